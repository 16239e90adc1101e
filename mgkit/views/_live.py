"""Live views: a bounded feed from the ledger, and one background thread that refreshes them all.

A view has the ledger append what it records to a bounded deque (``Ledger.attach``: one
append per call), so the thread that records an event (the compute path) never waits on the
UI; the view makes and filters the events when it drains them. One
daemon thread, shared by every live view, calls each view at most ``rate`` times a second to
set widget values; it holds views weakly, so a view nobody references any more stops
refreshing and is collected. Widgets are displayed from the main thread only; this thread
just sets values, which ipywidgets sends to the browser even while a cell runs.

Pictures redraw at most PICTURE_RATE times a second (a view's ``picture_rate``), and within a
time budget: a redraw that took ``c`` seconds is followed by none for ``c / DRAW_SHARE``
seconds, so each picture takes at most ~0.6 % of the wall time. Text values follow at the
view's full rate.

The thread as a whole keeps to a budget, ``THREAD_SHARE`` (2 %) of one core, held as credit
(``Budget``): earned with the wall time, up to ``BURST`` seconds of CPU saved, and spent by each
view's refresh. The thread looks at its views every ``TICK`` seconds (while the credit is spent,
every ``1 / MAX_RATE`` s at most); a view that is due refreshes only while there is credit (the
memory view still takes its samples, which are cheap, and charges them; while it is short, a
view with a picture waits until the picture may be redrawn too), and a dashboard serves first
the panel due longest. A feed makes only the events of its kinds (a step's collectives cost a
view of steps nothing), and a live refresh folds at most ``FOLD_CHUNK`` of the newest entries
of a heavy stream, shared between its sources (the older ones are skipped and counted; totals
come from the ledger's own), so no one refresh is costly and no view's work stops the others'
for long: however many events arrive and however many views there are, the views take at most
~2 % of a core (and of the GIL) from the work they watch, and under a heavy stream of events
they fold fewer of them, never the work more slowly. Costs are the thread's own CPU time
(``time.thread_time``), not wall time: on a busy machine a round that waited for a core or for
the GIL is not charged for the wait.
"""

from __future__ import annotations

import bisect
import collections
import logging
import math
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .._ledger import Call, Event, Layout, Ledger, ledger
from .._numbers import real, whole

log = logging.getLogger("mgkit")

MAX_RATE = 10.0  # refreshes per second, at most
BUFFER = 10_000  # events a view holds between two refreshes, at most
DRAW_SHARE = 0.006  # share of the wall time each picture may take to draw
PICTURE_RATE = 4.0  # picture redraws per second, at most
TICK = 0.05  # seconds between the refresh thread's looks at its views
THREAD_SHARE = 0.02  # share of one core the refresh thread may take
BURST = 0.02  # CPU seconds of the thread's budget saved up while its views have nothing to do
FOLD_CHUNK = 8  # entries of a heavy stream a budgeted refresh folds at most, the newest


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
    them (a call whose layout holds none of the feed's kinds is left out before its events are
    made). When more than ``size`` entries arrive between two drains the oldest are dropped.
    """

    def __init__(self, led: Ledger, kinds: frozenset[str], exclude: bool, size: int = BUFFER):
        self.buffer: collections.deque = collections.deque(maxlen=size)
        self.kinds, self.exclude = kinds, exclude
        self.skipped = 0  # entries of the feed's kinds left out by ``drain(limit)``, in all
        self._rows: dict[Layout, tuple[int, ...]] = {}  # per layout: the indexes of its events of our kinds
        self._detach = led.attach(self.buffer)

    def __len__(self) -> int:
        return len(self.buffer)

    def _wanted(self, layout: Layout) -> tuple[int, ...]:
        rows = self._rows.get(layout)
        if rows is None:
            if len(self._rows) >= 256:  # layouts are few and kept by their callers: this stays small
                self._rows.clear()
            rows = self._rows[layout] = layout.select(self.kinds, self.exclude)
        return rows

    def drain(self, limit: int | None = None) -> list[Event]:
        """Takes every buffered event of the feed's kinds, oldest first (entries appended
        meanwhile stay for next time); with ``limit``, those of the newest ``limit`` entries of
        its kinds only, shared between their sources (a call's layout, an event's context), the
        older ones skipped (counted in ``skipped``): a batch of one rank's steps, streamed, hides no other
        rank's. Of a call's events only those of the feed's kinds are made: a step's
        collectives cost a view of steps nothing."""
        pop = self.buffer.popleft
        kinds, exclude, wanted = self.kinds, self.exclude, self._wanted
        kept: list[tuple[Any, tuple[int, ...] | None]] = []
        for _ in range(len(self.buffer)):
            entry = pop()
            if type(entry) is Call:
                rows = wanted(entry.layout)
                if rows:
                    kept.append((entry, rows))
            elif (entry.kind in kinds) != exclude:
                kept.append((entry, None))
        if limit is not None and len(kept) > limit:
            kept = self._newest(kept, limit)
        out: list[Event] = []
        for entry, rows in kept:
            if rows is None:
                out.append(entry)
            else:
                out.extend(entry.events(rows))
        return out

    def _newest(self, kept: list[tuple[Any, tuple[int, ...] | None]], limit: int) -> list:
        """The newest of ``kept`` from each source, an equal share of ``limit`` each (one at
        least), oldest first; the rest counted as skipped."""
        keys = [id(entry.layout) if rows is not None else entry.src for entry, rows in kept]
        share = max(limit // len(set(keys)), 1)
        count: dict[Any, int] = {}
        out = []
        for key, item in zip(reversed(keys), reversed(kept), strict=True):
            seen = count.get(key, 0)
            if seen < share:
                count[key] = seen + 1
                out.append(item)
        self.skipped += len(kept) - len(out)
        out.reverse()
        return out

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


class Budget:
    """The views' thread's CPU budget, as credit: earned at ``share`` of one core for each
    second of wall time, at most ``burst`` seconds saved; spent by the views' refreshes.
    ``Budget.unlimited()``: a refresh by hand, never held back."""

    def __init__(self, share: float = THREAD_SHARE, burst: float = BURST):
        self.share, self.burst = share, burst
        self.credit = burst  # CPU seconds the views may still spend now
        self.spent = 0.0  # CPU seconds charged, in all

    @classmethod
    def unlimited(cls) -> Budget:
        return cls(share=math.inf, burst=math.inf)

    def earn(self, wall: float) -> None:
        """Adds the credit of ``wall`` seconds."""
        self.credit = min(self.credit + wall * self.share, self.burst)

    def allows(self) -> bool:
        """True while there is credit left."""
        return self.credit > 0.0

    def short(self) -> bool:
        """True while less than half of what may be saved up is left (the views are busy)."""
        return self.credit < self.burst / 2

    def charge(self, cost: float) -> None:
        """Takes ``cost`` CPU seconds off the credit (it may go below zero: the views then wait)."""
        self.credit -= cost
        self.spent += cost


class Refresher:
    """One daemon thread that ticks every live view within one budget; views are held weakly."""

    def __init__(self, period: float = TICK, share: float = THREAD_SHARE):
        self.period = period
        self.share = share
        self.budget = Budget(share)
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

    def tick(self, now: float | None = None, budget: Budget | None = None) -> int:
        """Refreshes every view that is due (within ``budget``; default: none held back);
        returns how many changed. A view that raises is logged (once) and the others go on."""
        now = time.monotonic() if now is None else now
        budget = Budget.unlimited() if budget is None else budget
        with self._lock:
            views = list(self._views)
        changed = 0
        for view in views:
            try:
                changed += bool(view._tick(now, budget))
            except Exception:
                view.errors += 1
                if view.errors == 1:
                    log.exception(
                        "mgkit: refreshing %s failed; it keeps its last values", type(view).__name__
                    )
        del views  # hold no view between ticks: views are collected when nobody else holds them
        return changed

    def _run(self) -> None:
        budget = self.budget
        wall = time.perf_counter()
        while True:
            with self._lock:
                if not self._views:
                    self._thread = None
                    return
            t0, spent = time.thread_time(), budget.spent
            try:
                self.tick(budget=budget)
            except Exception:  # noqa: BLE001  # pragma: no cover - interpreter shutdown
                return
            cost = time.thread_time() - t0
            self.busy += cost
            budget.charge(max(cost - (budget.spent - spent), 0.0))  # the round's own work
            time.sleep(self.pause(budget.credit))
            now = time.perf_counter()
            budget.earn(now - wall)
            wall = now

    def pause(self, credit: float) -> float:
        """Seconds to sleep after a round: the period while there is ``credit``; else until the
        budget has earned it back, but at most 1 / MAX_RATE (the memory samples keep their rate)."""
        if credit > 0.0:
            return self.period
        return min(max(self.period, -credit / self.share), 1.0 / MAX_RATE)


def next_due(due: float, now: float, rate: float) -> float:
    """When a view refreshed at ``now`` (due at ``due``) is next due at ``rate`` a second: a
    period after it was due, so late ticks do not slow the rate, or a period from now when it
    fell a period behind."""
    period = 1.0 / rate
    return due + period if due + period > now else now + period


REFRESHER = Refresher()
