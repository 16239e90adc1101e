"""What a leaf of a call's arguments is: the array behind it (a tracer may stand for none), and
its dtype."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

HOST_TYPES = (np.ndarray, np.generic, numbers.Number)  # leaves held in host memory


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


def dtype_of(leaf: Any) -> np.dtype:
    """The dtype of an array or of a Python number."""
    dtype = getattr(leaf, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.result_type(leaf)
