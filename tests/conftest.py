"""Every test runs with 8 simulated CPU devices; a test that needs another count uses a subprocess.

On a machine with an accelerator the tests still see only the CPU (the suite is written for the
simulated devices that CI has); GPU figures come from benchmarks/. Set MGKIT_TEST_ACCELERATORS=1
to let JAX see the accelerators as well (tests that assume a CPU-only machine then fail).
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

if os.environ.get("MGKIT_TEST_ACCELERATORS") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.pop("MGKIT_CONTEXTS", None)
os.environ["MGKIT_SIMULATE"] = "8"

# XLA's CPU compiler takes most of the suite's time (3 s for a solver's loop on CI's two cores).
# Unoptimised and without its newer fusion emitters it compiles the suite's small programs three
# times as fast (the suite took 30 minutes without, 17 with); the tests check what programs
# compute, not how XLA builds them (a test of compile times uses the defaults:
# ``default_compiler``). An XLA without these flags aborts on them, so a child process tries
# them first (once: xdist's workers inherit the result).
# Codegen in one piece: split for threads, it only adds work where the two test workers already
# take both cores (15 % less compile time).
FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
    "--xla_cpu_parallel_codegen_split_count=1"
)
if os.environ.get("MGKIT_TEST_FAST_COMPILE") is None:
    os.environ["MGKIT_TEST_FAST_COMPILE"] = "0"
    for _fast in (FAST_COMPILE, " ".join(FAST_COMPILE.split()[:2])):  # an older XLA: the first two
        _flags = f"{os.environ.get('XLA_FLAGS', '')} {_fast}".strip()
        _probe = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices('cpu')"],
            env={**os.environ, "XLA_FLAGS": _flags, "JAX_PLATFORMS": "cpu"},
            capture_output=True,
            timeout=120,
        )
        if _probe.returncode == 0:
            os.environ["MGKIT_TEST_FAST_COMPILE"], os.environ["XLA_FLAGS"] = _fast, _flags
            break
FAST_COMPILE = os.environ["MGKIT_TEST_FAST_COMPILE"] if os.environ["MGKIT_TEST_FAST_COMPILE"] != "0" else ""

# Every process of a run loads a program compiled earlier in the run instead of compiling it
# again (the fresh processes the tests start -- notebooks, launched ranks, engines -- compile the
# same programs): JAX's persistent cache, in a folder of this run's own, removed at its end.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mgkit-tests-xla-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
    os.environ["MGKIT_TEST_XLA_CACHE_OWNER"] = str(os.getpid())

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# A test run started in the background by a non-interactive shell (`cmd &`, nohup, some CI
# runners) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler: Ctrl-C
# would do nothing here and in the processes the tests start. The Ctrl-C tests need the handler
# (a handler set here is not inherited across exec: children start with SIGINT's default).
signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402

import mgkit as mg  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("MGKIT_TEST_XLA_CACHE_OWNER") == str(os.getpid()):  # the run's first process
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_contexts():
    """Each test starts with dev0..dev7 -> cpu0..cpu7, an empty ledger and no scope."""
    mg.use_contexts(";".join(f"dev{i}->cpu{i}" for i in range(8)), verbose=False)
    mg.ledger().clear()
    yield
    mg.ledger().flush()


def child_env(*drop: str) -> dict[str, str]:
    """The tests' environment for a fresh process that picks its own devices: without
    ``MGKIT_SIMULATE`` (nor ``drop``), and with no XLA flag but the tests' compile flag."""
    env = {k: v for k, v in os.environ.items() if k not in ("MGKIT_SIMULATE", "XLA_FLAGS", *drop)}
    if FAST_COMPILE:
        env["XLA_FLAGS"] = FAST_COMPILE
    return env


@contextlib.contextmanager
def default_compiler():
    """Processes started inside compile with XLA's default flags (for a test of compile times)."""
    kept = os.environ.get("XLA_FLAGS")
    flags = " ".join(f for f in (kept or "").split() if f not in FAST_COMPILE.split())
    if flags:
        os.environ["XLA_FLAGS"] = flags
    else:
        os.environ.pop("XLA_FLAGS", None)
    try:
        yield
    finally:
        if kept is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = kept


def run_python(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs code in a fresh Python process (for device counts and start-up order)."""
    full_env = child_env()
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
