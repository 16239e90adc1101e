"""mg.MemoryView: samples of the live arrays on CPU, the simulated limit drawn, a trainer's bands,
the dashboard's memory panel, the sampler's budget, %%mgkit_peak within a cell, bad input."""

import re
import time

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from IPython.utils.capture import capture_output

import mgkit as mg
from mgkit import _devices
from mgkit.views import _live
from mgkit.views._devicemap import LIVE_BYTES
from tests.conftest import ipython_shell

MB4 = 4_000_000  # a float32[1000, 1000]


def _loss(p, b):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def _data(n=256):
    return {"x": np.ones((n, 64), np.float32), "y": np.ones((n, 4), np.float32)}


def _used(view, name):
    return next(r.used for r in view.rows() if r.context == name)


def test_the_view_samples_the_live_arrays_on_cpu_and_keeps_the_peak():
    view = mg.MemoryView(contexts=["dev1", "dev2"], widget=False, live=False)
    before = _used(view, "dev1")
    a = mg.put(np.ones((1000, 1000), np.float32), "dev1")
    rows = {r.context: r for r in view.rows()}
    assert list(rows) == ["dev1", "dev2"] and rows["dev1"].device == "cpu1"
    assert rows["dev1"].used - before == MB4 and rows["dev1"].source == "live arrays"
    del a
    rows = {r.context: r for r in view.rows()}
    assert rows["dev1"].used == before and rows["dev1"].peak >= before + MB4  # the peak stays
    points = view.history("dev1")
    assert [p.used - before for p in points[-3:]] == [0, MB4, 0]
    assert points[-2].records >= 1  # the put was recorded in the ledger before that sample
    assert points == sorted(points, key=lambda p: p.t)
    text = repr(view)
    assert text.startswith("mgkit memory: 2 context(s), the last 300 s kept")
    assert "live arrays: the bytes of the jax arrays alive" in text and "parameters" not in text
    view.close()


def test_the_simulated_limit_is_drawn(monkeypatch, tmp_path):
    monkeypatch.setattr(_devices, "_simulated_limit", 64 << 20)
    view = mg.MemoryView(contexts=["dev0"], widget=True, live=False)
    assert [r.limit for r in view.rows()] == [64 << 20]
    assert re.search(r"dev0\s+cpu0\s+\S+ \S+\s+\S+ \S+\s+64.0 MiB\s+live arrays", repr(view))
    svg = view.svg()
    assert svg.startswith("<svg") and ">limit<" in svg and "dev0 MiB" in svg
    assert view.widget.children[1].value == svg  # the live picture in the widget
    path = view.save_png(tmp_path / "memory.png")
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG" and path.endswith("memory.png")
    view.close()


def test_a_device_with_allocator_statistics_shows_its_use_and_peak(monkeypatch):
    stats = {"bytes_in_use": 1 << 30, "peak_bytes_in_use": 3 << 30, "bytes_limit": 16 << 30}
    monkeypatch.setattr(_devices, "memory_stats", lambda d: dict(stats) if d.id == 4 else {})
    monkeypatch.setattr(
        _devices, "memory", lambda d: (stats["bytes_in_use"], 16 << 30) if d.id == 4 else (None, None)
    )
    view = mg.MemoryView(contexts=["dev4"], widget=False, live=False)
    stats["bytes_in_use"] = 2 << 30
    row = view.rows()[0]
    assert row[2:6] == (2 << 30, 3 << 30, 16 << 30, "allocator")  # the allocator's own peak
    assert [p.used for p in view.history("dev4")] == [1 << 30, 2 << 30]
    assert re.search(r"dev4\s+cpu4\s+2.0 GiB\s+3.0 GiB\s+16.0 GiB\s+allocator", repr(view))
    assert "live arrays:" not in repr(view)


def test_a_watched_trainer_is_drawn_as_bands():
    tr = mg.Trainer(_loss, optax.adam(1e-3), {"w": jnp.zeros((64, 4))}, contexts=["dev0", "dev1"])
    view = mg.MemoryView(contexts=["dev0", "dev1", "dev2"], widget=False, live=False)
    assert view.watch(tr) is view
    tr.fit(_data(), steps=3, batch_size=64, progress=False)
    rows = {r.context: r for r in view.rows()}
    table = {r.context: r for r in tr.memory().rows()}
    for name in ("dev0", "dev1"):
        band = rows[name].band
        assert band == (table[name].params, table[name].opt_state, table[name].batch)
        assert band.params == 64 * 4 * 4 and band.batch > 0
    assert rows["dev2"].band is None  # the trainer does not run there
    text = repr(view)
    assert "parameters" in text and "optimizer state" in text and re.search(r"dev0 .* 1.0 KiB", text)
    assert "+ parameters" in view.svg() and "+ batch" in view.svg()
    del tr
    view.refresh()  # the view holds the trainer weakly
    view.close()


def test_a_trainer_whose_state_is_in_a_running_step_is_read_again_later():
    class Busy:  # memory() as Trainer.memory() raises while the step holds the donated state
        calls = 0

        def memory(self):
            Busy.calls += 1
            if Busy.calls == 1:
                raise RuntimeError("Array has been deleted with shape=float32[256].")
            return mg.fits({"w": jnp.zeros((64, 4))}, optax.sgd(0.1), contexts=["dev0"])

    busy = Busy()
    view = mg.MemoryView(contexts=["dev0"], widget=False, live=False).watch(busy)
    assert view.errors == 0 and view.rows()[0].band == (1024, 0, 0)  # read at the next refresh
    view.close()


def test_the_dashboard_has_the_memory_panel_and_it_samples_after_the_steps(tmp_path):
    tr = mg.Trainer(_loss, optax.adam(1e-3), {"w": jnp.zeros((64, 4))})
    dash = mg.Dashboard(rate=10, widget=True, live=False).watch(tr)  # ticked by the test
    assert dash.memory in dash.views and dash.memory.widget in dash.widget.children
    samples, now = dash.memory.samples, time.monotonic() + 1.0
    for k in range(1, 4):  # the views' thread's ticks after each fit
        tr.fit(_data(), steps=5, batch_size=64, progress=False)
        dash._tick(now + k, _live.Budget.unlimited())
    points = dash.memory.history("dev0")
    assert dash.memory.samples - samples == 3 and all(p.records >= 5 for p in points[-3:])  # 5 steps each
    assert "mgkit memory: 8 context(s)" in dash.text() and "optimizer state" in dash.text()
    dash.save_png(tmp_path / "dash.png")
    assert (tmp_path / "dash.png").stat().st_size > 10_000
    dash.close()


def test_the_live_arrays_are_summed_within_a_share_of_a_core():
    def costly():
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.002:  # 2 ms of CPU a reading
            pass
        return {}

    reading = _live.Throttled(costly, period=1.0, share=0.01)
    reading(age=0.0)
    for _ in range(20):  # asked for a fresh value (age 0) twenty times: the budget says no
        reading(age=0.0)
    assert reading.readings == 1
    time.sleep(1.0)  # 2 ms / 1 % = 0.2 s later (more on a loaded machine), a new reading is allowed
    reading(age=0.0)
    assert reading.readings == 2 and reading.busy < 0.05


def test_a_live_view_samples_at_its_rate_on_the_views_thread():
    view = mg.MemoryView(contexts=["dev3"], rate=10, widget=True)
    assert view in _live.REFRESHER._views  # the views' thread ticks it; here the test does
    _live.REFRESHER.discard(view)
    samples, now = view.samples, time.monotonic() + 1.0
    ticks = [
        view._tick(now + k * 0.05, _live.Budget.unlimited()) for k in range(1, 11)
    ]  # 0.5 s of ticks at 20 a second
    assert view.samples - samples == 5 and ticks.count(False) >= 5  # at most 10 samples a second
    view.close()


def test_a_live_view_samples_many_live_arrays_at_its_rate_reusing_recent_sums():
    arrays = [mg.put(np.ones(4, np.float32), "dev3") for _ in range(3000)]  # ~10 ms a sum
    view = mg.MemoryView(contexts=["dev3"], rate=10, widget=True)
    _live.REFRESHER.discard(view)  # ticked by the test, as the views' thread would
    readings = LIVE_BYTES.readings
    samples, now = view.samples, time.monotonic() + 1.0
    for k in range(1, 16):  # 1.5 s of samples at 10 a second, the ledger busy
        mg.ledger().record(mg.Event("put", "host", "dev3", "host", "cpu3", 16, time.time(), 0.0))
        view._tick(now + k * 0.11, _live.Budget.unlimited())
        time.sleep(0.1)
    assert view.samples - samples == 15  # every sample taken, most with the last sum
    # sums are reused for 0.1 s: fewer sums than samples (the share of a core they cost is
    # measured in benchmarks/bench_seeing.py, not asserted here: it depends on the machine's load)
    assert 1 <= LIVE_BYTES.readings - readings < 15
    view.close()
    del arrays


BAD = [
    (
        lambda: mg.MemoryView(contexts=["dev0", "gpu9x"]),
        mg.ContextError,
        r"unknown context\(s\) 'gpu9x'.*dev0, dev1",
    ),
    (lambda: mg.MemoryView(contexts=[]), ValueError, r"contexts is empty; pass None to show every context"),
    (lambda: mg.MemoryView(contexts=5), TypeError, r"contexts must be a list of context names"),
    (lambda: mg.MemoryView(rate=0), ValueError, r"rate=0 is out of range.*at most 10"),
    (lambda: mg.MemoryView(rate=50), ValueError, r"rate=50 is out of range"),
    (lambda: mg.MemoryView(rate="fast"), TypeError, r"rate must be .*str 'fast'"),
    (lambda: mg.MemoryView(window=0.5), ValueError, r"window=0.5 is out of range.*seconds kept"),
    (lambda: mg.MemoryView(window=None), TypeError, r"window must be a finite number"),
    (
        lambda: mg.MemoryView(widget=False).watch(42),
        TypeError,
        r"watch\(trainer\): trainer must be an mg.Trainer",
    ),
    (
        lambda: mg.MemoryView(widget=False).history("dev9"),
        KeyError,
        r"no samples of 'dev9'; the contexts shown",
    ),
    (
        lambda: mg.MemoryView(widget=False).save_png("memory.svg"),
        ValueError,
        r"give a file name ending in .png",
    ),
]


@pytest.mark.parametrize(("make", "error", "message"), BAD, ids=[m for *_, m in BAD])
def test_bad_input_is_refused_with_a_clear_message(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_a_closed_view_watches_nothing():
    view = mg.MemoryView(widget=False)
    view.close()
    with pytest.raises(RuntimeError, match=r"the view is closed; make a new mg.MemoryView\(\)"):
        view.watch(mg.Trainer(_loss, optax.sgd(0.1), {"w": jnp.zeros((64, 4))}))


# -- %%mgkit_peak ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shell():
    with ipython_shell() as ip:
        ip.run_cell("%load_ext mgkit\nimport time, numpy as np, mgkit as mg")
        yield ip


def test_the_peak_within_a_cell_counts_arrays_freed_before_it_ended(shell):
    cell = "%%mgkit_peak\nbig = mg.put(np.ones((1000, 1000), np.float32), 'dev2')\ntime.sleep(0.3)\ndel big"
    shell.run_cell("before = mg.MemoryView(contexts=['dev2'], widget=False).rows()[0].used")
    with capture_output() as out:
        result = shell.run_cell(cell, store_history=True)
    assert result.success, result.error_in_exec
    rows = {r.context: r for r in shell.user_ns["_mgkit_peak"].rows()}
    assert rows["dev2"].peak >= shell.user_ns["before"] + MB4 and not rows["dev2"].exact
    assert rows["dev2"].source == "live arrays" and rows["dev2"].host_to_device == MB4
    text = out.outputs[0].data["text/plain"]
    assert re.search(r"dev2\s+cpu2\s+>= 3.8 MiB \(live arrays\)", text), text
