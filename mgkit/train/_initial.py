"""A trainer's parameters as given: arrays, or a function of no arguments that makes them (run as
one program whose outputs are created where they are to live, so no context holds more than its
share of a split leaf), and their shapes, read without allocating anything."""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from .._static import Model, held
from ._checks import check_not_number, check_params, is_python_number
from ._step import copied


def is_maker(params: Any) -> bool:
    """Whether ``params`` is a function that makes the parameters (not a pytree of arrays)."""
    return isinstance(params, types.FunctionType | types.MethodType | functools.partial)


class Initial(NamedTuple):
    """A trainer's parameters as given, read without allocating anything."""

    model: Model  # the arrays (or their shapes) and the leaves held as given (``_static``)
    shapes: Any  # the arrays' tree of ``jax.ShapeDtypeStruct`` (None where a leaf is held)
    make: Callable[[], Any] | None  # makes the arrays' tree (a function given), else None


def initial(params: Any, where: str) -> Initial:
    """The parameters as given: arrays, their shapes (``jax.ShapeDtypeStruct``), or a function
    of no arguments that makes them (``jax.eval_shape``: nothing runs). Checks that every array
    is floating point; other leaves (an Equinox module's functions) are held as given."""
    if not is_maker(params):
        model = check_params(params, where)
        shapes = jax.tree_util.tree_map(  # in the dtype JAX places them as (float64 as float32 without x64)
            lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(x.dtype)), model.arrays
        )
        return Initial(model, shapes, None)
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
    numbers_: list = []  # the Python numbers among its leaves (eval_shape would make them arrays)

    def shaped() -> Any:
        made = params()
        numbers_.extend(
            (jax.tree_util.keystr(path), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(made)[0]
            if is_python_number(leaf)
        )
        return held(made)  # a module's functions ride in its structure

    try:
        shapes = jax.eval_shape(shaped)
    except TypeError as e:
        raise TypeError(
            f"{where}: params is a function {name}() whose result is not a pytree of arrays ({e}); "
            "return the parameters, e.g. {'w': jnp.zeros((784, 100))}"
        ) from None
    for path, leaf in numbers_:  # refused as the same number given directly is
        check_not_number(leaf, path or "(the params themselves)", where, f"what {name}() returns")
    model = check_params(shapes, where, f"what {name}() returns")
    return Initial(model, model.arrays, lambda: Model(params()).arrays)


def param_shapes(params: Any, where: str) -> Any:
    """The parameters' arrays as a tree of ``jax.ShapeDtypeStruct`` (see :func:`initial`)."""
    return initial(params, where).shapes


def made(start: Initial, target: jax.sharding.Sharding) -> Any:
    """The parameters' arrays laid out by ``target``: made there by the function, or fresh
    copies of the arrays (never the caller's buffers: the step donates what it is given)."""
    if start.make is not None:
        return jax.jit(start.make, out_shardings=target)()
    return copied(start.model.arrays, target)
