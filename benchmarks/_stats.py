"""Robust summaries and report helpers shared by the benchmarks (run as scripts:
``benchmarks/`` is on sys.path)."""

from __future__ import annotations

import os

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


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([fmt(headers), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)])


def duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def load_average() -> str:
    """The 1-minute load average, or n/a where the OS does not tell."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except (AttributeError, OSError):  # not on Unix
        return "n/a"


def cpu_counts() -> tuple[int | None, int | None]:
    """(CPUs on the host, CPUs this process may use)."""
    cpus = os.cpu_count()
    try:
        return cpus, len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return cpus, cpus


def stage_report(
    stages: dict, t_start: float, elapsed: float, included: str, load_before: str, load_after: str
) -> str:
    """Two lines: how long each case took (``stages``: case -> perf_counter at its end), and the
    load average before and after."""
    marks = [t_start, *stages.values()]
    spans = zip(stages, marks[:-1], marks[1:], strict=True)
    per_case = ", ".join(f"({k}) {b - a:.1f} s" for k, a, b in spans)
    return (
        f"cases took {elapsed:.1f} s ({per_case}, {included})\n"
        f"load average (1 min): {load_before} before the cases, {load_after} after"
    )
