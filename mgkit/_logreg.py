"""Logistic regression on many devices: one model data-parallel, one model per device, or many
models per device.

The objective is Theano's (seed 000): ``mean(log-loss) + l2 * ||w||^2``, the intercept not
penalised. scikit-learn's ``LogisticRegression(C=C)`` minimises the same function with
``l2 = 1 / (2 * C * n_samples)``. Two classes use the sigmoid and a weight vector ``w`` of shape
``(d,)``; k > 2 classes use the softmax and ``w`` of shape ``(d, k)``.

One solver serves every layout. It fits a batch of models at once and runs its whole loop in
one compiled program:

* ``fit``: one model, the rows split across contexts; every iteration each device computes its
  share of the loss, gradient (and Hessian) and the shares are summed (``psum``), so every
  device holds the same model.
* ``fit_per_device``: one model per context, each on its own data, all at once.
* ``fit_many``: K models over one data set (a sweep of l2 values, or bootstrap row sets), spread
  over the contexts, several per device.

Distinct devices of one kind run one SPMD program (``shard_map``) over all of them. Otherwise
each device runs its own program, all dispatched before any is waited on; for
``fit_per_device`` the models of contexts that share a device are stacked into that device's
one program (eight contexts on one GPU cost about one fit).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from . import _contexts, _devices, _parallel, _progress
from ._contexts import HOST
from ._parallel import AXIS, Batch, Targets
from ._transfer import place, staged

_HI = jax.lax.Precision.HIGHEST
_SOLVERS = ("auto", "newton", "lbfgs", "gd")
_MAX_ITER = {"newton": 100, "lbfgs": 1000, "gd": 10_000}
_NEWTON_MAX_PARAMS = {"cpu": 64}  # parameters per model up to which "auto" picks Newton
_NEWTON_MAX_PARAMS_ACCEL = 256
_MEMORY = 10  # L-BFGS correction pairs
_ARMIJO = 1e-4
_BACKTRACKS = 30
_LINE_NEWTON = 2  # Newton steps on the step length per iteration


class ConvergenceWarning(UserWarning):
    """A fit stopped before its gradient reached the tolerance."""


# -- the model -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FitInfo:
    """How a fit went: host numpy (the fit fetches these facts once, when it ends), a leading
    axis of K models for ``fit_many``.

    Attributes:
      loss: the objective at each iteration (index 0: the initial model), NaN after the last;
        ``history()`` gives the filled part.
      iterations: iterations run.
      converged: whether the gradient reached the tolerance.
      grad_norm: the largest absolute gradient component at the returned model.
      l2: the penalty the model was fitted with.
      solver: ``newton``, ``lbfgs`` or ``gd``.
    """

    loss: Any
    iterations: Any
    converged: Any
    grad_norm: Any
    l2: Any
    solver: str = "newton"

    def history(self) -> np.ndarray:
        """The objective per iteration, initial model first, as host numpy, trimmed to the
        iterations run (stacked models: a row each, NaN after a model stopped)."""
        loss, its = np.asarray(self.loss), np.asarray(self.iterations)
        return loss[..., : int(its.max()) + 1]


jax.tree_util.register_dataclass(
    FitInfo, data_fields=["loss", "iterations", "converged", "grad_norm", "l2"], meta_fields=["solver"]
)


class Model(NamedTuple):
    """A fitted logistic regression: pure data, usable inside ``jax.jit``.

    Attributes:
      w: weights, ``(d,)`` for two classes, ``(d, k)`` for k classes (a leading axis of K
        models for ``fit_many``).
      b: intercept, ``()`` or ``(k,)`` (leading K likewise).
      classes: the k labels in sorted order (host numpy); ``predict`` returns these.
      info: a FitInfo.
    """

    w: Any
    b: Any
    classes: Any
    info: Any


# -- prediction (pure, jittable) -----------------------------------------------------------


def _binary(model: Model) -> bool:
    return np.shape(model.classes)[-1] == 2


def _check_features(model: Model, X: Any, where: str) -> None:
    if not isinstance(model, Model):
        raise TypeError(
            f"{where}: the first argument must be a model from mg.logreg.fit (a Model), got "
            f"{type(model).__name__}"
        )
    d = np.shape(model.w)[-1 if _binary(model) else -2]
    shape = np.shape(X)
    if len(shape) != 2:
        raise ValueError(
            f"{where}: X must be 2-D (samples, features), got shape {tuple(shape)}; "
            "for a single sample use X.reshape(1, -1)"
        )
    if shape[1] != d:
        raise ValueError(
            f"{where}: X has {shape[1]} features (shape {tuple(shape)}), but the model was fitted "
            f"on {d}; pass data with the same {d} columns, in the same order"
        )


def decision_function(model: Model, X: Any) -> jax.Array:
    """Scores ``X @ w + b``: ``(n,)`` for two classes, ``(n, k)`` for k (leading K for stacked models)."""
    _check_features(model, X, "decision_function")
    X = jnp.asarray(X)
    w, b = _follow(model.w, X), _follow(model.b, X)
    X = X.astype(jnp.result_type(w.dtype, jnp.float32))
    if _binary(model):
        return jnp.einsum("nd,...d->...n", X, w, precision=_HI) + b[..., None]
    return jnp.einsum("nd,...dk->...nk", X, w, precision=_HI) + b[..., None, :]


def predict_proba(model: Model, X: Any) -> jax.Array:
    """Class probabilities, ``(n, k)`` with columns in ``model.classes`` order (k = 2 included).

    >>> import mgkit as mg, numpy as np
    >>> X = np.array([[-2.0], [-1.0], [1.0], [2.0]]); y = np.array([0, 0, 1, 1])
    >>> m = mg.logreg.fit(X, y, l2=0.01, contexts=1)
    >>> mg.logreg.predict_proba(m, X).shape
    (4, 2)
    """
    z = decision_function(model, X)
    if _binary(model):
        p = jax.nn.sigmoid(z)
        return jnp.stack([1 - p, p], axis=-1)
    return jax.nn.softmax(z, axis=-1)


def predict_index(model: Model, X: Any) -> jax.Array:
    """The index into ``model.classes`` of the most likely class for each row."""
    z = decision_function(model, X)
    return (z > 0).astype(jnp.int32) if _binary(model) else jnp.argmax(z, axis=-1).astype(jnp.int32)


def predict(model: Model, X: Any) -> Any:
    """The most likely label for each row, from ``model.classes``.

    Numeric labels give a JAX array (and this works inside ``jax.jit``); other labels (strings)
    give host numpy.

    >>> import mgkit as mg, numpy as np
    >>> X = np.array([[-2.0], [-1.0], [1.0], [2.0]]); y = np.array(["no", "no", "yes", "yes"])
    >>> m = mg.logreg.fit(X, y, l2=0.01, contexts=1)
    >>> mg.logreg.predict(m, X).tolist()
    ['no', 'no', 'yes', 'yes']
    """
    index = predict_index(model, X)
    classes = model.classes
    if isinstance(classes, np.ndarray) and classes.dtype.kind not in "biuf":
        return np.take_along_axis(
            np.broadcast_to(classes, (*np.shape(index)[:-1], classes.shape[-1])), np.asarray(index), axis=-1
        )
    return jnp.take_along_axis(
        jnp.broadcast_to(jnp.asarray(classes), (*index.shape[:-1], np.shape(classes)[-1])), index, axis=-1
    )


def score(model: Model, X: Any, y: Any) -> Any:
    """Accuracy: the fraction of rows whose predicted label equals ``y`` (one per stacked model)."""
    pred = predict(model, X)
    y = np.asarray(y) if isinstance(pred, np.ndarray) else jnp.asarray(y)
    if np.shape(y) != np.shape(pred)[-1:]:
        raise ValueError(f"score: y has shape {np.shape(y)}, expected ({np.shape(pred)[-1]},), one per row")
    return (pred == y).mean(axis=-1)


def objective(model: Model, X: Any, y: Any, l2: float) -> float:
    """The objective ``mean(log-loss) + l2 * ||w||^2`` of a model on data, in float64 on the host
    (to compare solvers, or with scikit-learn: ``l2 = 1 / (2 * C * n_samples)``)."""
    X = np.asarray(X, np.float64)
    w, b = np.asarray(model.w, np.float64), np.asarray(model.b, np.float64)
    index = np.searchsorted(np.asarray(model.classes), np.asarray(y))
    z = X @ w + b
    if _binary(model):
        loss = np.logaddexp(0.0, z) - index * z
    else:
        top = z.max(axis=1, keepdims=True)
        lse = np.log(np.exp(z - top).sum(axis=1)) + top[:, 0]
        loss = lse - z[np.arange(len(z)), index]
    return float(loss.mean() + l2 * np.sum(w**2))


def unstack(models: Model) -> list[Model]:
    """The K models of a ``fit_many`` result as a list of single models."""
    k = np.shape(models.info.iterations)
    if not k:
        return [models]
    pieces = [jax.tree_util.tree_map(lambda a, i=i: a[i], models._replace(classes=None)) for i in range(k[0])]
    return [m._replace(classes=models.classes) for m in pieces]


def _follow(a: Any, X: Any) -> Any:
    """Model arrays follow the data: moved (recorded) to X's device when X is committed elsewhere."""
    if not isinstance(a, jax.Array) or not isinstance(X, jax.Array) or isinstance(X, jax.core.Tracer):
        return a
    if isinstance(a, jax.core.Tracer) or a.devices() == X.devices() or not X.committed:
        return a
    if len(X.devices()) == 1:
        (device,) = X.devices()
        return place([a], _contexts.name_of(device), device, "transfer")[0]
    return jax.device_put(a, X.sharding.with_spec(P()) if hasattr(X.sharding, "with_spec") else X.sharding)


# -- the solver (traced; local data, M models) ---------------------------------------------


class Spec(NamedTuple):
    """What a compiled fit does (static: part of the program's cache key)."""

    solver: str  # newton | lbfgs | gd
    c: int  # 1: sigmoid; k: softmax over k classes
    max_iter: int
    every: int  # iterations per call of the program: the host reports steps between calls
    reduce: bool  # sum the loss, gradient and Hessian over the mesh axis (data-parallel)
    fused: bool  # one model, X streamed on a CPU: scores as (1, n) and the gradient as a fused multiply-sum
    stacked: bool = False  # model m has its own rows: X (M, n, d), y (n, M)
    short_sums: bool = False  # a CPU program whose every sum is short: see ``_compiler_options``
    batched_search: bool = False  # every backtracking step length is tried at once: see ``_spec``

    @property
    def chunked(self) -> bool:
        """The fit may outlast one call: each call runs ``every`` iterations at most and returns
        the solver's state with its results, and the host resumes it (``_drive``)."""
        return self.every < self.max_iter


class Fit(NamedTuple):
    """A solver's results for M models: W (d, M, c), b (M, c) and what the host needs to know
    of each fit, packed into one (M, max_iter + 5) array (``_packed``): one fetch, not five."""

    W: Any
    b: Any
    facts: Any


class _Carry(NamedTuple):
    it: Any
    its: Any  # (M,) iterations each model took (models stop on their own in a batch)
    W: Any
    b: Any
    Z: Any
    f: Any
    g: Any
    gmax: Any
    done: Any
    stalled: Any
    hist: Any
    SY: Any  # L-BFGS: the last steps s_i and gradient changes y_i, (M, 2m, p), newest first
    Rinv: Any  # the inverse of R, R[i, j] = s_i . y_j for i >= j (pair i no newer than j), (M, m, m)
    YtY: Any  # y_i . y_j, (M, m, m)


_INT_OF = {4: jnp.int32, 8: jnp.int64}  # the integer type as wide as each float type
_KINDS = _Carry(*"ii" + "f" * 6 + "bb" + "ffff")  # i: int32, b: bool, f: the fit's float type


def _pack(st: _Carry, dtype) -> jax.Array:
    """The solver's state as one flat array of its float type (integers bit-cast: exact), so a
    call hands it to the next as one buffer per device, not fourteen."""
    parts = []
    for a, kind in zip(st, _KINDS, strict=True):
        if kind == "i":
            a = jax.lax.bitcast_convert_type(a.astype(_INT_OF[jnp.dtype(dtype).itemsize]), dtype)
        parts.append(jnp.ravel(a).astype(dtype))
    return jnp.concatenate(parts)


def _unpack(flat: jax.Array, like: _Carry) -> _Carry:
    """``_pack``'s inverse; ``like`` holds each field's shape."""
    fields, at = [], 0
    for shape, kind in zip(like, _KINDS, strict=True):
        size = math.prod(shape)
        a = flat[at : at + size].reshape(shape)
        at += size
        if kind == "i":
            a = jax.lax.bitcast_convert_type(a, _INT_OF[a.dtype.itemsize]).astype(jnp.int32)
        fields.append(a > 0 if kind == "b" else a)
    return _Carry(*fields)


def _halves_sum(X: jax.Array, r: jax.Array) -> jax.Array:
    """``sum(X * r[:, None], axis=0)`` over X's two halves of rows, then their two sums (an odd
    last row added alone). XLA's CPU backend runs the sum over rows of 100k x 100 in 3.3-3.7
    ms this way, 4.6-5.3 ms as one sum (a fit 8-9% faster); the rounding is no worse."""
    n, d = X.shape
    h = n // 2
    if h == 0:
        return jnp.sum(X * r[:, None], axis=0)
    out = jnp.sum(X[: 2 * h].reshape(2, h, d) * r[: 2 * h].reshape(2, h, 1), axis=1).sum(0)
    return out + X[-1] * r[-1] if n % 2 else out


def solve(spec: Spec, X, y, omega, W0, b0, l2, tol, lr, resume=None) -> Fit | tuple[Fit, jax.Array]:
    """Fits M models on local rows; with ``spec.reduce`` the rows are one shard of the data.

    X: (n, d), or (M, n, d) with ``spec.stacked`` (each model its own rows); y: (n,) class
    indices, or (n, M) stacked; omega: (n, 1 or M) row weights (0 for padding), or None (every
    row weighs one); W0: (d, M, c) and b0: (M, c), or None (start from zeros); l2: (M,); tol,
    lr: scalars.

    A chunked fit (``spec.chunked``) runs ``spec.every`` iterations at most and returns its
    results with its state packed (``_pack``); ``resume`` is a state so returned, to go on from
    (W0 and b0 are then not read). The host reports each context's step between calls: no host
    callback runs inside the program, so every call takes jit's fast path.
    """
    n, d = X.shape[-2:]
    M, c = l2.shape[0], spec.c
    K = M * c
    dtype = l2.dtype
    if W0 is None:
        W0, b0 = jnp.zeros((d, M, c), dtype), jnp.zeros((M, c), dtype)
    if omega is None:
        omega = jnp.ones((n, 1), dtype)
    X = X.astype(dtype)
    # Rows run along the last axis of every per-row array (scores (M, c, n), labels and weights
    # (M or 1, n)): XLA's CPU backend reduces and maps a contiguous row axis several times
    # faster than a strided one (mean log-loss over 100k rows: 0.34 ms against 1.3 ms).
    ym = y.T if spec.stacked else y[None, :]  # (M or 1, n)
    yf = ym.astype(dtype)
    eps = float(jnp.finfo(dtype).eps)

    def red(v):
        return jax.tree_util.tree_map(lambda a: jax.lax.psum(a, AXIS), v) if spec.reduce else v

    omega = omega.T.astype(dtype)  # (M or 1, n)
    N = jnp.broadcast_to(red(omega.sum(-1)), (M,))
    wn = omega / N[:, None]  # each row's weight in the mean, (M, n)

    def scores(W, b):
        if spec.stacked:
            Z = jnp.einsum("mnd,dmc->mcn", X, W, precision=_HI)
        elif K == 1 and spec.fused:  # (1, d) x (d, n): a matrix-vector product written into a row
            Z = jnp.dot(W.reshape(d, K).T, X.T, precision=_HI)
        else:
            Z = jnp.dot(X, W.reshape(d, K), precision=_HI).T
        return Z.reshape(M, c, n) + b[..., None]

    def data_term(Z):  # scores (..., M, c, n) -> the mean log-loss, (..., M)
        if c == 1:
            z = Z[..., 0, :]
            rows = jax.nn.softplus(z) - yf * z
        else:
            at = jnp.broadcast_to(ym[:, None, :], (*Z.shape[:-2], 1, n))
            rows = jax.nn.logsumexp(Z, axis=-2) - jnp.take_along_axis(Z, at, axis=-2)[..., 0, :]
        return red(jnp.sum(wn * rows, axis=-1))

    def value(Z, W):
        return data_term(Z) + l2 * jnp.sum(W * W, axis=(0, 2))

    def probs(Z):
        return jax.nn.sigmoid(Z) if c == 1 else jax.nn.softmax(Z, axis=1)

    target = yf[:, None] if c == 1 else jax.nn.one_hot(ym, c, dtype=dtype, axis=1)  # (M or 1, c, n)

    def residual(Z):
        return (probs(Z) - target) * wn[:, None]

    def grad(Z, W):
        R = residual(Z)
        if spec.stacked:
            gW = jnp.einsum("mnd,mcn->dmc", X, R, precision=_HI)
        else:
            if spec.fused and K == 1:  # one fused multiply-sum beats XLA's CPU vector x matrix
                gW = _halves_sum(X, R.reshape(n))
            else:
                gW = jnp.dot(R.reshape(K, n), X, precision=_HI)
            gW = gW.reshape(M, c, d).transpose(2, 0, 1)
        gW, gb = red((gW, R.sum(-1)))
        return flat(gW + 2 * l2[None, :, None] * W, gb)

    def line(Zt, D):
        """The data term's slope and curvature, (M,) each, along scores moving as Zt + t * D."""
        Pr = probs(Zt)
        if c == 1:
            curve = Pr * (1 - Pr) * D * D
        else:
            PD = Pr * D
            curve = PD * D - PD * jnp.sum(PD, axis=1, keepdims=True)
        return red((jnp.sum(residual(Zt) * D, axis=(1, 2)), jnp.sum(wn * curve.sum(1), axis=-1)))

    def flat(W, b):  # (d, M, c), (M, c) -> (M, p), p = (d + 1) * c; index i * c + a
        return jnp.concatenate([W.transpose(1, 0, 2).reshape(M, d * c), b], axis=1)

    def unflat(v):
        return v[:, : d * c].reshape(M, d, c).transpose(1, 0, 2), v[:, d * c :]

    def hessian(Z):
        Xa = jnp.concatenate([X, jnp.ones((*X.shape[:-1], 1), dtype)], axis=-1)
        x = "mn" if spec.stacked else "n"  # the row axes of Xa
        Pr = probs(Z)
        if c == 1:
            s = (Pr * (1 - Pr))[:, 0] * wn
            H = jnp.einsum(f"{x}i,mn,{x}j->mij", Xa, s, Xa, precision=_HI)
        else:
            wp = Pr * wn[:, None]
            H1 = jnp.einsum(f"{x}i,man,{x}j->miaj", Xa, wp, Xa, precision=_HI)
            H2 = jnp.einsum(f"{x}i,man,{x}j,mbn->miajb", Xa, wp, Xa, Pr, precision=_HI)
            H = H1[..., None] * jnp.eye(c, dtype=dtype)[None, None, :, None, :] - H2
            H = H.reshape(M, (d + 1) * c, (d + 1) * c)
        return red(H)

    p = (d + 1) * c
    penal = jnp.concatenate([jnp.ones((d * c,), dtype), jnp.zeros((c,), dtype)])

    def newton_direction(Z, g):
        H = hessian(Z) + jax.vmap(jnp.diag)(2 * l2[:, None] * penal)
        if c > 1:  # softmax: shifting every intercept alike changes nothing; pin that direction
            H = H.at[:, d * c :, d * c :].add(1.0 / c)
        damp = 1e-6 * jnp.max(jnp.diagonal(H, axis1=1, axis2=2), axis=1) + eps
        H = H + damp[:, None, None] * jnp.eye(p, dtype=dtype)
        L = jnp.linalg.cholesky(H)
        step = -jax.scipy.linalg.cho_solve((L, True), g[..., None])[..., 0]
        ok = jnp.all(jnp.isfinite(step), axis=1, keepdims=True)
        return jnp.where(ok, step, -g)

    def lbfgs_direction(st):
        """-H g for L-BFGS's inverse Hessian H, in the compact form of Byrd, Nocedal and Schnabel
        (1994): H = gamma I + [S gamma Y] [[R^-T (D + gamma Y'Y) R^-1, -R^-T], [-R^-1, 0]] [S'; gamma Y'],
        R the pairs' s_i . y_j for i no newer than j, D its diagonal. Two products with the stored
        pairs and two with R's inverse (kept up to date by ``remember``) replace the two-loop
        recursion's 4m dependent dot products and updates (400 x 784 on a CPU: a fit a tenth
        faster). Empty slots (s = y = 0) have a unit diagonal in R and contribute nothing."""
        m = _MEMORY
        q = jnp.einsum("mkp,mp->mk", st.SY, st.g, precision=_HI)  # S'g and Y'g
        filled = jnp.diagonal(st.YtY, axis1=1, axis2=2) > 0  # a kept pair has y != 0
        sy = jnp.where(filled, 1.0 / jnp.diagonal(st.Rinv, axis1=1, axis2=2), 0.0)
        yy = st.YtY[:, 0, 0]
        gnorm = jnp.sqrt(jnp.sum(st.g * st.g, axis=1))
        first = 1.0 / jnp.where(gnorm > 0, gnorm, 1.0)  # a first step of unit length
        gamma = jnp.where(filled[:, 0], sy[:, 0] / jnp.where(yy > 0, yy, 1.0), first)[:, None]
        u = jnp.einsum("mij,mj->mi", st.Rinv, q[:, :m], precision=_HI)  # R^-1 S'g
        v = sy * u + gamma * (jnp.einsum("mij,mj->mi", st.YtY, u, precision=_HI) - q[:, m:])
        top = jnp.einsum("mji,mj->mi", st.Rinv, v, precision=_HI)  # R^-T v
        step = -(
            gamma * st.g
            + jnp.einsum("mkp,mk->mp", st.SY, jnp.concatenate([top, -gamma * u], 1), precision=_HI)
        )
        descent = jnp.sum(step * st.g, axis=1) < 0
        return jnp.where(descent[:, None], step, -st.g)

    def remember(st, keep, s, yv, sy):
        """The pair (s, yv) becomes the newest for the models that ``keep`` it; the oldest goes.

        R's inverse follows without a solve: the new R is [[sy, 0], [c, R0]], c the kept pairs'
        s_i . yv and R0 the old R less its oldest row and column, whose inverse is the old
        inverse's leading block (R is lower triangular). So the new inverse is
        [[1 / sy, 0], [-R0^-1 c / sy, R0^-1]]: one m x m product. (An accelerator runs a
        triangular solve as a library call of its own, between the loop's captured launches:
        without the two per iteration, eight 400 x 784 models fit in 2.3 ms on an H100, not 3.0;
        a CPU fits them in the same time either way.)"""
        m = _MEMORY
        q = jnp.einsum("mkp,mp->mk", st.SY, yv, precision=_HI)  # the kept pairs' s_i . yv and y_i . yv
        yy = jnp.sum(yv * yv, axis=1)

        def shifted(A, col):  # the newest pair's products in row and column 0, the rest moved down
            A = jnp.pad(A[:, :-1, :-1], ((0, 0), (1, 0), (1, 0)))
            return A.at[:, :, 0].set(col)

        lead = st.Rinv[:, : m - 1, : m - 1]
        inv_col = jnp.concatenate(
            [1.0 / sy[:, None], -jnp.einsum("mij,mj->mi", lead, q[:, : m - 1], precision=_HI) / sy[:, None]],
            axis=1,
        )
        col_y = jnp.concatenate([yy[:, None], q[:, m : 2 * m - 1]], axis=1)
        SY = jnp.concatenate([s[:, None], st.SY[:, : m - 1], yv[:, None], st.SY[:, m : 2 * m - 1]], axis=1)
        new = (SY, shifted(st.Rinv, inv_col), shifted(st.YtY, col_y).at[:, 0, :].set(col_y))
        old = (st.SY, st.Rinv, st.YtY)
        return tuple(jnp.where(keep[:, None, None], a, b) for a, b in zip(new, old, strict=True))

    def gd_step(st):
        Z = scores(st.W, st.b)
        f, g = value(Z, st.W), grad(Z, st.W)
        gmax = jnp.max(jnp.abs(g), axis=1)
        W, b = unflat(flat(st.W, st.b) - lr * g)
        hist = st.hist.at[:, st.it].set(f)
        return st._replace(it=st.it + 1, its=st.its + 1, W=W, b=b, f=f, g=g, gmax=gmax, hist=hist)

    def search_step(st):
        active = ~st.done
        step = newton_direction(st.Z, st.g) if spec.solver == "newton" else lbfgs_direction(st)
        step = jnp.where(active[:, None], step, 0.0)
        dW, db = unflat(step)
        D = scores(dW, db)
        slope = jnp.sum(step * st.g, axis=1)
        slack = 16 * eps * jnp.abs(st.f)

        def trial(t):  # step lengths (..., M) -> the objective there, and whether it is low enough
            f = data_term(st.Z + t[..., None, None] * D) + l2 * (ww + t * (2 * pW + t * pp))
            return f, (f <= st.f + _ARMIJO * t * slope + slack) & jnp.isfinite(f)

        # The step length: Newton's method on the objective along the step. The scores move
        # along the line as Z + t * D, so each of its slope and curvature evaluations is one
        # pass over the per-row arrays, never over X; Armijo backtracking then guards the result.
        ww = jnp.sum(st.W * st.W, axis=(0, 2))
        pW, pp = jnp.sum(st.W * dW, axis=(0, 2)), jnp.sum(dW * dW, axis=(0, 2))
        t = jnp.ones((M,), dtype)
        for _ in range(_LINE_NEWTON):
            d1, d2 = line(st.Z + t[:, None, None] * D, D)
            d1, d2 = d1 + 2 * l2 * (pW + t * pp), d2 + 2 * l2 * pp
            t_new = jnp.clip(t - d1 / jnp.where(d2 > 0, d2, 1.0), t / 16, t * 16)
            t = jnp.where((d2 > 0) & jnp.isfinite(t_new), t_new, t)
        if spec.batched_search:  # t, t / 2, ... t / 2**_BACKTRACKS at once; the first that passes
            ts = t * 0.5 ** jnp.arange(_BACKTRACKS + 1, dtype=dtype)[:, None]
            f_ts, ok_ts = trial(ts)
            first = jnp.argmax(ok_ts, axis=0)[None]
            t, f_t = (jnp.take_along_axis(a, first, axis=0)[0] for a in (ts, f_ts))
            ok = jnp.any(ok_ts, axis=0) | ~active
        else:  # halve t until it passes
            f_t, ok = trial(t)
            ok = ok | ~active

            def backtrack(state):
                k, t, f_t, ok = state
                t = jnp.where(ok, t, t / 2)
                f_new, ok_new = trial(t)
                return k + 1, t, jnp.where(ok, f_t, f_new), ok | ok_new

            _, t, f_t, ok = jax.lax.while_loop(
                lambda s: (s[0] < _BACKTRACKS) & ~jnp.all(s[3]), backtrack, (0, t, f_t, ok)
            )
        stalled = active & ~ok
        t = jnp.where(ok & active, t, 0.0)
        W = st.W + t[None, :, None] * dW
        b = st.b + t[:, None] * db
        Z = st.Z + t[:, None, None] * D
        f = jnp.where(ok & active, f_t, st.f)
        g = grad(Z, W)
        gmax = jnp.max(jnp.abs(g), axis=1)
        pairs = (st.SY, st.Rinv, st.YtY)
        if spec.solver == "lbfgs":
            s, yv = t[:, None] * step, g - st.g
            sy = jnp.sum(s * yv, axis=1)
            keep = active & (sy > eps * jnp.sqrt(jnp.sum(s * s, axis=1) * jnp.sum(yv * yv, axis=1)))
            pairs = remember(st, keep, s, yv, sy)
        done = st.done | stalled | (gmax <= tol)
        hist = st.hist.at[:, st.it + 1].set(jnp.where(active, f, jnp.nan))
        its = st.its + active.astype(st.its.dtype)
        return _Carry(st.it + 1, its, W, b, Z, f, g, gmax, done, st.stalled | stalled, hist, *pairs)

    mem = _MEMORY if spec.solver == "lbfgs" else 0
    if resume is not None:
        shapes = ((), (M,), (d, M, c), (M, c), (M, c, n), (M,), (M, p), (M,), (M,), (M,))
        shapes += ((M, spec.max_iter + 1), (M, 2 * mem, p), (M, mem, mem), (M, mem, mem))
        start = _unpack(resume, _Carry(*shapes))
    else:
        # From zeros (the default start) the first scores are the intercepts: no pass over X.
        Z0 = jax.lax.cond(
            jnp.any(W0 != 0), lambda: scores(W0, b0), lambda: jnp.broadcast_to(b0[..., None], (M, c, n))
        )
        f0, g0 = value(Z0, W0), grad(Z0, W0)
        gmax0 = jnp.max(jnp.abs(g0), axis=1)
        # The first gradient reads every value of X, each times a finite weight: a NaN or inf in
        # X makes it non-finite, and the fit stops at once (the host then names the bad value).
        # gd takes its fixed steps unless a gradient is not finite: then every model stops.
        finite0 = jnp.isfinite(gmax0)
        hist0 = jnp.full((M, spec.max_iter + 1), jnp.nan, dtype)
        start = _Carry(
            jnp.int32(0),
            jnp.zeros((M,), jnp.int32),
            W0,
            b0,
            Z0,
            f0,
            g0,
            gmax0,
            (gmax0 <= tol) | ~finite0 if spec.solver != "gd" else jnp.broadcast_to(~jnp.all(finite0), (M,)),
            jnp.zeros((M,), bool),
            hist0.at[:, 0].set(f0) if spec.solver != "gd" else hist0,
            jnp.zeros((M, 2 * mem, p), dtype),
            jnp.broadcast_to(jnp.eye(mem, dtype=dtype), (M, mem, mem)),  # R = I: no pairs yet
            jnp.zeros((M, mem, mem), dtype),
        )
    stop = jnp.minimum(start.it + spec.every, spec.max_iter) if spec.chunked else spec.max_iter
    step_fn = gd_step if spec.solver == "gd" else search_step
    st = jax.lax.while_loop(lambda s: (s.it < stop) & ~jnp.all(s.done), step_fn, start)

    # The carried loss and gradient are the returned model's (scores are updated, not
    # recomputed: their rounding stays near float epsilon times the path length).
    f, gmax = st.f, st.gmax
    if spec.solver == "gd":  # the carry holds the step before the last update: evaluate the last
        Z = scores(st.W, st.b)
        f, gmax = value(Z, st.W), jnp.max(jnp.abs(grad(Z, st.W)), axis=1)
    hist = st.hist.at[jnp.arange(M), st.its].set(f)  # models that stopped early: already there
    conv = gmax <= tol
    if spec.solver != "gd":
        # A line search that can no longer lower the objective has met float rounding: accept
        # the gradient if it is within rounding of the terms it sums (bounded per column).
        def floor():
            R = jnp.abs(residual(st.Z)).sum(axis=(1, 2))
            col = jnp.max(jnp.abs(X), axis=-2)  # per feature (and model, when stacked)
            col = jax.lax.pmax(col, AXIS) if spec.reduce else col
            terms = red(R) * jnp.maximum(jnp.max(col, axis=-1), 1.0) + 2 * l2 * jnp.max(
                jnp.abs(st.W), axis=(0, 2)
            )
            return 64 * eps * math.sqrt(n) * terms

        limit = jax.lax.cond(jnp.any(st.stalled), floor, lambda: jnp.zeros((M,), dtype))
        conv = conv | (st.stalled & (gmax <= limit))
    fit = Fit(st.W, st.b, _packed(hist, st.its, gmax, conv, ~st.done & (st.it < spec.max_iter)))
    return (fit, _pack(st, dtype)) if spec.chunked else fit


# -- programs ------------------------------------------------------------------------------


def _compiler_options(spec: Spec) -> dict[str, str] | None:
    """XLA's CPU backend splits every sum of more than 32 terms into a windowed partial sum
    and a second sum of the partials (pairwise-like rounding for long sums), each a step of
    its own. In a short fit's loop these steps are a good part of the time: 400 x 784 models
    fit 7% faster without the split. A sum of at most ``_SHORT_SUM`` terms keeps float32
    accuracy without it (the CPU sums 8 lanes at once): it is skipped where every sum is short."""
    return {"xla_disable_hlo_passes": "tree_reduction_rewriter"} if spec.short_sums else None


_SHORT_SUM = 16384  # terms (rows per device, or parameters per model) of a sum kept unsplit


def _local_program(spec: Spec) -> Callable:
    """One device, M models: ``solve`` compiled (a resumed call passes the state last)."""
    return _parallel._PROGRAMS.get(
        ("logreg", spec),
        lambda: jax.jit(functools.partial(solve, spec), compiler_options=_compiler_options(spec)),
    )


def _per_device_program(spec: Spec, stacked: bool) -> Callable:
    """One device, M models each on its own rows (``fit_per_device``'s contexts that share a
    device): X, or with ``stacked`` a tuple of M equal-shape X, then the models' labels,
    penalties and starts as (M, L) rows (``_per_device_rows``), tol and lr (a resumed call:
    the state last). Every row weighs one."""

    def program(X, rows, tol, lr, *resume):
        n, d = X[0].shape if stacked else X.shape
        y, l2, W0, b0 = _unrows(rows, n, d, spec.c)
        X, y = (jnp.stack(X), y) if stacked else (X, y[:, 0])
        return solve(spec._replace(stacked=stacked), X, y, None, W0, b0, l2, tol, lr, *resume)

    return _parallel._PROGRAMS.get(
        ("logreg", "per device", spec, stacked),
        lambda: jax.jit(program, compiler_options=_compiler_options(spec)),
    )


def _unrows(rows: jax.Array, n: int, d: int, c: int) -> tuple:
    """``_per_device_rows``' (M, L) rows (traced) -> y (n, M) class indices, l2 (M,) and the
    start, W0 (d, M, c) and b0 (M, c): None (zeros) unless the rows carry one."""
    M = rows.shape[0]
    y, l2 = rows[:, :n].T.astype(jnp.int32), rows[:, n]
    if rows.shape[1] > n + 1:  # a start other than zeros
        W0 = rows[:, n + 1 : n + 1 + d * c].reshape(M, d, c).transpose(1, 0, 2)
        return y, l2, W0, rows[:, n + 1 + d * c :].reshape(M, c)
    return y, l2, None, None


# Partition specs per layout, for (X, y, omega, W0, b0, l2) and the outputs.
_ROWS, _MODELS, _REPL = P(AXIS), P(None, AXIS), P()
_LAYOUTS = {
    # one model, rows split, sums reduced: every output replicated
    "rows": ((_ROWS, _ROWS, _ROWS, _REPL, _REPL, _REPL), Fit(*(_REPL,) * 3)),
    # one model per device on its own rows and its labels, penalty and start in one array
    # (``_per_device_rows``); out: each model's w and b as one block, and its facts
    "devices": ((_ROWS, _ROWS), (_ROWS, _ROWS)),
    # every device holds all rows and fits its own slice of the models
    "models": ((_REPL, _REPL, _REPL, _MODELS, _ROWS, _ROWS), Fit(_MODELS, _ROWS, _ROWS)),
}


def _mapped_program(
    spec: Spec, devices: tuple, layout: str, omega_spec: Any = None, resume: bool = False
) -> Callable:
    """One SPMD program over the devices' mesh, for one of the three layouts. A chunked fit's
    program also returns each device's state as one row, (devices, L); ``resume``: the program
    that takes those rows last and goes on from them."""
    key = ("logreg", spec, devices, layout, omega_spec, resume)

    def build():
        in_specs, out_specs = _LAYOUTS[layout]
        if omega_spec is not None:
            in_specs = (*in_specs[:2], omega_spec, *in_specs[3:])
        scalar = (_REPL,) * 2  # tol, lr
        state = (_ROWS,) if resume else ()
        if spec.chunked:
            out_specs = (out_specs, _ROWS)

        def body(X, y, omega, W0, b0, l2, tol, lr, *resumed):  # omega, W0, b0 None: ones, zeros
            out = solve(spec, X, y, omega, W0, b0, l2, tol, lr, *(r[0] for r in resumed))
            fit, packed = out if spec.chunked else (out, None)
            if layout == "devices":
                # this device's model as one (d + 1, c) block, and its facts packed into one
                # row: the host takes both with one fetch each, not one per field
                fit = jnp.concatenate([fit.W[:, 0], fit.b]), fit.facts
            return (fit, packed[None]) if spec.chunked else fit

        def per_device(X, rows, tol, lr, *resumed):
            y, l2, W0, b0 = _unrows(rows[None], *X.shape, spec.c)
            return body(X, y[:, 0], None, W0, b0, l2, tol, lr, *resumed)

        mesh = _parallel.mesh(devices)
        program = jax.shard_map(
            per_device if layout == "devices" else body,
            mesh=mesh,
            in_specs=(*in_specs, *scalar, *state),
            out_specs=out_specs,
            check_vma=False,
        )
        shardings = [jax.sharding.NamedSharding(mesh, s) for s in in_specs]
        shardings += [_parallel._sharding(devices, AXIS, None) for _ in scalar]
        shardings += [jax.sharding.NamedSharding(mesh, s) for s in state]
        return jax.jit(program, in_shardings=tuple(shardings), compiler_options=_compiler_options(spec))

    return _parallel._PROGRAMS.get(key, build)


# -- checking inputs -----------------------------------------------------------------------


def _dtype() -> Any:
    return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


def _check_X(X: Any, where: str, name: str = "X") -> Any:
    """A 2-D, real array (numpy on the host, or a jax.Array where it is). NaN and inf are found
    by the solver, whose first gradient reads every value (see ``_conclude``)."""
    if isinstance(X, jax.Array):
        arr = X
    else:
        try:
            arr = np.asarray(X)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"{where}: {name} cannot be read as an array ({e}); pass a 2-D numeric array"
            ) from None
    kind = np.dtype(arr.dtype).kind
    if kind not in "fiub":
        raise TypeError(
            f"{where}: {name} has dtype {arr.dtype}, but features must be real numbers; convert with "
            f"{name}.astype(np.float32) (encode text or categories as numbers first)"
        )
    if arr.ndim != 2:
        hint = f"{name}.reshape(-1, 1) for one feature" if arr.ndim == 1 else "one row per sample"
        raise ValueError(
            f"{where}: {name} must be 2-D (samples, features), got shape {tuple(arr.shape)}; use {hint}"
        )
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(
            f"{where}: {name} is empty (shape {tuple(arr.shape)}); fitting needs at least one sample "
            "and one feature"
        )
    if isinstance(arr, np.ndarray):
        arr = arr.astype(_dtype(), copy=False)
    elif arr.dtype != _dtype():
        arr = arr.astype(_dtype())
    return arr


@jax.jit
def _sum(a: jax.Array) -> jax.Array:
    return jnp.sum(a)


@jax.jit
def _nonfinite(a: jax.Array) -> jax.Array:
    return jnp.sum(~jnp.isfinite(a))


def _check_finite(arrays: list, names: list[str], where: str) -> None:
    """Raises for the first array holding NaN or inf. Arrays on devices are summed where they
    are, all before waiting once: a finite sum clears an array in one fast pass (XLA's CPU
    count of non-finite values takes 20x as long); only a non-finite sum, which large finite
    values can also give, has its non-finite values counted."""
    floats = [(a, nm) for a, nm in zip(arrays, names, strict=True) if np.dtype(a.dtype).kind == "f"]
    with np.errstate(over="ignore", invalid="ignore"):
        sums = jax.device_get([_sum(a) if isinstance(a, jax.Array) else np.sum(a) for a, _ in floats])
    for (arr, name), total in zip(floats, sums, strict=True):
        if np.isfinite(total):
            continue
        count = int(_nonfinite(arr)) if isinstance(arr, jax.Array) else np.count_nonzero(~np.isfinite(arr))
        if count:
            row, col = (int(i) for i in np.argwhere(~np.isfinite(np.asarray(arr)))[0])
            raise ValueError(
                f"{where}: {name} has {int(count)} NaN or infinite value(s), the first at row {row}, "
                f"column {col} (value {float(arr[row, col])}); drop or impute them (e.g. with column "
                "means) before fitting"
            )


def _encode(y: Any, n: int, where: str, name: str = "y") -> tuple[np.ndarray, np.ndarray]:
    """Labels -> (class index per row, int32; the sorted distinct labels)."""
    if isinstance(y, jax.Array):
        y = place([y], HOST, None, "transfer")[0]
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(
            f"{where}: {name} must be 1-D, one label per row, got shape {y.shape}"
            + ("; use y.ravel()" if y.ndim == 2 and 1 in y.shape else "")
        )
    if len(y) != n:
        raise ValueError(
            f"{where}: X has {n} rows but {name} has {len(y)} labels; pass one label per row of X"
        )
    if y.dtype.kind == "f" and not np.isfinite(y).all():
        raise ValueError(f"{where}: {name} contains NaN or infinite labels; every row needs a label")
    try:
        classes, index = _distinct(y)
    except TypeError as e:
        kinds = sorted({type(v).__name__ for v in y.ravel().tolist()})
        raise TypeError(
            f"{where}: the labels in {name} cannot be sorted ({e}); they mix types {kinds}. Use labels "
            "of one type, e.g. y.astype(str)"
        ) from None
    if len(classes) < 2:
        raise ValueError(
            f"{where}: {name} has a single class ({classes[0]!r} for all {n} rows); logistic regression "
            "needs at least two classes"
        )
    return index.astype(np.int32), classes


def _distinct(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(y, return_inverse=True)``; integer labels in a small range are counted
    instead of sorted (100k labels: 0.2 ms against 0.9 ms)."""
    if y.dtype.kind in "iub" and y.size:
        lo, hi = int(y.min()), int(y.max())
        if hi - lo < 4 * y.size + 1024 and lo > -(2**62) and hi < 2**62:
            offset = np.subtract(y, lo, dtype=np.int64)
            present = np.bincount(offset, minlength=hi - lo + 1) > 0
            if present.all():  # every value from lo to hi occurs (labels 0..k-1): the offset is the index
                return np.arange(lo, hi + 1).astype(y.dtype), offset
            rank = (np.cumsum(present) - 1).astype(np.int32)
            return (np.flatnonzero(present) + lo).astype(y.dtype), np.take(rank, offset)
    return np.unique(y, return_inverse=True)


def _check_l2(value: Any, where: str, name: str = "l2") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name}={value!r}; the penalty must be a number >= 0, e.g. {name}=1e-3")
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{where}: {name}={value!r}; the penalty must be finite and >= 0 (0: no penalty), "
            f"e.g. {name}=1e-3"
        )
    return float(value)


def _penalty(l2: Any, C: Any, n: float, where: str) -> float:
    if C is not None and l2 is not None:
        raise ValueError(f"{where}: give l2= or C=, not both (l2 = 1 / (2 * C * n_samples))")
    if C is None:
        return 1.0 / (2 * n) if l2 is None else _check_l2(l2, where)
    if isinstance(C, bool) or not isinstance(C, numbers.Real) or not math.isfinite(C) or C <= 0:
        raise ValueError(f"{where}: C={C!r}; C must be a positive finite number, as in scikit-learn")
    return 1.0 / (2 * C * n)


class _Options(NamedTuple):
    solver: str
    max_iter: int | None
    tol: float
    learning_rate: float
    progress: bool | None


def _options(solver, max_iter, tol, learning_rate, progress, where) -> _Options:
    if solver not in _SOLVERS:
        raise ValueError(
            f"{where}: solver={solver!r}; use 'auto' (the default), 'newton', 'lbfgs' or 'gd' "
            "(fixed learning rate and steps, as in Theano's recipe)"
        )
    if max_iter is not None and (
        isinstance(max_iter, bool) or not isinstance(max_iter, numbers.Integral) or max_iter < 1
    ):
        raise ValueError(f"{where}: max_iter={max_iter!r}; give a whole number of iterations >= 1")
    for name, v in (("tol", tol), ("learning_rate", learning_rate)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{where}: {name}={v!r}; it must be a positive finite number")
    if progress not in (None, True, False):
        raise TypeError(f"{where}: progress={progress!r}; use None (a bar after 1 s), True or False")
    return _Options(
        solver, None if max_iter is None else int(max_iter), float(tol), float(learning_rate), progress
    )


def _spec(
    opts: _Options,
    d: int,
    c: int,
    platform: str,
    reduce: bool,
    rows: int,
    models: int,
    held: int,
) -> Spec:
    """The compiled fit's settings, for ``rows`` rows of X and ``models`` models per device and
    ``held`` rows of X over all the fit's devices."""
    solver = opts.solver
    if solver == "auto":
        limit = _NEWTON_MAX_PARAMS.get(platform, _NEWTON_MAX_PARAMS_ACCEL)
        solver = "newton" if (d + 1) * c <= limit else "lbfgs"
    max_iter = opts.max_iter or _MAX_ITER[solver]
    every = _every(solver, d, c, platform, rows * models)
    # XLA's CPU backend reads an X that is streamed from memory faster with the fused forms
    # (100k x 100: 0.8 + 1.4 ms a pass against 1.0 + 2.0; the same rows on 8 simulated devices:
    # 22 ms a fit against 25), one that stays in cache with plain products (400 x 784: 31 + 27
    # us against 49 + 48). Simulated CPU devices share the host's cache, so all of X counts.
    fused = platform == "cpu" and held * d * np.dtype(_dtype()).itemsize >= _STREAMED
    short = platform == "cpu" and max(rows, (d + 1) * c) <= _SHORT_SUM
    # An accelerator runs a loop inside the program from the host, which reads the loop's
    # condition back at every pass (a sync of tens of microseconds). Backtracking along the
    # step is such a loop, entered at every iteration. Where the trials are few values, the
    # accelerator tries every step length at once instead, with no loop (eight 400 x 784 models
    # on an H100: 2.0 ms, not 2.3); on a CPU, or for many rows, each trial's work counts (100k
    # x 100 on a CPU: 150 ms a fit, not 83).
    batched = platform != "cpu" and rows * models * c * (_BACKTRACKS + 1) <= _BATCHED_TRIALS
    return Spec(solver, c, max_iter, every, reduce, fused, short_sums=short, batched_search=batched)


_BATCHED_TRIALS = 1 << 22  # per-row values (rows x models x classes x lengths) for all step lengths at once
_STREAMED = 16 << 20  # bytes of X from which a CPU streams it from memory (more than its cache)


# Work (row x parameter products) a device gets through in about a tenth of a second: about
# 2.5e9 a second on one core of a CPU (100k x 100 and 400 x 784 fits both measured 2-3.5e9),
# ten times that on an accelerator.
_REPORT_WORK = {"cpu": 2.5e8}
_REPORT_WORK_ACCEL = 2.5e9


def _every(solver: str, d: int, c: int, platform: str, load: int) -> int:
    """Iterations per call of a fit's program: about a tenth of a second of work. Between calls
    the host records each context's step and the bar moves; each call costs a dispatch and a
    fetch (under a millisecond), so a fit shorter than one call is one call and reports only
    its last step."""
    p = (d + 1) * c
    work = max(load, 1) * p * (p if solver == "newton" else 1)  # Newton: a p x p Hessian
    return max(1, math.ceil(_REPORT_WORK.get(platform, _REPORT_WORK_ACCEL) / work))


def _init(init: Any, d: int, c: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Starting weights (d, c) and intercept (c,): zeros, or a Model / (w, b) given."""
    if init is None:
        return np.zeros((d, c)), np.zeros((c,))
    w, b = (init.w, init.b) if isinstance(init, Model) else init if isinstance(init, tuple) else (None, None)
    if w is None:
        raise TypeError(f"{where}: init must be a Model or a tuple (w, b), got {type(init).__name__}")
    w, b = np.asarray(w, np.float64), np.asarray(b, np.float64)
    want_w, want_b = ((d,), ()) if c == 1 else ((d, c), (c,))
    if w.shape != want_w or b.shape != want_b:
        raise ValueError(
            f"{where}: init has w of shape {w.shape} and b of shape {b.shape}; this data needs "
            f"w {want_w} and b {want_b}"
        )
    return w.reshape(d, c), b.reshape(c)


# -- results -------------------------------------------------------------------------------


class Facts(NamedTuple):
    """What the host needs to know of M fits, fetched once: host numpy, a row per model."""

    conv: np.ndarray  # (M,) bool
    grad: np.ndarray  # (M,) max |gradient| at the returned model
    its: np.ndarray  # (M,) int32
    hist: Any  # (M, max_iter + 1) objective per iteration, NaN after the last (a list when fits differ)
    more: np.ndarray  # (M,) bool: still running (a chunked fit's call ended first)

    def info(self, i: int | slice, l2: Any, solver: str) -> FitInfo:
        return FitInfo(self.hist[i], self.its[i], self.conv[i], self.grad[i], l2, solver)


def _facts(fits: list, rows: list[tuple[int, int]]) -> Facts:
    """The facts of model r of fit f for each (f, r) in ``rows``, in one fetch."""
    got = [_unpacked(np.asarray(a)) for a in jax.device_get([f.facts for f in fits])]
    if len(fits) == 1:
        index = [r for _, r in rows]
        return Facts(*(a[index] for a in got[0]))
    conv, grad, its = (np.stack([got[f][k][r] for f, r in rows]) for k in range(3))
    return Facts(
        conv, grad, its, [got[f].hist[r] for f, r in rows], np.stack([got[f].more[r] for f, r in rows])
    )


def _packed(hist, its, gmax, conv, more) -> jax.Array:
    """M fits' facts as one (M, max_iter + 5) array (traced): the objective history, then
    iterations (bit-cast: exact at any count), max |gradient|, converged and still running (a
    chunked fit's call ended first)."""
    dtype = hist.dtype
    its = jax.lax.bitcast_convert_type(its.astype(_INT_OF[dtype.itemsize]), dtype)
    cols = [its, gmax.astype(dtype), conv.astype(dtype), more.astype(dtype)]
    return jnp.concatenate([hist, jnp.stack(cols, axis=1)], axis=1)


def _unpacked(packed: np.ndarray) -> Facts:
    """``_packed``'s rows, fetched, as Facts."""
    its = packed[:, -4].view(np.int32 if packed.dtype.itemsize == 4 else np.int64).astype(np.int32)
    return Facts(packed[:, -2] > 0, packed[:, -3], its, packed[:, :-4], packed[:, -1] > 0)


def _model(fit: Fit, i: int | slice, classes: np.ndarray, info: FitInfo, c: int) -> Model:
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
_every_model = jax.jit(lambda W, b, c: [_cut(W, b, i, c) for i in range(W.shape[1])], static_argnums=2)


def _last(facts: Facts) -> np.ndarray:
    """Each model's objective at its last iteration."""
    return np.array([h[i] for h, i in zip(facts.hist, facts.its, strict=True)])


def _steps(facts: Facts, owners, last: np.ndarray) -> list[tuple]:
    """One step per context, ``(ctx, iteration, losses, gradients)``, over the models it fits
    (``owners``: the context index, or indices, of each model)."""
    mine: dict[int, list[int]] = {}
    for r, owner in enumerate(owners):
        for ctx in np.atleast_1d(owner).tolist():
            mine.setdefault(ctx, []).append(r)
    return [(ctx, int(facts.its[got].max()), last[got], facts.grad[got]) for ctx, got in mine.items()]


class _Job:
    """One compiled fit's calls: ``call()`` starts it; a chunked fit's call ends after
    ``spec.every`` iterations, and ``call(state)`` goes on from the state the last call
    returned, until no model runs on. ``contexts``: the indices of the contexts whose models
    it fits (None: all); ``work``: its last call's work (``_progress.start``)."""

    def __init__(self, spec: Spec, call: Callable, contexts: Sequence[int] | None = None) -> None:
        self.spec, self.call, self.contexts = spec, call, contexts
        self.work = _progress.start(call)

    @property
    def out(self) -> Any:
        return self.work.out

    @property
    def result(self) -> Any:
        return self.out[0] if self.spec.chunked else self.out

    def running(self) -> bool:
        return bool(np.asarray(self.result[-1])[:, -1].any())  # packed facts last; "still running" last

    def resume(self) -> None:
        state = self.out[1]
        self.work = _progress.start(lambda: self.call(state))


def _mapped_job(spec: Spec, devices: tuple, layout: str, args: tuple, omega_spec: Any = None) -> _Job:
    """A job of the layout's SPMD program on ``args`` (a resumed call: the resuming program)."""

    def call(*state):
        return _mapped_program(spec, devices, layout, omega_spec, bool(state))(*args, *state)

    return _Job(spec, call)


def _drive(jobs: list[_Job], run: _progress.Run, progress, facts_of: Callable, owners) -> Facts:
    """Waits for the jobs (``_progress.wait``: Ctrl-C works, a bar once the fit has run for a
    second) and resumes the chunked ones while a model runs on, recording each context's step
    between calls. Returns the facts of the last calls, ``facts_of(results)``, which fetches
    them at once: a fit within one call (the usual case) costs one fetch."""
    for job in jobs:
        run.begin(job.work.began, job.contexts)
    while True:
        _progress.wait([job.work for job in jobs], run, progress)
        for job in jobs:
            run.end(job.work.ended, job.contexts)
        facts = facts_of([job.result for job in jobs])
        if not facts.more.any():
            return facts
        run.steps(_steps(facts, owners, _last(facts)))
        for job in jobs:
            if job.spec.chunked and job.running():
                job.resume()  # the first resumption compiles the resuming program
                run.begin(job.work.began, job.contexts)


def _conclude(run: _progress.Run, facts: Facts, labels, owners, where, solver, data) -> None:
    """Records each context's final step event, and warns about the models that stopped short.

    ``facts``: a row per model; ``labels``: how the warning names each model; ``owners``: the
    context index, or indices, that fitted each model; ``data``: (arrays, names) of the
    features, checked for NaN and inf when a model's gradient is not finite (the solver's first
    gradient reads every value, so finite data needs no pass of its own).
    """
    conv, grad = facts.conv, facts.grad
    if not np.isfinite(grad).all():
        _check_finite(*data, where)
    last = _last(facts)
    first = np.array([h[0] for h in facts.hist])
    run.steps(_steps(facts, owners, last), final=True)
    bad = [
        f"{labels[r] + ': ' if labels[r] else ''}max|gradient| {grad[r]:.3g}" for r in np.flatnonzero(~conv)
    ]
    diverged = bool(np.any(~conv & (~np.isfinite(last) | (last > first))))
    if not bad:
        return
    shown = "; ".join(bad[:8]) + (f"; ... ({len(bad)} in all)" if len(bad) > 8 else "")
    if diverged:
        what = "the fit diverged (the objective rose)"
        fix = "lower learning_rate" if solver == "gd" else "standardise the features or raise l2"
    else:
        what = "did not converge"
        fix = (
            "raise max_iter (steps) or use solver='newton' or 'lbfgs'"
            if solver == "gd"
            else "raise max_iter, standardise the features, or raise l2"
        )
    warnings.warn(f"{where}: {what} ({solver}): {shown}. To fix it, {fix}.", ConvergenceWarning, stacklevel=3)


def _run(what, targets: Targets, samples, models, spec: Spec) -> _progress.Run:
    return _progress.Run(
        f"{what} ({spec.solver})",
        targets.names,
        [_devices.short_name(d) for d in targets.devices],
        samples,
        models,
        spec.max_iter if spec.solver == "gd" else None,
    )


def _scalars(opts: _Options, dtype, devices: tuple = ()) -> tuple:
    """tol and learning rate, the program's scalar arguments. For an SPMD program (``devices``)
    they are kept on the devices between fits: copying scalars to eight devices costs more than
    a short fit's host work."""
    if not devices:
        return np.asarray(opts.tol, dtype), np.asarray(opts.learning_rate, dtype)
    name = np.dtype(dtype).name
    return tuple(_replicated(float(v), name, devices) for v in (opts.tol, opts.learning_rate))


@functools.lru_cache(maxsize=64)
def _replicated(value: float, dtype: str, devices: tuple) -> jax.Array:
    return jax.device_put(np.asarray(value, dtype), _parallel._sharding(devices, AXIS, None))


# -- fit: one model, data-parallel ---------------------------------------------------------


def fit(
    X: Any,
    y: Any,
    l2: float | None = None,
    *,
    C: float | None = None,
    sample_weight: Any = None,
    solver: str = "auto",
    max_iter: int | None = None,
    tol: float = 1e-5,
    learning_rate: float = 0.1,
    init: Any = None,
    contexts: Any = None,
    progress: bool | None = None,
) -> Model:
    """Fits one logistic regression with its rows split across contexts (data-parallel).

    Each device computes the loss, gradient (and Hessian) of its rows; the shares are summed
    every iteration, so every device holds the same model and the answer does not depend on
    how many contexts share the work. Any number of rows works.

    Args:
      X: (n, d) features, numpy or JAX.
      y: (n,) labels, any k >= 2 distinct sortable values.
      l2: penalty in ``mean(log-loss) + l2 * ||w||^2``. Default: scikit-learn's default
        ``C=1``, i.e. ``l2 = 1 / (2 * n)``.
      C: scikit-learn's inverse penalty instead of l2 (``l2 = 1 / (2 * C * n)``).
      sample_weight: (n,) non-negative row weights (the mean becomes a weighted mean).
      solver: ``"auto"`` (Newton when the Hessian is small, else L-BFGS), ``"newton"``,
        ``"lbfgs"``, or ``"gd"``: fixed ``learning_rate`` for exactly ``max_iter`` steps.
      max_iter: iterations at most (gd: steps). Default 100 (newton), 1000 (lbfgs), 10000 (gd).
      tol: stop when every gradient component is at most this.
      learning_rate: gd's step size.
      init: a Model or ``(w, b)`` to start from (default zeros).
      contexts: context names, a count (the first n) or None for every context in the map.
      progress: None: a progress bar once the fit has run for a second; True: at once; False: never.

    Returns:
      A Model; its arrays are replicated on every context's device.

    >>> import mgkit as mg, numpy as np
    >>> X = np.array([[-2.0], [-1.0], [1.0], [2.0]]); y = np.array([0, 0, 1, 1])
    >>> m = mg.logreg.fit(X, y, l2=0.01, contexts=2)
    >>> mg.logreg.predict(m, X).tolist(), bool(m.info.converged)
    ([0, 0, 1, 1], True)
    """
    where = "logreg.fit"
    opts = _options(solver, max_iter, tol, learning_rate, progress, where)
    targets = _parallel.resolve(contexts, where)
    X = _check_X(X, where)
    n, d = X.shape
    y_idx, classes = _encode(y, n, where)
    omega = None if sample_weight is None else _weights(sample_weight, n, where)[:, None]
    l2v = _penalty(l2, C, float(n) if omega is None else float(omega.sum()), where)
    c = 1 if len(classes) == 2 else len(classes)
    W0, b0 = _init(init, d, c, where)
    devices = tuple(dict.fromkeys(targets.devices))  # two names on one device share its rows
    if len({dev.platform for dev in devices}) > 1:
        kinds = ", ".join(
            f"{nm}->{_devices.short_name(dv)}" for nm, dv in zip(targets.names, targets.devices, strict=True)
        )
        raise ValueError(
            f"{where}: a data-parallel fit sums every iteration over one SPMD program, which needs "
            f"devices of one kind, but the contexts mix kinds ({kinds}). Pass contexts=[...] naming "
            "devices of one kind, or fit one model per context with mg.logreg.fit_per_device"
        )
    first = {}  # each device under the first of the given contexts that names it
    for nm, dv in zip(targets.names, targets.devices, strict=True):
        first.setdefault(dv, nm)
    targets = Targets(tuple(first.values()), devices, True)
    k = len(devices)
    spec = _spec(opts, d, c, devices[0].platform, True, rows=-(-n // k), models=1, held=n)
    sizes = _parallel.shares(n, k)
    dtype = _dtype()
    run = _run("logreg.fit", targets, sizes, [1] * k, spec)
    padded = len(set(sizes)) > 1
    weighted = omega is not None or padded  # else every row weighs one, made on the devices
    if padded and omega is None:
        omega = np.ones((n, 1), dtype)
    start = bool(W0.any() or b0.any())  # else the start from zeros is made on the devices
    parts = {
        "X": (X, 0),
        "y": (y_idx, 0),
        "sample_weight": (omega, 0) if weighted else None,
        "init w": (W0.reshape(d, 1, c).astype(dtype), None) if start else None,
        "init b": (b0.reshape(1, c).astype(dtype), None) if start else None,
        "l2": (np.asarray([l2v], dtype), None),
    }
    names = [nm for nm, part in parts.items() if part is not None]
    batch = Batch(
        [parts[nm][0] for nm in names], None, tuple(parts[nm][1] for nm in names), n, _names(*names)
    )
    # one placement; the arrays made here (all but X) need no private copies
    placed = _parallel.place_spmd(batch, targets, sizes, own=range(1, len(names)))
    got = dict(zip(names, placed, strict=True))
    if padded:  # padding rows repeat a real row: zero their weight
        keep = np.zeros((k * max(sizes), 1), dtype)
        keep[_parallel._padding(sizes)[1]] = 1
        got["sample_weight"] = got["sample_weight"] * keep
    placed = [got.get(nm) for nm in ("X", "y", "sample_weight", "init w", "init b", "l2")]
    args = (*placed, *_scalars(opts, dtype, devices))
    owners = [list(range(k))]  # every context holds the one model
    try:
        job = _mapped_job(spec, devices, "rows", args)
        facts = _drive([job], run, opts.progress, lambda fits: _facts(fits, [(0, 0)]), owners)
        _conclude(run, facts, [""], owners, where, spec.solver, ([X], ["X"]))
    finally:
        run.close()
    return _model(job.result, 0, classes, facts.info(0, np.asarray(l2v, dtype), spec.solver), c)


def _names(*names: str) -> Callable[[int], str]:
    return lambda i: names[i]


def _weights(w: Any, n: int, where: str) -> np.ndarray:
    w = np.asarray(w, dtype=np.float64)
    if w.shape != (n,):
        raise ValueError(f"{where}: sample_weight has shape {w.shape}; expected ({n},), one weight per row")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError(f"{where}: sample_weight must be finite and >= 0")
    if w.sum() <= 0:
        raise ValueError(f"{where}: sample_weight sums to 0; at least one row needs a positive weight")
    return w.astype(_dtype())


# -- fit_per_device: one model per context -------------------------------------------------


def fit_per_device(
    data: Mapping[str, tuple] | Callable[[str], tuple],
    l2: Any = None,
    *,
    C: Any = None,
    solver: str = "auto",
    max_iter: int | None = None,
    tol: float = 1e-5,
    learning_rate: float = 0.1,
    init: Any = None,
    contexts: Any = None,
    progress: bool | None = None,
) -> dict[str, Model]:
    """Fits one model per context, each on its own data and device, all at once (seed 000).

    Args:
      data: ``{context: (X, y)}``, or a function ``context -> (X, y)`` that makes each
        context's data; it runs inside ``mg.on(context)``, so arrays it creates land there.
      l2, C: the penalty, shared by every model, or a ``{context: value}`` mapping of
        private values. Default: ``C=1`` as in scikit-learn.
      init: a Model or ``(w, b)`` for every context, or a ``{context: ...}`` mapping.
      contexts: with a data function, the contexts to fit on (default: every context).
      solver, max_iter, tol, learning_rate, progress: as in ``fit``.

    Returns:
      ``{context: Model}``; each model's arrays live on its context's device.

    >>> import mgkit as mg, numpy as np
    >>> _ = mg.use_contexts("a->cpu0;b->cpu1", verbose=False)
    >>> X = np.array([[-2.0], [-1.0], [1.0], [2.0]])
    >>> models = mg.logreg.fit_per_device({"a": (X, [0, 0, 1, 1]), "b": (X, [1, 1, 0, 0])}, l2=0.01)
    >>> {k: mg.logreg.predict(m, X).tolist() for k, m in models.items()}
    {'a': [0, 0, 1, 1], 'b': [1, 1, 0, 0]}
    >>> mg.where(models["b"].w)
    'b'
    """
    where = "logreg.fit_per_device"
    opts = _options(solver, max_iter, tol, learning_rate, progress, where)
    if callable(data) and not isinstance(data, Mapping):
        targets = _parallel.resolve(contexts, where)
        made = {}
        for name in targets.names:
            with _contexts.on(name):
                made[name] = data(name)
        data, source = made, "the data function returned, for context {!r},"
    elif isinstance(data, Mapping):
        if contexts is not None:
            raise ValueError(f"{where}: contexts= is for a data function; a mapping names its contexts")
        if not data:
            raise ValueError(
                f"{where}: no data; pass {{context: (X, y), ...}} or a function context -> (X, y)"
            )
        targets = _parallel.resolve(list(data), where)
        source = "the data for context {!r} is"
    else:
        raise TypeError(
            f"{where}: data must be a mapping {{context: (X, y)}} or a function context -> (X, y), got "
            f"{type(data).__name__}"
        )
    parts = []
    for name in targets.names:
        pair = data[name]
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise TypeError(
                f"{where}: {source.format(name)} a {type(pair).__name__}; expected a pair (X, y) with X of "
                "shape (n, d) and y of shape (n,)"
            )
        X = _check_X(pair[0], where, f"X for context {name!r}")
        y_idx, classes = _encode(pair[1], X.shape[0], where, f"y for context {name!r}")
        parts.append((X, y_idx, classes))
    l2s = _private(l2, targets, where, "l2")
    Cs = _private(C, targets, where, "C")
    inits = _private(init, targets, where, "init")
    dtype = _dtype()
    same = len({(X.shape, len(cl)) for X, _, cl in parts}) == 1
    shapes = [(X.shape[1], 1 if len(cl) == 2 else len(cl)) for X, _, cl in parts]
    penalties, starts, specs = [], [], []
    held = sum(X.shape[0] for X, _, _ in parts)
    sharing = collections.Counter(targets.devices)  # contexts on one device are fitted together
    for i, ((X, _, _), (d, c)) in enumerate(zip(parts, shapes, strict=True)):
        penalties.append(_penalty(l2s[i], Cs[i], X.shape[0], where))
        starts.append(_init(inits[i], d, c, where))
        platform = targets.devices[i].platform
        specs.append(_spec(opts, d, c, platform, False, X.shape[0], sharing[targets.devices[i]], held))
    run = _run(
        "logreg.fit_per_device", targets, [X.shape[0] for X, _, _ in parts], [1] * len(parts), specs[0]
    )
    try:
        owners = range(len(targets.names))
        if targets.spmd and same:
            job = _per_device_spmd(parts, starts, penalties, targets, specs[0], opts, dtype)
            # every model's facts in one fetch
            facts = _drive([job], run, opts.progress, lambda got: _unpacked(np.asarray(got[0][1])), owners)
            blocks = {s.device: s.data for s in job.result[0].addressable_shards}  # model i's w and b
            arrays = [
                _split(blocks[device], c) for device, (_, c) in zip(targets.devices, shapes, strict=True)
            ]
        else:
            jobs, slots = _per_device_local(parts, starts, penalties, targets, specs, opts, dtype)
            facts = _drive(jobs, run, opts.progress, lambda fits: _facts(fits, slots), owners)
            each = [_every_model(job.result.W, job.result.b, job.spec.c) for job in jobs]
            arrays = [each[j][m] for j, m in slots]
        data = ([X for X, _, _ in parts], [f"X for context {nm!r}" for nm in targets.names])
        names = list(targets.names)
        _conclude(run, facts, names, owners, where, specs[0].solver, data)
    finally:
        run.close()
    return {
        name: Model(w, b, classes, facts.info(i, np.asarray(l2v, dtype), spec.solver))
        for i, (name, (w, b), (_, _, classes), l2v, spec) in enumerate(
            zip(names, arrays, parts, penalties, specs, strict=True)
        )
    }


@functools.partial(jax.jit, static_argnums=1)
def _split(wb: jax.Array, c: int) -> tuple:
    """One device's (d + 1, c) block of a per-device fit -> its model's w and b."""
    return (wb[:-1, 0], wb[-1, 0]) if c == 1 else (wb[:-1], wb[-1])


def _private(value: Any, targets: Targets, where: str, what: str) -> list:
    """A value shared by every context, or a {context: value} mapping of private ones."""
    if not isinstance(value, Mapping):
        return [value] * len(targets.names)
    return _parallel.per_context(value, targets, f"{what}= as a mapping", where)


def _per_device_rows(parts, penalties, starts, dtype) -> np.ndarray:
    """Every model's class indices, penalty and (unless all are zeros) start as one array, the
    models' parts in turn (an SPMD program's model i: device i's part), in the fit's float type
    (class indices are exact in it: below 2**24). One placement of a few kilobytes costs what
    one of a few bytes does (0.13 ms to 8 CPU devices), and this makes one instead of three."""
    given = any(w.any() or b.any() for w, b in starts)
    pieces = []
    for (_, y_idx, _), l2v, (w, b) in zip(parts, penalties, starts, strict=True):
        pieces += [y_idx, [l2v], *((w.ravel(), b.ravel()) if given else ())]
    return np.concatenate(pieces, dtype=dtype, casting="unsafe")


def _per_device_spmd(parts, starts, penalties, targets, spec, opts, dtype) -> _Job:
    """One SPMD program: device i fits model i on its own rows. Each X is put on its device
    (one already there stays: no copy) and the blocks form one row-sharded array; model i's
    labels, penalty and start go to device i, all in one placement. The job's result: the M
    models' w and b, (M * (d + 1), c) with model i's block on device i, and their packed facts
    (``_packed``)."""
    k, n = len(targets.names), parts[0][0].shape[0]
    # host X bound for CPU devices are copied all at once, over two threads (eight 1.25 MB
    # copies one after another take twice as long)
    Xs = [
        place([X], name, device, "put", private=True)[0]
        for X, name, device in zip(
            staged([X for X, _, _ in parts], targets.devices), targets.names, targets.devices, strict=True
        )
    ]
    sharding = jax.sharding.NamedSharding(_parallel.mesh(targets.devices), _ROWS)
    X = jax.make_array_from_single_device_arrays((k * n, Xs[0].shape[1]), sharding, Xs)
    # Made here, never the caller's: no private copy. Row weights (all one) and a start from
    # zeros are made on the devices.
    rows = _per_device_rows(parts, penalties, starts, dtype)
    (rows,) = _parallel.place_spmd(
        Batch([rows], None, (0,), len(rows), _names("labels, l2 and start")),
        targets,
        (len(rows) // k,) * k,
        own=True,
    )
    args = (X, rows, *_scalars(opts, dtype, targets.devices))
    return _mapped_job(spec, targets.devices, "devices", args)


def _per_device_local(parts, starts, penalties, targets, specs, opts, dtype) -> tuple[list[_Job], list]:
    """One program per device, all dispatched before any is waited on. The models of contexts
    that share a device (with data of one shape) are fitted together, stacked: eight contexts on
    one GPU cost about one fit, not eight. Returns the jobs and, per context, (its job's index,
    the index of its model in the job's fit)."""
    groups: dict[tuple, list[int]] = {}
    for i, ((X, _, _), spec) in enumerate(zip(parts, specs, strict=True)):
        groups.setdefault((targets.devices[i], spec, X.shape), []).append(i)
    scalars = _scalars(opts, dtype)
    jobs: list[_Job] = []
    slots: list = [None] * len(parts)
    for (device, spec, _), members in groups.items():
        Xs = tuple(place([parts[i][0]], targets.names[i], device, "put")[0] for i in members)
        # the group's labels, penalties and starts: one placement (row weights are made there)
        rows = _per_device_rows(*([seq[i] for i in members] for seq in (parts, penalties, starts)), dtype)
        (rows,) = place([rows.reshape(len(members), -1)], targets.names[members[0]], device, "put")
        stacked = len(members) > 1
        program = _per_device_program(spec, stacked)
        jobs.append(_Job(spec, functools.partial(program, Xs if stacked else Xs[0], rows, *scalars), members))
        for m, i in enumerate(members):
            slots[i] = (len(jobs) - 1, m)
    return jobs, slots


# -- fit_many: K models, several per device ------------------------------------------------


def fit_many(
    X: Any,
    y: Any,
    l2: Any = None,
    *,
    C: Any = None,
    rows: Sequence[Any] | None = None,
    solver: str = "auto",
    max_iter: int | None = None,
    tol: float = 1e-5,
    learning_rate: float = 0.1,
    contexts: Any = None,
    progress: bool | None = None,
) -> Model:
    """Fits K models on one data set, spread over the contexts, several per device at once.

    Args:
      X, y: the data, as in ``fit``; every device gets a copy.
      l2: a list of K penalties (a sweep); or one value for every model when ``rows`` is given.
      C: scikit-learn's C instead of l2 (one value or a list).
      rows: K sets of row indices (repeats allowed: bootstrap samples); model i is fitted on
        ``X[rows[i]], y[rows[i]]``.
      solver, max_iter, tol, learning_rate, contexts, progress: as in ``fit``.

    Returns:
      One Model whose arrays have a leading axis of K models (``unstack`` gives a list), on the
      first context. Each model equals fitting it alone.

    >>> import mgkit as mg, numpy as np
    >>> X = np.array([[-2.0], [-1.0], [1.0], [2.0]]); y = np.array([0, 0, 1, 1])
    >>> sweep = mg.logreg.fit_many(X, y, l2=[0.001, 0.01, 0.1])
    >>> sweep.w.shape, [round(float(w), 2) for w in sweep.w[:, 0]]
    ((3, 1), [4.12, 2.42, 1.11])
    """
    where = "logreg.fit_many"
    opts = _options(solver, max_iter, tol, learning_rate, progress, where)
    targets = _parallel.resolve(contexts, where)
    X = _check_X(X, where)
    n, d = X.shape
    y_idx, classes = _encode(y, n, where)
    dtype = _dtype()
    if rows is not None:
        counts = _row_sets(rows, n, where)
        k_models = len(counts)
        sizes_n = counts.sum(axis=1)
    else:
        counts, sizes_n = None, None
    values = l2 if l2 is not None else C
    name = "l2" if l2 is not None else "C"
    if isinstance(values, Sequence | np.ndarray) and not isinstance(values, str):
        values = list(np.asarray(values).tolist()) if isinstance(values, np.ndarray) else list(values)
        if not values:
            raise ValueError(
                f"{where}: {name} is an empty list; give one value per model, e.g. {name}=[1e-4, 1e-3]"
            )
        if rows is not None and len(values) != k_models:
            raise ValueError(
                f"{where}: {name} has {len(values)} values but rows has {k_models} sets; give one {name} "
                f"per row set, or a single {name} for all"
            )
        k_models = len(values)
    elif rows is None:
        raise ValueError(
            f"{where}: nothing to sweep; give a list of penalties (l2=[1e-4, 1e-3, ...]) or of row sets "
            "(rows=[idx0, idx1, ...]) to fit one model each"
        )
    else:
        values = [values] * k_models
    per_n = sizes_n if sizes_n is not None else np.full(k_models, n)
    penalties = [
        _penalty(v if name == "l2" else None, v if name == "C" else None, float(m), where)
        for v, m in zip(values, per_n, strict=True)
    ]
    c = 1 if len(classes) == 2 else len(classes)
    used = min(k_models, len(targets.names))
    targets = Targets(targets.names[:used], targets.devices[:used], targets.spmd)
    platform, per = targets.devices[0].platform, -(-k_models // used)
    spec = _spec(opts, d, c, platform, False, rows=n, models=per, held=n * used)
    if opts.solver == "auto" and spec.solver == "newton" and platform == "cpu":
        # XLA's CPU batched Cholesky can deadlock its worker threads with several models per
        # simulated device; L-BFGS needs no factorisation.
        spec = _spec(opts._replace(solver="lbfgs"), d, c, platform, False, n, per, n * used)
    chunks = [per] * used if targets.spmd else list(_parallel.shares(k_models, used))
    padded = sum(chunks)
    order = list(range(k_models)) + [k_models - 1] * (padded - k_models)  # repeats the last model
    pen = np.asarray([penalties[i] for i in order], dtype)
    omega = np.ones((n, 1), dtype) if counts is None else counts[order].T.astype(dtype)
    W0, b0 = np.zeros((d, padded, c), dtype), np.zeros((padded, c), dtype)
    run = _run("logreg.fit_many", targets, [n] * used, chunks, spec)
    try:
        if targets.spmd:
            axes = (None, None, None if counts is None else 1, 1, 0, 0)
            batch = Batch(
                [X, y_idx, omega, W0, b0, pen],
                None,
                axes,
                padded,
                _names("X", "y", "rows", "init w", "init b", "l2"),
            )
            placed = _parallel.place_spmd(batch, targets, tuple(chunks))
            omega_spec = _REPL if counts is None else _MODELS
            devices = targets.devices
            args = (*placed, *_scalars(opts, dtype, devices))
            jobs = [_mapped_job(spec, devices, "models", args, omega_spec)]
            slots = [(0, j) for j in range(k_models)]  # (job, model in its fit) of each model
        else:
            jobs, start, slots = [], 0, []
            scalars = _scalars(opts, dtype)
            for i, (ctx, device, m) in enumerate(zip(targets.names, targets.devices, chunks, strict=True)):
                part = slice(start, start + m)
                start += m
                om = omega if counts is None else omega[:, part]
                args = place([X, y_idx, om, W0[:, part], b0[part], pen[part]], ctx, device, "replicate")
                program = functools.partial(_local_program(spec), *args, *scalars)
                jobs.append(_Job(spec, program, [i]))
                slots += [(i, j) for j in range(m)]
            slots = slots[:k_models]
        owners = np.repeat(np.arange(len(chunks)), chunks)[:k_models]
        facts = _drive(jobs, run, opts.progress, lambda fits: _facts(fits, slots), owners)
        first, device = targets.names[0], targets.devices[0]
        if targets.spmd:
            got = {"from": "+".join(targets.names)}
            W, b = place(list(jobs[0].result[:2]), first, device, "gather", got)
        else:
            moved = [place(list(job.result[:2]), first, device, "gather") for job in jobs]
            W, b = (jnp.concatenate(f, axis=1 - j) for j, f in enumerate(zip(*moved, strict=True)))
        out = Fit(W, b, None)
        labels = [f"model {j}" for j in range(k_models)]
        _conclude(run, facts, labels, owners, where, spec.solver, ([X], ["X"]))
    finally:
        run.close()
    info = facts.info(slice(None), pen[:k_models], spec.solver)
    return _model(out, slice(0, k_models), classes, info, c)


def _row_sets(rows: Any, n: int, where: str) -> np.ndarray:
    """Row-index sets -> (K, n) counts (how often each row is drawn)."""
    if isinstance(rows, str | bytes) or not isinstance(rows, Sequence | np.ndarray):
        raise TypeError(
            f"{where}: rows must be a list of index arrays, one per model, got {type(rows).__name__}"
        )
    if len(rows) == 0:
        raise ValueError(f"{where}: rows is an empty list; give one array of row indices per model")
    counts = np.zeros((len(rows), n), np.int64)
    for i, idx in enumerate(rows):
        idx = np.asarray(idx)
        if idx.ndim != 1 or idx.size == 0 or idx.dtype.kind not in "iu":
            raise ValueError(
                f"{where}: rows[{i}] must be a non-empty 1-D array of integer row indices, got "
                f"{idx.dtype} of shape {idx.shape}"
            )
        if idx.min() < 0 or idx.max() >= n:
            bad = idx[(idx < 0) | (idx >= n)][0]
            raise ValueError(f"{where}: rows[{i}] has index {int(bad)}, but X has {n} rows (0..{n - 1})")
        counts[i] = np.bincount(idx, minlength=n)
    return counts
