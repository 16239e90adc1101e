"""Training on many contexts: the trainer, its compiled step, data, history and checkpoints.

``mg.Trainer(loss_fn, optimizer, params)`` trains one model with an optax optimizer on every
context in the map: one SPMD program per step over distinct devices of one kind, cutorch's loop
(per-context gradients gathered on the first context, the update there, the parameters copied
back) where contexts share a device or mix kinds. ``fit`` returns a ``History``.
"""

from ._history import History as History
from ._trainer import DataRanOut as DataRanOut
from ._trainer import Trainer as Trainer

__all__ = ["DataRanOut", "History", "Trainer"]
