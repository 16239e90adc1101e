"""The launch view: per rank its devices, state, heartbeat age and last output lines, from the
running launch (``mg.launching.current``), the last one it watched, or the ledger; the
Dashboard's launch row; one real launch watched live."""

import time

import pytest

import mgkit as mg
from mgkit._ledger import Event, Ledger
from mgkit.launching import RankInfo, Running, _launch

NONE = "mgkit launch: none yet; mg.launch(fn, nprocs=...) shows its ranks here as they run"


def _rank(rank, state, devices=None, step=None, beat=None, tail=(), started=None, **more):
    now = time.time()
    info = RankInfo(
        rank,
        1000 + rank,
        devices or (f"cpu{rank}",),
        state=state,
        step=step,
        beat_at=None if beat is None else now - beat,
        started=now - 10.0 if started is None else started,
        **more,
    )
    info.tail.extend(tail)
    return info


class _Launch:
    """Stands for a running launch in the list ``mg.launching.current()`` reads."""

    def __init__(self, snapshot):
        self.snapshot = snapshot


@pytest.fixture
def running(monkeypatch):
    """Sets the launch that ``current()`` reports: running(ranks), or running(None) for none."""

    def set_ranks(ranks):
        value = [] if ranks is None else [_Launch(lambda: Running("mg.launch: test", tuple(ranks)))]
        monkeypatch.setattr(_launch, "_current", value)

    return set_ranks


def _four():
    return [
        _rank(0, "running", step=7, beat=1.5, tail=["loading", "step 6 loss 0.31", "step 7 loss 0.30"]),
        _rank(1, "starting", devices=("cpu1", "cpu2")),
        _rank(2, "running", beat=None, tail=["compiling\r10%\r55%"]),
        _rank(3, "stalled", step=4, beat=30.0, tail=["x" * 200]),
    ]


def _launch_event(rank, what, pid, start, seconds, state, devices=("cpu0",), label=None):
    info = {"event": what, "pid": pid, "devices": devices, "state": state}
    return Event("launch", "kernel", f"rank{rank}", "host", devices[0], 0, start, seconds, label, info)


# -- no launch ----------------------------------------------------------------------------------


def test_no_launch_says_so_in_text_and_html():
    view = mg.LaunchView(widget=False)
    assert view.widget is None and not view.active and view.rows() == []
    assert repr(view) == NONE
    bundle = view._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"} and NONE in bundle["text/html"]
    assert "LaunchView" in mg.__all__ and "LaunchView" in dir(mg)


def test_a_launch_ending_between_two_reads_is_no_launch(monkeypatch):
    def ended():
        raise IndexError("pop from empty list")

    monkeypatch.setattr(_launch, "_current", [_Launch(ended)])
    assert repr(mg.LaunchView(widget=False)) == NONE


# -- a running launch ---------------------------------------------------------------------------


def test_running_ranks_show_devices_state_heartbeat_age_and_output(running):
    ranks = _four()
    running(ranks)
    view = mg.LaunchView(widget=False)
    rows = view.rows()
    assert [r.rank for r in rows] == [0, 1, 2, 3] and [r.pid for r in rows] == [1000, 1001, 1002, 1003]
    assert [r.devices for r in rows] == ["cpu0", "cpu1,cpu2", "cpu2", "cpu3"]
    assert [r.status for r in rows] == ["running step 7", "starting", "ready", "stalled after step 4"]
    assert float(rows[0].beat.removesuffix(" s")) == pytest.approx(1.5, abs=1.0)
    assert rows[1].beat == rows[2].beat == ""  # no heartbeat yet
    assert rows[0].output == ("step 6 loss 0.31", "step 7 loss 0.30")  # the last 2 lines
    assert rows[2].output == ("55%",)  # a line redrawn with carriage returns: its last state
    assert rows[3].output == ("x" * 69 + "...",)  # cut to 72 characters
    text = repr(view)
    assert text.startswith("mgkit launch: 4 rank(s) running for 10.")
    assert ": 2 running, 1 starting, 1 stalled" in text.splitlines()[0]
    assert "cpu1,cpu2" in text and "running step 7" in text and "step 6 loss 0.31 | step 7 loss 0.30" in text
    assert mg.LaunchView(lines=0, widget=False).rows()[0].output == ()
    assert mg.LaunchView(lines=3, widget=False).rows()[0].output[0] == "loading"


def test_the_view_follows_the_ranks_and_keeps_the_launch_it_watched(running):
    ranks = _four()
    running(ranks)
    view = mg.LaunchView(widget=False)
    assert view.rows()[1].status == "starting"
    ranks[1].state = "running"
    ranks[1].step = 2
    ranks[1].beat_at = time.time()
    ranks[1].tail.append("step 2")
    assert view.refresh() is True
    assert view.rows()[1][4:] == ("running step 2", "0.0 s", ("step 2",))
    # the launch ends: the ranks' final states, heartbeat ages frozen at each rank's exit
    for info, state in zip(ranks, ["done", "failed", "aborted", "terminated"], strict=True):
        info.state, info.seconds = state, 10.0
    ranks[1].tail.append("ValueError: <boom>")
    running(None)
    rows = view.rows()
    assert [r.status for r in rows] == ["done", "failed", "aborted", "terminated"]
    assert rows[0].beat == "1.5 s" and rows[3].beat == "30.0 s"  # last beats 1.5 s and 30 s before exit
    text = repr(view)
    assert text.startswith("mgkit launch: last launch, 4 rank(s): 1 done, 1 failed, 1 aborted, 1 terminated")
    assert "ValueError: <boom>" in text
    assert view.refresh() is False  # a finished launch no longer changes
    assert "ValueError: &lt;boom&gt;" in view.html() and "color:#c62828" in view.html()


def test_widget_shows_the_table_and_updates_on_refresh(running):
    ranks = _four()
    running(ranks)
    view = mg.LaunchView(widget=True, live=False)
    box = view.widget
    assert "mgkit-launch" in box._dom_classes
    html = box.children[0].value
    assert "<table" in html and "running step 7" in html and "cpu1,cpu2" in html
    assert "step 6 loss 0.31<br>step 7 loss 0.30" in html and 'class="mgkit-rank-stalled"' in html
    bundle = view._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and "running step 7" in bundle["text/plain"]
    ranks[0].state, ranks[0].seconds = "done", 10.0
    running(None)
    view.refresh()
    assert "last launch" in box.children[0].value and "mgkit-rank-done" in box.children[0].value
    view.close()


def test_save_png_draws_the_table(running, tmp_path):
    running(_four())
    path = mg.LaunchView(widget=False).save_png(tmp_path / "launch.png", dpi=40)
    assert (tmp_path / "launch.png").read_bytes()[:4] == b"\x89PNG" and path.endswith("launch.png")


# -- the ledger ---------------------------------------------------------------------------------


def test_a_view_made_after_a_launch_reads_its_ranks_from_the_ledger():
    led = Ledger()
    t = time.time() - 100.0
    # an earlier launch of 3 ranks, then one of 2 (rank 2 of the earlier must not show)
    led.record(_launch_event(0, "ready", 10, t, 2.0, "running"))
    led.record(_launch_event(1, "ready", 11, t, 2.1, "running"))
    led.record(_launch_event(2, "done", 12, t, 3.0, "done"))
    led.record(_launch_event(0, "done", 10, t, 3.0, "done"))
    led.record(_launch_event(1, "done", 11, t, 3.1, "done"))
    t += 10.0
    led.record(_launch_event(0, "ready", 20, t, 2.0, "running", devices=("cpu0", "cpu1"), label=7))
    led.record(_launch_event(1, "ready", 21, t + 0.01, 2.0, "running", devices=("cpu2", "cpu3"), label=7))
    led.record(_launch_event(1, "failed", 21, t + 0.01, 4.0, "running", devices=("cpu2", "cpu3"), label=7))
    view = mg.LaunchView(ledger=led, widget=False)
    rows = view.rows()
    assert [(r.rank, r.pid, r.devices, r.status) for r in rows] == [
        (0, 20, "cpu0,cpu1", "terminated"),  # ready, then stopped with the others: no exit recorded
        (1, 21, "cpu2,cpu3", "failed"),
    ]
    assert all(r.beat == "" and r.output == () for r in rows)
    text = repr(view)
    assert text.startswith(
        "mgkit launch: last launch (In [7]), 2 rank(s): 1 terminated, 1 failed (from the ledger"
    )
    led.record(_launch_event(0, "done", 30, t + 20.0, 1.0, "done"))  # a third launch, of one rank
    assert [(r.rank, r.pid, r.status) for r in view.rows()] == [(0, 30, "done")]
    led.clear()
    assert repr(view) == NONE


# -- the dashboard ------------------------------------------------------------------------------


def test_dashboard_shows_a_launch_row_only_once_there_is_a_launch(running):
    running(None)
    dash = mg.Dashboard(widget=True, live=False)
    assert len(dash.widget.children) == 5 and "mgkit launch" not in repr(dash)
    assert "mgkit launch" not in dash._repr_mimebundle_()["text/plain"]
    ranks = _four()
    running(ranks)
    dash.refresh()
    assert [c._dom_classes[-1] for c in dash.widget.children][-2:] == ["mgkit-throughput", "mgkit-launch"]
    assert "running step 7" in dash.widget.children[-1].children[0].value
    assert "mgkit launch: 4 rank(s) running" in repr(dash) and "running step 7" in dash.html()
    running(None)
    dash.refresh()
    assert len(dash.widget.children) == 6 and "mgkit launch: last launch" in repr(dash)
    dash.close()
    assert dash.launches.closed
    text = mg.Dashboard(widget=False)
    assert "mgkit launch" not in repr(text)


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lines": -1}, ValueError, r"lines=-1 is out of range.*0 to 20"),
        ({"lines": 2.5}, TypeError, r"lines must be a whole number.*float 2\.5"),
        ({"rate": 0}, ValueError, r"rate=0 is out of range"),
        ({"widget": "yes"}, TypeError, r"widget must be True.*'yes'"),
        ({"ledger": "x"}, TypeError, r"ledger must be an mg\.Ledger"),
    ],
)
def test_bad_arguments_are_named_with_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        mg.LaunchView(**kwargs)


# -- a real launch ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_real_launch_is_shown_live_and_afterwards():
    def work(rank, shared, private):
        import time

        import mgkit as mg

        print(f"hi from rank {rank}", flush=True)
        for step in range(1, 9):
            time.sleep(0.15)
            mg.beat(step)
        print(f"bye from rank {rank}", flush=True)
        return rank

    view = mg.LaunchView(lines=5, rate=10, widget=True, live=True)  # refreshed by the live thread
    shown = []
    view.widget.children[0].observe(lambda change: shown.append(change["new"]), names="value")
    res = mg.launch(work, nprocs=2, stream=False)
    assert res.values == [0, 1]
    assert any("running step" in html or "ready" in html for html in shown), shown  # seen while running
    rows = view.rows()
    assert [(r.rank, r.status) for r in rows] == [(0, "done"), (1, "done")]
    assert [r.pid for r in rows] == [r.pid for r in res.ranks]
    assert all({f"hi from rank {r.rank}", f"bye from rank {r.rank}"} <= set(r.output) for r in rows)
    assert all(r.beat for r in rows)
    assert "bye from rank 1" in view.widget.children[0].value
    view.close()
    fresh = mg.LaunchView(widget=False)  # made after the launch: from the ledger
    assert [(r.rank, r.pid, r.status) for r in fresh.rows()] == [
        (0, res.ranks[0].pid, "done"),
        (1, res.ranks[1].pid, "done"),
    ]
    assert "2 rank(s): 2 done" in repr(fresh)
