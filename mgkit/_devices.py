"""Devices: stable short names (cpu0, cuda0, tpu0), the device table, and simulated CPU devices
(with a memory limit of their own, if given)."""

from __future__ import annotations

import functools
import math
import os
import platform
import re
from collections.abc import Callable
from typing import NamedTuple

import jax

from ._errors import ContextError
from ._numbers import nbytes, whole
from ._table import Table, human_bytes

# Platforms whose devices get short names, in display order (accelerators first).
_GPU_PLATFORMS = ("cuda", "rocm")
_DEVICE_SPEC = re.compile(r"^(cpu|cuda|rocm|gpu|tpu)(0|[1-9][0-9]*)$")


def parse_device_spec(spec: str) -> tuple[str, int] | None:
    """('cuda', 1) for 'cuda1', ('cpu', 0) for 'cpu'; None when spec is not a device name."""
    if spec == "cpu":
        return "cpu", 0
    m = _DEVICE_SPEC.match(spec)
    return (m.group(1), int(m.group(2))) if m else None


def backend_started() -> bool:
    """True once JAX has started its backends (device counts can no longer change)."""
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - layout of a future jax
        return True
    check = getattr(xla_bridge, "backends_are_initialized", None)
    if check is None:  # pragma: no cover - layout of a future jax
        return bool(getattr(xla_bridge, "_backends", None))
    return bool(check())


def simulate(n: int, memory: int | str | None = None) -> None:
    """Gives JAX ``n`` CPU devices to work with, for multi-device code on a machine without GPUs.

    Must run before the first JAX operation. Calling it again with the count already in
    effect does nothing (but set ``memory``); any other count after JAX started raises
    ``RuntimeError``.

    ``memory`` gives each CPU device a byte limit, so a laptop can rehearse a machine of 8 x 80 GB
    GPUs: the device table, the device map and the dashboard's memory bars show the bytes of the
    live arrays on each device against it, and ``mg.memory_limit`` returns it. It is a figure
    mgkit reports and plans with; XLA does not enforce it.

    Simulated devices share the host's cores, and XLA's CPU runtime can deadlock when two
    programs with collectives (a ``psum``, the mean of a sharded array, a data-parallel
    gradient) are in flight at once on a machine with few cores. In a training loop on
    simulated devices, wait for each step, e.g. by reading its loss with ``float(loss)``;
    ``mg.pmap`` waits for its own result on CPU devices. GPUs do not have this problem.

    Args:
      n: number of CPU devices, at least 1.
      memory: each CPU device's byte limit: a number of bytes or a size such as ``"16GiB"``,
        ``"16 GB"``, ``"512MiB"``; None leaves the limit as it is (none, unless set before or by
        ``MGKIT_SIMULATE_MEMORY``).

    >>> import mgkit as mg
    >>> mg.simulate(8)
    >>> mg.simulate(8, memory="80GiB")  # rehearse 8 x 80 GiB   # doctest: +SKIP
    """
    n = whole(n, "n", "simulate", lo=1, example=8, note="the number of CPU devices")
    limit = None if memory is None else nbytes(memory, "memory", "simulate", example="16GiB")
    if not backend_started():
        jax.config.update("jax_num_cpu_devices", n)
        _clear_caches()
    elif len(jax.devices("cpu")) != n:
        have = len(jax.devices("cpu"))
        raise RuntimeError(
            f"mg.simulate({n}) came too late: JAX has already started with {have} CPU device(s), and "
            "the CPU device count can only be set before the first JAX operation. To fix it: restart "
            f"the kernel and call mg.simulate({n}) right after `import mgkit`, before any array is "
            f"made; or set MGKIT_SIMULATE={n} in the environment; or run the code in a fresh process."
        )
    if limit is not None:
        _set_simulated_limit(limit)


# The byte limit given to CPU devices by ``simulate(n, memory=...)`` (None: none given).
_simulated_limit: int | None = None


def _set_simulated_limit(limit: int) -> None:
    global _simulated_limit
    _simulated_limit = limit


def memory_limit(device: jax.Device) -> int | None:
    """A device's byte limit: its allocator's where it reports one, else the limit
    ``simulate(n, memory=...)`` gave CPU devices, else None."""
    limit = memory_stats(device).get("bytes_limit")
    if limit is None and device.platform == "cpu":
        return _simulated_limit
    return limit


def _clear_caches() -> None:
    _all_devices.cache_clear()
    _names_by_device.cache_clear()


class DeviceInfo(NamedTuple):
    """One row of the device table."""

    name: str
    platform: str
    kind: str
    description: str
    process_index: int
    memory_in_use: int | None
    memory_limit: int | None
    device: jax.Device
    memory_source: str | None = None  # ALLOCATOR, LIVE_ARRAYS, or None when memory is unknown


def _platform_of(device: jax.Device, client_platform: str) -> str:
    if device.platform == "gpu" or client_platform in _GPU_PLATFORMS:
        return client_platform if client_platform in _GPU_PLATFORMS else "cuda"
    return device.platform


@functools.lru_cache(maxsize=1)
def _all_devices() -> tuple[tuple[str, jax.Device], ...]:
    """Every device of every platform JAX can see, named, accelerators first."""
    import jax.extend.backend as jax_backend

    named: list[tuple[int, str, jax.Device]] = []
    for client_platform, client in jax_backend.backends().items():
        devs = sorted(client.devices(), key=lambda d: d.id)
        for i, d in enumerate(devs):
            plat = _platform_of(d, client_platform)
            order = 2 if plat == "cpu" else (1 if plat == "tpu" else 0)
            named.append((order, f"{plat}{i}", d))
    named.sort(key=lambda t: t[0])
    return tuple((name, d) for _, name, d in named)


def all_devices() -> tuple[tuple[str, jax.Device], ...]:
    """Pairs (short name, device) for every device; starts JAX's backends."""
    return _all_devices()


def short_name(device: jax.Device) -> str:
    """The stable short name of a device (``cpu3``, ``cuda0``)."""
    name = _names_by_device().get(device)
    return name if name is not None else str(device)


@functools.lru_cache(maxsize=1)
def _names_by_device() -> dict[jax.Device, str]:
    return {d: name for name, d in _all_devices()}


def device_names() -> list[str]:
    return [name for name, _ in _all_devices()]


def lookup_device(spec: str) -> jax.Device:
    """Finds the device a spec (``cpu``, ``cpu3``, ``cuda0``, ``gpu0``, ``tpu1``) names.

    Raises ValueError naming the spec and listing the devices that exist.
    """
    parsed = parse_device_spec(spec)
    if parsed is None:
        raise ContextError(f"{spec!r} is not a device name; {_expected_devices()}")
    plat, idx = parsed
    if plat == "gpu":
        candidates = [d for n, d in _all_devices() if n.startswith(_GPU_PLATFORMS)]
    else:
        candidates = [d for n, d in _all_devices() if re.fullmatch(plat + r"\d+", n)]
    if idx < len(candidates):
        return candidates[idx]
    if not candidates:
        why = f"this machine has no {plat.upper() if plat != 'rocm' else 'ROCm'} devices"
        if plat in ("cuda", "gpu", "rocm"):
            why += " (no GPU, or a CPU-only jaxlib; for GPUs install jax[cuda12] or jax[cuda13])"
    else:
        why = f"there are only {len(candidates)} {plat} device(s), numbered 0..{len(candidates) - 1}"
    hint = ""
    if plat == "cpu":
        hint = f"; for more CPU devices call mg.simulate({idx + 1}) before any JAX operation"
    raise ContextError(f"device {spec!r} does not exist: {why}{hint}. {_expected_devices()}")


def _expected_devices() -> str:
    names = device_names()
    shown = ", ".join(names[:16]) + (f", ... ({len(names)} in all)" if len(names) > 16 else "")
    return f"devices that exist: {shown}"


def describe(device: jax.Device) -> str:
    """A one-line description of a device: the GPU model, or the host CPU model for CPU devices."""
    if device.platform != "cpu":
        return device.device_kind
    n = len(jax.devices("cpu"))
    model = _cpu_model()
    return f"{model} (CPU device {device.id} of {n}{', simulated' if n > 1 else ''})"


@functools.lru_cache(maxsize=1)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "host CPU"


def memory_stats(device: jax.Device) -> dict:
    """The device's memory statistics, or {} where it reports none (CPU)."""
    try:
        return device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return {}


def memory(device: jax.Device) -> tuple[int | None, int | None]:
    """(bytes in use, byte limit) where the device reports them, else (None, None)."""
    stats = memory_stats(device)
    return stats.get("bytes_in_use"), stats.get("bytes_limit")


ALLOCATOR = "allocator"
"""Memory figures from the device's own allocator statistics (``device.memory_stats()``)."""
LIVE_ARRAYS = "live arrays"
"""Memory figures summed over the jax arrays alive on the device (``jax.live_arrays()``), for
devices that report no statistics (CPU): what the program holds, without a limit."""


def live_array_bytes() -> dict[jax.Device, int]:
    """Bytes held by the live jax arrays on each device: every array's shard on each of its
    addressable devices (a replicated array counts once per device that holds a copy).

    About 3-4 microseconds per live array: a live view calls it at most once per refresh.
    """
    held: dict[jax.Device, int] = {}
    get = held.get
    for a in jax.live_arrays():
        try:
            sharding = a.sharding
            devices = sharding.device_set
            if len(devices) == 1:  # the common case: no shapes to work out
                (device,) = devices
                held[device] = get(device, 0) + a.nbytes
                continue
            if a.is_deleted():
                continue
            size = math.prod(a.shape)
            part = a.nbytes * math.prod(sharding.shard_shape(a.shape)) // size if size else 0
            for device in sharding.addressable_devices:
                held[device] = get(device, 0) + part
        except Exception:  # noqa: BLE001 - deleted meanwhile, or a sharding without even shards
            try:
                for shard in a.addressable_shards:
                    held[shard.device] = get(shard.device, 0) + shard.data.nbytes
            except Exception:  # noqa: BLE001 - deleted meanwhile: it holds nothing now
                continue
    return held


class Reading(NamedTuple):
    """One device's memory, read now."""

    used: int | None  # bytes in use (None: not known)
    peak: int | None  # the allocator's peak bytes in use since the process began (None: not reported)
    limit: int | None  # the byte limit: the allocator's, or the one simulate(n, memory=...) gave
    source: str | None  # where ``used`` comes from: ALLOCATOR or LIVE_ARRAYS


def readings(
    devices: list[jax.Device], live: Callable[[], dict[jax.Device, int]] | None = None
) -> dict[jax.Device, Reading]:
    """A ``Reading`` per device: the device's allocator statistics where it reports them (source
    ``ALLOCATOR``), else the bytes of its live jax arrays (source ``LIVE_ARRAYS``, no peak),
    against the limit ``simulate(n, memory=...)`` gave CPU devices if any. ``live`` returns the
    live arrays' bytes per device (default ``live_array_bytes``; a live view passes a cached
    one); it is called at most once, and only when some device reports no statistics."""
    out: dict[jax.Device, Reading] = {}
    held: dict[jax.Device, int] | None = None
    for device in devices:
        if device in out:
            continue
        used, limit = memory(device)
        if used is not None or limit is not None:
            out[device] = Reading(used, memory_stats(device).get("peak_bytes_in_use"), limit, ALLOCATOR)
            continue
        if held is None:
            held = (live or live_array_bytes)()
        out[device] = Reading(held.get(device, 0), None, memory_limit(device), LIVE_ARRAYS)
    return out


def memory_usage(
    devices: list[jax.Device], live: Callable[[], dict[jax.Device, int]] | None = None
) -> dict[jax.Device, tuple[int | None, int | None, str | None]]:
    """(bytes in use, byte limit, source) per device, from ``readings``."""
    return {d: (r.used, r.limit, r.source) for d, r in readings(devices, live).items()}


def memory_text(used: int | None, limit: int | None, source: str | None) -> str:
    """``1.0 GiB / 4.0 GiB (25%)``, ``12.0 MiB (live arrays)``, ``12.0 MiB / 16.0 GiB (0%, live
    arrays)`` (a simulated limit), or ``n/a``."""
    if used is None and limit is None:
        return "n/a"
    used_s = "?" if used is None else human_bytes(used)
    if source == LIVE_ARRAYS and limit is None:
        return f"{used_s} ({LIVE_ARRAYS})"
    limit_s = "?" if limit is None else human_bytes(limit)
    share = f"{100 * used / limit:.0f}%" if used is not None and limit else ""
    if source == LIVE_ARRAYS:
        share = f"{share}, {LIVE_ARRAYS}"
    return f"{used_s} / {limit_s}" + (f" ({share})" if share else "")


MEMORY_NOTE = (
    "memory: the device's allocator statistics where it reports them (in use / limit), else "
    "the bytes held by live jax arrays on it (live arrays; no limit known, or the limit "
    "mg.simulate(n, memory=...) gave)"
)


class DeviceTable(Table):
    """The devices JAX can see; prints as a table, displays as HTML, iterates as DeviceInfo rows."""

    headers = ("name", "platform", "kind", "description", "process", "memory in use / limit")

    def __iter__(self):
        return iter(self._rows)

    def __getitem__(self, key: int | str) -> DeviceInfo:
        if isinstance(key, str):
            for row in self._rows:
                if row.name == key:
                    return row
            raise KeyError(f"no device named {key!r}; {_expected_devices()}")
        return self._rows[key]

    @property
    def names(self) -> list[str]:
        return [row.name for row in self._rows]

    def _display_rows(self) -> list[tuple]:
        return [
            (
                r.name,
                r.platform,
                r.kind,
                r.description,
                r.process_index,
                memory_text(r.memory_in_use, r.memory_limit, r.memory_source),
            )
            for r in self._rows
        ]


def devices() -> DeviceTable:
    """Lists every device JAX can see, on every platform, with stable short names.

    Returns:
      A DeviceTable: text in a terminal, HTML in a notebook, DeviceInfo rows when iterated.

    >>> import mgkit as mg
    >>> mg.devices().names[:2]
    ['cpu0', 'cpu1']
    """
    named = _all_devices()
    usage = memory_usage([d for _, d in named])
    rows = []
    for name, d in named:
        used, limit, source = usage[d]
        plat = name.rstrip("0123456789")
        rows.append(
            DeviceInfo(name, plat, d.device_kind, describe(d), d.process_index, used, limit, d, source)
        )
    note = f"\n{MEMORY_NOTE}" if any(r.memory_source for r in rows) else ""
    return DeviceTable(rows, title=f"{len(rows)} device(s), jax {jax.__version__}{note}")


def simulate_from_env() -> None:
    """Applies MGKIT_SIMULATE=n and MGKIT_SIMULATE_MEMORY=size (e.g. ``16GiB``) from the
    environment, if set."""
    value = os.environ.get("MGKIT_SIMULATE", "").strip()
    memory = os.environ.get("MGKIT_SIMULATE_MEMORY", "").strip()
    limit = nbytes(memory, "MGKIT_SIMULATE_MEMORY", "environment", example="16GiB") if memory else None
    if limit is not None:
        _set_simulated_limit(limit)
    if not value:
        return
    try:
        n = int(value)
    except ValueError:
        raise ValueError(
            f"MGKIT_SIMULATE={value!r} is not a whole number of CPU devices; set it like MGKIT_SIMULATE=8"
        ) from None
    simulate(n)
