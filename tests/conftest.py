"""Every test runs with 8 simulated CPU devices; a test that needs another count uses a subprocess.

On a machine with an accelerator the tests still see only the CPU (the suite is written for the
simulated devices that CI has); GPU figures come from benchmarks/. Set MGKIT_TEST_ACCELERATORS=1
to let JAX see the accelerators as well (tests that assume a CPU-only machine then fail).
"""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

if os.environ.get("MGKIT_TEST_ACCELERATORS") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.pop("MGKIT_CONTEXTS", None)
os.environ["MGKIT_SIMULATE"] = "8"

import jax

jax.config.update("jax_num_cpu_devices", 8)

# A test run started in the background by a non-interactive shell (`cmd &`, nohup, some CI
# runners) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler: Ctrl-C
# would do nothing here and in the processes the tests start. The Ctrl-C tests need the handler
# (a handler set here is not inherited across exec: children start with SIGINT's default).
signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402

import mgkit as mg  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_contexts():
    """Each test starts with dev0..dev7 -> cpu0..cpu7, an empty ledger and no scope."""
    mg.use_contexts(";".join(f"dev{i}->cpu{i}" for i in range(8)), verbose=False)
    mg.ledger().clear()
    yield
    mg.ledger().flush()


def run_python(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs code in a fresh Python process (for device counts and start-up order)."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("MGKIT_SIMULATE", "XLA_FLAGS")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


@contextlib.contextmanager
def ipython_shell():
    """A fresh IPython shell (history in memory, nothing of the user's read), cleared after: the
    magics' tests run their cells in it."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    try:
        yield InteractiveShell.instance(config=config)
    finally:
        InteractiveShell.clear_instance()
