"""Heartbeats: ``mg.beat(step)``, cheap enough for every step.

In a rank started by ``mg.launch`` a beat reaches the kernel over the rank's private pipe, at
most every ``SEND_EVERY`` seconds (a flusher thread sends the last one of a burst), with the
slowest step seen so far; the kernel's watchdog learns from that how long a silence means a
stall. In any other process a beat feeds the ``mg.watchdog`` blocks that are open, if any.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from ._numbers import whole

SEND_EVERY = 0.05  # seconds between two heartbeat messages of a rank


class _Beats:
    """The process's heartbeat state (one per process; only the thread that steps writes it)."""

    __slots__ = ("channel", "count", "last", "pending", "sent", "slowest", "step", "watchers")

    def __init__(self) -> None:
        self.channel = None  # a _wire.Channel in a launched rank
        self.count = 0  # beats so far
        self.step = 0  # the last step reported
        self.last = 0.0  # perf_counter() of the last beat
        self.slowest = 0.0  # the slowest step seen, from the second beat on (no compilation)
        self.sent = 0.0  # perf_counter() of the last message sent
        self.pending = False  # a beat not sent yet
        self.watchers: tuple[Callable[[int, float], None], ...] = ()


_beats = _Beats()


def beat(step: int | None = None) -> None:
    """Tells the watchdog this process finished a step (``mg.Trainer`` calls it at every step).

    Costs well under a microsecond when nothing listens, and a few when a launched rank
    reports to its kernel (one small pipe message every 50 ms at most).

    Args:
      step: the step just completed, a whole number from 0 (default: one more than the last beat).

    >>> import mgkit as mg
    >>> for step in range(1, 4):
    ...     mg.beat(step)
    """
    b = _beats
    t = time.perf_counter()
    if step is None:
        step = b.step + 1
    elif type(step) is not int or step < 0:
        step = whole(step, "step", "mg.beat", lo=0, example=12, note="the step just completed")
    if b.count:
        interval = t - b.last
        if interval > b.slowest:
            b.slowest = interval
    b.count += 1
    b.last = t
    b.step = step
    for watcher in b.watchers:
        watcher(step, t)
    if b.channel is not None:
        if t - b.sent >= SEND_EVERY:
            _send(b, t)
        else:
            b.pending = True


def _send(b: _Beats, t: float) -> None:
    b.sent = t
    b.pending = False
    try:
        b.channel.send(("beat", b.step, time.time(), b.slowest))
    except OSError:  # the kernel is gone: the lifeline thread ends this process
        b.channel = None


def attach(channel) -> None:
    """Makes this process a launched rank: beats go to the kernel through ``channel``."""
    _beats.channel = channel
    threading.Thread(target=_flush, name="mgkit-beats", daemon=True).start()


def _flush() -> None:
    b = _beats
    while b.channel is not None:
        time.sleep(SEND_EVERY * 2)
        if b.pending:
            _send(b, time.perf_counter())


def add_watcher(watcher: Callable[[int, float], None]) -> Callable[[], None]:
    """Calls ``watcher(step, perf_counter)`` at every beat until the returned function is called."""
    _beats.watchers = (*_beats.watchers, watcher)

    def remove() -> None:
        _beats.watchers = tuple(w for w in _beats.watchers if w is not watcher)

    return remove


def last_step() -> int:
    """The step of the last beat in this process (0 before any)."""
    return _beats.step


class LastBeat(NamedTuple):
    """This process's heartbeats so far (``last_beat()``)."""

    count: int  # beats so far (0: none yet)
    step: int  # the step of the last one
    wall: float  # time.time() of the last one (0.0 before any)


def last_beat() -> LastBeat:
    """How many beats this process made, the last one's step and its wall time (a cluster's rank
    sends them to the kernel with its ledger entries)."""
    b = _beats
    count, step, last = b.count, b.step, b.last
    wall = time.time() - (time.perf_counter() - last) if count else 0.0
    return LastBeat(count, step, wall)
