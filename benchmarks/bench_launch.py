"""What launching costs: mg.launch against starting the same bare JAX processes, the heartbeat's
cost per step, and how fast each fault is detected.

Usage::

    python benchmarks/bench_launch.py [--nprocs 2] [--repeats 3] [--simulate 8]

In one run:

  (a) start-up: ``mg.launch`` of a function that returns at once, on ``--nprocs`` ranks, with
      and without ``jax.distributed``, against the peer: the same number of bare
      ``python -c "import jax; jax.devices()"`` processes started together (the least any
      launcher of fresh JAX processes pays). Reported: time from the call to every rank ready,
      the whole call, the ratio to the peer, and mgkit's overhead per rank.
  (b) heartbeat: ``mg.beat(step)`` per call, alone and as a launched rank's (into a pipe), as
      a share of a 1 ms step (goal: at most 1 %).
  (c) fault detection: for each fault of the launching issue, the time from the fault (the
      rank prints ``time.time()`` just before it) to the ``LaunchError`` in the kernel, or to
      every rank gone (Ctrl-C, the kernel killed).

Timings are reported, never asserted; exit status 0.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import os
import platform
import subprocess
import sys
import textwrap
import threading
import time

import jax
import psutil
from _stats import load_average, median, table

import mgkit as mg
from mgkit import _beat
from mgkit.launching import _wire

BEAT_GOAL = 0.01  # of a 1 ms step


def _env(platforms: str | None = "cpu") -> dict[str, str]:
    """This process's environment without mgkit's and XLA's settings, JAX held to ``platforms``
    (None: the platforms JAX finds, its GPU memory taken as needed, as mg.launch's ranks do)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MGKIT_SIMULATE", "XLA_FLAGS")}
    if platforms:
        env["JAX_PLATFORMS"] = platforms
    else:  # the launching process's own JAX may hold most of the GPU's memory
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


def peer_startup(n: int, platforms: str | None = "cpu") -> float:
    """Seconds to start ``n`` bare ``import jax; jax.devices()`` processes together and see them end."""
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen([sys.executable, "-c", "import jax; jax.devices()"], env=_env(platforms))
        for _ in range(n)
    ]
    for p in procs:
        p.wait()
    return time.perf_counter() - t0


def _noop(rank, shared, private):
    return rank


def startup(n: int, repeats: int) -> list[list[str]]:
    rows = []
    peers, plain, dist = [], [], []
    for i in range(repeats):  # ABBA: the peer first, then last, so drift hits both alike
        if i % 2 == 0:
            peers.append(peer_startup(n))
        for distributed, out in ((False, plain), (True, dist))[:: 1 if i % 2 == 0 else -1]:
            t0 = time.perf_counter()
            res = mg.launch(_noop, nprocs=n, distributed=distributed, stream=False)
            out.append((max(r.ready_seconds for r in res.ranks), time.perf_counter() - t0))
        if i % 2 == 1:
            peers.append(peer_startup(n))
    peer = median(peers)
    rows.append([f"bare JAX x{n} (peer)", f"{peer:.2f}", f"{peer:.2f}", "1.00", ""])
    for name, runs in (("mg.launch", plain), ("mg.launch distributed", dist)):
        ready, whole = median([r for r, _ in runs]), median([w for _, w in runs])
        rows.append(
            [
                name,
                f"{ready:.2f}",
                f"{whole:.2f}",
                f"{whole / peer:.2f}",
                f"{(whole - peer) / n * 1e3:.0f} ms",
            ]
        )
    return rows


def heartbeat(n: int = 200_000) -> list[list[str]]:
    rows = []
    t0 = time.perf_counter()
    for step in range(n):
        _beat.beat(step)
    alone = (time.perf_counter() - t0) / n
    rows.append(["mg.beat (no listener)", f"{alone * 1e6:.3f}", f"{alone / 1e-3 * 100:.4f} %"])
    r, w = os.pipe()
    stop = threading.Event()

    def drain():
        while _wire.recv_bytes(r) is not None:
            pass

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    b = _beat._beats
    b.channel, b.sent = _wire.Channel(w), 0.0
    try:
        t0 = time.perf_counter()
        for step in range(n):
            _beat.beat(step)
        ranked = (time.perf_counter() - t0) / n
    finally:
        b.channel = None
        stop.set()
        os.close(w)
        reader.join(2)
        os.close(r)
    verdict = "met" if ranked <= BEAT_GOAL * 1e-3 else "MISSED"
    rows.append(
        ["mg.beat in a rank (pipe)", f"{ranked * 1e6:.3f}", f"{ranked / 1e-3 * 100:.4f} % ({verdict})"]
    )
    return rows


def _dying(how: str):
    code = f"import os, signal, time\nprint('fault', time.time(), flush=True)\n{how}\n"

    def work(rank, shared, private):
        import time

        if rank == 0:
            exec(shared)
        time.sleep(60)

    return work, code


def _latency_of(err: mg.LaunchError, rank: int = 0) -> float:
    marks = [float(line.split()[-1]) for line in err.ranks[rank].tail if line.startswith("fault")]
    return time.time() - marks[0]


def _raise_fault(how: str) -> float:
    work, code = _dying(how)
    try:
        mg.launch(work, nprocs=2, shared=code, stream=False, grace=1.0)
    except mg.LaunchError as err:
        return _latency_of(err)
    raise AssertionError("no LaunchError")


def _stall() -> float:
    def work(rank, shared, private):
        import time

        import mgkit as mg

        for step in range(1, 4):
            mg.beat(step)
        print("fault", time.time(), flush=True)
        time.sleep(60)

    limit = 1.0
    try:
        mg.launch(work, nprocs=1, stall_after=limit, stream=False)
    except mg.LaunchError as err:
        return _latency_of(err) - limit
    raise AssertionError("no LaunchError")


def _interrupt() -> float:
    def work(rank, shared, private):
        import time

        time.sleep(60)

    pids, at = [], []

    def interrupt():
        while not pids:
            state = mg.launching._launch.current()
            if state and all(r.state == "running" for r in state[1]):
                pids.extend(r.pid for r in state[1])
            time.sleep(0.02)
        at.append(time.perf_counter())
        _thread.interrupt_main()

    threading.Thread(target=interrupt, daemon=True).start()
    with contextlib.suppress(KeyboardInterrupt):
        mg.launch(work, nprocs=2, stream=False)
    return _gone(pids) - at[0]


def _gone(pids: list[int]) -> float:
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        time.sleep(0.005)
    return time.perf_counter()


def _kernel_killed() -> float:
    script = textwrap.dedent(
        """
        import mgkit as mg
        mg.simulate(8)
        def work(rank, shared, private):
            import os, time
            print("pid", os.getpid(), flush=True)
            time.sleep(120)
        mg.launch(work, nprocs=2)
        """
    )
    kernel = subprocess.Popen(
        [sys.executable, "-u", "-c", script], stdout=subprocess.PIPE, text=True, env=_env()
    )
    pids = []
    while len(pids) < 2:
        line = kernel.stdout.readline()
        if not line:
            raise AssertionError("the kernel ended early")
        if " pid " in line:
            pids.append(int(line.split()[-1]))
    t0 = time.perf_counter()
    kernel.kill()
    kernel.wait()
    return _gone(pids) - t0


def _distributed(rank_to_fail: int, how: str) -> float:
    def work(rank, shared, private):
        import os
        import signal
        import time

        import jax
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
        total = jax.jit(
            jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())
        )
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), np.ones(1))
        for step in range(100_000):
            total(x).block_until_ready()
            if step == 3 and rank == shared[0]:
                print("fault", time.time(), flush=True)
                os.kill(os.getpid(), signal.SIGSTOP if shared[1] == "stop" else signal.SIGKILL)
            time.sleep(0.01)

    try:
        mg.launch(
            work,
            nprocs=2,
            distributed=True,
            shared=(rank_to_fail, how),
            timeouts={"heartbeat": 3},
            grace=1.0,
            stream=False,
        )
    except mg.LaunchError as err:
        return _latency_of(err, rank_to_fail)
    raise AssertionError("no LaunchError")


def faults() -> list[list[str]]:
    cases = [
        ("a rank raises", "within 1 s", lambda: _raise_fault("raise ValueError('boom')")),
        ("a rank exits with code 3", "within 0.5 s", lambda: _raise_fault("os._exit(3)")),
        ("a rank dies by SIGKILL", "within 0.5 s", lambda: _raise_fault("os.kill(os.getpid(), 9)")),
        ("a rank hangs (stall_after=1 s), beyond the limit", "report + stop", _stall),
        ("the cell is interrupted: ranks gone", "within grace + 5 s", _interrupt),
        ("the kernel is killed: ranks gone", "within 1 s", _kernel_killed),
        (
            "distributed: non-coordinator killed",
            "within heartbeat (3 s) + 2 s",
            lambda: _distributed(1, "kill"),
        ),
        ("distributed: coordinator killed", "within heartbeat (3 s) + 2 s", lambda: _distributed(0, "kill")),
        (
            "distributed: a rank stopped (SIGSTOP)",
            "within heartbeat (3 s) + 2 s",
            lambda: _distributed(1, "stop"),
        ),
    ]
    rows = []
    for name, goal, run in cases:
        seconds = run()
        rows.append([name, f"{seconds:.3f}", goal])
        print(f"  {name}: {seconds:.3f} s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--simulate", type=int, default=8)
    args = parser.parse_args()
    mg.simulate(args.simulate)
    machine = f"{platform.node()}, {os.cpu_count()} cores, load {load_average()}"
    print(f"bench_launch: {machine}, python {sys.version.split()[0]}, jax {jax.__version__}")
    print(f"\n(a) start-up, {args.nprocs} ranks, median of {args.repeats} (seconds)")
    print(
        table(
            ["what", "all ready", "whole call", "x peer", "overhead per rank"],
            startup(args.nprocs, args.repeats),
        )
    )
    print("\n(b) heartbeat cost")
    print(table(["what", "us per beat", "of a 1 ms step"], heartbeat()))
    print("\n(c) fault detection (seconds from the fault)")
    print(table(["fault", "seconds", "goal"], faults()))


if __name__ == "__main__":
    main()
