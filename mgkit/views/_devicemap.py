"""The device map: context -> device -> platform, memory in use, the current context marked."""

from __future__ import annotations

import html
import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

from .. import _contexts, _devices
from .._ledger import Event
from .._table import Markup, html_table
from ._base import LiveView, check_cluster
from ._live import Throttled
from ._png import LIMIT_BAR, LIVE_BAR, MemoryBar, bar_share, draw_memory, largest_live


class DeviceRow(NamedTuple):
    """One context as the device map shows it."""

    context: str  # the context's name
    device: str  # its device's short name (cpu0, cuda1)
    platform: str  # the device's platform (cpu, cuda, tpu)
    kind: str  # the device's kind, as JAX names it
    used: int | None  # bytes in use (None: not known)
    limit: int | None  # the device's byte limit (None: it reports none)
    current: bool  # True for the current context (the main thread's)
    source: str | None  # where ``used`` comes from: "allocator", "live arrays", or None
    rank: int | None = None  # the cluster rank whose context it is (None: this kernel's)
    host: str = ""  # that rank's host
    pid: int | None = None  # that rank's process id


def process_text(r: DeviceRow) -> str:
    """Whose context a row is: ``kernel``, or ``rank 1 (host, pid 4242)``."""
    return "kernel" if r.rank is None else f"rank {r.rank} ({r.host}, pid {r.pid})"


def rank_rows(cluster: Any) -> list[DeviceRow]:
    """A row per context of every rank of ``cluster`` (named ``r1/dev2``), from each rank's newest
    memory reading; before a rank's first reading, a row per device it owns (``r1/cpu2``)."""
    streams = getattr(cluster, "streams", None)
    latest = streams.latest() if streams is not None else []
    rows = []
    for info in cluster.ranks:
        host = cluster.hosts[info.rank] if info.rank < len(cluster.hosts) else "?"
        mine = [s for s in latest if s.rank == info.rank]
        for s in mine:
            platform = s.device.rstrip("0123456789")
            rows.append(
                DeviceRow(
                    s.context,
                    s.device,
                    platform,
                    s.kind,
                    s.used,
                    s.limit,
                    False,
                    s.source,
                    info.rank,
                    host,
                    info.pid,
                )
            )
        if not mine:
            for d in info.devices:
                platform = d.rstrip("0123456789")
                rows.append(
                    DeviceRow(
                        f"r{info.rank}/{d}",
                        d,
                        platform,
                        "?",
                        None,
                        None,
                        False,
                        None,
                        info.rank,
                        host,
                        info.pid,
                    )
                )
    return rows


_CURRENT_ROW = {"class": "mgkit-current", "style": "background:#fff3c4;font-weight:bold"}


def _memory(r: DeviceRow) -> str:
    return _devices.memory_text(r.used, r.limit, r.source)


def _bar_html(share: float, color: str) -> str:
    """A memory bar ``share`` (0 to 1) full, as HTML."""
    return (
        '<div style="display:inline-block;width:120px;height:10px;background:#e6e6e6;'
        'vertical-align:middle;margin-right:6px"><div style="height:100%;'
        f'width:{100 * share:.1f}%;background:{color}"></div></div>'
    )


_MAIN_STACK: list[str] | None = None  # the main thread's ``mg.on`` stack, read by the live thread


def _watch_main_stack() -> None:
    """Keeps a reference to the main thread's ``mg.on`` scope stack (a thread-local list that
    ``mg.on`` appends to and pops from), so the live thread can show the main thread's context."""
    global _MAIN_STACK
    if _MAIN_STACK is None and threading.current_thread() is threading.main_thread():
        _MAIN_STACK = _contexts.scope_stack()


def shown_current() -> str | None:
    """The current context as the main thread (where cells run) sees it, from any thread."""
    if threading.current_thread() is threading.main_thread():
        return _contexts.current()
    stack = _MAIN_STACK
    if stack:
        try:
            return stack[-1]
        except IndexError:  # popped between the two reads
            pass
    return _contexts.current()


# The live arrays' bytes per device, for devices without memory statistics (CPU): one reading
# shared by every device map, taken at most once a second by the live thread and within 1 % of
# the wall time (about 3-4 microseconds per live array).
LIVE_BYTES = Throttled(lambda: _devices.live_array_bytes(), period=1.0, share=0.01)


class DeviceMap(LiveView):
    """Context name -> device -> platform, memory in use / limit, the current context highlighted.

    Memory comes from the device's allocator statistics where it reports them (GPUs, TPUs);
    devices that report none (CPU) show the bytes held by the live jax arrays on them, marked
    ``live arrays``, with no limit. A widget in notebooks (refreshed live), text elsewhere
    (``print(mg.DeviceMap())``). With ``cluster=c`` every rank's contexts follow this kernel's,
    named by rank (``r1/dev2``) with the rank's host and pid, their memory as the ranks read it.

    Args:
      contexts: context names to show (default: every context of the current map).
      rate: refreshes per second, above 0 and at most 10 (allocator statistics are polled at
        this rate; live arrays are summed at most once a second while refreshed live).
      widget: True for an ipywidgets widget, False for text, None for a widget inside a
        Jupyter kernel and text elsewhere.
      live: a widget is refreshed by a background thread, also while a cell runs; False:
        only when you call ``refresh()``.
      cluster: an ``mg.Cluster`` whose ranks' contexts to show too (default: none).

    >>> import mgkit as mg
    >>> _ = mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    >>> print(mg.DeviceMap(widget=False))  # doctest: +ELLIPSIS
    mgkit device map: 2 context(s), current (*) dev0
    context  device  platform  kind  memory in use / limit
    ...
    * dev0   cpu0    cpu       cpu   ... (live arrays)
      dev1   cpu1    cpu       cpu   ... (live arrays)
    memory: ...
    """

    polls = True
    css_class = "mgkit-devicemap"
    headers = ("context", "device", "platform", "kind", "memory in use / limit")

    def __init__(
        self,
        contexts: Iterable[str] | None = None,
        rate: float = 2.0,
        widget: bool | None = None,
        live: bool = True,
        cluster: Any = None,
    ):
        super().__init__(rate, None, widget, live, contexts)
        self.cluster = check_cluster(cluster, self._where)
        if self.cluster is not None:
            self.headers = (*self.headers, "process")
        self._state: list[DeviceRow] = []
        _watch_main_stack()
        self._start()

    def rows(self) -> list[DeviceRow]:
        """A ``DeviceRow`` per context shown, now: (context, device, platform, kind, bytes in use,
        byte limit, is current, memory source)."""
        self.refresh()
        return list(self._state)

    def _poll(self, fresh: bool) -> list[DeviceRow]:
        cmap = _contexts.context_map()
        current = shown_current()
        shown = [n for n in cmap.names if self.contexts is None or n in self.contexts]
        devices = [_contexts.device_of(name) for name in shown]
        usage = _devices.memory_usage(devices, lambda: LIVE_BYTES(fresh))
        rows = []
        for name, device in zip(shown, devices, strict=True):
            short = _devices.short_name(device)
            used, limit, source = usage[device]
            platform = short.rstrip("0123456789")
            rows.append(
                DeviceRow(name, short, platform, device.device_kind, used, limit, name == current, source)
            )
        if self.cluster is not None:
            rows.extend(rank_rows(self.cluster))
        return rows

    def _update(self, events: list[Event], budgeted: bool) -> bool:
        rows = self._poll(fresh=not budgeted)
        if rows == self._state:
            return False
        self._state = rows
        self._show_html()
        return True

    def _title(self) -> str:
        current = next((r.context for r in self._state if r.current), None)
        own = sum(r.rank is None for r in self._state)
        title = f"mgkit device map: {own} context(s), current (*) {current or '(none shown)'}"
        if self.cluster is not None:
            ranks = len({r.rank for r in self._state if r.rank is not None})
            title += f"; cluster: {len(self._state) - own} context(s) on {ranks} rank(s)"
        return title

    def _note(self) -> str:
        return _devices.MEMORY_NOTE if any(r.source for r in self._state) else ""

    def _bars(self) -> list[MemoryBar]:
        return [MemoryBar(r.context, r.device, r.used, r.limit, r.current) for r in self._state]

    def _rows(self) -> list[tuple]:
        rows = [
            (f"{'*' if r.current else ' '} {r.context}", r.device, r.platform, r.kind, _memory(r))
            for r in self._state
        ]
        if self.cluster is not None:
            rows = [(*row, process_text(r)) for row, r in zip(rows, self._state, strict=True)]
        return rows

    def text(self) -> str:
        note = self._note()
        return self._table(self._title()) + (f"\n{note}" if note else "")

    def html(self) -> str:
        top = largest_live(self._bars())
        rows = []
        for r in self._state:
            share = bar_share(r.used, r.limit, top)
            bar = "" if share is None else _bar_html(share, LIMIT_BAR if r.limit else LIVE_BAR)
            name = Markup(("&#9654; " if r.current else "") + html.escape(r.context))
            row = (name, r.device, r.platform, r.kind, Markup(bar + html.escape(_memory(r))))
            rows.append(row if self.cluster is None else (*row, process_text(r)))
        attrs = [_CURRENT_ROW if r.current else {} for r in self._state]
        note = self._note()
        foot = f'<div style="font-size:11px;color:#666">{html.escape(note)}</div>' if note else ""
        return html_table(self.headers, rows, self._title(), attrs) + foot

    def _draw(self, ax: Any) -> None:
        draw_memory(ax, self._bars())

    def _figsize(self) -> tuple[float, float]:
        return 6.0, 0.35 * len(self._state) + 1.2

    def _draw_figure(self, fig: Any) -> None:
        self._draw(fig.subplots())
