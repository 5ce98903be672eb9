"""to_static + shard_optimizer + Strategy: every parallel strategy trains like one device, with
the collectives and memory each promises."""
import copy
import re
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoshard as dist
from autoshard.hlo import count_collectives

MESH24 = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
MESH8 = dist.ProcessMesh(list(range(8)), ["dp"])
R, S = dist.Replicate, dist.Shard


def _is_dt(x):
    return isinstance(x, dist.DistTensor)


def apply(p, x):
    return jax.nn.relu(x @ p["w0"] + p["b0"]) @ p["w1"]


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def _weights(d_in=16, hidden=32, d_out=8, seed=0):
    rng = np.random.default_rng(seed)
    return {"w0": (rng.normal(size=(d_in, hidden)) * 0.2).astype(np.float32),
            "b0": np.zeros((hidden,), np.float32),
            "w1": (rng.normal(size=(hidden, d_out)) * 0.2).astype(np.float32)}


def _batches(n=8, batch=8, d_in=16, d_out=8, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(batch, d_in)).astype(np.float32),
             rng.normal(size=(batch, d_out)).astype(np.float32)) for _ in range(n)]


def _trained(weights, batches, tx, loss_of, k=1):
    """One device, plain jax + optax: loss_of(params, batch) per batch, the gradients of k
    batches averaged per update. The losses and the final params."""
    p = jax.tree.map(jnp.asarray, weights)
    s, acc, losses = tx.init(p), None, []
    for i, batch in enumerate(batches):
        value, g = jax.value_and_grad(loss_of)(p, batch)
        losses.append(float(value))
        acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
        if (i + 1) % k == 0:
            u, s = tx.update(jax.tree.map(lambda a: a / k, acc), s, p)
            p, acc = optax.apply_updates(p, u), None
    return losses, p


def _reference(weights, batches, tx, k=1, dtype=None):
    def loss(p, batch):
        x, y = batch
        q = jax.tree.map(lambda w: w.astype(dtype), p) if dtype else p
        return mse(apply(q, x.astype(dtype) if dtype else x), y).astype(jnp.float32)
    return _trained(weights, batches, tx, loss, k)


PLACEMENTS = {
    "dp": (MESH24, {"w0": [R(), R()], "b0": [R(), R()], "w1": [R(), R()]}),
    "tp": (MESH24, {"w0": [R(), S(1)], "b0": [R(), S(0)], "w1": [R(), S(0)]}),
}


def _model(kind, weights):
    mesh, placements = PLACEMENTS[kind]
    return mesh, (apply, {k: dist.shard_tensor(v, mesh, placements[k]) for k, v in weights.items()})


def _hlo(model, name, batch):
    f = model.programs()[name]
    args = model.program_args(name, *batch)
    planned = Counter(c.kind for c in f.plan(*args).collectives)
    compiled = count_collectives(f.lower(*args).compile().as_text())
    assert compiled == planned
    return compiled


@pytest.mark.parametrize("kind,stage,tx,tol", [
    ("dp", 0, optax.sgd(0.1), 1e-6), ("tp", 0, optax.sgd(0.1), 1e-6),
    ("tp", 1, optax.adamw(1e-2), 1e-4), ("tp", 2, optax.adamw(1e-2), 1e-4),
    ("tp", 3, optax.sgd(0.1), 1e-6), ("dp", 3, optax.adamw(1e-2), 1e-4),
], ids=["dp", "dp+tp", "zero1", "zero2", "zero3", "fsdp-adamw"])
def test_strategies_train_like_one_device(kind, stage, tx, tol):
    weights, batches = _weights(), _batches()
    mesh, model = _model(kind, weights)
    strategy = dist.Strategy({"sharding": {"enable": stage > 0, "stage": max(stage, 1)}})
    m = dist.to_static(model, None, mse, tx, strategy)
    losses = [float(m(x, y).numpy()) for x, y in batches]
    ref_losses, ref_params = _reference(weights, batches, tx)
    np.testing.assert_allclose(losses, ref_losses, rtol=tol, atol=tol)
    for name, value in ref_params.items():
        np.testing.assert_allclose(m.params[name].numpy(), value, rtol=tol, atol=tol)
    kinds = _hlo(m, "train", batches[0])
    if stage in (1, 2):   # gradients reduce-scattered into the state shards, params re-gathered
        assert kinds["reduce-scatter"] >= 2 and kinds["all-gather"] >= 2
    if stage == 3:        # params gathered where used, gradients reduce-scattered
        assert kinds["all-gather"] >= 2 and kinds["reduce-scatter"] >= 2
        # stored split over dp between steps: on dim 0 for w0 / w1, unless mp already split it
        assert m.params["w0"].placements[0] == S(0)


_FROZEN_B0 = {"w0": True, "b0": False, "w1": True}
_MASKED = {
    "masked": lambda: optax.masked(optax.sgd(0.1, momentum=0.9), _FROZEN_B0),
    "multi_transform": lambda: optax.multi_transform(
        {"train": optax.sgd(0.1, momentum=0.9), "frozen": optax.set_to_zero()},
        {k: "train" if v else "frozen" for k, v in _FROZEN_B0.items()}),
}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", list(_MASKED))
def test_zero_splits_the_states_of_masked_optimizers(name, stage):
    """optax.masked / multi_transform (a fine-tune freezing some params; nnx.Optimizer's wrt)
    hold a MaskedNode where a param has no state: the states of the others are split over dp
    as plain sgd's are (they stayed whole on every device: the memory ZeRO promises, lost
    silently), and training equals one device."""
    weights, batches = _weights(), _batches(n=4)
    mesh, model = _model("tp", weights)
    tx = _MASKED[name]()
    strategy = dist.Strategy({"sharding": {"enable": True, "stage": stage}})
    m = dist.to_static(model, None, mse, tx, strategy)
    losses = [float(m(x, y).numpy()) for x, y in batches]
    ref_losses, ref_params = _reference(weights, batches, tx)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for k, value in ref_params.items():
        np.testing.assert_allclose(m.params[k].numpy(), value, rtol=1e-6, atol=1e-7)
    flat = jax.tree_util.tree_flatten_with_path(m.opt_state, is_leaf=_is_dt)[0]
    traces = {jax.tree_util.keystr(path): x for path, x in flat
              if _is_dt(x) and x.ndim and "trace" in jax.tree_util.keystr(path)}
    assert {k.split("[")[-1] for k in traces} == {"'w0']", "'w1']"}, list(traces)
    for k, x in traces.items():  # each momentum split over dp as well as the param's mp
        assert "dp" in [mesh.dim_names[d] for d, q in enumerate(x.placements)
                        if isinstance(q, S)], (k, x.placements)


def _split_rows(param):
    return [S(0) if param.shape[0] % 4 == 0 else R(), R()]


_SHARD_FNS = {
    "placements": lambda param, state: _split_rows(param),
    "placed": lambda param, state: dist.shard_tensor(state, param.mesh, _split_rows(param)),
    # Paddle's documented form: the accumulator's name, the param, the accumulator placed
    "paddle": lambda accumulator_name, param, accumulator: dist.shard_tensor(
        accumulator, param.process_mesh, _split_rows(param)) if accumulator_name in ("mu", "nu")
    else None,
}


@pytest.mark.parametrize("form", list(_SHARD_FNS))
def test_a_custom_optimizer_shard_fn_places_the_states(form):
    """shard_optimizer(tx, shard_fn): a function of (param, state) answering placements or the
    state placed, or Paddle's (accumulator_name, param, accumulator) — which raised a bare
    TypeError — places each state mirroring a param; training equals one device."""
    weights, batches = _weights(), _batches(n=3)
    mesh, model = _model("dp", weights)
    tx = optax.adam(1e-2)
    m = dist.to_static(model, None, mse, dist.shard_optimizer(tx, _SHARD_FNS[form]))
    losses = [float(m(x, y).numpy()) for x, y in batches]
    ref_losses, ref_params = _reference(weights, batches, tx)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k, value in ref_params.items():
        np.testing.assert_allclose(m.params[k].numpy(), value, rtol=1e-4, atol=1e-6)
    adam = m.opt_state[0]
    for k in weights:
        assert adam.mu[k].placements == adam.nu[k].placements == _split_rows(m.params[k])


def test_a_custom_optimizer_shard_fn_of_another_form_is_an_error_that_says_what_to_write():
    with pytest.raises(dist.OptimizerError, match=r"a function of \(param, state\) or, as "
                                                  r"Paddle's, of \(accumulator_name, param, "
                                                  r"accumulator\)"):
        dist.shard_optimizer(optax.adam(1e-2), lambda param: [R(), R()])
    weights = _weights()
    _, model = _model("dp", weights)
    with pytest.raises(dist.OptimizerError, match=r"shard_fn returned int for the optimizer "
                                                  r"state 'mu': return its placements"):
        dist.to_static(model, None, mse, dist.shard_optimizer(optax.adam(1e-2), lambda p, s: 0))


@pytest.mark.parametrize("kind,wrap", [("dp", "clip_by_global_norm"), ("tp", "clip_by_global_norm"),
                                       ("tp", "apply_if_finite")])
def test_a_gradient_summed_up_before_a_zero_update_is_reduce_scattered_once(kind, wrap):
    """A norm or finiteness check of every gradient (optax's clip_by_global_norm,
    apply_if_finite) reads the gradients before the ZeRO-1 update reads them split over dp:
    reduced for the check, each was all-reduced whole (4 MiB) and then sliced. The check
    reads a reduce-scattered shard instead and combines one scalar: the step moves the bytes
    of the same step without the check (a few scalar bytes more) and trains like one device."""
    sgd = optax.sgd(0.1, momentum=0.9)  # a state to shard, exact (no Adam sign flips)
    tx = (optax.chain(optax.clip_by_global_norm(1.0), sgd) if wrap == "clip_by_global_norm"
          else optax.apply_if_finite(sgd, 3))
    # large enough for the bytes a reduce-scatter saves to outweigh its scalar's latency
    weights = _weights(d_in=512, hidden=2048, d_out=512)
    batches = _batches(n=3, batch=512, d_in=512, d_out=512)
    strategy = dist.Strategy({"sharding": {"enable": True, "stage": 1}})
    m = dist.to_static(_model(kind, weights)[1], None, mse, tx, strategy)
    losses = [float(m(x, y).numpy()) for x, y in batches]
    ref_losses, ref_params = _reference(weights, batches, tx)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    for name, value in ref_params.items():
        np.testing.assert_allclose(m.params[name].numpy(), value, rtol=1e-4, atol=1e-5)
    kinds = _hlo(m, "train", batches[0])
    plain = dist.to_static(_model(kind, weights)[1], None, mse, sgd, strategy)
    plain(*batches[0])
    plan = m.programs()["train"].plan(*m.program_args("train", *batches[0]))
    unchecked = plain.programs()["train"].plan(*plain.program_args("train", *batches[0]))
    assert plan.total_bytes <= unchecked.total_bytes + 4096, (plan.total_bytes,
                                                             unchecked.total_bytes)
    weight_bytes = 512 * 2048 * 4 // (1 if kind == "dp" else 4)
    whole = [c for c in plan.collectives if c.kind == "all-reduce" and c.axes == ("dp",)
             and c.bytes_per_device >= weight_bytes]
    assert not whole, whole  # no weight gradient all-reduced over dp
    assert kinds["reduce-scatter"] >= 2


@pytest.mark.parametrize("stage", [0, 1, 2], ids=["no-zero", "zero1", "zero2"])
def test_gradient_merge_reduces_once_per_k_steps(stage):
    weights, batches = _weights(), _batches()
    mesh, model = _model("dp", weights)
    strategy = dist.Strategy({"gradient_merge": {"enable": True, "k_steps": 4, "avg": True},
                              "sharding": {"enable": stage > 0, "stage": max(stage, 1)}})
    tx = optax.sgd(0.1, momentum=0.9)   # a state to shard, and exact (no Adam sign flips)
    m = dist.to_static(model, None, mse, tx, strategy)
    losses = [float(m(x, y).numpy()) for x, y in batches]
    ref_losses, ref_params = _reference(weights, batches, tx, k=4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for name, value in ref_params.items():
        np.testing.assert_allclose(m.params[name].numpy(), value, rtol=1e-6, atol=1e-7)
    accumulate = _hlo(m, "accumulate", batches[0])
    merge = _hlo(m, "merge", batches[0])
    # the summary lists both steps of the cycle, each with the collectives its HLO has
    summary = m.summary(*batches[0]).splitlines()
    for line, hlo, word in ((summary[1], accumulate, "accumulating step (3 of every 4)"),
                            (summary[2], merge, "merging step (1 of every 4)")):
        assert line.startswith(f"per {word}: "), summary
        listed = line.split(": ", 1)[1].split("; ")[0].split(", ")
        assert Counter({k: int(n) for n, k in (c.split(" ", 1) for c in listed)}) == hlo, line
    acc = m.program_args("accumulate", *batches[0])[1]["acc"]
    acc_bytes = sum(int(np.prod(a.local_shape)) * 4 for a in acc.values())
    full_bytes = sum(v.size * 4 for v in weights.values())
    if stage < 2:
        # micro-steps only reduce the scalar loss; the k-th step reduces the gradients, once
        # (all-reduce, or reduce-scatter into ZeRO-1's state shards); the accumulator holds
        # the whole unreduced gradient on every device
        assert accumulate == Counter({"all-reduce": 1})
        if stage == 0:
            assert merge["all-reduce"] == 1 + len(weights)
        else:
            assert merge["reduce-scatter"] == len(weights) and merge["all-reduce"] == 1
        assert acc_bytes == full_bytes
    else:
        # ZeRO-2 keeps only each device's gradient shard: every micro-step reduce-scatters
        assert accumulate["reduce-scatter"] == len(weights)
        assert merge["reduce-scatter"] == len(weights)
        assert acc_bytes == full_bytes // mesh.get_dim_size("dp")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_shard_optimizers_gradient_accumulation_steps_merge_gradients(stage):
    """Paddle's shard_optimizer(opt, shard_fn, gradient_accumulation_steps=k): one update per
    k calls, on their averaged gradients — the gradient merge of k (it was accepted and then
    ignored: one update per call); a k_steps of the strategy that disagrees is an error."""
    weights, batches = _weights(), _batches()
    _, model = _model("dp", weights)
    tx = optax.sgd(0.1, momentum=0.9)
    shard_fn = dist.ShardingStage1("dp") if stage == 1 else (
        dist.ShardingStage2("dp") if stage == 2 else None)
    m = dist.to_static(model, None, mse, dist.shard_optimizer(tx, shard_fn, 4))
    assert m.k_steps == 4
    losses = [float(m(x, y).numpy()) for x, y in batches]
    ref_losses, ref_params = _reference(weights, batches, tx, k=4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for name, value in ref_params.items():
        np.testing.assert_allclose(m.params[name].numpy(), value, rtol=1e-6, atol=1e-7)
    strategy = dist.Strategy({"gradient_merge": {"enable": True, "k_steps": 2}})
    with pytest.raises(dist.StrategyError, match=r"gradient_accumulation_steps = 4 and "
                                                 r"strategy.gradient_merge.k_steps = 2 disagree"):
        dist.to_static(_model("dp", weights)[1], None, mse, dist.shard_optimizer(tx, None, 4),
                       strategy)


@pytest.mark.parametrize("fails_at", [0, 1, 2])
def test_a_call_that_raises_leaves_the_gradient_merge_cycle_where_it_was(fails_at):
    """A user's call with a bad batch (the wrong width) raises; they fix it and go on: the
    merge cycle did not move (no update from a short cycle, no later cycle shifted)."""
    weights, batches = _weights(), _batches()
    _, model = _model("dp", weights)
    strategy = dist.Strategy({"gradient_merge": {"enable": True, "k_steps": 3, "avg": True}})
    tx = optax.sgd(0.1, momentum=0.9)
    m = dist.to_static(model, None, mse, tx, strategy)
    losses = []
    for i, (x, y) in enumerate(batches[:6]):
        if i == fails_at:
            with pytest.raises(Exception):
                m(x[:, :-1], y)
        losses.append(float(m(x, y).numpy()))
    ref_losses, ref_params = _reference(weights, batches[:6], tx, k=3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for name, value in ref_params.items():
        np.testing.assert_allclose(m.params[name].numpy(), value, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("k", [1, 3], ids=["train", "gradient-merge"])
def test_a_batch_of_the_wrong_width_after_good_ones_names_the_shapes(k):
    """A batch of the wrong feature width (or label width) after batches that ran: a typed
    error naming this batch's shapes and those of the last batch that ran, not jax's bare
    TypeError from inside the model (found by a probe); the model then trains on."""
    weights, batches = _weights(), _batches(n=3)
    strategy = dist.Strategy({"gradient_merge": {"enable": k > 1, "k_steps": k}})
    m = dist.to_static(_model("dp", weights)[1], None, mse, optax.sgd(0.1), strategy)
    (x, y), rest = batches[0], batches[1:]
    m(x, y)
    for bad in ((x[:, :-2], y), (x, y[:, :-1])):
        with pytest.raises(dist.DistModelError, match=re.escape(
                f"shapes {[tuple(a.shape) for a in bad]}; the last batch it ran had "
                f"[(8, 16), (8, 8)]")):
            m(*bad)
    ref_losses, _ = _reference(weights, batches, optax.sgd(0.1), k=k)
    np.testing.assert_allclose([float(m(*b).numpy()) for b in rest], ref_losses[1:], rtol=1e-6)


@pytest.mark.parametrize("stage", [0, 2], ids=["no-zero", "zero2"])
def test_a_checkpoint_taken_inside_a_gradient_merge_cycle_resumes_it(stage, tmp_path):
    """state_dict() mid-cycle holds the pending accumulated gradients (gm.acc.*: Partial over
    dp, or ZeRO-2's shards, saved reduced) and the cycle's micro-step (gm.step); a fresh model
    loaded from it finishes the cycle like the uninterrupted run and one device — it started
    the cycle over (with a warning), dropping the saved micro-steps' gradients."""
    weights, batches = _weights(), _batches(n=6)
    tx = optax.sgd(0.1, momentum=0.9)

    def fresh():
        strategy = dist.Strategy({"gradient_merge": {"enable": True, "k_steps": 4, "avg": True},
                                  "sharding": {"enable": stage > 0, "stage": max(stage, 1)}})
        return dist.to_static(_model("dp", weights)[1], None, mse, tx, strategy)

    m = fresh()
    for x, y in batches[:2]:  # 2 of the cycle's 4 micro-steps
        m(x, y)
    sd = m.state_dict()
    assert int(sd["gm.step"].numpy()) == 2
    assert {k for k in sd if k.startswith("gm.")} == {"gm.acc.w0", "gm.acc.b0", "gm.acc.w1",
                                                      "gm.step"}
    dist.save_state_dict(sd, str(tmp_path / "ckpt"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.state_dict()  # complete: nothing to warn about
    resumed = fresh()
    target = resumed.state_dict()
    assert int(target["gm.step"].numpy()) == 0
    dist.load_state_dict(target, str(tmp_path / "ckpt"))
    resumed.set_state_dict(target)
    resumed_losses = [float(resumed(x, y).numpy()) for x, y in batches[2:]]
    losses = [float(m(x, y).numpy()) for x, y in batches[2:]]
    ref_losses, ref_params = _reference(weights, batches, tx, k=4)
    np.testing.assert_allclose(resumed_losses, ref_losses[2:], rtol=1e-6)
    np.testing.assert_allclose(losses, ref_losses[2:], rtol=1e-6)
    for name, value in ref_params.items():  # 6 steps: one update, 2 micro-steps pending
        np.testing.assert_allclose(resumed.params[name].numpy(), m.params[name].numpy(),
                                   rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(resumed.params[name].numpy(), value, rtol=1e-6, atol=1e-7)
    pending = resumed.state_dict()  # the next cycle's 2 micro-steps, in memory too
    assert int(pending["gm.step"].numpy()) == 2
    for name in weights:
        np.testing.assert_allclose(pending[f"gm.acc.{name}"].numpy(),
                                   m.state_dict()[f"gm.acc.{name}"].numpy(), rtol=1e-6, atol=1e-7)
    # a gm.step past this model's k_steps says what to load, before anything is loaded
    other = fresh()
    with pytest.raises(dist.DistModelError, match=r"'gm.step' is 5, but this model's gradient "
                                                  r"merge has k_steps = 4"):
        other.set_state_dict({"param.w0": np.zeros((16, 32), np.float32),
                              "gm.step": np.int32(5)})
    np.testing.assert_array_equal(other.params["w0"].numpy(), weights["w0"])


@pytest.mark.parametrize("how", ["checkpoint", "in memory"])
@pytest.mark.parametrize("pending", [0, 1], ids=["between-cycles", "mid-cycle"])
def test_a_checkpoint_saved_without_gradient_merge_loads_into_a_model_that_merges(tmp_path,
                                                                                 pending, how):
    """A pretrained checkpoint has no gm.* entries: a model with gradient merge loads it and
    starts a new cycle, training like one device from it — also a model in the middle of a
    cycle, whose pending micro-steps were taken with other weights (they were kept: its first
    update mixed them in, a micro-step early; found by a probe), and from set_state_dict of
    params alone."""
    weights, batches = _weights(), _batches(n=4)
    tx = optax.sgd(0.1)
    plain = dist.to_static(_model("dp", weights)[1], None, mse, tx)
    dist.save_state_dict(plain.state_dict("param"), str(tmp_path / "pretrained"))
    strategy = dist.Strategy({"gradient_merge": {"enable": True, "k_steps": 4, "avg": True}})
    zeros = {k: np.zeros_like(v) for k, v in weights.items()}
    m = dist.to_static(_model("dp", zeros)[1], None, mse, tx, strategy)
    for x, y in _batches(n=pending, seed=7):
        m(x, y)
    if how == "checkpoint":
        target = m.state_dict()
        dist.load_state_dict(target, str(tmp_path / "pretrained"))
        assert int(target["gm.step"].numpy()) == 0
        assert all(not target[k].numpy().any() for k in target if k.startswith("gm.acc"))
    else:
        target = plain.state_dict("param")
    m.set_state_dict(target)
    assert int(m.state_dict()["gm.step"].numpy()) == 0
    # the state dict refers to its model only weakly: copied, it is the plain dict it is
    copied = copy.deepcopy(m.state_dict())
    assert type(copied) is dict and set(copied) == set(m.state_dict())
    losses = [float(m(x, y).numpy()) for x, y in batches]
    ref_losses, ref_params = _reference(weights, batches, tx, k=4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for name, value in ref_params.items():
        np.testing.assert_allclose(m.params[name].numpy(), value, rtol=1e-6, atol=1e-7)


def test_a_checkpoint_saved_without_loss_scaling_loads_into_a_float16_model(tmp_path):
    """A checkpoint of a float32 run (no amp.* entries) loads into a float16 model that scales
    its loss: its params and optimizer state are the checkpoint's, its loss scaler starts
    fresh (the load failed: "'amp.bad_steps' is not in checkpoint")."""
    weights, batches = _weights(), _batches(n=2)
    tx = optax.sgd(0.1, momentum=0.9)
    plain = dist.to_static(_model("dp", weights)[1], None, mse, tx)
    plain(*batches[0])
    dist.save_state_dict(plain.state_dict(), str(tmp_path / "float32"))
    strategy = dist.Strategy({"amp": {"enable": True, "dtype": "float16", "level": "o1",
                                      "init_loss_scaling": 1024.0}})
    zeros = {k: np.zeros_like(v) for k, v in weights.items()}
    m = dist.to_static(_model("dp", zeros)[1], None, mse, tx, strategy)
    fresh = {k: np.asarray(v.numpy()) for k, v in m.state_dict().items()
             if k.startswith("amp.")}
    assert fresh and fresh["amp.scale"] == 1024.0
    # a model whose scaler moved (overflowing steps halve the scale) starts from a fresh one
    # too (its own was kept; found by a probe)
    m.scaler_state = {**m.scaler_state, "scale": m.scaler_state["scale"] / 4}
    target = m.state_dict()
    assert float(target["amp.scale"].numpy()) == 256.0
    dist.load_state_dict(target, str(tmp_path / "float32"))
    m.set_state_dict(target)
    saved = plain.state_dict()
    for k, v in m.state_dict().items():
        want = fresh[k] if k.startswith("amp.") else saved[k].numpy()
        np.testing.assert_array_equal(np.asarray(v.numpy()), want, err_msg=k)


def test_recompute_trains_like_one_device():
    # AMP has its own tests (test_amp.py): each level against its one-device program
    weights, batches = _weights(), _batches(n=3)
    mesh, model = _model("tp", weights)
    strategy = dist.Strategy({"recompute": {"enable": True, "policy": "nothing_saveable"}})
    m = dist.to_static(model, None, mse, optax.sgd(0.1), strategy)
    losses = [float(m(x, y).numpy()) for x, y in batches]
    ref_losses, ref_params = _reference(weights, batches, optax.sgd(0.1))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, atol=1e-6)
    for name, value in ref_params.items():
        np.testing.assert_allclose(m.params[name].numpy(), value, rtol=1e-6, atol=1e-6)
    plan = m.programs()["train"].plan(*m.program_args("train", *batches[0]))
    assert "remat2" in {e.name for e in plan.program.eqns}   # jax.checkpoint around the forward, partitioned inside


def test_zero1_and_zero2_compile_the_same_step():
    """Without gradient merge the stages coincide: the update of each state shard consumes
    the matching gradient shard, so stage 1 reduce-scatters too (see the README)."""
    weights, batches = _weights(), _batches(n=1)
    plans = {}
    for stage in (1, 2):
        mesh, model = _model("tp", weights)
        m = dist.to_static(model, None, mse, optax.adamw(1e-2),
                           dist.Strategy({"sharding": {"enable": True, "stage": stage}}))
        m(*batches[0])
        plan = m.programs()["train"].plan(*m.program_args("train", *batches[0]))
        plans[stage] = sorted((c.kind, c.step, c.bytes_per_device) for c in plan.collectives)
    assert plans[1] == plans[2]
    # w0 and w1 (states split over dp) get their gradients reduce-scattered, not all-reduced
    # (b0 is already split over mp on its only dim, so its state stays whole over dp)
    assert [step for kind, step, _ in plans[1] if kind == "reduce-scatter"] == [
        "psum_scatter(dp) dim 0", "psum_scatter(dp) dim 1"]


def test_zero1_with_wide_weights_and_a_small_batch_computes_each_state_shards_gradient():
    """With few rows per step, gathering the activations over dp is cheaper than reducing the
    weight gradients: each device computes the gradient of its own ZeRO state shard, split on
    a dim of its own (dp on the dim tensor parallelism leaves whole). Nesting dp under mp on
    the weight's split dim instead made each moment's update re-split that gradient (4
    all-to-alls of 256 KiB per step here, half the step's bytes)."""
    weights = _weights(d_in=512, hidden=2048, d_out=512)
    batches = _batches(n=2, batch=8, d_in=512, d_out=512)
    tx = optax.adam(1e-3)
    mesh, model = _model("tp", weights)
    m = dist.to_static(model, None, mse, tx,
                       dist.Strategy({"sharding": {"enable": True, "stage": 1}}))
    losses = [float(m(x, y).numpy()) for x, y in batches]
    ref_losses, ref_params = _reference(weights, batches, tx)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name, value in ref_params.items():  # adam's steps are ±1e-3: 1e-4 tells them apart
        np.testing.assert_allclose(m.params[name].numpy(), value, rtol=0, atol=1e-4)
    args = m.program_args("train", *batches[0])
    plan = m.programs()["train"].plan(*args)
    assert not [c for c in plan.collectives if c.kind == "all-to-all" and c.bytes_per_device
                > 64 * 1024], plan.collectives  # (the activations' own re-split is small)
    assert _hlo(m, "train", batches[0])["all-gather"] >= 2  # the updated params, re-gathered


def test_zero3_memory_per_device_falls_to_one_nth():
    weights = _weights(d_in=64, hidden=512, d_out=64)
    batches = _batches(n=1, batch=8, d_in=64, d_out=64)
    placements = {k: [R()] for k in weights}
    sizes = {}
    for stage in (0, 3):
        model = (apply, {k: dist.shard_tensor(v, MESH8, placements[k]) for k, v in weights.items()})
        strategy = dist.Strategy({"sharding": {"enable": stage > 0, "stage": max(stage, 1)}})
        m = dist.to_static(model, None, mse, optax.adamw(1e-3), strategy)
        m(*batches[0])
        compiled = m.programs()["train"].lower(*m.program_args("train", *batches[0])).compile()
        sizes[stage] = compiled.memory_analysis().argument_size_in_bytes
    param_and_state = 3 * sum(v.size * 4 for v in weights.values())
    assert sizes[0] >= param_and_state                       # replicated: everything everywhere
    assert sizes[3] <= param_and_state / 8 * 1.1 + 4096     # ZeRO-3: ~1/8 per device (+ batch)


def test_predict_eval_and_state_dict_round_trip():
    weights, batches = _weights(), _batches(n=2)
    mesh, model = _model("tp", weights)
    m = dist.to_static(model, None, mse, optax.adamw(1e-2))
    m(*batches[0])
    x, y = batches[1]
    out = m.predict()(x)
    np.testing.assert_allclose(out.numpy(), apply({k: v.numpy() for k, v in m.params.items()}, x), rtol=1e-5)
    loss = m.eval()(x, y)
    np.testing.assert_allclose(loss.numpy(), mse(out.numpy(), y), rtol=1e-5)
    sd = m.state_dict()
    assert {"param.w0", "param.w1", "param.b0"} <= set(sd) and any(k.startswith("opt.") for k in sd)
    assert set(m.state_dict("param")) == {"param.w0", "param.w1", "param.b0"}
    fresh = dist.to_static(_model("dp", _weights(seed=5))[1], None, mse, optax.adamw(1e-2))
    fresh.set_state_dict(sd)
    np.testing.assert_array_equal(fresh.params["w0"].numpy(), m.params["w0"].numpy())
    assert fresh.params["w0"].placements == [R(), R()]   # loaded into the target's placements
    # a lower-precision copy loads into the float32 master weight as float32
    low = dist.shard_tensor(np.asarray(sd["param.w1"].numpy(), jnp.bfloat16), mesh, [R(), R()])
    fresh.set_state_dict({"param.w1": low})
    assert fresh.params["w1"].dtype == jnp.float32
    np.testing.assert_array_equal(fresh.params["w1"].numpy(), np.asarray(low.numpy(), np.float32))
    with pytest.raises(dist.DistModelError, match=r"'param.W0' \(did you mean 'param.w0'\?\)"
                                                  r".*nothing was loaded"):
        fresh.set_state_dict({"param.W0": sd["param.w0"]})
    with pytest.warns(UserWarning, match=r"1 of 2 keys name nothing.*'model.w1'.*skipped"):
        fresh.set_state_dict({"param.w0": sd["param.w0"], "model.w1": sd["param.w1"]})
    # as Paddle's DistModel, one built without an optimizer starts in eval mode, one without a
    # loss either in predict mode (it started in train: "train mode needs an optimizer")
    weights = {k: v.numpy() for k, v in m.params.items()}
    evaluator = dist.to_static(_model("dp", weights)[1], None, mse)
    assert evaluator.mode == "eval"
    np.testing.assert_allclose(evaluator(x, y).numpy(), mse(apply(weights, x), y), rtol=1e-5)
    predictor = dist.to_static(_model("dp", weights)[1])
    assert predictor.mode == "predict"
    np.testing.assert_allclose(predictor(x).numpy(), apply(weights, x), rtol=1e-5)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_set_state_dict_takes_a_typed_prng_key_as_its_key_data(impl):
    """nnx holds its RNG keys typed; the state dict holds them as key data. A typed key given
    to set_state_dict loads as its key data (it was 'has shape (), the model's is (2,)'); one
    of another implementation (another width) is an error that says how keys are stored."""
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(16, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.lin(x))

    def model():
        return dist.to_static(dist.shard_layer(Net(nnx.Rngs(0, dropout=1)), MESH24), None, mse,
                              optax.sgd(0.1))

    key = jax.random.key(3, impl=impl)
    typed, data = model(), model()
    name = "state.drop.rngs.key"
    if impl != "threefry2x32":
        with pytest.raises(dist.DistModelError, match=r"'state.drop.rngs.key' has shape \(4,\), "
                                                      r"the model's is \(2,\) \(PRNG keys are "
                                                      r"stored as their key data, "
                                                      r"jax.random.key_data\(key\)"):
            typed.set_state_dict({name: key})
        return
    typed.set_state_dict({name: key})
    data.set_state_dict({name: [int(k) for k in jax.random.key_data(key)]})  # (no dtype)
    np.testing.assert_array_equal(typed.state_dict()[name].numpy(), jax.random.key_data(key))
    x, y = _batches(n=1, d_out=8)[0]
    np.testing.assert_array_equal(typed(x, y).numpy(), data(x, y).numpy())  # the same masks


class _TwoInputs:
    """A model of two same-shaped inputs (swapping them is wrong, but runs)."""

    @staticmethod
    def apply(p, x, gain):
        return apply(p, x + 0.5 * gain)


def _dict_batches(n=3, order=("x", "gain", "y")):
    rng = np.random.default_rng(3)
    batches = []
    for _ in range(n):
        b = {"x": rng.normal(size=(16, 16)), "gain": rng.normal(size=(16, 16)),
             "y": rng.normal(size=(16, 8))}
        batches.append({k: b[k].astype(np.float32) for k in order})
    return batches


def _two_input_reference(weights, batches, tx):
    p = jax.tree.map(jnp.asarray, weights)
    s, losses = tx.init(p), []
    for b in batches:
        value, g = jax.value_and_grad(
            lambda p: mse(_TwoInputs.apply(p, b["x"], b["gain"]), b["y"]))(p)
        u, s = tx.update(g, s, p)
        p, losses = optax.apply_updates(p, u), losses + [float(value)]
    return losses


@pytest.mark.parametrize("order", [("x", "gain", "y"), ("gain", "y", "x")])
def test_dict_batches_feed_the_inputs_in_the_batch_order(order):
    # jax's tree functions sort dict keys: {"x", "gain"} reached the model as (gain, x); the
    # apply function's parameter names (p, x, gain) say the order whatever the batch's
    weights, batches = _weights(), _dict_batches(order=order)
    mesh = MESH24
    params = {k: dist.shard_tensor(v, mesh, PLACEMENTS["tp"][1][k]) for k, v in weights.items()}
    loader = dist.shard_dataloader(batches, meshes=mesh, input_keys=["x", "y"], shard_dims="dp")
    assert list(next(iter(loader))) == list(order)  # the loader keeps the batch's order
    m = dist.to_static((_TwoInputs.apply, params), loader, mse, optax.sgd(0.1))
    losses = [float(m(b).numpy()) for b in loader()]
    np.testing.assert_allclose(losses, _two_input_reference(weights, batches, optax.sgd(0.1)),
                               rtol=1e-5)


def test_dict_batches_follow_the_models_parameter_names():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, weights):
            self.w0, self.b0, self.w1 = (nnx.Param(jnp.asarray(weights[k]))
                                         for k in ("w0", "b0", "w1"))

        def __call__(self, x, gain):
            p = {"w0": self.w0[...], "b0": self.b0[...], "w1": self.w1[...]}
            return _TwoInputs.apply(p, x, gain)

    weights = _weights()
    batches = _dict_batches(order=("gain", "y", "x"))  # neither sorted nor the call's order
    loader = dist.shard_dataloader(batches, meshes=MESH24, input_keys=["x", "y"], shard_dims="dp")
    m = dist.to_static(Model(weights), loader, mse, optax.sgd(0.1))
    losses = [float(m(b).numpy()) for b in loader()]
    np.testing.assert_allclose(losses, _two_input_reference(weights, batches, optax.sgd(0.1)),
                               rtol=1e-5)
    out = m.predict()({"gain": batches[0]["gain"], "x": batches[0]["x"]})  # no label: inputs
    assert out.shape == (16, 8)


@pytest.mark.parametrize("call", [lambda m, b: m([b["x"], b["gain"]], b["y"]),
                                  lambda m, b: m((b["x"], b["gain"]), b["y"]),
                                  lambda m, b: m([[b["x"], b["gain"]], b["y"]])],
                         ids=["list", "tuple", "loader-batch"])
def test_a_list_of_inputs_before_the_label_is_unpacked_into_the_models_inputs(call):
    # Paddle's batch of a multi-input model, dist_model([x, gain], label): the model is called
    # with x and gain (the list was one input, and the call a DistModelError)
    weights, batches = _weights(), _dict_batches()
    params = {k: dist.shard_tensor(v, MESH24, PLACEMENTS["tp"][1][k]) for k, v in weights.items()}
    m = dist.to_static((_TwoInputs.apply, params), None, mse, optax.sgd(0.1))
    losses = [float(call(m, b).numpy()) for b in batches]
    np.testing.assert_allclose(losses, _two_input_reference(weights, batches, optax.sgd(0.1)),
                               rtol=1e-5)


def test_a_model_of_one_pytree_input_takes_the_list_whole():
    """apply(params, (x, gain)) takes one input: the pair stays a pair, each array placed on
    its own (numpy failed stacking arrays of two shapes)."""
    def apply_pair(p, pair):
        x, gain = pair
        return apply(p, x * gain[:, None])

    weights, batches = _weights(), _dict_batches()
    params = {k: dist.shard_tensor(v, MESH24, PLACEMENTS["dp"][1][k]) for k, v in weights.items()}
    m = dist.to_static((apply_pair, params), None, mse, optax.sgd(0.1))
    losses = [float(m((b["x"], b["gain"][:, 0]), b["y"]).numpy()) for b in batches]
    p, tx = jax.tree.map(jnp.asarray, weights), optax.sgd(0.1)
    s, ref = tx.init(p), []
    for b in batches:
        value, g = jax.value_and_grad(
            lambda p: mse(apply_pair(p, (b["x"], b["gain"][:, 0])), b["y"]))(p)
        u, s = tx.update(g, s, p)
        p, ref = optax.apply_updates(p, u), ref + [float(value)]
    np.testing.assert_allclose(losses, ref, rtol=1e-5)

@pytest.mark.parametrize("form", [list, tuple])
def test_predict_reads_a_list_as_train_does_one_pytree_input_whole_several_inputs_apart(form):
    """dist_model([x, gain]) in predict: a model of one pytree input gets the list whole, as
    train's dist_model([x, gain], label) gives it (predict unpacked it into two inputs: 'cannot
    take the batch's 2 input(s)'); a model of two inputs gets them one by one, as before."""
    def apply_pair(p, pair):
        x, gain = pair
        return apply(p, x * gain[:, None])

    weights, b = _weights(), _dict_batches(n=1)[0]
    x, gain = b["x"], b["gain"][:, 0]
    params = {k: dist.shard_tensor(v, MESH24, PLACEMENTS["dp"][1][k]) for k, v in weights.items()}
    m = dist.to_static((apply_pair, params), None, mse, optax.sgd(0.0))
    want = apply_pair(weights, (x, gain))
    np.testing.assert_allclose(float(m(form([x, gain]), b["y"]).numpy()), mse(want, b["y"]),
                               rtol=1e-5)
    np.testing.assert_allclose(m.predict()(form([x, gain])).numpy(), want, rtol=1e-5, atol=1e-6)
    two = dist.to_static((_TwoInputs.apply, params), None, mse, optax.sgd(0.0)).predict()
    np.testing.assert_allclose(two(form([b["x"], b["gain"]])).numpy(),
                               _TwoInputs.apply(weights, b["x"], b["gain"]), rtol=1e-5, atol=1e-6)


def test_predict_fed_a_dict_batch_with_its_label_names_the_key_to_drop():
    weights, b = _weights(), _dict_batches(n=1)[0]
    params = {k: dist.shard_tensor(v, MESH24, PLACEMENTS["dp"][1][k]) for k, v in weights.items()}
    loader = dist.shard_dataloader([b], meshes=MESH24, input_keys=["x", "y"], shard_dims="dp")
    m = dist.to_static((_TwoInputs.apply, params), loader, mse, optax.sgd(0.1)).predict()
    with pytest.raises(dist.DistModelError, match=r"predict takes a dict batch without its "
                                                  r"label: drop 'y'"):
        m(b)
    np.testing.assert_allclose(m({k: v for k, v in b.items() if k != "y"}).numpy(),
                               _TwoInputs.apply(weights, b["x"], b["gain"]), rtol=1e-5, atol=1e-6)


# -- Paddle's batch of several inputs and several labels: [[x1, x2], [y1, y2]] ---------------
def masked_mse(out, y, mask):
    """A loss of two labels, Paddle's loss(out, y1, y2) (a mean over the batch: a pipeline's
    equal micro-batches average to it)."""
    return jnp.mean(mask * (out - y) ** 2)


def _labelled_batches(n=3, seed=4):
    """Paddle loader batches of a two-input, two-label model: [[x, gain], [y, mask]]."""
    rng = np.random.default_rng(seed)
    return [[[rng.normal(size=(16, 16)).astype(np.float32),
              rng.normal(size=(16, 16)).astype(np.float32)],
             [rng.normal(size=(16, 8)).astype(np.float32),
              (rng.random((16, 8)) > 0.3).astype(np.float32)]] for _ in range(n)]


def _labelled_reference(weights, batches, tx, forward=_TwoInputs.apply, loss=masked_mse, k=1):
    """One device, plain jax + optax: loss(forward(p, x, gain), y, mask) per batch (outputs
    and labels one per argument); with k, the gradients of k batches averaged per update."""
    def f(p, batch):
        (x, gain), (y, mask) = batch
        out = forward(p, x, gain)
        return loss(*(out if isinstance(out, tuple) else (out,)), y, mask)
    return _trained(weights, batches, tx, f, k)


@pytest.mark.parametrize("call", [
    lambda m, b: m(b[0], b[1]),                      # dist_model([x, gain], [y, mask])
    lambda m, b: m(tuple(b[0]), tuple(b[1])),        # tuples
    lambda m, b: m(b),                               # a loader's batch as one argument
    lambda m, b: m(*b[0], b[1]),                     # dist_model(x, gain, [y, mask])
    lambda m, b: m(*b[0], *b[1]),                    # dist_model(x, gain, y, mask)
], ids=["lists", "tuples", "loader-batch", "inputs-apart", "flat"])
@pytest.mark.parametrize("kind", ["dp", "tp"])
def test_a_list_of_labels_is_passed_to_the_loss_one_per_argument_as_paddle_does(kind, call):
    """Paddle's DistModel feeds a batch [inputs, labels], each a tensor or a list, as
    model(*inputs) and loss(*outputs, *labels). A list of labels went to loss_fn as one
    argument: loss_fn(out, y, mask) was 'cannot be called as loss_fn(output, label)'. Train,
    then eval and predict, equal one device's plain jax + optax."""
    weights, batches = _weights(), _labelled_batches()
    mesh = MESH24 if kind == "tp" else MESH8
    placements = (PLACEMENTS["tp"][1] if kind == "tp"
                  else {k: [R()] for k in weights})
    params = {k: dist.shard_tensor(v, mesh, placements[k]) for k, v in weights.items()}
    tx = optax.adamw(1e-2)
    m = dist.to_static((_TwoInputs.apply, params), None, masked_mse, tx)
    losses = [float(call(m, b).numpy()) for b in batches[:2]]
    ref_losses, ref = _labelled_reference(weights, batches[:2], tx)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name in weights:
        np.testing.assert_allclose(m.params[name].numpy(), ref[name], rtol=1e-4, atol=1e-6)
    (x, gain), (y, mask) = batches[2]
    np.testing.assert_allclose(float(call(m.eval(), batches[2]).numpy()),
                               masked_mse(_TwoInputs.apply(ref, x, gain), y, mask), rtol=1e-5)
    want = _TwoInputs.apply(ref, x, gain)
    np.testing.assert_allclose(m.predict()([x, gain]).numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m.predict()(x, gain).numpy(), want, rtol=1e-5, atol=1e-6)


def test_a_shard_dataloader_of_input_and_label_lists_trains_like_one_device():
    """A loader yielding [[x, gain], [y, mask]] on a 2x4 mesh: every array of both lists is
    split over dp; with gradient merge (k=2) the accumulating and merging steps read the labels
    the same way."""
    weights, batches = _weights(), _labelled_batches(n=4)
    params = {k: dist.shard_tensor(v, MESH24, PLACEMENTS["tp"][1][k]) for k, v in weights.items()}
    loader = dist.shard_dataloader(batches, meshes=MESH24, shard_dims="dp")
    (xs, ys) = next(iter(loader))
    assert [t.placements for t in xs + ys] == [[S(0), R()]] * 4
    strategy = dist.Strategy({"gradient_merge": {"enable": True, "k_steps": 2, "avg": True}})
    m = dist.to_static((_TwoInputs.apply, params), loader, masked_mse, optax.sgd(0.1), strategy)
    losses = [float(m(b).numpy()) for b in loader()]
    ref_losses, ref = _labelled_reference(weights, batches, optax.sgd(0.1), k=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name in weights:
        np.testing.assert_allclose(m.params[name].numpy(), ref[name], rtol=1e-4, atol=1e-6)
    # the accumulators are Partial over dp, the dim the batch (labels too) is split over
    placed = m._batch((next(iter(loader)),), "train")
    assert isinstance(placed[-1], list) and len(placed) == 3  # x, gain, then [y, mask]
    assert all(isinstance(pl[0], dist.Partial) for pl in m._acc_placements(placed))
    assert all(isinstance(pl[0], dist.Partial) for pl in m._acc_placements(placed[-1:]))


def test_several_outputs_and_labels_call_the_loss_as_paddles_loss_of_outputs_then_labels():
    """A model of two outputs and a loss_fn(out, aux, y, mask): called with the outputs and
    then the labels one per argument (Paddle's loss(*outputs, *labels)); a loss_fn of the
    outputs whole, loss_fn(outputs, label), is called as before."""
    def forward(p, x, gain):
        out = _TwoInputs.apply(p, x, gain)
        return out, jnp.tanh(out)

    def loss_of_four(out, aux, y, mask):
        return masked_mse(out, y, mask) + 0.1 * jnp.mean(aux ** 2)

    weights, batches = _weights(), _labelled_batches()
    params = {k: dist.shard_tensor(v, MESH24, PLACEMENTS["tp"][1][k]) for k, v in weights.items()}
    m = dist.to_static((forward, params), None, loss_of_four, optax.sgd(0.1))
    losses = [float(m(b).numpy()) for b in batches]
    ref_losses, ref = _labelled_reference(weights, batches, optax.sgd(0.1), forward, loss_of_four)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(m.params["w1"].numpy(), ref["w1"], rtol=1e-4, atol=1e-6)
    (x, gain), (y, mask) = batches[0]
    whole = dist.to_static((forward, params), None, lambda outs, y: mse(outs[0], y))
    np.testing.assert_allclose(float(whole([x, gain], y).numpy()),
                               mse(forward(weights, x, gain)[0], y), rtol=1e-5)


def test_a_loss_of_one_label_parameter_takes_the_list_of_labels_whole():
    """loss_fn(out, labels) of a pytree label: the list comes whole, as before."""
    def pair_loss(out, labels):
        y, mask = labels
        return masked_mse(out, y, mask)

    weights, batches = _weights(), _labelled_batches(n=2)
    params = {k: dist.shard_tensor(v, MESH24, PLACEMENTS["dp"][1][k]) for k, v in weights.items()}
    m = dist.to_static((_TwoInputs.apply, params), None, pair_loss, optax.sgd(0.1))
    losses = [float(m(*b).numpy()) for b in batches]
    np.testing.assert_allclose(losses, _labelled_reference(weights, batches, optax.sgd(0.1))[0],
                               rtol=1e-5)


def test_a_pipeline_reads_a_list_of_labels_as_the_one_program_step_does():
    """strategy.pipeline over two meshes: the label list goes to the last stage, each array
    cut into micro-batches, and the loss of the last stage takes them one per argument."""
    m0 = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    m1 = dist.ProcessMesh([[4, 5], [6, 7]], dim_names=["dp", "mp"])
    weights = _weights()
    params = {"w0": dist.shard_tensor(weights["w0"], m0, [R(), S(1)]),
              "b0": dist.shard_tensor(weights["b0"], m0, [R(), S(0)]),
              "w1": dist.shard_tensor(weights["w1"], m1, [R(), R()])}

    def forward(p, x, gain):
        h = jax.nn.relu((x + 0.5 * gain) @ p["w0"] + p["b0"])
        return dist.reshard(h, m1, [S(0), R()]) @ p["w1"]

    batches = _labelled_batches(n=2)
    loader = dist.shard_dataloader(batches, meshes=[m0, m1], shard_dims="dp")
    m = dist.to_static((forward, params), loader, masked_mse, optax.sgd(0.1),
                       dist.Strategy({"pipeline": {"enable": True, "accumulate_steps": 2}}))
    losses = [float(m(b).numpy()) for b in loader()]
    ref_losses, ref = _labelled_reference(weights, batches, optax.sgd(0.1))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(m.params["w1"].numpy(), ref["w1"], rtol=1e-4, atol=1e-6)
    # a label of the list that cannot be cut into micro-batches is named by its parameter
    (x, gain), (y, mask) = batches[0]
    with pytest.raises(dist.StageError, match=r"batch element 2\[1\] \(loss_fn's argument "
                                              r"'mask'\) has an array of shape \[4, 8\]"):
        m([x, gain], [y, mask[:4]])


def test_a_batch_of_labels_the_loss_or_the_mode_cannot_take_is_an_error_saying_what_to_write():
    weights, batches = _weights(), _labelled_batches(n=1)
    (x, gain), (y, mask) = batches[0]
    params = {k: dist.shard_tensor(v, MESH24, PLACEMENTS["dp"][1][k]) for k, v in weights.items()}

    def model(loss):
        return dist.to_static((_TwoInputs.apply, params), None, loss, optax.sgd(0.1))

    # the training batch handed to predict: it reached the model as (list, list)
    with pytest.raises(dist.DistModelError, match=r"predict takes the model's inputs only, but "
                                                  r"the batch is a list of 2 inputs and then a "
                                                  r"list of 2 labels.*dist_model\(\[x1, x2\]\)"):
        model(masked_mse).predict()([x, gain], [y, mask])
    with pytest.raises(dist.DistModelError, match=r"list of 2 inputs and then a label"):
        model(masked_mse).predict()([x, gain], y)
    # two labels for a loss of one
    with pytest.raises(dist.DistModelError, match=r"loss_fn <lambda>\(out\) cannot be called as "
                                                  r"loss_fn\(output, y1, y2\).*is a list of 2: "
                                                  r"loss_fn is called as loss_fn\(output, y1, "
                                                  r"y2\) \(Paddle's rule\)"):
        model(lambda out: jnp.mean(out))([x, gain], [y, mask])
    # two labels for a loss of three
    with pytest.raises(dist.DistModelError, match=r"loss_fn <lambda>\(out, y, mask, w\) cannot "
                                                  r"be called on the model's output and labels "
                                                  r"\(a list of 2\) as any of loss_fn\(output, "
                                                  r"y1, y2\), loss_fn\(output, labels\)"):
        model(lambda out, y, mask, w: jnp.mean(out))([x, gain], [y, mask])
    # one label for a loss of two: Paddle's form named
    with pytest.raises(dist.DistModelError, match=r"passes one label.*dist_model\(inputs, "
                                                  r"\[y1, y2\]\) for loss_fn\(output, y1, y2\)"):
        model(masked_mse)([x, gain], y)

    # two outputs and a list of two labels, a loss of three parameters: either reading fits
    def forward(p, x, gain):
        out = _TwoInputs.apply(p, x, gain)
        return out, out
    two = dist.to_static((forward, params), None, lambda a, b, c: jnp.mean(a), optax.sgd(0.1))
    with pytest.raises(dist.DistModelError, match=r"can be called both as loss_fn\(outputs, y1, "
                                                  r"y2\).*and as loss_fn\(out1, out2, labels\)"):
        two([x, gain], [y, mask])

    # a flat batch that splits two ways between a model of an optional input and the labels
    def optional(p, x, gain=None):
        return _TwoInputs.apply(p, x, x if gain is None else gain)
    either = dist.to_static((optional, params), None, lambda out, *labels: jnp.mean(out),
                            optax.sgd(0.1))
    with pytest.raises(dist.DistModelError, match=r"a flat batch of 5 arrays splits into the "
                                                  r"model's inputs and loss_fn's labels 2 ways "
                                                  r"\(1 \+ 4, 2 \+ 3\).*dist_model\(\[x1\], "
                                                  r"\[y1, y2, y3, y4\]\) or dist_model\(\[x1, "
                                                  r"x2\], \[y1, y2, y3\]\)"):
        either(x, gain, y, mask, mask)


@pytest.mark.parametrize("built", ["eval-only", "predict-only"])
def test_summary_of_a_model_that_cannot_train_describes_the_step_it_runs(built):
    """An eval-only DistModel (a loss_fn, no optimizer) summarised the train step it cannot
    build, failing in a bare AttributeError inside the trace; a predict-only one's error spoke of
    that train step too. The summary is the eval (or predict) program's, and says so; asking
    for the train program is a DistModelError saying what the model lacks."""
    weights, (x, y) = _weights(), _batches(n=1)[0]
    mesh, model = _model("tp", weights)
    loss = mse if built == "eval-only" else None
    m = dist.to_static(model, None, loss)
    batch = (x, y) if loss else (x,)
    program = "eval" if loss else "predict"
    lines = m.summary(*batch).splitlines()
    missing = "optimizer" if loss else "loss_fn"
    assert lines[1].startswith(f"the {program} step (this DistModel has no {missing}"), lines
    assert list(m.programs()) == [program]
    plan = m.programs()[program].plan(*m.program_args(program, *batch))
    listed = lines[2].split(": ", 1)[1].split("; ")[0]
    assert listed == ", ".join(f"{n} {k}" for k, n in sorted(
        Counter(c.kind for c in plan.collectives).items())), lines
    # and the model still computes what one device does
    out = m(*batch).numpy()
    np.testing.assert_allclose(out, mse(apply(weights, x), y) if loss else apply(weights, x),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(dist.DistModelError, match=r"program 'train' needs "
                                                  + ("an optimizer" if loss else
                                                     "a loss_fn and an optimizer")
                                                  + r".*use what it has: "
                                                  + ("eval, predict" if loss else "predict")):
        m.program_args("train", x, y)


@pytest.mark.parametrize("mode", ["train", "eval", "predict"])
def test_summary_reads_the_batch_for_the_train_step_in_any_mode(mode):
    """summary() describes the train step: its batch (inputs, label) is read as train reads
    it whatever the model's mode — in predict mode [x, gain], y was read as predict's inputs
    ('cannot take the batch's 1 input(s)')."""
    weights, b = _weights(), _dict_batches(n=1)[0]
    params = {k: dist.shard_tensor(v, MESH24, PLACEMENTS["tp"][1][k]) for k, v in weights.items()}
    m = dist.to_static((_TwoInputs.apply, params), None, mse, optax.sgd(0.1))
    want = m.summary([b["x"], b["gain"]], b["y"])
    getattr(m, mode)()
    assert m.summary([b["x"], b["gain"]], b["y"]) == want
    assert m.mode == mode


def test_to_static_with_shard_dataloader_seed_4_5():
    weights, batches = _weights(), _batches(n=4)
    mesh, model = _model("dp", weights)
    loader = dist.shard_dataloader(batches, meshes=mesh, shard_dims="dp")
    m = dist.to_static(model, loader, mse, optax.sgd(0.1))
    m.train()
    losses = [float(m(inputs).numpy()) for inputs in loader]
    np.testing.assert_allclose(losses, _reference(weights, batches, optax.sgd(0.1))[0], rtol=1e-6)


def test_strategy_sections_and_errors():
    s = dist.Strategy({"sharding": {"enable": True, "stage": 2}})
    s.gradient_merge.enable = True
    s.gradient_merge.k_steps = 4
    assert s.to_dict()["gradient_merge"]["k_steps"] == 4 and s.sharding.stage == 2
    with pytest.raises(dist.StrategyError, match="stage = 4 is not one of"):
        s.sharding.stage = 4
    s.amp.level = "O2"  # Paddle's spelling in paddle.amp; the strategy's is "o2"
    assert s.amp.level == "o2" and dist.Strategy({"amp": {"level": "O1"}}).amp.level == "o1"
    with pytest.raises(dist.StrategyError, match="is not one of"):
        s.amp.level = "O3"
    with pytest.raises(dist.StrategyError, match="no setting 'stages'"):
        dist.Strategy({"sharding": {"stages": 2}})
    with pytest.raises(dist.StrategyError, match="unknown strategy sections"):
        dist.Strategy({"zero": {}})
    with pytest.raises(dist.OptimizerError, match="GradientTransformation"):
        dist.shard_optimizer(object())
    with pytest.raises(dist.StrategyError, match="is a switch: write True or False, not 'False'"):
        dist.Strategy({"sharding": {"enable": "False", "stage": 3}})  # a true string
    with pytest.raises(dist.StrategyError, match="'no_such' is not one of jax.checkpoint_policies"):
        dist.Strategy({"recompute": {"enable": True, "policy": "no_such"}})
    with pytest.raises(dist.StrategyError, match="takes a dict of sections"):
        dist.Strategy(["sharding"])
    # reading a section or setting that does not exist (Paddle code reads the section first:
    # strategy.pipline.enable = True): a StrategyError that is still an AttributeError
    for read, match in [(lambda: s.pipline, r"no section 'pipline' \(did you mean 'pipeline'\?\)"),
                        (lambda: s.fused_passes, r"no section 'fused_passes'; its sections are"),
                        (lambda: s.sharding.enabel, r"strategy.sharding has no setting 'enabel' "
                                                    r"\(did you mean 'enable'\?\)")]:
        with pytest.raises(dist.StrategyError, match=match) as info:
            read()
        assert isinstance(info.value, AttributeError)
    assert not hasattr(s, "pipline") and getattr(s.amp, "nothing", 3) == 3
    assert copy.deepcopy(s).to_dict() == s.to_dict()
    weights = _weights()
    for config, match in [({"enable": True, "stage": 1, "degree": 3},
                           r"degree = 3, but the optimizer states are split over mesh dim 'dp' "
                           r"of 2 devices"),
                          ({"enable": True, "stage": 3}, "already sharded at stage 1")]:
        with pytest.raises(dist.StrategyError, match=match):
            dist.to_static(_model("dp", weights)[1], None, mse,
                           dist.shard_optimizer(optax.sgd(0.1), dist.ShardingStage1("dp"))
                           if config["stage"] == 3 else optax.sgd(0.1),
                           dist.Strategy({"sharding": config}))
    m = dist.to_static(_model("dp", weights)[1], None, lambda out, y: (out - y) ** 2,
                       optax.sgd(0.1))
    with pytest.raises(dist.DistModelError, match=r"returned an array of shape \(\d+, 8\).*"
                                                  r"reduce it in loss_fn"):
        m(*_batches(n=1)[0])
    # what is not one floating-point number: the loss alone, said (jax's and Python's errors)
    for loss_fn, match in [(lambda out, y: (mse(out, y), out), "returned a tuple.*loss alone"),
                           (lambda out, y: {"loss": mse(out, y)}, "returned a dict"),
                           (lambda out, y: 0, "returned a value of dtype int32, which has no gradient")]:
        with pytest.raises(dist.DistModelError, match=match):
            dist.to_static(_model("dp", weights)[1], None, loss_fn, optax.sgd(0.1))(
                *_batches(n=1)[0])
    x, y = _batches(n=1)[0]
    with pytest.raises(dist.DistModelError, match=r"apply\(params, \*inputs\) cannot take the "
                                                  r"batch's 2 input\(s\).*but the last \(the label\)"):
        dist.to_static(_model("dp", weights)[1], None, mse, optax.sgd(0.1))(x, x, y)


@pytest.mark.parametrize("tx,n_moments", [(optax.sgd(0.1), 0), (optax.adam(0.1), 2)],
                         ids=["sgd", "adam"])
@pytest.mark.parametrize("stage", [dist.ShardingStage1, dist.ShardingStage2, dist.ShardingStage3])
def test_a_sharding_stage_on_a_mesh_dim_the_params_lack_is_an_error(tx, n_moments, stage):
    # sgd keeps no state to shard: the misnamed dim is reported all the same
    w = dist.shard_tensor(np.ones((8, 4), np.float32), MESH24, [dist.Replicate(), dist.Shard(1)])
    with pytest.raises(dist.OptimizerError, match=r"mesh_dim='zz'\): the params' mesh has dims "
                                                  r"\['dp', 'mp'\]; name one of them"):
        dist.shard_optimizer(tx, stage("zz")).init({"w": w})
    with pytest.raises(dist.OptimizerError, match=r"mesh_dim=2\): the params' mesh has dims"):
        dist.shard_optimizer(tx, stage(2)).init({"w": w})  # a mesh dim number past them
    state = dist.shard_optimizer(tx, stage("dp")).init({"w": w})  # the dim named right
    moments = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, dist.DistTensor))
               if isinstance(x, dist.DistTensor) and x.shape == (8, 4)]
    assert len(moments) == n_moments
    assert all(m.placements == [dist.Shard(0), dist.Shard(1)] for m in moments), moments


@pytest.mark.parametrize("stage", [0, 1, 3], ids=["dp+tp", "zero1", "zero3"])
def test_offloaded_optimizer_states_train_like_one_device(stage):
    """Paddle's optimize_offload (strategy.sharding.offload): adamw's moments (at stage 3 the
    params too) live in host memory between steps; each step's program copies them to the
    devices where it reads them and back out. The losses and params are one device's, the states stay on host after every
    step, and the program compiled once; the collectives are those of the same step without
    offloading."""
    weights, batches = _weights(), _batches(n=4)
    tx = optax.adamw(1e-2)
    _, model = _model("tp", weights)
    strategy = dist.Strategy({"sharding": {"enable": stage > 0, "stage": max(stage, 1),
                                           "offload": True}})
    m = dist.to_static(model, None, mse, tx, strategy)
    states = [x for x in jax.tree.leaves(m.opt_state, is_leaf=_is_dt) if _is_dt(x)]
    assert states and {x.memory_kind for x in states} == {"pinned_host"}
    losses = [float(m(x, y).numpy()) for x, y in batches]
    ref_losses, ref_params = _reference(weights, batches, tx)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, atol=1e-4)
    for name, value in ref_params.items():
        np.testing.assert_allclose(m.params[name].numpy(), value, rtol=1e-4, atol=1e-4)
        # stage 3 offloads the (split) params as well
        assert m.params[name].memory_kind == ("pinned_host" if stage == 3 else "device")
    assert {x.memory_kind for x in jax.tree.leaves(m.opt_state, is_leaf=_is_dt)
            if _is_dt(x)} == {"pinned_host"}
    train = m.programs()["train"]
    assert train.trace_count == 1
    args = m.program_args("train", *batches[0])
    assert "pinned_host" in train.lower(*args).as_text()  # the host copies are in the program
    plain = dist.to_static(_model("tp", weights)[1], None, mse, tx, dist.Strategy(
        {"sharding": {"enable": stage > 0, "stage": max(stage, 1)}}))
    plain(*batches[0])
    assert _hlo(m, "train", batches[0]) == _hlo(plain, "train", batches[0])


def test_offload_moves_blocks_to_host_and_back():
    x = dist.shard_tensor(np.arange(64, dtype=np.float32).reshape(8, 8), MESH24, [R(), S(1)])
    host = dist.offload(x)
    assert (x.memory_kind, host.memory_kind) == ("device", "pinned_host")
    assert host.placements == x.placements
    np.testing.assert_array_equal(host.numpy(), x.numpy())
    f = dist.jit(lambda a: a * 2, out_memory_kinds="pinned_host")
    assert f(host).memory_kind == "pinned_host" and f(x).memory_kind == "pinned_host"
    np.testing.assert_array_equal(f(host).numpy(), x.numpy() * 2)
    assert dist.offload(host, "device").memory_kind == "device"
    with pytest.raises(dist.PlacementTypeError, match="memory kind"):
        dist.jit(lambda a: a, out_memory_kinds="hbm")
    with pytest.raises(dist.PlacementTypeError, match="one per output"):
        dist.jit(lambda a: (a, a), out_memory_kinds=["pinned_host"])(x)


def test_an_offloaded_input_differentiates_with_grad_inside_or_outside_dist_jit():
    """Under jax.grad the input is a tracer with no sharding to read: its type's memory
    space says it lives on the host, and it is copied in as when called directly."""
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(16, 12)).astype(np.float32)
    a = dist.offload(dist.shard_tensor(x, MESH24, [S(0), R()]))
    b = dist.shard_tensor(w, MESH24, [R(), S(1)])
    fn = lambda a, b: jnp.sum(jnp.tanh(a @ b))  # noqa: E731
    want = jax.grad(fn, argnums=(0, 1))(x, w)
    f = dist.jit(fn)
    for grad in (jax.grad(lambda a, b: f(a, b), argnums=(0, 1)),
                 dist.jit(jax.grad(fn, argnums=(0, 1)))):
        for got, ref in zip(grad(a, b), want):
            np.testing.assert_allclose(got.numpy(), ref, rtol=1e-4, atol=1e-5)


def test_offloaded_states_save_and_load_back_into_host_memory(tmp_path):
    weights, batches = _weights(), _batches(n=2)
    strategy = dist.Strategy({"sharding": {"enable": True, "stage": 1, "offload": True}})
    m = dist.to_static(_model("tp", weights)[1], None, mse, optax.adamw(1e-2), strategy)
    m(*batches[0])
    saved = {k: v.numpy() for k, v in m.state_dict().items()}
    dist.save_state_dict(m.state_dict(), str(tmp_path / "ckpt"))
    fresh = dist.to_static(_model("tp", weights)[1], None, mse, optax.adamw(1e-2), strategy)
    state = fresh.state_dict()
    dist.load_state_dict(state, str(tmp_path / "ckpt"))
    for key, value in state.items():
        np.testing.assert_array_equal(value.numpy(), saved[key])
        assert value.memory_kind == ("pinned_host" if key.startswith("opt.") else "device"), key


def test_jax_offloading_shardings_work_on_dist_jit():
    """Code written for jax.jit's host offloading moves over: in_shardings / out_shardings
    with memory_kind="pinned_host" put the arguments and results in host memory."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    host = NamedSharding(MESH24.to_jax(), P(None, "mp"), memory_kind="pinned_host")
    device = NamedSharding(MESH24.to_jax(), P(None, "mp"))
    f = dist.jit(lambda s, g: s * 0.5 + g, in_shardings=(host, device), out_shardings=host)
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    out = f(a, np.ones_like(a))
    assert out.memory_kind == "pinned_host" and out.placements == [R(), S(1)]
    np.testing.assert_allclose(out.numpy(), a * 0.5 + 1)
    again = f(dist.shard_tensor(a, MESH24, [R(), R()]), np.ones_like(a))  # resharded, then offloaded
    np.testing.assert_allclose(again.numpy(), a * 0.5 + 1)


class _TwoLayers(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(4, 8, rngs=rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.body(x)))


@pytest.mark.parametrize("wrap", ["nnx.Optimizer", "shard_optimizer(nnx.Optimizer)"])
@pytest.mark.parametrize("stage", [0, 1])
def test_an_nnx_optimizer_with_wrt_trains_only_its_params(wrap, stage):
    # fine-tuning a head: nnx.Optimizer(model, tx, wrt=filter) updates only what the filter
    # takes (weight decay included); the rest keeps its values and gets no optimizer state
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(8, 4)).astype(np.float32),
                rng.normal(size=(8, 2)).astype(np.float32)) for _ in range(3)]
    tx, wrt = optax.adamw(1e-2, weight_decay=0.1), nnx.PathContains("head")
    ref = _TwoLayers(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, tx, wrt=wrt)
    for x, y in batches:
        grads = nnx.grad(lambda m: mse(m(x), y), argnums=nnx.DiffState(0, wrt))(ref)
        ref_opt.update(ref, grads)
    mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
    model = dist.shard_layer(_TwoLayers(nnx.Rngs(0)), mesh)
    opt = nnx.Optimizer(model, tx, wrt=wrt)
    if wrap != "nnx.Optimizer":
        opt = dist.shard_optimizer(opt)
    strategy = dist.Strategy({"sharding": {"enable": stage > 0, "stage": max(stage, 1)}})
    m = dist.to_static(model, None, mse, opt, strategy)
    for x, y in batches:
        m(dist.shard_tensor(x, mesh, [S(0), R()]), y)
    state = m.state_dict()
    for layer in ("body", "head"):
        for name in ("kernel", "bias"):
            np.testing.assert_allclose(state[f"param.{layer}.{name}"].numpy(),
                                       np.asarray(getattr(getattr(ref, layer), name)[...]),
                                       rtol=1e-5, atol=1e-6)
    assert not [k for k in state if k.startswith("opt.") and ".body." in k]  # no state for it


def test_a_batch_that_does_not_fit_an_nnx_modules_inputs_says_how_batches_become_arguments():
    """The training batch (x, y) handed to predict of an nnx model: the error says predict
    takes the inputs only (it was the module's own TypeError from inside the trace)."""
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.lin(x)

    model = dist.shard_layer(Net(nnx.Rngs(0)), MESH8)
    x, y = np.ones((8, 4), np.float32), np.ones((8, 2), np.float32)
    m = dist.to_static(model, None, mse, optax.sgd(0.1))
    ref = Net(nnx.Rngs(0))
    np.testing.assert_allclose(m.predict()(x).numpy(), np.asarray(ref(x)), rtol=1e-6)
    with pytest.raises(dist.DistModelError, match=r"Net.__call__\(\*inputs\) cannot take the "
                                                  r"batch's 2 input\(s\).*in predict mode every "
                                                  r"element is"):
        m.predict()(x, y)


def test_a_batch_that_does_not_fit_an_apply_fns_inputs_says_how_batches_become_arguments():
    w = dist.shard_tensor(np.ones((4, 2), np.float32), MESH24, [R(), R()])
    x, y = np.ones((8, 4), np.float32), np.ones((8, 2), np.float32)
    m = dist.to_static((lambda p, x: x @ p["w"], {"w": w}), None, mse, optax.sgd(0.1))
    np.testing.assert_allclose(m.predict()(x).numpy(), x @ np.ones((4, 2)))
    with pytest.raises(dist.DistModelError, match=r"cannot take the batch's 2 input\(s\).*"
                                                   r"in predict mode every element is"):
        m.predict()(x, y)  # the training batch handed to predict
    with pytest.raises(dist.DistModelError, match=r"cannot take the batch's 2 input\(s\)"):
        m.train()(x, x, y)


def test_a_zero_mesh_dim_missing_on_one_stages_mesh_names_the_meshes():
    """Params on two meshes (pipeline stages), ZeRO over a dim only the first has: the error
    says the dim must be on every stage's mesh and names one they share (it read as if the
    params lived on one mesh, suggesting a dim the first mesh lacks)."""
    first = dist.ProcessMesh([[0, 1], [2, 3]], ["dp", "x"])
    second = dist.ProcessMesh([4, 5, 6, 7], ["x"])
    params = {"w0": dist.shard_tensor(np.ones((4, 4), np.float32), first, [R(), R()]),
              "w1": dist.shard_tensor(np.ones((4, 4), np.float32), second, [R()])}
    with pytest.raises(dist.OptimizerError, match=r"ShardingStage1\(mesh_dim='dp'\): the params "
                                                  r"live on 2 meshes \(pipeline stages\), and "
                                                  r".*has no dim 'dp': name a dim every stage's "
                                                  r"mesh has, e.g. ShardingStage1\('x'\)"):
        dist.shard_optimizer(optax.adam(1e-2), dist.ShardingStage1("dp")).init(params)
    state = dist.shard_optimizer(optax.adam(1e-2), dist.ShardingStage1("x")).init(params)
    assert state[0].mu["w0"].placements == [R(), S(0)]
    assert state[0].mu["w1"].placements == [S(0)]


def test_a_train_step_updates_params_and_optimizer_states_in_place(monkeypatch):
    """The train step donates the params and optimizer states it replaces, as Paddle's static
    graph updates them in place: the compiled step aliases them to its results, so its peak
    memory holds one copy of them, not the old and the new (to_static donated nothing; found
    by a probe). The arrays the user passed in stay the user's: copied once before the first
    step (the optimizer states the model made itself are not), still readable after it; a
    weight tied to another (one array in two places) trains too."""
    weights, batches = _weights(), _batches(n=4)
    mesh, (fn, params) = _model("tp", weights)
    m = dist.to_static((fn, params), None, mse, optax.adam(1e-2))
    copies, copy = [], jnp.copy
    monkeypatch.setattr(jnp, "copy", lambda x, *a, **k: copies.append(x.shape) or copy(x, *a, **k))
    losses = [float(m(x, y).numpy()) for x, y in batches]
    assert sorted(copies) == sorted(v.shape for v in weights.values())  # the user's, once
    ref_losses, ref = _reference(weights, batches, optax.adam(1e-2))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name, v in m.state_dict().items():
        if name in ref:
            np.testing.assert_allclose(v.numpy(), ref[name], rtol=1e-4, atol=1e-6)
    for name, v in params.items():  # the user's arrays: intact, the values given
        np.testing.assert_array_equal(v.numpy(), weights[name])
    args = m.program_args("train", *batches[0])
    memory = m.programs()["train"].lower(*args).compile().memory_analysis()
    held = sum(x.physical.nbytes // len(x.physical.addressable_shards)
               for x in jax.tree.leaves((m.params, m.opt_state), is_leaf=_is_dt) if _is_dt(x))
    assert memory.alias_size_in_bytes >= held  # (per device: params + adam's mu and nu)
    from autoshard.reshard.planner import format_bytes
    assert (f"({format_bytes(memory.alias_size_in_bytes)} of them in the arguments' buffers)"
            in m.summary(*batches[0]))  # summary's memory line says so
    # one array as two params: each donated once (the second copied first)
    shared = dist.shard_tensor(np.eye(16, dtype=np.float32), MESH24, [R(), R()])
    tied = dist.to_static((lambda p, x: x @ p["a"] @ p["b"], {"a": shared, "b": shared}), None,
                          lambda o, y: jnp.mean((o - y) ** 2), optax.sgd(0.1))
    x, y = batches[0][0], batches[0][0] * 2
    for _ in range(2):
        tied(x, y)
    np.testing.assert_array_equal(shared.numpy(), np.eye(16))


@pytest.mark.parametrize("stage", [0, 2], ids=["no-zero", "zero2"])
def test_gradient_merge_steps_update_in_place(monkeypatch, stage):
    """With gradient merge, the accumulating steps add into the accumulators in place and
    the merging step updates the params and optimizer states in place (both held old and
    new at their peak; found by the donation probe). The merging step's accumulators, read
    and dropped, stay an undonated argument: donated, XLA gave them the params' slots."""
    weights, batches = _weights(), _batches(n=8)
    _, model = _model("dp", weights)
    strategy = dist.Strategy({"gradient_merge": {"enable": True, "k_steps": 4, "avg": True},
                              "sharding": {"enable": stage > 0, "stage": max(stage, 1)}})
    tx = optax.sgd(0.1, momentum=0.9)
    m = dist.to_static(model, None, mse, tx, strategy)
    copies, copy = [], jnp.copy
    monkeypatch.setattr(jnp, "copy", lambda x, *a, **k: copies.append(x.shape) or copy(x, *a, **k))
    losses = [float(m(x, y).numpy()) for x, y in batches]
    # the user's weights, once; never the accumulators the model made
    assert sorted(copies) == sorted(v.shape for v in weights.values())
    ref_losses, ref_params = _reference(weights, batches, tx, k=4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for name, value in ref_params.items():
        np.testing.assert_allclose(m.params[name].numpy(), value, rtol=1e-6, atol=1e-7)
    for name, v in model[1].items():
        np.testing.assert_array_equal(v.numpy(), weights[name])

    def local_bytes(tree):
        return sum(x.physical.nbytes // len(x.physical.addressable_shards)
                   for x in jax.tree.leaves(tree, is_leaf=_is_dt) if _is_dt(x))

    for name, held in (("accumulate", lambda args: local_bytes(args[1]["acc"])),
                       ("merge", lambda args: local_bytes((m.params, m.opt_state)))):
        args = m.program_args(name, *batches[0])
        assert "acc" in args[0 if name == "merge" else 1]
        memory = m.programs()[name].lower(*args).compile().memory_analysis()
        assert memory.alias_size_in_bytes >= held(args), name


def test_models_sharing_arrays_each_keep_theirs_through_the_others_donated_steps():
    """Two DistModels holding the same arrays — one given the other's state_dict, one built
    from the nnx module the other trains (an eval model beside the training one) — each
    train or evaluate as alone: a model copies what another holds before its step donates
    it (the second model's step crashed jaxlib on the donated buffers; found by a probe)."""
    weights, batches = _weights(), _batches(n=3)
    (x, y), (x2, y2) = batches[0], batches[1]
    make = lambda: dist.to_static(_model("dp", weights)[1], None, mse, optax.sgd(0.1))  # noqa: E731
    a, b = make(), make()
    a(x, y)
    b.set_state_dict(a.state_dict())  # b holds a's arrays ...
    want = float(b.eval()(x2, y2).numpy())
    b.train()
    la = float(a(x2, y2).numpy())  # ... which a's step would donate
    lb = float(b(x2, y2).numpy())
    assert la == lb == pytest.approx(want)

    class Net(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(dist.shard_tensor(weights["w0"], MESH8, [R()]))

        def __call__(self, x):
            return x @ self.w

    net, y16 = Net(), np.zeros((8, 32), np.float32)
    trainer = dist.to_static(net, None, mse, optax.sgd(0.1))
    trainer(x, y16)
    ev = dist.to_static(net, None, mse)  # reads the module's (trainer's) arrays
    before = float(ev(x, y16).numpy())
    trainer(x, y16)
    assert float(ev(x, y16).numpy()) == before  # its own copy of the params it was built with
    assert float(dist.to_static(net, None, mse)(x, y16).numpy()) < before  # the module trained
