"""The engine under a cluster, behind one narrow interface: start ranks, run a function or a
cell on every rank, read their output as it comes, signal them, stop. ``Engines`` is that
interface; ``IPyParallel`` implements it on ipyparallel (a controller and engines, its launchers
for local processes, MPI, Slurm and PBS), so another engine can come later without the cluster
changing.
"""

from __future__ import annotations

import abc
import contextlib
import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import missing
from .._numbers import whole
from ..launching import gpu_ids

LAUNCHERS = {"local": "Local", "mpi": "MPI", "slurm": "Slurm", "pbs": "PBS"}  # ours -> ipyparallel's
LOOPBACK = "127.0.0.1"
# The controller's queues and schedulers as threads of its one process (not eight processes to
# start on a laptop's cores), and a heartbeat every 0.5 s: an engine counts as up at its first
# beat, so the default 3 s period made every start wait for it (a start: 9 s -> 5 s). An engine
# is given up after 30 missed beats (15 s; the default 10 misses of 3 s each are 30 s).
CONTROLLER_ARGS = ["--usethreads", "--HeartMonitor.period=500", "--HeartMonitor.max_heartmonitor_misses=30"]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def require_ipyparallel(where: str) -> Any:
    """The ipyparallel module, or an ImportError saying how to install it."""
    try:
        import ipyparallel
    except ImportError as e:
        instead = "mg.launch runs one-off processes without it."
        raise missing(
            where, "runs its ranks on", "ipyparallel", "pip install 'mgkit[cluster]'", instead
        ) from e
    return ipyparallel


class Pending(abc.ABC):
    """Work sent to every rank, not yet all back."""

    @abc.abstractmethod
    def done(self) -> list[bool]:
        """Per rank: has it finished?"""

    @abc.abstractmethod
    def wait(self, timeout: float) -> bool:
        """Waits (at most ``timeout`` s) until every rank has finished; returns whether they have."""

    @abc.abstractmethod
    def output(self) -> list[str]:
        """Per rank: everything it printed so far (stdout, then stderr)."""

    @abc.abstractmethod
    def data(self, rank: int) -> dict:
        """What the rank published while it ran (a dict of its messages, taken by the reader)."""

    @abc.abstractmethod
    def settle(self, timeout: float) -> None:
        """Waits (at most ``timeout`` s) until everything the ranks sent before their replies is in."""

    @abc.abstractmethod
    def result(self, rank: int) -> tuple[str, Any]:
        """A finished rank's ("ok", value) or ("error", facts: type, message, traceback, exception)."""


class Engines(abc.ABC):
    """What a cluster needs of the engine it runs on."""

    @abc.abstractmethod
    def start(self, timeout: float) -> int:
        """Starts (or connects to) the engines; returns how many there are."""

    @abc.abstractmethod
    def apply(self, fn: Callable, per_rank: Sequence[tuple], wrapped: bool = True) -> Pending:
        """Runs ``fn(*per_rank[r])`` on rank r, on every rank at once (``wrapped``: ``fn``
        returns ("ok", value) or ("error", facts) itself)."""

    @abc.abstractmethod
    def execute(self, code: str) -> Pending:
        """Runs ``code`` in every rank's own namespace (names persist for the next call)."""

    @abc.abstractmethod
    def signal(self, ranks: Sequence[int], signum: int) -> None:
        """Sends ``signum`` to these ranks' processes."""

    @abc.abstractmethod
    def published(self, prefix: str, pending: Sequence[Pending] = ()) -> list[tuple[str, Any]]:
        """(key, value) of every message the ranks published under a key starting with
        ``prefix`` since the last look, taken: under ``pending``'s requests, or under any other
        (a rank publishes under whatever request it last ran; the key says whose it is)."""

    @abc.abstractmethod
    def ended(self, pid: int) -> str:
        """How the rank process ``pid`` it started ended: "signal SIGKILL", "exit code 1" or
        "exited" (where it cannot tell)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stops what it started (engines, controller) and disconnects."""

    @property
    @abc.abstractmethod
    def connection_file(self) -> str | None:
        """The file a client connects with (None where not known)."""


class _IppPending(Pending):
    """One ipyparallel AsyncResult per rank."""

    def __init__(self, results: list, wrapped: bool, cell: bool = False):
        self.results, self.wrapped, self.cell = results, wrapped, cell

    def done(self) -> list[bool]:
        return [ar.ready() for ar in self.results]

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for ar in self.results:
            if not ar.ready():
                ar.wait(max(deadline - time.monotonic(), 0.0))
        return all(self.done())

    def output(self) -> list[str]:
        return [(ar.stdout or "") + (ar.stderr or "") for ar in self.results]

    def data(self, rank: int) -> dict:
        return self.results[rank].data

    def settle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for ar in self.results:  # the reply comes first; what was published before it, then idle
            ar.wait_for_output(max(deadline - time.monotonic(), 0.0))

    def result(self, rank: int) -> tuple[str, Any]:
        try:
            value = self.results[rank].get(timeout=0)
        except Exception as exc:  # noqa: BLE001 - ipyparallel's RemoteError: the rank raised
            lines = getattr(exc, "traceback", None)
            text = "\n".join(lines) if isinstance(lines, list) else str(lines or "")
            text = _ANSI.sub("", text)  # IPython colours its tracebacks: plain text here
            return "error", {
                "type": getattr(exc, "ename", None) or type(exc).__name__,
                "message": str(getattr(exc, "evalue", None) or exc),
                "traceback": text,
                "exception": None,
            }
        if self.cell:  # a cell's reply: what it printed is its output, it has no value
            return "ok", None
        return value if self.wrapped else ("ok", value)


class IPyParallel(Engines):
    """Engines on ipyparallel: started by its ``Cluster`` (controller and engines on 127.0.0.1 for
    the local launcher, in a profile folder of the cluster's own, its connection files readable by
    their owner only), or connected to through a client connection file."""

    def __init__(
        self, engines: int | None, launcher: str, env: dict[str, str], connection_file: str | None = None
    ):
        self.n, self.launcher, self.env, self._file = engines, launcher, env, connection_file
        self.cluster: Any = None
        self.client: Any = None
        self.view: Any = None
        self._profile: tempfile.TemporaryDirectory | None = None

    @property
    def folder(self) -> str | None:
        """The profile folder it made (connection files, logs), or None."""
        return None if self._profile is None else self._profile.name

    @property
    def connection_file(self) -> str | None:
        if self._file is not None:
            return self._file
        if self.cluster is None or self.cluster.controller is None:
            return None
        return self.cluster.controller.connection_files.get("client")

    def start(self, timeout: float) -> int:
        ipp = require_ipyparallel("mg.Cluster")
        if self._file is not None:  # someone else's ipcluster: connect only
            self.client = ipp.Client(self._file, timeout=timeout)
            self.client.wait_for_engines(timeout=timeout, block=True, interactive=False)
        else:
            self._profile = tempfile.TemporaryDirectory(prefix="mgkit-cluster-")
            os.chmod(self._profile.name, 0o700)
            self.cluster = ipp.Cluster(
                n=self.n,
                profile_dir=self._profile.name,
                controller_ip=LOOPBACK,
                controller_location=LOOPBACK,
                engine_launcher_class=LAUNCHERS[self.launcher],
                engine_timeout=int(timeout),
                delay=0.0,
                log_level=40,
                shutdown_atexit=True,
                controller_args=CONTROLLER_ARGS,
            )
            self.cluster.engine_launcher_class  # noqa: B018 - resolved now: a bad name fails here
            self.cluster.start_controller_sync()
            self.cluster.start_engines_sync(n=self.n, environment=dict(self.env))
            self.client = self.cluster.connect_client_sync()
            self.client.wait_for_engines(self.n, timeout=timeout, block=True, interactive=False)
        self.view = self.client[:]
        self.view.use_cloudpickle().get()
        return len(self.client.ids)

    def _engine(self, rank: int) -> Any:
        return self.client[sorted(self.client.ids)[rank]]

    def apply(self, fn: Callable, per_rank: Sequence[tuple], wrapped: bool = True) -> Pending:
        return _IppPending(
            [self._engine(r).apply_async(fn, *args) for r, args in enumerate(per_rank)], wrapped
        )

    def execute(self, code: str) -> Pending:
        n = len(self.client.ids)
        return _IppPending(
            [self._engine(r).execute(code, block=False, silent=False) for r in range(n)], False, cell=True
        )

    def started(self) -> list[int]:
        """The pids of the processes on this machine it started (the controller, and the
        launchers of the engines)."""
        pids = []
        cluster = self.cluster
        for launcher in [getattr(cluster, "controller", None), *getattr(cluster, "engines", {}).values()]:
            process = getattr(launcher, "process", None)
            if process is not None:
                pids.append(process.pid)
        return pids

    def published(self, prefix: str, pending: Sequence[Pending] = ()) -> list[tuple[str, Any]]:
        if self.client is None:
            return []
        out = []
        boxes = [p.data(r) for p in pending for r in range(len(p.results))]  # type: ignore[attr-defined]
        boxes += [md.get("data") for md in list(self.client.metadata.values()) if isinstance(md, dict)]
        for data in boxes:
            if not isinstance(data, dict) or not data:
                continue
            for key in [k for k in list(data) if isinstance(k, str) and k.startswith(prefix)]:
                value = data.pop(key, None)
                if value is not None:
                    out.append((key, value))
        return out

    def signal(self, ranks: Sequence[int], signum: int) -> None:
        ids = sorted(self.client.ids)
        with contextlib.suppress(Exception):
            self.client.send_signal(signum, targets=[ids[r] for r in ranks], block=True)

    def ended(self, pid: int, wait: float = 3.0) -> str:
        """ "signal SIGKILL", "exit code 1" or "exited", from the process's exit status: reaped
        here where it is still a zombie, else as ipyparallel's launcher reaped it (its waiting
        thread, given up to ``wait`` seconds: two waits at once could lose the status)."""
        with contextlib.suppress(ChildProcessError, OSError):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                return _status_text(os.waitstatus_to_exitcode(status))
        for waiter in [t for t in threading.enumerate() if t.name == f"wait(pid={pid})"]:
            waiter.join(wait)
        for engine_set in getattr(self.cluster, "engines", {}).values():
            for child in getattr(engine_set, "launchers", {}).values():
                process = getattr(child, "process", None)
                if getattr(process, "pid", None) != pid:
                    continue
                code = (getattr(child, "stop_data", None) or {}).get("exit_code")
                if code is None:
                    with contextlib.suppress(Exception):  # psutil keeps the status its wait read
                        code = process.wait(timeout=0)
                if code is not None:
                    return _status_text(int(code))
        return "exited"

    def stop(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
            self.client = None
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.stop_cluster_sync()
            self.cluster = None
        if self._profile is not None:
            with contextlib.suppress(OSError):
                self._profile.cleanup()
            self._profile = None


def launcher_script(engines: Any, launcher: Any, devices_per_engine: Any = 1) -> str:
    """The command (``mpi``) or batch script (``slurm``, ``pbs``) ipyparallel's engine launcher
    would run or submit for ``engines`` engines, made without running or submitting anything
    (``Cluster.script``; its arguments checked here)."""
    n = whole(engines, "engines", "Cluster.script", lo=1, example=16)
    whole(devices_per_engine, "devices_per_engine", "Cluster.script", lo=1, example=1)
    if launcher not in LAUNCHERS or launcher == "local":
        raise ValueError(
            f"Cluster.script: launcher={launcher!r}; scripts are for 'mpi', 'slurm' or 'pbs' "
            "(the local launcher runs processes on this machine)"
        )
    require_ipyparallel("mg.Cluster.script")
    from ipyparallel.cluster import launcher as launchers

    with tempfile.TemporaryDirectory(prefix="mgkit-script-") as folder:
        kinds = {
            "mpi": launchers.MPIEngineSetLauncher,
            "slurm": launchers.SlurmEngineSetLauncher,
            "pbs": launchers.PBSEngineSetLauncher,
        }
        made = kinds[launcher](work_dir=folder, profile_dir=folder, cluster_id="mgkit")
        made.n = n
        if launcher == "mpi":
            import shlex

            return shlex.join(made.find_args())
        made.write_batch_script(n)
        with open(made.batch_file) as f:
            text = f.read()
    return text


def engine_env() -> dict[str, str]:
    """What every engine needs to import this mgkit (and nothing that picks its devices)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def check_gpus(engines: int, per: int, where: str) -> None:
    """On a machine with GPUs, ``engines`` local engines of ``per`` GPUs each must fit on them."""
    gpus = gpu_ids()
    if gpus and engines * per > len(gpus):
        fit = max(len(gpus) // engines, 1)
        raise ValueError(
            f"{where}: engines={engines} x devices_per_engine={per} needs {engines * per} GPUs, and this "
            f"machine has {len(gpus)} (CUDA ids {', '.join(gpus)}); use devices_per_engine={fit} or "
            f"engines={max(len(gpus) // per, 1)}"
        )


def device_groups(hosts: Sequence[str], per: int) -> list[tuple[str, Any]]:
    """Per rank: ("cpu", how many simulated devices) on a machine without GPUs, else ("gpu", its
    CUDA ids by its place on its host: the k-th engine of a host takes the k-th ``per`` of the
    GPUs this machine's engines may own (``CUDA_VISIBLE_DEVICES`` here, else all), or ids
    k*per .. k*per + per - 1 where a host has more)."""
    pool = gpu_ids()
    if not pool:
        return [("cpu", per)] * len(hosts)
    seen: dict[str, int] = {}
    out = []
    for host in hosts:
        k = seen.get(host, 0)
        seen[host] = k + 1
        ids = pool[k * per : (k + 1) * per]
        out.append(("gpu", ids if len(ids) == per else [str(i) for i in range(k * per, (k + 1) * per)]))
    return out


def _status_text(code: int) -> str:
    """An exit code in words: "signal SIGKILL" (negative: the signal) or "exit code 1"."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def family(pids: Sequence[int]) -> list:
    """These processes and their descendants (an engine's nanny too), as psutil processes."""
    import psutil

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            procs += [proc, *proc.children(recursive=True)]
    return procs


def reap(procs: Sequence[Any], wait: float = 5.0) -> None:
    """Waits (at most ``wait`` seconds) for the processes a cluster started (``family``) to end
    after it stopped them, and kills those still there: ``close()`` returns with none left.

    An engine's nanny (ipyparallel's watcher of its engine) outlives it by 3 s and more, telling
    the controller, stopped too, that its engine is gone: it is stopped once its engine is."""
    import psutil

    nannies = [p for p in procs if _is_nanny(p)]
    _, alive = psutil.wait_procs([p for p in procs if p not in nannies], timeout=wait)
    for proc in [*alive, *nannies]:  # a nanny holds nothing (its SIGTERM handler tells the controller)
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs([*alive, *nannies], timeout=1.0)


def _is_nanny(proc: Any) -> bool:
    import psutil

    try:
        return "ipyparallel.engine.nanny" in proc.cmdline()
    except psutil.Error:  # gone already
        return False


def connection_path(connection_file: Any, where: str) -> str:
    """``connection_file`` (an ipcluster's ``ipcontroller-client.json``) as a path to a file that
    exists and can be read, ``~`` expanded; else a clear error."""
    path = os.fspath(connection_file) if isinstance(connection_file, str | os.PathLike) else None
    if path is None:
        raise TypeError(
            f"{where}: connection_file must be a path, got {type(connection_file).__name__} "
            f"{connection_file!r}; e.g. '~/.ipython/profile_default/security/ipcontroller-client.json'"
        )
    path = os.path.expanduser(path)
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        why = "does not exist" if not os.path.exists(path) else "cannot be read"
        raise FileNotFoundError(
            f"{where}({connection_file!r}): the connection file {why}; it is written by "
            "`ipcluster start` in the profile's security folder (ipcontroller-client.json)"
        )
    return path
