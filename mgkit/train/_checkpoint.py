"""The trainer's checkpoint store: a training state saved to a folder with orbax-checkpoint (an
optional dependency, imported when a store is made), atomic (a save killed half-way leaves the
previous checkpoint the newest complete one), asynchronous, the newest ``keep`` kept.

A state is a dict. An entry holding arrays (``params``, ``opt_state``, a PRNG key) is a tree: its
arrays go to orbax, its other leaves (Python numbers) to a JSON manifest listing every leaf's path,
shape and dtype, so a restore into another model names the first leaf that differs. An entry without
arrays (``step``, the data position, a key of ``None``) is stored as JSON and comes back as saved.
"""

from __future__ import annotations

import itertools
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


def _plain(x: Any) -> Any:  # numpy scalars in JSON entries (a data position's index) as Python's
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} {x!r:.80}")


def _describe(leaf: dict) -> str:
    if leaf["kind"] == "value":
        return f"the Python value {leaf['value']!r}"
    noun = {"array": "an array", "key": f"a {leaf.get('impl')} PRNG key with data", "numpy": "a numpy array"}
    return f"{noun[leaf['kind']]} of shape {tuple(leaf['shape'])} and dtype {leaf['dtype']}"


def _leaf_info(path: str, x: Any, where: str) -> dict:
    kind = _kind(x)
    if kind == "value" and not isinstance(x, bool | int | float | str):
        raise TypeError(
            f"{where}: the state's leaf {path} = {x!r:.80} is not an array nor a number; a tree's leaves"
            " must be arrays or Python numbers (a JSON-able entry without arrays is saved as it is)"
        )
    if kind == "value":
        return {"path": path, "kind": kind, "value": x}
    data = jax.random.key_data(x) if kind == "key" else x
    info = {"path": path, "kind": kind, "shape": list(np.shape(data)), "dtype": str(np.dtype(data.dtype))}
    return info | ({"impl": str(jax.random.key_impl(x))} if kind == "key" else {})


def _first_difference(saved: list[dict], model: list[dict]) -> str | None:
    """Where the saved leaves and the model's first differ, in words; None when they match."""
    model_paths = {m["path"] for m in model}
    for s, m in itertools.zip_longest(saved, model):
        if s is None or m is None or s["path"] != m["path"]:
            if s is not None and s["path"] not in model_paths:
                return f"{s['path']} is in the checkpoint ({_describe(s)}) but missing from the model"
            return f"{m['path']} is in the model ({_describe(m)}) but missing from the checkpoint"
        if any(s.get(k) != m.get(k) for k in ("kind", "shape", "dtype")):
            return f"{s['path']} is {_describe(s)} in the checkpoint but {_describe(m)} in the model"
    return None


def _abstract(x: Any, info: dict) -> jax.ShapeDtypeStruct:
    """What orbax restores a leaf into: ``x``'s shape, dtype and sharding (numpy leaves: none)."""
    sharding = None if info["kind"] == "numpy" else x.sharding  # a key's sharding fits its key data
    return jax.ShapeDtypeStruct(tuple(info["shape"]), info["dtype"], sharding=sharding)


def _rebuild(x: Any, saved: dict, got: Any) -> Any:
    """A restored leaf as the model's leaf ``x`` holds it: a typed key rewrapped, a numpy scalar a scalar."""
    if saved["kind"] == "key":
        return jax.random.wrap_key_data(got, impl=jax.random.key_impl(x))
    if saved["kind"] == "numpy":
        return np.asarray(got)[()] if isinstance(x, np.generic) else np.asarray(got)
    return saved["value"] if saved["kind"] == "value" else got


def _writable_folder(directory: Any, where: str) -> Path:
    """``directory`` as an absolute path, made if missing; a clear error when it cannot be written in."""
    if not isinstance(directory, str | os.PathLike):
        raise TypeError(
            f"{where}: the checkpoint folder must be a path (str or pathlib.Path), got"
            f" {type(directory).__name__} {directory!r}; e.g. checkpoint='ckpt/'"
        )
    path = Path(directory).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"{where}: the checkpoint folder '{path}' is a file, not a folder; pass the path of a folder"
            " (made if missing), e.g. checkpoint='ckpt/'"
        )
    try:  # make the folder and a file in it: permission bits alone do not stop root
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise PermissionError(
            f"{where}: cannot write in the checkpoint folder '{path}' ({e.strerror or e}); pass a folder"
            " you can write to, e.g. checkpoint='ckpt/'"
        ) from e
    return path


class Checkpoints:
    """A folder of training checkpoints, saved every ``every`` steps, the newest ``keep`` kept.
    Needs orbax-checkpoint: ``pip install 'mgkit[checkpoint]'``.

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

    def __init__(self, directory: str | os.PathLike, *, every=100, keep: int | None = 3, where="Checkpoints"):
        self.where = where
        self.every = whole(every, "every", where, lo=1, example=100, note="save every `every` steps")
        self.keep = None if keep is None else whole(keep, "keep", where, lo=1, example=3, note="or None: all")
        self._ocp = ocp = _orbax(where)
        self.directory = path = _writable_folder(directory, where)
        options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, enable_async_checkpointing=True)
        self._manager = ocp.CheckpointManager(path, options=options)
        self._closed, self._saving = False, None

    def due(self, step: int) -> bool:
        """Whether step ``step`` (after it completes) is one to save: a positive multiple of ``every``."""
        return step > 0 and step % self.every == 0

    def wait(self) -> None:
        """Waits for the save in flight, if any; raises a RuntimeError if it failed."""
        if self._closed:
            raise RuntimeError(
                f"{self.where}: the checkpoint store of '{self.directory}' is closed; make a new one"
            )
        step, self._saving = self._saving, None
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise RuntimeError(
                f"{self.where}: saving the checkpoint of step {step} in '{self.directory}' failed"
                f" ({type(e).__name__}: {e}); the newest complete checkpoint is the one before it. Check the"
                " folder (free space, permissions) and save again"
            ) from e

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
        json_entries = {}
        for name in state.keys() - trees.keys():
            try:
                json_entries[name] = json.loads(json.dumps(state[name], default=_plain))
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"{self.where}: state[{name!r}] = {state[name]!r:.80} cannot be saved: {e} is not"
                    " JSON-able; use numbers, strings, lists and dicts with str keys"
                ) from None
        leaves = jax.tree_util.tree_flatten_with_path(trees)[0]
        manifest = [_leaf_info(jax.tree_util.keystr(p), x, self.where) for p, x in leaves]
        arrays = {
            str(i): jax.random.key_data(x) if info["kind"] == "key" else x
            for i, ((_, x), info) in enumerate(zip(leaves, manifest, strict=True))
            if info["kind"] != "value"
        }
        meta = {"format": "mgkit.train 1", "json": json_entries, "trees": sorted(trees), "leaves": manifest}
        items = {"meta": self._ocp.args.JsonSave(meta)}
        if arrays:
            items["arrays"] = self._ocp.args.StandardSave(arrays)
        self._manager.save(step, args=self._ocp.args.Composite(**items), force=True)
        self._saving = step

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
            step, "step", f"{self.where}: restoring a checkpoint", lo=0, example=steps[-1] if steps else 1
        )
        if step not in steps:
            raise FileNotFoundError(
                f"{self.where}: no complete checkpoint of step {step} in '{self.directory}'; it holds"
                f" steps {steps}: pass one of them, or step=None for the newest"
            )
        ocp = self._ocp
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        # the model's trees: those saved, and any other entry of `like` with arrays (to name it)
        names = {*meta["trees"], *(n for n, v in like.items() if n not in meta["json"] and _has_arrays(v))}
        leaves, treedef = jax.tree_util.tree_flatten_with_path({name: like.get(name) for name in names})
        model = [_leaf_info(jax.tree_util.keystr(p), x, self.where) for p, x in leaves]
        problem = _first_difference(meta["leaves"], model)
        if problem:
            raise ValueError(
                f"{self.where}: the checkpoint of step {step} in '{self.directory}' does not fit this model:"
                f" {problem}. It belongs to a different model: use a new checkpoint folder (e.g."
                " checkpoint='ckpt_2/'), or build the trainer with the parameters it was saved from"
            )
        xs, saved = [x for _, x in leaves], meta["leaves"]
        abstract = {str(i): _abstract(x, saved[i]) for i, x in enumerate(xs) if saved[i]["kind"] != "value"}
        items = ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract))
        got = self._manager.restore(step, args=items)["arrays"] if abstract else {}
        values = [_rebuild(x, saved[i], got.get(str(i))) for i, x in enumerate(xs)]
        return meta["json"] | jax.tree_util.tree_unflatten(treedef, values)

    def close(self) -> None:
        """Waits for the save in flight and releases orbax's resources; closing twice is fine."""
        if not self._closed:
            try:
                self.wait()
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


class Checkpointing:
    """What a trainer with a checkpoint folder does (``Trainer``, ``Pipeline``): saves its
    state every ``every`` steps while it fits, ``save()`` on demand, and a fit with
    ``resume=True`` goes on from the newest checkpoint. The trainer says what its state is
    (``_state(position)``: a dict of ``params``, ``opt_state``, ``step``, ``key`` and the data
    position) and takes a restored one back (``_restore(back)``)."""

    checkpoints: Checkpoints | None
    _step: int
    _position: dict | None  # where the last fit of arrays stopped

    def _state(self, position: dict | None) -> dict:
        raise NotImplementedError

    def _restore(self, back: dict) -> None:
        raise NotImplementedError

    def _what(self) -> tuple[str, str]:
        """(what messages call the trainer, how one makes it with a folder)."""
        name = type(self).__name__
        return name.lower(), f"mg.{name}(..., checkpoint='ckpt/')"

    def _begin(self, resume: bool, where: str) -> None:
        """Before a fit: restores the newest checkpoint (``resume``; none saved yet: a first
        run), or checks that the folder holds none ahead of the trainer's step."""
        what, make = self._what()
        if resume:
            if self.checkpoints is None:
                raise TypeError(
                    f"{where}: resume=True restores from the {what}'s checkpoint folder, and this {what} "
                    f"has none; make it with {make}"
                )
            if self.checkpoints.latest() is not None:
                self._restore(self.checkpoints.restore(self._state(self._position)))
        elif self.checkpoints is not None:
            latest = self.checkpoints.latest()
            if latest is not None and latest > self._step:
                raise ValueError(
                    f"{where}: the checkpoint folder '{self.checkpoints.directory}' holds step {latest}, "
                    f"ahead of this {what} (step {self._step}): pass resume=True to go on from it, or "
                    f"give the {what} a new folder (checkpoint='ckpt_2/')"
                )

    def _save_due(self, position: dict | None) -> None:
        """Saves the state after the step just dispatched where the step is one to save (orbax
        copies the arrays off the devices before this returns, before the next step donates
        them, and writes them in the background)."""
        if self.checkpoints is not None and self.checkpoints.due(self._step):
            self.checkpoints.save(self._step, self._state(position))

    def _fit_ended(self, feed: Any) -> None:
        """After a fit: its loader (a ``Feed``) stopped, its checkpoints on disk, and where its
        arrays stopped kept for the next fit (and the next checkpoint)."""
        position = feed.close()
        if self.checkpoints is not None:
            self.checkpoints.wait()
        if feed.arrays:
            self._position = position

    def save(self) -> None:
        """Saves a checkpoint of the current state now (needs ``checkpoint=``), and waits for it."""
        if self.checkpoints is None:
            what, _ = self._what()
            raise TypeError(
                f"{type(self).__name__}.save: this {what} has no checkpoint folder; make it with "
                "checkpoint='ckpt/'"
            )
        if self.checkpoints.latest() != self._step:
            self.checkpoints.save(self._step, self._state(self._position))
        self.checkpoints.wait()
