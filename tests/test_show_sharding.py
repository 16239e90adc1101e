"""mg.show_sharding: which block of each leaf lives on which context, from shapes and shardings."""

import math
import struct
import sys
import time
import xml.etree.ElementTree as ET

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mgkit as mg
from mgkit import _shards
from mgkit.views import _sharding


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: math.prod(shape)]).reshape(shape), names)


def _sds(shape, mesh, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _grid_lines(text):
    """The lines of the first drawn grid: the header and the rows under it."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  dim") or line == "  scalar")
    return lines[start:]


# -- the blocks ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mesh_shape", "spec", "shape"),
    [
        ((8,), P("x"), (16, 3)),
        ((4, 2), P("x", "y"), (8, 6)),
        ((4, 2), P("y", "x"), (8, 4)),
        ((4, 2), P(("y", "x")), (16,)),
        ((4, 2), P(None, "x"), (3, 4, 5)),
        ((4, 2), P(), (5, 5)),
        ((2, 2, 2), P("z", None, ("x", "y")), (2, 3, 8)),
    ],
)
def test_blocks_agree_with_jax_devices_indices_map(mesh_shape, spec, shape):
    names = ("x", "y", "z")[: len(mesh_shape)]
    sharding = NamedSharding(_mesh(mesh_shape, names), spec)
    lay = _shards.layout(jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding))
    mine = {p.device: (lay.blocks[p.block].start, lay.blocks[p.block].stop) for p in lay.places}
    theirs = {
        d: tuple(zip(*(s.indices(n)[:2] for s, n in zip(idx, shape, strict=True)), strict=True))
        for d, idx in sharding.devices_indices_map(shape).items()
    }
    assert mine == theirs
    assert lay.shard == sharding.shard_shape(shape)
    assert [p.context for p in lay.places] == [f"dev{d.id}" for d in np.array(sharding.mesh.devices).flat]


def test_padded_blocks_on_an_abstract_mesh():
    lay = _shards.layout(_sds((10, 3), AbstractMesh((4,), ("x",)), P("x")))
    assert lay.padded == (0,) and lay.shard == (3, 3) and lay.parts == (4, 1)
    assert [(b.start, b.stop) for b in lay.blocks] == [
        ((0, 0), (3, 3)),
        ((3, 0), (6, 3)),
        ((6, 0), (9, 3)),
        ((9, 0), (10, 3)),
    ]
    assert [p.context for p in lay.places] == ["#0", "#1", "#2", "#3"]
    assert lay.shard_bytes == 36 and lay.nbytes == 120
    empty = _shards.layout(_sds((5,), AbstractMesh((4,), ("x",)), P("x")))
    assert [(b.start, b.stop) for b in empty.blocks] == [
        ((0,), (2,)),
        ((2,), (4,)),
        ((4,), (5,)),
        ((5,), (5,)),
    ]


def test_bytes_per_context_sums_the_blocks_each_context_stores():
    mesh = _mesh((4, 2), ("x", "y"))
    tree = {
        "w": jax.device_put(jnp.ones((16, 6)), NamedSharding(mesh, P("x", "y"))),  # 48 B each
        "b": jax.device_put(jnp.ones(6), NamedSharding(mesh, P())),  # 24 B on every context
        "alone": mg.put(jnp.ones(5), "dev3"),  # 20 B on dev3
        "rows": jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, P("x"))),  # 16 B each
    }
    rows = _shards.bytes_per_context(tree)
    got = {r.context: (r.nbytes, r.leaves) for r in rows}
    assert got == {f"dev{i}": (48 + 24 + 16 + (20 if i == 3 else 0), 3 + (i == 3)) for i in range(8)}
    assert [r.device for r in rows] == jax.devices()[:8]
    total = sum(r.nbytes for r in rows)
    assert total == 384 + 8 * 24 + 20 + 2 * 64  # every copy of a replicated block counts
    view = mg.show_sharding(tree, widget=False)
    text = repr(view)
    assert "per context" in text and "dev3     cpu3    108 B       4" in text
    assert "['w']      float32[16, 6]  384 B  split 4 x 2 (dim 0 over 'x', dim 1 over 'y')" in text


# -- the text ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", range(7))
def test_every_rank_from_0_to_6_draws(rank):
    shape = (4, 2, 6, 2, 4, 2)[:rank]
    spec = P(*([None] * (rank - 1)), "x") if rank else P()
    mesh = _mesh((2,), ("x",))
    x = jax.device_put(jnp.ones(shape), NamedSharding(mesh, spec)) if rank else jnp.float32(1)
    view = mg.show_sharding(x, widget=False)
    text = repr(view)
    assert f"float32[{', '.join(map(str, shape))}]" in text
    lines = _grid_lines(text)
    if rank == 0:
        assert lines[:2] == ["  scalar", "          dev0"] and "whole on dev0" in text
    elif rank == 1:
        assert lines[:2] == ["  dim 0  0:2   2:4", "         dev0  dev1"]
    else:
        last = rank - 1
        assert lines[0].split()[:3] == ["dim", str(last - 1), "\\"]
        assert "dev0" in lines[1] and "dev1" in lines[1]
    if rank > 2:
        hidden = ", ".join(f"dim {d} ({shape[d]}) whole" for d in range(rank - 2))
        assert f"  not drawn: {hidden}" in text


def test_two_split_axes_of_a_rank_4_leaf_are_drawn_and_the_others_summarised():
    mesh = _mesh((2, 2, 2), ("x", "y", "z"))
    x = _sds((4, 6, 8, 2), mesh, P("x", None, ("y", "z")))
    text = repr(mg.show_sharding(x, widget=False))
    lines = _grid_lines(text)
    assert lines[0].split() == ["dim", "0", "\\", "dim", "2", "0:2", "2:4", "4:6", "6:8"]
    assert lines[1].split() == ["0:2", "dev0", "dev1", "dev2", "dev3"]
    assert "not drawn: dim 1 (6) whole, dim 3 (2) whole" in text
    three = repr(mg.show_sharding(_sds((2, 4, 6), mesh, P("x", "y", "z")), widget=False))
    assert "not drawn: dim 0 (2) in 2 blocks over 'x'; each cell lists the contexts of its 2 blocks" in three
    assert _grid_lines(three)[1].split() == ["0:2", "dev0,dev4", "dev1,dev5"]


def test_replicated_split_and_padded_are_marked():
    mesh = _mesh((4, 2), ("x", "y"))
    text = repr(mg.show_sharding(_sds((10, 3), mesh, P("x")), widget=False))
    assert "split 4 x 1 (dim 0 over 'x'); replicated x2; padded dim 0: 10 in 4 blocks of 3" in text
    assert "  9:10 pad 2     dev6,dev7" in text
    whole = repr(mg.show_sharding(_sds((3,), mesh, P()), widget=False))
    assert "replicated x8; 12 B per context" in whole and "dev0,dev1 +6" in whole
    assert "split" not in whole and "padded" not in whole


def test_context_names_label_the_blocks_with_a_fallback_for_devices_without_one():
    mg.use_contexts("enc->cpu0;dec->cpu1", verbose=False)
    x = jax.device_put(jnp.ones((4, 4)), NamedSharding(_mesh((4,), ("x",)), P("x")))
    view = mg.show_sharding(x, widget=False)
    assert [p.context for p in view.layouts[0].places] == ["enc", "dec", "cpu2", "cpu3"]
    assert "  0:1            enc" in repr(view) and "  3:4            cpu3" in repr(view)


def test_the_two_cases_other_views_fail_on_render():
    """JAX's own view draws only 1-D and 2-D arrays; treescope fails on 5120 x 5120 over 4 devices."""
    big = jax.device_put(jnp.zeros((5120, 5120)), NamedSharding(_mesh((2, 2), ("x", "y")), P("x", "y")))
    text = repr(mg.show_sharding(big, widget=False))
    assert "float32[5120, 5120]  100.0 MiB" in text and "25.0 MiB per context" in text
    assert _grid_lines(text)[1:3] == ["  0:2560         dev0    dev1", "  2560:5120      dev2    dev3"]
    deep = _sds((2, 3, 4, 8, 5), _mesh((4, 2), ("x", "y")), P(None, None, "y", "x"))
    assert "dim 2 \\ dim 3" in repr(mg.show_sharding(deep, widget=False))


def test_a_leaf_of_10_to_the_12_elements_over_512_devices_is_fast():
    mesh = AbstractMesh((32, 16), ("x", "y"))
    x = _sds((10**6, 10**6), mesh, P("x", "y"))
    t0 = time.perf_counter()
    view = mg.show_sharding(x, widget=False)
    text, page = view.text(), view.html()
    seconds = time.perf_counter() - t0
    assert seconds < 0.5, seconds  # about 5 ms; benchmarks/bench_show_sharding.py measures it
    assert "on 512 context(s), 7.3 GiB to 7.3 GiB each" in text
    assert "#511" in text and "..." in text and "#511" in page
    assert len(text.splitlines()) < 20


def test_prng_keys_count_their_bytes():
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8), NamedSharding(_mesh((8,), ("x",)), P("x")))
    [lay] = _shards.layouts(keys)
    assert lay.nbytes == keys.nbytes == 64 and lay.shard_bytes == 8
    assert "key<fry>[8]  64 B" in repr(mg.show_sharding(keys, widget=False))


def test_shapes_from_eval_shape_of_a_jitted_function():
    s = NamedSharding(_mesh((8,), ("x",)), P("x"))
    shapes = jax.eval_shape(jax.jit(lambda: {"w": jnp.zeros((64, 4))}, out_shardings={"w": s}))
    rows = _shards.bytes_per_context(shapes)
    assert [(r.context, r.nbytes) for r in rows] == [(f"dev{i}", 128) for i in range(8)]


def test_drawn_from_the_sharding_only_the_ledger_and_the_data_untouched():
    x = jax.device_put(jnp.ones((64, 8)), NamedSharding(_mesh((8,), ("x",)), P("x")))
    y = mg.put(jnp.ones(3), "dev2")
    mg.ledger().flush()
    before = (mg.ledger().totals(), len(mg.ledger().records()), len(jax.live_arrays()))
    view = mg.show_sharding({"x": x, "y": y}, widget=False)
    view.text(), view.html()
    mg.ledger().flush()
    assert (mg.ledger().totals(), len(mg.ledger().records()), len(jax.live_arrays())) == before
    x.delete()  # a deleted array's data is gone: its sharding still draws
    assert "split 8 x 1" in repr(mg.show_sharding(x, widget=False))


# -- widget, HTML and picture --------------------------------------------------------------------


def test_widget_html_and_text(monkeypatch):
    tree = {"a": _sds((10, 3), _mesh((4,), ("x",)), P("x")), "b": mg.put(jnp.ones(2), "dev1")}
    view = mg.show_sharding(tree, widget=True)
    assert "mgkit-sharding" in view.widget._dom_classes
    bundle = view._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and bundle["text/plain"] == repr(view)
    page = view.widget.children[0].value
    assert "<svg" in page and "stroke-dasharray" in page  # the padding of the short block is dashed
    ET.fromstring(view.svg(view._grids[0]))  # well-formed SVG
    assert "per context</caption>" in page and "dev1" in page
    text_view = mg.show_sharding(tree, widget=False)
    assert text_view.widget is None and set(text_view._repr_mimebundle_()) == {"text/plain", "text/html"}
    monkeypatch.setattr(_sharding, "in_kernel", lambda: True)
    assert mg.show_sharding(tree).widget is not None  # in a notebook: a widget
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    assert mg.show_sharding(tree).widget is None  # without ipywidgets: text and HTML


def test_save_png(tmp_path):
    tree = {"a": _sds((10, 3), _mesh((4,), ("x",)), P("x")), "b": jnp.ones((2, 3, 4)), "c": np.ones(3)}
    path = mg.show_sharding(tree, widget=False).save_png(tmp_path / "sharding.png", dpi=40)
    head = (tmp_path / "sharding.png").read_bytes()[:24]
    width, height = struct.unpack(">II", head[16:24])
    assert path == str(tmp_path / "sharding.png") and head[:8] == b"\x89PNG\r\n\x1a\n" and height > width


def test_limits_shown_against_each_contexts_memory(monkeypatch):
    from mgkit import _devices

    monkeypatch.setattr(_devices, "_simulated_limit", 4096)
    view = mg.show_sharding(
        {"a": mg.put(jnp.ones(256), "dev0"), "b": mg.put(jnp.ones(2), "dev1")}, widget=False
    )
    assert "dev0     cpu0    1.0 KiB       1  25.0% of 4.0 KiB" in repr(view)


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tree", "error", "message"),
    [
        (
            {"w": 1.5},
            TypeError,
            r"mg.show_sharding: leaf \['w'\] is float 1.5, not a jax array or a "
            r"jax.ShapeDtypeStruct with a sharding; put it on devices first or describe it: "
            r"e.g. jax.device_put",
        ),
        (
            {"w": jax.ShapeDtypeStruct((4,), jnp.float32)},
            ValueError,
            r"leaf \['w'\] \(ShapeDtypeStruct float32\[4\]\) has no sharding; expected a jax array or a "
            r"jax.ShapeDtypeStruct with a sharding: e.g.",
        ),
        ({}, ValueError, r"mg.show_sharding: dict \{\} has no arrays to show"),
        (
            {"f": jax.nn.relu, "name": "net"},
            ValueError,
            r"mg.show_sharding: dict .* has no arrays to show \(its leaves \['f'\] \(custom_jvp relu\), "
            r"\['name'\] \(str 'net'\) are held static\); give a jax",
        ),
    ],
)
def test_bad_input_says_what_was_expected(tree, error, message):
    with pytest.raises(error, match=message):
        mg.show_sharding(tree)


def test_a_numpy_leaf_is_on_the_host_and_no_context_holds_it():
    tree = {"w": np.ones((3, 5), np.float32), "b": mg.put(jnp.ones(2), "dev1"), "f": jax.nn.relu}
    view = mg.show_sharding(tree, widget=False)
    w = next(lay for lay in view.layouts if lay.path == "['w']")  # the function is skipped
    assert [lay.path for lay in view.layouts] == ["['b']", "['w']"]
    assert w.places == () and w.shard_bytes == 0 and w.nbytes == 60
    assert [(c.context, c.nbytes) for c in view.per_context] == [("dev1", 8)]  # w counts nowhere
    text = str(view)
    assert (
        text.splitlines()[0]
        == "mgkit sharding: 2 leaves, 68 B; on 1 context(s), 8 B to 8 B each; 60 B on the host (numpy)"
    )
    assert (
        "['w']  float32[3, 5]  60 B  on the host (numpy)\n  on the host (numpy): no context holds it" in text
    )
    assert "on the host (numpy)" in view.html()
    alone = str(mg.show_sharding(np.zeros(4, np.float32), widget=False))
    assert alone.startswith("mgkit sharding: 1 leaf, 16 B; on no context; 16 B on the host (numpy)")


def test_a_tracer_is_refused_with_what_to_do():
    seen = []

    def f(x):
        try:
            mg.show_sharding(x)
        except TypeError as e:
            seen.append(str(e))
        return x

    jax.jit(f)(jnp.ones(3))
    assert "is a tracer (inside jax.jit, jax.grad or jax.vmap)" in seen[0]
    assert "jax.eval_shape" in seen[0]


def test_eval_shape_without_out_shardings_has_no_sharding():
    shapes = jax.eval_shape(lambda: jnp.zeros(4))
    with pytest.raises(
        ValueError, match=r"\(the value itself\) \(ShapeDtypeStruct float32\[4\]\) has no sharding"
    ):
        mg.show_sharding(shapes)


def test_a_sharding_that_cannot_be_read_is_named():
    class NoMesh(jax.ShapeDtypeStruct):  # jax >= 0.11: a PartitionSpec with no mesh set raises
        @property
        def sharding(self):
            raise TypeError("the context mesh cannot be empty")

    with pytest.raises(ValueError, match=r"leaf \['w'\]: its sharding cannot be read: the context mesh"):
        mg.show_sharding({"w": NoMesh((2,), jnp.float32)})
