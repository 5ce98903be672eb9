"""Distributed checkpoints: save on one mesh, load bit-exact onto another mesh, device count or
placements; async saves; every broken checkpoint or mismatched target is a named error."""
import glob
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard as dist
from autoshard.training.checkpoint import (CheckpointError, load_state_dict, save_state_dict,
                                           wait_for_saves)

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
MESH4 = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
MESH1 = dist.ProcessMesh([5], dim_names=["x"])
R, P, S0, S1 = dist.Replicate(), dist.Partial(), dist.Shard(0), dist.Shard(1)

RNG = np.random.default_rng(0)
# Random bit patterns (NaN payloads, denormals, -0.0): loading must give back every bit.
FLOATS = RNG.integers(0, 2**32, (8, 8), dtype=np.uint32).view(np.float32)
INTS = RNG.integers(-2**31, 2**31, (8, 16), dtype=np.int64).astype(np.int32)


def assert_bits_equal(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    np.testing.assert_array_equal(actual.reshape(-1).view(np.uint8), expected.reshape(-1).view(np.uint8))


def zeros_like_on(value, mesh, placements):
    return dist.dtensor_from_fn(jnp.zeros, mesh, placements, value.shape, value.dtype)


@pytest.mark.parametrize("src", [[S0, S1], [R, P], [S1, R]])
@pytest.mark.parametrize("dst_mesh,dst", [(MESH4, [S1]), (MESH4, [R]), (MESH4, [P]),
                                          (MESH1, [R]), (MESH, [S1, S0]), (MESH, [P, R])])
def test_round_trip_across_meshes_device_counts_and_placements(tmp_path, src, dst_mesh, dst):
    # Partial sources hold the value on one device and zeros elsewhere, so their sum is exact.
    floats = FLOATS if P not in src else np.abs(np.nan_to_num(FLOATS, nan=1.0, posinf=2.0))
    state = {"w": dist.shard_tensor(floats, MESH, src), "i": dist.shard_tensor(INTS, MESH, src)}
    save_state_dict(state, tmp_path / "ckpt")

    target = {"w": zeros_like_on(floats, dst_mesh, dst), "i": zeros_like_on(INTS, dst_mesh, dst)}
    shardings = {k: v.physical.sharding for k, v in target.items()}
    loaded = load_state_dict(target, tmp_path / "ckpt")
    for key, expected in [("w", floats), ("i", INTS)]:
        out = loaded[key]
        assert isinstance(out, dist.DistTensor)
        assert out.mesh == dst_mesh and out.placements == dst and out.shape == expected.shape
        assert out.physical.sharding == shardings[key]
        assert_bits_equal(out.numpy(), expected)
        assert target[key] is out  # Paddle style: the given dict now holds the loaded values


def test_partial_values_are_reduced_before_saving(tmp_path):
    # Each device holds a different partial block; the checkpoint holds their sum.
    blocks = lambda c: np.full((4, 6), (c[0] + 1) * 10 + c[1], np.int32)  # noqa: E731
    t = dist.dtensor_from_local(blocks, MESH, [P, S1])
    expected = t.numpy()
    assert expected.shape == (4, 24) and expected[0, 0] == 10 + 20
    save_state_dict({"t": t}, tmp_path / "ckpt")
    out = load_state_dict({"t": zeros_like_on(expected, MESH1, [R])}, tmp_path / "ckpt")["t"]
    assert_bits_equal(out.numpy(), expected)
    assert out.local(5).shape == (4, 24)


def test_each_device_gets_only_its_block(tmp_path):
    save_state_dict({"w": dist.shard_tensor(FLOATS, MESH, [S0, S1])}, tmp_path / "ckpt")
    out = load_state_dict({"w": zeros_like_on(FLOATS, MESH4, [S0])}, tmp_path / "ckpt")["w"]
    assert {s.data.shape for s in out.physical.addressable_shards} == {(2, 8)}
    assert_bits_equal(out.local(2), FLOATS[4:6])


def test_nested_dict_of_mixed_leaves(tmp_path):
    sharding = jax.sharding.NamedSharding(MESH.to_jax(), jax.sharding.PartitionSpec("mp"))
    key = jax.random.key(7)
    state = {
        "model": {"linear": {"weight": dist.shard_tensor(FLOATS, MESH, [S1, S0]),
                             "bias": jax.device_put(INTS[0], sharding)}},
        "host": np.arange(5, dtype=np.int64), "step": 12, "lr": 0.25, "flag": True,
        "scale": np.float32(1.5), "rng": key, "layers": [INTS[1, :4], INTS[2, :4]],
    }
    save_state_dict(state, tmp_path / "ckpt")

    inner = {"weight": zeros_like_on(FLOATS, MESH4, [S0]),
             "bias": jnp.zeros(16, jnp.int32)}
    layers = [np.zeros(4, np.int32), jnp.zeros(4, jnp.int32)]
    target = {"model": {"linear": inner}, "host": np.zeros(5, np.int64), "step": 0, "lr": 0.0,
              "flag": False, "scale": np.float32(0), "rng": jax.random.key(0), "layers": layers}
    loaded = load_state_dict(target, tmp_path / "ckpt")

    w = loaded["model"]["linear"]["weight"]
    assert w.mesh == MESH4 and w.placements == [S0]
    assert_bits_equal(w.numpy(), FLOATS)
    assert_bits_equal(loaded["model"]["linear"]["bias"], INTS[0])
    assert isinstance(loaded["host"], np.ndarray)
    assert_bits_equal(loaded["host"], np.arange(5, dtype=np.int64))
    assert loaded["step"] == 12 and type(loaded["step"]) is int
    assert loaded["lr"] == 0.25 and type(loaded["lr"]) is float
    assert loaded["flag"] is True
    assert loaded["scale"] == np.float32(1.5) and loaded["scale"].dtype == np.float32
    assert_bits_equal(jax.random.key_data(loaded["rng"]), jax.random.key_data(key))
    assert isinstance(loaded["layers"][0], np.ndarray) and isinstance(loaded["layers"][1], jax.Array)
    assert_bits_equal(loaded["layers"][1], INTS[2, :4])
    # the caller's own nested dicts and lists were filled in place
    assert inner["weight"] is w and layers[0] is loaded["layers"][0] and target["step"] == 12


def test_optax_adam_state_of_disttensors(tmp_path):
    params = {"w": jnp.asarray(FLOATS[:, :4]), "b": jnp.linspace(-1.0, 1.0, 8)}
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda p: jnp.sin(p * 3.0), params)
    _, opt_state = opt.update(grads, opt_state, params)
    as_dist = lambda a, mesh, pl: dist.shard_tensor(a, mesh, pl if a.ndim else [R] * mesh.ndim)  # noqa: E731
    state = {"opt": jax.tree.map(lambda a: as_dist(a, MESH, [S0, R]), opt_state)}
    save_state_dict(state, tmp_path / "ckpt")

    target = {"opt": jax.tree.map(lambda a: as_dist(jnp.zeros_like(a), MESH4, [R]), opt_state)}
    loaded = load_state_dict(target, tmp_path / "ckpt")
    adam = loaded["opt"][0]
    assert type(adam).__name__ == "ScaleByAdamState" and int(adam.count.numpy()) == 1
    for got, want in zip(jax.tree.leaves(loaded, is_leaf=lambda x: isinstance(x, dist.DistTensor)),
                         jax.tree.leaves(opt_state)):
        assert got.mesh == MESH4 and got.placements == [R]
        assert_bits_equal(got.numpy(), want)


def test_async_save_is_complete_after_wait(tmp_path):
    big = np.arange(512 * 512, dtype=np.float32).reshape(512, 512)
    handle = save_state_dict({"w": dist.shard_tensor(big, MESH, [S0, S1])}, tmp_path / "a",
                             async_save=True)
    handle.wait()
    assert handle.done() and os.path.isfile(tmp_path / "a" / "_CHECKPOINT_METADATA")
    out = load_state_dict({"w": zeros_like_on(big, MESH4, [S1])}, tmp_path / "a")["w"]
    assert_bits_equal(out.numpy(), big)
    # a later load (or save, or exit) waits for a save nobody waited on
    save_state_dict({"w": big + 1}, tmp_path / "b", async_save=True)
    assert_bits_equal(load_state_dict({"w": np.zeros_like(big)}, tmp_path / "b")["w"], big + 1)
    wait_for_saves()


@pytest.mark.skipif((3, 12, 0) <= sys.version_info[:3] < (3, 12, 3),
                    reason="issue 5 (async checkpoints): CPython 3.12.0-3.12.2 start no threads "
                           "at exit (cpython#113964); save_state_dict warns there instead")
def test_exit_waits_for_an_async_save(tmp_path):
    script = (f"import numpy as np\nfrom autoshard.training.checkpoint import save_state_dict\n"
              f"save_state_dict({{'w': np.arange(1 << 20)}}, {str(tmp_path / 'c')!r}, "
              f"async_save=True)\n")
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    out = load_state_dict({"w": np.zeros(1 << 20, np.int64)}, tmp_path / "c")["w"]
    assert_bits_equal(out, np.arange(1 << 20))


def test_saving_again_replaces_the_checkpoint(tmp_path):
    save_state_dict({"w": INTS}, tmp_path / "ckpt")
    save_state_dict({"w": INTS + 1}, tmp_path / "ckpt")
    assert_bits_equal(load_state_dict({"w": np.zeros_like(INTS)}, tmp_path / "ckpt")["w"], INTS + 1)


# -- errors ---------------------------------------------------------------------------------------

@pytest.fixture()
def saved(tmp_path):
    path = tmp_path / "ckpt"
    save_state_dict({"model": {"w": dist.shard_tensor(FLOATS, MESH, [S0, S1])},
                     "step": 3}, path)
    return path


def test_missing_key_is_named(saved):
    target = {"model": {"w": zeros_like_on(FLOATS, MESH4, [R]), "bias": np.zeros(8, np.float32)}}
    with pytest.raises(CheckpointError, match=r"'model\.bias' is not in checkpoint .*ckpt"):
        load_state_dict(target, saved)


def test_wrong_shape_is_named(saved):
    target = {"model": {"w": zeros_like_on(FLOATS[:4], MESH4, [R])}}
    with pytest.raises(CheckpointError, match=r"'model\.w' has global shape \[8, 8\].*\[4, 8\]"):
        load_state_dict(target, saved)


def test_wrong_dtype_is_named(saved):
    target = {"model": {"w": zeros_like_on(np.zeros((8, 8), np.int32), MESH4, [R])}}
    with pytest.raises(CheckpointError, match=r"'model\.w' is float32 in .* target is int32"):
        load_state_dict(target, saved)
    with pytest.raises(CheckpointError, match=r"'step' is int64 .* target is float64"):
        load_state_dict({"step": 0.0}, saved)


# On a broken file orbax stops at the first failed read; tensorstore's other reads finish after
# orbax closed its event loop, and Python reports that as an unraisable exception.
TENSORSTORE_NOISE = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@TENSORSTORE_NOISE
@pytest.mark.parametrize("damage", ["missing dir", "not a checkpoint", "no metadata",
                                    "truncated data", "deleted data"])
def test_broken_checkpoint_names_the_path(saved, tmp_path, damage):
    path = saved
    if damage == "missing dir":
        path = tmp_path / "nowhere"
    elif damage == "not a checkpoint":
        path = tmp_path / "other"
        path.mkdir()
        (path / "notes.txt").write_text("hello")
    elif damage == "no metadata":
        os.remove(path / "_METADATA")
    else:
        files = glob.glob(str(path / "d" / "*"))
        assert files
        for f in files:
            if damage == "deleted data":
                os.remove(f)
            else:
                data = open(f, "rb").read()
                open(f, "wb").write(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=str(path)):
        load_state_dict({"model": {"w": zeros_like_on(FLOATS, MESH4, [R])}}, path)


@TENSORSTORE_NOISE
def test_corrupt_array_data_names_the_key(tmp_path):
    # Big enough that its chunks live in data files of their own, read only at restore time.
    big = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)
    save_state_dict({"model": {"big": big, "small": INTS[0]}}, tmp_path / "ckpt")
    data = max(glob.glob(str(tmp_path / "ckpt" / "ocdbt.process_*" / "d" / "*")),
               key=os.path.getsize)
    content = open(data, "rb").read()
    open(data, "wb").write(content[:len(content) // 2])
    target = {"model": {"big": np.zeros_like(big), "small": np.zeros(16, np.int32)}}
    with pytest.raises(CheckpointError, match=r"reading 'model\.big' from checkpoint .*ckpt"):
        load_state_dict(target, tmp_path / "ckpt")


def test_non_array_leaf_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"cannot save 'meta\.name': it is a str"):
        save_state_dict({"w": INTS, "meta": {"name": "gpt"}}, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="no arrays"):
        save_state_dict({}, tmp_path / "ckpt")


def _dist_model():
    w = dist.shard_tensor(np.ones((16, 8), np.float32), MESH, [R, S1])
    return dist.to_static((lambda p, x: x @ p["w"], {"w": w}), None,
                          lambda o, t: jnp.mean((o - t) ** 2), optax.sgd(0.1))


@pytest.mark.parametrize("call", ["save", "load", "save nested"])
def test_a_dist_model_passed_for_its_state_dict_says_what_to_pass(tmp_path, saved, call):
    """dist.save_state_dict(dist_model, path), Paddle's habit with layers: the error names the
    state dict to pass (it said "cannot save ''" and to drop the entry)."""
    model, path = _dist_model(), tmp_path / "other"
    if call == "save nested":
        with pytest.raises(CheckpointError, match=r"cannot save 'model': it is a DistModel .*"
                                                  r"save its state, dist_model\.state_dict\(\), "
                                                  r"in its place"):
            save_state_dict({"model": model, "step": 1}, path)
    else:
        with pytest.raises(CheckpointError, match=r"the state dict is a DistModel, not a dict of "
                                                  r"name -> array: pass dist_model\.state_dict\(\) "
                                                  r"\(to load: sd = dist_model\.state_dict\(\); "
                                                  r"dist.load_state_dict\(sd, path\); "
                                                  r"dist_model\.set_state_dict\(sd\)\)"):
            save_state_dict(model, path) if call == "save" else load_state_dict(model, saved)
    assert not os.path.exists(path)


def test_an_abstract_target_says_to_make_a_disttensor(saved):
    """orbax's usual target, a jax.ShapeDtypeStruct: the error names dist.dtensor_from_fn."""
    target = {"model": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}, "step": 0}
    with pytest.raises(CheckpointError, match=r"'model\.w': the target is a ShapeDtypeStruct.*"
                                              r"dist\.dtensor_from_fn\(jnp\.zeros, mesh, "
                                              r"placements, \(8, 8\), jnp\.float32\)"):
        load_state_dict(target, saved)


def test_refuses_to_overwrite_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        save_state_dict({"w": INTS}, tmp_path / "data")
    assert (tmp_path / "data" / "train.txt").read_text() == "keep me"


def test_flax_nnx_state_round_trip(tmp_path):
    from flax import nnx  # a dependency: its absence is a failure, not a skip

    class Net(nnx.Module):
        def __init__(self, seed):
            self.linear = nnx.Linear(8, 4, rngs=nnx.Rngs(seed))
            self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(seed + 1))

    trained = Net(0)
    save_state_dict(nnx.state(trained), tmp_path / "ckpt")
    fresh = Net(1)
    nnx.update(fresh, load_state_dict(nnx.state(fresh), tmp_path / "ckpt"))
    for got, want in zip(jax.tree.leaves(nnx.state(fresh)), jax.tree.leaves(nnx.state(trained))):
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        assert_bits_equal(got, want)


def test_a_disttensor_of_prng_keys_loads_onto_another_mesh_and_split(tmp_path):
    # a batch of keys split unevenly (6 over 4) on one mesh, loaded split on 3 devices, whole,
    # and into a plain key array; a plain key array loads into a split DistTensor of keys
    keys = jax.random.split(jax.random.key(4), 6)
    data = np.asarray(jax.random.key_data(keys))
    save_state_dict({"k": dist.shard_tensor(keys, MESH, [R, S0]), "plain": keys}, tmp_path / "c")
    mesh3 = dist.ProcessMesh([1, 2, 5], dim_names=["x"])
    fresh = jax.random.split(jax.random.key(0), 6)
    for target in [dist.shard_tensor(fresh, mesh3, [S0]), dist.shard_tensor(fresh, MESH1, [R])]:
        got = load_state_dict({"k": target, "plain": dist.shard_tensor(fresh, mesh3, [S0])},
                              tmp_path / "c")
        for value in got.values():
            assert jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
            assert_bits_equal(dist.jit(jax.random.key_data)(value).numpy(), data)
        assert got["k"].mesh == target.mesh and got["k"].placements == target.placements
    got = load_state_dict({"k": fresh}, tmp_path / "c")["k"]
    assert_bits_equal(jax.random.key_data(got), data)


def test_a_zero_size_leaf_is_named_before_anything_is_written(tmp_path):
    empty = dist.shard_tensor(np.zeros((0, 4), np.float32), MESH, [S0, S1])
    with pytest.raises(CheckpointError, match=r"cannot save 'opt.e': it has zero size "
                                              r"\(shape \(0, 4\)\).*drop it"):
        save_state_dict({"w": np.ones(3), "opt": {"e": empty}}, tmp_path / "c")
    assert not os.path.exists(tmp_path / "c")


# -- numbers, odd names and failed saves ------------------------------------------------------------

@pytest.mark.parametrize("target", ["int32", "jax int32", "DistTensor int32", "uint32", "int"])
@pytest.mark.parametrize("value", [7, -3, 2**31 - 1, 2**40 + 5, np.uint64(2**64 - 1)],
                         ids=["7", "-3", "int32 max", "2**40+5", "uint64 max"])
def test_a_saved_number_loads_exactly_or_is_an_error_never_wrapped(tmp_path, value, target):
    """A number saves at its own width (a Python int as int64) and loads into any integer
    target it fits; one it does not fit is a CheckpointError (the cast wrapped 2**40 + 5 into
    int32 as 5, silently)."""
    save_state_dict({"n": value}, tmp_path / "c")
    make = {"int32": lambda: np.int32(0), "jax int32": lambda: jnp.zeros((), jnp.int32),
            "DistTensor int32": lambda: dist.shard_tensor(np.int32(0), MESH4, [R]),
            "uint32": lambda: np.uint32(0), "int": lambda: 0}[target]
    bits = "uint" if target == "uint32" else "int"
    fits = target == "int" or np.iinfo(f"{bits}32").min <= int(value) <= np.iinfo(f"{bits}32").max
    if not fits:
        with pytest.raises(CheckpointError, match=r"'n' is .* which the target's u?int32 cannot "
                                                  r"hold: make the target a wider type"):
            load_state_dict({"n": make()}, tmp_path / "c")
        return
    got = load_state_dict({"n": make()}, tmp_path / "c")["n"]
    assert int(np.asarray(got)) == int(value)
    if target != "int":
        assert np.asarray(got).dtype == np.dtype(f"{bits}32")


def test_numbers_a_checkpoint_cannot_hold_are_named_before_anything_is_written(tmp_path):
    with pytest.raises(CheckpointError, match=r"the Python int 9223372036854775808 lies outside "
                                              r"int64"):
        save_state_dict({"n": 2**63}, tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"cannot save 'q': orbax's storage .* no uint4 "
                                              r"type; save x.astype\(jnp.uint8\)"):
        save_state_dict({"q": jnp.zeros(4, jnp.uint4)}, tmp_path / "c")
    assert not os.path.exists(tmp_path / "c")
    # a numpy bool scalar (np.all(...)) saves as the other numpy scalars do
    save_state_dict({"done": np.all(INTS > -2**31), "n": np.float32(2.5)}, tmp_path / "c")
    got = load_state_dict({"done": np.False_, "n": np.float32(0)}, tmp_path / "c")
    assert got["done"] is np.True_ and got["n"] == np.float32(2.5)


@pytest.mark.parametrize("name", ["ckpt-dp[2x4]", "run[1]", "step*", "a?b"])
def test_a_directory_name_with_glob_characters_saves_and_loads(tmp_path, name):
    """orbax's commit reads the name as a glob pattern: `[2x4]` wrote a checkpoint that did
    not load ("not a complete checkpoint"); it is now written under another name and moved."""
    save_state_dict({"w": dist.shard_tensor(FLOATS, MESH, [S0, S1])}, tmp_path / name)
    save_state_dict({"w": dist.shard_tensor(FLOATS + 1, MESH, [S0, S1])}, tmp_path / name)
    got = load_state_dict({"w": zeros_like_on(FLOATS, MESH4, [S1])}, tmp_path / name)["w"]
    assert_bits_equal(got.numpy(), FLOATS + 1)
    assert sorted(os.listdir(tmp_path)) == [name]  # no staging directory left behind


@pytest.mark.parametrize("fails", ["before writing", "while committing"])
def test_a_failed_save_keeps_the_checkpoint_it_would_have_replaced(tmp_path, monkeypatch, fails):
    """A save writes beside the checkpoint and replaces it once complete: with orbax's `force`
    the old one was deleted first, so a failed save (a full disk, a killed commit) lost both."""
    import orbax.checkpoint as ocp

    save_state_dict({"w": INTS}, tmp_path / "latest")

    close = ocp.AsyncCheckpointer.close

    def broken(self, *args, **kwargs):
        if fails == "while committing":  # the background write ends, then reports a failure
            close(self)
        raise OSError("No space left on device")

    monkeypatch.setattr(ocp.AsyncCheckpointer, "save" if fails == "before writing" else "close",
                        broken)
    with pytest.raises(CheckpointError, match="No space left on device"):
        save_state_dict({"w": INTS + 1}, tmp_path / "latest")
    monkeypatch.undo()
    wait_for_saves()
    assert_bits_equal(load_state_dict({"w": np.zeros_like(INTS)}, tmp_path / "latest")["w"], INTS)
    save_state_dict({"w": INTS + 2}, tmp_path / "latest")  # and the next save goes through
    assert_bits_equal(load_state_dict({"w": np.zeros_like(INTS)}, tmp_path / "latest")["w"],
                      INTS + 2)


def test_entries_named_like_a_models_run_state_are_checked_in_a_users_own_dict(tmp_path):
    """DistModel's gm.* / amp.* entries may be absent from a checkpoint (one saved without
    gradient merge); a user's own {"gm": generator, "dm": discriminator} was skipped by that
    prefix, silently, leaving the generator at its initial values."""
    save_state_dict({"dm": {"w": INTS}}, tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"'gm.w' is not in checkpoint"):
        load_state_dict({"gm": {"w": np.zeros_like(INTS)}, "dm": {"w": np.zeros_like(INTS)}},
                        tmp_path / "c")


@pytest.mark.parametrize("placed", [False, True], ids=["jax keys", "DistTensor of keys"])
def test_keys_of_another_prng_implementation_are_named_as_such(tmp_path, placed):
    """rbg keys are 4 words, threefry's 2: loading one into the other named the shapes of the
    key data ([6, 4] against [6, 2]), not the implementations."""
    save_state_dict({"k": jax.random.split(jax.random.key(0, impl="rbg"), 8)}, tmp_path / "c")
    target = jax.random.split(jax.random.key(1), 8)
    if placed:
        target = dist.shard_tensor(target, MESH4, [S0])
    with pytest.raises(CheckpointError, match=r"'k' holds PRNG keys of 4 words each .* target's "
                                              r"are 2 words \(threefry2x32\): .*impl='rbg'"):
        load_state_dict({"k": target}, tmp_path / "c")
