"""What every view shares: ``LiveView`` (arguments, the ledger feed, the widget, refresh, close,
text, HTML and ``save_png``) and ``Plotted``, a view with a live SVG picture.

A view's widget is made only when asked for (ipywidgets is imported then); ``save_png`` draws
with matplotlib (``_png``). Text works without either.
"""

from __future__ import annotations

import abc
import os
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any, ClassVar

from .. import _contexts
from .._errors import ContextError, missing
from .._ledger import Event, Ledger
from .._table import html_table, text_table
from ._live import (
    DRAW_SHARE,
    PICTURE_RATE,
    REFRESHER,
    Budget,
    Feed,
    check_count,
    check_ledger,
    check_rate,
    in_kernel,
    next_due,
)
from ._png import figure, require_matplotlib, write_png


def require_ipywidgets(where: str) -> Any:
    """The ipywidgets module, or an ImportError saying how to install it."""
    try:
        import ipywidgets
    except ImportError as e:
        instead = (
            "or pass widget=False to get the text view (print(view)) and view.save_png(path) for a picture."
        )
        raise missing(
            where,
            "is shown in notebooks as a widget, with",
            "ipywidgets",
            "pip install 'ipywidgets>=8.1'",
            instead,
        ) from e
    return ipywidgets


class LiveView(abc.ABC):
    """What every view shares: arguments, the ledger feed, the widget, refresh and close.

    A subclass sets its state, then calls ``_start()``; it implements ``_update(events,
    budgeted)`` (fold events into its state and set widget values; True when anything
    changed), ``text()``, ``html()`` and ``_draw_figure(fig)``; ``_build(widgets)`` where its
    widget is more than one HTML widget showing ``html()`` (``_show_html()`` updates that one).
    """

    kinds: ClassVar[frozenset[str] | None] = None  # event kinds the view follows; None: no feed
    exclude: ClassVar[bool] = False  # True: every kind except ``kinds``
    polls: ClassVar[bool] = False  # True: refresh on every tick, events or not
    samples: ClassVar[bool] = False  # True: when due while the budget is spent, ``_when_spent()``
    css_class: ClassVar[str] = ""
    headers: ClassVar[tuple[str, ...]] = ()  # the columns of the view's table
    figsize: ClassVar[tuple[float, float]] = (7.0, 4.5)  # inches, for save_png

    def __init__(
        self, rate: float, ledger: Ledger | None, widget: bool | None, live: bool, contexts: Any = None
    ):
        self._where = f"mg.{type(self).__name__}()"
        self.rate = check_rate(rate, self._where)
        self._ledger = check_ledger(ledger, self._where)
        if widget is not None and not isinstance(widget, bool):
            raise TypeError(
                f"{self._where}: widget must be True (an ipywidgets widget), False (text) or None "
                f"(a widget inside a Jupyter kernel, text elsewhere), got {widget!r}"
            )
        self._as_widget = in_kernel() if widget is None else widget
        if not isinstance(live, bool):
            raise TypeError(
                f"{self._where}: live must be True (refreshed by a background thread while cells run) "
                f"or False (call view.refresh() yourself), got {live!r}"
            )
        self.live = live
        self.contexts = check_contexts(contexts, self._where)
        self._lock = threading.RLock()
        self._feed: Feed | None = None
        self._next = 0.0  # when the live thread refreshes it next, at the earliest (time.monotonic)
        self._due = 0.0  # when the live thread's refresh now running was due
        self.spent = 0.0  # CPU seconds its refreshes by the live thread took, in all
        self.fold_limit: int | None = None  # entries a live refresh folds at most (the newest)
        self._box: Any = None
        self._html: Any = None  # the HTML widget, where the view has one
        self.updates = 0
        self.errors = 0
        self.closed = False

    def _start(self) -> None:
        widgets = require_ipywidgets(self._where) if self._as_widget else None
        self._seed()
        if self.kinds is not None:
            self._feed = Feed(self._ledger, self.kinds, self.exclude)
            weakref.finalize(self, self._feed.close)
        if widgets is not None:
            self._box = self._build(widgets)
            self._box.add_class(self.css_class)
        self.refresh()
        if self.live and self._box is not None:
            REFRESHER.add(self)

    # -- subclass hooks ----------------------------------------------------------------------

    def _seed(self) -> None:  # noqa: B027 - most views start empty
        """Takes what the ledger already holds, before the feed starts."""

    @abc.abstractmethod
    def _update(self, events: list[Event], budgeted: bool) -> bool:
        """Folds new events into the view's state and sets widget values; True when anything changed."""

    def _stale(self) -> bool:
        """True when something is waiting to be drawn even without new events."""
        return False

    def _defer(self, due: float, budget: Budget) -> bool:
        """True when a refresh due at ``due`` had better wait for a later tick although there is
        credit."""
        return False

    def _when_spent(self) -> bool:
        """What a view with ``samples`` does when due while the live thread's budget is spent
        (the memory view: its sample, nothing drawn); True when anything changed."""
        return False

    @abc.abstractmethod
    def text(self) -> str:
        """The view as plain text."""

    @abc.abstractmethod
    def html(self) -> str:
        """The view as static HTML."""

    def _build(self, widgets: Any) -> Any:
        """Makes the view's widgets (on the main thread); returns the box that holds them. Here:
        one HTML widget that shows ``html()``."""
        self._html = widgets.HTML()
        return widgets.VBox([self._html])

    def _show_html(self) -> None:
        """Sets the view's HTML widget to ``html()`` (a text view has none)."""
        if self._box is not None:
            self._html.value = self.html()

    @abc.abstractmethod
    def _draw_figure(self, fig: Any) -> None:
        """Draws the view onto an empty matplotlib figure."""

    def _rows(self) -> list[tuple]:
        """The rows of the view's table, as shown."""
        return []

    def _table(self, title: str, as_html: bool = False) -> str:
        return (html_table if as_html else text_table)(self.headers, self._rows(), title)

    def _figsize(self) -> tuple[float, float]:
        return self.figsize

    def _figure(self) -> Any:
        """A new figure of the view, for save_png."""
        fig = figure(*self._figsize())
        self._draw_figure(fig)
        return fig

    # -- refreshing --------------------------------------------------------------------------

    @property
    def widget(self) -> Any:
        """The ipywidgets box (None for a text view)."""
        return self._box

    @property
    def pending(self) -> int:
        """Ledger entries waiting in the view's buffer for the next refresh (an event each, or
        one call's events)."""
        return len(self._feed) if self._feed is not None else 0

    @property
    def skipped(self) -> int:
        """Ledger entries the live refreshes left out, in all: under a heavy stream a refresh
        folds the newest ``fold_limit`` only (totals still count every one)."""
        return self._feed.skipped if self._feed is not None else 0

    def refresh(self) -> bool:
        """Applies what happened since the last refresh: folds new events in, sets widget values
        and redraws plots. The live thread calls this at most ``rate`` times a second; call it
        yourself for an immediate update. Returns whether anything shown changed."""
        return self._refresh(budgeted=False)

    def _refresh(self, budgeted: bool) -> bool:
        with self._lock:
            if self.closed:
                return False
            limit = self.fold_limit if budgeted else None
            events = self._feed.drain(limit) if self._feed is not None else []
            changed = bool(self._update(events, budgeted))
            self.updates += changed
            return changed

    def _tick(self, now: float, budget: Budget) -> bool:
        """The live thread's call: refreshes when due (rate), when there is something to show
        and while ``budget`` has credit (else, or when ``_defer``, a view that ``samples`` only
        samples), and charges the refresh's CPU time to ``budget``. A due view left out stays
        due for the next tick."""
        if self.closed or now < self._next:
            return False
        if not (self.polls or self.pending or self._stale()):
            return False
        # the time it was due (or now, when it fell a period behind): pictures keep to that grid
        due = self._next if now - self._next < 1.0 / self.rate else now
        full = budget.allows() and not self._defer(due, budget)
        if not (full or self.samples):
            return False
        self._due = due
        self._next = next_due(self._next, now, self.rate)
        t0 = time.thread_time()
        try:
            return self._refresh(budgeted=True) if full else self._when_spent()
        finally:
            cost = time.thread_time() - t0
            budget.charge(cost)
            self.spent += cost

    def close(self) -> None:
        """Stops following the ledger and refreshing; a displayed widget keeps its last values."""
        with self._lock:
            self.closed = True
            if self._feed is not None:
                self._feed.close()
        REFRESHER.discard(self)

    def __enter__(self) -> LiveView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- showing -----------------------------------------------------------------------------

    def __repr__(self) -> str:
        self.refresh()
        return self.text()

    def _repr_mimebundle_(self, include: Iterable[str] | None = None, exclude: Iterable[str] | None = None):
        self.refresh()
        if self._box is not None:
            bundle = self._box._repr_mimebundle_(include=include, exclude=exclude)
            bundle["text/plain"] = self.text()
            return bundle
        return {"text/plain": self.text(), "text/html": self.html()}

    def save_png(self, path: str | os.PathLike, dpi: int = 100) -> str:
        """Writes a static picture of the view (matplotlib, no notebook needed); returns the path.

        Args:
          path: a file name ending in ``.png``; its folder must exist.
          dpi: dots per inch, 30 to 600.
        """
        if not isinstance(path, str | os.PathLike):
            raise TypeError(
                f"save_png(path): path must be a str or os.PathLike, got {type(path).__name__} {path!r}"
            )
        path = os.fspath(path)
        if not path.lower().endswith(".png"):
            raise ValueError(f"save_png({path!r}) writes PNG pictures; give a file name ending in .png")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise FileNotFoundError(
                f"save_png({path!r}): the folder {folder!r} does not exist; create it first "
                "(os.makedirs(folder, exist_ok=True))"
            )
        dpi = check_count(dpi, "dpi", f"{self._where}.save_png", 30, 600, 100)
        require_matplotlib(f"{self._where}.save_png")
        self.refresh()
        with self._lock:
            fig = self._figure()
        write_png(fig, path, dpi)
        return path


def check_contexts(contexts: Any, where: str) -> tuple[str, ...] | None:
    """The context names a view is limited to (None: every context), checked against the map."""
    if contexts is None:
        return None
    if isinstance(contexts, str):
        contexts = [contexts]
    elif not isinstance(contexts, list | tuple | set | frozenset):
        raise TypeError(
            f"{where}: contexts must be a list of context names (or None for all), got "
            f"{type(contexts).__name__} {contexts!r}; e.g. contexts=['dev0', 'dev1']"
        )
    names = list(contexts)
    known = _contexts.context_map().names
    if not names:
        raise ValueError(
            f"{where}: contexts is empty; pass None to show every context, or some of {', '.join(known)}"
        )
    for name in names:
        if not isinstance(name, str):
            raise TypeError(
                f"{where}: context names are strings, got {type(name).__name__} {name!r} in {contexts!r}"
            )
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ContextError(
            f"{where}: unknown context(s) {', '.join(map(repr, unknown))}; the contexts are "
            f"{', '.join(known)}. Define more with mg.use_contexts(...) first, or pass contexts=None."
        )
    return tuple(dict.fromkeys(names))


def check_cluster(cluster: Any, where: str) -> Any:
    """The ``mg.Cluster`` whose ranks a view shows besides this kernel's work (None: none)."""
    if cluster is None:
        return None
    from ..cluster import Cluster  # the cluster module imports no view: no cycle, no widget

    if not isinstance(cluster, Cluster):
        raise TypeError(
            f"{where}: cluster must be an mg.Cluster whose ranks to show beside this kernel's work "
            f"(c = mg.Cluster(engines=2); cluster=c), or None for this kernel alone; got "
            f"{type(cluster).__name__} {cluster!r:.80}"
        )
    if cluster.closed:
        raise ValueError(
            f"{where}: cluster={repr(cluster).splitlines()[0]!r} is closed, so it has no ranks to show; "
            "start a new one (c = mg.Cluster(...)) and pass that, or pass cluster=None"
        )
    return cluster


class Plotted(LiveView):
    """A view with a live SVG picture: redrawn when its data changed, within a time budget."""

    def __init__(self, rate: float, ledger: Ledger | None, widget: bool | None, live: bool, contexts: Any):
        super().__init__(rate, ledger, widget, live, contexts)
        self._plot: Any = None  # the HTML widget that shows the picture
        self._version = 0  # bumped when the data behind the picture changes
        self._drawn = -1
        self._draw_next = 0.0
        self.redraws = 0
        self.drawing = 0.0  # CPU seconds the redraws took, in all
        self.picture_rate = min(self.rate, PICTURE_RATE)  # live redraws per second, at most

    def _stale(self) -> bool:
        return self._plot is not None and self._drawn != self._version

    def _defer(self, due: float, budget: Budget) -> bool:
        """While the budget is short, a refresh waits until its picture may be redrawn too (the
        table then follows the picture, and the budget goes to pictures)."""
        return self._plot is not None and budget.short() and due < self._draw_next

    @abc.abstractmethod
    def svg(self) -> str:
        """The view's live picture, as SVG."""

    def _redraw(self, budgeted: bool) -> bool:
        """Redraws the picture if its data changed; from the live thread only when the budget
        allows (at most ``picture_rate`` a second, drawing at most DRAW_SHARE of the wall time)."""
        if not self._stale():
            return False
        # live: on the grid of the times the view was due, so ticks a little late keep the rate
        at = self._due if budgeted else time.monotonic()
        if budgeted and at < self._draw_next:
            return False
        t0 = time.thread_time()
        version = self._version
        self._plot.value = self.svg()
        cost = time.thread_time() - t0
        self._draw_next = at + max(1.0 / self.picture_rate, cost / DRAW_SHARE)
        self._drawn = version
        self.redraws += 1
        self.drawing += cost
        return True
