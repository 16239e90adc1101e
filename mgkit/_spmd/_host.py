"""Split arrays to and from the host one shard at a time: ``to_host`` reads one, its padding left
out, and no device ever holds more than the shard it already has (``jax.device_get`` of a leaf
that cannot be split evenly would otherwise need it whole somewhere first); ``from_host`` places
a numpy array padded and split, each device receiving only its own shard. ``from_process_zero``
gives every process of a distributed run process 0's list of whole numbers."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def to_host(x: jax.Array, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """The leading ``shape`` block of ``x`` (default: all of it) as a new numpy array, copied
    from each shard that holds part of it: one copy per distinct block (a replicated block is
    read once), the padding past ``shape`` never copied.

    >>> import jax.numpy as jnp
    >>> to_host(jnp.arange(6.0).reshape(2, 3), (2, 2)).tolist()
    [[0.0, 1.0], [3.0, 4.0]]

    Args:
      x: a jax array, split or not (a stored leaf padded along its split axes).
      shape: the leaf's own shape, at most ``x.shape`` along each axis.

    Returns:
      A numpy array of ``shape`` and ``x``'s dtype.
    """
    shape = tuple(x.shape) if shape is None else tuple(shape)
    if len(shape) != x.ndim or any(s > d for s, d in zip(shape, x.shape, strict=True)):
        raise ValueError(f"to_host: shape {shape} is not a leading block of the array's {tuple(x.shape)}")
    if not x.is_fully_addressable:
        raise ValueError(
            "to_host: the array has shards in other processes; read it in each process "
            "(jax.experimental.multihost_utils.process_allgather) instead"
        )
    out = np.empty(shape, dtype=x.dtype)
    seen: set = set()
    for shard in x.addressable_shards:
        index = tuple(sl.indices(d)[:2] for sl, d in zip(shard.index, x.shape, strict=True))
        if index in seen:
            continue
        seen.add(index)
        want = tuple(slice(start, min(stop, s)) for (start, stop), s in zip(index, shape, strict=True))
        if any(w.start >= w.stop for w in want):  # a block of padding only
            continue
        local = tuple(slice(0, w.stop - w.start) for w in want)
        out[want] = np.asarray(shard.data)[local]  # the shard to the host, then its part
    return out


def from_host(x: Any, shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` (a numpy array) as the leading block of a new array of ``shape`` laid out by
    ``sharding``, zeros past it: each device receives its own shard, cut from ``x`` and padded
    on the host, so neither any device nor the host holds the padded array whole.

    >>> import jax, numpy as np
    >>> one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> from_host(np.ones((2, 2), np.float32), (3, 2), one).tolist()
    [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]

    Args:
      x: a numpy array (or a scalar), at most ``shape`` along each axis.
      shape: the stored shape (``x.shape`` padded along its split axes).
      sharding: how the stored array lies on the devices.

    Returns:
      A jax array of ``shape`` with ``x``'s dtype as JAX holds it (float64 as float32 unless
      64-bit mode is on).
    """
    x = np.asarray(x)
    shape = tuple(shape)
    if x.ndim != len(shape) or any(s > d for s, d in zip(x.shape, shape, strict=True)):
        raise ValueError(f"from_host: the array's {x.shape} is not a leading block of {shape}")
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)

    def block(index: tuple) -> np.ndarray:
        bounds = [sl.indices(d)[:2] for sl, d in zip(index, shape, strict=True)]
        out = np.zeros([stop - start for start, stop in bounds], dtype)
        have = tuple(slice(start, min(stop, s)) for (start, stop), s in zip(bounds, x.shape, strict=True))
        if all(h.start < h.stop for h in have):
            out[tuple(slice(0, h.stop - h.start) for h in have)] = x[have]
        return out

    return jax.make_array_from_callback(shape, sharding, block)


def from_process_zero(values: list[int]) -> list[int]:
    """Process 0's ``values`` (whole numbers of any size) in every process of a distributed run:
    what the processes must do together (orbax's deletes, which they take in step) decided once,
    where each one's own view (a listing of a folder another process is renaming in) can differ.
    Every process must call it at the same point; in one process it returns ``values``.

    >>> from_process_zero([3, 2**40])
    [3, 1099511627776]
    """
    values = [int(v) for v in values]
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    if any(v < 0 for v in values):
        raise ValueError(f"from_process_zero: {values} holds a negative number; only steps (>= 0) are sent")
    # int32 pieces: JAX holds integers in 32 bits unless 64-bit mode is on
    count = int(multihost_utils.broadcast_one_to_all(np.int32(len(values))))
    pieces = np.zeros((count, 3), np.int32)
    if jax.process_index() == 0 and count:
        pieces[:] = [[v >> 62, (v >> 31) & (2**31 - 1), v & (2**31 - 1)] for v in values]
    pieces = np.asarray(multihost_utils.broadcast_one_to_all(pieces)).astype(object)
    return [int(hi) << 62 | int(mid) << 31 | int(lo) for hi, mid, lo in pieces]
