"""mg.launch in real processes: values, output, and every fault with its detection time measured
and no process left behind (psutil). Ranks start in about 2-3 s here (a fresh interpreter that
imports JAX, two at a time on two cores), so each test starts as few ranks as it can."""

import _thread
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest

import mgkit as mg

pytestmark = [
    pytest.mark.timeout(120),
    # a few launches simulate more CPU devices than a small machine has cores (tests/test_launch_plan.py)
    pytest.mark.filterwarnings("ignore::mgkit.launching.CoresWarning"),
]


def _gone(pids, within: float) -> float:
    """Seconds until every pid has exited (fails past ``within``)."""
    t0 = time.perf_counter()
    while True:
        alive = [
            p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return time.perf_counter() - t0
        assert time.perf_counter() - t0 < within, f"processes {alive} still alive after {within} s"
        time.sleep(0.02)


def _no_children() -> None:
    left = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    assert not [p for p in left if "mgkit.launching" in " ".join(p.cmdline())], left


@pytest.fixture
def launch_tmp(tmp_path, monkeypatch):
    """The test's own temporary directory, where launches make their folder of stacks files."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _none_left(tmp) -> None:
    """Nothing a launch made is left in the temporary directory ``tmp``."""
    assert not sorted(p.name for p in tmp.glob("mgkit-launch-*")), list(tmp.iterdir())


def _marks(tail, word):
    """The times a rank printed as ``word <time.time()>`` just before it failed."""
    return [float(line.split()[-1]) for line in tail if line.startswith(word)]


def test_values_shared_private_and_output(capfd, launch_tmp):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    left = {  # folders earlier launches left: a dead kernel's are removed, others kept
        f"mgkit-launch-{int(dead.stdout)}-gone": ["rank0.txt", "rank1.txt"],
        f"mgkit-launch-{int(dead.stdout)}-mine": ["notes.txt"],  # not only stacks files: kept
        f"mgkit-launch-{os.getpid()}-alive": ["rank0.txt"],  # its kernel lives: kept
    }
    for name, files in left.items():
        (launch_tmp / name).mkdir()
        for f in files:
            (launch_tmp / name / f).write_text("")

    def work(rank, shared, private):
        import jax

        print(f"rank says {rank} with {len(jax.devices())} device(s)")
        return shared["x"] * private["k"] + rank

    res = mg.launch(work, shared={"x": np.arange(3)}, private=[{"k": 1}, {"k": 2}])
    assert [v.tolist() for v in res.values] == [[0, 1, 2], [1, 3, 5]]
    assert res.exit_codes == [0, 0]
    assert all(s > 0 for s in res.seconds)
    assert [r.devices for r in res.ranks] == [("cpu0",), ("cpu0",)]
    assert [r.state for r in res.ranks] == ["done", "done"]
    out = capfd.readouterr().out
    assert "[rank 0] rank says 0 with 1 device(s)" in out
    assert "[rank 1] rank says 1 with 1 device(s)" in out
    assert "rank" in repr(res) and "done" in repr(res)
    kinds = {e.info["event"] for e in mg.ledger().records("launch")}
    assert {"ready", "done"} <= kinds
    _no_children()
    assert sorted(p.name for p in launch_tmp.iterdir()) == sorted(
        set(left) - {f"mgkit-launch-{int(dead.stdout)}-gone"}
    )


def test_a_rank_raises_others_stop_values_kept(launch_tmp):
    def work(rank, shared, private):
        import time

        if rank == 0:
            return "early"
        if rank == 1:
            time.sleep(1.0)
            print("raising", time.time(), flush=True)
            raise ValueError("bad row in rank 1")
        time.sleep(60)

    t0 = time.perf_counter()
    with pytest.raises(mg.LaunchError) as info:
        mg.launch(work, nprocs=3, grace=2.0, stream=False)
    err = info.value
    raised = _marks(err.ranks[1].tail, "raising")[0]
    latency = time.time() - raised
    assert latency < 1.0, latency
    assert err.kind == "raised" and err.rank == 1 and err.pid == err.ranks[1].pid
    assert isinstance(err.exception, ValueError) and "bad row in rank 1" in str(err.exception)
    assert "bad row in rank 1" in err.traceback and "in work" in err.traceback
    assert "rank 1 (pid" in str(err) and "ValueError: bad row in rank 1" in str(err)
    assert 'raise ValueError("bad row in rank 1")' in str(err)  # the source line, from the kernel
    assert err.values[0] == "early" and err.done == [0]
    assert [r.state for r in err.ranks] == ["done", "failed", "terminated"]
    assert "terminated after rank 1 failed" in str(err)
    _gone([r.pid for r in err.ranks], within=0.5)
    _no_children()
    _none_left(launch_tmp)
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize(
    ("how", "kind", "words"),
    [
        ("os._exit(3)", "exited", "exited with code 3 without returning a value"),
        ("os.kill(os.getpid(), 9)", "signal", "killed by signal SIGKILL (9)"),
        ("os.kill(os.getpid(), 15)", "signal", "killed by signal SIGTERM (15)"),
        ("sys.exit(123)", "exited", "called sys.exit(123)"),
    ],
    ids=["exit code", "SIGKILL", "external SIGTERM", "sys.exit"],
)
def test_exit_code_and_signal_detected_fast(how, kind, words):
    code = f"import os, sys, time\nprint('dying', time.time(), flush=True)\n{how}\n"

    def work(rank, shared, private):
        exec(shared)

    with pytest.raises(mg.LaunchError) as info:
        mg.launch(work, nprocs=1, shared=code, stream=False)
    err = info.value
    latency = time.time() - _marks(err.ranks[0].tail, "dying")[0]
    assert latency < 0.5 + 0.2, latency  # 0.5 s to notice, plus the output's trip through the pipe
    assert err.kind == kind and words in str(err)
    _no_children()


def test_every_rank_raises_the_first_is_the_cause_the_others_failed_too(tmp_path):
    def work(rank, shared, private):
        import os
        import time

        if rank == 1:  # raises after rank 0 has (a sleep alone loses to a slow start under load)
            while not os.path.exists(shared):
                time.sleep(0.01)
            time.sleep(0.5)
        else:
            open(shared, "w").close()
        raise RuntimeError(f"rank {rank} gives up")

    with pytest.raises(
        mg.LaunchError, match=r"^rank 0 \(pid \d+\) raised RuntimeError: rank 0 gives up"
    ) as info:
        mg.launch(work, nprocs=2, shared=str(tmp_path / "rank0-raised"), grace=2.0, stream=False)
    second = info.value.ranks[1]
    assert second.state in ("failed", "terminated"), second
    if second.state == "failed":
        assert "failed too, after rank 0: it raised RuntimeError: rank 1 gives up" in second.reason
    _no_children()


def test_unsendable_result_is_named_with_its_rank():
    def work(rank, shared, private):
        import threading

        return {"lock": threading.Lock()}

    with pytest.raises(
        mg.LaunchError, match=r"rank 0 \(pid \d+\) returned a dict, which cannot be sent back"
    ) as info:
        mg.launch(work, nprocs=1, stream=False)
    assert "the value['lock'] (a _thread.lock) cannot be pickled" in str(info.value)
    assert info.value.kind == "unsendable"
    _no_children()


def test_stall_reports_stacks_and_steps_then_stops():
    def work(rank, shared, private):
        import time

        import mgkit as mg

        for step in range(1, 6):
            mg.beat(step)
        time.sleep(60)  # the hang

    t0 = time.perf_counter()
    with pytest.raises(mg.LaunchError) as info:
        mg.launch(work, nprocs=1, stall_after=1.5, stream=False)
    took = time.perf_counter() - t0
    err = info.value
    assert err.kind == "stalled" and err.rank == 0
    assert "last completed step 5" in str(err)
    assert "in work" in err.stacks[0] and "Python stacks of rank 0" in str(err)
    assert took < 1.5 + 5.0, took  # start-up, then the limit, then the stack dump
    _no_children()


def test_timeout_stops_every_rank_and_reports_each_with_its_step_and_stack(launch_tmp):
    def work(rank, shared, private):
        import time

        import mgkit as mg

        for step in range(1, 4 + rank):
            mg.beat(step)

        def nap():
            time.sleep(60)

        nap()

    t0 = time.perf_counter()
    with pytest.raises(
        mg.LaunchError, match=r"ran past timeout=6 s and stopped rank\(s\) 0, 1 \(2 of 2"
    ) as info:
        mg.launch(work, nprocs=2, timeout=6, grace=1.0, stream=False)
    err = info.value
    assert err.kind == "timeout" and err.rank is None
    assert 6 <= time.perf_counter() - t0 < 6 + 3.0
    assert [r.state for r in err.ranks] == ["terminated", "terminated"]
    for rank, info_ in enumerate(err.ranks):
        assert info_.reason.startswith(
            f"stopped at timeout=6 s while running, last completed step {3 + rank} ("
        )
        line = f"  rank {rank} (pid {info_.pid}, {','.join(info_.devices)}): stopped at timeout=6 s"
        assert line + " while running" in str(err)
        assert "in nap" in err.stacks[rank] and "in work" in err.stacks[rank]
    assert "last completed steps: rank 0: step 3, rank 1: step 4" in str(err)
    _gone([r.pid for r in err.ranks], within=1.0)
    _no_children()
    _none_left(launch_tmp)


def test_interrupt_stops_all_within_grace_then_relaunch_works(launch_tmp):
    """Ctrl-C in the kernel: every rank gone within grace + 5 s, even one that ignores SIGTERM."""

    def work(rank, shared, private):
        import signal
        import time

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)

    pids = []

    def interrupt():
        while not pids:
            state = mg.launching.current()
            if state and all(r.state == "running" for r in state[1]):
                pids.extend(r.pid for r in state[1])
                break
            time.sleep(0.05)
        time.sleep(0.3)
        pressed.append(time.perf_counter())
        _thread.interrupt_main()

    pressed = []
    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        mg.launch(work, nprocs=2, grace=1.0, stream=False)
    assert pids and pressed
    _gone(pids, within=1.0 + 5.0)
    assert time.perf_counter() - pressed[0] < 1.0 + 5.0  # control back, every rank gone
    _no_children()
    _none_left(launch_tmp)
    assert mg.launch(lambda rank, shared, private: rank + 1, nprocs=2, stream=False).values == [1, 2]


def test_kernel_killed_children_exit_within_a_second(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(
        textwrap.dedent(
            """
            import time
            import mgkit as mg
            mg.simulate(8)

            def work(rank, shared, private):
                import os, time
                print("pid", os.getpid(), flush=True)
                time.sleep(120)

            mg.launch(work, nprocs=2)
            """
        )
    )
    from tests.conftest import child_env  # here: the ranks import this module, and no conftest

    env = child_env()
    env["TMPDIR"] = str(tmp_path)  # where the launch makes its folder, which the ranks remove
    kernel = subprocess.Popen([sys.executable, "-u", str(script)], stdout=subprocess.PIPE, text=True, env=env)
    pids = []
    try:
        while len(pids) < 2:
            line = kernel.stdout.readline()
            assert line, "the kernel ended before its ranks started"
            if " pid " in line:
                pids.append(int(line.split()[-1]))
        assert len(list(tmp_path.glob("mgkit-launch-*"))) == 1  # the launch's, while it runs
        kernel.kill()
        kernel.wait()
        assert _gone(pids, within=1.0) < 1.0
        _none_left(tmp_path)  # the kernel could not remove it: its ranks did
    finally:
        if kernel.poll() is None:
            kernel.kill()
        for pid in pids:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- jax.distributed across ranks


def _psum_and_names(rank, shared, private):
    import ipaddress

    import jax
    import numpy as np
    import psutil
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import mgkit as mg

    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    total = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
    local = np.arange(2.0) + 2 * rank + 1  # 1, 2 on rank 0; 3, 4 on rank 1
    out = total(jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local))
    listening = {c.laddr.ip for c in psutil.Process().net_connections() if c.status == psutil.CONN_LISTEN}

    def loopback(ip):
        address = ipaddress.ip_address(ip.split("%")[0])
        mapped = getattr(address, "ipv4_mapped", None)
        return address.is_loopback or (mapped is not None and mapped.is_loopback)

    return {
        "psum": float(np.asarray(out.addressable_data(0))[0]),
        "contexts": str(mg.context_map()),
        "ids": [d.id for d in jax.devices()],
        "listening": sorted(listening),
        "all_loopback": all(loopback(ip) for ip in listening),
    }


def test_distributed_psum_over_two_processes_of_two_devices():
    res = mg.launch(_psum_and_names, nprocs=2, devices_per_process=2, distributed=True, stream=False)
    for value in res.values:
        assert value["psum"] == 1 + 2 + 3 + 4
        assert value["ids"] == [0, 1, 2048, 2049]
        assert value["contexts"] == "dev0->cpu0;dev1->cpu1;dev2->cpu2;dev3->cpu3"
    assert res.values[0]["listening"], "the coordinator should listen in rank 0"
    assert all(v["all_loopback"] for v in res.values), [v["listening"] for v in res.values]
    assert [r.devices for r in res.ranks] == [("cpu0", "cpu1"), ("cpu2", "cpu3")]
    _no_children()


def _train(rank, shared, private):
    import jax.numpy as jnp
    import numpy as np
    import optax

    import mgkit as mg

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = (x[:, 0] - x[:, 3] > 0).astype(np.float32)

    def loss(p, b):
        return optax.sigmoid_binary_cross_entropy(b["x"] @ p["w"] + p["b"], b["y"]).mean()

    tr = mg.Trainer(loss, optax.adam(1e-2), {"w": jnp.zeros(8), "b": jnp.zeros(())})
    hist = tr.fit({"x": x, "y": y}, steps=50, batch_size=64)
    return float(hist.loss[-1]), len(tr.targets.contexts)


def test_trainer_across_two_processes_equals_one_process():
    two = mg.launch(_train, nprocs=2, devices_per_process=2, distributed=True, stream=False)
    one = mg.launch(_train, nprocs=1, devices_per_process=4, stream=False)
    assert two.values[0] == two.values[1]
    assert two.values[0][1] == one.values[0][1] == 4
    assert two.values[0][0] == pytest.approx(one.values[0][0], rel=1e-6, abs=1e-7)
    _no_children()


def _dies(rank, shared, private):
    import os
    import signal
    import time

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import mgkit as mg

    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    total = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), np.ones(1))
    for step in range(10_000):
        total(x).block_until_ready()
        mg.beat(step)
        if step == 3 and rank == shared["rank"]:
            print("fault", time.time(), flush=True)
            os.kill(os.getpid(), signal.SIGSTOP if shared["how"] == "stop" else signal.SIGKILL)
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("rank", "how", "words"),
    [
        (1, "kill", "rank 1 (pid"),
        (0, "kill", "rank 0 (pid"),
        (1, "stop", "rank 1 (pid"),
    ],
    ids=["non-coordinator killed", "coordinator killed", "rank stalled"],
)
def test_distributed_faults_end_in_a_launch_error(rank, how, words):
    heartbeat = 3
    with pytest.raises(mg.LaunchError) as info:
        mg.launch(
            _dies,
            nprocs=2,
            distributed=True,
            shared={"rank": rank, "how": how},
            timeouts={"heartbeat": heartbeat},
            grace=1.0,
            stream=False,
        )
    err = info.value
    fault = _marks(err.ranks[rank].tail, "fault")[0]
    latency = time.time() - fault
    assert latency < heartbeat + 2, latency
    assert str(err).startswith(words) and err.rank == rank
    other = err.ranks[1 - rank]
    if how == "stop":  # JAX aborts the survivor, which names the stopped rank
        assert other.state == "aborted" and f"aborted after rank {rank} died" in other.reason, other
        assert "stopped answering jax.distributed's heartbeats" in str(err)
    else:  # the supervisor sees the death first and stops the survivor
        assert other.state in ("terminated", "aborted"), other
    _gone([r.pid for r in err.ranks], within=0.5)
    _no_children()


def test_a_collective_that_times_out_names_it_and_shows_where_each_rank_was():
    def work(rank, shared, private):
        import time

        import jax
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
        total = jax.jit(
            jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())
        )
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), np.ones(1))
        total(x).block_until_ready()
        if rank == 1:
            time.sleep(60)  # never joins the next psum
        total(x).block_until_ready()

    t0 = time.perf_counter()
    with pytest.raises(mg.LaunchError, match=r"a collective timed out \(2 s\)") as info:
        mg.launch(work, nprocs=2, distributed=True, timeouts={"collectives": 2}, stream=False)
    err = info.value
    assert err.kind == "raised" and err.rank == 0 and "Timed out" in str(err)
    assert "time.sleep(60)" in err.stacks[1] or "in work" in err.stacks[1], err.stacks
    assert time.perf_counter() - t0 < 2 + 12  # start-up (slow beside other tests), the timeout, the stacks
    _no_children()
