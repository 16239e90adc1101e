"""mg.Pipeline: gradients equal one device's for 1 to 4 stages and M in {1, 2, 4, 8} (with a
batch that does not divide by M), 2·M·(S−1) stage transfers in the ledger, remat, training with
one optimizer state per stage on its context, NaN, Ctrl-C and the schedule picture; 1F1B's
order, its gradients (GPipe's) and the activations it keeps; where each argument lives."""

import _thread
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mgkit as mg
from mgkit._ledger import Kind
from mgkit.train._pipeline_schedule import Op, gpipe, live, needs, one_f_one_b

ROWS = 30  # divides by 1 and 2, not by 4 or 8


def _layer(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def _head(p, h):
    return h @ p["w"]


def _xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _model(stages, seed=0, d=5, width=8, classes=3):
    """``stages`` stages: tanh layers, the last a linear head; their parameters."""
    rng = np.random.default_rng(seed)
    fns, params, inp = [], [], d
    for s in range(stages):
        last = s == stages - 1
        out = classes if last else width
        w = jnp.asarray(rng.normal(size=(inp, out)) * 0.5, jnp.float32)
        if last:
            fns.append(_head)
            params.append({"w": w})
        else:
            fns.append(_layer)
            params.append({"w": w, "b": jnp.asarray(rng.normal(size=out) * 0.1, jnp.float32)})
        inp = out
    X = rng.normal(size=(ROWS, d)).astype(np.float32)
    y = rng.integers(0, classes, size=ROWS).astype(np.int32)
    return fns, params, X, y


def _one_device(fns, params, X, y):
    def loss(ps):
        a = jnp.asarray(X)
        for f, p in zip(fns, ps, strict=True):
            a = f(p, a)
        return _xent(a, y)

    return jax.value_and_grad(loss)(params)


@pytest.mark.parametrize(
    ("stages", "microbatches", "remat"),
    [(1, 8, False), (2, 1, False), (2, 2, False), (2, 4, True), (3, 8, False), (4, 4, False), (4, 8, True)],
)
def test_gradients_equal_one_devices_and_every_hop_is_in_the_ledger(stages, microbatches, remat):
    fns, params, X, y = _model(stages)
    ctxs = [f"dev{i}" for i in range(stages)]
    pipe = mg.Pipeline(
        list(zip(ctxs, fns, params, strict=True)), loss=_xent, microbatches=microbatches, remat=remat
    )
    mg.ledger().clear()
    loss, grads = pipe.value_and_grad(batch=(X, y))
    ref_loss, ref_grads = _one_device(fns, params, X, y)
    assert abs(float(loss) - float(ref_loss)) < 1e-6
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)
    assert [mg.where(g) for g in grads] == ctxs and mg.where(loss) == ctxs[-1]
    hops = mg.ledger().records("transfer")
    assert len(hops) == 2 * microbatches * (stages - 1)
    sizes = [len(range(ROWS)[i::microbatches]) for i in range(microbatches)]
    for e in hops:
        rows = sorted(sizes, reverse=True)[e.info["microbatch"]]
        width = 8  # every stage but the last outputs 8 columns; gradients have the same shape
        assert e.nbytes == rows * width * 4 and e.dst == ctxs[e.info["stage"]]
        assert e.src == ctxs[e.info["stage"] + (-1 if e.info["what"] == "activations" else 1)]
    blocks = [e for e in mg.ledger().records() if e.kind in ("forward", "backward")]
    assert len(blocks) == 2 * microbatches * stages


def test_remat_keeps_less_and_gives_the_same_gradients():
    fns, params, X, y = _model(3, width=64)
    stages = list(zip(["dev0", "dev1", "dev2"], fns, params, strict=True))
    kept, grads = {}, {}
    for remat in (False, True):
        pipe = mg.Pipeline(stages, loss=_xent, microbatches=4, remat=remat)
        _, grads[remat] = pipe.value_and_grad(batch=(X, y))
        kept[remat] = pipe.kept_bytes
    assert all(k > 0 for k in kept[True]) and sum(kept[True]) < sum(kept[False])
    for a, b in zip(
        jax.tree_util.tree_leaves(grads[True]), jax.tree_util.tree_leaves(grads[False]), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_fit_trains_with_one_optimizer_state_per_stage_on_its_context():
    fns, params, X, y = _model(3)
    pipe = mg.Pipeline(
        list(zip(["dev0", "dev1", "dev2"], fns, params, strict=True)), loss=_xent, microbatches=4
    )
    hist = pipe.fit((X, y), optax.adam(3e-2), steps=40, batch_size=ROWS, progress=False)
    assert pipe.step == 40 and len(hist) == 40 and hist.loss[-1] < 0.7 * hist.loss[0]
    assert [mg.where(p) for p in pipe.params] == ["dev0", "dev1", "dev2"]
    assert [mg.where(o) for o in pipe.opt_state] == ["dev0", "dev1", "dev2"]
    for p, o in zip(pipe.params, pipe.opt_state, strict=True):
        for leaf in jax.tree_util.tree_leaves((p, o)):
            assert len(leaf.devices()) == 1  # only on its context
    # the same optimizer goes on from its state; the user's arrays were never donated
    pipe.fit((X, y), optax.adam(3e-2), steps=2, batch_size=ROWS, progress=False)
    assert pipe.step == 42 and np.isfinite(np.asarray(params[0]["w"])).all()
    steps = mg.ledger().records("step")
    assert {e.src for e in steps} == {"dev0", "dev1", "dev2"} and all(e.info["loss"] > 0 for e in steps)
    assert len([e for e in mg.ledger().records("update")]) == 3 * 42
    shown = mg.show_sharding(pipe, widget=False)  # its state as stored: each stage on its context
    stages = zip(("dev0", "dev1", "dev2"), pipe.params, pipe.opt_state, strict=True)
    held = [(name, len(jax.tree_util.tree_leaves((p, o)))) for name, p, o in stages]
    assert [(c.context, c.leaves) for c in shown.per_context] == held
    assert shown.layouts[0].path == "['opt_state'][0][0].count"


def test_a_nan_step_is_not_applied_and_ctrl_c_stops_at_a_step_boundary():
    fns, params, X, y = _model(2)
    pipe = mg.Pipeline(list(zip(["dev0", "dev1"], fns, params, strict=True)), loss=_xent, microbatches=2)
    bad = X.copy()
    bad[3, 1] = np.inf
    pipe.fit((X, y), optax.sgd(0.1), steps=3, batch_size=ROWS, progress=False)
    before = jax.device_get(pipe.params)
    with pytest.raises(
        FloatingPointError, match=r"step 4's loss .* not applied, and the fit stopped at step 4"
    ):
        pipe.fit(lambda step: (bad, y), optax.sgd(0.1), steps=5, progress=False)
    # the step counts, as the trainer's does, with its update not applied: a next fit goes past it
    assert pipe.step == 4 and pipe.history.stopped == "nan"
    for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(pipe.params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    with pytest.warns(mg.train.StepsSkipped, match=r"1 of 3 step\(s\)"):
        hist = pipe.fit(
            lambda step: (bad if step == 6 else X, y), optax.sgd(0.1), steps=3, on_nan="skip", progress=False
        )
    assert pipe.step == 7 and np.isnan(hist.loss[1]) and np.isfinite(hist.loss[[0, 2]]).all()

    asked = []

    def batches(step):
        asked.append(step)
        if len(asked) == 4:
            threading.Timer(0.0, _thread.interrupt_main).start()
            time.sleep(0.05)
        return X, y

    with pytest.raises(KeyboardInterrupt, match="stopped at step"):
        pipe.fit(batches, optax.sgd(0.1), steps=1000, progress=False)
    stopped = pipe.step  # the step under way when Ctrl-C came ends (a late signal: a step or two more)
    # the loader asks for batches up to prefetch + 1 steps ahead of the step that runs
    assert (
        11 - 3 <= stopped <= 13 and pipe.history.stopped == "interrupted" and len(pipe.history) == stopped - 7
    )
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree_util.tree_leaves(pipe.params))
    pipe.fit((X, y), optax.sgd(0.1), steps=2, batch_size=ROWS, progress=False)
    assert pipe.step == stopped + 2


def test_the_schedule_draws_every_call_with_the_bubble(tmp_path):
    fns, params, X, y = _model(2)
    pipe = mg.Pipeline(list(zip(["dev0", "dev1"], fns, params, strict=True)), loss=_xent, microbatches=4)
    pipe.fit((X, y), optax.sgd(0.1), steps=2, batch_size=ROWS, progress=False)
    shown = pipe.schedule(widget=False)
    kinds = [(b.row, b.kind) for b in shown.blocks]
    for row in ("stage 0 (dev0)", "stage 1 (dev1)"):
        assert kinds.count((row, "forward")) == 4 and kinds.count((row, "backward")) == 4
        assert kinds.count((row, "update")) == 1
    assert shown.ideal == pytest.approx(1 / 5) and 0 <= shown.bubble < 1
    for b in shown.blocks:
        assert 0 <= b.start <= b.end <= shown.span
    text = str(shown)
    assert "2 stage(s) x 4 microbatch(es)" in text and "0.20 ideal" in text and "8 stage transfer(s)" in text
    assert "F forward" in text and "B backward" in text and "U update" in text
    assert "<svg" in shown.html() and "stage 1 (dev1)" in shown.html()
    path = shown.save_png(tmp_path / "gpipe.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# -- 1F1B ---------------------------------------------------------------------------------------


def test_the_1f1b_order_for_two_stages_and_four_microbatches():
    F, B = Kind.FORWARD, Kind.BACKWARD
    want = [
        (0, 0, F), (0, 1, F), (1, 0, F), (1, 0, B), (0, 0, B), (1, 1, F), (0, 2, F), (1, 1, B),
        (0, 1, B), (1, 2, F), (0, 3, F), (1, 2, B), (0, 2, B), (1, 3, F), (1, 3, B), (0, 3, B),
    ]  # fmt: skip
    assert [tuple(op) for op in one_f_one_b(2, 4)] == want
    # each stage's own order: warm-up forwards, then one forward and one backward in turn
    assert [op.kind[0].upper() for op in one_f_one_b(2, 4) if op.stage == 0] == list("FFBFBFBB")
    assert [op.kind[0].upper() for op in one_f_one_b(2, 4) if op.stage == 1] == list("FBFBFBFB")


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (3, 2), (3, 7), (4, 4), (4, 8), (2, 1)])
def test_every_schedule_order_runs_each_call_once_after_its_inputs(stages, microbatches):
    for make in (gpipe, one_f_one_b):
        order = make(stages, microbatches)
        assert sorted(order) == sorted(
            Op(s, m, k)
            for s in range(stages)
            for m in range(microbatches)
            for k in (Kind.FORWARD, Kind.BACKWARD)
        )
        seen = set()
        for op in order:
            assert all(n in seen for n in needs(op, stages)), (make.__name__, op)
            seen.add(op)
    kept = live(one_f_one_b(stages, microbatches), stages)
    assert kept == tuple(min(stages - s, microbatches) for s in range(stages))
    assert live(gpipe(stages, microbatches), stages) == (microbatches,) * stages


@pytest.mark.parametrize(
    ("stages", "microbatches", "remat"),
    [(2, 4, False), (3, 2, False), (3, 7, True), (4, 4, False), (4, 8, False), (2, 1, False)],
)
def test_1f1b_gives_gpipes_gradients_and_one_devices(stages, microbatches, remat):
    fns, params, X, y = _model(stages)
    ctxs = [f"dev{i}" for i in range(stages)]
    grads = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = mg.Pipeline(
            list(zip(ctxs, fns, params, strict=True)),
            loss=_xent,
            microbatches=microbatches,
            remat=remat,
            schedule=schedule,
        )
        mg.ledger().clear()
        loss, grads[schedule] = pipe.value_and_grad(batch=(X, y))
        assert len(mg.ledger().records("transfer")) == 2 * microbatches * (stages - 1)
    ref_loss, ref_grads = _one_device(fns, params, X, y)
    assert abs(float(loss) - float(ref_loss)) < 1e-6
    flat = [jax.tree_util.tree_leaves(g) for g in (grads["1f1b"], grads["gpipe"], ref_grads)]
    for a, b, r in zip(*flat, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-6, atol=1e-6)
    assert [mg.where(g) for g in grads["1f1b"]] == ctxs


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 6), (3, 6), (3, 2), (4, 5)])
def test_1f1b_keeps_at_most_s_microbatches_activations_per_stage(stages, microbatches):
    """30 rows in 6, 5 or 2 microbatches: equal parts, so each keeps the same bytes; GPipe keeps
    all M at once, 1F1B at most S - s on stage s."""
    fns, params, X, y = _model(stages, width=32)
    kept = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = mg.Pipeline(
            list(zip([f"dev{i}" for i in range(stages)], fns, params, strict=True)),
            loss=_xent,
            microbatches=microbatches,
            schedule=schedule,
        )
        pipe.value_and_grad(batch=(X, y))
        kept[schedule] = pipe.kept_bytes
    for s in range(stages):
        one = kept["gpipe"][s] // microbatches  # one microbatch's residuals on stage s
        assert one > 0 and kept["gpipe"][s] == microbatches * one
        assert kept["1f1b"][s] == min(stages - s, microbatches) * one <= stages * one


def test_the_1f1b_picture_shows_each_stage_alternating_forwards_and_backwards():
    fns, params, X, y = _model(2)
    pipe = mg.Pipeline(
        list(zip(["dev0", "dev1"], fns, params, strict=True)),
        loss=_xent,
        microbatches=4,
        schedule="1f1b",
        optimizer=optax.sgd(0.1),
    )
    pipe.fit((X, y), steps=2, batch_size=ROWS, progress=False)
    shown = pipe.schedule(widget=False)
    for row, want in (("stage 0 (dev0)", "FFBFBFBBU"), ("stage 1 (dev1)", "FBFBFBFBU")):
        blocks = sorted((b for b in shown.blocks if b.row == row), key=lambda b: b.start)
        assert "".join(b.kind[0].upper() for b in blocks) == want
    assert "1f1b" in repr(pipe)
    assert "(1F1B)" in repr(shown) and "GPipe" not in repr(shown)


# -- where each argument lives ------------------------------------------------------------------


def test_optimizer_seed_and_on_nan_live_in_the_constructor_and_fit_may_override_them():
    fns, params, X, y = _model(2)
    stages = list(zip(["dev0", "dev1"], fns, params, strict=True))
    made = mg.Pipeline(stages, loss=_xent, microbatches=2, optimizer=optax.sgd(0.1), seed=3)
    given = mg.Pipeline(stages, loss=_xent, microbatches=2)
    made.fit((X, y), steps=4, batch_size=10, progress=False)
    given.fit((X, y), optax.sgd(0.1), steps=4, batch_size=10, seed=3, progress=False)
    for a, b in zip(
        jax.tree_util.tree_leaves(made.params), jax.tree_util.tree_leaves(given.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(TypeError, match=r"Pipeline.fit: no optimizer; give it where the pipeline is made"):
        mg.Pipeline(stages, loss=_xent).fit((X, y), steps=1, progress=False)
    bad = X.copy()
    bad[0, 0] = np.nan
    skipping = mg.Pipeline(stages, loss=_xent, optimizer=optax.sgd(0.1), on_nan="skip")
    with pytest.warns(mg.train.StepsSkipped):
        hist = skipping.fit(lambda step: (bad if step == 2 else X, y), steps=3, progress=False)
    assert skipping.step == 3 and np.isnan(hist.loss[1]) and np.isfinite(hist.loss[[0, 2]]).all()
    with pytest.raises(FloatingPointError, match="step 4's loss"):
        skipping.fit(lambda step: (bad, y), steps=2, on_nan="raise", progress=False)
    with pytest.raises(ValueError, match=r"on_nan='ignore'"):
        mg.Pipeline(stages, loss=_xent, on_nan="ignore")


def test_a_pipeline_whose_data_runs_out_warns_as_the_trainer_does():
    fns, params, X, y = _model(2)
    pipe = mg.Pipeline(
        list(zip(["dev0", "dev1"], fns, params, strict=True)), loss=_xent, optimizer=optax.sgd(0.1)
    )
    with pytest.warns(mg.train.DataRanOut, match=r"the data ended after 2 of 5 step\(s\).*state of step 2"):
        hist = pipe.fit([(X, y), (X, y)], steps=5, progress=False)
    assert pipe.step == 2 and hist.stopped == "data ran out"


def test_batches_with_fewer_rows_than_microbatches_are_refused_or_warned():
    fns, params, X, y = _model(2)
    pipe = mg.Pipeline(
        list(zip(["dev0", "dev1"], fns, params, strict=True)),
        loss=_xent,
        optimizer=optax.sgd(0.1),
        microbatches=8,
    )
    with pytest.raises(
        ValueError,
        match=r"Pipeline\.fit: batch_size is 4, fewer than microbatches=8: each batch would run as 4 "
        r"microbatches of one row, not 8; use batch_size >= 8 .*or mg\.Pipeline\(\.\.\., microbatches=4\)",
    ):
        pipe.fit((X, y), steps=1, batch_size=4, progress=False)
    assert pipe.step == 0  # nothing ran
    batches = [(X[:8], y[:8]), (X[:4], y[:4]), (X[:3], y[:3])]  # a loader's batches, the later ones short
    with pytest.warns(mg.train.FewerMicrobatches) as caught:
        pipe.fit(batches, steps=3, progress=False)
    assert [str(w.message) for w in caught] == [  # once a fit, naming the first short step
        "Pipeline.fit: step 2's batch has 4 row(s), fewer than microbatches=8: it runs as 4 microbatches of "
        "one row (as a loader's short last batch does); if every batch is this short, use "
        "mg.Pipeline(..., microbatches=4) or larger batches (said once a fit)"
    ]
    assert pipe.step == 3


def test_stages_on_one_device_read_each_loss_one_step_late_with_the_same_result():
    """On one device a step's loss is read after the next step's dispatch (the skeleton's rule):
    the update is gated on the device, so a NaN step still leaves its update out, and the step
    dispatched behind it trains on."""
    fns, params, X, y = _model(2)
    bad = X.copy()
    bad[3, 1] = np.nan
    data = lambda step: (bad if step == 3 else X, y)  # noqa: E731
    with pytest.warns(UserWarning, match="run on one device"):
        late = mg.Pipeline(list(zip(["dev0", "dev0"], fns, params, strict=True)), loss=_xent, microbatches=2)
    at_once = mg.Pipeline(list(zip(["dev0", "dev1"], fns, params, strict=True)), loss=_xent, microbatches=2)
    for pipe in (late, at_once):
        with pytest.warns(mg.train.StepsSkipped):
            hist = pipe.fit(data, optax.sgd(0.1), steps=5, on_nan="skip", progress=False)
        assert pipe.step == 5 and np.isnan(hist.loss[2]) and np.isfinite(hist.loss[[0, 1, 3, 4]]).all()
    for a, b in zip(
        jax.tree_util.tree_leaves(late.params), jax.tree_util.tree_leaves(at_once.params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    with pytest.raises(FloatingPointError, match=r"step 8's loss .* the fit stopped at step 9"):
        late.fit(lambda step: (bad if step == 8 else X, y), optax.sgd(0.1), steps=5, progress=False)
    assert late.step == 9 and late.history.stopped == "nan" and np.isnan(late.history.loss[-1])
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree_util.tree_leaves(late.params))


def test_two_fits_of_arrays_are_one_fit_with_or_without_prefetch():
    fns, params, X, y = _model(2)
    stages = list(zip(["dev0", "dev1"], fns, params, strict=True))
    one = mg.Pipeline(stages, loss=_xent, microbatches=2, optimizer=optax.adam(1e-2))
    one.fit((X, y), steps=7, batch_size=8, progress=False)
    two = mg.Pipeline(stages, loss=_xent, microbatches=2, optimizer=optax.adam(1e-2), prefetch=0)
    two.fit((X, y), steps=4, batch_size=8, progress=False)
    two.fit((X, y), steps=3, batch_size=8, progress=False)  # goes on where the first stopped
    assert two.step == 7
    for a, b in zip(
        jax.tree_util.tree_leaves(one.params), jax.tree_util.tree_leaves(two.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_pipeline_resumed_from_a_checkpoint_gives_the_uninterrupted_runs_parameters(tmp_path):
    fns, params, X, y = _model(2)
    stages = list(zip(["dev0", "dev1"], fns, params, strict=True))

    def pipe(**kw):
        return mg.Pipeline(stages, loss=_xent, microbatches=2, optimizer=optax.adam(1e-2), **kw)

    whole_run = pipe()
    whole_run.fit((X, y), steps=9, batch_size=8, progress=False)
    first = pipe(checkpoint=tmp_path, every=3)
    first.fit((X, y), steps=7, batch_size=8, progress=False)  # checkpoints at 3 and 6
    first.checkpoints.close()
    again = pipe(checkpoint=tmp_path, every=3)
    hist = again.fit((X, y), steps=9, batch_size=8, resume=True, progress=False)
    assert again.step == 9 and len(hist) == 3  # from step 6: the run's 9 steps
    for a, b in zip(
        jax.tree_util.tree_leaves((again.params, again.opt_state)),
        jax.tree_util.tree_leaves((whole_run.params, whole_run.opt_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [mg.where(p) for p in again.params] == ["dev0", "dev1"]
    with pytest.raises(ValueError, match=r"holds step 9, ahead of this pipeline \(step 0\)"):
        pipe(checkpoint=tmp_path, every=3).fit((X, y), steps=2, batch_size=8, progress=False)
    with pytest.raises(TypeError, match=r"resume=True restores from the pipeline's checkpoint folder"):
        pipe().fit((X, y), steps=2, resume=True, progress=False)
    again.checkpoints.close()
