"""Mixed precision: the loss function computed in bfloat16 or float16 over float32 parameters.

The parameters and optimizer state stay float32 (master weights). ``in_precision`` wraps the
loss function so that it sees the parameters and the batch's floating leaves cast to the
compute dtype and returns its loss (and floating aux) as float32; the gradient with respect to
the float32 parameters comes back float32 through the casts.

float16 overflows at 65504 and loses small gradients below 6e-8, so ``"fp16"`` adds a dynamic
loss scale (``LossScale``): the backward pass runs on ``loss * scale`` and the gradients are
divided back in float32. A step whose loss is finite but whose scaled gradients are not has
overflowed: its update is skipped and the scale halved (``next_scale``); after ``GROWTH_EVERY``
finite steps in a row the scale doubles. A non-finite loss, or gradients that are still not
finite at the scale's floor (``MINIMUM``), is left to the trainer's non-finite guard
(``on_nan``), as at float32.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PRECISIONS = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
INITIAL = 2.0**15  # the first loss scale (as jmp and PyTorch's GradScaler start)
GROWTH_EVERY = 2000  # finite steps in a row after which the scale doubles
MINIMUM = 1.0  # the scale is never halved below this: overflow there is a non-finite gradient


class PrecisionWarning(UserWarning):
    """Reduced precision (``precision="bf16"`` or ``"fp16"``) on CPU: it gives the same
    low-precision numbers but is not faster there (CPUs have no fast bfloat16/float16 units)."""


class LossScale(NamedTuple):
    """The dynamic loss scale of ``precision="fp16"``, carried from step to step (arrays)."""

    scale: jax.Array  # float32: the loss is multiplied by it before the backward pass
    good: jax.Array  # int32: finite steps since the scale last changed
    overflow: jax.Array  # bool: the last step overflowed (its update skipped, the scale halved)


def check_precision(precision: Any, where: str) -> str:
    """``precision`` as given, where it is one of ``PRECISIONS``."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(
            f"{where}: precision={precision!r} is not one of {sorted(PRECISIONS)}; use 'fp32' (the"
            " default), 'bf16' (bfloat16 compute, float32 weights) or 'fp16' (float16 compute with a"
            " dynamic loss scale), e.g. precision='bf16'"
        )
    return precision


def warn_if_cpu(precision: str, devices: tuple, where: str) -> bool:
    """Warns (``PrecisionWarning``) that reduced precision is not faster where ``devices`` are
    CPUs; returns whether it warned."""
    if precision == "fp32" or devices[0].platform != "cpu":
        return False
    warnings.warn(
        f"{where}: precision={precision!r} on CPU computes in {jnp.dtype(PRECISIONS[precision]).name}"
        " but is not faster than 'fp32' there (CPUs have no fast half-precision units); use it on"
        " a GPU or TPU, or keep precision='fp32' on CPU",
        PrecisionWarning,
        stacklevel=4,
    )
    return True


def _cast(tree: Any, dtype: Any, only_below: int | None = None) -> Any:
    """``tree`` with its floating leaves cast to ``dtype`` (with ``only_below``: only those of
    fewer bytes per element); integer leaves and PRNG keys are left as they are."""

    def one(x: Any) -> Any:
        kind = getattr(x, "dtype", None)
        if kind is None or not jnp.issubdtype(kind, jnp.floating):
            return x
        if only_below is not None and jnp.dtype(kind).itemsize >= only_below:
            return x
        return x.astype(dtype)

    return jax.tree_util.tree_map(one, tree)


def in_precision(loss_fn: Callable, precision: str) -> Callable:
    """``loss_fn`` computed in ``precision``'s dtype: it sees the parameters and the batch's
    floating leaves cast to it, and its half-precision outputs come back float32. ``"fp32"``:
    ``loss_fn`` itself.

    >>> import jax.numpy as jnp
    >>> low = in_precision(lambda p, b: jnp.sum(p * b["x"]), "bf16")
    >>> low(jnp.ones(2), {"x": jnp.ones(2)}).dtype
    dtype('float32')
    """
    if precision == "fp32":
        return loss_fn
    dtype = PRECISIONS[precision]

    def low(params: Any, batch: Any, *key: Any) -> Any:
        out = loss_fn(_cast(params, dtype), _cast(batch, dtype), *key)
        return _cast(out, jnp.float32, only_below=4)

    return low


def initial_scale() -> LossScale:
    """The loss scale a float16 fit starts from."""
    return LossScale(jnp.float32(INITIAL), jnp.int32(0), jnp.bool_(False))


def finite(tree: Any) -> jax.Array:
    """Whether every leaf of ``tree`` is finite, from one fused sum per leaf (a NaN or an
    infinity anywhere makes the total so; sums accumulate in at least float32)."""
    total = jnp.float32(0)
    for x in jax.tree_util.tree_leaves(tree):
        total = total + jnp.sum(x, dtype=jnp.result_type(x.dtype, jnp.float32))
    return jnp.isfinite(total)


def value_and_grad(f: Callable, params: Any, scale: LossScale | None) -> tuple:
    """(loss, aux, grads) of ``f(params) -> (loss, aux)``; with ``scale``, the backward pass runs
    on ``loss * scale.scale`` and the gradients are divided back (in float32)."""
    if scale is None:
        (loss, aux), grads = jax.value_and_grad(f, has_aux=True)(params)
        return loss, aux, grads

    def scaled(p: Any) -> tuple:
        loss, aux = f(p)
        return loss.astype(jnp.float32) * scale.scale, (loss, aux)

    (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(params)
    inverse = 1.0 / scale.scale
    return loss, aux, jax.tree_util.tree_map(lambda g: (g * inverse).astype(g.dtype), grads)


def next_scale(scale: LossScale | None, loss: jax.Array, grads: Any) -> LossScale | None:
    """The loss scale after a step of ``loss`` and (unscaled) ``grads``: doubled after
    ``GROWTH_EVERY`` finite steps in a row; halved where the loss is finite but a gradient is
    not and the scale is above ``MINIMUM`` (an overflow: the step is skipped); else kept."""
    if scale is None:
        return None
    loss_ok, grads_ok = jnp.isfinite(loss), finite(grads)
    overflow = loss_ok & ~grads_ok & (scale.scale > MINIMUM)
    good = jnp.where(loss_ok & grads_ok, scale.good + 1, 0)
    grow = good >= GROWTH_EVERY
    value = jnp.where(overflow, jnp.maximum(scale.scale / 2, MINIMUM), scale.scale)
    value = jnp.where(grow, value * 2, value)
    return LossScale(value.astype(jnp.float32), jnp.where(grow, 0, good).astype(jnp.int32), overflow)


def scale_entry(scale: LossScale) -> dict:
    """The loss scale as a checkpoint's JSON entry (a power of two and a count: exact)."""
    return {"scale": float(scale.scale), "good": int(scale.good)}


def scale_from(entry: dict) -> LossScale:
    """The loss scale a checkpoint's entry (``scale_entry``) saved."""
    return LossScale(jnp.float32(entry["scale"]), jnp.int32(entry["good"]), jnp.bool_(False))
