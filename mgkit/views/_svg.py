"""Small SVG drawings for the live views: line panels and a heatmap (and ``by_source``, which
joins each source's points into one line, for these lines and the matplotlib ones).

A live view redraws many times while a cell runs, on a thread that shares the interpreter with
the compute loop, so a picture must cost about a millisecond: these are plain SVG text, which
every notebook frontend shows inside an HTML widget. Pictures saved to files use matplotlib.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
"""matplotlib's default colour cycle, so live views and saved pictures agree."""

_VIRIDIS = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))
_FONT = 'font-family="sans-serif" font-size="10"'
MAX_POINTS = 120  # points per line drawn; longer series are thinned evenly


def colors(names: Sequence[str]) -> dict[str, str]:
    """One stable colour per name, in the order given."""
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(dict.fromkeys(names))}


def ramp(x: float) -> str:
    """A viridis colour for ``x`` in [0, 1]."""
    x = min(max(x, 0.0), 1.0) * (len(_VIRIDIS) - 1)
    i = min(int(x), len(_VIRIDIS) - 2)
    f = x - i
    rgb = (round(a + (b - a) * f) for a, b in zip(_VIRIDIS[i], _VIRIDIS[i + 1], strict=True))
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def compact(v: float) -> str:
    """A short label for an axis tick: 950, 1.2k, 3.4M, 0.012."""
    a = abs(v)
    for limit, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= limit:
            return f"{v / limit:.3g}{suffix}"
    return f"{v:.3g}"


def _text(x: float, y: float, s: str, anchor: str = "start", extra: str = "") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" {_FONT}{extra}>{html.escape(s)}</text>'


def _thin(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every k-th point (and the last, and every NaN that breaks a line), at most about
    MAX_POINTS of them."""
    k = -(-len(x) // MAX_POINTS)
    if k <= 1:
        return x, y
    keep = np.zeros(len(x), bool)
    keep[::k] = True
    keep[-1] = True
    keep |= np.isnan(y)
    return x[keep], y[keep]


def _segments(words: list[str], finite: list[bool], lo: int, hi: int) -> list[str]:
    """The ``points`` text of each run of finite points among points ``lo..hi`` (``words``: two
    per point, its whole-pixel x and y as text)."""
    if all(finite[lo:hi]):
        return [" ".join(words[2 * lo : 2 * hi])]
    out, start = [], None
    for k in range(lo, hi + 1):
        if k < hi and finite[k]:
            start = k if start is None else start
        elif start is not None:
            out.append(" ".join(words[2 * start : 2 * k]))
            start = None
    return out


def _marker(i: int, color: str) -> str:
    """A small round marker drawn at every vertex of the lines that use it (one definition per
    colour: no element per point)."""
    return (
        f'<marker id="m{i}" viewBox="0 0 6 6" refX="3" refY="3" markerWidth="5" markerHeight="5" '
        f'markerUnits="userSpaceOnUse"><circle cx="3" cy="3" r="2.6" fill="{color}"/></marker>'
    )


class Panel(NamedTuple):
    """One panel of ``lines``."""

    y_label: str  # the text beside its y axis
    series: Mapping[str, tuple[np.ndarray, np.ndarray]]  # name -> (x, y) of each of its lines


class _Box(NamedTuple):
    """Where a panel is drawn, in pixels, and the x values its width spans."""

    left: float
    top: float
    width: float
    height: float
    x0: float
    x1: float


class _YScale(NamedTuple):
    """A panel's y axis."""

    ticks: list[float]  # the values marked with a grid line
    scale: Callable[[np.ndarray], np.ndarray]  # values -> share of the panel's height (0 at the bottom)
    logged: bool  # True: a log scale


def _y_scale(ys: np.ndarray, log: bool) -> _YScale:
    """The y axis for the values ``ys`` (of every line of a panel): log where asked and the
    positive values span more than a factor of 20, else linear from 0."""
    ys = ys[np.isfinite(ys)]
    y_max = float(ys.max()) if ys.size else 0.0
    positive = ys[ys > 0]
    y_min = float(positive.min()) if positive.size else 0.0
    if log and y_min > 0 and y_max > 20 * y_min:
        lo, hi = math.floor(math.log10(y_min)), math.ceil(math.log10(y_max))

        def logged(y: np.ndarray) -> np.ndarray:
            with np.errstate(divide="ignore", invalid="ignore"):
                return (np.log10(np.where(y > 0, y, np.nan)) - lo) / (hi - lo)

        return _YScale([10.0**e for e in range(lo, hi + 1)], logged, True)
    top = y_max * 1.05 if y_max > 0 else 1.0
    return _YScale([top * k / 2 for k in range(3)], lambda y: y / top, False)


def _panel(
    box: _Box, panel: Panel, palette: Mapping[str, str], markers: Mapping[str, str], log: bool
) -> list[str]:
    """One panel's frame, grid, y labels and lines (the numbers of all its lines worked out
    together: a panel costs a few array operations, not a few per line)."""
    left, top, width, height, x0, x1 = box
    names, xs, ys = [], [], []
    for name, (x, y) in panel.series.items():
        if len(x):
            x, y = _thin(np.asarray(x, float), np.asarray(y, float))
            names.append(name)
            xs.append(x)
            ys.append(y)
    y_all = np.concatenate(ys) if ys else np.zeros(0)
    axis = _y_scale(y_all, log)
    out = [f'<rect x="{left}" y="{top}" width="{width}" height="{height}" fill="none" stroke="#bbb"/>']
    for v, share in zip(axis.ticks, axis.scale(np.array(axis.ticks)).tolist(), strict=True):
        y = top + height - height * share
        out.append(f'<line x1="{left}" x2="{left + width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(_text(left - 4, y + 3, compact(v), "end"))
    mid = top + height / 2
    label = f"{panel.y_label} (log)" if axis.logged else panel.y_label
    out.append(_text(12, mid, label, "middle", f' transform="rotate(-90 12 {mid:.1f})"'))
    if not names:
        return out
    px = left + (np.concatenate(xs) - x0) / (x1 - x0) * width
    py = top + height - np.clip(axis.scale(y_all), 0.0, 1.0) * height
    ok = np.isfinite(px) & np.isfinite(py)
    xy = np.rint(np.column_stack([np.where(ok, px, 0.0), np.where(ok, py, 0.0)])).astype(np.int32)
    words = list(map(str, xy.ravel().tolist()))  # whole pixels: ints print fast
    finite = ok.tolist()
    lo = 0
    for name, x in zip(names, xs, strict=True):
        hi = lo + len(x)
        color = palette.get(name, "#333")
        ends = f"url(#{markers[name]})"
        for points in _segments(words, finite, lo, hi):
            out.append(
                f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.2" '
                f'stroke-opacity="0.7" marker-start="{ends}" marker-mid="{ends}" marker-end="{ends}"/>'
            )
        lo = hi
    return out


def lines(
    panels: Sequence[Panel],
    palette: Mapping[str, str],
    title: str,
    x_label: str,
    width: int = 640,
    panel_height: int = 100,
    log: bool = False,
) -> str:
    """Panels stacked over one shared x axis, one line with a marker at each point per name in
    each; a NaN in y breaks a line.

    Args:
      panels: from top to bottom.
      palette: name -> colour.
      title, x_label: text above the panels and below the x axis.
      log: a log y scale in a panel whose positive values span more than a factor of 20.
    """
    left, right, top, gap, bottom = 56, 10, 34, 14, 30
    height = top + len(panels) * panel_height + (len(panels) - 1) * gap + bottom
    plot_w = width - left - right
    every = [np.asarray(x, float) for panel in panels for x, _ in panel.series.values() if len(x)]
    x_all = np.concatenate(every) if every else np.zeros(0)
    x_all = x_all[np.isfinite(x_all)]
    xs = x_all.size > 0
    x0 = float(x_all.min()) if xs else 0.0
    x1 = float(x_all.max()) if xs else 1.0
    if x1 <= x0:
        x0, x1 = x0 - 0.5, x0 + 0.5
    names = list(dict.fromkeys(n for panel in panels for n in panel.series))
    markers = {name: f"m{i}" for i, name in enumerate(names)}
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">',
        "<defs>" + "".join(_marker(i, palette.get(n, "#333")) for i, n in enumerate(names)) + "</defs>",
        _text(left, 12, title, extra=' font-weight="bold"'),
    ]
    lx = left
    for name in names:
        label = _text(lx + 12, 26, name)
        out.append(f'<rect x="{lx}" y="19" width="9" height="9" fill="{palette.get(name, "#333")}"/>{label}')
        lx += 22 + 6 * len(name)
    for p, panel in enumerate(panels):
        box = _Box(left, top + p * (panel_height + gap), plot_w, panel_height, x0, x1)
        out += _panel(box, panel, palette, markers, log)
    y_axis = top + len(panels) * panel_height + (len(panels) - 1) * gap
    out.append(_text(left, y_axis + 12, compact(x0)))
    out.append(_text(left + plot_w, y_axis + 12, compact(x1), "end"))
    out.append(_text(left + plot_w / 2, y_axis + 24, x_label, "middle"))
    if not xs:
        out.append(_text(left + plot_w / 2, top + panel_height / 2, "nothing yet", "middle"))
    out.append("</svg>")
    return "".join(out)


def heatmap(
    names: Sequence[str],
    values: np.ndarray,
    title: str,
    label: Callable[[float], str],
    row_name: Callable[[str], str] = str,
) -> str:
    """A square grid: ``values[i, j]`` from ``names[i]`` (row) to ``names[j]`` (column), on a log
    colour scale; each cell's exact value is its tooltip."""
    n = len(names)
    cell = max(12, min(32, 320 // max(n, 1)))
    left, top = 70, 24
    size = n * cell
    width, height = left + max(size, 120) + 10, top + size + 64
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">',
        _text(0, 12, title, extra=' font-weight="bold"'),
    ]
    nonzero = values[values > 0]
    lo, hi = (math.log10(float(nonzero.min())), math.log10(float(nonzero.max()))) if nonzero.size else (0, 0)
    out.append(f'<rect x="{left}" y="{top}" width="{size}" height="{size}" fill="#f4f4f4" stroke="#bbb"/>')
    for (i, j), v in np.ndenumerate(values):
        if v <= 0:
            continue
        shade = ramp((math.log10(float(v)) - lo) / (hi - lo)) if hi > lo else ramp(1.0)
        tip = html.escape(f"{names[i]} -> {names[j]}: {label(v)}")
        out.append(
            f'<rect x="{left + j * cell}" y="{top + i * cell}" width="{cell}" height="{cell}" '
            f'fill="{shade}"><title>{tip}</title></rect>'
        )
    for k, name in enumerate(names):
        short = row_name(name)
        out.append(_text(left - 4, top + k * cell + cell / 2 + 3, short, "end"))
        x, y = left + k * cell + cell / 2, top + size + 6
        out.append(_text(x, y, short, "end", f' transform="rotate(-60 {x:.1f} {y:.1f})"'))
    out.append(_text(left - 4, top - 4, "from \\ to", "end"))
    if not n or not nonzero.size:
        out.append(_text(left + max(size, 120) / 2, top + size / 2 + 4, "nothing moved yet", "middle"))
    out.append("</svg>")
    return "".join(out)


def by_source(x: np.ndarray, y: np.ndarray, sources: list[str]) -> tuple[np.ndarray, np.ndarray]:
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
