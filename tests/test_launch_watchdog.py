"""How mg.launch's watchdog learns a rank's stall limit and finds the silent ranks (no process)."""

import pytest

from mgkit.launching import RankInfo
from mgkit.launching._ranks import RankState
from mgkit.launching._watch import Silence, silences, stall_limit
from mgkit.launching._wire import Beat, Ready

NOW = 1000.0


def _rank(beats, slowest, first_step, silent, rank=0):
    r = RankState(RankInfo(rank, 100 + rank, ("cpu0",)), spawned=0.0)
    r.ready_at = NOW - silent - 1
    r.beats, r.slowest, r.first_step = beats, slowest, first_step
    r.last_beat = NOW - silent if beats else None
    return r


@pytest.mark.parametrize(
    ("beats", "slowest", "first_step", "silent", "stalled", "collectives"),
    [
        (0, 0.0, None, 500.0, False, None),  # before the first step (compiling): not judged
        (0, 0.0, None, 24.0, False, 20),  # ... unless distributed: the collectives' timeout + 5 s
        (0, 0.0, None, 26.0, True, 20),
        (5, 4.0, 30.0, 21.0, True, 300),  # the learned limit when it is lower
        (1, 0.0, 1.0, 9.0, False, None),  # floor: 10 s
        (1, 0.0, 1.0, 11.0, True, None),
        (1, 0.0, 30.0, 100.0, False, None),  # one step seen (with its compile): 5 x 30 s
        (5, 4.0, 30.0, 19.0, False, None),  # from the second step on: 5 x the slowest (4 s)
        (5, 4.0, 30.0, 21.0, True, None),
    ],
)
def test_the_learned_stall_limit(beats, slowest, first_step, silent, stalled, collectives):
    found = silences([_rank(beats, slowest, first_step, silent)], NOW, None, collectives)
    assert bool(found) == stalled
    if stalled:
        limit = stall_limit(_rank(beats, slowest, first_step, silent), None, collectives)
        assert [(s.rank, s.limit) for s in found] == [(0, limit)] and found[0].silent >= silent


def test_a_given_stall_after_is_the_limit_from_ready_on():
    assert stall_limit(_rank(0, 0.0, None, 0.0), 1.5, None) == 1.5
    assert stall_limit(_rank(0, 0.0, None, 0.0), 60.0, 20) == 25.0  # the collectives' ceiling is lower
    assert [s.rank for s in silences([_rank(0, 0.0, None, 2.0)], NOW, 1.5, None)] == [0]


def test_ranks_not_running_are_not_judged():
    starting = _rank(0, 0.0, None, 100.0)
    starting.ready_at = None
    ended = _rank(0, 0.0, None, 100.0, rank=1)
    ended.exited = True
    stalled = _rank(0, 0.0, None, 100.0, rank=2)
    stalled.stalled = True
    assert silences([starting, ended, stalled], NOW, 1.0, None) == []


def test_the_limit_is_learned_from_the_messages_heard():
    r = RankState(RankInfo(0, 100, ("cpu0",)), spawned=0.0)
    r.hear(Ready(("cpu0",), 1.0), 10.0)
    r.hear(Beat(1, 0.0, 0.0), 40.0)  # the first step: 30 s, with its compile
    assert stall_limit(r, None, None) == 150.0
    r.hear(Beat(2, 0.0, 4.0), 44.0)  # from the second on: the slowest the rank reports
    assert stall_limit(r, None, None) == 20.0
    assert silences([r], 44.0 + 20.5, None, None) == [Silence(0, 20.5, 20.0)]
