"""The solver (traced; local data, M models): Newton, L-BFGS and gradient descent, one compiled
loop each, for a batch of models at once."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._spmd import AXIS
from ._results import INT_OF, Fit, pack_facts

HI = jax.lax.Precision.HIGHEST
_MEMORY = 10  # L-BFGS correction pairs
_ARMIJO = 1e-4
BACKTRACKS = 30
_LINE_NEWTON = 2  # Newton steps on the step length per iteration


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
    batched_search: bool = False  # every backtracking step length is tried at once: see ``make_spec``

    @property
    def chunked(self) -> bool:
        """The fit may outlast one call: each call runs ``every`` iterations at most and returns
        the solver's state with its results, and the host resumes it (``drive``)."""
        return self.every < self.max_iter


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


_KINDS = _Carry(*"ii" + "f" * 6 + "bb" + "ffff")  # i: int32, b: bool, f: the fit's float type


def _pack(st: _Carry, dtype) -> jax.Array:
    """The solver's state as one flat array of its float type (integers bit-cast: exact), so a
    call hands it to the next as one buffer per device, not fourteen."""
    parts = []
    for a, kind in zip(st, _KINDS, strict=True):
        if kind == "i":
            a = jax.lax.bitcast_convert_type(a.astype(INT_OF[jnp.dtype(dtype).itemsize]), dtype)
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
            a = jax.lax.bitcast_convert_type(a, INT_OF[a.dtype.itemsize]).astype(jnp.int32)
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
            Z = jnp.einsum("mnd,dmc->mcn", X, W, precision=HI)
        elif K == 1 and spec.fused:  # (1, d) x (d, n): a matrix-vector product written into a row
            Z = jnp.dot(W.reshape(d, K).T, X.T, precision=HI)
        else:
            Z = jnp.dot(X, W.reshape(d, K), precision=HI).T
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
            gW = jnp.einsum("mnd,mcn->dmc", X, R, precision=HI)
        else:
            if spec.fused and K == 1:  # one fused multiply-sum beats XLA's CPU vector x matrix
                gW = _halves_sum(X, R.reshape(n))
            else:
                gW = jnp.dot(R.reshape(K, n), X, precision=HI)
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
            H = jnp.einsum(f"{x}i,mn,{x}j->mij", Xa, s, Xa, precision=HI)
        else:
            wp = Pr * wn[:, None]
            H1 = jnp.einsum(f"{x}i,man,{x}j->miaj", Xa, wp, Xa, precision=HI)
            H2 = jnp.einsum(f"{x}i,man,{x}j,mbn->miajb", Xa, wp, Xa, Pr, precision=HI)
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
        q = jnp.einsum("mkp,mp->mk", st.SY, st.g, precision=HI)  # S'g and Y'g
        filled = jnp.diagonal(st.YtY, axis1=1, axis2=2) > 0  # a kept pair has y != 0
        sy = jnp.where(filled, 1.0 / jnp.diagonal(st.Rinv, axis1=1, axis2=2), 0.0)
        yy = st.YtY[:, 0, 0]
        gnorm = jnp.sqrt(jnp.sum(st.g * st.g, axis=1))
        first = 1.0 / jnp.where(gnorm > 0, gnorm, 1.0)  # a first step of unit length
        gamma = jnp.where(filled[:, 0], sy[:, 0] / jnp.where(yy > 0, yy, 1.0), first)[:, None]
        u = jnp.einsum("mij,mj->mi", st.Rinv, q[:, :m], precision=HI)  # R^-1 S'g
        v = sy * u + gamma * (jnp.einsum("mij,mj->mi", st.YtY, u, precision=HI) - q[:, m:])
        top = jnp.einsum("mji,mj->mi", st.Rinv, v, precision=HI)  # R^-T v
        step = -(
            gamma * st.g
            + jnp.einsum("mkp,mk->mp", st.SY, jnp.concatenate([top, -gamma * u], 1), precision=HI)
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
        q = jnp.einsum("mkp,mp->mk", st.SY, yv, precision=HI)  # the kept pairs' s_i . yv and y_i . yv
        yy = jnp.sum(yv * yv, axis=1)

        def shifted(A, col):  # the newest pair's products in row and column 0, the rest moved down
            A = jnp.pad(A[:, :-1, :-1], ((0, 0), (1, 0), (1, 0)))
            return A.at[:, :, 0].set(col)

        lead = st.Rinv[:, : m - 1, : m - 1]
        inv_col = jnp.concatenate(
            [1.0 / sy[:, None], -jnp.einsum("mij,mj->mi", lead, q[:, : m - 1], precision=HI) / sy[:, None]],
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
        if spec.batched_search:  # t, t / 2, ... t / 2**BACKTRACKS at once; the first that passes
            ts = t * 0.5 ** jnp.arange(BACKTRACKS + 1, dtype=dtype)[:, None]
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
                lambda s: (s[0] < BACKTRACKS) & ~jnp.all(s[3]), backtrack, (0, t, f_t, ok)
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
    fit = Fit(st.W, st.b, pack_facts(hist, st.its, gmax, conv, ~st.done & (st.it < spec.max_iter)))
    return (fit, _pack(st, dtype)) if spec.chunked else fit
