"""mg.Ensemble: different models side by side, each equal to training it alone; dispatch before
waiting; failure isolation; Ctrl-C; step events, the dashboard's lines and the picture."""

import _thread
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mgkit as mg
from mgkit.train import _ensemble

ROWS = 96


def _data(seed=0, n=ROWS, d=6):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = (X @ rng.normal(size=d) > 0).astype(np.int32)
    return X, y


def _linear(p, b):
    X, y = b
    logits = X @ p["w"] + p["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _mlp(p, b):
    X, y = b
    h = jnp.tanh(X @ p["w1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], y).mean()


def _params(kind, d=6, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    if kind == "linear":
        return {"w": jnp.zeros((d, 2)), "b": jnp.zeros(2)}
    return {"w1": jax.random.normal(k1, (d, 12)) * 0.3, "w2": jax.random.normal(k2, (12, 2)) * 0.3}


def _same(a, b):
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


def _members(contexts):
    """Members that differ in architecture, optimizer, data, steps and batch size; the last
    two share the last context."""
    specs = [
        ("linear", optax.sgd(0.1), 0, 16, 12),
        ("mlp", optax.adam(1e-2), 1, 32, 20),
        ("mlp", optax.sgd(0.05, momentum=0.9), 2, 24, 8),
        ("linear", optax.adamw(5e-3), 3, 20, 15),
    ]
    out = {}
    for i, ctx in enumerate(contexts):
        kind, opt, seed, batch, steps = specs[i % len(specs)]
        out.setdefault(ctx, []).append(
            (
                kind,
                opt,
                seed,
                batch,
                steps,
                mg.Member(
                    _linear if kind == "linear" else _mlp,
                    opt,
                    _params(kind, seed=seed),
                    data=_data(seed),
                    batch_size=batch,
                    steps=steps,
                    seed=seed,
                    name=f"m{i}",
                ),
            )
        )
    return out


@pytest.mark.parametrize("contexts", [["dev0", "dev0"], ["dev0", "dev1", "dev2", "dev3", "dev3"]])
def test_every_member_ends_with_the_parameters_it_trains_to_alone(contexts):
    members = _members(contexts)
    ens = mg.Ensemble({ctx: [m[-1] for m in group] for ctx, group in members.items()})
    res = ens.fit(progress=False)
    assert set(res) == {f"m{i}" for i in range(len(contexts))}
    i = 0
    for ctx, group in members.items():
        for kind, opt, seed, batch, steps, _ in group:
            name = f"m{i}"
            i += 1
            alone = mg.Trainer(
                _linear if kind == "linear" else _mlp,
                opt,
                _params(kind, seed=seed),
                contexts=[ctx],
                seed=seed,
            )
            alone.fit(_data(seed), steps=steps, batch_size=batch, progress=False)
            r = res[name]
            assert r.context == ctx and r.step == steps and len(r.history) == steps and r.error is None
            assert _same(r.params, alone.params), name  # bit for bit on CPU
            assert mg.where(r.params) == ctx
            assert not jax.tree_util.tree_leaves(r.opt_state) or mg.where(r.opt_state) == ctx
            np.testing.assert_array_equal(r.history.loss, alone.history.loss)


def test_every_members_step_is_dispatched_before_any_loss_is_read(monkeypatch):
    log = []
    ens = mg.Ensemble(
        {
            "dev0": mg.Member(_linear, optax.sgd(0.1), _params("linear"), data=_data(0), steps=3),
            "dev1": mg.Member(_mlp, optax.adam(1e-2), _params("mlp"), data=_data(1), steps=3),
        }
    )
    for name, runner in ens._runners.items():
        program = runner.program

        def logged(*args, name=name, program=program):
            log.append(("dispatch", name))
            return program(*args)

        runner.program = logged
    read = _ensemble.Ensemble._read

    def logged_read(self, item, *args):
        log.append(("read", item.fit.runner.name))
        return read(self, item, *args)

    monkeypatch.setattr(_ensemble.Ensemble, "_read", logged_read)
    ens.fit(progress=False)
    rounds = [("dispatch", "dev0"), ("dispatch", "dev1")]
    reads = [("read", "dev0"), ("read", "dev1")]
    assert log == rounds + rounds + reads + rounds + reads + reads


def test_step_events_and_the_dashboard_show_each_member():
    ens = mg.Ensemble(
        {
            "dev0": [
                mg.Member(_linear, optax.sgd(0.1), _params("linear"), data=_data(0), name="lin"),
                mg.Member(_mlp, optax.adam(1e-2), _params("mlp"), data=_data(1), name="mlp"),
            ],
            "dev1": mg.Member(_mlp, optax.sgd(0.1), _params("mlp", seed=2), data=_data(2)),
        }
    )
    view = mg.ThroughputView(widget=False)
    res = ens.fit(steps=6, progress=False)
    steps = mg.ledger().records("step")
    assert len(steps) == 18
    for name in ("lin", "mlp", "dev1"):
        mine = [e for e in steps if e.info["member"] == name]
        assert [e.info["iteration"] for e in mine] == list(range(1, 7))
        assert all(e.info["samples_per_second"] > 0 and e.seconds >= 0 for e in mine)
        assert [e.info["loss"] for e in mine] == res[name].history.loss.tolist()
    series = view.series()
    assert {"dev0:lin", "dev0:mlp", "dev1"} <= set(series)
    text = view.text()
    assert "loss" in text and f"{res['lin'].history.loss[-1]:.6g}" in text
    assert "dev0:mlp" in repr(mg.Dashboard(widget=False))
    view.close()
    shown = ens.schedule(steps=3, widget=False)
    assert set(shown.rows) == {"dev0", "dev1"}
    assert len(shown.blocks) == 9 and {b.label for b in shown.blocks} == {"lin", "mlp", "dev1"}
    text = str(shown)
    assert "ensemble schedule: 3 member(s) on 2 context(s)" in text and "step of mlp" in text
    assert "mgkit ensemble: 3 member(s)" in repr(res) and "lin" in repr(res)


def test_a_member_that_raises_is_reported_while_the_others_finish():
    X, y = _data(0)

    def flaky(step):
        if step == 4:
            raise ValueError("no batch for step 4")
        return X[:16], y[:16]

    ens = mg.Ensemble(
        {
            "dev0": mg.Member(_linear, optax.sgd(0.1), _params("linear"), data=flaky, name="flaky"),
            "dev1": mg.Member(_mlp, optax.adam(1e-2), _params("mlp"), data=(X, y), name="ok"),
        }
    )
    with pytest.warns(RuntimeWarning, match=r"member 'flaky' on dev0 failed at step 4.*others went on"):
        res = ens.fit(steps=10, progress=False)
    err = res["flaky"].error
    assert (err.member, err.context, err.step) == ("flaky", "dev0", 4)
    assert isinstance(err.error, ValueError) and "no batch for step 4" in err.traceback
    assert "flaky" in err.traceback  # the user's own frame is in it
    assert res["flaky"].step == 3 and res["flaky"].stopped == "error" and len(res["flaky"].history) == 3
    assert res["ok"].step == 10 and res["ok"].error is None and res["ok"].stopped is None
    assert "error at step 4" in repr(res)


def test_a_nan_keeps_the_members_last_finite_state_and_stop_all_stops_everyone():
    X, y = _data(0)
    bad = X.copy()
    bad[0, 0] = np.nan

    def nan_at_5(step):
        return (bad if step == 5 else X)[:32], y[:32]

    def fine(step):
        return X[:32], y[:32]

    ens = mg.Ensemble(
        {
            "dev0": mg.Member(_linear, optax.sgd(0.1), _params("linear"), data=nan_at_5, name="nan"),
            "dev1": mg.Member(_linear, optax.sgd(0.1), _params("linear"), data=fine, name="other"),
        }
    )
    with pytest.warns(RuntimeWarning, match="everyone stopped"):
        res = ens.fit(steps=50, on_error="stop_all", progress=False)
    err = res["nan"].error
    assert err.step == 5 and isinstance(err.error, FloatingPointError) and res["nan"].stopped == "nan"
    # the NaN step counts, as a trainer's does, with its update not applied; the step dispatched
    # behind it changed nothing
    assert res["nan"].step == 5
    assert 5 <= res["other"].step <= 7 and res["other"].stopped == "stopped"
    alone = mg.Trainer(_linear, optax.sgd(0.1), _params("linear"), contexts=["dev0"])
    alone.fit(fine, steps=4, progress=False)
    assert _same(res["nan"].params, alone.params)


def test_ctrl_c_stops_every_member_at_a_step_boundary_and_the_next_fit_goes_on():
    X, y = _data(0)
    asked = []

    def batches(step):
        asked.append(step)
        if step == 8 and asked.count(8) == 1:
            threading.Timer(0.0, _thread.interrupt_main).start()
            time.sleep(0.05)
        return X[:32], y[:32]

    ens = mg.Ensemble(
        {
            "dev0": mg.Member(_linear, optax.sgd(0.1), _params("linear"), data=batches, name="a"),
            "dev1": mg.Member(_mlp, optax.adam(1e-2), _params("mlp"), data=(X, y), batch_size=32, name="b"),
        }
    )
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt, match="step boundary"):
        ens.fit(steps=10_000, progress=False)
    assert time.perf_counter() - t0 < 30
    res = ens.result
    for name in ("a", "b"):
        r = res[name]
        # the round under way when Ctrl-C came ends (a late signal: a round or two more); a
        # member's loader asks for batches up to prefetch + 1 steps ahead of the step that runs
        assert r.stopped == "interrupted" and 8 - 3 <= r.step <= 12 and len(r.history) == r.step
        assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree_util.tree_leaves(r.params))
    before = ens.step
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ens.fit(steps=3, progress=False)
    assert ens.step == {name: before[name] + 3 for name in before}


def test_a_member_with_on_nan_skip_goes_on_and_one_whose_data_runs_out_warns():
    X, y = _data(0)
    bad = X.copy()
    bad[0, 0] = np.nan

    def nan_at_2(step):
        return (bad if step == 2 else X)[:32], y[:32]

    batches = [(X[:32], y[:32])] * 2
    ens = mg.Ensemble(
        {
            "dev0": mg.Member(
                _linear, optax.sgd(0.1), _params("linear"), data=nan_at_2, on_nan="skip", name="s"
            ),
            "dev1": mg.Member(_linear, optax.sgd(0.1), _params("linear"), data=batches, name="short"),
        }
    )
    with (
        pytest.warns(mg.train.DataRanOut, match=r"member 'short': the data ended after 2 of 4 step\(s\)"),
        pytest.warns(mg.train.StepsSkipped, match=r"member 's': 1 of 4 step\(s\)"),
    ):
        res = ens.fit(steps=4, progress=False)
    h = res["s"].history
    assert (
        res["s"].error is None
        and res["s"].step == 4
        and np.isnan(h.loss[1])
        and np.isfinite(h.loss[[0, 2, 3]]).all()
    )
    assert res["short"].stopped == "data ran out" and res["short"].step == 2
    # skipping gives what a trainer that skips gives
    alone = mg.Trainer(_linear, optax.sgd(0.1), _params("linear"), contexts=["dev0"], on_nan="skip")
    with pytest.warns(mg.train.StepsSkipped):
        alone.fit(nan_at_2, steps=4, progress=False)
    assert _same(res["s"].params, alone.params)
    with pytest.raises(ValueError, match=r"Member 'x': on_nan='no'"):
        mg.Member(_linear, optax.sgd(0.1), _params("linear"), data=(X, y), on_nan="no", name="x")


def test_members_with_checkpoint_folders_resume_to_the_uninterrupted_runs_parameters(tmp_path):
    def ensemble(**kw):
        return mg.Ensemble(
            {
                "dev0": mg.Member(
                    _mlp, optax.adam(1e-2), _params("mlp"), data=_data(0), batch_size=16, name="m", **kw
                ),
                "dev1": mg.Member(
                    _linear, optax.sgd(0.1), _params("linear"), data=_data(1), prefetch=0, name="l"
                ),
            }
        )

    whole_run = ensemble().fit(steps=9, progress=False)
    first = ensemble(checkpoint=tmp_path / "m", every=3)
    first.fit(steps=7, progress=False)  # the member m saves at 3 and 6
    again = ensemble(checkpoint=tmp_path / "m", every=3)
    res = again.fit(steps=9, resume=True, progress=False)
    # m goes on from its step 6 (3 steps); l, without a folder, runs its 9 steps from the start
    assert len(res["m"].history) == 3 and res["m"].step == 9 and res["l"].step == 9
    assert _same(res["m"].params, whole_run["m"].params) and _same(res["l"].params, whole_run["l"].params)
    with pytest.raises(TypeError, match=r"resume=True restores each member from its checkpoint folder"):
        ensemble().fit(steps=2, resume=True, progress=False)
    with pytest.raises(ValueError, match=r"member 'm': the checkpoint folder .* ahead of this member"):
        ensemble(checkpoint=tmp_path / "m", every=3).fit(steps=2, progress=False)
