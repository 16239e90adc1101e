"""The trainer's checkpoint store: a training state saved to a folder with orbax-checkpoint (an
optional dependency, imported when a store is made), atomic (a save killed half-way leaves the
previous checkpoint the newest complete one), asynchronous, the newest ``keep`` of mgkit's own
steps kept (another tool's steps in the folder are never touched: ``_checkpoint_steps``).

A state is a dict. An entry holding arrays (``params``, ``opt_state``, a PRNG key), or one that
JSON would not give back as it is (an optimizer state of empty NamedTuples, as ``optax.sgd``'s), is
a tree: it is written as an orbax tree item of its own name, as it is, each leaf in its own shape
(``_checkpoint_tree.written``), so plain orbax restores it with its own target tree; a JSON
record (``_checkpoint_tree``) lists its every node (with its type) and leaf (path, shape and
dtype; Python numbers by value). A restore puts the leaves back into the model's own tree, after
naming the first node or leaf that differs. Other entries (``step``, the data position, a key of
``None``, the loss scale) are stored as JSON in the item ``mgkit`` with the record, and come back
as saved. A damaged newest checkpoint is moved aside (``<step>.damaged``, with a warning) for the
one before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

from mgkit._numbers import whole
from mgkit._spmd import from_process_zero
from mgkit._stops import PreemptedError, preempted_error

from . import _checkpoint_steps as _steps
from . import _checkpoint_tree as _tree

_INSTALL = "pip install 'mgkit[checkpoint]'"


def import_orbax(where: str):
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            f"{where}: checkpoints need the optional package orbax-checkpoint, which is not installed;"
            f" install it with {_INSTALL} (or pip install 'orbax-checkpoint>=0.11')"
        ) from e
    if not ORBAX_LOGS.folder:  # orbax logs through absl's logger
        ORBAX_LOGS.folder = str(Path(ocp.__file__).parent)
        logging.getLogger("absl").addFilter(ORBAX_LOGS)
    return ocp


def _has_arrays(tree: Any) -> bool:
    return any(isinstance(x, jax.Array | np.ndarray | _tree.Padded) for x in jax.tree_util.tree_leaves(tree))


def _plain(x: Any) -> Any:  # numpy scalars in JSON entries (a data position's index) as Python's
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} {x!r:.80}")


def _item(name: str, tree: Any) -> str:
    """The orbax item a tree entry is written to: its own, or ``LEAVES`` for an entry that is one
    array (a PRNG key: orbax's tree items need a container)."""
    return _steps.LEAVES if jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(tree)) else name


def _item_tree(item: str, trees: dict) -> Any:
    """What an orbax item holds of its trees (by name): the one-array entries together, else the one tree."""
    return trees if item == _steps.LEAVES else trees[item]


def _is_tree(value: Any) -> bool:
    """Whether a state entry is saved as a tree (its structure kept), not as JSON: it holds arrays,
    or it has numbers only but would not come back from JSON as it is (an optimizer state of
    empty NamedTuples); other entries are JSON (a data position), or are refused as not JSON-able."""
    if _has_arrays(value):
        return True
    numbers = all(isinstance(x, bool | int | float | str) for x in jax.tree_util.tree_leaves(value))
    return numbers and not _tree.is_json(value)


class _OrbaxLogs(logging.Filter):
    """Holds back orbax's log records while a store works with orbax (``busy`` > 0): a failure
    reaches the caller as one mgkit error with orbax's as its cause, not as tracebacks that
    orbax's threads print."""

    def __init__(self) -> None:
        super().__init__()
        self.busy = 0
        self.folder = ""  # orbax's package folder, set when orbax is imported

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.busy and self.folder and record.pathname.startswith(self.folder))

    @contextlib.contextmanager
    def held(self):
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1


ORBAX_LOGS = _OrbaxLogs()


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
    first wait for the save in flight. A save that fails raises a RuntimeError (from ``save`` or
    the next call) and leaves no orbax thread running. A damaged newest checkpoint (its array
    files missing, cut short or garbled) is moved aside to ``<step>.damaged`` with a warning, and
    the newest complete one is used. Only mgkit's own step folders (``_checkpoint_steps``) are
    ever renamed or deleted (``keep``): another tool's steps in the folder are left as they are
    and named in a warning. While the store works, orbax's own log records are held back: its
    errors reach the caller as the store's. A context manager: leaving it closes the store.

    Each step is an orbax step folder that plain orbax reads: one item per tree entry, named by
    it (``params``, ``opt_state``), holding the tree as it is with every leaf in its own shape; the
    entries that are one array each (a PRNG key, as its key data) in the item ``mgkit_leaves``;
    and mgkit's metadata (the other entries, the trees' record) in the JSON item ``mgkit``.

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
        self._ocp = ocp = import_orbax(where)
        self.directory = path = _writable_folder(directory, where)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # pruned here, among mgkit's own steps only (orbax's counts any)
            enable_async_checkpointing=True,
            # a step folder that cannot be made fails the save here: made in the background, its
            # failure left orbax's threads of that save waiting for it for twenty minutes
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        )
        with ORBAX_LOGS.held():
            self._manager = ocp.CheckpointManager(path, options=options)
        self._closed, self._saving = False, None
        self._named: set[str] = set()  # other tools' step folders already named in a warning

    def due(self, step: int) -> bool:
        """Whether step ``step`` (after it completes) is one to save: a positive multiple of ``every``."""
        return step > 0 and step % self.every == 0

    def _failed(self, step: int | None, e: Exception) -> RuntimeError:
        return RuntimeError(
            f"{self.where}: saving the checkpoint of step {step} in '{self.directory}' failed"
            f" ({type(e).__name__}: {e}); the newest complete checkpoint is the one before it. Check the"
            " folder (free space, permissions) and save again"
        )

    def wait(self) -> None:
        """Waits for the save in flight, if any; raises a RuntimeError if it failed."""
        if self._closed:
            raise RuntimeError(
                f"{self.where}: the checkpoint store of '{self.directory}' is closed; make a new one"
            )
        step, self._saving = self._saving, None
        try:
            with ORBAX_LOGS.held():
                self._manager.wait_until_finished()
        except Exception as e:
            raise self._failed(step, e) from e
        finally:
            if step is not None:  # the save's own hold, taken when it started
                ORBAX_LOGS.busy -= 1
        if step is not None and self.keep is not None:  # the oldest of mgkit's own beyond keep
            # The step just saved counts where this process does not see it yet (in a
            # distributed fit another process finishes it). Process 0 decides for all: orbax's
            # delete is a step every process takes together, and while process 0 still renames or
            # deletes a folder, another process's listing of it can differ.
            for old in from_process_zero(sorted({*_steps.listing(self.directory).ours, step})[: -self.keep]):
                with ORBAX_LOGS.held():
                    self._manager.delete(old)

    def others(self) -> list[str]:
        """The names of the folder's entries named like steps that mgkit did not write (another
        tool's orbax steps, stray folders or files): never renamed, moved, deleted nor restored."""
        return _steps.listing(self.directory).others

    def _steps(self) -> list[int]:
        """The steps of the folder's mgkit checkpoints, oldest first, after setting aside a damaged
        newest; another tool's step folders are named in a warning (once per store) and left alone."""
        self.wait()
        steps, others = _steps.listing(self.directory)
        if new := [name for name in others if name not in self._named]:
            self._named.update(new)
            warnings.warn(
                f"{self.where}: the checkpoint folder '{self.directory}' holds {', '.join(map(repr, new))},"
                " named like steps but not written by mgkit (no readable mgkit metadata in them): they"
                " are left as they are, never restored, renamed, deleted nor counted toward keep. Give the"
                " trainer a folder of its own (checkpoint='ckpt_2/'); to start from an orbax checkpoint"
                " of parameters, see Trainer.load_orbax",
                UserWarning,
                stacklevel=4,
            )
        while steps and (why := _steps.looks_damaged(self.directory / str(steps[-1]))):
            self._set_aside(steps.pop(), why)
        return steps

    def _set_aside(self, step: int, why: str) -> None:
        """Renames mgkit's damaged checkpoint of ``step`` to ``<step>.damaged`` (orbax then ignores it)."""
        folder = self.directory / str(step)
        aside = _steps.set_aside(folder)
        with ORBAX_LOGS.held():
            self._manager.reload()
        warnings.warn(
            f"{self.where}: the checkpoint folder '{folder}' (step {step}) is damaged ({why}); it is"
            f" skipped and moved to '{aside}', and the newest complete checkpoint before it is used."
            " Delete the moved folder once you no longer need it",
            UserWarning,
            stacklevel=4,
        )

    def latest(self) -> int | None:
        """The step of the newest complete checkpoint, or None when the folder holds none."""
        steps = self._steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: dict) -> None:
        """Starts saving ``state`` as step ``step``: returns once the arrays are copied off the devices.

        ``step`` must be newer than every checkpoint in the folder (older ones belong to another run)."""
        step = whole(step, "step", f"{self.where}: saving a checkpoint", lo=0, example=100)
        _writable_folder(self.directory, self.where)  # still a folder one can write in
        latest = self.latest()
        if str(step) in self.others():
            raise ValueError(
                f"{self.where}: the checkpoint folder '{self.directory}' already holds '{step}', not written"
                f" by mgkit, where step {step} would be saved; mgkit leaves it as it is. Give the trainer a"
                " folder of its own (e.g. checkpoint='ckpt_2/')"
            )
        if latest is not None and step <= latest:
            raise ValueError(
                f"{self.where}: the checkpoint folder '{self.directory}' already holds step {latest}, not"
                f" older than step {step} being saved: it holds another run's checkpoints. Resume from"
                " them, or use a new folder (e.g. checkpoint='ckpt_2/'), or empty this one"
            )
        trees = {name: value for name, value in state.items() if _is_tree(value)}
        if taken := {_steps.MARK, _steps.LEAVES} & trees.keys():
            raise ValueError(
                f"{self.where}: state entry {taken.pop()!r} has a name the checkpoint keeps for itself"
            )
        json_entries = {}
        for name in state.keys() - trees.keys():
            try:
                json_entries[name] = json.loads(json.dumps(state[name], default=_plain))
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"{self.where}: state[{name!r}] = {state[name]!r:.80} cannot be saved: {e} is not"
                    " JSON-able; use numbers, strings, lists and dicts with str keys"
                ) from None
        manifest, _ = _tree.records(trees, self.where)
        ocp, items = self._ocp, {}
        for name, tree in trees.items():  # one orbax item per tree, the one-array trees together
            items.setdefault(_item(name, tree), {})[name] = _tree.written(tree)
        saves = {item: ocp.args.StandardSave(_item_tree(item, t)) for item, t in items.items()}
        meta = {"format": _steps.FORMAT, "json": json_entries, "trees": sorted(trees), "leaves": manifest}
        saves[_steps.MARK] = ocp.args.JsonSave(meta | {"items": sorted(items)})
        with ORBAX_LOGS.held():
            try:
                self._manager.save(step, args=ocp.args.Composite(**saves), force=True)
            except Exception as e:
                raise self._failed(step, e) from e
        ORBAX_LOGS.busy += 1  # held until `wait` has seen the save end: its threads may log
        self._saving = step

    def restore(self, like: dict, step: int | None = None) -> dict:
        """The state saved at ``step`` (default: the newest complete one), its arrays placed like ``like``'s.

        ``like`` is a state of the same form (its tree structure, and its arrays' shapes, dtypes and
        shardings are used, not their values): the state comes back in ``like``'s tree structure.
        Raises FileNotFoundError when there is no such checkpoint or it is damaged, ValueError when
        the checkpoint's trees differ from ``like``'s (naming the first node or leaf that differs).
        With ``step=None`` a damaged newest checkpoint is set aside (a warning) for the one before."""
        steps = self._steps()
        if step is None:
            while steps:
                try:
                    return self._restore(like, steps[-1])
                except _steps.DamagedError as e:
                    self._set_aside(steps.pop(), e.why)
            raise FileNotFoundError(
                f"{self.where}: no complete checkpoint in '{self.directory}': the folder is empty or"
                " holds only unfinished or damaged saves; start without resuming, or point to the folder"
                " that holds the checkpoints"
            )
        step = whole(
            step, "step", f"{self.where}: restoring a checkpoint", lo=0, example=steps[-1] if steps else 1
        )
        if step not in steps:
            raise FileNotFoundError(
                f"{self.where}: no complete checkpoint of step {step} in '{self.directory}'; it holds"
                f" steps {steps}: pass one of them, or step=None for the newest"
            )
        try:
            return self._restore(like, step)
        except _steps.DamagedError as e:
            raise FileNotFoundError(
                f"{self.where}: the checkpoint of step {step} in '{self.directory / str(step)}' is damaged"
                f" ({e.why}); pass another of steps {steps}, or step=None for the newest complete one"
            ) from None

    def _restore(self, like: dict, step: int) -> dict:
        """The state of ``step`` in ``like``'s form; raises DamagedError where its files are damaged."""
        meta = _steps.metadata(self.directory / str(step))
        if meta is None:  # gone or garbled since the folder was listed
            raise _steps.DamagedError(f"its metadata {_steps.MARK}/metadata cannot be read")
        if _steps.old_format(meta):
            raise ValueError(
                f"{self.where}: the checkpoint of step {step} in '{self.directory}' is of an earlier mgkit"
                f" format ({meta.get('format')!r}, its arrays a numbered list), which this version does not"
                f" read (it reads {_steps.FORMAT!r}); resume it with the mgkit version that wrote it, or"
                " start a new checkpoint folder (e.g. checkpoint='ckpt_2/')"
            )
        # the model's trees: those saved, and any other entry of `like` that is a tree (to name it)
        names = {*meta["trees"], *(n for n, v in like.items() if n not in meta["json"] and _is_tree(v))}
        trees = {name: like[name] for name in names if name in like}
        model, _ = _tree.records(trees, self.where)
        problem = _tree.first_difference(meta["leaves"], model)
        if problem:
            raise ValueError(
                f"{self.where}: the checkpoint of step {step} in '{self.directory}' does not fit this model:"
                f" {problem}. It belongs to a different model or optimizer: use a new checkpoint folder"
                " (e.g. checkpoint='ckpt_2/'), or build the trainer with the optimizer and the"
                " parameters it was saved from"
            )
        saved = iter([r for r in meta["leaves"] if r["kind"] != "node"])
        records = {
            name: [next(saved) for _ in jax.tree_util.tree_leaves(trees[name])] for name in sorted(trees)
        }
        got = self._read_trees(step, trees, records)
        back = {}
        for name, tree in trees.items():
            leaves, structure = jax.tree_util.tree_flatten(tree)
            back[name] = structure.unflatten(map(_tree.rebuild, leaves, records[name], got[name]))
        return meta["json"] | back

    def _read_trees(self, step: int, trees: dict, records: dict) -> dict[str, list]:
        """Each tree's leaves as orbax reads them at ``step``, in flattening order (None where
        the record holds the leaf: a Python number); arrays placed like the model's."""
        ocp, restores, strict = self._ocp, {}, {}
        for name, tree in trees.items():
            leaves = jax.tree_util.tree_leaves(tree)
            if all(r["kind"] == "value" for r in records[name]):
                continue  # nothing to read: no item, or one without arrays
            target = jax.tree_util.tree_structure(tree).unflatten(map(_tree.target, leaves, records[name]))
            item = _item(name, tree)
            restores.setdefault(item, {})[name] = target
            # padded leaves are read into their padding (the records matched: shapes are checked)
            strict[item] = strict.get(item, True) and not any(isinstance(x, _tree.Padded) for x in leaves)
        args = {
            item: ocp.args.StandardRestore(_item_tree(item, t), strict=strict[item])
            for item, t in restores.items()
        }
        read = self._read(step, ocp.args.Composite(**args)) if args else {}
        got = {}
        for name, tree in trees.items():
            item = _item(name, tree)
            if item not in restores:  # nothing read: the records hold every leaf
                got[name] = [None] * len(records[name])
                continue
            back = read[item][name] if item == _steps.LEAVES else read[item]
            got[name] = jax.tree_util.tree_structure(tree).flatten_up_to(back)  # a string's None kept
        return got

    def _read(self, step: int, args: Any) -> Any:
        """orbax's restore of ``args`` at ``step``; a checkpoint with missing or garbled files raises
        _steps.DamagedError."""
        try:
            with ORBAX_LOGS.held():
                return self._manager.restore(step, args=args)
        except Exception as e:
            damaged = _steps.damage(e, self.directory / str(step))
            if damaged is None:
                raise
            raise damaged from e

    def close(self) -> None:
        """Waits for the save in flight and releases orbax's resources; closing twice is fine."""
        if not self._closed:
            try:
                self.wait()
            finally:
                self._closed = True
                with ORBAX_LOGS.held():
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
            elif others := self.checkpoints.others():  # resuming meant one of these: say so
                raise FileNotFoundError(
                    f"{where}: resume=True, and the checkpoint folder '{self.checkpoints.directory}' holds"
                    f" no mgkit checkpoint, only {', '.join(map(repr, others))}, not written by mgkit (left"
                    f" as they are). To start from an orbax checkpoint of parameters, call"
                    f" {type(self).__name__.lower()}.load_orbax(folder) before fit; to start afresh, pass"
                    " resume=False or give the trainer a folder of its own"
                )
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

    def _preempted(self, where: str, by: int | None) -> PreemptedError:
        """After a fit every rank stopped for a preemption: the state saved (where the trainer
        has a checkpoint folder), and the error that says so."""
        what, _ = self._what()
        saved = None
        if self.checkpoints is not None:
            self.save()
            saved = str(self.checkpoints.directory)
        return preempted_error(where, by, self._step, saved, what)

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
