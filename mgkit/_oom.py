"""The out-of-memory report: when an mgkit call fails because a device ran out of memory, what
filled each context, what the failing program needed and the fixes that apply.

mgkit notes which call placed each array it puts on a device (``note_placed``: a weak
reference per array, dropped with the array), so the report can say where the largest live
arrays came from.
"""

from __future__ import annotations

import heapq
import math
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from . import _contexts, _devices
from ._table import human_bytes

TOP = 5  # the largest live arrays listed per context

_OOM_WORDS = ("RESOURCE_EXHAUSTED", "Resource exhausted", "out of memory", "Out of memory")
_NEEDED = re.compile(r"allocat\w*\s+([0-9][0-9,]*)\s*bytes", re.IGNORECASE)
_NEEDED_SIZE = re.compile(r"allocat\w*\s+([0-9.]+)\s*([KMGT]i?B)\b", re.IGNORECASE)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class OutOfMemoryError(jax.errors.JaxRuntimeError):
    """A device ran out of memory in an mgkit call. The message lists, per context, the largest
    live arrays (and which mgkit call placed them), what the failing program needed and the
    fixes that apply; the original error is its ``__cause__``."""


class Placed(NamedTuple):
    """Which mgkit call placed an array."""

    call: str  # the ledger kind of the call ("put", "transfer", "split", ...)
    cell: int | None  # the notebook cell it ran in (None: outside IPython)


class LiveArray(NamedTuple):
    """One live array's part on one device, for the report."""

    shape: tuple[int, ...]  # the array's whole shape
    dtype: str  # its dtype's name
    nbytes: int  # the bytes it holds on the device
    placed: Placed | None  # the mgkit call that placed it (None: made otherwise)


_PLACED: dict[int, tuple[weakref.ref, Placed]] = {}


def note_placed(arrays: Sequence[Any], call: str, cell: int | None) -> None:
    """Notes that ``arrays`` were placed by the mgkit call ``call`` in cell ``cell``."""
    placed = Placed(call, cell)
    for a in arrays:
        key = id(a)
        try:
            ref = weakref.ref(a, lambda _, key=key: _PLACED.pop(key, None))
        except TypeError:  # host values: not on a device
            continue
        _PLACED[key] = (ref, placed)


def placed_by(array: Any) -> Placed | None:
    """The mgkit call that placed ``array`` (None: mgkit did not place it)."""
    entry = _PLACED.get(id(array))
    return entry[1] if entry is not None and entry[0]() is array else None


def is_out_of_memory(error: BaseException) -> bool:
    """True for XLA's resource-exhausted errors (``RESOURCE_EXHAUSTED``, ``Out of memory``)."""
    if isinstance(error, OutOfMemoryError) or not isinstance(error, RuntimeError | MemoryError):
        return False
    text = str(error)
    return any(word in text for word in _OOM_WORDS)


def needed_bytes(text: str) -> int | None:
    """The bytes a failing allocation asked for, as the error's text says it (None: it does not)."""
    m = _NEEDED.search(text)
    if m:
        return int(m.group(1).replace(",", ""))
    m = _NEEDED_SIZE.search(text)
    if m:
        return int(float(m.group(1)) * _UNITS[m.group(2)[0].upper()])
    return None


def largest_live(devices: Sequence[jax.Device], top: int = TOP) -> dict[jax.Device, list[LiveArray]]:
    """The ``top`` largest live arrays' parts on each of ``devices``, largest first."""
    wanted = set(devices)
    heaps: dict[jax.Device, list] = {d: [] for d in wanted}
    for n, a in enumerate(jax.live_arrays()):
        try:
            if a.is_deleted():
                continue
            size = math.prod(a.shape)
            share = math.prod(a.sharding.shard_shape(a.shape)) / size if size else 0.0
            on = [d for d in a.sharding.device_set if d in wanted]
        except Exception:  # noqa: BLE001 - deleted meanwhile, or a sharding without even shards
            continue
        for d in on:
            item = (int(a.nbytes * share), n, a)
            heap = heaps[d]
            (heapq.heappush if len(heap) < top else heapq.heappushpop)(heap, item)
    return {
        d: [
            LiveArray(tuple(a.shape), str(a.dtype), nbytes, placed_by(a))
            for nbytes, _, a in sorted(heaps[d], key=lambda item: (-item[0], item[1]))
        ]
        for d in devices
    }


def mapped_contexts() -> list[tuple[str, jax.Device]]:
    """(name, device) of every context of the current map."""
    return list(_contexts.context_map().devices().items())


def _array_line(a: LiveArray) -> str:
    shape = ",".join(map(str, a.shape))
    made = "not placed by mgkit" if a.placed is None else f"placed by mg.{a.placed.call}"
    if a.placed is not None and a.placed.cell is not None:
        made += f" in In [{a.placed.cell}]"
    return f"    {a.dtype}[{shape}]  {human_bytes(a.nbytes)}  ({made})"


def live_facts(contexts: Sequence[tuple[str, jax.Device]], top: int = TOP) -> str:
    """Per context: its memory in use / limit and its largest live arrays, as indented lines."""
    devices = [d for _, d in contexts]
    usage = _devices.readings(devices)
    largest = largest_live(devices, top)
    lines = ["the largest live arrays per context:"]
    for name, device in contexts:
        r = usage[device]
        lines.append(
            f"  {name} ({_devices.short_name(device)}, {_devices.memory_text(r.used, r.limit, r.source)}):"
        )
        lines += [_array_line(a) for a in largest[device]] or ["    (no live arrays)"]
    return "\n".join(lines)


def program_needs(compiled: Any) -> str | None:
    """What a compiled program needs on each device, from its ``memory_analysis`` (None where
    the backend does not say)."""
    try:
        m = compiled.memory_analysis()
        args, out = m.argument_size_in_bytes, m.output_size_in_bytes
        alias, temp = m.alias_size_in_bytes, m.temp_size_in_bytes
    except Exception:  # noqa: BLE001 - no analysis on this backend
        return None
    total = args + out - alias + temp
    return (
        f"{human_bytes(total)} per device from the compiled program (arguments {human_bytes(args)}, "
        f"outputs {human_bytes(out - alias)} beyond the donated arguments, temporaries {human_bytes(temp)})"
    )


def state_facts(table: Any) -> str:
    """A trainer's ``MemoryTable`` in one line per context (parameters, optimizer state, batch)."""
    lines = ["the training state per context (parameters + optimizer state + batch = total / limit):"]
    for r in table.rows():
        limit = "unknown" if r.limit is None else human_bytes(r.limit)
        lines.append(
            f"  {r.context}: {human_bytes(r.params)} + {human_bytes(r.opt_state)} + {human_bytes(r.batch)}"
            f" = {human_bytes(r.total)} / {limit}"
        )
    return "\n".join(lines)


def report(
    where: str,
    error: BaseException,
    contexts: Sequence[tuple[str, jax.Device]],
    fixes: Sequence[str],
    state: Callable[[], Any] | None = None,
    needs: Callable[[], str | None] | None = None,
) -> OutOfMemoryError:
    """The ``OutOfMemoryError`` for ``error`` in the mgkit call ``where`` on ``contexts`` (name,
    device): the error's first line, what the failing program needed (``needs()``: from its
    compiled form, where given; and the allocation the error's text names), each context's
    largest live arrays, a trainer's state (``state()``, its ``MemoryTable``, where given and
    readable) and the ``fixes``."""
    text = str(error)
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    asked = needed_bytes(text)
    said = [needs() if needs is not None else None]
    said.append(f"the allocation that failed: {human_bytes(asked)}" if asked is not None else None)
    need = "; ".join(x for x in said if x) or "not said by the error"
    lines = [
        f"{where}: a device ran out of memory ({first})",
        f"the failing program needed: {need}",
        live_facts(contexts),
    ]
    if state is not None:
        try:
            lines.append(state_facts(state()))
        except Exception:  # noqa: BLE001 - the state was donated to the failed step: not readable
            lines.append("the trainer's state: not readable (given to the step that failed)")
    lines.append("fixes that apply: " + "; ".join(fixes))
    return OutOfMemoryError("\n".join(lines))


def raise_if_out_of_memory(
    error: BaseException,
    where: str,
    contexts: Sequence[tuple[str, jax.Device]],
    fixes: Sequence[str],
    state: Callable[[], Any] | None = None,
    needs: Callable[[], str | None] | None = None,
) -> None:
    """Raises the ``OutOfMemoryError`` report (from ``error``) when ``error`` is an
    out-of-memory error; else returns, and the caller re-raises ``error``."""
    if is_out_of_memory(error):
        raise report(where, error, contexts, fixes, state, needs) from error
