"""``mg.Pipeline``: one model split layer-wise across contexts, trained with microbatches.

Seed 003's third case (TensorFlow's layer-wise split over two GPUs) as a GPipe schedule: the
batch is cut into M microbatches; each goes forward through the S stages, each stage on its
own context with its own function and parameters, the activations moved to the next stage's
context; then each goes backward, the gradients moved back. One thread dispatches every call
and every move in that order without waiting, so while stage 1 computes microbatch 0, stage
0 computes microbatch 1: the devices overlap except in the pipeline's bubble.

Every hop between neighbouring stages is ``jax.device_put`` under mgkit's placement and so
in the ledger: 2 * M * (S - 1) ``transfer`` events a step (activations forward, gradients
back), with their bytes. Each stage's forward, backward and update is timed on its device
(``_clock``) and recorded as a ``forward``, ``backward`` or ``update`` event, from which
``Pipeline.schedule()`` draws the step.

The forward of a stage keeps what its backward needs (the residuals of ``jax.vjp``) on its
context; with ``remat=True`` it keeps only its input, and the backward computes the forward
again. The loss of a microbatch is weighted by its share of the batch's rows, so the
gradients are those of the whole batch's mean loss, even when the batch does not divide by M.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import _clock, _contexts
from .._ledger import Event, execution_label, ledger
from .._numbers import whole
from .._spmd import shares
from .._transfer import leaves_of, place
from . import _data
from ._checks import (
    MissingInputError,
    check_loss_fn,
    check_optimizer,
    check_params,
    check_scalar_loss,
    device_context,
)
from ._history import History
from ._loop import Bar, Interrupts

_WHERE = "Pipeline"
SCHEDULES = ("gpipe",)


def _fn_name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _avals(tree: Any) -> str:
    """A pytree's shapes for messages: ``float32[16,5]``, or ``{'x': float32[16,5], ...}``."""
    leaves = jax.tree_util.tree_leaves(tree)
    text = [f"{jnp.dtype(leaf.dtype).name}[{','.join(map(str, leaf.shape))}]" for leaf in leaves]
    return text[0] if len(text) == 1 and not isinstance(tree, dict | list | tuple) else f"({', '.join(text)})"


def _key(*trees: Any) -> tuple:
    """The shapes and dtypes of the trees' leaves (arrays, tracers or shape structs)."""
    return tuple((tuple(x.shape), str(x.dtype)) for t in trees for x in jax.tree_util.tree_leaves(t))


class _Stage:
    """One stage's compiled calls: forward (keeping what the backward needs), backward
    (accumulating the parameters' gradient over microbatches, returning the input's), and the
    optimizer's update; all on the stage's context."""

    def __init__(
        self, index: int, ctx: _contexts.Context, fn: Callable, count: int, loss: Callable, remat: bool
    ):
        self.index, self.ctx, self.fn, self.remat = index, ctx, fn, remat
        self.first, self.last = index == 0, index == count - 1
        self.name = f"stage {index} ({ctx.name}, {_fn_name(fn)})"
        self._trees: dict[tuple, Any] = {}  # arguments' shapes -> the vjp's structure (remat=False)
        self._backs: dict[tuple, Callable] = {}

        if self.last:

            def model(p, x, y, w):
                return w * loss(fn(p, x), y)
        else:

            def model(p, x):
                return fn(p, x)

        first = self.first

        def vjp(p, x, *rest):
            if first:  # the batch's inputs are not differentiated (they may be integers)
                out, back = jax.vjp(lambda p: model(p, x, *rest), p)
            else:
                out, back = jax.vjp(lambda p, x: model(p, x, *rest), p, x)
            return out, back

        self._vjp = vjp

        def keep(p, x, *rest):
            out, back = vjp(p, x, *rest)
            leaves, tree = jax.tree_util.tree_flatten(back)
            self._trees[_key(p, x, *rest)] = (tree, jax.ShapeDtypeStruct(out.shape, out.dtype))
            return out, leaves

        self._forward = jax.jit(model if remat else keep)
        self.apply = jax.jit(fn)
        self._update: Callable | None = None
        self._optimizer: Any = None

    def forward(self, p: Any, x: Any, rest: tuple) -> tuple[Any, tuple]:
        """(output, saved): the stage's output (the last stage's: its weighted loss), and what
        its backward needs."""
        if self.remat:
            return self._forward(p, x, *rest), (x, *rest)
        out, leaves = self._forward(p, x, *rest)
        return out, (_key(p, x, *rest), leaves)

    def backward(self, p: Any, saved: tuple, g: Any, acc: Any) -> tuple[Any, Any]:
        """(the parameters' gradient plus ``acc``, the input's gradient or None)."""
        if self.remat:
            key = ("remat", _key(*saved))
            back = self._backs.get(key)
            if back is None:
                back = self._backs[key] = jax.jit(self._recompute, donate_argnums=(3,))
            return back(p, saved, g, acc)
        key, leaves = saved
        back = self._backs.get(key)
        if back is None:
            tree = self._trees[key]
            back = self._backs[key] = jax.jit(functools.partial(self._replay, tree), donate_argnums=(2,))
        return back(leaves, g, acc)

    def _finish(self, cot: tuple, acc: Any) -> tuple[Any, Any]:
        gp = cot[0] if acc is None else jax.tree_util.tree_map(jnp.add, acc, cot[0])
        return gp, (None if self.first else cot[1])

    def _replay(self, tree: tuple, leaves: list, g: Any, acc: Any) -> tuple[Any, Any]:
        structure, out = tree
        back = jax.tree_util.tree_unflatten(structure, leaves)
        return self._finish(back(jnp.ones(out.shape, out.dtype) if g is None else g), acc)

    def _recompute(self, p: Any, saved: tuple, g: Any, acc: Any) -> tuple[Any, Any]:
        out, back = self._vjp(p, *saved)
        return self._finish(back(jnp.ones_like(out) if g is None else g), acc)

    def update(self, optimizer: optax.GradientTransformation, p: Any, opt: Any, grads: Any) -> tuple:
        if self._update is None or self._optimizer is not optimizer:

            def step(p, opt, grads):
                updates, opt = optimizer.update(grads, opt, p)
                return optax.apply_updates(p, updates), opt

            self._update, self._optimizer = jax.jit(step, donate_argnums=(0, 1)), optimizer
        return self._update(p, opt, grads)


@jax.jit
def _finite_sum(grads: Any) -> jax.Array:
    total = jnp.zeros((), jnp.float32)
    for g in jax.tree_util.tree_leaves(grads):
        total = total + jnp.sum(g, dtype=jnp.result_type(g.dtype, jnp.float32))
    return total


@jax.jit
def _total(losses: list) -> jax.Array:
    out = losses[0]
    for x in losses[1:]:
        out = out + x
    return out


class Pipeline:
    """One model split layer-wise across contexts, trained with microbatches (GPipe).

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
    >>> pipe = mg.Pipeline([("dev0", layer, p0), ("dev1", head, p1)], loss=mse, microbatches=4)
    >>> loss, grads = pipe.value_and_grad(batch=(X, y))
    >>> [mg.where(g) for g in grads]
    ['dev0', 'dev1']
    >>> hist = pipe.fit((X, y), optax.adam(1e-2), steps=50, batch_size=32, progress=False)
    >>> bool(hist.loss[-1] < hist.loss[0])
    True

    Args:
      stages: ``(context, fn, params)`` per stage, in order: ``fn(params, x) -> y``, each
        stage's output the next one's input; the first stage takes the batch's inputs.
      loss: ``loss(outputs, targets) -> scalar``, the mean loss over the rows of the last
        stage's outputs (it runs on the last stage's context).
      microbatches: M, the parts each batch is cut into (a batch that does not divide by M
        gets parts one row apart).
      schedule: ``"gpipe"``: every microbatch forward, then every one backward.
      remat: keep only each stage's input between its forward and backward, and compute the
        forward again in the backward (less memory, more compute).
    """

    def __init__(
        self,
        stages: Sequence[tuple],
        loss: Callable,
        *,
        microbatches: int = 1,
        schedule: str = "gpipe",
        remat: bool = False,
    ):
        if not isinstance(stages, list | tuple):
            raise TypeError(
                f"{_WHERE}: stages must be a list of (context, fn, params), e.g. "
                f"[('dev0', stage0, p0), ('dev1', stage1, p1)]; got {type(stages).__name__} {stages!r:.80}"
            )
        if not stages:
            raise ValueError(
                f"{_WHERE}: no stages; give a list of (context, fn, params), e.g. "
                "[('dev0', stage0, p0), ('dev1', stage1, p1)]"
            )
        check_loss_fn(loss, _WHERE, "loss(outputs, targets) -> scalar loss")
        self.microbatches = whole(
            microbatches, "microbatches", _WHERE, lo=1, example=8, note="parts per batch"
        )
        if schedule not in SCHEDULES:
            raise ValueError(
                f"{_WHERE}: schedule={schedule!r} is not known; use one of {list(SCHEDULES)} (every "
                "microbatch forward, then every one backward)"
            )
        if not isinstance(remat, bool):
            raise TypeError(f"{_WHERE}: remat must be True or False, got {type(remat).__name__} {remat!r}")
        self.schedule_name, self.remat, self.loss = schedule, remat, loss
        contexts, fns, params = [], [], []
        for i, stage in enumerate(stages):
            if not isinstance(stage, list | tuple) or len(stage) != 3:
                raise TypeError(
                    f"{_WHERE}: stage {i} must be a (context, fn, params) triple, e.g. ('dev{i}', "
                    f"stage{i}, p{i}); got {type(stage).__name__} {stage!r:.80}"
                )
            name, fn, p = stage
            ctx = device_context(name, f"{_WHERE}: stage {i}", f"dev{i}")
            if not callable(fn):
                raise TypeError(
                    f"{_WHERE}: stage {i} ({ctx.name}): fn must be a function fn(params, x) -> y; got "
                    f"{type(fn).__name__} {fn!r:.60}"
                )
            where = f"{_WHERE}: stage {i} ({ctx.name}, {_fn_name(fn)})"
            if not jax.tree_util.tree_leaves(p):
                raise ValueError(
                    f"{where} has no parameters; every stage trains parameters of its own: merge "
                    "a function without parameters into a neighbouring stage's fn"
                )
            check_params(p, where)
            contexts.append(ctx)
            fns.append(fn)
            params.append(p)
        self.contexts = tuple(c.name for c in contexts)
        shared = {}
        for i, c in enumerate(contexts):
            shared.setdefault(c.device, []).append(i)
        for idx in shared.values():
            if len(idx) > 1:
                names = ", ".join(f"{i} ({contexts[i].name})" for i in idx)
                warnings.warn(
                    f"{_WHERE}: stages {names} run on one device ({contexts[idx[0]].short}): they take "
                    "turns there, so no overlap is possible between them, and the hops between them "
                    "move nothing",
                    UserWarning,
                    stacklevel=2,
                )
        count = len(contexts)
        self._stages = [
            _Stage(i, c, f, count, loss, remat) for i, (c, f) in enumerate(zip(contexts, fns, strict=True))
        ]
        self._params = [self._own(p, s, "parameters") for p, s in zip(params, self._stages, strict=True)]
        self._optimizer: Any = None
        self._opt: list | None = None
        self._step = 0
        self._calls = 0
        self._last: tuple | None = None  # (token, what) of the last call whose events are recorded
        self._checked: set = set()
        self.history: History | None = None
        self.kept_bytes: tuple[int, ...] = (0,) * count

    # -- state ---------------------------------------------------------------------------

    @property
    def params(self) -> list:
        """Each stage's parameters, on its context (the pipeline's own arrays: ``fit`` donates
        them; copy with ``jax.device_get`` to keep a snapshot)."""
        return list(self._params)

    @property
    def opt_state(self) -> list | None:
        """Each stage's optimizer state, on its context (None before the first fit)."""
        return None if self._opt is None else list(self._opt)

    @property
    def step(self) -> int:
        """Training steps completed, over every fit."""
        return self._step

    @property
    def stages(self) -> int:
        return len(self._stages)

    def __repr__(self) -> str:
        parts = " -> ".join(f"{_fn_name(s.fn)}@{s.ctx.name}" for s in self._stages)
        remat = ", remat" if self.remat else ""
        m = self.microbatches
        return f"Pipeline({parts}; {m} microbatch(es), {self.schedule_name}{remat}; step {self._step})"

    def _own(self, tree: Any, stage: _Stage, what: str) -> Any:
        """``tree`` on the stage's context, as arrays of the pipeline's own (moves recorded)."""
        leaves, treedef = leaves_of(tree, f"{_WHERE}: {stage.name}")
        moved = place(leaves, stage.ctx, "put", {"what": what, "stage": stage.index})
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
        for tree, stage in zip(p, self._stages, strict=True):
            leaves, treedef = leaves_of(tree, f"{_WHERE}.value_and_grad: {stage.name}")
            moved = place(leaves, stage.ctx, "put", {"what": "parameters", "stage": stage.index})
            out.append(jax.tree_util.tree_unflatten(treedef, moved))
        return out

    # -- checking ------------------------------------------------------------------------

    def _split(self, batch: Any, where: str) -> tuple[list, list, int, tuple[int, ...]]:
        """The batch's inputs and targets, cut into microbatches: (x parts, y parts, rows, sizes)."""
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise TypeError(
                f"{where}: batch must be a pair (inputs, targets), e.g. (X, y): the inputs go through the "
                f"stages, the targets to loss(outputs, targets); got {type(batch).__name__} {batch!r:.80}"
            )
        x, y = batch
        _, _, n = _data.check_batch((x, y), 1, where, "the batch")
        m = self.microbatches
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
            key = (_key(xa), _key(ya))
            if key in self._checked:
                continue
            a = xa
            for s, stage in enumerate(self._stages):
                params = jax.tree_util.tree_map(
                    lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), self._params[s]
                )
                try:
                    out = jax.eval_shape(stage.fn, params, a)
                except Exception as e:
                    if s == 0:
                        raise ValueError(
                            f"{where}: {stage.name} cannot take the batch's inputs {_avals(a)} (one "
                            f"microbatch of {size} rows): {type(e).__name__}: {_first_line(e)}"
                        ) from e
                    before = self._stages[s - 1]
                    raise ValueError(
                        f"{where}: {before.name} outputs {_avals(a)}, which {stage.name} cannot take "
                        f"as its input: {type(e).__name__}: {_first_line(e)}; make the two stages' shapes "
                        "agree"
                    ) from e
                a = out
            try:
                out = jax.eval_shape(self.loss, a, ya)
            except Exception as e:
                raise ValueError(
                    f"{where}: the last stage, {self._stages[-1].name}, outputs {_avals(a)}, which "
                    f"loss(outputs, targets) cannot take with targets {_avals(ya)}: {type(e).__name__}: "
                    f"{_first_line(e)}"
                ) from e
            check_scalar_loss(out, False, where, "loss(outputs, targets)")
            self._checked.add(key)

    # -- one step ------------------------------------------------------------------------

    def value_and_grad(self, p: Any = None, batch: Any = None) -> tuple[jax.Array, list]:
        """The batch's mean loss and its gradient, by the GPipe schedule.

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
        loss, grads, _ = self._run(params, batch, where, "value_and_grad")
        return loss, grads

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
            kind = "put" if s == 0 else "transfer"
            a = _placed(a, stage.ctx, kind, {"what": "activations" if s else "inputs", "stage": s})
            a = stage.apply(params[s], a)
        return a

    def _run(self, params: list, batch: Any, where: str, what: str) -> tuple[jax.Array, list, int]:
        xs, ys, n, sizes = self._split(batch, where)
        stages, m_count = self._stages, len(sizes)
        first, last = stages[0], stages[-1]
        self._calls += 1
        token = (id(self), self._calls)
        label = execution_label()
        blocks: list[tuple[str, int, int | None, _clock.Timing]] = []
        info = {"pipeline": token}
        # the microbatches onto the first stage (inputs) and the last (targets)
        xs = [
            _placed(x, first.ctx, "split", {**info, "rows": s, "of": n, "microbatch": i})
            for i, (x, s) in enumerate(zip(xs, sizes, strict=True))
        ]
        ys = [
            _placed(y, last.ctx, "split", {**info, "rows": s, "of": n, "microbatch": i})
            for i, (y, s) in enumerate(zip(ys, sizes, strict=True))
        ]
        weights = [np.float32(s / n) for s in sizes]
        saved: list[list] = [[None] * m_count for _ in stages]
        ready: dict[tuple[int, int], _clock.Timing] = {}  # (stage, microbatch) -> when its input landed
        losses = []
        kept = [0] * len(stages)
        for mb in range(m_count):
            a = xs[mb]
            for s, stage in enumerate(stages):
                after = ()
                if s > 0:
                    t0 = time.perf_counter()
                    a = _placed(
                        a,
                        stage.ctx,
                        "transfer",
                        {**info, "what": "activations", "stage": s, "microbatch": mb},
                    )
                    ready[(s, mb)] = _clock.watch(stage.ctx.device, a, t0, (blocks[-1][3],))
                    after = (ready[(s, mb)],)
                rest = (ys[mb], weights[mb]) if stage.last else ()
                t0 = time.perf_counter()
                out, keep = stage.forward(params[s], a, rest)
                blocks.append(("forward", s, mb, _clock.watch(stage.ctx.device, out, t0, after)))
                saved[s][mb] = keep
                kept[s] += _nbytes(keep, params[s])
                a = out
            losses.append(a)
        accs: list[Any] = [None] * len(stages)
        for mb in reversed(range(m_count)):
            g, producer = None, None
            for s in reversed(range(len(stages))):
                stage = stages[s]
                after = ()
                if g is not None:
                    t0 = time.perf_counter()
                    g = _placed(
                        g, stage.ctx, "transfer", {**info, "what": "gradients", "stage": s, "microbatch": mb}
                    )
                    after = (_clock.watch(stage.ctx.device, g, t0, (producer,)),)
                t0 = time.perf_counter()
                accs[s], g = stage.backward(params[s], saved[s][mb], g, accs[s])
                saved[s][mb] = None  # what the backward needed is freed as it goes
                producer = _clock.watch(stage.ctx.device, (accs[s], g), t0, after)
                blocks.append(("backward", s, mb, producer))
        loss = _total(losses)
        self.kept_bytes = tuple(kept)
        self._record_blocks(blocks, token, label, what)
        return loss, accs, n

    def _record_blocks(self, blocks: list, token: tuple, label: int | None, what: str) -> None:
        """The forward/backward/update events of a call, recorded once the devices are done
        (the caller does not wait)."""
        stages = self._stages
        offset = time.time() - time.perf_counter()
        self._last = (token, what)

        def make() -> list[Event]:
            events = []
            for kind, s, mb, timing in blocks:
                timing.wait()
                start = timing.start
                c = stages[s].ctx
                info = {"pipeline": token, "what": what, "stage": s, "microbatch": mb}
                events.append(
                    Event(
                        kind, c.name, c.name, c.short, c.short, 0, offset + start, timing.seconds, label, info
                    )
                )
            return events

        ledger().record_later(make)

    # -- training ------------------------------------------------------------------------

    def fit(
        self,
        data: Any,
        optimizer: Any,
        steps: int | None = None,
        *,
        batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        on_nan: str = "raise",
        progress: bool | None = None,
    ) -> History:
        """Trains the stages with ``optimizer``: one state per stage, on its context (kept
        across fits with the same optimizer; a different one starts afresh).

        Args:
          data: ``(inputs, targets)`` arrays with rows along axis 0 (batched and shuffled per
            epoch by ``seed``), a function ``step -> batch`` or an iterable of batches.
          optimizer: an optax ``GradientTransformation``.
          steps: steps to run (default: one epoch of arrays).
          batch_size: rows per batch, for arrays (default min(rows, 256)).
          on_nan: ``"raise"``: a step whose loss or gradient is not finite is not applied and
            the fit stops with an error; ``"skip"``: that step is skipped.
          progress: None: a bar once the fit has run a second; True: at once; False: never.

        Returns a ``History`` (also ``pipe.history``). Ctrl-C stops at a step boundary with the
        state of the last completed step and raises KeyboardInterrupt.
        """
        where = f"{_WHERE}.fit"
        check_optimizer(optimizer, where)
        if on_nan not in ("raise", "skip"):
            raise ValueError(f"{where}: on_nan={on_nan!r}; use 'raise' (stop at a non-finite loss) or 'skip'")
        seed = whole(seed, "seed", where, lo=0, example=0)
        src = _data.source(data, batch_size, shuffle, seed, 1, where)
        if steps is not None:
            total = whole(steps, "steps", where, lo=1, example=500, note="steps to run")
        elif isinstance(src, _data.ArraySource):
            total = src.steps_per_epoch
        else:
            raise MissingInputError(
                f"{where}: data is a function or an iterable of batches; say how many steps, e.g. steps=500"
            )
        if self._optimizer is not optimizer:
            self._opt = [jax.jit(optimizer.init)(p) for p in self._params]
            self._optimizer = optimizer
        history = History(self.contexts)
        self.history = history
        bar = Bar(where, total, progress)
        stopped = None
        try:
            with Interrupts() as stop:
                for _ in range(total):
                    if stop.requested:
                        stopped = "interrupted"
                        break
                    try:
                        batch = src.next(self._step + 1)
                    except StopIteration:
                        stopped = "data ran out"
                        break
                    self._train_step(batch, optimizer, history, on_nan, where)
                    bar.tick(len(history), lambda: f"loss {history.loss[-1]:.6g}")
        finally:
            bar.close(len(history), lambda: f"loss {history.loss[-1]:.6g}" if len(history) else "")
            history.stopped = history.stopped or stopped
        if stopped == "interrupted":
            raise KeyboardInterrupt(
                f"{where} stopped at step {self._step} ({len(history)} step(s) this fit); params and "
                "opt_state are those of that step; fit again to go on"
            )
        return history

    def _train_step(self, batch: Any, optimizer: Any, history: History, on_nan: str, where: str) -> None:
        t0 = time.perf_counter()
        loss, grads, n = self._run(self._params, batch, where, f"fit step {self._step + 1}")
        sums = [_finite_sum(g) for g in grads]
        value = float(loss)
        finite = np.isfinite(value) and all(np.isfinite(float(x)) for x in sums)
        step = self._step + 1
        if not finite:
            history.append(step, float("nan"), time.perf_counter() - t0, (n,) * len(self._stages))
            if on_nan == "raise":
                history.stopped = "nan"
                raise FloatingPointError(
                    f"{where}: step {step}'s loss is {value} (or a gradient is not finite): its update was "
                    f"not applied, and the fit stopped at step {self._step}; params and opt_state are the "
                    "last finite ones. Lower the learning rate, check the batch's data, or pass on_nan='skip'"
                )
            self._step = step  # skipped: counted, as the trainer counts it, with the state unchanged
            return
        label = execution_label()
        offset = time.time() - time.perf_counter()
        token = self._last[0] if self._last else None
        updates = []
        for s, stage in enumerate(self._stages):
            u0 = time.perf_counter()
            self._params[s], self._opt[s] = stage.update(optimizer, self._params[s], self._opt[s], grads[s])
            updates.append((s, _clock.watch(stage.ctx.device, self._params[s], u0)))
        self._step = step
        jax.block_until_ready(self._params)  # one step in flight: the next batch's moves wait for this one
        seconds = time.perf_counter() - t0
        history.append(step, value, seconds, (n,) * len(self._stages))
        rate = n / seconds if seconds > 0 else float("nan")
        events = []
        for s, timing in updates:
            c = self._stages[s].ctx
            timing.wait()
            info = {"pipeline": token, "what": f"fit step {step}", "stage": s, "microbatch": None}
            events.append(
                Event(
                    "update",
                    c.name,
                    c.name,
                    c.short,
                    c.short,
                    0,
                    offset + timing.start,
                    timing.seconds,
                    label,
                    info,
                )
            )
        for stage in self._stages:
            c = stage.ctx
            info = {
                "what": "Pipeline.fit",
                "iteration": step,
                "models": 1,
                "rows": n,
                "loss": value,
                "samples_per_second": rate,
                "final": False,
            }
            events.append(
                Event("step", c.name, c.name, c.short, c.short, 0, offset + t0, seconds, label, info)
            )
        ledger().record(events)

    # -- the picture ---------------------------------------------------------------------

    def schedule(self, widget: bool | None = None) -> Any:
        """The last step's timeline (a ``value_and_grad`` call, or a ``fit``'s last step): a row
        per stage, a block per forward, backward and update, from the ledger's events, with the
        bubble fraction measured beside GPipe's ideal (S - 1) / (M + S - 1). An inline widget in
        a notebook, text elsewhere; ``.save_png(path)`` for reports."""
        from ..views import Schedule  # a view: loaded when drawn

        if self._last is None:
            raise RuntimeError(
                f"{_WHERE}.schedule: nothing has run yet; call pipe.value_and_grad(batch=...) or "
                "pipe.fit(...) first"
            )
        token, what = self._last
        events = [e for e in ledger().records() if e.info is not None and e.info.get("pipeline") == token]
        return Schedule.of_pipeline(events, self.contexts, self.microbatches, what, widget=widget)


def _placed(tree: Any, ctx: _contexts.Context, kind: str, info: dict) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, place(leaves, ctx, kind, info))


def _nbytes(saved: tuple, params: Any) -> int:
    """Bytes a forward keeps for its backward, less the parameters themselves."""
    own = {id(x) for x in jax.tree_util.tree_leaves(params)}
    return sum(
        x.nbytes for x in jax.tree_util.tree_leaves(saved) if hasattr(x, "nbytes") and id(x) not in own
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
