"""What the kernel knows of each rank, from its messages and output (no process in here).

``RankState.hear`` takes one message or output line of a rank and updates what is known: that its
stack handler is in place, when it became ready, its heartbeats, and its last word (a value, an
error, or a value that cannot be sent). ``RankState.info`` is the rank's public ``RankInfo``. Once
mgkit stops a rank (``stopping``), a late ``Ready`` or heartbeat no longer changes its state.
"""

from __future__ import annotations

from collections import deque

from ._result import RankInfo
from ._wire import Beat, Error, Line, Message, Ready, Result, Started, Unsendable

ERR_TAIL = 200  # stderr lines kept per rank, where JAX names the peers it gave up on


class RankState:
    """One rank as the kernel sees it: its ``RankInfo``, and the facts the watchdog and the
    blame read (times are ``time.perf_counter()``)."""

    def __init__(self, info: RankInfo, spawned: float):
        self.rank = info.rank
        self.info = info
        self.spawned = spawned  # when its process was started
        self.started = False  # its stack handler is in place (SIGUSR1 is safe)
        self.ready_at: float | None = None  # when it said it was ready
        self.last_beat: float | None = None  # when its last heartbeat came
        self.beats = 0  # heartbeat messages so far
        self.slowest = 0.0  # the slowest step it reported (0 before its second beat)
        self.first_step: float | None = None  # from ready to its first heartbeat (compiling)
        self.stalled = False  # silent past its limit, and not heard from since
        self.exited = False  # its exit was seen and classified
        self.stopping = False  # mgkit is stopping it: what it says from now on keeps its state
        self.result: bytes | None = None  # its pickled value
        self.error: Error | None = None  # what it raised
        self.unsendable: Unsendable | None = None  # the value it could not send
        self.err_tail: deque[str] = deque(maxlen=ERR_TAIL)

    def hear(self, what: Message | Line, now: float) -> None:
        """Takes in a message or an output line of this rank, heard at ``now``."""
        info = self.info
        match what:
            case Line(stream, text):
                info.tail.append(text)
                if stream == "err":
                    self.err_tail.append(text)
            case Started():
                self.started = True
            case Ready(devices):
                self.ready_at = now
                info.devices = tuple(devices)
                info.ready_seconds = now - self.spawned
                if not self.stopping:
                    info.state = "running"
            case Beat(step, wall, slowest):
                if self.beats == 0 and self.ready_at is not None:
                    self.first_step = now - self.ready_at
                self.beats += 1
                self.last_beat, self.slowest = now, slowest
                info.step, info.beat_at = step, wall
                if self.stalled and not self.stopping:
                    self.stalled = False
                    info.state = "running"
            case Result(value):
                self.result = value
            case Error():
                self.error = what
            case Unsendable():
                self.unsendable = what

    def doing(self, now: float) -> str:
        """What the rank is doing at ``now``, in words: ``running, last completed step 5 (0.2 s ago)``."""
        info = self.info
        if self.ready_at is None:
            where = "its interpreter" if not self.started else "JAX"
            return f"still starting {where}, {now - self.spawned:.1f} s after it was started"
        state = "stalled" if self.stalled else "running"
        if info.step is None or self.last_beat is None:
            return f"{state}, no step completed yet ({now - self.ready_at:.1f} s after it was ready)"
        return f"{state}, last completed step {info.step} ({now - self.last_beat:.1f} s ago)"

    def said_nothing(self) -> bool:
        """It sent neither a value nor an error (a death without a word: killed, or crashed)."""
        return self.result is None and self.error is None
