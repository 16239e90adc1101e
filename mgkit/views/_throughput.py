"""The throughput view: samples per second and step time per context, from step and run events,
with compilation taken out of the calls that compiled."""

from __future__ import annotations

import collections
import math
import operator
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from .. import _contexts
from .._ledger import Event, Ledger
from . import _svg
from ._base import Plotted
from ._format import duration, rate_text
from ._live import COMPILES, CompileClock, check_count
from ._png import draw_throughput
from ._svg import by_source

RATE_KINDS = frozenset({"step", "run"})
"""Compute events that say how many samples they processed."""


def samples_per_second(event: Event, seconds: float | None = None) -> float | None:
    """A step or run event's samples per second: a step's own figure, a run's rows over its
    time (``seconds``: its time without compilation, default the event's); None when the
    event does not say."""
    try:
        info = event.info
        if event.kind == "step":
            rate = float(info["samples_per_second"])
        else:
            rate = info["rows"] / (event.seconds if seconds is None else seconds)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return rate if 0.0 <= rate < math.inf else None


class _Series:
    """One context's recent points: completion time, samples per second, seconds per step (a
    fit's iteration, or a call) without compilation, the compilation taken out, and what the
    point came from (a fit, or a function and path: lines join only points of one source)."""

    __slots__ = ("compiled", "device", "loss", "rate", "source", "step", "t")

    def __init__(self, history: int, device: str):
        self.device = device
        self.loss = float("nan")  # the last step's loss, where steps report one
        self.t: collections.deque[float] = collections.deque(maxlen=history)
        self.rate: collections.deque[float] = collections.deque(maxlen=history)
        self.step: collections.deque[float] = collections.deque(maxlen=history)
        self.compiled: collections.deque[float] = collections.deque(maxlen=history)
        self.source: collections.deque[str] = collections.deque(maxlen=history)

    def add(self, t: float, rate: float, step: float, compiled: float, source: str) -> None:
        self.t.append(t)
        self.rate.append(rate)
        self.step.append(step)
        self.compiled.append(compiled)
        self.source.append(source)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return tuple(np.fromiter(d, np.float64, len(d)) for d in (self.t, self.rate, self.step))


_MERGE_OVER = 4  # events of one source and context per refresh shown one by one, at most


def _merged(parts: list[tuple]) -> tuple:
    """One point for several of one source: the last time, all samples over all the time, all
    the time over all the steps, the compilation left out of all of them."""
    samples = sum(p[4][0] for p in parts)
    steps = sum(p[4][1] for p in parts)
    seconds = sum(p[2] * p[4][1] for p in parts)
    return (
        max(p[0] for p in parts),
        samples / seconds if seconds > 0 else parts[-1][1],
        seconds / steps,
        sum(p[3] for p in parts),
        (samples, steps),
    )


_BUCKET = 10.0  # events per source and context that end within 1 / _BUCKET s may make one point


def _chunks(group: list[tuple[int, Event]]) -> list[list[tuple[int, Event]]]:
    """``group`` cut where an event ends in another tenth of a second than the one before."""
    out: list[list[tuple[int, Event]]] = []
    last = None
    for item in group:
        e = item[1]
        bucket = int((e.start + e.seconds) * _BUCKET)
        if bucket != last:
            out.append([item])
            last = bucket
        else:
            out[-1].append(item)
    return out


def _summed_runs(group: list[tuple[int, Event]], spans: list, ends: list, t0: float) -> list | None:
    """The one point of many run events of one function on one context, summed in one pass;
    None where that does not apply (step events, a compilation during them, an event that does
    not say its rows), and the caller takes them one by one."""
    rows = 0
    seconds = 0.0
    start = end = group[0][1].start
    try:
        for _, e in group:
            if e.kind != "run":
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
    return [(group[-1][0], (end - t0, rows / seconds, seconds / len(group), 0.0, (rows, len(group))))]


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

    kinds = RATE_KINDS
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
        self._series: dict[str, _Series] = {}
        self._last: dict[tuple[str, str], int] = {}  # (context, fit) -> its last step's iteration
        self._t0 = time.time()
        COMPILES.listen()  # from now on, calls that compile are timed without their compilation
        self._start()

    def _seed(self) -> None:
        events = [e for e in self._ledger.records() if e.kind in RATE_KINDS]
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
        groups: dict[tuple, list[tuple[int, Event]]] = {}  # per context and fit, or function and path
        contexts = self.contexts
        for i, e in enumerate(events):
            if contexts is not None and e.src not in contexts:
                continue
            info = e.info
            try:
                if e.kind == "step":
                    key = (e.src, "step", info.get("what"))
                else:
                    key = (e.src, info.get("fn"), info.get("path"))
            except AttributeError:  # no info: no rate
                continue
            group = groups.get(key)
            if group is None:
                groups[key] = [(i, e)]
            else:
                group.append((i, e))
        if not groups:
            return False
        spans = COMPILES.spans()
        ends = [end for end, _ in spans]
        points: list[tuple] = []  # (arrival, point, line, device, source): shown in arrival order
        losses: dict[str, float] = {}
        for (ctx, a, b), group in groups.items():
            source = str(b or "") if a == "step" else f"{a or ''} ({b or ''})"
            device = group[0][1].src_device
            member = group[0][1].info.get("member") if a == "step" else None
            name = ctx if member is None or member == ctx else f"{ctx}:{member}"  # a line per model
            for chunk in _chunks(group) if len(group) > _MERGE_OVER else (group,):
                parts = _summed_runs(chunk, spans, ends, self._t0) if len(chunk) > _MERGE_OVER else None
                if parts is None:
                    parts = [(i, self._point(e, source, spans, ends)) for i, e in chunk]
                    parts = [(i, p) for i, p in parts if p is not None]
                    if len(parts) > _MERGE_OVER:
                        parts = [(parts[-1][0], _merged([p for _, p in parts]))]
                points.extend((i, p, name, device, source) for i, p in parts)
            loss = group[-1][1].info.get("loss") if a == "step" else None
            if loss is not None:
                losses[name] = loss
        points.sort(key=operator.itemgetter(0))
        series, history = self._series, self.history
        for _, (t, rate, step, compiled, _), ctx, device, source in points:
            line = series.get(ctx)
            if line is None:
                line = series[ctx] = _Series(history, device)
            line.add(t, rate, step, compiled, source)
        for ctx, loss in losses.items():
            if ctx in series:
                series[ctx].loss = float(loss)
        return bool(points)

    def _point(self, e: Event, source: str, spans: list, ends: list) -> tuple | None:
        """(time, samples/s, seconds per step, compile seconds left out, (samples, steps)) of one
        event, or None when it says no rate."""
        compiled = 0.0
        seconds = e.seconds
        steps = 1
        if e.kind != "step":
            if spans:
                compiled = min(COMPILES.within(spans, ends, e.start, e.start + seconds), seconds)
                seconds -= compiled
            if seconds <= 0.0:
                return None  # all compilation: no time left to rate
        rate = samples_per_second(e, seconds)
        if rate is None:
            return None
        if e.kind == "step":
            iteration = e.info.get("iteration")
            last_iteration = self._last.get((e.src, source), 0)
            if isinstance(iteration, int) and iteration > 0:
                steps = iteration - last_iteration if iteration > last_iteration else iteration
                self._last[(e.src, source)] = iteration
        return e.start + e.seconds - self._t0, rate, seconds / steps, compiled, (rate * seconds, steps)

    def series(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """context -> (time in s since the view started, samples per second, seconds per step),
        in the context map's order. A step is a fit's iteration or one parallel call; its time
        leaves out compilation."""
        self.refresh()
        return self._arrays()

    def _ordered(self) -> list[tuple[str, _Series]]:
        order = {n: i for i, n in enumerate(_contexts.context_map().names)}
        return sorted(
            self._series.items(),
            key=lambda item: (order.get(item[0].split(":")[0], len(order)), item[0]),
        )

    def _arrays(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return {name: points.arrays() for name, points in self._ordered()}

    def _plotted(self) -> dict[str, tuple]:
        """context -> (time, samples/s, step seconds, compile seconds taken out, sources)."""
        out = {}
        for name, points in self._ordered():
            t, rate, step = points.arrays()
            compiled = np.fromiter(points.compiled, np.float64, len(points.compiled))
            out[name] = (t, rate, step, compiled, list(points.source))
        return out

    def _update(self, events: list[Event], budgeted: bool) -> bool:
        changed = self._fold(events)
        if changed:
            self._version += 1
            if self._box is not None:
                self._html.value = self.html()
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
        series = self._plotted()
        rates, steps = {}, {}
        for name, (t, rate, step, _, sources) in series.items():
            rates[name] = by_source(t, rate, sources)
            steps[name] = by_source(t, step * 1e3, sources)
        panels = [("samples/s", rates), ("ms per step", steps)]
        title = "throughput per context (compilation left out of step times)"
        return _svg.lines(panels, self._palette(series), title, "time since the view started (s)", log=True)

    def _draw(self, ax_rate: Any, ax_step: Any) -> None:
        series = self._plotted()
        draw_throughput(ax_rate, ax_step, series, self._palette(series))

    def _draw_figure(self, fig: Any) -> None:
        self._draw(*fig.subplots(2, 1, sharex=True))
