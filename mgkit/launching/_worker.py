"""``mgkit worker`` and ``mgkit run``: the same rank code under a cluster's own launcher.

``mgkit worker pkg.module:function`` (or ``path/to/script.py[:function]``) joins
``jax.distributed`` (the coordinator, process count and id from flags, or else from JAX's own
cluster detection: Slurm, Open MPI) and calls ``function(rank, shared, private)`` with
``rank = jax.process_index()``, as ``mg.launch`` would; a script without a function runs as
``__main__`` once JAX is up. So a job scales out with ``srun`` or ``mpirun`` and no cluster
manager of mgkit's own.

``mgkit run --devices 1 script.py`` runs a script pinned to the listed devices (separate
jobs on separate GPUs): ``CUDA_VISIBLE_DEVICES`` on GPUs, as many simulated CPU
devices as listed on a machine without one.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pickle
import runpy
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from .._watchdog import watchdog
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


def _target(text: str) -> tuple[str, str | None, bool]:
    """('module or path', 'function' or None, is_path) for ``pkg.mod:fn``, ``a/b.py[:fn]``."""
    where, _, name = text.partition(":")
    if where.endswith(".py") or os.sep in where:
        if not Path(where).is_file():
            raise ValueError(f"mgkit worker: {where!r} is not a file; give pkg.module:function or script.py")
        return where, name or None, True
    if not name:
        raise ValueError(
            f"mgkit worker: {text!r} names a module but no function; give it as {text}:function "
            "(the function is called as function(rank, shared, private))"
        )
    return where, name, False


def _load(where: str, name: str | None, is_path: bool) -> Any:
    if is_path:
        namespace = runpy.run_path(where, run_name="__mgkit_worker__")
    else:
        sys.path.insert(0, os.getcwd())
        namespace = vars(importlib.import_module(where))
    if name not in namespace or not callable(namespace[name]):
        found = sorted(k for k, v in namespace.items() if callable(v) and not k.startswith("_"))[:10]
        raise ValueError(f"mgkit worker: {where} has no function {name!r}; its functions: {', '.join(found)}")
    return namespace[name]


def worker_main(args: argparse.Namespace) -> int:
    where, name, is_path = _target(args.target)
    if args.devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(args.devices)
        from .._devices import simulate

        simulate(len(args.devices))
    flags = (args.coordinator, args.num_processes, args.process_id)
    if any(f is not None for f in flags) and not all(f is not None for f in flags):
        raise ValueError(
            "mgkit worker: give --coordinator, --num-processes and --process-id together, or none of them "
            "(then JAX detects the cluster: Slurm, Open MPI)"
        )
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
    t0 = time.perf_counter()
    jax.distributed.initialize(**kwargs)
    rank, size = jax.process_index(), jax.process_count()
    print(
        f"mgkit worker: rank {rank} of {size}, devices {[d.id for d in jax.local_devices()]} of "
        f"{jax.device_count()}, joined in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    shared = None
    if args.shared is not None:
        with open(args.shared, "rb") as f:
            shared = pickle.load(f)
    status = 0
    with watchdog(args.stall_after) if args.stall_after else _nothing():
        try:
            if name is None:
                runpy.run_path(where, run_name="__main__")
                value = None
            else:
                value = _load(where, name, is_path)(rank, shared, None)
            if args.out is not None:
                out = Path(args.out)
                out.mkdir(parents=True, exist_ok=True)
                with open(out / f"rank{rank}.pkl", "wb") as f:
                    pickle.dump(value, f)
            print(f"mgkit worker: rank {rank} done in {time.perf_counter() - t0:.1f} s", flush=True)
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
