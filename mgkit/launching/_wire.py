"""What crosses the pipes between the kernel and its ranks: frames, and the messages in them.

A frame is an 8-byte length, then the bytes. A message is a frame holding a pickled plain
tuple, its tag then its fields (``("ready", devices, seconds)``), so that reading it needs no
class; ``decode`` turns it into one of the typed messages below, ``encode`` back. A rank's value
follows its ``Result`` header as a frame of its own (it can be large). Arguments, results,
heartbeats and errors all cross private pipes made with ``os.pipe``; nothing of a launch goes
over a socket (the coordinator of ``jax.distributed`` is JAX's own).

A rank sends, in order: ``Started``, then ``Ready`` (or an ``Error`` while starting), ``Beat``
messages while it runs, and last its ``Result``, an ``Error`` or ``Unsendable``.
"""

from __future__ import annotations

import os
import pickle
import struct
import threading
from typing import NamedTuple

_HEADER = struct.Struct("!Q")


class Started(NamedTuple):
    """The rank's interpreter runs and its stack handler is in place (SIGUSR1 is now safe)."""


class Ready(NamedTuple):
    """The rank has started JAX (and joined jax.distributed) and is about to call the function."""

    devices: tuple[str, ...]  # short names of the rank's local devices
    seconds: float  # from its interpreter's start to ready


class Beat(NamedTuple):
    """A heartbeat: a step finished (``mg.beat``; ``mgkit._beat`` sends this wire form itself)."""

    step: int  # the last step reported
    wall: float  # time.time() of the beat
    slowest: float  # the slowest step seen so far, in seconds (0 before the second beat)


class Result(NamedTuple):
    """The function's return value, pickled (on the wire: a header with its size, then the bytes)."""

    value: bytes  # cloudpickle of the value


class Error(NamedTuple):
    """The rank raised (or called sys.exit) while starting or running the function."""

    type: str  # the exception's type name (module-qualified unless builtin or __main__)
    message: str  # str() of the exception
    traceback: str  # the traceback text, from the user's function on
    exception: bytes | None  # the exception, pickled; None when it cannot be sent
    during: str  # "start" (before the function was called) or "run"


class Unsendable(NamedTuple):
    """The function returned a value that cannot be pickled."""

    type: str  # the value's type name
    part: str  # which part of it cannot be pickled ("the value['lock'] (a _thread.lock)")
    message: str  # why, in pickle's words


class Line(NamedTuple):
    """A line of a rank's output (not a message: read from its stdout or stderr)."""

    stream: str  # "out" or "err"
    text: str  # the line, without its newline


Message = Started | Ready | Beat | Result | Error | Unsendable
_TAGS: dict[type, str] = {
    Started: "started",
    Ready: "ready",
    Beat: "beat",
    Result: "result",
    Error: "error",
    Unsendable: "unsendable",
}
_TYPES = {tag: kind for kind, tag in _TAGS.items()}


def encode(message: Message) -> tuple:
    """The plain tuple a message crosses the pipe as: its tag, then its fields."""
    return (_TAGS[type(message)], *message)


def decode(wire: tuple) -> Message:
    """The typed message of a plain tuple read from a pipe."""
    return _TYPES[wire[0]](*wire[1:])


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_exact(fd: int, n: int) -> bytes | None:
    """n bytes from fd, or None at end of file."""
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def send_bytes(fd: int, data: bytes) -> None:
    write_all(fd, _HEADER.pack(len(data)) + data if len(data) < 65536 else _HEADER.pack(len(data)))
    if len(data) >= 65536:
        write_all(fd, data)


def recv_bytes(fd: int) -> bytes | None:
    """The next frame, or None when the other side closed the pipe."""
    head = read_exact(fd, _HEADER.size)
    if head is None:
        return None
    body = read_exact(fd, _HEADER.unpack(head)[0])
    if body is None:
        return None
    return body


def read_message(fd: int) -> Message | None:
    """The next message from a rank (a ``Result`` with its value read too), or None when the
    pipe closed. Raises what unpickling a damaged frame raises."""
    data = recv_bytes(fd)
    if data is None:
        return None
    wire = pickle.loads(data)
    if wire[0] != _TAGS[Result]:
        return decode(wire)
    value = recv_bytes(fd)
    return None if value is None else Result(value)


class Channel:
    """The sending end of a pipe: whole messages, one writer at a time (the main thread, the
    heartbeat flusher and the final result share it)."""

    def __init__(self, fd: int):
        self.fd = fd
        self._lock = threading.Lock()

    def send(self, message: Message | tuple) -> None:
        """Sends a typed message, or a wire tuple as ``encode`` makes them (``mgkit._beat``'s)."""
        wire = message if type(message) is tuple else encode(message)
        data = pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            send_bytes(self.fd, data)

    def send_result(self, value: bytes) -> None:
        """Sends a pickled value: its header, then the bytes, with no heartbeat between them."""
        header = pickle.dumps((_TAGS[Result], len(value)), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            send_bytes(self.fd, header)
            send_bytes(self.fd, value)
