"""Meshes and shardings over the contexts' devices. Their axes are ``Auto``: an array that leaves
an ``Explicit`` mesh for one device keeps that type, and the next single-device ``jax.jit``
rejects it."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._caches import cached

AXIS = "mgkit"  # the mesh axis of mgkit's own SPMD programs


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
def shardings(devices: tuple[jax.Device, ...], axis_name: str, axes: tuple) -> tuple[NamedSharding, ...]:
    """One :func:`sharding` per axis in ``axes``."""
    return tuple(sharding(devices, axis_name, ax) for ax in axes)
