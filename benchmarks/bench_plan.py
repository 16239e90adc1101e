"""A step planned ahead of time (``tr.plan``) against the same step run, in one run.

Usage::

    python benchmarks/bench_plan.py [--devices 8] [--steps 30] [--width 512]

Contexts ``d0..dN -> cpu0..cpuN`` on ``mg.simulate(N)`` CPU devices without an accelerator; on a
machine with GPUs, on them. The model is an MLP ``width -> width -> width -> 1`` with
``optax.adam(1e-3)``, batch 256.

  (a) planned peak     For replicated, fsdp and fsdp with ``accumulate=4``: the plan's peak
                       per context / the peak of the program the fit then compiles and runs
                       (``memory_analysis`` of it; on a GPU also the allocator's
                       ``peak_bytes_in_use`` after the fit). Goal within 10 %.
  (b) predicted step   The plan's predicted seconds per step / the measured seconds per step
                       (one fit of ``--steps`` steps, best of 3, after the compile), with the
                       device figures used (the table's, or this session's calibration).
  (c) plan time        Seconds to plan 12 layouts (2 counts x 3 shard= x 2 accumulate=), the
                       first time (compiling) and again (cached). Goal under 20 s.
  (d) shard="auto"     The layout ``shard="auto"`` keeps under a budget, against the fastest
                       fitting layout found by running each (replicated, fsdp): its step time
                       / the fastest's.

Timings are reported, never asserted; exit status 0.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import optax
from bench_train import contexts_on_devices

import mgkit as mg


def mlp(width: int):
    import jax
    import jax.numpy as jnp

    def init():
        keys = jax.random.split(jax.random.key(0), 3)
        return {
            "w1": jax.random.normal(keys[0], (width, width)) * 0.05,
            "w2": jax.random.normal(keys[1], (width, width)) * 0.05,
            "w3": jax.random.normal(keys[2], (width, 1)) * 0.05,
        }

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w1"])
        h = jnp.tanh(h @ p["w2"])
        return jnp.mean((h @ p["w3"] - b["y"]) ** 2)

    return init, loss


def measured(tr, batch, steps: int, accumulate: int = 1, rounds: int = 3) -> float:
    """Seconds per step: the best of ``rounds`` fits of ``steps`` steps each, after two steps that
    compile (one fit call per round, as a training loop runs)."""
    tr.fit(lambda s: batch, steps=2, accumulate=accumulate, progress=False)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        tr.fit(lambda s: batch, steps=steps, accumulate=accumulate, progress=False)
        best = min(best, (time.perf_counter() - t0) / steps)
    return best


def running_peak(tr) -> int | None:
    from mgkit._oom import program_bytes

    readings = [r for r in tr._collectives._readings.values() if r.compiled is not None]
    return program_bytes(readings[-1].compiled) if readings else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=512)
    args = p.parse_args()
    devices, _ = contexts_on_devices(args.devices)
    init, loss = mlp(args.width)
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(256, args.width)).astype(np.float32),
        "y": rng.normal(size=(256, 1)).astype(np.float32),
    }
    print(f"bench_plan: {len(devices)} x {devices[0].device_kind}, MLP width {args.width}, batch 256")

    print("\n(a) planned peak and (b) predicted step, against the step run")
    for shard, acc in (("replicate", 1), ("fsdp", 1), ("fsdp", 4)):
        tr = mg.Trainer(loss, optax.adam(1e-3), init(), shard=shard)
        planned = tr.plan(batch, accumulate=acc)
        row = planned.rows()[0]
        tr.fit(lambda s: batch, steps=1, accumulate=acc, progress=False)
        used = running_peak(tr)
        step = measured(mg.Trainer(loss, optax.adam(1e-3), init(), shard=shard), batch, args.steps, acc)
        ratio = "n/a" if not used else f"{row.peak / used:.3f}"
        print(
            f"  {shard:9s} accumulate {acc}: planned peak {row.peak:,} B, running program {used:,} B "
            f"(ratio {ratio}); predicted {row.seconds * 1e3:.3g} ms, measured {step * 1e3:.3g} ms "
            f"(ratio {row.seconds / step:.2f}, bound: {row.predicted.bound})"
        )
    print(f"  device figures: {planned.figures}")

    print("\n(c) plan time for 12 layouts")
    tr = mg.Trainer(loss, optax.adam(1e-3), init())
    grid = dict(
        contexts=[len(devices) // 2 or 1, len(devices)],
        shard=["replicate", "fsdp", {"w2": 1}],
        accumulate=[1, 4],
    )
    t0 = time.perf_counter()
    first = tr.plan(batch, **grid)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tr.plan(batch, **grid)
    again_s = time.perf_counter() - t0
    print(
        f"  {len(first)} layouts: {first_s:.1f} s the first time (goal < 20 s), "
        f"{again_s:.3f} s again (cached)"
    )

    print('\n(d) shard="auto" against the fastest fitting layout found by running each')
    steps = {}
    for shard in ("replicate", "fsdp"):
        steps[shard] = measured(mg.Trainer(loss, optax.adam(1e-3), init(), shard=shard), batch, args.steps)
    auto = mg.Trainer(loss, optax.adam(1e-3), init(), shard="auto")
    auto.fit(lambda s: batch, steps=1, progress=False)
    fastest = min(steps, key=steps.get)
    print("  measured: " + ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in steps.items()))
    print(f"  auto chose {auto.shard}; fastest by running each: {fastest}; "
          f"auto's step / fastest = {steps[auto.shard] / steps[fastest]:.3f}")  # fmt: skip
    print("  " + auto.layout.replace("\n", "\n  "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
