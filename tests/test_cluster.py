"""mg.Cluster on ipyparallel with local engines (everything on 127.0.0.1): warm ranks in one
jax.distributed group, %%mgkit_all cells whose names persist per rank, the same answer as one
process, errors and a killed rank as one LaunchError, restart, close with nothing left behind,
loopback only, and the bad input."""

import ipaddress
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import psutil
import pytest

import mgkit as mg
from tests.conftest import default_compiler, ipython_shell

pytest.importorskip("ipyparallel")
pytestmark = pytest.mark.slow

_DATA_CODE = """
import numpy as np, optax, jax.numpy as jnp, mgkit as mg
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype(np.float32)
y = (x[:, 0] - x[:, 3] > 0).astype(np.float32)
data = {"x": x, "y": y}
def loss(p, b):
    return optax.sigmoid_binary_cross_entropy(b["x"] @ p["w"] + p["b"], b["y"]).mean()
"""


def _ours() -> set[int]:
    """Processes of the cluster machinery this test process started (controller, engines)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "ipyparallel" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except psutil.Error:
            continue
    return out


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, a dual-stack socket's view
    return (mapped or address).is_loopback


@pytest.fixture
def shell():
    with ipython_shell() as ip:
        ip.run_line_magic("load_ext", "mgkit")
        yield ip


@pytest.fixture(scope="module")
def cluster():
    before = _ours()
    with default_compiler():  # the warm-ranks test times the first compile as users see it
        c = mg.Cluster(engines=2, devices_per_engine=2)
    try:
        yield c
    finally:
        c.close()
        deadline = time.monotonic() + 10
        while _ours() - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _ours() - before, "the cluster left processes behind"


def test_a_cluster_of_warm_ranks_in_one_group(cluster, capsys):
    assert [r.devices for r in cluster.ranks] == [("cpu0", "cpu1"), ("cpu2", "cpu3")]
    text = repr(cluster)
    assert "2 rank(s) x 2 device(s), local launcher, one jax.distributed group; warm" in text
    for r in cluster.ranks:
        assert f"{r.pid}" in text and psutil.pid_exists(r.pid)

    def where(rank, shared, private):

        import mgkit as mg

        print(f"rank {rank} of {jax.process_count()} here")
        return rank + shared, private, str(mg.context_map()), jax.device_count()

    capsys.readouterr()
    values = cluster.run(where, shared=10, private=["a", "b"])
    everyone = "dev0->cpu0;dev1->cpu1;dev2->cpu2;dev3->cpu3"
    assert values == [(10, "a", everyone, 4), (11, "b", everyone, 4)]
    out = capsys.readouterr().out
    assert "[rank 0@" in out and "] rank 0 of 2 here" in out and "] rank 1 of 2 here" in out


def test_cells_keep_their_names_per_rank_and_a_second_step_compiles_nothing(cluster, shell, capsys):
    run = shell.run_cell_magic
    run(
        "mgkit_all",
        "",
        _DATA_CODE + "tr = mg.Trainer(loss, optax.adam(1e-2), {'w': jnp.zeros(8), 'b': jnp.zeros(())})",
    )
    t0 = time.perf_counter()
    run("mgkit_all", "", "h = tr.fit(data, steps=1, batch_size=64, progress=False)")
    first = time.perf_counter() - t0
    compiled = cluster.compilations()
    t0 = time.perf_counter()
    run("mgkit_all", "", "h = tr.fit(data, steps=1, batch_size=64, progress=False)\nprint('step', tr.step)")
    second = time.perf_counter() - t0
    assert cluster.compilations() == compiled  # warm: nothing compiled again
    assert second < 0.1 * first, (first, second)
    out = capsys.readouterr().out
    assert "] step 2" in out and out.count("] step 2") == 2


def test_a_trainer_across_the_ranks_equals_one_process(cluster):
    def train(rank, shared, private):
        import jax.numpy as jnp
        import numpy as np
        import optax

        import mgkit as mg

        namespace = {}
        exec(shared, namespace)  # the data and loss, as the cell defines them
        out = []
        for shard in (None, "fsdp"):
            tr = mg.Trainer(
                namespace["loss"], optax.adam(1e-2), {"w": jnp.zeros(8), "b": jnp.zeros(())}, shard=shard
            )
            out.append(np.asarray(tr.fit(namespace["data"], steps=5, batch_size=64, progress=False).loss))
        return out

    ranks = cluster.run(train, shared=_DATA_CODE)
    mg.use_contexts(";".join(f"dev{i}->cpu{i}" for i in range(4)), verbose=False)
    namespace = {}
    exec(_DATA_CODE, namespace)
    for k, shard in enumerate((None, "fsdp")):
        tr = mg.Trainer(
            namespace["loss"], optax.adam(1e-2), {"w": jnp.zeros(8), "b": jnp.zeros(())}, shard=shard
        )
        one = np.asarray(tr.fit(namespace["data"], steps=5, batch_size=64, progress=False).loss)
        for losses in ranks:
            np.testing.assert_allclose(losses[k], one, rtol=1e-5)


def test_pmap_and_a_data_parallel_logreg_across_the_ranks_equal_one_process(cluster):
    # defined here, so it travels by value (the test module would set up 8 devices on import)
    def _pmap_and_logreg(rank, shared, private):
        import jax
        import numpy as np

        import mgkit as mg

        x = np.arange(12.0, dtype=np.float32).reshape(4, 3)
        total = mg.pmap(lambda v: jax.lax.psum(v * v, "i"), out_axes=None)(x)
        rng = np.random.default_rng(0)
        X = rng.normal(size=(400, 5)).astype(np.float32)
        y = (X[:, 0] - 0.5 * X[:, 2] > 0).astype(np.int32)
        model = mg.logreg.fit(X, y, l2=1e-2)
        return np.asarray(total.addressable_data(0)), np.asarray(model.w), np.asarray(model.b)

    ranks = cluster.run(_pmap_and_logreg)
    mg.use_contexts(";".join(f"dev{i}->cpu{i}" for i in range(4)), verbose=False)
    one = _pmap_and_logreg(0, None, None)
    for values in ranks:
        for got, want in zip(values, one, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_an_exception_in_one_rank_is_one_launch_error_and_the_cluster_stays_warm(cluster, shell):
    code = "import os\nif int(os.environ['MGKIT_RANK']) == 1:\n    raise ValueError('bad row 7')\nok = True"
    with pytest.raises(mg.LaunchError) as info:
        cluster.run_cell(code)
    err = info.value
    assert err.rank == 1 and err.kind == "raised" and err.exception_type == "ValueError"
    text = str(err)
    assert "rank 1 (" in text and f"pid {cluster.ranks[1].pid}" in text and "bad row 7" in text
    assert "raise ValueError('bad row 7')" in text  # the cell's own line in the traceback
    assert "rank 0 (pid" in text  # every rank's fate

    def fine(rank, shared, private):
        return rank

    assert cluster.run(fine) == [0, 1]
    # the other rank still running: stopped (SIGINT) a second after, the error at once
    busy = "import os, time\n" + code.replace("ok = True", "for i in range(3000):\n    time.sleep(0.01)")
    t0 = time.monotonic()
    with pytest.raises(mg.LaunchError, match=r"rank 1 .* bad row 7 \(the cluster stays warm\)") as info:
        cluster.run_cell(busy)
    assert time.monotonic() - t0 < 1.0 + 2.0 + 2.0
    assert re.search(
        r"rank 0 \(pid \d+, .*\): stopped after rank 1 raised \(KeyboardInterrupt\)", str(info.value)
    )
    assert [r.state for r in cluster.ranks] == ["stopped", "raised"]
    assert cluster.run(fine) == [0, 1]


def test_every_ranks_ledger_reaches_the_kernels_named_by_rank(cluster):
    led = mg.ledger()
    led.clear()
    sent = list(cluster.streams.messages)
    t0 = time.monotonic()
    cluster.run_cell(
        _DATA_CODE
        + "tr = mg.Trainer(loss, optax.sgd(0.1), {'w': jnp.zeros(8), 'b': jnp.zeros(())})\n"
        + "tr.fit(data, steps=30, batch_size=64, progress=False)\n"
        + "a = mg.transfer(mg.put(np.ones(100), 'dev0'), 'dev1')"
    )
    seconds = time.monotonic() - t0
    counts = {}
    for e in led.records():
        counts[(e.kind, e.src.split("/")[0])] = counts.get((e.kind, e.src.split("/")[0]), 0) + 1
    for rank in ("r0", "r1"):  # every event of both ranks: 30 steps on 4 contexts, and the moves
        assert counts[("step", rank)] == 120 and counts[("split", rank)] == 120, counts
        assert counts[("collective", rank)] >= 30 and counts[("transfer", rank)] == 1, counts
    assert cluster.streams.dropped == [0, 0]
    sent = [b - a for a, b in zip(sent, cluster.streams.messages, strict=True)]
    assert all(0 < m <= 10 * seconds + 2 for m in sent), (sent, seconds)  # at most 10 a second
    text = mg.Dashboard(widget=False).text()
    assert "r1/dev3" in text and "r0/dev0" in text  # the transfers and throughput panels
    cluster.stream(False)
    try:
        before = len(led.records())
        cluster.run_cell("a = mg.transfer(a, 'dev0')")
        assert len(led.records()) == before  # nothing sent
    finally:
        cluster.stream(True)


def test_ctrl_c_stops_the_cell_on_every_rank_and_the_cluster_stays_warm(cluster, capsys):
    import _thread

    threading.Timer(1.0, _thread.interrupt_main).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        cluster.run_cell("import time\nfor i in range(3000):\n    time.sleep(0.01)")
    assert time.monotonic() - t0 < 1.0 + 2.5
    cluster.run_cell("print('stopped at', i)")  # the names the cell made so far are kept
    out = capsys.readouterr().out
    stops = [int(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "stopped at" in line]
    assert len(stops) == 2 and all(0 < i < 2999 for i in stops), out


def test_ctrl_c_stops_a_distributed_fit_at_one_step_on_every_rank_and_it_goes_on(cluster, tmp_path):
    import _thread

    code = _CHECKPOINTED.replace("FOLDER", "None").replace("0.03", "0.05")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    cluster.run_cell(code + "tr.fit(batches, steps=40, progress=False)\n" + _save(whole))
    cluster.run_cell(code)
    pressed = []

    def ctrl_c():
        pressed.append(time.monotonic())
        _thread.interrupt_main()

    threading.Timer(2.0, ctrl_c).start()
    with pytest.raises(KeyboardInterrupt) as info:
        cluster.run_cell("tr.fit(batches, steps=300, progress=False)")
    assert time.monotonic() - pressed[0] < 2.0 + 1.5  # the ranks stop within 2 s (and a loaded machine)
    text = str(info.value)
    stops = re.findall(r"rank \d \(.*\): KeyboardInterrupt: Trainer\.fit stopped at step (\d+)", text)
    assert len(stops) == 2 and stops[0] == stops[1], text  # one step boundary, on every rank
    k = int(stops[0])
    assert 0 < k < 40, k
    assert [r.state for r in cluster.ranks] == ["ready", "ready"]
    # warm: the next cell runs, its steps' collectives too, from the state each rank kept
    cluster.run_cell(f"tr.fit(batches, steps={40 - k}, progress=False)\n" + _save(cut))
    for rank in (0, 1):
        np.testing.assert_array_equal(np.load(cut / f"{rank}.npy"), np.load(whole / f"{rank}.npy"))


def test_a_stalled_rank_is_reported_with_every_ranks_stacks(cluster):
    stacks = cluster.stacks()  # on demand, between cells
    assert sorted(stacks) == [0, 1] and all("File " in text for text in stacks.values()), stacks
    hang = _CHECKPOINTED.replace("FOLDER", "None").replace(
        "time.sleep(0.03)", "time.sleep(4 if step == 8 else 0.01)"
    )
    cluster.run_cell(hang)
    before = cluster.stall_after
    cluster.stall_after = 1.0
    try:
        with pytest.warns(mg.StallWarning) as caught:  # on_stall="warn": reported, the call goes on
            cluster.run_cell("tr.fit(batches, steps=12, progress=False)")
    finally:
        cluster.stall_after = before
    text = str(caught[0].message)
    assert re.search(
        r"rank \d \(.*\) stalled: no heartbeat for [\d.]+ s \(limit 1\.0 s; last completed step 7\)", text
    )
    assert "Python stacks of rank 0" in text and "Python stacks of rank 1" in text and "in batches" in text, (
        text
    )
    assert [r.state for r in cluster.ranks] == ["ready", "ready"]


def test_what_cannot_be_sent_is_named(cluster):
    lock = threading.Lock()

    def uses_a_lock(rank, shared, private):
        return lock.locked()

    with pytest.raises(TypeError, match=r"Cluster\.run cannot send .*lock"):
        cluster.run(uses_a_lock)
    with pytest.raises(TypeError, match=r"takes \(rank, shared, private\)|three positional"):
        cluster.run(lambda: 1)
    with pytest.raises(ValueError, match=r"one entry per rank \(2\)"):
        cluster.run(lambda r, s, p: r, private=[1])


def test_the_cluster_listens_on_loopback_only_and_its_files_are_private(cluster):
    pids = _ours()
    assert len(pids) >= 3  # the controller and two engines
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="inet"):
            for address in (conn.laddr, conn.raddr):
                if address:
                    assert _loopback(address.ip), (pid, conn)  # listening or connected: loopback only
    folder = os.path.dirname(cluster._engines.connection_file)
    for name in os.listdir(folder):
        mode = stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode)
        assert mode & 0o077 == 0, (name, oct(mode))


_CHECKPOINTED = """
import os, time, numpy as np, optax, jax.numpy as jnp, mgkit as mg
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype(np.float32)
y = (x[:, 0] > 0).astype(np.float32)
def loss(p, b):
    return optax.sigmoid_binary_cross_entropy(b["x"] @ p["w"] + p["b"], b["y"]).mean()
def batches(step):
    time.sleep(0.03)
    i = (step * 64) % 512
    return {"x": x[i : i + 64], "y": y[i : i + 64]}
tr = mg.Trainer(loss, optax.adam(1e-2), {"w": jnp.zeros(8), "b": jnp.zeros(())}, checkpoint=FOLDER, every=5)
"""


def _save(folder) -> str:
    """A cell's line saving each rank's trained weights in ``folder`` as <rank>.npy."""
    out = repr(str(folder))
    return (
        f"os.makedirs({out}, exist_ok=True)\n"
        f"np.save(os.path.join({out}, f\"{{os.environ['MGKIT_RANK']}}.npy\"), np.asarray(tr.params['w']))\n"
    )


def _a_trainer_whose_rank_died_resumes_bit_for_bit(c, tmp_path):
    whole = _CHECKPOINTED.replace("FOLDER", repr(str(tmp_path / "whole")))
    c.run_cell(whole + "tr.fit(batches, steps=40, progress=False)\n" + _save(tmp_path / "whole-out"))
    cut = _CHECKPOINTED.replace("FOLDER", repr(str(tmp_path / "cut")))
    c.run_cell(cut)
    folder = tmp_path / "cut"

    def kill_after_a_checkpoint(pid=c.ranks[1].pid):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir()):
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.02)

    threading.Thread(target=kill_after_a_checkpoint, daemon=True).start()
    with pytest.raises(mg.LaunchError, match=r"rank 1 .* died"):
        c.run_cell("tr.fit(batches, steps=40, progress=False)")
    saved = sorted(int(p.name) for p in (tmp_path / "cut").iterdir() if p.name.isdigit())
    assert saved and saved[-1] < 40, saved  # it died part way, after a checkpoint
    c.restart()
    steps = tmp_path / "cut-out" / "steps"
    resume = "h = tr.fit(batches, steps=40, progress=False, resume=True)\n"
    resume += f"open({str(steps)!r}, 'w').write(str(len(h.loss)))\n"
    (tmp_path / "cut-out").mkdir()
    c.run_cell(cut + resume + _save(tmp_path / "cut-out"))
    assert int(steps.read_text()) == 40 - saved[-1]  # resumed from the last checkpoint, not from 0
    for rank in (0, 1):
        np.testing.assert_array_equal(
            np.load(tmp_path / f"cut-out/{rank}.npy"), np.load(tmp_path / f"whole-out/{rank}.npy")
        )


def _a_preempted_rank_saves_its_step_and_the_run_resumes_bit_for_bit(c, tmp_path):
    """SIGTERM to one rank: every rank stops at one step boundary and saves it, the preempted
    rank exits, the cell says which rank and step; after c.restart() the run resumes from that
    step and ends as an uninterrupted one (``whole-out``, written before)."""
    folder, mark = tmp_path / "preempted", tmp_path / "fitting"
    code = _CHECKPOINTED.replace("FOLDER", repr(str(folder))).replace("every=5", "every=1000")
    code = code.replace("time.sleep(0.03)", f"time.sleep(0.03)\n    step == 5 and open({str(mark)!r}, 'w')")
    c.run_cell(code)
    victim = c.ranks[1].pid

    def preempt() -> None:  # once the fit runs (a fixed delay can miss a fit compiled fast)
        deadline = time.monotonic() + 60
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(victim, signal.SIGTERM)

    threading.Thread(target=preempt, daemon=True).start()
    with pytest.raises(mg.LaunchError) as info:
        c.run_cell("tr.fit(batches, steps=40, progress=False)")
    text = str(info.value)
    found = re.search(
        r"rank 1 \(.*pid \d+\) was preempted \(SIGTERM\): every rank stopped at step (\d+)", text
    )
    assert found and f"step {found.group(1)} is saved in '{folder}'" in text and "c.restart()" in text, text
    step = int(found.group(1))
    assert info.value.rank == 1 and "PreemptedError" in text and "rank 0" in text
    assert 0 < step < 40 and [int(p.name) for p in folder.iterdir() if p.name.isdigit()] == [step]
    deadline = time.monotonic() + 5
    while _running(victim) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(victim)  # a preempted rank goes, as told
    with pytest.raises(RuntimeError, match=r"rank 1 .* was preempted .*c\.restart\(\)"):
        c.run(lambda r, s, p: r)
    c.restart()
    steps = tmp_path / "preempted-out" / "steps"
    resume = "h = tr.fit(batches, steps=40, progress=False, resume=True)\n"
    resume += f"open({str(steps)!r}, 'w').write(str(len(h.loss)))\n"
    steps.parent.mkdir()
    c.run_cell(code + resume + _save(tmp_path / "preempted-out"))
    assert int(steps.read_text()) == 40 - step
    for rank in (0, 1):
        np.testing.assert_array_equal(
            np.load(tmp_path / f"preempted-out/{rank}.npy"), np.load(tmp_path / f"whole-out/{rank}.npy")
        )


def test_a_killed_rank_ends_the_call_within_seconds_and_restart_brings_the_cluster_back(tmp_path):
    before = _ours()
    c = mg.Cluster(engines=2, devices_per_engine=1)
    try:

        def spin(rank, shared, private):
            import time

            import jax
            import jax.numpy as jnp

            total = jax.jit(lambda a: a.sum())
            while True:  # in a loop of steps, as training is
                total(jnp.ones(4)).block_until_ready()
                time.sleep(0.01)

        victim = c.ranks[1].pid
        threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(mg.LaunchError) as info:
            c.run(spin)
        assert time.monotonic() - t0 < 1.0 + 5.0
        text = str(info.value)
        assert "rank 1" in text and "SIGKILL" in text and "restart" in text
        assert info.value.rank == 1 and info.value.kind == "signal"
        with pytest.raises(RuntimeError, match=r"rank 1 .* died .*c\.restart\(\)"):
            c.run(lambda r, s, p: r)
        assert "died" in repr(c)
        c.restart()
        assert c.run(lambda r, s, p: r * 10) == [0, 10] and victim not in {r.pid for r in c.ranks}
        _a_trainer_whose_rank_died_resumes_bit_for_bit(c, tmp_path)
        _a_preempted_rank_saves_its_step_and_the_run_resumes_bit_for_bit(c, tmp_path)
        # a rank raised while the other waits for it in a collective: that one is stopped
        stuck = (
            "import os\nfrom jax.experimental import multihost_utils\nif os.environ['MGKIT_RANK'] == '0':\n"
        )
        stuck += "    raise ValueError('bad row 8')\nmultihost_utils.sync_global_devices('never')\n"
        t0 = time.monotonic()
        with pytest.raises(
            mg.LaunchError, match=r"rank 0 .* bad row 8; the ranks waiting .* c\.restart"
        ) as info:
            c.run_cell(stuck)
        assert time.monotonic() - t0 < 1.0 + 2.0 + 5.0
        text = str(info.value)
        where = (
            r"rank 1 \(pid \d+, .*\): waited for rank 0 where no signal reaches \(a collective, in <module>"
        )
        assert re.search(where + r" \(the cell's line 5\)\)", text), text
        assert "Python stacks of rank 1" in text and "Python stacks of rank 0" not in text
        with pytest.raises(RuntimeError, match=r"rank 0 raised .* c\.restart\(\)"):
            c.run(lambda r, s, p: r)
        c.restart()
        c.stall_after, c.on_stall = 1.0, "raise"  # a stall ends the call, its ranks stopped
        hang = _CHECKPOINTED.replace("FOLDER", "None").replace(
            "time.sleep(0.03)", "time.sleep(60 if step == 5 else 0)"
        )
        t0 = time.monotonic()
        with pytest.raises(mg.LaunchError, match=r"stalled: no heartbeat .*limit 1\.0 s") as info:
            c.run_cell(hang + "tr.fit(batches, steps=10, progress=False)")
        assert time.monotonic() - t0 < 30 and info.value.kind == "stalled"
        assert "Python stacks of rank 0" in str(info.value) and "c.restart()" in str(info.value)
        with pytest.raises(RuntimeError, match=r"stalled"):
            c.run(lambda r, s, p: r)
    finally:
        c.close()
    deadline = time.monotonic() + 10
    while _ours() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _ours() - before
    with pytest.raises(RuntimeError, match=r"the cluster is closed; make a new one"):
        c.run(lambda r, s, p: r)
    assert "closed" in repr(c)


def test_a_dying_kernel_leaves_no_engine_or_controller_behind(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(
        "import os, sys, time\n"
        "import mgkit as mg\n"
        "c = mg.Cluster(engines=2)\n"
        "pids = [r.pid for r in c.ranks] + c._engines.started() + [c._guard.pid]\n"
        "print(c._engines.folder, ' '.join(map(str, pids)), flush=True)\n"
        "time.sleep(600)\n"
    )
    kernel = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = kernel.stdout.readline()
        folder, *pids = line.split()
        pids = [int(p) for p in pids]
        assert os.path.isdir(folder), line
        assert len(pids) == 4 and all(psutil.pid_exists(p) for p in pids), line
        kernel.kill()  # SIGKILL: no atexit, nothing of the kernel's own runs
        kernel.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_running(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if _running(p)], [p for p in pids if _running(p)]
        deadline = time.monotonic() + 5
        while os.path.exists(folder) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(folder)  # its profile folder (connection files) too
    finally:
        kernel.kill()
        kernel.wait()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_bad_arguments_are_clear_and_start_nothing(tmp_path, shell, monkeypatch):
    before = _ours()
    for kwargs, error, words in (
        ({"engines": 0}, ValueError, r"engines"),
        ({"engines": 1.5}, TypeError, r"engines"),
        ({"devices_per_engine": 0}, ValueError, r"devices_per_engine"),
        ({"launcher": "ray"}, ValueError, r"launcher='ray'.*'local', 'mpi', 'slurm', 'pbs'"),
        ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, ValueError, r"CUDA_VISIBLE_DEVICES"),
        ({"env": {"A": 1}}, TypeError, r"env must be a dict of strings"),
        ({"distributed": "yes"}, TypeError, r"distributed must be True or False"),
    ):
        with pytest.raises(error, match=words):
            mg.Cluster(**kwargs)
    with pytest.raises(FileNotFoundError, match=r"does not exist.*ipcontroller-client\.json"):
        mg.Cluster.connect(tmp_path / "nope.json")
    with pytest.raises(TypeError, match=r"connection_file must be a path"):
        mg.Cluster.connect(3)
    assert not _ours() - before
    monkeypatch.setattr(mg.cluster, "current", lambda: None)  # no cluster open
    result = shell.run_cell("%%mgkit_all\nx = 1\n")
    assert "no cluster is open" in str(result.error_in_exec)
    result = shell.run_cell("%%mgkit_all now\nx = 1\n")
    assert "takes no arguments" in str(result.error_in_exec)


@pytest.mark.parametrize(
    ("launcher", "words"),
    [
        ("mpi", r"mpiexec -n 16 .*-m ipyparallel\.engine"),
        ("slurm", r"#SBATCH --ntasks=16(.|\n)*srun .*-m ipyparallel\.engine"),
        ("pbs", r"#PBS -t 1-16(.|\n)*-m ipyparallel\.engine"),
    ],
)
def test_batch_launchers_scripts_are_generated_not_run(launcher, words):
    before = _ours()
    text = mg.Cluster.script(16, launcher, devices_per_engine=2)
    assert __import__("re").search(words, text), text
    assert not _ours() - before
    with pytest.raises(ValueError, match=r"scripts are for 'mpi', 'slurm' or 'pbs'"):
        mg.Cluster.script(2, "local")


def test_on_gpus_each_engine_takes_its_own_cuda_devices_by_its_place_on_its_host(monkeypatch, tmp_path):
    from mgkit.cluster import _engines

    monkeypatch.setattr(_engines, "gpu_ids", lambda: ["0", "1", "2", "3"])
    groups = _engines.device_groups(["a", "a", "b", "a"], 1)
    assert groups == [("gpu", ["0"]), ("gpu", ["1"]), ("gpu", ["0"]), ("gpu", ["2"])]
    assert _engines.device_groups(["a", "a"], 2) == [("gpu", ["0", "1"]), ("gpu", ["2", "3"])]
    before = _ours()
    with pytest.raises(ValueError, match=r"needs 6 GPUs, and this machine has 4 \(CUDA ids 0, 1, 2, 3\)"):
        mg.Cluster(engines=2, devices_per_engine=3)  # more devices per engine than exist
    assert not _ours() - before  # refused before anything started
    monkeypatch.setattr(_engines, "gpu_ids", lambda: ["4", "6"])  # CUDA_VISIBLE_DEVICES=4,6 here
    assert _engines.device_groups(["a", "a"], 1) == [("gpu", ["4"]), ("gpu", ["6"])]
    monkeypatch.setattr(_engines, "gpu_ids", lambda: [])
    assert _engines.device_groups(["a", "a"], 2) == [("cpu", 2), ("cpu", 2)]  # simulated devices
    # what the engine does with its group: its CUDA_VISIBLE_DEVICES, before jax is imported
    import cloudpickle

    from mgkit.cluster import _rank

    (tmp_path / "setup.pkl").write_bytes(cloudpickle.dumps(_rank.setup))  # as an engine receives it
    script = tmp_path / "engine.py"
    script.write_text(
        "import os, sys, cloudpickle\n"
        f"setup = cloudpickle.loads(open({str(tmp_path / 'setup.pkl')!r}, 'rb').read())\n"
        "assert 'jax' not in sys.modules\n"
        "info = setup({'rank': 1, 'ranks': 2, 'platform': 'gpu', 'devices': ['2', '3'], 'distributed': None,"
        " 'collectives': None, 'sys_path': []})\n"
        "print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['MGKIT_RANK'], info['rank'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"  # this machine has no GPU: jax itself runs on the CPU
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["2,3", "1", "1"], out.stdout
