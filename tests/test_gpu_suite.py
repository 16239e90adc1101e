"""benchmarks/gpu_suite.py: the dry run takes every part's code path on CPU devices and appends
its section; Ctrl-C, a failing part and a part past its budget still leave what was measured;
without a GPU and without --dry-run it exits 2 and says how to run it."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "benchmarks" / "gpu_suite.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_suite  # noqa: E402

from tests.conftest import child_env  # noqa: E402

TITLES = [p.title.format(gpu="cpu0", host="cpu1") for p in gpu_suite.PARTS]
HEADING = re.compile(
    r"^## GPU checks, \d{4}-\d\d-\d\d \d\d:\d\d UTC: .+, jax \S+, jaxlib \S+, Python \S+$", re.M
)
TABLE = r"\| what \| mgkit \| peer \| ratio \| note \|\n\| --- \| --- \| --- \| --- \| --- \|\n(\|.*\|\n)+"
# seconds, under the per-test limit with finish()'s 60 more: 75 to 140 s alone on two idle cores
# (the cluster part starts an engine: ~15 s), up to 200 s beside the other test worker
DRY_RUN_LIMIT = 260


def _env() -> dict[str, str]:
    env = child_env()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


class Run:
    """The suite in a fresh process (it sets its own device count), its descendants watched so
    that none outlives it."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(SUITE), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
        )
        self.seen: set[int] = set()
        self.lines: list[str] = []
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._done.is_set():
            try:
                self.seen.update(c.pid for c in psutil.Process(self.proc.pid).children(recursive=True))
            except psutil.Error:  # it ended meanwhile
                return
            time.sleep(0.1)

    def read_until(self, pattern: str) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if re.search(pattern, line):
                return
        raise AssertionError(f"the suite ended before printing {pattern!r}:\n{''.join(self.lines)}")

    def finish(self, timeout: float) -> int:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        finally:
            self._done.set()
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self.lines.append(out)
        return self.proc.returncode

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def leftovers(self) -> list[int]:
        """Descendants still alive; they are stopped (by pid) so that the test leaves none."""
        alive = []
        for pid in self.seen:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
                    p.kill()
            except psutil.NoSuchProcess:
                pass
        return alive


@pytest.mark.slow
@pytest.mark.timeout(DRY_RUN_LIMIT + 90)  # past finish()'s own wait, which reports the output
def test_dry_run_appends_a_table_for_every_part_quickly(tmp_path):
    """One test, so that the whole dry run happens once even with the tests spread over workers."""
    out = tmp_path / "RESULTS.md"
    out.write_text("# Figures\n")
    t0 = time.perf_counter()
    run = Run("--dry-run", "--out", str(out))
    rc = run.finish(timeout=DRY_RUN_LIMIT + 60)
    seconds = time.perf_counter() - t0
    assert rc == 0, run.output
    assert not run.leftovers()
    for i, title in enumerate(TITLES, 1):
        progress = rf"^\[{i}/{len(TITLES)}\] {re.escape(title)} \.\.\. \d+\.\d s$"
        assert re.search(progress, run.output, re.M), run.output
    assert seconds < DRY_RUN_LIMIT, f"the dry run took {seconds:.0f} s"
    text = out.read_text()
    assert text.startswith("# Figures\n"), "the section is appended, the file kept"
    assert len(HEADING.findall(text)) == 1, text[:400]
    assert "--dry-run" in text and "Dry run: CPU devices stand for the GPU" in text
    for title in TITLES:
        block = re.search(rf"^### {re.escape(title)} \(\d+\.\d s\)\n\n{TABLE}", text, re.M)
        assert block, f"no table for {title!r} in:\n{text}"
    assert "did not finish" not in text and "(not run)" not in text


@pytest.mark.slow
def test_ctrl_c_writes_what_was_measured(tmp_path):
    out = tmp_path / "RESULTS.md"
    run = Run("--dry-run", "--out", str(out))
    run.read_until(rf"^\[2/{len(TITLES)}\] .* \.\.\.$")  # the first part is done, the second started
    run.proc.send_signal(signal.SIGINT)
    rc = run.finish(timeout=120)
    assert rc == 130, run.output
    assert not run.leftovers()
    text = out.read_text()
    assert len(HEADING.findall(text)) == 1, text
    assert re.search(rf"^### {re.escape(TITLES[0])} \(\d+\.\d s\)\n\n\| what", text, re.M), text
    stopped = [
        t for t in TITLES if re.search(rf"^### {re.escape(t)} .*interrupted \(Ctrl-C\)\)$", text, re.M)
    ]
    assert len(stopped) == 1 and stopped[0] != TITLES[0], text
    after = TITLES[TITLES.index(stopped[0]) + 1 :]
    assert after and all(f"### {t} (not run)" in text for t in after), text


def test_without_a_gpu_it_exits_2_and_says_how_to_run(tmp_path):
    out = tmp_path / "RESULTS.md"
    run = Run("--out", str(out))
    rc = run.finish(timeout=120)
    assert rc == 2, run.output
    assert "no GPU here" in run.output and "--dry-run" in run.output, run.output
    assert not out.exists()


def _fails(setup, rows):
    rows.append(gpu_suite.figure("before the failure", "1 s"))
    raise ValueError("the device went away")


def _too_slow(setup, rows):
    rows.append(gpu_suite.figure("before the budget ran out", "2 s"))
    time.sleep(30)


def test_a_failing_part_and_a_part_past_its_budget_keep_their_rows(capsys):
    parts = [gpu_suite.Part("fails on {gpu}", _fails, 10), gpu_suite.Part("slow on {host}", _too_slow, 0.3)]
    setup = gpu_suite.Setup("cpu0", "cpu", "cpu1", True, gpu_suite.DRY_SIZES)
    t0 = time.perf_counter()
    outcomes, stopped = gpu_suite.run_parts(setup, parts)
    assert time.perf_counter() - t0 < 5 and not stopped
    assert [o.error for o in outcomes] == [
        "ValueError: the device went away",
        "OverBudgetError: ran past its budget of 0.3 s",
    ]
    text = gpu_suite.section(setup, outcomes, parts, ["--dry-run"])
    assert "### fails on cpu0 (" in text and "did not finish: ValueError: the device went away)" in text
    assert "| before the failure | 1 s | - | - |  |" in text
    assert "| before the budget ran out | 2 s | - | - |  |" in text
    assert "[1/2] fails on cpu0 ..." in capsys.readouterr().out
