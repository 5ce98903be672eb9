"""dist.local_map (Paddle's): a function of one device's blocks, its results read by their
out_placements — Partial results combined only where needed — eagerly, inside dist.jit and
under jax.grad, equal to the same computation written over the whole arrays."""
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard as dist
from autoshard.hlo import count_collectives

R, S, P = dist.Replicate(), dist.Shard, dist.Partial
MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
X = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 10


@pytest.mark.parametrize("kind,combine", [("sum", np.sum), ("max", np.max), ("min", np.min),
                                          ("avg", np.mean)])
def test_partial_results_are_the_parts_of_one_value(kind, combine):
    # each device reduces its own block; the mp parts combine as the Partial kind says
    f = dist.local_map(lambda b: jnp.max(b, 1) if kind == "max" else jnp.min(b, 1)
                       if kind == "min" else jnp.mean(b, 1) if kind == "avg" else jnp.sum(b, 1),
                       out_placements=[[S(0), P(kind)]])
    out = f(dist.shard_tensor(X, MESH, [S(0), S(1)]))
    assert out.placements == [S(0), P(kind)]  # handed out pending, as asked
    local = {"sum": np.sum, "max": np.max, "min": np.min, "avg": np.mean}[kind]
    parts = np.stack([local(c, 1) for c in np.split(X, 4, 1)])
    np.testing.assert_allclose(out.numpy(), combine(parts, 0), rtol=1e-6)


def test_rank_is_the_device_of_the_block():
    mesh = dist.ProcessMesh([[4, 5, 6, 7], [0, 1, 2, 3]], ["dp", "mp"])

    def rank(b):
        return jnp.zeros((1, 1), jnp.int32) + dist.get_rank()

    f = dist.local_map(rank, out_placements=[[S(0), S(1)]], process_mesh=mesh,
                       in_placements=[[S(0), S(1)]])
    out = f(dist.shard_tensor(X, mesh, [S(0), S(1)]))
    np.testing.assert_array_equal(out.numpy(), np.asarray(mesh.process_ids).reshape(2, 4))
    assert dist.get_rank() == jax.process_index()  # outside a local function


def test_inputs_placed_otherwise_are_an_error_unless_resharding_is_asked():
    def f(b):
        return b * 2

    x = dist.shard_tensor(X, MESH, [S(0), R])
    strict = dist.local_map(f, out_placements=[[S(0), S(1)]], in_placements=[[S(0), S(1)]])
    with pytest.raises(dist.LocalMapError, match=r"argument 0 \(shape \(8, 16\)\) is placed "
                                                 r"\[S\(0\), R\].*reshard_inputs=True"):
        strict(x)
    moved = dist.local_map(f, out_placements=[[S(0), S(1)]], in_placements=[[S(0), S(1)]],
                           reshard_inputs=True)(x)
    assert moved.placements == [S(0), S(1)]
    np.testing.assert_allclose(moved.numpy(), X * 2)


def _masked_loss(w, x):
    """Each device scales its block of h's squares by a weight of its rank (Paddle's LocalLayer
    example: a mask that differs per device), then the parts are summed."""
    h = x @ w

    def local(hb):
        return jnp.sum(hb ** 2) * jnp.where(dist.get_rank() % 2 == 0, 1.0, 0.5)

    return dist.local_map(local, out_placements=[[P(), P()]], in_placements=[[S(0), S(1)]],
                          process_mesh=MESH)(h)


def _masked_loss_reference(w, x):
    h = x @ w
    weights = np.where(np.asarray(MESH.process_ids).reshape(-1) % 2 == 0, 1.0, 0.5)
    blocks = [c for r in jnp.split(h, 2, 0) for c in jnp.split(r, 4, 1)]
    return sum(jnp.sum(b ** 2) * wt for b, wt in zip(blocks, weights))


def test_inside_dist_jit_with_gradients():
    w = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    args = (dist.shard_tensor(w, MESH, [R, S(1)]), dist.shard_tensor(X, MESH, [S(0), R]))
    f = dist.jit(jax.value_and_grad(_masked_loss))
    value, grad = f(*args)
    want_value, want_grad = jax.value_and_grad(_masked_loss_reference)(w, X)
    np.testing.assert_allclose(value.numpy(), want_value, rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), want_grad, rtol=1e-5)
    # h = x @ w is made where local_map reads it ([S(0), S(1)]): nothing is gathered; the
    # loss's parts and w's gradient over dp are the only reductions
    planned = Counter(c.kind for c in f.plan(*args).collectives)
    assert count_collectives(f.lower(*args).compile().as_text()) == planned
    assert set(planned) == {"all-reduce"}
    # the same function under plain jax.jit on arrays: jax's own shard_map
    np.testing.assert_allclose(jax.jit(_masked_loss)(w, X), want_value, rtol=1e-5)


def test_local_map_errors_say_what_to_give():
    x = dist.shard_tensor(X, MESH, [S(0), S(1)])
    with pytest.raises(dist.LocalMapError, match="needs out_placements"):
        dist.local_map(lambda b: b)
    two = dist.local_map(lambda b: (b, b), out_placements=[[S(0), S(1)]])
    with pytest.raises(dist.LocalMapError, match="returns 2 arrays but out_placements has 1"):
        two(x)
    mixed = dist.local_map(lambda b: b, out_placements=[["P(sum)", "P(avg)"]])
    with pytest.raises(dist.LocalMapError, match=r"output 0 is pending more than one kind of "
                       r"reduction \('dp' sum, 'mp' avg\); a local_map output takes one kind: "
                       r"reduce one of them inside \(jax.lax.psum / pmean"):
        mixed(x)
    traced = dist.local_map(lambda b: b, out_placements=[[S(0), S(1)]])
    with pytest.raises(dist.LocalMapError, match="inside dist.jit needs in_placements.*and "
                                                 "process_mesh"):
        dist.jit(lambda t: traced(t) + 1)(x)
    no_mesh = dist.local_map(lambda b: b, out_placements=[[S(0), S(1)]],
                             in_placements=[[S(0), S(1)]])
    with pytest.raises(dist.LocalMapError, match="traced function needs process_mesh"):
        dist.jit(lambda t: no_mesh(t) + 1)(x)
    dist.auto_parallel.set_mesh(MESH)  # ... or the mesh set for everything
    try:
        np.testing.assert_allclose(dist.jit(lambda t: no_mesh(t) + 1)(x).numpy(), X + 1)
    finally:
        dist.set_mesh(None)
    with pytest.raises(dist.LocalMapError, match="got no DistTensor input: give process_mesh"):
        traced(X)
    partial_in = dist.local_map(lambda b: b, out_placements=[[S(0), S(1)]],
                                in_placements=[[S(0), P()]], process_mesh=MESH)
    with pytest.raises(dist.LocalMapError, match="is Partial"):
        dist.jit(partial_in)(x)


# ---------------------------------------------------------------- dtensor_to_local, LocalLayer
@pytest.mark.parametrize("placements", [[S(0), S(1)], [R, S(0)], [S(1), R], [P(), S(0)]],
                         ids=str)
def test_dtensor_to_local_is_the_inverse_of_dtensor_from_local(placements):
    blocks = [np.full((2, 4), k, np.float32) + np.arange(8).reshape(2, 4) for k in range(8)]
    x = dist.dtensor_from_local(blocks, MESH, placements)
    got = dist.dtensor_to_local(x, MESH, placements)
    assert len(got) == MESH.size
    for want, block in zip(blocks, got):
        np.testing.assert_array_equal(np.asarray(block), want)
    again = dist.dtensor_from_local(got, MESH, placements)
    np.testing.assert_array_equal(again.numpy(), x.numpy())


def test_dtensor_to_local_checks_what_it_is_told():
    x = dist.shard_tensor(X, MESH, [S(0), R])
    # blocks in mesh order: device (dp=1, mp=2) holds rows 4:8 of the whole columns
    np.testing.assert_array_equal(np.asarray(dist.dtensor_to_local(x)[6]), X[4:])
    with pytest.raises(dist.LocalDataError, match=r"placed \[S\(0\), R\].*dist.reshard"):
        dist.dtensor_to_local(x, MESH, [S(0), S(1)])
    with pytest.raises(dist.PlacementTypeError, match="needs a DistTensor"):
        dist.dtensor_to_local(X)
    with pytest.raises(dist.LocalDataError, match="local_map"):
        dist.jit(lambda t: dist.dtensor_to_local(t))(x)


class _MaskedSums(dist.LocalLayer):
    """Paddle's LocalLayer example, in nnx: each device sums its own rows under a mask that
    depends on its rank."""

    def forward(self, x):
        mask = jnp.where(dist.get_rank() % 2 == 0, 1.0, 0.0)
        return jnp.sum(x * mask), jnp.sum(x)


def _masked_sums_reference(x):
    per_device = [(k % 2 == 0) * b.sum() for k, b in enumerate(
        b for rows in np.split(x, 2, 0) for b in np.split(rows, 4, 1))]
    return sum(per_device), x.sum()


def test_local_layer_runs_forward_on_blocks_eagerly_and_in_dist_jit():
    attrs = [(MESH, [P(), P()]), (MESH, [P(), P()])]
    layer = _MaskedSums(attrs)
    x = dist.shard_tensor(X, MESH, [S(0), S(1)])
    masked, total = layer(x)
    want_masked, want_total = _masked_sums_reference(X)
    assert masked.placements == [P(), P()]
    np.testing.assert_allclose(masked.numpy(), want_masked, rtol=1e-6)
    np.testing.assert_allclose(total.numpy(), want_total, rtol=1e-6)
    assert layer(x)[0].numpy() == masked.numpy()  # the same program again

    # inside dist.jit, with the blocks named, and differentiated: the mask's gradient
    traced = _MaskedSums(attrs, in_placements=[[S(0), S(1)]])
    step = dist.jit(jax.grad(lambda t: traced(t)[0]))
    grad = step(X)
    assert count_collectives(step.lower(X).compile().as_text()) == Counter(
        c.kind for c in step.plan(X).collectives)
    want = np.concatenate([np.concatenate([np.full((4, 4), float((r * 4 + c) % 2 == 0))
                                           for c in range(4)], 1) for r in range(2)], 0)
    np.testing.assert_array_equal(grad.numpy(), want)
    with pytest.raises(dist.LocalMapError, match="in_placements"):
        dist.jit(lambda t: layer(t)[0])(X)
    with pytest.raises(dist.LocalMapError, match="one .process_mesh, placements. pair"):
        _MaskedSums([MESH])


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "dist.jit"])
def test_uneven_blocks_and_an_output_claimed_replicated_are_named(traced):
    uneven = dist.shard_tensor(np.zeros((6, 10), np.float32), MESH, [S(0), S(1)])
    even = dist.shard_tensor(np.zeros((8, 16), np.float32), MESH, [S(0), S(1)])
    cases = [
        (uneven, [[S(0), S(1)]], r"splits dim 1 of size 10 over mesh dim\(s\) \['mp'\] "
                                 r"\(4 devices\), unevenly.*pad dim 1 to a multiple of 4"),
        (even, [[S(0), R]], r"an output differs between devices of a mesh dim where "
                            r"out_placements \[\[S\(0\), R\]\] says Replicate.*Partial\(\)"),
    ]
    for x, out, match in cases:
        lm = dist.local_map(lambda b: b * 2, out_placements=out, in_placements=[[S(0), S(1)]],
                            process_mesh=MESH)
        with pytest.raises(dist.LocalMapError, match=match):
            (dist.jit(lm) if traced else lm)(x)


def test_a_local_map_inside_a_loop_or_checkpoint_body_names_the_mesh():
    # the only annotation is in a scan / checkpoint body (inputs are numpy): dist.jit finds
    # the mesh there instead of refusing the function
    double = dist.local_map(lambda b: b * 2, out_placements=[[S(0), S(1)]],
                            in_placements=[[S(0), S(1)]], process_mesh=MESH)
    looped = dist.jit(lambda x: jax.lax.scan(lambda c, _: (double(c), None), x, None,
                                             length=3)[0])(X)
    assert looped.mesh == MESH
    np.testing.assert_allclose(looped.numpy(), X * 8, rtol=1e-6)
    sines = dist.local_map(lambda b: jnp.sum(jnp.sin(b)), out_placements=[[P(), P()]],
                           in_placements=[[S(0), S(1)]], process_mesh=MESH)
    grad = dist.jit(jax.grad(jax.checkpoint(lambda x: sines(x))))(X)
    np.testing.assert_allclose(grad.numpy(), np.cos(X), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "dist.jit"])
def test_results_come_back_in_the_structure_the_function_returns(traced):
    # out_placements follow the flattened result (dict keys sorted); the result is the pytree
    f = dist.local_map(lambda b: {"sum": jnp.sum(b, 1), "twice": b * 2, "none": None},
                       out_placements=[[S(0), P()], [S(0), S(1)]],
                       in_placements=[[S(0), S(1)]], process_mesh=MESH)
    one = dist.local_map(lambda b: (b + 1,), out_placements=[[S(0), S(1)]],
                         in_placements=[[S(0), S(1)]], process_mesh=MESH)
    x = dist.shard_tensor(X, MESH, [S(0), S(1)])
    out, single = (dist.jit(f)(x), dist.jit(one)(x)) if traced else (f(x), one(x))
    assert isinstance(out, dict) and set(out) == {"sum", "twice", "none"}, out
    assert out["none"] is None
    np.testing.assert_allclose(out["sum"].numpy(), X.sum(1), rtol=1e-5)
    np.testing.assert_allclose(out["twice"].numpy(), X * 2)
    assert isinstance(single, tuple) and len(single) == 1
    np.testing.assert_allclose(single[0].numpy(), X + 1)


def test_input_placed_otherwise_names_the_leaf_the_mesh_dim_and_what_to_write():
    f = dist.local_map(lambda d: d["a"] * 2, out_placements=[[S(0), S(1)]],
                       in_placements=[[S(0), S(1)]], process_mesh=MESH)
    with pytest.raises(dist.LocalMapError, match=r"argument 0\['a'\] \(shape \(8, 16\)\) is "
                       r"placed \[S\(0\), R\].*on mesh dim 'mp' it is R, the function expects "
                       r"S\(1\).*dist.reshard\(x, mesh, \[S\(0\), S\(1\)\]\)"):
        f({"a": dist.shard_tensor(X, MESH, [S(0), R])})
    # the same placements on other devices: moved only when asked, as any other placement
    other = dist.ProcessMesh([[4, 5, 6, 7], [0, 1, 2, 3]], ["dp", "mp"])
    elsewhere = {"a": dist.shard_tensor(X, other, [S(0), S(1)])}
    with pytest.raises(dist.LocalMapError, match=r"is on ProcessMesh\(\[\[4, 5, 6, 7\].*but "
                                                 r"local_map runs on ProcessMesh\(\[\[0, 1"):
        f(elsewhere)
    moved = dist.local_map(lambda d: d["a"] * 2, out_placements=[[S(0), S(1)]],
                           in_placements=[[S(0), S(1)]], process_mesh=MESH,
                           reshard_inputs=True)(elsewhere)
    assert moved.mesh == MESH
    np.testing.assert_allclose(moved.numpy(), X * 2)


def test_a_local_map_called_on_blocks_is_a_typed_error():
    inner = dist.local_map(lambda b: b * 2, out_placements=[[S(0), S(1)]],
                           in_placements=[[S(0), S(1)]], process_mesh=MESH)
    outer = dist.local_map(lambda b: inner(b) + 1, out_placements=[[S(0), S(1)]],
                           in_placements=[[S(0), S(1)]], process_mesh=MESH)
    with pytest.raises(dist.LocalMapError, match="inside the function of another local_map"):
        dist.jit(outer)(X)
    with pytest.raises(dist.LocalMapError, match="inside the function of another local_map"):
        outer(dist.shard_tensor(X, MESH, [S(0), S(1)]))


@pytest.mark.parametrize("kind", ["sum", "avg"])
@pytest.mark.parametrize("dtype", ["bool", "uint8", "int8", "bfloat16"])
def test_partial_outputs_keep_their_dtype(kind, dtype):
    """A local_map output placed Partial is its parts combined in their own dtype, as a
    reshard combines them: truth values read as their `or`, uint8 parts sum in uint8 (they
    came back as an int32 count and as uint32)."""
    import jax.numpy as jnp

    mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["x", "y"])
    x = np.array([0, 1, 100, 250]).astype(jnp.dtype("uint8" if dtype == "bool" else dtype))
    t = dist.shard_tensor(x, mesh, ["R", "R"])
    fn = (lambda v: v > 0) if dtype == "bool" else (lambda v: v)
    out = dist.local_map(fn, out_placements=[[f"P({kind})", "R"]], process_mesh=mesh)(t)
    parts = np.stack([np.asarray(fn(jnp.asarray(x)))] * 2)  # one part per device along "x"
    if dtype == "bool":
        want = parts.any(axis=0)
    elif kind == "sum":
        want = np.asarray(jnp.sum(jnp.asarray(parts), axis=0, dtype=parts.dtype))
    else:
        want = parts[0]  # the mean of equal parts
    assert out.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(out.numpy()), want)
