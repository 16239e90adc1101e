"""The SPMD layer every capability shares. ``mg.parallel``, ``mg.pmap``, logistic regression,
the trainers and ``mg.prefetch`` build their programs on it. One module per question:

==================  ==============================================================================
``_caches``         the caches of compiled programs (``programs``) and ``clear_caches``
``_targets``        the contexts a program runs on (``Targets``, ``resolve``)
``_mesh``           meshes with ``Auto`` axes and shardings over the contexts' devices
``_shares``         rows per part, and padding uneven parts to equal ones (and trimming back)
``_leaves``         the array behind a leaf (a tracer may stand for none), and its dtype
``_host``           split arrays to and from the host shard by shard, padding left out or added;
                    process 0's choice sent to every process
``_placing``        placing a batch for one program, host arrays through a private copy
``_layouts``        the ledger's events for a placement and a run, and recording them
``_messages``       how messages name a function, and JAX's device errors in context names
``_hlo``            the collectives in a compiled program's HLO text, with bytes and devices
``_collectives``    those collectives as ledger events on each run, and a step's ``Communication``
==================  ==============================================================================
"""

from ._caches import Cache as Cache
from ._caches import cached as cached
from ._caches import clear_caches as clear_caches
from ._caches import programs as programs
from ._collectives import Communication as Communication
from ._collectives import Reading as Reading
from ._collectives import Watch as Watch
from ._collectives import check_run as check_run
from ._collectives import communication as communication
from ._collectives import cost_of as cost_of
from ._collectives import flops_of as flops_of
from ._collectives import note_run as note_run
from ._collectives import read_compiled as read_compiled
from ._collectives import record_collectives as record_collectives
from ._hlo import Collective as Collective
from ._hlo import collectives_in as collectives_in
from ._host import from_host as from_host
from ._host import from_process_zero as from_process_zero
from ._host import to_host as to_host
from ._layouts import record as record
from ._layouts import record_run as record_run
from ._layouts import run_layout as run_layout
from ._layouts import spmd_layout as spmd_layout
from ._leaves import dtype_of as dtype_of
from ._leaves import is_abstract as is_abstract
from ._mesh import AXIS as AXIS
from ._mesh import mesh as mesh
from ._mesh import sharding as sharding
from ._mesh import spec as spec
from ._messages import explained as explained
from ._messages import fn_name as fn_name
from ._placing import Batch as Batch
from ._placing import lands_at_once as lands_at_once
from ._placing import needs_private as needs_private
from ._placing import place_copied as place_copied
from ._placing import place_spmd as place_spmd
from ._placing import private as private
from ._placing import put as put
from ._shares import pad as pad
from ._shares import padding as padding
from ._shares import shares as shares
from ._shares import trim as trim
from ._targets import Targets as Targets
from ._targets import per_context as per_context
from ._targets import resolve as resolve
