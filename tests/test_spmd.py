"""The shared SPMD layer: meshes with Auto axes, padding and trimming, the program cache and
mg.clear_caches()."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import mgkit as mg
from mgkit import _spmd
from mgkit._parallel import _calls, _wrapper

N = 8


def _devices():
    return tuple(mg.context_map().devices().values())


def test_meshes_have_auto_axes():
    m = _spmd.mesh(_devices())
    assert m.axis_names == (_spmd.AXIS,) and tuple(m.axis_types) == (AxisType.Auto,)
    assert _spmd.sharding(_devices(), _spmd.AXIS, 1).spec == P(None, _spmd.AXIS)
    assert _spmd.sharding(_devices()).spec == P()


RESULTS = {
    "parallel": lambda x: mg.parallel(lambda v: v * 2)(x),
    "make_parallel": lambda x: mg.make_parallel(lambda v: v * 2, v=x),
    "pmap": lambda x: mg.pmap(lambda v: v * 2)(x),
    "make_mesh input": lambda x: mg.make_parallel(
        lambda v: v * 2,
        # jax.make_mesh's axes are Explicit on jax 0.10: its arrays are taken over as they are
        v=jax.device_put(x, NamedSharding(jax.make_mesh((N,), ("rows",), devices=_devices()), P("rows"))),
    ),
}


@pytest.mark.parametrize("how", list(RESULTS))
@pytest.mark.parametrize("gather", ["concat", "transfer"])
def test_a_sharded_result_gathered_to_one_context_runs_in_a_plain_jit(how, gather):
    x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    out = RESULTS[how](x)
    assert len(out.devices()) == N
    one = mg.concat([out[:4], out[4:]], to="dev0") if gather == "concat" else mg.transfer(out, "dev0")
    assert mg.where(one) == "dev0"
    got = jax.jit(lambda a: a @ jnp.ones((3, 2), a.dtype) + 1)(one)
    np.testing.assert_allclose(np.asarray(got), (x * 2) @ np.ones((3, 2)) + 1)
    # and with an array made on that device, as a single-device program takes them
    np.testing.assert_allclose(np.asarray(jax.jit(jnp.add)(one, jnp.ones_like(one))), x * 2 + 1)


@pytest.mark.parametrize("sizes", [(3, 3, 2), (1, 0), (2, 2), (5, 4, 4, 4)])
def test_pad_and_trim_round_trip(sizes):
    n = sum(sizes)
    x = np.arange(n * 2).reshape(n, 2)
    padded = _spmd.pad(x, sizes, 0)
    assert padded.shape == (len(sizes) * max(sizes), 2)
    for i, size in enumerate(sizes):  # each part's rows come first in its block, then repeats
        start = sum(sizes[:i])
        block = padded[i * max(sizes) : (i + 1) * max(sizes)]
        np.testing.assert_array_equal(block[:size], x[start : start + size])
    np.testing.assert_array_equal(_spmd.trim(padded, sizes, 0), x)
    np.testing.assert_array_equal(np.asarray(_spmd.trim(jnp.asarray(padded.T), sizes, 1)), x.T)


def test_clear_caches_frees_every_program_and_what_it_closes_over():
    def make():
        big = np.ones(1000, np.float32)

        def f(v):
            return v * big[: v.shape[-1]].sum()

        return f

    f = make()
    ref = weakref.ref(f)
    x = np.ones((N, 4), np.float32)
    mg.make_parallel(f, v=x).block_until_ready()  # SPMD
    mg.make_parallel(f, v=x[:5]).block_until_ready()  # SPMD, padded
    mg.parallel(f, contexts=2, weights=[1, 3])(x).block_until_ready()  # one program per context
    mg.pmap(f)(x).block_until_ready()
    assert len(_spmd.programs) >= 3 and len(_wrapper._MADE) >= 1
    del f
    gc.collect()
    assert ref() is not None  # the cached programs hold it
    mg.clear_caches()
    assert len(_spmd.programs) == 0 and len(_wrapper._MADE) == 0 and len(_calls.plans) == 0
    assert _spmd.mesh.cache_info().currsize == 0 and _spmd.sharding.cache_info().currsize == 0
    gc.collect()
    assert ref() is None
    # and everything works after: programs are built again
    np.testing.assert_allclose(np.asarray(mg.make_parallel(lambda v: v + 1, v=x)), 2.0)
    np.testing.assert_allclose(np.asarray(mg.pmap(lambda v: jax.lax.psum(v, "i"))(x)), 8.0)
    assert len(_spmd.programs) == 2


def test_clear_caches_empties_every_cache_of_the_parallel_ops_and_they_compile_again():
    traces = []

    def f(v):
        traces.append(v.shape)  # once per compilation
        return v * 2

    x = np.ones((N, 4), np.float32)
    wrapped = mg.parallel(f)

    def calls():
        wrapped(x).block_until_ready()  # SPMD; leaves a plan
        wrapped(x).block_until_ready()  # runs that plan
        mg.make_parallel(f, v=x).block_until_ready()
        mg.parallel(f, contexts=2, weights=[1, 3])(x).block_until_ready()  # one program per context
        mg.pmap(f)(x).block_until_ready()

    mg.clear_caches()
    calls()
    compiled = len(traces)
    calls()
    assert len(traces) == compiled  # every program and plan came from a cache
    assert len(_spmd.programs) and len(_calls.plans) and len(_wrapper._MADE)
    mg.clear_caches()
    caches = [c for c in gc.get_objects() if isinstance(c, _spmd.Cache)]
    assert _spmd.programs in caches and _calls.plans in caches
    assert all(len(c) == 0 for c in caches)
    calls()
    assert len(traces) == 2 * compiled  # each program compiled again


def test_a_held_wrapper_runs_its_last_plan_until_the_caches_are_cleared():
    mg.clear_caches()
    x, y = np.ones((N, 4), np.float32), np.ones((N, 3), np.float32)
    wrapped = mg.parallel(lambda v: v * 2)
    for v in (x, x, y, y, x):  # a new layout replaces the last plan; the cache keeps both
        np.testing.assert_allclose(np.asarray(wrapped(v)), 2.0)
    assert len(_calls.plans) == 2
    plan = weakref.ref(_calls.plans.items()[-1][1])
    program = weakref.ref(_spmd.programs.find(plan().program))
    mg.clear_caches()
    gc.collect()
    assert plan() is None and program() is None  # the wrapper let go of them too
    before = mg.ledger().totals()
    np.testing.assert_allclose(np.asarray(wrapped(x)), 2.0)
    _ = mg.use_contexts("a->cpu0;b->cpu1", verbose=False)  # another map: another plan
    out = wrapped(x)
    assert mg.where(out) == "a+b" and len(_calls.plans) == 2
    mg.ledger().flush()
    assert mg.ledger().totals() != before


def test_clear_caches_is_public_and_leaves_jax_caches_alone():
    assert "clear_caches" in mg.__all__ and mg.clear_caches is _spmd.clear_caches
    jitted = jax.jit(lambda a: a + 1)
    jitted(1.0)
    mg.clear_caches()
    assert jitted._cache_size() == 1  # the caller's own programs stay compiled
