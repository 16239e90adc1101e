"""The communication a compiled program contains, read from its HLO text
(``jitted.lower(*args).compile().as_text()``): each all-reduce, all-gather, reduce-scatter,
all-to-all and collective-permute, with its bytes and the devices it joins.

What is counted:

* **bytes**: the op's result bytes on one participant (``nbytes``); a tuple-shaped op (XLA
  combines several all-reduces into one) sums its elements. For all-reduce that is the array
  reduced; for all-gather the array gathered; for reduce-scatter the shard each keeps; for
  all-to-all and collective-permute what each receives. An async ``-start`` op counts as its op
  (its ``-done`` is skipped): its result is the op's result (all-reduce) or the pair
  (operands, results) whose results are counted (all-gather, collective-permute).
* **devices**: the groups of the program's devices that take part, as positions in its device
  list (``replica_groups`` in any of XLA's spellings: ``{{0,1},{2,3}}``, ``[2,4]<=[8]``,
  ``[2,4]<=[4,2]T(1,0)``, ``mesh['axis_0'=8,'axis_1'=1] {'axis_0'}``; a collective-permute's
  ``source_target_pairs``). A spelling not understood is read as one group of every device.
* **runs**: how many times the op runs per run of the program: 1, or inside a loop (a
  ``while``, as ``lax.scan`` and ``fori_loop`` compile to) its trip count, where XLA knows it
  (``known_trip_count``: a scan's length); None inside a loop whose trips depend on the data
  (a solver's iterations): such an op is counted once per run.
"""

from __future__ import annotations

import math
import re
from itertools import repeat
from typing import NamedTuple

import numpy as np

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


class Collective(NamedTuple):
    """One communication op of a compiled program."""

    op: str  # one of ``OPS`` (an async ``-start`` form is named as its op)
    nbytes: int  # the op's result bytes on one participant (tuple elements summed)
    groups: tuple[
        tuple[int, ...], ...
    ]  # the devices that take part together, as positions in the program's device list
    pairs: tuple[tuple[int, int], ...] = ()  # collective-permute: (source, target) positions; else empty
    runs: int | None = 1  # times it runs per program run (a loop's known trips); None: a loop's, unknown


_LINE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([^\]]*)\]")
_BITS = re.compile(r"(\d+)")
_GROUPS = re.compile(
    r"replica_groups=("
    r"\{\{[\d,{}\s]*\}\}|\{\}"  # {{0,1},{2,3}}, or {}
    r"|\[[^\]]*\]<=\[[^\]]*\](?:T\([\d,]*\))?"  # [2,4]<=[8], [2,4]<=[4,2]T(1,0)
    r"|mesh\[[^\]]*\]\s*\{[^}]*\}"  # mesh['axis_0'=8,'axis_1'=1] {'axis_0'}
    r")"
)
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(")  # a computation's first line, ending "{"
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = re.compile(r"\b(?:to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_SIZES = {"pred": 1, "token": 0, "c64": 8, "c128": 16}


def itemsize(dtype: str) -> int:
    """Bytes per element of an HLO element type: ``f32`` -> 4, ``bf16`` -> 2, ``pred`` -> 1,
    ``f8e4m3fn`` -> 1 (types under a byte count one).

    >>> itemsize("f32"), itemsize("bf16"), itemsize("pred"), itemsize("c64"), itemsize("s4")
    (4, 2, 1, 8, 1)
    """
    if dtype in _SIZES:
        return _SIZES[dtype]
    bits = _BITS.search(dtype)
    return max(int(bits.group(1)) // 8, 1) if bits else 0


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape, a tuple's elements summed: ``(f32[3,16]{1,0}, f32[])`` -> 196."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        sizes = [int(d.replace("<=", "")) for d in dims.split(",") if d.strip()]
        total += itemsize(dtype) * math.prod(sizes)
    return total


def tuple_parts(shape: str) -> list[str]:
    """The top-level elements of a tuple shape (``(a, (b, c))`` -> ``["a", "(b, c)"]``); a
    shape that is not a tuple is its one element."""
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    parts, depth, begin = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            parts.append(shape[begin:i].strip())
            begin = i + 1
    return [p for p in parts if p]


def replica_groups(spelling: str | None, n: int) -> tuple[tuple[int, ...], ...]:
    """The groups a ``replica_groups`` spelling names, as positions among the program's ``n``
    devices; one group of all of them where the spelling is missing, empty or not understood.

    >>> replica_groups("{{0,1},{2,3}}", 4)
    ((0, 1), (2, 3))
    >>> replica_groups("[2,2]<=[4]", 4)
    ((0, 1), (2, 3))
    >>> replica_groups("[2,2]<=[2,2]T(1,0)", 4)
    ((0, 2), (1, 3))
    >>> replica_groups("mesh['axis_0'=2,'axis_1'=2] {'axis_1'}", 4)
    ((0, 1), (2, 3))
    """
    everyone = (tuple(range(n)),)
    if not spelling or spelling == "{}":
        return everyone
    try:
        if spelling.startswith("{{"):
            return tuple(
                tuple(int(d) for d in g.split(",") if d) for g in re.findall(r"\{([\d,\s]*)\}", spelling)
            )
        if spelling.startswith("["):
            return _iota(spelling)
        if spelling.startswith("mesh"):
            return _mesh_groups(spelling)
    except (ValueError, IndexError):
        pass
    return everyone


def _iota(spelling: str) -> tuple[tuple[int, ...], ...]:
    """``[G,S]<=[dims]T(perm)``: iota over ``dims``, transposed by ``perm``, cut into G groups of S."""
    found = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]*)\))?", spelling.replace(" ", ""))
    if found is None:
        raise ValueError(spelling)
    shape = [int(d) for d in found.group(1).split(",")]
    dims = [int(d) for d in found.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if found.group(3):
        ids = ids.transpose([int(d) for d in found.group(3).split(",")])
    ids = ids.reshape(shape[0], -1)
    return tuple(tuple(int(d) for d in row) for row in ids)


def _mesh_groups(spelling: str) -> tuple[tuple[int, ...], ...]:
    """``mesh['a'=2,'b'=4] {'b'}``: devices numbered in the mesh's order, grouped by the axes in
    braces (the devices that differ only along them)."""
    found = re.fullmatch(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", spelling.strip())
    if found is None:
        raise ValueError(spelling)
    axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", found.group(1))
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    over = [names.index(a) for a in re.findall(r"'([^']+)'", found.group(2))]
    if not over:
        raise ValueError(spelling)
    keep = [i for i in range(len(sizes)) if i not in over]
    ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(keep + over)
    return tuple(tuple(int(d) for d in row) for row in ids.reshape(-1, math.prod(sizes[i] for i in over)))


def collectives_in(text: str, n: int) -> tuple[Collective, ...]:
    """The collectives in a compiled program's HLO text, in order, for a program over ``n``
    devices (see the module's docstring for what is counted).

    >>> line = "%ar = (f32[3,16]{1,0}, f32[]) all-reduce(%a, %b), replica_groups={{0,1}}, to_apply=%add"
    >>> collectives_in(line, 2)
    (Collective(op='all-reduce', nbytes=196, groups=((0, 1),), pairs=(), runs=1),)
    """
    if " while(" not in text:  # no loop: each op runs once per run
        return tuple(op for op in map(_collective, _with_ops(text.splitlines()), repeat(n)) if op is not None)
    found: list[tuple[str, Collective]] = []  # (its computation, the op)
    calls: dict[str, list[tuple[str, int | None]]] = {}  # computation -> (called, times per call)
    entry = computation = ""
    for line in text.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            header = _HEADER.match(line)
            if header is not None:
                computation = header.group(2)
                entry = computation if header.group(1) else entry
            continue
        if " while(" in line:
            trips = _TRIPS.search(line)
            times = int(trips.group(1)) if trips else None
            for pattern in (_BODY, _CONDITION):
                called = pattern.search(line)
                if called is not None:
                    calls.setdefault(computation, []).append((called.group(1), times))
        elif (
            "=%" in line
            and " fusion(" not in line
            and ("to_apply=" in line or "calls=" in line or "_computation" in line)
        ):
            _note_calls(line, computation, calls)
        if _has_op(line):
            op = _collective(line, n)
            if op is not None:
                found.append((computation, op))
    runs = _runs(entry, calls)
    return tuple(op._replace(runs=runs.get(where, 1)) for where, op in found)


def _has_op(line: str) -> bool:
    return "all-" in line or "reduce-scatter" in line or "collective-permute" in line


def _with_ops(lines: list[str]) -> list[str]:
    return [line for line in lines if _has_op(line)]


def _note_calls(line: str, computation: str, calls: dict) -> None:
    """Notes the computations ``line`` calls once per run of it (a call, a conditional's branches)."""
    names = _CALLED.findall(line)
    for branches in _BRANCHES.findall(line):
        names += [b.strip().lstrip("%") for b in branches.split(",") if b.strip()]
    calls.setdefault(computation, []).extend((name, 1) for name in names)


def _runs(entry: str, calls: dict) -> dict[str, int | None]:
    """Times each computation runs per run of ``entry``: trip counts multiplied down the calls
    (None: under a loop whose trips are unknown)."""
    runs: dict[str, int | None] = {entry: 1}
    todo = [entry]
    while todo:
        parent = todo.pop()
        for child, times in calls.get(parent, ()):
            if child in runs:
                continue
            mine = runs[parent]
            runs[child] = None if mine is None or times is None else mine * times
            todo.append(child)
    return runs


def _collective(line: str, n: int) -> Collective | None:
    """The collective on one line of HLO text, or None where there is none."""
    found = _LINE.match(line)
    if found is None:
        return None
    op, shape = found.group("op"), found.group("shape")
    if found.group("start") and op in ("all-gather", "collective-permute"):
        parts = tuple_parts(shape)
        shape = parts[1] if len(parts) > 1 else shape  # (operands, results[, contexts])
    nbytes = shape_bytes(shape)
    if op == "collective-permute":
        pairs = _PAIRS.search(line)
        links = re.findall(r"\{(\d+),(\d+)\}", pairs.group(1) if pairs else "")
        return Collective(op, nbytes, (), tuple((int(a), int(b)) for a, b in links))
    groups = _GROUPS.search(line)
    return Collective(op, nbytes, replica_groups(groups.group(1) if groups else None, n))
