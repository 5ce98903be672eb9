"""Model state in a scheduled pipeline: dropout RNG counters and BatchNorm statistics are
threaded through each stage's micro-batches, so a pipelined step equals one device accumulating
gradients over the same micro-batches one after another — losses, params and the state after
the step (nnx and linen models, every schedule kind, recompute and ZeRO-3)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import autoshard as dist
from autoshard.training.stages import StageError

R, S = dist.Replicate(), dist.Shard
M0, M1 = dist.ProcessMesh([0, 1, 2, 3], ["dp"]), dist.ProcessMesh([4, 5, 6, 7], ["dp"])
B, D, GROUPS = 16, 8, 4  # GROUPS: the batch's dp shards, each cut into micro-batches


def _data(steps: int = 3):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(B, D)).astype(np.float32),
             rng.normal(size=(B, D)).astype(np.float32)) for _ in range(steps)]


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def _micro(x, m: int, i: int):
    """Micro-batch i as the pipeline cuts it: the i-th part of every dp shard's rows."""
    return x.reshape(GROUPS, m, -1, *x.shape[1:])[:, i].reshape(-1, *x.shape[1:])


class Net(nnx.Module):
    """Linear → BatchNorm → dropout on stage 0; linear → BatchNorm on stage 1."""

    def __init__(self, pipelined: bool = False):
        rngs = nnx.Rngs(0)
        self.l1, self.bn1 = nnx.Linear(D, D, rngs=rngs), nnx.BatchNorm(D, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.l2, self.bn2 = nnx.Linear(D, D, rngs=rngs), nnx.BatchNorm(D, rngs=rngs)
        self.pipelined = pipelined

    def __call__(self, x):
        h = self.drop(jax.nn.relu(self.bn1(self.l1(x))))
        if self.pipelined:
            h = dist.reshard(h, M1, [S(0)])
        return self.bn2(self.l2(h))


def _nnx_one_device(data, m: int):
    """One device: per step, value_and_grad on each micro-batch in turn (the dropout counters
    and BatchNorm statistics advance per micro-batch), then one update with the mean."""
    model = Net()
    model.train()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    grad = nnx.jit(lambda mm, x, y: nnx.value_and_grad(lambda mm: mse(mm(x), y))(mm))
    update = nnx.jit(lambda mm, o, g: o.update(mm, g))
    losses = []
    for x, y in data:
        total, ls = None, []
        for i in range(m):
            loss, g = grad(model, _micro(x, m, i), _micro(y, m, i))
            total = g if total is None else jax.tree.map(jnp.add, total, g)
            ls.append(float(loss))
        update(model, opt, jax.tree.map(lambda t: t / m, total))
        losses.append(np.mean(ls))
    return model, losses


def _variables(model) -> dict:
    return {".".join(map(str, p)): v for p, v in nnx.iter_graph(model)
            if isinstance(v, nnx.Variable) and not isinstance(v, nnx.RngKey)}


def _value(v):
    v = v.get_value()
    return v.numpy() if isinstance(v, dist.DistTensor) else np.asarray(v)


@pytest.mark.parametrize("schedule,m,recompute", [("1F1B", 4, True), ("ZBH1", 2, False)])
def test_nnx_dropout_and_batchnorm_in_a_pipeline_equal_one_device_accumulating(schedule, m,
                                                                               recompute):
    data = _data()
    model = Net(pipelined=True)
    for path, v in nnx.iter_graph(model):
        if isinstance(v, nnx.Param):
            mesh = M1 if path[0] in ("l2", "bn2") else M0
            v.set_value(dist.shard_tensor(np.asarray(v.get_value()), mesh, [R]))
    loader = dist.shard_dataloader(data, meshes=[M0, M1], shard_dims="dp")
    dm = dist.to_static(model, loader, mse, optax.sgd(0.1), dist.Strategy(
        {"pipeline": {"enable": True, "schedule_mode": schedule, "accumulate_steps": m},
         "recompute": {"enable": recompute}}))
    losses = [float(dm(x, y).numpy()) for x, y in loader()]

    ref, ref_losses = _nnx_one_device(data, m)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    want = _variables(ref)
    for path, v in _variables(model).items():  # params, BatchNorm statistics, RNG counters
        np.testing.assert_allclose(_value(v), _value(want[path]), rtol=2e-4, atol=2e-6,
                                   err_msg=path)
    assert int(_value(model.drop.rngs.count)) == 3 * m  # one draw per micro-batch
    # each statistic lives on its BatchNorm's stage, as its scale does
    assert model.bn2.mean.get_value().mesh == M1 and model.bn1.mean.get_value().mesh == M0
    (runner,) = dm._pipeline._runners.values()
    assert (runner.schedule.name, len(runner.stages)) == (schedule, 2)


class LinenNet(nn.Module):
    pipelined: bool = False

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dropout(0.3, deterministic=not train)(jax.nn.relu(nn.Dense(D, name="l1")(x)))
        if self.pipelined:
            h = dist.reshard(h, M1, [S(0)])
        h = nn.Dropout(0.2, deterministic=not train)(nn.Dense(D, name="l2")(h))
        return nn.BatchNorm(use_running_average=not train, name="bn")(h)


def test_linen_dropout_keys_follow_the_step_counter_on_every_stage():
    """A linen model's one RNG counter is read by both stages: each advances its own copy, and
    micro-batch i of step t draws with fold_in(key, t * m + i), as gradient merge does."""
    data, m, key = _data(), 2, jax.random.key(7)
    variables = LinenNet().init(jax.random.key(0), data[0][0])
    placed = {col: jax.tree_util.tree_map_with_path(
        lambda p, x: dist.shard_tensor(np.asarray(x), M1 if p[0].key in ("l2", "bn") else M0,
                                       [R]), tree) for col, tree in variables.items()}
    loader = dist.shard_dataloader(data, meshes=[M0, M1], shard_dims="dp")
    dm = dist.to_static((LinenNet(pipelined=True), placed, {"dropout": key}), loader, mse,
                        optax.sgd(0.1), dist.Strategy({"pipeline": {
                            "enable": True, "schedule_mode": "1F1B", "accumulate_steps": m}}))
    losses = [float(dm(x, y).numpy()) for x, y in loader()]

    net, params, stats = LinenNet(), variables["params"], variables["batch_stats"]

    @jax.jit
    def grad(params, stats, x, y, k):
        def loss(p):
            out, new = net.apply({"params": p, "batch_stats": stats}, x, train=True,
                                 mutable=["batch_stats"], rngs={"dropout": k})
            return mse(out, y), new["batch_stats"]
        (value, stats), g = jax.value_and_grad(loss, has_aux=True)(params)
        return value, g, stats

    ref, step = [], 0
    for x, y in data:
        total, ls = None, []
        for i in range(m):
            value, g, stats = grad(params, stats, _micro(x, m, i), _micro(y, m, i),
                                   jax.random.fold_in(key, step))
            step += 1
            total = g if total is None else jax.tree.map(jnp.add, total, g)
            ls.append(float(value))
        params = jax.tree.map(lambda p, g: p - 0.1 * g / m, params, total)
        ref.append(np.mean(ls))
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert int(np.asarray(dm.state["rng_step"].numpy())) == step == 6
    for name in ("mean", "var"):
        np.testing.assert_allclose(dm.state["batch_stats"]["bn"][name].numpy(),
                                   stats["bn"][name], rtol=1e-5, atol=1e-6)


def test_state_updated_on_another_stage_than_it_is_read_is_an_error():
    """A statistic read on stage 0 but computed from stage 1's activations would make every
    micro-batch of stage 0 wait for stage 1: refused, naming the leaf and the stages."""
    w0 = dist.shard_tensor(np.ones((D, D), np.float32), M0, [R])
    w1 = dist.shard_tensor(np.ones((D, D), np.float32), M1, [R])
    scale = dist.shard_tensor(np.ones((D,), np.float32), M0, [R])

    def fn(params, state, x):
        h = dist.reshard((x @ params[0]) * state["scale"], M1, [S(0)])
        y = h @ params[1]
        return jnp.mean(y ** 2), {"scale": jnp.mean(y, axis=0)}

    runner = dist.PipelineRunner.from_function(fn, "1F1B", 2, stateful=True)
    x = dist.shard_tensor(np.ones((B, D), np.float32), M0, [S(0)])
    with pytest.raises(StageError, match=r"state leaf 0 .* read on stages \[0\] .* made on "
                                         r"stage 1"):
        runner.value_and_grad([w0, w1], x, state={"scale": scale})
    with pytest.raises(StageError, match="pass it as value_and_grad"):
        runner.value_and_grad([w0, w1], x)


def test_explicit_stages_thread_their_state_through_the_micro_batches():
    """PipelineRunner over hand-written stages: stage fns take their state after the loss
    arguments' place and return (output, new state); a running mean per stage comes out as
    one device computes it over the micro-batches in turn."""
    rng = np.random.default_rng(1)
    w = [rng.normal(size=(D, D)).astype(np.float32) for _ in range(2)]
    x, y = rng.normal(size=(B, D)).astype(np.float32), rng.normal(size=(B, D)).astype(np.float32)

    def stage0(p, x, st):
        h = jnp.tanh(x @ p)
        return h, {"mean": 0.9 * st["mean"] + 0.1 * h.mean(0)}

    def stage1(p, h, st, y):
        out = h @ p
        return mse(out, y), {"mean": 0.9 * st["mean"] + 0.1 * out.mean(0), "n": st["n"] + 1}

    m = 4
    runner = dist.PipelineRunner([dist.Stage(stage0, M0), dist.Stage(stage1, M1)], "1F1B", m)
    state = [{"mean": dist.shard_tensor(np.zeros(D, np.float32), M0, [R])},
             {"mean": dist.shard_tensor(np.zeros(D, np.float32), M1, [R]),
              "n": dist.shard_tensor(np.zeros((), np.int32), M1, [R])}]
    params = [dist.shard_tensor(w[0], M0, [R]), dist.shard_tensor(w[1], M1, [R])]
    loss, grads, new = runner.value_and_grad(
        params, dist.shard_tensor(x, M0, [S(0)]), dist.shard_tensor(y, M1, [S(0)]),
        state=state)

    def one_device(ws):
        means, n, losses = [np.zeros(D, np.float32)] * 2, 0, []
        for i in range(m):
            h, st0 = stage0(ws[0], _micro(x, m, i), {"mean": means[0]})
            value, st1 = stage1(ws[1], h, {"mean": means[1], "n": n}, _micro(y, m, i))
            means, n = [st0["mean"], st1["mean"]], st1["n"]
            losses.append(value)
        return sum(losses) / m, (means, n)

    (ref_loss, (means, n)), ref_grads = jax.value_and_grad(one_device, has_aux=True)(w)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    for g, want in zip(grads, ref_grads):
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(new[0]["mean"].numpy(), means[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new[1]["mean"].numpy(), means[1], rtol=1e-5, atol=1e-6)
    assert int(new[1]["n"].numpy()) == n == m
    assert new[1]["mean"].mesh == M1


def test_summary_names_the_state_each_stage_threads():
    model = Net(pipelined=True)
    for path, v in nnx.iter_graph(model):
        if isinstance(v, nnx.Param):
            mesh = M1 if path[0] in ("l2", "bn2") else M0
            v.set_value(dist.shard_tensor(np.asarray(v.get_value()), mesh, [R]))
    data = _data(1)
    loader = dist.shard_dataloader(data, meshes=[M0, M1], shard_dims="dp")
    dm = dist.to_static(model, loader, mse, optax.sgd(0.1), dist.Strategy(
        {"pipeline": {"enable": True, "schedule_mode": "1F1B", "accumulate_steps": 2}}))
    text = dm.summary(*data[0])
    stages = text.split("model state, threaded through each stage's micro-batches:")[1]
    first, second = stages.strip().splitlines()
    assert "bn1.mean" in first and "drop.rngs.count" in first and "bn2" not in first
    assert "bn2.var" in second and "bn1" not in second and "drop" not in second
