"""Bad input to mg.Ensemble, mg.Member and mg.Pipeline: a clear error naming the bad value, what
was expected and how to fix it, before anything compiles or runs."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mgkit as mg

X = np.random.default_rng(0).normal(size=(12, 4)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32)
P = {"w": jnp.zeros((4, 2))}


def _loss(p, b):
    return jnp.mean((b[0] @ p["w"])[:, 0] - b[1])


def _member(**kw):
    kw.setdefault("data", (X, Y))
    return mg.Member(_loss, optax.sgd(0.1), P, **kw)


def _stage0(p, x):
    return jnp.tanh(x @ p["w"])


def _stage1(p, h):
    return h @ p["v"]


def _xent(out, y):
    return jnp.mean(out[:, 0] - y)


P0, P1 = {"w": jnp.zeros((4, 6))}, {"v": jnp.zeros((6, 2))}


def _pipe(stages=None, loss=_xent, **kw):
    stages = [("dev0", _stage0, P0), ("dev1", _stage1, P1)] if stages is None else stages
    return mg.Pipeline(stages, loss=loss, **kw)


CASES = {
    # the ensemble and its members
    "unknown context": (
        lambda: mg.Ensemble({"dev9": _member()}),
        mg.ContextError,
        r"unknown context 'dev9'; the contexts are dev0",
    ),
    "host memory as a context": (
        lambda: mg.Ensemble({"cpu": _member()}),
        mg.ContextError,
        r"'cpu' means host memory.*device context",
    ),
    "no members": (lambda: mg.Ensemble({}), ValueError, r"Ensemble: no members; give at least one"),
    "members not a dict": (
        lambda: mg.Ensemble([_member()]),
        TypeError,
        r"members must be a dict context -> mg.Member",
    ),
    "a member that is not a Member": (
        lambda: mg.Ensemble({"dev0": (_loss, optax.sgd(0.1), P)}),
        TypeError,
        r"members\['dev0\[0\]'\] is a function.*mg.Member\(loss_fn, optimizer, params",
    ),
    "an empty list on a context": (
        lambda: mg.Ensemble({"dev0": []}),
        ValueError,
        r"context 'dev0' has an empty list of members",
    ),
    "two members with one name": (
        lambda: mg.Ensemble({"dev0": _member(name="m"), "dev1": _member(name="m")}),
        ValueError,
        r"two members are named 'm'; give each a distinct name",
    ),
    "a member without data": (
        lambda: mg.Member(_loss, optax.sgd(0.1), P),
        TypeError,
        r"Member: no data; give the member its batches",
    ),
    "a non-optax optimizer": (
        lambda: mg.Member(_loss, "adam", P, data=(X, Y)),
        TypeError,
        r"optimizer must be an optax GradientTransformation.*got str 'adam'",
    ),
    "a loss that is not a function": (
        lambda: mg.Member(3.0, optax.sgd(0.1), P, data=(X, Y)),
        TypeError,
        r"loss_fn must be a function",
    ),
    "integer parameters": (
        lambda: mg.Member(_loss, optax.sgd(0.1), {"w": np.zeros(3, np.int32)}, data=(X, Y)),
        TypeError,
        r"params leaf \['w'\] has dtype int32; .* floating point",
    ),
    "zero steps": (lambda: _member(steps=0), ValueError, r"steps=0"),
    "a member loss that is not scalar": (
        lambda: mg.Member(lambda p, b: (b[0] @ p["w"])[:, 0], optax.sgd(0.1), P, data=(X, Y), batch_size=4),
        TypeError,
        r"Member: loss_fn must return a scalar.*shape \(4,\)",
    ),
    "a member loss that fails on its data": (
        lambda: mg.Member(lambda p, b: jnp.mean(b[0] @ p["v"]), optax.sgd(0.1), P, data=(X, Y)),
        KeyError,
        r"Member: loss_fn\(params, batch\) fails on a batch of 12 rows of data",
    ),
    "a member whose loss uses a None leaf": (
        lambda: mg.Member(
            lambda p, b: jnp.mean(b[0] @ p["w"] + p["b"]), optax.sgd(0.1), {**P, "b": None}, data=(X, Y)
        ),
        TypeError,
        r"fails on a batch of 12 rows of data: unsupported operand .*NoneType'; params\['b'\] is None: JAX",
    ),
    "a batch larger than the data": (
        lambda: _member(batch_size=50),
        ValueError,
        r"batch_size=50 is larger than the data \(12 rows\)",
    ),
    "a member without steps": (
        lambda: mg.Ensemble({"dev0": _member(), "dev1": _member(steps=3)}).fit(progress=False),
        TypeError,
        r"member 'dev0' \(dev0\) has no steps; give mg.Member\(\.\.\., steps=500\) or ens.fit\(steps=1000\)",
    ),
    "an unknown on_error": (
        lambda: mg.Ensemble({"dev0": _member()}).fit(steps=2, on_error="ignore"),
        ValueError,
        r"on_error='ignore'; use 'continue' .* or 'stop_all'",
    ),
    "a schedule of no steps": (
        lambda: mg.Ensemble({"dev0": _member()}).schedule(steps=0),
        ValueError,
        r"steps=0",
    ),
    # the pipeline
    "no stages": (
        lambda: _pipe([]),
        ValueError,
        r"Pipeline: no stages; give a list of \(context, fn, params\)",
    ),
    "a stage that is not a triple": (
        lambda: _pipe([("dev0", _stage0)]),
        TypeError,
        r"stage 0 must be a \(context, fn, params\) triple",
    ),
    "an unknown stage context": (
        lambda: _pipe([("dev0", _stage0, P0), ("dev9", _stage1, P1)]),
        mg.ContextError,
        r"Pipeline: stage 1: unknown context 'dev9'",
    ),
    "a stage fn that is not a function": (
        lambda: _pipe([("dev0", _stage0, P0), ("dev1", "head", P1)]),
        TypeError,
        r"stage 1 \(dev1\): fn must be a function fn\(params, x\) -> y",
    ),
    "a stage with no parameters": (
        lambda: _pipe([("dev0", _stage0, P0), ("dev1", lambda p, h: h, {})]),
        ValueError,
        r"stage 1 \(dev1, <lambda>\) has no parameters; .*merge",
    ),
    "zero microbatches": (lambda: _pipe(microbatches=0), ValueError, r"microbatches=0"),
    "an unknown schedule": (
        lambda: _pipe(schedule="interleaved"),
        ValueError,
        r"schedule='interleaved' is not known; use one of \['gpipe', '1f1b'\]",
    ),
    "a loss that is not a function (pipeline)": (
        lambda: _pipe(loss=None),
        TypeError,
        r"loss_fn must be a function loss\(outputs, targets\)",
    ),
    "more microbatches than rows": (
        lambda: _pipe(microbatches=13).value_and_grad(batch=(X, Y)),
        ValueError,
        r"microbatches=13, but the batch has 12 row\(s\); use microbatches <= 12",
    ),
    "a stage output that does not fit the next stage": (
        lambda: _pipe([("dev0", _stage0, P0), ("dev1", _stage1, {"v": jnp.zeros((5, 2))})]).value_and_grad(
            batch=(X, Y)
        ),
        ValueError,
        r"stage 0 \(dev0, _stage0\) outputs float32\[12,6\], which stage 1 \(dev1, _stage1\) cannot take",
    ),
    "a stage that uses a None leaf": (
        lambda: _pipe(
            [("dev0", lambda p, x: x @ p["w"] + p["b"], {**P0, "b": None}), ("dev1", _stage1, P1)]
        ).value_and_grad(batch=(X, Y)),
        TypeError,
        r"stage 0 \(dev0, <lambda>\) failed: unsupported operand .*NoneType'; stage 0 \(dev0, <lambda>\)'s "
        r"params\['b'\] is None: JAX holds None as an empty subtree",
    ),
    "inputs the first stage cannot take": (
        lambda: _pipe().value_and_grad(batch=(X[:, :3], Y)),
        ValueError,
        r"stage 0 \(dev0, _stage0\) cannot take the batch's inputs float32\[12,3\]",
    ),
    "a loss that is not scalar": (
        lambda: _pipe(loss=lambda out, y: out[:, 0] - y).value_and_grad(batch=(X, Y)),
        TypeError,
        r"loss\(outputs, targets\) must return a scalar.*shape \(12,\)",
    ),
    "a batch that is not (inputs, targets)": (
        lambda: _pipe().value_and_grad(batch=X),
        TypeError,
        r"batch must be a pair \(inputs, targets\)",
    ),
    "parameters for the wrong number of stages": (
        lambda: _pipe().value_and_grad(p=[P0], batch=(X, Y)),
        TypeError,
        r"p must be a list of 2 parameter trees, one per stage",
    ),
    "a non-optax optimizer (pipeline)": (
        lambda: _pipe().fit((X, Y), optax.adam, steps=2),
        TypeError,
        r"Pipeline.fit: optimizer must be an optax GradientTransformation",
    ),
    "a schedule before anything ran": (
        lambda: _pipe().schedule(),
        RuntimeError,
        r"nothing has run yet; call pipe.value_and_grad",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_a_clear_error(case):
    make, error, match = CASES[case]
    mg.ledger().clear()
    with pytest.raises(error, match=match):
        make()
    # found before anything computed: no forward, backward or step recorded
    assert not [e for e in mg.ledger().records() if e.kind in ("forward", "backward", "step", "transfer")]


def test_duplicate_stage_contexts_are_allowed_with_a_warning():
    with pytest.warns(
        UserWarning, match=r"stages 0 \(dev0\), 1 \(dev0\) run on one device \(cpu0\).*no overlap"
    ):
        pipe = _pipe([("dev0", _stage0, P0), ("dev0", _stage1, P1)], microbatches=2)
    loss, grads = pipe.value_and_grad(batch=(X, Y))
    assert np.isfinite(float(loss)) and [mg.where(g) for g in grads] == ["dev0", "dev0"]


def test_a_member_whose_loss_is_not_scalar_on_its_batches_is_reported_and_the_others_train():
    # batches from a function are known only when asked for: the first one shows it
    bad = mg.Member(
        lambda p, b: (b[0] @ p["w"])[:, 0], optax.sgd(0.1), P, data=lambda step: (X, Y), name="bad"
    )
    ens = mg.Ensemble({"dev0": bad, "dev1": _member(name="good")})
    with pytest.warns(RuntimeWarning, match=r"member 'bad' on dev0 failed at step 1: TypeError"):
        res = ens.fit(steps=3, progress=False)
    assert "must return a scalar" in str(res["bad"].error) and res["good"].step == 3


def test_a_missing_input_is_both_a_type_error_and_a_value_error():
    for make in (
        lambda: mg.Member(_loss, optax.sgd(0.1), P),
        lambda: mg.Ensemble({"dev0": _member()}).fit(progress=False),
        lambda: _pipe().value_and_grad(),
    ):
        for error in (TypeError, ValueError):
            with pytest.raises(error):
                make()
