"""Launching: ``mg.launch`` runs a function in one fresh process per device (or group of
devices), with ``jax.distributed`` when asked, and supervises them; ``mg.beat`` and
``mg.watchdog`` turn a silent hang into a report with every stack. ``CoresWarning``: a launch
simulates more CPU devices than the machine has cores.

For the views: ``current()`` is the launch running now (``Running``: its title and each rank's
``RankInfo``, which keeps its last ``TAIL`` output lines), and ``rank_event`` reads a finished
launch's ledger events back (``RankEvent``). For the ``mgkit`` command: ``add_commands``
adds ``mgkit worker`` and ``mgkit run``."""

from .._beat import beat as beat
from ._events import RankEvent as RankEvent
from ._events import rank_event as rank_event
from ._launch import Running as Running
from ._launch import current as current
from ._launch import launch as launch
from ._plan import CoresWarning as CoresWarning
from ._result import TAIL as TAIL
from ._result import LaunchError as LaunchError
from ._result import LaunchResult as LaunchResult
from ._result import RankInfo as RankInfo
from ._worker import add_commands as add_commands

__all__ = [
    "TAIL",
    "CoresWarning",
    "LaunchError",
    "LaunchResult",
    "RankEvent",
    "RankInfo",
    "Running",
    "add_commands",
    "beat",
    "current",
    "launch",
    "rank_event",
]
