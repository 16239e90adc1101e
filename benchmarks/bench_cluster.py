"""What mg.Cluster's warm ranks save, and how fast it notices a lost rank: local engines on
127.0.0.1, simulated CPU devices.

Usage::

    python benchmarks/bench_cluster.py [--engines 2 4] [--devices 2] [--steps 1] [--rounds 6]

For each engine count: the time to start the cluster (engines up, devices chosen, one
jax.distributed group formed); a cell that makes an ``mg.Trainer`` and runs ``--steps`` steps,
then the same steps again in a later cell (start to result of each, the second's share of the
first, and the compilations the second did, counted in every rank); ``mg.launch`` running the
same steps in fresh processes (its peer: what every call costs without warm ranks); 100 steps
with each rank's ledger streamed to the kernel and without, in turn (``--rounds``, paired); then
a rank killed with SIGKILL in a running call: the seconds from the kill to the LaunchError in the
kernel, and ``c.restart()``'s time. Timings are reported, never asserted; exit status 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time

import mgkit as mg

SETUP = """
import numpy as np, optax, jax.numpy as jnp, mgkit as mg
rng = np.random.default_rng(0)
x, y = rng.normal(size=(4096, 64)), rng.normal(size=(4096, 1))
data = {"x": x.astype(np.float32), "y": y.astype(np.float32)}
def loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"])
    return jnp.mean((h @ p["w2"] - b["y"]) ** 2)
tr = mg.Trainer(loss, optax.adam(1e-3), {"w1": jnp.zeros((64, 256)) + 0.01, "w2": jnp.zeros((256, 1))})
"""


def _launched(rank, shared, private):
    namespace = {}
    exec(shared["setup"], namespace)
    namespace["tr"].fit(namespace["data"], steps=shared["steps"], batch_size=256, progress=False)
    return namespace["tr"].step


def _spin(rank, shared, private):
    import time

    while True:
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, nargs="+", default=[2, 4], help="engine counts (default 2 4)")
    p.add_argument("--devices", type=int, default=2, help="simulated devices per engine (default 2)")
    p.add_argument("--steps", type=int, default=1, help="steps per cell (default 1)")
    p.add_argument("--rounds", type=int, default=6, help="streaming on/off rounds (default 6)")
    args = p.parse_args(argv)
    fit = f"tr.fit(data, steps={args.steps}, batch_size=256, progress=False)"
    print(f"mgkit {mg.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} cores")
    for n in args.engines:
        t0 = time.perf_counter()
        c = mg.Cluster(engines=n, devices_per_engine=args.devices)
        start = time.perf_counter() - t0
        try:
            c.run_cell(SETUP)
            t0 = time.perf_counter()
            c.run_cell(fit)
            first = time.perf_counter() - t0
            compiled = c.compilations()
            t0 = time.perf_counter()
            c.run_cell(fit)
            second = time.perf_counter() - t0
            again = [b - a for a, b in zip(compiled, c.compilations(), strict=True)]
            loop = "tr.fit(data, steps=100, batch_size=256, progress=False)"
            timed: dict[bool, list[float]] = {True: [], False: []}
            for k in range(args.rounds):  # streaming on and off in turn, ABBA
                for on in (True, False) if k % 2 == 0 else (False, True):
                    c.stream(on)
                    t0 = time.perf_counter()
                    c.run_cell(loop)
                    timed[on].append(time.perf_counter() - t0)
            c.stream(True)
            ratios = sorted(a / b for a, b in zip(timed[True], timed[False], strict=True))
            t0 = time.perf_counter()
            mg.launch(
                _launched,
                nprocs=n,
                devices_per_process=args.devices,
                distributed=n > 1,
                shared={"setup": SETUP, "steps": args.steps},
                stream=False,
            )
            launched = time.perf_counter() - t0
            killed = []

            def kill(pid: int = c.ranks[-1].pid, killed: list = killed) -> None:
                killed.append(time.perf_counter())
                os.kill(pid, signal.SIGKILL)

            threading.Timer(1.0, kill).start()
            try:
                c.run(_spin)
            except mg.LaunchError:
                noticed = time.perf_counter() - killed[0]
            t0 = time.perf_counter()
            c.restart()
            restart = time.perf_counter() - t0
        finally:
            c.close()
        print(f"{n} engine(s) x {args.devices} device(s):")
        print(f"  start: {start:.1f} s (engines up, devices chosen, the jax.distributed group formed)")
        print(
            f"  a cell of {args.steps} Trainer step(s): first {first:.2f} s, the same again {second:.3f} s "
            f"({second / first:.1%} of the first; compilations in it per rank: {again})"
        )
        print(
            f"  mg.launch of the same steps in fresh processes: {launched:.2f} s "
            f"({launched / second:.0f}x the warm cell)"
        )
        print(
            f"  100 steps with each rank's ledger streamed to the kernel, against without: median "
            f"{statistics.median(timed[True]):.3f} s vs {statistics.median(timed[False]):.3f} s, "
            "paired ratio "
            f"{statistics.median(ratios):.3f} [{ratios[0]:.3f}-{ratios[-1]:.3f}] over {args.rounds} rounds "
            "(goal <= 1.03)"
        )
        print(f"  a rank killed (SIGKILL): the LaunchError {noticed:.2f} s later; restart() {restart:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
