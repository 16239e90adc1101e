"""The memory view: bytes in use and peak per context over the last minutes, against the
device's limit, with a watched trainer's parameters, optimizer state and batch as bands."""

from __future__ import annotations

import collections
import time
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from .. import _contexts, _devices
from .._ledger import Event, Ledger
from .._numbers import real
from .._table import html_table, human_bytes, text_table
from . import _svg
from ._base import Plotted, check_cluster
from ._devicemap import LIVE_BYTES

MIB = float(1 << 20)
BUSY_AGE = 0.1  # seconds: the live arrays are summed again this soon while the ledger records
IDLE_AGE = 1.0  # seconds: and this soon while it records nothing
BANDS_AGE = 1.0  # seconds between two readings of a watched trainer's state, at least
BANDS = ("parameters", "optimizer state", "batch")  # a trainer's bands, from the bottom up
_BAND_COLORS = ("#c6dbef", "#fdd0a2", "#c7e9c0")
_LIMIT_COLOR = "#d62728"


class MemoryPoint(NamedTuple):
    """One sample of one context's memory."""

    t: float  # when it was taken, seconds since the view started
    used: int  # bytes in use
    peak: int  # the peak so far: the allocator's, or (live arrays) the most of the samples
    records: int  # ledger entries (a step, a put...) recorded since the previous sample


class Band(NamedTuple):
    """A watched trainer's state on one context, in bytes."""

    params: int  # parameters
    opt_state: int  # optimizer state
    batch: int  # the last fit's batch


class MemoryNow(NamedTuple):
    """One context as the memory view shows it now (``MemoryView.rows()``)."""

    context: str  # the context's name
    device: str  # its device's short name
    used: int | None  # bytes in use at the last sample (None: no sample yet)
    peak: int | None  # the peak: the allocator's since the process began, else the samples' most
    limit: int | None  # the device's byte limit (the allocator's, or mg.simulate's); None: unknown
    source: str | None  # "allocator" or "live arrays"
    band: Band | None  # a watched trainer's state on it (None: no trainer watched there)


class _Context:
    """One context's samples, newest last."""

    __slots__ = ("device", "limit", "most", "points", "source")

    def __init__(self, device: str, size: int):
        self.device = device
        self.points: collections.deque[MemoryPoint] = collections.deque(maxlen=size)
        self.most = 0  # the most bytes in use seen
        self.limit: int | None = None
        self.source: str | None = None


class MemoryView(Plotted):
    """Bytes in use and peak per context over the last ``window`` seconds, drawn against each
    device's limit; a watched trainer's parameters, optimizer state and batch as bands.

    Memory comes from the device's allocator where it reports statistics (GPUs, TPUs: in use and
    its peak, which also catches peaks between two samples); elsewhere (CPU, simulated devices)
    from the bytes of the live jax arrays on each device (the peak is then the most of the
    samples), drawn against the limit of ``mg.simulate(n, memory=...)`` where one was given.
    A sample is taken at every refresh (``rate`` a second, at most 10), so after the steps and
    moves the ledger recorded meanwhile (counted in each ``MemoryPoint``); refreshed live, the
    samples keep their rate also while the views' thread has spent its budget (the table and
    the picture then wait for it). The live arrays,
    which cost about 4 microseconds an array to sum, are summed again at most every 0.1 s while
    the ledger records and every 1 s while it does not, and within 1 % of a core (a reading
    shared with the device map).

    Trainers are not followed on their own: ``view.watch(trainer)`` adds its bands (read from
    ``trainer.memory()`` at most once a second while refreshed live, and at each ``refresh()``).

    With ``cluster=c`` every rank's contexts (``r1/dev2``) follow this kernel's: each rank reads
    its own devices' memory (the same sources, at most twice a second, a reading only when it
    changed) and sends it with its ledger entries; a rank's points are placed at the times the
    rank took them.

    Args:
      contexts: context names to show (default: every context of the current map).
      rate: samples (and refreshes) per second, above 0 and at most 10.
      window: seconds of history kept and drawn, 1 to 3600.
      ledger: the ledger whose records (steps, moves) say the live arrays may have changed, so
        they are summed again sooner (default ``mg.ledger()``).
      widget: True for an ipywidgets widget, False for text, None for a widget inside a
        Jupyter kernel and text elsewhere.
      live: a widget is refreshed by a background thread, also while a cell runs; False:
        only when you call ``refresh()``.
      cluster: an ``mg.Cluster`` whose ranks' contexts to show too (default: none).

    >>> import mgkit as mg
    >>> _ = mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    >>> print(mg.MemoryView(widget=False))  # doctest: +ELLIPSIS
    mgkit memory: 2 context(s), the last 300 s kept
    context  device  in use  peak  limit  source
    ...
    """

    kinds = frozenset()  # every kind (exclude): any record says the live arrays may have changed
    exclude = True
    polls = True
    samples = True  # its samples are taken at its rate even while the live thread's budget is spent
    css_class = "mgkit-memory"
    headers = ("context", "device", "in use", "peak", "limit", "source", *BANDS)
    figsize = (8.0, 4.5)

    def __init__(
        self,
        contexts: Iterable[str] | None = None,
        rate: float = 4.0,
        window: float = 300.0,
        ledger: Ledger | None = None,
        widget: bool | None = None,
        live: bool = True,
        cluster: Any = None,
    ):
        super().__init__(rate, ledger, widget, live, contexts)
        self.cluster = check_cluster(cluster, self._where)
        self.window = real(window, "window", self._where, lo=1, hi=3600, example=300, note="seconds kept")
        self._size = int(self.window * self.rate) + 2
        self._t0 = time.monotonic()
        self._wall0 = time.time()  # the same moment, for the times the ranks took their readings
        self._heard: dict[str, float] = {}  # per rank context: when its newest reading shown was taken
        self._ranks: set[str] = set()  # the ranks' contexts shown
        self._state: dict[str, _Context] = {}
        self._trainers: list[weakref.ref] = []
        self._bands: dict[str, Band] = {}
        self._bands_at = -BANDS_AGE
        self._records = 0  # ledger entries since the last sample
        self._shown: list[tuple] = []
        self.samples = 0
        self._start()

    # -- what is watched -----------------------------------------------------------------------

    def watch(self, trainer: Any) -> MemoryView:
        """Shows ``trainer``'s parameters, optimizer state and batch per context as bands (read
        from ``trainer.memory()``); returns the view. The view holds the trainer weakly.

        Args:
          trainer: an ``mg.Trainer`` (anything with a ``memory()`` method that returns an
            ``mg.train.MemoryTable``).
        """
        if not callable(getattr(trainer, "memory", None)):
            raise TypeError(
                f"{self._where}.watch(trainer): trainer must be an mg.Trainer (something with a "
                f"memory() method giving its bytes per context), got {type(trainer).__name__} {trainer!r}"
            )
        if self.closed:
            raise RuntimeError(f"{self._where}.watch(): the view is closed; make a new mg.MemoryView()")
        with self._lock:
            self._trainers.append(weakref.ref(trainer))
            self._bands_at = -BANDS_AGE
        self.refresh()
        return self

    def _read_bands(self, now: float, fresh: bool) -> bool:
        """Reads the watched trainers' state per context when due (or ``fresh``); True when the
        bands changed."""
        if not self._trainers or (not fresh and now < self._bands_at + BANDS_AGE):
            return False
        self._bands_at = now
        self._trainers = [ref for ref in self._trainers if ref() is not None]
        bands: dict[str, Band] = {}
        for ref in self._trainers:
            trainer = ref()
            try:
                table = [] if trainer is None else trainer.memory().rows()
            except RuntimeError:  # its state was given to a step that is running: read it next time
                self._bands_at = now - BANDS_AGE + BUSY_AGE
                return False
            for r in table:
                old = bands.get(r.context, Band(0, 0, 0))
                bands[r.context] = Band(
                    old.params + r.params, old.opt_state + r.opt_state, old.batch + r.batch
                )
        changed = bands != self._bands
        self._bands = bands
        return changed

    # -- sampling ------------------------------------------------------------------------------

    def _sample(self, busy: bool, fresh: bool) -> None:
        """Takes one sample of every context shown."""
        cmap = _contexts.context_map()
        shown = [n for n in cmap.names if self.contexts is None or n in self.contexts]
        devices = [_contexts.device_of(name) for name in shown]
        age = BUSY_AGE if busy else IDLE_AGE
        now = _devices.readings(devices, lambda: LIVE_BYTES(fresh, age))
        t = time.monotonic() - self._t0
        for name, device in zip(shown, devices, strict=True):
            r = now[device]
            ctx = self._state.get(name)
            short = _devices.short_name(device)
            if ctx is None or ctx.device != short:  # new, or mapped to another device
                ctx = self._state[name] = _Context(short, self._size)
            used = r.used or 0
            ctx.most = max(ctx.most, used)
            ctx.limit, ctx.source = r.limit, r.source
            ctx.points.append(MemoryPoint(t, used, max(r.peak or 0, ctx.most), self._records))
        ranks = self._ranks = self._sample_ranks() if self.cluster is not None else set()
        for gone in [n for n in self._state if n not in shown and n not in ranks]:
            del self._state[gone]
        self._records = 0
        self.samples += 1

    def _sample_ranks(self) -> set[str]:
        """Adds the readings the cluster's ranks sent since the last sample, each at the time
        its rank took it; returns the ranks' contexts."""
        streams = getattr(self.cluster, "streams", None)
        if streams is None:  # the cluster did not start
            return set()
        new = streams.memory(self._heard)
        for name, samples in new.items():
            ctx = self._state.get(name)
            for s in samples:
                if ctx is None or ctx.device != s.device:  # new, or another device after a restart
                    ctx = self._state[name] = _Context(s.device, self._size)
                used = s.used or 0
                ctx.most = max(ctx.most, used)
                ctx.limit, ctx.source = s.limit, s.source
                ctx.points.append(MemoryPoint(s.t - self._wall0, used, max(s.peak or 0, ctx.most), 0))
                self._heard[name] = s.t
        return set(new)

    def _refresh(self, budgeted: bool) -> bool:
        with self._lock:  # what was recorded is counted, not read: no events are made
            if self._feed is not None:
                self._records += self._feed.skip()
        return super()._refresh(budgeted)

    def _when_spent(self) -> bool:
        """A sample, nothing else (the live thread's budget is spent: the table, the bands and
        the picture follow once it allows)."""
        with self._lock:
            if self.closed:
                return False
            if self._feed is not None:
                self._records += self._feed.skip()
            self._sample(busy=self._records > 0, fresh=False)
            self._version += 1
            return True

    def _update(self, events: list[Event], budgeted: bool) -> bool:
        self._records += len(events)
        self._sample(busy=self._records > 0, fresh=not budgeted)
        self._read_bands(time.monotonic(), fresh=not budgeted)
        self._version += 1
        rows = self._rows()
        changed = rows != self._shown
        if changed:
            self._shown = rows
            self._show_html()
        if self._plot is not None:
            changed |= self._redraw(budgeted)
        return changed

    # -- what is shown -------------------------------------------------------------------------

    def rows(self) -> list[MemoryNow]:
        """A ``MemoryNow`` per context shown, after a fresh sample."""
        self.refresh()
        return self._now()

    def _now(self) -> list[MemoryNow]:
        out = []
        for name, ctx in self._state.items():
            last = ctx.points[-1] if ctx.points else None
            used, peak = (None, None) if last is None else (last.used, last.peak)
            out.append(MemoryNow(name, ctx.device, used, peak, ctx.limit, ctx.source, self._bands.get(name)))
        return out

    def history(self, context: str) -> list[MemoryPoint]:
        """The samples of ``context`` kept (the last ``window`` seconds), oldest first."""
        with self._lock:
            if context not in self._state:
                raise KeyError(
                    f"{self._where}.history({context!r}): no samples of {context!r}; the contexts shown "
                    f"are {', '.join(self._state) or '(none yet)'}"
                )
            cut = self._state[context].points[-1].t - self.window
            return [p for p in self._state[context].points if p.t >= cut]

    def _rows(self) -> list[tuple]:
        def size(n: int | None) -> str:
            return "?" if n is None else human_bytes(n)

        rows = []
        for r in self._now():
            band = [human_bytes(b) for b in r.band] if r.band else ["", "", ""]
            limit = "unknown" if r.limit is None else human_bytes(r.limit)
            rows.append((r.context, r.device, size(r.used), size(r.peak), limit, r.source or "", *band))
        return rows

    def _table(self, title: str, as_html: bool = False) -> str:
        """The table, with the band columns only once a watched trainer has some."""
        keep = len(self.headers) if self._bands else len(self.headers) - len(BANDS)
        rows = [row[:keep] for row in self._rows()]
        return (html_table if as_html else text_table)(self.headers[:keep], rows, title)

    def _title(self) -> str:
        title = f"mgkit memory: {len(self._state)} context(s), the last {self.window:g} s kept"
        if self.cluster is not None:
            title += f" ({len(self._ranks)} of them on the cluster's ranks, read there)"
        return title

    def _note(self) -> str:
        if any(c.source == _devices.LIVE_ARRAYS for c in self._state.values()):
            return (
                "live arrays: the bytes of the jax arrays alive on the device (no allocator statistics); "
                "the peak is the most of the samples"
            )
        return ""

    def text(self) -> str:
        note = self._note()
        return self._table(self._title()) + (f"\n{note}" if note else "")

    def html(self) -> str:
        return self._table(self._title(), as_html=True)

    def _build(self, widgets: Any) -> Any:
        self._html = widgets.HTML()
        self._plot = widgets.HTML()
        return widgets.VBox([self._html, self._plot])

    # -- pictures ------------------------------------------------------------------------------

    def _series(self, ctx: _Context, name: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The lines of one context's panel, in MiB: in use, peak, limit and the bands' tops."""
        pts = list(ctx.points)
        if not pts:
            return {}
        cut = pts[-1].t - self.window
        pts = [p for p in pts if p.t >= cut]
        t = np.fromiter((p.t for p in pts), float, len(pts))
        ends = np.array([t[0], t[-1]])
        out = {
            "in use": (t, np.fromiter((p.used for p in pts), float, len(pts)) / MIB),
            "peak": (t, np.fromiter((p.peak for p in pts), float, len(pts)) / MIB),
        }
        if ctx.limit:
            out["limit"] = (ends, np.full(2, ctx.limit / MIB))
        band = self._bands.get(name)
        if band is not None:
            for label, top in zip(BANDS, np.cumsum(band), strict=True):
                out[f"+ {label}"] = (ends, np.full(2, top / MIB))
        return out

    def svg(self) -> str:
        panels = [_svg.Panel(f"{name} MiB", self._series(ctx, name)) for name, ctx in self._state.items()]
        palette = {"in use": _svg.PALETTE[0], "peak": _svg.PALETTE[1], "limit": _LIMIT_COLOR}
        palette.update({f"+ {label}": c for label, c in zip(BANDS, _BAND_COLORS, strict=True)})
        title = "memory per context (bands: a watched trainer's state, stacked)"
        return _svg.lines(panels, palette, title, "time since the view started (s)", panel_height=70)

    def _figsize(self) -> tuple[float, float]:
        return 8.0, 1.0 + 1.4 * max(len(self._state), 1)

    def _draw(self, axes: list[Any]) -> None:
        """Each context's memory on its own axes: bands, in use, peak and the limit."""
        for ax, (name, ctx) in zip(axes, self._state.items(), strict=False):
            series = self._series(ctx, name)
            ax.clear()
            band = self._bands.get(name)
            if band is not None:
                tops = np.cumsum([0, *band]) / MIB
                for label, lo, hi, color in zip(BANDS, tops[:-1], tops[1:], _BAND_COLORS, strict=True):
                    ax.axhspan(lo, hi, color=color, alpha=0.8, label=label)
            for key, style in (("in use", "-"), ("peak", "--")):
                if key in series:
                    ax.plot(*series[key], style, label=key, lw=1.2)
            if ctx.limit:
                ax.axhline(ctx.limit / MIB, color=_LIMIT_COLOR, lw=1, label=f"limit {human_bytes(ctx.limit)}")
            ax.set_ylabel(f"{name}\nMiB", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=6, loc="upper left")
        if axes:
            axes[-1].set_xlabel("time since the view started (s)", fontsize=8)

    def _draw_total(self, ax: Any) -> None:
        """Every context's bytes in use on one axes, with the limits (the dashboard's panel)."""
        ax.clear()
        palette = _svg.colors(list(self._state))
        for name, ctx in self._state.items():
            series = self._series(ctx, name)
            if "in use" in series:
                ax.plot(*series["in use"], color=palette[name], lw=1.2, label=name)
        for limit in sorted({ctx.limit for ctx in self._state.values() if ctx.limit}):
            ax.axhline(limit / MIB, color=_LIMIT_COLOR, lw=1, label=f"limit {human_bytes(limit)}")
        ax.set_ylabel("MiB in use", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_title("memory per context over time", fontsize=9)
        if self._state:
            ax.legend(fontsize=6, loc="upper left", ncol=4)

    def _draw_figure(self, fig: Any) -> None:
        axes = fig.subplots(max(len(self._state), 1), 1, sharex=True, squeeze=False)[:, 0]
        self._draw(list(axes))
        fig.suptitle("memory per context", fontsize=9)
