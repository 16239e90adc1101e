"""Reading a split array to the host one shard at a time, its padding left out: no device ever
holds more than the shard it already has (``jax.device_get`` of a leaf that cannot be split
evenly would otherwise need it whole somewhere first)."""

from __future__ import annotations

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
