"""The cluster's watchdog and its stacks on demand, on ``mg.launch``'s own rules.

While a call runs, each rank's heartbeats (``mg.beat``; the Trainer beats every step) come with
its streamed batches. ``Watch`` keeps, per rank, the facts launching's watchdog reads (its
``silences``: the stall limit given, or learned from the rank's slowest step) and says which
ranks are silent past their limit. ``stacks`` asks every rank for its Python stacks:
faulthandler writes them on SIGUSR1 into a file of the rank's (``_rank.setup``), even while
its main thread sits in a collective, and the rank's watcher thread publishes what it wrote.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ..launching import RankInfo, Silence, silences

STACKS = "mgkit-stacks-"  # what a rank publishes its stacks under: mgkit-stacks-<rank>-<seq>
STACK_WAIT = 2.0  # seconds to wait for the ranks' stacks


class _Rank:
    """One rank as launching's watchdog reads it (``silences``), from its ``RankInfo``'s beats
    (times are ``time.perf_counter()``)."""

    def __init__(self, rank: int, began: float):
        self.rank = rank
        self.exited = False
        self.ready_at: float | None = began  # the call's start: silence before a first beat is not counted
        self.stalled = False  # reported; a new beat clears it
        self.beats = 0  # beats seen this call
        self.slowest = 0.0  # the slowest step between two beats seen this call, in seconds
        self.first_step: float | None = None  # from the call's start to its first beat
        self.last_beat: float | None = None
        self._seen: tuple[int | None, float | None] = (None, None)  # (step, wall) of the last beat
        self.fitting = False  # it runs a fit

    def begin(self, now: float) -> None:
        """A fit began at ``now``: what was learned of the last one is forgotten."""
        self.ready_at, self.beats, self.slowest, self.first_step = now, 0, 0.0, None
        self.last_beat, self.stalled = None, False

    def hear(self, info: RankInfo, offset: float) -> None:
        """Takes the rank's last beat (its ``RankInfo``: step and wall time, set by the streams);
        ``offset``: ``time.perf_counter() - time.time()``."""
        step, wall = info.step, info.beat_at
        if wall is None or (step, wall) == self._seen:
            return
        at = wall + offset
        before_step, before_wall = self._seen
        if self.beats == 0:
            self.first_step = max(at - (self.ready_at or at), 0.0)
        elif before_wall is not None and step is not None and before_step is not None and step > before_step:
            self.slowest = max(self.slowest, (wall - before_wall) / (step - before_step))
        self._seen = (step, wall)
        self.beats += 1
        self.last_beat, self.stalled = at, False


class Watch:
    """One call's watchdog: which running ranks are silent past their limit.

    Args:
      ranks: the cluster's ``RankInfo`` per rank.
      stall_after: seconds without a heartbeat that make a stall (None: learned per rank).
      collectives: the collectives' timeout of the jax.distributed group (None: no group).
    """

    def __init__(self, ranks: Sequence[RankInfo], stall_after: float | None, collectives: float | None):
        began = time.perf_counter()
        self.infos = ranks
        self.ranks = [_Rank(r.rank, began) for r in ranks]
        self.stall_after, self.collectives = stall_after, collectives

    def check(self, done: Sequence[bool], fitting: Sequence[bool]) -> list[Silence]:
        """The ranks in a fit (``fitting``: their loops beat every step) newly silent past their
        limit, each reported once until it beats again; ranks done or between fits are not."""
        now = time.perf_counter()
        offset = now - time.time()
        for r, info, finished, fits in zip(self.ranks, self.infos, done, fitting, strict=False):
            if fits and not r.fitting:  # a fit began: silence counts from its first beat on
                r.begin(now)
            r.fitting = fits
            r.hear(info, offset)
            r.exited = bool(finished) or not fits or not r.beats
        found = silences(self.ranks, time.perf_counter(), self.stall_after, self.collectives)
        for s in found:
            self.ranks[s.rank].stalled = True
        return found


def stacks(signal_ranks: Callable[[list[int]], None], engines: Any, ranks: int) -> dict[int, str]:
    """Every rank's Python stacks: SIGUSR1 to each (``signal_ranks``), then what they publish, for
    at most ``STACK_WAIT`` seconds; a rank that did not answer is said so."""
    engines.published(STACKS)  # anything an earlier ask left
    signal_ranks(list(range(ranks)))
    found: dict[int, str] = {}
    deadline = time.monotonic() + STACK_WAIT
    while len(found) < ranks and time.monotonic() < deadline:
        time.sleep(0.05)
        for key, text in engines.published(STACKS):
            rank = int(key[len(STACKS) :].split("-")[0])
            found[rank] = found.get(rank, "") + str(text)
    for rank in range(ranks):
        found.setdefault(rank, "(no answer: the process is stopped, gone, or its watcher thread is stuck)")
    return dict(sorted(found.items()))
