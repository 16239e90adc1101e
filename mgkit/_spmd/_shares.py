"""How many rows each part gets, and padding uneven parts to equal ones (and trimming back)."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from ._caches import cached


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
