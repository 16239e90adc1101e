"""Where a fit's batches come from: arrays that mgkit batches (shuffled by a seed, so the order
is reproducible and a fit can resume where it stopped), a function of the step, or any iterable
of batches."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from .._numbers import whole
from .._transfer import leaf_paths, leaves_of

DEFAULT_BATCH = 256  # rows per batch when the caller does not say (or every row, when fewer)


def check_batch(batch: Any, k: int, where: str, what: str) -> tuple[list, Any, int]:
    """A batch's leaves, structure and rows: every leaf an array with rows along axis 0, the
    same number of them, at least one per context. ``what`` names the batch in messages."""
    leaves, treedef = leaves_of(batch, where)
    if not leaves:
        raise ValueError(f"{where}: {what} has no arrays; give a pytree of arrays with rows along axis 0")
    shapes = [np.shape(leaf) for leaf in leaves]
    counts = {shape[0] if shape else None for shape in shapes}
    if len(counts) > 1 or None in counts:  # the leaves are named only for a message (per batch)
        paths = leaf_paths(batch, "(the batch itself)")
        for path, shape in zip(paths, shapes, strict=True):
            if not shape:
                raise ValueError(
                    f"{where}: {what} leaf {path} is a scalar; every leaf needs rows along axis 0 "
                    f"(e.g. x of shape (n, features), y of shape (n,))"
                )
        listed = ", ".join(f"{p}: {shape[0]}" for p, shape in zip(paths, shapes, strict=True))
        raise ValueError(
            f"{where}: {what}'s leaves have different row counts ({listed}); every leaf needs the "
            "same number of rows along axis 0, one per example"
        )
    n = shapes[0][0]
    if n == 0:
        raise ValueError(f"{where}: {what} has 0 rows; give at least one row per context ({k} or more)")
    if n < k:
        raise ValueError(
            f"{where}: {what} has {n} row(s), fewer than the {k} contexts it is split over; give "
            f"at least {k} rows per batch (batch_size >= {k}) or train on fewer contexts"
        )
    return leaves, treedef, n


class ArraySource:
    """Batches of ``batch_size`` rows of arrays with rows along axis 0, in an order shuffled per
    epoch by ``(seed, epoch)``: batches run on across epochs, so every batch is full. The
    position (epoch, first row) is saved with checkpoints and restored on resume."""

    def __init__(self, data: Any, batch_size: Any, shuffle: bool, seed: int, k: int, where: str):
        leaves, self.treedef, n = check_batch(data, 1, where, "data")
        self.leaves = [leaf if isinstance(leaf, jax.Array) else np.asarray(leaf) for leaf in leaves]
        self.rows = n
        if batch_size is None:
            batch_size = min(n, DEFAULT_BATCH)
        self.batch_size = whole(batch_size, "batch_size", where, lo=1, example=min(n, DEFAULT_BATCH))
        if self.batch_size > n:
            raise ValueError(
                f"{where}: batch_size={self.batch_size} is larger than the data ({n} rows); use "
                f"batch_size <= {n}"
            )
        if self.batch_size < k:
            raise ValueError(
                f"{where}: batch_size={self.batch_size} is smaller than the {k} contexts it is split "
                f"over; use batch_size >= {k}"
            )
        self.shuffle, self.seed = bool(shuffle), seed
        self.epoch, self.index = 0, 0
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.rows / self.batch_size)

    def _perm(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            perm = (
                np.random.default_rng([self.seed, epoch]).permutation(self.rows)
                if self.shuffle
                else np.arange(self.rows)
            )
            self._order = (epoch, perm)
        return self._order[1]

    def next(self, step: int) -> Any:
        """The next batch (``step`` is not needed: the position says where it starts)."""
        parts, want = [], self.batch_size
        while want:
            perm = self._perm(self.epoch)
            take = perm[self.index : self.index + want]
            parts.append(take)
            want -= len(take)
            self.index += len(take)
            if self.index == self.rows:
                self.epoch, self.index = self.epoch + 1, 0
        idx = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return jax.tree_util.tree_unflatten(self.treedef, [leaf[idx] for leaf in self.leaves])

    @property
    def position(self) -> dict:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "rows": self.rows,
        }

    def seek(self, position: dict) -> None:
        self.epoch, self.index = int(position["epoch"]), int(position["index"])


class FunctionSource:
    """Batches from ``fn(step)``: the global step number, so a resumed fit asks for the same
    batches an uninterrupted one would."""

    def __init__(self, fn: Callable[[int], Any]):
        self.fn = fn

    def next(self, step: int) -> Any:
        return self.fn(step)

    @property
    def position(self) -> dict:
        return {}

    def seek(self, position: dict) -> None:
        pass


class IterableSource:
    """Batches from any iterable, in its order (a resumed fit goes on with what it yields next)."""

    def __init__(self, iterable: Iterable, where: str):
        try:
            self.it: Iterator = iter(iterable)
        except TypeError:
            raise TypeError(
                f"{where}: data must be a pytree of arrays, a function step -> batch or an iterable of "
                f"batches; got {type(iterable).__name__} {iterable!r:.80}"
            ) from None

    def next(self, step: int) -> Any:
        return next(self.it)

    @property
    def position(self) -> dict:
        return {}

    def seek(self, position: dict) -> None:
        pass


def source(data: Any, batch_size: Any, shuffle: bool, seed: int, k: int, where: str) -> Any:
    """The batch source for ``data``: an array, or a dict, tuple or other pytree of arrays (rows
    along axis 0) that mgkit batches; a callable ``step -> batch``; or an iterable of batches
    (a list of batches, a generator, a DataLoader-like object)."""
    if data is None:
        raise TypeError(
            f"{where}: data is None; give arrays (e.g. {{'x': X, 'y': y}}), a function or an iterable"
        )
    if callable(data) and not isinstance(data, np.ndarray | jax.Array):
        _no_batch_size(batch_size, where, "a function")
        return FunctionSource(data)
    if isinstance(data, np.ndarray | jax.Array | dict | tuple | numbers.Number) or _is_pytree_of_arrays(data):
        return ArraySource(data, batch_size, shuffle, seed, k, where)
    _no_batch_size(batch_size, where, "an iterable")
    return IterableSource(data, where)


def _is_pytree_of_arrays(data: Any) -> bool:
    if isinstance(data, list) or hasattr(data, "__next__") or hasattr(data, "__iter__"):
        return False  # a list of batches, an iterator, a loader: batches, not arrays
    leaves = jax.tree_util.tree_leaves(data)
    return bool(leaves) and all(isinstance(x, np.ndarray | jax.Array) for x in leaves)


def _no_batch_size(batch_size: Any, where: str, what: str) -> None:
    if batch_size is not None:
        raise TypeError(
            f"{where}: batch_size={batch_size!r} applies to arrays that mgkit batches; data is {what}, "
            "whose batches already have their size: leave batch_size out"
        )
