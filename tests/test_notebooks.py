"""Every notebook in notebooks/ runs top to bottom on 8 simulated CPU devices, and none is
committed with outputs."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
# `mgkit tour` runs the tour notebook: tests/test_cli.py checks its outputs against the list below
RUN_HERE = [p for p in NOTEBOOKS if p.name != "00_tour.ipynb"]

# Text a notebook's outputs must contain once executed, by file name.
EXPECTED_OUTPUT = {
    "00_tour.ipynb": [
        "Mapped name dev7 to device",
        "context name 'dev0' appears more than once",
        "mgkit device map: 8 context(s)",
        "(live arrays)",
        "inside:  dev1 - z lives on dev1",
        "exact: True",
        "argument y of add (float32[1024,1024]) is on dev1",
        "a + b over 8 contexts: shape (1001, 100), exact: True",
        "split then concat, exact: True",
        "tanh(x @ w) over 8 contexts, equal to one device's result: True",
        "psum over 8 contexts: 28.0",
        "converged: True",
        "w lives on dev0+dev1+dev2+dev3+dev4+dev5+dev6+dev7",
        "logreg.fit (gd)",
        "gd: 3000 steps",
        "dev2: w on dev2",
        "ones lives on dev1 - the current context is dev1",
        "device->device 4.0 MiB",
        "mgkit ledger:",
        "bytes moved (row: from, column: to)",
        "mgkit throughput: 8 context(s) reporting",
        "compile excluded",
        "mgkit transfers:",
    ],
    "09_clusters.ipynb": [
        "2 rank(s) x 2 device(s), local launcher, one jax.distributed group; warm",
        "] process 1 of 2, 4 devices: dev0->cpu0;dev1->cpu1;dev2->cpu2;dev3->cpu3",
        "] data-parallel: loss 0.6931 ->",
        "] fsdp: loss 0.6931 ->",
        "compilations in the second fit, per rank: [0, 0]",
        "r1/dev3",
        "rank 1 (",
        "died (",
        "] resumed to step 40,",
    ],
    "10_why_not_faster.ipynb": [
        "step plan: 4 layout(s) compiled ahead of time from shapes, nothing allocated",
        "fastest that fits: 8 contexts, fsdp, accumulate",
        "shard='auto' chose fsdp: the fastest predicted that fits",
        "replicate: peak 5.0 MiB per context",
        "over the budget",
        "mgkit scaling:",
        "CPU devices sharing this host's",
    ],
    "01_contexts_and_transfers.ipynb": ["Mapped name dev0 to device cpu0"],
    "02_split_concat.ipynb": [
        "Mapped name d7 to device cpu7",
        "a + b on 4 contexts, exact: True",
        "1001 rows on 4 contexts, exact: True",
        "round trip exact: True",
        "{'d0': 50, 'd1': 17, 'd2': 17, 'd3': 16}",
        "gradients match",
        "fitted w = [5.000, 0.000, 3.000]",
        "ratio two / one:",
        "psum over 8 contexts: 28.0",
        "rows per context: {'d0': 750, 'd1': 250}",
        "mgkit ledger:",
    ],
    "03_logistic_regression.ipynb": [
        "Mapped name dev0 to device cpu0",
        "Initial model:",
        "Final model:",
        "dev0: D lives on dev0, its w on dev0, its b on dev0",
        "dev1: D lives on dev1, its w on dev1, its b on dev1",
        "dev0 target values for D:",
        "dev0 prediction on D:",
        "dev0 training accuracy: 1.000",
        "dev1 training accuracy: 1.000",
        "gd   -> gd   : iterations {'dev0': 10000, 'dev1': 10000}",
        "auto -> lbfgs: iterations",
        "same predictions: True",
        "Mapped name dev7 to device cpu7",
        "converged: True",
        "w (30,) lives on dev0+dev1+dev2+dev3+dev4+dev5+dev6+dev7",
        "coefficients match scikit-learn: True",
        "same test predictions: True",
        "same model on 1 and 8 contexts: True",
        "w (16, 64, 10)",
        "best l2 on digits:",
        "mgkit ledger:",
        "'what': 'logreg.fit_many (lbfgs)'",
    ],
    "04_training.ipynb": [
        "Mapped name dev7 to device cpu7",
        "1. split:     host -> 8 contexts, 16 of 128 rows, 704 B each",
        "4. gather:    7 contexts -> dev0, loss and gradients,",
        "6. copy back: dev0 -> 7 contexts, the new parameters,",
        "moves in the ledger: 22",
        "bytes moved (row: from, column: to)",
        "one SPMD program per step; step 20",
        "same parameters (atol 1e-6): True",
        "mgkit training history: 20 step(s) on 8 context(s)",
        "step 25 - parameters on dev0+dev1+dev2+dev3+dev4+dev5+dev6+dev7",
        "fitted coefficients within 0.01 of the true ones: True",
        "train: (1347, 64)  test: (450, 64)",
        "mgkit device map: 8 context(s)",
        "mgkit training history: 300 step(s) on 8 context(s)",
        "test accuracy on 8 contexts: 0.9",
        "mgkit throughput: 8 context(s) reporting",
        ", within 1e-5: True",
        "same test accuracy on 8 contexts and on 1 context (within 1%): True",
    ],
    "05_launch.ipynb": [
        "[rank 0] contexts dev0->cpu0, data seed 0, l2 = 0.01",
        "[rank 1] contexts dev0->cpu0, data seed 1, l2 = 0.1",
        "[rank 0] Initial model: w = ",
        "[rank 1] Initial model: w = ",
        "after 10000 steps",
        "mg.launch: 2 rank(s) done in",
        "Final model:",
        "rank 0 (l2 = 0.01): w = ",
        "rank 1 (l2 = 0.1): w = ",
        "rank 0 training accuracy: 1.000",
        "rank 1 training accuracy: 0.9",
        "converged: True",
        "[rank 1] process 1 of 2: holds [3. 4.]",
        "rank 0: psum over 2 processes x 2 devices: 10.0, mg.pmap: 10.0",
        "rank 1: psum over 2 processes x 2 devices: 10.0, mg.pmap: 10.0",
        "contexts dev0->cpu0;dev1->cpu1;dev2->cpu2;dev3->cpu3",
        ") raised ValueError: logreg.fit: l2=-0.1 is out of range",
        "rank 1 (pid ",
        "terminated after rank 1 failed",
        "traceback from rank 1:",
        "err.kind: raised",
        "err.rank: 1 - pid ",
        "err.done: [] - err.values: [None, None]",
        "states: ['terminated', 'failed']",
    ],
    "06_many_models.ipynb": [
        "Mapped name dev1 to device cpu1",
        "mgkit ensemble: 2 member(s)",
        "cnn test accuracy: 0.9",
        "mlp test accuracy: 0.9",
        "members equal training each alone, bit for bit: True",
        "mgkit ensemble schedule: 2 member(s) on 2 context(s), rounds 95..100",
        "a step of cnn  b step of mlp",
        "member 'mlp' on dev1 failed at step 20: FloatingPointError",
        "mlp kept the state of step 19 - cnn finished 40 steps",
        "M=1: loss 2.375589 vs one device 2.375589",
        "M=8: loss 2.375589 vs one device 2.375589",
        "16 stage transfers in the ledger: 8 activations, 8 gradients",
        "gradients live on ['dev0', 'dev1']",
        "optimizer state on ['dev0', 'dev1']",
        "pipeline test accuracy: 0.9",
        "2 stage(s) x 1 microbatch(es) (GPipe)",
        "0.50 ideal ((S-1)/(M+S-1))",
        "2 stage(s) x 8 microbatch(es) (GPipe)",
        "0.11 ideal ((S-1)/(M+S-1))",
        "F forward  B backward  U update",
        "mgkit ledger:",
    ],
    "07_big_models.ipynb": [
        "digits: (1797, 64) - limit per context: 256.0 MiB",
        "does NOT fit",
        "fits on one context: False",
        "Trainer: the training state does not fit: dev0 needs 297.2 MiB",
        "pass shard='fsdp'",
        "shard='fsdp' over 8 context(s): at most 37.1 MiB per context; fits",
        "mgkit training history: 4 step(s) on 8 context(s)",
        "split 8 x 1 (dim 0 over 'mgkit')",
        "every context within its limit: True",
        "1 update from a batch of 64 rows in 4 microbatches",
        "precision='bf16' on CPU",
        "parameters stay float32: {'float32'}",
        "training accuracy after 7 steps: 0.",
    ],
    "08_seeing_inside.ipynb": [
        "Trainer step: 4.3 MiB in 1 collective(s) per step",
        "all-reduce ",
        "arithmetic intensity",
        "all-gather ",
        "collectives inside compiled programs:",
        "mgkit's moves alone: mgkit transfers: 80 (650.0 KiB moved",
        "mgkit memory: 8 context(s), the last 300 s kept",
        "context  device  in use    peak      limit    source       parameters  optimizer state  batch",
        "Trainer.fit: a device ran out of memory (RESOURCE_EXHAUSTED",
        "the failing program needed: 2.0 TiB per device",
        "(placed by mg.put in In [",
        'fixes that apply: shard="fsdp"',
        "Trainer: the training state does not fit: dev0 needs 3.0 GiB (parameters 1.0 GiB",
        "  dev1: 1.0 GiB + 2.0 GiB + 0 B = 3.0 GiB / 1.0 GiB",
        " s captured; trace kept at",
        "mgkit profile: steps 11..20 on 8 context(s)",
        "context  compute  communication  transfers  idle",
    ],
}


def output_text(nb: nbformat.NotebookNode) -> str:
    """All text the executed cells printed or displayed."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out.get("text", ""))
            elif "data" in out:
                parts.append(out["data"].get("text/plain", ""))
            elif out.get("output_type") == "error":
                parts.extend(out.get("traceback", []))
    return "\n".join(parts)


def test_notebooks_exist():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOKS_DIR}"


@pytest.mark.slow
@pytest.mark.parametrize("path", RUN_HERE, ids=[p.name for p in RUN_HERE])
def test_notebook_runs(path, monkeypatch, tmp_path):
    monkeypatch.setenv("MGKIT_SIMULATE", "8")  # the kernel inherits the test's environment
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # what a notebook keeps in temp (a profile's trace) goes too
    monkeypatch.delenv("MGKIT_CONTEXTS", raising=False)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=300,
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    client.execute()  # a failing cell raises CellExecutionError, naming the cell and the error
    text = output_text(nb)
    for expected in EXPECTED_OUTPUT.get(path.name, []):
        assert expected in text, f"{path.name}: expected {expected!r} in the outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, (
        f"{path.name}: code cells {dirty} have outputs or execution counts; clear them before "
        "committing (e.g. jupyter nbconvert --clear-output --inplace)"
    )
