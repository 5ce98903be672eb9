"""dist.associative_scan: a linear recurrence (h_t = a_t h_{t-1} + b_t, as Mamba / S5 scan it)
over a sequence split across devices equals jax.lax.associative_scan on one device, forward
and gradients, both directions, on 1-d, 2-d and 3-d meshes — moving only the block totals,
a small fraction of what the plan of jax's whole-axis scan moves."""
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard as dist
from autoshard.hlo import count_collectives

S, R = dist.Shard, dist.Replicate()
MESHES = {
    "sep": (dist.ProcessMesh(list(range(8)), ["sep"]), [S(1)]),
    "dp×sep": (dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "sep"]), [S(0), S(1)]),
    "dp×sep×mp": (dist.ProcessMesh(np.arange(8).reshape(2, 2, 2), ["dp", "sep", "mp"]),
                  [S(0), S(1), S(2)]),
}


def linear_recurrence(x, y):
    """(a, b) pairs compose as h -> a h + b maps: associative, not commutative."""
    return x[0] * y[0], y[0] * x[1] + y[1]


def _ab(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.uniform(0.5, 1.0, (4, 64, 8)).astype(np.float32),
            rng.normal(size=(4, 64, 8)).astype(np.float32))


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("name", list(MESHES))
def test_blocked_scan_equals_one_device(name, reverse):
    mesh, placements = MESHES[name]
    a, b = _ab()
    da, db = (dist.shard_tensor(x, mesh, placements) for x in (a, b))
    want = jax.lax.associative_scan(linear_recurrence, (a, b), axis=1, reverse=reverse)

    got = dist.associative_scan(linear_recurrence, (da, db), axis=1, reverse=reverse)  # eagerly
    for g, w in zip(got, want):
        assert g.placements == placements
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-5)

    def loss(scan):
        return lambda a, b: jnp.sum(jnp.sin(scan((a, b))[1]))

    ours = loss(lambda e: dist.associative_scan(linear_recurrence, e, axis=1, mesh=mesh,
                                                placements=placements, reverse=reverse))
    plain = loss(lambda e: jax.lax.associative_scan(linear_recurrence, e, axis=1,
                                                    reverse=reverse))
    grad = dist.jit(jax.grad(ours, argnums=(0, 1)), out_placements=[placements] * 2)
    for g, w in zip(grad(da, db), jax.grad(plain, argnums=(0, 1))(a, b)):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-4, atol=1e-4)
    plan = grad.plan(da, db)
    assert not plan.fallbacks
    assert {c.axes for c in plan.collectives} <= {("sep",)}
    # each move is named by a line of this test or of the feature, never the compiler's
    assert all(c.source.startswith(("test_associative_scan.py", "associative_scan.py"))
               for c in plan.collectives), [c.source for c in plan.collectives]
    assert count_collectives(grad.lower(da, db).compile().as_text()) == Counter(
        c.kind for c in plan.collectives)
    # jax's tree of strided slices over the split axis gathers the sequence
    whole = dist.jit(jax.grad(plain, argnums=(0, 1)), out_placements=[placements] * 2)
    assert plan.total_bytes * 3 < whole.plan(da, db).total_bytes


@pytest.mark.parametrize("name", list(MESHES))
def test_eager_jax_grad_of_a_scan_given_its_mesh_and_placements_equals_one_device(name):
    """jax.grad run eagerly (no jit) of a loss calling dist.associative_scan(..., mesh=,
    placements=) on plain arrays — how one checks gradients on one device — raised jax's
    'Custom VJP bwd rule must produce an output with the same container' TypeError: the
    totals' placement hint made a DistTensor of a concrete cotangent (found by a probe). The
    hints now apply to traced values only."""
    mesh, placements = MESHES[name]
    a, b = _ab()

    def loss(scan):
        return lambda a, b: jnp.sum(scan((a, b))[1] ** 2)

    ours = loss(lambda e: dist.associative_scan(linear_recurrence, e, axis=1, mesh=mesh,
                                                placements=placements))
    plain = loss(lambda e: jax.lax.associative_scan(linear_recurrence, e, axis=1))
    want = jax.grad(plain, argnums=(0, 1))(a, b)
    for got in (jax.grad(ours, argnums=(0, 1))(a, b),
                jax.jit(jax.grad(ours, argnums=(0, 1)))(a, b)):
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-4)
    # the forward alone, eagerly, still places its results
    out = dist.associative_scan(linear_recurrence, (a, b), axis=1, mesh=mesh,
                                placements=placements)
    for g, w in zip(out, jax.lax.associative_scan(linear_recurrence, (a, b), axis=1)):
        assert g.placements == placements
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-5)


def test_blocks_are_named_or_read_from_placements():
    mesh, placements = MESHES["dp×sep"]
    a, b = _ab()
    da = dist.shard_tensor(a, mesh, placements)
    with pytest.raises(dist.ScanBlocksError, match="pass placements="):
        dist.jit(lambda x: dist.associative_scan(jnp.add, x, axis=1))(da)
    with pytest.raises(dist.ScanBlocksError, match="name 1 mesh dims"):
        dist.associative_scan(jnp.add, a, axis=1, mesh=mesh, placements=[S(1)])
    with pytest.raises(dist.ScanBlocksError, match="placed alike"):
        dist.associative_scan(jnp.add, (da, dist.shard_tensor(a, mesh, [R, S(1)])), axis=1)
    with pytest.raises(dist.ScanBlocksError, match="pad the sequence to a multiple of 4"):
        dist.associative_scan(jnp.add, a[:, :30], axis=1, blocks=4)
    # on plain arrays, blocks= alone: the same values as jax's scan
    np.testing.assert_allclose(dist.associative_scan(jnp.add, a, axis=1, blocks=8),
                               jnp.cumsum(a, axis=1), rtol=1e-5, atol=1e-5)


def test_arrays_of_different_shapes_and_checked_axis_and_placements():
    """As jax's scan, the arrays need one length along the axis only: a decay (B, L, 1)
    broadcast against inputs (B, L, d) — eagerly, in dist.jit with gradients, and by blocks=.
    An axis out of range and a Shard dim a scanned array lacks are errors (the axis used to
    wrap around silently: axis=3 of a 3-d array scanned axis 0); short forms are read."""
    mesh, placements = MESHES["dp×sep"]
    a, b = _ab()
    a = a[..., :1]  # (4, 64, 1) beside b's (4, 64, 8)
    want = jax.lax.associative_scan(linear_recurrence, (a, b), axis=1)
    got = dist.associative_scan(linear_recurrence, tuple(dist.shard_tensor(x, mesh, placements)
                                                         for x in (a, b)), axis=1)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-5)
    for g, w in zip(dist.associative_scan(linear_recurrence, (a, b), axis=1, blocks=4), want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)

    def loss(scan):
        return lambda a, b: jnp.sum(jnp.sin(scan((a, b))[1]))

    ours = loss(lambda e: dist.associative_scan(linear_recurrence, e, axis=1, mesh=mesh,
                                                placements=["S(0)", "S(1)"]))
    plain = loss(lambda e: jax.lax.associative_scan(linear_recurrence, e, axis=1))
    grad = dist.jit(jax.grad(ours, argnums=(0, 1)))
    for g, w in zip(grad(a, b), jax.grad(plain, argnums=(0, 1))(a, b)):
        np.testing.assert_allclose(g.numpy() if hasattr(g, "numpy") else g, w,
                                   rtol=1e-4, atol=1e-4)
    with pytest.raises(dist.ScanBlocksError, match="axis 3 is out of range"):
        dist.associative_scan(jnp.add, b, axis=3, blocks=2)
    with pytest.raises(dist.ScanBlocksError, match="one length along axis 1"):
        dist.associative_scan(linear_recurrence, (a[:, :32], b), axis=1, blocks=2)
    with pytest.raises(dist.PlacementError, match="dim 3 does not exist"):
        dist.associative_scan(jnp.add, b, axis=1, mesh=mesh, placements=[R, S(3)])


def test_a_sequence_its_devices_do_not_divide_is_scanned_whole_with_a_warning():
    """An uneven split is computed whole with an UnevenShardingWarning, as everywhere else
    (it was a ScanBlocksError): eagerly, results placed as the inputs, and inside dist.jit."""
    mesh, placements = MESHES["dp×sep"]
    a, b = (x[:, :30] for x in _ab(3))  # 30 rows over 4 sep devices
    da, db = (dist.shard_tensor(x, mesh, placements) for x in (a, b))
    expected = jax.lax.associative_scan(linear_recurrence, (a, b), axis=1, reverse=True)
    with pytest.warns(dist.UnevenShardingWarning,
                      match=r"associative_scan: argument \d .*dim 1 of size 30 .*gathered whole"):
        got = dist.associative_scan(linear_recurrence, (da, db), axis=1, reverse=True)
    for g, e in zip(got, expected):
        assert g.placements == placements
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-5, atol=1e-5)
    inside = dist.jit(lambda x, y: dist.associative_scan(
        linear_recurrence, (x, y), axis=1, reverse=True, placements=placements, mesh=mesh))
    with pytest.warns(dist.UnevenShardingWarning):
        got = inside(da, db)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length,placements", [(64, [S(0), R]), (10, [S(0), S(1)])],
                         ids=["scanned axis whole", "scanned axis uneven"])
def test_placements_inside_dist_jit_annotate_a_scan_of_the_whole_axis(length, placements):
    """With the scanned axis not split (or split unevenly: computed whole, as the README
    says), placements= and mesh= still annotate the arrays: unplaced inputs then take the
    placements (they were dropped: "dist.jit found no mesh")."""
    mesh = MESHES["dp×sep"][0]
    a, b = (x[:, :length] for x in _ab())
    f = dist.jit(lambda a, b: dist.associative_scan(linear_recurrence, (a, b), axis=1,
                                                    placements=placements, mesh=mesh))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dist.UnevenShardingWarning)
        got = f(a, b)
    for g, w in zip(got, jax.lax.associative_scan(linear_recurrence, (a, b), axis=1)):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-6)
    assert f.plan(a, b).inputs[0].dims[0] == ("dp",)  # the batch split, as the placements say
