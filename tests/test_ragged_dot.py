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


@pytest.mark.parametrize("x_at,w_at,reduced,rows_over", [
    pytest.param([R, R], [R, S(2)], False, (), id="experts' output features over mp"),
    pytest.param([R, S(1)], [R, S(1)], True, (), id="contracting features over mp"),
    pytest.param([S(0), R], [R, S(2)], False, ("dp",),
                 id="rows split over dp: each block's own group sizes"),
    pytest.param([S(0), S(0)], [R, R], False, ("dp", "mp"), id="rows split over both axes"),
])
@pytest.mark.parametrize("sizes", [
    pytest.param(SIZES, id="groups crossing blocks, one idle"),
    pytest.param(np.array([2, 7, 0], np.int32), id="rows past every group stay zero"),
])
def test_ragged_dot_values_and_gradients_equal_one_device(x_at, w_at, reduced, rows_over, sizes):
    x = dist.shard_tensor(X, MESH24, x_at)
    w = dist.shard_tensor(W, MESH24, w_at)
    placed_sizes = dist.shard_tensor(sizes, MESH24, [R, R])
    f = dist.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        value, (gx, gw) = f(x, w, placed_sizes)
    ref_value, (ref_gx, ref_gw) = jax.value_and_grad(loss, argnums=(0, 1))(X, W, sizes)
    np.testing.assert_allclose(value.numpy(), ref_value, rtol=1e-5)
    np.testing.assert_allclose(gx.numpy(), ref_gx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw.numpy(), ref_gw, rtol=1e-5, atol=1e-5)
    plan = f.plan(x, w, placed_sizes)
    forward, *backward = [ep for ep in plan.eqns if ep.primitive == "ragged_dot_general"]
    # the groups are never split; split rows stay split (no gather of the tokens), and a split
    # contracting dim leaves a partial sum
    assert forward.required[0].dims[0] == rows_over and not forward.required[1].dims[0]
    assert forward.results[0].dims[0] == rows_over
    assert bool(forward.results[0].partial) == reduced
    if rows_over:  # the experts' gradient sums its rows' blocks: pending over the row axes
        (rhs_grad,) = [ep for ep in backward if len(ep.results[0].dims) == 3]
        assert set(rhs_grad.results[0].partial_map) == set(rows_over)
        assert not [c for c in plan.collectives
                    if c.kind == "all-gather" and c.bytes_per_device >= X.nbytes // 2]
    planned = Counter(c.kind for c in plan.collectives)
    assert count_collectives(f.lower(x, w, placed_sizes).compile().as_text()) == planned


W4 = RNG.normal(size=(4, D, F)).astype(np.float32)


@pytest.mark.parametrize("x_at", [pytest.param([R, R], id="tokens replicated"),
                                  pytest.param([S(0), R], id="tokens over dp")])
@pytest.mark.parametrize("sizes", [pytest.param(np.array([5, 0, 7, 4], np.int32), id="all rows"),
                                   pytest.param(np.array([1, 2, 3, 1], np.int32),
                                                id="rows past every group")])
def test_experts_split_over_a_mesh_axis_run_their_own_rows(x_at, sizes):
    # expert parallelism: each device holds one expert's weights and multiplies the rows of
    # its expert (the others' come out zero: the output is a pending sum over mp); the experts'
    # gradient comes out split the same way, never gathered
    x = dist.shard_tensor(X, MESH24, x_at)
    w = dist.shard_tensor(W4, MESH24, [R, S(0)])
    placed_sizes = dist.shard_tensor(sizes, MESH24, [R, R])
    f = dist.jit(jax.value_and_grad(loss, argnums=(0, 1)),
                 out_placements=[[R, R], (x_at, [R, S(0)])])
    value, (gx, gw) = f(x, w, placed_sizes)
    ref_value, (ref_gx, ref_gw) = jax.value_and_grad(loss, argnums=(0, 1))(X, W4, sizes)
    np.testing.assert_allclose(value.numpy(), ref_value, rtol=1e-5)
    np.testing.assert_allclose(gx.numpy(), ref_gx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw.numpy(), ref_gw, rtol=1e-5, atol=1e-5)
    plan = f.plan(x, w, placed_sizes)
    forward, *backward = [ep for ep in plan.eqns if ep.primitive == "ragged_dot_general"]
    assert forward.required[1].dims[0] == ("mp",)
    assert "mp" in forward.results[0].partial_map
    (rhs_grad,) = [ep for ep in backward if len(ep.results[0].dims) == 3]
    assert rhs_grad.results[0].dims[0] == ("mp",)
    assert not [c for c in plan.collectives if c.kind == "all-gather"]  # no expert, no token
    planned = Counter(c.kind for c in plan.collectives)
    assert count_collectives(f.lower(x, w, placed_sizes).compile().as_text()) == planned
