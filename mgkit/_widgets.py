"""Live views of devices, transfers, throughput and launches: widgets in notebooks, text elsewhere.

Each view follows the ledger through a bounded feed and is refreshed by one shared background
thread (``_live``) at most ``rate`` times a second, so it updates while a long cell runs.
Live pictures (the bytes heatmap, the throughput lines) are SVG in HTML widgets (``_svg``),
about a millisecond each; ``save_png`` draws with matplotlib on ``Figure`` objects with an Agg
canvas (no pyplot, no display). ipywidgets is imported only when a widget is made, matplotlib
only when a picture is saved.
"""

from __future__ import annotations

import abc
import collections
import heapq
import html
import math
import operator
import os
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from . import _contexts, _devices, _svg
from ._errors import ContextError
from ._ledger import Event, Ledger, Matrix, short_label
from ._live import (
    COMPILES,
    DRAW_SHARE,
    PICTURE_RATE,
    REFRESHER,
    CompileClock,
    Feed,
    Throttled,
    check_count,
    check_ledger,
    check_rate,
    in_kernel,
)
from ._table import html_table, human_bytes, text_table
from .launching import _launch
from .launching._result import TAIL, RankInfo

_START = operator.attrgetter("start")
COMPUTE_KINDS = frozenset({"step", "run", "forward", "backward", "update"})
"""Event kinds that are work on a context; every other kind moves bytes."""
RATE_KINDS = frozenset({"step", "run"})
"""Compute events that say how many samples they processed."""


def require_ipywidgets(where: str) -> Any:
    """The ipywidgets module, or an ImportError saying how to install it."""
    try:
        import ipywidgets
    except ImportError as e:
        raise ImportError(
            f"{where} is shown as an ipywidgets widget in notebooks, and ipywidgets is not installed. "
            "Install it with `pip install 'ipywidgets>=8.1'` and restart the kernel; or pass "
            "widget=False to get the text view (print(view)) and view.save_png(path) for a picture."
        ) from e
    return ipywidgets


def require_matplotlib(where: str) -> None:
    """Checks that matplotlib imports (for save_png), else raises an ImportError saying how to
    install it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"{where} draws its pictures with matplotlib, which is not installed. Install it with "
            "`pip install 'matplotlib>=3.8'`; the text view (print(view)) works without it."
        ) from e


# -- pictures --------------------------------------------------------------------------------

_ANNOTATE_UP_TO = 12  # write the bytes into heatmap cells when there are at most this many names
_CURRENT = "#f5a623"
_BAR = "#4c78a8"
_LIVE = "#72b7b2"  # bars of live arrays' bytes (no limit known)


def figure(width: float, height: float, dpi: int = 100) -> Any:
    """A matplotlib Figure with an Agg canvas (no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def write_png(fig: Any, path: str, dpi: int) -> None:
    fig.savefig(path, format="png", dpi=dpi)


def _bar_share(used: int | None, limit: int | None, top: int) -> float | None:
    """A memory bar's length from 0 to 1: the share of the limit where the device reports one,
    else (live arrays) the share of ``top``, the most any such device holds; None: no bar."""
    if used is None:
        return None
    if limit:
        return min(used / limit, 1.0)
    return used / top if top else 0.0


def draw_memory(ax, rows: Sequence[tuple[str, str, int | None, int | None, bool]]) -> None:
    """Horizontal bars per context: memory in use as a share of the limit where the device
    reports one, else the live arrays' bytes as a share of the most any context's device holds;
    ``n/a`` where nothing is known.

    rows: (context, device, bytes in use, byte limit, is current).
    """
    ax.clear()
    y = np.arange(len(rows))
    top = max((used for _, _, used, limit, _ in rows if used and not limit), default=0)
    kinds = set()
    for i, (_, _, used, limit, current) in enumerate(rows):
        share = _bar_share(used, limit, top)
        if share is not None:
            kinds.add("limit" if limit else "live")
            color = _CURRENT if current else (_BAR if limit else _LIVE)
            ax.barh(i, share, color=color)
        if used is None and limit is None:
            note = "n/a"
        elif limit:
            note = f"{'?' if used is None else human_bytes(used)} / {human_bytes(limit)}"
        else:
            note = f"{human_bytes(used)} in live arrays"
        ax.text(0.01, i, note, va="center", fontsize=8)
    ax.set_yticks(y, [f"{'* ' if r[4] else ''}{r[0]} -> {r[1]}" for r in rows], fontsize=8)
    for tick, row in zip(ax.get_yticklabels(), rows, strict=True):
        if row[4]:
            tick.set_fontweight("bold")
    ax.set_xlim(0, 1)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    if kinds == {"live"}:
        label = f"bytes held by live jax arrays (bar: share of the largest, {human_bytes(top)})"
    elif kinds == {"limit"} or not kinds:
        label = "memory in use / limit (device allocator)"
    else:
        label = "in use / limit (allocator), or live arrays / the largest (no statistics)"
    ax.set_xlabel(label, fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title("memory per context (* current context)", fontsize=9)


def draw_heatmap(ax, names: Sequence[str], values: np.ndarray, title: str) -> None:
    """Bytes moved from each name (row) to each name (column), log colour scale."""
    ax.clear()
    labels = [short_label(n) for n in names]
    if not names:
        ax.text(0.5, 0.5, "no transfers yet", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    from matplotlib.colors import LogNorm

    ax.set_axis_on()
    masked = np.ma.masked_equal(values.astype(np.float64), 0.0)
    top = float(values.max()) if values.size else 0.0
    norm = LogNorm(vmin=max(1.0, float(masked.min())), vmax=max(top, 2.0)) if top > 0 else None
    image = ax.imshow(masked, cmap="viridis", norm=norm, aspect="auto")
    ax.set_xticks(range(len(names)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(names)), labels, fontsize=7)
    ax.set_xlabel("to", fontsize=8)
    ax.set_ylabel("from", fontsize=8)
    ax.set_title(title, fontsize=9)
    if len(names) <= _ANNOTATE_UP_TO:
        for (i, j), v in np.ndenumerate(values):
            if v:
                color = "black" if image.norm(v) > 0.6 else "white"
                ax.text(j, i, human_bytes(int(v)), ha="center", va="center", fontsize=6, color=color)


_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "<", ">", "*")


def _log_if_wide(ax: Any, values: list[np.ndarray]) -> None:
    """A log y scale when the positive values span more than a factor of 20."""
    finite = [v[np.isfinite(v) & (v > 0)] for v in values]
    finite = [v for v in finite if v.size]
    if finite and max(v.max() for v in finite) > 20 * min(v.min() for v in finite):
        ax.set_yscale("log")


def draw_throughput(ax_rate, ax_step, series: dict[str, tuple], colors: dict[str, str]) -> None:
    """Samples per second (top) and milliseconds per step (bottom) against time, one colour and
    marker shape per context. Each point is one step event (a fit's iterations since its last)
    or one parallel call; lines join only points of one fit or function, each of which is named
    where it first appears, and a grey ring marks a call whose compilation was taken out of its
    time.

    series: context -> (time in s, samples per second, step seconds, compile seconds taken out,
    the source of each point).
    """
    ax_rate.clear()
    ax_step.clear()
    named: set[str] = set()
    rings = False
    for i, (name, (t, rate, step, compiled, sources)) in enumerate(series.items()):
        color = colors.get(name)
        marker = _MARKERS[i % len(_MARKERS)]
        style = {"ls": "none", "marker": marker, "ms": 5.5, "mfc": "none", "mew": 1.1, "color": color}
        for ax, y in ((ax_rate, rate), (ax_step, step * 1e3)):
            ax.plot(*_by_source(t, y, sources), lw=0.8, alpha=0.5, color=color)
            ax.plot(t, y, **style)
            hot = compiled > 0
            if hot.any():
                rings = True
                ax.plot(t[hot], y[hot], ls="none", marker="o", ms=11, mfc="none", mec="0.55", mew=1.0)
        ax_rate.plot([], [], **{**style, "ls": "-", "lw": 0.8}, label=name)  # the legend's entry
        if len(series) * len(set(sources)) <= 200:
            right = float(np.nanmax(t)) if len(t) else 0.0
            for k, source in enumerate(sources):
                if source and source not in named:
                    named.add(source)
                    left_side = len(named) % 2 == 0  # alternate sides: neighbours do not overlap
                    if t[k] < 0.3 * right or t[k] > 0.7 * right:  # near an edge: face the middle
                        left_side = t[k] > 0.7 * right
                    label = ax_rate.annotate(
                        source,
                        (t[k], rate[k]),
                        xytext=(-7 if left_side else 7, 7 if len(named) % 2 else -12),
                        textcoords="offset points",
                        ha="right" if left_side else "left",
                        fontsize=6.5,
                        color="0.25",
                    )
                    label.set_in_layout(False)
    if rings:
        ax_rate.plot([], [], ls="none", marker="o", ms=9, mfc="none", mec="0.55", label="compiled (left out)")
    if not series:
        ax_rate.text(0.5, 0.5, "no steps yet", ha="center", va="center", transform=ax_rate.transAxes)
    else:
        _log_if_wide(ax_rate, [s[1] for s in series.values()])
        _log_if_wide(ax_step, [s[2] for s in series.values()])
        if len(series) <= 16:
            ax_rate.legend(
                fontsize=7,
                ncols=min(len(series) + rings, 9),
                loc="lower left",
                bbox_to_anchor=(0, 1.0),
                frameon=False,
                handlelength=1.8,
                columnspacing=1.0,
            )
    ax_rate.set_ylabel("samples per second", fontsize=8)
    ax_step.set_ylabel("ms per step\n(compilation left out)", fontsize=8)
    ax_step.set_xlabel(
        "time since the view started (s); a point is a fit's iterations since its last report, "
        "or one parallel call",
        fontsize=7,
    )
    for ax in (ax_rate, ax_step):
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.35)
        ax.margins(x=0.04, y=0.12)
    ax_rate.set_title("throughput per context", fontsize=9, pad=18 if len(series) else 6)


# -- views --------------------------------------------------------------------------------


class LiveView(abc.ABC):
    """What every view shares: arguments, the ledger feed, the widget, refresh and close.

    A subclass sets its state, then calls ``_start()``; it implements ``_update(events,
    budgeted)`` (fold events into its state and set widget values; True when anything
    changed), ``text()``, ``html()``, ``_build(widgets)`` and ``_draw_figure(fig)``.
    """

    kinds: ClassVar[frozenset[str] | None] = None  # event kinds the view follows; None: no feed
    exclude: ClassVar[bool] = False  # True: every kind except ``kinds``
    polls: ClassVar[bool] = False  # True: refresh on every tick, events or not
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
        self._next = 0.0
        self._box: Any = None
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

    @abc.abstractmethod
    def text(self) -> str:
        """The view as plain text."""

    @abc.abstractmethod
    def html(self) -> str:
        """The view as static HTML."""

    @abc.abstractmethod
    def _build(self, widgets: Any) -> Any:
        """Makes the view's widgets (on the main thread); returns the box that holds them."""

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

    def refresh(self) -> bool:
        """Applies what happened since the last refresh: folds new events in, sets widget values
        and redraws plots. The live thread calls this at most ``rate`` times a second; call it
        yourself for an immediate update. Returns whether anything shown changed."""
        return self._refresh(budgeted=False)

    def _refresh(self, budgeted: bool) -> bool:
        with self._lock:
            if self.closed:
                return False
            events = self._feed.drain() if self._feed is not None else []
            changed = bool(self._update(events, budgeted))
            self.updates += changed
            return changed

    def _tick(self, now: float) -> bool:
        """The live thread's call: refreshes when due (rate) and when there is something to show."""
        if self.closed or now < self._next:
            return False
        if not (self.polls or self.pending or self._stale()):
            return False
        self._next = now + 1.0 / self.rate
        return self._refresh(budgeted=True)

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


_MAIN_STACK: list[str] | None = None  # the main thread's ``mg.on`` stack, read by the live thread


def _watch_main_stack() -> None:
    """Keeps a reference to the main thread's ``mg.on`` scope stack (a thread-local list that
    ``mg.on`` appends to and pops from), so the live thread can show the main thread's context."""
    global _MAIN_STACK
    if _MAIN_STACK is None and threading.current_thread() is threading.main_thread():
        stack = getattr(_contexts._local, "stack", None)
        if stack is None:
            stack = _contexts._local.stack = []
        _MAIN_STACK = stack


def shown_current() -> str | None:
    """The current context as the main thread (where cells run) sees it, from any thread."""
    if threading.current_thread() is threading.main_thread():
        return _contexts.current()
    stack = _MAIN_STACK
    if stack:
        try:
            return stack[-1]
        except IndexError:  # popped between the two reads
            pass
    return _contexts.current()


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


def _cell(label: int | None) -> str:
    return "" if label is None else f"In [{label}]"


def _gbps(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}" if seconds > 0 and nbytes else "n/a"


def _duration(seconds: float) -> str:
    """``2.41 ms``, ``310 us``, ``1.20 s``."""
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


def _rate(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


class _Plotted(LiveView):
    """A view with a live SVG picture: redrawn when its data changed, within a time budget."""

    def __init__(self, rate: float, ledger: Ledger | None, widget: bool | None, live: bool, contexts: Any):
        super().__init__(rate, ledger, widget, live, contexts)
        self._plot: Any = None  # the HTML widget that shows the picture
        self._version = 0  # bumped when the data behind the picture changes
        self._drawn = -1
        self._draw_next = 0.0
        self.redraws = 0

    def _stale(self) -> bool:
        return self._plot is not None and self._drawn != self._version

    @abc.abstractmethod
    def svg(self) -> str:
        """The view's live picture, as SVG."""

    def _redraw(self, budgeted: bool) -> bool:
        """Redraws the picture if its data changed; from the live thread only when the budget
        allows (at most PICTURE_RATE a second, drawing at most DRAW_SHARE of the wall time)."""
        if not self._stale():
            return False
        now = time.monotonic()
        if budgeted and now < self._draw_next:
            return False
        t0 = time.thread_time()
        version = self._version
        self._plot.value = self.svg()
        cost = time.thread_time() - t0
        self._draw_next = now + max(1.0 / min(self.rate, PICTURE_RATE), cost / DRAW_SHARE)
        self._drawn = version
        self.redraws += 1
        return True


class Header(LiveView):
    """JAX version, backend, devices and whether they are simulated; the context map."""

    polls = True
    css_class = "mgkit-header"
    figsize = (10.0, 0.8)

    def __init__(self, rate: float = 1.0, widget: bool | None = None, live: bool = True):
        super().__init__(rate, None, widget, live)
        self._text = ""
        self._start()

    def facts(self) -> dict[str, Any]:
        """mgkit and JAX versions, backend, devices per platform, simulated or not, the context map."""
        import jax

        from ._version import __version__

        platforms = collections.Counter(name.rstrip("0123456789") for name in _devices.device_names())
        cpus = platforms.get("cpu", 0)
        flags = os.environ.get("XLA_FLAGS", "")
        simulated = cpus > 1 and (
            getattr(jax.config, "jax_num_cpu_devices", -1) > 1
            or "xla_force_host_platform_device_count" in flags
        )
        return {
            "mgkit": __version__,
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "devices": dict(platforms),
            "simulated": simulated,
            "contexts": str(_contexts.context_map()),
        }

    def _update(self, events: list[Event], budgeted: bool) -> bool:
        f = self.facts()
        devices = ", ".join(f"{n} {p.upper()}" for p, n in f["devices"].items())
        sim = f"yes ({f['devices'].get('cpu', 0)} simulated CPU devices)" if f["simulated"] else "no"
        text = (
            f"mgkit {f['mgkit']} | jax {f['jax']} | backend {f['backend']} | devices: {devices} | "
            f"simulated: {sim}\ncontexts: {f['contexts']}"
        )
        if text == self._text:
            return False
        self._text = text
        if self._box is not None:
            self._html.value = self.html()
        return True

    def text(self) -> str:
        return self._text

    def html(self) -> str:
        lines = "<br>".join(map(html.escape, self._text.splitlines()))
        return f'<div style="font-family:monospace;font-size:12px">{lines}</div>'

    def _build(self, widgets: Any) -> Any:
        self._html = widgets.HTML()
        return widgets.VBox([self._html])

    def _draw_figure(self, fig: Any) -> None:
        fig.text(0.01, 0.5, self._text, va="center", fontsize=8, family="monospace")


# The live arrays' bytes per device, for devices without memory statistics (CPU): one reading
# shared by every device map, taken at most once a second by the live thread and within 1 % of
# the wall time (about 3-4 microseconds per live array).
LIVE_BYTES = Throttled(lambda: _devices.live_array_bytes(), period=1.0, share=0.01)


class DeviceMap(LiveView):
    """Context name -> device -> platform, memory in use / limit, the current context highlighted.

    Memory comes from the device's allocator statistics where it reports them (GPUs, TPUs);
    devices that report none (CPU) show the bytes held by the live jax arrays on them, marked
    ``live arrays``, with no limit. A widget in notebooks (refreshed live), text elsewhere
    (``print(mg.DeviceMap())``).

    Args:
      contexts: context names to show (default: every context of the current map).
      rate: refreshes per second, above 0 and at most 10 (allocator statistics are polled at
        this rate; live arrays are summed at most once a second while refreshed live).
      widget: True for an ipywidgets widget, False for text, None for a widget inside a
        Jupyter kernel and text elsewhere.
      live: a widget is refreshed by a background thread, also while a cell runs; False:
        only when you call ``refresh()``.

    >>> import mgkit as mg
    >>> _ = mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    >>> print(mg.DeviceMap(widget=False))  # doctest: +ELLIPSIS
    mgkit device map: 2 context(s), current (*) dev0
    context  device  platform  kind  memory in use / limit
    ...
    * dev0   cpu0    cpu       cpu   ... (live arrays)
      dev1   cpu1    cpu       cpu   ... (live arrays)
    memory: ...
    """

    polls = True
    css_class = "mgkit-devicemap"
    headers = ("context", "device", "platform", "kind", "memory in use / limit")

    def __init__(
        self,
        contexts: Iterable[str] | None = None,
        rate: float = 2.0,
        widget: bool | None = None,
        live: bool = True,
    ):
        super().__init__(rate, None, widget, live, contexts)
        self._state: list[tuple] = []
        _watch_main_stack()
        self._start()

    def rows(self) -> list[tuple[str, str, str, str, int | None, int | None, bool, str | None]]:
        """(context, device, platform, kind, bytes in use, byte limit, is current, memory source)
        per context, now. The source is ``"allocator"`` (the device's statistics), ``"live
        arrays"`` (bytes of the live jax arrays on a device without statistics) or None."""
        self.refresh()
        return list(self._state)

    def _poll(self, fresh: bool) -> list[tuple]:
        cmap = _contexts.context_map()
        current = shown_current()
        shown = [n for n in cmap.names if self.contexts is None or n in self.contexts]
        devices = [_contexts.device_of(name) for name in shown]
        usage = _devices.memory_usage(devices, lambda: LIVE_BYTES(fresh))
        rows = []
        for name, device in zip(shown, devices, strict=True):
            short = _devices.short_name(device)
            used, limit, source = usage[device]
            platform = short.rstrip("0123456789")
            rows.append((name, short, platform, device.device_kind, used, limit, name == current, source))
        return rows

    def _update(self, events: list[Event], budgeted: bool) -> bool:
        rows = self._poll(fresh=not budgeted)
        if rows == self._state:
            return False
        self._state = rows
        if self._box is not None:
            self._html.value = self.html()
        return True

    def _title(self) -> str:
        current = next((r[0] for r in self._state if r[6]), None)
        return f"mgkit device map: {len(self._state)} context(s), current (*) {current or '(none shown)'}"

    def _note(self) -> str:
        return _devices.MEMORY_NOTE if any(r[7] for r in self._state) else ""

    def _rows(self) -> list[tuple]:
        return [
            (f"{'*' if r[6] else ' '} {r[0]}", r[1], r[2], r[3], _devices.memory_text(r[4], r[5], r[7]))
            for r in self._state
        ]

    def text(self) -> str:
        note = self._note()
        return self._table(self._title()) + (f"\n{note}" if note else "")

    def html(self) -> str:
        esc = html.escape
        head = "".join(f"<th>{esc(h)}</th>" for h in self.headers)
        body = []
        top = max((r[4] for r in self._state if r[5] is None and r[4]), default=0)
        for name, device, platform, kind, used, limit, current, source in self._state:
            share = _bar_share(used, limit, top)
            bar = ""
            if share is not None:
                color = _BAR if limit else _LIVE
                bar = (
                    '<div style="display:inline-block;width:120px;height:10px;background:#e6e6e6;'
                    'vertical-align:middle;margin-right:6px"><div style="height:100%;'
                    f'width:{100 * share:.1f}%;background:{color}"></div></div>'
                )
            style = ' class="mgkit-current" style="background:#fff3c4;font-weight:bold"' if current else ""
            cells = [("&#9654; " if current else "") + esc(name), *map(esc, (device, platform, kind))]
            cells.append(bar + esc(_devices.memory_text(used, limit, source)))
            body.append(f"<tr{style}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        note = self._note()
        foot = f'<div style="font-size:11px;color:#666">{esc(note)}</div>' if note else ""
        return (
            f'<table class="mgkit"><caption>{esc(self._title())}</caption><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>{foot}"
        )

    def _build(self, widgets: Any) -> Any:
        self._html = widgets.HTML()
        return widgets.VBox([self._html])

    def _draw(self, ax: Any) -> None:
        draw_memory(ax, [(r[0], r[1], r[4], r[5], r[6]) for r in self._state])

    def _figsize(self) -> tuple[float, float]:
        return 6.0, 0.35 * len(self._state) + 1.2

    def _draw_figure(self, fig: Any) -> None:
        self._draw(fig.subplots())


class TransferView(_Plotted):
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

    kinds = COMPUTE_KINDS
    exclude = True
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
        events = [
            e for e in self._ledger.records() if e.kind not in COMPUTE_KINDS and self._keep(e.src, e.dst)
        ]
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
            if kind in COMPUTE_KINDS or not self._keep(src, dst):
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
            f"{_gbps(self.nbytes, self.seconds)} GB/s per transfer on average)"
        )

    def _rows(self) -> list[tuple]:
        return [
            (
                e.kind,
                short_label(e.src),
                short_label(e.dst),
                human_bytes(e.nbytes),
                _gbps(e.nbytes, e.seconds),
                _cell(e.label),
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


def _by_source(x: np.ndarray, y: np.ndarray, sources: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """x and y regrouped by source (each source's points in order, a NaN between two sources),
    so that a line joins the points of one fit or function even where another's come between."""
    kinds = list(dict.fromkeys(sources))
    if len(kinds) <= 1:
        return x, y
    which = np.array([kinds.index(s) for s in sources]) if len(kinds) > 8 else None
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    gap = np.array([np.nan])
    for k, kind in enumerate(kinds):
        keep = (
            which == k if which is not None else np.fromiter((s == kind for s in sources), bool, len(sources))
        )
        xs += [x[keep], gap]
        ys += [y[keep], gap]
    return np.concatenate(xs[:-1]), np.concatenate(ys[:-1])


class ThroughputView(_Plotted):
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
                _rate(p.rate[-1]),
                _rate(sum(p.rate) / len(p.rate)),
                _duration(p.step[-1]),
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
            rates[name] = _by_source(t, rate, sources)
            steps[name] = _by_source(t, step * 1e3, sources)
        panels = [("samples/s", rates), ("ms per step", steps)]
        title = "throughput per context (compilation left out of step times)"
        return _svg.lines(panels, self._palette(series), title, "time since the view started (s)", log=True)

    def _draw(self, ax_rate: Any, ax_step: Any) -> None:
        series = self._plotted()
        draw_throughput(ax_rate, ax_step, series, self._palette(series))

    def _draw_figure(self, fig: Any) -> None:
        self._draw(*fig.subplots(2, 1, sharex=True))


# -- launches ------------------------------------------------------------------------------

_OUTPUT_WIDTH = 72  # characters of an output line shown, at most
_LIVE_STATES = ("starting", "running", "stalled")
_STATE_COLORS = {
    "done": "#2e7d32",
    "failed": "#c62828",
    "aborted": "#c62828",
    "stalled": "#ef6c00",
    "terminated": "#757575",
    "starting": "#757575",
}


class LaunchRow(NamedTuple):
    """One rank as a launch view shows it."""

    rank: int
    pid: int
    devices: str  # comma-separated device names
    state: str  # RankInfo.state: starting, running, stalled, done, failed, aborted or terminated
    status: str  # what the view says: ready, running step 12, stalled after step 12, done, ...
    beat: str  # seconds since its last heartbeat ("" before the first), frozen when it ended
    output: tuple[str, ...]  # its last output lines, shortened


def rank_status(r: RankInfo) -> str:
    """``ready`` (running, no step reported yet), ``running step k``, ``stalled after step k``,
    else the rank's state (starting, done, failed, aborted, terminated)."""
    if r.state == "running" and r.step is None:
        return "ready"
    if r.state == "stalled" and r.step is not None:
        return f"stalled after step {r.step}"
    return r.status()


def last_lines(tail: Iterable[str], count: int, width: int = _OUTPUT_WIDTH) -> tuple[str, ...]:
    """The last ``count`` lines of a rank's output, each cut to ``width`` characters; a line
    redrawn with carriage returns (a progress bar) shows its last state."""
    if count <= 0:
        return ()
    lines: list[str] = []
    for _ in range(100):
        try:
            lines = list(tail)[-count:]
            break
        except RuntimeError:  # appended to by the launch's reader thread while copied: copy again
            continue
    out = []
    for line in lines:
        line = str(line).rsplit("\r", 1)[-1].expandtabs(4).rstrip()
        out.append(line if len(line) <= width else line[: width - 3] + "...")
    return tuple(out)


def _beat(r: RankInfo, now: float) -> str:
    if r.beat_at is None:
        return ""
    end = now if r.seconds is None else r.started + r.seconds
    return f"{max(end - r.beat_at, 0.0):.1f} s"


def launch_rows(ranks: Iterable[RankInfo], lines: int, now: float | None = None) -> tuple[LaunchRow, ...]:
    """A row per rank of a running (or finished) launch; heartbeat ages at ``now`` for live
    ranks, at their exit for ended ones."""
    now = time.time() if now is None else now
    return tuple(
        LaunchRow(
            r.rank,
            r.pid,
            ",".join(r.devices) or "?",
            r.state,
            rank_status(r),
            _beat(r, now),
            last_lines(r.tail, lines),
        )
        for r in sorted(ranks, key=operator.attrgetter("rank"))
    )


def ledger_launch(events: Iterable[Event]) -> tuple[int | None, tuple[LaunchRow, ...]]:
    """The newest launch in the ledger's ``launch`` events: (its cell label, a row per rank that
    reported), from each rank's newest event. The ledger keeps no output or heartbeat age.

    Launches run one after another: an event that ended before the newest launch's first rank
    started belongs to an earlier launch, and so does a rank number seen with another pid.
    """
    parsed = []
    for e in events:
        info = e.info
        try:
            rank = int(e.dst.removeprefix("rank"))
            pid = int(info["pid"])
            what = str(info["event"])
        except (AttributeError, KeyError, TypeError, ValueError):
            continue
        parsed.append((e.start + e.seconds, rank, pid, what, e))
    parsed.sort(key=operator.itemgetter(0), reverse=True)  # newest first
    since = math.inf  # when the newest launch's first rank started (its events' earliest start)
    newest: dict[int, tuple[int, str, Event]] = {}
    label = None
    for end, rank, pid, what, e in parsed:
        if end < since and newest:
            break  # ended before the newest launch began
        since = min(since, e.start)
        if rank in newest:
            continue
        newest[rank] = (pid, what, e)
        label = e.label if label is None else label
    rows = []
    for rank, (pid, what, e) in sorted(newest.items()):
        state = str(e.info.get("state", ""))
        if what == "done":
            state = "done"
        elif what == "failed":
            state = state if state in ("failed", "stalled", "aborted", "terminated") else "failed"
        elif what == "stalled":
            state = "stalled"
        else:  # ready, and no exit reported: stopped with the others
            state = "terminated"
        devices = e.info.get("devices") or ()
        names = ",".join(map(str, devices)) if isinstance(devices, list | tuple) else str(devices)
        rows.append(LaunchRow(rank, pid, names or "?", state, state, "", ()))
    return label, tuple(rows)


def _counts(rows: Sequence[LaunchRow]) -> str:
    counts = collections.Counter(r.state for r in rows)
    return ", ".join(f"{n} {state}" for state, n in counts.items())


class LaunchView(LiveView):
    """The ranks of the running ``mg.launch``, or of the last one: per rank its devices, state,
    last heartbeat's age and last lines of output, updated while the ranks run.

    States: starting, ready (running, no ``mg.beat`` step yet), running step k, stalled (after
    step k), done, failed, aborted, terminated. A heartbeat's age is counted to now while a rank
    runs and to its exit once it ended. A launch the view watched keeps its final table with
    the ranks' output; a view made after a launch shows that launch from the ledger's ``launch``
    events (states and devices, no output or heartbeats).

    Args:
      lines: output lines shown per rank, 0 to 20 (each cut to 72 characters).
      rate: refreshes per second, above 0 and at most 10.
      ledger: the ledger to read finished launches from (default ``mg.ledger()``).
      widget: True for an ipywidgets widget, False for text, None for a widget inside a
        Jupyter kernel and text elsewhere.
      live: a widget is refreshed by a background thread, also while ``mg.launch`` runs in the
        cell; False: only when you call ``refresh()``.

    >>> import mgkit as mg
    >>> mg.ledger().clear()
    >>> print(mg.LaunchView(widget=False))  # doctest: +ELLIPSIS
    mgkit launch: none yet; mg.launch(fn, nprocs=...) shows its ranks here as they run
    """

    polls = True
    css_class = "mgkit-launch"
    headers = ("rank", "pid", "devices", "state", "last beat", "output")

    def __init__(
        self,
        lines: int = 2,
        rate: float = 2.0,
        ledger: Ledger | None = None,
        widget: bool | None = None,
        live: bool = True,
    ):
        super().__init__(rate, ledger, widget, live)
        self.lines = check_count(lines, "lines", self._where, 0, TAIL, 2)
        self._seen: tuple[RankInfo, ...] = ()  # the ranks of the last launch seen running
        self._launches = -1  # launch events in the ledger's totals when last read
        self._from_ledger: tuple[int | None, tuple[LaunchRow, ...]] = (None, ())
        self._shown: tuple[str, tuple[LaunchRow, ...]] = ("", ())
        self._start()

    @property
    def active(self) -> bool:
        """True when there is a launch to show (running, or finished and remembered)."""
        return bool(self._shown[1])

    def rows(self) -> list[LaunchRow]:
        """A row per rank of the launch shown, now (empty when there is none)."""
        self.refresh()
        return list(self._shown[1])

    def _running(self) -> tuple[str, tuple[RankInfo, ...]] | None:
        try:
            return _launch.current()
        except IndexError:  # the launch ended between two reads
            return None

    def _read_ledger(self) -> tuple[int | None, tuple[LaunchRow, ...]]:
        """The ledger's newest launch, read again only when its count of launch events changed."""
        count = sum(c for (kind, _, _), (c, _, _) in self._ledger.totals().items() if kind == "launch")
        if count != self._launches:
            self._launches = count
            self._from_ledger = ledger_launch(self._ledger.records("launch")) if count else (None, ())
        return self._from_ledger

    def _state(self) -> tuple[str, tuple[LaunchRow, ...]]:
        now = time.time()
        running = self._running()
        if running is not None:
            self._seen = running[1]
            rows = launch_rows(self._seen, self.lines, now)
            starts = [r.started for r in self._seen if r.started > 0]
            elapsed = f" for {now - min(starts):.1f} s" if starts else ""
            return f"mgkit launch: {len(rows)} rank(s) running{elapsed}: {_counts(rows)}", rows
        label, logged = self._read_ledger()
        pids = {r.pid for r in self._seen}
        if self._seen and {r.pid for r in logged} <= pids:  # the launch this view watched
            rows = launch_rows(self._seen, self.lines, now)
            return f"mgkit launch: last launch, {len(rows)} rank(s): {_counts(rows)}", rows
        if logged:
            cell = f" ({_cell(label)})" if label is not None else ""
            return (
                f"mgkit launch: last launch{cell}, {len(logged)} rank(s): {_counts(logged)} "
                "(from the ledger: output and heartbeats show while a view watches)",
                logged,
            )
        return "mgkit launch: none yet; mg.launch(fn, nprocs=...) shows its ranks here as they run", ()

    def _update(self, events: list[Event], budgeted: bool) -> bool:
        shown = self._state()
        if shown == self._shown:
            return False
        self._shown = shown
        if self._box is not None:
            self._html.value = self.html()
        return True

    def _rows(self) -> list[tuple]:
        return [(r.rank, r.pid, r.devices, r.status, r.beat, " | ".join(r.output)) for r in self._shown[1]]

    def text(self) -> str:
        title, rows = self._shown
        return self._table(title) if rows else title

    def html(self) -> str:
        esc = html.escape
        title, rows = self._shown
        if not rows:
            return f'<div style="font-family:monospace;font-size:12px">{esc(title)}</div>'
        head = "".join(f"<th>{esc(h)}</th>" for h in self.headers)
        body = []
        for r in rows:
            color = _STATE_COLORS.get(r.state)
            state = f'<span style="color:{color}">{esc(r.status)}</span>' if color else esc(r.status)
            output = "<br>".join(map(esc, r.output))
            cells = [esc(str(r.rank)), esc(str(r.pid)), esc(r.devices), state, esc(r.beat)]
            body.append(
                f'<tr class="mgkit-rank-{esc(r.state)}">'
                + "".join(f"<td>{c}</td>" for c in cells)
                + f'<td style="font-family:monospace;text-align:left;white-space:pre">{output}</td></tr>'
            )
        return (
            f'<table class="mgkit"><caption>{esc(title)}</caption><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>"
        )

    def _build(self, widgets: Any) -> Any:
        self._html = widgets.HTML()
        return widgets.VBox([self._html])

    def _figsize(self) -> tuple[float, float]:
        return 10.0, 0.25 * (len(self._shown[1]) + 3) + 0.4

    def _draw_figure(self, fig: Any) -> None:
        fig.text(0.01, 0.98, self.text(), va="top", fontsize=8, family="monospace")


class Dashboard(LiveView):
    """The header, device map, transfers and throughput in one live widget (text elsewhere);
    below them the ranks of the running or last ``mg.launch``, once there has been one.

    Args:
      contexts: show only these contexts (default: all).
      max_rows: recent transfers listed, 1 to 1000.
      history: throughput points kept per context, 2 to 100000.
      rate: refreshes per second, above 0 and at most 10.
      ledger: the ledger to follow (default ``mg.ledger()``).
      widget: True for an ipywidgets widget, False for text, None for a widget inside a
        Jupyter kernel and text elsewhere.
      live: a widget is refreshed by a background thread, also while a cell runs; False:
        only when you call ``refresh()``.

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
    figsize = (11.0, 9.0)

    def __init__(
        self,
        contexts: Iterable[str] | None = None,
        max_rows: int = 10,
        history: int = 300,
        rate: float = 10.0,
        ledger: Ledger | None = None,
        widget: bool | None = None,
        live: bool = True,
    ):
        super().__init__(rate, ledger, widget, live, contexts)
        mode = self._as_widget
        self.header = Header(rate=min(rate, 1.0), widget=mode, live=False)
        self.devices = DeviceMap(contexts, rate=min(rate, 2.0), widget=mode, live=False)
        self.transfers = TransferView(contexts, max_rows, rate, self._ledger, mode, live=False)
        self.throughput = ThroughputView(contexts, history, rate, self._ledger, mode, live=False)
        self.launches = LaunchView(rate=min(rate, 2.0), ledger=self._ledger, widget=mode, live=False)
        self.views = (self.header, self.devices, self.transfers, self.throughput, self.launches)
        self._start()

    def _shown(self) -> tuple[LiveView, ...]:
        """The views shown: the launch table only once there is a launch to show."""
        return self.views if self.launches.active else self.views[:-1]

    def _show_launches(self) -> None:
        """Adds the launch table's widget below the others when the first launch appears."""
        with self._lock:  # the live thread and a refresh() on the main thread may both get here
            box, launches = self._box, self.launches.widget
            if box is not None and self.launches.active and all(c is not launches for c in box.children):
                box.children = (*box.children, launches)

    def _update(self, events: list[Event], budgeted: bool) -> bool:
        changed = any([view._refresh(budgeted) for view in self.views])
        self._show_launches()
        return changed

    def _tick(self, now: float) -> bool:
        if self.closed or now < self._next:
            return False
        self._next = now + 1.0 / self.rate
        changed = any([view._tick(now) for view in self.views])
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
        grid = fig.add_gridspec(3, 2, height_ratios=[1.3, 1, 1])
        self.devices._draw(fig.add_subplot(grid[0, 0]))
        self.transfers._draw(fig.add_subplot(grid[0, 1]))
        ax_rate = fig.add_subplot(grid[1, :])
        self.throughput._draw(ax_rate, fig.add_subplot(grid[2, :], sharex=ax_rate))
        fig.suptitle(self.header.text(), fontsize=8, family="monospace")
