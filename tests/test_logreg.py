"""Logistic regression: parity with scikit-learn, the three layouts, Theano's recipe's gradient descent,
telemetry, convergence warnings and bad input."""

import collections
import functools
import time
import warnings

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

import mgkit as mg
from mgkit.logreg import _checks, _fit, _linesearch, _objective, _programs, _solver

lr = mg.logreg


@pytest.fixture(scope="module")
def cancer():
    X, y = load_breast_cancer(return_X_y=True)
    return StandardScaler().fit_transform(X), y


@pytest.fixture(scope="module")
def digits():
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    return X[:1300], y[:1300], X[1300:], y[1300:]


@pytest.fixture(scope="module")
def small():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((203, 5)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5, 0.0, 1.5]) + 0.5 * rng.standard_normal(203) > 0).astype(int)
    return X, y


def _sk_model(sk: LogisticRegression) -> lr.Model:
    binary = len(sk.classes_) == 2
    w = sk.coef_[0] if binary else sk.coef_.T
    b = sk.intercept_[0] if binary else sk.intercept_
    return lr.Model(w, b, sk.classes_, None)


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


# -- parity with scikit-learn --------------------------------------------------------------


@pytest.mark.parametrize("solver", ["auto", "lbfgs"])
def test_breast_cancer_matches_scikit_learn(cancer, solver):
    X, y = cancer
    l2 = 1 / (2 * len(X))  # C = 1
    m = lr.fit(X, y, solver=solver)  # 8 contexts, 569 rows: an uneven split
    assert bool(m.info.converged)
    # scikit-learn's default stops at tol=1e-4, about 1% from the optimum in its coefficients:
    # compare the coefficients with its converged fit, the objective with both.
    default = LogisticRegression(C=1).fit(X, y)
    converged = LogisticRegression(C=1, tol=1e-10, max_iter=10_000).fit(X, y)
    assert _rel(m.w, converged.coef_[0]) < 1e-3
    assert float(m.b) == pytest.approx(converged.intercept_[0], rel=1e-3)
    for sk in (default, converged):
        assert lr.objective(m, X, y, l2) <= lr.objective(_sk_model(sk), X, y, l2) * (1 + 1e-4)
    assert float(lr.score(m, X, y)) == pytest.approx(converged.score(X, y), abs=1e-6)


@pytest.mark.parametrize("solver", ["newton", "lbfgs"])
def test_digits_ten_classes_match_scikit_learn(digits, solver):
    Xtr, ytr, Xte, yte = digits
    sk = LogisticRegression(C=1, max_iter=1000).fit(Xtr, ytr)
    m = lr.fit(Xtr, ytr, solver=solver)
    assert m.w.shape == (64, 10) and m.b.shape == (10,) and list(m.classes) == list(range(10))
    assert abs(float(lr.score(m, Xte, yte)) - sk.score(Xte, yte)) <= 0.01
    l2 = 1 / (2 * len(Xtr))
    assert lr.objective(m, Xtr, ytr, l2) <= lr.objective(_sk_model(sk), Xtr, ytr, l2) * (1 + 1e-4)
    assert np.allclose(np.asarray(lr.predict_proba(m, Xte)).sum(1), 1, atol=1e-5)


def test_c_maps_to_l2(small):
    X, y = small
    a = lr.fit(X, y, C=0.5, contexts=1)
    b = lr.fit(X, y, l2=1 / (2 * 0.5 * len(X)), contexts=1)
    np.testing.assert_allclose(np.asarray(a.w), np.asarray(b.w), rtol=1e-6)


# -- fit: data-parallel --------------------------------------------------------------------


def test_short_sums_skip_the_tree_split_on_cpus_only():
    opts = _checks.options("auto", None, 1e-5, 0.1, False, "test")
    spec = functools.partial(_programs.make_spec, opts, reduce=False, models=1, held=400)
    assert spec(784, 1, "cpu", rows=400).short_sums  # Theano's recipe's size
    assert spec(100, 1, "cpu", rows=12_500).short_sums  # 100k rows over 8 contexts
    assert not spec(100, 1, "cpu", rows=100_000).short_sums  # one context's 100k-row sums are split
    assert not spec(20_000, 1, "cpu", rows=400).short_sums  # 20k parameters
    assert not spec(784, 1, "gpu", rows=400).short_sums
    short = _programs.local_program(spec(784, 1, "cpu", rows=400))
    long = _programs.local_program(spec(784, 1, "cpu", rows=100_000))
    args = (
        _solver.Args(
            np.ones((400, 784), np.float32), np.zeros(400, np.int32), np.ones((400, 1), np.float32),
            np.zeros((784, 1, 1), np.float32), np.zeros((1, 1), np.float32), np.full(1, 0.01, np.float32),
        ),
        np.float32(1e-5), np.float32(0.1),
    )  # fmt: skip
    assert "reduce-window" not in short.lower(*args).compile().as_text()
    assert "reduce-window" in long.lower(*args).compile().as_text()


@pytest.mark.parametrize("n", [1, 2, 3, 8, 101])
def test_the_gradient_sum_in_halves_is_the_sum_over_rows(n):
    rng = np.random.default_rng(n)
    X, r = rng.standard_normal((n, 4)).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    got = jax.jit(_objective._halves_sum)(X, r)
    np.testing.assert_allclose(np.asarray(got), (X * r[:, None]).sum(0), rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::mgkit.logreg.ConvergenceWarning")  # gd: fixed steps
@pytest.mark.parametrize("solver", ["newton", "lbfgs", "gd"])
def test_one_and_eight_contexts_give_the_same_model(small, solver):
    X, y = small  # 203 rows: uneven on 8 contexts
    kw = {"l2": 0.01, "solver": solver} | ({"max_iter": 300} if solver == "gd" else {})
    one, eight = lr.fit(X, y, contexts=1, **kw), lr.fit(X, y, **kw)
    np.testing.assert_allclose(np.asarray(one.w), np.asarray(eight.w), atol=2e-5)
    np.testing.assert_allclose(float(one.b), float(eight.b), atol=2e-5)
    assert int(one.info.iterations) == int(eight.info.iterations)


def test_every_device_holds_the_same_model(small):
    X, y = small
    m = lr.fit(X, y, l2=0.01)
    assert m.w.sharding.device_set == {mg.device_of(f"dev{i}") for i in range(8)}
    shards = [np.asarray(s.data) for s in m.w.addressable_shards]
    assert all(np.array_equal(shards[0], s) for s in shards[1:])
    assert mg.where(mg.logreg.predict(m, mg.put(X, "dev3"))) == "dev3"  # the model follows the data


def test_split_events_and_padding_rows_do_not_count(small):
    X, y = small
    m = lr.fit(X, y, l2=0.01)
    split = mg.ledger().records("split")
    assert {e.dst for e in split} == {f"dev{i}" for i in range(8)}
    for arrays in {e.info["arrays"] for e in split}:  # X, then the labels and row weights
        rows = {e.dst: e.info["rows"] for e in split if e.info["arrays"] == arrays}
        assert sum(rows.values()) == len(X) and set(rows.values()) == {25, 26}
    ref = lr.fit(np.concatenate([X, X[-1:]]), np.concatenate([y, y[-1:]]), l2=0.01, contexts=1)
    assert not np.allclose(np.asarray(ref.w), np.asarray(m.w), atol=1e-6)  # a repeated row would show


def test_sample_weight_equals_repeated_rows(small):
    X, y = small
    weights = np.ones(len(X))
    weights[:10] = 3
    a = lr.fit(X, y, l2=0.01, sample_weight=weights, contexts=1)
    Xr = np.concatenate([X, X[:10], X[:10]])
    yr = np.concatenate([y, y[:10], y[:10]])
    b = lr.fit(Xr, yr, l2=0.01, contexts=1)
    np.testing.assert_allclose(np.asarray(a.w), np.asarray(b.w), atol=1e-5)


def test_predictions_are_pure_and_jittable(small):
    X, y = small
    m = lr.fit(X, y, l2=0.01, contexts=1)
    np.testing.assert_array_equal(np.asarray(jax.jit(lr.predict)(m, X)), np.asarray(lr.predict(m, X)))
    proba = np.asarray(jax.jit(lr.predict_proba)(m, X))
    assert proba.shape == (len(X), 2) and np.allclose(proba.sum(1), 1)
    assert float(jax.jit(lr.score)(m, X, y)) == pytest.approx(float(lr.score(m, X, y)))
    assert m.info.history()[0] == pytest.approx(np.log(2), rel=1e-5)  # zeros: p = 1/2 (float32 mean)
    assert np.all(np.diff(m.info.history()) <= 1e-7)  # the objective never rises


@pytest.mark.parametrize(
    "labels", [np.array(["cat", "dog", "emu"]), np.array([-5, 10, 20]), np.array([0.5, 1.5, 2.5])]
)
def test_any_distinct_labels_come_back(small, labels):
    X, _ = small
    y = labels[np.argmax(X[:, :3], axis=1)]
    m = lr.fit(X, y, l2=1e-3, contexts=2)
    assert list(m.classes) == sorted(labels.tolist())
    pred = np.asarray(lr.predict(m, X))
    assert set(pred.tolist()) <= set(labels.tolist()) and (pred == y).mean() > 0.9


# -- fit_per_device ------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::mgkit.logreg.ConvergenceWarning")  # 300 of the recipe's 10000 steps
def test_theano_recipe_gradient_descent_is_exact():
    """Theano's recipe: 400 x 784, random labels, 0.01 * ||w||^2, steps of 0.1, on two devices."""
    rng = np.random.default_rng(1)
    N, feats, steps = 400, 784, 300
    data = {c: (rng.standard_normal((N, feats)), rng.integers(0, 2, N)) for c in ("dev0", "dev1")}
    init = {c: (rng.standard_normal(feats) * 0.01, 0.0) for c in data}
    models = lr.fit_per_device(data, l2=0.01, solver="gd", learning_rate=0.1, max_iter=steps, init=init)
    for ctx, m in models.items():
        assert mg.where(m.w) == ctx and m.info.solver == "gd" and int(m.info.iterations) == steps
        X64, y64 = data[ctx]
        assert m.info.history()[-1] == pytest.approx(lr.objective(m, X64, y64, 0.01), rel=1e-5)
        X, y = (np.asarray(a, np.float32) for a in data[ctx])
        w, b = np.asarray(init[ctx][0], np.float32), np.float32(0)
        for _ in range(steps):  # the recipe's update, by hand
            p = 1 / (1 + np.exp(-(X @ w + b)))
            w, b = w - 0.1 * (X.T @ (p - y) / N + 0.02 * w), b - 0.1 * np.mean(p - y)
        np.testing.assert_allclose(np.asarray(m.w), w, atol=2e-5)
        assert float(m.b) == pytest.approx(float(b), abs=2e-5)
        assert (np.asarray(lr.predict(m, X)) == y).mean() == 1.0  # 784 features fit 400 labels


def test_data_function_runs_on_each_context_with_private_arguments(small):
    made = {}

    def make(ctx):
        key = jax.random.key(int(ctx[-1]))
        X = jax.random.normal(key, (64, 5))
        made[ctx] = mg.where(X)
        return X, (X[:, 0] > 0).astype(jnp.int32)

    models = lr.fit_per_device(make, l2={"dev0": 0.1, "dev1": 0.001}, contexts=["dev0", "dev1"])
    assert made == {"dev0": "dev0", "dev1": "dev1"}
    assert [float(m.info.l2) for m in models.values()] == pytest.approx([0.1, 0.001])
    assert abs(float(models["dev1"].w[0])) > abs(float(models["dev0"].w[0]))  # less penalty
    assert not [e for e in mg.ledger().records("put") if e.src == "host" and e.info["arrays"] == 1]


def test_per_device_equals_fitting_each_alone_on_shared_devices(small):
    X, y = small
    mg.use_contexts("a->cpu0;b->cpu0;c->cpu1", verbose=False)  # two contexts share a device
    data = {"a": (X, y), "b": (X[:100], y[:100]), "c": (X[50:], 1 - y[50:])}
    models = lr.fit_per_device(data, l2=0.01)
    for ctx, (Xc, yc) in data.items():
        alone = lr.fit(Xc, yc, l2=0.01, contexts=[ctx])
        np.testing.assert_allclose(np.asarray(models[ctx].w), np.asarray(alone.w), atol=1e-5)
        assert models[ctx].w.devices() == {mg.device_of(ctx)}


@pytest.mark.parametrize("solver", ["newton", "lbfgs", "gd"])
def test_contexts_sharing_a_device_fit_in_one_program(small, solver, monkeypatch):
    calls = []
    program = _fit.per_device_program
    monkeypatch.setattr(
        _fit, "per_device_program", lambda spec, stacked: calls.append(stacked) or program(spec, stacked)
    )
    X, y = small
    rng = np.random.default_rng(5)
    mg.use_contexts("a->cpu0;b->cpu0;c->cpu0;d->cpu1", verbose=False)
    data = {
        "a": (X, y),
        "b": (rng.standard_normal(X.shape), np.array(["no", "yes"])[y]),
        "c": (X[:, ::-1].copy(), 1 - y),
        "d": (X, y),
    }
    penalties = {"a": 0.01, "b": 0.1, "c": 0.03, "d": 0.01}
    steps = 300 if solver == "gd" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lr.ConvergenceWarning)  # gd: a fixed number of steps
        models = lr.fit_per_device(data, l2=penalties, solver=solver, max_iter=steps)
        assert sorted(calls) == [False, True]  # a, b and c: one program on cpu0; d alone on cpu1
        for ctx, (Xc, yc) in data.items():
            alone = lr.fit(Xc, yc, l2=penalties[ctx], contexts=[ctx], solver=solver, max_iter=steps)
            np.testing.assert_allclose(np.asarray(models[ctx].w), np.asarray(alone.w), atol=1e-5)
            assert int(models[ctx].info.iterations) == int(alone.info.iterations)
            assert list(models[ctx].classes) == list(alone.classes)
            assert models[ctx].w.devices() == {mg.device_of(ctx)}
    final = [e for e in mg.ledger().records("step") if e.info["final"]]
    assert sorted(e.src for e in final) == ["a", "a", "b", "b", "c", "c", "d", "d"]  # together, alone


@pytest.mark.parametrize("start", [False, True])
def test_per_device_spmd_models_live_on_their_devices_and_equal_fitting_alone(start, monkeypatch):
    """One SPMD program: each model's w and b come back on its own device, in the shapes of a
    fit alone (three classes here), with its facts as host numpy; a start other than zeros
    travels with the penalties."""
    rng = np.random.default_rng(7)
    ctxs = ["dev0", "dev3", "dev5"]
    data = {c: (rng.standard_normal((60, 4)), rng.integers(0, 3, 60)) for c in ctxs}
    init = (
        {c: (rng.standard_normal((4, 3)) * 0.1, rng.standard_normal(3) * 0.1) for c in ctxs}
        if start
        else None
    )
    calls = []
    spmd = _fit._per_device_spmd
    monkeypatch.setattr(_fit, "_per_device_spmd", lambda *a: calls.append(1) or spmd(*a))
    models = lr.fit_per_device(data, l2={"dev0": 0.01, "dev3": 0.03, "dev5": 0.1}, init=init)
    assert calls == [1]
    for ctx, m in models.items():
        assert m.w.shape == (4, 3) and m.b.shape == (3,)
        assert mg.where(m.w) == ctx and mg.where(m.b) == ctx
        assert isinstance(m.info.loss, np.ndarray) and isinstance(m.info.iterations, np.integer)
        l2 = float(m.info.l2)
        alone = lr.fit(
            *data[ctx], l2=l2, contexts=[ctx], solver=m.info.solver, init=init[ctx] if start else None
        )
        np.testing.assert_allclose(np.asarray(m.w), np.asarray(alone.w), atol=1e-5)
        np.testing.assert_allclose(np.asarray(m.b), np.asarray(alone.b), atol=1e-5)
        assert int(m.info.iterations) == int(alone.info.iterations) and bool(m.info.converged)
        np.testing.assert_allclose(m.info.history(), alone.info.history(), rtol=1e-5)
    assert [round(float(models[c].info.l2), 6) for c in ctxs] == [0.01, 0.03, 0.1]


def test_per_device_models_of_different_sizes_and_solvers(small):
    X, y = small
    rng = np.random.default_rng(2)
    wide = rng.standard_normal((len(X), 70))  # 71 parameters: "auto" picks L-BFGS on CPU
    models = lr.fit_per_device({"dev0": (X, y), "dev1": (wide, y)}, l2=0.01)
    assert (models["dev0"].info.solver, models["dev1"].info.solver) == ("newton", "lbfgs")
    assert models["dev1"].w.shape == (70,) and all(bool(m.info.converged) for m in models.values())


# -- fit_many ------------------------------------------------------------------------------


@pytest.mark.parametrize("contexts", [None, 3])
def test_fit_many_equals_fitting_each_alone(small, contexts):
    X, y = small
    penalties = [1e-4, 1e-3, 1e-2, 1e-1, 1.0]  # 5 models: 1 per device on 5 of 8; 2,2,1 on 3
    sweep = lr.fit_many(X, y, l2=penalties, contexts=contexts)
    assert sweep.w.shape == (5, 5) and sweep.b.shape == (5,) and mg.where(sweep.w) == "dev0"
    for i, (m, l2) in enumerate(zip(lr.unstack(sweep), penalties, strict=True)):
        alone = lr.fit(X, y, l2=l2, contexts=1, solver=sweep.info.solver)
        np.testing.assert_allclose(np.asarray(m.w), np.asarray(alone.w), atol=1e-5, err_msg=f"model {i}")
        assert float(m.info.l2) == pytest.approx(l2)
        assert list(m.classes) == [0, 1]
    acc = np.asarray(lr.score(sweep, X, y))
    assert acc.shape == (5,) and acc[0] >= acc[-1]


def test_fit_many_bootstrap_rows_and_shared_devices(small):
    X, y = small
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, len(X), len(X)) for _ in range(3)]
    mg.use_contexts("a->cpu0;b->cpu0", verbose=False)  # one program per context
    boot = lr.fit_many(X, y, l2=0.01, rows=rows)
    for i, idx in enumerate(rows):
        alone = lr.fit(X[idx], y[idx], l2=0.01, contexts=1, solver=boot.info.solver)
        np.testing.assert_allclose(np.asarray(boot.w[i]), np.asarray(alone.w), atol=1e-5)


def test_fit_many_many_models_per_simulated_device_finishes():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((500, 50)).astype(np.float32)
    y = (X @ rng.standard_normal(50) + rng.logistic(size=500) > 0).astype(int)
    sweep = lr.fit_many(X, y, l2=np.logspace(-5, 1, 64).tolist(), progress=False)
    # Newton, as fit picks for this problem: eight models a device solve their systems in XLA
    # operations (XLA's CPU batched Cholesky could deadlock here)
    assert sweep.info.solver == "newton" and bool(np.all(sweep.info.converged))


def test_fit_many_ten_classes_several_per_device(digits):
    Xtr, ytr, Xte, yte = digits
    sweep = lr.fit_many(Xtr, ytr, l2=np.logspace(-4, 0, 11).tolist(), solver="lbfgs", max_iter=300)
    assert sweep.w.shape == (11, 64, 10) and np.asarray(lr.score(sweep, Xte, yte)).shape == (11,)


# -- telemetry -----------------------------------------------------------------------------


def test_step_events_per_context(small, monkeypatch):
    X, y = small
    monkeypatch.setattr(_programs, "_REPORT_WORK", {"cpu": 1})  # a report interval of one iteration
    lr.fit(X, y, l2=0.01, solver="newton")
    steps = mg.ledger().records("step")
    assert {e.src for e in steps} == {f"dev{i}" for i in range(8)}
    final = [e for e in steps if e.info["final"]]
    assert len(final) == 8 and all(e.info["what"] == "logreg.fit (newton)" for e in steps)
    assert all(e.info["samples_per_second"] > 0 for e in final if e.info["iteration"])
    # The fit runs one iteration a call, and the host records each one's step.
    assert {e.info["iteration"] for e in steps} == set(range(1, final[0].info["iteration"] + 1))


def _every_layout(X, y, kw):
    """One fit of each layout: data-parallel, one SPMD per-device program, several models per
    device in one SPMD program, then per-device programs of contexts sharing a device (stacked
    and alone) and fit_many without SPMD. Returns {layout: Model or {context: Model}}."""
    data = {"dev0": (X, y), "dev1": (X[::-1].copy(), 1 - y), "dev2": (X * 2, y)}
    out = {
        "fit": lr.fit(X, y, **kw),
        "per device": lr.fit_per_device(data, **kw),
        "many": lr.fit_many(X, y, **{**kw, "l2": [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 0.02, 0.05, 0.2, 2.0]}),
    }
    mg.use_contexts("a->cpu0;b->cpu0;c->cpu1", verbose=False)
    out["shared"] = lr.fit_per_device(dict(zip("abc", data.values(), strict=True)), **kw)
    out["many shared"] = lr.fit_many(X, y, **{**kw, "l2": [0.01, 0.1, 1.0]})
    mg.use_contexts(";".join(f"dev{i}->cpu{i}" for i in range(8)), verbose=False)
    return out


def _assert_same_fits(got_layouts, want_layouts, atol=1e-6, rtol=1e-6):
    """The fits of ``_every_layout``, compared: weights, iterations, convergence and history."""
    for layout, got in got_layouts.items():
        want = want_layouts[layout]
        pairs = [(got, want)] if isinstance(got, lr.Model) else [(got[k], want[k]) for k in want]
        for g, w in pairs:
            np.testing.assert_allclose(np.asarray(g.w), np.asarray(w.w), atol=atol, err_msg=layout)
            np.testing.assert_allclose(np.asarray(g.b), np.asarray(w.b), atol=atol, err_msg=layout)
            np.testing.assert_array_equal(np.asarray(g.info.iterations), np.asarray(w.info.iterations))
            np.testing.assert_array_equal(np.asarray(g.info.converged), np.asarray(w.info.converged))
            np.testing.assert_allclose(g.info.history(), w.info.history(), rtol=rtol, err_msg=layout)


@pytest.mark.filterwarnings("ignore::mgkit.logreg.ConvergenceWarning")  # gd: fixed steps
@pytest.mark.parametrize("solver", ["newton", "lbfgs", "gd"])
def test_a_fit_in_many_calls_equals_one_call_in_every_layout(small, solver, monkeypatch):
    X, y = small
    kw = {"l2": 0.01, "solver": solver} | ({"max_iter": 40} if solver == "gd" else {})
    whole = _every_layout(X, y, kw)
    assert not mg.ledger().records("step") or all(e.info["final"] for e in mg.ledger().records("step"))
    mg.ledger().clear()
    # a call runs 3 iterations at most
    monkeypatch.setattr(_programs, "iterations_per_call", lambda *a, **k: 3)
    chunked = _every_layout(X, y, kw)
    _assert_same_fits(chunked, whole)
    # between calls the host records each context's step: every third iteration, then the last
    steps = [e for e in mg.ledger().records("step") if e.info["what"].startswith("logreg.fit ")]
    last = int(chunked["fit"].info.iterations)
    assert sorted({e.info["iteration"] for e in steps if not e.info["final"]}) == list(range(3, last, 3))
    assert {e.src for e in steps if e.info["final"]} == {f"dev{i}" for i in range(8)}


@pytest.mark.parametrize("case", ["lbfgs", "newton, classes", "backtracking"])
def test_step_lengths_tried_at_once_equal_the_backtracking_loop(small, case, monkeypatch):
    # Accelerators try every step length at once (no loop inside the iteration); CPUs halve
    # the step in a loop. Forced here on the CPU, the two fit the same models in every layout.
    X, y = small
    kw = {"l2": 0.01, "solver": case.split(",")[0] if case != "backtracking" else "lbfgs"}
    if case == "backtracking":  # one huge value: first step lengths fail, and are halved
        X = np.vstack([X, [[1e4, 0, 0, 0, 0]]]).astype(np.float32)
        y, kw["l2"] = np.r_[(X[:-1, 0] > 0).astype(int), 0], 0.0
    elif case.endswith("classes"):
        y = np.digitize(X @ np.array([1.0, -2.0, 0.5, 0.0, 1.5]), [-1, 0, 1])
    loop = _every_layout(X, y, kw)
    spec = _programs.make_spec
    monkeypatch.setattr(_fit, "make_spec", lambda *a, **k: spec(*a, **k)._replace(batched_search=True))
    at_once = _every_layout(X, y, kw)
    if case != "backtracking":
        _assert_same_fits(at_once, loop, atol=1e-5, rtol=1e-5)
        return
    # The intercept is ill-conditioned here (an unpenalised outlier): float rounding, summed
    # in another order, moves the path by an iteration. Both reach the same objective.
    for layout, got in at_once.items():
        got, want = (got, loop[layout]) if isinstance(got, dict) else ({0: got}, {0: loop[layout]})
        for k in want:
            assert np.all(np.asarray(got[k].info.converged)), layout
            np.testing.assert_allclose(got[k].info.history()[-1], want[k].info.history()[-1], rtol=1e-5)
    monkeypatch.setattr(_linesearch, "BACKTRACKS", 0)  # no halving: the fit stalls at once
    stalled = lr.fit(X, y, **kw, contexts=1)
    assert int(stalled.info.iterations) < int(at_once["fit"].info.iterations) // 4


def test_step_lengths_are_tried_at_once_on_accelerators_where_the_trials_are_few():
    opts = _checks.options("lbfgs", None, 1e-5, 0.1, False, "test")
    spec = _programs.make_spec
    assert spec(opts, 784, 1, "gpu", False, rows=400, models=8, held=3200).batched_search
    assert not spec(opts, 784, 1, "cpu", False, rows=400, models=8, held=3200).batched_search
    assert not spec(opts, 100, 1, "gpu", False, rows=10**6, models=1, held=10**6).batched_search


@pytest.mark.filterwarnings("ignore::mgkit.logreg.ConvergenceWarning")
def test_steps_are_timed_from_when_the_work_began_not_from_the_compile(monkeypatch):
    monkeypatch.setattr(_programs, "iterations_per_call", lambda *a, **k: 3)
    rng = np.random.default_rng(7)
    X = rng.standard_normal((211, 7))  # a shape no other test fits: every program compiles here
    y = (X[:, 0] + rng.standard_normal(211) > 0).astype(int)
    t0 = time.perf_counter()
    _every_layout(X, y, {"l2": 0.01, "solver": "lbfgs"})  # 2 compiles a layout: first call, resumption
    wall = time.perf_counter() - t0
    seconds = collections.Counter()
    for e in mg.ledger().records("step"):
        seconds[e.info["what"], e.src] += e.seconds
    assert len(seconds) == 22 and max(seconds.values()) < wall / 20  # each fit's work: milliseconds


def test_a_fit_in_many_calls_stops_at_once_on_nan(monkeypatch):
    monkeypatch.setattr(_programs, "iterations_per_call", lambda *a, **k: 2)
    X = np.ones((20, 3))
    X[3, 1] = np.nan
    for solver in ("gd", "lbfgs"):
        with pytest.raises(ValueError, match=r"X has 1 NaN or infinite value\(s\), the first at row 3"):
            lr.fit(X, np.arange(20) % 2, solver=solver, max_iter=10**6, progress=False)


def test_a_fit_shorter_than_the_report_interval_reports_its_last_step_only(small):
    X, y = small
    m = lr.fit(X, y, l2=0.01, solver="lbfgs", contexts=2)
    steps = mg.ledger().records("step")
    assert sorted((e.src, e.info["iteration"], e.info["final"]) for e in steps) == [
        (ctx, int(m.info.iterations), True) for ctx in ("dev0", "dev1")
    ]


def test_reports_come_about_a_tenth_of_a_second_of_work_apart(monkeypatch):
    every = _programs.iterations_per_call
    monkeypatch.setattr(_programs, "_cores", lambda: 2)
    assert every("lbfgs", 784, 1, "cpu", 400) == 587  # Theano's recipe: 400 x 785 per iteration, and 45 us
    assert every("lbfgs", 100, 1, "cpu", 100_000) == 25  # 100k x 101
    assert every("newton", 30, 1, "cpu", 569) == 374  # a 31 x 31 Hessian per row, and its factor
    assert every("lbfgs", 784, 1, "gpu", 400) == 1379  # accelerators: ten times the work, 60 us
    assert every("gd", 10**6, 10, "cpu", 10**6) == 1  # never less than one
    assert every("gd", 1, 1, "cpu", 1) == 6667  # a pass of the loop costs 15 us whatever its work
    # an iteration of 0.85 of the budget: calls of two (eight 400 x 784 Newton fits on one GPU)
    assert every("newton", 784, 1, "gpu", 8 * 400) == 2
    # 8 simulated devices on 2 cores, data-parallel: each of 10,000 steps meets in a sum, about
    # 1 ms (one 6 s call before); per device, without sums, the cores are shared
    assert every("gd", 10, 1, "cpu", 125, devices=8, reduce=True) == 98
    assert every("lbfgs", 10, 1, "cpu", 250, devices=8) == 543


@pytest.mark.filterwarnings("ignore::mgkit.logreg.ConvergenceWarning")
def test_progress_bar_in_text(small, capsys):
    X, y = small
    lr.fit(X, y, l2=0.01, solver="gd", max_iter=50, progress=True)
    err = capsys.readouterr().err
    assert "logreg.fit (gd)" in err and "50/50" in err


def test_progress_true_shows_a_fast_fit_done(small, capsys):
    X, y = small
    m = lr.fit(X, y, l2=0.01, contexts=1, solver="lbfgs", progress=True)  # done within the first look
    err = capsys.readouterr().err
    assert "logreg.fit (lbfgs)" in err and f" {int(m.info.iterations)}it " in err


def test_progress_false_prints_nothing(small, capsys):
    X, y = small
    lr.fit(X, y, l2=0.01, contexts=1, progress=False)
    assert capsys.readouterr().err == ""


def test_convergence_failures_warn_with_the_gradient(small):
    X, y = small
    with pytest.warns(lr.ConvergenceWarning, match=r"did not converge \(lbfgs\): max\|gradient\| "):
        m = lr.fit(X, y, l2=0.0, solver="lbfgs", max_iter=2)
    assert not bool(m.info.converged)
    with pytest.warns(
        lr.ConvergenceWarning, match=r"diverged \(the objective rose\) \(gd\).*lower learning_rate"
    ):
        lr.fit(X * 1e3, y, l2=0.0, solver="gd", learning_rate=1e6, max_iter=20, contexts=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lr.fit(X, y, l2=0.01, contexts=1)


def test_large_finite_features_whose_sum_overflows_are_not_taken_for_inf():
    big = np.full((4, 2), 3e38, np.float32)  # the float32 sum overflows; every value is finite
    _checks.check_finite([big, mg.put(big, "dev0")], ["X", "X placed"], "test")
    bad = big.copy()
    bad[2, 1] = -np.inf
    with pytest.raises(
        ValueError, match=r"X placed has 1 NaN or infinite value\(s\), the first at row 2, column 1"
    ):
        _checks.check_finite([big, mg.put(bad, "dev0")], ["X", "X placed"], "test")


# -- bad input -----------------------------------------------------------------------------

_X = np.random.default_rng(0).standard_normal((20, 3))
_Y = np.arange(20) % 2
_nan = _X.copy()
_nan[3, 1] = np.nan


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: lr.fit(_X[:, 0], _Y), ValueError, r"X must be 2-D.*shape \(20,\).*reshape\(-1, 1\)"),
        (lambda: lr.fit(_X[None], _Y), ValueError, r"X must be 2-D .*got shape \(1, 20, 3\)"),
        (lambda: lr.fit(_X, _Y[:-1]), ValueError, "X has 20 rows but y has 19 labels"),
        (
            lambda: lr.fit(_nan, _Y),
            ValueError,
            r"X has 1 NaN or infinite value\(s\), the first at row 3, column 1 \(value nan\)",
        ),
        (lambda: lr.fit(np.full((2, 2), np.inf), [0, 1]), ValueError, "first at row 0, column 0"),
        (
            lambda: lr.fit(mg.put(_nan.astype(np.float32), "dev1"), _Y),
            ValueError,
            r"X has 1 NaN or infinite value\(s\), the first at row 3, column 1",
        ),
        (
            lambda: lr.fit(_nan, _Y, solver="gd", max_iter=10**6),  # stops at once, not after 10**6 steps
            ValueError,
            r"X has 1 NaN or infinite value\(s\), the first at row 3, column 1",
        ),
        (
            lambda: lr.fit_many(_nan, _Y, rows=[[0, 1, 2, 4], [5, 6, 7, 8]]),  # row 3 in no set: weight 0
            ValueError,
            r"X has 1 NaN or infinite value\(s\), the first at row 3, column 1",
        ),
        (
            lambda: lr.fit_many(_nan, _Y, l2=[0.1, 1.0]),
            ValueError,
            r"X has 1 NaN or infinite value\(s\), the first at row 3, column 1",
        ),
        (
            lambda: lr.fit_per_device({"dev0": (_X, _Y), "dev1": (_nan, _Y)}),
            ValueError,
            r"X for context 'dev1' has 1 NaN or infinite value\(s\), the first at row 3, column 1",
        ),
        (
            lambda: lr.fit(_nan, _Y, init=(np.ones(3), 0.5), sample_weight=np.arange(20) % 3),
            ValueError,
            r"X has 1 NaN or infinite value\(s\), the first at row 3, column 1",
        ),
        (lambda: lr.fit(_X, np.zeros(20)), ValueError, "single class .*needs at least two classes"),
        (
            lambda: lr.fit(_X, np.array([1, "a"] * 10, dtype=object)),
            TypeError,
            r"cannot be sorted.*\['int', 'str'\]",
        ),
        (
            lambda: lr.fit(_X, _Y, l2=-1.0),
            ValueError,
            r"l2=-1.0 is out of range; l2 must be .* at least 0",
        ),
        (
            lambda: lr.fit(_X, _Y, l2=float("nan")),
            ValueError,
            "l2=nan is out of range",
        ),
        (
            lambda: lr.fit(_X, _Y, l2="big"),
            TypeError,
            "l2 must be .*got str 'big'",
        ),
        (lambda: lr.fit(np.zeros((0, 3)), []), ValueError, r"X is empty \(shape \(0, 3\)\)"),
        (lambda: lr.fit(_X, _Y, contexts=["dev0", "gpu_z"]), ValueError, "unknown context 'gpu_z'.*dev0"),
        (lambda: lr.fit(_X, _Y, solver="sgd"), ValueError, "solver='sgd'; use 'auto'"),
        (
            lambda: lr.fit(_X, _Y, max_iter=0),
            ValueError,
            "max_iter=0 is out of range; max_iter must be a whole",
        ),
        (
            lambda: lr.fit(_X, _Y, tol=0),
            ValueError,
            "tol=0 is out of range; tol must be",
        ),
        (lambda: lr.fit(_X, _Y, l2=0.1, C=1.0), ValueError, "give l2= or C=, not both"),
        (lambda: lr.fit(_X, _Y, C=0), ValueError, "C=0 is out of range; C must be a number above 0"),
        (lambda: lr.fit(_X.astype(str), _Y), TypeError, "dtype <U.*features must be real numbers"),
        (lambda: lr.fit(_X, _Y[:, None]), ValueError, r"y must be 1-D.*use y.ravel\(\)"),
        (
            lambda: lr.fit(_X, _Y, sample_weight=-np.ones(20)),
            ValueError,
            r"sample_weight\[0\] is -1.0; every weight must be finite and >= 0",
        ),
        (
            lambda: lr.fit(_X, _Y, init=(np.zeros(4), 0.0)),
            ValueError,
            r"init has w of shape \(4,\).*needs w \(3,\)",
        ),
        (lambda: lr.fit_many(_X, _Y, l2=[]), ValueError, "l2 is an empty list; give one value per model"),
        (lambda: lr.fit_many(_X, _Y, l2=0.1), ValueError, "nothing to sweep"),
        (
            lambda: lr.fit_many(_X, _Y, rows=[[0, 1, 99]]),
            ValueError,
            r"rows\[0\] has index 99, but X has 20 rows",
        ),
        (lambda: lr.fit_many(_X, _Y, rows=[]), ValueError, "rows is an empty list"),
        (
            lambda: lr.fit_many(_X, _Y, l2=[0.1, 0.2], rows=[[0, 1]]),
            ValueError,
            "l2 has 2 values but rows has 1",
        ),
        (
            lambda: lr.fit_per_device({"dev9x": (_X, _Y)}),
            ValueError,
            "unknown context 'dev9x'; the contexts are dev0",
        ),
        (lambda: lr.fit_per_device({}), ValueError, "no data"),
        (
            lambda: lr.fit_per_device({"dev0": _X}),
            TypeError,
            "data for context 'dev0' is a ndarray; expected a pair",
        ),
        (
            lambda: lr.fit_per_device(lambda c: (_X[:, 0], _Y), contexts=2),
            ValueError,
            r"X for context 'dev0' must be 2-D",
        ),
        (
            lambda: lr.fit_per_device(lambda c: (_X, _Y[:5]), contexts=2),
            ValueError,
            "X has 20 rows but y for context 'dev0' has 5 labels",
        ),
        (
            lambda: lr.fit_per_device(lambda c: _X, contexts=1),
            TypeError,
            "data function returned, for context 'dev0'",
        ),
        (
            lambda: lr.fit_per_device({"dev0": (_X, _Y)}, l2={"dev1": 0.1}),
            ValueError,
            r"l2= as a mapping must have one entry per context \(1 context\(s\): dev0\); "
            r"unknown: \['dev1'\]. "
            r"missing: \['dev0'\]",
        ),
        (lambda: lr.fit_per_device([(_X, _Y)]), TypeError, "data must be a mapping"),
        (lambda: lr.fit(_X, _Y, progress="yes"), TypeError, "progress='yes'"),
    ],
)
def test_bad_input_is_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_predict_checks_the_feature_count(small):
    X, y = small
    m = lr.fit(X, y, l2=0.01, contexts=1)
    with pytest.raises(
        ValueError, match=r"X has 4 features \(shape \(3, 4\)\), but the model was fitted on 5"
    ):
        lr.predict(m, X[:3, :4])
    with pytest.raises(ValueError, match=r"X must be 2-D .*reshape\(1, -1\)"):
        lr.predict_proba(m, X[0])
    with pytest.raises(TypeError, match=r"must be a model from mg\.logreg\.fit"):
        lr.predict((m.w, m.b), X)


@settings(max_examples=200, deadline=None)
@given(
    hnp.arrays(
        st.sampled_from([np.int8, np.uint8, np.int32, np.int64, np.uint64, np.bool_]),
        st.integers(1, 60),
    )
)
def test_label_counting_matches_sorting(y):
    classes, index = _checks.distinct(y)
    want, want_index = np.unique(y, return_inverse=True)
    assert classes.dtype == want.dtype and classes.tolist() == want.tolist()
    assert index.tolist() == want_index.tolist()


def test_label_counting_keeps_huge_unsigned_labels():
    y = np.array([2**64 - 1, 2**64 - 2, 2**64 - 1], np.uint64)
    classes, index = _checks.distinct(y)
    assert classes.tolist() == [2**64 - 2, 2**64 - 1] and index.tolist() == [1, 0, 1]


def test_lbfgs_picks_step_lengths_that_converge_in_few_iterations():
    # Newton's method on the step length (on the scores, no pass over X) lands near the line's
    # minimum: 6 iterations here, where unit steps with backtracking took 8.
    rng = np.random.default_rng(1)
    X = rng.standard_normal((5000, 50), dtype=np.float32)
    y = (X @ (rng.standard_normal(50) * 2 / np.sqrt(50)) + rng.logistic(size=5000) > 0).astype(int)
    m = lr.fit(X, y, C=1.0, solver="lbfgs", contexts=1, progress=False)
    assert bool(m.info.converged) and int(m.info.iterations) <= 6
    assert np.all(np.diff(m.info.history()) <= 16 * np.finfo(np.float32).eps)  # never up, but for rounding
    sk = LogisticRegression(C=1.0, tol=1e-8, max_iter=1000).fit(X, y)
    l2 = 1 / (2 * 5000)
    assert lr.objective(m, X, y, l2) <= lr.objective(_sk_model(sk), X, y, l2) * (1 + 1e-6)
