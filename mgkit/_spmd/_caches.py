"""The caches of compiled programs and of what is worked out beside them, and ``clear_caches``,
which empties every one of them."""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable
from typing import Any

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
        value = self.find(key)
        if value is None:
            value = build()
            self.add(key, value)
        return value

    def find(self, key: Any) -> Any:
        """The value cached under ``key``, else None."""
        value = self._items.get(key)  # a hit needs no lock: each OrderedDict call is atomic
        if value is not None:
            try:  # noqa: SIM105 - contextlib.suppress costs more than this hit path's work
                self._items.move_to_end(key)
            except KeyError:  # dropped meanwhile by another thread: still a valid value
                pass
        return value

    def add(self, key: Any, value: Any) -> None:
        """Caches ``value`` under ``key``, dropping the least recently used entry when full."""
        with self._lock:
            self._items[key] = value
            if len(self._items) > self._size:
                self._items.popitem(last=False)

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


programs = Cache()  # every compiled program mgkit keeps: key -> jitted function


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
