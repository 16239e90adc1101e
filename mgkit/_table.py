"""Plain-text and HTML rendering of small tables, shared by every report mgkit prints."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> str:
    """Renders rows as an aligned plain-text table (numbers right-aligned)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    numeric = [
        bool(rows) and all(isinstance(row[i], int | float) for row in rows) for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    out = [title] if title else []
    out.append(line(list(headers)))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(row) for row in cells)
    if not rows:
        out.append("(none)")
    return "\n".join(out)


class Markup(str):
    """A cell's content that is HTML already (a bar, a coloured word): ``html_table`` puts it in
    the cell as it is, where it escapes every other value."""


def html_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    title: str = "",
    row_attrs: Sequence[Mapping[str, str]] | None = None,
) -> str:
    """Renders rows as an HTML table for notebook display.

    Args:
      headers, rows, title: the columns, the cells (``Markup`` cells go in unescaped), a caption.
      row_attrs: each row's HTML attributes (``{"class": "mgkit-current"}``), or None.
    """
    esc = html.escape
    head = "".join(f"<th>{esc(str(h))}</th>" for h in headers)
    attrs = row_attrs if row_attrs is not None else [{}] * len(rows)
    body = "".join(
        "<tr"
        + "".join(f' {k}="{esc(v)}"' for k, v in a.items())
        + ">"
        + "".join(f"<td>{c if isinstance(c, Markup) else esc(str(c))}</td>" for c in row)
        + "</tr>"
        for row, a in zip(rows, attrs, strict=True)
    )
    if not rows:
        body = f'<tr><td colspan="{len(headers)}">(none)</td></tr>'
    caption = f"<caption>{esc(title)}</caption>" if title else ""
    return f'<table class="mgkit">{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def human_bytes(n: float) -> str:
    """Formats a byte count with a binary unit: 33554432 -> '32.0 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Table:
    """A small immutable table that prints as text and displays as HTML in notebooks."""

    headers: tuple[str, ...] = ()

    def __init__(self, rows: Sequence[Sequence[object]], title: str = ""):
        self._rows = [r if isinstance(r, tuple) else tuple(r) for r in rows]
        self._title = title

    def rows(self) -> list[tuple]:
        """The table's rows as tuples, in display order."""
        return list(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return text_table(self.headers, self._display_rows(), self._title)

    def _repr_html_(self) -> str:
        return html_table(self.headers, self._display_rows(), self._title)

    def _display_rows(self) -> list[tuple]:
        return self._rows
