"""``mg.run_each``: one function per context, every context dispatched before any is waited on."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from .. import _contexts
from .._errors import ContextError
from .._ledger import Event, Kind, execution_label, ledger
from .._spmd import fn_name
from .._transfer import leaves_of, place


def run_each(tasks: Mapping[str, Any]) -> dict[str, Any]:
    """Runs one function per context, dispatching every context before waiting for any
    (Theano's two dot products on two GPUs in one call).

    Args:
      tasks: context -> ``fn``, ``(fn, args)`` or ``(fn, args, kwargs)``. Arguments not yet on
        that context are moved there (and recorded); ``fn`` runs inside ``mg.on(context)``.

    Returns:
      {context: result}, every result complete.

    >>> import mgkit as mg, numpy as np, jax.numpy as jnp
    >>> _ = mg.use_contexts("a->cpu0;b->cpu1", verbose=False)
    >>> r = mg.run_each({"a": (jnp.dot, (np.ones(3), np.ones(3))), "b": (jnp.sum, (np.ones(4),))})
    >>> {k: float(v) for k, v in r.items()}, mg.where(r["b"])
    ({'a': 3.0, 'b': 4.0}, 'b')
    """
    if not isinstance(tasks, Mapping):
        raise TypeError(
            f"run_each: tasks must be a dict context -> (fn, args), got {type(tasks).__name__}; "
            "e.g. mg.run_each({'dev0': (jnp.dot, (a0, b0)), 'dev1': (jnp.dot, (a1, b1))})"
        )
    if not tasks:
        raise ValueError("run_each: no tasks; pass {context: (fn, args), ...}")
    plan = []
    for ctx, task in tasks.items():
        fn, args, kwargs = _task(ctx, task)
        dest = _contexts.resolve(ctx, "run_each")
        if dest.device is None:
            raise ContextError(
                f"run_each: {ctx!r} is host memory, not a device context; name a context such as 'dev0'"
            )
        plan.append((ctx, dest, fn, args, kwargs))
    label = execution_label()
    running = []
    for ctx, dest, fn, args, kwargs in plan:
        leaves, treedef = leaves_of((args, kwargs), "run_each")
        args, kwargs = jax.tree_util.tree_unflatten(treedef, place(leaves, dest, Kind.TRANSFER))
        start, t0 = time.time(), time.perf_counter()
        try:
            with _contexts.on(dest.name if isinstance(ctx, str) else dest.device):
                out = fn(*args, **kwargs)
        except Exception as e:
            e.add_note(f"mgkit: raised by run_each's function for context {dest.name!r} ({dest.short})")
            raise
        running.append((ctx, dest, fn, out, start, t0))
    results = {}
    for ctx, dest, fn, out, start, t0 in running:
        out = jax.block_until_ready(out)
        info = {"fn": fn_name(fn), "path": "run_each"}
        seconds = time.perf_counter() - t0
        ledger().record(Event.on(Kind.RUN, dest, start, seconds, label, info))
        results[ctx] = out
    return results


def _task(ctx: Any, task: Any) -> tuple[Callable, tuple, dict]:
    if callable(task):
        return task, (), {}
    if isinstance(task, tuple) and 1 <= len(task) <= 3 and callable(task[0]):
        fn, args, kwargs = task[0], task[1] if len(task) > 1 else (), task[2] if len(task) > 2 else {}
        if not isinstance(args, tuple | list):
            raise TypeError(
                f"run_each: the arguments for context {ctx!r} must be a tuple, got {type(args).__name__}; "
                f"write ({fn_name(fn)}, (x,)) for one argument"
            )
        if not isinstance(kwargs, Mapping):
            raise TypeError(f"run_each: the keyword arguments for context {ctx!r} must be a dict")
        return fn, tuple(args), dict(kwargs)
    raise TypeError(
        f"run_each: the task for context {ctx!r} is {type(task).__name__} {task!r}; give fn, (fn, args) "
        "or (fn, args, kwargs) with a callable fn"
    )
