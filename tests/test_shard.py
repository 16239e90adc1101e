"""``mg.Trainer(..., shard=, mesh=)``: parameters and optimizer state split over the contexts (fsdp,
rules, tensor parallel), models created split, checkpoints of split state, and bad input."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import run_python

import mgkit as mg
from mgkit.train import _memory

ROWS, BATCH = 240, 60


def init(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (784, 100)) * 0.05,
        "b1": jnp.zeros(100),
        "w2": jax.random.normal(k2, (100, 16)) * 0.1,
        "b2": jnp.zeros(16),
    }


def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - b["y"]) ** 2)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 784)).astype(np.float32)
    teacher = rng.normal(size=(784, 16)).astype(np.float32) / 28
    return {"x": x, "y": np.tanh(x @ teacher).astype(np.float32)}


DATA = _data()
PARAMS = init(jax.random.key(0))
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _fit(steps=30, **kw):
    tr = mg.Trainer(loss_fn, optax.adam(1e-3), PARAMS, **kw)
    tr.fit(DATA, steps=steps, batch_size=BATCH, progress=False)
    return tr


def _values(tree):
    """The leaves as numpy arrays without any padding (shapes of PARAMS)."""
    return {k: np.asarray(v)[tuple(slice(0, s) for s in PARAMS[k].shape)] for k, v in tree.items()}


@pytest.fixture(scope="module")
def reference():
    mg.use_contexts(";".join(f"dev{i}->cpu{i}" for i in range(8)), verbose=False)
    return _values(_fit(contexts=1).params)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_fsdp_equals_the_replicated_run_on_one_device(reference, n):
    tr = _fit(contexts=n, shard="fsdp")
    got = _values(tr.params)
    for k in reference:
        np.testing.assert_allclose(got[k], reference[k], **TOL, err_msg=k)
    assert tr.params["b1"].sharding.spec == jax.sharding.PartitionSpec(None)  # small leaves replicated
    if n > 1:
        assert len({str(s.index) for s in tr._params["w1"].addressable_shards}) == n  # split, n parts
    if n == 3:  # neither 784 nor 100 divides by 3: stored padded (262 rows each), the math unchanged
        assert tr.params["w1"].shape == (784, 100) and tr.opt_state[0].mu["w1"].shape == (784, 100)
        w2_share = 34 * 16 * 4  # 100 rows padded to 102
        assert tr.memory().rows()[0].params == 262 * 100 * 4 + w2_share + (100 + 16) * 4


def test_tensor_parallel_mesh_equals_the_replicated_run(reference):
    rules = {"w1": (None, "model"), "w2": ("model", None)}
    tr = _fit(contexts=8, shard=rules, mesh={"data": 2, "model": 4})
    got = _values(tr.params)
    for k in reference:
        np.testing.assert_allclose(got[k], reference[k], **TOL, err_msg=k)
    assert tr.params["w1"].sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert tr.params["w1"].addressable_shards[0].data.shape == (784, 25)
    mu = tr.opt_state[0].mu["w1"]  # adam's moments split like their parameter
    assert mu.sharding.spec == jax.sharding.PartitionSpec(None, "model")


def test_a_padded_leaf_reads_to_the_host_and_the_others_as_stored():
    tr = _fit(steps=2, contexts=3, shard="fsdp")  # w1 (784 x 100) and w2 (100 x 16) stored padded
    p, s = tr.params, tr.opt_state
    assert isinstance(p["w1"], np.ndarray) and p["w1"].shape == (784, 100)
    np.testing.assert_array_equal(p["w1"], np.asarray(tr._params["w1"])[:784])
    assert p["b1"] is tr._params["b1"]  # not padded: the stored array itself, no copy
    mu = s[0].mu
    assert (
        isinstance(mu["w2"], np.ndarray) and mu["w2"].shape == (100, 16) and mu["b2"] is tr._opt[0].mu["b2"]
    )


def test_step_fn_takes_the_state_as_read_or_as_stored():
    tr = mg.Trainer(loss_fn, optax.adam(1e-3), PARAMS, contexts=3, shard="fsdp")
    read = (tr.params, tr.opt_state)  # w1 and w2 (padded) as numpy, the others as stored
    given = {
        "as read": lambda: read,
        "jax arrays": lambda: jax.tree_util.tree_map(jnp.asarray, read),  # padded on the devices
        "numpy": lambda: jax.tree_util.tree_map(np.asarray, read),  # every leaf, the count too
        "as stored": lambda: jax.tree_util.tree_map(jnp.copy, (tr._params, tr._opt)),
    }
    batch = {k: v[:BATCH] for k, v in DATA.items()}
    ran = {}
    for how, state in given.items():  # the trainer's own arrays among them are not donated
        p, s = state()
        for _ in range(3):
            out = tr.step_fn(p, s, batch)
            p, s = out.params, out.opt_state
        assert p["w1"].shape == (786, 100), how  # as stored: given back as it is
        assert (
            p["w1"].sharding == tr._params["w1"].sharding and s[0].count.sharding == tr._opt[0].count.sharding
        )
        ran[how] = _values(p)
    p, s = read
    with pytest.raises(
        ValueError,
        match=r"Trainer.step_fn: the state's leaf 'w1' \(or its optimizer state\) has "
        r"shape \(784, 99\); expected \(784, 100\) as Trainer.params reads it, or \(786, 100\)",
    ):
        tr.step_fn({**p, "w1": p["w1"][:, :99]}, s, batch)
    tr.fit(lambda step: batch, steps=3, progress=False)  # the trainer's own three steps
    for how, got in ran.items():
        for k in PARAMS:
            np.testing.assert_array_equal(got[k], _values(tr.params)[k], err_msg=f"{how}: {k}")


_READ_SPLIT = """
import gc, tempfile, threading
import mgkit as mg

LEAF = (1001, 601)  # neither axis divides by 8: stored padded to 1008 rows
SHARE = -(-LEAF[0] // 8) * LEAF[1] * 4  # a context's share of one leaf, padding included
LIMIT = int(3 * 3 * SHARE / 0.7)  # 3 such leaves and adam's mu and nu: 70 % of the limit
mg.simulate(8, memory=LIMIT)
import jax, jax.numpy as jnp, numpy as np, optax


def held():
    buffers = {}  # (device, address): bytes; a shard's view (shard.data) is not another buffer
    for x in jax.live_arrays():
        try:
            for s in x.addressable_shards:
                buffers[s.device, s.data.unsafe_buffer_pointer()] = s.data.nbytes
        except RuntimeError:  # deleted meanwhile
            continue
    out = dict.fromkeys(jax.devices(), 0)
    for (d, _), n in buffers.items():
        out[d] += n
    return out


peak = dict.fromkeys(jax.devices(), 0)


def note():
    for d, n in held().items():
        peak[d] = max(peak[d], n)


def loss(p, b):
    return sum(jnp.mean((b @ p[k]) ** 2) for k in ("w1", "w2", "w3")) + jnp.sum(p["b"])


def make():
    key = jax.random.key(0)
    ws = {k: jax.random.normal(jax.random.fold_in(key, i), LEAF) for i, k in enumerate(("w1", "w2", "w3"))}
    return {**ws, "b": jnp.zeros(LEAF[1])}


tr = mg.Trainer(loss, optax.adam(1e-3), make, shard="fsdp", checkpoint=tempfile.mkdtemp(), every=10**6)
gc.collect()
base = held()
assert max(base.values()) <= 0.71 * LIMIT, base
stop = threading.Event()


def sample():
    while not stop.wait(0.0005):
        note()


sampler = threading.Thread(target=sample)
sampler.start()
reads = {
    "tr.params": lambda: tr.params,
    "tr.opt_state": lambda: tr.opt_state,
    "mg.show_sharding(tr.params)": lambda: str(mg.show_sharding(tr.params, widget=False)),
    "mg.show_sharding(tr)": lambda: str(mg.show_sharding(tr, widget=False)),
    "tr.memory()": lambda: tr.memory(),
    "tr.save()": lambda: tr.save(),
}
kept = []
try:
    for name, read in reads.items():
        kept.append(read())
        note()
        most = max(peak.values())
        assert most <= LIMIT, f"{name}: {most} bytes live on a context, over its limit of {LIMIT}"
finally:
    stop.set()
    sampler.join()
assert kept[0]["w1"].shape == LEAF and "padded dim 0: 1001 in 8 blocks of 126" in kept[3]
del kept
gc.collect()
assert held() == base, "reading left arrays alive"
print("peak", max(peak.values()), "of", LIMIT)
"""


def test_reading_a_split_state_never_gathers_it():
    """The state at 70 % of each context's limit when split, leaves that do not divide by the 8
    contexts: reading it every way keeps each context's live bytes under its limit (sampled
    after each read and by a thread during them), and leaves nothing alive after."""
    out = run_python(_READ_SPLIT, timeout=300)
    assert out.returncode == 0 and "peak" in out.stdout, out.stderr[-3000:]


def test_rules_first_match_wins_and_unmatched_follow_fsdp():
    tr = mg.Trainer(loss_fn, optax.adam(1e-3), PARAMS, contexts=4, shard={"w": None, "w1": 1})
    specs = {k: v.sharding.spec for k, v in tr.params.items()}
    assert specs["w1"] == jax.sharding.PartitionSpec() and specs["w2"] == jax.sharding.PartitionSpec()
    tr = mg.Trainer(loss_fn, optax.adam(1e-3), PARAMS, contexts=4, shard={"w2": None})
    assert tr.params["w1"].sharding.spec == jax.sharding.PartitionSpec("mgkit", None)  # fsdp
    tr = mg.Trainer(
        loss_fn, optax.adam(1e-3), PARAMS, contexts=4, shard=lambda path, leaf: np.int64(leaf.ndim - 1)
    )
    assert tr.params["b1"].sharding.spec == jax.sharding.PartitionSpec("mgkit")
    assert tr.opt_state[0].count.sharding.spec == jax.sharding.PartitionSpec()  # scalars replicated


@pytest.mark.parametrize("n", [3, 8])
def test_memory_per_context_is_its_share(n):
    tr = _fit(steps=1, contexts=n, shard="fsdp")
    whole = sum(x.nbytes for x in PARAMS.values())
    total = 3 * whole + 4  # adam: parameters, mu and nu, and a count
    rows = 0
    for lay in jax.tree_util.tree_leaves(tr._plan.leaves):  # one padding row per split leaf, x 3 copies
        if any(lay.spec):
            ax = next(i for i, names in enumerate(lay.spec) if names)
            rows += 3 * math.prod(lay.shape) // lay.shape[ax] * 4
    for row in tr.memory().rows():  # read from the live shards
        assert row.params + row.opt_state <= total / n * 1.05 + rows, (row, total / n)


def test_fits_plans_what_the_trainer_then_holds():
    planned = mg.fits(
        lambda: init(jax.random.key(0)), optax.adam(1e-3), shard="fsdp", contexts=3, batch=DATA["x"][:BATCH]
    )
    shapes = jax.eval_shape(lambda: PARAMS)
    from_shapes = mg.fits(shapes, optax.adam(1e-3), shard="fsdp", contexts=3, limit="16 GB")
    tr = _fit(steps=1, contexts=3, shard="fsdp")
    live = tr.memory()
    for p, s, row in zip(planned.rows(), from_shapes.rows(), live.rows(), strict=True):
        assert (p.params, p.opt_state) == (s.params, s.opt_state) == (row.params, row.opt_state)
        assert p.batch == (BATCH // 3) * 784 * 4 and s.limit == 16 * 10**9
    assert from_shapes.fits is True and planned.fits is None  # CPU devices report no limit
    assert "parameters" in repr(planned) and "<table" in planned._repr_html_()
    many = mg.fits(shapes, optax.adam(1e-3), shard="fsdp", contexts=64, limit="1MiB")
    assert len(many) == 64 and many.fits is True
    small = mg.fits(shapes, optax.adam(1e-3), contexts=2, limit="100KiB")
    assert small.fits is False and small.largest[0].path == "w1" and "NO" in repr(small)


def test_a_state_over_the_device_limit_raises_before_the_first_step(monkeypatch):
    monkeypatch.setattr(_memory, "device_limit", lambda device: 500_000)
    with pytest.raises(ValueError, match=r"does not fit.*w1.*shard='fsdp'"):
        mg.Trainer(loss_fn, optax.adam(1e-3), PARAMS, contexts=2)
    tr = mg.Trainer(loss_fn, optax.adam(1e-3), PARAMS, contexts=8, shard="fsdp")  # its share fits
    assert tr.memory().rows()[0].limit == 500_000 and tr.memory().fits


def test_params_made_by_a_function_are_created_split():
    make = lambda: {"w": jax.random.normal(jax.random.key(1), (4096, 512)), "b": jnp.zeros(512)}  # noqa: E731
    tr = mg.Trainer(lambda p, b: jnp.mean(b @ p["w"] + p["b"]), optax.sgd(0.1), make, shard="fsdp")
    w = tr.params["w"]
    assert {s.data.shape for s in w.addressable_shards} == {(512, 512)}
    np.testing.assert_array_equal(np.asarray(w), np.asarray(jax.jit(make)()["w"]))
    split = tr._layout.creator(make).lower().compile().memory_analysis()
    whole = jax.jit(make).lower().compile().memory_analysis()
    assert split.output_size_in_bytes <= 512 * 512 * 4 * 1.01  # the share of w, and b
    peak = split.output_size_in_bytes + split.temp_size_in_bytes
    assert peak <= (whole.output_size_in_bytes + whole.temp_size_in_bytes) / 8 * 1.05  # an 8th of it


def test_a_replicated_trainer_takes_a_function_too():
    make = lambda: init(jax.random.key(0))  # noqa: E731
    tr = mg.Trainer(loss_fn, optax.sgd(0.1), make, contexts=2)
    np.testing.assert_array_equal(np.asarray(tr.params["w1"]), np.asarray(jax.jit(make)()["w1"]))


# -- checkpoints -------------------------------------------------------------------------------


def test_split_state_resumes_bit_identical_and_onto_other_layouts(tmp_path, reference):
    kw = {"contexts": 8, "shard": "fsdp"}
    first = mg.Trainer(loss_fn, optax.adam(1e-3), PARAMS, checkpoint=tmp_path, every=10, **kw)
    first.fit(DATA, steps=10, batch_size=BATCH, progress=False)
    resumed = mg.Trainer(loss_fn, optax.adam(1e-3), PARAMS, checkpoint=tmp_path, every=10, **kw)
    resumed.fit(DATA, steps=30, batch_size=BATCH, resume=True, progress=False)
    straight = _fit(**kw)
    for k in PARAMS:
        np.testing.assert_array_equal(np.asarray(resumed.params[k]), np.asarray(straight.params[k]))
    saved = _values(jax.device_get(resumed.params))  # the folder's newest: step 30
    for other in ({"contexts": 3, "shard": "fsdp"}, {"contexts": 4, "shard": "fsdp"}, {"contexts": 1}):
        tr = mg.Trainer(loss_fn, optax.adam(1e-3), PARAMS, checkpoint=tmp_path, every=10, **other)
        tr.fit(DATA, steps=30, batch_size=BATCH, resume=True, progress=False)  # restores, runs none
        assert tr.step == 30
        back = _values(tr.params)
        for k in PARAMS:
            np.testing.assert_array_equal(back[k], saved[k], err_msg=f"{other} {k}")


def test_padded_state_is_saved_in_its_own_shape_and_restored_into_any_padding(tmp_path):
    import orbax.checkpoint as ocp

    kw = {"contexts": 3, "shard": "fsdp", "checkpoint": tmp_path, "every": 5}
    tr = mg.Trainer(loss_fn, optax.adam(1e-3), PARAMS, **kw)
    tr.fit(DATA, steps=5, batch_size=BATCH, progress=False)
    assert tr._params["w1"].shape == (786, 100)  # stored padded
    tr.checkpoints.wait()
    saved = ocp.StandardCheckpointHandler().metadata(tmp_path / "5" / "params").tree
    assert {k: tuple(v.shape) for k, v in saved.items()} == {k: v.shape for k, v in PARAMS.items()}
    wide = mg.Trainer(loss_fn, optax.adam(1e-3), PARAMS, **(kw | {"contexts": 5}))
    wide.fit(DATA, steps=5, batch_size=BATCH, resume=True, progress=False)
    for k in PARAMS:
        np.testing.assert_array_equal(_values(wide.params)[k], _values(tr.params)[k])
        np.testing.assert_array_equal(
            _values(wide.opt_state[0].nu)[k], _values(tr.opt_state[0].nu)[k], err_msg=k
        )


# -- bad input ---------------------------------------------------------------------------------

BAD = [
    (
        {"shard": "fdsp"},
        ValueError,
        r"shard='fdsp' is not known; use one of \['replicate', 'fsdp', 'annotations'\]",
    ),
    (
        {"shard": 3},
        TypeError,
        r"shard must be 'replicate', 'fsdp', a dict of rules, logical axis rules or a function; got int",
    ),
    ({"shard": {"kernel": 1}}, ValueError, r"rule 'kernel' matches no parameter \(paths: b1, b2, w1, w2\)"),
    ({"shard": {"(w": 1}}, ValueError, r"rule '\(w' is not a regular expression"),
    ({"shard": {"w1": 2}}, ValueError, r"axis 2 for 'w1' is out of range: the leaf has shape \(784, 100\)"),
    ({"shard": {"b1": -2}}, ValueError, r"axis -2 for 'b1' is out of range.*from -1 to 0"),
    (
        {"shard": lambda p, leaf: "rows"},
        ValueError,
        r"the layout \('rows',\) of 'b1' names mesh axis 'rows', which the mesh does not have",
    ),
    (
        {"shard": lambda p, leaf: 1.5},
        TypeError,
        r"the layout of 'b1' is 1.5 \(given by shard function .*<lambda>\); a rule gives an array axis",
    ),
    (
        {"mesh": {"data": 3, "model": 2}},
        ValueError,
        r"arranges 6 contexts, but there are 8; the sizes must multiply to 8",
    ),
    ({"mesh": [2, 4]}, TypeError, r"mesh must be a dict of axis names and sizes"),
    ({"mesh": {"data": 0, "model": 8}}, ValueError, r"mesh entry 'data': 0; each axis is a name and a size"),
    (
        {"mesh": {"data": 2, "model": 4}, "shard": {"w1": (None, "tensor")}},
        ValueError,
        r"names mesh axis 'tensor', which the mesh does not have \(axes: \['data', 'model'\]\)",
    ),
    (
        {"mesh": {"data": 2, "model": 4}, "shard": {"b1": (None, "model")}},
        ValueError,
        r"the layout \(None, 'model'\) of 'b1' names 2 axes, but the leaf has shape \(100,\)",
    ),
]


@pytest.mark.parametrize(("kw", "error", "message"), BAD)
def test_bad_sharding_is_refused_by_name(kw, error, message):
    with pytest.raises(error, match=message):
        mg.Trainer(loss_fn, optax.adam(1e-3), PARAMS, **kw)


def test_bad_params_functions_are_refused():
    with pytest.raises(
        TypeError, match=r"params is a function init\(key\) that takes arguments.*lambda: init"
    ):
        mg.Trainer(loss_fn, optax.sgd(0.1), init)
    with pytest.raises(
        ValueError, match=r"what <lambda>\(\) returns has no arrays \(its leaves \['w'\] \(str"
    ):
        mg.Trainer(loss_fn, optax.sgd(0.1), lambda: {"w": "weights"})
    with pytest.raises(TypeError, match=r"whose result is not a pytree of arrays"):
        mg.Trainer(loss_fn, optax.sgd(0.1), lambda: {"w": np.ones(3, dtype=object)})
    with pytest.raises(TypeError, match=r"what <lambda>\(\) returns leaf \['w'\] has dtype int32"):
        mg.Trainer(loss_fn, optax.sgd(0.1), lambda: {"w": jnp.zeros(3, jnp.int32)})


def test_sharding_over_contexts_that_share_a_device_is_refused():
    mg.use_contexts("a->cpu0;b->cpu0;c->cpu1", verbose=False)
    with pytest.raises(ValueError, match=r"contexts a, b share a device; sharding needs distinct devices"):
        mg.Trainer(loss_fn, optax.sgd(0.1), PARAMS, shard="fsdp")
    with pytest.raises(ValueError, match=r"share a device"):
        mg.fits(PARAMS, optax.sgd(0.1), shard="fsdp")
    with pytest.raises(ValueError, match=r"shard=\{'b': None\} splits parameters.*share a device"):
        mg.Trainer(loss_fn, optax.sgd(0.1), PARAMS, shard={"b": None})  # asked for, though none splits
    mg.Trainer(loss_fn, optax.sgd(0.1), PARAMS)  # replicated: the gather-update-copy loop, as before


@pytest.mark.parametrize(
    ("limit", "error", "message"),
    [
        (
            "eighty gigs",
            ValueError,
            r"limit='eighty gigs' is not a size; limit must be a size in bytes above 0",
        ),
        ("1iB", ValueError, r"limit='1iB' is not a size"),
        (-5, ValueError, r"limit=-5 is out of range"),
        ([80], TypeError, r"limit must be a size in bytes above 0.*got list \[80\]"),
    ],
)
def test_fits_refuses_a_limit_it_cannot_read(limit, error, message):
    with pytest.raises(error, match=re.compile(message)):
        mg.fits(PARAMS, optax.adam(1e-3), limit=limit)
