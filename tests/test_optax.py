"""optax as a JAX user writes it: `tx.init(params)` on DistTensor params, then `tx.update` inside
dist.jit. The state has one device's shapes and the step trains like one device, with the
collectives the plan promised — for optimizers whose state is not shaped like the params
(per-param scalars, factored rows, lists of accumulators, masked leaves) too."""
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard as dist
from autoshard.hlo import count_collectives
from autoshard.testing import assert_trains_like_one_device, mse_step

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
R, S = dist.Replicate, dist.Shard
MEGATRON = {"w0": [R(), S(1)], "b0": [R(), S(0)], "w1": [R(), S(0)], "scale": [R(), R()]}


def apply(p, x):
    return (jax.nn.gelu(x @ p["w0"] + p["b0"]) @ p["w1"]) * p["scale"]


def _weights(hidden=32):
    rng = np.random.default_rng(0)
    return {"w0": (rng.normal(size=(16, hidden)) * .3).astype(np.float32),
            "b0": np.zeros(hidden, np.float32),
            "w1": (rng.normal(size=(hidden, 16)) * .3).astype(np.float32),
            "scale": np.ones(16, np.float32)}


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "lion": lambda: optax.lion(1e-3),
    # state not shaped like the params:
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),  # factored rows
    "novograd": lambda: optax.novograd(1e-2),          # one scalar per param
    "zero_nans": lambda: optax.chain(optax.zero_nans(), optax.sgd(1e-2)),  # scalar bools
    "sm3": lambda: optax.sm3(1e-2),                    # a list of per-dim accumulators
    "muon": lambda: optax.contrib.muon(1e-2),          # MaskedNode where adam takes over
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
    "schedule_free": lambda: optax.contrib.schedule_free_adamw(1e-2),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_raw_init_has_one_devices_state_and_trains_like_one_device(name):
    tx = OPTIMIZERS[name]()
    w = _weights()
    params = {k: dist.shard_tensor(v, MESH, MEGATRON[k]) for k, v in w.items()}
    state, ref_state = tx.init(params), tx.init(w)
    is_dt = lambda t: isinstance(t, dist.DistTensor)  # noqa: E731
    got = jax.tree.map(lambda t: (tuple(t.shape), jnp.dtype(t.dtype)), state, is_leaf=is_dt)
    assert got == jax.tree.map(lambda t: (tuple(t.shape), jnp.dtype(t.dtype)), ref_state)
    if name == "adam":  # where the state mirrors a param it keeps the param's placements
        mu = state[0].mu
        assert {k: v.placements for k, v in mu.items()} == {k: params[k].placements for k in mu}

    rng = np.random.default_rng(1)
    x, y = (rng.normal(size=(8, 16)).astype(np.float32) for _ in range(2))
    dx = dist.shard_tensor(x, MESH, [S(0), R()])
    step = mse_step(apply, tx)
    f = assert_trains_like_one_device(step, params, w, ref_state, dx, x, y, steps=3)
    args = (params, state, dx, y)
    planned = Counter(c.kind for c in f.plan(*args).collectives)
    assert planned["all-reduce"] >= 1  # the batch's gradients meet over dp
    compiled = count_collectives(f.lower(*args).compile().as_text())
    if name == "muon":  # XLA unrolls the Newton-Schulz fori_loop: its psums appear 5 times
        assert set(compiled) == set(planned) and compiled.total() >= planned.total()
    else:
        assert compiled == planned


def test_per_example_clipping_unzips_through_distensor_nodes():
    """optax's per-example clipping maps (grads -> (clipped, norm)) and unzips with
    jax.tree.transpose: the DistTensor node stays where it was for the unzip."""
    w = _weights()
    params = {k: dist.shard_tensor(v, MESH, MEGATRON[k]) for k, v in w.items()}
    pairs = jax.tree.map(lambda p: (p, jnp.zeros(())), params)
    outer, inner = jax.tree.structure(params), jax.tree.structure((0, 0))
    firsts, norms = jax.tree.transpose(outer, inner, pairs)
    for k in w:
        assert isinstance(firsts[k], dist.DistTensor) and firsts[k].placements == MEGATRON[k]
        np.testing.assert_array_equal(firsts[k].numpy(), w[k])
        assert not isinstance(norms[k], dist.DistTensor) and norms[k].shape == ()


@pytest.mark.parametrize("init", ["dist.jit", "shard_optimizer"])
def test_galore_initialised_in_a_program_trains_like_one_device(init):
    """GaLore's init pairs the params with a tree made from them (`jax.tree.map(f, params,
    dim_nums)`), which a DistTensor, a pytree node, cannot pass outside a program (the README
    says so): initialised by dist.jit or shard_optimizer it trains like one device, through the
    projector's refresh (an SVD of the gradient every `update_proj_gap` steps, under a cond),
    with the collectives the plan lists."""
    tx = optax.contrib.galore(1e-2, rank=4, update_proj_gap=2)
    w = _weights()
    params = {k: dist.shard_tensor(v, MESH, MEGATRON[k]) for k, v in w.items()}
    state = (dist.jit(tx.init) if init == "dist.jit" else dist.shard_optimizer(tx).init)(params)
    ref_state = tx.init(w)
    is_dt = lambda t: isinstance(t, dist.DistTensor)  # noqa: E731
    assert (jax.tree.map(lambda t: tuple(t.shape), state, is_leaf=is_dt)
            == jax.tree.map(lambda t: tuple(t.shape), ref_state))
    rng = np.random.default_rng(1)
    x, y = (rng.normal(size=(8, 16)).astype(np.float32) for _ in range(2))
    dx = dist.shard_tensor(x, MESH, [S(0), R()])
    step = mse_step(apply, tx)
    f, ref = dist.jit(step), jax.jit(step)
    dp, ds, p, s = params, state, w, ref_state
    for _ in range(4):  # the projector is refreshed at steps 0 and 2
        dp, ds, loss = f(dp, ds, dx, y)
        p, s, ref_loss = ref(p, s, x, y)
        np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    for k in w:
        np.testing.assert_allclose(dp[k].numpy(), p[k], rtol=1e-4, atol=1e-5)
    for got, want in zip(jax.tree.leaves(ds[0].projector, is_leaf=is_dt),
                         jax.tree.leaves(s[0].projector)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)
    args = (params, state, dx, y)
    planned = Counter(c.kind for c in f.plan(*args).collectives)
    assert planned["all-reduce"] >= 1
    assert count_collectives(f.lower(*args).compile().as_text()) == planned


def test_uneven_storage_seen_by_a_tree_map_is_named():
    """A param split unevenly is stored padded; a tree.map that makes something of another
    shape from the storage is told so (and pointed at dist.jit / shard_optimizer), and the
    shard_optimizer / dist.jit inits see the logical shape."""
    w = _weights(hidden=30)
    params = {k: dist.shard_tensor(v, MESH, MEGATRON[k]) for k, v in w.items()}
    tx = optax.sm3(1e-2)
    with pytest.warns(dist.StorageViewWarning, match=r"padded.*dist\.jit") as seen:
        tx.init(params)
    assert any("shape (30,) placed [R, S(0)]" in str(m.message) and "shape (32,)" in str(m.message)
               and "test_optax.py:" in str(m.message) for m in seen)
    assert {m.filename for m in seen} == {__file__}  # the user's tx.init line, not optax's
    ref = jax.tree.map(lambda t: t.shape, tx.init(w))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dist.UnevenShardingWarning)
        warnings.simplefilter("error", dist.StorageViewWarning)
        for state in (dist.jit(tx.init)(params), dist.shard_optimizer(tx).init(params)):
            is_dt = lambda t: isinstance(t, dist.DistTensor)  # noqa: E731
            assert jax.tree.map(lambda t: tuple(t.shape), state, is_leaf=is_dt) == ref


@pytest.mark.parametrize("wrap", ["apply_if_finite", "multisteps_skip_not_finite"])
def test_a_gradient_checked_for_finiteness_is_reduced_once(wrap):
    """optax.apply_if_finite checks every gradient with is_finite (which needs the summed
    gradient), then updates inside a lax.cond: the update takes the gradients already reduced
    for the check — as many bytes as adam alone plus the check's flags, not each gradient
    reduced a second time inside the branch — and trains like one device."""
    inner = optax.adam(1e-2)
    tx = (optax.apply_if_finite(inner, 3) if wrap == "apply_if_finite" else
          optax.MultiSteps(inner, 1, should_skip_update_fn=optax.skip_not_finite))
    w = _weights()
    params = {k: dist.shard_tensor(v, MESH, MEGATRON[k]) for k, v in w.items()}
    rng = np.random.default_rng(1)
    x, y = (rng.normal(size=(8, 16)).astype(np.float32) for _ in range(2))
    dx = dist.shard_tensor(x, MESH, [S(0), R()])
    f = assert_trains_like_one_device(mse_step(apply, tx), params, w, tx.init(w), dx, x, y,
                                      steps=3)
    plan = f.plan(params, tx.init(params), dx, y)
    adam = dist.jit(mse_step(apply, inner)).plan(params, inner.init(params), dx, y)
    assert plan.total_bytes <= adam.total_bytes + 64, (plan.total_bytes, adam.total_bytes)
    assert count_collectives(f.lower(params, tx.init(params), dx, y).compile().as_text()) == \
        Counter(c.kind for c in plan.collectives)


def test_multisteps_accumulator_kept_partial_is_reduced_once_per_call():
    # The accumulated gradients returned Partial over dp (out_placements): each call adds its
    # pending gradients to them as they lie, and reduces the running mean once, for the update
    # optax's MultiSteps computes on every call and keeps every k-th (a select, not a cond).
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3)
    w = _weights()
    step = mse_step(apply, tx)
    partial = {k: [dist.Partial(), *MEGATRON[k][1:]] for k in w}
    state0 = tx.init(w)
    inner = jax.tree.map(lambda _: None, state0.inner_opt_state)
    out = (MEGATRON, state0._replace(mini_step=None, gradient_step=None, inner_opt_state=inner,
                                     acc_grads=partial), None)
    f = dist.jit(step, out_placements=out)
    params = {k: dist.shard_tensor(v, MESH, MEGATRON[k]) for k, v in w.items()}
    state, ref_params, ref_state = state0, w, state0
    rng = np.random.default_rng(1)
    for _ in range(5):  # a first call from the plain zeros, then from the Partial sums
        x, y = (rng.normal(size=(8, 16)).astype(np.float32) for _ in range(2))
        xd, yd = (dist.shard_tensor(a, MESH, [S(0), R()]) for a in (x, y))
        params, state, loss = f(params, state, xd, yd)
        ref_params, ref_state, ref_loss = jax.jit(step)(ref_params, ref_state, x, y)
        np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
        for k in w:
            np.testing.assert_allclose(params[k].numpy(), ref_params[k], rtol=1e-4, atol=1e-6)
            assert state.acc_grads[k].placements[0] == dist.Partial()
            np.testing.assert_allclose(state.acc_grads[k].numpy(), ref_state.acc_grads[k],
                                       rtol=1e-4, atol=1e-6)
    plan = f.plan(params, state, xd, yd)
    gradients = [c for c in plan.collectives if c.axes == ("dp",) and c.bytes_per_device >= 32]
    assert len(gradients) == len(w), plan.collectives  # one sum per weight's running mean
    assert count_collectives(f.lower(params, state, xd, yd).compile().as_text()) == \
        Counter(c.kind for c in plan.collectives)
    every_call = dist.jit(step).plan(params, state, xd, yd)
    assert every_call.total_bytes >= plan.total_bytes  # kept Partial, it costs nothing more
