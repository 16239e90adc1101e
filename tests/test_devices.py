"""The device table and simulated devices."""

import jax
import pytest

import mgkit as mg
from tests.conftest import run_python


def test_devices_lists_every_cpu_device_with_short_names():
    table = mg.devices()
    assert table.names == [f"cpu{i}" for i in range(8)]
    row = table["cpu3"]
    assert row.platform == "cpu" and row.process_index == 0 and row.device == jax.devices("cpu")[3]
    assert row.memory_in_use is None and row.memory_limit is None  # memory_stats() is None on CPU
    assert table[0].name == "cpu0" and len(table) == 8 and [r.name for r in table] == table.names


def test_devices_text_and_html():
    table = mg.devices()
    text = repr(table)
    assert text.splitlines()[0] == f"8 device(s), jax {jax.__version__}"
    assert "memory in use / limit" in text and "n/a" in text and "cpu7" in text
    html = table._repr_html_()
    assert html.startswith('<table class="mgkit">') and "<td>cpu7</td>" in html and "<td>n/a</td>" in html


def test_unknown_device_name_in_table():
    with pytest.raises(KeyError, match="no device named 'cuda0'; devices that exist: cpu0"):
        mg.devices()["cuda0"]


def test_memory_column_when_the_device_reports_it():
    from mgkit._devices import DeviceInfo, DeviceTable

    dev = jax.devices()[0]
    t = DeviceTable([DeviceInfo("cuda0", "cuda", "H100", "H100", 0, 3 * 2**30, 80 * 2**30, dev)])
    assert "3.0 GiB / 80.0 GiB" in repr(t)


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
