"""What mg.Trainer costs: its steps against a hand-written data-parallel step doing the same work,
measured in the same run.

Usage::

    python benchmarks/bench_train.py [--steps 200] [--rounds 6] [--devices 8] [--load-ms 0] [--pairs 16]

Contexts ``d0..d7 -> cpu0..cpu7`` on ``mg.simulate(8)`` CPU devices without an accelerator; on
a machine with GPUs, ``d0..dN`` on them. The model is an MLP 784-256-10 (tanh), softmax
cross-entropy, ``optax.adam(1e-3)``, on synthetic 784-feature data (digits-sized rows).

The peer is the step a careful user writes by hand: the same loss and optax update in one
``jax.jit`` with ``NamedSharding`` (parameters and optimizer state replicated and donated, the
batch split along its rows), fed the same batches (rows picked by the same shuffled order from
the same host arrays, then ``jax.device_put`` with the split sharding), reading each step's
loss (on CPU devices before the next step, as mgkit does: XLA's CPU runtime must not have two
collective programs in flight; on accelerators one step late).

  (a) dispatch-bound  batch 256, measured paired: ``--pairs`` rounds, each a block of
                      ``--steps / 2`` steps of every variant in turn (the order reversed every
                      other round), the median and quartiles of the per-round ratios to the
                      peer's block of that round. Variants: the Trainer; the Trainer with
                      ``fit(..., collectives=False)`` (its recording's cost: the ratio of the
                      two); the peer with the Trainer's guard (the update under ``lax.cond`` on
                      the loss and gradients being finite, both read: what ``on_nan`` costs in
                      the program itself); the Trainer with ``on_nan="apply"`` (no guard in its
                      step, as the plain peer). Goal <= 1.03.
  (b) compute-bound   batch 16,384. Goal <= 1.03.
  (c) slow loader     a data function that takes ``--load-ms`` (default: 1.5x the peer's step
                      in (a)) per batch: time per step with the trainer's prefetch against
                      max(load, step). Goal <= 1.1 x max(load, step) + 1 ms.
  (d) watched         (a) with a live mg.Dashboard attached (the ledger is always on): Trainer
                      time per step / (a)'s Trainer without. Goal <= 1.05.

(b)-(d): each round runs every variant for ``--steps`` steps in ABBA order; medians of the rounds
and the median of per-round ratios are printed. Timings are reported, never asserted; exit status 0.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _stats import median, quartiles, table
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mgkit as mg

AXIS = "x"


def parse_args(argv):
    p = argparse.ArgumentParser(description="mg.Trainer against a hand-written data-parallel step.")
    p.add_argument("--steps", type=int, default=200, help="steps per variant per round (default 200)")
    p.add_argument("--rounds", type=int, default=6, help="ABBA rounds (default 6)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices without a GPU (default 8)")
    p.add_argument(
        "--load-ms", type=float, default=0.0, help="(c) the loader's time per batch (0: 1.5x a step)"
    )
    p.add_argument("--rows", type=int, default=32768, help="rows of synthetic data (default 32768)")
    p.add_argument("--pairs", type=int, default=16, help="(a): paired rounds (default 16)")
    args = p.parse_args(argv)
    if args.steps < 2 or args.rounds < 1 or args.devices < 1 or args.rows < 16384:
        p.error("--steps >= 2, --rounds >= 1, --devices >= 1, --rows >= 16384")
    return args


def mlp_init(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (784, 256)) * (1 / 28),
        "b1": jnp.zeros(256),
        "w2": jax.random.normal(k2, (256, 10)) * (1 / 16),
        "b2": jnp.zeros(10),
    }


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


class Peer:
    """The hand-written step: jit with NamedSharding, same batches, same optax update; with
    ``guard``, the update under ``lax.cond`` on the loss and gradients being finite (the flag
    read with the loss), as mgkit's step does."""

    def __init__(self, params, optimizer, devices, data, batch_size, seed=0, guard=False):
        mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
        self.rep, self.split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
        self.params = jax.device_put(jax.tree_util.tree_map(jnp.copy, params), self.rep)
        self.opt = jax.jit(optimizer.init, out_shardings=self.rep)(self.params)
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.n = len(data["y"])
        self.epoch, self.index, self.perm = 0, 0, None
        self.late = devices[0].platform != "cpu"

        def step(p, s, b):
            loss, g = jax.value_and_grad(loss_fn)(p, b)
            if not guard:
                u, s = optimizer.update(g, s, p)
                return optax.apply_updates(p, u), s, loss
            ok = jnp.isfinite(loss + sum(jnp.sum(x) for x in jax.tree_util.tree_leaves(g)))

            def apply(p, s, g):
                u, s = optimizer.update(g, s, p)
                return optax.apply_updates(p, u), s

            p, s = jax.lax.cond(ok, apply, lambda p, s, g: (p, s), p, s, g)
            return p, s, (loss, ok)

        self.step = jax.jit(
            step, in_shardings=(self.rep, self.rep, self.split), out_shardings=self.rep, donate_argnums=(0, 1)
        )

    def batch(self):
        """The next batch's rows, as mgkit's array batching picks them (shuffled per epoch)."""
        parts, want = [], self.batch_size
        while want:
            if self.perm is None or self.perm[0] != self.epoch:
                self.perm = (self.epoch, np.random.default_rng([self.seed, self.epoch]).permutation(self.n))
            take = self.perm[1][self.index : self.index + want]
            parts.append(take)
            want -= len(take)
            self.index += len(take)
            if self.index == self.n:
                self.epoch, self.index = self.epoch + 1, 0
        idx = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return {k: v[idx] for k, v in self.data.items()}

    def run(self, steps, batches=None):
        pending = None
        for i in range(steps):
            host = self.batch() if batches is None else batches(i)
            b = jax.device_put(host, self.split)
            self.params, self.opt, loss = self.step(self.params, self.opt, b)
            if self.late:
                if pending is not None:
                    read(pending)
                pending = loss
            else:
                read(loss)
        if pending is not None:
            read(pending)


def read(loss) -> None:
    """Reads a step's loss (and, from a guarded step, its flag) to the host."""
    if isinstance(loss, tuple):
        float(loss[0]), bool(loss[1])
    else:
        float(loss)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def compare(name, variants, args, goal):
    """Runs the variants ABBA for args.rounds rounds; returns (row, per-step medians)."""
    times = {k: [] for k in variants}
    for v in variants.values():  # warm up: compile, first steps
        v(20)
    keys = list(variants)
    for r in range(args.rounds):
        for k in keys if r % 2 == 0 else keys[::-1]:
            times[k].append(timed(lambda k=k: variants[k](args.steps)) / args.steps)
        mg.ledger().clear()
    a, b = keys
    paired = [x / y for x, y in zip(times[a], times[b], strict=True)]
    ratio = median(times[a]) / median(times[b])
    q = quartiles(paired)
    row = [
        name,
        f"{median(times[a]) * 1e3:.3f} ms",
        f"{median(times[b]) * 1e3:.3f} ms",
        f"{ratio:.3f}",
        f"{median(paired):.3f} [{q[0]:.3f}-{q[1]:.3f}]",
        f"<= {goal}",
        "yes" if ratio <= goal else "NO",
    ]
    return row, {k: median(v) for k, v in times.items()}


def paired(variants, args, steps):
    """(a): ``args.pairs`` rounds, each a block of ``steps`` steps of every variant (the order
    reversed every other round). Returns, per variant, its per-round ratios to the last
    variant's (the peer's) block of the same round, in wall time and in this process's CPU time
    (which other processes on a loaded machine disturb less), and its median time per step."""
    for v in variants.values():  # warm up: compile, first steps
        v(20)
    wall, cpu = {k: [] for k in variants}, {k: [] for k in variants}
    keys = list(variants)
    for r in range(args.pairs):
        for k in keys if r % 2 == 0 else keys[::-1]:
            c0 = time.process_time()
            wall[k].append(timed(lambda k=k: variants[k](steps)) / steps)
            cpu[k].append((time.process_time() - c0) / steps)
        mg.ledger().clear()
    peer = keys[-1]

    def ratios(times):
        return {k: [x / y for x, y in zip(times[k], times[peer], strict=True)] for k in keys}

    return ratios(wall), ratios(cpu), {k: median(v) for k, v in wall.items()}


def contexts_on_devices(count: int) -> tuple[list, list[str]]:
    """Contexts ``d0..dN`` on every device: ``count`` simulated CPU devices, or the accelerators
    when there are some. Returns (devices, context names)."""
    mg.simulate(count)  # CPU devices only; an accelerator, when there is one, is used instead
    devices = jax.devices()
    names = [f"d{i}" for i in range(len(devices))]
    mg.use_contexts(
        ";".join(f"{n}->{d.platform}{d.id}" for n, d in zip(names, devices, strict=True)), verbose=False
    )
    return devices, names


def main(argv=None) -> int:
    args = parse_args(argv)
    devices, names = contexts_on_devices(args.devices)
    print(
        f"mgkit {mg.__version__}, jax {jax.__version__}, "
        f"{len(devices)} {devices[0].platform} device(s): {names}"
    )
    rng = np.random.default_rng(0)
    data = {
        "x": rng.normal(size=(args.rows, 784)).astype(np.float32),
        "y": rng.integers(0, 10, args.rows).astype(np.int32),
    }
    params = mlp_init(jax.random.key(0))
    opt = optax.adam(1e-3)
    rows, steps_ms = [], {}
    tr = mg.Trainer(loss_fn, opt, params)
    quiet = mg.Trainer(loss_fn, opt, params)
    bare = mg.Trainer(loss_fn, opt, params, on_nan="apply")
    ratios, cpu, med = paired(
        {
            "mgkit": lambda n: tr.fit(data, steps=n, batch_size=256, progress=False),
            "unrecorded": lambda n: quiet.fit(
                data, steps=n, batch_size=256, progress=False, collectives=False
            ),
            "on_nan=apply": lambda n: bare.fit(data, steps=n, batch_size=256, progress=False),
            "guarded peer": Peer(params, opt, devices, data, 256, guard=True).run,
            "peer": Peer(params, opt, devices, data, 256).run,
        },
        args,
        max(args.steps // 2, 2),
    )
    steps_ms["(a) batch 256"] = med

    def over(a, b, by):
        return [x / y for x, y in zip(by[a], by[b], strict=True)]

    for name, first, against, goal in (
        ("(a) batch 256, paired", "mgkit", "peer", 1.03),
        ("(a) on_nan='apply'", "on_nan=apply", "peer", 1.03),
        ("(a) collectives=False", "unrecorded", "peer", None),
        ("(a) peer with the guard", "guarded peer", "peer", None),
        ("(a) mgkit / unrecorded", "mgkit", "unrecorded", None),
        ("(a) mgkit / guarded peer", "mgkit", "guarded peer", None),
    ):
        rs, cs = over(first, against, ratios), over(first, against, cpu)
        q, qc = quartiles(rs), quartiles(cs)
        rows.append(
            [
                name,
                f"{med[first] * 1e3:.3f} ms",
                f"{med[against] * 1e3:.3f} ms ({against})",
                f"{med[first] / med[against]:.3f}",
                f"{median(rs):.3f} [{q[0]:.3f}-{q[1]:.3f}], cpu {median(cs):.3f} [{qc[0]:.3f}-{qc[1]:.3f}]",
                "" if goal is None else f"<= {goal}",
                "" if goal is None else "yes" if median(rs) <= goal else "NO",
            ]
        )
    for case, batch_size, goal in (("(b) batch 16384", 16384, 1.03),):
        tr = mg.Trainer(loss_fn, opt, params)
        peer = Peer(params, opt, devices, data, batch_size)
        row, med = compare(
            case,
            {
                "mgkit": lambda n, tr=tr, bs=batch_size: tr.fit(data, steps=n, batch_size=bs, progress=False),
                "peer": peer.run,
            },
            args,
            goal,
        )
        rows.append(row)
        steps_ms[case] = med
    # (c): a loader slower than a step, with and without the trainer's prefetch
    step_s = steps_ms["(a) batch 256"]["peer"]
    load_s = args.load_ms / 1e3 if args.load_ms > 0 else 1.5 * step_s
    peer_c = Peer(params, opt, devices, data, 256)
    pool = [peer_c.batch() for _ in range(8)]

    def loader(step):
        time.sleep(load_s)  # reading and decoding, off the GIL like file I/O
        return pool[step % len(pool)]

    ahead = mg.Trainer(loss_fn, opt, params)
    inline = mg.Trainer(loss_fn, opt, params, prefetch=0)
    times_c = {"prefetch": [], "inline": []}
    for fn in (ahead, inline):
        fn.fit(loader, steps=10, progress=False)
    for r in range(args.rounds):
        for name, tr_c in (("prefetch", ahead), ("inline", inline))[:: 1 if r % 2 == 0 else -1]:
            times_c[name].append(
                timed(lambda tr_c=tr_c: tr_c.fit(loader, steps=args.steps // 2, progress=False))
                / (args.steps // 2)
            )
        mg.ledger().clear()
    bound = 1.1 * max(load_s, step_s) + 1e-3
    got = median(times_c["prefetch"])
    rows_c = [
        "(c) loader 1.5x a step",
        f"{got * 1e3:.3f} ms",
        f"max(load {load_s * 1e3:.3f}, step {step_s * 1e3:.3f} ms)",
        f"{got / max(load_s, step_s):.3f}",
        f"inline {median(times_c['inline']) * 1e3:.3f} ms",
        f"<= {bound * 1e3:.3f} ms",
        "yes" if got <= bound else "NO",
    ]
    # (d): the dashboard attached
    tr = mg.Trainer(loss_fn, opt, params)
    dash = {"view": None}

    def watched(n):
        if dash["view"] is None:
            dash["view"] = mg.Dashboard(widget=True)
        tr.fit(data, steps=n, batch_size=256, progress=False)

    plain = mg.Trainer(loss_fn, opt, params)

    def unwatched(n):
        if dash["view"] is not None:
            dash["view"].close()
            dash["view"] = None
        plain.fit(data, steps=n, batch_size=256, progress=False)

    row, _ = compare("(d) dashboard attached", {"watched": watched, "plain": unwatched}, args, 1.05)
    if dash["view"] is not None:
        dash["view"].close()
    rows.append(row)
    rows.insert(6, rows_c)
    print()
    print(
        "time per step, median of rounds; ratio = first / second; "
        "paired = median [quartiles] of per-round ratios"
    )
    print(table(["case", "mgkit", "peer", "ratio", "paired", "goal", "met"], rows))
    a, b = steps_ms["(a) batch 256"], steps_ms["(b) batch 16384"]
    print(
        f"\nsamples/s: (a) mgkit {256 / a['mgkit']:,.0f}, peer {256 / a['peer']:,.0f}; "
        f"(b) mgkit {16384 / b['mgkit']:,.0f}, peer {16384 / b['peer']:,.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
