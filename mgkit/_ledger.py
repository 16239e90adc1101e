"""The ledger: one bounded, thread-safe stream of events for every move and step mgkit makes.

Compute code records events here; widgets, magics and summaries read or subscribe. Copy
durations are measured to completion by a watcher thread, so the caller never waits for them.
"""

from __future__ import annotations

import collections
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from . import _contexts
from ._numbers import whole
from ._table import Table, html_table, human_bytes, text_table

log = logging.getLogger("mgkit")


def link_shares(links: list[tuple[str, str, int]]) -> list[float]:
    """Each event's share of the seconds that events completing together took, from its
    (source, target, bytes): all of them where it is the only event between its two contexts,
    else its part of the bytes that went between them (an equal part where none did)."""
    totals: dict[tuple[str, str], list[int]] = {}
    for src, dst, nbytes in links:
        totals.setdefault((src, dst), []).append(nbytes)
    out = []
    for src, dst, nbytes in links:
        sizes = totals[(src, dst)]
        out.append(1.0 if len(sizes) == 1 else nbytes / sum(sizes) if sum(sizes) else 1.0 / len(sizes))
    return out


def _timed(events: list[Event], seconds: float) -> list[Event]:
    """``events`` that completed together after ``seconds``, each given its share (``link_shares``)."""
    if len({(e[1], e[2]) for e in events}) == len(events):  # one event per pair: all the seconds
        return [_new(Event, (*e[:7], seconds, e[8], e[9])) for e in events]
    shares = link_shares([(e[1], e[2], e[5]) for e in events])
    pairs = zip(events, shares, strict=True)
    return [_new(Event, (*e[:7], seconds * share, e[8], e[9])) for e, share in pairs]


_new = tuple.__new__  # an Event from a tuple of its fields, without NamedTuple's argument parsing


class Event(NamedTuple):
    """One thing mgkit did.

    Attributes:
      kind: ``put``, ``transfer``, ``colocate``, ``split``, ``replicate``, ``concat``, ``gather``
        or ``run`` (one context's share of a parallel call).
      src, dst: context names (``host`` for host memory).
      src_device, dst_device: short device names (``cpu0``, ``cuda1``, ``host``).
      nbytes: bytes moved.
      start: wall-clock time the operation was issued (``time.time()``).
      seconds: time from issue to completion.
      label: the IPython execution count (``In [7]`` -> ``7``) when run in IPython, else None.
      info: extra facts about the event (array count, shapes, samples...), or None.
    """

    kind: str
    src: str
    dst: str
    src_device: str
    dst_device: str
    nbytes: int
    start: float
    seconds: float
    label: int | None = None
    info: Mapping[str, Any] | None = None

    @property
    def gbps(self) -> float:
        """Achieved bandwidth in GB/s (1e9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")


class Layout:
    """Events that calls laid out alike record again and again, made once by their caller and
    kept (``_spmd`` caches them per layout): per event its first six fields (kind to bytes), its
    share of the seconds the events take together (``link_shares``) and its info.

    ``Ledger.record_layout`` keeps one small entry per call and makes the events only when they
    are read (``records``, subscribers); the running totals are folded in per layout, so a
    call's recording costs the same however many contexts it spans.
    """

    __slots__ = ("rows", "size", "totals")

    def __init__(self, rows: list[tuple[tuple, float, Mapping[str, Any] | None]]):
        self.rows = tuple(rows)
        self.size = len(self.rows)
        sums: dict[tuple[str, str, str], list] = {}
        for head, share, _ in self.rows:
            total = sums.setdefault((head[0], head[1], head[2]), [0, 0, 0.0])
            total[0] += 1
            total[1] += head[5]
            total[2] += share
        # per (kind, source, target): events, bytes, and the share of one call's seconds
        self.totals = tuple((key, c, b, s) for key, (c, b, s) in sums.items())

    def events(
        self, start: float, seconds: float, label: int | None, extra: tuple | None = None
    ) -> list[Event]:
        """The events of one call issued at ``start`` that took ``seconds`` together; ``extra``:
        one dict per event of this call's own facts (a step's loss), merged into its info."""
        if extra is None:
            return [
                _new(Event, (*head, start, seconds * share, label, info)) for head, share, info in self.rows
            ]
        return [
            _new(Event, (*head, start, seconds * share, label, {**(info or {}), **more}))
            for (head, share, info), more in zip(self.rows, extra, strict=True)
        ]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"Layout({[head[:3] for head, _, _ in self.rows]})"


class _Recorded(NamedTuple):
    """One ``record_layout`` call as the ledger keeps it, its events made when read."""

    layout: Layout
    start: float
    seconds: float
    label: int | None
    extra: tuple | None = None  # per event: this call's own facts

    def events(self) -> list[Event]:
        return self.layout.events(self.start, self.seconds, self.label, self.extra)


class _Later(NamedTuple):
    """Events made by ``make()`` once the work they describe is done (``Ledger.record_later``)."""

    make: Callable[[], list[Event]]


def _size(entry: Event | _Recorded) -> int:
    return entry.layout.size if type(entry) is _Recorded else 1


def events_of(entries) -> list[Event]:
    """The events of entries a buffer got from ``Ledger.attach``, in order."""
    out: list[Event] = []
    for entry in entries:
        if type(entry) is _Recorded:
            out.extend(entry.events())
        else:
            out.append(entry)
    return out


def execution_label() -> int | None:
    """The running IPython cell's execution count, without importing IPython."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    try:
        shell = ipython.get_ipython()
    except Exception:  # noqa: BLE001
        return None
    if shell is None:
        return None
    # The running cell is the last input in the history (IPython moves execution_count on
    # before or after the cell depending on its version; the history is the same in both).
    history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None)
    if history:
        return len(history) - 1
    return getattr(shell, "execution_count", None)


def short_label(name: str) -> str:
    """A compact label for an array over many contexts: ``dev0+dev1+...+dev7`` -> ``dev0..dev7 (8)``."""
    parts = name.split("+")
    return name if len(parts) <= 3 else f"{parts[0]}..{parts[-1]} ({len(parts)})"


class Summary(Table):
    """Per source -> target pair totals: count, bytes, seconds, GB/s."""

    headers = ("kind", "from", "to", "count", "bytes", "seconds", "GB/s")

    def _display_rows(self) -> list[tuple]:
        return [
            (
                k,
                short_label(s),
                short_label(d),
                c,
                human_bytes(b),
                f"{t:.6f}",
                f"{b / t / 1e9:.2f}" if t > 0 and b else "n/a",
            )
            for k, s, d, c, b, t in self._rows
        ]


class Matrix:
    """Bytes moved between every pair of contexts: ``values[i, j]`` from ``names[i]`` to ``names[j]``."""

    def __init__(self, names: list[str], values: np.ndarray):
        self.names = names
        self.values = values

    def __getitem__(self, pair: tuple[str, str]) -> int:
        src, dst = pair
        return int(self.values[self.names.index(src), self.names.index(dst)])

    def _rows(self) -> tuple[list[str], list[list[str]]]:
        headers = ["from \\ to", *map(short_label, self.names)]
        rows = [
            [short_label(s), *(human_bytes(v) if v else "." for v in self.values[i])]
            for i, s in enumerate(self.names)
        ]
        return headers, rows

    def __repr__(self) -> str:
        return text_table(*self._rows(), title="bytes moved (row: from, column: to)")

    def _repr_html_(self) -> str:
        return html_table(*self._rows(), title="bytes moved (row: from, column: to)")


class _Subscription:
    """One subscriber and how often it raised: the first error is logged with its traceback,
    later ones only counted, with a line at the 10th, 100th, 1000th, ... and a total when the
    subscriber leaves."""

    __slots__ = ("_next_note", "callback", "errors")

    def __init__(self, callback: Callable[[Event], None]):
        self.callback = callback
        self.errors = 0
        self._next_note = 10

    def failed(self) -> None:
        """Called inside the ``except`` block of the subscriber's error."""
        self.errors += 1
        if self.errors == 1:
            log.exception(
                "mgkit ledger subscriber %r raised; the ledger keeps recording and calling it. Later "
                "errors from this subscriber are counted, not logged one by one",
                self.callback,
            )
        elif self.errors == self._next_note:
            self._next_note *= 10
            log.warning(
                "mgkit ledger subscriber %r has raised %d times (last: %s)",
                self.callback,
                self.errors,
                _last_error(),
            )

    def summarize(self) -> None:
        if self.errors > 1:
            log.warning(
                "mgkit ledger subscriber %r was unsubscribed after raising %d times in all "
                "(the first error's traceback was logged when it happened)",
                self.callback,
                self.errors,
            )


def _last_error() -> str:
    err = sys.exc_info()[1]
    return f"{type(err).__name__}: {err}" if err is not None else "unknown"


class Ledger:
    """A bounded, thread-safe record of events with live subscribers.

    Args:
      capacity: how many recent events ``records()`` keeps (older ones drop out of the ring
        buffer; ``summary()`` and ``matrix()`` still count them).
    """

    def __init__(self, capacity: int = 10_000):
        self._lock = threading.RLock()
        # Events and ``_Recorded`` entries, oldest first; ``_kept`` events in all, at most capacity.
        self._events: collections.deque[Event | _Recorded] = collections.deque()
        self._capacity = self._check_capacity(capacity)
        self._kept = 0
        self._totals: dict[tuple[str, str, str], list[float]] = {}
        self._folds: dict[Layout, list] = {}  # layout -> [calls, seconds] not yet in _totals
        self._subscribers: list[_Subscription] = []
        self._feeds: tuple[collections.deque, ...] = ()  # views' buffers, given entries as recorded
        self._pending: queue.Queue = queue.Queue()
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        self._watcher: threading.Thread | None = None
        self.dropped = 0

    @staticmethod
    def _check_capacity(capacity: int) -> int:
        return whole(capacity, "capacity", "Ledger", lo=1, example=10_000, note="events kept")

    @property
    def capacity(self) -> int:
        return self._capacity

    def set_capacity(self, capacity: int) -> None:
        """Changes how many recent events are kept, keeping the newest."""
        capacity = self._check_capacity(capacity)
        with self._lock:
            self._capacity = capacity
            self._trim()

    def _trim(self) -> None:
        """Drops the oldest events beyond the capacity (under the lock): whole entries, and of
        an entry only partly beyond it, its oldest events."""
        over = self._kept - self._capacity
        while over > 0:
            first = self._events.popleft()
            size = _size(first)
            if size > over:  # keep its newest events
                self._events.extendleft(reversed(first.events()[over:]))
                size = over
            self._kept -= size
            self.dropped += size
            over -= size

    # -- recording -------------------------------------------------------------------------

    def record(self, event: Event | list[Event]) -> None:
        """Appends a finished event (or several, in order) and hands each to every subscriber."""
        self._record_all((event,) if isinstance(event, Event) else event)

    def _record_all(self, events) -> None:
        with self._lock:
            self._events.extend(events)
            self._kept += len(events)
            if self._kept > self._capacity:
                self._trim()
            totals = self._totals
            for event in events:
                key = (event[0], event[1], event[2])  # kind, src, dst
                tot = totals.get(key)
                if tot is None:
                    totals[key] = [1, event[5], event[7]]  # count, nbytes, seconds
                else:
                    tot[0] += 1
                    tot[1] += event[5]
                    tot[2] += event[7]
            for feed in self._feeds:
                feed.extend(events)
            subscribers = tuple(self._subscribers)
        if subscribers:
            self._notify(events, subscribers)

    def record_layout(
        self, layout: Layout, start: float, seconds: float, label: int | None, extra: tuple | None = None
    ) -> None:
        """Records the events of ``layout`` for one call issued at ``start`` that took ``seconds``
        (each event its share): one entry and one fold per call, the events made when read.
        ``extra``: one dict per event of this call's own facts, merged into its info."""
        self._record_layout(_Recorded(layout, start, seconds, label, extra))

    def _record_layout(self, entry: _Recorded) -> None:
        with self._lock:
            self._events.append(entry)
            self._kept += entry.layout.size
            if self._kept > self._capacity:
                self._trim()
            fold = self._folds.get(entry.layout)
            if fold is None:
                self._folds[entry.layout] = [1, entry.seconds]
            else:
                fold[0] += 1
                fold[1] += entry.seconds
            for feed in self._feeds:
                feed.append(entry)
            subscribers = tuple(self._subscribers)
        if subscribers:
            self._notify(entry.events(), subscribers)

    @staticmethod
    def _notify(events, subscribers) -> None:
        for event in events:
            for sub in subscribers:
                try:
                    sub.callback(event)
                except Exception:  # noqa: BLE001 - a broken view must not stop the recording
                    sub.failed()

    def _fold(self) -> None:
        """Adds the layouts recorded since the last fold to the totals (under the lock)."""
        totals = self._totals
        for layout, (calls, seconds) in self._folds.items():
            for key, count, nbytes, share in layout.totals:
                tot = totals.get(key)
                if tot is None:
                    totals[key] = [calls * count, calls * nbytes, seconds * share]
                else:
                    tot[0] += calls * count
                    tot[1] += calls * nbytes
                    tot[2] += seconds * share
        self._folds.clear()

    def record_when_ready(self, event: Event | list[Event], arrays: list, t0: float) -> None:
        """Records ``event`` (or several events that share one completion) once ``arrays`` are
        ready, timed from ``t0`` (``time.perf_counter``) to completion, without making the
        caller wait. Events between one pair of contexts (a split and a replicate to one
        context in one placement) share the seconds in proportion to their bytes, so the link's
        seconds are counted once; events on different pairs each get them all.

        Work that is already complete is timed and recorded at once; work still running is
        handed to a watcher thread that waits for it.
        """
        events = [event] if isinstance(event, Event) else event
        for a in arrays:
            if not a.is_ready():
                break
        else:  # all complete: recorded here, no watcher needed
            self._record_all(_timed(events, time.perf_counter() - t0))
            return
        self._watch_for(events, len(events), arrays, t0)

    def record_layout_when_ready(
        self, layout: Layout, start: float, label: int | None, arrays: list, t0: float
    ) -> None:
        """``record_layout`` once ``arrays`` are ready, timed from ``t0`` to completion, without
        making the caller wait (see ``record_when_ready``)."""
        for a in arrays:
            if not a.is_ready():
                break
        else:
            self._record_layout(_Recorded(layout, start, time.perf_counter() - t0, label))
            return
        self._watch_for(_Recorded(layout, start, 0.0, label), layout.size, arrays, t0)

    def record_later(self, make: Callable[[], list[Event]]) -> None:
        """Records the events ``make()`` returns, called on the ledger's watcher thread: for
        events whose times are known only once work on the devices is done (``make`` may wait
        for it), without making the caller wait. ``flush`` (and so ``records``) waits for them."""
        self._watch_for(_Later(make), 1, [], 0.0)

    def _watch_for(self, entry: list[Event] | _Recorded | _Later, size: int, arrays: list, t0: float) -> None:
        with self._lock:
            self._inflight += size
            if self._watcher is None or not self._watcher.is_alive():
                self._watcher = threading.Thread(target=self._watch, name="mgkit-ledger", daemon=True)
                self._watcher.start()
        self._pending.put((entry, size, arrays, t0))

    def _watch(self) -> None:
        while True:
            batch = [self._pending.get()]
            while not self._pending.empty():  # drain what queued up: one wake-up for many copies
                batch.append(self._pending.get_nowait())
            done, entries, size = [], [], 0
            for entry, n, arrays, t0 in batch:
                size += n
                if type(entry) is _Later:
                    try:
                        done.extend(entry.make())
                    except Exception:
                        log.exception("mgkit ledger: events made after the work could not be made")
                    continue
                try:
                    for a in arrays:
                        a.block_until_ready()
                    seconds, info = time.perf_counter() - t0, None
                except Exception as e:  # noqa: BLE001 - failed work is recorded, not lost
                    seconds, info = time.perf_counter() - t0, {"error": repr(e)}
                if type(entry) is _Recorded:
                    if info is None:
                        entries.append(entry._replace(seconds=seconds))
                        continue
                    entry = entry.events()
                for event in _timed(entry, seconds):
                    extra = {} if info is None else {"info": {**(event.info or {}), **info}}
                    done.append(event._replace(**extra))
            del batch, arrays
            try:
                if done:
                    self._record_all(done)
                for entry in entries:
                    self._record_layout(entry)
            finally:
                with self._lock:
                    self._inflight -= size
                    if self._inflight == 0:
                        self._idle.notify_all()

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Waits until every event in flight is recorded; returns False on timeout."""
        if threading.current_thread() is self._watcher:
            return self._inflight == 0  # called from a subscriber: waiting would wait on itself
        with self._lock:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    # -- reading ---------------------------------------------------------------------------

    def records(self, kind: str | None = None) -> list[Event]:
        """The events kept in the ring buffer in the order they were issued (waits for events in
        flight; work that finishes out of order is still listed by start time)."""
        self.flush()
        with self._lock:
            entries = list(self._events)
        events = events_of(entries)
        events.sort(key=lambda e: e.start)  # stable: events issued together keep their order
        return [e for e in events if kind is None or e.kind == kind]

    def totals(self) -> dict[tuple[str, str, str], tuple[int, int, float]]:
        """Running (count, bytes, seconds) per (kind, source, target) since the last ``clear()``,
        as recorded so far: unlike ``summary()`` it does not wait for events in flight, so a
        live view can read it while copies are still running."""
        with self._lock:
            self._fold()
            return {key: (int(c), int(b), float(t)) for key, (c, b, t) in self._totals.items()}

    def summary(self) -> Summary:
        """Totals per (kind, source, target) since the last ``clear()``: count, bytes, seconds, GB/s."""
        self.flush()
        rows = [(k, s, d, c, b, t) for (k, s, d), (c, b, t) in self.totals().items()]
        n = sum(r[3] for r in rows)
        return Summary(
            rows, title=f"mgkit ledger: {n} event(s), {human_bytes(sum(r[4] for r in rows))} moved"
        )

    def matrix(self) -> Matrix:
        """Bytes moved between every pair of contexts (and host) since the last ``clear()``."""
        self.flush()
        with self._lock:
            self._fold()
            totals = dict(self._totals)
        names = list(_contexts.context_map().names)
        for _, s, d in totals:
            for n in (s, d):
                if n not in names:
                    names.append(n)
        values = np.zeros((len(names), len(names)), dtype=np.int64)
        for (_, s, d), (_, b, _) in totals.items():
            values[names.index(s), names.index(d)] += int(b)
        return Matrix(names, values)

    def clear(self) -> None:
        """Forgets every event and total, after waiting for events in flight to be recorded."""
        self.flush()
        with self._lock:
            self._events.clear()
            self._kept = 0
            self._totals.clear()
            self._folds.clear()
            self.dropped = 0

    def subscribe(self, callback: Callable[[Event], None]) -> Callable[[], None]:
        """Calls ``callback(event)`` for every new event, on the thread that records it.

        Returns a function that unsubscribes. A callback that raises is kept: its first error
        is logged with its traceback, later ones are counted (a line at the 10th, 100th, ...
        error, and the total when it is unsubscribed), so a broken view cannot flood the log
        or slow the recording.
        """
        if not callable(callback):
            raise TypeError(f"subscribe() takes a callable taking one Event, got {callback!r}")
        sub = _Subscription(callback)
        with self._lock:
            self._subscribers.append(sub)

        def unsubscribe() -> None:
            with self._lock:
                if sub not in self._subscribers:
                    return
                self._subscribers.remove(sub)
            sub.summarize()

        return unsubscribe

    def attach(self, buffer: collections.deque) -> Callable[[], None]:
        """Appends every new entry to ``buffer`` (a bounded deque) as it is recorded: an event,
        or one call's events not yet made (``events_of`` makes them). The cheapest way to
        watch: one append per call on the recording thread, whatever the call's event count.
        Returns a function that detaches it."""
        with self._lock:
            self._feeds = (*self._feeds, buffer)

        def detach() -> None:
            with self._lock:
                self._feeds = tuple(f for f in self._feeds if f is not buffer)

        return detach

    def __len__(self) -> int:
        with self._lock:
            return self._kept

    def __repr__(self) -> str:
        return repr(self.summary())

    def _repr_html_(self) -> str:
        return self.summary()._repr_html_()


_LEDGER = Ledger()


def ledger() -> Ledger:
    """The process-wide ledger of every put, transfer, colocate (and later split, concat, step).

    >>> import mgkit as mg
    >>> mg.ledger().clear()
    >>> len(mg.ledger())
    0
    """
    return _LEDGER
