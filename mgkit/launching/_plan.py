"""A launch's plan: which devices each rank owns, its environment, and the pickled frames it is
sent, all checked before any process starts (every bad argument gets its own clear error)."""

from __future__ import annotations

import ipaddress
import os
import pickle
import re
import socket
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import jax

from .._devices import backend_started
from .._numbers import real, whole
from . import _check
from ._processes import stacks_path

# jax.distributed's heartbeat, initialisation and shutdown timeouts (JAX's: 100, 300, 300 s), and
# how long a rank of a distributed launch may be silent (no mg.beat) before the watchdog stops the
# group: the collectives' timeout, which JAX does not let one set for gloo (its own is 30 min).
TIMEOUTS = {"heartbeat": 10, "init": 60, "shutdown": 10, "collectives": 300}  # seconds
_OWN_ENV = ("CUDA_VISIBLE_DEVICES", "JAX_NUM_CPU_DEVICES", "MGKIT_SIMULATE", "MGKIT_RANK", "MGKIT_NPROCS")


# ---------------------------------------------------------------- what runs where (checked first)


@dataclass
class Plan:
    """A launch, checked: what each rank gets and the limits it runs under."""

    nprocs: int
    platform: str  # "cpu" or "gpu"
    groups: list[list[str]]  # per rank: CUDA ids, or CPU device names
    envs: list[dict[str, str]]  # per rank: its whole environment
    frames: list[list[bytes]]  # per rank: header, fn, shared, private
    distributed: dict | None  # jax.distributed's address and timeouts; None when not distributed
    timeout: float | None  # seconds for the whole launch
    grace: float  # seconds between SIGTERM and SIGKILL
    stall_after: float | None  # seconds of silence that make a stall (None: learned)
    on_stall: str  # "raise" or "warn"

    @property
    def collectives(self) -> float | None:
        """The collectives' timeout of a distributed launch, in seconds (None when not distributed)."""
        return None if self.distributed is None else self.distributed["collectives"]


def _pool() -> tuple[str, list[str]]:
    """The devices ranks can own: the machine's GPUs (by CUDA id), else CPU devices (simulated:
    as many as the kernel has or the machine has cores, whichever is more). GPUs are counted
    without starting JAX in the kernel when it has not started yet (starting it would take
    most of every GPU's memory away from the ranks)."""
    gpus = gpu_ids()
    if gpus:
        return "gpu", gpus
    n = max(len(jax.devices("cpu")) if backend_started() else 1, os.cpu_count() or 1)
    return "cpu", [f"cpu{i}" for i in range(n)]


def gpu_ids() -> list[str]:
    """The GPUs ranks can own, by CUDA id (none on a machine without them); JAX is not started
    in the kernel to count them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    listed = None if visible is None else [v.strip() for v in visible.split(",") if v.strip()]
    if backend_started():
        count = sum(1 for d in jax.devices() if d.platform == "gpu")
    else:
        platforms = os.environ.get("JAX_PLATFORMS", "")
        if platforms and not any(p in platforms for p in ("cuda", "gpu", "rocm")):
            return []
        count = _nvidia_smi_count()
        if listed is not None:
            count = min(count, len(listed))
    if not count:
        return []
    if listed is not None and len(listed) >= count:
        return listed[:count]
    return [str(i) for i in range(count)]


def _nvidia_smi_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")) if out.returncode == 0 else 0


def _counts(nprocs: Any, private: Any, devices_per_process: Any) -> tuple[str, list[list[str]], int]:
    """The platform, each rank's devices and the number of ranks. GPUs are real: a launch that
    needs more than there are is refused. CPU devices are simulated, so any count works: a launch
    whose ranks' devices exceed the machine's cores is warned of (``CoresWarning``), never refused."""
    dpp = whole(
        devices_per_process,
        "devices_per_process",
        "mg.launch",
        lo=1,
        example=1,
        note="devices each rank owns",
    )
    platform, pool = _pool()
    if platform == "gpu" and len(pool) % dpp:
        fits = [d for d in range(1, len(pool) + 1) if len(pool) % d == 0]
        raise ValueError(
            f"devices_per_process={dpp} does not divide the {len(pool)} devices ranks can own "
            f"(GPU(s) {', '.join(pool)}); use one of {fits}"
        )
    _check_private(private)
    if nprocs is None:
        nprocs = len(private) if private is not None else max(1, len(pool) // dpp)
    nprocs = whole(nprocs, "nprocs", "mg.launch", lo=1, example=2, note="the number of processes")
    if platform == "gpu" and nprocs * dpp > len(pool):
        raise ValueError(
            f"nprocs={nprocs} with devices_per_process={dpp} needs {nprocs * dpp} GPUs, but there are "
            f"{len(pool)} (GPU(s) {', '.join(pool)}); use at most nprocs={len(pool) // dpp}"
        )
    if private is not None and len(private) != nprocs:
        raise ValueError(
            f"private has {len(private)} entries but there are {nprocs} ranks; give one entry per rank "
            f"(private[i] goes to rank i), or nprocs={len(private)}"
        )
    if platform == "cpu":
        _warn_past_cores(nprocs, dpp)
        pool = [f"cpu{i}" for i in range(nprocs * dpp)]
    return platform, [pool[r * dpp : (r + 1) * dpp] for r in range(nprocs)], nprocs


def _check_private(private: Any) -> None:
    if private is not None and not isinstance(private, list | tuple):
        raise TypeError(
            f"private must be a list with one entry per rank, got {type(private).__name__} "
            f"{_short(private)}; e.g. private=[{{'l2': 1e-3}}, {{'l2': 1e-2}}] for two ranks"
        )
    if private is not None and not private:
        raise ValueError(
            f"private={_short(private)} has no entries, so there is no rank to run; give one entry per "
            "rank (private[i] goes to rank i), e.g. private=[{'l2': 1e-3}, {'l2': 1e-2}] for two ranks, "
            "or private=None"
        )


class CoresWarning(UserWarning):
    """The ranks of a launch simulate more CPU devices than the machine has cores."""


def _warn_past_cores(nprocs: int, dpp: int) -> None:
    cores = os.cpu_count() or 1
    if nprocs * dpp > cores:
        warnings.warn(
            f"mg.launch: nprocs={nprocs} with devices_per_process={dpp} simulates {nprocs * dpp} CPU "
            f"devices on {cores} core(s); they share the cores, so the ranks run slower than on as "
            "many real devices (the results are the same)",
            CoresWarning,
            stacklevel=5,  # the caller of mg.launch
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _env(
    extra: Any, platform: str, group: list[str], rank: int, config: dict | None, n: int
) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["MGKIT_RANK"], env["MGKIT_NPROCS"] = str(rank), str(n)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).split()
    if config is not None and not any(f.startswith("--xla_cpu_collective_timeout_seconds") for f in flags):
        flags.append(f"--xla_cpu_collective_timeout_seconds={config['collectives']}")
    if platform == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(group)
        env.pop("MGKIT_SIMULATE", None)
        # a rank takes its GPU's memory as it needs it: the kernel's own JAX may hold part of it
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    else:
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_NUM_CPU_DEVICES"] = env["MGKIT_SIMULATE"] = str(len(group))
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    return env


def check_env(
    env: Any,
    who: str = "mg.launch",
    own: tuple[str, ...] = _OWN_ENV,
    fix: str = "from devices_per_process; remove it and choose devices with nprocs and devices_per_process",
) -> dict[str, str]:
    """``env`` checked: a dict of strings to strings setting none of the variables ``who``
    sets itself (``own``; ``fix`` says from what, and what to do instead)."""
    if env is None:
        return {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise TypeError(
            "env must be a dict of strings to strings (added to every rank's environment), got "
            f"{_short(env)}; "
            "e.g. env={'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.4'}"
        )
    taken = sorted(set(env) & set(own))
    if taken:
        raise ValueError(f"env sets {', '.join(taken)}, which {who} sets itself for each rank {fix}")
    return env


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ValueError(
                f"the coordinator port {port} on {host} is busy ({exc.strerror}); pass another, "
                f"e.g. coordinator='127.0.0.1:{_free_port()}', or leave coordinator=None for a free one"
            ) from None


def check_stall(stall_after: Any, on_stall: Any, where: str) -> tuple[float | None, str]:
    """``stall_after`` (seconds above 0, or None: learned) and ``on_stall`` ('raise' or 'warn'),
    checked."""
    if stall_after is not None:
        stall_after = real(stall_after, "stall_after", where, lo=0, example=30)
        if stall_after <= 0:
            raise ValueError(
                f"{where}: stall_after must be above 0 seconds (or None to learn it), got {stall_after}"
            )
    if on_stall not in ("raise", "warn"):
        raise ValueError(f"{where}: on_stall must be 'raise' or 'warn', got {_short(on_stall)}")
    return stall_after, on_stall


def coordinator_config(coordinator: Any, nprocs: int, timeouts: Any) -> dict:
    if nprocs < 2:
        raise ValueError(
            "distributed=True needs at least 2 processes (jax.distributed joins several processes), "
            "but there is 1; use nprocs=2 or more, or distributed=False for one process"
        )
    if coordinator is None:
        host, port = "127.0.0.1", _free_port()
    else:
        if isinstance(coordinator, int) and not isinstance(coordinator, bool):
            host, port_text = "127.0.0.1", str(coordinator)
        elif isinstance(coordinator, str) and coordinator.rpartition(":")[0]:
            host, _, port_text = coordinator.rpartition(":")
            host = host.strip("[]")
        else:
            raise ValueError(
                f"coordinator must be 'host:port' or a port number, got {_short(coordinator)}; "
                "e.g. coordinator='127.0.0.1:12355', or None for a free port on 127.0.0.1"
            )
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ValueError(
                f"coordinator port {port_text!r} (in {coordinator!r}) is not a port number from 1 to 65535; "
                "e.g. coordinator='127.0.0.1:12355'"
            )
        port = int(port_text)
        if _loopback(host) or host in ("0.0.0.0", "::"):
            _check_port_free("127.0.0.1" if host == "localhost" else host, port)
    limits = dict(TIMEOUTS)
    if timeouts is not None:
        if not isinstance(timeouts, dict):
            raise TypeError(f"timeouts must be a dict like {TIMEOUTS}, got {_short(timeouts)}")
        unknown = sorted(set(timeouts) - set(TIMEOUTS))
        if unknown:
            raise ValueError(
                f"unknown timeout(s) {unknown}; the timeouts are {sorted(TIMEOUTS)} (seconds), "
                f"defaults {TIMEOUTS}"
            )
        for key, value in timeouts.items():
            limits[key] = max(1, round(real(value, f"timeouts[{key!r}]", "mg.launch", lo=0, example=10)))
    address = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    return {
        "coordinator": address,
        "bind": address,
        "loopback": _loopback(host),
        "num_processes": nprocs,
        **limits,
    }


def plan(
    fn: Any,
    *,
    nprocs: Any,
    shared: Any,
    private: Any,
    devices_per_process: Any,
    distributed: Any,
    timeout: Any,
    grace: Any,
    env: Any,
    coordinator: Any,
    timeouts: Any,
    stall_after: Any,
    on_stall: Any,
    stacks_dir: str,
) -> Plan:
    """Checks every argument and pickles what goes to the ranks, before any process starts."""
    _check.check_signature(fn)
    if not isinstance(distributed, bool):
        raise TypeError(f"distributed must be True or False, got {_short(distributed)}")
    if timeout is not None:
        timeout = real(
            timeout, "timeout", "mg.launch", lo=0, example=600, note="seconds for the whole launch"
        )
        if timeout <= 0:
            raise ValueError(f"timeout must be above 0 seconds (or None for no limit), got {timeout}")
    grace = real(grace, "grace", "mg.launch", lo=0, example=5.0, note="seconds between SIGTERM and SIGKILL")
    stall_after, on_stall = check_stall(stall_after, on_stall, "mg.launch")
    extra = check_env(env)
    platform, groups, nprocs = _counts(nprocs, private, devices_per_process)
    if coordinator is not None and not distributed:
        raise ValueError(
            "coordinator= is the address of jax.distributed's coordinator: pass distributed=True too"
        )
    if timeouts is not None and not distributed:
        raise ValueError("timeouts= sets jax.distributed's timeouts: pass distributed=True too")
    config = coordinator_config(coordinator, nprocs, timeouts) if distributed else None
    fix = "Create it inside the function instead, or pass what it is made from."
    fn_bytes = _check.dumps(fn, getattr(fn, "__qualname__", "fn"), fix)
    shared_bytes = _check.dumps(shared, "shared", fix)
    private_bytes = [
        _check.dumps(None if private is None else private[r], f"private[{r}]", fix) for r in range(nprocs)
    ]
    frames, envs = [], []
    for r in range(nprocs):
        header = {
            "rank": r,
            "sys_path": [p for p in sys.path if p],
            "stacks": stacks_path(stacks_dir, r),
            "distributed": None if config is None else {**config, "process_id": r},
        }
        frames.append([pickle.dumps(header), fn_bytes, shared_bytes, private_bytes[r]])
        envs.append(_env(extra, platform, groups[r], r, config, nprocs))
    return Plan(nprocs, platform, groups, envs, frames, config, timeout, grace, stall_after, on_stall)
