"""to_static threads an nnx model's non-Param state (BatchNorm statistics, dropout RNG counters)
through the compiled step and writes it back: training equals nnx + optax on one device."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import flax.linen as linen
from flax import nnx
from flax.traverse_util import flatten_dict

import autoshard as dist

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
R, S = dist.Replicate, dist.Shard
STEPS = 4


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, momentum=0.8, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.down = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(self.drop(jax.nn.relu(self.bn(self.up(x)))))


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def megatron(name, layer, mesh):
    """up column-parallel, down row-parallel, BatchNorm on the up layer's feature shards."""
    placements = {"up": {"kernel": [R(), S(1)], "bias": [R(), S(0)]},
                  "bn": {"scale": [R(), S(0)], "bias": [R(), S(0)]},
                  "down": {"kernel": [R(), S(0)]}}.get(name, {})
    for attr, where in placements.items():
        var = getattr(layer, attr)
        var.set_value(dist.shard_tensor(var.get_value(), mesh, where))


def _batches(n=STEPS + 1):
    rng = np.random.default_rng(3)
    return [(rng.normal(size=(8, 16)).astype(np.float32) * 2 + 1,
             rng.normal(size=(8, 8)).astype(np.float32)) for _ in range(n)]


def _one_device(batches, tx):
    """The same steps written with nnx and optax directly, on one device."""
    model = Net(nnx.Rngs(0, dropout=1))
    model.train()
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    losses = []
    for x, y in batches:
        loss, grads = nnx.value_and_grad(lambda m: mse(m(x), y))(model)
        opt.update(model, grads)
        losses.append(float(loss))
    return model, losses


def _value(v):
    v = v.get_value() if hasattr(v, "get_value") else v
    return np.asarray(v.numpy() if isinstance(v, dist.DistTensor) else v)


@pytest.mark.parametrize("stage", [0, 3], ids=["dp+tp", "dp+tp+zero3"])
def test_batchnorm_and_dropout_train_like_nnx_on_one_device(stage):
    batches = _batches()
    train, held_out = batches[:STEPS], batches[STEPS]
    tx = optax.sgd(0.1)
    ref, ref_losses = _one_device(train, tx)

    model = dist.shard_layer(Net(nnx.Rngs(0, dropout=1)), MESH, megatron)
    strategy = dist.Strategy({"sharding": {"enable": stage > 0, "stage": max(stage, 1)}})
    dist_model = dist.to_static(model, None, mse, tx, strategy)
    # The statistics are placed like BatchNorm's scale: features split over mp.
    assert dist_model.state["bn"]["mean"].placements == [R(), S(0)]
    losses = [float(dist_model(x, y).numpy()) for x, y in train]

    # Same dropout masks (the RNG counter advanced the same way) and same batch statistics.
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert int(_value(model.drop.rngs.count)) == int(_value(ref.drop.rngs.count)) == STEPS
    for name in ("mean", "var"):
        np.testing.assert_allclose(_value(getattr(model.bn, name)), _value(getattr(ref.bn, name)),
                                   rtol=1e-5, atol=1e-6)
        assert not np.allclose(_value(getattr(model.bn, name)), 0.0 if name == "mean" else 1.0)
    # The user's module holds the trained params (written back, as Paddle's layers are).
    np.testing.assert_allclose(_value(model.down.kernel), _value(ref.down.kernel), rtol=1e-5, atol=1e-6)

    # eval uses the running statistics and no dropout; predict returns the outputs.
    ref.eval()
    x, y = held_out
    np.testing.assert_allclose(float(dist_model.eval()(x, y).numpy()), float(mse(ref(x), y)),
                               rtol=1e-5)
    np.testing.assert_allclose(dist_model.predict()(x).numpy(), np.asarray(ref(x)), rtol=1e-4,
                               atol=1e-5)
    assert int(_value(model.drop.rngs.count)) == STEPS   # eval drew no random numbers


def test_state_is_in_the_state_dict_and_loads_into_a_fresh_model():
    batches = _batches()
    model = dist.shard_layer(Net(nnx.Rngs(0, dropout=1)), MESH, megatron)
    dist_model = dist.to_static(model, None, mse, optax.sgd(0.1))
    for x, y in batches[:2]:
        dist_model(x, y)
    sd = dist_model.state_dict("param")
    assert {"state.bn.mean", "state.bn.var", "state.drop.rngs.count", "state.drop.rngs.key"} <= set(sd)

    fresh_model = dist.shard_layer(Net(nnx.Rngs(7, dropout=9)), MESH, megatron)
    fresh = dist.to_static(fresh_model, None, mse, optax.sgd(0.1))
    fresh.set_state_dict(dist_model.state_dict())
    np.testing.assert_array_equal(_value(fresh_model.bn.mean), _value(model.bn.mean))
    # The next step of both draws the same dropout mask: their losses agree exactly.
    x, y = batches[2]
    assert float(fresh(x, y).numpy()) == float(dist_model(x, y).numpy())


def test_gradient_merge_threads_state_through_micro_steps():
    batches = _batches()[:4]
    model = dist.shard_layer(Net(nnx.Rngs(0, dropout=1)), MESH, megatron)
    strategy = dist.Strategy({"gradient_merge": {"enable": True, "k_steps": 2}})
    dist_model = dist.to_static(model, None, mse, optax.sgd(0.1), strategy)
    losses = [float(dist_model(x, y).numpy()) for x, y in batches]

    ref = Net(nnx.Rngs(0, dropout=1))
    graphdef, params, rest = nnx.split(ref, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    tx = optax.sgd(0.1)
    opt_state, acc, ref_losses = tx.init(params), None, []
    for i, (x, y) in enumerate(batches):
        def loss_fn(p, rest=rest):
            m = nnx.merge(graphdef, nnx.State(p), nnx.State(rest))
            out = mse(m(x), y)
            return out, nnx.to_pure_dict(nnx.split(m, nnx.Param, ...)[2])
        (loss, rest), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        ref_losses.append(float(loss))
        acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
        if i % 2 == 1:
            updates, opt_state = tx.update(jax.tree.map(lambda a: a / 2, acc), opt_state, params)
            params, acc = optax.apply_updates(params, updates), None
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_value(model.bn.var), np.asarray(rest["bn"]["var"]),
                               rtol=1e-5)


def test_seed_4_5_as_a_user_writes_it(tmp_path):
    """Seed §4.5 ported: dict batches from shard_dataloader, an nnx.Optimizer passed to
    shard_optimizer, `for step, inputs in enumerate(dataloader())`; then a checkpoint with the
    batch statistics, loaded on 4 devices for evaluation."""
    batches = _batches()
    tx = optax.sgd(0.1, momentum=0.9)
    ref, ref_losses = _one_device(batches[:STEPS], tx)

    model = dist.shard_layer(Net(nnx.Rngs(0, dropout=1)), MESH, megatron)
    dataloader = dist.shard_dataloader([{"x": x, "label": y} for x, y in batches[:STEPS]],
                                       meshes=MESH, input_keys=["x", "label"], shard_dims="dp")
    opt = dist.shard_optimizer(nnx.Optimizer(model, tx, wrt=nnx.Param))
    dist_model = dist.to_static(model, dataloader, mse, opt)
    dist_model.train()
    losses = []
    for step, inputs in enumerate(dataloader()):
        loss = dist_model(inputs)
        losses.append(float(loss.numpy()))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)

    path = str(tmp_path / "ckpt")
    dist.save_state_dict(dist_model.state_dict("param"), path)
    mesh4 = dist.ProcessMesh([0, 1, 2, 3], dim_names=["mp"])
    evaluator = dist.to_static(dist.shard_layer(Net(nnx.Rngs(5, dropout=6)), mesh4), None, mse)
    evaluator.set_state_dict(dist.load_state_dict(evaluator.state_dict("param"), path))
    ref.eval()
    x, y = batches[STEPS]
    np.testing.assert_allclose(float(evaluator.eval()(x, y).numpy()), float(mse(ref(x), y)), rtol=1e-5)


class LinenNet(linen.Module):
    """Dense → BatchNorm → relu → Dense, switched between training and inference by `train`."""

    @linen.compact
    def __call__(self, x, train: bool = True):
        x = linen.Dense(32)(x)
        x = linen.BatchNorm(use_running_average=not train, momentum=0.8)(x)
        return linen.Dense(8)(jax.nn.relu(x))


def _linen_one_device(net, variables, batches, tx, key=None):
    """flax's own training idiom on one device: (params, batch_stats, losses); with `key`,
    step k draws dropout from fold_in(key, k)."""
    params, stats, ref_losses = variables["params"], variables["batch_stats"], []
    opt_state = tx.init(params)
    for k, (x, y) in enumerate(batches):
        rngs = {"dropout": jax.random.fold_in(key, k)} if key is not None else None

        def loss_fn(p):
            out, new = net.apply({"params": p, "batch_stats": stats}, x, train=True,
                                 mutable=["batch_stats"], rngs=rngs)
            return mse(out, y), new["batch_stats"]
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        ref_losses.append(float(loss))
    return params, stats, ref_losses


@pytest.mark.parametrize("form", ["module", "bound_apply"])
def test_linen_batch_stats_train_like_one_device(form):
    """A linen model's non-params collections are the state: mutable in training, read in eval."""
    batches = _batches()
    train, held_out = batches[:STEPS], batches[STEPS]
    net = LinenNet()
    variables = net.init(jax.random.key(0), train[0][0], train=False)
    tx = optax.sgd(0.1)

    params, stats, ref_losses = _linen_one_device(net, variables, train, tx)

    placed = {"params": dist.shard_layer(variables["params"], MESH, lambda name, layer, mesh: {
        "Dense_0": {"kernel": [R(), S(1)], "bias": [R(), S(0)]},
        "BatchNorm_0": {"scale": [R(), S(0)], "bias": [R(), S(0)]},
        "Dense_1": {"kernel": [R(), S(0)]}}.get(name)), "batch_stats": variables["batch_stats"]}
    model = (net if form == "module" else net.apply, placed)
    dist_model = dist.to_static(model, None, mse, tx)
    # the statistics are placed like BatchNorm's scale (features split over mp)
    assert dist_model.state["batch_stats"]["BatchNorm_0"]["mean"].placements == [R(), S(0)]
    losses = [float(dist_model(x, y).numpy()) for x, y in train]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for name in ("mean", "var"):
        got = dist_model.state["batch_stats"]["BatchNorm_0"][name].numpy()
        np.testing.assert_allclose(got, stats["BatchNorm_0"][name], rtol=1e-5, atol=1e-6)
    # eval reads the running statistics (train=False) and leaves them as they are
    x, y = held_out
    before = dist_model.state["batch_stats"]["BatchNorm_0"]["mean"].numpy()
    want = mse(net.apply({"params": params, "batch_stats": stats}, x, train=False), y)
    np.testing.assert_allclose(float(dist_model.eval()(x, y).numpy()), float(want), rtol=1e-5)
    np.testing.assert_array_equal(dist_model.state["batch_stats"]["BatchNorm_0"]["mean"].numpy(),
                                  before)


def test_linen_variables_without_params_is_a_clear_error():
    with pytest.raises(dist.AutoshardError, match="'params' collection"):
        dist.to_static((LinenNet(), {"batch_stats": {}}), None, mse, optax.sgd(0.1))


class LinenDropoutNet(linen.Module):
    """LinenNet with dropout after the BatchNorm: it draws from the 'dropout' stream in training."""

    @linen.compact
    def __call__(self, x, train: bool = True):
        x = linen.BatchNorm(use_running_average=not train, momentum=0.8)(linen.Dense(32)(x))
        x = linen.Dropout(0.3, deterministic=not train)(jax.nn.relu(x))
        return linen.Dense(8)(x)


def test_linen_dropout_draws_step_k_from_fold_in_of_the_given_key(tmp_path):
    """to_static((module, variables, rngs)): train step k runs with {name: fold_in(key, k)} —
    one device's masks, as flax's loop with that key schedule; the step counter is state, so a
    loaded checkpoint draws where the saved model would have."""
    batches = _batches()
    net, key = LinenDropoutNet(), jax.random.key(7)
    variables = net.init(jax.random.key(0), batches[0][0], train=False)
    tx = optax.sgd(0.1)
    params, stats, ref_losses = _linen_one_device(net, variables, batches, tx, key)

    placed = {"params": dist.shard_layer(variables["params"], MESH, lambda name, layer, mesh: {
        "Dense_0": {"kernel": [R(), S(1)], "bias": [R(), S(0)]},
        "Dense_1": {"kernel": [R(), S(0)]}}.get(name)), "batch_stats": variables["batch_stats"]}
    with pytest.raises(dist.AutoshardError, match=r"draws random numbers .*'dropout': jax"):
        dist.to_static((net, placed), None, mse, tx)(*batches[0])
    dist_model = dist.to_static((net, placed, {"dropout": key}), None, mse, tx)
    half = len(batches) // 2
    losses = [float(dist_model(x, y).numpy()) for x, y in batches[:half]]
    assert int(dist_model.state_dict()["state.rng_step"].numpy()) == half
    dist.save_state_dict(dist_model.state_dict(), str(tmp_path / "ckpt"))
    resumed = dist.to_static((net, placed, {"dropout": key}), None, mse, tx)
    sd = resumed.state_dict()
    dist.load_state_dict(sd, str(tmp_path / "ckpt"))
    resumed.set_state_dict(sd)
    losses += [float(resumed(x, y).numpy()) for x, y in batches[half:]]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    # eval draws nothing and leaves the counter where it is
    x, y = batches[0]
    want = mse(net.apply({"params": params, "batch_stats": stats}, x, train=False), y)
    np.testing.assert_allclose(float(resumed.eval()(x, y).numpy()), float(want), rtol=1e-5)
    assert int(resumed.state_dict()["state.rng_step"].numpy()) == len(batches)


class _WithTable(nnx.Module):
    """A constant held as a plain array attribute (a RoPE table, a mask), not a Variable."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.table = jnp.arange(1.0, 5.0)

    def __call__(self, x):
        return self.lin(x) * self.table


class _Blocks(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([_WithTable(rngs) for _ in range(2)])

    def __call__(self, x):
        return self.blocks[1](self.blocks[0](x))


@pytest.mark.parametrize("net", [_WithTable, _Blocks])
def test_a_plain_array_attribute_of_an_nnx_module_trains_like_one_device(net):
    """to_static of an nnx Module holding a plain jax.Array attribute (also inside a list of
    blocks): nnx.split files it with the non-Param state, and writing the step's state back
    raised a raw KeyError on its path."""
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)

    def mse(o, y):
        return jnp.mean((o - y) ** 2)

    model = dist.shard_layer(net(nnx.Rngs(0)), MESH)
    dm = dist.to_static(model, None, mse, optax.sgd(0.1))
    losses = [float(dm(x, x).numpy()) for _ in range(3)]

    ref = net(nnx.Rngs(0))
    opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    want = []
    for _ in range(3):
        loss, grads = nnx.value_and_grad(lambda m: mse(m(x), x))(ref)
        opt.update(ref, grads)
        want.append(float(loss))
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    got, ref_state = nnx.state(model), nnx.state(ref)
    for path, value in flatten_dict(nnx.to_pure_dict(ref_state)).items():
        mine = flatten_dict(nnx.to_pure_dict(got))[path]
        np.testing.assert_allclose(_value(mine), np.asarray(value), rtol=1e-5, atol=1e-6,
                                   err_msg=str(path))
