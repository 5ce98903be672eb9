"""flax models run through dist.jit unchanged apart from the annotations."""

import flax.linen as linen
import jax
import numpy as np
import optax
from flax import nnx

import autoshard as dist
from autoshard.testing import assert_trains_like_one_device, mse_step, nnx_apply

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])


class LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        x = linen.gelu(linen.Dense(32)(x))
        x = linen.LayerNorm()(x)
        return linen.Dense(4)(x)


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.down = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(self.norm(nnx.gelu(self.up(x))))


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 4)).astype(np.float32)


def _megatron(path, x):
    name = jax.tree_util.keystr(path)
    if x.ndim == 2 and ("Dense_0" in name or "up" in name):
        return [dist.Replicate(), dist.Shard(1)]
    if x.ndim == 2 and ("Dense_1" in name or "down" in name):
        return [dist.Replicate(), dist.Shard(0)]
    return [dist.Replicate(), dist.Replicate()]


def _check(step, params, state, x, y):
    dparams = jax.tree_util.tree_map_with_path(
        lambda p, v: dist.shard_tensor(v, MESH, _megatron(p, v)), params)
    dx = dist.shard_tensor(x, MESH, [dist.Shard(0), dist.Replicate()])
    assert_trains_like_one_device(step, dparams, params, state, dx, x, y)


def test_linen_model_trains_like_one_device():
    x, y = _data()
    model = LinenMLP()
    params = model.init(jax.random.key(0), x)
    tx = optax.adamw(1e-2)
    _check(mse_step(model.apply, tx), params, tx.init(params), x, y)


def test_nnx_model_trains_like_one_device():
    x, y = _data()
    model = NnxMLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    tx = optax.sgd(0.1)
    _check(mse_step(nnx_apply(graphdef), tx), params, tx.init(params), x, y)
