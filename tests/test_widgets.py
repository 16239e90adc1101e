"""Live views: device map, transfers, throughput, dashboard; text and PNG outside notebooks;
the live thread's rate limit, bounded buffers, close, missing ipywidgets, bad input."""

import gc
import logging
import struct
import sys
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python

import mgkit as mg
from mgkit._ledger import Event, Ledger
from mgkit.views import _base, _devicemap, _live, _svg

NAMES = [f"dev{i}" for i in range(8)]


def _move(src, dst, nbytes, seconds=0.001, kind="transfer", label=None):
    return Event(kind, src, dst, "cpu0", "cpu1", nbytes, time.time(), seconds, label)


def _step(ctx, sps, seconds=0.01, iteration=1):
    info = {"what": "fit", "iteration": iteration, "of": 10, "models": 1, "loss": 0.5, "grad": 0.1}
    info |= {"samples_per_second": sps, "final": False}
    return Event("step", ctx, ctx, "cpu0", "cpu0", 0, time.time(), seconds, None, info)


def _run(ctx, rows, seconds):
    info = {"fn": "f", "of": rows * 8, "path": "spmd", "rows": rows}
    return Event("run", ctx, ctx, "cpu0", "cpu0", 0, time.time(), seconds, None, info)


def _watching(led):
    return len(led._subscribers) + len(led._feeds)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# -- importing ---------------------------------------------------------------------------------


def test_import_mgkit_loads_no_widget_library_and_text_views_need_none():
    r = run_python(
        """
        import sys
        import mgkit as mg
        assert 'ipywidgets' not in sys.modules and 'matplotlib' not in sys.modules
        print(mg.Dashboard(widget=False))
        assert 'ipywidgets' not in sys.modules and 'matplotlib' not in sys.modules
        print("facts", mg.Dashboard(widget=False).header.facts()["simulated"])
        """
    )
    assert r.returncode == 0, r.stderr
    assert "simulated: no" in r.stdout and "facts False" in r.stdout
    assert "mgkit device map: 1 context(s), current (*) dev0" in r.stdout


def test_header_says_xla_flag_devices_are_simulated():
    r = run_python(
        "import mgkit as mg; print(mg.Dashboard(widget=False).header.text())",
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 0, r.stderr
    assert "devices: 4 CPU | simulated: yes (4 simulated CPU devices)" in r.stdout


# -- device map --------------------------------------------------------------------------------


def test_device_map_lists_contexts_devices_and_the_current_one():
    view = mg.DeviceMap(widget=True, live=False)
    assert [r[:4] for r in view.rows()] == [(n, f"cpu{i}", "cpu", "cpu") for i, n in enumerate(NAMES)]
    default = mg.current()  # dev0 on a CPU-only machine; None where JAX's default device is a GPU
    assert [r[0] for r in view.rows() if r[6]] == ([default] if default else [])
    html = view.widget.children[0].value
    assert all(f">{n}<" in html or f" {n}<" in html for n in NAMES) and "(live arrays)</td>" in html
    assert "else the bytes held by live jax arrays on it" in html  # says where the figures come from
    assert "mgkit-devicemap" in view.widget._dom_classes
    before = view.updates
    with mg.on("dev3"):
        assert view.refresh() is True
        assert [r[0] for r in view.rows() if r[6]] == ["dev3"]
        assert 'class="mgkit-current"' in view.widget.children[0].value
        assert view.refresh() is False  # nothing changed: nothing is sent
    assert view.updates == before + 1
    with mg.on("dev0"):
        text = repr(view)
    assert "current (*) dev0" in text and "* dev0" in text and "cpu7" in text
    view.close()


def test_device_map_memory_bar_where_the_device_reports_it(monkeypatch):
    def memory(device):
        return (1 << 30, 4 << 30) if device.id == 1 else (None, None)

    monkeypatch.setattr(mg._devices, "memory", memory)
    monkeypatch.setattr(mg._devices, "live_array_bytes", lambda: {jax.devices("cpu")[0]: 3 << 20})
    view = mg.DeviceMap(contexts=["dev0", "dev1"], widget=True, live=False)
    assert [(r[4], r[5], r[7]) for r in view.rows()] == [
        (3 << 20, None, "live arrays"),
        (1 << 30, 4 << 30, "allocator"),
    ]
    assert "width:25.0%" in view.widget.children[0].value and "width:100.0%" in view.widget.children[0].value
    assert "1.0 GiB / 4.0 GiB (25%)" in repr(view) and "3.0 MiB (live arrays)" in repr(view)
    view.close()


def test_device_map_shows_live_array_bytes_on_cpu_and_reads_them_at_most_once_a_second():
    view = mg.DeviceMap(contexts=["dev6"], widget=True, live=False)
    before = view.rows()[0][4]
    x = mg.put(np.ones((512, 1024), np.float32), "dev6")  # 2 MiB
    assert view.rows()[0][4:6] == (before + 2 * 2**20, None)  # refresh(): a fresh reading
    readings = _devicemap.LIVE_BYTES.readings
    del x
    for _ in range(5):  # the live thread's refreshes: one reading a second at most, shared
        view._refresh(budgeted=True)
    assert _devicemap.LIVE_BYTES.readings - readings <= 1
    assert "(live arrays)" in view.text() and "memory: the device's allocator statistics" in view.text()
    view.close()


def test_live_thread_shows_the_main_threads_context():
    mg.DeviceMap(widget=False)  # a view made on the main thread follows its `mg.on` scopes
    seen = []
    with mg.on("dev5"):
        t = threading.Thread(target=lambda: seen.append(_devicemap.shown_current()))
        t.start()
        t.join()
    assert seen == ["dev5"]


# -- transfers ---------------------------------------------------------------------------------


def test_transfer_view_rows_totals_and_heatmap_from_real_transfers():
    view = mg.TransferView(max_rows=3, widget=True, live=False)
    x = mg.put(np.ones(256, np.float32), "dev0")  # 1 KiB host -> dev0
    for dst in ("dev1", "dev2", "dev3"):
        x = mg.transfer(x, dst)
    mg.ledger().flush()
    assert view.pending == 4
    assert view.refresh() is True and view.pending == 0 and view.refresh() is False
    assert view.count == 4 and view.nbytes == 4096
    m = view.matrix()
    assert m.names == [*NAMES, "host"]
    assert m["host", "dev0"] == m["dev0", "dev1"] == m["dev1", "dev2"] == m["dev2", "dev3"] == 1024
    assert int(m.values.sum()) == 4096
    assert [(e.src, e.dst) for e in view.recent()] == [("dev2", "dev3"), ("dev1", "dev2"), ("dev0", "dev1")]
    box = view.widget
    assert "mgkit-transfers" in box._dom_classes
    label = box.children[0].children[1]
    assert label.value == "transfers: 4" and "mgkit-transfer-count" in label._dom_classes
    svg = box.children[1].children[1].value
    assert svg.startswith("<svg") and svg.count("<rect") == 1 + 4  # the grid, then one cell per pair
    assert "dev0 -&gt; dev1: 1.0 KiB" in svg and "bytes moved (4 transfers)" in svg
    assert view.redraws == 2  # the empty picture, then the data
    text = repr(view)
    assert text.startswith("mgkit transfers: 4 (4.0 KiB moved") and "bytes moved" in text
    view.close()


def test_transfer_view_filter_gbps_labels_and_ledger_clear():
    led = Ledger()
    led.record(_move("dev0", "dev1", 2_000_000_000, seconds=1.0, label=7))
    led.record(_move("dev2", "dev3", 10))
    led.record(_step("dev0", 100.0))  # work, not a transfer
    view = mg.TransferView(contexts=["dev1"], ledger=led, widget=False)
    assert view.count == 1 and view.nbytes == 2_000_000_000
    assert [(e.src, e.dst) for e in view.recent()] == [("dev0", "dev1")]
    assert view.matrix().names == ["dev1", "dev0"]
    text = repr(view)
    assert "In [7]" in text and "2.00" in text and "dev2" not in text
    led.clear()
    view.refresh()
    assert view.count == 0 and view.recent() == [] and not view.matrix().values.any()


def test_transfer_view_shows_moves_only_not_compute_or_process_events():
    led = Ledger()
    view = mg.TransferView(ledger=led, widget=False, live=False)
    now = time.time()
    led.record(
        [
            Event("transfer", "dev0", "dev1", "cpu0", "cpu1", 64, now, 0.1),
            Event("step", "dev0", "dev0", "cpu0", "cpu0", 0, now, 0.1),
            Event("launch", "kernel", "rank0", "host", "cpu0", 8, now, 0.1, None, {"event": "done"}),
            Event("stall", "kernel", "kernel", "host", "host", 0, now, 2.0),
        ]
    )
    assert [e.kind for e in view.recent()] == ["transfer"]
    assert (view.count, view.nbytes) == (1, 64)
    assert "kernel" not in view.matrix().names and "rank0" not in view.matrix().names


def test_transfer_view_lists_the_newest_transfers_by_start_time():
    led = Ledger()
    view = mg.TransferView(max_rows=2, ledger=led, widget=False)
    t = time.time()
    for start, dst in (
        (t + 2, "dev2"),
        (t, "dev0"),
        (t + 3, "dev3"),
        (t + 1, "dev1"),
    ):  # finished out of order
        led.record(_move("dev7", dst, 8)._replace(start=start))
    assert [e.dst for e in view.recent()] == ["dev3", "dev2"]
    led.record(_move("dev7", "dev4", 8)._replace(start=t + 2.5))
    assert [e.dst for e in view.recent()] == ["dev3", "dev4"] and view.count == 5


# -- throughput --------------------------------------------------------------------------------


def test_throughput_view_series_per_context_from_steps_and_runs():
    led = Ledger()
    view = mg.ThroughputView(history=3, ledger=led, widget=True, live=False)
    for sps in (100.0, 200.0, 300.0, 400.0):
        led.record(_step("dev0", sps, seconds=0.02))
    led.record(_run("dev1", rows=50, seconds=0.5))
    led.record(_run("dev1", rows=50, seconds=0.0))  # no time: no rate
    led.record(_move("dev0", "dev1", 8))  # a transfer: not followed here
    assert view.pending == 7  # every entry waits; the view picks its kinds when it drains them
    assert view.refresh() is True
    series = view.series()
    assert list(series) == ["dev0", "dev1"]
    t, rate, step = series["dev0"]
    assert rate.tolist() == [200.0, 300.0, 400.0] and step.tolist() == [0.02] * 3  # history=3
    assert np.all(np.diff(t) >= 0)
    assert series["dev1"][1].tolist() == [100.0]
    box = view.widget
    assert "mgkit-throughput" in box._dom_classes
    redraws = box.children[2]
    assert redraws.value == "redraws: 2" and "mgkit-redraws" in redraws._dom_classes
    svg = box.children[1].value
    assert svg.count("<polyline") == 4  # two contexts, samples/s and step time
    assert 'stroke="#1f77b4"' in svg and 'stroke="#ff7f0e"' in svg  # dev0, dev1: the map's colours
    led.record(_step("dev0", 500.0))
    view.refresh()
    assert view.redraws == 3 and redraws.value == "redraws: 3"
    assert view.refresh() is False and view.redraws == 3  # no new data: no redraw
    assert "dev0" in box.children[0].value and "400" in box.children[0].value
    view.close()


def test_a_live_refresh_under_a_heavy_stream_keeps_each_contexts_newest_steps():
    """A live refresh folds the newest few entries, shared between their sources: a batch of one
    rank's steps arriving just after another's (a cluster's streams) hides neither."""
    led = Ledger()
    view = mg.ThroughputView(ledger=led, widget=False, live=False)
    for ctx in ("r0/dev0", "r1/dev0"):  # each rank's batch, one after the other
        for i in range(3 * view.fold_limit):
            led.record(_step(ctx, 100.0 + i, iteration=i + 1))
    view._refresh(budgeted=True)  # what the views' thread does
    assert list(view.series()) == ["r0/dev0", "r1/dev0"]
    assert view.skipped == 2 * 3 * view.fold_limit - view.fold_limit  # the newest half of the limit each
    view.close()


def test_throughput_view_follows_parallel_calls_on_eight_contexts():
    view = mg.ThroughputView(widget=False)
    f = mg.parallel(lambda a: a * 2)
    for _ in range(2):
        f(jnp.ones((64, 4)))
    mg.ledger().flush()
    series = view.series()
    assert list(series) == NAMES and all(len(s[1]) == 2 and (s[1] > 0).all() for s in series.values())
    assert "8 context(s) reporting" in repr(view)


def test_throughput_view_leaves_compilation_out_of_a_calls_time():
    view = mg.ThroughputView(contexts=["dev0"], widget=False)
    led = mg.ledger()
    led.flush()
    led.clear()

    def add(a):
        return a + 1.0

    f = mg.parallel(add)
    x = jnp.ones((64, 4))
    t0 = time.time()
    f(x)  # compiles: tracing, lowering and compiling take most of this call
    f(x)  # the compiled program: no compilation
    led.flush()
    first, second = [e for e in led.records("run") if e.src == "dev0"]
    assert first.info["fn"] == "add" and first.start >= t0
    spans = _live.COMPILES.spans()
    compiled = sum(s for end, s in spans if first.start <= end <= first.start + first.seconds)
    assert 0 < compiled < first.seconds
    assert sum(s for end, s in spans if second.start <= end <= second.start + second.seconds) == 0
    _t, rate, step = view.series()["dev0"]
    assert step.tolist() == pytest.approx([first.seconds - compiled, second.seconds])
    assert rate.tolist() == pytest.approx([8 / (first.seconds - compiled), 8 / second.seconds])
    points = view._series["dev0"]
    assert list(points.compiled) == pytest.approx([compiled, 0.0])
    row = view.text().splitlines()[-1]
    assert f"{compiled:.2f} s" in row and "compile excluded" in view.text()
    view.close()


def test_throughput_step_time_is_per_iteration_and_lines_join_one_source():
    led = Ledger()
    view = mg.ThroughputView(ledger=led, widget=True, live=False)
    # a fit reports after 100 and 300 iterations (0.5 s and 1.0 s), then another fit after 50
    led.record(_step("dev0", 1e4, seconds=0.5, iteration=100))
    led.record(_step("dev0", 1e4, seconds=1.0, iteration=300))
    second = _step("dev0", 1e4, seconds=0.2, iteration=50)
    led.record(second._replace(info={**second.info, "what": "another fit"}))
    led.record(_run("dev0", rows=40, seconds=0.01))
    _t, _rate, step = view.series()["dev0"]
    assert step.tolist() == pytest.approx([0.005, 0.005, 0.004, 0.01])  # seconds per iteration, per call
    points = view._series["dev0"]
    assert list(points.source) == ["fit", "fit", "another fit", "f (spmd)"]
    led.record(_step("dev0", 1e4, seconds=0.5, iteration=400))  # the first fit again, after the others
    view.refresh()
    x, _ = _svg.by_source(*view.series()["dev0"][:2], list(points.source))
    assert np.isnan(x).tolist() == [False, False, False, True, False, True, False]  # fit, another, f
    svg = view.widget.children[1].value
    # one line per source and panel, each with a marker at every point (not one element per point)
    assert svg.count("<polyline") == 6 and svg.count("<marker ") == 1 and 'marker-mid="url(#m0)"' in svg
    assert "ms per step" in svg and "samples/s" in svg and "(log)" not in svg  # 1e4 .. 4e3: linear
    led.record(_run("dev0", rows=40_000, seconds=0.01))  # now 4e3 .. 4e6 samples/s: a log scale
    view.refresh()
    assert "samples/s (log)" in view.widget.children[1].value
    view.close()


def test_throughput_view_sums_events_that_come_faster_than_it_can_show():
    led = Ledger()
    # long ago (no compilation recorded then), a whole second and a bit: the burst ends in one tenth
    now = 1_600_000_000.02
    # 40 calls within one tenth of a second, then 30 steps of a fit, one a second
    burst = [_run("dev0", rows=10 + i, seconds=0.001)._replace(start=now + 0.0001 * i) for i in range(40)]
    steps = [
        _step("dev1", 1000.0 + i, seconds=1.0, iteration=10 * (i + 1))._replace(start=now + i)
        for i in range(30)
    ]
    led.record(burst + steps)
    view = mg.ThroughputView(ledger=led, widget=False, live=False)  # read from the ledger at once
    series = view.series()
    _, rate, step = series["dev0"]
    rows = sum(10 + i for i in range(40))
    assert rate.tolist() == pytest.approx([rows / 0.04]) and step.tolist() == pytest.approx([0.001])
    _, rate, step = series["dev1"]
    assert len(rate) == 30 and rate[-1] == 1029.0  # a second apart: every step is its own point
    assert step.tolist() == pytest.approx([0.1] * 30)  # 1 s over 10 iterations
    view.close()


def test_throughput_picture_has_markers_labels_and_a_legend_per_context(tmp_path):
    from matplotlib.lines import Line2D

    led = Ledger()
    view = mg.ThroughputView(ledger=led, widget=False)
    for ctx in ("dev0", "dev1"):
        led.record(_step(ctx, 1e4, seconds=0.5, iteration=100))
        led.record(_run(ctx, rows=40, seconds=0.01))
    view.refresh()
    view._series["dev1"].compiled[-1] = 0.2  # as if dev1's call had compiled
    fig = view._figure()
    ax_rate, ax_step = fig.axes
    legend = [t.get_text() for t in ax_rate.get_legend().get_texts()]
    assert legend == ["dev0", "dev1", "compiled (left out)"]
    markers = {line.get_marker() for line in ax_rate.get_lines() if isinstance(line, Line2D)}
    assert {"o", "s"} <= markers  # one shape per context, drawn at each point
    assert ax_rate.get_ylabel() == "samples per second"
    assert ax_step.get_ylabel() == "ms per step\n(compilation left out)"
    assert ax_step.get_xlabel().startswith("time since the view started (s)")
    assert {t.get_text() for t in ax_rate.texts} == {"fit", "f (spmd)"}  # each source named once
    view.save_png(tmp_path / "throughput.png", dpi=40)
    view.close()


# -- dashboard, text, pictures -----------------------------------------------------------------


def test_dashboard_combines_the_views_and_names_every_context():
    dash = mg.Dashboard(widget=True, live=False)
    box = dash.widget
    assert "mgkit-dashboard" in box._dom_classes
    assert [c._dom_classes[-1] for c in box.children] == [
        "mgkit-header",
        "mgkit-devicemap",
        "mgkit-memory",
        "mgkit-transfers",
        "mgkit-throughput",
    ]
    header = box.children[0].children[0].value
    assert f"jax {jax.__version__}" in header and f"backend {jax.default_backend()}" in header
    assert "simulated: yes (8 simulated CPU devices)" in header
    assert dash.header.facts()["simulated"] is True
    assert all(n in box.children[1].children[0].value for n in NAMES)
    bundle = dash._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert all(n in bundle["text/plain"] for n in NAMES)
    dash.close()
    assert all(v.closed for v in dash.views)


def test_views_are_text_outside_a_notebook():
    for view in (mg.DeviceMap(), mg.TransferView(), mg.ThroughputView(), mg.Dashboard()):
        assert view.widget is None
        bundle = view._repr_mimebundle_()
        assert set(bundle) == {"text/plain", "text/html"}
        assert bundle["text/plain"] == repr(view) and "<table" in bundle["text/html"]
    assert "mgkit throughput: 0 context(s) reporting" in repr(mg.ThroughputView())


@pytest.mark.parametrize("make", [mg.DeviceMap, mg.TransferView, mg.ThroughputView, mg.Dashboard])
def test_save_png_writes_a_picture_without_a_notebook(make, tmp_path):
    led = Ledger()
    led.record(_move("dev0", "dev1", 4096))
    led.record(_step("dev0", 1000.0))
    view = make(widget=False) if make is mg.DeviceMap else make(ledger=led, widget=False)
    path = view.save_png(tmp_path / "view.png", dpi=50)
    width, height = _png_size((tmp_path / "view.png").read_bytes())
    assert path == str(tmp_path / "view.png") and width > 100 and height > 50


# -- live updates ------------------------------------------------------------------------------


def _wait_for(condition, timeout=20.0):
    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        time.sleep(0.02)
    return condition()


def test_live_thread_updates_a_view_while_the_main_thread_records():
    led = Ledger()
    view = mg.TransferView(ledger=led, widget=True)
    label = view.widget.children[0].children[1]
    for i in range(200):
        led.record(_move("dev0", "dev1", 8))
        if i % 50 == 0:
            time.sleep(0.05)
    assert _wait_for(lambda: label.value == "transfers: 200")
    assert view.updates >= 1 and view.pending == 0
    view.close()


def test_load_is_rate_limited_and_buffers_stay_bounded():
    led = Ledger(capacity=1000)
    start = time.monotonic()
    dash = mg.Dashboard(ledger=led, rate=10, widget=True)
    text_view = mg.TransferView(ledger=led, widget=False)  # never refreshed: its buffer fills
    for i in range(20_000):  # in bursts of 1000, over about a second: the live thread refreshes meanwhile
        led.record(_move(NAMES[i % 8], NAMES[(i + 1) % 8], 100) if i % 2 else _step(NAMES[i % 8], float(i)))
        if i % 1000 == 999:
            assert dash.transfers.pending <= _live.BUFFER and dash.throughput.pending <= _live.BUFFER
            time.sleep(0.05)
    dash.close()
    elapsed = time.monotonic() - start
    assert text_view.pending == _live.BUFFER and len(led) == 1000
    for view in (dash, *dash.views):  # the first render when made, then at most `rate` a second
        assert view.updates <= 10 * elapsed + 2, (type(view).__name__, view.updates, elapsed)
    assert dash.transfers.refresh() is False  # closed
    text_view.refresh()
    assert text_view.count == 10_000 and text_view.nbytes == 1_000_000  # totals are exact
    assert all(len(s[1]) <= 300 for s in dash.throughput.series().values())


def test_close_stops_updates_and_unsubscribes():
    led = Ledger()
    view = mg.TransferView(ledger=led, widget=True)
    assert _watching(led) == 1 and view in _live.REFRESHER._views
    led.record(_move("dev0", "dev1", 8))
    view.refresh()
    updates = view.updates
    view.close()
    assert _watching(led) == 0 and view not in _live.REFRESHER._views
    led.record(_move("dev0", "dev1", 8))
    assert view.refresh() is False and view.updates == updates and view.count == 1
    with mg.ThroughputView(ledger=led, widget=False) as other:
        assert _watching(led) == 1
    assert other.closed and _watching(led) == 0


def test_a_forgotten_view_is_collected_and_stops_following_the_ledger():
    led = Ledger()
    view = mg.Dashboard(ledger=led, widget=True)
    ref = weakref.ref(view)
    assert _watching(led) == 3 and view in _live.REFRESHER._views  # transfers, throughput, memory
    del view
    gc.collect()
    assert ref() is None and _watching(led) == 0
    assert _wait_for(lambda: not _live.REFRESHER.running)  # no views left: the thread ends


def test_a_view_that_fails_to_refresh_is_logged_once_and_others_go_on(caplog, monkeypatch):
    led = Ledger()
    bad = mg.TransferView(ledger=led, widget=False)
    good = mg.TransferView(ledger=led, widget=False)
    monkeypatch.setattr(bad, "_update", lambda events, budgeted: 1 / 0)
    refresher = _live.Refresher()
    refresher._views.update((bad, good))  # ticked here, by hand: no thread
    with caplog.at_level(logging.ERROR, logger="mgkit"):
        for i in range(3):
            led.record(_move("dev0", "dev1", 8))
            assert refresher.tick(now=1000.0 + i) == 1
    assert bad.errors == 3 and good.count == 3
    assert [r.message for r in caplog.records] == [
        "mgkit: refreshing TransferView failed; it keeps its last values"
    ]


def test_the_refresh_thread_keeps_to_its_budget():
    budget = _live.Budget(share=0.01, burst=0.02)
    budget.charge(0.025)  # a refresh of 25 ms: 5 ms over what was saved up
    assert not budget.allows()
    budget.earn(wall=0.4)  # 4 ms earned: still short
    assert not budget.allows()
    budget.earn(wall=0.1)  # 1 ms more
    assert budget.allows() is False and budget.credit == pytest.approx(0.0)
    budget.earn(wall=100.0)  # idle for long: at most `burst` saved up
    assert budget.credit == 0.02 and budget.spent == 0.025
    refresher = _live.Refresher(period=0.05, share=0.01)
    assert refresher.pause(credit=0.001) == 0.05  # credit left: at the period
    assert refresher.pause(credit=-0.0007) == pytest.approx(0.07)  # until earned back
    assert refresher.pause(credit=-0.01) == 0.1  # but the memory samples keep their rate
    assert [_live.next_due(d, now, 4.0) for d, now in ((1.0, 1.05), (1.0, 1.3), (0.0, 5.0))] == [
        1.25,  # a tick late: the next stays on the schedule (the rate holds)
        1.55,  # a period late: a period from now (no burst to catch up)
        5.25,
    ]


def _flood(led, steps):
    """What a fast fit records per step: a split of its batch over 8 contexts, 8 step events and
    the step's collectives, as calls of a layout (one entry each)."""
    from mgkit._ledger import Kind, Layout

    def layout(kind, nbytes, info):
        return Layout([((kind, n, n, "cpu0", "cpu0", nbytes), 1.0, info) for n in NAMES])

    split = layout(Kind.SPLIT, 512, None)
    step = layout(Kind.STEP, 0, {"what": "fit", "of": 10**6, "models": 1, "rows": 8})
    collective = layout(Kind.COLLECTIVE, 64, {"op": "all-reduce", "read": "program"})
    for i in range(1, steps + 1):
        t = time.time()
        led.record(split.call(t, 1e-4, None))
        extra = tuple({"samples_per_second": 8e4, "iteration": i, "loss": 0.5} for _ in NAMES)
        led.record(step.call(t, 1e-4, None, extra))
        led.record(collective.call(t, 0.0, None))


def test_a_live_refresh_folds_the_newest_entries_of_a_heavy_stream_and_skips_the_rest():
    led = Ledger()
    view = mg.ThroughputView(ledger=led, widget=True, live=False)
    _flood(led, 1000)
    assert view.pending == 3000  # an entry per call
    assert view._tick(time.monotonic() + 1, _live.Budget.unlimited())
    assert view.pending == 0 and view.skipped == 1000 - _live.FOLD_CHUNK  # steps' calls only
    rows = {r[0]: r for r in view._rows()}
    assert rows["dev0"][4] == "100 us"  # each event its own step's time, not its time over the gap
    _flood(led, 3)
    view.refresh()  # by hand: all of them
    assert view.skipped == 1000 - _live.FOLD_CHUNK
    view.close()


def test_a_dashboard_keeps_sampling_memory_and_drawing_during_a_fast_fit_within_the_budget():
    import optax

    tr = mg.Trainer(
        lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), optax.sgd(1e-3), {"w": jnp.zeros((16, 4))}
    )
    data = {"x": np.ones((4096, 16), np.float32), "y": np.ones((4096, 4), np.float32)}
    tr.fit(data, steps=5, batch_size=64, progress=False)  # compiled
    gc.collect()  # views other tests left behind share the thread's budget until collected
    dash = mg.Dashboard(widget=True).watch(tr)  # refreshed by the views' thread
    memory, throughput = dash.memory, dash.throughput
    samples, busy, redraws = memory.samples, _live.REFRESHER.busy, throughput.redraws
    start = time.monotonic()
    while time.monotonic() - start < 5.0:  # hundreds of steps a second, 3 ledger entries each
        tr.fit(data, steps=50, batch_size=64, progress=False)
    wall = time.monotonic() - start
    samples, busy = memory.samples - samples, _live.REFRESHER.busy - busy
    redraws = throughput.redraws - redraws
    dash.close()
    assert samples >= 0.8 * memory.rate * wall, (samples, wall)  # its rate's samples
    # the throughput picture at its rate (the dashboard's panels: 2 a second)
    assert throughput.picture_rate == 2.0
    assert redraws >= 0.75 * throughput.picture_rate * wall, (redraws, wall)
    # the thread: 2 % of a core, with what it had saved up before
    assert busy <= _live.THREAD_SHARE * wall + _live.BURST + 0.01, (busy, wall)


def test_a_shared_reading_is_taken_at_most_once_a_period_and_within_its_share():
    calls = []

    def reading():
        calls.append(1)
        return len(calls)

    once = _live.Throttled(reading, period=30.0, share=0.01)
    assert [once(), once(), once()] == [1, 1, 1] and once.readings == 1  # the last value between
    assert once(fresh=True) == 2 and once() == 2  # fresh: a new reading, kept for the next ones


def test_a_raising_subscriber_is_logged_and_the_views_keep_working(caplog):
    led = Ledger()

    def broken(event):
        raise RuntimeError("subscriber bug")

    led.subscribe(broken)
    dash = mg.Dashboard(ledger=led, widget=False)
    with caplog.at_level(logging.ERROR, logger="mgkit"):
        led.record(_move("dev0", "dev1", 8))
        led.record(_step("dev1", 50.0))
    assert "subscriber" in caplog.text and "keeps recording" in caplog.text
    dash.refresh()
    assert dash.transfers.count == 1 and list(dash.throughput.series()) == ["dev1"] and len(led) == 2
    dash.close()


# -- missing libraries -------------------------------------------------------------------------


def test_missing_ipywidgets_is_an_actionable_error_only_for_widgets(monkeypatch):
    led = Ledger()
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    with pytest.raises(ImportError, match=r"pip install 'ipywidgets>=8\.1'.*widget=False"):
        mg.Dashboard(ledger=led, widget=True)
    assert _watching(led) == 0  # nothing left behind
    assert "mgkit transfers: 0" in repr(mg.TransferView(ledger=led, widget=False))
    monkeypatch.setattr(_base, "in_kernel", lambda: True)  # in a notebook, a widget is wanted
    with pytest.raises(
        ImportError,
        match=r"mg\.DeviceMap\(\) is shown in notebooks as a widget, with ipywidgets, which is not installed",
    ):
        mg.DeviceMap()


def test_missing_matplotlib_is_an_actionable_error_only_for_saved_pictures(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "matplotlib.figure", raising=False)
    view = mg.Dashboard(widget=True, live=False)  # live pictures are SVG: no matplotlib needed
    assert "<svg" in view.throughput.widget.children[1].value
    with pytest.raises(
        ImportError, match=r"mg\.Dashboard\(\)\.save_png draws its pictures with matplotlib.*pip install"
    ):
        view.save_png(tmp_path / "x.png")
    assert list(tmp_path.iterdir()) == []


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda: mg.DeviceMap(contexts=["dev0", "nope"]),
            mg.ContextError,
            r"unknown context\(s\) 'nope'.*dev0, dev1",
        ),
        (lambda: mg.TransferView(contexts=5), TypeError, r"contexts must be a list of context names.*int 5"),
        (lambda: mg.ThroughputView(contexts=[]), ValueError, r"contexts is empty; pass None"),
        (lambda: mg.Dashboard(contexts=["dev0", 3]), TypeError, r"context names are strings, got int 3"),
        (lambda: mg.TransferView(max_rows=0), ValueError, r"max_rows=0 is out of range.*1 to 1000"),
        (lambda: mg.TransferView(max_rows=2.5), TypeError, r"max_rows must be a whole number.*float 2\.5"),
        (lambda: mg.Dashboard(max_rows=True), TypeError, r"max_rows must be a whole number.*bool True"),
        (lambda: mg.ThroughputView(history=1), ValueError, r"history=1 is out of range.*2 to 100000"),
        (lambda: mg.TransferView(rate=0), ValueError, r"rate=0 is out of range; rate must be .* above 0"),
        (lambda: mg.ThroughputView(rate=50), ValueError, r"rate=50 .* at most 10"),
        (lambda: mg.DeviceMap(rate=float("nan")), ValueError, r"rate=nan"),
        (lambda: mg.Dashboard(rate="fast"), TypeError, r"rate must be .*refreshes per second.*str 'fast'"),
        (lambda: mg.TransferView(ledger="ledger"), TypeError, r"ledger must be an mg\.Ledger.*str 'ledger'"),
        (lambda: mg.DeviceMap(widget="yes"), TypeError, r"widget must be True.*'yes'"),
        (lambda: mg.ThroughputView(live=1), TypeError, r"live must be True .* or False .*got 1"),
    ],
)
def test_bad_arguments_are_named_with_the_fix(make, error, match):
    subscribers = _watching(mg.ledger())
    with pytest.raises(error, match=match):
        make()
    assert _watching(mg.ledger()) == subscribers


@pytest.mark.parametrize(
    ("path", "dpi", "error", "match"),
    [
        (42, 100, TypeError, r"path must be a str or os\.PathLike, got int 42"),
        ("picture.jpg", 100, ValueError, r"writes PNG pictures; give a file name ending in \.png"),
        ("missing/folder/view.png", 100, FileNotFoundError, r"the folder .*missing/folder' does not exist"),
        ("view.png", 5, ValueError, r"dpi=5 is out of range"),
    ],
)
def test_bad_save_png_arguments(path, dpi, error, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=match):
        mg.TransferView(widget=False).save_png(path, dpi=dpi)
    assert list(tmp_path.iterdir()) == []
