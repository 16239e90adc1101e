"""The ledger: events, totals, ring buffer, subscribers, threads, timing off the caller's path."""

import collections
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mgkit as mg
from mgkit._ledger import Event, Layout, Ledger, events_of, link_shares


def _event(i=0, src="dev0", dst="dev1", nbytes=100, seconds=0.5, kind="transfer"):
    return Event(kind, src, dst, "cpu0", "cpu1", nbytes, time.time(), seconds, label=i)


def test_summary_matrix_and_gbps():
    led = Ledger()
    led.record(_event(nbytes=2_000_000_000, seconds=1.0))
    led.record(_event(nbytes=1_000_000_000, seconds=1.0))
    led.record(_event(src="host", dst="dev0", nbytes=10, seconds=0.0, kind="put"))
    rows = led.summary().rows()
    assert rows == [("transfer", "dev0", "dev1", 2, 3_000_000_000, 2.0), ("put", "host", "dev0", 1, 10, 0.0)]
    text = repr(led.summary())
    assert "mgkit ledger: 3 event(s)" in text and "1.50" in text and "n/a" in text
    assert "<td>dev0</td>" in led.summary()._repr_html_()
    m = led.matrix()
    assert m["dev0", "dev1"] == 3_000_000_000 and m["host", "dev0"] == 10 and m["dev1", "dev0"] == 0
    assert m.names[:8] == [f"dev{i}" for i in range(8)] and "host" in m.names
    assert "bytes moved" in repr(m) and "<table" in m._repr_html_()
    assert _event(nbytes=3e9, seconds=1.5).gbps == pytest.approx(2.0)


def test_ring_buffer_is_bounded_but_totals_count_everything():
    led = Ledger(capacity=5)
    for i in range(12):
        led.record(_event(i))
    assert len(led) == 5 and [e.label for e in led.records()] == [7, 8, 9, 10, 11]
    assert led.dropped == 7
    assert led.summary().rows()[0][3] == 12
    led.set_capacity(2)
    assert [e.label for e in led.records()] == [10, 11] and led.capacity == 2
    led.clear()
    assert led.records() == [] and led.summary().rows() == [] and led.dropped == 0


def _layout(n=3, nbytes=100):
    heads = [("split", "host", f"dev{i}", "host", f"cpu{i}", nbytes * (i + 1)) for i in range(n)]
    heads.append(("replicate", "host", "dev0", "host", "cpu0", 50))
    shares = link_shares([(h[1], h[2], h[5]) for h in heads])
    return Layout([(h, s, {"i": k}) for k, (h, s) in enumerate(zip(heads, shares, strict=True))])


def test_a_layout_recorded_per_call_reads_like_its_events():
    # One entry per call; its events made when read, each with its share of the seconds.
    lay, plain = _layout(), Ledger()
    led = Ledger()
    seen = []
    led.subscribe(seen.append)
    for call in range(3):
        led.record(lay.call(100.0 + call, 2.0, call))
        plain.record(lay.events(100.0 + call, 2.0, call))
    got = led.records()
    assert got == plain.records() and seen == got and len(led) == 12
    first = got[:4]
    assert [e.kind for e in first] == ["split", "split", "split", "replicate"]
    assert first[0].seconds == pytest.approx(2.0 * 100 / 150)
    assert first[3].seconds == pytest.approx(2.0 * 50 / 150)
    assert first[1].seconds == first[2].seconds == 2.0 and first[0].info == {"i": 0}
    assert {e.label for e in got} == {0, 1, 2} and [e.start for e in got[4:8]] == [101.0] * 4
    assert led.summary().rows() == plain.summary().rows()
    assert led.totals() == plain.totals()
    assert led.matrix()["host", "dev0"] == plain.matrix()["host", "dev0"] == 3 * 150
    led.record(_event(7))  # single events and layouts mix, in order
    assert led.records()[-1].label == 7 and len(led) == 13


def test_the_ring_buffer_drops_the_oldest_events_of_a_layout_entry_one_by_one():
    led = Ledger(capacity=6)
    lay = _layout()  # 4 events per call
    for call in range(3):
        led.record(lay.call(float(call), 1.0, call))
    kept = led.records()
    assert len(led) == 6 and led.dropped == 6
    assert [e.label for e in kept] == [1, 1, 2, 2, 2, 2]
    assert [e.kind for e in kept[:2]] == ["split", "replicate"]
    assert sum(r[3] for r in led.summary().rows()) == 12  # totals count everything: 3 calls x 4
    led.set_capacity(1)
    assert [(e.label, e.kind) for e in led.records()] == [(2, "replicate")] and led.dropped == 11
    led.clear()
    assert len(led) == 0 and led.records() == [] and led.totals() == {}


@jax.jit
def _slow(x):
    return jax.lax.fori_loop(0, 60, lambda i, a: jnp.tanh(a @ a), x)


def _running() -> tuple[jax.Array, float]:
    """A program dispatched and still running (compiled beforehand), and when it was issued."""
    x = jnp.ones((512, 512)) / 512
    _slow(x).block_until_ready()
    t0 = time.perf_counter()
    return _slow(x), t0


def test_a_layout_in_flight_is_timed_by_the_watcher():
    led = Ledger()
    y, t0 = _running()
    led.record_when_ready(_layout(2).call(time.time(), 0.0, None), [y], t0)
    y.block_until_ready()
    finished = time.perf_counter() - t0
    assert led.flush(timeout=30)
    split0, split1, rep0 = (e.seconds for e in led.records())
    assert split1 >= finished * 0.5 and split0 + rep0 == pytest.approx(split1)
    assert led.totals()[("split", "host", "dev1")][0] == 1


@pytest.mark.parametrize("bad", [0, -3, 2.5, "10", True])
def test_bad_capacity(bad):
    kind = ValueError if isinstance(bad, int) and not isinstance(bad, bool) else TypeError
    with pytest.raises(kind) as info:
        Ledger(capacity=bad)
    text = str(info.value)
    assert text.startswith("Ledger: capacity") and repr(bad) in text
    assert "capacity must be a whole number at least 1" in text and "capacity=10000" in text


def test_records_filter_by_kind():
    mg.put(np.ones(2), "dev1")
    mg.transfer(mg.put(np.ones(2), "dev2"), "dev3")
    assert [e.kind for e in mg.ledger().records("transfer")] == ["transfer"]
    assert len(mg.ledger().records("put")) == 2


def test_an_attached_buffer_gets_one_entry_per_call_and_reads_as_the_events():
    led, buffer = Ledger(), collections.deque(maxlen=100)
    detach = led.attach(buffer)
    led.record(_layout().call(1.0, 2.0, 5))  # 4 events, one entry
    led.record(_event(6))
    assert len(buffer) == 2 and events_of(buffer) == led.records()
    detach()
    led.record(_event(7))
    assert len(buffer) == 2 and len(led) == 6
    detach()  # twice is harmless


def test_subscribers_see_every_event_and_can_unsubscribe():
    seen = []
    unsubscribe = mg.ledger().subscribe(seen.append)
    mg.put(np.ones(3), "dev1")
    mg.transfer(np.ones(3), "dev2")
    mg.ledger().flush()
    unsubscribe()
    mg.put(np.ones(3), "dev1")
    mg.ledger().flush()
    assert [(e.kind, e.dst) for e in seen] == [("put", "dev1"), ("transfer", "dev2")]
    unsubscribe()  # twice is harmless


def test_a_raising_subscriber_is_logged_and_the_ledger_keeps_working(caplog):
    def broken(event):
        raise RuntimeError("widget fell over")

    unsubscribe = mg.ledger().subscribe(broken)
    try:
        with caplog.at_level(logging.ERROR, logger="mgkit"):
            mg.put(np.ones(3), "dev1")
            mg.put(np.ones(3), "dev2")
            assert len(mg.ledger().records()) == 2
        assert "subscriber" in caplog.text and "widget fell over" in caplog.text
    finally:
        unsubscribe()


def test_a_raising_subscriber_is_logged_once_then_counted(caplog):
    led = mg.Ledger()
    calls = []

    def broken(event):
        calls.append(event)
        raise RuntimeError(f"view broke on event {len(calls)}")

    unsubscribe = led.subscribe(broken)
    event = Event("put", "host", "dev0", "host", "cpu0", 8, 0.0, 1e-6)
    with caplog.at_level(logging.DEBUG, logger="mgkit"):
        for _ in range(300):
            led.record(event)
        assert len(led) == 300 and len(calls) == 300  # every event recorded, the subscriber kept
        unsubscribe()
        led.record(event)  # no longer called
    records = [r for r in caplog.records if r.name == "mgkit"]
    first, *notes, total = records
    assert first.levelno == logging.ERROR and first.exc_info is not None  # one traceback, the first
    assert "view broke on event 1" in caplog.text and "counted, not logged one by one" in first.getMessage()
    assert [r.exc_info for r in [*notes, total]] == [None] * (len(records) - 1)
    assert [r.getMessage().split(" has raised ")[1] for r in notes] == [
        "10 times (last: RuntimeError: view broke on event 10)",
        "100 times (last: RuntimeError: view broke on event 100)",
    ]
    assert "was unsubscribed after raising 300 times in all" in total.getMessage()
    assert len(calls) == 300


def test_subscribe_needs_a_callable():
    with pytest.raises(TypeError, match="subscribe\\(\\) takes a callable taking one Event, got 3"):
        mg.ledger().subscribe(3)  # type: ignore[arg-type]


def test_a_subscriber_may_read_the_ledger_without_deadlock():
    sizes = []
    unsubscribe = mg.ledger().subscribe(lambda e: sizes.append(len(mg.ledger().summary())))
    try:
        mg.put(np.ones(3), "dev1")
        mg.ledger().flush(timeout=10)
    finally:
        unsubscribe()
    assert sizes == [1]


def test_copy_time_is_measured_off_the_callers_path():
    led = Ledger()
    y, t0 = _running()
    led.record_when_ready(_event(seconds=0.0), [y], t0)
    returned = time.perf_counter() - t0
    y.block_until_ready()
    finished = time.perf_counter() - t0
    assert led.flush(timeout=30)
    (event,) = led.records()
    assert returned < finished / 2
    assert event.seconds >= finished * 0.5


@pytest.mark.parametrize("running", [False, True])
def test_events_between_one_pair_of_contexts_share_their_placement_s_seconds(running):
    # One placement moved a split and a replicate to dev0 and a split to dev1, together: the
    # host -> dev0 link's seconds are counted once, shared by bytes; dev1's are its own.
    led = Ledger()
    x = jnp.ones((256, 256))
    y = jax.jit(lambda a: jax.lax.fori_loop(0, 20, lambda i, b: jnp.tanh(b @ b), a))(x) if running else x
    t0 = time.perf_counter() - 0.2
    events = [
        _event(src="host", dst="dev0", nbytes=3000, kind="split"),
        _event(src="host", dst="dev0", nbytes=1000, kind="replicate"),
        _event(src="host", dst="dev1", nbytes=3000, kind="split"),
        _event(i=1, src="host", dst="dev2", nbytes=0, kind="replicate"),
        _event(i=2, src="host", dst="dev2", nbytes=0, kind="replicate"),
    ]
    led.record_when_ready(events, [y], t0)
    assert led.flush(timeout=30)
    split0, rep0, split1, none1, none2 = (e.seconds for e in led.records())
    assert split1 >= 0.2
    assert split0 == pytest.approx(3 * rep0) and split0 + rep0 == pytest.approx(split1)
    assert none1 == none2 == pytest.approx(split1 / 2)


def test_many_threads_recording_at_once():
    led = Ledger(capacity=100_000)

    def work(k):
        for i in range(2000):
            led.record(_event(i, src=f"t{k}"))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(led) == 16_000
    assert sorted(r[3] for r in led.summary().rows()) == [2000] * 8


def test_label_is_the_ipython_execution_count():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        shell.run_cell("import numpy as np, mgkit as mg", store_history=True)
        count = shell.execution_count
        result = shell.run_cell("x = mg.put(np.ones(4), 'dev1')", store_history=True)
        result.raise_error()
        mg.ledger().flush()
        assert [e.label for e in mg.ledger().records()] == [count]
    finally:
        InteractiveShell.clear_instance()


def test_a_layout_entry_carries_each_calls_own_facts():
    led, lay = Ledger(), _layout(2)  # 3 events
    facts = ({"loss": 1.0}, {"loss": 2.0}, {"loss": 3.0})
    led.record(lay.call(5.0, 1.0, None, facts))
    led.record(lay.call(6.0, 1.0, None))
    got = led.records()
    assert [e.info.get("loss") for e in got] == [1.0, 2.0, 3.0, None, None, None]
    assert got[0].info["i"] == 0 and lay.rows[0][2] == {"i": 0}  # the layout's own info is not changed


@pytest.mark.parametrize("entry", ["not an event", 42, ("transfer", "dev0")])
def test_record_names_what_it_takes(entry):
    led = Ledger()
    with pytest.raises(TypeError) as info:
        led.record(entry)
    assert str(info.value) == (
        f"Ledger.record: got a {type(entry).__name__} ({entry!r}); it takes an Event (Event.on(kind, ctx, "
        "start, seconds)), a list of Events, or a layout's call (layout.call(start, seconds, label))"
    )
    assert len(led) == 0 and led.totals() == {}  # nothing half-recorded
    led.record(_event())
    assert len(led.records()) == 1
