"""Strategy.amp: levels o1 / o2 in bfloat16 and float16, and float16 dynamic loss scaling, each
against the same low-precision program written by hand on one device."""
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard as dist
from autoshard.hlo import collective_bytes, count_collectives
from autoshard.training.amp import autocast

MESH24 = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
R, S = dist.Replicate, dist.Shard
F32 = jnp.float32
TP = {"w0": [R(), S(1)], "b0": [R(), S(0)], "w1": [R(), S(0)]}


def apply(p, x):
    return jax.nn.relu(x @ p["w0"] + p["b0"]) @ p["w1"]


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    return {"w0": (rng.normal(size=(16, 32)) * 0.2).astype(np.float32),
            "b0": (rng.normal(size=(32,)) * 0.1).astype(np.float32),
            "w1": (rng.normal(size=(32, 8)) * 0.2).astype(np.float32)}


def _batches(n):
    rng = np.random.default_rng(1)
    return [(rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(8, 8)).astype(np.float32))
            for _ in range(n)]


# -- the one-device references, written out by hand ----------------------------------------
def forward_o1(p, x, dtype):
    """Matmuls in low precision, everything else (bias add, relu, loss) in float32."""
    h = (x.astype(dtype) @ p["w0"].astype(dtype)).astype(F32) + p["b0"]
    return (jax.nn.relu(h).astype(dtype) @ p["w1"].astype(dtype)).astype(F32)


def forward_o2(p, x, dtype):
    """The whole forward in low precision; the loss in float32."""
    return apply(jax.tree.map(lambda w: w.astype(dtype), p), x.astype(dtype)).astype(F32)


def reference(batches, tx, forward, scale=None, incr_every=1000, decr_every=2, decr_ratio=0.8):
    """Paddle's GradScaler on one device: scale the loss, unscale the gradients, skip an update
    whose gradients are not finite, grow / shrink the scale."""
    p = jax.tree.map(jnp.asarray, _weights())
    state, good, bad, losses = tx.init(p), 0, 0, []
    for x, y in batches:
        s = 1.0 if scale is None else scale
        loss, g = jax.value_and_grad(lambda p: mse(forward(p, x), y) * F32(s))(p)
        losses.append(float(loss / F32(s)))
        g = jax.tree.map(lambda a: a / F32(s), g)
        finite = all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(g))
        if finite:
            updates, state = tx.update(g, state, p)
            p = optax.apply_updates(p, updates)
        if scale is not None:
            good, bad = (good + 1, 0) if finite else (0, bad + 1)
            if good >= incr_every:
                scale, good = scale * 2.0, 0
            if bad >= decr_every:
                scale, bad = max(scale * decr_ratio, 1.0), 0
    return losses, p, scale


def _dist_model(amp, tx=optax.sgd(0.1)):
    params = {k: dist.shard_tensor(v, MESH24, TP[k]) for k, v in _weights().items()}
    return dist.to_static((apply, params), None, mse, tx,
                          dist.Strategy({"amp": {"enable": True, **amp}}))


def _low_precision_primitives(m, batch):
    """Primitives of the compiled train step with a 16-bit floating result."""
    plan = m.programs()["train"].plan(*m.program_args("train", *batch))
    return {e.name for e in plan.program.eqns
            if any(jnp.issubdtype(v.dtype, jnp.floating) and jnp.finfo(v.dtype).bits == 16
                   for v in e.outputs)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("level", ["o1", "o2"])
def test_amp_level_trains_like_one_device(level, dtype):
    batches = _batches(6)
    amp = {"dtype": dtype, "level": level, "init_loss_scaling": 256.0, "incr_every_n_steps": 2}
    m = _dist_model(amp)
    losses = [float(m(x, y).numpy()) for x, y in batches]
    forward = {"o1": forward_o1, "o2": forward_o2}[level]
    fp16 = dtype == "float16"
    ref_losses, ref_params, ref_scale = reference(
        batches, optax.sgd(0.1), lambda p, x: forward(p, x, jnp.dtype(dtype)),
        scale=256.0 if fp16 else None, incr_every=2)
    tol = 2e-3 if fp16 else 1e-2   # float16 has 3 more mantissa bits than bfloat16
    np.testing.assert_allclose(losses, ref_losses, rtol=tol, atol=tol)
    for name, value in ref_params.items():
        assert m.params[name].dtype == jnp.float32           # float32 master weights
        np.testing.assert_allclose(m.params[name].numpy(), value, rtol=tol, atol=tol)
    # float16 only: the scale grew once per 2 finite steps, 256 -> 2048, as on one device
    assert m.loss_scale == (ref_scale if fp16 else None)
    if fp16:
        assert ref_scale == 2048.0
    # What the levels mean: o1 keeps all but the matmuls in float32; o2 runs the adds and the
    # relu in low precision too.
    low = _low_precision_primitives(m, batches[0])
    assert "dot_general" in low
    if level == "o1":
        assert low <= {"dot_general", "convert_element_type", "transpose"}, low
    else:
        assert {"add", "max"} <= low, low


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_zero1_reduce_scatters_the_gradients_in_low_precision(dtype):
    """With ZeRO-1 the weight gradients are reduce-scattered in the 16-bit dtype their matmul
    made them in — as without ZeRO they are all-reduced in it — not after the cast to float32
    and the unscaling (which commute with the sum): half the bytes. Trains like one device."""
    params = {k: dist.shard_tensor(v, MESH24, TP[k]) for k, v in _weights().items()}
    amp = {"enable": True, "dtype": dtype, "level": "o1", "init_loss_scaling": 256.0,
           "incr_every_n_steps": 2}
    tx = optax.sgd(0.1, momentum=0.9)
    m = dist.to_static((apply, params), None, mse, tx, dist.Strategy(
        {"amp": amp, "sharding": {"enable": True, "stage": 1}}))
    batches = _batches(6)
    losses = [float(m(x, y).numpy()) for x, y in batches]
    fp16 = dtype == "float16"
    ref_losses, ref_params, _ = reference(batches, tx, lambda p, x: forward_o1(p, x, jnp.dtype(dtype)),
                                          scale=256.0 if fp16 else None, incr_every=2)
    tol = 2e-3 if fp16 else 1e-2
    np.testing.assert_allclose(losses, ref_losses, rtol=tol, atol=tol)
    for name, value in ref_params.items():
        np.testing.assert_allclose(m.params[name].numpy(), value, rtol=tol, atol=tol)
    f, args = m.programs()["train"], m.program_args("train", *batches[0])
    plan = f.plan(*args)
    scattered = [c for c in plan.collectives if c.kind == "reduce-scatter"]
    # w0 (16, 32) and w1 (32, 8): split over mp (4), scattered over dp (2), 2 bytes each
    assert sorted(c.bytes_per_device for c in scattered) == sorted([16 * 32 // 8 * 2, 32 * 8 // 8 * 2])
    assert count_collectives(f.lower(*args).compile().as_text()) == \
        Counter(c.kind for c in plan.collectives)


def test_float16_overflow_skips_the_update_and_halves_the_scale():
    batches = _batches(6)
    amp = {"dtype": "float16", "level": "o1", "init_loss_scaling": 2.0 ** 24,
           "decr_every_n_nan_or_inf": 1, "decr_ratio": 0.5}
    tx = optax.sgd(0.1, momentum=0.9)   # a state that a skipped step must leave alone
    m = _dist_model(amp, tx)
    before = {k: v.numpy() for k, v in m.params.items()}
    def opt_leaves():
        return jax.tree.leaves(m.opt_state, is_leaf=lambda t: isinstance(t, dist.DistTensor))

    before_state = [v.numpy() for v in opt_leaves()]
    assert len(before_state) == 3
    for step, expected_scale in [(0, 2.0 ** 23), (1, 2.0 ** 22)]:
        # 2**24 (then 2**23) times the loss overflows float16 in the backward pass
        m(*batches[step])
        for name, value in before.items():
            np.testing.assert_array_equal(m.params[name].numpy(), value)   # update skipped
        assert m.loss_scale == expected_scale
    assert all(np.array_equal(a.numpy(), b) for a, b in zip(opt_leaves(), before_state))
    sd = m.state_dict("opt")
    assert float(sd["amp.scale"].numpy()) == 2.0 ** 22 and int(sd["amp.bad_steps"].numpy()) == 0

    # From a safe scale, training goes on from the untouched params, as on one device.
    m.set_state_dict({"amp.scale": 1024.0})
    assert m.loss_scale == 1024.0
    losses = [float(m(x, y).numpy()) for x, y in batches[2:]]
    ref_losses, ref_params, ref_scale = reference(
        batches[2:], tx, lambda p, x: forward_o1(p, x, jnp.float16), scale=1024.0,
        decr_every=1, decr_ratio=0.5)
    assert m.loss_scale == ref_scale == 1024.0
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-3, atol=2e-3)
    for name, value in ref_params.items():
        assert not np.array_equal(value, before[name])
        np.testing.assert_allclose(m.params[name].numpy(), value, rtol=2e-3, atol=2e-3)

    # The scaler's state round-trips through the state dict.
    fresh = _dist_model(amp, tx)
    fresh.set_state_dict(m.state_dict())
    assert fresh.loss_scale == m.loss_scale


def test_autocast_runs_only_matmuls_in_low_precision_inside_control_flow():
    p = jax.tree.map(jnp.asarray, _weights())
    x = jnp.asarray(_batches(1)[0][0])

    def body(h, _):   # matmuls inside a scan are cast too
        return jnp.tanh(h @ p["w0"][:, :16].T), None

    def f(p, x):
        h, _ = jax.lax.scan(body, x, None, length=2)
        return apply(p, h)

    jaxpr = jax.make_jaxpr(autocast(f, jnp.float16))(p, x)
    dots, others = [], []

    def walk(jx):
        for e in jx.eqns:
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(sub)
            (dots if e.primitive.name == "dot_general" else others).append(e)

    walk(jaxpr.jaxpr)
    assert len(dots) == 3 and all(v.aval.dtype == jnp.float16 for e in dots for v in e.invars)
    assert all(v.aval.dtype != jnp.float16 for e in others if e.primitive.name != "convert_element_type"
               for v in e.outvars)
    np.testing.assert_allclose(autocast(f, jnp.float16)(p, x), f(p, x), rtol=2e-2, atol=2e-2)


def test_amp_settings_are_checked():
    with pytest.raises(dist.StrategyError, match="decr_ratio = 1.5 must lie strictly between"):
        dist.Strategy({"amp": {"decr_ratio": 1.5}})
    with pytest.raises(dist.StrategyError, match="incr_every_n_steps must be a positive int"):
        dist.Strategy({"amp": {"incr_every_n_steps": 0}})
    with pytest.raises(dist.StrategyError, match="level = 'o3' is not one of"):
        dist.Strategy({"amp": {"level": "o3"}})


_EXTREMES = {
    # each fills the blocks a device does not own, or its padding, with the dtype's extreme
    "cummax over a split dim": lambda x: jax.lax.cummax(x, axis=1),
    "max pool over split rows": lambda x: jax.lax.reduce_window(
        x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME"),
    "max pool gradient": jax.grad(lambda x: jnp.sum(jax.lax.reduce_window(
        x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME").astype(F32))),
    "max over a split dim": lambda x: jnp.max(x, axis=(1, 2)),
    "gather filling out of bounds": lambda x: x.at[:, jnp.arange(-2, 14)].get(mode="fill"),
}


@pytest.mark.parametrize("name", list(_EXTREMES))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn],
                         ids=["bfloat16", "float16", "float8_e4m3fn"])
def test_low_precision_extremes_over_split_dims(name, dtype):
    """Max-like ops over split dims in jax's own float types: the identity that fills foreign
    blocks and padding is -inf (or the lowest finite value of a type without infinities) —
    numpy does not count bfloat16 as a float, and asking it for integer limits crashed."""
    fn = _EXTREMES[name]
    x = (np.random.default_rng(0).normal(size=(2, 8, 8, 4)) * 4).astype(dtype)
    dx = dist.shard_tensor(x, MESH24, [S(1), S(2)])
    got = dist.jit(fn)(dx).numpy()
    want = jax.jit(fn)(x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("to", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_a_pending_sum_is_reduced_before_a_cast_that_rounds(to):
    """A matmul contracting a split dim leaves partial sums; cast to a narrower float they
    would each be rounded and then added, where one device rounds the whole sum once. So the
    sum is reduced in float32 first (a float32 all-reduce), and the result is one device's
    bit for bit; a widening cast still carries the pending sum (reduced after it)."""
    rng = np.random.default_rng(5)
    a, b = rng.normal(size=(8, 64)).astype(np.float32), rng.normal(size=(64, 16)).astype(np.float32)
    da = dist.shard_tensor(a, MESH24, [R(), S(1)])
    db = dist.shard_tensor(b, MESH24, [R(), S(0)])
    narrow = dist.jit(lambda a, b: jnp.tanh((a @ b).astype(to)))
    got = narrow(da, db)
    np.testing.assert_array_equal(np.asarray(got.numpy(), np.float32),
                                  np.asarray(jax.jit(lambda a, b: jnp.tanh((a @ b).astype(to)))(a, b),
                                             np.float32))
    assert [c.kind for c in narrow.plan(da, db).collectives] == ["all-reduce"]
    hlo = narrow.lower(da, db).compile().as_text()
    assert collective_bytes(hlo) == {"all-reduce": 8 * 16 * 4}  # of float32
    widen = lambda a, b: (a.astype(to) @ b.astype(to)).astype(F32)  # noqa: E731
    wide = dist.jit(widen, out_placements="keep")
    if to == jnp.bfloat16:  # float32's range: still pending after the widening cast
        assert wide(da, db).placements[1].is_partial()
    else:  # float16's parts added in float32 would not overflow where one device's sum does
        assert not wide(da, db).placements[1].is_partial()
        hlo = wide.lower(da, db).compile().as_text()
        assert collective_bytes(hlo) == {"all-reduce": 8 * 16 * 2}  # of float16


@pytest.mark.parametrize("k_steps", [1, 2])
def test_a_float16_sum_that_overflows_on_one_device_overflows_split(k_steps):
    """The parts of a float16 matmul over a split dim fit float16 where their sum does not:
    one device's result is inf (its loss scaling skips the step), so the sum is reduced in
    float16, before the cast to float32 that would let it through finite — also when a
    gradient merge accumulates the cast gradients over micro-steps."""
    a = np.full((8, 4), 100.0, np.float32)
    b = np.full((8, 4), 100.0, np.float32)  # a.T @ b: 8 * 1e4 = 80000 > float16's 65504
    step = lambda a, b: (a.astype(jnp.float16).T @ b.astype(jnp.float16)).astype(F32)  # noqa: E731
    da = dist.shard_tensor(a, MESH24, [S(0), R()])
    db = dist.shard_tensor(b, MESH24, [S(0), R()])
    acc = lambda a, b: sum(step(a[k::k_steps], b[k::k_steps]) for k in range(k_steps))  # noqa: E731
    want = np.asarray(jax.jit(acc)(a, b))
    got = dist.jit(acc)(da, db).numpy()
    assert np.isinf(want).all() == (k_steps == 1)
    np.testing.assert_array_equal(got, want)
