"""Logistic regression on many devices: one model data-parallel, one model per device, or many
models per device.

The objective is ``mean(log-loss) + l2 * ||w||^2``, the intercept not
penalised. scikit-learn's ``LogisticRegression(C=C)`` minimises the same function with
``l2 = 1 / (2 * C * n_samples)``. Two classes use the sigmoid and a weight vector ``w`` of shape
``(d,)``; k > 2 classes use the softmax and ``w`` of shape ``(d, k)``.

One solver serves every layout. It fits a batch of models at once and runs its whole loop in
one compiled program:

* ``fit``: one model, the rows split across contexts; every iteration each device computes its
  share of the loss, gradient (and Hessian) and the shares are summed (``psum``), so every
  device holds the same model.
* ``fit_per_device``: one model per context, each on its own data, all at once.
* ``fit_many``: K models over one data set (a sweep of l2 values, or bootstrap row sets), spread
  over the contexts, several per device.

Distinct devices of one kind run one SPMD program (``shard_map``) over all of them. Otherwise
each device runs its own program, all dispatched before any is waited on; for
``fit_per_device`` the models of contexts that share a device are stacked into that device's
one program (eight contexts on one GPU cost about one fit).
"""

from ._fit import fit as fit
from ._fit import fit_many as fit_many
from ._fit import fit_per_device as fit_per_device
from ._model import ConvergenceWarning as ConvergenceWarning
from ._model import FitInfo as FitInfo
from ._model import Model as Model
from ._model import decision_function as decision_function
from ._model import objective as objective
from ._model import predict as predict
from ._model import predict_index as predict_index
from ._model import predict_proba as predict_proba
from ._model import score as score
from ._model import unstack as unstack

__all__ = [
    "ConvergenceWarning",
    "FitInfo",
    "Model",
    "decision_function",
    "fit",
    "fit_many",
    "fit_per_device",
    "objective",
    "predict",
    "predict_index",
    "predict_proba",
    "score",
    "unstack",
]
