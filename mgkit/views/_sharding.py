"""The sharding view: which block of each leaf lives on which context, and the bytes per context.

Drawn from the shapes and shardings only (``mgkit._shards``): no array's data is read or moved.
A leaf is drawn over two of its dimensions (the ones split into the most blocks, else its last
two), the others summarised; each cell lists the contexts holding that block. At most ``_CAP``
blocks are drawn along an axis (the first ones, ``...``, the last two), so a leaf over 512
devices draws as fast as one over 4. A pytree gets a table per leaf and per context.

An inline widget in a notebook, text elsewhere, ``save_png(path)`` for reports.
"""

from __future__ import annotations

import html
import importlib.util
from collections.abc import Sequence
from typing import Any, NamedTuple

from .. import _devices, _shards
from .._table import html_table, human_bytes, text_table
from . import _svg
from ._base import LiveView
from ._live import in_kernel
from ._png import Tile, draw_tiles

_CAP = 8  # blocks drawn along an axis; more are elided in the middle
_GRIDS = 8  # leaves drawn as a grid; the leaf table lists every leaf
_CONTEXT_ROWS = 16  # rows of the context table; more are summarised in one row
_CHAR_W, _CELL_H, _HEAD = 6.2, 22, 20  # the SVG grid: pixels per character, row height, header


class Axis(NamedTuple):
    """One drawn dimension of a leaf's grid."""

    dim: int | None  # the leaf's dimension (None: the leaf has too few dimensions to fill it)
    blocks: tuple[int | None, ...]  # the block positions drawn, in order (None: elided blocks)
    labels: tuple[str, ...]  # each entry's span, ``0:2560`` (``9:10 pad 2`` when short), or ``...``
    filled: tuple[float, ...]  # the share of each entry that holds data (below 1: padded)


class Grid(NamedTuple):
    """A leaf drawn over two of its dimensions."""

    corner: str  # what the rows and columns are: ``dim 0 \\ dim 1``
    rows: Axis  # the drawn rows
    cols: Axis  # the drawn columns
    cells: tuple[tuple[tuple[str, ...], ...], ...]  # per row, per column: the contexts holding it
    note: str  # what the dimensions not drawn hold ("" when every dimension is drawn)


def drawn_dims(lay: _shards.Layout) -> tuple[int, ...]:
    """The dimensions a leaf is drawn over: every one up to two, else the two split into the most
    blocks (the later dimension on a tie), else its last two; in order."""
    rank = len(lay.shape)
    if rank <= 2:
        return tuple(range(rank))
    split = sorted((d for d in range(rank) if lay.parts[d] > 1), key=lambda d: (-lay.parts[d], -d))
    rest = [d for d in reversed(range(rank)) if d not in split]
    return tuple(sorted((split + rest)[:2]))


def _shown(n: int) -> tuple[int | None, ...]:
    """The block positions drawn out of ``n``: all up to ``_CAP``, else the first ones, None, the
    last two."""
    if n <= _CAP:
        return tuple(range(n))
    return (*range(_CAP - 3), None, n - 2, n - 1)


def _axis(lay: _shards.Layout, dim: int | None) -> Axis:
    if dim is None:
        return Axis(None, (0,), ("",), (1.0,))
    size, shard = lay.shape[dim], lay.shard[dim]
    blocks = _shown(lay.parts[dim])
    labels, filled = [], []
    for k in blocks:
        if k is None:
            labels.append("...")
            filled.append(1.0)
            continue
        a = min(k * shard, size)
        b = min(a + shard, size)
        labels.append(f"{a}:{b}" + (f" pad {shard - (b - a)}" if b - a < shard else ""))
        filled.append((b - a) / shard if shard else 1.0)
    return Axis(dim, blocks, tuple(labels), tuple(filled))


def _not_drawn(lay: _shards.Layout, dims: Sequence[int]) -> str:
    hidden = [d for d in range(len(lay.shape)) if d not in dims]
    if not hidden:
        return ""
    parts = [
        f"dim {d} ({lay.shape[d]}) in {lay.parts[d]} blocks{_over(lay, d)}"
        if lay.parts[d] > 1
        else f"dim {d} ({lay.shape[d]}) whole"
        for d in hidden
    ]
    blocks = 1
    for d in hidden:
        blocks *= lay.parts[d]
    each = f"; each cell lists the contexts of its {blocks} blocks" if blocks > 1 else ""
    return "not drawn: " + ", ".join(parts) + each


def _over(lay: _shards.Layout, d: int) -> str:
    axes = lay.axes[d]
    return f" over {'+'.join(repr(a) for a in axes)}" if axes else ""


def grid(lay: _shards.Layout) -> Grid:
    """The grid of a leaf's blocks over the dimensions ``drawn_dims`` picks."""
    dims = drawn_dims(lay)
    rdim, cdim = (None, None, *dims)[-2:]
    rows, cols = _axis(lay, rdim), _axis(lay, cdim)
    held: dict[tuple[int, int], list[str]] = {}
    for b in lay.blocks:
        key = (0 if rdim is None else b.index[rdim], 0 if cdim is None else b.index[cdim])
        held.setdefault(key, []).extend(b.contexts)
    cells = tuple(
        tuple(
            () if i is None or j is None else tuple(dict.fromkeys(held.get((i, j), ()))) for j in cols.blocks
        )
        for i in rows.blocks
    )
    corner = {0: "scalar", 1: f"dim {cdim}"}.get(len(dims), f"dim {rdim} \\ dim {cdim}")
    return Grid(corner, rows, cols, cells, _not_drawn(lay, dims))


def who(contexts: Sequence[str]) -> str:
    """A cell's contexts in short: ``dev0``, ``dev0,dev4``, ``dev0,dev1 +6``."""
    if len(contexts) <= 2:
        return ",".join(contexts)
    return f"{contexts[0]},{contexts[1]} +{len(contexts) - 2}"


def marks(lay: _shards.Layout) -> list[str]:
    """How a leaf is laid out, in words: split, replicated, padded, whole on one context, or on
    the host (a numpy leaf)."""
    if not lay.places:
        return [f"{_shards.HOST}: no context holds it"]
    out = []
    split = [d for d, k in enumerate(lay.parts) if k > 1]
    if split:
        dims = ", ".join(f"dim {d}{_over(lay, d)}" for d in split)
        out.append(f"split {' x '.join(str(k) for k in lay.parts)} ({dims})")
    if lay.copies > 1:
        out.append(f"replicated x{lay.copies}")
    for d in lay.padded:
        out.append(f"padded dim {d}: {lay.shape[d]} in {lay.parts[d]} blocks of {lay.shard[d]}")
    if not split and lay.copies == 1:
        out.append(f"whole on {lay.places[0].context}")
    return out


def _type_text(lay: _shards.Layout) -> str:
    return f"{lay.dtype.name}[{', '.join(str(n) for n in lay.shape)}]"


def _limit_text(row: _shards.ContextBytes) -> str:
    limit = _devices.memory_limit(row.device) if row.device is not None else None
    return f"{100 * row.nbytes / limit:.1f}% of {human_bytes(limit)}" if limit else ""


def grid_svg(g: Grid, colors: dict[str, str]) -> str:
    """A leaf's grid as SVG: a cell per block, coloured by its first context (``colors``), the
    padding of a short block (past the leaf's end) dashed. Columns are as wide as their labels."""
    cell_w = max(48, _CHAR_W * max(len(t) for t in (*g.cols.labels, *map(who, sum(g.cells, ())))) + 12)
    left = _CHAR_W * max(len(t) for t in (*g.rows.labels, g.corner)) + 10
    esc = html.escape
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + cell_w * len(g.cols.blocks) + 4:.0f}" '
        f'height="{_HEAD + _CELL_H * len(g.rows.blocks) + 4}" font-family="sans-serif" font-size="10">',
        f'<text x="2" y="13" fill="#666">{esc(g.corner)}</text>',
    ]
    for j, label in enumerate(g.cols.labels):
        out.append(
            f'<text x="{left + cell_w * (j + 0.5):.0f}" y="13" text-anchor="middle">{esc(label)}</text>'
        )
    for i, (label, row) in enumerate(zip(g.rows.labels, g.cells, strict=True)):
        y = _HEAD + _CELL_H * i
        out.append(f'<text x="{left - 4:.0f}" y="{y + 15}" text-anchor="end">{esc(label)}</text>')
        for j, contexts in enumerate(row):
            x, full = left + cell_w * j, g.cols.filled[j] == 1 and g.rows.filled[i] == 1
            text = esc(who(contexts)) if contexts else "..."
            if contexts and not full:
                out.append(
                    f'<rect x="{x + 1:.0f}" y="{y + 1}" width="{cell_w - 2:.0f}" height="{_CELL_H - 2}" '
                    'fill="none" stroke="#999" stroke-dasharray="3,2"/>'
                )
            if contexts:
                w, h = (cell_w - 2) * g.cols.filled[j], (_CELL_H - 2) * g.rows.filled[i]
                tip = esc(f"{label} x {g.cols.labels[j]}: {', '.join(contexts)}")
                out.append(
                    f'<rect x="{x + 1:.0f}" y="{y + 1}" width="{w:.1f}" height="{h:.1f}" '
                    f'fill="{colors[contexts[0]]}" stroke="white"><title>{tip}</title></rect>'
                )
            fill = "white" if contexts and full else "#333"
            mid = x + cell_w / 2
            out.append(f'<text x="{mid:.0f}" y="{y + 15}" text-anchor="middle" fill="{fill}">{text}</text>')
    out.append("</svg>")
    return "".join(out)


class ShardingView(LiveView):
    """Where every block of a pytree of sharded arrays (or shapes with shardings) lives.

    Attributes:
      layouts: a ``mgkit._shards.Layout`` per leaf (its blocks and the contexts holding them).
      per_context: a ``ContextBytes`` per context: the bytes it stores, the leaves it holds.
    """

    css_class = "mgkit-sharding"
    headers = ("leaf", "shape", "bytes", "layout", "per context")
    context_headers = ("context", "device", "bytes", "leaves", "of its limit")

    def __init__(self, layouts: Sequence[_shards.Layout], widget: bool | None = None):
        super().__init__(1.0, None, widget, False)
        self.layouts = tuple(layouts)
        self.per_context = tuple(_shards.context_bytes(self.layouts))
        self._grids = [grid(lay) if lay.places else None for lay in self.layouts[:_GRIDS]]
        self._colors = _svg.colors([c.context for c in self.per_context])  # one colour per context
        self._start()

    def _update(self, events: list, budgeted: bool) -> bool:
        return False

    def _title(self) -> str:
        total = sum(lay.nbytes for lay in self.layouts)
        held = [c.nbytes for c in self.per_context]
        n = len(self.layouts)
        host = sum(lay.nbytes for lay in self.layouts if not lay.places)
        where = (
            f"on {len(held)} context(s), {human_bytes(min(held))} to {human_bytes(max(held))} each"
            if held
            else "on no context"
        )
        on_host = f"; {human_bytes(host)} {_shards.HOST}" if host else ""
        return f"mgkit sharding: {n} lea{'f' if n == 1 else 'ves'}, {human_bytes(total)}; {where}{on_host}"

    def _rows(self) -> list[tuple]:
        return [
            (
                lay.path,
                _type_text(lay),
                human_bytes(lay.nbytes),
                "; ".join(marks(lay)),
                human_bytes(lay.shard_bytes),
            )
            for lay in self.layouts
        ]

    def _context_rows(self) -> list[tuple]:
        rows = self.per_context
        shown = rows if len(rows) <= _CONTEXT_ROWS else rows[: _CONTEXT_ROWS - 1]
        out = [
            (
                c.context,
                "-" if c.device is None else _devices.short_name(c.device),
                human_bytes(c.nbytes),
                c.leaves,
                _limit_text(c),
            )
            for c in shown
        ]
        rest = rows[len(shown) :]
        if rest:
            lo, hi = min(c.nbytes for c in rest), max(c.nbytes for c in rest)
            out.append((f"... {len(rest)} more", "", f"{human_bytes(lo)} to {human_bytes(hi)}", "", ""))
        return out

    def _sections(self) -> list[tuple[_shards.Layout, Grid | None]]:
        return list(zip(self.layouts, self._grids, strict=False))

    def _more(self) -> str:
        rest = len(self.layouts) - len(self._grids)
        return (
            f"... and {rest} more leaves (listed above; draw one with mg.show_sharding(leaf))"
            if rest > 0
            else ""
        )

    def text(self) -> str:
        out = [self._title()]
        if len(self.layouts) > 1:
            out += [
                self._table("per leaf"),
                text_table(self.context_headers, self._context_rows(), "per context"),
            ]
        for lay, g in self._sections():
            out.append("")
            out.append(f"{lay.path}  {_type_text(lay)}  {human_bytes(lay.nbytes)}  {lay.sharding}")
            out.append("  " + "; ".join(marks(lay)) + f"; {human_bytes(lay.shard_bytes)} per context")
            if g is None:  # on the host: nothing to draw
                continue
            table = text_table(
                (g.corner, *g.cols.labels),
                [(label, *(who(c) for c in row)) for label, row in zip(g.rows.labels, g.cells, strict=True)],
            )
            out += ["  " + line for line in table.splitlines() if not set(line) <= {"-", " "}]
            if g.note:
                out.append("  " + g.note)
        if self._more():
            out.append(self._more())
        return "\n".join(out)

    def svg(self, g: Grid) -> str:
        """One leaf's grid as SVG (``grid_svg``), in the view's colours."""
        return grid_svg(g, self._colors)

    def html(self) -> str:
        esc = html.escape
        out = [f'<div class="mgkit-sharding"><div><b>{esc(self._title())}</b></div>']
        if len(self.layouts) > 1:
            out.append(self._table("per leaf", as_html=True))
            out.append(html_table(self.context_headers, self._context_rows(), "per context"))
        for lay, g in self._sections():
            head = f"{lay.path}  {_type_text(lay)}  {human_bytes(lay.nbytes)}  {lay.sharding}"
            out.append(f'<div style="margin-top:8px"><code>{esc(head)}</code></div>')
            out.append(f"<div>{esc('; '.join(marks(lay)))}; {human_bytes(lay.shard_bytes)} per context</div>")
            if g is None:  # on the host: nothing to draw
                continue
            out.append(self.svg(g))
            if g.note:
                out.append(f'<div style="font-size:11px;color:#666">{esc(g.note)}</div>')
        if self._more():
            out.append(f"<div>{esc(self._more())}</div>")
        out.append("</div>")
        return "".join(out)

    def _build(self, widgets: Any) -> Any:
        return widgets.VBox([widgets.HTML(self.html())])

    def _figsize(self) -> tuple[float, float]:
        n = len(self._grids) + (len(self.layouts) > 1)
        return 7.0, 2.6 * max(n, 1)

    def _draw_figure(self, fig: Any) -> None:
        axes = fig.subplots(len(self._grids) + (len(self.layouts) > 1), 1, squeeze=False)[:, 0]
        for ax, (lay, g) in zip(axes, self._sections(), strict=False):
            title = f"{lay.path}  {_type_text(lay)}  {'; '.join(marks(lay))}"
            if g is None:  # on the host: its title alone
                ax.set_axis_off()
                ax.set_title(title, fontsize=8, loc="left")
                continue
            color = self._colors
            tiles = [
                Tile(i, j, g.cols.filled[j], g.rows.filled[i], who(c), color[c[0]])
                for i, row in enumerate(g.cells)
                for j, c in enumerate(row)
                if c
            ]
            draw_tiles(ax, tiles, g.rows.labels, g.cols.labels, g.corner, title)
        if len(self.layouts) > 1:
            rows = self.per_context[:_CONTEXT_ROWS]
            ax = axes[-1]
            ax.barh(range(len(rows)), [c.nbytes for c in rows], color=_svg.PALETTE[0])
            ax.set_yticks(range(len(rows)), [c.context for c in rows], fontsize=7)
            ax.invert_yaxis()
            ax.set_xlabel("bytes stored per context", fontsize=8)
            ax.set_title(self._title(), fontsize=8, loc="left")


def show_sharding(x: Any, widget: bool | None = None) -> ShardingView:
    """Shows which block of each leaf of ``x`` lives on which context, from the shapes and
    shardings only (no data is read or moved).

    Args:
      x: a jax array, a pytree of them, or shapes with shardings (``jax.ShapeDtypeStruct(shape,
        dtype, sharding=...)``, what ``jax.eval_shape`` returns for a function jitted with
        ``out_shardings``), on real devices or on a ``jax.sharding.AbstractMesh``. Numpy leaves
        (a padded leaf of ``tr.params``) are listed on the host, no context holding any of
        them; leaves held static (an Equinox module's activation) are skipped. Or a trainer
        (``mg.Trainer``, ``mg.Pipeline``: anything with a ``state_shapes()`` method): its
        parameters and optimizer state as they are stored, padded blocks marked.
      widget: True for an ipywidgets widget, False for text (and HTML in a notebook), None for a
        widget inside a Jupyter kernel where ipywidgets is installed, text elsewhere.

    Returns:
      A ``ShardingView``: prints as text, displays inline in a notebook, ``save_png(path)``.

    >>> import jax, numpy as np, mgkit as mg
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> _ = mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    >>> x = jax.device_put(np.zeros((4, 6), np.float32), NamedSharding(mesh, P("x")))
    >>> print(mg.show_sharding(x, widget=False))  # doctest: +NORMALIZE_WHITESPACE
    mgkit sharding: 1 leaf, 96 B; on 2 context(s), 48 B to 48 B each
    <BLANKLINE>
    (the value itself)  float32[4, 6]  96 B  P('x', None) on mesh x=2
      split 2 x 1 (dim 0 over 'x'); 48 B per context
      dim 0 \\ dim 1  0:6
      0:2            dev0
      2:4            dev1
    """
    if callable(getattr(x, "state_shapes", None)):  # a trainer: its state as stored
        x = x.state_shapes()
    lays = _shards.layouts(x)
    if widget is None:
        widget = in_kernel() and importlib.util.find_spec("ipywidgets") is not None
    return ShardingView(lays, widget)
