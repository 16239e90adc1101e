"""``mg.Cluster``: warm ranks on one or several hosts, driven from one notebook.

Engines start once (ipyparallel's, behind ``_engines.Engines``); each chooses its devices and
joins the cluster's ``jax.distributed`` group once (``_rank.setup``). Then ``c.run(fn, shared,
private)`` keeps ``mg.launch``'s contract on those warm ranks, and ``%%mgkit_all`` runs a cell
in every rank's own namespace. Output comes back under the cell as it arrives, prefixed with the
rank; an exception in a rank is one ``mg.LaunchError`` naming every rank's fate; a rank that
dies ends the call within seconds, the others stopped out of their collectives, and
``c.restart()`` brings fresh engines and forms the group again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

from .._numbers import real, whole
from .._table import html_table, text_table
from .._watchdog import StallWarning
from ..launching import (
    Failure,
    LaunchError,
    RankInfo,
    check_env,
    check_signature,
    check_stall,
    coordinator_config,
    dumps,
    launch_error,
    stacks_text,
    steps_text,
)
from . import _guard, _rank
from ._engines import (
    LAUNCHERS,
    IPyParallel,
    Pending,
    check_gpus,
    connection_path,
    device_groups,
    engine_env,
    family,
    launcher_script,
    reap,
)
from ._report import HEADERS, Raise, interrupted, is_preempted, preempted_error, raised_error, rows, title
from ._stream import BATCH, RATE, SIZE, Streams
from ._watch import Watch, stacks

cloudpickle.register_pickle_by_value(_rank)  # engines must not import mgkit (and jax) to unpickle it

_WHERE = "mg.Cluster"
_OWN_ENV = ("CUDA_VISIBLE_DEVICES", "JAX_NUM_CPU_DEVICES", "MGKIT_SIMULATE", "JAX_PLATFORMS", "MGKIT_RANK")
POLL = 0.05  # seconds between two looks at the ranks while a call runs
INTERRUPT_WAIT = 2.0  # seconds the ranks have to stop after Ctrl-C
PEER_WAIT = 1.0  # seconds the other ranks have to finish after one raised, before they are stopped
_CURRENT: list[Cluster] = []  # the cluster %%mgkit_all runs on: the newest one still open


def current() -> Cluster | None:
    """The newest cluster still open (the one ``%%mgkit_all`` runs on), or None."""
    while _CURRENT and _CURRENT[-1].closed:
        _CURRENT.pop()
    return _CURRENT[-1] if _CURRENT else None


class Cluster:
    """Warm ranks, one per engine, each with its devices, in one ``jax.distributed`` group.

    Args:
      engines: how many engines (ranks) to start, 1 or more.
      devices_per_engine: devices each rank owns: simulated CPU devices on a machine without
        GPUs, else GPUs (``CUDA_VISIBLE_DEVICES`` per engine, by its place on its host).
      launcher: ``"local"`` (processes on this machine, everything on 127.0.0.1), or ipyparallel's
        ``"mpi"``, ``"slurm"``, ``"pbs"`` (engines started under an allocation or submitted as a
        job; ``Cluster.script`` shows what would run).
      distributed: join the ranks in one ``jax.distributed`` group (with 2 or more engines):
        ``mg.context_map()`` inside the ranks then names every device of the cluster.
      timeout: seconds to wait for the engines to start and join, at most.
      timeouts: jax.distributed's timeouts in seconds (``heartbeat``, ``init``, ``shutdown``,
        ``collectives``), as ``mg.launch`` takes them.
      env: more environment variables for the engines (strings to strings).
      stream: each rank sends its ledger entries to the kernel's ledger in batches (at most 2
        messages a second, as often as the dashboard's panels refresh; a rank holds at most
        100,000 entries meanwhile and counts more as dropped, never waiting), its contexts named
        by rank (``r1/dev2``): the dashboard's transfers and throughput panels show every rank.
        Its last heartbeat (``mg.beat``) and its devices' memory readings go with the batches
        (``mg.Dashboard(cluster=c)`` shows them). ``c.stream(False)`` stops it.
      stall_after: seconds without a heartbeat (``mg.beat``; a Trainer beats every step) after
        which a rank in a fit has stalled; None: learned as ``mg.launch`` learns it (5 times its
        slowest step, at least 10 s). The beats come with the streamed batches.
      on_stall: ``"warn"``: a ``StallWarning`` with every rank's Python stacks, the call goes on;
        ``"raise"``: the call ends in a ``LaunchError`` with them, its ranks stopped.

    >>> c = mg.Cluster(engines=2, devices_per_engine=2)   # doctest: +SKIP
    >>> c.run(lambda rank, shared, private: rank)          # doctest: +SKIP
    [0, 1]
    """

    def __init__(
        self,
        engines: int = 2,
        devices_per_engine: int = 1,
        launcher: str = "local",
        *,
        distributed: bool = True,
        timeout: float = 120.0,
        timeouts: dict | None = None,
        env: dict[str, str] | None = None,
        stream: bool = True,
        stall_after: float | None = None,
        on_stall: str = "warn",
        _file: str | None = None,
    ):
        self.engines = whole(engines, "engines", _WHERE, lo=1, example=2, note="ranks to start")
        self.devices_per_engine = whole(
            devices_per_engine, "devices_per_engine", _WHERE, lo=1, example=2, note="devices each rank owns"
        )
        if launcher not in LAUNCHERS:
            raise ValueError(
                f"{_WHERE}: launcher={launcher!r} is not one mgkit knows; use one of "
                f"{', '.join(map(repr, LAUNCHERS))} (ipyparallel's launchers), or connect to a running "
                "ipcluster with mg.Cluster.connect('ipcontroller-client.json')"
            )
        if not isinstance(distributed, bool):
            raise TypeError(f"{_WHERE}: distributed must be True or False, got {distributed!r}")
        if not isinstance(stream, bool):
            raise TypeError(f"{_WHERE}: stream must be True or False, got {stream!r}")
        self.streaming = stream
        self.stall_after, self.on_stall = check_stall(stall_after, on_stall, _WHERE)
        self._collectives: float | None = None  # the group's collectives timeout, in seconds
        self.launcher, self.distributed = launcher, distributed
        self.timeout = real(timeout, "timeout", _WHERE, lo=0, above=True, example=120, note="seconds")
        self._timeouts = timeouts
        self._env = check_env(env, _WHERE, _OWN_ENV, "from devices_per_engine; remove it")
        self._file = _file
        if launcher == "local" and _file is None:
            check_gpus(self.engines, self.devices_per_engine, _WHERE)
        self.closed = False
        self.lost: str | None = None  # why the cluster can run nothing until c.restart()
        self.ranks: tuple[RankInfo, ...] = ()
        self.hosts: tuple[str, ...] = ()
        self.calls = 0
        self._sent = 0  # calls announced to the ranks (``_begin``)
        self.start_seconds = 0.0
        self._engines: IPyParallel | None = None
        self._guard: Any = None  # the process that stops the engines if the kernel dies
        self._start()
        _CURRENT.append(self)

    @classmethod
    def connect(
        cls,
        connection_file: str | os.PathLike,
        devices_per_engine: int = 1,
        *,
        distributed: bool = True,
        timeout: float = 60.0,
    ) -> Cluster:
        """A cluster on an ipcluster someone already started: ``connection_file`` is its client
        connection file (``ipcontroller-client.json``). Its engines are set up as a started
        cluster's are; ``close()`` disconnects and leaves them running."""
        path = connection_path(connection_file, "mg.Cluster.connect")
        return cls(1, devices_per_engine, distributed=distributed, timeout=timeout, _file=path)

    # -- starting --------------------------------------------------------------------------

    def _start(self) -> None:
        t0 = time.perf_counter()
        self.ranks, self.hosts = (), ()
        engines = IPyParallel(
            None if self._file else self.engines, self.launcher, {**self._env, **engine_env()}, self._file
        )
        try:
            n = engines.start(self.timeout)
            self._engines = engines
            if self._file is not None:
                self.engines = n
            self._protect()
            self._setup()
        except BaseException as exc:
            engines.stop()
            self._engines = None
            if isinstance(exc, LaunchError | KeyboardInterrupt):
                raise
            raise RuntimeError(
                f"{_WHERE}: the {self.launcher} engines did not start: {type(exc).__name__}: {exc}. "
                f"Nothing was left running; check the launcher's settings, or raise timeout= "
                f"(now {self.timeout:g} s)"
            ) from exc
        self.start_seconds = time.perf_counter() - t0

    def _protect(self) -> None:
        """The connection files readable by their owner only."""
        path = self._engines.connection_file if self._engines is not None else None
        if path and self._file is None:
            folder = os.path.dirname(path)
            for name in os.listdir(folder):
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(folder, name), 0o600)

    def _setup(self) -> None:
        """Each engine's devices, then the jax.distributed group, once."""
        n = self.engines
        infos = self._wait(self._engines.apply(_rank.info, [()] * n, wrapped=False), "start", quiet=True)
        hosts = [i["host"] for i in infos]
        if any(i["jax"] for i in infos):
            raise RuntimeError(
                f"{_WHERE}: jax is already imported in some engines, so their devices cannot be chosen "
                "any more; restart those engines (ipcluster stop/start) or start a cluster with mg.Cluster"
            )
        groups = device_groups(hosts, self.devices_per_engine)
        config = None
        if self.distributed and n > 1:
            port = self._wait(self._engines.apply(_rank.free_port, [()] * n, wrapped=False), "start", True)[0]
            host = "127.0.0.1" if self.launcher == "local" and self._file is None else hosts[0]
            config = coordinator_config(f"{host}:{port}", n, self._timeouts)
        per_rank = [
            (
                {
                    "rank": r,
                    "ranks": n,
                    "platform": groups[r][0],
                    "devices": groups[r][1],
                    "distributed": config,
                    "collectives": None if config is None else config["collectives"],
                    "sys_path": [p for p in sys.path if p],
                },
            )
            for r in range(n)
        ]
        ready = self._wait(self._engines.apply(_rank.setup, per_rank, wrapped=False), "start", quiet=True)
        self._collectives = None if config is None else config["collectives"]
        self.hosts = tuple(hosts)
        self.streams = Streams(self._engines, n)
        if self.streaming:
            self._streaming(True)
        self.ranks = tuple(
            RankInfo(r, i["pid"], tuple(i["devices"]), "ready", ready_seconds=i["ready"], started=time.time())
            for r, i in enumerate(ready)
        )
        self.streams.infos = self.ranks  # each rank's last beat, as its messages bring it
        if self._file is None:  # what it started stops with the kernel, however the kernel ends
            local = [r.pid for r in self.ranks] if self.launcher == "local" else []
            pids = [*self._engines.started(), *local]
            self._guard = _guard.start(os.getpid(), pids, self._engines.folder)

    # -- running -----------------------------------------------------------------------------

    def _check_usable(self, where: str) -> None:
        if self.closed:
            raise RuntimeError(f"{where}: the cluster is closed; make a new one with mg.Cluster(...)")
        if self.lost is not None:
            raise RuntimeError(f"{where}: {self.lost}; call c.restart() for fresh engines, then run again")

    def run(self, fn: Callable, shared: Any = None, private: Sequence[Any] | None = None) -> list:
        """Runs ``fn(rank, shared, private[rank])`` on every warm rank (``mg.launch``'s contract);
        returns each rank's value, in rank order. Output appears as it comes, prefixed
        ``[rank r@host]``; an exception in a rank raises one ``mg.LaunchError``."""
        self._check_usable("Cluster.run")
        check_signature(fn, "Cluster.run")
        if private is not None and (not isinstance(private, list | tuple) or len(private) != self.engines):
            raise ValueError(
                f"Cluster.run: private must be a list with one entry per rank ({self.engines}), got "
                f"{type(private).__name__} {private!r:.60}; private[i] goes to rank i"
            )
        fix = "Create it inside the function instead, or pass what it is made from."
        name = getattr(fn, "__qualname__", "fn")
        fn_bytes = dumps(fn, name, fix, "Cluster.run")
        shared_bytes = dumps(shared, "shared", fix, "Cluster.run")
        per_rank = [
            (fn_bytes, shared_bytes, dumps(None if private is None else private[r], f"private[{r}]", fix))
            for r in range(self.engines)
        ]
        self._begin()
        values = self._wait(self._engines.apply(_rank.call, per_rank), "run")
        return [cloudpickle.loads(v) for v in values]

    def run_cell(self, code: str) -> None:
        """Runs ``code`` in every rank's own namespace (``%%mgkit_all``): names it defines stay
        for the next cell. Output as ``run``'s; an exception raises one ``mg.LaunchError``."""
        self._check_usable("%%mgkit_all")
        if not isinstance(code, str):
            raise TypeError(f"Cluster.run_cell: code must be a str, got {type(code).__name__}")
        self._begin()
        self._wait(self._engines.execute(code), "run")

    def _begin(self) -> None:
        """Tells the ranks which call comes next (their fits key stop requests by it); queued
        before the call, not waited for."""
        self._sent += 1
        self._engines.apply(_rank.begin, [(self._sent,)] * self.engines, wrapped=False)

    def compilations(self) -> list[int]:
        """Each rank's XLA compilations so far (counted from the first time asked)."""
        self._check_usable("Cluster.compilations")
        return self._wait(self._engines.apply(_rank.compilations, [()] * self.engines, wrapped=False), "run")

    def _wait(self, pending: Pending, during: str, quiet: bool = False) -> list:
        """Waits for every rank, printing their output as it comes; the values, in rank order.
        A rank that raised ends it in one LaunchError once the others finish, or are stopped
        (``_after_a_raise``); a rank whose process is gone ends it at once, the others stopped;
        Ctrl-C interrupts every rank."""
        shown = [0] * self.engines
        streams = getattr(self, "streams", None) if during == "run" else None
        self.calls += during == "run"
        for info in self.ranks:
            info.state, info.reason = "running", ""  # (a reason from an earlier call is gone)
        watch = Watch(self.ranks, self.stall_after, self._collectives) if streams is not None else None
        raised = Raise(time.time())  # a rank that raised while others still ran
        try:
            while not all(pending.done()):
                if not quiet:
                    self._show(pending, shown)
                if streams is not None:
                    streams.collect(pending)
                    self._stalls(watch, pending, shown)
                gone = self._gone(pending)
                if gone is not None:
                    self._lose(gone, pending, shown)
                self._after_a_raise(pending, shown, raised)
                pending.wait(POLL)  # returns as the last rank finishes
        except KeyboardInterrupt:
            self._interrupt(pending, shown)
        pending.settle(1.0)  # what the ranks printed before their replies (it may come after them)
        if not quiet:
            self._show(pending, shown, final=True)
        if streams is not None:
            self._drain(streams, pending)
        outcomes = [pending.result(r) for r in range(self.engines)]
        return self._outcome(outcomes, raised)

    def stream(self, on: bool = True) -> None:
        """Starts (``True``) or stops sending each rank's ledger entries to the kernel's ledger."""
        self._check_usable("Cluster.stream")
        if not isinstance(on, bool):
            raise TypeError(f"Cluster.stream: on must be True or False, got {on!r}")
        self._streaming(on)
        self.streaming = on

    def _streaming(self, on: bool) -> None:
        per_rank = [(on, RATE, SIZE, BATCH)] * self.engines
        self._wait(self._engines.apply(_rank.stream, per_rank, wrapped=False), "start", quiet=True)

    def _drain(self, streams: Streams, pending: Pending) -> None:
        """What the ranks hold after a call (settled: its late batches are in), read at once."""
        streams.collect(pending)
        if self.streaming:  # what the ranks still hold, after every batch they were publishing
            rest = self._engines.apply(_rank.take, [(None,)] * self.engines, wrapped=False)
            while not rest.wait(POLL) and self._gone(rest) is None:
                pass
            rest.settle(1.0)
            streams.collect(pending, rest)
            for rank in range(self.engines):
                kind, value = rest.result(rank)
                if kind == "ok":
                    streams.record(rank, *value)

    def _show(self, pending: Pending, shown: list[int], final: bool = False) -> None:
        for r, text in enumerate(pending.output()):
            new = text[shown[r] :]
            if not final:
                new = new[: new.rfind("\n") + 1]  # whole lines while it runs
            if new:
                shown[r] += len(new)
                host = self.hosts[r] if r < len(self.hosts) else "?"
                for line in new.splitlines():
                    print(f"[rank {r}@{host}] {line}", flush=True)
                    if r < len(self.ranks):
                        self.ranks[r].tail.append(line)

    def _gone(self, pending: Pending) -> tuple[int, str] | None:
        """A rank whose process is gone (this machine's engines), with how it ended; but for a
        preempted rank that replied to ``pending`` (it exits after its reply, as told)."""
        if self.launcher != "local" or self._file is not None:
            return None
        import psutil

        done = pending.done()
        for info in self.ranks:
            if done[info.rank] and is_preempted(pending.result(info.rank)):
                continue
            try:
                proc = psutil.Process(info.pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                pass
            return info.rank, self._engines.ended(info.pid)
        return None

    def _lose(self, gone: tuple[int, str], pending: Pending, shown: list[int]) -> None:
        """A rank died: the others are stopped out of their collectives, the cluster marked lost,
        and one LaunchError raised."""
        rank, how = gone
        self._show(pending, shown, final=True)
        done = pending.done()
        for info in self.ranks:
            if info.rank == rank:
                info.state, info.reason = "lost", f"died ({how})"
            elif not done[info.rank]:
                info.state, info.reason = "stopped", "stopped: a peer died (its collectives could not finish)"
        self._kill_engines()
        self.lost = f"rank {rank} ({self.hosts[rank]}, pid {self.ranks[rank].pid}) died ({how})"
        head = f"{self.lost}; the other ranks were stopped, and the cluster needs c.restart()"
        raise launch_error(head, Failure("signal", f"died ({how})"), self.ranks, rank, [None] * self.engines)

    def _outcome(self, outcomes: list[tuple[str, Any]], raised: Raise) -> list:
        failed = [r for r, (kind, _) in enumerate(outcomes) if kind != "ok"]
        for r, (kind, _) in enumerate(outcomes):
            if r < len(self.ranks):
                self.ranks[r].state = "ready" if kind == "ok" else "raised" if kind == "error" else kind
        if not failed:
            return [value for _, value in outcomes]
        preempted = [r for r in failed if is_preempted(outcomes[r])]
        if preempted:
            self.lost, error = preempted_error(outcomes, preempted, self.ranks, self.hosts)
            raise error
        raise raised_error(outcomes, self.ranks, self.hosts, raised)

    def _after_a_raise(self, pending: Pending, shown: list[int], raised: Raise) -> None:
        """A rank raised while others still run, which may wait for it in a collective: after
        ``PEER_WAIT`` s they get SIGINT (a fit stops at its next step boundary; a second SIGINT
        half way through ``INTERRUPT_WAIT`` if needed). Those still running then wait where no
        signal reaches: their stacks are taken, their engines stopped (the cluster needs
        ``c.restart()``) and one LaunchError raised. ``raised`` is filled in here."""
        done = pending.done()
        if raised.rank is None:
            first = next((r for r, d in enumerate(done) if d and pending.result(r)[0] == "error"), None)
            if first is not None and not all(done) and not is_preempted(pending.result(first)):
                raised.rank, raised.at = first, time.monotonic()  # (a preemption stops every rank itself)
            return
        if raised.stopped or time.monotonic() - raised.at < PEER_WAIT:
            return
        raised.stopped = [r for r, finished in enumerate(done) if not finished]
        self._sigint(pending, again_at=INTERRUPT_WAIT / 2)
        if all(pending.done()):
            return
        taken = {r: text for r, text in self.stacks().items() if not pending.done()[r]}
        self._show(pending, shown, final=True)
        self._kill_engines()
        outcomes = [pending.result(r) if d else ("running", None) for r, d in enumerate(pending.done())]
        self.lost = f"rank {raised.rank} raised and the ranks waiting for it in a collective were stopped"
        raise raised_error(outcomes, self.ranks, self.hosts, raised, taken)

    def stacks(self) -> dict[int, str]:
        """Every rank's Python stacks now (all threads; faulthandler's, so also of a rank whose
        main thread waits in a collective), by rank."""
        self._check_usable("Cluster.stacks")
        return stacks(lambda ranks: self._signal(ranks, signal.SIGUSR1), self._engines, self.engines)

    def _stalls(self, watch: Watch, pending: Pending, shown: list[int]) -> None:
        """Ranks silent past their stall limit (``mg.launch``'s): with ``on_stall="warn"`` a
        ``StallWarning`` with every rank's stacks; with ``"raise"`` the call ends in a
        LaunchError with them, the ranks stopped (the cluster needs ``c.restart()``)."""
        found = watch.check(pending.done(), self.streams.fitting)
        if not found:
            return
        taken = self.stacks()
        for s in found:
            info = self.ranks[s.rank]
            last = "no step yet" if info.step is None else f"last completed step {info.step}"
            info.reason = f"stalled: no heartbeat for {s.silent:.1f} s (limit {s.limit:.1f} s; {last})"
        first = min(found, key=lambda s: (self.ranks[s.rank].step or 0, -s.silent, s.rank)).rank
        head = f"rank {first} ({self.hosts[first]}, pid {self.ranks[first].pid}) {self.ranks[first].reason}"
        if self.on_stall == "warn":
            lines = [f"mg.Cluster: {head}", steps_text(self.ranks), stacks_text(taken)]
            warnings.warn("\n".join(lines), StallWarning, stacklevel=4)
            return
        self._show(pending, shown, final=True)
        for info in self.ranks:
            info.state = "stalled" if any(s.rank == info.rank for s in found) else "stopped"
        self._kill_engines()
        self.lost = f"{head}; its ranks were stopped"
        failure = Failure("stalled", head, stacks=taken)
        results = [None] * self.engines
        raise launch_error(f"{self.lost}: call c.restart()", failure, self.ranks, first, results)

    def _interrupt(self, pending: Pending, shown: list[int]) -> None:
        """Ctrl-C: SIGINT to every rank still running (a fit stops at the step boundary the ranks
        agree on, its state kept), and a wait of up to ``INTERRUPT_WAIT`` seconds for them; a
        second Ctrl-C meanwhile sends the ranks still running a second SIGINT (a fit then stops
        at its next boundary, agreed or not). Raises KeyboardInterrupt saying where each rank
        stopped, or that it still runs (its fit stops at the agreed boundary; the next call
        waits for it)."""
        self._sigint(pending, again_at=None)
        with contextlib.suppress(Exception):
            self._show(pending, shown, final=True)
        raise interrupted(self.ranks, self.hosts, pending, INTERRUPT_WAIT)

    def _sigint(self, pending: Pending, again_at: float | None) -> None:
        """SIGINT to the ranks still running, then a wait of up to ``INTERRUPT_WAIT`` s for them;
        a second SIGINT to those still running after ``again_at`` s, or at a Ctrl-C meanwhile."""
        running = lambda: [r for r, finished in enumerate(pending.done()) if not finished]  # noqa: E731
        self._signal(running(), signal.SIGINT)
        start, again = time.monotonic(), again_at
        while running() and time.monotonic() < start + INTERRUPT_WAIT:
            try:
                time.sleep(POLL)
                if again is not None and time.monotonic() > start + again:
                    raise KeyboardInterrupt
            except KeyboardInterrupt:
                if again != -1:
                    self._signal(running(), signal.SIGINT)
                    again = -1

    def _signal(self, ranks: list[int], signum: int) -> None:
        """``signum`` to these ranks: straight to the processes this machine started, else
        through the engine."""
        if self.launcher == "local" and self._file is None:
            for r in ranks:
                with contextlib.suppress(OSError):
                    os.kill(self.ranks[r].pid, signum)
        else:
            self._engines.signal(ranks, signum)

    def _kill_engines(self) -> None:
        import psutil

        for info in self.ranks:
            with contextlib.suppress(psutil.Error):
                psutil.Process(info.pid).kill()

    # -- life -----------------------------------------------------------------------------------

    def restart(self) -> Cluster:
        """Fresh engines (the same count, devices and launcher) and the jax.distributed group
        formed again; names defined by cells are gone. Returns the cluster."""
        if self.closed:
            raise RuntimeError("Cluster.restart: the cluster is closed; make a new one with mg.Cluster(...)")
        if self._file is not None:
            raise RuntimeError(
                "Cluster.restart: this cluster is connected to an ipcluster it did not start; restart "
                "that one (ipcluster stop / start), then mg.Cluster.connect(...) again"
            )
        self._stop()
        self.lost = None
        self._start()
        return self

    def _stop(self) -> None:
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.kill()
            guard.wait()
        if self._engines is not None:
            if self._file is None and self.lost:  # the survivors may sit in a collective: no goodbye
                self._kill_engines()
            local = [r.pid for r in self.ranks] if self.launcher == "local" else []  # no pid of another host
            mine = family([] if self._file is not None else [*self._engines.started(), *local])
            self._engines.stop()
            self._engines = None
            reap(mine)

    def close(self) -> None:
        """Stops the engines and the controller it started (a connected cluster: disconnects);
        nothing is left running."""
        if self.closed:
            return
        self.closed = True
        self._stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # -- showing ------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return text_table(HEADERS, rows(self), title(self))

    def _repr_html_(self) -> str:
        return html_table(HEADERS, rows(self), title(self))

    # -- batch systems ------------------------------------------------------------------------

    @staticmethod
    def script(engines: int, launcher: str, devices_per_engine: int = 1) -> str:
        """What ipyparallel would run (``mpi``: the mpiexec command) or submit (``slurm``,
        ``pbs``: the batch script) to start ``engines`` engines, for checking before a real
        allocation. Each engine chooses its ``devices_per_engine`` devices when the cluster
        sets it up (``CUDA_VISIBLE_DEVICES`` by its place on its host)."""
        return launcher_script(engines, launcher, devices_per_engine)
