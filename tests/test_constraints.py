"""jax's with_sharding_constraint inside dist.jit fixes a layout, as dist.shard_tensor does:
code written for jax.jit keeps its annotations. Results equal one device; the plan lays the
constrained values out as asked; the compiled HLO has exactly the planned collectives."""
from __future__ import annotations

import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import autoshard as dist
from autoshard.hlo import collective_bytes, count_collectives

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 32)).astype(np.float32)
W1 = (0.1 * RNG.normal(size=(32, 64))).astype(np.float32)
W2 = (0.1 * RNG.normal(size=(64, 32))).astype(np.float32)


def _constrained_mlp(shard):
    """A Megatron MLP step as one writes it for jax.jit: `shard(x, spec)` pins a layout."""
    def step(w1, w2, x):
        def loss(w1, w2):
            h = shard(jax.nn.gelu(shard(x, P("dp", None)) @ w1), P("dp", "mp"))
            return jnp.mean((h @ w2) ** 2)
        g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
        return shard(w1 - 0.1 * g1, P(None, "mp")), shard(w2 - 0.1 * g2, P("mp", None))
    return step


def _check(f, args, reference):
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.IgnoredConstraintWarning)
        out = f(*args)
    for got, want in zip(out, reference):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    plan = f.plan(*args)
    hlo = f.lower(*args).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)
    return out, plan, hlo


def _hinted(plan):
    return [plan.layouts[e.outputs[0]].describe(MESH) for e in plan.program.eqns
            if e.name == "autoshard_hint"]


def test_named_sharding_constraints_place_a_program_whose_inputs_are_unplaced():
    jm = MESH.to_jax()
    step = _constrained_mlp(lambda v, spec: jax.lax.with_sharding_constraint(
        v, NamedSharding(jm, spec)))
    f = dist.jit(step)
    # numpy inputs: the constraints name the mesh and place everything (as jax.jit would)
    out, plan, hlo = _check(f, (W1, W2, X), jax.jit(step)(W1, W2, X))
    assert plan.mesh == MESH
    assert [o.placements for o in out] == [[dist.Replicate(), dist.Shard(1)],
                                           [dist.Replicate(), dist.Shard(0)]]
    assert "[S(0), S(1)]" in _hinted(plan) and "[S(0), R]" in _hinted(plan)
    # Megatron: the weights never move; the hidden activations stay split over mp
    assert not [c for c in plan.collectives if c.kind == "all-gather"]
    base = jax.jit(step).lower(W1, W2, X).compile().as_text()
    assert sum(collective_bytes(hlo).values()) <= sum(collective_bytes(base).values())


def test_bare_partition_specs_under_set_mesh_are_read_on_the_program_mesh():
    jm = MESH.to_jax()
    step = _constrained_mlp(jax.lax.with_sharding_constraint)
    w1 = dist.shard_tensor(W1, MESH, [dist.Replicate(), dist.Shard(1)])
    w2 = dist.shard_tensor(W2, MESH, [dist.Replicate(), dist.Shard(0)])
    with jax.sharding.set_mesh(jm):
        reference = jax.jit(step)(W1, W2, X)
        f = dist.jit(step)
        _, plan, _ = _check(f, (w1, w2, X), reference)
    assert "[S(0), S(1)]" in _hinted(plan)


def test_a_constraint_on_another_mesh_is_an_error_naming_its_line():
    other = dist.ProcessMesh([[4, 5, 6, 7], [0, 1, 2, 3]], dim_names=["dp", "mp"]).to_jax()

    def f(x):
        return jax.lax.with_sharding_constraint(x * 2, NamedSharding(other, P("dp")))

    x = dist.shard_tensor(X, MESH, [dist.Shard(0), dist.Replicate()])
    with pytest.raises(dist.MeshMismatchError, match="with_sharding_constraint at") as info:
        dist.jit(f)(x)
    assert "test_constraints.py" in str(info.value)


def test_a_constraint_over_an_axis_the_mesh_lacks_is_an_error():
    from jax.sharding import AbstractMesh, AxisType

    abstract = AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def f(x):
        return jax.lax.with_sharding_constraint(x * 2, NamedSharding(abstract, P("data")))

    x = dist.shard_tensor(X, MESH, [dist.Shard(0), dist.Replicate()])
    with pytest.raises(dist.PlacementError, match=r"'data'.*\['dp', 'mp'\]"):
        dist.jit(f)(x)


def test_an_unconstrained_dim_leaves_the_value_to_the_plan_with_a_warning():
    jm = MESH.to_jax()

    def f(x):
        y = jax.lax.with_sharding_constraint(jnp.sin(x), NamedSharding(jm, P(P.UNCONSTRAINED, "mp")))
        return y * 2

    x = dist.shard_tensor(X, MESH, [dist.Shard(0), dist.Replicate()])
    g = dist.jit(f)
    with pytest.warns(dist.IgnoredConstraintWarning, match="UNCONSTRAINED"):
        out = g(x)
    np.testing.assert_allclose(out.numpy(), np.sin(X) * 2, rtol=1e-6)
    assert not g.plan(x).collectives  # left to the plan: x stays as it came


def test_sequence_parallel_gpt_written_for_jax_plans_as_written_with_dist_annotations():
    # the benchmark's sequence-parallel GPT: the residual stream constrained to P(dp, mp) with
    # with_sharding_constraint (what jax.jit is given) plans the same collectives as with
    # dist.shard_tensor, and equals one device
    from autoshard.bench.gpt_workloads import gpt_sequence_parallel

    w = gpt_sequence_parallel(1)
    ours = dist.jit(w.step, out_placements=w.out_placements)
    theirs = dist.jit(w.baseline_step, out_placements=w.out_placements)
    (new, loss), plan = ours(*w.args), ours.plan(*w.args)
    (new2, loss2), plan2 = theirs(*w.args), theirs.plan(*w.args)
    assert [(c.kind, c.bytes_per_device) for c in plan2.collectives] == \
        [(c.kind, c.bytes_per_device) for c in plan.collectives]
    np.testing.assert_allclose(loss2.numpy(), loss.numpy(), rtol=1e-6)
    physical = jax.tree.map(lambda t: t.physical if isinstance(t, dist.DistTensor) else t,
                            w.args, is_leaf=lambda t: isinstance(t, dist.DistTensor))
    _, want = jax.jit(w.baseline_step)(*physical)
    np.testing.assert_allclose(loss2.numpy(), want, rtol=1e-5)


def test_device_put_inside_the_function_places_like_a_constraint():
    # jax.device_put(x, NamedSharding) inside a traced function asks for that layout; without
    # a sharding (or of a pytree) it lays each value out on its own — no rule is missing
    jm = MESH.to_jax()

    def f(x):
        y = jax.device_put(x * 2, NamedSharding(jm, P(None, "mp")))
        a, b = jax.device_put((x, x + 1))  # no target: each value stays where it is
        c, d = jax.device_put((x, jnp.cos(x)), (NamedSharding(jm, P("dp", "mp")),
                                                NamedSharding(jm, P())))
        return (jnp.sin(y) + a * b + c * d,)

    x = dist.shard_tensor(X, MESH, [dist.Shard(0), dist.Replicate()])
    g = dist.jit(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        _, plan, _ = _check(g, (x,), jax.jit(f)(X))
    assert sorted(_hinted(plan)) == ["[R, R]", "[R, S(1)]", "[S(0), S(1)]"]
    # the hints move x twice (gathered over dp for y and for d); a and b move nothing
    assert [c.kind for c in plan.collectives] == ["all-gather", "all-gather"]
