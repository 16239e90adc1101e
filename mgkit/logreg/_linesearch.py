"""The step length along a direction, for M lines at once: Newton's method on the objective along
the line (``newton_length``), then Armijo backtracking with an explicit loop contract
(``search_init``, ``search_step``, ``search_cond``, as optax's line searches), or every halving
tried at once (``backtrack_at_once``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

_ARMIJO = 1e-4  # sufficient decrease: f(t) <= f(0) + _ARMIJO * t * slope
BACKTRACKS = 30  # halvings of the step length at most
_LINE_NEWTON = 2  # Newton steps on the step length per iteration


def newton_length(derivatives: Callable, t: jax.Array, rounds: int = _LINE_NEWTON) -> jax.Array:
    """Newton's method on the objective along the step: ``derivatives(t)`` gives its slope and
    curvature at step lengths t, (M,) each. Each round moves t by at most a factor 16 either
    way, and keeps it where the curvature is not positive or the new t not finite."""
    for _ in range(rounds):
        d1, d2 = derivatives(t)
        t_new = jnp.clip(t - d1 / jnp.where(d2 > 0, d2, 1.0), t / 16, t * 16)
        t = jnp.where((d2 > 0) & jnp.isfinite(t_new), t_new, t)
    return t


class Search(NamedTuple):
    """Backtracking's loop state, for M lines at once (``search_init``, ``search_step``,
    ``search_cond``: the loop contract of optax's line searches)."""

    # fixed along the search
    f0: Any  # (M,) the objective at t = 0
    slope: Any  # (M,) its slope along the step at t = 0 (negative for a descent step)
    slack: Any  # (M,) rounding allowance on the objective
    # changing
    k: Any  # () halvings so far
    t: Any  # (M,) step lengths
    f_t: Any  # (M,) the objective at t
    # stopping
    ok: Any  # (M,) bool: t passes (sufficient decrease), or the line is not searched


def sufficient(f_t, t, f0, slope, slack) -> jax.Array:
    """Armijo's condition (with a rounding allowance), and a finite objective."""
    return (f_t <= f0 + _ARMIJO * t * slope + slack) & jnp.isfinite(f_t)


def search_init(value_at: Callable, t, f0, slope, slack, active) -> Search:
    """Tries the first step lengths t; lines that are not ``active`` pass at once."""
    f_t = value_at(t)
    ok = sufficient(f_t, t, f0, slope, slack) | ~active
    return Search(f0, slope, slack, jnp.int32(0), t, f_t, ok)


def search_step(value_at: Callable, s: Search) -> Search:
    """Halves t on the lines that have not passed, and tries it."""
    t = jnp.where(s.ok, s.t, s.t / 2)
    f_new = value_at(t)
    ok_new = sufficient(f_new, t, s.f0, s.slope, s.slack)
    return s._replace(k=s.k + 1, t=t, f_t=jnp.where(s.ok, s.f_t, f_new), ok=s.ok | ok_new)


def search_cond(s: Search) -> jax.Array:
    """Whether a line still searches (at most ``BACKTRACKS`` halvings)."""
    return (s.k < BACKTRACKS) & ~jnp.all(s.ok)


def backtrack(value_at: Callable, t, f0, slope, slack, active) -> tuple:
    """Halves t until it passes: (t, the objective there, whether it passed)."""
    s = search_init(value_at, t, f0, slope, slack, active)
    s = jax.lax.while_loop(search_cond, functools.partial(search_step, value_at), s)
    return s.t, s.f_t, s.ok


def backtrack_at_once(value_at: Callable, t, f0, slope, slack, active) -> tuple:
    """``backtrack``'s answer with t, t / 2, ... t / 2**BACKTRACKS tried at once (no loop): the
    first that passes."""
    ts = t * 0.5 ** jnp.arange(BACKTRACKS + 1, dtype=t.dtype)[:, None]
    f_ts = value_at(ts)
    ok_ts = sufficient(f_ts, ts, f0, slope, slack)
    first = jnp.argmax(ok_ts, axis=0)[None]
    t, f_t = (jnp.take_along_axis(a, first, axis=0)[0] for a in (ts, f_ts))
    return t, f_t, jnp.any(ok_ts, axis=0) | ~active
