"""``mg.Ensemble``: different models trained side by side, each on its own context.

Seed 003's second case: several models that differ in everything (parameter trees, optimizers,
data, step counts, batch sizes) train at once, one per context, or several on one. One thread
dispatches every member's step before it waits on any, and reads each loss one step later,
while the devices work: each device runs its members' steps back to back.

A member's step is the trainer's compiled step on its one context, so a member ends with the
parameters it would have trained to alone (``mg.Trainer(..., contexts=[ctx])`` with the same
data, seed and batch size), bit for bit on CPU. It is gated: its update applies only while
the member is alive (every step so far finite), so a member whose step k was not finite keeps
the state of step k - 1 through the step already dispatched behind it.
"""

from __future__ import annotations

import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _clock, _contexts
from .._ledger import Event, execution_label, ledger
from .._numbers import whole
from .._spmd import sharding
from .._table import Table
from .._transfer import place
from . import _data
from ._checks import (
    MissingInputError,
    check_key,
    check_loss_fn,
    check_optimizer,
    check_params,
    check_scalar_loss,
    device_context,
)
from ._history import History
from ._loop import Bar, Interrupts
from ._step import copied, spmd_step

_WHERE = "Ensemble"


class Member:
    """One model of an ensemble: its loss, optimizer, parameters and data.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (``(scalar, aux)`` with ``has_aux``), the
        mean loss over the batch's rows (``loss_fn(params, batch, key)`` with a ``key``).
      optimizer: an optax ``GradientTransformation``.
      params: the initial parameters, a pytree of float arrays (copied onto the member's
        context: yours are never donated).
      data: arrays with rows along axis 0 (a tuple ``(X, y)``, a dict...: batched and shuffled
        by ``seed`` as ``mg.Trainer`` does), a function ``step -> batch`` or an iterable of
        batches.
      steps: the member's steps (else ``Ensemble.fit(steps=...)``'s).
      batch_size: rows per batch, for arrays (default min(rows, 256)).
      shuffle, seed: the order of array batches, per epoch (as ``mg.Trainer``'s).
      key: a PRNG key for a ``loss_fn(params, batch, key)``; step s gets ``fold_in(key, s)``.
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      name: what results and views call the member (default: its context, or
        ``context/i`` where several share one).
    """

    def __init__(
        self,
        loss_fn: Callable,
        optimizer: Any,
        params: Any,
        *,
        data: Any = None,
        steps: int | None = None,
        batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        key: Any = None,
        has_aux: bool = False,
        name: str | None = None,
    ):
        where = "Member" if name is None else f"Member {name!r}"
        self.loss_fn = check_loss_fn(loss_fn, where)
        self.optimizer = check_optimizer(optimizer, where)
        check_params(params, where)
        self.params = params
        if data is None:
            raise MissingInputError(
                f"{where}: no data; give the member its batches, e.g. Member(loss_fn, optimizer, params, "
                "data=(X, y)), a function step -> batch, or an iterable of batches"
            )
        self.seed = whole(seed, "seed", where, lo=0, example=0)
        self.steps = None if steps is None else whole(steps, "steps", where, lo=1, example=1000)
        src = _data.source(data, batch_size, shuffle, self.seed, 1, where)  # checked now, made per fit
        self.data, self.batch_size, self.shuffle = data, batch_size, bool(shuffle)
        self.key = check_key(key, where)
        self.has_aux = bool(has_aux)
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"{where}: name must be a non-empty str, got {type(name).__name__} {name!r}")
        self.name = name
        self._checked = isinstance(src, _data.ArraySource)
        if self._checked:  # the loss on a batch's shapes, before anything runs
            self._check_loss(src, where)

    def _check_loss(self, src: _data.ArraySource, where: str) -> None:
        rows = src.batch_size
        batch = jax.tree_util.tree_unflatten(
            src.treedef,
            [
                jax.ShapeDtypeStruct((rows, *np.shape(x)[1:]), jax.dtypes.canonicalize_dtype(x.dtype))
                for x in src.leaves
            ],
        )
        extra = () if self.key is None else (self.key,)
        try:
            out = jax.eval_shape(self.loss_fn, self.params, batch, *extra)
        except Exception as e:
            raise type(e)(
                f"{where}: loss_fn(params, batch) fails on a batch of {rows} rows of data: {e}"
            ) from e
        check_scalar_loss(out, self.has_aux, where)

    def __repr__(self) -> str:
        fn = getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)
        steps = "" if self.steps is None else f", steps={self.steps}"
        name = "" if self.name is None else f", name={self.name!r}"
        return f"Member({fn}{steps}{name})"


class MemberError(Exception):
    """Why a member stopped: its name and context, the step that failed, the error and its
    traceback (as text). The other members went on."""

    def __init__(self, member: str, context: str, step: int, error: BaseException, trace: str):
        self.member, self.context, self.step, self.error, self.traceback = member, context, step, error, trace
        super().__init__(
            f"member {member!r} on {context} failed at step {step}: {type(error).__name__}: {error}"
        )


class MemberResult(NamedTuple):
    """One member after a fit.

    Attributes:
      name, context: the member and where it trained.
      params, opt_state: after its last completed step (the ensemble's own arrays: a later fit
        donates them; copy with ``jax.device_get`` to keep them).
      step: its steps completed over every fit; ``history``: this fit's steps (a ``History``).
      error: a ``MemberError`` (context, step, traceback) if it failed, else None.
      stopped: why it stopped early (``"error"``, ``"nan"``, ``"stopped"`` by another's error
        under ``on_error="stop_all"``, ``"interrupted"``, ``"data ran out"``), else None.
    """

    name: str
    context: str
    params: Any
    opt_state: Any
    step: int
    history: History
    error: MemberError | None
    stopped: str | None


class EnsembleResult(Mapping, Table):
    """Member name -> ``MemberResult``; printed as a table."""

    headers = ("member", "context", "steps", "first loss", "last loss", "samples/s", "seconds", "status")

    def __init__(self, results: dict[str, MemberResult], title: str):
        self._results = results
        Table.__init__(self, [], title=title)

    def __getitem__(self, name: str) -> MemberResult:
        try:
            return self._results[name]
        except KeyError:
            raise KeyError(f"no member {name!r}; the members are {list(self._results)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._results)

    def __len__(self) -> int:
        return len(self._results)

    def _display_rows(self) -> list[tuple]:
        rows = []
        for r in self._results.values():
            h = r.history
            loss, rate = h.loss, h.samples_per_second
            warm = rate[1:] if len(rate) > 1 else rate
            status = "done" if r.stopped is None else r.stopped
            if r.error is not None:
                status = f"{r.stopped} at step {r.error.step}"
            rows.append(
                (
                    r.name,
                    r.context,
                    len(h),
                    f"{loss[0]:.6g}" if len(h) else "",
                    f"{loss[-1]:.6g}" if len(h) else "",
                    f"{np.nanmedian(warm):,.0f}" if np.isfinite(warm).any() else "n/a",
                    f"{h.wall:.3f}",
                    status,
                )
            )
        return rows


class _Runner:
    """A member's state in an ensemble: its context, compiled step, parameters, optimizer state,
    steps and data position."""

    def __init__(self, name: str, member: Member, ctx: _contexts.Context):
        self.name, self.member, self.ctx = name, member, ctx
        devices = (ctx.device,)
        rep = sharding(devices)
        self.params = copied(member.params, rep)
        self.opt = jax.jit(member.optimizer.init, out_shardings=rep)(self.params)
        self.program = spmd_step(member.loss_fn, member.optimizer, member.has_aux, devices, gated=True)
        self.alive_true = jax.device_put(jnp.asarray(True), rep)
        self.step = 0
        self.position: dict | None = None
        self.checked = member._checked  # a member of arrays was checked when made
        self.what = f"Ensemble.fit [{name}]"

    def source(self) -> Any:
        m = self.member
        src = _data.source(m.data, m.batch_size, m.shuffle, m.seed, 1, f"{_WHERE} member {self.name!r}")
        if isinstance(src, _data.ArraySource) and self.position is not None:
            src.seek(self.position)
        return src

    def check_loss(self, even: Any) -> None:
        """The loss function's output, from shapes only, before the first step compiles."""
        if self.checked:
            return
        m = self.member
        extra = () if m.key is None else (m.key,)
        where = f"{_WHERE} member {self.name!r} ({self.ctx.name})"
        try:
            out = jax.eval_shape(m.loss_fn, self.params, even, *extra)
        except Exception as e:
            raise type(e)(f"{where}: loss_fn(params, batch) failed on the first batch: {e}") from e
        check_scalar_loss(out, m.has_aux, where)
        self.checked = True


class _Fit:
    """One member's share of a fit in progress."""

    def __init__(self, runner: _Runner, total: int):
        self.runner, self.total = runner, total
        self.first = runner.step  # the member's step count when this fit began
        self.src = runner.source()
        self.done = 0  # steps dispatched this fit
        self.history = History((runner.ctx.name,))
        self.error: MemberError | None = None
        self.stopped: str | None = None
        self.alive = runner.alive_true
        self.last_end: float | None = None  # when its last read step ended (perf_counter)
        self.position: dict | None = None

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
        return {name: r.params for name, r in self._runners.items()}

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
        self, steps: int | None = None, *, on_error: str = "continue", progress: bool | None = None
    ) -> EnsembleResult:
        """Trains every member: its own ``steps`` if it has them, else ``steps``.

        Each round dispatches one step of every running member, then reads the losses of the
        round before (one step late): the devices never wait for Python to look at a loss.

        Args:
          steps: steps for members that do not say their own.
          on_error: ``"continue"`` (default): a member that raises, or whose loss or gradient is
            not finite, stops with its state of the step before (``res[name].error`` says
            where and why) and the others finish; ``"stop_all"``: everyone stops at the next
            step boundary.
          progress: None: a bar once the fit has run a second; True: at once; False: never.

        Returns an ``EnsembleResult`` (member name -> ``MemberResult``), also kept as
        ``ens.result``. Ctrl-C stops every member at a step boundary, keeps its state (and
        ``ens.result``) and raises KeyboardInterrupt; a later fit goes on from there.
        """
        where = f"{_WHERE}.fit"
        if steps is not None:
            steps = whole(steps, "steps", where, lo=1, example=1000, note="steps per member")
        if on_error not in ("continue", "stop_all"):
            raise ValueError(
                f"{where}: on_error={on_error!r}; use 'continue' (the other members finish) or "
                "'stop_all' (everyone stops at the next step boundary)"
            )
        totals = {}
        for name, r in self._runners.items():
            total = r.member.steps if r.member.steps is not None else steps
            if total is None:
                raise MissingInputError(
                    f"{where}: member {name!r} ({r.ctx.name}) has no steps; give mg.Member(..., steps=500) "
                    "or ens.fit(steps=1000)"
                )
            totals[name] = total
        fits = [_Fit(r, totals[name]) for name, r in self._runners.items()]
        self._fits += 1
        token = (id(self), self._fits)
        bar = Bar(where, sum(totals.values()), progress)
        interrupted = False
        try:
            with Interrupts() as stop:
                interrupted = self._loop(fits, on_error, bar, stop, token)
        finally:
            bar.close(sum(len(f.history) for f in fits), lambda: _postfix(fits))
            for f in fits:
                if isinstance(f.src, _data.ArraySource):
                    f.runner.position = f.position or f.runner.position
            self.result = self._result(fits, interrupted)
        failed = [f.error for f in fits if f.error is not None]
        if interrupted:
            raise KeyboardInterrupt(
                f"{where} stopped at a step boundary: every member keeps the state of its last "
                "completed step (ens.result, ens.params); fit again to go on"
            )
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

    def _loop(self, fits: list[_Fit], on_error: str, bar: Bar, stop: Interrupts, token: tuple) -> bool:
        """Rounds of one step per running member, each round's losses read in the next.
        Returns whether Ctrl-C stopped it."""
        pending: list[_Pending] = []
        label = execution_label()
        offset = time.time() - time.perf_counter()
        interrupted = halt = False
        while True:
            if stop.requested:
                interrupted = True
            running = [] if interrupted or halt else [f for f in fits if f.running]
            if not running and not pending:
                break
            dispatched = []
            for f in running:
                item = self._dispatch(f)
                if item is not None:
                    dispatched.append(item)
                elif on_error == "stop_all":
                    halt = True
            for item in pending:
                if not self._read(item, label, offset, token) and on_error == "stop_all":
                    halt = True
            pending = dispatched
            bar.tick(sum(len(f.history) for f in fits), lambda: _postfix(fits))
        for f in fits:
            if f.stopped is None and f.done < f.total:
                f.stopped = "interrupted" if interrupted else "stopped"
        return interrupted

    def _dispatch(self, f: _Fit) -> _Pending | None:
        """Places the member's next batch and dispatches its step; a member whose data or
        step raises stops here (None)."""
        r = f.runner
        step = r.step + 1
        try:
            try:
                batch = f.src.next(step)
            except StopIteration:
                f.stopped = "data ran out"
                return None
            leaves, treedef, n = _data.check_batch(batch, 1, f"{_WHERE} member {r.name!r}", "the batch")
            own = isinstance(f.src, _data.ArraySource)
            # one context: the batch goes to its device whole (a split event); batches mgkit
            # made are its own copies, the caller's are copied first (the step may keep them)
            placed = place(leaves, r.ctx, "split", {"rows": n, "of": n, "member": r.name}, private=own)
            even, rest = jax.tree_util.tree_unflatten(treedef, placed), None
            r.check_loss(even)
            key = None if r.member.key is None else jax.random.fold_in(r.member.key, step)
            t0 = time.perf_counter()
            out = r.program(r.params, r.opt, even, rest, key, f.alive)
        except Exception as e:  # noqa: BLE001 - the member stops; the others go on
            self._fail(f, step, e, "error")
            return None
        r.params, r.opt, f.alive = out.params, out.opt_state, out.ok
        r.step, f.done = step, f.done + 1
        timing = _clock.watch(r.ctx.device, out.loss, t0)
        position = dict(f.src.position) if own else None
        return _Pending(f, step, out.loss, out.ok, n, timing, position)

    def _read(self, item: _Pending, label: int | None, offset: float, token: tuple) -> bool:
        """Reads a dispatched step's loss, records its step event and history entry. False
        when the step failed (the member stops with the state of the step before)."""
        f, r = item.fit, item.fit.runner
        if f.error is not None and item.step >= f.error.step:
            return True  # dispatched behind the step that failed: it changed nothing
        try:
            loss = float(item.loss)  # NaN where the gated step applied no update
            ok = loss == loss
        except Exception as e:  # noqa: BLE001 - a failure on the device
            r.step = min(r.step, item.step - 1)
            self._fail(f, item.step, e, "error")
            return False
        item.timing.wait()
        start, end = item.timing.start, item.timing.ended or time.perf_counter()
        cadence = end - (f.last_end if f.last_end is not None else start)
        f.last_end = end
        f.history.append(item.step, loss if ok else float("nan"), cadence, (item.rows,))
        if item.position is not None:
            f.position = item.position
        info = {
            "what": r.what,
            "member": r.name,
            "ensemble": token,
            "iteration": item.step,
            "round": item.step - f.first,
            "of": f.first + f.total,
            "models": 1,
            "rows": item.rows,
            "loss": loss,
            "samples_per_second": item.rows / cadence if cadence > 0 else float("nan"),
            "final": item.step == f.first + f.total,
        }
        c = r.ctx
        seconds = max(end - start, 0.0)
        ledger().record(
            Event("step", c.name, c.name, c.short, c.short, 0, offset + start, seconds, label, info)
        )
        if not ok:
            r.step = item.step - 1  # the gated steps behind it changed nothing
            err = FloatingPointError(
                f"step {item.step}'s loss is {loss} (or a gradient is not finite); the member keeps "
                f"the state of step {item.step - 1}. Lower its learning rate or check its data"
            )
            self._fail(f, item.step, err, "nan", trace="")
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
                f.runner.params,
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
            e for e in ledger().records("step") if e.info is not None and e.info.get("ensemble") == token
        ]
        rows = list(dict.fromkeys(r.ctx.name for r in self._runners.values()))
        return Schedule.of_ensemble(events, steps, rows, widget=widget)


def _postfix(fits: list[_Fit]) -> str:
    parts = []
    for f in fits[:4]:
        loss = f.history.loss[-1] if len(f.history) else float("nan")
        parts.append(f"{f.runner.name} {loss:.4g}")
    return " | ".join(parts) + (" ..." if len(fits) > 4 else "")
