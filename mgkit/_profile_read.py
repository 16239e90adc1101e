"""Reading a profiler trace into a timeline per context: what each context computed,
communicated and received, when, for which program and step, and its share of each.

``read_trace`` reads the ``.xplane.pb`` that ``jax.profiler`` writes with ``jax.profiler.ProfileData``
(part of jaxlib: no TensorFlow, XProf or TensorBoard needed). On a GPU the ops of each device
plane (``/device:GPU:N``) are placed on rows per stream; on CPU, where XLA's ops run on host
threads, each op is placed on the context whose device ran it (its ``device_ordinal``) and the
Python thread's step dispatch is the ``host`` row. The copies mgkit makes (puts, splits,
transfers) come from the ledger's times. ``from_ledger`` builds the timeline from the ledger
alone, where the trace cannot be read.

A step is the trainer's step the op belongs to: by the program run (``run_id``) dispatched inside
the step's ``StepTraceAnnotation``, else the last step started before the op; mgkit's copies
carry none (a batch's copy comes before its step).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from ._ledger import Event, Kind

STEP_NAME = "mgkit step"  # the StepTraceAnnotation around each trainer step
ANCHOR = "mgkit profile"  # the TraceAnnotation around the whole profile: times it to the wall clock

COMPUTE, COMMUNICATION, TRANSFER, HOST = "compute", "communication", "transfer", "host"
CATEGORIES = (COMPUTE, COMMUNICATION, TRANSFER)  # what a context's busy time is made of
HOST_ROW = "host"

_COLLECTIVE = re.compile(
    r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|collective-broadcast|"
    r"^send|^recv|nccl|AllReduce|AllGather|ReduceScatter|AllToAll|SendRecv",
    re.I,
)
_COPY = re.compile(r"^memcpy|MemcpyH2D|MemcpyD2H|MemcpyD2D|MemcpyP2P", re.I)
_GPU_PLANE = re.compile(r"^/device:(?:GPU|TPU):(\d+)")
_NOT_OPS = ("end: ", "ThreadpoolListener", "$")  # host events that are no op: skipped unread
_MERGE_GAP = 0.002  # ops closer than this share of the window are drawn as one block


class Span(NamedTuple):
    """One block of the timeline: work of one category, one program and one step, on one row."""

    row: str  # the context (on a GPU ``<context> stream <n>``), or ``host``
    context: str | None  # the context it ran on; None on the host row
    category: str  # compute, communication, transfer, or host (the host's step dispatch)
    program: str  # the compiled program (``jit_step``), or the ledger's kind of copy (``split``)
    step: int | None  # the trainer's step, None where no step was running
    start: float  # seconds from the timeline's start
    end: float  # seconds from the timeline's start

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Shares(NamedTuple):
    """One context's time in the window, by category: the four sum to 1."""

    compute: float  # computing (and not communicating or copying at the same time)
    communication: float  # in a collective (all-reduce, all-gather, ...)
    transfer: float  # receiving a copy (a put, a split, a transfer), outside a collective
    idle: float  # none of these


class Timeline(NamedTuple):
    """What a profile saw, a row per context."""

    rows: tuple[str, ...]  # top to bottom: the contexts (or their streams), then ``host``
    spans: tuple[Span, ...]  # the blocks drawn, ops of one program and step merged, by start
    shares: Mapping[str, Shares]  # context -> its shares of the window
    window: float  # seconds from the first block's start to the last one's end
    source: str  # "device streams", "host threads" (CPU) or "ledger" (the trace was not read)
    steps: tuple[int, ...]  # the trainer steps seen, in order
    notes: tuple[str, ...]  # what the picture should say about how it was made

    @property
    def about(self) -> str:
        """One line: the steps, contexts, window and source (``steps 3..12 on 2 context(s), ...``)."""
        steps = f"steps {self.steps[0]}..{self.steps[-1]}" if self.steps else "no trainer step"
        return f"{steps} on {len(self.shares)} context(s), {self.window * 1e3:.2f} ms, from the {self.source}"


class _Raw(NamedTuple):
    """An op or copy as read, before merging: times in wall-clock seconds."""

    row: str  # as Span.row
    context: str | None  # as Span.context
    category: str  # as Span.category
    program: str  # as Span.program
    run: int | None  # the program run it belongs to (``run_id``), where the trace says
    start: float  # wall-clock seconds
    end: float  # wall-clock seconds


class _Step(NamedTuple):
    """A trainer step's dispatch on the host, from its StepTraceAnnotation."""

    step: int  # the trainer's step number
    start: float  # wall-clock seconds
    end: float  # wall-clock seconds


def device_key(device: Any) -> int:
    """The number a trace names a device by: its local hardware id (GPU), else its id (CPU)."""
    local = getattr(device, "local_hardware_id", None)
    return local if local is not None else device.id


def category_of(name: str) -> str:
    """An op's category from its name (``all-reduce.3``: communication, ``MemcpyH2D``: transfer).

    >>> category_of("all-reduce.3"), category_of("MemcpyH2D"), category_of("dot_fusion")
    ('communication', 'transfer', 'compute')
    """
    if _COLLECTIVE.search(name):
        return COMMUNICATION
    return TRANSFER if _COPY.search(name) else COMPUTE


def read_trace(
    path: str, contexts: Mapping[int, str], anchor_wall: float, moves: Sequence[Event]
) -> Timeline:
    """The timeline in the trace at ``path`` (an ``.xplane.pb``).

    Args:
      path: the trace file.
      contexts: device key (``device_key``) -> the context name its row takes.
      anchor_wall: the wall-clock time (``time.time()``) the ``ANCHOR`` annotation began.
      moves: the ledger's copies (``Kind.MOVES``) during the profile, drawn as transfers.
    """
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    anchor_ns = None
    for plane in data.planes:
        for line in plane.lines:
            for e in line.events:
                if e.name == ANCHOR:
                    anchor_ns = e.start_ns
    if anchor_ns is None:
        raise ValueError(f"{path}: no {ANCHOR!r} annotation in the trace: it is not an mgkit profile")

    def wall(ns: float) -> float:
        return anchor_wall + (ns - anchor_ns) * 1e-9

    raws: list[_Raw] = []
    steps: list[_Step] = []
    runs: list[tuple[float, int]] = []  # (wall time, run_id) of each program dispatched on the host
    on_device = False
    for plane in data.planes:
        gpu = _GPU_PLANE.match(plane.name)
        if gpu:
            on_device = True
            raws.extend(_device_ops(plane, contexts, int(gpu.group(1)), wall))
        elif plane.name.startswith("/host:"):
            raws.extend(_host_ops(plane, contexts, wall, steps, runs))
    step_of_run = _steps_of_runs(runs, steps)
    raws.extend(_copies(moves))
    source = "device streams" if on_device else "host threads"
    return _timeline(raws, steps, step_of_run, source, _notes(source))


def _device_ops(plane: Any, contexts: Mapping[int, str], device: int, wall) -> Iterable[_Raw]:
    """A GPU's ops, a row per stream of its plane."""
    name = contexts.get(device, f"device {device}")
    for line in plane.lines:
        if line.name in ("XLA Modules", "XLA Ops", "Steps", "Source", "Framework Ops"):
            continue  # lines derived from the streams: the streams have the same ops
        stream = re.sub(r"^Stream\s*#?", "", line.name).split("(")[0].strip() or line.name
        for e in line.events:
            stats = dict(e.stats)
            op = str(stats.get("hlo_op") or e.name)
            program = str(stats.get("hlo_module") or "")
            yield _Raw(
                f"{name} stream {stream}",
                name,
                category_of(f"{op} {e.name}"),
                program,
                _int(stats.get("run_id")),
                wall(e.start_ns),
                wall(e.start_ns + e.duration_ns),
            )


def _host_ops(plane: Any, contexts: Mapping[int, str], wall, steps: list, runs: list) -> Iterable[_Raw]:
    """A host plane: the step annotations and programs dispatched (into ``steps`` and ``runs``),
    and, on CPU, XLA's ops, each on the context of its ``device_ordinal``."""
    for line in plane.lines:
        for e in line.events:
            if e.name.startswith(_NOT_OPS):
                continue
            stats = dict(e.stats)
            if e.name == STEP_NAME and "step_num" in stats:
                steps.append(
                    _Step(int(stats["step_num"]), wall(e.start_ns), wall(e.start_ns + e.duration_ns))
                )
            elif "hlo_op" in stats and "device_ordinal" in stats:
                name = contexts.get(int(stats["device_ordinal"]), f"device {stats['device_ordinal']}")
                yield _Raw(
                    name,
                    name,
                    category_of(str(stats["hlo_op"])),
                    str(stats.get("hlo_module", "")),
                    _int(stats.get("run_id")),
                    wall(e.start_ns),
                    wall(e.start_ns + e.duration_ns),
                )
            elif "run_id" in stats and "Execute" in e.name and "device_ordinal" not in stats:
                runs.append((wall(e.start_ns), int(stats["run_id"])))


def _copies(moves: Sequence[Event]) -> list[_Raw]:
    """The ledger's copies, each on the context that received it (or sent it, to the host)."""
    out = []
    for e in moves:
        name = e.dst if e.dst != "host" else e.src
        out.append(_Raw(name, name, TRANSFER, e.kind, None, e.start, e.start + e.seconds))
    return out


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _steps_of_runs(runs: Sequence[tuple[float, int]], steps: Sequence[_Step]) -> dict[int, int]:
    """run_id -> the step whose annotation the program was dispatched in."""
    out = {}
    for t, run in runs:
        for s in steps:
            if s.start <= t <= s.end:
                out[run] = s.step
                break
    return out


def _timeline(
    raws: list[_Raw], steps: list[_Step], step_of_run: Mapping[int, int], source: str, notes: Sequence[str]
) -> Timeline:
    """Merges the raw ops into blocks, measures each context's shares and makes the Timeline."""
    steps = sorted(steps, key=lambda s: s.start)
    ends = [*(r.end for r in raws), *(s.end for s in steps)]
    starts = [*(r.start for r in raws), *(s.start for s in steps)]
    t0, t1 = (min(starts), max(ends)) if starts else (0.0, 0.0)
    window = t1 - t0
    step_starts = [s.start for s in steps]

    def step_of(r: _Raw) -> int | None:
        if r.program in Kind.MOVES:  # mgkit's copy: a batch's comes before its step, others in none
            return None
        if r.run is not None and r.run in step_of_run:
            return step_of_run[r.run]
        i = bisect.bisect_right(step_starts, r.start) - 1
        return steps[i].step if i >= 0 else None

    spans = [
        Span(r.row, r.context, r.category, r.program, step_of(r), r.start - t0, r.end - t0) for r in raws
    ]
    spans += [Span(HOST_ROW, None, HOST, "dispatch", s.step, s.start - t0, s.end - t0) for s in steps]
    shares = {}
    for ctx in sorted({s.context for s in spans if s.context is not None}, key=_row_order):
        mine = [s for s in spans if s.context == ctx]
        shares[ctx] = shares_of(
            {c: [(s.start, s.end) for s in mine if s.category == c] for c in CATEGORIES}, window
        )
    rows = sorted({s.row for s in spans if s.context is not None}, key=_row_order)
    if steps:
        rows.append(HOST_ROW)
    merged = merge(sorted(spans, key=lambda s: (s.row, s.start)), window * _MERGE_GAP)
    return Timeline(
        tuple(rows),
        tuple(sorted(merged, key=lambda s: s.start)),
        shares,
        window,
        source,
        tuple(dict.fromkeys(s.step for s in steps)),
        tuple(notes),
    )


def _row_order(row: str) -> tuple:
    """Rows in context order: dev2 before dev10, a context's streams together."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", row))


def merge(spans: Sequence[Span], gap: float) -> list[Span]:
    """Joins spans of one row, category, program and step that follow within ``gap`` seconds
    (``spans`` sorted by row, then start)."""
    out: list[Span] = []
    for s in spans:
        last = out[-1] if out else None
        if (
            last is not None
            and (last.row, last.category, last.program, last.step) == (s.row, s.category, s.program, s.step)
            and s.start - last.end <= gap
        ):
            out[-1] = last._replace(end=max(last.end, s.end))
        else:
            out.append(s)
    return out


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping intervals joined, by start.

    >>> union([(0, 2), (1, 3), (5, 6)])
    [(0, 3), (5, 6)]
    """
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def shares_of(by_category: Mapping[str, Sequence[tuple[float, float]]], window: float) -> Shares:
    """A context's shares of ``window`` seconds from its busy intervals per category: where two
    overlap, communication counts first, then transfer, then compute.

    >>> shares_of({"compute": [(0, 4)], "communication": [(3, 5)], "transfer": []}, 10)
    Shares(compute=0.3, communication=0.2, transfer=0.0, idle=0.5)
    """
    if window <= 0:
        return Shares(0.0, 0.0, 0.0, 1.0)
    comm = union(by_category.get(COMMUNICATION, ()))
    with_copies = union([*comm, *by_category.get(TRANSFER, ())])
    busy = union([*with_copies, *by_category.get(COMPUTE, ())])
    c, t, b = _length(comm), _length(with_copies), _length(busy)
    return Shares((b - t) / window, c / window, (t - c) / window, max(0.0, 1.0 - b / window))


def from_ledger(events: Sequence[Event]) -> Timeline:
    """The timeline from the ledger alone (the trace could not be read): each context's step and
    run events as compute, mgkit's copies as transfers; collectives are not timed there."""
    raws = [
        _Raw(
            e.src, e.src, COMPUTE, str((e.info or {}).get("what", e.kind)), None, e.start, e.start + e.seconds
        )
        for e in events
        if e.kind in Kind.COMPUTE
    ]
    raws += _copies([e for e in events if e.kind in Kind.MOVES])
    steps = [
        _Step(int(e.info["iteration"]), e.start, e.start + e.seconds)
        for e in events
        if e.kind == Kind.STEP and e.info and "iteration" in e.info
    ]
    unique = list({s.step: s for s in steps}.values())
    notes = [
        "from mgkit's ledger (the trace could not be read): compute is each step's time, "
        "collectives are not timed"
    ]
    return _timeline(raws, unique, {}, "ledger", notes)


def _notes(source: str) -> list[str]:
    """What the picture says about how it was made: its first line fits the picture's width."""
    copies = (
        "mgkit's copies (puts, splits, transfers) at the ledger's times, on the context that received them"
    )
    if source == "host threads":
        return [
            "CPU trace (host threads only): each op on the context whose device ran it; 'host': the dispatch",
            copies,
        ]
    return ["rows: each device's streams; 'host': step dispatch", copies]
