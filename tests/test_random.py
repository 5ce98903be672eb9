"""Random numbers inside dist.jit equal one device's for every mesh, with no communication."""
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard as dist
from autoshard.testing import logical_value

MESHES = {
    "8": dist.ProcessMesh(list(range(8)), ["a"]),
    "2x4": dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["a", "b"]),
    "4x2": dist.ProcessMesh([[7, 6], [5, 4], [3, 2], [1, 0]], ["a", "b"]),
    "2x2x2": dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["a", "b", "c"]),
}


def _has_generator(impl: str) -> bool:
    try:
        jax.random.key(0, impl=impl)
    except (ValueError, TypeError, KeyError):
        return False
    return True


PHILOX = [g for g in ("philox2x32", "philox4x32") if _has_generator(g)]  # (from jax 0.10)
COUNTER_BASED = [g for g in ("threefry4x32",) if _has_generator(g)] + PHILOX


def dropout(x, key):
    keep = jax.random.bernoulli(key, 0.7, x.shape)
    noise = jax.random.normal(jax.random.fold_in(key, 1), x.shape)
    return jnp.where(keep, x / 0.7, 0.0) + 0.01 * noise


# XLA CPU in jax >= 0.12 rounds erf_inv (the normal distribution's transform of the uniform
# bits) by the shape of the block it runs on: plain jax.jit of erf_inv on a (16, 32) array and
# on its (16, 4) column blocks differ by an ulp in 25 of 512 elements. The bits are the same.
SHAPE_DEPENDENT_ROUNDING = jax.__version_info__[:2] >= (0, 12)


def assert_same_draws(got, want):
    if SHAPE_DEPENDENT_ROUNDING and np.issubdtype(want.dtype, np.floating):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    else:
        np.testing.assert_array_equal(got, want)


def assert_draws_on_own_shard(fn, x, mesh_name, placements, key):
    """`fn(x, key)` equals one device's, with no fallback, no collective, and the random bits
    sharded like x (each device draws only its own block)."""
    mesh = MESHES[mesh_name]
    placements = list(placements)[:mesh.ndim] + ["R"] * (mesh.ndim - len(placements))
    xs = dist.shard_tensor(x, mesh, placements)
    f = dist.jit(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        out = f(xs, key)
    assert_same_draws(out.numpy(), np.asarray(jax.jit(fn)(x, key)))
    plan = f.plan(xs, key)
    assert not plan.collectives
    bits = next(ep for ep in plan.eqns if ep.primitive == "random_bits")
    assert bits.results[0] == xs.layout


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("placements", [("S(0)",), ("S(1)",), ("S(0)", "S(1)"), ("R",), ("S(1)", "S(0)")])
def test_dropout_mask_is_the_single_device_mask(mesh_name, placements):
    x = np.arange(16 * 32, dtype=np.float32).reshape(16, 32)
    assert_draws_on_own_shard(dropout, x, mesh_name, placements, jax.random.key(1234))


def per_row_noise(x, key):
    """One key per row (split, then vmap): random_bits on a batch of keys."""
    rows = jax.random.split(key, x.shape[0] * x.shape[1]).reshape(x.shape[:2])
    draw = jax.vmap(jax.vmap(lambda k: jax.random.bernoulli(k, 0.6, x.shape[2:])))
    return jnp.where(draw(rows), x, 0.0)


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("placements", [("S(0)", "S(2)"), ("S(1)", "S(0)"), ("S(2)",), ("R", "S(1)", "S(0)")])
def test_batched_keys_draw_on_their_own_shard(mesh_name, placements):
    x = np.arange(8 * 8 * 16, dtype=np.float32).reshape(8, 8, 16)  # key dims split like x's
    assert_draws_on_own_shard(per_row_noise, x, mesh_name, placements, jax.random.key(99))


def _gamma_family(a, key):
    g = jax.random.gamma(key, a)
    b = jax.random.beta(jax.random.fold_in(key, 1), a, 2.0 * a)
    return g + b + jax.grad(lambda c: jnp.sum(jax.random.gamma(key, c)))(a)


@pytest.mark.parametrize("mesh_name,placements,impl", [
    ("8", ("S(1)",), "threefry2x32"), ("2x4", ("S(0)", "S(1)"), "threefry2x32"),
    ("4x2", ("S(1)", "S(0)"), "threefry2x32"), ("2x2x2", ("S(0)", "S(1)"), "threefry2x32")]
    + [("2x4", ("S(0)", "S(1)"), g) for g in COUNTER_BASED + ["rbg"]])  # (compiles ~2 s)
def test_gamma_and_beta_draws_equal_one_device_on_every_shard(mesh_name, placements, impl):
    # element i draws with key i of split(key, a.size): each device makes its own elements'
    # keys and runs jax's sampler on them (ran replicated: the alphas gathered, a warning).
    # Other generators' keys draw whole on every device, as one device does, with no
    # warning (Philox's: the sampler's loop splits keys, their hashes computed on half-width
    # products there too)
    mesh = MESHES[mesh_name]
    placements = list(placements)[:mesh.ndim] + ["R"] * (mesh.ndim - len(placements))
    a = np.linspace(0.3, 4.0, 64, dtype=np.float32).reshape(8, 8)
    xs = dist.shard_tensor(a, mesh, placements)
    key = jax.random.key(11, impl=impl)
    f = dist.jit(_gamma_family)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        out = f(xs, key)
    # (to an ulp: XLA CPU vectorises the sampler's log / exp differently for a one-column
    # block; a different draw would be off by far more)
    np.testing.assert_allclose(out.numpy(), np.asarray(jax.jit(_gamma_family)(a, key)),
                               rtol=1e-6)
    if impl != "threefry2x32":
        return
    plan = f.plan(xs, key)  # the draws move nothing and stay laid out as the alphas
    gammas = [ep for ep in plan.eqns if ep.primitive == "random_gamma"]
    assert gammas and all(ep.results[0] == xs.layout and not ep.reshards for ep in gammas)
    assert not any(c.consumer.startswith("random_gamma") for c in plan.collectives)


def test_raw_key_data_and_legacy_keys_match_one_device():
    mesh = MESHES["2x4"]
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    xs = dist.shard_tensor(x, mesh, ["S(0)", "S(1)"])

    def f(x, raw):
        key = jax.random.wrap_key_data(raw)
        legacy = jax.random.PRNGKey(5)  # uint32[2] keys, as older code writes them
        a, b = jax.random.split(key)
        y = x + jax.random.normal(a, x.shape) + jax.random.uniform(legacy, x.shape)
        return y, jax.random.key_data(b)

    raw = jax.random.key_data(jax.random.key(11))
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        y, k = dist.jit(f)(xs, raw)
    want_y, want_k = jax.jit(f)(x, raw)
    np.testing.assert_array_equal(y.numpy(), np.asarray(want_y))
    np.testing.assert_array_equal(k.numpy(), np.asarray(want_k))
    assert not dist.jit(f).plan(xs, raw).collectives


@pytest.mark.parametrize("impl", ["threefry2x32"] + PHILOX)
def test_random_init_with_dtensor_from_fn_matches_one_device(impl):
    # (a Philox draw is planned by dist.jit: jax.jit with out_shardings fails in XLA on it)
    mesh = MESHES["2x4"]
    key = jax.random.key(0, impl=impl)
    for shape in [(8, 16), (7, 10)]:  # (uneven: stored padded)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dist.UnevenShardingWarning)
            w = dist.dtensor_from_fn(jax.random.normal, mesh, ["S(0)", "S(1)"], key, shape)
        np.testing.assert_array_equal(w.numpy(), np.asarray(jax.random.normal(key, shape)))
        assert w.placements == [dist.Shard(0), dist.Shard(1)]


# ------------------------------------------------------------------ masks in the compiled HLO
def _compiled_pair(workload):
    """Our compiled step and plain jax.jit's, from the same input shardings."""
    from autoshard.bench.measure import baseline_inputs

    ours = dist.jit(workload.step, out_placements=workload.out_placements)
    ours = ours.lower(*workload.args).compile().as_text()
    base = jax.jit(workload.step).lower(*baseline_inputs(workload.args)).compile().as_text()
    return ours, base


def _threefry_loops(hlo: str) -> int:
    # on CPU every threefry2x32 call (random_bits, fold_in) is one while loop over (counter,
    # u32 bits, ...); jaxlib 0.10's elemental emitter (conftest) expands scatters into loops too
    return len(re.findall(r"= \(s32\[\], u32\[[^\n]*? while\(", hlo))


def _uniform_conversions(hlo: str) -> int:
    # u32 random bits -> f32 in [1, 2): the bitcast of jax.random.uniform (of the bits or'ed
    # with the exponent), once per place the mask is computed from the bits (a max over a
    # split dim bitcasts its ordered integer key back to a float too: not counted)
    return len(re.findall(r"= f32\[[\d,]*\](?:\{[\d,]*\})? bitcast-convert\(%or", hlo))


def test_dropout_bits_are_drawn_once_per_mask_like_jax_jit():
    """Forward and backward share each draw: threefry runs as often as in plain jax.jit (the
    backward never re-draws), and on the dropout MLP the mask is computed as often too."""
    from autoshard.bench import gpt_workloads, workloads

    ours, base = _compiled_pair(workloads.dropout_mlp(quick=True))
    assert _threefry_loops(ours) == _threefry_loops(base) == 1
    assert _uniform_conversions(ours) == _uniform_conversions(base) > 0
    ours, base = _compiled_pair(gpt_workloads.gpt_dp_tp(2))
    assert _threefry_loops(ours) == _threefry_loops(base) == 4   # 2 fold_in + 2 masks


def test_gpt_dropout_mask_conversions_no_more_than_jax_jit():
    """The Megatron residual add reduces the block's Partial output and then adds x: making x
    Partial instead (same bytes) left XLA CPU recomputing x, its dropout select and the
    bits->mask conversion in every consumer fusion (O(layers^2) work in the backward)."""
    from autoshard.bench import gpt_workloads

    ours, base = _compiled_pair(gpt_workloads.gpt_dp_tp(3))
    assert _uniform_conversions(ours) <= _uniform_conversions(base)


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_other_generators_draw_whole_from_replicated_keys_with_no_warning(impl):
    # rbg keys have no per-element formula: every device draws the whole array (the keys are
    # replicated, so nothing moves) and keeps its block — one device's values, no fallback.
    # Not even a batch of keys splits: rbg draws a batch at once unlike its parts.
    mesh = MESHES["2x4"]
    x = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)

    def f(x):
        key = jax.random.key(3, impl=impl)
        rows = jax.vmap(lambda k: jax.random.uniform(k, (16,)))(jax.random.split(key, 8))
        return x * jax.random.normal(key, x.shape) + rows

    xd = dist.shard_tensor(x, mesh, [dist.Shard(0), dist.Shard(1)])
    g = dist.jit(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        out = g(xd)
    np.testing.assert_array_equal(out.numpy(), jax.jit(f)(x))
    assert out.placements == xd.placements and not g.plan(xd).collectives


@pytest.mark.parametrize("mesh_name, shape, placements", [
    ("8", (8,), ["S(0)"]), ("2x4", (2, 4), ["S(0)", "S(1)"]), ("2x4", (8,), ["R", "S(0)"])])
def test_jax_random_of_a_key_dtensor_names_what_to_write_and_that_matches_one_device(
        mesh_name, shape, placements):
    """jax.random takes typed keys only as a jax.Array (a DistTensor it reads as raw uint32
    key data: jax's shape TypeError); the error says so, and what it says to write gives one
    device's key data."""
    from autoshard.errors import OperandTypeError

    mesh = MESHES[mesh_name]
    keys = jax.random.split(jax.random.key(0), int(np.prod(shape))).reshape(shape)
    want = np.asarray(jax.random.key_data(keys))
    x = dist.shard_tensor(keys, mesh, placements)
    where = re.escape(f"shape {list(shape)}) placed {x.placements} on mesh dims {mesh.dim_names}")
    with pytest.raises(OperandTypeError, match=rf"jax\.random\.key_data of .*{where}.*"
                       r"dist\.jit\(jax\.random\.key_data\)\(x\).*"
                       r"jax\.random\.key_data\(jnp\.asarray\(x\)\)") as info:
        jax.random.key_data(x)
    assert isinstance(info.value, TypeError)  # what jax raised, for code catching that
    np.testing.assert_array_equal(dist.jit(jax.random.key_data)(x).numpy(), want)
    np.testing.assert_array_equal(logical_value(x), want)  # the testing helper reads the words
    data = jax.random.key_data(jnp.asarray(x))  # split as x is, the key words whole
    np.testing.assert_array_equal(np.asarray(data), want)
    spec = jax.sharding.PartitionSpec(*x.sharding.spec, None)
    assert data.sharding.is_equivalent_to(
        jax.sharding.NamedSharding(x.sharding.mesh, spec), data.ndim)
    # another jax.random function: the dist.jit form it names draws one device's values
    key = dist.shard_tensor(jax.random.key(5), mesh, ["R"] * mesh.ndim)
    with pytest.raises(OperandTypeError, match=r"jax\.random\.uniform of .*"
                       r"dist\.jit\(lambda k: jax\.random\.uniform\(k, \.\.\.\)\)\(x\)"):
        jax.random.uniform(key, (3,))
    np.testing.assert_array_equal(dist.jit(lambda k: jax.random.uniform(k, (3,)))(key).numpy(),
                                  jax.random.uniform(jax.random.key(5), (3,)))





def _counter_based_program(x, key):
    """Draws of every kind from a counter-based generator's key: a mask, normals of a folded
    key, 8-bit bits, and a key seeded inside the program."""
    inner = jax.random.key(5, impl=jax.random.key_impl(key))
    bits = jax.random.bits(jax.random.split(key)[1], x.shape, dtype=jnp.uint8)
    return (dropout(x, key) + bits.astype(jnp.float32)
            + jax.random.uniform(inner, x.shape))


@pytest.mark.parametrize("impl", COUNTER_BASED)
@pytest.mark.parametrize("fn", [_counter_based_program, per_row_noise],
                         ids=["draws", "per-row keys"])
@pytest.mark.parametrize("mesh_name, placements", [("2x4", ("S(0)", "S(1)")),
                                                   ("2x2x2", ("S(1)", "S(0)"))])
def test_counter_based_keys_draw_on_their_own_shard(impl, fn, mesh_name, placements):
    # jax 0.10's counter-based generators hash the element's index: each device draws its
    # own block (as with threefry2x32: no communication). XLA's multiply-high of Philox's
    # hash does not lower inside shard_map ("Unable to convert MHLO to StableHLO", plain
    # jax.shard_map too): it runs on half-width products instead
    x = np.arange(8 * 8 * 16, dtype=np.float32).reshape(8, 8, 16)
    assert_draws_on_own_shard(fn, x, mesh_name, placements, jax.random.key(1234, impl=impl))


_KEY_OPS = {
    "key_data": jax.random.key_data,
    "wrap(key_data)": lambda k: jax.random.wrap_key_data(jax.random.key_data(k),
                                                         impl=jax.random.key_impl(k)),
    "split": lambda k: jax.vmap(jax.random.split)(k),
    "fold_in per key": lambda k: jax.vmap(jax.random.fold_in)(
        k, jnp.arange(k.shape[0], dtype=jnp.uint32)),
    "clone": lambda k: jax.vmap(jax.random.clone)(k),
    "fold_in one message": lambda k: jax.vmap(lambda kk: jax.random.fold_in(kk, 7))(k),
    "per-key draws": lambda k: jax.vmap(lambda kk: jax.random.uniform(kk, (3,)))(
        jax.vmap(jax.random.fold_in, in_axes=(0, None))(k, 3)),
}


def _words(x) -> np.ndarray:
    """An array's values, a key array's as its uint32 words."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


@pytest.mark.parametrize("op", list(_KEY_OPS))
@pytest.mark.parametrize("mesh_name, placements", [("8", ["S(0)"]), ("2x4", ["R", "S(0)"]),
                                                   ("2x2x2", ["S(0)", "R", "R"])])
def test_key_manipulation_keeps_split_keys_split_and_matches_one_device(op, mesh_name,
                                                                         placements):
    """Per-sample keys split over a mesh dim stay split through key_data / wrap / split /
    fold_in (each works per key): no collective, and one device's values (they were gathered,
    every device manipulating every key)."""
    _check_key_op(_KEY_OPS[op], MESHES[mesh_name], placements,
                  jax.random.split(jax.random.key(0), 8))


@pytest.mark.parametrize("op", list(_KEY_OPS))
@pytest.mark.parametrize("impl", COUNTER_BASED)
def test_counter_based_key_manipulation_keeps_split_keys_split_and_matches_one_device(op, impl):
    _check_key_op(_KEY_OPS[op], MESHES["2x4"], ["R", "S(0)"],
                  jax.random.split(jax.random.key(0, impl=impl), 8))


def _check_key_op(fn, mesh, placements, keys):
    from autoshard.hlo import count_collectives

    x = dist.shard_tensor(keys, mesh, placements)
    g = dist.jit(fn)
    out = g(x)
    got = out.numpy() if not jax.dtypes.issubdtype(out.dtype, jax.dtypes.prng_key) else \
        dist.jit(jax.random.key_data)(out).numpy()
    np.testing.assert_array_equal(got, _words(fn(keys)))
    assert out.placements == x.placements  # the keys' dim split as it was, added dims whole
    assert not g.plan(x).collectives
    assert not count_collectives(g.lower(x).compile().as_text())


@pytest.mark.parametrize("same_function", [True, False], ids=["one dist.jit", "fresh dist.jit"])
def test_draws_follow_jax_threefry_partitionable_when_it_changes(same_function):
    """With jax_threefry_partitionable off each device draws the whole array (no index split);
    the rules read the flag, so an answer kept from a program planned with it on (the rule
    memo, dist.jit's program cache) must not serve one planned with it off — that bound a
    (16, 8) draw where the (4, 8) block was expected, a TypeError inside jax."""
    mesh = MESHES["8"]
    x = np.arange(32 * 8, dtype=np.float32).reshape(32, 8)
    dx = dist.shard_tensor(x, mesh, [dist.Shard(0)])

    def f(a):
        return dropout(a, jax.random.key(3))

    g = dist.jit(f)
    before = jax.config.jax_threefry_partitionable
    try:
        for flag in (True, False, True):
            jax.config.update("jax_threefry_partitionable", flag)
            out = (g if same_function else dist.jit(f))(dx)
            np.testing.assert_allclose(out.numpy(), np.asarray(jax.jit(f)(x)), rtol=1e-6,
                                       atol=1e-6)
    finally:
        jax.config.update("jax_threefry_partitionable", before)
