"""What mgkit's bookkeeping costs: mg.put / mg.transfer against the bare JAX calls they wrap.

Usage::

    python benchmarks/bench_transfer.py [--contexts MAP] [--mib 32] [--repeats N] [--simulate 8]
                                        [--seconds 8]

For one float32 array of ``--mib`` MiB it times, in one run and with the ledger on:

  (a) host -> device    ``mg.put(h, "dev0")``        vs ``jax.device_put(h, device_of("dev0"))``
  (b) device -> device  ``mg.transfer(x, "dev1")``   vs ``jax.device_put(x, device_of("dev1"))``
  (c) device -> host    ``mg.transfer(x, "cpu")``    vs ``np.asarray(jax.device_get(x))``
  (d) host memcpy       ``np.copyto(dst, src)``, the yardstick for the bandwidth columns

each copy waited for with ``block_until_ready``, plus the per-call cost of ``mg.put`` on a tiny
array. After a warm-up the mgkit and JAX variants run interleaved, in ABBA order, so drift in
machine speed hits both alike; the table reports medians, the median of the paired ratios with
its quartiles, and a 10 % trimmed mean. Sources rotate through three arrays (96 MiB at the
default size, more than a typical last-level cache) and device -> host sources are made fresh
for every call, because JAX caches the host copy on the array. Whether each JAX call aliases
memory instead of copying (on CPU devices, device -> host is a zero-copy view) is checked and
printed. Without --repeats, each case runs as many pairs as fit in its share of --seconds.
The ledger is flushed after every pair, outside the timed region, and cleared between cases;
the events it recorded are checked against the mgkit calls made, and its recorded durations
against the ones the caller measured.

Default contexts: ``dev0->cuda0;dev1->cpu0`` where JAX sees an accelerator (its first one for
dev0), else ``dev0->cpu0;dev1->cpu1``. Timings are reported, never asserted; exit status 0.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from _stats import TRIM, duration, median, quartiles, table, trimmed_mean

import mgkit as mg

GOAL = 1.03
POOL = 3  # source arrays to rotate through, so one call does not warm the cache for the next
# Share of the --seconds budget each case gets.
BUDGET = {"a": 0.28, "b": 0.28, "c": 0.22, "d": 0.07, "tiny": 0.15}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time mg.put / mg.transfer against jax.device_put / device_get (ledger on)."
    )
    p.add_argument(
        "--contexts",
        metavar="MAP",
        default=None,
        help="context map, e.g. 'dev0->cuda0;dev1->cpu0' (default: dev0->first accelerator;dev1->cpu0, "
        "or dev0->cpu0;dev1->cpu1 without one)",
    )
    p.add_argument("--mib", type=float, default=32.0, help="array size in MiB (default 32)")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed pairs per case (default: as many as fit in --seconds)",
    )
    p.add_argument("--seconds", type=float, default=8.0, help="time budget for the timed loops (default 8)")
    p.add_argument("--simulate", type=int, default=8, help="CPU devices for mg.simulate (default 8)")
    args = p.parse_args(argv)
    if args.mib <= 0:
        p.error("--mib must be positive")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.seconds <= 0:
        p.error("--seconds must be positive")
    return args


@dataclass
class LedgerCheck:
    """What the ledger recorded for one case, next to what the benchmark did."""

    case: str
    calls: int  # mgkit calls made
    caller_seconds: float  # their total time as the caller saw it (each waited for)
    events: int  # events the ledger recorded
    ledger_seconds: float  # the durations it recorded, summed
    summary: object


@dataclass
class Result:
    case: str
    nbytes: int
    mg: list[float]  # seconds per call, mgkit variant
    jx: list[float]  # seconds per call, JAX (or numpy) variant
    note: str = ""

    @property
    def paired(self) -> list[float]:
        return [a / b for a, b in zip(self.mg, self.jx, strict=True) if b > 0]


# -- timing -------------------------------------------------------------------------------------


def _timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes, waiting for any JAX result; the result is dropped afterwards."""
    t0 = time.perf_counter()
    out = fn()
    if isinstance(out, jax.Array):
        out.block_until_ready()
    dt = time.perf_counter() - t0
    del out
    return dt


def _interleave(
    run_mg: Callable[[], float], run_jx: Callable[[], float], repeats: int, warmup: int = 3
) -> tuple[list[float], list[float]]:
    """Warms both up, then runs ``repeats`` pairs in ABBA order; flushes the ledger after each
    pair, outside the timed calls."""
    led = mg.ledger()
    for _ in range(warmup):
        run_mg()
        run_jx()
        led.flush()
    t_mg: list[float] = []
    t_jx: list[float] = []
    gc.collect()
    gc.disable()
    try:
        for i in range(repeats):
            if i % 2 == 0:
                t_mg.append(run_mg())
                t_jx.append(run_jx())
            else:
                t_jx.append(run_jx())
                t_mg.append(run_mg())
            led.flush()
    finally:
        gc.enable()
    return t_mg, t_jx


def _repeats_for(args: argparse.Namespace, key: str, run_mg: Callable, run_jx: Callable) -> int:
    """Pairs that fit in this case's share of the budget, from one timed pair (setup included)."""
    if args.repeats is not None:
        return args.repeats
    t0 = time.perf_counter()
    run_mg()
    run_jx()
    mg.ledger().flush()
    pair = time.perf_counter() - t0
    return int(min(2000, max(10, args.seconds * BUDGET[key] / max(pair, 1e-6))))


# -- aliasing -----------------------------------------------------------------------------------


def _buffer_pointer(x: jax.Array) -> int | None:
    try:
        return int(x.unsafe_buffer_pointer())
    except (AttributeError, NotImplementedError, RuntimeError, ValueError):
        return None


def _within(ptr: int | None, host: np.ndarray) -> bool | None:
    """Whether a device buffer pointer lies inside a host array's memory (None: no pointer)."""
    if ptr is None:
        return None
    lo = host.__array_interface__["data"][0]
    return lo <= ptr < lo + host.nbytes


def _yes_no(flag: bool | None) -> str:
    return "n/a" if flag is None else ("yes" if flag else "no")


# -- the cases ----------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, d0: jax.Device, d1: jax.Device):
        self.args = args
        self.d0, self.d1 = d0, d1
        n = max(1, int(args.mib * 2**20) // 4)
        rng = np.random.default_rng(0)
        # Distinct sources, every page touched.
        self.hosts = [rng.random(n, dtype=np.float32) for _ in range(POOL)]
        self.nbytes = self.hosts[0].nbytes
        self.mg_calls: dict[str, int] = {}
        self.mg_seconds: dict[str, float] = {}  # caller-side time of every mgkit call, warm-ups included
        self.ledgers: list[LedgerCheck] = []
        self.aliasing: list[str] = []

    def _next(self, pool: list) -> Callable[[], object]:
        it = itertools.cycle(pool)
        return lambda: next(it)

    def _note(self, case: str, seconds: float, calls: int = 1) -> float:
        """Counts mgkit calls and their caller-side time, to check against the ledger."""
        self.mg_calls[case] = self.mg_calls.get(case, 0) + calls
        self.mg_seconds[case] = self.mg_seconds.get(case, 0.0) + seconds
        return seconds

    def _close_case(self, case: str) -> None:
        """Compares the ledger with the mgkit calls of this case, keeps its summary, clears it."""
        summary = mg.ledger().summary()  # flushes first
        rows = summary.rows()
        self.ledgers.append(
            LedgerCheck(
                case,
                self.mg_calls.get(case, 0),
                self.mg_seconds.get(case, 0.0),
                sum(int(r[3]) for r in rows),
                sum(float(r[5]) for r in rows),
                summary,
            )
        )
        mg.ledger().clear()

    def host_to_device(self) -> Result:
        case = "(a) host->dev0"
        src = self._next(self.hosts)
        d0 = self.d0

        def run_mg() -> float:
            h = src()
            return self._note(case, _timed(lambda: mg.put(h, "dev0")))

        def run_jx() -> float:
            h = src()
            return _timed(lambda: jax.device_put(h, d0))

        # Does a put to this device alias the host array (zero-copy) instead of copying it?
        h = self.hosts[0]
        y_jx = jax.device_put(h, d0).block_until_ready()
        t0 = time.perf_counter()
        y_mg = mg.put(h, "dev0").block_until_ready()
        self._note(case, time.perf_counter() - t0)
        shares = d0.platform == "cpu" and np.shares_memory(np.asarray(y_jx), h)
        self.aliasing.append(
            f"(a) jax.device_put(host, dev0) aliases the host array: "
            f"{_yes_no(_within(_buffer_pointer(y_jx), h))} (np.shares_memory(np.asarray(y), host): "
            f"{shares}); mg.put: {_yes_no(_within(_buffer_pointer(y_mg), h))}"
        )
        del y_jx, y_mg
        reps = _repeats_for(self.args, "a", run_mg, run_jx)
        t_mg, t_jx = _interleave(run_mg, run_jx, reps)
        self._close_case(case)
        return Result(case, self.nbytes, t_mg, t_jx)

    def device_to_device(self) -> Result:
        case = "(b) dev0->dev1"
        d0, d1 = self.d0, self.d1
        sources = [jax.device_put(h, d0).block_until_ready() for h in self.hosts]
        src = self._next(sources)

        def run_mg() -> float:
            x = src()
            return self._note(case, _timed(lambda: mg.transfer(x, "dev1")))

        def run_jx() -> float:
            x = src()
            return _timed(lambda: jax.device_put(x, d1))

        x = sources[0]
        y = jax.device_put(x, d1).block_until_ready()
        ptr_x, ptr_y = _buffer_pointer(x), _buffer_pointer(y)
        same = None if ptr_x is None or ptr_y is None else ptr_x == ptr_y
        self.aliasing.append(f"(b) jax.device_put(x on dev0, dev1) reuses x's buffer: {_yes_no(same)}")
        del y
        reps = _repeats_for(self.args, "b", run_mg, run_jx)
        t_mg, t_jx = _interleave(run_mg, run_jx, reps)
        del sources
        self._close_case(case)
        return Result(case, self.nbytes, t_mg, t_jx)

    def device_to_host(self) -> Result:
        case = "(c) dev0->host"
        d0 = self.d0
        host = self._next(self.hosts)

        def fresh() -> jax.Array:
            # A new array every call: JAX caches the host copy on an array after the first get.
            return jax.device_put(host(), d0).block_until_ready()

        def run_mg() -> float:
            x = fresh()
            return self._note(case, _timed(lambda: mg.transfer(x, "cpu")))

        def run_jx() -> float:
            x = fresh()
            return _timed(lambda: np.asarray(jax.device_get(x)))

        x = fresh()
        got = np.asarray(jax.device_get(x))
        zero_copy = _within(_buffer_pointer(x), got)
        x2 = fresh()
        t0 = time.perf_counter()
        got2 = mg.transfer(x2, "cpu")
        self._note(case, time.perf_counter() - t0)
        self.aliasing.append(
            f"(c) np.asarray(jax.device_get(x)) is a view of x's device buffer (zero-copy): "
            f"{_yes_no(zero_copy)}; mg.transfer(x, 'cpu'): {_yes_no(_within(_buffer_pointer(x2), got2))}"
        )
        del x, x2, got, got2
        reps = _repeats_for(self.args, "c", run_mg, run_jx)
        t_mg, t_jx = _interleave(run_mg, run_jx, reps)
        self._close_case(case)
        note = "zero-copy: times are call overhead, not bandwidth" if zero_copy else ""
        return Result(case, self.nbytes, t_mg, t_jx, note)

    def memcpy(self) -> Result:
        src = self.hosts[0].copy()
        dst = np.empty_like(src)
        dst.fill(1.0)  # pre-touch every page

        def run() -> float:
            t0 = time.perf_counter()
            np.copyto(dst, src)
            return time.perf_counter() - t0

        for _ in range(3):
            run()
        reps = self.args.repeats or int(
            min(2000, max(10, self.args.seconds * BUDGET["d"] / max(run(), 1e-6)))
        )
        times = [run() for _ in range(reps)]
        return Result(
            "(d) numpy memcpy",
            self.nbytes,
            [],
            times,
            "np.copyto between two preallocated, touched arrays (cached if they fit)",
        )

    def tiny_overhead(self) -> list[str]:
        """Per-call cost of mg.put vs jax.device_put for a 4-float array, each waited for."""
        case = "tiny put"
        tiny = np.arange(4, dtype=np.float32)
        d0 = self.d0
        led = mg.ledger()
        per_block = 100

        def block(fn: Callable[[], jax.Array], counted: bool) -> tuple[float, float]:
            t0 = time.perf_counter()
            for _ in range(per_block):
                fn().block_until_ready()
            caller = time.perf_counter() - t0
            led.flush()
            total = time.perf_counter() - t0
            if counted:
                self._note(case, caller, per_block)
            return caller / per_block, total / per_block

        def mg_put() -> jax.Array:
            return mg.put(tiny, "dev0")

        def jx_put() -> jax.Array:
            return jax.device_put(tiny, d0)

        for _ in range(3):
            block(mg_put, True)
            block(jx_put, False)
        t0 = time.perf_counter()
        block(mg_put, True)
        block(jx_put, False)
        pair = time.perf_counter() - t0
        blocks = self.args.repeats or int(min(500, max(6, self.args.seconds * BUDGET["tiny"] / pair)))
        mg_caller, mg_total, jx_caller = [], [], []
        gc.collect()
        gc.disable()
        try:
            for i in range(blocks):
                order = [(mg_put, True), (jx_put, False)]
                for fn, counted in order if i % 2 == 0 else order[::-1]:
                    caller, total = block(fn, counted)
                    if counted:
                        mg_caller.append(caller)
                        mg_total.append(total)
                    else:
                        jx_caller.append(caller)
        finally:
            gc.enable()
        self._close_case(case)
        m, mt, j = median(mg_caller) * 1e6, median(mg_total) * 1e6, median(jx_caller) * 1e6
        q1, q3 = quartiles([a / b for a, b in zip(mg_caller, jx_caller, strict=True)])
        return [
            f"tiny put (4 x float32, + block_until_ready), median per call over {blocks} blocks of "
            f"{per_block} calls each:",
            f"  mg.put {m:.1f} us (caller), {mt:.1f} us including the ledger flush; "
            f"jax.device_put {j:.1f} us; mgkit overhead {m - j:+.1f} us per call "
            f"({mt - j:+.1f} us with flush); ratio {m / j:.2f} (paired quartiles {q1:.2f}-{q3:.2f})",
        ]


# -- report -------------------------------------------------------------------------------------


def _rows(results: list[Result], memcpy_gbps: float) -> list[list[str]]:
    rows = []
    for r in results:
        jx_med = median(r.jx)
        jx_gbps = r.nbytes / jx_med / 1e9
        if not r.mg:  # the memcpy yardstick
            rows.append(
                [r.case, "-", f"{jx_med * 1e3:.3f}", "-", "-", "-", "-", "-", f"{jx_gbps:.2f}", "-",
                 f"{jx_gbps / memcpy_gbps:.2f}", str(len(r.jx))]
            )  # fmt: skip
            continue
        mg_med = median(r.mg)
        mg_gbps = r.nbytes / mg_med / 1e9
        ratio = mg_med / jx_med
        q1, q3 = quartiles(r.paired)
        trim = trimmed_mean(r.mg) / trimmed_mean(r.jx)
        rows.append(
            [
                r.case,
                f"{mg_med * 1e3:.3f}",
                f"{jx_med * 1e3:.3f}",
                f"{ratio:.3f}",
                "yes" if ratio <= GOAL else "NO",
                f"{median(r.paired):.3f} [{q1:.2f}-{q3:.2f}]",
                f"{trim:.3f}",
                f"{mg_gbps:.2f}",
                f"{jx_gbps:.2f}",
                f"{mg_gbps / memcpy_gbps:.2f}",
                f"{jx_gbps / memcpy_gbps:.2f}",
                str(len(r.mg)),
            ]
        )
    return rows


def _context_map(spec: str | None) -> str:
    if spec:
        return spec
    accel = [row.name for row in mg.devices() if row.platform != "cpu"]
    return f"dev0->{accel[0]};dev1->cpu0" if accel else "dev0->cpu0;dev1->cpu1"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mg.simulate(args.simulate)  # before any JAX operation
    spec = _context_map(args.contexts)
    try:
        cmap = mg.use_contexts(spec, verbose=False)
    except (mg.ContextError, ValueError) as e:
        print(f"bench_transfer: {e}", file=sys.stderr)
        return 2
    if not {"dev0", "dev1"} <= set(cmap.names):
        print(f"bench_transfer: the context map {spec!r} must define dev0 and dev1", file=sys.stderr)
        return 2
    d0, d1 = mg.device_of("dev0"), mg.device_of("dev1")
    listed = mg.devices()
    names = {row.device: row for row in listed}

    print(
        f"mgkit {mg.__version__}, jax {jax.__version__}, numpy {np.__version__}, "
        f"python {platform.python_version()}, {platform.machine()}"
    )
    for ctx, dev in (("dev0", d0), ("dev1", d1)):
        row = names[dev]
        print(f"  {ctx} -> {row.name} ({row.kind}): {row.description}")
    mg.ledger().clear()
    bench = Bench(args, d0, d1)
    print(f"array: {bench.nbytes / 2**20:.1f} MiB float32; contexts {cmap}; ledger on")
    print()

    t_start = time.perf_counter()
    results = [bench.host_to_device(), bench.device_to_device(), bench.device_to_host(), bench.memcpy()]
    tiny = bench.tiny_overhead()
    elapsed = time.perf_counter() - t_start

    memcpy_gbps = bench.nbytes / median(results[-1].jx) / 1e9
    headers = [
        "case", "mgkit ms", "jax ms", "ratio", f"<={GOAL}", "paired ratio [q1-q3]", "trim ratio",
        "mgkit GB/s", "jax GB/s", "mgkit/memcpy", "jax/memcpy", "pairs",
    ]  # fmt: skip
    print(
        "medians per call; ratio = mgkit median / jax median; paired ratio = median of per-pair "
        f"ratios; trim ratio = {TRIM:.0%} trimmed means"
    )
    print(table(headers, _rows(results, memcpy_gbps)))
    for r in results:
        if r.note:
            print(f"  {r.case}: {r.note}")
    print()
    print("\n".join(tiny))
    print()
    print("aliasing:")
    for line in bench.aliasing:
        print(f"  {line}")
    print()
    print(
        "ledger, per case (cleared after each): events recorded vs mgkit calls made, and the mean "
        "duration it recorded vs the mean the caller measured (the caller's includes mgkit's overhead)"
    )
    for c in bench.ledgers:
        status = "ok" if c.calls == c.events else "MISMATCH"
        led = c.ledger_seconds / max(c.events, 1)
        caller = c.caller_seconds / max(c.calls, 1)
        print(
            f"  {c.case}: {c.events} event(s) for {c.calls} mgkit call(s): {status}; "
            f"ledger {duration(led)}/event, caller {duration(caller)}/call, "
            f"ledger/caller {led / caller if caller > 0 else float('nan'):.2f}"
        )
    print()
    for c in bench.ledgers:
        print(c.summary)
        print()
    print(f"timed section took {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
