"""The ledger's totals as tables: per (kind, source, target), and bytes between every pair."""

from __future__ import annotations

import numpy as np

from .._table import Table, html_table, human_bytes, text_table
from ._events import Kind, short_label


class Summary(Table):
    """Per source -> target pair totals: count, bytes, seconds, GB/s. Collectives inside compiled
    programs are read from the programs, not timed: their seconds say ``read``."""

    headers = ("kind", "from", "to", "count", "bytes", "seconds", "GB/s")

    def _display_rows(self) -> list[tuple]:
        return [
            (
                k,
                short_label(s),
                short_label(d),
                c,
                human_bytes(b),
                "read" if k == Kind.COLLECTIVE else f"{t:.6f}",
                f"{b / t / 1e9:.2f}" if t > 0 and b else "n/a",
            )
            for k, s, d, c, b, t in self._rows
        ]


class Matrix:
    """Bytes moved between every pair of contexts: ``values[i, j]`` from ``names[i]`` to ``names[j]``."""

    def __init__(self, names: list[str], values: np.ndarray):
        self.names = names
        self.values = values

    def __getitem__(self, pair: tuple[str, str]) -> int:
        src, dst = pair
        return int(self.values[self.names.index(src), self.names.index(dst)])

    def _rows(self) -> tuple[list[str], list[list[str]]]:
        headers = ["from \\ to", *map(short_label, self.names)]
        rows = [
            [short_label(s), *(human_bytes(v) if v else "." for v in self.values[i])]
            for i, s in enumerate(self.names)
        ]
        return headers, rows

    def __repr__(self) -> str:
        return text_table(*self._rows(), title="bytes moved (row: from, column: to)")

    def _repr_html_(self) -> str:
        return html_table(*self._rows(), title="bytes moved (row: from, column: to)")
