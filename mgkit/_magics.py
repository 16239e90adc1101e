"""IPython magics: ``%mgkit`` (devices, contexts, simulate, dashboard, ledger, help), ``%%on``,
``%%mgkit_all`` (a cell on every rank of a cluster), ``%%mgkit_peak`` and ``%%mgkit_profile``.
Loaded with ``%load_ext mgkit``; ``import mgkit`` alone
never imports IPython.

Arguments are split like a shell command line (``shlex``) and checked strictly: misuse raises
IPython's ``UsageError`` naming the bad value and the valid choices. ``{expr}`` and ``$var`` are
never expanded (every magic is ``@no_var_expand``) and are rejected, and nothing is evaluated.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import inspect
import re
import shlex
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class, no_var_expand
from IPython.display import display

from . import _contexts, _devices
from ._errors import ContextError
from ._ledger import Event, execution_label, ledger, short_label
from ._peaks import Peak, PeakWatch
from ._profile import profile
from ._table import Table, human_bytes
from ._transfer import synchronize

# subcommand -> usage; the docstring of ``%mgkit`` (its ``%mgkit?`` help) shows each of these lines
_COMMANDS = {
    "devices": "%mgkit devices",
    "contexts": "%mgkit contexts [MAP]",
    "simulate": "%mgkit simulate N",
    "dashboard": "%mgkit dashboard",
    "ledger": "%mgkit ledger [--clear]",
    "help": "%mgkit help",
}
_ON_USAGE = "%%on CONTEXT"
_PEAK_USAGE = "%%mgkit_peak"
_PROFILE_USAGE = "%%mgkit_profile [--dir FOLDER] [--python]"
_PROFILE_OPTIONS = ("--dir", "--python")
_EXPANSION = re.compile(r"[{}$]")

HOST = _contexts.HOST
DIRECTIONS = ("host->device", "device->host", "device->device")


def _usage(sub: str) -> str:
    return f"usage: {_COMMANDS[sub]}"


def _tokens(magic: str, line: str, usage: str) -> list[str]:
    """Splits a magic's arguments like a shell; rejects {expr} and $var, which are never expanded."""
    if _EXPANSION.search(line):
        word = next(w for w in line.split() if _EXPANSION.search(w))
        raise UsageError(
            f"{magic} {line.strip()}: {word} is taken literally, not expanded: mgkit magics do not "
            "support {expr} or $var expansion. Write the value itself, or call mgkit from Python with "
            f"a variable (e.g. mg.use_contexts(spec) or `with mg.on(name):`). {usage}"
        )
    try:
        return shlex.split(line)
    except ValueError as e:  # an unclosed quote
        raise UsageError(f"{magic} {line.strip()}: cannot split the arguments ({e}); {usage}") from None


def _expect(sub: str, args: list[str], wanted: int, example: str = "") -> None:
    """Raises UsageError unless ``%mgkit sub`` got exactly ``wanted`` arguments."""
    if len(args) < wanted:
        raise UsageError(f"%mgkit {sub}: missing argument; {_usage(sub)}{example}")
    if len(args) > wanted:
        extra = " ".join(args[wanted:])
        raise UsageError(f"%mgkit {sub}: unexpected argument(s) {extra!r}; {_usage(sub)}")


def _closest(word: str, choices: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


class ContextTable(Table):
    """The current context map: context -> device, the device's description, the current context."""

    headers = ("context", "device", "description", "current")


def context_table() -> ContextTable:
    cmap = _contexts.context_map()
    devs = cmap.devices()
    now = _contexts.current()
    rows = [(n, cmap[n], _devices.describe(devs[n]), "*" if n == now else "") for n in cmap]
    return ContextTable(rows, title=f"context map {cmap}")


class PeakRow(NamedTuple):
    """One context in a ``%%mgkit_peak`` report."""

    context: str  # the context's name
    device: str  # its device's short name
    peak: int | None  # the most bytes in use on the device within the cell (None: not known)
    host_to_device: int  # bytes the context received from the host
    device_to_host: int  # bytes it sent to the host
    device_to_device: int  # bytes it received from other contexts
    exact: bool  # True: the allocator's peak, raised by the cell; False: a lower bound
    source: str | None  # where ``peak`` comes from: "allocator" or "live arrays"


class PeakReport(Table):
    """What a ``%%mgkit_peak`` cell did, per context: the most memory in use on its device within
    the cell, bytes moved, wall time. Rows are ``PeakRow``s.

    ``peak`` is exact where the device's allocator reports its peak and the cell raised it; else
    it is a lower bound (JAX cannot reset the allocator's peak), marked ``>=``: the most in use
    seen while the cell ran, from the allocator, or from the live arrays sampled in a thread
    where the device reports no statistics (CPU; temporaries inside a compiled program are not
    live arrays). ``peak_raised`` names the devices whose allocator peak the cell raised.
    """

    headers = ("context", "device", "peak memory", *DIRECTIONS)

    def __init__(
        self,
        rows: Sequence[PeakRow],
        seconds: float,
        moved: dict[str, tuple[int, int]],
        label: int | None,
        peak_raised: frozenset[str],
    ):
        self.seconds = seconds
        self.moved = moved
        self.label = label
        self.peak_raised = peak_raised
        totals = ", ".join(f"{d} {human_bytes(b)} in {c} event(s)" for d, (c, b) in moved.items())
        cell = f"cell [{label}]" if label is not None else "cell"
        note = (
            "\npeak: within the cell; >= a lower bound (the allocator's peak was not raised, or live "
            "arrays sampled: temporaries inside compiled programs are not seen)"
        )
        super().__init__(rows, title=f"mgkit_peak: {cell} took {seconds:.3f} s wall; moved {totals}{note}")

    def _display_rows(self) -> list[tuple]:
        out = []
        for r in self._rows:
            if r.peak is None:
                shown = "n/a"
            elif r.exact:
                shown = human_bytes(r.peak) + " (this cell)"
            else:
                shown = f">= {human_bytes(r.peak)}" + (
                    " (live arrays)" if r.source == _devices.LIVE_ARRAYS else ""
                )
            moved = (r.host_to_device, r.device_to_host, r.device_to_device)
            out.append(
                (short_label(r.context), r.device, shown, *(human_bytes(b) if b else "." for b in moved))
            )
        return out


class _Meter:
    """Counts the bytes moved by the ledger events issued from ``start`` on, by direction and context."""

    def __init__(self, start: float):
        self.start = start
        self._lock = threading.Lock()
        self.by_context: dict[str, list[int]] = {}
        self.devices: dict[str, str] = {}
        self.moved = {d: [0, 0] for d in DIRECTIONS}

    def __call__(self, e: Event) -> None:
        if e.start < self.start or e.nbytes == 0 or e.src == e.dst:
            return
        if e.src == HOST:
            direction, name, dev = DIRECTIONS[0], e.dst, e.dst_device
        elif e.dst == HOST:
            direction, name, dev = DIRECTIONS[1], e.src, e.src_device
        else:
            direction, name, dev = DIRECTIONS[2], e.dst, e.dst_device
        column = DIRECTIONS.index(direction)
        with self._lock:
            self.moved[direction][0] += 1
            self.moved[direction][1] += e.nbytes
            self.by_context.setdefault(name, [0, 0, 0])[column] += e.nbytes
            self.devices.setdefault(name, dev)


def _mapped_devices() -> dict[str, jax.Device]:
    """Short device name -> device for every context of the current map."""
    return {_devices.short_name(d): d for d in _contexts.context_map().devices().values()}


@magics_class
class MgkitMagics(Magics):
    """``%mgkit``, ``%%on``, ``%%mgkit_all``, ``%%mgkit_peak`` and ``%%mgkit_profile``."""

    @no_var_expand
    @line_magic
    def mgkit(self, line: str = "") -> None:
        """mgkit: named device contexts, transfers and live views.

        Usage::

          %mgkit devices               list every device JAX can see (mg.devices())
          %mgkit contexts [MAP]        set the context map, e.g. %mgkit contexts dev0->cpu0;dev1->cpu1
                                       (mg.use_contexts(MAP)); with no MAP, show the current map
          %mgkit simulate N            give JAX N CPU devices (mg.simulate(N)); only before JAX's
                                       first operation, e.g. right after %load_ext mgkit
          %mgkit dashboard             show the live dashboard (mg.Dashboard())
          %mgkit ledger [--clear]      show the ledger summary (mg.ledger().summary());
                                       --clear empties the ledger after showing it
          %mgkit help                  show this help

        Cell magics::

          %%on CONTEXT                 run the cell with CONTEXT as the default device context
                                       (like `with mg.on(CONTEXT):`); its variables stay defined
          %%mgkit_peak                 run the cell, then report per context the device's peak
                                       memory (n/a where the device does not report it), bytes
                                       moved host->device, device->host and device->device, and
                                       the wall time; the report is kept as `_mgkit_peak`
          %%mgkit_profile [--dir D] [--python]
                                       run the cell under jax.profiler and draw a timeline per
                                       context (mg.profile()); kept as `_mgkit_profile`

        Arguments are taken literally: {expr} and $var are not expanded and are rejected.
        """
        args = _tokens("%mgkit", line, "Type %mgkit? for help.")
        if not args:
            raise UsageError(
                f"%mgkit: missing subcommand; the subcommands are {', '.join(_COMMANDS)}. "
                "Type %mgkit? for help."
            )
        sub, rest = args[0], args[1:]
        if sub not in _COMMANDS:
            raise UsageError(
                f"%mgkit: unknown subcommand {sub!r}{_closest(sub, list(_COMMANDS))}; the subcommands "
                f"are {', '.join(_COMMANDS)}. Type %mgkit? for help."
            )
        getattr(self, f"_{sub}")(rest)

    def _devices(self, args: list[str]) -> None:
        _expect("devices", args, 0)
        display(_devices.devices())

    def _contexts(self, args: list[str]) -> None:
        if not args:
            display(context_table())
            return
        spec = " ".join(args)  # 'dev0->cpu0; dev1->cpu1' arrives as two words
        try:
            _contexts.use_contexts(spec)
        except ContextError as e:
            raise UsageError(
                f"%mgkit contexts {spec}: {e}\n{_usage('contexts')}, "
                "e.g. %mgkit contexts dev0->cpu0;dev1->cpu1"
            ) from None

    def _simulate(self, args: list[str]) -> None:
        example = ", e.g. %mgkit simulate 8"
        _expect("simulate", args, 1, example)
        if not re.fullmatch(r"[0-9]+", args[0]):
            raise UsageError(
                f"%mgkit simulate: {args[0]!r} is not a whole number of CPU devices; "
                f"{_usage('simulate')}{example}"
            )
        n = int(args[0])
        started = _devices.backend_started()
        try:
            _devices.simulate(n)
        except (ValueError, RuntimeError) as e:
            raise UsageError(f"%mgkit simulate {n}: {e}") from None
        if started:
            print(f"mgkit: JAX already runs with {n} CPU device(s)")
        else:
            print(f"mgkit: JAX will start with {n} simulated CPU device(s)")

    def _dashboard(self, args: list[str]) -> None:
        _expect("dashboard", args, 0)
        from .views import Dashboard

        display(Dashboard())

    def _ledger(self, args: list[str]) -> None:
        for i, arg in enumerate(args):
            if arg != "--clear":
                raise UsageError(
                    f"%mgkit ledger: unknown argument {arg!r}{_closest(arg, ['--clear'])}; {_usage('ledger')}"
                )
            if i:
                raise UsageError(f"%mgkit ledger: '--clear' given more than once; {_usage('ledger')}")
        display(ledger().summary())
        if args:
            ledger().clear()
            print("mgkit: ledger cleared")

    def _help(self, args: list[str]) -> None:
        _expect("help", args, 0)
        print(inspect.cleandoc(self.mgkit.__doc__))

    @no_var_expand
    @cell_magic
    def on(self, line: str, cell: str) -> Any:
        """Runs the cell with CONTEXT as the default device context, like ``with mg.on(CONTEXT):``.

        Usage::

          %%on CONTEXT

        Arrays the cell creates land on CONTEXT's device and ``mg.current()`` is CONTEXT inside.
        The cell's variables are defined in the notebook as usual, and the value of its last line
        is its output. An error in the cell shows as usual and the previous context is restored.
        CONTEXT is a context name (``%mgkit contexts`` lists them) or a device name such as cpu1.
        """
        args = _tokens("%%on", line, f"usage: {_ON_USAGE}")
        if len(args) != 1:
            what = f"one context expected, got {len(args)}: {line.strip()!r}" if args else "missing context"
            names = ", ".join(_contexts.context_map().names)
            raise UsageError(f"%%on: {what}; usage: {_ON_USAGE}, e.g. %%on dev1 (the contexts are {names})")
        try:
            scope = _contexts.on(args[0])
        except ContextError as e:
            raise UsageError(f"%%on {args[0]}: {e}\nusage: {_ON_USAGE}") from None
        __tracebackhide__ = True
        with scope:
            return self._run(cell, "%%on")

    @no_var_expand
    @cell_magic
    def mgkit_all(self, line: str, cell: str) -> None:
        """Runs the cell on every rank of the newest open ``mg.Cluster``, each in its own
        namespace: names the cell defines stay in each rank for the next ``%%mgkit_all`` cell.

        Usage::

          %%mgkit_all

        Each rank's output appears under the cell as it comes, prefixed ``[rank r@host]``; an
        exception in a rank raises one ``mg.LaunchError`` naming every rank's fate.
        """
        if line.strip():
            raise UsageError(f"%%mgkit_all takes no arguments, got {line.strip()!r}; usage: %%mgkit_all")
        from .cluster import current as current_cluster

        cluster = current_cluster()
        if cluster is None:
            raise UsageError(
                "%%mgkit_all: no cluster is open; make one first, e.g. c = mg.Cluster(engines=2, "
                "devices_per_engine=2), then run the cell again"
            )
        __tracebackhide__ = True
        cluster.run_cell(cell)

    @no_var_expand
    @cell_magic
    def mgkit_peak(self, line: str, cell: str) -> Any:
        """Runs the cell, then reports what it did on each context.

        Usage::

          %%mgkit_peak

        Per context: the most memory in use on its device within the cell. Where the device's
        allocator reports its peak (GPUs, TPUs) and the cell raised it, that peak, marked "(this
        cell)"; JAX cannot reset the peak, so where the cell did not raise it the figure is the
        most in use seen while the cell ran, marked ">=" (a lower bound). Where the device
        reports no statistics (CPU), the live jax arrays on it are summed in a thread while the
        cell runs (">= ... (live arrays)": temporaries inside a compiled program are not seen).
        Then the bytes it received from the host (host->device),
        sent to the host (device->host) and received from other contexts (device->device), from
        the ledger events the cell issued; and the cell's wall time, including the wait for the
        work it dispatched. The report is displayed (text, or a table in a notebook) and kept in
        the variable ``_mgkit_peak``; the cell's last value is its output as usual. When the
        cell raises, the report covers what ran and the error shows as usual.
        """
        _tokens("%%mgkit_peak", line, f"usage: {_PEAK_USAGE}")
        if line.strip():
            raise UsageError(f"%%mgkit_peak takes no arguments, got {line.strip()!r}; usage: {_PEAK_USAGE}")
        __tracebackhide__ = True
        watch = PeakWatch(list(_mapped_devices().values())).start()
        label = execution_label()
        meter = _Meter(time.time())
        unsubscribe = ledger().subscribe(meter)
        t0 = time.perf_counter()
        try:
            value = self._run(cell, "%%mgkit_peak")
            synchronize()
        finally:
            seconds = time.perf_counter() - t0
            ledger().flush()
            unsubscribe()
            report = _peak_report(meter, watch.stop(), seconds, label)
            self.shell.user_ns["_mgkit_peak"] = report
            display(report)
        return value

    @no_var_expand
    @cell_magic
    def mgkit_profile(self, line: str, cell: str) -> Any:
        """Runs the cell under ``jax.profiler``'s trace and draws a timeline per context.

        Usage::

          %%mgkit_profile [--dir FOLDER] [--python]

        Like ``with mg.profile(FOLDER) as prof:`` around the cell: each trainer step is marked,
        and when the cell ends the trace's path is printed (for XProf or Perfetto) and a timeline
        is drawn inline (SVG: no server, no internet), a row per context with its compute,
        communication, transfers and idle time, each block labelled with its program and step.
        The ``Profile`` is kept in ``_mgkit_profile`` (``_mgkit_profile.summary()``: the shares).

        Options:
          --dir FOLDER   the trace folder (default: mgkit-profiles in the temporary folder)
          --python       also trace every Python call (slower)

        When the cell raises (Ctrl-C included), the trace stops, is kept, and the error shows.
        """
        dir_, python = _profile_options(_tokens("%%mgkit_profile", line, f"usage: {_PROFILE_USAGE}"))
        prof = profile(dir_, python=python)
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(prof)
        except (OSError, RuntimeError) as e:
            raise UsageError(f"%%mgkit_profile {line.strip()}: {e}; usage: {_PROFILE_USAGE}") from None
        self.shell.user_ns["_mgkit_profile"] = prof
        __tracebackhide__ = True
        with stack:
            return self._run(cell, "%%mgkit_profile")

    def _run(self, cell: str, magic: str) -> Any:
        """Runs cell code in the user's namespace as IPython would; returns its last expression's value."""
        __tracebackhide__ = True
        shell = self.shell
        code = shell.transform_cell(cell)
        label = execution_label()
        filename = shell.compile.cache(code, shell.execution_count if label is None else label, cell)
        tree = shell.transform_ast(shell.compile.ast_parse(code, filename=filename))
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        try:  # compile all before running any, so that a cell that cannot run does not half run
            body = shell.compile(tree, filename, "exec")
            value = None if last is None else shell.compile(last, filename, "eval")
        except SyntaxError as e:
            if "outside" in (e.msg or "") and ("await" in e.msg or "async" in e.msg):
                raise UsageError(
                    f"{magic}: the cell uses top-level await ({e.msg}, line {e.lineno}), which cannot run "
                    f"inside {magic}; nothing ran. Run the awaiting code in a cell without {magic}."
                ) from None
            raise
        exec(body, shell.user_global_ns, shell.user_ns)
        return None if value is None else eval(value, shell.user_global_ns, shell.user_ns)


def _profile_options(args: list[str]) -> tuple[str | None, bool]:
    """``%%mgkit_profile``'s options: (the trace folder or None, whether to trace Python calls)."""
    folder, python = None, False
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        name, eq, value = arg.partition("=")
        if name == "--dir":
            if not eq:
                if not rest or rest[0].startswith("--"):
                    raise UsageError(
                        f"%%mgkit_profile: --dir needs a folder, e.g. --dir profiles; usage: {_PROFILE_USAGE}"
                    )
                value = rest.pop(0)
            if folder is not None:
                raise UsageError(f"%%mgkit_profile: --dir given more than once; usage: {_PROFILE_USAGE}")
            folder = value
        elif arg == "--python":
            python = True
        else:
            what = "option" if arg.startswith("-") else "argument"
            raise UsageError(
                f"%%mgkit_profile: unknown {what} {arg!r}{_closest(name, _PROFILE_OPTIONS)}; the options "
                f"are {', '.join(_PROFILE_OPTIONS)}; usage: {_PROFILE_USAGE}"
            )
    return folder, python


def _peak_report(
    meter: _Meter, peaks: dict[jax.Device, Peak], seconds: float, label: int | None
) -> PeakReport:
    by_short = {_devices.short_name(d): p for d, p in peaks.items()}
    raised = frozenset(d for d, p in by_short.items() if p.exact)
    cmap = _contexts.context_map()
    mapped = {n: _devices.short_name(d) for n, d in cmap.devices().items()}
    rows = []
    unknown = Peak(None, False, None, 0)
    for name in [*mapped, *(n for n in meter.by_context if n not in mapped)]:
        dev = mapped[name] if name in mapped else meter.devices[name]
        peak = by_short.get(dev, unknown)
        moved = meter.by_context.get(name, (0, 0, 0))
        rows.append(PeakRow(name, dev, peak.peak, *moved, peak.exact, peak.source))
    moved = {d: (c, b) for d, (c, b) in meter.moved.items()}
    return PeakReport(rows, seconds, moved, label, raised)


def load_ipython_extension(ipython) -> None:
    """Registers ``%mgkit``, ``%%on``, ``%%mgkit_peak`` and ``%%mgkit_profile`` (``%load_ext mgkit``)."""
    ipython.register_magics(MgkitMagics)


def unload_ipython_extension(ipython) -> None:
    """Removes the magics ``load_ipython_extension`` registered (``%unload_ext mgkit``)."""
    manager = ipython.magics_manager
    manager.magics["line"].pop("mgkit", None)
    manager.magics["cell"].pop("on", None)
    manager.magics["cell"].pop("mgkit_peak", None)
    manager.magics["cell"].pop("mgkit_profile", None)
    manager.registry.pop(MgkitMagics.__name__, None)
