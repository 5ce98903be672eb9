"""Shape primitives over split dims: a reversed dim stays split (mirror blocks swapped) instead
of being gathered — values and gradients equal one device, the planned collectives are the
compiled ones, and a flip moves the bytes jax.jit moves with the same input shardings."""
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import autoshard as dist
from autoshard.hlo import collective_bytes, count_collectives

R, S = dist.Replicate(), dist.Shard
MESH24 = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
MESH3 = dist.ProcessMesh([0, 1, 2], ["x"])


def _spec(mesh, placements, ndim):
    spec = [None] * ndim
    for axis, p in zip(mesh.dim_names, placements):
        if isinstance(p, dist.Shard):
            spec[p.dim] = axis if spec[p.dim] is None else (spec[p.dim], axis)
    return P(*spec)


@pytest.mark.parametrize("mesh,placements,flip", [
    (MESH24, [S(0), S(1)], (0,)),
    (MESH24, [S(0), S(1)], (0, 1)),
    (MESH24, [S(1), S(0)], (0, 1)),    # the dims' axes against the mesh's order
    (MESH24, [S(1), S(1)], (1,)),      # one dim over both axes: 8 blocks mirrored
    (MESH3, [S(0)], (0,)),             # an odd count: the middle device keeps its block
], ids=["rows", "both dims", "both dims transposed", "dim over dp,mp", "three devices"])
def test_a_reversed_split_dim_stays_split(mesh, placements, flip):
    x = np.random.default_rng(0).normal(size=(24, 16)).astype(np.float32)

    dx = dist.shard_tensor(x, mesh, placements)
    ramp = jnp.arange(24 * 16, dtype=jnp.float32).reshape(24, 16) / 100
    for fn in (lambda x: jnp.flip(x, flip) * 2.0,
               jax.grad(lambda x: jnp.sum(jnp.tanh(jnp.flip(x, flip)) * ramp))):
        g = dist.jit(fn)
        out = g(dx)
        np.testing.assert_allclose(out.numpy(), jax.jit(fn)(x), rtol=1e-5, atol=1e-6)
        assert out.placements == placements  # kept where it was
        plan = g.plan(dx)
        hlo = g.lower(dx).compile().as_text()
        assert not [c for c in plan.collectives if c.kind == "all-gather"]
        assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)
        assert collective_bytes(hlo)["collective-permute"] == sum(
            c.bytes_per_device for c in plan.collectives if c.kind == "collective-permute")
    # the flip alone moves what XLA moves (one block per device); in the gradient XLA's
    # simplifier sinks the reverses through the elementwise ops and cancels a pair, which
    # explicit ppermutes do not allow
    xla = jax.jit(lambda x: jnp.flip(x, flip) * 2.0,
                  in_shardings=NamedSharding(mesh.to_jax(), _spec(mesh, placements, 2)))
    forward = dist.jit(lambda x: jnp.flip(x, flip) * 2.0).lower(dx).compile().as_text()
    assert sum(collective_bytes(forward).values()) == sum(
        collective_bytes(xla.lower(x).compile().as_text()).values())


def test_empty_arrays_reshape_without_falling_back():
    """jnp.pad's edge mode reshapes empty arrays (0 rows): they have a rule like any other —
    no fallback warning — and the result equals one device."""
    x = np.random.default_rng(1).normal(size=(16, 32)).astype(np.float32)
    dx = dist.shard_tensor(x, MESH24, [S(0), S(1)])
    f = dist.jit(lambda x: jnp.pad(x, ((0, 0), (2, 2)), mode="edge"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        np.testing.assert_array_equal(f(dx).numpy(), np.pad(x, ((0, 0), (2, 2)), mode="edge"))
    assert not f.plan(dx).fallbacks
