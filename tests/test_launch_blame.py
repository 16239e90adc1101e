"""Who is to blame when a launch fails, decided from recorded message sequences: the judge is fed
each rank's messages, output lines and exit code, with no process started."""

import signal
from typing import NamedTuple

import pytest

from mgkit.launching import RankInfo
from mgkit.launching._blame import Judge
from mgkit.launching._child import EXIT_LIFELINE
from mgkit.launching._ranks import RankState
from mgkit.launching._result import launch_error
from mgkit.launching._watch import Silence
from mgkit.launching._wire import Beat, Error, Line, Ready, Result, Started, Unsendable


def work(rank, shared, private):
    return rank


class Exit(NamedTuple):
    """A rank's exit in a recorded sequence."""

    code: int


class Timeout(NamedTuple):
    """The launch's clock ran past ``timeout=seconds`` (in a recorded sequence, with rank None)."""

    seconds: float


class Recorder:
    """Stands for the processes: records the ledger events and the stacks asked, and hands over
    the exits of the ranks that died without a word when the judge looks for a dead peer."""

    def __init__(self, dead_peers=()):
        self.judge = None
        self.dead_peers = list(dead_peers)  # (rank, code) seen dead when asked
        self.events = []  # (rank, what) recorded in the ledger
        self.asked = []  # the ranks whose stacks were asked, per ask

    def dead_peer(self, rank):
        for peer, code in self.dead_peers:
            if peer != rank and not self.judge.ranks[peer].exited:
                self.judge.exited(peer, code, 50.0)
                return

    def stacks(self, ranks):
        self.asked.append(list(ranks))
        return {r: f"stack of rank {r}" for r in ranks}

    def record(self, r, what, nbytes, seconds):
        self.events.append((r.rank, what))


def judged(nprocs, sequence, distributed=False, dead_peers=()):
    """The judge after hearing ``sequence``: (rank, message, line, Exit or Timeout) in order, one a
    second."""
    recorder = Recorder(dead_peers)
    ranks = [RankState(RankInfo(r, 100 + r, (f"cpu{r}",)), spawned=0.0) for r in range(nprocs)]
    judge = Judge(ranks, recorder, work, collectives=300 if distributed else None)
    recorder.judge = judge
    for now, (rank, what) in enumerate(sequence, start=1):
        if isinstance(what, Exit):
            judge.exited(rank, what.code, float(now))
        elif isinstance(what, Timeout):
            judge.timed_out(what.seconds, float(now))
        else:
            judge.hear(rank, what, float(now))
    return judge, recorder


def running(*ranks):
    """Every rank started and ready."""
    return [item for r in ranks for item in ((r, Started()), (r, Ready((f"cpu{r}",), 0.5)))]


def raised(kind, message, during="run"):
    return Error(kind, message, f"Traceback (most recent call last):\n{kind}: {message}\n", None, during)


def states(judge):
    return [r.info.state for r in judge.ranks]


# -- one rank's own failure ---------------------------------------------------------------------


def test_the_first_rank_to_raise_is_the_root_the_finished_keep_their_values():
    judge, recorder = judged(
        3,
        [
            *running(0, 1, 2),
            (0, Result(b"early")),
            (0, Exit(0)),
            (1, Line("out", "raising")),
            (1, raised("ValueError", "bad row in rank 1")),
            (1, Exit(1)),
        ],
    )
    assert judge.root.rank == 1 and judge.failure.kind == "raised"
    assert judge.failure.reason == "raised ValueError: bad row in rank 1"
    assert judge.failure.exception_type == "ValueError" and "bad row in rank 1" in judge.failure.traceback
    assert judge.head() == "rank 1 (pid 101) raised ValueError: bad row in rank 1"
    assert states(judge) == ["done", "failed", "running"]
    assert judge.ranks[1].info.tail[-1] == "raising"
    judge.terminating(2, "terminated after rank 1 failed")  # the supervisor stops the rest
    judge.exited(2, -signal.SIGTERM, 9.0)
    assert states(judge) == ["done", "failed", "terminated"]
    assert judge.ranks[2].info.reason == "terminated after rank 1 failed"
    assert recorder.events == [(0, "ready"), (1, "ready"), (2, "ready"), (0, "done"), (1, "failed")]


def test_a_rank_that_fails_after_the_root_failed_too():
    judge, _ = judged(
        2,
        [
            *running(0, 1),
            (0, raised("RuntimeError", "rank 0 gives up")),
            (0, Exit(1)),
            (1, raised("RuntimeError", "rank 1 gives up")),
            (1, Exit(1)),
        ],
    )
    assert judge.root.rank == 0 and states(judge) == ["failed", "failed"]
    assert judge.ranks[1].info.reason == "failed too, after rank 0: it raised RuntimeError: rank 1 gives up"


def test_a_rank_that_dies_after_the_root_without_an_error_was_aborted():
    judge, _ = judged(2, [*running(0, 1), (0, raised("ValueError", "x")), (0, Exit(1)), (1, Exit(-9))])
    assert judge.root.rank == 0 and states(judge) == ["failed", "aborted"]
    assert judge.ranks[1].info.reason.startswith("aborted after rank 0 died (it was killed by signal SIGKILL")


@pytest.mark.parametrize(
    ("said", "code", "kind", "reason"),
    [
        (None, 3, "exited", "exited with code 3 without returning a value"),
        (None, -9, "signal", "was killed by signal SIGKILL (9): often the out-of-memory killer"),
        (None, -15, "signal", "was killed by signal SIGTERM (15)"),
        (None, EXIT_LIFELINE, "exited", "lost its lifeline to the kernel and exited"),
        (raised("SystemExit", "123"), 123, "exited", "called sys.exit(123)"),
        (raised("ImportError", "no jax", "start"), 1, "raised", "raised ImportError: no jax while starting"),
        (
            Unsendable("dict", "the value['lock'] (a _thread.lock)", "cannot pickle"),
            1,
            "unsendable",
            "returned a dict, which cannot be sent back to the kernel: the value['lock'] (a _thread.lock) "
            "cannot be pickled (cannot pickle)",
        ),
    ],
    ids=["exit code", "SIGKILL", "SIGTERM", "lifeline", "sys.exit", "while starting", "unsendable"],
)
def test_each_way_to_end_is_named(said, code, kind, reason):
    sequence = [*running(0), *([(0, said)] if said is not None else []), (0, Exit(code))]
    judge, _ = judged(1, sequence)
    assert judge.root.rank == 0 and judge.failure.kind == kind
    assert judge.failure.reason.startswith(reason), judge.failure.reason
    assert judge.ranks[0].info.exit_code == code and judge.ranks[0].info.seconds == len(sequence)


def test_a_finished_rank_is_done_whatever_its_exit():
    judge, recorder = judged(1, [*running(0), (0, Result(b"v" * 8)), (0, Exit(0))])
    assert judge.root is None and states(judge) == ["done"]
    assert recorder.events[-1] == (0, "done")


# -- a distributed launch: peers -----------------------------------------------------------------


def test_a_lost_peer_error_blames_the_peer_that_died_without_a_word():
    lost = raised("jaxlib.XlaRuntimeError", "UNAVAILABLE: Connection reset by peer")
    judge, _ = judged(2, [*running(0, 1), (0, lost), (0, Exit(1))], distributed=True, dead_peers=[(1, -9)])
    assert judge.root.rank == 1 and judge.failure.kind == "signal"
    assert states(judge) == ["aborted", "failed"]
    assert judge.ranks[0].info.reason.startswith("aborted after rank 1 died (it raised jaxlib.XlaRuntime")


def test_a_lost_peer_error_with_no_dead_peer_is_the_ranks_own():
    lost = raised("jaxlib.XlaRuntimeError", "UNAVAILABLE: Connection reset by peer")
    judge, _ = judged(2, [*running(0, 1), (0, lost), (0, Exit(1))], distributed=True)
    assert judge.root.rank == 0 and states(judge) == ["failed", "running"]


def test_outside_a_distributed_launch_a_lost_connection_is_the_ranks_own():
    lost = raised("ConnectionError", "Connection reset by peer")
    judge, _ = judged(2, [*running(0, 1), (0, lost), (0, Exit(1))], dead_peers=[(1, -9)])
    assert judge.root.rank == 0 and not judge.ranks[1].exited


def test_a_rank_jax_aborted_blames_the_peer_jax_names_with_its_stack():
    judge, recorder = judged(
        2,
        [
            *running(0, 1),
            (0, Beat(3, 0.0, 0.1)),
            (0, Line("err", "F0000 JAX distributed service detected fatal errors. Shutting down.")),
            (0, Line("err", "tasks are unhealthy (stopped sending heartbeats): 1")),
            (0, Exit(-signal.SIGABRT)),
        ],
        distributed=True,
    )
    assert judge.root.rank == 1 and judge.failure.kind == "stalled"
    assert judge.failure.stacks == {1: "stack of rank 1"} and recorder.asked == [[1]]
    assert states(judge) == ["aborted", "failed"]
    assert judge.ranks[0].info.reason.startswith("aborted after rank 1 died (it was killed by signal SIGABRT")
    assert "stopped answering jax.distributed's heartbeats" in judge.head()


def test_a_collective_that_timed_out_shows_the_live_ranks_stacks():
    timed_out = raised("jaxlib.XlaRuntimeError", "Gloo all-reduce failed: Timed out waiting for peers")
    judge, recorder = judged(2, [*running(0, 1), (0, timed_out), (0, Exit(1))], distributed=True)
    failure = judge.ending()
    assert judge.root.rank == 0 and failure.kind == "raised"
    assert "a collective timed out (300 s), timeouts['collectives']" in failure.reason
    assert failure.stacks == {1: "stack of rank 1"} and recorder.asked == [[1]]


# -- stalls ---------------------------------------------------------------------------------------


def test_of_several_silent_ranks_the_one_with_fewest_steps_is_the_root():
    judge, recorder = judged(3, [*running(0, 1, 2), (0, Beat(5, 0.0, 0.1)), (1, Beat(3, 0.0, 0.1))])
    assert judge.stalled([Silence(0, 12.0, 10.0), Silence(1, 11.0, 10.0)], warn=False) is None
    assert judge.root.rank == 1 and judge.failure.kind == "stalled"
    assert judge.failure.reason == (
        "stalled: no heartbeat for 11.0 s (limit 10.0 s; last completed step 3)\n(also silent: rank 0)"
    )
    assert judge.failure.stacks == {0: "stack of rank 0", 1: "stack of rank 1", 2: "stack of rank 2"}
    assert states(judge) == ["stalled", "stalled", "running"]
    assert recorder.events[-2:] == [(0, "stalled"), (1, "stalled")]
    judge.exited(0, -9, 30.0)  # a stalled rank that is not the root keeps its state when stopped
    assert states(judge) == ["stalled", "stalled", "running"]


def test_a_stall_only_warned_of_ends_with_the_next_heartbeat():
    judge, _ = judged(2, [*running(0, 1), (0, Beat(2, 0.0, 0.1))])
    report = judge.stalled([Silence(0, 12.0, 10.0)], warn=True)
    assert judge.root is None and states(judge) == ["stalled", "running"]
    assert report.splitlines()[0] == (
        "mg.launch: rank 0 (pid 100) stalled: no heartbeat for 12.0 s (limit 10.0 s; last completed step 2)"
    )
    assert "last completed steps: rank 0: step 2, rank 1: no step" in report
    assert "Python stacks of rank 1:\nstack of rank 1" in report
    judge.hear(0, Beat(3, 0.0, 0.1), 40.0)
    assert states(judge) == ["running", "running"] and not judge.ranks[0].stalled


# -- the launch's timeout ---------------------------------------------------------------------------


def test_every_rank_stopped_at_the_timeout_is_reported_with_what_it_was_doing():
    judge, recorder = judged(
        3,
        [
            *running(0, 1),
            (2, Started()),
            (0, Beat(5, 0.0, 0.1)),
            (1, Beat(2, 0.0, 0.1)),
            (None, Timeout(3)),  # at 8 s: rank 0 beat 2 s ago, rank 2 is still importing JAX
            (2, Ready(("cpu2",), 0.5)),  # said just before its SIGTERM, heard after it
            (1, Beat(3, 0.0, 0.1)),
            (0, Exit(-signal.SIGTERM)),
            (1, raised("RuntimeError", "Connection reset by peer")),  # rank 0, the coordinator, is gone
            (1, Exit(1)),
            (2, Exit(-signal.SIGTERM)),
        ],
        distributed=True,
    )
    failure = judge.ending()
    assert judge.root is None and failure.kind == "timeout"
    assert states(judge) == ["terminated", "terminated", "terminated"]
    assert [r.info.reason for r in judge.ranks] == [
        "stopped at timeout=3 s while running, last completed step 5 (2.0 s ago)",
        "stopped at timeout=3 s while running, last completed step 2 (1.0 s ago)",
        "stopped at timeout=3 s while still starting JAX, 8.0 s after it was started",
    ]
    assert (
        judge.head()
        == failure.reason
        == (
            "mg.launch ran past timeout=3 s and stopped rank(s) 0, 1, 2 (3 of 3; none had finished). "
            "Each is listed below with what it was doing, its last step and its stack: "
            "raise timeout=, or find the slow rank there."
        )
    )
    assert recorder.asked == [[0, 1, 2]] and failure.stacks == {r: f"stack of rank {r}" for r in range(3)}
    assert recorder.events == [(0, "ready"), (1, "ready"), (2, "ready")]  # no rank failed
    text = str(launch_error(judge.head(), failure, [r.info for r in judge.ranks], None, [None] * 3))
    assert "  rank 1 (pid 101, cpu1): stopped at timeout=3 s while running, last completed step 2" in text
    assert "last completed steps: rank 0: step 5, rank 1: step 3, rank 2: no step" in text
    assert "Python stacks of rank 2:\nstack of rank 2" in text


def test_a_rank_that_finished_before_the_timeout_keeps_its_value():
    judge, recorder = judged(
        2,
        [
            *running(0, 1),
            (0, Result(b"value")),
            (0, Exit(0)),
            (None, Timeout(2.5)),
            (1, Exit(-signal.SIGKILL)),  # it ignored SIGTERM: SIGKILL after the grace
        ],
    )
    failure = judge.ending()
    assert states(judge) == ["done", "terminated"] and recorder.asked == [[1]]
    assert failure.reason.startswith(
        "mg.launch ran past timeout=2.5 s and stopped rank(s) 1 (1 of 2; rank(s) 0 finished)"
    )
    assert judge.ranks[1].info.reason.startswith(
        "stopped at timeout=2.5 s while running, no step completed yet"
    )


def test_a_stall_only_warned_of_is_stopped_at_the_timeout_as_stalled():
    judge, _ = judged(2, [*running(0, 1), (0, Beat(4, 0.0, 0.1))])
    judge.stalled([Silence(0, 12.0, 10.0)], warn=True)
    judge.timed_out(60, 20.0)
    judge.hear(0, Beat(5, 0.0, 0.1), 20.5)  # a heartbeat during the grace changes nothing
    judge.exited(0, -signal.SIGTERM, 21.0)
    assert states(judge) == ["terminated", "terminated"] and judge.root is None
    assert judge.ranks[0].info.reason.startswith(
        "stopped at timeout=60 s while stalled, last completed step 4"
    )


def test_a_rank_stopped_after_the_root_failed_stays_stopped_whatever_it_says_last():
    judge, _ = judged(
        2, [(0, Started()), (1, Started()), (0, raised("ValueError", "x", "start")), (0, Exit(1))]
    )
    judge.terminating(1, "terminated after rank 0 failed")
    judge.hear(1, Ready(("cpu1",), 0.5), 9.0)  # ready just as it was stopped
    judge.exited(1, -signal.SIGTERM, 10.0)
    assert states(judge) == ["failed", "terminated"]
    assert judge.ranks[1].info.reason == "terminated after rank 0 failed"
