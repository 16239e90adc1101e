"""Collectives inside compiled programs: read from the HLO text once, recorded on each run."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mgkit as mg
from mgkit import _spmd
from mgkit._ledger import Kind

# -- reading the HLO text ------------------------------------------------------------------

_TUPLE_ALL_REDUCE = (
    "  %all-reduce.3 = (f32[3,16]{1,0}, f32[3]{0}, f32[]) all-reduce(%dot.1, %fusion, %fusion.1), "
    "channel_id=3, replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, use_global_device_ids=true, "
    'to_apply=%add.clone, metadata={op_name="jit(step)/transpose(jvp())/dot_general"}'
)


def _one(line: str, n: int = 8) -> _spmd.Collective:
    (found,) = _spmd.collectives_in(line, n)
    return found


def test_a_tuple_all_reduce_sums_its_elements_over_the_mesh_spelling():
    c = _one(_TUPLE_ALL_REDUCE)
    assert c.op == "all-reduce" and c.nbytes == (48 + 3 + 1) * 4 and c.groups == (tuple(range(8)),)


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        ("{{0,1,2,3},{4,5,6,7}}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
        ("mesh['a'=2,'b'=4] {'a'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("mesh['a'=2,'b'=4] {'a','b'}", (tuple(range(8)),)),
        ("{}", (tuple(range(8)),)),
        ("[oops]<=[8]", (tuple(range(8)),)),  # not understood: every device
    ],
)
def test_replica_groups_in_each_spelling(groups, expected):
    line = f"  %ag = f32[2,4]{{1,0}} all-gather(%p), channel_id=1, replica_groups={groups}, dimensions={{0}}"
    assert _one(line).groups == expected


def test_permutes_async_starts_and_done_ops():
    text = "\n".join(
        [
            "  %cp = f32[4,4]{1,0} collective-permute(%p), channel_id=1, source_target_pairs={{0,1},{1,0}}",
            "  %ags = ((f32[4]{0}), f32[16]{0}) all-gather-start(%p), replica_groups=[1,4]<=[4], "
            "dimensions={0}",
            "  %agd = f32[16]{0} all-gather-done(%ags)",
            "  %cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%p), "
            "source_target_pairs={{2,3}}",
            "  %ars = bf16[8]{0} all-reduce-start(%p), replica_groups={{0,1,2,3}}, to_apply=%add",
            "  ROOT %rs = f32[2]{0} reduce-scatter(%p), replica_groups={{0,1,2,3}}, dimensions={0}",
            "  %a2a = (f32[1,4]{1,0}, f32[1,4]{1,0}) all-to-all(%x, %y), replica_groups={{0,1}}",
            "  %add = f32[4]{0} add(%all-reduce, %x)",  # uses a collective's result: not one
        ]
    )
    found = _spmd.collectives_in(text, 4)
    assert [(c.op, c.nbytes) for c in found] == [
        ("collective-permute", 64),
        ("all-gather", 64),  # the result of (operands, results)
        ("collective-permute", 32),
        ("all-reduce", 16),
        ("reduce-scatter", 8),
        ("all-to-all", 32),
    ]
    assert found[0].pairs == ((0, 1), (1, 0)) and found[2].pairs == ((2, 3),)
    assert found[1].groups == ((0, 1, 2, 3),) and found[5].groups == ((0, 1),)


class _Compiled:
    def __init__(self, analysis):
        self.analysis = analysis

    def cost_analysis(self):
        if isinstance(self.analysis, Exception):
            raise self.analysis
        return self.analysis


@pytest.mark.parametrize(
    ("analysis", "flops"),
    [
        ({"flops": 12.0, "bytes accessed": 3.0}, 12.0),  # JAX 0.4.30 and later
        ([{"flops": 7.0}], 7.0),  # before: one dict per program
        ({"bytes accessed": 3.0}, None),
        (None, None),
        (NotImplementedError("no cost analysis"), None),
    ],
)
def test_flops_from_the_cost_analysis_of_each_jax_version(analysis, flops):
    assert _spmd.flops_of(_Compiled(analysis)) == flops


_LOOPS = """HloModule jit_step
%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ar = f32[4]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  %c = f32[4]{0} call(%x), to_apply=%inner
}
%inner (q: f32[4]) -> f32[4] {
  %ag = f32[8]{0} all-gather(%q), replica_groups={{0,1}}, dimensions={0}
}
%cond (p: (s32[], f32[4])) -> pred[] {
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}
%solver (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %rs = f32[2]{0} reduce-scatter(%x), replica_groups={{0,1}}, dimensions={0}
}
ENTRY %main (a: f32[4]) -> f32[4] {
  %w = (s32[], f32[4]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %v = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%solver
  ROOT %once = f32[4]{0} all-reduce(%a), replica_groups={{0,1}}, to_apply=%add
}
"""


def test_ops_in_loops_run_once_per_known_trip_and_once_where_unknown():
    found = _spmd.collectives_in(_LOOPS, 2)
    assert [(c.op, c.runs) for c in found] == [
        ("all-reduce", 3),  # a scan's body: its length is known
        ("all-gather", 3),  # called from that body
        ("reduce-scatter", None),  # a loop that runs until the data says stop
        ("all-reduce", 1),
    ]


# -- the trainer's step ----------------------------------------------------------------------


def _loss(p, batch):
    return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)


_PARAMS = {"w": jnp.zeros((16, 3)), "b": jnp.zeros(3)}
_GRAD_BYTES = (16 * 3 + 3) * 4


def _data(rows: int = 64) -> dict:
    x = np.random.default_rng(0).normal(size=(rows, 16)).astype(np.float32)
    return {"x": x, "y": x[:, :3].copy()}


@pytest.mark.parametrize("n", [8, 4, 2])
def test_a_data_parallel_step_reduces_the_gradients_bytes_once_per_step(n):
    tr = mg.Trainer(_loss, optax.sgd(0.1), _PARAMS, contexts=n)
    tr.fit(_data(), steps=3, batch_size=16, progress=False)
    comm = tr.communication()
    # XLA may fuse the gradient's all-reduces (and the loss's scalar) into one: count bytes
    (row,) = comm.rows()
    assert row[0] == "all-reduce" and _GRAD_BYTES <= row[2] <= _GRAD_BYTES + 8 and row[4] == n
    events = mg.ledger().records(Kind.COLLECTIVE)
    assert sorted({e.info["step"] for e in events}) == [1, 2, 3]
    for step in (1, 2, 3):
        mine = [e for e in events if e.info["step"] == step]
        assert all(e.info["read"] == "program" and e.seconds == 0 for e in mine)
        # a ring: each context sends to the next 2 B (n-1)/n
        assert sorted((e.src, e.dst) for e in mine) == sorted(
            (f"dev{i}", f"dev{(i + 1) % n}") for i in range(n)
        )
        assert sum(e.info["bytes"] for e in mine) == n * row[2]  # the op's bytes, on each link once
        assert {e.nbytes for e in mine} == {round(2 * row[2] * (n - 1) / n)}


def test_a_fit_without_collectives_records_none_of_them_and_everything_else():
    tr = mg.Trainer(_loss, optax.sgd(0.1), _PARAMS, contexts=4)
    tr.fit(_data(), steps=2, batch_size=16, progress=False, collectives=False)
    assert mg.ledger().records(Kind.COLLECTIVE) == []
    assert len(mg.ledger().records(Kind.STEP)) == 2 * 4 and mg.ledger().records(Kind.SPLIT)
    assert tr.communication().rows()[0][0] == "all-reduce"  # read from the step all the same
    tr.fit(_data(), steps=2, batch_size=16, progress=False)  # the default records them
    assert sorted({e.info["step"] for e in mg.ledger().records(Kind.COLLECTIVE)}) == [3, 4]
    with pytest.raises(TypeError, match=r"Trainer.fit: collectives must be True .* or False, got str 'no'"):
        tr.fit(_data(), steps=1, batch_size=16, progress=False, collectives="no")


def test_communication_gives_bytes_and_arithmetic_intensity_per_step():
    tr = mg.Trainer(_loss, optax.sgd(0.1), _PARAMS, contexts=4)
    with pytest.raises(RuntimeError, match=r"Trainer.communication\(\): no step has run yet.*tr.fit\(data"):
        tr.communication()
    tr.fit(_data(), steps=1, batch_size=16, progress=False)
    comm = tr.communication()
    assert comm.sent == round(2 * comm.bytes * 3 / 4) and comm.flops > 0
    assert comm.intensity == pytest.approx(comm.flops / comm.sent)
    assert "arithmetic intensity" in repr(comm) and "all-reduce" in repr(comm)
    # reading the compiled step adds well under 50 ms to its compile (0.5 s: a loaded machine)
    assert comm.seconds < 0.5


def test_communication_of_the_loop_path_says_where_its_moves_are():
    mg.use_contexts("a->cpu0;b->cpu0", verbose=False)
    tr = mg.Trainer(_loss, optax.sgd(0.1), _PARAMS)
    tr.fit(_data(), steps=1, batch_size=16, progress=False)
    with pytest.raises(ValueError, match=r"gather-update-copy loop.*gather and replicate events"):
        tr.communication()
    assert not mg.ledger().records(Kind.COLLECTIVE)


# -- parallel ops ----------------------------------------------------------------------------


def test_a_pmap_of_a_psum_shows_one_all_reduce_per_call():
    total = mg.pmap(lambda v: jax.lax.psum(v, "i"), out_axes=None)
    x = np.ones((8, 4), np.float32)
    total(x)
    total(x)
    events = mg.ledger().records(Kind.COLLECTIVE)
    assert len(events) == 2 * 8 and {e.info["op"] for e in events} == {"all-reduce"}
    assert {e.info["bytes"] for e in events} == {16} and {e.info["ops"] for e in events} == {1}
    assert {e.info["program"] for e in events} == {"pmap of <lambda>"}


def test_a_psum_in_a_scan_counts_once_per_step_of_the_scan():
    def running(v):
        return jax.lax.scan(lambda c, x: (c + jax.lax.psum(x, "i"), None), 0.0, v)[0]

    mg.pmap(running, out_axes=None)(np.ones((8, 5), np.float32))
    events = mg.ledger().records(Kind.COLLECTIVE)
    assert len(events) == 8 and {(e.info["ops"], e.info["bytes"]) for e in events} == {(5, 5 * 4)}
    assert {e.nbytes for e in events} == {round(2 * 5 * 4 * 7 / 8)} and "trips" not in events[0].info


def test_parallel_of_a_function_without_collectives_records_none():
    double = mg.parallel(lambda x: x * 2)
    for _ in range(3):  # the first call plans, the next ones run the plan
        double(np.ones((16, 3), np.float32))
    assert len(mg.ledger().records(Kind.RUN)) == 3 * 8 and not mg.ledger().records(Kind.COLLECTIVE)


# -- where they are shown --------------------------------------------------------------------


def _two_psums():
    total = mg.pmap(lambda v: jax.lax.psum(v, "i"), out_axes=None)
    x = np.ones((8, 4), np.float32)
    total(x)
    total(x)
    mg.transfer(mg.put(np.ones(256, np.float32), "dev0"), "dev1")  # 1 KiB of mgkit's own moves
    mg.ledger().flush()


def test_the_ledger_summary_has_a_line_for_collectives():
    _two_psums()
    text = repr(mg.ledger().summary())
    assert "collectives inside compiled programs: 448 B sent in 16 event(s) (read from" in text
    assert "2.2 KiB moved" in text  # mgkit's own: the put, the transfer, the pmaps' splits (256 B)
    row = next(r for r in mg.ledger().summary().rows() if r[0] == Kind.COLLECTIVE)
    assert row[1:5] == ("dev0", "dev1", 2, 56)
    assert " read " in next(line for line in text.splitlines() if line.startswith("collective "))


def test_transfer_view_totals_include_collectives_and_the_toggle_leaves_them_out():
    view = mg.TransferView(widget=True, live=False)
    _two_psums()
    view.refresh()
    assert view.collective_count == 16 and view.collective_bytes == 448
    assert view.matrix()["dev3", "dev4"] == 56 and view.matrix()["dev0", "dev1"] == 56 + 1024
    assert "collectives inside compiled programs: 448 B" in view.text()
    assert "16 collective" in view.svg()
    view.widget.children[0].children[2].value = False  # the widget's box
    assert view.collectives is False and view.collective_count == 0
    assert view.matrix()["dev3", "dev4"] == 0 and view.matrix()["dev0", "dev1"] == 1024
    assert all(e.kind != Kind.COLLECTIVE for e in view.recent()) and "collectives inside" not in view.text()
    alone = mg.TransferView(widget=False, collectives=False)
    assert alone.count == view.count == 2 + 2 * 8 and alone.collective_count == 0
    with pytest.raises(TypeError, match=r"collectives must be True .* or False .*got str 'no'"):
        mg.TransferView(widget=False, collectives="no")


def test_a_data_parallel_logistic_regression_records_its_all_reduces_per_call():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(800, 5)).astype(np.float32)
    y = (X[:, 0] > 0).astype(int)
    mg.logreg.fit(X, y, progress=False)
    events = mg.ledger().records(Kind.COLLECTIVE)
    # one call (no chunk resumed): each op in the program once, as it appears in the program
    assert len(events) == 8 and {e.info["op"] for e in events} == {"all-reduce"}
    assert {e.info["program"] for e in events} == {"logreg (newton)"} and events[0].info["bytes"] >= 5 * 4
    assert events[0].info["trips"] == "unknown"  # the solver stops when it converges
    mg.ledger().clear()
    mg.logreg.fit_many(X, y, l2=[0.1 * i for i in range(1, 9)], progress=False)  # a model per device
    assert not mg.ledger().records(Kind.COLLECTIVE)


def test_an_fsdp_step_gathers_its_split_parameters():
    params = {"w1": jnp.zeros((784, 128)), "b1": jnp.zeros(128), "w2": jnp.zeros((128, 16))}

    def loss(p, b):
        return jnp.mean((jnp.tanh(b[0] @ p["w1"] + p["b1"]) @ p["w2"] - b[1]) ** 2)

    data = (np.ones((64, 784), np.float32), np.ones((64, 16), np.float32))
    split = mg.Trainer(loss, optax.sgd(0.1), params, shard="fsdp")
    split.fit(data, steps=2, batch_size=64)
    rows = split.communication().rows()  # (op, count, bytes, sent per context, contexts)
    ops = {row[0] for row in rows}
    gathered = sum(row[2] for row in rows if row[0] == "all-gather")
    assert gathered >= (784 * 128 + 128 * 16) * 4  # every split weight is gathered once per step
    kinds = {e.info["op"] for e in mg.ledger().records() if e.kind == Kind.COLLECTIVE}
    assert "all-gather" in kinds and "all-gather" in ops
    replicated = mg.Trainer(loss, optax.sgd(0.1), params)
    replicated.fit(data, steps=1, batch_size=64)
    assert {row[0] for row in replicated.communication().rows()} == {"all-reduce"}  # nothing to gather
