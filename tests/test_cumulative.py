"""Scans and arg-reductions over a sharded axis combine shard totals instead of gathering."""
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import autoshard as dist
from autoshard.hlo import collective_bytes, count_collectives

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
X = (np.arange(16 * 32, dtype=np.float32).reshape(16, 32) % 7 - 3) / 4


@pytest.mark.parametrize("fn", [
    lambda x: jnp.cumsum(x, axis=1), lambda x: lax.cumsum(x, axis=1, reverse=True),
    lambda x: lax.cummax(x, axis=1), lambda x: lax.cumlogsumexp(x, axis=1),
    lambda x: jnp.argmax(x, axis=1), lambda x: jnp.argmin(x, axis=1),
], ids=["cumsum", "cumsum-reverse", "cummax", "cumlogsumexp", "argmax", "argmin"])
def test_sharded_axis_is_combined_not_gathered(fn):
    x = dist.shard_tensor(X, MESH, [dist.Shard(0), dist.Shard(1)])
    f = dist.jit(fn)
    np.testing.assert_allclose(f(x).numpy(), np.asarray(jax.jit(fn)(X)), rtol=1e-5, atol=1e-5)
    plan = f.plan(x)
    local_rows, full_axis = 16 // 2, 32
    for c in plan.collectives:  # only shard totals / candidates travel, never the whole axis
        assert c.bytes_per_device < local_rows * full_axis * 4, str(c)
    assert count_collectives(f.lower(x).compile().as_text()) == Counter(c.kind for c in plan.collectives)


@pytest.mark.parametrize("fn", [jnp.max, jnp.min, jnp.argmax, jnp.argmin,
                                lambda x: jnp.argmax(x, axis=1), lambda x: jnp.max(x, axis=0)],
                         ids=["max", "min", "argmax", "argmin", "argmax-rows", "max-cols"])
def test_a_nan_in_one_shard_wins_as_on_one_device(fn):
    # jax.jit's own sharded max returns a number here (XLA's all-reduce drops the NaN), and a
    # NaN equals no value, so the arg-reduction's combine must pick it out by itself
    value = X.copy()
    value[5, 20], value[12, 3] = np.nan, np.nan
    x = dist.shard_tensor(value, MESH, [dist.Shard(0), dist.Shard(1)])
    f = dist.jit(fn)
    np.testing.assert_array_equal(f(x).numpy(), np.asarray(fn(jnp.asarray(value))))
    plan = f.plan(x)
    assert count_collectives(f.lower(x).compile().as_text()) == Counter(c.kind for c in plan.collectives)


REVERSED = {  # the op from the end of a split dim, written with flips, and as lax writes it
    "flip-cumsum-flip": (lambda x: jnp.flip(jnp.cumsum(jnp.flip(x, 1), 1), 1),
                         lambda x: lax.cumsum(x, 1, reverse=True)),
    "[::-1]-cummax-[::-1]": (lambda x: lax.cummax(x[:, ::-1], 1)[:, ::-1],
                             lambda x: lax.cummax(x, 1, reverse=True)),
    "reverse-cumprod-between-flips": (
        lambda x: jnp.flip(lax.cumprod(jnp.flip(x, 1), 1, reverse=True), 1),
        lambda x: lax.cumprod(x, 1)),
    "flip-flip": (lambda x: jnp.flip(jnp.flip(x, (0, 1)), (1, 0)) * 2, lambda x: x * 2),
}
# (cummax's and cumprod's gradients are associative scans of their own, not these ops)
_GRADIENT_TOO = {"flip-cumsum-flip", "flip-flip"}


@pytest.mark.parametrize("name", list(REVERSED))
def test_reversals_around_a_scan_fold_into_the_reverse_scan(name):
    """A sum from the end written with flips (returns-to-go) reverses the split dim twice —
    each reversal a move of every block to the mirrored device; folded, it is the reverse
    scan and moves exactly what lax's own reverse scan moves (the gradient too, a cumsum's
    being a cumsum between the same flips)."""
    flipped, plain = REVERSED[name]
    x = dist.shard_tensor(X, MESH, [dist.Shard(0), dist.Shard(1)])
    cases = [(flipped, plain)]
    if name in _GRADIENT_TOO:
        cases.append((jax.grad(lambda x: jnp.sum(flipped(x) ** 2)),
                      jax.grad(lambda x: jnp.sum(plain(x) ** 2))))
    for fn, ref in cases:
        f = dist.jit(fn)
        np.testing.assert_allclose(f(x).numpy(), np.asarray(jax.jit(fn)(X)), rtol=1e-5, atol=1e-5)
        plan, ref_plan = f.plan(x), dist.jit(ref).plan(x)
        assert plan.total_bytes == ref_plan.total_bytes, plan.collectives
        assert not any(e.primitive is lax.rev_p for e in plan.program.eqns)
        assert count_collectives(f.lower(x).compile().as_text()) == Counter(
            c.kind for c in plan.collectives)


@pytest.mark.parametrize("fn", [
    lambda x: jnp.sort(x, axis=1), lambda x: jnp.argsort(x, axis=1),
    lambda x: jnp.median(x, axis=1), lambda x: jnp.flip(jnp.moveaxis(x.reshape(16, 4, 8), 1, 2), 2),
], ids=["sort", "argsort", "median", "moveaxis"])
def test_a_dim_needed_whole_hands_its_axis_to_another_dim(fn):
    """An op that needs the split dim whole (a sort along it) keeps the other dims split —
    and the freed mesh axis re-splits another dim (one all-to-all, as XLA moves it) rather
    than every device gathering the whole dim for its rows: no all-gather, no more bytes than
    jax.jit with the same input shardings."""
    x = dist.shard_tensor(X, MESH, [dist.Shard(0), dist.Shard(1)])
    f = dist.jit(fn, out_placements="keep")
    out = f(x)
    np.testing.assert_array_equal(out.numpy(), np.asarray(jax.jit(fn)(X)))
    assert out.placements[0] == dist.Shard(0)  # rows stay split over dp ...
    plan = f.plan(x)
    assert not [c for c in plan.collectives if c.kind == "all-gather"]  # ... and mp joins them
    hlo = f.lower(x).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)
    xla = jax.jit(fn, in_shardings=jax.sharding.NamedSharding(
        MESH.to_jax(), jax.sharding.PartitionSpec("dp", "mp"))).lower(X).compile().as_text()
    assert sum(collective_bytes(hlo).values()) <= sum(collective_bytes(xla).values())


@pytest.mark.parametrize("placements", [["S(0)", "S(1)"], ["R", "S(0)"]])
@pytest.mark.parametrize("sort", [
    lambda k, v: lax.sort_key_val(k, v, dimension=1),
    lambda k, v: lax.sort((k, v, v * 2.0), dimension=1, num_keys=1)[::2],
], ids=["sort_key_val", "three operands"])
def test_sorted_values_nothing_reads_are_not_moved(sort, placements):
    """A step that only differentiates a sort reads its permutation (jax's jvp adds an iota
    operand), not the sorted values: XLA drops the unread operands, so the plan must not
    move them either — it listed an all-to-all of `v` that never ran."""
    k, v = X, np.cos(X)

    def loss(k, v):
        return sum(jnp.sum(o * jnp.arange(32.0)) for o in sort(k, v))

    f = jax.grad(loss, argnums=(0, 1))
    g = dist.jit(f)
    dk, dv = (dist.shard_tensor(a, MESH, placements) for a in (k, v))
    for got, want in zip(g(dk, dv), jax.jit(f)(k, v)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    plan = g.plan(dk, dv)
    (e,) = [e for e in plan.program.eqns if e.name == "sort"]
    # the keys and the iota jax's jvp sorts with them (the permutation), nothing else
    assert [np.dtype(v.aval.dtype).kind for v in e.inputs] == ["f", "u"]
    hlo = g.lower(dk, dv).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)


@pytest.mark.parametrize("fn, itemsize", [
    (lambda x: jnp.sort(x, axis=1), 4),
    (lambda x: jnp.fft.fft(x.astype(jnp.complex64), axis=1), 8),
], ids=["sort", "fft"])
@pytest.mark.parametrize("mesh, placements", [
    (dist.ProcessMesh(list(range(8)), ["sep"]), ["S(1)"]),
    (MESH, ["S(0)", "S(1)"]),
], ids=["8", "2x4"])
def test_the_freed_axis_goes_to_a_later_dim_when_the_first_cannot_take_it(fn, itemsize, mesh,
                                                                           placements):
    """(batch 4, seq 16, channels 8), the sequence split: the batch cannot take the sequence's
    mesh axis (4 rows over 8 devices, or over dp × mp), the channels can — one all-to-all
    onto them, not an all-gather of the sequence (only the first passing dim was offered;
    found by a probe: 8x the bytes)."""
    v = np.random.default_rng(0).normal(size=(4, 16, 8)).astype(np.float32)
    x = dist.shard_tensor(v, mesh, placements)
    f = dist.jit(fn)
    np.testing.assert_allclose(f(x).numpy(), np.asarray(jax.jit(fn)(v)), rtol=1e-5, atol=1e-5)
    plan = f.plan(x)
    assert Counter(c.kind for c in plan.collectives) == {"all-to-all": 1}, plan.collectives
    block = v.size * itemsize // 8
    split = mesh.shape[-1]
    assert plan.total_bytes == block * (split - 1) // split
    assert count_collectives(f.lower(x).compile().as_text()) == Counter(
        c.kind for c in plan.collectives)


# Integer-valued logits: many equal values sit in different shards, so the order among ties
# (lowest index first, as on one device) is exercised.
LOGITS = (np.arange(16 * 256, dtype=np.float32).reshape(16, 256) * 37 % 23)


@pytest.mark.parametrize("placements", [["S(0)", "S(1)"], ["R", "S(1)"], ["S(1)", "S(0)"]])
@pytest.mark.parametrize("k, combined", [(4, True), (100, False)], ids=["k4-candidates", "k100-gathered"])
def test_top_k_over_sharded_vocab(placements, k, combined):
    """top-k of vocab-parallel logits: each device's best k travel, not the logits (unless the
    candidates would weigh more than the block)."""
    x = dist.shard_tensor(LOGITS, MESH, placements)
    fn = lambda x: lax.top_k(x, k)  # noqa: E731
    f = dist.jit(fn)
    values, indices = f(x)
    want_values, want_indices = jax.jit(fn)(LOGITS)
    np.testing.assert_array_equal(values.numpy(), np.asarray(want_values))
    np.testing.assert_array_equal(indices.numpy(), np.asarray(want_indices))
    grad = lambda x: jax.grad(lambda x: (lax.top_k(x, k)[0] ** 2).sum())(x)  # noqa: E731
    np.testing.assert_array_equal(dist.jit(grad)(x).numpy(), np.asarray(jax.jit(grad)(LOGITS)))

    vocab_dim = placements.index("S(1)")                  # the mesh dim splitting the vocab
    n, axis = MESH.shape[vocab_dim], MESH.dim_names[vocab_dim]
    rows = 16 // (MESH.shape[placements.index("S(0)")] if "S(0)" in placements else 1)
    block = 256 // n
    plan = f.plan(x)
    assert all(c.axes == (axis,) for c in plan.collectives)
    moved = sum(c.bytes_per_device for c in plan.collectives)
    if combined:  # k f32 values + k i32 indices from each of the other n - 1 devices
        assert len(plan.collectives) == 2 and moved == rows * k * 8 * (n - 1)
    else:  # the block itself is smaller than k candidates
        assert len(plan.collectives) == 1 and moved == rows * block * 4 * (n - 1)
    hlo = f.lower(x).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)
    # what the compiled all-gathers produce: n·k candidates per row, or the whole vocab row
    gathered = rows * n * k * 8 if combined else rows * 256 * 4
    assert collective_bytes(hlo) == Counter({"all-gather": gathered})
