"""A launch's ranks in the ledger: the ``launch`` events the kernel records, made and read here.

A rank event is an ``Event`` of kind ``launch``, one each time a rank is ready, done, failed or
stalled. Its fields do not name contexts, as other events' do:

====================  ===========================================================================
``src``               ``kernel``: the process that started the ranks and records their events
``dst``               ``rank<r>`` (``rank3``): the rank, by its number in the launch
``src_device``        ``host``
``dst_device``        the rank's first device (``cpu0``, ``cuda1``), ``host`` before it is known
``nbytes``            the pickled value's size for ``done``, else 0
``start``             when what it measures began (``time.time()``)
``seconds``           ``ready``: start to ready; ``done`` and ``failed``: start to exit;
                      ``stalled``: the silence that made the stall
``label``             the cell that ran ``mg.launch``
``info["event"]``     ``ready``, ``done``, ``failed`` or ``stalled``
``info["pid"]``       the rank's process id
``info["devices"]``   all the rank's devices (a tuple of short names)
``info["state"]``     its ``RankInfo.state`` when recorded
``info["launch"]``    which launch of this kernel (1, 2, ...): the group the rank belongs to
====================  ===========================================================================

``rank_event`` reads one back as a ``RankEvent``; the views read launches from the ledger with it.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from .._ledger import KERNEL, Event, Kind
from ._result import RankInfo

_PREFIX = "rank"  # their dst: "rank<r>"


class RankEvent(NamedTuple):
    """A rank event of the ledger, read back (see the module's table)."""

    rank: int  # the rank's number, from dst "rank<r>"
    pid: int  # its process id
    what: str  # ready, done, failed or stalled
    state: str  # its RankInfo.state when recorded ("" when not recorded)
    devices: tuple[str, ...]  # its devices' short names (() when not recorded)
    launch: int | None  # which launch of the kernel (None in events recorded without it)
    start: float  # Event.start
    seconds: float  # Event.seconds
    label: int | None  # the cell that ran the launch

    @property
    def end(self) -> float:
        """When the event ended (``start + seconds``)."""
        return self.start + self.seconds


def launch_event(
    info: RankInfo, what: str, nbytes: int, seconds: float, label: int | None, launch: int
) -> Event:
    """The ledger event saying rank ``info.rank`` is ``what`` (ready, done, failed or stalled),
    after ``seconds`` that end now."""
    device = info.devices[0] if info.devices else "host"
    return Event(
        Kind.LAUNCH,
        KERNEL,
        f"{_PREFIX}{info.rank}",
        "host",
        device,
        nbytes,
        time.time() - seconds,
        seconds,
        label,
        {"event": what, "pid": info.pid, "devices": info.devices, "state": info.state, "launch": launch},
    )


def rank_event(event: Event) -> RankEvent | None:
    """The rank event ``event`` records, or None when it is not one (another kind, or fields
    that do not read as a rank, a pid and what happened).

    >>> import mgkit as mg
    >>> info = {"event": "done", "pid": 4242, "devices": ("cpu3",), "state": "done", "launch": 1}
    >>> e = mg.Event("launch", "kernel", "rank3", "host", "cpu3", 8, 0.0, 1.5, None, info)
    >>> mg.launching.rank_event(e)[:6]
    (3, 4242, 'done', 'done', ('cpu3',), 1)
    """
    if event.kind != Kind.LAUNCH:
        return None
    info = event.info
    try:
        rank = int(event.dst.removeprefix(_PREFIX))
        pid = int(info["pid"])
        what = str(info["event"])
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    devices = info.get("devices") or ()
    names = tuple(map(str, devices)) if isinstance(devices, list | tuple) else (str(devices),)
    launch = info.get("launch")
    return RankEvent(
        rank,
        pid,
        what,
        str(info.get("state", "")),
        names,
        launch if isinstance(launch, int) else None,
        event.start,
        event.seconds,
        event.label,
    )
