"""mg.prefetch and mg.Prefetch: order, placement, errors at their position, closing, stats, Ctrl-C."""

import _thread
import gc
import itertools
import threading
import time
import traceback

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mgkit as mg


def _mgkit_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("mgkit-prefetch")]


def _wait_for(condition, within: float = 2.0) -> bool:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _no_thread_left(within: float = 2.0) -> bool:
    return _wait_for(lambda: not _mgkit_threads(), within)


@pytest.fixture(autouse=True)
def _no_loader_left():
    yield
    assert _no_thread_left(), f"threads left behind: {_mgkit_threads()}"


def _batches(count, rows=16, start=0):
    for i in range(start, start + count):
        x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + 1000 * i
        yield {"x": x, "y": np.full(rows, i, np.int32)}


# -- order, values, placement --------------------------------------------------------------


def test_order_and_values_preserved_and_sharded_over_the_mesh():
    devices = tuple(jax.devices()[:8])
    with mg.prefetch(_batches(5)) as it:
        out = list(it)
    assert len(out) == 5
    for want, got in zip(_batches(5), out, strict=True):
        for key in ("x", "y"):
            leaf = got[key]
            assert isinstance(leaf, jax.Array)
            assert leaf.sharding.spec == P("mgkit")
            assert tuple(leaf.sharding.mesh.devices.flat) == devices
            assert [s.data.shape[0] for s in leaf.addressable_shards] == [2] * 8
            np.testing.assert_array_equal(np.asarray(leaf), want[key])
    assert it.stats()["batches"] == 5


def test_works_with_a_list_and_a_pytree_of_jax_arrays():
    data = [(jax.numpy.ones((8, 2)) * i, [np.arange(8)]) for i in range(3)]
    with mg.prefetch(data, contexts=["dev2", "dev5"], size=1) as it:
        out = list(it)
    assert [float(x.sum()) for x, _ in out] == [0.0, 16.0, 32.0]
    x, (y,) = out[1]
    assert {d.id for d in x.devices()} == {2, 5} and {d.id for d in y.devices()} == {2, 5}
    assert x.sharding.spec == P("mgkit")


def test_infinite_iterator_and_count_contexts():
    def endless():
        i = 0
        while True:
            yield np.full((6, 2), i)
            i += 1

    with mg.prefetch(endless(), contexts=3, size=3) as it:
        got = [int(next(it)[0, 0]) for _ in range(20)]
    assert got == list(range(20))


def test_uneven_batches_come_as_split_does():
    batch = {"x": np.arange(30.0).reshape(10, 3)}
    with mg.prefetch([batch], contexts=4) as it:
        (parts,) = list(it)
    want = mg.split(batch, 4)
    assert list(parts) == ["dev0", "dev1", "dev2", "dev3"]
    for name in parts:
        np.testing.assert_array_equal(np.asarray(parts[name]["x"]), np.asarray(want[name]["x"]))
        assert mg.where(parts[name]["x"]) == name
    assert [parts[n]["x"].shape[0] for n in parts] == [3, 3, 2, 2]


def test_a_context_map_that_is_not_installed():
    other = mg.ContextMap.parse("p->cpu6;q->cpu7")
    with mg.prefetch([np.arange(6), np.arange(5)], contexts=other) as it:
        even, uneven = list(it)
    assert {d.id for d in even.devices()} == {6, 7} and even.sharding.spec == P("mgkit")
    assert list(uneven) == ["p", "q"] and uneven["q"].tolist() == [3, 4]
    assert uneven["q"].devices() == {jax.devices()[7]}


def test_contexts_on_one_device_come_as_split_does():
    mg.use_contexts("a->cpu0;b->cpu0", verbose=False)
    with mg.prefetch([np.arange(8)]) as it:
        (parts,) = list(it)
    assert list(parts) == ["a", "b"]
    assert parts["a"].tolist() == [0, 1, 2, 3] and parts["b"].tolist() == [4, 5, 6, 7]


def test_every_placement_is_in_the_ledger():
    with mg.prefetch(_batches(3, rows=8)) as it:
        for _ in it:
            pass
    mg.ledger().flush()
    events = mg.ledger().records("split")
    assert {e.dst for e in events} == {f"dev{i}" for i in range(8)}
    per_row = 3 * 4 + 4  # float32 x[3] and int32 y
    assert sum(e.nbytes for e in events) == 3 * 8 * per_row
    assert all(e.info["rows"] == 1 and e.info["of"] == 8 for e in events)
    mg.ledger().clear()
    with mg.prefetch([np.arange(10)], contexts=4) as it:
        list(it)
    mg.ledger().flush()
    assert sorted(e.info["rows"] for e in mg.ledger().records("split")) == [2, 2, 3, 3]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
@pytest.mark.parametrize("rows", [8, 8192, 10])  # small, large, uneven (split's parts)
def test_a_placed_batch_does_not_share_the_loaders_buffer(rows, dtype):
    buffer = np.zeros((rows, 2), dtype)

    def reused():
        for i in range(3):
            buffer[:] = i
            yield buffer

    with mg.prefetch(reused(), size=3) as it:
        time.sleep(0.2)  # every batch placed before any is read
        got = [np.asarray(mg.concat(b) if isinstance(b, dict) else b) for b in it]
    assert [float(b[0, 0]) for b in got] == [0.0, 1.0, 2.0]
    assert [float(b[-1, -1]) for b in got] == [0.0, 1.0, 2.0]


def test_at_most_size_batches_are_placed_ahead_of_the_callers():
    placed = []

    def place(b):
        placed.append(b)
        return b

    with mg.Prefetch(itertools.count(), place, size=3) as it:
        assert _wait_for(lambda: len(placed) == 3)
        time.sleep(0.3)  # and no more
        assert placed == [0, 1, 2]
        assert next(it) == 0
        assert _wait_for(lambda: len(placed) == 4)
        time.sleep(0.3)
        assert placed == [0, 1, 2, 3]
        assert repr(it) == "Prefetch(size=3, batches=1, running)"
    assert repr(it) == "Prefetch(size=3, batches=1, closed)"


def test_a_list_ends_the_iteration_and_the_thread():
    it = mg.Prefetch([1, 2], lambda b: b)
    assert list(it) == [1, 2]
    assert _no_thread_left()
    assert repr(it) == "Prefetch(size=2, batches=2, ended)"
    assert list(it) == []


# -- errors at their position --------------------------------------------------------------


def test_iterable_error_comes_after_the_batches_before_it():
    def failing():
        yield np.ones(8)
        yield np.ones(8) * 2
        raise OSError("disk gone")

    it = mg.prefetch(failing())
    got = [float(next(it)[0]), float(next(it)[0])]
    with pytest.raises(OSError, match="disk gone") as info:
        next(it)
    assert got == [1.0, 2.0]
    assert any("batch 2" in note and "loader thread" in note for note in info.value.__notes__)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "failing" in frames, frames  # the loader's own traceback is kept
    assert it.closed
    with pytest.raises(StopIteration):
        next(it)
    it.close()


def test_place_error_comes_at_its_position():
    def place(b):
        if b == 3:
            raise ZeroDivisionError("bad batch 3")
        return b

    with mg.Prefetch(range(10), place, size=4, where="fit") as it:
        got = []
        with pytest.raises(ZeroDivisionError, match="bad batch 3") as info:
            for b in it:
                got.append(b)
    assert got == [0, 1, 2]
    assert any("fit loader thread at batch 3" in n for n in info.value.__notes__)


def test_stop_iteration_from_place_is_not_a_silent_end():
    def place(b):
        raise StopIteration

    with mg.Prefetch([1], place) as it, pytest.raises(RuntimeError, match="raised StopIteration at batch 0"):
        next(it)


def test_rows_that_differ_raise_at_that_batch():
    def batches():
        yield {"x": np.ones((8, 2)), "y": np.ones(8)}
        yield {"x": np.ones((8, 2)), "y": np.ones(7)}

    with mg.prefetch(batches()) as it:
        next(it)
        with pytest.raises(ValueError) as info:
            next(it)
    msg = str(info.value)
    assert "leaf ['y'] of batch 1 has 7 rows" in msg
    assert "leaf ['x'] of batch 1 has 8" in msg
    assert "same number of rows along axis 0" in msg


def test_fewer_rows_than_contexts_raise_naming_the_batch():
    with mg.prefetch([np.ones(8), np.ones(3)]) as it:
        next(it)
        with pytest.raises(ValueError, match=r"batch 1 has 3 row\(s\), fewer than the 8 context") as info:
            next(it)
    assert "at least 8 rows" in str(info.value) and "contexts=3" in str(info.value)


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"x": np.ones((8, 2)), "n": 3}, r"leaf \['n'\] of batch 0 is a scalar \(3\).*leading axis"),
        ({"x": np.ones((8, 2)), "name": "abc"}, r"leaf \['name'\] of batch 0 is a str .*np.asarray"),
        ({}, r"batch 0 holds no array"),
    ],
)
def test_bad_leaves_are_named(batch, match):
    with mg.prefetch([batch]) as it, pytest.raises((TypeError, ValueError), match=match):
        next(it)


# -- bad arguments -------------------------------------------------------------------------


def test_not_an_iterable():
    with pytest.raises(TypeError, match=r"prefetch: iterable must be an iterable of batches.*got int 5"):
        mg.prefetch(5)


def test_a_dict_of_arrays_is_not_a_batch_stream():
    with pytest.raises(TypeError, match=r"iterable is a dict \(keys \['x'\]\).*gives its keys"):
        mg.prefetch({"x": np.ones(8)})


@pytest.mark.parametrize(
    ("size", "error", "match"),
    [
        (0, ValueError, r"prefetch: size=0 is out of range; size must be a whole number at least 1"),
        (-2, ValueError, r"size=-2 is out of range"),
        (1.5, TypeError, r"prefetch: size must be a whole number at least 1.*got float 1.5; e.g. size=2"),
        (True, TypeError, r"got bool True"),
    ],
)
def test_bad_size(size, error, match):
    with pytest.raises(error, match=match):
        mg.prefetch([np.ones(8)], size=size)


def test_unknown_context_lists_the_contexts():
    with pytest.raises(mg.ContextError, match=r"prefetch: unknown context 'nope'.*dev0, dev1"):
        mg.prefetch([np.ones(8)], contexts=["dev0", "nope"])
    with pytest.raises(ValueError, match=r"contexts=9, but the map has 8 context"):
        mg.prefetch([np.ones(8)], contexts=9)


def test_place_must_be_callable():
    with pytest.raises(TypeError, match=r"fit: place must be a function place\(batch\)"):
        mg.Prefetch([1], place="split", where="fit")


# -- closing -------------------------------------------------------------------------------


def test_close_with_the_loader_waiting_for_a_free_slot():
    it = mg.prefetch(_batches(10**6, rows=8), size=1)
    time.sleep(0.2)  # the loader fills its one slot, then waits for space
    assert _mgkit_threads()
    t0 = time.perf_counter()
    it.close()
    assert time.perf_counter() - t0 < 0.6
    assert not _mgkit_threads()
    it.close()  # twice: harmless
    with pytest.raises(StopIteration):
        next(it)
    assert "closed" in repr(it)


def test_close_does_not_wait_for_a_slow_next_and_the_thread_ends_after_it():
    release, closed_generator = threading.Event(), threading.Event()

    def slow():
        try:
            yield np.ones(8)
            release.wait(10)
            yield np.ones(8)
        finally:
            closed_generator.set()

    it = mg.prefetch(slow())
    next(it)
    time.sleep(0.1)  # the loader is inside next(), waiting for release
    t0 = time.perf_counter()
    it.close()
    assert time.perf_counter() - t0 < 0.9
    assert _mgkit_threads(), "the slow next() has not returned yet"
    release.set()
    assert _no_thread_left()
    assert closed_generator.wait(1), "the generator was closed by the loader"


def test_a_dropped_prefetch_is_closed():
    it = mg.prefetch(_batches(10**6, rows=8), size=1)
    next(it)
    assert _mgkit_threads()
    del it
    gc.collect()
    assert _no_thread_left()


def test_with_block_closes_on_error_in_the_body():
    with pytest.raises(RuntimeError, match="body"), mg.prefetch(_batches(10**6, rows=8)) as it:
        next(it)
        raise RuntimeError("body")
    assert it.closed
    assert _no_thread_left()


def test_keyboard_interrupt_while_waiting_comes_back_promptly():
    release = threading.Event()

    def slow():
        yield np.ones(8)
        release.wait(10)
        yield np.ones(8)

    it = mg.prefetch(slow())
    next(it)
    timer = threading.Timer(0.2, _thread.interrupt_main)
    t0 = time.perf_counter()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            next(it)
        waited = time.perf_counter() - t0
    finally:
        timer.join()
        release.set()
    assert waited < 1.0, waited
    assert it.closed
    it.close()
    assert _no_thread_left()
    with pytest.raises(StopIteration):
        next(it)


# -- stats ---------------------------------------------------------------------------------


def test_stats_of_a_slow_loader():
    def slow():
        for i in range(4):
            time.sleep(0.05)
            yield np.full(8, i)

    with mg.prefetch(slow()) as it:
        for _ in it:
            pass
        stats = it.stats()
    assert set(stats) == {"batches", "wait_data", "wait_space", "load", "size"}
    assert stats["batches"] == 4 and stats["size"] == 2
    assert stats["wait_data"] > 0.1
    assert stats["load"] >= 0.19
    assert stats["wait_space"] < 0.05
    assert all(isinstance(v, float) for k, v in stats.items() if k not in ("batches", "size"))


def test_stats_of_a_slow_consumer():
    with mg.prefetch(_batches(5, rows=8), size=1) as it:
        time.sleep(0.1)
        for _ in it:
            time.sleep(0.05)
        stats = it.stats()
    assert stats["batches"] == 5 and stats["size"] == 1
    assert stats["wait_space"] > 0.1
    assert stats["wait_data"] < stats["wait_space"]


def test_loading_overlaps_with_consuming():
    def loader():
        for i in range(10):
            time.sleep(0.05)
            yield np.full(8, i)

    t0 = time.perf_counter()
    with mg.prefetch(loader(), size=2) as it:
        for _ in it:
            time.sleep(0.05)
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.85, f"10 batches of 50 ms loading and 50 ms work took {elapsed:.2f} s (about 0.55 s)"
