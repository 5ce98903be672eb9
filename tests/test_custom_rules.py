"""Differentiating through dist.jit, and custom derivative rules kept across partitioning.

`jax.grad(dist.jit(f))` must equal `jax.grad(f)` on one device, and a custom_jvp / custom_vjp
inside f must be differentiated by the user's rule (a straight-through estimator, a clipped
gradient, relu's derivative at 0), not by autodiff of its partitioned primal.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard as dist

MESH24 = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
MESH8 = dist.ProcessMesh(list(range(8)), dim_names=["x"])


@jax.custom_jvp
def ste_round(x):
    return jnp.round(x)


@ste_round.defjvp
def _ste_round_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return jnp.round(x), t  # straight-through: d round / dx := 1


@jax.custom_vjp
def clip_grad(x):
    return x


def _clip_fwd(x):
    return x, None


def _clip_bwd(_, g):
    return (jnp.clip(g, -0.01, 0.01),)


clip_grad.defvjp(_clip_fwd, _clip_bwd)


def loss_ste(w, x):
    return jnp.sum(ste_round(x @ w) ** 2)


def loss_clip(w, x):
    h = clip_grad(x @ w)
    return jnp.sum(jax.nn.relu(h) * 3.0)


def loss_relu_at_zero(w, x):
    # x @ w is exactly 0 for half the rows: relu's custom_jvp gives 0 there, autodiff of
    # max(x, 0) through a partitioned where would too, but a wrong wrap would give NaN/0.5.
    return jnp.sum(jax.nn.relu(x @ w)) + jnp.sum(jax.nn.gelu(x @ w))


def _data(seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(8, 16)).astype(np.float32)
    x = rng.normal(size=(8, 8)).astype(np.float32) * 2
    x[::2] = 0.0
    return w, x


PLACEMENTS = {
    "rows-dp/cols-mp": (MESH24, [dist.Replicate(), dist.Shard(1)], [dist.Shard(0), dist.Replicate()]),
    "contracting-split": (MESH24, [dist.Shard(0), dist.Replicate()], [dist.Replicate(), dist.Shard(1)]),
    "1d-batch": (MESH8, [dist.Replicate()], [dist.Shard(0)]),
}


@pytest.mark.parametrize("loss", [loss_ste, loss_clip, loss_relu_at_zero], ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", sorted(PLACEMENTS))
def test_grad_through_dist_jit_uses_the_custom_rule(loss, case):
    mesh, w_pl, x_pl = PLACEMENTS[case]
    w, x = _data()
    wd, xd = dist.shard_tensor(w, mesh, w_pl), dist.shard_tensor(x, mesh, x_pl)
    f = dist.jit(loss)
    value, grad = jax.value_and_grad(lambda a: f(a, xd))(wd)
    ref_value, ref_grad = jax.value_and_grad(loss)(w, x)
    np.testing.assert_allclose(np.asarray(value), ref_value, rtol=1e-5)
    # gelu's tanh, fused in one program here and op by op in the reference, rounds apart by
    # ~2e-5 in the gradient's sums over 8 rows; a wrong wrap at zero is off by 0.5 or NaN
    np.testing.assert_allclose(np.asarray(grad.numpy() if hasattr(grad, "numpy") else grad),
                               ref_grad, rtol=1e-4, atol=1e-4)
    # the rule really matters: autodiff of the primal would give a different gradient
    if loss is loss_ste:
        assert not np.allclose(ref_grad, 0.0)
    if loss is loss_clip:
        assert np.abs(ref_grad).max() <= 0.01 * np.abs(x).sum(0).max() + 1e-6


@pytest.mark.parametrize("loss", [loss_ste, loss_clip], ids=lambda f: f.__name__)
def test_grad_through_dist_jit_of_a_bfloat16_custom_rule(loss):
    """Inputs of bfloat16 are differentiable inputs of the custom rule too (numpy does not
    count bfloat16 as inexact: their cotangent was a float0 and jax.grad failed)."""
    mesh, w_pl, x_pl = PLACEMENTS["rows-dp/cols-mp"]
    w, x = (a.astype(jnp.bfloat16) for a in _data(2))
    wd, xd = dist.shard_tensor(w, mesh, w_pl), dist.shard_tensor(x, mesh, x_pl)
    f = dist.jit(lambda a, b: loss(a, b).astype(jnp.float32))
    grad = jax.grad(lambda a: f(a, xd))(wd)
    ref = jax.grad(lambda a: loss(a, x).astype(jnp.float32))(w)
    assert grad.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(grad.numpy(), np.float32), np.asarray(ref, np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case", sorted(PLACEMENTS))
def test_jvp_through_dist_jit(case):
    mesh, w_pl, x_pl = PLACEMENTS[case]
    w, x = _data(1)
    t = np.ones_like(w)
    wd, xd = dist.shard_tensor(w, mesh, w_pl), dist.shard_tensor(x, mesh, x_pl)
    f = dist.jit(loss_ste)
    y, ty = jax.jvp(lambda a: f(a, xd), (wd,), (dist.shard_tensor(t, mesh, w_pl),))
    ry, rty = jax.jvp(lambda a: loss_ste(a, x), (w,), (t,))
    np.testing.assert_allclose(np.asarray(y), ry, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ty), rty, rtol=1e-5)


def test_grad_inside_jax_jit_of_dist_jit():
    mesh, w_pl, x_pl = PLACEMENTS["rows-dp/cols-mp"]
    w, x = _data(2)
    wd, xd = dist.shard_tensor(w, mesh, w_pl), dist.shard_tensor(x, mesh, x_pl)
    f = dist.jit(loss_clip)
    g = jax.jit(jax.grad(lambda a, b: f(a, b)))(wd, xd)
    np.testing.assert_allclose(np.asarray(g.numpy() if hasattr(g, "numpy") else g),
                               jax.grad(loss_clip)(w, x), rtol=1e-5, atol=1e-6)


def test_custom_rule_survives_inside_the_program():
    """jax.grad *inside* the partitioned function also sees the user's rule."""
    mesh, w_pl, x_pl = PLACEMENTS["contracting-split"]
    w, x = _data(3)
    wd, xd = dist.shard_tensor(w, mesh, w_pl), dist.shard_tensor(x, mesh, x_pl)
    f = dist.jit(jax.grad(loss_ste))
    np.testing.assert_allclose(f(wd, xd).numpy(), jax.grad(loss_ste)(w, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", [jax.nn.relu, jax.nn.softplus, ste_round],
                         ids=lambda f: getattr(f, "__name__", "ste_round"))
def test_a_pending_sum_reduced_inside_and_outside_a_custom_rule_is_reduced_once(act):
    """`x @ w` over a split contracting dim is a pending sum; relu (a custom_jvp) reduces it
    inside its body and relu's derivative (`x > 0`, outside the body) reduces it again: the
    same psum of the same operand, which XLA runs once, so the plan lists it once too (it
    listed it twice: plan 2 all-reduces, HLO 1)."""
    from collections import Counter

    from autoshard.hlo import count_collectives

    mesh, w_pl, x_pl = PLACEMENTS["contracting-split"]
    w, x = _data(6)
    wd, xd = dist.shard_tensor(w, mesh, w_pl), dist.shard_tensor(x, mesh, x_pl)

    def loss(w, x):
        return jnp.sum(act(x @ w) ** 2)

    f = dist.jit(jax.value_and_grad(loss))
    value, grad = f(wd, xd)
    ref_value, ref_grad = jax.value_and_grad(loss)(w, x)
    np.testing.assert_allclose(float(value.numpy()), ref_value, rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), ref_grad, rtol=1e-4, atol=1e-4)
    collectives = f.plan(wd, xd).collectives
    planned = Counter(c.kind for c in collectives)
    assert count_collectives(f.lower(wd, xd).compile().as_text()) == planned
    moves = [(c.value, c.step) for c in collectives]
    assert len(moves) == len(set(moves)), collectives  # no value moved the same way twice


def test_differentiating_a_partial_input_differentiates_its_value():
    """jax.grad flattens a Partial DistTensor to its value, reduced: the gradient is that of
    the value (the parts' cotangents would each be the whole gradient), without the Partial."""
    mesh = MESH8
    w, x = _data(4)
    wd = dist.shard_tensor(w, mesh, [dist.Replicate()])
    partial = dist.reshard(wd, mesh, [dist.Partial()])
    f = dist.jit(lambda a: jnp.sum(jnp.sin(a) * 2.0))
    g = jax.grad(f)(partial)
    assert g.placements == [dist.Replicate()]
    np.testing.assert_allclose(g.numpy(), 2 * np.cos(w), rtol=1e-6, atol=1e-6)


def test_eager_ops_under_an_outer_grad():
    """A notebook user differentiates eager DistTensor ops: each op's program reduces its own
    Partial outputs, so jax.grad never sees a Partial value."""
    mesh, w_pl, x_pl = PLACEMENTS["contracting-split"]
    w, x = _data(5)
    wd, xd = dist.shard_tensor(w, mesh, w_pl), dist.shard_tensor(x, mesh, x_pl)
    g = jax.grad(lambda a: (xd @ a).sum())(wd)  # x @ w contracts the split dim: Partial
    np.testing.assert_allclose(np.asarray(g.numpy() if hasattr(g, "numpy") else g),
                               jax.grad(lambda a: (x @ a).sum())(w), rtol=1e-5, atol=1e-5)


@jax.custom_jvp
def doubled_concat(x):
    return jnp.concatenate([x, jnp.pad(x, (1, 0))[:-1]])


@doubled_concat.defjvp
def _doubled_concat_jvp(primals, tangents):
    y, t = jax.jvp(lambda a: jnp.concatenate([a, jnp.pad(a, (1, 0))[:-1]]), primals, tangents)
    return y, 2.0 * t  # not autodiff's: the user's rule must be the one applied


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_custom_jvp_whose_result_is_reshaped_differentiates_by_its_rule(where):
    # the rule's primal and tangent results need collectives alike (a split dim concatenated
    # and shifted); gathered in one packed buffer, the primal would wait on the tangent, which
    # jax's linearization of the rule cannot have: each moves by itself
    x = np.random.default_rng(0).normal(size=(16,)).astype(np.float32)
    loss = lambda v: jnp.sum(doubled_concat(v) ** 2 * jnp.arange(32.0))  # noqa: E731
    body = lambda v: loss(dist.shard_tensor(v, MESH8, [dist.Shard(0)]))  # noqa: E731
    f = jax.grad(dist.jit(body)) if where == "outside" else dist.jit(jax.grad(body))
    got = f(jnp.asarray(x))
    want = jax.jit(jax.grad(loss))(x)
    np.testing.assert_allclose(np.asarray(got.numpy() if hasattr(got, "numpy") else got), want,
                               rtol=1e-5, atol=1e-5)
    # the rule was applied (autodiff of the primal would give half)
    autodiff = jax.grad(lambda v: jnp.sum(jnp.concatenate([v, jnp.pad(v, (1, 0))[:-1]]) ** 2
                                          * jnp.arange(32.0)))(x)
    np.testing.assert_allclose(want, 2 * autodiff, rtol=1e-5)


@pytest.mark.parametrize("placements,mesh", [([dist.Shard(0)], MESH8),
                                             ([dist.Shard(0), dist.Shard(1)], MESH24)])
def test_a_custom_vjp_with_optimize_remat_differentiated_inside_stays_split(placements, mesh):
    """custom_vjp(..., optimize_remat=True) differentiated inside dist.jit: jax's `remat_opt`
    (its forward of residuals and outputs) is partitioned by its body's rules — it ran
    replicated with a FallbackWarning, its inputs gathered — and the gradient equals one
    device, with its operand's placements."""
    import warnings

    @jax.custom_vjp
    def f(x):
        return jnp.sin(x) * x

    f.defvjp(lambda x: (jnp.sin(x) * x, (jnp.sin(x), jnp.cos(x), x)),
             lambda r, g: (g * (r[0] + r[2] * r[1]),), optimize_remat=True)
    x = np.arange(64, dtype=np.float32).reshape(8, 8) / 10

    def loss(x):
        return (f(x) ** 2).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        g = dist.jit(jax.grad(loss))(dist.shard_tensor(x, mesh, placements))
        value, g2 = dist.jit(jax.value_and_grad(loss))(dist.shard_tensor(x, mesh, placements))
    np.testing.assert_allclose(g.numpy(), jax.grad(loss)(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g2.numpy(), jax.grad(loss)(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(value.numpy()), float(loss(x)), rtol=1e-5)
    assert g.placements == placements


@jax.custom_vjp
def _matmul_by_rule(x, w):
    return x @ w


_matmul_by_rule.defvjp(lambda x, w: (x @ w, (x, w)),
                       lambda res, g: (g @ res[1].T * 0.5, res[0].T @ g))  # (halved: by the rule)


def _loss_of_a_moving_rule(x, w):
    return jnp.sum(_matmul_by_rule(x, w) ** 2)


MESH222 = dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["a", "b", "c"])


@pytest.mark.parametrize("how", ["grad", "vjp", "jit-of-grad"])
@pytest.mark.parametrize("mesh,x_pl,w_pl", [
    (MESH8, [dist.Shard(1)], [dist.Replicate()]),
    (MESH24, [dist.Shard(0), dist.Shard(1)], [dist.Replicate(), dist.Replicate()]),
    (MESH222, [dist.Replicate(), dist.Shard(1), dist.Replicate()],
     [dist.Shard(1), dist.Replicate(), dist.Shard(0)]),
], ids=["8:x-contracting", "2x4:x-rows-and-contracting", "2x2x2:w-split-both"])
def test_a_custom_vjp_whose_body_moves_data_is_differentiated_from_outside(mesh, x_pl, w_pl, how):
    """jax.grad taken outside dist.jit traces a custom_vjp's forward while differentiating the
    partitioned program, after the call that partitioned it has returned: its body's moves (a
    contraction over a split dim: an all-reduce) ran then without the call's replayer, an
    IndexError (found by a probe). The gradient is the rule's, as on one device."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    w = rng.normal(size=(8, 8)).astype(np.float32)
    xd, wd = dist.shard_tensor(x, mesh, x_pl), dist.shard_tensor(w, mesh, w_pl)
    f = dist.jit(_loss_of_a_moving_rule)
    expected = jax.grad(_loss_of_a_moving_rule, argnums=(0, 1))(x, w)
    if how == "grad":
        got = jax.grad(f, argnums=(0, 1))(xd, wd)
    elif how == "vjp":
        _, pull = jax.vjp(f, xd, wd)
        got = pull(np.float32(1.0))
    else:
        grad = jax.jit(jax.grad(f, argnums=(0, 1)))
        got = grad(xd, wd)
        hlo = grad.lower(xd, wd).compile().as_text()
        assert "all-reduce" in hlo  # the contraction over a split dim, as planned
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.asarray(g.numpy() if hasattr(g, "numpy") else g), e,
                                   rtol=1e-4, atol=1e-4)
