"""Paddle's keyword names and argument forms: code ported from Paddle passes them as its own
signatures have them (`reshard(dist_tensor=...)`, `to_static(layer=..., loss=...)`)."""
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard as dist

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
R, S = dist.Replicate(), dist.Shard
X = np.arange(64, dtype=np.float32).reshape(8, 8)


def test_tensor_functions_take_paddles_keywords_and_positions():
    t = dist.shard_tensor(X, MESH, [S(0), R], None, None, False)  # dtype, place, stop_gradient
    moved = dist.reshard(dist_tensor=t, mesh=MESH, placements=[R, S(1)])
    assert moved.placements == [R, S(1)]
    np.testing.assert_array_equal(np.asarray(dist.unshard_dtensor(dist_tensor=moved)), X)
    blocks = dist.dtensor_to_local(dist_tensor=t, mesh=MESH, placements=[S(0), R])
    np.testing.assert_array_equal(np.concatenate([np.asarray(b) for b in blocks[::4]]), X)
    with pytest.raises(TypeError, match=r"got both 'x' and 'dist_tensor'"):
        dist.reshard(x=t, dist_tensor=t, mesh=MESH, placements=[R, R])


def test_meshes_stages_loaders_and_to_static_take_paddles_keywords():
    mesh = dist.ProcessMesh(shape=[2, 4], process_ids=range(8), dim_names=["dp", "mp"])
    assert mesh == MESH
    with pytest.raises(dist.MeshError, match=r"the shape holds 6 devices but 8 process ids"):
        dist.ProcessMesh(shape=[2, 3], process_ids=range(8))
    assert dist.ShardingStage2(sharding_mesh_dim="dp", mesh=MESH).mesh_dim == "dp"
    batches = [(X, X[:, :4]) for _ in range(2)]
    loader = dist.shard_dataloader(dataloader=batches, meshes=MESH, shard_dims="dp")
    w = {"w": dist.shard_tensor(np.eye(8, 4, dtype=np.float32), MESH, [R, S(1)])}
    model = dist.to_static(layer=(lambda p, x: x @ p["w"], w), loader=loader,
                           loss=lambda out, y: jnp.mean((out - y) ** 2),
                           optimizer=optax.sgd(0.0))
    for x, y in loader:
        np.testing.assert_allclose(model(x, y).numpy(), np.mean((X @ np.eye(8, 4) - X[:, :4]) ** 2),
                                   rtol=1e-6)


def test_disttensor_answers_paddles_queries():
    mesh = dist.ProcessMesh([[3, 1], [0, 2]], ["a", "b"])  # device 3 holds block (0, 0)
    t = dist.shard_tensor(X[:4, :4], mesh, [S(0), S(1)])
    assert t.is_dist() and t.process_mesh == mesh
    # this rank's block: the process's first device in the mesh (device 3, listed first)
    np.testing.assert_array_equal(np.asarray(t._local_value()), X[:2, :2])
    np.testing.assert_array_equal(np.asarray(t._local_value()), np.asarray(t.local(3)))
