"""Live views: a bounded feed from the ledger, and one background thread that refreshes them all.

A view has the ledger append what it records to a bounded deque (``Ledger.attach``: one
append per call), so the thread that records an event (the compute path) never waits on the
UI; the view makes and filters the events when it drains them. One
daemon thread, shared by every live view, calls each view at most ``rate`` times a second to
set widget values; it holds views weakly, so a view nobody references any more stops
refreshing and is collected. Widgets are displayed from the main thread only; this thread
just sets values, which ipywidgets sends to the browser even while a cell runs.

Pictures redraw at most PICTURE_RATE times a second, and within a time budget: a redraw that
took ``c`` seconds is followed by none for ``c / DRAW_SHARE`` seconds, so each picture takes at
most ~0.3 % of the wall time. Text values follow at the view's full rate. The thread as a whole
keeps to a budget too: after a round of refreshes that used ``c`` seconds of its CPU time it
sleeps at least ``c / THREAD_SHARE`` seconds, so however many events arrive and however many
views there are, it takes at most ~1 % of a core (and of the GIL) from the work it watches;
under a heavy stream of events the views refresh less often, never the work more slowly. Costs
are the thread's own CPU time (``time.thread_time``), not wall time: on a busy machine a round
that waited for a core or for the GIL is not charged for the wait; and where the process gets
less than a core (a machine busy with other work), the budget is that share of what it gets.
"""

from __future__ import annotations

import bisect
import collections
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .._ledger import Event, Ledger, events_of, ledger
from .._numbers import real, whole

log = logging.getLogger("mgkit")

MAX_RATE = 10.0  # refreshes per second, at most
BUFFER = 10_000  # events a view holds between two refreshes, at most
DRAW_SHARE = 0.003  # share of the wall time each picture may take to draw
PICTURE_RATE = 4.0  # picture redraws per second, at most
TICK = 0.05  # seconds between the refresh thread's looks at its views
THREAD_SHARE = 0.01  # share of a core (or of the process's CPU) the refresh thread may take
MIN_CORES = 0.1  # below this share of a core the process gets, the budget stops shrinking


def check_count(value: Any, name: str, where: str, lo: int, hi: int, example: int) -> int:
    """``value`` as an int in ``lo..hi``, else a clear TypeError / ValueError."""
    return whole(value, name, where, lo=lo, hi=hi, example=example)


def check_rate(rate: Any, where: str) -> float:
    """Refreshes per second: a real number above 0 and at most MAX_RATE."""
    note = f"refreshes per second; the UI updates at most ~{MAX_RATE:g} times a second"
    return real(rate, "rate", where, lo=0, above=True, hi=MAX_RATE, example=2, note=note)


def check_ledger(value: Any, where: str) -> Ledger:
    if value is None:
        return ledger()
    if not isinstance(value, Ledger):
        raise TypeError(
            f"{where}: ledger must be an mg.Ledger (or None for mg.ledger()), got {type(value).__name__} "
            f"{value!r}"
        )
    return value


def in_kernel() -> bool:
    """True inside a Jupyter kernel: an IPython shell with a kernel (IPython is not imported here)."""
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    shell = get_ipython() if get_ipython is not None else None
    return getattr(shell, "kernel", None) is not None


class Feed:
    """A bounded buffer of ledger events of some kinds, filled on the recording thread.

    The ledger appends each entry as it is recorded (``Ledger.attach``): one ``deque.append``
    per call, never blocking; the events are made and filtered by kind when the view drains
    them. When more than ``size`` entries arrive between two drains the oldest are dropped.
    """

    def __init__(self, led: Ledger, kinds: frozenset[str], exclude: bool, size: int = BUFFER):
        self.buffer: collections.deque = collections.deque(maxlen=size)
        self.kinds, self.exclude = kinds, exclude
        self._detach = led.attach(self.buffer)

    def __len__(self) -> int:
        return len(self.buffer)

    def drain(self) -> list[Event]:
        """Takes every buffered event of the feed's kinds, oldest first (entries appended
        meanwhile stay for next time)."""
        pop = self.buffer.popleft
        events = events_of([pop() for _ in range(len(self.buffer))])
        kinds, exclude = self.kinds, self.exclude
        return [e for e in events if (e.kind in kinds) != exclude]

    def skip(self) -> int:
        """Drops the buffered entries without making their events (a view that only needs to
        know that the ledger recorded something); returns how many there were."""
        n = len(self.buffer)
        for _ in range(n):
            self.buffer.popleft()
        return n

    def close(self) -> None:
        self._detach()


class Throttled:
    """A costly reading (``fn()``) that live views share: taken again at most once per
    ``period`` seconds (or ``age``, where a caller asks for fresher values), and after a reading
    that used ``c`` seconds of CPU time not before ``c / share`` seconds, so it takes at most
    ``share`` of a core however often it is asked for; in between, the last value."""

    def __init__(self, fn: Callable[[], Any], period: float, share: float):
        self.fn, self.period, self.share = fn, period, share
        self._lock = threading.Lock()
        self._value: Any = None
        self._taken = 0.0  # when the last reading was taken (time.monotonic)
        self._next = 0.0  # the budget's earliest time for the next reading
        self.readings = 0
        self.busy = 0.0  # CPU seconds the readings took, in all

    def __call__(self, fresh: bool = False, age: float | None = None) -> Any:
        """The value: a new reading when ``fresh`` or when one is due (older than ``age``,
        default ``period``, and the budget allows), else the last one."""
        with self._lock:
            now = time.monotonic()
            due = now >= self._taken + (self.period if age is None else age) and now >= self._next
            if fresh or self.readings == 0 or due:
                t0 = time.thread_time()
                self._value = self.fn()
                cost = time.thread_time() - t0
                self._taken, self._next = now, now + cost / self.share
                self.readings += 1
                self.busy += cost
            return self._value

    @property
    def taken(self) -> float:
        """When the value was read (``time.monotonic``; 0 before the first reading)."""
        return self._taken


class CompileClock:
    """The compilations JAX reports (``jax.monitoring``: tracing, lowering, compiling), so a view
    can take them out of the time of the call they happened in.

    It listens from the first ``listen()`` on, for the rest of the process (one listener, a
    bounded record of the newest spans); the listener does one string test and one append.
    """

    def __init__(self, size: int = 4096):
        self._spans: collections.deque[tuple[float, float]] = collections.deque(maxlen=size)
        self._lock = threading.Lock()
        self.listening = False

    def listen(self) -> None:
        """Starts recording compilations (once; later calls do nothing)."""
        with self._lock:
            if self.listening:
                return
            import jax.monitoring

            jax.monitoring.register_event_duration_secs_listener(self._heard)
            self.listening = True

    def _heard(self, event: str, duration: float, **kwargs: Any) -> None:
        if event.startswith("/jax/core/compile/"):
            self._spans.append((time.time(), duration))

    def spans(self) -> list[tuple[float, float]]:
        """(wall time it ended, seconds) of each compilation recorded, oldest first."""
        while True:
            try:
                return list(self._spans)
            except RuntimeError:  # appended to while copied: copy again
                continue

    @staticmethod
    def within(spans: list[tuple[float, float]], ends: list[float], start: float, end: float) -> float:
        """Seconds of the compilations in ``spans`` (``ends`` their end times) that ended between
        ``start`` and ``end`` (wall times)."""
        lo = bisect.bisect_left(ends, start)
        hi = bisect.bisect_right(ends, end, lo)
        return sum(seconds for _, seconds in spans[lo:hi])


COMPILES = CompileClock()


class Refresher:
    """One daemon thread that ticks every live view; views are held weakly."""

    def __init__(self, period: float = TICK, share: float = THREAD_SHARE):
        self.period = period
        self.share = share
        self.busy = 0.0  # seconds spent refreshing, in all
        self._views: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, view: Any) -> None:
        with self._lock:
            self._views.add(view)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mgkit-views", daemon=True)
                self._thread.start()

    def discard(self, view: Any) -> None:
        with self._lock:
            self._views.discard(view)

    def __len__(self) -> int:
        with self._lock:
            return len(self._views)

    @property
    def running(self) -> bool:
        with self._lock:
            return self._thread is not None

    def tick(self, now: float | None = None) -> int:
        """Refreshes every view that is due; returns how many changed. A view that raises is
        logged (once) and the others go on."""
        now = time.monotonic() if now is None else now
        with self._lock:
            views = list(self._views)
        changed = 0
        for view in views:
            try:
                changed += bool(view._tick(now))
            except Exception:
                view.errors += 1
                if view.errors == 1:
                    log.exception(
                        "mgkit: refreshing %s failed; it keeps its last values", type(view).__name__
                    )
        del views  # hold no view between ticks: views are collected when nobody else holds them
        return changed

    def _run(self) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        while True:
            with self._lock:
                if not self._views:
                    self._thread = None
                    return
            t0 = time.thread_time()
            try:
                self.tick()
            except Exception:  # noqa: BLE001  # pragma: no cover - interpreter shutdown
                return
            cost = time.thread_time() - t0
            self.busy += cost
            time.sleep(self.pause(cost, time.perf_counter() - wall, time.process_time() - cpu))
            wall, cpu = time.perf_counter(), time.process_time()

    def pause(self, cost: float, wall: float, cpu: float) -> float:
        """Seconds to sleep after a round that used ``cost`` seconds of the thread's CPU time,
        when the process used ``cpu`` seconds of CPU time over the last ``wall`` seconds: the
        round's cost over the budget, a share of one core, or of the cores the process got when
        that was less than one (a machine busy with other work gives it less: the views then
        take a share of what the work gets, not of a core it never had)."""
        cores = min(max(cpu / wall if wall > 0 else 1.0, MIN_CORES), 1.0)
        return max(self.period, cost / (self.share * cores))


REFRESHER = Refresher()
