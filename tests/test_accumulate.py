"""Gradient accumulation: ``Trainer.fit(..., accumulate=k)`` gives the whole batch's gradient in
one update per step, on the SPMD step and on the gather-update-copy loop, with the memory of one
microbatch (the compiled program's memory analysis)."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mgkit as mg
from mgkit._spmd import AXIS, sharding
from mgkit.train._accumulate import peak_bytes
from mgkit.train._plan import plan
from mgkit.train._shard import Placement
from mgkit.train._step import place_spmd_batch, spmd_step

RNG = np.random.default_rng(0)
PARAMS = {
    "w1": RNG.normal(size=(5, 16)).astype(np.float32),
    "b1": np.zeros(16, np.float32),
    "w2": RNG.normal(size=(16, 1)).astype(np.float32),
}


def loss_fn(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)


def loss_with_aux(p, batch):
    return loss_fn(p, batch), {"mean_x": jnp.mean(batch["x"])}


def batch_of(n: int, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 5)).astype(np.float32), "y": rng.normal(size=(n, 1)).astype(np.float32)}


def gradient(batch: dict, accumulate: int, fn=loss_fn, params=PARAMS, **kw) -> tuple:
    """The gradient one step applies (sgd with rate 1: old - new parameters), and the trainer."""
    tr = mg.Trainer(fn, optax.sgd(1.0), params, **kw)
    tr.fit([batch], steps=1, accumulate=accumulate, progress=False)
    new = jax.device_get(tr.params)
    return {k: params[k] - new[k] for k in params}, tr


def true_gradient(batch: dict, params=PARAMS) -> dict:
    """The whole batch's gradient of ``loss_fn``, by hand in float64 numpy."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
    h = np.tanh(x @ p["w1"] + p["b1"])
    dr = 2 * (h @ p["w2"] - y) / y.size
    dz = (dr @ p["w2"].T) * (1 - h**2)
    return {"w1": x.T @ dz, "b1": dz.sum(0), "w2": h.T @ dr}


@pytest.mark.parametrize(
    "rows, k",
    [(64, 4), (64, 8), (67, 3), (61, 4), (13, 5)],
    ids=["divides", "k=8", "rest rows", "uneven blocks", "fewer rows per device than k"],
)
def test_the_gradient_is_the_whole_batch_s(rows, k):
    batch = batch_of(rows)
    whole, _ = gradient(batch, 1)
    accumulated, tr = gradient(batch, k)
    truth = true_gradient(batch)
    for name in PARAMS:
        np.testing.assert_allclose(accumulated[name], truth[name], rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(accumulated[name], whole[name], rtol=2e-5, atol=2e-6)
    assert tr.step == 1


# fsdp splits w1 along its first axis (8 rows, one per context) and w2 along its first, padded
# from 300 to 304 rows; b1 (under FSDP_MIN_SIZE) stays whole
SPLIT = {
    "w1": RNG.normal(size=(8, 300)).astype(np.float32),
    "b1": RNG.normal(size=300).astype(np.float32),
    "w2": (RNG.normal(size=(300, 4)) / 10).astype(np.float32),
}


@pytest.mark.parametrize(
    "rows, k",
    [(64, 4), (67, 3), (61, 4), (13, 5)],
    ids=["divides", "rest rows", "uneven blocks", "fewer rows per device than k"],
)
def test_split_parameters_accumulate_the_whole_batch_s_gradient(rows, k):
    rng = np.random.default_rng(rows)
    batch = {
        "x": rng.normal(size=(rows, 8)).astype(np.float32),
        "y": rng.normal(size=(rows, 4)).astype(np.float32),
    }
    accumulated, tr = gradient(batch, k, params=SPLIT, shard="fsdp")
    w1 = tr.params["w1"]  # stored split: a row per context
    assert len(w1.sharding.device_set) == 8 and w1.addressable_shards[0].data.shape == (1, 300)
    whole, _ = gradient(batch, 1, params=SPLIT, shard="fsdp")
    truth = true_gradient(batch, SPLIT)
    for name in SPLIT:
        np.testing.assert_allclose(accumulated[name], truth[name], rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(accumulated[name], whole[name], rtol=2e-5, atol=2e-6)


def test_the_loop_over_contexts_sharing_a_device_accumulates_too():
    mg.use_contexts("a->cpu0;b->cpu0;c->cpu1", verbose=False)
    batch = batch_of(67)
    accumulated, tr = gradient(batch, 4)
    assert not tr.spmd
    truth = true_gradient(batch)
    for name in PARAMS:
        np.testing.assert_allclose(accumulated[name], truth[name], rtol=2e-5, atol=2e-6)


def test_aux_and_loss_are_averaged_over_the_microbatches():
    devices = tuple(jax.devices()[:8])
    batch = batch_of(64)
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    outs = []
    for k in (1, 4):
        tr = mg.Trainer(loss_with_aux, optax.sgd(0.1), PARAMS, has_aux=True)
        even, rest, _ = place_spmd_batch(leaves, treedef, tr.targets, own=False)
        step = spmd_step(loss_with_aux, optax.sgd(0.1), True, devices, accumulate=k)
        outs.append(step(tr.params, tr.opt_state, even, rest, None))
    np.testing.assert_allclose(float(outs[1].aux["mean_x"]), float(np.mean(batch["x"])), rtol=1e-5)
    np.testing.assert_allclose(float(outs[1].loss), float(outs[0].loss), rtol=1e-5)


def test_one_update_per_step_and_step_counts_updates():
    data = batch_of(256)
    tr = mg.Trainer(loss_fn, optax.adam(1e-2), PARAMS)
    hist = tr.fit(data, steps=6, batch_size=64, accumulate=4, progress=False)
    assert tr.step == 6 and len(hist) == 6
    assert int(tr.opt_state[0].count) == 6  # adam's count: one update per step, not per microbatch
    assert hist.loss[-1] < hist.loss[0]


def test_accumulated_training_follows_the_unaccumulated_run():
    data = batch_of(256)
    runs = []
    for k in (1, 4):
        tr = mg.Trainer(loss_fn, optax.adam(1e-2), PARAMS)
        tr.fit(data, steps=20, batch_size=64, accumulate=k, progress=False)
        runs.append(jax.device_get(tr.params))
    for name in PARAMS:
        np.testing.assert_allclose(runs[1][name], runs[0][name], rtol=1e-4, atol=1e-5)


# -- memory -------------------------------------------------------------------------------------


def deep_loss(p, batch):
    h = batch["x"]
    for w in p["ws"][:-1]:
        h = jax.nn.relu(h @ w)
    return jnp.mean((h @ p["ws"][-1] - batch["y"]) ** 2)


def step_peak(
    rows: int, accumulate: int, width: int = 256, depth: int = 4, features: int = 16, shard: str | None = None
) -> int:
    """Per-device peak of the compiled step (arguments + outputs not aliased + temporaries), from
    ``memory_analysis`` of the program lowered on shapes (nothing is allocated); ``shard``: the
    parameters and optimizer state split as ``Trainer(shard=...)`` splits them (else replicated)."""
    devices = tuple(jax.devices()[:8])
    shapes = itertools.pairwise([features] + [width] * depth + [1])
    params = {"ws": [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]}
    opt = optax.adam(1e-3)
    layout = None if shard is None else Placement(plan(params, shard, None, len(devices), "test"), devices)
    rep, split = (
        (sharding(devices), sharding(devices, AXIS, 0)) if layout is None else (layout.rep, layout.split)
    )
    laid = jax.tree_util.tree_map(lambda _: rep, params) if layout is None else layout.params
    state = jax.eval_shape(opt.init, params)
    state_laid = jax.tree_util.tree_map(lambda _: rep, state) if layout is None else layout.opt_state(opt)
    on = lambda tree, where: jax.tree_util.tree_map(  # noqa: E731
        lambda s, at: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=at), tree, where
    )
    batch = {
        "x": jax.ShapeDtypeStruct((rows, features), jnp.float32, sharding=split),
        "y": jax.ShapeDtypeStruct((rows, 1), jnp.float32, sharding=split),
    }
    step = spmd_step(deep_loss, opt, False, devices, accumulate=accumulate, layout=layout)
    return peak_bytes(step, on(params, laid), on(state, state_laid), batch, None, None)


def test_peak_memory_is_that_of_one_microbatch():
    """8 microbatches of 1,024 rows per device: within 1.15x of a step of one microbatch, and far
    under the whole batch's step."""
    rows = 8 * 8 * 1024
    accumulated, micro, whole = step_peak(rows, 8), step_peak(rows // 8, 1), step_peak(rows, 1)
    assert accumulated <= 1.15 * micro, (accumulated, micro)
    assert accumulated < 0.5 * whole, (accumulated, whole)


def test_peak_memory_with_split_parameters_is_that_of_one_microbatch():
    """fsdp: each device holds its share of a float32 gradient sum (each microbatch reduce-scattered
    into it), not a whole-parameter one, and gathers the parameters inside the microbatch loop,
    freeing them in the backward pass as a step of one microbatch does (not once, held through the
    loop): 8 microbatches within 1.15x of a step of one (1.66x when each device summed its own
    blocks whole)."""
    rows, size = 8 * 8 * 256, {"width": 1024, "depth": 3, "features": 16, "shard": "fsdp"}
    accumulated, micro = step_peak(rows, 8, **size), step_peak(rows // 8, 1, **size)
    whole = step_peak(rows, 1, **size)
    assert accumulated <= 1.15 * micro, (accumulated, micro)
    assert accumulated < 0.6 * whole, (accumulated, whole)


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1])
def test_accumulate_below_one_is_refused(bad):
    tr = mg.Trainer(loss_fn, optax.sgd(0.1), PARAMS)
    with pytest.raises(ValueError, match=rf"accumulate={bad} is out of range.*at least 1.*accumulate=4"):
        tr.fit(batch_of(64), steps=1, accumulate=bad, progress=False)
    assert tr.step == 0


def test_accumulate_of_a_non_integer_is_refused():
    tr = mg.Trainer(loss_fn, optax.sgd(0.1), PARAMS)
    with pytest.raises(TypeError, match=r"accumulate.*whole number"):
        tr.fit(batch_of(64), steps=1, accumulate=2.5, progress=False)


def test_accumulate_over_the_batch_s_rows_is_refused():
    tr = mg.Trainer(loss_fn, optax.sgd(0.1), PARAMS)
    with pytest.raises(ValueError, match=r"accumulate=16 is more than the batch's 12 rows.*accumulate <= 12"):
        tr.fit(batch_of(64), steps=1, batch_size=12, accumulate=16, progress=False)
    assert tr.step == 0
    with pytest.raises(ValueError, match=r"accumulate=9 is more than the batch's 8 rows"):
        tr.fit([batch_of(8)], steps=1, accumulate=9, progress=False)


def test_a_loss_with_a_key_draws_a_key_per_microbatch():
    def dropout_loss(p, batch, key):
        keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
        return loss_fn(p, {"x": jnp.where(keep, batch["x"] * 2, 0.0), "y": batch["y"]})

    tr = mg.Trainer(dropout_loss, optax.adam(1e-2), PARAMS, key=jax.random.key(0))
    hist = tr.fit(batch_of(256), steps=4, batch_size=64, accumulate=4, progress=False)
    assert tr.step == 4 and np.isfinite(hist.loss).all()


def test_split_parameters_draw_the_same_keys_and_average_aux_over_the_microbatches():
    """With a key, each block of each microbatch draws as on replicated parameters (the gradients
    agree); the loss and aux are the batch's means."""

    def dropout_loss(p, batch, key):
        keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
        return loss_fn(p, {"x": jnp.where(keep, batch["x"] * 2, 0.0), "y": batch["y"]})

    rng = np.random.default_rng(5)
    batch = {
        "x": rng.normal(size=(67, 8)).astype(np.float32),
        "y": rng.normal(size=(67, 4)).astype(np.float32),
    }
    split, _ = gradient(batch, 3, dropout_loss, SPLIT, shard="fsdp", key=jax.random.key(0))
    replicated, _ = gradient(batch, 3, dropout_loss, SPLIT, key=jax.random.key(0))
    for name in SPLIT:
        np.testing.assert_allclose(split[name], replicated[name], rtol=2e-5, atol=2e-6)

    devices, opt = tuple(jax.devices()[:8]), optax.sgd(0.1)
    layout = Placement(plan(SPLIT, "fsdp", None, len(devices), "test"), devices)
    tr = mg.Trainer(loss_with_aux, opt, SPLIT, has_aux=True, shard="fsdp")
    even, rest, _ = place_spmd_batch(*jax.tree_util.tree_flatten(batch), tr.targets, own=False, layout=layout)
    outs = []
    for k in (1, 3):
        params = layout.place(SPLIT)
        step = spmd_step(loss_with_aux, opt, True, devices, accumulate=k, layout=layout)
        outs.append(step(params, layout.init(opt, params), even, rest, None))
    np.testing.assert_allclose(float(outs[1].aux["mean_x"]), float(np.mean(batch["x"])), rtol=1e-5)
    np.testing.assert_allclose(float(outs[1].loss), float(outs[0].loss), rtol=1e-5)


def test_one_cross_context_reduction_per_step_outside_the_microbatch_loop():
    """The compiled step has one all-reduce, in its entry computation: each device sums its own
    microbatches' gradients, and the devices' sums are reduced once (not once per microbatch)."""
    devices = tuple(jax.devices()[:8])
    rep, split = sharding(devices), sharding(devices, AXIS, 0)
    params = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rep) for k, v in PARAMS.items()}
    state = jax.eval_shape(optax.sgd(0.1).init, params)
    for rows in (1024, 1003):  # the second leaves 5 rows per device after 8 x 15, and 3 rest rows
        batch = {
            "x": jax.ShapeDtypeStruct((rows - rows % 8, 5), jnp.float32, sharding=split),
            "y": jax.ShapeDtypeStruct((rows - rows % 8, 1), jnp.float32, sharding=split),
        }
        rest = (
            None
            if rows % 8 == 0
            else {"x": np.zeros((rows % 8, 5), np.float32), "y": np.zeros((rows % 8, 1), np.float32)}
        )
        step = spmd_step(loss_fn, optax.sgd(0.1), False, devices, accumulate=8)
        text = step.lower(params, state, batch, rest, None).compile().as_text()
        computations = re.split(r"\n(?=\S)", text)
        reducing = [c.split("(", 1)[0] for c in computations if re.search(r"all-reduce(-start)?\(", c)]
        assert len(reducing) == 1 and reducing[0].startswith("ENTRY"), reducing
        assert len(re.findall(r"all-reduce(?:-start)?\(", text)) == 1
