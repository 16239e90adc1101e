"""``mg.Ensemble``: different models trained side by side, each on its own context.

Several models that differ in everything (parameter trees, optimizers, data, step counts,
batch sizes) train at once, one per context, or several on one. One thread
dispatches every member's step before it waits on any, and reads each loss one step later,
while the devices work: each device runs its members' steps back to back.

A member's step is the trainer's compiled step on its one context, so a member ends with the
parameters it would have trained to alone (``mg.Trainer(..., contexts=[ctx])`` with the same
data, seed and batch size), bit for bit on CPU. It is gated: its update applies only while
the member is alive (every step so far finite), so a member whose step k was not finite keeps
the state of step k - 1 through the step already dispatched behind it (under ``on_nan="skip"``
it stays alive: only that step's update is left out).

The members' models and results are in ``_member``; the fit's skeleton (Ctrl-C, step events,
stop reasons, the bar) in ``_loop``.
"""

from __future__ import annotations

import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .. import _clock, _contexts
from .._ledger import Kind, execution_label, ledger
from .._numbers import whole
from .._spmd import sharding
from .._stops import preempted_error
from .._transfer import place
from . import _data
from ._checkpoint import Checkpointing, Checkpoints
from ._checks import MissingInputError, check_loss_on, device_context
from ._feed import Feed
from ._history import History
from ._loop import Bar, Interrupts, StepEvents, Stop, conclude, not_finite, run_steps, warn_skipped
from ._member import EnsembleResult, Member, MemberError, MemberResult
from ._step import copied, spmd_step

_WHERE = "Ensemble"


class _Runner(Checkpointing):
    """A member's state in an ensemble: its context, compiled step, parameters, optimizer state,
    steps, data position and checkpoints."""

    def __init__(self, name: str, member: Member, ctx: _contexts.Context):
        self.name, self.member, self.ctx = name, member, ctx
        devices = (ctx.device,)
        rep = sharding(devices)
        self.params = copied(member.model.arrays, rep)  # the model's arrays
        self.opt = jax.jit(member.optimizer.init, out_shardings=rep)(self.params)
        self.loss = member.model.bind(member.loss_fn)  # loss_fn of the model's arrays
        self.program = spmd_step(self.loss, member.optimizer, member.has_aux, devices, gated=True)
        self.alive_true = jax.device_put(jnp.asarray(True), rep)
        self._step = 0
        self._position: dict | None = None  # where the last fit of arrays stopped
        self.checked = member._checked  # a member of arrays was checked when made
        self.what = f"Ensemble.fit [{name}]"
        self.checkpoints = None
        if member.checkpoint is not None:
            where = f"Member {name!r}"
            self.checkpoints = Checkpoints(
                member.checkpoint, every=member.every, keep=member.keep, where=where
            )

    @property
    def step(self) -> int:
        """Steps completed, over every fit."""
        return self._step

    def _what(self) -> tuple[str, str]:
        return "member", "mg.Member(..., checkpoint='ckpt/')"

    def _state(self, position: dict | None) -> dict:
        key = self.member.key
        return {
            "params": self.params,
            "opt_state": self.opt,
            "step": self._step,
            "key": None if key is None else key,
            "data": {} if position is None else dict(position),
        }

    def _restore(self, back: dict) -> None:
        self.params, self.opt, self._step = back["params"], back["opt_state"], int(back["step"])
        self._position = back["data"] or None

    def feed(self, total: int) -> Feed:
        """This fit's batches: placed on the member's context (a split event; batches mgkit made
        are its own copies, the caller's are copied first, since the step may keep them)."""
        m = self.member
        where = f"{_WHERE} member {self.name!r}"
        src = _data.source(m.data, m.batch_size, m.shuffle, m.seed, 1, where)

        def put(batch: Any, own: bool) -> tuple[Any, int]:
            leaves, treedef, n = _data.check_batch(batch, where, "the batch")
            placed = place(
                leaves, self.ctx, Kind.SPLIT, {"rows": n, "of": n, "member": self.name}, private=own
            )
            return jax.tree_util.tree_unflatten(treedef, placed), n

        return Feed(src, total, self._step + 1, put, m.prefetch, self._position, where)

    def check_loss(self, even: Any) -> None:
        """The loss function's output, from shapes only, before the first step compiles."""
        if not self.checked:
            m = self.member
            where = f"{_WHERE} member {self.name!r} ({self.ctx.name})"
            check_loss_on(self.loss, self.params, even, m.key, m.has_aux, where, "failed on the first batch")
            self.checked = True


class _Fit:
    """One member's share of a fit in progress."""

    def __init__(self, runner: _Runner, total: int, token: tuple):
        self.runner, self.total = runner, total
        self.first = runner.step  # the member's step count when this fit began
        self.feed = runner.feed(total)
        info = {"member": runner.name, "ensemble": token}
        self.events = StepEvents(runner.what, [runner.ctx], self.first + total, info)
        self.done = 0  # steps dispatched this fit
        self.history = History((runner.ctx.name,))
        self.error: MemberError | None = None
        self.stopped: str | None = None
        self.alive = runner.alive_true
        self.last_end: float | None = None  # when its last read step ended (perf_counter)

    @property
    def running(self) -> bool:
        return self.stopped is None and self.done < self.total


class _Pending(NamedTuple):
    fit: _Fit
    step: int
    loss: jax.Array
    ok: jax.Array
    rows: int
    timing: _clock.Timing
    position: dict | None


class Ensemble:
    """Different models trained side by side, one per context (or several on one).

    >>> import mgkit as mg, optax, jax.numpy as jnp, numpy as np
    >>> _ = mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    >>> X = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    >>> y = X @ np.array([1.0, -2.0, 0.5], np.float32)
    >>> def mse(p, b):
    ...     return jnp.mean((b[0] @ p["w"] - b[1]) ** 2)
    >>> def mae(p, b):
    ...     return jnp.mean(jnp.abs(b[0] @ p["w"] + p["c"] - b[1]))
    >>> ens = mg.Ensemble({
    ...     "dev0": mg.Member(mse, optax.sgd(0.1), {"w": jnp.zeros(3)}, data=(X, y), batch_size=16),
    ...     "dev1": mg.Member(mae, optax.adam(0.05), {"w": jnp.zeros(3), "c": jnp.zeros(())},
    ...                       data=(X, y), steps=100),
    ... })
    >>> res = ens.fit(steps=200, progress=False)
    >>> res["dev0"].step, res["dev1"].step, mg.where(res["dev1"].params)
    (200, 100, 'dev1')

    Args:
      members: context -> ``mg.Member``, or a list of members to share that context.
    """

    def __init__(self, members: Mapping[str, Member | Sequence[Member]]):
        if not isinstance(members, Mapping):
            raise TypeError(
                f"{_WHERE}: members must be a dict context -> mg.Member (or a list of members sharing "
                f"that context), e.g. {{'dev0': mg.Member(...), 'dev1': mg.Member(...)}}; got "
                f"{type(members).__name__} {members!r:.80}"
            )
        if not members:
            cmap = _contexts.context_map()
            raise ValueError(
                f"{_WHERE}: no members; give at least one, e.g. mg.Ensemble({{{cmap.names[0]!r}: "
                "mg.Member(loss_fn, optax.adam(1e-3), params, data=(X, y))})"
            )
        placed: list[tuple[str, Member, _contexts.Context]] = []
        for ctx_name, value in members.items():
            ctx = device_context(ctx_name, _WHERE)
            group = list(value) if isinstance(value, list | tuple) else [value]
            if not group:
                raise ValueError(f"{_WHERE}: context {ctx_name!r} has an empty list of members; drop it")
            for i, member in enumerate(group):
                if not isinstance(member, Member):
                    at = (
                        ctx_name
                        if len(group) == 1 and not isinstance(value, list | tuple)
                        else f"{ctx_name}[{i}]"
                    )
                    raise TypeError(
                        f"{_WHERE}: members[{at!r}] is a {type(member).__name__} ({member!r:.60}); each "
                        "member is an mg.Member(loss_fn, optimizer, params, data=...)"
                    )
                default = ctx.name if len(group) == 1 else f"{ctx.name}/{i}"
                placed.append((member.name or default, member, ctx))
        names = [name for name, _, _ in placed]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"{_WHERE}: two members are named {repeated[0]!r}; give each a distinct name "
                "(mg.Member(..., name='mlp'))"
            )
        self._runners = {name: _Runner(name, member, ctx) for name, member, ctx in placed}
        self.result: EnsembleResult | None = None
        self._fits = 0

    # -- state ---------------------------------------------------------------------------

    @property
    def members(self) -> tuple[str, ...]:
        """The members' names, in order."""
        return tuple(self._runners)

    @property
    def contexts(self) -> dict[str, str]:
        """Member name -> its context."""
        return {name: r.ctx.name for name, r in self._runners.items()}

    @property
    def params(self) -> dict[str, Any]:
        """Member name -> its parameters after its last completed step."""
        return {name: r.member.model.join(r.params) for name, r in self._runners.items()}

    @property
    def opt_state(self) -> dict[str, Any]:
        return {name: r.opt for name, r in self._runners.items()}

    @property
    def step(self) -> dict[str, int]:
        """Member name -> steps completed over every fit."""
        return {name: r.step for name, r in self._runners.items()}

    def __repr__(self) -> str:
        parts = ", ".join(f"{name} on {r.ctx.name} (step {r.step})" for name, r in self._runners.items())
        return f"Ensemble({len(self._runners)} member(s): {parts})"

    # -- fitting -------------------------------------------------------------------------

    def fit(
        self,
        steps: int | None = None,
        *,
        on_error: str = "continue",
        resume: bool = False,
        progress: bool | None = None,
    ) -> EnsembleResult:
        """Trains every member: its own ``steps`` if it has them, else ``steps``.

        Each round dispatches one step of every running member, then reads the losses of the
        round before (one step late): the devices never wait for Python to look at a loss.

        Args:
          steps: steps for members that do not say their own.
          on_error: ``"continue"`` (default): a member that raises, or whose loss or gradient is
            not finite (under its ``on_nan="raise"``), stops with the state of its last applied
            update (``res[name].error`` says where and why) and the others finish;
            ``"stop_all"``: everyone stops at the next step boundary.
          resume: first restore each member with a checkpoint folder (``Member(checkpoint=)``)
            from its newest checkpoint; its steps are then those of its whole run.
          progress: None: a bar once the fit has run a second; True: at once; False: never.

        Returns an ``EnsembleResult`` (member name -> ``MemberResult``), also kept as
        ``ens.result``. A member whose iterable of batches ends early stops there, with a
        ``DataRanOut`` warning, as a trainer does. Ctrl-C stops every member at a step boundary,
        keeps its state (and ``ens.result``) and raises KeyboardInterrupt; a later fit goes on
        from there.
        """
        where = f"{_WHERE}.fit"
        if steps is not None:
            steps = whole(steps, "steps", where, lo=1, example=1000, note="steps per member")
        if on_error not in ("continue", "stop_all"):
            raise ValueError(
                f"{where}: on_error={on_error!r}; use 'continue' (the other members finish) or "
                "'stop_all' (everyone stops at the next step boundary)"
            )
        totals = self._totals(steps, resume, where)
        self._fits += 1
        token = (id(self), self._fits)
        fits: list[_Fit] = []
        bar = Bar(where, sum(totals.values()), progress)
        stopped: str | None = None
        try:
            fits += [_Fit(r, totals[name], token) for name, r in self._runners.items()]
            with Interrupts() as stop:
                stopped = self._loop(fits, on_error, bar, stop)
        finally:
            bar.close(sum(len(f.history) for f in fits), lambda: _postfix(fits))
            for f in fits:
                f.runner._fit_ended(f.feed)
            self.result = self._result(fits, stopped is not None)
        rounds = max((len(f.history) for f in fits), default=0)
        if stopped == Stop.PREEMPTED:
            saved = []
            for r in self._runners.values():
                if r.checkpoints is not None:
                    r.save()
                    saved.append(str(r.checkpoints.directory))
            raise preempted_error(where, stop.by, rounds, ", ".join(saved) or None, "ensemble")
        kept = "each member's last completed step (ens.result, ens.params)"
        conclude(where, stopped, rounds, None, kept)
        for f in fits:
            if f.stopped == Stop.DATA:
                name = f.runner.name
                conclude(
                    f"{where}: member {name!r}", Stop.DATA, len(f.history), f.total, f"step {f.runner.step}"
                )
            if f.runner.member.on_nan == "skip":
                warn_skipped(f"{where}: member {f.runner.name!r}", f.history)
        failed = [f.error for f in fits if f.error is not None]
        if failed:
            rest = (
                "everyone stopped (on_error='stop_all')" if on_error == "stop_all" else "the others went on"
            )
            warnings.warn(
                f"{where}: {'; '.join(str(e) for e in failed)}. {rest}; see res[name].error",
                RuntimeWarning,
                stacklevel=2,
            )
        return self.result

    def _totals(self, steps: int | None, resume: bool, where: str) -> dict[str, int]:
        """Each member's steps this fit (with ``resume``, after restoring its newest checkpoint:
        the steps of its run left)."""
        if resume and not any(r.checkpoints is not None for r in self._runners.values()):
            raise TypeError(
                f"{where}: resume=True restores each member from its checkpoint folder, and no member has "
                "one; make them with mg.Member(..., checkpoint='ckpt/member/')"
            )
        totals = {}
        for name, r in self._runners.items():
            total = r.member.steps if r.member.steps is not None else steps
            if total is None:
                raise MissingInputError(
                    f"{where}: member {name!r} ({r.ctx.name}) has no steps; give mg.Member(..., steps=500) "
                    "or ens.fit(steps=1000)"
                )
            r._begin(resume and r.checkpoints is not None, f"{where}: member {name!r}")
            totals[name] = max(total - r.step, 0) if resume else total
        return totals

    def _loop(self, fits: list[_Fit], on_error: str, bar: Bar, stop: Interrupts) -> str | None:
        """Rounds of one step per running member (``run_steps``, a round a step), each round's
        losses read in the next. Returns whether Ctrl-C (or a preemption) stopped it: the
        ``Stop``, or None."""
        label = execution_label()
        offset = time.time() - time.perf_counter()
        halt = False

        def take() -> list[_Fit]:
            running = [] if halt else [f for f in fits if f.running]
            if not running:
                raise StopIteration
            return running

        def dispatch(running: list[_Fit]) -> list[_Pending]:
            nonlocal halt
            items = [self._dispatch(f, stop) for f in running]
            halt = halt or (on_error == "stop_all" and None in items)
            return [item for item in items if item is not None]

        def read(items: list[_Pending]) -> None:
            nonlocal halt
            for item in items:
                if not self._read(item, label, offset) and on_error == "stop_all":
                    halt = True
            bar.tick(sum(len(f.history) for f in fits), lambda: _postfix(fits))

        stopped = run_steps(take, dispatch, read, None, stop, late=True)
        interrupted = stopped in (Stop.INTERRUPTED, Stop.PREEMPTED)
        for f in fits:
            if f.stopped is None and f.done < f.total:
                f.stopped = stopped if interrupted else "stopped"
        return stopped if interrupted else None

    def _dispatch(self, f: _Fit, stop: Interrupts) -> _Pending | None:
        """Takes the member's next batch (placed by its feed) and dispatches its step; a member
        whose data or step raises stops here (None)."""
        r = f.runner
        step = r.step + 1
        try:
            try:
                (even, n), position = f.feed.take(stop)
            except StopIteration:
                f.stopped = Stop.DATA
                return None
            except KeyboardInterrupt:
                return None  # Ctrl-C while the loader worked: the loop stops at this boundary
            r.check_loss(even)
            key = None if r.member.key is None else jax.random.fold_in(r.member.key, step)
            t0 = time.perf_counter()
            out = r.program(r.params, r.opt, even, None, key, f.alive)
        except Exception as e:  # noqa: BLE001 - the member stops; the others go on
            self._fail(f, step, e, "error")
            return None
        r.params, r.opt = out.params, out.opt_state
        if r.member.on_nan == "raise":  # the next step applies only while every step so far did
            f.alive = out.ok
        r._step, f.done = step, f.done + 1
        r._save_due(position)
        timing = _clock.watch(r.ctx.device, out.loss, t0)
        return _Pending(f, step, out.loss, out.ok, n, timing, position)

    def _read(self, item: _Pending, label: int | None, offset: float) -> bool:
        """Reads a dispatched step's loss, records its step event and history entry. False
        when the step failed (the member stops: with the state of the step before where the
        step raised; a non-finite step under ``on_nan="raise"`` counts, its update not applied)."""
        f, r = item.fit, item.fit.runner
        if f.error is not None and item.step >= f.error.step:
            return True  # dispatched behind the step that failed: it changed nothing
        try:
            loss = float(item.loss)  # NaN where the gated step applied no update
            ok = loss == loss
        except Exception as e:  # noqa: BLE001 - a failure on the device
            r._step = min(r.step, item.step - 1)
            self._fail(f, item.step, e, "error")
            return False
        item.timing.wait()
        start, end = item.timing.start, item.timing.ended or time.perf_counter()
        cadence = end - (f.last_end if f.last_end is not None else start)
        f.last_end = end
        f.history.append(item.step, loss if ok else float("nan"), cadence, (item.rows,))
        f.feed.after = item.position
        facts = {
            "iteration": item.step,
            "round": item.step - f.first,
            "loss": loss,
            "samples_per_second": item.rows / cadence if cadence > 0 else float("nan"),
            "final": item.step == f.first + f.total,
        }
        f.events.record(offset + start, max(end - start, 0.0), label, (item.rows,), facts)
        if not ok and r.member.on_nan == "raise":
            r._step = item.step  # it counts, as a trainer's does; the gated steps behind it changed nothing
            kept = f"the member stopped at step {item.step}"
            err = not_finite(f"member {r.name!r}", item.step, loss, kept, "give Member(..., on_nan='skip')")
            self._fail(f, item.step, err, Stop.NAN, trace="")
            return False
        return True

    def _fail(self, f: _Fit, step: int, error: BaseException, why: str, trace: str | None = None) -> None:
        r = f.runner
        if trace is None:
            trace = "".join(traceback.format_exception(error))
        f.error = MemberError(r.name, r.ctx.name, step, error, trace)
        f.stopped = why

    def _result(self, fits: list[_Fit], interrupted: bool) -> EnsembleResult:
        results = {
            f.runner.name: MemberResult(
                f.runner.name,
                f.runner.ctx.name,
                f.runner.member.model.join(f.runner.params),
                f.runner.opt,
                f.runner.step,
                f.history,
                f.error,
                f.stopped,
            )
            for f in fits
        }
        failed = sum(f.error is not None for f in fits)
        note = "; interrupted" if interrupted else f"; {failed} failed" if failed else ""
        return EnsembleResult(results, f"mgkit ensemble: {len(fits)} member(s){note}")

    def save(self) -> None:
        """Saves a checkpoint of every member with a checkpoint folder now, and waits for them."""
        for r in self._runners.values():
            if r.checkpoints is not None:
                r.save()

    # -- the picture ---------------------------------------------------------------------

    def schedule(self, steps: int = 10, widget: bool | None = None) -> Any:
        """The last fit's timeline: a row per context, a block per member step, from the
        ledger's step events: the last ``steps`` rounds in which every member ran (a round is
        one step of each). An inline widget in a notebook, text elsewhere; ``.save_png(path)``
        for reports."""
        from ..views import Schedule  # a view: loaded when drawn

        steps = whole(steps, "steps", f"{_WHERE}.schedule", lo=1, example=10, note="steps per member shown")
        token = (id(self), self._fits)
        events = [
            e for e in ledger().records(Kind.STEP) if e.info is not None and e.info.get("ensemble") == token
        ]
        rows = list(dict.fromkeys(r.ctx.name for r in self._runners.values()))
        return Schedule.of_ensemble(events, steps, rows, widget=widget)


def _postfix(fits: list[_Fit]) -> str:
    parts = []
    for f in fits[:4]:
        loss = f.history.loss[-1] if len(f.history) else float("nan")
        parts.append(f"{f.runner.name} {loss:.4g}")
    return " | ".join(parts) + (" ..." if len(fits) > 4 else "")
