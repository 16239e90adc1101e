"""Checks of number arguments, written once: a real or whole number (never a bool), finite, in a
range. Every message names the call, the parameter, the value given, what was expected and an
example that works."""

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


_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
_BYTES = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(i?)(b?)\s*", re.IGNORECASE)


def byte_count(value: Any, name: str, where: str) -> int:
    """A number of bytes: an int or float, or a string with a unit, decimal (``"16 GB"``, ``"500MB"``)
    or binary (``"80GiB"``, ``"512 MiB"``). Else a TypeError or ValueError naming ``where``.

    >>> [byte_count(v, "limit", "fits") for v in ("80GiB", "16 GB", 1024)]
    [85899345920, 16000000000, 1024]
    """
    expected = "a number of bytes or a string with a unit such as '80GiB', '16 GB' or '512MiB'"
    if isinstance(value, str):
        m = _BYTES.fullmatch(value)
        if m and not (m.group(3) and not m.group(2)):  # "iB" needs a prefix
            unit = m.group(2).lower()
            scale = 1024 ** "kmgt".index(unit) * 1024 if m.group(3) else _UNITS[unit]
            return int(float(m.group(1)) * scale)
        raise ValueError(
            f"{where}: {name}={value!r} cannot be read as bytes; give {expected}, e.g. {name}='80GiB'"
        )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(_wrong_type(value, name, where, expected, "80GiB"))
    if not math.isfinite(value) or value <= 0:
        raise ValueError(_out_of_range(value, name, where, f"{expected}, above 0", "80GiB"))
    return int(value)
