"""What the trainer step's non-finite guard costs, and what other ways of writing it cost: compiled
programs timed directly, against the same step with no guard, in the same run.

Usage::

    python benchmarks/bench_guard.py [--model mlp|wide|tiny] [--rounds 20] [--steps 30] [--devices 8]

Models: ``mlp`` 784-256-10 (``bench_train.py`` (a)'s), ``wide`` 784-2048-2048-2048-10, ``tiny``
8-4-2; softmax cross-entropy, ``optax.adam(1e-3)``, batch 256 split over the devices, parameters
and optimizer state replicated and donated, each step's loss read before the next (as the
trainer does on CPU devices). Every variant is one ``jax.jit`` of the same loss and update:

  plain       no guard (the peer)
  guard       mgkit's step's guard (``train._step.update``): the optax update under ``lax.cond``
              on the loss and every gradient being finite
  loss-cond   the same ``lax.cond`` on the loss alone (what the conditional costs by itself)
  flag-only   no conditional; the flag computed and returned (what the finite check costs)
  state-cond  only the optax update under ``lax.cond``; the parameters updated outside by
              ``where(ok, updates, 0)``
  select      no conditional: the update computed, then ``where(ok, new, old)`` per leaf of the
              parameters and optimizer state
  mask        no conditional: ``where(ok, updates, 0)`` added to the parameters, the optimizer
              state selected per leaf
  loop        the optax update in a ``fori_loop`` run ``ok`` times (0 or 1): a loop's carried
              state is updated in place, where a conditional's outputs are new buffers
  pick        the update computed outside; ``lax.cond`` only picks the new or the old state

Each round runs ``--steps`` steps of every variant in turn (the order reversed every other
round); printed: per variant the median time per step (CPU time, ``time.process_time``, and
wall) and the median and quartiles of the per-round ratios to ``plain``, with the copies and
conditionals in its compiled program (``compile().as_text()``). Timings are reported, never
asserted; exit status 0.
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _stats import median, quartiles, table
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mgkit as mg
from mgkit.train._precision import finite
from mgkit.train._step import update

SIZES = {"mlp": [784, 256, 10], "wide": [784, 2048, 2048, 2048, 10], "tiny": [8, 4, 2]}
VARIANTS = ("plain", "guard", "loss-cond", "flag-only", "state-cond", "select", "mask", "loop", "pick")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="The trainer step's guard against the same step without it.")
    p.add_argument("--model", choices=sorted(SIZES), default="mlp", help="model (default mlp)")
    p.add_argument("--rounds", type=int, default=20, help="paired rounds (default 20)")
    p.add_argument("--steps", type=int, default=30, help="steps per variant per round (default 30)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.devices < 1:
        p.error("--rounds, --steps and --devices are at least 1")
    return args


def model(sizes, key):
    """(params, loss function) of an MLP of ``sizes`` (tanh between layers)."""
    keys = jax.random.split(key, len(sizes) - 1)
    params = {}
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        params[f"w{i}"] = jax.random.normal(keys[i], (a, b)) / np.sqrt(a)
        params[f"b{i}"] = jnp.zeros(b)

    def loss_fn(p, batch):
        h = batch["x"]
        for i in range(len(sizes) - 1):
            h = h @ p[f"w{i}"] + p[f"b{i}"]
            h = jnp.tanh(h) if i < len(sizes) - 2 else h
        return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()

    return params, loss_fn


def step_of(variant, loss_fn, opt):
    """The step (params, opt_state, batch) -> (params, opt_state, loss or (loss, ok))."""
    where = lambda ok, new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
    masked = lambda ok, u: jax.tree_util.tree_map(lambda x: jnp.where(ok, x, 0), u)  # noqa: E731

    def apply(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        if variant == "plain":
            p, s = apply(p, s, g)
            return p, s, loss
        if variant == "guard":
            p, s, ok = update(opt, p, s, loss, g)
            return p, s, (loss, ok)
        ok = jnp.isfinite(loss) if variant == "loss-cond" else finite((loss, g))
        if variant == "loss-cond":
            p, s = jax.lax.cond(ok, apply, lambda p, s, g: (p, s), p, s, g)
        elif variant == "flag-only":
            p, s = apply(p, s, g)
        elif variant == "pick":
            new = apply(p, s, g)
            p, s = jax.lax.cond(ok, lambda n, o: n, lambda n, o: o, new, (p, s))
        elif variant == "loop":
            p, s = jax.lax.fori_loop(0, ok.astype(jnp.int32), lambda _, ps: apply(*ps, g), (p, s))
        elif variant == "state-cond":
            zero = lambda s, g, p: (jax.tree_util.tree_map(jnp.zeros_like, p), s)  # noqa: E731
            u, s = jax.lax.cond(ok, lambda s, g, p: opt.update(g, s, p), zero, s, g, p)
            p = optax.apply_updates(p, u)
        else:
            u, new = opt.update(g, s, p)
            p = (
                where(ok, optax.apply_updates(p, u), p)
                if variant == "select"
                else optax.apply_updates(p, masked(ok, u))
            )
            s = where(ok, new, s)
        return p, s, (loss, ok)

    return step


def main(argv=None):
    args = parse_args(argv)
    mg.simulate(args.devices)
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))
    sizes = SIZES[args.model]
    params, loss_fn = model(sizes, jax.random.PRNGKey(0))
    opt = optax.adam(1e-3)
    rng = np.random.default_rng(0)
    rows = 256 * 8
    x = rng.normal(size=(rows, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], size=rows).astype(np.int32)
    batches = [jax.device_put({"x": x[i : i + 256], "y": y[i : i + 256]}, split) for i in range(0, rows, 256)]
    programs, states, shape = {}, {}, {}
    for v in VARIANTS:
        f = jax.jit(
            step_of(v, loss_fn, opt), in_shardings=(rep, rep, split), out_shardings=rep, donate_argnums=(0, 1)
        )
        p = jax.device_put(jax.tree_util.tree_map(jnp.copy, params), rep)
        s = jax.jit(opt.init, out_shardings=rep)(p)
        text = f.lower(p, s, batches[0]).compile().as_text()
        shape[v] = (text.count(" copy("), text.count(" conditional("))
        programs[v], states[v] = f, [p, s]

    def run(v, n):
        f, st = programs[v], states[v]
        for i in range(n):
            st[0], st[1], out = f(st[0], st[1], batches[i % len(batches)])
            float(out if v == "plain" else out[0])

    for v in VARIANTS:
        run(v, min(args.steps, 10))
    cpu = {v: [] for v in VARIANTS}
    wall = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            c0, w0 = time.process_time(), time.perf_counter()
            run(v, args.steps)
            cpu[v].append((time.process_time() - c0) / args.steps)
            wall[v].append((time.perf_counter() - w0) / args.steps)

    def ratio(times, v):
        rs = [a / b for a, b in zip(times[v], times["plain"], strict=True)]
        lo, hi = quartiles(rs)
        return f"{median(rs):.3f} [{lo:.3f}, {hi:.3f}]"

    print(
        f"mgkit {mg.__version__}, jax {jax.__version__}, {len(devices)} devices, model {args.model} {sizes}"
    )
    headers = ["variant", "copies", "conds", "cpu ms/step", "cpu / plain", "wall ms/step", "wall / plain"]
    body = [
        [
            v,
            str(shape[v][0]),
            str(shape[v][1]),
            f"{median(cpu[v]) * 1e3:.3f}",
            ratio(cpu, v),
            f"{median(wall[v]) * 1e3:.3f}",
            ratio(wall, v),
        ]
        for v in VARIANTS
    ]
    print(table(headers, body))


if __name__ == "__main__":
    main()
