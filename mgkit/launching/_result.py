"""What a launch gives back: ``LaunchResult`` (values, per-rank wall time and exit status),
``LaunchError`` (the root cause, with the rest of the group's fate) and ``RankInfo`` (one rank)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

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
