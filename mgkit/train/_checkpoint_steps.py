"""Which step folders of a checkpoint folder mgkit wrote, and whether one of them is damaged.

A step folder is mgkit's when it holds mgkit's metadata item (``<step>/mgkit/metadata``, JSON
with ``"format": "mgkit.train ..."``), written with the step's other items and committed with
them by orbax's rename: a step folder without it (a user's own orbax step, a folder or file
that only has a step's name) is another tool's, and mgkit never renames, moves or deletes it,
nor counts it toward ``keep``. Checkpoints of the earlier format (``<step>/meta/metadata``)
are mgkit's too: they are kept and pruned, and a restore refuses them with a clear message.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import NamedTuple

FORMAT = "mgkit.train 3"  # the format this version writes and reads
MARK = "mgkit"  # the item that holds mgkit's metadata: its presence marks a step as mgkit's
LEAVES = "mgkit_leaves"  # the item of entries that are one array each (a PRNG key's data)
_OLD_MARK = "meta"  # the metadata item of format "mgkit.train 2" (arrays as a numbered list)
# tensorstore's codes for files that are missing, cut short or garbled
_DAMAGE_CODES = ("NOT_FOUND", "DATA_LOSS", "OUT_OF_RANGE", "FAILED_PRECONDITION", "INVALID_ARGUMENT")


class Listing(NamedTuple):
    """The entries of a checkpoint folder that are named like steps."""

    ours: list[int]  # the steps of mgkit's step folders, oldest first
    others: list[str]  # the names of the rest (another tool's steps, stray folders or files)


def metadata(folder: Path) -> dict | None:
    """mgkit's metadata of a step folder, or None when the folder is not mgkit's (or has no
    readable metadata: then mgkit does not know it as its own, and leaves it alone)."""
    for mark in (MARK, _OLD_MARK):
        try:
            meta = json.loads((folder / mark / "metadata").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and str(meta.get("format", "")).startswith("mgkit.train"):
            return meta
    return None


def listing(directory: Path) -> Listing:
    """The step-named entries of ``directory``: mgkit's steps and the others' names."""
    ours, others = [], []
    if not directory.is_dir():  # gone or replaced: the save or restore that needs it says so
        return Listing([], [])
    for entry in directory.iterdir():
        if re.fullmatch(r"[0-9]+", entry.name):
            if entry.is_dir() and metadata(entry) is not None:
                ours.append(int(entry.name))
            else:
                others.append(entry.name)
    return Listing(sorted(ours), sorted(others, key=int))


def looks_damaged(folder: Path) -> str | None:
    """Why one of mgkit's step folders is not a whole checkpoint, from its files alone; None when it
    looks whole (files missing or garbled deeper down are found by the restore)."""
    if not folder.exists():  # gone since it was listed: nothing to set aside
        return None
    meta = metadata(folder) or {}
    for item in meta.get("items", []):
        if not (folder / item).is_dir() or not any((folder / item).iterdir()):
            return f"its array files ({item}/) are missing"
    return None


class DamagedError(Exception):
    """A checkpoint folder that orbax cannot read: ``why`` says what is wrong with it."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def damage(e: BaseException | None, folder: Path) -> DamagedError | None:
    """``e`` as a damaged checkpoint when it says that files of ``folder`` are missing, cut short
    or garbled (tensorstore's codes for that, naming a file in the folder), else None: an error
    that says nothing of the files (out of memory, a device error) never marks a step damaged."""
    while e is not None:  # orbax wraps tensorstore's error: look at each cause
        text = f"{type(e).__name__}: {e}"
        missing = isinstance(e, FileNotFoundError | KeyError | json.JSONDecodeError)
        garbled = (
            any(text.startswith(f"ValueError: {code}") for code in _DAMAGE_CODES) and str(folder) in text
        )
        if missing or garbled or "DATA_LOSS" in text:
            return DamagedError(text if len(text) <= 200 else text[:200] + "...")
        e = e.__cause__ or e.__context__
    return None


def set_aside(folder: Path) -> Path:
    """Renames one of mgkit's damaged step folders ``<step>`` to ``<step>.damaged`` (``-1``, ``-2``,
    ... when taken); returns the new name. Only called for folders ``listing`` counts as mgkit's."""
    for n in itertools.count():
        aside = folder.with_name(f"{folder.name}.damaged" + (f"-{n}" if n else ""))
        if not aside.exists():
            break
    if folder.exists():
        folder.rename(aside)
    return aside


def old_format(meta: dict) -> bool:
    """Whether mgkit's metadata is of a format this version does not read."""
    return meta.get("format") != FORMAT
