"""``mg.scaling``: the same training step on 1, 2, 4, ... contexts, measured, split and
explained. For each count the user's ``make_trainer(n)`` makes a trainer on n contexts; its step
is compiled first (left out), then ``steps`` steps of one batch are timed (samples/s), a short
``mg.profile`` splits a step per context into compute, collectives, transfers and idle (the host
dispatching and feeding the step), and ``Trainer.plan`` predicts it (the roofline model). The
verdict names the bottleneck at the largest count in one sentence, with its numbers.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from .. import _contexts
from .._numbers import whole
from .._profile import profile as run_profile
from .._profile_read import CATEGORIES
from .._table import Table

GOOD = 0.8  # an efficiency at which a study says the step scales well
_EXAMPLE = "lambda n: mg.Trainer(loss, optax.adam(1e-3), init(), contexts=n)"


class ScalingRow(NamedTuple):
    """One count of contexts: measured and predicted seconds per step, and the step's split."""

    contexts: int
    samples_per_second: float
    seconds: float  # measured per step
    efficiency: float  # samples/s over (contexts x one context's samples/s)
    predicted: float | None  # seconds per step, the roofline model's (``Trainer.plan``); None:
    # contexts that share a device or mix kinds (the gather-update-copy loop: no one program to plan)
    split: dict  # seconds per step in compute, communication, transfer, idle (mean over contexts)
    intensity: float | None  # flops per context over bytes it sends per step (planned)
    balance: float  # this machine's peak flop/s over its link bytes/s (flops per byte)


class ScalingStudy(Table):
    """A scaling study: a ``ScalingRow`` per count (``rows()``), the ``verdict``, and the picture
    (``save_png``: measured against ideal and predicted samples/s, and each step's split)."""

    headers = (
        "contexts", "samples/s", "efficiency", "step", "predicted", "compute", "collectives",
        "transfers", "idle",
    )  # fmt: skip

    def __init__(self, rows: list[ScalingRow], verdict: str, simulated: str):
        self.verdict, self.simulated = verdict, simulated
        super().__init__(rows, f"mgkit scaling: {verdict}")

    def _display_rows(self) -> list[tuple]:
        ms = lambda s: f"{s * 1e3:.3g} ms"  # noqa: E731
        return [
            (
                r.contexts,
                f"{r.samples_per_second:,.0f}",
                f"{r.efficiency:.0%}",
                ms(r.seconds),
                "-" if r.predicted is None else f"{ms(r.predicted)} ({r.predicted / r.seconds:.2g}x)",
                *(ms(r.split[c]) if r.split else "-" for c in (*CATEGORIES, "idle")),
            )
            for r in self._rows
        ]

    def save_png(self, path: str | os.PathLike, dpi: int = 100) -> str:
        """Writes the picture as a PNG file; returns its path."""
        from ..views import scaling_png  # a picture: matplotlib loads when drawn

        return scaling_png(self, os.fspath(path), dpi)


def scaling(
    make_trainer: Callable[[int], Any],
    batch: Any,
    *,
    contexts: Any = (1, 2, 4, 8),
    steps: int = 20,
    profile: bool = True,
) -> ScalingStudy:
    """The same step measured on each count of ``contexts``.

    >>> import mgkit as mg, optax, jax.numpy as jnp, numpy as np   # doctest: +SKIP
    >>> make = lambda n: mg.Trainer(loss, optax.adam(1e-3), init(), contexts=n)   # doctest: +SKIP
    >>> study = mg.scaling(make, batch, contexts=[1, 2, 4, 8], steps=20)   # doctest: +SKIP
    >>> study.verdict   # doctest: +SKIP
    'communication-bound on 8 contexts: ...'

    Args:
      make_trainer: ``n -> mg.Trainer`` on n contexts (``contexts=n``), the same model each time.
      batch: the batch every step trains on (the same rows for every count: strong scaling).
      contexts: the counts, each at most the contexts in the map.
      steps: timed steps per count, after two that compile.
      profile: split each count's step with a short ``mg.profile`` (a few steps).

    Returns a ``ScalingStudy``.
    """
    where = "mg.scaling"
    if not callable(make_trainer):
        raise TypeError(
            f"{where}: make_trainer must be a function n -> mg.Trainer on n contexts, got "
            f"{type(make_trainer).__name__}; e.g. {_EXAMPLE}"
        )
    counts = _counts(contexts, where)
    steps = whole(steps, "steps", where, lo=1, example=20, note="timed steps per count")
    measured = [_measure(make_trainer, n, batch, steps, profile, where) for n in counts]
    one = measured[0][1] / counts[0]  # samples/s of one context, from the smallest count
    rows = [
        ScalingRow(n, rate, seconds, rate / (n * one), predicted, split, intensity, balance)
        for n, (seconds, rate, predicted, split, intensity, balance) in zip(counts, measured, strict=True)
    ]
    simulated = _simulated(counts[-1])
    return ScalingStudy(rows, verdict(rows, simulated), simulated)


def _counts(contexts: Any, where: str) -> list[int]:
    have = len(_contexts.context_map().names)
    if isinstance(contexts, int | str) or not hasattr(contexts, "__iter__"):
        raise TypeError(f"{where}: contexts must be a list of counts, e.g. [1, 2, 4, 8], got {contexts!r}")
    counts = [whole(n, "contexts", where, lo=1, example=4) for n in contexts]
    if not counts:
        raise ValueError(
            f"{where}: contexts=[] is an empty grid; give the counts to measure, e.g. [1, 2, 4, 8]"
        )
    if max(counts) > have:
        raise ValueError(
            f"{where}: contexts={list(contexts)} asks for {max(counts)} contexts and the map has {have}; "
            f"use counts up to {have} (mg.simulate(8) before JAX starts gives 8 CPU devices)"
        )
    return sorted(set(counts))


def _measure(make_trainer: Callable, n: int, batch: Any, steps: int, profile: bool, where: str) -> tuple:
    """(seconds per step, samples/s, predicted seconds, split, intensity, machine balance) on n contexts."""
    from ._trainer import Trainer  # the trainer module needs this one's package first

    tr = make_trainer(n)
    if not isinstance(tr, Trainer):
        raise TypeError(
            f"{where}: make_trainer({n}) returned {type(tr).__name__} {tr!r:.60}; it must return an "
            f"mg.Trainer on {n} contexts, e.g. {_EXAMPLE}"
        )
    if len(tr.contexts) != n:
        raise ValueError(
            f"{where}: make_trainer({n}) made a trainer on {len(tr.contexts)} context(s) "
            f"({', '.join(tr.contexts)}); pass contexts=n to mg.Trainer"
        )
    same = lambda step: batch  # noqa: E731 - every step trains on the same rows
    tr.fit(same, steps=2, progress=False)  # compiles (left out)
    t0 = time.perf_counter()
    tr.fit(same, steps=steps, progress=False)
    seconds = (time.perf_counter() - t0) / steps
    rows = _rows(batch)
    planned, balance = None, float("nan")
    if tr.spmd:  # one program to plan (the gather-update-copy loop has none)
        plan = tr.plan(batch)
        planned, balance = plan.rows()[0], plan.figures.flops / plan.figures.link
    split: dict = {}
    if profile:
        profiled = min(steps, 5)
        with tempfile.TemporaryDirectory(prefix="mgkit-scaling-") as folder:
            with run_profile(folder, show=False) as prof:
                tr.fit(same, steps=profiled, progress=False)
            shares = prof.summary().rows()
        for c_i, name in enumerate((*CATEGORIES, "idle")):  # each share of the measured step
            split[name] = seconds * sum(r[1 + c_i] for r in shares) / max(1, len(shares))
    intensity = (
        None if planned is None or planned.flops is None or not planned.sent else planned.flops / planned.sent
    )
    return seconds, rows / seconds, None if planned is None else planned.seconds, split, intensity, balance


def _rows(batch: Any) -> int:
    import jax
    import numpy as np

    return int(np.shape(jax.tree_util.tree_leaves(batch)[0])[0])


def _simulated(n: int) -> str:
    """A note where the contexts are simulated CPU devices sharing this host's cores, else ""."""
    devices = _contexts.context_map().devices()
    if not devices or any(d.platform != "cpu" for d in devices.values()):
        return ""
    cores = os.cpu_count() or 1
    return (
        f"the {n} contexts are CPU devices sharing this host's {cores} core(s): more of them cannot run "
        "faster here, so read the split for where the time goes, not the speed-up"
    )


def verdict(rows: list[ScalingRow], simulated: str = "") -> str:
    """The bottleneck at the largest count, in one sentence with its numbers."""
    last = rows[-1]
    tail = f" ({simulated})" if simulated else ""
    if len(rows) == 1:
        return (
            f"one count measured ({last.contexts} context(s)): give contexts=[1, 2, 4, ...] to compare{tail}"
        )
    if last.efficiency >= GOOD:
        return (
            f"scales well: {last.efficiency:.0%} efficiency on {last.contexts} contexts "
            f"({last.samples_per_second:,.0f} samples/s, ideal "
            f"{last.samples_per_second / last.efficiency:,.0f}){tail}"
        )
    at = f"{last.efficiency:.0%} efficiency on {last.contexts} contexts"
    step = last.seconds
    losses = {k: v for k, v in last.split.items() if k != "compute"}
    worst = max(losses, key=losses.get) if losses else None
    share = losses.get(worst, 0.0) / step if worst else 0.0
    if worst == "communication" or (
        worst is None and last.intensity is not None and last.intensity < last.balance
    ):
        head = f"communication-bound: {at}, {share:.0%} of a step in collectives"
        if last.intensity is None or last.intensity < last.balance:
            intensity = "unknown" if last.intensity is None else f"{last.intensity:.3g}"
            return (
                f"{head}; arithmetic intensity {intensity} flops/byte, below this machine's "
                f"{last.balance:.3g}; a larger batch per context or accumulate=4 raises it{tail}"
            )
        return (
            f"{head}; arithmetic intensity {last.intensity:.3g} flops/byte, above this machine's "
            f"{last.balance:.3g}, so it is the collectives' count and latency, not their bytes: fewer, "
            f"larger collectives (fewer split leaves, a larger batch per step) help{tail}"
        )
    if worst == "idle":
        return (
            f"dispatch/input-bound: {at}; the contexts wait {share:.0%} of a step for the host to "
            f"dispatch and feed it; a larger batch per step, prefetch= or a longer step raises the work "
            f"per dispatch{tail}"
        )
    if worst == "transfer":
        return (
            f"transfer-bound: {at}, {share:.0%} of a step copying data to or between contexts; keep the "
            f"data on the devices (mg.put once, or prefetch=){tail}"
        )
    return f"compute-bound but not faster: {at}; each context's compute did not shrink with the count{tail}"
