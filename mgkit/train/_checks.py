"""Checks every trainer shares (``Trainer``, ``Ensemble``'s members, ``Pipeline``): the loss
function, the optimizer, the parameters, the key, and what the loss function returns."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from .. import _contexts
from .._errors import ContextError
from .._static import Model, describe, is_array
from .._transfer import leaves_of


class MissingInputError(TypeError, ValueError):
    """A required input is missing (a member without data or steps, a call without a batch):
    a TypeError, as for a missing argument, and a ValueError, as for a value out of bounds."""


def check_loss_fn(loss_fn: Any, where: str, what: str = "loss_fn(params, batch) -> scalar loss") -> Callable:
    if not callable(loss_fn):
        raise TypeError(
            f"{where}: loss_fn must be a function {what}; got {type(loss_fn).__name__} {loss_fn!r:.80}"
        )
    return loss_fn


def check_optimizer(optimizer: Any, where: str) -> optax.GradientTransformation:
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"{where}: optimizer must be an optax GradientTransformation (e.g. optax.adamw(1e-3), "
            f"optax.sgd(0.1)); got {type(optimizer).__name__} {optimizer!r:.80}{_maker_hint(optimizer)}"
        )
    return optimizer


def is_python_number(leaf: Any) -> bool:
    """Whether a leaf is a Python number (``2.0``, ``True``), not an array nor a numpy scalar."""
    return isinstance(leaf, numbers.Number) and not isinstance(leaf, np.generic)


def check_not_number(leaf: Any, name: str, where: str, what: str = "params") -> None:
    """Refuses a Python number leaf (``name``: its path) of a model: nothing says whether it is a
    parameter or a constant."""
    if is_python_number(leaf):
        raise TypeError(
            f"{where}: {what} leaf {name} is a Python {type(leaf).__name__} ({leaf!r}): is it a "
            f"parameter or a constant? To train it, make it an array, e.g. jnp.asarray({leaf!r}, "
            "jnp.float32); to hold it fixed, mark it static (eqx.field(static=True) in an Equinox "
            "module) or close over it in the function instead of keeping it in the model"
        )


def _maker_hint(optimizer: Any) -> str:
    """For an optimizer's name or its maker (``"adam"``, ``optax.adam``): how to make the optimizer."""
    name = optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", None)
    if not isinstance(name, str) or not callable(getattr(optax, name, None)):
        return ""
    what = f"{name!r} names" if isinstance(optimizer, str) else f"optax.{name} is the function that makes"
    return f"; {what} an optimizer: make one with its learning rate, e.g. optax.{name}(1e-3)"


def check_params(params: Any, where: str, what: str = "params") -> Model:
    """The model ``params`` as a trainer holds it (``Model``): its array leaves, each floating
    point and at least one, are trained; its other leaves (functions, strings, other objects:
    an Equinox module's activation) are held as given. A Python number is an error: nothing
    says whether it is a parameter or a constant."""
    arrays, held = 0, []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path) or "(the params themselves)"
        check_not_number(leaf, name, where, what)
        if not is_array(leaf):
            held.append(f"{name} ({describe(leaf)})")
            continue
        if isinstance(leaf, np.ndarray):
            leaves_of(leaf, where, lambda _, name=name: f"{what} leaf {name}")  # an object array is refused
        if not np.issubdtype(leaf.dtype, np.inexact):
            raise TypeError(
                f"{where}: {what} leaf {name} has dtype {leaf.dtype}; parameters are trained by "
                f"gradients, so they must be floating point (e.g. .astype(jnp.float32)); keep "
                "integer constants out of params (close over them in the function)"
            )
        arrays += 1
    if not arrays:
        others = f" (its leaves {', '.join(held[:3])} are not arrays, and are held as given)" if held else ""
        raise ValueError(
            f"{where}: {what} has no arrays{others}; give the model's parameters (a pytree of float arrays)"
        )
    return Model(params)


def check_key(key: Any, where: str) -> Any:
    if key is None:
        return None
    if (
        isinstance(key, jax.Array)
        and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        and key.shape == ()
    ):
        return key
    if isinstance(key, np.ndarray | jax.Array) and key.shape == (2,) and key.dtype == np.uint32:
        return jax.random.wrap_key_data(key)
    raise TypeError(
        f"{where}: key must be a PRNG key, e.g. key=jax.random.key(0) (or None: loss_fn takes no key); "
        f"got {type(key).__name__} {key!r:.80}"
    )


def check_scalar_loss(out: Any, has_aux: bool, where: str, what: str = "loss_fn") -> None:
    """What a loss function returned (from ``jax.eval_shape``): a floating-point scalar, or
    ``(scalar, aux)`` with ``has_aux``."""
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"{where}: has_aux=True, but {what} returned {type(out).__name__} {out!r:.120}; return "
                "(loss, aux), or leave has_aux out"
            )
        out = out[0]
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape != ():
        hint = "" if has_aux or not isinstance(out, tuple) else " (a tuple: (loss, aux)? pass has_aux=True)"
        raise TypeError(
            f"{where}: {what} must return a scalar, the mean loss over the batch's rows; it returned "
            f"shape {shape} dtype {dtype}{hint}; reduce it, e.g. return losses.mean()"
        )
    if not np.issubdtype(dtype, np.floating):
        raise TypeError(
            f"{where}: {what} returned a {dtype} scalar; the loss must be floating point to be "
            "differentiated (e.g. return loss.astype(jnp.float32))"
        )


def check_loss_on(
    loss_fn: Callable, params: Any, batch: Any, key: Any, has_aux: bool, where: str, on: str
) -> None:
    """What ``loss_fn(params, batch)`` (with ``key``, where given) returns on ``batch``'s shapes
    (``jax.eval_shape``: nothing compiles or runs): a floating-point scalar. ``on`` says how a
    loss function that raises failed (``"failed on the first batch"``)."""
    extra = () if key is None else (key,)
    try:
        out = jax.eval_shape(loss_fn, params, batch, *extra)
    except Exception as e:
        model = getattr(loss_fn, "model", None)  # a bound loss (``Model.bind``): what it gives loss_fn
        given = model.join(params) if isinstance(model, Model) else params
        nones = none_hint(e, {"params": given, "batch": batch})
        if key is None:
            raise type(e)(f"{where}: loss_fn(params, batch) {on}: {e}{nones}") from e
        raise type(e)(
            f"{where}: loss_fn(params, batch, key) {on}: {e}{nones}. The key is passed because key= was "
            "given; make loss_fn take (params, batch, key), or leave key= out"
        ) from e
    check_scalar_loss(out, has_aux, where)


def none_hint(error: BaseException, trees: dict[str, Any]) -> str:
    """For a function that failed on a None (``error`` names ``NoneType``): the paths of the
    None leaves of the named trees it was given, and how to fix them; else ``""``. JAX holds a
    None as an empty subtree, not an array, so it reaches the function as None."""
    if not isinstance(error, TypeError | AttributeError) or "NoneType" not in str(error):
        return ""
    paths = [
        f"{what}{jax.tree_util.keystr(path)}"
        for what, tree in trees.items()
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
        if leaf is None
    ]
    if not paths:
        return ""
    listed = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
    return (
        f"; {listed} {'is' if len(paths) == 1 else 'are'} None: JAX holds None as an empty subtree, not "
        "an array, so the function gets None there; give it an array (e.g. jnp.zeros(shape)), or take "
        "it out of the tree and out of the function"
    )


def device_context(name: Any, where: str, example: str = "dev0") -> _contexts.Context:
    """A context that computes: a context or device name (or a jax.Device), not host memory."""
    if not isinstance(name, str | jax.Device):
        raise TypeError(
            f"{where}: a context is a name such as {example!r}; got {type(name).__name__} {name!r}"
        )
    ctx = _contexts.resolve(name, where)
    if ctx.device is None:
        cmap = _contexts.context_map()
        raise ContextError(
            f"{where}: {name!r} means host memory, which computes nothing; use a device context such as "
            f"{list(cmap.names[:2])}"
        )
    return ctx
