"""Deciding what failed in a launch and which rank is to blame, from what the ranks said and how
they exited (no process in here: ``Judge`` is fed messages, output lines and exit codes).

The first rank to fail for a reason of its own is the root cause; the ranks that fail after it
have "failed too" (an error of their own) or were "aborted" (stopped by the root's failure). Two
cases turn that around in a distributed launch: a rank whose error says a peer went away (a
lost connection, a missed heartbeat) blames a peer that died without a word, when there is one;
and a rank that JAX aborted because a peer stopped sending heartbeats blames the peer JAX names.
"""

from __future__ import annotations

import pickle
import re
import signal
from typing import Any, Protocol

from . import _check
from ._child import EXIT_LIFELINE
from ._ranks import RankState
from ._result import Failure, stacks_text, steps_text
from ._watch import Silence
from ._wire import Line, Message, Ready

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


class Supervisor(Protocol):
    """What the judge asks of whoever runs the ranks' processes."""

    def dead_peer(self, rank: int) -> None:
        """Hands the judge (``Judge.exited``) the exit of a rank other than ``rank`` that died
        without a word, if one is seen dead within a moment; else does nothing."""

    def stacks(self, ranks: list[int]) -> dict[int, str]:
        """The Python stacks of these live ranks, now (rank -> text)."""

    def record(self, r: RankState, what: str, nbytes: int, seconds: float) -> None:
        """Records in the ledger that rank ``r`` is ``what`` (ready, done, failed or stalled)."""


class Judge:
    """Keeps each rank's state from what it says, classifies each exit, and names the root cause.

    Args:
      ranks: every rank's state, in rank order (the judge updates them).
      supervisor: what runs the processes (dead peers, stacks, the ledger).
      fn: the launched function (its source lines go back into a rank's traceback).
      collectives: the collectives' timeout of a distributed launch, in seconds; None when the
        launch is not distributed.
    """

    def __init__(self, ranks: list[RankState], supervisor: Supervisor, fn: Any, collectives: float | None):
        self.ranks = ranks
        self.supervisor = supervisor
        self.fn = fn
        self.collectives = collectives
        self.root: RankState | None = None  # the rank whose failure ends the launch
        self.failure: Failure | None = None  # what it did (or the timeout, with root None)
        self.timeout: float | None = None  # the launch's timeout, once it ran past it

    def hear(self, rank: int, what: Message | Line, now: float) -> None:
        """Takes in a message or output line of ``rank``, heard at ``now``."""
        r = self.ranks[rank]
        r.hear(what, now)
        if isinstance(what, Ready):
            self.supervisor.record(r, "ready", 0, r.info.ready_seconds)

    def exited(self, rank: int, code: int, now: float) -> None:
        """Classifies ``rank``'s exit with ``code`` at ``now``, once all it said was heard."""
        r = self.ranks[rank]
        info = r.info
        r.exited = True
        info.exit_code = code
        info.seconds = now - r.spawned
        if r.result is not None:
            info.state = "done"
            self.supervisor.record(r, "done", len(r.result), info.seconds)
            return
        if (r.stopping or info.state == "stalled") and r is not self.root:
            return  # stopped by mgkit, or stalled: its own state and reason stay
        failure = cause(r, code, self.fn)
        info.reason = failure.reason
        self.supervisor.record(r, "failed", 0, info.seconds)
        if self.root is r:
            return
        if self.root is None and self._peer_failure(r, failure):
            self.supervisor.dead_peer(rank)  # that peer, when there is one, is the root cause now
        if self.root is not None:
            own = (r.error is not None and not self._peer_failure(r, failure)) or r.unsendable is not None
            if own:
                info.state = "failed"
                info.reason = f"failed too, after rank {self.root.rank}: it {failure.reason}"
            else:
                info.state = "aborted"
                info.reason = f"aborted after rank {self.root.rank} died (it {failure.reason})"
            return
        blamed = self._blamed_by_jax(r)
        if blamed is not None:
            info.state = "aborted"
            info.reason = f"aborted after rank {blamed.rank} died (it {failure.reason})"
            self._blame_silent_peer(blamed, r)
            return
        info.state = "failed"
        self.root = r
        self.failure = failure

    def _blame_silent_peer(self, blamed: RankState, aborted: RankState) -> None:
        blamed.info.state = "failed"
        blamed.info.reason = (
            f"stopped answering jax.distributed's heartbeats (dead, stopped, or stuck in native code); "
            f"rank {aborted.rank} was aborted by JAX because of it"
        )
        self.root = blamed
        self.failure = Failure("stalled", blamed.info.reason, stacks=self.supervisor.stacks([blamed.rank]))

    def _peer_failure(self, r: RankState, failure: Failure) -> bool:
        """Whether a distributed rank's error reports a peer that went away (the coordinator
        or a collective's partner), rather than a failure of its own."""
        if self.collectives is None or r.error is None:
            return False
        return bool(_PEER_GONE.search(failure.reason + failure.traceback))

    def _blamed_by_jax(self, r: RankState) -> RankState | None:
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

    def stalled(self, found: list[Silence], warn: bool) -> str | None:
        """Marks the ranks silent past their limit as stalled. With ``warn``, returns the report
        (each rank's silence, every live rank's stack) and the launch goes on; else the rank
        with the fewest steps done, or silent longest, is the root cause, and None is returned."""
        stacks = self.supervisor.stacks([x.rank for x in self.ranks if not x.exited])
        reasons = {}
        for rank, silent, limit in found:
            r = self.ranks[rank]
            r.stalled = True
            r.info.state = "stalled"
            last = "no step yet" if r.info.step is None else f"last completed step {r.info.step}"
            reasons[r] = f"stalled: no heartbeat for {silent:.1f} s (limit {limit:.1f} s; {last})"
            self.supervisor.record(r, "stalled", 0, silent)
        if warn:
            lines = [f"mg.launch: rank {r.rank} (pid {r.info.pid}) {reason}" for r, reason in reasons.items()]
            return "\n".join([*lines, steps_text([x.info for x in self.ranks]), stacks_text(stacks)])
        fewest_steps = min(found, key=lambda s: (self.ranks[s.rank].info.step or 0, -s.silent, s.rank))
        first = self.ranks[fewest_steps.rank]
        for r, reason in reasons.items():
            r.info.reason = reason
        others = [f"rank {r.rank}" for r in reasons if r is not first]
        also = f"\n(also silent: {', '.join(others)})" if others else ""
        self.root = first
        self.failure = Failure("stalled", reasons[first] + also, stacks=stacks)
        return None

    def ending(self) -> Failure:
        """The root cause's failure (or the timeout's) as the launch ends with it. A rank whose
        collective timed out is rarely the culprit: the live ranks' stacks, taken now, show which
        one did not join it."""
        failure = self.failure
        if self.timeout is not None:
            self.failure = failure._replace(reason=self._timeout_reason())
            return self.failure
        if failure.kind != "raised" or not _GLOO_TIMEOUT.search(failure.reason):
            return failure
        limit = "" if self.collectives is None else f" ({self.collectives} s)"
        self.failure = failure._replace(
            reason=failure.reason
            + f"\n(a collective timed out{limit}, timeouts['collectives']: a rank did not join it; "
            "the stacks below show where each rank was)",
            stacks=self.supervisor.stacks([x.rank for x in self.ranks if not x.exited]),
        )
        return self.failure

    def timed_out(self, timeout: float, now: float) -> None:
        """The launch ran past ``timeout`` seconds at ``now``: every rank still running is stopped
        (``terminating``), each with what it was doing then and its stack, taken now. The ranks
        are stopped next; ``ending`` then names each one stopped, and there is no root cause."""
        live = [r for r in self.ranks if not r.exited]
        stacks = self.supervisor.stacks([r.rank for r in live])
        for r in live:
            self.terminating(r.rank, f"stopped at timeout={timeout:g} s while {r.doing(now)}", force=True)
        self.timeout = timeout
        self.failure = Failure("timeout", "", stacks=stacks)

    def _timeout_reason(self) -> str:
        stopped = [r.rank for r in self.ranks if r.stopping and r.result is None]
        done = [r.rank for r in self.ranks if r.result is not None]
        names = ", ".join(str(rank) for rank in stopped)
        return (
            f"mg.launch ran past timeout={self.timeout:g} s and stopped rank(s) {names} "
            f"({len(stopped)} of {len(self.ranks)}; "
            + (f"rank(s) {', '.join(map(str, done))} finished" if done else "none had finished")
            + "). Each is listed below with what it was doing, its last step and its stack: "
            "raise timeout=, or find the slow rank there."
        )

    def head(self) -> str:
        """The first line of the error: the root cause and what it did, or the timeout and the
        ranks it stopped."""
        if self.root is None:
            return self.failure.reason
        info = self.root.info
        return f"rank {self.root.rank} (pid {info.pid}) {self.failure.reason}"

    def terminating(self, rank: int, reason: str, force: bool = False) -> None:
        """``rank`` is being stopped for ``reason``; a rank already being stopped, or that failed or
        stalled, keeps its own reason unless ``force``."""
        r = self.ranks[rank]
        if r.stopping and not force:
            return
        r.stopping = True
        if force or r.info.state not in ("failed", "stalled"):
            r.info.state = "terminated"
            r.info.reason = reason


def cause(r: RankState, code: int, fn: Any) -> Failure:
    """What rank ``r`` did, from its last message and its exit ``code`` (negative: a signal)."""
    if r.error is not None:
        e = r.error
        during = " while starting" if e.during == "start" else ""
        exited = e.type == "SystemExit"
        return Failure(
            kind="exited" if exited else "raised",
            reason=(
                f"called sys.exit({e.message}){during}" if exited else f"raised {e.type}: {e.message}{during}"
            ),
            exception_type=e.type,
            traceback=_check.restore_files(e.traceback, fn),
            exception=_load_exception(e.exception),
        )
    if r.unsendable is not None:
        u = r.unsendable
        return Failure(
            "unsendable",
            f"returned a {u.type}, which cannot be sent back to the kernel: {u.part} "
            f"cannot be pickled ({u.message}); return plain data instead (numbers, numpy "
            "arrays, dicts and lists of them)",
        )
    if code < 0:
        name = _signal_name(-code)
        hint = _SIGNAL_HINTS.get(name)
        return Failure("signal", f"was killed by signal {name} ({-code})" + (f": {hint}" if hint else ""))
    if code == EXIT_LIFELINE:
        return Failure("exited", "lost its lifeline to the kernel and exited")
    return Failure("exited", f"exited with code {code} without returning a value")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _load_exception(blob: bytes | None) -> BaseException | None:
    if blob is None:
        return None
    try:
        return pickle.loads(blob)
    except Exception:  # noqa: BLE001 - the type name and traceback text stay in the error
        return None
