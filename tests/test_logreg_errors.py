"""Bad input to logistic regression gets a clear error; Ctrl-C during a fit returns at once."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python

import mgkit as mg

lr = mg.logreg

X4 = np.array([[-2.0, 1.0], [-1.0, 0.0], [1.0, 1.0], [2.0, 0.0]])
Y4 = np.array([0, 0, 1, 1])


@pytest.fixture(scope="module")
def model():
    return lr.fit(X4, Y4, l2=0.01, contexts=1)


# -- values of the wrong kind --------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "said"),
    [
        (["a", "b", "c", "d"], r"sample_weight has dtype <U1 \(e\.g\. 'a'\)"),
        ([1, None, 1, 1], r"sample_weight has dtype object \(e\.g\. None\)"),
        (np.ones(4) * 1j, r"sample_weight has dtype complex128"),
        ({"a": 1}, r"sample_weight is a dict"),
    ],
)
def test_sample_weight_of_the_wrong_kind(weights, said):
    with pytest.raises(TypeError, match=said + r".*expected 4 real numbers >= 0, one weight per row"):
        lr.fit(X4, Y4, sample_weight=weights)


def test_sample_weight_negative_or_infinite_names_the_row():
    with pytest.raises(ValueError, match=r"sample_weight\[1\] is inf; .*finite and >= 0"):
        lr.fit(X4, Y4, sample_weight=[1, np.inf, 1, 1])
    with pytest.raises(ValueError, match=r"sample_weight\[2\] is -1.0; .*finite and >= 0"):
        lr.fit(X4, Y4, sample_weight=[1, 1, -1, 1])
    with pytest.raises(ValueError, match=r"sample_weight\[0\] is nan"):
        lr.fit(X4, Y4, sample_weight=[np.nan, 1, 1, 1])


@pytest.mark.parametrize("call", ["predict", "predict_proba", "decision_function", "predict_index"])
def test_prediction_of_strings(model, call):
    with pytest.raises(TypeError, match=rf"^{call}: X has dtype <U1; .*real numbers.*astype\(np\.float32\)"):
        getattr(lr, call)(model, np.array([["a", "b"]]))
    with pytest.raises(TypeError, match=rf"^{call}: X has dtype object"):
        getattr(lr, call)(model, [[1.0, None]])
    with pytest.raises(TypeError, match=rf"^{call}: X cannot be read as an array"):
        getattr(lr, call)(model, [[1.0, 2.0], [3.0]])


KINDS = [  # the models the fits make, built from the binary fit (the same shapes, no compiles)
    "binary",
    "multiclass",
    "string labels",
    "stacked binary (fit_many)",
    "stacked multiclass (fit_many)",
    "per device (fit_per_device)",
]
PREDICTIONS = ["decision_function", "predict_proba", "predict_index", "predict", "score"]


@pytest.fixture(scope="module")
def kinds(model):
    w, b = np.asarray(model.w), np.asarray(model.b)
    multi = model._replace(w=jnp.zeros((2, 3)), b=jnp.zeros(3), classes=np.array([0, 1, 2]))
    on = lambda m, ctx: m._replace(w=mg.put(m.w, ctx), b=mg.put(m.b, ctx))  # noqa: E731
    return {
        "binary": model,
        "multiclass": multi,
        "string labels": model._replace(classes=np.array(["no", "yes"])),
        "stacked binary (fit_many)": model._replace(w=jnp.stack([w, w]), b=jnp.stack([b, b])),
        "stacked multiclass (fit_many)": multi._replace(w=jnp.zeros((2, 2, 3)), b=jnp.zeros((2, 3))),
        "per device (fit_per_device)": {"dev1": on(multi, "dev1"), "dev2": on(model, "dev2")},
    }


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("call", PREDICTIONS)
def test_every_prediction_of_every_kind_of_model_names_the_function_called(kinds, kind, call):
    fn = getattr(lr, call)
    rest = (np.zeros(1),) if call == "score" else ()
    models = kinds[kind]
    if isinstance(models, dict):  # fit_per_device's dict: each of its models, and the dict itself
        with pytest.raises(
            TypeError,
            match=rf"^{call}: the first argument must be a model .*got dict of 2 models \(fit_per_device's, "
            rf"one per context\); call {call} with one of them, e.g\. {call}\(models\['dev1'\], \.\.\.\)",
        ):
            fn(models, np.array([["a", "b"]]), *rest)
        models = models["dev2"]
    for X, said in [
        (np.array([["a", "b"]]), r"X has dtype <U1; features must be real numbers"),
        ([["a", "b"]], r"X has dtype <U1"),
        ([[1.0, None]], r"X has dtype object"),
        (np.ones((1, 3)), r"X has 3 features \(shape \(1, 3\)\), but the model was fitted on 2"),
        (np.full((1, 2), np.nan), r"X has 2 NaN or infinite value\(s\)"),
    ]:
        with pytest.raises((TypeError, ValueError), match=rf"^{call}: {said}"):
            fn(models, X, *rest)


def test_score_of_strings(model):
    with pytest.raises(TypeError, match=r"^score: X has dtype <U1"):
        lr.score(model, np.array([["a", "b"]]), [0])
    with pytest.raises(
        TypeError, match=r"^score: y has labels of dtype <U3 .*'yes'.* the model's classes are \[0, 1\]"
    ):
        lr.score(model, X4, ["yes", "no", "yes", "no"])


def test_objective_checks_its_arguments(model):
    with pytest.raises(
        ValueError, match=r"^objective: X has 3 features \(shape \(4, 3\)\), but the model was fitted on 2"
    ):
        lr.objective(model, np.ones((4, 3)), Y4, 0.1)
    with pytest.raises(ValueError, match=r"^objective: X must be 2-D"):
        lr.objective(model, np.ones(4), Y4, 0.1)
    with pytest.raises(TypeError, match=r"^objective: X has dtype <U1"):
        lr.objective(model, np.array([["a", "b"]]), [0], 0.1)
    with pytest.raises(ValueError, match=r"^objective: X has 4 rows but y has 3 labels"):
        lr.objective(model, X4, [0, 0, 1], 0.1)
    with pytest.raises(
        ValueError,
        match=r"^objective: y has labels the model was not fitted on: \[5\]; its classes are \[0, 1\]",
    ):
        lr.objective(model, X4, [0, 0, 5, 1], 0.1)
    with pytest.raises(TypeError, match=r"^objective: l2 must be a finite number at least 0 .*got str 'a'"):
        lr.objective(model, X4, Y4, "a")
    with pytest.raises(TypeError, match=r"^objective: the first argument must be a model .*got str"):
        lr.objective("x", X4, Y4, 0.1)


def test_unstack_of_a_non_model(model):
    with pytest.raises(
        TypeError, match=r"^unstack: models must be a Model from mg\.logreg\.fit_many, got str"
    ):
        lr.unstack("x")
    with pytest.raises(TypeError, match=r"got tuple"):
        lr.unstack((model.w, model.b))
    assert len(lr.unstack(model)) == 1


# -- silent garbage ------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["predict", "predict_proba", "decision_function", "predict_index"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_prediction_of_nan_or_inf_raises(model, call, bad):
    X = X4.copy()
    X[2, 1] = bad
    said = rf"^{call}: X has 1 NaN or infinite value\(s\), the first at row 2, column 1 \(value {bad}\)"
    with pytest.raises(ValueError, match=said):
        getattr(lr, call)(model, X)
    with pytest.raises(ValueError, match=said):  # on a device too
        getattr(lr, call)(model, jnp.asarray(X, jnp.float32))


def test_score_of_nan_raises(model):
    X = X4.copy()
    X[0, 0] = np.nan
    with pytest.raises(
        ValueError, match=r"^score: X has 1 NaN or infinite value\(s\), the first at row 0, column 0"
    ):
        lr.score(model, X, Y4)


def test_prediction_under_jit_is_not_checked(model):
    """Traced values cannot be read: under jax.jit prediction stays pure and NaN gives NaN."""
    X = X4.copy()
    X[1, 0] = np.nan
    proba = jax.jit(lambda x: lr.predict_proba(model, x))(X)
    assert np.isnan(np.asarray(proba)[1]).all() and np.isfinite(np.asarray(proba)[[0, 2, 3]]).all()
    assert jax.jit(lambda x: lr.predict(model, x))(X4).tolist() == [0, 0, 1, 1]


def test_large_finite_scores_are_not_an_error(model):
    """Huge finite features overflow the scores to inf, but the prediction is still right."""
    X = np.array([[3e38, 0.0], [-3e38, 0.0]], np.float32)
    assert lr.predict(model, X).tolist() == [1, 0]


def test_huge_sample_weights_fit_as_their_ratios():
    """Only ratios of weights matter (the objective is their weighted mean): 4e38 in all
    overflows float32, and fits as the same weights scaled down."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 3))
    y = (X[:, 0] + 0.5 * rng.normal(size=64) > 0).astype(int)
    w = rng.uniform(0.5, 2.0, 64)
    ref = lr.fit(X, y, l2=1e-2, sample_weight=w)
    for scale in (1e38, 1e300, 1e-300):
        m = lr.fit(X, y, l2=1e-2, sample_weight=w * scale)
        assert bool(m.info.converged)
        np.testing.assert_allclose(np.asarray(m.w), np.asarray(ref.w), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(float(m.b), float(ref.b), rtol=1e-4, atol=1e-5)
    # C counts the weights' sum as scikit-learn does: the penalty scales with it
    m = lr.fit(X, y, C=1.0, sample_weight=w * 1e38)
    assert float(m.info.l2) == pytest.approx(1 / (2 * 1e38 * w.sum()), rel=1e-5)


# -- C=np.inf: no penalty ------------------------------------------------------------------


def test_c_inf_means_no_penalty():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(40, 2))
    y = (X[:, 0] + rng.normal(size=40) > 0).astype(int)
    ref = lr.fit(X, y, l2=0.0)
    m = lr.fit(X, y, C=np.inf)
    assert float(m.info.l2) == 0.0
    np.testing.assert_allclose(np.asarray(m.w), np.asarray(ref.w), rtol=1e-5)
    many = lr.fit_many(X, y, C=[1.0, np.inf])
    assert np.asarray(many.info.l2).tolist() == [pytest.approx(1 / 80), 0.0]
    np.testing.assert_allclose(np.asarray(many.w[1]), np.asarray(ref.w), rtol=1e-3, atol=1e-4)
    each = lr.fit_per_device({"dev0": (X, y), "dev1": (X, y)}, C={"dev0": np.inf, "dev1": 1.0})
    assert float(each["dev0"].info.l2) == 0.0 and float(each["dev1"].info.l2) == pytest.approx(1 / 80)
    boot = lr.fit_many(X, y, C=np.inf, rows=[np.arange(40), np.arange(20)])
    assert np.asarray(boot.info.l2).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("C", [0, -1.0, np.nan, -np.inf, "1", True])
def test_c_still_rejects_other_values(C):
    wrong_type = isinstance(C, bool | str)
    with pytest.raises(TypeError if wrong_type else ValueError) as info:
        lr.fit(X4, Y4, C=C)
    said = f"got {type(C).__name__} {C!r}" if wrong_type else f"C={C!r} is out of range"
    assert said in str(info.value) and str(info.value).startswith("logreg.fit: ")
    assert "C must be a number above 0 (scikit-learn's inverse penalty; C=np.inf: none)" in str(info.value)


# -- Ctrl-C --------------------------------------------------------------------------------

_INTERRUPT = """
import os, signal, sys, threading, time, warnings
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np
import mgkit as mg
mg.use_contexts(";".join(f"dev{{i}}->cpu{{i}}" for i in range(8)), verbose=False)
warnings.simplefilter("ignore")
lr = mg.logreg
rng = np.random.default_rng(0)
X = rng.normal(size=(2000, 10)).astype(np.float32)
y = (X[:, 0] + rng.normal(size=2000) > 0).astype(int)
many = [float(v) for v in np.logspace(-12, -11, 16)]
kw = dict(solver={solver!r}, tol=1e-30, max_iter=10**5, progress=False)
def long():
    if {which!r} == "fit":
        lr.fit(X, y, l2=1e-12, **kw)
    elif {which!r} == "fit_many":
        lr.fit_many(X, y, l2=many, **kw)
    else:
        lr.fit_per_device(lambda ctx: (X, y), l2=1e-12, **kw)
def small():
    t = time.perf_counter()
    lr.fit(X[:50], y[:50], l2=0.1, progress=False)
    return time.perf_counter() - t
def compiles_done():  # compiles an interrupt left running go on in helper threads
    end = time.perf_counter() + 200
    while any(t.name == "mgkit-compile" for t in threading.enumerate()) and time.perf_counter() < end:
        time.sleep(0.05)
small()
# attempts 0 and 1 compile the long fit's first and resuming programs (interrupted there,
# the compile goes on in the background, and is awaited); 2 interrupts a running chunk
for attempt in range(3):
    timer = threading.Timer(1.0, lambda: {interrupt})
    t = time.perf_counter()
    timer.start()
    try:
        long()
        raise SystemExit("the fit ended before the interrupt")
    except KeyboardInterrupt:
        late = time.perf_counter() - t - 1.0
    next_fit = small()
    compiles_done()
    time.sleep(0.5)  # the call in flight ends on its own: a chunk, not the rest of the fit
    cpu = time.process_time()
    time.sleep(1.0)
    busy = time.process_time() - cpu  # CPU seconds spent by abandoned work in the second after
    print("interrupt", attempt, round(late, 3), "next fit", round(next_fit, 3), "busy", round(busy, 3))
sys.stdout.flush()
os._exit(0)  # XLA's CPU runtime can abort at exit after an interrupted call (not what is tested here)
"""


_SIGINT = "os.kill(os.getpid(), signal.SIGINT)"
_INTERRUPT_MAIN = "__import__('_thread').interrupt_main()"  # what some front ends use: no signal


@pytest.mark.parametrize(
    ("which", "solver", "interrupt"),
    [
        ("fit", "gd", _INTERRUPT_MAIN),  # wakes no waiting thread: the wait must look for it itself
        ("fit", "lbfgs", _SIGINT),
        ("fit", "newton", _SIGINT),
        ("fit_many", "gd", _SIGINT),
        ("fit_per_device", "lbfgs", _SIGINT),
    ],
    ids=["fit-gd-interrupt_main", "fit-lbfgs", "fit-newton", "fit_many-gd", "fit_per_device-lbfgs"],
)
def test_ctrl_c_returns_at_once_and_the_next_fit_does_not_wait(which, solver, interrupt):
    proc = run_python(_INTERRUPT.format(which=which, solver=solver, interrupt=interrupt), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln.split() for ln in proc.stdout.splitlines() if ln.startswith("interrupt")]
    assert len(lines) == 3, proc.stdout
    for line in lines:
        late, next_fit, busy = float(line[2]), float(line[5]), float(line[7])
        assert late < 1.0, proc.stdout  # Ctrl-C returned within a second, compiling or running
        assert next_fit < 1.5, proc.stdout  # the next fit waited for no abandoned work
        assert busy < 0.3, proc.stdout  # and none was left running a second later


def test_no_warning_leaks_from_these_checks(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lr.predict(model, X4).tolist() == [0, 0, 1, 1]
        assert float(lr.score(model, X4, Y4)) == 1.0
