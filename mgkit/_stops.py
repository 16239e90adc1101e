"""Stopping a fit between two steps: Ctrl-C (the notebook's Stop button) and preemption
(SIGTERM, what a batch scheduler sends before it takes the machine back), noted when they come
and acted on at the next step boundary, never between a step's dispatch and its result being
kept (a step donates the old parameters).

In a process group (a cluster's ranks, one ``jax.distributed`` group, ``install``) every rank
stops at the same step: where the ranks' steps share collectives, a rank that went on would wait
in a collective for peers that had stopped. How they agree:

1. A rank that gets the signal notes it and posts a notice in the group's key-value store (the
   coordination service ``jax.distributed`` runs); every rank's watcher thread waits on that key
   and notes the request in the fit it runs (so one SIGTERM reaches all ranks).
2. At its next step boundary a rank posts how many steps this fit has dispatched (``b``) and
   steps on until every rank has posted. All then stop at boundary ``max(b) + LEAD``: steps that
   share a collective keep the ranks within one step of each other (two, with losses read one
   step late), so every rank knows that boundary before it reaches it, and no step waits for a
   peer that stopped. Ranks whose steps share nothing stop at once where they are past it.
3. A second Ctrl-C to a rank stops it at its next boundary without waiting for the others
   (a peer that goes on may then wait in a collective: it is the user's explicit choice).

Nothing here costs a step anything until a signal comes: the watcher thread waits in the store's
blocking read (without the GIL), and the boundary check is one attribute until a request is noted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any

INTERRUPTED = "interrupted"  # Ctrl-C, at a step boundary
PREEMPTED = "preempted"  # SIGTERM (a scheduler's preemption), at a step boundary, the state saved
GRACE = 2.0  # seconds a rank takes a Ctrl-C just after a fit stopped for one as that one
LEAD = 2  # boundaries past the furthest rank's post at which every rank stops
_WAIT_MS = 1000  # the watcher's blocking read, in slices (so it notices a fit that ended)


class PreemptedError(Exception):
    """A rank got SIGTERM (its scheduler preempted it): every rank of its group stopped at one
    step boundary, and where the trainer has a checkpoint folder that step was saved there.

    Attributes:
      rank: the rank that got the signal (None: this process, outside a group).
      step: the step every rank stopped at (None: the signal came outside a fit).
      saved: the checkpoint folder the step was saved in, or None (nothing saved).
    """

    def __init__(
        self, message: str, rank: int | None = None, step: int | None = None, saved: str | None = None
    ):
        super().__init__(message)
        self.rank, self.step, self.saved = rank, step, saved
        g = group()
        if g is not None and rank == g.rank and not g.preempted.is_set():
            g.preempted.set()  # this rank's own signal: it exits once its reply has gone
            threading.Thread(target=_exit_soon, name="mgkit-preempted", daemon=True).start()


def preempted_error(where: str, by: int | None, step: int, saved: str | None, what: str) -> PreemptedError:
    """The error a fit raises after a preemption: who was preempted, the step every rank stopped
    at, and where it is saved (``saved``: the folder, None: nothing saved; ``what``: the trainer's
    kind, for the fix)."""
    who = "this process" if by is None else f"rank {by}"
    head = f"{where}: {who} was preempted (SIGTERM): every rank stopped at step {step}, a step boundary"
    if saved is not None:
        tail = f"; step {step} is saved in '{saved}', and fit(..., resume=True) goes on from it"
    else:
        tail = (
            f"; this {what} has no checkpoint folder, so nothing was saved: give it checkpoint='ckpt/' "
            "to keep its state across preemptions"
        )
    return PreemptedError(head + tail, by, step, saved)


class _GroupFit:
    """One fit's part in the group's agreement: its keys, what it posted, the boundary agreed."""

    def __init__(self, group: Group, prefix: str, interrupts: Interrupts):
        self.group, self.prefix, self.interrupts = group, prefix, interrupts
        self.posted: int | None = None
        self.target: int | None = None
        self.heard = False

    def notice(self, reason: str) -> None:
        """Tells every rank of a signal this rank got (the first notice of the fit stands)."""
        self.group.set(f"{self.prefix}/notice", f"{reason} {self.group.rank}")

    def agreed(self, done: int) -> bool:
        """Whether to stop at this boundary (``done`` steps dispatched this fit)."""
        if self.target is None:
            group = self.group
            if self.posted is None:
                group.set(f"{self.prefix}/at/{group.rank}", str(done))
                self.posted = done
            posts = group.listing(f"{self.prefix}/at/")
            if len(posts) < group.ranks:
                return False
            bounds = [int(v) for v in posts if v.isdigit()]
            self.target = max(bounds, default=done) + LEAD
        return done >= self.target


class Group:
    """This process's place in a process group (a cluster rank): its rank, the group's size, the
    key-value client, the fit it runs (``active``) and the watcher thread."""

    def __init__(self, rank: int, ranks: int, client: Any):
        self.rank, self.ranks, self.client = rank, ranks, client
        self.call = 0  # the kernel's call now running (keys are per call)
        self.stops = 0  # stops agreed in this call (keys are per stop)
        self.active: _GroupFit | None = None
        self.preempted = threading.Event()  # this rank's own SIGTERM was acted on
        self._wake = threading.Event()
        if client is not None and ranks > 1:
            threading.Thread(target=self._watch, name="mgkit-stops", daemon=True).start()

    def begin(self, call: int) -> None:
        """A new call from the kernel: its stops are keyed afresh."""
        if call != self.call:
            self.call, self.stops = call, 0

    def prefix(self) -> str:
        return f"mgkit/stop/{self.call}/{self.stops}"

    def enter(self, interrupts: Interrupts) -> _GroupFit | None:
        if self.client is None or self.ranks < 2:
            return None
        self.active = _GroupFit(self, self.prefix(), interrupts)
        self._wake.set()
        return self.active

    def leave(self, fit: _GroupFit | None) -> None:
        if fit is None:
            return
        if self.active is fit:
            self.active = None
        if fit.heard or fit.posted is not None or fit.interrupts.requested is not None:
            self.stops += 1

    def set(self, key: str, value: str) -> None:
        with contextlib.suppress(Exception):  # already there: the first one stands
            self.client.key_value_set(key, value)

    def listing(self, prefix: str) -> list[str]:
        try:
            return [v for _, v in self.client.key_value_dir_get(prefix)]
        except Exception:  # noqa: BLE001 - the group is going away: stop where we are
            return [str(0)] * self.ranks

    def _watch(self) -> None:
        """Waits on the active fit's notice key; notes what it says in that fit."""
        while True:
            fit = self.active
            if fit is None or fit.heard:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                value = self.client.blocking_key_value_get(f"{fit.prefix}/notice", _WAIT_MS)
            except Exception as e:  # noqa: BLE001 - not there yet (a deadline), or the group is gone
                if "DEADLINE" not in str(e).upper():
                    self._wake.wait(0.5)
                continue
            fit.heard = True
            reason, _, by = str(value).partition(" ")
            if self.active is fit and reason in (INTERRUPTED, PREEMPTED):
                fit.interrupts.note(reason, int(by) if by.isdigit() else None)

    def _sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM outside a fit: the others are told (nothing of this rank's to wait for), and
        the rank's code stops with ``PreemptedError``."""
        prefix = self.prefix()
        self.set(f"{prefix}/notice", f"{PREEMPTED} {self.rank}")
        self.set(f"{prefix}/at/{self.rank}", "out")
        self.stops += 1
        raise PreemptedError(
            f"rank {self.rank} was preempted (SIGTERM): it was not in a fit, so nothing was saved", self.rank
        )


_GROUP: list[Group] = []
_FITTING = [0]  # fits running in this process (their loops beat at every step)


def fitting() -> bool:
    """Whether a fit is running in this process (a cluster's watchdog counts silences then only)."""
    return _FITTING[0] > 0


def install(rank: int, ranks: int) -> Group:
    """Makes this process rank ``rank`` of ``ranks`` in a group whose fits stop together (a
    cluster's rank, after it joined ``jax.distributed``); SIGTERM then means preemption."""
    client = None
    if ranks > 1:
        with contextlib.suppress(ImportError, AttributeError):
            from jax._src.distributed import global_state

            client = global_state.client
    group = Group(rank, ranks, client)
    _GROUP[:] = [group]
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, group._sigterm)  # over JAX's own preemption notifier
    return group


def group() -> Group | None:
    """This process's group, where it is a cluster's rank."""
    return _GROUP[0] if _GROUP else None


class Interrupts:
    """A fit's stop requests: Ctrl-C (and, in a group, SIGTERM) noted while the fit runs, so its
    loop stops at a step boundary with the state of the last completed step. Off the main thread,
    where no handler can be set, Ctrl-C is left to Python.

    ``requested``: ``INTERRUPTED``, ``PREEMPTED`` or None; ``by``: the rank preempted;
    ``agreed(done)``: whether to stop at this boundary (at once, outside a group).
    """

    def __init__(self) -> None:
        self.requested: str | None = None
        self.by: int | None = None
        self.forced = False  # a second Ctrl-C: stop at the next boundary, agreed or not
        self._sigints = 0  # Ctrl-Cs this process got during the fit
        self._old: dict[int, Any] = {}
        self._fit: _GroupFit | None = None

    @property
    def urgent(self) -> bool:
        """Whether a wait for data may end now: a request that needs no agreement."""
        return self.requested is not None and (self._fit is None or self.forced)

    def note(self, reason: str, by: int | None = None) -> None:
        if self.requested is None or (reason == PREEMPTED and self.requested != PREEMPTED):
            self.requested, self.by = reason, by

    def agreed(self, done: int) -> bool:
        return self.forced or self._fit is None or self._fit.agreed(done)

    def _sigint(self, signum: int, frame: Any) -> None:
        self._sigints += 1
        if self._sigints > 1:  # this rank's own second Ctrl-C (a peer's notice is not one)
            self.forced = True
        self.note(INTERRUPTED)
        if self._fit is not None:
            self._fit.notice(INTERRUPTED)

    def _sigterm(self, signum: int, frame: Any) -> None:
        g = group()
        self.note(PREEMPTED, None if g is None else g.rank)
        if self._fit is not None:
            self._fit.notice(PREEMPTED)

    def __enter__(self) -> Interrupts:
        _FITTING[0] += 1
        if threading.current_thread() is threading.main_thread():
            g = group()
            self._old[signal.SIGINT] = signal.signal(signal.SIGINT, self._sigint)
            if g is not None:
                self._fit = g.enter(self)
                self._old[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._sigterm)
        return self

    def __exit__(self, *exc: Any) -> None:
        _FITTING[0] -= 1
        for signum, old in self._old.items():
            signal.signal(signum, old)
        late = self.requested is not None and group() is not None  # a rank: its kernel may signal again
        if late and self._old.get(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _Late(time.monotonic() + GRACE))
        self._old.clear()
        g = group()
        if g is not None:
            g.leave(self._fit)
        self._fit = None


class _Late:
    """In a cluster's rank, SIGINT just after a fit stopped for one: the same Ctrl-C (the kernel
    sends a second to ranks still running after a second), not a new one to raise while the
    fit's KeyboardInterrupt is on its way out; after ``until`` (``time.monotonic()``) it raises
    as ever. The engine's next cell starts with Python's handler again."""

    def __init__(self, until: float):
        self.until = until

    def __call__(self, signum: int, frame: Any) -> None:
        if time.monotonic() >= self.until:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt


def _exit_soon(delay: float = 1.0) -> None:
    """A preempted rank exits ``delay`` seconds after its fit raised ``PreemptedError`` (time for its
    reply to reach the kernel), as a process told to go by SIGTERM must."""
    threading.Event().wait(delay)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + signal.SIGTERM)  # what a process ended by SIGTERM reports
