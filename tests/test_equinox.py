"""Models as Equinox and Flax NNX users write them: a module passed as ``params``. Its arrays
are trained; its other leaves (functions, strings) are held as given, as
``eqx.partition(model, eqx.is_array)`` holds them. Every trainer is checked against an
equinox + optax loop on one device (``eqx.filter_value_and_grad``)."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mgkit as mg

ROWS, BATCH, STEPS = 64, 16, 12


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 3)).astype(np.float32)
    y = np.stack([x.sum(1), x[:, 0] * x[:, 1]], axis=1).astype(np.float32)
    return x, y


def _batches():
    x, y = _data()
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, ROWS, BATCH)]


def _swish(x):
    return x * jax.nn.sigmoid(1.5 * x)


class Net(eqx.Module):
    """A module as users write it: a custom activation and a string field beside its layers."""

    first: eqx.nn.Linear
    last: eqx.nn.Linear
    activation: Callable
    name: str

    def __init__(self, key, activation=_swish, name="net"):
        k1, k2 = jax.random.split(key)
        self.first = eqx.nn.Linear(3, 8, key=k1)
        self.last = eqx.nn.Linear(8, 2, key=k2)
        self.activation, self.name = activation, name

    def __call__(self, x):
        return self.last(self.activation(self.first(x)))


def _mlp():
    return eqx.nn.MLP(3, 2, 8, 2, activation=jax.nn.tanh, key=jax.random.key(1))


def _models():
    return {"mlp": _mlp, "custom": lambda: Net(jax.random.key(2))}


def _loss(model, batch):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _reference(model, optimizer, batches, steps):
    """The equinox + optax loop on one device."""
    state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state, batch):
        loss, grads = eqx.filter_value_and_grad(_loss)(model, batch)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for i in range(steps):
        model, state, loss = step(model, state, batches[i % len(batches)])
        losses.append(float(loss))
    return model, losses


def _assert_same_model(got, want, rtol=1e-5, atol=1e-6):
    got_arrays, got_static = eqx.partition(got, eqx.is_array)
    want_arrays, want_static = eqx.partition(want, eqx.is_array)
    assert jax.tree_util.tree_structure(got_static) == jax.tree_util.tree_structure(want_static)
    for g, w in zip(
        jax.tree_util.tree_leaves(got_static), jax.tree_util.tree_leaves(want_static), strict=True
    ):
        assert g is w  # held as given: the same function, the same string
    for g, w in zip(
        jax.tree_util.tree_leaves(got_arrays), jax.tree_util.tree_leaves(want_arrays), strict=True
    ):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


# -- the trainer -------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["mlp", "custom"])
@pytest.mark.parametrize("contexts", [1, 8])
def test_trainer_trains_a_module_as_the_equinox_loop_does(which, contexts):
    model = _models()[which]()
    optimizer = optax.adam(1e-2)
    want, want_losses = _reference(model, optimizer, _batches(), STEPS)
    tr = mg.Trainer(_loss, optimizer, model, contexts=contexts)
    hist = tr.fit(_data(), steps=STEPS, batch_size=BATCH, shuffle=False)
    assert type(tr.params) is type(model)
    _assert_same_model(tr.params, want)
    np.testing.assert_allclose(hist.loss, want_losses, rtol=1e-5, atol=1e-6)
    if which == "custom":
        assert tr.params.activation is _swish and tr.params.name == "net"
        assert mg.where(tr.params) == ("dev0" if contexts == 1 else "dev0+dev1+dev2+dev3+dev4+dev5+dev6+dev7")
    # the optimizer state is that of the model's arrays, as eqx.filter gives them
    want_state = optimizer.init(eqx.filter(model, eqx.is_array))
    assert jax.tree_util.tree_structure(tr.opt_state) == jax.tree_util.tree_structure(want_state)


def test_the_gather_update_copy_loop_trains_a_module_too():
    model = Net(jax.random.key(2))
    want, _ = _reference(model, optax.sgd(0.1), _batches(), STEPS)
    mg.use_contexts("a->cpu0;b->cpu0;c->cpu1", verbose=False)  # a shared device: the loop
    tr = mg.Trainer(_loss, optax.sgd(0.1), model)
    assert "gather-update-copy" in repr(tr)
    tr.fit(_data(), steps=STEPS, batch_size=BATCH, shuffle=False)
    _assert_same_model(tr.params, want)


def test_step_fn_takes_and_returns_the_module():
    model = Net(jax.random.key(2))
    want, _ = _reference(model, optax.sgd(0.1), _batches(), 3)
    tr = mg.Trainer(_loss, optax.sgd(0.1), model)
    params, state = tr.params, tr.opt_state
    for batch in _batches()[:3]:
        out = tr.step_fn(params, state, batch)
        params, state = out.params, out.opt_state
    assert isinstance(params, Net)
    _assert_same_model(params, want)
    other = Net(jax.random.key(2), activation=jax.nn.relu)
    with pytest.raises(
        ValueError, match=r"Trainer.step_fn: params holds .*relu.* at \.activation.*make a new one"
    ):
        tr.step_fn(other, state, _batches()[0])


def test_a_module_resumes_from_its_checkpoint(tmp_path):
    model = Net(jax.random.key(2))
    whole = mg.Trainer(_loss, optax.adam(1e-2), model)
    whole.fit(_data(), steps=8, batch_size=BATCH)
    first = mg.Trainer(_loss, optax.adam(1e-2), model, checkpoint=tmp_path, every=2)
    first.fit(_data(), steps=4, batch_size=BATCH)
    again = mg.Trainer(_loss, optax.adam(1e-2), model, checkpoint=tmp_path, every=2)
    again.fit(_data(), steps=8, batch_size=BATCH, resume=True)
    assert again.step == 8
    _assert_same_model(again.params, whole.params, rtol=0, atol=0)


# -- many models -------------------------------------------------------------------------------


def test_modules_as_ensemble_members():
    optimizer = optax.adam(1e-2)
    models = {"dev0": _mlp(), "dev1": Net(jax.random.key(2))}
    members = {
        ctx: mg.Member(_loss, optimizer, m, data=_data(), batch_size=BATCH, shuffle=False, steps=STEPS)
        for ctx, m in models.items()
    }
    res = mg.Ensemble(members).fit()
    for ctx, m in models.items():
        want, want_losses = _reference(m, optimizer, _batches(), STEPS)
        assert res[ctx].error is None
        _assert_same_model(res[ctx].params, want)
        np.testing.assert_allclose(res[ctx].history.loss, want_losses, rtol=1e-5, atol=1e-6)
    assert mg.where(res["dev1"].params) == "dev1"


class _Head(eqx.Module):
    layer: eqx.nn.Linear
    activation: Callable
    label: str

    def __call__(self, h):
        return self.layer(self.activation(h))


class _Joined(eqx.Module):
    body: eqx.nn.Linear
    head: _Head

    def __call__(self, x):
        return self.head(self.body(x))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_modules_as_pipeline_stages(schedule):
    k1, k2 = jax.random.split(jax.random.key(3))
    body = eqx.nn.Linear(3, 8, key=k1)
    head = _Head(eqx.nn.Linear(8, 2, key=k2), _swish, "head")
    optimizer = optax.adam(1e-2)
    want, want_losses = _reference(_Joined(body, head), optimizer, _batches(), STEPS)
    pipe = mg.Pipeline(
        [("dev0", lambda m, x: jax.vmap(m)(x), body), ("dev1", lambda m, h: jax.vmap(m)(h), head)],
        loss=lambda out, y: jnp.mean((out - y) ** 2),
        microbatches=4,
        schedule=schedule,
    )
    hist = pipe.fit(_data(), optimizer, steps=STEPS, batch_size=BATCH, shuffle=False)
    got_body, got_head = pipe.params
    assert isinstance(got_head, _Head) and got_head.activation is _swish and got_head.label == "head"
    _assert_same_model(_Joined(got_body, got_head), want)
    np.testing.assert_allclose(hist.loss, want_losses, rtol=1e-5, atol=1e-6)
    loss, grads = pipe.value_and_grad(pipe.params, _batches()[0])
    assert grads[1].activation is None and grads[1].label is None  # a gradient of the arrays only
    one = jax.devices()[0]
    joined = jax.tree.map(
        lambda a: jax.device_put(a, one) if eqx.is_array(a) else a, _Joined(got_body, got_head)
    )
    want_loss, _ = eqx.filter_value_and_grad(_loss)(joined, _batches()[0])
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)


# -- a call split across contexts --------------------------------------------------------------


def test_parallel_shares_a_module_on_every_context():
    model = Net(jax.random.key(2))
    x, _ = _data()
    x = x[:37]  # rows that do not divide by 8
    f = mg.parallel(lambda m, x: jax.vmap(m)(x), in_axes=(None, 0))
    np.testing.assert_allclose(np.asarray(f(model, x)), np.asarray(jax.vmap(model)(x)), rtol=1e-6, atol=1e-6)
    other = Net(jax.random.key(2), activation=jax.nn.relu)  # another function: another program
    np.testing.assert_allclose(np.asarray(f(other, x)), np.asarray(jax.vmap(other)(x)), rtol=1e-6, atol=1e-6)
    grads = eqx.filter_grad(lambda m: f(m, x).sum())(model)
    want = eqx.filter_grad(lambda m: jax.vmap(m)(x).sum())(model)
    _assert_same_model(grads, want, rtol=1e-5, atol=1e-5)
    p = mg.pmap(lambda m, x: jax.vmap(m)(x), in_axes=(None, 0))
    np.testing.assert_allclose(
        np.asarray(p(model, x[:32].reshape(8, 4, 3))).reshape(32, 2),
        np.asarray(jax.vmap(model)(x[:32])),
        rtol=1e-6,
        atol=1e-6,
    )


def test_parallel_names_a_module_that_is_split():
    with pytest.raises(
        TypeError, match=r"parallel: argument 'm', leaf \.activation is a function.*in_axes=None"
    ):
        mg.parallel(lambda m, x: jax.vmap(m)(x))(Net(jax.random.key(2)), _data()[0])


# -- what stays an error -----------------------------------------------------------------------


class _Scaled(eqx.Module):
    layer: eqx.nn.Linear
    scale: float

    def __call__(self, x):
        return self.scale * self.layer(x)


def _python_number_cases():
    model = _Scaled(eqx.nn.Linear(3, 2, key=jax.random.key(0)), 2.0)
    return [
        ("Trainer", lambda: mg.Trainer(_loss, optax.sgd(0.1), model)),
        ("Trainer", lambda: mg.Trainer(_loss, optax.sgd(0.1), lambda: model)),  # made by a function
        ("fits", lambda: mg.fits(lambda: model, optax.sgd(0.1))),
        ("Member", lambda: mg.Member(_loss, optax.sgd(0.1), model, data=_data())),
        (
            r"Pipeline: stage 0",
            lambda: mg.Pipeline([("dev0", lambda m, x: jax.vmap(m)(x), model)], loss=lambda o, y: 0.0),
        ),
    ]


@pytest.mark.parametrize(("where", "make"), _python_number_cases())
def test_a_python_number_leaf_asks_parameter_or_constant(where, make):
    with pytest.raises(TypeError) as info:
        make()
    text = str(info.value)
    assert text.startswith(where)
    assert "leaf .scale is a Python float (2.0): is it a parameter or a constant?" in text, text
    assert "jnp.asarray(2.0, jnp.float32)" in text and "eqx.field(static=True)" in text


def test_a_module_of_functions_only_has_no_parameters():
    with pytest.raises(ValueError, match=r"Trainer: params has no arrays"):
        mg.Trainer(_loss, optax.sgd(0.1), {"f": jax.nn.relu, "name": "x"})


# -- Flax NNX keeps working --------------------------------------------------------------------


def test_a_flax_nnx_module_and_its_state_train_as_the_nnx_loop_does():
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.first = nnx.Linear(3, 8, rngs=rngs)
            self.last = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.last(jax.nn.relu(self.first(x)))

    def loss(m, batch):
        x, y = batch
        return jnp.mean((m(x) - y) ** 2)

    ref = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        value, grads = nnx.value_and_grad(loss)(model, batch)
        opt.update(model, grads)
        return value

    want = [float(step(ref, opt, b)) for b in _batches()[:4] * 2]

    module = mg.Trainer(loss, optax.adam(1e-2), Model(nnx.Rngs(0)))
    got = module.fit(_data(), steps=8, batch_size=BATCH, shuffle=False).loss
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert isinstance(module.params, Model)

    graphdef, state = nnx.split(Model(nnx.Rngs(0)))
    split = mg.Trainer(lambda s, b: loss(nnx.merge(graphdef, s), b), optax.adam(1e-2), state)
    np.testing.assert_allclose(
        split.fit(_data(), steps=8, batch_size=BATCH, shuffle=False).loss, want, rtol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(nnx.state(module.params)["first"]["kernel"][...]),
        np.asarray(nnx.state(ref)["first"]["kernel"][...]),
        rtol=1e-5,
        atol=1e-6,
    )


# -- big models: split, created split, accumulated ---------------------------------------------


def _wide():
    return eqx.nn.MLP(3, 2, 512, 1, activation=jax.nn.tanh, key=jax.random.key(4))


@pytest.mark.parametrize("made", [False, True])
def test_a_module_trains_split_over_the_contexts(made):
    optimizer = optax.adam(1e-2)
    want, want_losses = _reference(_wide(), optimizer, _batches(), 6)
    tr = mg.Trainer(_loss, optimizer, _wide if made else _wide(), shard="fsdp", contexts=3)
    hist = tr.fit(_data(), steps=6, batch_size=BATCH, shuffle=False)
    assert tr.params.activation is jax.nn.tanh  # the module, its functions held
    weight = tr.params.layers[0].weight  # stored split: each context holds a third
    assert len(weight.sharding.device_set) == 3 and weight.addressable_shards[0].data.size == weight.size // 3
    _assert_same_model(tr.params, want)
    np.testing.assert_allclose(hist.loss, want_losses, rtol=1e-5, atol=1e-6)


def test_show_sharding_of_a_split_module_skips_its_functions():
    tr = mg.Trainer(_loss, optax.adam(1e-2), _wide(), shard="fsdp", contexts=3)
    tr.fit(_data(), steps=1, batch_size=BATCH, progress=False)
    view = mg.show_sharding(tr.params, widget=False)  # the activation is held static: skipped
    assert [lay.path for lay in view.layouts] == [
        ".layers[0].weight",
        ".layers[0].bias",
        ".layers[1].weight",
        ".layers[1].bias",
    ]
    first, _, last, _ = view.layouts
    assert first.parts == (1, 3) and not first.padded  # 512 x 3: split evenly, on the contexts
    assert last.places == () and "on the host (numpy)" in str(view)  # 2 x 512: padded, read to the host
    stored = {lay.path: lay for lay in mg.show_sharding(tr, widget=False).layouts}
    assert stored["['params'].layers[1].weight"].padded == (1,)  # as stored: 512 in 3 blocks of 171
    assert stored["['params'].layers[1].weight"].shard == (2, 171)


def test_a_module_accumulates_as_the_whole_batch():
    optimizer = optax.sgd(0.1)
    want, _ = _reference(Net(jax.random.key(2)), optimizer, _batches(), 4)
    tr = mg.Trainer(_loss, optimizer, Net(jax.random.key(2)))
    tr.fit(_data(), steps=4, batch_size=BATCH, shuffle=False, accumulate=2)
    _assert_same_model(tr.params, want)
