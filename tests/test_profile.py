"""mg.profile() and %%mgkit_profile: a profiler trace read back into a timeline per context."""

import _thread
import os
import re
import signal
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output
from jax.profiler import ProfileData
from traitlets.config import Config

import mgkit as mg
from mgkit import _profile, _profile_read


def _loss(p, batch):
    return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)


@pytest.fixture(scope="module")
def trainer():
    """A data-parallel trainer on dev0 and dev1, compiled (its first steps run)."""
    mg.use_contexts(";".join(f"dev{i}->cpu{i}" for i in range(8)), verbose=False)
    tr = mg.Trainer(_loss, optax.sgd(0.1), {"w": jnp.zeros((16, 3)), "b": jnp.zeros(3)}, contexts=2)
    tr.fit(_data(), steps=2, batch_size=16, progress=False)
    return tr


def _data(rows: int = 256) -> dict:
    x = np.random.default_rng(0).normal(size=(rows, 16)).astype(np.float32)
    return {"x": x, "y": x[:, :3].copy()}


def _profiled(trainer, folder, steps: int = 4, **options) -> mg.Profile:
    with mg.profile(folder, **options) as prof:
        trainer.fit(_data(), steps=steps, batch_size=16, progress=False)
    return prof


def test_a_profile_of_trainer_steps_draws_a_row_per_context_labelled_by_program_and_step(trainer, tmp_path):
    first = trainer.step + 1
    prof = _profiled(trainer, tmp_path, show=False)
    tl = prof.timeline
    assert tl.rows == ("dev0", "dev1", "host") and tl.source == "host threads"
    assert tl.steps == tuple(range(first, first + 4))
    for ctx in ("dev0", "dev1"):
        mine = [s for s in tl.spans if s.row == ctx]
        assert {s.category for s in mine} >= {"compute", "communication", "transfer"}  # the all-reduce
        assert {s.step for s in mine if s.program == "jit_step"} == set(tl.steps)
    view = prof.view(widget=False)
    svg = view.svg()
    assert svg.startswith("<svg") and "http" not in svg.replace('xmlns="http://www.w3.org/2000/svg"', "")
    for step in tl.steps:
        assert f"compute: jit_step s{step}," in svg and f"communication: jit_step s{step}," in svg
        assert f"host: s{step}," in svg  # the step's dispatch on the host row
    assert ">dev0<" in svg and ">dev1<" in svg and ">host<" in svg
    text = str(view)
    assert "CPU trace (host threads only): each op on the context whose device ran it" in text
    assert text.splitlines()[-1].startswith("C compute  A communication")


def test_the_view_is_a_widget_in_a_notebook_and_saves_a_png(trainer, tmp_path):
    prof = _profiled(trainer, tmp_path, steps=2, show=False)
    view = prof.view(widget=True)
    assert "application/vnd.jupyter.widget-view+json" in view._repr_mimebundle_()
    assert "<svg" in view._box.children[0].value and "mgkit-profile" in view._box._dom_classes
    path = prof.view(widget=False).save_png(tmp_path / "profile.png")
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_gives_each_contexts_shares_summing_to_one(trainer, tmp_path):
    prof = _profiled(trainer, tmp_path, show=False)
    summary = prof.summary()
    assert [r[0] for r in summary.rows()] == ["dev0", "dev1"]
    for _, compute, comm, transfer, idle, window in summary.rows():
        assert compute + comm + transfer + idle == pytest.approx(1.0)
        assert compute > 0 and comm > 0 and transfer > 0 and idle >= 0 and window > 0
    assert repr(summary).splitlines()[1].split() == [
        "context",
        "compute",
        "communication",
        "transfers",
        "idle",
        "window",
    ]
    assert "<table" in summary._repr_html_()


def test_the_trace_is_kept_and_its_path_printed(trainer, tmp_path, capsys):
    prof = _profiled(trainer, tmp_path / "traces")
    out = capsys.readouterr().out
    assert prof.trace.startswith(str(tmp_path / "traces" / "plugins" / "profile"))
    assert os.path.isfile(prof.trace) and prof.trace.endswith(".xplane.pb")
    assert f"trace kept at {prof.trace}" in out and f"xprof --logdir {tmp_path / 'traces'}" in out
    assert any(f.endswith(".trace.json.gz") for f in os.listdir(os.path.dirname(prof.trace)))
    again = _profiled(trainer, tmp_path / "traces", steps=1, show=False)  # same second: its own folder
    assert again.trace != prof.trace and os.path.isfile(prof.trace)


def test_a_profile_without_a_trainer_shows_the_programs_on_their_contexts(tmp_path):
    x = mg.put(jnp.ones((64, 64)), "dev3")
    with mg.profile(tmp_path, show=False) as prof:
        jax.jit(lambda a: a @ a)(x).block_until_ready()
    tl = prof.timeline
    assert tl.rows == ("dev3",) and tl.steps == ()
    assert "no trainer step" in repr(prof.summary())


def _plane(pid: int, name: str, lines: dict) -> str:
    """One plane of an XSpace in the text format: ``lines`` maps a line's name to its events,
    each (name, start in microseconds, microseconds, stats)."""
    events, stats, out = {}, {}, []
    for i, (line, evs) in enumerate(lines.items()):
        body = []
        for ev_name, start, us, ev_stats in evs:
            meta = events.setdefault(ev_name, len(events) + 1)
            fields = " ".join(
                f"stats {{ metadata_id: {stats.setdefault(k, len(stats) + 1)} "
                + (f'str_value: "{v}" }}' if isinstance(v, str) else f"int64_value: {v} }}")
                for k, v in ev_stats.items()
            )
            times = f"offset_ps: {start * 10**6} duration_ps: {us * 10**6}"
            body.append(f"events {{ metadata_id: {meta} {times} {fields} }}")
        out.append(f'lines {{ id: {i + 1} name: "{line}" timestamp_ns: 0 {" ".join(body)} }}')
    out += [f'event_metadata {{ key: {m} value {{ id: {m} name: "{n}" }} }}' for n, m in events.items()]
    out += [f'stat_metadata {{ key: {m} value {{ id: {m} name: "{n}" }} }}' for n, m in stats.items()]
    return f'planes {{ id: {pid} name: "{name}" {" ".join(out)} }}'


def test_the_gpu_path_puts_each_stream_on_its_context_and_steps_by_run(tmp_path):
    """A trace with a device plane, as a GPU writes it (made from the XSpace text format)."""
    step = {"hlo_module": "jit_step", "run_id": 5}
    gpu = _plane(
        1,
        "/device:GPU:1",
        {
            "Stream #7(Compute)": [("fusion.1", 10, 20, step), ("all-reduce-start.1", 40, 10, step)],
            "Stream #9(MemcpyH2D)": [("MemcpyH2D", 5, 4, {})],
        },
    )
    python = [
        ("mgkit profile", 0, 100, {}),
        ("mgkit step", 1, 8, {"step_num": 4}),
        ("Execute (jit_step)", 2, 1, {"run_id": 5}),
    ]
    path = tmp_path / "gpu.xplane.pb"
    xspace = f"{gpu} {_plane(2, '/host:CPU', {'python': python})}"
    path.write_bytes(ProfileData.text_proto_to_serialized_xspace(xspace))
    tl = _profile_read.read_trace(str(path), {1: "dev1"}, 1000.0, [])
    assert tl.source == "device streams" and tl.rows == ("dev1 stream 7", "dev1 stream 9", "host")
    by_op = {(s.row, s.category): s for s in tl.spans}
    assert by_op[("dev1 stream 7", "compute")].step == 4  # run 5 was dispatched inside step 4
    assert by_op[("dev1 stream 7", "communication")].seconds == pytest.approx(10e-6)
    assert by_op[("dev1 stream 9", "transfer")].start == pytest.approx(4e-6)  # from step 4's start
    shares = tl.shares["dev1"]
    assert sum(shares) == pytest.approx(1.0) and shares.communication == pytest.approx(10 / 49)


def test_without_a_readable_trace_the_timeline_comes_from_the_ledger(trainer, tmp_path, monkeypatch):
    def unreadable(*args):
        raise ValueError("no ProfileData in this jax")

    monkeypatch.setattr(_profile, "read_trace", unreadable)
    prof = _profiled(trainer, tmp_path, show=False)
    tl = prof.timeline
    assert tl.source == "ledger" and tl.rows == ("dev0", "dev1", "host") and len(tl.steps) == 4
    assert "collectives are not timed" in tl.notes[0]
    assert all(sum(r[1:5]) == pytest.approx(1.0) for r in prof.summary().rows())


# -- errors, Ctrl-C ----------------------------------------------------------------------------


def _no_trace_running(tmp_path) -> None:
    jax.profiler.start_trace(str(tmp_path / "check"))  # raises while another trace runs
    jax.profiler.stop_trace()
    assert _profile.active() is None


def test_ctrl_c_inside_a_profile_stops_the_trace_and_keeps_it(trainer, tmp_path, capsys):
    data = _data(16)
    first = trainer.step + 1

    def batches(step):
        if step == first + 3:  # Ctrl-C while the fit runs: it stops at a step boundary
            threading.Timer(0.0, _thread.interrupt_main).start()
            time.sleep(0.05)
        return data

    with pytest.raises(KeyboardInterrupt), mg.profile(tmp_path) as prof:
        trainer.fit(batches, steps=1000, progress=False)
    assert isinstance(prof.error, KeyboardInterrupt) and os.path.isfile(prof.trace)
    assert "stopped by KeyboardInterrupt" in capsys.readouterr().out
    _no_trace_running(tmp_path)
    assert prof.timeline.steps[0] == first and len(prof.timeline.steps) < 10  # what ran can be read
    with pytest.raises(KeyboardInterrupt), mg.profile(tmp_path, show=False):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C outside any fit
    _no_trace_running(tmp_path)


def test_a_failure_inside_a_profile_stops_the_trace(tmp_path):
    with pytest.raises(ZeroDivisionError), mg.profile(tmp_path, show=False):
        1 / 0  # noqa: B018
    _no_trace_running(tmp_path)


def test_profiles_do_not_nest(tmp_path):
    with mg.profile(tmp_path, show=False) as outer:
        nested = pytest.raises(RuntimeError, match=r"a profile is running already .*profiles do not nest")
        with nested, mg.profile(tmp_path / "inner"):
            pytest.fail("the inner block ran")
        with pytest.raises(RuntimeError, match=r"still running; read prof\.timeline"):
            outer.summary()
    with pytest.raises(RuntimeError, match="a profile runs once"), outer:
        pass
    _no_trace_running(tmp_path)


def test_a_trace_already_started_with_jax_profiler_is_named(tmp_path):
    jax.profiler.start_trace(str(tmp_path / "theirs"))
    try:
        theirs = pytest.raises(
            RuntimeError, match=r"jax\.profiler has a trace running already .*stop_trace\(\)"
        )
        with theirs, mg.profile(tmp_path, show=False):
            pytest.fail("the block ran")
    finally:
        jax.profiler.stop_trace()
    assert _profile.active() is None


def test_a_trace_folder_that_cannot_be_written_is_refused_before_anything_runs(tmp_path):
    blocker = tmp_path / "taken"
    blocker.write_text("a file where the folder should be")
    a_file = pytest.raises(
        NotADirectoryError, match=re.escape(f"the trace folder '{blocker}' is a file, not a")
    )
    with a_file, mg.profile(blocker):
        pytest.fail("the block ran")
    under = pytest.raises(PermissionError, match=re.escape(f"cannot write the trace in '{blocker / 'sub'}'"))
    with under, mg.profile(blocker / "sub"):
        pytest.fail("the block ran")
    _no_trace_running(tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"path": 3}, "path must be a folder name .* got int 3"),
        ({"python": "yes"}, "python must be True or False, got str 'yes'"),
        ({"show": None}, "show must be True or False, got NoneType None"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, message):
    with pytest.raises(TypeError, match=message):
        mg.profile(**kwargs)


def test_the_default_folder_is_in_the_temporary_folder():
    assert mg.profile().folder == os.path.join(tempfile.gettempdir(), "mgkit-profiles")
    assert repr(mg.profile("x")).startswith("mgkit profile: not started (`with` it); it will write to ")


def test_a_profile_view_of_something_else_is_refused():
    with pytest.raises(TypeError, match=r"the Profile of `with mg.profile\(\) as prof:`, got int"):
        mg.ProfileView(42)


# -- the cell magic ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shell(trainer):
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    ip = InteractiveShell.instance(config=config)
    try:
        ip.run_cell("%load_ext mgkit")
        ip.user_ns.update(tr=trainer, data=_data())
        yield ip
    finally:
        InteractiveShell.clear_instance()


def test_the_magic_profiles_the_cell_and_draws_the_timeline_inline(shell, tmp_path):
    with capture_output() as captured:
        result = shell.run_cell(
            f"%%mgkit_profile --dir {tmp_path}\ntr.fit(data, steps=3, batch_size=16, progress=False)\n2 + 3"
        )
    assert result.success and result.result == 5
    prof = shell.user_ns["_mgkit_profile"]
    assert f"trace kept at {prof.trace}" in captured.stdout and prof.trace.startswith(str(tmp_path))
    (drawn,) = [o for o in captured.outputs if "mgkit-profile" in o.data.get("text/html", "")]
    assert "<svg" in drawn.data["text/html"] and "jit_step s" in drawn.data["text/html"]
    assert drawn.data["text/plain"].startswith("mgkit profile: steps ")


def test_the_magics_python_option_traces_python_calls(shell, tmp_path):
    with capture_output():
        result = shell.run_cell(f"%%mgkit_profile --python --dir={tmp_path}\nsum(range(10))")
    assert result.success and result.result == 45
    prof = shell.user_ns["_mgkit_profile"]
    assert prof.python and prof.folder == str(tmp_path)
    names = {e.name for p in ProfileData.from_file(prof.trace).planes for ln in p.lines for e in ln.events}
    assert any(n.startswith("$") for n in names)  # the Python tracer's calls


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--dri x", "unknown option '--dri' (did you mean '--dir'?); the options are --dir, --python"),
        ("--dir", "--dir needs a folder, e.g. --dir profiles"),
        ("--dir a --dir b", "--dir given more than once"),
        ("profiles", "unknown argument 'profiles'"),
        ("--dir {folder}", "{folder} is taken literally, not expanded"),
    ],
)
def test_the_magic_refuses_bad_options(shell, line, message):
    with pytest.raises(UsageError, match=r"%%mgkit_profile") as raised:
        shell.run_cell_magic("mgkit_profile", line, "ran = True")
    assert message in str(raised.value) and "usage: %%mgkit_profile [--dir FOLDER] [--python]" in str(
        raised.value
    )
    assert "ran" not in shell.user_ns


def test_the_magic_refuses_an_unwritable_folder_and_a_profile_inside_another(shell, tmp_path):
    blocker = tmp_path / "taken"
    blocker.write_text("")
    with pytest.raises(UsageError, match="is a file, not a folder"):
        shell.run_cell_magic("mgkit_profile", f"--dir {blocker}", "ran = True")
    with mg.profile(tmp_path, show=False), pytest.raises(UsageError, match="profiles do not nest"):
        shell.run_cell_magic("mgkit_profile", f"--dir {tmp_path}", "ran = True")
    assert "ran" not in shell.user_ns
    _no_trace_running(tmp_path)


def test_the_magic_is_listed_in_the_help_and_removed_on_unload(shell):
    with capture_output() as captured:
        shell.run_line_magic("mgkit", "help")
    assert "%%mgkit_profile [--dir D] [--python]" in captured.stdout
    shell.run_line_magic("unload_ext", "mgkit")
    assert "mgkit_profile" not in shell.magics_manager.magics["cell"]
    shell.run_line_magic("load_ext", "mgkit")
    assert "mgkit_profile" in shell.magics_manager.magics["cell"]


def test_a_cell_that_fails_under_the_magic_stops_the_trace_and_shows_the_error(shell, tmp_path):
    with capture_output() as captured:
        result = shell.run_cell(f"%%mgkit_profile --dir {tmp_path}\n1 / 0")
    assert isinstance(result.error_in_exec, ZeroDivisionError)
    prof = shell.user_ns["_mgkit_profile"]
    assert isinstance(prof.error, ZeroDivisionError) and os.path.isfile(prof.trace)
    assert "stopped by ZeroDivisionError" in captured.stdout
    _no_trace_running(tmp_path)
