"""Parallel ops: split a batch across contexts, run a function on each part, concatenate.

One API, two execution paths:

* **SPMD** — the contexts are distinct devices of one kind (``cuda0..cuda7``, or simulated
  ``cpu0..cpu7``): one ``shard_map`` program over a mesh of those devices, compiled once.
  A batch that does not divide evenly is padded by at most one row per part and trimmed.
* **dispatch** — the contexts share a device, mix kinds (``cuda0`` with ``cpu0``), or weights
  make the parts unequal: one compiled program per context, every context dispatched before
  any is waited on, then the outputs are gathered.

Both paths give ``fn`` applied to each context's part, concatenated; both are differentiable,
with each part's backward pass on its own device. Every split, replicate, gather and run is
recorded in the ledger.

==============  ==================================================================================
``_wrapper``    ``mg.parallel``, ``mg.make_parallel``: the ``Parallel`` wrapper
``_calls``      how a call is planned, compiled and run (every program of the parallel ops)
``_batch``      a call's batch: which leaves are split, along which axis, rows per context
``_pmap``       ``mg.pmap``
``_split``      ``mg.split``, ``mg.concat``
``_run_each``   ``mg.run_each``
==============  ==================================================================================
"""

from ._pmap import UnboundAxisError as UnboundAxisError
from ._pmap import pmap as pmap
from ._run_each import run_each as run_each
from ._split import concat as concat
from ._split import split as split
from ._wrapper import Parallel as Parallel
from ._wrapper import make_parallel as make_parallel
from ._wrapper import parallel as parallel
