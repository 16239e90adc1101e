"""Split arrays to and from the host shard by shard (``mgkit._spmd.to_host``, ``from_host``)."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from mgkit._spmd import from_host, from_process_zero, to_host


@pytest.mark.parametrize("spec", [P("a"), P(None, "b"), P("a", "b"), P(), P(("a", "b"))])
@pytest.mark.parametrize("shape", [(1001, 13), (1008, 16), (1, 1), (0, 16)])
def test_leading_block_of_any_layout(spec, shape):
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    ref = np.arange(1008 * 16, dtype=np.float32).reshape(1008, 16)
    x = jax.device_put(ref, NamedSharding(mesh, spec))
    got = to_host(x, shape)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    np.testing.assert_array_equal(got, ref[: shape[0], : shape[1]])


def test_whole_array_and_scalar():
    np.testing.assert_array_equal(to_host(jax.numpy.arange(5)), np.arange(5))
    assert to_host(jax.numpy.float32(3.0)) == 3.0


def test_a_shape_past_the_array_is_refused():
    with pytest.raises(ValueError, match=r"shape \(7,\) is not a leading block of the array's \(5,\)"):
        to_host(jax.numpy.arange(5), (7,))


@pytest.mark.parametrize("spec", [P("a"), P(None, "b"), P(("a", "b")), P()])
@pytest.mark.parametrize("shape", [(1001, 13), (1008, 16), (1, 1)])
def test_from_host_pads_and_splits_and_to_host_reads_it_back(spec, shape):
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    ref = np.arange(shape[0] * shape[1], dtype=np.float64).reshape(shape)
    x = from_host(ref, (1008, 16), NamedSharding(mesh, spec))
    assert x.shape == (1008, 16) and x.dtype == np.float32 and x.sharding.spec == spec
    np.testing.assert_array_equal(to_host(x, shape), ref)
    assert not np.asarray(x)[shape[0] :].any() and not np.asarray(x)[:, shape[1] :].any()  # zeros
    whole = 1008 * 16 * 4
    assert all(
        s.data.nbytes == whole // len({str(t.index) for t in x.addressable_shards})
        for s in x.addressable_shards
    )


def test_from_host_refuses_an_array_larger_than_the_shape():
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(ValueError, match=r"from_host: the array's \(5,\) is not a leading block of \(4,\)"):
        from_host(np.zeros(5), (4,), one)


def test_every_process_gets_process_zeros_list():
    import mgkit as mg

    def work(rank, shared, private):
        import jax

        from mgkit._spmd import from_process_zero

        # each rank's own view differs, in length too; all get process 0's (past 32 bits too)
        mine = [rank, 2**40 + rank, 7][: 3 - rank]
        return jax.process_count(), from_process_zero(mine), from_process_zero(mine[:rank])

    got = mg.launch(work, nprocs=2, distributed=True, stream=False).values
    assert got == [(2, [0, 2**40, 7], [])] * 2  # process 0's, even an empty list
    assert from_process_zero([5, 2**40]) == [5, 2**40]  # one process: the list as it is


def test_process_zeros_list_must_be_whole_numbers():
    with pytest.raises(ValueError, match="invalid literal"):
        from_process_zero(["step 3"])
