"""The fitted model: pure data, and prediction and scoring (pure, jittable)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .. import _contexts
from .._ledger import Kind
from .._numbers import real
from .._transfer import place

HI = jax.lax.Precision.HIGHEST


class ConvergenceWarning(UserWarning):
    """A fit stopped before its gradient reached the tolerance."""


@dataclasses.dataclass(frozen=True)
class FitInfo:
    """How a fit went: host numpy (the fit fetches these facts once, when it ends), a leading
    axis of K models for ``fit_many``.

    Attributes:
      loss: the objective at each iteration run (index 0: the initial model), NaN after a
        model's last (stacked models stop on their own); ``history()`` gives the filled part.
      iterations: iterations run.
      converged: whether the gradient reached the tolerance.
      grad_norm: the largest absolute gradient component at the returned model.
      l2: the penalty the model was fitted with.
      solver: ``newton``, ``lbfgs`` or ``gd``.
    """

    loss: Any
    iterations: Any
    converged: Any
    grad_norm: Any
    l2: Any
    solver: str = "newton"

    def history(self) -> np.ndarray:
        """The objective per iteration, initial model first, as host numpy, trimmed to the
        iterations run (stacked models: a row each, NaN after a model stopped)."""
        loss, its = np.asarray(self.loss), np.asarray(self.iterations)
        return loss[..., : int(its.max()) + 1]


jax.tree_util.register_dataclass(
    FitInfo, data_fields=["loss", "iterations", "converged", "grad_norm", "l2"], meta_fields=["solver"]
)


class Model(NamedTuple):
    """A fitted logistic regression: pure data, usable inside ``jax.jit``.

    Attributes:
      w: weights, ``(d,)`` for two classes, ``(d, k)`` for k classes (a leading axis of K
        models for ``fit_many``).
      b: intercept, ``()`` or ``(k,)`` (leading K likewise).
      classes: the k labels in sorted order (host numpy); ``predict`` returns these.
      info: a FitInfo.
    """

    w: Any
    b: Any
    classes: Any
    info: Any


# -- prediction (pure, jittable) -----------------------------------------------------------


def _binary(model: Model) -> bool:
    return np.shape(model.classes)[-1] == 2


def _check_model(model: Any, where: str) -> None:
    if not isinstance(model, Model):
        models = isinstance(model, dict) and model and all(isinstance(m, Model) for m in model.values())
        hint = (
            f" of {len(model)} models (fit_per_device's, one per context); call {where} with one of "
            f"them, e.g. {where}(models[{next(iter(model))!r}], ...)"
            if models
            else ""
        )
        raise TypeError(
            f"{where}: the first argument must be a model from mg.logreg.fit (a Model), got "
            f"{type(model).__name__}{hint}"
        )


def real_array(X: Any, where: str, name: str = "X") -> Any:
    """X as an array of real numbers: a jax.Array (traced or not) as it is, anything else as
    numpy; else a TypeError naming it, its dtype and the fix."""
    if not isinstance(X, jax.Array):
        try:
            X = np.asarray(X)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"{where}: {name} cannot be read as an array ({e}); pass a 2-D array of real numbers"
            ) from None
    if np.dtype(X.dtype).kind not in "biuf":
        raise TypeError(
            f"{where}: {name} has dtype {X.dtype}; features must be real numbers; convert with "
            f"{name}.astype(np.float32) (encode text or categories as numbers first)"
        )
    return X


def _rows(model: Model, X: Any, where: str) -> Any:
    """X checked for prediction: 2-D real numbers with the model's feature count (a jax.Array,
    traced or not, as is; anything else as numpy)."""
    _check_model(model, where)
    X = real_array(X, where)
    d = np.shape(model.w)[-1 if _binary(model) else -2]
    shape = np.shape(X)
    if len(shape) != 2:
        raise ValueError(
            f"{where}: X must be 2-D (samples, features), got shape {tuple(shape)}; "
            "for a single sample use X.reshape(1, -1)"
        )
    if shape[1] != d:
        raise ValueError(
            f"{where}: X has {shape[1]} features (shape {tuple(shape)}), but the model was fitted "
            f"on {d}; pass data with the same {d} columns, in the same order"
        )
    return X


_total = jax.jit(jnp.sum)


def _check_scores(z: Any, X: Any, where: str) -> None:
    """Raises when X holds NaN or inf (scikit-learn's "Input X contains NaN"): its scores are
    then not finite, and one sum of the scores (n x k values, not n x d) clears finite data.
    Huge finite features can overflow a score too; their predictions stand. Traced values
    (under ``jax.jit``) cannot be read: they are not checked."""
    if isinstance(z, jax.core.Tracer) or isinstance(X, jax.core.Tracer):
        return
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.asarray(_total(z))):
            return
        host = np.asarray(jax.device_get(X))
        bad = ~np.isfinite(host)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{where}: X has {int(bad.sum())} NaN or infinite value(s), the first at row {row}, column "
            f"{col} (value {float(host[row, col])}); a prediction needs finite features: drop or impute "
            "those rows first"
        )


def _scores(model: Model, X: Any, where: str) -> jax.Array:
    X = jnp.asarray(_rows(model, X, where))
    w, b = _follow(model.w, X), _follow(model.b, X)
    X = X.astype(jnp.result_type(w.dtype, jnp.float32))
    if _binary(model):
        z = jnp.einsum("nd,...d->...n", X, w, precision=HI) + b[..., None]
    else:
        z = jnp.einsum("nd,...dk->...nk", X, w, precision=HI) + b[..., None, :]
    _check_scores(z, X, where)
    return z


def decision_function(model: Model, X: Any) -> jax.Array:
    """Scores ``X @ w + b``: ``(n,)`` for two classes, ``(n, k)`` for k (leading K for stacked models).

    NaN or inf in X raises, naming the first; under ``jax.jit`` (traced values cannot be read)
    it is not checked, and such rows get NaN scores."""
    return _scores(model, X, "decision_function")


def _proba(model: Model, X: Any, where: str) -> jax.Array:
    z = _scores(model, X, where)
    if _binary(model):
        p = jax.nn.sigmoid(z)
        return jnp.stack([1 - p, p], axis=-1)
    return jax.nn.softmax(z, axis=-1)


def predict_proba(model: Model, X: Any) -> jax.Array:
    """Class probabilities, ``(n, k)`` with columns in ``model.classes`` order (k = 2 included).
    NaN or inf in X raises (not under ``jax.jit``: see ``decision_function``).

    >>> import mgkit as mg, numpy as np
    >>> X = np.array([[-2.0], [-1.0], [1.0], [2.0]]); y = np.array([0, 0, 1, 1])
    >>> m = mg.logreg.fit(X, y, l2=0.01, contexts=1)
    >>> mg.logreg.predict_proba(m, X).shape
    (4, 2)
    """
    return _proba(model, X, "predict_proba")


def _index(model: Model, X: Any, where: str) -> jax.Array:
    z = _scores(model, X, where)
    return (z > 0).astype(jnp.int32) if _binary(model) else jnp.argmax(z, axis=-1).astype(jnp.int32)


def predict_index(model: Model, X: Any) -> jax.Array:
    """The index into ``model.classes`` of the most likely class for each row. NaN or inf in X
    raises (not under ``jax.jit``: see ``decision_function``)."""
    return _index(model, X, "predict_index")


def _predict(model: Model, X: Any, where: str) -> Any:
    index = _index(model, X, where)
    classes = model.classes
    if isinstance(classes, np.ndarray) and classes.dtype.kind not in "biuf":
        return np.take_along_axis(
            np.broadcast_to(classes, (*np.shape(index)[:-1], classes.shape[-1])), np.asarray(index), axis=-1
        )
    return jnp.take_along_axis(
        jnp.broadcast_to(jnp.asarray(classes), (*index.shape[:-1], np.shape(classes)[-1])), index, axis=-1
    )


def predict(model: Model, X: Any) -> Any:
    """The most likely label for each row, from ``model.classes``.

    Numeric labels give a JAX array (and this works inside ``jax.jit``); other labels (strings)
    give host numpy. NaN or inf in X raises, as in scikit-learn; under ``jax.jit`` (traced
    values cannot be read) it is not checked.

    >>> import mgkit as mg, numpy as np
    >>> X = np.array([[-2.0], [-1.0], [1.0], [2.0]]); y = np.array(["no", "no", "yes", "yes"])
    >>> m = mg.logreg.fit(X, y, l2=0.01, contexts=1)
    >>> mg.logreg.predict(m, X).tolist()
    ['no', 'no', 'yes', 'yes']
    """
    return _predict(model, X, "predict")


def score(model: Model, X: Any, y: Any) -> Any:
    """Accuracy: the fraction of rows whose predicted label equals ``y`` (one per stacked model)."""
    pred = _predict(model, X, "score")
    if not isinstance(y, jax.Array):
        try:
            y = np.asarray(y)
        except (TypeError, ValueError) as e:
            raise TypeError(f"score: y cannot be read as an array ({e}); pass one label per row") from None
        if not isinstance(pred, np.ndarray) and y.dtype.kind not in "biuf":
            example = f" (e.g. {y.ravel().tolist()[0]!r})" if y.size else ""
            raise TypeError(
                f"score: y has labels of dtype {y.dtype}{example}, but the model's classes are "
                f"{np.asarray(model.classes).tolist()}; pass labels of the kind it was fitted on"
            )
    y = np.asarray(y) if isinstance(pred, np.ndarray) else jnp.asarray(y)
    if np.shape(y) != np.shape(pred)[-1:]:
        raise ValueError(f"score: y has shape {np.shape(y)}, expected ({np.shape(pred)[-1]},), one per row")
    return (pred == y).mean(axis=-1)


def check_l2(value: Any, where: str, name: str = "l2") -> float:
    """A penalty: a finite number >= 0 (0: none), else a clear error."""
    return real(value, name, where, lo=0, example=1e-3, note="the penalty; 0: none")


def objective(model: Model, X: Any, y: Any, l2: float) -> float:
    """The objective ``mean(log-loss) + l2 * ||w||^2`` of a model on data, in float64 on the host
    (to compare solvers, or with scikit-learn: ``l2 = 1 / (2 * C * n_samples)``)."""
    where = "objective"
    X = np.asarray(jax.device_get(_rows(model, X, where)), np.float64)
    l2 = check_l2(l2, where)
    y = np.asarray(jax.device_get(y))
    if y.ndim != 1 or len(y) != len(X):
        got = f"{len(y)} labels" if y.ndim == 1 else f"labels of shape {y.shape}"
        raise ValueError(f"{where}: X has {len(X)} rows but y has {got}; pass one label per row of X")
    classes = np.asarray(model.classes)
    if (classes.dtype.kind in "biuf") == (y.dtype.kind in "biuf"):
        index = np.minimum(np.searchsorted(classes, y), len(classes) - 1)
        unknown = np.unique(y[classes[index] != y])
    else:
        index, unknown = None, np.unique(y)
    if len(unknown):
        raise ValueError(
            f"{where}: y has labels the model was not fitted on: {unknown[:5].tolist()}"
            f"{' ...' if len(unknown) > 5 else ''}; its classes are {classes.tolist()}"
        )
    w, b = np.asarray(model.w, np.float64), np.asarray(model.b, np.float64)
    z = X @ w + b
    if _binary(model):
        loss = np.logaddexp(0.0, z) - index * z
    else:
        top = z.max(axis=1, keepdims=True)
        lse = np.log(np.exp(z - top).sum(axis=1)) + top[:, 0]
        loss = lse - z[np.arange(len(z)), index]
    return float(loss.mean() + l2 * np.sum(w**2))


def unstack(models: Model) -> list[Model]:
    """The K models of a ``fit_many`` result as a list of single models."""
    if not isinstance(models, Model):
        raise TypeError(
            f"unstack: models must be a Model from mg.logreg.fit_many, got {type(models).__name__}"
        )
    k = np.shape(models.info.iterations)
    if not k:
        return [models]
    pieces = [jax.tree_util.tree_map(lambda a, i=i: a[i], models._replace(classes=None)) for i in range(k[0])]
    return [m._replace(classes=models.classes) for m in pieces]


def _follow(a: Any, X: Any) -> Any:
    """Model arrays follow the data: moved (recorded) to X's device when X is committed elsewhere."""
    if not isinstance(a, jax.Array) or not isinstance(X, jax.Array) or isinstance(X, jax.core.Tracer):
        return a
    if isinstance(a, jax.core.Tracer) or a.devices() == X.devices() or not X.committed:
        return a
    if len(X.devices()) == 1:
        (device,) = X.devices()
        return place([a], _contexts.context_of(device), Kind.TRANSFER)[0]
    return jax.device_put(a, X.sharding.with_spec(P()) if hasattr(X.sharding, "with_spec") else X.sharding)


# -- the solver (traced; local data, M models) ---------------------------------------------
