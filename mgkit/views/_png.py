"""The views' pictures drawn with matplotlib, for ``save_png``: memory bars, the transfers'
heatmap, the throughput lines, timelines and block grids.

Each draws on a matplotlib ``Figure`` with an Agg canvas (no pyplot, no display); matplotlib is
imported only when a picture is drawn. Views call these with their data; this module imports
no view.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .._ledger import short_label
from .._table import human_bytes
from ._svg import by_source


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


_ANNOTATE_UP_TO = 12  # write the bytes into heatmap cells when there are at most this many names
_CURRENT = "#f5a623"
LIMIT_BAR = "#4c78a8"  # bars of memory in use against the device's limit
LIVE_BAR = "#72b7b2"  # bars of live arrays' bytes (no limit known)


def figure(width: float, height: float, dpi: int = 100) -> Any:
    """A matplotlib Figure with an Agg canvas (no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def write_png(fig: Any, path: str, dpi: int) -> None:
    """Saves ``fig`` as a PNG file."""
    fig.savefig(path, format="png", dpi=dpi)


class MemoryBar(NamedTuple):
    """One context's memory, as the memory picture draws it."""

    context: str  # the context's name
    device: str  # its device's short name
    used: int | None  # bytes in use (None: not known)
    limit: int | None  # the device's byte limit (None: it reports none)
    current: bool  # True for the current context


def largest_live(bars: Sequence[MemoryBar]) -> int:
    """The most bytes a device without a limit holds: the length of a full live-arrays bar."""
    return max((b.used for b in bars if b.used and not b.limit), default=0)


def bar_share(used: int | None, limit: int | None, top: int) -> float | None:
    """A memory bar's length from 0 to 1: the share of the limit where the device reports one,
    else (live arrays) the share of ``top``, the most any such device holds; None: no bar."""
    if used is None:
        return None
    if limit:
        return min(used / limit, 1.0)
    return used / top if top else 0.0


def _memory_note(used: int | None, limit: int | None) -> str:
    if used is None and limit is None:
        return "n/a"
    if limit:
        return f"{'?' if used is None else human_bytes(used)} / {human_bytes(limit)}"
    return f"{human_bytes(used)} in live arrays"


def draw_memory(ax, bars: Sequence[MemoryBar]) -> None:
    """Horizontal bars per context: memory in use as a share of the limit where the device
    reports one, else the live arrays' bytes as a share of the most any context's device holds;
    ``n/a`` where nothing is known."""
    ax.clear()
    top = largest_live(bars)
    kinds = set()
    for i, b in enumerate(bars):
        share = bar_share(b.used, b.limit, top)
        if share is not None:
            kinds.add("limit" if b.limit else "live")
            ax.barh(i, share, color=_CURRENT if b.current else (LIMIT_BAR if b.limit else LIVE_BAR))
        ax.text(0.01, i, _memory_note(b.used, b.limit), va="center", fontsize=8)
    labels = [f"{'* ' if b.current else ''}{b.context} -> {b.device}" for b in bars]
    ax.set_yticks(np.arange(len(bars)), labels, fontsize=8)
    for tick, b in zip(ax.get_yticklabels(), bars, strict=True):
        if b.current:
            tick.set_fontweight("bold")
    ax.set_xlim(0, 1)
    ax.set_ylim(len(bars) - 0.5, -0.5)
    if kinds == {"live"}:
        label = f"bytes held by live jax arrays (bar: share of the largest, {human_bytes(top)})"
    elif kinds == {"limit"} or not kinds:
        label = "memory in use / limit (device allocator, or live arrays / simulated limit)"
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


class Trace(NamedTuple):
    """One line of the throughput picture (a context, or a member on it): its points as arrays."""

    t: np.ndarray  # when each point ended, seconds since the view started
    rate: np.ndarray  # samples per second
    step: np.ndarray  # seconds per step, compilation left out
    compiled: np.ndarray  # seconds of compilation taken out of each point's time
    sources: list[str]  # what each point came from: a fit, or a function and how it ran


def _name_sources(ax: Any, trace: Trace, named: set[str]) -> None:
    """Writes each source's name beside its first point (once per picture: ``named``)."""
    t, rate = trace.t, trace.rate
    right = float(np.nanmax(t)) if len(t) else 0.0
    for k, source in enumerate(trace.sources):
        if source and source not in named:
            named.add(source)
            left_side = len(named) % 2 == 0  # alternate sides: neighbours do not overlap
            if t[k] < 0.3 * right or t[k] > 0.7 * right:  # near an edge: face the middle
                left_side = t[k] > 0.7 * right
            label = ax.annotate(
                source,
                (t[k], rate[k]),
                xytext=(-7 if left_side else 7, 7 if len(named) % 2 else -12),
                textcoords="offset points",
                ha="right" if left_side else "left",
                fontsize=6.5,
                color="0.25",
            )
            label.set_in_layout(False)


def draw_throughput(ax_rate, ax_step, traces: dict[str, Trace], colors: dict[str, str]) -> None:
    """Samples per second (top) and milliseconds per step (bottom) against time, one colour and
    marker shape per line. Each point is one step event (a fit's iterations since its last)
    or one parallel call; lines join only points of one fit or function, each of which is named
    where it first appears, and a grey ring marks a call whose compilation was taken out of its
    time."""
    ax_rate.clear()
    ax_step.clear()
    named: set[str] = set()
    rings = False
    for i, (name, trace) in enumerate(traces.items()):
        color = colors.get(name)
        marker = _MARKERS[i % len(_MARKERS)]
        style = {"ls": "none", "marker": marker, "ms": 5.5, "mfc": "none", "mew": 1.1, "color": color}
        t = trace.t
        for ax, y in ((ax_rate, trace.rate), (ax_step, trace.step * 1e3)):
            ax.plot(*by_source(t, y, trace.sources), lw=0.8, alpha=0.5, color=color)
            ax.plot(t, y, **style)
            hot = trace.compiled > 0
            if hot.any():
                rings = True
                ax.plot(t[hot], y[hot], ls="none", marker="o", ms=11, mfc="none", mec="0.55", mew=1.0)
        ax_rate.plot([], [], **{**style, "ls": "-", "lw": 0.8}, label=name)  # the legend's entry
        if len(traces) * len(set(trace.sources)) <= 200:
            _name_sources(ax_rate, trace, named)
    if rings:
        ax_rate.plot([], [], ls="none", marker="o", ms=9, mfc="none", mec="0.55", label="compiled (left out)")
    if not traces:
        ax_rate.text(0.5, 0.5, "no steps yet", ha="center", va="center", transform=ax_rate.transAxes)
    else:
        _log_if_wide(ax_rate, [tr.rate for tr in traces.values()])
        _log_if_wide(ax_step, [tr.step for tr in traces.values()])
        if len(traces) <= 16:
            ax_rate.legend(
                fontsize=7,
                ncols=min(len(traces) + rings, 9),
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
    ax_rate.set_title("throughput per context", fontsize=9, pad=18 if len(traces) else 6)


class Bar(NamedTuple):
    """One block of a timeline."""

    row: int  # its row, from the top
    start: float  # where it starts on the x axis
    width: float  # its length on the x axis
    color: str  # its fill


def draw_timeline(
    ax: Any, rows: Sequence[str], bars: Sequence[Bar], legend: dict[str, str], x_label: str, title: str
) -> None:
    """Coloured bars on named rows (a schedule), with a legend (label -> colour)."""
    from matplotlib.patches import Patch

    for i in range(len(rows)):
        mine = [b for b in bars if b.row == i]
        for color in dict.fromkeys(b.color for b in mine):
            spans = [(b.start, b.width) for b in mine if b.color == color]
            ax.broken_barh(spans, (i - 0.4, 0.8), facecolors=color, edgecolors="white", linewidth=0.5)
    ax.set_yticks(range(len(rows)), list(rows))
    ax.invert_yaxis()
    ax.set_xlabel(x_label)
    handles = [Patch(facecolor=color, label=label) for label, color in legend.items()]
    if handles:
        ax.legend(handles=handles, fontsize="small", loc="upper right", ncols=min(len(handles), 4))
    ax.set_title(title, fontsize=8, loc="left")


class Tile(NamedTuple):
    """One cell of a block grid (a leaf's blocks on their contexts)."""

    row: int  # its row, from the top
    col: int  # its column, from the left
    width: float  # the share of the cell's width that holds data (below 1: padded)
    height: float  # the share of the cell's height that holds data
    label: str  # the contexts holding it, in short
    color: str  # its fill


def draw_tiles(
    ax: Any, tiles: Sequence[Tile], rows: Sequence[str], cols: Sequence[str], corner: str, title: str
) -> None:
    """A grid of labelled cells; the part of a short cell past the data (padding) dashed."""
    from matplotlib.patches import Rectangle

    for t in tiles:
        full = t.width == 1 and t.height == 1
        if not full:
            ax.add_patch(Rectangle((t.col, t.row), 1, 1, fill=False, linestyle="--", edgecolor="#999"))
        ax.add_patch(Rectangle((t.col, t.row), t.width, t.height, facecolor=t.color, edgecolor="white"))
        color = "white" if full else "#333"
        ax.text(t.col + 0.5, t.row + 0.5, t.label, ha="center", va="center", fontsize=7, color=color)
    ax.set_xlim(0, max(len(cols), 1))
    ax.set_ylim(max(len(rows), 1), 0)
    ax.set_xticks([j + 0.5 for j in range(len(cols))], list(cols), fontsize=7)
    ax.set_yticks([i + 0.5 for i in range(len(rows))], list(rows), fontsize=7)
    ax.xaxis.tick_top()
    ax.set_xlabel(corner, fontsize=8)
    ax.set_title(title, fontsize=8, loc="left")
