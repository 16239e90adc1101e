"""Clusters: warm ranks on one or several hosts, driven from one notebook (``mg.Cluster``).

``_cluster``  ``Cluster``: engines started once, each with its devices, in one jax.distributed
              group; ``run`` (mg.launch's contract on warm ranks), ``run_cell`` (``%%mgkit_all``),
              ``restart``, ``close``, the table of ranks; ``current()``, the newest open cluster
``_engines``  the engine behind one narrow interface (``Engines``: start, apply, execute, signal,
              stop), on ipyparallel; ``launcher_script`` for MPI, Slurm and PBS
``_rank``     what runs inside an engine: its setup, a call, its compilations
"""

from ._cluster import Cluster as Cluster
from ._cluster import current as current

__all__ = ["Cluster", "current"]
