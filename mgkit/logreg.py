"""Logistic regression on many devices: ``mg.logreg.fit`` (one model, data-parallel),
``fit_per_device`` (one model per context), ``fit_many`` (K models, several per device), and
pure, jittable prediction."""

from ._logreg import ConvergenceWarning as ConvergenceWarning
from ._logreg import FitInfo as FitInfo
from ._logreg import Model as Model
from ._logreg import decision_function as decision_function
from ._logreg import fit as fit
from ._logreg import fit_many as fit_many
from ._logreg import fit_per_device as fit_per_device
from ._logreg import objective as objective
from ._logreg import predict as predict
from ._logreg import predict_index as predict_index
from ._logreg import predict_proba as predict_proba
from ._logreg import score as score
from ._logreg import unstack as unstack

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
