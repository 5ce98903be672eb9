"""Decisions the cost model must get right, each against one device and the compiled HLO.

A pending Partial is priced (it will be reduced later), so a strategy that leaves a full-size
weight gradient Partial over every mesh axis does not look free; layouts a value was already
moved to for an earlier consumer are reused.
"""
from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard as dist
from autoshard.compiler import refine
from autoshard.hlo import (collective_bytes, collective_wire_bytes, count_collective_ops,
                           count_collectives)

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
S, R = dist.Shard, dist.Replicate


def _sequence_parallel_step(d: int):
    def step(w, x):
        def loss(w):
            h = dist.shard_tensor(x, MESH, [S(0), S(1)])  # activations split along the sequence
            return jnp.sum(jnp.tanh(h @ w) ** 2)
        return w - 0.1 * jax.grad(loss)(w)

    def reference(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
    return step, reference


@pytest.mark.parametrize("d", [1024, 2048])
def test_weight_gradient_is_never_reduced_at_full_size_over_every_axis(d):
    rng = np.random.default_rng(0)
    w = (rng.normal(size=(d, d)) * 0.02).astype(np.float32)
    x = rng.normal(size=(4, 16, d)).astype(np.float32)
    step, reference = _sequence_parallel_step(d)
    wd = dist.shard_tensor(w, MESH, [R(), S(0)])  # row-parallel weight
    xd = dist.shard_tensor(x, MESH, [S(0), S(1)])
    f = dist.jit(step, out_placements=[[R(), S(0)]])
    np.testing.assert_allclose(f(wd, xd).numpy(), reference(w, x), rtol=1e-4, atol=1e-5)
    plan = f.plan(wd, xd)
    full = w.nbytes
    # a reduction over dp x mp of the whole gradient would move ~2 x 7/8 of it per device
    assert all(c.bytes_per_device < full for c in plan.collectives), plan.collectives
    assert count_collectives(f.lower(wd, xd).compile().as_text()) == \
        Counter(c.kind for c in plan.collectives)


def _dot_step(w, x):
    return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)


@pytest.mark.parametrize("w_placements", [[R(), S(1)], [R(), S(0)], [R(), R()]],
                         ids=["column-parallel", "row-parallel", "replicated"])
def test_weight_gradient_is_reduced_before_jaxs_transpose(w_placements):
    # jax's gradient of `x @ w` is a dot_general then a transpose; with the batch over dp the
    # dot's result is Partial. Reduced after the transpose, XLA folds the transpose into the
    # dot (a non-canonical dot); reduced before it, as jax.jit does, the dot stays canonical.
    rng = np.random.default_rng(1)
    w = (rng.normal(size=(64, 128)) * 0.1).astype(np.float32)
    x = rng.normal(size=(8, 16, 64)).astype(np.float32)
    wd = dist.shard_tensor(w, MESH, w_placements)
    xd = dist.shard_tensor(x, MESH, [S(0), R()])
    f = dist.jit(_dot_step, out_placements=[w_placements])
    np.testing.assert_allclose(f(wd, xd).numpy(), _dot_step(w, x), rtol=1e-4, atol=1e-5)

    plan = f.plan(wd, xd)
    grads = [ep for ep in plan.eqns if ep.primitive == "transpose" and ep.operands[0].partial]
    assert grads, "the gradient's transpose should read the Partial dot result"
    assert all(not ep.results[0].partial and ep.reshards for ep in grads)
    hlo = f.lower(wd, xd).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    folded = [line for line in entry.splitlines()
              if " dot(" in line and 'op_name="' in line and '/transpose"' in line]
    assert not folded, folded
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)
    base = jax.jit(_dot_step).lower(wd.physical, xd.physical).compile().as_text()
    assert sum(collective_bytes(hlo).values()) <= sum(collective_bytes(base).values())


def _normalized_rows(x, y):
    # Two row sums over the sharded dimension (Partial over mp): y's is reduced where the log
    # needs it; x's passes the division and the reshape still Partial, so the plan would
    # reduce it at the end, after (and waiting for) y's reduction.
    z = jnp.log(jnp.sum(jnp.exp(y), axis=1))
    return (jnp.sum(x, axis=1) / z).reshape(4, 4, 2) * 0.5


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "value_and_grad"])
def test_a_pending_reduction_runs_where_its_partial_was_made(grad):
    # Reduced right after the sum instead, it depends only on x: XLA combines it with y's
    # reduction into one all-reduce (one synchronisation instead of two in a row), and the
    # arithmetic is one device's (sum, then divide).
    fn = _normalized_rows
    if grad:
        fn = jax.value_and_grad(lambda x, y: jnp.sum(_normalized_rows(x, y) ** 2), argnums=(0, 1))
    rng = np.random.default_rng(3)
    x, y = (rng.normal(size=(32, 16)).astype(np.float32) for _ in range(2))
    xd, yd = (dist.shard_tensor(a, MESH, [S(0), S(1)]) for a in (x, y))
    f = dist.jit(fn)
    got = jax.tree.leaves(f(xd, yd), is_leaf=lambda a: isinstance(a, dist.DistTensor))
    want = jax.tree.leaves(jax.jit(fn)(x, y))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-6)
    plan = f.plan(xd, yd)
    hoisted = [ep for ep in plan.eqns if "reduced where the Partial was made" in ep.strategy]
    # (with the gradient, the division's result is also read by the backward, which needs it
    # reduced: the plan reduces at the division already)
    assert bool(hoisted) != grad, "the row sum's reduction should move to where it was made"
    hlo = f.lower(xd, yd).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)
    entry = hlo[hlo.index("ENTRY"):]
    # the two forward row-sum reductions are one op
    assert count_collective_ops(entry)["all-reduce"] < count_collectives(entry)["all-reduce"]
    if not grad:
        assert count_collective_ops(entry) == Counter({"all-reduce": 1})


def _mlp_loss(w1, w2, x):
    # column- then row-parallel: the sum of the output is Partial over mp (the row-parallel
    # dot) and dp (the batch) until the end
    return jnp.sum(jnp.tanh(x @ w1) @ w2) * 0.01


def _train_step_returning_the_loss_twice(w1, w2, x):
    value, grads = jax.value_and_grad(_mlp_loss, argnums=(0, 1, 2))(w1, w2, x)
    return value, grads, value


@pytest.mark.parametrize("with_gradients,twice", [(True, False), (True, True), (False, False)],
                         ids=["train step", "loss returned twice", "loss only"])
def test_a_tiny_output_is_reduced_one_axis_at_a_time_with_other_reductions(with_gradients,
                                                                           twice):
    rng = np.random.default_rng(4)
    w1 = (rng.normal(size=(16, 32)) * 0.3).astype(np.float32)
    w2 = (rng.normal(size=(32, 16)) * 0.3).astype(np.float32)
    x = rng.normal(size=(8, 16)).astype(np.float32)
    args = (dist.shard_tensor(w1, MESH, [R(), S(1)]), dist.shard_tensor(w2, MESH, [R(), S(0)]),
            dist.shard_tensor(x, MESH, [S(0), R()]))
    fn = jax.value_and_grad(_mlp_loss, argnums=(0, 1, 2)) if with_gradients else _mlp_loss
    if twice:
        fn = _train_step_returning_the_loss_twice
    f = dist.jit(fn)
    got = jax.tree.leaves(f(*args), is_leaf=lambda a: isinstance(a, dist.DistTensor))
    for g, w in zip(got, jax.tree.leaves(jax.jit(fn)(w1, w2, x))):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-6)
    loss_steps = [c for c in f.plan(*args).collectives if c.consumer == "output 0"]
    hlo = f.lower(*args).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in f.plan(*args).collectives)
    if with_gradients:
        # the loss's mp part rides with x's gradient (reduced over mp), its dp part with the
        # weight gradients (over dp): no all-reduce of its own
        assert [c.step for c in loss_steps] == ["psum(mp)", "psum(dp)"]
        ops = count_collective_ops(hlo)["all-reduce"]
        assert ops == 2 < count_collectives(hlo)["all-reduce"]
        base = jax.jit(fn).lower(*(a.physical for a in args)).compile().as_text()
        assert ops <= count_collective_ops(base)["all-reduce"]
    else:
        # nothing to ride with: one reduction over both axes
        assert [c.step for c in loss_steps] == ["psum(dp,mp)"]


def test_a_calibrated_cost_model_is_measured_per_axis_and_plans_a_correct_step():
    # The numbers are this machine's (never asserted); what is: one latency and bandwidth per
    # mesh axis, plausible magnitudes, a hashable model that dist.jit plans with.
    model = dist.calibrate_cost_model(MESH, repeats=3, large_bytes=1 << 18)
    assert dict(model.latency).keys() == dict(model.bandwidth).keys() == {"dp", "mp"}
    for a in ("dp", "mp"):
        assert 0 < model.axis_latency(a) < 1.0
        assert 1e8 <= model.axis_bandwidth(a) <= 1e13
    assert model.default_latency == max(dict(model.latency).values())
    assert hash(model) == hash(dist.CostModel(**{
        k: getattr(model, k) for k in ("default_latency", "default_bandwidth", "local_bandwidth",
                                       "transfer_bandwidth", "latency", "bandwidth")}))
    rng = np.random.default_rng(0)
    w = (rng.normal(size=(64, 64)) * 0.1).astype(np.float32)
    x = rng.normal(size=(8, 64)).astype(np.float32)
    wd = dist.shard_tensor(w, MESH, [R(), S(1)])
    xd = dist.shard_tensor(x, MESH, [S(0), R()])
    f = dist.jit(_dot_step, cost_model=model)
    np.testing.assert_allclose(f(wd, xd).numpy(), _dot_step(w, x), rtol=1e-4, atol=1e-5)
    assert count_collectives(f.lower(wd, xd).compile().as_text()) == \
        Counter(c.kind for c in f.plan(wd, xd).collectives)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_a_reshape_mp_cannot_follow_keeps_the_batch_split(kv_heads):
    # grouped-query attention: the column-parallel k projection's (kv_heads * head_dim)
    # features split over mp = 4 cannot become a split of (kv_heads, head_dim) when kv_heads
    # < 4; only mp is given up there — the batch stays split over dp (it was gathered too) —
    # and mp moves onto another dim by an all-to-all (it was gathered: 4x the bytes)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 16, 32)).astype(np.float32)
    w = (rng.normal(size=(32, kv_heads * 8)) * 0.1).astype(np.float32)

    def attend(x, w):
        k = (x @ w).reshape(8, 16, kv_heads, 8)
        k = jnp.repeat(k, 8 // kv_heads, axis=2)  # 8 query heads
        return jnp.einsum("bthd,bshd->bhts", k, k)

    xd = dist.shard_tensor(x, MESH, [S(0), R()])
    wd = dist.shard_tensor(w, MESH, [R(), S(1)])
    f = dist.jit(attend)
    np.testing.assert_allclose(f(xd, wd).numpy(), attend(x, w), rtol=1e-4, atol=1e-4)
    plan = f.plan(xd, wd)
    assert all(c.axes == ("mp",) for c in plan.collectives), plan.collectives
    hlo = f.lower(xd, wd).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)
    base = jax.jit(attend).lower(xd.physical, wd.physical).compile().as_text()
    assert sum(collective_bytes(hlo).values()) <= sum(collective_bytes(base).values())
    if kv_heads == 2:  # this device's block of k re-split over mp where it is reshaped
        assert [(c.kind, c.bytes_per_device) for c in plan.collectives] == \
            [("all-to-all", 4 * 16 * 16 * 4 * 3 // 4 // 4)]
    if kv_heads == 4:
        assert not plan.collectives


@pytest.mark.parametrize("layers", [1, 2])
def test_sequence_parallel_backward_reuses_the_gathered_cotangent(layers):
    # Megatron-SP per block: an all-gather of the sequence before attention and before the
    # MLP, a reduce-scatter after each — forward and backward — plus the head's. The
    # backward of attention's output projection gathers the cotangent for the weight gradient
    # first; the input gradient must reuse that copy with the row-split weight as it lies (it
    # gathered the weight too, then moved the result back with an all-to-all).
    from autoshard.bench.gpt_workloads import gpt_sequence_parallel

    w = gpt_sequence_parallel(layers)
    f = dist.jit(w.step, out_placements=w.out_placements)
    plan = f.plan(*w.args)
    over_mp = Counter(c.kind for c in plan.collectives if c.axes == ("mp",)
                      and c.kind != "all-reduce")  # (the softmax rows' tiny reductions)
    # (+1 all-gather: the token embedding's table, gathered for the lookup)
    assert over_mp == {"all-gather": 4 * layers + 2, "reduce-scatter": 4 * layers + 1}, over_mp
    hlo = f.lower(*w.args).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)
    ours, ref = f(*w.args), jax.jit(w.step)(*[
        jax.tree.map(lambda x: x.numpy() if isinstance(x, dist.DistTensor) else x, a,
                     is_leaf=lambda x: isinstance(x, dist.DistTensor)) for a in w.args])
    np.testing.assert_allclose(ours[1].numpy(), ref[1], rtol=1e-5)


@pytest.mark.parametrize("whole_reader_first", [True, False])
def test_a_value_made_from_nothing_is_computed_whole_for_a_reader_that_needs_it_whole(
        whole_reader_first):
    # jax's derivative of `.at[order].set` without unique_indices: iota ids scattered into
    # zeros, read split by the residual stream and gathered back by the (replicated) order.
    # Split, the gather-back is a masked gather + all-reduce of the ids; computed whole on
    # every device, nothing moves. Once a reader has taken the split layout the plan keeps it.
    rng = np.random.default_rng(3)
    xs = rng.normal(size=(16, 8)).astype(np.float32)
    order = rng.permutation(16).astype(np.int32)

    def f(x, order):
        ids = jnp.zeros((16, 8), jnp.int32).at[order].set(jnp.arange(128).reshape(16, 8) + 1)
        if whole_reader_first:
            back = ids[order]
            kept = jnp.where(ids % 3 == 0, x, 0.0)
        else:
            kept = jnp.where(ids % 3 == 0, x, 0.0)
            back = ids[order]
        return kept, back

    x = dist.shard_tensor(xs, MESH, [S(0), R()])
    g = dist.jit(f, out_placements=[[S(0), R()], [R(), R()]])
    kept, back = g(x, order)
    want_kept, want_back = jax.jit(f)(xs, order)
    np.testing.assert_array_equal(kept.numpy(), want_kept)
    np.testing.assert_array_equal(back.numpy(), want_back)
    plan = g.plan(x, order)
    hlo = g.lower(x, order).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)
    if whole_reader_first:
        assert not plan.collectives
        assert any("computed whole" in ep.strategy for ep in plan.eqns)
    else:  # the scatter was planned split for its first reader: the gather-back moves ids
        assert len(plan.collectives) == 1


def test_a_constant_read_less_split_than_it_was_made_is_sliced_from_a_whole_copy():
    # jax.vmap widens the gamma derivative's constants (a scalar's broadcast broadcast again
    # to the batched shape); propagation lays them out split over both axes, and their one
    # reader wants them split over dp only: made whole where they are made (any device can),
    # then sliced, rather than gathered over mp — XLA folds such gathers of constants, so the
    # plan listed three all-gathers the compiled program did not run
    from autoshard.testing import logical_value, make_tensor

    rng = np.random.default_rng(0)
    a = rng.uniform(0.1, 0.9, size=(4, 8, 16)).astype(np.float32)
    x = rng.uniform(0.1, 0.9, size=(4, 8, 16)).astype(np.float32)
    fn = jax.vmap(jax.lax.random_gamma_grad)
    args = [make_tensor(a, MESH, [S(0), S(2)], seed=3),
            make_tensor(x, MESH, [S(1), dist.Partial()], seed=3)]
    f = dist.jit(fn)
    plan = f.plan(*args)
    hlo = f.lower(*args).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)
    gathers = [c for c in plan.collectives if c.kind == "all-gather"]
    assert len(gathers) == 1 and gathers[0].runs is None  # the loop's own
    want = jax.jit(fn)(*[logical_value(t) for t in args])
    np.testing.assert_allclose(f(*args).numpy(), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_embedding_gradient_of_sequence_shards_moves_the_cotangent_not_the_table():
    # A hidden-split table (Paddle's ColWiseParallel embedding) read by a sequence-split step:
    # the gradient is a scatter-add of the sequence-split cotangent into the whole table.
    # Summed where it lies, every device holds a Partial of the whole table, reduced over
    # dp x mp; the cotangent all-to-all'd onto the hidden dim instead (a quarter of the
    # table's bytes here) leaves each device its own columns, reduced over dp alone.
    rng = np.random.default_rng(0)
    table = (rng.normal(size=(1024, 256)) * 0.02).astype(np.float32)
    ids = rng.integers(0, 1024, (8, 64)).astype(np.int32)
    cot = rng.normal(size=(8, 64, 256)).astype(np.float32)

    def step(table, ids, cot):
        grad, = jax.vjp(lambda t: jnp.take(t, ids, axis=0), table)[1](cot)
        return table - 0.1 * grad

    args = (dist.shard_tensor(table, MESH, [R(), S(1)]),
            dist.shard_tensor(ids, MESH, [S(0), S(1)]),
            dist.shard_tensor(cot, MESH, [S(0), S(1)]))
    f = dist.jit(step, out_placements=[[R(), S(1)]])
    np.testing.assert_allclose(f(*args).numpy(), jax.jit(step)(table, ids, cot), rtol=1e-5,
                               atol=1e-6)
    plan = f.plan(*args)
    steps = Counter(c.step.split(" ")[0] for c in plan.collectives)
    assert steps["all_to_all(mp)"] == 1 and steps["psum(dp)"] == 1, plan.collectives
    assert all(c.axes != ("dp", "mp") for c in plan.collectives), plan.collectives
    assert plan.total_bytes < table.nbytes // 2
    hlo = f.lower(*args).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)


LINE = dist.ProcessMesh(list(range(8)), dim_names=["x"])


def _widened_matmul(widen: str):
    """x (64 x 256) widened — padded to 512 columns, or cast bf16 → f32 — then multiplied by
    a weight the plan keeps column-split: the matmul needs x whole."""
    def f(x, w):
        if widen == "pad":
            y = jnp.tanh(jnp.pad(x, ((0, 0), (0, 256))))
        else:
            y = x.astype(jnp.float32) * 0.5
        return y @ w
    rng = np.random.default_rng(0)
    cols = 256 if widen == "cast" else 512
    x = rng.normal(size=(64, 256)).astype(jnp.bfloat16 if widen == "cast" else np.float32)
    w = rng.normal(size=(cols, 128)).astype(np.float32)
    return f, x, w


@pytest.mark.parametrize("widen,mesh,x_placements,w_placements", [
    ("pad", LINE, [S(0)], [S(1)]), ("pad", MESH, [S(0), S(0)], [R(), S(1)]),
    ("cast", LINE, [S(0)], [S(1)]), ("cast", LINE, [S(1)], [S(1)]),
    ("cast", MESH, [S(0), S(0)], [R(), S(1)])],
    ids=["pad-1d", "pad-2d", "cast-1d-rows", "cast-1d-cols", "cast-2d"])
def test_a_value_is_moved_before_the_steps_that_widen_it(widen, mesh, x_placements,
                                                         w_placements):
    f, x, w = _widened_matmul(widen)
    xd = dist.shard_tensor(x, mesh, x_placements)
    wd = dist.shard_tensor(w, mesh, w_placements)
    g = dist.jit(f)
    np.testing.assert_allclose(g(xd, wd).numpy(), f(x, w), rtol=1e-5, atol=1e-4)
    plan = g.plan(xd, wd)
    gathers = [c for c in plan.collectives if c.kind == "all-gather"]
    assert gathers and all(c.value == "a" for c in gathers), plan.collectives  # x itself
    moved = [ep for ep in plan.eqns if ep.reshards]  # where x is moved: at the widening step
    assert [ep.primitive for ep in moved] == [
        "pad" if widen == "pad" else "convert_element_type"], str(plan)
    assert "moved before this step" in moved[0].strategy
    # the program gathers x as it came (unpadded; in bf16: XLA's CPU backend then gathers in
    # f32, having no bf16 collectives, so the dtype is read from the emitted program)
    emitted = g.lower(xd, wd).as_text()
    gathered = [line for line in emitted.splitlines() if "all_gather" in line]
    narrow = "x256xf32>) ->" if widen == "pad" else "xbf16>) ->"
    assert gathered and all(narrow in line for line in gathered), gathered
    if widen == "pad":
        compiled = collective_bytes(g.lower(xd, wd).compile().as_text())
        assert compiled["all-gather"] <= x.nbytes, compiled  # the padded x is twice that


def test_a_widened_value_another_reader_takes_as_it_is_is_moved_where_it_is_read():
    f, x, w = _widened_matmul("pad")

    def both(x, w):
        y = jnp.tanh(jnp.pad(x, ((0, 0), (0, 256))))
        return y @ w, y  # y is also returned, split as it was made

    xd = dist.shard_tensor(x, LINE, [S(0)])
    wd = dist.shard_tensor(w, LINE, [S(1)])
    g = dist.jit(both, out_placements=[None, [S(0)]])
    out, y = g(xd, wd)
    ref_out, ref_y = both(x, w)
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(y.numpy(), ref_y, rtol=1e-6)
    plan = g.plan(xd, wd)
    assert not any("moved before" in ep.strategy for ep in plan.eqns), str(plan)
    assert [c.kind for c in plan.collectives] == ["all-gather"], plan.collectives


def _gshard_moe(tokens: int, experts: int, d: int, f: int, top: int = 2):
    """A GShard-style mixture-of-experts layer: top-2 routing, one-hot dispatch and combine
    tensors (tokens, experts, capacity), the experts' matmuls as einsums."""
    capacity = tokens * top // experts

    def moe(p, x):
        gates, idx = jax.lax.top_k(jax.nn.softmax(x @ p["router"], -1), top)
        onehot = jax.nn.one_hot(idx, experts)
        pos = jnp.cumsum(onehot.reshape(tokens * top, experts), 0).reshape(
            tokens, top, experts) * onehot - 1
        dispatch = onehot[..., None] * jax.nn.one_hot(pos.astype(jnp.int32), capacity)
        combine = (dispatch * gates[..., None, None]).sum(1)
        xe = jnp.einsum("tec,td->ecd", dispatch.sum(1), x)
        h = jax.nn.relu(jnp.einsum("ecd,edf->ecf", xe, p["w1"]))
        return jnp.einsum("tec,ecd->td", combine, jnp.einsum("ecf,efd->ecd", h, p["w2"]))
    rng = np.random.default_rng(2)
    p = {"router": 0.2 * rng.normal(size=(d, experts)).astype(np.float32),
         "w1": 0.2 * rng.normal(size=(experts, d, f)).astype(np.float32),
         "w2": 0.2 * rng.normal(size=(experts, f, d)).astype(np.float32)}
    return moe, p, rng.normal(size=(tokens, d)).astype(np.float32)


@pytest.mark.parametrize("mesh,split", [(LINE, [S(0)]), (MESH, [S(0), S(0)])],
                         ids=["8 devices", "2x4"])
def test_moe_dispatch_is_made_split_by_experts_from_the_gathered_routing(mesh, split):
    # tokens and experts split over the same devices: the dispatch and combine tensors are
    # made by one-hots from the (tokens, 2) routing choices, which the plan gathers (a few
    # KiB) so that each device makes its experts' slice and the einsums run on it, as XLA
    # does — not a reduce-scatter of the dispatched (experts, capacity, features) sum and an
    # all-gather of the experts' outputs (1.29x XLA's wire bytes; remake.py)
    moe, p, x = _gshard_moe(1024, 8, 128, 256)
    placed = {"router": dist.shard_tensor(p["router"], mesh, [R()] * len(split)),
              "w1": dist.shard_tensor(p["w1"], mesh, split),
              "w2": dist.shard_tensor(p["w2"], mesh, split)}
    xd = dist.shard_tensor(x, mesh, split)
    g = dist.jit(moe)
    np.testing.assert_allclose(g(placed, xd).numpy(), jax.jit(moe)(p, x), rtol=1e-4, atol=1e-4)
    ours = g.lower(placed, xd).compile().as_text()
    assert count_collectives(ours) == Counter(c.kind for c in g.plan(placed, xd).collectives)
    physical = jax.tree.map(lambda t: t.physical, placed,
                            is_leaf=lambda t: isinstance(t, dist.DistTensor))
    base = jax.jit(moe).lower(physical, xd.physical).compile().as_text()
    wire = sum(collective_wire_bytes(ours).values())
    base_wire = sum(collective_wire_bytes(base).values())
    assert wire <= base_wire, (wire, base_wire, count_collectives(ours), count_collectives(base))


def _wire_bytes_against_jit(fn, args, reference_args):
    """(ours, jax.jit's) collective wire bytes of `fn`, jax.jit given the same input
    shardings, after checking our values against the unpartitioned function."""
    leaf = lambda t: isinstance(t, dist.DistTensor)  # noqa: E731
    g = dist.jit(fn)
    got = jax.tree.leaves(g(*args), is_leaf=leaf)
    for a, b in zip(got, jax.tree.leaves(jax.jit(fn)(*reference_args)), strict=True):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-3, atol=1e-4)
    ours = g.lower(*args).compile().as_text()
    physical = jax.tree.map(lambda t: t.physical, args, is_leaf=leaf)
    base = jax.jit(fn).lower(*physical).compile().as_text()
    return (sum(collective_wire_bytes(ours).values()),
            sum(collective_wire_bytes(base).values()))


@pytest.mark.parametrize("mesh,split", [(LINE, [S(0)]), (MESH, [S(0), S(0)])],
                         ids=["8 devices", "2x4"])
def test_moe_gradient_remakes_dispatch_split_by_experts(mesh, split):
    # the MoE layer's gradient at a size where no one einsum's pending sum or move outweighs
    # a collective's latency: each one-hot remade split by experts saves little where it is
    # read, but together they save an all-to-all and two reduce-scatters of the dispatched
    # tokens (2.7x XLA's wire bytes before; remake.py groups the remakes that share moves)
    moe, p, x = _gshard_moe(256, 8, 16, 32)
    step = jax.grad(lambda p, x: jnp.sum(moe(p, x) ** 2))
    placed = {"router": dist.shard_tensor(p["router"], mesh, [R()] * len(split)),
              "w1": dist.shard_tensor(p["w1"], mesh, split),
              "w2": dist.shard_tensor(p["w2"], mesh, split)}
    wire, base_wire = _wire_bytes_against_jit(
        step, (placed, dist.shard_tensor(x, mesh, split)), (p, x))
    assert wire <= base_wire, (wire, base_wire)


@pytest.mark.parametrize("mesh,split", [(LINE, [S(0)]), (MESH, [S(0), S(0)]),
                                        (MESH, [R(), S(0)])],
                         ids=["8 devices", "2x4", "2x4 mp"])
@pytest.mark.parametrize("rows", [256, 512, 1024])
def test_a_split_vector_added_to_a_replicated_input_is_gathered_once(mesh, split, rows):
    # y = x + v, x replicated, v split: the add takes y split like v (slicing x is free,
    # gathering v costs a collective's latency), and each of the two matmuls reading y would
    # contract its split dim and all-reduce its (rows, 32) result. Gathering v's 64 bytes once
    # serves both (jax.jit's plan); with y made split by rows from x sliced, nothing else moves.
    # (Below 1024 rows no value is larger than a collective's latency is worth in bytes, yet
    # the remake saves two whole collectives)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 16)).astype(np.float32)
    v = rng.normal(size=(16,)).astype(np.float32)
    w1, w2 = (rng.normal(size=(16, 32)).astype(np.float32) for _ in range(2))

    def f(x, v, w1, w2):
        y = x + v
        return jnp.tanh(y @ w1) * (y @ w2)
    whole = [R()] * len(split)
    args = (dist.shard_tensor(x, mesh, whole), dist.shard_tensor(v, mesh, split),
            dist.shard_tensor(w1, mesh, whole), dist.shard_tensor(w2, mesh, whole))
    wire, base_wire = _wire_bytes_against_jit(f, args, (x, v, w1, w2))
    assert wire <= base_wire, (wire, base_wire)


def test_a_gpt_step_is_not_planned_again_for_remakes(monkeypatch):
    # a GPT train step's values are all smaller than a collective's latency is worth in
    # bytes: no remake can gain there (its loss's one-hot remade from the labels would save
    # 192 bytes), and planning the step twice would double its planning time
    from autoshard.bench.gpt_workloads import gpt_dp_tp
    from autoshard.compiler import plan as planning
    found = []
    pins = planning.remake_pins
    monkeypatch.setattr(planning, "remake_pins", lambda *a: found.append(pins(*a)) or found[-1])
    w = gpt_dp_tp(2, "unrolled")
    dist.jit(w.step, out_placements=w.out_placements).plan(*w.args)
    assert found and not any(found), found


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradient"])
def test_query_heads_grouped_finer_than_mp_stay_split(grad, monkeypatch):
    # jax.nn.dot_product_attention with 2 key-value heads groups 8 query heads split over
    # mp = 4 as (2, 4): on the user's mesh mp cannot split the group dim of 2, so it moves onto
    # the sequence (one all-to-all of a shard) instead of the queries being gathered and every
    # head computed on every device (with sub-axes, test_sub_axes.py, nothing moves)
    monkeypatch.setattr(refine, "ENABLED", False)
    rng = np.random.default_rng(1)
    q = rng.normal(size=(4, 16, 8, 8)).astype(np.float32)
    k, v = (rng.normal(size=(4, 16, 2, 8)).astype(np.float32) for _ in range(2))
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    if grad:
        fn = jax.grad(lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True) ** 2), argnums=(0, 1, 2))
    qd = dist.shard_tensor(q, MESH, [S(0), S(2)])
    kd, vd = (dist.shard_tensor(a, MESH, [S(0), R()]) for a in (k, v))
    f = dist.jit(fn)
    got = jax.tree.leaves(f(qd, kd, vd), is_leaf=lambda a: isinstance(a, dist.DistTensor))
    for g, w in zip(got, jax.tree.leaves(jax.jit(fn)(q, k, v))):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-4, atol=1e-5)
    plan = f.plan(qd, kd, vd)
    kinds = Counter(c.kind for c in plan.collectives)
    assert kinds["all-gather"] == 0 and kinds["all-to-all"] == 1, plan.collectives
    shard = q.nbytes // 8
    moved = [c for c in plan.collectives if c.kind == "all-to-all"]
    assert moved[0].bytes_per_device == shard * 3 // 4
    hlo = f.lower(qd, kd, vd).compile().as_text()
    assert count_collectives(hlo) == kinds


def test_unflattening_a_batch_smaller_than_the_axis_does_not_move_it_onto_the_features():
    # (batch * sequence, features) split over 8 devices, unflattened to a batch of 4: the axis
    # cannot follow onto the batch; moved onto the features, the matmul after contracts them
    # and all-reduces its whole output — twice the bytes of gathering the rows once
    mesh = dist.ProcessMesh(list(range(8)), dim_names=["dp"])
    rng = np.random.default_rng(2)
    x = rng.normal(size=(64, 32)).astype(np.float32)
    w = (rng.normal(size=(32, 32)) * 0.2).astype(np.float32)

    def fn(x, w):
        h = jnp.tanh(x @ w).reshape(4, 16, 32)
        return (h - h.mean(1, keepdims=True)).reshape(64, 32) @ w
    xd, wd = dist.shard_tensor(x, mesh, [S(0)]), dist.shard_tensor(w, mesh, [R()])
    f = dist.jit(fn)
    np.testing.assert_allclose(f(xd, wd).numpy(), fn(x, w), rtol=1e-4, atol=1e-5)
    plan = f.plan(xd, wd)
    assert plan.total_bytes <= x.nbytes * 7 // 8, plan.collectives  # one gather of the rows
    assert count_collectives(f.lower(xd, wd).compile().as_text()) == \
        Counter(c.kind for c in plan.collectives)


def test_a_batched_count_into_a_large_fresh_table_keeps_the_batch_split():
    # jax.vmap of a histogram: one table per example, each counting its example's samples,
    # then read whole (a nonlinear step: no pending sum passes it). With the batch split over
    # dp and the samples over mp, a 100k-bin table is cheaper counted from gathered indices
    # than all-reduced; no strategy dropped just the summed split, so the indices were
    # gathered over both axes and every device counted every example's table: the batch
    # stays split and the indices are gathered over mp alone (half the bytes; a quarter of
    # the tables per device).
    bins = 100_000
    ids = np.random.default_rng(0).integers(0, bins, size=(4, 64)).astype(np.int32)

    def f(ids):
        tables = jax.vmap(lambda i: jnp.zeros(bins).at[i].add(1.0))(ids)
        return jnp.sqrt(tables * tables + 1.0)

    g = dist.jit(f)
    di = dist.shard_tensor(ids, MESH, [S(0), S(1)])
    out = g(di)
    np.testing.assert_allclose(out.numpy(), jax.jit(f)(ids), rtol=1e-6)
    assert out.placements == [S(0), R()]
    plan = g.plan(di)
    (scatter,) = [e for e in plan.eqns if e.primitive == "scatter-add"]
    assert scatter.results[0].placements(MESH) == [S(0), R()]
    assert [(c.kind, c.axes) for c in plan.collectives] == [("all-gather", ("mp",))]
    assert count_collectives(g.lower(di).compile().as_text()) == Counter({"all-gather": 1})


@pytest.mark.parametrize("model", [
    dict(default_bandwidth=1e-300), dict(default_bandwidth=5e-324),
    dict(default_latency=1e308, default_bandwidth=1e-308)],
    ids=["tiny bandwidth", "subnormal bandwidth", "huge latency"])
def test_a_cost_model_whose_costs_overflow_still_plans_right(model):
    """A cost model changes the plan, never whether the program runs: costs that overflow to
    inf left the reshard planner with no path ("no reshard reaches ... a dim split over
    devices that do not divide it")."""
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    xd = dist.shard_tensor(x, MESH, [S(0), S(1)])
    cm = dist.CostModel(**model)
    np.testing.assert_array_equal(dist.jit(lambda a: jnp.sum(a, 0), cost_model=cm)(xd).numpy(),
                                  x.sum(0))
    np.testing.assert_array_equal(dist.reshard(xd, MESH, [R(), R()], cost_model=cm).numpy(), x)


def test_set_default_cost_model_reaches_functions_planned_before():
    """A dist.jit function without its own cost_model plans again under a new default (it
    kept its first plan); one given cost_model= keeps it."""
    rng = np.random.default_rng(0)
    w0, w1, x, y = (rng.normal(size=s).astype(np.float32)
                    for s in [(16, 32), (32, 16), (8, 16), (8, 16)])

    def step(w0, w1, x, y):
        def loss(w0, w1):
            return jnp.mean((jax.nn.gelu(x @ w0) @ w1 - y) ** 2)
        value, (g0, g1) = jax.value_and_grad(loss, argnums=(0, 1))(w0, w1)
        return w0 - 0.1 * g0, w1 - 0.1 * g1, value

    args = (dist.shard_tensor(w0, MESH, [S(1), S(0)]),
            dist.shard_tensor(w1, MESH, [dist.Partial(), S(1)]),
            dist.shard_tensor(x, MESH, [S(1), S(0)]),
            dist.shard_tensor(y, MESH, [R(), dist.Partial("avg")]))
    f, g = dist.jit(step), dist.jit(step, cost_model=dist.CostModel())
    before, kept = f.plan(*args).total_bytes, g.plan(*args).total_bytes
    old = dist.default_cost_model()
    try:  # links free of bandwidth, each collective costly: fewer, bigger collectives
        dist.set_default_cost_model(dist.CostModel(default_bandwidth=float("inf"),
                                                   default_latency=1e-3))
        fresh = dist.jit(step).plan(*args).total_bytes
        assert fresh != before and f.plan(*args).total_bytes == fresh
        assert g.plan(*args).total_bytes == kept
        for got, want in zip(f(*args), jax.jit(step)(w0, w1, x, y)):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)
    finally:
        dist.set_default_cost_model(old)
    with pytest.raises(dist.CostModelError, match=r"set_default_cost_model: cost_model=\{'dp': 1\}"):
        dist.set_default_cost_model({"dp": 1})
