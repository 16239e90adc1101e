"""The most memory each device held while some code ran (``%%mgkit_peak``).

Where the device's allocator reports statistics (GPUs, TPUs), its ``peak_bytes_in_use`` is read
before and after: JAX cannot reset that peak, so when the code raised it the new peak is the
code's own (exact); when it did not, the code's peak is at most the old one and at least the
most in use seen while it ran (a lower bound). Elsewhere (CPU, simulated devices) a thread sums
the live jax arrays on each device while the code runs, within a share of a core: a lower bound
too, since the temporaries inside a compiled program are not live arrays.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import jax

from . import _devices

PERIOD = 0.05  # seconds between two samples, at least
SHARE = 0.05  # share of a core the sampling thread may take (a live-array sum costs ~4 us an array)


class Peak(NamedTuple):
    """One device's most memory in use while the code ran."""

    peak: int | None  # bytes (None: the device reports nothing and has no live arrays counted)
    exact: bool  # True: the allocator's peak, raised by the code; False: a lower bound
    source: str | None  # ``_devices.ALLOCATOR`` or ``_devices.LIVE_ARRAYS``
    samples: int  # readings taken while the code ran (the first and last included)


class PeakWatch:
    """Samples the memory in use on ``devices`` from ``start()`` to ``stop()``, in a thread.

    >>> import jax, jax.numpy as jnp
    >>> watch = PeakWatch(jax.devices()[:1]).start()
    >>> x = jnp.ones(1000)
    >>> peaks = watch.stop()
    >>> peaks[jax.devices()[0]].peak >= 4000
    True
    """

    def __init__(self, devices: list[jax.Device], period: float = PERIOD, share: float = SHARE):
        self.devices = list(dict.fromkeys(devices))
        self.period, self.share = period, share
        self._most: dict[jax.Device, int] = {}
        self._before: dict[jax.Device, _devices.Reading] = {}
        self._samples = 0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.busy = 0.0  # CPU seconds the samples took

    def _sample(self) -> dict[jax.Device, _devices.Reading]:
        t0 = time.thread_time()
        now = _devices.readings(self.devices)
        for device, r in now.items():
            if r.used is not None:
                self._most[device] = max(self._most.get(device, 0), r.used)
        self._samples += 1
        self.busy += time.thread_time() - t0
        return now

    def _run(self) -> None:
        while not self._done.is_set():
            t0 = time.thread_time()
            self._sample()
            cost = time.thread_time() - t0
            self._done.wait(max(self.period, cost / self.share))

    def start(self) -> PeakWatch:
        """Takes the first reading and starts the sampling thread; returns the watch."""
        self._before = self._sample()
        self._thread = threading.Thread(target=self._run, name="mgkit-peak", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[jax.Device, Peak]:
        """Stops the thread, takes the last reading; returns a ``Peak`` per device."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        after = self._sample()
        out = {}
        for device in self.devices:
            first, last = self._before.get(device), after[device]
            raised = (
                last.peak is not None
                and first is not None
                and first.peak is not None
                and last.peak > first.peak
            )
            most = self._most.get(device)
            out[device] = Peak(last.peak if raised else most, raised, last.source, self._samples)
        return out
