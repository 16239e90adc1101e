"""``mgkit tour``: runs notebooks/00_tour.ipynb in a fresh kernel, prints what it did, and writes
the executed notebook (HTML and .ipynb) and PNG pictures of the dashboard under one folder.

The notebook runs in a kernel of this Python (the one mgkit is installed in), one cell at a time
behind a progress bar. After the last cell, ``report`` runs in the same kernel: it prints the
device map, the ledger summary and the throughput per context, and saves the pictures.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "00_tour.ipynb"
PICTURES = ("dashboard.png", "devices.png", "transfers.png", "throughput.png")
CELL_TIMEOUT = 600  # seconds one cell may run
STARTUP_TIMEOUT = 120  # seconds the kernel may take to start


class TourError(RuntimeError):
    """The tour could not run or could not write its files; the message says why and how to fix it."""


class TourResult(NamedTuple):
    """What ``run`` wrote and printed."""

    out: Path
    html: Path
    notebook: Path
    pictures: tuple[Path, ...]
    report: str
    seconds: float


def output_dir(text: str) -> Path:
    """The folder for the tour's files, created if missing; TourError when it cannot be written."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise TourError(
            f"--out {text!r} is a file, not a folder; give a folder for the tour's files "
            "(it is created if missing), e.g. --out mgkit-tour"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise TourError(
            f"--out {text!r}: cannot write there ({e.strerror or e}); give a folder you can write to, "
            "e.g. --out ./mgkit-tour"
        ) from None
    return path.resolve()


def notebook_path() -> Path:
    """The tour notebook in mgkit's source tree."""
    if not NOTEBOOK.is_file():
        raise TourError(
            f"the tour notebook {NOTEBOOK} is missing: `mgkit tour` runs notebooks/00_tour.ipynb from "
            "mgkit's source tree; install mgkit from a checkout with `pip install -e .`"
        )
    return NOTEBOOK


def report(out: str, dash: Any = None) -> None:
    """Prints the dashboard as text (device map, transfers, throughput per context from the step
    and run events) and the ledger summary, and writes the dashboard's pictures into ``out``.

    Runs in the tour's kernel after the last cell, so it reads that kernel's ledger. ``dash``:
    the notebook's own live dashboard, when it made one: the pictures then show what it saw while
    the cells ran (its memory samples over the whole tour); else a new one, from the ledger.
    """
    from ._ledger import ledger
    from .views import Dashboard

    own = not isinstance(dash, Dashboard) or dash.closed
    if own:
        dash = Dashboard(widget=False, live=False)
    views = (dash, dash.devices, dash.transfers, dash.throughput)
    for name, view in zip(PICTURES, views, strict=True):
        view.save_png(os.path.join(out, name))
    print(dash.header.text(), dash.devices.text(), dash.throughput.text(), sep="\n\n")
    print()
    print(_memory_span(dash.memory))
    print()
    print(ledger().summary())
    print()
    print(ledger().matrix())
    if own:
        dash.close()


def _memory_span(memory: Any) -> str:
    """How much memory history the dashboard's picture shows: samples and seconds per context."""
    rows = memory.rows()
    history = memory.history(rows[0].context) if rows else []
    seconds = history[-1].t - history[0].t if len(history) > 1 else 0.0
    return f"memory: {len(history)} samples per context over {seconds:.1f} s (the dashboard's picture)"


def _kernel_manager_class() -> type:
    """An AsyncKernelManager whose ``python3`` is this Python, whatever kernels are installed."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    class ThisPythonKernel(AsyncKernelManager):
        @default("kernel_spec_manager")
        def _kernel_spec_manager_default(self) -> KernelSpecManager:
            return KernelSpecManager(kernel_dirs=[], parent=self)

    return ThisPythonKernel


def _cell_error(nb: Any, index: int, error: Exception) -> TourError:
    """A one-paragraph account of a failed cell: its number, first line and the error."""
    source = nb.cells[index].source.strip().splitlines()
    first = source[0] if source else ""
    ename = getattr(error, "ename", type(error).__name__)
    evalue = getattr(error, "evalue", str(error))
    return TourError(f"the tour stopped in cell {index} ({first!r}): {ename}: {evalue}")


def _text_of(outputs: list) -> str:
    parts = []
    for out in outputs:
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


def _static_copy(nb: Any) -> Any:
    """A copy whose widget outputs show as their text, so the HTML reads without a network."""
    import copy

    static = copy.deepcopy(nb)
    static.metadata.pop("widgets", None)
    for cell in static.cells:
        for out in cell.get("outputs", []):
            data = out.get("data")
            if data and "application/vnd.jupyter.widget-view+json" in data:
                del data["application/vnd.jupyter.widget-view+json"]
    return static


def run(
    out: Path,
    progress: bool = True,
    env: dict[str, str] | None = None,
    echo: Callable[[str], None] = print,
) -> TourResult:
    """Runs the tour notebook in a fresh kernel and writes its files under ``out``.

    Args:
      out: an existing folder (see ``output_dir``).
      progress: show a progress bar over the cells (text, on stderr).
      env: the kernel's environment (default: this process's).
      echo: where the report's text goes, as it comes.

    Returns:
      A TourResult. Raises TourError when a cell fails or the kernel dies.
    """
    import time

    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    from nbconvert import HTMLExporter
    from tqdm import tqdm  # text: the tour runs in a terminal

    t0 = time.perf_counter()
    nb = nbformat.read(notebook_path(), as_version=4)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        startup_timeout=STARTUP_TIMEOUT,
        kernel_name="python3",
        kernel_manager_class=_kernel_manager_class(),
        resources={"metadata": {"path": str(out)}},
    )
    code = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"]
    report_cell = nbformat.v4.new_code_cell(  # with the notebook's own dashboard, where it made one
        f"import mgkit._tour\nmgkit._tour.report({str(out)!r}, globals().get('dash'))"
    )
    nb.cells.append(report_cell)  # taken out again before the notebook is written
    code.append(len(nb.cells) - 1)
    bar = tqdm(total=len(code), desc="mgkit tour", unit="cell", disable=not progress, file=sys.stderr)
    index = None
    # The kernel's own stderr (start-up notices, a crash's last words) goes to a log, shown on failure.
    with bar, tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:
        try:
            with client.setup_kernel(env=dict(os.environ if env is None else env), stderr=log):
                for index in code:
                    bar.set_postfix_str(nb.cells[index].source.strip().splitlines()[0][:40], refresh=False)
                    client.execute_cell(nb.cells[index], index)
                    bar.update()
        except (CellExecutionError, CellTimeoutError) as e:
            raise _cell_error(nb, index, e) from None
        except (DeadKernelError, RuntimeError) as e:  # the kernel died, or did not start
            where = "while starting" if index is None else f"in cell {index}"
            log.seek(0)
            tail = "".join(log.readlines()[-20:]).strip()
            raise TourError(
                f"the tour's kernel failed {where}: {e}" + (f"\nits last words:\n{tail}" if tail else "")
            ) from None
        finally:
            nb.cells.remove(report_cell)
    text = _text_of(report_cell.outputs)
    echo(text.rstrip("\n"))
    stem = notebook_path().stem
    notebook = out / f"{stem}.ipynb"
    html = out / f"{stem}.html"
    nbformat.write(nb, notebook)
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(_static_copy(nb))
    html.write_text(body, encoding="utf-8")
    pictures = tuple(out / name for name in PICTURES)
    return TourResult(out, html, notebook, pictures, text, time.perf_counter() - t0)
