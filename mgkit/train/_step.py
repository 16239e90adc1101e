"""The compiled training step.

Over distinct devices of one kind it is one SPMD program: the batch's rows split over the
contexts' mesh, the gradient of the whole batch's mean loss all-reduced by XLA, the optax update,
parameters and optimizer state replicated and donated. A batch whose rows do not divide by the
contexts keeps its largest even part split and its last rows (fewer than the contexts) on every
context, and weighs the two parts' mean losses by their rows: the gradient of the whole batch's
mean, in the same program. A batch with fewer rows than contexts (a loader's short last batch)
is all last rows: every context computes the whole batch, the one-device gradient.

Where contexts share a device or mix kinds it is the gather-update-copy loop: each context's
gradient of its part, gathered on the first context, the update there, the new parameters
copied back to the others (each move in the ledger).

Either way an update is applied only where the loss and every gradient are finite; the step
says whether it was (``ok``). The gradient itself, whole or accumulated over microbatches, is
``_accumulate``'s; the loss function's compute dtype and float16's loss scale ``_precision``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import _spmd
from .._contexts import Context
from .._spmd import AXIS, Targets, sharding
from .._transfer import place
from ._accumulate import BlockSum, batch_gradient
from ._precision import finite, in_precision, next_scale


class StepOut(NamedTuple):
    params: Any
    opt_state: Any
    loss: jax.Array
    ok: jax.Array  # bool: the update was applied (loss and gradients finite)
    aux: Any
    scale: Any = None  # precision="fp16": the LossScale after the step (else None)


def update(
    optimizer: optax.GradientTransformation, params, opt_state, loss, grads, alive=None, guard: bool = True
) -> tuple:
    """The optax update where the loss and every gradient are finite (and ``alive``, when
    given, is True), else the state as it was: (params, opt_state, ok). One branch runs
    (``lax.cond`` on a replicated flag). ``guard=False``: the update applied whatever it
    holds, as a hand-written step does (``ok``: the loss is finite); no conditional.

    The flag is whether the loss plus the sum of every gradient is finite: a NaN or an infinity
    anywhere makes that sum so, and one fused sum per leaf costs a fraction of an elementwise
    ``isfinite`` pass over the gradient (measured: about 1.5 % of a dispatch-bound step against
    10 %). Sums accumulate in at least float32, so half-precision gradients do not overflow; a
    float32 gradient whose sum overflows is itself past any useful step and is not applied."""
    if not guard:
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jnp.isfinite(loss)
    ok = finite((loss, grads))
    if alive is not None:
        ok = jnp.logical_and(ok, alive)

    def apply(params, opt_state, grads):
        updates, new_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state

    def keep(params, opt_state, grads):
        return params, opt_state

    params, opt_state = jax.lax.cond(ok, apply, keep, params, opt_state, grads)
    return params, opt_state, ok


def spmd_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    has_aux: bool,
    devices: tuple,
    gated: bool = False,
    accumulate: int = 1,
    precision: str = "fp32",
    layout: Any = None,
    guard: bool = True,
) -> Callable:
    """The jitted step over ``devices``: (params, opt_state, even, rest, key) -> StepOut, with
    ``even`` split over the devices (None for a batch with fewer rows than devices) and ``rest``
    (the last rows, fewer than the devices, or None) on every one; ``key`` a PRNG key for
    ``loss_fn`` or None. Parameters and optimizer state are donated.

    ``gated``: the step takes one more argument, ``alive`` (a bool array), and applies its
    update only where it is True: the ``ok`` of one step is the ``alive`` of the next, so a
    model whose step k was not finite keeps its state through steps dispatched before the
    caller read step k's result. Its loss is NaN where the update was not applied, so reading
    the loss alone says both.

    ``accumulate``: microbatches per batch, run in a ``lax.scan`` (``_accumulate``);
    ``precision``: the loss function's compute dtype (``_precision``). With ``"fp16"`` the step
    takes ``alive`` (None where not gated) and the ``LossScale``, and returns the next one.
    ``layout``: a ``Placement`` (``shard=``): parameters and optimizer state stored split (and
    padded) as it says, the batch split over its batch axis, the step traced and run with its
    mesh in force (``InForce``); None: replicated. ``guard=False``: no non-finite guard
    (``update``)."""
    rep, split = sharding(devices), sharding(devices, AXIS, 0)
    state, groups = (rep, rep), len(devices)
    if layout is not None:
        rep, split = layout.rep, layout.split
        state, groups = (layout.params, layout.opt_state(optimizer)), layout.batch_parts
    grad = batch_gradient(
        in_precision(loss_fn, precision),
        has_aux,
        accumulate,
        groups,
        lambda tree: jax.lax.with_sharding_constraint(tree, split),
        None if layout is None else BlockSum(layout.blocks, layout.lay, layout.own),
    )

    def step(params, opt_state, even, rest, key, alive=None, scale=None):
        if layout is not None:  # the math sees the leaves without their padding
            params, opt_state = layout.unpad(optimizer, params, opt_state)
        loss, aux, grads = grad(params, even, rest, key, scale)
        scale = next_scale(scale, loss, grads)
        params, opt_state, ok = update(optimizer, params, opt_state, loss, grads, alive, guard)
        if layout is not None:
            params, opt_state = layout.pad(optimizer, params, opt_state)
        if gated:  # one scalar tells both: the loss where the update applied, NaN where not
            loss = jnp.where(ok, loss, jnp.nan)
        return StepOut(params, opt_state, loss, ok, aux, scale)

    extra = 2 if precision == "fp16" else int(gated)
    program = jax.jit(
        step,
        in_shardings=(*state, split, rep, rep) + (rep,) * extra,
        out_shardings=StepOut(*state, rep, rep, rep, rep),
        donate_argnums=(0, 1),
    )
    return program if layout is None else InForce(program, layout.in_force)


class InForce:
    """A jitted program traced, lowered and run with a mesh in force (``Placement.in_force``):
    the loss function may name the mesh's axes (``with_sharding_constraint(x, P("data",
    "model"))``), and each call finds the trace it made (JAX keys traces by the mesh in force)."""

    __slots__ = ("in_force", "program")

    def __init__(self, program: Callable, in_force: Callable):
        self.program, self.in_force = program, in_force

    def __call__(self, *args: Any) -> Any:
        with self.in_force():
            return self.program(*args)

    def lower(self, *args: Any) -> Any:
        with self.in_force():
            return self.program.lower(*args)


def copied(tree: Any, target: jax.sharding.Sharding) -> Any:
    """Fresh copies of ``tree`` laid out by ``target`` (never the caller's buffers: the step
    donates what it is given)."""
    return jax.jit(lambda t: jax.tree_util.tree_map(jnp.copy, t), out_shardings=target)(tree)


def split_rows(leaves: list, n: int, k: int) -> tuple[list | None, list | None]:
    """A batch's leaves as (the first k * (n // k) rows or None where n < k, the rest or None)."""
    even = k * (n // k)
    if even == n:
        return leaves, None
    if even == 0:
        return None, leaves
    return [leaf[:even] for leaf in leaves], [leaf[even:] for leaf in leaves]


def place_spmd_batch(
    leaves: list, treedef: Any, targets: Targets, own: bool, layout: Any = None
) -> tuple[Any, Any, tuple]:
    """Places a batch for ``spmd_step``: its even part split over the contexts, its last rows on
    every one; recorded in the ledger (split and replicate events). ``own``: host arrays made
    for this batch (not the caller's), placed without a private copy. ``layout``: the step's
    ``Placement`` (the rows split over its batch axis only), or None. Returns (even, rest, rows
    per context)."""
    k = len(targets.contexts) if layout is None else layout.batch_parts
    n = np.shape(leaves[0])[0]
    even, rest = split_rows(leaves, n, k)
    sizes = (n // k,) * len(targets.contexts)
    t0, start = time.perf_counter(), time.time()
    moving = [(x, 0) for x in even or ()] + [(x, None) for x in rest or ()]
    values = [x for x, _ in moving]
    if not own:
        cpu = targets.devices[0].platform == "cpu"
        host = [i for i, x in enumerate(values) if _spmd.needs_private(x, cpu)]
        for i, c in zip(host, _spmd.private([values[i] for i in host]), strict=True):
            values[i] = c
    shardings = [
        sharding(targets.devices, AXIS, ax) if layout is None else layout.batch_sharding(ax)
        for _, ax in moving
    ]
    placed = _spmd.put(values, shardings)
    nbytes = sum(x.size * x.dtype.itemsize for x in values)  # numpy or jax arrays (check_batch)
    at_once = time.perf_counter() if _spmd.lands_at_once(targets.devices, nbytes) else None
    _spmd.record(_spmd.spmd_layout(moving, targets, sizes), start, placed, t0, at_once)
    r = len(even or ())
    even_tree = None if even is None else jax.tree_util.tree_unflatten(treedef, placed[:r])
    rest_tree = None if rest is None else jax.tree_util.tree_unflatten(treedef, placed[r:])
    if len(sizes) != k:  # contexts that share rows (a mesh's other axes): rows of the whole batch
        return even_tree, rest_tree, _spmd.shares(n, len(sizes))
    extra = n - sum(sizes)
    rows = tuple(s + (extra if i == 0 else 0) for i, s in enumerate(sizes))
    return even_tree, rest_tree, rows


def step_program(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    has_aux: bool,
    targets: Targets,
    spmd: bool,
    layout: Any,
    accumulate: int,
    precision: str,
    guard: bool,
) -> Any:
    """A trainer's step: one SPMD program over ``targets``' devices (``spmd_step``), or the
    gather-update-copy loop over contexts that share a device or mix kinds (``LoopStep``)."""
    if spmd:
        return spmd_step(
            loss_fn, optimizer, has_aux, targets.devices, False, accumulate, precision, layout, guard
        )
    return LoopStep(loss_fn, optimizer, has_aux, targets, accumulate, precision, guard)


class LoopStep:
    """The gather-update-copy loop over contexts that share a device or mix kinds: each
    context's gradient of its part, gathered on the first context, weighted by rows; the update
    there; the new parameters copied back to the other contexts. ``params`` is a list, one replica per context
    (the first the one the update reads and donates)."""

    def __init__(
        self,
        loss_fn: Callable,
        optimizer: optax.GradientTransformation,
        has_aux: bool,
        targets: Targets,
        accumulate: int = 1,
        precision: str = "fp32",
        guard: bool = True,
    ):
        self.targets = targets
        grad = batch_gradient(in_precision(loss_fn, precision), has_aux, accumulate, 1)
        self.grad = jax.jit(lambda params, part, key=None, scale=None: grad(params, part, None, key, scale))

        def combine(params, opt_state, weights, losses, grads, auxes, scale):
            loss, grad = _weighted(weights, losses), _weighted(weights, grads)
            aux = None if auxes[0] is None else _weighted(weights, auxes)
            scale = next_scale(scale, loss, grad)
            params, opt_state, ok = update(optimizer, params, opt_state, loss, grad, guard=guard)
            return StepOut(params, opt_state, loss, ok, aux, scale)

        self.combine = jax.jit(combine, donate_argnums=(0, 1))

    def __call__(
        self,
        replicas: list,
        opt_state: Any,
        parts: list,
        sizes: tuple[int, ...],
        key: Any = None,
        scale: Any = None,
    ) -> tuple[list, StepOut]:
        contexts: tuple[Context, ...] = self.targets.contexts
        first = contexts[0]
        active = [i for i, s in enumerate(sizes) if s]
        keys = [None if key is None else jax.device_put(key, contexts[i].device) for i in active]
        scales = [None if scale is None else jax.device_put(scale, contexts[i].device) for i in active]
        outs = [self.grad(replicas[i], parts[i], k, s) for i, k, s in zip(active, keys, scales, strict=True)]
        gathered = []
        for i, out in zip(active, outs, strict=True):
            leaves, treedef = jax.tree_util.tree_flatten(out)
            if contexts[i].device != first.device:
                leaves = place(leaves, first, "gather", {"what": "gradients"})
            gathered.append(jax.tree_util.tree_unflatten(treedef, leaves))
        total = sum(sizes)
        weights = tuple(jnp.asarray(sizes[i] / total, jnp.float32) for i in active)
        losses = [g[0] for g in gathered]
        auxes = [g[1] for g in gathered]
        grads = [g[2] for g in gathered]
        out = self.combine(replicas[0], opt_state, weights, losses, grads, auxes, scale)
        new = [out.params]
        leaves, treedef = jax.tree_util.tree_flatten(out.params)
        for ctx in contexts[1:]:
            if ctx.device == first.device:
                new.append(out.params)
            else:
                new.append(
                    jax.tree_util.tree_unflatten(
                        treedef, place(leaves, ctx, "replicate", {"what": "parameters"})
                    )
                )
        return new, out


def _weighted(weights: tuple, trees: list) -> Any:
    """sum_i weights[i] * trees[i], leaf by leaf."""
    return jax.tree_util.tree_map(lambda *v: sum(w * x for w, x in zip(weights, v, strict=True)), *trees)


def place_parts(leaves: list, treedef: Any, targets: Targets, sizes: tuple[int, ...]) -> list:
    """A batch cut into one part per context (``sizes`` rows each), each placed on its context
    and recorded (split events)."""
    parts, start = [], 0
    for ctx, size in zip(targets.contexts, sizes, strict=True):
        cut = [leaf[start : start + size] for leaf in leaves]
        start += size
        if size:
            cut = place(cut, ctx, "split", {"rows": size, "of": sum(sizes)})
        parts.append(jax.tree_util.tree_unflatten(treedef, cut))
    return parts


def replicas_of(targets: Targets, params: Any) -> list:
    """The gather-update-copy loop's copies of ``params``, one per context: the first context's
    tree as it is, and a copy on each other device (a context sharing the first's device shares
    its tree)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    first = targets.contexts[0]
    out = [params]
    for ctx in targets.contexts[1:]:
        if ctx.device == first.device:
            out.append(params)
        else:
            copies = [jax.device_put(x, ctx.device) for x in leaves]
            out.append(jax.tree_util.tree_unflatten(treedef, copies))
    return out


def speeds(program: LoopStep, replicas: list, placed: tuple) -> tuple[float, ...]:
    """Rows per second of each context's gradient on its part of ``placed`` (after a warm-up),
    for ``balance="measured"``."""
    parts, sizes = placed
    out = []
    for i, part in enumerate(parts):
        if not sizes[i]:
            out.append(1.0)
            continue
        jax.block_until_ready(program.grad(replicas[i], part))
        t0 = time.perf_counter()
        jax.block_until_ready(program.grad(replicas[i], part))
        out.append(sizes[i] / max(time.perf_counter() - t0, 1e-9))
    return tuple(out)
