"""GPU checks for logistic regression: the 100,000 x 100 fit against the memory-bandwidth bound,
and fits on mixed GPU + CPU contexts. Run on a machine with a GPU:

    python benchmarks/gpu_logreg.py

Also checks scikit-learn parity on the GPU (load_breast_cancer, load_digits). Prints samples
per second, the bytes the solver must read per iteration and the achieved share
of a device-to-device copy's bandwidth measured in the same run, and scikit-learn's time on the
host for the same problem at the same objective.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import mgkit as mg

lr = mg.logreg


def copy_bandwidth(device: jax.Device, gib: float = 1.0) -> float:
    """GB/s of a device-to-device copy, counting bytes read and written."""
    x = jax.device_put(jnp.zeros(int(gib * 2**30) // 4, jnp.float32), device) + 1.0
    copy = jax.jit(lambda a: a * 1.0)
    copy(x).block_until_ready()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        copy(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / np.median(times) / 1e9


def median_seconds(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--features", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    gpus = [r.name for r in mg.devices() if r.platform != "cpu"]
    if not gpus:
        raise SystemExit("gpu_logreg.py needs a GPU; on CPU use benchmarks/bench_logreg.py")
    print(mg.devices())
    mg.use_contexts(f"dev0->{gpus[0]};host0->cpu0")
    device = mg.device_of("dev0")
    bw = copy_bandwidth(device)
    print(f"\ndevice-to-device copy on {device.device_kind}: {bw:.0f} GB/s (read + write)\n")

    n, d = args.rows, args.features
    rng = np.random.default_rng(0)
    X = rng.standard_normal((n, d)).astype(np.float32)
    y = (X @ (rng.standard_normal(d) / 3) + rng.standard_normal(n) > 0).astype(np.int32)
    Xd, yd = mg.put(X, "dev0"), mg.put(y, "dev0")
    from sklearn.linear_model import LogisticRegression

    t0 = time.perf_counter()
    sk = LogisticRegression(C=1.0).fit(X, y)
    sk_s = time.perf_counter() - t0
    l2 = 1 / (2 * n)
    sk_obj = lr.objective(lr.Model(sk.coef_[0], sk.intercept_[0], sk.classes_, None), X, y, l2)
    print(f"scikit-learn lbfgs on the host: {sk_s * 1e3:.1f} ms, objective {sk_obj:.8f}")
    rows = []
    for solver, passes in (("newton", 3), ("lbfgs", 2)):

        def fit(solver=solver):
            return lr.fit(Xd, yd, solver=solver, contexts=["dev0"], progress=False)

        m = fit()
        seconds = median_seconds(fit, args.repeats)
        its = int(m.info.iterations)
        obj = lr.objective(m, X, y, l2)
        read = passes * X.nbytes * its  # the solver reads X about `passes` times per iteration
        rows.append((solver, seconds, its, obj, n * its / seconds, read / seconds / 1e9))
        host = median_seconds(
            lambda solver=solver: lr.fit(X, y, solver=solver, contexts=["dev0"], progress=False), 5
        )
        rows[-1] += (host,)
    print(f"\n{n} x {d} binary, C=1, data on {gpus[0]} (warm, median of {args.repeats}):")
    print(
        "solver  ms      its  objective    samples/s   GB/s of X read  share of copy bw  "
        "x sklearn  ms from host"
    )
    for solver, s, its, obj, sps, gbps, host in rows:
        print(
            f"{solver:7s} {s * 1e3:6.1f}  {its:3d}  {obj:.8f}  {sps:10.3g}  {gbps:8.1f}        "
            f"{gbps / bw:8.3f}          {sk_s / s:6.1f}    {host * 1e3:6.1f}"
        )

    # Theano's recipe's size: 8 models of 400 x 784 on 8 contexts that share the GPU, against a
    # scikit-learn loop on the host.
    seeds = [(rng.standard_normal((400, 784)).astype(np.float32), rng.integers(0, 2, 400)) for _ in range(8)]
    C = 1 / (2 * 0.01 * 400)

    def sk_loop():
        return [LogisticRegression(C=C, max_iter=1000).fit(Xi, yi) for Xi, yi in seeds]

    sk_s = median_seconds(sk_loop, 7)
    sk_models = sk_loop()
    mg.use_contexts(";".join(f"m{i}->{gpus[0]}" for i in range(8)) + ";host0->cpu0", verbose=False)
    placed = {f"m{i}": mg.put(s, f"m{i}") for i, s in enumerate(seeds)}
    print(f"\nTheano recipe, 8 x (400 x 784) on 8 contexts sharing {gpus[0]} (one stacked program):")
    print(f"scikit-learn loop (lbfgs, 8 fits on the host): {sk_s * 1e3:.1f} ms")
    for solver in ("auto", "newton", "lbfgs"):

        def call(solver=solver):
            return lr.fit_per_device(placed, l2=0.01, solver=solver, progress=False)

        per = median_seconds(call, 10)
        models = call()
        gap = max(
            lr.objective(models[f"m{i}"], Xi, yi, 0.01)
            - lr.objective(lr.Model(m.coef_[0], m.intercept_[0], np.array([0, 1]), None), Xi, yi, 0.01)
            for i, ((Xi, yi), m) in enumerate(zip(seeds, sk_models, strict=True))
        )
        print(
            f"  mgkit {solver:6s} ({models['m0'].info.solver}): {per * 1e3:6.1f} ms, "
            f"x scikit-learn {sk_s / per:5.1f}, max objective gap vs scikit-learn {gap:+.2e}"
        )
    mg.use_contexts(f"dev0->{gpus[0]};host0->cpu0", verbose=False)

    # Mixed GPU + CPU contexts: one model per context, K models over both.
    data = {
        c: (rng.standard_normal((400, 784)).astype(np.float32), rng.integers(0, 2, 400))
        for c in ("dev0", "host0")
    }
    models = lr.fit_per_device(data, l2=0.01, progress=False)
    print(
        "\nfit_per_device on dev0 (GPU) and host0 (CPU):",
        {c: (mg.where(m.w), int(m.info.iterations), bool(m.info.converged)) for c, m in models.items()},
    )
    sweep = lr.fit_many(X[:5000], y[:5000], l2=np.logspace(-4, 0, 8).tolist(), progress=False)
    print("fit_many of 8 over dev0 + host0:", mg.where(sweep.w), np.asarray(sweep.info.converged).tolist())
    try:
        lr.fit(X[:1000], y[:1000])
    except ValueError as e:
        print("fit on mixed kinds:", str(e)[:160], "...")
    _parity()
    print(mg.ledger().summary())


def _parity() -> None:
    """The tests' parity checks, with the data and the fits on the GPU context dev0."""
    from sklearn.datasets import load_breast_cancer, load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    def sk_model(sk):
        two = len(sk.classes_) == 2
        return lr.Model(
            sk.coef_[0] if two else sk.coef_.T, sk.intercept_[0] if two else sk.intercept_, sk.classes_, None
        )

    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X).astype(np.float32)
    converged = LogisticRegression(C=1, tol=1e-10, max_iter=10_000).fit(X, y)
    default = LogisticRegression(C=1).fit(X, y)
    l2 = 1 / (2 * len(X))
    print("\nparity on dev0, load_breast_cancer (C=1):")
    for solver in ("newton", "lbfgs"):
        m = lr.fit(X, y, solver=solver, contexts=["dev0"], progress=False)
        rel = np.linalg.norm(np.asarray(m.w) - converged.coef_[0]) / np.linalg.norm(converged.coef_[0])
        gap = lr.objective(m, X, y, l2) / lr.objective(sk_model(default), X, y, l2) - 1
        print(
            f"  {solver:6s} on {mg.where(m.w)}: converged {bool(m.info.converged)}, coefficients "
            f"{rel:.1e} relative from scikit-learn's converged fit (goal 1e-3), objective "
            f"{gap:+.1e} relative to its default fit (goal <= 1e-4)"
        )
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X).astype(np.float32)
    Xtr, ytr, Xte, yte = X[:1300], y[:1300], X[1300:], y[1300:]
    sk = LogisticRegression(C=1, max_iter=1000).fit(Xtr, ytr)
    l2 = 1 / (2 * len(Xtr))
    print("parity on dev0, load_digits (10 classes, C=1):")
    for solver in ("newton", "lbfgs"):
        m = lr.fit(Xtr, ytr, solver=solver, contexts=["dev0"], progress=False)
        gap = lr.objective(m, Xtr, ytr, l2) / lr.objective(sk_model(sk), Xtr, ytr, l2) - 1
        print(
            f"  {solver:6s}: test accuracy {float(lr.score(m, Xte, yte)):.4f} against scikit-learn's "
            f"{sk.score(Xte, yte):.4f} (goal within 0.01), objective {gap:+.1e} relative (goal <= 1e-4)"
        )


if __name__ == "__main__":
    main()
