"""mg.pmap against jax.pmap: cases from JAX's own pmap tests, on the 8 simulated devices."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mgkit as mg

N = 8
PERM = [(i, (i + 1) % N) for i in range(N)]


def _jax_pmap(fn, *args, **kwargs):
    """jax.pmap's answer, fetched at once (one CPU collective program in flight at a time)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jax.pmap's own deprecation notices, where it has them
        out = jax.pmap(fn, **kwargs)(*args)
    return jax.tree_util.tree_map(np.asarray, out)


def _scan_axis_index(x):
    # The carry starts as a plain 0 and adds axis_index: shard_map's varying-axes check rejects
    # it (carry types differ); jax.pmap runs it.
    def body(c, _):
        return c + lax.axis_index("i"), None

    c, _ = lax.scan(body, 0, None, length=3)
    return x + c


def _tree_fn(d):
    return {"a": d["x"] * 2, "b": (lax.psum(d["y"][0], "i"), d["y"][1] - 1)}


X = np.arange(N * 4, dtype=np.float32).reshape(N, 4)
TREE = {"x": X, "y": [np.arange(N, dtype=np.float32), np.ones((N, 2), np.int32)]}

CASES = {
    # name: (fn, args, pmap keyword arguments)
    "psum": (lambda x: x - lax.psum(x, "i"), (X,), {}),
    "pmean": (lambda x: lax.pmean(x, "i"), (X,), {}),
    "pmax and pmin": (lambda x: (lax.pmax(x, "i"), lax.pmin(x, "i")), (X,), {}),
    "axis_index": (lambda x: x + lax.axis_index("i"), (X,), {}),
    "all_gather": (lambda x: lax.all_gather(x, "i"), (X,), {}),
    "ppermute": (lambda x: lax.ppermute(x, "i", perm=PERM), (X,), {}),
    "another axis name": (lambda x: lax.psum(x, "batch") * x, (X,), {"axis_name": "batch"}),
    "scan carry from 0 adds axis_index": (_scan_axis_index, (X,), {}),
    "nested pytrees": (_tree_fn, (TREE,), {}),
    "in_axes None": (lambda w, x: w * x + lax.psum(w, "i"), (np.float32(3), X), {"in_axes": (None, 0)}),
    "in_axes 1": (lambda x: x * lax.axis_index("i"), (X.T.copy(),), {"in_axes": 1}),
    "out_axes None": (lambda x: lax.psum(x, "i"), (X,), {"out_axes": None}),
    "out_axes 1": (lambda x: jnp.stack([x, x + 1]), (X,), {"out_axes": 1}),
    "out_axes per output": (lambda x: (lax.psum(x, "i"), x * 2), (X,), {"out_axes": (None, 0)}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pmap_gives_jax_pmaps_answer(name):
    fn, args, kwargs = CASES[name]
    kwargs = dict(kwargs)
    axis_name = kwargs.pop("axis_name", "i")
    want = _jax_pmap(fn, *args, axis_name=axis_name, **kwargs)
    got = jax.tree_util.tree_map(np.asarray, mg.pmap(fn, axis_name=axis_name, **kwargs)(*args))
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_grad_of_pmap_equals_jax_pmap():
    def loss(pm, w):
        return pm(lambda w, x: jnp.sum(jnp.tanh(x * w) - lax.pmean(x, "i")), in_axes=(None, 0))(w, X).sum()

    w = jnp.float32(0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = float(jax.grad(lambda w: loss(lambda f, **k: jax.pmap(f, axis_name="i", **k), w))(w))
    got = float(jax.grad(lambda w: loss(mg.pmap, w))(w))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_vmap_and_jit_of_pmap_equal_jax_pmap():
    x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    fn = lambda v: lax.psum(v, "i") + lax.axis_index("i")  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = np.asarray(jax.vmap(jax.pmap(fn, axis_name="i"), in_axes=1)(x))
    got = jax.vmap(mg.pmap(fn), in_axes=1)(x)
    np.testing.assert_allclose(np.asarray(got), want)
    np.testing.assert_allclose(np.asarray(jax.jit(jax.vmap(mg.pmap(fn), in_axes=1))(x)), want)
    np.testing.assert_allclose(np.asarray(jax.jit(mg.pmap(fn))(x)), want.T)
    # vmap over the leading axis: each call still takes one slice per context
    batched = np.ones((3, N), np.float32)
    np.testing.assert_allclose(np.asarray(jax.vmap(mg.pmap(lambda v: v * 2))(batched)), 2.0)


@pytest.mark.parametrize(
    ("fn", "axis_name", "used"),
    [
        (lambda v: lax.psum(v, "i"), "j", "i"),  # the axis name given is not the one fn uses
        (lambda v: lax.psum(v, "k"), "i", "k"),  # fn names an axis nothing binds
        (lambda v: v + lax.axis_index("k"), "i", "k"),
        (lambda v: lax.all_gather(v, "k"), "i", "k"),
    ],
)
def test_an_axis_name_fn_does_not_use_is_named_in_the_error(fn, axis_name, used):
    with pytest.raises(ValueError) as info:
        mg.pmap(fn, axis_name=axis_name)(X)
    # a NameError as well, as jax.pmap's is: code that catches JAX's error catches it
    assert isinstance(info.value, NameError) and info.value.name == used
    with pytest.raises(NameError):
        _jax_pmap(fn, X, axis_name=axis_name)
    assert str(info.value) == (
        f"pmap: axis_name={axis_name!r} was given, but <lambda> uses a collective over the axis {used!r}, "
        f"which is not bound; pass axis_name={used!r} to mg.pmap, or name {axis_name!r} in <lambda>'s "
        f"collectives (e.g. jax.lax.psum(x, {axis_name!r}))"
    )
    # after the error the same function still works with the right name
    assert np.asarray(mg.pmap(fn, axis_name=used)(X)).shape[0] == N
