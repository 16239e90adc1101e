"""Leaves held static: the functions, strings and other objects inside a pytree (an Equinox
module's activation, a name field) that are neither placed on a device nor differentiated,
as ``eqx.partition(tree, eqx.is_array)`` holds them.

Two ways of holding them, for two uses:

* ``Model``: a model split once into its arrays (what is placed, differentiated, optimized
  and saved: the model with every other leaf ``None``) and the rest, joined back for the
  user's function (trainers);
* ``held``: a call's arguments with each static leaf moved into the tree's structure, so that
  the structure carries it into a compiled program and its cache key, and unflattening gives
  the original object back (``mg.parallel``, ``mg.pmap``).
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)  # leaves that are arrays


def is_array(leaf: Any) -> bool:
    """Whether a leaf is an array (JAX or numpy, a numpy scalar included) or an array's shape
    (``jax.ShapeDtypeStruct``, as ``jax.eval_shape`` gives it)."""
    return isinstance(leaf, (*ARRAY_TYPES, jax.ShapeDtypeStruct))


def is_static(leaf: Any) -> bool:
    """Whether a leaf is held static: neither an array nor a number (a function, a string,
    any other object)."""
    return not isinstance(leaf, (*ARRAY_TYPES, jax.ShapeDtypeStruct, numbers.Number))


class Model:
    """A model split as ``eqx.partition(model, eqx.is_array)`` splits it.

    ``arrays`` is the model with every non-array leaf replaced by ``None``: what a trainer
    places, differentiates, optimizes and saves. The other leaves are held as given, and
    :meth:`join` puts them back. A model of arrays only is ``plain``: ``arrays`` is the model
    itself and :meth:`bind` returns the function unchanged.
    """

    __slots__ = ("_mask", "_static", "_treedef", "arrays", "plain")

    def __init__(self, tree: Any):
        leaves, self._treedef = jax.tree_util.tree_flatten(tree)
        self._mask = tuple(is_array(x) for x in leaves)
        self.plain = all(self._mask)
        self._static = [None if a else x for x, a in zip(leaves, self._mask, strict=True)]
        arrays = [x if a else None for x, a in zip(leaves, self._mask, strict=True)]
        self.arrays = tree if self.plain else jax.tree_util.tree_unflatten(self._treedef, arrays)

    def join(self, arrays: Any) -> Any:
        """The model with ``arrays`` (a tree like :attr:`arrays`) and the leaves held static."""
        if self.plain:
            return arrays
        flat = self._treedef.flatten_up_to(arrays)  # a None of the model's own stays structure
        merged = [x if a else s for x, s, a in zip(flat, self._static, self._mask, strict=True)]
        return jax.tree_util.tree_unflatten(self._treedef, merged)

    def bind(self, fn: Callable) -> Callable:
        """``fn(model, *rest)`` as a function of the arrays: ``bound(arrays, *rest)``."""
        if self.plain:
            return fn

        @functools.wraps(fn)
        def bound(arrays: Any, *rest: Any) -> Any:
            return fn(self.join(arrays), *rest)

        bound.model = self  # what it joins the arrays with: messages name what fn was given
        return bound

    def arrays_of(self, tree: Any, where: str, what: str) -> Any:
        """The arrays of ``tree``, a model like this one (e.g. ``tr.params``); its other
        leaves must be this model's, which the compiled program holds."""
        if self.plain:
            return tree
        other = Model(tree)
        if other._treedef != self._treedef or other._mask != self._mask:
            raise ValueError(
                f"{where}: {what} does not have the structure of the model this was made with "
                f"({other._treedef} against {self._treedef}); pass the model it returned "
                "(e.g. tr.params), with the same leaves held static"
            )
        for path, mine, theirs in zip(self._paths(), self._static, other._static, strict=True):
            if mine is not theirs and not _same(mine, theirs):
                raise ValueError(
                    f"{where}: {what} holds {describe(theirs)} at {path}, where the model this was made "
                    f"with holds {describe(mine)}; non-array leaves are held as given when it was made "
                    "(they are part of the compiled program): make a new one for another model"
                )
        return other.arrays

    def _paths(self) -> list[str]:
        paths = jax.tree_util.tree_flatten_with_path(self.join(self.arrays))[0]
        return [jax.tree_util.keystr(p) or "(the model itself)" for p, _ in paths]


def describe(value: Any) -> str:
    """A static leaf for messages: ``function relu``, ``str 'net'``."""
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    if isinstance(name, str) and not isinstance(value, type):
        return f"{type(value).__name__} {name}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # noqa: BLE001 - objects that cannot be compared are different objects
        return False


# -- held in the structure -------------------------------------------------------------------


class _Held:
    """A static leaf as a pytree node without children: its value rides in the structure
    (compared by equality where it is hashable, else by identity), and unflattening gives the
    value itself back."""

    __slots__ = ("_key", "value")

    def __init__(self, value: Any):
        self.value = value
        try:
            hash(value)
            self._key = (type(value), value)
        except TypeError:
            self._key = (type(value), id(value))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Held) and _same(self._key, other._key)

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"static({self.value!r:.40})"


class _Static:
    """Stands for a static leaf while a tree is rebuilt by :func:`held`."""

    __slots__ = ("held",)

    def __init__(self, value: Any):
        self.held = _Held(value)


jax.tree_util.register_pytree_node(
    _Static,
    lambda s: ((), s.held),
    lambda held, _: held.value,  # unflattening gives the value back, not the stand-in
)


def held(tree: Any, hold: Sequence[bool] | None = None) -> Any:
    """``tree`` with its static leaves (:func:`is_static`; ``hold``: one flag per leaf, for
    those to hold) moved into its structure: flattening the result gives the other leaves
    only, and unflattening gives ``tree``'s objects back. ``tree`` itself when none is held."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if hold is None:
        hold = [is_static(x) for x in leaves]
    if not any(hold):
        return tree
    return jax.tree_util.tree_unflatten(
        treedef, [_Static(x) if h else x for x, h in zip(leaves, hold, strict=True)]
    )
