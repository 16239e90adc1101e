"""How a call of ``mg.parallel`` (and ``mg.make_parallel``) is planned, compiled and run.

* **planned**: ``run`` picks the path. A call whose arguments are host arrays split evenly
  over distinct devices of one kind leaves a ``Plan`` in ``plans``; the next call laid out
  like it only copies, places, runs and records.
* **compiled**: every program of the parallel ops is built here (``spmd_program``,
  ``dispatch_program``, ``pmap_program``) and kept in one place, the cache of compiled
  programs ``_spmd.programs`` (a plan holds its program's key, not the program).
  ``mg.clear_caches()`` empties it and ``plans``.
* **run**: ``run_spmd`` (one ``shard_map`` program over the contexts' mesh) or
  ``run_dispatch`` (one program per context, all dispatched before any is waited on).
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _contexts
from .._ledger import Kind, Layout
from .._spmd import (
    AXIS,
    Batch,
    Cache,
    Targets,
    check_run,
    explained,
    fn_name,
    is_abstract,
    lands_at_once,
    mesh,
    needs_private,
    note_run,
    place_copied,
    place_spmd,
    programs,
    record,
    record_run,
    run_layout,
    sharding,
    spec,
    spmd_layout,
    trim,
)
from .._transfer import place
from ._batch import hashable, leaf_axes, slice_rows, tree_leaf_name

# -- planning ------------------------------------------------------------------------------


def run(fn, batch, targets, sizes, out_axes, to, where) -> Any:
    """Picks the execution path: SPMD when one program can span the contexts, else dispatch."""
    if batch.n and targets.spmd and max(sizes) - min(sizes) <= 1:
        return run_spmd(fn, batch, targets, sizes, out_axes, to, where)
    return run_dispatch(fn, batch, targets, sizes, out_axes, to, where)


class PlanKey(NamedTuple):
    """What a plan depends on besides the arguments' values: its key in ``plans``."""

    fn: Callable  # the wrapped function
    axes: tuple  # (in_axes, out_axes), each as ``hashable`` gives it
    where: str  # the public function called ("parallel" or "make_parallel"), for messages
    treedef: Any  # the structure of (args, kwargs)
    targets: Targets  # the contexts
    layout: tuple  # (shape, dtype) per leaf (``host_layout``)


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Plan:
    """What a call of ``parallel`` does again for inputs laid out like a call before: host arrays
    split evenly over distinct devices of one kind (copied, placed, recorded) and one program.
    Everything ``describe``, ``place_spmd`` and the program cache work out is kept, so the next
    such call only copies, places, runs and records (``run``)."""

    copies: tuple[int, ...]  # host leaves copied before they are placed (``private``)
    shardings: list  # one per leaf: every leaf is placed
    split: Layout  # the placement's events (``record``)
    runs: Layout  # the program's run events
    program: tuple  # the program's key in ``programs``, the one place it is kept
    build: Callable[[], Callable]  # compiles the program when ``programs`` no longer has it
    at_once: bool  # the placement is complete when device_put returns (``lands_at_once``)
    contexts: tuple  # the contexts the program runs on, for its collectives (``note_run``)
    what: str  # the program, as its collective events name it

    def run(self, leaves: list) -> Any:
        t0, start = time.perf_counter(), time.time()
        placed = place_copied(leaves, self.shardings, self.copies)
        record(self.split, start, placed, t0, time.perf_counter() if self.at_once else None)
        program = programs.get(self.program, self.build)
        start, t0 = time.time(), time.perf_counter()  # the run's time includes a first compile
        check_run(program, placed, self.contexts, self.what)
        out = explained(program, *placed)
        record(self.runs, start, jax.tree_util.tree_leaves(out), t0)
        note_run(program, placed, self.contexts, self.what, start)
        return out


# PlanKey -> Plan. The only strong reference to a plan: a wrapper keeps a weak one to its last
# plan, so mg.clear_caches() frees every plan with its layouts and shardings.
plans = Cache(256)


def host_layout(leaves: list) -> tuple | None:
    """(shape, dtype) per leaf when every leaf is a host numpy array, else None (no plan)."""
    out = []
    for x in leaves:
        if type(x) is not np.ndarray:
            return None
        out.append((x.shape, x.dtype))
    return tuple(out)


def make_plan(key: PlanKey, batch: Batch, sizes: tuple[int, ...], out_axes: Any) -> None:
    """Leaves in ``plans`` the plan for calls laid out like this one, when it has one (host
    arrays, an even SPMD split)."""
    targets = key.targets
    if is_abstract(batch.leaves) or not (batch.n and targets.spmd and len(set(sizes)) == 1):
        return
    cpu = targets.devices[0].platform == "cpu"
    copies = tuple(i for i, x in enumerate(batch.leaves) if needs_private(x, cpu))
    shardings = [sharding(targets.devices, AXIS, ax) for ax in batch.axes]
    split = spmd_layout([(x, ax) for x, ax in zip(batch.leaves, batch.axes, strict=True)], targets, sizes)
    runs = run_layout(targets, sizes, key.fn, "spmd", batch.n)
    program, build = spmd_source(key.fn, batch.treedef, batch.axes, out_axes, targets, key.where)
    at_once = lands_at_once(targets.devices, sum(x.nbytes for x in batch.leaves))
    what = f"{key.where} of {fn_name(key.fn)}"
    plan = Plan(copies, shardings, split, runs, program, build, at_once, targets.contexts, what)
    plans.get(key, lambda: plan)


# -- compiling -----------------------------------------------------------------------------


_REDUCE_HINT = (
    "For a reduction over the whole batch, reduce after the call (e.g. out.mean()) or use "
    "mg.pmap(fn, axis_name='i') with jax.lax.psum inside; for a value that is the same on every "
    "context, pass out_axes=None"
)
_REDUCE_FIX = {  # where a value that is the same on every context is declared, per function
    "make_parallel": " to mg.parallel (make_parallel concatenates every output along axis 0).",
}


def _checked(fn: Callable, treedef: Any, axes: tuple, out_axes: Any, k: int, where: str) -> Callable:
    """``fn`` over flat leaves; at trace time checks that each output has one row per input row."""

    def run(*leaves):
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        out = fn(*args, **kwargs)
        rows = next(np.shape(x)[ax] for x, ax in zip(leaves, axes, strict=True) if ax is not None)
        _check_out(out, out_axes, rows, k, fn, where)
        return out

    return run


def _check_out(out: Any, out_axes: Any, rows: int, k: int, fn: Callable, where: str) -> None:
    out_leaves = jax.tree_util.tree_leaves(out)
    for i, (leaf, ax) in enumerate(zip(out_leaves, leaf_axes(out_axes, out, "out_axes", where), strict=True)):
        label = tree_leaf_name(out, i).replace("leaf ", "output ").replace("the array", "its output")
        if not hasattr(leaf, "dtype") and not isinstance(leaf, numbers.Number):
            raise TypeError(
                f"{where}: {fn_name(fn)} returned a {type(leaf).__name__} ({leaf!r:.60}) for {label}, not an "
                "array; a compiled function returns arrays only: return arrays (and numbers) from "
                f"{fn_name(fn)}, and keep other values outside it"
            )
        if ax is None:
            continue
        shape = np.shape(leaf)
        what = "a scalar (shape ())" if not shape else f"shape {tuple(shape)}"
        if not -len(shape) <= ax < len(shape) or shape[ax] != rows:
            raise ValueError(
                f"{where}: {fn_name(fn)} returned {what} for {label} on a part of {rows} rows "
                f"({k} context(s)); the outputs are concatenated along axis {ax}, so each needs "
                f"{rows} rows there. {_REDUCE_HINT}{_REDUCE_FIX.get(where, '.')}"
            )


def _out_specs(out_axes: Any, axis_name: str) -> Any:
    if out_axes is None or isinstance(out_axes, int):
        return spec(out_axes, axis_name)
    return jax.tree_util.tree_map(lambda ax: spec(ax, axis_name), out_axes, is_leaf=lambda x: x is None)


def spmd_program(
    fn: Callable, batch: Batch, out_axes: Any, targets: Targets, where: str, traced: bool = False
) -> Callable:
    """jit(shard_map) of ``fn`` over the contexts' mesh; ``traced``: for a call inside another
    transformation (``vmap`` adds axes that fixed input shardings would not have)."""
    return programs.get(*spmd_source(fn, batch.treedef, batch.axes, out_axes, targets, where, traced))


def spmd_source(
    fn: Callable, treedef: Any, axes: tuple, out_axes: Any, targets: Targets, where: str, traced: bool = False
) -> tuple[tuple, Callable[[], Callable]]:
    """The key in ``programs`` of :func:`spmd_program`'s program, and the function that builds it."""
    key = ("spmd", fn, treedef, axes, hashable(out_axes), targets.devices, where, traced)

    def build():
        body = _checked(fn, treedef, axes, out_axes, len(targets.devices), where)
        mapped = jax.shard_map(
            body,
            mesh=mesh(targets.devices),
            in_specs=tuple(spec(ax) for ax in axes),
            out_specs=_out_specs(out_axes, AXIS),
            check_vma=False,
        )
        if traced:
            return jax.jit(mapped)
        return jax.jit(mapped, in_shardings=tuple(sharding(targets.devices, AXIS, ax) for ax in axes))

    return key, build


def dispatch_program(fn: Callable, batch: Batch, out_axes: Any, k: int, where: str) -> Callable:
    """jit of ``fn`` on one context's part: one program for all ``k`` contexts, which runs
    where its arguments are."""
    key = ("dispatch", fn, batch.treedef, batch.axes, hashable(out_axes), k, where)
    return programs.get(key, lambda: jax.jit(_checked(fn, batch.treedef, batch.axes, out_axes, k, where)))


def pmap_program(
    fn: Callable, batch: Batch, out_axes: Any, targets: Targets, axis_name: str, traced: bool
) -> Callable:
    """jit(shard_map) of ``fn`` over one slice per device; ``traced``: for a call inside another
    transformation (``vmap`` adds axes that fixed input shardings would not have)."""
    key = ("pmap", fn, axis_name, batch.treedef, batch.axes, hashable(out_axes), targets.devices, traced)
    return programs.get(key, lambda: _pmap_program(fn, batch, out_axes, targets, axis_name, traced))


def _pmap_program(
    fn: Callable, batch: Batch, out_axes: Any, targets: Targets, axis_name: str, traced: bool
) -> Callable:
    def body(*leaves):
        leaves = [x if ax is None else jnp.squeeze(x, ax) for x, ax in zip(leaves, batch.axes, strict=True)]
        args, kwargs = jax.tree_util.tree_unflatten(batch.treedef, leaves)
        out = fn(*args, **kwargs)
        axes = leaf_axes(out_axes, out, "out_axes", "pmap")
        flat, tree = jax.tree_util.tree_flatten(out)
        for x, ax in zip(flat, axes, strict=True):
            if ax is not None and not 0 <= ax <= np.ndim(x):
                raise ValueError(
                    f"pmap: out_axes={out_axes!r} is out of range for an output of shape {np.shape(x)}"
                )
        stacked = [x if ax is None else jnp.expand_dims(x, ax) for x, ax in zip(flat, axes, strict=True)]
        return jax.tree_util.tree_unflatten(tree, stacked)

    mapped = jax.shard_map(
        body,
        mesh=mesh(targets.devices, axis_name),
        in_specs=tuple(spec(ax, axis_name) for ax in batch.axes),
        out_specs=_out_specs(out_axes, axis_name),
        check_vma=False,  # jax.pmap's semantics: no varying/invariant types (issue 19)
    )
    if traced:
        return jax.jit(mapped)
    return jax.jit(mapped, in_shardings=tuple(sharding(targets.devices, axis_name, ax) for ax in batch.axes))


# -- running -------------------------------------------------------------------------------


def run_spmd(fn, batch, targets, sizes, out_axes, to, where) -> Any:
    """One SPMD program over the contexts' mesh; parts padded to equal size and trimmed."""
    placed = place_spmd(batch, targets, sizes)
    traced = is_abstract(batch.leaves)
    program = spmd_program(fn, batch, out_axes, targets, where, traced)
    start, t0 = time.time(), time.perf_counter()  # the run's time includes a first compile
    if not traced:  # a program too big for the devices fails here, as the dispatch path's does
        check_run(program, placed, targets.contexts, f"{where} of {fn_name(fn)}")
    out = explained(program, *placed)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out)
    if not traced:
        record_run(targets, sizes, fn, "spmd", start, batch.n, out_leaves, t0)
        note_run(program, placed, targets.contexts, f"{where} of {fn_name(fn)}", start)
    padded = len(set(sizes)) > 1
    if not padded and to is None:
        return out
    axes = leaf_axes(out_axes, out, "out_axes", where)
    dest = targets.contexts[0] if to is None else _contexts.resolve(to, where)
    gathered = place(out_leaves, dest, Kind.GATHER, {"from": "+".join(targets.names)})
    trimmed = [
        x if (ax is None or not padded) else trim(x, sizes, ax) for x, ax in zip(gathered, axes, strict=True)
    ]
    return jax.tree_util.tree_unflatten(out_tree, trimmed)


def run_dispatch(fn, batch, targets, sizes, out_axes, to, where) -> Any:
    """One program per context with rows, all dispatched before any is waited on, then gathered."""
    if is_abstract(batch.leaves):
        raise TypeError(
            f"{where}: these contexts ({targets.describe()}) need one program per context, which "
            "cannot be traced inside jax.jit or jax.vmap. Call it outside jit (mgkit compiles fn "
            "for each context itself), or use distinct devices of one kind and an even split."
        )
    program = dispatch_program(fn, batch, out_axes, len(targets.names), where)
    active = [i for i, size in enumerate(sizes) if size] or [0]
    outs, ran = [], []
    split_idx = [j for j, ax in enumerate(batch.axes) if ax is not None]
    shared_idx = [j for j, ax in enumerate(batch.axes) if ax is None]
    for i in active:
        ctx, size = targets.contexts[i], sizes[i]
        start = sum(sizes[:i])
        cut = [slice_rows(batch.leaves[j], start, size, batch.axes[j]) for j in split_idx]
        info = {"rows": size, "of": batch.n}
        leaves = list(batch.leaves)
        for j, v in zip(split_idx, place(cut, ctx, Kind.SPLIT, info), strict=True):
            leaves[j] = v
        shared = place([batch.leaves[j] for j in shared_idx], ctx, Kind.REPLICATE)
        for j, v in zip(shared_idx, shared, strict=True):
            leaves[j] = v
        begin, t0 = time.time(), time.perf_counter()
        try:
            out = explained(program, *leaves)
        except Exception as e:
            where_run = f"context {ctx.name!r} ({ctx.short})"
            e.add_note(f"mgkit: raised while running {fn_name(fn)} on {where_run}")
            raise
        record_run(targets.only(i), (size,), fn, "dispatch", begin, batch.n, out, t0)
        outs.append(out)
        ran.append(ctx)
    if len(outs) == 1 and to is None:
        return outs[0]
    first = jax.tree_util.tree_flatten(outs[0])
    axes = leaf_axes(out_axes, outs[0], "out_axes", where)
    dest = ran[0] if to is None else _contexts.resolve(to, where)
    flat = [jax.tree_util.tree_leaves(o) for o in outs]
    moved = [place(leaves, dest, Kind.GATHER) for leaves in flat]
    join = np.concatenate if dest.device is None else jnp.concatenate
    result = [
        m0 if ax is None else join([m[j] for m in moved], axis=ax)
        for j, (m0, ax) in enumerate(zip(moved[0], axes, strict=True))
    ]
    return jax.tree_util.tree_unflatten(first[1], result)
