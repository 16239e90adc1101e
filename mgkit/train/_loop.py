"""The fit skeleton every trainer shares (``Trainer``, ``Ensemble``, ``Pipeline``).

Each trainer keeps only what is its own (the SPMD step, the round of members, the pipeline's
schedule) and hands the rest to this module:

==========================  ===============================================================
what                        here
==========================  ===============================================================
why a fit stopped           ``Stop`` (the strings ``History.stopped`` holds)
the steps, one after one    ``run_steps``: take a batch, dispatch, read the loss at once or
                            one step late (``reads_late``), Ctrl-C and data running out
Ctrl-C, preemption          ``_stops.Interrupts``: noted, acted on at the next step boundary
a non-finite loss           ``check_on_nan`` and ``not_finite`` (the error and its message)
data running out            ``DataRanOut``, warned by ``conclude`` (no batch at all too)
skipped updates             ``StepsSkipped``, warned by ``warn_skipped`` at a fit's end
step events                 ``StepEvents``: one ``Kind.STEP`` event per context per step
the progress bar            ``Bar``
after the fit               ``conclude``: KeyboardInterrupt after Ctrl-C, the data warning
all of it for one fit       ``Fit``: its ``History``, events, bar and Ctrl-C; ``steps`` runs
                            them, ``read`` keeps a step's loss, ``end`` concludes
the batches, placed ahead   ``_feed.Feed`` (arrays go on across fits)
checkpoints and resume      ``_checkpoint.Checkpointing``
==========================  ===============================================================
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._beat import beat
from .._contexts import Context
from .._ledger import Kind, Layout, execution_label, ledger
from .._oom import StepFacts, raise_if_out_of_memory
from .._stops import INTERRUPTED, PREEMPTED, Interrupts
from ._history import History


class DataRanOut(UserWarning):
    """An iterable of batches ended before the steps asked for, or gave no batch at all."""


class StepsSkipped(UserWarning):
    """Under ``on_nan="skip"``, steps whose update was skipped (a loss or gradient not finite)."""


class Stop:
    """Why a fit ended before its steps (``History.stopped``; None: it ran them all)."""

    INTERRUPTED = INTERRUPTED  # Ctrl-C (the notebook's Stop button), at a step boundary
    PREEMPTED = PREEMPTED  # SIGTERM to a cluster's rank, at a step boundary every rank agreed on
    DATA = "data ran out"  # the iterable of batches ended
    NAN = "nan"  # a step's loss or gradient was not finite, under on_nan="raise"


ON_NAN = ("raise", "skip")
UNGUARDED = "apply"  # a trainer's step without the guard: every update applied, as written by hand


def check_on_nan(on_nan: Any, where: str, unguarded: bool = False) -> str:
    """``on_nan`` as given, where it is one of ``ON_NAN`` (or, with ``unguarded``, ``"apply"``)."""
    modes = (*ON_NAN, UNGUARDED) if unguarded else ON_NAN
    if on_nan not in modes:
        also = " or 'apply' (no guard in the step: every update applied; stop at a non-finite loss)"
        raise ValueError(
            f"{where}: on_nan={on_nan!r}; use 'raise' (stop at a non-finite loss, its update not applied), "
            f"'skip' (skip such updates and go on){also if unguarded else ''}"
        )
    return on_nan


def not_finite(where: str, step: int, loss: float, kept: str, fix: str) -> FloatingPointError:
    """The error of a step whose loss or gradient is not finite (its update was not applied);
    ``kept``: whose state is kept, ``fix``: how to skip such steps instead."""
    if kept == UNGUARDED:
        return FloatingPointError(
            f"{where}: step {step}'s loss is {loss}: the fit stopped there, and under on_nan='apply' "
            "its update was applied (the step has no guard), so params and opt_state hold it and are "
            "not finite. Lower the learning rate, check the batch's data, or use on_nan='raise' (the "
            "default) to keep the last finite state"
        )
    return FloatingPointError(
        f"{where}: step {step}'s loss is {loss} (or a gradient is not finite): its update was not "
        f"applied, and {kept}; params and opt_state are the last finite ones (from before that step). "
        f"Lower the learning rate, check the batch's data, or {fix}"
    )


def reads_late(devices: Sequence[Any]) -> bool:
    """Whether a step's loss is read one step late (after the next step is dispatched, so the
    devices never wait for Python): yes, except for a step over several CPU devices, read at
    once, since XLA's CPU runtime can deadlock with two collective programs in flight."""
    return len(set(devices)) == 1 or devices[0].platform != "cpu"


def run_steps(
    take: Callable[[], Any],
    dispatch: Callable[[Any], Any],
    read: Callable[[Any], None],
    total: int | None,
    stop: Interrupts,
    late: bool,
) -> str | None:
    """Runs up to ``total`` steps (None: until ``take`` ends): ``take()`` the next batch (it
    raises StopIteration when the data ends), ``dispatch(batch)`` a step, ``read(dispatched)``
    its loss, at once or, with ``late``, after the next step's dispatch. Stops at a step boundary
    on Ctrl-C or preemption (in a cluster's ranks, at the boundary they all agree on). Returns
    why it stopped early (a ``Stop``), or None; ``read``'s errors propagate, the steps
    dispatched before them read first."""
    done, pending, stopped = 0, None, None
    while total is None or done < total:
        if stop.requested is not None and stop.agreed(done):
            stopped = stop.requested
            break
        try:
            batch = take()
        except StopIteration:
            stopped = Stop.DATA
            break
        except KeyboardInterrupt:
            stopped = Stop.INTERRUPTED
            break
        current = dispatch(batch)
        done += 1
        if late:
            current, pending = pending, current
        if current is not None:
            read(current)
    if pending is not None:
        read(pending)
    return stopped


def conclude(
    where: str, stopped: str | None, done: int, total: int | None, kept: str, stacklevel: int = 3
) -> None:
    """After a fit of ``done`` steps: KeyboardInterrupt where Ctrl-C stopped it, a ``DataRanOut``
    warning where the data ended before ``total`` steps. ``kept``: whose state is kept, e.g.
    ``"step 12 (params, opt_state and step are that step's)"``; ``stacklevel``: the warning's,
    from this function (3: the caller's caller)."""
    if stopped == Stop.INTERRUPTED:
        raise KeyboardInterrupt(
            f"{where} stopped at {kept}, a step boundary, after {done} step(s) this fit; fit again to go on"
        )
    if stopped == Stop.DATA and done == 0:
        warnings.warn(
            f"{where}: no batch came from the data, so nothing trained; it keeps the state of {kept}. "
            "The data is empty, or it is a generator (an iterator) that an earlier fit used up: "
            "make a new one for each fit, or give a list, arrays or a function step -> batch",
            DataRanOut,
            stacklevel=stacklevel,
        )
    elif stopped == Stop.DATA and total is not None:
        warnings.warn(
            f"{where}: the data ended after {done} of {total} step(s); it keeps the state of {kept}. "
            "Give more batches, or fewer steps",
            DataRanOut,
            stacklevel=stacklevel,
        )


def warn_skipped(where: str, history: History, stacklevel: int = 3) -> None:
    """A ``StepsSkipped`` warning where steps of the fit were skipped (``history.skipped``, but
    for those the fp16 loss scale skipped: ``history.overflowed``)."""
    skipped = history.skipped - history.overflowed
    if skipped:
        every = "every update" if skipped == len(history) else "those updates"
        warnings.warn(
            f"{where}: {skipped} of {len(history)} step(s) had a loss or gradient that is not finite "
            f"(on_nan='skip'): {every} skipped, the parameters kept as they were (NaN in "
            "history.loss). Lower the learning rate or check the data",
            StepsSkipped,
            stacklevel=stacklevel,
        )


class StepEvents:
    """A fit's step events: at each step one ``Kind.STEP`` event per context, with its rows,
    the step's loss and samples per second. The events of a step are one ``Layout`` call, the
    layout made once per rows per context (recording costs the same on any number of contexts).

    Args:
      what: what ran (``"Trainer.fit"``), the events' ``info["what"]``.
      contexts: the contexts the step ran on.
      total: the steps asked for (``info["of"]``), or None.
      info: more facts every event of this fit carries (a member's name).
    """

    def __init__(
        self, what: str, contexts: Sequence[Context], total: int | None, info: Mapping[str, Any] | None = None
    ):
        self.contexts = tuple(contexts)
        self.facts: StepFacts | None = None  # what the trainer knows, for an out-of-memory report
        nan = float("nan")
        self._info = {
            "what": what,
            "of": total,
            "models": 1,
            "grad": nan,
            "final": False,
            "steps": 1,
            **(info or {}),
        }
        self._layouts: dict[tuple[int, ...], Layout] = {}

    def record(
        self, start: float, seconds: float, label: int | None, rows: tuple[int, ...], facts: Mapping[str, Any]
    ) -> None:
        """Records one step that began at ``start`` (``time.time()``) and took ``seconds``, with
        ``rows`` per context and ``facts`` (``iteration``, ``loss``...) on each event
        (samples per second: each context's rows over ``seconds``, unless ``facts`` says)."""
        layout = self._layouts.get(rows)
        if layout is None:
            layout = Layout(
                [
                    ((Kind.STEP, c.name, c.name, c.short, c.short, 0), 1.0, {**self._info, "rows": r})
                    for c, r in zip(self.contexts, rows, strict=True)
                ]
            )
            if len(self._layouts) < 64:
                self._layouts[rows] = layout
        extra = tuple(
            {"samples_per_second": r / seconds if seconds > 0 else float("nan"), **facts} for r in rows
        )
        ledger().record(layout.call(start, seconds, label, extra))


class Bar:
    """A fit's progress bar: after a second of work (``progress`` None), at once (True) or
    never (False); updated at most ten times a second. ``postfix()`` says what the bar shows
    beside the count (made only when the bar is drawn)."""

    def __init__(self, what: str, total: int | None, progress: bool | None, start: float | None = None):
        self.what, self.total, self.bar = what, total, None
        start = time.perf_counter() if start is None else start
        self.show_at = None if progress is False else start + (0.0 if progress else 1.0)
        self._next = 0.0

    def tick(self, n: int, postfix: Callable[[], str]) -> None:
        if self.show_at is None:
            return
        now = time.perf_counter()
        if now < self._next or now < self.show_at:
            return
        self._next = now + 0.1
        if self.bar is None:
            from tqdm.auto import tqdm  # a widget in notebooks, text elsewhere

            self.bar = tqdm(total=self.total, desc=self.what, unit="step", leave=True)
        self.bar.n = n
        self.bar.set_postfix_str(postfix(), refresh=False)
        self.bar.refresh()

    def close(self, n: int, postfix: Callable[[], str]) -> None:
        if self.bar is not None:
            self.bar.n = n
            self.bar.set_postfix_str(postfix(), refresh=False)
            self.bar.close()
            self.bar = None


FIT_FIXES = (
    'shard="fsdp" (split the parameters and optimizer state over the contexts)',
    "accumulate=k (each step in k smaller micro-batches, the same update)",
    "a smaller batch_size",
)


class Fit:
    """One fit in progress: its ``History``, step events, progress bar and Ctrl-C.

    Args:
      where: what fits (``"Trainer.fit"``), in events, the bar and messages.
      contexts: the contexts each step runs on (a history column and step events each).
      total: the steps asked for, or None (until the data ends).
      progress: the bar's ``progress`` (None: after a second; True: at once; False: never).
      info: more facts every step event carries (a member's name).
    """

    def __init__(
        self,
        where: str,
        contexts: Sequence[Context],
        total: int | None,
        progress: bool | None,
        info: Mapping[str, Any] | None = None,
    ):
        self.where, self.total = where, total
        self.contexts = tuple(contexts)
        self.facts: StepFacts | None = None  # what the trainer knows, for an out-of-memory report
        self.history = History(tuple(c.name for c in contexts))
        self.events = StepEvents(where, contexts, total, info)
        self.bar = Bar(where, total, progress)
        self.stop = Interrupts()
        self.label = execution_label()
        self.read_at = time.perf_counter()  # when the last step's loss was read (or the steps began)

    def steps(
        self, take: Callable[[], Any], dispatch: Callable[[Any], Any], read: Callable, late: bool
    ) -> None:
        """``run_steps`` with Ctrl-C noted; the history says why the steps stopped early (a
        non-finite loss raises FloatingPointError: ``Stop.NAN``); the bar is closed."""
        history = self.history
        try:
            with self.stop:
                history.stopped = run_steps(take, dispatch, read, self.total, self.stop, late)
        except FloatingPointError:
            history.stopped = Stop.NAN
            raise
        except Exception as e:
            on = [(c.name, c.device) for c in self.contexts]
            raise_if_out_of_memory(e, self.where, on, FIT_FIXES, self.facts)
            raise
        finally:
            self.bar.close(len(history), lambda: f"loss {history.loss[-1]:.6g}" if len(history) else "")

    def read(self, step: int, loss: float, ok: bool, rows: tuple[int, ...], overflow: bool = False) -> float:
        """Keeps a step's loss just read (NaN in the history where its update was not applied;
        ``overflow``: skipped by the fp16 loss scale): its history entry, step events, the
        watchdog's beat and the bar. Returns the seconds since the last read (the step's time)."""
        now = time.perf_counter()
        seconds, self.read_at = now - self.read_at, now
        self.history.append(step, loss if ok else float("nan"), seconds, rows, overflow)
        self.events.record(
            time.time() - seconds, seconds, self.label, rows, {"iteration": step, "loss": loss}
        )
        beat(step)
        self.bar.tick(len(self.history), lambda: f"loss {loss:.6g}")
        return seconds

    def end(self, kept: str, preempted: Callable[[str, int | None], Exception] | None = None) -> History:
        """``conclude`` for this fit and the ``StepsSkipped`` warning; returns its history. After
        a preemption, raises ``preempted(where, rank)`` (the trainer's: it saves its state)."""
        if self.history.stopped == Stop.PREEMPTED and preempted is not None:
            raise preempted(self.where, self.stop.by)
        conclude(self.where, self.history.stopped, len(self.history), self.total, kept, stacklevel=4)
        warn_skipped(self.where, self.history, stacklevel=4)
        return self.history
