"""Short texts the views show: a cell's label, a rate, a duration, GB/s."""

from __future__ import annotations

import math


def cell_name(label: int | None) -> str:
    """``In [7]`` for the cell an event was recorded in ("" outside IPython)."""
    return "" if label is None else f"In [{label}]"


def gbps(nbytes: float, seconds: float) -> str:
    """Gigabytes per second, ``12.34``; ``n/a`` without bytes or time."""
    return f"{nbytes / seconds / 1e9:.2f}" if seconds > 0 and nbytes else "n/a"


def duration(seconds: float) -> str:
    """``2.41 ms``, ``310 us``, ``1.20 s``."""
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


def rate_text(value: float) -> str:
    """Samples per second: ``12,345``, ``4.56``; ``n/a`` when not finite."""
    return "n/a" if not math.isfinite(value) else f"{value:,.0f}" if value >= 100 else f"{value:.3g}"
