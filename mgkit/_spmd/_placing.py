"""Placing a batch for one SPMD program: split leaves part i on device i, shared leaves on every
device, host arrays through a private copy, each placement recorded in the ledger once it lands."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .._transfer import private_copies
from ._layouts import record, spmd_layout
from ._leaves import HOST_TYPES, concrete, is_abstract
from ._mesh import AXIS, shardings
from ._shares import pad
from ._targets import Targets


class Batch(NamedTuple):
    """A flattened pytree of arguments, which leaves are split (and along which axis), rows."""

    leaves: list
    treedef: Any
    axes: tuple  # per leaf: None (shared) or a non-negative axis
    n: int
    names: Callable[[int], str]  # leaf index -> readable name, for messages


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


def lands_at_once(devices: Sequence, nbytes: int) -> bool:
    """Whether placing ``nbytes`` from host memory on these devices is complete when
    ``jax.device_put`` returns. XLA's CPU client copies host buffers under 100 KiB before it
    returns (or takes them as they are); this says so for less than 64 KiB in all, so a small
    call's placement is timed without asking every array whether it is ready (a few
    microseconds each)."""
    return nbytes < _SMALL and devices[0].platform == "cpu"


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
    per_leaf = shardings(targets.devices, axis_name, batch.axes)
    out = list(batch.leaves)
    moving, copies, moves = [], [], []
    t0, start = time.perf_counter(), time.time()
    for i, (leaf, ax, target) in enumerate(zip(batch.leaves, batch.axes, per_leaf, strict=True)):
        value = concrete(leaf)
        if padded and ax is not None:
            out[i] = pad(leaf, sizes, ax)
        if value is None:  # traced: the program lays it out (vmap's tracers have more axes)
            continue
        if isinstance(value, HOST_TYPES):
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
    placed = put([out[i] for i in moving], [per_leaf[i] for i in moving])
    for i, p in zip(moving, placed, strict=True):
        out[i] = p
    if not staged:
        record(spmd_layout(moves, targets, sizes), start, [concrete(p) for p in placed], t0)
    return out


def place_copied(leaves: list, shardings: list, copies: Sequence[int]) -> list:
    """Every leaf placed with its sharding in one ``jax.device_put``, the host leaves at
    ``copies`` through a private copy first (``private``): a planned call's placement."""
    if copies:
        leaves = list(leaves)
        for i, c in zip(copies, private([leaves[i] for i in copies]), strict=True):
            leaves[i] = c
    return jax.device_put(leaves, shardings)


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
