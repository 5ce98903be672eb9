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
from autoshard.hlo import collective_bytes, count_collectives

MESH24 = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
R, S = dist.Replicate(), dist.Shard
RNG = np.random.default_rng(0)
ROWS, D, F, EXPERTS = 16, 8, 12, 3
X = RNG.normal(size=(ROWS, D)).astype(np.float32)
W = RNG.normal(size=(EXPERTS, D, F)).astype(np.float32)
SIZES = np.array([5, 0, 11], np.int32)  # rows per expert, one expert idle


def loss(x, w, sizes):
    return jnp.sum(jnp.tanh(jax.lax.ragged_dot(x, w, sizes)) ** 2)


def _equal_one_device(x_value, x_at, w_value, w_at, sizes, **jit_options):
    """dist.jit of the loss's value and gradients: no fallback, and equal to one device."""
    placed = (dist.shard_tensor(x_value, MESH24, x_at), dist.shard_tensor(w_value, MESH24, w_at),
              dist.shard_tensor(sizes, MESH24, [R, R]))
    f = dist.jit(jax.value_and_grad(loss, argnums=(0, 1)), **jit_options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        value, grads = f(*placed)
    ref_value, ref_grads = jax.value_and_grad(loss, argnums=(0, 1))(x_value, w_value, sizes)
    np.testing.assert_allclose(value.numpy(), ref_value, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    return f, placed


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
    f, (x, w, placed_sizes) = _equal_one_device(X, x_at, W, w_at, sizes)
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
    f, (x, w, placed_sizes) = _equal_one_device(X, x_at, W4, [R, S(0)], sizes,
                                                out_placements=[[R, R], (x_at, [R, S(0)])])
    plan = f.plan(x, w, placed_sizes)
    forward, *backward = [ep for ep in plan.eqns if ep.primitive == "ragged_dot_general"]
    assert forward.required[1].dims[0] == ("mp",)
    assert "mp" in forward.results[0].partial_map
    (rhs_grad,) = [ep for ep in backward if len(ep.results[0].dims) == 3]
    assert rhs_grad.results[0].dims[0] == ("mp",)
    assert not [c for c in plan.collectives if c.kind == "all-gather"]  # no expert, no token
    planned = Counter(c.kind for c in plan.collectives)
    assert count_collectives(f.lower(x, w, placed_sizes).compile().as_text()) == planned


def _moe_step(unique: bool):
    """A dropless top-1 mixture of experts: route, sort the tokens by expert, two grouped
    matmuls, unsort; its train step (grad + SGD)."""
    experts = 4

    def moe(p, x):
        logits = x @ p["router"]
        expert = jnp.argmax(logits, axis=-1)
        gate = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), expert[:, None], axis=-1)
        order = jnp.argsort(expert)
        sizes = jnp.bincount(expert, length=experts).astype(jnp.int32)
        h = jax.nn.gelu(jax.lax.ragged_dot(x[order], p["w_in"], sizes))
        ys = jax.lax.ragged_dot(h, p["w_out"], sizes)
        return x + jnp.zeros_like(ys).at[order].set(ys, unique_indices=unique) * gate

    def step(p, x, y):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((moe(p, x) - y) ** 2))(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    return step


@pytest.mark.parametrize("w_at", [
    pytest.param(([R, S(0)], [R, S(0)]), id="experts over mp"),
    pytest.param(([R, S(2)], [R, S(1)]), id="each expert's hidden features over mp"),
])
@pytest.mark.parametrize("unique", [True, False], ids=["unique unsort", "plain unsort"])
def test_a_mixture_of_experts_train_step_equals_one_device(w_at, unique):
    tokens, d, f = 64, 16, 32
    params = {"router": RNG.normal(size=(d, 4)).astype(np.float32),
              "w_in": 0.1 * RNG.normal(size=(4, d, f)).astype(np.float32),
              "w_out": 0.1 * RNG.normal(size=(4, f, d)).astype(np.float32)}
    xs, ys = (RNG.normal(size=(tokens, d)).astype(np.float32) for _ in range(2))
    placed = {"router": dist.shard_tensor(params["router"], MESH24, [R, R]),
              "w_in": dist.shard_tensor(params["w_in"], MESH24, w_at[0]),
              "w_out": dist.shard_tensor(params["w_out"], MESH24, w_at[1])}
    x, y = (dist.shard_tensor(a, MESH24, [S(0), R]) for a in (xs, ys))
    # the tokens are a permutation of themselves: saying so (unique_indices) lets the
    # gradient of the unsort be a plain gather; without it jax scatters ids into zeros and
    # gathers them back, which the plan computes whole (recompute.py) instead of reducing
    step = _moe_step(unique=unique)
    f = dist.jit(step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        new, loss = f(placed, x, y)
    ref_new, ref_loss = jax.jit(step)(params, xs, ys)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    for name in params:
        np.testing.assert_allclose(new[name].numpy(), ref_new[name], rtol=1e-4, atol=1e-6)
        assert new[name].placements == placed[name].placements
    plan = f.plan(placed, x, y)
    hlo = f.lower(placed, x, y).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)
    assert not [c for c in plan.collectives if c.kind == "all-gather" and c.bytes_per_device > 1024]
    physical = jax.tree.map(lambda t: t.physical, (placed, x, y),
                            is_leaf=lambda t: isinstance(t, dist.DistTensor))
    shardings = (jax.tree.map(lambda a: a.sharding, physical[0]), None)
    base = jax.jit(step, out_shardings=shardings).lower(*physical).compile().as_text()
    ours_bytes, base_bytes = sum(collective_bytes(hlo).values()), sum(collective_bytes(base).values())
    assert ours_bytes <= base_bytes, (ours_bytes, base_bytes)  # expert parallel: 0.996x
