"""mgkit's logistic regression against scikit-learn, measured in the same run, at equal objective.

Usage::

    python benchmarks/bench_logreg.py [--seconds 30] [--quick] [--repeats N] [--contexts MAP]
                                      [--devices 8] [--rows 100000] [--features 100] [--settle 0.2]
                                      [--sweep cancer|synthetic] [--tol 1e-5] [--bandwidth-gbps GBPS]

Contexts: without an accelerator, ``dev0..dev7 -> cpu0..cpu7`` on ``mg.simulate(--devices)``
CPU devices; with one (``jax.default_backend() != "cpu"``), ``dev0..devN`` on the GPUs, wrapping
round to 8 names when there are fewer than 8 GPUs so that (b) still has 8 contexts (several
then share a GPU). ``--contexts`` replaces either map. Both fit the same objective,
``mean(log-loss) + l2 * ||w||^2`` (intercept not penalised), scikit-learn with
``C = 1 / (2 * l2 * n_samples)``.

  (a) one big model   100,000 x 100 float32, standard normal features, labels from a random
                      linear model plus logistic noise, C=1: ``lr.fit`` vs scikit-learn's
                      default ``LogisticRegression(C=1)`` (lbfgs). mgkit on one context and on
                      every distinct device (data-parallel), each from host numpy (a1: the
                      host -> device copy included) and with X already placed (a2: ``mg.put`` on
                      dev0, or row-sharded over the devices with a NamedSharding that mgkit
                      takes as it is). Goal: scikit-learn time / mgkit time >= 3.
  (b) Theano recipe   8 independent 400 x 784 models (standard normal features, random 0/1
                      labels, l2=0.01) with ``lr.fit_per_device`` on 8 contexts, from host numpy
                      (b1) and with each X already on its context via ``mg.put`` (b2), vs a
                      scikit-learn loop fitting the 8 models one after another
                      (``LogisticRegression(C=1/(2*0.01*400), max_iter=1000)``). Goal >= 5.
  (c) l2 sweep        64 penalties ``np.logspace(-5, 1, 64)`` with ``lr.fit_many`` over the
                      distinct devices, vs a scikit-learn loop over the 64 C values
                      (``max_iter=1000``); on load_breast_cancer standardised (569 x 30, the
                      default) or ``--sweep synthetic`` (5000 x 50, like (a)). No goal.

"At equal objective": every model's objective (``lr.objective``, float64 on the host) is compared
with scikit-learn's on the same data; mgkit's may not exceed it by more than 1e-6 (relative).
mgkit starts at scikit-learn's default ``tol`` (1e-4, a bound on max |gradient| in both); where
its objective is higher, its ``tol`` is divided by sqrt(10) and the fit redone, until it is not
(or tol reaches 1e-9). The loosest tol that matches is used for the timings, and the report
says which. ``--tol 1e-5`` starts at mgkit's own default instead.

The first call of every variant is timed on its own (for mgkit: tracing and compilation, for a
variant that brings its own program); after them, the objective checks and one untimed round
(which sizes the run) are the warm-up. Then the variants of a case run interleaved, the order
reversed every other round (ABBA), so drift in machine speed hits all alike, with an untimed
pause of --settle seconds before every call: scikit-learn's OpenBLAS threads (and XLA's) keep
spinning for a while after their work is done, and back to back the next call competes with
them for the cores (measured: mgkit's fit in (a) took 1.5x longer on a 2-core CPU host and 2.3x
on an H100 host right after a scikit-learn fit; ``--settle 0`` shows that). Tables report
medians, the median of the per-round ratios with its quartiles, and a 10 % trimmed mean. The
ledger stays on (as users have it), flushed and cleared after every round outside the timed
calls; the bytes mgkit moved in each variant's first call are reported (a2 and b2 should move
no X). On an accelerator, (a2)'s rate of reading X (passes per iteration: L-BFGS about 2,
Newton about 3) is shown as a share of ``--bandwidth-gbps`` per device (default: measured, a
1 GiB float32 device-to-device copy, bytes read + written).
Without --repeats, each case runs as many rounds as fit in its share of --seconds. Timings are
reported, never asserted; exit status 0.

Note: ``--sweep synthetic`` on 8 simulated CPU devices can hang inside jaxlib's batched Cholesky
(every XLA CPU worker thread waits in it for work queued behind itself); the default sweep does
not reach that code path.
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np
from _stats import (
    TRIM,
    cpu_counts,
    duration,
    load_average,
    median,
    quartiles,
    stage_report,
    table,
    trimmed_mean,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mgkit as mg

lr = mg.logreg

# Share of the --seconds budget each case gets.
BUDGET = {"a": 0.55, "b": 0.2, "c": 0.25}
GOALS = {"a": 3.0, "b": 5.0, "c": None}  # on scikit-learn time / mgkit time (>=)
REL = 1e-6  # mgkit's objective may exceed scikit-learn's by this much (relative)
TOL_FLOOR = 1e-9  # tightening stops here
TIGHTEN = 10**0.5  # each tightening divides tol by this
SEED_N, SEED_D, SEED_L2, SEED_MODELS = 400, 784, 0.01, 8  # case (b), Theano's multiprocessing recipe
SWEEP = np.logspace(-5, 1, 64)  # case (c)
GIB = 2**30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time mg.logreg against scikit-learn's LogisticRegression, at equal objective."
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="time budget for the timed loops (default 30; 4 with --quick)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short smoke run (about 30 s): 2 timed rounds per case, 4 s budget",
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="timed rounds per case (default: what fits in --seconds)"
    )
    p.add_argument(
        "--contexts",
        metavar="MAP",
        default=None,
        help="context map, e.g. 'dev0->cuda0;dev1->cuda1' (default: dev0..dev7 on the simulated CPU "
        "devices, or on the GPUs where JAX has them)",
    )
    p.add_argument(
        "--devices", type=int, default=8, help="simulated CPU devices when JAX has no accelerator (default 8)"
    )
    p.add_argument("--rows", type=int, default=100_000, help="rows in (a) (default 100000)")
    p.add_argument("--features", type=int, default=100, help="features in (a) (default 100)")
    p.add_argument(
        "--sweep",
        choices=("cancer", "synthetic"),
        default="cancer",
        help="data of (c): load_breast_cancer standardised (default) or synthetic 5000 x 50",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=0.2,
        metavar="SECONDS",
        help="untimed pause before every timed call, so the worker threads still spinning after the "
        "last call (OpenBLAS, XLA) do not slow it (default 0.2; 0: back to back)",
    )
    p.add_argument(
        "--tol",
        type=float,
        default=1e-4,
        help="mgkit's starting tol (default 1e-4, scikit-learn's default; mgkit's own is 1e-5)",
    )
    p.add_argument(
        "--bandwidth-gbps",
        type=float,
        default=None,
        metavar="GBPS",
        help="device memory bandwidth in GB/s for (a2)'s share (default: measured, accelerators only)",
    )
    args = p.parse_args(argv)
    if args.seconds is None:
        args.seconds = 4.0 if args.quick else 30.0
    if args.seconds <= 0:
        p.error("--seconds must be positive")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.devices < 1:
        p.error("--devices must be at least 1")
    for name in ("rows", "features"):
        if getattr(args, name) < 2:
            p.error(f"--{name} must be at least 2")
    if args.settle < 0:
        p.error("--settle must be >= 0")
    if not 0 < args.tol < 1:
        p.error("--tol must be in (0, 1)")
    if args.bandwidth_gbps is not None and args.bandwidth_gbps <= 0:
        p.error("--bandwidth-gbps must be positive")
    return args


# -- timing -------------------------------------------------------------------------------------


@dataclass
class Variant:
    """One way of doing a case's work: ``call()`` issues it and returns its result."""

    label: str
    call: Callable[[], object]
    what: str = ""  # the call, spelled out
    times: list[float] = field(default_factory=list)  # seconds per call, one per round
    cold: float = float("nan")  # the first call
    moved: int = 0  # bytes mgkit's ledger recorded for the first call
    last: object = None


def _timed(call: Callable[[], object]) -> tuple[float, object]:
    """Seconds of one call of ``call()``, its result waited for; and the result."""
    t0 = time.perf_counter()
    out = call()
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out


SETTLE = [0.0]  # --settle, set by main


def _settle() -> None:
    """After a call, before the next is timed: BLAS and XLA worker threads spin for a while after
    their work is done, and a call timed during that competes with them for the cores."""
    if SETTLE[0]:
        time.sleep(SETTLE[0])


def _first_calls(variants: list[Variant]) -> None:
    """Times each variant's first call on its own, with the bytes the ledger saw it move."""
    led = mg.ledger()
    for v in variants:
        led.flush()
        led.clear()
        _settle()
        v.cold, v.last = _timed(v.call)
        led.flush()
        v.moved = sum(e.nbytes for e in led.records() if e.kind != "step")
        led.clear()


def _run_rounds(args: argparse.Namespace, key: str, variants: list[Variant]) -> int:
    """One warm-up round (which sizes the run), then rounds with the order reversed every other
    round (ABBA); the ledger is flushed and cleared after each round, outside the timed calls.
    Returns the rounds."""
    led = mg.ledger()
    one = 0.0
    for v in variants:
        _settle()
        seconds, v.last = _timed(v.call)
        one += seconds + SETTLE[0]
    led.flush()
    led.clear()
    if args.repeats is not None:
        rounds = args.repeats
    else:
        floor = 2 if args.quick else 6
        rounds = int(min(400, max(floor, args.seconds * BUDGET[key] / max(one, 1e-6))))
    rounds += rounds % 2  # whole ABBA pairs
    gc.collect()
    gc.disable()
    try:
        for i in range(rounds):
            for v in variants if i % 2 == 0 else variants[::-1]:
                _settle()
                seconds, v.last = _timed(v.call)
                v.times.append(seconds)
            led.flush()
            led.clear()
    finally:
        gc.enable()
    return rounds


# -- objective ----------------------------------------------------------------------------------


def _sk_model(est) -> lr.Model:
    """A scikit-learn binary LogisticRegression as an mgkit Model, for ``lr.objective``."""
    return lr.Model(est.coef_[0], est.intercept_[0], np.asarray(est.classes_), None)


@dataclass
class Match:
    """mgkit's objectives against scikit-learn's, per model, at the tol that made them equal."""

    mg: np.ndarray
    sk: np.ndarray
    tol: float
    tightened: int  # times tol was divided by sqrt(10)

    @property
    def gaps(self) -> np.ndarray:
        return (self.mg - self.sk) / np.abs(self.sk)

    @property
    def worst(self) -> float:
        return float(self.gaps.max())

    @property
    def ok(self) -> bool:
        return self.worst <= REL


def _match(tol: float, refit: Callable[[float], object], objectives: Callable[[object], np.ndarray], sk):
    """Refits with tol / sqrt(10) until no model's objective exceeds scikit-learn's by more than REL."""
    sk = np.asarray(sk, np.float64)
    start, tightened = tol, 0
    while True:
        got = np.asarray(objectives(refit(tol)), np.float64)
        if np.all((got - sk) / np.abs(sk) <= REL) or tol / TIGHTEN < TOL_FLOOR:
            return Match(got, sk, tol, tightened)
        tightened += 1
        tol = float(f"{start / TIGHTEN**tightened:.3g}")  # 1e-4, 3.16e-05, 1e-05, ...


# -- the cases ----------------------------------------------------------------------------------


@dataclass
class Row:
    """mgkit against scikit-learn for one case; the goal is on scikit-learn time / mgkit time."""

    case: str
    mg: Variant
    peer: Variant
    goal: float | None
    match: Match
    rounds: int
    work: float = float("nan")  # sample-iterations per call: rows x iterations, summed over models
    x_bytes: int = 0  # X's size, for the bytes-moved check
    passes: float = float("nan")  # reads of X per iteration (a2 bandwidth)
    iterations: float = float("nan")
    devices: int = 1

    @property
    def ratio(self) -> float:
        return median(self.peer.times) / median(self.mg.times)

    def met(self) -> bool | None:
        return None if self.goal is None else self.ratio >= self.goal


def synthetic(rng: np.random.Generator, n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Standard normal float32 features; labels of a random linear model plus logistic noise."""
    X = rng.standard_normal((n, d), dtype=np.float32)
    w = rng.standard_normal(d) / math.sqrt(d) * 2
    y = (X @ w + rng.logistic(size=n) > 0).astype(np.int64)
    return X, y


class Bench:
    def __init__(self, args: argparse.Namespace, names: tuple[str, ...]):
        self.args = args
        self.names = names
        devices = [mg.device_of(n) for n in names]
        first: dict = {}
        for name, dev in zip(names, devices, strict=True):
            first.setdefault(dev, name)
        self.distinct = list(first.values())  # one context per distinct device, in map order
        self.devices = list(first)
        # (a)'s data-parallel fit runs one SPMD program: devices of the first context's kind only.
        kind = self.devices[0].platform
        self.spmd = [
            (c, dev) for c, dev in zip(self.distinct, self.devices, strict=True) if dev.platform == kind
        ]
        self.rng = np.random.default_rng(0)
        self.notes: list[str] = []

    def one_model(self) -> list[Row]:
        """(a) One model on 100,000 x 100, C=1: lr.fit on 1 and on every device vs scikit-learn."""
        args = self.args
        one, every, k = [self.names[0]], [c for c, _ in self.spmd], len(self.spmd)
        if k < len(self.devices):
            self.notes.append(f"(a): contexts=all uses the {k} distinct device(s) of {one[0]}'s kind")
        n, d = args.rows - args.rows % k, args.features
        if n != args.rows:  # a row-sharded X needs equal shards
            self.notes.append(f"(a): {n} rows, --rows {args.rows} rounded down to a multiple of {k}")
        X, y = synthetic(self.rng, n, d)
        l2 = 1.0 / (2 * n)  # C = 1
        x_dev0 = mg.put(X, self.names[0])
        mesh = Mesh(np.array([dev for _, dev in self.spmd], dtype=object), ("rows",))
        x_rows = jax.device_put(X, NamedSharding(mesh, P("rows")))
        tols = {"1": args.tol, "k": args.tol}

        def fit(data, contexts, key):
            return lambda: lr.fit(data, y, C=1.0, tol=tols[key], contexts=contexts, progress=False)

        variants = [
            Variant("(a1) 1 ctx", fit(X, one, "1"), "lr.fit(X host numpy, contexts=1)"),
            Variant("(a2) 1 ctx", fit(x_dev0, one, "1"), f"lr.fit(mg.put(X, {one[0]!r}), contexts=1)"),
        ]
        if k > 1:
            variants += [
                Variant(f"(a1) {k} ctx", fit(X, every, "k"), f"lr.fit(X host numpy, contexts={k})"),
                Variant(
                    f"(a2) {k} ctx",
                    fit(x_rows, every, "k"),
                    f"lr.fit(X row-sharded on {k} devices, contexts={k})",
                ),
            ]
        else:
            self.notes.append("(a): one distinct device: contexts=all is contexts=1")
        sk = Variant("sklearn (a)", lambda: _sk_fit(X, y, 1.0, None), "LogisticRegression(C=1).fit(X, y)")
        _first_calls([*variants, sk])
        sk_obj = [lr.objective(_sk_model(sk.last), X, y, l2)]
        self.notes.append(
            f"(a): scikit-learn {sk.last.n_iter_[0]} iterations ({sk.last.solver}), "
            f"objective {sk_obj[0]:.12g}"
        )
        matches = {}
        for key, v in (("1", variants[0]), ("k", variants[-2] if k > 1 else None)):
            if v is None:
                continue

            def refit(tol, key=key, v=v):
                tols[key] = tol
                return v.call()

            matches[key] = _match(tols[key], refit, lambda m: [lr.objective(m, X, y, l2)], sk_obj)
        for v in variants:  # the placed-data variants give the same model
            key = "1" if v.label.endswith(" 1 ctx") else "k"
            got = lr.objective(_timed(v.call)[1], X, y, l2)
            if abs(got - matches[key].mg[0]) > 1e-9 * abs(got):
                self.notes.append(f"(a) {v.label}: objective {got:.12g} differs from the host-X fit's")
        rounds = _run_rounds(args, "a", [*variants, sk])
        rows = []
        for v in variants:
            key = "1" if v.label.endswith(" 1 ctx") else "k"
            its = int(v.last.info.iterations)
            row = Row(v.label, v, sk, GOALS["a"], matches[key], rounds)
            row.work, row.iterations, row.x_bytes = n * its, its, X.nbytes
            row.passes = {"newton": 3.0, "lbfgs": 2.0, "gd": 2.0}[v.last.info.solver]
            row.devices = 1 if key == "1" else k
            rows.append(row)
        self.notes.append(
            f"(a): mgkit solver {variants[0].last.info.solver}, "
            + ", ".join(f"{r.case} {int(r.iterations)} iterations" for r in rows)
        )
        return rows

    def theano_recipe(self) -> list[Row]:
        """(b) 8 models of 400 x 784, one per context, with fit_per_device vs a scikit-learn loop."""
        args = self.args
        ctxs = list(self.names[:SEED_MODELS])
        if len(ctxs) < SEED_MODELS:
            self.notes.append(f"(b): the map has {len(ctxs)} contexts: {len(ctxs)} models, not {SEED_MODELS}")
        data = {
            c: (
                self.rng.standard_normal((SEED_N, SEED_D), dtype=np.float32),
                self.rng.integers(0, 2, SEED_N).astype(np.int64),
            )
            for c in ctxs
        }
        placed = {c: (mg.put(Xc, c), yc) for c, (Xc, yc) in data.items()}
        C = 1.0 / (2 * SEED_L2 * SEED_N)
        tol = {"t": args.tol}

        def fit(source):
            return lambda: lr.fit_per_device(source, l2=SEED_L2, tol=tol["t"], progress=False)

        m = len(ctxs)
        host = Variant(f"(b1) {m} ctx", fit(data), f"lr.fit_per_device({{ctx: (X host numpy, y)}} x {m})")
        moved = Variant(
            f"(b2) {m} ctx", fit(placed), f"lr.fit_per_device({{ctx: (mg.put(X, ctx), y)}} x {m})"
        )
        sk = Variant(
            "sklearn (b)",
            lambda: [_sk_fit(*data[c], C, 1000) for c in ctxs],
            f"{m} x LogisticRegression(C={C:g}, max_iter=1000).fit(X, y), one after another",
        )
        _first_calls([host, moved, sk])
        sk_obj = [lr.objective(_sk_model(e), *data[c], SEED_L2) for c, e in zip(ctxs, sk.last, strict=True)]

        def objectives(models):
            return [lr.objective(models[c], *data[c], SEED_L2) for c in ctxs]

        def refit(t):
            tol["t"] = t
            return host.call()

        match = _match(tol["t"], refit, objectives, sk_obj)
        got = objectives(_timed(moved.call)[1])
        if np.max(np.abs(np.asarray(got) - match.mg) / np.abs(match.mg)) > 1e-9:
            self.notes.append("(b) b2: objectives differ from b1's")
        rounds = _run_rounds(args, "b", [host, moved, sk])
        rows = []
        for v in (host, moved):
            row = Row(v.label, v, sk, GOALS["b"], match, rounds)
            its = [int(m.info.iterations) for m in v.last.values()]
            row.work, row.iterations = SEED_N * sum(its), float(np.mean(its))
            row.x_bytes = sum(Xc.nbytes for Xc, _ in data.values())
            rows.append(row)
        solver = next(iter(host.last.values())).info.solver
        its = [int(m.info.iterations) for m in host.last.values()]
        self.notes.append(
            f"(b): mgkit solver {solver}, iterations per model {its}; "
            f"scikit-learn {[int(e.n_iter_[0]) for e in sk.last]}"
        )
        return rows

    def sweep(self) -> Row:
        """(c) 64 penalties with fit_many over the devices vs a scikit-learn loop."""
        args = self.args
        if args.sweep == "cancer":
            from sklearn.datasets import load_breast_cancer

            X, y = load_breast_cancer(return_X_y=True)
            X = ((X - X.mean(axis=0)) / X.std(axis=0)).astype(np.float32)
            what = "load_breast_cancer standardised"
        else:
            X, y = synthetic(self.rng, 5000, 50)
            what = "synthetic"
        n, d = X.shape
        tol = {"t": args.tol}
        contexts = self.distinct
        mgv = Variant(
            f"(c) {len(contexts)} ctx",
            lambda: lr.fit_many(X, y, l2=SWEEP, tol=tol["t"], contexts=contexts, progress=False),
            f"lr.fit_many(X host numpy ({n} x {d}), l2=<{len(SWEEP)} values>, contexts={len(contexts)})",
        )
        sk = Variant(
            "sklearn (c)",
            lambda: [_sk_fit(X, y, 1.0 / (2 * l2 * n), 1000) for l2 in SWEEP],
            f"{len(SWEEP)} x LogisticRegression(C=1/(2*l2*n), max_iter=1000).fit(X, y)",
        )
        _first_calls([mgv, sk])
        sk_obj = [lr.objective(_sk_model(e), X, y, l2) for e, l2 in zip(sk.last, SWEEP, strict=True)]

        def objectives(stacked):
            # lr.unstack drops `classes`; rebuild each model with the stack's classes.
            return [
                lr.objective(lr.Model(m.w, m.b, stacked.classes, m.info), X, y, l2)
                for m, l2 in zip(lr.unstack(stacked), SWEEP, strict=True)
            ]

        def refit(t):
            tol["t"] = t
            return mgv.call()

        match = _match(tol["t"], refit, objectives, sk_obj)
        rounds = _run_rounds(args, "c", [mgv, sk])
        row = Row(mgv.label, mgv, sk, GOALS["c"], match, rounds)
        its = np.asarray(mgv.last.info.iterations)
        row.work, row.iterations, row.x_bytes = float(n * its.sum()), float(its.mean()), X.nbytes
        self.notes.append(
            f"(c): {what}, {n} x {d}; mgkit solver {mgv.last.info.solver}, iterations per model "
            f"{int(its.min())}..{int(its.max())}; scikit-learn {min(int(e.n_iter_[0]) for e in sk.last)}.."
            f"{max(int(e.n_iter_[0]) for e in sk.last)}"
        )
        return row


def _sk_fit(X, y, C: float, max_iter: int | None):
    from sklearn.linear_model import LogisticRegression

    est = LogisticRegression(C=C) if max_iter is None else LogisticRegression(C=C, max_iter=max_iter)
    return est.fit(X, y)


# -- bandwidth ----------------------------------------------------------------------------------


def measure_bandwidth(device) -> tuple[float, str]:
    """GB/s of a 1 GiB float32 device-to-device copy (bytes read + written), best of two ways."""
    x = jax.device_put(np.zeros(GIB // 4, np.float32), device)
    add = jax.jit(lambda v: v + 0)
    ways = {"x.copy()": lambda: x.copy(), "jit(x + 0)": lambda: add(x)}
    best, how = 0.0, ""
    for label, call in ways.items():
        for _ in range(2):
            jax.block_until_ready(call())
        times = [_timed(call)[0] for _ in range(10)]
        gbps = 2 * GIB / median(times) / 1e9
        if gbps > best:
            best, how = gbps, label
    return best, how


# -- report -------------------------------------------------------------------------------------


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _final_rows(rows: list[Row]) -> list[list[str]]:
    out = []
    for r in rows:
        paired = [p / m for m, p in zip(r.mg.times, r.peer.times, strict=True) if m > 0]
        q1, q3 = quartiles(paired)
        trim = trimmed_mean(r.peer.times) / trimmed_mean(r.mg.times)
        met = r.met()
        out.append(
            [
                r.case,
                f"{median(r.mg.times):.4f}",
                f"{median(r.peer.times):.4f}",
                f"{r.ratio:.2f}",
                f"{median(paired):.2f} [{q1:.2f}-{q3:.2f}]",
                f"{trim:.2f}",
                "-" if r.goal is None else f">= {r.goal:g}",
                "-" if met is None else ("yes" if met else "NO"),
                f"{r.match.worst:+.2e}",
                f"{r.match.tol:g}",
                str(r.rounds),
            ]
        )
    return out


def _cold_row(v: Variant) -> list[str]:
    warm = median(v.times)
    share = max((v.cold - warm) / v.cold, 0.0) if v.cold > 0 else float("nan")
    return [
        f"{v.label}: {v.what}",
        duration(v.cold),
        duration(warm),
        f"{v.cold / warm:.1f}",
        f"{share:.0%}",
    ]


def _context_map(args: argparse.Namespace, accelerated: bool) -> mg.ContextMap:
    if args.contexts:
        return mg.use_contexts(args.contexts, verbose=False)
    if accelerated:
        gpus = [info.name for info in mg.devices() if info.platform != "cpu"]
        count = max(len(gpus), SEED_MODELS)
        spec = ";".join(f"dev{i}->{gpus[i % len(gpus)]}" for i in range(count))
    else:
        spec = ";".join(f"dev{i}->cpu{i}" for i in range(args.devices))
    return mg.use_contexts(spec, verbose=False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    SETTLE[0] = args.settle
    # Before any JAX operation. On a machine with GPUs this only sets how many CPU devices JAX
    # makes; the contexts below then name the GPUs and the CPU devices stay unused.
    mg.simulate(args.devices)
    backend = jax.default_backend()
    accelerated = backend != "cpu"
    cmap = _context_map(args, accelerated)
    names = tuple(cmap.names)
    import sklearn

    cpus, usable = cpu_counts()
    print(
        f"mgkit {mg.__version__}, jax {jax.__version__}, scikit-learn {sklearn.__version__}, "
        f"numpy {np.__version__}, python {platform.python_version()}, {platform.machine()}"
    )
    print(f"host: {cpus} CPU(s) ({usable} usable by this process); JAX backend {backend}")
    kinds = sorted({d.device_kind for d in jax.devices()})
    how = "" if accelerated else " simulated CPU"
    print(f"devices: {len(jax.devices())}{how} device(s) ({', '.join(kinds)})")
    print(f"contexts: {cmap}")
    print(
        f"budget {args.seconds:g} s of timed loops{' (quick)' if args.quick else ''}; ledger on; "
        f"{args.settle:g} s untimed pause before every call (--settle)"
    )
    print()
    load_before = load_average()
    mg.ledger().clear()
    bench = Bench(args, names)
    stages = {}
    t_start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lr.ConvergenceWarning)  # counted below from info.converged
        rows_a = bench.one_model()
        stages["a"] = time.perf_counter()
        rows_b = bench.theano_recipe()
        stages["b"] = time.perf_counter()
        row_c = bench.sweep()
        stages["c"] = time.perf_counter()
    elapsed = time.perf_counter() - t_start
    load_after = load_average()
    rows = [*rows_a, *rows_b, row_c]

    peers: list[Variant] = []
    for r in rows:
        if r.peer not in peers:
            peers.append(r.peer)
    print("variants (every call waited for):")
    for v in [r.mg for r in rows_a] + [rows_a[0].peer] + [r.mg for r in rows_b] + [rows_b[0].peer]:
        print(f"  {v.label:<12} {v.what}")
    print(f"  {row_c.mg.label:<12} {row_c.mg.what}")
    print(f"  {row_c.peer.label:<12} {row_c.peer.what}")
    print()

    print(
        "objectives (lr.objective: mean log-loss + l2 * ||w||^2, float64 on the host), mgkit vs scikit-learn:"
    )
    shown: list[Match] = []
    for r in rows:
        m = r.match
        if any(m is x for x in shown):
            continue
        shown.append(m)
        tol = f"tol {m.tol:g}" + (f", tightened {m.tightened}x from {args.tol:g}" if m.tightened else "")
        verdict = "ok" if m.ok else f"mgkit HIGHER by more than {REL:g}"
        if len(m.gaps) == 1:
            print(
                f"  {r.case}: mgkit {m.mg[0]:.12g}, scikit-learn {m.sk[0]:.12g}, "
                f"gap {m.worst:+.3e} ({verdict}; {tol})"
            )
            continue
        gaps = m.gaps
        case = r.case.split(")")[0] + ")"
        print(
            f"  {case}: {len(gaps)} models, gap min {gaps.min():+.3e} median {np.median(gaps):+.3e} "
            f"max {gaps.max():+.3e} ({verdict}); mgkit lower on {int((gaps < 0).sum())}, higher by more "
            f"than {REL:g} on {int((gaps > REL).sum())} ({tol})"
        )
        if len(gaps) <= SEED_MODELS:
            pairs = ", ".join(f"{x:.8f}/{y:.8f}" for x, y in zip(m.mg, m.sk, strict=True))
            print(f"      per model, mgkit/scikit-learn: {pairs}")
    print("  gap = (mgkit - scikit-learn) / scikit-learn; (a2) and (b2) fit the same models as (a1) and (b1)")
    print()

    print("mgkit throughput (rows x iterations per second, summed over models) and data moved:")
    tput = [
        [
            r.case,
            f"{r.iterations:g}",
            f"{r.work / median(r.mg.times) / 1e6:.2f}",
            _bytes(r.mg.moved),
            _bytes(r.x_bytes),
        ]
        for r in rows
    ]
    print(table(["case", "iterations", "M samples/s", "moved (1st call)", "X size"], tput))
    print(
        "  moved: bytes the ledger recorded for the first call (X, labels, row weights, parameters); "
        "(a2) and (b2) should not move X"
    )
    print()

    print(
        "first call (tracing and compiling, where the variant needs a program not yet built) vs warm calls:"
    )
    cold_rows = []
    for v in [r.mg for r in rows_a] + [rows_a[0].peer] + [r.mg for r in rows_b] + [rows_b[0].peer]:
        cold_rows.append(_cold_row(v))
    cold_rows += [_cold_row(row_c.mg), _cold_row(row_c.peer)]
    print(table(["variant", "first call", "warm median", "first/warm", "first-call share"], cold_rows))
    print(
        "  first-call share = (first - warm) / first: the part of a one-off call spent before the "
        "solver runs (the main figures are warm calls)"
    )
    print()

    if accelerated:
        device = bench.devices[0]
        if args.bandwidth_gbps is not None:
            bw, how = args.bandwidth_gbps, "given by --bandwidth-gbps"
        else:
            bw, how = measure_bandwidth(device)
            how = f"measured: 1 GiB float32 {how} on {names[0]}, bytes read + written"
        print(f"(a2) reading X per iteration vs memory bandwidth {bw:.0f} GB/s per device ({how}):")
        for r in rows_a:
            if not r.case.startswith("(a2"):
                continue
            per_it = median(r.mg.times) / max(r.iterations, 1)
            rate = r.x_bytes * r.passes * r.iterations / median(r.mg.times) / 1e9
            print(
                f"  {r.case}: {r.iterations:g} iterations, {duration(per_it)} per iteration, "
                f"{r.passes:g} passes over X ({_bytes(r.x_bytes)}) per iteration -> {rate:.1f} GB/s = "
                f"{rate / (bw * r.devices):.1%} of {bw * r.devices:.0f} GB/s ({r.devices} device(s))"
            )
        print()

    unconverged = []
    for r in rows:
        out = r.mg.last
        models = out.values() if isinstance(out, dict) else [out]
        bad = sum(int(np.sum(~np.asarray(m.info.converged))) for m in models)
        if bad:
            unconverged.append(f"{r.case}: {bad} model(s)")
    if unconverged:
        bench.notes.append("mgkit fits that did not reach tol: " + "; ".join(unconverged))
    print("notes:")
    for line in bench.notes:
        print(f"  {line}")
    if not accelerated:
        print(
            f"  The {len(bench.devices)} simulated CPU devices share this host's {usable} core(s), as does "
            "scikit-learn's BLAS: more contexts split the rows but add no compute."
        )
    print()
    print("mgkit vs scikit-learn at equal objective: median seconds per warm call (each waited for)")
    print("  ratio = scikit-learn / mgkit (> 1: mgkit faster); paired = median [quartiles] of the per-round")
    print(f"  ratios; trim = ratio of {TRIM:.0%} trimmed means; obj gap = worst (mgkit - scikit-learn) /")
    print(
        f"  scikit-learn objective over the models (must be <= {REL:g}); tol = mgkit's tol in the timed calls"
    )
    headers = [
        "case", "mgkit s", "sklearn s", "ratio", "paired [q1-q3]", "trim", "goal", "met", "obj gap",
        "tol", "rounds",
    ]  # fmt: skip
    print(table(headers, _final_rows(rows)))
    print()
    print(
        stage_report(
            stages, t_start, elapsed, "first calls and objective checks included", load_before, load_after
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
