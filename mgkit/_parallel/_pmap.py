"""``mg.pmap``: ``jax.pmap``'s semantics on ``jax.shard_map``, one slice per context."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._spmd import Batch, dtype_of, explained, fn_name, is_abstract, note_run, place_spmd, record_run
from ._batch import call_batch, check_axes, check_in_axes
from ._calls import pmap_program


def pmap(
    fn: Callable, axis_name: str = "i", contexts: Any = None, in_axes: Any = 0, out_axes: Any = 0
) -> Callable:
    """``jax.pmap``'s semantics on ``jax.shard_map``: one slice of the mapped axis per context.

    ``fn`` sees one slice (the mapped axis removed) and may use collectives over ``axis_name``
    (``jax.lax.psum``, ``pmean``, ``all_gather``, ``ppermute``, ``axis_index``...), with
    ``jax.pmap``'s results: as in ``jax.pmap``, values are not tracked as varying or invariant
    over the axis (a ``lax.scan`` carry may start as ``0`` and add ``axis_index``), and ``psum``
    of a value shared with ``in_axes=None`` sums one copy per context. Outputs are stacked along
    ``out_axes``, one slice per context, sharded over the contexts; ``out_axes=None`` returns a
    value that is the same on every context (e.g. after ``psum``). The contexts must be distinct
    devices of one kind, as for pmap.

    The mapped function works inside ``jax.jit``, ``jax.grad`` and ``jax.vmap`` (``vmap`` maps
    over another axis of the arguments; each call still takes one slice per context).

    A collective over an axis that is not bound raises ``UnboundAxisError``: a ``NameError``,
    as in ``jax.pmap``, and a ``ValueError``; its message names the axis and the fix.

    >>> import mgkit as mg, numpy as np, jax
    >>> _ = mg.use_contexts("a->cpu0;b->cpu1", verbose=False)
    >>> total = mg.pmap(lambda v: jax.lax.psum(v, "i"), out_axes=None)(np.array([1.0, 2.0]))
    >>> float(total)
    3.0
    """
    if not callable(fn):
        raise TypeError(f"pmap: fn must be callable, got {type(fn).__name__} {fn!r}")
    if not isinstance(axis_name, str) or not axis_name:
        raise TypeError(f"pmap: axis_name must be a non-empty str such as 'i', got {axis_name!r}")
    check_in_axes(in_axes, "pmap")
    check_axes(out_axes, "out_axes", "pmap")
    layouts: dict = {}  # tree structure of (args, kwargs) -> one axis per leaf

    @functools.wraps(fn)
    def mapped(*args, **kwargs):
        batch, targets = call_batch(fn, contexts, in_axes, args, kwargs, "pmap", layouts)
        k = len(targets.names)
        if not targets.spmd:
            kinds = ", ".join(f"{c.name}->{c.short}" for c in targets.contexts)
            raise ValueError(
                f"pmap: its contexts must be distinct devices of one kind, but {kinds} share a device or "
                "mix kinds; choose such contexts with contexts=[...], or use mg.parallel, which runs on "
                "any contexts"
            )
        if batch.n != k:
            i = next(j for j, ax in enumerate(batch.axes) if ax is not None)
            raise ValueError(
                f"pmap: {batch.names(i)} has {batch.n} slices along axis {batch.axes[i]} (shape "
                f"{tuple(np.shape(batch.leaves[i]))}), but there are {targets.describe()}; pmap takes "
                f"exactly one slice per context (use mg.parallel to split a batch of any size)"
            )
        placed = place_spmd(batch, targets, (1,) * k, axis_name)
        traced = is_abstract(batch.leaves)
        program = pmap_program(fn, batch, out_axes, targets, axis_name, traced)
        start, t0 = time.time(), time.perf_counter()
        try:
            out = explained(program, *placed)
        except (AssertionError, NameError) as e:
            better = _unbound_axis(fn, batch, axis_name)
            if better is None:
                raise
            raise better from e
        if not traced:
            if targets.devices[0].platform == "cpu" and k > 1:
                jax.block_until_ready(out)  # two CPU collective programs in flight can deadlock
            record_run(targets, (1,) * k, fn, "pmap", start, k, out, t0)
            note_run(program, placed, targets.contexts, f"pmap of {fn_name(fn)}", start)
        return out

    return mapped


_UNBOUND = re.compile(r"unbound axis name: ([^\s.]+)")


class UnboundAxisError(ValueError, NameError):
    """A mapped function's collectives name an axis that ``mg.pmap`` does not bind. A
    ``NameError``, as ``jax.pmap``'s is (``name``: the axis), and a ``ValueError``."""


def _unbound_axis(fn: Callable, batch: Batch, axis_name: str) -> UnboundAxisError | None:
    """The error for a function whose collectives name an axis other than ``axis_name`` (JAX's
    own is an empty AssertionError from inside shard_map, or a NameError), else None. ``jax.vmap`` binds only
    ``axis_name`` and names the first other axis the function uses."""

    def flat(*leaves):
        args, kwargs = jax.tree_util.tree_unflatten(batch.treedef, leaves)
        return fn(*args, **kwargs)

    shapes = [jax.ShapeDtypeStruct(np.shape(x), dtype_of(x)) for x in batch.leaves]
    try:
        jax.eval_shape(jax.vmap(flat, in_axes=batch.axes, axis_name=axis_name), *shapes)
    except NameError as e:
        found = _UNBOUND.search(str(e))
        if found is None:
            return None
        used = found.group(1)
        error = UnboundAxisError(
            f"pmap: axis_name={axis_name!r} was given, but {fn_name(fn)} uses a collective over the axis "
            f"{used!r}, which is not bound; pass axis_name={used!r} to mg.pmap, or name {axis_name!r} in "
            f"{fn_name(fn)}'s collectives (e.g. jax.lax.psum(x, {axis_name!r}))"
        )
        error.name = used
        return error
    except Exception:  # noqa: BLE001 - the diagnosis failed another way: keep JAX's error
        return None
    return None
