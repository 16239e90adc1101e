"""The transfers view: the newest transfers, totals, and a heatmap of bytes moved between contexts."""

from __future__ import annotations

import collections
import heapq
import html
import operator
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

from .. import _contexts
from .._ledger import Event, Kind, Ledger, Matrix, short_label
from .._table import human_bytes
from . import _svg
from ._base import Plotted
from ._format import cell_name, gbps
from ._live import check_count
from ._png import draw_heatmap

_START = operator.attrgetter("start")


class TransferView(Plotted):
    """The most recent transfers, totals, and a heatmap of bytes moved between contexts.

    Totals and the heatmap count every transfer since the ledger was last cleared (like
    ``mg.ledger().summary()``); the table lists the newest ``max_rows`` transfers. They include
    the collectives XLA runs inside mgkit's compiled programs (``collective`` events: the bytes
    each context sends to the next in a ring, read from the program, not timed) unless
    ``collectives=False`` (or the widget's "collectives" box is unticked): then only the moves
    mgkit makes itself. The average GB/s counts mgkit's timed moves only.

    Args:
      contexts: show only transfers from or to these contexts (default: all).
      max_rows: how many recent transfers to list, 1 to 1000.
      rate: refreshes per second, above 0 and at most 10.
      ledger: the ledger to follow (default ``mg.ledger()``).
      widget: True for an ipywidgets widget, False for text, None for a widget inside a
        Jupyter kernel and text elsewhere.
      live: a widget is refreshed by a background thread, also while a cell runs; False:
        only when you call ``refresh()``.
      collectives: show the collectives inside compiled programs too (``view.collectives``
        changes it later).

    >>> import mgkit as mg
    >>> _ = mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    >>> mg.ledger().clear()
    >>> view = mg.TransferView(widget=False)
    >>> _ = mg.transfer(mg.put(1.0, "dev0"), "dev1")
    >>> mg.ledger().flush()
    True
    >>> print(view)  # doctest: +ELLIPSIS
    mgkit transfers: 2 (8 B moved...)
    ...
    """

    kinds = Kind.MOVES | {Kind.COLLECTIVE}
    css_class = "mgkit-transfers"
    figsize = (6.0, 5.0)
    headers = ("kind", "from", "to", "bytes", "GB/s", "cell")

    def __init__(
        self,
        contexts: Iterable[str] | None = None,
        max_rows: int = 10,
        rate: float = 10.0,
        ledger: Ledger | None = None,
        widget: bool | None = None,
        live: bool = True,
        collectives: bool = True,
    ):
        super().__init__(rate, ledger, widget, live, contexts)
        self._collectives = _check_flag(collectives, "collectives", self._where)
        self._toggle: Any = None  # the widget's "collectives" checkbox
        self.max_rows = check_count(max_rows, "max_rows", self._where, 1, 1000, 10)
        self.fold_limit = (
            self.max_rows
        )  # entries, the newest (each one event or more): the table lists no more
        self._recent: collections.deque[Event] = collections.deque(maxlen=self.max_rows)
        self._totals: dict[tuple[str, str, str], tuple[int, int, float]] = {}
        self.count = 0
        self.nbytes = 0
        self.seconds = 0.0
        self.collective_count = 0  # collective events shown (0 when ``collectives`` is False)
        self.collective_bytes = 0  # their bytes sent
        self._matrix = Matrix([], np.zeros((0, 0), dtype=np.int64))
        self._start()

    @property
    def collectives(self) -> bool:
        """Whether the collectives inside compiled programs are shown (set it to change)."""
        return self._collectives

    @collectives.setter
    def collectives(self, on: bool) -> None:
        on = _check_flag(on, "collectives", self._where)
        with self._lock:
            if on == self._collectives:
                return
            self._collectives = on
            self._recent.clear()
            self._seed()
            self._totals = {}  # folded again on the refresh below
            self.count = self.collective_count = 0  # not read as the ledger cleared
            if self._toggle is not None:
                self._toggle.value = on
        self.refresh()

    def _shown(self) -> frozenset[str]:
        return self.kinds if self._collectives else Kind.MOVES

    def _keep(self, src: str, dst: str) -> bool:
        return self.contexts is None or src in self.contexts or dst in self.contexts

    def _seed(self) -> None:
        shown = self._shown()
        events = [e for e in self._ledger.records() if e.kind in shown and self._keep(e.src, e.dst)]
        self._recent.extend(events[-self.max_rows :])

    def recent(self) -> list[Event]:
        """The newest transfers, newest first."""
        self.refresh()
        return list(reversed(self._recent))

    def matrix(self) -> Matrix:
        """Bytes moved between every pair of names shown (row: from, column: to)."""
        self.refresh()
        return self._matrix

    def _fold_totals(self, totals: dict) -> None:
        names = list(self.contexts or _contexts.context_map().names)
        count = nbytes = inside = inside_bytes = 0
        seconds = 0.0
        kept = []
        shown = self._shown()
        for (kind, src, dst), (c, b, t) in totals.items():
            if kind not in shown or not self._keep(src, dst):
                continue
            if kind == Kind.COLLECTIVE:
                inside, inside_bytes = inside + c, inside_bytes + b
            else:
                count, nbytes, seconds = count + c, nbytes + b, seconds + t
            kept.append((src, dst, b))
            names.extend(n for n in (src, dst) if n not in names)
        values = np.zeros((len(names), len(names)), dtype=np.int64)
        index = {n: i for i, n in enumerate(names)}
        for src, dst, b in kept:
            values[index[src], index[dst]] += b
        if count + inside < self.count + self.collective_count:  # the ledger was cleared
            self._recent.clear()
        self.count, self.nbytes, self.seconds = count, nbytes, seconds
        self.collective_count, self.collective_bytes = inside, inside_bytes
        self._matrix = Matrix(names, values)

    def _update(self, events: list[Event], budgeted: bool) -> bool:
        totals = self._ledger.totals()
        changed = False
        if totals != self._totals:
            self._totals = totals
            old = self._matrix
            self._fold_totals(totals)
            if old.names != self._matrix.names or not np.array_equal(old.values, self._matrix.values):
                self._version += 1
            changed = True
        if self.contexts is not None or not self._collectives:
            shown = self._shown()
            events = [e for e in events if e.kind in shown and self._keep(e.src, e.dst)]
        if events:  # copies finish out of order: the table lists the newest by start, like the ledger
            # (they are recorded nearly in order: the newest by start are among the last recorded)
            newest = heapq.nlargest(self.max_rows, events[-max(8 * self.max_rows, 256) :], key=_START)
            merged = sorted([*self._recent, *newest], key=_START)[-self.max_rows :]
            self._recent.clear()
            self._recent.extend(merged)
            changed = True
        if self._box is not None and changed:
            self._count_label.value = f"transfers: {self.count}"
            self._html.value = self._table(self._recent_title(), as_html=True)
        return self._redraw(budgeted) or changed

    def _title(self) -> str:
        title = (
            f"mgkit transfers: {self.count} ({human_bytes(self.nbytes)} moved, "
            f"{gbps(self.nbytes, self.seconds)} GB/s per transfer on average)"
        )
        if self.collective_count:
            title += (
                f"; collectives inside compiled programs: {human_bytes(self.collective_bytes)} sent "
                f"in {self.collective_count} event(s), read from the programs"
            )
        return title

    def _picture_title(self) -> str:
        inside = f", {self.collective_count} collective" if self.collective_count else ""
        return f"bytes moved ({self.count} transfers{inside})"

    def _rows(self) -> list[tuple]:
        return [
            (
                e.kind,
                short_label(e.src),
                short_label(e.dst),
                human_bytes(e.nbytes),
                gbps(e.nbytes, e.seconds),
                cell_name(e.label),
            )
            for e in reversed(self._recent)
        ]

    def _recent_title(self) -> str:
        return f"{len(self._recent)} most recent (newest first)"

    def text(self) -> str:
        return f"{self._title()}\n{self._table(self._recent_title())}\n{self._matrix!r}"

    def html(self) -> str:
        return (
            f"<div><b>{html.escape(self._title())}</b>{self._table(self._recent_title(), as_html=True)}"
            f"{self._matrix._repr_html_()}</div>"
        )

    def _build(self, widgets: Any) -> Any:
        self._count_label = widgets.Label()
        self._count_label.add_class("mgkit-transfer-count")
        self._html = widgets.HTML()
        self._plot = widgets.HTML()
        title = widgets.HTML("<b>mgkit transfers</b>")
        self._toggle = widgets.Checkbox(value=self._collectives, description="collectives", indent=False)
        self._toggle.add_class("mgkit-transfer-collectives")
        self._toggle.observe(_toggled(weakref.ref(self)), names="value")
        return widgets.VBox(
            [widgets.HBox([title, self._count_label, self._toggle]), widgets.HBox([self._html, self._plot])]
        )

    def svg(self) -> str:
        m = self._matrix
        return _svg.heatmap(
            m.names, m.values, self._picture_title(), lambda v: human_bytes(int(v)), short_label
        )

    def _draw(self, ax: Any) -> None:
        draw_heatmap(ax, self._matrix.names, self._matrix.values, self._picture_title())

    def _draw_figure(self, fig: Any) -> None:
        self._draw(fig.subplots())


def _toggled(ref: weakref.ref) -> Any:
    """The checkbox's callback: sets the view's ``collectives`` (a weak reference, so a forgotten
    view is still collected)."""

    def toggled(change: dict) -> None:
        view = ref()
        if view is not None:
            view.collectives = change["new"]

    return toggled


def _check_flag(value: Any, name: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(
            f"{where}: {name} must be True (show the collectives inside compiled programs) or False "
            f"(mgkit's own moves alone), got {type(value).__name__} {value!r}"
        )
    return value
