"""``mg.watchdog``: a block of one process that reports when its work stops making progress.

Progress is a heartbeat (``mg.beat``, which the Trainer and the logistic-regression fits give
at every step) or anything else mgkit records in the ledger (a transfer, a split, a step). A
thread checks the time since the last one; past ``stall_after`` seconds it warns once (until
progress resumes) with the stack of the thread that opened the block, so a hang, such as two
collective programs deadlocked on simulated CPU devices, becomes a readable report.
"""

from __future__ import annotations

import _thread
import sys
import threading
import time
import traceback
import warnings
from typing import Any

from . import _beat
from ._ledger import KERNEL, Event, Kind, execution_label, ledger
from ._numbers import real


class StallWarning(RuntimeWarning):
    """A watched block made no progress for ``stall_after`` seconds."""


class watchdog:  # noqa: N801 - used like a function: `with mg.watchdog(stall_after=30):`
    """Warns with the stack of the watched thread when its work stops making progress.

    Args:
      stall_after: seconds without progress (``mg.beat`` or a ledger event) that make a stall.
      on_stall: ``'warn'``: a ``StallWarning`` with the stack (once per stall); ``'interrupt'``:
        the same, then KeyboardInterrupt in the watched thread (when it is the main thread and
        runs Python code).

    Attributes:
      stalls: one report (text) per stall seen, newest last.

    >>> import mgkit as mg
    >>> with mg.watchdog(stall_after=30) as dog:
    ...     for step in range(3):
    ...         mg.beat(step)
    >>> dog.stalls
    []
    """

    def __init__(self, stall_after: float = 30.0, *, on_stall: str = "warn"):
        self.stall_after = real(stall_after, "stall_after", "mg.watchdog", lo=0, example=30)
        if self.stall_after <= 0:
            raise ValueError(f"mg.watchdog: stall_after must be above 0 seconds, got {stall_after}")
        if on_stall not in ("warn", "interrupt"):
            raise ValueError(f"mg.watchdog: on_stall must be 'warn' or 'interrupt', got {on_stall!r}")
        self.on_stall = on_stall
        self.stalls: list[str] = []
        self._last = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._undo: list = []

    def _progress(self, *_: Any) -> None:
        self._last = time.perf_counter()

    def _event(self, event: Event) -> None:
        if event.kind != "stall":
            self._last = time.perf_counter()

    def __enter__(self) -> watchdog:
        if self._thread is not None:
            raise RuntimeError("mg.watchdog: this watchdog is already watching; make a new one per block")
        self._watched = threading.get_ident()
        self._main = threading.current_thread() is threading.main_thread()
        self._label = execution_label()
        self._last = time.perf_counter()
        self._stop.clear()
        self._undo = [_beat.add_watcher(self._progress), ledger().subscribe(self._event)]
        self._thread = threading.Thread(target=self._watch, name="mgkit-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for undo in self._undo:
            undo()
        self._undo = []
        if self._thread is not None:
            self._thread.join()
        self._thread = None

    def _watch(self) -> None:
        every = min(1.0, self.stall_after / 10)
        warned_for = None
        while not self._stop.wait(every):
            last = self._last
            silent = time.perf_counter() - last
            if silent <= self.stall_after or warned_for == last:
                continue
            warned_for = last
            self._report(silent)

    def _report(self, silent: float) -> None:
        frame = sys._current_frames().get(self._watched)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(the thread has ended)\n"
        step = _beat.last_step()
        text = (
            f"mg.watchdog: no progress for {silent:.1f} s (stall_after={self.stall_after:g} s; last "
            f"step {step}). The watched thread is here:\n{stack}"
            "If it waits inside a JAX program on simulated CPU devices, two programs with collectives "
            "may be in flight at once: wait for each step's result (float(loss)) before the next."
        )
        self.stalls.append(text)
        now = time.time()
        ledger().record(
            Event(
                Kind.STALL,
                KERNEL,
                KERNEL,
                "host",
                "host",
                0,
                now - silent,
                silent,
                self._label,
                {"step": step},
            )
        )
        warnings.warn(text, StallWarning, stacklevel=1)
        if self.on_stall == "interrupt" and self._main:
            _thread.interrupt_main()
