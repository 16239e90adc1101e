"""The launch view: per rank of the running or last ``mg.launch`` its devices, state, heartbeat
age and last output lines; a finished launch it did not watch, read from the ledger; or, with
``cluster=``, the engines of an ``mg.Cluster`` (the same ``RankInfo`` rows, with their hosts)."""

from __future__ import annotations

import collections
import html
import math
import operator
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from .. import launching
from .._ledger import Event, Kind, Ledger
from .._table import Markup, html_table
from ..launching import TAIL, RankEvent, RankInfo, Running
from ._base import LiveView, check_cluster
from ._format import cell_name
from ._live import check_count

_OUTPUT_WIDTH = 72  # characters of an output line shown, at most
_NONE = "mgkit launch: none yet; mg.launch(fn, nprocs=...) shows its ranks here as they run"
_OUTPUT_STYLE = "font-family:monospace;text-align:left;white-space:pre"
_STATE_COLORS = {
    "done": "#2e7d32",
    "failed": "#c62828",
    "aborted": "#c62828",
    "stalled": "#ef6c00",
    "terminated": "#757575",
    "starting": "#757575",
    "lost": "#c62828",
    "raised": "#c62828",
    "stopped": "#757575",
}


class LaunchRow(NamedTuple):
    """One rank as a launch view shows it."""

    rank: int
    pid: int
    devices: str  # comma-separated device names
    state: str  # RankInfo.state: starting, running, stalled, done, failed, aborted or terminated
    # (a cluster's engine: ready, running, raised, lost, stopped or closed)
    status: str  # what the view says: ready, running step 12, stalled after step 12, done, ...
    beat: str  # seconds since its last heartbeat ("" before the first), frozen when it ended
    # (a cluster's engine: "0.3 s ago, step 120")
    output: tuple[str, ...]  # its last output lines, shortened


def rank_status(r: RankInfo) -> str:
    """``ready`` (running, no step reported yet), ``running step k``, ``stalled after step k``,
    else the rank's state (starting, done, failed, aborted, terminated)."""
    if r.state == "running" and r.step is None:
        return "ready"
    if r.state == "stalled" and r.step is not None:
        return f"stalled after step {r.step}"
    return r.status()


def last_lines(tail: Iterable[str], count: int, width: int = _OUTPUT_WIDTH) -> tuple[str, ...]:
    """The last ``count`` lines of a rank's output, each cut to ``width`` characters; a line
    redrawn with carriage returns (a progress bar) shows its last state."""
    if count <= 0:
        return ()
    lines: list[str] = []
    for _ in range(100):
        try:
            lines = list(tail)[-count:]
            break
        except RuntimeError:  # appended to by the launch's reader thread while copied: copy again
            continue
    out = []
    for line in lines:
        line = str(line).rsplit("\r", 1)[-1].expandtabs(4).rstrip()
        out.append(line if len(line) <= width else line[: width - 3] + "...")
    return tuple(out)


def _beat(r: RankInfo, now: float) -> str:
    if r.beat_at is None:
        return ""
    end = now if r.seconds is None else r.started + r.seconds
    return f"{max(end - r.beat_at, 0.0):.1f} s"


def launch_rows(
    ranks: Iterable[RankInfo], lines: int, now: float | None = None, warm: bool = False
) -> tuple[LaunchRow, ...]:
    """A row per rank of a running (or finished) launch; heartbeat ages at ``now`` for live
    ranks, at their exit for ended ones. ``warm``: a cluster's engines, which outlive their
    calls: the status is the engine's state, the beat its age and step (``0.3 s ago, step 120``)."""
    now = time.time() if now is None else now
    return tuple(
        LaunchRow(
            r.rank,
            r.pid,
            ",".join(r.devices) or "?",
            r.state,
            r.state if warm else rank_status(r),
            r.beat_text(now) if warm else _beat(r, now),
            last_lines(r.tail, lines),
        )
        for r in sorted(ranks, key=operator.attrgetter("rank"))
    )


# -- a finished launch, from the ledger ----------------------------------------------------------


class LedgerLaunch(NamedTuple):
    """The newest launch the ledger's ``launch`` events tell of."""

    label: int | None  # the cell that ran it (None outside IPython, or when there was none)
    rows: tuple[LaunchRow, ...]  # a row per rank that reported, by rank


def _final_state(e: RankEvent) -> str:
    """The state a rank ended in, from its newest event."""
    if e.what == "done":
        return "done"
    if e.what == "failed":
        return e.state if e.state in ("failed", "stalled", "aborted", "terminated") else "failed"
    if e.what == "stalled":
        return "stalled"
    return "terminated"  # ready, and no exit reported: stopped with the others


def ledger_launch(events: Iterable[Event]) -> LedgerLaunch:
    """The newest launch in the ledger's ``launch`` events: its cell label and a row per rank
    that reported, from each rank's newest event. The ledger keeps no output or heartbeat age.

    Launches run one after another: an event that ended before the newest launch's first rank
    started belongs to an earlier launch, and so does a rank number seen with another pid.
    """
    parsed = [r for r in map(launching.rank_event, events) if r is not None]
    parsed.sort(key=operator.attrgetter("end"), reverse=True)  # newest first
    since = math.inf  # when the newest launch's first rank started (its events' earliest start)
    newest: dict[int, RankEvent] = {}
    label = None
    for e in parsed:
        if e.end < since and newest:
            break  # ended before the newest launch began
        since = min(since, e.start)
        if e.rank in newest:
            continue
        newest[e.rank] = e
        label = e.label if label is None else label
    rows = []
    for rank, e in sorted(newest.items()):
        state = _final_state(e)
        rows.append(LaunchRow(rank, e.pid, ",".join(e.devices) or "?", state, state, "", ()))
    return LedgerLaunch(label, tuple(rows))


class _Shown(NamedTuple):
    """What a launch view shows."""

    title: str  # the line above the table (all there is when there is no launch)
    rows: tuple[LaunchRow, ...]  # a row per rank
    hosts: tuple[str, ...] = ()  # a cluster's engines: each row's host (a launch: none)


def _counts(rows: Sequence[LaunchRow]) -> str:
    counts = collections.Counter(r.state for r in rows)
    return ", ".join(f"{n} {state}" for state, n in counts.items())


class LaunchView(LiveView):
    """The ranks of the running ``mg.launch``, or of the last one: per rank its devices, state,
    last heartbeat's age and last lines of output, updated while the ranks run.

    States: starting, ready (running, no ``mg.beat`` step yet), running step k, stalled (after
    step k), done, failed, aborted, terminated. A heartbeat's age is counted to now while a rank
    runs and to its exit once it ended. A launch the view watched keeps its final table with
    the ranks' output; a view made after a launch shows that launch from the ledger's ``launch``
    events (states and devices, no output or heartbeats).

    With ``cluster=c`` it shows that cluster's engines instead, warm between calls: per rank its
    host, pid, devices, state (ready, running, raised, lost, stopped, closed), last heartbeat
    (``0.3 s ago, step 120``: ``mg.beat``, which trainers call every step, sent with the rank's
    ledger entries) and last output lines.

    Args:
      lines: output lines shown per rank, 0 to 20 (each cut to 72 characters).
      rate: refreshes per second, above 0 and at most 10.
      ledger: the ledger to read finished launches from (default ``mg.ledger()``).
      widget: True for an ipywidgets widget, False for text, None for a widget inside a
        Jupyter kernel and text elsewhere.
      live: a widget is refreshed by a background thread, also while ``mg.launch`` runs in the
        cell; False: only when you call ``refresh()``.
      cluster: an ``mg.Cluster`` whose engines to show (default: ``mg.launch``'s ranks).

    >>> import mgkit as mg
    >>> mg.ledger().clear()
    >>> print(mg.LaunchView(widget=False))  # doctest: +ELLIPSIS
    mgkit launch: none yet; mg.launch(fn, nprocs=...) shows its ranks here as they run
    """

    polls = True
    css_class = "mgkit-launch"
    headers = ("rank", "pid", "devices", "state", "last beat", "output")

    def __init__(
        self,
        lines: int = 2,
        rate: float = 2.0,
        ledger: Ledger | None = None,
        widget: bool | None = None,
        live: bool = True,
        cluster: Any = None,
    ):
        super().__init__(rate, ledger, widget, live)
        self.cluster = check_cluster(cluster, self._where)
        if self.cluster is not None:
            self.headers = ("rank", "host", *self.headers[1:])
        self.lines = check_count(lines, "lines", self._where, 0, TAIL, 2)
        self._seen: tuple[RankInfo, ...] = ()  # the ranks of the last launch seen running
        self._launches = -1  # launch events in the ledger's totals when last read
        self._from_ledger = LedgerLaunch(None, ())
        self._shown = _Shown("", ())
        self._start()

    @property
    def active(self) -> bool:
        """True when there is a launch to show (running, or finished and remembered)."""
        return bool(self._shown.rows)

    def rows(self) -> list[LaunchRow]:
        """A row per rank of the launch shown, now (empty when there is none)."""
        self.refresh()
        return list(self._shown.rows)

    def _running(self) -> Running | None:
        try:
            return launching.current()
        except IndexError:  # the launch ended between two reads
            return None

    def _read_ledger(self) -> LedgerLaunch:
        """The ledger's newest launch, read again only when its count of launch events changed."""
        count = sum(c for (kind, _, _), (c, _, _) in self._ledger.totals().items() if kind == Kind.LAUNCH)
        if count != self._launches:
            self._launches = count
            self._from_ledger = ledger_launch(self._ledger.records(Kind.LAUNCH))
        return self._from_ledger

    def _cluster_state(self, now: float) -> _Shown:
        """The cluster's engines, now."""
        c = self.cluster
        rows = launch_rows(c.ranks, self.lines, now, warm=True)
        if c.closed:
            rows = tuple(r._replace(state="closed", status="closed") for r in rows)
        hosts = tuple(c.hosts[r.rank] if r.rank < len(c.hosts) else "?" for r in rows)
        state = "closed" if c.closed else "lost a rank" if c.lost else "warm"
        title = f"mgkit cluster: {len(rows)} engine(s), {state}, {c.calls} call(s): {_counts(rows)}"
        return _Shown(title, rows, hosts)

    def _state(self) -> _Shown:
        now = time.time()
        if self.cluster is not None:
            return self._cluster_state(now)
        running = self._running()
        if running is not None:
            self._seen = running.ranks
            rows = launch_rows(self._seen, self.lines, now)
            starts = [r.started for r in self._seen if r.started > 0]
            elapsed = f" for {now - min(starts):.1f} s" if starts else ""
            return _Shown(f"mgkit launch: {len(rows)} rank(s) running{elapsed}: {_counts(rows)}", rows)
        label, logged = self._read_ledger()
        pids = {r.pid for r in self._seen}
        if self._seen and {r.pid for r in logged} <= pids:  # the launch this view watched
            rows = launch_rows(self._seen, self.lines, now)
            return _Shown(f"mgkit launch: last launch, {len(rows)} rank(s): {_counts(rows)}", rows)
        if logged:
            cell = f" ({cell_name(label)})" if label is not None else ""
            title = (
                f"mgkit launch: last launch{cell}, {len(logged)} rank(s): {_counts(logged)} "
                "(from the ledger: output and heartbeats show while a view watches)"
            )
            return _Shown(title, logged)
        return _Shown(_NONE, ())

    def _update(self, events: list[Event], budgeted: bool) -> bool:
        shown = self._state()
        if shown == self._shown:
            return False
        self._shown = shown
        self._show_html()
        return True

    def _rows(self) -> list[tuple]:
        rows = [(r.rank, r.pid, r.devices, r.status, r.beat, " | ".join(r.output)) for r in self._shown.rows]
        return _with_hosts(rows, self._shown.hosts)

    def text(self) -> str:
        title, rows, _ = self._shown
        return self._table(title) if rows else title

    def html(self) -> str:
        esc = html.escape
        title, rows, hosts = self._shown
        if not rows:
            return f'<div style="font-family:monospace;font-size:12px">{esc(title)}</div>'
        cells = []
        for r in rows:
            color = _STATE_COLORS.get(r.state)
            state = Markup(f'<span style="color:{color}">{esc(r.status)}</span>') if color else r.status
            output = Markup(f'<div style="{_OUTPUT_STYLE}">{"<br>".join(map(esc, r.output))}</div>')
            cells.append((r.rank, r.pid, r.devices, state, r.beat, output))
        return html_table(
            self.headers, _with_hosts(cells, hosts), title, [{"class": f"mgkit-rank-{r.state}"} for r in rows]
        )

    def _figsize(self) -> tuple[float, float]:
        return 10.0, 0.25 * (len(self._shown.rows) + 3) + 0.4

    def _draw_figure(self, fig: Any) -> None:
        fig.text(0.01, 0.98, self.text(), va="top", fontsize=8, family="monospace")


def _with_hosts(rows: list[tuple], hosts: tuple[str, ...]) -> list[tuple]:
    """A table's rows with each one's host after its rank (a cluster's engines), else as they are."""
    if not hosts:
        return rows
    return [(row[0], host, *row[1:]) for row, host in zip(rows, hosts, strict=True)]
