"""The three public fits: ``fit`` (one model, data-parallel), ``fit_per_device`` (one model per
context) and ``fit_many`` (K models, several per device)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _contexts, _spmd
from .._ledger import Kind
from .._spmd import Batch, Targets
from .._transfer import place, staged
from ._checks import (
    check_X,
    encode,
    float_dtype,
    initial,
    options,
    penalty,
    private,
    row_sets,
    weights,
)
from ._driver import Job, conclude, drive, mapped_job, progress_run
from ._model import Model
from ._programs import (
    ARG_NAMES,
    MODELS,
    REPL,
    ROWS,
    local_program,
    make_spec,
    per_device_program,
    per_device_rows,
    place_args,
    scalar_args,
)
from ._results import Fit, every_model, fetch_facts, model_of, split_block, unpack_facts
from ._solver import Args


def fit(
    X: Any,
    y: Any,
    l2: float | None = None,
    *,
    C: float | None = None,
    sample_weight: Any = None,
    solver: str = "auto",
    max_iter: int | None = None,
    tol: float = 1e-5,
    learning_rate: float = 0.1,
    init: Any = None,
    contexts: Any = None,
    progress: bool | None = None,
) -> Model:
    """Fits one logistic regression with its rows split across contexts (data-parallel).

    Each device computes the loss, gradient (and Hessian) of its rows; the shares are summed
    every iteration, so every device holds the same model and the answer does not depend on
    how many contexts share the work. Any number of rows works.

    Args:
      X: (n, d) features, numpy or JAX.
      y: (n,) labels, any k >= 2 distinct sortable values.
      l2: penalty in ``mean(log-loss) + l2 * ||w||^2``. Default: scikit-learn's default
        ``C=1``, i.e. ``l2 = 1 / (2 * n)``.
      C: scikit-learn's inverse penalty instead of l2 (``l2 = 1 / (2 * C * n)``; with
        sample_weight, n is their sum); ``C=np.inf`` is no penalty (``l2=0``), as in scikit-learn.
      sample_weight: (n,) non-negative row weights (the mean becomes a weighted mean, so only
        their ratios matter: they are scaled to a mean of one on the host, in float64).
      solver: ``"auto"`` (Newton when the Hessian is small, else L-BFGS: the same choice in
        every layout), ``"newton"``,
        ``"lbfgs"``, or ``"gd"``: fixed ``learning_rate`` for exactly ``max_iter`` steps.
      max_iter: iterations at most (gd: steps). Default 100 (newton), 1000 (lbfgs), 10000 (gd).
      tol: the stopping rule, the same in every layout: Newton and L-BFGS stop when every
        gradient component is at most ``tol`` and the estimated distance to the minimum
        objective (the decrement ``-g . d / 2`` of the next step d) is at most ``tol`` times the
        objective, or below the float type's epsilon (an objective that goes to zero: separable
        classes without a penalty). Newton's estimate is second order (from the Hessian its last
        step was taken with: k iterations solve k systems); L-BFGS's uses its inverse-Hessian
        approximation and can understate the distance a few times on ill-conditioned problems
        (use ``solver="newton"`` or a smaller tol there). gd: converged when every gradient
        component is at most ``tol`` (it takes its fixed steps regardless).
      learning_rate: gd's step size.
      init: a Model or ``(w, b)`` to start from (default zeros).
      contexts: context names, a count (the first n) or None for every context in the map.
      progress: None: a progress bar once the fit has run for a second; True: at once; False: never.

    Returns:
      A Model; its arrays are replicated on every context's device.

    >>> import mgkit as mg, numpy as np
    >>> X = np.array([[-2.0], [-1.0], [1.0], [2.0]]); y = np.array([0, 0, 1, 1])
    >>> m = mg.logreg.fit(X, y, l2=0.01, contexts=2)
    >>> mg.logreg.predict(m, X).tolist(), bool(m.info.converged)
    ([0, 0, 1, 1], True)
    """
    where = "logreg.fit"
    opts = options(solver, max_iter, tol, learning_rate, progress, where)
    targets = _spmd.resolve(contexts, where)
    X = check_X(X, where)
    n, d = X.shape
    y_idx, classes = encode(y, n, where)
    omega, total = (None, float(n)) if sample_weight is None else weights(sample_weight, n, where)
    omega = None if omega is None else omega[:, None]
    l2v = penalty(l2, C, total, where)
    c = 1 if len(classes) == 2 else len(classes)
    W0, b0 = initial(init, d, c, where)
    devices = tuple(dict.fromkeys(targets.devices))  # two names on one device share its rows
    if len({dev.platform for dev in devices}) > 1:
        kinds = ", ".join(f"{ctx.name}->{ctx.short}" for ctx in targets.contexts)
        raise ValueError(
            f"{where}: a data-parallel fit sums every iteration over one SPMD program, which needs "
            f"devices of one kind, but the contexts mix kinds ({kinds}). Pass contexts=[...] naming "
            "devices of one kind, or fit one model per context with mg.logreg.fit_per_device"
        )
    first = {}  # each device under the first of the given contexts that names it
    for ctx in targets.contexts:
        first.setdefault(ctx.device, ctx)
    targets = Targets(tuple(first.values()), True)
    k = len(devices)
    spec = make_spec(opts, d, c, devices[0].platform, True, rows=-(-n // k), models=1, held=n)
    sizes = _spmd.shares(n, k)
    dtype = float_dtype()
    run = progress_run("logreg.fit", targets, sizes, [1] * k, spec)
    padded = len(set(sizes)) > 1
    weighted = omega is not None or padded  # else every row weighs one, made on the devices
    if padded and omega is None:
        omega = np.ones((n, 1), dtype)
    start = bool(W0.any() or b0.any())  # else the start from zeros is made on the devices
    parts = Args(
        X,
        y_idx,
        omega if weighted else None,
        W0.reshape(d, 1, c).astype(dtype) if start else None,
        b0.reshape(1, c).astype(dtype) if start else None,
        np.asarray([l2v], dtype),
    )
    # one placement; the arrays made here (all but X) need no private copies
    placed = place_args(parts, Args(0, 0, 0, None, None, None), n, targets, sizes, own=Args._fields[1:])
    if padded:  # padding rows repeat a real row: zero their weight
        keep = np.zeros((k * max(sizes), 1), dtype)
        keep[_spmd.padding(sizes)[1]] = 1
        placed = placed._replace(omega=placed.omega * keep)
    args = (placed, *scalar_args(opts, dtype, devices))
    owners = [list(range(k))]  # every context holds the one model
    try:
        job = mapped_job(spec, targets, "rows", args)
        facts = drive([job], run, opts.progress, lambda fits: fetch_facts(fits, [(0, 0)]), owners)
        conclude(run, facts, [""], owners, where, spec.solver, ([X], ["X"]))
    finally:
        run.close()
    return model_of(job.result, 0, classes, facts.info(0, np.asarray(l2v, dtype), spec.solver), c)


def _names(*names: str) -> Callable[[int], str]:
    return lambda i: names[i]


def _per_device_data(data: Any, contexts: Any, where: str) -> tuple[Any, list[tuple]]:
    """``fit_per_device``'s data, checked: the contexts it names and, per context, its
    ``(X, y_idx, classes)``; a data function is run inside ``mg.on`` of each context."""
    if callable(data) and not isinstance(data, Mapping):
        targets = _spmd.resolve(contexts, where)
        made = {}
        for name in targets.names:
            with _contexts.on(name):
                made[name] = data(name)
        data, source = made, "the data function returned, for context {!r},"
    elif isinstance(data, Mapping):
        if contexts is not None:
            raise ValueError(f"{where}: contexts= is for a data function; a mapping names its contexts")
        if not data:
            raise ValueError(
                f"{where}: no data; pass {{context: (X, y), ...}} or a function context -> (X, y)"
            )
        targets = _spmd.resolve(list(data), where)
        source = "the data for context {!r} is"
    else:
        raise TypeError(
            f"{where}: data must be a mapping {{context: (X, y)}} or a function context -> (X, y), got "
            f"{type(data).__name__}"
        )
    parts = []
    for name in targets.names:
        pair = data[name]
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise TypeError(
                f"{where}: {source.format(name)} a {type(pair).__name__}; expected a pair (X, y) with X of "
                "shape (n, d) and y of shape (n,)"
            )
        X = check_X(pair[0], where, f"X for context {name!r}")
        y_idx, classes = encode(pair[1], X.shape[0], where, f"y for context {name!r}")
        parts.append((X, y_idx, classes))
    return targets, parts


def fit_per_device(
    data: Mapping[str, tuple] | Callable[[str], tuple],
    l2: Any = None,
    *,
    C: Any = None,
    solver: str = "auto",
    max_iter: int | None = None,
    tol: float = 1e-5,
    learning_rate: float = 0.1,
    init: Any = None,
    contexts: Any = None,
    progress: bool | None = None,
) -> dict[str, Model]:
    """Fits one model per context, each on its own data and device, all at once.

    Args:
      data: ``{context: (X, y)}``, or a function ``context -> (X, y)`` that makes each
        context's data; it runs inside ``mg.on(context)``, so arrays it creates land there.
      l2, C: the penalty, shared by every model, or a ``{context: value}`` mapping of
        private values. Default: ``C=1`` as in scikit-learn; ``C=np.inf``: no penalty.
      init: a Model or ``(w, b)`` for every context, or a ``{context: ...}`` mapping.
      contexts: with a data function, the contexts to fit on (default: every context).
      solver, max_iter, tol, learning_rate, progress: as in ``fit``.

    Returns:
      ``{context: Model}``; each model's arrays live on its context's device.

    >>> import mgkit as mg, numpy as np
    >>> _ = mg.use_contexts("a->cpu0;b->cpu1", verbose=False)
    >>> X = np.array([[-2.0], [-1.0], [1.0], [2.0]])
    >>> models = mg.logreg.fit_per_device({"a": (X, [0, 0, 1, 1]), "b": (X, [1, 1, 0, 0])}, l2=0.01)
    >>> {k: mg.logreg.predict(m, X).tolist() for k, m in models.items()}
    {'a': [0, 0, 1, 1], 'b': [1, 1, 0, 0]}
    >>> mg.where(models["b"].w)
    'b'
    """
    where = "logreg.fit_per_device"
    opts = options(solver, max_iter, tol, learning_rate, progress, where)
    targets, parts = _per_device_data(data, contexts, where)
    l2s = private(l2, targets, where, "l2")
    Cs = private(C, targets, where, "C")
    inits = private(init, targets, where, "init")
    dtype = float_dtype()
    same = len({(X.shape, len(cl)) for X, _, cl in parts}) == 1
    shapes = [(X.shape[1], 1 if len(cl) == 2 else len(cl)) for X, _, cl in parts]
    penalties, starts, specs = [], [], []
    held = sum(X.shape[0] for X, _, _ in parts)
    sharing = collections.Counter(targets.devices)  # contexts on one device are fitted together
    for i, ((X, _, _), (d, c)) in enumerate(zip(parts, shapes, strict=True)):
        penalties.append(penalty(l2s[i], Cs[i], X.shape[0], where))
        starts.append(initial(inits[i], d, c, where))
        platform = targets.devices[i].platform
        specs.append(make_spec(opts, d, c, platform, False, X.shape[0], sharing[targets.devices[i]], held))
    run = progress_run(
        "logreg.fit_per_device", targets, [X.shape[0] for X, _, _ in parts], [1] * len(parts), specs[0]
    )
    try:
        owners = range(len(targets.names))
        if targets.spmd and same:
            job = _per_device_spmd(parts, starts, penalties, targets, specs[0], opts, dtype)
            # every model's facts in one fetch
            facts = drive([job], run, opts.progress, lambda got: unpack_facts(np.asarray(got[0][1])), owners)
            blocks = {s.device: s.data for s in job.result[0].addressable_shards}  # model i's w and b
            arrays = [
                split_block(blocks[device], c) for device, (_, c) in zip(targets.devices, shapes, strict=True)
            ]
        else:
            jobs, slots = _per_device_local(parts, starts, penalties, targets, specs, opts, dtype)
            facts = drive(jobs, run, opts.progress, lambda fits: fetch_facts(fits, slots), owners)
            each = [every_model(job.result.W, job.result.b, job.spec.c) for job in jobs]
            arrays = [each[j][m] for j, m in slots]
        data = ([X for X, _, _ in parts], [f"X for context {nm!r}" for nm in targets.names])
        names = list(targets.names)
        conclude(run, facts, names, owners, where, specs[0].solver, data)
    finally:
        run.close()
    return {
        name: Model(w, b, classes, facts.info(i, np.asarray(l2v, dtype), spec.solver))
        for i, (name, (w, b), (_, _, classes), l2v, spec) in enumerate(
            zip(names, arrays, parts, penalties, specs, strict=True)
        )
    }


def _per_device_spmd(parts, starts, penalties, targets, spec, opts, dtype) -> Job:
    """One SPMD program: device i fits model i on its own rows. Each X is put on its device
    (one already there stays: no copy) and the blocks form one row-sharded array; model i's
    labels, penalty and start go to device i, all in one placement. The job's result: the M
    models' w and b, (M * (d + 1), c) with model i's block on device i, and their packed facts
    (``pack_facts``)."""
    k, n = len(targets.names), parts[0][0].shape[0]
    # host X bound for CPU devices are copied all at once, over two threads (eight 1.25 MB
    # copies one after another take twice as long)
    Xs = [
        place([X], ctx, Kind.PUT, private=True)[0]
        for X, ctx in zip(staged([X for X, _, _ in parts], targets.devices), targets.contexts, strict=True)
    ]
    sharding = jax.sharding.NamedSharding(_spmd.mesh(targets.devices), ROWS)
    X = jax.make_array_from_single_device_arrays((k * n, Xs[0].shape[1]), sharding, Xs)
    # Made here, never the caller's: no private copy. Row weights (all one) and a start from
    # zeros are made on the devices.
    rows = per_device_rows(parts, penalties, starts, dtype)
    (rows,) = _spmd.place_spmd(
        Batch([rows], None, (0,), len(rows), _names("labels, l2 and start")),
        targets,
        (len(rows) // k,) * k,
        own=True,
    )
    args = (X, rows, *scalar_args(opts, dtype, targets.devices))
    return mapped_job(spec, targets, "devices", args)


def _per_device_local(parts, starts, penalties, targets, specs, opts, dtype) -> tuple[list[Job], list]:
    """One program per device, all dispatched before any is waited on. The models of contexts
    that share a device (with data of one shape) are fitted together, stacked: eight contexts on
    one GPU cost about one fit, not eight. Returns the jobs and, per context, (its job's index,
    the index of its model in the job's fit)."""
    groups: dict[tuple, list[int]] = {}
    for i, ((X, _, _), spec) in enumerate(zip(parts, specs, strict=True)):
        groups.setdefault((targets.devices[i], spec, X.shape), []).append(i)
    scalars = scalar_args(opts, dtype)
    jobs: list[Job] = []
    slots: list = [None] * len(parts)
    for (_, spec, _), members in groups.items():
        Xs = tuple(place([parts[i][0]], targets.contexts[i], Kind.PUT)[0] for i in members)
        # the group's labels, penalties and starts: one placement (row weights are made there)
        rows = per_device_rows(*([seq[i] for i in members] for seq in (parts, penalties, starts)), dtype)
        (rows,) = place([rows.reshape(len(members), -1)], targets.contexts[members[0]], Kind.PUT)
        stacked = len(members) > 1
        program = per_device_program(spec, stacked)
        jobs.append(
            Job(spec, lambda _, program=program: program, (Xs if stacked else Xs[0], rows, *scalars), members)
        )
        for m, i in enumerate(members):
            slots[i] = (len(jobs) - 1, m)
    return jobs, slots


# -- fit_many: K models, several per device ------------------------------------------------


def fit_many(
    X: Any,
    y: Any,
    l2: Any = None,
    *,
    C: Any = None,
    rows: Sequence[Any] | None = None,
    solver: str = "auto",
    max_iter: int | None = None,
    tol: float = 1e-5,
    learning_rate: float = 0.1,
    contexts: Any = None,
    progress: bool | None = None,
) -> Model:
    """Fits K models on one data set, spread over the contexts, several per device at once.

    Args:
      X, y: the data, as in ``fit``; every device gets a copy.
      l2: a list of K penalties (a sweep); or one value for every model when ``rows`` is given.
      C: scikit-learn's C instead of l2 (one value or a list; ``np.inf``: no penalty).
      rows: K sets of row indices (repeats allowed: bootstrap samples); model i is fitted on
        ``X[rows[i]], y[rows[i]]``.
      solver, max_iter, tol, learning_rate, contexts, progress: as in ``fit``.

    Returns:
      One Model whose arrays have a leading axis of K models (``unstack`` gives a list), on the
      first context. Each model equals fitting it alone.

    >>> import mgkit as mg, numpy as np
    >>> X = np.array([[-2.0], [-1.0], [1.0], [2.0]]); y = np.array([0, 0, 1, 1])
    >>> sweep = mg.logreg.fit_many(X, y, l2=[0.001, 0.01, 0.1])
    >>> sweep.w.shape, [round(float(w), 2) for w in sweep.w[:, 0]]
    ((3, 1), [4.12, 2.42, 1.11])
    """
    where = "logreg.fit_many"
    opts = options(solver, max_iter, tol, learning_rate, progress, where)
    targets = _spmd.resolve(contexts, where)
    X = check_X(X, where)
    n, d = X.shape
    y_idx, classes = encode(y, n, where)
    dtype = float_dtype()
    if rows is not None:
        counts = row_sets(rows, n, where)
        k_models = len(counts)
        sizes_n = counts.sum(axis=1)
    else:
        counts, sizes_n = None, None
    values = l2 if l2 is not None else C
    name = "l2" if l2 is not None else "C"
    if isinstance(values, Sequence | np.ndarray) and not isinstance(values, str):
        values = list(np.asarray(values).tolist()) if isinstance(values, np.ndarray) else list(values)
        if not values:
            raise ValueError(
                f"{where}: {name} is an empty list; give one value per model, e.g. {name}=[1e-4, 1e-3]"
            )
        if rows is not None and len(values) != k_models:
            raise ValueError(
                f"{where}: {name} has {len(values)} values but rows has {k_models} sets; give one {name} "
                f"per row set, or a single {name} for all"
            )
        k_models = len(values)
    elif rows is None:
        raise ValueError(
            f"{where}: nothing to sweep; give a list of penalties (l2=[1e-4, 1e-3, ...]) or of row sets "
            "(rows=[idx0, idx1, ...]) to fit one model each"
        )
    else:
        values = [values] * k_models
    per_n = sizes_n if sizes_n is not None else np.full(k_models, n)
    penalties = [
        penalty(v if name == "l2" else None, v if name == "C" else None, float(m), where)
        for v, m in zip(values, per_n, strict=True)
    ]
    c = 1 if len(classes) == 2 else len(classes)
    used = min(k_models, len(targets.names))
    targets = targets.first(used)
    platform, per = targets.devices[0].platform, -(-k_models // used)
    spec = make_spec(opts, d, c, platform, False, rows=n, models=per, held=n * used)
    chunks = [per] * used if targets.spmd else list(_spmd.shares(k_models, used))
    padded = sum(chunks)
    order = list(range(k_models)) + [k_models - 1] * (padded - k_models)  # repeats the last model
    pen = np.asarray([penalties[i] for i in order], dtype)
    omega = np.ones((n, 1), dtype) if counts is None else counts[order].T.astype(dtype)
    W0, b0 = np.zeros((d, padded, c), dtype), np.zeros((padded, c), dtype)
    run = progress_run("logreg.fit_many", targets, [n] * used, chunks, spec)
    try:
        jobs, slots = _many_jobs(
            Args(X, y_idx, omega, W0, b0, pen), counts is not None, targets, chunks, spec, opts
        )
        slots = slots[:k_models]
        owners = np.repeat(np.arange(len(chunks)), chunks)[:k_models]
        facts = drive(jobs, run, opts.progress, lambda fits: fetch_facts(fits, slots), owners)
        out = Fit(*_gathered(jobs, targets), None)
        labels = [f"model {j}" for j in range(k_models)]
        conclude(run, facts, labels, owners, where, spec.solver, ([X], ["X"]))
    finally:
        run.close()
    info = facts.info(slice(None), pen[:k_models], spec.solver)
    return model_of(out, slice(0, k_models), classes, info, c)


def _many_jobs(
    parts: Args, drawn: bool, targets: Targets, chunks: list, spec, opts
) -> tuple[list[Job], list]:
    """``fit_many``'s jobs: one SPMD program, each device fitting its chunk of the models on all
    the rows, or one program per context. ``parts``: every model's arrays (row weights per
    model when ``drawn``: bootstrap counts). Returns the jobs and, per model, (its job, its
    index in the job's fit)."""
    dtype = parts.l2.dtype
    if targets.spmd:
        axes = Args(None, None, 1 if drawn else None, 1, 0, 0)
        names = ARG_NAMES._replace(omega="rows")
        placed = place_args(parts, axes, sum(chunks), targets, tuple(chunks), names=names)
        args = (placed, *scalar_args(opts, dtype, targets.devices))
        job = mapped_job(spec, targets, "models", args, MODELS if drawn else REPL)
        return [job], [(0, j) for j in range(sum(chunks))]
    jobs, start, slots = [], 0, []
    scalars = scalar_args(opts, dtype)
    for i, (ctx, m) in enumerate(zip(targets.contexts, chunks, strict=True)):
        part = slice(start, start + m)
        start += m
        mine = parts._replace(
            omega=parts.omega[:, part] if drawn else parts.omega,
            W0=parts.W0[:, part],
            b0=parts.b0[part],
            l2=parts.l2[part],
        )
        args = Args(*place(list(mine), ctx, Kind.REPLICATE))
        program = local_program(spec)
        jobs.append(Job(spec, lambda _, program=program: program, (args, *scalars), [i]))
        slots += [(i, j) for j in range(m)]
    return jobs, slots


def _gathered(jobs: list[Job], targets: Targets) -> tuple:
    """``fit_many``'s W and b, every model's, on the first context."""
    first = targets.contexts[0]
    if targets.spmd:
        got = {"from": "+".join(targets.names)}
        return tuple(place(list(jobs[0].result[:2]), first, Kind.GATHER, got))
    moved = [place(list(job.result[:2]), first, Kind.GATHER) for job in jobs]
    return tuple(jnp.concatenate(f, axis=1 - j) for j, f in enumerate(zip(*moved, strict=True)))
