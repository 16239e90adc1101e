"""The SPMD layer every capability shares: the contexts a program runs on, the mesh over their
devices, shardings, padding and trimming of uneven batches, placing a batch for one program,
and the cache of compiled programs (``clear_caches`` empties it).

``parallel``, ``pmap`` and logistic regression all build their programs on this; so will a
trainer. Meshes built here have ``Auto`` axes: an array that leaves an ``Explicit`` mesh for
one device keeps that type, and the next single-device ``jax.jit`` rejects it.
"""

from __future__ import annotations

import collections
import functools
import math
import numbers
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import _contexts, _devices
from ._contexts import Context, ContextMap, explain_incompatible
from ._errors import ContextError
from ._ledger import Layout, execution_label, ledger, link_shares
from ._transfer import private_copies, source

AXIS = "mgkit"  # the mesh axis of mgkit's own SPMD programs

# -- caches --------------------------------------------------------------------------------

_CLEARS: list[Callable[[], None]] = []  # every cache's clear(), for clear_caches()


class Cache:
    """A small thread-safe LRU (keyed by function identity and layout), emptied by
    :func:`clear_caches` like every other cache of compiled programs."""

    def __init__(self, size: int = 256):
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._size = size
        self._lock = threading.Lock()
        _CLEARS.append(self.clear)

    def get(self, key: Any, build: Callable[[], Any]) -> Any:
        """The value cached under ``key``, else ``build()`` (cached)."""
        value = self._items.get(key)  # a hit needs no lock: each OrderedDict call is atomic
        if value is not None:
            try:  # noqa: SIM105 - contextlib.suppress costs more than this hit path's work
                self._items.move_to_end(key)
            except KeyError:  # dropped meanwhile by another thread: still a valid value
                pass
            return value
        value = build()
        with self._lock:
            self._items[key] = value
            if len(self._items) > self._size:
                self._items.popitem(last=False)
        return value

    def items(self) -> list[tuple]:
        """(key, value) pairs, least recently used first."""
        with self._lock:
            return list(self._items.items())

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


def cached(maxsize: int) -> Callable[[Callable], Callable]:
    """``functools.lru_cache(maxsize)`` that :func:`clear_caches` empties too."""

    def wrap(fn: Callable) -> Callable:
        out = functools.lru_cache(maxsize=maxsize)(fn)
        _CLEARS.append(out.cache_clear)
        return out

    return wrap


programs = Cache()  # compiled programs: key -> jitted function


def clear_caches() -> None:
    """Frees every compiled program mgkit keeps, with what it closes over (functions, arrays),
    and the layouts, meshes and shardings cached beside them. The next call compiles again.

    JAX's own caches are left alone (they also hold the caller's own ``jax.jit`` programs); call
    ``jax.clear_caches()`` as well to empty them. The device lists found at start-up stay too:
    they hold no program, and only ``mg.simulate`` changes them.

    >>> import mgkit as mg, numpy as np
    >>> _ = mg.use_contexts("a->cpu0;b->cpu1", verbose=False)
    >>> _ = mg.make_parallel(lambda x: x + 1, x=np.ones(4))
    >>> mg.clear_caches()
    >>> len(programs)
    0
    """
    for clear in _CLEARS:
        clear()


def on_clear(clear: Callable[[], None]) -> None:
    """Has :func:`clear_caches` call ``clear()`` too: for what keeps compiled programs outside
    the caches (each wrapper's last plan)."""
    _CLEARS.append(clear)


# -- contexts ------------------------------------------------------------------------------


class Targets(NamedTuple):
    """The contexts a program runs on, each resolved once against the current map."""

    contexts: tuple[Context, ...]
    spmd: bool  # distinct devices of one kind: one SPMD program can span them

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.contexts)

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return tuple(c.device for c in self.contexts)

    def only(self, i: int) -> Targets:
        """The i-th context alone."""
        return Targets((self.contexts[i],), True)

    def first(self, k: int) -> Targets:
        """The first k contexts."""
        return Targets(self.contexts[:k], self.spmd)

    def describe(self) -> str:
        return f"{len(self.names)} context(s): {', '.join(self.names)}"


def resolve(contexts: Any, fn: str) -> Targets:
    """Context names (None: every context in the map; an int n: the first n) -> Targets."""
    cmap = _contexts.context_map()
    if contexts is None:
        spec: Any = None
    elif isinstance(contexts, bool):
        raise TypeError(f"{fn}: contexts={contexts!r}; pass context names, a count or None")
    elif isinstance(contexts, numbers.Integral):
        spec = int(contexts)
    elif isinstance(contexts, str | jax.Device):
        spec = (contexts,)
    elif isinstance(contexts, ContextMap):
        spec = tuple(contexts.names) if contexts == cmap else contexts
    elif isinstance(contexts, Mapping | Sequence):
        spec = tuple(contexts)
    else:
        raise TypeError(
            f"{fn}: contexts must be a list of context names (e.g. {list(cmap.names[:2])}), a count "
            f"or None for every context; got {type(contexts).__name__} {contexts!r}"
        )
    return _resolve(cmap, spec, fn)


@cached(256)
def _resolve(cmap: ContextMap, spec: Any, fn: str) -> Targets:
    if isinstance(spec, ContextMap):  # a map that is not installed: use its own devices
        contexts = tuple(Context(name, d, _devices.short_name(d)) for name, d in spec.devices().items())
    else:
        if spec is None:
            names = cmap.names
        elif isinstance(spec, int):
            if not 1 <= spec <= len(cmap):
                raise ValueError(
                    f"{fn}: contexts={spec}, but the map has {len(cmap)} context(s) ({cmap}); "
                    f"pass a count from 1 to {len(cmap)}, or context names"
                )
            names = cmap.names[:spec]
        else:
            names = spec
        if not names:
            raise ValueError(
                f"{fn}: the context list is empty; pass context names such as {list(cmap.names[:2])}, "
                f"or contexts=None for every context in the map ({cmap})"
            )
        contexts = tuple(_contexts.resolve(name, fn) for name in names)
        host = [c.name for c in contexts if c.device is None]
        if host:
            raise ContextError(
                f"{fn}: {host[0]!r} means host memory, which runs nothing; pass device contexts "
                f"such as {list(cmap.names[:2])}"
            )
    names = tuple(c.name for c in contexts)
    devices = tuple(c.device for c in contexts)
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(
            f"{fn}: context {repeated[0]!r} is listed more than once in {list(names)}; to run two "
            f"parts on one device, map two names to it, e.g. mg.use_contexts('a->cpu0;b->cpu0')"
        )
    spmd = len(set(devices)) == len(devices) and len({d.platform for d in devices}) == 1
    return Targets(contexts, spmd)


def per_context(values: Mapping, targets: Targets, what: str, fn: str) -> list:
    """The values of a {context: value} mapping in context order; every context exactly once."""
    unknown = [c for c in values if c not in targets.names]
    missing = [c for c in targets.names if c not in values]
    if unknown or missing:
        raise ValueError(
            f"{fn}: {what} must have one entry per context ({targets.describe()}); "
            + (f"unknown: {unknown}. " if unknown else "")
            + (f"missing: {missing}." if missing else "")
        )
    return [values[c] for c in targets.names]


# -- meshes and shardings ------------------------------------------------------------------


@cached(64)
def mesh(devices: tuple[jax.Device, ...], axis_name: str = AXIS) -> Mesh:
    """A one-axis mesh over the devices, in order, with an ``Auto`` axis."""
    return Mesh(np.array(devices, dtype=object), (axis_name,), axis_types=(AxisType.Auto,))


def spec(ax: int | None, axis_name: str = AXIS) -> P:
    """The partition spec of an array split along ``ax`` over the mesh axis (None: replicated)."""
    return P() if ax is None else P(*([None] * ax), axis_name)


@cached(1024)
def sharding(devices: tuple[jax.Device, ...], axis_name: str = AXIS, ax: int | None = None) -> NamedSharding:
    """The sharding over ``mesh(devices, axis_name)`` of an array split along ``ax`` (None: replicated)."""
    return NamedSharding(mesh(devices, axis_name), spec(ax, axis_name))


@cached(256)
def _shardings(devices: tuple[jax.Device, ...], axis_name: str, axes: tuple) -> tuple[NamedSharding, ...]:
    return tuple(sharding(devices, axis_name, ax) for ax in axes)


# -- sizes, padding and trimming -----------------------------------------------------------


@cached(1024)
def shares(n: int, k: int, weights: tuple[float, ...] | None = None) -> tuple[int, ...]:
    """Rows per part: proportional to the weights with largest-remainder rounding (ties to the
    earlier part); without weights the sizes differ by at most one.

    >>> shares(10, 4)
    (3, 3, 2, 2)
    >>> shares(10, 2, (3.0, 1.0))
    (8, 2)
    """
    if weights is None:
        return tuple(n // k + (i < n % k) for i in range(k))
    total = sum(weights)
    quotas = [n * w / total for w in weights]
    sizes = [math.floor(q) for q in quotas]
    order = sorted(range(k), key=lambda i: (sizes[i] - quotas[i], i))
    for i in order[: n - sum(sizes)]:
        sizes[i] += 1
    return tuple(sizes)


@cached(256)
def padding(sizes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(index that pads every part to the largest, positions of the real rows after padding).

    ``x[index]`` repeats a part's last row until it is as long as the largest part (so every
    device gets an equal share); ``out[keep]`` drops those rows again.

    >>> index, keep = padding((2, 1))
    >>> index.tolist(), keep.tolist()
    ([0, 1, 2, 2], [0, 1, 2])
    """
    s, n = max(sizes), sum(sizes)
    index, keep, start = [], [], 0
    for i, size in enumerate(sizes):
        pad_row = start + size - 1 if size else n - 1
        index.extend(range(start, start + size))
        index.extend([pad_row] * (s - size))
        keep.extend(range(i * s, i * s + size))
        start += size
    return np.asarray(index, dtype=np.int32), np.asarray(keep, dtype=np.int32)


def pad(leaf: Any, sizes: tuple[int, ...], axis: int) -> Any:
    """``leaf`` with each part padded to the largest along ``axis`` (see :func:`padding`)."""
    index = padding(sizes)[0]
    if isinstance(leaf, np.ndarray | np.generic):
        return np.take(leaf, index, axis=axis)
    return jax.numpy.take(leaf, index, axis=axis)


def trim(leaf: Any, sizes: tuple[int, ...], axis: int) -> Any:
    """The real rows of a padded result (inverse of :func:`pad`)."""
    keep = padding(sizes)[1]
    if isinstance(leaf, np.ndarray | np.generic):
        return np.take(leaf, keep, axis=axis)
    return jax.numpy.take(leaf, keep, axis=axis)


# -- placing a batch -----------------------------------------------------------------------


class Batch(NamedTuple):
    """A flattened pytree of arguments, which leaves are split (and along which axis), rows."""

    leaves: list
    treedef: Any
    axes: tuple  # per leaf: None (shared) or a non-negative axis
    n: int
    names: Callable[[int], str]  # leaf index -> readable name, for messages


def concrete(leaf: Any) -> Any:
    """The array behind a leaf: itself, its value under an eager ``jax.grad``, or None for a
    tracer that stands for no one array of its shape (inside ``jax.jit``; inside ``jax.vmap``,
    whose tracer holds the whole batch)."""
    if not isinstance(leaf, jax.core.Tracer):
        return leaf
    value = leaf.to_concrete_value()
    return value if value is not None and np.shape(value) == leaf.shape else None


def is_abstract(leaves: Sequence) -> bool:
    """Whether any leaf is a tracer without a value of its own (inside ``jax.jit`` or ``jax.vmap``)."""
    return any(isinstance(x, jax.core.Tracer) and concrete(x) is None for x in leaves)


_HOST_TYPES = (np.ndarray, np.generic, numbers.Number)
_SMALL = 1 << 16  # bytes below which a plain copy beats an aligned one (XLA copies either way)


@functools.lru_cache(maxsize=64)
def kept(dtype: np.dtype) -> bool:
    """Whether JAX keeps a host array of this dtype as it is (no conversion copies it anyway)."""
    return dtype == jax.dtypes.canonicalize_dtype(dtype)


def needs_private(value: Any, cpu: bool) -> bool:
    """Whether a host array is placed through mgkit's own copy (``private``): on CPU devices
    every array whose dtype JAX keeps (``device_put`` may take its buffer as it is), and on any
    device one of a dtype JAX converts (float64 without x64: jax 0.10 places such an array over
    several devices from a conversion it keeps per array object, so a refilled buffer would
    place its first contents again)."""
    return isinstance(value, np.ndarray) and (cpu or not kept(value.dtype))


def private(values: list[np.ndarray]) -> list[np.ndarray]:
    """Fresh arrays with the values of host arrays, so that a device array never shares the
    caller's memory (or a conversion of it): a dtype JAX converts is converted here; the rest
    are copied, small ones plainly, larger ones aligned for XLA to take as they are
    (``private_copies``)."""
    out = list(values)
    same = []
    for i, v in enumerate(values):
        if kept(v.dtype):
            same.append(i)
        else:
            out[i] = v.astype(jax.dtypes.canonicalize_dtype(v.dtype))
    if same:
        copies = [values[i] for i in same]
        made = (
            [v.copy() for v in copies] if sum(v.nbytes for v in copies) < _SMALL else private_copies(copies)
        )
        for i, m in zip(same, made, strict=True):
            out[i] = m
    return out


def place_spmd(
    batch: Batch,
    targets: Targets,
    sizes: tuple[int, ...],
    axis_name: str = AXIS,
    own: bool | Collection[int] = False,
) -> list:
    """Lays the leaves out for one SPMD program: split leaves part i on device i (padded to
    equal parts when the sizes differ), shared leaves on every device.

    Host and device arrays are moved here, in one placement, and recorded once they land (timed
    from the start of the move, so a copy's seconds are its own, not the program's). A host
    array bound for CPU devices goes through a private copy (``private``) unless it is the
    caller's ``own`` (True: every leaf; else the leaves' indices), made for this call and never
    the user's. Leaves already laid out are not moved.
    """
    own = range(len(batch.leaves)) if own is True else own or ()
    padded = len(set(sizes)) > 1
    staged = is_abstract(batch.leaves)
    cpu = targets.devices[0].platform == "cpu"
    shardings = _shardings(targets.devices, axis_name, batch.axes)
    out = list(batch.leaves)
    moving, copies, moves = [], [], []
    t0, start = time.perf_counter(), time.time()
    for i, (leaf, ax, target) in enumerate(zip(batch.leaves, batch.axes, shardings, strict=True)):
        value = concrete(leaf)
        if padded and ax is not None:
            out[i] = pad(leaf, sizes, ax)
        if value is None:  # traced: the program lays it out (vmap's tracers have more axes)
            continue
        if isinstance(value, _HOST_TYPES):
            if i not in own:
                if staged:  # traced: left to the program, as constants
                    continue
                if needs_private(out[i], cpu):  # never the user's own buffer (``needs_private``)
                    copies.append(i)
        elif not padded and isinstance(value, jax.Array):
            current = value.sharding
            if current == target:
                continue
            if current.is_equivalent_to(target, value.ndim):
                if not staged:
                    # The same buffers under another mesh (jax.make_mesh's Explicit axes would
                    # leak into the program): relabel them, which copies nothing.
                    out[i] = jax.device_put(value, target)
                continue
        moving.append(i)
        if not staged:
            moves.append((value, ax))
    if not moving:
        return out
    if copies:
        for i, c in zip(copies, private([out[i] for i in copies]), strict=True):
            out[i] = c
    placed = put([out[i] for i in moving], [shardings[i] for i in moving])
    for i, p in zip(moving, placed, strict=True):
        out[i] = p
    if not staged:
        record(spmd_layout(moves, targets, sizes), start, [concrete(p) for p in placed], t0)
    return out


def put(values: list, shardings: Sequence[jax.sharding.Sharding]) -> list:
    """``jax.device_put(values, shardings)``, also for shardings over several processes (after
    ``jax.distributed.initialize``): there every process holds the same host values and lays
    out only its own devices' parts, with no collective (``device_put`` would first check with
    the other processes that the values agree, a collective that must not run beside a step)."""
    if all(s.is_fully_addressable for s in shardings):
        return jax.device_put(values, list(shardings))
    out = []
    for value, target in zip(values, shardings, strict=True):
        host = np.asarray(value)
        out.append(jax.make_array_from_callback(host.shape, target, lambda index, host=host: host[index]))
    return out


def record(layout: Layout, start: float, arrays: list, t0: float, done: float | None = None) -> None:
    """Records a cached layout's events (see ``_spmd_layout``) issued at ``start`` once
    ``arrays`` are ready, timed from ``t0``: at once when they are, else by the ledger's
    watcher. ``done``: the ``perf_counter`` time by which the work is known to be complete
    (``lands_at_once``), so the arrays need not be asked. The ledger keeps one entry per call
    and makes the events when they are read."""
    label = execution_label()
    if done is None:
        for a in arrays:
            if not a.is_ready():
                ledger().record_when_ready(layout.call(start, 0.0, label), arrays, t0)
                return
        done = time.perf_counter()
    ledger().record(layout.call(start, done - t0, label))


def lands_at_once(devices: Sequence, nbytes: int) -> bool:
    """Whether placing ``nbytes`` from host memory on these devices is complete when
    ``jax.device_put`` returns. XLA's CPU client copies host buffers under 100 KiB before it
    returns (or takes them as they are); this says so for less than 64 KiB in all, so a small
    call's placement is timed without asking every array whether it is ready (a few
    microseconds each)."""
    return nbytes < _SMALL and devices[0].platform == "cpu"


def spmd_layout(moves: list, targets: Targets, sizes: tuple[int, ...]) -> Layout:
    """The events of a placement of ``moves`` ((value, axis) pairs), one per (kind, source,
    context): the bytes that land on each context (see ``record``)."""
    layout = tuple(
        (*_HOST_SOURCE, value.shape, value.dtype, ax)
        if type(value) is np.ndarray
        else (*_HOST_SOURCE, np.shape(value), _dtype(value), ax)
        if isinstance(value, _HOST_TYPES)
        else (*_source(value), value.shape, value.dtype, ax)
        for value, ax in moves
    )
    return _spmd_layout(targets, sizes, layout)


_HOST_SOURCE = (_contexts.HOST, _contexts.HOST, None)


def _source(value: jax.Array) -> tuple[str, str, frozenset | None]:
    ctx, devices = source(value)
    return ctx.name, ctx.short, devices


def _dtype(leaf: Any) -> np.dtype:
    dtype = getattr(leaf, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.result_type(leaf)


def _with_shares(rows: list[tuple]) -> Layout:
    """(head, info) rows -> their ``Layout``, the heads being an event's first six fields."""
    shares = link_shares([(head[1], head[2], head[5]) for head, _ in rows])
    return Layout([(head, share, info) for (head, info), share in zip(rows, shares, strict=True)])


@cached(1024)
def _spmd_layout(targets: Targets, sizes: tuple[int, ...], layout: tuple) -> Layout:
    totals: dict[tuple, list] = {}
    for src_name, src_dev, src_devices, shape, dtype, ax in layout:
        itemsize = np.dtype(jax.dtypes.canonicalize_dtype(dtype)).itemsize
        per_row = (
            math.prod(shape) * itemsize if ax is None else math.prod(shape[:ax] + shape[ax + 1 :]) * itemsize
        )
        kind = "replicate" if ax is None else "split"
        for ctx, size in zip(targets.contexts, sizes, strict=True):
            if src_devices == frozenset((ctx.device,)) or (ax is not None and not size):
                continue  # this part is already there, or it has no rows
            key = (kind, src_name, ctx.name, src_dev, ctx.short)
            entry = totals.setdefault(key, [0, 0, size])
            entry[0] += per_row if ax is None else per_row * size
            entry[1] += 1
    of = sum(sizes)
    return _with_shares(
        [
            ((*key, nbytes), {"arrays": count, "rows": rows, "of": of})
            for key, (nbytes, count, rows) in totals.items()
        ]
    )


def fn_name(fn: Callable) -> str:
    """How messages and the ledger name a function."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def record_run(
    targets: Targets,
    sizes: tuple[int, ...],
    fn: Callable,
    path: str,
    start: float,
    of: int,
    outputs: Any,
    t0: float,
) -> None:
    """Records one ``run`` event per context with rows (its share of a call over ``of`` rows),
    once the outputs (a pytree) are ready."""
    layout = run_layout(targets, sizes, fn, path, of)
    record(layout, start, [concrete(x) for x in jax.tree_util.tree_leaves(outputs)], t0)


def run_layout(targets: Targets, sizes: tuple[int, ...], fn: Callable, path: str, of: int) -> Layout:
    """The ``run`` events of a call (see ``record``): one per context with rows."""
    return _run_layout(targets, sizes, fn_name(fn), path, of)


@cached(1024)
def _run_layout(targets: Targets, sizes: tuple[int, ...], fn: str, path: str, of: int) -> Layout:
    return _with_shares(
        [
            (("run", c.name, c.name, c.short, c.short, 0), {"fn": fn, "of": of, "path": path, "rows": size})
            for c, size in zip(targets.contexts, sizes, strict=True)
            if size
        ]
    )


def explained(call: Callable, *args: Any) -> Any:
    """Runs ``call``; JAX's incompatible-devices error comes back in context names."""
    try:
        return call(*args)
    except ValueError as e:
        better = explain_incompatible(e)
        if better is None:
            raise
        raise better from e
