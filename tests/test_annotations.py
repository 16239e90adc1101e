"""A model's own sharding: Flax annotations followed under ``mesh=`` (names that are mesh axes,
logical names mapped by rules), rule functions that see them, the trainer's mesh in force while
the loss is traced, and rules that give what no rule may give."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import mgkit as mg
from mgkit.train._annotations import annotations
from mgkit.train._plan import plan

nnx = pytest.importorskip("flax.nnx")

TOL = {"rtol": 2e-5, "atol": 1e-6}


def _auto_mesh():
    """The guide's auto_mesh: a 2 x 4 mesh of Auto axes (jax.make_mesh now makes Explicit ones)."""
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _specs(tree):
    """{path: PartitionSpec} of every array leaf."""
    return {
        jax.tree_util.keystr(path): leaf.sharding.spec
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _split(tree):
    """How many leaves are split over some mesh axis."""
    return sum(any(s is not None for s in spec) for spec in _specs(tree).values())


# -- the Flax GSPMD guide's model ("Scale up on multiple devices"), as the guide writes it ----------


class DotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth,
            depth,
            kernel_init=nnx.with_partitioning(init_fn, (None, "model")),
            use_bias=False,
            rngs=rngs,
        )
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), sharding=("model", None))

    def __call__(self, x: jax.Array):
        y = self.dot1(x)
        y = jax.nn.relu(y)
        y = jax.lax.with_sharding_constraint(y, P("data", "model"))
        z = jnp.dot(y, self.w2[...])
        return z


class MultiDotReluDot(nnx.Module):
    def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs):
        @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})
        def create_sublayers(r):
            return DotReluDot(depth, r)

        self.layers = create_sublayers(rngs.fork(split=num_layers))

    def __call__(self, x):
        def scan_over_layers(x, layer):
            return layer(x), None

        x, _ = jax.lax.scan(scan_over_layers, x, self.layers)
        return x


def _guide_data(rows=32, depth=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, depth)).astype(np.float32), rng.normal(size=(rows, depth)).astype(
        np.float32
    )


def _mse(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


@pytest.mark.filterwarnings("ignore:The 'split' argument of 'fork' is deprecated")
def test_the_gspmd_guides_model_trains_split_as_annotated_equal_to_its_own_loop():
    auto_mesh = _auto_mesh()
    x, y = _guide_data()
    with jax.set_mesh(auto_mesh):
        ref = MultiDotReluDot(32, 2, rngs=nnx.Rngs(0))
        model = MultiDotReluDot(32, 2, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(ref, optax.adam(1e-3), wrt=nnx.Param)

        @nnx.jit
        def train_step(model, optimizer, x, y):
            loss, grads = nnx.value_and_grad(lambda m: _mse(m, (x, y)))(model)
            optimizer.update(model, grads)
            return loss

        want = [float(train_step(ref, optimizer, x[i : i + 8], y[i : i + 8])) for i in range(0, 32, 8)]

    tr = mg.Trainer(_mse, optax.adam(1e-3), model, mesh={"data": 2, "model": 4})  # no shard=, no mesh set
    got = tr.fit((x, y), steps=4, batch_size=8, shuffle=False, progress=False).loss
    np.testing.assert_allclose(got, want, **TOL)
    assert _specs(tr.params) == {
        ".layers.dot1.kernel.value": P(None, None, "model"),
        ".layers.w2.value": P(None, "model", None),
    }
    assert tr.params.layers.w2.get_value().addressable_shards[0].data.shape == (2, 8, 32)
    np.testing.assert_allclose(np.asarray(tr.params.layers.w2[...]), np.asarray(ref.layers.w2[...]), **TOL)


sharding_rules = (("batch", "data"), ("hidden", "model"), ("embed", None))


class LogicalDotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth,
            depth,
            kernel_init=nnx.with_partitioning(init_fn, ("embed", "hidden")),
            use_bias=False,
            rngs=rngs,
        )
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), sharding=("hidden", "embed"))

    def __call__(self, x: jax.Array):
        y = jax.nn.relu(self.dot1(x))
        y = jax.lax.with_sharding_constraint(y, P("data", None))
        return jnp.dot(y, self.w2[...])


def _logical():
    auto_mesh = _auto_mesh()
    with jax.set_mesh(auto_mesh), nnx.logical_axis_rules(sharding_rules):
        return LogicalDotReluDot(32, rngs=nnx.Rngs(0))


def test_logical_names_are_mapped_by_flax_style_rules_and_the_state_splits_alike():
    model = _logical()
    tr = mg.Trainer(_mse, optax.adam(1e-3), model, mesh={"data": 2, "model": 4}, shard=sharding_rules)
    want = {".dot1.kernel.value": P(None, "model"), ".w2.value": P("model", None)}
    assert _specs(tr.params) == want
    graphdef, state = nnx.split(model)  # the nnx.split state carries the same annotations
    tr = mg.Trainer(
        lambda s, b: _mse(nnx.merge(graphdef, s), b),
        optax.adam(1e-3),
        state,
        mesh={"data": 2, "model": 4},
        shard=sharding_rules,
    )
    assert sorted(_specs(tr.params).values(), key=str) == sorted(want.values(), key=str)
    x, y = _guide_data()
    assert np.isfinite(tr.fit((x, y), steps=2, batch_size=8, progress=False).loss).all()


def test_a_logical_name_without_a_rule_is_named_with_its_leaf():
    with pytest.raises(
        ValueError,
        match=r"the annotation \('embed', 'hidden'\) of 'dot1/kernel/value' names 'embed', which is not a "
        r"mesh axis \(axes: \['data', 'model'\]\) and no rule maps; give logical axis rules, e.g. "
        r"shard=\(\('embed', 'model'\),\)",
    ):
        mg.Trainer(_mse, optax.sgd(0.1), _logical(), mesh={"data": 2, "model": 4})


def test_a_rule_function_sees_the_annotation_and_two_argument_functions_still_work():
    seen = {}

    def rule(path, leaf):
        seen[path] = (leaf.names, leaf.metadata.get("out_sharding"), leaf.ndim)
        return leaf.names  # names that are mesh axes: the annotation itself

    auto_mesh = _auto_mesh()
    with jax.set_mesh(auto_mesh):
        model = DotReluDot(32, rngs=nnx.Rngs(0))
    tr = mg.Trainer(_mse, optax.sgd(0.1), model, mesh={"data": 2, "model": 4}, shard=rule)
    assert seen == {
        "dot1/kernel/value": ((None, "model"), (None, "model"), 2),
        "w2/value": (("model", None), ("model", None), 2),
    }
    assert _specs(tr.params) == {".dot1.kernel.value": P(None, "model"), ".w2.value": P("model", None)}
    plain = mg.Trainer(
        _mse, optax.sgd(0.1), {"w": jnp.zeros((8, 4))}, contexts=4, shard=lambda path, leaf: leaf.names
    )
    assert _specs(plain.params) == {"['w']": P()}  # no annotation: names is None, replicated


def test_without_mesh_or_with_shard_replicate_the_annotations_are_not_followed():
    auto_mesh = _auto_mesh()
    with jax.set_mesh(auto_mesh):
        model = DotReluDot(32, rngs=nnx.Rngs(0))
    assert _split(mg.Trainer(_mse, optax.sgd(0.1), model).params) == 0
    replicated = mg.Trainer(_mse, optax.sgd(0.1), model, mesh={"data": 2, "model": 4}, shard="replicate")
    assert _split(replicated.params) == 0


def test_linen_boxed_parameters_and_a_variables_own_rules_are_read_too():
    meta = pytest.importorskip("flax.core.meta")
    params = {"w": meta.Partitioned(jnp.ones((8, 16)), names=(None, "model")), "b": jnp.zeros(16)}
    table = mg.fits(params, optax.sgd(0.1), mesh={"data": 2, "model": 4})
    assert table.rows()[0].params == (8 * 4 + 16) * 4  # the kernel's quarter, the bias whole
    own = nnx.Param(
        jnp.ones((8, 16)),
        sharding_names=("embed", "hidden"),
        sharding_rules=(("hidden", "model"), ("embed", None)),
        eager_sharding=False,
    )
    table = mg.fits({"w": own}, optax.sgd(0.1), mesh={"data": 2, "model": 4})
    assert table.rows()[0].params == 8 * 4 * 4


# -- the miniGPT tutorial's model (JAX AI stack), annotations as the tutorial writes them -----------


def _minigpt(mesh, maxlen, vocab_size, embed_dim, num_heads, feed_forward_dim, blocks):
    from jax.sharding import NamedSharding

    def part(init, spec):
        return nnx.with_partitioning(init, NamedSharding(mesh, spec))

    xavier, zeros, ones = (
        nnx.initializers.xavier_uniform(),
        nnx.initializers.zeros_init(),
        nnx.initializers.ones_init(),
    )

    class TransformerBlock(nnx.Module):
        def __init__(self, embed_dim, num_heads, ff_dim, *, rngs, rate=0.1):
            self.mha = nnx.MultiHeadAttention(
                num_heads=num_heads,
                in_features=embed_dim,
                kernel_init=part(xavier, P(None, "model")),
                bias_init=part(zeros, P("model")),
                rngs=rngs,
            )
            self.dropout1 = nnx.Dropout(rate=rate)
            self.layer_norm1 = nnx.LayerNorm(
                epsilon=1e-6,
                num_features=embed_dim,
                scale_init=part(ones, P("model")),
                bias_init=part(zeros, P("model")),
                rngs=rngs,
            )
            self.linear1 = nnx.Linear(
                in_features=embed_dim,
                out_features=ff_dim,
                kernel_init=part(xavier, P(None, "model")),
                bias_init=part(zeros, P("model")),
                rngs=rngs,
            )
            self.linear2 = nnx.Linear(
                in_features=ff_dim,
                out_features=embed_dim,
                kernel_init=part(xavier, P(None, "model")),
                bias_init=part(zeros, P("model")),
                rngs=rngs,
            )
            self.dropout2 = nnx.Dropout(rate=rate)
            self.layer_norm2 = nnx.LayerNorm(
                epsilon=1e-6,
                num_features=embed_dim,
                scale_init=part(ones, P(None, "model")),
                bias_init=part(zeros, P(None, "model")),
                rngs=rngs,
            )

        def __call__(self, inputs, training: bool = False):
            _, seq_len, _ = inputs.shape
            mask = jnp.tril(jnp.ones((seq_len, seq_len)))
            attention_output = self.mha(inputs_q=inputs, mask=mask, decode=False)
            attention_output = self.dropout1(attention_output, deterministic=not training)
            out1 = self.layer_norm1(inputs + attention_output)
            ffn_output = nnx.relu(self.linear1(out1))
            ffn_output = self.dropout2(self.linear2(ffn_output), deterministic=not training)
            return self.layer_norm2(out1 + ffn_output)

    class TokenAndPositionEmbedding(nnx.Module):
        def __init__(self, maxlen, vocab_size, embed_dim, *, rngs):
            self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
            self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

        def __call__(self, x):
            positions = jnp.arange(0, x.shape[1])[None, :]
            return self.token_emb(x) + self.pos_emb(positions)

    class MiniGPT(nnx.Module):
        def __init__(self, rngs):
            self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
            self.transformer_blocks = nnx.List(  # a list of modules is nnx.List in Flax 0.12
                [TransformerBlock(embed_dim, num_heads, feed_forward_dim, rngs=rngs) for _ in range(blocks)]
            )
            self.output_layer = nnx.Linear(
                in_features=embed_dim,
                out_features=vocab_size,
                kernel_init=part(xavier, P(None, "model")),
                bias_init=part(zeros, P(None, "model")),
                rngs=rngs,
            )

        def __call__(self, inputs, training: bool = False):
            x = self.embedding_layer(inputs)
            for transformer_block in self.transformer_blocks:
                x = transformer_block(x, training=training)
            return self.output_layer(x)

    return MiniGPT


def _gpt_loss(model, batch):
    logits = model(batch[0])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch[1]).mean()
    return loss, logits


def _tutorial_mesh():
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh

    return Mesh(mesh_utils.create_device_mesh((4, 2)), ("batch", "model"))


CONFIG = {"maxlen": 8, "vocab_size": 32, "embed_dim": 16, "num_heads": 2, "feed_forward_dim": 16}


def test_the_minigpt_tutorials_34_annotated_leaves_are_split_as_annotated():
    MiniGPT = _minigpt(_tutorial_mesh(), **CONFIG, blocks=2)
    with nnx.use_eager_sharding(False):  # its 1-D leaves annotated with two names cannot be placed eagerly
        model = nnx.eval_shape(lambda: MiniGPT(nnx.Rngs(0)))
    assert len([leaf for leaf in annotations(model) if leaf.names is not None]) == 34
    with pytest.warns(mg.AnnotationWarning, match=r"5 annotation\(s\) name more axes than their leaf has"):
        layouts = plan(model, None, {"batch": 4, "model": 2}, 8, "Trainer")
    split = {lay.path: lay.partition for lay in jax.tree_util.tree_leaves(layouts.leaves) if any(lay.spec)}
    assert len(split) == 29  # the 34 less the five 1-D leaves annotated (None, 'model')
    assert split["transformer_blocks/0/mha/query/kernel/value"] == P(None, "model", None)
    assert split["transformer_blocks/1/linear1/bias/value"] == P("model")
    assert "output_layer/bias/value" not in split


@pytest.mark.slow  # two compiles of a transformer (its nnx.jit loop and the trainer's step)
def test_the_minigpt_tutorials_model_trains_split_equal_to_its_own_loop():
    MiniGPT = _minigpt(_tutorial_mesh(), **CONFIG, blocks=1)
    with nnx.use_eager_sharding(False):
        ref, model = MiniGPT(nnx.Rngs(0)), MiniGPT(nnx.Rngs(0))
    optimizer = nnx.Optimizer(ref, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        (loss, _), grads = nnx.value_and_grad(_gpt_loss, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        return loss

    prep_target_batch = jax.vmap(lambda tokens: jnp.concatenate((tokens[1:], jnp.array([0]))))
    tokens = np.random.default_rng(0).integers(0, 32, size=(16, 8)).astype(np.int32)
    targets = np.asarray(prep_target_batch(jnp.asarray(tokens)))
    want = [float(train_step(ref, optimizer, (tokens[i : i + 8], targets[i : i + 8]))) for i in (0, 8)]

    with pytest.warns(mg.AnnotationWarning, match=r"3 annotation\(s\)"):
        tr = mg.Trainer(_gpt_loss, optax.adam(1e-3), model, has_aux=True, mesh={"batch": 4, "model": 2})
    specs = _specs(tr.params)
    assert _split(tr.params) == 15 and specs[".transformer_blocks[0].mha.query.kernel.value"] == P(
        None, "model", None
    )
    got = tr.fit((tokens, targets), steps=2, batch_size=8, shuffle=False, progress=False).loss
    np.testing.assert_allclose(got, want, **TOL)


# -- the trainer's mesh is the one in force ---------------------------------------------------------


def test_a_loss_that_constrains_its_activations_trains_under_the_trainers_mesh():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (16, 32)) * 0.2, "w2": jax.random.normal(k2, (32, 4)) * 0.2}
    x, y = _guide_data(rows=32, depth=16)
    y = y[:, :4]

    def loss(p, batch):
        h = jnp.tanh(batch[0] @ p["w1"])
        h = jax.lax.with_sharding_constraint(h, P("data", "model"))  # names the mesh's axes
        return jnp.mean((h @ p["w2"] - batch[1]) ** 2)

    rules = {"w1": (None, "model"), "w2": ("model", None)}
    tr = mg.Trainer(loss, optax.adam(1e-2), params, mesh={"data": 2, "model": 4}, shard=rules)
    got = tr.fit((x, y), steps=4, batch_size=8, shuffle=False, progress=False).loss

    opt = optax.adam(1e-2)
    with jax.set_mesh(_auto_mesh()):

        @jax.jit
        def step(p, s, batch):
            value, grads = jax.value_and_grad(loss)(p, batch)
            updates, s = opt.update(grads, s, p)
            return optax.apply_updates(p, updates), s, value

        p, s, want = params, opt.init(params), []
        for i in range(0, 32, 8):
            p, s, value = step(p, s, (x[i : i + 8], y[i : i + 8]))
            want.append(float(value))
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(np.asarray(tr.params["w1"]), np.asarray(p["w1"]), **TOL)
    out = tr.step_fn(tr.params, tr.opt_state, (x[:8], y[:8]))  # a loop of one's own: the mesh too
    assert np.isfinite(float(out.loss))


# -- what a rule may give ------------------------------------------------------------------------------

PARAMS = {"w1": jnp.zeros((16, 32)), "b1": jnp.zeros(32)}
MAY_GIVE = r"a rule gives an array axis \(int\) to split over every context, None to replicate, or with mesh="


def _loss(p, b):
    return jnp.mean(b @ p["w1"] + p["b1"])


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        (
            {"shard": {"w1": (None, 0)}},
            TypeError,
            r"the layout \(None, 0\) of 'w1': entry 0 for array axis 1 is not a mesh axis name \(axes: "
            r"\['mgkit'\]\); to split array axis 1 over every context give 1 alone \(given by shard rule "
            rf"'w1'\); {MAY_GIVE}",
        ),
        (
            {"shard": {"w1": ("model", "model")}, "mesh": {"data": 2, "model": 4}},
            ValueError,
            r"the layout \('model', 'model'\) of 'w1' names mesh axis 'model' twice; a mesh axis splits at "
            rf"most one array axis.*\(given by shard rule 'w1'\); {MAY_GIVE}",
        ),
        (
            {
                "shard": lambda path, leaf: (("data", "data"),) + (None,) * (leaf.ndim - 1),
                "mesh": {"data": 2, "model": 4},
            },
            ValueError,
            r"of 'b1' names mesh axis 'data' twice.*given by shard function .*<lambda>",
        ),
        (
            {"shard": lambda path: 0},
            TypeError,
            r"the shard function .*<lambda>\(path\) cannot be called as fn\(path, leaf\); a rule function "
            rf"takes the leaf's path \('dense/kernel'\) and the leaf.*{MAY_GIVE}",
        ),
        (
            {"shard": {"w1": 1.5}},
            TypeError,
            rf"the layout of 'w1' is 1.5 \(given by shard rule 'w1'\); {MAY_GIVE}",
        ),
        (
            {"shard": (("embed", None), ("mlp", "model"))},
            ValueError,
            r"gives logical axis rules, but no leaf of params carries a sharding annotation",
        ),
    ],
)
def test_a_rule_that_gives_what_no_rule_may_give_is_named(kw, error, message):
    with pytest.raises(error, match=re.compile(message, re.S)):
        mg.Trainer(_loss, optax.sgd(0.1), PARAMS, **kw)


def test_a_type_error_inside_a_rule_function_is_the_users_own():
    def rule(path, leaf):
        return leaf.shape + 1  # a bug in the rule itself

    with pytest.raises(TypeError, match=r'can only concatenate tuple \(not "int"\) to tuple'):
        mg.Trainer(_loss, optax.sgd(0.1), PARAMS, shard=rule)


def test_a_malformed_logical_rule_is_named():
    with pytest.raises(
        TypeError, match=r"shard rule \('hidden', 3\) is not a logical axis rule; each is a pair"
    ):
        mg.Trainer(_mse, optax.sgd(0.1), _logical(), mesh={"data": 2, "model": 4}, shard=(("hidden", 3),))
