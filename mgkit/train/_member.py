"""An ensemble's members and what a fit gives back: ``Member`` (one model, its optimizer and
data), ``MemberError`` (why one stopped), ``MemberResult`` and ``EnsembleResult``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from .._numbers import whole
from .._table import Table
from . import _data
from ._checks import (
    MissingInputError,
    check_key,
    check_loss_fn,
    check_loss_on,
    check_optimizer,
    check_params,
)
from ._history import History
from ._loop import check_on_nan


class Member:
    """One model of an ensemble: its loss, optimizer, parameters and data.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (``(scalar, aux)`` with ``has_aux``), the
        mean loss over the batch's rows (``loss_fn(params, batch, key)`` with a ``key``).
      optimizer: an optax ``GradientTransformation``.
      params: the initial parameters, a pytree of float arrays (copied onto the member's
        context: yours are never donated), or a model such as an Equinox module (its leaves
        other than arrays are held as given, as ``mg.Trainer`` holds them).
      data: arrays with rows along axis 0 (a tuple ``(X, y)``, a dict...: batched and shuffled
        by ``seed`` as ``mg.Trainer`` does), a function ``step -> batch`` or an iterable of
        batches.
      steps: the member's steps (else ``Ensemble.fit(steps=...)``'s).
      batch_size: rows per batch, for arrays (default min(rows, 256)).
      shuffle, seed: the order of array batches, per epoch (as ``mg.Trainer``'s).
      key: a PRNG key for a ``loss_fn(params, batch, key)``; step s gets ``fold_in(key, s)``.
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      on_nan: ``"raise"`` (default): a step whose loss or gradient is not finite is not
        applied, and the member stops with a ``MemberError`` naming it (the others go on, as
        ``Ensemble.fit``'s ``on_error`` says); ``"skip"``: that update is skipped and the
        member goes on (at the fit's end a ``StepsSkipped`` warning says how many).
      name: what results and views call the member (default: its context, or
        ``context/i`` where several share one).
      prefetch: batches placed ahead of the member's step by a background thread
        (``mg.Prefetch``); 0 places each batch when the step needs it.
      checkpoint, every, keep: a folder to save the member's checkpoints in, as
        ``mg.Trainer``'s (its own folder per member); ``Ensemble.fit(resume=True)`` goes on
        from the newest one.
    """

    def __init__(
        self,
        loss_fn: Callable,
        optimizer: Any,
        params: Any,
        *,
        data: Any = None,
        steps: int | None = None,
        batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        key: Any = None,
        has_aux: bool = False,
        on_nan: str = "raise",
        name: str | None = None,
        prefetch: int = 2,
        checkpoint: Any = None,
        every: int = 100,
        keep: int | None = 3,
    ):
        where = "Member" if name is None else f"Member {name!r}"
        self.loss_fn = check_loss_fn(loss_fn, where)
        self.optimizer = check_optimizer(optimizer, where)
        self.model = check_params(params, where)  # its arrays, and the leaves held as given
        self.params = params
        if data is None:
            raise MissingInputError(
                f"{where}: no data; give the member its batches, e.g. Member(loss_fn, optimizer, params, "
                "data=(X, y)), a function step -> batch, or an iterable of batches"
            )
        self.seed = whole(seed, "seed", where, lo=0, example=0)
        self.steps = None if steps is None else whole(steps, "steps", where, lo=1, example=1000)
        src = _data.source(data, batch_size, shuffle, self.seed, 1, where)  # checked now, made per fit
        self.data, self.batch_size, self.shuffle = data, batch_size, bool(shuffle)
        self.key = check_key(key, where)
        self.has_aux = bool(has_aux)
        self.on_nan = check_on_nan(on_nan, where)
        self.prefetch = whole(prefetch, "prefetch", where, lo=0, example=2, note="batches placed ahead")
        self.checkpoint, self.every, self.keep = checkpoint, every, keep  # opened by the ensemble
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"{where}: name must be a non-empty str, got {type(name).__name__} {name!r}")
        self.name = name
        self._checked = isinstance(src, _data.ArraySource)
        if self._checked:  # the loss on a batch's shapes, before anything runs
            self._check_loss(src, where)

    def _check_loss(self, src: _data.ArraySource, where: str) -> None:
        rows = src.batch_size
        batch = jax.tree_util.tree_unflatten(
            src.treedef,
            [
                jax.ShapeDtypeStruct((rows, *np.shape(x)[1:]), jax.dtypes.canonicalize_dtype(x.dtype))
                for x in src.leaves
            ],
        )
        on = f"fails on a batch of {rows} rows of data"
        check_loss_on(
            self.model.bind(self.loss_fn), self.model.arrays, batch, self.key, self.has_aux, where, on
        )

    def __repr__(self) -> str:
        fn = getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)
        steps = "" if self.steps is None else f", steps={self.steps}"
        name = "" if self.name is None else f", name={self.name!r}"
        return f"Member({fn}{steps}{name})"


class MemberError(Exception):
    """Why a member stopped: its name and context, the step that failed, the error and its
    traceback (as text). The other members went on."""

    def __init__(self, member: str, context: str, step: int, error: BaseException, trace: str):
        self.member, self.context, self.step, self.error, self.traceback = member, context, step, error, trace
        super().__init__(
            f"member {member!r} on {context} failed at step {step}: {type(error).__name__}: {error}"
        )


class MemberResult(NamedTuple):
    """One member after a fit.

    Attributes:
      name, context: the member and where it trained.
      params, opt_state: after its last completed step (the ensemble's own arrays: a later fit
        donates them; copy with ``jax.device_get`` to keep them).
      step: its steps completed over every fit; ``history``: this fit's steps (a ``History``).
      error: a ``MemberError`` (context, step, traceback) if it failed, else None.
      stopped: why it stopped early (``"error"``, ``"nan"``, ``"stopped"`` by another's error
        under ``on_error="stop_all"``, ``"interrupted"``, ``"data ran out"``), else None. A
        step whose loss was not finite counts (its update was not applied), as in a trainer.
    """

    name: str
    context: str
    params: Any
    opt_state: Any
    step: int
    history: History
    error: MemberError | None
    stopped: str | None


class EnsembleResult(Mapping, Table):
    """Member name -> ``MemberResult``; printed as a table."""

    headers = ("member", "context", "steps", "first loss", "last loss", "samples/s", "seconds", "status")

    def __init__(self, results: dict[str, MemberResult], title: str):
        self._results = results
        Table.__init__(self, [], title=title)

    def __getitem__(self, name: str) -> MemberResult:
        try:
            return self._results[name]
        except KeyError:
            raise KeyError(f"no member {name!r}; the members are {list(self._results)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._results)

    def __len__(self) -> int:
        return len(self._results)

    def _display_rows(self) -> list[tuple]:
        rows = []
        for r in self._results.values():
            h = r.history
            loss, rate = h.loss, h.samples_per_second
            warm = rate[1:] if len(rate) > 1 else rate
            status = "done" if r.stopped is None else r.stopped
            if r.error is not None:
                status = f"{r.stopped} at step {r.error.step}"
            rows.append(
                (
                    r.name,
                    r.context,
                    len(h),
                    f"{loss[0]:.6g}" if len(h) else "",
                    f"{loss[-1]:.6g}" if len(h) else "",
                    f"{np.nanmedian(warm):,.0f}" if np.isfinite(warm).any() else "n/a",
                    f"{h.wall:.3f}",
                    status,
                )
            )
        return rows
