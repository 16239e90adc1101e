"""How a cluster says where it stands and how a call ended, in words: its table (rank, host,
pid, devices, state, last beat), the error of a preemption, and what Ctrl-C left on each rank."""

from __future__ import annotations

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
