"""ragged_dot (a mixture of experts' grouped matmul): forward and gradients equal one device,
and compile to exactly the planned collectives."""
from __future__ import annotations

import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard as dist
from autoshard.hlo import count_collectives

MESH24 = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
R, S = dist.Replicate(), dist.Shard
RNG = np.random.default_rng(0)
ROWS, D, F, EXPERTS = 16, 8, 12, 3
X = RNG.normal(size=(ROWS, D)).astype(np.float32)
W = RNG.normal(size=(EXPERTS, D, F)).astype(np.float32)
SIZES = np.array([5, 0, 11], np.int32)  # rows per expert, one expert idle


def loss(x, w, sizes):
    return jnp.sum(jnp.tanh(jax.lax.ragged_dot(x, w, sizes)) ** 2)


@pytest.mark.parametrize("x_at,w_at,reduced", [
    pytest.param([R, R], [R, S(2)], False, id="experts' output features over mp"),
    pytest.param([R, S(1)], [R, S(1)], True, id="contracting features over mp"),
    pytest.param([S(0), R], [R, S(2)], False, id="rows split: gathered (groups stay whole)"),
])
def test_ragged_dot_values_and_gradients_equal_one_device(x_at, w_at, reduced):
    x = dist.shard_tensor(X, MESH24, x_at)
    w = dist.shard_tensor(W, MESH24, w_at)
    sizes = dist.shard_tensor(SIZES, MESH24, [R, R])
    f = dist.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        value, (gx, gw) = f(x, w, sizes)
    ref_value, (ref_gx, ref_gw) = jax.value_and_grad(loss, argnums=(0, 1))(X, W, SIZES)
    np.testing.assert_allclose(value.numpy(), ref_value, rtol=1e-5)
    np.testing.assert_allclose(gx.numpy(), ref_gx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw.numpy(), ref_gw, rtol=1e-5, atol=1e-5)
    plan = f.plan(x, w, sizes)
    (forward,) = [ep for ep in plan.eqns if ep.primitive == "ragged_dot_general"][:1]
    # the rows and the groups are never split; a split contracting dim leaves a partial sum
    assert not forward.required[0].dims[0] and not forward.required[1].dims[0]
    assert bool(forward.results[0].partial) == reduced
    planned = Counter(c.kind for c in plan.collectives)
    assert count_collectives(f.lower(x, w, sizes).compile().as_text()) == planned
