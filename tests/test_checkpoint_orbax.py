"""Checkpoints and plain orbax (mgkit/train/_checkpoint.py, _checkpoint_steps.py, _orbax.py): a
user's own orbax steps in a checkpoint folder are left alone; plain orbax reads mgkit's steps
with its documented restore, split ones included, into shardings of the reader's choosing; a
trainer starts from a user's orbax checkpoint; damaged split steps are set aside."""

import os
import shutil
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mgkit as mg


def _data(rows=64, n_in=101):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, n_in)).astype(np.float32)
    return {"x": x, "y": rng.normal(size=(rows, 3)).astype(np.float32)}


def _params(n_in=101, hidden=60):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": jax.random.normal(k1, (n_in, hidden)) * 0.1,
        "b": jnp.zeros(hidden),
        "v": jax.random.normal(k2, (hidden, 3)) * 0.1,
    }


def _loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w"] + p["b"]) @ p["v"] - b["y"]) ** 2)


def _snapshot(folder: Path) -> dict:
    """Every path under ``folder`` with its kind, size and modification time."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root, name)
            st = path.stat()
            out[str(path.relative_to(folder))] = (path.is_dir(), st.st_size, st.st_mtime_ns)
    return out


def _abstract(tree, sharding_of):
    """The user's abstract tree: each leaf's shape and dtype, with a sharding the user chose."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_of(x)), tree)


def _plain_restore(folder, step, abstract):
    """orbax's documented restore, without mgkit."""
    with ocp.CheckpointManager(folder) as manager:
        args = {name: ocp.args.StandardRestore(tree) for name, tree in abstract.items()}
        back = manager.restore(step, args=ocp.args.Composite(**args))
    return {name: back[name] for name in abstract}


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(_host(a)), jax.tree.leaves(_host(b)), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


# --- a user's own steps are never touched ---------------------------------------------------------


def _users_folder(folder: Path) -> dict:
    """A folder with a user's own orbax step 10, a stray folder '7' and a file '12'."""
    params = _params()
    with ocp.CheckpointManager(folder) as manager:
        manager.save(10, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))
        manager.wait_until_finished()
    (folder / "7").mkdir()
    (folder / "7" / "notes.txt").write_text("not a checkpoint")
    (folder / "12").write_text("a file named like a step")
    return _snapshot(folder)


def test_a_users_own_orbax_steps_are_never_renamed_deleted_or_restored(tmp_path):
    before = _users_folder(tmp_path)
    tr = mg.Trainer(_loss, optax.sgd(0.1), _params(), checkpoint=tmp_path, every=2, keep=1)
    with pytest.warns(UserWarning) as warned, pytest.raises(FileNotFoundError) as info:
        tr.fit(_data(), steps=2, batch_size=16, resume=True, progress=False)
    for part in [
        "resume=True",
        "holds no mgkit checkpoint, only '7', '10', '12'",
        "load_orbax",
        "resume=False",
    ]:
        assert part in str(info.value), str(info.value)
    msg = str(warned[0].message)
    for part in [f"'{tmp_path}' holds '7', '10', '12'", "not written by mgkit", "left as they are"]:
        assert part in msg, msg
    assert tr.step == 0 and _snapshot(tmp_path) == before

    tr.fit(_data(), steps=4, batch_size=16, progress=False)  # saves 2 and 4; keeps 1 of mgkit's
    tr.checkpoints.close()
    after = _snapshot(tmp_path)
    assert {k: after[k] for k in before} == before  # every entry there before, as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["10", "12", "4", "7"]
    again = mg.Trainer(_loss, optax.sgd(0.1), _params(), checkpoint=tmp_path, every=2, keep=1)
    with pytest.warns(UserWarning, match="not written by mgkit"):
        again.fit(_data(), steps=4, batch_size=16, resume=True, progress=False)
    assert again.step == 4
    again.checkpoints.close()
    _equal(again.params, tr.params)
    assert {k: v for k, v in _snapshot(tmp_path).items() if k in before} == before


def test_a_step_a_user_folder_already_has_is_not_saved_over(tmp_path):
    (tmp_path / "2").mkdir()
    tr = mg.Trainer(_loss, optax.sgd(0.1), _params(), checkpoint=tmp_path, every=2)
    with pytest.warns(UserWarning, match="'2', named like steps"), pytest.raises(ValueError) as info:
        tr.fit(_data(), steps=2, batch_size=16, progress=False)
    assert "already holds '2', not written by mgkit" in str(info.value)
    assert "folder of its own" in str(info.value)
    tr.checkpoints.close()
    assert sorted(os.listdir(tmp_path)) == ["2"] and os.listdir(tmp_path / "2") == []


# --- plain orbax reads mgkit's checkpoints ---------------------------------------------------------


def test_plain_orbax_restores_a_replicated_trainers_params_and_adam_state(tmp_path):
    params, opt = _params(), optax.adam(1e-2)
    tr = mg.Trainer(_loss, opt, params, checkpoint=tmp_path, every=3)
    tr.fit(_data(), steps=3, batch_size=16, progress=False)
    tr.checkpoints.close()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {
        "params": _abstract(params, lambda x: one),
        "opt_state": _abstract(opt.init(params), lambda x: one),
    }
    back = _plain_restore(tmp_path, 3, abstract)
    _equal(back["params"], tr.params)
    _equal(back["opt_state"], tr.opt_state)  # adam's own NamedTuples, counts as int32
    assert isinstance(back["opt_state"][0], optax.ScaleByAdamState)
    assert all(x.sharding == one for x in jax.tree.leaves(back))


def test_plain_orbax_restores_a_split_padded_checkpoint_with_shardings_of_its_choosing(tmp_path):
    params, opt = _params(n_in=1001), optax.adam(1e-2)  # w: 1001 x 60, split over 8: padded
    tr = mg.Trainer(_loss, opt, params, checkpoint=tmp_path, every=2, shard="fsdp")
    tr.fit(_data(n_in=1001), steps=2, batch_size=16, progress=False)
    tr.checkpoints.close()
    assert tr._params["w"].shape != (1001, 60)  # stored padded: the case the files unpad
    want = {"params": tr.params, "opt_state": tr.opt_state}
    one = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    mesh = jax.make_mesh((4,), ("m",), devices=jax.devices()[4:], axis_types=(jax.sharding.AxisType.Auto,))

    def split_last(x):  # over 4 devices along an axis that divides by 4 (60 and 3: 60 only)
        return NamedSharding(mesh, P(*[None] * (x.ndim - 1), "m") if x.ndim and x.shape[-1] % 4 == 0 else P())

    for sharding_of in (lambda x: one, split_last):
        abstract = {
            "params": _abstract(params, sharding_of),
            "opt_state": _abstract(opt.init(params), sharding_of),
        }
        back = _plain_restore(tmp_path, 2, abstract)
        _equal(back, want)
        for got, a in zip(jax.tree.leaves(back), jax.tree.leaves(abstract), strict=True):
            assert got.sharding == a.sharding
    shape = back["params"]["w"].addressable_shards[0].data.shape
    assert shape == (1001, 15)  # each of the 4 devices reads its part


# --- a trainer starts from a user's orbax checkpoint -----------------------------------------------


def _batch(step):
    data = _data()
    rows = (np.arange(16) + 16 * step) % 64
    return {k: v[rows] for k, v in data.items()}


@pytest.mark.parametrize("kw", [{}, {"shard": "fsdp", "contexts": 3}])
def test_a_trainer_goes_on_from_a_users_orbax_checkpoint_as_the_users_own_loop_would(tmp_path, kw):
    opt = optax.adam(1e-2)

    @jax.jit
    def step(p, s, b):
        g = jax.grad(_loss)(p, b)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    p, s = _params(), opt.init(_params())
    for i in (1, 2, 3):  # a function source gives step i's batch as data(i)
        p, s = step(p, s, _batch(i))
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(
            3, args=ocp.args.Composite(params=ocp.args.StandardSave(p), opt_state=ocp.args.StandardSave(s))
        )
    for i in (4, 5, 6):
        p, s = step(p, s, _batch(i))

    tr = mg.Trainer(_loss, opt, jax.tree.map(jnp.zeros_like, _params()), **kw)
    tr.load_orbax(tmp_path, opt_state="opt_state")
    assert tr.step == 3
    tr.fit(_batch, steps=3, progress=False)
    for got, want in zip(jax.tree.leaves((tr.params, tr.opt_state)), jax.tree.leaves((p, s)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-6)


def test_load_orbax_names_the_first_leaf_that_differs_and_a_missing_item(tmp_path):
    params = _params()
    with ocp.CheckpointManager(tmp_path) as manager:
        saved = params | {"w": jnp.zeros((101, 61))}
        manager.save(5, args=ocp.args.Composite(params=ocp.args.StandardSave(saved)))
    tr = mg.Trainer(_loss, optax.adam(1e-2), params)
    with pytest.raises(ValueError) as info:
        tr.load_orbax(tmp_path)
    for part in [
        "Trainer.load_orbax: the orbax checkpoint item 'params' of step 5",
        "params['w'] is an array of shape (101, 61) and dtype float32 in the checkpoint but an array of"
        " shape (101, 60) and dtype float32 in the trainer",
    ]:
        assert part in str(info.value), str(info.value)
    with pytest.raises(
        FileNotFoundError, match=r"has no item 'opt' \(its items: \['params'\]\); pass opt_state="
    ):
        tr.load_orbax(tmp_path, opt_state="opt")
    with pytest.raises(FileNotFoundError, match=r"no orbax checkpoint step 4 in .* \(it holds steps \[5\]\)"):
        tr.load_orbax(tmp_path, step=4)
    other = {"w": params["w"], "b": params["b"]}
    with ocp.CheckpointManager(tmp_path / "two") as manager:
        manager.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(other)))
    with pytest.raises(
        ValueError, match=r"params\['v'\] \(an array of shape \(60, 3\) .*\) is not in the checkpoint"
    ):
        tr.load_orbax(tmp_path / "two")
    assert tr.step == 0
    with ocp.CheckpointManager(tmp_path / "single") as manager:  # one item: orbax names it "default"
        manager.save(7, args=ocp.args.StandardSave(params))
    tr.load_orbax(tmp_path / "single", params="default")
    assert tr.step == 7
    _equal(tr.params, params)


# --- damaged split checkpoints ---------------------------------------------------------------------


def _fsdp(steps, folder, resume=False):
    tr = mg.Trainer(_loss, optax.adam(1e-2), _params(), checkpoint=folder, every=2, shard="fsdp", contexts=8)
    tr.fit(_batch, steps=steps, progress=False, resume=resume)
    tr.checkpoints.close()
    return tr


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    """A split run of 6 steps, and the folder of one stopped at 4 (checkpoints at 2 and 4)."""
    folder = tmp_path_factory.mktemp("split")
    mg.use_contexts(";".join(f"dev{i}->cpu{i}" for i in range(8)), verbose=False)
    whole = mg.Trainer(_loss, optax.adam(1e-2), _params(), shard="fsdp", contexts=8)
    whole.fit(_batch, steps=6, progress=False)
    _fsdp(4, folder)
    return jax.device_get(whole.params), folder


@pytest.mark.parametrize("fault", ["a shard file lost", "shard files garbled"])
def test_a_damaged_split_checkpoint_is_set_aside_for_the_one_before(tmp_path, split_run, fault):
    whole, saved = split_run
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    files = sorted(p for p in (tmp_path / "4" / "params").rglob("*") if p.is_file() and p.parent.name == "d")
    assert files, sorted(str(p) for p in (tmp_path / "4").rglob("*"))
    rng = np.random.default_rng(1)
    largest = max(files, key=lambda f: f.stat().st_size)  # the array data, read by any restore
    for f in files if fault == "shard files garbled" else [largest]:
        if fault == "a shard file lost":
            f.unlink()
        else:
            f.write_bytes(rng.integers(0, 256, f.stat().st_size, dtype=np.uint8).tobytes())
    with pytest.warns(UserWarning) as warned:
        again = _fsdp(6, tmp_path, resume=True)
    msg = " ".join(str(w.message) for w in warned)
    for part in [f"'{tmp_path / '4'}' (step 4) is damaged", f"moved to '{tmp_path / '4.damaged'}'"]:
        assert part in msg, msg
    assert again.step == 6 and (tmp_path / "4.damaged").is_dir()
    _equal(again.params, whole)


def _bytes_per_device() -> dict:
    """Bytes of the live buffers on each device (a shard's view of a buffer counted once)."""
    buffers = {}
    for a in jax.live_arrays():
        for shard in a.addressable_shards:
            buffers[shard.device, shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    out: dict = {}
    for (device, _), n in buffers.items():
        out[device] = out.get(device, 0) + n
    return out


def test_saving_a_split_padded_state_puts_no_whole_leaf_on_a_context(tmp_path, monkeypatch):
    from mgkit.train import _checkpoint_tree

    make = lambda: _params(n_in=1001)  # noqa: E731 - created split: no whole copy anywhere
    tr = mg.Trainer(_loss, optax.adam(1e-2), make, shard="fsdp", checkpoint=tmp_path)
    assert tr._params["w"].shape != (1001, 60)  # stored padded
    assert (1001, 60) not in [a.shape for a in jax.live_arrays()]
    before, seen = _bytes_per_device(), []
    written = _checkpoint_tree.written

    def spy(tree):
        out = written(tree)  # what orbax is given: held until the save has copied it
        seen.append((_bytes_per_device(), [a.shape for a in jax.live_arrays()], jax.tree.leaves(out)))
        return out

    monkeypatch.setattr(_checkpoint_tree, "written", spy)
    tr.save()
    assert seen
    for per_device, shapes, leaves in seen:
        assert (1001, 60) not in shapes  # no device holds the leaf whole
        assert all(per_device[d] <= before[d] for d in before), (per_device, before)
        assert any(isinstance(x, np.ndarray) and x.shape == (1001, 60) for x in leaves) or not leaves
    tr.checkpoints.close()


def test_the_readmes_plain_orbax_snippet_reads_a_trainers_checkpoint(tmp_path, monkeypatch):
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    after = readme[readme.index("**Layout: plain orbax reads it.**") :]
    snippet = after[
        after.index("```python") + len("```python") : after.index("```", after.index("```python") + 9)
    ]
    params, optimizer = _params(), optax.sgd(0.1, momentum=0.9)
    tr = mg.Trainer(_loss, optimizer, params, checkpoint=tmp_path / "ckpt", every=2)
    tr.fit(_data(), steps=2, batch_size=16, progress=False)
    tr.checkpoints.close()
    monkeypatch.chdir(tmp_path)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    scope = {"jax": jax, "params": params, "optimizer": optimizer, "sharding": one}
    exec(textwrap.dedent(snippet), scope)
    _equal(scope["back"]["params"], tr.params)
    _equal(scope["back"]["opt_state"], tr.opt_state)


def test_a_checkpoint_of_the_earlier_format_is_refused_with_a_clear_message(tmp_path):
    (tmp_path / "3" / "meta").mkdir(parents=True)  # what the earlier format's step held
    (tmp_path / "3" / "meta" / "metadata").write_text('{"format": "mgkit.train 2", "json": {}}')
    tr = mg.Trainer(_loss, optax.sgd(0.1), _params(), checkpoint=tmp_path, every=2)
    with pytest.raises(ValueError) as info:
        tr.fit(_data(), steps=4, batch_size=16, resume=True, progress=False)
    tr.checkpoints.close()
    for part in [
        f"Trainer: the checkpoint of step 3 in '{tmp_path}' is of an earlier mgkit format ('mgkit.train 2'",
        "which this version does not read (it reads 'mgkit.train 3')",
        "with the mgkit version that wrote it, or start a new checkpoint folder",
    ]:
        assert part in str(info.value), str(info.value)
    assert (tmp_path / "3" / "meta" / "metadata").is_file() and tr.step == 0
