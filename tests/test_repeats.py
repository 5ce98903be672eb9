"""Repeated blocks are planned once: a later block whose decisions would read exactly what an
earlier one's read takes that block's plan (compiler/repeats.py), and propagation's first sweep
copies the proposals of a block that starts from the state an earlier one started from.

The plan with copying must be the plan without it, decision for decision and collective for
collective (names, sources and reasons included), on every kind of repeated model: GPT written
unrolled with dropout and adam, scanned and rematerialised, ZeRO-3 (a gather per layer),
sequence parallel (hints in every layer), and a stack whose third layer reads a weight placed
differently (that block is planned by itself).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autoshard as dist
from autoshard.bench import gpt
from autoshard.bench.gpt_workloads import gpt_dp_tp, gpt_sequence_parallel, gpt_zero3
from autoshard.compiler import propagate, repeats
from autoshard.compiler.jit import _describe_leaf, _registry
from autoshard.compiler.plan import make_plan
from autoshard.compiler.trace import build_program

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
R, S = dist.Replicate(), dist.Shard


def _plan(step, args, out_placements, enabled: bool, monkeypatch):
    monkeypatch.setattr(repeats, "ENABLED", enabled)
    f = dist.jit(step, out_placements=out_placements)
    static, leaves, tree = f._split(args, {})
    described = tuple(_describe_leaf(x) for x in leaves)
    closed, _ = f._trace(static, tree, described)
    program = build_program(closed)
    mesh = next(d.mesh for d in described if d.mesh is not None)
    return make_plan(program, mesh, [d.layout for d in described],
                     f._out_targets(program, mesh), _registry(), dist.default_cost_model())


def _digest(plan):
    eqns = [(e.index, e.primitive, e.source, tuple(e.operands), tuple(e.required),
             tuple(e.results), e.strategy, e.considered,
             tuple((i, r.src, r.dst, tuple(map(str, r.steps))) for i, r in e.reshards))
            for e in plan.eqns]
    collectives = [(c.kind, c.step, c.axes, c.bytes_per_device, c.value, c.consumer, c.source,
                    c.reason) for c in plan.collectives]
    layouts = {repr(v): L for v, L in plan.layouts.items()}
    return eqns, collectives, layouts, plan.outputs, [(k, r.dst) for k, r in plan.output_reshards]


def _assert_same_plan(step, args, monkeypatch, out_placements=None):
    copied = _plan(step, args, out_placements, True, monkeypatch)
    planned = _plan(step, args, out_placements, False, monkeypatch)
    assert planned.same_as == {}
    for got, want in zip(_digest(copied), _digest(planned)):
        assert got == want
    return copied


def _gpt(form):
    step, _, args = gpt.workload(MESH, 4, form, optax.adam(1e-3))  # with dropout
    return step, args, None


def _workload(w):
    return w.step, w.args, w.out_placements


WORKLOADS = {
    "gpt unrolled": lambda: _gpt("unrolled"),
    "gpt scan": lambda: _gpt("scan"),
    "gpt remat": lambda: _gpt("remat"),
    "dp x tp 5L": lambda: _workload(gpt_dp_tp(5)),
    "zero-3 5L": lambda: _workload(gpt_zero3(5)),
    "sequence parallel 5L": lambda: _workload(gpt_sequence_parallel(5)),
}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_copied_plan_is_the_plan(name, monkeypatch):
    step, args, out_placements = WORKLOADS[name]()
    plan = _assert_same_plan(step, args, monkeypatch, out_placements)
    if name != "gpt scan":  # a scan's layers are one body: nothing repeats
        # the third and later layers' forward and backward (the first two read their
        # neighbours in other layouts) and the optimizer's like-shaped updates took a plan
        assert len(plan.same_as) >= len(plan.eqns) // 4


def test_a_block_reading_other_layouts_is_planned_by_itself(monkeypatch):
    mesh = dist.ProcessMesh(list(range(8)), ["x"])

    def f(x, *ws):
        for w in ws:
            h = jnp.tanh(x @ w)
            h = h * jax.nn.sigmoid(h)
            x = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5) + x
        return x.sum()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 32)).astype(np.float32)
    ws = [(rng.normal(size=(32, 32)) * 0.1).astype(np.float32) for _ in range(5)]
    placements = [[S(1)], [S(1)], [S(0)], [S(1)], [S(1)]]  # the third layer's weight: rows
    args = (dist.shard_tensor(x, mesh, [S(0)]),
            *(dist.shard_tensor(w, mesh, p) for w, p in zip(ws, placements)))
    plan = _assert_same_plan(f, args, monkeypatch)
    third = [k for k, e in enumerate(plan.program.eqns)
             if plan.program.inputs[3] in e.inputs]
    assert third and all(k not in plan.same_as for k in third)
    assert len(plan.same_as) > 0  # the other layers were copied
    got = dist.jit(f)(*args)
    np.testing.assert_allclose(np.asarray(got.numpy() if hasattr(got, "numpy") else got),
                               np.asarray(jax.jit(f)(x, *ws)), rtol=1e-5)


def test_a_block_whose_readers_differ_only_where_no_partial_is_read_takes_the_plan(monkeypatch):
    # a 2-layer step's two backward blocks differ in one fact: an add of the first (the last
    # layer's) reads a cotangent the head's gradient reads too; no Partial is read there, so
    # the choice is the same and the second block takes the first's plan
    step, args, out_placements = _workload(gpt_dp_tp(2))
    visits = {}
    real = propagate.chooser

    def counted(*a, **k):  # propagation's choices, counted per run of the test's plans
        pick = real(*a, **k)

        def each(*b):
            visits[repeats.ENABLED] = visits.get(repeats.ENABLED, 0) + 1
            return pick(*b)
        return each

    monkeypatch.setattr(propagate, "chooser", counted)
    plan = _assert_same_plan(step, args, monkeypatch, out_placements)
    assert len(plan.same_as) >= 100
    # and propagation's first sweep took the block's proposals too: ~100 fewer visits
    assert visits[True] <= visits[False] - 80, visits


def test_a_block_whose_partial_operand_has_another_reader_is_planned_by_itself(monkeypatch):
    mesh = dist.ProcessMesh(list(range(8)), ["x"])

    def f(x, *ws):
        kept = []
        for k, w in enumerate(ws):
            h = x @ w  # pending its sum over x: a row sum of it is reduced smaller (one reader)
            if k == 2:
                kept.append(h)  # read again after the stack: reduced once, whole
            x = jnp.tanh(x * jax.nn.sigmoid(h.sum(-1, keepdims=True)))
            x = (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)
        return x.sum() + sum(jnp.sum(h ** 2) for h in kept)

    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 32)).astype(np.float32)
    ws = [(rng.normal(size=(32, 32)) * 0.1).astype(np.float32) for _ in range(5)]
    args = (dist.shard_tensor(x, mesh, [S(1)]),
            *(dist.shard_tensor(w, mesh, [S(0)]) for w in ws))
    plan = _assert_same_plan(f, args, monkeypatch)
    third = [k for k, e in enumerate(plan.program.eqns) if plan.program.inputs[3] in e.inputs]
    assert third and all(k not in plan.same_as for k in third)
    assert len(plan.same_as) > 0  # the other layers were copied
    # the third layer's h reduced whole, every other layer's row sum reduced instead
    whole = [c for c in plan.collectives if c.bytes_per_device > 1000]
    assert len(whole) == 1 and whole[0].consumer.startswith("reduce_sum")
    got = dist.jit(f)(*args)
    np.testing.assert_allclose(np.asarray(got.numpy() if hasattr(got, "numpy") else got),
                               np.asarray(jax.jit(f)(x, *ws)), rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=12), st.integers(1, 5),
       st.lists(st.integers(0, 3), max_size=6), st.lists(st.integers(0, 3), max_size=6))
def test_found_runs_repeat(block, count, before, after):
    h = before + block * count + after
    runs = repeats.find_runs(h, min_len=2, max_len=64)
    covered = set()
    for start, period, n in runs:
        assert n >= 2 and period >= 2
        first = h[start:start + period]
        for i in range(n):
            assert h[start + i * period:start + (i + 1) * period] == first
        span = range(start, start + n * period)
        assert covered.isdisjoint(span)
        covered.update(span)
    if len(block) >= 2 and count >= 2 and not before and len(set(block)) == len(block):
        assert runs and runs[0][0] == 0 and runs[0][1] == len(block)


def test_negative_entries_never_repeat():
    assert repeats.find_runs([-1, -2, -3, -4] * 3, min_len=2) == []


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=10), st.lists(st.integers(4, 9), max_size=5),
       st.lists(st.integers(0, 9), max_size=8), st.integers(1, 3))
def test_found_blocks_are_equal_and_disjoint(block, gap, noise, copies):
    # a block repeated with other equations between (a 2-layer model's layers: the first also
    # computes what both read) is found as well as back-to-back runs; every group's blocks equal
    h = noise + (block + gap) * copies + block + noise[::-1]
    groups = repeats.find_blocks(h, min_len=2)
    covered = set()
    for period, starts in groups:
        assert period >= 2 and len(starts) >= 2 and starts == sorted(starts)
        for s in starts:
            assert h[s:s + period] == h[starts[0]:starts[0] + period]
            span = range(s, s + period)
            assert covered.isdisjoint(span)
            covered.update(span)
    if not noise and len(set(block)) == len(block):
        # the block's first copy starts a group (perhaps merged with its gap, when that repeats)
        assert any(0 in starts for _, starts in groups)


def test_blocks_apart_are_found_only_when_asked():
    a, x, y = [1, 2, 3, 4], [7, 8], [9]
    h = a + x + a + y
    assert repeats.find_runs(h, min_len=4) == []
    assert repeats.find_blocks(h, min_len=4, apart=False) == []
    assert repeats.find_blocks(h, min_len=4) == [(4, [0, 6])]
    # the longest repeat wins over a shorter one met first (a layer's whole forward over its
    # attention alone)
    b = [5, 6, 7, 8]
    h = b + a + [0] + a + [9] + b + a
    assert repeats.find_blocks(h, min_len=2) == [(8, [0, 14])]
