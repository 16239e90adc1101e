"""Frames over a pipe between the kernel and its ranks: an 8-byte length, then the bytes.

Arguments, results, heartbeats and errors all cross private pipes made with ``os.pipe``; nothing
of a launch goes over a socket (the coordinator of ``jax.distributed`` is JAX's own).
"""

from __future__ import annotations

import os
import pickle
import struct
import threading

_HEADER = struct.Struct("!Q")


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


class Channel:
    """The sending end of a pipe: whole frames, one writer at a time (the main thread, the
    heartbeat flusher and the final result share it)."""

    def __init__(self, fd: int):
        self.fd = fd
        self._lock = threading.Lock()

    def send(self, message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            send_bytes(self.fd, data)

    def send_raw(self, data: bytes) -> None:
        with self._lock:
            send_bytes(self.fd, data)
