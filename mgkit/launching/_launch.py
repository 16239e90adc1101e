"""``mg.launch``: run a function in N fresh processes, each owning its devices, and supervise them.

The kernel starts every rank with ``subprocess`` (a fresh interpreter: JAX cannot be forked),
in a session of its own (the notebook's Interrupt signals the kernel's process group, not the
ranks), with its devices fixed in the environment before JAX starts. Arguments go to a rank
and its value comes back over private pipes; the pipe into a rank stays open as its lifeline.
The kernel's loop reads the ranks' messages and output, polls their exits every 20 ms, runs
the watchdog, and on the first failure stops the rest: SIGTERM, then SIGKILL after ``grace``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from typing import Any

from .._ledger import execution_label, ledger
from . import _check, _plan, _wire
from ._child import EXIT_LIFELINE
from ._events import launch_event
from ._result import LaunchError, LaunchResult, RankInfo

POLL = 0.02  # seconds between two looks at the ranks' exits
STACK_WAIT = 0.5  # seconds the ranks get to write their stacks
DRAIN_WAIT = 0.5  # seconds an exited rank's pipes get to deliver its last words
PEER_WAIT = 0.3  # seconds a rank that reports a lost peer waits for that peer's death to show
STALL_FLOOR = 10.0  # a learned stall limit is never below this many seconds
STALL_FACTOR = 5.0  # ... and otherwise this many times the slowest step seen
COLLECTIVES_MARGIN = 5.0  # seconds past the collectives' timeout before the watchdog steps in
_UNHEALTHY = re.compile(r"tasks are unhealthy \(stopped sending heartbeats\):\s*([\d,\s]+)")
_JAX_ABORT = "JAX distributed service detected fatal errors"
_PEER_GONE = re.compile(
    r"coordination service|Connection (reset|closed)|closed by peer|Socket closed|UNAVAILABLE|heartbeat",
    re.IGNORECASE,
)
_GLOO_TIMEOUT = re.compile(r"Gloo .* failed.*Timed out|collective.*timed out", re.IGNORECASE)
_SIGNAL_HINTS = {
    "SIGKILL": "often the out-of-memory killer, or a kill -9",
    "SIGABRT": "a fatal error in native code (XLA, JAX); the output above says which",
    "SIGSEGV": "a crash in native code",
    "SIGBUS": "a crash in native code",
}

_current: list[_Group] = []  # the launch running now, for the views
_launches = itertools.count(1)  # numbers the launches of this kernel, for their ledger events


class _Rank:
    """The kernel's side of one rank: its process, pipes, reader threads and what came back."""

    def __init__(self, rank: int, devices: list[str]):
        self.rank = rank
        self.devices = devices
        self.popen: subprocess.Popen | None = None
        self.lifeline: int | None = None  # the kernel's end of the pipe into the rank
        self.info: RankInfo | None = None
        self.spawned = 0.0  # perf_counter() at start
        self.started = False  # its stack handler is in place
        self.ready_at: float | None = None
        self.last_beat: float | None = None  # perf_counter() of the last heartbeat message
        self.beats = 0
        self.slowest = 0.0
        self.first_step: float | None = None
        self.stalled = False
        self.exited = False
        self.result: bytes | None = None
        self.error: _wire.Error | None = None
        self.unsendable: _wire.Unsendable | None = None
        self.err_tail: deque[str] = deque(maxlen=200)
        self.readers: list[threading.Thread] = []
        self.messages_done = threading.Event()


class _Group:
    """Starts the ranks of a plan, watches them, and stops them all on the way out."""

    def __init__(self, fn: Any, plan: _plan._Plan, stream: bool, stacks_dir: str):
        self.fn = fn
        self.plan = plan
        self.stream = stream
        self.stacks_dir = stacks_dir
        self.ranks = [_Rank(r, plan.groups[r]) for r in range(plan.nprocs)]
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.root: _Rank | None = None  # the rank whose failure ends the launch
        self.failure: dict | None = None
        self.t0 = time.perf_counter()
        self.label = execution_label()
        self.launch = next(_launches)

    # ------------------------------------------------------------------ starting

    def start(self) -> None:
        for r in self.ranks:
            self._spawn(r)

    def _spawn(self, r: _Rank) -> None:
        r_in, w_in = os.pipe()
        r_out, w_out = os.pipe()
        try:
            r.popen = subprocess.Popen(
                [sys.executable, "-u", "-m", "mgkit.launching", str(r_in), str(w_out)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self.plan.envs[r.rank],
                pass_fds=(r_in, w_out),
                start_new_session=True,
            )
        except BaseException:
            for fd in (r_in, w_in, r_out, w_out):
                os.close(fd)
            raise
        os.close(r_in)
        os.close(w_out)
        r.lifeline = w_in
        r.spawned = time.perf_counter()
        r.info = RankInfo(r.rank, r.popen.pid, tuple(r.devices), started=time.time())
        frames = self.plan.frames[r.rank]
        threads = [
            threading.Thread(target=self._send_frames, args=(w_in, frames), daemon=True),
            threading.Thread(target=self._read_messages, args=(r, r_out), daemon=True),
            threading.Thread(target=self._read_lines, args=(r, r.popen.stdout, "out"), daemon=True),
            threading.Thread(target=self._read_lines, args=(r, r.popen.stderr, "err"), daemon=True),
        ]
        for t in threads:
            t.start()
        r.readers = threads[1:]

    @staticmethod
    def _send_frames(fd: int, frames: list[bytes]) -> None:
        with contextlib.suppress(OSError):  # the rank died first: its exit tells the story
            for frame in frames:
                _wire.send_bytes(fd, frame)

    def _read_messages(self, r: _Rank, fd: int) -> None:
        try:
            while (message := _wire.read_message(fd)) is not None:
                self.events.put((r, "msg", message))
        except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError):
            pass  # a rank cut off mid-message: its exit tells the story
        finally:
            os.close(fd)
            r.messages_done.set()

    def _read_lines(self, r: _Rank, pipe: Any, kind: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            for raw in iter(pipe.readline, b""):
                self.events.put((r, kind, raw.decode(errors="replace").rstrip("\r\n")))

    # ------------------------------------------------------------------ watching

    def run(self) -> LaunchResult:
        plan = self.plan
        while True:
            self._drain(POLL)
            for r in self.ranks:
                if not r.exited and r.popen.poll() is not None:
                    self._exited(r)
            if self.root is not None:
                self._collective_timed_out()
                self._stop_all(f"terminated after rank {self.root.rank} failed")
                raise self._error()
            if all(r.exited for r in self.ranks):
                break
            now = time.perf_counter()
            if plan.timeout is not None and now - self.t0 > plan.timeout:
                self._timeout()
            self._watch(now)
        values = [None if r.result is None else _load(r.result, r.rank) for r in self.ranks]
        return LaunchResult(values, tuple(r.info for r in self.ranks), time.perf_counter() - self.t0)

    def _drain(self, wait: float) -> None:
        try:
            item = self.events.get(timeout=wait) if wait else self.events.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.events.get_nowait()
            except queue.Empty:
                return

    def _handle(self, r: _Rank, kind: str, payload: Any) -> None:
        info = r.info
        if kind == "msg":
            self._message(r, payload)
            return
        info.tail.append(payload)
        if kind == "err":
            r.err_tail.append(payload)
        if self.stream:
            print(f"[rank {r.rank}] {payload}", file=sys.stderr if kind == "err" else sys.stdout, flush=True)

    def _message(self, r: _Rank, message: _wire.Message) -> None:
        info, now = r.info, time.perf_counter()
        match message:
            case _wire.Started():
                r.started = True
            case _wire.Ready(devices):
                r.ready_at = now
                info.devices = tuple(devices)
                info.ready_seconds = now - r.spawned
                info.state = "running"
                self._record(r, "ready", 0, info.ready_seconds)
            case _wire.Beat(step, wall, slowest):
                if r.beats == 0 and r.ready_at is not None:
                    r.first_step = now - r.ready_at
                r.beats += 1
                r.last_beat, r.slowest = now, slowest
                info.step, info.beat_at = step, wall
                if r.stalled:
                    r.stalled = False
                    info.state = "running"
            case _wire.Result(value):
                r.result = value
            case _wire.Error():
                r.error = message
            case _wire.Unsendable():
                r.unsendable = message

    def _exited(self, r: _Rank) -> None:
        """Classifies a rank that exited, once its pipes delivered their last words."""
        deadline = time.perf_counter() + DRAIN_WAIT
        r.messages_done.wait(DRAIN_WAIT)
        for t in r.readers[1:]:
            t.join(max(0.0, deadline - time.perf_counter()))
        self._drain(0)
        code = r.popen.returncode
        info = r.info
        r.exited = True
        info.exit_code = code
        info.seconds = time.perf_counter() - r.spawned
        if r.result is not None:
            info.state = "done"
            self._record(r, "done", len(r.result), info.seconds)
            return
        if info.state == "terminated" or (info.state == "stalled" and r is not self.root):
            return
        facts = self._cause(r, code)
        info.reason = facts["reason"]
        self._record(r, "failed", 0, info.seconds)
        if self.root is r:
            return
        if self.root is None and self._peer_failure(r, facts):
            culprit = self._dead_peer(r)
            if culprit is not None:
                self._exited(culprit)  # the peer whose death this rank's error reports: the cause
        if self.root is not None:
            own = (r.error is not None and not self._peer_failure(r, facts)) or r.unsendable is not None
            if own:  # a failure of its own
                info.state = "failed"
                info.reason = f"failed too, after rank {self.root.rank}: it {facts['reason']}"
            else:
                info.state = "aborted"
                info.reason = f"aborted after rank {self.root.rank} died (it {facts['reason']})"
            return
        blamed = self._blamed_by_jax(r)
        if blamed is not None:
            info.state = "aborted"
            info.reason = f"aborted after rank {blamed.rank} died (it {facts['reason']})"
            self.root = blamed
            blamed.info.state = "failed"
            blamed.info.reason = (
                f"stopped answering jax.distributed's heartbeats (dead, stopped, or stuck in native code); "
                f"rank {r.rank} was aborted by JAX because of it"
            )
            self.failure = {
                "kind": "stalled",
                "reason": blamed.info.reason,
                "stacks": self._stacks([blamed]),
            }
            return
        info.state = "failed"
        self.root = r
        self.failure = facts

    def _peer_failure(self, r: _Rank, facts: dict) -> bool:
        """Whether a distributed rank's error reports a peer that went away (the coordinator
        or a collective's partner), rather than a failure of its own."""
        if self.plan.distributed is None or r.error is None:
            return False
        return bool(_PEER_GONE.search(facts.get("reason", "") + facts.get("traceback", "")))

    def _dead_peer(self, r: _Rank) -> _Rank | None:
        """Another rank that died without an error of its own within ``PEER_WAIT`` s (a dead
        peer's process can take a moment to be seen exiting)."""
        deadline = time.perf_counter() + PEER_WAIT
        while True:
            for x in self.ranks:
                if x is not r and not x.exited and x.popen.poll() is not None:
                    x.messages_done.wait(DRAIN_WAIT)
                    self._drain(0)
                    if x.result is None and x.error is None:
                        return x
            if time.perf_counter() > deadline:
                return None
            time.sleep(POLL / 2)

    def _collective_timed_out(self) -> None:
        """A rank whose collective timed out is rarely the culprit: the others' stacks show
        which one did not join it."""
        facts = self.failure or {}
        if facts.get("kind") != "raised" or not _GLOO_TIMEOUT.search(facts.get("reason", "")):
            return
        limit = "" if self.plan.distributed is None else f" ({self.plan.distributed['collectives']} s)"
        facts["reason"] += (
            f"\n(a collective timed out{limit}, timeouts['collectives']: a rank did not join it; "
            "the stacks below show where each rank was)"
        )
        facts["stacks"] = self._stacks([x for x in self.ranks if not x.exited])

    def _cause(self, r: _Rank, code: int) -> dict:
        if r.error is not None:
            e = r.error
            during = " while starting" if e.during == "start" else ""
            said = f"called sys.exit({e.message})" if e.type == "SystemExit" else "raised"
            return {
                "kind": "exited" if e.type == "SystemExit" else "raised",
                "reason": f"{said}{during}" if said != "raised" else f"raised {e.type}: {e.message}{during}",
                "exception_type": e.type,
                "traceback": _check.restore_files(e.traceback, self.fn),
                "exception": _load_exception(e.exception),
            }
        if r.unsendable is not None:
            u = r.unsendable
            return {
                "kind": "unsendable",
                "reason": (
                    f"returned a {u.type}, which cannot be sent back to the kernel: {u.part} "
                    f"cannot be pickled ({u.message}); return plain data instead (numbers, numpy "
                    "arrays, dicts and lists of them)"
                ),
            }
        if code < 0:
            name = _signal_name(-code)
            hint = _SIGNAL_HINTS.get(name)
            return {
                "kind": "signal",
                "reason": f"was killed by signal {name} ({-code})" + (f": {hint}" if hint else ""),
            }
        if code == EXIT_LIFELINE:
            return {"kind": "exited", "reason": "lost its lifeline to the kernel and exited"}
        return {"kind": "exited", "reason": f"exited with code {code} without returning a value"}

    def _blamed_by_jax(self, r: _Rank) -> _Rank | None:
        """The rank jax.distributed named when it aborted rank r (a peer that stopped sending
        heartbeats), or None when r is not such a survivor."""
        text = "\n".join(r.err_tail)
        if _JAX_ABORT not in text:
            return None
        m = _UNHEALTHY.search(text)
        if m is None:
            return None
        for token in re.split(r"[,\s]+", m.group(1).strip()):
            if token.isdigit() and int(token) < len(self.ranks) and int(token) != r.rank:
                return self.ranks[int(token)]
        return None

    def _watch(self, now: float) -> None:
        """The watchdog: a running rank silent longer than its limit has stalled. The limit is
        ``stall_after``, else learned from the rank's steps (none before its first step, which
        compiles); in a distributed launch it is never above the collectives' timeout (plus a margin:
        XLA's own error for a collective that timed out says more, and comes first)."""
        config = self.plan.distributed
        ceiling = None if config is None else config["collectives"] + COLLECTIVES_MARGIN
        silent_ranks = []
        for r in self.ranks:
            if r.exited or r.ready_at is None or r.stalled:
                continue
            limit = self.plan.stall_after
            if limit is None and r.beats:
                seen = r.slowest if r.beats >= 2 and r.slowest > 0 else (r.first_step or 0.0)
                limit = max(STALL_FLOOR, STALL_FACTOR * seen)
            if ceiling is not None and (limit is None or ceiling < limit):
                limit = ceiling
            if limit is None:
                continue
            silent = now - (r.last_beat or r.ready_at)
            if silent > limit:
                silent_ranks.append((r, silent, limit))
        if silent_ranks:
            self._stalled(silent_ranks)

    def _stalled(self, silent_ranks: list[tuple[_Rank, float, float]]) -> None:
        """Reports ranks silent past their limit, with every live rank's stack. Several at once
        (a collective that never completes silences them all): the one silent longest, or with
        the fewest steps done, is named first."""
        stacks = self._stacks([x for x in self.ranks if not x.exited])
        reasons = {}
        for r, silent, limit in silent_ranks:
            r.stalled = True
            r.info.state = "stalled"
            last = "no step yet" if r.info.step is None else f"last completed step {r.info.step}"
            reasons[r] = f"stalled: no heartbeat for {silent:.1f} s (limit {limit:.1f} s; {last})"
            self._record(r, "stalled", 0, silent)
        if self.plan.on_stall == "warn":
            for r in reasons:
                print(
                    f"mg.launch: rank {r.rank} (pid {r.info.pid}) {reasons[r]}", file=sys.stderr, flush=True
                )
            print(f"{_steps(self.ranks)}\n{_stack_text(stacks)}", file=sys.stderr, flush=True)
            return
        first = min(silent_ranks, key=lambda t: (t[0].info.step or 0, -t[1], t[0].rank))[0]
        for r, reason in reasons.items():
            r.info.reason = reason
        others = [f"rank {r.rank}" for r in reasons if r is not first]
        also = f"\n(also silent: {', '.join(others)})" if others else ""
        self.root = first
        self.failure = {"kind": "stalled", "reason": reasons[first] + also, "stacks": stacks}

    def _timeout(self) -> None:
        stacks = self._stacks([x for x in self.ranks if not x.exited])
        self._stop_all(f"terminated when the launch ran past timeout={self.plan.timeout:g} s")
        running = ", ".join(
            f"rank {r.rank} ({r.info.status()})" for r in self.ranks if r.info.state == "terminated"
        )
        raise self._error_for(
            f"mg.launch ran past timeout={self.plan.timeout:g} s; still running were {running}. "
            "Raise timeout=, or find the slow rank in the stacks below.",
            {"kind": "timeout", "stacks": stacks},
            None,
        )

    def _stacks(self, ranks: list[_Rank]) -> dict[int, str]:
        """Each rank's Python stacks, written by faulthandler on SIGUSR1 (no debugger needed).
        A rank whose interpreter is still starting has no handler yet (SIGUSR1 would end it):
        it is not asked."""
        asked, stacks = [], {}
        for r in ranks:
            if not r.started:
                stacks[r.rank] = "(still starting its interpreter)"
                continue
            path = os.path.join(self.stacks_dir, f"rank{r.rank}.txt")
            with contextlib.suppress(OSError):
                size = os.path.getsize(path)
                os.kill(r.popen.pid, signal.SIGUSR1)
                asked.append((r, path, size))
        time.sleep(STACK_WAIT / 2)
        deadline = time.perf_counter() + STACK_WAIT / 2
        for r, path, size in asked:
            text = ""
            while True:
                with contextlib.suppress(OSError), open(path, errors="replace") as f:
                    f.seek(size)
                    text = f.read()
                if text or time.perf_counter() > deadline:
                    break
                time.sleep(0.02)
            stacks[r.rank] = text.strip() or "(no answer: the process is stopped, or stuck outside Python)"
        return stacks

    # ------------------------------------------------------------------ stopping

    def _stop_all(self, reason: str) -> None:
        """SIGTERM to every live rank, SIGKILL to those still there after ``grace``."""
        live = [r for r in self.ranks if not r.exited and r.popen is not None]
        for r in live:
            if r.info.state not in ("failed", "stalled"):
                r.info.state = "terminated"
                r.info.reason = reason
            _signal_group(r.popen.pid, signal.SIGTERM)
            _signal_group(r.popen.pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only now
        deadline = time.perf_counter() + self.plan.grace
        while any(r.popen.poll() is None for r in live) and time.perf_counter() < deadline:
            self._drain(POLL)
        for r in live:
            if r.popen.poll() is None:
                _signal_group(r.popen.pid, signal.SIGKILL)
        for r in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.popen.wait(5.0)
            if not r.exited:
                self._exited(r)

    def kill_all(self) -> None:
        """The last word on the way out, whatever happened: no rank outlives its launch."""
        for r in self.ranks:
            if r.popen is not None and r.popen.poll() is None:
                _signal_group(r.popen.pid, signal.SIGKILL)
        for r in self.ranks:
            if r.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    r.popen.wait(5.0)
            if r.lifeline is not None:
                with contextlib.suppress(OSError):
                    os.close(r.lifeline)
                r.lifeline = None
        for r in self.ranks:
            for t in r.readers:
                t.join(1.0)
            if r.popen is not None:
                for pipe in (r.popen.stdout, r.popen.stderr):
                    with contextlib.suppress(OSError):
                        pipe.close()
        self._drain(0)

    # ------------------------------------------------------------------ reporting

    def _error(self) -> LaunchError:
        root, facts = self.root, self.failure or {}
        info = root.info
        head = f"rank {root.rank} (pid {info.pid}) {facts.get('reason', info.reason)}"
        return self._error_for(head, facts, root)

    def _error_for(self, head: str, facts: dict, root: _Rank | None) -> LaunchError:
        values = [None if r.result is None else _load(r.result, r.rank) for r in self.ranks]
        done = [r.rank for r in self.ranks if r.result is not None]
        lines = [head, "", "ranks:"]
        for r in self.ranks:
            info = r.info
            what = info.reason if info.reason and r is not root else info.status()
            lines.append(f"  rank {r.rank} (pid {info.pid}, {','.join(info.devices)}): {what}")
        if done:
            lines.append(f"finished ranks' values are kept in this error's .values (ranks {done})")
        if facts.get("traceback"):
            lines += ["", f"traceback from rank {root.rank}:", facts["traceback"].rstrip()]
        elif root is not None and root.info.tail:
            lines += ["", f"last output of rank {root.rank}:", *root.info.tail]
        if facts.get("stacks"):
            lines += ["", _steps(self.ranks), _stack_text(facts["stacks"])]
        return LaunchError(
            "\n".join(lines),
            kind=facts.get("kind", ""),
            rank=None if root is None else root.rank,
            pid=None if root is None else root.info.pid,
            exception=facts.get("exception"),
            exception_type=facts.get("exception_type", ""),
            traceback=facts.get("traceback", ""),
            values=values,
            done=done,
            ranks=tuple(r.info for r in self.ranks),
            stacks=facts.get("stacks", {}),
        )

    def _record(self, r: _Rank, what: str, nbytes: int, seconds: float) -> None:
        ledger().record(launch_event(r.info, what, nbytes, seconds, self.label, self.launch))

    def snapshot(self) -> tuple[str, tuple[RankInfo, ...]]:
        elapsed = time.perf_counter() - self.t0
        return f"mg.launch: {len(self.ranks)} rank(s), {elapsed:.1f} s", tuple(
            r.info for r in self.ranks if r.info is not None
        )


def _steps(ranks: list[_Rank]) -> str:
    parts = [f"rank {r.rank}: {'no step' if r.info.step is None else f'step {r.info.step}'}" for r in ranks]
    return "last completed steps: " + ", ".join(parts)


def _stack_text(stacks: dict[int, str]) -> str:
    return "\n\n".join(f"Python stacks of rank {rank}:\n{text}" for rank, text in sorted(stacks.items()))


def _signal_group(pid: int, sig: int) -> None:
    """Signals the rank's own session (it leads it: its pid is the group's id), only if it is still ours."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _load(blob: bytes, rank: int) -> Any:
    try:
        return pickle.loads(blob)
    except Exception as exc:
        raise LaunchError(
            f"rank {rank}'s value came back but cannot be unpickled in the kernel "
            f"({type(exc).__name__}: {exc}); return types the kernel can import (plain data, numpy arrays)",
            kind="unsendable",
            rank=rank,
        ) from exc


def _load_exception(blob: bytes | None) -> BaseException | None:
    if blob is None:
        return None
    try:
        return pickle.loads(blob)
    except Exception:  # noqa: BLE001 - the type name and traceback text stay in the error
        return None


def current() -> tuple[str, tuple[RankInfo, ...]] | None:
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
      devices_per_process: devices each rank owns.
      distributed: every rank calls ``jax.distributed.initialize`` (the kernel never does), with
        the coordinator on 127.0.0.1 and short timeouts; ``jax.devices()`` is then every rank's
        devices, and ``mg.use_contexts`` names them in global order (dev0, dev1, ...).
      timeout: seconds for the whole launch (None: no limit); past it, the stacks of every rank
        are reported and the ranks stopped.
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
    stacks_dir = tempfile.mkdtemp(prefix="mgkit-launch-")
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
            open(os.path.join(stacks_dir, f"rank{r}.txt"), "w").close()
        group = _Group(fn, plan, bool(stream), stacks_dir)
        _current.append(group)
        try:
            group.start()
            try:
                return group.run()
            except KeyboardInterrupt:
                group._stop_all("terminated when the cell was interrupted")
                raise
        finally:
            group.kill_all()
            _current.remove(group)
    finally:
        shutil.rmtree(stacks_dir, ignore_errors=True)
