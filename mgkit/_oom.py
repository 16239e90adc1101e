"""The out-of-memory report: when an mgkit call fails because a device ran out of memory, what
filled each context, what the failing program needed and the fixes that apply.

mgkit notes which call placed each array it puts on a device (``note_placed``: a weak
reference per array, dropped with the array), so the report can say where the largest live
arrays came from.
"""

from __future__ import annotations

import heapq
import math
import os
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
    """What made an array, as the report says it."""

    what: str  # the mgkit call that placed it ("mg.put"), or what it is ("the trainer's parameters")
    cell: int | None  # the notebook cell it was placed in (None: outside IPython, or not known)


class LiveArray(NamedTuple):
    """One live array's part on one device, for the report."""

    shape: tuple[int, ...]  # the array's whole shape
    dtype: str  # its dtype's name
    nbytes: int  # the bytes it holds on the device
    placed: Placed | None  # what made it (None: not known: a computation, or jax directly)


_PLACED: dict[int, tuple[weakref.ref, Placed]] = {}


def note_placed(arrays: Sequence[Any], what: str, cell: int | None) -> None:
    """Notes that ``arrays`` were placed by the mgkit call ``what`` ("mg.put") in cell ``cell``."""
    placed = Placed(what, cell)
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


def largest_live(
    devices: Sequence[jax.Device], top: int = TOP, known: dict[int, str] | None = None
) -> dict[jax.Device, list[LiveArray]]:
    """The ``top`` largest live arrays' parts on each of ``devices``, largest first; ``known``
    names some arrays by ``id`` ("the trainer's parameters"), the others by ``placed_by``."""
    known = known or {}
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
            LiveArray(
                tuple(a.shape),
                str(a.dtype),
                nbytes,
                Placed(known[id(a)], None) if id(a) in known else placed_by(a),
            )
            for nbytes, _, a in sorted(heaps[d], key=lambda item: (-item[0], item[1]))
        ]
        for d in devices
    }


def mapped_contexts() -> list[tuple[str, jax.Device]]:
    """(name, device) of every context of the current map."""
    return list(_contexts.context_map().devices().items())


def _array_line(a: LiveArray) -> str:
    shape = ",".join(map(str, a.shape))
    made = "made by a computation" if a.placed is None else a.placed.what
    if a.placed is not None and a.placed.what.startswith("mg."):
        made = f"placed by {made}" + ("" if a.placed.cell is None else f" in In [{a.placed.cell}]")
    return f"    {a.dtype}[{shape}]  {human_bytes(a.nbytes)}  ({made})"


def live_facts(
    contexts: Sequence[tuple[str, jax.Device]], top: int = TOP, known: dict[int, str] | None = None
) -> str:
    """Per context: its memory in use / limit and its largest live arrays (``known``: names of
    some, by ``id``), as indented lines."""
    devices = [d for _, d in contexts]
    usage = _devices.readings(devices)
    largest = largest_live(devices, top, known)
    lines = ["the largest live arrays per context:"]
    for name, device in contexts:
        r = usage[device]
        lines.append(
            f"  {name} ({_devices.short_name(device)}, {_devices.memory_text(r.used, r.limit, r.source)}):"
        )
        lines += [_array_line(a) for a in largest[device]] or ["    (no live arrays)"]
    return "\n".join(lines)


def program_bytes(compiled: Any) -> int | None:
    """The bytes a compiled program needs on each device, from its ``memory_analysis``: its
    arguments, its outputs beyond the donated arguments and its temporaries (None where the
    backend does not say)."""
    try:
        m = compiled.memory_analysis()
        out = m.output_size_in_bytes - m.alias_size_in_bytes  # outputs beyond the donated arguments
        return m.argument_size_in_bytes + out + m.temp_size_in_bytes
    except Exception:  # noqa: BLE001 - no analysis on this backend
        return None


def host_memory() -> int | None:
    """The host's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def refuse_too_big(compiled: Any, devices: Sequence[jax.Device]) -> None:
    """Raises XLA's own error (a ``JaxRuntimeError``, ``RESOURCE_EXHAUSTED``) before a compiled
    program runs on ``devices`` when it needs more than they can ever hold: more than a device's
    allocator limit, or, on CPU devices, which share the host's memory, more in all than the
    host has. Such a program would fail when run, after taking its donated arguments; refused
    here, nothing is taken and the caller's report (``raise_if_out_of_memory``) says what filled
    the contexts. A limit given by ``mg.simulate(memory=...)`` is not enforced here."""
    need = program_bytes(compiled)
    if not need:
        return
    cpus = sum(d.platform == "cpu" for d in devices)
    host = host_memory() if cpus else None
    if host is not None and need * cpus > host:
        have = f"{cpus} CPU device(s) share the host's {human_bytes(host)}"
    else:
        limits = [(d, _devices.memory_stats(d).get("bytes_limit")) for d in devices if d.platform != "cpu"]
        over = [(d, lim) for d, lim in limits if lim is not None and need > lim]
        if not over:
            return
        have = f"{_devices.short_name(over[0][0])} holds at most {human_bytes(over[0][1])}"
    raise jax.errors.JaxRuntimeError(
        f"RESOURCE_EXHAUSTED: Out of memory allocating {need} bytes per device for the program "
        f"({human_bytes(need)}), and {have}; refused before it ran, so its arguments are untouched"
    )


def program_needs(compiled: Any, limit: int | None = None) -> str | None:
    """What a compiled program needs on each device, from its ``memory_analysis`` (None where
    the backend does not say); with the device's ``limit``, which part did not fit: the state
    and batch it is given alone, or the temporaries it makes while it runs."""
    try:
        m = compiled.memory_analysis()
        args, out = m.argument_size_in_bytes, m.output_size_in_bytes
        alias, temp = m.alias_size_in_bytes, m.temp_size_in_bytes
    except Exception:  # noqa: BLE001 - no analysis on this backend
        return None
    total = args + out - alias + temp
    said = (
        f"{human_bytes(total)} per device from the compiled program (arguments {human_bytes(args)}, "
        f"outputs {human_bytes(out - alias)} beyond the donated arguments, temporaries {human_bytes(temp)})"
    )
    if limit is None or total <= limit:
        return said
    if args > limit:
        return (
            f"{said}; its arguments alone (the state and the batch) are over the {human_bytes(limit)} "
            "limit: split the state (shard='fsdp') or use more contexts"
        )
    return (
        f"{said}; its arguments (the state and the batch) fit the {human_bytes(limit)} limit, and the "
        "step's temporaries (activations, gathered parameters, gradients) take it over: "
        "fit(..., accumulate=4) or precision='bf16' cut them (tr.plan(batch, accumulate=[1, 4]) shows "
        "by how much)"
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


class StepFacts(NamedTuple):
    """What a trainer knows about its step, for the report (each read only when it is made)."""

    state: Callable[[], Any]  # its MemoryTable: parameters, optimizer state and batch per context
    needs: Callable[[], str | None]  # what its compiled step needs per device (None: not known)
    known: Callable[[], dict[int, str]]  # names of its own arrays by ``id`` ("the trainer's parameters")


def _step_lines(facts: StepFacts) -> tuple[str | None, dict[int, str], str]:
    """(what the step needs, its arrays' names, its state in lines), each as far as readable."""
    try:
        needs, known = facts.needs(), facts.known()
    except Exception:  # noqa: BLE001 - nothing more to say than the error itself
        needs, known = None, {}
    try:
        state = state_facts(facts.state())
    except Exception:  # noqa: BLE001 - the state was donated to the failed step: not readable
        state = "the training state: not readable (given to the step that failed)"
    return needs, known, state


def report(
    where: str,
    error: BaseException,
    contexts: Sequence[tuple[str, jax.Device]],
    fixes: Sequence[str],
    facts: StepFacts | None = None,
) -> OutOfMemoryError:
    """The ``OutOfMemoryError`` for ``error`` in the mgkit call ``where`` on ``contexts`` (name,
    device): the error's first line, what the failing program needed (from a trainer's compiled
    step, where ``facts`` are given; and the allocation the error's text names), each context's
    largest live arrays, a trainer's state and the ``fixes``."""
    text = str(error)
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    needs, known, state = _step_lines(facts) if facts is not None else (None, {}, None)
    asked = needed_bytes(text)
    said = [needs, f"the allocation that failed: {human_bytes(asked)}" if asked is not None else None]
    lines = [
        f"{where}: a device ran out of memory ({first})",
        "the failing program needed: " + ("; ".join(x for x in said if x) or "not said by the error"),
        live_facts(contexts, known=known),
        *([state] if state else []),
        "fixes that apply: " + "; ".join(fixes),
    ]
    return OutOfMemoryError("\n".join(lines))


def raise_if_out_of_memory(
    error: BaseException,
    where: str,
    contexts: Sequence[tuple[str, jax.Device]],
    fixes: Sequence[str],
    facts: StepFacts | None = None,
) -> None:
    """Raises the ``OutOfMemoryError`` report (from ``error``) when ``error`` is an
    out-of-memory error; else returns, and the caller re-raises ``error``."""
    if is_out_of_memory(error):
        raise report(where, error, contexts, fixes, facts) from error
