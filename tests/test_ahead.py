"""Why it is not N times faster: a step planned ahead of time (``Trainer.plan``, ``mg.plan``),
compiled from shapes for each layout of a grid, nothing allocated, its memory what the running
step's program needs; the roofline model that predicts its time (``mgkit._roofline``);
``shard="auto"``; and the scaling study (``mg.scaling``) with its verdict."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mgkit as mg
from mgkit import _roofline
from mgkit._oom import program_bytes

WIDTH = 256


def _loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"])
    h = jnp.tanh(h @ p["w2"])
    return jnp.mean((h @ p["w3"] - b["y"]) ** 2)


def _params():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {
        "w1": jax.random.normal(k1, (32, WIDTH)) * 0.1,
        "w2": jax.random.normal(k2, (WIDTH, WIDTH)) * 0.1,
        "w3": jax.random.normal(k3, (WIDTH, 1)) * 0.1,
    }


def _batch(rows=128):
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(rows, 32)).astype(np.float32),
        "y": rng.normal(size=(rows, 1)).astype(np.float32),
    }


def _live() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


@pytest.mark.parametrize("shard", ["replicate", "fsdp"])
def test_the_planned_peak_is_what_the_running_step_needs_and_nothing_is_allocated(shard):
    tr = mg.Trainer(_loss, optax.adam(1e-3), _params(), shard=shard)
    before = _live()
    planned = tr.plan(_batch())
    assert _live() == before  # shapes only: not an array of the model was made
    (row,) = planned.rows()
    assert (row.contexts, row.shard, row.accumulate, row.precision) == (8, shard, 1, "fp32")
    tr.fit(lambda step: _batch(), steps=1, progress=False)
    (reading,) = [r for r in tr._collectives._readings.values() if r.compiled is not None]
    assert row.peak == program_bytes(reading.compiled)  # the very program the fit compiled
    assert row.peak >= row.arguments + row.temporaries > 0
    assert row.sent == tr.communication().sent and row.flops == tr.communication().flops


def test_a_grid_is_every_combination_in_order_and_planned_again_compiles_nothing():
    tr = mg.Trainer(_loss, optax.adam(1e-3), _params())
    grid = {"contexts": [4, 8], "shard": ["replicate", "fsdp"], "accumulate": [1, 4]}
    planned = tr.plan(_batch(), **grid)
    rows = planned.rows()
    assert [(r.contexts, r.shard, r.accumulate) for r in rows] == [
        (n, s, a) for n in (4, 8) for s in ("replicate", "fsdp") for a in (1, 4)
    ]
    by = {(r.contexts, r.shard, r.accumulate): r for r in rows}
    # fsdp holds an eighth (a quarter on 4) of the state; replicated, only the batch's share differs
    assert by[(8, "fsdp", 1)].arguments < by[(4, "fsdp", 1)].arguments < by[(4, "replicate", 1)].arguments
    share = (128 // 4 - 128 // 8) * (32 + 1) * 4  # rows x (x's and y's floats) x 4 bytes
    assert by[(4, "replicate", 1)].arguments - by[(8, "replicate", 1)].arguments == share
    # the same arithmetic in four microbatches; fsdp gathers the parameters in each (4x the sending)
    for shard in ("replicate", "fsdp"):
        one, four = by[(8, shard, 1)], by[(8, shard, 4)]
        assert 0.8 < four.flops / one.flops < 1.3, (shard, four.flops, one.flops)
    assert by[(8, "fsdp", 4)].sent > 2 * by[(8, "fsdp", 1)].sent
    assert all(r.compile_seconds > 0 for r in rows) and all(r.seconds > 0 for r in rows)
    again = tr.plan(_batch(), **grid)
    assert [r.compile_seconds for r in again.rows()] == [0.0] * 8
    assert [r.peak for r in again.rows()] == [r.peak for r in rows]
    text = repr(planned)
    assert "8 layout(s) compiled ahead of time from shapes, nothing allocated" in text
    assert "predicted step" in text and "calibrated, 8 at once" in text


def test_a_memory_budget_marks_what_fits_and_best_is_the_fastest_that_fits():
    shapes = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((64, 1024), jnp.float32)}
    loss = lambda p, b: jnp.mean(jnp.tanh(b["x"] @ p["w"]))  # noqa: E731
    planned = mg.plan(
        loss, optax.adam(1e-3), shapes, batch, contexts=8, shard=["replicate", "fsdp"], memory="12MiB"
    )
    replicated, split = planned.rows()
    assert replicated.arguments > 12 * 2**20 and replicated.fits is False  # 4 MiB of w, 8 of adam's moments
    assert split.fits is True and split.limit == 12 * 2**20
    # what mg.fits cannot see: the step gathers w whole (4 MiB) and makes its whole gradient
    assert split.temporaries > 8 * 2**20 > 2 * 2**20 > split.arguments
    assert planned.best() is split
    assert mg.plan(loss, optax.sgd(0.1), shapes, batch, contexts=8, memory="1KiB").best() is None
    assert "NO" in repr(planned)


def test_reduced_precision_and_a_key_and_aux_are_planned_as_the_trainer_runs_them():
    def loss(p, b, key):
        drop = jax.random.bernoulli(key, 0.9, b["x"].shape)
        return _loss(p, {**b, "x": b["x"] * drop}), {"mean": jnp.mean(b["x"])}

    tr = mg.Trainer(loss, optax.adam(1e-3), _params(), key=jax.random.key(1), has_aux=True)
    rows = tr.plan(_batch(100), contexts=4, precision=["fp32", "bf16", "fp16"]).rows()  # 100 rows: 4 x 25
    assert [r.precision for r in rows] == ["fp32", "bf16", "fp16"] and all(r.peak > 0 for r in rows)
    uneven = tr.plan(_batch(101), contexts=4).rows()[0]  # the last row on every context, as fit places it
    assert uneven.rows == 101 and uneven.peak > 0


def test_bad_grids_are_named():
    tr = mg.Trainer(_loss, optax.adam(1e-3), _params())
    cases = [
        ({"shard": []}, ValueError, r"shard=\[\] is an empty grid"),
        ({"shard": "bogus"}, ValueError, r"bogus"),
        ({"contexts": 9}, ValueError, r"9"),
        ({"accumulate": [1, 0]}, ValueError, r"accumulate"),
        ({"accumulate": 1000}, ValueError, r"accumulate=1000 is more than the batch's 128 rows"),
        ({"precision": "fp8"}, ValueError, r"precision='fp8' is not one of"),
        ({"memory": "lots"}, ValueError, r"memory"),
    ]
    for kwargs, kind, words in cases:
        with pytest.raises(kind, match=words):
            tr.plan(_batch(), **kwargs)
    with pytest.raises(ValueError, match=r"Trainer\.plan: the batch has no arrays"):
        tr.plan({})
    mg.use_contexts("a->cpu0;b->cpu0", verbose=False)
    try:
        with pytest.raises(ValueError, match=r"share a device or mix kinds, so their step is the gather"):
            tr.plan(_batch(), contexts=["a", "b"])
    finally:
        mg.use_contexts(";".join(f"dev{i}->cpu{i}" for i in range(8)), verbose=False)


def test_known_accelerators_come_from_the_table_and_others_are_calibrated():
    h100 = _roofline.known("NVIDIA H100 80GB HBM3", reduced=True)
    pcie = _roofline.known("NVIDIA H100 PCIe", reduced=True)
    assert h100.source == "table: H100" and h100.flops == 989e12 and h100.link == 450e9
    assert pcie.source == "table: H100 PCIe" and pcie.link < h100.link
    assert _roofline.known("NVIDIA H200", reduced=False).bandwidth == 4.8e12
    assert _roofline.known("cpu", reduced=False) is None
    cpu = _roofline.figures(jax.devices()[0])
    assert cpu.source == "calibrated" and cpu.flops > 1e8 and cpu.bandwidth > 1e7 and cpu.dispatch < 0.1
    assert _roofline.figures(jax.devices()[1]) is cpu  # once per session
    eight = _roofline.together(tuple(jax.devices()[:8]))
    assert eight.source == "calibrated, 8 at once" and 0 < eight.flops < 2 * cpu.flops
    assert _roofline.together(tuple(jax.devices()[:8])) is eight  # once per count


def test_the_roofline_overlaps_compute_and_memory_and_adds_communication_and_dispatch():
    f = _roofline.Figures(flops=1e12, bandwidth=1e11, link=1e10, dispatch=1e-5, source="test")
    p = _roofline.predict(2e9, 1e8, 1e7, f)  # 2 ms of compute, 1 ms of memory, 1 ms sending
    assert p.seconds == pytest.approx(2e-3 + 1e-3 + 1e-5) and p.bound == "compute"
    assert _roofline.predict(None, 1e9, 0, f).bound == "memory"


def _mlp_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (512, 512)) * 0.05, "w2": jax.random.normal(k2, (512, 1)) * 0.05}


def _mlp_loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)


def _mlp_batch():
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(64, 512)).astype(np.float32),
        "y": rng.normal(size=(64, 1)).astype(np.float32),
    }


def test_auto_keeps_the_layout_that_fits_and_trains_as_that_layout_does():
    # replicated, the state (w1 and adam's two moments, 3 MiB) and the step's temporaries are over 3 MiB
    tr = mg.Trainer(_mlp_loss, optax.adam(1e-3), _mlp_params(), shard="auto", memory="3MiB")
    assert "until the first step" in tr.layout
    tr.fit(lambda step: _mlp_batch(), steps=4, progress=False)
    assert tr.shard == "fsdp" and tr.layout.startswith(
        "shard='auto' chose fsdp: the fastest predicted that fits"
    )
    assert "replicate: peak 5.0 MiB per context" in tr.layout and "over the budget" in tr.layout
    alone = mg.Trainer(_mlp_loss, optax.adam(1e-3), _mlp_params(), shard="fsdp")
    alone.fit(lambda step: _mlp_batch(), steps=4, progress=False)
    np.testing.assert_array_equal(np.asarray(tr.params["w1"]), np.asarray(alone.params["w1"]))


def test_auto_lays_the_state_out_again_when_another_layout_is_predicted_faster(monkeypatch):
    # a prediction that counts hops only: replicated (one all-reduce) beats fsdp (gathers per leaf)
    monkeypatch.setattr(
        _roofline,
        "predict",
        lambda flops, accessed, sent, figures, hops=0: _roofline.Prediction(0, 0, hops, 0),
    )
    tr = mg.Trainer(_mlp_loss, optax.adam(1e-3), _mlp_params(), shard="auto")
    assert tr.memory().rows()[0].params < 2**20  # placed split until the first step
    tr.fit(lambda step: _mlp_batch(), steps=4, progress=False)
    assert tr.shard == "replicate" and "(no memory limit known)" in tr.layout
    assert tr.memory().rows()[0].params == (512 * 512 + 512) * 4  # whole on each context now
    alone = mg.Trainer(_mlp_loss, optax.adam(1e-3), _mlp_params())
    alone.fit(lambda step: _mlp_batch(), steps=4, progress=False)
    np.testing.assert_allclose(
        np.asarray(tr.params["w1"]), np.asarray(alone.params["w1"]), rtol=1e-6, atol=1e-7
    )


def test_auto_says_what_did_not_fit_and_how_to_cut_the_step():
    tr = mg.Trainer(_mlp_loss, optax.adam(1e-3), _mlp_params(), shard="auto", memory="1MiB")
    with pytest.raises(ValueError, match=r"no layout's step fits 1\.0 MiB per context") as info:
        tr.fit(lambda step: _mlp_batch(), steps=1, progress=False)
    text = str(info.value)
    assert (
        "replicate: peak 5.0 MiB" in text
        and "fsdp: peak" in text
        and "accumulate=4" in text
        and "bf16" in text
    )
    with pytest.raises(ValueError, match=r"memory='1MiB' is the budget shard='auto' plans with"):
        mg.Trainer(_mlp_loss, optax.adam(1e-3), _mlp_params(), memory="1MiB")
    with pytest.raises(ValueError, match=r"shard='auto' chooses between replicate and fsdp .* mesh="):
        mg.Trainer(_mlp_loss, optax.adam(1e-3), _mlp_params(), shard="auto", mesh={"data": 2, "model": 4})
    with pytest.raises(ValueError, match=r"memory='lots' is not a size"):
        mg.Trainer(_mlp_loss, optax.adam(1e-3), _mlp_params(), shard="auto", memory="lots")
    mg.use_contexts("a->cpu0;b->cpu0", verbose=False)
    try:
        with pytest.raises(ValueError, match=r"contexts a, b share a device or mix kinds"):
            mg.Trainer(_mlp_loss, optax.adam(1e-3), _mlp_params(), shard="auto")
    finally:
        mg.use_contexts(";".join(f"dev{i}->cpu{i}" for i in range(8)), verbose=False)


def _make(n):
    return mg.Trainer(_mlp_loss, optax.adam(1e-3), _mlp_params(), contexts=n)


def test_a_scaling_study_measures_splits_predicts_and_names_the_bottleneck(tmp_path):
    study = mg.scaling(_make, _mlp_batch(), contexts=[4, 1, 2], steps=3)
    rows = study.rows()
    assert [r.contexts for r in rows] == [1, 2, 4] and rows[0].efficiency == pytest.approx(1.0)
    for r in rows:
        assert r.samples_per_second == pytest.approx(64 / r.seconds)
        assert r.efficiency == pytest.approx(r.samples_per_second / (r.contexts * rows[0].samples_per_second))
        assert r.predicted > 0 and set(r.split) == {"compute", "communication", "transfer", "idle"}
        assert sum(r.split.values()) == pytest.approx(r.seconds, rel=1e-6)  # shares of the measured step
    assert rows[0].split["communication"] == 0 < rows[2].split["communication"]  # one context: no collectives
    assert "CPU devices sharing this host's" in study.verdict and str(study).startswith("mgkit scaling: ")
    png = study.save_png(tmp_path / "scaling.png")
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_verdict_names_each_bottleneck_with_its_numbers():
    from mgkit.train._scaling import ScalingRow, verdict

    def row(n, rate, split, intensity=10.0):
        seconds = 64 / rate
        return ScalingRow(n, rate, seconds, rate / (n * 1000.0), seconds, split, intensity, 100.0)

    one = row(1, 1000.0, {"compute": 0.064, "communication": 0.0, "transfer": 0.0, "idle": 0.0})
    good = row(4, 3600.0, {"compute": 0.016, "communication": 0.001, "transfer": 0.0, "idle": 0.0})
    assert verdict([one, good]).startswith(
        "scales well: 90% efficiency on 4 contexts (3,600 samples/s, ideal 4,000)"
    )
    comm = row(4, 2000.0, {"compute": 0.01, "communication": 0.02, "transfer": 0.001, "idle": 0.001})
    said = verdict([one, comm])
    assert said.startswith("communication-bound: 50% efficiency on 4 contexts, 62% of a step in collectives")
    assert "arithmetic intensity 10 flops/byte, below this machine's 100" in said and "accumulate=4" in said
    idle = row(4, 2000.0, {"compute": 0.01, "communication": 0.001, "transfer": 0.001, "idle": 0.02})
    assert verdict([one, idle]).startswith(
        "dispatch/input-bound: 50% efficiency on 4 contexts; the contexts wait 62%"
    )
    moving = row(4, 2000.0, {"compute": 0.01, "communication": 0.001, "transfer": 0.02, "idle": 0.001})
    assert verdict([one, moving]).startswith(
        "transfer-bound: 50% efficiency on 4 contexts, 62% of a step copying"
    )
    assert verdict([one], "simulated").endswith("to compare (simulated)")


def test_a_scaling_study_refuses_bad_input_by_name():
    batch = _mlp_batch()
    cases = [
        (dict(make_trainer="not a function"), TypeError, r"make_trainer must be a function n -> mg\.Trainer"),
        (
            dict(make_trainer=lambda n: 3),
            TypeError,
            r"make_trainer\(1\) returned int 3; it must return an mg\.Trainer",
        ),
        (dict(make_trainer=lambda n: _make(2)), ValueError, r"make_trainer\(1\) made a trainer on 2 context"),
        (dict(make_trainer=_make, contexts=[]), ValueError, r"contexts=\[\] is an empty grid"),
        (dict(make_trainer=_make, contexts=[1, 16]), ValueError, r"asks for 16 contexts and the map has 8"),
        (dict(make_trainer=_make, contexts=4), TypeError, r"contexts must be a list of counts"),
        (dict(make_trainer=_make, contexts=[0]), ValueError, r"contexts"),
        (dict(make_trainer=_make, steps=0), ValueError, r"steps"),
    ]
    for kwargs, kind, words in cases:
        make = kwargs.pop("make_trainer")
        with pytest.raises(kind, match=words):
            mg.scaling(make, batch, **{"contexts": [1], **kwargs})


def test_mg_fits_counts_the_steps_temporaries_when_given_the_loss():
    shapes = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((64, 1024), jnp.float32)}
    loss = lambda p, b: jnp.mean(jnp.tanh(b["x"] @ p["w"]))  # noqa: E731
    state = mg.fits(shapes, optax.adam(1e-3), shard="fsdp", contexts=8, limit="6MiB", batch=batch)
    step = mg.fits(
        shapes, optax.adam(1e-3), shard="fsdp", contexts=8, limit="6MiB", batch=batch, loss_fn=loss
    )
    assert state.fits is True and "temporaries" not in repr(state)  # the state alone: 1.5 MiB
    row = step.rows()[0]
    assert row.temporaries > 4 * 2**20 and row.total == state.rows()[0].total + row.temporaries
    assert step.fits is False and "temporaries" in repr(step) and "the step's temporaries" in step.over()
    with pytest.raises(ValueError, match=r"loss_fn= plans the step on the contexts' devices with one batch"):
        mg.fits(shapes, optax.adam(1e-3), contexts=8, loss_fn=loss)
