"""put / transfer / colocate / synchronize, and the events they leave in the ledger."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mgkit as mg


def test_the_issue_walkthrough():
    mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    w = mg.put(np.ones((1024, 1024), np.float32), "dev0")
    with mg.on("dev1"):
        v = jnp.ones((1024, 1024))
    v0 = mg.transfer(v, "dev0")
    h = mg.transfer(v0, "cpu")
    mg.synchronize()
    assert w.devices() == {jax.devices()[0]} and v.devices() == {jax.devices()[1]}
    assert v0.devices() == {jax.devices()[0]}
    assert isinstance(h, np.ndarray) and h.shape == (1024, 1024) and h.sum() == 1024 * 1024
    rows = {(k, s, d): (c, b) for k, s, d, c, b, _ in mg.ledger().summary().rows()}
    assert rows == {
        ("put", "host", "dev0"): (1, 4 * 2**20),
        ("transfer", "dev1", "dev0"): (1, 4 * 2**20),
        ("transfer", "dev0", "host"): (1, 4 * 2**20),
    }


def test_put_places_any_pytree():
    tree = {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": [1.5, 2, True],
        "j": jnp.arange(3),
        "s": np.float32(4.0),
        "none": None,
    }
    out = mg.put(tree, "dev2")
    assert mg.where(out) == "dev2"
    assert out["none"] is None
    np.testing.assert_array_equal(out["w"], tree["w"])
    assert [float(x) for x in out["b"]] == [1.5, 2.0, 1.0]
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16, np.int32, np.uint8, np.bool_])
def test_round_trip_keeps_dtype_and_values(dtype):
    x = (np.arange(24) % 3).astype(dtype).reshape(2, 3, 4)
    back = mg.transfer(mg.transfer(mg.put(x, "dev1"), "dev5"), "cpu")
    assert back.dtype == jnp.asarray(x).dtype and back.shape == x.shape
    np.testing.assert_array_equal(back.astype(np.float64), x.astype(np.float64))


def test_empty_and_scalar_arrays():
    assert mg.transfer(mg.put(np.zeros((0, 3)), "dev1"), "cpu").shape == (0, 3)
    assert float(mg.put(3.0, "dev1")) == 3.0


def test_transfer_to_cpu_returns_numpy_for_every_leaf():
    out = mg.transfer({"a": mg.put(np.ones(2), "dev1"), "b": np.zeros(1), "c": 2.0}, "cpu")
    assert all(isinstance(v, np.ndarray) for v in out.values())


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8])
def test_large_arrays_between_cpu_devices_arrive_whole_and_private(dtype, monkeypatch):
    # from _SPLIT_COPY bytes a CPU -> CPU move goes through a private host copy (XLA's own copy
    # faults in fresh pages one by one above 32 MiB)
    from mgkit import _transfer

    copied = []
    copies = _transfer.private_copies
    monkeypatch.setattr(
        _transfer, "private_copies", lambda vs: copied.extend(v.nbytes for v in vs) or copies(vs)
    )
    x = mg.put((np.arange(_transfer._SPLIT_COPY // np.dtype(dtype).itemsize + 7) % 251).astype(dtype), "dev0")
    small = mg.put(np.arange(10, dtype=dtype), "dev0")
    mg.ledger().clear()
    copied.clear()  # the puts' host copies
    y, tiny = mg.transfer([x, small], "dev1")
    mg.synchronize()
    assert y.devices() == {jax.devices()[1]} and tiny.devices() == {jax.devices()[1]} and y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert not np.shares_memory(np.asarray(y), np.asarray(x))
    z = y + 1  # the copy is an ordinary device array
    assert z.devices() == y.devices() and np.asarray(x)[0] == 0
    (event,) = mg.ledger().records("transfer")
    assert (event.src, event.dst, event.nbytes) == ("dev0", "dev1", x.nbytes + small.nbytes)
    assert copied == [x.nbytes]  # the small one is left to XLA


def test_leaves_already_there_are_not_moved_or_recorded():
    x = mg.put(np.ones(8), "dev3")
    mg.ledger().clear()
    assert mg.transfer(x, "dev3") is x
    assert mg.transfer(np.ones(2), "cpu").shape == (2,)
    assert mg.ledger().records() == []


def test_device_names_and_devices_as_targets():
    assert mg.where(mg.put(np.ones(2), "cpu6")) == "dev6"
    assert mg.where(mg.put(np.ones(2), jax.devices()[7])) == "dev7"


def test_one_event_per_source_with_bytes_and_timing():
    a = mg.put(np.ones(10, np.float32), "dev1")
    b = mg.put(np.ones(20, np.float32), "dev2")
    mg.ledger().clear()
    mg.transfer({"a": a, "b": b, "h": np.ones(5, np.float64)}, "dev0")
    events = sorted(mg.ledger().records(), key=lambda e: e.src)
    assert [(e.kind, e.src, e.dst, e.src_device, e.dst_device, e.nbytes) for e in events] == [
        ("transfer", "dev1", "dev0", "cpu1", "cpu0", 40),
        ("transfer", "dev2", "dev0", "cpu2", "cpu0", 80),
        ("transfer", "host", "dev0", "host", "cpu0", 20),  # float64 arrives as float32 (x64 off)
    ]
    assert all(e.seconds > 0 and e.start > 1.6e9 and e.label is None for e in events)


def test_colocate_moves_several_trees_to_one_context():
    a = mg.put(np.ones(3, np.float32), "dev0")
    b = mg.put(np.full(3, 2.0, np.float32), "dev1")
    c = {"x": mg.put(np.ones(3, np.float32), "dev2")}
    mg.ledger().clear()
    a2, b2, c2 = mg.colocate(a, b, c, to="dev1")
    assert mg.where((a2, b2, c2)) == "dev1" and b2 is b
    np.testing.assert_array_equal(a2 + b2 + c2["x"], np.full(3, 4.0))
    kinds = {(e.kind, e.src, e.dst) for e in mg.ledger().records()}
    assert kinds == {("colocate", "dev0", "dev1"), ("colocate", "dev2", "dev1")}


def test_where_reports_mixed_placement():
    out = mg.where({"a": mg.put(1.0, "dev0"), "b": np.ones(1)})
    assert out == {"['a']": "dev0", "['b']": "host"}


@pytest.mark.parametrize(
    "tree, named",
    [("train.csv", "str 'train.csv'"), ({}, "dict {}"), ({"act": np.tanh}, "dict {'act': <ufunc")],
)
def test_where_of_a_tree_without_arrays_says_it_holds_none(tree, named):
    with pytest.raises(
        ValueError, match=re.escape(f"where: {named}") + ".* holds no arrays, so it lives on no context"
    ):
        mg.where(tree)
    assert mg.where({"act": np.tanh, "w": mg.put(np.ones(2), "dev3")}) == "dev3"  # static leaves left out


def test_sharded_array_source_is_named():
    mesh = jax.make_mesh((2,), ("i",), devices=jax.devices()[:2])
    x = jax.device_put(np.ones((4, 2)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("i")))
    mg.transfer(x, "dev3")
    (event,) = mg.ledger().records()
    assert event.src == "dev0+dev1" and event.src_device == "2 devices"


def test_synchronize_everything_and_one_context():
    x = mg.put(np.ones((256, 256), np.float32), "dev1")
    y = x @ x
    mg.synchronize("dev1")
    assert y.is_ready()
    mg.synchronize()
    mg.synchronize("cpu")
    assert mg.ledger().records()[0].kind == "put"


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("leaf", "message"),
    [
        ("text", r"leaf \['x'\] is a str \('text'\)"),
        (b"raw", r"leaf \['x'\] is a bytes"),
        (object(), r"leaf \['x'\] is a object"),
        (np.array(["a", object()], dtype=object), "numpy array of dtype object"),
        ([1, 2], None),
    ],
)
def test_bad_leaves_are_named(leaf, message):
    if message is None:  # a list is a pytree, not a leaf: it is fine
        assert mg.where(mg.put({"x": leaf}, "dev1")) == "dev1"
        return
    with pytest.raises(TypeError, match=message) as info:
        mg.put({"x": leaf}, "dev1")
    assert "np.asarray" in str(info.value) or "astype" in str(info.value)


def test_unknown_context_in_put_transfer_colocate():
    with pytest.raises(mg.ContextError, match="put: unknown context 'dev8'; the contexts are dev0, dev1"):
        mg.put(np.ones(2), "dev8")
    with pytest.raises(mg.ContextError, match="transfer: unknown context 'gpu'"):
        mg.transfer(np.ones(2), "gpu")
    with pytest.raises(mg.ContextError, match="colocate: unknown context 'nowhere'"):
        mg.colocate(np.ones(2), to="nowhere")
    with pytest.raises(mg.ContextError, match="'cuda0' does not exist"):
        mg.put(np.ones(2), "cuda0")


def test_put_to_host_points_to_transfer():
    with pytest.raises(mg.ContextError, match=r"mg.transfer\(tree, 'cpu'\)"):
        mg.put(np.ones(2), "cpu")


def test_target_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"transfer: a context is a name such as 'dev0'.*got int 3"):
        mg.transfer(np.ones(2), 3)  # type: ignore[arg-type]


def test_colocate_needs_a_tree():
    with pytest.raises(TypeError, match="at least one tree"):
        mg.colocate(to="dev0")


def test_failed_put_leaves_user_data_alone():
    x = np.arange(4.0)
    with pytest.raises(TypeError):
        mg.put({"x": x, "bad": "s"}, "dev1")
    np.testing.assert_array_equal(x, np.arange(4.0))
    assert mg.ledger().records() == []


def _aligned(shape, align=64):
    """A float32 host array whose buffer starts on an ``align``-byte boundary."""
    size = int(np.prod(shape)) * 4
    buf = np.empty(size + align, np.uint8)
    start = (-buf.ctypes.data) % align
    out = buf[start : start + size].view(np.float32).reshape(shape)
    out[...] = np.arange(out.size, dtype=np.float32).reshape(shape)
    return out


def test_placed_arrays_never_share_the_callers_host_memory():
    # jax.device_put hands an aligned numpy buffer to a CPU device as it is; mgkit copies it
    x = _aligned((64, 32))
    put = mg.put(x, "dev1")
    parts = mg.split(x, ["dev0", "dev1"])
    spmd = mg.make_parallel(lambda v: v, v=x)
    kept = x.copy()
    x[...] = -1.0
    np.testing.assert_array_equal(np.asarray(put), kept)
    np.testing.assert_array_equal(np.asarray(parts["dev1"]), kept[32:])
    np.testing.assert_array_equal(np.asarray(spmd), kept)
    assert mg.where(put) == "dev1"


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.bool_])
def test_host_arrays_keep_their_values_through_the_staged_copy(dtype):
    x = (np.arange(6 * 5).reshape(6, 5) % 3).astype(dtype)[:, 1:4]  # a strided view
    out = mg.put(x, "dev2")
    assert out.dtype == jax.dtypes.canonicalize_dtype(x.dtype)
    np.testing.assert_array_equal(np.asarray(out), x)


@settings(max_examples=30, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=6),
    split=st.sampled_from([1 << 30, 64]),
)
def test_private_copies_are_aligned_equal_and_not_the_callers_memory(shapes, split):
    from mgkit import _transfer

    values = [np.arange(r * c, dtype=np.float32).reshape(r, c) + i for i, (r, c) in enumerate(shapes)]
    values.append(np.full((), 7.0))  # a 0-d array too
    old = _transfer._SPLIT_COPY
    _transfer._SPLIT_COPY = split  # 64: the helper thread copies too, and large arrays go in halves
    try:
        copies = _transfer.private_copies(values)
    finally:
        _transfer._SPLIT_COPY = old
    for value, copy in zip(values, copies, strict=True):
        assert copy.shape == value.shape and copy.dtype == value.dtype
        assert copy.ctypes.data % _transfer._ALIGN == 0 or not copy.size
        np.testing.assert_array_equal(copy, value)
        assert not np.shares_memory(copy, value)
    for value in values:
        value[...] = -1  # the caller changes its arrays: the copies keep the old values
    assert all((copy != -1).all() for copy in copies if copy.size)
