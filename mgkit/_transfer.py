"""Placement and transfers: put, transfer, colocate, synchronize — each recorded in the ledger."""

from __future__ import annotations

import concurrent.futures
import functools
import numbers
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _contexts
from ._contexts import HOST_CONTEXT, Context, resolve
from ._errors import ContextError
from ._ledger import Event, Kind, execution_label, ledger
from ._oom import note_placed, raise_if_out_of_memory
from ._static import describe, held

_LEAF_TYPES = (jax.Array, np.ndarray, np.generic, numbers.Number)


def leaves_of(tree: Any, fn: str, names: Callable[[int], str] | None = None) -> tuple[list, Any]:
    """Flattens a pytree and checks every leaf is an array or a number.

    ``names`` maps a leaf index to how messages name it (default: ``leaf <path>``).
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, _LEAF_TYPES) or (isinstance(leaf, np.ndarray) and leaf.dtype == object):
            where = names(i) if names else f"leaf {leaf_paths(tree)[i]}"
            _reject(leaf, where, fn)
    return leaves, treedef


def leaf_paths(tree: Any, itself: str = "(the value itself)") -> list[str]:
    """How messages name a pytree's leaves (``['x']``, ``[0]``...); ``itself`` for a lone leaf."""
    return [jax.tree_util.keystr(p) or itself for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _reject(leaf: Any, where: str, fn: str) -> None:
    """Raises TypeError naming a leaf that cannot be placed on a device."""
    if isinstance(leaf, np.ndarray) and leaf.dtype == object:
        raise TypeError(
            f"{fn}: {where} is a numpy array of dtype object (shape {leaf.shape}), which "
            "cannot live on a device; convert it to a numeric dtype, e.g. x.astype(np.float32)"
        )
    raise TypeError(
        f"{fn}: {where} is a {type(leaf).__name__} ({_short(leaf)}), but only arrays "
        "(numpy or JAX) and numbers can be placed on a device. Convert it with np.asarray(...) "
        "or keep it out of the tree you pass."
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def source(leaf: Any) -> tuple[Context, frozenset | None]:
    """Where a leaf lives and on which devices; host memory (devices None) for numpy and numbers.
    An array over several devices is named by its contexts joined with ``+``."""
    if isinstance(leaf, jax.Array):
        devs = leaf.devices()
        if len(devs) == 1:
            return _contexts.context_of(next(iter(devs))), frozenset(devs)
        names = "+".join(sorted({_contexts.name_of(d) for d in devs}))
        return Context(names, None, f"{len(devs)} devices"), frozenset(devs)
    return HOST_CONTEXT, None


def concrete(leaf: Any) -> Any:
    """The array behind a leaf: itself, the value under an eager ``jax.grad``, or None for an
    abstract tracer (inside ``jax.jit`` or ``jax.vmap``, where nothing runs yet)."""
    if isinstance(leaf, jax.core.Tracer):
        return leaf.to_concrete_value()
    return leaf


_ALIGN = 64  # XLA's CPU client uses a host buffer aligned to this as it is, without a copy


_SPLIT_COPY = 4 << 20  # bytes from which a copy is shared between two threads


def private_copy(value: np.ndarray) -> np.ndarray:
    """A fresh copy of a host array in memory aligned to ``_ALIGN`` bytes (``private_copies``)."""
    return private_copies([value])[0]


def private_copies(values: list[np.ndarray]) -> list[np.ndarray]:
    """Fresh copies of host arrays, each aligned to ``_ALIGN`` bytes, all in one buffer (freed
    when the last of them is).

    Most of a copy's time is the first touch of its new pages. One buffer for all lets numpy ask
    for huge pages (it does from 4 MiB): eight 1.25 MB copies take 0.8 ms instead of 3.4 ms in
    separate buffers. From ``_SPLIT_COPY`` bytes in all, a helper thread makes about half of the
    copies (a large array in two halves) while this one makes the rest, since numpy lets go of
    the GIL while it copies: 40 MB in 4.1 ms instead of 5.9 ms on a 2-core host.
    """
    spans = [-(-value.nbytes // _ALIGN) * _ALIGN for value in values]
    buf = np.empty(sum(spans) + _ALIGN, np.uint8)
    start = (-buf.ctypes.data) % _ALIGN
    outs, tasks = [], []
    for value, span in zip(values, spans, strict=True):
        out = buf[start : start + value.nbytes].view(value.dtype).reshape(value.shape)
        start += span
        outs.append(out)
        if value.nbytes >= _SPLIT_COPY and value.ndim and len(value) >= 2:
            half = len(value) // 2
            tasks += [(out[:half], value[:half]), (out[half:], value[half:])]
        else:
            tasks.append((out, value))
    total = sum(v.nbytes for _, v in tasks)
    if total < _SPLIT_COPY or len(tasks) < 2 or (os.cpu_count() or 1) < 2:
        for out, value in tasks:
            np.copyto(out, value)
        return outs
    mine, theirs, load = [], [], [0, 0]  # the larger copies first, each to the lighter side
    for task in sorted(tasks, key=lambda t: -t[1].nbytes):
        side = 0 if load[0] <= load[1] else 1
        (mine, theirs)[side].append(task)
        load[side] += task[1].nbytes
    other = _copier().submit(lambda: [np.copyto(out, value) for out, value in theirs])
    for out, value in mine:
        np.copyto(out, value)
    other.result()
    return outs


@functools.lru_cache(maxsize=1)
def _copier() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mgkit-copy")


def stageable(value: Any, devices: Any) -> bool:
    """Whether a value is a host array that CPU devices can take through ``private_copy``
    (its dtype is one JAX keeps as it is, so no conversion copies it anyway)."""
    return (
        isinstance(value, np.ndarray)
        and all(d.platform == "cpu" for d in devices)
        and value.dtype == jax.dtypes.canonicalize_dtype(value.dtype)
    )


def to_devices(values: list, devices: list[jax.Device], private: bool = False) -> list[jax.Array]:
    """Copies host arrays (and moves device arrays) to the given devices, one each.

    A host array bound for a CPU device goes through a private aligned copy, which the CPU
    client then takes without copying it again: one memcpy instead of ``jax.device_put``'s
    slower copy of an unaligned array (7 ms against 28 ms for 40 MB on a 2-core host), and
    never the caller's own memory (``device_put`` shares an aligned array's buffer, so a
    later change to the numpy array would show through the device array). ``private``: the
    host arrays are such copies already (``private_copies``).
    """
    return jax.device_put(values if private else staged(values, devices), list(devices))


def staged(values: list, devices: list[jax.Device]) -> list:
    """The values, with each host array bound for a CPU device (``stageable``), and each large
    array moving between CPU devices (``_through_host``), replaced by a private copy on the
    host, all copied at once (``private_copies``)."""
    out = list(values)
    stage = [
        i
        for i, (v, d) in enumerate(zip(values, devices, strict=True))
        if stageable(v, (d,)) or _through_host(v, d)
    ]
    for i, copy in zip(stage, private_copies([np.asarray(values[i]) for i in stage]), strict=True):
        out[i] = copy
    return out


def _through_host(value: Any, device: jax.Device) -> bool:
    """Whether an array on one CPU device, bound for another, is copied faster through the host.
    Above glibc's 32 MiB mmap threshold XLA's own copy faults its fresh pages in one by one
    (40 MB: 30 ms, 1.3 GB/s); a private copy of the source's host view takes 6 ms on a 2-core
    host. Below ``_SPLIT_COPY`` bytes both are as fast, and XLA's copy does not wait."""
    if not isinstance(value, jax.Array) or isinstance(value, jax.core.Tracer) or value.nbytes < _SPLIT_COPY:
        return False
    sources = value.devices()
    return device.platform == "cpu" and len(sources) == 1 and next(iter(sources)).platform == "cpu"


PUT_FIXES = (
    "put the value on a context with more free memory",
    "free what the context holds (del the largest arrays listed)",
    "split the value over several contexts (mg.split)",
)


def place(leaves: list, to: Context, kind: str, info: dict | None = None, private: bool = False) -> list:
    """Moves a list of leaves to one context (``HOST_CONTEXT``: host numpy), one ledger event
    per source.

    Leaves already there are returned as they are. Inside ``jax.jit`` nothing is recorded: the
    copy happens when the compiled program runs. ``private``: host leaves bound for a CPU
    device are private copies already (``to_devices``).
    """
    label = execution_label()
    # Group the leaves that actually move by where they come from: one event per source.
    device = to.device
    groups: dict[Context | None, list[int]] = {}
    out = list(leaves)
    for i, leaf in enumerate(leaves):
        value = concrete(leaf)
        if value is None:  # traced: the copy happens when the compiled program runs
            groups.setdefault(None, []).append(i)
            continue
        src, src_devices = source(value)
        if device is None and src_devices is None:
            out[i] = np.asarray(value)  # already host memory
            continue
        if device is not None and src_devices == frozenset((device,)):
            continue  # already there
        groups.setdefault(src, []).append(i)
    for src, idx in groups.items():
        moving = [leaves[i] for i in idx]
        start, t0 = time.time(), time.perf_counter()
        if device is None:
            moved = [np.asarray(m) for m in jax.device_get(moving)]
            seconds = time.perf_counter() - t0
        else:
            try:
                moved = to_devices(moving, [device] * len(moving), private)
            except Exception as e:
                raise_if_out_of_memory(e, f"mg.{kind}", [(to.name, device)], PUT_FIXES)
                raise
            note_placed(moved, f"mg.{kind}", label)
            seconds = 0.0
        for i, m in zip(idx, moved, strict=True):
            out[i] = m
        if src is None:
            continue
        nbytes = sum(m.nbytes for m in moved)
        event = Event(
            kind,
            src.name,
            to.name,
            src.short,
            to.short,
            nbytes,
            start,
            seconds,
            label,
            {"arrays": len(idx), **(info or {})},
        )
        if device is None:
            ledger().record(event)
        else:
            ledger().record_when_ready(event, [concrete(m) for m in moved], t0)
    return out


def _move(tree: Any, ctx: Any, kind: str, fn: str) -> Any:
    to = resolve(ctx, fn)
    leaves, treedef = leaves_of(tree, fn)
    return jax.tree_util.tree_unflatten(treedef, place(leaves, to, kind))


def put(tree: Any, ctx: str | jax.Device) -> Any:
    """Places a pytree of numpy/JAX arrays and numbers on a context (Theano's ``shared(..., target=)``).

    Args:
      tree: any pytree whose leaves are arrays or numbers.
      ctx: a context name (``dev0``), a device name (``cpu3``) or a jax.Device.

    Returns:
      The same tree with every leaf a jax.Array on that context's device.

    >>> import mgkit as mg, numpy as np
    >>> _ = mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    >>> w = mg.put({"w": np.ones((2, 2)), "b": 0.5}, "dev1")
    >>> mg.where(w)
    'dev1'
    """
    if isinstance(ctx, str) and resolve(ctx, "put") is HOST_CONTEXT:
        raise ContextError(
            f"put(tree, {ctx!r}): put places data on a device context; to bring arrays back to "
            "host numpy use mg.transfer(tree, 'cpu')"
        )
    return _move(tree, ctx, Kind.PUT, "put")


def transfer(tree: Any, ctx: str | jax.Device) -> Any:
    """Moves a pytree to a context (Theano's ``v.transfer('dev0')``); ``ctx='cpu'`` returns host numpy.

    Leaves already on the target stay as they are and are not recorded as moves.

    >>> import mgkit as mg, numpy as np
    >>> _ = mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    >>> x = mg.put(np.arange(4.0), "dev0")
    >>> mg.where(mg.transfer(x, "dev1"))
    'dev1'
    >>> type(mg.transfer(x, "cpu")).__name__
    'ndarray'
    """
    return _move(tree, ctx, Kind.TRANSFER, "transfer")


def colocate(*trees: Any, to: str | jax.Device) -> tuple:
    """Moves several pytrees onto one context so they can be combined (adding two arrays that
    live on different devices, say).

    >>> import mgkit as mg, numpy as np
    >>> _ = mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    >>> a, b = mg.put(np.ones(3), "dev0"), mg.put(np.ones(3), "dev1")
    >>> a, b = mg.colocate(a, b, to="dev0")
    >>> float((a + b).sum())
    6.0
    """
    if not trees:
        raise TypeError("colocate(*trees, to=ctx) needs at least one tree to move")
    return tuple(_move(t, to, Kind.COLOCATE, "colocate") for t in trees)


def where(tree: Any) -> str | dict:
    """The context a pytree lives on: one name when every leaf is on the same context, else a
    dict leaf path -> context name (``host`` for numpy). Leaves held static (an Equinox
    module's functions: ``mg.Trainer``) live nowhere and are left out; a tree with no array or
    number at all (a string, ``{}``, ``None``) lives nowhere: a ValueError naming it."""
    arrays = held(tree)
    leaves, _ = leaves_of(arrays, "where")
    if not leaves:
        raise ValueError(
            f"where: {describe(tree)} holds no arrays, so it lives on no context; give an array or "
            "a pytree with arrays (numbers live on the host)"
        )
    names = [source(leaf)[0].name for leaf in leaves]
    if len(set(names)) == 1:
        return names[0]
    return dict(zip(leaf_paths(arrays), names, strict=True))


def synchronize(ctx: str | jax.Device | None = None) -> None:
    """Waits for all work dispatched on every context, or on one (a barrier before timing or reading results).

    Also waits until every copy in flight is recorded in the ledger. Arrays whose computation
    failed (a program that ran out of memory) already raised their error where they were
    read: they are waited for, not raised again.
    """
    if ctx is None:
        targets = None
    else:
        device = resolve(ctx, "synchronize").device
        if device is None:
            return
        targets = {device}
    pending = []
    for arr in jax.live_arrays():
        try:
            if arr.is_deleted():
                continue
            if targets is None or targets & arr.devices():
                pending.append(arr)
        except RuntimeError:  # deleted between the listing and the check
            continue
    try:
        jax.block_until_ready(pending)
    except Exception:  # noqa: BLE001 - an array holds a failed computation's error: wait for the rest
        for arr in pending:
            try:
                arr.block_until_ready()
            except Exception:  # noqa: BLE001 - its error was raised where it was computed
                continue
    if ctx is None:
        ledger().flush()
