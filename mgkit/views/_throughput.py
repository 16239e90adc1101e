"""The throughput view: samples per second and step time per context, from step and run events,
with compilation taken out of the calls that compiled."""

from __future__ import annotations

import collections
import itertools
import math
import operator
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from .. import _contexts
from .._ledger import Event, Kind, Ledger
from . import _svg
from ._base import Plotted
from ._format import duration, rate_text
from ._live import COMPILES, FOLD_CHUNK, CompileClock, check_count
from ._png import Trace, draw_throughput
from ._svg import by_source


def samples_per_second(event: Event, seconds: float | None = None) -> float | None:
    """A step or run event's samples per second: a step's own figure, a run's rows over its
    time (``seconds``: its time without compilation, default the event's); None when the
    event does not say."""
    try:
        info = event.info
        if event.kind == Kind.STEP:
            rate = float(info["samples_per_second"])
        else:
            rate = info["rows"] / (event.seconds if seconds is None else seconds)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return rate if 0.0 <= rate < math.inf else None


class Point(NamedTuple):
    """One point of a throughput line: one step or run event, or several of one source summed."""

    t: float  # when it ended, seconds since the view started
    rate: float  # samples per second
    step: float  # seconds per step (a fit's iteration, or one call), compilation left out
    compiled: float  # seconds of compilation taken out of its time
    samples: float  # the samples it covers (to sum points)
    steps: int  # the steps it covers


class Series(NamedTuple):
    """One line's points as arrays (``ThroughputView.series()``)."""

    t: np.ndarray  # when each point ended, seconds since the view started
    rate: np.ndarray  # samples per second
    step: np.ndarray  # seconds per step (a fit's iteration, or one call), compilation left out


class _Line:
    """One line's recent points (a context, or one member of an ensemble on it), each with what
    it came from (a fit, or a function and path: lines join only points of one source)."""

    __slots__ = ("compiled", "device", "loss", "rate", "source", "step", "t")

    def __init__(self, history: int, device: str):
        self.device = device
        self.loss = float("nan")  # the last step's loss, where steps report one
        self.t: collections.deque[float] = collections.deque(maxlen=history)
        self.rate: collections.deque[float] = collections.deque(maxlen=history)
        self.step: collections.deque[float] = collections.deque(maxlen=history)
        self.compiled: collections.deque[float] = collections.deque(maxlen=history)
        self.source: collections.deque[str] = collections.deque(maxlen=history)

    def add(self, point: Point, source: str) -> None:
        self.t.append(point.t)
        self.rate.append(point.rate)
        self.step.append(point.step)
        self.compiled.append(point.compiled)
        self.source.append(source)

    def series(self) -> Series:
        return Series(*(np.fromiter(d, np.float64, len(d)) for d in (self.t, self.rate, self.step)))

    def trace(self) -> Trace:
        t, rate, step = self.series()
        compiled = np.fromiter(self.compiled, np.float64, len(self.compiled))
        return Trace(t, rate, step, compiled, list(self.source))


class _Source(NamedTuple):
    """What a line's points come from: a fit's steps, or a function's runs, on one context."""

    context: str  # where the events ran
    step: bool  # True: a fit's step events; False: a function's run events
    name: str | None  # the fit (info ``what``) or the function (info ``fn``)
    path: str | None  # how the function ran (info ``path``); None for a fit

    def label(self) -> str:
        return str(self.name or "") if self.step else f"{self.name or ''} ({self.path or ''})"


class _Group:
    """Events of one source from one refresh, in arrival order, with their places among all the
    refresh's events (points are added to their lines in that order)."""

    __slots__ = ("events", "orders")

    def __init__(self, events: list[Event] | None = None, orders: list[int] | None = None):
        self.events: list[Event] = [] if events is None else events
        self.orders: list[int] = [] if orders is None else orders

    def __len__(self) -> int:
        return len(self.events)


class _Placed(NamedTuple):
    """A point and the place of its (last) event among the events of one refresh."""

    order: int  # the place of its (last) event among the refresh's events
    point: Point


class _Arrival(NamedTuple):
    """A point on its way to its line."""

    order: int  # as _Placed.order
    point: Point
    line: str  # the line's name: the context, or ``context:member``
    device: str  # the context's device
    source: str  # _Source.label()


_MERGE_OVER = 4  # events of one source and context per refresh shown one by one, at most
_ORDER = operator.attrgetter("order")


def _merged(points: list[Point]) -> Point:
    """One point for several of one source: the last time, all samples over all the time, all
    the time over all the steps, the compilation left out of all of them."""
    samples = sum(p.samples for p in points)
    steps = sum(p.steps for p in points)
    seconds = sum(p.step * p.steps for p in points)
    return Point(
        max(p.t for p in points),
        samples / seconds if seconds > 0 else points[-1].rate,
        seconds / steps,
        sum(p.compiled for p in points),
        samples,
        steps,
    )


_BUCKET = 10.0  # events per source and context that end within 1 / _BUCKET s may make one point


def _chunks(group: _Group) -> list[_Group]:
    """``group`` cut where an event ends in another tenth of a second than the one before."""
    cuts = [0]
    last = None
    for k, e in enumerate(group.events):
        bucket = int((e.start + e.seconds) * _BUCKET)
        if bucket != last and k:
            cuts.append(k)
        last = bucket
    cuts.append(len(group))
    return [_Group(group.events[lo:hi], group.orders[lo:hi]) for lo, hi in itertools.pairwise(cuts)]


def _summed_runs(group: _Group, spans: list, ends: list, t0: float) -> _Placed | None:
    """The one point of many run events of one function on one context, summed in one pass;
    None where that does not apply (step events, a compilation during them, an event that does
    not say its rows), and the caller takes them one by one."""
    rows = 0
    seconds = 0.0
    start = end = group.events[0].start
    try:
        for e in group.events:
            if e.kind != Kind.RUN:
                return None
            rows += e.info["rows"]
            seconds += e.seconds
            start = min(start, e.start)
            end = max(end, e.start + e.seconds)
    except (KeyError, TypeError):
        return None
    if not (seconds > 0 and rows >= 0):
        return None
    if spans and CompileClock.within(spans, ends, start, end) > 0:
        return None
    steps = len(group)
    return _Placed(group.orders[-1], Point(end - t0, rows / seconds, seconds / steps, 0.0, rows, steps))


class ThroughputView(Plotted):
    """A live plot of samples per second and step time per context, with each one's last loss.

    Fed by ``step`` events (fits report them from inside their compiled loops) and ``run``
    events (each context's share of a parallel call: its rows over the call's time). Where an
    ensemble trains several members on one context, each member has a line of its own,
    ``context:member``.

    Args:
      contexts: show only these contexts (default: all).
      history: points kept per context, 2 to 100000 (older points drop out).
      rate: refreshes per second, above 0 and at most 10 (the plot itself redraws at most 4
        times a second, and less often when drawing is slow: it takes at most ~0.3 % of the time).
      ledger: the ledger to follow (default ``mg.ledger()``).
      widget: True for an ipywidgets widget, False for text, None for a widget inside a
        Jupyter kernel and text elsewhere.
      live: a widget is refreshed by a background thread, also while a cell runs; False:
        only when you call ``refresh()``.

    >>> import mgkit as mg, jax.numpy as jnp
    >>> _ = mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    >>> view = mg.ThroughputView(widget=False)
    >>> _ = mg.parallel(lambda x: x * 2)(jnp.ones((8, 4)))
    >>> mg.ledger().flush()
    True
    >>> print(view)  # doctest: +ELLIPSIS
    mgkit throughput: 2 context(s) reporting
    ...
    """

    kinds = Kind.RATE
    css_class = "mgkit-throughput"
    headers = (
        "context",
        "device",
        "samples/s",
        "mean samples/s",
        "step time",
        "compile excluded",
        "points",
        "loss",
    )

    def __init__(
        self,
        contexts: Iterable[str] | None = None,
        history: int = 300,
        rate: float = 10.0,
        ledger: Ledger | None = None,
        widget: bool | None = None,
        live: bool = True,
    ):
        super().__init__(rate, ledger, widget, live, contexts)
        self.history = check_count(history, "history", self._where, 2, 100_000, 300)
        self._series: dict[str, _Line] = {}  # line name -> its points
        self._last: dict[tuple[str, str], int] = {}  # (context, fit) -> its last step's iteration
        self._skipped = 0  # entries the live refreshes left out, as last seen
        self._unknown = 0  # a fit's last iteration before its first event seen: -1 once some were left out
        self.fold_limit = FOLD_CHUNK
        self._t0 = time.time()
        COMPILES.listen()  # from now on, calls that compile are timed without their compilation
        self._start()

    def _seed(self) -> None:
        events = [e for e in self._ledger.records() if e.kind in Kind.RATE]
        if events:
            self._t0 = min(self._t0, min(e.start + e.seconds for e in events))
        self._fold(events)

    def _fold(self, events: list[Event]) -> bool:
        """Adds a point per step or run event. A step's seconds span the iterations since the
        context's last step (its start is after any compilation), so its time per iteration is
        its seconds over those iterations; a run is one call, whose seconds may include
        compiling the program: the compilations JAX reported during the call are taken out.

        Events that come faster than a view can show are summed: more than ``_MERGE_OVER``
        events of one fit or function on one context that end within one tenth of a second
        make one point (their samples over their time, their time over their steps), whether
        they arrive live or are read from the ledger later.
        """
        groups = self._grouped(events)
        if not groups:
            return False
        runs = any(not step for _, step, _, _ in groups)  # only runs have compilations taken out
        spans = COMPILES.spans() if runs else []
        ends = [end for end, _ in spans]
        arrivals: list[_Arrival] = []
        losses: dict[str, float] = {}
        for key, group in groups.items():
            source = _Source._make(key)
            first = group.events[0]
            member = first.info.get("member") if source.step else None
            ctx = source.context
            line = ctx if member is None or member == ctx else f"{ctx}:{member}"  # a line per model
            label = source.label()
            for placed in self._points(group, label, spans, ends):
                arrivals.append(_Arrival(placed.order, placed.point, line, first.src_device, label))
            loss = group.events[-1].info.get("loss") if source.step else None
            if loss is not None:
                losses[line] = loss
        arrivals.sort(key=_ORDER)
        lines, history = self._series, self.history
        for a in arrivals:
            line = lines.get(a.line)
            if line is None:
                line = lines[a.line] = _Line(history, a.device)
            line.add(a.point, a.source)
        for name, loss in losses.items():
            if name in lines:
                lines[name].loss = float(loss)
        return bool(arrivals)

    def _grouped(self, events: list[Event]) -> dict[tuple, _Group]:
        """The events of the contexts shown, by source (keys: a ``_Source``'s fields; a plain
        tuple per event is cheaper to make), each in arrival order; events without info left out."""
        groups: dict[tuple, _Group] = {}
        contexts, step = self.contexts, Kind.STEP
        for i, e in enumerate(events):
            if contexts is not None and e.src not in contexts:
                continue
            info = e.info
            try:
                if e.kind == step:
                    key = (e.src, True, info.get("what"), None)
                else:
                    key = (e.src, False, info.get("fn"), info.get("path"))
            except AttributeError:  # no info: no rate
                continue
            group = groups.get(key)
            if group is None:
                group = groups[key] = _Group()
            group.events.append(e)
            group.orders.append(i)
        return groups

    def _points(self, group: _Group, source: str, spans: list, ends: list) -> list[_Placed]:
        """The points of one source's events: one per event, or summed (see ``_fold``)."""
        out: list[_Placed] = []
        for chunk in _chunks(group) if len(group) > _MERGE_OVER else (group,):
            summed = _summed_runs(chunk, spans, ends, self._t0) if len(chunk) > _MERGE_OVER else None
            if summed is not None:
                out.append(summed)
                continue
            points: list[Point] = []
            orders: list[int] = []
            for order, e in zip(chunk.orders, chunk.events, strict=True):
                point = self._point(e, source, spans, ends)
                if point is not None:
                    points.append(point)
                    orders.append(order)
            if len(points) > _MERGE_OVER:
                out.append(_Placed(orders[-1], _merged(points)))
            else:
                out.extend(map(_Placed, orders, points))
        return out

    def _point(self, e: Event, source: str, spans: list, ends: list) -> Point | None:
        """The point of one event, or None when it says no rate."""
        compiled = 0.0
        seconds = e.seconds
        steps = 1
        is_step = e.kind == Kind.STEP
        if not is_step:
            if spans:
                compiled = min(COMPILES.within(spans, ends, e.start, e.start + seconds), seconds)
                seconds -= compiled
            if seconds <= 0.0:
                return None  # all compilation: no time left to rate
        rate = samples_per_second(e, seconds)
        if rate is None:
            return None
        if is_step:
            iteration = e.info.get("iteration")
            last_iteration = self._last.get((e.src, source), self._unknown)
            spans = e.info.get("steps")
            if isinstance(iteration, int) and iteration > 0:
                if isinstance(spans, int) and spans > 0:  # the event says how many iterations
                    steps = spans
                elif last_iteration < 0:  # steps left out since: its seconds are its own step's
                    steps = 1
                else:
                    steps = iteration - last_iteration if iteration > last_iteration else iteration
                self._last[(e.src, source)] = iteration
        return Point(e.start + e.seconds - self._t0, rate, seconds / steps, compiled, rate * seconds, steps)

    def series(self) -> dict[str, Series]:
        """context -> (time in s since the view started, samples per second, seconds per step),
        in the context map's order. A step is a fit's iteration or one parallel call; its time
        leaves out compilation."""
        self.refresh()
        return {name: line.series() for name, line in self._ordered()}

    def _ordered(self) -> list[tuple[str, _Line]]:
        order = {n: i for i, n in enumerate(_contexts.context_map().names)}
        return sorted(
            self._series.items(),
            key=lambda item: (order.get(item[0].split(":")[0], len(order)), item[0]),
        )

    def _traces(self) -> dict[str, Trace]:
        return {name: line.trace() for name, line in self._ordered()}

    def _update(self, events: list[Event], budgeted: bool) -> bool:
        if self.skipped != self._skipped:  # a heavy stream: some steps left out
            self._skipped, self._unknown = self.skipped, -1
            self._last = dict.fromkeys(self._last, -1)
        changed = self._fold(events)
        if changed:
            self._version += 1
            self._show_html()
        if self._redraw(budgeted):
            self._redraw_label.value = f"redraws: {self.redraws}"
            changed = True
        return changed

    def _rows(self) -> list[tuple]:
        return [
            (
                name,
                p.device,
                rate_text(p.rate[-1]),
                rate_text(sum(p.rate) / len(p.rate)),
                duration(p.step[-1]),
                f"{sum(p.compiled):.2f} s" if any(p.compiled) else "",
                len(p.rate),
                f"{p.loss:.6g}" if p.loss == p.loss else "",
            )
            for name, p in self._ordered()
        ]

    def _title(self) -> str:
        return f"mgkit throughput: {len(self._series)} context(s) reporting"

    def text(self) -> str:
        return self._table(self._title())

    def html(self) -> str:
        return self._table(self._title(), as_html=True)

    def _build(self, widgets: Any) -> Any:
        self._html = widgets.HTML()
        self._plot = widgets.HTML()
        self._redraw_label = widgets.Label("redraws: 0")
        self._redraw_label.add_class("mgkit-redraws")
        return widgets.VBox([self._html, self._plot, self._redraw_label])

    def _palette(self, names: Iterable[str]) -> dict[str, str]:
        return _svg.colors([*_contexts.context_map().names, *names])

    def svg(self) -> str:
        traces = self._traces()
        rates = {name: by_source(tr.t, tr.rate, tr.sources) for name, tr in traces.items()}
        steps = {name: by_source(tr.t, tr.step * 1e3, tr.sources) for name, tr in traces.items()}
        panels = [_svg.Panel("samples/s", rates), _svg.Panel("ms per step", steps)]
        title = "throughput per context (compilation left out of step times)"
        return _svg.lines(panels, self._palette(traces), title, "time since the view started (s)", log=True)

    def _draw(self, ax_rate: Any, ax_step: Any) -> None:
        traces = self._traces()
        draw_throughput(ax_rate, ax_step, traces, self._palette(traces))

    def _draw_figure(self, fig: Any) -> None:
        self._draw(*fig.subplots(2, 1, sharex=True))
