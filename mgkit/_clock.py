"""When work ran on each device: the start and end of each compiled call, without waiting for it.

A device runs the calls dispatched to it one after another, in the order they were dispatched.
One watcher thread per device waits for the outputs of each call handed to it, in that order,
and notes when each was seen done. A call began when it was dispatched, when the call before
it on the same device ended, or when the last of its inputs from elsewhere arrived, whichever
came last (``Timing.start``). Timelines of a step (``Pipeline.schedule``, ``Ensemble.schedule``)
are drawn from these times; the caller never blocks on them.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax


class Timing:
    """One call on one device: when it was dispatched, began and ended (``time.perf_counter``)."""

    __slots__ = ("_after", "_done", "_floor", "_start", "dispatched", "ended", "failure")

    def __init__(self, dispatched: float, after: Sequence[Timing]):
        self.dispatched = dispatched
        self.ended: float | None = None
        self.failure: BaseException | None = None
        self._after = tuple(after)
        self._floor = dispatched  # the previous call's end on the device, once seen
        self._start: float | None = None
        self._done = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until the call was seen done; False on timeout."""
        return self._done.wait(timeout)

    @property
    def start(self) -> float:
        """When the call began on its device (waits until it, and what it waited for, were seen done)."""
        if self._start is None:
            self._done.wait()
            start = self._floor
            for other in self._after:
                other.wait()
                if other.ended is not None:
                    start = max(start, other.ended)
            self._after = ()
            self._start = min(start, self.ended) if self.ended is not None else start
        return self._start

    @property
    def seconds(self) -> float:
        """How long the call ran on its device."""
        start = self.start
        return max((self.ended or start) - start, 0.0)


class _Watcher:
    """The thread that watches one device's calls in order."""

    def __init__(self, device: Any):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0
        self.idle = threading.Condition()
        self.last = 0.0  # when the last call was seen done
        self.thread = threading.Thread(target=self._run, name=f"mgkit-clock-{device}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            timing, arrays = self.jobs.get()
            timing._floor = max(timing.dispatched, self.last)
            try:
                jax.block_until_ready(arrays)
            except BaseException as e:  # noqa: BLE001 - kept for the reader
                timing.failure = e
            timing.ended = self.last = max(time.perf_counter(), timing._floor)
            timing._done.set()
            arrays = timing = None  # hold no outputs between calls
            with self.idle:
                self.pending -= 1
                if self.pending == 0:
                    self.idle.notify_all()


_watchers: dict[Any, _Watcher] = {}
_lock = threading.Lock()


def watch(device: Any, outputs: Any, dispatched: float, after: Sequence[Timing] = ()) -> Timing:
    """Notes when the call that makes ``outputs`` (any pytree of arrays) on ``device`` ends;
    ``dispatched``: when it was dispatched; ``after``: the calls (on other devices) whose
    outputs it takes."""
    with _lock:
        watcher = _watchers.get(device)
        if watcher is None or not watcher.thread.is_alive():
            watcher = _watchers[device] = _Watcher(device)
    timing = Timing(dispatched, after)
    with watcher.idle:
        watcher.pending += 1
    watcher.jobs.put((timing, jax.tree_util.tree_leaves(outputs)))
    return timing


@atexit.register
def _drain() -> None:
    """At exit, waits (a minute at most) for calls still watched: a thread stopped inside a wait
    aborts the process."""
    for watcher in list(_watchers.values()):
        with watcher.idle:
            watcher.idle.wait_for(lambda w=watcher: w.pending == 0, 60)
