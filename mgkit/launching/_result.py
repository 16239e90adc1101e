"""What a launch gives back: ``LaunchResult`` (values, per-rank wall time and exit status),
``LaunchError`` (the root cause, with the rest of the group's fate), ``RankInfo`` (one rank), and
``Failure`` (the facts of the failure that ends a launch, from which its error is written)."""

from __future__ import annotations

import pickle
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

from .._table import Table

TAIL = 20  # output lines kept per rank for the view and the error


class LaunchError(RuntimeError):
    """A launched rank failed (raised, exited, died, stalled or ran out of time).

    Attributes:
      kind: ``raised``, ``exited``, ``signal``, ``unsendable``, ``stalled``, ``timeout`` or ``start``.
      rank, pid: the root cause's rank and process id (None for a timeout of the whole group).
      exception: the rank's exception when it could be sent back, else None.
      exception_type: its type's name, as text.
      traceback: the rank's traceback, as text ("" when it did not raise).
      values: each rank's value, None where a rank did not finish; ``done`` lists those that did.
      ranks: every rank's final ``RankInfo``.
      stacks: each live rank's Python stacks at a stall or timeout (rank -> text).
    """

    def __init__(self, message: str, **facts: Any):
        super().__init__(message)
        self.kind: str = facts.get("kind", "")
        self.rank: int | None = facts.get("rank")
        self.pid: int | None = facts.get("pid")
        self.exception: BaseException | None = facts.get("exception")
        self.exception_type: str = facts.get("exception_type", "")
        self.traceback: str = facts.get("traceback", "")
        self.values: list = facts.get("values", [])
        self.done: list[int] = facts.get("done", [])
        self.ranks: tuple[RankInfo, ...] = facts.get("ranks", ())
        self.stacks: dict[int, str] = facts.get("stacks", {})


@dataclass
class RankInfo:
    """One rank of a launch: what it runs on and how it is doing (``state``: starting, ready,
    running, done, failed, aborted, terminated or stalled)."""

    rank: int
    pid: int
    devices: tuple[str, ...]
    state: str = "starting"
    step: int | None = None  # the last step it reported with mg.beat
    beat_at: float | None = None  # time.time() of its last heartbeat
    started: float = 0.0  # time.time() when it was started
    ready_seconds: float | None = None  # from start to ready
    seconds: float | None = None  # wall time, start to exit
    exit_code: int | None = None
    reason: str = ""  # why it failed, in words
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL))

    def status(self, now: float | None = None) -> str:
        if self.state == "running" and self.step is not None:
            return f"running step {self.step}"
        return self.state

    def beat_age(self, now: float | None = None) -> float | None:
        return None if self.beat_at is None else (now or time.time()) - self.beat_at

    def beat_text(self, now: float | None = None) -> str:
        """Its last heartbeat, ``0.3 s ago, step 120`` at ``now`` (default: now); "" before any."""
        age = self.beat_age(now)
        if age is None:
            return ""
        step = "" if self.step is None else f", step {self.step}"
        return f"{max(age, 0.0):.1f} s ago{step}"


class LaunchResult(Table):
    """What ``mg.launch`` returns: ``values`` (one per rank), ``seconds`` (each rank's wall time),
    ``exit_codes`` and ``ranks`` (each rank's ``RankInfo``). Prints as a table."""

    headers = ("rank", "pid", "devices", "state", "ready s", "wall s", "exit")

    def __init__(self, values: list, ranks: tuple[RankInfo, ...], seconds: float):
        self.values = values
        self.ranks = ranks
        self.seconds = [r.seconds for r in ranks]
        self.exit_codes = [r.exit_code for r in ranks]
        self.wall = seconds
        super().__init__(
            [rank_row(r) for r in ranks],
            title=f"mg.launch: {len(ranks)} rank(s) done in {seconds:.2f} s",
        )

    def __getitem__(self, rank: int) -> Any:
        return self.values[rank]

    def __iter__(self):
        return iter(self.values)


def rank_row(r: RankInfo) -> tuple:
    return (
        r.rank,
        r.pid,
        ",".join(r.devices) or "?",
        r.status(),
        "" if r.ready_seconds is None else round(r.ready_seconds, 2),
        "" if r.seconds is None else round(r.seconds, 2),
        "" if r.exit_code is None else r.exit_code,
    )


class Failure(NamedTuple):
    """What ended a launch, as its ``LaunchError`` reports it."""

    kind: str  # raised, exited, signal, unsendable, stalled or timeout (LaunchError.kind)
    reason: str  # what the root-cause rank did, in words ("raised ValueError: bad row")
    exception_type: str = ""  # the exception's type name, when it raised
    traceback: str = ""  # its traceback text, when it raised
    exception: BaseException | None = None  # the exception itself, when it could be sent back
    stacks: Mapping[int, str] = MappingProxyType({})  # rank -> its Python stacks (stall, timeout)


def launch_error(
    head: str, failure: Failure, ranks: Sequence[RankInfo], root: int | None, results: Sequence[bytes | None]
) -> LaunchError:
    """The error that ends a launch: ``head``, then every rank's fate, then the root-cause rank's
    traceback (or its last output) and the stacks taken.

    Args:
      head: the first line, naming the root cause.
      failure: its facts.
      ranks: every rank's final ``RankInfo``, in rank order.
      root: the root-cause rank (None for a timeout of the whole group).
      results: each rank's pickled value, None where it did not finish.
    """
    values = [None if blob is None else load_value(blob, rank) for rank, blob in enumerate(results)]
    done = [rank for rank, blob in enumerate(results) if blob is not None]
    lines = [head, "", "ranks:"]
    for info in ranks:
        what = info.reason if info.reason and info.rank != root else info.status()
        lines.append(f"  rank {info.rank} (pid {info.pid}, {','.join(info.devices)}): {what}")
    if done:
        lines.append(f"finished ranks' values are kept in this error's .values (ranks {done})")
    if failure.traceback:
        lines += ["", f"traceback from rank {root}:", failure.traceback.rstrip()]
    elif root is not None and ranks[root].tail:
        lines += ["", f"last output of rank {root}:", *ranks[root].tail]
    if failure.stacks:
        lines += ["", steps_text(ranks), stacks_text(failure.stacks)]
    return LaunchError(
        "\n".join(lines),
        kind=failure.kind,
        rank=root,
        pid=None if root is None else ranks[root].pid,
        exception=failure.exception,
        exception_type=failure.exception_type,
        traceback=failure.traceback,
        values=values,
        done=done,
        ranks=tuple(ranks),
        stacks=dict(failure.stacks),
    )


def steps_text(ranks: Sequence[RankInfo]) -> str:
    """``last completed steps: rank 0: step 5, rank 1: no step``."""
    parts = [f"rank {r.rank}: {'no step' if r.step is None else f'step {r.step}'}" for r in ranks]
    return "last completed steps: " + ", ".join(parts)


def stacks_text(stacks: Mapping[int, str]) -> str:
    """Each rank's Python stacks under a heading, in rank order."""
    return "\n\n".join(f"Python stacks of rank {rank}:\n{text}" for rank, text in sorted(stacks.items()))


def load_value(blob: bytes, rank: int) -> Any:
    """A rank's value, unpickled in the kernel; a LaunchError (``unsendable``) when it cannot be."""
    try:
        return pickle.loads(blob)
    except Exception as exc:
        raise LaunchError(
            f"rank {rank}'s value came back but cannot be unpickled in the kernel "
            f"({type(exc).__name__}: {exc}); return types the kernel can import (plain data, numpy arrays)",
            kind="unsendable",
            rank=rank,
        ) from exc
