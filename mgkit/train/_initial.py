"""A trainer's parameters as given: arrays, or a function of no arguments that makes them (run as
one program whose outputs are created where they are to live, so no context holds more than its
share of a split leaf), and their shapes, read without allocating anything."""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import jax
import numpy as np

from ._checks import check_params
from ._step import copied


def is_maker(params: Any) -> bool:
    """Whether ``params`` is a function that makes the parameters (not a pytree of arrays)."""
    return isinstance(params, types.FunctionType | types.MethodType | functools.partial)


def param_shapes(params: Any, where: str) -> Any:
    """The parameters' tree of ``jax.ShapeDtypeStruct``: of arrays (or shapes) as given, or of
    what a function of no arguments returns (``jax.eval_shape``: nothing runs). Checks that
    every leaf is a floating-point array."""
    if not is_maker(params):
        leaves = jax.tree_util.tree_leaves(params)
        if leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            check_params(jax.tree_util.tree_map(lambda s: np.zeros((0,), s.dtype), params), where)
            return params
        check_params(params, where)
        return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    name = getattr(params, "__name__", type(params).__name__)
    try:
        needed = [
            p.name
            for p in inspect.signature(params).parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    except (TypeError, ValueError):
        needed = []
    if needed:
        call = name if name.isidentifier() else "init_params"
        raise TypeError(
            f"{where}: params is a function {name}({', '.join(needed)}) that takes arguments; give a "
            f"function of no arguments that makes the parameters, e.g. lambda: {call}(jax.random.key(0))"
        )
    try:
        shapes = jax.eval_shape(params)
    except TypeError as e:
        raise TypeError(
            f"{where}: params is a function {name}() whose result is not a pytree of arrays ({e}); "
            "return the parameters, e.g. {'w': jnp.zeros((784, 100))}"
        ) from None
    check_params(
        jax.tree_util.tree_map(lambda s: np.zeros((0,), s.dtype), shapes), where, f"what {name}() returns"
    )
    return shapes


def made(params: Any, target: jax.sharding.Sharding) -> Any:
    """The parameters laid out by ``target``: made there by the function, or fresh copies of the
    arrays (never the caller's buffers: the step donates what it is given)."""
    if is_maker(params):
        return jax.jit(params, out_shardings=target)()
    return copied(params, target)
