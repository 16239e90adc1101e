"""``mg.parallel`` and ``mg.make_parallel``: ``fn`` wrapped so that each call splits its batch
across contexts and concatenates the outputs. How a call is planned, compiled and run:
``_calls``."""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from .. import _contexts
from .._oom import mapped_contexts, raise_if_out_of_memory
from .._spmd import Batch, Cache, Targets, dtype_of, fn_name, is_abstract, resolve, shares
from ._batch import call_batch, check_axes, check_in_axes, check_weights, hashable, slice_rows
from ._calls import PlanKey, host_layout, make_plan, plans, run, run_dispatch

PARALLEL_FIXES = (
    "fewer rows per call (split the batch into chunks and call once per chunk)",
    "more contexts, so each holds a smaller share (contexts=)",
    "free what the contexts hold (del the largest arrays listed)",
)


class _Resolved(NamedTuple):
    """A wrapper's contexts resolved for its last call."""

    cmap: Any  # the context map they were resolved against
    where: str  # the public function called, for messages
    contexts: Any  # the wrapper's ``contexts`` then
    targets: Targets


class _Hot(NamedTuple):
    """A wrapper's last planned call: the next call laid out like it runs its plan at once."""

    cmap: Any  # the context map of that call
    where: str  # the public function called
    treedef: Any  # the structure of (args, kwargs)
    layout: tuple  # (shape, dtype) per leaf (``host_layout``)
    plan: weakref.ref  # to the Plan, which only ``plans`` holds (mg.clear_caches() frees it)


class Parallel:
    """``fn`` split across contexts: call it like ``fn``; see :func:`parallel`."""

    def __init__(self, fn, contexts=None, in_axes=0, out_axes=0, weights=None, balance=None, to=None):
        if not callable(fn):
            raise TypeError(f"parallel: fn must be callable, got {type(fn).__name__} {fn!r}")
        check_in_axes(in_axes, "parallel")
        check_axes(out_axes, "out_axes", "parallel")
        if balance not in (None, "measured"):
            raise ValueError(
                f"parallel: balance={balance!r}; use None (even or weighted split) or 'measured'"
            )
        if balance is not None and weights is not None:
            raise ValueError("parallel: give weights= or balance='measured', not both")
        self.fn, self.contexts, self.in_axes, self.out_axes = fn, contexts, in_axes, out_axes
        self.weights, self.balance, self.to = weights, balance, to
        self._speeds: dict = {}
        self._layouts: dict = {}  # tree structure of (args, kwargs) -> one axis per leaf
        self._axes = (hashable(in_axes), hashable(out_axes))  # with fn, what its plans depend on
        self._plans = weights is None and balance is None and to is None  # whether calls are planned
        self._last: _Resolved | None = None
        self._hot: _Hot | None = None
        functools.update_wrapper(self, fn)

    def _targets(self, where: str) -> Targets:
        """``resolve(self.contexts, where)``, kept while the context map is the same one."""
        cmap = _contexts.context_map()
        last = self._last
        if last is not None and last.cmap is cmap and last.where == where and last.contexts is self.contexts:
            return last.targets
        targets = resolve(self.contexts, where)
        self._last = _Resolved(cmap, where, self.contexts, targets)
        return targets

    def _batch(self, args: tuple, kwargs: dict, where: str) -> tuple[Batch, Targets]:
        return call_batch(self.fn, self.contexts, self.in_axes, args, kwargs, where, self._layouts)

    def __call__(self, *args, **kwargs):
        return self._call(args, kwargs, "parallel")

    def _call(self, args: tuple, kwargs: dict, where: str) -> Any:
        """Runs a call (``_run``); an out-of-memory error becomes mgkit's report of what filled
        the contexts (``OutOfMemoryError``)."""
        try:
            return self._run(args, kwargs, where)
        except Exception as e:
            last = self._last
            on = [(c.name, c.device) for c in last.targets.contexts] if last is not None else None
            raise_if_out_of_memory(e, f"mg.{where}", on or mapped_contexts(), PARALLEL_FIXES)
            raise

    def _run(self, args: tuple, kwargs: dict, where: str) -> Any:
        """Runs a call: its plan when one was left by a call laid out like it (see ``_calls``),
        else by splitting, running and concatenating, which leaves a plan when it can."""
        key = None
        if self._plans:
            leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
            layout = host_layout(leaves)
            if layout is not None:
                cmap, hot = _contexts.context_map(), self._hot
                if (
                    hot is not None
                    and hot.cmap is cmap
                    and hot.where == where
                    and hot.treedef == treedef
                    and hot.layout == layout
                ):  # laid out like the last call: its plan, without the cache's key
                    plan = hot.plan()
                    if plan is not None:
                        return plan.run(leaves)
                key = PlanKey(self.fn, self._axes, where, treedef, self._targets(where), layout)
                plan = plans.find(key)
                if plan is not None:
                    self._hot = _Hot(cmap, where, treedef, layout, weakref.ref(plan))
                    return plan.run(leaves)
        batch, targets = self._batch(args, kwargs, where)
        if self.balance == "measured":
            speeds = self._measure(batch, targets)
            weights = tuple(speeds[n] for n in targets.names)
        else:
            weights = check_weights(self.weights, targets, where)
        sizes = shares(batch.n, len(targets.names), weights)
        out = run(self.fn, batch, targets, sizes, self.out_axes, self.to, where)
        if key is not None:
            make_plan(key, batch, sizes, self.out_axes)
        return out

    def speeds(self, *args, **kwargs) -> dict[str, float]:
        """Rows per second of ``fn`` on each context, measured once per input shape (cached).

        Each context runs its even share of the batch alone (after a warm-up call that compiles),
        so the figures are comparable; ``balance='measured'`` splits by them.
        """
        batch, targets = self._batch(args, kwargs, "parallel")
        return self._measure(batch, targets)

    def _measure(self, batch: Batch, targets: Targets) -> dict[str, float]:
        shapes = tuple((np.shape(x), dtype_of(x)) for x in batch.leaves)
        key = (targets.names, targets.devices, batch.treedef, batch.axes, shapes)
        if key in self._speeds:
            return self._speeds[key]
        if is_abstract(batch.leaves):
            raise TypeError("parallel: balance='measured' times real calls; call it outside jax.jit first")
        sizes = shares(batch.n, len(targets.names))
        speeds = {}
        for i, (name, size) in enumerate(zip(targets.names, sizes, strict=True)):
            one = targets.only(i)
            start = sum(sizes[:i])
            cut = [
                x if ax is None else slice_rows(x, start, size, ax)
                for x, ax in zip(batch.leaves, batch.axes, strict=True)
            ]
            part = batch._replace(leaves=cut, n=size)
            seconds = []
            for _ in range(3):  # compile, then two timed calls; keep the faster
                t0 = time.perf_counter()
                jax.block_until_ready(
                    run_dispatch(self.fn, part, one, (size,), self.out_axes, None, "parallel")
                )
                seconds.append(time.perf_counter() - t0)
            speeds[name] = max(size, 1) / max(min(seconds[1:]), 1e-9)
        self._speeds[key] = speeds
        return speeds

    def __repr__(self) -> str:
        return (
            f"mg.parallel({fn_name(self.fn)}, contexts={self.contexts!r}, in_axes={self.in_axes!r}, "
            f"out_axes={self.out_axes!r}, weights={self.weights!r}, balance={self.balance!r})"
        )


def parallel(
    fn: Callable | None = None,
    contexts: Any = None,
    in_axes: Any = 0,
    out_axes: Any = 0,
    weights: Any = None,
    balance: str | None = None,
    to: Any = None,
) -> Any:
    """Wraps ``fn`` so each call splits its batch across contexts and concatenates the outputs.

    ``f = mg.parallel(fn)`` then ``f(*args)`` equals ``fn(*args)`` for a function whose outputs
    have one row per input row, with part i computed on context i. Distinct devices of one kind
    run one SPMD program; contexts that share a device or mix kinds run one program each,
    dispatched together. Gradients flow through, each part's backward pass on its own device.

    Args:
      fn: the function; may be omitted to use ``@mg.parallel(in_axes=...)`` as a decorator.
      contexts: context names, a count (the first n) or None for every context in the map.
      in_axes: per positional argument, the axis to split or None for a value shared by every
        context (parameters); an int applies to all. Keyword arguments are split along axis 0.
      out_axes: the axis along which outputs are concatenated (None: the same on every context).
      weights: relative share of the batch per context (largest-remainder rounding).
      balance: ``"measured"`` times ``fn`` on each context once per input shape and splits by speed.
      to: where the result goes. None leaves it where it was computed when JAX can hold it there
        (an even split over distinct same-kind devices: one array sharded over the contexts),
        else on the first context; ``"cpu"`` returns host numpy.

    >>> import mgkit as mg, numpy as np, jax.numpy as jnp
    >>> _ = mg.use_contexts("a->cpu0;b->cpu1;c->cpu2", verbose=False)
    >>> f = mg.parallel(lambda w, x: x @ w, in_axes=(None, 0))
    >>> f(jnp.ones((2, 1)), np.ones((5, 2))).ravel().tolist()
    [2.0, 2.0, 2.0, 2.0, 2.0]
    """
    if fn is None:
        return functools.partial(
            parallel,
            contexts=contexts,
            in_axes=in_axes,
            out_axes=out_axes,
            weights=weights,
            balance=balance,
            to=to,
        )
    return Parallel(fn, contexts, in_axes, out_axes, weights, balance, to)


_MADE = Cache()  # (fn, contexts) -> the Parallel that make_parallel reuses (and its last plan)


def make_parallel(fn: Callable, contexts: Any = None, **kwargs: Any) -> Any:
    """TensorFlow's ``make_parallel``: every keyword argument is split along axis 0, ``fn`` runs on
    each context with its parts, and the outputs are concatenated along axis 0.

    Any batch size works, including sizes that do not divide by the number of contexts.

    >>> import mgkit as mg, numpy as np
    >>> _ = mg.use_contexts("a->cpu0;b->cpu1", verbose=False)
    >>> c = mg.make_parallel(lambda a, b: a + b, a=np.ones(5), b=np.arange(5.0))
    >>> c.tolist()
    [1.0, 2.0, 3.0, 4.0, 5.0]
    """
    if not callable(fn):
        raise TypeError(f"make_parallel: fn must be callable, got {type(fn).__name__} {fn!r}")
    if not kwargs:
        raise TypeError(
            "make_parallel: no keyword arguments to split; pass the batches by name, "
            "e.g. mg.make_parallel(model, x=x, y=y)"
        )
    try:
        wrapper = _MADE.get((fn, contexts), lambda: Parallel(fn, contexts))
    except TypeError:  # unhashable contexts (a list): no reuse
        wrapper = Parallel(fn, contexts)
    return wrapper._call((), kwargs, "make_parallel")
