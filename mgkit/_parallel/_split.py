"""``mg.split`` and ``mg.concat``: a batch cut into one part per context, and parts gathered
onto one context."""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _contexts
from .._ledger import Kind
from .._spmd import dtype_of, resolve, shares
from .._transfer import leaves_of, place
from ._batch import check_weights, describe, slice_rows, tree_leaf_name


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
    names = functools.partial(tree_leaf_name, tree)
    leaves, treedef = leaves_of(tree, "split", names)
    batch = describe(leaves, treedef, (axis,) * len(leaves), targets, "split", names)
    sizes = shares(batch.n, len(targets.names), check_weights(weights, targets, "split"))
    parts: dict[str, Any] = {}
    start = 0
    for ctx, size in zip(targets.contexts, sizes, strict=True):
        cut = [slice_rows(leaf, start, size, ax) for leaf, ax in zip(batch.leaves, batch.axes, strict=True)]
        info = {"rows": size, "of": batch.n, "axis": axis}
        parts[ctx.name] = jax.tree_util.tree_unflatten(batch.treedef, place(cut, ctx, Kind.SPLIT, info))
        start += size
    return parts


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
        _check_column(column, labels, axis, lambda j=j: tree_leaf_name(trees[0], j))
    moved = [place(leaves, dest, Kind.CONCAT, {"axis": axis}) for leaves, _ in flat]
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
    ref_dtype = dtype_of(column[0])
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
        if dtype_of(leaf) != ref_dtype:
            raise TypeError(
                f"concat: {leaf_name()} of {label} has dtype {dtype_of(leaf)}, but {labels[0]} "
                f"has {ref_dtype}; cast the parts to one dtype first"
            )
