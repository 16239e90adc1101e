"""How messages name a function, and JAX's device errors told in context names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._contexts import explain_incompatible


def fn_name(fn: Callable) -> str:
    """How messages and the ledger name a function."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def explained(call: Callable, *args: Any) -> Any:
    """Runs ``call``; JAX's incompatible-devices error comes back in context names."""
    try:
        return call(*args)
    except ValueError as e:
        better = explain_incompatible(e)
        if better is None:
            raise
        raise better from e
