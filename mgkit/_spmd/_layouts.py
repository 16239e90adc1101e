"""The ledger's events for a placement and for a program's run, worked out once per layout and
cached (the ledger makes the events from a layout when they are read), and recording them once
the arrays they describe are ready."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .. import _contexts
from .._ledger import Kind, Layout, execution_label, ledger, link_shares
from .._transfer import source
from ._caches import cached
from ._leaves import HOST_TYPES, concrete, dtype_of
from ._messages import fn_name
from ._targets import Targets


def record(layout: Layout, start: float, arrays: list, t0: float, done: float | None = None) -> None:
    """Records a cached layout's events (see ``_spmd_layout``) issued at ``start`` once
    ``arrays`` are ready, timed from ``t0``: at once when they are, else by the ledger's
    watcher. ``done``: the ``perf_counter`` time by which the work is known to be complete
    (``lands_at_once``), so the arrays need not be asked. The ledger keeps one entry per call
    and makes the events when they are read."""
    label = execution_label()
    if done is None:
        for a in arrays:
            if not a.is_ready():
                ledger().record_when_ready(layout.call(start, 0.0, label), arrays, t0)
                return
        done = time.perf_counter()
    ledger().record(layout.call(start, done - t0, label))


def spmd_layout(moves: list, targets: Targets, sizes: tuple[int, ...]) -> Layout:
    """The events of a placement of ``moves`` ((value, axis) pairs), one per (kind, source,
    context): the bytes that land on each context (see ``record``)."""
    layout = tuple(
        (*_HOST_SOURCE, value.shape, value.dtype, ax)
        if type(value) is np.ndarray
        else (*_HOST_SOURCE, np.shape(value), dtype_of(value), ax)
        if isinstance(value, HOST_TYPES)
        else (*_source(value), value.shape, value.dtype, ax)
        for value, ax in moves
    )
    return _spmd_layout(targets, sizes, layout)


_HOST_SOURCE = (_contexts.HOST, _contexts.HOST, None)


def _source(value: jax.Array) -> tuple[str, str, frozenset | None]:
    ctx, devices = source(value)
    return ctx.name, ctx.short, devices


def _with_shares(rows: list[tuple]) -> Layout:
    """(head, info) rows -> their ``Layout``, the heads being an event's first six fields."""
    shares = link_shares([(head[1], head[2], head[5]) for head, _ in rows])
    return Layout([(head, share, info) for (head, info), share in zip(rows, shares, strict=True)])


@cached(1024)
def _spmd_layout(targets: Targets, sizes: tuple[int, ...], layout: tuple) -> Layout:
    totals: dict[tuple, list] = {}
    for src_name, src_dev, src_devices, shape, dtype, ax in layout:
        itemsize = np.dtype(jax.dtypes.canonicalize_dtype(dtype)).itemsize
        per_row = (
            math.prod(shape) * itemsize if ax is None else math.prod(shape[:ax] + shape[ax + 1 :]) * itemsize
        )
        kind = Kind.REPLICATE if ax is None else Kind.SPLIT
        for ctx, size in zip(targets.contexts, sizes, strict=True):
            if src_devices == frozenset((ctx.device,)) or (ax is not None and not size):
                continue  # this part is already there, or it has no rows
            key = (kind, src_name, ctx.name, src_dev, ctx.short)
            entry = totals.setdefault(key, [0, 0, size])
            entry[0] += per_row if ax is None else per_row * size
            entry[1] += 1
    of = sum(sizes)
    return _with_shares(
        [
            ((*key, nbytes), {"arrays": count, "rows": rows, "of": of})
            for key, (nbytes, count, rows) in totals.items()
        ]
    )


def record_run(
    targets: Targets,
    sizes: tuple[int, ...],
    fn: Callable,
    path: str,
    start: float,
    of: int,
    outputs: Any,
    t0: float,
) -> None:
    """Records one ``run`` event per context with rows (its share of a call over ``of`` rows),
    once the outputs (a pytree) are ready."""
    layout = run_layout(targets, sizes, fn, path, of)
    record(layout, start, [concrete(x) for x in jax.tree_util.tree_leaves(outputs)], t0)


def run_layout(targets: Targets, sizes: tuple[int, ...], fn: Callable, path: str, of: int) -> Layout:
    """The ``run`` events of a call (see ``record``): one per context with rows."""
    return _run_layout(targets, sizes, fn_name(fn), path, of)


@cached(1024)
def _run_layout(targets: Targets, sizes: tuple[int, ...], fn: str, path: str, of: int) -> Layout:
    return _with_shares(
        [
            (
                (Kind.RUN, c.name, c.name, c.short, c.short, 0),
                {"fn": fn, "of": of, "path": path, "rows": size},
            )
            for c, size in zip(targets.contexts, sizes, strict=True)
            if size
        ]
    )
