"""The ranks' ledgers in the kernel's: each rank sends its entries in batches (``_rank.stream``:
a bounded outbox, at most ``RATE`` messages a second, the dropped ones counted), and the kernel
records them in ``mg.ledger()`` with each context named by its rank (``r1/dev2``), so the
dashboard's transfers and throughput panels, the ledger's summary and its matrix show every
rank beside the kernel's own work.

A rank publishes under the request it last ran; the kernel reads the batches of every request
(``Engines.published``), and each call ends with a drain of what is left, whose reply follows
every batch published before it.
"""

from __future__ import annotations

from typing import Any

from .._ledger import Event, ledger

RATE = 10.0  # messages a second per rank, at most
SIZE = 100_000  # ledger entries a rank holds for the kernel, at most; more are counted as dropped
BATCH = 5_000  # events per message, at most
PREFIX = "mgkit-events-"


def renamed(row: tuple, rank: int) -> Event:
    """A rank's event row as a kernel event, its contexts and devices named ``r<rank>/<name>``."""
    kind, src, dst, src_device, dst_device, nbytes, start, seconds, label, info = row
    tag = f"r{rank}/"
    return Event(
        kind, tag + src, tag + dst, tag + src_device, tag + dst_device, nbytes, start, seconds, label, info
    )


class Streams:
    """The kernel's side: reads the batches the ranks published, records them, counts drops."""

    def __init__(self, engines: Any, ranks: int):
        self.engines, self.ranks = engines, ranks
        self.received = [0] * ranks  # events recorded per rank
        self.messages = [0] * ranks  # batches read per rank
        self.dropped = [0] * ranks  # entries each rank could not hold

    def collect(self, *pending: Any) -> int:
        """Records every batch published since the last look (under ``pending``'s requests or
        any other), each rank's in order; returns how many events."""
        total = 0
        for key, (rows, dropped) in sorted(self.engines.published(PREFIX, pending), key=lambda m: m[0]):
            rank = int(key[len(PREFIX) :].split("-")[0])  # mgkit-events-<rank>-<seq>
            if 0 <= rank < self.ranks:
                total += self.record(rank, rows, dropped)
        return total

    def record(self, rank: int, rows: Any, dropped: int) -> int:
        """Records one batch of ``rank``'s event rows in the kernel's ledger."""
        events = [renamed(tuple(row), rank) for row in rows]
        if events:
            ledger().record(events)
        self.received[rank] += len(events)
        self.messages[rank] += 1
        self.dropped[rank] += int(dropped)
        return len(events)
