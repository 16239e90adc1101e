"""Where a fit's batches come from: arrays that mgkit batches (shuffled by a seed, so the order
is reproducible and a fit can resume where it stopped), a function of the step, or any iterable
of batches."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from .._numbers import whole
from .._transfer import leaf_paths, leaves_of

DEFAULT_BATCH = 256  # rows per batch when the caller does not say (or every row, when fewer)


def check_batch(batch: Any, where: str, what: str) -> tuple[list, Any, int]:
    """A batch's leaves, structure and rows: every leaf an array with rows along axis 0, the
    same number of them, at least one (a batch with fewer rows than contexts trains too: see
    ``_step``). ``what`` names the batch in messages."""
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
        raise ValueError(f"{where}: {what} has 0 rows; give at least one row")
    return leaves, treedef, n


def check_rows(batch: Any, where: str, what: str) -> tuple[list, Any, int]:
    """``check_batch`` of a batch given whole (data, ``mg.fits``'s batch), and its arrays hold
    numbers; a string is refused first (mgkit reads no files)."""
    _no_text(batch, where, what)
    out = check_batch(batch, where, what)
    _numeric(batch, _signature(batch), where, what)
    return out


def _no_text(data: Any, where: str, what: str, others: str = "") -> None:
    """A string or bytes given for arrays: an error saying mgkit reads no files or text."""
    if isinstance(data, str | bytes):
        raise TypeError(
            f"{where}: {what} is a {type(data).__name__} ({data!r:.80}); mgkit reads no files or text. "
            "Give arrays with rows along axis 0 (e.g. (X, y), read with np.load or pandas' .to_numpy())"
            f"{others}"
        )


class Signature(NamedTuple):
    """What every batch of a fit shares with its first: all but the row count."""

    treedef: Any  # the pytree structure
    leaves: tuple[tuple[tuple[int, ...], Any], ...]  # per leaf: (shape after axis 0, dtype or Python type)


def _signature(batch: Any) -> Signature:
    """A batch's ``Signature`` (host only: shapes and dtypes, nothing moves)."""
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    return Signature(treedef, tuple((np.shape(x)[1:], getattr(x, "dtype", type(x))) for x in leaves))


class BatchCheck:
    """Checks each batch of a fit against the first, on the host: the same structure, and per
    leaf the same shape but for the row count and the same dtype, so a batch that differs is
    named by its step and leaf before JAX sees it (a new shape would otherwise compile a new
    step, or fail inside it). The first batch's arrays must hold numbers."""

    def __init__(self, where: str):
        self.where = where
        self.first: Signature | None = None
        self.rows = 0  # the first batch's

    def __call__(self, batch: Any, step: int) -> None:
        sig = _signature(batch)
        if sig == self.first:
            return
        what = f"step {step}'s batch"
        if self.first is None:
            _numeric(batch, sig, self.where, what)
            self.first, self.rows = sig, _rows(batch)
            return
        raise _unlike(batch, sig, self, what)


def _numeric(batch: Any, sig: Signature, where: str, what: str) -> None:
    """Every array leaf of ``batch`` holds numbers (JAX has no strings, bytes, objects or dates)."""
    for path, (_, dtype) in zip(leaf_paths(batch, "(the batch itself)"), sig.leaves, strict=True):
        if isinstance(dtype, np.dtype) and dtype.kind in "USOMm":
            raise TypeError(
                f"{where}: {what} leaf {path} has dtype {dtype} (strings, bytes, objects or dates), "
                "which JAX cannot hold; encode it as numbers first, e.g. class labels as integers "
                "(np.unique(labels, return_inverse=True)[1])"
            )


def _rows(batch: Any) -> int | None:
    """The row count of a batch's first leaf (None where it has none)."""
    leaves = jax.tree_util.tree_leaves(batch)
    shape = np.shape(leaves[0]) if leaves else ()
    return shape[0] if shape else None


def _unlike(batch: Any, sig: Signature, check: BatchCheck, what: str) -> ValueError:
    """The error of a batch unlike the first: its structure, or its first leaf that differs."""
    first = check.first
    fix = (
        "every batch of a fit needs the first's structure, and per leaf its dtype and shape but "
        "for the row count (axis 0); make the data yield alike batches"
    )
    if sig.treedef != first.treedef:
        return ValueError(
            f"{check.where}: {what} has structure {sig.treedef}, and the first batch's was "
            f"{first.treedef}; {fix}"
        )
    n = _rows(batch)
    paths = leaf_paths(batch, "(the batch itself)")
    for path, (shape, dtype), (shape0, dtype0) in zip(paths, sig.leaves, first.leaves, strict=True):
        if (shape, dtype) != (shape0, dtype0):
            return ValueError(
                f"{check.where}: {what} leaf {path} has shape {(n, *shape)} dtype {dtype}, and the "
                f"first batch's had shape {(check.rows, *shape0)} dtype {dtype0}; {fix}"
            )
    return ValueError(f"{check.where}: {what} differs from the first batch; {fix}")


class ArraySource:
    """Batches of ``batch_size`` rows of arrays with rows along axis 0, in an order shuffled per
    epoch by ``(seed, epoch)``: batches run on across epochs, so every batch is full. The
    position (epoch, first row) is saved with checkpoints and restored on resume."""

    def __init__(self, data: Any, batch_size: Any, shuffle: bool, seed: int, k: int, where: str):
        leaves, self.treedef, n = check_rows(data, where, "data")
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
    (a list of batches, a generator, a DataLoader-like object). A list of arrays with one row
    count but not one shape and dtype (``[X, y]``) is read as the tuple ``(X, y)``; a string is
    an error (mgkit reads no files)."""
    if data is None:
        raise TypeError(
            f"{where}: data is None; give arrays (e.g. {{'x': X, 'y': y}}), a function or an iterable"
        )
    _no_text(data, where, "data", ", a function step -> batch, or an iterable of batches")
    if _columns(data):
        data = tuple(data)  # [X, y]: the columns of one data set, not two batches
    if callable(data) and not isinstance(data, np.ndarray | jax.Array):
        _no_batch_size(batch_size, where, "a function")
        return FunctionSource(data)
    if isinstance(data, np.ndarray | jax.Array | dict | tuple | numbers.Number) or _is_pytree_of_arrays(data):
        return ArraySource(data, batch_size, shuffle, seed, k, where)
    _no_batch_size(batch_size, where, "an iterable")
    return IterableSource(data, where)


def _columns(data: Any) -> bool:
    """Whether a list is the columns of one data set (``[X, y]``): arrays with the same row
    count and not all of one shape and dtype (the batches of a list of batches share theirs)."""
    if not isinstance(data, list) or len(data) < 2:
        return False
    if not all(isinstance(x, np.ndarray | jax.Array) and x.ndim for x in data):
        return False
    if len({x.shape[0] for x in data}) > 1:
        return False
    return len({(x.shape, x.dtype) for x in data}) > 1


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


def total_steps(src: Any, steps: Any, epochs: Any, where: str) -> int | None:
    """The steps a fit runs: ``steps``, ``epochs`` passes over arrays, or one epoch of arrays;
    None for an iterable (it runs until it ends). A function needs ``steps``."""
    if steps is not None and epochs is not None:
        raise TypeError(f"{where}: give steps= or epochs=, not both")
    if steps is not None:
        return whole(steps, "steps", where, lo=1, example=1000, note="steps to run")
    if epochs is not None:
        epochs = whole(epochs, "epochs", where, lo=1, example=5, note="passes over the data")
        if not isinstance(src, ArraySource):
            raise TypeError(f"{where}: epochs= needs arrays that mgkit batches; for other data give steps=")
        return epochs * src.steps_per_epoch
    if isinstance(src, ArraySource):
        return src.steps_per_epoch
    if isinstance(src, FunctionSource):
        raise TypeError(
            f"{where}: data is a function step -> batch; say how many steps to run, e.g. steps=1000"
        )
    return None
