"""The picture of a scaling study (``mg.scaling``): samples/s against the count of contexts,
measured beside ideal (one context's rate times the count) and predicted (the roofline model),
and each count's step split into compute, collectives, transfers and idle."""

from __future__ import annotations

from typing import Any

from ._png import figure, require_matplotlib, write_png

_SPLIT = (("compute", "#1f77b4"), ("communication", "#d62728"), ("transfer", "#2ca02c"), ("idle", "#bbbbbb"))


def scaling_png(study: Any, path: str, dpi: int = 100) -> str:
    """Draws ``study`` (a ``ScalingStudy``) into a PNG file at ``path``; returns the path."""
    require_matplotlib("ScalingStudy.save_png")
    rows = study.rows()
    counts = [r.contexts for r in rows]
    fig = figure(9.0, 3.6, dpi)
    rate, split = fig.subplots(1, 2)
    one = rows[0].samples_per_second / rows[0].contexts
    rate.plot(counts, [one * n for n in counts], "--", color="#999999", label="ideal")
    rate.plot(counts, [r.samples_per_second for r in rows], "o-", color="#1f77b4", label="measured")
    planned = [(r.contexts, r.samples_per_second * r.seconds / r.predicted) for r in rows if r.predicted]
    if planned:  # the batch's rows over the predicted seconds, where a step was planned
        rate.plot(*zip(*planned, strict=True), ":", color="#ff7f0e", label="predicted")
    rate.set_xlabel("contexts")
    rate.set_ylabel("samples/s")
    rate.set_xticks(counts)
    rate.legend(loc="upper left", fontsize=8)
    rate.set_title("throughput", fontsize=10)
    bottom = [0.0] * len(rows)
    labels = [str(n) for n in counts]
    for name, color in _SPLIT:
        ms = [(r.split.get(name, 0.0) if r.split else 0.0) * 1e3 for r in rows]
        split.bar(
            labels, ms, bottom=bottom, color=color, label="collectives" if name == "communication" else name
        )
        bottom = [b + m for b, m in zip(bottom, ms, strict=True)]
    split.set_xlabel("contexts")
    split.set_ylabel("ms per step (mean over contexts)")
    split.legend(loc="upper left", fontsize=8)
    split.set_title("where a step's time goes", fontsize=10)
    fig.suptitle(study.verdict if len(study.verdict) <= 110 else study.verdict[:107] + "...", fontsize=9)
    write_png(fig, path, dpi)
    return path
