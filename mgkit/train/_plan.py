"""What each parameter of a trainer's state gets from ``shard=`` and ``mesh=``, worked out from
shapes alone (no devices): one ``LeafLayout`` per leaf in a ``Plan``. ``_shard.Placement`` lays a
plan on the devices.

============  ====================================================================================
``shard=``    what each parameter gets
============  ====================================================================================
None          the default: ``annotations`` for a model that carries them given ``mesh=``, else
              ``replicate``
replicate     a whole copy on every context
annotations   as the model's own annotations say (``nnx.with_partitioning``: ``_annotations``),
              each name a mesh axis; leaves without one replicated
((name, ax),  logical axis rules, as Flax writes them: the annotations with each logical name
 ...)         mapped to mesh axes by the first rule for it (``(("embed", None), ("mlp", "model"))``)
fsdp          leaves of at least ``FSDP_MIN_SIZE`` elements split along one axis over every
              context: the largest axis that divides by the contexts, else the largest (padded)
{regex: ax}   the first rule whose regex matches the leaf's path (``"dense/kernel"``): an axis
              (int), None (replicated), or with ``mesh=`` a mesh axis name per array axis
              (``(None, "model")``); leaves no rule matches follow fsdp
function      ``fn(path, leaf) -> axis, None or per-axis names``; ``leaf`` (``_annotations.Leaf``)
              has shape, dtype, ndim, size, its annotation ``names`` and its variable's ``metadata``
============  ====================================================================================
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .._spmd import AXIS, Targets
from ._annotations import Leaf, annotations, check_rules, is_rules, mesh_names, warn_misfits

FSDP_MIN_SIZE = 1024
"""Leaves with fewer elements than this are replicated by ``shard="fsdp"`` (biases, norms): their
share would be smaller than the bookkeeping of splitting them."""

SHARDS = ("replicate", "fsdp", "annotations")
_EXAMPLE = "shard='fsdp', shard={'dense/kernel': 1}, or shard=lambda path, leaf: 0"
_MAY_GIVE = (
    "a rule gives an array axis (int) to split over every context, None to replicate, or with mesh= "
    "one mesh axis name, None or a tuple of names per array axis, each mesh axis once, e.g. (None, 'model')"
)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How one parameter lies on the contexts. Not a pytree node: a tree of layouts has the
    parameters' structure with one layout per leaf."""

    path: str  # the leaf's path, keys joined by "/" ("dense/kernel", "layers/0/w")
    shape: tuple[int, ...]  # its shape
    dtype: Any  # its dtype
    spec: tuple  # per array axis: None, or the mesh axis names it is split over (a tuple)
    padded: tuple[int, ...]  # its stored shape: each split axis padded to a multiple of its parts

    @property
    def partition(self) -> P:
        """The PartitionSpec of ``spec``."""
        return P(*(None if not names else names[0] if len(names) == 1 else names for names in self.spec))

    def pad(self, x: jax.Array) -> jax.Array:
        """``x`` (of ``shape``) with zeros appended up to ``padded`` (already padded: as it is)."""
        if self.padded == self.shape or x.shape == self.padded:
            return x
        return jnp.pad(x, [(0, p - s) for s, p in zip(self.shape, self.padded, strict=True)])

    def unpad(self, x: jax.Array) -> jax.Array:
        """``x`` (of ``padded``) without its padding."""
        if self.padded == self.shape or x.shape == self.shape:
            return x
        return x[tuple(slice(0, s) for s in self.shape)]

    def share(self, axes: Mapping[str, int]) -> int:
        """The bytes of this leaf on each context (its stored shape over its parts)."""
        parts = math.prod(axes[name] for names in self.spec for name in names or ())
        return math.prod(self.padded) // parts * np.dtype(self.dtype).itemsize


class Plan(NamedTuple):
    """Every parameter's layout over a mesh of the given axis sizes (no devices needed)."""

    axes: dict[str, int]  # the mesh's axes and their sizes, in order ({"mgkit": 8})
    batch_axis: str  # the mesh axis the batch's rows are split over
    leaves: Any  # the parameters' tree with a LeafLayout per leaf
    shard: Any  # the shard= it was made from (for messages)

    @property
    def split(self) -> bool:
        """Whether any parameter is split (else every context holds the whole state)."""
        return any(any(s) for s in (lay.spec for lay in layouts(self.leaves)))

    @property
    def asked(self) -> bool:
        """Whether ``shard=`` or ``mesh=`` asked for more than replicating on one mesh axis."""
        return not (isinstance(self.shard, str) and self.shard == "replicate") or list(self.axes) != [AXIS]


def layouts(tree: Any) -> list[LeafLayout]:
    """The layouts of a tree of layouts, in leaf order."""
    return jax.tree_util.tree_leaves(tree)


def leaf_path(path: tuple) -> str:
    """A pytree path as rules see it: its keys joined by "/" (``{"dense": {"w": x}}`` -> "dense/w")."""
    names = []
    for key in path:
        for field in ("key", "name", "idx"):
            if hasattr(key, field):
                names.append(str(getattr(key, field)))
                break
        else:
            names.append(str(key))
    return "/".join(names)


def mesh_axes(mesh: Any, n: int, where: str) -> dict[str, int]:
    """``mesh=`` as {axis name: size} over ``n`` contexts (None: one axis over all of them)."""
    if mesh is None:
        return {AXIS: n}
    example = "mesh={'data': 2, 'model': 4}"
    if not isinstance(mesh, Mapping) or not mesh:
        raise TypeError(
            f"{where}: mesh must be a dict of axis names and sizes, e.g. {example}; got "
            f"{type(mesh).__name__} {mesh!r:.80}"
        )
    for name, size in mesh.items():
        if not isinstance(name, str) or isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"{where}: mesh entry {name!r}: {size!r}; each axis is a name and a size of at least 1, "
                f"e.g. {example}"
            )
    if math.prod(mesh.values()) != n:
        raise ValueError(
            f"{where}: mesh={dict(mesh)} arranges {math.prod(mesh.values())} contexts, but there are "
            f"{n}; the sizes must multiply to {n}, e.g. mesh={{'data': {n}, 'model': 1}}"
        )
    return dict(mesh)


def plan(shapes: Any, shard: Any, mesh: Any, n: int, where: str) -> Plan:
    """The layout of every parameter of ``shapes`` (arrays or ShapeDtypeStructs) over ``n``
    contexts, from ``shard=`` and ``mesh=`` (and the model's own annotations: ``_annotations``);
    errors name the leaf, the rule at fault and what a rule may give."""
    axes = mesh_axes(mesh, n, where)
    batch_axis = "data" if "data" in axes else next(iter(axes))
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    leaves = annotations(shapes)
    annotated = any(leaf.names is not None for leaf in leaves)
    if shard is None:  # shard= not given: the model's own annotations, where it has them, with mesh=
        shard = "annotations" if annotated and mesh is not None else "replicate"
    choose = _chooser(shard, where, annotated, axes)
    if shard == "annotations" or is_rules(shard):
        warn_misfits([leaf_path(path) for path, _ in flat], leaves, where)
    out = []
    for (path, _), leaf in zip(flat, leaves, strict=True):
        name = leaf_path(path)
        choice, rule = choose(name, leaf)
        out.append(_layout(name, leaf.shape, leaf.dtype, choice, rule, axes, where))
    if isinstance(shard, Mapping):
        _check_rules_used(shard, [lay.path for lay in out], where)
    return Plan(axes, batch_axis, jax.tree_util.tree_unflatten(treedef, out), shard)


def _fsdp(shape: tuple[int, ...], parts: int) -> int | None:
    """fsdp's axis for a leaf of ``shape``: None below FSDP_MIN_SIZE elements, else the largest
    axis that divides by ``parts``, else the largest axis (to be padded)."""
    if math.prod(shape) < FSDP_MIN_SIZE or not shape:
        return None
    order = sorted(range(len(shape)), key=lambda i: (-shape[i], i))
    dividing = [i for i in order if shape[i] % parts == 0]
    return dividing[0] if dividing else order[0]


_FSDP = object()  # a chooser's answer: do what fsdp does


def _chooser(shard: Any, where: str, annotated: bool, axes: dict) -> Callable[[str, Leaf], tuple]:
    """``shard=`` as a function (path, leaf) -> (an axis, None, per-axis names or ``_FSDP``; the
    rule that gave it, for messages)."""
    if isinstance(shard, str):
        if shard not in SHARDS:
            raise ValueError(
                f"{where}: shard={shard!r} is not known; use one of {list(SHARDS)} or {_EXAMPLE}"
            )
        if shard == "annotations":
            return _by_annotation((), where, axes)
        answer = None if shard == "replicate" else _FSDP
        return lambda name, leaf: (answer, f"shard={shard!r}")
    if isinstance(shard, Mapping):
        rules = []
        for pattern, value in shard.items():
            try:
                rules.append((re.compile(pattern), value))
            except (TypeError, re.error) as e:
                raise ValueError(
                    f"{where}: shard rule {pattern!r} is not a regular expression ({e}); a rule is "
                    "{regex on the leaf's path: axis}, e.g. {'kernel$': 1}"
                ) from None

        def by_rule(name: str, leaf: Leaf) -> tuple:
            for regex, value in rules:
                if regex.search(name):
                    return value, f"shard rule {regex.pattern!r}"
            return _FSDP, "shard='fsdp' (no rule matches)"

        return by_rule
    if is_rules(shard):
        if not annotated:
            raise ValueError(
                f"{where}: shard={shard!r:.80} gives logical axis rules, but no leaf of params carries a "
                "sharding annotation (nnx.with_partitioning); annotate the model, or give regex rules "
                "on the leaves' paths, e.g. {'kernel': (None, 'model')}"
            )
        return _by_annotation(check_rules(shard, where), where, axes)
    if callable(shard):
        _check_arity(shard, where)
        what = f"shard function {getattr(shard, '__qualname__', None) or type(shard).__name__}"
        return lambda name, leaf: (shard(name, leaf), what)
    raise TypeError(
        f"{where}: shard must be 'replicate', 'fsdp', a dict of rules, logical axis rules or a function; "
        f"got {type(shard).__name__} {shard!r:.80}; e.g. {_EXAMPLE}"
    )


def _by_annotation(rules: tuple, where: str, axes: dict) -> Callable[[str, Leaf], tuple]:
    """Each leaf as its annotation says (its names mapped to mesh axes by ``rules``); leaves
    without one replicated."""

    def choose(name: str, leaf: Leaf) -> tuple:
        if leaf.names is None:
            return None, "no annotation"
        return mesh_names(name, leaf, rules, axes, where), f"its annotation {leaf.names!r}"

    return choose


def _check_arity(fn: Callable, where: str) -> None:
    """A rule function must take (path, leaf): said before it is ever called."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its call will say
        return
    try:
        signature.bind("path", "leaf")
    except TypeError:
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        raise TypeError(
            f"{where}: the shard function {name}{signature} cannot be called as fn(path, leaf); a rule "
            f"function takes the leaf's path ('dense/kernel') and the leaf (its shape, dtype and "
            f"annotation), e.g. shard=lambda path, leaf: 0 if leaf.ndim == 2 else None; {_MAY_GIVE}"
        ) from None


def _check_rules_used(rules: Mapping, paths: list[str], where: str) -> None:
    for pattern in rules:
        if not any(re.search(pattern, p) for p in paths):
            shown = ", ".join(paths[:6]) + (", ..." if len(paths) > 6 else "")
            raise ValueError(
                f"{where}: shard rule {pattern!r} matches no parameter (paths: {shown}); fix the regex "
                "or drop the rule (a rule that matches nothing would leave its leaves to fsdp)"
            )


def _layout(
    name: str, shape: tuple, dtype: Any, choice: Any, rule: str, axes: dict, where: str
) -> LeafLayout:
    """One leaf's layout from a chooser's answer (checked against the leaf and the mesh); errors
    name the leaf, the ``rule`` that gave the answer and what a rule may give."""
    if choice is _FSDP:
        choice = _fsdp(shape, math.prod(axes.values()))
    spec: list = [None] * len(shape)
    if isinstance(choice, str):  # one mesh axis name: the leaf's first axis split over it
        choice = (choice,)
    elif isinstance(choice, numbers.Integral) and not isinstance(choice, bool):
        choice = int(choice)  # numpy integers too
    said = f"(given by {rule}); {_MAY_GIVE}"
    if isinstance(choice, bool) or (choice is not None and not isinstance(choice, int | tuple | list | P)):
        raise TypeError(f"{where}: the layout of {name!r} is {choice!r:.80} {said}")
    if isinstance(choice, int):
        if not shape:
            raise ValueError(
                f"{where}: axis {choice} for {name!r}: the leaf is a scalar, which cannot be split; "
                f"give None to replicate it {said}"
            )
        if not -len(shape) <= choice < len(shape):
            raise ValueError(
                f"{where}: axis {choice} for {name!r} is out of range: the leaf has shape {shape} "
                f"({len(shape)} axes); give an axis from {-len(shape)} to {len(shape) - 1}, or None "
                f"to replicate it {said}"
            )
        spec[choice % len(shape)] = tuple(axes)
    elif choice is not None:
        spec = _named_spec(
            name, shape, tuple(choice), axes, f"{where}: the layout {tuple(choice)} of {name!r}", said
        )
    padded = tuple(
        d if not names else -(-d // (p := math.prod(axes[a] for a in names))) * p
        for d, names in zip(shape, spec, strict=True)
    )
    return LeafLayout(name, shape, np.dtype(dtype), tuple(spec), padded)


def _named_spec(name: str, shape: tuple, choice: tuple, axes: dict, what: str, said: str) -> list:
    """Per array axis: None or the mesh axes it is split over (each at most once in the leaf)."""
    if len(choice) > len(shape):
        raise ValueError(
            f"{what} names {len(choice)} axes, but the leaf has shape {shape}; give at most "
            f"{len(shape)} entries {said}"
        )
    spec: list = []
    for i, entry in enumerate(choice + (None,) * (len(shape) - len(choice))):
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        if not isinstance(names, tuple | list) or not all(isinstance(a, str) for a in names):
            hint = (
                f"; to split array axis {i} over every context give {i} alone"
                if isinstance(entry, int)
                else ""
            )
            raise TypeError(
                f"{what}: entry {entry!r} for array axis {i} is not a mesh axis name (axes: "
                f"{list(axes)}){hint} {said}"
            )
        unknown = [a for a in names if a not in axes]
        if unknown:
            raise ValueError(
                f"{what} names mesh axis {unknown[0]!r}, which the mesh does not have (axes: "
                f"{list(axes)}); use one of them, e.g. (None, {list(axes)[-1]!r}) {said}"
            )
        twice = [a for a in names if a in {b for got in spec for b in got or ()} or names.count(a) > 1]
        if twice:
            raise ValueError(
                f"{what} names mesh axis {twice[0]!r} twice; a mesh axis splits at most one array "
                f"axis of a leaf, once: split another axis over another mesh axis, e.g. "
                f"(None, {twice[0]!r}) {said}"
            )
        spec.append(tuple(names) or None)
    return spec


def shapes_of(leaves: Any) -> Any:
    """A tree of layouts as the parameters' (unpadded) shapes and dtypes."""
    return jax.tree_util.tree_map(lambda lay: jax.ShapeDtypeStruct(lay.shape, lay.dtype), leaves)


def check_distinct(plan_: Plan, targets: Targets, where: str) -> None:
    """A split plan (or a mesh) needs distinct devices of one kind: else a clear error."""
    if targets.spmd or not plan_.asked:
        return
    devices = targets.devices
    shared = [c.name for c in targets.contexts if devices.count(c.device) > 1]
    why = (
        f"contexts {', '.join(shared[:4])} share a device"
        if shared
        else f"the contexts mix kinds ({', '.join(sorted({d.platform for d in devices}))})"
    )
    raise ValueError(
        f"{where}: shard={plan_.shard!r} splits parameters over the contexts, but {why}; sharding needs "
        "distinct devices of one kind: map each context to its own device (mg.use_contexts"
        "('a->gpu0;b->gpu1')), pick such contexts with contexts=, or use shard='replicate'"
    )
