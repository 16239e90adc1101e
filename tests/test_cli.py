"""The `mgkit` command: `mgkit tour` runs the tour notebook in a fresh kernel, prints its report
and writes the executed notebook and pictures; bad arguments get one clear line and exit 1 (2 for
argparse's own errors), without hanging or leaving files behind."""

import datetime
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from mgkit import _cli, _tour
from tests.test_notebooks import EXPECTED_OUTPUT, output_text

PNG = b"\x89PNG\r\n\x1a\n"


def _mgkit(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs the `mgkit` command in a fresh process (its own device count)."""
    cmd = [sys.executable, "-m", "mgkit._cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _seconds(stamp: str) -> float:
    """Seconds of an ISO time stamp as nbclient records a cell's timing."""
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@pytest.mark.slow
def test_tour_prints_report_and_writes_files(tmp_path):
    r = _mgkit("tour", "--out", "report", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for expected in (
        "mgkit tour: running",
        "simulated: yes (8 simulated CPU devices)",
        "mgkit device map: 8 context(s), current (*) dev0",
        "mgkit throughput: 8 context(s) reporting",
        "mgkit ledger:",
        "bytes moved (row: from, column: to)",
        "wrote into",
    ):
        assert expected in out, f"{expected!r} not in the tour's output:\n{out}"
    code_cells = sum(c.cell_type == "code" for c in nbformat.read(_tour.NOTEBOOK, as_version=4).cells)
    assert f"{code_cells + 1}/{code_cells + 1}" in r.stderr, "the progress bar did not reach the end"

    folder = tmp_path / "report"
    executed = nbformat.read(folder / "00_tour.ipynb", as_version=4)
    code = [c for c in executed.cells if c.cell_type == "code"]
    assert len(code) == code_cells and all(c.execution_count for c in code)
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    text = output_text(executed)  # the tour notebook runs here only: what its cells must print
    for expected in EXPECTED_OUTPUT[_tour.NOTEBOOK.name]:
        assert expected in text, f"{_tour.NOTEBOOK.name}: expected {expected!r} in the outputs"
    html = (folder / "00_tour.html").read_text(encoding="utf-8")
    assert "The mgkit tour" in html and "Mapped name dev7 to device cpu7" in html
    assert "mgkit throughput: 8 context(s) reporting" in html  # the dashboard, as text
    assert "application/vnd.jupyter.widget-view+json" not in html  # readable without a network
    # dashboard.png's memory panel is the notebook's own dashboard's: sampled over the whole tour
    timing = [c.metadata.execution for c in code]
    cells = _seconds(timing[-1]["shell.execute_reply"]) - _seconds(timing[0]["iopub.execute_input"])
    span = re.search(r"memory: \d+ samples per context over ([\d.]+) s", out)
    assert span and float(span[1]) >= 0.5 * cells, (span and span[0], cells)
    for name in _tour.PICTURES:
        data = (folder / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5_000, name


def test_tour_default_folder():
    args = _cli.build_parser().parse_args(["tour"])
    assert args.out == "mgkit-tour" and not args.no_progress


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("a_file", "is a file, not a folder"),
        ("a_file/below", "cannot write there (Not a directory)"),
        ("/proc/mgkit-tour", "cannot write there"),
    ],
)
def test_tour_bad_out_is_one_line_and_exit_1(tmp_path, out, message):
    (tmp_path / "a_file").write_text("keep me")
    r = _mgkit("tour", "--out", out, cwd=tmp_path, timeout=120)
    assert r.returncode == 1
    assert r.stderr.startswith(f"mgkit tour: error: --out {out!r}") and message in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert (tmp_path / "a_file").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tour", "--bogus"], "unrecognized arguments: --bogus"),
        (["tour", "--out"], "argument --out: expected one argument"),
        (["tour", "extra"], "unrecognized arguments: extra"),
        (["tuor"], "invalid choice: 'tuor'"),
        (["devices", "--simulate", "0"], "0 is not at least 1"),
        (["devices", "--simulate", "eight"], "'eight' is not a whole number"),
    ],
)
def test_bad_arguments_exit_2(tmp_path, args, message):
    r = _mgkit(*args, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())


def test_no_command_prints_help_and_exits_2(capsys):
    assert _cli.main([]) == 2
    assert "{tour,devices,worker,run}" in capsys.readouterr().out


def test_version(capsys):
    import mgkit

    assert _cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == mgkit.__version__


def test_devices_simulated(tmp_path):
    r = _mgkit("devices", "--simulate", "3", cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "cpu2" in r.stdout and "cpu3" not in r.stdout


def _notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
def test_tour_failing_cell_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(_tour, "NOTEBOOK", _notebook(tmp_path / "t.ipynb", "x = 1", "x / 0"))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(_tour.TourError, match=r"stopped in cell 1 \('x / 0'\): ZeroDivisionError"):
        _tour.run(out, progress=False)
    assert not list(out.iterdir()), "a failed tour writes no files"


@pytest.mark.slow
def test_tour_dead_kernel_is_reported(tmp_path, monkeypatch):
    code = "import os, sys\nprint('going', file=sys.__stderr__, flush=True)\nos._exit(3)"
    monkeypatch.setattr(_tour, "NOTEBOOK", _notebook(tmp_path / "t.ipynb", "x = 1", code))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(_tour.TourError, match=r"(?s)kernel failed in cell 1.*its last words:.*going"):
        _tour.run(out, progress=False)
    assert not list(out.iterdir())


def test_tour_notebook_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(_tour, "NOTEBOOK", tmp_path / "nowhere.ipynb")
    with pytest.raises(_tour.TourError, match=r"tour notebook .*nowhere.ipynb is missing.*pip install -e \."):
        _tour.run(tmp_path, progress=False)
