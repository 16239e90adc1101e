"""What mg.Cluster's warm ranks save, and how fast it notices a lost rank: local engines on
127.0.0.1, simulated CPU devices.

Usage::

    python benchmarks/bench_cluster.py [--engines 2 4] [--devices 2] [--steps 1] [--rounds 6] [--loop 100]

For each engine count: the time to start the cluster (engines up, devices chosen, one
jax.distributed group formed); a cell that makes an ``mg.Trainer`` and runs ``--steps`` steps,
then the same steps again in a later cell (start to result of each, the second's share of the
first, and the compilations the second did, counted in every rank); ``mg.launch`` running the
same steps in fresh processes (its peer: what every call costs without warm ranks); ``--loop``
steps with each rank's ledger streamed to the kernel and without, in turn (``--rounds``, paired;
timed in the ranks, and as the kernel's call), and the messages a second each rank sent
meanwhile; Ctrl-C in a long fit (the seconds to the KeyboardInterrupt, the step each rank
stopped at); SIGTERM to a rank in a checkpointed fit (the
seconds to the LaunchError, then ``c.restart()`` and the fit resumed to its end); then a rank
killed with SIGKILL in a running call: the seconds from the kill to the LaunchError in the
kernel, and ``c.restart()``'s time. Timings are reported, never asserted; exit status 0.
"""

from __future__ import annotations

import _thread
import argparse
import os
import re
import signal
import statistics
import sys
import tempfile
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


def _took(rank, shared, private):
    from IPython import get_ipython

    return get_ipython().user_ns["took"]  # what the cell timed in this rank


def _spin(rank, shared, private):
    import time

    while True:
        time.sleep(0.01)


def _ctrl_c(c: mg.Cluster) -> tuple[list[int], float]:
    """Ctrl-C two seconds into a long fit: the step each rank stopped at, and the seconds from
    the press to the KeyboardInterrupt in the kernel."""
    pressed = []

    def press() -> None:
        pressed.append(time.perf_counter())
        _thread.interrupt_main()

    threading.Timer(2.0, press).start()
    try:
        c.run_cell("tr.fit(data, steps=10**6, batch_size=256, progress=False)")
    except KeyboardInterrupt as e:
        seconds = time.perf_counter() - pressed[0]
        return [int(k) for k in re.findall(r"stopped at step (\d+)", str(e))], seconds
    return [], float("nan")


def _preempt(c: mg.Cluster) -> tuple[float, str, float]:
    """SIGTERM to the last rank in a checkpointed fit: the seconds to the LaunchError, its first
    line, and the seconds of c.restart() plus the fit resumed to its end."""
    with tempfile.TemporaryDirectory() as folder:
        saved = f"tr = mg.Trainer(loss, optax.adam(1e-3), tr.params, checkpoint={folder!r}, every=10**6)\n"
        cell = SETUP + saved  # saved only when preempted
        fit = "tr.fit(data, steps=400, batch_size=256, progress=False, resume=True)"
        c.run_cell(cell)
        sent = []

        def term(pid: int = c.ranks[-1].pid) -> None:
            sent.append(time.perf_counter())
            os.kill(pid, signal.SIGTERM)

        threading.Timer(2.0, term).start()
        try:
            c.run_cell(fit)
            return float("nan"), "no error", float("nan")
        except mg.LaunchError as e:
            seconds, said = time.perf_counter() - sent[0], str(e).splitlines()[0]
        t0 = time.perf_counter()
        c.restart()
        c.run_cell(cell + fit)
        return seconds, said, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, nargs="+", default=[2, 4], help="engine counts (default 2 4)")
    p.add_argument("--devices", type=int, default=2, help="simulated devices per engine (default 2)")
    p.add_argument("--steps", type=int, default=1, help="steps per cell (default 1)")
    p.add_argument("--rounds", type=int, default=6, help="streaming on/off rounds (default 6)")
    p.add_argument("--loop", type=int, default=100, help="steps of each streaming round (default 100)")
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
            loop = (
                f"import time\nt0 = time.perf_counter()\ntr.fit(data, steps={args.loop}, batch_size=256, "
                "progress=False)\ntook = time.perf_counter() - t0"
            )
            timed: dict[bool, list[float]] = {True: [], False: []}
            inside: dict[bool, list[float]] = {True: [], False: []}  # the slowest rank's fit, timed in it
            sent = [0] * n
            for k in range(args.rounds):  # streaming on and off in turn, ABBA
                for on in (True, False) if k % 2 == 0 else (False, True):
                    c.stream(on)
                    before = list(c.streams.messages)
                    t0 = time.perf_counter()
                    c.run_cell(loop)
                    timed[on].append(time.perf_counter() - t0)
                    sent = [s + b - a for s, a, b in zip(sent, before, c.streams.messages, strict=True)]
                    inside[on].append(max(c.run(_took)))
            c.stream(True)
            # each streamed call ends with a drain, read as one more message (a reply, not a batch)
            rates = [(m - args.rounds) / sum(timed[True]) for m in sent]
            stopped, pressed = _ctrl_c(c)
            preempted, said, restart_resume = _preempt(c)
            ratios = sorted(a / b for a, b in zip(timed[True], timed[False], strict=True))
            in_rank = sorted(a / b for a, b in zip(inside[True], inside[False], strict=True))
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
            f"  {args.loop} steps with each rank's ledger streamed to the kernel, against without, timed "
            f"in the ranks: median {statistics.median(inside[True]):.3f} s vs "
            f"{statistics.median(inside[False]):.3f} s, paired ratio {statistics.median(in_rank):.3f} "
            f"[{in_rank[0]:.3f}-{in_rank[-1]:.3f}] over {args.rounds} rounds (goal <= 1.03); the call "
            f"in the kernel (with the last batches read): {statistics.median(ratios):.3f} "
            f"[{ratios[0]:.3f}-{ratios[-1]:.3f}]"
        )
        print(
            f"  messages a second per rank while streaming: {', '.join(f'{r:.1f}' for r in rates)} "
            "(at most 2 by default; the goal: at most 10)"
        )
        print(
            f"  Ctrl-C in a fit: every rank stopped {pressed:.2f} s later, at steps {stopped} "
            "(goal: one step, <= 2 s)"
        )
        print(f"  SIGTERM to rank {n - 1} in a fit: the LaunchError {preempted:.2f} s later: {said}")
        print(f"  then restart() and fit(resume=True) to the end: {restart_resume:.1f} s")
        print(f"  a rank killed (SIGKILL): the LaunchError {noticed:.2f} s later; restart() {restart:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
