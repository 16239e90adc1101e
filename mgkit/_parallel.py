"""Parallel ops: split a batch across contexts, run a function on each part, concatenate.

One API, two execution paths:

* **SPMD** — the contexts are distinct devices of one kind (``cuda0..cuda7``, or simulated
  ``cpu0..cpu7``): one ``shard_map`` program over a mesh of those devices, compiled once.
  A batch that does not divide evenly is padded by at most one row per part and trimmed.
* **dispatch** — the contexts share a device, mix kinds (``cuda0`` with ``cpu0``), or weights
  make the parts unequal: one compiled program per context, every context dispatched before
  any is waited on, then the outputs are gathered.

Both paths give ``fn`` applied to each context's part, concatenated; both are differentiable,
with each part's backward pass on its own device. Every split, replicate, gather and run is
recorded in the ledger.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import re
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _contexts
from ._errors import ContextError
from ._ledger import Event, Layout, execution_label, ledger
from ._numbers import real
from ._spmd import (
    AXIS,
    Batch,
    Cache,
    Targets,
    explained,
    fn_name,
    is_abstract,
    lands_at_once,
    mesh,
    needs_private,
    on_clear,
    per_context,
    place_copied,
    place_spmd,
    programs,
    record,
    record_run,
    resolve,
    run_layout,
    sharding,
    shares,
    spec,
    spmd_layout,
    trim,
)
from ._transfer import leaves_of, place

_REDUCE_HINT = (
    "For a reduction over the whole batch, reduce after the call (e.g. out.mean()) or use "
    "mg.pmap(fn, axis_name='i') with jax.lax.psum inside; for a value that is the same on every "
    "context, pass out_axes=None"
)
_REDUCE_FIX = {  # where a value that is the same on every context is declared, per function
    "make_parallel": " to mg.parallel (make_parallel concatenates every output along axis 0).",
}

# -- sizes ---------------------------------------------------------------------------------


def check_weights(weights: Any, targets: Targets, fn: str) -> tuple[float, ...] | None:
    """Validates weights (a sequence or a {context: weight} mapping) against the contexts."""
    if weights is None:
        return None
    k = len(targets.names)
    if isinstance(weights, Mapping):
        weights = per_context(weights, targets, f"weights={dict(weights)!r}", fn)
    elif isinstance(weights, str) or not isinstance(weights, Sequence | np.ndarray):
        raise TypeError(
            f"{fn}: weights must be a list of {k} non-negative numbers, one per context "
            f"({targets.describe()}), got {type(weights).__name__} {weights!r}"
        )
    weights = list(np.asarray(weights).tolist()) if isinstance(weights, np.ndarray) else list(weights)
    if len(weights) != k:
        raise ValueError(
            f"{fn}: weights has {len(weights)} entries ({weights!r}) but there are {targets.describe()}; "
            f"pass one weight per context"
        )
    for c, w in zip(targets.names, weights, strict=True):
        real(w, f"weights[{c!r}]", fn, lo=0, example=1, note="a context with weight 0 gets no rows")
    if sum(weights) <= 0:
        raise ValueError(
            f"{fn}: weights {weights!r} are all zero; at least one context ({targets.describe()}) "
            f"needs a positive weight"
        )
    return tuple(float(w) for w in weights)


# -- batches and axes ----------------------------------------------------------------------


class _Ax:
    """An axis wrapped so that None survives tree flattening."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def leaf_axes(axes: Any, tree: Any, what: str, fn: str) -> list:
    """One axis (int or None) per leaf of ``tree``, from an int, None or a pytree prefix."""
    if axes is None or (isinstance(axes, int) and not isinstance(axes, bool)):
        return [axes] * len(jax.tree_util.tree_leaves(tree))
    key = (jax.tree_util.tree_structure(tree), _hashable(axes))
    return list(_AXES.get(key, lambda: _leaf_axes(axes, tree, what, fn)))


def _leaf_axes(axes: Any, tree: Any, what: str, fn: str) -> tuple:
    try:
        wrapped = jax.tree_util.tree_map(
            lambda ax, sub: jax.tree_util.tree_map(lambda _: _Ax(ax), sub),
            axes,
            tree,
            is_leaf=lambda x: x is None,
        )
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{fn}: {what}={axes!r} does not match the structure of the values it describes "
            f"({jax.tree_util.tree_structure(tree)}); give an int, None, or one entry per value. ({e})"
        ) from None
    out = [a.value for a in jax.tree_util.tree_leaves(wrapped, is_leaf=lambda x: isinstance(x, _Ax))]
    for ax in out:
        if ax is not None and (isinstance(ax, bool) or not isinstance(ax, int)):
            raise TypeError(f"{fn}: {what}={axes!r} contains {ax!r}; each axis must be an int or None")
    return tuple(out)


def describe(
    leaves: list, treedef: Any, per_leaf: Sequence, targets: Targets, fn: str, names: Callable[[int], str]
) -> Batch:
    """Checks every split leaf has the same number of rows along its axis (``per_leaf``: one
    axis or None per leaf); ``fn`` names the caller in messages and picks their advice."""
    norm = []
    n, first = None, None
    for i, (leaf, ax) in enumerate(zip(leaves, per_leaf, strict=True)):
        if ax is None:
            norm.append(None)
            continue
        shape = np.shape(leaf)
        if not shape:
            raise ValueError(
                f"{fn}: {names(i)} is a scalar (shape ()), but it is split along axis {ax} across "
                f"{targets.describe()}; pass a batch with a leading axis" + _SHARED_HINT[fn]
            )
        if not -len(shape) <= ax < len(shape):
            raise ValueError(
                f"{fn}: axis {ax} is out of range for {names(i)} of shape {tuple(shape)} "
                f"({len(shape)} dimension(s)); use an axis from {-len(shape)} to {len(shape) - 1}"
            )
        ax %= len(shape)
        norm.append(ax)
        if n is None:
            n, first = shape[ax], i
        elif shape[ax] != n:
            raise ValueError(
                f"{fn}: {names(i)} has {shape[ax]} rows along axis {ax} (shape {tuple(shape)}) but "
                f"{names(first)} has {n} (shape {tuple(np.shape(leaves[first]))}); every split argument "
                f"needs the same batch size to be split across {targets.describe()}"
            )
    if n is None:
        raise ValueError(_no_batch(fn, treedef, bool(leaves), targets))
    return Batch(leaves, treedef, tuple(norm), int(n), names)


_SHARED_HINT = {  # how a value is shared by every context instead of split, per function
    "split": "",
    "parallel": ", or mark it as shared on every context with in_axes=None",
    "pmap": ", or mark it as shared on every context with in_axes=None",
    "make_parallel": (
        "; make_parallel splits every keyword argument along axis 0, so close over a value that every "
        "context shares (e.g. mg.make_parallel(lambda x: f(x, w), x=x)), or use "
        "mg.parallel(f, in_axes=(0, None))(x, w)"
    ),
}


def _no_batch(fn: str, treedef: Any, has_leaves: bool, targets: Targets) -> str:
    """The message for a call with nothing to split."""
    if fn == "make_parallel":
        given = jax.tree_util.tree_unflatten(treedef, [])[1]  # nothing to split: no leaves at all
        shown = ", ".join(f"{k}={v!r}" for k, v in given.items())
        verb = "holds" if len(given) == 1 else "hold"
        return (
            f"make_parallel: {shown} {verb} no array to split; each keyword argument is a batch split "
            f"along axis 0 across {targets.describe()}, so pass arrays, e.g. "
            "mg.make_parallel(f, x=np.ones((8, 4)))"
        )
    if fn == "split" or not has_leaves:
        what = "the tree holds" if fn == "split" else "the arguments hold"
        return (
            f"{fn}: {what} no array to split ({treedef}); pass a batch, e.g. a numpy or JAX array "
            f"with one row per sample, to split across {targets.describe()}"
        )
    return (
        f"{fn}: every argument is shared (in_axes is None for all of them), so there is no batch "
        f"to split across {targets.describe()}; mark the batch argument with in_axes=0"
    )


def _slice(leaf: Any, start: int, size: int, axis: int) -> Any:
    if isinstance(leaf, np.ndarray | np.generic):
        return leaf[(slice(None),) * axis + (slice(start, start + size),)]
    return jax.lax.slice_in_dim(leaf, start, start + size, axis=axis)


def _dtype(leaf: Any) -> np.dtype:
    dtype = getattr(leaf, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.result_type(leaf)


# -- split and concat ----------------------------------------------------------------------


def split(tree: Any, contexts: Any = None, axis: int = 0, weights: Any = None) -> dict[str, Any]:
    """Splits a pytree of batches along ``axis`` and places part i on context i.

    Without weights the part sizes differ by at most one; with weights they are proportional
    (largest-remainder rounding). Every part's rows are recorded in the ledger.

    Args:
      tree: a pytree of arrays that share their size along ``axis``.
      contexts: context names, a count (the first n) or None for every context in the map.
      axis: the axis to split.
      weights: one non-negative number per context, or a {context: weight} mapping.

    Returns:
      An ordered dict context name -> part (the same tree structure) on that context.

    >>> import mgkit as mg, numpy as np
    >>> _ = mg.use_contexts("a->cpu0;b->cpu1", verbose=False)
    >>> parts = mg.split(np.arange(5), weights=[3, 1])
    >>> {k: v.tolist() for k, v in parts.items()}
    {'a': [0, 1, 2, 3], 'b': [4]}
    """
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(
            f"split: axis={axis!r}; give the int axis to cut every leaf along, e.g. axis=0 "
            "(every leaf of the tree is split; to give a value to every context, use mg.put on each)"
        )
    axis = int(axis)
    targets = resolve(contexts, "split")
    names = functools.partial(_tree_leaf_name, tree)
    leaves, treedef = leaves_of(tree, "split", names)
    batch = describe(leaves, treedef, (axis,) * len(leaves), targets, "split", names)
    sizes = shares(batch.n, len(targets.names), check_weights(weights, targets, "split"))
    parts: dict[str, Any] = {}
    start = 0
    for ctx, size in zip(targets.contexts, sizes, strict=True):
        cut = [_slice(leaf, start, size, ax) for leaf, ax in zip(batch.leaves, batch.axes, strict=True)]
        info = {"rows": size, "of": batch.n, "axis": axis}
        parts[ctx.name] = jax.tree_util.tree_unflatten(batch.treedef, place(cut, ctx, "split", info))
        start += size
    return parts


def _tree_leaf_name(tree: Any, i: int) -> str:
    paths = jax.tree_util.tree_leaves_with_path(tree)
    where = jax.tree_util.keystr(paths[i][0])
    return f"leaf {where}" if where else "the array"


def concat(parts: Mapping[str, Any] | Sequence[Any], to: Any = None, axis: int = 0) -> Any:
    """Gathers parts onto one context and concatenates them along ``axis`` (inverse of split).

    Args:
      parts: a mapping context -> part (as ``split`` returns) or a sequence of parts; every part
        has the same tree structure.
      to: the target context; None means the first part's context, ``"cpu"`` host numpy.
      axis: the axis to concatenate along.

    >>> import mgkit as mg, numpy as np
    >>> _ = mg.use_contexts("a->cpu0;b->cpu1", verbose=False)
    >>> x = mg.concat(mg.split({"x": np.arange(6.0)}))
    >>> mg.where(x), x["x"].tolist()
    ('a', [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    """
    if isinstance(parts, Mapping):
        labels, trees = [f"part {k!r}" for k in parts], list(parts.values())
        default = next(iter(parts), None)
    elif isinstance(parts, Sequence) and not isinstance(parts, str):
        labels, trees = [f"part {i}" for i in range(len(parts))], list(parts)
        default = None
    else:
        raise TypeError(
            f"concat: parts must be a mapping context -> part (as mg.split returns) or a list of parts, "
            f"got {type(parts).__name__}"
        )
    if not trees:
        raise ValueError("concat: no parts to concatenate; pass the mapping mg.split returned")
    if to is None:
        to = default if isinstance(default, str) else _first_context(trees[0])
    dest = _contexts.resolve(to, "concat")
    flat = [leaves_of(t, "concat") for t in trees]
    treedef = flat[0][1]
    for label, (_, td) in zip(labels[1:], flat[1:], strict=True):
        if td != treedef:
            raise ValueError(
                f"concat: {label} has structure {td}, but {labels[0]} has {treedef}; every part "
                "must have the same tree structure"
            )
    columns = list(zip(*(leaves for leaves, _ in flat), strict=True)) if treedef.num_leaves else []
    for j, column in enumerate(columns):
        _check_column(column, labels, axis, lambda j=j: _tree_leaf_name(trees[0], j))
    moved = [place(leaves, dest, "concat", {"axis": axis}) for leaves, _ in flat]
    join = np.concatenate if dest.device is None else jnp.concatenate
    out = [join([m[j] for m in moved], axis=axis) for j in range(len(columns))]
    return jax.tree_util.tree_unflatten(treedef, out)


def _first_context(tree: Any) -> str:
    leaves = jax.tree_util.tree_leaves(tree)
    devs = leaves[0].devices() if leaves and isinstance(leaves[0], jax.Array) else None
    if devs is None or len(devs) != 1:
        raise ValueError("concat: the parts are not on one context each; say where to gather with to='dev0'")
    return _contexts.name_of(next(iter(devs)))


def _check_column(column: tuple, labels: list[str], axis: int, leaf_name: Callable[[], str]) -> None:
    ref = np.shape(column[0])
    ref_dtype = _dtype(column[0])
    for label, leaf in zip(labels, column, strict=True):
        shape = np.shape(leaf)
        if not -len(shape) <= axis < len(shape):
            raise ValueError(
                f"concat: axis {axis} is out of range for {leaf_name()} of {label}, shape {tuple(shape)} "
                f"({len(shape)} dimension(s))"
            )
        ax = axis % len(shape)
        if len(shape) != len(ref) or shape[:ax] + shape[ax + 1 :] != ref[:ax] + ref[ax + 1 :]:
            raise ValueError(
                f"concat: {leaf_name()} of {label} has shape {tuple(shape)}, which does not match "
                f"{tuple(ref)} of {labels[0]} outside axis {axis}"
            )
        if _dtype(leaf) != ref_dtype:
            raise TypeError(
                f"concat: {leaf_name()} of {label} has dtype {_dtype(leaf)}, but {labels[0]} "
                f"has {ref_dtype}; cast the parts to one dtype first"
            )


# -- programs ------------------------------------------------------------------------------


_AXES = Cache(1024)  # (tree structure, axes) -> one axis per leaf
_MAKE = Cache()  # (fn, contexts) -> the Parallel that make_parallel reuses


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
        if ax is None:
            continue
        shape = np.shape(leaf)
        label = _tree_leaf_name(out, i).replace("leaf ", "output ").replace("the array", "its output")
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


def _spmd_program(
    fn: Callable, batch: Batch, out_axes: Any, targets: Targets, where: str, traced: bool = False
) -> Callable:
    """jit(shard_map) of ``fn`` over the contexts' mesh; ``traced``: for a call inside another
    transformation (``vmap`` adds axes that fixed input shardings would not have)."""
    key = ("spmd", fn, batch.treedef, batch.axes, _hashable(out_axes), targets.devices, where, traced)

    def build():
        body = _checked(fn, batch.treedef, batch.axes, out_axes, len(targets.devices), where)
        mapped = jax.shard_map(
            body,
            mesh=mesh(targets.devices),
            in_specs=tuple(spec(ax) for ax in batch.axes),
            out_specs=_out_specs(out_axes, AXIS),
            check_vma=False,
        )
        if traced:
            return jax.jit(mapped)
        return jax.jit(mapped, in_shardings=tuple(sharding(targets.devices, AXIS, ax) for ax in batch.axes))

    return programs.get(key, build)


def _dispatch_program(fn: Callable, batch: Batch, out_axes: Any, k: int, where: str) -> Callable:
    key = ("dispatch", fn, batch.treedef, batch.axes, _hashable(out_axes), k, where)
    return programs.get(key, lambda: jax.jit(_checked(fn, batch.treedef, batch.axes, out_axes, k, where)))


def _hashable(axes: Any) -> Any:
    if axes is None or isinstance(axes, int):
        return axes
    leaves, treedef = jax.tree_util.tree_flatten(axes, is_leaf=lambda x: x is None)
    return (treedef, tuple(leaves))


# -- running -------------------------------------------------------------------------------


def run_spmd(fn, batch, targets, sizes, out_axes, to, where) -> Any:
    """One SPMD program over the contexts' mesh; parts padded to equal size and trimmed."""
    placed = place_spmd(batch, targets, sizes)
    traced = is_abstract(batch.leaves)
    program = _spmd_program(fn, batch, out_axes, targets, where, traced)
    start, t0 = time.time(), time.perf_counter()
    out = explained(program, *placed)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out)
    if not traced:
        record_run(targets, sizes, fn, "spmd", start, batch.n, out_leaves, t0)
    padded = len(set(sizes)) > 1
    if not padded and to is None:
        return out
    axes = leaf_axes(out_axes, out, "out_axes", where)
    dest = targets.contexts[0] if to is None else _contexts.resolve(to, where)
    gathered = place(out_leaves, dest, "gather", {"from": "+".join(targets.names)})
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
    program = _dispatch_program(fn, batch, out_axes, len(targets.names), where)
    active = [i for i, size in enumerate(sizes) if size] or [0]
    outs, ran = [], []
    split_idx = [j for j, ax in enumerate(batch.axes) if ax is not None]
    shared_idx = [j for j, ax in enumerate(batch.axes) if ax is None]
    for i in active:
        ctx, size = targets.contexts[i], sizes[i]
        start = sum(sizes[:i])
        cut = [_slice(batch.leaves[j], start, size, batch.axes[j]) for j in split_idx]
        info = {"rows": size, "of": batch.n}
        leaves = list(batch.leaves)
        for j, v in zip(split_idx, place(cut, ctx, "split", info), strict=True):
            leaves[j] = v
        shared = place([batch.leaves[j] for j in shared_idx], ctx, "replicate")
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
    moved = [place(leaves, dest, "gather") for leaves in flat]
    join = np.concatenate if dest.device is None else jnp.concatenate
    result = [
        m0 if ax is None else join([m[j] for m in moved], axis=ax)
        for j, (m0, ax) in enumerate(zip(moved[0], axes, strict=True))
    ]
    return jax.tree_util.tree_unflatten(first[1], result)


class _Plan(NamedTuple):
    """What a call of ``parallel`` does again for inputs laid out like a call before: host arrays
    split evenly over distinct devices of one kind (copied, placed, recorded) and one program.
    Everything ``describe``, ``place_spmd`` and the program cache work out is kept, so the next
    such call only copies, places, runs and records (``run``)."""

    targets: Targets
    copies: tuple[int, ...]  # host leaves copied before they are placed (``private``)
    shardings: list  # one per leaf: every leaf is placed
    split: Layout  # the placement's events (``record``)
    runs: Layout  # the program's run events
    program: Callable
    at_once: bool  # the placement is complete when device_put returns (``lands_at_once``)

    def run(self, leaves: list) -> Any:
        t0, start = time.perf_counter(), time.time()
        placed = place_copied(leaves, self.shardings, self.copies)
        record(self.split, start, placed, t0, time.perf_counter() if self.at_once else None)
        start, t0 = time.time(), time.perf_counter()
        out = explained(self.program, *placed)
        record(self.runs, start, jax.tree_util.tree_leaves(out), t0)
        return out


_PLANS = Cache(256)  # (fn, axes, caller, structure, targets, leaf layout) -> _Plan
_HOT: weakref.WeakSet = weakref.WeakSet()  # the wrappers holding their last call's plan


def _forget_plans() -> None:
    for wrapper in list(_HOT):
        wrapper._hot = None
    _HOT.clear()


on_clear(_forget_plans)


def _none() -> None:
    return None


def _leaf_layout(leaves: list) -> tuple | None:
    """(shape, dtype) per leaf when every leaf is a host numpy array, else None (no plan)."""
    out = []
    for x in leaves:
        if type(x) is not np.ndarray:
            return None
        out.append((x.shape, x.dtype))
    return tuple(out)


def _plan(fn, batch, targets, sizes, out_axes, where) -> _Plan | None:
    """The plan for calls like this one (host arrays, an even SPMD split), else None."""
    if not (batch.n and targets.spmd and len(set(sizes)) == 1):
        return None
    cpu = targets.devices[0].platform == "cpu"
    copies = tuple(i for i, x in enumerate(batch.leaves) if needs_private(x, cpu))
    shardings = [sharding(targets.devices, AXIS, ax) for ax in batch.axes]
    split = spmd_layout([(x, ax) for x, ax in zip(batch.leaves, batch.axes, strict=True)], targets, sizes)
    runs = run_layout(targets, sizes, fn, "spmd", batch.n)
    program = _spmd_program(fn, batch, out_axes, targets, where)
    at_once = lands_at_once(targets.devices, sum(x.nbytes for x in batch.leaves))
    return _Plan(targets, copies, shardings, split, runs, program, at_once)


def run(fn, batch, targets, sizes, out_axes, to, where) -> Any:
    """Picks the execution path: SPMD when one program can span the contexts, else dispatch."""
    if batch.n and targets.spmd and max(sizes) - min(sizes) <= 1:
        return run_spmd(fn, batch, targets, sizes, out_axes, to, where)
    return run_dispatch(fn, batch, targets, sizes, out_axes, to, where)


# -- the public wrappers -------------------------------------------------------------------


def _argument_names(fn: Callable, tree: tuple) -> Callable[[int], str]:
    """Leaf index of ``(args, kwargs)`` -> "argument 'x'" (plus the path inside it)."""

    def name(i: int) -> str:
        path = jax.tree_util.tree_leaves_with_path(tree)[i][0]
        group, key, rest = path[0].idx, path[1], path[2:]
        if group == 1:
            arg = repr(key.key)
        else:
            try:
                params = list(inspect.signature(fn).parameters)
            except (TypeError, ValueError):
                params = []
            arg = repr(params[key.idx]) if key.idx < len(params) else f"at position {key.idx}"
        inner = jax.tree_util.keystr(tuple(rest))
        return f"argument {arg}" + (f", leaf {inner}" if inner else "")

    return name


def _check_axes(axes: Any, what: str, fn: str) -> None:
    leaves = jax.tree_util.tree_leaves(axes, is_leaf=lambda x: x is None)
    for ax in leaves:
        if ax is not None and (isinstance(ax, bool) or not isinstance(ax, int)):
            raise TypeError(
                f"{fn}: {what}={axes!r} contains {ax!r} ({type(ax).__name__}); each entry must be an "
                f"int axis or None (shared on every context)"
            )


class Parallel:
    """``fn`` split across contexts: call it like ``fn``; see :func:`parallel`."""

    def __init__(self, fn, contexts=None, in_axes=0, out_axes=0, weights=None, balance=None, to=None):
        if not callable(fn):
            raise TypeError(f"parallel: fn must be callable, got {type(fn).__name__} {fn!r}")
        if not (in_axes is None or isinstance(in_axes, int | tuple | list)) or isinstance(in_axes, bool):
            raise TypeError(
                f"parallel: in_axes={in_axes!r}; give an int, None, or a tuple with one entry per "
                f"positional argument (e.g. in_axes=(None, 0) for shared parameters and a batch)"
            )
        _check_axes(in_axes, "in_axes", "parallel")
        _check_axes(out_axes, "out_axes", "parallel")
        if balance not in (None, "measured"):
            raise ValueError(
                f"parallel: balance={balance!r}; use None (even or weighted split) or 'measured'"
            )
        if balance is not None and weights is not None:
            raise ValueError("parallel: give weights= or balance='measured', not both")
        self.fn, self.contexts, self.in_axes, self.out_axes = fn, contexts, in_axes, out_axes
        self.weights, self.balance, self.to = weights, balance, to
        self._speeds: dict = {}
        self._layouts: dict = {}  # tree structure of (args, kwargs) -> one axis per leaf
        self._key = (_hashable(in_axes), _hashable(out_axes))  # with fn, what its plans depend on
        self._last: tuple | None = None  # (context map, caller, contexts, targets) of the last call
        self._hot: tuple | None = None  # (context map, caller, structure, leaf layout, plan)
        functools.update_wrapper(self, fn)

    def _targets(self, where: str) -> Targets:
        """``resolve(self.contexts, where)``, kept while the context map is the same one."""
        cmap = _contexts.context_map()
        last = self._last
        if last is not None and last[0] is cmap and last[1] == where and last[2] is self.contexts:
            return last[3]
        targets = resolve(self.contexts, where)
        self._last = (cmap, where, self.contexts, targets)
        return targets

    def _batch(self, args: tuple, kwargs: dict, where: str) -> tuple[Batch, Targets]:
        targets = resolve(self.contexts, where)
        tree = (args, kwargs)
        names = _argument_names(self.fn, tree)
        leaves, treedef = leaves_of(tree, where, names)
        per_leaf = self._layouts.get(treedef)
        if per_leaf is None:  # the axes depend only on the structure: worked out once per structure
            per_leaf = self._leaf_axes(args, kwargs, where)
            if len(self._layouts) < 64:
                self._layouts[treedef] = per_leaf
        return describe(leaves, treedef, per_leaf, targets, where, names), targets

    def _leaf_axes(self, args: tuple, kwargs: dict, where: str) -> tuple:
        in_axes = self.in_axes
        if isinstance(in_axes, tuple | list):
            if len(in_axes) != len(args):
                raise ValueError(
                    f"{where}: in_axes={tuple(in_axes)!r} has {len(in_axes)} entries, but "
                    f"{fn_name(self.fn)} was called with {len(args)} positional argument(s); give one "
                    f"entry per positional argument"
                )
            axes = tuple(in_axes)
        else:
            axes = (in_axes,) * len(args)
        return tuple(leaf_axes((axes, dict.fromkeys(kwargs, 0)), (args, kwargs), "in_axes", where))

    def __call__(self, *args, **kwargs):
        return self._call(args, kwargs, "parallel")

    def _call(self, args: tuple, kwargs: dict, where: str) -> Any:
        key = None
        if self.weights is None and self.balance is None and self.to is None:
            leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
            layout = _leaf_layout(leaves)
            if layout is not None:  # a call laid out like one before runs its plan (see _Plan)
                cmap, hot = _contexts.context_map(), self._hot
                if (
                    hot is not None
                    and hot[0] is cmap
                    and hot[1] == where
                    and hot[2] == treedef
                    and hot[3] == layout
                ):  # laid out like the last call: its plan, without the cache's key
                    return hot[4].run(leaves)
                key = (self.fn, self._key, where, treedef, self._targets(where), layout)
                plan = _PLANS.get(key, _none)
                if plan is not None:
                    self._hot = (cmap, where, treedef, layout, plan)
                    _HOT.add(self)
                    return plan.run(leaves)
        batch, targets = self._batch(args, kwargs, where)
        if self.balance == "measured":
            speeds = self._measure(batch, targets)
            weights = tuple(speeds[n] for n in targets.names)
        else:
            weights = check_weights(self.weights, targets, where)
        sizes = shares(batch.n, len(targets.names), weights)
        out = run(self.fn, batch, targets, sizes, self.out_axes, self.to, where)
        if key is not None and not is_abstract(batch.leaves):
            plan = _plan(self.fn, batch, targets, sizes, self.out_axes, where)
            if plan is not None:
                _PLANS.get(key, lambda: plan)
        return out

    def speeds(self, *args, **kwargs) -> dict[str, float]:
        """Rows per second of ``fn`` on each context, measured once per input shape (cached).

        Each context runs its even share of the batch alone (after a warm-up call that compiles),
        so the figures are comparable; ``balance='measured'`` splits by them.
        """
        batch, targets = self._batch(args, kwargs, "parallel")
        return self._measure(batch, targets)

    def _measure(self, batch: Batch, targets: Targets) -> dict[str, float]:
        shapes = tuple((np.shape(x), _dtype(x)) for x in batch.leaves)
        key = (targets.names, targets.devices, batch.treedef, batch.axes, shapes)
        if key in self._speeds:
            return self._speeds[key]
        if is_abstract(batch.leaves):
            raise TypeError("parallel: balance='measured' times real calls; call it outside jax.jit first")
        sizes = shares(batch.n, len(targets.names))
        speeds = {}
        for i, (name, size) in enumerate(zip(targets.names, sizes, strict=True)):
            one = targets.only(i)
            start = sum(sizes[:i])
            cut = [
                x if ax is None else _slice(x, start, size, ax)
                for x, ax in zip(batch.leaves, batch.axes, strict=True)
            ]
            part = batch._replace(leaves=cut, n=size)
            seconds = []
            for _ in range(3):  # compile, then two timed calls; keep the faster
                t0 = time.perf_counter()
                jax.block_until_ready(
                    run_dispatch(self.fn, part, one, (size,), self.out_axes, None, "parallel")
                )
                seconds.append(time.perf_counter() - t0)
            speeds[name] = max(size, 1) / max(min(seconds[1:]), 1e-9)
        self._speeds[key] = speeds
        return speeds

    def __repr__(self) -> str:
        return (
            f"mg.parallel({fn_name(self.fn)}, contexts={self.contexts!r}, in_axes={self.in_axes!r}, "
            f"out_axes={self.out_axes!r}, weights={self.weights!r}, balance={self.balance!r})"
        )


def parallel(
    fn: Callable | None = None,
    contexts: Any = None,
    in_axes: Any = 0,
    out_axes: Any = 0,
    weights: Any = None,
    balance: str | None = None,
    to: Any = None,
) -> Any:
    """Wraps ``fn`` so each call splits its batch across contexts and concatenates the outputs.

    ``f = mg.parallel(fn)`` then ``f(*args)`` equals ``fn(*args)`` for a function whose outputs
    have one row per input row, with part i computed on context i. Distinct devices of one kind
    run one SPMD program; contexts that share a device or mix kinds run one program each,
    dispatched together. Gradients flow through, each part's backward pass on its own device.

    Args:
      fn: the function; may be omitted to use ``@mg.parallel(in_axes=...)`` as a decorator.
      contexts: context names, a count (the first n) or None for every context in the map.
      in_axes: per positional argument, the axis to split or None for a value shared by every
        context (parameters); an int applies to all. Keyword arguments are split along axis 0.
      out_axes: the axis along which outputs are concatenated (None: the same on every context).
      weights: relative share of the batch per context (largest-remainder rounding).
      balance: ``"measured"`` times ``fn`` on each context once per input shape and splits by speed.
      to: where the result goes. None leaves it where it was computed when JAX can hold it there
        (an even split over distinct same-kind devices: one array sharded over the contexts),
        else on the first context; ``"cpu"`` returns host numpy.

    >>> import mgkit as mg, numpy as np, jax.numpy as jnp
    >>> _ = mg.use_contexts("a->cpu0;b->cpu1;c->cpu2", verbose=False)
    >>> f = mg.parallel(lambda w, x: x @ w, in_axes=(None, 0))
    >>> f(jnp.ones((2, 1)), np.ones((5, 2))).ravel().tolist()
    [2.0, 2.0, 2.0, 2.0, 2.0]
    """
    if fn is None:
        return functools.partial(
            parallel,
            contexts=contexts,
            in_axes=in_axes,
            out_axes=out_axes,
            weights=weights,
            balance=balance,
            to=to,
        )
    return Parallel(fn, contexts, in_axes, out_axes, weights, balance, to)


def make_parallel(fn: Callable, contexts: Any = None, **kwargs: Any) -> Any:
    """TensorFlow's ``make_parallel``: every keyword argument is split along axis 0, ``fn`` runs on
    each context with its parts, and the outputs are concatenated along axis 0.

    Any batch size works, including sizes that do not divide by the number of contexts.

    >>> import mgkit as mg, numpy as np
    >>> _ = mg.use_contexts("a->cpu0;b->cpu1", verbose=False)
    >>> c = mg.make_parallel(lambda a, b: a + b, a=np.ones(5), b=np.arange(5.0))
    >>> c.tolist()
    [1.0, 2.0, 3.0, 4.0, 5.0]
    """
    if not callable(fn):
        raise TypeError(f"make_parallel: fn must be callable, got {type(fn).__name__} {fn!r}")
    if not kwargs:
        raise TypeError(
            "make_parallel: no keyword arguments to split; pass the batches by name, "
            "e.g. mg.make_parallel(model, x=x, y=y)"
        )
    try:
        wrapper = _MAKE.get((fn, contexts), lambda: Parallel(fn, contexts))
    except TypeError:  # unhashable contexts (a list): no reuse
        wrapper = Parallel(fn, contexts)
    return wrapper._call((), kwargs, "make_parallel")


def pmap(
    fn: Callable, axis_name: str = "i", contexts: Any = None, in_axes: Any = 0, out_axes: Any = 0
) -> Callable:
    """``jax.pmap``'s semantics on ``jax.shard_map``: one slice of the mapped axis per context.

    ``fn`` sees one slice (the mapped axis removed) and may use collectives over ``axis_name``
    (``jax.lax.psum``, ``pmean``, ``all_gather``, ``ppermute``, ``axis_index``...), with
    ``jax.pmap``'s results: as in ``jax.pmap``, values are not tracked as varying or invariant
    over the axis (a ``lax.scan`` carry may start as ``0`` and add ``axis_index``), and ``psum``
    of a value shared with ``in_axes=None`` sums one copy per context. Outputs are stacked along
    ``out_axes``, one slice per context, sharded over the contexts; ``out_axes=None`` returns a
    value that is the same on every context (e.g. after ``psum``). The contexts must be distinct
    devices of one kind, as for pmap.

    The mapped function works inside ``jax.jit``, ``jax.grad`` and ``jax.vmap`` (``vmap`` maps
    over another axis of the arguments; each call still takes one slice per context).

    >>> import mgkit as mg, numpy as np, jax
    >>> _ = mg.use_contexts("a->cpu0;b->cpu1", verbose=False)
    >>> total = mg.pmap(lambda v: jax.lax.psum(v, "i"), out_axes=None)(np.array([1.0, 2.0]))
    >>> float(total)
    3.0
    """
    if not callable(fn):
        raise TypeError(f"pmap: fn must be callable, got {type(fn).__name__} {fn!r}")
    if not isinstance(axis_name, str) or not axis_name:
        raise TypeError(f"pmap: axis_name must be a non-empty str such as 'i', got {axis_name!r}")
    _check_axes(in_axes, "in_axes", "pmap")
    _check_axes(out_axes, "out_axes", "pmap")
    wrapper = Parallel(fn, contexts, in_axes, out_axes)

    @functools.wraps(fn)
    def mapped(*args, **kwargs):
        batch, targets = wrapper._batch(args, kwargs, "pmap")
        k = len(targets.names)
        if not targets.spmd:
            kinds = ", ".join(f"{c.name}->{c.short}" for c in targets.contexts)
            raise ValueError(
                f"pmap: its contexts must be distinct devices of one kind, but {kinds} share a device or "
                "mix kinds; choose such contexts with contexts=[...], or use mg.parallel, which runs on "
                "any contexts"
            )
        if batch.n != k:
            i = next(j for j, ax in enumerate(batch.axes) if ax is not None)
            raise ValueError(
                f"pmap: {batch.names(i)} has {batch.n} slices along axis {batch.axes[i]} (shape "
                f"{tuple(np.shape(batch.leaves[i]))}), but there are {targets.describe()}; pmap takes "
                f"exactly one slice per context (use mg.parallel to split a batch of any size)"
            )
        placed = place_spmd(batch, targets, (1,) * k, axis_name)
        traced = is_abstract(batch.leaves)
        program = programs.get(
            ("pmap", fn, axis_name, batch.treedef, batch.axes, _hashable(out_axes), targets.devices, traced),
            lambda: _pmap_program(fn, batch, out_axes, targets, axis_name, traced),
        )
        start, t0 = time.time(), time.perf_counter()
        try:
            out = explained(program, *placed)
        except (AssertionError, NameError) as e:
            better = _unbound_axis(fn, batch, axis_name)
            if better is None:
                raise
            raise better from e
        if not traced:
            if targets.devices[0].platform == "cpu" and k > 1:
                jax.block_until_ready(out)  # two CPU collective programs in flight can deadlock
            record_run(targets, (1,) * k, fn, "pmap", start, k, out, t0)
        return out

    return mapped


_UNBOUND = re.compile(r"unbound axis name: ([^\s.]+)")


def _unbound_axis(fn: Callable, batch: Batch, axis_name: str) -> ValueError | None:
    """The error for a function whose collectives name an axis other than ``axis_name`` (JAX's
    own is an empty AssertionError from inside shard_map), else None. ``jax.vmap`` binds only
    ``axis_name`` and names the first other axis the function uses."""

    def flat(*leaves):
        args, kwargs = jax.tree_util.tree_unflatten(batch.treedef, leaves)
        return fn(*args, **kwargs)

    shapes = [jax.ShapeDtypeStruct(np.shape(x), _dtype(x)) for x in batch.leaves]
    try:
        jax.eval_shape(jax.vmap(flat, in_axes=batch.axes, axis_name=axis_name), *shapes)
    except NameError as e:
        found = _UNBOUND.search(str(e))
        if found is None:
            return None
        used = found.group(1)
        return ValueError(
            f"pmap: axis_name={axis_name!r} was given, but {fn_name(fn)} uses a collective over the axis "
            f"{used!r}, which is not bound; pass axis_name={used!r} to mg.pmap, or name {axis_name!r} in "
            f"{fn_name(fn)}'s collectives (e.g. jax.lax.psum(x, {axis_name!r}))"
        )
    except Exception:  # noqa: BLE001 - the diagnosis failed another way: keep JAX's error
        return None
    return None


def _pmap_program(
    fn: Callable, batch: Batch, out_axes: Any, targets: Targets, axis_name: str, traced: bool
) -> Callable:
    """jit(shard_map) of ``fn`` over one slice per device; ``traced``: for a call inside another
    transformation (``vmap`` adds axes that fixed input shardings would not have)."""

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


def run_each(tasks: Mapping[str, Any]) -> dict[str, Any]:
    """Runs one function per context, dispatching every context before waiting for any
    (Theano's two dot products on two GPUs in one call).

    Args:
      tasks: context -> ``fn``, ``(fn, args)`` or ``(fn, args, kwargs)``. Arguments not yet on
        that context are moved there (and recorded); ``fn`` runs inside ``mg.on(context)``.

    Returns:
      {context: result}, every result complete.

    >>> import mgkit as mg, numpy as np, jax.numpy as jnp
    >>> _ = mg.use_contexts("a->cpu0;b->cpu1", verbose=False)
    >>> r = mg.run_each({"a": (jnp.dot, (np.ones(3), np.ones(3))), "b": (jnp.sum, (np.ones(4),))})
    >>> {k: float(v) for k, v in r.items()}, mg.where(r["b"])
    ({'a': 3.0, 'b': 4.0}, 'b')
    """
    if not isinstance(tasks, Mapping):
        raise TypeError(
            f"run_each: tasks must be a dict context -> (fn, args), got {type(tasks).__name__}; "
            "e.g. mg.run_each({'dev0': (jnp.dot, (a0, b0)), 'dev1': (jnp.dot, (a1, b1))})"
        )
    if not tasks:
        raise ValueError("run_each: no tasks; pass {context: (fn, args), ...}")
    plan = []
    for ctx, task in tasks.items():
        fn, args, kwargs = _task(ctx, task)
        dest = _contexts.resolve(ctx, "run_each")
        if dest.device is None:
            raise ContextError(
                f"run_each: {ctx!r} is host memory, not a device context; name a context such as 'dev0'"
            )
        plan.append((ctx, dest, fn, args, kwargs))
    label = execution_label()
    running = []
    for ctx, dest, fn, args, kwargs in plan:
        leaves, treedef = leaves_of((args, kwargs), "run_each")
        args, kwargs = jax.tree_util.tree_unflatten(treedef, place(leaves, dest, "transfer"))
        start, t0 = time.time(), time.perf_counter()
        try:
            with _contexts.on(dest.name if isinstance(ctx, str) else dest.device):
                out = fn(*args, **kwargs)
        except Exception as e:
            e.add_note(f"mgkit: raised by run_each's function for context {dest.name!r} ({dest.short})")
            raise
        running.append((ctx, dest, fn, out, start, t0))
    results = {}
    for ctx, dest, fn, out, start, t0 in running:
        out = jax.block_until_ready(out)
        info = {"fn": fn_name(fn), "path": "run_each"}
        seconds = time.perf_counter() - t0
        head = ("run", dest.name, dest.name, dest.short, dest.short, 0)
        ledger().record(Event(*head, start, seconds, label, info))
        results[ctx] = out
    return results


def _task(ctx: Any, task: Any) -> tuple[Callable, tuple, dict]:
    if callable(task):
        return task, (), {}
    if isinstance(task, tuple) and 1 <= len(task) <= 3 and callable(task[0]):
        fn, args, kwargs = task[0], task[1] if len(task) > 1 else (), task[2] if len(task) > 2 else {}
        if not isinstance(args, tuple | list):
            raise TypeError(
                f"run_each: the arguments for context {ctx!r} must be a tuple, got {type(args).__name__}; "
                f"write ({fn_name(fn)}, (x,)) for one argument"
            )
        if not isinstance(kwargs, Mapping):
            raise TypeError(f"run_each: the keyword arguments for context {ctx!r} must be a dict")
        return fn, tuple(args), dict(kwargs)
    raise TypeError(
        f"run_each: the task for context {ctx!r} is {type(task).__name__} {task!r}; give fn, (fn, args) "
        "or (fn, args, kwargs) with a callable fn"
    )
