"""Up- and downsampling along a split dim: nearest-neighbour resizes, repeats and every-k-th-row
picks — by a constant index or a strided slice — keep the dim split with no communication,
forward and backward, and equal one device.

A gather by a computed index would gather the dim whole (or look it up masked and all-reduce
the result); `compiler/constant_gathers.py` recognises the index, `rules/shape.py` lets a
strided slice keep its blocks.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard as dist
from autoshard.hlo import collective_bytes, count_collectives

S, R = dist.Shard, dist.Replicate
MESHES = {
    "8": dist.ProcessMesh(list(range(8)), dim_names=["x"]),
    "2x4": dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"]),
    "2x2x2": dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["a", "b", "c"]),
}
# NHWC images; the rows (and on 3-d meshes the columns) split
PLACEMENTS = {
    "8": [S(1)],
    "2x4": [S(0), S(1)],
    "2x2x2": [S(0), S(1), S(2)],
}
IMAGE = np.random.default_rng(0).normal(size=(4, 32, 32, 8)).astype(np.float32)

FUNCTIONS = {
    "nearest resize 2x": lambda x: jax.image.resize(x, (4, 64, 64, 8), "nearest"),
    "rows i // 2, columns i // 2": lambda x: x[:, jnp.arange(64) // 2][:, :, jnp.arange(64) // 2],
    "columns i // 4": lambda x: x[:, :, jnp.arange(128) // 4],
    "take even rows by index": lambda x: x[:, jnp.arange(0, 32, 2)],
    "take odd rows and columns by index": lambda x: jnp.take(
        jnp.take(x, jnp.arange(1, 32, 2), axis=1), jnp.arange(1, 32, 2), axis=2),
    "strided slice ::2, ::2": lambda x: x[:, ::2, ::2],
    "strided slice 1::4": lambda x: x[:, 1::4],
    "repeat": lambda x: jnp.repeat(x, 2, axis=1),
    # its index built with a scatter, a roll, a scatter-add and a cumsum
    "repeat to a total length": lambda x: jnp.repeat(x, 2, axis=1, total_repeat_length=64),
}


def _placed(mesh_name):
    mesh = MESHES[mesh_name]
    return mesh, PLACEMENTS[mesh_name], dist.shard_tensor(IMAGE, mesh, PLACEMENTS[mesh_name])


def _compiled_collectives(f, *args):
    hlo = f.lower(*args).compile().as_text()
    return count_collectives(hlo), collective_bytes(hlo)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_resampling_keeps_the_split_dims_and_moves_nothing(name, mesh_name):
    fn = FUNCTIONS[name]
    mesh, placements, x = _placed(mesh_name)
    f = dist.jit(fn, out_placements=placements)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        got = f(x)
        plan = f.plan(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(fn)(IMAGE)))
    assert got.placements == placements
    assert plan.collectives == [], plan
    kinds, _ = _compiled_collectives(f, x)
    assert not kinds, kinds


def _assert_step_moves_only_scalars(fn, mesh_name: str, scalars: int = 1, weights=1.0,
                                    grad_tol: float = 1e-5) -> None:
    """value_and_grad of sum(fn(x)² · weights) equals one device with the gradient split like
    x, and all that moves is `scalars` all-reduced scalars (the loss, a cond's predicate)."""
    mesh, placements, x = _placed(mesh_name)

    def loss(x):
        return jnp.sum(fn(x) ** 2 * weights)

    step = jax.value_and_grad(loss)
    f = dist.jit(step, out_placements=([R()] * len(placements), placements))
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        value, grad = f(x)
    want_value, want_grad = jax.jit(step)(IMAGE)
    # the loss sums thousands of squares in another order on each device (1.4e-5 apart)
    np.testing.assert_allclose(np.asarray(value), want_value, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=grad_tol, atol=grad_tol)
    assert grad.placements == placements
    # the scatter-adds of the gradient are local sums or pads: only the scalars move
    kinds, nbytes = _compiled_collectives(f, x)
    assert set(kinds) == {"all-reduce"}, kinds
    assert sum(nbytes.values()) <= 4 * len(placements) * scalars, nbytes
    assert [c.kind for c in f.plan(x).collectives] == ["all-reduce"] * scalars


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_resampling_gradient_stays_split_and_only_the_loss_is_reduced(name, mesh_name):
    fn = FUNCTIONS[name]
    weights = np.random.default_rng(1).normal(size=jax.eval_shape(fn, IMAGE).shape)
    _assert_step_moves_only_scalars(fn, mesh_name, weights=weights.astype(np.float32))


def _up_down(h):
    return jax.image.resize(h, (4, 64, 32, 8), "nearest")[:, ::2] * 0.9 + jnp.tanh(h)


def _nested_scan(x):
    def outer(c, _):
        return jax.lax.scan(lambda c, _: (_up_down(c), None), c, None, length=2)[0], None
    return jax.lax.scan(outer, x, None, length=2)[0]


# jax computes a loop's gather index once, outside the loop, and hands it to the forward and
# the backward loop as an operand; a cond's forward branch hands it to the backward branch as
# a residual: each body sees an input, not a constant, unless it is made one.
# (function, the scalars it all-reduces: the loss, and the cond's predicate)
LOOPS = {
    "scan": (lambda x: jax.lax.scan(lambda c, _: (_up_down(c), c.sum()), x, None, length=3)[0], 1),
    "fori_loop": (lambda x: jax.lax.fori_loop(0, 2, lambda i, h: _up_down(h), x), 1),
    "scan inside a scan": (_nested_scan, 1),
    "cond": (lambda x: jax.lax.cond(x.sum() > 0, _up_down, lambda h: jnp.tanh(h) * 2, x), 2),
}


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("loop", list(LOOPS))
def test_resampling_inside_a_differentiated_loop_stays_split(loop, mesh_name):
    # the index reached the bodies: their gathers are slices, their scatter-adds pads
    fn, scalars = LOOPS[loop]
    _assert_step_moves_only_scalars(fn, mesh_name, scalars, grad_tol=1e-4)


@pytest.mark.parametrize("key", [jax.random.key(3), np.asarray(jax.random.PRNGKey(3))],
                         ids=["typed key", "uint32 key constant"])
def test_a_loop_handed_a_key_and_a_constant_index_equals_one_device(key):
    # integer operands that are no index: a typed key (no numpy dtype) stays an operand; a
    # raw uint32 key known at trace time becomes a constant of the body like an index
    mesh, placements, x = _placed("2x4")

    def fn(x):
        def body(i, h):
            keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.8, h.shape)
            return jnp.where(keep, _up_down(h), 0.0)
        return jax.lax.fori_loop(0, 2, body, x)

    f = dist.jit(fn, out_placements=placements)
    np.testing.assert_allclose(np.asarray(f(x)), np.asarray(jax.jit(fn)(IMAGE)), rtol=1e-6)


def test_an_index_that_is_no_repeat_or_stride_is_still_a_gather():
    # rows [0, 3, 1, 2, ...]: no slice or repeat says it; the gather rule decides as before
    mesh, placements, x = _placed("2x4")
    index = np.argsort(np.random.default_rng(2).random(32)).astype(np.int32)
    fn = lambda x: x[:, jnp.asarray(index)]  # noqa: E731
    f = dist.jit(fn, out_placements=placements)
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(jax.jit(fn)(IMAGE)))
    assert any(e.primitive == "gather" for e in f.plan(x).eqns)


def test_nearest_upsampling_before_a_convolution_trains_with_halos_only():
    """A U-Net decoder's upsample then 3x3 convolution, rows split: the convolutions exchange
    edge rows (collective-permute); nothing is gathered."""
    mesh, placements, x = _placed("2x4")
    kernel = (np.random.default_rng(3).normal(size=(3, 3, 8, 8)) * 0.1).astype(np.float32)

    def loss(x, k):
        y = jax.image.resize(x, (4, 64, 64, 8), "nearest")
        y = jax.lax.conv_general_dilated(y, k, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.mean(jax.nn.relu(y) ** 2)

    step = jax.value_and_grad(loss, argnums=(0, 1))
    f = dist.jit(step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        value, (gx, gk) = f(x, kernel)
        plan = f.plan(x, kernel)
    want_value, (want_gx, want_gk) = jax.jit(step)(IMAGE, kernel)
    np.testing.assert_allclose(np.asarray(value), want_value, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), want_gx, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(gk), want_gk, rtol=1e-4, atol=1e-7)
    kinds, _ = _compiled_collectives(f, x, kernel)
    assert set(kinds) <= {"collective-permute", "all-reduce"}, kinds
    assert kinds == count_collectives_of(plan), (kinds, plan.collectives)


def count_collectives_of(plan):
    from collections import Counter
    return Counter(c.kind for c in plan.collectives)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("rows", [8, 16, 32])
def test_jax_associative_scan_of_strided_slices_and_interleaves_equals_one_device(rows, mesh_name):
    """lax.associative_scan is made of x[0:-1:2], x[1::2] and interleaving pads, down to slices
    of one row of two (which cannot stay split); its JVP is how jax differentiates cummax."""
    mesh, placements, _ = _placed(mesh_name)
    x = np.random.default_rng(4).normal(size=(4, rows, 8)).astype(np.float32)
    xd = dist.shard_tensor(x, mesh, placements)

    def fn(x):
        h = jax.lax.associative_scan(jnp.add, x, axis=1)
        return jnp.sum(jnp.tanh(h) * jax.lax.cummax(x, axis=1)), h

    step = jax.value_and_grad(fn, has_aux=True)
    f = dist.jit(step)
    (value, h), grad = f(xd)
    (want_value, want_h), want_grad = jax.jit(step)(x)
    np.testing.assert_allclose(np.asarray(h), want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(value), want_value, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-5)
    kinds, _ = _compiled_collectives(f, xd)
    assert kinds == count_collectives_of(f.plan(xd)), f.plan(xd).collectives


INDEX_EXPRESSIONS = {
    "floor divide": lambda: jnp.arange(64) // 2,
    "floor divide of negatives": lambda: (jnp.arange(16) - 8) // 3,
    "remainder of negatives": lambda: (jnp.arange(16) - 8) % 3,
    "lax.rem and lax.div": lambda: jax.lax.rem(jnp.arange(16) - 8, 3) + jax.lax.div(
        jnp.arange(16) - 8, 3),
    "nearest resize index": lambda: jnp.floor((jnp.arange(48, dtype=jnp.float32) + 0.5)
                                              * 32.0 / 48.0).astype(jnp.int32),
    "wrapped negative index": lambda: jnp.where(jnp.arange(8) - 4 < 0, jnp.arange(8) + 4,
                                                jnp.arange(8) - 4),
    "clamp and select": lambda: jnp.clip(jnp.arange(12) * 3 - 5, 0, 20),
    "jnp.repeat's index": lambda: jnp.repeat(jnp.arange(16), 3, total_repeat_length=48),
    "cumsum and reverse cumsum": lambda: jnp.cumsum(jnp.arange(10)) + jax.lax.cumsum(
        jnp.arange(10), reverse=True),
    "roll, slice and concatenate": lambda: jnp.concatenate(
        [jnp.roll(jnp.arange(10), 3), jnp.arange(10)[2:8:3]]),
    "scatter-add with duplicates": lambda: jnp.zeros(8, jnp.int32).at[
        jnp.array([1, 1, 3, 9])].add(1, mode="drop"),
    "scatter": lambda: jnp.zeros(8, jnp.int32).at[jnp.array([2, 5])].set(7),
}


@pytest.mark.parametrize("name", list(INDEX_EXPRESSIONS))
def test_index_computations_evaluated_at_trace_time_equal_jax(name):
    from autoshard.compiler.constant_gathers import _Constants
    from autoshard.compiler.trace import build_program

    fn = INDEX_EXPRESSIONS[name]
    program = build_program(jax.make_jaxpr(fn)())
    known = _Constants({v: e for e in program.eqns for v in e.outputs})
    value = known(program.outputs[0])
    assert value is not None
    np.testing.assert_array_equal(value, np.asarray(jax.jit(fn)()))


@pytest.mark.parametrize("fn", [
    lambda: jnp.zeros(8, jnp.int32).at[jnp.array([2, 2])].set(jnp.array([5, 7])),
    lambda: jnp.cumsum(jnp.arange(10, dtype=jnp.float32) / 3),
], ids=["which duplicate scatter wins", "a float cumsum's rounding"])
def test_what_xla_decides_its_own_way_is_left_unknown(fn):
    from autoshard.compiler.constant_gathers import _Constants
    from autoshard.compiler.trace import build_program

    program = build_program(jax.make_jaxpr(fn)())
    known = _Constants({v: e for e in program.eqns for v in e.outputs})
    assert known(program.outputs[0]) is None


def test_an_index_divided_by_zero_is_left_unknown():
    # XLA's integer division by zero has its own answer; numpy's would be a guess
    from autoshard.compiler.constant_gathers import _Constants
    from autoshard.compiler.trace import build_program

    program = build_program(jax.make_jaxpr(
        lambda: jax.lax.div(jnp.arange(8), jnp.arange(8) % 1))())
    known = _Constants({v: e for e in program.eqns for v in e.outputs})
    assert known(program.outputs[0]) is None
