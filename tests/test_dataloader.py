"""shard_dataloader: batch structures, pipeline meshes, shard dims, per-device slices only,
lazy iteration and Paddle-style use."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import pxla

import autoshard as dist
from autoshard.training.dataloader import (BatchSplitError, DataloaderError, ShardDataloader,
                                           shard_dataloader)

MESH0 = dist.ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
MESH1 = dist.ProcessMesh([[4, 5], [6, 7]], ["x", "y"])
MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
SR = [dist.Shard(0), dist.Replicate()]


def batches(n=3, rows=4):
    return [(np.arange(rows * 6, dtype=np.float32).reshape(rows, 6) + 100 * i,
             np.arange(rows, dtype=np.int32) + 10 * i) for i in range(n)]


def test_seed_two_meshes_paddle_style():
    data = batches()
    shard = getattr(dist, "shard_dataloader", shard_dataloader)  # the export, once added
    dataloader = shard(data, meshes=[MESH0, MESH1], shard_dims="x")
    assert len(dataloader) == 3
    seen = 0
    for step, inputs in enumerate(dataloader()):
        image, label = inputs
        assert isinstance(inputs, tuple)
        assert image.mesh == MESH0 and label.mesh == MESH1
        assert image.placements == SR and label.placements == SR
        assert image.local_shape == (2, 6) and label.local_shape == (2,)
        np.testing.assert_array_equal(image.numpy(), data[step][0])
        np.testing.assert_array_equal(label.numpy(), data[step][1])
        # x=0 holds rows 0:2 (devices 0, 1 / 4, 5), x=1 rows 2:4 (devices 2, 3 / 6, 7)
        np.testing.assert_array_equal(image.local(1), data[step][0][:2])
        np.testing.assert_array_equal(image.local(2), data[step][0][2:])
        np.testing.assert_array_equal(label.local(6), data[step][1][2:])
        seen += 1
    assert seen == 3
    # plain iteration, and a list loader can be iterated again
    assert [b[1].numpy().tolist() for b in dataloader] == [d[1].tolist() for d in data]


def test_list_batch_middle_elements_go_to_the_first_mesh():
    data = [[np.ones((4, 2)), np.zeros((4, 3)), np.arange(4)]]
    a, b, c = next(iter(shard_dataloader(data, [MESH0, MESH1], shard_dims="x")))
    assert (a.mesh, b.mesh, c.mesh) == (MESH0, MESH0, MESH1)
    assert a.dtype == np.float32 and c.dtype == np.int32  # canonicalized like jnp
    single = next(iter(shard_dataloader([[np.ones(4)]], [MESH0, MESH1])))
    assert isinstance(single, list) and single[0].mesh == MESH0


def test_dict_batches_with_input_keys_list_and_dict():
    batch = {"image": np.arange(32.0).reshape(8, 4), "label": np.arange(8), "mask": np.ones(8)}
    out = next(iter(shard_dataloader([batch], [MESH0, MESH1], input_keys=["image", "label"])))
    assert set(out) == {"image", "label", "mask"}
    assert out["image"].mesh == MESH0 and out["mask"].mesh == MESH0 and out["label"].mesh == MESH1
    assert out["label"].placements == SR and out["label"].local_shape == (4,)
    for k in batch:
        np.testing.assert_array_equal(out[k].numpy(), batch[k])
    out = next(iter(shard_dataloader([batch], [MESH0, MESH1], input_keys={"mask": 1},
                                     shard_dims={"mask": "y", "image": 1})))
    assert out["mask"].mesh == MESH1 and out["mask"].placements == [dist.Replicate(), dist.Shard(0)]
    assert out["image"].placements == [dist.Replicate(), dist.Shard(0)]
    assert out["label"].mesh == MESH0 and out["label"].placements == SR
    # a list of shard dims follows input_keys
    out = next(iter(shard_dataloader([batch], [MESH0, MESH1], input_keys=["image", "label"],
                                     shard_dims=["y", "x"])))
    assert out["image"].placements == [dist.Replicate(), dist.Shard(0)]
    assert out["label"].placements == SR and out["mask"].placements == SR


def test_nested_batches_keep_their_structure():
    Pair = collections.namedtuple("Pair", "ids pos")
    batch = ({"ids": np.arange(16).reshape(8, 2), "extra": [np.ones((8, 1)), None]},
             Pair(np.arange(8), np.arange(8.0)), np.float32(0.5))
    out = next(iter(shard_dataloader([batch], [MESH0, MESH1], shard_dims=[0, "y", None])))
    ids, extra = out[0]["ids"], out[0]["extra"]
    assert isinstance(out, tuple) and isinstance(out[1], Pair) and extra[1] is None
    assert ids.mesh == MESH0 and ids.placements == SR and extra[0].local_shape == (4, 1)
    assert out[1].ids.mesh == MESH0 and out[1].pos.placements == [dist.Replicate(), dist.Shard(0)]
    scalar = out[2]  # the last element: meshes[-1], replicated (no batch dim)
    assert scalar.mesh == MESH1 and scalar.placements == [dist.Replicate(), dist.Replicate()]
    np.testing.assert_array_equal(ids.numpy(), batch[0]["ids"])
    assert float(scalar.numpy()) == 0.5


def test_default_and_int_shard_dims_on_one_mesh():
    x = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    t = next(iter(shard_dataloader([x], MESH)))  # a bare array batch; first mesh dim 'dp'
    assert t.placements == SR and t.local_shape == (4, 8)
    t = next(iter(shard_dataloader([x], MESH, shard_dims=1)))
    assert t.placements == [dist.Replicate(), dist.Shard(0)] and t.local_shape == (2, 8)
    assert {tuple(s.data.shape) for s in t.physical.addressable_shards} == {(2, 8)}
    np.testing.assert_array_equal(t.local(5), x[2:4])
    # a jax.Array leaf works too; one already laid out as asked is used as is
    placed = jax.device_put(jnp.asarray(x), t.sharding)
    same = next(iter(shard_dataloader([placed, jnp.asarray(x)], MESH, shard_dims="mp")))
    assert same.physical is placed
    other = list(shard_dataloader([jnp.asarray(x)], MESH, shard_dims="mp"))[0]
    np.testing.assert_array_equal(other.numpy(), x)
    # jax's own float types (numpy files bfloat16 under kind "V", as raw bytes)
    half = next(iter(shard_dataloader([x.astype(jnp.bfloat16)], MESH)))
    assert half.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(half.numpy(), np.float32), x)


@pytest.mark.parametrize("splitted", [False, True])
def test_each_device_receives_only_its_slice(monkeypatch, splitted):
    puts, single = [], []
    real_batched, real_put = pxla.batched_device_put, jax.device_put

    def spy_batched(aval, sharding, xs, devices, *a, **k):
        puts.extend(np.shape(x) for x in xs)
        return real_batched(aval, sharding, xs, devices, *a, **k)

    def spy_put(x, device=None, *a, **k):
        single.append(np.shape(x))
        return real_put(x, device, *a, **k)

    monkeypatch.setattr(pxla, "batched_device_put", spy_batched)
    monkeypatch.setattr(jax, "device_put", spy_put)
    data = [(np.ones((8, 16), np.float32), np.arange(8))]
    loader = shard_dataloader(data, MESH, shard_dims="mp", is_dataset_splitted=splitted)
    image, label = next(iter(loader))
    assert {tuple(s.data.shape) for s in image.physical.addressable_shards} == {(2, 16)}
    assert {tuple(s.data.shape) for s in label.physical.addressable_shards} == {(2,)}
    # 8 devices x 2 arrays, each placed from a host slice of its own size, never the batch
    assert sorted(set(puts)) == [(2,), (2, 16)] and len(puts) == 16
    assert (8, 16) not in single and (8,) not in single
    np.testing.assert_array_equal(image.numpy(), data[0][0])
    np.testing.assert_array_equal(label.numpy(), data[0][1])


def test_generator_is_not_over_consumed_and_len():
    drawn = []

    def gen():
        for i, b in enumerate(batches(4)):
            drawn.append(i)
            yield b

    loader = shard_dataloader(gen(), [MESH0, MESH1], shard_dims="x")
    assert drawn == []  # nothing is inferred ahead of iteration
    it = loader()
    assert drawn == []
    first = next(it)
    assert drawn == [0] and first[0].shape == (4, 6)
    next(it)
    assert drawn == [0, 1]
    assert len(list(it)) == 2 and drawn == [0, 1, 2, 3]
    with pytest.raises(TypeError, match="has no len"):
        len(loader)
    assert isinstance(loader, ShardDataloader) and loader.meshes == [MESH0, MESH1]


def test_loader_attributes_pass_through():
    class Loader:
        batch_size = 4

        def __iter__(self):
            return iter(batches(2))

        def __len__(self):
            return 2

    loader = shard_dataloader(Loader(), MESH0, shard_dims="y")
    assert loader.batch_size == 4 and len(loader) == 2 and len(list(loader)) == 2


def test_a_short_last_batch_is_stored_padded_and_trains_like_one_device():
    # drop_last=False: 5 rows over 'x' (2) — stored padded, computed whole (test_uneven.py)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(5, 3)).astype(np.float32), rng.normal(size=5).astype(np.float32)
    bx, by = next(iter(shard_dataloader([(x, y)], [MESH0, MESH1], shard_dims="x")))
    assert bx.mesh == MESH0 and by.mesh == MESH1 and by.placements[0] == dist.Shard(0)
    np.testing.assert_array_equal(by.numpy(), y)
    assert by.local_shape == (3,)  # ceil(5 / 2) rows a device, the last one padding
    w = dist.shard_tensor(np.ones(3, np.float32), MESH0, ["R", "R"])
    with pytest.warns(dist.UnevenShardingWarning, match=r"argument 1 \(shape \(5, 3\)\)"):
        loss = dist.jit(lambda w, x: jnp.mean((x @ w) ** 2))(w, bx)
    np.testing.assert_allclose(loss.numpy(), np.mean((x @ np.ones(3)) ** 2), rtol=1e-6)


def test_divisibility_error_of_a_split_dataset_names_input_dim_and_axis():
    # each process feeds its own rows of a split dataset: those must divide
    data = [(np.ones((4, 3)), np.ones(5))]
    loader = shard_dataloader(data, [MESH0, MESH1], shard_dims="x", is_dataset_splitted=True)
    with pytest.raises(BatchSplitError, match=r"batch\[1\] has 5 rows on dim 0 .* mesh dim 'x' "
                       r"\(size 2\).*multiple of 2.*drop_last=True") as info:
        next(iter(loader))
    assert isinstance(info.value, dist.ShardingError)
    with pytest.raises(BatchSplitError, match=r"batch\['a'\] has 3 rows.*'dp' \(size 2\)"):
        list(shard_dataloader([{"a": np.ones(3)}], MESH, is_dataset_splitted=True))


def test_argument_and_batch_errors():
    with pytest.raises(DataloaderError, match=r"shard_dims='z' .* dim names \['x', 'y'\]"):
        shard_dataloader([], [MESH0, MESH1], shard_dims="z")
    with pytest.raises(DataloaderError, match="generator function: pass its result"):
        shard_dataloader(batches, MESH0)
    with pytest.raises(DataloaderError, match="two different keys"):
        shard_dataloader([], [MESH0, MESH1], input_keys=["a"])
    with pytest.raises(DataloaderError, match=r"input_keys=\['a', 'b'\]"):
        list(shard_dataloader([{"a": np.ones(2), "b": np.ones(2)}], [MESH0, MESH1]))
    with pytest.raises(DataloaderError, match=r"no key\(s\) \['label'\]"):
        list(shard_dataloader([{"a": np.ones(2)}], [MESH0, MESH1], input_keys=["a", "label"]))
    with pytest.raises(DataloaderError, match="applies to dict batches"):
        list(shard_dataloader(batches(1), [MESH0, MESH1], input_keys=["a", "b"]))
    with pytest.raises(DataloaderError, match="a list of 2"):
        list(shard_dataloader(batches(1), MESH0, shard_dims=["x"]))
    with pytest.raises(DataloaderError, match=r"shard_dims=5 for batch\[0\]"):
        list(shard_dataloader(batches(1), MESH0, shard_dims={0: 5}))
    with pytest.raises(DataloaderError, match=r"batch\['text'\]\[0\] is str 'a', which is not"):
        list(shard_dataloader([{"text": ["a", "b"]}], MESH0))


@pytest.mark.parametrize("rows", [4, 3])
def test_prng_key_batches_are_split_like_arrays(rows):
    """Typed keys have no numpy value: np.asarray's raw TypeError came through."""
    keys = jax.random.split(jax.random.key(0), rows)
    data = [{"keys": keys, "seed": jax.random.key(1), "x": np.ones((rows, 2), np.float32)}]
    batch = next(iter(shard_dataloader(data, meshes=MESH0, shard_dims="x")))
    assert batch["keys"].placements == SR and batch["seed"].placements == [dist.Replicate()] * 2
    for name in ("keys", "seed"):
        np.testing.assert_array_equal(jax.random.key_data(dist.unshard_dtensor(batch[name])),
                                      jax.random.key_data(data[0][name]))


def test_a_list_of_numbers_in_a_batch_is_one_per_sample_array():
    """A collate_fn's per-sample lengths (or rows of numbers) are one input, split along the
    batch dim like the arrays beside them — jax's pytree rules made each number a 0-d input."""
    batch = {"ids": np.arange(8).reshape(4, 2), "lens": [3, 4, 5, 6],
             "rows": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]}
    out = next(iter(shard_dataloader([batch], MESH0)))
    for name in ("lens", "rows"):
        want = jnp.asarray(batch[name])  # what one device's step makes of it
        assert isinstance(out[name], dist.DistTensor) and out[name].placements == SR
        assert out[name].dtype == want.dtype
        np.testing.assert_array_equal(out[name].numpy(), want)
    np.testing.assert_array_equal(out["lens"].local(2), [5, 6])  # x=1 holds rows 2:4
    # the last element of a tuple batch (numpy scalars too): one label array on meshes[-1]
    x, lens = next(iter(shard_dataloader([(np.ones((4, 3)), [np.int32(1), 2, 3, 4])],
                                         [MESH0, MESH1])))
    assert lens.mesh == MESH1 and lens.placements == SR
    np.testing.assert_array_equal(lens.numpy(), [1, 2, 3, 4])
    with pytest.raises(DataloaderError, match=r"batch\['r'\] is a ragged list of numbers .*"
                       r"mesh dim 'x' .*pad its rows to one length"):
        list(shard_dataloader([{"r": [[1, 2], [3]]}], MESH0))


def test_a_dtensor_on_another_mesh_is_moved_to_the_mesh_it_goes_to():
    """It passed through on its own mesh, where no step on the loader's mesh takes it."""
    x = np.arange(24.0, dtype=np.float32).reshape(4, 6)
    keys = jax.random.split(jax.random.key(0), 4)
    line = dist.ProcessMesh(list(range(8)), ["a"])
    batch = {"x": dist.shard_tensor(x, MESH1, ["R", "S(1)"]),
             "keys": dist.shard_tensor(keys, line, ["S(0)"]),  # a 1-d mesh, typed keys
             "same": dist.shard_tensor(x, MESH0, ["R", "S(1)"]),  # its own mesh: kept as placed
             "y": np.arange(4, dtype=np.float32)}
    out = next(iter(shard_dataloader([batch], MESH0, shard_dims="y")))
    placed = [dist.Replicate(), dist.Shard(0)]
    assert out["x"].mesh == MESH0 and out["x"].placements == placed
    np.testing.assert_array_equal(out["x"].numpy(), x)
    np.testing.assert_array_equal(out["x"].local(1), x[2:])  # y=1 holds rows 2:4
    assert out["keys"].mesh == MESH0 and out["keys"].placements == placed
    np.testing.assert_array_equal(jax.random.key_data(dist.unshard_dtensor(out["keys"])),
                                  jax.random.key_data(keys))
    assert out["same"] is batch["same"]
    loss = dist.jit(lambda x, y: (x.sum(1) * y).sum())(out["x"], out["y"])
    np.testing.assert_allclose(loss.numpy(), (x.sum(1) * np.arange(4)).sum())
    # pipeline meshes: a label on the first stage's mesh goes to the last's, a short batch too
    label = np.arange(5, dtype=np.int32)
    image, moved = next(iter(shard_dataloader(
        [(dist.shard_tensor(x, MESH1, SR), dist.shard_tensor(label, MESH0, ["R", "R"]))],
        [MESH0, MESH1], shard_dims="x")))
    assert (image.mesh, moved.mesh) == (MESH0, MESH1) and moved.placements == SR
    np.testing.assert_array_equal(image.numpy(), x)
    np.testing.assert_array_equal(moved.numpy(), label)
