"""What seeing inside the compiled step costs: the trainer's step with the collectives XLA put in
its program recorded in the ledger, against the same step without that recording, in one run.

Usage::

    python benchmarks/bench_seeing.py [--steps 100] [--rounds 12] [--devices 8] [--quick]

Contexts ``d0..d7 -> cpu0..cpu7`` on ``mg.simulate(8)`` CPU devices without an accelerator; on a
machine with GPUs, ``d0..dN`` on them. The model is bench_train.py's MLP 784-256-10 with
``optax.adamw(1e-3)``, batch 256 (dispatch-bound: where a per-step cost shows most).

  (a) collectives recorded  Trainer time per step with each step's collectives recorded (the
                            default) / the same trainer's with the recording off
                            (``mgkit._spmd.record_collectives(False)``), its fits alternating.
                            Goal <= 1.02.

  (b) memory panel          Trainer throughput (steps per second) with an ``mg.Dashboard``
                            (memory panel attached: ``dash.watch(tr)``, widgets refreshed
                            live by the views' thread) / without any view. Goal >= 0.95.
                            Also printed: the samples the memory panel took meanwhile and the
                            views' thread's share of a core.
  (c) profile capture       Seconds ``with mg.profile(show=False)`` around 10 trainer steps
                            adds beyond the same 10 steps unprofiled: starting and stopping the
                            trace, writing it, reading it back into the timeline per context and
                            drawing its SVG. The first profile of the process (the profiler
                            starts) and the median of the later ones. Goal < 2 s.

Also printed: how long reading the compiled step took (once per program; goal under 50 ms),
and what the step communicates (``Trainer.communication()``): bytes per step, bytes each
context sends, flops and the arithmetic intensity.

Each round runs both variants for ``--steps`` steps in ABBA order; medians of the rounds and
the median of per-round ratios are printed. Timings are reported, never asserted; exit status 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import jax
import numpy as np
import optax
from _stats import duration, median, quartiles, table
from bench_train import contexts_on_devices, loss_fn, mlp_init, timed

import mgkit as mg
from mgkit import _spmd
from mgkit.views import _live


def parse_args(argv):
    p = argparse.ArgumentParser(description="The trainer's step with collectives recorded and without.")
    p.add_argument("--steps", type=int, default=100, help="steps per variant per round (default 100)")
    p.add_argument("--rounds", type=int, default=12, help="ABBA rounds (default 12)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices without a GPU (default 8)")
    p.add_argument("--quick", action="store_true", help="50 steps, 2 rounds: a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 50, 2
    if args.steps < 2 or args.rounds < 1 or args.devices < 1:
        p.error("--steps >= 2, --rounds >= 1, --devices >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    devices, _ = contexts_on_devices(args.devices)
    print(f"mgkit {mg.__version__}, jax {jax.__version__}, {len(devices)} {devices[0].platform} device(s)")
    rng = np.random.default_rng(0)
    data = {
        "x": rng.normal(size=(16384, 784)).astype(np.float32),
        "y": rng.integers(0, 10, 16384).astype(np.int32),
    }
    params = mlp_init(jax.random.key(0))
    tr = mg.Trainer(loss_fn, optax.adamw(1e-3), params)  # one trainer: only the recording differs

    def run(which: str, steps: int) -> None:
        _spmd.record_collectives(which == "recorded")
        try:
            tr.fit(data, steps=steps, batch_size=256, progress=False)
        finally:
            _spmd.record_collectives(True)

    keys = ["recorded", "off"]
    times: dict[str, list[float]] = {k: [] for k in keys}
    for k in keys:  # warm up: compile, first steps
        run(k, 20)
    for r in range(args.rounds):
        for k in keys if r % 2 == 0 else keys[::-1]:
            times[k].append(timed(lambda k=k: run(k, args.steps)) / args.steps)
        mg.ledger().clear()
    paired = [a / b for a, b in zip(times["recorded"], times["off"], strict=True)]
    ratio = median(times["recorded"]) / median(times["off"])
    q = quartiles(paired)
    headers = ["case", "recorded", "off", "ratio", "paired [IQR]", "goal", "met"]
    row = [
        "(a) batch 256",
        f"{median(times['recorded']) * 1e3:.3f} ms",
        f"{median(times['off']) * 1e3:.3f} ms",
        f"{ratio:.3f}",
        f"{median(paired):.3f} [{q[0]:.3f}-{q[1]:.3f}]",
        "<= 1.02",
        "yes" if ratio <= 1.02 else "NO",
    ]
    print(table(headers, [row]))
    print(
        table(
            ["case", "with", "without", "ratio", "paired [IQR]", "goal", "met"],
            [dashboard_case(args, tr, data)],
        )
    )
    comm = tr.communication()
    print(f"reading the compiled step: {comm.seconds * 1e3:.2f} ms (once per program; goal < 50 ms)")
    print(comm)
    print(profile_overhead(tr, data, max(args.rounds // 2, 2)))
    return 0


def dashboard_case(args, tr, data) -> list[str]:
    """(b): steps per second with a live dashboard (memory panel watching the trainer) against
    none, ABBA rounds; returns the table row."""

    def fit(steps: int) -> None:
        tr.fit(data, steps=steps, batch_size=256, progress=False)

    rates: dict[str, list[float]] = {"with": [], "without": []}
    samples, busy, wall = 0, 0.0, 0.0
    fit(20)
    for r in range(args.rounds):
        for k in ("with", "without") if r % 2 == 0 else ("without", "with"):
            dash = mg.Dashboard(rate=10, widget=True).watch(tr) if k == "with" else None
            before, t0 = _live.REFRESHER.busy, time.perf_counter()
            seconds = timed(lambda: fit(args.steps))
            if dash is not None:
                busy += _live.REFRESHER.busy - before
                wall += time.perf_counter() - t0
                samples += dash.memory.samples
                dash.close()
            rates[k].append(args.steps / seconds)
        mg.ledger().clear()
    paired = [a / b for a, b in zip(rates["with"], rates["without"], strict=True)]
    ratio = median(rates["with"]) / median(rates["without"])
    q = quartiles(paired)
    print(
        f"(b) the memory panel took {samples / max(args.rounds, 1):.1f} samples per fit of {args.steps} "
        f"steps; the views' thread used {100 * busy / wall:.2f} % of a core"
    )
    return [
        "(b) dashboard + memory",
        f"{median(rates['with']):,.0f} steps/s",
        f"{median(rates['without']):,.0f} steps/s",
        f"{ratio:.3f}",
        f"{median(paired):.3f} [{q[0]:.3f}-{q[1]:.3f}]",
        ">= 0.95",
        "yes" if ratio >= 0.95 else "NO",
    ]


def profile_overhead(tr: mg.Trainer, data: dict, rounds: int, steps: int = 10) -> str:
    """(c): seconds a profile of ``steps`` trainer steps adds, read back and drawn, beyond the steps."""
    with tempfile.TemporaryDirectory(prefix="bench-seeing-profiles-") as folder:  # traces not kept
        return _profile_overhead(tr, data, rounds, steps, folder)


def _profile_overhead(tr: mg.Trainer, data: dict, rounds: int, steps: int, folder: str) -> str:
    def plain() -> None:
        tr.fit(data, steps=steps, batch_size=256, progress=False)

    def profiled() -> None:
        with mg.profile(folder, show=False) as prof:
            plain()
        prof.view(widget=False).svg()  # reads the trace, measures the shares, draws

    plain()
    first = timed(profiled) - timed(plain)
    extra = []
    for r in range(rounds):
        pair = [("profiled", profiled), ("plain", plain)]
        got = {k: timed(fn) for k, fn in (pair if r % 2 == 0 else pair[::-1])}
        extra.append(got["profiled"] - got["plain"])
        mg.ledger().clear()
    worst = max(first, median(extra))
    row = [
        f"(c) profile {steps} steps",
        duration(first),
        duration(median(extra)),
        "< 2 s",
        "yes" if worst < 2.0 else "NO",
    ]
    return table(["case", "first profile", f"later (median of {rounds})", "goal", "met"], [row])


if __name__ == "__main__":
    sys.exit(main())
