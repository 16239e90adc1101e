"""The batch of a call: which leaves are split across the contexts (and along which axis), how
many rows each context gets, and the messages for a batch that cannot be split."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .._numbers import real
from .._spmd import Batch, Cache, Targets, fn_name, per_context, resolve
from .._static import held, is_static
from .._transfer import leaves_of

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


_AXES = Cache(1024)  # (tree structure, axes) -> one axis per leaf


def leaf_axes(axes: Any, tree: Any, what: str, fn: str) -> list:
    """One axis (int or None) per leaf of ``tree``, from an int, None or a pytree prefix."""
    if axes is None or (isinstance(axes, int) and not isinstance(axes, bool)):
        return [axes] * len(jax.tree_util.tree_leaves(tree))
    key = (jax.tree_util.tree_structure(tree), hashable(axes))
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


def hashable(axes: Any) -> Any:
    """``axes`` (an int, None or a pytree of them) as a cache key."""
    if axes is None or isinstance(axes, int):
        return axes
    leaves, treedef = jax.tree_util.tree_flatten(axes, is_leaf=lambda x: x is None)
    return (treedef, tuple(leaves))


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


def slice_rows(leaf: Any, start: int, size: int, axis: int) -> Any:
    """Rows ``start`` to ``start + size`` of ``leaf`` along ``axis``."""
    if isinstance(leaf, np.ndarray | np.generic):
        return leaf[(slice(None),) * axis + (slice(start, start + size),)]
    return jax.lax.slice_in_dim(leaf, start, start + size, axis=axis)


def tree_leaf_name(tree: Any, i: int) -> str:
    """How messages name the i-th leaf of ``tree``."""
    paths = jax.tree_util.tree_leaves_with_path(tree)
    where = jax.tree_util.keystr(paths[i][0])
    return f"leaf {where}" if where else "the array"


def argument_names(fn: Callable, tree: tuple) -> Callable[[int], str]:
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


def check_in_axes(in_axes: Any, fn: str) -> None:
    """Checks ``in_axes``: an int, None, or one entry per positional argument."""
    if not (in_axes is None or isinstance(in_axes, int | tuple | list)) or isinstance(in_axes, bool):
        raise TypeError(
            f"{fn}: in_axes={in_axes!r}; give an int, None, or a tuple with one entry per "
            f"positional argument (e.g. in_axes=(None, 0) for shared parameters and a batch)"
        )
    check_axes(in_axes, "in_axes", fn)


def check_axes(axes: Any, what: str, fn: str) -> None:
    """Checks that every entry of ``axes`` is an int or None."""
    leaves = jax.tree_util.tree_leaves(axes, is_leaf=lambda x: x is None)
    for ax in leaves:
        if ax is not None and (isinstance(ax, bool) or not isinstance(ax, int)):
            raise TypeError(
                f"{fn}: {what}={axes!r} contains {ax!r} ({type(ax).__name__}); each entry must be an "
                f"int axis or None (shared on every context)"
            )


def call_batch(
    fn: Callable, contexts: Any, in_axes: Any, args: tuple, kwargs: dict, where: str, memo: dict
) -> tuple[Batch, Targets]:
    """The batch of the call ``fn(*args, **kwargs)`` split per ``in_axes`` (keyword arguments
    along axis 0) across ``contexts``, and those contexts. ``memo``: the caller's own
    {tree structure: one axis per leaf}, filled here (the axes depend only on the structure)."""
    targets = resolve(contexts, where)
    tree = (args, kwargs)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    per_leaf = memo.get(treedef)
    if per_leaf is None:
        per_leaf = _in_leaf_axes(fn, in_axes, args, kwargs, where)
        if len(memo) < 64:
            memo[treedef] = per_leaf
    if where != "make_parallel":  # (its every argument is split: the general message says it)
        _check_split_leaves(fn, tree, leaves, per_leaf, where)
    hold = [ax is None and is_static(x) for x, ax in zip(leaves, per_leaf, strict=True)]
    if any(hold):  # a shared model's functions and other objects ride in the structure
        tree = held(tree, hold)
        per_leaf = tuple(ax for ax, h in zip(per_leaf, hold, strict=True) if not h)
    names = argument_names(fn, tree)
    leaves, treedef = leaves_of(tree, where, names)
    return describe(leaves, treedef, per_leaf, targets, where, names), targets


def _check_split_leaves(fn: Callable, tree: tuple, leaves: list, per_leaf: Sequence, where: str) -> None:
    """A function, string or other object in an argument that is split: only arrays are."""
    for i, (x, ax) in enumerate(zip(leaves, per_leaf, strict=True)):
        if ax is not None and is_static(x):
            raise TypeError(
                f"{where}: {argument_names(fn, tree)(i)} is a {type(x).__name__} ({x!r:.40}) in an "
                f"argument split along axis {ax}, but only arrays are split across contexts. A model "
                "that holds functions or other objects (an Equinox module) is shared on every context: "
                "mark its argument in_axes=None (e.g. in_axes=(None, 0)); keep other objects out of "
                "the batch"
            )


def _in_leaf_axes(fn: Callable, in_axes: Any, args: tuple, kwargs: dict, where: str) -> tuple:
    if isinstance(in_axes, tuple | list):
        if len(in_axes) != len(args):
            raise ValueError(
                f"{where}: in_axes={tuple(in_axes)!r} has {len(in_axes)} entries, but "
                f"{fn_name(fn)} was called with {len(args)} positional argument(s); give one "
                f"entry per positional argument"
            )
        axes = tuple(in_axes)
    else:
        axes = (in_axes,) * len(args)
    return tuple(leaf_axes((axes, dict.fromkeys(kwargs, 0)), (args, kwargs), "in_axes", where))
