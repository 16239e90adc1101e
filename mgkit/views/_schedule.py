"""The picture of a parallel step: who computed what, when.

A row per context (a pipeline's stages, an ensemble's contexts), a block per forward, backward
and update (a pipeline) or per member step (an ensemble), placed at the times the ledger's
events say each call ran on its device. For a pipeline it gives the bubble fraction: the share
of the stages' time in the step that they sat idle, measured, beside GPipe's ideal
(S - 1) / (M + S - 1) for S stages and M microbatches.

An inline widget in a notebook, text elsewhere, ``save_png(path)`` for reports.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any, NamedTuple

from .._ledger import Event, Kind
from .._table import human_bytes
from . import _svg
from ._base import LiveView
from ._png import Bar, draw_timeline

_KIND_COLORS = {Kind.FORWARD: "#1f77b4", Kind.BACKWARD: "#ff7f0e", Kind.UPDATE: "#2ca02c"}
_SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B"}  # how titles write a pipeline schedule
_KIND_CHARS = {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.UPDATE: "U"}
_WIDTH = 72  # columns of the text timeline


class Key(NamedTuple):
    """The key to one kind of block: how the text, the SVG and the PNG mark it."""

    char: str  # its character in the text timeline
    color: str  # its colour in the pictures
    meaning: str  # what it is: forward, backward, update, step of <member>


class Block(NamedTuple):
    """One call on one row: ``row`` (the context, or ``stage i (ctx)``), ``kind`` (forward,
    backward, update, step), ``label`` (the microbatch, the member), and its start and end in
    seconds from the picture's first start."""

    row: str
    kind: str
    label: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def _busy(blocks: Sequence[Block]) -> float:
    """Seconds covered by the blocks (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for b in sorted(blocks, key=lambda b: b.start):
        if b.end <= reach:
            continue
        total += b.end - max(b.start, reach)
        reach = b.end
    return total


class Schedule(LiveView):
    """A timeline of one parallel step (``Pipeline.schedule()``, ``Ensemble.schedule()``).

    Attributes:
      blocks: the ``Block`` of every call drawn, by start.
      rows: the rows, top to bottom.
      span: seconds from the first block's start to the last one's end.
      bubble: (pipelines) the share of the stages' time idle between the first forward and
        the last backward, measured; ``ideal``: GPipe's (S - 1) / (M + S - 1).
      busy: row -> the share of ``span`` its blocks cover.
    """

    css_class = "mgkit-schedule"
    figsize = (9.0, 3.0)

    def __init__(
        self,
        blocks: Sequence[Block],
        rows: Sequence[str],
        title: str,
        notes: Sequence[str] = (),
        bubble: float | None = None,
        ideal: float | None = None,
        widget: bool | None = None,
    ):
        super().__init__(1.0, None, widget, False)
        self.blocks = tuple(sorted(blocks, key=lambda b: b.start))
        self.rows = tuple(rows)
        self.title, self.notes = title, tuple(notes)
        self.bubble, self.ideal = bubble, ideal
        self.span = max((b.end for b in self.blocks), default=0.0)
        self.busy = {
            row: (_busy([b for b in self.blocks if b.row == row]) / self.span if self.span > 0 else 0.0)
            for row in self.rows
        }
        labels = sorted({b.label for b in self.blocks if b.kind == Kind.STEP})
        self._member_colors = _svg.colors(labels)
        self._start()

    # -- built from the ledger -------------------------------------------------------------

    @classmethod
    def of_pipeline(
        cls,
        events: Sequence[Event],
        stages: Sequence[str],
        microbatches: int,
        what: str,
        widget: bool | None = None,
        schedule: str = "gpipe",
    ) -> Schedule:
        """The picture of one pipeline call from its events: ``forward``, ``backward`` and
        ``update`` blocks (info ``stage``, ``microbatch``) and the stage transfers; ``schedule``
        names the order the calls ran in (``gpipe`` or ``1f1b``), for the title."""
        work = [e for e in events if e.kind in _KIND_CHARS]
        hops = [e for e in events if e.kind == Kind.TRANSFER]
        t0 = min((e.start for e in work), default=0.0)
        rows = [f"stage {i} ({ctx})" for i, ctx in enumerate(stages)]
        blocks = []
        for e in work:
            stage = int(e.info.get("stage", 0))
            mb = e.info.get("microbatch")
            label = "" if mb is None else str(mb)
            blocks.append(Block(rows[stage], e.kind, label, e.start - t0, e.start + e.seconds - t0))
        s, m = len(stages), microbatches
        fb = [b for b in blocks if b.kind != Kind.UPDATE]
        bubble = None
        if fb:
            first, last = min(b.start for b in fb), max(b.end for b in fb)
            window = last - first
            if window > 0:
                busy = sum(_busy([b for b in fb if b.row == row]) for row in rows)
                bubble = max(0.0, 1.0 - busy / (s * window))
        ideal = (s - 1) / (m + s - 1)
        moved = sum(e.nbytes for e in hops)
        span = max((b.end for b in blocks), default=0.0)
        title = (
            f"mgkit pipeline schedule: {what}; {s} stage(s) x {m} microbatch(es) "
            f"({_SCHEDULE_NAMES.get(schedule, schedule)}), {span * 1e3:.2f} ms"
        )
        notes = [
            "bubble (stages idle between the first forward and the last backward): "
            + (f"{bubble:.2f} measured" if bubble is not None else "not measured")
            + f", {ideal:.2f} ideal ((S-1)/(M+S-1))",
            f"{len(hops)} stage transfer(s) (activations forward, gradients back), {human_bytes(moved)}",
        ]
        return cls(blocks, rows, title, notes, bubble, ideal, widget)

    @classmethod
    def of_ensemble(
        cls, events: Sequence[Event], steps: int, rows: Sequence[str], widget: bool | None = None
    ) -> Schedule:
        """The picture of an ensemble's fit from its step events, a row per context: the last
        ``steps`` rounds in which every member ran (round r: each member's r-th step)."""
        by_member: dict[str, list[Event]] = {}
        for e in events:
            by_member.setdefault(str(e.info.get("member")), []).append(e)
        last = min((max(int(e.info.get("round", 0)) for e in evs) for evs in by_member.values()), default=0)
        kept = [e for e in events if last - steps < int(e.info.get("round", 0)) <= last]
        t0 = min((e.start for e in kept), default=0.0)
        blocks = [
            Block(e.src, Kind.STEP, str(e.info.get("member")), e.start - t0, e.start + e.seconds - t0)
            for e in kept
        ]
        span = max((b.end for b in blocks), default=0.0)
        first = max(last - steps + 1, 1)
        title = (
            f"mgkit ensemble schedule: {len(by_member)} member(s) on {len(rows)} context(s), rounds "
            f"{first}..{last} (a step of each member), {span * 1e3:.2f} ms"
        )
        return cls(blocks, rows, title, (), None, None, widget)

    # -- LiveView ------------------------------------------------------------------------

    def _update(self, events: list[Event], budgeted: bool) -> bool:
        return False

    def _color(self, b: Block) -> str:
        return _KIND_COLORS.get(b.kind) or self._member_colors.get(b.label, _svg.PALETTE[0])

    def _char(self, b: Block, chars: dict[str, str]) -> str:
        """A block's character in the text timeline (``chars``: member label -> its character)."""
        return _KIND_CHARS.get(b.kind) or chars.get(b.label, "#")

    def _tip(self, b: Block) -> str:
        """What hovering over a block says."""
        return f"{b.kind} {b.label} {b.seconds * 1e3:.3f} ms".replace("  ", " ")

    def _block_text(self, b: Block, width: float) -> str:
        """The text written inside a block ``width`` pixels wide (empty: none)."""
        return b.label if b.label and width > 12 and b.kind != Kind.STEP else ""

    def _legend(self) -> list[Key]:
        """The key to each kind of block drawn."""
        kinds = {b.kind for b in self.blocks}
        out = [Key(_KIND_CHARS[k], _KIND_COLORS[k], k) for k in _KIND_CHARS if k in kinds]
        for i, (label, color) in enumerate(self._member_colors.items()):
            out.append(Key(_member_char(i), color, f"step of {label}"))
        return out

    def text(self) -> str:
        lines = [self.title, *self.notes]
        if not self.blocks:
            return "\n".join([*lines, "(no calls recorded: run the step first)"])
        width = max(len(r) for r in self.rows)
        chars = {label: _member_char(i) for i, label in enumerate(self._member_colors)}
        scale = _WIDTH / self.span if self.span > 0 else 0.0
        for row in self.rows:
            cells = [" "] * _WIDTH
            for b in self.blocks:
                if b.row != row:
                    continue
                lo = min(int(b.start * scale), _WIDTH - 1)
                hi = max(lo + 1, min(round(b.end * scale), _WIDTH))
                char = self._char(b, chars)
                for i in range(lo, hi):
                    cells[i] = char
            lines.append(f"{row.ljust(width)} |{''.join(cells)}| busy {self.busy[row]:.0%}")
        lines.append(" " * width + f"  0{'':{_WIDTH - 12}}{self.span * 1e3:8.2f} ms")
        lines.append("  ".join(f"{k.char} {k.meaning}" for k in self._legend()))
        return "\n".join(lines)

    def _rows(self) -> list[tuple]:
        out = []
        for row in self.rows:
            mine = [b for b in self.blocks if b.row == row]
            out.append((row, len(mine), f"{sum(b.seconds for b in mine) * 1e3:.2f}", f"{self.busy[row]:.0%}"))
        return out

    def svg(self) -> str:
        """The timeline as SVG: a row per context, a coloured block per call."""
        left, top, row_h, width = 150, 34, 26, 560
        height = top + row_h * len(self.rows) + 40
        scale = width / self.span if self.span > 0 else 0.0
        esc = html.escape
        out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}" '
            'font-family="sans-serif" font-size="10">',
            f'<text x="4" y="12" font-size="11">{esc(self.title)}</text>',
        ]
        if self.notes:
            out.append(f'<text x="4" y="26">{esc(self.notes[0])}</text>')
        for i, row in enumerate(self.rows):
            y = top + i * row_h
            out.append(
                f'<text x="{left - 6}" y="{y + row_h / 2 + 3:.0f}" text-anchor="end">{esc(row)}</text>'
            )
            out.append(f'<rect x="{left}" y="{y + 2}" width="{width}" height="{row_h - 4}" fill="#f3f3f3"/>')
            for b in self.blocks:
                if b.row != row:
                    continue
                x, w = left + b.start * scale, max(b.seconds * scale, 0.8)
                tip = self._tip(b)
                out.append(
                    f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" '
                    f'fill="{self._color(b)}" stroke="white" stroke-width="0.5">'
                    f"<title>{esc(tip)}</title></rect>"
                )
                shown = self._block_text(b, w)
                if shown:
                    out.append(
                        f'<text x="{x + w / 2:.1f}" y="{y + row_h / 2 + 3:.0f}" text-anchor="middle" '
                        f'fill="white">{esc(shown)}</text>'
                    )
        y = top + row_h * len(self.rows) + 12
        out.append(f'<text x="{left}" y="{y}">0 ms</text>')
        out.append(f'<text x="{left + width}" y="{y}" text-anchor="end">{self.span * 1e3:.2f} ms</text>')
        x = left
        for _, color, meaning in self._legend():
            out.append(f'<rect x="{x}" y="{y + 8}" width="10" height="10" fill="{color}"/>')
            out.append(f'<text x="{x + 14}" y="{y + 17}">{esc(meaning)}</text>')
            x += 20 + 6 * len(meaning)
        out.append("</svg>")
        return "".join(out)

    def html(self) -> str:
        notes = "".join(f"<div>{html.escape(n)}</div>" for n in self.notes[1:])
        return f'<div class="mgkit-schedule">{self.svg()}{notes}</div>'

    def _build(self, widgets: Any) -> Any:
        return widgets.VBox([widgets.HTML(self.html())])

    def _figsize(self) -> tuple[float, float]:
        return (9.0, 1.6 + 0.45 * max(len(self.rows), 1))

    def _draw_figure(self, fig: Any) -> None:
        index = {row: i for i, row in enumerate(self.rows)}
        bars = [Bar(index[b.row], b.start * 1e3, b.seconds * 1e3, self._color(b)) for b in self.blocks]
        legend = {k.meaning: k.color for k in self._legend()}
        title = "\n".join([self.title, *self.notes[:1]])
        draw_timeline(fig.add_subplot(1, 1, 1), self.rows, bars, legend, "ms since the first call", title)


def _member_char(i: int) -> str:
    return "abcdefghijklmnopqrstuvwxyz"[i % 26]
