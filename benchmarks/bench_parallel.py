"""What mgkit's parallel ops cost: mg.make_parallel / mg.parallel / mg.run_each against the
hand-written JAX that does the same work, in one run, on simulated CPU devices.

Usage::

    python benchmarks/bench_parallel.py [--seconds 60] [--repeats N] [--devices 8] [--rows 65536]
                                        [--features 256] [--gemm 2048] [--dot 1024] [--profile 400]

Contexts ``d0..d7 -> cpu0..cpu7`` on ``mg.simulate(8)`` devices, ledger on (as users have it),
cleared between cases. Every timed call ends with ``jax.block_until_ready`` on its result.

  (a) large batch     ``mg.make_parallel(mlp, x=host)`` for ``mlp(x) = tanh(x @ W1) @ W2`` (W1, W2
                      replicated on the mesh, closed over) on a ``--rows`` x ``--features`` float32
                      host batch, vs ``jax.device_put(host, NamedSharding(mesh, P("x")))`` and a
                      ``jax.jit`` of the same ``mlp`` with in/out shardings over the same devices.
                      Goal: mgkit/jax <= 1.03.
  (b) tiny input      ``mg.make_parallel(add, a=a, b=b)`` on 8 x 4 float32 host arrays (dispatch
                      overhead) vs device_put + the jitted ``add``; the jit given the host arrays
                      directly is shown for reference. Goal: mgkit/jax <= 1.2.
  (c) sgemm           ``--gemm``-square float32 ``A @ B``, A split over the devices, B replicated,
                      both already placed: ``mg.make_parallel(lambda a: a @ B, a=A)`` (B closed
                      over) and ``mg.parallel(lambda b, a: a @ b, in_axes=(None, 0))(B, A)`` vs the
                      jitted sharded sgemm; GFLOP/s, and a single-device ``jnp.dot`` for reference.
                      Goal: mgkit/jax throughput >= 0.95.
  (d) context maps    two ``--dot``-square dot products on d0 and d1 in one ``mg.run_each`` call
                      over one dot product on d0 (inputs already on their devices), with the same
                      two dots dispatched by hand for reference. No goal: the figure only.

After a warm-up the variants of a case run interleaved, in ABBA order (ABC CBA for three), so
drift in machine speed hits all alike; tables report medians, the median of the paired ratios
with its quartiles, and a 10 % trimmed mean. The ledger is flushed after every round, outside
the timed calls; the events it recorded per mgkit call are reported. With ``--profile N`` (on by
default) case (b) runs N more calls under cProfile and mgkit's own functions are listed with
their cost per call. Without --repeats, each case runs as many rounds as fit in its share of
--seconds. Timings are reported, never asserted; exit status 0.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import itertools
import os
import platform
import pstats
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
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

POOL = 3  # host batches to rotate through in (a), so one call does not warm the cache for the next
# Share of the --seconds budget each case gets.
BUDGET = {"a": 0.30, "b": 0.20, "c": 0.35, "d": 0.15}
TINY_BLOCK = 25  # calls per timed block in (b): one call is ~1 ms, too short to time alone
AXIS = "x"  # the mesh axis of the hand-written programs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time mg.make_parallel / mg.parallel / mg.run_each against hand-written JAX (ledger on)."
    )
    p.add_argument("--seconds", type=float, default=60.0, help="time budget for the timed loops (default 60)")
    p.add_argument(
        "--repeats", type=int, default=None, help="timed rounds per case (default: what fits in --seconds)"
    )
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices and contexts (default 8)")
    p.add_argument("--rows", type=int, default=65536, help="batch rows in (a) (default 65536)")
    p.add_argument("--features", type=int, default=256, help="features per row in (a) (default 256)")
    p.add_argument("--gemm", type=int, default=2048, help="matrix size in (c) (default 2048)")
    p.add_argument("--dot", type=int, default=1024, help="matrix size in (d) (default 1024)")
    p.add_argument(
        "--profile",
        type=int,
        default=400,
        metavar="N",
        help="calls of (b) to run under cProfile for the per-function breakdown (default 400; 0: off)",
    )
    args = p.parse_args(argv)
    if args.seconds <= 0:
        p.error("--seconds must be positive")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.devices < 2:
        p.error("--devices must be at least 2")
    for name in ("rows", "features", "gemm", "dot"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be positive")
    if args.rows % args.devices or args.gemm % args.devices:
        p.error("--rows and --gemm must divide by --devices (the even split runs one SPMD program)")
    if args.profile < 0:
        p.error("--profile must be >= 0")
    return args


def _paired(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True) if y > 0]


# -- timing -------------------------------------------------------------------------------------


@dataclass
class Variant:
    """One way of doing a case's work: ``call()`` issues it and returns what to wait for."""

    label: str
    call: Callable[[], object]
    times: list[float] = field(default_factory=list)  # seconds per call, one entry per round


def _timed(call: Callable[[], object], per_block: int) -> float:
    """Seconds per call of ``call()``, each call waited for; results are dropped afterwards."""
    t0 = time.perf_counter()
    for _ in range(per_block):
        out = call()
        jax.block_until_ready(out)
        del out
    return (time.perf_counter() - t0) / per_block


class Counter:
    """mgkit calls made per case (warm-ups included), to compare with the ledger's events."""

    def __init__(self) -> None:
        self.calls = 0

    def wrap(self, call: Callable[[], object]) -> Callable[[], object]:
        def counted() -> object:
            self.calls += 1
            return call()

        return counted


def _run_case(
    args: argparse.Namespace, key: str, variants: list[Variant], per_block: int = 1, warmup: int = 3
) -> int:
    """Warms every variant up, then runs rounds with the order reversed every other round
    (ABBA); flushes the ledger after each round, outside the timed calls. Returns the rounds."""
    led = mg.ledger()
    for _ in range(warmup):
        for v in variants:
            _timed(v.call, per_block)
        led.flush()
    if args.repeats is not None:
        rounds = args.repeats
    else:
        t0 = time.perf_counter()
        for v in variants:
            _timed(v.call, per_block)
        led.flush()
        one = time.perf_counter() - t0
        rounds = int(min(2000, max(6, args.seconds * BUDGET[key] / max(one, 1e-6))))
    rounds += rounds % 2  # whole ABBA pairs
    gc.collect()
    gc.disable()
    try:
        for i in range(rounds):
            for v in variants if i % 2 == 0 else variants[::-1]:
                v.times.append(_timed(v.call, per_block))
            led.flush()
    finally:
        gc.enable()
    return rounds


# -- ledger -------------------------------------------------------------------------------------


@dataclass
class LedgerCheck:
    case: str
    calls: int
    events: int
    kinds: dict[str, int]


def _close_case(case: str, counter: Counter, checks: list[LedgerCheck]) -> None:
    """Keeps the ledger's event count for this case next to the mgkit calls made, then clears it."""
    rows = mg.ledger().summary().rows()  # flushes first
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r[0]] = kinds.get(r[0], 0) + int(r[3])
    checks.append(LedgerCheck(case, counter.calls, sum(kinds.values()), kinds))
    mg.ledger().clear()


# -- the cases ----------------------------------------------------------------------------------


@dataclass
class Row:
    """A compared pair: mgkit variant vs its peer, with the goal on the time ratio mgkit/peer
    (``<=``) or on the throughput ratio mgkit/peer (``>=``)."""

    case: str
    mg: Variant
    peer: Variant
    goal: tuple[str, float] | None
    rounds: int
    events_per_call: float = float("nan")
    flops: float = 0.0  # per call, for the GFLOP/s columns

    @property
    def time_ratio(self) -> float:
        return median(self.mg.times) / median(self.peer.times)

    @property
    def goal_ratio(self) -> float:
        """The ratio the goal is on: time (mgkit/peer) or throughput (peer time / mgkit time)."""
        return 1.0 / self.time_ratio if self.goal and self.goal[0] == ">=" else self.time_ratio

    def met(self) -> bool | None:
        if self.goal is None:
            return None
        op, bound = self.goal
        return self.goal_ratio <= bound if op == "<=" else self.goal_ratio >= bound


class Bench:
    def __init__(self, args: argparse.Namespace, names: list[str], devices: list):
        self.args = args
        self.names = names
        self.devices = devices
        self.mesh = Mesh(np.array(devices, dtype=object), (AXIS,))
        self.split = NamedSharding(self.mesh, P(AXIS))
        self.repl = NamedSharding(self.mesh, P())
        self.rng = np.random.default_rng(0)
        self.checks: list[LedgerCheck] = []
        self.notes: list[str] = []

    def _agree(self, case: str, got: object, want: object, rtol: float = 1e-4) -> None:
        g, w = np.asarray(got), np.asarray(want)
        ok = g.shape == w.shape and np.allclose(g, w, rtol=rtol, atol=rtol)
        self.notes.append(f"{case}: mgkit's result equals the hand-written one: {'yes' if ok else 'NO'}")

    def _sharded_note(self, case: str, out: jax.Array) -> None:
        devs = out.sharding.device_set if isinstance(out, jax.Array) else set()
        kept = len(devs) == len(self.devices) and not out.sharding.is_fully_replicated
        self.notes.append(
            f"{case}: mgkit's result stays sharded over the {len(self.devices)} devices (no gather): "
            f"{'yes' if kept else 'NO'} ({type(out.sharding).__name__} {getattr(out.sharding, 'spec', '?')})"
        )

    def large_batch(self) -> Row:
        """(a) A row-wise MLP over a host batch: make_parallel vs device_put + jit with shardings."""
        case = "(a) large batch"
        f = self.args.features
        w1 = jax.device_put(self.rng.standard_normal((f, f), dtype=np.float32) / np.sqrt(f), self.repl)
        w2 = jax.device_put(self.rng.standard_normal((f, f), dtype=np.float32) / np.sqrt(f), self.repl)

        def mlp(x):
            return jnp.tanh(x @ w1) @ w2

        hosts = [self.rng.standard_normal((self.args.rows, f), dtype=np.float32) for _ in range(POOL)]
        src = itertools.cycle(hosts)
        jitted = jax.jit(mlp, in_shardings=self.split, out_shardings=self.split)
        split = self.split
        counter = Counter()

        def run_mg() -> jax.Array:
            return mg.make_parallel(mlp, x=next(src))

        def run_jx() -> jax.Array:
            return jitted(jax.device_put(next(src), split))

        got = counter.wrap(lambda: mg.make_parallel(mlp, x=hosts[0]))()
        self._agree(case, got, jitted(jax.device_put(hosts[0], split)))
        self._sharded_note(case, got)
        del got
        mgv = Variant("mg.make_parallel(mlp, x=host)", counter.wrap(run_mg))
        jxv = Variant("device_put + jit(mlp, shardings)", run_jx)
        rounds = _run_case(self.args, "a", [mgv, jxv])
        _close_case(case, counter, self.checks)
        flops = 2.0 * 2 * self.args.rows * f * f
        row = Row(case, mgv, jxv, ("<=", 1.03), rounds, flops=flops)
        row.events_per_call = self.checks[-1].events / max(counter.calls, 1)
        return row

    def tiny(self) -> tuple[Row, Variant, float]:
        """(b) Dispatch overhead: an add on 8 x 4 host arrays."""
        case = "(b) tiny input"
        k = len(self.devices)
        a = np.arange(k * 4, dtype=np.float32).reshape(k, 4)
        b = np.ones((k, 4), dtype=np.float32)

        def add(a, b):
            return a + b

        jitted = jax.jit(add, in_shardings=(self.split, self.split), out_shardings=self.split)
        shardings = [self.split, self.split]
        counter = Counter()

        def run_mg() -> jax.Array:
            return mg.make_parallel(add, a=a, b=b)

        def run_jx() -> jax.Array:
            return jitted(*jax.device_put([a, b], shardings))

        def run_np() -> jax.Array:
            return jitted(a, b)

        got = counter.wrap(run_mg)()
        self._agree(case, got, run_jx())
        self._sharded_note(case, got)
        mgv = Variant("mg.make_parallel(add, a=, b=)", counter.wrap(run_mg))
        jxv = Variant("device_put + jit(add, shardings)", run_jx)
        npv = Variant("jit(add, shardings)(host arrays)", run_np)
        rounds = _run_case(self.args, "b", [mgv, jxv, npv], per_block=TINY_BLOCK)
        # What the ledger's watcher still has to do after the caller got its results.
        led = mg.ledger()
        flushes = []
        for _ in range(10):
            t0 = time.perf_counter()
            for _ in range(TINY_BLOCK):
                counter.wrap(run_mg)().block_until_ready()
            caller = time.perf_counter() - t0
            led.flush()
            flushes.append((time.perf_counter() - t0 - caller) / TINY_BLOCK)
        # A new function object on every call (an inline lambda) gets a new compiled program.
        fresh_mg, fresh_jx = [], []
        for _ in range(4):
            fresh_mg.append(_timed(counter.wrap(lambda: mg.make_parallel(lambda a, b: a + b, a=a, b=b)), 1))
            fresh_jx.append(
                _timed(
                    lambda: jax.jit(lambda a, b: a + b, in_shardings=shardings, out_shardings=self.split)(
                        *jax.device_put([a, b], shardings)
                    ),
                    1,
                )
            )
        self.notes.append(
            f"{case}: with an inline lambda (a new function each call) every call compiles: "
            f"mgkit {duration(median(fresh_mg))}, jax.jit {duration(median(fresh_jx))} per call, "
            f"vs {duration(median(mgv.times))} with the function defined once"
        )
        _close_case(case, counter, self.checks)
        row = Row(case, mgv, jxv, ("<=", 1.2), rounds)
        row.events_per_call = self.checks[-1].events / max(counter.calls, 1)
        return row, npv, median(flushes)

    def sgemm(self) -> tuple[list[Row], Variant]:
        """(c) A sharded sgemm, inputs already placed: GFLOP/s of mgkit and of jax."""
        case = "(c) sgemm"
        n = self.args.gemm
        a_host = self.rng.standard_normal((n, n), dtype=np.float32)
        b_host = self.rng.standard_normal((n, n), dtype=np.float32)
        a = jax.device_put(a_host, self.split).block_until_ready()
        b = jax.device_put(b_host, self.repl).block_until_ready()
        d0 = self.devices[0]
        a0 = jax.device_put(a_host, d0).block_until_ready()
        b0 = jax.device_put(b_host, d0).block_until_ready()

        def times_b(a):  # B closed over, as in make_parallel(lambda a: a @ B, a=A)
            return a @ b

        shared = mg.parallel(lambda b, a: a @ b, in_axes=(None, 0))
        jitted = jax.jit(lambda a, b: a @ b, in_shardings=(self.split, self.repl), out_shardings=self.split)
        single = jax.jit(jnp.dot)
        counter = Counter()
        want = jitted(a, b)
        self._agree(f"{case} make_parallel", counter.wrap(lambda: mg.make_parallel(times_b, a=a))(), want)
        got = counter.wrap(lambda: shared(b, a))()
        self._agree(f"{case} parallel", got, want)
        self._sharded_note(case, got)
        del got, want
        mg_closure = Variant(
            "mg.make_parallel(lambda a: a @ B, a=A)",
            counter.wrap(lambda: mg.make_parallel(times_b, a=a)),
        )
        mg_shared = Variant(
            "mg.parallel(lambda b, a: a @ b, in_axes=(None, 0))(B, A)",
            counter.wrap(lambda: shared(b, a)),
        )
        jxv = Variant("jit(a @ b, shardings)(A, B)", lambda: jitted(a, b))
        one = Variant(f"jnp.dot on one device ({mg.context_map().names[0]})", lambda: single(a0, b0))
        rounds = _run_case(self.args, "c", [mg_closure, mg_shared, jxv, one])
        _close_case(case, counter, self.checks)
        flops = 2.0 * n**3
        rows = []
        for v in (mg_closure, mg_shared):
            r = Row(f"{case} {v.label.split('(')[0]}", v, jxv, (">=", 0.95), rounds, flops=flops)
            r.events_per_call = self.checks[-1].events / max(counter.calls, 1)
            rows.append(r)
        return rows, one

    def context_maps(self) -> tuple[Variant, Variant, Variant, int]:
        """(d) Two dot products on two contexts in one run_each call, vs one dot on one device."""
        case = "(d) context maps"
        n = self.args.dot
        c0, c1 = self.names[0], self.names[1]
        d0, d1 = self.devices[0], self.devices[1]
        hosts = [self.rng.random((n, n), dtype=np.float32) for _ in range(4)]
        a0, b0 = (jax.device_put(h, d0).block_until_ready() for h in hosts[:2])
        a1, b1 = (jax.device_put(h, d1).block_until_ready() for h in hosts[2:])
        counter = Counter()

        def two_mg() -> dict:
            return mg.run_each({c0: (jnp.dot, (a0, b0)), c1: (jnp.dot, (a1, b1))})

        def two_raw() -> tuple:
            return jnp.dot(a0, b0), jnp.dot(a1, b1)

        def one_raw() -> jax.Array:
            return jnp.dot(a0, b0)

        got = counter.wrap(two_mg)()
        self._agree(case, got[c1], jnp.dot(a1, b1))
        self.notes.append(f"{case}: run_each results on {mg.where(got[c0])!r} and {mg.where(got[c1])!r}")
        del got
        two = Variant(f"mg.run_each: a dot on {c0} and one on {c1}", counter.wrap(two_mg))
        raw = Variant(f"jnp.dot on {c0} and jnp.dot on {c1}, then wait", two_raw)
        one = Variant(f"one jnp.dot on {c0}", one_raw)
        rounds = _run_case(self.args, "d", [two, raw, one])
        _close_case(case, counter, self.checks)
        self.seed_events = self.checks[-1].events / max(counter.calls, 1)
        return two, raw, one, rounds


# -- profile --------------------------------------------------------------------------------------


def _profiled(call: Callable[[], jax.Array], calls: int) -> tuple[pstats.Stats, float]:
    """cProfile of ``calls`` calls of ``call()``, each waited for; also the wall time per call."""
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(calls):
        call().block_until_ready()
    prof.disable()
    return pstats.Stats(prof), (time.perf_counter() - t0) / calls


def profile_tiny(calls: int, split: NamedSharding, k: int) -> list[str]:
    """Runs (b) ``calls`` times under cProfile, mgkit and the hand-written JAX, and lists mgkit's
    functions by their cost per call."""
    a = np.arange(k * 4, dtype=np.float32).reshape(k, 4)
    b = np.ones((k, 4), dtype=np.float32)

    def add(a, b):
        return a + b

    jitted = jax.jit(add, in_shardings=(split, split), out_shardings=split)

    def run_mg() -> jax.Array:
        return mg.make_parallel(add, a=a, b=b)

    def run_jx() -> jax.Array:
        return jitted(*jax.device_put([a, b], [split, split]))

    for _ in range(20):
        run_mg().block_until_ready()
        run_jx().block_until_ready()
    mg.ledger().clear()
    stats, wall = _profiled(run_mg, calls)
    mg.ledger().clear()
    _, wall_jx = _profiled(run_jx, calls)
    package = os.path.dirname(os.path.abspath(mg.__file__))
    mine = []
    self_total = program = 0.0
    for (path, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if os.path.abspath(path).startswith(package + os.sep):
            where = f"{os.path.basename(path)}:{line}({func})"
            if func in ("explained", "_explained"):
                # The compiled program is called from here; cProfile books that C++ call
                # as this function's own time.
                program += tt
                where += " [its self time: the jitted program call]"
            else:
                self_total += tt
            mine.append((ct, tt, nc, where))
    mine.sort(reverse=True)
    rows = [
        [where, f"{nc / calls:g}", f"{ct / calls * 1e6:.1f}", f"{tt / calls * 1e6:.1f}"]
        for ct, tt, nc, where in mine[:20]
    ]
    us = 1e6 / calls
    return [
        f"cProfile of (b), {calls} calls each + block_until_ready (main thread only; the profiler "
        "slows every Python call, so read shares, not absolute times):",
        f"  per call under the profiler: mgkit {wall * 1e6:.1f} us, device_put + jit {wall_jx * 1e6:.1f} us "
        f"(difference {(wall - wall_jx) * 1e6:+.1f} us)",
        f"  mgkit's own Python (self time of its functions, program call excluded): {self_total * us:.1f} us "
        f"per call; the jitted program call: {program * us:.1f} us per call",
        table(["mgkit function", "calls/call", "cumulative us/call", "self us/call"], rows),
    ]


# -- report -------------------------------------------------------------------------------------


def _goal_text(row: Row) -> str:
    if row.goal is None:
        return "-"
    return f"{row.goal[0]} {row.goal[1]:g}"


def _compare_rows(rows: list[Row]) -> list[list[str]]:
    out = []
    for r in rows:
        paired = _paired(r.mg.times, r.peer.times)
        throughput = r.goal is not None and r.goal[0] == ">="
        if throughput:  # the goal is on peer time / mgkit time: show the paired ratios that way too
            paired = [1.0 / p for p in paired]
        q1, q3 = quartiles(paired)
        trim = trimmed_mean(r.mg.times) / trimmed_mean(r.peer.times)
        met = r.met()
        out.append(
            [
                r.case,
                duration(median(r.mg.times)),
                duration(median(r.peer.times)),
                ("jax/mgkit " if throughput else "mgkit/jax ") + f"{r.goal_ratio:.3f}",
                f"{median(paired):.3f} [{q1:.3f}-{q3:.3f}]",
                f"{(1.0 / trim if throughput else trim):.3f}",
                _goal_text(r),
                "-" if met is None else ("yes" if met else "NO"),
                f"{r.events_per_call:.1f}",
                str(r.rounds),
            ]
        )
    return out


def _gflops(flops: float, seconds: list[float]) -> str:
    return f"{flops / median(seconds) / 1e9:.1f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mg.simulate(args.devices)  # before any JAX operation

    names = [f"d{i}" for i in range(args.devices)]
    spec = ";".join(f"{n}->cpu{i}" for i, n in enumerate(names))
    cmap = mg.use_contexts(spec, verbose=False)
    devices = [mg.device_of(n) for n in names]
    cpus, usable = cpu_counts()
    print(
        f"mgkit {mg.__version__}, jax {jax.__version__}, jaxlib {getattr(jax.lib, '__version__', '?')}, "
        f"numpy {np.__version__}, python {platform.python_version()}, {platform.machine()}"
    )
    model = mg.devices()[0].description.split(" (")[0]
    print(f"host: {cpus} CPU(s) ({usable} usable by this process), {model}")
    print(f"devices: {len(jax.devices())} simulated CPU devices ({', '.join(str(d) for d in jax.devices())})")
    print(f"contexts: {cmap}; ledger on, cleared between cases; budget {args.seconds:g} s of timed loops")
    print()
    load_before = load_average()
    mg.ledger().clear()
    bench = Bench(args, names, devices)

    stages = {}
    t_start = time.perf_counter()
    row_a = bench.large_batch()
    stages["a"] = time.perf_counter()
    row_b, ref_b, flush_b = bench.tiny()
    stages["b"] = time.perf_counter()
    rows_c, one_c = bench.sgemm()
    stages["c"] = time.perf_counter()
    two_d, raw_d, one_d, rounds_d = bench.context_maps()
    stages["d"] = time.perf_counter()
    elapsed = time.perf_counter() - t_start
    load_after = load_average()

    headers = [
        "case", "mgkit", "jax", "ratio (goal's way)", "paired [q1-q3]", "trim", "goal", "met",
        "events/call", "rounds",
    ]  # fmt: skip
    print(
        "mgkit vs hand-written JAX: median time per call (each waited for); ratio = mgkit/jax for time "
        "goals, jax/mgkit (throughput) for (c); paired = median of per-round ratios; "
        f"trim = ratio of {TRIM:.0%} trimmed means"
    )
    print(table(headers, _compare_rows([row_a, row_b, *rows_c])))
    print()
    mib = args.rows * args.features * 4 / 2**20
    print(f"(a) {args.rows} x {args.features} float32 host batch ({mib:.0f} MiB), mlp(x) = tanh(x @ W1) @ W2")
    print(f"    mgkit: {row_a.mg.label}; jax: {row_a.peer.label}")
    print(
        f"    compute: mgkit {_gflops(row_a.flops, row_a.mg.times)} GFLOP/s, "
        f"jax {_gflops(row_a.flops, row_a.peer.times)} GFLOP/s"
    )
    ref = median(ref_b.times)
    print(f"(b) {args.devices} x 4 float32 host arrays, {TINY_BLOCK} calls per timed block")
    print(f"    mgkit: {row_b.mg.label}; jax: {row_b.peer.label}")
    print(
        f"    mgkit overhead {(median(row_b.mg.times) - median(row_b.peer.times)) * 1e6:+.1f} us per call; "
        f"reference {ref_b.label}: {duration(ref)} (mgkit/that {median(row_b.mg.times) / ref:.3f})"
    )
    print(
        f"    the ledger's watcher needs {flush_b * 1e6:.1f} us per call more after the caller has its "
        "result (ledger flush, not in the times above)"
    )
    print()
    n = args.gemm
    flops = 2.0 * n**3
    jx_c = rows_c[0].peer
    print(f"(c) {n} x {n} float32 sgemm, A split over {args.devices} devices, B replicated, both placed")
    print(
        table(
            ["variant", "median", "GFLOP/s", "throughput / jax"],
            [
                [v.label, duration(median(v.times)), _gflops(flops, v.times),
                 f"{median(jx_c.times) / median(v.times):.3f}"]
                for v in (rows_c[0].mg, rows_c[1].mg, jx_c, one_c)
            ],
        )
    )  # fmt: skip
    print()
    m = args.dot
    one = median(one_d.times)
    print(
        f"(d) context maps (Theano): two {m} x {m} float32 dot products, inputs already on their devices "
        f"({rounds_d} rounds, {bench.seed_events:.1f} ledger events per run_each call)"
    )
    print(
        table(
            ["variant", "median", "time / one dot", "GFLOP/s"],
            [
                [v.label, duration(median(v.times)), f"{median(v.times) / one:.3f}",
                 _gflops(2.0 * m**3 * k, v.times)]
                for v, k in ((one_d, 1), (two_d, 2), (raw_d, 2))
            ],
        )
    )  # fmt: skip
    print(
        f"    run_each / the same two dots by hand: {median(two_d.times) / median(raw_d.times):.3f} "
        f"(paired {median(_paired(two_d.times, raw_d.times)):.3f})"
    )
    print(
        f"    Simulated CPU devices share the host's cores: this host has {usable} usable core(s) and one "
        "dot already uses them all,"
    )
    print(
        "    so two dots take about twice as long as one (~2x expected). On two real GPUs each dot has "
        "its own device and the ratio approaches 1x."
    )
    print()
    print("goals:")
    for r in (row_a, row_b, *rows_c):
        met = r.met()
        throughput = r.goal is not None and r.goal[0] == ">="
        way = "jax time / mgkit time (throughput)" if throughput else "mgkit time / jax time"
        print(f"  {r.case}: {way} = {r.goal_ratio:.3f}, goal {_goal_text(r)}: {'met' if met else 'NOT met'}")
    print(f"  (d) context maps: run_each of two dots / one dot = {median(two_d.times) / one:.3f} (no goal)")
    print()
    print("checks:")
    for line in bench.notes:
        print(f"  {line}")
    print()
    print("ledger, per case (cleared after each): events recorded for the mgkit calls made (warm-ups too)")
    for c in bench.checks:
        kinds = ", ".join(f"{k} {v}" for k, v in c.kinds.items())
        print(
            f"  {c.case}: {c.events} event(s) for {c.calls} mgkit call(s) = "
            f"{c.events / max(c.calls, 1):.1f} per call ({kinds})"
        )
    print()
    if args.profile:
        print("\n".join(profile_tiny(args.profile, bench.split, args.devices)))
        print()
    print(stage_report(stages, t_start, elapsed, "warm-ups and checks included", load_before, load_after))
    return 0


if __name__ == "__main__":
    sys.exit(main())
