"""Convolutional models: conv, pooling and their gradients partition without falling back.

A small flax nnx CNN (conv → relu → max pool → conv → avg pool → linear) trains on a 2×4 mesh
with the batch over dp and the conv channels over mp; every step equals one device, no
primitive runs replicated, and the compiled collectives are the planned ones.
"""
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoshard as dist
from autoshard.testing import assert_trains_like_one_device, mse_step, nnx_apply
from autoshard.hlo import count_collectives

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
R, S = dist.Replicate(), dist.Shard


class CNN(nnx.Module):
    def __init__(self, rngs):
        self.conv1 = nnx.Conv(4, 8, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 8, (3, 3), strides=(1, 1), padding="VALID", rngs=rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.conv1(x)), (2, 2), strides=(2, 2))
        x = nnx.avg_pool(jnp.tanh(self.conv2(x)), (2, 2), strides=(1, 1))
        return self.head(x.mean(axis=(1, 2)))


def _placements(path, v):
    # conv1 splits its output channels over mp (a column-parallel conv), conv2 contracts them
    # (row-parallel: its output is a pending sum over mp); the rest is replicated
    name = jax.tree_util.keystr(path)
    if "conv1" in name:
        return [R, S(v.ndim - 1)]
    if "conv2" in name and v.ndim == 4:
        return [R, S(2)]
    return [R, R]


@pytest.mark.parametrize("channels", ["mp", "replicated"])
def test_cnn_trains_like_one_device(channels):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 12, 12, 4)).astype(np.float32)
    y = rng.normal(size=(8, 4)).astype(np.float32)
    graphdef, params = nnx.split(CNN(nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(params)
    tx = optax.adam(1e-2)
    step = mse_step(nnx_apply(graphdef), tx)
    place = _placements if channels == "mp" else (lambda path, v: [R, R])
    dp = jax.tree_util.tree_map_with_path(
        lambda path, v: dist.shard_tensor(v, MESH, place(path, v)), params)
    dx = dist.shard_tensor(x, MESH, [S(0), R])
    state = tx.init(params)
    f = assert_trains_like_one_device(step, dp, params, state, dx, x, y)
    plan = f.plan(dp, state, dx, y)
    assert not plan.fallbacks
    hlo = f.lower(dp, state, dx, y).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)
    # data parallel: the conv activations are never gathered over dp, only gradients reduced
    assert not [c for c in plan.collectives if c.kind == "all-gather" and "dp" in c.axes]
    if channels == "mp":  # the mp-split channels meet once per conv2, as a matmul's would
        assert [c for c in plan.collectives if "mp" in c.axes]
