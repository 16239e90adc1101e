"""What the ledger records: the event, its kinds, and the layouts that calls laid out alike share."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, NamedTuple


def link_shares(links: list[tuple[str, str, int]]) -> list[float]:
    """Each event's share of the seconds that events completing together took, from its
    (source, target, bytes): all of them where it is the only event between its two contexts,
    else its part of the bytes that went between them (an equal part where none did)."""
    totals: dict[tuple[str, str], list[int]] = {}
    for src, dst, nbytes in links:
        totals.setdefault((src, dst), []).append(nbytes)
    out = []
    for src, dst, nbytes in links:
        sizes = totals[(src, dst)]
        out.append(1.0 if len(sizes) == 1 else nbytes / sum(sizes) if sum(sizes) else 1.0 / len(sizes))
    return out


def timed(events: list[Event], seconds: float) -> list[Event]:
    """``events`` that completed together after ``seconds``, each given its share (``link_shares``)."""
    if len({(e[1], e[2]) for e in events}) == len(events):  # one event per pair: all the seconds
        return [_new(Event, (*e[:7], seconds, e[8], e[9])) for e in events]
    shares = link_shares([(e[1], e[2], e[5]) for e in events])
    pairs = zip(events, shares, strict=True)
    return [_new(Event, (*e[:7], seconds * share, e[8], e[9])) for e, share in pairs]


_new = tuple.__new__  # an Event from a tuple of its fields, without NamedTuple's argument parsing


class Kind:
    """The kinds of event mgkit records, each spelled once here (``Event.kind`` is one of them).

    Moves carry bytes from ``src`` to ``dst`` (mgkit's own, and ``COLLECTIVE``: those inside a
    compiled program); compute events are on one context (``src == dst``,
    no bytes); process events name processes, not contexts (see ``PROCESS``).

    >>> Kind.STEP, Kind.STEP in Kind.COMPUTE, Kind.LAUNCH in Kind.PROCESS
    ('step', True, True)
    """

    # -- moves: ``src`` -> ``dst``, ``nbytes`` copied
    PUT = (
        "put"  # host values (numpy, Python) copied onto a context: ``mg.put``, a batch, a stage's parameters
    )
    TRANSFER = "transfer"  # arrays copied from one context to another: ``mg.transfer``, a pipeline's hop
    COLOCATE = "colocate"  # arrays brought onto one context so that one program can take them all
    SPLIT = "split"  # one context's share of a batch cut along an axis (``mg.split``, a parallel call)
    REPLICATE = "replicate"  # a whole array copied to one context of several (parameters, broadcast args)
    CONCAT = "concat"  # parts gathered onto one context and joined (``mg.concat``)
    GATHER = "gather"  # one context's result brought back to the caller's context after a parallel call
    # -- communication inside a compiled program: ``src`` -> ``dst``, ``nbytes`` sent
    # Read once from the program XLA compiled (``_spmd._collectives``), recorded on each run,
    # not timed (``seconds`` 0, ``info["read"] == "program"``); ``info``: op, program, ops (how
    # many ran), bytes (theirs, on one participant), step (a trainer's); ``nbytes``: sent (a ring).
    # Not in ``MOVES``, the moves mgkit makes and times itself: views add it where asked.
    COLLECTIVE = "collective"  # an all-reduce, all-gather... that XLA runs inside an SPMD program
    # -- compute: on one context, ``info`` holds what was computed
    RUN = "run"  # one context's share of a parallel call (``mg.parallel``, ``mg.pmap``, ``run_each``)
    STEP = "step"  # one training or fitting step on one context (``info``: what, samples/s, loss, member)
    FORWARD = "forward"  # a pipeline stage's forward pass of one microbatch
    BACKWARD = "backward"  # a pipeline stage's backward pass of one microbatch
    UPDATE = "update"  # a pipeline stage's optimizer update
    # -- processes: ``src`` and ``dst`` are process names (``KERNEL``, ``rank<N>``), not contexts
    LAUNCH = "launch"  # a launched rank changed state (``info["event"]``: started, ready, result, error...)
    STALL = "stall"  # the watchdog saw no progress for ``seconds`` (from the kernel to itself)

    MOVES = frozenset({PUT, TRANSFER, COLOCATE, SPLIT, REPLICATE, CONCAT, GATHER})
    COMPUTE = frozenset({RUN, STEP, FORWARD, BACKWARD, UPDATE})  # device work, drawn as busy time
    RATE = frozenset({RUN, STEP})  # compute events whose ``info`` carries samples per second
    PROCESS = frozenset({LAUNCH, STALL})
    ALL = MOVES | COMPUTE | PROCESS | {COLLECTIVE}


KERNEL = "kernel"  # the process that runs the notebook (or script), as a process event's src/dst


class Event(NamedTuple):
    """One thing mgkit did.

    Attributes:
      kind: one of ``Kind``'s (``put``, ``transfer``, ``step``, ``launch``...).
      src, dst: context names (``host`` for host memory); for process events (``Kind.PROCESS``)
        process names instead: ``kernel`` (the launching process) and ``rank<N>``.
      src_device, dst_device: short device names (``cpu0``, ``cuda1``, ``host``).
      nbytes: bytes moved (0 for compute and process events).
      start: wall-clock time the operation was issued (``time.time()``).
      seconds: time from issue to completion.
      label: the IPython execution count (``In [7]`` -> ``7``) when run in IPython, else None.
      info: extra facts about the event (array count, shapes, samples...), or None.
    """

    kind: str
    src: str
    dst: str
    src_device: str
    dst_device: str
    nbytes: int
    start: float
    seconds: float
    label: int | None = None
    info: Mapping[str, Any] | None = None

    @classmethod
    def on(
        cls,
        kind: str,
        ctx,
        start: float,
        seconds: float,
        label: int | None = None,
        info: Mapping[str, Any] | None = None,
    ) -> Event:
        """A compute event on one context ``ctx`` (a ``Context``): it moves nothing, so its source
        and target are both ``ctx``.

        >>> from mgkit._contexts import Context
        >>> ctx = Context("dev0", None, "cpu0")
        >>> e = Event.on(Kind.STEP, ctx, 10.0, 0.5, info={"loss": 0.1})
        >>> e.src, e.dst, e.dst_device, e.nbytes
        ('dev0', 'dev0', 'cpu0', 0)
        """
        return _new(cls, (kind, ctx.name, ctx.name, ctx.short, ctx.short, 0, start, seconds, label, info))

    @property
    def gbps(self) -> float:
        """Achieved bandwidth in GB/s (1e9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")


class Layout:
    """Events that calls laid out alike record again and again, made once by their caller and
    kept (``_spmd`` caches them per layout): per event its first six fields (kind to bytes), its
    share of the seconds the events take together (``link_shares``) and its info.

    ``layout.call(...)`` is one call's entry; ``Ledger.record`` keeps it whole and makes its
    events only when they are read (``records``, subscribers), and folds the running totals in
    per layout, so a call's recording costs the same however many contexts it spans.
    """

    __slots__ = ("rows", "size", "totals")

    def __init__(self, rows: list[tuple[tuple, float, Mapping[str, Any] | None]]):
        self.rows = tuple(rows)
        self.size = len(self.rows)
        sums: dict[tuple[str, str, str], list] = {}
        for head, share, _ in self.rows:
            total = sums.setdefault((head[0], head[1], head[2]), [0, 0, 0.0])
            total[0] += 1
            total[1] += head[5]
            total[2] += share
        # per (kind, source, target): events, bytes, and the share of one call's seconds
        self.totals = tuple((key, c, b, s) for key, (c, b, s) in sums.items())

    def call(self, start: float, seconds: float, label: int | None, extra: tuple | None = None) -> Call:
        """One call issued at ``start`` that took ``seconds`` (0 when ``Ledger.record_when_ready``
        times it); ``extra``: one dict per event of this call's own facts (a step's loss)."""
        return _new(Call, (self, start, seconds, label, extra))

    def events(
        self,
        start: float,
        seconds: float,
        label: int | None,
        extra: tuple | None = None,
        rows: tuple[int, ...] | None = None,
    ) -> list[Event]:
        """The events of one call issued at ``start`` that took ``seconds`` together; ``extra``:
        one dict per event of this call's own facts (a step's loss), merged into its info;
        ``rows``: the indexes of the events to make (default: all)."""
        if rows is not None:
            picked = [self.rows[i] for i in rows]
            if extra is None:
                return [
                    _new(Event, (*head, start, seconds * share, label, info)) for head, share, info in picked
                ]
            return [
                _new(Event, (*head, start, seconds * share, label, {**(info or {}), **extra[i]}))
                for (head, share, info), i in zip(picked, rows, strict=True)
            ]
        if extra is None:
            return [
                _new(Event, (*head, start, seconds * share, label, info)) for head, share, info in self.rows
            ]
        return [
            _new(Event, (*head, start, seconds * share, label, {**(info or {}), **more}))
            for (head, share, info), more in zip(self.rows, extra, strict=True)
        ]

    def select(self, kinds: frozenset[str], exclude: bool = False) -> tuple[int, ...]:
        """The indexes of the events whose kind is in ``kinds`` (``exclude``: is not)."""
        return tuple(i for i, (head, _, _) in enumerate(self.rows) if (head[0] in kinds) != exclude)

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"Layout({[head[:3] for head, _, _ in self.rows]})"


class Call(NamedTuple):
    """One call of a ``Layout`` as the ledger keeps it (``Layout.call``), its events made when read."""

    layout: Layout
    start: float  # wall-clock time the call was issued
    seconds: float  # from issue to completion, shared out among the layout's events
    label: int | None  # the IPython execution count
    extra: tuple | None = None  # per event: this call's own facts, merged into its info

    def events(self, rows: tuple[int, ...] | None = None) -> list[Event]:
        """Its events (``rows``: the indexes of those to make; default: all)."""
        return self.layout.events(self.start, self.seconds, self.label, self.extra, rows)


Entry = Event | list[Event] | Call  # what ``Ledger.record`` and ``record_when_ready`` take


def events_of(entries) -> list[Event]:
    """The events of entries a buffer got from ``Ledger.attach`` (events, and calls of a layout
    whose events are made when read), in order."""
    out: list[Event] = []
    for entry in entries:
        if type(entry) is Call:
            out.extend(entry.events())
        else:
            out.append(entry)
    return out


def execution_label() -> int | None:
    """The running IPython cell's execution count, without importing IPython."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    try:
        shell = ipython.get_ipython()
    except Exception:  # noqa: BLE001
        return None
    if shell is None:
        return None
    # The running cell is the last input in the history (IPython moves execution_count on
    # before or after the cell depending on its version; the history is the same in both).
    history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None)
    if history:
        return len(history) - 1
    return getattr(shell, "execution_count", None)


def short_label(name: str) -> str:
    """A compact label for an array over many contexts: ``dev0+dev1+...+dev7`` -> ``dev0..dev7 (8)``."""
    parts = name.split("+")
    return name if len(parts) <= 3 else f"{parts[0]}..{parts[-1]} ({len(parts)})"
