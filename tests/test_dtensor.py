"""DistTensor: creation from every source, per-device blocks, honest physical layout, display."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import autoshard as dist

from autoshard.testing import logical_value

SEED_MESH = dist.ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"])
MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
SEED_VALUE = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])


def test_seed_002_each_device_holds_a_2x1_block():
    t = dist.shard_tensor(SEED_VALUE, SEED_MESH, [dist.Shard(0), dist.Shard(1)])
    assert t.shape == (4, 3) and t.local_shape == (2, 1) and t.ndim == 2
    assert t.dtype == np.int32 and t.mesh == SEED_MESH
    assert t.placements == [dist.Shard(0), dist.Shard(1)]
    # device 2 sits at (x=0, y=0), device 3 at (x=1, y=2)
    np.testing.assert_array_equal(t.local(2), [[1], [4]])
    np.testing.assert_array_equal(t.local(3), [[9], [12]])
    assert t.block_bounds(1) == ((2, 4), (1, 2))
    np.testing.assert_array_equal(np.asarray(t), SEED_VALUE)
    np.testing.assert_array_equal(t.numpy(), SEED_VALUE)


@pytest.mark.parametrize("data,expected", [
    (np.arange(8, dtype=np.float32), np.arange(8, dtype=np.float32)),
    (jnp.arange(8), np.arange(8, dtype=np.int32)),
    ([1.0, 2.0, 3.0, 4.0], np.array([1, 2, 3, 4], np.float32)),
    (3.5, np.float32(3.5)),
])
def test_shard_tensor_sources(data, expected):
    placements = [dist.Replicate(), dist.Shard(0) if np.ndim(expected) else dist.Replicate()]
    t = dist.shard_tensor(data, MESH, placements)
    assert t.dtype == expected.dtype
    np.testing.assert_array_equal(t.numpy(), expected)
    t2 = dist.shard_tensor(data, MESH, ["P(sum)", "R"], dtype=np.float32)
    np.testing.assert_array_equal(logical_value(t2), np.asarray(expected, np.float32))


@pytest.mark.parametrize("shape, placements", [
    ((8, 12), [dist.Shard(0), dist.Shard(1)]),
    ((8, 12), [dist.Replicate(), dist.Shard(0)]),
    ((8, 12), [dist.Shard(1), dist.Replicate()]),
    ((8, 12), [dist.Partial(), dist.Shard(1)]),
    ((8, 12), [dist.Partial("max"), dist.Replicate()]),
    ((7, 10), [dist.Shard(0), dist.Shard(1)]),
    ((7, 10), [dist.Replicate(), dist.Shard(1)]),
], ids=["S0 S1", "R S0", "S1 R", "P S1", "Pmax R", "uneven S0 S1", "uneven R S1"])
def test_addressable_shards_are_the_blocks_of_the_logical_value(shape, placements):
    # what code written for jax.Array reads (checkpointers, per-device loops): each shard's
    # data is the global value at its index, every element is covered, and equal blocks are
    # numbered as replicas. A Partial tensor's blocks are those of its sum; an uneven dim's are
    # the rows each device owns
    value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    t = dist.shard_tensor(value, MESH, placements)
    shards = t.addressable_shards
    assert sorted(s.device.id for s in shards) == list(range(8))
    covered = np.zeros(shape, int)
    for s in shards:
        np.testing.assert_array_equal(np.asarray(s.data), value[s.index])
        covered[s.index] += s.replica_id == 0
    np.testing.assert_array_equal(covered, 1)
    want_block = t.local_shape if not t.layout.partial and shape == (8, 12) else None
    if want_block is not None:
        assert all(s.data.shape == want_block for s in shards)
    assert len(t.global_shards) == 8
    np.testing.assert_array_equal(np.asarray(t.addressable_data(3)),
                                  value[shards[3].index])


def test_partial_is_stored_as_varying_data_not_fake_replicas():
    t = dist.shard_tensor(np.ones((4, 8), np.float32), MESH, [dist.Partial(), dist.Shard(1)])
    phys = t.physical
    assert phys.shape == (2, 4, 8)
    assert phys.sharding.spec == P("dp", None, "mp")
    np.testing.assert_array_equal(t.local(0), np.ones((4, 2)))   # dp index 0 holds the value
    np.testing.assert_array_equal(t.local(4), np.zeros((4, 2)))  # the other dp row holds zeros
    np.testing.assert_array_equal(t.numpy(), np.ones((4, 8)))
    m = dist.shard_tensor(np.full((4, 8), 3.0, np.float32), MESH, ["P(max)", "P(max)"])
    expected = NamedSharding(MESH.to_jax(), P(("dp", "mp"), None, None))
    assert m.physical.sharding.is_equivalent_to(expected, 3)
    assert m.physical.shape == (8, 4, 8)
    np.testing.assert_array_equal(m.numpy(), np.full((4, 8), 3.0))


def test_dtensor_from_fn_never_builds_the_global_tensor_on_one_device():
    t = dist.dtensor_from_fn(jnp.ones, MESH, [dist.Shard(0), dist.Shard(1)], (8, 16))
    assert {tuple(s.data.shape) for s in t.physical.addressable_shards} == {(4, 4)}
    np.testing.assert_array_equal(t.numpy(), np.ones((8, 16)))
    key = jax.random.key(0)
    r = dist.dtensor_from_fn(jax.random.normal, MESH, ["S(0)", "R"], key, (8, 4))
    np.testing.assert_allclose(r.numpy(), np.asarray(jax.random.normal(key, (8, 4))), rtol=1e-6)
    p = dist.dtensor_from_fn(jnp.arange, MESH, ["R", "P(sum)"], 8.0)
    np.testing.assert_array_equal(logical_value(p), np.arange(8.0))


def test_dtensor_from_local_list_function_and_partial():
    blocks = [np.full((2, 3), i, np.float32) for i in range(8)]
    t = dist.dtensor_from_local(blocks, MESH, [dist.Shard(0), dist.Shard(0)])
    assert t.shape == (16, 3)
    np.testing.assert_array_equal(t.numpy(), np.repeat(np.arange(8.0), 2)[:, None] * np.ones((1, 3)))
    # partial: per-device values differ, the logical value is their sum over 'mp'
    p = dist.dtensor_from_local(lambda c: np.full((4,), c[1] + 1.0, np.float32), MESH,
                                [dist.Shard(0), dist.Partial()])
    assert p.shape == (8,) and p.placements == [dist.Shard(0), dist.Partial()]
    np.testing.assert_array_equal(p.numpy(), np.full((8,), 1.0 + 2 + 3 + 4))
    np.testing.assert_array_equal(p.local(6), np.full((4,), 3.0))
    same = dist.dtensor_from_local(np.arange(4.0), MESH, ["R", "R"])
    np.testing.assert_array_equal(same.numpy(), np.arange(4.0))


@pytest.mark.parametrize("placements", [["S(0)", "S(1)"], ["S(1)", "S(0)"], ["R", "S(0)"],
                                        ["S(0)", "S(0)"], ["P", "S(1)"]])
def test_dtensor_from_local_inverts_dtensor_to_local_of_an_uneven_tensor(placements):
    # 7 x 5 over a 2 x 3 mesh: blocks of ceil(size / devices) rows, the last ones short or empty
    mesh = dist.ProcessMesh([[0, 1, 2], [3, 4, 5]], ["a", "b"])
    value = np.arange(35, dtype=np.float32).reshape(7, 5)
    y = dist.shard_tensor(value, mesh, placements)
    blocks = dist.dtensor_to_local(y)
    assert len({tuple(b.shape) for b in blocks}) > 1
    z = dist.dtensor_from_local(blocks, mesh, placements)
    assert z.shape == (7, 5) and z.placements == y.placements
    np.testing.assert_array_equal(z.numpy(), value)
    for a, b in zip(dist.dtensor_to_local(z), blocks):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # one block that is not what its device holds in any such split
    blocks[0] = blocks[0][:1]
    with pytest.raises(dist.LocalDataError, match=r"mesh coords \(0, [01]\) \(id [01]\) is float32"):
        dist.dtensor_from_local(blocks, mesh, placements)


@pytest.mark.parametrize("placements", [["S(0)", "S(1)"], ["R", "S(0)"]])
def test_dtensor_from_local_inverts_dtensor_to_local_of_uneven_prng_keys(placements):
    # keys have no zero to pad a short block with: they pad as their key data, as shard_tensor
    # pads them (was jax's ValueError 'Cannot convert_element_type from int32 to key<fry>')
    mesh = dist.ProcessMesh([[0, 1, 2], [3, 4, 5]], ["a", "b"])
    keys = jax.random.split(jax.random.key(0), 35).reshape(7, 5)
    blocks = dist.dtensor_to_local(dist.shard_tensor(keys, mesh, placements))
    z = dist.dtensor_from_local(blocks, mesh, placements)
    assert z.shape == (7, 5) and z.placements == [dist.parse_placement(p) for p in placements]
    np.testing.assert_array_equal(jax.random.key_data(dist.unshard_dtensor(z)),
                                  jax.random.key_data(keys))
    with pytest.raises(dist.PlacementError, match=r"PRNG keys placed \[P\(sum\), S\(0\)\]"):
        dist.dtensor_from_local(blocks, mesh, ["P", "S(0)"])


def test_numpy_of_prng_keys_is_a_typed_error_naming_their_key_data():
    # was jax's raw TypeError, whose jax.random.key_data(x) fails on a DistTensor
    keys = jax.random.split(jax.random.key(0), 8)
    x = dist.shard_tensor(keys, MESH, [dist.Shard(0), dist.Replicate()])
    for read in (lambda: x.numpy(), lambda: np.asarray(x)):
        with pytest.raises(dist.OperandError, match=r"typed PRNG keys \(key<fry>, shape \[8\]\) "
                           r"has no numpy value: .*dist.jit\(jax.random.key_data\)\(x\).numpy"):
            read()
    np.testing.assert_array_equal(dist.jit(jax.random.key_data)(x).numpy(),
                                  jax.random.key_data(keys))


def test_a_value_its_dtype_cannot_hold_is_a_placement_type_error():
    # numpy's OverflowError came through raw
    with pytest.raises(dist.PlacementTypeError, match="out of bounds for int8"):
        dist.shard_tensor([300], MESH, ["R", "R"], dtype=np.int8)
    np.testing.assert_array_equal(
        dist.shard_tensor([100, -3], MESH, ["S(0)", "R"], dtype=np.int8).numpy(),
        np.array([100, -3], np.int8))


def test_dtensor_from_local_errors():
    with pytest.raises(dist.LocalDataError, match="got 3 blocks for a mesh of 8 devices"):
        dist.dtensor_from_local([np.zeros(2)] * 3, MESH, ["S(0)", "R"])
    with pytest.raises(dist.LocalDataError, match=r"mesh coords \(0, 1\) \(id 1\) is float32\[3\]"):
        dist.dtensor_from_local(lambda c: np.zeros(3 if c == (0, 1) else 2, np.float32), MESH, ["S(0)", "R"])


def test_unshard_and_local_errors():
    t = dist.shard_tensor(np.arange(16.0).reshape(4, 4), MESH, ["S(0)", "P(sum)"])
    full = dist.unshard_dtensor(t)
    assert isinstance(full, jax.Array)
    assert full.sharding.is_equivalent_to(NamedSharding(MESH.to_jax(), P()), 2)
    assert set(full.sharding.device_set) == set(MESH.to_jax().devices.flat)
    np.testing.assert_array_equal(full, np.arange(16.0).reshape(4, 4))
    with pytest.raises(dist.DeviceNotFoundError, match="device 9 is not in this tensor's mesh"):
        t.local(9)


def test_pytree_and_jit_passthrough():
    t = dist.shard_tensor(np.arange(8.0), MESH, ["S(0)", "R"])
    leaves, tree = jax.tree.flatten({"w": t})
    assert len(leaves) == 1 and leaves[0] is t.physical
    back = jax.tree.unflatten(tree, leaves)["w"]
    assert isinstance(back, dist.DistTensor) and back.placements == t.placements
    doubled = jax.jit(lambda d: jax.tree.map(lambda v: v * 2, d))(t)
    assert isinstance(doubled, dist.DistTensor)
    np.testing.assert_array_equal(doubled.numpy(), np.arange(8.0) * 2)


def test_repr_and_html_show_mesh_placements_and_blocks():
    t = dist.shard_tensor(SEED_VALUE, SEED_MESH, [dist.Shard(0), dist.Shard(1)])
    text = repr(t)
    assert "placements=[S(0), S(1)]" in text and "local_shape=(2, 1)" in text
    assert "[[2, 4, 5], [0, 1, 3]]" in text
    html = t._repr_html_()
    assert html.count("<td") == 6 and "dev 2<br>[0:2, 0:1]" in html and "dev 3<br>[2:4, 2:3]" in html
    table = dist.placement_table(t)
    assert "device   3 (x=1, y=2): block [2:4, 2:3]" in table
    cube = dist.shard_tensor(np.zeros((4, 4)), dist.ProcessMesh(np.arange(8).reshape(2, 2, 2)),
                             ["S(0)", "R", "P(sum)"])
    assert cube._repr_html_().count("<table") == 2


def test_tree_map_pairs_tensors_split_differently_and_says_how_the_result_is_laid_out():
    """As jax.tree.map pairs jax.Arrays of different shardings, it pairs a param with a grad
    placed otherwise (an eager `p - lr * g`, optax.apply_updates outside a program); the
    result is described by how it is actually stored."""
    R, S = dist.Replicate(), dist.Shard
    w = np.arange(32, dtype=np.float32).reshape(4, 8)
    params = {"w": dist.shard_tensor(w, MESH, [R, S(1)])}
    grads = {"w": dist.shard_tensor(np.ones_like(w), MESH, [S(0), R])}
    for new in (jax.tree.map(lambda p, g: p - 0.5 * g, params, grads),
                jax.tree.map(lambda g, p: p - 0.5 * g, grads, params)):
        np.testing.assert_array_equal(new["w"].numpy(), w - 0.5)
        assert new["w"].physical.sharding.spec == new["w"].sharding.spec
    # jax.jit over trees of the two layouts: one trace, each result described as stored
    double = jax.jit(lambda t: jax.tree.map(lambda x: x * 2, t))
    for t in (params, grads):
        out = double(t)["w"]
        np.testing.assert_array_equal(out.numpy(), 2 * np.asarray(t["w"].numpy()))
        assert out.physical.sharding.spec == out.sharding.spec


@pytest.mark.parametrize("kinds", [("max", "max"), ("avg", "sum")])
def test_partial_tensors_of_other_kinds_are_other_tree_structures(kinds):
    """Partial slots mean what their reduce kind says: a jax.jit traced for a P(max) tensor
    is not reused for P(avg)/P(sum) ones of the same stored shape."""
    from autoshard.testing import make_tensor

    value = np.random.default_rng(4).normal(size=(8, 4)).astype(np.float32)
    relu = jax.jit(jax.nn.relu)
    for k in (("max", "max"), kinds):
        x = make_tensor(value, MESH, [f"P({k[0]})", f"P({k[1]})"])
        np.testing.assert_allclose(np.asarray(relu(x)), np.maximum(value, 0), rtol=1e-6)


@pytest.mark.parametrize("fn", [lambda x: x + 1, lambda x: x * x, jnp.exp, lambda x: x * 2],
                         ids=["plus one", "square", "exp", "double"])
@pytest.mark.parametrize("mesh,placements", [
    (MESH, ["P(sum)", "S(1)"]), (MESH, ["P(avg)", "P(sum)"]), (MESH, ["S(0)", "P(max)"]),
    (MESH, ["P(min)", "R"]), (dist.ProcessMesh(list(range(8)), ["x"]), ["P(sum)"]),
    (dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["a", "b", "c"]),
     ["S(0)", "P(max)", "P(max)"])], ids=["2d-sum", "2d-avg-sum", "2d-max", "2d-min", "1d-sum",
                                           "3d-max"])
def test_tree_map_over_a_partial_tensor_maps_its_value(mesh, placements, fn):
    """jax.tree.map hands its function a Partial tensor's value, reduced — not its pending
    parts, whose `x + 1` summed would add one per part: the same numbers as one device, eager
    and under jax.jit, placed without the Partial."""
    from autoshard.testing import make_tensor

    value = np.random.default_rng(7).normal(size=(4, 8)).astype(np.float32)
    t = make_tensor(value, mesh, placements)
    want = np.asarray(fn(value))
    for mapped in (jax.tree.map(fn, {"w": t})["w"],
                   jax.jit(lambda tree: jax.tree.map(fn, tree))({"w": t})["w"]):
        assert isinstance(mapped, dist.DistTensor) and not mapped.layout.partial
        np.testing.assert_allclose(mapped.numpy(), want, rtol=1e-5, atol=1e-6)
    assert [repr(p) for p in t.placements] == placements  # t itself is left as it was
    t[0] = 5.0  # written in place: mapped again, the new value
    value[0] = 5.0
    np.testing.assert_allclose(jax.tree.map(fn, t).numpy(), np.asarray(fn(value)), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("placements", [["R", "S(1)"], ["R", "S(0)"], ["P(avg)", "P(sum)"]],
                         ids=["even", "uneven", "partial"])
def test_tree_map_to_descriptions_and_host_values(placements):
    """What a user maps params to when looking at them: `jax.device_get(params)` and
    `jax.tree.map(np.asarray, params)` give one device's numpy values (padding dropped, Partial
    slots reduced), sizes are ints and dtypes dtypes — not DistTensors wrapping them. Other
    objects keep the node: orbax zips trees of names and SaveArgs with the params."""
    from autoshard.testing import make_tensor

    value = np.random.default_rng(5).normal(size=(6, 8)).astype(np.float32)
    t = make_tensor(value, MESH, placements)
    # (a Partial tensor's leaf is its value, reduced: only padding is storage the leaf shows)
    padded = t.physical.shape != value.shape and not t.layout.partial
    for host in (jax.device_get({"w": t})["w"], jax.tree.map(np.asarray, {"w": t})["w"]):
        assert type(host) is np.ndarray
        np.testing.assert_allclose(host, value, rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sizes = jax.tree.map(lambda x: x.size, {"w": t})
        dtypes = jax.tree.map(lambda x: x.dtype, {"w": t})
        masks = jax.tree.map(lambda x: x.ndim > 1, {"w": t})  # optax's weight-decay masks
    assert type(sizes["w"]) is int and dtypes["w"] == np.float32 and masks["w"] is True
    # the size was counted on the storage: said so where that is not the logical size (once:
    # a mask, decided by the rank, is not warned of)
    assert sizes["w"] == (value.size if t.layout.partial else t.physical.size)
    assert len(seen) == padded
    assert all(issubclass(w.category, dist.StorageViewWarning) and
               "test_dtensor.py" in str(w.message) for w in seen)
    names = jax.tree.map(lambda x: "w", {"w": t})
    assert isinstance(names["w"], dist.DistTensor) and "dtype=?" in repr(names["w"])
    assert jax.tree.structure(names) == jax.tree.structure({"w": t})


@pytest.mark.parametrize("kind", ["max", "min"])
def test_a_complex_tensor_placed_partial_max_or_min_is_a_placement_error(kind):
    """Complex numbers have no order: Partial(max) / Partial(min) of them is refused where it
    is asked for (it was accepted, then failed deep in XLA's runtime when read: 'Unsupported
    reduction computation'); Partial(sum) / (avg) of them are values as usual."""
    mesh = dist.ProcessMesh(list(range(8)), dim_names=["x"])
    x = np.array([1 + 2j, 3 - 1j], np.complex64)
    with pytest.raises(dist.PlacementError, match=rf"complex64\[2\] is complex, placed "
                                                  rf"Partial\({kind}\): complex numbers have no "
                                                  rf"order"):
        dist.shard_tensor(x, mesh, [dist.Partial(kind)])
    t = dist.shard_tensor(x, mesh, [dist.Replicate()])
    with pytest.raises(dist.PlacementError, match=rf"placed Partial\({kind}\)"):
        dist.reshard(t, mesh, [dist.Partial(kind)])
    for ok in ("sum", "avg"):
        np.testing.assert_allclose(dist.shard_tensor(x, mesh, [dist.Partial(ok)]).numpy(), x)


@pytest.mark.parametrize("dtype", ["int4", "uint4", "int8", "uint8"])
def test_a_partial_avg_of_narrow_integers_is_their_value(dtype):
    """Partial(avg) of ml_dtypes' int4 / uint4 parts is exact as of numpy's integers (the
    parts were summed in int4 before dividing, wrapping around: -3 read back as -1)."""
    import jax.numpy as jnp

    mesh = dist.ProcessMesh(list(range(8)), dim_names=["x"])
    low, high = (-8, 7) if dtype.startswith("int") and "4" in dtype else (
        (0, 15) if dtype == "uint4" else ((-128, 127) if dtype == "int8" else (0, 255)))
    x = np.arange(low, high + 1).astype(jnp.dtype(dtype))
    t = dist.shard_tensor(x, mesh, [dist.Partial("avg")])
    np.testing.assert_array_equal(np.asarray(t.numpy()).astype(np.int32), x.astype(np.int32))


def test_a_lax_map_over_an_unevenly_stored_tensor_is_named_and_dist_jit_maps_the_rows():
    """jax.lax.map takes a DistTensor as a pytree: it maps the stored rows (12 over 8 devices:
    16, padded). The warning names lax.map and says what to write; under dist.jit the map
    runs over the logical rows, as on one device (found by a probe)."""
    mesh = dist.ProcessMesh(list(range(8)), dim_names=["x"])
    value = np.arange(12, dtype=np.float32) - 3
    t = dist.shard_tensor(value, mesh, [dist.Shard(0)])
    assert t.physical.shape == (16,)
    with pytest.warns(dist.StorageViewWarning, match=r"jax\.lax\.map.*dist\.jit\(lambda x: "
                                                     r"jax\.lax\.map\(f, x\)\)\(x\)"):
        jax.lax.map(lambda r: r * 2, t)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dist.UnevenShardingWarning)
        got = dist.jit(lambda x: jax.lax.map(lambda r: r * 2, x))(t)
    assert got.shape == (12,)
    np.testing.assert_array_equal(np.asarray(got.numpy()), value * 2)
