"""Checks of number arguments, written once: a real or whole number (never a bool), finite, in a
range; a size in bytes (``"16GiB"``). Every message names the call, the parameter, the value given,
what was expected and an example that works."""

from __future__ import annotations

import math
import numbers
import re
from typing import Any


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _bound(lo: float | None, hi: float | None, above: bool) -> str:
    if lo is not None and hi is not None and not above:
        return f"from {_num(lo)} to {_num(hi)}"
    parts = []
    if lo is not None:
        parts.append(f"{'above' if above else 'at least'} {_num(lo)}")
    if hi is not None:
        parts.append(f"at most {_num(hi)}")
    return " and ".join(parts)


def _wrong_type(value: Any, name: str, where: str, what: str, example: Any) -> str:
    return f"{where}: {name} must be {what}, got {type(value).__name__} {value!r}; e.g. {name}={example!r}"


def _out_of_range(value: Any, name: str, where: str, what: str, example: Any) -> str:
    return f"{where}: {name}={value!r} is out of range; {name} must be {what}, e.g. {name}={example!r}"


def real(
    value: Any,
    name: str,
    where: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    above: bool = False,
    finite: bool = True,
    example: Any = 1,
    note: str = "",
) -> float:
    """``value`` as a float: a real number (not a bool), finite unless ``finite=False``, at least
    ``lo`` (above it with ``above=True``) and at most ``hi``. Else a TypeError (not a number) or
    ValueError (out of range) that names ``where``, ``name`` and the value; ``note`` is added to
    say what the value means (``"0: no penalty"``).

    >>> real(0.5, "tol", "fit", lo=0, above=True)
    0.5
    """
    bound = _bound(lo, hi, above)
    what = f"a {'finite ' if finite else ''}number" + (f" {bound}" if bound else "")
    what += f" ({note})" if note else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(_wrong_type(value, name, where, what, example))
    v = float(value)
    bad = (finite and not math.isfinite(v)) or math.isnan(v)
    bad = bad or (lo is not None and (v <= lo if above else v < lo)) or (hi is not None and v > hi)
    if bad:
        raise ValueError(
            f"{where}: {name}={value!r} is out of range; {name} must be {what}, e.g. {name}={example!r}"
        )
    return v


def whole(
    value: Any,
    name: str,
    where: str,
    *,
    lo: int | None = None,
    hi: int | None = None,
    example: Any = 1,
    note: str = "",
) -> int:
    """``value`` as an int: a whole number (an int or numpy integer, not a bool) from ``lo`` to
    ``hi``; else a TypeError or ValueError like ``real``'s.

    >>> whole(3, "max_iter", "fit", lo=1)
    3
    """
    bound = _bound(lo, hi, False)
    what = "a whole number" + (f" {bound}" if bound else "")
    what += f" ({note})" if note else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(_wrong_type(value, name, where, what, example))
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(
            f"{where}: {name}={value!r} is out of range; {name} must be {what}, e.g. {name}={example!r}"
        )
    return v


# Byte units a size may carry: decimal (kB = 1000 B) and binary (KiB = 1024 B), any case.
_SIZE_UNITS = {"": 1, "b": 1}
for _i, _prefix in enumerate("kmgtp", start=1):
    _SIZE_UNITS[f"{_prefix}b"] = 1000**_i
    _SIZE_UNITS[f"{_prefix}ib"] = 1024**_i
_SIZE = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def nbytes(value: Any, name: str, where: str, *, example: str = "16GiB") -> int:
    """``value`` as a whole number of bytes, above 0: a number of bytes (``2**30``) or a string
    with a unit (``"16GiB"``, ``"16 GB"``, ``"512MiB"``, ``"1.5e9"``; KiB/MiB/GiB/TiB are powers of
    1024, kB/MB/GB/TB powers of 1000, any case). Else a TypeError or ValueError that names
    ``where``, ``name`` and the value, and shows ``example``.

    >>> nbytes("16GiB", "memory", "simulate")
    17179869184
    >>> nbytes("512 MB", "limit", "fits")
    512000000
    """
    what = "a size in bytes above 0: a number, or a string with a unit (B, kB, MB, GB, KiB, MiB, GiB, ...)"
    if isinstance(value, str):
        m = _SIZE.match(value)
        scale = _SIZE_UNITS.get(m.group(2).lower()) if m else None
        if scale is None:
            raise ValueError(
                f"{where}: {name}={value!r} is not a size; {name} must be {what}, e.g. {name}={example!r}"
            )
        size = float(m.group(1)) * scale
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        size = float(value)
    else:
        raise TypeError(_wrong_type(value, name, where, what, example))
    if not math.isfinite(size) or size < 1:
        raise ValueError(_out_of_range(value, name, where, what, example))
    return round(size)
