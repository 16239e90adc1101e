"""A rank's first code: ``python -m mgkit.launching FD_IN FD_OUT``, started by ``mg.launch``.

It reads its arguments from the kernel's pipe (FD_IN), keeps that pipe open as a lifeline
(its end means the kernel died: the rank exits at once), fixes nothing about devices itself
(the kernel set ``CUDA_VISIBLE_DEVICES`` or the CPU device count in the environment before
this interpreter started), joins ``jax.distributed`` when asked, says it is ready, runs the
function and sends back its value or its error over FD_OUT.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import traceback

from .. import _beat
from . import _check, _wire
from ._processes import leave_stacks

EXIT_LIFELINE = 70  # the kernel's end of the lifeline closed: it died or gave up on this rank


def _lifeline(fd: int, stacks: str) -> None:
    """Blocks on the kernel's pipe; when it ends, so does this process, removing its stacks file
    (the kernel may be dead: ``leave_stacks``) and nothing that could hang."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    leave_stacks(stacks)
    os._exit(EXIT_LIFELINE)


def _describe(exc: BaseException, during: str) -> _wire.Error:
    """The message that reports ``exc``, raised while starting (``during="start"``) or running."""
    kind = type(exc)
    name = (
        kind.__qualname__
        if kind.__module__ in ("builtins", "__main__")
        else (f"{kind.__module__}.{kind.__qualname__}")
    )
    try:
        import cloudpickle

        blob = cloudpickle.dumps(exc)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - the text below is enough when the exception cannot travel
        blob = None
    text = "".join(traceback.format_exception(type(exc), exc, _user_frames(exc.__traceback__)))
    return _wire.Error(name, str(exc), text, blob, during)


def _user_frames(tb):
    """The traceback from the user's function on (this module's own frames left out)."""
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def initialize(config: dict) -> None:
    """Joins jax.distributed with the kernel's coordinator address and timeouts."""
    import inspect

    import jax

    if config.get("loopback"):
        _gloo_on_loopback()
    kwargs = {
        "coordinator_address": config["coordinator"],
        "num_processes": config["num_processes"],
        "process_id": config["process_id"],
        "coordinator_bind_address": config.get("bind"),
        "initialization_timeout": config["init"],
        "heartbeat_timeout_seconds": config["heartbeat"],
        "shutdown_timeout_seconds": config["shutdown"],
    }
    accepted = inspect.signature(jax.distributed.initialize).parameters
    jax.distributed.initialize(**{k: v for k, v in kwargs.items() if k in accepted and v is not None})


def _gloo_on_loopback() -> None:
    """Gloo's CPU collectives listen on the address the host name resolves to; a launch on one
    machine keeps them on 127.0.0.1 like its coordinator."""
    try:
        from jax._src import xla_bridge

        make = xla_bridge._jax.make_gloo_tcp_collectives
    except (ImportError, AttributeError):  # pragma: no cover - layout of another jax
        return

    def on_loopback(*args, **kwargs):
        kwargs.setdefault("hostname", "127.0.0.1")
        return make(*args, **kwargs)

    with contextlib.suppress(AttributeError, TypeError):  # a read-only module: gloo's own choice
        xla_bridge._jax.make_gloo_tcp_collectives = on_loopback


def _finish(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def main(argv: list[str]) -> None:
    fd_in, fd_out = int(argv[1]), int(argv[2])
    frames = [_wire.recv_bytes(fd_in) for _ in range(4)]
    if any(f is None for f in frames):
        os._exit(EXIT_LIFELINE)
    header = pickle.loads(frames[0])
    stacks = open(header["stacks"], "w")  # noqa: SIM115 - open for the process's life
    threading.Thread(
        target=_lifeline, args=(fd_in, header["stacks"]), name="mgkit-lifeline", daemon=True
    ).start()
    channel = _wire.Channel(fd_out)
    rank = header["rank"]
    sys.path[:0] = [p for p in header["sys_path"] if p not in sys.path]
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.enable(file=sys.stderr)
    channel.send(_wire.Started())  # from now on SIGUSR1 writes the stacks, nothing worse
    t0 = time.perf_counter()
    try:
        import cloudpickle
        import jax

        if header["distributed"]:
            initialize(header["distributed"])
            # JAX's preemption notifier takes SIGTERM over; here it means what mg.launch means by it
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        from .._devices import short_name

        devices = [short_name(d) for d in jax.local_devices()]
        fn = cloudpickle.loads(frames[1])
        shared = cloudpickle.loads(frames[2])
        private = cloudpickle.loads(frames[3])
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then the rank exits
        channel.send(_describe(exc, "start"))
        _finish(1)
    channel.send(_wire.Ready(tuple(devices), time.perf_counter() - t0))
    _beat.attach(channel)
    code = 0
    try:
        value = fn(rank, shared, private)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        channel.send(_describe(exc, "run"))
        _finish(code)
    except BaseException as exc:  # noqa: BLE001
        channel.send(_describe(exc, "run"))
        _finish(1)
    try:
        blob = cloudpickle.dumps(value)
    except Exception as exc:  # noqa: BLE001 - reported by name with the rank
        bad = _check.unpicklable(value, "the value")
        part = "the value" if bad is None else f"{bad.part} (a {bad.kind})"
        channel.send(_wire.Unsendable(type(value).__qualname__, part, str(exc if bad is None else bad.error)))
        _finish(1)
    channel.send_result(blob)
    if header["distributed"]:
        try:
            jax.distributed.shutdown()
        except Exception:  # noqa: BLE001 - the value is home; a peer that is gone cannot matter now
            code = 0
    _finish(code)
