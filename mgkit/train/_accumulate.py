"""The gradient of a batch's mean loss, whole or accumulated over microbatches.

A step's batch comes as ``even``, rows split into ``groups`` equal blocks (one per device of
the SPMD step; one block on the gather-update-copy loop's contexts), and ``rest``, a few rows
every device holds (or None). ``batch_gradient`` returns the function
``(params, even, rest, key, scale) -> (loss, aux, grads)`` of the rows' mean loss:

- ``accumulate=1``: one ``jax.value_and_grad`` of the row-weighted mean of ``even``'s and
  ``rest``'s losses;
- ``accumulate=k``: each block is cut into ``k`` slices of ``c = m // k`` rows (``m`` rows per
  block); microbatch ``j`` is slice ``j`` of every block, and the microbatches run one after
  the other in a ``lax.scan``. Each block's loss, aux and gradient are computed apart (a
  ``vmap`` over the blocks, laid out like them: on the SPMD step each device computes and
  accumulates its own block's, in float32, and nothing crosses devices inside the scan); the
  blocks' last ``m - k * c`` rows follow as one more piece per block. Each piece is weighted by
  its rows over the batch's; the sum over the blocks after the scan is the step's one
  cross-device reduction; ``rest``, which every device holds, is added after it. The gradient
  equals the whole batch's (with rows that do not divide by ``k``), while only one
  microbatch's activations are live at a time. With a key, microbatch ``j`` draws with
  ``fold_in(fold_in(key, j), block)``.

With split parameters (``shard=``: a ``BlockSum``, the step's ``Placement``) no device holds a
whole-parameter sum: each device computes its block's gradient (a ``shard_map`` over the batch
axis), reduce-scatters it into a float32 sum split as the parameters are stored, microbatch by
microbatch, as FSDP does; and the parameters pass an optimization barrier each microbatch, so
XLA gathers them inside the loop and frees them in the backward pass, as a step of one
microbatch does, rather than gathering them once before the loop and holding them through it.
The peak is then that of a step of one microbatch (``tests/test_accumulate.py``).

``scale`` is float16's loss scale (``_precision.LossScale``) or None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._oom import program_bytes
from . import _precision


def call_loss(loss_fn: Callable, params, batch, key) -> Any:
    """``loss_fn(params, batch)``, or ``loss_fn(params, batch, key)`` for a trainer with a key."""
    return loss_fn(params, batch) if key is None else loss_fn(params, batch, key)


def rows(tree: Any) -> int:
    """The rows of a batch (its leaves' first axis)."""
    return jax.tree_util.tree_leaves(tree)[0].shape[0]


def rows_mean(loss_fn: Callable, has_aux: bool, pieces: list, key: Any) -> Callable:
    """``params -> (loss, aux)``: the row-weighted mean of ``loss_fn`` over ``pieces`` (batches
    of the same structure; one piece: its loss as it is); aux is the first piece's."""

    def f(params: Any) -> tuple:
        outs = [call_loss(loss_fn, params, piece, key) for piece in pieces]
        losses = [out[0] if has_aux else out for out in outs]
        aux = outs[0][1] if has_aux else None
        if len(pieces) == 1:
            return losses[0], aux
        counts = [rows(piece) for piece in pieces]
        return sum(n * loss for n, loss in zip(counts, losses, strict=True)) / sum(counts), aux

    return f


def microbatches(even: Any, groups: int, k: int) -> tuple[Any, Any]:
    """``even`` (``groups`` blocks of ``m`` rows) as (the stack of its k microbatches, shape
    ``(groups, k, m // k, ...)`` per leaf, or None where ``m < k``; the blocks' last ``m % k``
    rows, shape ``(groups, m % k, ...)``, or None where ``k`` divides ``m``)."""
    m = rows(even) // groups
    c = m // k

    def blocks(x: jax.Array) -> jax.Array:
        return x.reshape(groups, m, *x.shape[1:])

    stack = (
        None
        if c == 0
        else jax.tree_util.tree_map(lambda x: blocks(x)[:, : k * c].reshape(groups, k, c, *x.shape[1:]), even)
    )
    tail = None if m == k * c else jax.tree_util.tree_map(lambda x: blocks(x)[:, k * c :], even)
    return stack, tail


def _zeros(tree: Any) -> Any:
    """Float32 (or wider) zeros shaped like ``tree``'s leaves (shapes or arrays)."""
    return jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, jnp.result_type(x.dtype, jnp.float32)), tree)


def _add(total: tuple, weight: jax.Array, out: tuple) -> tuple:
    """``total + weight * out``, leaf by leaf, in ``total``'s dtypes."""
    return jax.tree_util.tree_map(lambda t, x: t + (weight * x).astype(t.dtype), total, out)


def _fold(key: Any, i: Any) -> Any:
    """``key`` folded with ``i`` (None: None)."""
    return None if key is None else jax.random.fold_in(key, i)


class BlockSum(NamedTuple):
    """How the SPMD step over split parameters sums its blocks' gradients (a ``Placement``'s)."""

    # ``blocks(fn)``: ``fn(params, block, key, scale) -> (loss, aux, grads)`` run on each block
    # where it lies: ``(params, blocks, keys, scale) -> (losses, auxes, grads)``, the blocks' losses
    # and aux stacked, their gradients' float32 sum padded and split as the parameters are stored
    blocks: Callable
    lay: Callable  # a tree of the parameters' stored shapes -> laid out as they are stored
    own: Callable  # a tree as stored -> in the parameters' own shapes (padding sliced off)


def batch_gradient(
    loss_fn: Callable,
    has_aux: bool,
    accumulate: int,
    groups: int,
    constrain: Callable | None = None,
    split: BlockSum | None = None,
) -> Callable:
    """``(params, even, rest, key, scale) -> (loss, aux, grads)``: the gradient of the batch's
    mean loss (see the module's docstring). ``even``: rows in ``groups`` equal blocks, or None;
    ``rest``: more rows, or None. ``constrain(tree)``: lays out arrays whose first axis is the
    blocks' like ``even``'s rows (the SPMD step's sharding constraint), or None. ``split``: how
    the step's split parameters sum each microbatch's block gradients, or None (replicated).

    >>> import jax.numpy as jnp
    >>> grad = batch_gradient(lambda p, b: jnp.mean((b * p) ** 2), False, 4, 1)
    >>> loss, _, g = grad(jnp.float32(1.0), jnp.arange(10.0), None, None, None)
    >>> float(loss), float(g)  # the mean over all 10 rows, and its gradient
    (28.5, 57.0)
    """
    lay = constrain or (lambda tree: tree)

    def whole(params, even, rest, key, scale):
        pieces = [piece for piece in (even, rest) if piece is not None]
        return _precision.value_and_grad(rows_mean(loss_fn, has_aux, pieces, key), params, scale)

    if accumulate == 1:
        return whole

    def one(params, piece, key, scale) -> tuple:
        return _precision.value_and_grad(rows_mean(loss_fn, has_aux, [piece], key), params, scale)

    def per_block(params, pieces, key, scale) -> tuple:
        """(loss, aux, grads) of each block's piece, stacked along a first axis laid out like
        the blocks: each device computes its own block's, nothing crosses devices. With split
        parameters the gradients come summed over the blocks, as stored."""
        keys = None if key is None else jax.vmap(lambda g: jax.random.fold_in(key, g))(jnp.arange(groups))
        if split is not None:
            return split.blocks(one)(params, lay(pieces), keys, scale)
        out = jax.vmap(one, in_axes=(None, 0, None if key is None else 0, None))(
            params, lay(pieces), keys, scale
        )
        return lay(out)

    def laid(total: tuple) -> tuple:
        """A running total laid out: per block, or with split parameters the gradients as stored."""
        return lay(total) if split is None else (*lay(total[:2]), split.lay(total[2]))

    def accumulated(params, even, rest, key, scale):
        stack, tail = (None, even) if even is None else microbatches(even, groups, accumulate)
        if stack is None:  # fewer rows per block than microbatches: one piece
            return whole(params, even, rest, key, scale)
        total_rows = rows(even) + (0 if rest is None else rows(rest))
        c = jax.tree_util.tree_leaves(stack)[0].shape[2]

        def microbatch(total: tuple, j: jax.Array) -> tuple:
            p = params
            if split is not None:  # no loop invariant: the parameters are gathered inside the loop
                p, j = jax.lax.optimization_barrier((params, j))
            piece = jax.tree_util.tree_map(lambda x: jax.lax.dynamic_index_in_dim(x, j, 1, False), stack)
            out = per_block(p, piece, _fold(key, j), scale)
            return laid(_add(total, jnp.float32(c / total_rows), out)), None

        first = jax.tree_util.tree_map(lambda x: x[:, 0], stack)
        total = laid(_zeros(jax.eval_shape(lambda: per_block(params, first, key, scale))))
        total, _ = jax.lax.scan(microbatch, total, jnp.arange(accumulate))
        if tail is not None:
            a = jax.tree_util.tree_leaves(tail)[0].shape[1]
            out = per_block(params, tail, _fold(key, accumulate), scale)
            total = laid(_add(total, jnp.float32(a / total_rows), out))
        if split is None:
            total = jax.tree_util.tree_map(lambda x: jnp.sum(x, axis=0), total)  # the one reduction
        else:
            loss, aux = jax.tree_util.tree_map(lambda x: jnp.sum(x, axis=0), total[:2])
            total = (loss, aux, split.own(total[2]))
        if rest is not None:
            out = one(params, rest, _fold(key, accumulate + 1), scale)
            total = _add(total, jnp.float32(rows(rest) / total_rows), out)
        loss, aux, grads = total
        return loss, aux, jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, params)

    return accumulated


def check_rows(accumulate: int, n: int, where: str) -> None:
    """A batch of ``n`` rows can be cut into ``accumulate`` microbatches (at least a row each)."""
    if accumulate > n:
        raise ValueError(
            f"{where}: accumulate={accumulate} is more than the batch's {n} rows, so some microbatches"
            f" would have no rows; use accumulate <= {n}, or batches of at least {accumulate} rows"
        )


def peak_bytes(step: Callable, *args: Any) -> int:
    """Per-device peak bytes of the jitted ``step`` for ``args`` (arrays, or shapes with their
    shardings: nothing is allocated): its arguments, its outputs that do not reuse them (donated
    buffers), and its temporaries, from the compiled program's ``memory_analysis``."""
    return program_bytes(step.lower(*args).compile())
