"""split / concat, parallel / make_parallel on both paths, gradients, pmap, run_each, balance."""

import warnings

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mgkit as mg
from mgkit import _spmd
from mgkit._spmd import _placing

N = 8  # contexts dev0..dev7 (conftest)
SIZES = [0, 1, N - 1, N, N + 1, 5 * N - 1, 5 * N + 1]
DTYPES = [np.float32, jnp.bfloat16, np.int32, np.uint8, np.bool_]
SHARED = "a->cpu0;b->cpu0;c->cpu1"  # two contexts on one device: the per-context path


def _batch(n, dtype=np.float32, cols=3):
    x = np.arange(n * cols).reshape(n, cols) % 7
    return x.astype(dtype)


def _row_fn(x, y):
    return {"s": jnp.tanh(x @ jnp.ones((3, 2))) + y[:, None], "d": x * 2}


# -- split / concat ------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_split_sizes_differ_by_at_most_one_and_round_trip(n):
    x = _batch(n)
    parts = mg.split(x)
    sizes = [p.shape[0] for p in parts.values()]
    assert list(parts) == [f"dev{i}" for i in range(N)]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    for name, part in parts.items():
        assert mg.where(part) == name
    np.testing.assert_array_equal(np.asarray(mg.concat(parts)), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_concat_round_trip_pytrees_and_dtypes(dtype):
    tree = {"x": _batch(11, dtype), "y": [np.arange(11).astype(dtype)]}
    back = mg.concat(mg.split(tree, contexts=["dev2", "dev5", "dev6"]), to="cpu")
    assert isinstance(back["x"], np.ndarray)
    assert back["x"].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(back["x"], tree["x"])
    np.testing.assert_array_equal(back["y"][0], tree["y"][0])


def test_split_along_another_axis_and_concat_back():
    x = np.arange(2 * 7 * 3).reshape(2, 7, 3).astype(np.float32)
    parts = mg.split(x, contexts=3, axis=1)
    assert [p.shape for p in parts.values()] == [(2, 3, 3), (2, 2, 3), (2, 2, 3)]
    np.testing.assert_array_equal(np.asarray(mg.concat(parts, axis=1)), x)
    np.testing.assert_array_equal(np.asarray(mg.concat(mg.split(x, contexts=2, axis=-1), axis=-1)), x)


def test_weights_use_largest_remainder_and_the_ledger_reports_sizes():
    assert _spmd.shares(10, 3, (1.0, 1.0, 1.0)) == (4, 3, 3)
    assert _spmd.shares(7, 3, (2.0, 2.0, 3.0)) == (2, 2, 3)
    assert _spmd.shares(5, 2, (0.0, 1.0)) == (0, 5)
    parts = mg.split(np.arange(100), contexts=["dev0", "dev1", "dev2"], weights=[3, 1, 1])
    assert [len(p) for p in parts.values()] == [60, 20, 20]
    rows = {e.dst: e.info["rows"] for e in mg.ledger().records("split")}
    assert rows == {"dev0": 60, "dev1": 20, "dev2": 20}
    parts = mg.split(np.arange(5), contexts=["dev0", "dev1"], weights={"dev1": 1, "dev0": 0})
    assert [len(p) for p in parts.values()] == [0, 5]


def test_split_from_a_device_array_records_moves_from_that_context():
    x = mg.put(np.arange(8.0), "dev3")
    mg.ledger().clear()
    parts = mg.split(x, contexts=["dev3", "dev4"])
    events = mg.ledger().records("split")
    assert [(e.src, e.dst, e.nbytes) for e in events] == [("dev3", "dev4", 16)]
    assert mg.where(parts["dev3"]) == "dev3"


def test_concat_target_and_ledger():
    parts = mg.split(np.ones((4, 2), np.float32), contexts=["dev0", "dev1"])
    mg.ledger().clear()
    out = mg.concat(parts, to="dev1")
    assert mg.where(out) == "dev1"
    (event,) = mg.ledger().records("concat")
    assert (event.src, event.dst, event.nbytes) == ("dev0", "dev1", 16)
    out = mg.concat(list(parts.values()))  # a list: gathers onto the first part's context
    assert mg.where(out) == "dev0"


# -- make_parallel / parallel: results ------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_make_parallel_equals_fn_for_every_batch_size_spmd(n):
    x, y = _batch(n), np.arange(n, dtype=np.float32)
    got = mg.make_parallel(_row_fn, x=x, y=y)
    want = _row_fn(x, y)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6)


@pytest.mark.parametrize("n", SIZES)
def test_make_parallel_equals_fn_for_every_batch_size_per_context(n):
    mg.use_contexts(SHARED, verbose=False)
    x, y = _batch(n), np.arange(n, dtype=np.float32)
    got = mg.make_parallel(_row_fn, x=x, y=y)
    want = _row_fn(x, y)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6)


def test_make_parallel_recipe_vector_add():
    a = np.random.default_rng(0).uniform(size=(1000, 100)).astype(np.float32)
    b = np.random.default_rng(1).uniform(size=(1000, 100)).astype(np.float32)
    c = mg.make_parallel(lambda a, b: a + b, contexts=2, a=a, b=b)
    np.testing.assert_array_equal(np.asarray(c), a + b)


def test_spmd_path_compiles_once_and_leaves_the_result_sharded():
    f = mg.parallel(lambda x: x * 2)
    for _ in range(3):
        out = f(np.ones((16, 4), np.float32))
    assert mg.where(out) == "+".join(f"dev{i}" for i in range(N))
    programs = [v for k, v in _spmd.programs.items() if k[0] == "spmd" and k[1] is f.fn]
    assert len(programs) == 1 and programs[0]._cache_size() == 1
    runs = mg.ledger().records("run")
    assert {e.info["path"] for e in runs} == {"spmd"} and len(runs) == 3 * N


def test_inputs_with_the_right_sharding_are_not_moved_again():
    mesh = _spmd.mesh(tuple(mg.context_map().devices().values()))
    x = jax.device_put(np.ones((16, 3), np.float32), NamedSharding(mesh, P(_spmd.AXIS)))
    mg.ledger().clear()
    out = mg.make_parallel(lambda x: x + 1, x=x)
    assert mg.ledger().records("split") == []
    np.testing.assert_array_equal(np.asarray(out), 2.0)


@pytest.mark.parametrize("axis", ["rows", "x"])
def test_inputs_sharded_on_a_make_mesh_mesh_are_taken_without_a_copy(axis):
    # jax.make_mesh gives Explicit axis types: its axis name must not leak into mgkit's program
    mesh = jax.make_mesh((N,), (axis,), devices=tuple(mg.context_map().devices().values()))
    x = jax.device_put(np.arange(16 * 3, dtype=np.float32).reshape(16, 3), NamedSharding(mesh, P(axis)))
    mg.ledger().clear()
    out = mg.make_parallel(lambda x: x + 1, x=x)
    assert mg.ledger().records("split") == []
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) + 1)
    rows = np.arange(16) % 2
    m = mg.logreg.fit(x, rows, l2=0.1)
    moved = mg.ledger().records("split")  # the labels, from the host (row weights of one are made
    # on the devices); X stays
    assert m.w.shape == (3,) and {e.src for e in moved} == {"host"} and sum(e.nbytes for e in moved) == 16 * 4


@pytest.mark.parametrize("contexts", ["solo->cpu3", "a->cpu1;b->cpu2"])
def test_large_host_inputs_for_cpu_devices_go_through_a_private_copy(contexts, monkeypatch):
    mg.use_contexts(contexts, verbose=False)
    staged = []
    copy = _placing.private
    monkeypatch.setattr(_placing, "private", lambda vs: staged.extend(v.nbytes for v in vs) or copy(vs))
    x = np.arange(4352 * 1024 * 2, dtype=np.float32).reshape(-1, 1024)  # 34 MiB: parts of 17 or 34
    out = mg.make_parallel(lambda v: v + 1, v=x)
    np.testing.assert_array_equal(np.asarray(out), x + 1)
    assert staged == [x.nbytes]
    moved = mg.ledger().records("split")
    assert sum(e.nbytes for e in moved) == x.nbytes and {e.src for e in moved} == {"host"}
    staged.clear()
    mg.make_parallel(lambda v: v + 1, v=x[:64])  # small parts too: never the caller's memory
    assert staged == [x[:64].nbytes]


def test_a_host_split_is_timed_by_its_copy_not_by_the_program_it_feeds():
    def slow(x):  # some 40 ms of work per call on a 2-core host, plus its compile on the first
        m = jnp.eye(128, dtype=x.dtype) * 0.5
        return x + jax.lax.fori_loop(0, 40, lambda i, a: a @ m + x.sum(), jnp.ones((128, 128), x.dtype)).sum()

    mg.make_parallel(slow, x=np.ones((16, 4), np.float32))
    mg.ledger().flush()
    run = mg.ledger().records("run")[0]
    splits = mg.ledger().records("split")
    assert len(splits) == N and sum(e.nbytes for e in splits) == 16 * 4 * 4
    assert max(e.seconds for e in splits) < run.seconds / 4


def test_a_call_laid_out_like_one_before_does_and_records_the_same(monkeypatch):
    # the second call runs the plan the first one left (_parallel._calls.Plan): same results, events
    def f(w, x):
        return x * w

    g = mg.parallel(f, in_axes=(None, 0))
    w, x = np.float32(2), np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    wv = np.full((3,), 2, np.float32)
    first = g(wv, x)
    before = [e._replace(start=0, seconds=0) for e in mg.ledger().records()]
    mg.ledger().clear()
    copies = []
    real = _placing.private
    monkeypatch.setattr(_placing, "private", lambda vs: copies.extend(v.nbytes for v in vs) or real(vs))
    x2 = x + 1
    second = g(wv, x2)
    assert copies == [wv.nbytes, x2.nbytes]  # never the caller's memory on this path either
    after = [e._replace(start=0, seconds=0) for e in mg.ledger().records()]
    assert after == before and {e.kind for e in after} == {"split", "replicate", "run"}
    assert sum(e.nbytes for e in after if e.kind == "split") == x.nbytes
    np.testing.assert_array_equal(np.asarray(first), x * w)
    np.testing.assert_array_equal(np.asarray(second), x2 * w)  # new values, not a cached result
    assert mg.where(second) == "+".join(f"dev{i}" for i in range(N))
    mg.use_contexts("p->cpu5;q->cpu6", verbose=False)  # another map: its own plan
    third = g(wv, x)
    assert mg.where(third) == "p+q"
    assert {e.dst for e in mg.ledger().records("split")} >= {"p", "q"}


def test_uneven_spmd_batch_is_gathered_on_the_first_context():
    out = mg.make_parallel(lambda x: x + 1, x=np.zeros(13, np.float32))
    assert mg.where(out) == "dev0" and out.shape == (13,)
    (gather,) = mg.ledger().records("gather")
    assert gather.dst == "dev0"


def test_per_context_path_records_each_context_and_gathers():
    mg.use_contexts(SHARED, verbose=False)
    out = mg.make_parallel(lambda x: x + 1, x=np.zeros((9, 2), np.float32))
    assert mg.where(out) == "a"
    runs = mg.ledger().records("run")
    assert [(e.dst, e.info["rows"], e.info["path"]) for e in runs] == [
        ("a", 3, "dispatch"),
        ("b", 3, "dispatch"),
        ("c", 3, "dispatch"),
    ]
    gathers = mg.ledger().records("gather")
    assert [(e.src, e.dst) for e in gathers] == [("c", "a")]  # b's part is already on cpu0


def test_shared_parameters_are_replicated_and_recorded():
    w = mg.put(np.ones((3, 2), np.float32), "dev0")
    mg.ledger().clear()
    f = mg.parallel(lambda w, x: x @ w, in_axes=(None, 0))
    out = f(w, np.ones((16, 3), np.float32))
    np.testing.assert_array_equal(np.asarray(out), 3.0)
    reps = mg.ledger().records("replicate")
    assert sorted(e.dst for e in reps) == [f"dev{i}" for i in range(1, N)]
    assert all(e.src == "dev0" and e.nbytes == 24 for e in reps)


def test_weighted_parallel_runs_per_context_with_the_weighted_sizes():
    f = mg.parallel(lambda x: x * 3, contexts=["dev0", "dev1"], weights=[3, 1])
    out = f(np.arange(8.0, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(out), np.arange(8.0) * 3)
    assert [e.info["rows"] for e in mg.ledger().records("run")] == [6, 2]


def test_out_axes_none_and_to_host():
    f = mg.parallel(lambda w, x: (w * 1, x.sum(1)), in_axes=(None, 0), out_axes=(None, 0), to="cpu")
    w, s = f(np.float32(2.0), np.ones((5, 3), np.float32))
    assert float(w) == 2.0 and isinstance(s, np.ndarray)
    np.testing.assert_array_equal(s, 3.0)


def test_keyword_and_decorator_forms():
    @mg.parallel(in_axes=(None, 0))
    def affine(w, x, *, b):
        return x * w + b

    out = affine(np.float32(2), np.arange(10, dtype=np.float32), b=np.ones(10, np.float32))
    np.testing.assert_array_equal(np.asarray(out), np.arange(10) * 2 + 1)
    assert affine.__name__ == "affine" and "affine" in repr(affine)


def test_parallel_inside_jit_on_the_spmd_path():
    f = jax.jit(lambda x: mg.make_parallel(lambda a: a * 2, a=x))
    np.testing.assert_array_equal(np.asarray(f(np.ones(9, np.float32))), 2.0)
    mg.use_contexts(SHARED, verbose=False)
    with pytest.raises(TypeError, match=r"one program per context.*cannot be traced inside jax.jit"):
        f(np.ones(10, np.float32))


def test_parallel_under_vmap_on_the_spmd_path():
    f = mg.parallel(lambda w, x: x * w, in_axes=(None, 0))
    x = np.arange(3 * 16 * 2, dtype=np.float32).reshape(3, 16, 2)
    got = jax.vmap(f, in_axes=(None, 0))(np.float32(2), x)
    np.testing.assert_array_equal(np.asarray(got), x * 2)


def test_an_error_inside_fn_names_the_context():
    mg.use_contexts(SHARED, verbose=False)

    def bad(x):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:
        mg.make_parallel(bad, x=np.ones(3))
    assert any("context 'a'" in note for note in info.value.__notes__)


# -- gradients -----------------------------------------------------------------------------


def _poly(w, x, y):
    f = jnp.stack([x**2, x, jnp.ones_like(x)], 1)
    return (f @ w - y) ** 2


@pytest.mark.parametrize("contexts", [None, ["dev0", "dev1", "dev2"], "shared", "weighted"])
def test_grad_through_parallel_equals_single_device(contexts):
    x = np.random.default_rng(0).uniform(-10, 10, 101).astype(np.float32)
    y = 5 * x**2 + 3
    w = jnp.array([1.0, 2.0, 3.0])
    kwargs = {"in_axes": (None, 0, 0)}
    if contexts == "shared":
        mg.use_contexts(SHARED, verbose=False)
    elif contexts == "weighted":
        kwargs.update(contexts=["dev0", "dev1"], weights=[1, 3])
    else:
        kwargs.update(contexts=contexts)
    f = mg.parallel(_poly, **kwargs)
    want = jax.grad(lambda w: _poly(w, x, y).mean())(w)
    got = jax.grad(lambda w: f(w, x, y).mean())(w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
    grad_x = jax.grad(lambda x: f(w, x, y).sum())(jnp.asarray(x))
    np.testing.assert_allclose(grad_x, jax.grad(lambda x: _poly(w, x, y).sum())(jnp.asarray(x)), rtol=1e-5)


def test_each_part_backward_pass_runs_on_its_own_device():
    # Per-context path: what the backward pass needs stays on each part's device, so JAX runs
    # each part's backward there (TensorFlow's colocate_gradients_with_ops).
    mg.use_contexts(SHARED, verbose=False)
    x = jnp.arange(6.0)
    _, vjp = jax.vjp(lambda x: mg.make_parallel(lambda x: jnp.sin(x), x=x), x)
    residuals = [leaf for leaf in jax.tree_util.tree_leaves(vjp) if isinstance(leaf, jax.Array)]
    assert {d for r in residuals for d in r.devices()} == {mg.device_of("a"), mg.device_of("c")}
    np.testing.assert_allclose(vjp(jnp.ones(6))[0], np.cos(np.arange(6.0)), rtol=1e-6)
    # SPMD path: the backward pass is itself one shard_map over the contexts' devices.
    mg.use_contexts(";".join(f"dev{i}->cpu{i}" for i in range(N)), verbose=False)
    jaxpr = jax.make_jaxpr(jax.grad(lambda x: mg.make_parallel(lambda x: jnp.sin(x), x=x).sum()))(
        jnp.arange(16.0)
    )
    assert str(jaxpr).count("shard_map") >= 2  # forward and transpose


def test_make_parallel_recipe_polynomial_fit_reaches_5_0_3():
    f = mg.parallel(_poly, in_axes=(None, 0, 0))
    opt = optax.adam(0.1)
    w = jnp.zeros(3)
    state = opt.init(w)

    @jax.jit
    def step(w, state, x, y):
        loss, g = jax.value_and_grad(lambda w: f(w, x, y).mean())(w)
        updates, state = opt.update(g, state, w)
        return optax.apply_updates(w, updates), state, loss

    rng = np.random.default_rng(0)
    for _ in range(3000):
        x = rng.uniform(-10.0, 10.0, size=100).astype(np.float32)
        w, state, loss = step(w, state, x, 5 * x**2 + 3)
        float(loss)  # wait for each step: overlapping CPU collective programs can deadlock
    np.testing.assert_allclose(np.asarray(w), [5.0, 0.0, 3.0], atol=1e-2)


# -- pmap ----------------------------------------------------------------------------------


def test_pmap_collectives_without_deprecation_warnings():
    v = np.arange(N, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        total = mg.pmap(lambda v: jax.lax.psum(v, "i"), out_axes=None)(v)
        mean = mg.pmap(lambda v: jax.lax.pmean(v, "i"))(v)
        gathered = mg.pmap(lambda v: jax.lax.all_gather(v, "i"))(v)
        idx = mg.pmap(lambda v: v * 0 + jax.lax.axis_index("j"), axis_name="j")(v)
    assert float(total) == v.sum()
    np.testing.assert_allclose(np.asarray(mean), np.full(N, v.mean()))
    assert gathered.shape == (N, N)
    np.testing.assert_array_equal(np.asarray(idx), np.arange(N))
    assert mg.where(mean) == "+".join(f"dev{i}" for i in range(N))


def test_pmap_shared_arguments_and_subsets_of_contexts():
    f = mg.pmap(lambda w, v: w * v, in_axes=(None, 0), contexts=["dev1", "dev2"])
    out = f(np.float32(3), np.ones((2, 4), np.float32))
    np.testing.assert_array_equal(np.asarray(out), 3.0)
    assert mg.where(out) == "dev1+dev2"
    g = jax.grad(lambda w: f(w, np.ones((2, 4), np.float32)).sum())(jnp.float32(1.0))
    assert float(g) == 8.0


# -- run_each ------------------------------------------------------------------------------


def test_run_each_context_maps_two_dots_dispatches_before_waiting(monkeypatch):
    rng = np.random.default_rng(0)
    a0, b0 = (mg.put(rng.random((64, 64), dtype=np.float32), "dev0") for _ in range(2))
    a1, b1 = (mg.put(rng.random((64, 64), dtype=np.float32), "dev1") for _ in range(2))
    order = []
    real_block = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: (order.append("wait"), real_block(x))[1])

    def dot(a, b):
        order.append(f"run {mg.current()}")
        return jnp.dot(a, b)

    out = mg.run_each({"dev0": (dot, (a0, b0)), "dev1": (dot, (a1, b1))})
    assert order == ["run dev0", "run dev1", "wait", "wait"]
    assert mg.where(out["dev0"]) == "dev0" and mg.where(out["dev1"]) == "dev1"
    np.testing.assert_allclose(np.asarray(out["dev1"]), np.asarray(a1) @ np.asarray(b1), rtol=1e-5)
    assert [e.dst for e in mg.ledger().records("run")] == ["dev0", "dev1"]


def test_run_each_moves_arguments_and_accepts_kwargs_and_bare_callables():
    out = mg.run_each(
        {
            "dev2": (jnp.add, (np.ones(2), np.ones(2))),
            "dev3": (jnp.sum, (np.ones(3),), {"axis": 0}),
            "dev4": lambda: jnp.zeros(1),
        }
    )
    assert mg.where(out["dev2"]) == "dev2" and float(out["dev3"]) == 3.0 and mg.where(out["dev4"]) == "dev4"
    assert {e.dst for e in mg.ledger().records("transfer")} == {"dev2", "dev3"}


# -- balance -------------------------------------------------------------------------------


def test_balance_measured_times_each_context_once_and_splits_by_speed():
    w = np.linspace(0, 0.1, 16 * 16, dtype=np.float32).reshape(16, 16)
    f = mg.parallel(lambda x: jnp.tanh(x @ w).sum(1), contexts=["dev0", "dev1"], balance="measured")
    x = np.ones((64, 16), np.float32)
    speeds = f.speeds(x)
    assert set(speeds) == {"dev0", "dev1"} and all(s > 0 for s in speeds.values())
    assert f.speeds(x) is speeds  # cached per input shape
    mg.ledger().clear()
    out = f(x)
    np.testing.assert_allclose(np.asarray(out), np.tanh(x @ w).sum(1), rtol=1e-5)
    want = _spmd.shares(64, 2, (speeds["dev0"], speeds["dev1"]))
    got = tuple(e.info["rows"] for e in mg.ledger().records("split"))
    assert got == tuple(s for s in want if s)
    assert f.speeds(np.ones((32, 16), np.float32)) is not speeds  # another shape: measured again


# -- bad input -----------------------------------------------------------------------------

BAD = [
    # (call, exception, message pattern)
    (
        lambda: mg.make_parallel(lambda a, b: a + b, a=np.ones((9, 3)), b=np.ones(8)),
        ValueError,
        r"argument 'b' has 8 rows along axis 0 \(shape \(8,\)\) but argument 'a' has 9 .*8 context",
    ),
    (
        lambda: mg.make_parallel(lambda a: a, a=np.float32(3)),
        ValueError,
        r"make_parallel: argument 'a' is a scalar \(shape \(\)\).*8 context.*make_parallel splits every "
        r"keyword argument along axis 0, so close over a value .*in_axes=\(0, None\)",
    ),
    (
        lambda: mg.parallel(lambda a: a)(np.float32(3)),
        ValueError,
        r"parallel: argument 'a' is a scalar \(shape \(\)\).*in_axes=None",
    ),
    (
        lambda: mg.make_parallel(lambda a: a, a=None),
        ValueError,
        r"make_parallel: a=None holds no array to split",
    ),
    (
        lambda: mg.make_parallel(lambda a, b: a, a=None, b=()),
        ValueError,
        r"make_parallel: a=None, b=\(\) hold no array .*pass arrays, e.g. mg.make_parallel\(f, x=",
    ),
    (lambda: mg.make_parallel("f", a=np.ones(3)), TypeError, r"make_parallel: fn must be callable, got str"),
    (
        lambda: mg.split(np.ones(4), axis=None),
        TypeError,
        r"split: axis=None; give the int axis to cut every leaf along, e.g. axis=0",
    ),
    (lambda: mg.split(np.ones(4), axis=True), TypeError, r"split: axis=True; give the int axis"),
    (lambda: mg.split({"x": None}), ValueError, r"split: the tree holds no array to split"),
    (lambda: mg.parallel(lambda a: a)(None), ValueError, r"parallel: the arguments hold no array to split"),
    (
        lambda: mg.make_parallel(lambda a: a, a=["x", "y"]),
        TypeError,
        r"parallel: argument 'a', leaf \[0\] is a str \('x'\)",
    ),
    (lambda: mg.make_parallel(lambda a: a, a=np.ones(3, dtype=object)), TypeError, r"dtype object"),
    (
        lambda: mg.split(np.ones(4), contexts=["dev0", "gpu9x"]),
        mg.ContextError,
        r"split: unknown context 'gpu9x'.*dev0, dev1",
    ),
    (lambda: mg.split(np.ones(4), contexts=[]), ValueError, r"split: the context list is empty"),
    (
        lambda: mg.split(np.ones(4), contexts=["dev1", "dev1"]),
        ValueError,
        r"context 'dev1' is listed more than once",
    ),
    (lambda: mg.split(np.ones(4), contexts=9), ValueError, r"contexts=9, but the map has 8"),
    (lambda: mg.split(np.ones(4), contexts=3.5), TypeError, r"contexts must be a list of context names"),
    (
        lambda: mg.split(np.ones(4), contexts=2, weights=[1, 2, 3]),
        ValueError,
        r"weights has 3 entries .* 2 context\(s\): dev0, dev1",
    ),
    (
        lambda: mg.split(np.ones(4), contexts=2, weights=[1, -1]),
        ValueError,
        r"weights\['dev1'\]=-1 is out of range; weights\['dev1'\] must be a finite number at least 0",
    ),
    (lambda: mg.split(np.ones(4), contexts=2, weights=[0, 0]), ValueError, r"weights \[0, 0\] are all zero"),
    (
        lambda: mg.split(np.ones(4), contexts=2, weights=[1, float("nan")]),
        ValueError,
        r"weights\['dev1'\]=nan is out of range",
    ),
    (
        lambda: mg.split(np.ones(4), contexts=2, weights=[1, "2"]),
        TypeError,
        r"weights\['dev1'\] must be a finite number at least 0.*got str '2'",
    ),
    (lambda: mg.split(np.ones(4), contexts=2, weights="12"), TypeError, r"weights must be a list of 2"),
    (
        lambda: mg.split(np.ones(4), contexts=2, weights={"dev0": 1, "zz": 1}),
        ValueError,
        r"unknown: \['zz'\]",
    ),
    (
        lambda: mg.make_parallel(lambda a: a.sum(), a=np.ones((9, 3))),
        ValueError,
        r"returned a scalar \(shape \(\)\) for its output on a part of 2 rows \(8 context\(s\)\).*mg.pmap",
    ),
    (
        lambda: mg.make_parallel(lambda a: "done", a=np.ones((16, 3))),
        TypeError,
        r"^make_parallel: <lambda> returned a str \('done'\) for its output, not an array; a compiled "
        r"function returns arrays only: return arrays \(and numbers\) from <lambda>, and keep other values "
        r"outside it",
    ),
    (
        lambda: mg.parallel(lambda a: {"y": a, "tag": b"x"}, out_axes=None)(np.ones((16, 3))),
        TypeError,
        r"^parallel: <lambda> returned a bytes \(b'x'\) for output \['tag'\], not an array",
    ),
    (
        lambda: mg.make_parallel(lambda a: a[:1], a=np.ones((16, 3))),
        ValueError,
        r"returned shape \(1, 3\) for its output on a part of 2 rows",
    ),
    (
        lambda: mg.make_parallel(lambda a: a.sum(), a=np.ones((16, 3))),
        ValueError,
        r"make_parallel: <lambda> returned a scalar .*pass out_axes=None to mg.parallel \(make_parallel "
        r"concatenates every output along axis 0\)",
    ),
    (
        lambda: mg.split(np.ones((4, 2)), axis=2),
        ValueError,
        r"axis 2 is out of range for the array of shape \(4, 2\) \(2 dimension\(s\)\)",
    ),
    (
        lambda: mg.parallel(lambda w, x: x, in_axes=(None, 0, 0))(1.0, np.ones(4)),
        ValueError,
        r"in_axes=\(None, 0, 0\) has 3 entries, but <lambda> was called with 2 positional",
    ),
    (lambda: mg.parallel(lambda x: x, in_axes="0"), TypeError, r"in_axes='0'; give an int, None, or a tuple"),
    (lambda: mg.parallel(lambda x: x, in_axes=(1.5,)), TypeError, r"in_axes=\(1.5,\) contains 1.5"),
    (lambda: mg.parallel(lambda w: w, in_axes=None)(np.ones(3)), ValueError, r"every argument is shared"),
    (lambda: mg.parallel("not a function"), TypeError, r"fn must be callable, got str"),
    (
        lambda: mg.parallel(lambda x: x, balance="fast"),
        ValueError,
        r"balance='fast'; use None .* or 'measured'",
    ),
    (lambda: mg.parallel(lambda x: x, balance="measured", weights=[1, 1]), ValueError, r"not both"),
    (lambda: mg.make_parallel(lambda a: a), TypeError, r"no keyword arguments to split"),
    (lambda: mg.concat({}), ValueError, r"no parts to concatenate"),
    (
        lambda: mg.concat({"dev0": np.ones((2, 3)), "dev1": np.ones((2, 4))}),
        ValueError,
        r"part 'dev1' has shape \(2, 4\), which does not match \(2, 3\)",
    ),
    (
        lambda: mg.concat({"dev0": {"x": np.ones(2)}, "dev1": {"y": np.ones(2)}}),
        ValueError,
        r"part 'dev1' has structure",
    ),
    (
        lambda: mg.concat({"dev0": np.ones(2, np.float32), "dev1": np.ones(2, np.int32)}),
        TypeError,
        r"dtype int32, but part 'dev0' has float32",
    ),
    (
        lambda: mg.concat({"dev0": np.ones(2)}, to="nowhere"),
        mg.ContextError,
        r"concat: unknown context 'nowhere'",
    ),
    (
        lambda: mg.pmap(lambda v: v)(np.ones((3, 2))),
        ValueError,
        r"pmap: argument 'v' has 3 slices along axis 0 \(shape \(3, 2\)\), but there are 8 context",
    ),
    (
        lambda: mg.pmap(lambda v: v, contexts=["dev0"], axis_name=3),
        TypeError,
        r"axis_name must be a non-empty str",
    ),
    (lambda: mg.run_each({}), ValueError, r"run_each: no tasks"),
    (lambda: mg.run_each([(jnp.dot, ())]), TypeError, r"tasks must be a dict context -> \(fn, args\)"),
    (
        lambda: mg.run_each({"dev0": (jnp.dot, np.ones(2))}),
        TypeError,
        r"arguments for context 'dev0' must be a tuple",
    ),
    (lambda: mg.run_each({"dev0": 3}), TypeError, r"task for context 'dev0' is int 3"),
    (lambda: mg.run_each({"devX": jnp.zeros}), mg.ContextError, r"run_each: unknown context 'devX'"),
    (lambda: mg.run_each({"cpu": jnp.zeros}), mg.ContextError, r"'cpu' is host memory"),
]


@pytest.mark.parametrize(("call", "exc", "pattern"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_gets_a_clear_error(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_pmap_rejects_contexts_that_share_a_device():
    mg.use_contexts(SHARED, verbose=False)
    with pytest.raises(ValueError, match=r"a->cpu0, b->cpu0, c->cpu1 share a device or mix kinds"):
        mg.pmap(lambda v: v)(np.ones(3))


def test_a_failed_call_leaves_no_half_state():
    f = mg.parallel(lambda x: x + 1)
    with pytest.raises(ValueError):
        f(np.ones((4, 2)), np.ones(3))
    np.testing.assert_array_equal(np.asarray(f(np.ones(4))), 2.0)


# -- properties ----------------------------------------------------------------------------

_DTYPE = st.sampled_from([np.float32, np.int32, np.uint8, np.bool_])
_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(
    x=hnp.arrays(_DTYPE, hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=9)),
    k=st.integers(1, N),
    data=st.data(),
)
def test_property_split_concat_round_trip(x, k, data):
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1))
    weights = data.draw(st.none() | st.lists(st.integers(0, 5), min_size=k, max_size=k).filter(any))
    parts = mg.split(x, contexts=k, axis=axis, weights=weights)
    sizes = [p.shape[axis] for p in parts.values()]
    assert sum(sizes) == x.shape[axis]
    if weights is None:
        assert max(sizes) - min(sizes) <= 1
    np.testing.assert_array_equal(np.asarray(mg.concat(parts, axis=axis, to="cpu")), x)


@_SETTINGS
@given(
    n=st.integers(0, 3 * N + 1),
    cols=st.integers(1, 3),
    k=st.integers(1, N),
    dtype=st.sampled_from([np.float32, np.int32]),
    shared=st.booleans(),
)
def test_property_make_parallel_equals_fn(n, cols, k, dtype, shared):
    device = (lambda i: i % 2) if shared else (lambda i: i)
    mg.use_contexts(";".join(f"s{i}->cpu{device(i)}" for i in range(k)), verbose=False)
    x = (np.arange(n * cols).reshape(n, cols) % 5).astype(dtype)
    got = mg.make_parallel(_sq_plus_rowsum, contexts=k, x=x)
    want = _sq_plus_rowsum(x)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def _sq_plus_rowsum(x):
    return x * x, x.sum(axis=1)


@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.float32])
def test_a_refilled_host_buffer_is_placed_with_its_new_values(dtype):
    # jax 0.10 places a float64 (or int64) host array over several devices from a conversion
    # it keeps per array object: mgkit converts such arrays itself, so a refilled buffer
    # (a loader's) never gives its first contents again.
    buf = np.zeros(16, dtype)
    double = mg.parallel(lambda x: x * 2)
    for value in (1, 2, 3):
        buf[:] = value
        np.testing.assert_array_equal(np.asarray(double(buf)), 2 * value)
        np.testing.assert_array_equal(np.asarray(mg.make_parallel(lambda x: x + 0, x=buf)), value)
