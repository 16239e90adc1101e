"""mg.Trainer: the same parameters as one device on any number of contexts, the loop path,
interrupts, NaN, data sources, events and bad input."""

import _thread
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import psutil
import pytest

import mgkit as mg
from mgkit.train import _data
from tests.conftest import child_env

STEPS = 200


def _problem(n=600, d=12, c=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)).astype(np.float32)
    W = rng.normal(size=(d, c)).astype(np.float32)
    y = np.argmax(X @ W + 0.5 * rng.normal(size=(n, c)), axis=1).astype(np.int32)
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {
        "w1": jax.random.normal(k1, (d, 16)) * 0.3,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, c)) * 0.3,
        "b2": jnp.zeros(c),
    }
    return {"x": X, "y": y}, params


def _loss(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    logits = h @ p["w2"] + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _one_device(params, data, optimizer, steps, batch_size, seed=0):
    """The same training in plain JAX on one device, on the same batches."""
    src = _data.ArraySource(data, batch_size, True, seed, 1, "test")
    state = optimizer.init(params)

    @jax.jit
    def step(p, s, b):
        loss, g = jax.value_and_grad(_loss)(p, b)
        u, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    for i in range(steps):
        params, state, _ = step(params, state, src.next(i))
    return jax.device_get(params)


def _close(got, want, rtol=1e-5, atol=1e-6):
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=rtol, atol=atol, err_msg=k)


@pytest.mark.parametrize("batch_size", [96, 100])  # 100: uneven over 3, 7 and 8 contexts
def test_any_number_of_contexts_gives_one_devices_parameters(batch_size):
    data, params = _problem()
    opt = optax.adam(1e-2)
    want = _one_device(params, data, opt, STEPS, batch_size)
    for k in (1, 2, 3, 4, 8):
        tr = mg.Trainer(_loss, opt, params, contexts=k)
        hist = tr.fit(data, steps=STEPS, batch_size=batch_size, progress=False)
        assert tr.step == STEPS and len(hist) == STEPS and tr.spmd
        _close(jax.device_get(tr.params), want)
        assert hist.loss[-1] < 0.5 * hist.loss[0]
        assert mg.where(jax.tree_util.tree_leaves(tr.params)[0]) == "+".join(f"dev{i}" for i in range(k))


def test_contexts_sharing_a_device_run_the_gather_update_copy_loop_with_the_same_result():
    data, params = _problem()
    opt = optax.adam(1e-2)
    want = _one_device(params, data, opt, 60, 100)
    mg.use_contexts("a->cpu0;b->cpu0;c->cpu1", verbose=False)
    tr = mg.Trainer(_loss, opt, params)
    assert not tr.spmd and "gather-update-copy loop" in repr(tr)
    tr.fit(data, steps=60, batch_size=100, progress=False)
    _close(jax.device_get(tr.params), want)
    mg.ledger().flush()
    kinds = {(k, s, d) for k, s, d, *_ in mg.ledger().summary().rows()}
    assert ("gather", "c", "a") in kinds and ("replicate", "a", "c") in kinds
    assert ("gather", "b", "a") not in kinds  # b shares a's device: nothing to move


def test_two_fits_are_one_fit():
    data, params = _problem()
    opt = optax.adam(1e-2)
    one = mg.Trainer(_loss, opt, params)
    one.fit(data, steps=40, batch_size=64, progress=False)
    two = mg.Trainer(_loss, opt, params)
    two.fit(data, steps=25, batch_size=64, progress=False)
    two.fit(data, steps=15, batch_size=64, progress=False)
    assert two.step == 40
    for a, b in zip(
        jax.tree_util.tree_leaves(one.params), jax.tree_util.tree_leaves(two.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_callers_params_are_never_donated():
    data, params = _problem()
    tr = mg.Trainer(_loss, optax.sgd(0.1), params)
    tr.fit(data, steps=3, batch_size=64, progress=False)
    np.testing.assert_array_equal(np.asarray(params["b1"]), 0.0)  # still readable, unchanged


def test_each_step_records_one_step_event_per_context_and_the_batches_placement():
    data, params = _problem()
    tr = mg.Trainer(_loss, optax.sgd(0.1), params, contexts=4)
    hist = tr.fit(data, steps=5, batch_size=40, progress=False)
    mg.ledger().flush()
    steps = mg.ledger().records("step")
    assert len(steps) == 5 * 4 and {e.src for e in steps} == {"dev0", "dev1", "dev2", "dev3"}
    last = steps[-1].info
    assert last["iteration"] == 5 and last["loss"] == pytest.approx(hist.loss[-1])
    assert last["samples_per_second"] > 0
    splits = mg.ledger().records("split")
    assert {e.dst for e in splits} == {"dev0", "dev1", "dev2", "dev3"} and len(splits) == 5 * 4
    assert "5 step(s) on 4 context(s)" in repr(hist)


def test_history_plots_loss_and_samples_per_second():
    import matplotlib

    matplotlib.use("Agg")
    data, params = _problem()
    hist = mg.Trainer(_loss, optax.sgd(0.1), params, contexts=2).fit(
        data, steps=6, batch_size=32, progress=False
    )
    fig = hist.plot()
    assert fig.axes[0].get_title() == "loss" and len(fig.axes[1].lines) == 2
    assert hist.samples_per_second.shape == (6,) and set(hist.per_context()) == {"dev0", "dev1"}


def test_has_aux_and_a_function_and_an_iterable_as_data():
    data, params = _problem()

    def loss_aux(p, b):
        loss = _loss(p, b)
        return loss, {"double": 2 * loss}

    tr = mg.Trainer(loss_aux, optax.sgd(0.1), params, has_aux=True)
    tr.fit(lambda step: {"x": data["x"][:64], "y": data["y"][:64]}, steps=3, progress=False)
    assert tr.step == 3
    batches = [{"x": data["x"][i : i + 50], "y": data["y"][i : i + 50]} for i in range(0, 200, 50)]
    hist = tr.fit(batches, progress=False)  # until the list ends: no warning
    assert tr.step == 7 and len(hist) == 4 and hist.stopped == "data ran out"
    with pytest.warns(_data_warning(), match=r"the data ended after 4 of 10 step\(s\).*state of step 11"):
        tr.fit(iter(batches), steps=10, progress=False)
    assert tr.step == 11


def _data_warning():
    return mg.train.DataRanOut


@pytest.mark.parametrize("on_nan", ["raise", "skip"])
def test_a_nan_loss_keeps_the_last_good_parameters(on_nan):
    data, params = _problem()
    bad = {"x": data["x"][:64].copy(), "y": data["y"][:64]}
    bad["x"][3, 2] = np.nan
    good = {"x": data["x"][64:128], "y": data["y"][64:128]}

    def batches(step):
        return bad if step == 3 else good

    tr = mg.Trainer(_loss, optax.sgd(0.1), params, on_nan=on_nan, contexts=4)
    if on_nan == "raise":
        with pytest.raises(FloatingPointError, match=r"step 3's loss is nan.*not applied.*on_nan='skip'"):
            tr.fit(batches, steps=5, progress=False)
        assert tr.history.stopped == "nan"
    else:
        with pytest.warns(mg.train.StepsSkipped, match=r"1 of 5 step\(s\)"):
            hist = tr.fit(batches, steps=5, progress=False)
        assert hist.skipped == 1
        assert np.isnan(hist.loss[2]) and np.isfinite(hist.loss[[0, 1, 3, 4]]).all()
    for leaf in jax.tree_util.tree_leaves(tr.params):
        assert np.isfinite(np.asarray(leaf)).all()


@pytest.mark.parametrize("contexts", ["a->cpu0;b->cpu1;c->cpu2", "a->cpu0;b->cpu0;c->cpu1"])
def test_a_finite_loss_with_a_nan_gradient_is_not_applied(contexts):
    """jnp.where's trap: sqrt at 0 behind a where gives a finite loss and a NaN gradient. Both
    step paths (one SPMD program; the gather-update-copy loop) leave such an update out."""
    mg.use_contexts(contexts, verbose=False)

    def loss(p, b):
        r = b["x"] @ p["w"]
        safe = jnp.where(r > 0, jnp.sqrt(jnp.abs(r)), 0.0)  # d/dr sqrt(|r|) at r = 0: inf * 0
        return jnp.mean((safe - b["y"]) ** 2)

    x = np.ones((6, 2), np.float32)
    good = {"x": x, "y": np.ones(6, np.float32)}
    bad = {"x": np.zeros((6, 2), np.float32), "y": np.ones(6, np.float32)}
    params = {"w": jnp.array([0.3, 0.2])}
    out = jax.grad(loss)(params, bad)["w"]
    assert not np.isfinite(np.asarray(out)).all()  # the trap is real
    tr = mg.Trainer(loss, optax.sgd(0.1), params, on_nan="skip")
    with pytest.warns(mg.train.StepsSkipped):
        hist = tr.fit(lambda step: bad if step == 2 else good, steps=3, progress=False)
    assert np.isnan(hist.loss[1]) and np.isfinite(hist.loss[[0, 2]]).all()
    assert np.isfinite(np.asarray(tr.params["w"])).all()
    tr = mg.Trainer(loss, optax.sgd(0.1), params)
    with pytest.raises(FloatingPointError, match=r"step 2's loss is .*or a gradient is not finite"):
        tr.fit(lambda step: bad if step == 2 else good, steps=3, progress=False)
    # step 2 ran without its update: the next fit goes on past the bad batch
    assert tr.step == 2 and np.isfinite(np.asarray(tr.params["w"])).all()


@pytest.mark.parametrize("contexts", ["a->cpu0;b->cpu1;c->cpu2", "a->cpu0;b->cpu0;c->cpu1"])
def test_on_nan_apply_runs_the_step_without_its_guard(contexts):
    """on_nan='apply': no guard in the step (both paths), every update applied as a hand-written
    step would; a non-finite loss still stops the fit, saying the state now holds that update."""
    mg.use_contexts(contexts, verbose=False)
    data, params = _problem()
    bad = {"x": data["x"][:60].copy(), "y": data["y"][:60]}
    bad["x"][3, 2] = np.nan
    good = {"x": data["x"][60:120], "y": data["y"][60:120]}
    tr = mg.Trainer(_loss, optax.sgd(0.1), params, on_nan="apply")
    same = mg.Trainer(_loss, optax.sgd(0.1), params)  # guarded: the same steps while all is finite
    np.testing.assert_allclose(
        tr.fit(good, steps=2, progress=False).loss, same.fit(good, steps=2, progress=False).loss, rtol=1e-6
    )
    with pytest.raises(FloatingPointError, match=r"step 3's loss is nan.*on_nan='apply'.*update was applied"):
        tr.fit(lambda step: bad, steps=1, progress=False)
    assert tr.history.stopped == "nan" and tr.step == 3
    assert not np.isfinite(np.asarray(tr.params["w1"])).all()  # the update is in the state


def test_half_precision_gradients_with_a_large_sum_are_applied():
    """The finiteness flag sums each gradient in float32: 60,000 float16 gradients of 2 each sum
    past float16's largest value (65,504), and the update still applies."""
    params = {"w": jnp.zeros(60_000, jnp.float16)}

    def loss(p, b):
        return jnp.sum(2.0 * p["w"] * b["x"][0, 0]).astype(jnp.float32) + b["x"].mean() * 0

    tr = mg.Trainer(loss, optax.sgd(1e-3), params, contexts=2)
    hist = tr.fit({"x": np.ones((8, 1), np.float32)}, steps=2, batch_size=4, progress=False)
    assert np.isfinite(hist.loss).all() and tr.step == 2
    np.testing.assert_allclose(np.asarray(tr.params["w"], np.float32), -4e-3, rtol=1e-2)


def test_ctrl_c_stops_at_a_step_boundary_and_the_next_fit_goes_on():
    data, params = _problem()
    tr = mg.Trainer(_loss, optax.adam(1e-2), params)
    seen = []

    def batches(step):
        seen.append(step)
        if step == 30 and seen.count(30) == 1:
            threading.Timer(0.0, _thread.interrupt_main).start()
            time.sleep(0.05)
        return {"x": data["x"][:64], "y": data["y"][:64]}

    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt, match="stopped at step"):
        tr.fit(batches, steps=10_000, progress=False)
    assert time.perf_counter() - t0 < 30
    stopped = tr.step
    # the loader asks for batches up to prefetch + 1 steps ahead of the step that runs
    assert 30 - 3 <= stopped <= 32 and len(tr.history) == stopped and tr.history.stopped == "interrupted"
    for leaf in jax.tree_util.tree_leaves(tr.params):  # never a donated buffer
        assert np.isfinite(np.asarray(leaf)).all()
    tr.fit(batches, steps=5, progress=False)
    assert tr.step == stopped + 5


@pytest.mark.timeout(240)
def test_two_thousand_steps_on_eight_simulated_devices_do_not_deadlock():
    data, params = _problem(n=256)
    tr = mg.Trainer(_loss, optax.sgd(0.05), params)
    hist = tr.fit(data, steps=2000, batch_size=64, progress=False)
    assert tr.step == 2000 and np.isfinite(hist.loss).all()


_CHILD = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import mgkit as mg
    mg.simulate(8)
    import jax, jax.numpy as jnp, optax
    mg.use_contexts(";".join(f"d{i}->cpu{i}" for i in range(8)), verbose=False)
    X = np.random.default_rng(0).normal(size=(4096, 64)).astype(np.float32)
    params = {"w": jnp.zeros((64, 64)), "v": jnp.zeros(64)}
    def loss_fn(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w"]) @ p["v"] - b["x"][:, 0]) ** 2)
    tr = mg.Trainer(loss_fn, optax.adam(1e-3), params)
    tr.fit({"x": X}, steps=2, batch_size=512, progress=False)
    print("ready", flush=True)
    try:
        tr.fit({"x": X}, steps=10**7, batch_size=512, progress=False)
    except KeyboardInterrupt:
        t = time.perf_counter()
        print("stopped", tr.step, len(tr.history), float(np.asarray(tr.params["v"]).sum()), flush=True)
        tr.fit({"x": X}, steps=3, batch_size=512, progress=False)
        print("again", tr.step, time.perf_counter() - t, flush=True)
    os._exit(0)
    """
)


def test_sigint_in_a_subprocess_returns_within_a_second_with_a_consistent_state(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        sent = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        line = proc.stdout.readline().split()
        waited = time.perf_counter() - sent
        assert line[0] == "stopped", proc.stderr.read()
        step, steps = int(line[1]), int(line[2])
        assert waited < 1.0 + 0.5 and step == steps + 2 and np.isfinite(float(line[3]))
        again = proc.stdout.readline().split()
        assert again[0] == "again" and int(again[1]) == step + 3
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE


# -- bad input ---------------------------------------------------------------------------------

_DATA, _PARAMS = _problem(n=64)


def _fit(**kw):
    tr = mg.Trainer(
        kw.pop("loss_fn", _loss),
        kw.pop("opt", optax.sgd(0.1)),
        kw.pop("params", _PARAMS),
        **kw.pop("init", {}),
    )
    return tr.fit(kw.pop("data", _DATA), progress=False, **kw)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda: mg.Trainer("loss", optax.sgd(0.1), _PARAMS),
            TypeError,
            r"loss_fn must be a function.*got str",
        ),
        (lambda: mg.Trainer(_loss, "adam", _PARAMS), TypeError, r"optax GradientTransformation.*got str"),
        (
            lambda: mg.Trainer(_loss, optax.sgd, _PARAMS),
            TypeError,
            r"optax GradientTransformation.*got function",
        ),
        (
            lambda: mg.Trainer(_loss, optax.sgd(0.1), {"w": 1.0}),
            TypeError,
            r"params leaf \['w'\] is a Python float \(1.0\): is it a parameter",
        ),
        (
            lambda: mg.Trainer(_loss, optax.sgd(0.1), {"w": np.arange(3)}),
            TypeError,
            r"\['w'\] has dtype int64.*floating",
        ),
        (lambda: mg.Trainer(_loss, optax.sgd(0.1), {}), ValueError, r"params has no arrays"),
        (
            lambda: mg.Trainer(_loss, optax.sgd(0.1), {"w": ["a"]}),
            ValueError,
            r"params has no arrays \(its leaves \['w'\]\[0\] \(str 'a'\) are not arrays",
        ),
        (
            lambda: mg.Trainer(_loss, optax.sgd(0.1), _PARAMS, on_nan="ignore"),
            ValueError,
            r"on_nan='ignore'.*'skip'.*'apply'",
        ),
        (lambda: mg.Trainer(_loss, optax.sgd(0.1), _PARAMS, contexts=["nope"]), mg.ContextError, r"nope"),
        (lambda: mg.Trainer(_loss, optax.sgd(0.1), _PARAMS, seed=-1), ValueError, r"seed"),
        (lambda: mg.Trainer(_loss, optax.sgd(0.1), _PARAMS, balance="fast"), ValueError, r"balance='fast'"),
        (lambda: _fit(steps=0), ValueError, r"steps"),
        (lambda: _fit(steps=-5), ValueError, r"steps"),
        (lambda: _fit(steps=2.5), TypeError, r"steps"),
        (lambda: _fit(batch_size=65), ValueError, r"batch_size=65 is larger than the data \(64 rows\)"),
        (lambda: _fit(batch_size=4), ValueError, r"batch_size=4 is smaller than the 8 contexts"),
        (lambda: _fit(batch_size=0), ValueError, r"batch_size"),
        (
            lambda: _fit(data={"x": _DATA["x"], "y": _DATA["y"][:10]}),
            ValueError,
            r"different row counts.*\['x'\]: 64.*\['y'\]: 10",
        ),
        (lambda: _fit(data={"x": _DATA["x"][:0], "y": _DATA["y"][:0]}), ValueError, r"0 rows"),
        (lambda: _fit(data=None), TypeError, r"data is None"),
        (lambda: _fit(data=5), ValueError, r"scalar"),
        (lambda: _fit(data=lambda s: _DATA), TypeError, r"say how many steps"),
        (
            lambda: _fit(data=lambda s: _DATA, steps=2, batch_size=8),
            TypeError,
            r"batch_size=8 applies to arrays",
        ),
        (lambda: _fit(steps=3, epochs=1), TypeError, r"steps= or epochs=, not both"),
        (lambda: _fit(data=iter([_DATA]), epochs=2), TypeError, r"epochs= needs arrays"),
        (
            lambda: _fit(loss_fn=lambda p, b: _loss(p, b) * jnp.ones(3)),
            TypeError,
            r"must return a scalar.*shape \(3,\)",
        ),
        (
            lambda: _fit(loss_fn=lambda p, b: jnp.sum(b["y"])),
            TypeError,
            r"returned a int32 scalar.*floating point",
        ),
        (
            lambda: _fit(loss_fn=lambda p, b: (_loss(p, b), 1.0)),
            TypeError,
            r"\(loss, aux\)\? pass has_aux=True",
        ),
        (
            lambda: _fit(loss_fn=_loss, init={"has_aux": True}),
            TypeError,
            r"has_aux=True, but loss_fn returned",
        ),
        (lambda: _fit(data=object()), TypeError, r"data must be a pytree of arrays, a function"),
    ],
)
def test_bad_input_is_named_with_the_fix(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_loss_function_that_fails_says_so():
    with pytest.raises(KeyError, match=r"loss_fn\(params, batch\) failed on the first batch"):
        _fit(loss_fn=lambda p, b: b["missing"].sum())


def test_a_none_leaf_the_loss_uses_is_named():
    with pytest.raises(
        TypeError,
        match=r"failed on the first batch: unsupported operand .*NoneType'; params\['b1'\] is None: JAX "
        r"holds None as an empty subtree, not an array.*give it an array",
    ):
        _fit(params={**_PARAMS, "b1": None}, steps=1)
    with pytest.raises(TypeError, match=r"NoneType'; params\['b1'\] is None: JAX holds") as info:
        _fit(params={**_PARAMS, "b1": None, "act": np.tanh}, steps=1)  # a leaf held static: not None
    assert "act" not in str(info.value)


def test_a_none_leaf_beside_a_leaf_held_static_trains():
    def loss(p, b):
        return _loss({k: v for k, v in p.items() if k != "act"}, {**b, "x": p["act"](b["x"])})

    params = {**_PARAMS, "unused": None, "act": jnp.tanh}  # None: an empty subtree; act: held static
    tr = mg.Trainer(loss, optax.sgd(0.1), params)
    tr.fit(_DATA, steps=2, progress=False)
    assert tr.step == 2 and tr.params["unused"] is None and tr.params["act"] is jnp.tanh


def test_the_iterable_ending_early_keeps_the_state_and_warns():
    tr = mg.Trainer(_loss, optax.sgd(0.1), _PARAMS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.fit([_DATA, _DATA], steps=5, progress=False)
    assert tr.step == 2 and any("ended after 2 of 5" in str(w.message) for w in caught)


# -- keys, checkpoints and resume ---------------------------------------------------------------


def _dropout_loss(p, batch, key):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    h = h * jax.random.bernoulli(key, 0.8, h.shape) / 0.8
    logits = h @ p["w2"] + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _same(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_key_gives_each_step_its_own_draws_and_is_reproducible():
    data, params = _problem()
    runs = [mg.Trainer(_dropout_loss, optax.adam(1e-2), params, key=jax.random.key(7)) for _ in range(2)]
    for tr in runs:
        tr.fit(data, steps=20, batch_size=64, progress=False)
    _same(runs[0].params, runs[1].params)
    other = mg.Trainer(_dropout_loss, optax.adam(1e-2), params, key=jax.random.key(8))
    other.fit(data, steps=20, batch_size=64, progress=False)
    assert not np.array_equal(np.asarray(other.params["w1"]), np.asarray(runs[0].params["w1"]))
    with pytest.raises(TypeError, match=r"key must be a PRNG key, e.g. key=jax.random.key\(0\)"):
        mg.Trainer(_loss, optax.sgd(0.1), params, key=7)


def test_resuming_from_a_checkpoint_gives_the_uninterrupted_runs_parameters_bit_for_bit(tmp_path):
    data, params = _problem()
    opt = optax.adamw(1e-2)
    whole_run = mg.Trainer(_dropout_loss, opt, params, key=jax.random.key(1))
    whole_run.fit(data, steps=50, batch_size=96, progress=False)

    first = mg.Trainer(_dropout_loss, opt, params, key=jax.random.key(1), checkpoint=tmp_path, every=10)
    first.fit(data, steps=35, batch_size=96, progress=False)  # checkpoints at 10, 20, 30
    first.checkpoints.close()
    again = mg.Trainer(_dropout_loss, opt, params, key=jax.random.key(1), checkpoint=tmp_path, every=10)
    hist = again.fit(data, steps=50, batch_size=96, resume=True, progress=False)
    assert again.step == 50 and len(hist) == 20  # from step 30: the run's 50 steps
    _same(again.params, whole_run.params)
    _same(again.opt_state, whole_run.opt_state)
    # a fresh trainer that does not resume is told about the newer checkpoints
    fresh = mg.Trainer(_loss, opt, params, checkpoint=tmp_path, every=10)
    with pytest.raises(
        ValueError, match=r"holds step 50, ahead of this trainer \(step 0\): pass resume=True"
    ):
        fresh.fit(data, steps=5, batch_size=96, progress=False)
    with pytest.raises(TypeError, match=r"resume=True restores from the trainer's checkpoint folder"):
        mg.Trainer(_loss, opt, params).fit(data, steps=5, resume=True, progress=False)
    for tr in (again, fresh):
        tr.checkpoints.close()


def test_resuming_a_different_model_names_the_first_leaf_that_differs(tmp_path):
    data, params = _problem()
    tr = mg.Trainer(_loss, optax.sgd(0.1), params, checkpoint=tmp_path, every=2)
    tr.fit(data, steps=2, batch_size=64, progress=False)
    tr.checkpoints.close()
    other = dict(params, w2=jnp.zeros((16, 4)))
    tr2 = mg.Trainer(_loss, optax.sgd(0.1), other, checkpoint=tmp_path, every=2)
    with pytest.raises(ValueError, match=r"\['w2'\]"):
        tr2.fit(data, steps=4, batch_size=64, resume=True, progress=False)
    tr2.checkpoints.close()


_KILLED = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import mgkit as mg
    mg.simulate(8)
    import jax, jax.numpy as jnp, optax
    mg.use_contexts(";".join(f"d{i}->cpu{i}" for i in range(8)), verbose=False)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(512, 16)).astype(np.float32)
    data = {"x": X, "y": (X[:, 0] > 0).astype(np.int32)}
    params = {"w": jnp.zeros((16, 2)), "b": jnp.zeros(2)}
    def loss_fn(p, b):
        import optax
        return optax.softmax_cross_entropy_with_integer_labels(b["x"] @ p["w"] + p["b"], b["y"]).mean()
    folder, steps, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    tr = mg.Trainer(loss_fn, optax.adam(1e-2), params, checkpoint=folder, every=7)
    if mode == "kill":
        def batches(step):
            if step == 30:
                print("at", tr.step, flush=True)
                sys.stdin.readline()  # the parent kills this process here
            return {k: v[(step * 64) % 512:(step * 64) % 512 + 64] for k, v in data.items()}
        tr.fit(batches, steps=steps, progress=False)
    else:
        batches = lambda step: {k: v[(step * 64) % 512:(step * 64) % 512 + 64] for k, v in data.items()}
        tr.fit(batches, steps=steps, resume=(mode == "resume"), progress=False)
        tr.checkpoints.close()
        np.save(sys.argv[4], np.asarray(tr.params["w"]))
        print("done", tr.step, flush=True)
    """
)


def test_a_run_killed_mid_training_resumes_to_the_uninterrupted_result(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_KILLED)
    env = child_env()

    def python(*args, **kw):
        return subprocess.Popen([sys.executable, str(script), *map(str, args)], env=env, text=True, **kw)

    whole_run = python(tmp_path / "a", 40, "whole", tmp_path / "a.npy", stdout=subprocess.PIPE)
    assert whole_run.communicate(timeout=120)[0].split()[:2] == ["done", "40"]
    killed = python(tmp_path / "b", 40, "kill", stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    try:
        line = killed.stdout.readline().split()
        assert line[0] == "at" and int(line[1]) >= 27, line
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait(timeout=30)
    assert killed.returncode == -signal.SIGKILL
    resumed = python(tmp_path / "b", 40, "resume", tmp_path / "b.npy", stdout=subprocess.PIPE)
    assert resumed.communicate(timeout=120)[0].split()[:2] == ["done", "40"]
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))
    for proc in (whole_run, killed, resumed):
        assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE


def test_step_fn_runs_the_compiled_step_in_a_loop_of_ones_own():
    data, params = _problem()
    opt = optax.sgd(0.1)
    tr = mg.Trainer(_loss, opt, params)
    batch = {"x": data["x"][:100], "y": data["y"][:100]}
    p, s = tr.params, tr.opt_state
    p, s = jax.tree_util.tree_map(jnp.copy, p), jax.tree_util.tree_map(jnp.copy, s)
    for _ in range(3):
        out = tr.step_fn(p, s, batch)
        p, s = out.params, out.opt_state
    assert bool(out.ok) and tr.step == 0  # the trainer's own state is not touched
    loss = float(_loss(jax.device_get(p), batch))
    assert loss < float(_loss(params, batch)) and np.isfinite(loss)
    ref = params
    for _ in range(3):
        g = jax.grad(_loss)(ref, batch)
        ref = jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, ref, g)
    _close(jax.device_get(p), jax.device_get(ref))
