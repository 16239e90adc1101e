"""The solver (traced; local data, M models at once): Newton, L-BFGS and gradient descent,
each a step function run by one loop (``iterate``) inside one compiled program.

A state NamedTuple (``State``) and pure functions: the directions (``newton_direction``,
``lbfgs_direction``, with the pair memory ``remember``), the stopping rule (``stops``), the
iterations (``search_iteration``, with Newton's point ``newton_point``, ``gd_iteration``) and
the loop driver. The objective lives in ``_objective``, the step length (Newton along the line,
backtracking) in ``_linesearch``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._spmd import AXIS
from . import _objective as ob
from ._linesearch import backtrack, backtrack_at_once, newton_length
from ._objective import HI, Problem
from ._results import INT_OF, Fit, pack_facts

_MEMORY = 10  # L-BFGS correction pairs


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
    own_solve: bool = False  # the Newton system solved by XLA ops, not LAPACK: see ``make_spec``

    @property
    def chunked(self) -> bool:
        """The fit may outlast one call: each call runs ``every`` iterations at most and returns
        the solver's state with its results, and the host resumes it (``drive``)."""
        return self.every < self.max_iter

    @property
    def span(self) -> int:
        """Iterations per call at most: a call's history holds ``span + 1`` values."""
        return min(self.every, self.max_iter)


class Args(NamedTuple):
    """A compiled fit's arrays, by name: every program takes them as one argument."""

    X: Any  # (n, d), or (M, n, d) stacked
    y: Any  # (n,) class indices, or (n, M) stacked
    omega: Any  # (n, 1 or M) row weights (0 for padding), or None: every row weighs one
    W0: Any  # (d, M, c) start, or None: zeros
    b0: Any  # (M, c) start, or None: zeros
    l2: Any  # (M,) penalties, in the fit's float type


class State(NamedTuple):
    """The solver's loop state for M models (p = (d + 1) * c flat parameters per model)."""

    it: Any  # () iterations run by the batch
    its: Any  # (M,) iterations each model took (models stop on their own in a batch)
    W: Any  # (d, M, c) weights
    b: Any  # (M, c) intercepts
    Z: Any  # (M, c, n) scores of the current model (L-BFGS: updated along each step; Newton: recomputed)
    f: Any  # (M,) objective
    g: Any  # (M, p) gradient
    gmax: Any  # (M,) max |gradient|
    d: Any  # (M, p) L-BFGS: the next step's direction from this point; Newton: -H^-1 g with the
    # Hessian of the point the last step began from. Its decrement: ``stops``
    done: Any  # (M,) bool: converged, stalled or not finite: the model takes no more steps
    stalled: Any  # (M,) bool: the line search found no lower objective
    conv: Any  # (M,) bool: the stopping rule holds (``stops``)
    # not carried from call to call (``pack_state``): this call's own
    base: Any  # () the iteration this call began at
    hist: Any  # (M, span + 1) objective at iterations base, base + 1, ...; NaN where not run
    # L-BFGS's pair memory (m = 0 for the other solvers)
    SY: Any  # L-BFGS: the last steps s_i and gradient changes y_i, (M, 2m, p), newest first
    Rinv: Any  # the inverse of R, R[i, j] = s_i . y_j for i >= j (pair i no newer than j), (M, m, m)
    YtY: Any  # y_i . y_j, (M, m, m)


class Pairs(NamedTuple):
    """L-BFGS's memory of m correction pairs (``State``'s last three fields)."""

    SY: Any
    Rinv: Any
    YtY: Any


# i: int32, b: bool, f: the fit's float type, -: not carried from call to call
_KINDS = State(*"ii" + "f" * 7 + "bbb" + "--" + "fff")


def pack_state(st: State, dtype) -> jax.Array:
    """The solver's state as one flat array of its float type (integers bit-cast: exact), so a
    call hands it to the next as one buffer per device, not fifteen."""
    parts = []
    for a, kind in zip(st, _KINDS, strict=True):
        if kind == "-":
            continue
        if kind == "i":
            a = jax.lax.bitcast_convert_type(a.astype(INT_OF[jnp.dtype(dtype).itemsize]), dtype)
        parts.append(jnp.ravel(a).astype(dtype))
    return jnp.concatenate(parts)


def unpack_state(flat: jax.Array, like: State) -> State:
    """``pack_state``'s inverse; ``like`` holds each field's shape. The fields not carried are
    a new call's: it begins at the carried iteration, with no history yet."""
    fields, at = [], 0
    for shape, kind in zip(like, _KINDS, strict=True):
        if kind == "-":
            fields.append(None)
            continue
        size = math.prod(shape)
        a = flat[at : at + size].reshape(shape)
        at += size
        if kind == "i":
            a = jax.lax.bitcast_convert_type(a, INT_OF[a.dtype.itemsize]).astype(jnp.int32)
        fields.append(a > 0 if kind == "b" else a)
    st = State(*fields)
    return st._replace(base=st.it, hist=jnp.full(like.hist, jnp.nan, flat.dtype))


# -- directions ----------------------------------------------------------------------------


def empty_pairs(M: int, p: int, m: int, dtype) -> Pairs:
    """No pairs yet: R = I, every slot s = y = 0."""
    return Pairs(
        jnp.zeros((M, 2 * m, p), dtype),
        jnp.broadcast_to(jnp.eye(m, dtype=dtype), (M, m, m)),
        jnp.zeros((M, m, m), dtype),
    )


def lbfgs_direction(pairs: Pairs, g: jax.Array) -> jax.Array:
    """-H g for L-BFGS's inverse Hessian H, (M, p), from m pairs (any m; empty slots s = y = 0
    have a unit diagonal in R and contribute nothing); -g where that is not a descent step.

    Reference: R. H. Byrd, J. Nocedal and R. B. Schnabel, "Representations of quasi-Newton
    matrices and their use in limited memory methods", Math. Programming 63 (1994), eq. (3.13):
    H = gamma I + [S gamma Y] [[R^-T (D + gamma Y'Y) R^-1, -R^-T], [-R^-1, 0]] [S'; gamma Y'],
    R the pairs' s_i . y_j for i no newer than j, D its diagonal, gamma = s'y / y'y of the
    newest pair (a first step of unit length when there is none). Two products with the stored
    pairs and two with R's inverse (kept up to date by ``remember``) replace the two-loop
    recursion's 4m dependent dot products and updates (400 x 784 on a CPU: a fit a tenth
    faster)."""
    m = pairs.Rinv.shape[-1]
    q = jnp.einsum("mkp,mp->mk", pairs.SY, g, precision=HI)  # S'g and Y'g
    filled = jnp.diagonal(pairs.YtY, axis1=1, axis2=2) > 0  # a kept pair has y != 0
    sy = jnp.where(filled, 1.0 / jnp.diagonal(pairs.Rinv, axis1=1, axis2=2), 0.0)
    yy = pairs.YtY[:, 0, 0]
    gnorm = jnp.sqrt(jnp.sum(g * g, axis=1))
    first = 1.0 / jnp.where(gnorm > 0, gnorm, 1.0)  # a first step of unit length
    gamma = jnp.where(filled[:, 0], sy[:, 0] / jnp.where(yy > 0, yy, 1.0), first)[:, None]
    u = jnp.einsum("mij,mj->mi", pairs.Rinv, q[:, :m], precision=HI)  # R^-1 S'g
    v = sy * u + gamma * (jnp.einsum("mij,mj->mi", pairs.YtY, u, precision=HI) - q[:, m:])
    top = jnp.einsum("mji,mj->mi", pairs.Rinv, v, precision=HI)  # R^-T v
    step = -(
        gamma * g + jnp.einsum("mkp,mk->mp", pairs.SY, jnp.concatenate([top, -gamma * u], 1), precision=HI)
    )
    descent = jnp.sum(step * g, axis=1) < 0
    return jnp.where(descent[:, None], step, -g)


def remember(pairs: Pairs, keep, s, yv, sy) -> Pairs:
    """The pair (s, yv), s . yv = sy, becomes the newest for the models that ``keep`` it; the
    oldest goes.

    R's inverse follows without a solve: the new R is [[sy, 0], [c, R0]], c the kept pairs'
    s_i . yv and R0 the old R less its oldest row and column, whose inverse is the old
    inverse's leading block (R is lower triangular). So the new inverse is
    [[1 / sy, 0], [-R0^-1 c / sy, R0^-1]]: one m x m product. (An accelerator runs a
    triangular solve as a library call of its own, between the loop's captured launches:
    without the two per iteration, eight 400 x 784 models fit in 2.3 ms on an H100, not 3.0;
    a CPU fits them in the same time either way.)"""
    m = pairs.Rinv.shape[-1]
    q = jnp.einsum("mkp,mp->mk", pairs.SY, yv, precision=HI)  # the kept pairs' s_i . yv and y_i . yv
    yy = jnp.sum(yv * yv, axis=1)

    def shifted(A, col):  # the newest pair's products in row and column 0, the rest moved down
        A = jnp.pad(A[:, :-1, :-1], ((0, 0), (1, 0), (1, 0)))
        return A.at[:, :, 0].set(col)

    lead = pairs.Rinv[:, : m - 1, : m - 1]
    inv_col = jnp.concatenate(
        [1.0 / sy[:, None], -jnp.einsum("mij,mj->mi", lead, q[:, : m - 1], precision=HI) / sy[:, None]],
        axis=1,
    )
    col_y = jnp.concatenate([yy[:, None], q[:, m : 2 * m - 1]], axis=1)
    SY = jnp.concatenate([s[:, None], pairs.SY[:, : m - 1], yv[:, None], pairs.SY[:, m : 2 * m - 1]], axis=1)
    new = Pairs(SY, shifted(pairs.Rinv, inv_col), shifted(pairs.YtY, col_y).at[:, 0, :].set(col_y))
    return Pairs(*(jnp.where(keep[:, None, None], a, b) for a, b in zip(new, pairs, strict=True)))


def newton_system(pb: Problem, Z) -> jax.Array:
    """The objective's Hessian, (M, p, p). The softmax is unchanged when the same vector is
    added to every class's weights and intercepts, a flat direction of the objective: the
    system adds 1 / c to every (feature, feature) block of classes, so its steps are free of
    that shift (the gradient has none: its sum over classes is zero) and the iterates stay
    symmetric, as scikit-learn's are, at any penalty (``symmetric``)."""
    _, d, c = ob.sizes(pb)
    H = ob.hessian(pb, Z) + jax.vmap(jnp.diag)(2 * pb.l2[:, None] * ob.penalised(pb))
    if c > 1:
        H = H + jnp.kron(jnp.eye(d + 1, dtype=H.dtype), jnp.full((c, c), 1.0 / c, H.dtype))
    return H


def symmetric(W, b) -> tuple:
    """Softmax parameters (W (d, M, c), b (M, c)) less their mean over the classes: the same
    probabilities, sums over classes of zero (scikit-learn's solution when the penalty does not
    fix them), and no larger a penalty."""
    return W - W.mean(axis=-1, keepdims=True), b - b.mean(axis=-1, keepdims=True)


def cholesky(A: jax.Array) -> jax.Array:
    """The lower Cholesky factor of symmetric positive definite A (M, p, p), written in XLA
    operations (p steps of a column each), not LAPACK's: XLA's CPU batched Cholesky can
    deadlock its worker threads with several models per simulated device. NaN where A is not
    positive definite."""
    p = A.shape[-1]
    idx = jnp.arange(p)

    def column(j, L):  # L's columns before j are done
        v = A[:, :, j] - jnp.einsum("mik,mk->mi", L, L[:, j, :], precision=HI)
        col = jnp.where(idx >= j, v / jnp.sqrt(v[:, j])[:, None], 0.0)
        return L.at[:, :, j].set(col)

    return jax.lax.fori_loop(0, p, column, jnp.zeros_like(A))


def cholesky_solve(A: jax.Array, r: jax.Array) -> jax.Array:
    """A^-1 r for symmetric positive definite A (M, p, p), r (M, p), by ``cholesky``."""
    return _factor_solve(cholesky(A), r)


def _factor_solve(L: jax.Array, r: jax.Array) -> jax.Array:
    """(L L')^-1 r by two triangular solves written in XLA operations (see ``cholesky``)."""
    p = r.shape[-1]

    def forward(i, z):  # L z = r
        return z.at[:, i].set((r[:, i] - jnp.sum(L[:, i, :] * z, axis=1)) / L[:, i, i])

    def backward(k, x):  # L' x = z
        i = p - 1 - k
        return x.at[:, i].set((z[:, i] - jnp.sum(L[:, :, i] * x, axis=1)) / L[:, i, i])

    z = jax.lax.fori_loop(0, p, forward, jnp.zeros_like(r))
    return jax.lax.fori_loop(0, p, backward, jnp.zeros_like(r))


def _lapack_solve(L: jax.Array, r: jax.Array) -> jax.Array:
    return jax.scipy.linalg.cho_solve((L, True), r[..., None])[..., 0]


def newton_factor(H: jax.Array, own_solve: bool = False) -> jax.Array:
    """The lower Cholesky factor (LAPACK's, or with ``own_solve`` ``cholesky``) of H (M, p, p)
    damped by 1e-6 of its largest diagonal entry (plus the float type's epsilon)."""
    p = H.shape[-1]
    eps = float(jnp.finfo(H.dtype).eps)
    damp = 1e-6 * jnp.max(jnp.diagonal(H, axis1=1, axis2=2), axis=1) + eps
    H = H + damp[:, None, None] * jnp.eye(p, dtype=H.dtype)
    return cholesky(H) if own_solve else jnp.linalg.cholesky(H)


def newton_solve(L: jax.Array, g: jax.Array, own_solve: bool = False) -> jax.Array:
    """-H^-1 g, (M, p), from H's factor (``newton_factor``); -g for a model whose factorisation
    failed."""
    solve = _factor_solve if own_solve else _lapack_solve
    step = -solve(L, g)
    ok = jnp.all(jnp.isfinite(step), axis=1, keepdims=True)
    return jnp.where(ok, step, -g)


def newton_direction(H: jax.Array, g: jax.Array, own_solve: bool = False) -> jax.Array:
    """-H^-1 g, (M, p), H damped as in ``newton_factor``; -g for a model whose factorisation
    fails."""
    return newton_solve(newton_factor(H, own_solve), g, own_solve)


# -- iterations and the loop ---------------------------------------------------------------


def gd_iteration(pb: Problem, lr, st: State) -> State:
    """One gradient-descent step of fixed length ``lr`` (its objective recorded before it)."""
    _, d, c = ob.sizes(pb)
    Z = ob.scores(pb, st.W, st.b)
    f, g = ob.value(pb, Z, st.W), ob.gradient(pb, Z, st.W)
    gmax = jnp.max(jnp.abs(g), axis=1)
    W, b = ob.unflat(ob.flat(st.W, st.b) - lr * g, d, c)
    hist = st.hist.at[:, st.it - st.base].set(f)
    return st._replace(it=st.it + 1, its=st.its + 1, W=W, b=b, f=f, g=g, gmax=gmax, hist=hist)


def _step_length(pb: Problem, st: State, step, dW, D, active, batched: bool) -> tuple:
    """The step length along ``step`` (scores moving as Z + t * D): Newton's method on the
    objective along the line, each evaluation one pass over the per-row arrays, never over X;
    Armijo backtracking then guards the result. Returns (t, the objective there, passed)."""
    eps = float(jnp.finfo(st.f.dtype).eps)
    l2 = pb.l2
    ww = jnp.sum(st.W * st.W, axis=(0, 2))
    pW, pp = jnp.sum(st.W * dW, axis=(0, 2)), jnp.sum(dW * dW, axis=(0, 2))

    def value_at(t):  # step lengths (..., M) -> the objective there
        return ob.data_term(pb, st.Z + t[..., None, None] * D) + l2 * (ww + t * (2 * pW + t * pp))

    def derivatives(t):
        d1, d2 = ob.line_derivatives(pb, st.Z + t[:, None, None] * D, D)
        return d1 + 2 * l2 * (pW + t * pp), d2 + 2 * l2 * pp

    t = newton_length(derivatives, jnp.ones_like(st.f))
    slope = jnp.sum(step * st.g, axis=1)
    slack = 16 * eps * jnp.abs(st.f)
    search = backtrack_at_once if batched else backtrack
    return search(value_at, t, st.f, slope, slack, active)


def direction(pb: Problem, spec: Spec, st: State) -> jax.Array:
    """The next step's direction from the state's point: Newton's or L-BFGS's, (M, p)."""
    if spec.solver == "newton":
        return newton_direction(newton_system(pb, st.Z), st.g, spec.own_solve)
    return lbfgs_direction(Pairs(st.SY, st.Rinv, st.YtY), st.g)


def stops(f, g, gmax, d, tol) -> jax.Array:
    """The stopping rule of Newton and L-BFGS, (M,) bool: every gradient component at most
    ``tol``, and the objective's estimated distance to its minimum, the decrement -g . d / 2
    of a (quasi-)Newton step d from this point, at most ``tol`` times the objective or at most
    the float type's epsilon. The decrement is the second-order estimate of f - min f:
    Newton's reads the Hessian of the point its last step began from (near the minimum, where
    the rule can hold, it changes by the step's length), so a fit of k iterations solves k
    Newton systems; L-BFGS's uses its inverse-Hessian estimate.

    The absolute floor, epsilon, is a distance that rounding hides in a unit objective (a mean
    log-loss starts at log k for k classes): without it a fit whose objective goes to zero
    (separable classes, no penalty) never stops, as its decrement stays about a fixed fraction
    of the objective. An objective above epsilon / tol (float32 at tol 1e-5: 0.012) keeps the
    relative promise."""
    gap = -0.5 * jnp.sum(g * d, axis=1)
    eps = float(jnp.finfo(f.dtype).eps)
    return (gmax <= tol) & (gap <= jnp.maximum(tol * jnp.abs(f), eps))


def newton_point(pb: Problem, st: State, active, W, b) -> tuple:
    """Newton's next point (W, b) for the active models, as a fit started from it (``init=``)
    begins: softmax weights made symmetric (``symmetric``), the scores recomputed from them and
    the objective there. Returns (W, b, Z, f).

    Newton keeps nothing from step to step but its point, so a warm start from the model a fit
    returns takes the step that fit would have taken next. Scores carried along the steps
    (Z + t * D, as L-BFGS's are) differ from recomputed ones by rounding, and the Newton system
    of a weak penalty amplifies that (two steps of iris at C=inf in float32 were 7e-4 apart:
    tests/test_logreg_solver.py). The product with X costs little beside the Hessian's."""
    if pb.c > 1:
        W, b = symmetric(W, b)
    Z = ob.scores(pb, W, b)
    f = ob.value(pb, Z, W)
    keep = ~active
    return (
        jnp.where(keep[None, :, None], st.W, W),
        jnp.where(keep[:, None], st.b, b),
        jnp.where(keep[:, None, None], st.Z, Z),
        jnp.where(keep, st.f, f),
    )


def search_iteration(pb: Problem, spec: Spec, tol, st: State) -> State:
    """One Newton or L-BFGS iteration: a step along the state's direction, its length by line
    search, the new gradient, (L-BFGS) the pair memory and the next direction, which decides
    whether the model stops (``stops``). Models that are done take no step."""
    _, d, c = ob.sizes(pb)
    eps = float(jnp.finfo(st.f.dtype).eps)
    active = ~st.done
    newton = spec.solver == "newton"
    if newton:  # this point's system; its factor also gives the next point's decrement
        factor = newton_factor(newton_system(pb, st.Z), spec.own_solve)
        here = newton_solve(factor, st.g, spec.own_solve)
    else:
        here = st.d
    step = jnp.where(active[:, None], here, 0.0)
    dW, db = ob.unflat(step, d, c)
    D = ob.scores(pb, dW, db)
    t, f_t, ok = _step_length(pb, st, step, dW, D, active, spec.batched_search)
    stalled = active & ~ok
    t = jnp.where(ok & active, t, 0.0)
    W = st.W + t[None, :, None] * dW
    b = st.b + t[:, None] * db
    if newton:
        W, b, Z, f = newton_point(pb, st, active, W, b)
    else:
        Z = st.Z + t[:, None, None] * D
        f = jnp.where(ok & active, f_t, st.f)
    g = ob.gradient(pb, Z, W)
    gmax = jnp.max(jnp.abs(g), axis=1)
    pairs = Pairs(st.SY, st.Rinv, st.YtY)
    if spec.solver == "lbfgs":
        s, yv = t[:, None] * step, g - st.g
        sy = jnp.sum(s * yv, axis=1)
        keep = active & (sy > eps * jnp.sqrt(jnp.sum(s * s, axis=1) * jnp.sum(yv * yv, axis=1)))
        pairs = remember(pairs, keep, s, yv, sy)
    hist = st.hist.at[:, st.it + 1 - st.base].set(jnp.where(active, f, jnp.nan))
    its = st.its + active.astype(st.its.dtype)
    new = State(
        st.it + 1,
        its,
        W,
        b,
        Z,
        f,
        g,
        gmax,
        st.d,
        st.done,
        st.stalled | stalled,
        st.conv,
        st.base,
        hist,
        *pairs,
    )
    if newton:  # the decrement at the new point, by the Hessian this step was taken with
        new = new._replace(d=newton_solve(factor, g, spec.own_solve))
    else:
        new = new._replace(d=direction(pb, spec, new))
    conv = st.conv | (active & ~stalled & stops(f, g, gmax, new.d, tol))
    return new._replace(conv=conv, done=st.done | stalled | conv)


def start_state(pb: Problem, spec: Spec, W0, b0, tol) -> State:
    """The state at the start W0, b0: its scores, objective, gradient and first direction. A
    model for which the stopping rule already holds, or whose gradient is not finite, is done
    (gd: every model stops when any gradient is not finite; otherwise it takes its fixed steps)."""
    M, d, c = ob.sizes(pb)
    n, dtype = pb.X.shape[-2], pb.l2.dtype
    # From zeros (the default start) the first scores are the intercepts: no pass over X.
    Z0 = jax.lax.cond(
        jnp.any(W0 != 0), lambda: ob.scores(pb, W0, b0), lambda: jnp.broadcast_to(b0[..., None], (M, c, n))
    )
    f0, g0 = ob.value(pb, Z0, W0), ob.gradient(pb, Z0, W0)
    gmax0 = jnp.max(jnp.abs(g0), axis=1)
    # The first gradient reads every value of X, each times a finite weight: a NaN or inf in
    # X makes it non-finite, and the fit stops at once (the host then names the bad value).
    finite0 = jnp.isfinite(gmax0)
    gd = spec.solver == "gd"
    hist0 = jnp.full((M, spec.span + 1), jnp.nan, dtype)
    hist0 = hist0 if gd else hist0.at[:, 0].set(f0)
    pairs = empty_pairs(M, (d + 1) * c, _MEMORY if spec.solver == "lbfgs" else 0, dtype)
    no = jnp.zeros((M,), bool)
    it, its = jnp.int32(0), jnp.zeros((M,), jnp.int32)
    st = State(it, its, W0, b0, Z0, f0, g0, gmax0, jnp.zeros_like(g0), no, no, no, it, hist0, *pairs)
    if gd:
        return st._replace(done=jnp.broadcast_to(~jnp.all(finite0), (M,)))
    if spec.solver == "newton":
        # Each iteration solves its own system first: here it is solved only when a gradient is
        # already small enough for the rule to hold (a start at the minimum).
        d0 = jax.lax.cond(jnp.any(gmax0 <= tol), lambda: direction(pb, spec, st), lambda: -g0)
    else:
        d0 = direction(pb, spec, st)
    st = st._replace(d=d0)
    conv = stops(f0, g0, gmax0, st.d, tol) & finite0
    return st._replace(conv=conv, done=conv | ~finite0)


def state_shapes(pb: Problem, spec: Spec) -> State:
    """Each field's shape (to unpack a resumed state)."""
    M, d, c = ob.sizes(pb)
    n, p = pb.X.shape[-2], (d + 1) * c
    m = _MEMORY if spec.solver == "lbfgs" else 0
    shapes = ((), (M,), (d, M, c), (M, c), (M, c, n), (M,), (M, p), (M,), (M, p), (M,), (M,), (M,), ())
    return State(*shapes, (M, spec.span + 1), (M, 2 * m, p), (M, m, m), (M, m, m))


def iterate(step: Callable[[State], State], start: State, stop) -> State:
    """The one loop every solver shares: ``step`` until ``stop`` iterations, or until every
    model is done."""
    return jax.lax.while_loop(lambda s: (s.it < stop) & ~jnp.all(s.done), step, start)


def _rounding_floor(pb: Problem, st: State) -> jax.Array:
    """The gradient a model can reach at most in float rounding, (M,): the terms it sums,
    bounded per column, times 64 epsilon times sqrt(rows)."""
    n, eps = pb.X.shape[-2], float(jnp.finfo(st.f.dtype).eps)
    R = jnp.abs(ob.residual(pb, st.Z)).sum(axis=(1, 2))
    col = jnp.max(jnp.abs(pb.X), axis=-2)  # per feature (and model, when stacked)
    col = jax.lax.pmax(col, AXIS) if pb.reduce else col
    terms = ob.total(pb, R) * jnp.maximum(jnp.max(col, axis=-1), 1.0)
    terms = terms + 2 * pb.l2 * jnp.max(jnp.abs(st.W), axis=(0, 2))
    return 64 * eps * math.sqrt(n) * terms


def results(pb: Problem, spec: Spec, tol, st: State) -> Fit:
    """The fit's model (softmax: ``symmetric``) and facts (``pack_facts``) from the loop's last
    state; the history holds this call's iterations only."""
    M = pb.l2.shape[0]
    # The carried loss and gradient are the returned model's (L-BFGS's scores are updated, not
    # recomputed: their rounding stays near float epsilon times the path length).
    f, gmax, conv = st.f, st.gmax, st.conv
    if spec.solver == "gd":  # the carry holds the step before the last update: evaluate the last
        Z = ob.scores(pb, st.W, st.b)
        f, gmax = ob.value(pb, Z, st.W), jnp.max(jnp.abs(ob.gradient(pb, Z, st.W)), axis=1)
        conv = gmax <= tol
    # each model's last objective, unless it stopped in an earlier call
    rows, at = jnp.arange(M), st.its - st.base
    hist = st.hist.at[rows, jnp.maximum(at, 0)].set(jnp.where(at >= 0, f, st.hist[rows, jnp.maximum(at, 0)]))
    if spec.solver != "gd":
        # A line search that can no longer lower the objective has met float rounding: accept
        # the gradient if it is within rounding of the terms it sums (bounded per column).
        zero = jnp.zeros((M,), f.dtype)
        limit = jax.lax.cond(jnp.any(st.stalled), lambda: _rounding_floor(pb, st), lambda: zero)
        conv = conv | (st.stalled & (gmax <= limit))
    W, b = st.W, st.b
    if spec.c > 1:  # Newton's points are symmetric already (``newton_point``), but for its start
        Ws, bs = symmetric(W, b)
        kept = st.its > 0 if spec.solver == "newton" else jnp.zeros_like(st.done)
        W, b = jnp.where(kept[None, :, None], W, Ws), jnp.where(kept[:, None], b, bs)
    more = ~st.done & (st.it < spec.max_iter)
    return Fit(W, b, pack_facts(hist, st.base, st.its, gmax, conv, more))


def solve(spec: Spec, args: Args, tol, lr, resume=None) -> Fit | tuple[Fit, jax.Array]:
    """Fits M models on local rows (``Args``); with ``spec.reduce`` the rows are one shard of
    the data. tol, lr: scalars.

    A chunked fit (``spec.chunked``) runs ``spec.every`` iterations at most and returns its
    results with its state packed (``pack_state``); ``resume`` is a state so returned, to go on
    from (the start is then not read). The host reports each context's step between calls: no
    host callback runs inside the program, so every call takes jit's fast path. Nothing a call
    holds grows with ``max_iter``: its history is its own iterations'.
    """
    pb = ob.problem(args.X, args.y, args.omega, args.l2, spec.c, spec.reduce, spec.fused, spec.stacked)
    M, d, c = ob.sizes(pb)
    dtype = args.l2.dtype
    if resume is not None:
        start = unpack_state(resume, state_shapes(pb, spec))
    else:
        zeros = args.W0 is None
        W0 = jnp.zeros((d, M, c), dtype) if zeros else args.W0
        b0 = jnp.zeros((M, c), dtype) if zeros else args.b0
        start = start_state(pb, spec, W0, b0, tol)
    stop = jnp.minimum(start.it + spec.every, spec.max_iter) if spec.chunked else spec.max_iter
    if spec.solver == "gd":
        step = functools.partial(gd_iteration, pb, lr)
    else:
        step = functools.partial(search_iteration, pb, spec, tol)
    st = iterate(step, start, stop)
    fit = results(pb, spec, tol, st)
    return (fit, pack_state(st, dtype)) if spec.chunked else fit
