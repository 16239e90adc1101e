"""Long-running steps: step events between a fit's calls, and waiting with a progress bar.

A fit compiles its loop into one program. One that may run long is called in chunks of about
a tenth of a second of work each (the caller sets the length in iterations); between calls the
caller records a ``step`` event in the ledger for each context (``Run.steps``), and once the
work is done each context's last step. Each call's work is watched by a helper thread from
its start (``start``, ``Work``); the caller waits in ``wait``, which shows a progress bar once
the work has run for a second (a widget in notebooks, text elsewhere, through tqdm, imported
only then). Nothing here runs on the compute path.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import numpy as np

from ._beat import beat
from ._ledger import Event, Kind, execution_label, ledger

_DELAY = 1.0  # seconds of work before a bar appears (progress=None)
_REFRESH = 0.1  # seconds between bar updates


class Run:
    """One piece of work in flight: what its step events say about each context.

    Args:
      what: what runs, e.g. ``"logreg.fit (lbfgs)"``.
      contexts: the contexts the work runs on (``Context`` values), by context index.
      samples: rows each context processes per iteration and model.
      models: models each context fits.
      total: iterations at most (the bar's length), or None when the work stops earlier.
    """

    def __init__(self, what: str, contexts, samples, models, total: int | None):
        self.what, self.contexts = what, tuple(contexts)
        self.samples, self.models, self.total = tuple(samples), tuple(models), total
        self.label = execution_label()
        self.start = time.perf_counter()
        self._last = {i: (self.start, 0) for i in range(len(self.contexts))}
        self._ends: dict[int, float] = {}  # when each context's work was seen done, once known
        self.iteration, self.loss, self.grad = 0, float("nan"), float("nan")
        self.bar: Any = None  # the progress bar ``wait`` drew, closed by ``close``

    def begin(self, at: float, contexts=None) -> None:
        """The work of ``contexts`` (all when None) began, or went on, on the devices at ``at``
        (``time.perf_counter``): their next step is timed from there."""
        for ctx in range(len(self.contexts)) if contexts is None else contexts:
            self._last[ctx] = (at, self._last[ctx][1])

    def end(self, at: float, contexts=None) -> None:
        """The work of ``contexts`` (all when None) was seen done at ``at``: their next step is
        timed to there (else to when it is recorded)."""
        for ctx in range(len(self.contexts)) if contexts is None else contexts:
            self._ends[ctx] = at

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
        beat(self.iteration)

    def _event(self, ctx: int, iteration: int, loss: Any, grad: Any, final: bool) -> Event:
        now = self._ends.pop(ctx, None) or time.perf_counter()
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
            "steps": int(done),  # the iterations its seconds span
            "of": self.total,
            "models": self.models[ctx],
            "loss": sum(losses) / len(losses) if losses else float("nan"),
            "grad": max(grads) if grads else float("nan"),
            "samples_per_second": done * self.samples[ctx] * self.models[ctx] / seconds,
            "final": final,
        }
        if iteration >= self.iteration:
            self.iteration, self.loss, self.grad = int(iteration), info["loss"], info["grad"]
        return Event.on(Kind.STEP, self.contexts[ctx], time.time() - seconds, seconds, self.label, info)


def compile(program: Any, args: tuple) -> None:
    """Compiles the jitted ``program`` for ``args`` in a helper thread while the caller waits
    in slices, so Ctrl-C works (XLA's compiler runs seconds without returning to Python, and a
    signal is only seen when it does). Done once per program and kind of arguments (shapes,
    dtypes, shardings); the call then finds the compiled program in jit's caches. An
    interrupted compile runs on to its end and is kept (a later call waits for it, not for a
    second compile); nothing is dispatched. A compile that fails is left to the call, which
    raises its error. At exit, compiles still running are waited for: a thread stopped inside
    the compiler aborts the process."""
    kind = tuple(
        (getattr(a, "shape", None), getattr(a, "dtype", type(a)), getattr(a, "sharding", None))
        for a in jax.tree_util.tree_leaves(args)
    )
    try:
        kinds = _compiled.setdefault(program, {})
    except TypeError:  # not weakly referable: compiled by its call
        return
    done = kinds.get(kind)
    if done is None:
        done = kinds[kind] = threading.Event()

        def run() -> None:
            try:
                program.lower(*args).compile()
            except Exception:  # noqa: BLE001 - the call raises it, with its own traceback
                pass
            finally:
                done.set()
                _compiling.discard(threading.current_thread())

        thread = threading.Thread(target=run, name="mgkit-compile", daemon=True)
        _compiling.add(thread)
        thread.start()
    while not done.wait(_REFRESH):
        pass


_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # program -> {kind of arguments: done}
_compiling: set[threading.Thread] = set()


_in_flight: set[Work] = set()  # work a waiter thread is blocked on


@atexit.register
def _finish() -> None:
    """At exit, waits for compiles and work left running by an interrupted wait (a chunk of a
    fit is short): a thread stopped at exit inside XLA's compiler or a wait aborts the process
    ("FATAL: exception not rethrown")."""
    for thread in list(_compiling):
        thread.join()
    for work in list(_in_flight):
        work.done.wait(60)


def start(call: Callable[[], Any]) -> Work:
    """Calls ``call()``, which starts work on the devices, and returns the ``Work``. It began
    when the call returned if the call traced and compiled the program first (that takes
    seconds, and a step's rate must not count it), else when the call was made (the devices
    start at once; the call returns while they work)."""
    if not _compiles:
        listen = getattr(jax.monitoring, "register_event_duration_secs_listener", None)
        if listen is not None:  # else no call counts as compiling: a first step counts its compile
            listen(_count_compile)
        _compiles.append(0)
    compiles, began = _compiles[0], time.perf_counter()
    out = call()
    return Work(out, time.perf_counter() if _compiles[0] != compiles else began)


_compiles: list[int] = []  # [programs traced or compiled so far], once counting


def _count_compile(event: str, duration: float, **kwargs: Any) -> None:
    if event.startswith("/jax/core/compile/"):
        _compiles[0] += 1


class Work:
    """Work in flight on the devices: its outputs ``out``, when it began (``time.perf_counter``)
    and, once a helper thread has seen it done, when (``ended``) or what computing it raised
    (``failure``). The thread watches from the start, so each piece of work gets its own end
    even when several run at once and the caller waits for them in turn."""

    __slots__ = ("began", "done", "ended", "failure", "out")

    def __init__(self, out: Any, began: float | None = None) -> None:
        self.out, self.began = out, time.perf_counter() if began is None else began
        self.ended: float | None = None
        self.failure: BaseException | None = None
        self.done = threading.Event()
        _Waiter.get().put(self)


class _Waiter:
    """A daemon thread that waits for the work handed to it, kept for the next once done.
    Starting a thread for every wait cost about a millisecond: the new thread must first be
    scheduled, while the program it waits for keeps every core busy. A wait that is still
    blocked (its caller stopped with Ctrl-C) keeps its thread; the next work gets another. A
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

    def put(self, work: Work) -> None:
        self._jobs.put(work)

    def _run(self) -> None:
        while True:
            work = self._jobs.get()
            _in_flight.add(work)
            try:
                jax.block_until_ready(work.out)
                work.ended = time.perf_counter()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                work.failure = e
            with _Waiter._lock:
                _Waiter._idle.append(self)
            _in_flight.discard(work)
            work.done.set()
            work = None  # hold no results (or errors) between waits


def wait(works: list[Work], run: Run, progress: bool | None) -> None:
    """Waits until each piece of work is done, so the caller stays responsive (Ctrl-C stops
    the wait at once, within ``_REFRESH``, and leaves the work to end on its own) and can draw
    a bar: once the run has lasted a second when ``progress`` is None, at once when
    True, never when False. Raises what computing the work raised. The bar stays open until
    ``run.close()``, through the run's later waits, so it can show the last step, which the
    caller records."""
    bar, run.bar = run.bar, None
    show_at = None if progress is False else run.start + (0.0 if progress else _DELAY)
    try:
        for work in works:
            # Waits in slices, never without a timeout: an interrupt that sends no signal
            # (``_thread.interrupt_main``, as some front ends do) wakes no waiting lock, and is
            # only seen when the wait returns.
            while not work.done.wait(_REFRESH):
                if show_at is None:
                    continue
                if bar is None and time.perf_counter() >= show_at:
                    bar = _bar(run)
                if bar is not None and bar.n != run.iteration:
                    _update(bar, run)
        failure = next((work.failure for work in works if work.failure is not None), None)
        if bar is None and progress and failure is None:  # finished before the first look: show it done
            bar = _bar(run)
    except BaseException:
        if bar is not None:
            bar.close()
        raise
    if failure is not None:
        if bar is not None:
            bar.close()
        raise failure
    run.bar = bar  # the caller records the last step, then ``run.close()`` shows it and closes


def _bar(run: Run) -> Any:
    from tqdm.auto import tqdm  # a widget in notebooks, text elsewhere

    return tqdm(total=run.total, desc=run.what, unit="it", leave=True)


def _update(bar: Any, run: Run) -> None:
    bar.n = run.iteration
    bar.set_postfix_str(f"loss {run.loss:.6g}, max|grad| {run.grad:.2e}", refresh=False)
    bar.refresh()
