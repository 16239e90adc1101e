"""Where the blocks of sharded arrays live: for each leaf of a pytree of jax arrays or shapes with
shardings (``jax.ShapeDtypeStruct(..., sharding=...)``, what ``jax.eval_shape`` returns for a
function jitted with ``out_shardings``), which block of it each context holds, and the bytes each
context stores. A numpy leaf lives on the host: no context holds any of it. Leaves that are
neither arrays nor numbers (an Equinox module's activation) are held static and skipped, as
``mgkit._static`` says.

Computed from the shape and the sharding only: no array's data is read or moved. A
``NamedSharding``'s blocks come from its mesh's shape and its ``PartitionSpec``, so an abstract
mesh of any size (``jax.sharding.AbstractMesh``) works without devices; other shardings answer
``devices_indices_map``. A dimension that does not divide by its number of blocks is padded as
XLA pads it: every block is ``ceil(size / blocks)`` long and the last ones hold less (or nothing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, Sharding

from . import _contexts
from ._static import describe, is_static
from ._transfer import leaf_paths

WHERE = "mg.show_sharding"
HOST = "on the host (numpy)"  # where a numpy leaf lives (its ``Layout.sharding``)
_EXAMPLE = (
    "e.g. jax.device_put(x, NamedSharding(mesh, P('x'))), or jax.ShapeDtypeStruct(shape, dtype, "
    "sharding=NamedSharding(mesh, P('x')))"
)


class Block(NamedTuple):
    """One block of a leaf and the contexts that hold a copy of it."""

    index: tuple[int, ...]  # its position along each dimension, 0 to ``Layout.parts`` - 1
    start: tuple[int, ...]  # its first index along each dimension
    stop: tuple[int, ...]  # one past its last index along each dimension (at most the size)
    contexts: tuple[str, ...]  # the contexts holding a copy, in mesh order

    @property
    def size(self) -> int:
        """Elements of the leaf in the block (padding not counted)."""
        return math.prod(b - a for a, b in zip(self.start, self.stop, strict=True))


class Place(NamedTuple):
    """One device a leaf is laid out on."""

    context: str  # the context name of the device (its short name, or ``#i`` on an abstract mesh)
    device: jax.Device | None  # the device (None on an abstract mesh)
    block: int  # the index in ``Layout.blocks`` of the block it holds


class Layout(NamedTuple):
    """How one leaf is laid out over the contexts, from its shape and sharding only."""

    path: str  # where the leaf is in the pytree (``['w']``), or "(the value itself)"
    shape: tuple[int, ...]  # the leaf's shape
    dtype: Any  # the leaf's dtype: a numpy dtype, or JAX's dtype of PRNG keys (``key<fry>``)
    sharding: str  # the sharding in short: ``P('x', None) on mesh x=4, y=2``, ``one device``
    parts: tuple[int, ...]  # blocks along each dimension (1: the dimension is whole)
    axes: tuple[tuple[str, ...], ...]  # the mesh axes each dimension is split over
    shard: tuple[int, ...]  # a block's shape as each device stores it (padding included)
    blocks: tuple[Block, ...]  # the distinct blocks, by their first index
    places: tuple[Place, ...]  # every device holding a block, in mesh order

    @property
    def nbytes(self) -> int:
        """The leaf's bytes (one copy, no padding)."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def shard_bytes(self) -> int:
        """The bytes each device stores for the leaf: one block, padded to ``shard`` (0: on the host)."""
        return math.prod(self.shard) * self.dtype.itemsize if self.places else 0

    @property
    def copies(self) -> int:
        """How many devices hold each block (1: no block is replicated)."""
        return len(self.places) // max(len(self.blocks), 1)

    @property
    def padded(self) -> tuple[int, ...]:
        """The dimensions whose size does not divide by their blocks (their last blocks are short)."""
        return tuple(d for d, (n, k) in enumerate(zip(self.shape, self.parts, strict=True)) if n % k)

    @property
    def contexts(self) -> tuple[str, ...]:
        """Every context holding a block, in mesh order, each once."""
        return tuple(dict.fromkeys(p.context for p in self.places))


class ContextBytes(NamedTuple):
    """The bytes one context stores for the leaves of a pytree."""

    context: str  # the context name (a device's short name, or ``#i`` on an abstract mesh)
    device: jax.Device | None  # its device (None on an abstract mesh)
    nbytes: int  # bytes it stores: one block of each leaf it holds, padded to the shard shape
    leaves: int  # how many leaves it holds a block of


def layouts(tree: Any, where: str = WHERE) -> list[Layout]:
    """The ``Layout`` of every leaf of ``tree``: jax arrays, ``jax.ShapeDtypeStruct`` with a
    sharding, or numpy arrays (on the host: no places); leaves held static (functions, strings:
    ``mgkit._static.is_static``) are skipped. Raises TypeError naming any other leaf (a Python
    number), ValueError for a shape without a sharding; ``where`` names the caller in the messages.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
    >>> s = NamedSharding(AbstractMesh((4,), ("x",)), P("x"))
    >>> [lay] = layouts(jax.ShapeDtypeStruct((10,), jnp.float32, sharding=s))
    >>> lay.parts, lay.shard, lay.padded, [b.stop for b in lay.blocks]
    ((4,), (3,), (0,), [(3,), (6,), (9,), (10,)])
    """
    pairs = list(zip(leaf_paths(tree), jax.tree_util.tree_leaves(tree), strict=True))
    shown = [(path, leaf) for path, leaf in pairs if not is_static(leaf)]
    if not shown:
        held = ", ".join(f"{path} ({describe(leaf)})" for path, leaf in pairs[:3])
        raise ValueError(
            f"{where}: {type(tree).__name__} {_short_repr(tree)} has no arrays to show"
            + (f" (its leaves {held} are held static)" if held else "")
            + f"; give a jax array, a pytree of them, or shapes with shardings ({_EXAMPLE})"
        )
    seen: dict[tuple, Layout] = {}  # leaves of one shape, dtype and sharding share their blocks
    out = []
    for path, leaf in shown:
        if isinstance(leaf, np.ndarray | np.generic):
            out.append(_host_layout(path, leaf))
            continue
        sharding = _sharding_of(leaf, path, where)
        key = (tuple(leaf.shape), leaf.dtype, sharding)
        lay = seen.get(key)
        if lay is None:
            lay = seen[key] = layout(leaf, path, where)
        out.append(lay._replace(path=path))
    return out


def layout(leaf: Any, path: str = "(the value itself)", where: str = WHERE) -> Layout:
    """The ``Layout`` of one jax array or ``jax.ShapeDtypeStruct`` with a sharding."""
    sharding = _sharding_of(leaf, path, where)
    shape = tuple(int(n) for n in leaf.shape)
    dtype = leaf.dtype  # has .name and .itemsize, PRNG keys' too
    if isinstance(sharding, NamedSharding):
        return _named_layout(path, shape, dtype, sharding)
    return _mapped_layout(path, shape, dtype, sharding)


def bytes_per_context(tree: Any, where: str = WHERE) -> list[ContextBytes]:
    """The bytes each context stores for the leaves of a pytree of jax arrays or sharded shapes:
    one block of every leaf it holds a block of, padded to the shard shape (a replicated leaf
    counts in full on every context). Contexts by device id (on an abstract mesh, in mesh order).

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
    >>> mesh = AbstractMesh((2,), ("x",))
    >>> w = jax.ShapeDtypeStruct((4, 3), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    >>> b = jax.ShapeDtypeStruct((3,), jnp.float32, sharding=NamedSharding(mesh, P()))
    >>> [(c.context, c.nbytes) for c in bytes_per_context({"w": w, "b": b})]
    [('#0', 36), ('#1', 36)]
    """
    return context_bytes(layouts(tree, where))


def context_bytes(lays: Sequence[Layout]) -> list[ContextBytes]:
    """``bytes_per_context`` from layouts already computed."""
    groups: dict[int, list] = {}  # leaves laid out alike share one tuple of places: sum them first
    for lay in lays:
        group = groups.setdefault(id(lay.places), [lay.places, 0, 0])
        group[1] += lay.shard_bytes
        group[2] += 1
    held: dict[str, list] = {}
    for places, nbytes, leaves in groups.values():
        for place in places:
            row = held.setdefault(place.context, [place.device, 0, 0])
            row[1] += nbytes
            row[2] += leaves
    rows = [ContextBytes(name, device, n, k) for name, (device, n, k) in held.items()]
    return sorted(rows, key=lambda r: (r.device is None, 0 if r.device is None else r.device.id))


def _sharding_of(leaf: Any, path: str, where: str) -> Sharding:
    """The leaf's sharding, or an error saying what a leaf must be."""
    what = f"{where}: leaf {path}"
    if isinstance(leaf, jax.core.Tracer):
        raise TypeError(
            f"{what} is a tracer (inside jax.jit, jax.grad or jax.vmap), which has no place on devices "
            "yet; call show_sharding outside the transformation, on its result or on "
            "jax.eval_shape(jitted_function, ...)"
        )
    if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        try:
            sharding = leaf.sharding
        except (TypeError, ValueError) as e:  # a PartitionSpec with no mesh set (jax >= 0.11)
            raise ValueError(f"{what}: its sharding cannot be read: {e}") from None
        if isinstance(sharding, Sharding):
            return sharding
        shown = f"{leaf.dtype.name}{list(leaf.shape)}"
        raise ValueError(
            f"{what} ({type(leaf).__name__} {shown}) has no sharding; expected a jax array or a "
            f"jax.ShapeDtypeStruct with a sharding: {_EXAMPLE}; jax.eval_shape gives one for a "
            "function jitted with out_shardings"
        )
    raise TypeError(
        f"{what} is {type(leaf).__name__} {_short_repr(leaf)}, not a jax array or a "
        f"jax.ShapeDtypeStruct with a sharding; put it on devices first or describe it: {_EXAMPLE}"
    )


def _host_layout(path: str, leaf: np.ndarray | np.generic) -> Layout:
    """A numpy leaf: one block, held by no context (its bytes are on the host)."""
    shape = tuple(np.shape(leaf))
    whole = Block((0,) * len(shape), (0,) * len(shape), shape, ())
    return Layout(path, shape, leaf.dtype, HOST, (1,) * len(shape), ((),) * len(shape), shape, (whole,), ())


def _short_repr(leaf: Any) -> str:
    if isinstance(leaf, np.ndarray):
        return f"{leaf.dtype.name}{list(leaf.shape)}"
    text = repr(leaf)
    return text if len(text) <= 60 else text[:57] + "..."


def _split_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry splits a dimension over."""
    if entry is None or entry is getattr(jax.sharding.PartitionSpec, "UNCONSTRAINED", None):
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec_text(spec: Any, rank: int) -> str:
    entries = list(spec) + [None] * (rank - len(spec))
    return "P(" + ", ".join(repr(e) for e in entries) + ")"


def _named_layout(path: str, shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> Layout:
    """A NamedSharding's blocks from its mesh's shape and its PartitionSpec (no devices needed)."""
    mesh, spec = sharding.mesh, sharding.spec
    names = tuple(mesh.axis_names)
    sizes = tuple(int(mesh.shape[n]) for n in names)
    axes = tuple(_split_axes(e) for e in spec) + ((),) * (len(shape) - len(spec))
    parts = tuple(math.prod(sizes[names.index(a)] for a in ax) for ax in axes)
    shard = tuple(-(-n // k) for n, k in zip(shape, parts, strict=True))
    # Each device's mesh coordinates, then its block's index along each dimension.
    coords = np.indices(sizes).reshape(len(sizes), -1) if sizes else np.zeros((0, 1), int)
    index = np.zeros((len(shape), coords.shape[1]), dtype=np.int64)
    for d, ax in enumerate(axes):
        for a in ax:
            i = names.index(a)
            index[d] = index[d] * sizes[i] + coords[i]
    flat = np.ravel_multi_index(index, parts) if shape else np.zeros(coords.shape[1], np.int64)
    labels, devices = _labels(mesh, coords.shape[1])
    order = {int(b): None for b in np.unique(flat)}
    position = {b: j for j, b in enumerate(order)}
    held: list[list[str]] = [[] for _ in order]
    places = []
    for p, b in enumerate(flat.tolist()):
        held[position[b]].append(labels[p])
        places.append(Place(labels[p], devices[p], position[b]))
    blocks = []
    for b, names_held in zip(order, held, strict=True):
        idx = np.unravel_index(b, parts) if shape else ()
        start = tuple(min(int(i) * s, n) for i, s, n in zip(idx, shard, shape, strict=True))
        stop = tuple(min(a + s, n) for a, s, n in zip(start, shard, shape, strict=True))
        blocks.append(Block(tuple(int(i) for i in idx), start, stop, tuple(names_held)))
    mesh_text = ", ".join(f"{n}={s}" for n, s in zip(names, sizes, strict=True))
    kind = "abstract mesh" if isinstance(mesh, AbstractMesh) else "mesh"
    text = f"{_spec_text(spec, len(shape))} on {kind} {mesh_text}"
    return Layout(path, shape, dtype, text, parts, axes, shard, tuple(blocks), tuple(places))


def _labels(mesh: Any, n: int) -> tuple[list[str], list[jax.Device | None]]:
    """Each mesh position's context name and device (``#i`` and None on an abstract mesh)."""
    if isinstance(mesh, AbstractMesh):
        return [f"#{i}" for i in range(n)], [None] * n
    devices = list(mesh.devices.flat)
    return [_contexts.name_of(d) for d in devices], devices


def _mapped_layout(path: str, shape: tuple[int, ...], dtype: Any, sharding: Sharding) -> Layout:
    """Any other sharding's blocks, from ``devices_indices_map`` (its devices are real)."""
    mapping = sharding.devices_indices_map(shape)
    bounds = {d: tuple(s.indices(n)[:2] for s, n in zip(i, shape, strict=True)) for d, i in mapping.items()}
    distinct = sorted(set(bounds.values()))
    position = {b: j for j, b in enumerate(distinct)}
    names = {d: _contexts.name_of(d) for d in mapping}
    places = tuple(Place(names[d], d, position[b]) for d, b in bounds.items())
    holders: list[list[str]] = [[] for _ in distinct]
    for place in places:
        holders[place.block].append(place.context)
    starts = [sorted({b[d][0] for b in distinct}) for d in range(len(shape))]
    blocks = tuple(
        Block(
            tuple(starts[d].index(a) for d, (a, _) in enumerate(b)),
            tuple(a for a, _ in b),
            tuple(z for _, z in b),
            tuple(held),
        )
        for b, held in zip(distinct, holders, strict=True)
    )
    parts = tuple(len(s) for s in starts)
    shard = tuple(sharding.shard_shape(shape))
    axes = tuple(() for _ in shape)
    kind = "one device" if len(mapping) == 1 else f"{type(sharding).__name__} over {len(mapping)} devices"
    return Layout(path, shape, dtype, kind, parts, axes, shard, blocks, places)
