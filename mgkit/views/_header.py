"""The header: mgkit and JAX versions, backend, devices (simulated or not), the context map."""

from __future__ import annotations

import collections
import html
import os
from typing import Any

from .. import _contexts, _devices
from .._ledger import Event
from ._base import LiveView


class Header(LiveView):
    """JAX version, backend, devices and whether they are simulated; the context map."""

    polls = True
    css_class = "mgkit-header"
    figsize = (10.0, 0.8)

    def __init__(self, rate: float = 1.0, widget: bool | None = None, live: bool = True):
        super().__init__(rate, None, widget, live)
        self._text = ""
        self._start()

    def facts(self) -> dict[str, Any]:
        """mgkit and JAX versions, backend, devices per platform, simulated or not, the context map."""
        import jax

        from .._version import __version__

        platforms = collections.Counter(name.rstrip("0123456789") for name in _devices.device_names())
        cpus = platforms.get("cpu", 0)
        flags = os.environ.get("XLA_FLAGS", "")
        simulated = cpus > 1 and (
            getattr(jax.config, "jax_num_cpu_devices", -1) > 1
            or "xla_force_host_platform_device_count" in flags
        )
        return {
            "mgkit": __version__,
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "devices": dict(platforms),
            "simulated": simulated,
            "contexts": str(_contexts.context_map()),
        }

    def _update(self, events: list[Event], budgeted: bool) -> bool:
        f = self.facts()
        devices = ", ".join(f"{n} {p.upper()}" for p, n in f["devices"].items())
        sim = f"yes ({f['devices'].get('cpu', 0)} simulated CPU devices)" if f["simulated"] else "no"
        text = (
            f"mgkit {f['mgkit']} | jax {f['jax']} | backend {f['backend']} | devices: {devices} | "
            f"simulated: {sim}\ncontexts: {f['contexts']}"
        )
        if text == self._text:
            return False
        self._text = text
        self._show_html()
        return True

    def text(self) -> str:
        return self._text

    def html(self) -> str:
        lines = "<br>".join(map(html.escape, self._text.splitlines()))
        return f'<div style="font-family:monospace;font-size:12px">{lines}</div>'

    def _draw_figure(self, fig: Any) -> None:
        fig.text(0.01, 0.5, self._text, va="center", fontsize=8, family="monospace")
