"""How a trainer's state is split over its contexts (``shard=`` and ``mesh=``): one ``LeafLayout``
per parameter, worked out from shapes alone (``_plan``), then laid on the devices' mesh
(``Placement``): NamedShardings for the parameters, for each optimizer-state leaf like its
parameter (``optax.tree_map_params``; counts and other scalars replicated) and for the batch.

A split axis that does not divide by its parts is stored padded with zeros up to a multiple of
them (JAX refuses uneven shardings); the step slices the padding off before the loss and the
optimizer see the leaf and pads the result again, so the math is that of the unpadded leaf.
Read back (``Trainer.params``), such a leaf comes to the host as a numpy array of its own shape,
shard by shard, and given back (``Trainer.step_fn``) it goes to the devices the same way: no
context ever holds it whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._spmd import AXIS, from_host, to_host
from .._spmd import mesh as line_mesh
from ._checkpoint_tree import Padded
from ._plan import LeafLayout, Plan, layouts, shapes_of


class Placement:
    """A plan laid on the devices: the shardings of the parameters, the optimizer state and the
    batch over one mesh, and padding on and off the stored leaves (inside jitted code)."""

    def __init__(self, plan: Plan, devices: tuple[jax.Device, ...]):
        self.plan = plan
        if list(plan.axes) == [AXIS]:
            self.mesh = line_mesh(devices)  # the mesh mgkit's batches are placed on
        else:
            grid = np.array(devices, dtype=object).reshape(tuple(plan.axes.values()))
            self.mesh = Mesh(grid, tuple(plan.axes), axis_types=(AxisType.Auto,) * len(plan.axes))
        self.rep = NamedSharding(self.mesh, P())
        self.split = NamedSharding(self.mesh, P(plan.batch_axis))
        self.batch_parts = plan.axes[plan.batch_axis]
        self.params = jax.tree_util.tree_map(self.sharding, plan.leaves)

    def in_force(self) -> Any:
        """A context manager that makes this mesh the one in force (``jax.set_mesh``), so that a
        loss function may name its axes (``jax.lax.with_sharding_constraint(x, P("data",
        "model"))``) while the step is traced and run."""
        return mesh_in_force(self.mesh)

    def batch_sharding(self, ax: int | None) -> NamedSharding:
        """The sharding of a batch leaf split along axis 0 (``ax=0``) or on every context (None)."""
        return self.rep if ax is None else self.split

    def opt_state(self, optimizer: optax.GradientTransformation) -> Any:
        """The shardings of the optimizer state: each leaf like its parameter's, others replicated."""
        shapes = jax.eval_shape(optimizer.init, self.plan_shapes())
        return param_like(
            optimizer, shapes, self.plan.leaves, lambda x, lay: self.sharding(lay), lambda x: self.rep
        )

    def sharding(self, lay: LeafLayout) -> NamedSharding:
        """The sharding of a stored leaf."""
        return NamedSharding(self.mesh, lay.partition)

    def pad(self, optimizer: Any, params: Any, opt_state: Any) -> tuple[Any, Any]:
        return self._each(optimizer, params, opt_state, LeafLayout.pad)

    def unpad(self, optimizer: Any, params: Any, opt_state: Any) -> tuple[Any, Any]:
        return self._each(optimizer, params, opt_state, LeafLayout.unpad)

    def _each(self, optimizer: Any, params: Any, opt_state: Any, how: Callable) -> tuple[Any, Any]:
        if not self.padding:
            return params, opt_state
        params = jax.tree_util.tree_map(lambda lay, x: how(lay, x), self.plan.leaves, params)
        opt_state = param_like(optimizer, opt_state, self.plan.leaves, lambda x, lay: how(lay, x), None)
        return params, opt_state

    def blocks(self, fn: Callable) -> Callable:
        """``fn(params, block, key, scale) -> (loss, aux, grads)`` of one block of a batch, run on
        each block where it lies (a ``shard_map`` over the batch axis; ``params`` whole, gathered
        by XLA): ``(params, blocks, keys, scale) -> (losses, auxes, grads)``, ``blocks`` and ``keys``
        stacked along a first axis split over the batch axis, the losses and aux stacked the same
        way, and the blocks' gradients summed in float32, padded and split as the parameters are
        stored: a reduce-scatter for a leaf split over the batch axis alone (each context receives
        only its share's sum), an all-reduce for the others."""
        axis = self.plan.batch_axis

        def scattered(lay: LeafLayout) -> int | None:
            """The axis of a leaf split over the batch axis alone, or None."""
            return next((i for i, names in enumerate(lay.spec) if names == (axis,)), None)

        def summed(lay: LeafLayout, g: jax.Array) -> jax.Array:
            g = lay.pad(g.astype(jnp.result_type(g.dtype, jnp.float32)))
            at = scattered(lay)
            if at is None:
                return jax.lax.psum(g, axis)
            return jax.lax.psum_scatter(g, axis, scatter_dimension=at, tiled=True)

        def local(params: Any, blocks: Any, keys: Any, scale: Any) -> tuple:
            first = lambda tree: jax.tree_util.tree_map(lambda x: x[0], tree)  # noqa: E731
            params = jax.lax.pcast(params, axis, to="varying")  # each block's own gradient, unsummed
            loss, aux, grads = fn(params, first(blocks), None if keys is None else keys[0], scale)
            stacked = jax.tree_util.tree_map(lambda x: x[None], (loss, aux))
            return (*stacked, jax.tree_util.tree_map(summed, self.plan.leaves, grads))

        def spec(lay: LeafLayout) -> P:
            at = scattered(lay)
            return P(*(axis if i == at else None for i in range(len(lay.shape))))

        out = (P(axis), P(axis), jax.tree_util.tree_map(spec, self.plan.leaves))
        return jax.shard_map(
            local, mesh=self.mesh, in_specs=(P(), P(axis), P(axis), P()), out_specs=out, axis_names={axis}
        )

    def lay(self, tree: Any) -> Any:
        """A tree of the parameters' stored shapes laid out as they are stored (inside jitted code)."""
        return jax.lax.with_sharding_constraint(tree, self.params)

    def own(self, tree: Any) -> Any:
        """A tree of the parameters' stored shapes in their own shapes (the padding sliced off)."""
        return jax.tree_util.tree_map(lambda lay, x: lay.unpad(x), self.plan.leaves, tree)

    @property
    def padding(self) -> bool:
        """Whether any leaf is stored padded."""
        return any(lay.padded != lay.shape for lay in layouts(self.plan.leaves))

    def read(self, params: Any) -> Any:
        """The stored parameters in their own shapes, as ``Trainer.params`` gives them (see ``own_leaf``)."""
        return jax.tree_util.tree_map(own_leaf, self.plan.leaves, params) if self.padding else params

    def read_state(self, optimizer: Any, opt_state: Any) -> Any:
        """The stored optimizer state in the parameters' own shapes (see ``own_leaf``)."""
        if not self.padding:
            return opt_state
        return param_like(optimizer, opt_state, self.plan.leaves, lambda x, lay: own_leaf(lay, x), None)

    def as_stored(self, optimizer: Any, params: Any, opt_state: Any, where: str) -> tuple[Any, Any]:
        """A state given back (``Trainer.step_fn``) laid out as stored. A state stored already
        comes back as it is; else numpy leaves (padded leaves as ``read`` gives them) are padded
        and split from the host, each device receiving only its shard (``from_host``), and jax
        arrays (in their own shapes or as stored) are padded and laid out in one program. A leaf
        of another shape is refused by name (``where``: the caller, for the message)."""
        flat, treedef = jax.tree_util.tree_flatten((params, opt_state))
        lays = layouts(self.plan.leaves) + [
            spot.layout
            for spot in jax.tree_util.tree_leaves(
                param_like(optimizer, opt_state, self.plan.leaves, lambda x, lay: _Spot(x, lay), _Spot)
            )
        ]
        if all(
            isinstance(x, jax.Array) and (lay is None or x.shape == lay.padded)
            for x, lay in zip(flat, lays, strict=True)
        ):
            return params, opt_state
        for x, lay in zip(flat, lays, strict=True):
            if lay is not None and np.shape(x) not in (lay.shape, lay.padded):
                raise ValueError(
                    f"{where}: the state's leaf {lay.path!r} (or its optimizer state) has shape "
                    f"{np.shape(x)}; expected {lay.shape} as Trainer.params reads it, or {lay.padded} "
                    "as the step returns it"
                )
        targets = [self.rep if lay is None else self.sharding(lay) for lay in lays]
        out = list(flat)
        on_devices = [i for i, x in enumerate(flat) if isinstance(x, jax.Array)]
        for i, (x, lay) in enumerate(zip(flat, lays, strict=True)):
            if not isinstance(x, jax.Array):
                out[i] = from_host(x, np.shape(x) if lay is None else lay.padded, targets[i])
        pads = [lays[i] for i in on_devices]
        program = jax.jit(
            lambda xs: [x if lay is None else lay.pad(x) for lay, x in zip(pads, xs, strict=True)],
            out_shardings=[targets[i] for i in on_devices],
        )
        for i, x in zip(on_devices, program([flat[i] for i in on_devices]), strict=True):
            out[i] = x
        return jax.tree_util.tree_unflatten(treedef, out)

    def shapes(self, optimizer: Any, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """The stored state as ``jax.ShapeDtypeStruct`` leaves of the leaves' own shapes with
        their stored shardings (``mg.show_sharding`` then marks a padded leaf's short blocks)."""
        params = jax.tree_util.tree_map(lambda lay, x: shape_of(x, lay.shape), self.plan.leaves, params)
        opt_state = param_like(
            optimizer, opt_state, self.plan.leaves, lambda x, lay: shape_of(x, lay.shape), shape_of
        )
        return params, opt_state

    def stored(self, optimizer: Any, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """The state as checkpoints take it: each padded leaf as a ``Padded`` (its own shape kept)."""

        def wrap(lay: LeafLayout, x: Any) -> Any:
            return x if lay.padded == lay.shape else Padded(x, lay.shape)

        return self._each(optimizer, params, opt_state, wrap)

    @staticmethod
    def unstored(tree: Any) -> Any:
        """A restored tree's ``Padded`` leaves as their stored arrays."""
        return jax.tree_util.tree_map(lambda x: x.array if isinstance(x, Padded) else x, tree)

    def create(self, make: Callable[[], Any]) -> Any:
        """Runs ``make()`` as one program whose outputs are created split (padded as stored)."""
        return self.creator(make)()

    def creator(self, make: Callable[[], Any]) -> Callable[[], Any]:
        """``make`` jitted to create its outputs split and padded (``.lower()`` for its memory)."""

        def padded():
            return jax.tree_util.tree_map(lambda lay, x: lay.pad(x), self.plan.leaves, make())

        return jax.jit(padded, out_shardings=self.params)

    def place(self, params: Any) -> Any:
        """Fresh copies of ``params`` padded and split (never the caller's buffers)."""
        padded = lambda t: jax.tree_util.tree_map(lambda lay, x: lay.pad(jnp.copy(x)), self.plan.leaves, t)  # noqa: E731
        return jax.jit(padded, out_shardings=self.params)(params)

    def init(self, optimizer: optax.GradientTransformation, params: Any) -> Any:
        """The optimizer's state for the stored ``params``, split like them (init on the unpadded)."""

        def init(p):
            plain = jax.tree_util.tree_map(lambda lay, x: lay.unpad(x), self.plan.leaves, p)
            return self.pad(optimizer, plain, optimizer.init(plain))[1]

        return jax.jit(init, out_shardings=self.opt_state(optimizer))(params)

    def plan_shapes(self) -> Any:
        """The parameters' (unpadded) shapes and dtypes."""
        return shapes_of(self.plan.leaves)


def mesh_in_force(mesh: Mesh) -> Any:
    """``jax.set_mesh(mesh)`` as a context manager (``jax.sharding.use_mesh`` where JAX has no
    ``set_mesh``)."""
    set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
    return set_mesh(mesh)


def own_leaf(lay: LeafLayout, x: jax.Array) -> Any:
    """A stored leaf as the user reads it: one stored padded read to a new numpy array of its own
    shape, shard by shard (``to_host``: no context ever holds it whole, and nothing is left on
    the devices), any other the stored array itself (no copy)."""
    if lay.padded == lay.shape or np.shape(x) != lay.padded:
        return x
    return to_host(x, lay.shape)


def shape_of(x: jax.Array, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
    """A stored array as a ``jax.ShapeDtypeStruct`` of ``shape`` (default its own) with its sharding."""
    return jax.ShapeDtypeStruct(np.shape(x) if shape is None else shape, x.dtype, sharding=x.sharding)


class _Spot:
    """An optimizer-state leaf's parameter layout (None: a leaf such as a count), for ``as_stored``;
    made from (the leaf, its layout) as ``param_like`` calls it. Not a pytree node."""

    def __init__(self, leaf: Any, layout: LeafLayout | None = None):
        self.layout = layout


def param_like(optimizer: Any, state: Any, leaves: Any, f: Callable, other: Callable | None) -> Any:
    """``f(state_leaf, layout)`` on every optimizer-state leaf that stands for a parameter (optax's
    ``tree_map_params``: each copy of the parameter tree, as adam's mu and nu; ``leaves`` is the
    tree of layouts), ``other`` on the rest (None: kept). An optimizer whose ``init`` optax cannot
    map is matched by shape: a state leaf of a parameter's shape is taken for that parameter."""
    try:
        return optax.tree_map_params(optimizer, f, state, leaves, transform_non_params=other)
    except Exception:  # noqa: BLE001 - an init that needs real arrays: match by shape
        by_shape: dict = {}
        for lay in layouts(leaves):
            by_shape.setdefault(lay.shape, lay)
            by_shape.setdefault(lay.padded, lay)

        def one(x: Any) -> Any:
            lay = by_shape.get(tuple(np.shape(x))) if np.ndim(x) else None
            if lay is not None:
                return f(x, lay)
            return x if other is None else other(x)

        return jax.tree_util.tree_map(one, state)
