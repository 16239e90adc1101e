"""The ranks' ledgers in the kernel's: each rank sends its entries in batches (``_rank.stream``:
a bounded outbox, at most ``RATE`` messages a second, the dropped ones counted), and the kernel
records them in ``mg.ledger()`` with each context named by its rank (``r1/dev2``), so the
dashboard's transfers and throughput panels, the ledger's summary and its matrix show every
rank beside the kernel's own work. The same messages bring the rank's last heartbeat (set in
its ``RankInfo``) and its devices' memory readings (kept here, a bounded history per context,
for ``mg.Dashboard(cluster=c)``'s device map and memory panel).

A step's events are alike at every step (a ``Layout``, made once; the ledger keeps each call of
it whole): a rank sends a layout's rows once and then each call as one small row, and the kernel
records the call of its renamed copy, so streaming costs a step the same however many contexts
and collectives it has.

A rank publishes under the request it last ran; the kernel reads the batches of every request
(``Engines.published``), and each call ends with a drain of what is left, whose reply follows
every batch published before it.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from .._ledger import Event, Layout, ledger

# Messages a second per rank, at most: the dashboard's panels refresh twice a second. Each message
# costs the rank, the controller and the kernel about 1.5 ms of CPU: on a laptop's two cores,
# where the ranks' steps wait on each other, 10 a second slowed a step by about 10 %, 2 by 2 %.
RATE = 2.0
SIZE = 100_000  # ledger entries a rank holds for the kernel, at most; more are counted as dropped
BATCH = 25_000  # events per message, at most (50,000 a second per rank)
PREFIX = "mgkit-events-"
KEPT = 600  # memory samples kept per rank context (5 minutes at the ranks' 2 a second)


class RankSample(NamedTuple):
    """One reading of one rank device's memory, as the kernel keeps it."""

    rank: int  # the rank that read it
    context: str  # its context, named by rank (r1/dev2; its device's name where no context is on it)
    device: str  # the device's short name in the rank (cpu2, cuda0)
    platform: str  # the device's platform (cpu, gpu, tpu)
    kind: str  # the device's kind, as JAX names it
    t: float  # time.time() when the rank read it
    used: int | None  # bytes in use (None: not known)
    peak: int | None  # the allocator's peak (None: not reported)
    limit: int | None  # the device's byte limit (None: not known)
    source: str | None  # "allocator" or "live arrays"


def samples_of(rank: int, reading: Sequence[dict]) -> list[RankSample]:
    """A rank's reading of its devices (``_rank.sample``) as samples, one per context of each
    device (a device without a context: one, under the device's name)."""
    out = []
    for d in reading:
        fields = (
            d["device"],
            d["platform"],
            d["kind"],
            d["t"],
            d["used"],
            d["peak"],
            d["limit"],
            d["source"],
        )
        for name in d["contexts"] or (d["device"],):
            out.append(RankSample(rank, f"r{rank}/{name}", *fields))
    return out


def _head(head: Sequence, tag: str) -> tuple:
    """An event's first six fields (kind to bytes), its contexts and devices prefixed ``tag``."""
    kind, src, dst, src_device, dst_device, nbytes = head
    return (kind, tag + src, tag + dst, tag + src_device, tag + dst_device, nbytes)


def renamed(row: tuple, rank: int) -> Event:
    """A rank's event row as a kernel event, its contexts and devices named ``r<rank>/<name>``."""
    return Event(*_head(row[:6], f"r{rank}/"), *row[6:])


def renamed_layout(rows: Sequence[tuple], rank: int) -> Layout:
    """A rank's layout (its rows: the first six fields of each event, its share, its info) as
    the kernel's, its contexts and devices named ``r<rank>/<name>``."""
    tag = f"r{rank}/"
    return Layout([(_head(head, tag), share, info) for head, share, info in rows])


class Streams:
    """The kernel's side: reads the batches the ranks published, records them, counts drops."""

    def __init__(self, engines: Any, ranks: int):
        self.engines, self.ranks = engines, ranks
        self.received = [0] * ranks  # events recorded per rank
        self.messages = [0] * ranks  # batches read per rank
        self.dropped = [0] * ranks  # entries each rank could not hold
        self.heard: list[float | None] = [None] * ranks  # time.time() of each rank's last message
        self.fitting = [False] * ranks  # each rank runs a fit (it beats every step)
        self.infos: Sequence[Any] = ()  # the cluster's RankInfo per rank: their beats are set here
        self._memory: dict[str, collections.deque[RankSample]] = {}  # per rank context, newest last
        self._layouts: dict[int, tuple[int, dict[int, Layout]]] = {}  # rank -> (its pid, key -> layout)
        self._lock = threading.Lock()  # the memory samples are read by the views' thread

    def collect(self, *pending: Any) -> int:
        """Records every batch published since the last look (under ``pending``'s requests or
        any other), each rank's in order; returns how many events."""
        total = 0
        for key, batch in sorted(self.engines.published(PREFIX, pending), key=lambda m: m[0]):
            rank = int(key[len(PREFIX) :].split("-")[0])  # mgkit-events-<rank>-<seq>
            if 0 <= rank < self.ranks:
                total += self.record(rank, *batch)
        return total

    def record(
        self, rank: int, rows: Any, dropped: int, news: dict | None = None, layouts: tuple | None = None
    ) -> int:
        """Records one batch of ``rank``'s (``_rank.take``'s): its rows in the kernel's ledger
        (events, and calls of the layouts it sent, ``(pid, [(key, rows)])``), its last heartbeat
        in its ``RankInfo`` and its memory readings (the news)."""
        pid, new = layouts if layouts is not None else (None, ())
        known = self._layouts.get(rank)
        if known is None or (pid is not None and known[0] != pid):  # its first batch, or a new process
            known = self._layouts[rank] = (pid, {})
        for key, layout in new:
            known[1][key] = renamed_layout(layout, rank)
        count, lost = 0, 0
        led = ledger()
        events: list[Event] = []
        for row in rows:
            if len(row) != 5:  # an event's fields
                events.append(renamed(tuple(row), rank))
                continue
            layout = known[1].get(row[0])  # a call: (key, start, seconds, label, extra)
            if layout is None:  # its layout never came: counted as dropped
                lost += 1
                continue
            if events:
                led.record(events)
                count, events = count + len(events), []
            led.record(layout.call(*row[1:]))
            count += layout.size
        if events:
            led.record(events)
            count += len(events)
        self.received[rank] += count
        self.messages[rank] += 1
        self.dropped[rank] += int(dropped) + lost
        self.heard[rank] = time.time()
        news = news or {}
        if "fitting" in news:
            self.fitting[rank] = bool(news["fitting"])
        beat = news.get("beat")  # a LastBeat
        if beat is not None and rank < len(self.infos):
            self.infos[rank].step, self.infos[rank].beat_at = beat.step, beat.wall
        if news.get("memory"):
            with self._lock:
                for reading in news["memory"]:
                    for sample in samples_of(rank, reading):
                        kept = self._memory.get(sample.context)
                        if kept is None:
                            kept = self._memory[sample.context] = collections.deque(maxlen=KEPT)
                        kept.append(sample)
        return count

    def memory(self, after: Mapping[str, float] | None = None) -> dict[str, list[RankSample]]:
        """Each rank context's memory samples kept, oldest first (those taken after ``after[name]``,
        a time.time(), where given), by rank, each rank's contexts in its devices' order."""
        after = after or {}
        with self._lock:
            return {
                name: [s for s in kept if s.t > after.get(name, -math.inf)]
                for name, kept in sorted(self._memory.items(), key=_by_rank)
            }

    def latest(self) -> list[RankSample]:
        """Each rank context's newest memory sample, in ``memory``'s order."""
        with self._lock:
            return [kept[-1] for _, kept in sorted(self._memory.items(), key=_by_rank)]


def _by_rank(item: tuple[str, collections.deque[RankSample]]) -> int:
    return item[1][0].rank
