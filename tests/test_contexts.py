"""Context maps (the syntax of Theano's context maps), the ``on`` scope, and name lookup."""

import threading
import time

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import mgkit as mg

# -- parsing -------------------------------------------------------------------------------


def test_parse_and_format_round_trip():
    m = mg.ContextMap.parse("  dev0 -> cuda0 ;dev1->cuda1;  ")
    assert list(m.items()) == [("dev0", "cuda0"), ("dev1", "cuda1")]
    assert str(m) == "dev0->cuda0;dev1->cuda1"
    assert mg.ContextMap.parse(str(m)) == m
    assert hash(mg.ContextMap.parse(str(m))) == hash(m)
    assert repr(m) == "ContextMap('dev0->cuda0;dev1->cuda1')"


def test_map_is_immutable_and_hashable():
    m = mg.ContextMap.parse("a->cpu0")
    with pytest.raises(AttributeError, match="immutable"):
        m._items = ()
    with pytest.raises(TypeError):
        m["b"] = "cpu1"  # type: ignore[index]
    assert {m: 1}[mg.ContextMap.parse("a->cpu0")] == 1


def test_same_device_under_several_names_and_cpu_alias():
    m = mg.ContextMap.parse("a->cpu;b->cpu0;c->gpu0")
    assert dict(m) == {"a": "cpu0", "b": "cpu0", "c": "gpu0"}
    mg.use_contexts("a->cpu;b->cpu0", verbose=False)
    assert mg.device_of("a") == mg.device_of("b") == jax.devices("cpu")[0]


def test_order_matters_for_equality():
    assert mg.ContextMap.parse("a->cpu0;b->cpu1") != mg.ContextMap.parse("b->cpu1;a->cpu0")


def test_unicode_names_are_fine():
    m = mg.use_contexts("gerät0->cpu0;δ->cpu1;设备->cpu2", verbose=False)
    assert m.names == ("gerät0", "δ", "设备")
    assert mg.device_of("设备").id == 2


def test_large_map_parses_fast():
    text = ";".join(f"n{i}->cpu{i % 8}" for i in range(10_000))
    t0 = time.perf_counter()
    m = mg.ContextMap.parse(text)
    mg.use_contexts(m, verbose=False)
    assert time.perf_counter() - t0 < 2.0
    assert len(m) == 10_000 and mg.device_of("n9999").id == 9999 % 8


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty context map"),
        (";", "empty context map"),
        ("   ", "empty context map"),
        ("dev0->cpu0;;dev1->cpu1", "empty mapping between ';'"),
        ("dev0 cpu0", "has no '->'"),
        ("dev0=>cpu0", "has no '->'"),
        ("->cpu0", "empty context name"),
        ("dev0->", "empty device"),
        ("a->b->cpu0", "more than one '->'"),
        ("cuda0->cpu0", "begins with 'cuda'"),
        ("cudafast->cpu0", "begins with 'cuda'"),
        ("opencl_dev->cpu0", "begins with 'opencl'"),
        ("cpu_main->cpu0", "begins with 'cpu'"),
        ("GPU1->cpu0", "begins with 'gpu'"),
        ("tpuA->cpu0", "begins with 'tpu'"),
        ("dev0->cpu0;dev0->cpu1", "appears more than once"),
        ("dev 0->cpu0", "whitespace"),
        ("dev\x00->cpu0", "control characters"),
        ("dev0->opencl0:0", "not supported by JAX"),
        ("dev0->opencl1", "not supported by JAX"),
        ("dev0->CUDA0", "did you mean 'cuda0'"),
        ("dev0->cuda", "not a device name"),
        ("dev0->cuda-1", "not a device name"),
        ("dev0->cuda01", "not a device name"),
        ("dev0->nvidia0", "not a device name"),
        ("dev0->cpu0 cpu1", "not a device name"),
    ],
)
def test_bad_maps_explain_themselves(text, message):
    with pytest.raises(mg.ContextError, match=message) as info:
        mg.ContextMap.parse(text)
    assert isinstance(info.value, ValueError)


def test_bad_map_types():
    with pytest.raises(TypeError, match="a context map is a string like 'dev0->cuda0;dev1->cuda1', got int"):
        mg.ContextMap.parse(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got NoneType"):
        mg.use_contexts(None)  # type: ignore[arg-type]


def test_cuda_on_cpu_only_machine_names_devices_that_exist():
    with pytest.raises(mg.ContextError) as info:
        mg.use_contexts("dev0->cuda0")
    msg = str(info.value)
    assert "'cuda0' does not exist" in msg and "no CUDA devices" in msg
    assert "devices that exist: cpu0, cpu1" in msg and "cpu7" in msg


def test_index_past_last_device():
    with pytest.raises(mg.ContextError) as info:
        mg.use_contexts("dev0->cpu0;dev1->cpu8")
    msg = str(info.value)
    assert "context 'dev1'" in msg and "only 8 cpu device(s), numbered 0..7" in msg
    assert "mg.simulate(9)" in msg


def test_failed_use_contexts_keeps_the_previous_map():
    before = mg.context_map()
    with pytest.raises(mg.ContextError):
        mg.use_contexts("x->cpu0;y->tpu3")
    assert mg.context_map() == before


def test_verbose_prints_each_mapping(capsys):
    mg.use_contexts("dev0->cpu0;dev1->cpu1")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Mapped name dev0 to device cpu0: ")
    assert out[1].startswith("Mapped name dev1 to device cpu1: ")
    assert "CPU device 1 of 8" in out[1]


def test_unknown_context_lists_the_contexts():
    mg.use_contexts("dev0->cpu0;dev1->cpu1", verbose=False)
    with pytest.raises(mg.ContextError) as info:
        mg.device_of("dev9")
    msg = str(info.value)
    assert "unknown context 'dev9'" in msg and "dev0, dev1" in msg
    assert "mg.use_contexts('dev0->cpu0;dev1->cpu1;dev9->cpu0')" in msg


def test_device_names_work_where_contexts_do():
    assert mg.device_of("cpu5") == jax.devices("cpu")[5]
    assert mg.device_of("cpu") == jax.devices("cpu")[0]
    assert mg.device_of(jax.devices()[3]) == jax.devices()[3]


def test_device_of_rejects_non_strings():
    with pytest.raises(TypeError, match="got int 0"):
        mg.device_of(0)  # type: ignore[arg-type]


# -- defaults ------------------------------------------------------------------------------


def test_default_map_names_every_cpu_device_without_accelerators():
    from tests.conftest import run_python

    r = run_python(
        "import mgkit as mg; mg.simulate(3); print(mg.context_map())",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "dev0->cpu0;dev1->cpu1;dev2->cpu2"


class _CountedDevices(tuple):
    """A device list that counts the entries every scan of it reads, and stops a scan that reads
    more than ``limit`` in all (a quadratic build would read n * n)."""

    reads = 0
    limit = 0

    def __iter__(self):
        for item in super().__iter__():
            type(self).reads += 1
            if type(self).reads > type(self).limit:
                raise AssertionError(f"the default map read more than {type(self).limit} device entries")
            yield item


@pytest.mark.parametrize("n", [1_000, 5_000])
def test_default_map_over_thousands_of_devices_is_built_in_linear_work(monkeypatch, n):
    from mgkit import _contexts, _devices

    class FakeDevice:
        def __init__(self, i):
            self.id = i

    devices = _CountedDevices((f"cuda{i}", FakeDevice(i)) for i in range(n))
    monkeypatch.setattr(_CountedDevices, "reads", 0)
    monkeypatch.setattr(_CountedDevices, "limit", 10 * n)
    monkeypatch.setattr(_devices, "_all_devices", lambda: devices)
    monkeypatch.setattr(_contexts, "_installed", None)  # restored afterwards: the next test's map
    monkeypatch.delenv("MGKIT_CONTEXTS", raising=False)
    cmap = mg.context_map()  # builds and installs the default map, as on first use
    assert len(cmap) == n and cmap[f"dev{n - 1}"] == f"cuda{n - 1}"
    assert mg.device_of(f"dev{n - 1}") is devices[n - 1][1]
    assert _CountedDevices.reads <= 4 * n  # a few scans of the list, not one per device


def test_mgkit_contexts_env_gives_the_default_map():
    from tests.conftest import run_python

    r = run_python(
        "import mgkit as mg; print(mg.context_map()); print(mg.device_of('b').id)",
        env={"MGKIT_SIMULATE": "4", "MGKIT_CONTEXTS": "a->cpu3;b->cpu1"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["a->cpu3;b->cpu1", "1"]


def test_bad_mgkit_contexts_env_is_named():
    from tests.conftest import run_python

    r = run_python("import mgkit as mg; mg.context_map()", env={"MGKIT_CONTEXTS": "cuda0->cpu0"})
    assert r.returncode != 0
    assert "MGKIT_CONTEXTS='cuda0->cpu0' is not a valid context map" in r.stderr


# -- scope ---------------------------------------------------------------------------------


def test_on_places_new_arrays_and_nests():
    assert mg.current() == "dev0"
    with mg.on("dev1"):
        assert mg.current() == "dev1"
        a = jnp.ones(3)
        with mg.on("dev2"):
            b = jnp.zeros(2)
            assert mg.current() == "dev2"
        c = jnp.arange(3)
    assert mg.current() == "dev0"
    assert a.devices() == {mg.device_of("dev1")}
    assert b.devices() == {mg.device_of("dev2")}
    assert c.devices() == {mg.device_of("dev1")}


def test_on_as_decorator_is_reentrant():
    @mg.on("dev3")
    def depth(n):
        x = jnp.ones(1)
        return [(mg.current(), mg.where(x))] + (depth(n - 1) if n else [])

    assert depth(2) == [("dev3", "dev3")] * 3
    assert mg.current() == "dev0"


def test_on_is_thread_local():
    seen = {}
    barrier = threading.Barrier(2)

    def worker(name):
        with mg.on(name):
            barrier.wait(timeout=10)
            seen[name] = (mg.current(), mg.where(jnp.ones(2)))
            barrier.wait(timeout=10)

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("dev4", "dev5")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert seen == {"dev4": ("dev4", "dev4"), "dev5": ("dev5", "dev5")}


def test_on_restores_scope_after_an_exception():
    with pytest.raises(ZeroDivisionError), mg.on("dev6"):
        1 / 0  # noqa: B018
    assert mg.current() == "dev0"


def test_on_unknown_context():
    with pytest.raises(mg.ContextError, match="unknown context 'gpu_box'"):
        mg.on("gpu_box")


def test_incompatible_devices_explained_in_context_names():
    a = mg.put(np.ones(3, np.float32), "dev1")
    b = mg.put(np.ones(3, np.float32), "dev2")
    with pytest.raises(mg.DeviceMismatchError) as info, mg.on("dev1"):
        _ = a + b
    msg = str(info.value)
    assert "is on dev1" in msg and "is on dev2" in msg and "mg.colocate" in msg
    assert "incompatible devices" in str(info.value.__cause__)


# -- property tests ------------------------------------------------------------------------

_PLATFORMS = ("cuda", "opencl", "cpu", "gpu", "tpu", "rocm")
_name = st.text(
    alphabet=st.characters(
        blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp", "Cf", "Co", "Cn"), blacklist_characters=";-"
    ),
    min_size=1,
    max_size=12,
).filter(lambda s: s == s.strip() and not s.lower().startswith(_PLATFORMS))
_device = st.builds(
    lambda p, i: f"{p}{i}", st.sampled_from(["cpu", "cuda", "gpu", "tpu", "rocm"]), st.integers(0, 99)
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_name, _device), min_size=1, max_size=10, unique_by=lambda t: t[0]))
def test_format_parse_round_trip(pairs):
    m = mg.ContextMap(pairs)
    again = mg.ContextMap.parse(str(m))
    assert again == m and hash(again) == hash(m)
    assert mg.ContextMap.parse(" ; ".join(f" {n} -> {d} " for n, d in pairs) + ";") == m


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_arbitrary_text_parses_or_raises_value_error(text):
    try:
        m = mg.ContextMap.parse(text)
    except ValueError as e:
        assert str(e)
    else:
        assert mg.ContextMap.parse(str(m)) == m


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(_name, _device), min_size=1, max_size=5, unique_by=lambda t: t[0]),
    st.sampled_from(["dup", "empty_name", "reserved", "arrow", "opencl", "baddev"]),
)
def test_generated_invalid_maps_raise_value_error(pairs, how):
    name, dev = pairs[0]
    bad = {
        "dup": [*pairs, (name, "cpu0")],
        "empty_name": [*pairs, ("", "cpu0")],
        "reserved": [*pairs, ("cuda" + name, "cpu0")],
        "arrow": [(name + "->x", dev)],
        "opencl": [(name, "opencl0:1")],
        "baddev": [(name, dev + "x")],
    }[how]
    text = ";".join(f"{n}->{d}" for n, d in bad)
    with pytest.raises(ValueError):
        mg.ContextMap.parse(text)
