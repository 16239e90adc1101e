"""``mg.Pipeline``: one model split layer-wise across contexts, trained with microbatches.

The batch is cut into M microbatches; each goes forward through the S stages, each stage on
its own context with its own function and parameters, the activations moved to the next
stage's context; then each goes backward, the gradients moved back. The order of those calls
is a schedule, a value (``_pipeline_schedule``): GPipe (every microbatch forward, then every
one backward) or 1F1B (each stage alternating a forward and a backward once the pipeline is
full, keeping at most S microbatches' activations). One thread dispatches every call and every
move in that order without waiting, so while stage 1 computes microbatch 0, stage 0 computes
microbatch 1: the devices overlap except in the pipeline's bubble.

Every hop between neighbouring stages is ``jax.device_put`` under mgkit's placement and so
in the ledger: 2 * M * (S - 1) ``transfer`` events a step (activations forward, gradients
back), with their bytes. Each stage's forward, backward and update is timed on its device
(``_clock``) and recorded as a ``forward``, ``backward`` or ``update`` event, from which
``Pipeline.schedule()`` draws the step.

The forward of a stage keeps what its backward needs (the residuals of ``jax.vjp``) on its
context; with ``remat=True`` it keeps only its input, and the backward computes the forward
again. The loss of a microbatch is weighted by its share of the batch's rows, so the
gradients are those of the whole batch's mean loss, even when the batch does not divide by M.

A training step's update applies only where the loss and every stage's gradients are finite:
each stage's gradient sum moves to the last stage, which decides, and the decision moves back
(recorded moves of one scalar each), so no step waits for the host to look at the loss.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _clock
from .._ledger import Event, Kind, execution_label, ledger
from .._numbers import whole
from .._spmd import shares
from .._transfer import leaves_of, place
from . import _data
from ._checkpoint import Checkpointing, Checkpoints
from ._checks import (
    MissingInputError,
    check_loss_fn,
    check_optimizer,
)
from ._feed import Feed
from ._history import History
from ._loop import Fit, check_on_nan, not_finite, reads_late
from ._pipeline_schedule import SCHEDULES, Block, Op, Ran, run
from ._shard import shape_of
from ._stage import (
    Stage,
    check_shapes,
    finite_sum,
    fn_name,
    gate,
    placed,
    read_stages,
    shapes_key,
    warn_shared,
)

_WHERE = "Pipeline"


class FewerMicrobatches(UserWarning):
    """A fit's batch had fewer rows than ``microbatches``: it ran as one microbatch per row."""


class _Placed(NamedTuple):
    """A batch cut into microbatches and placed for a call."""

    token: tuple  # the call's (pipeline id, call number): its events' ``info["pipeline"]``
    xs: list  # each microbatch's inputs, on the first stage's context
    ys: list  # each microbatch's (targets, weight), on the last stage's context
    rows: int  # the batch's rows


class _Dispatched(NamedTuple):
    """A training step dispatched, its loss not read yet."""

    step: int  # the pipeline's step number
    loss: jax.Array  # the batch's mean loss, on the last stage's context
    ok: jax.Array  # whether its update applied (loss and gradients finite), on the last stage's context
    rows: int  # the batch's rows


class Pipeline(Checkpointing):
    """One model split layer-wise across contexts, trained with microbatches (GPipe or 1F1B).

    >>> import mgkit as mg, optax, jax, jax.numpy as jnp, numpy as np
    >>> _ = mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    >>> def layer(p, x):
    ...     return jnp.tanh(x @ p["w"] + p["b"])
    >>> def head(p, h):
    ...     return h @ p["w"]
    >>> def mse(out, y):
    ...     return jnp.mean((out[:, 0] - y) ** 2)
    >>> X = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    >>> y = X.sum(1)
    >>> p0 = {"w": jnp.full((4, 8), 0.1), "b": jnp.zeros(8)}
    >>> p1 = {"w": jnp.full((8, 1), 0.1)}
    >>> pipe = mg.Pipeline([("dev0", layer, p0), ("dev1", head, p1)], loss=mse, microbatches=4,
    ...                    optimizer=optax.adam(1e-2))
    >>> loss, grads = pipe.value_and_grad(batch=(X, y))
    >>> [mg.where(g) for g in grads]
    ['dev0', 'dev1']
    >>> hist = pipe.fit((X, y), steps=50, batch_size=32, progress=False)
    >>> bool(hist.loss[-1] < hist.loss[0])
    True

    Args:
      stages: ``(context, fn, params)`` per stage, in order: ``fn(params, x) -> y``, each
        stage's output the next one's input; the first stage takes the batch's inputs.
        ``params`` may be a model such as an Equinox module: its leaves other than arrays
        are held as given (as ``mg.Trainer`` holds them).
      loss: ``loss(outputs, targets) -> scalar``, the mean loss over the rows of the last
        stage's outputs (it runs on the last stage's context).
      microbatches: M, the parts each batch is cut into (a batch that does not divide by M
        gets parts one row apart).
      schedule: ``"gpipe"``: every microbatch forward, then every one backward; ``"1f1b"``:
        each stage alternates one forward and one backward once the pipeline is full, keeping
        at most S microbatches' activations (the same gradients).
      remat: keep only each stage's input between its forward and backward, and compute the
        forward again in the backward (less memory, more compute).
      optimizer: an optax ``GradientTransformation`` for ``fit`` (``fit(data, optimizer)``
        still takes one, in place of this one).
      seed: the seed of the data order (arrays mgkit batches are shuffled by (seed, epoch)).
      on_nan: ``"raise"`` (default): a step whose loss or gradient is not finite is not
        applied, and the fit stops with an error naming it; ``"skip"``: that update is skipped
        and the fit goes on (at its end a ``StepsSkipped`` warning says how many).
      prefetch: batches cut and placed ahead of the step by a background thread
        (``mg.Prefetch``); 0 places each batch when the step needs it.
      checkpoint: a folder to save checkpoints in, as ``mg.Trainer``'s (parameters, optimizer
        states, step and data position, every ``every`` steps, the newest ``keep`` kept);
        ``fit(..., resume=True)`` goes on from the newest one.

    ``kept_bytes``: per stage, the most bytes its forwards kept at once for the backwards in
    the last call (GPipe: all M microbatches'; 1F1B: at most S - s on stage s).
    """

    def __init__(
        self,
        stages: Sequence[tuple],
        loss: Callable,
        *,
        microbatches: int = 1,
        schedule: str = "gpipe",
        remat: bool = False,
        optimizer: Any = None,
        seed: int = 0,
        on_nan: str = "raise",
        prefetch: int = 2,
        checkpoint: Any = None,
        every: int = 100,
        keep: int | None = 3,
    ):
        stages = read_stages(stages, _WHERE)
        check_loss_fn(loss, _WHERE, "loss(outputs, targets) -> scalar loss")
        self.microbatches = whole(
            microbatches, "microbatches", _WHERE, lo=1, example=8, note="parts per batch"
        )
        if schedule not in SCHEDULES:
            raise ValueError(
                f"{_WHERE}: schedule={schedule!r} is not known; use one of {list(SCHEDULES)} ('gpipe': every "
                "microbatch forward, then every one backward; '1f1b': a forward and a backward in turn)"
            )
        if not isinstance(remat, bool):
            raise TypeError(f"{_WHERE}: remat must be True or False, got {type(remat).__name__} {remat!r}")
        self.schedule_name, self.remat, self.loss = schedule, remat, loss
        self.optimizer = None if optimizer is None else check_optimizer(optimizer, _WHERE)
        self.seed = whole(seed, "seed", _WHERE, lo=0, example=0)
        self.on_nan = check_on_nan(on_nan, _WHERE)
        self.prefetch = whole(prefetch, "prefetch", _WHERE, lo=0, example=2, note="batches placed ahead")
        contexts = [ctx for ctx, _, _ in stages]
        self.contexts = tuple(c.name for c in contexts)
        warn_shared(contexts, _WHERE)
        count = len(stages)
        self._models = [m for _, _, m in stages]  # each stage's arrays and leaves held as given
        self._stages = [Stage(i, c, m.bind(f), count, loss, remat) for i, (c, f, m) in enumerate(stages)]
        self._params = [
            self._own(m.arrays, s, "parameters") for m, s in zip(self._models, self._stages, strict=True)
        ]
        self._optimizer: Any = None
        self._opt: list | None = None
        self._step = 0
        self._calls = 0
        self._last: tuple | None = None  # (token, what) of the last call whose events are recorded
        self._checked: set = set()
        self._position: dict | None = None  # where the last fit of arrays stopped
        self._orders: dict[int, tuple[Op, ...]] = {}  # microbatches -> the schedule's order
        self.history: History | None = None
        self.checkpoints = (
            None if checkpoint is None else Checkpoints(checkpoint, every=every, keep=keep, where=_WHERE)
        )
        self.kept_bytes: tuple[int, ...] = (0,) * count

    # -- state ---------------------------------------------------------------------------

    @property
    def params(self) -> list:
        """Each stage's parameters, on its context (the pipeline's own arrays: ``fit`` donates
        them; copy with ``jax.device_get`` to keep a snapshot). A stage's model with leaves
        other than arrays (an Equinox module's functions) comes back with them as given."""
        return [m.join(p) for m, p in zip(self._models, self._params, strict=True)]

    @property
    def opt_state(self) -> list | None:
        """Each stage's optimizer state, on its context (None before the first fit)."""
        return None if self._opt is None else list(self._opt)

    def state_shapes(self) -> dict:
        """The state as it lies on the contexts, for ``mg.show_sharding(pipe)``: ``{"params": ...,
        "opt_state": ...}`` (a list per stage), each leaf a ``jax.ShapeDtypeStruct`` with the
        sharding it is stored with (its stage's context). Nothing is read or moved."""
        return jax.tree_util.tree_map(shape_of, {"params": list(self._params), "opt_state": self._opt})

    @property
    def step(self) -> int:
        """Training steps completed, over every fit."""
        return self._step

    @property
    def stages(self) -> int:
        return len(self._stages)

    def __repr__(self) -> str:
        parts = " -> ".join(f"{fn_name(s.fn)}@{s.ctx.name}" for s in self._stages)
        remat = ", remat" if self.remat else ""
        m = self.microbatches
        return f"Pipeline({parts}; {m} microbatch(es), {self.schedule_name}{remat}; step {self._step})"

    def _own(self, tree: Any, stage: Stage, what: str) -> Any:
        """``tree`` on the stage's context, as arrays of the pipeline's own (moves recorded)."""
        leaves, treedef = leaves_of(tree, f"{_WHERE}: {stage.name}")
        moved = place(leaves, stage.ctx, Kind.PUT, {"what": what, "stage": stage.index})
        owned = [jnp.copy(m) if m is x else m for m, x in zip(moved, leaves, strict=True)]
        return jax.tree_util.tree_unflatten(treedef, owned)

    def _on_stages(self, p: Any) -> list:
        """Parameters given to ``value_and_grad``: one tree per stage, each moved to its stage's
        context where it is not there (recorded)."""
        if not isinstance(p, list | tuple) or len(p) != len(self._stages):
            raise TypeError(
                f"{_WHERE}.value_and_grad: p must be a list of {len(self._stages)} parameter trees, one per "
                f"stage (as pipe.params); got {type(p).__name__} {p!r:.80}"
            )
        out = []
        for tree, stage, model in zip(p, self._stages, self._models, strict=True):
            where = f"{_WHERE}.value_and_grad: {stage.name}"
            leaves, treedef = leaves_of(model.arrays_of(tree, where, "its parameters"), where)
            moved = place(leaves, stage.ctx, Kind.PUT, {"what": "parameters", "stage": stage.index})
            out.append(jax.tree_util.tree_unflatten(treedef, moved))
        return out

    # -- checking ------------------------------------------------------------------------

    def _split(self, batch: Any, where: str, short: bool) -> tuple[list, list, int, tuple[int, ...]]:
        """The batch's inputs and targets, cut into microbatches: (x parts, y parts, rows, sizes).
        ``short``: a batch with fewer rows than microbatches (a loader's short last batch in a
        fit) is cut into one microbatch per row, else it is an error."""
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise TypeError(
                f"{where}: batch must be a pair (inputs, targets), e.g. (X, y): the inputs go through the "
                f"stages, the targets to loss(outputs, targets); got {type(batch).__name__} {batch!r:.80}"
            )
        x, y = batch
        _, _, n = _data.check_batch((x, y), where, "the batch")
        m = min(self.microbatches, n) if short else self.microbatches
        if m > n:
            raise ValueError(
                f"{where}: microbatches={m}, but the batch has {n} row(s); use microbatches <= {n}, or a "
                f"larger batch"
            )
        sizes = shares(n, m)
        self._check(x, y, sizes, where)
        xs, ys, start = [], [], 0
        for size in sizes:
            cut = slice(start, start + size)
            xs.append(jax.tree_util.tree_map(lambda a, cut=cut: a[cut], x))
            ys.append(jax.tree_util.tree_map(lambda a, cut=cut: a[cut], y))
            start += size
        return xs, ys, n, sizes

    def _check(self, x: Any, y: Any, sizes: tuple[int, ...], where: str) -> None:
        """Runs the stages and the loss on shapes only, for each microbatch size, before any
        compute: a stage that cannot take its neighbour's output is named with both shapes."""
        for size in sorted(set(sizes)):
            xa = jax.tree_util.tree_map(
                lambda a, size=size: jax.ShapeDtypeStruct((size, *np.shape(a)[1:]), np.result_type(a)), x
            )
            ya = jax.tree_util.tree_map(
                lambda a, size=size: jax.ShapeDtypeStruct((size, *np.shape(a)[1:]), np.result_type(a)), y
            )
            key = (shapes_key(xa), shapes_key(ya))
            if key in self._checked:
                continue
            check_shapes(self._stages, self._params, self.loss, xa, ya, size, where)
            self._checked.add(key)

    # -- one step ------------------------------------------------------------------------

    def value_and_grad(self, p: Any = None, batch: Any = None) -> tuple[jax.Array, list]:
        """The batch's mean loss and its gradient, by the pipeline's schedule.

        Args:
          p: one parameter tree per stage (default: the pipeline's own, ``pipe.params``);
            trees not on their stage's context are moved there (recorded).
          batch: ``(inputs, targets)``, arrays with rows along axis 0.

        Returns ``(loss, grads)``: the loss (a scalar on the last stage's context) and one
        gradient tree per stage, each on its stage's context. Nothing is waited for.
        """
        where = f"{_WHERE}.value_and_grad"
        if batch is None:
            raise MissingInputError(f"{where}: give the batch, e.g. pipe.value_and_grad(batch=(X, y))")
        params = self._params if p is None else self._on_stages(p)
        ran = self._run(params, self._place(batch, where, short=False), "value_and_grad")
        self._record(ran.blocks)
        return ran.loss, ran.grads

    def apply(self, inputs: Any, p: Any = None) -> Any:
        """The model's outputs for ``inputs`` (rows along axis 0): the whole batch through each
        stage in turn, on its context, the activations moved between them (recorded). Returns
        the last stage's outputs, on its context. ``p``: parameters per stage (default the
        pipeline's own)."""
        where = f"{_WHERE}.apply"
        params = self._params if p is None else self._on_stages(p)
        leaves, _ = leaves_of(inputs, where)
        if not leaves or any(np.ndim(x) == 0 for x in leaves):
            raise TypeError(
                f"{where}: inputs must be arrays with rows along axis 0, e.g. X_test; got {inputs!r:.80}"
            )
        a = inputs
        for s, stage in enumerate(self._stages):
            kind = Kind.PUT if s == 0 else Kind.TRANSFER
            a = placed(a, stage.ctx, kind, {"what": "activations" if s else "inputs", "stage": s})
            a = stage.apply(params[s], a)
        return a

    def _place(self, batch: Any, where: str, short: bool) -> _Placed:
        """The batch cut into microbatches, inputs placed on the first stage, targets (with
        their weights) on the last (recorded as this call's splits); ``short`` as ``_split``'s."""
        xs, ys, n, sizes = self._split(batch, where, short)
        first, last = self._stages[0], self._stages[-1]
        self._calls += 1
        token = (id(self), self._calls)
        info = {"pipeline": token}
        xs = [
            placed(x, first.ctx, Kind.SPLIT, {**info, "rows": s, "of": n, "microbatch": i})
            for i, (x, s) in enumerate(zip(xs, sizes, strict=True))
        ]
        ys = [
            (
                placed(y, last.ctx, Kind.SPLIT, {**info, "rows": s, "of": n, "microbatch": i}),
                np.float32(s / n),
            )
            for i, (y, s) in enumerate(zip(ys, sizes, strict=True))
        ]
        return _Placed(token, xs, ys, n)

    def _run(self, params: list, batch: _Placed, what: str) -> Ran:
        """One forward and backward of a placed batch by the schedule."""
        self._last = (batch.token, what)
        m = len(batch.xs)
        order = self._orders.get(m)
        if order is None:
            order = self._orders[m] = SCHEDULES[self.schedule_name](len(self._stages), m)
        ran = run(order, self._stages, params, batch.xs, batch.ys, {"pipeline": batch.token})
        self.kept_bytes = ran.kept
        return ran

    def _record(self, blocks: list[Block]) -> None:
        """The forward/backward/update events of the last call, recorded once the devices are
        done (the caller does not wait)."""
        token, what = self._last
        stages = self._stages
        label = execution_label()
        offset = time.time() - time.perf_counter()

        def make() -> list[Event]:
            events = []
            for b in blocks:
                b.timing.wait()
                info = {"pipeline": token, "what": what, "stage": b.stage, "microbatch": b.microbatch}
                events.append(
                    Event.on(
                        b.kind, stages[b.stage].ctx, offset + b.timing.start, b.timing.seconds, label, info
                    )
                )
            return events

        ledger().record_later(make)

    # -- training ------------------------------------------------------------------------

    def fit(
        self,
        data: Any,
        optimizer: Any = None,
        steps: int | None = None,
        *,
        batch_size: int | None = None,
        shuffle: bool = True,
        seed: int | None = None,
        on_nan: str | None = None,
        resume: bool = False,
        progress: bool | None = None,
    ) -> History:
        """Trains the stages: one optimizer state per stage, on its context (kept across fits
        with the same optimizer; a different one starts afresh).

        Args:
          data: ``(inputs, targets)`` arrays with rows along axis 0 (batched and shuffled per
            epoch by the seed; a later fit of the same arrays goes on where this one stopped),
            a function ``step -> batch`` or an iterable of batches, which may end early: the
            fit then stops with a ``DataRanOut`` warning, state kept.
          optimizer: an optax ``GradientTransformation``; default: the pipeline's own
            (``mg.Pipeline(..., optimizer=)``).
          steps: steps to run (default: one epoch of arrays). With ``resume=True``, the steps
            of the whole run, as ``Trainer.fit``'s.
          batch_size: rows per batch, for arrays (default min(rows, 256)).
          shuffle: shuffle arrays each epoch (else in order).
          seed, on_nan: in place of the pipeline's own, for this fit.
          resume: first restore the newest checkpoint in the pipeline's ``checkpoint`` folder
            (parameters, optimizer states, step and data position).
          progress: None: a bar once the fit has run a second; True: at once; False: never.

        Returns a ``History`` (also ``pipe.history``). Ctrl-C stops at a step boundary with the
        state of the last completed step and raises KeyboardInterrupt.
        """
        where = f"{_WHERE}.fit"
        optimizer = self._optimizer_for(optimizer, where)
        on_nan = self.on_nan if on_nan is None else check_on_nan(on_nan, where)
        seed = self.seed if seed is None else whole(seed, "seed", where, lo=0, example=0)
        src = _data.source(data, batch_size, shuffle, seed, 1, where)
        self._check_batch_size(src, where)
        if steps is not None:
            total = whole(steps, "steps", where, lo=1, example=500, note="steps to run")
        elif isinstance(src, _data.ArraySource):
            total = src.steps_per_epoch
        else:
            raise MissingInputError(
                f"{where}: data is a function or an iterable of batches; say how many steps, e.g. steps=500"
            )
        if self._optimizer is not optimizer:
            self._opt = [  # every leaf on its stage's context, the step count too
                jax.jit(optimizer.init, out_shardings=jax.sharding.SingleDeviceSharding(s.ctx.device))(p)
                for p, s in zip(self._params, self._stages, strict=True)
            ]
            self._optimizer = optimizer
        self._begin(resume, where)
        if resume:
            total = max(total - self._step, 0)
        fit = Fit(where, [s.ctx for s in self._stages], total, progress)
        self.history = fit.history
        if total == 0:
            return fit.history
        feed = Feed(
            src,
            total,
            self._step + 1,
            lambda b, own: self._place(b, where, short=True),
            self.prefetch,
            self._position,
            where,
        )
        try:
            self._steps(feed, fit, optimizer, on_nan)
        finally:
            self._fit_ended(feed)
        return fit.end(f"step {self._step} (params and opt_state are that step's)", self._preempted)

    def _check_batch_size(self, src: Any, where: str) -> None:
        """Arrays batched by fewer rows than microbatches: an error (each batch would run as
        fewer microbatches than asked)."""
        if isinstance(src, _data.ArraySource) and src.batch_size < self.microbatches:
            size = "batch_size" if src.batch_size < src.rows else "the data's rows (batch_size)"
            raise ValueError(
                f"{where}: {size} is {src.batch_size}, fewer than microbatches={self.microbatches}: each "
                f"batch would run as {src.batch_size} microbatches of one row, not "
                f"{self.microbatches}; use batch_size >= {self.microbatches} (a multiple of it cuts even "
                f"parts), or mg.Pipeline(..., microbatches={src.batch_size}) or fewer"
            )

    def _steps(self, feed: Feed, fit: Fit, optimizer: Any, on_nan: str) -> None:
        """Dispatches steps until the fit's total (or the data ends, or Ctrl-C), each loss read
        at once or one step late (``reads_late``). The first batch with fewer rows than
        microbatches warns (``FewerMicrobatches``): it runs as one microbatch per row."""
        warned = []

        def take() -> tuple:
            return feed.take(fit.stop)

        def dispatch(item: tuple) -> _Dispatched:
            batch, position = item
            if len(batch.xs) < self.microbatches and not warned:
                warned.append(self._step + 1)
                warnings.warn(
                    f"{fit.where}: step {self._step + 1}'s batch has {batch.rows} row(s), fewer than "
                    f"microbatches={self.microbatches}: it runs as {batch.rows} microbatches of one row "
                    "(as a loader's short last batch does); if every batch is this short, use "
                    f"mg.Pipeline(..., microbatches={batch.rows}) or larger batches (said once a fit)",
                    FewerMicrobatches,
                    stacklevel=2,
                )
            out = self._dispatch(batch, optimizer)
            feed.after = position
            self._save_due(position)
            return out

        def read(item: _Dispatched) -> None:
            loss, ok = float(item.loss), bool(item.ok)
            fit.read(item.step, loss, ok, (item.rows,) * len(self._stages))
            if not ok and on_nan == "raise":
                kept = f"the fit stopped at step {self._step}"
                raise not_finite(fit.where, item.step, loss, kept, "pass on_nan='skip' to skip such steps")

        fit.steps(take, dispatch, read, reads_late([s.ctx.device for s in self._stages]))

    # -- checkpoints ---------------------------------------------------------------------

    def _state(self, position: dict | None) -> dict:
        return {
            "params": self._params,
            "opt_state": self._opt,
            "step": self._step,
            "key": None,
            "data": {} if position is None else dict(position),
        }

    def _restore(self, back: dict) -> None:
        self._params, self._opt = list(back["params"]), list(back["opt_state"])
        self._step = int(back["step"])
        self._position = back["data"] or None

    def _optimizer_for(self, optimizer: Any, where: str) -> Any:
        """The optimizer a fit uses: the one given to it, else the pipeline's own."""
        if optimizer is None:
            if self.optimizer is None:
                raise MissingInputError(
                    f"{where}: no optimizer; give it where the pipeline is made, mg.Pipeline(..., "
                    "optimizer=optax.adam(1e-3)), or to this fit, pipe.fit(data, optax.adam(1e-3))"
                )
            return self.optimizer
        return check_optimizer(optimizer, where)

    def _dispatch(self, batch: _Placed, optimizer: Any) -> _Dispatched:
        """One training step dispatched: the schedule's run, then each stage's update, applied
        only where the loss and every gradient are finite (decided on the last stage)."""
        step = self._step + 1
        ran = self._run(self._params, batch, f"fit step {step}")
        last = self._stages[-1]
        sums = [
            finite_sum(g)
            if stage.last
            else placed(finite_sum(g), last.ctx, Kind.TRANSFER, {"what": "gradient sum", "stage": s})
            for s, (stage, g) in enumerate(zip(self._stages, ran.grads, strict=True))
        ]
        ok = gate(ran.loss, sums)
        blocks = list(ran.blocks)
        for s, stage in enumerate(self._stages):
            flag = (
                ok
                if stage.last
                else placed(ok, stage.ctx, Kind.TRANSFER, {"what": "finite flag", "stage": s})
            )
            t0 = time.perf_counter()
            self._params[s], self._opt[s] = stage.update(
                optimizer, self._params[s], self._opt[s], ran.grads[s], flag
            )
            blocks.append(Block(Kind.UPDATE, s, None, _clock.watch(stage.ctx.device, self._params[s], t0)))
        self._record(blocks)
        self._step = step
        return _Dispatched(step, ran.loss, ok, batch.rows)

    # -- the picture ---------------------------------------------------------------------

    def schedule(self, widget: bool | None = None) -> Any:
        """The last step's timeline (a ``value_and_grad`` call, or a ``fit``'s last step): a row
        per stage, a block per forward, backward and update, from the ledger's events, with the
        bubble fraction measured beside the ideal (S - 1) / (M + S - 1). An inline widget in
        a notebook, text elsewhere; ``.save_png(path)`` for reports."""
        from ..views import Schedule  # a view: loaded when drawn

        if self._last is None:
            raise RuntimeError(
                f"{_WHERE}.schedule: nothing has run yet; call pipe.value_and_grad(batch=...) or "
                "pipe.fit(...) first"
            )
        token, what = self._last
        events = [e for e in ledger().records() if e.info is not None and e.info.get("pipeline") == token]
        return Schedule.of_pipeline(
            events, self.contexts, self.microbatches, what, widget=widget, schedule=self.schedule_name
        )
