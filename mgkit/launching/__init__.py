"""Launching: ``mg.launch`` runs a function in one fresh process per device (or group of
devices), with ``jax.distributed`` when asked, and supervises them; ``mg.beat`` and
``mg.watchdog`` turn a silent hang into a report with every stack."""

from .._beat import beat as beat
from ._launch import launch as launch
from ._result import LaunchError as LaunchError
from ._result import LaunchResult as LaunchResult
from ._result import RankInfo as RankInfo

__all__ = ["LaunchError", "LaunchResult", "RankInfo", "beat", "launch"]
