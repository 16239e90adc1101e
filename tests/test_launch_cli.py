"""`mgkit worker` under a launcher of its own (here: 4 local processes standing for 2 hosts x 2
processes, all on 127.0.0.1) and `mgkit run --devices`."""

import os
import pickle
import socket
import subprocess
import sys
import textwrap

import psutil
import pytest

pytestmark = pytest.mark.timeout(180)

JOB = """
def work(rank, shared, private):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    total = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
    local = np.full(jax.local_device_count(), float(rank + 1))
    out = total(jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local))
    ids = [d.id for d in jax.local_devices()]
    return float(np.asarray(out.addressable_data(0))[0]) * (shared == "ok"), jax.process_count(), ids
"""


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("MGKIT_SIMULATE", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mgkit(*args):
    return [sys.executable, "-m", "mgkit._cli", *args]


def test_worker_two_hosts_of_two_processes(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    port = _free_port()
    shared = tmp_path / "shared.pkl"
    shared.write_bytes(pickle.dumps("ok"))
    procs = []
    for host in range(2):
        for local in range(2):
            pid = 2 * host + local
            procs.append(
                subprocess.Popen(
                    _mgkit(
                        "worker",
                        "job.py:work",
                        "--coordinator",
                        f"127.0.0.1:{port}",
                        "--num-processes",
                        "4",
                        "--process-id",
                        str(pid),
                        "--devices",
                        str(local),
                        "--shared",
                        str(shared),
                        "--out",
                        "out",
                    ),
                    cwd=tmp_path,
                    env=_env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
    values = [pickle.loads((tmp_path / "out" / f"rank{r}.pkl").read_bytes()) for r in range(4)]
    assert [v[0] for v in values] == [1.0 + 2 + 3 + 4] * 4
    assert [v[1] for v in values] == [4] * 4
    assert [v[2] for v in values] == [[0], [2048], [4096], [6144]]
    assert "mgkit worker: rank 2 of 4" in outs[2]
    assert not [c for c in psutil.Process().children(recursive=True) if c.pid in {p.pid for p in procs}]


def test_worker_bad_target_and_missing_flags(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    bad = subprocess.run(
        _mgkit("worker", "nope.py:work"), cwd=tmp_path, env=_env(), capture_output=True, text=True
    )
    assert bad.returncode == 1 and "'nope.py' is not a file" in bad.stderr
    half = subprocess.run(
        _mgkit("worker", "job.py:work", "--coordinator", "127.0.0.1:1234"),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert (
        half.returncode == 1
        and "give --coordinator, --num-processes and --process-id together" in half.stderr
    )


def test_run_pins_a_script_to_its_devices(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys
            import jax
            print(len(jax.devices()), os.environ["CUDA_VISIBLE_DEVICES"], sys.argv[1:])
            """
        )
    )
    out = subprocess.run(
        _mgkit("run", "--devices", "1,2", str(script), "--lr", "0.1"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "2 1,2 ['--lr', '0.1']"
    bad = subprocess.run(
        _mgkit("run", "--devices", "a", str(script)), env=_env(), capture_output=True, text=True
    )
    assert bad.returncode == 2 and "give device numbers separated by commas" in bad.stderr
