"""Long-running steps: step events from inside compiled loops, and waiting with a progress bar.

A fit compiles its whole loop into one program. About every tenth of a second of work (the
caller sets the interval in iterations) the program calls ``report`` on the host
(``jax.debug.callback``), which records a ``step`` event in the ledger for the context that
reported; the caller records each context's final step once the work is done (it fetches the
results anyway). The caller waits in ``wait``, on its own thread, which shows a progress bar
once the work has run for a second (a widget in notebooks, text elsewhere, through tqdm,
imported only then). Nothing here runs on the compute path except the callback.
"""

from __future__ import annotations

import itertools
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

    _ids = itertools.count(1)
    _live: ClassVar[dict[int, Run]] = {}
    _lock = threading.Lock()

    def __init__(self, what: str, names, devices, samples, models, total: int | None):
        self.id = next(Run._ids)
        self.what, self.names, self.devices = what, tuple(names), tuple(devices)
        self.samples, self.models, self.total = tuple(samples), tuple(models), total
        self.label = execution_label()
        self.start = time.perf_counter()
        self._last = {i: (self.start, 0) for i in range(len(self.names))}
        self.iteration, self.loss, self.grad = 0, float("nan"), float("nan")
        self.bar: Any = None  # the progress bar ``wait`` drew, closed by ``close``
        with Run._lock:
            Run._live[self.id] = self

    def close(self) -> None:
        """Ends the run: later reports are ignored, and the bar shows the last step and closes."""
        with Run._lock:
            Run._live.pop(self.id, None)
        bar, self.bar = self.bar, None
        if bar is not None:
            _update(bar, self)
            bar.close()

    def step(self, ctx: int, iteration: int, loss: np.ndarray, grad: np.ndarray, final: bool = False) -> None:
        """Records one ``step`` event for context ``ctx`` at ``iteration``."""
        ledger().record(self._event(ctx, iteration, loss, grad, final))

    def finals(self, steps: list[tuple[int, int, np.ndarray, np.ndarray]]) -> None:
        """Records the last step of each context, ``(ctx, iteration, loss, grad)``, at once."""
        ledger().record([self._event(*step, final=True) for step in steps])

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


def report(run: Any, ctx: Any, iteration: Any, loss: Any, grad: Any) -> None:
    """The host side of ``jax.debug.callback`` in a compiled loop: one step event per context
    (``ctx`` is one context index, or one per model when a program fits several contexts' models)."""
    live = Run._live.get(int(np.asarray(run)))
    if live is None:  # a run the caller stopped waiting for (Ctrl-C) reports nothing
        return
    ctx, it = np.asarray(ctx), int(np.asarray(iteration))
    if ctx.ndim == 0:
        live.step(int(ctx), it, loss, grad)
        return
    loss, grad = np.asarray(loss), np.asarray(grad)
    for m, i in enumerate(ctx.tolist()):
        live.step(i, it, loss[m : m + 1], grad[m : m + 1])


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
    and can draw a bar: after a second of work when ``progress`` is None, at once when True,
    never when False. Returns the outputs, or raises what computing them raised. The bar stays
    open until ``run.close()``, so it can show the last step, which the caller records."""
    finished = threading.Event()
    failure: list[BaseException] = []
    _Waiter.get().put(outputs, finished, failure)
    bar = None
    show_at = None if progress is False else time.perf_counter() + (0.0 if progress else _DELAY)
    try:
        while not finished.wait(_REFRESH if show_at is not None else None):
            if bar is None and time.perf_counter() >= show_at:
                bar = _bar(run)
            if bar is not None and bar.n != run.iteration:
                _update(bar, run)
        if bar is None and progress and not failure:  # finished before the first look: show it done
            bar = _bar(run)
        if run.total is not None and not failure:  # a fixed number of steps: all done
            run.iteration = run.total
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
