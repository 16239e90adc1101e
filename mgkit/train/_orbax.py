"""Reading a user's own orbax checkpoint into a trainer's state (``Trainer.load_orbax``): a step
folder written by ``ocp.CheckpointManager`` with tree items (``ocp.args.StandardSave``), each
item read straight into the trainer's layout (split leaves each context's part, padded leaves
into their padding), after its shapes and dtypes are checked against the trainer's trees.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from . import _checkpoint_tree as _tree
from ._checkpoint import ORBAX_LOGS, import_orbax


def _names(path: tuple) -> tuple[str, ...]:
    """A key path as plain names, as orbax names a tree's nodes (a NamedTuple's field, a dict's
    key, a sequence's index): the same for a trainer's tree and orbax's metadata of it."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return tuple(out)


def _shown(entry: str, path: tuple) -> str:
    return entry + "".join(f"[{n!r}]" if not n.isdigit() else f"[{n}]" for n in path)


def _leaf(shape: Any, dtype: Any) -> str:
    return f"shape {tuple(shape)} and dtype {np.dtype(dtype)}"


def first_difference(entry: str, like: Any, saved: Any) -> str | None:
    """Where the trainer's tree ``like`` and orbax's metadata tree ``saved`` of it first differ
    (a leaf missing on one side, or of another shape or dtype), in words; None when they match."""
    ours = []
    for path, x in jax.tree_util.tree_flatten_with_path(like)[0]:
        shape = x.shape if isinstance(x, _tree.Padded) else np.shape(x)
        dtype = (x.array if isinstance(x, _tree.Padded) else x).dtype if hasattr(x, "dtype") else type(x)
        ours.append((_names(path), tuple(shape), dtype))
    theirs = {
        _names(path): (tuple(getattr(m, "shape", ())), getattr(m, "dtype", None))
        for path, m in jax.tree_util.tree_flatten_with_path(saved)[0]
    }
    for names, shape, dtype in ours:
        if names not in theirs:
            return f"{_shown(entry, names)} (an array of {_leaf(shape, dtype)}) is not in the checkpoint"
        got_shape, got_dtype = theirs.pop(names)
        if got_shape != shape or (got_dtype is not None and np.dtype(got_dtype) != np.dtype(dtype)):
            return (
                f"{_shown(entry, names)} is an array of {_leaf(got_shape, got_dtype or dtype)} in the"
                f" checkpoint but of {_leaf(shape, dtype)} in the trainer"
            )
    if theirs:
        names, (shape, dtype) = next(iter(theirs.items()))
        rest = f"(an array of {_leaf(shape, dtype)}) but not in the trainer"
        return f"{_shown(entry, names)} is in the checkpoint {rest}"
    return None


def _step_folder(ocp: Any, path: Path, step: Any, where: str) -> tuple[Any, int]:
    """orbax's manager of the folder (read only) and the step to read (default: the newest)."""
    manager = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(read_only=True))
    steps = sorted(manager.all_steps())
    if step is None and steps:
        return manager, steps[-1]
    if step not in steps:
        manager.close()
        what = f"step {step}" if step is not None else "step"
        raise FileNotFoundError(
            f"{where}: no orbax checkpoint {what} in '{path}' (it holds steps {steps}); pass the folder"
            " given to ocp.CheckpointManager, and step=None for its newest step or one of its steps"
        )
    return manager, step


def read(directory: str | os.PathLike, step: int | None, items: dict, like: dict, where: str) -> tuple:
    """The trees ``items`` names (trainer entry -> orbax item) read from the orbax checkpoint of
    ``step`` in ``directory``, laid out like ``like``'s trees: (step, {entry: tree}).

    Raises FileNotFoundError for a missing folder, step or item (naming those there are),
    ValueError naming the first leaf whose path, shape or dtype differs from the trainer's."""
    ocp = import_orbax(where)
    path = Path(directory).expanduser().absolute()
    if not path.is_dir():
        raise FileNotFoundError(
            f"{where}: '{path}' is not a folder; pass the folder of an orbax CheckpointManager"
        )
    with ORBAX_LOGS.held():
        manager, step = _step_folder(ocp, path, step, where)
    try:
        there = sorted(p.name for p in (path / str(step)).iterdir() if p.is_dir())
        for entry, item in items.items():
            if item not in there:
                raise FileNotFoundError(
                    f"{where}: the orbax checkpoint of step {step} in '{path}' has no item {item!r} (its"
                    f" items: {there}); pass {entry}= the name the tree was saved under"
                )
        restores = {}
        for entry, item in items.items():
            with ORBAX_LOGS.held():
                saved = ocp.StandardCheckpointHandler().metadata(path / str(step) / item).tree
            problem = first_difference(entry, like[entry], saved)
            if problem:
                raise ValueError(
                    f"{where}: the orbax checkpoint item {item!r} of step {step} in '{path}' does not fit the"
                    f" trainer's {entry}: {problem}. Build the trainer with the model (and optimizer) the"
                    " checkpoint was saved from"
                )
            target = jax.tree_util.tree_map(_target, like[entry])
            padded = any(isinstance(x, _tree.Padded) for x in jax.tree_util.tree_leaves(like[entry]))
            restores[item] = ocp.args.StandardRestore(target, strict=not padded)  # shapes checked
        with ORBAX_LOGS.held():
            read_back = manager.restore(step, args=ocp.args.Composite(**restores))
    finally:
        manager.close()
    out = {}
    for entry, item in items.items():
        leaves, structure = jax.tree_util.tree_flatten(like[entry])
        got = structure.flatten_up_to(read_back[item])
        pad = lambda x, g: _tree.Padded(g, x.shape) if isinstance(x, _tree.Padded) else g  # noqa: E731
        out[entry] = structure.unflatten(map(pad, leaves, got))
    return step, out


def _target(x: Any) -> Any:
    """What orbax reads a trainer's leaf into: its (stored) shape, dtype and sharding."""
    if isinstance(x, _tree.Padded):
        return jax.ShapeDtypeStruct(x.array.shape, x.array.dtype, sharding=x.array.sharding)
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x
