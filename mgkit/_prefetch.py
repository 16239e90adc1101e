"""A bounded background loader: a thread takes the next batches from an iterable and places
them on the contexts while the caller computes on the current one.

``prefetch(iterable, contexts)`` places each batch as a data-parallel step needs it: one
array sharded over the contexts' mesh when they are distinct devices of one kind and the rows
divide evenly, else ``split``'s parts. ``Prefetch(iterable, place)`` is the general form, for a
caller with its own placement (a trainer).

The thread holds at most ``size`` placed batches, hands the caller the loader's exceptions at
the batch where they happened, and stops on ``close()``, on leaving a ``with`` block, on Ctrl-C
while the caller waits for a batch, and when the ``Prefetch`` is garbage collected.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from ._contexts import ContextMap
from ._numbers import whole
from ._parallel import split
from ._spmd import Batch, Targets, place_spmd, resolve, shares
from ._transfer import leaves_of

_SLICE = 0.1  # seconds: the longest either side blocks before it looks at the stop flag again
_JOIN = 0.5  # seconds close() waits for the thread (a slow next() of the iterable is not waited for)


class _Done:
    """The iterable is exhausted."""


class _Failed:
    """The loader raised: ``error`` at ``index`` (the batches before it were delivered)."""

    __slots__ = ("error", "index")

    def __init__(self, error: BaseException, index: int):
        self.error = error
        self.index = index


class _State:
    """What the loader thread and the caller share; it holds no reference to the ``Prefetch``,
    so a ``Prefetch`` that is dropped can be collected (and its finalizer stop the thread)."""

    def __init__(self, size: int):
        # A slot is taken before a batch is loaded and given back when the caller takes it: at
        # most ``size`` batches are placed ahead of the one the caller holds.
        self.slots = threading.Semaphore(size)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.stop = threading.Event()
        self.load = 0.0  # seconds in the iterable's next() and in place()
        self.wait_space = 0.0  # seconds the loader waited for a free slot
        self.thread: threading.Thread | None = None

    def drain(self) -> None:
        """Drops the batches not taken (frees their device memory)."""
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                return


def _load(state: _State, iterator: Iterator, place: Callable[[Any], Any]) -> None:
    """The loader thread: a free slot, next(), place(), put, until the iterable ends, raises,
    or ``stop`` is set."""
    try:
        for index in itertools.count():
            t0 = time.perf_counter()
            while not state.slots.acquire(timeout=_SLICE):
                if state.stop.is_set():
                    return
            t1 = time.perf_counter()
            state.wait_space += t1 - t0
            if state.stop.is_set():
                return
            try:
                item: Any = next(iterator)
            except StopIteration:
                item = _Done()
            except BaseException as e:  # noqa: BLE001 - handed to the caller at this position
                item = _Failed(e, index)
            else:
                try:
                    item = place(item)
                except BaseException as e:  # noqa: BLE001 - as above
                    item = _Failed(e, index)
            if state.stop.is_set():
                return
            state.load += time.perf_counter() - t1
            state.queue.put(item)
            if isinstance(item, _Done | _Failed):
                return
    finally:
        closer = getattr(iterator, "close", None)  # a generator's finally blocks run now
        if state.stop.is_set() and callable(closer):
            with contextlib.suppress(Exception):  # the caller stopped reading: nothing to tell it
                closer()


def _shutdown(state: _State, join: float) -> None:
    """Stops the loader: sets the flag, frees the slots and waits up to ``join`` seconds for the
    thread (which also ends on its own once a slow next() returns)."""
    state.stop.set()
    state.drain()
    thread = state.thread
    if join > 0 and thread is not None and thread is not threading.current_thread():
        thread.join(join)
    state.drain()


class Prefetch:
    """A bounded background loader over ``iterable``: a daemon thread calls ``place(batch)`` on
    each batch and keeps up to ``size`` placed batches ready ahead of the one the caller holds.

    Iterate it to get the placed batches in order. An exception from the iterable or from
    ``place`` is raised in the caller after the batches before it (the same exception, with the
    loader's traceback), and the loader stops; the end of the iterable ends the iteration.
    ``close()`` stops the thread (also on leaving ``with``, on Ctrl-C while waiting for a batch,
    and on garbage collection); iterating a closed ``Prefetch`` ends at once.

    Args:
      iterable: any iterable of batches (a list, a generator, an endless iterator).
      place: ``place(batch) -> placed batch``, called on the loader thread.
      size: how many batches are loaded and placed ahead of the one the caller holds (a whole
        number, at least 1): the memory the loader takes is ``size`` placed batches.
      where: the caller's name, for messages and the thread's name (``mgkit-prefetch-<where>``).

    >>> with Prefetch(range(3), lambda b: b * 10) as it:
    ...     list(it)
    [0, 10, 20]
    """

    def __init__(
        self, iterable: Iterable, place: Callable[[Any], Any], size: int = 2, where: str = "prefetch"
    ):
        size = whole(size, "size", where, lo=1, example=2, note="how many placed batches are kept ready")
        if not callable(place):
            raise TypeError(
                f"{where}: place must be a function place(batch) -> placed batch, got "
                f"{type(place).__name__} {place!r}; e.g. place=lambda b: mg.split(b)"
            )
        iterator = _iterator(iterable, where)
        self.size = size
        self.where = where
        self._state = state = _State(size)
        self._batches = 0
        self._wait_data = 0.0
        self._ended = False
        self._interrupted: Callable[[], bool] | None = None
        state.thread = threading.Thread(
            target=_load, args=(state, iterator, place), name=_thread_name(where), daemon=True
        )
        self._finalizer = weakref.finalize(self, _shutdown, state, 0.0)
        state.thread.start()

    def __iter__(self) -> Prefetch:
        return self

    def __next__(self) -> Any:
        try:
            item = self._take()
        except KeyboardInterrupt:
            _shutdown(self._state, 0.0)  # no waiting here: close() joins the thread
            self._ended = True
            raise
        if isinstance(item, _Failed):
            self._ended = True
            self.close()
            error = item.error
            if isinstance(error, StopIteration):  # would end the caller's loop silently (PEP 479)
                raise RuntimeError(
                    f"{self.where}: place(batch) raised StopIteration at batch {item.index}, which "
                    "would end the loop as if the data were exhausted; raise another exception there"
                ) from error
            before = {0: "", 1: ", after batch 0"}.get(item.index, f", after batches 0 to {item.index - 1}")
            error.add_note(f"mgkit: raised on the {self.where} loader thread at batch {item.index}{before}")
            raise error
        self._batches += 1
        return item

    def take(self, interrupted: Callable[[], bool]) -> Any:
        """The next batch, as ``next()`` gives it, for a caller that notes Ctrl-C itself (a
        trainer's loop): raises KeyboardInterrupt as soon as ``interrupted()`` turns true while it
        waits, and StopIteration when the batches are done."""
        self._interrupted = interrupted
        try:
            return next(self)
        finally:
            self._interrupted = None

    def _take(self) -> Any:
        """The next item from the loader, waited for in slices so that Ctrl-C comes back at once."""
        state = self._state
        if self._ended or state.stop.is_set():
            self._ended = True
            raise StopIteration
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    item = state.queue.get(timeout=_SLICE)
                    break
                except queue.Empty:
                    if self._interrupted is not None and self._interrupted():
                        raise KeyboardInterrupt from None
                    if state.stop.is_set() or not state.thread.is_alive():
                        try:  # the loader may have put its last item just before it ended
                            item = state.queue.get_nowait()
                            break
                        except queue.Empty:
                            self._ended = True
                            raise StopIteration from None
        finally:
            self._wait_data += time.perf_counter() - t0
        state.slots.release()
        if isinstance(item, _Done):
            self._ended = True
            raise StopIteration
        return item

    def close(self) -> None:
        """Stops the loader thread and drops the batches not taken. It waits for the thread at
        most half a second: a loader inside a slow ``next()`` of the iterable ends on its own as
        soon as that returns. Closing twice is harmless."""
        self._ended = True
        _shutdown(self._state, _JOIN)
        self._finalizer.detach()

    @property
    def closed(self) -> bool:
        """Whether the loader was told to stop (``close()``, Ctrl-C, or the loader's error)."""
        return self._state.stop.is_set()

    def stats(self) -> dict[str, float | int]:
        """Counts and seconds so far (``time.perf_counter``), for seeing which side waits.

        Returns:
          ``batches``: batches delivered to the caller; ``wait_data``: seconds the caller waited
          for a batch; ``wait_space``: seconds the loader waited for a free slot; ``load``:
          seconds the loader spent in the iterable's ``next()`` and in placing; ``size``: slots.
        """
        s = self._state
        return {
            "batches": self._batches,
            "wait_data": self._wait_data,
            "wait_space": s.wait_space,
            "load": s.load,
            "size": self.size,
        }

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        thread = self._state.thread
        status = (
            "closed" if self.closed else "running" if thread is not None and thread.is_alive() else "ended"
        )
        return f"Prefetch(size={self.size}, batches={self._batches}, {status})"


def _thread_name(where: str) -> str:
    return "mgkit-prefetch" if where == "prefetch" else f"mgkit-prefetch-{where}"


def _iterator(iterable: Any, where: str) -> Iterator:
    try:
        return iter(iterable)
    except TypeError:
        raise TypeError(
            f"{where}: iterable must be an iterable of batches (a list, a generator, an iterator), "
            f"got {type(iterable).__name__} {_short(iterable)}; e.g. "
            "mg.prefetch(({'x': X[i:i + 256]} for i in range(0, len(X), 256)))"
        ) from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def prefetch(iterable: Iterable, contexts: Any = None, size: int = 2) -> Prefetch:
    """Places the next batches of ``iterable`` on the contexts in a background thread while the
    caller works on the current one.

    Each batch is a pytree of arrays with rows along axis 0. When the contexts are distinct
    devices of one kind and the rows divide evenly, each leaf becomes one array sharded over the
    contexts' mesh along axis 0 (what a data-parallel program takes); otherwise the batch comes
    as ``mg.split(batch, contexts)`` does: a dict context name -> part. Every placement is
    recorded in the ledger. A batch whose leaves differ in rows, or with fewer rows than
    contexts, raises at that batch's position.

    Args:
      iterable: an iterable of batches (a list, a generator, an endless iterator).
      contexts: context names, a count (the first n) or None for every context in the map.
      size: how many placed batches are kept ready (a whole number, at least 1).

    Returns:
      A :class:`Prefetch`: iterate it, ``close()`` it (or use ``with``), read ``stats()``.

    >>> import mgkit as mg, numpy as np
    >>> _ = mg.use_contexts("a->cpu0;b->cpu1", verbose=False)
    >>> batches = ({"x": np.full((4, 2), i)} for i in range(3))
    >>> with mg.prefetch(batches) as it:
    ...     [(len(b["x"].devices()), int(b["x"].sum())) for b in it]   # each on both contexts
    [(2, 0), (2, 8), (2, 16)]
    """
    targets = resolve(contexts, "prefetch")
    if isinstance(iterable, Mapping):
        raise TypeError(
            f"prefetch: iterable is a {type(iterable).__name__} (keys {list(iterable)[:4]}), whose "
            "iteration gives its keys; pass an iterable of batches instead, e.g. "
            "mg.prefetch(({k: v[i:i + 256] for k, v in data.items()} for i in range(0, n, 256)))"
        )
    return Prefetch(iterable, _placer(targets, contexts), size, "prefetch")


def _placer(targets: Targets, contexts: Any) -> Callable[[Any], Any]:
    """``place(batch)`` for ``prefetch``: checks the batch (named by its index) and places it."""
    counter = itertools.count()
    k = len(targets.names)
    parts = contexts if isinstance(contexts, ContextMap) else targets.names  # for split, as resolved

    def place(batch: Any) -> Any:
        index = next(counter)

        def names(i: int) -> str:
            where = jax.tree_util.keystr(jax.tree_util.tree_leaves_with_path(batch)[i][0])
            return f"leaf {where} of batch {index}" if where else f"batch {index}"

        leaves, treedef = leaves_of(batch, "prefetch", names)
        n = _rows(leaves, names, index, targets)
        if targets.spmd and n % k == 0:
            batch_ = Batch(leaves, treedef, (0,) * len(leaves), n, names)
            return jax.tree_util.tree_unflatten(treedef, place_spmd(batch_, targets, shares(n, k)))
        return split(batch, parts)

    return place


def _rows(leaves: list, names: Callable[[int], str], index: int, targets: Targets) -> int:
    """The rows every leaf of batch ``index`` has along axis 0; at least one per context."""
    if not leaves:
        raise ValueError(
            f"prefetch: batch {index} holds no array; each batch is a pytree of arrays with rows "
            "along axis 0, e.g. {'x': np.ones((256, 784)), 'y': np.zeros(256, int)}"
        )
    n, first = None, 0
    for i, leaf in enumerate(leaves):
        shape = np.shape(leaf)
        if not shape:
            raise ValueError(
                f"prefetch: {names(i)} is a scalar ({_short(leaf)}); every leaf of a batch needs rows "
                "along axis 0 to be split across the contexts; give it a leading axis, e.g. np.full(n, value)"
            )
        if n is None:
            n, first = shape[0], i
        elif shape[0] != n:
            raise ValueError(
                f"prefetch: {names(i)} has {shape[0]} rows (shape {tuple(shape)}) but {names(first)} "
                f"has {n} (shape {tuple(np.shape(leaves[first]))}); every leaf of a batch needs the "
                "same number of rows along axis 0"
            )
    k = len(targets.names)
    if n < k:
        raise ValueError(
            f"prefetch: batch {index} has {n} row(s), fewer than the {targets.describe()} it is split "
            f"across; give batches of at least {k} rows, or fewer contexts (e.g. contexts={max(n, 1)})"
        )
    return int(n)
