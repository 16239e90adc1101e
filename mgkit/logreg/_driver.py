"""Driving compiled fits from the host: calls, resumption of chunked fits, progress and the
convergence warning."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import _progress
from .._spmd import Targets, note_run
from ._checks import check_finite
from ._model import ConvergenceWarning
from ._programs import mapped_program
from ._results import Facts, last_losses, merged
from ._solver import Spec


def _steps(facts: Facts, owners, last: np.ndarray) -> list[tuple]:
    """One step per context, ``(ctx, iteration, losses, gradients)``, over the models it fits
    (``owners``: the context index, or indices, of each model)."""
    mine: dict[int, list[int]] = {}
    for r, owner in enumerate(owners):
        for ctx in np.atleast_1d(owner).tolist():
            mine.setdefault(ctx, []).append(r)
    return [(ctx, int(facts.its[got].max()), last[got], facts.grad[got]) for ctx, got in mine.items()]


class Job:
    """One compiled fit's calls: ``program(resume)`` is the jitted program of a first call
    (resume False) or of one that goes on from a state (True; a program may serve both), and
    ``args`` its arguments. A chunked fit's call ends after ``spec.every`` iterations and
    returns its state with its results; the next call takes that state last, until no model
    runs on. ``contexts``: the indices of the contexts whose models it fits (None: all);
    ``work``: its last call's work (``_progress.start``). A program that has not yet run on
    arguments of this kind is compiled first, while Ctrl-C still works (``_progress.compile``).
    ``spans``: the contexts an SPMD program spans, whose collectives each call records (None:
    a program on one context, which has none)."""

    def __init__(
        self,
        spec: Spec,
        program: Callable,
        args: tuple,
        contexts: Sequence[int] | None = None,
        spans: Targets | None = None,
    ) -> None:
        self.spec, self.program, self.args, self.contexts = spec, program, args, contexts
        self.spans = spans
        self.work = self._start(())

    def _start(self, state: tuple) -> _progress.Work:
        program, args = self.program(bool(state)), (*self.args, *state)
        _progress.compile(program, args)
        start = time.time()
        work = _progress.start(lambda: program(*args))
        if self.spans is not None:
            what = f"logreg ({self.spec.solver})"
            note_run(program, args, self.spans.contexts, what, start)
        return work

    @property
    def out(self) -> Any:
        return self.work.out

    @property
    def result(self) -> Any:
        return self.out[0] if self.spec.chunked else self.out

    def running(self) -> bool:
        return bool(np.asarray(self.result[-1])[:, -1].any())  # packed facts last; "still running" last

    def resume(self) -> None:
        self.work = self._start((self.out[1],))


def mapped_job(spec: Spec, targets: Targets, layout: str, args: tuple, omega_spec: Any = None) -> Job:
    """A job of the layout's SPMD program over the contexts of ``targets`` on ``args`` (a resumed
    call: the resuming program)."""
    devices = targets.devices

    def program(resume: bool) -> Callable:
        return mapped_program(spec, devices, layout, omega_spec, resume)

    return Job(spec, program, args, spans=targets)


def drive(jobs: list[Job], run: _progress.Run, progress, facts_of: Callable, owners) -> Facts:
    """Waits for the jobs (``_progress.wait``: Ctrl-C works, a bar once the fit has run for a
    second) and resumes the chunked ones while a model runs on, recording each context's step
    between calls. Returns the facts of the last calls, ``facts_of(results)``, which fetches
    them at once (a fit within one call, the usual case, costs one fetch), with the history
    of every call joined."""
    for job in jobs:
        run.begin(job.work.began, job.contexts)
    history = None  # each call returns its own iterations' objective: the host joins them
    while True:
        _progress.wait([job.work for job in jobs], run, progress)
        for job in jobs:
            run.end(job.work.ended, job.contexts)
        facts = facts_of([job.result for job in jobs])
        history = merged(history, facts)
        facts = facts._replace(hist=history, base=np.zeros_like(facts.base))
        if not facts.more.any():
            return facts._replace(hist=history[:, : int(facts.its.max()) + 1])
        run.steps(_steps(facts, owners, last_losses(facts)))
        for job in jobs:
            if job.spec.chunked and job.running():
                job.resume()  # the first resumption compiles the resuming program
                run.begin(job.work.began, job.contexts)


def conclude(run: _progress.Run, facts: Facts, labels, owners, where, solver, data) -> None:
    """Records each context's final step event, and warns about the models that stopped short.

    ``facts``: a row per model; ``labels``: how the warning names each model; ``owners``: the
    context index, or indices, that fitted each model; ``data``: (arrays, names) of the
    features, checked for NaN and inf when a model's gradient is not finite (the solver's first
    gradient reads every value, so finite data needs no pass of its own).
    """
    conv, grad = facts.conv, facts.grad
    if not np.isfinite(grad).all():
        check_finite(*data, where)
    last = last_losses(facts)
    first = np.array([h[0] for h in facts.hist])
    run.steps(_steps(facts, owners, last), final=True)
    bad = [
        f"{labels[r] + ': ' if labels[r] else ''}max|gradient| {grad[r]:.3g}" for r in np.flatnonzero(~conv)
    ]
    diverged = bool(np.any(~conv & (~np.isfinite(last) | (last > first))))
    if not bad:
        return
    shown = "; ".join(bad[:8]) + (f"; ... ({len(bad)} in all)" if len(bad) > 8 else "")
    if diverged:
        what = "the fit diverged (the objective rose)"
        fix = "lower learning_rate" if solver == "gd" else "standardise the features or raise l2"
    else:
        what = "did not converge"
        fix = (
            "raise max_iter (steps) or use solver='newton' or 'lbfgs'"
            if solver == "gd"
            else "raise max_iter, standardise the features, or raise l2"
        )
    warnings.warn(f"{where}: {what} ({solver}): {shown}. To fix it, {fix}.", ConvergenceWarning, stacklevel=3)


def progress_run(what, targets: Targets, samples, models, spec: Spec) -> _progress.Run:
    return _progress.Run(
        f"{what} ({spec.solver})",
        targets.contexts,
        samples,
        models,
        spec.max_iter if spec.solver == "gd" else None,
    )
