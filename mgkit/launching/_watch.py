"""The launch's watchdog: which running ranks have been silent (no heartbeat) past their limit.

The limit is ``stall_after`` when given, else learned from a rank's own steps: ``STALL_FACTOR``
times the slowest step seen, never below ``STALL_FLOOR``, and none before its first step (which
compiles). In a distributed launch it is never above the collectives' timeout plus a margin:
XLA's own error for a collective that timed out says more, and comes first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from ._ranks import RankState

STALL_FLOOR = 10.0  # a learned stall limit is never below this many seconds
STALL_FACTOR = 5.0  # ... and otherwise this many times the slowest step seen
COLLECTIVES_MARGIN = 5.0  # seconds past the collectives' timeout before the watchdog steps in


class Silence(NamedTuple):
    """A running rank silent past its limit."""

    rank: int  # the rank
    silent: float  # seconds since its last heartbeat (or since it was ready)
    limit: float  # the limit it passed, in seconds


def stall_limit(r: RankState, stall_after: float | None, collectives: float | None) -> float | None:
    """Seconds of silence after which rank ``r`` has stalled (None: no limit yet).

    Args:
      r: the rank.
      stall_after: the launch's ``stall_after`` (None: learn it from the steps).
      collectives: the collectives' timeout of a distributed launch, in seconds (None otherwise).
    """
    limit = stall_after
    if limit is None and r.beats:
        seen = r.slowest if r.beats >= 2 and r.slowest > 0 else (r.first_step or 0.0)
        limit = max(STALL_FLOOR, STALL_FACTOR * seen)
    if collectives is not None:
        ceiling = collectives + COLLECTIVES_MARGIN
        if limit is None or ceiling < limit:
            limit = ceiling
    return limit


def silences(
    ranks: Iterable[RankState], now: float, stall_after: float | None, collectives: float | None
) -> list[Silence]:
    """The ranks running at ``now`` (ready, not exited, not already stalled) that are silent past
    their limit, in rank order."""
    found = []
    for r in ranks:
        if r.exited or r.ready_at is None or r.stalled:
            continue
        limit = stall_limit(r, stall_after, collectives)
        if limit is None:
            continue
        silent = now - (r.last_beat or r.ready_at)
        if silent > limit:
            found.append(Silence(r.rank, silent, limit))
    return found
