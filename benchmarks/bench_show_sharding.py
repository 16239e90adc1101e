"""How long ``mg.show_sharding`` takes, from shapes and shardings only, against JAX's own view.

Usage::

    python benchmarks/bench_show_sharding.py [--simulate 8] [--repeats 50]
    python benchmarks/bench_show_sharding.py --simulate 512   # also 512 devices, not abstract

Cases, each timed ``--repeats`` times (median and quartiles, milliseconds):

- ``10^12 x 512``: one float32 leaf of 10^6 x 10^6 elements split over an abstract mesh of
  32 x 16 = 512 devices (``jax.sharding.AbstractMesh``: no devices needed). Timed in parts: the
  blocks (``mgkit._shards.layouts``), the view (its grid), its text, its HTML. Goal: the whole
  under 50 ms. With ``--simulate 512`` also on a mesh of 512 simulated CPU devices.
- ``5120 x 5120 over 4``: a float32 array on 4 simulated devices, split 2 x 2: ``mg.show_sharding``
  (view and text) against ``jax.debug.visualize_array_sharding`` (rich, printed to a string),
  the one view JAX ships; the ratio of medians (mgkit / JAX).
- ``pytree``: 200 leaves (a 100-layer MLP's weights and biases, 1024 wide) split over every
  simulated device: ``mgkit._shards.bytes_per_context`` and the whole view's text.

Timings are reported, never asserted; exit status 0.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from collections.abc import Callable

GOAL_MS = 50.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="mg.show_sharding timings against jax.debug.visualize_array_sharding."
    )
    p.add_argument("--simulate", type=int, default=8, help="simulated CPU devices (default 8, at least 4)")
    p.add_argument("--repeats", type=int, default=50, help="timed runs per case (default 50)")
    args = p.parse_args(argv)
    if args.simulate < 4 or args.repeats < 1:
        p.error("--simulate must be at least 4 and --repeats at least 1")
    return args


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Milliseconds per call, after one warm-up call."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    import mgkit as mg

    mg.simulate(args.simulate)
    import jax.numpy as jnp
    import numpy as np
    from _stats import median, quartiles, table
    from jax.sharding import AbstractMesh, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from mgkit import _shards

    mg.use_contexts(";".join(f"dev{i}->cpu{i}" for i in range(args.simulate)), verbose=False)
    rows: list[list[str]] = []

    def add(name: str, ms: list[float]) -> float:
        lo, hi = quartiles(ms)
        rows.append([name, f"{median(ms):.3f}", f"{lo:.3f}", f"{hi:.3f}"])
        return median(ms)

    huge = jax.ShapeDtypeStruct(
        (10**6, 10**6), jnp.float32, sharding=NamedSharding(AbstractMesh((32, 16), ("x", "y")), P("x", "y"))
    )
    add("10^12 x 512: blocks", timed(lambda: _shards.layouts(huge), args.repeats))
    add("10^12 x 512: view", timed(lambda: mg.show_sharding(huge, widget=False), args.repeats))
    view = mg.show_sharding(huge, widget=False)
    add("10^12 x 512: text", timed(view.text, args.repeats))
    add("10^12 x 512: html", timed(view.html, args.repeats))

    def shown(x: object) -> tuple[str, str]:
        v = mg.show_sharding(x, widget=False)
        return v.text(), v.html()

    whole = add("10^12 x 512: view + text + html", timed(lambda: shown(huge), args.repeats))
    if args.simulate >= 512:  # the same leaf on 512 real (simulated) devices, labelled dev0..dev511
        mesh512 = Mesh(np.array(jax.devices()[:512]).reshape(32, 16), ("x", "y"))
        real = jax.ShapeDtypeStruct((10**6, 10**6), jnp.float32, sharding=NamedSharding(mesh512, P("x", "y")))
        add("10^12 x 512 devices: view + text + html", timed(lambda: shown(real), args.repeats))

    mesh4 = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    square = jax.device_put(jnp.zeros((5120, 5120), jnp.float32), NamedSharding(mesh4, P("x", "y")))
    ours = add(
        "5120^2 over 4: mg.show_sharding text",
        timed(lambda: str(mg.show_sharding(square, widget=False)), args.repeats),
    )

    def jax_view() -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):  # rich prints to sys.stdout
            jax.debug.visualize_array_sharding(square)
        return out.getvalue()

    try:
        theirs = add("5120^2 over 4: jax.debug.visualize_array_sharding", timed(jax_view, args.repeats))
    except ImportError as e:  # rich is optional for JAX
        theirs = None
        print(f"jax.debug.visualize_array_sharding skipped: {e}")

    n = args.simulate
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    split = NamedSharding(mesh, P("x"))
    tree = {
        f"layer{i}": {
            "w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=split),
            "b": jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=split),
        }
        for i in range(100)
    }
    add(
        "pytree of 200 leaves: bytes_per_context",
        timed(lambda: _shards.bytes_per_context(tree), args.repeats),
    )
    add(
        "pytree of 200 leaves: view + text",
        timed(lambda: str(mg.show_sharding(tree, widget=False)), args.repeats),
    )

    print(f"mg.show_sharding, jax {jax.__version__}, {n} simulated CPU devices, {args.repeats} runs per case")
    print(table(["case", "median ms", "q1 ms", "q3 ms"], rows))
    print(f"10^12 elements over 512 devices, view + text + html: {whole:.2f} ms (goal < {GOAL_MS:.0f} ms)")
    if theirs is not None:
        ratio = ours / theirs
        print(
            f"5120 x 5120 over 4 devices: mg.show_sharding / jax.debug.visualize_array_sharding = {ratio:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
