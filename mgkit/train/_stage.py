"""A pipeline stage's compiled calls (forward, backward, update) and the small pieces a step
shares between stages: the finiteness of its gradients, the sum of its microbatches' losses,
the bytes a forward keeps."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from .. import _contexts
from .._static import Model
from .._transfer import place
from ._checks import check_params, check_scalar_loss, device_context, none_hint


def fn_name(fn: Callable) -> str:
    """What messages call a stage's function."""
    return getattr(fn, "__name__", type(fn).__name__)


def shapes_key(*trees: Any) -> tuple:
    """The shapes and dtypes of the trees' leaves (arrays, tracers or shape structs)."""
    return tuple((tuple(x.shape), str(x.dtype)) for t in trees for x in jax.tree_util.tree_leaves(t))


def placed(tree: Any, ctx: _contexts.Context, kind: str, info: dict) -> Any:
    """``tree`` placed on ``ctx`` (recorded as a ``kind`` move with ``info``)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, place(leaves, ctx, kind, info))


def kept_nbytes(saved: tuple, params: Any) -> int:
    """Bytes a forward keeps for its backward, less the parameters themselves."""
    own = {id(x) for x in jax.tree_util.tree_leaves(params)}
    return sum(
        x.nbytes for x in jax.tree_util.tree_leaves(saved) if hasattr(x, "nbytes") and id(x) not in own
    )


@jax.jit
def finite_sum(grads: Any) -> jax.Array:
    """The sum of every gradient (in at least float32): finite where each gradient is."""
    total = jnp.zeros((), jnp.float32)
    for g in jax.tree_util.tree_leaves(grads):
        total = total + jnp.sum(g, dtype=jnp.result_type(g.dtype, jnp.float32))
    return total


@jax.jit
def sum_losses(losses: list) -> jax.Array:
    """The microbatches' weighted losses added up: the batch's mean loss."""
    out = losses[0]
    for x in losses[1:]:
        out = out + x
    return out


@jax.jit
def gate(loss: jax.Array, sums: list) -> jax.Array:
    """Whether a step's update applies: its loss and every stage's gradient sum are finite."""
    total = loss.astype(jnp.float32)
    for s in sums:
        total = total + s
    return jnp.isfinite(total)


def read_stages(stages: Any, owner: str) -> list[tuple[_contexts.Context, Callable, Model]]:
    """The stages as (context, fn, model), each checked: ``model`` holds the stage's
    parameters (its arrays) and any leaves held as given (an Equinox module's functions)."""
    if not isinstance(stages, list | tuple):
        raise TypeError(
            f"{owner}: stages must be a list of (context, fn, params), e.g. "
            f"[('dev0', stage0, p0), ('dev1', stage1, p1)]; got {type(stages).__name__} {stages!r:.80}"
        )
    if not stages:
        raise ValueError(
            f"{owner}: no stages; give a list of (context, fn, params), e.g. "
            "[('dev0', stage0, p0), ('dev1', stage1, p1)]"
        )
    out = []
    for i, stage in enumerate(stages):
        if not isinstance(stage, list | tuple) or len(stage) != 3:
            raise TypeError(
                f"{owner}: stage {i} must be a (context, fn, params) triple, e.g. ('dev{i}', "
                f"stage{i}, p{i}); got {type(stage).__name__} {stage!r:.80}"
            )
        name, fn, p = stage
        ctx = device_context(name, f"{owner}: stage {i}", f"dev{i}")
        if not callable(fn):
            raise TypeError(
                f"{owner}: stage {i} ({ctx.name}): fn must be a function fn(params, x) -> y; got "
                f"{type(fn).__name__} {fn!r:.60}"
            )
        where = f"{owner}: stage {i} ({ctx.name}, {fn_name(fn)})"
        if not jax.tree_util.tree_leaves(p):
            raise ValueError(
                f"{where} has no parameters; every stage trains parameters of its own: merge "
                "a function without parameters into a neighbouring stage's fn"
            )
        out.append((ctx, fn, check_params(p, where)))
    return out


def warn_shared(contexts: list[_contexts.Context], owner: str) -> None:
    """Warns of stages that share a device: they take turns there."""
    shared: dict[Any, list[int]] = {}
    for i, c in enumerate(contexts):
        shared.setdefault(c.device, []).append(i)
    for idx in shared.values():
        if len(idx) > 1:
            names = ", ".join(f"{i} ({contexts[i].name})" for i in idx)
            warnings.warn(
                f"{owner}: stages {names} run on one device ({contexts[idx[0]].short}): they take "
                "turns there, so no overlap is possible between them, and the hops between them "
                "move nothing",
                UserWarning,
                stacklevel=3,
            )


def _avals(tree: Any) -> str:
    """A pytree's shapes for messages: ``float32[16,5]``, or ``{'x': float32[16,5], ...}``."""
    leaves = jax.tree_util.tree_leaves(tree)
    text = [f"{jnp.dtype(leaf.dtype).name}[{','.join(map(str, leaf.shape))}]" for leaf in leaves]
    return text[0] if len(text) == 1 and not isinstance(tree, dict | list | tuple) else f"({', '.join(text)})"


def check_shapes(stages: list, params: list, loss: Any, xa: Any, ya: Any, size: int, where: str) -> None:
    """Runs the stages and the loss on shapes only (``xa``, ``ya``: one microbatch's inputs
    and targets of ``size`` rows, as shape structs): a stage that cannot take its neighbour's
    output is named with both shapes."""
    a = xa
    for s, stage in enumerate(stages):
        shapes = jax.tree_util.tree_map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), params[s])
        try:
            out = jax.eval_shape(stage.fn, shapes, a)
        except Exception as e:
            nones = none_hint(e, {f"{stage.name}'s params": params[s]})
            if nones:
                raise type(e)(f"{where}: {stage.name} failed: {_first_line(e)}{nones}") from e
            if s == 0:
                raise ValueError(
                    f"{where}: {stage.name} cannot take the batch's inputs {_avals(a)} (one "
                    f"microbatch of {size} rows): {type(e).__name__}: {_first_line(e)}"
                ) from e
            before = stages[s - 1]
            raise ValueError(
                f"{where}: {before.name} outputs {_avals(a)}, which {stage.name} cannot take "
                f"as its input: {type(e).__name__}: {_first_line(e)}; make the two stages' shapes "
                "agree"
            ) from e
        a = out
    try:
        out = jax.eval_shape(loss, a, ya)
    except Exception as e:
        raise ValueError(
            f"{where}: the last stage, {stages[-1].name}, outputs {_avals(a)}, which "
            f"loss(outputs, targets) cannot take with targets {_avals(ya)}: {type(e).__name__}: "
            f"{_first_line(e)}"
        ) from e
    check_scalar_loss(out, False, where, "loss(outputs, targets)")


def _first_line(e: BaseException) -> str:
    """An error's first line, for a message that quotes it."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class Stage:
    """One stage's compiled calls: forward (keeping what the backward needs), backward
    (accumulating the parameters' gradient over microbatches, returning the input's), and the
    optimizer's update; all on the stage's context."""

    def __init__(
        self, index: int, ctx: _contexts.Context, fn: Callable, count: int, loss: Callable, remat: bool
    ):
        self.index, self.ctx, self.fn, self.remat = index, ctx, fn, remat
        self.first, self.last = index == 0, index == count - 1
        self.name = f"stage {index} ({ctx.name}, {fn_name(fn)})"
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
            self._trees[shapes_key(p, x, *rest)] = (tree, jax.ShapeDtypeStruct(out.shape, out.dtype))
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
        return out, (shapes_key(p, x, *rest), leaves)

    def backward(self, p: Any, saved: tuple, g: Any, acc: Any) -> tuple[Any, Any]:
        """(the parameters' gradient plus ``acc``, the input's gradient or None)."""
        if self.remat:
            key = ("remat", shapes_key(*saved))
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

    def update(self, optimizer: optax.GradientTransformation, p: Any, opt: Any, grads: Any, ok: Any) -> tuple:
        """The optax update of the stage's parameters where ``ok`` (a bool on the stage's context:
        the step's loss and every stage's gradients finite), else the state as it was."""
        if self._update is None or self._optimizer is not optimizer:

            def apply(p, opt, grads):
                updates, opt = optimizer.update(grads, opt, p)
                return optax.apply_updates(p, updates), opt

            def step(p, opt, grads, ok):
                return jax.lax.cond(ok, apply, lambda p, opt, grads: (p, opt), p, opt, grads)

            self._update, self._optimizer = jax.jit(step, donate_argnums=(0, 1)), optimizer
        return self._update(p, opt, grads, ok)
