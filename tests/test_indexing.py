"""Indexing rules: gather, scatter, dynamic_slice and dynamic_update_slice equal one device,
values and gradients, and compile to exactly the planned collectives."""
from __future__ import annotations

import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import autoshard as dist
from autoshard.hlo import count_collectives
from autoshard.placement import ReduceType

MESH8 = dist.ProcessMesh(list(range(8)), dim_names=["x"])
MESH24 = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
R, S = dist.Replicate(), dist.Shard

VOCAB, DIM = 16, 8
RNG = np.random.default_rng(0)
TABLE = RNG.normal(size=(VOCAB, DIM)).astype(np.float32)
IDS = RNG.integers(0, VOCAB, size=(4, 6)).astype(np.int32)   # every block of 16 rows is hit
W = RNG.normal(size=(4, 6, DIM)).astype(np.float32)


@pytest.fixture(autouse=True)
def no_fallbacks():
    # Every indexing primitive here has a rule: running one replicated is a failure.
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        yield


def kinds(f, *args) -> Counter:
    return Counter(c.kind for c in f.plan(*args).collectives)


def assert_hlo_matches_plan(f, *args):
    assert count_collectives(f.lower(*args).compile().as_text()) == kinds(f, *args)


def eqn(plan, primitive):
    (found,) = [ep for ep in plan.eqns if ep.primitive == primitive]
    return found


def check(fn, args, *, rtol=1e-6, atol=1e-6, **jit_kwargs):
    """dist.jit(fn) on the placed args equals jax.jit(fn) on their values; returns the plan."""
    f = dist.jit(fn, **jit_kwargs)
    got = f(*args)
    values = [a.numpy() if isinstance(a, dist.DistTensor) else a for a in args]
    ref = jax.jit(fn)(*values)
    for x, y in zip(jax.tree.leaves(got, is_leaf=lambda t: isinstance(t, dist.DistTensor)),
                    jax.tree.leaves(ref)):
        np.testing.assert_allclose(x.numpy(), np.asarray(y), rtol=rtol, atol=atol)
    assert_hlo_matches_plan(f, *args)
    return f, f.plan(*args), got


# -- the vocab-parallel embedding ---------------------------------------------------------------

EMBEDDING_PLACEMENTS = [
    pytest.param(MESH24, [R, S(0)], [S(0), R], "mp", id="2x4 vocab on mp, ids on dp"),
    pytest.param(MESH8, [S(0)], [R], "x", id="8 vocab on x"),
]


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("mesh,table_at,ids_at,vocab_axis", EMBEDDING_PLACEMENTS)
def test_embedding_lookup_of_a_vocab_sharded_table_never_gathers_it(mesh, table_at, ids_at,
                                                                    vocab_axis, dtype):
    # (a bfloat16 table was gathered whole: numpy does not count bfloat16 as a number)
    table = dist.shard_tensor(TABLE.astype(dtype), mesh, table_at)
    ids = dist.shard_tensor(IDS, mesh, ids_at)
    f, plan, out = check(lambda t, i: t[i], (table, ids))
    np.testing.assert_array_equal(out.numpy(), TABLE.astype(dtype)[IDS])
    # each device looks up its own rows: the lookup is Partial(sum) over the vocab axis ...
    gather = eqn(plan, "gather")
    assert gather.required[0] == gather.operands[0]
    assert gather.results[0].partial == ((vocab_axis, ReduceType.SUM),)
    # ... reduced once; the table never moves
    assert "all-gather" not in kinds(f, table, ids)
    assert [c.step for c in plan.collectives] == [f"psum({vocab_axis})"]


def _loss(t, ids):
    return jnp.sum(jnp.tanh(t[ids]) * W)


@pytest.mark.parametrize("mesh,table_at,ids_at,vocab_axis", EMBEDDING_PLACEMENTS)
def test_embedding_gradient_stays_vocab_sharded(mesh, table_at, ids_at, vocab_axis):
    table = dist.shard_tensor(TABLE, mesh, table_at)
    ids = dist.shard_tensor(IDS, mesh, ids_at)
    f, plan, (loss, grad) = check(jax.value_and_grad(_loss), (table, ids), rtol=1e-5, atol=1e-5,
                                  out_placements=[None, table_at])
    assert grad.placements == table_at
    # the table gradient is a scatter-add that each device does into its own rows
    scatter = eqn(plan, "scatter-add")
    assert scatter.results[0].dims[0] == (vocab_axis,)
    assert set(kinds(f, table, ids)) == {"all-reduce"}
    assert not any(c.value == repr(plan.program.inputs[0]) for c in plan.collectives)


@pytest.mark.parametrize("mesh,table_at,ids_at,vocab_axis", EMBEDDING_PLACEMENTS)
def test_sgd_update_of_a_vocab_sharded_table_scatters_into_its_own_rows(mesh, table_at, ids_at,
                                                                       vocab_axis):
    # The gradient is Partial over the batch axes and scaled by the learning rate before the
    # update needs it reduced: it must still be built as a vocab shard (not a full table per
    # device that is reduced and then sliced).
    def update(t, ids):
        return t - 0.1 * jax.grad(_loss)(t, ids)

    table = dist.shard_tensor(TABLE, mesh, table_at)
    ids = dist.shard_tensor(IDS, mesh, ids_at)
    f, plan, new = check(update, (table, ids), rtol=1e-5, atol=1e-5, out_placements=[table_at])
    assert new.placements == table_at
    assert eqn(plan, "scatter-add").results[0].dims[0] == (vocab_axis,)
    shard = TABLE.nbytes // mesh.get_dim_size(vocab_axis)
    reduced = [c for c in plan.collectives if c.consumer.startswith("sub")]
    assert all(c.bytes_per_device <= shard for c in reduced), plan.collectives
    ours = f.lower(table, ids).compile().memory_analysis()
    base = jax.jit(update).lower(table.physical, ids.physical).compile().memory_analysis()
    assert ours.temp_size_in_bytes <= base.temp_size_in_bytes + shard


@pytest.mark.parametrize("poison", [False, True], ids=["finite", "an inf label weight"])
def test_a_table_gradient_from_gathered_updates_is_allocated_after_the_gather(poison):
    # Vocab-parallel embedding and head with cross-entropy, a large vocab and few tokens: the
    # plan all-gathers the batch's embedding updates over dp rather than reducing the table
    # gradient. The zero table they are scattered into must not be held from the step's start
    # (XLA CPU schedules a bare zero broadcast first: 4.72 MB of temporaries against jax.jit's
    # 4.23 MB, whose all-reduce reuses buffers). The zeros are derived from an update, and stay
    # zeros when that update is not finite.
    vocab, dim, batch, seq = 8192, 64, 8, 32
    params = {"wte": 0.1 * RNG.normal(size=(vocab, dim)).astype(np.float32),
              "head": 0.1 * RNG.normal(size=(dim, vocab)).astype(np.float32)}
    ids_np = RNG.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    labels_np = RNG.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    weights = np.ones((batch, seq), np.float32)
    if poison:
        weights[0, 0] = np.inf

    def step(p, ids, labels):
        def loss(p):
            logp = jax.nn.log_softmax(jnp.tanh(p["wte"][ids]) @ p["head"], axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
                             * weights)
        return jax.tree.map(lambda w, g: w - 0.1 * g, p, jax.grad(loss)(p))

    placed = {"wte": dist.shard_tensor(params["wte"], MESH24, [R, S(0)]),
              "head": dist.shard_tensor(params["head"], MESH24, [R, S(1)])}
    ids = dist.shard_tensor(ids_np, MESH24, [S(0), R])
    labels = dist.shard_tensor(labels_np, MESH24, [S(0), R])
    args = (placed, ids, labels)
    f, plan, new = check(step, args, rtol=1e-5, atol=1e-5,
                         out_placements=[[R, S(1)], [R, S(0)]])
    if poison:  # the table rows one device leaves finite are finite here too
        ref = jax.jit(step)(params, ids_np, labels_np)["wte"]
        np.testing.assert_array_equal(np.isfinite(new["wte"].numpy()), np.isfinite(ref))
    into_table = [c for c in plan.collectives if c.consumer.startswith("scatter-add")]
    # the ids and the updates are gathered (jax >= 0.11's tanh derivative lets the pending
    # sum reach the scatter, where it is reduce-scattered first: the same bytes); nothing the
    # size of the table shard moves before the scatter
    assert [c.kind for c in into_table].count("all-gather") == 2
    assert "all-reduce" not in [c.kind for c in into_table]
    assert all(c.bytes_per_device < vocab * dim * 4 // 4 for c in into_table)
    assert_hlo_matches_plan(f, *args)
    ours = f.lower(*args).compile().memory_analysis()
    base = jax.jit(step).lower(*jax.tree.map(
        lambda x: x.physical, args, is_leaf=lambda x: isinstance(x, dist.DistTensor))
    ).compile().memory_analysis()
    # (a few hundred bytes of scalars and row vectors may be placed differently; the zero
    # table held for the whole step is 512 KiB)
    assert ours.temp_size_in_bytes <= base.temp_size_in_bytes + 4096


def test_embedding_gradient_with_free_output_placement():
    table = dist.shard_tensor(TABLE, MESH24, [R, S(0)])
    ids = dist.shard_tensor(IDS, MESH24, [S(0), R])
    f, _, _ = check(jax.value_and_grad(_loss), (table, ids), rtol=1e-5, atol=1e-5)
    assert "all-gather" not in kinds(f, table, ids)


@pytest.mark.parametrize("mode", ["fill", "clip"])
def test_out_of_range_ids_behave_as_on_one_device(mode):
    # ids past either end: fill gives NaN rows, clip the first/last row — on exactly one device
    bad = np.array([[-3, 0, 15, 16, 40, 7]], np.int32)
    table = dist.shard_tensor(TABLE, MESH24, [R, S(0)])
    ids = dist.shard_tensor(bad, MESH24, [R, R])
    fn = lambda t, i: jnp.take(t, i, axis=0, mode=mode)  # noqa: E731
    f, plan, out = check(fn, (table, ids))
    assert eqn(plan, "gather").results[0].partial == (("mp", ReduceType.SUM),)
    assert np.isnan(out.numpy()).any() == (mode == "fill")


def test_integer_table_with_fill_value():
    table = dist.shard_tensor(np.arange(64, dtype=np.int32).reshape(16, 4), MESH8, [S(0)])
    ids = np.array([3, -1, 9, 16, 12], np.int32)
    check(lambda t, i: jnp.take(t, i, axis=0, mode="fill", fill_value=-7), (table, ids))


# -- other gather forms -------------------------------------------------------------------------

X = RNG.normal(size=(8, 16)).astype(np.float32)
IDX = np.array([3, 0, 12, 7, 7, 15], np.int32)
ALONG = RNG.integers(0, 16, size=(8, 4)).astype(np.int32)
DOWN = RNG.integers(0, 8, size=(4, 16)).astype(np.int32)


FIVE, THREE = np.int32(5), np.int32(3)


@pytest.mark.parametrize("name,fn,index", [
    ("x[idx]", lambda x, i: x[i % 8], IDX),
    ("x[:, idx]", lambda x, i: x[:, i], IDX),
    ("x[idx, jdx]", lambda x, i: x[i % 8, i[::-1]], IDX),
    ("take_along_axis 1", lambda x, i: jnp.take_along_axis(x, i, axis=1), ALONG),
    ("take_along_axis 0", lambda x, i: jnp.take_along_axis(x, i, axis=0), DOWN),
    ("x[i]", lambda x, i: x[i], FIVE),
    ("x[i, j]", lambda x, i: x[i, i * 3], FIVE),
    ("dynamic_slice", lambda x, i: lax.dynamic_slice(x, (i, 0), (1, 16)), FIVE),
    ("dynamic_slice window", lambda x, i: lax.dynamic_slice(x, (i, i), (2, 16)), THREE),
])
@pytest.mark.parametrize("placements", [[S(0), S(1)], [S(1), S(0)]], ids=["S0S1", "S1S0"])
def test_forms_equal_one_device_with_gradients(name, fn, index, placements):
    x = dist.shard_tensor(X, MESH24, placements)
    loss = lambda x, i: jnp.sum(jnp.sin(fn(x, i)))  # noqa: E731
    f, plan, (_, grad) = check(jax.value_and_grad(loss), (x, index), rtol=1e-5, atol=1e-5)
    assert grad.shape == X.shape
    if name != "dynamic_slice window":  # a window across blocks is the one read that gathers
        assert "all-gather" not in kinds(f, x, index)


def test_take_along_axis_of_row_sharded_values_needs_no_communication():
    x = dist.shard_tensor(X, MESH8, [S(0)])
    idx = dist.shard_tensor(ALONG, MESH8, [S(0)])
    f, plan, out = check(lambda x, i: jnp.take_along_axis(x, i, axis=1), (x, idx))
    assert out.placements == [S(0)] and not plan.collectives


# -- writes -------------------------------------------------------------------------------------

def test_scatter_set_with_duplicate_indices_into_a_sharded_dim():
    dup = np.array([5, 1, 5, 14, 1, 5], np.int32)
    v = RNG.normal(size=(6, 8)).astype(np.float32)
    table = dist.shard_tensor(TABLE, MESH24, [R, S(0)])
    f, plan, out = check(lambda t, v: t.at[dup].set(v), (table, v))
    assert out.placements == [R, S(0)] and not plan.collectives


@pytest.mark.parametrize("op", ["add", "min", "max", "multiply"])
def test_scatter_of_sharded_updates(op):
    # updates split over dp: add sums partial results, min/max take their min/max
    v = RNG.normal(size=(4, 6, DIM)).astype(np.float32)
    table = dist.shard_tensor(TABLE, MESH24, [R, S(0)])
    ids = dist.shard_tensor(IDS, MESH24, [S(0), R])
    vs = dist.shard_tensor(v, MESH24, [S(0), R])
    f, plan, _ = check(lambda t, i, v: getattr(t.at[i], op)(v), (table, ids, vs),
                       out_placements=[[R, S(0)]])
    scatter = [ep for ep in plan.eqns if ep.primitive.startswith("scatter")][0]
    assert scatter.results[0].dims[0] == ("mp",)
    if op != "multiply":  # a product of partial products is not a reduction we have
        assert "all-gather" not in kinds(f, table, ids, vs)


def test_dynamic_update_slice_into_a_sharded_cache_needs_no_communication():
    cache = RNG.normal(size=(4, 8, DIM)).astype(np.float32)
    new = RNG.normal(size=(4, DIM)).astype(np.float32)
    c = dist.shard_tensor(cache, MESH24, [S(0), S(1)])
    step = lambda c, n, pos: lax.dynamic_update_slice_in_dim(c, n[:, None], pos, axis=1)  # noqa: E731
    for pos in (0, 5, 7, 11):  # 11: clamped to the last position, as on one device
        f, plan, out = check(step, (c, new, np.int32(pos)))
        assert out.placements == [S(0), S(1)] and not plan.collectives


def test_dynamic_update_slice_of_partial_values():
    a = dist.shard_tensor(X, MESH8, [S(1)])
    b = dist.shard_tensor(X.T.copy(), MESH8, [S(0)])
    row = np.arange(8, dtype=np.float32)[None]
    # a @ b is Partial(sum); writing a row into it keeps it pending, counting the row once
    f, plan, _ = check(lambda a, b: lax.dynamic_update_slice(a @ b, row, (3, 0)), (a, b),
                       out_placements="keep", rtol=1e-5, atol=1e-5)
    assert eqn(plan, "dynamic_update_slice").results[0].partial == (("x", ReduceType.SUM),)
    assert not plan.collectives


def test_vocab_parallel_cross_entropy_reduces_partials_instead_of_gathering_logits():
    mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, 64)).astype(np.float32)
    labels = rng.integers(0, 64, size=(8,)).astype(np.int32)

    def xent(z, y):
        logp = jax.nn.log_softmax(z, axis=-1)
        return -jnp.take_along_axis(logp, y[:, None], axis=-1).mean()

    z = dist.shard_tensor(logits, mesh, [dist.Shard(0), dist.Shard(1)])  # vocab over mp
    y = dist.shard_tensor(labels, mesh, [dist.Shard(0), dist.Replicate()])
    f = dist.jit(jax.value_and_grad(xent))
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        loss, grad = f(z, y)
    ref_loss, ref_grad = jax.value_and_grad(xent)(logits, labels)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), ref_grad, rtol=1e-4, atol=1e-6)
    plan = f.plan(z, y)
    assert "all-gather" not in {c.kind for c in plan.collectives}
    steps = " ".join(c.step for c in plan.collectives)
    assert "pmax(mp)" in steps and "psum(mp)" in steps  # max, then sum, over the vocab shards
    rows = 8 // 2
    assert all(c.bytes_per_device <= rows * 4 * 2 for c in plan.collectives if "mp" in c.axes)
    assert count_collectives(f.lower(z, y).compile().as_text()) == Counter(c.kind for c in plan.collectives)


def test_two_tables_read_at_the_same_ids_move_the_ids_once_as_xla_does():
    """`cos_t[pos]` and `sin_t[pos]` (RoPE tables read at packed positions): jnp indexing
    normalises the ids (`pos < 0`, `pos + 64`) once per table. Each literal was its own
    constant, so the two normalisations were two values, each gathered over dp — 4 all-gathers
    planned where XLA's CSE runs 3. Equal literals are one constant: one normalisation."""
    R, S = dist.Replicate(), dist.Shard
    rng = np.random.default_rng(21)
    B, T, H, DH = 4, 16, 8, 4
    wq, wk = (rng.normal(size=(32, H * DH)).astype(np.float32) for _ in range(2))
    x = rng.normal(size=(B, T, 32)).astype(np.float32)
    pos = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    cos_t, sin_t = (rng.normal(size=(64, DH)).astype(np.float32) for _ in range(2))

    def rot(q):
        a, b = jnp.split(q, 2, -1)
        return jnp.concatenate([-b, a], -1)

    def scores(x, pos, cos_t, sin_t):
        q, k = ((x @ w).reshape(B, T, H, DH) for w in (wq, wk))
        cos, sin = cos_t[pos][:, :, None], sin_t[pos][:, :, None]
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        return jnp.einsum("bqhd,bkhd->bhqk", q, k)

    mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
    args = (dist.shard_tensor(x, mesh, [S(0), S(1)]), dist.shard_tensor(pos, mesh, [S(0), S(1)]),
            dist.shard_tensor(cos_t, mesh, [S(1), R]), dist.shard_tensor(sin_t, mesh, [S(1), R]))
    f = dist.jit(scores)
    want = np.asarray(jax.jit(scores)(x, pos, cos_t, sin_t))
    # scores reach ~200: float32 sums taken in another order (a local block's matmul; AVX-512
    # kernels) differ by a few ulps of that scale, not of each element
    np.testing.assert_allclose(f(*args).numpy(), want, rtol=1e-5,
                               atol=3e-6 * np.abs(want).max())
    plan = f.plan(*args)
    assert plan.collective_counts() == count_collectives(f.lower(*args).compile().as_text())
    ids_moves = [c for c in plan.collectives if c.bytes_per_device == 32]  # the int32 ids
    assert len(ids_moves) == 1, [str(c) for c in plan.collectives]


@pytest.mark.parametrize("write", [
    lambda x, i: jnp.put_along_axis(x, i, 0.0, axis=1, inplace=False),
    lambda x, i: x.at[jnp.arange(8)[:, None], i[:, 0], :].set(0.0),
], ids=["put_along_axis", "at_set"])
@pytest.mark.parametrize("placements", [[S(0), S(1)], [S(1), S(2)]])
def test_the_gradient_of_writing_a_constant_runs_no_dead_collectives(write, placements):
    """The gradient of writing a constant selects between two zeros for the written value's
    cotangent: the select is that zero, and the scatter, gather and comparison that made its
    predicate (a psum and gathers in the plan) are dead, as XLA finds."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(8, 16, 32)).astype(np.float32)
    idx = rng.integers(0, 16, size=(8, 1, 32)).astype(np.int32)
    fn = jax.grad(lambda x, i: jnp.sum(write(x, i) ** 2))
    args = [dist.shard_tensor(x, MESH24, placements), dist.shard_tensor(idx, MESH24, [S(0), R])]
    f = dist.jit(fn)
    np.testing.assert_allclose(f(*args).numpy(), jax.jit(fn)(x, idx), rtol=1e-6)
    plan = f.plan(*args)
    hlo = count_collectives(f.lower(*args).compile().as_text())
    assert hlo == Counter(c.kind for c in plan.collectives), plan.collectives
