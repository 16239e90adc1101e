"""Named device contexts: the ``name->device`` map, the ``on`` scope, and name lookup."""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import jax

from . import _devices
from ._errors import ContextError, DeviceMismatchError

_RESERVED_PREFIXES = ("cuda", "opencl", "cpu", "gpu", "tpu", "rocm")
_OPENCL = re.compile(r"^opencl\d+(:\d+)?$", re.IGNORECASE)
HOST = "host"
"""The name the ledger uses for host (numpy) memory."""


def _check_name(name: str, mapping: str) -> None:
    where = f" in mapping {mapping!r}"
    if not name:
        raise ContextError(f"empty context name{where}; write it as 'name->device', e.g. 'dev0->cuda0'")
    if ";" in name or "->" in name:
        raise ContextError(
            f"context name {name!r}{where} contains '->' or ';', which separate mappings; "
            "write one mapping per 'name->device' and separate mappings with ';'"
        )
    if any(ch.isspace() for ch in name) or not name.isprintable():
        raise ContextError(
            f"context name {name!r}{where} contains whitespace or control characters; "
            "use a single word such as 'dev0' or 'gpu_big'"
        )
    lowered = name.lower()
    for prefix in _RESERVED_PREFIXES:
        if lowered.startswith(prefix):
            raise ContextError(
                f"context name {name!r}{where} begins with {prefix!r}, which is reserved for device "
                "names (cuda0, cpu0, gpu0, tpu0, opencl0:0) to avoid confusion; choose another name, "
                "e.g. 'dev0'"
            )


def _check_device_spec(spec: str, mapping: str) -> str:
    if not spec:
        raise ContextError(
            f"empty device in mapping {mapping!r}; expected one of cpu, cpu<i>, cuda<i>, gpu<i>, tpu<i>"
        )
    if _OPENCL.match(spec):
        raise ContextError(
            f"device {spec!r} in mapping {mapping!r} is an OpenCL device, which is not supported by JAX; "
            "use cuda<i> (or gpu<i>) for GPUs, tpu<i>, or cpu<i>"
        )
    if _devices.parse_device_spec(spec) is None:
        lowered = spec.lower()
        hint = f" (did you mean {lowered!r}?)" if _devices.parse_device_spec(lowered) else ""
        raise ContextError(
            f"{spec!r} in mapping {mapping!r} is not a device name{hint}; expected one of cpu, cpu<i>, "
            "cuda<i>, gpu<i>, rocm<i>, tpu<i> with <i> a device index such as 0"
        )
    return "cpu0" if spec == "cpu" else spec


class ContextMap(Mapping[str, str]):
    """An immutable, hashable map from context names to device names, in definition order.

    Its string form (``dev0->cuda0;dev1->cuda1``) parses back to an equal map.

    >>> import mgkit as mg
    >>> m = mg.ContextMap.parse("dev0->cpu0; dev1->cpu1;")
    >>> str(m)
    'dev0->cpu0;dev1->cpu1'
    >>> m["dev1"]
    'cpu1'
    """

    __slots__ = ("_index", "_items")

    def __init__(self, items: Mapping[str, str] | Iterator[tuple[str, str]] | list[tuple[str, str]]):
        pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
        if not pairs:
            raise ContextError(
                "empty context map; give at least one mapping like 'dev0->cpu0' "
                "(several are separated by ';')"
            )
        index: dict[str, str] = {}
        for name, spec in pairs:
            if not isinstance(name, str) or not isinstance(spec, str):
                raise ContextError(
                    f"context map entries are strings, got {name!r} -> {spec!r}; write 'dev0->cpu0'"
                )
            mapping = f"{name}->{spec}"
            _check_name(name, mapping)
            spec = _check_device_spec(spec, mapping)
            if name in index:
                raise ContextError(
                    f"context name {name!r} appears more than once (-> {index[name]} and -> {spec}); "
                    "each name maps to one device, though one device may have several names"
                )
            index[name] = spec
        self._index = index
        self._items = tuple(index.items())

    @classmethod
    def parse(cls, text: str) -> ContextMap:
        """Parses ``name->device;name->device`` without checking that the devices exist.

        Whitespace around names and devices is ignored and a trailing ``;`` is allowed.
        Raises ContextError (a ValueError) naming the bad part and the fix.
        """
        if not isinstance(text, str):
            raise TypeError(
                "a context map is a string like 'dev0->cuda0;dev1->cuda1', "
                f"got {type(text).__name__} {text!r}"
            )
        parts = text.split(";")
        if parts and not parts[-1].strip():
            parts.pop()
        if not any(p.strip() for p in parts):
            raise ContextError(
                f"empty context map {text!r}; give at least one mapping like 'dev0->cpu0' "
                "(several are separated by ';')"
            )
        pairs = []
        for part in parts:
            mapping = part.strip()
            if not mapping:
                raise ContextError(
                    f"empty mapping between ';' in {text!r}; remove the extra ';' "
                    "(mappings look like 'dev0->cpu0;dev1->cpu1')"
                )
            if "->" not in mapping:
                raise ContextError(
                    f"mapping {mapping!r} in {text!r} has no '->'; "
                    "write it as 'name->device', e.g. 'dev0->cpu0'"
                )
            name, spec = mapping.split("->", 1)
            name, spec = name.strip(), spec.strip()
            if "->" in spec:
                raise ContextError(
                    f"mapping {mapping!r} has more than one '->'; a context name may not contain '->' "
                    "and a mapping is exactly 'name->device'"
                )
            pairs.append((name, spec))
        return cls(pairs)

    def __getitem__(self, name: str) -> str:
        try:
            return self._index[name]
        except (KeyError, TypeError):
            raise ContextError(
                f"unknown context {name!r}; the contexts are {', '.join(self._index)}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ContextMap):
            return self._items == other._items
        return NotImplemented

    def __setattr__(self, key: str, value: object) -> None:
        if hasattr(self, "_items"):
            raise AttributeError("ContextMap is immutable; build a new one with mg.ContextMap.parse(...)")
        object.__setattr__(self, key, value)

    def __str__(self) -> str:
        return ";".join(f"{n}->{d}" for n, d in self._items)

    def __repr__(self) -> str:
        return f"ContextMap({str(self)!r})"

    @property
    def names(self) -> tuple[str, ...]:
        """Context names in definition order."""
        return tuple(self._index)

    def devices(self) -> dict[str, jax.Device]:
        """Resolves every context to its jax.Device; raises ContextError if one does not exist.

        Short device names are found in one index of every device, so a map of thousands of
        contexts resolves in time linear in its size; other specs (``gpu<i>``, names that do
        not exist) go through ``lookup_device``, which explains a missing device.
        """
        index = dict(_devices.all_devices())
        out = {}
        for name, spec in self._items:
            device = index.get(spec)
            if device is not None:
                out[name] = device
                continue
            try:
                out[name] = _devices.lookup_device(spec)
            except ValueError as e:
                raise ContextError(f"context {name!r} -> {e}") from None
        return out


class Context(NamedTuple):
    """A context resolved once: the name events and messages call it by, the device behind it and
    that device's short name. Made when a map is installed (or a device or device name is first
    used as a target) and passed along as it is, so labelling an event never looks anything up.

    >>> import mgkit as mg
    >>> _ = mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    >>> resolve("dev1", "put")
    Context(name='dev1', device=CpuDevice(id=1), short='cpu1')
    """

    name: str  # the context name ("dev1"), a device name used as one ("cpu3"), or "host"
    device: jax.Device | None  # None: host memory (numpy)
    short: str  # the device's short name ("cpu1", "cuda0"), or "host"


HOST_CONTEXT = Context(HOST, None, HOST)
_HOST_TARGETS = ("cpu", "host")


class _Installed(NamedTuple):
    map: ContextMap
    devices: dict[str, jax.Device]
    by_device: dict[jax.Device, tuple[Context, ...]]  # every context on a device, in map order
    contexts: dict[str, Context]


_lock = threading.Lock()
_installed: _Installed | None = None  # replaced whole, so readers need no lock
_local = threading.local()


def _install(cmap: ContextMap, only_if_none: bool = False) -> _Installed:
    """Resolves a map's devices and makes it current (atomically: readers see old or new)."""
    global _installed
    devs = cmap.devices()
    by_device: dict[jax.Device, list[Context]] = {}
    contexts = {name: Context(name, d, _devices.short_name(d)) for name, d in devs.items()}
    for ctx in contexts.values():
        by_device.setdefault(ctx.device, []).append(ctx)
    with _lock:
        if not (only_if_none and _installed is not None):
            _installed = _Installed(cmap, devs, {d: tuple(cs) for d, cs in by_device.items()}, contexts)
        return _installed


def default_map() -> ContextMap:
    """The map used until ``use_contexts`` is called: ``MGKIT_CONTEXTS``, else every
    accelerator as dev0..devN-1, else every CPU device."""
    env = os.environ.get("MGKIT_CONTEXTS", "").strip()
    if env:
        try:
            return ContextMap.parse(env)
        except ContextError as e:
            raise ContextError(f"MGKIT_CONTEXTS={env!r} is not a valid context map: {e}") from None
    named = _devices.all_devices()
    accel = [n for n, _ in named if not n.startswith("cpu")]
    chosen = accel or [n for n, _ in named]
    return ContextMap([(f"dev{i}", n) for i, n in enumerate(chosen)])


def use_contexts(spec: str | ContextMap, verbose: bool = True) -> ContextMap:
    """Parses a context map, checks its devices exist, and makes it the current map.

    Args:
      spec: ``"dev0->cuda0;dev1->cuda1"`` or a ContextMap.
      verbose: print each mapping as it is defined.

    Returns:
      The installed ContextMap.

    >>> import mgkit as mg
    >>> m = mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    >>> mg.device_of("dev1")
    CpuDevice(id=1)
    """
    cmap = spec if isinstance(spec, ContextMap) else ContextMap.parse(spec)
    devs = _install(cmap).devices
    if verbose:
        for name, spec_name in cmap.items():
            print(f"Mapped name {name} to device {spec_name}: {_devices.describe(devs[name])}")
    return cmap


def _ensure() -> _Installed:
    current = _installed
    return current if current is not None else _install(default_map(), only_if_none=True)


def context_map() -> ContextMap:
    """The current context map (the default one until ``use_contexts`` is called)."""
    return _ensure().map


def device_of(name: str | jax.Device) -> jax.Device:
    """The jax.Device a context name (or a device name like ``cpu3``) stands for.

    Raises ContextError naming the unknown name and listing the contexts and devices that exist.
    """
    if isinstance(name, jax.Device):
        return name
    if not isinstance(name, str):
        raise TypeError(
            f"a context is a name such as 'dev0' (or a device name such as 'cpu1'), got "
            f"{type(name).__name__} {name!r}"
        )
    cmap, devs, _, _ = _ensure()
    if name in devs:
        return devs[name]
    if _devices.parse_device_spec(name):
        return _devices.lookup_device(name)
    known = _devices.device_names()
    raise ContextError(
        f"unknown context {name!r}; the contexts are {', '.join(cmap.names)} "
        f"(map {str(cmap)!r}), and device names ({', '.join(known[:8])}"
        f"{', ...' if len(known) > 8 else ''}) work too. "
        f"To add it: mg.use_contexts('{cmap};{name}->cpu0')"
    )


def context_of(device: jax.Device) -> Context:
    """The context of a device: the current scope's if it is on that device, else the first one
    mapped to it, else the device under its short name."""
    on_device = _ensure().by_device.get(device, ())
    if not on_device:
        short = _devices.short_name(device)
        return Context(short, device, short)
    stack = getattr(_local, "stack", None)
    if stack and len(on_device) > 1:
        for ctx in on_device:
            if ctx.name == stack[-1]:
                return ctx
    return on_device[0]


def name_of(device: jax.Device) -> str:
    """The context name for a device (``context_of``'s)."""
    return context_of(device).name


def resolve(ctx: str | jax.Device, fn: str) -> Context:
    """A target given as a context name, a device name (``cpu3``), a jax.Device, or ``"cpu"`` /
    ``"host"`` for host numpy, resolved once; errors name ``fn`` and list what exists."""
    if isinstance(ctx, str) and ctx in _HOST_TARGETS:
        return HOST_CONTEXT
    if isinstance(ctx, jax.Device):
        return context_of(ctx)
    if isinstance(ctx, str):
        known = _ensure().contexts.get(ctx)
        if known is not None:
            return known
    try:
        device = device_of(ctx)
    except (ContextError, ValueError) as e:
        raise type(e)(f"{fn}: {e}") from None
    except TypeError as e:
        raise TypeError(f"{fn}: {e}; use 'cpu' for host memory") from None
    return Context(ctx, device, _devices.short_name(device))


class on(contextlib.ContextDecorator):  # noqa: N801 - reads like a keyword: `with mg.on("dev1"):`
    """Makes a context the default device for arrays created inside: ``with mg.on("dev1"):``.

    Nestable, thread-local, and usable as a decorator. JAX's "incompatible devices" errors
    raised inside are explained in terms of context names.

    >>> import mgkit as mg, jax.numpy as jnp
    >>> _ = mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    >>> with mg.on("dev1"):
    ...     x = jnp.ones(3)
    >>> mg.where(x)
    'dev1'
    """

    def __init__(self, name: str):
        self.name = name
        self.device = device_of(name)
        self._scopes: list = []

    def _recreate_cm(self):
        return on(self.name)

    def __enter__(self) -> on:
        scope = jax.default_device(self.device)
        scope.__enter__()
        self._scopes.append(scope)
        scope_stack().append(self.name)
        return self

    def __exit__(self, exc_type, exc, tb):
        _local.stack.pop()
        self._scopes.pop().__exit__(exc_type, exc, tb)
        if exc is not None:
            better = explain_incompatible(exc)
            if better is not None:
                raise better from exc
        return False

    def __repr__(self) -> str:
        return f"on({self.name!r})"


def scope_stack() -> list[str]:
    """The calling thread's ``mg.on`` scopes, innermost last: the list itself, which ``mg.on``
    appends to and pops from (made on first use). A view keeps the main thread's to show its
    context from another thread."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current() -> str | None:
    """The current context name: the innermost ``mg.on`` scope, else the context of JAX's
    default device, else None when no context is on that device."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    by_device = _ensure().by_device
    dev = jax.config.jax_default_device
    if isinstance(dev, str):
        dev = jax.devices(dev)[0]
    if dev is None:
        dev = jax.devices()[0]
    on_device = by_device.get(dev, ())
    return on_device[0].name if on_device else None


def memory_limit(where: str | jax.Device) -> int | None:
    """The byte limit of a context's device: its allocator's where the device reports one (GPUs,
    TPUs), else the limit ``mg.simulate(n, memory=...)`` gave CPU devices, else None.

    Args:
      where: a context name (``"dev0"``), a device name (``"cpu3"``) or a jax.Device
        (``"cpu"`` / ``"host"``, host memory, has no limit: None).

    >>> import mgkit as mg
    >>> _ = mg.use_contexts("dev0->cpu0", verbose=False)
    >>> mg.memory_limit("dev0") is None or mg.memory_limit("dev0") > 0
    True
    """
    device = resolve(where, "memory_limit").device
    return None if device is None else _devices.memory_limit(device)


_INCOMPATIBLE = re.compile(r"argument (\S+) of (\S+) with shape (\S+) and with device ids \[([\d, ]+)\]")


def explain_incompatible(exc: BaseException) -> Exception | None:
    """Rewrites JAX's "incompatible devices" error in terms of context names, else None."""
    text = str(exc)
    if not isinstance(exc, ValueError) or "incompatible devices" not in text:
        return None
    by_id = {d.id: d for _, d in _devices.all_devices()}
    parts, names = [], []
    for arg, op, shape, ids in _INCOMPATIBLE.findall(text):
        devs = [by_id[int(i)] for i in ids.split(",") if int(i) in by_id]
        ctx = "+".join(sorted({name_of(d) for d in devs})) or f"device ids [{ids}]"
        names.append(ctx)
        parts.append(f"argument {arg} of {op} ({shape}) is on {ctx}")
    if not parts:
        return None
    return DeviceMismatchError(
        "arrays on different contexts were combined in one operation: "
        + "; ".join(parts)
        + f". Move them onto one context first, e.g. a, b = mg.colocate(a, b, to={names[0]!r}), "
        "or mg.transfer(x, ctx)."
    )
