"""The trainer's checkpoint store: a training state saved to a folder with orbax-checkpoint (an
optional dependency, imported when a store is made), atomic (a save killed half-way leaves the
previous checkpoint the newest complete one), asynchronous, the newest ``keep`` kept.

A state is a dict. An entry holding arrays (``params``, ``opt_state``, a PRNG key), or one that
JSON would not give back as it is (an optimizer state of empty NamedTuples, as ``optax.sgd``'s), is
a tree: its arrays go to orbax, and a JSON manifest (``_checkpoint_tree``) lists its every node
(with its type) and leaf (path, shape and dtype; Python numbers by value). A restore puts the
leaves back into the model's own tree, after naming the first node or leaf that differs. Other
entries (``step``, the data position, a key of ``None``) are stored as JSON and come back as saved.
A damaged newest checkpoint is moved aside (``<step>.damaged``, with a warning) for the one before.
"""

from __future__ import annotations

import contextlib
import itertools
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

from . import _checkpoint_tree as _tree

_INSTALL = "pip install 'mgkit[checkpoint]'"


def _orbax(where: str):
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            f"{where}: checkpoints need the optional package orbax-checkpoint, which is not installed;"
            f" install it with {_INSTALL} (or pip install 'orbax-checkpoint>=0.11')"
        ) from e
    if not _ORBAX_LOGS.folder:  # orbax logs through absl's logger
        _ORBAX_LOGS.folder = str(Path(ocp.__file__).parent)
        logging.getLogger("absl").addFilter(_ORBAX_LOGS)
    return ocp


def _has_arrays(tree: Any) -> bool:
    return any(isinstance(x, jax.Array | np.ndarray | _tree.Padded) for x in jax.tree_util.tree_leaves(tree))


def _plain(x: Any) -> Any:  # numpy scalars in JSON entries (a data position's index) as Python's
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} {x!r:.80}")


def _is_tree(value: Any) -> bool:
    """Whether a state entry is saved as a tree (its structure kept), not as JSON: it holds arrays,
    or it has numbers only but would not come back from JSON as it is (an optimizer state of
    empty NamedTuples); other entries are JSON (a data position), or are refused as not JSON-able."""
    if _has_arrays(value):
        return True
    numbers = all(isinstance(x, bool | int | float | str) for x in jax.tree_util.tree_leaves(value))
    return numbers and not _tree.is_json(value)


class _DamagedError(Exception):
    """A checkpoint folder that orbax cannot read: ``why`` says what is wrong with it."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def _damage(e: Exception) -> _DamagedError | None:
    """``e`` as a damaged checkpoint when it says that files are missing or unreadable, else None."""
    text = f"{type(e).__name__}: {e}"
    missing = isinstance(e, FileNotFoundError | KeyError | json.JSONDecodeError)
    if missing or any(code in text for code in ("NOT_FOUND", "DATA_LOSS")):
        return _DamagedError(text if len(text) <= 200 else text[:200] + "...")
    return None


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


_ORBAX_LOGS = _OrbaxLogs()


def _looks_damaged(folder: Path) -> str | None:
    """Why a step folder is not a whole checkpoint, from its files alone; None when it looks whole
    (files missing deeper down are found by the restore)."""
    if not folder.exists():  # gone since orbax listed it: nothing to set aside
        return None
    if not folder.is_dir():
        return "it is not a folder"
    meta = folder / "meta" / "metadata"
    if not meta.is_file():
        return "it holds no manifest meta/metadata" if any(folder.iterdir()) else "it is empty"
    try:
        leaves = json.loads(meta.read_text())["leaves"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest meta/metadata cannot be read: {type(e).__name__}: {e}"
    arrays = folder / "arrays"
    if any(r["kind"] not in ("node", "value") for r in leaves) and not (
        arrays.is_dir() and any(arrays.iterdir())
    ):
        return "its array files (arrays/) are missing"
    return None


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
    the next call) and leaves no orbax thread running. A damaged newest checkpoint (an empty
    step folder, its arrays gone) is moved aside to ``<step>.damaged`` with a warning, and the
    newest complete one is used. While the store works, orbax's own log records are held back:
    its errors reach the caller as the store's. A context manager: leaving it closes the store.

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
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep,
            enable_async_checkpointing=True,
            # a step folder that cannot be made fails the save here: made in the background, its
            # failure left orbax's threads of that save waiting for it for twenty minutes
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        )
        with _ORBAX_LOGS.held():
            self._manager = ocp.CheckpointManager(path, options=options)
        self._closed, self._saving = False, None

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
            with _ORBAX_LOGS.held():
                self._manager.wait_until_finished()
        except Exception as e:
            raise self._failed(step, e) from e
        finally:
            if step is not None:  # the save's own hold, taken when it started
                _ORBAX_LOGS.busy -= 1

    def _steps(self) -> list[int]:
        """The steps of the folder's checkpoints, oldest first, after setting aside a damaged newest."""
        self.wait()
        steps = sorted(self._manager.all_steps())
        while steps and (why := _looks_damaged(self.directory / str(steps[-1]))):
            self._set_aside(steps.pop(), why)
        return steps

    def _set_aside(self, step: int, why: str) -> None:
        """Renames the damaged checkpoint of ``step`` to ``<step>.damaged`` (orbax then ignores it)."""
        folder = self.directory / str(step)
        for n in itertools.count():
            aside = folder.with_name(f"{step}.damaged" + (f"-{n}" if n else ""))
            if not aside.exists():
                break
        if folder.exists():
            folder.rename(aside)
        with _ORBAX_LOGS.held():
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
        if latest is not None and step <= latest:
            raise ValueError(
                f"{self.where}: the checkpoint folder '{self.directory}' already holds step {latest}, not"
                f" older than step {step} being saved: it holds another run's checkpoints. Resume from"
                " them, or use a new folder (e.g. checkpoint='ckpt_2/'), or empty this one"
            )
        trees = {name: value for name, value in state.items() if _is_tree(value)}
        json_entries = {}
        for name in state.keys() - trees.keys():
            try:
                json_entries[name] = json.loads(json.dumps(state[name], default=_plain))
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"{self.where}: state[{name!r}] = {state[name]!r:.80} cannot be saved: {e} is not"
                    " JSON-able; use numbers, strings, lists and dicts with str keys"
                ) from None
        manifest, leaves = _tree.records(trees, self.where)
        infos = [r for r in manifest if r["kind"] != "node"]
        arrays = {
            str(i): _tree.stored(x, info["kind"])
            for i, (x, info) in enumerate(zip(leaves, infos, strict=True))
            if info["kind"] != "value"
        }
        meta = {"format": "mgkit.train 2", "json": json_entries, "trees": sorted(trees), "leaves": manifest}
        items = {"meta": self._ocp.args.JsonSave(meta)}
        if arrays:
            items["arrays"] = self._ocp.args.StandardSave(arrays)
        with _ORBAX_LOGS.held():
            try:
                self._manager.save(step, args=self._ocp.args.Composite(**items), force=True)
            except Exception as e:
                raise self._failed(step, e) from e
        _ORBAX_LOGS.busy += 1  # held until `wait` has seen the save end: its threads may log
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
                except _DamagedError as e:
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
        except _DamagedError as e:
            raise FileNotFoundError(
                f"{self.where}: the checkpoint of step {step} in '{self.directory / str(step)}' is damaged"
                f" ({e.why}); pass another of steps {steps}, or step=None for the newest complete one"
            ) from None

    def _restore(self, like: dict, step: int) -> dict:
        """The state of ``step`` in ``like``'s form; raises _DamagedError where its files are missing."""
        ocp = self._ocp
        meta = self._read(step, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        # the model's trees: those saved, and any other entry of `like` that is a tree (to name it)
        names = {*meta["trees"], *(n for n, v in like.items() if n not in meta["json"] and _is_tree(v))}
        trees = {name: like[name] for name in names if name in like}
        model, xs = _tree.records(trees, self.where)
        problem = _tree.first_difference(meta["leaves"], model)
        if problem:
            raise ValueError(
                f"{self.where}: the checkpoint of step {step} in '{self.directory}' does not fit this model:"
                f" {problem}. It belongs to a different model or optimizer: use a new checkpoint folder"
                " (e.g. checkpoint='ckpt_2/'), or build the trainer with the optimizer and the"
                " parameters it was saved from"
            )
        saved = [r for r in meta["leaves"] if r["kind"] != "node"]
        abstract = {
            str(i): _tree.abstract(x, saved[i]) for i, x in enumerate(xs) if saved[i]["kind"] != "value"
        }
        strict = not any(_tree.padded(saved[i], x) for i, x in enumerate(xs))  # else pads may differ
        got = (
            self._read(step, ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract, strict=strict)))[
                "arrays"
            ]
            if abstract
            else {}
        )
        values = [_tree.rebuild(x, saved[i], got.get(str(i))) for i, x in enumerate(xs)]
        return meta["json"] | jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(trees), values)

    def _read(self, step: int, args: Any) -> Any:
        """orbax's restore of ``args`` at ``step``; a checkpoint with missing files raises _DamagedError."""
        try:
            with _ORBAX_LOGS.held():
                return self._manager.restore(step, args=args)
        except Exception as e:
            damaged = _damage(e)
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
                with _ORBAX_LOGS.held():
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
