"""The bytes of a trainer's state on each context, planned from shapes (``mg.fits``: nothing is
allocated) or read from the live arrays (``Trainer.memory``), against each device's limit."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from .. import _devices
from .._numbers import nbytes
from .._oom import live_facts, state_facts
from .._spmd import Targets, resolve
from .._table import Table, human_bytes
from ._ahead import Makings, plan_grid
from ._checks import check_optimizer
from ._data import check_rows
from ._initial import param_shapes
from ._plan import Plan, check_distinct, layouts, plan, shapes_of
from ._shard import param_like, shape_of


class MemoryRow(NamedTuple):
    """One context's bytes."""

    context: str  # the context's name
    params: int  # bytes of parameters on it (padding included)
    opt_state: int  # bytes of optimizer state on it
    batch: int  # bytes of one batch on it
    limit: int | None  # its memory limit in bytes (None: unknown)
    temporaries: int | None = None  # what the compiled step makes while it runs (None: not planned)

    @property
    def total(self) -> int:
        return self.params + self.opt_state + self.batch + (self.temporaries or 0)

    @property
    def fits(self) -> bool | None:
        """Whether the total is within the limit (None: the limit is unknown)."""
        return None if self.limit is None else self.total <= self.limit


class LeafBytes(NamedTuple):
    """A parameter's bytes on each context (with its optimizer state's)."""

    path: str  # the leaf's path ("dense/kernel")
    nbytes: int  # its bytes on each context, parameter and optimizer state
    split: bool  # whether it is split (else every context holds it whole)


class MemoryTable(Table):
    """Bytes of parameters, optimizer state and batch per context, and whether they fit the limit.

    ``rows()`` are ``MemoryRow``s (bytes as ints); ``fits`` is False when any context is over its
    limit (None where no limit is known); ``largest`` the leaves that take the most per context."""

    headers = ("context", "parameters", "optimizer state", "batch", "total", "limit", "fits")

    def __init__(self, rows: list[MemoryRow], title: str, largest: list[LeafBytes] = ()):
        super().__init__(rows, title)
        self.largest = list(largest)
        if any(r.temporaries is not None for r in rows):  # the step was planned (``fits(loss_fn=...)``)
            self.headers = (*self.headers[:4], "temporaries", *self.headers[4:])

    @property
    def fits(self) -> bool | None:
        known = [r.fits for r in self._rows if r.fits is not None]
        return None if not known else all(known)

    def _display_rows(self) -> list[tuple]:
        return [
            (
                r.context,
                human_bytes(r.params),
                human_bytes(r.opt_state),
                human_bytes(r.batch),
                *([] if len(self.headers) == 7 else [human_bytes(r.temporaries or 0)]),
                human_bytes(r.total),
                "unknown" if r.limit is None else human_bytes(r.limit),
                {None: "?", True: "yes", False: "NO"}[r.fits],
            )
            for r in self._rows
        ]

    def over(self) -> str:
        """The contexts over their limit and the largest leaves, in words (for errors)."""
        bad = [r for r in self._rows if r.fits is False]
        leaves = ", ".join(
            f"{leaf.path} {human_bytes(leaf.nbytes)}{'' if leaf.split else ' (whole on each)'}"
            for leaf in self.largest[:3]
        )
        first = bad[0]
        return (
            f"{first.context} needs {human_bytes(first.total)} (parameters {human_bytes(first.params)}, "
            f"optimizer state {human_bytes(first.opt_state)}"
            + (
                ""
                if first.temporaries is None
                else f", the step's temporaries {human_bytes(first.temporaries)}"
            )
            + f") but has {human_bytes(first.limit)}"
            + (f" ({len(bad) - 1} more contexts too)" if len(bad) > 1 else "")
            + f"; the largest leaves per context: {leaves}"
        )


def device_limit(device: jax.Device | None) -> int | None:
    """A device's memory limit in bytes: its allocator's, else the one ``mg.simulate(n,
    memory=...)`` gave simulated devices, else None (unknown)."""
    return None if device is None else _devices.memory_limit(device)


def planned(plan_: Plan, optimizer: Any, names: list[str], limits: list, batch: Any = None) -> MemoryTable:
    """The bytes per context of a plan: parameters, optimizer state (``jax.eval_shape``), a batch."""
    axes = plan_.axes
    opt_shapes = jax.eval_shape(optimizer.init, shapes_of(plan_.leaves))

    opt_by_path: dict[str, int] = {}

    def opt_share(x: Any, lay: Any) -> int:  # a state leaf that stands for parameter `lay`
        nbytes = lay.share(axes) // lay.dtype.itemsize * np.dtype(x.dtype).itemsize
        opt_by_path[lay.path] = opt_by_path.get(lay.path, 0) + nbytes
        return nbytes

    opt = param_like(optimizer, opt_shapes, plan_.leaves, opt_share, _nbytes)
    opt_bytes = sum(jax.tree_util.tree_leaves(opt))
    leaves = sorted(
        (
            LeafBytes(lay.path, lay.share(axes) + opt_by_path.get(lay.path, 0), any(lay.spec))
            for lay in layouts(plan_.leaves)
        ),
        key=lambda b: -b.nbytes,
    )
    params = sum(lay.share(axes) for lay in layouts(plan_.leaves))
    rows_on = _batch_bytes(batch, axes[plan_.batch_axis])
    rows = [MemoryRow(n, params, opt_bytes, rows_on, lim) for n, lim in zip(names, limits, strict=True)]
    return MemoryTable(rows, _title(plan_, rows), leaves)


def _nbytes(x: Any) -> int:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # a key: its key data's bytes
        x = jax.eval_shape(jax.random.key_data, x)
    return int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize


def _batch_bytes(batch: Any, parts: int) -> int:
    """The bytes of ``batch`` on each context as it will be placed: its even part's share and the
    last rows (placed on each), in the dtype JAX places it as (float64 as float32 without x64)."""
    if batch is None:
        return 0
    total = 0
    for x in jax.tree_util.tree_leaves(batch):
        n = np.shape(x)[0]
        row = (
            int(np.prod(np.shape(x)[1:], dtype=np.int64))
            * np.dtype(jax.dtypes.canonicalize_dtype(x.dtype)).itemsize
        )
        total += row * (n // parts + n % parts)
    return total


def _as_arrays(batch: Any) -> Any:
    """``batch`` with each shape (``jax.ShapeDtypeStruct``) standing as an array of that shape
    and dtype that takes no memory, so it is checked as arrays are."""
    return jax.tree_util.tree_map(
        lambda x: (
            np.broadcast_to(np.zeros((), x.dtype), x.shape) if isinstance(x, jax.ShapeDtypeStruct) else x
        ),
        batch,
    )


def _title(plan_: Plan, rows: list[MemoryRow]) -> str:
    how = plan_.shard if isinstance(plan_.shard, str) else "rules"
    most = max(r.total for r in rows)
    verdict = {None: "no limit known", True: "fits", False: "does NOT fit"}[MemoryTable(rows, "").fits]
    return f"shard={how!r} over {len(rows)} context(s): at most {human_bytes(most)} per context; {verdict}"


def fits(
    params: Any,
    optimizer: Any,
    *,
    shard: Any = None,
    contexts: Any = None,
    limit: Any = None,
    mesh: Any = None,
    batch: Any = None,
    loss_fn: Any = None,
    has_aux: bool = False,
) -> MemoryTable:
    """The bytes per context of a model's training state, worked out from shapes before anything
    is allocated, and whether they fit each context's memory; given ``loss_fn`` (and ``batch``),
    the step's temporaries too, from its program compiled ahead of time (``mg.plan``).

    >>> import mgkit as mg, optax, jax, jax.numpy as jnp
    >>> shapes = {"w": jax.ShapeDtypeStruct((8192, 8192), jnp.float32)}
    >>> t = mg.fits(shapes, optax.adam(1e-3), shard="fsdp", contexts=8, limit="100MiB")
    >>> t.fits, [r.params for r in t.rows()][:2]
    (True, [33554432, 33554432])

    Args:
      params: the parameters (arrays), their shapes (``jax.eval_shape``'s tree of
        ``ShapeDtypeStruct``) or a function of no arguments that makes them (not run).
      optimizer: the optax optimizer (its state is sized by ``jax.eval_shape``).
      shard, mesh: as ``mg.Trainer`` takes them.
      contexts: context names, a count, or None for every context in the map; a count larger than
        the map plans for that many contexts without devices (give ``limit``).
      limit: bytes per context (``"80GiB"``, ``"16 GB"``, a number); None: each device's own
        limit, where it reports one.
      batch: one batch (arrays or shapes), to count its share on each context too.
      loss_fn: ``loss_fn(params, batch)`` (``has_aux``: returns ``(loss, aux)``): the step is
        compiled from shapes and its temporaries (activations, gathered parameters, gradients)
        are counted in each context's total. Needs ``batch`` and contexts that exist.

    Returns:
      a ``MemoryTable``: a row per context, ``fits`` and the ``largest`` leaves.
    """
    where = "fits"
    shapes = param_shapes(params, where)
    check_optimizer(optimizer, where)
    if batch is not None:
        check_rows(_as_arrays(batch), where, "batch")
    cap = None if limit is None else nbytes(limit, "limit", where, example="80GiB")
    targets = None
    if (
        isinstance(contexts, int)
        and not isinstance(contexts, bool)
        and contexts > len(resolve(None, where).names)
    ):
        names, devices = [f"context {i}" for i in range(contexts)], [None] * contexts
    else:
        targets = resolve(contexts, where)
        names, devices = list(targets.names), list(targets.devices)
    p = plan(shapes, shard, mesh, len(names), where)
    if targets is not None:
        check_distinct(p, targets, where)
    limits = [cap if cap is not None else device_limit(d) for d in devices]
    table = planned(p, optimizer, names, limits, batch)
    if loss_fn is None:
        return table
    if batch is None or targets is None:
        raise ValueError(
            f"{where}: loss_fn= plans the step on the contexts' devices with one batch: give batch= and "
            f"at most the map's {len(resolve(None, where).names)} contexts (mg.simulate(n) rehearses more)"
        )
    makings = Makings(loss_fn, optimizer, bool(has_aux), shapes, None, True)
    step = plan_grid(makings, batch, tuple(names), shard, 1, "fp32", cap, mesh, where).rows()[0]
    rows = [r._replace(temporaries=step.temporaries) for r in table.rows()]
    return MemoryTable(
        rows, _title(p, rows) + "; the step's temporaries from its compiled program", table.largest
    )


def check_fits(plan_: Plan, optimizer: Any, targets: Targets, where: str) -> None:
    """Raises before anything is allocated where a context's state is over its device's limit."""
    limits = [device_limit(d) for d in targets.devices]
    if all(limit is None for limit in limits):  # no device says how much it has
        return
    table = planned(plan_, optimizer, list(targets.names), limits)
    if table.fits is not False:
        return
    hint = (
        "pass shard='fsdp' to split parameters and optimizer state over the contexts"
        if not plan_.split
        else "split more leaves (rules), use more contexts, or a smaller model"
    )
    facts = live_facts([(c.name, c.device) for c in targets.contexts])
    raise ValueError(
        f"{where}: the training state does not fit: {table.over()}; {hint} (plan with mg.fits)\n"
        f"{state_facts(table)}\n{facts}"
    )


def live(targets: Targets, params: Any, opt_state: Any, batch_bytes: int = 0) -> MemoryTable:
    """The bytes per context of the live arrays of a trainer's state (every shard counted where it lives)."""
    held = {d: [0, 0] for d in targets.devices}
    for i, tree in enumerate((params, opt_state)):
        for x in jax.tree_util.tree_leaves(tree):
            if isinstance(x, jax.Array):
                for shard in x.addressable_shards:
                    if shard.device in held:
                        held[shard.device][i] += shard.data.nbytes
    rows = [MemoryRow(c.name, *held[c.device], batch_bytes, device_limit(c.device)) for c in targets.contexts]
    most = max(r.total for r in rows)
    return MemoryTable(
        rows, f"live arrays over {len(rows)} context(s): at most {human_bytes(most)} per context"
    )


def batch_bytes(placed: Any) -> int:
    """The most bytes of a placed batch (a step's batch arguments) on any one device."""
    held: dict = {}
    for x in jax.tree_util.tree_leaves(placed):
        if isinstance(x, jax.Array):
            for shard in x.addressable_shards:
                held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values(), default=0)


class Sizes:
    """A trainer's state as it lies on the contexts: its shapes and shardings, and its bytes."""

    def state_shapes(self) -> dict:
        """The state as it lies on the contexts, for ``mg.show_sharding(tr)``: ``{"params": ...,
        "opt_state": ...}``, each leaf a ``jax.ShapeDtypeStruct`` of its own shape and dtype with
        the sharding it is stored with (a padded leaf's last blocks are then shown short).
        Nothing is read or moved."""
        if self._layout is not None:
            params, opt = self._layout.shapes(self.optimizer, self._params, self._opt)
        else:
            params, opt = jax.tree_util.tree_map(shape_of, (self._params, self._opt))
        return {"params": params, "opt_state": opt}

    def memory(self) -> MemoryTable:
        """Bytes per context of the live parameters and optimizer state (each shard where it
        lives, padding included), and of the last fit's first batch; with each device's limit
        where it reports one.

        >>> import mgkit as mg, optax, jax.numpy as jnp
        >>> _ = mg.use_contexts("a->cpu0;b->cpu1", verbose=False)
        >>> loss = lambda p, b: jnp.mean(b @ p["w"])
        >>> tr = mg.Trainer(loss, optax.adam(1e-3), {"w": jnp.zeros((4096, 4))}, shard="fsdp")
        >>> [(r.context, r.params, r.opt_state) for r in tr.memory().rows()]
        [('a', 32768, 65540), ('b', 32768, 65540)]
        """
        return live(self.targets, self._params, self._opt, self._batch_bytes)
