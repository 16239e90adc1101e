"""``mg.profile()``: a profiler trace of a block, read back into a timeline per context.

``with mg.profile() as prof:`` runs ``jax.profiler``'s trace around the block, marks each
trainer step (``StepTraceAnnotation``), and when the block ends keeps the trace (its path is
printed, for XProf or Perfetto), reads it (``_profile_read``) and, in IPython, draws the timeline
inline (``mg.ProfileView``, an SVG: no server, no internet). ``prof.summary()`` gives each
context's shares of compute, communication, transfers and idle time.

One profile runs at a time. A block that raises (Ctrl-C included) still stops the trace and
keeps what it captured; the error goes on.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from . import _contexts
from ._ledger import Kind, ledger
from ._profile_read import ANCHOR, CATEGORIES, STEP_NAME, Timeline, device_key, from_ledger, read_trace
from ._table import Table
from ._transfer import synchronize

DEFAULT_FOLDER = os.path.join(tempfile.gettempdir(), "mgkit-profiles")
_lock = threading.Lock()
_active: Profile | None = None  # the profile running now, if any
_count = 0  # profiles started in this process: names each run's folder


class ProfileSummary(Table):
    """Each context's share of the profile's window spent computing, communicating (collectives),
    receiving copies (transfers) and idle; rows ``(context, compute, communication, transfer,
    idle, window seconds)``, shares summing to 1."""

    headers = ("context", "compute", "communication", "transfers", "idle", "window")

    def _display_rows(self) -> list[tuple]:
        return [(r[0], *(f"{v:.1%}" for v in r[1:5]), f"{r[5] * 1e3:.2f} ms") for r in self._rows]


def step_scope(method: Callable) -> Callable:
    """Marks each call of a trainer's step dispatch as a step in the running profile (a
    ``StepTraceAnnotation`` named ``mgkit step`` with the step number); a plain call when no
    profile runs."""

    @functools.wraps(method)
    def dispatch(trainer: Any, *args: Any) -> Any:
        if _active is None:
            return method(trainer, *args)
        with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=trainer.step + 1):
            return method(trainer, *args)

    return dispatch


def profile(path: str | os.PathLike | None = None, *, python: bool = False, show: bool = True) -> Profile:
    """A profile of the block it wraps: ``with mg.profile() as prof: tr.fit(...)``.

    Args:
      path: the folder the trace goes in (made if missing; XProf's ``--logdir``); None: a
        ``mgkit-profiles`` folder in the system's temporary folder.
      python: also trace every Python call (slower; seen in XProf/Perfetto, not in the timeline).
      show: print the trace's path when the block ends, and in IPython draw the timeline.

    Returns:
      A ``Profile``: after the block, ``prof.trace`` (the file), ``prof.timeline``,
      ``prof.summary()`` and ``prof.view()``.
    """
    return Profile(path, python=python, show=show)


class Profile:
    """One profiler trace of a block, and what it shows per context (see ``mg.profile``).

    Attributes:
      folder: the trace folder (``--logdir`` for XProf).
      trace: the ``.xplane.pb`` file written, once the block has ended.
      seconds: the block's wall time.
      error: the error that ended the block, or None.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, python: bool = False, show: bool = True):
        where = "mg.profile()"
        if path is not None and not isinstance(path, str | os.PathLike):
            raise TypeError(
                f"{where}: path must be a folder name (str or os.PathLike) or None, got "
                f"{type(path).__name__} {path!r}; e.g. mg.profile('profiles')"
            )
        for name, value in (("python", python), ("show", show)):
            if not isinstance(value, bool):
                raise TypeError(
                    f"{where}: {name} must be True or False, got {type(value).__name__} {value!r}"
                )
        self.folder = os.path.abspath(os.fspath(path)) if path is not None else DEFAULT_FOLDER
        self.python, self.show = python, show
        self.trace: str | None = None
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._state = "new"  # new, running, done
        self._timeline: Timeline | None = None
        self._anchor: Any = None
        self._wall = 0.0

    # -- running -------------------------------------------------------------------------

    def __enter__(self) -> Profile:
        global _active, _count
        if self._state != "new":
            raise RuntimeError(
                f"this profile ran already (trace {self.trace}); a profile runs once: "
                "start another with `with mg.profile() as prof:`"
            )
        synchronize()  # work dispatched before the block ends before the trace starts
        with _lock:
            if _active is not None:
                raise RuntimeError(
                    f"a profile is running already (writing to {_active.folder}); profiles do not nest: "
                    "end the outer `with mg.profile()` (or %%mgkit_profile cell) before starting another"
                )
            check_folder(self.folder)
            _count += 1
            self._session = f"mgkit_{time.strftime('%Y_%m_%d_%H_%M_%S')}_{os.getpid()}_{_count}"
            try:
                self._session = start_trace(self.folder, self.python, self._session)
            except RuntimeError as e:
                raise RuntimeError(
                    f"mg.profile(): jax.profiler has a trace running already ({e}); stop it with "
                    "jax.profiler.stop_trace() (one trace runs at a time), then profile again"
                ) from None
            _active = self
            self._state = "running"
        self._wall = time.time()
        self._anchor = jax.profiler.TraceAnnotation(ANCHOR)
        self._anchor.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, tb: Any) -> bool:
        global _active
        try:
            if error is None:
                synchronize()  # the work the block dispatched ends inside the trace
        finally:
            self.seconds = time.perf_counter() - self._t0
            try:
                self._anchor.__exit__(None, None, None)
            finally:
                with _lock:
                    _active = None
                    self._state = "done"
                    jax.profiler.stop_trace()
        self.error = error
        self.trace = self._find_trace()
        self._moves = [e for e in ledger().records() if e.start >= self._wall and e.kind in Kind.MOVES]
        if self.show:
            self._report()
        return False

    def _find_trace(self) -> str | None:
        """The ``.xplane.pb`` this profile wrote: in its session's folder, else the newest."""
        base = os.path.join(self.folder, "plugins", "profile")
        runs = [self._session] if self._session else sorted(os.listdir(base), reverse=True)
        for run in runs:
            folder = os.path.join(base, run)
            found = (
                sorted(f for f in os.listdir(folder) if f.endswith(".xplane.pb"))
                if os.path.isdir(folder)
                else []
            )
            if found:
                return os.path.join(folder, found[0])
        return None

    def _report(self) -> None:
        """Prints where the trace is; in IPython draws the timeline (not after an error)."""
        print(self.where())
        if self.error is None:
            from .views import show_profile  # a view: loaded when drawn

            show_profile(self)

    # -- reading -------------------------------------------------------------------------

    def where(self) -> str:
        """One line: what was captured and where the trace is kept."""
        if self._state == "new":
            return f"mgkit profile: not started (`with` it); it will write to {self.folder}"
        if self._state == "running":
            return f"mgkit profile: running, writing to {self.folder}"
        how = "" if self.error is None else f"stopped by {type(self.error).__name__}; "
        return (
            f"mgkit profile: {how}{self.seconds:.3f} s captured; trace kept at {self.trace} "
            f"(XProf: xprof --logdir {self.folder}; Perfetto: open the .trace.json.gz beside it)"
        )

    @property
    def timeline(self) -> Timeline:
        """The trace read back, a row per context (read on first use)."""
        if self._state != "done":
            raise RuntimeError(
                "mg.profile(): the profile is still running; read prof.timeline, prof.summary() and "
                "prof.view() after the `with` block (or the %%mgkit_profile cell) has ended"
            )
        if self._timeline is None:
            self._timeline = self._read()
        return self._timeline

    def _read(self) -> Timeline:
        cmap = _contexts.context_map()
        names: dict[int, str] = {}
        for name, device in cmap.devices().items():
            names.setdefault(device_key(device), name)
        if self.trace is not None:
            try:
                return read_trace(self.trace, names, self._wall, self._moves)
            except (ImportError, AttributeError, ValueError, RuntimeError):
                pass  # a jax without ProfileData, or a trace it cannot read: the ledger's view
        return from_ledger([e for e in ledger().records() if e.start >= self._wall])

    def summary(self) -> ProfileSummary:
        """Each context's share of the window: compute, communication, transfers, idle."""
        tl = self.timeline
        rows = [
            (ctx, *(getattr(s, c) for c in CATEGORIES), s.idle, tl.window) for ctx, s in tl.shares.items()
        ]
        return ProfileSummary(rows, f"mgkit profile: {tl.about}")

    def view(self, widget: bool | None = None) -> Any:
        """The timeline as a view (``mg.ProfileView``): inline SVG, text, ``save_png``."""
        from .views import ProfileView  # a view: loaded when drawn

        return ProfileView(self, widget=widget)

    def __repr__(self) -> str:
        return self.where()


def start_trace(folder: str, python: bool, session: str) -> str | None:
    """Starts jax's trace into ``folder``, Python calls traced or not, in the run folder
    ``session`` where this jax can name it; returns the run folder's name, or None (jax's own)."""
    options = jax.profiler.ProfileOptions()
    if hasattr(options, "python_tracer_level"):
        options.python_tracer_level = 1 if python else 0
    named = hasattr(options, "session_id")  # each run its own folder, even two in one second
    if named:
        options.session_id = session
    jax.profiler.start_trace(folder, profiler_options=options)
    return session if named else None


def check_folder(folder: str) -> None:
    """Makes the trace folder and checks a file can be written in it, before any trace starts."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise NotADirectoryError(
            f"mg.profile(): the trace folder {folder!r} is a file, not a folder; pass another path "
            "(mg.profile('profiles'), %%mgkit_profile --dir profiles) or move the file"
        )
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".mgkit-write-check-"):
            pass
    except OSError as e:
        raise PermissionError(
            f"mg.profile(): cannot write the trace in {folder!r} ({e.strerror or e}); pass a folder you "
            "can write (mg.profile('profiles'), %%mgkit_profile --dir profiles)"
        ) from None


def active() -> Profile | None:
    """The profile running now, or None."""
    return _active
