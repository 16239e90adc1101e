"""What ``mg.launch`` checks before any process starts: the function's signature, the counts,
and that the function, everything it uses and every argument can be sent to a rank."""

from __future__ import annotations

import inspect
import io
import linecache
import pickle
import re
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

import cloudpickle


class SendError(TypeError):
    """Something ``mg.launch`` would have to send to a rank (or back) cannot be pickled."""


def _kind(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _dumps(value: Any) -> bytes:
    buf = io.BytesIO()
    cloudpickle.CloudPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buf.getvalue()


def _fails(value: Any) -> Exception | None:
    try:
        _dumps(value)
    except Exception as exc:  # noqa: BLE001 - any failure to pickle is the answer
        return exc
    return None


def _culprit(value: Any, where: str, seen: set[int], depth: int = 0) -> tuple[str, Any, Exception] | None:
    """The innermost named part of ``value`` that cannot be pickled: a global or closure cell of
    a function (followed into the functions it calls), an item of a dict, list or tuple, or an
    attribute of an object."""
    if id(value) in seen or depth > 6:
        return None
    seen.add(id(value))
    exc = _fails(value)
    if exc is None:
        return None
    parts: list[tuple[str, Any]] = []
    if isinstance(value, types.FunctionType):
        try:
            cv = inspect.getclosurevars(value)
        except (TypeError, ValueError):
            cv = None
        if cv is not None:
            parts += [(f"global {name!r} of {value.__qualname__}", v) for name, v in cv.globals.items()]
            parts += [
                (f"variable {name!r} captured by {value.__qualname__}", v) for name, v in cv.nonlocals.items()
            ]
        for i, d in enumerate(value.__defaults__ or ()):
            parts.append((f"default argument {i} of {value.__qualname__}", d))
        for name, d in (value.__kwdefaults__ or {}).items():
            parts.append((f"default of {name!r} in {value.__qualname__}", d))
    elif isinstance(value, types.MethodType):
        parts.append((f"{where}.__self__", value.__self__))
    elif isinstance(value, Mapping):
        parts += [(f"{where}[{k!r}]", v) for k, v in list(value.items())[:1000]]
    elif isinstance(value, list | tuple):
        parts += [(f"{where}[{i}]", v) for i, v in enumerate(value[:1000])]
    elif hasattr(value, "__dict__") and not isinstance(value, type | types.ModuleType):
        parts += [(f"{where}.{k}", v) for k, v in list(vars(value).items())[:1000]]
    for name, part in parts:
        found = _culprit(part, name, seen, depth + 1)
        if found is not None:
            return found
    return where, value, exc


class Unpicklable(NamedTuple):
    """The part of a value that cannot be pickled."""

    part: str  # the part, named from the value's own name: "the value['lock']"
    kind: str  # its type: "_thread.lock"
    error: Exception  # pickle's error for it


def unpicklable(value: Any, where: str) -> Unpicklable | None:
    """The innermost named part of ``value`` (called ``where``) that cannot be pickled with
    cloudpickle; None when all of it can be."""
    error = _fails(value)
    if error is None:
        return None
    found = _culprit(value, where, set())
    part, bad, cause = found if found is not None else (where, value, error)
    return Unpicklable(part, _kind(bad), cause)


def dumps(value: Any, where: str, fix: str, who: str = "mg.launch") -> bytes:
    """cloudpickle's bytes for ``value``; a SendError naming the part that cannot be sent (and
    ``who`` would send it)."""
    try:
        return _dumps(value)
    except Exception as exc:
        bad = unpicklable(value, where) or Unpicklable(where, _kind(value), exc)  # it failed only once
        raise SendError(
            f"{who} cannot send {bad.part} (a {bad.kind}) to the ranks: {type(bad.error).__name__}: "
            f"{bad.error}. Each rank is a fresh process, so everything it needs is pickled (with "
            f"cloudpickle); locks, open files, generators, sockets and live devices' handles cannot be. {fix}"
        ) from exc


def check_signature(fn: Any, who: str = "mg.launch") -> None:
    """A TypeError unless ``fn`` is a function that takes ``(rank, shared, private)``; ``who``
    (``mg.launch``, ``mgkit worker``) is named as the caller."""
    if not callable(fn):
        raise TypeError(
            f"{who} needs a function to run in every rank, got {_kind(fn)} {fn!r}; "
            "pass e.g. `def work(rank, shared, private): ...` and then mg.launch(work, nprocs=2)"
        )
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: it will say so itself
    try:
        sig.bind(0, None, None)
    except TypeError:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"{who} calls fn(rank, shared, private) in every rank, but {name}{sig} does not accept "
            "three positional arguments; define it as `def work(rank, shared, private): ...` "
            "(ignore the ones you do not need)"
        ) from None


_DYNAMIC = re.compile(r'^(\s*)File "<dynamic-code>", line (\d+), in (\S+)$', re.MULTILINE)


def _code_files(fn: Any) -> dict[str, str]:
    """Function name -> source file, for fn and the functions it defines or uses by name."""
    files: dict[str, str] = {}
    todo, seen = [fn], set()
    while todo:
        f = todo.pop()
        if id(f) in seen or len(seen) > 500:
            continue
        seen.add(id(f))
        code = getattr(f, "__code__", None) if not isinstance(f, types.CodeType) else f
        if code is None:
            continue
        files.setdefault(code.co_name, code.co_filename)
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        if isinstance(f, types.FunctionType):
            g = f.__globals__
            todo += [g[n] for n in code.co_names if isinstance(g.get(n), types.FunctionType)]
            todo += [c.cell_contents for c in f.__closure__ or () if _is_function(c)]
    return files


def _is_function(cell: Any) -> bool:
    try:
        return isinstance(cell.cell_contents, types.FunctionType)
    except ValueError:
        return False


def restore_files(text: str, fn: Any) -> str:
    """A rank's traceback with the file names and source lines cloudpickle left out of the
    function's frames (it sends code without its file), taken from the kernel's own copy."""
    files = _code_files(fn)

    def put_back(m: re.Match) -> str:
        indent, line, name = m.group(1), int(m.group(2)), m.group(3)
        path = files.get(name)
        if path is None:
            return m.group(0)
        source = linecache.getline(path, line).strip()
        return f'{indent}File "{path}", line {line}, in {name}' + (f"\n{indent}  {source}" if source else "")

    return _DYNAMIC.sub(put_back, text)
