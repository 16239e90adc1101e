"""``mg.Trainer``: one model trained on many contexts with an optax optimizer."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

from .. import _progress
from .._numbers import whole
from .._spmd import Communication, Targets, Watch, communication, resolve, sharding, shares
from . import _data
from ._checkpoint import Checkpointing, Checkpoints
from ._checks import check_key, check_loss_fn, check_loss_on, check_optimizer, check_params
from ._feed import Feed
from ._history import History
from ._loop import Fit, check_on_nan, not_finite, reads_late
from ._step import LoopStep, StepOut, copied, place_parts, place_spmd_batch, spmd_step

_WHERE = "Trainer"


class Trainer(Checkpointing):
    """Trains one model on every context in the map (or ``contexts``) with an optax optimizer.

    >>> import mgkit as mg, optax, jax.numpy as jnp, numpy as np
    >>> _ = mg.use_contexts("a->cpu0;b->cpu1", verbose=False)
    >>> def loss_fn(p, batch):
    ...     return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)
    >>> X = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    >>> data = {"x": X, "y": X @ np.array([1.0, -2.0, 0.5], np.float32)}
    >>> tr = mg.Trainer(loss_fn, optax.sgd(0.1), {"w": jnp.zeros(3)})
    >>> hist = tr.fit(data, steps=200, batch_size=16, progress=False)
    >>> np.round(np.asarray(tr.params["w"]), 2).tolist(), tr.step
    ([1.0, -2.0, 0.5], 200)

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``: the mean loss over the batch's rows (or
        ``(scalar, aux)`` with ``has_aux=True``; aux is averaged over the contexts' rows).
      optimizer: an optax ``GradientTransformation`` (``optax.adamw(1e-3)``...).
      params: the initial parameters, any pytree of float arrays (copied: the trainer's own
        arrays are donated to each step, never yours), or a model that is a pytree, such as an
        Equinox module: its other leaves (functions, strings, objects) are held as given,
        neither placed nor differentiated, as ``eqx.partition(model, eqx.is_array)`` does.
      contexts: context names, a count (the first n) or None for every context in the map.
        Distinct devices of one kind run one SPMD program per step; contexts that share a
        device or mix kinds run the gather-update-copy loop (see ``mgkit.train``).
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      on_nan: ``"raise"`` (default): a step whose loss or gradient is not finite is not
        applied, and the fit stops with an error naming it; ``"skip"``: that update is skipped
        and the fit goes on (at its end a ``StepsSkipped`` warning says how many).
      seed: the seed of the data order (arrays mgkit batches are shuffled by (seed, epoch)).
      balance: None (parts of equal rows) or ``"measured"`` (the gather-update-copy loop only:
        parts in proportion to each context's measured speed, as ``mg.parallel`` does).
      key: a PRNG key (``jax.random.key(0)``) for a ``loss_fn(params, batch, key)`` that draws
        random numbers (dropout): step s gets ``jax.random.fold_in(key, s)``, so a resumed run
        draws what an uninterrupted one would. None (default): ``loss_fn(params, batch)``.
      checkpoint: a folder to save checkpoints in, with orbax-checkpoint
        (``pip install 'mgkit[checkpoint]'``): parameters, optimizer state, step, key and data
        position, every ``every`` steps, the newest ``keep`` kept; ``fit(..., resume=True)``
        goes on from the newest one.
      prefetch: batches placed ahead of the step by a background thread (``mg.Prefetch``); 0
        places each batch when the step needs it.

    Attributes ``params``, ``opt_state`` and ``step`` are always those of the last completed
    step; ``history`` is the last fit's ``History``.
    """

    def __init__(
        self,
        loss_fn: Callable,
        optimizer: Any,
        params: Any,
        *,
        contexts: Any = None,
        has_aux: bool = False,
        on_nan: str = "raise",
        seed: int = 0,
        balance: str | None = None,
        key: Any = None,
        checkpoint: Any = None,
        every: int = 100,
        keep: int | None = 3,
        prefetch: int = 2,
    ):
        check_loss_fn(loss_fn, _WHERE)
        check_optimizer(optimizer, _WHERE)
        check_on_nan(on_nan, _WHERE)
        if balance not in (None, "measured"):
            raise ValueError(f"{_WHERE}: balance={balance!r}; use None (equal parts) or 'measured'")
        self._model = check_params(params, _WHERE)
        self._loss = self._model.bind(loss_fn)  # loss_fn of the model's arrays
        self.loss_fn, self.optimizer, self.has_aux = loss_fn, optimizer, bool(has_aux)
        self.on_nan, self.balance = on_nan, balance
        self.seed = whole(seed, "seed", _WHERE, lo=0, example=0)
        self.prefetch = whole(prefetch, "prefetch", _WHERE, lo=0, example=2, note="batches placed ahead")
        self._key = check_key(key, _WHERE)
        self.targets: Targets = resolve(contexts, _WHERE)
        self.spmd = self.targets.spmd
        devices = self.targets.devices
        self._step = 0
        self._position: dict | None = None
        self.history: History | None = None
        self._checked: set = set()
        if self.spmd:
            self._params = copied(self._model.arrays, sharding(devices))
            self._opt = jax.jit(optimizer.init, out_shardings=sharding(devices))(self._params)
            self._program = spmd_step(self._loss, optimizer, self.has_aux, devices)
            self._replicas: list = []
            self._collectives: Watch | None = Watch(self.targets.contexts, "Trainer step")
        else:
            first = jax.sharding.SingleDeviceSharding(devices[0])
            self._params = copied(self._model.arrays, first)
            self._opt = jax.jit(optimizer.init, out_shardings=first)(self._params)
            self._program = LoopStep(self._loss, optimizer, self.has_aux, self.targets)
            self._replicas = self._copies(self._params)
            self._collectives = None
        self._weights: tuple[float, ...] | None = None
        self.checkpoints: Checkpoints | None = None
        if checkpoint is not None:
            self.checkpoints = Checkpoints(checkpoint, every=every, keep=keep, where=_WHERE)

    # -- state -------------------------------------------------------------------------------

    @property
    def params(self) -> Any:
        """The parameters after the last completed step (the trainer's own arrays: the next fit
        donates them, so copy them, e.g. ``jax.device_get``, to keep a snapshot). A model with
        leaves other than arrays (an Equinox module's activation) comes back with them as given."""
        return self._model.join(self._params)

    @property
    def opt_state(self) -> Any:
        """The optimizer state after the last completed step (of the model's arrays, as
        ``optimizer.init(eqx.filter(model, eqx.is_array))`` would make it)."""
        return self._opt

    @property
    def step(self) -> int:
        """Steps completed, over every fit."""
        return self._step

    @property
    def contexts(self) -> tuple[str, ...]:
        return self.targets.names

    @property
    def step_fn(self) -> Callable:
        """The compiled step, for a loop of one's own: ``step_fn(params, opt_state, batch,
        key=None)`` splits the batch over the contexts (recorded in the ledger), runs one step
        and returns ``StepOut(params, opt_state, loss, ok, aux)``. It donates ``params`` and
        ``opt_state`` (use the returned ones); ``ok`` is False where the update was skipped
        (a loss or gradient not finite). The trainer's own state is not touched."""
        k = len(self.targets.contexts)

        def step_fn(params: Any, opt_state: Any, batch: Any, key: Any = None) -> StepOut:
            leaves, treedef, n = _data.check_batch(batch, "Trainer.step_fn", "the batch")
            arrays = self._model.arrays_of(params, "Trainer.step_fn", "params")
            if self.spmd:
                even, rest, _ = place_spmd_batch(leaves, treedef, self.targets, own=False)
                out = self._program(arrays, opt_state, even, rest, key)
            else:
                sizes = shares(n, k, self._weights)
                parts = place_parts(leaves, treedef, self.targets, sizes)
                out = self._program(self._copies(arrays), opt_state, parts, sizes, key)[1]
            return out._replace(params=self._model.join(out.params))

        return step_fn

    def communication(self) -> Communication:
        """What the compiled step communicates per step, read from the program XLA compiled
        (the last one run): bytes per collective op, bytes sent per context, and the step's
        arithmetic intensity (flops per context over bytes it sends). Each step's collectives
        are also in the ledger (``collective`` events). Ask after a step has run."""
        why = "these contexts run the gather-update-copy loop, not one compiled program; its moves are "
        why += "the ledger's gather and replicate events (mg.ledger().summary())"
        return communication(self._collectives, "Trainer.communication()", why)

    def __repr__(self) -> str:
        path = "one SPMD program per step" if self.spmd else "gather-update-copy loop (per-context gradients)"
        return (
            f"Trainer({len(self.contexts)} context(s): {', '.join(self.contexts)}; {path}; step {self._step})"
        )

    def _copies(self, params: Any) -> list:
        leaves, treedef = jax.tree_util.tree_flatten(params)
        first = self.targets.contexts[0]
        out = [params]
        for ctx in self.targets.contexts[1:]:
            if ctx.device == first.device:
                out.append(params)
            else:
                copies = [jax.device_put(x, ctx.device) for x in leaves]
                out.append(jax.tree_util.tree_unflatten(treedef, copies))
        return out

    # -- one step ----------------------------------------------------------------------------

    def _place(self, batch: Any, own: bool) -> tuple[tuple, tuple[int, ...]]:
        """A batch laid out for the step: (the step's batch arguments, rows per context)."""
        k = len(self.targets.contexts)
        leaves, treedef, n = _data.check_batch(batch, "Trainer.fit", "the batch")
        if self.spmd:
            even, rest, rows = place_spmd_batch(leaves, treedef, self.targets, own)
            return (even, rest), rows
        sizes = shares(n, k, self._weights)
        return (place_parts(leaves, treedef, self.targets, sizes), sizes), sizes

    def _dispatch(self, placed: tuple) -> StepOut:
        """Runs one step and keeps its results at once: nothing can come between the donation
        of the old state and keeping the new one (Ctrl-C is only noted during a fit)."""
        key = None if self._key is None else jax.random.fold_in(self._key, self._step + 1)
        if self.spmd:
            args = (self._params, self._opt, *placed, key)
            out = self._collectives.run(self._program, args, placed, {"step": self._step + 1})
            self._params, self._opt = out.params, out.opt_state
        else:
            replicas, out = self._program(self._replicas, self._opt, *placed, key)
            self._replicas, self._params, self._opt = replicas, out.params, out.opt_state
        self._step += 1
        return out

    def _check_loss(self, placed: tuple) -> None:
        """The loss function's output, from shapes only (before anything compiles or runs)."""
        batch = (placed[0] if placed[0] is not None else placed[1]) if self.spmd else placed[0][0]
        structure = jax.tree_util.tree_structure(batch)
        if structure not in self._checked:
            check_loss_on(
                self._loss,
                self._params,
                batch,
                self._key,
                self.has_aux,
                _WHERE,
                "failed on the first batch",
            )
            self._checked.add(structure)

    # -- fitting -----------------------------------------------------------------------------

    def fit(
        self,
        data: Any,
        steps: int | None = None,
        *,
        batch_size: int | None = None,
        shuffle: bool = True,
        epochs: int | None = None,
        resume: bool = False,
        progress: bool | None = None,
    ) -> History:
        """Trains for ``steps`` steps (or ``epochs`` passes over arrays) and returns a ``History``.

        Args:
          data: arrays with rows along axis 0 (an array, a dict or tuple pytree: mgkit batches
            them, shuffled per epoch by the trainer's seed, and a later fit goes on where this
            one stopped); a function ``step -> batch`` (given the step number, from 1); or an
            iterable of batches (a list, a generator), which may end early: the fit then stops
            with a warning, state kept. A list is read from its start by each fit; an iterator
            (a generator) goes on where the last fit left it, less the batches its loader had
            read ahead (up to ``prefetch`` + 1) when a fit stops early (Ctrl-C, a NaN): for
            data whose position is kept across fits and checkpoints, give arrays or a function.
            Every batch needs the first's structure, and per leaf its dtype and shape but for
            the row count; a batch with fewer rows than contexts (a loader's short last batch)
            trains exactly. A list of arrays with one row count but not one shape and dtype
            (``[X, y]``) is the data set ``(X, y)``; an empty iterable warns ``DataRanOut``.
          steps: steps to run (default: one epoch of arrays; required for a function). With
            ``resume=True``, the steps of the whole run: a run restored at step s runs
            ``steps - s`` more, so the same call re-run after a crash finishes the same run.
          batch_size: rows per batch, for arrays (default min(rows, 256)).
          shuffle: shuffle arrays each epoch (else in order).
          epochs: passes over arrays, instead of ``steps`` (with ``resume=True``, of the run).
          resume: first restore the newest checkpoint in the trainer's ``checkpoint`` folder
            (parameters, optimizer state, step, key and data position); without one, start
            from the trainer's state. The run then gives the parameters an uninterrupted one
            would, bit for bit.
          progress: None: a progress bar once the fit has run a second; True: at once; False: never.

        Ctrl-C (the notebook's Stop button) stops at the next step boundary: ``params``,
        ``opt_state`` and ``step`` are those of the last completed step, ``history`` holds the
        steps run, and KeyboardInterrupt is raised. A later ``fit`` goes on from there.
        """
        where = "Trainer.fit"
        k = len(self.targets.contexts)
        src = _data.source(data, batch_size, shuffle, self.seed, k, where)
        total = self._total(src, steps, epochs, where)
        self._begin(resume, where)
        if resume and total is not None:
            total = max(total - self._step, 0)
        fit = Fit(where, self.targets.contexts, total, progress)
        self.history = fit.history
        if total == 0:
            return fit.history
        feed = Feed(src, total, self._step + 1, self._place, self.prefetch, self._position, where)
        try:
            self._steps(feed, fit)
        finally:
            self._fit_ended(feed)
        return fit.end(f"step {self._step} (params, opt_state and step are that step's)")

    def _steps(self, feed: Feed, fit: Fit) -> None:
        """Dispatches steps until the fit's total (or the data ends, or Ctrl-C), each loss read
        at once or one step late (``reads_late``). Keeps the data position after the last
        dispatched batch in ``feed.after``."""
        first = True

        def take() -> tuple:
            return feed.take(fit.stop)

        def dispatch(item: tuple) -> tuple:
            nonlocal first
            (placed, rows), position = item
            if self.balance == "measured" and not self.spmd and self._weights is None:
                self._weights = self._measure(placed)
            if first:
                self._check_loss(placed)
                self._compile(placed)
                fit.read_at, first = time.perf_counter(), False
            out = self._dispatch(placed)
            feed.after = position
            self._save_due(position)
            return self._step, out, rows

        def read(item: tuple) -> None:
            step, out, rows = item
            loss, ok = float(out.loss), bool(out.ok)
            fit.read(step, loss, ok, rows)
            if not ok and self.on_nan == "raise":
                kept = f"the fit stopped at step {self._step}"
                raise not_finite(fit.where, step, loss, kept, "pass on_nan='skip' to skip such steps")

        fit.steps(take, dispatch, read, reads_late(self.targets.devices))

    # -- checkpoints -------------------------------------------------------------------------

    def _state(self, position: dict | None) -> dict:
        return {
            "params": self._params,
            "opt_state": self._opt,
            "step": self._step,
            "key": None if self._key is None else self._key,
            "data": {} if position is None else dict(position),
        }

    def _restore(self, back: dict) -> None:
        self._params, self._opt, self._step = back["params"], back["opt_state"], int(back["step"])
        if self._key is not None and back["key"] is not None:
            self._key = back["key"]
        self._position = back["data"] or None
        if not self.spmd:
            self._replicas = self._copies(self._params)

    def _total(self, src: Any, steps: Any, epochs: Any, where: str) -> int | None:
        if steps is not None and epochs is not None:
            raise TypeError(f"{where}: give steps= or epochs=, not both")
        if steps is not None:
            return whole(steps, "steps", where, lo=1, example=1000, note="steps to run")
        if epochs is not None:
            epochs = whole(epochs, "epochs", where, lo=1, example=5, note="passes over the data")
            if not isinstance(src, _data.ArraySource):
                raise TypeError(
                    f"{where}: epochs= needs arrays that mgkit batches; for other data give steps="
                )
            return epochs * src.steps_per_epoch
        if isinstance(src, _data.ArraySource):
            return src.steps_per_epoch
        if isinstance(src, _data.FunctionSource):
            raise TypeError(
                f"{where}: data is a function step -> batch; say how many steps to run, e.g. steps=1000"
            )
        return None

    def _compile(self, placed: tuple) -> None:
        """Compiles the step for these arguments while Ctrl-C still works (``_progress.compile``)."""
        if self.spmd:
            key = None if self._key is None else jax.random.fold_in(self._key, 0)
            _progress.compile(self._program, (self._params, self._opt, *placed, key))

    def _measure(self, placed: tuple) -> tuple[float, ...]:
        """Rows per second of each context's gradient on an equal part (after a warm-up)."""
        parts, sizes = placed
        speeds = []
        for i, part in enumerate(parts):
            if not sizes[i]:
                speeds.append(1.0)
                continue
            jax.block_until_ready(self._program.grad(self._replicas[i], part))
            t0 = time.perf_counter()
            jax.block_until_ready(self._program.grad(self._replicas[i], part))
            speeds.append(sizes[i] / max(time.perf_counter() - t0, 1e-9))
        return tuple(speeds)
