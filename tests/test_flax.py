"""flax models run through dist.jit unchanged apart from the annotations."""

import warnings
from collections import Counter

import flax.linen as linen
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import autoshard as dist
from autoshard.hlo import count_collectives
from autoshard.testing import assert_trains_like_one_device, mse_step, nnx_apply

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])


class LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        x = linen.gelu(linen.Dense(32)(x))
        x = linen.LayerNorm()(x)
        return linen.Dense(4)(x)


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.down = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(self.norm(nnx.gelu(self.up(x))))


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 4)).astype(np.float32)


def _megatron(path, x):
    name = jax.tree_util.keystr(path)
    if x.ndim == 2 and ("Dense_0" in name or "up" in name):
        return [dist.Replicate(), dist.Shard(1)]
    if x.ndim == 2 and ("Dense_1" in name or "down" in name):
        return [dist.Replicate(), dist.Shard(0)]
    return [dist.Replicate(), dist.Replicate()]


def _is_dt(x):
    return isinstance(x, dist.DistTensor)


def _check(step, params, state, x, y):
    dparams = jax.tree_util.tree_map_with_path(
        lambda p, v: dist.shard_tensor(v, MESH, _megatron(p, v)), params)
    dx = dist.shard_tensor(x, MESH, [dist.Shard(0), dist.Replicate()])
    assert_trains_like_one_device(step, dparams, params, state, dx, x, y)


def test_linen_model_trains_like_one_device():
    x, y = _data()
    model = LinenMLP()
    params = model.init(jax.random.key(0), x)
    tx = optax.adamw(1e-2)
    _check(mse_step(model.apply, tx), params, tx.init(params), x, y)


def test_nnx_model_trains_like_one_device():
    x, y = _data()
    model = NnxMLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    tx = optax.sgd(0.1)
    _check(mse_step(nnx_apply(graphdef), tx), params, tx.init(params), x, y)


# -- dist.jit in place of nnx.jit: modules as arguments, what the step does written back --------

class NnxNet(nnx.Module):
    """State beyond the params: BatchNorm statistics and a dropout Rngs counter. (The norm
    comes after the activation: a bias right before it would get a gradient of rounding noise,
    which adam turns into steps of the learning rate's size, different on every machine.)"""

    def __init__(self, rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.down = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(self.drop(self.bn(nnx.gelu(self.up(x)))))


def _nnx_train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
    optimizer.update(model, grads)
    return loss


def _nnx_megatron(path, layer, mesh):
    R, S = dist.Replicate(), dist.Shard
    if path.endswith("up"):
        layer.kernel.set_value(dist.shard_tensor(layer.kernel.get_value(), mesh, [R, S(1)]))
        layer.bias.set_value(dist.shard_tensor(layer.bias.get_value(), mesh, [R, S(0)]))
    if path.endswith("down"):
        layer.kernel.set_value(dist.shard_tensor(layer.kernel.get_value(), mesh, [R, S(0)]))


@pytest.mark.parametrize("donate", [(), (0, 1)], ids=["kept", "donated"])
def test_dist_jit_takes_nnx_modules_as_nnx_jit_does(donate):
    """`@dist.jit` on the nnx train step `(model, optimizer, x, y)`: each step updates the
    caller's model and optimizer (params, adam moments, BatchNorm statistics, the dropout
    counter) as nnx.jit does on one device — plain jax.jit would trace copies and lose them —
    the placements stay, and the program is traced once."""
    x, y = _data()
    ref = NnxNet(nnx.Rngs(0, dropout=1))
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    model = dist.shard_layer(NnxNet(nnx.Rngs(0, dropout=1)), MESH, _nnx_megatron)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = dist.jit(_nnx_train_step, donate_argnums=donate)
    dx = dist.shard_tensor(x, MESH, [dist.Shard(0), dist.Replicate()])
    losses, ref_losses, traces = [], [], []
    for _ in range(3):
        traces.append(sum(f.trace_count for f in getattr(step, "_graph_inner", {}).values()))
        with warnings.catch_warnings():
            warnings.simplefilter("error", dist.FallbackWarning)
            losses.append(float(step(model, opt, dx, y).numpy()))
        ref_losses.append(float(nnx.jit(_nnx_train_step)(ref, ref_opt, x, y)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert len(set(ref_losses)) == 3  # the steps did train
    got, want = nnx.state((model, opt)), nnx.state((ref, ref_opt))
    for a, b in zip(jax.tree.leaves(got, is_leaf=_is_dt), jax.tree.leaves(want)):
        a = dist.unshard_dtensor(a) if _is_dt(a) else a
        if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):  # the dropout key
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert model.up.kernel.get_value().placements == [dist.Replicate(), dist.Shard(1)]
    assert model.down.kernel.get_value().placements == [dist.Replicate(), dist.Shard(0)]
    assert opt.opt_state[0].mu["up"]["kernel"].get_value().placements == \
        [dist.Replicate(), dist.Shard(1)]
    # traced once: the BatchNorm statistics and the Rngs entered the first step as plain arrays
    # and come back placed as that program placed them, which it takes as they are
    assert traces == [0, 1, 1] and sum(f.trace_count for f in step._graph_inner.values()) == 1
    # the Rngs keys came back as jax keys (a DistTensor of keys cannot draw outside
    # dist.jit): the model still runs eagerly in train mode, drawing the masks one device does
    keys = [k for k in jax.tree.leaves(nnx.state(model), is_leaf=_is_dt)
            if jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key)]
    assert keys and all(isinstance(k, jax.Array) for k in keys)
    np.testing.assert_allclose(np.asarray(model(dx)), np.asarray(ref(x)),
                               rtol=1e-4, atol=1e-6)
    # plan / lower take the same arguments; the HLO has the collectives planned
    planned = Counter(c.kind for c in step.plan(model, opt, dx, y).collectives)
    assert planned["all-reduce"] >= 2  # the MLP's forward over mp, the gradients over dp
    lowered = step.lower(model, opt, dx, y)
    assert count_collectives(lowered.compile().as_text()) == planned
    # donate_argnums naming the modules donates their State's buffers
    assert ("jax.buffer_donor = true" in lowered.as_text()) == bool(donate)


class ConfiguredMLP(NnxMLP):
    """A module keeping a plain dict (a config) as an attribute: flax records it in the
    GraphDef, which it then cannot hash."""

    def __init__(self, rngs):
        super().__init__(rngs)
        self.cfg = {"act": "gelu", "scale": 0.5}

    def __call__(self, x):
        return super().__call__(x) * self.cfg["scale"]


def test_a_module_holding_an_unhashable_config_trains_as_under_nnx_jit():
    x, y = _data()
    ref = ConfiguredMLP(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    model = dist.shard_layer(ConfiguredMLP(nnx.Rngs(0)), MESH, _nnx_megatron)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = dist.jit(_nnx_train_step)
    dx = dist.shard_tensor(x, MESH, [dist.Shard(0), dist.Replicate()])
    for _ in range(2):
        np.testing.assert_allclose(float(step(model, opt, dx, y).numpy()),
                                   float(nnx.jit(_nnx_train_step)(ref, ref_opt, x, y)), rtol=1e-5)
    assert sum(f.trace_count for f in step._graph_inner.values()) == 1  # one program, found again
    np.testing.assert_allclose(dist.unshard_dtensor(model.up.kernel.get_value()),
                               ref.up.kernel.get_value(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dist.jit(model)(dx).numpy(), ref(x), rtol=1e-5, atol=1e-6)


def test_returning_an_nnx_module_from_dist_jit_is_named():
    model = NnxMLP(nnx.Rngs(0))
    x, _ = _data()
    with pytest.raises(dist.PlacementTypeError, match="nnx.state"):
        dist.jit(lambda m, x: (m, m(x)))(model, x)


def test_nnx_metrics_accumulate_inside_dist_jit_and_reset_outside():
    """flax's tutorial loop: `metrics.update(...)` inside the jitted step, `compute()` and
    `reset()` (which assigns `total[...] = 0` into a DistTensor) outside."""
    def eval_step(model, metrics, x, labels):
        logits = model(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        metrics.update(loss=loss, logits=logits, labels=labels)

    def new_metrics():
        return nnx.MultiMetric(loss=nnx.metrics.Average("loss"),
                               accuracy=nnx.metrics.Accuracy())

    rng = np.random.default_rng(4)
    batches = [(rng.normal(size=(16, 8)).astype(np.float32),
                rng.integers(0, 4, 16).astype(np.int32)) for _ in range(3)]
    ref, ref_metrics = NnxMLP(nnx.Rngs(0)), new_metrics()
    model = dist.shard_layer(NnxMLP(nnx.Rngs(0)), MESH, _nnx_megatron)
    metrics, step = new_metrics(), dist.jit(eval_step)
    for i, (x, labels) in enumerate(batches):
        if i == 2:
            metrics.reset()
            ref_metrics.reset()
        dx = dist.shard_tensor(x, MESH, [dist.Shard(0), dist.Replicate()])
        step(model, metrics, dx, dist.shard_tensor(labels, MESH, [dist.Shard(0), dist.Replicate()]))
        nnx.jit(eval_step)(ref, ref_metrics, x, labels)
        got, want = metrics.compute(), ref_metrics.compute()
        for k in want:
            np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=1e-5)
    assert metrics.loss.count.get_value().placements == [dist.Replicate(), dist.Replicate()]


def test_dist_jit_of_an_nnx_module_reads_its_current_params():
    """`predict = dist.jit(model)` (or of a bound method): the module is the call's hidden
    first argument — its
    params enter placed (the MLP runs split over mp) and each call reads them as they are now,
    so predictions follow training instead of the params traced at the first call."""
    x, y = _data()
    ref = NnxMLP(nnx.Rngs(0))
    model = dist.shard_layer(NnxMLP(nnx.Rngs(0)), MESH, _nnx_megatron)
    predict, method = dist.jit(model), dist.jit(model.__call__)
    dx = dist.shard_tensor(x, MESH, [dist.Shard(0), dist.Replicate()])
    np.testing.assert_allclose(predict(dx).numpy(), np.asarray(ref(x)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(method(dx).numpy(), np.asarray(ref(x)), rtol=1e-5, atol=1e-6)
    planned = Counter(c.kind for c in predict.plan(dx).collectives)
    assert planned["all-reduce"] >= 1  # the row-parallel matmul's result, over mp
    assert count_collectives(predict.lower(dx).compile().as_text()) == planned

    opt, ref_opt = (nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in (model, ref))
    dist.jit(_nnx_train_step)(model, opt, dx, y)
    nnx.jit(_nnx_train_step)(ref, ref_opt, x, y)
    np.testing.assert_allclose(predict(dx).numpy(), np.asarray(ref(x)), rtol=1e-5, atol=1e-6)
    assert predict.trace_count + sum(f.trace_count for f in predict._graph_inner.values()) == 1
    # a method bound to the module is taken the same way (made and called before the step)
    np.testing.assert_allclose(method(dx).numpy(), np.asarray(ref(x)), rtol=1e-5, atol=1e-6)



class _UnevenMLP(nnx.Module):
    def __init__(self, rngs, hidden=10):  # 10 hidden units over mp's 4 devices: uneven
        self.up, self.down = nnx.Linear(16, hidden, rngs=rngs), nnx.Linear(hidden, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def _uneven_step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
    opt.update(model, grads)
    return loss


@pytest.mark.filterwarnings("ignore::autoshard.UnevenShardingWarning")
def test_nnx_params_split_unevenly_keep_their_placements_across_steps():
    R, S = dist.Replicate(), dist.Shard
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(8, 4)).astype(np.float32)
    ref = _UnevenMLP(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    model = _UnevenMLP(nnx.Rngs(0))
    model.up.kernel.set_value(dist.shard_tensor(model.up.kernel.get_value(), MESH, [R, S(1)]))
    model.down.kernel.set_value(dist.shard_tensor(model.down.kernel.get_value(), MESH, [R, S(0)]))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = dist.jit(_uneven_step)
    dx = dist.shard_tensor(x, MESH, [S(0), R])
    losses = [float(step(model, opt, dx, y).numpy()) for _ in range(3)]
    ref_losses = [float(nnx.jit(_uneven_step)(ref, ref_opt, x, y)) for _ in range(3)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(model.up.kernel.get_value().numpy(), ref.up.kernel.get_value(),
                               rtol=1e-4, atol=1e-6)
    assert model.up.kernel.get_value().placements == [R, S(1)]
    assert model.down.kernel.get_value().placements == [R, S(0)]
    assert opt.opt_state[0].mu["up"]["kernel"].get_value().placements == [R, S(1)]
    assert sum(f.trace_count for f in step._graph_inner.values()) == 1
