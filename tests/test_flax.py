"""flax models run through dist.jit unchanged apart from the annotations."""
import warnings

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import autoshard as dist

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


def _check(step, params, state, x, y, tx):
    dparams = jax.tree_util.tree_map_with_path(
        lambda p, v: dist.shard_tensor(v, MESH, _megatron(p, v)), params)
    dx = dist.shard_tensor(x, MESH, [dist.Shard(0), dist.Replicate()])
    f = dist.jit(step)
    ref_p, ref_s = params, state
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error", dist.FallbackWarning)
            dparams, state, loss = f(dparams, state, dx, y)
        ref_p, ref_s, ref_loss = jax.jit(step)(ref_p, ref_s, x, y)
        np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(dparams, is_leaf=lambda t: isinstance(t, dist.DistTensor)),
                         jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)


def test_linen_model_trains_like_one_device():
    x, y = _data()
    model = LinenMLP()
    params = model.init(jax.random.key(0), x)
    tx = optax.adamw(1e-2)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    _check(step, params, tx.init(params), x, y, tx)


def test_nnx_model_trains_like_one_device():
    x, y = _data()
    model = NnxMLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    tx = optax.sgd(0.1)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            m = nnx.merge(graphdef, nnx.State(p))
            return jnp.mean((m(x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    _check(step, params, tx.init(params), x, y, tx)
