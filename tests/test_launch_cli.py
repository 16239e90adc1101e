"""`mgkit worker` under a launcher of its own (here: 4 local processes standing for 2 hosts x 2
processes, all on 127.0.0.1) and `mgkit run --devices`."""

import pickle
import socket
import subprocess
import sys
import textwrap

import psutil
import pytest

from tests.conftest import child_env

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
    env = child_env()
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


CHECKED = """
import pathlib
import threading


def work(rank, shared, private):
    pathlib.Path("ran").write_text("the function ran")
    return {"rank": rank, "lock": threading.Lock()}


def two(a, b):
    return a
"""


def _worker(tmp_path, *args, flags=True, env=None):
    """``mgkit worker`` with ``args``, as the one process of a job (a coordinator on 127.0.0.1)."""
    job = ["--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", "1", "--process-id", "0"]
    cluster = ("SLURM_", "OMPI_", "KUBERNETES_", "TPU_WORKER", "MEGASCALE_")
    clean = {k: v for k, v in _env().items() if not k.startswith(cluster)}
    return subprocess.run(
        _mgkit("worker", *args, *(job if flags else []), "--init-timeout", "20"),
        cwd=tmp_path,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            ["nope.py:work"],
            "'nope.py' is not a file; give pkg.module:function, script.py:function or script.py",
        ),
        (["nosuchmodule:work"], "no module named 'nosuchmodule'; give pkg.module:function with the module"),
        (["job"], "'job' names a module but no function; give it as job:function"),
        (["job:nope"], "job has no function 'nope'; its functions: two, work"),
        (
            ["job.py:two"],
            "mgkit worker calls fn(rank, shared, private) in every rank, but two(a, b) does not accept "
            "three positional arguments",
        ),
        (["job:work", "--shared", "missing.pkl"], "--shared 'missing.pkl' is not a file; give a pickle file"),
        (["job:work", "--shared", "job.py"], "--shared 'job.py' cannot be read as a pickle (UnpicklingError"),
        (["job:work", "--out", "job.py"], "--out 'job.py' is a file; give a folder (made if missing)"),
    ],
    ids=[
        "no script",
        "no module",
        "no function named",
        "no such function",
        "signature",
        "no shared",
        "shared not a pickle",
        "out a file",
    ],
)
def test_worker_checks_before_joining_and_says_it_in_one_line(tmp_path, args, words):
    (tmp_path / "job.py").write_text(CHECKED)
    out = _worker(tmp_path, *args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mgkit worker: error: {words}"), out.stderr
    assert not (tmp_path / "ran").exists()  # nothing ran: no work is lost to a late error


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        (
            [],
            {},
            "no cluster to join: give --coordinator HOST:PORT --num-processes N --process-id I (e.g. "
            "--coordinator 127.0.0.1:12355 --num-processes 2 --process-id 0 for the first of two processes), "
            "or start it with srun (Slurm sets SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, "
            "SLURM_PROCID, SLURM_LOCALID) or mpirun (Open MPI sets OMPI_MCA_orte_hnp_uri)",
        ),
        (
            [],
            {"SLURM_JOB_ID": "7"},
            "; found part of one: srun (Slurm) is missing SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, "
            "SLURM_LOCALID",
        ),
        (
            ["--coordinator", "127.0.0.1:1234"],
            {},
            "give --coordinator, --num-processes and --process-id together, or none of them",
        ),
        (
            ["--coordinator", "127.0.0.1", "--num-processes", "2", "--process-id", "0"],
            {},
            "--coordinator '127.0.0.1' is not HOST:PORT; give process 0's host and a free port",
        ),
        (
            ["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
            {},
            "--process-id 2 is out of range for --num-processes 2; give 0 to 1",
        ),
    ],
    ids=["no cluster", "part of slurm", "half the flags", "no port", "process id"],
)
def test_worker_names_the_flags_or_the_cluster_it_needs(tmp_path, args, env, words):
    (tmp_path / "job.py").write_text(CHECKED)
    out = _worker(tmp_path, "job:work", *args, flags=False, env=env)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("mgkit worker: error: ") and words in out.stderr
    assert "coordinator_address should be defined" not in out.stderr


@pytest.mark.parametrize(
    "target, first",
    [
        ("missing.py:work", "'missing.py' is not a file; give pkg.module:function"),
        ("nosuchmodule:work", "no module named 'nosuchmodule'; give pkg.module:function"),
    ],
)
def test_worker_names_a_wrong_target_before_a_missing_cluster_and_both(tmp_path, target, first):
    out = _worker(tmp_path, target, flags=False)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 2, out.stderr
    assert lines[0].startswith(f"mgkit worker: error: {first}"), out.stderr
    assert lines[1].startswith("mgkit worker: error: no cluster to join: give --coordinator"), out.stderr


def test_worker_names_the_part_of_a_value_it_cannot_write(tmp_path):
    (tmp_path / "job.py").write_text(CHECKED)
    out = _worker(tmp_path, "job:work", "--out", "values")
    assert out.returncode == 1, out.stderr
    assert (tmp_path / "ran").exists() and not (tmp_path / "values" / "rank0.pkl").exists()
    assert out.stderr.strip().splitlines() == [
        "mgkit worker: error: rank 0 returned a dict, which cannot be written to --out: the value['lock'] "
        "(a _thread.lock) cannot be pickled (TypeError: cannot pickle '_thread.lock' object); return plain "
        "data instead (numbers, numpy arrays, dicts and lists of them)"
    ]


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
