"""Every figure mgkit claims for accelerators, in one command, appended to benchmarks/RESULTS.md.

Usage::

    python benchmarks/gpu_suite.py [--out FILE] [--dry-run]

On a machine with a GPU it runs, in order, each part with its own time budget (the whole run
stays under 8 minutes on one H100), printing ``[3/11] trainer on cuda0 ... 41.2 s`` as it goes:

  transfers            mg.put / mg.transfer against jax.device_put (``bench_transfer.py``)
  make_parallel, pmap  ``bench_parallel.py``'s (a)-(c); mg.pmap against jit of a shard_map
  logistic regression  ``gpu_logreg.py``'s cases: the copy bandwidth, 100,000 x 100 against
                       scikit-learn, Theano's recipe on 8 contexts sharing the GPU, GPU + CPU, parity
  trainer              MLP 784-256-10 at batch 256 and 16,384 against a hand-written step
                       (``bench_train.py``), on ``cuda0`` and on ``a->cuda0;b->cpu0``
  mixed precision      samples/s of ``fit(precision="bf16")`` and ``"fp16"`` against
                       ``"fp32"``, MLP 1024-4096-4096-10 at batch 8,192 on ``cuda0``
  ensemble, pipeline   against their hand-written peers, with the measured bubble
                       (``bench_many_models.py``), on two contexts sharing ``cuda0`` and on GPU + CPU
  launch               ``mg.launch`` of one rank on the GPU against a bare JAX process's start-up
  dashboard memory     the device map's memory in use against the allocator's own figure
  cluster              ``mg.Cluster`` of one engine on the GPU (its own ``CUDA_VISIBLE_DEVICES``):
                       the start against a bare JAX process's, a second identical fit cell against
                       the first

It then appends a dated section to RESULTS.md (or ``--out FILE``): the device, jax, jaxlib and
Python versions, and a Markdown table per part. Ctrl-C, a part's exception or a part past its
budget still writes what was measured, naming the part that did not finish. ``--dry-run`` takes
the same code paths on CPU devices at tiny sizes (contexts naming ``cuda0`` get ``cpu0``, those
naming ``cpu0`` get ``cpu1``); without a GPU and without ``--dry-run`` it exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import itertools
import platform
import signal
import sys
import time
import warnings
from argparse import Namespace
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import bench_launch
import bench_many_models
import bench_parallel
import bench_plan
import bench_train
import bench_transfer
import gpu_logreg
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _stats import duration, median
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mgkit as mg

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
TOTAL_SECONDS = 470.0  # every part's budget is cut to what is left of this
CPU_DEVICES = 4  # the CPU devices JAX is given (the dry run's stand-ins included)


class Row(NamedTuple):
    """One measured figure of a part, as its table shows it."""

    name: str  # what was measured
    mgkit: str  # mgkit's figure, with its unit
    peer: str  # the peer's figure, with its unit ("-" where there is none)
    ratio: str  # mgkit / peer ("-" where there is none)
    note: str  # what the peer is, or how to read the figures


class Sizes(NamedTuple):
    """How much work each part does."""

    transfer_mib: float  # array size of the transfers
    transfer_seconds: float  # bench_transfer's budget for its timed loops
    parallel_seconds: float  # bench_parallel's budget for its timed loops
    parallel_rows: int  # rows of the sharded MLP's batch
    parallel_gemm: int  # side of the sgemm's matrices
    pmap_width: int  # values per context in the pmap case
    logreg_rows: int  # rows of the one-model fit (100,000 on a GPU)
    logreg_features: int  # its features
    logreg_repeats: int  # warm fits timed per solver
    copy_gib: float  # array size of the copy-bandwidth yardstick
    seed_rows: int  # rows per model of Theano's recipe (8 models)
    seed_features: int  # features per model of Theano's recipe
    train_batches: tuple[int, ...]  # the trainer's batch sizes
    train_steps: int  # steps per variant per round
    train_rounds: int  # ABBA rounds
    mixed_steps: int  # steps per variant per round on GPU + CPU
    many_steps: int  # ensemble and pipeline steps per variant per round
    many_rounds: int  # their ABBA rounds
    many_rows: int  # rows of their synthetic data
    pipe_width: int  # the pipeline's hidden width
    pipe_batch: int  # the pipeline's batch
    bubble_steps: int  # pipeline steps per microbatch count for the bubble
    bubble_ms: tuple[int, ...]  # the microbatch counts whose bubble is measured
    launch_repeats: int  # launches (and bare starts) timed
    dashboard_mib: float  # the array put on the GPU for the memory figures
    precision_width: int  # hidden width of the mixed-precision MLP
    precision_batch: int  # its batch
    precision_steps: int  # its steps per variant per round
    cluster_steps: int  # steps of the cluster's fit cell


GPU_SIZES = Sizes(
    transfer_mib=64, transfer_seconds=12, parallel_seconds=20, parallel_rows=65536, parallel_gemm=4096,
    pmap_width=1 << 20, logreg_rows=100_000, logreg_features=100, logreg_repeats=20, copy_gib=1.0,
    seed_rows=400, seed_features=784, train_batches=(256, 16384), train_steps=100, train_rounds=4,
    mixed_steps=10, many_steps=10, many_rounds=2, many_rows=8192, pipe_width=1024, pipe_batch=1024,
    bubble_steps=3, bubble_ms=(1, 2, 4, 8), launch_repeats=2, dashboard_mib=256,
    precision_width=4096, precision_batch=8192, precision_steps=20, cluster_steps=50,
)  # fmt: skip
DRY_SIZES = Sizes(
    transfer_mib=0.25, transfer_seconds=0.3, parallel_seconds=0.3, parallel_rows=256, parallel_gemm=64,
    pmap_width=64, logreg_rows=500, logreg_features=10, logreg_repeats=2, copy_gib=1 / 64,
    seed_rows=40, seed_features=20, train_batches=(32, 128), train_steps=2, train_rounds=2,
    mixed_steps=2, many_steps=1, many_rounds=2, many_rows=1024, pipe_width=32, pipe_batch=64,
    bubble_steps=2, bubble_ms=(2, 4), launch_repeats=1, dashboard_mib=1,
    precision_width=32, precision_batch=64, precision_steps=2, cluster_steps=3,
)  # fmt: skip


class Setup(NamedTuple):
    """What every part is given."""

    gpu: str  # the device standing for the GPU: cuda0, or cpu0 in a dry run
    kind: str  # that device's kind, as JAX names it (NVIDIA H100 80GB HBM3)
    host: str  # the CPU device next to it: cpu0, or cpu1 in a dry run
    dry: bool  # True: CPU devices at tiny sizes
    sizes: Sizes  # how much work each part does


class Part(NamedTuple):
    """A named piece of the suite: ``run(setup, rows)`` appends its figures to ``rows``."""

    title: str  # its heading, with {gpu} and {host} for the devices' names
    run: Callable[[Setup, list[Row]], None]  # does the measuring
    budget: float  # seconds it may take on one H100


class Outcome(NamedTuple):
    """What one part left behind."""

    title: str  # its heading, devices named
    rows: list[Row]  # the figures it measured (also those before a failure)
    seconds: float  # how long it ran
    error: str | None  # why it did not finish (None: it did)


INTERRUPTED = "interrupted (Ctrl-C)"  # a part's error when Ctrl-C stopped it


class OverBudgetError(Exception):
    """A part ran past its time budget."""


def vs(name: str, mine: float, peer: float, note: str) -> Row:
    """A row comparing two times in seconds."""
    return Row(name, duration(mine), duration(peer), f"{mine / peer:.3f}", note)


def in_bytes(name: str, mine: int, peer: int, note: str) -> Row:
    """A row comparing two byte counts."""
    return Row(name, f"{mine:,} B", f"{peer:,} B", f"{mine / peer:.3f}", note)


def figure(name: str, mine: str, note: str = "") -> Row:
    """A row with mgkit's figure alone."""
    return Row(name, mine, "-", "-", note)


# -- transfers, make_parallel, pmap ------------------------------------------------------------


def transfers(setup: Setup, rows: list[Row]) -> None:
    s = setup.sizes
    mg.use_contexts(f"dev0->{setup.gpu};dev1->{setup.host}", verbose=False)
    args = Namespace(mib=s.transfer_mib, repeats=None, seconds=s.transfer_seconds)
    bench = bench_transfer.Bench(args, mg.device_of("dev0"), mg.device_of("dev1"))
    cases = (
        (bench.host_to_device, f"host -> {setup.gpu}", "mg.put vs jax.device_put"),
        (bench.device_to_device, f"{setup.gpu} -> {setup.host}", "mg.transfer vs jax.device_put"),
        (bench.device_to_host, f"{setup.gpu} -> host", "mg.transfer(x, 'cpu') vs np.asarray(jax.device_get)"),
    )
    for case, name, peer in cases:
        r = case()
        gbps = r.nbytes / median(r.mg) / 1e9
        note = f"{peer}; {r.nbytes / 2**20:g} MiB, mgkit {gbps:.2f} GB/s, {len(r.mg)} pairs {r.note}"
        rows.append(vs(name, median(r.mg), median(r.jx), note.strip()))


def parallel_ops(setup: Setup, rows: list[Row]) -> None:
    s = setup.sizes
    mg.use_contexts(f"d0->{setup.gpu}", verbose=False)
    devices = [mg.device_of("d0")]
    args = Namespace(
        seconds=s.parallel_seconds, repeats=None, rows=s.parallel_rows, features=256, gemm=s.parallel_gemm
    )
    bench = bench_parallel.Bench(args, ["d0"], devices)
    tiny, _, _ = bench.tiny()
    compared = [bench.large_batch(), tiny, *bench.sgemm()[0]]
    for r in compared:
        mine, peer = median(r.mg.times), median(r.peer.times)
        rows.append(vs(r.case, mine, peer, f"{r.mg.label} vs {r.peer.label}; {r.rounds} rounds"))
    rows.append(pmap_row(setup, devices))


def pmap_row(setup: Setup, devices: list) -> Row:
    """mg.pmap of a psum and a tanh against jit of the same shard_map, from the host."""
    width = setup.sizes.pmap_width
    x = np.random.default_rng(0).random((len(devices), width), dtype=np.float32)

    def f(v):
        return jnp.tanh(v) + jax.lax.psum(v, "i")

    split = NamedSharding(Mesh(np.array(devices), ("i",)), P("i"))
    peer = jax.jit(jax.shard_map(f, mesh=split.mesh, in_specs=P("i"), out_specs=P("i")))
    mine = mg.pmap(f, axis_name="i")
    same = np.allclose(np.asarray(mine(x)), np.asarray(peer(jax.device_put(x, split))), rtol=1e-5)
    variants = [
        bench_parallel.Variant("mg.pmap", lambda: mine(x)),
        bench_parallel.Variant("jit(shard_map)", lambda: peer(jax.device_put(x, split))),
    ]
    args = Namespace(seconds=setup.sizes.parallel_seconds, repeats=None)
    rounds = bench_parallel._run_case(args, "b", variants)
    note = f"vs device_put + jit(shard_map) of the same f; {width:,} floats; equal: {same}; {rounds} rounds"
    return vs("mg.pmap(tanh + psum)", median(variants[0].times), median(variants[1].times), note)


# -- logistic regression -----------------------------------------------------------------------


def logreg(setup: Setup, rows: list[Row]) -> None:
    from sklearn.linear_model import LogisticRegression

    lr, s = mg.logreg, setup.sizes
    mg.use_contexts(f"dev0->{setup.gpu};host0->{setup.host}", verbose=False)
    bw = gpu_logreg.copy_bandwidth(mg.device_of("dev0"), s.copy_gib)
    rows.append(figure(f"copy on {setup.gpu}", f"{bw:.0f} GB/s", "read + write: the bound below"))
    n, d = s.logreg_rows, s.logreg_features
    rng = np.random.default_rng(0)
    X = rng.standard_normal((n, d)).astype(np.float32)
    y = (X @ (rng.standard_normal(d) / 3) + rng.standard_normal(n) > 0).astype(np.int32)
    Xd, yd = mg.put(X, "dev0"), mg.put(y, "dev0")
    sk_s = gpu_logreg.median_seconds(lambda: LogisticRegression(C=1.0).fit(X, y), 3)
    for solver, passes in (("newton", 3), ("lbfgs", 2)):

        def fit(solver=solver):
            return lr.fit(Xd, yd, solver=solver, contexts=["dev0"], progress=False)

        seconds = gpu_logreg.median_seconds(fit, s.logreg_repeats)
        its = int(fit().info.iterations)
        share = passes * X.nbytes * its / seconds / 1e9 / bw
        note = f"vs scikit-learn lbfgs on the host; {its} iterations, {n * its / seconds:.3g} samples/s, "
        rows.append(vs(f"{n:,} x {d} {solver}", seconds, sk_s, note + f"{share:.3f} of the copy bandwidth"))
    theano_recipe(setup, rows)
    models = lr.fit_per_device(
        {c: (X[: s.seed_rows], y[: s.seed_rows]) for c in ("dev0", "host0")}, l2=0.01, progress=False
    )
    where = ", ".join(f"{mg.where(m.w)} {int(m.info.iterations)} its" for m in models.values())
    rows.append(figure(f"fit_per_device on {setup.gpu} + {setup.host}", where, "one model per context"))
    parity(rows)


def theano_recipe(setup: Setup, rows: list[Row]) -> None:
    """8 models on 8 contexts sharing the GPU, against a scikit-learn loop on the host."""
    from sklearn.linear_model import LogisticRegression

    s, rng = setup.sizes, np.random.default_rng(1)
    shape = (s.seed_rows, s.seed_features)
    seeds = [
        (rng.standard_normal(shape).astype(np.float32), rng.integers(0, 2, s.seed_rows)) for _ in range(8)
    ]
    C = 1 / (2 * 0.01 * s.seed_rows)
    sk_s = gpu_logreg.median_seconds(
        lambda: [LogisticRegression(C=C, max_iter=1000).fit(Xi, yi) for Xi, yi in seeds], 3
    )
    mg.use_contexts(";".join(f"m{i}->{setup.gpu}" for i in range(8)), verbose=False)
    placed = {f"m{i}": mg.put(xy, f"m{i}") for i, xy in enumerate(seeds)}
    for solver in ("auto", "newton", "lbfgs"):
        seconds = gpu_logreg.median_seconds(
            lambda solver=solver: mg.logreg.fit_per_device(placed, l2=0.01, solver=solver, progress=False), 10
        )
        rows.append(
            vs(f"Theano recipe, 8 x {shape[0]} x {shape[1]}, {solver}", seconds, sk_s, "vs scikit-learn loop")
        )
    mg.use_contexts(f"dev0->{setup.gpu};host0->{setup.host}", verbose=False)


def parity(rows: list[Row]) -> None:
    """load_breast_cancer on dev0: mgkit's objective against scikit-learn's default fit's."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    lr = mg.logreg
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X).astype(np.float32)
    sk = LogisticRegression(C=1).fit(X, y)
    l2 = 1 / (2 * len(X))
    theirs = lr.objective(lr.Model(sk.coef_[0], sk.intercept_[0], sk.classes_, None), X, y, l2)
    for solver in ("newton", "lbfgs"):
        ours = lr.objective(lr.fit(X, y, solver=solver, contexts=["dev0"], progress=False), X, y, l2)
        note = "objective vs scikit-learn's default fit (goal: ratio <= 1 + 1e-4)"
        ratio = f"{ours / theirs:.6f}"
        rows.append(Row(f"parity, breast cancer, {solver}", f"{ours:.8f}", f"{theirs:.8f}", ratio, note))


# -- training ----------------------------------------------------------------------------------


def trainer(spec: str) -> Callable[[Setup, list[Row]], None]:
    """The trainer part on the context map ``spec`` ({gpu} and {host} filled in)."""

    def run(setup: Setup, rows: list[Row]) -> None:
        s = setup.sizes
        cmap = mg.use_contexts(spec.format(gpu=setup.gpu, host=setup.host), verbose=False)
        devices = list(dict.fromkeys(mg.device_of(c) for c in cmap.names))
        mixed = len({d.platform for d in devices}) > 1
        peer_devices = devices[:1] if mixed else devices
        rng = np.random.default_rng(0)
        n = 2 * max(s.train_batches)
        data = {
            "x": rng.normal(size=(n, 784)).astype(np.float32),
            "y": rng.integers(0, 10, n).astype(np.int32),
        }
        params, opt = bench_train.mlp_init(jax.random.key(0)), optax.adamw(1e-3)
        args = Namespace(steps=s.mixed_steps if mixed else s.train_steps, rounds=s.train_rounds)
        peer_name = "+".join(str(d) for d in peer_devices)
        for batch, goal in zip(s.train_batches, (1.05, 1.03), strict=True):
            tr = mg.Trainer(bench_train.loss_fn, opt, params)
            peer = bench_train.Peer(params, opt, peer_devices, data, batch)

            def fit(steps, tr=tr, batch=batch):
                tr.fit(data, steps=steps, batch_size=batch, progress=False)

            _, med = bench_train.compare(f"batch {batch}", {"mgkit": fit, "peer": peer.run}, args, goal)
            note = (
                f"hand-written jit step on {peer_name}; per step {duration(med['mgkit'])} vs "
                f"{duration(med['peer'])}; goal <= {goal}"
            )
            ratio = f"{med['mgkit'] / med['peer']:.3f}"
            rows.append(
                Row(f"MLP 784-256-10, batch {batch:,}", f"{batch / med['mgkit']:,.0f} samples/s",
                    f"{batch / med['peer']:,.0f} samples/s", ratio, note)
            )  # fmt: skip

    return run


def _wide_loss(params, batch):
    h = batch["x"]
    for w in params[:-1]:
        h = jax.nn.gelu(h @ w)
    return optax.softmax_cross_entropy_with_integer_labels(h @ params[-1], batch["y"]).mean()


def mixed_precision(setup: Setup, rows: list[Row]) -> None:
    """Samples/s of bf16 and fp16 fits against fp32's, same model, data and batch (ABBA rounds)."""
    s = setup.sizes
    mg.use_contexts(f"d0->{setup.gpu}", verbose=False)
    width, batch = s.precision_width, s.precision_batch
    widths = [1024, width, width, 10]
    keys = jax.random.split(jax.random.key(0), len(widths) - 1)
    shapes = itertools.pairwise(widths)
    params = [jax.random.normal(k, (a, b)) / np.sqrt(a) for k, (a, b) in zip(keys, shapes, strict=True)]
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(2 * batch, 1024)).astype(np.float32), "y": rng.integers(0, 10, 2 * batch)}
    args = Namespace(steps=s.precision_steps, rounds=s.train_rounds)

    def fitter(name: str) -> Callable[[int], None]:
        tr = mg.Trainer(_wide_loss, optax.adamw(1e-4), params)

        def fit(steps: int) -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", mg.PrecisionWarning)  # the dry run's CPU
                tr.fit(data, steps=steps, batch_size=batch, precision=name, progress=False)

        return fit

    fp32 = fitter("fp32")
    for low in ("bf16", "fp16"):
        fits = {low: fitter(low), "fp32": fp32}
        _, med = bench_train.compare(low, fits, args, float("inf"))
        mine, peer = batch / med[low], batch / med["fp32"]
        note = f"ratio: {low} samples/s over fp32's; per step {duration(med[low])} vs {duration(med['fp32'])}"
        rows.append(
            Row(f"MLP 1024-{width}-{width}-10, batch {batch:,}, {low}", f"{mine:,.0f} samples/s",
                f"{peer:,.0f} samples/s", f"{mine / peer:.3f}", note)
        )  # fmt: skip


def _two_contexts(setup: Setup, spec: str, mixed: bool) -> tuple[list[str], list, Namespace]:
    """The two contexts of ``spec``, their devices, and bench_many_models' arguments."""
    s = setup.sizes
    ctxs = list(mg.use_contexts(spec.format(gpu=setup.gpu, host=setup.host), verbose=False).names)[:2]
    steps = min(s.many_steps, s.mixed_steps) if mixed else s.many_steps
    args = Namespace(steps=steps, rounds=s.many_rounds, bubble_steps=s.bubble_steps)
    return ctxs, [mg.device_of(c) for c in ctxs], args


def _time_rows(times: dict[str, list[float]], peers: dict[str, str], default: str) -> list[Row]:
    """A row per variant: its median time per step against its peer's, the paired median ratio."""
    out = []
    for k, ts in times.items():
        peer = peers.get(k, default)
        if k == peer:
            continue
        ratios = [t / p for t, p in zip(ts, times[peer], strict=True)]
        out.append(
            Row(k, duration(median(ts)), duration(median(times[peer])), f"{median(ratios):.3f}",
                f"per step, vs {peer} (median of per-round ratios)")
        )  # fmt: skip
    return out


def ensemble(spec: str, mixed: bool) -> Callable[[Setup, list[Row]], None]:
    def run(setup: Setup, rows: list[Row]) -> None:
        ctxs, devices, args = _two_contexts(setup, spec, mixed)
        times, peer = bench_many_models.bench_ensemble(args, ctxs, devices, setup.sizes.many_rows)
        rows.extend(_time_rows(times, {}, peer))

    return run


def pipeline(spec: str, mixed: bool) -> Callable[[Setup, list[Row]], None]:
    def run(setup: Setup, rows: list[Row]) -> None:
        s = setup.sizes
        ctxs, devices, args = _two_contexts(setup, spec, mixed)
        times, kept = bench_many_models.bench_pipeline(
            args, ctxs, devices, s.many_rows, width=s.pipe_width, batch=s.pipe_batch
        )
        hand = "hand-written jit + device_put"
        rows.extend(_time_rows(times, {"mg.Pipeline remat": "hand-written remat"}, hand))
        for remat, per_stage in kept.items():
            rows.append(figure(f"kept per stage, remat={remat}", " / ".join(f"{b:,} B" for b in per_stage)))
        for m, bubble, ideal in bench_many_models.bench_bubble(
            args, ctxs, s.many_rows, width=s.pipe_width, batch=s.pipe_batch, ms=s.bubble_ms
        ):
            rows.append(Row(f"bubble, M = {m}", f"{bubble:.3f}", f"{ideal:.3f}", f"{bubble / ideal:.2f}",
                            "measured vs GPipe's ideal (S-1)/(M+S-1), S = 2"))  # fmt: skip

    return run


# -- launch, dashboard ---------------------------------------------------------------------------


def _rank_device(rank, shared, private):
    import jax

    return jax.devices()[0].platform


def launch(setup: Setup, rows: list[Row]) -> None:
    """mg.launch of one rank (on the GPU where there is one) against a bare JAX process."""
    platforms = "cpu" if setup.dry else None
    peers, ready, whole, where = [], [], [], []
    for i in range(setup.sizes.launch_repeats):
        if i % 2 == 0:
            peers.append(bench_launch.peer_startup(1, platforms))
        t0 = time.perf_counter()
        res = mg.launch(_rank_device, nprocs=1, stream=False)
        whole.append(time.perf_counter() - t0)
        ready.append(res.ranks[0].ready_seconds)
        where.append(res.values[0])
        if i % 2 == 1:
            peers.append(bench_launch.peer_startup(1, platforms))
    peer = median(peers)
    rows.append(vs("mg.launch, 1 rank: ready", median(ready), peer, f"rank's devices: {where[0]}"))
    bare = "vs python -c 'import jax; jax.devices()'"
    rows.append(vs("mg.launch, 1 rank: whole call", median(whole), peer, bare))


_CLUSTER_CELL = """
import jax.numpy as jnp, numpy as np, optax, mgkit as mg
rng = np.random.default_rng(0)
data = {"x": rng.normal(size=(4096, 256)).astype(np.float32), "y": rng.integers(0, 10, 4096)}
def loss(p, b):
    logits = jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
params = {"w1": jnp.zeros((256, 512)) + 0.01, "w2": jnp.zeros((512, 10))}
tr = mg.Trainer(loss, optax.adam(1e-3), params)
"""


def _rank_where(rank, shared, private):
    import os

    import jax

    return jax.devices()[0].platform, os.environ.get("CUDA_VISIBLE_DEVICES", "-")


def cluster(setup: Setup, rows: list[Row]) -> None:
    """A warm rank: mg.Cluster of one engine (its own CUDA_VISIBLE_DEVICES), the start against a
    bare JAX process's, and a second identical fit cell against the first (compiles nothing)."""
    peer = bench_launch.peer_startup(1, "cpu" if setup.dry else None)
    c = mg.Cluster(engines=1, devices_per_engine=1, stream=False)
    try:
        rows.append(vs("mg.Cluster, 1 engine: start", c.start_seconds, peer, "vs a bare JAX process's start"))
        c.run_cell(_CLUSTER_CELL)
        where = c.run(_rank_where)[0]
        rows.append(figure("the rank's device", f"{where[0]}, CUDA_VISIBLE_DEVICES={where[1]}"))
        c.compilations()
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            c.run_cell(f"tr.fit(data, steps={setup.sizes.cluster_steps}, batch_size=256, progress=False)")
            times.append(time.perf_counter() - t0)
        before = c.compilations()[0]
        c.run_cell(f"tr.fit(data, steps={setup.sizes.cluster_steps}, batch_size=256, progress=False)")
        again = c.compilations()[0] - before
        note = f"{setup.sizes.cluster_steps} steps a cell; the third compiled {again} program(s)"
        rows.append(vs("warm cell: second fit vs first", times[1], times[0], note))
    finally:
        c.close()


def dashboard_memory(setup: Setup, rows: list[Row]) -> None:
    """The dashboard's memory in use for the GPU's context, against the allocator's own figure
    (on CPU devices, which report none: the live arrays' bytes)."""
    mg.use_contexts(f"dev0->{setup.gpu}", verbose=False)
    device = mg.device_of("dev0")

    def truth() -> int:
        stats = device.memory_stats() or {}
        if "bytes_in_use" in stats:
            return stats["bytes_in_use"]
        return sum(a.nbytes for a in jax.live_arrays() if a.sharding.device_set == {device})

    dash = mg.Dashboard(widget=False)
    try:
        before = dash.devices.rows()[0]
        x = mg.put(np.ones(int(setup.sizes.dashboard_mib * 2**18), np.float32), "dev0").block_until_ready()
        after, now = dash.devices.rows()[0], truth()
        t0 = time.perf_counter()
        reads = [dash.devices.rows() for _ in range(20)]
        per_read = (time.perf_counter() - t0) / len(reads)
    finally:
        dash.close()
    note = f"source: {after.source}; limit {after.limit}; peer: memory_stats() (CPU: live arrays)"
    rows.append(in_bytes(f"in use after a {x.nbytes / 2**20:g} MiB put", after.used, now, note))
    rows.append(in_bytes("growth from the put", after.used - before.used, x.nbytes, "vs the array's bytes"))
    rows.append(figure("one read of the device map", duration(per_read), "20 reads"))


# -- a step planned ahead of time, and a scaling study ---------------------------------------


def planning(setup: Setup, rows: list[Row]) -> None:
    """tr.plan's peak and predicted step against the step run on {gpu}; then mg.scaling of the
    same step on {gpu} alone and on {gpu} + {host}."""
    s = setup.sizes
    mg.use_contexts(f"d0->{setup.gpu};d1->{setup.host}", verbose=False)
    width = min(s.precision_width, 2048)
    init, loss = bench_plan.mlp(width)
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(256, width)).astype(np.float32),
        "y": rng.normal(size=(256, 1)).astype(np.float32),
    }
    tr = mg.Trainer(loss, optax.adam(1e-3), init(), contexts=1)
    planned = tr.plan(batch)
    row = planned.rows()[0]
    step = bench_plan.measured(tr, batch, s.train_steps)
    used = bench_plan.running_peak(tr)
    stats = mg.device_of("d0").memory_stats() if not setup.dry else None
    allocator = (stats or {}).get("peak_bytes_in_use")
    note = "memory_analysis of the program the fit ran" + (
        "" if allocator is None else f"; the allocator's peak after the fit {allocator:,} B"
    )
    rows.append(in_bytes(f"planned peak, MLP {width}-{width}-{width}-1", row.peak, used or row.peak, note))
    rows.append(
        vs(
            "predicted step vs measured",
            row.seconds,
            step,
            f"{planned.figures.source}; bound: {row.predicted.bound}",
        )
    )
    study = mg.scaling(
        lambda n: mg.Trainer(loss, optax.adam(1e-3), init(), contexts=n),
        batch,
        contexts=[1, 2],
        steps=s.train_steps,
    )
    one, two = study.rows()
    note = f"1 context {one.samples_per_second:,.0f} samples/s; {study.verdict}"
    rows.append(
        figure(f"mg.scaling: {setup.gpu} alone -> {setup.gpu} + {setup.host}", f"{two.efficiency:.0%}", note)
    )


# -- the suite ---------------------------------------------------------------------------------

SHARED = "d0->{gpu};d1->{gpu}"
MIXED = "d0->{gpu};d1->{host}"
PARTS = [
    Part("transfers: host <-> {gpu}", transfers, 30),
    Part("make_parallel and pmap on {gpu}", parallel_ops, 45),
    Part("logistic regression on {gpu}", logreg, 60),
    Part("trainer on {gpu}", trainer("d0->{gpu}"), 50),
    Part("trainer on a->{gpu};b->{host}", trainer("a->{gpu};b->{host}"), 45),
    Part("mixed precision on {gpu}", mixed_precision, 30),
    Part("ensemble on two contexts sharing {gpu}", ensemble(SHARED, False), 30),
    Part("ensemble on {gpu} + {host}", ensemble(MIXED, True), 30),
    Part("pipeline on two contexts sharing {gpu}", pipeline(SHARED, False), 45),
    Part("pipeline on {gpu} + {host}", pipeline(MIXED, True), 55),
    Part("mg.launch of one rank on {gpu}", launch, 30),
    Part("dashboard memory on {gpu}", dashboard_memory, 15),
    Part("mg.Cluster of one engine on {gpu}", cluster, 45),
    Part("step plan and scaling on {gpu} (+ {host})", planning, 45),
]


@contextmanager
def budget(seconds: float):
    """Raises OverBudgetError in the main thread once ``seconds`` have passed."""

    def expire(signum, frame):
        raise OverBudgetError(f"ran past its budget of {seconds:.3g} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_part(setup: Setup, part: Part, step: str, seconds: float) -> Outcome:
    """Runs one part within ``seconds``, announcing it as ``step`` (``[3/11]``); the rows it
    measured survive its exception, its budget running out and Ctrl-C (the outcome's error
    then says which)."""
    rows: list[Row] = []
    title = part.title.format(gpu=setup.gpu, host=setup.host)
    t0 = time.perf_counter()
    try:
        print(f"{step} {title} ...", flush=True)
        with budget(seconds):
            part.run(setup, rows)
        error = None
    except KeyboardInterrupt:
        error = INTERRUPTED
    except Exception as e:  # noqa: BLE001 - the suite goes on and reports it
        error = f"{type(e).__name__}: {e}"
    done = Outcome(title, rows, time.perf_counter() - t0, error)
    print(f"{step} {title} ... {done.seconds:.1f} s" + (f": {error}" if error else ""), flush=True)
    return done


def run_parts(setup: Setup, parts: list[Part]) -> tuple[list[Outcome], bool]:
    """Runs the parts in order, printing progress, each within its budget and what is left of
    TOTAL_SECONDS; returns their outcomes and whether Ctrl-C stopped the run."""
    outcomes: list[Outcome] = []
    start = time.perf_counter()
    try:
        for i, part in enumerate(parts, 1):
            left = TOTAL_SECONDS - (time.perf_counter() - start)
            outcomes.append(run_part(setup, part, f"[{i}/{len(parts)}]", min(part.budget, left)))
            if outcomes[-1].error == INTERRUPTED:
                return outcomes, True
            mg.ledger().clear()
    except KeyboardInterrupt:  # between two parts
        return outcomes, True
    return outcomes, False


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def section(setup: Setup, outcomes: list[Outcome], parts: list[Part], argv: list[str]) -> str:
    """The Markdown section: a dated heading naming the device and versions, a table per part."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    head = (
        f"## GPU checks, {now}: {setup.kind}, jax {jax.__version__}, "
        f"jaxlib {importlib.metadata.version('jaxlib')}, Python {platform.python_version()}"
    )
    total = sum(o.seconds for o in outcomes)
    lines = [
        head,
        "",
        f"Command: `python benchmarks/gpu_suite.py{''.join(' ' + a for a in argv)}`; mgkit {mg.__version__}; "
        f"{len(outcomes)} of {len(parts)} parts in {total:.0f} s. Ratio = mgkit / peer.",
    ]
    if setup.dry:
        lines.append(
            f"Dry run: CPU devices stand for the GPU ({setup.gpu}) and the CPU ({setup.host}), at tiny "
            "sizes: these figures check the code paths, not the hardware."
        )
    for o in outcomes:
        status = f", did not finish: {o.error}" if o.error else ""
        lines += ["", f"### {o.title} ({o.seconds:.1f} s{_cell(status)})", ""]
        if o.rows:
            lines += ["| what | mgkit | peer | ratio | note |", "| --- | --- | --- | --- | --- |"]
            lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in o.rows]
        else:
            lines.append("(nothing measured)")
    for part in parts[len(outcomes) :]:
        lines += ["", f"### {part.title.format(gpu=setup.gpu, host=setup.host)} (not run)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description="Every GPU figure mgkit claims, appended to RESULTS.md.")
    p.add_argument("--out", type=Path, default=RESULTS, help="the file to append to (default RESULTS.md)")
    p.add_argument("--dry-run", action="store_true", help="CPU devices at tiny sizes: the same code paths")
    args = p.parse_args(argv)
    if args.dry_run:
        jax.config.update("jax_platforms", "cpu")
    mg.simulate(CPU_DEVICES)
    kinds = {r.name: r.kind for r in mg.devices()}
    gpus = [r.name for r in mg.devices() if r.platform != "cpu"]
    if not gpus and not args.dry_run:
        print(
            "gpu_suite: no GPU here (JAX sees only CPU devices); "
            "run with --dry-run to take the same code paths on CPU devices at tiny sizes",
            file=sys.stderr,
        )
        return 2
    gpu, host = ("cpu0", "cpu1") if args.dry_run else (gpus[0], "cpu0")
    setup = Setup(gpu, kinds[gpu], host, args.dry_run, DRY_SIZES if args.dry_run else GPU_SIZES)
    print(f"gpu_suite: {len(PARTS)} parts, the GPU is {setup.gpu}; appending to {args.out}", flush=True)
    outcomes, stopped = run_parts(setup, PARTS)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what was measured is written whole
    text = section(setup, outcomes, PARTS, argv)
    with open(args.out, "a", encoding="utf-8") as f:
        f.write("\n" + text)
    print(f"gpu_suite: wrote {len(outcomes)} part(s) to {args.out}", flush=True)
    return 130 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
