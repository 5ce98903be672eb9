"""StageRunner: a model split across meshes trains as it does on one device.

The seed's §4.4 3D hybrid example (examples/seed_hybrid.py) against plain jax + optax, where
its params and optimizer states live, and which collectives each stage program runs; then a
three-stage chain with labels and nonlinearities against jax.value_and_grad.
"""
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard as dist
from autoshard.hlo import collectives, group_size

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import seed_hybrid  # noqa: E402

MESH0, MESH1 = seed_hybrid.mesh0, seed_hybrid.mesh1


@pytest.fixture(scope="module")
def hybrid() -> seed_hybrid.HybridRun:
    return seed_hybrid.train_hybrid(steps=4)


def test_seed_hybrid_equals_one_device(hybrid):
    losses, ref_params = seed_hybrid.one_device(steps=4)
    np.testing.assert_allclose(hybrid.losses, losses, rtol=1e-5, atol=1e-6)
    for params, ref in zip(hybrid.params, ref_params):
        for name in ref:
            np.testing.assert_allclose(params[name].numpy(), ref[name], rtol=1e-4, atol=1e-6)


def test_seed_forward_as_written_is_cut_by_dist_jit_and_equals_one_device():
    """The seed's forward with its reshard inside one dist.jit train step (test_cut.py)."""
    losses, params = seed_hybrid.train_as_written(steps=3)
    ref_losses, ref_params = seed_hybrid.one_device(steps=3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for name, ref in {**ref_params[0], **ref_params[1]}.items():
        np.testing.assert_allclose(params[name].numpy(), ref, rtol=1e-4, atol=1e-6)
    assert (params["w0"].mesh, params["w1"].mesh) == (MESH0, MESH1)


def test_seed_hybrid_params_and_states_stay_on_their_stage(hybrid):
    R, S = dist.Replicate, dist.Shard
    (p0, p1), (s0, s1) = hybrid.params, hybrid.states
    assert p0["w0"].mesh == MESH0 and p0["w0"].placements == [R(), S(1)]  # column split
    assert p1["w1"].mesh == MESH1 and p1["w1"].placements == [R(), S(0)]  # row split
    for state, mesh, name, placements in [(s0, MESH0, "w0", [R(), S(1)]),
                                          (s1, MESH1, "w1", [R(), S(0)])]:
        leaves = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, dist.DistTensor))
        moments = [x for x in leaves if isinstance(x, dist.DistTensor) and x.ndim == 2]
        assert len(moments) == 2  # AdamW's mu and nu, placed as their param
        for m in moments:
            assert m.mesh == mesh and m.placements == placements, (name, m)


def _all_reduce_groups(hlo_text: str) -> list[int]:
    lines = [line for line in hlo_text.splitlines() if " all-reduce(" in line
             or " all-reduce-start(" in line]
    assert len(lines) == len(collectives(hlo_text))  # nothing but all-reduces
    return sorted(group_size(line, 4) for line in lines)


def _array(out):
    """A dist.jit output under jax.vjp as one array, whichever form dist.jit returns it in."""
    return out.physical if isinstance(out, dist.DistTensor) else out


def test_seed_hybrid_stage_programs_collectives(hybrid):
    """Forward: stage 0 is local (batch on x, w0 columns on y); stage 1's row-split matmul and
    mean end in one all-reduce over x and y. Backward: each weight gradient is summed over the
    batch split, one all-reduce over x (2 devices) per stage."""
    (p0, p1), stage0, stage1 = hybrid.params, *hybrid.runner.programs
    x = dist.shard_tensor(np.ones((2, 16, 64), "float32"), MESH0, [dist.Shard(0), dist.Replicate()])
    y = dist.reshard(stage0(p0, x), MESH1, [dist.Shard(0), dist.Shard(2)])
    assert _all_reduce_groups(stage0.lower(p0, x).compile().as_text()) == []
    assert _all_reduce_groups(stage1.lower(p1, y).compile().as_text()) == [4]

    backward1 = jax.jit(lambda p, a, ct: jax.vjp(lambda q, b: _array(stage1(q, b)), p, a)[1](ct))
    assert _all_reduce_groups(backward1.lower(p1, y, np.float32(1)).compile().as_text()) == [2]
    d_y = dist.shard_tensor(np.ones((2, 16, 256), "float32"), MESH0, [dist.Shard(0), dist.Shard(2)])
    backward0 = jax.jit(lambda p, a, ct: jax.vjp(lambda q: _array(stage0(q, a)), p)[1](ct))
    assert _all_reduce_groups(backward0.lower(p0, x, d_y.physical).compile().as_text()) == [2]


# -- a three-stage chain mesh0 -> mesh1 -> mesh0 with labels ----------------------------------
def _layer(params, x):
    return jnp.tanh(jnp.matmul(x, params["w"]) + params["b"])


def _head(params, x, label):
    return jnp.mean((jnp.matmul(x, params["w"]) - label) ** 2)


def _chain_data():
    rng = np.random.default_rng(7)
    shapes = [(16, 32), (32, 32), (32, 8)]
    params = [{"w": rng.normal(size=s).astype("float32") * 0.3,
               "b": rng.normal(size=s[1]).astype("float32") * 0.1} for s in shapes]
    del params[2]["b"]
    x = rng.normal(size=(4, 16)).astype("float32")
    label = rng.normal(size=(4, 8)).astype("float32")
    return params, x, label


def _chain_runner() -> dist.StageRunner:
    R, S = dist.Replicate(), dist.Shard
    return dist.StageRunner([
        dist.Stage(_layer, MESH0),
        dist.Stage(_layer, MESH1),                         # keeps the activation's placements
        dist.Stage(_head, MESH0, in_placements=[S(0), R]),  # back to mesh0
    ])


def _place_chain(params):
    R, S = dist.Replicate(), dist.Shard
    on = [(MESH0, [R, S(1)], [R, S(0)]), (MESH1, [R, S(0)], [R, R]), (MESH0, [R, R], None)]
    return [{k: dist.shard_tensor(v, mesh, w_pl if k == "w" else b_pl) for k, v in p.items()}
            for p, (mesh, w_pl, b_pl) in zip(params, on)]


def _chain_loss(params, x, label):
    return _head(params[2], _layer(params[1], _layer(params[0], x)), label)


def test_three_stage_chain_with_labels_equals_one_device():
    params, x, label = _chain_data()
    placed = _place_chain(params)
    loader = dist.shard_dataloader([(x, label)], meshes=[MESH0, MESH0], shard_dims="x")
    data, target = next(iter(loader))
    runner = _chain_runner()
    loss, grads = runner.value_and_grad(placed, data, target)
    ref_loss, ref_grads = jax.value_and_grad(_chain_loss)(params, x, label)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(runner.forward(placed, data, target).numpy(), ref_loss, rtol=1e-5)
    for g, p, ref in zip(grads, placed, ref_grads):
        for k in ref:
            assert g[k].mesh == p[k].mesh and g[k].placements == p[k].placements
            np.testing.assert_allclose(g[k].numpy(), ref[k], rtol=1e-4, atol=1e-6)


def test_params_on_another_mesh_are_a_clear_error():
    params, x, label = _chain_data()
    placed = _place_chain(params)
    placed[1], placed[2] = placed[2], placed[1]
    data = dist.shard_tensor(x, MESH0, [dist.Shard(0), dist.Replicate()])
    with pytest.raises(dist.StageError, match="stage 1 is on"):
        _chain_runner().value_and_grad(placed, data, label)


def test_last_stage_must_return_a_scalar_loss():
    runner = dist.StageRunner([dist.Stage(_layer, MESH0)])
    params = _place_chain(_chain_data()[0])[:1]
    data = dist.shard_tensor(_chain_data()[1], MESH0, [dist.Shard(0), dist.Replicate()])
    with pytest.raises(dist.StageError, match="scalar loss"):
        runner.value_and_grad(params, data)
    with pytest.raises(dist.StageError, match="at least one"):
        dist.StageRunner([])


@pytest.mark.parametrize("runner", ["StageRunner", "PipelineRunner"])
def test_stages_on_meshes_of_another_rank_say_where_the_activation_lands(runner):
    """A 2-d stage feeding a 1-d one, without in_placements: the activation's placements
    cannot carry over; the error names the stages and meshes and writes the in_placements
    that keeps the split by dim name (it blamed placements the user never wrote); with them,
    loss and gradients equal one device."""
    R, S = dist.Replicate(), dist.Shard
    m0 = dist.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    m1 = dist.ProcessMesh([4, 5, 6, 7], ["dp"])
    rng = np.random.default_rng(0)
    w0, w1, x, y = (rng.normal(size=(8, 8)).astype("float32") * 0.3 for _ in range(4))

    def s0(p, x):
        return jnp.tanh(x @ p)

    def s1(p, h, y):
        return jnp.mean((jnp.tanh(h @ p) - y) ** 2)

    def make(second):
        stages = [dist.Stage(s0, m0), second]
        return (dist.StageRunner(stages) if runner == "StageRunner"
                else dist.PipelineRunner(stages, "1F1B", 2))

    params = [dist.shard_tensor(w0, m0, [R, R]), dist.shard_tensor(w1, m1, [R])]
    args = (params, dist.shard_tensor(x, m0, [S(0), R]), dist.shard_tensor(y, m1, [S(0)]))
    with pytest.raises(dist.StageError, match=re.escape(
            "stage 0's activation is placed [S(0), R] on a 2-d mesh ['dp', 'mp'], and stage 1 "
            "runs on a 1-d mesh ['dp']: say where it lands there, dist.Stage(fn, mesh, "
            "in_placements=[dist.Shard(0)])")):
        make(dist.Stage(s1, m1)).value_and_grad(*args)
    loss, grads = make(dist.Stage(s1, m1, in_placements=[S(0)])).value_and_grad(*args)
    ref, ref_grads = jax.value_and_grad(lambda w: s1(w[1], s0(w[0], x), y))([w0, w1])
    np.testing.assert_allclose(float(loss.numpy()), float(ref), rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-4, atol=1e-6)
