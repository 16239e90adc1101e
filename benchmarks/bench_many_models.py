"""Many models at once: mg.Ensemble and mg.Pipeline against hand-written JAX doing the same work,
measured in the same run.

Usage::

    python benchmarks/bench_many_models.py [--steps 30] [--rounds 4] [--contexts "d0->cpu0;d1->cpu1"]

Without an accelerator the contexts are two simulated CPU devices (they share the host's cores,
so running side by side cannot be faster there: the ratios against the hand-written peers are
what this measures). On a GPU machine try ``--contexts "d0->cuda0;d1->cuda0"`` (two contexts on
one GPU) and ``--contexts "d0->cuda0;d1->cpu0"`` (a GPU and the CPU).

  (a) ensemble   two different MLPs (784-512-10 with Adam, batch 1024; 784-256-256-10 with SGD,
                 batch 512), one per context, ``--steps`` steps each:
                 mg.Ensemble.fit against (1) the members trained one after the other with
                 mg.Trainer, and (2) a hand-written loop that dispatches every member's jitted
                 step (donating its state) before it reads the losses of the round before.
                 Goal: ensemble / hand-written <= 1.05.
  (b) pipeline   an MLP 784-1024-1024 | 1024-1024-10 split over the two contexts, batch 1024,
                 M = 4 microbatches, optax.sgd: a Pipeline.fit step against a hand-written
                 jit + device_put GPipe step of the same stages (each microbatch forward
                 through both stages, then backward, the hops with jax.device_put, the
                 gradients summed, one update per stage; the loss read each step), with the
                 residuals kept (remat=False) and with the forward computed again in the
                 backward (remat=True); and against the whole model on one context (reported).
                 Goal: pipeline / hand-written <= 1.05.
  (c) bubble     the bubble fraction of Pipeline.schedule() for M = 1, 2, 4, 8 (the median over
                 the last steps), against GPipe's ideal (S-1)/(M+S-1); and what each stage keeps
                 between its forward and backward, with and without remat.

Variants run in ABBA order within each round; medians over rounds, and the median of per-round
ratios, are printed. Timings are reported, never asserted; exit status 0.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _stats import duration, median, table

import mgkit as mg


def parse_args(argv):
    p = argparse.ArgumentParser(description="mg.Ensemble and mg.Pipeline against hand-written JAX.")
    p.add_argument("--steps", type=int, default=30, help="steps per variant per round (default 30)")
    p.add_argument("--rounds", type=int, default=4, help="ABBA rounds (default 4)")
    p.add_argument(
        "--contexts", default=None, help='two contexts, e.g. "d0->cuda0;d1->cpu0" (default: two devices)'
    )
    p.add_argument("--bubble-steps", type=int, default=6, help="pipeline steps per M for (c) (default 6)")
    p.add_argument("--parts", default="abc", help="which parts to run, e.g. 'a' or 'bc' (default abc)")
    return p.parse_args(argv)


def _init(sizes, seed):
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def _mlp(layers, x):
    for i, p in enumerate(layers):
        x = x @ p["w"] + p["b"]
        if i < len(layers) - 1:
            x = jnp.tanh(x)
    return x


def _xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _loss(params, batch):
    return _xent(_mlp(params, batch[0]), batch[1])


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- (a) the ensemble --------------------------------------------------------------------------


class HandEnsemble:
    """The loop a careful user writes: per member a jitted step donating its state, batches
    taken in the same shuffled order from the same host arrays and placed with device_put,
    every member's step dispatched before the last round's losses are read."""

    def __init__(self, specs, devices, data):
        self.members = []
        for (sizes, opt, batch, seed), device in zip(specs, devices, strict=True):
            params = jax.device_put(_init(sizes, seed), device)
            params = jax.tree.map(jnp.copy, params)

            def step(p, o, b, opt=opt):
                loss, g = jax.value_and_grad(_loss)(p, b)
                u, o = opt.update(g, o, p)
                return optax.apply_updates(p, u), o, loss

            self.members.append(
                {
                    "params": params,
                    "opt": jax.jit(opt.init)(params),
                    "step": jax.jit(step, donate_argnums=(0, 1)),
                    "device": device,
                    "batch": batch,
                    "seed": seed,
                    "epoch": 0,
                    "index": 0,
                }
            )
        self.X, self.y = data

    def _next(self, m):
        n, want, parts = len(self.X), m["batch"], []
        while want:
            perm = np.random.default_rng([m["seed"], m["epoch"]]).permutation(n)
            take = perm[m["index"] : m["index"] + want]
            parts.append(take)
            want -= len(take)
            m["index"] += len(take)
            if m["index"] == n:
                m["epoch"], m["index"] = m["epoch"] + 1, 0
        idx = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return jax.device_put((self.X[idx], self.y[idx]), m["device"])

    def fit(self, steps):
        pending = []
        for _ in range(steps):
            now = []
            for m in self.members:
                m["params"], m["opt"], loss = m["step"](m["params"], m["opt"], self._next(m))
                now.append(loss)
            for loss in pending:
                float(loss)
            pending = now
        for loss in pending:
            float(loss)


def bench_ensemble(args, ctxs, devices, rows):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(rows, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=rows).astype(np.int32)
    specs = [([784, 512, 10], optax.adam(1e-3), 1024, 0), ([784, 256, 256, 10], optax.sgd(1e-2), 512, 1)]
    ens = mg.Ensemble(
        {
            ctx: mg.Member(_loss, opt, _init(sizes, seed), data=(X, y), batch_size=batch, seed=seed)
            for ctx, (sizes, opt, batch, seed) in zip(ctxs, specs, strict=True)
        }
    )
    trainers = [
        mg.Trainer(_loss, opt, _init(sizes, seed), contexts=[ctx], seed=seed)
        for ctx, (sizes, opt, batch, seed) in zip(ctxs, specs, strict=True)
    ]
    hand = HandEnsemble(specs, devices, (X, y))

    def one_after_the_other():
        for tr, (_, _, batch, _) in zip(trainers, specs, strict=True):
            tr.fit((X, y), steps=args.steps, batch_size=batch, progress=False)

    variants = {
        "mg.Ensemble": lambda: ens.fit(steps=args.steps, progress=False),
        "hand-written loop": lambda: hand.fit(args.steps),
        "one after the other (mg.Trainer)": one_after_the_other,
    }
    for fn in variants.values():  # compile
        fn()
    times = {k: [] for k in variants}
    order = list(variants)
    for r in range(args.rounds):
        for k in order if r % 2 == 0 else order[::-1]:
            times[k].append(_timed(variants[k]) / args.steps)
    return times, "hand-written loop"


# -- (b) the pipeline --------------------------------------------------------------------------


class HandPipeline:
    """A GPipe step written by hand with jit and device_put: per stage a jitted forward (with
    the vjp's residuals returned, or only the output when ``remat``) and a jitted backward
    that adds its gradient to the running sum; the hops with jax.device_put; one optax update
    per stage; the loss read each step."""

    def __init__(self, stages, devices, opt, m, remat):
        self.devices, self.opt, self.m, self.remat = devices, opt, m, remat
        self.params = [
            jax.tree.map(jnp.copy, jax.device_put(p, d)) for p, d in zip(stages, devices, strict=True)
        ]
        self.opts = [jax.jit(opt.init)(p) for p in self.params]
        self.trees = {}

        def f0(p, x):
            return _mlp_hidden(p, x)

        def f1(p, h, y, w):
            return w * _xent(_mlp(p, h), y)

        self.f = (f0, f1)
        if remat:
            self.fwd = (jax.jit(f0), jax.jit(f1))

            @functools.partial(jax.jit, donate_argnums=(3,))
            def b0(p, x, g, acc):
                _, back = jax.vjp(lambda p: f0(p, x), p)
                (gp,) = back(g)
                return gp if acc is None else jax.tree.map(jnp.add, acc, gp)

            @functools.partial(jax.jit, donate_argnums=(4,))
            def b1(p, h, y, w, acc):
                out, back = jax.vjp(lambda p, h: f1(p, h, y, w), p, h)
                gp, gh = back(jnp.ones_like(out))
                return (gp if acc is None else jax.tree.map(jnp.add, acc, gp)), gh

            self.bwd = (b0, b1)
        else:
            trees = self.trees

            def k0(p, x):
                out, back = jax.vjp(lambda p: f0(p, x), p)
                leaves, trees[0] = jax.tree.flatten(back)
                return out, leaves

            def k1(p, h, y, w):
                out, back = jax.vjp(lambda p, h: f1(p, h, y, w), p, h)
                leaves, trees[1] = jax.tree.flatten(back)
                return out, leaves

            self.fwd = (jax.jit(k0), jax.jit(k1))

            @functools.partial(jax.jit, donate_argnums=(2,), static_argnums=())
            def b0(leaves, g, acc):
                (gp,) = jax.tree.unflatten(trees[0], leaves)(g)
                return gp if acc is None else jax.tree.map(jnp.add, acc, gp)

            @functools.partial(jax.jit, donate_argnums=(1,))
            def b1(leaves, acc):
                gp, gh = jax.tree.unflatten(trees[1], leaves)(jnp.ones((), jnp.float32))
                return (gp if acc is None else jax.tree.map(jnp.add, acc, gp)), gh

            self.bwd = (b0, b1)

        def upd(p, o, g):
            u, o = opt.update(g, o, p)
            return optax.apply_updates(p, u), o

        self.upd = jax.jit(upd, donate_argnums=(0, 1))
        self.total = jax.jit(lambda ls: functools.reduce(jnp.add, ls))

    def step(self, X, y):
        d0, d1 = self.devices
        n, m = len(X), self.m
        sizes = [n // m + (i < n % m) for i in range(m)]
        bounds = np.cumsum([0, *sizes])
        xs = [jax.device_put(X[a:b], d0) for a, b in itertools.pairwise(bounds)]
        ys = [jax.device_put(y[a:b], d1) for a, b in itertools.pairwise(bounds)]
        ws = [np.float32(s / n) for s in sizes]
        p0, p1 = self.params
        saved0, saved1, losses = [], [], []
        for i in range(m):
            if self.remat:
                h = self.fwd[0](p0, xs[i])
                hh = jax.device_put(h, d1)
                losses.append(self.fwd[1](p1, hh, ys[i], ws[i]))
                saved0.append(xs[i])
                saved1.append(hh)
            else:
                h, r0 = self.fwd[0](p0, xs[i])
                hh = jax.device_put(h, d1)
                loss, r1 = self.fwd[1](p1, hh, ys[i], ws[i])
                losses.append(loss)
                saved0.append(r0)
                saved1.append(r1)
        acc0 = acc1 = None
        for i in reversed(range(m)):
            if self.remat:
                acc1, gh = self.bwd[1](p1, saved1[i], ys[i], ws[i], acc1)
                acc0 = self.bwd[0](p0, saved0[i], jax.device_put(gh, d0), acc0)
            else:
                acc1, gh = self.bwd[1](saved1[i], acc1)
                acc0 = self.bwd[0](saved0[i], jax.device_put(gh, d0), acc0)
        loss = self.total(losses)
        self.params[0], self.opts[0] = self.upd(p0, self.opts[0], acc0)
        self.params[1], self.opts[1] = self.upd(p1, self.opts[1], acc1)
        float(loss)
        jax.block_until_ready(self.params)


def _mlp_hidden(layers, x):
    for p in layers:
        x = jnp.tanh(x @ p["w"] + p["b"])
    return x


def _stage1(layers, h):
    return _mlp(layers, h)


def bench_pipeline(args, ctxs, devices, rows, width=1024, batch=1024):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(rows, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=rows).astype(np.int32)
    full = _init([784, width, width, width, 10], 2)
    s0, s1 = full[:2], full[2:]
    m = 4
    opt = optax.sgd(1e-3)
    pipes = {
        remat: mg.Pipeline(
            [(ctxs[0], _mlp_hidden, s0), (ctxs[1], _stage1, s1)], loss=_xent, microbatches=m, remat=remat
        )
        for remat in (False, True)
    }
    hands = {remat: HandPipeline((s0, s1), devices, opt, m, remat) for remat in (False, True)}
    one = mg.Trainer(_loss, opt, full, contexts=[ctxs[0]])
    order = np.random.default_rng(3).permutation(rows)
    batches = [(X[order[i : i + batch]], y[order[i : i + batch]]) for i in range(0, rows - batch + 1, batch)]

    def run_pipe(remat):
        def go():
            pipes[remat].fit(lambda step: batches[step % len(batches)], opt, steps=args.steps, progress=False)

        return go

    def run_hand(remat):
        def go():
            for s in range(args.steps):
                hands[remat].step(*batches[s % len(batches)])

        return go

    variants = {
        "mg.Pipeline": run_pipe(False),
        "hand-written jit + device_put": run_hand(False),
        "mg.Pipeline remat": run_pipe(True),
        "hand-written remat": run_hand(True),
        "one context (mg.Trainer)": lambda: one.fit(
            lambda step: batches[step % len(batches)], steps=args.steps, progress=False
        ),
    }
    for fn in variants.values():
        fn()
    times = {k: [] for k in variants}
    keys = list(variants)
    for r in range(args.rounds):
        for k in keys if r % 2 == 0 else keys[::-1]:
            times[k].append(_timed(variants[k]) / args.steps)
    kept = {remat: pipes[remat].kept_bytes for remat in (False, True)}
    return times, kept


def bench_bubble(args, ctxs, rows, width=1024, batch=1024, ms=(1, 2, 4, 8)):
    rng = np.random.default_rng(4)
    X = rng.normal(size=(rows, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=rows).astype(np.int32)
    full = _init([784, width, width, width, 10], 5)
    out = []
    for m in ms:
        pipe = mg.Pipeline(
            [(ctxs[0], _mlp_hidden, full[:2]), (ctxs[1], _stage1, full[2:])], loss=_xent, microbatches=m
        )
        bubbles = []
        for s in range(args.bubble_steps):
            pipe.fit((X[:batch], y[:batch]), optax.sgd(1e-3), steps=1, batch_size=batch, progress=False)
            if s >= 1:  # the first step compiles
                bubbles.append(pipe.schedule(widget=False).bubble)
        out.append((m, median(bubbles), 1 / (m + 1)))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    mg.simulate(2)  # CPU devices only; with a GPU, the default contexts are on it
    spec = args.contexts or "d0->cpu0;d1->cpu1"
    if args.contexts is None and any(d.platform == "gpu" for d in jax.devices()):
        spec = "d0->cuda0;d1->cuda0"
    cmap = mg.use_contexts(spec, verbose=False)
    ctxs = list(cmap.names)[:2]
    devices = [mg.device_of(c) for c in ctxs]
    print(
        f"mgkit {mg.__version__}, jax {jax.__version__}; contexts {spec}; devices {[str(d) for d in devices]}"
    )
    print(f"steps per variant per round {args.steps}, rounds {args.rounds}")
    rows = 8192

    if "a" in args.parts:
        report_ensemble(args, ctxs, devices, rows)
    if "b" in args.parts:
        report_pipeline(args, ctxs, devices, rows)
    if "c" in args.parts:
        print("\n(c) bubble fraction of the schedule (median over steps after the first), S = 2")
        rows_out = [[str(m), f"{b:.3f}", f"{i:.3f}"] for m, b, i in bench_bubble(args, ctxs, rows)]
        print(table(["M", "measured", "ideal (S-1)/(M+S-1)"], rows_out))
    return 0


def report_ensemble(args, ctxs, devices, rows) -> None:
    times, peer = bench_ensemble(args, ctxs, devices, rows)
    print("\n(a) ensemble: two different MLPs, one per context; time per round of one step each")
    base = median(times[peer])
    rows_out = []
    for k, ts in times.items():
        ratios = [t / p for t, p in zip(ts, times[peer], strict=True)]
        rows_out.append([k, duration(median(ts)), f"{median(ratios):.3f}x", f"{median(ts) / base:.3f}x"])
    print(table(["variant", "per step", "vs hand-written (median of rounds)", "ratio of medians"], rows_out))
    print("goal: mg.Ensemble <= 1.05x the hand-written loop")


def report_pipeline(args, ctxs, devices, rows) -> None:
    times, kept = bench_pipeline(args, ctxs, devices, rows)
    print("\n(b) pipeline: MLP 784-1024-1024 | 1024-1024-10, batch 1024, M = 4; time per training step")
    rows_out = []
    pairs = {"mg.Pipeline": "hand-written jit + device_put", "mg.Pipeline remat": "hand-written remat"}
    for k, ts in times.items():
        peer = pairs.get(k, "hand-written jit + device_put")
        ratios = [t / p for t, p in zip(ts, times[peer], strict=True)]
        rows_out.append([k, duration(median(ts)), f"{median(ratios):.3f}x vs {peer}"])
    print(table(["variant", "per step", "ratio (median of rounds)"], rows_out))
    print("goal: mg.Pipeline <= 1.05x the hand-written pipeline (remat against remat)")
    print(
        "kept between forward and backward per stage (bytes): "
        f"remat=False {list(kept[False])}, remat=True {list(kept[True])}"
    )


if __name__ == "__main__":
    sys.exit(main())
