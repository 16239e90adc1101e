"""A fit's batches, as every trainer takes them: asked of the data source by step number,
placed on the contexts ahead of the step by a background thread (``mg.Prefetch``) unless
``prefetch=0``, each with the data position after it. Arrays that mgkit batches go on, fit
after fit, where the last fit stopped (the same arrays batched alike); other data's batches are
each checked on the host against the first (``_data.BatchCheck``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._prefetch import Prefetch
from . import _data
from ._loop import Interrupts


class Feed:
    """The batches of one fit.

    Args:
      src: the data source (``_data.source``).
      total: the most batches to ask of it (None: until it ends).
      first: the step number of the first batch (a function source is asked by step).
      place: ``place(batch, own) -> placed``: the batch laid out for the step (``own``: arrays
        mgkit made for this batch, placed without a private copy).
      prefetch: batches placed ahead by a background thread; 0: each when the step needs it.
      resume_at: where the last fit of these arrays stopped (a position), or None.
      where: what fits (``"Trainer.fit"``), in messages about a batch unlike the first.
    """

    def __init__(
        self,
        src: Any,
        total: int | None,
        first: int,
        place: Callable[[Any, bool], Any],
        prefetch: int,
        resume_at: dict | None,
        where: str,
    ):
        self.arrays = isinstance(src, _data.ArraySource)
        if self.arrays and resume_at is not None:
            same = (resume_at.get("batch_size"), resume_at.get("rows"), resume_at.get("seed"))
            if same == (src.batch_size, src.rows, src.seed):  # the same arrays, batched alike: go on
                src.seek(resume_at)
        self.start = dict(src.position)  # where this fit's data begins (the loader reads ahead of it)
        self.after: dict | None = None  # the position after the last batch a step took
        check = None if self.arrays else _data.BatchCheck(where)  # mgkit's own batches are alike

        def batches():
            i = 0
            while total is None or i < total:
                try:
                    batch = src.next(first + i)
                except StopIteration:
                    return
                if check is not None:
                    check(batch, first + i)
                yield batch, dict(src.position)
                i += 1

        def placed(item: tuple) -> tuple:
            batch, position = item
            return place(batch, self.arrays), position

        if prefetch == 0:
            self._batches: Any = (placed(item) for item in batches())
        else:
            self._batches = Prefetch(batches(), placed, prefetch, where="fit")

    def take(self, stop: Interrupts) -> tuple[Any, dict]:
        """The next placed batch and the data position after it; StopIteration at the data's
        end, KeyboardInterrupt where Ctrl-C comes while it waits for the loader."""
        if isinstance(self._batches, Prefetch):
            return self._batches.take(lambda: stop.urgent)
        return next(self._batches)

    def close(self) -> dict | None:
        """Stops the loader; returns where the next fit of these arrays goes on (None for other
        data)."""
        if isinstance(self._batches, Prefetch):
            self._batches.close()
        return (self.after or self.start) if self.arrays else None
