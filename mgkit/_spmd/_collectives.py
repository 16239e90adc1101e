"""The communication XLA puts inside mgkit's compiled programs, read once per program and kind
of arguments (``_hlo``) and recorded in the ledger on each run as ``collective`` events.

How an op among a group of N contexts becomes ledger events (from -> to, bytes): the bytes
each context sends in the bandwidth-optimal ring algorithm, to the next context of its group
(B: the op's bytes on one participant, see ``_hlo``):

==================  ===================================================================
all-reduce          each sends 2 B (N-1)/N to the next (a reduce-scatter, then an all-gather)
all-gather          each sends B (N-1)/N to the next (B: the array gathered)
reduce-scatter      each sends B (N-1) to the next (B: the shard each keeps)
all-to-all          each sends B/N straight to each other context
collective-permute  each source sends B to its target
==================  ===================================================================

It is a model of the traffic, not a measurement (the library that runs the op may use a tree
or a device's own links), so the events are marked ``"read": "program"`` and take no seconds.
Per run of a program only the recording is added: its events are one cached ``Layout``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from .._ledger import Kind, Layout, execution_label, ledger
from .._oom import refuse_too_big
from .._table import Table, human_bytes
from ._caches import Cache
from ._hlo import Collective, collectives_in


class Reading(NamedTuple):
    """What one compiled program communicates, read once from it."""

    what: str  # the program, as events name it ("Trainer step", "pmap of f")
    collectives: tuple[Collective, ...]  # its communication ops, in program order
    contexts: tuple  # the contexts of the program's devices, in its device order (``Context``s)
    compiled: Any  # the compiled program, whose cost analysis ``Communication`` asks for
    layout: Layout | None  # the ledger events of one run; None where it communicates nothing
    seconds: float  # how long reading its collectives took (the cost analysis not asked)

    def record(self, start: float, info: dict | None = None) -> None:
        """Records one run issued at ``start`` (``time.time()``); ``info``: this run's own
        facts (the step), merged into every event's."""
        layout = self.layout
        if layout is not None:
            extra = None if info is None else (info,) * layout.size
            ledger().record(layout.call(start, 0.0, execution_label(), extra))


def traffic(c: Collective) -> dict[tuple[int, int], float]:
    """(source position, target position) -> bytes sent, for one op in one run of its program
    (the ring model above; an op in a loop, for each of its runs, ``c.runs``)."""
    out: dict[tuple[int, int], float] = {}
    nbytes = c.nbytes * (c.runs or 1)
    if c.op == "collective-permute":
        for a, b in c.pairs:
            if a != b:
                out[(a, b)] = out.get((a, b), 0.0) + nbytes
        return out
    for group in c.groups:
        n = len(group)
        if n < 2:
            continue
        if c.op == "all-to-all":
            for a in group:
                for b in group:
                    if a != b:
                        out[(a, b)] = out.get((a, b), 0.0) + nbytes / n
            continue
        per = {"all-reduce": 2 * nbytes * (n - 1) / n, "all-gather": nbytes * (n - 1) / n}
        sent = per.get(c.op, nbytes * (n - 1))  # reduce-scatter: B is the shard kept
        for k, a in enumerate(group):
            link = (a, group[(k + 1) % n])
            out[link] = out.get(link, 0.0) + sent
    return out


def layout_of(collectives: tuple[Collective, ...], contexts: tuple, what: str) -> Layout | None:
    """One run's ``collective`` events, one per (op, source, target) context: the bytes sent
    (``traffic``), with the ops' bytes and how many ran in ``info`` (an op in a loop once per
    trip; ``"trips": "unknown"`` where a loop's trips depend on the data, its ops counted once);
    None for no traffic."""
    links: dict[tuple[str, int, int], list] = {}
    for c in collectives:
        for (a, b), nbytes in traffic(c).items():
            if max(a, b) < len(contexts):
                entry = links.setdefault((c.op, a, b), [0.0, 0, 0, False])
                entry[0] += nbytes
                entry[1] += c.nbytes * (c.runs or 1)
                entry[2] += c.runs or 1
                entry[3] = entry[3] or c.runs is None
    if not links:
        return None
    share = 1.0 / len(links)
    rows = []
    for (op, a, b), (sent, nbytes, count, unknown) in links.items():
        src, dst = contexts[a], contexts[b]
        head = (Kind.COLLECTIVE, src.name, dst.name, src.short, dst.short, round(sent))
        info = {"op": op, "read": "program", "program": what, "ops": count, "bytes": nbytes}
        if unknown:
            info["trips"] = "unknown"
        rows.append((head, share, info))
    return Layout(rows)


def program_devices(compiled: Any) -> tuple | None:
    """The compiled program's devices in its order (its shardings' mesh), or None if unknown."""
    try:
        shardings = jax.tree_util.tree_leaves((compiled.input_shardings, compiled.output_shardings))
    except Exception:  # noqa: BLE001 - an executable that does not say: the caller's order
        return None
    for s in shardings:
        devices = getattr(getattr(s, "mesh", None), "devices", None)
        if devices is not None and hasattr(devices, "flat"):
            return tuple(devices.flat)
    return None


def cost_of(compiled: Any, what: str = "flops") -> float | None:
    """One figure of a compiled program's ``cost_analysis()`` per device (``"flops"``, ``"bytes
    accessed"``; a dict in JAX 0.4.30 and later, a list of one dict per program before), or None
    where it has none (or no program)."""
    try:
        analysis = None if compiled is None else compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without a cost analysis
        return None
    if isinstance(analysis, list | tuple):
        analysis = analysis[0] if analysis else None
    if not isinstance(analysis, dict):
        return None
    value = analysis.get(what)
    return float(value) if isinstance(value, int | float) and value >= 0 else None


def flops_of(compiled: Any) -> float | None:
    """The ``flops`` of a compiled program's cost analysis (``cost_of``)."""
    return cost_of(compiled, "flops")


def read_compiled(compiled: Any, contexts: tuple, what: str) -> Reading:
    """The communication of a compiled program (``jitted.lower(*args).compile()``) whose
    devices are those of ``contexts`` (``Context``s, in the program's device order unless the
    program says its own)."""
    t0 = time.perf_counter()
    by_device = {c.device: c for c in contexts}
    devices = program_devices(compiled)
    if devices is not None and all(d in by_device for d in devices):
        contexts = tuple(by_device[d] for d in devices)
    collectives = collectives_in(compiled.as_text(), len(contexts))
    layout = layout_of(collectives, contexts, what)
    return Reading(what, collectives, contexts, compiled, layout, time.perf_counter() - t0)


_RECORDING = [True]  # off only to measure what recording costs (benchmarks/bench_seeing.py)


def record_collectives(on: bool) -> None:
    """Turns the recording of collectives on (the default) or off, for every program."""
    _RECORDING[0] = bool(on)


class Watch:
    """The collectives of one jitted program, read on its first run with each kind of
    arguments (a compiled program is found in jit's caches, so reading compiles nothing
    again) and recorded on every run. At that first sight a program that needs more memory
    than its devices can hold is refused before it runs (``_oom.refuse_too_big``): a step that
    donates its arguments keeps them.

    Args:
      contexts: the contexts the program runs on (``Context``s).
      what: the program, as its events name it.
    """

    def __init__(self, contexts: tuple, what: str):
        self.contexts, self.what = tuple(contexts), what
        self._readings: dict[Any, Reading] = {}
        self.last: Reading | None = None  # the reading of the last program run

    def reading(self, program: Callable, args: tuple, kind: Any) -> Reading:
        """The reading of ``program`` for ``args``, whose kind (shapes and dtypes that can change
        between runs) is ``kind``; read on first sight of that program and kind."""
        found = self._readings.get((program, kind))  # a trainer has a program per accumulate and precision
        if found is None:
            try:
                compiled = program.lower(*args).compile()
            except Exception:  # noqa: BLE001 - the program's call raises it, with its own message
                found = Reading(self.what, (), self.contexts, None, None, 0.0)  # nothing to read
            else:
                found = self.last = read_compiled(compiled, self.contexts, self.what)
                refuse_too_big(compiled, [c.device for c in self.contexts])  # before it takes anything
            self._readings[(program, kind)] = found
        self.last = found
        return found

    def run(
        self, program: Callable, args: tuple, varying: Any, info: dict | None = None, record: bool = True
    ) -> Any:
        """``program(*args)``, its collectives recorded (with ``info``) unless ``record`` is
        False; ``varying``: the arguments whose shapes and dtypes may change between runs (the
        batch). A program that cannot fit its devices is refused before it runs (``reading``)."""
        reading = self.reading(program, args, kind_of(jax.tree_util.tree_leaves(varying)))
        start = time.time()
        out = program(*args)
        if record and _RECORDING[0]:
            reading.record(start, info)
        return out


def kind_of(leaves: list) -> tuple:
    """What a program's compiled form depends on among ``leaves``: shapes and dtypes."""
    return tuple((getattr(x, "shape", None), getattr(x, "dtype", type(x))) for x in leaves)


watches = Cache(256)  # jitted program -> its Watch, for programs run by mgkit's parallel ops


def _watch(program: Callable, contexts: tuple, what: str) -> Watch:
    """The ``Watch`` of a program run by mgkit's parallel ops (made on its first run)."""
    watch = watches.find(program)
    if watch is None:
        watch = Watch(contexts, what)
        watches.add(program, watch)
    return watch


def check_run(program: Callable, args: tuple, contexts: tuple, what: str) -> None:
    """Before ``program(*args)`` runs: refuses a program that needs more memory than its
    devices can hold (``Watch.reading``), as the error its run would give when read."""
    _watch(program, contexts, what).reading(program, args, kind_of(jax.tree_util.tree_leaves(args)))


def note_run(program: Callable, args: tuple, contexts: tuple, what: str, start: float) -> None:
    """Records the collectives of a run of ``program(*args)`` issued at ``start``; called after
    the run's call, so the program is compiled (and errors were raised by the call, with its
    own message)."""
    if not _RECORDING[0]:
        return
    watch = _watch(program, contexts, what)
    watch.reading(program, args, kind_of(jax.tree_util.tree_leaves(args))).record(start)


class Communication(Table):
    """What one run of a compiled program communicates, per op: how many, their bytes (on one
    participant), the bytes each context sends (the ring model of ``mgkit._spmd._collectives``)
    and how many contexts each op joins.

    Attributes:
      bytes: the ops' bytes per run (on one participant).
      sent: the bytes the busiest context sends per run.
      flops: floating-point operations per context and run (XLA's cost analysis), or None.
      intensity: ``flops / sent``: operations per byte communicated; high means the step is
        bound by compute and more contexts can help; inf where nothing is communicated.
      seconds: how long reading the program's collectives took (once per program; the cost
        analysis, asked here, not counted).
    """

    headers = ("op", "count", "bytes", "sent per context", "contexts")

    def __init__(self, reading: Reading):
        per_op: dict[str, list] = {}
        for c in reading.collectives:
            entry = per_op.setdefault(c.op, [0, 0, 0])
            entry[0] += c.runs or 1
            entry[1] += c.nbytes * (c.runs or 1)
            joined = max((len(g) for g in c.groups), default=len({p for pair in c.pairs for p in pair}))
            entry[2] = max(entry[2], joined)
        sent: dict[tuple[str, int], float] = {}
        for c in reading.collectives:
            for (a, _), nbytes in traffic(c).items():
                sent[(c.op, a)] = sent.get((c.op, a), 0.0) + nbytes
        rows = [
            (op, count, nbytes, round(max((v for (o, _), v in sent.items() if o == op), default=0)), n)
            for op, (count, nbytes, n) in per_op.items()
        ]
        per_context: dict[int, float] = {}
        for (_, a), v in sent.items():
            per_context[a] = per_context.get(a, 0.0) + v
        self.bytes = sum(r[2] for r in rows)
        self.sent = round(max(per_context.values(), default=0.0))
        self.flops, self.seconds = flops_of(reading.compiled), reading.seconds
        self.intensity = None if self.flops is None else self.flops / self.sent if self.sent else float("inf")
        flops = "unknown" if self.flops is None else f"{self.flops:.4g}"
        ratio = "n/a" if self.intensity is None else f"{self.intensity:.4g}"
        title = (
            f"{reading.what}: {human_bytes(self.bytes)} in {sum(r[1] for r in rows)} collective(s) "
            f"per step, {human_bytes(self.sent)} sent per context; {flops} flops per context; "
            f"arithmetic intensity {ratio} flops/byte"
        )
        if any(c.runs is None for c in reading.collectives):
            title += " (ops in loops whose trips depend on the data counted once)"
        super().__init__(rows, title)

    def _display_rows(self) -> list[tuple]:
        return [(op, c, human_bytes(b), human_bytes(s), n) for op, c, b, s, n in self._rows]


def communication(watch: Watch | None, where: str, why_none: str) -> Communication:
    """The ``Communication`` of the last program ``watch`` saw run, or an error that says why
    there is none: ``why_none`` where there is no watch (no compiled program spans the contexts)."""
    if watch is None:
        raise ValueError(f"{where}: {why_none}")
    if watch.last is None:
        raise RuntimeError(
            f"{where}: no step has run yet, so there is no compiled step to read its communication "
            "from; run a step first (e.g. tr.fit(data, steps=1)) and ask again"
        )
    return Communication(watch.last)
