"""The picture of a profile (``mg.profile()``, ``%%mgkit_profile``): a row per context, a block per
program and step in its category (compute, communication, transfer), gaps idle, and on CPU a
``host`` row with each step's dispatch. Drawn as SVG inline (no server, no internet), as text
elsewhere, ``save_png(path)`` for reports.
"""

from __future__ import annotations

import html
import sys
from typing import Any

from .._profile_read import COMMUNICATION, COMPUTE, HOST, TRANSFER, Span
from ._schedule import Block, Key, Schedule

_CATEGORY_KEYS = {
    COMPUTE: Key("C", "#1f77b4", "compute"),
    COMMUNICATION: Key("A", "#d62728", "communication (collectives)"),
    TRANSFER: Key("T", "#2ca02c", "transfer (mgkit's copies, memcpy)"),
    HOST: Key("h", "#9a9a9a", "host: step dispatch"),
}
_CHAR_WIDTH = 5.6  # pixels per character of the SVG's 10 px font


def label_of(span: Span) -> str:
    """A block's label: its program and its step (``jit_step s3``; on the host row ``s3``)."""
    step = f"s{span.step}" if span.step is not None else ""
    program = "" if span.category == HOST else span.program  # the host row: each step's dispatch
    return " ".join(p for p in (program, step) if p)


class ProfileView(Schedule):
    """The timeline of one profile, a row per context (``prof.view()``).

    Attributes (besides ``Schedule``'s): ``profile``, the ``Profile`` drawn; ``timeline``, its
    ``Timeline``.
    """

    css_class = "mgkit-profile"

    def __init__(self, profile: Any, widget: bool | None = None):
        if not hasattr(profile, "timeline") or not hasattr(profile, "summary"):
            raise TypeError(
                f"mg.ProfileView(profile): profile must be the Profile of `with mg.profile() as prof:`, got "
                f"{type(profile).__name__}; draw one with prof.view()"
            )
        self.profile = profile
        self.timeline = tl = profile.timeline
        blocks = [Block(s.row, s.category, label_of(s), s.start, s.end) for s in tl.spans]
        title = f"mgkit profile: {tl.about}"
        shares = "; ".join(
            f"{ctx} {s.compute:.0%} compute, {s.communication:.0%} comm, {s.transfer:.0%} transfer, "
            f"{s.idle:.0%} idle"
            for ctx, s in tl.shares.items()
        )
        notes = [*tl.notes, shares or "nothing ran on a context", f"trace: {profile.trace}"]
        super().__init__(blocks, tl.rows, title, notes, None, None, widget)

    def _color(self, b: Block) -> str:
        return _CATEGORY_KEYS[b.kind].color

    def _legend(self) -> list[Key]:
        kinds = {b.kind for b in self.blocks}
        return [k for c, k in _CATEGORY_KEYS.items() if c in kinds]

    def _char(self, b: Block, chars: dict[str, str]) -> str:
        return _CATEGORY_KEYS[b.kind].char

    def _tip(self, b: Block) -> str:
        return f"{b.kind}: {b.label or 'outside a step'}, {b.seconds * 1e3:.3f} ms at {b.start * 1e3:.3f} ms"

    def _block_text(self, b: Block, width: float) -> str:
        return b.label if b.label and width > _CHAR_WIDTH * (len(b.label) + 1) else ""

    def html(self) -> str:
        notes = "".join(f"<div>{html.escape(n)}</div>" for n in self.notes[1:])
        return f'<div class="mgkit-profile">{self.svg()}{notes}{self.profile.summary()._repr_html_()}</div>'


def show_profile(profile: Any) -> None:
    """Draws a profile's timeline in IPython (inline in a notebook); nothing elsewhere."""
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)  # IPython is not imported here
    shell = get_ipython() if get_ipython is not None else None
    if shell is None:
        return
    data, metadata = shell.display_formatter.format(ProfileView(profile))
    shell.display_pub.publish(data, metadata)
