"""How a checkpoint describes a state's trees: one record per tree node (its type) and per leaf
(an array's shape and dtype, a key's implementation, a Python number's value), in the order JAX
flattens the tree, so a restore can name the first place where the checkpoint and the model
differ and put the leaves back into the model's own tree structure. And how each tree is
written (``written``: every leaf in its own shape, as plain orbax reads it) and read back
(``target``, ``rebuild``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import numpy as np

from mgkit._spmd import to_host


@dataclasses.dataclass(frozen=True)
class Padded:
    """A leaf stored with zeros appended along its split axes (a trainer's ``shard=``): its
    checkpoint holds the leaf in its own shape (read to the host shard by shard, never whole on a
    context), and a restore fills any padding (or none) from it, each context reading its own
    part. Not a pytree node: a leaf of the state's trees."""

    array: jax.Array  # the stored, padded array
    shape: tuple[int, ...]  # the leaf's shape without the padding


def kind(x: Any) -> str:
    """How a leaf is stored: "key" (typed PRNG key, as its key data), "array" (jax), "numpy", "value"."""
    if isinstance(x, Padded):
        return "array"
    if isinstance(x, jax.Array):
        return "key" if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else "array"
    return "numpy" if isinstance(x, np.ndarray | np.generic) else "value"


def is_json(x: Any) -> bool:
    """Whether ``x`` comes back from JSON as it is: None, numbers, strings, and lists and
    str-keyed dicts of them (a tuple or a NamedTuple, even an empty one, would come back a list)."""
    if x is None or isinstance(x, bool | int | float | str | np.generic):
        return not isinstance(x, np.generic) or np.ndim(x) == 0
    if type(x) is list:
        return all(is_json(v) for v in x)
    if type(x) is dict:
        return all(isinstance(k, str) and is_json(v) for k, v in x.items())
    return False


def _type_name(x: Any) -> str:
    return "None" if x is None else type(x).__qualname__


def _leaf_info(path: str, x: Any, where: str) -> dict:
    how = kind(x)
    if how == "value" and not isinstance(x, bool | int | float | str):
        raise TypeError(
            f"{where}: the state's leaf {path} = {x!r:.80} is not an array nor a number; a tree's leaves"
            " must be arrays or Python numbers (a JSON-able entry without arrays is saved as it is)"
        )
    if how == "value":
        return {"path": path, "kind": how, "value": x}
    data = x.array if isinstance(x, Padded) else jax.random.key_data(x) if how == "key" else x
    shape = x.shape if isinstance(x, Padded) else np.shape(data)  # a key's: its key data's
    info = {"path": path, "kind": how, "shape": list(shape), "dtype": str(np.dtype(data.dtype))}
    return info | ({"impl": str(jax.random.key_impl(x))} if how == "key" else {})


def written(tree: Any) -> Any:
    """``tree`` as orbax writes it, each leaf in its own shape: a typed key as its key data, a
    padded leaf without its padding (read to the host shard by shard), a numpy scalar as a 0-d
    array, a string as None (its record holds it); arrays as they are (written shard by shard)."""

    def one(x: Any) -> Any:
        if isinstance(x, Padded):
            return to_host(x.array, x.shape)
        if kind(x) == "key":
            return jax.random.key_data(x)
        if isinstance(x, np.generic):
            return np.asarray(x)
        return None if isinstance(x, str) else x

    return jax.tree_util.tree_map(one, tree)


def records(trees: dict, where: str) -> tuple[list[dict], list[Any]]:
    """Every node and leaf of ``trees`` (a dict of trees) in JAX's flattening order: (records, leaves).

    A node's record is ``{"path", "kind": "node", "type"}``; a leaf's as ``_leaf_info`` says.
    ``leaves`` are the leaf objects, in the order of ``jax.tree_util.tree_leaves(trees)``.

    >>> import jax.numpy as jnp, optax
    >>> recs, leaves = records({"opt": optax.sgd(0.1).init({"w": jnp.zeros(2)})}, "doc")
    >>> [(r["path"], r.get("type")) for r in recs], leaves
    ([('', 'dict'), ("['opt']", 'tuple'), ("['opt'][0]", 'EmptyState'), ("['opt'][1]", 'EmptyState')], [])
    """
    out, leaves = [], []
    stack = [((), trees)]
    while stack:
        path, x = stack.pop()
        children = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y, x=x: y is not x)[0]
        if len(children) == 1 and children[0][0] == ():  # x is a leaf
            out.append(_leaf_info(jax.tree_util.keystr(path), x, where))
            leaves.append(x)
            continue
        out.append({"path": jax.tree_util.keystr(path), "kind": "node", "type": _type_name(x)})
        stack.extend((path + p, c) for p, c in reversed(children))
    return out, leaves


def describe(rec: dict) -> str:
    """A record in words: "an array of shape (3,) and dtype float32", "a tree node of type EmptyState"."""
    if rec["kind"] == "node":
        return f"a tree node of type {rec['type']}"
    if rec["kind"] == "value":
        return f"the Python value {rec['value']!r}"
    noun = {"array": "an array", "key": f"a {rec.get('impl')} PRNG key with data", "numpy": "a numpy array"}
    return f"{noun[rec['kind']]} of shape {tuple(rec['shape'])} and dtype {rec['dtype']}"


def _missing(path: str, rec: dict, where: str, other: str) -> str:
    return f"{path} is in the {where} ({describe(rec)}) but missing from the {other}"


def _leaf_difference(saved: list[dict], model: list[dict]) -> str | None:
    model_paths = {m["path"] for m in model}
    for s, m in itertools.zip_longest(saved, model):
        if s is None or m is None or s["path"] != m["path"]:
            if s is not None and s["path"] not in model_paths:
                return _missing(s["path"], s, "checkpoint", "model")
            return _missing(m["path"], m, "model", "checkpoint")
        if any(s.get(k) != m.get(k) for k in ("kind", "shape", "dtype")):
            return f"{s['path']} is {describe(s)} in the checkpoint but {describe(m)} in the model"
    return None


def first_difference(saved: list[dict], model: list[dict]) -> str | None:
    """Where the checkpoint's records and the model's first differ, in words; None when they match.

    First a node of another type at the same path (an optimizer state of another optimizer),
    then the leaves (a missing, extra or reshaped array), then a node on one side only (an empty
    state). Records without nodes (checkpoints of format 1) are compared by their leaves."""
    nodes = [{r["path"]: r for r in recs if r["kind"] == "node"} for recs in (saved, model)]
    for path, s in nodes[0].items():
        m = nodes[1].get(path)
        if m is not None and m["type"] != s["type"]:
            return f"{path} is {describe(s)} in the checkpoint but of type {m['type']} in the model"
    leaves = [[r for r in recs if r["kind"] != "node"] for recs in (saved, model)]
    problem = _leaf_difference(*leaves)
    if problem or not nodes[0]:
        return problem
    for ours, theirs, here, there in ((0, 1, "checkpoint", "model"), (1, 0, "model", "checkpoint")):
        for path, rec in nodes[ours].items():
            if path not in nodes[theirs]:
                return _missing(path, rec, here, there)
    return None


def target(x: Any, info: dict) -> Any:
    """What orbax restores the model's leaf ``x`` into (its saved record ``info``): an array's
    shape, dtype and sharding (a padded leaf's padded shape: orbax fills the padding with zeros,
    each context reading its own part), numpy leaves as numpy, a Python number as itself."""
    if info["kind"] == "value":
        return None if isinstance(info["value"], str) else info["value"]
    if isinstance(x, Padded):
        return jax.ShapeDtypeStruct(x.array.shape, info["dtype"], sharding=x.array.sharding)
    sharding = None if info["kind"] == "numpy" else x.sharding  # a key's sharding fits its key data
    return jax.ShapeDtypeStruct(tuple(info["shape"]), info["dtype"], sharding=sharding)


def rebuild(x: Any, saved: dict, got: Any) -> Any:
    """A restored leaf as the model's leaf ``x`` holds it: a typed key rewrapped, a numpy scalar a
    scalar, a padded leaf its padded array (``Padded``), a Python number the saved one."""
    if saved["kind"] == "key":
        return jax.random.wrap_key_data(got, impl=jax.random.key_impl(x))
    if isinstance(x, Padded):
        return Padded(got, x.shape)
    if saved["kind"] == "numpy":
        return np.asarray(got)[()] if isinstance(x, np.generic) else np.asarray(got)
    return saved["value"] if saved["kind"] == "value" else got
