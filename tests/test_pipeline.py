"""Pipeline schedules and PipelineRunner: schedules are complete, ordered and as cheap as their
textbook formulas; a model split into stages on different meshes trains, under every
schedule, to the same loss, gradients and weights as one device."""
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import autoshard as dist
from autoshard.hlo import collectives
from autoshard.training.schedule import (Action, Schedule, ScheduleError, bubble_formula,
                                         dispatch_order, fthenb, interleaved, make_schedule,
                                         one_f_one_b, simulate, validate, zero_bubble_h1, _deps)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import pipeline as example  # noqa: E402

R, S = dist.Replicate(), dist.Shard


# ------------------------------------------------------------------------------ schedules
def _assert_complete_and_ordered(s: Schedule) -> None:
    validate(s)
    order = dispatch_order(s)
    kinds = "FBW" if s.split_backward else "FB"
    assert len(order) == len(kinds) * s.stages * s.micro_batches == len(set(order))
    position = {a: k for k, a in enumerate(order)}
    for a in order:
        assert all(position[d] < position[a] for d in _deps(a, s.stages)), a
    for r, acts in enumerate(s.actions):  # each rank's order is kept in the dispatch order
        assert [position[a] for a in acts] == sorted(position[a] for a in acts), r
        assert all(s.rank_of(a.stage) == r for a in acts)


@pytest.mark.parametrize("p,m", [(1, 1), (1, 4), (2, 1), (2, 3), (4, 4), (4, 8), (8, 3)])
@pytest.mark.parametrize("mode", ["FThenB", "1F1B"])
def test_fthenb_and_1f1b_have_the_textbook_bubble(mode, p, m):
    s = make_schedule(mode, p, m)
    _assert_complete_and_ordered(s)
    t = simulate(s)
    assert t.bubble == pytest.approx(bubble_formula(mode, p, m))
    assert t.makespan == pytest.approx(3 * (m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (8, 8)])
def test_1f1b_holds_p_minus_r_micro_batches_fthenb_all(p, m):
    assert simulate(one_f_one_b(p, m)).peak_in_flight == tuple(min(p - r, m) for r in range(p))
    assert simulate(fthenb(p, m)).peak_in_flight == (m,) * p


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 4),
                                   (2, 6, 3)])
def test_interleaved_shrinks_the_bubble_by_the_chunk_count(p, m, v):
    s = interleaved(p, m, v)
    _assert_complete_and_ordered(s)
    t = simulate(s)
    assert t.bubble == pytest.approx(bubble_formula("VPP", p, m, v))
    assert t.bubble < simulate(one_f_one_b(p, m)).bubble
    # virtual stage c·p + r lives on rank r
    assert all(a.stage % p == r for r, acts in enumerate(s.actions) for a in acts)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (4, 4), (4, 8), (8, 16), (3, 7)])
def test_zbh1_fills_the_bubble_with_weight_gradients_in_1f1b_memory(p, m):
    s = zero_bubble_h1(p, m)
    assert s.split_backward
    _assert_complete_and_ordered(s)
    t, base = simulate(s), simulate(one_f_one_b(p, m))
    # F = B = W = 1: ZB-H1's makespan is 3m + p - 1 (1F1B: 3m + 3(p - 1))
    assert t.makespan == pytest.approx(3 * m + p - 1)
    assert t.bubble < base.bubble
    assert max(t.peak_in_flight) <= max(base.peak_in_flight)


@given(mode=st.sampled_from(["FThenB", "1F1B", "VPP", "ZBH1"]), p=st.integers(1, 6),
       m=st.integers(1, 9), v=st.integers(1, 3))
@settings(max_examples=60, deadline=None)
def test_every_schedule_is_complete_ordered_and_no_worse_than_gpipe(mode, p, m, v):
    v = v if mode == "VPP" else 1
    if mode == "VPP" and v > 1:
        m = m * p  # VPP wants a multiple of p micro-batches
    s = make_schedule(mode, p, m, v)
    _assert_complete_and_ordered(s)
    assert simulate(s).makespan <= simulate(fthenb(p, m)).makespan + 1e-9


def test_schedule_errors_say_what_is_wrong():
    good = one_f_one_b(2, 2)
    with pytest.raises(ScheduleError, match="never run"):
        validate(Schedule("x", 2, 2, 1, (good.actions[0][:-1], good.actions[1])))
    with pytest.raises(ScheduleError, match="runs twice"):
        validate(Schedule("x", 2, 2, 1, (good.actions[0] + good.actions[0][:1], good.actions[1])))
    with pytest.raises(ScheduleError, match="stage 1 lives on rank 1"):
        validate(Schedule("x", 2, 2, 1, (good.actions[0] + good.actions[1], ())))
    # rank 0 wants the backward of micro-batch 0 before it has run its forward
    stuck = (Action("B", 0, 0), Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 1))
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(Schedule("x", 2, 2, 1, (stuck, good.actions[1])))
    with pytest.raises(ScheduleError, match="multiple of the pipeline ranks.*use 8"):
        interleaved(4, 6, 2)
    with pytest.raises(ScheduleError, match="unknown pipeline schedule 'GPipe'"):
        make_schedule("GPipe", 2, 2)
    with pytest.raises(ScheduleError, match="use schedule 'VPP'"):
        make_schedule("1F1B", 2, 2, chunks=2)
    with pytest.raises(ScheduleError, match="micro_batches must be a positive int"):
        one_f_one_b(2, 0)


# --------------------------------------------------------------------------------- running
MESHES_2D = [dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]),
             dist.ProcessMesh([[4, 5], [6, 7]], dim_names=["dp", "mp"])]
MESHES_1D = example.MESHES  # four meshes of two devices, "dp"


def _stage_fn(x, p):
    return jnp.tanh(x @ p["w"] + p["b"])


def _mid(p, x):
    return _stage_fn(x, p)


def _last(p, x, y):
    return jnp.mean((_stage_fn(x, p) - y) ** 2)


def _one_device(ws, x, y):
    def loss(ws):
        h = x
        for p in ws[:-1]:
            h = _stage_fn(h, p)
        return _last(ws[-1], h, y)
    return jax.value_and_grad(loss)(ws)


def _setup(meshes, chunks, weight_placements):
    n = 4
    p = len(meshes)
    rng = np.random.default_rng(3)
    ws = [{"w": rng.normal(size=(16, 16)).astype("float32") * 0.4,
           "b": rng.normal(size=(16,)).astype("float32") * 0.1} for _ in range(n)]
    x = rng.normal(size=(8, 16)).astype("float32")
    y = rng.normal(size=(8, 16)).astype("float32")
    stages = [dist.Stage(_last if s == n - 1 else _mid, meshes[s % p]) for s in range(n)]
    batch = [S(0)] + [R] * (meshes[0].ndim - 1)
    params = [{"w": dist.shard_tensor(w["w"], st.mesh, weight_placements),
               "b": dist.shard_tensor(w["b"], st.mesh, [R] * st.mesh.ndim)}
              for w, st in zip(ws, stages)]
    return (ws, x, y, stages, params, dist.shard_tensor(x, meshes[0], batch),
            dist.shard_tensor(y, stages[-1].mesh, batch))


CASES = [  # (schedule, micro-batches, chunks, meshes, weight placements)
    ("FThenB", 4, 1, MESHES_1D, [R]),
    ("1F1B", 2, 1, MESHES_1D, [S(1)]),
    ("1F1B", 4, 1, MESHES_1D, [R]),
    ("ZBH1", 4, 1, MESHES_1D, [S(0)]),
    ("ZBH1", 1, 1, MESHES_1D, [R]),
    ("VPP", 2, 2, MESHES_2D, [R, S(1)]),
    # four stages on two 2-d meshes, alternating, without interleaving: stage 2 waits for mesh 0
    ("1F1B", 2, 1, MESHES_2D * 2, [R, S(0)]),
]


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("mode,m,chunks,meshes,placements", CASES)
def test_pipelined_loss_and_gradients_equal_one_device(mode, m, chunks, meshes, placements,
                                                       recompute):
    ws, x, y, stages, params, xd, yd = _setup(meshes, chunks, placements)
    runner = dist.PipelineRunner(stages, mode, m, chunks=chunks, recompute=recompute)
    loss, grads = runner.value_and_grad(params, xd, yd)
    ref_loss, ref_grads = _one_device(ws, x, y)
    np.testing.assert_allclose(float(loss.numpy()), float(ref_loss), rtol=1e-5)
    for s, (g, ref, p) in enumerate(zip(grads, ref_grads, params)):
        for name in ref:
            np.testing.assert_allclose(g[name].numpy(), ref[name], rtol=1e-4, atol=1e-6,
                                       err_msg=f"stage {s} {name}")
            assert g[name].mesh == p[name].mesh, (s, name)
            assert g[name].physical.sharding.is_equivalent_to(g[name].sharding, g[name].physical.ndim)
    np.testing.assert_allclose(float(runner.forward(params, xd, yd).numpy()), float(ref_loss),
                               rtol=1e-5)


def test_zbh1_halves_compile_once_and_each_does_only_its_half():
    ws, x, y, stages, params, xd, yd = _setup(MESHES_1D, 1, [R])
    runner = dist.PipelineRunner(stages, "ZBH1", 4)
    runner.value_and_grad(params, xd, yd)
    runner.value_and_grad(params, xd, yd)
    # stages 1..3: an input-gradient half and a weight-gradient half; stage 0: weights only
    assert sorted(key[:2] for key in runner._halves) == [(0, 0), (1, 0), (1, 1), (2, 0),
                                                           (2, 1), (3, 0), (3, 1)]
    assert all(fn._cache_size() == 1 for fn in runner._halves.values())
    # one micro-batch of stage 2 by hand: B's program has one matmul (d x = d h @ w^T), W's
    # one (d w = x^T @ d h), the fused backward both; their values are the fused backward's
    micro_x = runner._cut(xd, 2, 4, "x")[0]
    h = micro_x
    for s in range(2):
        h = runner.programs[s](params[s], runner._arrive(s, h))
    h = runner._arrive(2, h)
    out, pull = runner._forward(2, params[2], h, ())
    ct = dist.shard_tensor(np.ones(out.shape, "float32"), out.mesh, out.placements)
    leaves, treedef = jax.tree_util.tree_flatten(pull.vjp)
    halves = {key[1]: fn for key, fn in runner._halves.items() if key[0] == 2}
    ct_in = ct.physical if pull.raw else ct
    dots = {k: fn.lower(leaves, ct_in).as_text().count("dot_general") for k, fn in halves.items()}
    fused = jax.jit(lambda leaves, ct: jax.tree_util.tree_unflatten(treedef, leaves)(ct))
    assert dots == {0: 1, 1: 1}
    assert fused.lower(leaves, ct_in).as_text().count("dot_general") == 2
    fused_g, fused_dx = pull.both(ct)
    np.testing.assert_allclose(pull.part(ct, 1, 2).numpy(), fused_dx.numpy(), rtol=1e-6)
    for name, g in pull.part(ct, 0, 2).items():
        np.testing.assert_allclose(g.numpy(), fused_g[name].numpy(), rtol=1e-6)


def test_micro_batches_are_cut_without_communication():
    """Micro-batch i holds the i-th quarter of every data-parallel shard's rows."""
    x = np.arange(8 * 3, dtype="float32").reshape(8, 3)
    xd = dist.shard_tensor(x, MESHES_2D[0], [S(0), R])
    parts = dist.PipelineRunner._cut(xd, 2, 2, "x")
    for i, part in enumerate(parts):
        assert part.placements == [S(0), R]
        np.testing.assert_array_equal(part.numpy(), np.concatenate([x[i * 2:i * 2 + 2],
                                                                   x[4 + i * 2:4 + i * 2 + 2]]))
    from autoshard.training.pipeline import _cutter
    hlo = _cutter(2, 2, (S(0), R)).lower(xd).compile().as_text()
    assert collectives(hlo) == []


def test_pipeline_errors_name_the_fix():
    ws, x, y, stages, params, xd, yd = _setup(MESHES_1D, 1, [R])
    with pytest.raises(dist.StageError, match=r"batch dim 8 cannot be cut into 8 micro-batches "
                                              r"of each of its 2 data-parallel shards"):
        dist.PipelineRunner(stages, "1F1B", 8).value_and_grad(params, xd, yd)
    with pytest.raises(dist.StageError, match=r"loss argument 1 has an array of shape \[16\] "
                                              r"whose dim 0 is not the batch \(8 rows\)"):
        dist.PipelineRunner(stages, "1F1B", 2).value_and_grad(params, xd, yd, np.ones(16))
    with pytest.raises(dist.StageError, match="stage 2 is on .* rank 0, whose mesh is"):
        dist.PipelineRunner(stages, "VPP", 2, chunks=2)
    with pytest.raises(ScheduleError, match="cannot be cut into 3 chunks"):
        dist.PipelineRunner(stages, "VPP", 2, chunks=3)
    with pytest.raises(ScheduleError, match="runs 2 stages, but 4 were given"):
        dist.PipelineRunner(stages, one_f_one_b(2, 2))
    strategy = dist.Strategy({"pipeline": {"enable": True, "schedule_mode": "1F1B",
                                           "accumulate_steps": 2, "micro_batch_size": 3}})
    runner = dist.PipelineRunner.from_strategy(stages, strategy)
    assert (runner.schedule.name, runner.schedule.micro_batches) == ("1F1B", 2)
    with pytest.raises(dist.StageError, match=r"micro_batch_size = 3 with accumulate_steps = 2 "
                                              r"makes batches of 6 rows per data-parallel rank "
                                              r"\(12 over the 2 .*the batch has 8 rows: set "
                                              r"micro_batch_size to 2"):
        runner.value_and_grad(params, xd, yd)
    # 1 given is checked as any other value (Paddle's default 1, not given, is not: the batch
    # sets the micro-batch size then)
    strategy.pipeline.micro_batch_size = 1
    with pytest.raises(dist.StageError, match=r"micro_batch_size = 1 with accumulate_steps = 2 "
                                              r"makes batches of 2 rows per data-parallel rank "
                                              r".*set micro_batch_size to 2 or leave it unset"):
        dist.PipelineRunner.from_strategy(stages, strategy).value_and_grad(params, xd, yd)
    unset = dist.Strategy({"pipeline": {"enable": True, "accumulate_steps": 2}})
    assert unset.pipeline.micro_batch_size == 1 and not unset.pipeline.written("micro_batch_size")
    dist.PipelineRunner.from_strategy(stages, unset).value_and_grad(params, xd, yd)
    # Paddle's micro_batch_size is one data-parallel rank's: 2 x 2 micro-batches x 2 ranks
    strategy.pipeline.micro_batch_size = 2
    runner = dist.PipelineRunner.from_strategy(stages, strategy)
    np.testing.assert_allclose(
        float(runner.value_and_grad(params, xd, yd)[0].numpy()),
        float(dist.PipelineRunner(stages, "1F1B", 2).value_and_grad(params, xd, yd)[0].numpy()),
        rtol=1e-6)
    with pytest.raises(ScheduleError, match="pipeline.enable is False"):
        dist.PipelineRunner.from_strategy(stages, dist.Strategy())


# ------------------------------------------------------- one loss function, cut into stages
def _chain_loss(meshes, skip=False, tied=False):
    """Four blocks; block k runs on meshes[k % len(meshes)] after a dist.reshard (none when
    `meshes` is None: the one-device reference). `skip`: block 3 also adds block 0's output
    (moved along); `tied`: block 2 reuses block 0's weight (both on mesh 0)."""
    def loss(ps, x, y):
        h, first = x, None
        for k in range(4):
            if meshes is not None and k:
                h = dist.reshard(h, meshes[k % len(meshes)], [S(0)] + [R] * (meshes[0].ndim - 1))
            w = ps[0]["w"] if (tied and k == 2) else ps[k]["w"]
            h = jnp.tanh(h @ w + ps[k]["b"])
            if k == 0:
                first = h
            if skip and k == 3:
                moved = first if meshes is None else dist.reshard(
                    first, meshes[3 % len(meshes)], [S(0)] + [R] * (meshes[0].ndim - 1))
                h = h + moved
        return jnp.mean((h - y) ** 2)
    return loss


@pytest.mark.parametrize("mode,m,chunks,n_meshes,skip,tied", [
    ("1F1B", 2, 1, 4, False, False),
    ("FThenB", 4, 1, 4, True, False),
    ("ZBH1", 2, 1, 4, True, False),
    ("VPP", 2, 2, 2, False, True),
])
def test_a_loss_function_is_cut_into_stages_and_scheduled(mode, m, chunks, n_meshes, skip, tied):
    meshes = MESHES_1D[:n_meshes]
    ws, x, y, _, _, _, _ = _setup(meshes, chunks, [R])
    params = [{k: dist.shard_tensor(v, meshes[s % n_meshes], [R]) for k, v in w.items()}
              for s, w in enumerate(ws)]
    xd = dist.shard_tensor(x, meshes[0], [S(0)])
    yd = dist.shard_tensor(y, meshes[3 % n_meshes], [S(0)])
    runner = dist.PipelineRunner.from_function(_chain_loss(meshes, skip, tied), mode, m,
                                               chunks=chunks)
    loss, grads = runner.value_and_grad(params, xd, yd)
    ref_loss, ref_grads = jax.value_and_grad(
        lambda ps: _chain_loss(None, skip, tied)(ps, x, y))(ws)
    np.testing.assert_allclose(float(loss.numpy()), float(ref_loss), rtol=1e-5)
    for s, (g, ref) in enumerate(zip(grads, ref_grads)):
        for name in ref:
            np.testing.assert_allclose(g[name].numpy(), ref[name], rtol=1e-4, atol=1e-6,
                                       err_msg=f"block {s} {name}")
            assert g[name].mesh == params[s][name].mesh
    (inner,) = runner._runners.values()
    assert inner.schedule.name == mode and len(inner.stages) == 4
    np.testing.assert_allclose(float(runner.forward(params, xd, yd).numpy()), float(ref_loss),
                               rtol=1e-5)


@pytest.mark.parametrize("mode", ["1F1B", "ZBH1", "FThenB"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_a_stage_holding_no_params_runs_in_the_pipeline(mode, m):
    """A middle stage of activations only (a nonlinearity between two moves): it has no
    gradients to accumulate over the micro-batches (adding its empty ones failed: 'found no
    mesh'); loss and gradients equal one device."""
    m0, m1, m2 = MESHES_1D[:3]
    rng = np.random.default_rng(7)
    w0, w2, x, y = (rng.normal(size=(8, 8)).astype("float32") * 0.3 for _ in range(4))

    def loss(p, x, y, move=True):
        h = jnp.tanh(x @ p["w0"])
        h = dist.reshard(h, m1, [S(0)]) if move else h
        h = jax.nn.gelu(h) * 2.0
        h = dist.reshard(h, m2, [S(0)]) if move else h
        return jnp.mean((h @ p["w2"] - y) ** 2)

    p = {"w0": dist.shard_tensor(w0, m0, [R]), "w2": dist.shard_tensor(w2, m2, [R])}
    runner = dist.PipelineRunner.from_function(loss, mode, m)
    value, grads = runner.value_and_grad(p, dist.shard_tensor(x, m0, [S(0)]),
                                         dist.shard_tensor(y, m2, [S(0)]))
    ref, ref_grads = jax.value_and_grad(lambda q: loss(q, x, y, False))({"w0": w0, "w2": w2})
    np.testing.assert_allclose(float(value.numpy()), float(ref), rtol=1e-5)
    for name in ref_grads:
        np.testing.assert_allclose(grads[name].numpy(), ref_grads[name], rtol=1e-4, atol=1e-6)
        assert grads[name].mesh == p[name].mesh


@pytest.mark.parametrize("m", [2, 4])
def test_vpp_computes_what_reads_only_a_param_in_the_stage_that_reads_it(m):
    """VPP, four stages alternating on two meshes; layer 2 normalises its weight (w / |w|).
    That reads only a param of stage 2's mesh: it runs in stage 2, not in the first stage on
    that mesh (its result was carried from stage 0 through stage 1 and back, every
    micro-batch, and stage 2 read no param at all) — each stage reads its own layer's weight,
    carries one activation, and loss and gradients equal one device."""
    meshes = MESHES_1D[:2]
    rng = np.random.default_rng(3)
    ws = [rng.normal(size=(8, 8)).astype("float32") * 0.3 for _ in range(4)]
    x, y = (rng.normal(size=(8, 8)).astype("float32") for _ in range(2))

    def loss(ws, x, y, move=True):
        for k in range(4):
            if k and move:
                x = dist.reshard(x, meshes[k % 2], [S(0)])
            w = ws[k] / jnp.linalg.norm(ws[k]) if k == 2 else ws[k]
            x = jnp.tanh(x @ w)
        return jnp.mean((x - y) ** 2)

    params = [dist.shard_tensor(w, meshes[k % 2], [R]) for k, w in enumerate(ws)]
    runner = dist.PipelineRunner.from_function(loss, "VPP", m, chunks=2)
    value, grads = runner.value_and_grad(params, dist.shard_tensor(x, meshes[0], [S(0)]),
                                         dist.shard_tensor(y, meshes[1], [S(0)]))
    ref, ref_grads = jax.value_and_grad(lambda w: loss(w, x, y, False))(ws)
    np.testing.assert_allclose(float(value.numpy()), float(ref), rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-4, atol=1e-6)
    (inner,) = runner._runners.values()
    assert inner._reads == [[0], [1], [2], [3]]
    assert [len(c) for c in inner._carries] == [1, 1, 1, 0]


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("regularised", [False, True])
def test_a_loss_moved_back_to_the_first_mesh_runs_in_the_pipeline(m, regularised):
    """The loss computed on the second mesh and moved back to the first (to add a term of the
    first stage's params there, or to log it where the batch lives): the move is a stage of
    its own, which reads no label (it was handed the labels of the other mesh, and its
    program spanned two meshes: 'spans 1 stages on different meshes')."""
    m0, m1 = MESHES_1D[:2]
    rng = np.random.default_rng(4)
    w0, w1, x, y = (rng.normal(size=(8, 8)).astype("float32") * 0.3 for _ in range(4))

    def loss(p, x, y, move=True):
        h = jnp.tanh(x @ p["w0"])
        h = dist.reshard(h, m1, [S(0)]) if move else h
        out = jnp.mean((h @ p["w1"] - y) ** 2)
        out = dist.reshard(out, m0, [R]) if move else out
        return out + 0.1 * jnp.sum(p["w0"] ** 2) if regularised else out

    p = {"w0": dist.shard_tensor(w0, m0, [R]), "w1": dist.shard_tensor(w1, m1, [R])}
    value, grads = dist.PipelineRunner.from_function(loss, "1F1B", m).value_and_grad(
        p, dist.shard_tensor(x, m0, [S(0)]), dist.shard_tensor(y, m1, [S(0)]))
    ref, ref_grads = jax.value_and_grad(lambda q: loss(q, x, y, False))({"w0": w0, "w1": w1})
    np.testing.assert_allclose(float(value.numpy()), float(ref), rtol=1e-5)
    assert value.mesh == m0
    for name in ref_grads:
        np.testing.assert_allclose(grads[name].numpy(), ref_grads[name], rtol=1e-4, atol=1e-6)
        assert grads[name].mesh == p[name].mesh


def test_the_seed_forward_as_written_runs_in_a_1f1b_pipeline():
    """Seed §4.4's forward (2-d meshes, dp × mp, the reshard inside) on 2 micro-batches."""
    m0, m1 = MESHES_2D
    rng = np.random.default_rng(5)
    w0 = rng.normal(size=(16, 64)).astype("float32") * 0.1
    w1 = rng.normal(size=(64, 16)).astype("float32") * 0.1
    x = rng.normal(size=(4, 8, 16)).astype("float32")

    def loss(p, x, move=True):
        y = jnp.matmul(x, p["w0"])
        if move:
            y = dist.reshard(y, m1, [S(0), S(2)])
        return jnp.mean(jnp.matmul(y, p["w1"]))

    p = {"w0": dist.shard_tensor(w0, m0, [R, S(1)]), "w1": dist.shard_tensor(w1, m1, [R, S(0)])}
    runner = dist.PipelineRunner.from_function(loss, "1F1B", 2)
    value, grads = runner.value_and_grad(p, dist.shard_tensor(x, m0, [S(0), R]))
    ref, ref_grads = jax.value_and_grad(lambda q: loss(q, x, False))({"w0": w0, "w1": w1})
    np.testing.assert_allclose(float(value.numpy()), float(ref), rtol=1e-5)
    for name in ref_grads:
        np.testing.assert_allclose(grads[name].numpy(), ref_grads[name], rtol=1e-4, atol=1e-7)
    assert (grads["w0"].placements, grads["w1"].placements) == ([R, S(1)], [R, S(0)])


def test_a_cut_stage_reading_the_batch_after_the_first_is_an_error():
    m0, m1 = MESHES_1D[:2]

    def loss(p, x):
        h = dist.reshard(x @ p["a"], m1, [S(0)])
        return jnp.mean(h @ p["b"]) + jnp.mean(dist.reshard(x, m1, [S(0)]))

    p = {"a": dist.shard_tensor(np.ones((4, 4), "float32"), m0, [R]),
         "b": dist.shard_tensor(np.ones((4, 4), "float32"), m1, [R])}
    with pytest.raises(dist.StageError, match="stage 1 reads the batch inputs"):
        dist.PipelineRunner.from_function(loss, "1F1B", 2).value_and_grad(
            p, dist.shard_tensor(np.ones((4, 4), "float32"), m0, [S(0)]))


def test_a_cut_function_with_fewer_stages_than_ranks_times_chunks_says_how_many_cuts():
    """Two stages (one reshard) on two meshes with 2 chunks per rank: the error counts the
    stages VPP needs — it said "put stage 1 on that mesh", a stage the function's own reshard
    placed."""
    m0, m1 = MESHES_1D[:2]

    def loss(p, x):
        return jnp.mean(dist.reshard(x @ p["a"], m1, [S(0)]) @ p["b"])

    p = {"a": dist.shard_tensor(np.ones((4, 4), "float32"), m0, [R]),
         "b": dist.shard_tensor(np.ones((4, 4), "float32"), m1, [R])}
    with pytest.raises(dist.StageError, match=r"chunks\) = 2 model chunks per pipeline rank on "
                                              r"the 2 meshes .* needs 2 x 2 = 4 stages, but the "
                                              r"model is cut into 2: name 3 cuts"):
        dist.PipelineRunner.from_function(loss, "VPP", 2, chunks=2).value_and_grad(
            p, dist.shard_tensor(np.ones((4, 4), "float32"), m0, [S(0)]))


def test_explain_shows_the_schedule_the_moves_and_each_stage_communication():
    ws, x, y, stages, params, xd, yd = _setup(MESHES_2D, 2, [R, S(1)])
    runner = dist.PipelineRunner(stages, "VPP", 2, chunks=2)
    text = runner.explain(params, xd, yd)
    assert text.startswith("pipeline: 4 stages on 2 ranks, schedule VPP, 2 micro-batches")
    moves = [line for line in text.splitlines() if line.lstrip().startswith("→ stage")]
    # each micro-batch activation [4, 16] crosses 3 times, split over both mesh dims
    assert moves == [f"  → stage {s}: float32[4, 16] [S(0), S(1)] → [S(0), S(1)], 64 B/device"
                     for s in (1, 2, 3)]
    stage_lines = [line for line in text.splitlines() if line.startswith("  stage ")]
    assert stage_lines[0] == "  stage 0 on devices [0, 1, 2, 3]: no collectives, 0 B/device"
    # the last stage's line is its plan for one micro-batch
    h = runner._cut(xd, 2, 2, "x")[0]
    for s in range(3):
        h = runner.programs[s](params[s], runner._arrive(s, h))
    plan = runner.programs[3].plan(params[3], runner._arrive(3, h), runner._cut(yd, 2, 2, "y")[0])
    counts = ", ".join(f"{n} {k}" for k, n in sorted(plan.collective_counts().items()))
    assert counts and f": {counts}, " in stage_lines[3]
    assert str(runner.schedule) in text


# ------------------------------------------------------------------------------ profiling
def test_measured_costs_per_stage_drive_the_simulation():
    """simulate with (stage, kind) costs: a slow last stage sets the pace (hand-computed)."""
    costs = {(0, "F"): 1.0, (0, "B"): 1.0, (1, "F"): 3.0, (1, "B"): 3.0}
    t = simulate(fthenb(2, 2), costs)
    # rank 0: F0.0 [0,1] F0.1 [1,2]; rank 1: F1.0 [1,4] F1.1 [4,7] B1.0 [7,10] B1.1 [10,13];
    # rank 0 then runs B0.0 [10,11] and B0.1 [13,14]
    assert t.makespan == pytest.approx(14.0)
    assert t.busy == pytest.approx((4.0, 12.0))
    assert t.bubble == pytest.approx(1 - 16 / 28)
    # costs per kind still apply where no stage overrides them
    assert simulate(fthenb(2, 2), {"F": 1.0, "B": 1.0}).makespan == pytest.approx(6.0)  # (m+p-1)(F+B)
    _assert_complete_and_ordered(zero_bubble_h1(3, 5, {(2, "F"): 4.0, "W": 0.5}))


@pytest.mark.parametrize("mode,chunks,meshes", [("1F1B", 1, MESHES_1D), ("ZBH1", 1, MESHES_1D),
                                                ("VPP", 2, MESHES_2D)])
def test_profile_measures_every_action_and_replays_the_schedule_with_those_costs(mode, chunks,
                                                                                 meshes):
    ws, x, y, stages, params, xd, yd = _setup(meshes, chunks, [R] * meshes[0].ndim)
    runner = dist.PipelineRunner(stages, mode, 2, chunks=chunks)
    prof = runner.profile(params, xd, yd, steps=2)
    kinds = "FBW" if mode == "ZBH1" else "FB"
    assert sorted(prof.costs) == sorted((s, k) for s in range(4) for k in kinds)
    assert all(c > 0 for c in prof.costs.values())
    # the timeline is the schedule run with exactly these costs: each rank is busy m times its
    # stages' costs, and no step is shorter than its busiest rank
    for r in range(runner.schedule.ranks):
        mine = [s for s in range(4) if runner.schedule.rank_of(s) == r]
        assert prof.busy[r] == pytest.approx(2 * sum(prof.costs[(s, k)] for s in mine
                                                     for k in kinds))
    assert prof.predicted_s >= max(prof.busy) - 1e-12
    assert prof.imbalance >= 1.0 and prof.step_s > 0 and prof.serial_s > 0
    text = str(prof)
    assert text.startswith(f"pipeline profile: {mode}, 4 stages on {runner.schedule.ranks} ranks")
    assert len([ln for ln in text.splitlines() if ln[:5].strip().isdigit()]) == 4
    # the runner is left as it was, and a runner ordered by the measured costs still trains
    assert runner.blocking is False and runner.after_action is None
    tuned = dist.PipelineRunner(stages, mode, 2, chunks=chunks, costs=prof.costs)
    loss, grads = tuned.value_and_grad(params, xd, yd)
    ref_loss, _ = runner.value_and_grad(params, xd, yd)
    np.testing.assert_allclose(float(loss.numpy()), float(ref_loss.numpy()), rtol=1e-6)


def test_profile_of_a_cut_loss_function():
    meshes = MESHES_1D
    rng = np.random.default_rng(5)
    ws = [{"w": rng.normal(size=(16, 16)).astype("float32") * 0.3,
           "b": np.zeros(16, "float32")} for _ in range(4)]
    params = [{k: dist.shard_tensor(v, meshes[s], [R]) for k, v in w.items()}
              for s, w in enumerate(ws)]
    x, y = rng.normal(size=(8, 16)).astype("float32"), rng.normal(size=(8, 16)).astype("float32")
    runner = dist.PipelineRunner.from_function(_chain_loss(meshes), "1F1B", 2)
    prof = runner.profile(params, dist.shard_tensor(x, meshes[0], [S(0)]),
                          dist.shard_tensor(y, meshes[3], [S(0)]), steps=1)
    assert sorted(prof.costs) == sorted((s, k) for s in range(4) for k in "FB")
    assert "stage balance: slowest stage" in str(prof)


def test_a_weight_two_stages_share_is_moved_where_it_is_read_and_its_gradients_summed():
    """Tied input and output embeddings across stages: the table lives on the first stage's
    mesh, the last stage reads a copy (`dist.reshard` in the function); the copy's gradient goes
    back and is summed with the lookup's — under dist.jit's cut (a train step) and a pipeline."""
    m0, m1 = MESHES_2D
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(16, 8)).astype("float32")
    w = rng.normal(size=(8, 8)).astype("float32") * 0.3
    ids = rng.integers(0, 16, (4, 6)).astype(np.int32)
    labels = rng.integers(0, 16, (4, 6)).astype(np.int32)

    def loss(p, ids, labels, placed=True):
        x = p["emb"][ids]
        if placed:
            x = dist.reshard(x, m1, [S(0), R])
        x = jnp.tanh(x @ p["w"])
        table = dist.reshard(p["emb"], m1, [R, R]) if placed else p["emb"]  # the head's copy
        logits = x @ table.T
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def placed():
        return {"emb": dist.shard_tensor(emb, m0, [R, S(0)]), "w": dist.shard_tensor(w, m1, [R, R])}

    idd, lab = dist.shard_tensor(ids, m0, [S(0), R]), dist.shard_tensor(labels, m1, [S(0), R])
    ref_loss, ref_grads = jax.value_and_grad(lambda q: loss(q, ids, labels, False))(
        {"emb": emb, "w": w})
    for value, grads in (dist.jit(jax.value_and_grad(loss))(placed(), idd, lab),
                         dist.PipelineRunner.from_function(loss, "1F1B", 2).value_and_grad(
                             placed(), idd, lab)):
        np.testing.assert_allclose(float(value.numpy()), float(ref_loss), rtol=1e-5)
        np.testing.assert_allclose(grads["emb"].numpy(), ref_grads["emb"], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(grads["w"].numpy(), ref_grads["w"], rtol=1e-4, atol=1e-6)
        assert grads["emb"].mesh == m0  # back on the table's mesh


_BAD_LOSSES = {  # loss_fn results to_static's step refuses, but for the constant (accepted)
    "tuple": lambda o, t: (jnp.mean((o - t) ** 2), jnp.max(o)),
    "dict": lambda o, t: {"loss": jnp.mean((o - t) ** 2)},
    "int32": lambda o, t: jnp.sum(o > t),
    "per-sample": lambda o, t: jnp.mean((o - t) ** 2, axis=1),
    "python float": lambda o, t: 0.0,
}


@pytest.mark.parametrize("strategy", [
    {"pipeline": {"enable": True, "schedule_mode": "1F1B", "accumulate_steps": 2}},
    {"recompute": {"enable": True}}], ids=["1F1B", "staged-recompute"])
@pytest.mark.parametrize("result", list(_BAD_LOSSES))
def test_a_pipelined_step_checks_the_loss_as_the_one_program_step_does(strategy, result):
    """A loss_fn returning a tuple, a dict, an int or per-sample values: the pipeline's stages
    (strategy.pipeline, or recompute on two meshes) refuse it with the one-program step's
    DistModelError — it was a bare AttributeError, and an int loss trained silently with zero
    gradients. A constant loss trains as there: loss 0, the params unchanged."""
    m0, m1 = MESHES_1D[:2]
    rng = np.random.default_rng(6)
    w0, w1 = (rng.normal(size=(8, 8)).astype(np.float32) * 0.3 for _ in range(2))
    x, y = (rng.normal(size=(8, 8)).astype(np.float32) for _ in range(2))

    def model(p, x, placed=True):
        h = jnp.tanh(x @ p["w0"])
        return (dist.reshard(h, m1, [S(0)]) if placed else h) @ p["w1"]

    def call(meshes, strategy, placed):
        p = {"w0": dist.shard_tensor(w0, meshes[0], [R]),
             "w1": dist.shard_tensor(w1, meshes[-1], [R])}
        dm = dist.to_static((lambda p, x: model(p, x, placed), p), None, _BAD_LOSSES[result],
                            optax.sgd(0.1), dist.Strategy(strategy))
        try:
            return dm(x, y), dm.params
        except dist.AutoshardError as e:
            return e, None

    want, _ = call([m0], None, False)  # the same loss_fn on one mesh: one program
    got, params = call([m0, m1], strategy, True)
    if isinstance(want, Exception):
        assert type(got) is type(want) is dist.DistModelError
        # (a per-sample loss is named by its shape: a micro-batch's in the pipeline)
        first_line = lambda e: re.sub(r"\(\d+,\)", "(n,)", str(e).splitlines()[0])
        assert first_line(got) == first_line(want)
    else:
        assert float(got.numpy()) == float(want.numpy()) == 0.0
        np.testing.assert_array_equal(params["w0"].numpy(), w0)
        np.testing.assert_array_equal(params["w1"].numpy(), w1)
