"""mg.launch's bad input: each case gets a clear error naming the bad value, what was expected
and how to fix it, before any process starts (none is left, none was started)."""

import os
import socket
import threading

import psutil
import pytest

import mgkit as mg

LOCK = threading.Lock()


def work(rank, shared, private):
    return rank


def _notebook_function(source: str, **names):
    """A function defined as in a notebook cell (module ``__main__``: sent by value)."""
    namespace = {"__name__": "__main__", **names}
    exec(source, namespace)
    return namespace["uses_a_lock"]


uses_a_lock = _notebook_function(
    "def uses_a_lock(rank, shared, private):\n    with LOCK:\n        return rank\n", LOCK=LOCK
)


def _generator_closure():
    gen = (i for i in range(3))

    def work(rank, shared, private):
        return next(gen)

    return work


@pytest.fixture
def busy_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


CASES = [
    ("not callable", lambda: mg.launch(42, nprocs=1), TypeError, r"needs a function .* got int 42"),
    (
        "wrong signature",
        lambda: mg.launch(lambda x: x, nprocs=1),
        TypeError,
        r"calls fn\(rank, shared, private\) .* does not accept three positional arguments",
    ),
    ("nprocs 0", lambda: mg.launch(work, nprocs=0), ValueError, r"nprocs.*0"),
    ("nprocs negative", lambda: mg.launch(work, nprocs=-2), ValueError, r"nprocs.*-2"),
    ("nprocs float", lambda: mg.launch(work, nprocs=1.5), TypeError, r"nprocs.*1\.5"),
    ("nprocs bool", lambda: mg.launch(work, nprocs=True), TypeError, r"nprocs"),
    (
        "private of the wrong length",
        lambda: mg.launch(work, nprocs=2, private=[{}, {}, {}]),
        ValueError,
        r"private has 3 entries but there are 2 ranks",
    ),
    (
        "private not a list",
        lambda: mg.launch(work, private={"l2": 1.0}),
        TypeError,
        r"private must be a list with one entry per rank, got dict",
    ),
    (
        "devices_per_process 0",
        lambda: mg.launch(work, devices_per_process=0),
        ValueError,
        "devices_per_process",
    ),
    (
        "private empty",
        lambda: mg.launch(work, private=[]),
        ValueError,
        r"private=\[\] has no entries, so there is no rank to run; give one entry per rank .*or private=None",
    ),
    (
        "unpicklable global",
        lambda: mg.launch(uses_a_lock, nprocs=1),
        TypeError,
        r"cannot send global 'LOCK' of uses_a_lock \(a _thread.lock\)",
    ),
    (
        "unpicklable captured variable",
        lambda: mg.launch(_generator_closure(), nprocs=1),
        TypeError,
        r"cannot send variable 'gen' captured by .*work \(a generator\)",
    ),
    (
        "unpicklable shared",
        lambda: mg.launch(work, nprocs=1, shared={"ok": 1, "log": open(os.devnull, "w")}),  # noqa: SIM115
        TypeError,
        r"cannot send shared\['log'\] \(a _io.TextIOWrapper\)",
    ),
    (
        "unpicklable private",
        lambda: mg.launch(work, private=[{}, {"lock": threading.Lock()}]),
        TypeError,
        r"cannot send private\[1\]\['lock'\] \(a _thread.lock\)",
    ),
    (
        "distributed with one process",
        lambda: mg.launch(work, nprocs=1, distributed=True),
        ValueError,
        r"distributed=True needs at least 2 processes",
    ),
    (
        "distributed not a bool",
        lambda: mg.launch(work, nprocs=2, distributed="yes"),
        TypeError,
        "distributed",
    ),
    (
        "invalid coordinator port",
        lambda: mg.launch(work, nprocs=2, distributed=True, coordinator="127.0.0.1:70000"),
        ValueError,
        r"coordinator port '70000' .* is not a port number from 1 to 65535",
    ),
    (
        "coordinator not an address",
        lambda: mg.launch(work, nprocs=2, distributed=True, coordinator="nowhere"),
        ValueError,
        r"coordinator must be 'host:port' or a port number, got 'nowhere'",
    ),
    (
        "coordinator without distributed",
        lambda: mg.launch(work, nprocs=2, coordinator=12355),
        ValueError,
        r"pass distributed=True too",
    ),
    (
        "unknown timeout",
        lambda: mg.launch(work, nprocs=2, distributed=True, timeouts={"hartbeat": 3}),
        ValueError,
        r"unknown timeout\(s\) \['hartbeat'\]; the timeouts are "
        r"\['collectives', 'heartbeat', 'init', 'shutdown'\]",
    ),
    ("timeout 0", lambda: mg.launch(work, nprocs=1, timeout=0), ValueError, r"timeout must be above 0"),
    ("timeout negative", lambda: mg.launch(work, nprocs=1, timeout=-5), ValueError, "timeout"),
    ("grace negative", lambda: mg.launch(work, nprocs=1, grace=-1), ValueError, "grace"),
    ("stall_after 0", lambda: mg.launch(work, nprocs=1, stall_after=0), ValueError, "stall_after"),
    (
        "on_stall unknown",
        lambda: mg.launch(work, nprocs=1, on_stall="explode"),
        ValueError,
        r"on_stall must be 'raise' or 'warn', got 'explode'",
    ),
    ("env not a dict", lambda: mg.launch(work, nprocs=1, env=["A=1"]), TypeError, r"env must be a dict"),
    (
        "env sets the devices",
        lambda: mg.launch(work, nprocs=1, env={"CUDA_VISIBLE_DEVICES": "0"}),
        ValueError,
        r"env sets CUDA_VISIBLE_DEVICES, which mg.launch sets itself",
    ),
]


@pytest.mark.parametrize(("call", "error", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_named_before_any_process_starts(call, error, match):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(error, match=match):
        call()
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def test_busy_coordinator_port_is_named(busy_port):
    with pytest.raises(ValueError, match=rf"coordinator port {busy_port} on 127.0.0.1 is busy"):
        mg.launch(work, nprocs=2, distributed=True, coordinator=f"127.0.0.1:{busy_port}")
    with pytest.raises(ValueError, match=rf"coordinator port {busy_port} on 127.0.0.1 is busy"):
        mg.launch(work, nprocs=2, distributed=True, coordinator=busy_port)


def test_there_are_at_least_twenty_distinct_cases():
    assert len(CASES) + 1 >= 20


def test_watchdog_bad_arguments():
    with pytest.raises(ValueError, match="stall_after must be above 0"):
        mg.watchdog(stall_after=0)
    with pytest.raises(ValueError, match="on_stall must be 'warn' or 'interrupt'"):
        mg.watchdog(on_stall="raise!")
    with pytest.raises(TypeError, match="step"):
        mg.beat("three")
