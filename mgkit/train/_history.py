"""What a fit did, step by step: the loss, the time and the samples per second on each context."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._table import text_table


class History:
    """The steps one fit ran (``Trainer.fit``, ``Pipeline.fit``, an ensemble member's).

    Attributes:
      step: (n,) the trainer's step number after each step (they go on from fit to fit).
      loss: (n,) the batch's mean loss at each step (NaN where the update was skipped: ``on_nan``).
      seconds: (n,) wall time of each step, from the dispatch of one to the next's.
      samples_per_second: (n,) rows per second over every context.
      contexts: the context names; ``rows``: rows each context took per step (the last batch's).
      stopped: why the fit ended early (``"interrupted"``, ``"data ran out"``, ``"nan"``), or None.
      skipped: steps whose update was not applied (a loss or gradient not finite; ``on_nan``).
      overflowed: of those, the steps skipped by ``precision="fp16"``'s loss scale (their scaled
        gradients overflowed float16; the scale was halved).
    """

    def __init__(self, contexts: tuple[str, ...]):
        self.contexts = contexts
        self.rows: tuple[int, ...] = (0,) * len(contexts)
        self._step: list[int] = []
        self._loss: list[float] = []
        self._seconds: list[float] = []
        self._samples: list[int] = []
        self.stopped: str | None = None
        self.overflowed = 0

    def append(
        self, step: int, loss: float, seconds: float, rows: tuple[int, ...], overflow: bool = False
    ) -> None:
        self.overflowed += bool(overflow)
        self._step.append(step)
        self._loss.append(loss)
        self._seconds.append(seconds)
        self._samples.append(sum(rows))
        self.rows = rows

    @property
    def step(self) -> np.ndarray:
        return np.asarray(self._step, np.int64)

    @property
    def loss(self) -> np.ndarray:
        return np.asarray(self._loss, np.float64)

    @property
    def seconds(self) -> np.ndarray:
        return np.asarray(self._seconds, np.float64)

    @property
    def samples_per_second(self) -> np.ndarray:
        seconds = self.seconds
        return np.asarray(self._samples, np.float64) / np.where(seconds > 0, seconds, np.nan)

    @property
    def skipped(self) -> int:
        """Steps whose update was not applied: those whose loss the history holds as NaN."""
        return int(np.isnan(self.loss).sum())

    @property
    def wall(self) -> float:
        """Seconds the steps took in all."""
        return float(self.seconds.sum())

    def per_context(self) -> dict[str, np.ndarray]:
        """Samples per second of each context at each step (its rows over the step's time)."""
        rate = self.samples_per_second
        share = np.asarray(self.rows, np.float64) / max(sum(self.rows), 1)
        return {name: rate * s for name, s in zip(self.contexts, share, strict=True)}

    def __len__(self) -> int:
        return len(self._step)

    def _rows(self) -> list[list[str]]:
        if not self._step:
            return []
        loss, rate = self.loss, self.samples_per_second
        warm = rate[1:] if len(rate) > 1 else rate  # the first step compiles
        return [
            [
                f"{self._step[0]}..{self._step[-1]}",
                str(len(self._step)),
                f"{loss[0]:.6g}",
                f"{loss[-1]:.6g}",
                f"{np.nanmedian(warm):,.0f}" if np.isfinite(warm).any() else "n/a",
                f"{self.wall:.3f}",
            ]
        ]

    def __repr__(self) -> str:
        note = f"; stopped: {self.stopped}" if self.stopped else ""
        if self.skipped and self.overflowed:
            why = f"{self.skipped - self.overflowed} loss not finite, {self.overflowed} fp16 overflow"
            note += f"; {self.skipped} skipped ({why})"
        elif self.skipped:
            note += f"; {self.skipped} skipped (loss not finite)"
        title = f"mgkit training history: {len(self)} step(s) on {len(self.contexts)} context(s){note}"
        headers = ["steps", "count", "first loss", "last loss", "samples/s (median)", "seconds"]
        return text_table(headers, self._rows(), title=title)

    def plot(self, ax: Any = None) -> Any:
        """The loss per step and samples per second per context, in a matplotlib figure (two
        axes side by side; ``ax``: a pair of axes to draw into). Returns the figure."""
        import matplotlib.pyplot as plt  # only when drawing

        if ax is None:
            fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
        else:
            fig = ax[0].figure
        steps = self.step
        ax[0].plot(steps, self.loss, marker=".", markersize=3, linewidth=1)
        ax[0].set(xlabel="step", ylabel="loss", title="loss")
        if len(self) and np.all(self.loss[np.isfinite(self.loss)] > 0):
            finite = self.loss[np.isfinite(self.loss)]
            if finite.size and finite.max() > 20 * finite.min():
                ax[0].set_yscale("log")
        for name, rate in self.per_context().items():
            ax[1].plot(steps[1:], rate[1:], marker=".", markersize=3, linewidth=1, label=name)
        ax[1].set(
            xlabel="step", ylabel="samples / s", title="samples per second per context (first step compiles)"
        )
        if len(self.contexts) <= 8:
            ax[1].legend(fontsize="small")
        fig.tight_layout()
        return fig
