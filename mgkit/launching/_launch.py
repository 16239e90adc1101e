"""``mg.launch``: run a function in N fresh processes, each owning its devices, and supervise them.

The kernel starts every rank (``_processes``), with its devices fixed in the environment before
JAX starts. Arguments go to a rank and its value comes back over private pipes (``_wire``); the
pipe into a rank stays open as its lifeline. The kernel's loop here hands the ranks' messages
and output to the judge (``_blame``), polls their exits every 20 ms, runs the watchdog
(``_watch``) and the launch's clock, and on the first failure stops the rest: SIGTERM, then
SIGKILL after ``grace``.
"""

from __future__ import annotations

import itertools
import queue
import shutil
import sys
import time
from typing import Any, NamedTuple

from .._ledger import execution_label, ledger
from . import _plan
from ._blame import Judge
from ._events import launch_event
from ._processes import KILL_WAIT, Heard, Process, ask_stacks, kill_all, spawn, stacks_folder, stacks_path
from ._ranks import RankState
from ._result import LaunchResult, RankInfo, launch_error, load_value
from ._watch import Silence, silences
from ._wire import Line

POLL = 0.02  # seconds between two looks at the ranks' exits
DRAIN_WAIT = 0.5  # seconds an exited rank's pipes get to deliver its last words
PEER_WAIT = 0.3  # seconds a rank that reports a lost peer waits for that peer's death to show
STILL_STARTING = "(still starting its interpreter)"  # the stacks of a rank that cannot be asked yet

_current: list[_Group] = []  # the launch running now, for the views
_launches = itertools.count(1)  # numbers the launches of this kernel, for their ledger events


class Running(NamedTuple):
    """The launch running now, as the views show it."""

    title: str  # "mg.launch: 2 rank(s), 3.1 s"
    ranks: tuple[RankInfo, ...]  # each started rank's RankInfo, updated as the launch runs


class _Group:
    """Starts the ranks of a plan, hands what they say to the judge, runs the watchdog and the
    clock, and stops them all on the way out (the judge's ``Supervisor``)."""

    def __init__(self, fn: Any, plan: _plan.Plan, stream: bool, stacks_dir: str):
        self.plan = plan
        self.stream = stream
        self.stacks_dir = stacks_dir
        self.processes: list[Process] = []
        self.states: list[RankState] = []
        self.inbox: queue.SimpleQueue[Heard] = queue.SimpleQueue()
        self.judge = Judge(self.states, self, fn, plan.collectives)
        self.t0 = time.perf_counter()
        self.label = execution_label()
        self.launch = next(_launches)

    def start(self) -> None:
        plan = self.plan
        for rank in range(plan.nprocs):
            p = spawn(rank, plan.envs[rank], plan.frames[rank], self.inbox.put)
            info = RankInfo(rank, p.pid, tuple(plan.groups[rank]), started=time.time())
            self.processes.append(p)
            self.states.append(RankState(info, time.perf_counter()))

    # ------------------------------------------------------------------ watching

    def run(self) -> LaunchResult:
        plan, judge = self.plan, self.judge
        while True:
            self._drain(POLL)
            for p, r in zip(self.processes, self.states, strict=True):
                if not r.exited and not p.running():
                    self._exited(p)
            if judge.root is not None:
                failure = judge.ending()
                self.stop_all(f"terminated after rank {judge.root.rank} failed")
                raise launch_error(judge.head(), failure, self._infos(), judge.root.rank, self._results())
            if all(r.exited for r in self.states):
                break
            now = time.perf_counter()
            if plan.timeout is not None and now - self.t0 > plan.timeout:
                self._timeout()
            found = silences(self.states, now, plan.stall_after, plan.collectives)
            if found:
                self._stalled(found)
        values = [None if r.result is None else load_value(r.result, r.rank) for r in self.states]
        return LaunchResult(values, self._infos(), time.perf_counter() - self.t0)

    def _drain(self, wait: float) -> None:
        """Hands the judge everything heard, waiting up to ``wait`` seconds for the first."""
        try:
            item = self.inbox.get(timeout=wait) if wait else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._hear(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _hear(self, item: Heard) -> None:
        what = item.what
        self.judge.hear(item.rank, what, time.perf_counter())
        if self.stream and isinstance(what, Line):
            out = sys.stderr if what.stream == "err" else sys.stdout
            print(f"[rank {item.rank}] {what.text}", file=out, flush=True)

    def _exited(self, p: Process) -> None:
        """Hands the judge a rank's exit, once its pipes delivered their last words."""
        p.drained(DRAIN_WAIT)
        self._drain(0)
        self.judge.exited(p.rank, p.popen.returncode, time.perf_counter())

    def _stalled(self, found: list[Silence]) -> None:
        report = self.judge.stalled(found, warn=self.plan.on_stall == "warn")
        if report is not None:
            print(report, file=sys.stderr, flush=True)

    def _timeout(self) -> None:
        """Every rank still running is stopped and reported with what it was doing (the judge's)."""
        self.judge.timed_out(self.plan.timeout, time.perf_counter())
        self.stop_all(f"stopped at timeout={self.plan.timeout:g} s")
        failure = self.judge.ending()
        raise launch_error(self.judge.head(), failure, self._infos(), None, self._results())

    # ------------------------------------------------------------------ the judge's questions

    def dead_peer(self, rank: int) -> None:
        """Hands the judge the exit of another rank that died without a word, if one is seen
        dead within ``PEER_WAIT`` s (a dead peer's process can take a moment to be seen exiting)."""
        deadline = time.perf_counter() + PEER_WAIT
        while True:
            for p, r in zip(self.processes, self.states, strict=True):
                if p.rank != rank and not r.exited and not p.running():
                    p.messages_done.wait(DRAIN_WAIT)
                    self._drain(0)
                    if r.said_nothing():
                        self._exited(p)
                        return
            if time.perf_counter() > deadline:
                return
            time.sleep(POLL / 2)

    def stacks(self, ranks: list[int]) -> dict[int, str]:
        """These ranks' Python stacks; a rank whose interpreter is still starting has no stack
        handler yet (SIGUSR1 would end it), and is not asked."""
        ready = [self.processes[r] for r in ranks if self.states[r].started]
        found = {r: STILL_STARTING for r in ranks if not self.states[r].started}
        found.update(ask_stacks(ready, self.stacks_dir))
        return dict(sorted(found.items()))

    def record(self, r: RankState, what: str, nbytes: int, seconds: float) -> None:
        ledger().record(launch_event(r.info, what, nbytes, seconds, self.label, self.launch))

    # ------------------------------------------------------------------ stopping

    def stop_all(self, reason: str) -> None:
        """SIGTERM to every live rank, SIGKILL to those still there after ``grace``."""
        live = [p for p in self.processes if not self.states[p.rank].exited]
        for p in live:
            self.judge.terminating(p.rank, reason)
            p.terminate()
        deadline = time.perf_counter() + self.plan.grace
        while any(p.running() for p in live) and time.perf_counter() < deadline:
            self._drain(POLL)
        for p in live:
            if p.running():
                p.kill()
        for p in live:
            p.wait(KILL_WAIT)
            if not self.states[p.rank].exited:
                self._exited(p)

    def kill_all(self) -> None:
        """The last word on the way out, whatever happened: no rank outlives its launch."""
        kill_all(self.processes)
        self._drain(0)

    # ------------------------------------------------------------------ reporting

    def _infos(self) -> tuple[RankInfo, ...]:
        return tuple(r.info for r in self.states)

    def _results(self) -> list[bytes | None]:
        return [r.result for r in self.states]

    def snapshot(self) -> Running:
        elapsed = time.perf_counter() - self.t0
        return Running(f"mg.launch: {self.plan.nprocs} rank(s), {elapsed:.1f} s", self._infos())


def current() -> Running | None:
    """The running launch's title and ranks (None when none runs), for the live views."""
    running = _current[-1:]  # one read: a launch may end meanwhile
    return running[0].snapshot() if running else None


def launch(
    fn: Any,
    *,
    nprocs: int | None = None,
    shared: Any = None,
    private: list | None = None,
    devices_per_process: int = 1,
    distributed: bool = False,
    timeout: float | None = None,
    grace: float = 5.0,
    env: dict[str, str] | None = None,
    coordinator: str | int | None = None,
    timeouts: dict[str, float] | None = None,
    stall_after: float | None = None,
    on_stall: str = "raise",
    stream: bool = True,
) -> LaunchResult:
    """Runs ``fn(rank, shared, private)`` in ``nprocs`` fresh processes, each owning its devices.

    ``fn`` may be defined in a notebook cell, a lambda or a closure: it is sent by value with
    cloudpickle. Before any process starts, ``fn``, everything it uses, ``shared`` and each
    ``private`` entry are pickled; what cannot be is named in a TypeError. Each rank runs in a
    fresh interpreter in its own session (the notebook's Interrupt reaches only the kernel), its
    devices fixed before JAX starts: its own GPUs with ``CUDA_VISIBLE_DEVICES``, or
    ``devices_per_process`` simulated CPU devices when the kernel has no GPU. Each rank's output
    appears under the cell as it comes, prefixed ``[rank r]``. A rank notices the kernel's death
    through its lifeline pipe and exits at once.

    On the first failure (an exception, an exit code, a signal, a stall, an unsendable value)
    the other ranks get SIGTERM, then SIGKILL after ``grace`` seconds, and a ``LaunchError``
    names the root-cause rank, its pid, exception and traceback, and keeps the finished ranks'
    values. Ranks that JAX aborts because a peer died are reported as aborted after it. Ctrl-C
    stops every rank the same way and raises KeyboardInterrupt.

    Args:
      fn: called as ``fn(rank, shared, private)`` in every rank; its return value comes back.
      nprocs: number of processes (default: ``len(private)``, else one per ``devices_per_process``
        of the devices ranks can own).
      shared: sent once to every rank (pickled once).
      private: one entry per rank; ``private[r]`` goes to rank ``r``.
      devices_per_process: devices each rank owns. GPUs are real: a launch needing more than
        there are is refused. CPU devices are simulated, so any count works; one past the
        machine's cores gets a ``CoresWarning`` (the ranks share the cores).
      distributed: every rank calls ``jax.distributed.initialize`` (the kernel never does), with
        the coordinator on 127.0.0.1 and short timeouts; ``jax.devices()`` is then every rank's
        devices, and ``mg.use_contexts`` names them in global order (dev0, dev1, ...).
      timeout: seconds for the whole launch (None: no limit); past it, every rank still running
        is stopped and the ``LaunchError`` (``kind`` ``timeout``) lists each one with what it was
        doing (its last completed step) and its stack.
      grace: seconds between SIGTERM and SIGKILL when ranks are stopped.
      env: extra environment variables for every rank.
      coordinator: ``'host:port'`` or a port for jax.distributed's coordinator (default: a free
        port on 127.0.0.1; the coordinator binds only that address).
      timeouts: jax.distributed's timeouts in seconds, ``{'heartbeat': 10, 'init': 60,
        'shutdown': 10}`` by default (JAX's own are 100, 300 and 300).
      stall_after: seconds without a heartbeat (``mg.beat``; the Trainer beats every step)
        after which a running rank has stalled. Default: learned, 5 times the slowest step
        seen, never below 10 s, counted from a rank's first step.
      on_stall: ``'raise'``: report every rank's stack and stop the group; ``'warn'``: report
        and go on.
      stream: print the ranks' output under the cell as it comes.

    Returns:
      A ``LaunchResult``: ``values`` (one per rank), ``seconds`` (each rank's wall time),
      ``exit_codes`` and ``ranks``.

    >>> import mgkit as mg
    >>> res = mg.launch(lambda rank, shared, private: rank * shared, nprocs=2, shared=10)  # doctest: +SKIP
    >>> res.values  # doctest: +SKIP
    [0, 10]
    """
    stacks_dir = stacks_folder()
    try:
        plan = _plan.plan(
            fn,
            nprocs=nprocs,
            shared=shared,
            private=private,
            devices_per_process=devices_per_process,
            distributed=distributed,
            timeout=timeout,
            grace=grace,
            env=env,
            coordinator=coordinator,
            timeouts=timeouts,
            stall_after=stall_after,
            on_stall=on_stall,
            stacks_dir=stacks_dir,
        )
        for r in range(plan.nprocs):
            open(stacks_path(stacks_dir, r), "w").close()
        group = _Group(fn, plan, bool(stream), stacks_dir)
        _current.append(group)
        try:
            group.start()
            try:
                return group.run()
            except KeyboardInterrupt:
                group.stop_all("terminated when the cell was interrupted")
                raise
        finally:
            group.kill_all()
            _current.remove(group)
    finally:
        shutil.rmtree(stacks_dir, ignore_errors=True)
