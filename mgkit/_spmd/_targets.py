"""The contexts a program runs on: context names resolved once against the current map."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax

from .. import _contexts, _devices
from .._contexts import Context, ContextMap
from .._errors import ContextError
from ._caches import cached


class Targets(NamedTuple):
    """The contexts a program runs on, each resolved once against the current map."""

    contexts: tuple[Context, ...]
    spmd: bool  # distinct devices of one kind: one SPMD program can span them

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.contexts)

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return tuple(c.device for c in self.contexts)

    def only(self, i: int) -> Targets:
        """The i-th context alone."""
        return Targets((self.contexts[i],), True)

    def first(self, k: int) -> Targets:
        """The first k contexts."""
        return Targets(self.contexts[:k], self.spmd)

    def describe(self) -> str:
        return f"{len(self.names)} context(s): {', '.join(self.names)}"


def resolve(contexts: Any, fn: str) -> Targets:
    """Context names (None: every context in the map; an int n: the first n) -> Targets."""
    cmap = _contexts.context_map()
    if contexts is None:
        spec: Any = None
    elif isinstance(contexts, bool):
        raise TypeError(f"{fn}: contexts={contexts!r}; pass context names, a count or None")
    elif isinstance(contexts, numbers.Integral):
        spec = int(contexts)
    elif isinstance(contexts, str | jax.Device):
        spec = (contexts,)
    elif isinstance(contexts, ContextMap):
        spec = tuple(contexts.names) if contexts == cmap else contexts
    elif isinstance(contexts, Mapping | Sequence):
        spec = tuple(contexts)
    else:
        raise TypeError(
            f"{fn}: contexts must be a list of context names (e.g. {list(cmap.names[:2])}), a count "
            f"or None for every context; got {type(contexts).__name__} {contexts!r}"
        )
    return _resolve(cmap, spec, fn)


@cached(256)
def _resolve(cmap: ContextMap, spec: Any, fn: str) -> Targets:
    if isinstance(spec, ContextMap):  # a map that is not installed: use its own devices
        contexts = tuple(Context(name, d, _devices.short_name(d)) for name, d in spec.devices().items())
    else:
        if spec is None:
            names = cmap.names
        elif isinstance(spec, int):
            if not 1 <= spec <= len(cmap):
                raise ValueError(
                    f"{fn}: contexts={spec}, but the map has {len(cmap)} context(s) ({cmap}); "
                    f"pass a count from 1 to {len(cmap)}, or context names"
                )
            names = cmap.names[:spec]
        else:
            names = spec
        if not names:
            raise ValueError(
                f"{fn}: the context list is empty; pass context names such as {list(cmap.names[:2])}, "
                f"or contexts=None for every context in the map ({cmap})"
            )
        contexts = tuple(_contexts.resolve(name, fn) for name in names)
        host = [c.name for c in contexts if c.device is None]
        if host:
            raise ContextError(
                f"{fn}: {host[0]!r} means host memory, which runs nothing; pass device contexts "
                f"such as {list(cmap.names[:2])}"
            )
    names = tuple(c.name for c in contexts)
    devices = tuple(c.device for c in contexts)
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(
            f"{fn}: context {repeated[0]!r} is listed more than once in {list(names)}; to run two "
            f"parts on one device, map two names to it, e.g. mg.use_contexts('a->cpu0;b->cpu0')"
        )
    spmd = len(set(devices)) == len(devices) and len({d.platform for d in devices}) == 1
    return Targets(contexts, spmd)


def per_context(values: Mapping, targets: Targets, what: str, fn: str) -> list:
    """The values of a {context: value} mapping in context order; every context exactly once."""
    unknown = [c for c in values if c not in targets.names]
    missing = [c for c in targets.names if c not in values]
    if unknown or missing:
        raise ValueError(
            f"{fn}: {what} must have one entry per context ({targets.describe()}); "
            + (f"unknown: {unknown}. " if unknown else "")
            + (f"missing: {missing}." if missing else "")
        )
    return [values[c] for c in targets.names]
