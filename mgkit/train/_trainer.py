"""``mg.Trainer``: one model trained on many contexts with an optax optimizer."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import jax

from .. import _progress
from .._numbers import whole
from .._oom import OutOfMemoryError, StepFacts, program_needs
from .._profile import step_scope
from .._spmd import Communication, Targets, Watch, communication, resolve, sharding, shares
from . import _data, _orbax
from ._accumulate import check_rows
from ._ahead import PlansAhead
from ._checkpoint import Checkpointing, Checkpoints
from ._checks import check_key, check_loss_fn, check_loss_on, check_optimizer
from ._feed import Feed
from ._history import History
from ._initial import initial, made
from ._loop import UNGUARDED, Fit, check_on_nan, not_finite, reads_late
from ._memory import Sizes, batch_bytes, check_fits, device_limit
from ._plan import check_distinct, plan
from ._precision import check_precision, initial_scale, scale_entry, scale_from, warn_if_cpu
from ._shard import Placement
from ._step import StepOut, place_parts, place_spmd_batch, replicas_of, speeds, step_program

_WHERE = "Trainer"


class Trainer(Checkpointing, PlansAhead, Sizes):
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
        neither placed nor differentiated, as ``eqx.partition(model, eqx.is_array)`` does. Or
        a function of no arguments that makes them (``lambda: init(jax.random.key(0))``), run
        as one program whose outputs are created where they live: no context ever holds more
        than its share of a split leaf.
      contexts: context names, a count (the first n) or None for every context in the map.
        Distinct devices of one kind run one SPMD program per step; contexts that share a
        device or mix kinds run the gather-update-copy loop (see ``mgkit.train``).
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      on_nan: ``"raise"`` (default): a step whose loss or gradient is not finite is not
        applied, and the fit stops with an error naming it; ``"skip"``: that update is skipped
        and the fit goes on (at its end a ``StepsSkipped`` warning says how many); ``"apply"``:
        the step has no guard (no conditional in the program: what a hand-written step costs,
        measured 8-15 % less per step on simulated CPU devices), every update is applied, and
        the fit stops with an error at a non-finite loss, the state then holding that update
        (a NaN gradient behind a finite loss goes unseen). With ``precision="fp16"`` the guard
        stays: the loss scale skips the steps that overflow.
      seed: the seed of the data order (arrays mgkit batches are shuffled by (seed, epoch)).
      balance: None (parts of equal rows) or ``"measured"`` (the gather-update-copy loop only:
        parts in proportion to each context's measured speed, as ``mg.parallel`` does).
      key: a PRNG key (``jax.random.key(0)``) for a ``loss_fn(params, batch, key)`` that draws
        random numbers (dropout): step s gets ``jax.random.fold_in(key, s)``, so a resumed run
        draws what an uninterrupted one would. None (default): ``loss_fn(params, batch)``.
      checkpoint: a folder to save checkpoints in, with orbax-checkpoint
        (``pip install 'mgkit[checkpoint]'``): parameters, optimizer state, step, key and data
        position, every ``every`` steps, the newest ``keep`` kept; ``fit(..., resume=True)``
        goes on from the newest one. Plain orbax reads them (README, "Checkpoints"); the
        folder's other steps are never touched. ``load_orbax`` starts from a user's own.
      prefetch: batches placed ahead of the step by a background thread (``mg.Prefetch``); 0
        places each batch when the step needs it.
      shard: how parameters and optimizer state lie on the contexts: ``"replicate"`` (whole on
        each), ``"fsdp"`` (every leaf of at least 1,024 elements split along
        one axis over every context, padded where the axis does not divide; each optimizer-state
        leaf like its parameter), a dict ``{regex on the leaf's path ("dense/kernel"): axis or
        None}`` (first match wins; leaves no rule matches follow fsdp; a rule that matches
        nothing is an error), a function ``(path, leaf) -> axis or None`` (``leaf`` has shape,
        dtype, its annotation ``names`` and ``metadata``), ``"annotations"`` (as a Flax model's
        own sharding annotations say: ``nnx.with_partitioning``), or Flax-style logical axis
        rules mapping the annotations' logical names to mesh axes
        (``(("embed", None), ("mlp", "model"))``). None (default): ``"annotations"`` for an
        annotated model given ``mesh=``, else ``"replicate"``. Needs distinct devices of one
        kind. A state over the devices' memory limit raises before allocating. ``"auto"``: at
        the first step the step is planned (``plan``) replicated and fsdp with that batch, and
        the layout that fits ``memory`` with the least predicted step time is kept (the state is
        placed fsdp until then); ``tr.layout`` says what was chosen and why.
      memory: the bytes per context ``shard="auto"`` plans for (``"70GiB"``); None: the devices'
        own limit (``mg.simulate(n, memory=...)``'s on simulated devices).
      mesh: the contexts arranged on named axes, ``{"data": 2, "model": 4}`` (sizes multiply to
        the contexts), for tensor parallelism: rules give a leaf's split per array axis
        (``{"w1": (None, "model")}``; an int axis splits over every mesh axis), the batch's rows
        are split over ``"data"`` (else the first axis). This mesh is the one in force
        (``jax.set_mesh``) while the step is traced and run, so the loss may name its axes
        (``jax.lax.with_sharding_constraint(x, P("data", "model"))``). None: one axis over all
        contexts.

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
        shard: Any = None,
        mesh: Any = None,
        memory: Any = None,
    ):
        check_loss_fn(loss_fn, _WHERE)
        check_optimizer(optimizer, _WHERE)
        check_on_nan(on_nan, _WHERE, unguarded=True)
        if balance not in (None, "measured"):
            raise ValueError(f"{_WHERE}: balance={balance!r}; use None (equal parts) or 'measured'")
        start = initial(params, _WHERE)
        self._model, shapes = start.model, start.shapes  # the arrays and the leaves held as given
        self._loss = self._model.bind(loss_fn)  # loss_fn of the model's arrays
        self.loss_fn, self.optimizer, self.has_aux = loss_fn, optimizer, bool(has_aux)
        self.on_nan, self.balance, self.shard, self.mesh = on_nan, balance, shard, mesh
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
        self._programs: dict[tuple[int, str], Any] = {}  # (accumulate, precision) -> compiled step
        self._accumulate, self._precision = 1, "fp32"  # the last fit's
        self._scale, self._warned = None, False  # the LossScale of fp16 fits; warned: on CPU
        self._plan = plan(shapes, self._auto_start(shard, memory, mesh, _WHERE), mesh, len(devices), _WHERE)
        check_distinct(self._plan, self.targets, _WHERE)
        check_fits(self._plan, optimizer, self.targets, _WHERE)
        split = self.spmd and (self._plan.split or mesh is not None)
        self._layout = Placement(self._plan, devices) if split else None
        self._batch_bytes = 0  # of the last fit's first batch, on each context (``memory``)
        if self._layout is not None:
            layout = self._layout
            self._params = layout.create(start.make) if start.make else layout.place(self._model.arrays)
            self._replicas: list = []
        elif self.spmd:
            self._params = made(start, sharding(devices))
            self._replicas = []
        else:
            self._params = made(start, jax.sharding.SingleDeviceSharding(devices[0]))
            self._replicas = replicas_of(self.targets, self._params)
        self._opt = self._init_opt(self._params)
        self._program = self._built(1, "fp32")
        # the collectives of the SPMD step, read once per program and recorded on each run
        self._collectives: Watch | None = Watch(self.targets.contexts, "Trainer step") if self.spmd else None
        self._weights: tuple[float, ...] | None = None
        self._record = True  # the step's collectives recorded in the ledger (``fit(collectives=)``)
        self._given: tuple = ()  # the state the last dispatched step was given (it donates it)
        self._begun = 0  # the step the last fit began at
        self._lost: str | None = None  # why the state is gone (a step that failed after taking it)
        self.checkpoints: Checkpoints | None = None
        if checkpoint is not None:
            self.checkpoints = Checkpoints(checkpoint, every=every, keep=keep, where=_WHERE)

    # -- state -------------------------------------------------------------------------------

    @property
    def params(self) -> Any:
        """The parameters after the last completed step: the trainer's own arrays (the next fit
        donates them, so copy them, e.g. ``jax.device_get``, to keep a snapshot). A leaf that
        ``shard=`` stores padded (an axis that does not divide by the contexts) is read to the
        host as a new numpy array of its own shape, shard by shard: no context ever holds it
        whole, nothing is kept for later, and each read copies it again (keep the result). A
        model with leaves other than arrays (an Equinox module's activation) comes back with
        them as given."""
        self._check_alive("Trainer.params")
        if self._layout is None:
            return self._model.join(self._params)
        return self._model.join(self._layout.read(self._params))

    @property
    def opt_state(self) -> Any:
        """The optimizer state after the last completed step, of the model's arrays (as
        ``optimizer.init(eqx.filter(model, eqx.is_array))`` would make it; leaves stored padded
        read as ``params`` reads them)."""
        self._check_alive("Trainer.opt_state")
        if self._layout is None:
            return self._opt
        return self._layout.read_state(self.optimizer, self._opt)

    def _check_alive(self, where: str) -> None:
        """Raises where a step that failed while it ran took the state with it (``_out_of_memory``)."""
        if self._lost is not None and self._given and self._params is self._given[0]:
            raise RuntimeError(f"{where}: {self._lost}")

    @property
    def step(self) -> int:
        """Steps completed, over every fit."""
        return self._step

    @property
    def contexts(self) -> tuple[str, ...]:
        return self.targets.names

    def _own_arrays(self) -> dict[int, str]:
        """Its parameters' and optimizer state's arrays by ``id``, named (for an OOM report)."""
        names = {}
        for tree, what in ((self._params, "the trainer's parameters"), (self._opt, "its optimizer state")):
            names.update((id(x), what) for x in jax.tree_util.tree_leaves(tree))
        return names

    def _needs(self) -> str | None:
        """What the last step's compiled program needs per device (for an out-of-memory report)."""
        last = self._collectives.last if self._collectives is not None else None
        limit = device_limit(self.targets.devices[0])
        return None if last is None or last.compiled is None else program_needs(last.compiled, limit)

    @property
    def step_fn(self) -> Callable:
        """The compiled step, for a loop of one's own: ``step_fn(params, opt_state, batch,
        key=None)`` splits the batch over the contexts (recorded in the ledger), runs one step
        and returns ``StepOut(params, opt_state, loss, ok, aux)``. It donates ``params`` and
        ``opt_state`` (use the returned ones); ``ok`` is False where the update was skipped
        (a loss or gradient not finite). The trainer's own state is not touched. It is the
        plain step (no ``accumulate``, float32), whatever the last fit used. With ``shard=``,
        leaves stored padded come back padded: give them back as they are; the state as
        ``params`` and ``opt_state`` read it (padded leaves as numpy arrays) is taken too, each
        device receiving only its shard of such a leaf."""
        k = len(self.targets.contexts)
        program = self._built(1, "fp32")

        def step_fn(params: Any, opt_state: Any, batch: Any, key: Any = None) -> StepOut:
            leaves, treedef, n = _data.check_batch(batch, "Trainer.step_fn", "the batch")
            arrays = self._model.arrays_of(params, "Trainer.step_fn", "params")
            if self._layout is not None:  # a state in its own shapes padded (stored: kept)
                arrays, opt_state = self._layout.as_stored(
                    self.optimizer, arrays, opt_state, "Trainer.step_fn"
                )
            if self.spmd:
                even, rest, _ = place_spmd_batch(leaves, treedef, self.targets, False, self._layout)
                out = program(arrays, opt_state, even, rest, key)
            else:
                sizes = shares(n, k, self._weights)
                parts = place_parts(leaves, treedef, self.targets, sizes)
                out = program(replicas_of(self.targets, arrays), opt_state, parts, sizes, key)[1]
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

    def _built(self, accumulate: int, precision: str) -> Any:
        """The step for ``accumulate`` microbatches in ``precision``, built once per pair."""
        key = (accumulate, precision)
        if key not in self._programs:
            guard = self.on_nan != UNGUARDED or precision == "fp16"  # fp16: the scale skips overflows
            args = (self._loss, self.optimizer, self.has_aux, self.targets, self.spmd, self._layout)
            self._programs[key] = step_program(*args, accumulate, precision, guard)
        return self._programs[key]

    # -- one step ----------------------------------------------------------------------------

    def _place(self, batch: Any, own: bool) -> tuple[tuple, tuple[int, ...]]:
        """A batch laid out for the step: (the step's batch arguments, rows per context)."""
        k = len(self.targets.contexts)
        leaves, treedef, n = _data.check_batch(batch, "Trainer.fit", "the batch")
        check_rows(self._accumulate, n, "Trainer.fit")
        if self.spmd:
            even, rest, rows = place_spmd_batch(leaves, treedef, self.targets, own, self._layout)
            return (even, rest), rows
        sizes = shares(n, k, self._weights)
        return (place_parts(leaves, treedef, self.targets, sizes), sizes), sizes

    @step_scope  # a step in a running mg.profile()
    def _dispatch(self, placed: tuple) -> StepOut:
        """Runs one step and keeps its results at once: nothing can come between the donation
        of the old state and keeping the new one (Ctrl-C is only noted during a fit)."""
        self._given = (self._params, self._opt, self._replicas)  # taken by the step (donated)
        if self.spmd:
            args = (self._params, self._opt, *self._args(placed, self._step + 1))
            info = {"step": self._step + 1}
            out = self._collectives.run(self._program, args, placed, info, self._record)
            self._params, self._opt = out.params, out.opt_state
        else:
            replicas, out = self._program(self._replicas, self._opt, *self._args(placed, self._step + 1))
            self._replicas, self._params, self._opt = replicas, out.params, out.opt_state
        if out.scale is not None:
            self._scale = out.scale
        self._step += 1
        return out

    def _args(self, placed: tuple, step: int) -> tuple:
        """The step's arguments after the state: the batch, the key of ``step``, and under
        ``precision="fp16"`` the loss scale (after ``alive``: None, on the SPMD step)."""
        key = None if self._key is None else jax.random.fold_in(self._key, step)
        if self._precision != "fp16":
            return (*placed, key)
        return (*placed, key, None, self._scale) if self.spmd else (*placed, key, self._scale)

    def _check_loss(self, placed: tuple) -> None:
        """The loss function's output, from shapes only (before anything compiles or runs)."""
        batch = (placed[0] if placed[0] is not None else placed[1]) if self.spmd else placed[0][0]
        structure = jax.tree_util.tree_structure(batch)
        if structure not in self._checked:
            with nullcontext() if self._layout is None else self._layout.in_force():
                check_loss_on(
                    self._loss,
                    self._params if self._layout is None else self._layout.plan_shapes(),  # unpadded
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
        accumulate: int = 1,
        precision: str = "fp32",
        collectives: bool = True,
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
          accumulate: microbatches per batch: each batch is cut into ``accumulate`` parts run one
            after the other inside the one compiled step (a ``lax.scan``), their gradients summed
            in float32, then one update; the gradient is the whole batch's, with the memory of one
            microbatch's activations. ``step`` counts updates. At most the batch's rows.
          precision: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"``: the dtype ``loss_fn`` computes
            in (it sees the parameters and the batch's floating leaves cast to it); parameters,
            optimizer state and gradients stay float32. ``"fp16"`` adds a dynamic loss scale: a
            step whose scaled gradients overflow is skipped and the scale halved (not an error
            under ``on_nan="raise"``; ``History.overflowed`` counts them). On CPU a
            ``PrecisionWarning`` says it is not faster.
          collectives: record each step's collectives in the ledger (``collective`` events, read
            from the compiled step; the default). False leaves them out, for a fit that wants
            them unrecorded or to measure what recording costs (``benchmarks/bench_train.py``:
            nothing measurable); the step events and the batches' placements are recorded as ever.

        A step that cannot fit the devices (its compiled program needs more than a device's
        limit, or, on CPU devices, than the host's memory) is refused before it runs, with an
        ``mg.OutOfMemoryError``; ``params``, ``opt_state`` and ``step`` stay those of the last
        completed step. A step that runs out of memory while it runs has already taken the
        state it was given (the step donates it): the error says so, ``step`` stays the last
        completed one's, and the state must come back from a checkpoint (``resume=True``).

        Ctrl-C (the notebook's Stop button) stops at the next step boundary: ``params``,
        ``opt_state`` and ``step`` are those of the last completed step, ``history`` holds the
        steps run, and KeyboardInterrupt is raised. A later ``fit`` goes on from there.
        """
        where = "Trainer.fit"
        k = len(self.targets.contexts)
        if not isinstance(collectives, bool):
            raise TypeError(
                f"{where}: collectives must be True (record each step's collectives) or False, got "
                f"{type(collectives).__name__} {collectives!r}"
            )
        self._set_recipe(accumulate, precision, where)
        src = _data.source(data, batch_size, shuffle, self.seed, k, where)
        total = _data.total_steps(src, steps, epochs, where)
        self._begin(resume, where)
        self._check_alive(where)  # a lost state not restored by resume=True
        self._lost = None
        self._record, self._begun, self._given = collectives, self._step, ()
        if resume and total is not None:
            total = max(total - self._step, 0)
        fit = Fit(where, self.targets.contexts, total, progress)
        fit.facts = StepFacts(self.memory, self._needs, self._own_arrays)
        self.history = fit.history
        if total == 0:
            return fit.history
        feed = Feed(src, total, self._step + 1, self._place, self.prefetch, self._position, where)
        try:
            self._steps(feed, fit)
        except OutOfMemoryError as e:
            raise self._out_of_memory(e) from e.__cause__
        finally:
            self._fit_ended(feed)
        return fit.end(f"step {self._step} (params, opt_state and step are that step's)", self._preempted)

    def _out_of_memory(self, error: OutOfMemoryError) -> OutOfMemoryError:
        """``error`` as it is where the failing step was refused before it ran (it took nothing:
        the state is the last completed step's). Where the step ran and failed, it was given the
        state (donated): ``step`` goes back to the last completed step's, and where the state is
        gone it is marked lost and the error says so."""
        if not self._given or self._params is self._given[0]:  # refused before it ran
            return error
        done = self.history.step[-1] if self.history is not None and len(self.history) else self._begun
        self._step, (self._params, self._opt, self._replicas) = done, self._given  # not its outputs
        given = [x for x in jax.tree_util.tree_leaves(self._given[:2]) if isinstance(x, jax.Array)]
        if not any(x.is_deleted() for x in given):  # the backend kept what it was given
            return error
        self._lost = (
            f"the trainer's state of step {done} was given to step {done + 1}, which ran out of memory "
            "while it ran (a step donates its state, so that one copy is in memory), so it is gone; "
            "restore a checkpoint (fit(..., resume=True)) or make a new Trainer"
        )
        return OutOfMemoryError(f"{error}\n{self._lost}")

    def _set_recipe(self, accumulate: Any, precision: Any, where: str) -> None:
        """Checks ``accumulate`` and ``precision`` and picks their step; a first fp16 fit starts
        the loss scale; on CPU, the first reduced-precision fit warns that it is not faster."""
        self._accumulate = whole(
            accumulate, "accumulate", where, lo=1, example=4, note="microbatches per batch"
        )
        self._precision = check_precision(precision, where)
        if self._precision == "fp16" and self._scale is None:
            self._scale = initial_scale()
        if not self._warned:
            self._warned = warn_if_cpu(self._precision, self.targets.devices, where)
        self._program = self._built(self._accumulate, self._precision)

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
                self._weights = speeds(self._program, self._replicas, placed)
            if first:
                self._choose(placed)  # shard="auto": the layout, from this batch's step
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
            overflow = out.scale is not None and bool(out.scale.overflow)
            fit.read(step, loss, ok, rows, overflow)
            if not ok and not overflow and self.on_nan != "skip":
                kept = UNGUARDED if self.on_nan == UNGUARDED else f"the fit stopped at step {self._step}"
                raise not_finite(fit.where, step, loss, kept, "pass on_nan='skip' to skip such steps")

        fit.steps(take, dispatch, read, reads_late(self.targets.devices))

    # -- checkpoints -------------------------------------------------------------------------

    def _state(self, position: dict | None) -> dict:
        self._check_alive("Trainer.save")
        params, opt = self._params, self._opt
        if self._layout is not None:  # padded leaves say their own shape (restored into any padding)
            params, opt = self._layout.stored(self.optimizer, params, opt)
        return {
            "params": params,
            "opt_state": opt,
            "step": self._step,
            "key": None if self._key is None else self._key,
            "data": {} if position is None else dict(position),
            **({} if self._scale is None else {"loss_scale": scale_entry(self._scale)}),
        }

    def _restore(self, back: dict) -> None:
        self._params, self._opt, self._step = back["params"], back["opt_state"], int(back["step"])
        if self._layout is not None:
            self._params, self._opt = Placement.unstored(self._params), Placement.unstored(self._opt)
        if self._key is not None and back["key"] is not None:
            self._key = back["key"]
        self._position = back["data"] or None
        if back.get("loss_scale") is not None:
            self._scale = scale_from(back["loss_scale"])
        if not self.spmd:
            self._replicas = replicas_of(self.targets, self._params)

    def _init_opt(self, params: Any) -> Any:
        """The optimizer's initial state for the trainer's (stored) ``params``, laid out as theirs."""
        if self._layout is not None:
            return self._layout.init(self.optimizer, params)
        devices = self.targets.devices
        out = sharding(devices) if self.spmd else jax.sharding.SingleDeviceSharding(devices[0])
        return jax.jit(self.optimizer.init, out_shardings=out)(params)

    def load_orbax(
        self, directory: str | os.PathLike, step: int | None = None, *, params="params", opt_state=None
    ) -> None:
        """Starts from a checkpoint that orbax wrote (``ocp.CheckpointManager(directory).save(step,
        args=ocp.args.Composite(params=ocp.args.StandardSave(params), ...))``): the trainer's
        parameters (and optimizer state, when ``opt_state`` names its item) become the saved ones,
        read straight into the trainer's layout (no leaf gathered), and its step becomes ``step``.

        Args:
          directory: the folder given to ``ocp.CheckpointManager``.
          step: the step to read; None: the newest.
          params: the name of the item holding the parameters (a single-item manager's: "default").
          opt_state: the name of the item holding the optimizer state (the trainer's optimizer's own
            tree, as ``optimizer.init`` makes it); None: a new state, ``optimizer.init`` of the
            loaded parameters.

        Raises FileNotFoundError for a missing folder, step or item, and ValueError naming the
        first leaf whose path, shape or dtype differs from the trainer's.
        """
        items = {"params": params} | ({} if opt_state is None else {"opt_state": opt_state})
        like = self._state(self._position)
        step, got = _orbax.read(directory, step, items, like, "Trainer.load_orbax")
        self._restore(like | got | {"step": step})
        if opt_state is None:
            self._opt = self._init_opt(self._params)

    def _compile(self, placed: tuple) -> None:
        """Compiles the step for these arguments while Ctrl-C still works (``_progress.compile``)."""
        self._batch_bytes = batch_bytes(placed)
        if self.spmd:
            _progress.compile(self._program, (self._params, self._opt, *self._args(placed, 0)))
