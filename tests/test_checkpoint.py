"""The trainer's checkpoint store (mgkit/train/_checkpoint.py): optional orbax, atomic saves under
SIGKILL, bit-identical round trips on 8 contexts, kept checkpoints, no threads left, clear errors."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import psutil
import pytest

import mgkit as mg
from mgkit.train import _checkpoint
from mgkit.train._checkpoint import Checkpoints
from tests.conftest import child_env, run_python

ROOT = Path(__file__).resolve().parent.parent


def _replicated():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _state(seed: int, key="typed", step=5):
    """An adamw training state after one update, replicated over 8 contexts."""
    rep = _replicated()
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"w": jax.random.normal(k1, (16, 8)), "b": jax.random.normal(k2, (8,)).astype(jnp.bfloat16)}
    params = jax.device_put(params, rep)
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.25), params)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    keys = {"typed": jax.random.key(seed + 1), "raw": jax.random.PRNGKey(seed + 1), None: None}
    key = None if keys[key] is None else jax.device_put(keys[key], rep)
    data = {"epoch": 2, "index": 384, "seed": seed}
    return {"params": params, "opt_state": opt_state, "step": step, "key": key, "data": data}


def _host(tree):
    """Host copies of every array (typed keys as their key data), to compare bits."""

    def one(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(one, tree)


def _same_bits(a, b):
    la, lb = jax.tree.leaves(_host(a)), jax.tree.leaves(_host(b))
    assert jax.tree.structure(_host(a)) == jax.tree.structure(_host(b))
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def _raises(exc, match, fn, *args, **kw):
    with pytest.raises(exc) as info:
        fn(*args, **kw)
    for part in match:
        assert part in str(info.value), f"{part!r} not in: {info.value}"
    return str(info.value)


# --- 1. orbax is optional ------------------------------------------------------------------------


def test_importing_mgkit_does_not_import_orbax():
    r = run_python(
        "import sys, mgkit, mgkit.train, mgkit.train._checkpoint\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'orbax'))",
        env={"PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_missing_orbax_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "orbax", None)
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
    msg = _raises(
        ImportError,
        ["Trainer:", "orbax-checkpoint", "pip install 'mgkit[checkpoint]'"],
        Checkpoints,
        tmp_path,
        where="Trainer",
    )
    assert "not installed" in msg


def test_pyproject_lists_orbax_as_an_extra_and_for_tests():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["checkpoint"] == ["orbax-checkpoint>=0.11"]
    assert "orbax-checkpoint>=0.11" in extras["test"]


# --- 3. bit-identical round trip on 8 contexts ---------------------------------------------------


@pytest.mark.parametrize("key", ["typed", "raw", None])
def test_round_trip_is_bit_identical_and_placed_like_like(tmp_path, key):
    state = _state(0, key=key)
    saved = _host({k: state[k] for k in ("params", "opt_state", "key") if state[k] is not None})
    like = _state(9, key=key, step=0) | {"data": {"epoch": 0, "index": 0, "seed": 9}}
    with Checkpoints(tmp_path, every=5, where="Trainer") as ck:
        ck.save(5, state)
        # save returns once the arrays are copied: the trainer may donate (delete) them at once
        for x in jax.tree.leaves([state["params"], state["opt_state"]]):
            x.delete()
        assert ck.latest() == 5
        back = ck.restore(like)
    assert back["step"] == 5 and back["data"] == {"epoch": 2, "index": 384, "seed": 0}
    _same_bits({k: back[k] for k in saved}, saved)
    assert jax.tree.structure(back["opt_state"]) == jax.tree.structure(like["opt_state"])
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(like), strict=True):
        if isinstance(want, jax.Array):
            assert got.sharding == want.sharding
    if key == "typed":
        assert jax.dtypes.issubdtype(back["key"].dtype, jax.dtypes.prng_key)
        assert jax.random.key_impl(back["key"]) == jax.random.key_impl(like["key"])
    if key is None:
        assert back["key"] is None


def test_numpy_and_python_leaves_come_back_as_saved(tmp_path):
    state = {"params": {"w": np.arange(6.0).reshape(2, 3), "s": np.float32(1.5), "n": 3}, "step": 2}
    like = {"params": {"w": np.zeros((2, 3)), "s": np.float32(0), "n": 0}, "step": 0}
    with Checkpoints(tmp_path, every=2) as ck:
        ck.save(2, state)
        back = ck.restore(like)
    assert back["step"] == 2 and back["params"]["n"] == 3
    assert (
        isinstance(back["params"]["w"], np.ndarray)
        and back["params"]["w"].tolist() == state["params"]["w"].tolist()
    )
    assert isinstance(back["params"]["s"], np.float32) and back["params"]["s"] == np.float32(1.5)


# --- 2. atomic saves: SIGKILL during a save ------------------------------------------------------

N_BIG = 50_000_000  # 200 MB of float32: its save takes long enough to be killed half-way

CHILD = f"""
import sys
import jax, jax.numpy as jnp
import mgkit as mg
from mgkit.train import _checkpoint
from mgkit.train._checkpoint import Checkpoints

def state(step, value):
    w = jnp.full(({N_BIG},), value)
    return {{"params": {{"w": w}}, "step": step, "key": jax.random.key(step), "data": {{"index": step}}}}

ck = Checkpoints(sys.argv[1], every=1, keep=3, where="child")
ck.save(1, state(1, 1.0))
ck.wait()
big = jax.block_until_ready(state(2, 2.0))
ck.save(2, big)
print("saving", flush=True)
ck.wait()
print("saved", flush=True)
"""


@pytest.mark.timeout(120)
def test_kill_during_save_leaves_the_previous_checkpoint():
    env = child_env()
    env["PYTHONPATH"] = str(ROOT)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with tempfile.TemporaryDirectory() as tmp:  # removed at the end: it holds 200 MB
        script, folder, log = Path(tmp, "child.py"), Path(tmp, "ckpt"), Path(tmp, "child.err")
        script.write_text(CHILD)
        with log.open("w") as err:
            child = subprocess.Popen(
                [sys.executable, str(script), str(folder)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )
            try:
                line = child.stdout.readline()
                if line.strip() == "saving":
                    os.kill(child.pid, signal.SIGKILL)
            finally:
                if child.poll() is None:
                    os.kill(child.pid, signal.SIGKILL)
                child.communicate(timeout=60)
        assert line.strip() == "saving", log.read_text()[-3000:]
        assert child.returncode == -signal.SIGKILL
        assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
        unfinished = [p.name for p in folder.iterdir() if p.name.startswith("2") and p.name != "2"]
        assert unfinished, f"the kill came after step 2's save ended: {sorted(os.listdir(folder))}"

        like = {"params": {"w": jnp.zeros((N_BIG,))}, "step": 0, "key": jax.random.key(0), "data": {}}
        with Checkpoints(folder, every=1, keep=3) as ck:
            assert ck.latest() == 1
            back = ck.restore(like)
            assert back["step"] == 1 and back["data"] == {"index": 1}
            assert bool((back["params"]["w"] == 1.0).all())
            _same_bits(back["key"], jax.random.key(1))
            del back, like
            ck.save(2, {"params": {"w": jnp.full((8,), 3.0)}, "step": 2, "key": None, "data": {}})
            assert ck.latest() == 2


# --- 5, 6. kept checkpoints, waiting, threads ----------------------------------------------------


def test_old_checkpoints_beyond_keep_are_deleted(tmp_path):
    with Checkpoints(tmp_path, every=1, keep=2) as ck:
        for step in range(1, 6):
            ck.save(step, {"params": {"w": jnp.full((4,), float(step))}, "step": step})
        assert ck.latest() == 5
        assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["4", "5"]
        like = {"params": {"w": jnp.zeros(4)}, "step": 0}
        assert ck.restore(like, step=4)["params"]["w"].tolist() == [4.0] * 4
        _raises(
            FileNotFoundError,
            ["no complete checkpoint of step 3", str(tmp_path), "[4, 5]"],
            ck.restore,
            like,
            step=3,
        )


def test_keep_none_keeps_every_checkpoint(tmp_path):
    with Checkpoints(tmp_path, every=1, keep=None) as ck:
        for step in range(1, 5):
            ck.save(step, {"params": {"w": jnp.ones(2)}, "step": step})
        ck.wait()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["1", "2", "3", "4"]


def test_close_waits_and_leaves_no_thread_behind(tmp_path):
    # orbax keeps process-wide idle workers (an asyncio loop's executor, "asyncio_N") that it
    # starts on first use and reuses: a first store starts them, and a store made after it must
    # leave no thread of its own behind
    with Checkpoints(tmp_path / "first", every=1) as first:
        first.save(1, {"params": {"w": jnp.arange(100_000.0)}, "step": 1})
    before = set(threading.enumerate())
    ck = Checkpoints(tmp_path, every=1)
    for step in (1, 2):  # the second save waits for the first
        ck.save(step, {"params": {"w": jnp.arange(100_000.0) + step}, "step": step})
    ck.close()
    ck.close()  # closing twice is fine
    _no_thread_but(before)  # a thread told to end may take a moment to return
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and p.name != "first") == ["1", "2"]
    _raises(RuntimeError, ["is closed", "make a new one"], ck.save, 3, {"step": 3})
    assert "closed" in repr(ck)
    with Checkpoints(tmp_path, every=1) as again:
        assert again.latest() == 2
        assert again.restore({"params": {"w": jnp.zeros(100_000)}, "step": 0})["params"]["w"][1] == 3.0


def test_due_is_every_positive_multiple(tmp_path):
    with Checkpoints(tmp_path, every=100, keep=3) as ck:
        assert [s for s in (0, 1, 99, 100, 150, 200, 300) if ck.due(s)] == [100, 200, 300]


# --- 4. bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"every": 0}, ValueError, ["Trainer: every=0 is out of range", "at least 1", "every=100"]),
        ({"every": -5}, ValueError, ["every=-5 is out of range"]),
        ({"every": 2.5}, TypeError, ["every must be a whole number", "float 2.5"]),
        ({"every": True}, TypeError, ["every must be a whole number", "bool True"]),
        ({"keep": 0}, ValueError, ["Trainer: keep=0 is out of range", "or None"]),
        ({"keep": "3"}, TypeError, ["keep must be a whole number", "str '3'"]),
    ],
)
def test_bad_every_and_keep(tmp_path, kw, exc, match):
    _raises(exc, match, Checkpoints, tmp_path, **({"every": 10} | kw), where="Trainer")


def test_folder_that_is_a_file(tmp_path):
    f = tmp_path / "ckpt"
    f.write_text("not a folder")
    _raises(
        NotADirectoryError,
        ["Trainer:", f"'{f}' is a file, not a folder", "checkpoint='ckpt/'"],
        Checkpoints,
        f,
        where="Trainer",
    )
    _raises(
        PermissionError,
        ["Trainer: cannot write in the checkpoint folder", str(f / "sub"), "you can write to"],
        Checkpoints,
        f / "sub",
        where="Trainer",
    )
    _raises(
        TypeError, ["Trainer: the checkpoint folder must be a path", "int 3"], Checkpoints, 3, where="Trainer"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in read-only folders; the file case covers it")
def test_folder_without_write_permission(tmp_path):
    d = tmp_path / "locked"
    d.mkdir()
    d.chmod(0o500)
    try:
        _raises(
            PermissionError,
            ["cannot write in the checkpoint folder", str(d), "you can write to"],
            Checkpoints,
            d,
            where="Trainer",
        )
    finally:
        d.chmod(0o700)


def test_folder_where_no_file_can_be_made(tmp_path, monkeypatch):
    """What a read-only folder does for a user who is not root (or a read-only file system for root)."""
    import mgkit.train._checkpoint as module

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(module.tempfile, "TemporaryFile", refuse)
    _raises(
        PermissionError,
        [
            "Trainer: cannot write in the checkpoint folder",
            str(tmp_path),
            "Permission denied",
            "you can write to",
        ],
        Checkpoints,
        tmp_path,
        where="Trainer",
    )


def test_restore_with_no_checkpoint_names_the_folder(tmp_path):
    (tmp_path / "1.orbax-checkpoint-tmp-123").mkdir()  # an unfinished save is not a checkpoint
    with Checkpoints(tmp_path, every=1, where="Trainer") as ck:
        assert ck.latest() is None
        _raises(
            FileNotFoundError,
            ["Trainer: no complete checkpoint in", str(tmp_path), "unfinished"],
            ck.restore,
            {"params": {"w": jnp.zeros(2)}},
        )


def _mismatch(tmp_path, like_params, where_text):
    state = {"params": {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}, "step": 1, "key": jax.random.key(0)}
    like = {"params": like_params, "step": 0, "key": jax.random.key(0)}
    with Checkpoints(tmp_path, every=1, where="Trainer") as ck:
        ck.save(1, state)
        msg = _raises(
            ValueError,
            [
                "Trainer: the checkpoint of step 1",
                str(tmp_path),
                "does not fit this model",
                "different model",
                "new checkpoint folder",
                "parameters it was saved from",
            ],
            ck.restore,
            like,
        )
    assert where_text in msg, msg


def test_restore_into_a_model_with_a_missing_leaf(tmp_path):
    _mismatch(tmp_path, {"w": jnp.zeros((4, 3))}, "['params']['b'] is in the checkpoint")


def test_restore_into_a_model_with_an_extra_leaf(tmp_path):
    params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3), "c": jnp.zeros(2)}
    _mismatch(tmp_path, params, "['params']['c'] is in the model")


def test_restore_into_a_model_with_another_shape_names_the_first_leaf(tmp_path):
    params = {"w": jnp.zeros((4, 5)), "b": jnp.zeros(5)}  # both differ: 'b' comes first
    _mismatch(
        tmp_path,
        params,
        "['params']['b'] is an array of shape (3,) and dtype float32 in the checkpoint but an "
        "array of shape (5,)",
    )


def test_restore_into_a_model_with_another_dtype(tmp_path):
    params = {"w": jnp.zeros((4, 3), jnp.bfloat16), "b": jnp.zeros(3)}
    _mismatch(
        tmp_path,
        params,
        "['params']['w'] is an array of shape (4, 3) and dtype float32 in the checkpoint "
        "but an array of shape (4, 3) and dtype bfloat16",
    )


def test_restore_into_a_model_without_an_entry(tmp_path):
    state = {"params": {"w": jnp.zeros(3)}, "ema": {"w": jnp.zeros(3)}, "step": 1}
    with Checkpoints(tmp_path, every=1) as ck:
        ck.save(1, state)
        _raises(
            ValueError,
            ["['ema']['w'] is in the checkpoint (an array of shape (3,)", "but missing from the model"],
            ck.restore,
            {"params": {"w": jnp.zeros(3)}, "step": 0},
        )
        _raises(
            ValueError,
            ["['opt'][0] is in the model (an array of shape (1,)", "but missing from the checkpoint"],
            ck.restore,
            state | {"opt": (jnp.zeros(1),)},
        )


def test_restore_a_raw_key_into_a_typed_key(tmp_path):
    with Checkpoints(tmp_path, every=1) as ck:
        ck.save(1, {"params": {"w": jnp.zeros(3)}, "key": jax.random.PRNGKey(0), "step": 1})
        _raises(
            ValueError,
            ["['key'] is an array of shape (2,) and dtype uint32 in the checkpoint", "threefry2x32 PRNG key"],
            ck.restore,
            {"params": {"w": jnp.zeros(3)}, "key": jax.random.key(0), "step": 0},
        )


def test_saving_over_a_newer_checkpoint_is_refused(tmp_path):
    with Checkpoints(tmp_path, every=1, where="Trainer") as ck:
        ck.save(3, {"params": {"w": jnp.zeros(3)}, "step": 3})
        _raises(
            ValueError,
            ["Trainer: the checkpoint folder", "already holds step 3", "step 2 being saved", "new folder"],
            ck.save,
            2,
            {"params": {"w": jnp.zeros(3)}, "step": 2},
        )
        _raises(ValueError, ["step=-1 is out of range"], ck.save, -1, {"step": -1})


def test_data_that_is_not_json_is_refused_before_writing(tmp_path):
    with Checkpoints(tmp_path, every=1, where="Trainer") as ck:
        _raises(
            TypeError,
            ["Trainer: state['data']", "JSON", "numbers, strings, lists and dicts"],
            ck.save,
            1,
            {"params": {"w": jnp.zeros(3)}, "step": 1, "data": {"sampler": object()}},
        )
        assert ck.latest() is None
        ck.save(1, {"params": {"w": jnp.zeros(3)}, "step": np.int64(1), "data": {"index": np.int32(7)}})
        assert ck.restore({"params": {"w": jnp.zeros(3)}})["data"] == {"index": 7}


def test_a_leaf_that_is_neither_array_nor_number_is_refused(tmp_path):
    with Checkpoints(tmp_path, every=1, where="Trainer") as ck:
        _raises(
            TypeError,
            ["Trainer: the state's leaf ['params']['act'] = <", "arrays or Python numbers"],
            ck.save,
            1,
            {"params": {"w": jnp.zeros(3), "act": jnp.tanh}, "step": 1},
        )


def test_a_failed_background_save_is_reported_by_the_next_wait(tmp_path, monkeypatch):
    ck = Checkpoints(tmp_path, every=1, where="Trainer")
    ck.save(1, {"params": {"w": jnp.zeros(3)}, "step": 1})
    ck.wait()
    ck.save(2, {"params": {"w": jnp.ones(3)}, "step": 2})
    finish = ck._manager.wait_until_finished

    def failed():
        finish()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck._manager, "wait_until_finished", failed)
    _raises(
        RuntimeError,
        [
            "Trainer: saving the checkpoint of step 2",
            str(tmp_path),
            "No space left on device",
            "the newest complete checkpoint is the one before it",
            "save again",
        ],
        ck.wait,
    )
    monkeypatch.undo()
    ck.close()


# --- any optax state resumes as it was (issue 30) ------------------------------------------------

_MASK = {"w": True, "b": False}
OPTIMIZERS = {  # states with no arrays, chains, masks, scalars, contrib, MultiSteps, keys
    "sgd": lambda: optax.sgd(0.1),
    "sgd_nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adamw": lambda: optax.adamw(1e-2),
    "chain_without_arrays": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.add_decayed_weights(1e-4), optax.sgd(0.1)
    ),
    "masked_sgd": lambda: optax.masked(optax.sgd(0.1), _MASK),
    "masked_adam_and_sgd": lambda: optax.chain(
        optax.masked(optax.adam(1e-2), _MASK), optax.masked(optax.sgd(0.1), {"w": False, "b": True})
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.5),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2).gradient_transformation(),
    "noisy_sgd": lambda: optax.noisy_sgd(0.1, key=jax.random.key(3)),
    "prodigy": lambda: optax.contrib.prodigy(),
    "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-2),
    "multi_transform": lambda: optax.multi_transform(
        {"a": optax.adam(1e-2), "s": optax.sgd(0.1)}, {"w": "a", "b": "s"}
    ),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.lion(1e-3), 3),
    "adafactor": lambda: optax.adafactor(1e-2),
}


def _regression():
    rng = np.random.default_rng(0)
    data = {
        "x": rng.normal(size=(64, 4)).astype(np.float32),
        "y": rng.normal(size=(64, 2)).astype(np.float32),
    }
    return data, {"w": jnp.zeros((4, 2)), "b": jnp.zeros(2)}


def _sq_loss(p, batch):
    return ((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2).mean()


def _fit(opt, steps, folder=None, resume=False, every=2):
    data, params = _regression()
    tr = mg.Trainer(_sq_loss, opt, params, checkpoint=folder, every=every)
    tr.fit(data, steps=steps, batch_size=16, resume=resume, progress=False)
    if tr.checkpoints is not None:
        tr.checkpoints.close()
    return tr


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_resume_with_any_optax_optimizer_is_the_uninterrupted_run_bit_for_bit(tmp_path, name):
    whole_run = _fit(OPTIMIZERS[name](), 6)
    _fit(OPTIMIZERS[name](), 4, tmp_path)  # checkpoints at steps 2 and 4
    again = _fit(OPTIMIZERS[name](), 6, tmp_path, resume=True)
    assert again.step == 6
    assert jax.tree.structure(again.opt_state) == jax.tree.structure(whole_run.opt_state)
    _same_bits((again.params, again.opt_state), (whole_run.params, whole_run.opt_state))


def test_an_optimizer_state_without_arrays_comes_back_in_its_own_structure(tmp_path):
    params = {"w": jnp.ones(3)}
    opt_state = optax.chain(optax.sgd(0.1), optax.masked(optax.sgd(0.1), {"w": True})).init(params)
    assert jax.tree.leaves(opt_state) == []
    with Checkpoints(tmp_path, every=1) as ck:
        ck.save(1, {"params": params, "opt_state": opt_state, "step": 1, "data": {"index": 3}})
        back = ck.restore({"params": params, "opt_state": opt_state, "step": 0, "data": {}})
    assert jax.tree.structure(back["opt_state"]) == jax.tree.structure(opt_state)
    assert back["opt_state"] == opt_state and back["data"] == {"index": 3}


def test_resuming_with_another_optimizer_names_the_first_difference(tmp_path):
    _fit(optax.sgd(0.1), 2, tmp_path)
    data, params = _regression()
    tr = mg.Trainer(_sq_loss, optax.adam(1e-2), params, checkpoint=tmp_path, every=2)
    with pytest.raises(ValueError) as info:
        tr.fit(data, steps=4, batch_size=16, resume=True, progress=False)
    tr.checkpoints.close()
    for part in [
        "Trainer: the checkpoint of step 2",
        str(tmp_path),
        "['opt_state'][0] is a tree node of type EmptyState in the checkpoint but of type "
        "ScaleByAdamState in the model",
        "different model or optimizer",
        "with the optimizer and the parameters it was saved from",
    ]:
        assert part in str(info.value), str(info.value)
    assert tr.step == 0


def test_a_state_with_another_number_of_empty_nodes_names_the_node(tmp_path):
    params = {"w": jnp.ones(3)}
    with Checkpoints(tmp_path, every=1, where="Trainer") as ck:
        ck.save(1, {"params": params, "opt_state": optax.sgd(0.1).init(params), "step": 1})
        _raises(
            ValueError,
            [
                "['opt_state'][1] is in the checkpoint (a tree node of type EmptyState) but missing",
            ],
            ck.restore,
            {"params": params, "opt_state": (optax.EmptyState(),), "step": 0},
        )


# --- a damaged newest checkpoint -----------------------------------------------------------------


def _damage(folder: Path, how: str) -> Path:
    """Damages the checkpoint of step 2: the folder that is skipped."""
    if how == "array files gone":
        shutil.rmtree(folder / "2" / "params")
    else:  # the array data deleted, its manifest kept: found only when orbax reads the arrays
        for f in (folder / "2" / "params" / "d").iterdir():
            f.unlink()
    return folder / "2"


@pytest.mark.parametrize("how", ["array files gone", "array data gone"])
def test_a_damaged_newest_checkpoint_is_set_aside_for_the_newest_complete_one(tmp_path, how):
    like = {"params": {"w": jnp.zeros(3)}, "step": 0}
    with Checkpoints(tmp_path, every=1, where="Trainer") as ck:
        for step in (1, 2):
            ck.save(step, {"params": {"w": jnp.full(3, float(step))}, "step": step})
    skipped = _damage(tmp_path, how)
    with Checkpoints(tmp_path, every=1, where="Trainer") as ck:
        with pytest.warns(UserWarning) as warned:
            back = ck.restore(like)
        msg = str(warned[0].message)
        for part in ["Trainer: the checkpoint folder", f"'{skipped}'", "is damaged", f"'{skipped}.damaged'"]:
            assert part in msg, msg
        complete = 1
        assert back["step"] == complete and back["params"]["w"].tolist() == [float(complete)] * 3
        assert ck.latest() == complete and Path(f"{skipped}.damaged").is_dir() and not skipped.exists()
        step = int(skipped.name)  # the step is saved again
        ck.save(step, {"params": {"w": jnp.full(3, 5.0)}, "step": step})
        assert ck.restore(like)["params"]["w"].tolist() == [5.0] * 3


def test_a_damaged_checkpoint_asked_for_by_step_names_the_folder_and_step(tmp_path):
    like = {"params": {"w": jnp.zeros(3)}, "step": 0}
    with Checkpoints(tmp_path, every=1, where="Trainer") as ck:
        for step in (1, 2):
            ck.save(step, {"params": {"w": jnp.full(3, float(step))}, "step": step})
    _damage(tmp_path, "array data gone")
    with Checkpoints(tmp_path, every=1, where="Trainer") as ck:
        msg = _raises(
            FileNotFoundError,
            ["Trainer: the checkpoint of step 2 in", f"'{tmp_path / '2'}' is damaged", "step=None"],
            ck.restore,
            like,
            step=2,
        )
        assert "KeyError" not in msg.split("(")[0]
        shutil.rmtree(tmp_path / "1" / "params")
        with pytest.warns(UserWarning), pytest.raises(FileNotFoundError, match="unfinished or damaged"):
            ck.restore(like)


def test_resume_from_a_damaged_newest_checkpoint_goes_on_from_the_one_before(tmp_path):
    whole_run = _fit(optax.adam(1e-2), 6)
    _fit(optax.adam(1e-2), 4, tmp_path)
    shutil.rmtree(tmp_path / "4" / "opt_state")
    with pytest.warns(UserWarning, match=r"checkpoint folder '.*4' \(step 4\) is damaged"):
        again = _fit(optax.adam(1e-2), 6, tmp_path, resume=True)
    assert again.step == 6 and sorted(p.name for p in tmp_path.iterdir())[-1] == "6"
    _same_bits((again.params, again.opt_state), (whole_run.params, whole_run.opt_state))


# --- a failed save: a clear error, no thread left, no orbax traceback ---------------------------


async def _disk_full(self, x, directory):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("failure", ["folder replaced by a file", "disk full"])
def test_a_failed_save_leaves_no_thread_and_prints_no_traceback(
    tmp_path, monkeypatch, capfd, caplog, failure
):
    from orbax.checkpoint._src.handlers import json_checkpoint_handler

    with Checkpoints(tmp_path / "first", every=1) as first:  # orbax's process-wide workers start
        first.save(1, {"params": {"w": jnp.ones(3)}, "step": 1})
    folder = tmp_path / "ckpt"
    ck = Checkpoints(folder, every=1, where="Trainer")
    ck.save(1, {"params": {"w": jnp.ones(3)}, "step": 1})
    ck.wait()
    before = set(threading.enumerate())
    capfd.readouterr()
    if failure == "disk full":
        monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", _disk_full)
        expected = ["Trainer: saving the checkpoint of step 2", "No space left on device", "save again"]
    else:  # replaced after the store's own check: orbax cannot make the step's folder
        monkeypatch.setattr(_checkpoint, "_writable_folder", lambda directory, where: Path(directory))
        shutil.rmtree(folder)
        folder.write_text("not a folder")
        expected = ["Trainer: saving the checkpoint of step 2", "Not a directory", "save again"]
    with pytest.raises(RuntimeError) as info:
        ck.save(2, {"params": {"w": jnp.ones(3)}, "step": 2})
        ck.wait()
    for part in expected:
        assert part in str(info.value), str(info.value)
    _no_thread_but(before)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "absl" not in err, err
    assert not [r for r in caplog.records if "orbax" in r.pathname and r.levelno >= 30]
    monkeypatch.undo()
    if failure == "disk full":  # the store still works
        ck.save(2, {"params": {"w": jnp.ones(3)}, "step": 2})
        assert ck.latest() == 2
    ck.close()
    _no_thread_but(before)  # orbax's threads of the last save end with close (within moments)


def _no_thread_but(before: set) -> None:
    """Within 5 s, no thread runs that did not run before."""
    deadline = time.monotonic() + 5.0
    while (left := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == set(), sorted(t.name for t in left)


def _stage(p, x):
    return jnp.tanh(x @ p["w"])


def test_a_pipeline_and_an_ensemble_with_sgd_resume_bit_for_bit(tmp_path):
    data, _ = _regression()
    k1, k2 = jax.random.split(jax.random.key(0))
    stages = [
        ("dev0", _stage, {"w": jax.random.normal(k1, (4, 3))}),
        ("dev1", _stage, {"w": jax.random.normal(k2, (3, 2))}),
    ]

    def pipe(steps, **kw):
        p = mg.Pipeline(
            stages,
            loss=lambda out, y: ((out - y) ** 2).mean(),
            microbatches=2,
            optimizer=optax.sgd(0.1),
            **kw,
        )
        p.fit(
            (data["x"], data["y"]),
            steps=steps,
            batch_size=16,
            progress=False,
            resume="checkpoint" in kw and steps == 6,
        )
        if p.checkpoints is not None:
            p.checkpoints.close()
        return p

    whole_run, _, again = (
        pipe(6),
        pipe(4, checkpoint=tmp_path / "pipe", every=2),
        pipe(6, checkpoint=tmp_path / "pipe", every=2),
    )
    assert again.step == 6 and jax.tree.structure(again.opt_state) == jax.tree.structure(whole_run.opt_state)
    _same_bits((again.params, again.opt_state), (whole_run.params, whole_run.opt_state))

    def ensemble(steps, **kw):
        member = mg.Member(
            _sq_loss, optax.sgd(0.1), _regression()[1], data=data, batch_size=16, name="m", **kw
        )
        return mg.Ensemble({"dev0": member}).fit(
            steps=steps, progress=False, resume="checkpoint" in kw and steps == 6
        )["m"]

    whole_m, _, again_m = (
        ensemble(6),
        ensemble(4, checkpoint=tmp_path / "m", every=2),
        ensemble(6, checkpoint=tmp_path / "m", every=2),
    )
    assert again_m.step == 6 and len(again_m.history) == 2
    _same_bits(again_m.params, whole_m.params)
