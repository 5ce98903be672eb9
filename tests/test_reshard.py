"""Every reshard equals numpy, and compiles to exactly the collectives the plan lists."""
from __future__ import annotations

import itertools
import random
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard as dist
from autoshard.errors import PlacementError
from autoshard.hlo import count_collectives
from autoshard.dtensor import DistTensor
from autoshard.physical import physical_sharding, physical_spec
from autoshard.reshard.execute import compiled_hlo

from autoshard.testing import logical_value, make_tensor
from hypothesis import HealthCheck, given, settings, strategies as st

MESHES = {
    "8": ([0, 1, 2, 3, 4, 5, 6, 7], ["x"]),
    "2x4": ([[0, 1, 2, 3], [4, 5, 6, 7]], ["x", "y"]),
    "4x2": ([[7, 6], [5, 4], [3, 2], [1, 0]], ["x", "y"]),
    "2x2x2": ([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["x", "y", "z"]),
}
OPTIONS = ["R", "S(0)", "S(1)", "P(sum)", "P(max)"]
SAMPLES_PER_MESH = 150  # of 625 (2-d) and 15625 (3-d) pairs; the 1-d mesh runs all 25
SHAPE = (8, 16)


def _valid(placements) -> bool:
    kinds = {p for p in placements if p.startswith("P")}
    return len(kinds) <= 1


def _pairs(name):
    ndim = len(MESHES[name][1])
    lists = [p for p in itertools.product(OPTIONS, repeat=ndim) if _valid(p)]
    pairs = list(itertools.product(lists, lists))
    if len(pairs) > SAMPLES_PER_MESH:
        pairs = random.Random(f"reshard-{name}").sample(pairs, SAMPLES_PER_MESH)
    return [pytest.param(name, list(a), list(b), id=f"{name}:{','.join(a)}->{','.join(b)}")
            for a, b in pairs]


CASES = [case for name in MESHES for case in _pairs(name)]


def _value(shape=SHAPE, dtype=np.float32):
    return np.arange(np.prod(shape), dtype=dtype).reshape(shape) - 40


def check_reshard(src: dist.DistTensor, mesh, placements, expected: np.ndarray):
    plan = dist.plan_reshard(src, mesh, placements)
    out = dist.reshard(src, mesh, placements)
    assert out.mesh == dist.ProcessMesh(mesh.id_array, mesh.dim_names)
    assert [repr(p) for p in out.placements] == [
        repr(p) for p in dist.reshard(out, mesh, placements).placements]
    np.testing.assert_array_equal(logical_value(out), expected)
    hlo = Counter()
    for text in compiled_hlo(plan, src.physical):
        hlo += count_collectives(text)
    assert hlo == Counter(plan.collectives), (str(plan), hlo)
    return plan, out


@pytest.mark.parametrize("mesh_name,src,dst", CASES)
def test_reshard_matrix(mesh_name, src, dst):
    mesh = dist.ProcessMesh(*MESHES[mesh_name])
    value = _value()
    x = make_tensor(value, mesh, src, seed=hash((mesh_name, tuple(src))) % 1000)
    np.testing.assert_array_equal(logical_value(x), value)
    _, out = check_reshard(x, mesh, dst, value)
    assert [repr(p) for p in out.placements] == [repr(dist.parse_placement(p)) for p in dst]


@pytest.mark.parametrize("reduce_type", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("dst", [["R", "R"], ["S(0)", "R"], ["R", "S(1)"], ["S(1)", "S(0)"]])
def test_every_partial_kind_reduces(reduce_type, dst):
    mesh = dist.ProcessMesh(*MESHES["2x4"])
    value = _value()
    x = make_tensor(value, mesh, [f"P({reduce_type})", "S(0)"], seed=3)
    check_reshard(x, mesh, dst, value)


@pytest.mark.parametrize("reduce_type", ["sum", "avg", "max", "min"])
def test_to_partial_of_every_kind(reduce_type):
    mesh = dist.ProcessMesh(*MESHES["2x4"])
    value = _value()
    for src in (["R", "R"], ["S(0)", "S(1)"]):
        x = dist.shard_tensor(value, mesh, src)
        plan, _ = check_reshard(x, mesh, [f"P({reduce_type})", "S(1)"], value)
        # R→P and S→P are local: no collective, no bytes.
        assert plan.collectives == [] and plan.total_bytes == 0, str(plan)


def test_mixed_sum_and_avg_partial():
    mesh = dist.ProcessMesh(*MESHES["2x4"])
    value = _value()
    x = make_tensor(value, mesh, ["P(sum)", "P(avg)"], seed=5)
    check_reshard(x, mesh, ["S(0)", "R"], value)


def test_mixed_nonlinear_partial_is_rejected():
    mesh = dist.ProcessMesh(*MESHES["2x4"])
    with pytest.raises(PlacementError, match="one kind of reduction"):
        dist.shard_tensor(_value(), mesh, [dist.Partial("sum"), dist.Partial("max")])


# -- what the planner prefers ---------------------------------------------------------------

def _plan_kinds(src, dst, mesh_name="2x4", shape=SHAPE):
    mesh = dist.ProcessMesh(*MESHES[mesh_name])
    x = make_tensor(_value(shape), mesh, src)
    return [s.kind for s in dist.plan_reshard(x, mesh, dst).steps]


@pytest.mark.parametrize("src,dst,kinds", [
    (["S(0)"], ["R"], ["all_gather"]),
    (["P(sum)"], ["R"], ["all_reduce"]),
    (["P(sum)"], ["S(1)"], ["reduce_scatter"]),        # not psum + slice
    (["S(0)"], ["S(1)"], ["all_to_all"]),              # not all_gather + slice
    (["R"], ["S(1)"], ["slice"]),
    (["R"], ["P(sum)"], ["to_partial"]),
    (["S(0)"], ["P(sum)"], ["shard_to_partial"]),
    (["P(max)"], ["S(0)"], ["all_reduce", "slice"]),    # no reduce-scatter for max
])
def test_planner_prefers_single_collectives(src, dst, kinds):
    assert _plan_kinds(src, dst, "8") == kinds


def test_multi_axis_collectives_are_merged():
    # Gathering a co-sharded dim, or reducing two partial axes, is one collective each.
    assert _plan_kinds(["S(0)", "S(0)"], ["R", "R"]) == ["all_gather"]
    assert _plan_kinds(["P(sum)", "P(sum)"], ["R", "R"]) == ["all_reduce"]
    assert _plan_kinds(["P(sum)", "P(sum)"], ["S(0)", "S(0)"]) == ["reduce_scatter"]


def test_plan_reports_bytes_per_device_and_is_cached():
    mesh = dist.ProcessMesh(*MESHES["8"])
    x = dist.shard_tensor(_value(), mesh, ["S(0)"])
    plan = dist.plan_reshard(x, mesh, ["R"])
    full = 8 * 16 * 4
    assert plan.steps[0].bytes_per_device == full * 7 // 8
    assert plan.total_bytes == full * 7 // 8
    assert dist.plan_reshard(x, mesh, [dist.Replicate()]) is plan
    assert "all_gather(x) dim 0" in str(plan) and "448 B/device" in str(plan)


def test_cost_model_is_overridable_and_changes_the_choice():
    # With collectives made very expensive on 'y', the planner avoids a collective over it.
    mesh = dist.ProcessMesh(*MESHES["2x4"])
    x = make_tensor(_value(), mesh, ["P(sum)", "P(sum)"])
    cheap = dist.plan_reshard(x, mesh, ["R", "R"])
    assert [s.kind for s in cheap.steps] == ["all_reduce"]
    slow_y = dist.CostModel(latency={"y": 1.0})
    plan = dist.plan_reshard(x, mesh, ["R", "R"], cost_model=slow_y)
    assert plan.seconds >= 1.0 and plan is not cheap
    assert dist.default_cost_model() == dist.CostModel()


def test_identity_reshard_is_free():
    mesh = dist.ProcessMesh(*MESHES["2x4"])
    x = dist.shard_tensor(_value(), mesh, ["S(0)", "S(1)"])
    assert dist.plan_reshard(x, mesh, ["S(0)", "S(1)"]).steps == ()
    y = dist.reshard(x, mesh, ["S(0)", "S(1)"])
    assert y.physical is x.physical  # the same buffers, nothing moved (a tensor of its own)


def test_co_shard_orders():
    mesh = dist.ProcessMesh(*MESHES["2x2x2"])
    value = _value()
    for src, dst in [(["S(0)", "S(0)", "S(0)"], ["S(1)", "S(1)", "S(1)"]),
                     (["S(0)", "R", "S(0)"], ["R", "S(0)", "S(0)"]),
                     (["R", "S(0)", "R"], ["S(0)", "S(0)", "R"]),
                     (["P(sum)", "S(0)", "P(sum)"], ["S(0)", "S(0)", "S(0)"])]:
        check_reshard(make_tensor(value, mesh, src), mesh, dst, value)


def test_scalars_and_other_dtypes():
    mesh = dist.ProcessMesh(*MESHES["2x4"])
    s = make_tensor(np.array(7.0, np.float32), mesh, ["P(sum)", "R"])
    check_reshard(s, mesh, ["R", "R"], np.array(7.0, np.float32))
    ints = np.arange(64, dtype=np.int32).reshape(8, 8)
    check_reshard(make_tensor(ints, mesh, ["P(max)", "S(1)"]), mesh, ["S(1)", "S(0)"], ints)
    bools = (np.arange(64).reshape(8, 8) % 3 == 0)
    check_reshard(dist.shard_tensor(bools, mesh, ["S(0)", "S(1)"]), mesh, ["S(1)", "R"], bools)


def test_prng_keys_move_between_placements_and_meshes_as_their_key_data():
    count = 5  # over 4 devices: stored padded
    import jax

    keys = jax.random.split(jax.random.key(0), (count, 4))
    data = np.asarray(jax.random.key_data(keys))
    m24 = dist.ProcessMesh(*MESHES["2x4"])
    m4 = dist.ProcessMesh([0, 1, 2, 3], ["x"])
    m2 = dist.ProcessMesh([[7], [6]], ["a", "b"])
    t = dist.shard_tensor(keys, m4, ["S(0)"])
    for mesh, placements in [(m4, ["S(0)"]), (m4, ["S(1)"]), (m24, ["R", "R"]),
                             (m24, ["S(0)", "S(1)"]), (m24, ["S(1)", "S(1)"]), (m2, ["S(0)", "R"]),
                             (m4, ["R"])]:
        t = dist.reshard(t, mesh, placements)
        assert jax.dtypes.issubdtype(t.dtype, jax.dtypes.prng_key) and t.mesh == mesh
        np.testing.assert_array_equal(jax.random.key_data(dist.unshard_dtensor(t)), data)
        for d in mesh.process_ids:
            rows = tuple(slice(*b) for b in t.block_bounds(d))
            np.testing.assert_array_equal(jax.random.key_data(t.local(d)), data[rows])
    # a key has no sum, mean, max or min to be pending
    for make in (lambda: dist.reshard(t, m4, ["P(sum)"]),
                 lambda: dist.shard_tensor(keys, m4, ["P(max)"])):
        with pytest.raises(PlacementError, match="PRNG keys placed"):
            make()


@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("dst", [["R", "R"], ["S(0)", "R"], ["R", "S(1)"]])
def test_a_nan_wins_a_max_or_min_reduction_as_on_one_device(kind, dst):
    # XLA's all-reduce max / min drops a NaN (on CPU); one device's jnp.max keeps it
    mesh = dist.ProcessMesh(*MESHES["2x4"])
    value = _value()
    value[3, 5], value[6, 0] = np.nan, -np.inf if kind == "max" else np.inf
    check_reshard(make_tensor(value, mesh, [f"P({kind})", "S(1)"]), mesh, dst, value)


NARROW = {"e4m3fn": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2, "e4m3fnuz": jnp.float8_e4m3fnuz,
          "e5m2fnuz": jnp.float8_e5m2fnuz, "e4m3b11fnuz": jnp.float8_e4m3b11fnuz,
          "f4e2m1fn": jnp.float4_e2m1fn, "int4": jnp.int4, "uint4": jnp.uint4}


@pytest.mark.parametrize("name", list(NARROW))
def test_float8_4bit_and_int4_values_reduce_over_devices_as_on_one_device(name):
    """A max / min over devices of float8 keeps a NaN (the fnuz kinds, NaN at 0x80, read back
    their largest finite number), and 4-bit floats and int4 / uint4 reduce at all (a bitcast to
    int8 and numpy's iinfo failed) — an int4 mean as an integer mean (it wrapped); found by a
    probe. Values equal one device's jnp.max / min."""
    dtype = NARROW[name]
    mesh = dist.ProcessMesh(list(range(8)), ["x"])
    small = np.array([0.5, 1, 1.5, 2, 3, 4, 6, -1], np.float32)
    if jnp.issubdtype(dtype, jnp.integer):
        small = np.arange(8, dtype=np.float32) - (7 if name == "int4" else 0)
    value = np.resize(small, (8, 8)).T.astype(dtype)
    has_nan = jnp.issubdtype(dtype, jnp.floating) and not name.startswith("f4")
    if has_nan:
        value[5, 2] = np.nan
    x = dist.shard_tensor(value, mesh, [dist.Shard(0)])
    for reduce in (jnp.max, jnp.min):
        got = dist.jit(lambda a: reduce(a, axis=0))(x).numpy()
        want = np.asarray(jax.jit(lambda a: reduce(a, axis=0))(value))
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    for kind in ("max", "min", "avg"):
        if kind == "avg" and jnp.issubdtype(dtype, jnp.floating):
            continue
        got = dist.reshard(x, mesh, [dist.Partial(kind)]).numpy()
        np.testing.assert_array_equal(got.astype(np.float32), value.astype(np.float32))
    if has_nan:
        part = dist.shard_tensor(value, mesh, [dist.Partial("max")])
        assert np.isnan(dist.reshard(part, mesh, [dist.Replicate()]).numpy()[5, 2].astype(np.float32))


def test_a_float_without_zero_placed_partial_sum_is_an_error():
    """float8_e8m0fnu (MX block scales) has no zero, which the other devices' parts of a
    Partial(sum) are: it read back all NaN (found by a probe); a typed error now, and
    Partial(avg) (every part the value) reads back."""
    mesh = dist.ProcessMesh(list(range(8)), ["x"])
    value = np.resize(np.array([0.25, 0.5, 1, 2], np.float32), (8, 4)).astype(jnp.float8_e8m0fnu)
    with pytest.raises(PlacementError, match=r"float8_e8m0fnu, placed Partial\(sum\) over 'x': "
                                             r"the type has no zero"):
        dist.shard_tensor(value, mesh, [dist.Partial("sum")])
    got = dist.shard_tensor(value, mesh, [dist.Partial("avg")]).numpy()
    np.testing.assert_array_equal(got.astype(np.float32), value.astype(np.float32))


@pytest.mark.parametrize("kind", ["sum", "avg"])
def test_truth_values_and_integers_reduce_in_their_dtype(kind):
    # a pending sum of truth values reads as their `or`, a mean of integers stays an integer
    mesh = dist.ProcessMesh(*MESHES["2x4"])
    bools = np.arange(64).reshape(8, 8) % 3 == 0
    x = dist.shard_tensor(bools, mesh, [dist.Partial(kind), dist.Shard(0)])
    assert x.numpy().dtype == np.bool_
    np.testing.assert_array_equal(x.numpy(), bools)
    for dst in (["R", "S(0)"], ["S(1)", "S(0)"]):
        out = dist.reshard(x, mesh, dst)
        assert out.dtype == np.bool_ and out.numpy().dtype == np.bool_
        np.testing.assert_array_equal(out.numpy(), bools)
    ints = np.arange(64, dtype=np.int32).reshape(8, 8)
    y = dist.shard_tensor(ints, mesh, [dist.Partial(kind), dist.Replicate()])
    for got in (y.numpy(), np.asarray(jnp.asarray(y)), dist.reshard(y, mesh, ["R", "R"]).numpy()):
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, ints)


@pytest.mark.parametrize("dtype", [np.uint8, np.int32])
def test_a_mean_of_integer_parts_does_not_overflow_their_dtype(dtype):
    # uint8 parts 200 and 255 sum past 255 (jax's own pmean wraps: 200 reads as 8); the parts'
    # quotients and remainders are summed apart, and the mean truncates toward zero as a float
    # mean cast back does
    mesh = dist.ProcessMesh(*MESHES["2x4"])
    info = np.iinfo(dtype)
    value = np.array([[info.max, info.max - 55, info.min, info.min + 5, 3, 0, -1 % (info.max + 1),
                       7]] * 8, dtype)
    x = dist.shard_tensor(value, mesh, ["P(avg)", "R"])
    np.testing.assert_array_equal(x.numpy(), value)
    np.testing.assert_array_equal(np.asarray(jnp.asarray(x)), value)
    for dst in (["R", "R"], ["S(1)", "R"], ["S(0)", "S(1)"]):
        np.testing.assert_array_equal(dist.reshard(x, mesh, dst).numpy(), value)
    # parts that differ: their mean, truncated toward zero
    parts = [np.full((8, 8), info.max - k, dtype) if k % 2 else np.full((8, 8), info.min + k, dtype)
             for k in range(8)]
    y = dist.dtensor_from_local(parts, mesh, ["P(avg)", "P(avg)"])
    want = np.trunc(np.mean(np.stack(parts).astype(np.float64), axis=0)).astype(dtype)
    np.testing.assert_array_equal(y.numpy(), want)
    np.testing.assert_array_equal(dist.reshard(y, mesh, ["R", "S(0)"]).numpy(), want)
    # a split tensor made a pending mean goes through its gathered copy (n times a shard on its
    # owner would overflow), and back
    z = dist.reshard(dist.shard_tensor(value, mesh, ["S(1)", "R"]), mesh, ["P(avg)", "R"])
    np.testing.assert_array_equal(z.numpy(), value)
    # inside a program: the plan lists the remainders' sum too, as the compiled program runs it
    f = dist.jit(lambda t: t // 2, out_placements=["S(1)", "R"])
    np.testing.assert_array_equal(f(x).numpy(), value // 2)
    hlo = f.lower(x).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in f.plan(x).collectives)
    assert len(f.plan(x).collectives) == 2
    # and plan_reshard lists what the eager move runs: the remainders' collective, its bytes
    for dst in (["R", "R"], ["S(0)", "R"]):
        rp = dist.plan_reshard(x, mesh, dst)
        moved = dist.jit(lambda t: dist.reshard(t, mesh, dst))
        hlo = moved.lower(x).compile().as_text()
        assert Counter(rp.collectives) == count_collectives(hlo) == Counter(
            c.kind for c in moved.plan(x).collectives)
        assert rp.total_bytes == moved.plan(x).total_bytes and "int32 remainders" in str(rp)


@pytest.mark.parametrize("mesh_shape, src, dst", [
    ((2, 2), ["P(avg)", "P(avg)"], ["R", "P(avg)"]),
    ((2, 2), ["P(avg)", "P(avg)"], ["P(avg)", "R"]),
    ((2, 2), ["P(avg)", "P(avg)"], ["S(0)", "P(avg)"]),
    ((2, 2), ["P(avg)", "P(avg)"], ["P(avg)", "S(0)"]),
    ((2, 2, 2), ["P(avg)", "P(avg)", "P(avg)"], ["R", "P(avg)", "R"]),
    ((2, 2, 2), ["P(avg)", "P(avg)", "P(avg)"], ["P(avg)", "P(avg)", "S(0)"]),
    # a pending sum beside the mean: summed first (a sum of truncated means is not the mean)
    ((2, 2), ["P(sum)", "P(avg)"], ["P(sum)", "R"]),
    ((2, 2), ["P(avg)", "P(sum)"], ["P(sum)", "R"]),
    ((2, 2), ["P(sum)", "P(avg)"], ["R", "P(sum)"]),
    ((2, 2, 2), ["P(sum)", "P(avg)", "P(avg)"], ["P(sum)", "R", "S(1)"]),
])
def test_an_integer_mean_pending_over_several_axes_is_reduced_over_all_at_once(mesh_shape, src,
                                                                                dst):
    """A mean of integers truncates: the mean of some parts' means is not the mean of all
    ((1 + 0) // 2 = 0 and (0 + 3) // 2 = 1 give 0, where (1 + 0 + 0 + 3) // 4 is 1), nor is a
    sum of means the mean of the sum. A target that keeps some axes pending reduces the sum,
    then the mean over every axis, and makes those pending again (the planner offered a mean
    over the dropped axes alone: 0 read back), eagerly and in dist.jit; jax's view of it
    (`jnp.asarray`) is the same value."""
    n = int(np.prod(mesh_shape))
    mesh = dist.ProcessMesh(np.arange(n).reshape(mesh_shape).tolist(),
                            ["a", "b", "c"][:len(mesh_shape)])
    rng = np.random.default_rng(n + len(dst))
    parts = [rng.integers(0, 7, size=(4, 2)).astype(np.int32) for _ in range(n)]
    parts[0][0, 0], parts[1][0, 0], parts[2][0, 0], parts[3][0, 0] = 1, 0, 0, 3
    x = dist.dtensor_from_local(parts, mesh, src)
    averaged = int(np.prod([k for k, p in zip(mesh_shape, src) if p == "P(avg)"]))
    want = np.sum(np.stack(parts), axis=0) // averaged  # nonnegative: truncation is the floor
    np.testing.assert_array_equal(x.numpy(), want)
    got = dist.reshard(x, mesh, dst)
    assert [str(p) for p in got.placements] == dst
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(dist.jit(lambda t: t, out_placements=dst)(x).numpy(), want)
    # jax reads the same value (__jax_array__ reduced the slots one mesh axis at a time)
    np.testing.assert_array_equal(np.asarray(jnp.asarray(x)), want)
    np.testing.assert_array_equal(np.asarray(jnp.concatenate([x, x]))[:4], want)


@pytest.mark.parametrize("src,dst", [(["S(0)", "R"], ["R", "R"]), (["P(sum)", "S(1)"], ["R", "S(0)"]),
                                     (["R", "S(1)"], ["S(1)", "P(max)"])])
def test_an_empty_tensor_reshards_without_moving_anything(src, dst):
    mesh = dist.ProcessMesh(*MESHES["2x4"])
    x = make_tensor(np.zeros((0, 8), np.float32), mesh, src)
    out = dist.reshard(x, mesh, dst)
    assert out.numpy().shape == (0, 8)
    # stored as its placements say (XLA reports an empty result replicated)
    assert out.physical.sharding.spec == physical_spec(out.layout, mesh)
    assert [repr(p) for p in out.placements] == [repr(p) for p in
                                                 dist.reshard(out, mesh, dst).placements]


# -- across meshes ----------------------------------------------------------------------------

def _cross(src_mesh, src, dst_mesh, dst, value=None):
    value = _value() if value is None else value
    x = make_tensor(value, src_mesh, src, seed=11)
    plan = dist.plan_reshard(x, dst_mesh, dst)
    out = dist.reshard(x, dst_mesh, dst)
    assert out.mesh == dst_mesh
    assert {s.device.id for s in out.physical.addressable_shards} == set(dst_mesh.process_ids)
    np.testing.assert_array_equal(logical_value(out), value)
    hlo = Counter()
    for text in compiled_hlo(plan, x.physical):
        hlo += count_collectives(text)
    assert hlo == Counter(plan.collectives)
    return plan


def test_seed_002_replicate_to_shard_on_other_devices():
    mesh0 = dist.ProcessMesh([0, 1], dim_names=["x"])
    mesh1 = dist.ProcessMesh([2, 3], dim_names=["x"])
    plan = _cross(mesh0, ["R"], mesh1, ["S(0)"], np.array([[1, 2, 3], [4, 5, 6]], np.int32))
    # Each destination device receives only its own row, sliced on the sender.
    assert [s.kind for s in plan.steps] == ["transfer"]
    assert plan.total_bytes == 3 * 4


@pytest.mark.parametrize("src,dst", [
    (["S(0)", "S(1)"], ["S(1)"]), (["P(sum)", "S(1)"], ["S(1)"]), (["R", "P(max)"], ["R"]),
    (["S(1)", "R"], ["P(sum)"]),
])
def test_full_mesh_to_pipeline_stage_and_back(src, dst):
    full = dist.ProcessMesh(*MESHES["2x4"])
    stage1 = full["x", 1]
    assert stage1 == dist.ProcessMesh([4, 5, 6, 7], ["y"])
    _cross(full, src, stage1, dst)
    _cross(stage1, dst, full, src)


def test_sub_mesh_that_already_holds_its_blocks_moves_nothing():
    full = dist.ProcessMesh(*MESHES["2x4"])
    plan = _cross(full, ["R", "S(1)"], full.get_mesh_with_dim("x", 0), ["S(1)"])
    assert plan.total_bytes == 0


@pytest.mark.parametrize("src_mesh,src,dst_mesh,dst", [
    (([0, 1, 2, 3], ["a"]), ["S(0)"], ([4, 5], ["b"]), ["S(1)"]),
    (([[0, 1], [2, 3]], ["a", "b"]), ["P(sum)", "S(0)"], ([[4, 5], [6, 7]], ["a", "b"]), ["S(0)", "S(1)"]),
    (([0, 1, 2, 3, 4, 5, 6, 7], ["x"]), ["S(1)"], ([[7, 5], [3, 1]], ["p", "q"]), ["S(0)", "P(sum)"]),
    (([[0, 1, 2, 3], [4, 5, 6, 7]], ["x", "y"]), ["S(0)", "S(1)"], ([[3, 2, 1, 0], [7, 6, 5, 4]], ["x", "y"]), ["S(0)", "S(1)"]),
])
def test_across_meshes_of_any_size_and_order(src_mesh, src, dst_mesh, dst):
    _cross(dist.ProcessMesh(*src_mesh), src, dist.ProcessMesh(*dst_mesh), dst)


@pytest.mark.parametrize("src,dst", [(["P(max)", "R"], ["R", "S(0)"]),
                                     (["P(min)", "S(0)"], ["R", "R"]),
                                     (["P(sum)", "S(0)"], ["S(0)", "R"])])
def test_an_offloaded_tensor_reshards_on_the_devices_and_stays_offloaded(src, dst):
    """A tensor in host memory (dist.offload) is copied to the devices for the reshard's
    program and its result back: a float max / min (its NaN-keeping keys) computed on the
    host array raised jax's 'memory_space of all inputs passed to select_n must be the
    same'; .numpy() of such a tensor failed the same way."""
    mesh = dist.ProcessMesh(*MESHES["2x4"])
    value = np.array([[1.0, np.nan, -3.0], [4.0, -5.0, 6.0], [0.5, 2.0, -1.0],
                      [7.0, 8.0, 9.0]], np.float32)
    host = dist.offload(dist.shard_tensor(value, mesh, src))
    np.testing.assert_array_equal(host.numpy(), value)
    out = dist.reshard(host, mesh, dst)
    assert out.memory_kind == "pinned_host" and out.placements == dist.reshard(
        dist.shard_tensor(value, mesh, src), mesh, dst).placements
    np.testing.assert_array_equal(out.numpy(), value)


@pytest.mark.parametrize("dst_ids", [[4, 5, 6, 7], [0, 1, 2, 3]], ids=["disjoint", "overlapping"])
def test_an_offloaded_tensor_moves_between_meshes_and_stays_offloaded(dst_ids):
    """Across meshes too: the blocks are assembled in device memory and stored back in host
    memory (the result was in device memory; where a piece stayed on its own device, jax's
    'Memory kind mismatch with xla::PjRtBuffers')."""
    src = dist.ProcessMesh(*MESHES["2x4"])
    dst = dist.ProcessMesh([dst_ids[:2], dst_ids[2:]], ["a", "b"])
    value = np.arange(24, dtype=np.float32).reshape(6, 4)
    out = dist.reshard(dist.offload(dist.shard_tensor(value, src, ["S(0)", "S(1)"])), dst,
                       ["S(1)", "R"])
    assert out.memory_kind == "pinned_host" and out.mesh == dst
    np.testing.assert_array_equal(out.numpy(), value)


@pytest.mark.parametrize("placements", [["S(0)", "R"], ["R", "S(1)"], ["P", "R"]])
def test_a_reshard_that_moves_nothing_is_a_tensor_of_its_own(placements):
    """reshard / shard_tensor to the placements a tensor has moves nothing, and gives a tensor
    of its own: writing into it (`u[idx] = v`) leaves the original as it was (it was the same
    object: the write changed both)."""
    mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["x", "y"])
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    for make in (lambda t: dist.reshard(t, mesh, placements),
                 lambda t: dist.shard_tensor(t, mesh, placements)):
        t = dist.shard_tensor(x, mesh, placements)
        u = make(t)
        assert u is not t and u.placements == t.placements
        np.testing.assert_array_equal(u.numpy(), x)
        u[0] = -1.0
        np.testing.assert_array_equal(t.numpy(), x)
        np.testing.assert_array_equal(u.numpy()[0], -1.0)
        np.testing.assert_array_equal(u.numpy()[1:], x[1:])


def test_a_layout_no_step_reaches_is_a_reshard_error_not_a_key_error():
    """The planner's search asked for a layout whose split the devices do not divide (2 rows
    over 4): a ReshardError saying so (it was a bare KeyError from inside the search)."""
    from autoshard.cost_model import default_cost_model
    from autoshard.layout import Layout
    from autoshard.reshard.planner import plan_on_mesh

    mesh = dist.ProcessMesh([0, 1, 2, 3], ["x"])
    with pytest.raises(dist.ReshardError, match=r"no reshard reaches .* for shape \[2, 4\]"):
        plan_on_mesh(mesh, Layout(((), ())), Layout((("x",), ())), (2, 4), "float32",
                     default_cost_model())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_search_expands_a_layout_alike_for_every_shape_that_divides_alike(data):
    """The reshard search lists a layout's steps once per pattern of divisibility
    (`planner._divisibility`: an evenly split dim by its gcd with the mesh size), not once per
    shape: for any mesh, layout, shape (dims uneven or not) and target partial axes, the
    steps and the layouts after them are those the shape itself gives."""
    from autoshard.layout import Layout
    from autoshard.placement import ReduceType
    from autoshard.reshard import planner

    shape_of_mesh = data.draw(st.sampled_from([(8,), (2, 4), (4, 2), (2, 2, 2), (2, 3), (3, 2, 2)]))
    names = ["x", "y", "z"][:len(shape_of_mesh)]
    mesh = dist.ProcessMesh(np.arange(np.prod(shape_of_mesh)).reshape(shape_of_mesh), names)
    ndim = data.draw(st.integers(1, 3))
    order = data.draw(st.permutations(names))
    dims: list[tuple[str, ...]] = [() for _ in range(ndim)]
    partial = []
    kinds = list(ReduceType)
    for a in order:
        where = data.draw(st.integers(-1, ndim))
        if where == ndim:
            partial.append((a, data.draw(st.sampled_from(kinds))))
        elif where >= 0:
            dims[where] += (a,)
    kinds_used = {t for _, t in partial}
    if len(kinds_used - {ReduceType.SUM, ReduceType.AVG}) and len(kinds_used) > 1:
        partial = [p for p in partial if p[1] is partial[0][1]]  # one nonlinear kind at most
    layout = Layout(tuple(dims), tuple(partial))
    shape = tuple(data.draw(st.sampled_from([0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 30, 48, 7, 5]))
                  for _ in range(ndim))
    wanted = tuple(data.draw(st.lists(st.tuples(st.sampled_from(names), st.sampled_from(kinds)),
                                      max_size=2, unique_by=lambda p: p[0])))
    integer = data.draw(st.booleans())
    sizes = mesh.axis_sizes
    direct = []
    for step in planner._candidate_steps(layout, dict(wanted), ndim, mesh.dim_names, integer):
        after = step.after(layout, shape, sizes)
        if after is not None:
            direct.append((step, after))
    shared = planner._transitions(layout, wanted, planner._divisibility(layout, shape, mesh),
                                  integer, mesh)
    assert list(shared) == direct, (layout, shape)


@pytest.mark.parametrize("mesh_shape, src, dst", [
    ((8,), ["P(avg)"], ["R"]),
    ((8,), ["P(avg)"], ["S(0)"]),
    ((8,), ["R"], ["P(avg)"]),
    ((8,), ["S(0)"], ["P(avg)"]),
    ((2, 4), ["R", "P(avg)"], ["R", "R"]),
    ((2, 4), ["P(avg)", "P(avg)"], ["S(1)", "R"]),
    ((2, 4), ["S(0)", "R"], ["P(avg)", "S(0)"]),
])
@pytest.mark.parametrize("dtype", [np.float16, jnp.float8_e4m3fn])
def test_a_float16_mean_of_parts_is_summed_without_overflowing(mesh_shape, src, dst, dtype):
    """float16 parts of a mean are summed in float32, as jnp.mean sums them: summed in float16,
    eight parts of 10,000 overflowed to inf before the division (a Partial(avg) read back, a
    reshard to or from one), and a shard made a mean's part was first scaled by the device
    count (found by a probe). The plan lists the float32 bytes the program moves."""
    from autoshard.hlo import collective_wire_bytes

    mesh = dist.ProcessMesh(np.arange(8).reshape(mesh_shape), ["x", "y"][:len(mesh_shape)])
    big = 10000.0 if dtype == np.float16 else 400.0  # (float8_e4m3fn: largest 448)
    value = (np.array([[big, -big, 1.0, 0.5] * 4] * 8, np.float32)).astype(dtype)
    expected = np.asarray(value.astype(np.float32))
    x = dist.shard_tensor(value, mesh, [dist.placement.parse_placement(p) for p in src])
    np.testing.assert_array_equal(np.asarray(x.numpy()).astype(np.float32), expected)
    plan, out = check_reshard(x, mesh, [dist.placement.parse_placement(p) for p in dst],
                              expected.astype(dtype))
    wire = sum(collective_wire_bytes(text).get("all-reduce", 0) +
               collective_wire_bytes(text).get("reduce-scatter", 0)
               for text in compiled_hlo(plan, x.physical))
    planned = sum(s.bytes_per_device for s in plan.steps if s.step.kind in ("all_reduce",
                                                                              "reduce_scatter"))
    assert round(wire) == planned, str(plan)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("axes", [("a", "b"), ("b", "a"), ("c", "a"), ("a", "b", "c"),
                                  ("c", "b", "a"), ("b", "c", "a")])
def test_a_dim_split_over_several_axes_moves_them_in_one_all_to_all(axes, dim):
    """A dim split over several mesh axes, in any order, moved to another dim (in that order,
    or reversed after): the axes go together in one all-to-all of the block, in their order
    (jax's linear index of the group, the first major). The planner offered an all-to-all of
    the minor-most axis only, so [S(1), S(1)] → [S(0), S(0)] on 2×4 was an all-gather and an
    all-to-all, 640 KiB where one all-to-all moves 112 (found by a probe: 4x XLA's bytes for
    a concatenate or a slice of such a dim)."""
    from autoshard.cost_model import default_cost_model
    from autoshard.layout import Layout
    from autoshard.reshard.api import plan_layouts
    from autoshard.reshard.execute import execute

    mesh = dist.ProcessMesh(np.arange(8).reshape(2, 2, 2), ["a", "b", "c"])
    value = np.arange(16 * 32, dtype=np.float32).reshape(16, 32)
    src = Layout(tuple(axes if d == dim else () for d in range(2)), ())
    for order in (axes, axes[::-1]):
        dst = Layout(tuple(order if d != dim else () for d in range(2)), ())
        plan = plan_layouts(value.shape, "float32", mesh, src, mesh, dst, default_cost_model())
        kinds = [s.step.kind for s in plan.steps]
        if order == axes:  # one collective over the whole group
            assert kinds == ["all_to_all"] and plan.steps[0].step.axes == axes, kinds
        moved = execute(plan, jax.device_put(value, physical_sharding(src, mesh)))
        got = DistTensor(moved, mesh, dst, value.shape)
        np.testing.assert_array_equal(got.numpy(), value)
        assert moved.sharding.is_equivalent_to(physical_sharding(dst, mesh), 2)


# -- moving a split to other mesh axes: one collective permute --------------------------------

def _spec(mesh, placements, ndim):
    from jax.sharding import PartitionSpec

    dims = [[] for _ in range(ndim)]
    for axis, p in zip(mesh.dim_names, placements):
        if isinstance(p, dist.Shard):
            dims[p.dim].append(axis)
    return PartitionSpec(*[tuple(d) if len(d) > 1 else (d[0] if d else None) for d in dims])


_PERMUTES = [  # (mesh, from, to): each device's target block lies inside one source block
    ("2x4", ["S(0)", "R"], ["R", "S(0)"]),
    ("2x2x2", ["S(0)", "R", "R"], ["R", "S(0)", "R"]),
    ("2x2x2", ["S(0)", "S(1)", "R"], ["S(1)", "S(0)", "R"]),
    ("2x2x2", ["S(0)", "S(1)", "S(2)"], ["S(2)", "S(0)", "S(1)"]),
    ("2x2x2", ["S(0)", "S(0)", "R"], ["R", "S(0)", "S(0)"]),
    ("2x2x2", ["S(0)", "R", "R"], ["R", "R", "S(0)"]),
    ("2x2x2", ["S(0)", "S(0)", "R"], ["S(0)", "R", "S(0)"]),
    ("4x2", ["R", "S(0)"], ["S(0)", "R"]),
]


@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("mesh_name,src,dst", _PERMUTES)
def test_a_split_moved_to_other_mesh_axes_is_one_collective_permute(mesh_name, src, dst, dtype,
                                                                    how):
    """Rows split over dp read split over mp ([S(0), R] → [R, S(0)] on 2x4), axes exchanged
    between dims, a co-split dim's axes replaced: each device's target block lies inside one
    source block, which some device holds, and one collective permute of a target block moves
    it (steps.Retile), as jax.jit's with_sharding_constraint does. The search knew no step
    that moves a split from one mesh axis to another and went through a gather: 2x to 6x
    jax.jit's bytes (found by a probe)."""
    from jax.sharding import NamedSharding
    from autoshard.hlo import collective_bytes

    mesh = dist.ProcessMesh(*MESHES[mesh_name])
    value = _value((16, 8, 8), dtype)
    x = dist.shard_tensor(value, mesh, src)
    block = value.nbytes // np.prod([mesh.get_dim_size(a) for a, p in
                                     zip(mesh.dim_names, dst) if p != "R"])
    if how == "eager":
        plan, _ = check_reshard(x, mesh, dst, value)
        assert plan.collectives == ["collective-permute"], str(plan)
        assert plan.total_bytes == block and "ppermute(" in str(plan), str(plan)
        return
    f = dist.jit(lambda v: dist.reshard(v * 2, mesh, dst))
    out = f(x)
    np.testing.assert_array_equal(logical_value(out), value * 2)
    assert [repr(p) for p in out.placements] == [repr(dist.parse_placement(p)) for p in dst]
    hlo = f.lower(x).compile().as_text()
    assert count_collectives(hlo) == Counter({"collective-permute": 1}), hlo
    ours = sum(collective_bytes(hlo).values())
    spec = _spec(mesh, [dist.parse_placement(p) for p in dst], 3)
    g = jax.jit(lambda v: jax.lax.with_sharding_constraint(v * 2, NamedSharding(mesh.to_jax(),
                                                                                 spec)))
    assert ours == block <= sum(collective_bytes(g.lower(x.physical).compile().as_text()).values())


@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize("src,dst", [
    (["S(0)", "R", "P(sum)"], ["R", "S(0)", "P(sum)"]),
    (["P(sum)", "S(0)", "S(1)"], ["P(sum)", "S(1)", "S(0)"]),
    (["P(max)", "S(0)", "R"], ["P(max)", "R", "S(0)"]),
])
def test_a_partial_value_moves_its_split_by_one_permute_keeping_its_parts(src, dst, how):
    """The permute runs over the axes that split a dim only: each device's part of a pending
    reduction stays on the devices of its partial index, and the target is still partial."""
    mesh = dist.ProcessMesh(*MESHES["2x2x2"])
    value = _value((16, 8))
    x = make_tensor(value, mesh, src, seed=7)
    if how == "eager":
        plan, out = check_reshard(x, mesh, dst, value)
        assert plan.collectives == ["collective-permute"], str(plan)
    else:
        f = dist.jit(lambda v: dist.reshard(v, mesh, dst), out_placements="keep")
        out = f(x)
        np.testing.assert_array_equal(logical_value(out), value)
        assert count_collectives(f.lower(x).compile().as_text()) == Counter(
            {"collective-permute": 1})
    assert [repr(p) for p in out.placements] == [repr(dist.parse_placement(p)) for p in dst]


def test_a_split_moved_to_fewer_devices_permutes_then_gathers():
    """[R, S(0)] → [S(0), R] on 2x4: a target block spans two source blocks, which one round
    cannot fill; permuted to rows split over (dp, mp) first — half a target block — and
    gathered over mp, it moves less than a gather of the whole dim over mp (and than
    jax.jit's permute and gather)."""
    from jax.sharding import NamedSharding
    from autoshard.hlo import collective_bytes

    mesh = dist.ProcessMesh(*MESHES["2x4"])
    value = _value((1024, 256))
    x = dist.shard_tensor(value, mesh, ["R", "S(0)"])
    plan, _ = check_reshard(x, mesh, ["S(0)", "R"], value)
    assert [s.kind for s in plan.steps] == ["permute", "all_gather"], str(plan)
    assert plan.total_bytes == value.nbytes // 2, str(plan)  # a gather alone: 3/4
    f = dist.jit(lambda v: dist.reshard(v * 2, mesh, ["S(0)", "R"]))
    np.testing.assert_array_equal(f(x).numpy(), value * 2)
    ours = sum(collective_bytes(f.lower(x).compile().as_text()).values())
    g = jax.jit(lambda v: jax.lax.with_sharding_constraint(
        v * 2, NamedSharding(mesh.to_jax(), jax.sharding.PartitionSpec("x", None))))
    assert ours <= sum(collective_bytes(g.lower(x.physical).compile().as_text()).values())


@pytest.mark.parametrize("where", ["outside", "inside"])
@pytest.mark.parametrize("mesh_name,src,dst", [_PERMUTES[0], _PERMUTES[2], _PERMUTES[4]])
def test_a_permuted_split_differentiates(mesh_name, src, dst, where):
    """A permute whose target is replicated over axes it ran across types its result as
    agreeing along them (steps.agreed); its gradient, taken inside dist.jit or outside (the
    partitioned program itself differentiated), equals one device's."""
    _check_reshard_gradient(dist.ProcessMesh(*MESHES[mesh_name]), src, dst, (16, 8, 8), where, 0)


def _check_reshard_gradient(mesh, src, dst, shape, where, seed):
    """The gradient of a weighted sum of squares through reshard(src -> dst), taken inside
    dist.jit or outside it, equals one device's."""
    x = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    w = np.cos(np.arange(x.size, dtype=np.float32)).reshape(shape)
    body = lambda v: jnp.sum(dist.reshard(dist.shard_tensor(v, mesh, src) * 3.0, mesh, dst) ** 2
                             * w)  # noqa: E731
    f = jax.grad(dist.jit(body)) if where == "outside" else dist.jit(jax.grad(body))
    got = f(jnp.asarray(x))
    want = jax.grad(lambda v: jnp.sum((v * 3.0) ** 2 * w))(x)
    np.testing.assert_allclose(np.asarray(got.numpy() if hasattr(got, "numpy") else got), want,
                               rtol=1e-5)
    return x


# -- axes exchanged between dims of unequal splits: permutes of pieces, in rounds -------------

_ROUNDS = [  # (mesh, from, to, shape): a target block spans pieces of several source blocks
    ("2x4", ["S(0)", "S(1)"], ["S(1)", "S(0)"], (16, 16)),
    ("2x4", ["S(1)", "S(0)"], ["S(0)", "S(1)"], (16, 8, 8)),
    ("4x2", ["S(0)", "S(1)"], ["S(1)", "S(0)"], (16, 8, 8)),
    ("4x2", ["S(1)", "S(0)"], ["S(0)", "S(1)"], (16, 16)),
    ("2x2x2", ["S(0)", "S(1)", "S(1)"], ["S(1)", "S(0)", "S(0)"], (16, 16)),
    ("2x2x2", ["S(1)", "S(0)", "S(0)"], ["S(0)", "S(1)", "S(1)"], (16, 8, 8)),
    ("2x2x2", ["S(1)", "S(0)", "S(1)"], ["S(0)", "S(1)", "S(0)"], (16, 16)),
    ("2x2x2", ["S(1)", "S(1)", "S(0)"], ["S(0)", "S(0)", "S(1)"], (16, 8, 8)),
    ("2x2x2", ["S(1)", "S(0)", "P(sum)"], ["S(0)", "S(0)", "P(sum)"], (16, 16)),
    ("2x2x2", ["P(max)", "S(1)", "S(0)"], ["P(max)", "S(0)", "S(0)"], (16, 8, 8)),
    # two rounds against one all-gather: the permutes win once bandwidth outweighs latency
    ("2x2x2", ["S(0)", "S(0)", "P(sum)"], ["S(1)", "S(0)", "P(sum)"], (512, 512)),
]


def _jax_jit_bytes(x, mesh, dst_placements) -> int:
    """Result bytes of jax.jit's own move of `x`'s physical array to the physical form of
    `dst_placements` (a Partial axis is a leading dim split over it: the same data moves)."""
    from jax.sharding import NamedSharding
    from autoshard.hlo import collective_bytes
    from autoshard.layout import layout_from_placements

    dst = layout_from_placements([dist.parse_placement(p) for p in dst_placements], mesh,
                                 x.shape)
    g = jax.jit(lambda v: v * 2, out_shardings=NamedSharding(mesh.to_jax(),
                                                             physical_spec(dst, mesh)))
    return sum(collective_bytes(g.lower(x.physical).compile().as_text()).values())


@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("mesh_name,src,dst,shape", _ROUNDS,
                         ids=[f"{m}:{','.join(a)}->{','.join(b)}" for m, a, b, _ in _ROUNDS])
def test_axes_exchanged_between_unequal_splits_are_permutes_of_pieces(mesh_name, src, dst,
                                                                     shape, dtype, how):
    """[S(0), S(1)] → [S(1), S(0)] on 2x4: a target block (rows over mp, columns over dp)
    spans two source blocks, which no one permute fills; the search went through an
    all-gather, an all-to-all and a slice, twice jax.jit's bytes (jax.jit: an all-to-all over
    pairs of mp devices, an axis XLA splits in two, and a permute). Each device's target is
    pieces of several source blocks: each arrives by its own permute (steps.Retile in rounds),
    a piece per device per round, fewer bytes than jax.jit's."""
    from autoshard.hlo import collective_bytes

    mesh = dist.ProcessMesh(*MESHES[mesh_name])
    value = _value(shape, dtype)
    x = make_tensor(value, mesh, src, seed=11)
    theirs = _jax_jit_bytes(x, mesh, dst)
    if how == "eager":
        plan, out = check_reshard(x, mesh, dst, value)
        assert [s.kind for s in plan.steps] == ["permute"], str(plan)
        assert plan.collectives == ["collective-permute"] * 2, str(plan)
        ours = sum(sum(collective_bytes(text).values()) for text in compiled_hlo(plan, x.physical))
        assert ours == plan.total_bytes, str(plan)
    else:
        # (a Partial(max) value scaled is reduced first: the rules pass no max through a
        # product; moved as it is, it stays partial)
        scale = 1 if any(p.startswith("P") for p in src) else 2
        f = dist.jit(lambda v: dist.reshard(v * scale, mesh, dst), out_placements="keep")
        out = f(x)
        np.testing.assert_array_equal(logical_value(out), value * scale)
        hlo = f.lower(x).compile().as_text()
        assert count_collectives(hlo) == Counter({"collective-permute": 2}), hlo
        ours = sum(collective_bytes(hlo).values())
    assert [repr(p) for p in out.placements] == [repr(dist.parse_placement(p)) for p in dst]
    assert ours < theirs, (ours, theirs)


@pytest.mark.parametrize("where", ["outside", "inside"])
@pytest.mark.parametrize("mesh_name,src,dst,shape", [_ROUNDS[0], _ROUNDS[3], _ROUNDS[5]],
                         ids=["2x4", "4x2", "2x2x2"])
def test_a_permute_in_rounds_differentiates(mesh_name, src, dst, shape, where):
    """The pieces placed into the target block (dynamic_update_slice, select) and their
    permutes transpose to the reverse permutes and slices: a gradient through the reshard,
    taken inside dist.jit or outside, equals one device's."""
    mesh = dist.ProcessMesh(*MESHES[mesh_name])
    x = _check_reshard_gradient(mesh, src, dst, shape, where, 1)
    assert dist.plan_reshard(dist.shard_tensor(x, mesh, src), mesh, dst).collectives == [
        "collective-permute"] * 2


def _layouts(mesh):
    """Every layout of a 2-d tensor on `mesh` without partial axes (co-split dims in every
    order of their axes)."""
    from autoshard.layout import Layout

    names = mesh.dim_names
    found = []
    for where in itertools.product(range(3), repeat=len(names)):  # dim 0, dim 1, or none
        groups = [[a for a, d in zip(names, where) if d == k] for k in range(2)]
        for first in itertools.permutations(groups[0]):
            for second in itertools.permutations(groups[1]):
                found.append(Layout((tuple(first), tuple(second))))
    return found


@pytest.mark.parametrize("mesh_name", ["2x4", "4x2", "2x2x2"])
def test_every_retiling_assembles_each_target_block(mesh_name):
    """`steps.retiling` between every two layouts of a 2-d tensor, run by hand on numpy
    blocks: each round a device sends and receives at most one piece, there are as many
    rounds as the busiest device has pieces to receive or send, and every device ends with
    exactly its target block."""
    from autoshard.layout import block_bounds
    from autoshard.reshard.steps import retiling

    mesh = dist.ProcessMesh(*MESHES[mesh_name])
    sizes = mesh.axis_sizes
    value = np.arange(16 * 32).reshape(16, 32)
    found = 0
    for src in _layouts(mesh):
        for dst in _layouts(mesh):
            plan = retiling(src, dst, tuple(sizes.items()))
            if plan is None:
                continue
            found += 1
            assert plan.axes == tuple(a for a in mesh.dim_names if a in src.used_axes | dst.used_axes)
            coords = list(itertools.product(*(range(sizes[a]) for a in plan.axes)))

            def block(layout, c):
                at = [0] * mesh.ndim
                for a, i in zip(plan.axes, c):
                    at[mesh.dim_names.index(a)] = i
                return value[tuple(slice(lo, hi) for lo, hi in block_bounds(layout, mesh,
                                                                            value.shape, at))]

            held = [block(src, c) for c in coords]
            piece = tuple(n // s for n, s in zip(held[0].shape, plan.split))
            out = [np.full(tuple(p * s for p, s in zip(piece, plan.span)), -1) for _ in coords]

            def cut(x, at):
                return x[tuple(slice(o * p, (o + 1) * p) for o, p in zip(at, piece))]

            def put(i, x, at):
                region = tuple(slice(o * p, (o + 1) * p) for o, p in zip(at, piece))
                assert (out[i][region] == -1).all()  # each piece placed once
                out[i][region] = x

            for i in range(len(coords)):
                if plan.keeps[i]:
                    kept = plan.keep[i] if plan.keep is not None else plan.rounds[0].send[i]
                    put(i, cut(held[i], kept), plan.keep_place[i])
            degree = Counter()
            for rnd in plan.rounds:
                senders = [j for j, _ in rnd.perm]
                receivers = [i for _, i in rnd.perm]
                assert len(set(senders)) == len(senders) and len(set(receivers)) == len(receivers)
                assert sorted(receivers) == [i for i, r in enumerate(rnd.receives) if r]
                for j, i in rnd.perm:
                    put(i, cut(held[j], rnd.send[j]), rnd.place[i])
                    degree[("send", j)] += 1
                    degree[("receive", i)] += 1
            assert len(plan.rounds) == max(degree.values()), (src, dst)
            for i, c in enumerate(coords):
                np.testing.assert_array_equal(out[i], block(dst, c), err_msg=f"{src} → {dst}")
    assert found
