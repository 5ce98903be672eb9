"""A user's own jax.shard_map (psum, all_gather, ppermute) inside dist.jit passes through.

The planner reshards the operands to the layouts `in_specs` name, takes `out_specs` as the
results' layouts, runs the body as written, and lists the body's collectives in the plan — so
the compiled HLO has exactly the planned collectives, and the values equal one device.
"""
from __future__ import annotations

import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import autoshard as dist
from autoshard.errors import MeshMismatchError
from autoshard.hlo import count_collectives

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
JMESH = MESH.to_jax()


def row_parallel(x, w):
    """Megatron's row-parallel matmul written by hand: local matmul, then psum over mp."""
    def body(xb, wb):
        return lax.psum(xb @ wb, "mp")
    y = jax.shard_map(body, mesh=JMESH, in_specs=(P("dp", "mp"), P("mp", None)),
                      out_specs=P("dp", None))(x, w)
    return jnp.sum(jnp.tanh(y) ** 2)


def normalize_rows(x, w):
    """A row softmax-like normalisation over an mp-split hidden dim, with the user's psum."""
    h = jnp.sin(x @ w)

    def body(hb):
        return hb / lax.psum(jnp.sum(hb * hb, axis=1, keepdims=True), "mp")
    y = jax.shard_map(body, mesh=JMESH, in_specs=P("dp", "mp"), out_specs=P("dp", "mp"))(h)
    return jnp.sum(y * jnp.cos(h))


def gathered_then_ring(x, w):
    """all_gather and a ring shift (ppermute) over mp, then a mean over dp."""
    h = x @ w
    n = MESH.get_dim_size("mp")

    def body(hb):
        full = lax.all_gather(hb, "mp", axis=1, tiled=True)
        shifted = lax.ppermute(hb, "mp", [(i, (i + 1) % n) for i in range(n)])
        return full[:, : hb.shape[1]] * shifted
    y = jax.shard_map(body, mesh=JMESH, in_specs=P("dp", "mp"), out_specs=P("dp", "mp"))(h)
    return jnp.mean(y ** 2)


def weighted_by_shard(x, w):
    """Each mp block scaled by its shard index, then summed over mp. The loss is a plain sum,
    so the backward shard_map receives a constant cotangent, replicated in our program: it
    must be cast to vary over the in_specs axes before the body runs (jax's check_vma)."""
    h = x @ w

    def body(hb):
        return lax.psum(hb * (1.0 + lax.axis_index("mp")), "mp")
    y = jax.shard_map(body, mesh=JMESH, in_specs=P("dp", "mp"), out_specs=P("dp", None))(h)
    return jnp.sum(y)


FUNCTIONS = [row_parallel, normalize_rows, gathered_then_ring, weighted_by_shard]
PLACEMENTS = {
    "x dp, w mp": ([dist.Shard(0), dist.Replicate()], [dist.Replicate(), dist.Shard(1)]),
    "replicated": ([dist.Replicate(), dist.Replicate()], [dist.Replicate(), dist.Replicate()]),
    "x mp-split": ([dist.Replicate(), dist.Shard(1)], [dist.Shard(0), dist.Replicate()]),
}


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(8, 16)).astype(np.float32),
            (rng.normal(size=(16, 16)) * 0.3).astype(np.float32))


def _placed(case, x, w):
    xp, wp = PLACEMENTS[case]
    return dist.shard_tensor(x, MESH, xp), dist.shard_tensor(w, MESH, wp)


def _hlo(f, *args) -> Counter:
    return count_collectives(f.lower(*args).compile().as_text())


@pytest.mark.parametrize("case", sorted(PLACEMENTS))
@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_user_shard_map_forward_and_grad_equal_one_device(fn, case):
    x, w = _data()
    xd, wd = _placed(case, x, w)
    f = dist.jit(jax.value_and_grad(fn, argnums=(0, 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: the shard_map is understood, not replicated
        value, (gx, gw) = f(xd, wd)
    rv, (rgx, rgw) = jax.value_and_grad(fn, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(value.numpy(), rv, rtol=1e-5)
    np.testing.assert_allclose(gx.numpy(), rgx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gw.numpy(), rgw, rtol=1e-4, atol=1e-5)
    plan = f.plan(xd, wd)
    assert Counter(c.kind for c in plan.collectives) == _hlo(f, xd, wd)
    mine = [c for c in plan.collectives if c.reason == "written by the user in a shard_map"]
    assert mine and all(c.bytes_per_device > 0 and "test_user_collectives.py" in c.source
                        for c in mine)


def test_operands_arrive_in_the_in_specs_layout():
    x, w = _data(1)
    xd, wd = _placed("replicated", x, w)
    f = dist.jit(row_parallel)
    plan = f.plan(xd, wd)
    (sm,) = [ep for ep in plan.eqns if ep.primitive == "shard_map"]
    assert [repr(L.placements(MESH)) for L in sm.required] == ["[S(0), S(1)]", "[R, S(0)]"]
    assert [repr(L.placements(MESH)) for L in sm.results] == ["[S(0), R]"]
    # replicated operands are sliced locally: the user's psum over mp, then the loss's sum over
    # the dp-split rows — nothing gathered
    user, ours = plan.collectives
    assert user.kind == "all-reduce" and user.axes == ("mp",) and "shard_map" in user.reason
    assert ours.kind == "all-reduce" and ours.axes == ("dp",) and ours.bytes_per_device <= 8
    assert _hlo(f, xd, wd) == Counter({"all-reduce": 2})
    np.testing.assert_allclose(f(xd, wd).numpy(), row_parallel(x, w), rtol=1e-5)


def test_grad_from_outside_through_a_user_shard_map():
    x, w = _data(2)
    xd, wd = _placed("x dp, w mp", x, w)
    f = dist.jit(normalize_rows)
    g = jax.grad(lambda a: f(xd, a))(wd)
    np.testing.assert_allclose(np.asarray(g), jax.grad(normalize_rows, argnums=1)(x, w),
                               rtol=1e-4, atol=1e-5)


def test_shard_map_on_another_mesh_is_a_clear_error():
    other = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

    def fn(x):
        return jax.shard_map(lambda b: lax.psum(b, "x"), mesh=other, in_specs=P("x"),
                             out_specs=P())(x)
    x, _ = _data(3)
    xd = dist.shard_tensor(x, MESH, [dist.Shard(0), dist.Replicate()])
    with pytest.raises(MeshMismatchError, match="mesh.to_jax"):
        dist.jit(fn)(xd)


def test_a_shard_map_over_some_axes_is_named_and_over_all_axes_runs():
    x = np.arange(128, dtype=np.float32).reshape(8, 16)
    dx = dist.shard_tensor(x, MESH, [dist.Shard(0), dist.Replicate()])

    def partly(a):
        return jax.shard_map(lambda b: lax.psum(b, "mp"), mesh=MESH.to_jax(),
                             in_specs=P(None, "mp"), out_specs=P(), axis_names={"mp"})(a)

    def wholly(a):  # the fix the message gives: the same values
        return jax.shard_map(lambda b: lax.psum(b, "mp"), mesh=MESH.to_jax(),
                             in_specs=P(None, "mp"), out_specs=P())(a)

    with pytest.raises(dist.PlacementError, match=r"takes mesh axes \['mp'\] by hand "
                                                  r"\(axis_names=\) and leaves \['dp'\] automatic"):
        dist.jit(partly)(dx)
    np.testing.assert_array_equal(dist.jit(wholly)(dx).numpy(), np.asarray(jax.jit(partly)(x)))
