"""The dashboard: the header, device map, memory over time, transfers and throughput in one view,
and the launch table once there has been a launch (with ``cluster=``: the cluster's engines, and
every rank's contexts in the panels)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._ledger import Event, Ledger
from ._base import LiveView, check_cluster
from ._devicemap import DeviceMap
from ._header import Header
from ._launches import LaunchView
from ._live import Budget, next_due
from ._memory import MemoryView
from ._throughput import ThroughputView
from ._transfers import TransferView

PANEL_RATE = 2.0  # refreshes per second of the transfer and throughput panels, pictures and tables
MEMORY_PICTURE_RATE = 1.0  # redraws per second of the memory panel's picture (its samples: 4)


class Dashboard(LiveView):
    """The header, device map, memory over time, transfers and throughput in one live widget
    (text elsewhere); below them the ranks of the running or last ``mg.launch``, once there has
    been one. ``dash.watch(trainer)`` draws a trainer's state as bands in the memory panel.

    ``mg.Dashboard(cluster=c)`` shows an ``mg.Cluster``'s ranks beside this kernel's work, live
    while their cells run: every rank's contexts (``r1/dev2``) in the device map (with the
    rank's host and pid), the transfer heatmap (with the collectives of their steps),
    throughput and memory over time, and below them the engines with their state and last
    heartbeat (``0.3 s ago, step 120``).

    Args:
      contexts: show only these contexts (default: all).
      max_rows: recent transfers listed, 1 to 1000.
      history: throughput points kept per context, 2 to 100000.
      rate: refreshes per second, above 0 and at most 10 (the panels at most their own: the
        header 1, the device map and launches 2, memory, transfers and throughput 4).
      ledger: the ledger to follow (default ``mg.ledger()``).
      widget: True for an ipywidgets widget, False for text, None for a widget inside a
        Jupyter kernel and text elsewhere.
      live: a widget is refreshed by a background thread, also while a cell runs; False:
        only when you call ``refresh()``.
      cluster: an ``mg.Cluster`` whose ranks to show too (default: this kernel's work alone).

    >>> import mgkit as mg
    >>> _ = mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    >>> print(mg.Dashboard(widget=False))  # doctest: +ELLIPSIS
    mgkit ... | jax ... | backend cpu | ...
    <BLANKLINE>
    mgkit device map: 2 context(s), current (*) dev0
    ...
    """

    polls = True
    css_class = "mgkit-dashboard"
    figsize = (11.0, 11.0)

    def __init__(
        self,
        contexts: Iterable[str] | None = None,
        max_rows: int = 10,
        history: int = 300,
        rate: float = 10.0,
        ledger: Ledger | None = None,
        widget: bool | None = None,
        live: bool = True,
        cluster: Any = None,
    ):
        super().__init__(rate, ledger, widget, live, contexts)
        self.cluster = check_cluster(cluster, self._where)
        mode, cluster = self._as_widget, self.cluster
        self.header = Header(rate=min(rate, 1.0), widget=mode, live=False)
        self.devices = DeviceMap(contexts, rate=min(rate, 2.0), widget=mode, live=False, cluster=cluster)
        self.memory = MemoryView(
            contexts, min(rate, 4.0), ledger=self._ledger, widget=mode, live=False, cluster=cluster
        )
        self.memory.picture_rate = min(rate, MEMORY_PICTURE_RATE)
        panel = min(rate, PANEL_RATE)  # the pictures redraw no faster: their tables follow them
        self.transfers = TransferView(contexts, max_rows, panel, self._ledger, mode, live=False)
        self.throughput = ThroughputView(contexts, history, panel, self._ledger, mode, live=False)
        self.launches = LaunchView(
            rate=min(rate, 2.0), ledger=self._ledger, widget=mode, live=False, cluster=cluster
        )
        self.views = (self.header, self.devices, self.memory, self.transfers, self.throughput, self.launches)
        self._start()

    def watch(self, trainer: Any) -> Dashboard:
        """Draws ``trainer``'s parameters, optimizer state and batch as bands in the memory panel
        (``MemoryView.watch``); returns the dashboard."""
        self.memory.watch(trainer)
        return self

    def _shown(self) -> tuple[LiveView, ...]:
        """The views shown: the launch table only once there is a launch to show."""
        return self.views if self.launches.active else self.views[:-1]

    def _show_launches(self) -> None:
        """Adds the launch table's widget below the others when the first launch appears."""
        if self._box is None or not self.launches.active:
            return
        with self._lock:  # the live thread and a refresh() on the main thread may both get here
            box, launches = self._box, self.launches.widget
            if all(c is not launches for c in box.children):
                box.children = (*box.children, launches)

    def _update(self, events: list[Event], budgeted: bool) -> bool:
        changed = any([view._refresh(budgeted) for view in self.views])
        self._show_launches()
        return changed

    def _tick(self, now: float, budget: Budget) -> bool:
        """Ticks the panels, the one due longest first: while the budget is short they take turns,
        and a costly one cannot starve the others."""
        if self.closed or now < self._next:
            return False
        self._next = next_due(self._next, now, self.rate)
        turns = sorted(self.views, key=lambda view: view._next)
        changed = any([view._tick(now, budget) for view in turns])
        self._show_launches()
        self.updates += changed
        return changed

    def close(self) -> None:
        for view in self.views:
            view.close()
        super().close()

    def text(self) -> str:
        return "\n\n".join(view.text() for view in self._shown())

    def html(self) -> str:
        return "".join(view.html() for view in self._shown())

    def _build(self, widgets: Any) -> Any:
        return widgets.VBox([view.widget for view in self._shown()])

    def _draw_figure(self, fig: Any) -> None:
        grid = fig.add_gridspec(4, 2, height_ratios=[1.3, 1, 1, 1])
        self.devices._draw(fig.add_subplot(grid[0, 0]))
        self.transfers._draw(fig.add_subplot(grid[0, 1]))
        self.memory._draw_total(fig.add_subplot(grid[1, :]))
        ax_rate = fig.add_subplot(grid[2, :])
        self.throughput._draw(ax_rate, fig.add_subplot(grid[3, :], sharex=ax_rate))
        fig.suptitle(self.header.text(), fontsize=8, family="monospace")
