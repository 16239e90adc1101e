"""Starting and stopping a launch's rank processes, reading their pipes, and asking their stacks.

Each rank is a fresh interpreter (``python -m mgkit.launching``; JAX cannot be forked) in a
session of its own, so that the notebook's Interrupt, which signals the kernel's process group,
does not reach it. Its arguments go in over one pipe, which then stays open as its lifeline;
its messages come back over another, and its output over stdout and stderr. A thread per pipe
hands what it reads to the kernel as ``Heard`` items. A rank's stacks go to a file in the
launch's folder (``stacks_folder``), which the launch removes, or its ranks when the kernel is
killed (``leave_stacks``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO, NamedTuple

from . import _wire
from ._wire import Line, Message

STACK_WAIT = 0.5  # seconds the ranks get to write their stacks
KILL_WAIT = 5.0  # seconds to wait for a killed process to be reaped


class Heard(NamedTuple):
    """Something a rank said, as a reader thread hands it to the kernel."""

    rank: int  # who said it
    what: Message | Line  # a message over its pipe, or a line of its output


class Process:
    """One rank's process: its ``Popen``, the kernel's end of its lifeline, and its reader threads."""

    def __init__(self, rank: int, popen: subprocess.Popen, lifeline: int):
        self.rank = rank
        self.popen = popen
        self.pid = popen.pid
        self.lifeline: int | None = lifeline  # the kernel's end of the pipe into the rank
        self.readers: list[threading.Thread] = []  # messages, stdout, stderr
        self.messages_done = threading.Event()  # its message pipe closed: all its messages were heard

    def running(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        """SIGTERM to the rank's session (and SIGCONT: a stopped process acts on SIGTERM only then)."""
        signal_group(self.pid, signal.SIGTERM)
        signal_group(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        signal_group(self.pid, signal.SIGKILL)

    def wait(self, seconds: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(seconds)

    def drained(self, seconds: float) -> None:
        """Waits up to ``seconds`` for an exited rank's pipes to deliver its last words."""
        deadline = time.perf_counter() + seconds
        self.messages_done.wait(seconds)
        for t in self.readers[1:]:
            t.join(max(0.0, deadline - time.perf_counter()))


def spawn(rank: int, env: dict[str, str], frames: list[bytes], heard: Callable[[Heard], None]) -> Process:
    """Starts rank ``rank``'s process with ``env``, sends it ``frames`` (its arguments), and starts
    the threads that hand what it says to ``heard``."""
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    try:
        popen = subprocess.Popen(
            [sys.executable, "-u", "-m", "mgkit.launching", str(r_in), str(w_out)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            pass_fds=(r_in, w_out),
            start_new_session=True,
        )
    except BaseException:
        for fd in (r_in, w_in, r_out, w_out):
            os.close(fd)
        raise
    os.close(r_in)
    os.close(w_out)
    p = Process(rank, popen, w_in)
    threads = [
        threading.Thread(target=_send_frames, args=(w_in, frames), daemon=True),
        threading.Thread(target=_read_messages, args=(p, r_out, heard), daemon=True),
        threading.Thread(target=_read_lines, args=(rank, popen.stdout, "out", heard), daemon=True),
        threading.Thread(target=_read_lines, args=(rank, popen.stderr, "err", heard), daemon=True),
    ]
    for t in threads:
        t.start()
    p.readers = threads[1:]
    return p


def _send_frames(fd: int, frames: list[bytes]) -> None:
    with contextlib.suppress(OSError):  # the rank died first: its exit tells the story
        for frame in frames:
            _wire.send_bytes(fd, frame)


def _read_messages(p: Process, fd: int, heard: Callable[[Heard], None]) -> None:
    try:
        while (message := _wire.read_message(fd)) is not None:
            heard(Heard(p.rank, message))
    except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError):
        pass  # a rank cut off mid-message: its exit tells the story
    finally:
        os.close(fd)
        p.messages_done.set()


def _read_lines(rank: int, pipe: IO[bytes], stream: str, heard: Callable[[Heard], None]) -> None:
    with contextlib.suppress(OSError, ValueError):
        for raw in iter(pipe.readline, b""):
            heard(Heard(rank, Line(stream, raw.decode(errors="replace").rstrip("\r\n"))))


def kill_all(processes: list[Process]) -> None:
    """SIGKILL to every process still running, then their pipes closed and readers joined."""
    for p in processes:
        if p.running():
            p.kill()
    for p in processes:
        p.wait(KILL_WAIT)
        if p.lifeline is not None:
            with contextlib.suppress(OSError):
                os.close(p.lifeline)
            p.lifeline = None
    for p in processes:
        for t in p.readers:
            t.join(1.0)
        for pipe in (p.popen.stdout, p.popen.stderr):
            with contextlib.suppress(OSError):
                pipe.close()


def ask_stacks(processes: list[Process], stacks_dir: str) -> dict[int, str]:
    """Each process's Python stacks, written by faulthandler on SIGUSR1 (no debugger needed) to
    ``stacks_dir/rank<r>.txt``. Only ask processes whose stack handler is in place (SIGUSR1
    ends an interpreter that is still starting); one that cannot be signalled is left out."""
    asked, stacks = [], {}
    for p in processes:
        path = stacks_path(stacks_dir, p.rank)
        with contextlib.suppress(OSError):
            size = os.path.getsize(path)
            os.kill(p.pid, signal.SIGUSR1)
            asked.append((p, path, size))
    time.sleep(STACK_WAIT / 2)
    deadline = time.perf_counter() + STACK_WAIT / 2
    for p, path, size in asked:
        text = ""
        while True:
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                f.seek(size)
                text = f.read()
            if text or time.perf_counter() > deadline:
                break
            time.sleep(0.02)
        stacks[p.rank] = text.strip() or "(no answer: the process is stopped, or stuck outside Python)"
    return stacks


def stacks_path(stacks_dir: str, rank: int) -> str:
    """The file rank ``rank`` writes its stacks to when asked."""
    return os.path.join(stacks_dir, f"rank{rank}.txt")


STACKS_PREFIX = "mgkit-launch-"  # a launch's folder of stacks files: mgkit-launch-<kernel pid>-<random>
_STACKS_FILE = re.compile(r"rank\d+\.txt")


def stacks_folder() -> str:
    """A fresh folder in the temporary directory for a launch's stacks files, named by this
    process's pid. The folders that launches of a process that is gone left behind (a kernel
    killed mid-launch, whose ranks could not all remove theirs) are removed first: only
    this user's, holding nothing but stacks files."""
    tmp = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(tmp):
            pid = name[len(STACKS_PREFIX) :].split("-")[0]
            if name.startswith(STACKS_PREFIX) and pid.isdigit() and not _alive(int(pid)):
                _remove_left(os.path.join(tmp, name))
    return tempfile.mkdtemp(prefix=f"{STACKS_PREFIX}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _remove_left(folder: str) -> None:
    """Removes a launch's folder left behind, if it is this user's and holds only stacks files."""
    with contextlib.suppress(OSError):
        if os.stat(folder).st_uid == os.getuid() and all(
            _STACKS_FILE.fullmatch(f) for f in os.listdir(folder)
        ):
            shutil.rmtree(folder, ignore_errors=True)


def leave_stacks(path: str) -> None:
    """A rank whose kernel is gone removes its stacks file, and the folder once it is empty (the
    last rank out removes it): the kernel, killed, cannot."""
    with contextlib.suppress(OSError):
        os.remove(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))


def signal_group(pid: int, sig: int) -> None:
    """Signals the rank's own session (it leads it: its pid is the group's id), only if it is still ours."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
