"""What a live dashboard costs the work it watches, and how it holds up under a stream of events.

Usage::

    python benchmarks/bench_dashboard.py [--simulate 8] [--pairs 6] [--block 2]
                                         [--load-seconds 30] [--load-rate 1000] [--fit-seconds 5]

Part 1 (speed). A compute loop that records events the way user code does: each iteration
moves a 256 KiB array to the next context (``mg.transfer``), runs a data-parallel call over
every context (``mg.parallel``: split and run events), and a jitted 256 x 256 matmul step
whose result it waits for. It runs in blocks of ``--block`` seconds, alternately without any
view and with an ``mg.Dashboard`` attached (a widget, refreshed live by its background thread,
as in a notebook: values set, plots drawn to PNG), in ABBA order so drift in machine speed hits
both alike. It prints iterations per second (medians, quartiles), the ratio of the medians and
the median of the paired ratios (with / without; goal >= 0.95), and the events per second the
loop recorded. On a shared machine wall time swings with other people's work, so it also prints
the CPU seconds per iteration this process used, and those of the loop's own thread, with and
without (paired, without / with): the dashboard's own cost, which other processes' load
stretches less.

Part 2 (load). For ``--load-seconds`` a loop computes (the same matmul step) while recording
``--load-rate`` ledger events per second (a mix of transfer, step and run events) with a
Dashboard attached. It prints the UI updates per second (limit 10), plot redraws, the largest
buffer of events waiting for a refresh, errors logged, the refresh thread's CPU time, and
memory after each third of the run: Python's allocated blocks and the process's resident set
(tracemalloc is left off: it would slow the views it measures).

Part 3 (fast fit). An ``mg.Trainer`` on every context takes small steps as fast as it can
(a few hundred a second: a split, step events and collectives recorded per step) for
``--fit-seconds`` with a live dashboard watching it. It prints the ledger entries per second,
the memory panel's samples against its rate (goal >= 80 %) and the seconds of history it
holds, the pictures' redraws per second against their rates (with the rate the throughput
picture's own draw budget allows), the entries the panels left out, each panel's CPU time, and
the views' thread's CPU time as a share of a core (its budget: 2 %).

Timings are reported, never asserted; exit status 0.
"""

from __future__ import annotations

import argparse
import collections
import gc
import logging
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from _stats import median, quartiles

import mgkit as mg
from mgkit._ledger import Event
from mgkit.views._live import BUFFER

GOAL = 0.95


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="A compute loop with and without mg.Dashboard; a 1000 events/s load."
    )
    p.add_argument("--simulate", type=int, default=8, help="simulated CPU devices and contexts (default 8)")
    p.add_argument("--pairs", type=int, default=6, help="with/without pairs of blocks (default 6)")
    p.add_argument("--block", type=float, default=2.0, help="seconds per timed block (default 2)")
    p.add_argument(
        "--load-seconds", type=float, default=30.0, help="length of the load run (default 30; 0 skips)"
    )
    p.add_argument(
        "--load-rate", type=int, default=1000, help="events per second in the load run (default 1000)"
    )
    p.add_argument(
        "--fit-seconds", type=float, default=5.0, help="length of the fast fit (default 5; 0 skips)"
    )
    args = p.parse_args(argv)
    if args.fit_seconds < 0:
        p.error("--fit-seconds must be >= 0")
    if args.simulate < 1 or args.pairs < 1 or args.block <= 0 or args.load_seconds < 0 or args.load_rate < 1:
        p.error(
            "--simulate, --pairs and --load-rate must be at least 1, --block positive, --load-seconds >= 0"
        )
    return args


def _views_thread_cpu() -> float:
    """CPU seconds the views' refresh thread has used (0 when it is not running)."""
    for t in threading.enumerate():
        if t.name == "mgkit-views" and t.native_id is not None:
            try:
                with open(f"/proc/self/task/{t.native_id}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                return 0.0
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


# -- part 1: speed ------------------------------------------------------------------------------


def _workload(names: list[str]):
    """One iteration of the compute loop, and its state."""
    x = mg.put(np.ones((256, 256), np.float32), names[0])
    w = mg.put(np.full((256, 256), 1e-3, np.float32), names[0])
    f = mg.parallel(lambda a: jnp.tanh(a) * 2.0)
    batch = np.ones((len(names) * 64, 64), np.float32)
    step = jax.jit(lambda a, b: jnp.tanh(a @ b))
    state = {"x": x, "i": 0}

    def once() -> None:
        i = state["i"] = state["i"] + 1
        state["x"] = mg.transfer(state["x"], names[i % len(names)])
        f(batch).block_until_ready()
        step(w, w).block_until_ready()

    return once


def _block(once, seconds: float) -> tuple[float, int, float, float]:
    """Iterations per second over a block of ``seconds``, the events recorded meanwhile, the
    CPU seconds per iteration this process used (every thread: the loop, XLA's workers, the
    views' refresh thread), and those of the loop's own thread (its Python work, with the
    ledger's subscribers)."""
    led = mg.ledger()
    before = sum(r[3] for r in led.summary().rows())
    gc.collect()
    n, t0, cpu0, own0 = 0, time.perf_counter(), time.process_time(), time.thread_time()
    end = t0 + seconds
    while time.perf_counter() < end:
        once()
        n += 1
    elapsed = time.perf_counter() - t0
    cpu, own = (time.process_time() - cpu0) / n, (time.thread_time() - own0) / n
    led.flush()
    return n / elapsed, sum(r[3] for r in led.summary().rows()) - before, cpu, own


def speed(args: argparse.Namespace, names: list[str]) -> None:
    once = _workload(names)
    for _ in range(20):  # compile and warm up
        once()
    without: list[float] = []
    with_dash: list[float] = []
    cpu_without: list[float] = []
    cpu_with: list[float] = []
    own_without: list[float] = []
    own_with: list[float] = []
    events_per_s: list[float] = []
    updates: list[float] = []
    redraws: list[float] = []
    thread_cpu: list[float] = []

    def attached() -> float:
        dash = mg.Dashboard(widget=True)
        cpu0 = _views_thread_cpu()
        try:
            rate, events, cpu, own = _block(once, args.block)
            cpu_with.append(cpu)
            own_with.append(own)
            thread_cpu.append((_views_thread_cpu() - cpu0) / args.block)
        finally:
            dash.close()
        updates.append(dash.updates / args.block)
        redraws.append((dash.transfers.redraws + dash.throughput.redraws) / args.block)
        events_per_s.append(events / args.block)
        return rate

    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        for dash in order:
            if dash:
                with_dash.append(attached())
            else:
                rate, _, cpu, own = _block(once, args.block)
                without.append(rate)
                cpu_without.append(cpu)
                own_without.append(own)
            mg.ledger().clear()
    paired = [a / b for a, b in zip(with_dash, without, strict=True)]
    q_with, q_without, q_pair = quartiles(with_dash), quartiles(without), quartiles(paired)
    ratio = median(with_dash) / median(without)
    print(f"compute loop: {args.pairs} pairs of {args.block:g} s blocks, ABBA order")
    for name, xs, q in (("without a view", without, q_without), ("with mg.Dashboard", with_dash, q_with)):
        print(f"  {name:<18} {median(xs):8.1f} it/s  (quartiles {q[0]:.1f} .. {q[1]:.1f})")
    print(f"  events recorded    {median(events_per_s):8.0f} /s while the dashboard was attached")
    print(
        f"  dashboard          {median(updates):8.1f} updates/s, {median(redraws):.1f} picture redraws/s, "
        f"refresh thread {100 * median(thread_cpu):.1f} % of a core"
    )
    print(
        f"  with / without: ratio of medians {ratio:.3f}, median paired ratio {median(paired):.3f} "
        f"(quartiles {q_pair[0]:.3f} .. {q_pair[1]:.3f}); goal >= {GOAL} -> "
        f"{'met' if ratio >= GOAL else 'NOT met'}"
    )
    cpu_paired = [b / a for a, b in zip(cpu_with, cpu_without, strict=True)]
    q_cpu = quartiles(cpu_paired)
    print(
        f"  CPU per iteration (this process, every thread): {1e6 * median(cpu_without):.0f} us without, "
        f"{1e6 * median(cpu_with):.0f} us with; without / with: median paired {median(cpu_paired):.3f} "
        f"(quartiles {q_cpu[0]:.3f} .. {q_cpu[1]:.3f}): CPU time is not stretched by other processes' "
        "load the way wall time is"
    )
    own_paired = [b / a for a, b in zip(own_with, own_without, strict=True)]
    q_own = quartiles(own_paired)
    print(
        f"  CPU per iteration of the loop's own thread: {1e6 * median(own_without):.0f} us without, "
        f"{1e6 * median(own_with):.0f} us with; without / with: median paired {median(own_paired):.3f} "
        f"(quartiles {q_own[0]:.3f} .. {q_own[1]:.3f})"
    )


# -- part 2: load -------------------------------------------------------------------------------


def _events(names: list[str], i: int) -> Event:
    now = time.time()
    a, b = names[i % len(names)], names[(i + 1) % len(names)]
    kind = ("transfer", "step", "run")[i % 3]
    if kind == "transfer":
        return Event("transfer", a, b, "cpu0", "cpu1", 65536, now, 1e-4, None, {"arrays": 1})
    if kind == "step":
        info = {"what": "load", "iteration": i, "of": None, "models": 1, "loss": 1.0 / (i + 1)}
        info |= {"grad": 0.0, "samples_per_second": 1000.0 + i % 100, "final": False}
        return Event("step", a, a, "cpu0", "cpu0", 0, now, 1e-3, None, info)
    return Event(
        "run", a, a, "cpu0", "cpu0", 0, now, 2e-3, None, {"fn": "f", "of": 512, "path": "spmd", "rows": 64}
    )


def load(args: argparse.Namespace, names: list[str]) -> None:
    led = mg.ledger()
    led.clear()
    errors = _Errors()
    logging.getLogger("mgkit").addHandler(errors)
    w = jnp.ones((256, 256), jnp.float32)
    step = jax.jit(lambda a: jnp.tanh(a @ a))
    step(w).block_until_ready()
    rss0, rss_max, blocks0 = _rss_mib(), 0.0, sys.getallocatedblocks()
    dash = mg.Dashboard(widget=True)
    cpu0 = _views_thread_cpu()
    views = {"dashboard": dash, "transfers": dash.transfers, "throughput": dash.throughput}
    views["devices"] = dash.devices
    marks: list[tuple[float, int, float]] = []
    recorded = steps = pending_max = 0
    t0 = time.perf_counter()
    third = args.load_seconds / 3
    try:
        while (now := time.perf_counter() - t0) < args.load_seconds:
            step(w).block_until_ready()  # the cell's work
            steps += 1
            due = int(now * args.load_rate)
            while recorded < due:
                led.record(_events(names, recorded))
                recorded += 1
            pending_max = max(pending_max, dash.transfers.pending, dash.throughput.pending)
            if now >= third * (len(marks) + 1) and len(marks) < 2:
                rss = _rss_mib()
                marks.append((now, sys.getallocatedblocks(), rss))
                rss_max = max(rss_max, rss)
        marks.append((time.perf_counter() - t0, sys.getallocatedblocks(), _rss_mib()))
    finally:
        elapsed = time.perf_counter() - t0
        cpu = _views_thread_cpu() - cpu0
        dash.refresh()
        dash.close()
        logging.getLogger("mgkit").removeHandler(errors)
    rss_max = max(rss_max, _rss_mib())
    print(
        f"load: {recorded} events in {elapsed:.1f} s ({recorded / elapsed:.0f}/s) while computing "
        f"({steps / elapsed:.0f} matmul steps/s), Dashboard attached"
    )
    per_s = ", ".join(f"{k} {v.updates / elapsed:.1f}" for k, v in views.items())
    print(f"  UI updates per second: {per_s} (limit 10; the device map changes only with memory use)")
    print(
        f"  picture redraws per second: transfers {dash.transfers.redraws / elapsed:.2f}, "
        f"throughput {dash.throughput.redraws / elapsed:.2f}; "
        f"refresh thread {100 * cpu / elapsed:.1f} % of a core"
    )
    print(
        f"  largest buffer waiting for a refresh: {pending_max} events (bound {BUFFER}); "
        f"ledger keeps {len(led)} (capacity {led.capacity})"
    )
    print(f"  errors logged: {errors.count}; view errors: {sum(v.errors for v in views.values())}")
    shown = ", ".join(f"{t:.0f} s: {b - blocks0:+,} blocks, {r:.0f} MiB" for t, b, r in marks)
    print(f"  memory (Python allocated blocks since the start, resident set): {shown}")
    print(f"  resident memory: {rss0:.0f} MiB before, {rss_max:.0f} MiB at most")
    print(f"  transfers counted by the view: {dash.transfers.count} (recorded {(recorded + 2) // 3})")


# -- part 3: a fast fit ---------------------------------------------------------------------------


def fast_fit(args: argparse.Namespace) -> None:
    import optax

    from mgkit.views._live import BURST, DRAW_SHARE, REFRESHER, THREAD_SHARE

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)

    data = {"x": np.ones((4096, 16), np.float32), "y": np.ones((4096, 4), np.float32)}
    tr = mg.Trainer(loss, optax.sgd(1e-3), {"w": jnp.zeros((16, 4))})
    tr.fit(data, steps=5, batch_size=64, progress=False)  # compiled
    led = mg.ledger()
    led.clear()
    gc.collect()
    dash = mg.Dashboard(widget=True).watch(tr)
    memory, throughput, transfers = dash.memory, dash.throughput, dash.transfers
    entries = collections.deque(maxlen=10**7)
    detach = led.attach(entries)  # counts the ledger's entries (one per call)
    samples, busy, thread0 = memory.samples, REFRESHER.busy, _views_thread_cpu()
    redraws0 = {view: getattr(view, "redraws", 0) for view in dash.views}
    spent0 = {view: view.spent for view in dash.views}
    t0, cpu0, steps = time.perf_counter(), time.process_time(), 0
    try:
        while time.perf_counter() - t0 < args.fit_seconds:
            tr.fit(data, steps=100, batch_size=64, progress=False)
            steps += 100
        wall = time.perf_counter() - t0
        cores = (time.process_time() - cpu0) / wall
        samples, busy = memory.samples - samples, REFRESHER.busy - busy
        thread = _views_thread_cpu() - thread0
    finally:
        detach()
        dash.close()
    history = memory.history(memory.rows()[0].context)
    redraws = {view: getattr(view, "redraws", 0) - redraws0[view] for view in dash.views}
    drawn = throughput.drawing / throughput.redraws if throughput.redraws else 0.0
    allowed = 1.0 / max(1.0 / throughput.picture_rate, drawn / DRAW_SHARE)
    left_out = throughput.skipped + transfers.skipped
    print(
        f"fast fit: {steps} steps in {wall:.1f} s ({steps / wall:.0f}/s), {len(entries) / wall:.0f} ledger "
        f"entries/s, the process using {cores:.2f} cores, a live dashboard watching"
    )
    print(
        f"  memory panel: {samples} samples, {samples / (memory.rate * wall):.0%} of its rate's "
        f"({memory.rate:g}/s; goal >= 80 %); {history[-1].t - history[0].t:.1f} s of history"
    )
    print(
        f"  pictures: throughput {redraws[throughput] / wall:.2f} redraws/s (its rate "
        f"{throughput.picture_rate:g}/s; its draw budget allows {allowed:.2f}/s: {1e3 * drawn:.1f} ms a "
        f"redraw), transfers {redraws[transfers] / wall:.2f}/s, memory {redraws[memory] / wall:.2f}/s "
        f"(rate {memory.picture_rate:g}/s); {left_out} entries left out by the panels"
    )
    spent = ", ".join(
        f"{type(view).__name__} {1e3 * (view.spent - spent0[view]) / wall:.1f}" for view in dash.views
    )
    print(f"  each panel's refreshes, ms of CPU a second: {spent}")
    print(
        f"  views' thread: {100 * busy / wall:.2f} % of a core by its own count, {100 * thread / wall:.2f} % "
        f"from /proc (budget {100 * THREAD_SHARE:g} % of a core, {100 * (THREAD_SHARE + BURST / wall):.2f} % "
        "with what it had saved up)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mg.simulate(args.simulate)  # before any JAX operation
    names = [f"dev{i}" for i in range(args.simulate)]
    mg.use_contexts(";".join(f"{n}->cpu{i}" for i, n in enumerate(names)), verbose=False)
    print(
        f"jax {jax.__version__}, {len(jax.devices('cpu'))} simulated CPU devices (contexts {names[0]}.."
        f"{names[-1]}), default backend {jax.default_backend()}, python {sys.version.split()[0]}"
    )
    if args.fit_seconds > 0:
        fast_fit(args)
    speed(args, names)
    if args.load_seconds > 0:
        load(args, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
