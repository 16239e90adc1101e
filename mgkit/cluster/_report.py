"""How a cluster says where it stands and how a call ended, in words: its table (rank, host,
pid, devices, state, last beat), the errors of a rank that raised and of a preemption, and what
Ctrl-C left on each rank."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import cloudpickle

from .._stops import PreemptedError
from ..launching import Failure, LaunchError, RankInfo, launch_error
from ._engines import Pending

HEADERS = ("rank", "host", "pid", "devices", "state", "last beat", "ready (s)", "calls")


def rows(c: Any) -> list[tuple]:
    """The cluster ``c``'s table, a row per rank."""
    return [
        (
            r.rank,
            c.hosts[r.rank] if r.rank < len(c.hosts) else "?",
            r.pid,
            ",".join(r.devices),
            r.state if not c.closed else "closed",
            r.beat_text(),
            "" if r.ready_seconds is None else round(r.ready_seconds, 2),
            c.calls,
        )
        for r in c.ranks
    ]


def title(c: Any) -> str:
    """The line above the cluster ``c``'s table: its shape, launcher, group and state."""
    state = "closed" if c.closed else c.lost or "warm"
    group = "one jax.distributed group" if c.distributed and c.engines > 1 else "no jax.distributed"
    return (
        f"mgkit cluster: {c.engines} rank(s) x {c.devices_per_engine} device(s), {c.launcher} "
        f"launcher, {group}; {state}; started in {c.start_seconds:.1f} s"
    )


def is_preempted(outcome: tuple[str, Any]) -> bool:
    """Whether a rank's outcome is the ``PreemptedError`` of a preemption."""
    kind, facts = outcome
    return kind == "error" and isinstance(facts, dict) and facts.get("type") == PreemptedError.__name__


def preempted_error(
    outcomes: Sequence[tuple[str, Any]],
    preempted: Sequence[int],
    ranks: Sequence[RankInfo],
    hosts: Sequence[str],
) -> tuple[str, LaunchError]:
    """A rank's SIGTERM stopped every rank's fit at one step (saved where the trainer has a
    checkpoint folder): why the cluster is lost now (the preempted rank exits) and the error
    naming the rank and the step. ``preempted``: the ranks whose outcome is a PreemptedError."""
    message = outcomes[preempted[0]][1].get("message", "")
    found = re.search(r"rank (\d+) was preempted", message)
    root = int(found.group(1)) if found and int(found.group(1)) < len(ranks) else preempted[0]
    what = message.split("(SIGTERM)", 1)[-1].strip() if "(SIGTERM)" in message else ""
    host, pid = hosts[root], ranks[root].pid
    for info in ranks:
        info.state = "preempted" if info.rank == root else "stopped"
        info.reason = "" if info.rank == root else f"stopped with rank {root} (SIGTERM to rank {root})"
    who = f"rank {root} ({host}, pid {pid}) was preempted (SIGTERM)"
    lost, head = f"{who} and exits", f"{who}{what}. Rank {root} exits, so call c.restart() first"
    facts = outcomes[root][1] if outcomes[root][0] == "error" else outcomes[preempted[0]][1]
    failure = Failure("signal", head, PreemptedError.__name__, facts.get("traceback", ""))
    results = [cloudpickle.dumps(v) if k == "ok" else None for k, v in outcomes]
    return lost, launch_error(head, failure, ranks, root, results)


def interrupted(
    ranks: Sequence[RankInfo], hosts: Sequence[str], pending: Pending, wait: float
) -> KeyboardInterrupt:
    """After Ctrl-C: each rank's state set, and the KeyboardInterrupt saying where each stopped
    (a fit: its step), or that it still runs ``wait`` seconds later."""
    lines = []
    for info, finished in zip(ranks, pending.done(), strict=False):
        host = hosts[info.rank] if info.rank < len(hosts) else "?"
        if not finished:
            info.state = "running"
            what = f"still running {wait:g} s after Ctrl-C: the next call waits for it"
        else:
            info.state = "ready"
            kind, facts = pending.result(info.rank)
            what = "had finished" if kind == "ok" else f"{facts.get('type')}: {facts.get('message', '')}"
        lines.append(f"  rank {info.rank} ({host}): {(what.splitlines() or [''])[0]}")
    head = "Ctrl-C stopped the call on the ranks; the cluster stays warm:"
    return KeyboardInterrupt("\n".join([head, *lines]))


@dataclasses.dataclass
class Raise:
    """A call's first rank that raised while others still ran (``rank``, None until one did, at
    ``at``, ``time.monotonic()``), and the ranks then interrupted (``stopped``)."""

    began: float  # time.time() when the call began: a rank's step from before it is not told
    rank: int | None = None
    at: float = 0.0
    stopped: list[int] = dataclasses.field(default_factory=list)


def raised_error(
    outcomes: Sequence[tuple[str, Any]],
    ranks: Sequence[RankInfo],
    hosts: Sequence[str],
    raised: Raise,
    stacks: dict[int, str] | None = None,
) -> LaunchError:
    """A rank raised (``raised.rank``, else the first that did not reply "ok": it may have
    returned what cannot be sent back): the error naming it and every other rank's fate.
    ``raised.stopped``: the ranks still running when it raised, then interrupted (a fit at its
    next step boundary); with ``stacks`` they were stuck where no signal reaches (a collective
    waiting for it) and were stopped with their engines: the cluster needs ``c.restart()``. An
    outcome ("running", None) is a rank that never replied."""
    stopped = raised.stopped
    root = raised.rank
    if root is None:
        root = next(r for r, (kind, _) in enumerate(outcomes) if kind != "ok")
    kind, facts = outcomes[root]
    if root < len(ranks):
        ranks[root].state = "raised" if kind == "error" else kind
    host = hosts[root] if root < len(hosts) else "?"
    pid = ranks[root].pid if root < len(ranks) else "?"
    exception = None
    if kind == "unsendable":
        head = (
            f"rank {root} ({host}, pid {pid}) returned a {facts['type']}, which cannot be sent back "
            f"({facts['error']}); return plain data or numpy arrays"
        )
        failure = Failure("unsendable", head)
    else:
        head = f"rank {root} ({host}, pid {pid}) raised {facts['type']}: {facts['message']}"
        if facts.get("exception"):
            with contextlib.suppress(Exception):
                exception = cloudpickle.loads(facts["exception"])
        failure = Failure("raised", head, facts["type"], facts["traceback"], exception, stacks or {})
    for r, (k, other) in enumerate(outcomes):
        if r == root or r >= len(ranks):
            continue
        info = ranks[r]
        beat = info.step is not None and (info.beat_at or 0.0) >= raised.began
        step = f", last completed step {info.step}" if beat else ""
        if r in stopped and stacks is not None:
            info.state = "stopped"
            where = waiting_in(stacks.get(r, ""))
            info.reason = f"waited for rank {root} where no signal reaches (a collective{where}){step}"
        elif r in stopped:
            info.state = "stopped"
            how = "" if k == "ok" else f" ({other['type']})"
            info.reason = f"stopped after rank {root} raised{step}{how}"
        elif k not in ("ok", "running"):
            info.reason = f"raised {other.get('type', '?')}: {other.get('message', '')}"
    results = [cloudpickle.dumps(v) if k == "ok" else None for k, v in outcomes]
    tail = (
        " (the cluster stays warm)"
        if stacks is None
        else "; the ranks waiting for it were stopped: call c.restart()"
    )
    return launch_error(head + tail, failure, ranks, root, results)


def waiting_in(stacks: str) -> str:
    """Where a rank's main thread is, from its faulthandler stacks: ", in f (file.py:12)" for its
    innermost frame of the user's or mgkit's code (not an installed library's nor Python's own);
    "" when the text does not say."""
    main = stacks.split("Current thread", 1)[1] if "Current thread" in stacks else ""
    frames = re.findall(r'File "([^"]*)", line (\d+) in (\S+)', main.split("\n\n", 1)[0])
    ours = [f for f in frames if not re.search(r"site-packages|dist-packages|/lib/python3[.\d]*/", f[0])]
    if not (ours or frames):
        return ""
    path, line, name = (ours or frames)[0]
    place = f"the cell's line {line}" if "/ipykernel_" in path else f"{path.rsplit('/', 1)[-1]}:{line}"
    return f", in {name} ({place})"
