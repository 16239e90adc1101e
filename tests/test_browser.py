"""The dashboard in a real JupyterLab, in Debian's Chromium driven by Playwright.

The test writes a notebook into a temporary root, starts JupyterLab on 127.0.0.1 (a free port, a
token, its own config, data, runtime and IPython folders, so nothing of the user's is read or
written), opens the notebook and runs every cell. While the last cell still runs a loop of
transfers, parallel calls and trainer steps, it reads the dashboard until its transfer count grew,
its throughput plot redrew twice, its memory panel (with the watched trainer's bands) changed and
the collectives of the trainer's step appeared among the transfers, all before the loop ends. The
loop ends when the test writes a stop file (or after a bound), so a slow machine makes the test
wait, not fail.
"""

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
CONTEXTS = ("alpha", "beta", "gamma", "delta")
STOP_FILE = "stop-the-loop"
LOOP_SECONDS = 120  # the loop's own bound, should the test never write the stop file
SERVER_TIMEOUT = 60  # seconds for JupyterLab to answer
UI_TIMEOUT = 120_000  # ms for the page, the kernel and the first cells

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(),
        reason=f"{CHROMIUM} is absent (Debian's chromium package: apt-get install -y chromium)",
    ),
]

CELLS = [
    f"""\
import mgkit as mg

mg.simulate(8)
import numpy as np

mg.use_contexts({";".join(f"{n}->cpu{i}" for i, n in enumerate(CONTEXTS))!r})""",
    """\
dash = mg.Dashboard()
dash""",
    f"""\
import pathlib
import time

import jax.numpy as jnp
import optax

stop = pathlib.Path({STOP_FILE!r})
names = list(mg.context_map().names)
x = mg.put(np.ones((256, 256), np.float32), names[0])
layer = mg.parallel(lambda v: jnp.tanh(v) * 2)
batch = np.ones((4096, 64), np.float32)
layer(batch).block_until_ready()  # compiled before the loop
tr = mg.Trainer(lambda p, b: jnp.mean((b @ p["w"]) ** 2), optax.sgd(0.01), {{"w": jnp.ones((64, 8))}})
dash.watch(tr)
tr.fit(batch[:256], steps=1, progress=False)  # compiled before the loop
print("loop started", flush=True)
t0, rounds = time.perf_counter(), 0
while not stop.exists() and time.perf_counter() - t0 < {LOOP_SECONDS}:
    x = mg.transfer(x, names[(rounds + 1) % len(names)])
    layer(batch).block_until_ready()
    tr.fit(batch[:256], steps=1, progress=False)
    rounds += 1
    time.sleep(0.02)
print(f"loop done after {{rounds}} rounds", flush=True)""",
]

# One look at the page: the dashboard's text, and the loop cell's prompt and output.
READ_PAGE = """() => {
  const text = (el) => (el ? el.innerText : null);
  const cells = document.querySelectorAll('.jp-Notebook .jp-Cell');
  const loop = cells[2];
  return {
    dashboard: text(document.querySelector('.mgkit-dashboard')),
    transfers: text(document.querySelector('.mgkit-dashboard .mgkit-transfers')),
    throughput: text(document.querySelector('.mgkit-dashboard .mgkit-throughput')),
    memory: text(document.querySelector('.mgkit-dashboard .mgkit-memory')),
    memory_svg: (document.querySelector('.mgkit-dashboard .mgkit-memory svg') || {}).innerHTML || null,
    prompt: loop ? text(loop.querySelector('.jp-InputPrompt')) : null,
    output: loop ? text(loop.querySelector('.jp-OutputArea')) || '' : '',
  };
}"""

KERNEL_IDLE = """() => {
  const app = window.jupyterapp;
  const panel = app && app.shell.currentWidget;
  const kernel = panel && panel.sessionContext && panel.sessionContext.session
    && panel.sessionContext.session.kernel;
  return !!kernel && kernel.status === 'idle';
}"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _number(pattern: str, text: str | None) -> int | None:
    match = re.search(pattern, text or "")
    return int(match.group(1)) if match else None


def _wait_for_output(page, text: str) -> None:
    """Waits for a cell output containing ``text``; on timeout, fails showing what the cells printed."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.locator(".jp-OutputArea-output").filter(has_text=text).wait_for()
    except PlaywrightTimeout:
        outputs = page.locator(".jp-OutputArea-output").all_inner_texts()
        raise AssertionError(
            f"no output {text!r} in {UI_TIMEOUT / 1000:.0f} s; the cells showed {outputs}"
        ) from None


class Lab:
    """A JupyterLab server of its own, on 127.0.0.1."""

    def __init__(self, home: Path):
        self.root = home / "root"
        self.log = home / "jupyterlab.log"
        self.token = secrets.token_hex(16)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = home / "config"
        (config / "labconfig").mkdir(parents=True)
        self.root.mkdir()
        (config / "jupyter_server_config.json").write_text(
            json.dumps(
                {
                    "LabApp": {
                        "expose_app_in_browser": True,  # window.jupyterapp, to run commands
                        "news_url": None,
                        "check_for_updates_class": "jupyterlab.NeverCheckForUpdate",
                        "extension_manager": "readonly",
                    }
                }
            )
        )
        (config / "labconfig" / "page_config.json").write_text(
            json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
        )
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "MGKIT_CONTEXTS"))}
        self.env.update(
            JUPYTER_CONFIG_DIR=str(config),
            JUPYTER_DATA_DIR=str(home / "data"),
            JUPYTER_RUNTIME_DIR=str(home / "runtime"),
            IPYTHONDIR=str(home / "ipython"),
            MPLCONFIGDIR=str(home / "matplotlib"),
            MGKIT_SIMULATE="8",
        )
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--ServerApp.allow_root=True",
            "--ServerApp.terminals_enabled=False",
        ]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                cmd,
                cwd=self.root,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + SERVER_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"JupyterLab exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"JupyterLab did not answer in {SERVER_TIMEOUT} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()  # JupyterLab shuts its kernels down on SIGTERM
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@pytest.fixture
def lab(tmp_path):
    server = Lab(tmp_path)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_dashboard_updates_live_in_jupyterlab(lab, tmp_path):
    from playwright.sync_api import sync_playwright

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / "live.ipynb")
    screenshot = tmp_path / "dashboard.png"

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            page.set_default_timeout(UI_TIMEOUT)
            page.goto(f"{lab.url}/lab/tree/live.ipynb?token={lab.token}")
            page.wait_for_function(KERNEL_IDLE, timeout=UI_TIMEOUT)
            # Not awaited: the command's promise resolves only when every cell has run.
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            _wait_for_output(page, "loop started")

            def look() -> dict:
                state = page.evaluate(READ_PAGE)
                state["count"] = _number(r"transfers: (\d+)", state["transfers"])
                state["redraws"] = _number(r"redraws: (\d+)", state["throughput"])
                state["busy"] = state["prompt"] == "[*]:" and "loop done" not in state["output"]
                return state

            first = look()
            assert first["busy"], f"the loop cell is not running: {first}"
            assert first["dashboard"], "no element with class mgkit-dashboard on the page"
            for name in CONTEXTS:
                assert name in first["dashboard"], f"context {name!r} not shown by the dashboard"
            assert first["count"] is not None, f"no 'transfers: N' in the dashboard: {first['transfers']!r}"
            assert first["redraws"] is not None, f"no 'redraws: N' in the dashboard: {first['throughput']!r}"
            assert first["memory"], "no memory panel (class mgkit-memory) in the dashboard"

            # Read again until the count grew and the plot redrew twice, every look while the loop runs.
            later = first
            deadline = time.monotonic() + LOOP_SECONDS / 2
            while time.monotonic() < deadline:
                time.sleep(0.5)
                later = look()
                if not later["busy"]:
                    break
                if (
                    later["count"] > first["count"]
                    and later["redraws"] >= first["redraws"] + 2
                    and later["memory_svg"] not in (None, first["memory_svg"])
                    and "collective" in (later["transfers"] or "")
                ):
                    page.screenshot(path=str(screenshot), full_page=True)
                    break
            assert later["busy"], f"the loop ended before the test stopped it: {later['output']!r}"
            assert later["count"] > first["count"], (
                f"transfer count did not grow while the loop ran: {first['count']} -> {later['count']}"
            )
            assert later["redraws"] >= first["redraws"] + 2, (
                f"throughput plot redrew {later['redraws'] - first['redraws']} time(s) while the loop ran"
            )
            assert later["memory_svg"] not in (None, first["memory_svg"]), "the memory panel did not change"
            bands = later["memory"] or ""
            assert "parameters" in bands, f"no watched trainer's bands in the memory panel: {bands!r}"
            assert "collective" in later["transfers"], (
                f"the trainer step's collectives are not among the transfers: {later['transfers']!r}"
            )

            (lab.root / STOP_FILE).write_text("")
            _wait_for_output(page, "loop done")
            final = look()
            assert final["count"] >= later["count"]
        finally:
            browser.close()
    assert screenshot.stat().st_size > 10_000
