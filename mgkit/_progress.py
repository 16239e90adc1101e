"""Long-running steps: step events between a fit's calls, and waiting with a progress bar.

A fit compiles its loop into one program. One that may run long is called in chunks of about
a tenth of a second of work each (the caller sets the length in iterations); between calls the
caller records a ``step`` event in the ledger for each context (``Run.steps``), and once the
work is done each context's last step. The caller waits in ``wait``, on a helper thread, which
shows a progress bar once the work has run for a second (a widget in notebooks, text
elsewhere, through tqdm, imported only then). Nothing here runs on the compute path.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, ClassVar

import jax
import numpy as np

from ._ledger import Event, execution_label, ledger

_DELAY = 1.0  # seconds of work before a bar appears (progress=None)
_REFRESH = 0.1  # seconds between bar updates


class Run:
    """One piece of work in flight: what its step events say about each context.

    Args:
      what: what runs, e.g. ``"logreg.fit (lbfgs)"``.
      names, devices: context names and short device names, by context index.
      samples: rows each context processes per iteration and model.
      models: models each context fits.
      total: iterations at most (the bar's length), or None when the work stops earlier.
    """

    def __init__(self, what: str, names, devices, samples, models, total: int | None):
        self.what, self.names, self.devices = what, tuple(names), tuple(devices)
        self.samples, self.models, self.total = tuple(samples), tuple(models), total
        self.label = execution_label()
        self.start = time.perf_counter()
        self._last = {i: (self.start, 0) for i in range(len(self.names))}
        self.iteration, self.loss, self.grad = 0, float("nan"), float("nan")
        self.bar: Any = None  # the progress bar ``wait`` drew, closed by ``close``

    def close(self) -> None:
        """Ends the run: the bar shows the last step and closes."""
        bar, self.bar = self.bar, None
        if bar is not None:
            _update(bar, self)
            bar.close()

    def steps(self, steps: list[tuple[int, int, np.ndarray, np.ndarray]], final: bool = False) -> None:
        """Records one ``step`` event per context, ``(ctx, iteration, loss, grad)``, at once
        (``final``: the work is done, these are the contexts' last steps)."""
        ledger().record([self._event(*step, final=final) for step in steps])

    def _event(self, ctx: int, iteration: int, loss: Any, grad: Any, final: bool) -> Event:
        now = time.perf_counter()
        t_prev, it_prev = self._last.get(ctx, (self.start, 0))
        self._last[ctx] = (now, iteration)
        seconds = max(now - t_prev, 1e-9)
        done = iteration - it_prev
        # a few values per context: plain floats are several times faster than numpy's nan-functions
        losses = [v for v in np.asarray(loss, np.float64).ravel().tolist() if v == v]
        grads = [v for v in np.asarray(grad, np.float64).ravel().tolist() if v == v]
        info = {
            "what": self.what,
            "iteration": int(iteration),
            "of": self.total,
            "models": self.models[ctx],
            "loss": sum(losses) / len(losses) if losses else float("nan"),
            "grad": max(grads) if grads else float("nan"),
            "samples_per_second": done * self.samples[ctx] * self.models[ctx] / seconds,
            "final": final,
        }
        if iteration >= self.iteration:
            self.iteration, self.loss, self.grad = int(iteration), info["loss"], info["grad"]
        name, dev = self.names[ctx], self.devices[ctx]
        return Event("step", name, name, dev, dev, 0, time.time() - seconds, seconds, self.label, info)


class _Waiter:
    """A daemon thread that waits for the outputs handed to it, kept for the next wait once done.
    Starting a thread for every wait cost about a millisecond: the new thread must first be
    scheduled, while the program it waits for keeps every core busy. A wait that is still
    blocked (its caller stopped with Ctrl-C) keeps its thread; the next wait gets another. A
    kept waiter whose thread is gone (a process forked from this one has none) is dropped."""

    _idle: ClassVar[list[_Waiter]] = []
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mgkit-wait", daemon=True)
        self._thread.start()

    @classmethod
    def get(cls) -> _Waiter:
        with cls._lock:
            while cls._idle:
                waiter = cls._idle.pop()
                if waiter._thread.is_alive():
                    return waiter
        return cls()

    def put(self, outputs: Any, finished: threading.Event, failure: list) -> None:
        self._jobs.put((outputs, finished, failure))

    def _run(self) -> None:
        while True:
            outputs, finished, failure = self._jobs.get()
            try:
                jax.block_until_ready(outputs)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                failure.append(e)
            with _Waiter._lock:
                _Waiter._idle.append(self)
            finished.set()
            outputs = finished = failure = None  # hold no results (or errors) between waits


def wait(outputs: Any, run: Run, progress: bool | None) -> Any:
    """Waits for ``outputs`` on a helper thread, so the caller stays responsive (Ctrl-C works)
    and can draw a bar: once the run has lasted a second when ``progress`` is None, at once when
    True, never when False. Returns the outputs, or raises what computing them raised. The bar
    stays open until ``run.close()``, through the run's later waits, so it can show the last
    step, which the caller records."""
    finished = threading.Event()
    failure: list[BaseException] = []
    _Waiter.get().put(outputs, finished, failure)
    bar, run.bar = run.bar, None
    show_at = None if progress is False else run.start + (0.0 if progress else _DELAY)
    try:
        while not finished.wait(_REFRESH if show_at is not None else None):
            if bar is None and time.perf_counter() >= show_at:
                bar = _bar(run)
            if bar is not None and bar.n != run.iteration:
                _update(bar, run)
        if bar is None and progress and not failure:  # finished before the first look: show it done
            bar = _bar(run)
    except BaseException:
        if bar is not None:
            bar.close()
        raise
    if failure:
        if bar is not None:
            bar.close()
        raise failure[0]
    run.bar = bar  # the caller records the last step, then ``run.close()`` shows it and closes
    return outputs


def _bar(run: Run) -> Any:
    from tqdm.auto import tqdm  # a widget in notebooks, text elsewhere

    return tqdm(total=run.total, desc=run.what, unit="it", leave=True)


def _update(bar: Any, run: Run) -> None:
    bar.n = run.iteration
    bar.set_postfix_str(f"loss {run.loss:.6g}, max|grad| {run.grad:.2e}", refresh=False)
    bar.refresh()
