"""The ledger: every move and step mgkit makes, as events in one stream that views read.

``_events``: what is recorded (``Event``, its ``Kind``s, ``Layout``); ``_ledger``: the stream
itself (recording, totals, subscribers, the watcher that times work off the caller's path);
``_tables``: its totals as tables.
"""

from ._events import KERNEL as KERNEL
from ._events import Call as Call
from ._events import Entry as Entry
from ._events import Event as Event
from ._events import Kind as Kind
from ._events import Layout as Layout
from ._events import events_of as events_of
from ._events import execution_label as execution_label
from ._events import link_shares as link_shares
from ._events import short_label as short_label
from ._ledger import Ledger as Ledger
from ._ledger import ledger as ledger
from ._tables import Matrix as Matrix
from ._tables import Summary as Summary

__all__ = [
    "KERNEL",
    "Call",
    "Entry",
    "Event",
    "Kind",
    "Layout",
    "Ledger",
    "Matrix",
    "Summary",
    "events_of",
    "execution_label",
    "ledger",
    "link_shares",
    "short_label",
]
