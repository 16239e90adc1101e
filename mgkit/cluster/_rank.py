"""What runs inside an engine: its setup (devices, ``jax.distributed``) once per cluster, and each
call of ``Cluster.run`` with its errors caught and described for the kernel.

These functions travel to the engines by value (``cloudpickle.register_pickle_by_value``): an
engine that unpickled them by name would import mgkit, and with it jax, before ``setup`` has
chosen its devices. What a rank keeps between calls lives in a module of the engine's own
(``state()``), not in these functions' globals, which travel with them.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
import traceback
import types
from typing import Any

STATE_MODULE = "_mgkit_rank_state"


def state() -> dict:
    """This engine's rank, devices and counters, kept across calls."""
    module = sys.modules.get(STATE_MODULE)
    if module is None:
        module = sys.modules[STATE_MODULE] = types.ModuleType(STATE_MODULE)
        module.values = {}
    return module.values


def setup(config: dict) -> dict:
    """Chooses this engine's devices and joins the cluster's ``jax.distributed`` group (once per
    engine: a second call with the same config only says where it stands).

    ``config``: ``rank``, ``ranks``, ``platform`` (``cpu``: ``devices`` simulated CPU devices;
    ``gpu``: the CUDA ids ``devices``), ``distributed`` (launching's coordinator config, or None),
    ``collectives`` (seconds, the CPU collectives' timeout) and ``sys_path``."""
    kept = state()
    if kept:
        return info()
    sys.path[:0] = [p for p in config["sys_path"] if p not in sys.path]
    if "jax" in sys.modules:
        raise RuntimeError(
            "jax was imported in this engine before mgkit set its devices up; start the cluster with "
            "mg.Cluster (its engines import nothing first), or c.restart() for fresh engines"
        )
    env = os.environ
    env["MGKIT_RANK"], env["MGKIT_NPROCS"] = str(config["rank"]), str(config["ranks"])
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).split()
    if config["distributed"] is not None:
        flags.append(f"--xla_cpu_collective_timeout_seconds={config['collectives']}")
    if config["platform"] == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(config["devices"])
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    else:
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_NUM_CPU_DEVICES"] = env["MGKIT_SIMULATE"] = str(config["devices"])
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    t0 = time.perf_counter()
    import jax

    from .._devices import short_name  # travels by value: cloudpickle keeps __package__
    from .._stops import install
    from ..launching import initialize_distributed

    if config["distributed"] is not None:
        initialize_distributed({**config["distributed"], "process_id": config["rank"]})
    install(config["rank"], config["ranks"] if config["distributed"] is not None else 1)
    _plain_tracebacks()
    _answer_stacks(config["rank"])
    kept.update(rank=config["rank"], ranks=config["ranks"], ready=time.perf_counter() - t0)
    kept["devices"] = tuple(short_name(d) for d in jax.local_devices())
    return info()


def _answer_stacks(rank: int) -> None:
    """SIGUSR1 makes faulthandler write every thread's stack into a file of this engine's (even
    while the main thread waits in a collective); a watcher thread publishes what it wrote."""
    import faulthandler
    import signal
    import tempfile
    import threading

    out = tempfile.TemporaryFile("w+")  # noqa: SIM115 - open for the engine's life
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)

    def watch() -> None:
        from ipyparallel.datapub import publish_data

        seen, seq = 0, 0
        while True:
            time.sleep(0.1)
            size = os.fstat(out.fileno()).st_size
            if size > seen:
                time.sleep(0.1)  # the whole of it
                with open(out.fileno(), closefd=False, errors="replace") as f:
                    f.seek(seen)
                    text = f.read()
                seen += len(text.encode())
                seq += 1
                publish_data({f"mgkit-stacks-{rank:05d}-{seq:09d}": text})

    threading.Thread(target=watch, name="mgkit-stacks", daemon=True).start()


def _plain_tracebacks() -> None:
    """The engine's tracebacks as Python writes them, the cell's lines included, without colour:
    IPython's default (context, coloured) takes a second or more to format the first one, which
    a rank stopped by Ctrl-C would spend before it answers."""
    import builtins
    import contextlib
    import io

    with contextlib.suppress(Exception), contextlib.redirect_stdout(io.StringIO()):
        shell = getattr(builtins, "get_ipython", lambda: None)()  # an engine's shell puts it there
        if shell is not None:
            shell.run_line_magic("xmode", "Plain")
            shell.run_line_magic("colors", "nocolor")


def info() -> dict:
    """This engine's rank, host, pid and devices."""
    kept = state()
    return {
        "rank": kept.get("rank"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "devices": kept.get("devices", ()),
        "ready": kept.get("ready"),
        "jax": "jax" in sys.modules,
    }


def begin(call: int) -> None:
    """The kernel's next call is number ``call`` (its fits' stop requests are keyed by it)."""
    from .._stops import group

    g = group()
    if g is not None:
        g.begin(call)


def call(fn_bytes: bytes, shared_bytes: bytes, private_bytes: bytes) -> tuple:
    """Runs ``fn(rank, shared, private)`` here: ("ok", pickled value) or ("error", facts)."""
    import cloudpickle

    try:
        fn = cloudpickle.loads(fn_bytes)
        value = fn(state()["rank"], cloudpickle.loads(shared_bytes), cloudpickle.loads(private_bytes))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the kernel, described
        return "error", describe(exc)
    try:
        return "ok", cloudpickle.dumps(value)
    except Exception as exc:  # noqa: BLE001
        return "unsendable", {"type": type(value).__qualname__, "error": f"{type(exc).__name__}: {exc}"}


def describe(exc: BaseException) -> dict:
    """An exception as the kernel reports it: type, message, traceback text and the exception
    itself where it pickles."""
    import cloudpickle

    try:
        blob = cloudpickle.dumps(exc)
    except Exception:  # noqa: BLE001 - described by text only
        blob = None
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"type": type(exc).__name__, "message": str(exc), "traceback": text, "exception": blob}


def compilations() -> int:
    """How many XLA compilations this engine has done (counted from the first call on)."""
    kept = state()
    if "compilations" not in kept:
        import jax.monitoring

        kept["compilations"] = 0

        def heard(event: str, duration: float, **kwargs: Any) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                kept["compilations"] += 1

        jax.monitoring.register_event_duration_secs_listener(heard)
    return kept["compilations"]


def free_port() -> int:
    """A free TCP port on this engine's host (rank 0 hosts the coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Outbox:
    """A bounded buffer the rank's ledger appends each entry to (``Ledger.attach``): when full,
    entries are counted as dropped, never waited for."""

    def __init__(self, size: int):
        import collections

        self.items: Any = collections.deque()
        self.size, self.dropped = size, 0

    def append(self, entry: Any) -> None:
        if len(self.items) < self.size:
            self.items.append(entry)
        else:
            self.dropped += 1

    def extend(self, entries: Any) -> None:
        for entry in entries:
            self.append(entry)


def stream(on: bool, rate: float, size: int, batch: int) -> bool:
    """Sends this rank's ledger entries to the kernel (``on``), at most ``rate`` messages a
    second of at most ``batch`` events each, holding at most ``size`` entries meanwhile; or stops
    sending. Returns whether it sends."""
    import threading

    from .._ledger import ledger

    kept = state()
    if not on:
        detach = kept.pop("detach", None)
        if detach is not None:
            detach()
        return False
    kept["rate"], kept["batch"] = rate, batch  # the sender reads them at each round
    if "detach" in kept:
        return True
    box = kept["outbox"] = Outbox(size)
    kept.setdefault("lock", threading.RLock())  # a batch is taken and published as one, or drained
    kept["detach"] = ledger().attach(box)
    if "sender" not in kept:

        def send() -> None:
            from ipyparallel.datapub import publish_data

            seq = 0
            while True:
                time.sleep(1.0 / kept["rate"])
                sample(kept)  # outside the lock: a drain never waits for a reading
                with kept["lock"]:
                    batch = take(kept["batch"])
                    if batch[0] or batch[1] or batch[2]:
                        seq += 1
                        publish_data({f"mgkit-events-{kept['rank']:05d}-{seq:09d}": batch})

        kept["sender"] = threading.Thread(target=send, name="mgkit-stream", daemon=True)
        kept["sender"].start()
    return True


def take(most: int | None = None) -> tuple[list, int, dict, tuple]:
    """Up to ``most`` of the entries waiting (all: None) as rows (``rows``), the entries
    dropped since the last take, the news (``news``) and the layouts first sent now; after any
    batch the sender was publishing (its publication comes first)."""
    kept = state()
    box = kept.get("outbox")
    if box is None:
        return [], 0, {}, (os.getpid(), [])
    with kept["lock"]:
        n = len(box.items) if most is None else min(len(box.items), most)
        entries = [box.items.popleft() for _ in range(n)]
        dropped, box.dropped = box.dropped, 0
        heard = news(kept)
        layouts, out = rows(kept, entries)
    return out, dropped, heard, (os.getpid(), layouts)


def rows(kept: dict, entries: list) -> tuple[list, list]:
    """Ledger entries as rows to send: an event as its ten fields; a layout's call (a step: its
    events are alike every time) as ``(key, start, seconds, label, extra)``, its layout's rows
    sent once, the first time, as ``(key, rows)`` in the first list. The kernel makes the call
    again from them, so a step costs one small row whatever its event count."""
    from .._ledger import Call

    sent = kept.setdefault("layouts", {})  # id -> (layout, key): kept, so that no id is reused
    layouts, out = [], []
    for entry in entries:
        if type(entry) is Call:
            known = sent.get(id(entry.layout))
            if known is None:
                known = sent[id(entry.layout)] = (entry.layout, len(sent))
                layouts.append((known[1], entry.layout.rows))
            out.append((known[1], entry.start, entry.seconds, entry.label, entry.extra))
        else:
            out.append(tuple(entry))
    return layouts, out


SAMPLE_EVERY = 0.5  # seconds between two readings of this rank's devices' memory, at least
SAMPLE_SHARE = 0.01  # share of a core the readings may take (live arrays cost ~4 us each to sum)


def news(kept: dict) -> dict:
    """What the kernel has not heard yet besides ledger entries: ``beat``, the last heartbeat
    (``mg.beat``'s ``LastBeat``: beats so far, step, wall time) when there was a new one, and ``memory``,
    the readings ``sample`` took since the last take (oldest first)."""
    from .._beat import last_beat

    out: dict = {}
    if "detach" not in kept:  # not streaming
        return out
    from .._stops import fitting

    now = fitting()
    if now != kept.get("fitting_sent", False):
        kept["fitting_sent"] = out["fitting"] = now
    beat = last_beat()
    if beat.count and beat.count != kept.get("beat_sent"):
        kept["beat_sent"] = beat.count
        out["beat"] = beat
    samples = kept.get("samples")
    if samples:
        out["memory"] = [samples.popleft() for _ in range(len(samples))]
    return out


def sample(kept: dict) -> None:
    """Reads this rank's devices' memory when due (every ``SAMPLE_EVERY`` s at most, and within
    ``SAMPLE_SHARE`` of a core), with the source the kernel's own memory view reads (allocator
    statistics, else the live arrays' bytes); a reading equal to the last one kept is left out,
    so an idle rank sends nothing. Kept in ``kept["samples"]`` (bounded) for the next take."""
    import collections

    now = time.monotonic()
    if "detach" not in kept or now < kept.get("sample_next", 0.0):
        return
    t0 = time.thread_time()
    import jax

    from .._contexts import context_map, device_of
    from .._devices import readings, short_name

    local = jax.local_devices()
    names: dict = {d: [] for d in local}
    cmap = context_map()
    for name in cmap.names:
        device = device_of(name)
        if device in names:
            names[device].append(name)
    read = readings(local)
    rows = [
        {
            "contexts": tuple(names[d]),
            "device": short_name(d),
            "platform": d.platform,
            "kind": d.device_kind,
            "t": time.time(),
            "used": read[d].used,
            "peak": read[d].peak,
            "limit": read[d].limit,
            "source": read[d].source,
        }
        for d in local
    ]
    cost = time.thread_time() - t0
    kept["sample_next"] = now + max(SAMPLE_EVERY, cost / SAMPLE_SHARE)
    same = [(r["contexts"], r["used"], r["peak"], r["limit"]) for r in rows]
    if same == kept.get("sample_last"):
        return
    kept["sample_last"] = same
    kept.setdefault("samples", collections.deque(maxlen=64)).append(rows)
