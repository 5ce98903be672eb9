"""Several processes, one mesh: `python -m autoshard.launch` starts them, `init_parallel_env`
joins them; training across processes equals one device; a failing process fails the launch."""
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _launch(script: pathlib.Path, nproc: int = 2, devices: int = 4, timeout: float = 600,
            args: tuple[str, ...] = (), flags: tuple[str, ...] = ()):
    env = dict(os.environ)  # the launcher replaces the device count, keeps the other flags
    if "--timeout" not in flags:  # a hung launch then fails with every rank's stack shown
        flags = ("--timeout", str(timeout - 30), *flags)
    return subprocess.run([sys.executable, "-m", "autoshard.launch", "--nproc", str(nproc),
                           "--devices", str(devices), *flags, str(script), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_dp_across_processes_tp_inside_equals_one_device():
    """examples/multiprocess.py: each process feeds only its half of every batch."""
    out = _launch(ROOT / "examples" / "multiprocess.py")
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] process {rank} of 2: 4 devices of 8" in out.stdout
        assert f"[rank {rank}] process {rank}: every loss and weight equals" in out.stdout
    assert "peer ranks" not in out.stdout  # gloo's connection chatter is dropped


SCRIPT = '''
import os, sys
import autoshard as dist
dist.init_parallel_env()
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
R, S = dist.Replicate(), dist.Shard
mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
init = np.random.default_rng(0)
UP = init.normal(size=(32, 128)).astype("float32") * 0.1
DOWN = init.normal(size=(128, 32)).astype("float32") * 0.1

class MLP(nnx.Module):
    def __init__(self, placed):
        up, down = UP, DOWN
        if placed:
            up, down = dist.shard_tensor(up, mesh, [R, S(1)]), dist.shard_tensor(down, mesh, [R, S(0)])
        self.up, self.down = nnx.Param(up), nnx.Param(down)
    def __call__(self, x):
        return jax.nn.gelu(x @ self.up) @ self.down

rng = np.random.default_rng(1)
data = [(rng.normal(size=(8, 32)).astype("float32"), rng.normal(size=(8, 32)).astype("float32"))
        for _ in range(3)]
mse = lambda o, l: jnp.mean((o - l) ** 2)
loader = dist.shard_dataloader(data, meshes=mesh, shard_dims="dp")
model = MLP(True)
dm = dist.to_static(model, loader, mse, dist.shard_optimizer(optax.adamw(1e-2), dist.ShardingStage1("dp")))
losses = [float(dm(x, y).numpy()) for x, y in loader()]

with jax.default_device(jax.local_devices()[0]):
    ref = MLP(False)
    opt = nnx.Optimizer(ref, optax.adamw(1e-2), wrt=nnx.Param)
    @nnx.jit
    def step(m, opt, x, y):
        loss, g = nnx.value_and_grad(lambda m: mse(m(x), y))(m)
        opt.update(m, g)
        return loss
    ref_losses = [float(step(ref, opt, x, y)) for x, y in data]
np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
np.testing.assert_allclose(model.down[...].numpy(), np.asarray(ref.down[...]), rtol=1e-4, atol=1e-6)

# a checkpoint written by both processes, read back into a fresh state dict
path = sys.argv[1] if len(sys.argv) > 1 else os.environ["CKPT"]
state = dm.state_dict()
dist.save_state_dict(state, path)
target = {k: dist.shard_tensor(np.zeros(v.shape, v.dtype), v.mesh, v.placements) for k, v in state.items()}
dist.load_state_dict(target, path)
for k in state:
    np.testing.assert_array_equal(target[k].numpy(), state[k].numpy())
print(f"process {jax.process_index()}: to_static, ZeRO-1 and the checkpoint equal one device")
'''


def test_to_static_zero1_and_checkpoints_across_processes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    os.environ["CKPT"] = str(tmp_path / "ckpt")
    try:
        out = _launch(script)
    finally:
        del os.environ["CKPT"]
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] process {rank}: to_static, ZeRO-1 and the checkpoint" in out.stdout


@pytest.mark.parametrize("script,expect", [
    # mesh0 = ranks 0..3 (process 0), mesh1 = ranks 4..7 (process 1): as written (dist.jit
    # cut), to_static with a 1F1B pipeline, explicit stages
    ("seed_hybrid.py", ["§4.4 as written", "§4.4 pipelined", "§4.4 as stages"]),
    # four stages, two per process, under FThenB, 1F1B, VPP and ZBH1
    ("pipeline.py", ["FThenB m=4", "1F1B m=4", "ZBH1 m=4"]),
    # a flax transformer: parallelize's pp_config puts a stage in each process, dp x mp inside
    ("pipeline_gpt.py", ["pipelined  losses"]),
])
def test_pipeline_examples_with_stages_in_different_processes_equal_one_device(script, expect):
    """Every activation and gradient crossing a stage boundary moves between the processes."""
    out = _launch(ROOT / "examples" / script)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        for text in expect:
            assert f"[rank {rank}] {text}" in out.stdout
        assert f"[rank {rank}] every loss and weight equals the one-device run" in out.stdout


MOVES = """import autoshard as dist
dist.init_parallel_env()
import jax, numpy as np
from autoshard.reshard import sends
R, S, P = dist.Replicate(), dist.Shard, dist.Partial
me = jax.process_index()
A = dist.ProcessMesh([[0, 1], [2, 3]], ["x", "y"])          # process 0
B = dist.ProcessMesh([[4, 5], [6, 7]], ["x", "y"])          # process 1
B1 = dist.ProcessMesh([7, 6, 5, 4], ["z"])                  # process 1, reordered
W = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])  # both
rng = np.random.default_rng(0)
x = rng.normal(size=(8, 12)).astype("float32")
xa = dist.shard_tensor(x, A, [S(0), S(1)])
# one round: each of A's 4 devices sends its [4, 6] block to the device of B at its position
before = dict(sends.STATS)
xb = dist.reshard(xa, B, [S(0), S(1)])
rounds = sends.STATS["rounds"] - before["rounds"]
got = sends.STATS["received_bytes"] - before["received_bytes"]
assert rounds == 1, rounds
assert got == (4 * 4 * 6 * 4 if me == 1 else 0), got
devs = tuple(sorted(list(A.devices().flat) + list(B.devices().flat), key=lambda d: d.id))
hlo = sends.permute_program(devs, tuple((i, i + 4) for i in range(4))).lower(
    jax.ShapeDtypeStruct((8, 4, 6), np.float32, sharding=jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(devs), ("_send",)), jax.sharding.PartitionSpec("_send")))
).compile().as_text()
assert "collective-permute" in hlo and "{0,4},{1,5},{2,6},{3,7}" in hlo, hlo
np.testing.assert_array_equal(xb.numpy(), x)
cases = [
    (x, A, [S(0), S(1)], B1, [S(1)]),
    (x, A, [R, S(0)], B, [S(1), R]),
    (rng.normal(size=(7, 5)).astype("float32"), A, [S(0), S(1)], B, [S(1), S(0)]),  # uneven
    (x, W, [S(0), S(1)], B, [R, S(0)]),     # both processes -> one
    (x, B, [S(1), S(0)], W, [S(1), R]),     # one -> both
    (np.float32(3.5), A, [R, R], B1, [R]),  # 0-d
]
for k, (v, m1, p1, m2, p2) in enumerate(cases):
    there = dist.reshard(dist.shard_tensor(v, m1, p1), m2, p2)
    assert (there.mesh, there.placements) == (m2, p2)
    np.testing.assert_array_equal(there.numpy(), v, err_msg=str(k))
    back = dist.reshard(there, m1, p1)
    np.testing.assert_array_equal(back.numpy(), v, err_msg=str(k))
# a Partial value: reduced (or reduce-scattered) on its way over
xp = dist.reshard(xa, A, [dist.Partial(), S(1)])
for p2 in ([S(0), R], [dist.Partial(), R]):
    there = dist.reshard(xp, B, p2)
    np.testing.assert_allclose(there.numpy(), x, rtol=1e-6)
# a Partial tensor over both processes, mapped by jax.tree.map in every process: its value,
# reduced across them (a collective both run), not its parts
xw = dist.reshard(dist.shard_tensor(x, W, [R, S(1)]), W, [dist.Partial(), S(1)])
mapped = jax.tree.map(lambda t: t * t + 1, {"w": xw})["w"]
assert mapped.placements == [R, S(1)], mapped.placements
np.testing.assert_allclose(mapped.numpy(), x * x + 1, rtol=1e-5)
print(f"process {me}: every move between the processes' meshes equals its input", flush=True)
"""


def test_reshards_between_the_meshes_of_different_processes_equal_their_input(tmp_path):
    """Blocks move between processes by collective permutes (reshard/sends.py): one round when
    each device sends one block, the received bytes are the destination blocks, the compiled
    round is a collective-permute; meshes of one process, of both, reordered, uneven, 0-d and
    Partial values, there and back; .numpy() of a value on the other process's mesh."""
    script = tmp_path / "moves.py"
    script.write_text(MOVES)
    out = _launch(script)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert (f"[rank {rank}] process {rank}: every move between the processes' meshes "
                f"equals its input") in out.stdout


ACROSS = """import autoshard as dist
dist.init_parallel_env()
import jax, numpy as np
R, S, P = dist.Replicate(), dist.Shard, dist.Partial
me = jax.process_index()
W = dist.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])   # dp across the processes, mp inside
T = dist.ProcessMesh([[0, 2], [1, 3]], ["dp", "mp"])   # mp across, dp inside
x = np.arange(48, dtype="float32").reshape(8, 6)
y = np.arange(15, dtype="float32").reshape(5, 3)
# dtensor_from_local: each process places its own devices' blocks (others None, as
# dtensor_to_local gives them, or every block given), a function, one array for all
for mesh in (W, T):
    for pl in ([S(0), S(1)], [S(1), R], [P(), S(0)]):
        back = dist.dtensor_from_local(dist.dtensor_to_local(dist.shard_tensor(x, mesh, pl)), mesh, pl)
        assert back.placements == pl
        np.testing.assert_array_equal(back.numpy(), x)
    t = dist.shard_tensor(y, mesh, [S(0), S(1)])  # uneven: every block given
    blocks = [y[tuple(slice(*b) for b in t.block_bounds(int(d)))] for d in mesh.id_array.flat]
    np.testing.assert_array_equal(dist.dtensor_from_local(blocks, mesh, [S(0), S(1)]).numpy(), y)
    block = lambda c: x[c[0] * 4:(c[0] + 1) * 4, c[1] * 3:(c[1] + 1) * 3]
    np.testing.assert_array_equal(dist.dtensor_from_local(block, mesh, [S(0), S(1)]).numpy(), x)
    np.testing.assert_array_equal(dist.dtensor_from_local(x, mesh, [R, R]).numpy(), x)
try:  # uneven with the other process's blocks unknown: process 0 infers 6 rows, process 1 4
    dist.dtensor_from_local(dist.dtensor_to_local(dist.shard_tensor(y, W, [S(0), R])), W, [S(0), R])
    raise AssertionError("no error")
except dist.LocalDataError as e:
    assert "{0: ([6, 3], 'float32'), 1: ([4, 3], 'float32')}" in str(e), e
# typed PRNG keys onto both processes' devices (jax.device_put refuses them; jax.jit takes them)
import jax.numpy as jnp
keys = jax.random.split(jax.random.key(0), 8)
kt = dist.shard_tensor(keys, W, [S(0), R])
np.testing.assert_array_equal(jax.random.key_data(dist.unshard_dtensor(kt)), jax.random.key_data(keys))
drop = lambda k, v: jnp.where(jax.random.bernoulli(k, 0.5, v.shape), v / 0.5, 0.0)
masked = dist.jit(lambda k, v: drop(k, dist.shard_tensor(v, W, [S(0), S(1)])))(keys[3], x)
with jax.default_device(jax.local_devices()[0]):
    np.testing.assert_array_equal(masked.numpy(), jax.jit(drop)(keys[3], x))
# an unplaced input committed to one local device, and one differentiated eagerly from outside
# (jax.grad(dist.jit(f))(w)): jax asked for a cross-host transfer, and its transpose moved the
# cotangent back to one device, which an array on both processes' devices cannot do
w = np.linspace(-1, 1, 24, dtype="float32").reshape(6, 4)
loss = lambda w, v: jnp.mean((v @ w) ** 2)
xt = dist.shard_tensor(x, W, [S(0), R])
with jax.default_device(jax.local_devices()[0]):
    want_loss, want_grad = jax.value_and_grad(loss)(w, x)
    on_one = jax.device_put(w, jax.local_devices()[1])
    np.testing.assert_allclose(dist.jit(loss)(on_one, xt).numpy(), want_loss, rtol=1e-6)
    np.testing.assert_allclose(dist.shard_tensor(on_one, W, [R, S(1)]).numpy(), w)
    for given in (w, jnp.asarray(w), on_one):
        got_loss, got_grad = jax.value_and_grad(dist.jit(loss))(given, xt)
        np.testing.assert_allclose(np.asarray(got_loss), want_loss, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(got_grad), want_grad, rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(jax.device_put(jax.jit(jax.grad(dist.jit(loss)))(w, xt),
                                  jax.sharding.NamedSharding(W.to_jax(), jax.sharding.PartitionSpec()))
                   .addressable_data(0)), want_grad, rtol=1e-5)
# a dataset split by process: each feeds its rows of the batch dim that spans the processes
rows = x[me * 4:(me + 1) * 4]
split = lambda mesh: dist.shard_dataloader([(rows,)], meshes=mesh, shard_dims="dp",
                                           is_dataset_splitted=True)
np.testing.assert_array_equal(next(iter(split(W)))[0].numpy(), x)
try:  # T's dp lies inside each process: both would feed "the same" rows (read as one array)
    next(iter(split(T)))
    raise AssertionError("no error")
except dist.DataloaderError as e:
    assert "processes 0 and 1 both hold its slices [0, 1]" in str(e) or me == 1, e
print(f"process {me}: every value made across the processes equals its input", flush=True)
"""


def test_values_made_across_processes_equal_their_input(tmp_path):
    """dtensor_from_local placed every block on every process (jax refuses another process's
    devices: 'Expected 2 per-device arrays'); each process now places its own. A typed PRNG
    key (shard_tensor, a dist.jit argument) crashed in jax.device_put, as did an unplaced
    input committed to one local device, or differentiated by jax.grad outside dist.jit. A
    dataset split by process over a mesh dim inside each process was stitched silently from
    different rows."""
    script = tmp_path / "across.py"
    script.write_text(ACROSS)
    out = _launch(script, devices=2)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert (f"[rank {rank}] process {rank}: every value made across the processes equals "
                f"its input") in out.stdout


CHECKPOINTS = """import sys
import autoshard as dist
dist.init_parallel_env()
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
R, S, P = dist.Replicate(), dist.Shard, dist.Partial
me = jax.process_index()
path = sys.argv[1]
M0 = dist.ProcessMesh([0, 1], ["x"])        # process 0
M1 = dist.ProcessMesh([2, 3], ["x"])        # process 1
W = dist.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])  # both
rng = np.random.default_rng(0)
w0 = rng.normal(size=(8, 16)).astype("float32") * 0.1
w1 = rng.normal(size=(16, 8)).astype("float32") * 0.1

class Mlp(nnx.Module):  # a stage in each process
    def __init__(self):
        self.w0 = nnx.Param(dist.shard_tensor(w0, M0, [S(1)]))
        self.w1 = nnx.Param(dist.shard_tensor(w1, M1, [S(0)]))
    def __call__(self, x):
        return dist.reshard(jax.nn.relu(x @ self.w0), M1, [S(0)]) @ self.w1

data = [(rng.normal(size=(4, 8)).astype("float32"), rng.normal(size=(4, 8)).astype("float32"))]
loader = dist.shard_dataloader(data, meshes=[M0, M1], shard_dims="x")
dm = dist.to_static(Mlp(), loader, lambda o, l: jnp.mean((o - l) ** 2), optax.adam(1e-2),
                    dist.Strategy({"pipeline": {"enable": True, "schedule_mode": "1F1B",
                                                "accumulate_steps": 2}}))
for x, y in loader():
    dm(x, y)
state = dm.state_dict()
assert {v.mesh for v in state.values() if isinstance(v, dist.DistTensor)} == {M0, M1}
u = rng.normal(size=(5, 3)).astype("float32")
keys = jax.random.split(jax.random.key(1), 4)
state.update({"uneven": dist.shard_tensor(u, M1, [S(0)]), "partial": dist.shard_tensor(u, M0, [P()]),
              "keys": dist.shard_tensor(keys, M1, [S(0)]), "plain": jnp.asarray(u),
              "plain_key": keys[0]})


def value(v):  # a key's data: keys have no numpy value
    if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
        v = (dist.jit if isinstance(v, dist.DistTensor) else lambda f: f)(jax.random.key_data)(v)
    return v.numpy() if isinstance(v, dist.DistTensor) else np.asarray(v)

want = {k: value(v) for k, v in state.items()}
if me == 0:
    np.savez(path + ".npz", **want)
dist.save_state_dict(state, path)


def zeros(v, mesh=None, placements=None):
    if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
        z = jax.random.split(jax.random.key(0), v.shape[0]) if v.shape else jax.random.key(0)
    else:
        z = np.zeros(v.shape, v.dtype)
    if isinstance(v, dist.DistTensor):
        return dist.shard_tensor(z, mesh or v.mesh, placements or v.placements)
    return jnp.asarray(z) if isinstance(v, jax.Array) else z


def check(target, tag):
    dist.load_state_dict(target, path)
    for k, v in target.items():
        np.testing.assert_array_equal(value(v), want[k], err_msg=f"{tag} {k}")


check({k: zeros(v) for k, v in state.items()}, "same meshes")
# onto the other process's mesh, and onto both, other placements
check({k: zeros(v, M0 if v.mesh == M1 else M1, [R]) if isinstance(v, dist.DistTensor) else zeros(v)
       for k, v in state.items()}, "other process")
check({k: zeros(v, W, [R, R]) if isinstance(v, dist.DistTensor) else zeros(v)
       for k, v in state.items()}, "both")
try:  # per-process plain values: one process's would be written
    dist.save_state_dict({"mine": np.full(3, me, "float32")}, path + "_bad")
    raise AssertionError("no error")
except dist.CheckpointError as e:
    assert "differ between the processes" in str(e), e
print(f"process {me}: a pipeline's state dict saved and loaded across the processes", flush=True)
"""


def test_a_pipeline_state_dict_saved_across_processes_loads_back_there_and_in_one(tmp_path):
    """orbax writes and reads only arrays every process holds: a value on one process's mesh
    (every stage of a pipeline across the processes) failed to save ('list index out of range'
    in one process, 'Cannot serialize host local jax.Array' in the other) and to load (a
    misleading 'missing or corrupt' in one, a gloo timeout in the other); so did a plain
    jax.Array. Loaded here too, in one process onto one mesh, bit for bit."""
    script, path = tmp_path / "checkpoints.py", tmp_path / "ckpt"
    script.write_text(CHECKPOINTS)
    out = _launch(script, devices=2, args=(str(path),))
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert (f"[rank {rank}] process {rank}: a pipeline's state dict saved and loaded across "
                f"the processes") in out.stdout
    import jax
    import numpy as np
    import autoshard as dist
    want = dict(np.load(f"{path}.npz"))
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], ["a", "b"])
    target = {k: dist.shard_tensor(np.zeros_like(v), mesh, [dist.Replicate(), dist.Shard(0)])
              for k, v in want.items() if v.ndim and k not in ("keys", "plain_key")}
    target.update({"opt.0.count": np.int32(0), "plain_key": jax.random.key(0), "keys": (
        dist.shard_tensor(jax.random.split(jax.random.key(0), 4), mesh, [dist.Shard(0)] * 2))})
    dist.load_state_dict(target, path)
    for k, v in target.items():
        if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
            v = jax.random.key_data(dist.unshard_dtensor(v) if k == "keys" else v)
        np.testing.assert_array_equal(v.numpy() if isinstance(v, dist.DistTensor) else v,
                                      want[k], err_msg=k)


SIGNATURES = """import time
import autoshard as dist
dist.init_parallel_env()
import jax, jax.numpy as jnp, numpy as np
from autoshard import agreement
R, S = dist.Replicate(), dist.Shard
me = jax.process_index()
W = dist.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])   # dp across the processes
checks = []  # the processes' comparisons of what they hold (a collective each)
compare = agreement.differences
agreement.differences = lambda *a: checks.append(1) or compare(*a)


def layer(x, p):
    return jnp.tanh(x @ p["w"]) + p["b"]


f = dist.jit(layer)
rng = np.random.default_rng(0)
x = rng.normal(size=(8, 4)).astype("float32")
p = {"w": rng.normal(size=(4, 6)).astype("float32"), "b": rng.normal(size=(6,)).astype("float32")}
placed = {"w": dist.shard_tensor(p["w"], W, [R, S(1)]), "b": dist.shard_tensor(p["b"], W, [R, S(0)])}
xs = dist.shard_tensor(x, W, [S(0), R])
with jax.default_device(jax.local_devices()[0]):
    # (a local block's tanh may round one ulp apart from the whole array's on AVX-512 CPUs)
    want = np.asarray(jax.jit(layer)(x, p))
for args in ((xs, placed), (x, placed)):  # placed and unplaced inputs, agreeing
    before = len(checks)
    got = f(*args)
    assert len(checks) == before + 1, checks  # the first call: one small collective
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    before = len(checks)
    got = f(*args)  # a cache hit: nothing more
    assert len(checks) == before, checks
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
h = dist.jit(layer)
if me == 0:  # a plan asked in one process compares nothing; the first call then does
    h.plan(xs, placed)
before = len(checks)
np.testing.assert_allclose(h(xs, placed).numpy(), want, rtol=1e-5, atol=1e-6)
assert len(checks) == before + 1, checks
loss = lambda fn, x: lambda p: jnp.sum(fn(x, p) ** 2)  # under jax.grad: the check runs outside it
with jax.default_device(jax.local_devices()[0]):
    want = jax.grad(loss(layer, x))(p)
got = jax.grad(loss(f, xs))(placed)
for k in p:
    np.testing.assert_allclose(dist.DistTensor.numpy(got[k]), want[k], rtol=1e-4, atol=1e-6)


def refused(args, *texts):
    start = time.monotonic()
    try:
        f(*args)
    except dist.ParallelEnvError as e:
        assert time.monotonic() - start < 30, time.monotonic() - start
        for text in texts:
            assert text in str(e), (text, str(e))
        return
    raise AssertionError("no error")


# process 1 splits w by rows, or passes x as int32 (both signatures new in both processes: a
# process calling with one it called before runs that program, and compares nothing)
refused((xs, {"w": dist.shard_tensor(p["w"], W, [R, R if me == 0 else S(0)]), "b": placed["b"]}),
        "argument 1['w'] differs",
        "process 0: float32[4, 6] placed [dp: R, mp: R] on ProcessMesh([[0, 1], [2, 3]]",
        "process 1: float32[4, 6] placed [dp: R, mp: S(0)] on ProcessMesh([[0, 1], [2, 3]]",
        "must call layer with the same global shapes")
refused((x.astype("float16" if me == 0 else "int32"), placed), "argument 0 differs",
        "process 0: float16[8, 4] not placed", "process 1: int32[8, 4] not placed")
print(f"process {me}: agreeing calls equal one device, disagreeing ones are refused", flush=True)
own = rng.normal(size=(8, 4 if me == 0 else 6)).astype("float32")  # process 1: (8, 6)
g = dist.jit(layer)
g(own, placed)
"""


def test_processes_calling_a_dist_jit_function_with_different_arguments_all_get_its_error(
        tmp_path):
    """Processes passing a dist.jit function different shapes: one failed tracing with jax's
    TypeError, the other waited in a collective until the launcher stopped it. Now the first
    call of a signature compares it across the processes (one small collective; a cache hit
    none) and every process raises the same ParallelEnvError, naming the argument, each
    process's shape, dtype and placements, the mesh and the line; agreeing calls equal one
    device."""
    script = tmp_path / "signatures.py"
    script.write_text(SIGNATURES)
    line = SIGNATURES.splitlines().index("g(own, placed)") + 1
    start = time.monotonic()
    out = _launch(script, devices=2, flags=("--timeout", "300"))
    took = time.monotonic() - start
    assert out.returncode == 1, out.stdout + out.stderr
    assert took < 150, took  # well under the launcher's timeout: no rank waits for another
    for rank in (0, 1):
        assert (f"[rank {rank}] process {rank}: agreeing calls equal one device, disagreeing "
                f"ones are refused") in out.stdout, out.stdout
        for text in (f"[rank {rank}] autoshard.parallel_env.ParallelEnvError: layer: the 2 "
                     f"processes called it with different arguments — argument 0 differs:",
                     f"[rank {rank}]     process 0: float32[8, 4] not placed",
                     f"[rank {rank}]     process 1: float32[8, 6] not placed",
                     f"(called at signatures.py:{line})",
                     "one program over the same global values on ProcessMesh([[0, 1], [2, 3]], "
                     "dim_names=['dp', 'mp']), so every process must call layer with the same "
                     "global shapes",
                     f"[rank {rank}]   (at signatures.py:{line})"):
            assert text in out.stdout, (text, out.stdout)
    assert "TypeError" not in out.stdout, out.stdout


def test_dist_jit_in_one_process_compares_nothing(monkeypatch):
    """The processes' comparison of a call's signature is for several processes only: one
    process runs no collective for it, on the first call or any other."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    import autoshard as dist
    from autoshard import agreement

    def refuse(*args, **kwargs):
        raise AssertionError("a collective in a single process")

    monkeypatch.setattr(multihost_utils, "process_allgather", refuse)
    assert agreement.differences(b"anything") is None
    agreement.check_call_signature("f", [], [])
    mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
    x = np.arange(32, dtype="float32").reshape(8, 4)
    f = dist.jit(lambda x: jnp.tanh(x) * 2)
    f.plan(dist.shard_tensor(x, mesh, [dist.Shard(0), dist.Replicate()]))
    for _ in range(2):
        got = f(dist.shard_tensor(x, mesh, [dist.Shard(0), dist.Replicate()]))
        np.testing.assert_allclose(got.numpy(), np.tanh(x) * 2, rtol=1e-6)
    assert jax.process_count() == 1 and not f._unagreed


def test_a_failing_process_fails_the_launch_and_stops_the_others(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent('''
        import os, time
        if os.environ["AUTOSHARD_RANK"] == "1":
            raise SystemExit(3)
        time.sleep(120)  # would wait for rank 1 forever
    '''))
    out = _launch(script, timeout=60)
    assert out.returncode == 3


def test_a_rank_that_ignores_sigterm_is_killed_and_timeout_stops_a_hung_launch(tmp_path):
    """A process that joined jax catches SIGTERM (jax's preemption notifier): the launcher
    follows with SIGKILL. `--timeout` stops ranks that would wait forever (exit code 124)."""
    script = tmp_path / "stubborn.py"
    script.write_text(textwrap.dedent('''
        import os, signal, sys, time
        if os.environ["AUTOSHARD_RANK"] == "1" and sys.argv[1] == "fail":
            raise SystemExit(3)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)
    '''))
    for flags, arg, code in (([], "fail", 3), (["--timeout", "2"], "hang", 124)):
        out = subprocess.run([sys.executable, "-m", "autoshard.launch", "--nproc", "2", *flags,
                              str(script), arg], capture_output=True, text=True, timeout=60,
                             cwd=ROOT)
        assert out.returncode == code, out.stdout + out.stderr
    assert "ranks [0, 1] still running after --timeout 2 s" in out.stderr


def test_a_hung_launch_shows_where_each_rank_waits(tmp_path):
    """--timeout stops a launch whose ranks wait for each other; before that, each rank that
    joined (init_parallel_env) prints its Python stack, so the output names the collective
    rank 0 waits in and the line rank 1 is at. A hang in CI had said only 'timed out'."""
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent('''
        import time
        import autoshard as dist
        dist.init_parallel_env()
        import jax, numpy as np
        x = dist.shard_tensor(np.arange(4.0), dist.ProcessMesh([0, 1], ["dp"]), [dist.Shard(0)])
        print("joined", flush=True)
        if jax.process_index() == 1:
            time.sleep(300)  # rank 1 is elsewhere
        print(x.numpy())  # a collective rank 1 never joins
    '''))
    start = time.monotonic()
    out = _launch(script, devices=1, flags=("--timeout", "25"), timeout=120)
    assert out.returncode == 124, out.stdout + out.stderr
    assert time.monotonic() - start < 90
    assert "ranks [0, 1] still running after --timeout 25 s; their Python stacks follow" in \
        out.stderr
    lines = out.stdout.splitlines()
    for rank, at in ((0, "line 10"), (1, "line 9")):  # print(x.numpy()) / time.sleep(300)
        mine = [line for line in lines if line.startswith(f"[rank {rank}] ")]
        assert any("hang.py" in line and at in line for line in mine), out.stdout
    assert any(line.startswith("[rank 0] ") and "creation.py" in line for line in lines), \
        out.stdout  # inside numpy()'s gather


def test_a_rank_raising_after_init_parallel_env_fails_the_launch_promptly(tmp_path):
    """jax's exit waits (5 minutes) for every process to shut down: a rank that raised sat
    there while its peer waited for it in a collective, and the launch hung."""
    script = tmp_path / "raise.py"
    script.write_text(textwrap.dedent('''
        import autoshard as dist
        dist.init_parallel_env()
        import jax, numpy as np
        x = dist.shard_tensor(np.arange(4.0), dist.ProcessMesh([0, 1], ["dp"]), [dist.Shard(0)])
        if jax.process_index() == 1:
            raise RuntimeError("rank 1 fails")
        print(x.numpy())  # a collective rank 1 never joins
    '''))
    out = _launch(script, devices=1, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[rank 1] RuntimeError: rank 1 fails" in out.stdout


def test_init_parallel_env_alone_is_a_no_op(monkeypatch):
    import autoshard as dist
    for key in ("AUTOSHARD_COORDINATOR", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE",
                "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    dist.init_parallel_env()
    import jax
    assert jax.process_count() == 1


def test_init_parallel_env_after_jax_started_names_the_fix(monkeypatch):
    """Under the launcher, a script that asked jax for devices first got jax's raw
    RuntimeError from jax.distributed.initialize."""
    import jax
    import autoshard as dist
    jax.devices()  # the backend is up, as after any array or computation
    monkeypatch.setenv("AUTOSHARD_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("AUTOSHARD_NPROC", "2")
    monkeypatch.setenv("AUTOSHARD_RANK", "1")
    collectives = jax.config.jax_cpu_collectives_implementation
    try:
        with pytest.raises(dist.ParallelEnvError, match=r"process 1 cannot join the other 1 .*"
                           r"call dist.init_parallel_env\(\) first"):
            dist.init_parallel_env()
    finally:
        jax.config.update("jax_cpu_collectives_implementation", collectives)


def test_launch_rejects_no_processes():
    from autoshard.launch import LaunchError, launch
    with pytest.raises(LaunchError, match="--nproc must be at least 1"):
        launch("x.py", nproc=0)
