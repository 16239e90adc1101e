"""What a launch plans before any process starts: on a machine without a GPU the ranks' devices
are simulated, so any count works, and a count past the machine's cores is warned of."""

import os
import warnings

import pytest

import mgkit as mg
from mgkit.launching import CoresWarning
from mgkit.launching._plan import plan
from tests.conftest import run_python


def work(rank, shared, private):
    return rank


def _plan(tmp_path, **given):
    args = dict(
        nprocs=None,
        shared=None,
        private=None,
        devices_per_process=1,
        distributed=False,
        timeout=None,
        grace=1.0,
        env=None,
        coordinator=None,
        timeouts=None,
        stall_after=None,
        on_stall="raise",
        stacks_dir=str(tmp_path),
    )
    return plan(work, **{**args, **given})


@pytest.mark.parametrize(
    ("nprocs", "per_process", "groups"),
    [
        (9, 1, [[f"cpu{r}"] for r in range(9)]),
        (
            3,
            4,
            [
                ["cpu0", "cpu1", "cpu2", "cpu3"],
                ["cpu4", "cpu5", "cpu6", "cpu7"],
                ["cpu8", "cpu9", "cpu10", "cpu11"],
            ],
        ),
        (2, 3, [["cpu0", "cpu1", "cpu2"], ["cpu3", "cpu4", "cpu5"]]),
    ],
)
def test_simulated_devices_past_the_cores_are_warned_of_never_refused(
    tmp_path, monkeypatch, nprocs, per_process, groups
):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    words = (
        rf"mg.launch: nprocs={nprocs} with devices_per_process={per_process} simulates "
        rf"{nprocs * per_process} CPU devices on 2 core\(s\); they share the cores"
    )
    with pytest.warns(CoresWarning, match=words) as caught:
        planned = _plan(tmp_path, nprocs=nprocs, devices_per_process=per_process)
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert planned.platform == "cpu" and planned.groups == groups
    assert [e["JAX_NUM_CPU_DEVICES"] for e in planned.envs] == [str(per_process)] * nprocs


def test_within_the_cores_there_is_no_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CoresWarning)
        planned = _plan(tmp_path, nprocs=2, devices_per_process=2)
    assert planned.groups == [["cpu0", "cpu1"], ["cpu2", "cpu3"]]


def test_the_readme_example_runs_in_a_fresh_kernel_on_two_cores():
    out = run_python(
        """
        import os, warnings
        os.cpu_count = lambda: 2  # a 2-core machine, whatever this one has
        import jax
        import mgkit as mg

        def fn(rank, shared, private):
            import jax
            return jax.local_device_count(), jax.device_count()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = mg.launch(fn, nprocs=2, devices_per_process=2, distributed=True, stream=False)
        print(res.values, [str(w.message)[:62] for w in caught if w.category is mg.launching.CoresWarning])
        """,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == (
        "[(2, 4), (2, 4)] ['mg.launch: nprocs=2 with devices_per_process=2 simulates 4 CPU']"
    )


def test_the_warning_class_is_public():
    assert mg.launching.CoresWarning is CoresWarning and issubclass(CoresWarning, UserWarning)
