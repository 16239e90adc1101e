"""A launch's ranks in the ledger: the ``launch`` events are made and read back in one module."""

import pytest

import mgkit as mg
from mgkit.launching import RankEvent, RankInfo, rank_event
from mgkit.launching._events import launch_event


def _event(dst="rank3", info=None, kind="launch"):
    info = {"event": "done", "pid": 4242, "devices": ("cpu3",), "state": "done"} if info is None else info
    return mg.Event(kind, "kernel", dst, "host", "cpu3", 0, 10.0, 2.5, 7, info)


def test_an_event_made_for_a_rank_reads_back_as_that_rank():
    info = RankInfo(3, 4242, ("cpu3", "cpu4"), state="done")
    e = launch_event(info, "done", 64, 1.5, 7, 2)
    assert (e.kind, e.src, e.dst, e.src_device, e.dst_device) == ("launch", "kernel", "rank3", "host", "cpu3")
    assert e.nbytes == 64
    assert e.seconds == 1.5 and e.label == 7
    got = rank_event(e)
    assert got == RankEvent(3, 4242, "done", "done", ("cpu3", "cpu4"), 2, e.start, 1.5, 7)
    assert got.end == pytest.approx(e.start + 1.5)


def test_a_rank_with_no_devices_yet_is_on_the_host():
    e = launch_event(RankInfo(0, 1, ()), "failed", 0, 0.1, None, 1)
    assert e.dst_device == "host" and rank_event(e).devices == ()


def test_events_recorded_without_a_launch_number_still_read():
    got = rank_event(_event())
    assert got[:6] == (3, 4242, "done", "done", ("cpu3",), None)
    assert (got.start, got.seconds, got.label) == (10.0, 2.5, 7)


@pytest.mark.parametrize(
    ("devices", "names"),
    [(["cpu0", "cpu1"], ("cpu0", "cpu1")), ("cpu0,cpu1", ("cpu0,cpu1",)), (None, ()), ((), ())],
)
def test_devices_read_as_names(devices, names):
    got = rank_event(_event(info={"event": "ready", "pid": "7", "devices": devices}))
    assert got.devices == names and got.pid == 7 and got.state == ""


@pytest.mark.parametrize(
    "event",
    [
        _event(kind="put"),
        _event(dst="dev0"),
        _event(info={"event": "done"}),
        _event(info={"pid": 1}),
        _event(info={"event": "done", "pid": "x"}),
        mg.Event("launch", "kernel", "rank0", "host", "cpu0", 0, 0.0, 0.0),
    ],
    ids=["another kind", "not a rank", "no pid", "no event", "pid not a number", "no info"],
)
def test_what_is_not_a_rank_event_reads_as_none(event):
    assert rank_event(event) is None
