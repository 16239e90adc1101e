"""Gradient accumulation and mixed precision in mg.Trainer, measured against their peers in the
same run.

Usage::

    python benchmarks/bench_accumulate_precision.py [--quick] [--steps 1000] [--rounds 4] [--devices 8]

Contexts ``d0..d7 -> cpu0..cpu7`` on ``mg.simulate(8)`` CPU devices without an accelerator; on
a machine with GPUs, ``d0..dN`` on them.

  (a) accumulation memory  per-device peak of the compiled step (arguments, outputs that do
                           not reuse donated buffers, temporaries: ``memory_analysis``) of
                           ``accumulate=8`` at batch B against a step of batch B/8, and against
                           the unaccumulated step of batch B. MLP 16-256x4-1 (ReLU), adam, B/8 =
                           1,024 rows per device. Goal <= 1.15. The same with ``shard="fsdp"``
                           (parameters and adam's state split over the devices): MLP
                           512-2048x3-1, B/8 = 256 rows per device. Goal <= 1.15.
  (b) accumulation time    time per sample of ``accumulate=8`` at batch B against the
                           unaccumulated step at the same batch (ABBA rounds). Reported.
  (c) mixed precision      an MLP 64-128-10 (tanh) on scikit-learn's digits, adam at 1e-3 and
                           3e-4, batch 256, ``--steps`` steps (1,000; 200 with --quick) in fp32,
                           bf16 and fp16: the loss of the whole data set after training
                           (evaluated in float32), bf16's against fp32's (goal: within 1 %),
                           fp16's overflow steps, and the parameters' dtype (asserted float32).
                           The yardstick: fp32 with another data order (seed 1), how far two
                           float32 runs land apart. Time per step reported (on CPU reduced
                           precision is not faster).

Timings are reported, never asserted; exit status 0.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _stats import duration, median, table
from bench_train import compare

import mgkit as mg
from mgkit._spmd import AXIS, sharding
from mgkit.train._accumulate import peak_bytes
from mgkit.train._plan import plan
from mgkit.train._shard import Placement
from mgkit.train._step import spmd_step

K = 8  # microbatches in (a) and (b)


def parse_args(argv):
    p = argparse.ArgumentParser(description="mg.Trainer's accumulate= and precision= against their peers.")
    p.add_argument("--quick", action="store_true", help="small sizes, few steps (a smoke run)")
    p.add_argument("--steps", type=int, default=None, help="(c) training steps (default 1000; 200 quick)")
    p.add_argument("--rounds", type=int, default=4, help="(b) ABBA rounds (default 4)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices without a GPU (default 8)")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 200 if args.quick else 1000
    if args.steps < 10 or args.rounds < 1 or args.devices < 1:
        p.error("--steps >= 10, --rounds >= 1, --devices >= 1")
    return args


# -- (a), (b): accumulation --------------------------------------------------------------------


def deep_loss(p, batch):
    h = batch["x"]
    for w in p["ws"][:-1]:
        h = jax.nn.relu(h @ w)
    return jnp.mean((h @ p["ws"][-1] - batch["y"]) ** 2)


def deep_params(widths: list[int]) -> dict:
    keys = jax.random.split(jax.random.key(0), len(widths) - 1)
    pairs = itertools.pairwise(widths)
    return {"ws": [jax.random.normal(k, (a, b)) / np.sqrt(a) for k, (a, b) in zip(keys, pairs, strict=True)]}


def step_bytes(
    devices: tuple, widths: list[int], rows: int, accumulate: int, shard: str | None = None
) -> int:
    """Per-device peak of the trainer's SPMD step, lowered on shapes (nothing allocated);
    ``shard``: parameters and optimizer state split as ``Trainer(shard=...)`` splits them."""
    opt = optax.adam(1e-3)
    own = jax.eval_shape(lambda: deep_params(widths))
    state = jax.eval_shape(opt.init, own)
    layout = None if shard is None else Placement(plan(own, shard, None, len(devices), "bench"), devices)
    if layout is None:
        rep, split = sharding(devices), sharding(devices, AXIS, 0)
        laid, state_laid = jax.tree_util.tree_map(lambda _: rep, (own, state))
    else:
        rep, split, laid, state_laid = layout.rep, layout.split, layout.params, layout.opt_state(opt)

    def shapes(tree, where):
        return jax.tree_util.tree_map(
            lambda s, at: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=at), tree, where
        )

    batch = {
        "x": jax.ShapeDtypeStruct((rows, widths[0]), jnp.float32, sharding=split),
        "y": jax.ShapeDtypeStruct((rows, 1), jnp.float32, sharding=split),
    }
    step = spmd_step(deep_loss, opt, False, devices, accumulate=accumulate, layout=layout)
    return peak_bytes(step, shapes(own, laid), shapes(state, state_laid), batch, None, None)


def accumulation(args, devices: tuple) -> list[list[str]]:
    n = len(devices)
    widths = [16, 256, 256, 256, 256, 1]
    micro = n * 1024  # compiled, not run: the same with --quick
    accumulated = step_bytes(devices, widths, K * micro, K)
    one = step_bytes(devices, widths, micro, 1)
    whole = step_bytes(devices, widths, K * micro, 1)
    mib = 2**20
    rows = [
        [
            f"(a) peak, accumulate={K} vs batch/{K}",
            f"{accumulated / mib:.2f} MiB",
            f"{one / mib:.2f} MiB",
            f"{accumulated / one:.3f}",
            "<= 1.15",
            "yes" if accumulated <= 1.15 * one else "NO",
        ],
        [
            f"(a) peak, accumulate={K} vs whole batch",
            f"{accumulated / mib:.2f} MiB",
            f"{whole / mib:.2f} MiB",
            f"{accumulated / whole:.3f}",
            "report",
            "-",
        ],
    ]
    if n > 1:  # fsdp: split parameters and optimizer state
        wide, micro = [512, 2048, 2048, 2048, 1], n * 256
        accumulated = step_bytes(devices, wide, K * micro, K, "fsdp")
        one = step_bytes(devices, wide, micro, 1, "fsdp")
        rows.append(
            [
                f"(a) peak, fsdp, accumulate={K} vs batch/{K}",
                f"{accumulated / mib:.2f} MiB",
                f"{one / mib:.2f} MiB",
                f"{accumulated / one:.3f}",
                "<= 1.15",
                "yes" if accumulated <= 1.15 * one else "NO",
            ]
        )
    # (b): the same batch, with and without accumulation, per sample
    batch = K * (n * (32 if args.quick else 128))
    rng = np.random.default_rng(0)
    data = {
        "x": rng.normal(size=(2 * batch, widths[0])).astype(np.float32),
        "y": rng.normal(size=(2 * batch, 1)).astype(np.float32),
    }
    params = deep_params(widths)
    fits = {}
    for k in (K, 1):
        tr = mg.Trainer(deep_loss, optax.adam(1e-3), params)
        fits[f"accumulate={k}"] = lambda s, tr=tr, k=k: tr.fit(
            data, steps=s, batch_size=batch, accumulate=k, progress=False
        )
    timing = argparse.Namespace(steps=5 if args.quick else 20, rounds=args.rounds)
    _, med = compare("(b)", fits, timing, float("inf"))
    a, b = med[f"accumulate={K}"], med["accumulate=1"]
    rows.append(
        [
            f"(b) time per sample, batch {batch:,}",
            f"{duration(a / batch)}",
            f"{duration(b / batch)}",
            f"{a / b:.3f}",
            "report",
            "-",
        ]
    )
    return rows


# -- (c): mixed precision ----------------------------------------------------------------------


def digits():
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    return {"x": (X / 16.0).astype(np.float32), "y": y.astype(np.int32)}


def digits_params() -> dict:
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (64, 128)) / 8,
        "b1": jnp.zeros(128),
        "w2": jax.random.normal(k2, (128, 10)) / np.sqrt(128),
        "b2": jnp.zeros(10),
    }


def digits_loss(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    logits = h @ p["w2"] + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


class Run(NamedTuple):
    """One digits fit of (c)."""

    loss: float  # the whole data set's loss after training, evaluated in float32
    seconds: float  # median time per step (the first, which compiles, left out)
    overflowed: int  # steps fp16's loss scale skipped


def digits_run(data: dict, params: dict, steps: int, rate: float, precision: str, seed: int = 0) -> Run:
    tr = mg.Trainer(digits_loss, optax.adam(rate), params, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mg.PrecisionWarning)  # on CPU: the time rows say it
        hist = tr.fit(data, steps=steps, batch_size=256, precision=precision, progress=False)
    dtypes = {x.dtype for x in jax.tree_util.tree_leaves((tr.params, tr.opt_state))}
    floats = {d for d in dtypes if jnp.issubdtype(d, jnp.floating)}
    assert floats == {jnp.dtype(jnp.float32)}, f"{precision}: parameters and state are {floats}"
    loss = float(digits_loss(jax.device_get(tr.params), data))
    return Run(loss, median(list(hist.seconds[1:])), hist.overflowed)


def precision(args) -> list[list[str]]:
    """bf16 and fp16 against fp32 at two learning rates; the yardstick: fp32 itself with another
    data order (seed 1), how far two float32 runs land apart."""
    data, params = digits(), digits_params()
    rows, times = [], {}
    for rate in (1e-3, 3e-4):
        ref = digits_run(data, params, args.steps, rate, "fp32")
        runs = {
            "bf16": digits_run(data, params, args.steps, rate, "bf16"),
            "fp16": digits_run(data, params, args.steps, rate, "fp16"),
            "fp32, data order 1": digits_run(data, params, args.steps, rate, "fp32", seed=1),
        }
        times.setdefault("fp32", ref.seconds)
        for name, run in runs.items():
            times.setdefault(name, run.seconds)
            gap = abs(run.loss - ref.loss) / ref.loss
            goal, met = ("within 1 %", "yes" if gap <= 0.01 else "NO") if name == "bf16" else ("report", "-")
            if name == "fp16":
                goal = f"report ({run.overflowed} overflow steps)"
            case = f"(c) {name} loss, adam({rate:g}), {args.steps} steps"
            rows.append([case, f"{run.loss:.5f}", f"{ref.loss:.5f}", f"{run.loss / ref.loss:.4f}", goal, met])
    for name in ("bf16", "fp16"):
        ratio = f"{times[name] / times['fp32']:.3f}"
        mine, peer = duration(times[name]), duration(times["fp32"])
        rows.append([f"(c) {name} time per step", mine, peer, ratio, "report", "-"])
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    mg.simulate(args.devices)  # CPU devices only; an accelerator, when there is one, is used instead
    devices = tuple(jax.devices())
    names = [f"d{i}" for i in range(len(devices))]
    mg.use_contexts(
        ";".join(f"{n}->{d.platform}{d.id}" for n, d in zip(names, devices, strict=True)), verbose=False
    )
    print(f"mgkit {mg.__version__}, jax {jax.__version__}, {len(devices)} {devices[0].platform} device(s)")
    rows = accumulation(args, devices) + precision(args)
    print()
    print("parameters and optimizer state stayed float32 in every precision (asserted)")
    print(table(["case", "mgkit", "peer", "ratio", "goal", "met"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
