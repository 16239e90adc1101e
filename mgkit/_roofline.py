"""How long a compiled step should take on its devices: a roofline model per context.

A step's time on one context is predicted as

    max(flops / peak flop/s, bytes accessed / memory bandwidth)   (compute or memory, overlapped)
    + bytes the busiest context sends / link bandwidth            (collectives, not overlapped)
    + hops x link latency                                          (each ring step of each collective)
    + dispatch                                                     (launching one program)

with ``flops`` and ``bytes accessed`` from XLA's cost analysis of the partitioned program (per
context) and the bytes sent from the ring model of its collectives (``mgkit._spmd``). The
device's figures come from ``KNOWN`` (datasheet figures of common accelerators, dense, per
device; the link is NVLink's per direction, or PCIe's where the device's kind says PCIe) and,
on a CPU or a device not in the table, from a calibration timed once per session: a float32
matmul (peak), a copy (memory bandwidth), a transfer between two devices (link) and a tiny
program (dispatch), each on one device; where n simulated CPU devices run a step at once they
share the host's cores, so their peak and bandwidth are timed again with all n working at once
(once per count, ``together``). The latency of a hop is a small transfer's time (a table
device: 10 us). A ring collective over p contexts takes p - 1 hops (an all-reduce 2 (p - 1):
a reduce-scatter then an all-gather).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# kind (a part of jax's device_kind) -> (bf16/fp16 dense flop/s, fp32 dense flop/s (TF32 where
# matmuls use it), memory bytes/s, link bytes/s per direction): datasheet figures, SXM/NVLink
# boards unless the kind says PCIe. The first match in order wins (H100 PCIe before H100).
KNOWN: tuple[tuple[str, tuple[float, float, float, float]], ...] = (
    ("H200", (989e12, 494e12, 4.8e12, 450e9)),
    ("H100 PCIe", (756e12, 378e12, 2.0e12, 64e9)),
    ("H100", (989e12, 494e12, 3.35e12, 450e9)),
    ("GH200", (989e12, 494e12, 4.0e12, 450e9)),
    ("A100-PCIE", (312e12, 156e12, 1.94e12, 32e9)),
    ("A100-SXM4-40GB", (312e12, 156e12, 1.555e12, 300e9)),
    ("A100", (312e12, 156e12, 2.04e12, 300e9)),
    ("L40S", (362e12, 183e12, 0.864e12, 32e9)),
    ("L4", (121e12, 60e12, 0.3e12, 32e9)),
    ("A10", (125e12, 62.5e12, 0.6e12, 32e9)),
    ("V100", (125e12, 15.7e12, 0.9e12, 150e9)),
    ("T4", (65e12, 8.1e12, 0.32e12, 16e9)),
    ("TPU v5 lite", (197e12, 98.5e12, 0.819e12, 200e9)),
    ("TPU v4", (275e12, 137.5e12, 1.2e12, 300e9)),
)


class Figures(NamedTuple):
    """What one context can do: peak flop/s, memory and link bytes/s, seconds to dispatch a
    program and for one hop of a collective, and where the figures come from (``"table: H100"``
    or ``"calibrated"``)."""

    flops: float
    bandwidth: float
    link: float
    dispatch: float
    source: str
    latency: float = 10e-6

    def shared(self, flops: float, bandwidth: float, n: int) -> Figures:
        """These figures with the peak and memory bandwidth each of ``n`` devices gets while all
        ``n`` run at once (simulated CPU devices share the host's cores)."""
        return self._replace(flops=flops, bandwidth=bandwidth, source=f"{self.source}, {n} at once")


class Prediction(NamedTuple):
    """A step's predicted seconds per context, by part; ``seconds`` is the step."""

    compute: float
    memory: float
    communication: float
    dispatch: float

    @property
    def seconds(self) -> float:
        return max(self.compute, self.memory) + self.communication + self.dispatch

    @property
    def bound(self) -> str:
        """What the step waits on most: "compute", "memory", "communication" or "dispatch"."""
        parts = {
            "compute": self.compute,
            "memory": self.memory,
            "communication": self.communication,
            "dispatch": self.dispatch,
        }
        return max(parts, key=parts.get)


def predict(
    flops: float | None, accessed: float | None, sent: float, figures: Figures, hops: int = 0
) -> Prediction:
    """The roofline prediction of one step (see the module's text); unknown flops or bytes
    count as none."""
    return Prediction(
        (flops or 0.0) / figures.flops,
        (accessed or 0.0) / figures.bandwidth,
        sent / figures.link + hops * figures.latency,
        figures.dispatch,
    )


def hops(ops: list[tuple[str, int, int]]) -> int:
    """The ring steps of collectives given as (op, count, contexts each joins)."""
    return sum(count * max(0, n - 1) * (2 if op == "all-reduce" else 1) for op, count, n in ops)


def known(kind: str, reduced: bool) -> Figures | None:
    """The table's figures for a device kind (``reduced``: bf16/fp16 compute), or None."""
    for name, (half, full, bandwidth, link) in KNOWN:
        if name.lower() in kind.lower():
            return Figures(half if reduced else full, bandwidth, link, 10e-6, f"table: {name}")
    return None


_calibrated: dict[str, Figures] = {}  # platform -> the figures timed this session


def figures(device: jax.Device, reduced: bool = False) -> Figures:
    """The figures of ``device``'s kind: from the table, else calibrated (once per platform and
    session, about half a second)."""
    found = known(getattr(device, "device_kind", "") or "", reduced)
    if found is not None:
        return found
    if device.platform not in _calibrated:
        _calibrated[device.platform] = calibrate(device)
    return _calibrated[device.platform]


_together: dict[tuple, Figures] = {}  # (platform, n) -> the figures of n devices at once


def together(devices: tuple, reduced: bool = False) -> Figures:
    """The figures of each of ``devices`` while all of them run at once: for CPU devices a
    batched matmul and a copy split over them, timed once per count and session (each device
    gets its share of the host's cores); other devices' own figures."""
    one = figures(devices[0], reduced)
    if devices[0].platform != "cpu" or len(devices) == 1:
        return one
    key = (devices[0].platform, len(devices))
    if key not in _together:
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        n, m = len(devices), 512
        split = NamedSharding(Mesh(np.array(devices), ("i",)), P("i"))
        a = jax.device_put(jnp.ones((n, m, m), jnp.float32), split)
        matmul = jax.jit(lambda x: x @ x)
        peak = 2 * m**3 / _best(lambda: matmul(a))
        big = jax.device_put(jnp.ones((n, 2**21), jnp.float32), split)
        copy = jax.jit(lambda x: x * 2.0)
        bandwidth = 2 * big.nbytes / n / _best(lambda: copy(big))
        _together[key] = one.shared(peak, bandwidth, n)
    return _together[key]


def _best(fn, repeats: int = 5) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (after one untimed), in seconds."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def calibrate(device: jax.Device) -> Figures:
    """Times ``device`` (and the next device of its platform, for the link): a 1024 x 1024
    float32 matmul, a 32 MiB copy, a 16 MiB transfer and an empty program."""
    peers = [d for d in jax.devices(device.platform) if d != device]
    n = 1024
    a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
    matmul = jax.jit(lambda x: x @ x)
    peak = 2 * n**3 / _best(lambda: matmul(a))
    big = jax.device_put(jnp.ones((8 * 2**20,), jnp.float32), device)
    copy = jax.jit(lambda x: x * 2.0)
    bandwidth = 2 * big.nbytes / _best(lambda: copy(big))  # read once, written once
    if peers:
        moving = jax.device_put(np.ones((4 * 2**20,), np.float32), device)
        link = moving.nbytes / _best(lambda: jax.device_put(moving, peers[0]))
        small = jax.device_put(np.ones((16,), np.float32), device)
        latency = _best(lambda: jax.device_put(small, peers[0]), repeats=20)
    else:
        link, latency = bandwidth, 0.0
    tiny = jax.device_put(jnp.ones((), jnp.float32), device)
    noop = jax.jit(lambda x: x + 1)
    dispatch = _best(lambda: noop(tiny), repeats=20)
    return Figures(peak, bandwidth, link, dispatch, "calibrated", latency)
