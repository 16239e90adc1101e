"""A training step planned ahead of time: for each layout of a grid (contexts, ``shard=``,
``accumulate=``, ``precision=``) the step is lowered and compiled from shapes and shardings
alone (``jax.ShapeDtypeStruct``: no array of the model is allocated) and the compiled program
is read: its memory per context (arguments, temporaries and peak, from XLA's memory analysis),
what its collectives send (as the ledger reads them), its flops and bytes accessed (XLA's cost
analysis), and the step time a roofline model predicts from those (``mgkit._roofline``).

``Trainer.plan`` (``PlansAhead``) plans a trainer's own step; ``mg.plan`` a loss function's,
from parameters or their shapes. Readings are cached: a layout planned again compiles nothing.

XLA's cost analysis counts a loop's body once: with ``accumulate=k`` the microbatch loop's flops
and bytes are counted for one microbatch, so a row's are k times the program's less the optimizer
update (compiled alone for that, once per layout), plus the update once. Collectives are read
with their loops' trip counts (``mgkit._spmd``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from .. import _devices, _roofline
from .._numbers import nbytes, whole
from .._oom import program_bytes
from .._spmd import AXIS, Cache, Communication, cost_of, read_compiled, resolve, sharding
from .._table import Table, human_bytes
from ._checks import check_loss_fn, check_optimizer
from ._data import check_batch
from ._initial import param_shapes
from ._plan import check_distinct, shapes_of
from ._plan import plan as layout_plan
from ._precision import check_precision, initial_scale
from ._shard import Placement
from ._step import spmd_step

_readings = Cache(64)  # (the step's makings, the layout) -> its Reading, without the program


class PlanRow(NamedTuple):
    """One planned layout: bytes per context, what it communicates and computes, and the
    predicted step."""

    contexts: int
    shard: str  # the ``shard=`` value, in words
    accumulate: int
    precision: str
    arguments: int  # bytes per context the step is given: parameters, optimizer state, batch
    temporaries: int  # bytes per context the step needs while it runs (activations, gathers)
    peak: int  # arguments + outputs beyond the donated arguments + temporaries
    limit: int | None  # bytes per context it must fit in (None: unknown)
    sent: int  # bytes the busiest context sends per step (ring model)
    flops: float | None  # per context and step (with accumulate=k: see the module's text)
    accessed: float | None  # bytes of memory accessed per context and step (likewise)
    predicted: _roofline.Prediction
    rows: int  # the batch's rows: samples per step
    compile_seconds: float  # 0.0 where the reading came from the cache

    @property
    def fits(self) -> bool | None:
        """Whether the peak is within the limit (None: the limit is unknown)."""
        return None if self.limit is None else self.peak <= self.limit

    @property
    def seconds(self) -> float:
        """The predicted seconds per step."""
        return self.predicted.seconds

    @property
    def samples_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else float("inf")

    def layout(self) -> str:
        """The layout in words: ``8 contexts, fsdp, accumulate 4, bf16``."""
        return f"{self.contexts} contexts, {self.shard}, accumulate {self.accumulate}, {self.precision}"


class StepPlan(Table):
    """The planned layouts, one ``PlanRow`` each (``rows()``), in the grid's order; ``best()``
    the fitting one with the least predicted step time."""

    headers = (
        "contexts", "shard", "accumulate", "precision", "state + batch", "temporaries", "peak",
        "limit", "fits", "sent", "flops", "predicted step", "samples/s", "bound",
    )  # fmt: skip

    def __init__(self, rows: list[PlanRow], figures: _roofline.Figures, seconds: float):
        self.figures, self.seconds = figures, seconds
        title = (
            f"step plan: {len(rows)} layout(s) compiled ahead of time from shapes, nothing allocated "
            f"({seconds:.1f} s); per context; predicted by the roofline model ({figures.source}: "
            f"{figures.flops:.3g} flop/s, {human_bytes(figures.bandwidth)}/s memory, "
            f"{human_bytes(figures.link)}/s link, {figures.latency * 1e6:.0f} us a hop, "
            f"{figures.dispatch * 1e6:.0f} us dispatch)"
        )
        super().__init__(rows, title)

    def best(self) -> PlanRow | None:
        """The layout that fits (or whose fit is unknown) with the least predicted step time."""
        fitting = [r for r in self._rows if r.fits is not False]
        return min(fitting, key=lambda r: r.seconds, default=None)

    def _display_rows(self) -> list[tuple]:
        return [
            (
                r.contexts,
                r.shard,
                r.accumulate,
                r.precision,
                human_bytes(r.arguments),
                human_bytes(r.temporaries),
                human_bytes(r.peak),
                "unknown" if r.limit is None else human_bytes(r.limit),
                {None: "?", True: "yes", False: "NO"}[r.fits],
                human_bytes(r.sent),
                "unknown" if r.flops is None else f"{r.flops:.3g}",
                f"{r.seconds * 1e3:.3g} ms",
                f"{r.samples_per_second:,.0f}",
                r.predicted.bound,
            )
            for r in self._rows
        ]


class Makings(NamedTuple):
    """What a step is made of, besides its layout."""

    loss: Callable  # of the parameters' arrays
    optimizer: Any
    has_aux: bool
    shapes: Any  # the parameters' shapes (a tree of jax.ShapeDtypeStruct)
    key: Any  # a PRNG key for the loss, or None
    guard: bool  # the non-finite guard (``on_nan`` other than "apply")


def _grid(value: Any, name: str, where: str) -> list:
    """A grid axis: the items of a list, else the one value (a list of names is one value of
    ``contexts``: ``["a", "b"]``; ``[4, 8]`` or ``[("a", "b"), ("a", "b", "c")]`` are two)."""
    if isinstance(value, list) and not (
        name == "contexts" and value and all(isinstance(v, str) for v in value)
    ):
        if not value:
            raise ValueError(
                f"{where}: {name}=[] is an empty grid; give at least one value, or one value alone"
            )
        return value
    return [value]


def _words(shard: Any) -> str:
    if shard is None or isinstance(shard, str):
        return "replicate" if shard is None else shard
    if callable(shard):
        return getattr(shard, "__name__", "a function")
    return repr(shard) if len(repr(shard)) <= 40 else repr(shard)[:37] + "..."


def plan_grid(
    makings: Makings,
    batch: Any,
    contexts: Any,
    shard: Any,
    accumulate: Any,
    precision: Any,
    memory: Any,
    mesh: Any,
    where: str,
) -> StepPlan:
    """Each layout of the grid planned (see the module's text), in the grid's order."""
    shaped = lambda x: np.broadcast_to(np.zeros((), x.dtype), x.shape)  # a view: nothing allocated  # noqa: E731
    probe = jax.tree_util.tree_map(lambda x: shaped(x) if isinstance(x, jax.ShapeDtypeStruct) else x, batch)
    leaves, treedef, rows = check_batch(probe, where, "the batch")
    shapes = [jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(x.dtype)) for x in leaves]
    cap = None if memory is None else nbytes(memory, "memory", where, example="70GiB")
    grid = list(
        itertools.product(
            _grid(contexts, "contexts", where),
            _grid(shard, "shard", where),
            [whole(a, "accumulate", where, lo=1, example=4) for a in _grid(accumulate, "accumulate", where)],
            [check_precision(p, where) for p in _grid(precision, "precision", where)],
        )
    )
    t0, planned = time.perf_counter(), []
    figures = None
    for n, spec, acc, prec in grid:
        targets = resolve(n, where)
        if not targets.spmd:
            raise ValueError(
                f"{where}: contexts={n!r} ({', '.join(targets.names)}) share a device or mix kinds, so "
                "their step is the gather-update-copy loop, not one compiled program to plan; plan on "
                "contexts with distinct devices of one kind"
            )
        if acc > rows:
            raise ValueError(f"{where}: accumulate={acc} is more than the batch's {rows} rows")
        figures = _roofline.together(targets.devices, prec != "fp32")
        reading, seconds = _read(makings, shapes, treedef, targets, spec, mesh, acc, prec, where)
        flops, accessed, sent, arguments, temporaries, peak, hops = reading
        limit = cap if cap is not None else _devices.memory_limit(targets.devices[0])
        predicted = _roofline.predict(flops, accessed, sent, figures, hops)
        planned.append(
            PlanRow(
                len(targets.devices),
                _words(spec),
                acc,
                prec,
                arguments,
                temporaries,
                peak,
                limit,
                sent,
                flops,
                accessed,
                predicted,
                rows,
                seconds,
            )
        )
    return StepPlan(planned, figures, time.perf_counter() - t0)


def _read(
    makings: Makings,
    batch: list,
    treedef: Any,
    targets: Any,
    spec: Any,
    mesh: Any,
    acc: int,
    prec: str,
    where: str,
) -> tuple[tuple, float]:
    """The layout's step compiled from shapes and read (cached): (flops, bytes accessed, bytes
    sent, argument bytes, temporary bytes, peak bytes, collective hops), and the seconds
    compiling took (0 when cached)."""
    devices = targets.devices
    p = layout_plan(makings.shapes, spec, mesh, len(devices), where)
    check_distinct(p, targets, where)
    made = (makings.loss, makings.optimizer, makings.has_aux, makings.key is None, makings.guard)
    key = (made, devices, _words(spec), repr(p), acc, prec, treedef, tuple(batch))
    found = _readings.find(key)
    if found is not None:
        return found, 0.0
    layout = Placement(p, devices) if p.split or mesh is not None else None
    program = spmd_step(
        makings.loss, makings.optimizer, makings.has_aux, devices, False, acc, prec, layout, makings.guard
    )
    args = _abstract(makings, p, layout, devices, batch, treedef, prec)
    t0 = time.perf_counter()
    with nullcontext() if layout is None else layout.in_force():
        compiled = program.lower(*args).compile()
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    flops, accessed = _cost(compiled)
    if acc > 1 and flops is not None:  # the loop's body counted once: k of them, and the update
        update = jax.jit(lambda q, o: optax.apply_updates(q, makings.optimizer.update(q, o, q)[0]))
        with nullcontext() if layout is None else layout.in_force():
            once = _cost(update.lower(args[0], args[1]).compile())
        flops, accessed = (
            None if v is None or u is None else acc * (v - u) + u
            for v, u in zip((flops, accessed), once, strict=True)
        )
    communication = Communication(read_compiled(compiled, targets.contexts, "Trainer step"))
    found = (
        flops,
        accessed,
        communication.sent,
        m.argument_size_in_bytes,
        m.temp_size_in_bytes,
        program_bytes(compiled),
        _roofline.hops([(op, count, n) for op, count, _, _, n in communication.rows()]),
    )
    _readings.add(key, found)
    return found, seconds


def _cost(compiled: Any) -> tuple[float | None, float | None]:
    """A compiled program's flops and bytes accessed per device (XLA's cost analysis)."""
    return cost_of(compiled, "flops"), cost_of(compiled, "bytes accessed")


def _abstract(
    makings: Makings, p: Any, layout: Any, devices: tuple, batch: list, treedef: Any, prec: str
) -> tuple:
    """The step's arguments as shapes with the shardings a trainer's step is given."""
    if layout is None:
        rep, split, parts = sharding(devices), sharding(devices, AXIS, 0), len(devices)
        params = jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), makings.shapes
        )
        opt = jax.eval_shape(jax.jit(makings.optimizer.init, out_shardings=rep), params)
    else:
        rep, split, parts = layout.rep, layout.split, layout.batch_parts
        params = jax.tree_util.tree_map(
            lambda lay: jax.ShapeDtypeStruct(lay.padded, lay.dtype, sharding=layout.sharding(lay)), p.leaves
        )
        opt = jax.eval_shape(lambda q: layout.init(makings.optimizer, q), params)
    opt = jax.tree_util.tree_map(
        lambda s, at: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=at),
        opt,
        jax.tree_util.tree_map(lambda _: rep, opt) if layout is None else layout.opt_state(makings.optimizer),
    )
    n = batch[0].shape[0]
    even = parts * (n // parts)

    def rows(start: int, stop: int, at: Any) -> Any:
        if stop <= start:
            return None
        cut = [jax.ShapeDtypeStruct((stop - start, *s.shape[1:]), s.dtype, sharding=at) for s in batch]
        return jax.tree_util.tree_unflatten(treedef, cut)

    key = None if makings.key is None else jax.eval_shape(lambda k: jax.random.fold_in(k, 0), makings.key)
    args = (params, opt, rows(0, even, split), rows(even, n, rep), key)
    return (*args, None, jax.eval_shape(initial_scale)) if prec == "fp16" else args


AUTO = ("replicate", "fsdp")  # the layouts shard="auto" plans


class PlansAhead:
    """``Trainer.plan``: the trainer's own step planned for other layouts; ``shard="auto"``: the
    layout chosen from its step's plan at the first step."""

    def _auto_start(self, shard: Any, memory: Any, mesh: Any, where: str) -> Any:
        """The ``shard=`` to place the state with now: "fsdp" for ``"auto"`` (the layout is
        chosen at the first step, ``_choose``), else ``shard``. Sets ``layout``."""
        self._auto = None  # the budget (bytes or None) while shard="auto" is still to choose
        if memory is not None and shard != "auto":
            raise ValueError(
                f"{where}: memory={memory!r} is the budget shard='auto' plans with; pass shard='auto' too, "
                "or leave memory out (a state over the devices' limit is refused anyway)"
            )
        if shard != "auto":
            self.layout = f"shard={_words(shard)!r}, as given"
            return shard
        if not self.spmd:
            raise ValueError(
                f"{where}: shard='auto' chooses the layout of one compiled step over distinct devices of "
                f"one kind, and contexts {', '.join(self.targets.names)} share a device or mix kinds (their "
                "step is the gather-update-copy loop, which keeps the state whole on each); leave shard out"
            )
        if mesh is not None:
            raise ValueError(
                f"{where}: shard='auto' chooses between {' and '.join(AUTO)} over one axis of contexts; "
                "with mesh= give the rules (shard={'w.*': (None, 'model')}), or leave mesh out"
            )
        self._auto = ("budget", None if memory is None else nbytes(memory, "memory", where, example="70GiB"))
        self.layout = "shard='auto': placed fsdp until the first step, which chooses the layout"
        return "fsdp"

    def _choose(self, placed: tuple) -> None:
        """``shard="auto"`` at the first step: each of ``AUTO`` planned with this batch (``placed``,
        the step's even and last rows) at the fit's accumulate and precision; the one that fits
        with the least predicted step time is kept, the state laid out again where it is not
        the layout it lies in. None fits: an error naming each one's peak and the fixes."""
        if self._auto is None:
            return
        where = "Trainer(shard='auto')"
        trees = [tree for tree in placed if tree is not None]
        rows = sum(jax.tree_util.tree_leaves(tree)[0].shape[0] for tree in trees)
        batch = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), trees[0]
        )
        planned = plan_grid(
            self._makings(), batch, self.targets.names, list(AUTO), self._accumulate, self._precision,
            self._auto[1], None, where,
        )  # fmt: skip
        best = planned.best()
        lines = [
            f"  {r.shard}: peak {human_bytes(r.peak)} per context (state and batch "
            f"{human_bytes(r.arguments)}, temporaries {human_bytes(r.temporaries)})"
            f"{'' if r.fits is None else ', fits' if r.fits else ', over the budget'}, predicted "
            f"{r.seconds * 1e3:.3g} ms a step"
            for r in planned.rows()
        ]
        if best is None:
            limit = human_bytes(planned.rows()[0].limit)
            raise ValueError(
                f"{where}: no layout's step fits {limit} per context:\n" + "\n".join(lines) + "\nCut the "
                "step's temporaries: fit(..., accumulate=4) runs a quarter of the batch at a time, "
                "precision='bf16' halves the activations; or give more contexts"
            )
        if best.shard != "fsdp" or not self._plan.split:
            self._relay(best.shard, where)
        why = (
            "the fastest predicted that fits"
            if best.fits
            else "the fastest predicted (no memory limit known)"
        )
        self.layout = "\n".join([f"shard='auto' chose {best.shard}: {why}", *lines])
        self.shard, self._auto = best.shard, None  # chosen (a Ctrl-C before here: chosen again next fit)

    def _relay(self, shard: str, where: str) -> None:
        """The state laid out as ``shard`` says (read in its own shapes, placed again), and the
        step built for it. The trainer takes the new layout and state together, once both are
        made (a Ctrl-C meanwhile leaves the old ones)."""
        devices = self.targets.devices
        params, opt = self._params, self._opt
        if self._layout is not None:
            params, opt = self._layout.read(params), self._layout.read_state(self.optimizer, opt)
        plan = layout_plan(shapes_of(self._plan.leaves), shard, None, len(devices), where)
        layout = Placement(plan, devices) if plan.split else None
        if layout is None:
            params, opt = jax.device_put((params, opt), sharding(devices))
        else:
            params, opt = layout.as_stored(self.optimizer, params, opt, where)
        self._plan, self._layout, self._params, self._opt = plan, layout, params, opt
        self._programs.clear()
        self._program = self._built(self._accumulate, self._precision)

    def _makings(self) -> Makings:
        """What the trainer's step is made of (``Makings``)."""
        guard = self.on_nan != "apply"
        return Makings(
            self._loss, self.optimizer, self.has_aux, shapes_of(self._plan.leaves), self._key, guard
        )

    def plan(
        self,
        batch: Any,
        *,
        contexts: Any = None,
        shard: Any = None,
        accumulate: Any = 1,
        precision: Any = "fp32",
        memory: Any = None,
    ) -> StepPlan:
        """The step compiled ahead of time for each layout of a grid, from shapes alone
        (nothing is allocated), and read: bytes per context (state and batch, temporaries,
        peak) against ``memory``, bytes each context sends per step, flops, and the predicted
        step time and samples/s (``mgkit._roofline``). A list for any of ``contexts``,
        ``shard``, ``accumulate`` and ``precision`` is a grid axis: every combination is
        planned (``shard=["replicate", "fsdp"], accumulate=[1, 4]``: four layouts).

        Args:
          batch: one batch (arrays, or ``jax.ShapeDtypeStruct`` leaves), rows along axis 0.
          contexts: a count (the first n contexts of the map), names, or None (the trainer's);
            a grid of them is a list of counts or of tuples of names.
          shard: as ``mg.Trainer`` takes it; None: the trainer's own (``"auto"`` not chosen
            yet: each layout it chooses between). The trainer's ``mesh`` is
            used for every layout (its sizes must multiply to each count of contexts).
          accumulate: microbatches per batch, as ``fit`` takes it.
          precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``, as ``fit`` takes it.
          memory: bytes per context to fit in (``"70GiB"``); None: the devices' own limit.

        Returns a ``StepPlan``: a ``PlanRow`` per layout; ``best()`` the fitting one predicted fastest.
        """
        where = "Trainer.plan"
        makings = self._makings()
        own = self.targets.names if contexts is None else contexts
        spec = self.shard if shard is None else shard
        spec = list(AUTO) if spec == "auto" else spec  # not chosen yet: both
        return plan_grid(makings, batch, own, spec, accumulate, precision, memory, self.mesh, where)


def plan(
    loss_fn: Callable,
    optimizer: Any,
    params: Any,
    batch: Any,
    *,
    contexts: Any = None,
    shard: Any = None,
    accumulate: Any = 1,
    precision: Any = "fp32",
    memory: Any = None,
    mesh: Any = None,
    has_aux: bool = False,
) -> StepPlan:
    """``Trainer.plan`` for a loss function and its parameters, or their shapes (a tree of
    ``jax.ShapeDtypeStruct``, ``jax.eval_shape`` of the model's init): no trainer is made and
    nothing is allocated. ``contexts`` None: every context in the map; ``shard`` and ``mesh`` as
    ``mg.Trainer`` takes them (None: replicated, one axis).

    >>> import mgkit as mg, optax, jax, jax.numpy as jnp
    >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
    >>> shapes = {"w": jax.ShapeDtypeStruct((512, 512), jnp.float32)}
    >>> batch = {"x": jax.ShapeDtypeStruct((64, 512), jnp.float32)}
    >>> p = mg.plan(loss, optax.adam(1e-3), shapes, batch, contexts=2, shard=["replicate", "fsdp"])
    >>> [r.shard for r in p.rows()], p.rows()[1].arguments < p.rows()[0].arguments
    (['replicate', 'fsdp'], True)
    """
    where = "mg.plan"
    check_loss_fn(loss_fn, where)
    check_optimizer(optimizer, where)
    makings = Makings(loss_fn, optimizer, bool(has_aux), param_shapes(params, where), None, True)
    return plan_grid(makings, batch, contexts, shard, accumulate, precision, memory, mesh, where)
