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


def _leaves(tree: Any, where: str) -> list[tuple[tuple[str, ...], Any, dict]]:
    """Each leaf of a trainer's tree: (its path as names, the leaf, its record: kind, own shape, dtype)."""
    infos = [r for r in _tree.records({"": tree}, where)[0] if r["kind"] != "node"]
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(_names(path), x, info) for (path, x), info in zip(paths, infos, strict=True)]


def first_difference(entry: str, ours: list, saved: Any) -> str | None:
    """Where the trainer's leaves ``ours`` (``_leaves``) and orbax's metadata tree ``saved`` first
    differ (a leaf missing on one side, or of another shape or dtype), in words; None when they match."""
    theirs = {
        _names(path): (tuple(getattr(m, "shape", ())), getattr(m, "dtype", None))
        for path, m in jax.tree_util.tree_flatten_with_path(saved)[0]
    }
    for names, _, info in ours:
        if names not in theirs:
            return f"{_shown(entry, names)} ({_tree.describe(info)}) is not in the checkpoint"
        shape, dtype = theirs.pop(names)
        if info["kind"] == "value":  # a Python number: its value is read
            continue
        if shape != tuple(info["shape"]) or (dtype is not None and str(np.dtype(dtype)) != info["dtype"]):
            saved_info = info | {"shape": list(shape), "dtype": str(np.dtype(dtype or info["dtype"]))}
            return (
                f"{_shown(entry, names)} is {_tree.describe(saved_info)} in the checkpoint but"
                f" {_tree.describe(info)} in the trainer"
            )
    if theirs:
        names, (shape, dtype) = next(iter(theirs.items()))
        rest = f"(shape {shape}, dtype {dtype}) is in the checkpoint but not in the trainer"
        return f"{_shown(entry, names)} {rest}"
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
        restores, leaves = {}, {}
        for entry, item in items.items():
            with ORBAX_LOGS.held():
                saved = ocp.StandardCheckpointHandler().metadata(path / str(step) / item).tree
            leaves[entry] = _leaves(like[entry], where)
            problem = first_difference(entry, leaves[entry], saved)
            if problem:
                raise ValueError(
                    f"{where}: the orbax checkpoint item {item!r} of step {step} in '{path}' does not fit the"
                    f" trainer's {entry}: {problem}. Build the trainer with the model (and optimizer) the"
                    " checkpoint was saved from"
                )
            structure = jax.tree_util.tree_structure(like[entry])
            target = structure.unflatten(_tree.target(x, info) for _, x, info in leaves[entry])
            padded = any(isinstance(x, _tree.Padded) for _, x, _ in leaves[entry])
            restores[item] = ocp.args.StandardRestore(target, strict=not padded)  # shapes checked
        with ORBAX_LOGS.held():
            if list(restores) == ["default"]:  # a single-item manager's: its args not a Composite
                read_back = {"default": manager.restore(step, args=restores["default"])}
            else:
                read_back = manager.restore(step, args=ocp.args.Composite(**restores))
    finally:
        manager.close()
    out = {}
    for entry, item in items.items():
        structure = jax.tree_util.tree_structure(like[entry])
        got = structure.flatten_up_to(read_back[item])
        out[entry] = structure.unflatten(
            _tree.rebuild(x, info, g) for (_, x, info), g in zip(leaves[entry], got, strict=True)
        )
    return step, out
