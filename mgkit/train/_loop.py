"""What every training loop shares: Ctrl-C noted and acted on at a step boundary, and the
progress bar."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any


class Interrupts:
    """Ctrl-C (the notebook's Stop button) during a fit: noted, so the loop stops at the next
    step boundary with the state of the last completed step, never between a step's dispatch
    and its result being kept (the step donates the old parameters). Off the main thread,
    where no handler can be set, Ctrl-C is left to Python."""

    def __init__(self) -> None:
        self.requested = False
        self._old: Any = None

    def _note(self, signum: int, frame: Any) -> None:
        self.requested = True

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._note)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


class Bar:
    """A fit's progress bar: after a second of work (``progress`` None), at once (True) or
    never (False); updated at most ten times a second. ``postfix()`` says what the bar shows
    beside the count (made only when the bar is drawn)."""

    def __init__(self, what: str, total: int | None, progress: bool | None, start: float | None = None):
        self.what, self.total, self.bar = what, total, None
        start = time.perf_counter() if start is None else start
        self.show_at = None if progress is False else start + (0.0 if progress else 1.0)
        self._next = 0.0

    def tick(self, n: int, postfix: Callable[[], str]) -> None:
        if self.show_at is None:
            return
        now = time.perf_counter()
        if now < self._next or now < self.show_at:
            return
        self._next = now + 0.1
        if self.bar is None:
            from tqdm.auto import tqdm  # a widget in notebooks, text elsewhere

            self.bar = tqdm(total=self.total, desc=self.what, unit="step", leave=True)
        self.bar.n = n
        self.bar.set_postfix_str(postfix(), refresh=False)
        self.bar.refresh()

    def close(self, n: int, postfix: Callable[[], str]) -> None:
        if self.bar is not None:
            self.bar.n = n
            self.bar.set_postfix_str(postfix(), refresh=False)
            self.bar.close()
            self.bar = None
