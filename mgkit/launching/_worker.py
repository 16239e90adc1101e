"""``mgkit worker`` and ``mgkit run``: the same rank code under a cluster's own launcher.

``mgkit worker pkg.module:function`` (or ``path/to/script.py[:function]``) joins
``jax.distributed`` (the coordinator, process count and id from flags, or else from JAX's own
cluster detection: Slurm, Open MPI) and calls ``function(rank, shared, private)`` with
``rank = jax.process_index()``, as ``mg.launch`` would; a script without a function runs as
``__main__`` once JAX is up. So a job scales out with ``srun`` or ``mpirun`` and no cluster
manager of mgkit's own. Everything that can be checked is checked before joining (the target,
then the flags or the cluster's variables, the function and its signature, ``--shared``,
``--out``): a bad command line gets a line for what is wrong (the target and the cluster both,
when both are) and exit code 2. A value that cannot be written to ``--out`` is
named by its part, as ``mg.launch`` names it.

``mgkit run --devices 1 script.py`` runs a script pinned to the listed devices (separate
jobs on separate GPUs): ``CUDA_VISIBLE_DEVICES`` on GPUs, as many simulated CPU
devices as listed on a machine without one.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import pickle
import runpy
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import cloudpickle

from .._watchdog import watchdog
from . import _check
from ._plan import TIMEOUTS


def _device_list(text: str) -> list[str]:
    ids = [t.strip() for t in text.split(",")]
    if not ids or not all(t.isdigit() for t in ids) or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(
            f"--devices {text!r}: give device numbers separated by commas, each once, e.g. --devices 0 "
            "or --devices 0,1"
        )
    return ids


def _pin(ids: list[str]) -> dict[str, str]:
    """The environment that pins a process to these devices: those GPUs, or as many simulated
    CPU devices when there is no GPU."""
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(ids),
        "JAX_NUM_CPU_DEVICES": str(len(ids)),
        "MGKIT_SIMULATE": str(len(ids)),
    }


def run_main(args: argparse.Namespace) -> int:
    """``mgkit run --devices IDS script.py [args...]``: replaces this process by the script's."""
    script = Path(args.script)
    if not script.is_file():
        raise ValueError(f"mgkit run: {args.script!r} is not a file; give the path of a Python script")
    env = {**os.environ, **_pin(args.devices)}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, str(script), *args.args], env)
    return 0  # pragma: no cover - execve does not return


class UsageError(ValueError):
    """A bad ``mgkit worker`` command line, found before joining jax.distributed (exit code 2)."""


class Job(NamedTuple):
    """What ``mgkit worker`` runs, checked before it joins jax.distributed."""

    where: str  # the module's name, or the script's path
    fn: Callable | None  # the function, called as fn(rank, shared, private); None: run the script
    shared: Any  # the object from --shared (None without it)
    out: Path | None  # the folder for rank<k>.pkl (made already), or None


_CLUSTERS = {  # the variables JAX's cluster detection reads, by launcher
    "srun (Slurm)": ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
    "mpirun (Open MPI)": ("OMPI_MCA_orte_hnp_uri",),
}
# other clusters JAX detects itself (Kubernetes, TPU pods), by a variable they set
_OTHER_CLUSTERS = ("KUBERNETES_SERVICE_HOST", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")


def _check_flags(args: argparse.Namespace) -> None:
    """--coordinator, --num-processes and --process-id: all or none, and each well formed."""
    flags = (args.coordinator, args.num_processes, args.process_id)
    if not all(f is not None for f in flags):
        raise UsageError(
            "give --coordinator, --num-processes and --process-id together, or none of them "
            "(then JAX detects the cluster: Slurm, Open MPI)"
        )
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(
            f"--coordinator {args.coordinator!r} is not HOST:PORT; give process 0's host and a free "
            "port, e.g. --coordinator 127.0.0.1:12355"
        )
    if not 0 <= args.process_id < args.num_processes:
        raise UsageError(
            f"--process-id {args.process_id} is out of range for --num-processes {args.num_processes}; "
            f"give 0 to {args.num_processes - 1}, a different one to each process"
        )


def _check_cluster(args: argparse.Namespace) -> None:
    """The flags name the job, or a launcher JAX detects set its variables: else a UsageError
    naming both ways."""
    if any(f is not None for f in (args.coordinator, args.num_processes, args.process_id)):
        _check_flags(args)
        return
    if any(key in os.environ for key in _OTHER_CLUSTERS):
        return
    missing = {how: [v for v in names if v not in os.environ] for how, names in _CLUSTERS.items()}
    if any(not m for m in missing.values()):
        return
    found = [f"{how} is missing {', '.join(m)}" for how, m in missing.items() if len(m) < len(_CLUSTERS[how])]
    raise UsageError(
        "no cluster to join: give --coordinator HOST:PORT --num-processes N --process-id I (e.g. "
        "--coordinator 127.0.0.1:12355 --num-processes 2 --process-id 0 for the first of two processes), "
        "or start it with srun (Slurm sets SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, "
        "SLURM_LOCALID) or mpirun (Open MPI sets OMPI_MCA_orte_hnp_uri)"
        + (f"; found part of one: {'; '.join(found)}" if found else "")
    )


def _target(text: str) -> tuple[str, str | None, bool]:
    """('module or path', 'function' or None, is_path) for ``pkg.mod:fn``, ``a/b.py[:fn]``."""
    where, _, name = text.partition(":")
    if where.endswith(".py") or os.sep in where:
        if not Path(where).is_file():
            raise UsageError(
                f"{where!r} is not a file; give pkg.module:function, script.py:function or script.py"
            )
        return where, name or None, True
    if not name:
        raise UsageError(
            f"{text!r} names a module but no function; give it as {text}:function "
            "(the function is called as function(rank, shared, private))"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if importlib.util.find_spec(where.split(".")[0]) is None:
        raise UsageError(
            f"no module named {where!r}; give pkg.module:function with the module importable from "
            f"the current folder ({os.getcwd()}) or PYTHONPATH, or script.py:function"
        )
    return where, name, False


def _load(where: str, name: str, is_path: bool) -> Callable:
    """The function ``name`` of the script or module ``where``, checked to take
    ``(rank, shared, private)``."""
    if is_path:
        namespace = runpy.run_path(where, run_name="__mgkit_worker__")
    else:
        namespace = vars(importlib.import_module(where))  # found by _target
    if name not in namespace or not callable(namespace[name]):
        found = sorted(k for k, v in namespace.items() if callable(v) and not k.startswith("_"))[:10]
        raise UsageError(f"{where} has no function {name!r}; its functions: {', '.join(found) or 'none'}")
    fn = namespace[name]
    try:
        _check.check_signature(fn, "mgkit worker")
    except TypeError as exc:
        raise UsageError(str(exc)) from None
    return fn


def _read_shared(path: str | None) -> Any:
    if path is None:
        return None
    if not Path(path).is_file():
        raise UsageError(
            f"--shared {path!r} is not a file; give a pickle file, e.g. made with pickle.dump(obj, f)"
        )
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception as exc:  # noqa: BLE001 - any failure to read it is the answer
        raise UsageError(
            f"--shared {path!r} cannot be read as a pickle ({type(exc).__name__}: {exc}); "
            "write it with pickle.dump(obj, f) from code that can import the same modules"
        ) from None


def _make_out(path: str | None) -> Path | None:
    if path is None:
        return None
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {path!r} is a file; give a folder (made if missing) for rank<k>.pkl")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"--out {path!r} cannot be made ({exc.strerror}); give a folder you can write"
        ) from None
    return out


def _prepare(args: argparse.Namespace) -> Job:
    """Every check that can be made before joining jax.distributed: the target, the cluster (a
    UsageError of a line for each when both are wrong), --out, the target's function (its module
    or script is imported here: keep JAX computations inside the function), --shared."""
    found = [_attempt(_target, args.target), _attempt(_check_cluster, args)]
    wrong = [str(f) for f in found if isinstance(f, UsageError)]
    if wrong:
        raise UsageError("\n".join(wrong))
    where, name, is_path = found[0]
    out = _make_out(args.out)
    if args.devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(args.devices)
        from .._devices import simulate

        simulate(len(args.devices))
    fn = None if name is None else _load(where, name, is_path)
    return Job(where, fn, _read_shared(args.shared), out)


def _attempt(check: Callable, arg: Any) -> Any:
    """``check(arg)``, or the UsageError it raised."""
    try:
        return check(arg)
    except UsageError as exc:
        return exc


def _join(args: argparse.Namespace) -> None:
    import jax

    kwargs = {
        "initialization_timeout": args.init_timeout,
        "heartbeat_timeout_seconds": args.heartbeat_timeout,
        "shutdown_timeout_seconds": args.shutdown_timeout,
    }
    if args.coordinator is not None:
        kwargs.update(
            coordinator_address=args.coordinator,
            coordinator_bind_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    jax.distributed.initialize(**kwargs)


class UnsavedError(ValueError):
    """A rank's value cannot be written to --out."""


def _save(value: Any, out: Path, rank: int) -> None:
    """Writes ``value`` to ``out/rank<k>.pkl``; ``UnsavedError`` naming the part that cannot be pickled."""
    bad = _check.unpicklable(value, "the value")
    if bad is not None:
        raise UnsavedError(
            f"rank {rank} returned a {type(value).__qualname__}, which cannot be written to --out: "
            f"{bad.part} (a {bad.kind}) cannot be pickled ({type(bad.error).__name__}: {bad.error}); "
            "return plain data instead (numbers, numpy arrays, dicts and lists of them)"
        )
    with open(out / f"rank{rank}.pkl", "wb") as f:
        cloudpickle.dump(value, f)


def worker_main(args: argparse.Namespace) -> int:
    """``mgkit worker``: checks everything it can (one line and exit code 2 for a usage error),
    joins jax.distributed, runs the function or script, and writes its value to --out."""
    try:
        job = _prepare(args)
    except UsageError as exc:
        for line in str(exc).splitlines():  # a line for each thing that is wrong
            print(f"mgkit worker: error: {line}", file=sys.stderr, flush=True)
        return 2
    import jax

    t0 = time.perf_counter()
    _join(args)
    rank, size = jax.process_index(), jax.process_count()
    print(
        f"mgkit worker: rank {rank} of {size}, devices {[d.id for d in jax.local_devices()]} of "
        f"{jax.device_count()}, joined in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    status = 0
    with watchdog(args.stall_after) if args.stall_after else _nothing():
        try:
            if job.fn is None:
                runpy.run_path(job.where, run_name="__main__")
                value = None
            else:
                value = job.fn(rank, job.shared, None)
            if job.out is not None:
                _save(value, job.out, rank)
            print(f"mgkit worker: rank {rank} done in {time.perf_counter() - t0:.1f} s", flush=True)
        except UnsavedError as exc:
            print(f"mgkit worker: error: {exc}", file=sys.stderr, flush=True)
            status = 1
        except Exception:  # noqa: BLE001 - printed with the rank, and the exit code says it
            print(f"mgkit worker: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            status = 1
    jax.distributed.shutdown()
    return status


class _nothing:  # noqa: N801 - a context manager that does nothing
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def add_commands(sub: Any, positive_int: Any) -> None:
    """Adds ``worker`` and ``run`` to the ``mgkit`` command line."""
    p = sub.add_parser(
        "worker",
        help="run a rank function under srun/mpirun (or any launcher): joins jax.distributed, then calls it",
        description="Joins jax.distributed (coordinator, process count and id from the flags, else "
        "from JAX's cluster detection: Slurm, Open MPI), then calls function(rank, shared, private) "
        "with rank = jax.process_index(), or runs a script as __main__.",
    )
    p.add_argument("target", help="pkg.module:function, script.py:function, or script.py")
    p.add_argument("--coordinator", metavar="HOST:PORT", help="the coordinator (process 0's host)")
    p.add_argument("--num-processes", type=positive_int, help="processes in the job")
    p.add_argument("--process-id", type=int, help="this process's id, from 0")
    p.add_argument("--devices", type=_device_list, help="this process's devices, e.g. 0 or 0,1")
    p.add_argument("--shared", metavar="FILE", help="a pickle file whose object every rank gets as shared")
    p.add_argument("--out", metavar="DIR", help="write each rank's value to DIR/rank<k>.pkl")
    p.add_argument("--stall-after", type=float, help="warn with the stack after this many silent seconds")
    p.add_argument("--init-timeout", type=int, default=TIMEOUTS["init"], help="seconds to join (60)")
    p.add_argument("--heartbeat-timeout", type=int, default=TIMEOUTS["heartbeat"], help="seconds (10)")
    p.add_argument("--shutdown-timeout", type=int, default=TIMEOUTS["shutdown"], help="seconds (10)")
    p.set_defaults(func=worker_main)

    r = sub.add_parser(
        "run",
        help="run a script pinned to some devices (CUDA_VISIBLE_DEVICES, or simulated CPU devices)",
        description="Runs script.py with only the listed devices visible: those GPUs, or as many "
        "simulated CPU devices on a machine without one. Separate jobs on separate devices: "
        "mgkit run --devices 0 a.py & mgkit run --devices 1 b.py",
    )
    r.add_argument("--devices", type=_device_list, required=True, help="device numbers, e.g. 1 or 0,1")
    r.add_argument("script", help="the Python script")
    r.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    r.set_defaults(func=run_main)
