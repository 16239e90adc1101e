"""A fit's results: its facts, packed into one array on the devices and fetched once, and
its models cut from the solver's layout."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._model import FitInfo, Model

INT_OF = {4: jnp.int32, 8: jnp.int64}  # the integer type as wide as each float type


class Fit(NamedTuple):
    """A solver's results for M models: W (d, M, c), b (M, c) and what the host needs to know
    of each fit, packed into one (M, span + 6) array (``pack_facts``): one fetch, not six."""

    W: Any
    b: Any
    facts: Any


class Facts(NamedTuple):
    """What the host needs to know of M fits, fetched once: host numpy, a row per model."""

    conv: np.ndarray  # (M,) bool
    grad: np.ndarray  # (M,) max |gradient| at the returned model
    its: np.ndarray  # (M,) int32
    hist: Any  # (M, T) objective per iteration from ``base`` on, NaN after the last (a list when fits differ)
    more: np.ndarray  # (M,) bool: still running (a chunked fit's call ended first)
    base: np.ndarray  # (M,) the iteration of hist's first value: the call's first (0 once merged)

    def info(self, i: int | slice, l2: Any, solver: str) -> FitInfo:
        return FitInfo(self.hist[i], self.its[i], self.conv[i], self.grad[i], l2, solver)


def fetch_facts(fits: list, rows: list[tuple[int, int]]) -> Facts:
    """The facts of model r of fit f for each (f, r) in ``rows``, in one fetch."""
    got = [unpack_facts(np.asarray(a)) for a in jax.device_get([f.facts for f in fits])]
    if len(fits) == 1:
        index = [r for _, r in rows]
        return Facts(*(a[index] for a in got[0]))
    conv, grad, its = (np.stack([got[f][k][r] for f, r in rows]) for k in range(3))
    hist = [got[f].hist[r] for f, r in rows]
    more, base = (np.stack([got[f][k][r] for f, r in rows]) for k in (4, 5))
    return Facts(conv, grad, its, hist, more, base)


def pack_facts(hist, base, its, gmax, conv, more) -> jax.Array:
    """M fits' facts as one (M, span + 6) array (traced): the call's objective history, then
    the iteration it began at and the iterations run (both bit-cast: exact at any count), max
    |gradient|, converged and still running (a chunked fit's call ended first)."""
    dtype = hist.dtype
    whole = INT_OF[dtype.itemsize]
    base = jnp.broadcast_to(base, its.shape)
    base, its = (jax.lax.bitcast_convert_type(a.astype(whole), dtype) for a in (base, its))
    cols = [base, its, gmax.astype(dtype), conv.astype(dtype), more.astype(dtype)]
    return jnp.concatenate([hist, jnp.stack(cols, axis=1)], axis=1)


def unpack_facts(packed: np.ndarray) -> Facts:
    """``pack_facts``'s rows, fetched, as Facts."""
    whole = np.int32 if packed.dtype.itemsize == 4 else np.int64
    base, its = (packed[:, k].view(whole).astype(np.int32) for k in (-5, -4))
    return Facts(packed[:, -2] > 0, packed[:, -3], its, packed[:, :-5], packed[:, -1] > 0, base)


def merged(history: np.ndarray | None, facts: Facts) -> np.ndarray:
    """The objective per iteration so far, (M, T), NaN where not run: ``history`` (the earlier
    calls', or None) with the calls' values in ``facts`` written at their iterations. A call
    whose results come again (a job not resumed) writes the same values again."""
    rows = [np.asarray(h) for h in facts.hist] if isinstance(facts.hist, list) else None
    lengths = [len(h) for h in rows] if rows is not None else [facts.hist.shape[1]] * len(facts.base)
    end = max(int(b) + n for b, n in zip(facts.base, lengths, strict=True))
    dtype = facts.hist.dtype if rows is None else rows[0].dtype
    out = np.full((len(facts.base), max(end, 0 if history is None else history.shape[1])), np.nan, dtype)
    if history is not None:
        out[:, : history.shape[1]] = history
    if rows is None and len(set(facts.base.tolist())) == 1:  # one call's models: one copy
        b = int(facts.base[0])
        np.copyto(out[:, b : b + lengths[0]], facts.hist, where=~np.isnan(facts.hist))
        return out
    for r, (b, h) in enumerate(
        zip(facts.base.tolist(), rows if rows is not None else facts.hist, strict=True)
    ):
        np.copyto(out[r, b : b + len(h)], h, where=~np.isnan(h))
    return out


def model_of(fit: Fit, i: int | slice, classes: np.ndarray, info: FitInfo, c: int) -> Model:
    """Model i (an int: one model; a slice: stacked) out of a Fit's M models."""
    part = (i.start, i.stop) if isinstance(i, slice) else i
    w, b = _pieces(fit.W, fit.b, part, c)
    return Model(w, b, classes, info)


def _cut(W: jax.Array, b: jax.Array, part: int | tuple, c: int) -> tuple:
    """Model ``part``'s arrays (an int: one model; a (start, stop) pair: stacked models), cut
    from the solver's layout (traced)."""
    i = slice(*part) if isinstance(part, tuple) else part
    W = W[:, i]  # (d, c) or (d, K, c)
    w = jnp.moveaxis(W, 1, 0) if isinstance(part, tuple) else W
    w = w[..., 0] if c == 1 else w
    b = b[i][..., 0] if c == 1 else b[i]
    return w, b


# one compiled call each (not one op per array): one model's arrays, or every model's
_pieces = jax.jit(_cut, static_argnums=(2, 3))
every_model = jax.jit(lambda W, b, c: [_cut(W, b, i, c) for i in range(W.shape[1])], static_argnums=2)


def last_losses(facts: Facts) -> np.ndarray:
    """Each model's objective at its last iteration."""
    return np.array([h[i] for h, i in zip(facts.hist, facts.its, strict=True)])


@functools.partial(jax.jit, static_argnums=1)
def split_block(wb: jax.Array, c: int) -> tuple:
    """One device's (d + 1, c) block of a per-device fit -> its model's w and b."""
    return (wb[:-1, 0], wb[-1, 0]) if c == 1 else (wb[:-1], wb[-1])
