"""Mixed precision: ``Trainer.fit(..., precision="bf16" | "fp16")`` computes the loss function in
half precision over float32 parameters and optimizer state; fp16's dynamic loss scale skips and
halves on overflow (counted by History, no error), survives checkpoints; CPU says once that it is
not faster; unknown precisions are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mgkit as mg
from mgkit.train._precision import GROWTH_EVERY, LossScale, next_scale

pytestmark = pytest.mark.filterwarnings("ignore::mgkit.PrecisionWarning")  # CPU: not faster (tested below)


def digits_problem():
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    data = {"x": (X / 16.0).astype(np.float32), "y": y.astype(np.int32)}
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (64, 32)) / 8,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(k2, (32, 10)) / 6,
        "b2": jnp.zeros(10),
    }
    return data, params


SEEN = []  # dtypes the loss function saw while traced


def digits_loss(p, batch):
    SEEN.append((p["w1"].dtype, batch["x"].dtype, batch["y"].dtype))
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    logits = h @ p["w2"] + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def test_bf16_computes_in_bfloat16_keeps_float32_state_and_reaches_fp32_s_loss():
    data, params = digits_problem()
    losses, states = {}, {}
    for precision in ("fp32", "bf16"):
        SEEN.clear()
        tr = mg.Trainer(digits_loss, optax.adam(1e-2), params)
        tr.fit(data, steps=150, batch_size=256, precision=precision, progress=False)
        kind = jnp.bfloat16 if precision == "bf16" else jnp.float32
        assert SEEN[-1] == (kind, kind, jnp.int32), SEEN  # integer labels are left as they are
        states[precision] = tr
        losses[precision] = float(digits_loss(jax.device_get(tr.params), data))  # evaluated in float32
    tr = states["bf16"]
    dtypes = {x.dtype for x in jax.tree_util.tree_leaves((tr.params, tr.opt_state))}
    assert {d for d in dtypes if jnp.issubdtype(d, jnp.floating)} == {jnp.dtype(jnp.float32)}
    assert abs(losses["bf16"] - losses["fp32"]) <= 0.01 * losses["fp32"] + 1e-3, losses
    assert losses["bf16"] < 0.5, losses


def test_bf16_with_accumulation_and_on_the_loop_over_shared_devices():
    mg.use_contexts("a->cpu0;b->cpu0;c->cpu1", verbose=False)
    data, params = digits_problem()
    tr = mg.Trainer(digits_loss, optax.adam(1e-2), params)
    hist = tr.fit(data, steps=20, batch_size=96, accumulate=3, precision="bf16", progress=False)
    assert not tr.spmd and tr.step == 20 and hist.loss[-1] < hist.loss[0]
    assert {x.dtype for x in jax.tree_util.tree_leaves(tr.params)} == {jnp.dtype(jnp.float32)}


# -- fp16's loss scale ----------------------------------------------------------------------------


def sum_loss(p, batch):
    """Its gradient is 4 per weight: 4 x 2**15 and 4 x 2**14 overflow float16, 4 x 2**13 does not."""
    return jnp.mean(batch["x"] @ p["w"])


FOURS = {"x": np.full((64, 3), 4.0, np.float32)}


@pytest.mark.parametrize("contexts", ["spmd", "loop"])
def test_fp16_overflow_skips_the_step_halves_the_scale_and_history_counts_it(contexts):
    if contexts == "loop":
        mg.use_contexts("a->cpu0;b->cpu0;c->cpu1", verbose=False)
    tr = mg.Trainer(sum_loss, optax.sgd(0.1), {"w": jnp.zeros(3)})  # on_nan="raise": overflow is no error
    hist = tr.fit([FOURS] * 5, steps=5, precision="fp16", progress=False)
    assert hist.skipped == 2 and hist.overflowed == 2, hist
    assert np.isnan(hist.loss[:2]).all() and np.isfinite(hist.loss[2:]).all()
    assert "2 skipped (0 loss not finite, 2 fp16 overflow)" in repr(hist)
    assert tr.step == 5
    np.testing.assert_allclose(np.asarray(tr.params["w"]), -0.1 * 4 * 3, rtol=1e-3)  # 3 updates applied
    assert tr.params["w"].dtype == jnp.float32


def test_fp16_a_non_finite_loss_still_stops_the_fit():
    def nan_loss(p, batch):
        return jnp.mean(batch["x"] @ p["w"]) * jnp.nan

    tr = mg.Trainer(nan_loss, optax.sgd(0.1), {"w": jnp.zeros(3)})
    with pytest.raises(FloatingPointError, match="step 1's loss is nan"):
        tr.fit([FOURS] * 3, steps=3, precision="fp16", progress=False)
    assert tr.history.overflowed == 0


def test_the_scale_grows_after_good_steps_and_stops_halving_at_its_floor():
    grads, finite_loss = {"w": jnp.ones(2)}, jnp.float32(1.0)
    grown = next_scale(LossScale(jnp.float32(8.0), jnp.int32(GROWTH_EVERY - 1), False), finite_loss, grads)
    assert (float(grown.scale), int(grown.good), bool(grown.overflow)) == (16.0, 0, False)
    inf = {"w": jnp.array([1.0, jnp.inf])}
    halved = next_scale(LossScale(jnp.float32(8.0), jnp.int32(5), False), finite_loss, inf)
    assert (float(halved.scale), int(halved.good), bool(halved.overflow)) == (4.0, 0, True)
    floor = next_scale(LossScale(jnp.float32(1.0), jnp.int32(5), False), finite_loss, inf)
    assert (float(floor.scale), bool(floor.overflow)) == (1.0, False)  # left to the non-finite guard


def test_fp16_loss_scale_survives_a_checkpoint_and_resume_is_bit_identical(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    data = {"x": np.random.default_rng(0).normal(4.0, 1.0, size=(256, 3)).astype(np.float32)}

    def run(folder, steps, resume=False):
        tr = mg.Trainer(sum_loss, optax.adam(0.1), {"w": jnp.zeros(3)}, checkpoint=folder, every=3)
        tr.fit(data, steps=steps, batch_size=64, precision="fp16", resume=resume, progress=False)
        return tr

    whole = run(tmp_path / "a", 6)
    run(tmp_path / "b", 3)  # overflows first, saved at step 3 with the scale it reached
    resumed = run(tmp_path / "b", 6, resume=True)
    assert resumed.step == 6 and float(resumed._scale.scale) == float(whole._scale.scale) == 2.0**13
    np.testing.assert_array_equal(np.asarray(resumed.params["w"]), np.asarray(whole.params["w"]))


# -- warnings and bad input ------------------------------------------------------------------------


@pytest.mark.filterwarnings("error::mgkit.PrecisionWarning")
def test_on_cpu_the_first_reduced_precision_fit_says_it_is_not_faster():
    tr = mg.Trainer(sum_loss, optax.sgd(0.1), {"w": jnp.zeros(3)})
    tr.fit([FOURS], steps=1, progress=False)  # fp32: no warning
    with pytest.warns(mg.PrecisionWarning, match=r"precision='bf16' on CPU.*not faster than 'fp32'"):
        tr.fit([FOURS], steps=1, precision="bf16", progress=False)
    tr.fit([FOURS], steps=1, precision="fp16", progress=False)  # said once per trainer


@pytest.mark.parametrize("bad", ["fp8", "float16", None, 16])
def test_an_unknown_precision_is_refused(bad):
    tr = mg.Trainer(sum_loss, optax.sgd(0.1), {"w": jnp.zeros(3)})
    with pytest.raises(ValueError, match=rf"precision={bad!r} is not one of \['bf16', 'fp16', 'fp32'\].*"):
        tr.fit([FOURS], steps=1, precision=bad, progress=False)
    assert tr.step == 0
