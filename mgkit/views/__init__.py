"""Live views of what mgkit does: widgets in notebooks, text elsewhere, PNG pictures for reports.

One module per view, over a shared base:

==================  ===============================================================================
``_header``         ``Header``: versions, backend, devices, the context map
``_devicemap``      ``DeviceMap``: context -> device, memory in use, the current context
``_transfers``      ``TransferView``: the newest transfers, totals, a heatmap of bytes moved
``_memory``         ``MemoryView``: bytes in use and peak per context over time, a trainer's bands
``_throughput``     ``ThroughputView``: samples per second and step time per context
``_launches``       ``LaunchView``: the ranks of the running or last ``mg.launch``, or a cluster's engines
``_schedule``       ``Schedule``: the timeline of one pipeline or ensemble step
``_profile``        ``ProfileView``: a profile's timeline per context (``mg.profile()``)
``_scaling``        the picture of a scaling study (``mg.scaling``): measured, ideal, predicted
``_sharding``       ``ShardingView`` (``show_sharding``): which block of each leaf lives where
``_dashboard``      ``Dashboard``: the header, device map, transfers, throughput and launches;
                    ``cluster=c``: every rank's contexts and the engines too
``_base``           ``LiveView`` and ``Plotted``, what every view shares
``_live``           the bounded feed from the ledger and the one thread that refreshes views
``_format``         short texts: a cell's label, a rate, a duration, GB/s
``_svg``            the live pictures, as SVG text (about a millisecond each)
``_png``            the saved pictures, drawn with matplotlib (imports no view)
==================  ===============================================================================

Each view follows the ledger through a bounded feed and is refreshed by one shared background
thread at most ``rate`` times a second, so it updates while a long cell runs. ipywidgets is
imported only when a widget is made, matplotlib only when a picture is saved: importing this
package imports neither.
"""

from ._dashboard import Dashboard as Dashboard
from ._devicemap import DeviceMap as DeviceMap
from ._header import Header as Header
from ._launches import LaunchRow as LaunchRow
from ._launches import LaunchView as LaunchView
from ._memory import Band as Band
from ._memory import MemoryNow as MemoryNow
from ._memory import MemoryPoint as MemoryPoint
from ._memory import MemoryView as MemoryView
from ._profile import ProfileView as ProfileView
from ._profile import show_profile as show_profile
from ._scaling import scaling_png as scaling_png
from ._schedule import Block as Block
from ._schedule import Schedule as Schedule
from ._sharding import ShardingView as ShardingView
from ._sharding import show_sharding as show_sharding
from ._throughput import ThroughputView as ThroughputView
from ._transfers import TransferView as TransferView

__all__ = [
    "Band",
    "Block",
    "Dashboard",
    "DeviceMap",
    "Header",
    "LaunchRow",
    "LaunchView",
    "MemoryNow",
    "MemoryPoint",
    "MemoryView",
    "ProfileView",
    "Schedule",
    "ShardingView",
    "ThroughputView",
    "TransferView",
    "scaling_png",
    "show_profile",
    "show_sharding",
]
