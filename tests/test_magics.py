"""The IPython magics, driven through a real IPython shell: %mgkit, %%on, %%mgkit_peak."""

import inspect
import re

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import mgkit as mg
from mgkit import _devices, _magics
from tests.conftest import ipython_shell, run_python


@pytest.fixture(scope="module")
def shell():
    with ipython_shell() as ip:
        ok(ip, "%load_ext mgkit")
        ok(ip, "import numpy as np, jax.numpy as jnp, mgkit as mg")
        yield ip


@pytest.fixture(autouse=True)
def _keep_context_map():
    saved = mg.context_map()
    yield
    mg.use_contexts(saved, verbose=False)


def ok(ip, cell: str):
    """Runs a cell like a notebook does; fails the test if it raised. Returns (result, captured)."""
    with capture_output() as captured:
        result = ip.run_cell(cell, store_history=True)
    assert result.success, f"{cell!r} raised {result.error_in_exec!r}\n{captured.stdout}"
    return result, captured


def failed(ip, cell: str) -> BaseException:
    """Runs a cell that must fail; returns the exception the cell raised."""
    with capture_output():
        result = ip.run_cell(cell, store_history=True)
    assert not result.success, f"{cell!r} did not raise"
    return result.error_in_exec


def shown(captured) -> str:
    """Everything a cell printed or displayed, as text."""
    return captured.stdout + "".join(o.data.get("text/plain", "") for o in captured.outputs)


# -- %mgkit ------------------------------------------------------------------------------------


def test_devices_shows_the_device_table(shell):
    _, out = ok(shell, "%mgkit devices")
    text = shown(out)
    assert "8 device(s), jax" in text and all(f"cpu{i}" in text for i in range(8))
    assert out.outputs[0].data["text/html"].startswith('<table class="mgkit">')


def test_contexts_sets_the_map(shell):
    _, out = ok(shell, "%mgkit contexts dev0->cpu0; dev1->cpu3")  # a space after ';' is fine
    assert mg.context_map() == mg.ContextMap.parse("dev0->cpu0;dev1->cpu3")
    assert "Mapped name dev1 to device cpu3" in out.stdout
    ok(shell, "%mgkit contexts 'a0->cpu1;b1->cpu2'")  # quoted
    assert str(mg.context_map()) == "a0->cpu1;b1->cpu2"


def test_contexts_without_a_map_shows_the_current_one(shell):
    mg.use_contexts("dev0->cpu0;dev1->cpu1;big->cpu1", verbose=False)
    with mg.on("dev1"):
        _, out = ok(shell, "%mgkit contexts")
    lines = shown(out).splitlines()
    assert lines[0] == "context map dev0->cpu0;dev1->cpu1;big->cpu1"
    assert re.match(r"dev1\s+cpu1\s+.*\*$", lines[4]) and not lines[3].endswith("*")
    assert lines[5].startswith("big") and "<td>big</td>" in out.outputs[0].data["text/html"]


def test_simulate_with_the_count_in_effect_is_accepted(shell):
    _, out = ok(shell, "%mgkit simulate 8")
    assert "JAX already runs with 8 CPU device(s)" in out.stdout


def test_simulate_after_jax_started_gives_the_clear_error(shell):
    err = failed(shell, "%mgkit simulate 4")
    assert isinstance(err, UsageError)
    assert str(err).startswith("%mgkit simulate 4: mg.simulate(4) came too late: JAX has already started")
    assert "restart the kernel" in str(err)


def test_simulate_in_a_fresh_shell_sets_the_device_count():
    r = run_python(
        """
        import sys
        import mgkit
        assert "IPython" not in sys.modules, "import mgkit imported IPython"
        from IPython.core.interactiveshell import InteractiveShell
        from IPython.utils.capture import capture_output
        from traitlets.config import Config
        config = Config()
        config.HistoryManager.hist_file = ":memory:"
        ip = InteractiveShell.instance(config=config)
        for cell in ["%load_ext mgkit", "%mgkit simulate 4", "%mgkit devices", "%mgkit simulate 2"]:
            with capture_output() as out:
                result = ip.run_cell(cell)
            print(f"{cell} -> {type(result.error_in_exec).__name__}: {result.error_in_exec}")
            print(out.stdout, *(o.data["text/plain"] for o in out.outputs))
        """
    )
    assert r.returncode == 0, r.stderr
    assert "%mgkit simulate 4 -> NoneType" in r.stdout
    assert "JAX will start with 4 simulated CPU device(s)" in r.stdout
    assert "4 device(s), jax" in r.stdout and "cpu3" in r.stdout and "cpu4" not in r.stdout
    assert "%mgkit simulate 2 -> UsageError: %mgkit simulate 2: mg.simulate(2) came too late" in r.stdout


def test_dashboard_displays_what_mgkit_dashboard_returns(shell, monkeypatch):
    made = []

    class Board:
        def __repr__(self):
            return "the dashboard"

    def dashboard():
        made.append(Board())
        return made[-1]

    import mgkit.views

    monkeypatch.setattr(mgkit.views, "Dashboard", dashboard)
    _, out = ok(shell, "%mgkit dashboard")
    assert len(made) == 1 and [o.data["text/plain"] for o in out.outputs] == ["the dashboard"]


def test_ledger_shows_the_summary_and_clears(shell):
    ok(shell, "x = mg.put(np.ones(256, np.float32), 'dev2')")
    _, out = ok(shell, "%mgkit ledger")
    text = shown(out)
    assert "mgkit ledger: 1 event(s), 1.0 KiB moved" in text and re.search(r"put\s+host\s+dev2\s+1", text)
    assert len(mg.ledger()) == 1
    _, out = ok(shell, "%mgkit ledger --clear")
    assert "mgkit ledger: 1 event(s)" in shown(out) and out.stdout.endswith("mgkit: ledger cleared\n")
    assert len(mg.ledger()) == 0


def test_help_and_question_mark_show_every_usage(shell):
    _, out = ok(shell, "%mgkit help")
    _, pinfo = ok(shell, "%mgkit?")
    for text in (out.stdout, pinfo.stdout):
        for usage in [*_magics._COMMANDS.values(), "%%on CONTEXT", "%%mgkit_peak"]:
            assert usage in text, usage
    assert out.stdout.strip() == inspect.cleandoc(_magics.MgkitMagics.mgkit.__doc__)


def test_unload_removes_the_magics_and_load_brings_them_back(shell):
    ok(shell, "%unload_ext mgkit")
    assert failed(shell, "%mgkit devices") is not None and shell.find_cell_magic("on") is None
    ok(shell, "%load_ext mgkit")
    ok(shell, "%mgkit devices")


# -- %%on --------------------------------------------------------------------------------------


def test_on_runs_the_cell_on_the_context(shell):
    result, _ = ok(shell, "%%on dev1\nz = jnp.ones((16, 16))\ninside = mg.current()\nz.sum()")
    assert shell.user_ns["inside"] == "dev1" and mg.where(shell.user_ns["z"]) == "dev1"
    assert float(result.result) == 256.0 and mg.where(result.result) == "dev1"  # the last value is output
    assert mg.current() == "dev0"


def test_on_accepts_a_device_name_and_runs_magics_inside(shell):
    ok(shell, "%%on cpu5\nw = jnp.zeros(3)\n%mgkit contexts")
    assert shell.user_ns["w"].devices() == {mg.device_of("cpu5")}


def test_on_cell_with_a_syntax_error_raises_it_and_runs_nothing(shell):
    shell.user_ns.pop("ran", None)
    err = failed(shell, "%%on dev1\nran = 1\ndef f(:\n    pass")
    assert type(err) is SyntaxError and err.lineno == 2 and "ran" not in shell.user_ns
    assert mg.current() == "dev0"


def test_on_restores_the_context_after_an_error(shell):
    shell.user_ns.pop("before", None)
    with mg.on("dev2"):
        err = failed(shell, "%%on dev3\nbefore = mg.current()\nraise KeyError('boom')")
        assert mg.current() == "dev2"
    assert isinstance(err, KeyError) and shell.user_ns["before"] == "dev3"
    assert mg.current() == "dev0"
    ok(shell, "after = jnp.ones(2)")
    assert mg.where(shell.user_ns["after"]) == "dev0"


# -- %%mgkit_peak ------------------------------------------------------------------------------


def test_peak_counts_bytes_by_direction_and_context(shell):
    ok(shell, "earlier = mg.put(np.ones(999, np.float32), 'dev4')")  # before the cell: not counted
    cell = (
        "%%mgkit_peak\n"
        "a = mg.put(np.ones(1000, np.float32), 'dev1')\n"
        "b = mg.put(np.ones((50, 10), np.float32), 'dev2')\n"
        "c = mg.transfer(a, 'dev3')\n"
        "back = mg.transfer(b, 'cpu')\n"
        "back.shape"
    )
    result, out = ok(shell, cell)
    assert result.result == (50, 10)
    report = shell.user_ns["_mgkit_peak"]
    rows = {r.context: (r.device, *r[3:6]) for r in report.rows()}
    assert list(rows) == [f"dev{i}" for i in range(8)]
    assert rows["dev1"] == ("cpu1", 4000, 0, 0)
    assert rows["dev2"] == ("cpu2", 2000, 2000, 0)
    assert rows["dev3"] == ("cpu3", 0, 0, 4000)
    assert rows["dev4"] == ("cpu4", 0, 0, 0)
    peaks = {r.context: r.peak for r in report.rows()}  # live arrays sampled: a and c were alive
    assert peaks["dev1"] >= 4000 and peaks["dev3"] >= 4000 and peaks["dev4"] >= 3996
    assert report.moved == {"host->device": (2, 6000), "device->host": (1, 2000), "device->device": (1, 4000)}
    assert report.seconds > 0 and report.label == result.execution_count
    text = out.outputs[0].data["text/plain"]
    assert text.startswith(f"mgkit_peak: cell [{result.execution_count}] took ")
    assert "host->device 5.9 KiB in 2 event(s)" in text
    assert re.search(r"dev2\s+cpu2\s+>= [0-9.]+ [KM]iB \(live arrays\)\s+2.0 KiB", text)
    assert "<th>peak memory</th>" in out.outputs[0].data["text/html"]


def test_peak_reports_device_memory_where_the_device_reports_it(shell, monkeypatch):
    stats = {"cpu1": 1000, "cpu2": 5000}

    def memory_stats(device):
        short = _devices.short_name(device)
        if short not in stats:
            return {}
        return {"peak_bytes_in_use": stats[short], "bytes_in_use": 700, "bytes_limit": 2**30}

    monkeypatch.setattr(_devices, "memory_stats", memory_stats)
    mg.use_contexts("dev0->cpu0;dev1->cpu1;dev2->cpu2", verbose=False)
    shell.user_ns["stats"] = stats
    _, out = ok(shell, "%%mgkit_peak\nstats['cpu1'] = 3 * 2**20")
    rows = shell.user_ns["_mgkit_peak"].rows()
    assert [r[:3] for r in rows[1:]] == [
        ("dev1", "cpu1", 3 * 2**20),  # the cell raised the allocator's peak: its own peak
        ("dev2", "cpu2", 700),  # not raised: the most in use seen, a lower bound
    ]
    assert [r.exact for r in rows] == [False, True, False] and rows[0].source == "live arrays"
    text = shown(out)
    assert re.search(r"dev1\s+cpu1\s+3.0 MiB \(this cell\)", text)
    assert re.search(r"dev2\s+cpu2\s+>= 700 B\s", text) and re.search(
        r"dev0\s+cpu0\s+>= .* \(live arrays\)", text
    )
    assert "a lower bound (the allocator's peak was not raised" in text


def test_peak_measures_an_on_cell_inside_it(shell):
    result, _ = ok(shell, "%%mgkit_peak\n%%on dev5\nv = jnp.arange(4.0)\nmg.transfer(v, 'dev6')")
    assert mg.where(shell.user_ns["v"]) == "dev5" and mg.where(result.result) == "dev6"
    rows = {r.context: r[3:6] for r in shell.user_ns["_mgkit_peak"].rows()}
    assert rows["dev6"] == (0, 0, 16) and rows["dev5"] == (0, 0, 0)


def test_peak_reports_what_ran_when_the_cell_raises(shell):
    err = failed(shell, "%%mgkit_peak\na = mg.put(np.ones(10, np.float32), 'dev1')\n1 / 0")
    assert isinstance(err, ZeroDivisionError)
    assert shell.user_ns["_mgkit_peak"].moved["host->device"] == (1, 40)


# -- bad input ---------------------------------------------------------------------------------

BAD = [
    ("%mgkit", "%mgkit: missing subcommand; the subcommands are devices, contexts, simulate, dashboard"),
    ("%mgkit devcies", "unknown subcommand 'devcies' (did you mean 'devices'?); the subcommands are"),
    ("%mgkit frobnicate", "unknown subcommand 'frobnicate'; the subcommands are devices, contexts, simulate"),
    ("%mgkit devices all", "%mgkit devices: unexpected argument(s) 'all'; usage: %mgkit devices"),
    ("%mgkit help me now", "%mgkit help: unexpected argument(s) 'me now'; usage: %mgkit help"),
    ("%mgkit dashboard x", "%mgkit dashboard: unexpected argument(s) 'x'; usage: %mgkit dashboard"),
    ("%mgkit simulate", "%mgkit simulate: missing argument; usage: %mgkit simulate N, e.g. %mgkit simulate"),
    ("%mgkit simulate four", "'four' is not a whole number of CPU devices; usage: %mgkit simulate N"),
    ("%mgkit simulate -2", "'-2' is not a whole number of CPU devices"),
    ("%mgkit simulate 2 3", "%mgkit simulate: unexpected argument(s) '3'; usage: %mgkit simulate N"),
    ("%mgkit simulate 0", "%mgkit simulate 0: simulate: n=0 is out of range; n must be a whole number"),
    ("%mgkit contexts dev0", "mapping 'dev0' in 'dev0' has no '->'; write it as 'name->device'"),
    ("%mgkit contexts dev0->cpu99", "context 'dev0' -> device 'cpu99' does not exist"),
    ("%mgkit contexts cpu->cpu0", "context name 'cpu' in mapping 'cpu->cpu0' begins with 'cpu'"),
    ("%mgkit contexts d->opencl0:0", "'opencl0:0' in mapping 'd->opencl0:0' is an OpenCL device"),
    ("%mgkit contexts 'dev0->cpu0", "cannot split the arguments (No closing quotation)"),
    ("%mgkit contexts {spec}", "%mgkit contexts {spec}: {spec} is taken literally, not expanded"),
    ("%mgkit contexts $spec", "%mgkit contexts $spec: $spec is taken literally, not expanded"),
    ("%mgkit simulate {n}", "{n} is taken literally, not expanded: mgkit magics do not support {expr} or"),
    ("%mgkit ledger --clean", "unknown argument '--clean' (did you mean '--clear'?); usage: %mgkit ledger"),
    ("%mgkit ledger --clear --clear", "'--clear' given more than once; usage: %mgkit ledger [--clear]"),
    ("%%on\nran = 1", "%%on: missing context; usage: %%on CONTEXT, e.g. %%on dev1 (the contexts are dev0,"),
    ("%%on dev1 dev2\nran = 1", "%%on: one context expected, got 2: 'dev1 dev2'; usage: %%on CONTEXT"),
    ("%%on dev9\nran = 1", "%%on dev9: unknown context 'dev9'; the contexts are dev0, dev1, dev2, dev3"),
    ("%%on $ctx\nran = 1", "%%on $ctx: $ctx is taken literally, not expanded"),
    ("%%mgkit_peak now\nran = 1", "%%mgkit_peak takes no arguments, got 'now'; usage: %%mgkit_peak"),
    (
        "%%on dev1\nran = 1\nawait f()",
        "%%on: the cell uses top-level await ('await' outside function, line 2)",
    ),
    ("%%mgkit_peak\nran = 1\nasync with f():\n  pass", "'async with' outside async function, line 2"),
]


@pytest.mark.parametrize(("cell", "message"), BAD, ids=[c for c, _ in BAD])
def test_bad_input_is_a_usage_error(shell, cell, message):
    shell.user_ns.update(spec="dev0->cpu1", n=2, ctx="dev1")
    shell.user_ns.pop("ran", None)
    before = mg.context_map()
    err = failed(shell, cell)
    assert isinstance(err, UsageError) and message in str(err), str(err)
    assert "ran" not in shell.user_ns and mg.context_map() == before


def test_bad_context_map_message_ends_with_the_usage(shell):
    with pytest.raises(UsageError) as info:
        shell.run_line_magic("mgkit", "contexts dev0->cpu0;;dev1->cpu1")
    assert str(info.value).splitlines() == [
        "%mgkit contexts dev0->cpu0;;dev1->cpu1: empty mapping between ';' in 'dev0->cpu0;;dev1->cpu1'; "
        "remove the extra ';' (mappings look like 'dev0->cpu0;dev1->cpu1')",
        "usage: %mgkit contexts [MAP], e.g. %mgkit contexts dev0->cpu0;dev1->cpu1",
    ]
