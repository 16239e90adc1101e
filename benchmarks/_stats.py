"""Robust summaries shared by the benchmarks (run as scripts: ``benchmarks/`` is on sys.path)."""

from __future__ import annotations

import numpy as np

TRIM = 0.10  # share cut from each end for the trimmed mean


def median(xs: list[float]) -> float:
    return float(np.median(xs))


def trimmed_mean(xs: list[float], trim: float = TRIM) -> float:
    s = sorted(xs)
    k = int(len(s) * trim)
    core = s[k : len(s) - k] or s
    return sum(core) / len(core)


def quartiles(xs: list[float]) -> tuple[float, float]:
    q1, q3 = np.percentile(xs, [25, 75])
    return float(q1), float(q3)
