"""The batches of a fit: data that gives none, steps that all skip, batches unlike the first,
what a list and a string mean, batches with fewer rows than contexts, and a key the loss
function does not take. The Trainer throughout; the Ensemble and Pipeline where the skeleton
they share warns."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mgkit as mg


def _batch(n, d=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    return {"x": x, "y": (x @ np.arange(1.0, d + 1.0)).astype(np.float32)}


def _loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def _params(d=3):
    return {"w": jnp.asarray(np.linspace(-0.5, 0.5, d), jnp.float32), "b": jnp.asarray(0.1, jnp.float32)}


def _trainer(**kw):
    return mg.Trainer(kw.pop("loss_fn", _loss), optax.sgd(0.1), kw.pop("params", _params()), **kw)


def _nan_loss(p, b):
    return _loss(p, b) * jnp.nan


# -- data that gives no batch --------------------------------------------------------------------


@pytest.mark.parametrize("steps", [None, 3])
def test_an_empty_iterable_warns_that_no_batch_came(steps):
    tr = _trainer()
    with pytest.warns(mg.train.DataRanOut, match=r"no batch came from the data, so nothing trained"):
        hist = tr.fit([], steps=steps, progress=False)
    assert len(hist) == 0 and hist.stopped == "data ran out" and tr.step == 0


def test_a_generator_used_up_by_an_earlier_fit_is_named():
    tr = _trainer()
    gen = (_batch(16, seed=i) for i in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the first fit ends with its data: no word
        tr.fit(gen, progress=False)
    assert tr.step == 3
    with pytest.warns(mg.train.DataRanOut, match=r"a generator \(an iterator\) that an earlier fit used up"):
        hist = tr.fit(gen, progress=False)
    assert len(hist) == 0 and tr.step == 3


def test_an_ensemble_member_and_a_pipeline_with_no_batch_warn():
    ens = mg.Ensemble(
        {
            "dev0": mg.Member(_loss, optax.sgd(0.1), _params(), data=[_batch(8)] * 2, name="some"),
            "dev1": mg.Member(_loss, optax.sgd(0.1), _params(), data=[], name="none"),
        }
    )
    with pytest.warns(mg.train.DataRanOut, match=r"member 'none': no batch came from the data"):
        res = ens.fit(steps=2, progress=False)
    assert res["none"].step == 0 and res["some"].step == 2
    pipe = mg.Pipeline(
        [
            ("dev0", lambda p, x: x @ p["w"], {"w": jnp.ones((3, 2))}),
            ("dev1", lambda p, h: h @ p, jnp.ones(2)),
        ],
        loss=lambda out, y: jnp.mean((out - y) ** 2),
        optimizer=optax.sgd(0.1),
    )
    with pytest.warns(mg.train.DataRanOut, match=r"Pipeline.fit: no batch came from the data"):
        hist = pipe.fit(iter([]), steps=2, progress=False)
    assert len(hist) == 0 and pipe.step == 0


# -- steps that all skip -------------------------------------------------------------------------


def test_a_fit_whose_updates_were_all_skipped_says_how_many():
    tr = _trainer(loss_fn=_nan_loss, on_nan="skip")
    before = jax.device_get(tr.params)
    with pytest.warns(mg.train.StepsSkipped, match=r"3 of 3 step\(s\).*every update skipped"):
        hist = tr.fit([_batch(16)] * 3, progress=False)
    assert hist.skipped == 3 and tr.step == 3 and "3 skipped" in repr(hist)
    np.testing.assert_array_equal(np.asarray(tr.params["w"]), before["w"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped: no word
        assert _trainer(on_nan="skip").fit([_batch(16)], progress=False).skipped == 0


def test_an_ensemble_member_and_a_pipeline_that_skip_say_how_many():
    ens = mg.Ensemble(
        {
            "dev0": mg.Member(
                _nan_loss, optax.sgd(0.1), _params(), data=[_batch(8)] * 2, on_nan="skip", name="m"
            )
        }
    )
    with pytest.warns(mg.train.StepsSkipped, match=r"member 'm': 2 of 2 step\(s\)"):
        res = ens.fit(steps=2, progress=False)
    assert res["m"].history.skipped == 2
    pipe = mg.Pipeline(
        [
            ("dev0", lambda p, x: x @ p["w"], {"w": jnp.ones((3, 2))}),
            ("dev1", lambda p, h: h @ p, jnp.ones(2)),
        ],
        loss=lambda out, y: jnp.mean((out - y) ** 2) * jnp.nan,
        optimizer=optax.sgd(0.1),
        on_nan="skip",
    )
    b = _batch(8)
    with pytest.warns(mg.train.StepsSkipped, match=r"Pipeline.fit: 2 of 2 step\(s\)"):
        hist = pipe.fit([(b["x"], b["y"])] * 2, steps=2, progress=False)
    assert hist.skipped == 2


# -- batches unlike the first --------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_later_batch_with_another_feature_count_names_the_step_leaf_and_shapes(prefetch):
    tr = _trainer(prefetch=prefetch)
    batches = [_batch(64), _batch(64), {"x": np.ones((64, 5), np.float32), "y": np.ones(64, np.float32)}]
    with pytest.raises(ValueError) as info:
        tr.fit(batches, progress=False)
    msg = str(info.value)
    assert "step 3's batch leaf ['x'] has shape (64, 5) dtype float32" in msg
    assert "first batch's had shape (64, 3) dtype float32" in msg and "but for the row count" in msg
    assert tr.step == 2


def test_a_later_batch_with_another_dtype_or_structure_is_named():
    tr = _trainer()
    b = _batch(16)
    with pytest.raises(ValueError, match=r"step 2's batch leaf \['y'\] has shape \(16,\) dtype float64"):
        tr.fit([b, {"x": b["x"], "y": b["y"].astype(np.float64)}], progress=False)
    with pytest.raises(
        ValueError,
        match=r"step 3's batch has structure PyTreeDef\(\{'x': \*, 'z': \*\}\), and the first batch's was",
    ):
        tr.fit([b, {"x": b["x"], "z": b["y"]}], progress=False)


def test_short_batches_pass_the_check():
    tr = _trainer()
    tr.fit([_batch(64), _batch(5)], progress=False)
    assert tr.step == 2


@pytest.mark.parametrize("where", ["first", "later"])
def test_a_leaf_of_strings_is_named_before_jax_sees_it(where):
    b = _batch(8)
    words = {"x": b["x"], "y": np.array(list("abcdefgh"))}
    batches = [words] if where == "first" else [b, words]
    step = 1 if where == "first" else 2
    match = (
        rf"step {step}'s batch leaf \['y'\] has dtype <U1.*encode it as numbers"
        if where == "first"
        else r"step 2's batch leaf \['y'\] has shape \(8,\) dtype <U1"
    )
    with pytest.raises((TypeError, ValueError), match=match):
        _trainer().fit(batches, progress=False)


def test_arrays_of_strings_are_named_when_the_fit_begins():
    with pytest.raises(TypeError, match=r"data leaf \[1\] has dtype <U1"):
        _trainer().fit((np.ones((4, 3), np.float32), np.array(list("abcd"))), progress=False)


# -- what a list and a string mean ---------------------------------------------------------------


def test_a_list_of_columns_is_one_data_set():
    b = _batch(64)
    as_list, as_tuple = (
        mg.Trainer(lambda p, xy: _loss(p, {"x": xy[0], "y": xy[1]}), optax.sgd(0.1), _params())
        for _ in range(2)
    )
    hist = as_list.fit([b["x"], b["y"]], batch_size=16, progress=False)
    as_tuple.fit((b["x"], b["y"]), batch_size=16, progress=False)
    assert len(hist) == 4
    np.testing.assert_array_equal(np.asarray(as_list.params["w"]), np.asarray(as_tuple.params["w"]))


def test_a_list_of_alike_arrays_is_still_a_list_of_batches():
    tr = mg.Trainer(lambda p, x: jnp.mean((x @ p["w"]) ** 2), optax.sgd(0.1), {"w": jnp.ones(3)})
    hist = tr.fit([np.ones((8, 3), np.float32)] * 3, progress=False)
    assert len(hist) == 3


@pytest.mark.parametrize("data", ["train.csv", b"train.csv"])
def test_a_string_is_not_data(data):
    with pytest.raises(TypeError, match=r"data is a (str|bytes) \(b?'train.csv'\); mgkit reads no files"):
        _trainer().fit(data, progress=False)


# -- batches with fewer rows than contexts ---------------------------------------------------------


def _sgd_by_hand(params, batches, lr=0.1):
    """Plain SGD on one device: each batch's value_and_grad, applied in turn."""
    losses = []
    for b in batches:
        loss, g = jax.jit(jax.value_and_grad(_loss))(params, b)
        params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, g)
        losses.append(float(loss))
    return jax.device_get(params), losses


def _close(got, want):
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("contexts", [8, "a->cpu0;b->cpu0;c->cpu1;d->cpu1;e->cpu2;f->cpu2;g->cpu3;h->cpu3"])
@pytest.mark.parametrize("rows", [1, 5, 7])
def test_a_batch_with_fewer_rows_than_contexts_gives_one_devices_gradient(rows, contexts):
    if isinstance(contexts, str):
        mg.use_contexts(contexts, verbose=False)
        contexts = None
    tr = _trainer(contexts=contexts)
    assert len(tr.contexts) == 8 and tr.spmd == (contexts == 8)
    batch = _batch(rows, seed=rows)
    hist = tr.fit([batch], progress=False)
    want, losses = _sgd_by_hand(_params(), [batch])
    _close(jax.device_get(tr.params), want)
    np.testing.assert_allclose(hist.loss, losses, rtol=1e-6)
    assert sum(hist.rows) == rows


def test_a_loaders_short_last_batch_trains_as_one_device_does():
    """64 rows a batch, 133 in all: the last batch has 5 rows for 8 contexts."""
    data = _batch(133, seed=3)
    batches = [{k: v[i : i + 64] for k, v in data.items()} for i in range(0, 133, 64)]
    assert [len(b["y"]) for b in batches] == [64, 64, 5]
    tr = _trainer()
    hist = tr.fit(batches * 2, progress=False)  # two epochs: the short batch, then full ones again
    want, losses = _sgd_by_hand(_params(), batches * 2)
    _close(jax.device_get(tr.params), want)
    np.testing.assert_allclose(hist.loss, losses, rtol=1e-5)


def test_step_fn_takes_a_short_batch():
    tr = _trainer()
    params, opt = jax.tree_util.tree_map(jnp.copy, tr.params), tr.opt_state
    out = tr.step_fn(params, opt, _batch(3))
    want, losses = _sgd_by_hand(_params(), [_batch(3)])
    _close(jax.device_get(out.params), want)
    assert float(out.loss) == pytest.approx(losses[0], rel=1e-6)


def test_a_pipelines_short_last_batch_trains_as_one_device_does():
    """4 microbatches a batch; the loader's last batch has 3 rows: cut into 3, the same gradient."""
    w0, v0 = jnp.asarray(np.linspace(-1, 1, 6).reshape(3, 2), jnp.float32), jnp.asarray([0.5, -0.5])
    pipe = mg.Pipeline(
        [("dev0", lambda p, x: jnp.tanh(x @ p), w0), ("dev1", lambda p, h: h @ p, v0)],
        loss=lambda out, y: jnp.mean((out - y) ** 2),
        optimizer=optax.sgd(0.1),
        microbatches=4,
    )
    data = _batch(19, seed=4)
    batches = [(data["x"][i : i + 16], data["y"][i : i + 16]) for i in (0, 16)]
    assert [len(y) for _, y in batches] == [16, 3]
    with pytest.warns(mg.train.FewerMicrobatches, match="step 2's batch has 3 row"):
        hist = pipe.fit(batches, steps=2, progress=False)

    def loss(ps, x, y):
        return jnp.mean((jnp.tanh(x @ ps[0]) @ ps[1] - y) ** 2)

    ps, losses = [w0, v0], []
    for x, y in batches:
        value, g = jax.value_and_grad(loss)(ps, x, y)
        ps = [p - 0.1 * gp for p, gp in zip(ps, g, strict=True)]
        losses.append(float(value))
    for got, want in zip(pipe.params, ps, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hist.loss, losses, rtol=1e-5)


# -- a key the loss function does not take -------------------------------------------------------


def test_a_key_given_to_a_loss_without_one_says_why_it_is_passed():
    tr = _trainer(key=jax.random.key(0))
    with pytest.raises(TypeError) as info:
        tr.fit([_batch(16)], progress=False)
    msg = str(info.value)
    assert "loss_fn(params, batch, key) failed on the first batch" in msg
    assert "the key is passed because key= was given" in msg.lower()
    assert "leave key= out" in msg
