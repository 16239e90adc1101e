"""Big models on many contexts: ``mg.Trainer(..., shard=)`` checked for the same answer, the memory
each context holds, and the time of its step against a hand-written FSDP step, measured in the
same run.

Usage::

    python benchmarks/bench_big_models.py [--quick] [--devices 8] [--steps 20] [--rounds 4] [--only speed]

Contexts ``d0..d7 -> cpu0..cpu7`` on ``mg.simulate(8)`` CPU devices without an accelerator.

  same answer  200 adam steps of an MLP 784-100-16 (a 784 x 100 layer: on 3 and 5 contexts
               neither axis divides, so it is stored padded) with ``shard="fsdp"`` on 1, 2, 3, 4,
               5 and 8 contexts, and the tensor-parallel ``mesh={"data": 2, "model": 4}``, against
               the replicated run on one device. Goal: rtol 1e-5, atol 1e-6.
  memory       parameters plus adam state per context, read from the live shards, against
               total / N x 1.05 + one padding row per split leaf; and a model created split
               (``params`` a function): the creation program's peak per context (XLA's memory
               analysis) against its share of the whole.
  speed        an MLP with 2048-wide layers, adamw: the fsdp step against a hand-written FSDP step
               (one ``jax.jit`` with the same NamedShardings, parameters and optimizer state
               donated, the JAX training cookbook's way), fed the same batch; and fsdp against
               replicate. Goal: fsdp / hand-written <= 1.10.

Each section is a function; ``main`` runs them in order (other sections may be added). Timings
are medians of ABBA rounds; they are reported, never asserted; exit status 0.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _stats import median, table

import mgkit as mg

TOL = {"rtol": 1e-5, "atol": 1e-6}


def parse_args(argv):
    p = argparse.ArgumentParser(description="mg.Trainer(shard=...): same answer, memory and speed.")
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds (a smoke run)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    p.add_argument("--steps", type=int, default=20, help="speed: steps per variant per round (default 20)")
    p.add_argument("--rounds", type=int, default=4, help="speed: ABBA rounds (default 4)")
    p.add_argument(
        "--only", nargs="*", default=None, help="sections to run (default all): same_answer memory speed"
    )
    p.add_argument("--same-steps", type=int, default=200, help="same answer: adam steps (default 200)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.same_steps = 5, 2, 20
    return args


# -- the small model (same answer, memory) ---------------------------------------------------


def small_init(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (784, 100)) * 0.05,
        "b1": jnp.zeros(100),
        "w2": jax.random.normal(k2, (100, 16)) * 0.1,
        "b2": jnp.zeros(16),
    }


def small_loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - b["y"]) ** 2)


def small_data(rows=240):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 784)).astype(np.float32)
    teacher = rng.normal(size=(784, 16)).astype(np.float32) / 28
    return {"x": x, "y": np.tanh(x @ teacher).astype(np.float32)}


def unpadded(params, like):
    return {k: np.asarray(v)[tuple(slice(0, s) for s in like[k].shape)] for k, v in params.items()}


def same_answer(args) -> None:
    """fsdp on 1..8 contexts and the tensor-parallel mesh against the replicated run on one device."""
    params, data = small_init(jax.random.key(0)), small_data()

    def run(**kw):
        tr = mg.Trainer(small_loss, optax.adam(1e-3), params, **kw)
        tr.fit(data, steps=args.same_steps, batch_size=60, progress=False)
        return unpadded(tr.params, params)

    ref = run(contexts=1)
    cases = [(f"fsdp, {n} contexts", {"contexts": n, "shard": "fsdp"}) for n in (1, 2, 3, 4, 5, 8)]
    mesh_rules = {"w1": (None, "model"), "w2": ("model", None)}
    cases.append(('mesh {"data": 2, "model": 4}', {"shard": mesh_rules, "mesh": {"data": 2, "model": 4}}))
    rows = []
    for name, kw in cases:
        if kw.get("contexts", 8) > args.devices:
            continue
        got = run(**kw)
        worst = max(float(np.max(np.abs(got[k] - ref[k]) - TOL["rtol"] * np.abs(ref[k]))) for k in ref)
        diff = max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref)
        rows.append([name, f"{diff:.2e}", f"{worst:.2e}", "yes" if worst <= TOL["atol"] else "NO"])
    print(f"\nsame answer: {args.same_steps} adam steps against the replicated run on one device")
    print(table(["run", "max |diff|", "max |diff| - rtol|ref|", "<= atol 1e-6"], rows))


def memory(args) -> None:
    """Parameters plus optimizer state per context from the live shards, and creation's peak."""
    params, data = small_init(jax.random.key(0)), small_data()
    whole = sum(x.nbytes for x in params.values())
    rows = []
    for n in (3, 5, 8):
        if n > args.devices:
            continue
        tr = mg.Trainer(small_loss, optax.adam(1e-3), params, contexts=n, shard="fsdp")
        tr.fit(data, steps=1, batch_size=60, progress=False)
        pad_rows = 0  # one row of the split axis per split leaf, for the leaf, mu and nu
        for lay in jax.tree_util.tree_leaves(tr._plan.leaves):
            if any(lay.spec):
                ax = next(i for i, names in enumerate(lay.spec) if names)
                pad_rows += 3 * int(np.prod(lay.shape)) // lay.shape[ax] * 4
        bound = (3 * whole + 4) / n * 1.05 + pad_rows
        most = max(r.params + r.opt_state for r in tr.memory().rows())
        rows.append(
            [
                f"{n} contexts",
                f"{most:,}",
                f"{bound:,.0f}",
                f"{most / bound:.3f}",
                "yes" if most <= bound else "NO",
            ]
        )
    print("\nmemory: parameters + adam state per context (live shards), MLP 784-100-16")
    print(table(["fsdp", "bytes (most)", "bound", "ratio", "within"], rows))
    make = lambda: {"w": jax.random.normal(jax.random.key(1), (8192, 2048)), "b": jnp.zeros(2048)}  # noqa: E731
    n = args.devices
    tr = mg.Trainer(lambda p, b: jnp.mean(b @ p["w"]), optax.sgd(0.1), make, shard="fsdp")
    split = tr._layout.creator(make).lower().compile().memory_analysis()
    full = jax.jit(make).lower().compile().memory_analysis()
    peak = split.output_size_in_bytes + split.temp_size_in_bytes
    peak_full = full.output_size_in_bytes + full.temp_size_in_bytes
    share = 8192 * 2048 * 4 // n
    print(
        f"created split on {n} contexts (8192 x 2048 float32, {8192 * 2048 * 4:,} bytes): output per "
        f"context {split.output_size_in_bytes:,} (share {share:,}); peak {peak:,} = "
        f"{peak / peak_full:.3f} of creating it whole ({peak_full:,})"
    )


# -- speed -------------------------------------------------------------------------------------


def wide_init(key, width=2048, layers=3):
    keys = jax.random.split(key, layers)
    return {
        f"layer{i}": {"w": jax.random.normal(k, (width, width)) / np.sqrt(width), "b": jnp.zeros(width)}
        for i, k in enumerate(keys)
    }


def wide_loss(p, b):
    h = b["x"]
    for i in range(len(p)):
        h = jnp.tanh(h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
    return jnp.mean((h - b["y"]) ** 2)


class HandFSDP:
    """The hand-written FSDP step: one jit over the trainer's own NamedShardings, donated state."""

    def __init__(self, tr, optimizer, batch):
        leaves = jax.tree_util.tree_map(lambda x: x.sharding, (tr.params, tr.opt_state))
        p_sh, o_sh = leaves
        split = jax.sharding.NamedSharding(
            tr.params["layer0"]["w"].sharding.mesh, jax.sharding.PartitionSpec("mgkit")
        )
        rep = jax.sharding.NamedSharding(split.mesh, jax.sharding.PartitionSpec())
        copy = jax.jit(lambda t: jax.tree_util.tree_map(jnp.copy, t), out_shardings=(p_sh, o_sh))
        self.params, self.opt = copy((tr.params, tr.opt_state))
        self.batch, self.split = batch, split

        def step(p, s, b):
            loss, g = jax.value_and_grad(wide_loss)(p, b)
            u, s = optimizer.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        self.step = jax.jit(
            step, in_shardings=(p_sh, o_sh, split), out_shardings=(p_sh, o_sh, rep), donate_argnums=(0, 1)
        )

    def run(self, steps):
        for _ in range(steps):
            b = jax.device_put(self.batch, self.split)
            self.params, self.opt, loss = self.step(self.params, self.opt, b)
            float(loss)  # read each step, as the trainer does on CPU devices


def abba(variants: dict, steps: int, rounds: int) -> dict:
    """Seconds per step of each variant (medians over ABBA rounds, after a warm-up)."""
    times = {k: [] for k in variants}
    for run in variants.values():
        run(2)
    keys = list(variants)
    for r in range(rounds):
        for k in keys if r % 2 == 0 else keys[::-1]:
            t0 = time.perf_counter()
            variants[k](steps)
            times[k].append((time.perf_counter() - t0) / steps)
        mg.ledger().clear()
    return {k: median(v) for k, v in times.items()}


def speed(args) -> None:
    """fsdp against the hand-written FSDP step, and against replicate, on an MLP of 2048-wide layers."""
    params, optimizer = wide_init(jax.random.key(0)), optax.adamw(1e-3)
    rng = np.random.default_rng(0)
    batch = {k: rng.normal(size=(64, 2048)).astype(np.float32) for k in ("x", "y")}
    fsdp = mg.Trainer(wide_loss, optimizer, params, shard="fsdp")
    inline = mg.Trainer(wide_loss, optimizer, params, shard="fsdp", prefetch=0)  # places as the peer
    rep = mg.Trainer(wide_loss, optimizer, params)
    hand = HandFSDP(fsdp, optimizer, batch)

    def fit(tr):
        return lambda n: tr.fit(lambda step: batch, steps=n, progress=False)

    variants = {"fsdp": fit(fsdp), "hand": hand.run, "inline": fit(inline), "replicate": fit(rep)}
    t = abba(variants, args.steps, args.rounds)
    ratio = t["fsdp"] / t["hand"]
    print(
        f"\nspeed: MLP 3 x 2048-wide layers, adamw, batch 64, {args.devices} contexts, "
        f"{args.steps} steps x {args.rounds} rounds"
    )
    print(
        table(
            ["step", "ms per step", "ratio", "goal"],
            [
                [
                    "mg.Trainer shard='fsdp'",
                    f"{t['fsdp'] * 1e3:.2f}",
                    f"{ratio:.3f} of hand-written",
                    "<= 1.10 " + ("yes" if ratio <= 1.1 else "NO"),
                ],
                [
                    "mg.Trainer shard='fsdp', prefetch=0",
                    f"{t['inline'] * 1e3:.2f}",
                    f"{t['inline'] / t['hand']:.3f} of hand-written",
                    "(batch placed inline, as the peer)",
                ],
                ["hand-written FSDP (jax.jit)", f"{t['hand'] * 1e3:.2f}", "1.000", ""],
                [
                    "mg.Trainer replicate",
                    f"{t['replicate'] * 1e3:.2f}",
                    f"fsdp / replicate {t['fsdp'] / t['replicate']:.3f}",
                    "(report)",
                ],
            ],
        )
    )


SECTIONS = (same_answer, memory, speed)


def main(argv=None) -> int:
    args = parse_args(argv)
    mg.simulate(args.devices)
    devices = jax.devices()
    names = [f"d{i}" for i in range(len(devices))]
    mg.use_contexts(
        ";".join(f"{n}->{d.platform}{d.id}" for n, d in zip(names, devices, strict=True)), verbose=False
    )
    print(f"mgkit {mg.__version__}, jax {jax.__version__}, {len(devices)} {devices[0].platform} device(s)")
    for section in SECTIONS:
        if args.only is None or section.__name__ in args.only:
            section(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
