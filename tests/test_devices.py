"""The device table and simulated devices."""

import gc

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import mgkit as mg
from mgkit._table import human_bytes
from tests.conftest import run_python


def test_devices_lists_every_cpu_device_with_short_names():
    table = mg.devices()
    assert table.names == [f"cpu{i}" for i in range(8)]
    row = table["cpu3"]
    assert row.platform == "cpu" and row.process_index == 0 and row.device == jax.devices("cpu")[3]
    # memory_stats() is None on CPU: memory is the bytes of the live arrays there, with no limit
    assert row.memory_source == "live arrays" and row.memory_in_use >= 0 and row.memory_limit is None
    assert table[0].name == "cpu0" and len(table) == 8 and [r.name for r in table] == table.names


def test_devices_text_and_html():
    table = mg.devices()
    text = repr(table)
    assert text.splitlines()[0] == f"8 device(s), jax {jax.__version__}"
    assert text.splitlines()[1].startswith("memory: the device's allocator statistics where it reports")
    assert "memory in use / limit" in text and "(live arrays)" in text and "cpu7" in text
    html = table._repr_html_()
    assert html.startswith('<table class="mgkit">') and "<td>cpu7</td>" in html
    assert " (live arrays)</td>" in html


def test_unknown_device_name_in_table():
    with pytest.raises(KeyError, match="no device named 'cuda0'; devices that exist: cpu0"):
        mg.devices()["cuda0"]


def test_memory_column_when_the_device_reports_it():
    from mgkit._devices import DeviceInfo, DeviceTable

    dev = jax.devices()[0]
    t = DeviceTable([DeviceInfo("cuda0", "cuda", "H100", "H100", 0, 3 * 2**30, 80 * 2**30, dev)])
    assert "3.0 GiB / 80.0 GiB" in repr(t)


def _held() -> list[int]:
    """Each CPU device's bytes in use, after a collection (one: it is slow in a long run)."""
    gc.collect()
    table = mg.devices()
    return [table[f"cpu{i}"].memory_in_use for i in range(8)]


def test_cpu_memory_is_the_bytes_of_the_live_arrays_on_each_device():
    before = _held()
    x = mg.put(np.ones((256, 1024), np.float32), "dev5")  # 1 MiB on cpu5
    assert _held()[5] - before[5] == 2**20
    parts = mg.split(np.ones((80, 128), np.float32))  # 10 rows (5 KiB) on each device
    replicated = jax.device_put(
        np.ones(1000, np.float32), NamedSharding(jax.make_mesh((8,), ("i",)), PartitionSpec())
    )  # a copy of 4000 bytes on each device
    after = _held()
    assert [a - b for a, b in zip(after, before, strict=True)] == [
        10 * 128 * 4 + 4000 + (2**20 if i == 5 else 0) for i in range(8)
    ]
    x.delete()  # deleted (or donated) arrays hold nothing
    assert _held()[5] == after[5] - 2**20
    del parts, replicated
    assert _held() == before
    text = repr(mg.devices())
    assert f"{human_bytes(before[5])} (live arrays)" in text


def test_memory_usage_prefers_the_allocator_and_reads_live_arrays_once(monkeypatch):
    from mgkit import _devices

    cpus = jax.devices("cpu")
    monkeypatch.setattr(_devices, "memory", lambda d: (3 << 30, 16 << 30) if d.id == 2 else (None, None))
    readings = []

    def live():
        readings.append(1)
        return {cpus[0]: 1234}

    usage = _devices.memory_usage([cpus[0], cpus[1], cpus[2], cpus[0]], live)
    assert usage == {
        cpus[0]: (1234, None, "live arrays"),
        cpus[1]: (0, None, "live arrays"),
        cpus[2]: (3 << 30, 16 << 30, "allocator"),
    }
    assert readings == [1]  # one reading of the live arrays for every device without statistics
    assert _devices.memory_usage([cpus[2]], live) == {cpus[2]: (3 << 30, 16 << 30, "allocator")}
    assert readings == [1]  # not read at all when every device reports statistics
    assert _devices.memory_text(3 << 30, 16 << 30, "allocator") == "3.0 GiB / 16.0 GiB (19%)"
    assert _devices.memory_text(1234, None, "live arrays") == "1.2 KiB (live arrays)"
    assert _devices.memory_text(None, None, None) == "n/a"


def test_importing_mgkit_does_not_start_jax():
    r = run_python(
        """
        import mgkit
        from jax._src import xla_bridge
        print(xla_bridge.backends_are_initialized())
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_simulate_before_start_then_same_count_is_a_no_op():
    r = run_python(
        """
        import mgkit as mg, jax
        mg.simulate(3)
        print(len(jax.devices()))
        mg.simulate(3)
        print(mg.devices().names)
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["3", "['cpu0', 'cpu1', 'cpu2']"]


def test_simulate_too_late_says_how_to_fix():
    r = run_python(
        """
        import mgkit as mg, jax.numpy as jnp
        jnp.ones(1)
        try:
            mg.simulate(4)
        except RuntimeError as e:
            print(e)
        """
    )
    assert r.returncode == 0, r.stderr
    msg = r.stdout
    assert "mg.simulate(4) came too late: JAX has already started with 1 CPU device(s)" in msg
    assert "restart the kernel" in msg and "MGKIT_SIMULATE=4" in msg and "fresh process" in msg


def test_simulate_too_late_in_this_process():
    with pytest.raises(RuntimeError, match="already started with 8 CPU device"):
        mg.simulate(2)
    mg.simulate(8)  # the count in effect: a no-op


def test_mgkit_simulate_environment_variable():
    r = run_python("import mgkit as mg, jax; print(len(jax.devices('cpu')))", env={"MGKIT_SIMULATE": "5"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "5"


def test_bad_mgkit_simulate_environment_variable():
    r = run_python("import mgkit", env={"MGKIT_SIMULATE": "eight"})
    assert r.returncode != 0
    assert "MGKIT_SIMULATE='eight' is not a whole number of CPU devices" in r.stderr


@pytest.mark.parametrize(
    ("n", "error", "message"),
    [
        (0, ValueError, "simulate: n=0 is out of range; n must be a whole number at least 1"),
        (-1, ValueError, "simulate: n=-1 is out of range"),
        ("8", TypeError, "simulate: n must be a whole number at least 1 .*got str '8'; e.g. n=8"),
        (2.0, TypeError, "got float 2.0"),
        (True, TypeError, "got bool True"),
        (None, TypeError, "got NoneType None"),
    ],
)
def test_simulate_bad_arguments(n, error, message):
    with pytest.raises(error, match=message):
        mg.simulate(n)


def test_simulate_memory_gives_cpu_devices_a_limit_the_tables_and_memory_limit_report():
    r = run_python(
        """
        import mgkit as mg, numpy as np
        mg.simulate(4, memory="1GiB")
        x = mg.put(np.ones((256, 1024), np.float32), "cpu1")
        print(mg.memory_limit("cpu1"), mg.memory_limit("host"))
        print(mg.devices()["cpu1"].memory_limit, mg.devices()["cpu1"].memory_in_use)
        print(mg.DeviceMap(widget=False).rows()[1].limit)
        print(mg.DeviceMap(widget=False))
        mg.simulate(4, memory="16 GB")  # the count in effect: only the limit changes
        print(mg.memory_limit("dev0"))
        mg.simulate(4)  # no memory: the limit stays
        print(mg.memory_limit("dev0"))
        """
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:3] == ["1073741824 None", f"{2**30} {2**20}", str(2**30)]
    assert "  dev1   cpu1    cpu       cpu   1.0 MiB / 1.0 GiB (0%, live arrays)" in r.stdout
    assert lines[-2:] == ["16000000000", "16000000000"]


def test_simulate_memory_from_the_environment():
    env = {"MGKIT_SIMULATE": "2", "MGKIT_SIMULATE_MEMORY": "512MiB"}
    r = run_python("import mgkit as mg; print(mg.memory_limit('cpu1'), len(mg.devices()))", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(512 * 2**20), "2"]
    r = run_python("import mgkit", env={"MGKIT_SIMULATE_MEMORY": "512Mo"})
    assert r.returncode != 0
    assert "MGKIT_SIMULATE_MEMORY='512Mo' is not a size" in r.stderr
    assert "e.g. MGKIT_SIMULATE_MEMORY='16GiB'" in r.stderr


def test_no_simulated_limit_by_default():
    from mgkit import _devices

    assert mg.memory_limit("dev0") is None and mg.memory_limit(jax.devices()[3]) is None
    assert _devices.memory_text(2**20, 2**30, "live arrays") == "1.0 MiB / 1.0 GiB (0%, live arrays)"


@pytest.mark.parametrize(
    ("memory", "error", "message"),
    [
        ("16 gigs", ValueError, "simulate: memory='16 gigs' is not a size; memory must be a size in bytes"),
        (0, ValueError, "simulate: memory=0 is out of range"),
        (-5, ValueError, "simulate: memory=-5 is out of range"),
        ([16], TypeError, "simulate: memory must be a size in bytes above 0.*got list"),
    ],
)
def test_simulate_bad_memory(memory, error, message):
    with pytest.raises(error, match=message) as info:
        mg.simulate(8, memory=memory)
    assert "e.g. memory='16GiB'" in str(info.value)
    assert mg.memory_limit("dev0") is None  # nothing was set


def test_simulate_too_late_sets_no_memory():
    with pytest.raises(RuntimeError, match="already started with 8 CPU device"):
        mg.simulate(2, memory="1GiB")
    assert mg.memory_limit("dev0") is None


def test_memory_limit_unknown_context():
    with pytest.raises(mg.ContextError, match="memory_limit: unknown context 'dev9'; the contexts are dev0"):
        mg.memory_limit("dev9")
