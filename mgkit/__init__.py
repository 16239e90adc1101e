"""mgkit: named device contexts, parallel ops and live views for many accelerators, on JAX.

>>> import mgkit as mg
>>> mg.simulate(8)                                   # no GPU: 8 CPU devices   # doctest: +SKIP
>>> _ = mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
>>> mg.where(mg.put(1.0, "dev1"))
'dev1'
"""

from . import cluster as cluster
from . import launching as launching
from . import logreg as logreg
from . import train as train
from ._beat import beat as beat
from ._contexts import ContextMap as ContextMap
from ._contexts import context_map as context_map
from ._contexts import current as current
from ._contexts import device_of as device_of
from ._contexts import memory_limit as memory_limit
from ._contexts import on as on
from ._contexts import use_contexts as use_contexts
from ._devices import DeviceInfo as DeviceInfo
from ._devices import DeviceTable as DeviceTable
from ._devices import devices as devices
from ._devices import simulate as simulate
from ._errors import ContextError as ContextError
from ._errors import DeviceMismatchError as DeviceMismatchError
from ._ledger import Event as Event
from ._ledger import Ledger as Ledger
from ._ledger import ledger as ledger
from ._oom import OutOfMemoryError as OutOfMemoryError
from ._parallel import Parallel as Parallel
from ._parallel import UnboundAxisError as UnboundAxisError
from ._parallel import concat as concat
from ._parallel import make_parallel as make_parallel
from ._parallel import parallel as parallel
from ._parallel import pmap as pmap
from ._parallel import run_each as run_each
from ._parallel import split as split
from ._prefetch import Prefetch as Prefetch
from ._prefetch import prefetch as prefetch
from ._profile import Profile as Profile
from ._profile import profile as profile
from ._spmd import clear_caches as clear_caches
from ._stops import PreemptedError as PreemptedError
from ._transfer import colocate as colocate
from ._transfer import put as put
from ._transfer import synchronize as synchronize
from ._transfer import transfer as transfer
from ._transfer import where as where
from ._version import __version__ as __version__
from ._watchdog import StallWarning as StallWarning
from ._watchdog import watchdog as watchdog
from .cluster import Cluster as Cluster
from .launching import CoresWarning as CoresWarning
from .launching import LaunchError as LaunchError
from .launching import LaunchResult as LaunchResult
from .launching import launch as launch
from .train import AnnotationWarning as AnnotationWarning
from .train import Ensemble as Ensemble
from .train import History as History
from .train import Member as Member
from .train import MemberError as MemberError
from .train import Pipeline as Pipeline
from .train import PrecisionWarning as PrecisionWarning
from .train import ScalingStudy as ScalingStudy
from .train import StepPlan as StepPlan
from .train import Trainer as Trainer
from .train import fits as fits
from .train import plan as plan
from .train import scaling as scaling

__all__ = [
    "AnnotationWarning",
    "Cluster",
    "ContextError",
    "ContextMap",
    "CoresWarning",
    "Dashboard",
    "DeviceInfo",
    "DeviceMap",
    "DeviceMismatchError",
    "DeviceTable",
    "Ensemble",
    "Event",
    "History",
    "LaunchError",
    "LaunchResult",
    "LaunchView",
    "Ledger",
    "Member",
    "MemberError",
    "MemoryView",
    "OutOfMemoryError",
    "Parallel",
    "Pipeline",
    "PrecisionWarning",
    "PreemptedError",
    "Prefetch",
    "Profile",
    "ProfileView",
    "ScalingStudy",
    "Schedule",
    "ShardingView",
    "StallWarning",
    "StepPlan",
    "ThroughputView",
    "Trainer",
    "TransferView",
    "UnboundAxisError",
    "beat",
    "clear_caches",
    "colocate",
    "concat",
    "context_map",
    "current",
    "device_of",
    "devices",
    "fits",
    "launch",
    "launching",
    "ledger",
    "logreg",
    "make_parallel",
    "memory_limit",
    "on",
    "parallel",
    "plan",
    "pmap",
    "prefetch",
    "profile",
    "put",
    "run_each",
    "scaling",
    "show_sharding",
    "simulate",
    "split",
    "synchronize",
    "transfer",
    "use_contexts",
    "watchdog",
    "where",
]

# Views load on first use, so `import mgkit` imports neither ipywidgets nor matplotlib.
_LAZY = {
    "Dashboard": ".views",
    "DeviceMap": ".views",
    "LaunchView": ".views",
    "MemoryView": ".views",
    "ProfileView": ".views",
    "Schedule": ".views",
    "ShardingView": ".views",
    "ThroughputView": ".views",
    "TransferView": ".views",
    "show_sharding": ".views",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mgkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def load_ipython_extension(ipython) -> None:
    """``%load_ext mgkit``: registers ``%mgkit``, ``%%on``, ``%%mgkit_peak`` and ``%%mgkit_profile``
    (imports IPython only now)."""
    from ._magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext mgkit``: removes the magics again."""
    from ._magics import unload_ipython_extension as unload

    unload(ipython)


def _startup() -> None:
    from ._devices import simulate_from_env

    simulate_from_env()


_startup()
del _startup
