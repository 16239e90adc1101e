"""A pipeline step's schedule as a value, and the one runner that executes any schedule.

A schedule is the order of a step's calls: ``Op(stage, microbatch, kind)``, a stage's forward
or backward of one microbatch. Each schedule says the order of each stage's own calls; ``merge``
interleaves them into one dispatch order, tick by tick, as the devices would run them (a call
joins a tick once the calls it needs were dispatched in an earlier one).

- ``gpipe``: every stage runs every microbatch forward, then every one backward (last first),
  so each keeps all M microbatches' activations until its backwards begin.
- ``one_f_one_b`` (1F1B): stage s runs min(S - s - 1, M) forwards, then alternates one
  forward and one backward, then the backwards left; it keeps at most S - s microbatches'
  activations at once, and the gradients are GPipe's.

``run`` executes an order: it moves each activation and gradient between neighbouring stages
(recorded ``Kind.TRANSFER``), keeps each forward's residuals until its backward, counts the
bytes each stage keeps at once, and watches each call's device times for the picture.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from .. import _clock
from .._ledger import Kind
from ._stage import Stage, kept_nbytes, placed, sum_losses


class Op(NamedTuple):
    """One call of a pipeline step."""

    stage: int  # the stage that runs it
    microbatch: int  # the microbatch it runs on
    kind: str  # Kind.FORWARD or Kind.BACKWARD


def gpipe(stages: int, microbatches: int) -> tuple[Op, ...]:
    """Every microbatch forward, then every one backward, last first."""
    own = [
        [Op(s, m, Kind.FORWARD) for m in range(microbatches)]
        + [Op(s, m, Kind.BACKWARD) for m in reversed(range(microbatches))]
        for s in range(stages)
    ]
    return merge(own)


def one_f_one_b(stages: int, microbatches: int) -> tuple[Op, ...]:
    """1F1B: per stage, forwards to fill the pipeline, then one forward and one backward in
    turn, then the backwards left."""
    own = []
    for s in range(stages):
        warm = min(stages - s - 1, microbatches)
        calls = [Op(s, m, Kind.FORWARD) for m in range(warm)]
        for m in range(microbatches - warm):
            calls += [Op(s, warm + m, Kind.FORWARD), Op(s, m, Kind.BACKWARD)]
        calls += [Op(s, m, Kind.BACKWARD) for m in range(microbatches - warm, microbatches)]
        own.append(calls)
    return merge(own)


SCHEDULES: dict[str, Callable[[int, int], tuple[Op, ...]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def needs(op: Op, stages: int) -> tuple[Op, ...]:
    """The calls ``op`` takes its inputs from."""
    if op.kind == Kind.FORWARD:
        return () if op.stage == 0 else (Op(op.stage - 1, op.microbatch, Kind.FORWARD),)
    own = Op(op.stage, op.microbatch, Kind.FORWARD)
    return (own,) if op.stage == stages - 1 else (own, Op(op.stage + 1, op.microbatch, Kind.BACKWARD))


def merge(own: Sequence[Sequence[Op]]) -> tuple[Op, ...]:
    """One dispatch order from each stage's order: at each tick, every stage whose next call's
    inputs were dispatched in an earlier tick dispatches it."""
    heads, done, order = [0] * len(own), set(), []
    while len(order) < sum(len(calls) for calls in own):
        tick = []
        for s, calls in enumerate(own):
            if heads[s] < len(calls) and all(n in done for n in needs(calls[heads[s]], len(own))):
                tick.append(calls[heads[s]])
                heads[s] += 1
        if not tick:
            raise ValueError(f"the stages' orders wait on each other: {list(map(list, own))}")
        order += tick
        done.update(tick)
    return tuple(order)


def live(order: Sequence[Op], stages: int) -> tuple[int, ...]:
    """The most microbatches each stage keeps activations for at once (forward run, backward
    not yet) in ``order``."""
    now, most = [0] * stages, [0] * stages
    for op in order:
        now[op.stage] += 1 if op.kind == Kind.FORWARD else -1
        most[op.stage] = max(most[op.stage], now[op.stage])
    return tuple(most)


class Block(NamedTuple):
    """A call whose device times are watched, for the step's events."""

    kind: str  # Kind.FORWARD, Kind.BACKWARD or Kind.UPDATE
    stage: int  # the stage that ran it
    microbatch: int | None  # its microbatch (None: an update)
    timing: _clock.Timing  # when it ran on the stage's device


class Ran(NamedTuple):
    """What one run of a schedule gives."""

    loss: jax.Array  # the batch's mean loss, on the last stage's context
    grads: list  # each stage's gradient, on its context
    kept: tuple[int, ...]  # the most bytes each stage kept for its backwards at once
    blocks: list[Block]  # every forward and backward, in dispatch order


def run(order: Sequence[Op], stages: Sequence[Stage], params: list, xs: list, ys: list, info: dict) -> Ran:
    """Executes ``order`` on the stages: ``xs``, ``ys``: each microbatch's inputs on the first
    stage and targets (with its weight) on the last; ``info``: what every move records."""
    count = len(stages)
    outs: dict[tuple[int, int], Any] = {}  # (stage, microbatch) -> its forward's output, until moved on
    grads_in: dict[tuple[int, int], Any] = {}  # (stage, microbatch) -> its input's gradient
    saved: dict[tuple[int, int], tuple] = {}  # what a forward keeps for its backward, and its bytes
    timings: dict[Op, _clock.Timing] = {}
    accs: list[Any] = [None] * count
    losses: list[Any] = [None] * len(xs)
    now, kept = [0] * count, [0] * count
    for op in order:
        s, mb = op.stage, op.microbatch
        stage = stages[s]
        t0 = time.perf_counter()
        if op.kind == Kind.FORWARD:
            a, after = _arrive(xs[mb] if s == 0 else outs.pop((s - 1, mb)), op, stage, timings, count, info)
            rest = ys[mb] if stage.last else ()
            t0 = time.perf_counter()
            out, keep = stage.forward(params[s], a, rest)
            timings[op] = _clock.watch(stage.ctx.device, out, t0, after)
            nbytes = kept_nbytes(keep, params[s])
            saved[(s, mb)] = (keep, nbytes)
            now[s] += nbytes
            kept[s] = max(kept[s], now[s])
            if stage.last:
                losses[mb] = out
            else:
                outs[(s, mb)] = out
        else:
            g = None if stage.last else grads_in.pop((s + 1, mb))
            g, after = _arrive(g, op, stage, timings, count, info)
            keep, nbytes = saved.pop((s, mb))  # what the backward needed is freed as it goes
            now[s] -= nbytes
            t0 = time.perf_counter()
            accs[s], g = stage.backward(params[s], keep, g, accs[s])
            timings[op] = _clock.watch(stage.ctx.device, (accs[s], g), t0, after)
            if not stage.first:
                grads_in[(s, mb)] = g
    blocks = [Block(op.kind, op.stage, op.microbatch, timings[op]) for op in order]
    return Ran(sum_losses(losses), accs, tuple(kept), blocks)


def _arrive(
    value: Any, op: Op, stage: Stage, timings: dict, count: int, info: dict
) -> tuple[Any, tuple[_clock.Timing, ...]]:
    """``op``'s input moved onto its stage from the neighbour that made it (recorded), and the
    timing it waits for: (the input, (its move's timing,) or () where nothing moves)."""
    forward = op.kind == Kind.FORWARD
    if value is None or (forward and op.stage == 0):
        return value, ()
    t0 = time.perf_counter()
    what = "activations" if forward else "gradients"
    value = placed(
        value,
        stage.ctx,
        Kind.TRANSFER,
        {**info, "what": what, "stage": op.stage, "microbatch": op.microbatch},
    )
    producer = timings[needs(op, count)[-1]]
    return value, (_clock.watch(stage.ctx.device, value, t0, (producer,)),)
