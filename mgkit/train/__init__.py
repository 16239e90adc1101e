"""Training on many contexts: the trainer, an ensemble of different models, a pipeline of
stages, their compiled steps, data, history and checkpoints.

``mg.Trainer(loss_fn, optimizer, params)`` trains one model with an optax optimizer on every
context in the map: one SPMD program per step over distinct devices of one kind, the
gather-update-copy loop (per-context gradients gathered on the first context, the update
there, the parameters copied back) where contexts share a device or mix kinds. ``fit``
returns a ``History``. With ``shard="fsdp"`` (or rules, or ``mesh=`` for tensor parallelism)
parameters and optimizer state are split over the contexts, planned from shapes (``_plan``) and
laid on the devices (``_shard``), or as a Flax model's own annotations say (``_annotations``);
``mg.fits`` plans the bytes per context from shapes before anything is allocated (``_memory``);
``Trainer.plan`` and ``mg.plan`` compile the step ahead of time for a grid of layouts and read
its memory, communication and flops, with a predicted step time (``_ahead``); ``mg.scaling``
measures the step on 1, 2, 4, ... contexts and names the bottleneck (``_scaling``).

``mg.Ensemble({ctx: mg.Member(...)})`` trains different models side by side, one per context
(or several on one); ``mg.Pipeline([(ctx, fn, params), ...], loss)`` splits one model
layer-wise across contexts and trains it with microbatches (GPipe or 1F1B).

All three fit on one skeleton (``_loop``: stop reasons, Ctrl-C, step events, the non-finite
policy, data running out, the progress bar, ``History``; ``_feed``: the batches;
``_checkpoint``: checkpoints and resume), and take their arguments in the same places: the
optimizer, seed, ``on_nan``, ``prefetch`` and checkpoint folder where the model is made.

``Trainer.fit(..., accumulate=k, precision="bf16")``: each batch cut into k microbatches in a
``lax.scan`` inside the one step (``_accumulate``), the loss function computed in bfloat16 or
float16 over float32 parameters, with float16's dynamic loss scale (``_precision``).
"""

from ._ahead import PlanRow as PlanRow
from ._ahead import StepPlan as StepPlan
from ._ahead import plan as plan
from ._annotations import AnnotationWarning as AnnotationWarning
from ._ensemble import Ensemble as Ensemble
from ._history import History as History
from ._loop import DataRanOut as DataRanOut
from ._loop import StepsSkipped as StepsSkipped
from ._member import EnsembleResult as EnsembleResult
from ._member import Member as Member
from ._member import MemberError as MemberError
from ._member import MemberResult as MemberResult
from ._memory import MemoryTable as MemoryTable
from ._memory import fits as fits
from ._pipeline import FewerMicrobatches as FewerMicrobatches
from ._pipeline import Pipeline as Pipeline
from ._precision import PrecisionWarning as PrecisionWarning
from ._scaling import ScalingStudy as ScalingStudy
from ._scaling import scaling as scaling
from ._trainer import Trainer as Trainer

__all__ = [
    "AnnotationWarning",
    "DataRanOut",
    "Ensemble",
    "EnsembleResult",
    "FewerMicrobatches",
    "History",
    "Member",
    "MemberError",
    "MemberResult",
    "MemoryTable",
    "Pipeline",
    "PlanRow",
    "PrecisionWarning",
    "ScalingStudy",
    "StepPlan",
    "StepsSkipped",
    "Trainer",
    "fits",
    "plan",
    "scaling",
]
