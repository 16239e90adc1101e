"""A model's own sharding annotations, and logical axis rules.

A Flax NNX model built with ``nnx.with_partitioning(init, ("embed", "mlp"))`` (or
``nnx.Param(..., sharding_names=...)``) carries the layout of each parameter as metadata on its
``nnx.Variable``: one name per array axis, either a mesh axis (``"model"``) or a logical name
(``"embed"``) that logical axis rules map to mesh axes, as Flax's own
``nnx.logical_axis_rules(...)`` do. Linen's boxed ``nn.Partitioned`` parameters carry the same.
``annotations`` reads them, one ``Leaf`` per array leaf, without importing Flax (a model of Flax
exists only where Flax is imported); ``mesh_names`` maps one leaf's names to mesh axes.

Rules are Flax's ``LogicalRules``: pairs ``(logical name, mesh axis, None or a tuple of mesh
axes)``, in order of precedence: each array axis takes the first rule for its name whose mesh
axes the leaf does not use yet (as Flax Linen's ``logical_to_mesh_axes``); a name with no rule
that is a mesh axis is used directly; any other name is an error.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

_NAMES = ("out_sharding", "sharding_names", "sharding")  # the metadata key, newest Flax first


class Leaf(NamedTuple):
    """A parameter as ``shard=`` rule functions see it: ``fn(path, leaf)``."""

    shape: tuple[int, ...]  # its shape
    dtype: np.dtype  # its dtype
    names: tuple | None  # its annotation: a name (or None) per array axis; None: not annotated
    rules: tuple  # its own logical axis rules (``sharding_rules``): (name, tuple of mesh axes) pairs
    metadata: Mapping  # its variable's metadata as the library keeps it ({}: a plain array)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _boxes() -> tuple[type, ...]:
    """The classes that carry annotations, of the Flax modules imported so far."""
    found = []
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(getattr(nnx, "Variable", None), type):
        found.append(nnx.Variable)
    meta = sys.modules.get("flax.core.meta")
    if meta is not None and isinstance(getattr(meta, "Partitioned", None), type):
        found.append(meta.Partitioned)
    return tuple(found)


def _read(box: Any) -> tuple[tuple | None, tuple, dict]:
    """(names, rules, metadata) of one annotated variable (NNX) or boxed parameter (Linen)."""
    if hasattr(box, "get_metadata"):  # an nnx.Variable
        metadata = dict(box.get_metadata())
        names = next((metadata[k] for k in _NAMES if metadata.get(k)), None)
        rules = metadata.get("sharding_rules") or ()
    else:  # Linen's Partitioned / LogicallyPartitioned
        names, rules = box.names, getattr(box, "rules", None) or ()
        metadata = {"names": names, "rules": rules, "mesh": getattr(box, "mesh", None)}
    names = getattr(names, "spec", names)  # a NamedSharding (the miniGPT tutorial's way): its spec
    if names is not None and not isinstance(names, str):
        names = tuple(names)  # a PartitionSpec or a list: a tuple of per-axis entries
    own = tuple((name, _axes(to)) for name, to in rules if isinstance(name, str) and _axes(to) is not None)
    return names, own, metadata


def _axes(to: Any) -> tuple | None:
    """A rule's mesh axes as a tuple (``()`` for None), or None where they are not mesh axis names."""
    to = () if to is None else (to,) if isinstance(to, str) else to
    ok = isinstance(to, list | tuple) and all(isinstance(a, str) for a in to)
    return tuple(to) if ok else None


def annotations(tree: Any) -> list[Leaf]:
    """A ``Leaf`` per array leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``), in
    ``jax.tree_util`` leaf order, with the annotation its Flax variable carries (if any)."""
    boxes = _boxes()
    out = []
    for node in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: bool(boxes) and isinstance(x, boxes)):
        if boxes and isinstance(node, boxes):
            names, rules, metadata = _read(node)
            arrays = jax.tree_util.tree_leaves(node)
        else:
            names, rules, metadata, arrays = None, (), {}, [node]
        out.extend(Leaf(tuple(np.shape(x)), np.dtype(x.dtype), names, rules, metadata) for x in arrays)
    return out


def is_rules(shard: Any) -> bool:
    """Whether ``shard=`` is a sequence of logical axis rules (pairs), as Flax writes them."""
    return isinstance(shard, list | tuple) and all(
        isinstance(rule, list | tuple) and len(rule) == 2 for rule in shard
    )


def check_rules(rules: Sequence, where: str, what: str = "shard") -> tuple:
    """Logical axis rules as a tuple of (name, tuple of mesh axes); a bad pair is named."""
    out = []
    for rule in rules:
        name, to = rule[0], _axes(rule[1])
        if not isinstance(name, str) or to is None:
            raise TypeError(
                f"{where}: {what} rule {tuple(rule)!r} is not a logical axis rule; each is a pair "
                "(logical name, mesh axis, None or a tuple of mesh axes), as Flax's logical axis rules "
                "are, e.g. (('embed', None), ('mlp', 'model'))"
            )
        out.append((name, to))
    return tuple(out)


class AnnotationWarning(UserWarning):
    """A model's sharding annotation that cannot be followed (more names than the leaf has
    axes): the leaf is replicated."""


def fits(leaf: Leaf) -> bool:
    """Whether ``leaf``'s annotation names at most one entry per array axis (surplus entries
    that are None aside): JAX refuses a longer PartitionSpec."""
    names = leaf.names
    if names is None:
        return True
    return not isinstance(names, str) and not any(n is not None for n in names[len(leaf.shape) :])


def warn_misfits(paths: list[str], leaves: list[Leaf], where: str) -> None:
    """One ``AnnotationWarning`` naming the leaves whose annotations do not fit their shapes."""
    bad = [
        f"{p!r} {leaf.shape} annotated {leaf.names!r}"
        for p, leaf in zip(paths, leaves, strict=True)
        if not fits(leaf)
    ]
    if bad:
        shown = "; ".join(bad[:4]) + (f"; and {len(bad) - 4} more" if len(bad) > 4 else "")
        warnings.warn(
            f"{where}: {len(bad)} annotation(s) name more axes than their leaf has, which JAX cannot "
            f"follow, so those leaves are replicated: {shown}. Give one name (or None) per axis",
            AnnotationWarning,
            stacklevel=4,
        )


def mesh_names(path: str, leaf: Leaf, rules: tuple, axes: Mapping[str, int], where: str) -> tuple:
    """``leaf``'s annotation with each name mapped to mesh axes: per array axis None or a tuple
    of mesh axis names (``rules``, then the leaf's own, in order of precedence). An annotation
    that does not fit the leaf (``fits``) replicates it."""
    if not fits(leaf):
        return (None,) * len(leaf.shape)
    names = leaf.names[: len(leaf.shape)]
    entries = [() if n is None else (n,) if isinstance(n, str) else tuple(n) for n in names]
    entries = [tuple(n for n in e if isinstance(n, str)) for e in entries]  # P.UNCONSTRAINED: whole
    mapped: dict[int, tuple] = {}  # array axis -> the mesh axes a rule gave it
    for name, to in rules + leaf.rules:
        used = {a for got in mapped.values() for a in got}
        for i, entry in enumerate(entries):
            if entry == (name,) and i not in mapped and not used & set(to):
                mapped[i] = to
    for i, entry in enumerate(entries):
        unknown = [n for n in entry if n not in axes]
        if i not in mapped and unknown:
            raise ValueError(
                f"{where}: the annotation {names!r} of {path!r} names {unknown[0]!r}, which is not a mesh "
                f"axis (axes: {list(axes)}) and no rule maps; give logical axis rules, e.g. "
                f"shard=(({unknown[0]!r}, {list(axes)[-1]!r}),) to split it, or (({unknown[0]!r}, None),) "
                "to keep it whole"
            )
    spec = [mapped.get(i, entry) or None for i, entry in enumerate(entries)]
    return tuple(spec + [None] * (len(leaf.shape) - len(spec)))
