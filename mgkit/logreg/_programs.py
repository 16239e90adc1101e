"""The compiled programs, their layouts over a mesh, and their settings (``Spec``)."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .. import _spmd
from .._spmd import AXIS, Batch, Targets
from ._checks import Options, float_dtype
from ._linesearch import BACKTRACKS
from ._results import Fit
from ._solver import Args, Spec, solve

MAX_ITER = {"newton": 100, "lbfgs": 1000, "gd": 10_000}
NEWTON_MAX_PARAMS = {"cpu": 64}  # parameters per model up to which "auto" picks Newton
NEWTON_MAX_PARAMS_ACCEL = 256


def _compiler_options(spec: Spec) -> dict[str, str] | None:
    """XLA's CPU backend splits every sum of more than 32 terms into a windowed partial sum
    and a second sum of the partials (pairwise-like rounding for long sums), each a step of
    its own. In a short fit's loop these steps are a good part of the time: 400 x 784 models
    fit 7% faster without the split. A sum of at most ``_SHORT_SUM`` terms keeps float32
    accuracy without it (the CPU sums 8 lanes at once): it is skipped where every sum is short."""
    return {"xla_disable_hlo_passes": "tree_reduction_rewriter"} if spec.short_sums else None


_SHORT_SUM = 16384  # terms (rows per device, or parameters per model) of a sum kept unsplit


def local_program(spec: Spec) -> Callable:
    """One device, M models: ``solve`` compiled, called with ``Args``, tol and lr (a resumed
    call: the state last)."""
    return _spmd.programs.get(
        ("logreg", spec),
        lambda: jax.jit(functools.partial(solve, spec), compiler_options=_compiler_options(spec)),
    )


def per_device_program(spec: Spec, stacked: bool) -> Callable:
    """One device, M models each on its own rows (``fit_per_device``'s contexts that share a
    device): X, or with ``stacked`` a tuple of M equal-shape X, then the models' labels,
    penalties and starts as (M, L) rows (``per_device_rows``), tol and lr (a resumed call:
    the state last). Every row weighs one."""

    def program(X, rows, tol, lr, *resume):
        n, d = X[0].shape if stacked else X.shape
        args = _unrows(rows, n, d, spec.c)
        X, y = (jnp.stack(X), args.y) if stacked else (X, args.y[:, 0])
        return solve(spec._replace(stacked=stacked), args._replace(X=X, y=y), tol, lr, *resume)

    return _spmd.programs.get(
        ("logreg", "per device", spec, stacked),
        lambda: jax.jit(program, compiler_options=_compiler_options(spec)),
    )


def _unrows(rows: jax.Array, n: int, d: int, c: int) -> Args:
    """``per_device_rows``' (M, L) rows (traced) -> Args without X: y (n, M) class indices,
    l2 (M,) and the start, W0 (d, M, c) and b0 (M, c): None (zeros) unless the rows carry one.
    Every row weighs one."""
    M = rows.shape[0]
    y, l2 = rows[:, :n].T.astype(jnp.int32), rows[:, n]
    if rows.shape[1] > n + 1:  # a start other than zeros
        W0 = rows[:, n + 1 : n + 1 + d * c].reshape(M, d, c).transpose(1, 0, 2)
        return Args(None, y, None, W0, rows[:, n + 1 + d * c :].reshape(M, c), l2)
    return Args(None, y, None, None, None, l2)


# Partition specs per layout, for the Args (or X and ``per_device_rows``) and the outputs.
ROWS, MODELS, REPL = P(AXIS), P(None, AXIS), P()
_LAYOUTS = {
    # one model, rows split, sums reduced: every output replicated
    "rows": (Args(ROWS, ROWS, ROWS, REPL, REPL, REPL), Fit(*(REPL,) * 3)),
    # one model per device on its own rows and its labels, penalty and start in one array
    # (``per_device_rows``); out: each model's w and b as one block, and its facts
    "devices": ((ROWS, ROWS), (ROWS, ROWS)),
    # every device holds all rows and fits its own slice of the models
    "models": (Args(REPL, REPL, REPL, MODELS, ROWS, ROWS), Fit(MODELS, ROWS, ROWS)),
}


def mapped_program(
    spec: Spec, devices: tuple, layout: str, omega_spec: Any = None, resume: bool = False
) -> Callable:
    """One SPMD program over the devices' mesh, for one of the three layouts. A chunked fit's
    program also returns each device's state as one row, (devices, L); ``resume``: the program
    that takes those rows last and goes on from them."""
    key = ("logreg", spec, devices, layout, omega_spec, resume)

    def build():
        in_specs, out_specs = _LAYOUTS[layout]
        if omega_spec is not None:
            in_specs = in_specs._replace(omega=omega_spec)
        in_specs = (in_specs,) if isinstance(in_specs, Args) else in_specs
        scalar = (REPL,) * 2  # tol, lr
        state = (ROWS,) if resume else ()
        if spec.chunked:
            out_specs = (out_specs, ROWS)

        def body(args, tol, lr, *resumed):  # omega, W0, b0 None: ones, zeros
            out = solve(spec, args, tol, lr, *(r[0] for r in resumed))
            fit, packed = out if spec.chunked else (out, None)
            if layout == "devices":
                # this device's model as one (d + 1, c) block, and its facts packed into one
                # row: the host takes both with one fetch each, not one per field
                fit = jnp.concatenate([fit.W[:, 0], fit.b]), fit.facts
            return (fit, packed[None]) if spec.chunked else fit

        def per_device(X, rows, tol, lr, *resumed):
            args = _unrows(rows[None], *X.shape, spec.c)
            return body(args._replace(X=X, y=args.y[:, 0]), tol, lr, *resumed)

        mesh = _spmd.mesh(devices)
        program = jax.shard_map(
            per_device if layout == "devices" else body,
            mesh=mesh,
            in_specs=(*in_specs, *scalar, *state),
            out_specs=out_specs,
            check_vma=False,
        )
        shardings = [
            jax.tree_util.tree_map(
                functools.partial(jax.sharding.NamedSharding, mesh), s, is_leaf=lambda x: isinstance(x, P)
            )
            for s in in_specs
        ]
        shardings += [_spmd.sharding(devices, AXIS, None) for _ in scalar]
        shardings += [jax.sharding.NamedSharding(mesh, s) for s in state]
        return jax.jit(program, in_shardings=tuple(shardings), compiler_options=_compiler_options(spec))

    return _spmd.programs.get(key, build)


ARG_NAMES = Args("X", "y", "sample_weight", "init w", "init b", "l2")  # how messages name them


def place_args(
    parts: Args, axes: Args, n: int, targets: Targets, sizes: tuple, own: tuple = (), names: Args = ARG_NAMES
) -> Args:
    """The given parts (None: not given) laid out for one SPMD program, in one placement:
    ``axes`` holds each part's split axis (None: shared), ``own`` the fields made for the call
    (never the caller's: no private copies), ``names`` how messages name each part."""
    given = [f for f, part in zip(Args._fields, parts, strict=True) if part is not None]
    labels = [getattr(names, f) for f in given]
    batch = Batch(
        [getattr(parts, f) for f in given],
        None,
        tuple(getattr(axes, f) for f in given),
        n,
        labels.__getitem__,
    )
    placed = _spmd.place_spmd(batch, targets, sizes, own=[i for i, f in enumerate(given) if f in own])
    return Args(*(None,) * len(Args._fields))._replace(**dict(zip(given, placed, strict=True)))


# -- checking inputs -----------------------------------------------------------------------


def make_spec(
    opts: Options,
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
        limit = NEWTON_MAX_PARAMS.get(platform, NEWTON_MAX_PARAMS_ACCEL)
        solver = "newton" if (d + 1) * c <= limit else "lbfgs"
    max_iter = opts.max_iter or MAX_ITER[solver]
    # held rows over rows per device: the devices the fit runs on
    devices = max(1, round(held / max(rows, 1)))
    every = iterations_per_call(solver, d, c, platform, rows * models, devices, reduce)
    # XLA's CPU backend reads an X that is streamed from memory faster with the fused forms
    # (100k x 100: 0.8 + 1.4 ms a pass against 1.0 + 2.0; the same rows on 8 simulated devices:
    # 22 ms a fit against 25), one that stays in cache with plain products (400 x 784: 31 + 27
    # us against 49 + 48). Simulated CPU devices share the host's cache, so all of X counts.
    fused = platform == "cpu" and held * d * np.dtype(float_dtype()).itemsize >= _STREAMED
    short = platform == "cpu" and max(rows, (d + 1) * c) <= _SHORT_SUM
    # An accelerator runs a loop inside the program from the host, which reads the loop's
    # condition back at every pass (a sync of tens of microseconds). Backtracking along the
    # step is such a loop, entered at every iteration. Where the trials are few values, the
    # accelerator tries every step length at once instead, with no loop (eight 400 x 784 models
    # on an H100: 2.0 ms, not 2.3); on a CPU, or for many rows, each trial's work counts (100k
    # x 100 on a CPU: 150 ms a fit, not 83).
    batched = platform != "cpu" and rows * models * c * (BACKTRACKS + 1) <= _BATCHED_TRIALS
    # XLA's CPU batched Cholesky can deadlock its worker threads with several models per
    # simulated device: their Newton systems are solved by XLA operations instead, so "auto"
    # picks the same solver for a problem whatever the layout.
    own = solver == "newton" and platform == "cpu" and models > 1
    return Spec(
        solver, c, max_iter, every, reduce, fused, short_sums=short, batched_search=batched, own_solve=own
    )


_BATCHED_TRIALS = 1 << 22  # per-row values (rows x models x classes x lengths) for all step lengths at once
_STREAMED = 16 << 20  # bytes of X from which a CPU streams it from memory (more than its cache)


# Work (row x parameter products) a device gets through in a call, about a tenth of a second:
# about 2.5e9 a second on one core of a CPU (100k x 100 and 400 x 784 fits both measured
# 2-3.5e9), ten times that on an accelerator.
_CALL_SECONDS = 0.1
_REPORT_WORK = {"cpu": 2.5e8}
_REPORT_WORK_ACCEL = 2.5e9
# Seconds an iteration costs whatever its work: a pass of the loop inside the program (an
# accelerator's host reads its condition) and, for a data-parallel fit, its sums over the
# devices (a gradient-descent step one sum, the others about two), per device taking part.
# Simulated CPU devices meet in each sum by turns on the host's cores: 8 devices on 2 cores
# measured 0.9-1.0 ms a gradient-descent iteration of a few hundred rows, 1.6-3.4 ms one of
# L-BFGS or Newton, where the estimate of work alone gave a 10,000-step fit one 6 s call.
_LOOP_SECONDS = {"cpu": 15e-6}
_LOOP_SECONDS_ACCEL = 20e-6
_SUM_SECONDS = {"cpu": 120e-6}
_SUM_SECONDS_ACCEL = 20e-6


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        return os.cpu_count() or 1


def iterations_per_call(
    solver: str, d: int, c: int, platform: str, load: int, devices: int = 1, reduce: bool = False
) -> int:
    """Iterations per call of a fit's program: about a tenth of a second. Between calls the
    host records each context's step and the bar moves, and a Ctrl-C waits for no more than
    the call in flight; each call costs a dispatch and a fetch (under a millisecond on a CPU,
    about 1.2 ms on an H100), so a fit shorter than one call is one call and reports only its
    last step. The count rounds up: a call's iterations reach the budget, not stop short of it
    (rounding down, an iteration estimated at 0.85 of the budget made a call of one: eight
    400 x 784 Newton fits on one H100 took four calls, not two, 19.6 ms, not 17.3).

    ``load``: rows x models per device; ``devices``: how many run the fit (CPU devices share
    the host's cores); ``reduce``: its sums run over the devices every iteration."""
    p = (d + 1) * c
    work = max(load, 1) * p
    if solver == "newton":  # a p x p Hessian, and its Cholesky factor
        work = work * p + p**3 / 3
    budget = _REPORT_WORK.get(platform, _REPORT_WORK_ACCEL)
    seconds = _LOOP_SECONDS.get(platform, _LOOP_SECONDS_ACCEL) * (1 if solver == "gd" else 3)
    if platform == "cpu":
        share = min(1.0, _cores() / max(devices, 1))  # simulated devices share the cores
        work, seconds = work / share, seconds / share
    if reduce and devices > 1:  # measured with the devices sharing the cores
        seconds += _SUM_SECONDS.get(platform, _SUM_SECONDS_ACCEL) * devices * (1 if solver == "gd" else 2)
    per_iteration = work + seconds * budget / _CALL_SECONDS  # in units of work
    return min(_MOST_PER_CALL, max(1, math.ceil(budget / per_iteration)))


# Iterations per call at most, whatever their work: a call's history holds one value per
# iteration (and an iteration of the smallest fit still takes microseconds).
_MOST_PER_CALL = 10_000


def per_device_rows(parts, penalties, starts, dtype) -> np.ndarray:
    """Every model's class indices, penalty and (unless all are zeros) start as one array, the
    models' parts in turn (an SPMD program's model i: device i's part), in the fit's float type
    (class indices are exact in it: below 2**24). One placement of a few kilobytes costs what
    one of a few bytes does (0.13 ms to 8 CPU devices), and this makes one instead of three."""
    given = any(w.any() or b.any() for w, b in starts)
    pieces = []
    for (_, y_idx, _), l2v, (w, b) in zip(parts, penalties, starts, strict=True):
        pieces += [y_idx, [l2v], *((w.ravel(), b.ravel()) if given else ())]
    return np.concatenate(pieces, dtype=dtype, casting="unsafe")


def scalar_args(opts: Options, dtype, devices: tuple = ()) -> tuple:
    """tol and learning rate, the program's scalar arguments. For an SPMD program (``devices``)
    they are kept on the devices between fits: copying scalars to eight devices costs more than
    a short fit's host work."""
    if not devices:
        return np.asarray(opts.tol, dtype), np.asarray(opts.learning_rate, dtype)
    name = np.dtype(dtype).name
    return tuple(_replicated(float(v), name, devices) for v in (opts.tol, opts.learning_rate))


@_spmd.cached(64)
def _replicated(value: float, dtype: str, devices: tuple) -> jax.Array:
    return jax.device_put(np.asarray(value, dtype), _spmd.sharding(devices, AXIS, None))


# -- fit: one model, data-parallel ---------------------------------------------------------
