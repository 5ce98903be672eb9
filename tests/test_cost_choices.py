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
from autoshard.hlo import count_collectives

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
