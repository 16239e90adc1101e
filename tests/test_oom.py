"""The out-of-memory report: a real resource-exhausted error on CPU in Trainer.fit, provoked ones
in mg.parallel and mg.put, what mgkit placed, and the same facts when mg.fits predicts it."""

import gc
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mgkit as mg
from mgkit import _devices, _oom, _transfer
from mgkit._parallel import _wrapper
from mgkit.train import _memory
from tests.conftest import ipython_shell


def _exhausted(text="RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.50GiB."):
    return jax.errors.JaxRuntimeError(text)


def test_a_step_that_xla_cannot_allocate_is_reported_per_context(monkeypatch):
    monkeypatch.setattr(_devices, "_simulated_limit", 64 << 20)
    kept = mg.put(np.ones((1000, 1000), np.float32), "dev1")

    def loss(p, b):
        big = jnp.cumsum(jnp.full((1 << 38,), b["x"].sum()))  # a 1 TiB temporary: XLA refuses it
        return jnp.mean((b["x"] @ p["w"]) ** 2) + big[-1] * 0

    tr = mg.Trainer(loss, optax.adam(1e-3), {"w": jnp.zeros((16, 4))}, contexts=["dev0", "dev1"])
    with pytest.raises(mg.OutOfMemoryError) as caught:
        tr.fit({"x": np.ones((64, 16), np.float32)}, steps=2, batch_size=32, progress=False)
    err = caught.value
    assert isinstance(err, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(err.__cause__)
    text = str(err)
    assert text.startswith("Trainer.fit: a device ran out of memory (RESOURCE_EXHAUSTED: Out of memory")
    assert re.search(
        r"the failing program needed: 2.0 TiB per device from the compiled program \(arguments [0-9.]+ KiB, "
        r"outputs \d+ B beyond the donated arguments, temporaries 2.0 TiB\); its arguments \(the state and "
        r"the batch\) fit the 64.0 MiB limit, and the step's temporaries \(activations, gathered parameters, "
        r"gradients\) take it over: fit\(\.\.\., accumulate=4\) or precision='bf16' cut them .*; "
        r"the allocation that failed: 2.0 TiB",
        text,
    )
    assert re.search(r"  dev1 \(cpu1, [0-9.]+ MiB / 64.0 MiB \(\d+%, live arrays\)\):", text)
    assert "    float32[1000,1000]  3.8 MiB  (placed by mg.put)" in text  # the largest on dev1
    assert "the training state per context (parameters + optimizer state + batch" in text
    assert re.search(r"  dev0: 256 B \+ 516 B \+ 1.0 KiB = 1.8 KiB / 64.0 MiB", text)
    assert (
        'fixes that apply: shard="fsdp"' in text and "accumulate=k" in text and "a smaller batch_size" in text
    )
    assert "dev2" not in text  # only the contexts the trainer runs on
    del kept


def test_a_step_refused_at_dispatch_names_the_trainers_own_arrays(monkeypatch):
    def loss(p, b):
        return jnp.mean(b["x"] @ p["w"])

    tr = mg.Trainer(loss, optax.adam(1e-3), {"w": jnp.zeros((512, 256))})

    def run(program, args, varying, info=None, record=True):  # refused before anything is donated
        raise _exhausted("RESOURCE_EXHAUSTED: Out of memory allocating 524288 bytes.")

    monkeypatch.setattr(tr._collectives, "run", run)
    with pytest.raises(mg.OutOfMemoryError) as caught:
        tr.fit({"x": np.ones((64, 512), np.float32)}, steps=1, batch_size=64, progress=False)
    text = str(caught.value)
    assert "    float32[512,256]  512.0 KiB  (the trainer's parameters)" in text
    assert "    float32[512,256]  512.0 KiB  (its optimizer state)" in text
    assert "the allocation that failed: 512.0 KiB" in text
    assert re.search(r"  dev7: 512.0 KiB \+ 1.0 MiB \+ 16.0 KiB = 1.5 MiB / unknown", text)


def test_a_parallel_call_that_runs_out_of_memory_is_reported(monkeypatch):
    def run(*args, **kwargs):
        raise _exhausted()

    monkeypatch.setattr(_wrapper, "run", run)
    f = mg.parallel(lambda x: x * 2, contexts=["dev0", "dev1"])
    with pytest.raises(mg.OutOfMemoryError) as caught:
        f(np.ones((8, 3), np.float32))
    text = str(caught.value)
    assert text.startswith("mg.parallel: a device ran out of memory (RESOURCE_EXHAUSTED: Out of memory while")
    assert "the failing program needed: the allocation that failed: 1.5 GiB" in text
    assert "  dev0 (cpu0, " in text and "  dev1 (cpu1, " in text and "dev2" not in text
    assert "fixes that apply: fewer rows per call" in text
    assert isinstance(caught.value.__cause__, jax.errors.JaxRuntimeError)


def test_other_errors_pass_through_unchanged(monkeypatch):
    def run(*args, **kwargs):
        raise RuntimeError("INTERNAL: something else")

    monkeypatch.setattr(_wrapper, "run", run)
    with pytest.raises(RuntimeError, match="INTERNAL: something else") as caught:
        mg.parallel(lambda x: x * 2)(np.ones((8, 3), np.float32))
    assert not isinstance(caught.value, mg.OutOfMemoryError)


def test_a_put_that_runs_out_of_memory_names_its_context(monkeypatch):
    def to_devices(*args, **kwargs):
        raise _exhausted("RESOURCE_EXHAUSTED: Out of memory allocating 4000000 bytes.")

    monkeypatch.setattr(_transfer, "to_devices", to_devices)
    with pytest.raises(mg.OutOfMemoryError) as caught:
        mg.put(np.ones((1000, 1000), np.float32), "dev5")
    text = str(caught.value)
    assert text.startswith("mg.put: a device ran out of memory")
    assert "the allocation that failed: 3.8 MiB" in text and "  dev5 (cpu5, " in text and "dev4" not in text
    assert "fixes that apply: put the value on a context with more free memory" in text


def test_mgkit_notes_which_call_placed_an_array_until_it_is_gone():
    a = mg.put(np.ones(3, np.float32), "dev1")
    b = mg.transfer(a, "dev2")
    assert _oom.placed_by(a) == _oom.Placed("mg.put", None) and _oom.placed_by(b).what == "mg.transfer"
    assert _oom.placed_by(jnp.ones(3)) is None
    key = id(a)
    del a
    gc.collect()
    assert key not in _oom._PLACED  # the note goes with the array


def test_a_state_mg_fits_predicts_too_big_lists_the_same_facts(monkeypatch):
    monkeypatch.setattr(_memory, "device_limit", lambda device: 500_000)
    params = {"w": jnp.zeros((512, 512))}
    with pytest.raises(ValueError, match=r"does not fit.*shard='fsdp'") as caught:
        mg.Trainer(lambda p, b: jnp.sum(p["w"]), optax.adam(1e-3), params, contexts=["dev0", "dev1"])
    text = str(caught.value)
    assert "the training state per context (parameters + optimizer state + batch = total / limit):" in text
    assert "  dev0: 1.0 MiB + 2.0 MiB + 0 B = 3.0 MiB / 488.3 KiB" in text
    assert "the largest live arrays per context:" in text and "float32[512,512]  1.0 MiB" in text


@pytest.mark.parametrize(
    ("text", "oom", "needed"),
    [
        ("RESOURCE_EXHAUSTED: Out of memory allocating 2199023256104 bytes.", True, 2199023256104),
        ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.50GiB.", True, int(1.5 * 2**30)),
        ("Resource exhausted: Failed to allocate request for 2.0KiB (2048B) on device", True, None),
        ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory", True, None),
        ("INTERNAL: Failed to allocate 12 bytes? no: a different failure", False, None),
    ],
)
def test_what_the_program_needed_is_read_from_the_error(text, oom, needed):
    assert _oom.is_out_of_memory(RuntimeError(text)) is oom
    if oom:
        assert _oom.needed_bytes(text) == needed
    assert not _oom.is_out_of_memory(ValueError(text))  # XLA's errors are RuntimeErrors


def test_the_report_names_the_cell_that_placed_an_array():
    with ipython_shell() as ip:
        ip.run_cell("import numpy as np, mgkit as mg")
        result = ip.run_cell("kept = mg.put(np.ones((300, 1000), np.float32), 'dev6')", store_history=True)
        assert _oom.placed_by(ip.user_ns["kept"]) == _oom.Placed("mg.put", result.execution_count)
        facts = _oom.live_facts([("dev6", jax.devices()[6])])
        assert f"    float32[300,1000]  1.1 MiB  (placed by mg.put in In [{result.execution_count}])" in facts


def test_after_a_real_out_of_memory_error_the_kit_goes_on(tmp_path):
    def loss(p, b):
        big = jnp.cumsum(jnp.full((1 << 38,), b["x"].sum()))  # a 1 TiB temporary: XLA refuses it
        return jnp.mean((b["x"] @ p["w"]) ** 2) + big[-1] * 0

    tr = mg.Trainer(loss, optax.adam(1e-3), {"w": jnp.zeros((16, 4))}, contexts=["dev0", "dev1"])
    with pytest.raises(mg.OutOfMemoryError):
        tr.fit({"x": np.ones((64, 16), np.float32)}, steps=1, batch_size=32, progress=False)
    mg.synchronize()  # the failed step's outputs hold its error: waited for, not raised again
    with mg.profile(tmp_path, show=False) as prof:
        float(mg.put(np.ones(3), "dev0").sum())
    assert prof.trace is not None


def _too_big(p, b):
    big = jnp.cumsum(jnp.full((1 << 38,), b["x"].sum()))  # a 1 TiB temporary: more than the host has
    return jnp.mean((b["x"] @ p["w"]) ** 2) + big[-1] * 0


def test_a_step_too_big_for_the_devices_is_refused_and_the_trainer_keeps_its_state():
    tr = mg.Trainer(_too_big, optax.adam(1e-3), {"w": jnp.ones((16, 4))}, contexts=["dev0", "dev1"])
    with pytest.raises(mg.OutOfMemoryError) as caught:
        tr.fit({"x": np.ones((64, 16), np.float32)}, steps=3, batch_size=32, progress=False)
    text = str(caught.value)
    assert "per device for the program (2.0 TiB), and 2 CPU device(s) share the host's" in text
    assert "refused before it ran, so its arguments are untouched" in text
    assert tr.step == 0  # the last completed step's count, state and optimizer state
    np.testing.assert_array_equal(np.asarray(tr.params["w"]), np.ones((16, 4), np.float32))
    assert int(tr.opt_state[0].count) == 0


def test_a_step_that_fails_while_it_runs_says_its_state_is_gone(monkeypatch):
    from mgkit._spmd import _collectives

    monkeypatch.setattr(_collectives, "refuse_too_big", lambda compiled, devices: None)  # not foreseen
    tr = mg.Trainer(_too_big, optax.adam(1e-3), {"w": jnp.ones((16, 4))}, contexts=["dev0", "dev1"])
    data = {"x": np.ones((64, 16), np.float32)}
    with pytest.raises(mg.OutOfMemoryError) as caught:
        tr.fit(data, steps=3, batch_size=32, progress=False)
    assert caught.value.args[0].endswith(
        "the trainer's state of step 0 was given to step 1, which ran out of memory while it ran (a "
        "step donates its state, so that one copy is in memory), so it is gone; restore a checkpoint "
        "(fit(..., resume=True)) or make a new Trainer"
    )
    assert tr.step == 0
    with pytest.raises(RuntimeError, match=r"^Trainer.fit: the trainer.s state of step 0 was given to step"):
        tr.fit(data, steps=1, batch_size=32, progress=False)
    for read, where in ((lambda: tr.params, "params"), (lambda: tr.opt_state, "opt_state")):
        with pytest.raises(RuntimeError, match=rf"^Trainer.{where}: the trainer.s state of step 0 was given"):
            read()
    mg.synchronize()  # the failed step's outputs hold its error: waited for, not raised again


@pytest.mark.parametrize("rows", [8, 9])  # an even split (one SPMD program) and an uneven one
def test_a_parallel_call_too_big_for_the_devices_is_reported_when_called(rows):
    def f(x):
        big = jnp.cumsum(jnp.full((1 << 38,), x.sum()))
        return x * 2 + big[-1] * 0

    with pytest.raises(mg.OutOfMemoryError) as caught:
        mg.parallel(f)(np.ones((rows, 3), np.float32))
    text = str(caught.value)
    assert text.startswith("mg.parallel: a device ran out of memory (RESOURCE_EXHAUSTED: Out of memory")
    assert "fixes that apply: fewer rows per call" in text


def test_the_report_says_whether_the_state_or_the_steps_temporaries_did_not_fit():
    from types import SimpleNamespace

    from mgkit._oom import program_needs

    def compiled(args, temp):
        stats = SimpleNamespace(
            argument_size_in_bytes=args,
            output_size_in_bytes=args,
            alias_size_in_bytes=args,
            temp_size_in_bytes=temp,
        )
        return SimpleNamespace(memory_analysis=lambda: stats)

    mib = 2**20
    assert "limit" not in program_needs(compiled(10 * mib, 10 * mib), limit=64 * mib)  # it fits: no verdict
    assert "limit" not in program_needs(compiled(10 * mib, 10 * mib))  # no limit known
    state = program_needs(compiled(80 * mib, 10 * mib), limit=64 * mib)
    assert (
        "its arguments alone (the state and the batch) are over the 64.0 MiB limit: split the state" in state
    )
    temps = program_needs(compiled(10 * mib, 60 * mib), limit=64 * mib)
    assert "fit the 64.0 MiB limit, and the step's temporaries" in temps and "accumulate=4" in temps
