"""dist.jit of a function whose values move between meshes (Paddle's pipeline idiom,
`dist.reshard(y, mesh1, ...)` inside the forward): cut into one program per stage, run in
order — forward, gradients and optimizer updates equal one device; each stage's compiled
program has the collectives its plan lists; values read on the wrong mesh are errors that
say what to write."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoshard as dist
from autoshard.hlo import collectives

R, S = dist.Replicate(), dist.Shard
MESH0 = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
MESH1 = dist.ProcessMesh([[4, 5], [6, 7]], dim_names=["x", "y"])

rng = np.random.default_rng(0)
W0 = rng.normal(size=(64, 256)).astype("float32") * 0.05
W1 = rng.normal(size=(256, 64)).astype("float32") * 0.05
X = rng.uniform(size=(4, 16, 64)).astype("float32")
Y = rng.uniform(size=(4, 16, 64)).astype("float32")


def forward(p, x, move=True):
    """The seed's §4.4 forward: w0 column-split on mesh0, w1 row-split on mesh1."""
    y = jnp.matmul(x, p["w0"])
    if move:
        y = dist.reshard(y, MESH1, [S(0), S(2)])
    return jnp.matmul(jax.nn.gelu(y), p["w1"])


def loss_fn(p, x, label, move=True):
    return jnp.mean((forward(p, x, move) - label) ** 2)


def placed():
    return ({"w0": dist.shard_tensor(W0, MESH0, [R, S(1)]),
             "w1": dist.shard_tensor(W1, MESH1, [R, S(0)])},
            dist.shard_tensor(X, MESH0, [S(0), R]), dist.shard_tensor(Y, MESH1, [S(0), R]))


def _stage_runs(f, *args):
    """(program, its arguments) of every stage, as dist.jit runs them."""
    entry, leaves = f._entry(args, {})
    runs = []
    entry._run(leaves, lambda program, a, _moves: runs.append((program, a)))
    return runs


def test_forward_across_two_meshes_equals_one_device():
    p, x, label = placed()
    f = dist.jit(loss_fn)
    out = f(p, x, label)
    assert out.mesh == MESH1 and out.shape == ()
    ref = loss_fn({"w0": W0, "w1": W1}, X, Y, move=False)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5)
    plans = f.stage_plans(p, x, label)
    assert [pl.mesh for pl in plans] == [MESH0, MESH1]
    # stage 0: batch on x, w0 columns on y — no communication; stage 1 receives y as
    # [S(0), S(2)] (the hint), contracts the row-split w1 and reduces the mean
    for (program, args), plan in zip(_stage_runs(f, p, x, label), plans):
        hlo = program.lower(*args).compile().as_text()
        assert len(collectives(hlo)) == len(plan.collectives), program.__name__
    assert plans[0].collectives == []
    assert plans[1].collectives
    # explain(): each stage's plan, and what moves onto its mesh, with bytes and the line
    text = str(f.explain(p, x, label))
    assert text.startswith("autoshard: loss_fn runs as 2 stages on 2 meshes")
    moved = [line for line in text.splitlines() if "arrives:" in line]
    assert len(moved) == 1  # the activation, with the hint's placements (the label lives there)
    assert re.search(r"arrives: float32\[4, 16, 256\] from devices \[0, 1, 2, 3\] .* at "
                     r"test_cut\.py:\d+: 16\.0 KiB/device", moved[0]), moved[0]


def test_a_train_step_with_grad_and_adamw_inside_runs_as_three_stages():
    """Forward on mesh0, forward + backward + w1's update on mesh1, backward + w0's update on
    mesh0 — the cotangent goes back to the mesh its value came from."""
    p, x, label = placed()
    tx = optax.adamw(1e-2)
    state = tx.init(p)

    @dist.jit
    def step(p, state, x, label):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, label)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    @jax.jit
    def ref_step(p, state, x, label):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, label, False)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    ref_p = {"w0": W0, "w1": W1}
    ref_state = tx.init(ref_p)
    for _ in range(3):
        p, state, loss = step(p, state, x, label)
        ref_p, ref_state, ref_loss = ref_step(ref_p, ref_state, X, Y)
        np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    for name in ref_p:
        np.testing.assert_allclose(p[name].numpy(), ref_p[name], rtol=1e-4, atol=1e-6)
    assert (p["w0"].mesh, p["w0"].placements) == (MESH0, [R, S(1)])
    assert (p["w1"].mesh, p["w1"].placements) == (MESH1, [R, S(0)])
    assert [pl.mesh for pl in step.stage_plans(p, state, x, label)] == [MESH0, MESH1, MESH0]


@pytest.mark.parametrize("poison", [False, True], ids=["finite", "inf-skipped"])
@pytest.mark.parametrize("wrap", ["apply_if_finite", "multisteps_skip"])
def test_an_update_in_one_lax_cond_over_params_of_both_meshes_equals_one_device(wrap, poison):
    """optax.apply_if_finite (and MultiSteps' skip_not_finite) update every param inside one
    lax.cond: operands of both meshes meet there. Its branches are computed and each result
    selected, element by element on the result's own mesh (it stopped with a
    MeshMismatchError); a non-finite gradient skips the update as on one device."""
    p, x, label = placed()
    tx = (optax.apply_if_finite(optax.adamw(1e-2), 3) if wrap == "apply_if_finite" else
          optax.MultiSteps(optax.adamw(1e-2), 1, should_skip_update_fn=optax.skip_not_finite))
    scale = np.float32(np.inf if poison else 1.0)

    def make_step(move):
        def step(p, state, x, label, scale):
            loss, grads = jax.value_and_grad(lambda p: loss_fn(p, x, label, move) * scale)(p)
            updates, state = tx.update(grads, state, p)
            return optax.apply_updates(p, updates), state, loss
        return step

    step, ref_step = dist.jit(make_step(True)), jax.jit(make_step(False))
    # (MultiSteps' init runs skip_not_finite, which stacks a flag of every param: eagerly, jax
    # cannot stack arrays of two meshes; dist.jit's init cuts it like the step)
    state, ref_p = dist.jit(tx.init)(p), {"w0": W0, "w1": W1}
    ref_state = tx.init(ref_p)
    for _ in range(2):
        p, state, loss = step(p, state, x, label, scale)
        ref_p, ref_state, ref_loss = ref_step(ref_p, ref_state, X, Y, scale)
        np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    for name in ref_p:
        np.testing.assert_allclose(p[name].numpy(), ref_p[name], rtol=1e-4, atol=1e-6)
        if poison:  # skipped: the weights are the initial ones
            np.testing.assert_array_equal(p[name].numpy(), {"w0": W0, "w1": W1}[name])
    assert (p["w0"].mesh, p["w1"].mesh) == (MESH0, MESH1)


def test_a_jax_jit_body_that_moves_to_another_mesh_is_cut_like_inline_code():
    # a jitted helper holding the stage boundary (a call is its body): spliced into the
    # program, forward and backward, then cut as if written inline
    @jax.jit
    def second_stage(y, w1):
        y = dist.reshard(y, MESH1, [S(0), S(2)])
        return jnp.matmul(jax.nn.gelu(y), w1)

    def wrapped(p, x, label):
        return jnp.mean((second_stage(jnp.matmul(x, p["w0"]), p["w1"]) - label) ** 2)

    p, x, label = placed()
    f = dist.jit(jax.value_and_grad(wrapped))
    loss, grads = f(p, x, label)
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)({"w0": W0, "w1": W1}, X, Y, False)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    for name in ref_grads:
        np.testing.assert_allclose(grads[name].numpy(), ref_grads[name], rtol=1e-4, atol=1e-7)
        assert grads[name].mesh == p[name].mesh
    assert [pl.mesh for pl in f.stage_plans(p, x, label)] == [MESH0, MESH1, MESH0]


def test_a_jax_jit_call_reading_params_of_both_meshes_is_cut_like_inline_code():
    # a jitted update over every param (optax's bias correction is one in jax >= 0.11) reads
    # values of two meshes: its body is spliced in, each param updated on its own mesh
    @jax.jit
    def sgd(p, g):
        return jax.tree.map(lambda a, b: a - 0.5 * b, p, g)

    def step(p, x, label, move=True):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, label, move)
        return sgd(p, grads), loss

    p, x, label = placed()
    f = dist.jit(step)
    new, loss = f(p, x, label)
    ref_new, ref_loss = step({"w0": W0, "w1": W1}, X, Y, False)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    for name in ref_new:
        np.testing.assert_allclose(new[name].numpy(), ref_new[name], rtol=1e-4, atol=1e-6)
        assert (new[name].mesh, new[name].placements) == (p[name].mesh, p[name].placements)
    assert [pl.mesh for pl in f.stage_plans(p, x, label)] == [MESH0, MESH1, MESH0]

    @jax.jit
    def mixes(w0, w1):  # inlined too, so the error names the operation that mixes them
        return jnp.sum(w0 @ w1)

    with pytest.raises(dist.MeshMismatchError, match=r"meet in `dot_general`"):
        dist.jit(lambda p: mixes(p["w0"], p["w1"]))(p)


def test_a_chain_back_to_the_first_mesh_with_a_scalar_param_moving_along():
    """mesh0 → mesh1 → mesh0; a 0-d param on mesh0 is used on mesh1 (scalars move freely)."""
    w = [rng.normal(size=(16, 16)).astype("float32") * 0.3 for _ in range(3)]
    scale = np.float32(1.5)
    x = rng.normal(size=(8, 16)).astype("float32")

    def f(p, x, move=True):
        h = jnp.tanh(x @ p["a"])
        if move:
            h = dist.reshard(h, MESH1, [S(0), R])
        h = jnp.tanh(h @ p["b"]) * p["scale"]
        if move:
            h = dist.reshard(h, MESH0, [S(0), R])
        return jnp.sum(jnp.tanh(h @ p["c"]) ** 2)

    p = {"a": dist.shard_tensor(w[0], MESH0, [R, S(1)]),
         "b": dist.shard_tensor(w[1], MESH1, [R, S(0)]),
         "c": dist.shard_tensor(w[2], MESH0, [R, R]),
         "scale": dist.shard_tensor(scale, MESH0, [R, R])}
    loss, grads = dist.jit(jax.value_and_grad(f))(p, dist.shard_tensor(x, MESH0, [S(0), R]))
    ref = {"a": w[0], "b": w[1], "c": w[2], "scale": scale}
    ref_loss, ref_grads = jax.value_and_grad(lambda q: f(q, x, False))(ref)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    for name in ref:
        np.testing.assert_allclose(grads[name].numpy(), ref_grads[name], rtol=1e-4, atol=1e-6)
        assert grads[name].mesh == p[name].mesh or grads[name].shape == (), name


class Hybrid(nnx.Module):
    """Seed §4.4's MlpModel in flax nnx, its forward as written in Paddle."""

    def __init__(self, placed_: bool = True):
        w0, w1 = W0, W1
        if placed_:
            w0 = dist.shard_tensor(w0, MESH0, [R, S(1)])
            w1 = dist.shard_tensor(w1, MESH1, [R, S(0)])
        self.w0, self.w1 = nnx.Param(w0), nnx.Param(w1)
        self.placed = placed_

    def __call__(self, x):
        y = jnp.matmul(x, self.w0)
        if self.placed:
            y = dist.reshard(y, MESH1, [S(0), S(2)])
        return jnp.matmul(y, self.w1)


def _mse(out, label):
    return jnp.mean((out - label) ** 2)


def _one_device(batches, tx):
    """The unplaced model trained on `batches` with nnx + optax: (model, losses)."""
    ref = Hybrid(placed_=False)
    opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)

    @nnx.jit
    def ref_step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: _mse(m(x), y))(model)
        opt.update(model, grads)
        return loss

    return ref, [float(ref_step(ref, opt, x, y)) for x, y in batches]


@pytest.mark.parametrize("zero3", [False, True])
def test_to_static_trains_a_model_whose_forward_moves_to_another_mesh(zero3):
    batches = [(X[:2] + k, Y[:2] * k) for k in range(3)]
    loader = dist.shard_dataloader(batches, meshes=[MESH0, MESH1], shard_dims="x")
    mse = _mse
    model = Hybrid()
    strategy = dist.Strategy({"sharding": {"enable": zero3, "stage": 3, "mesh_dim": "x"}})
    dm = dist.to_static(model, loader, mse, optax.adamw(1e-3), strategy)
    losses = [float(dm(x, y).numpy()) for x, y in loader()]

    ref, ref_losses = _one_device(batches, optax.adamw(1e-3))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(model.w1[...].numpy(), ref.w1[...], rtol=1e-4, atol=1e-6)
    states = jax.tree.leaves(dm.opt_state, is_leaf=lambda v: isinstance(v, dist.DistTensor))
    moments = [s for s in states if isinstance(s, dist.DistTensor) and s.ndim == 2]
    assert sorted((m.mesh.process_ids[0], m.shape) for m in moments) == [
        (0, (64, 256)), (0, (64, 256)), (4, (256, 64)), (4, (256, 64))]
    stages = dm.summary(*batches[0]).splitlines()[1:]
    assert [line.split(":")[0] for line in stages] == [
        "stage 0 on devices [0, 1, 2, 3]", "stage 1 on devices [4, 5, 6, 7]",
        "stage 2 on devices [0, 1, 2, 3]"]
    if zero3:  # stored split over 'x' on each weight's own mesh, gathered where it is used
        assert [(p.mesh, p.placements) for p in dm.params.values()] == [(MESH0, [S(0), S(1)]),
                                                                       (MESH1, [S(1), S(0)])]


@pytest.mark.parametrize("mode,recompute", [("1F1B", False), ("ZBH1", False), ("1F1B", True)])
def test_to_static_with_strategy_pipeline_schedules_the_cut_stages_over_micro_batches(mode,
                                                                                     recompute):
    """Paddle's strategy.pipeline (schedule_mode, accumulate_steps) on the same model: the loss
    over 2 micro-batches per step, the weights as one device's whole-batch steps."""
    batches = [(X + k, Y * k) for k in range(3)]  # 4 rows: 2 data-parallel shards × 2 micro
    loader = dist.shard_dataloader(batches, meshes=[MESH0, MESH1], shard_dims="x")
    mse = _mse
    strategy = dist.Strategy({"pipeline": {"enable": True, "schedule_mode": mode,
                                           "accumulate_steps": 2},
                              "recompute": {"enable": recompute}})
    model = Hybrid()
    dm = dist.to_static(model, loader, mse, optax.sgd(0.05), strategy)
    losses = [float(dm(x, y).numpy()) for x, y in loader()]

    ref, ref_losses = _one_device(batches, optax.sgd(0.05))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(model.w0[...].numpy(), ref.w0[...], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(model.w1[...].numpy(), ref.w1[...], rtol=1e-4, atol=1e-6)
    (runner,) = dm._pipeline._runners.values()
    assert (runner.schedule.name, runner.schedule.micro_batches, len(runner.stages)) == (mode, 2, 2)
    assert runner.recompute is recompute


def test_to_static_pipeline_takes_plain_batches_when_params_are_placed_by_hand():
    """No loader and no stage list: the stages are the meshes the params were placed on, and
    which of them reads the label is known only from the trace — the label is left for the
    program to place (it was put on the first param's mesh, where a loss on another failed)."""
    m0, m1 = MESH0, MESH1
    rng = np.random.default_rng(0)
    w = {"w0": rng.normal(size=(64, 32)).astype(np.float32) / 8,
         "w1": rng.normal(size=(32, 16)).astype(np.float32) / 6}
    params = {"w0": dist.shard_tensor(w["w0"], m0, [R, R]),
              "w1": dist.shard_tensor(w["w1"], m1, [R, R])}

    def forward(p, x):
        return dist.reshard(jnp.tanh(x @ p["w0"]), m1, [S(0), R]) @ p["w1"]

    batches = [(rng.normal(size=(8, 64)).astype(np.float32),
                rng.normal(size=(8, 16)).astype(np.float32)) for _ in range(2)]
    dm = dist.to_static((forward, params), None, _mse, optax.sgd(0.1),
                        dist.Strategy({"pipeline": {"enable": True, "accumulate_steps": 2}}))
    losses = [float(dm(x, y).numpy()) for x, y in batches]
    ref, tx = {k: jnp.asarray(v) for k, v in w.items()}, optax.sgd(0.1)
    state, ref_losses = tx.init(ref), []
    for x, y in batches:
        loss, g = jax.value_and_grad(lambda p: _mse(jnp.tanh(x @ p["w0"]) @ p["w1"], y))(ref)
        updates, state = tx.update(g, state, ref)
        ref, ref_losses = optax.apply_updates(ref, updates), ref_losses + [float(loss)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(dm.params["w1"].numpy(), ref["w1"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_gradient_merge_without_a_pipeline_keeps_each_accumulator_on_its_params_mesh(stage):
    """The seed's two-mesh model trained by to_static with gradient merge (k=2, averaged) and
    no strategy.pipeline: each gradient accumulator lives on its param's own mesh (they were
    all made on the first: the accumulate program failed, two meshes meeting in an `add`);
    losses and params equal one device, with and without ZeRO."""
    batches = [(X + k, Y * (k + 1)) for k in range(4)]
    config = {"gradient_merge": {"enable": True, "k_steps": 2, "avg": True}}
    if stage:
        config["sharding"] = {"enable": True, "stage": stage, "mesh_dim": "x"}
    p, _, _ = placed()
    dm = dist.to_static((lambda p, x: forward(p, x), p), None, _mse, optax.sgd(0.05, 0.9),
                        dist.Strategy(config))
    losses = [float(dm(dist.shard_tensor(x, MESH0, [S(0), R]),
                       dist.shard_tensor(y, MESH1, [S(0), R])).numpy()) for x, y in batches]
    w = {"w0": jnp.asarray(W0), "w1": jnp.asarray(W1)}
    tx = optax.sgd(0.05, 0.9)
    state, acc, ref_losses = tx.init(w), None, []
    for i, (x, y) in enumerate(batches):
        value, g = jax.value_and_grad(lambda w: loss_fn(w, x, y, move=False))(w)
        ref_losses.append(float(value))
        acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
        if i % 2:
            u, state = tx.update(jax.tree.map(lambda a: a / 2, acc), state, w)
            w, acc = optax.apply_updates(w, u), None
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k in w:
        np.testing.assert_allclose(dm.params[k].numpy(), w[k], rtol=1e-4, atol=1e-6)
    assert (dm.params["w0"].mesh, dm.params["w1"].mesh) == (MESH0, MESH1)


@pytest.mark.parametrize("sharding", [None, "stage3"])
def test_to_static_pipeline_with_gradient_merge_and_zero3(sharding):
    """strategy.pipeline with gradient_merge (k=2, averaged): one update per two calls, on
    the mean of their gradients; with sharding stage 3 the params stay stored split over 'x'
    on their own stage's mesh and are gathered inside each stage's programs."""
    batches = [(X + k, Y * (k + 1)) for k in range(4)]
    loader = dist.shard_dataloader(batches, meshes=[MESH0, MESH1], shard_dims="x")
    config = {"pipeline": {"enable": True, "schedule_mode": "1F1B", "accumulate_steps": 2},
              "gradient_merge": {"enable": True, "k_steps": 2, "avg": True}}
    if sharding:
        config["sharding"] = {"enable": True, "stage": 3, "mesh_dim": "x"}
    model = Hybrid()
    dm = dist.to_static(model, loader, _mse, optax.sgd(0.05), dist.Strategy(config))
    losses = [float(dm(x, y).numpy()) for x, y in loader()]

    ref = Hybrid(placed_=False)
    w = {"w0": np.asarray(ref.w0[...]), "w1": np.asarray(ref.w1[...])}
    grad = jax.jit(jax.value_and_grad(lambda p, x, y: _mse(jnp.matmul(x @ p["w0"], p["w1"]), y)))
    ref_losses = []
    for pair in (batches[:2], batches[2:]):
        results = [grad(w, x, y) for x, y in pair]
        ref_losses += [float(v) for v, _ in results]
        w = {k: w[k] - 0.05 * (results[0][1][k] + results[1][1][k]) / 2 for k in w}
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(model.w0[...].numpy(), w["w0"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(model.w1[...].numpy(), w["w1"], rtol=1e-4, atol=1e-6)
    stored = {k: (v.mesh, v.placements) for k, v in dm.params.items()}
    if sharding:  # ZeRO-3 adds 'x' on a free dim of each weight, on its own stage's mesh
        assert stored == {"w0": (MESH0, [S(0), S(1)]), "w1": (MESH1, [S(1), S(0)])}
    else:
        assert stored == {"w0": (MESH0, [R, S(1)]), "w1": (MESH1, [R, S(0)])}


def test_values_read_on_a_mesh_they_do_not_live_on_are_errors_that_say_what_to_write():
    p, x, label = placed()

    def forgot_to_move(p, x):
        return jnp.sum(jnp.matmul(x, p["w0"]) @ p["w1"])  # w1 lives on mesh1

    with pytest.raises(dist.MeshMismatchError,
                       match=r"values on ProcessMesh\(\[\[0, 1\], \[2, 3\]\].* and on "
                             r"ProcessMesh\(\[\[4, 5\], \[6, 7\]\].* meet in `dot_general`.*"
                             r"dist\.reshard\(x, mesh, placements\)") as err:
        dist.jit(forgot_to_move)(p, x)
    assert re.search(r"test_cut\.py:\d+", str(err.value))
    # a label left on the first stage's mesh: the error says which argument and where to put it
    with pytest.raises(dist.MeshMismatchError,
                       match=r"meet in `sub`.*an argument \(leaf 3 of the flattened arguments\) "
                             r"is read here as it was given, on ProcessMesh\(\[\[0, 1\], "
                             r"\[2, 3\]\].*: place it on ProcessMesh\(\[\[4, 5\], \[6, 7\]\].*"
                             r"shard_dataloader\(\.\.\., meshes=\[first stage's mesh, last "
                             r"stage's mesh\]\)"):
        dist.jit(loss_fn)(p, x, dist.shard_tensor(Y, MESH0, [S(0), R]))

    @jax.checkpoint
    def moves_inside(w0, x):  # a move at the body's edge is taken out of it; this one is not
        return jnp.tanh(dist.reshard(x @ w0, MESH1, [S(0), S(2)]))

    with pytest.raises(dist.MeshMismatchError, match=r"`remat2` \(the body of a jax.checkpoint.*"
                                                     r"moves values to ProcessMesh\(\[\[4, 5\]"):
        dist.jit(lambda p, x: jnp.sum(moves_inside(p["w0"], x) @ p["w1"]))(p, x)
    f = dist.jit(loss_fn)
    with pytest.raises(dist.MeshMismatchError, match="put jax.grad / value_and_grad inside"):
        jax.grad(lambda q: f(q, x, label))(p)
    with pytest.raises(dist.MeshMismatchError, match=r"spans 2 meshes.*\.stage_plans"):
        f.plan(p, x, label)


@pytest.mark.parametrize("edge", ["start", "end"])
def test_a_remat_layer_with_the_stage_move_at_its_edge_keeps_its_remat_on_one_mesh(edge):
    """pp_config puts the stage boundary's reshard first in a layer's call; with the layer
    under jax.checkpoint the move (and in the backward its cotangent's move back) is at the
    body's edge: it is made just outside, the body runs on one stage with its remat kept, and
    loss and gradients equal one device."""
    from autoshard.compiler.cut import cut_by_mesh
    from autoshard.compiler.trace import hint_back_p, hint_p

    @jax.checkpoint
    def layer(w1, y):
        if edge == "start":
            y = dist.reshard(y, MESH1, [S(0), S(2)])
        out = jnp.matmul(jax.nn.gelu(y), w1)
        return out if edge == "start" else dist.reshard(out, MESH1, [S(0), R])

    def loss(p, x, label):
        y = jnp.matmul(x, p["w0"])
        w1 = p["w1"] if edge == "start" else dist.reshard(p["w1"], MESH0, [R, R])
        return jnp.mean((layer(w1, y) - label) ** 2)

    p, x, label = placed()
    value, grads = dist.jit(jax.value_and_grad(loss))(p, x, label)
    ref_value, ref_grads = jax.value_and_grad(loss)({"w0": W0, "w1": W1}, X, Y)
    np.testing.assert_allclose(value.numpy(), ref_value, rtol=1e-5)
    for k in ("w0", "w1"):
        np.testing.assert_allclose(grads[k].numpy(), ref_grads[k], rtol=1e-4, atol=1e-7)
        if k == "w0" or edge == "start":  # ("end": w1's gradient is its copy's, on mesh0)
            assert (grads[k].mesh, grads[k].placements) == (p[k].mesh, p[k].placements)

    avals = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in (W0, W1, X, Y)]
    closed = jax.make_jaxpr(lambda w0, w1, x, y: jax.value_and_grad(loss)(
        {"w0": w0, "w1": w1}, x, y))(*avals)
    cut = cut_by_mesh(closed, [MESH0, MESH1, MESH0, MESH1])
    home = MESH1 if edge == "start" else MESH0
    remats = [(part.mesh, e) for part in cut.stages for e in part.eqns
              if e.primitive.name == "remat2"]
    assert remats and all(mesh == home for mesh, _ in remats)  # the backward's recompute
    assert not any(b.primitive in (hint_p, hint_back_p)
                   for _, e in remats for b in e.params["jaxpr"].eqns)


def test_results_that_read_nothing_placed_are_plain_arrays_and_optimizer_states_follow_params():
    p, x, _ = placed()
    zeros, loss = dist.jit(lambda p, x: (jnp.zeros(3), jnp.sum(forward(p, x))))(p, x)
    assert not isinstance(zeros, dist.DistTensor) and np.all(np.asarray(zeros) == 0)
    assert loss.mesh == MESH1
    state = dist.shard_optimizer(optax.adam(1e-3)).init(p)
    mu = state[0].mu
    assert (mu["w0"].mesh, mu["w0"].placements) == (MESH0, [R, S(1)])
    assert (mu["w1"].mesh, mu["w1"].placements) == (MESH1, [R, S(0)])
    np.testing.assert_array_equal(mu["w1"].numpy(), np.zeros_like(W1))


# -- random chains across meshes ---------------------------------------------------------------
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

CHAIN_MESHES = [dist.ProcessMesh([0, 1, 2, 3], ["x"]), dist.ProcessMesh([4, 5, 6, 7], ["x"]),
                dist.ProcessMesh([1, 3, 5, 7], ["x"])]
CHOICES = [[R], [S(0)], [S(1)]]
ACTS = [jnp.tanh, jnp.sin, lambda h: h + 0.1 * h * h]


@given(steps=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 2),
                                st.integers(0, 2)), min_size=1, max_size=5),
       x_place=st.integers(0, 2))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_chains_across_meshes_train_like_one_device(steps, x_place):
    """Each step: on mesh `m` (moving the activation there with placements `move` when it
    changes), h = act(h @ w) with w placed `w_place`; then jax.value_and_grad inside dist.jit."""
    r = np.random.default_rng(len(steps))
    ws = [r.normal(size=(8, 8)).astype("float32") * 0.4 for _ in steps]
    x = r.normal(size=(8, 8)).astype("float32")

    def loss(ws, x, placed=True):
        h, here = x, steps[0][0]
        for (m, w_place, move, act), w in zip(steps, ws):
            if placed and m != here:
                h = dist.reshard(h, CHAIN_MESHES[m], CHOICES[move])
            here = m
            h = ACTS[act](h @ w)
        return jnp.mean(h * h)

    params = [dist.shard_tensor(w, CHAIN_MESHES[m], CHOICES[wp])
              for (m, wp, _, _), w in zip(steps, ws)]
    xd = dist.shard_tensor(x, CHAIN_MESHES[steps[0][0]], CHOICES[x_place])
    value, grads = dist.jit(jax.value_and_grad(loss))(params, xd)
    ref, ref_grads = jax.value_and_grad(lambda q: loss(q, x, False))(ws)
    np.testing.assert_allclose(value.numpy(), ref, rtol=1e-5, atol=1e-7)
    for g, rg, p in zip(grads, ref_grads, params):
        np.testing.assert_allclose(g.numpy(), rg, rtol=1e-4, atol=1e-6)
        assert g.mesh == p.mesh


def test_to_static_pipeline_with_float16_loss_scaling_trains_like_without_the_pipeline():
    """float16 (o1) with dynamic loss scaling through a pipeline: the loss seeds the backward
    scaled, the gradients are unscaled before the update, the scale grows after finite steps
    and a step whose gradients overflow is skipped — as the same DistModel without pipeline."""
    batches = [(X + k, Y * (k + 1)) for k in range(4)] + [(X * 1e6, Y)]  # the last overflows
    loader = dist.shard_dataloader(batches, meshes=[MESH0, MESH1], shard_dims="x")
    amp = {"enable": True, "dtype": "float16", "level": "o1", "init_loss_scaling": 1024.0,
           "incr_every_n_steps": 2}
    runs = []
    for pipeline in (True, False):
        model = Hybrid()
        dm = dist.to_static(model, loader, _mse, optax.sgd(0.05), dist.Strategy(
            {"amp": amp, "pipeline": {"enable": pipeline, "schedule_mode": "1F1B",
                                      "accumulate_steps": 2}}))
        losses, scales = [], []
        for x, y in loader():
            losses.append(float(dm(x, y).numpy()))
            scales.append(dm.loss_scale)
        runs.append((losses, scales, model.w0[...].numpy()))
    (losses, scales, w0), (ref_losses, ref_scales, ref_w0) = runs
    # doubled after every 2 finite steps; one overflow is skipped (the scale shrinks after 2)
    assert scales == ref_scales == [1024.0, 2048.0, 2048.0, 4096.0, 4096.0]
    np.testing.assert_allclose(losses[:4], ref_losses[:4], rtol=2e-3)
    assert not np.isfinite(losses[4]) and not np.isfinite(ref_losses[4])
    assert np.isfinite(w0).all()  # the overflowing step changed nothing
    np.testing.assert_allclose(w0, ref_w0, rtol=2e-3, atol=1e-5)


def test_to_static_recompute_on_a_model_across_meshes_recomputes_each_stage():
    """A jax.checkpoint around the whole forward could not be cut into stages: recompute on a
    model whose params live on two meshes runs each stage's forward again in its backward
    (a one-micro-batch pipeline with the runner's recompute) — and trains like one device."""
    batches = [(X[:2] + k, Y[:2] * k) for k in range(3)]
    loader = dist.shard_dataloader(batches, meshes=[MESH0, MESH1], shard_dims="x")
    model = Hybrid()
    dm = dist.to_static(model, loader, _mse, optax.adamw(1e-3),
                        dist.Strategy({"recompute": {"enable": True}}))
    losses = [float(dm(x, y).numpy()) for x, y in loader()]
    ref, ref_losses = _one_device(batches, optax.adamw(1e-3))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(model.w0[...].numpy(), ref.w0[...], rtol=1e-4, atol=1e-6)
    (runner,) = dm._pipeline._runners.values()
    assert (runner.schedule.micro_batches, len(runner.stages), runner.recompute) == (1, 2, True)

