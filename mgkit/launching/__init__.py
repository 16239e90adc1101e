"""Launching: ``mg.launch`` runs a function in one fresh process per device (or group of
devices), with ``jax.distributed`` when asked, and supervises them; ``mg.beat`` and
``mg.watchdog`` turn a silent hang into a report with every stack. ``CoresWarning``: a launch
simulates more CPU devices than the machine has cores.

For the views: ``current()`` is the launch running now (``Running``: its title and each rank's
``RankInfo``, which keeps its last ``TAIL`` output lines), and ``rank_event`` reads a finished
launch's ledger events back (``RankEvent``). For the ``mgkit`` command: ``add_commands``
adds ``mgkit worker`` and ``mgkit run``.

For ``mg.Cluster``, which keeps ranks warm and shares a launch's promises: ``check_signature``,
``check_env`` and ``dumps`` (what can be sent, the unpicklable part named), ``coordinator_config`` and
``initialize_distributed`` (jax.distributed's address, timeouts and joining it, gloo on the
loopback address), ``RankInfo``, ``Failure`` and ``launch_error`` (one error naming every
rank's fate), ``gpu_ids`` (the GPUs ranks can own), ``check_stall``, ``silences`` and
``Silence`` (the stall limits and which ranks passed theirs)."""

from .._beat import beat as beat
from ._check import check_signature as check_signature
from ._check import dumps as dumps
from ._child import initialize as initialize_distributed
from ._events import RankEvent as RankEvent
from ._events import rank_event as rank_event
from ._launch import Running as Running
from ._launch import current as current
from ._launch import launch as launch
from ._plan import CoresWarning as CoresWarning
from ._plan import check_env as check_env
from ._plan import check_stall as check_stall
from ._plan import coordinator_config as coordinator_config
from ._plan import gpu_ids as gpu_ids
from ._result import TAIL as TAIL
from ._result import Failure as Failure
from ._result import LaunchError as LaunchError
from ._result import LaunchResult as LaunchResult
from ._result import RankInfo as RankInfo
from ._result import launch_error as launch_error
from ._result import stacks_text as stacks_text
from ._result import steps_text as steps_text
from ._watch import Silence as Silence
from ._watch import silences as silences
from ._worker import add_commands as add_commands

__all__ = [
    "TAIL",
    "CoresWarning",
    "Failure",
    "LaunchError",
    "LaunchResult",
    "RankEvent",
    "RankInfo",
    "Running",
    "Silence",
    "add_commands",
    "beat",
    "check_env",
    "check_signature",
    "check_stall",
    "coordinator_config",
    "current",
    "dumps",
    "gpu_ids",
    "initialize_distributed",
    "launch",
    "launch_error",
    "rank_event",
    "silences",
    "stacks_text",
    "steps_text",
]
