"""The trainer's checkpoint store: a training state saved to a folder with orbax-checkpoint, atomic
(a save killed half-way leaves the previous checkpoint the newest complete one) and asynchronous (the
arrays are copied off the devices, then written in the background), the newest ``keep`` kept.

orbax-checkpoint is optional (``pip install 'mgkit[checkpoint]'``): it is imported when a
``Checkpoints`` is made, never when mgkit is.

A state is a dict. An entry holding arrays (``params``, ``opt_state``, a PRNG key) is a tree: its
arrays go to orbax, its other leaves (Python numbers) to a JSON manifest that also lists every
leaf's path, shape and dtype, so a restore into another model names the first leaf that differs.
An entry without arrays (``step``, the data position, a key of ``None``) is stored as JSON and
comes back as saved (JSON's types: tuples come back as lists).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np

from mgkit._numbers import whole

_INSTALL = "pip install 'mgkit[checkpoint]'"


def _orbax(where: str):
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            f"{where}: checkpoints need the optional package orbax-checkpoint, which is not installed;"
            f" install it with {_INSTALL} (or pip install 'orbax-checkpoint>=0.11')"
        ) from e
    return ocp


def _kind(x: Any) -> str:
    """How a leaf is stored: "key" (typed PRNG key, as its key data), "array" (jax), "numpy", "value"."""
    if isinstance(x, jax.Array):
        return "key" if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else "array"
    return "numpy" if isinstance(x, np.ndarray | np.generic) else "value"


def _has_arrays(tree: Any) -> bool:
    return any(isinstance(x, jax.Array | np.ndarray) for x in jax.tree_util.tree_leaves(tree))


def _plain(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} {x!r}")


def _describe(leaf: dict) -> str:
    if leaf["kind"] == "value":
        return f"the Python value {leaf['value']!r}"
    noun = {"array": "an array", "key": f"a {leaf.get('impl')} PRNG key with data", "numpy": "a numpy array"}
    return f"{noun[leaf['kind']]} of shape {tuple(leaf['shape'])} and dtype {leaf['dtype']}"


def _leaf_info(path: str, x: Any) -> dict:
    kind = _kind(x)
    if kind == "value":
        return {"path": path, "kind": kind, "value": x}
    data = jax.random.key_data(x) if kind == "key" else x
    info = {"path": path, "kind": kind, "shape": list(np.shape(data)), "dtype": str(np.dtype(data.dtype))}
    return info | ({"impl": str(jax.random.key_impl(x))} if kind == "key" else {})


def _first_difference(saved: list[dict], model: list[dict]) -> str | None:
    """Where the saved leaves and the model's first differ, in words; None when they match."""
    model_paths = {m["path"] for m in model}
    for i in range(max(len(saved), len(model))):
        s = saved[i] if i < len(saved) else None
        m = model[i] if i < len(model) else None
        if s is None or m is None or s["path"] != m["path"]:
            if s is not None and s["path"] not in model_paths:
                return f"{s['path']} is in the checkpoint ({_describe(s)}) but missing from the model"
            return f"{m['path']} is in the model ({_describe(m)}) but missing from the checkpoint"
        if s["kind"] != m["kind"] or s.get("shape") != m.get("shape") or s.get("dtype") != m.get("dtype"):
            return f"{s['path']} is {_describe(s)} in the checkpoint but {_describe(m)} in the model"
    return None


class Checkpoints:
    """A folder of training checkpoints, saved every ``every`` steps, the newest ``keep`` kept.

    Args:
        directory: the folder (made if missing); it must be writable.
        every: save when the step is a multiple of ``every`` (see ``due``).
        keep: how many checkpoints to keep, newest first; ``None`` keeps all.
        where: the caller's name, the start of every error message.

    ``save`` returns once the arrays are copied off the devices (they may then be donated) and
    writes in the background; a new ``save``, ``latest``, ``restore``, ``wait`` and ``close``
    first wait for the save in flight. A context manager: leaving it closes the store.

    >>> import jax.numpy as jnp, tempfile
    >>> with tempfile.TemporaryDirectory() as d, Checkpoints(d, every=10) as ck:
    ...     ck.save(10, {"params": {"w": jnp.ones(3)}, "step": 10, "key": None, "data": {"index": 5}})
    ...     back = ck.restore({"params": {"w": jnp.zeros(3)}, "step": 0, "key": None, "data": {}})
    ...     (ck.latest(), back["params"]["w"].tolist(), back["data"])
    (10, [1.0, 1.0, 1.0], {'index': 5})
    """

    def __init__(
        self, directory: str | os.PathLike, *, every: int = 100, keep: int | None = 3, where="Checkpoints"
    ):
        self.where = where
        self.every = whole(every, "every", where, lo=1, example=100, note="save every `every` steps")
        self.keep = None if keep is None else whole(keep, "keep", where, lo=1, example=3, note="or None: all")
        if not isinstance(directory, str | os.PathLike):
            raise TypeError(
                f"{where}: the checkpoint folder must be a path (str or pathlib.Path), got"
                f" {type(directory).__name__} {directory!r}; e.g. checkpoint='ckpt/'"
            )
        ocp = _orbax(where)
        path = Path(directory).expanduser().absolute()
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(
                f"{where}: the checkpoint folder '{path}' is a file, not a folder; pass the path of a"
                " folder (made if missing), e.g. checkpoint='ckpt/'"
            )
        try:  # writable: make the folder and a file in it (file permissions do not stop root)
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as e:
            raise PermissionError(
                f"{where}: cannot write in the checkpoint folder '{path}' ({e.strerror or e}); pass a"
                " folder you can write to, e.g. checkpoint='ckpt/'"
            ) from e
        self.directory = path
        self._ocp = ocp
        options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, enable_async_checkpointing=True)
        self._manager = ocp.CheckpointManager(path, options=options)
        self._closed = False

    def due(self, step: int) -> bool:
        """Whether step ``step`` (after it completes) is one to save: a positive multiple of ``every``."""
        return step > 0 and step % self.every == 0

    def _open(self) -> Any:
        if self._closed:
            raise RuntimeError(
                f"{self.where}: the checkpoint store of '{self.directory}' is closed; make a new one"
            )
        return self._manager

    def wait(self) -> None:
        """Waits for the save in flight, if any; re-raises its error if it failed."""
        self._open().wait_until_finished()

    def latest(self) -> int | None:
        """The step of the newest complete checkpoint, or None when the folder holds none."""
        self.wait()
        steps = self._manager.all_steps()
        return max(steps) if steps else None

    def save(self, step: int, state: dict) -> None:
        """Starts saving ``state`` as step ``step``: returns once the arrays are copied off the devices.

        ``step`` must be newer than every checkpoint in the folder (older ones belong to another run)."""
        step = whole(step, "step", f"{self.where}: saving a checkpoint", lo=0, example=100)
        latest = self.latest()
        if latest is not None and step <= latest:
            raise ValueError(
                f"{self.where}: the checkpoint folder '{self.directory}' already holds step {latest}, not"
                f" older than step {step} being saved: it holds another run's checkpoints. Resume from"
                " them, or use a new folder (e.g. checkpoint='ckpt_2/'), or empty this one"
            )
        trees = {name: value for name, value in state.items() if _has_arrays(value)}
        saved_as_json = {}
        for name in state.keys() - trees.keys():
            try:
                saved_as_json[name] = json.loads(json.dumps(state[name], default=_plain))
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"{self.where}: state[{name!r}] = {state[name]!r:.80} cannot be saved: {e} is not"
                    " JSON-able; use numbers, strings, lists and dicts with str keys"
                ) from None
        leaves = jax.tree_util.tree_flatten_with_path(trees)[0]
        manifest = [_leaf_info(jax.tree_util.keystr(p), x) for p, x in leaves]
        try:
            json.dumps(manifest)
        except TypeError as e:
            raise TypeError(
                f"{self.where}: a leaf of the state cannot be saved ({e}); a tree's leaves must be arrays or"
                " Python numbers"
            ) from None
        arrays = {
            str(i): jax.random.key_data(x) if info["kind"] == "key" else x
            for i, ((_, x), info) in enumerate(zip(leaves, manifest, strict=True))
            if info["kind"] != "value"
        }
        meta = {
            "format": "mgkit.train checkpoint 1",
            "json": saved_as_json,
            "trees": sorted(trees),
            "leaves": manifest,
        }
        items = {"meta": self._ocp.args.JsonSave(meta)}
        if arrays:
            items["arrays"] = self._ocp.args.StandardSave(arrays)
        if not self._manager.save(step, args=self._ocp.args.Composite(**items), force=True):
            raise RuntimeError(f"{self.where}: orbax declined to save step {step} in '{self.directory}'")

    def restore(self, like: dict, step: int | None = None) -> dict:
        """The state saved at ``step`` (default: the newest complete one), its arrays placed like ``like``'s.

        ``like`` is a state of the same form (its arrays' shapes, dtypes and shardings are used, not
        their values). Raises FileNotFoundError when there is no such checkpoint, ValueError when the
        checkpoint's trees differ from ``like``'s (naming the first leaf that differs)."""
        self.wait()
        steps = sorted(self._manager.all_steps())
        if step is None:
            if not steps:
                raise FileNotFoundError(
                    f"{self.where}: no complete checkpoint in '{self.directory}': the folder is empty or"
                    " holds only unfinished saves; start without resuming, or point to the folder that"
                    " holds the checkpoints"
                )
            step = steps[-1]
        step = whole(
            step, "step", f"{self.where}: restoring a checkpoint", lo=0, example=steps[-1] if steps else 100
        )
        if step not in steps:
            raise FileNotFoundError(
                f"{self.where}: no complete checkpoint of step {step} in '{self.directory}'; it holds"
                f" steps {steps}: pass one of them, or step=None for the newest"
            )
        ocp = self._ocp
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        trees = {name: like.get(name) for name in meta["trees"]}
        leaves, treedef = jax.tree_util.tree_flatten_with_path(trees)
        model = [_leaf_info(jax.tree_util.keystr(p), x) for p, x in leaves]
        missing = [f"[{n!r}] is in the checkpoint but missing from the model" for n in trees if n not in like]
        extra = [
            f"[{n!r}] is in the model but missing from the checkpoint"
            for n, v in like.items()
            if n not in trees and n not in meta["json"] and _has_arrays(v)
        ]
        problem = next(iter(missing + extra), None) or _first_difference(meta["leaves"], model)
        if problem:
            raise ValueError(
                f"{self.where}: the checkpoint of step {step} in '{self.directory}' does not fit this model:"
                f" {problem}. It belongs to a different model: use a new checkpoint folder (e.g."
                " checkpoint='ckpt_2/'), or build the trainer with the parameters it was saved from"
            )
        abstract = {}
        for i, ((_, x), info) in enumerate(zip(leaves, model, strict=True)):
            if info["kind"] in ("array", "key"):
                sharding = (jax.random.key_data(x) if info["kind"] == "key" else x).sharding
                abstract[str(i)] = jax.ShapeDtypeStruct(
                    tuple(info["shape"]), info["dtype"], sharding=sharding
                )
            elif info["kind"] == "numpy":
                abstract[str(i)] = jax.ShapeDtypeStruct(tuple(info["shape"]), info["dtype"])
        got = {}
        if abstract:
            items = ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract))
            got = self._manager.restore(step, args=items)["arrays"]
        values = []
        for i, ((_, x), saved) in enumerate(zip(leaves, meta["leaves"], strict=True)):
            kind = saved["kind"]
            value = saved.get("value") if kind == "value" else got[str(i)]
            if kind == "key":
                value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(x))
            elif kind == "numpy":
                value = np.asarray(value)[()] if isinstance(x, np.generic) else np.asarray(value)
            values.append(value)
        return meta["json"] | jax.tree_util.tree_unflatten(treedef, values)

    def close(self) -> None:
        """Waits for the save in flight and releases orbax's resources; closing twice is fine."""
        if not self._closed:
            try:
                self._manager.wait_until_finished()
            finally:
                self._closed = True
                self._manager.close()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"every={self.every}, keep={self.keep}"
        return f"Checkpoints('{self.directory}', {state})"
