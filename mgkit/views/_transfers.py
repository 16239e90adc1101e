"""The transfers view: the newest transfers, totals, and a heatmap of bytes moved between contexts."""

from __future__ import annotations

import collections
import heapq
import html
import operator
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
    ``mg.ledger().summary()``); the table lists the newest ``max_rows`` transfers.

    Args:
      contexts: show only transfers from or to these contexts (default: all).
      max_rows: how many recent transfers to list, 1 to 1000.
      rate: refreshes per second, above 0 and at most 10.
      ledger: the ledger to follow (default ``mg.ledger()``).
      widget: True for an ipywidgets widget, False for text, None for a widget inside a
        Jupyter kernel and text elsewhere.
      live: a widget is refreshed by a background thread, also while a cell runs; False:
        only when you call ``refresh()``.

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

    kinds = Kind.MOVES
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
    ):
        super().__init__(rate, ledger, widget, live, contexts)
        self.max_rows = check_count(max_rows, "max_rows", self._where, 1, 1000, 10)
        self._recent: collections.deque[Event] = collections.deque(maxlen=self.max_rows)
        self._totals: dict[tuple[str, str, str], tuple[int, int, float]] = {}
        self.count = 0
        self.nbytes = 0
        self.seconds = 0.0
        self._matrix = Matrix([], np.zeros((0, 0), dtype=np.int64))
        self._start()

    def _keep(self, src: str, dst: str) -> bool:
        return self.contexts is None or src in self.contexts or dst in self.contexts

    def _seed(self) -> None:
        events = [e for e in self._ledger.records() if e.kind in Kind.MOVES and self._keep(e.src, e.dst)]
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
        count = nbytes = 0
        seconds = 0.0
        kept = []
        for (kind, src, dst), (c, b, t) in totals.items():
            if kind not in Kind.MOVES or not self._keep(src, dst):
                continue
            count, nbytes, seconds = count + c, nbytes + b, seconds + t
            kept.append((src, dst, b))
            names.extend(n for n in (src, dst) if n not in names)
        values = np.zeros((len(names), len(names)), dtype=np.int64)
        index = {n: i for i, n in enumerate(names)}
        for src, dst, b in kept:
            values[index[src], index[dst]] += b
        if count < self.count:  # the ledger was cleared
            self._recent.clear()
        self.count, self.nbytes, self.seconds = count, nbytes, seconds
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
        if self.contexts is not None:
            events = [e for e in events if self._keep(e.src, e.dst)]
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
        return (
            f"mgkit transfers: {self.count} ({human_bytes(self.nbytes)} moved, "
            f"{gbps(self.nbytes, self.seconds)} GB/s per transfer on average)"
        )

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
        return widgets.VBox(
            [widgets.HBox([title, self._count_label]), widgets.HBox([self._html, self._plot])]
        )

    def svg(self) -> str:
        m = self._matrix
        title = f"bytes moved ({self.count} transfers)"
        return _svg.heatmap(m.names, m.values, title, lambda v: human_bytes(int(v)), short_label)

    def _draw(self, ax: Any) -> None:
        draw_heatmap(ax, self._matrix.names, self._matrix.values, f"bytes moved ({self.count} transfers)")

    def _draw_figure(self, fig: Any) -> None:
        self._draw(fig.subplots())
