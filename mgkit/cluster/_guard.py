"""A cluster's guard: a tiny process that outlives nothing. It watches the kernel that started
the cluster and, when that kernel dies (SIGKILL, the out-of-memory killer, a crash), stops the
processes the cluster started (controller, engines: SIGTERM, then SIGKILL) and removes the
profile folder it made, so a dying kernel leaves nothing behind. ``close()`` stops the guard
first.

Run as ``python _guard.py KERNEL_PID FOLDER PID...`` (FOLDER ``-``: none); it imports nothing
of mgkit's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

PERIOD = 0.25  # seconds between two looks at the kernel
GRACE = 2.0  # seconds between SIGTERM and SIGKILL


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # no /proc (macOS): kill(0) is all there is
        return True


def _stop(pids: list[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                continue
        deadline = time.monotonic() + GRACE
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)


def start(kernel: int, pids: list[int], folder: str | None) -> subprocess.Popen:
    """Starts the guard of ``pids`` (and of the profile ``folder`` the cluster made) for the
    kernel ``kernel``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.Popen(
        [sys.executable, "-S", __file__, str(kernel), folder or "-", *map(str, pids)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,  # Ctrl-C in the kernel's terminal is not its business
    )


def main(argv: list[str]) -> int:
    kernel, folder, pids = int(argv[1]), argv[2], [int(p) for p in argv[3:]]
    while _alive(kernel):
        time.sleep(PERIOD)
    _stop(pids)
    if folder != "-" and os.path.basename(folder).startswith("mgkit-cluster-"):  # only its own
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
