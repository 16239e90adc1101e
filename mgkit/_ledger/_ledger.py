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
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .. import _contexts
from .._numbers import whole
from .._table import human_bytes
from ._events import Call, Entry, Event, Kind, Layout, events_of, timed
from ._tables import Matrix, Summary

log = logging.getLogger("mgkit")


class _WhenReady(NamedTuple):
    """Events waiting on the watcher thread for their arrays (``Ledger.record_when_ready``)."""

    entry: list[Event] | Call
    arrays: list  # the arrays whose completion ends the work
    t0: float  # ``time.perf_counter()`` at issue

    def finish(self) -> list[Event | Call]:
        """Waits for the arrays, then the entry timed from ``t0``; failed work is recorded with
        its error in ``info``, not lost."""
        try:
            for a in self.arrays:
                a.block_until_ready()
            seconds, error = time.perf_counter() - self.t0, None
        except Exception as e:  # noqa: BLE001
            seconds, error = time.perf_counter() - self.t0, {"error": repr(e)}
        entry = self.entry
        if type(entry) is Call:
            if error is None:
                return [entry._replace(seconds=seconds)]
            entry = entry.events()
        done = timed(entry, seconds)
        return done if error is None else [e._replace(info={**(e.info or {}), **error}) for e in done]


class _Later(NamedTuple):
    """Events made by ``make()`` once the work they describe is done (``Ledger.record_later``)."""

    make: Callable[[], list[Event]]

    def finish(self) -> list[Event]:
        try:
            return list(self.make())
        except Exception:
            log.exception("mgkit ledger: events made after the work could not be made")
            return []


def _size(entry: Event | Call) -> int:
    return entry.layout.size if type(entry) is Call else 1


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
        # Events and layout ``Call``s, oldest first; ``_kept`` events in all, at most capacity.
        self._events: collections.deque[Event | Call] = collections.deque()
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
    # Three ways in: ``record`` for work already done and timed, ``record_when_ready`` for work
    # still running on the devices (timed to completion off the caller's thread), and
    # ``record_later`` for events that can only be made once the work is done.

    def record(self, entry: Entry) -> None:
        """Records finished work: an event, several events in order, or one call of a layout
        (``layout.call(start, seconds, label)``, kept as one entry and made into events when
        read), and hands each event to every subscriber.

        Use it when the caller knows the seconds already (host work, a step it waited for)."""
        if type(entry) is Call:
            self._record_call(entry)
        elif isinstance(entry, Event):
            self._record_all((entry,))
        elif isinstance(entry, list):
            self._record_all(entry)
        else:
            raise TypeError(
                f"Ledger.record: got a {type(entry).__name__} ({entry!r:.60}); it takes an Event "
                "(Event.on(kind, ctx, start, seconds)), a list of Events, or a layout's call "
                "(layout.call(start, seconds, label))"
            )

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

    def _record_call(self, entry: Call) -> None:
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

    def record_when_ready(self, entry: Entry, arrays: list, t0: float) -> None:
        """Records ``entry`` (an event, events that share one completion, or a layout's call)
        once ``arrays`` are ready, timed from ``t0`` (``time.perf_counter``) to completion,
        without making the caller wait: use it for copies and programs just dispatched.

        Events between one pair of contexts (a split and a replicate to one context in one
        placement) share the seconds in proportion to their bytes, so the link's seconds are
        counted once; events on different pairs each get them all. Work that is already
        complete is timed and recorded at once; work still running is handed to a watcher
        thread that waits for it.
        """
        for a in arrays:
            if not a.is_ready():
                break
        else:  # all complete: recorded here, no watcher needed
            seconds = time.perf_counter() - t0
            if type(entry) is Call:
                self._record_call(entry._replace(seconds=seconds))
            else:
                self._record_all(timed([entry] if isinstance(entry, Event) else entry, seconds))
            return
        if isinstance(entry, Event):
            entry = [entry]
        self._watch_for(_WhenReady(entry, arrays, t0), _size(entry) if type(entry) is Call else len(entry))

    def record_later(self, make: Callable[[], list[Event]]) -> None:
        """Records the events ``make()`` returns, called on the ledger's watcher thread: for
        events whose times are known only once work on the devices is done (``make`` may wait
        for it), without making the caller wait. ``flush`` (and so ``records``) waits for them."""
        self._watch_for(_Later(make), 1)

    def _watch_for(self, pending: _WhenReady | _Later, size: int) -> None:
        with self._lock:
            self._inflight += size
            if self._watcher is None or not self._watcher.is_alive():
                self._watcher = threading.Thread(target=self._watch, name="mgkit-ledger", daemon=True)
                self._watcher.start()
        self._pending.put((pending, size))

    def _watch(self) -> None:
        while True:
            batch = [self._pending.get()]
            while not self._pending.empty():  # drain what queued up: one wake-up for many copies
                batch.append(self._pending.get_nowait())
            size = sum(n for _, n in batch)
            try:
                events: list[Event] = []
                for pending, _ in batch:
                    for entry in pending.finish():
                        if type(entry) is Call:
                            self._record_call(entry)
                        else:
                            events.append(entry)
                del batch, pending
                if events:
                    self._record_all(events)
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
        """Totals per (kind, source, target) since the last ``clear()``: count, bytes, seconds, GB/s;
        a line under the title sums the collectives inside compiled programs, where there are any."""
        self.flush()
        rows = [(k, s, d, c, b, t) for (k, s, d), (c, b, t) in self.totals().items()]
        n = sum(r[3] for r in rows)
        inside = [r for r in rows if r[0] == Kind.COLLECTIVE]
        moved = sum(r[4] for r in rows) - sum(r[4] for r in inside)
        title = f"mgkit ledger: {n} event(s), {human_bytes(moved)} moved"
        if inside:
            title += (
                f"\ncollectives inside compiled programs: {human_bytes(sum(r[4] for r in inside))} sent "
                f"in {sum(r[3] for r in inside)} event(s) (read from the programs, not timed)"
            )
        return Summary(rows, title=title)

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
