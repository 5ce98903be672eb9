"""scan, while, cond and checkpoint are partitioned inside, equal to one device, with the plan's
collectives — and a gradient accumulated across a scan is reduced once, after the loop."""
import sys
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard as dist
from autoshard.compiler.plan import plan_seconds
from autoshard.hlo import collective_bytes, count_collectives
from autoshard.testing import make_tensor

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])


def run_checked(fn, *args):
    f = dist.jit(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        out = f(*args)
    planned = Counter(c.kind for c in f.plan(*args).collectives)
    assert count_collectives(f.lower(*args).compile().as_text()) == planned
    return f, out


def _scan_loss(w, xs):
    def body(c, x):
        return c + jnp.tanh(x @ w).sum(), x * 2
    c, ys = jax.lax.scan(body, 0.0, xs)
    return c + ys.sum() * 0.01


@pytest.mark.parametrize("pw,px", [(["R", "S(1)"], ["R", "R"]), (["R", "R"], ["R", "S(1)"]),
                                   (["S(0)", "R"], ["R", "R"])])
def test_scan_value_and_gradient(pw, px):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(4, 4)).astype(np.float32)
    xs = rng.normal(size=(3, 8, 4)).astype(np.float32)
    dw, dxs = dist.shard_tensor(w, MESH, pw), dist.shard_tensor(xs, MESH, px)
    f, (loss, grad) = run_checked(jax.value_and_grad(_scan_loss), dw, dxs)
    ref_loss, ref_grad = jax.value_and_grad(_scan_loss)(w, xs)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), ref_grad, rtol=1e-4, atol=1e-5)


def test_gradient_accumulated_across_a_scan_is_reduced_once_after_the_loop():
    # data parallel over the scanned micro-batches: per-step dW is Partial(sum) over dp
    w = np.eye(4, dtype=np.float32)
    xs = np.arange(3 * 8 * 4, dtype=np.float32).reshape(3, 8, 4) / 100
    dw = dist.shard_tensor(w, MESH, ["R", "R"])
    dxs = dist.shard_tensor(xs, MESH, [dist.Shard(1), dist.Replicate()])  # batch over dp
    f, (loss, grad) = run_checked(jax.value_and_grad(_scan_loss), dw, dxs)
    np.testing.assert_allclose(grad.numpy(), jax.grad(_scan_loss)(w, xs), rtol=1e-4, atol=1e-6)
    plan = f.plan(dw, dxs)
    inside = [c for c in plan.collectives if "inside scan" in c.reason]
    assert not inside, [c.reason for c in inside]  # no per-iteration reduction
    backward = [ep for ep in plan.eqns if ep.primitive == "scan"][-1]
    assert any(L.partial for L in backward.results)  # the carry stays Partial through the loop


def _layers_loss(w, xb):  # a scan over stacked layers: its gradient comes out of a loop
    def layer(h, wl):
        return h + jnp.tanh(h @ wl), None
    h, _ = jax.lax.scan(layer, xb, w)
    return jnp.mean(h ** 2)


def _plain_loss(w, xb):
    return jnp.mean(jnp.tanh(xb @ w[0]) ** 2)


@pytest.mark.parametrize("loss", [_layers_loss, _plain_loss], ids=["layers-scan", "plain"])
@pytest.mark.parametrize("bound", ["static", "traced"])
def test_gradients_accumulated_over_micro_batches_are_reduced_once_after_the_loop(loss, bound):
    # gradient accumulation as users write it: zeros, then each micro-batch's gradient added
    # in a fori_loop (a scan; a while loop when the trip count is traced). The batch is split
    # over dp, so each gradient is pending over dp: carried pending, it is reduced once after
    # the loop, where reducing it before each add all-reduces it on every iteration (as it was
    # for a gradient made by a scan inside the body, whose pending sum propagation cannot see)
    rng = np.random.default_rng(0)
    w = (rng.normal(size=(3, 8, 8)) * 0.3).astype(np.float32)
    xs = rng.normal(size=(4, 16, 8)).astype(np.float32)  # 4 micro-batches of 16 rows

    def step(w, xs, n):
        def body(i, acc):
            l, g = jax.value_and_grad(loss)(w, xs[i])
            return acc[0] + l, acc[1] + g
        stop = n if bound == "traced" else 4
        return jax.lax.fori_loop(0, stop, body, (jnp.zeros(()), jnp.zeros_like(w)))

    dw = dist.shard_tensor(w, MESH, ["R", "R"])
    dxs = dist.shard_tensor(xs, MESH, [dist.Shard(1), dist.Replicate()])
    n = np.int32(4)
    f, (l, g) = run_checked(step, dw, dxs, n)
    ref_l, ref_g = jax.jit(step)(w, xs, n)
    np.testing.assert_allclose(l.numpy(), ref_l, rtol=1e-5)
    np.testing.assert_allclose(g.numpy(), ref_g, rtol=1e-4, atol=1e-6)
    plan = f.plan(dw, dxs, n)
    assert not [c.reason for c in plan.collectives if "inside" in c.reason]
    # the loss and the gradient, each all-reduced once over dp
    assert sorted(c.bytes_per_device for c in plan.collectives) == [4, w.nbytes]
    assert all(c.kind == "all-reduce" and c.axes == ("dp",) for c in plan.collectives)


@pytest.mark.parametrize("bound", ["static", "traced"])
def test_a_loop_constant_moved_alike_at_every_read_is_moved_once_before_the_loop(bound,
                                                                               monkeypatch):
    # micro-batches sliced along the dim the batch is split on: each is held by some devices
    # only, so the batch is re-split (an all-to-all) — once, before the loop, not per micro-batch
    # (no larger per device). A weight the body gathers is still gathered inside: hoisted, the
    # gathered copy would be held for the whole loop (ZeRO-3's params across micro-batches).
    # With the batch moved, the body's fixpoint goes on from the carries it had found (the
    # accumulators, Partial over dp): planned once more, not again from the initial carries.
    from autoshard.compiler import control_flow

    plans, sub_plan = [], control_flow._sub_plan

    def counting(jaxpr, mesh, inputs, *a):
        plans.append(list(inputs))
        return sub_plan(jaxpr, mesh, inputs, *a)

    monkeypatch.setattr(control_flow, "_sub_plan", counting)
    rng = np.random.default_rng(1)
    w = (rng.normal(size=(8, 8)) * 0.3).astype(np.float32)
    x = rng.normal(size=(16, 4, 8)).astype(np.float32)

    def step(w, x, n):
        def body(i, acc):
            xb = jax.lax.dynamic_slice_in_dim(x, i * 4, 4)
            l, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(xb @ w) ** 2))(w)
            return acc[0] + l, acc[1] + g
        stop = n if bound == "traced" else 4
        return jax.lax.fori_loop(0, stop, body, (jnp.zeros(()), jnp.zeros_like(w)))

    dw = dist.shard_tensor(w, MESH, [dist.Shard(0), dist.Replicate()])   # ZeRO-3-like
    dx = dist.shard_tensor(x, MESH, [dist.Shard(0), dist.Replicate()])   # batch over dp
    n = np.int32(4)
    f, (l, g) = run_checked(step, dw, dx, n)
    ref_l, ref_g = jax.jit(step)(w, x, n)
    np.testing.assert_allclose(l.numpy(), ref_l, rtol=1e-5)
    np.testing.assert_allclose(g.numpy(), ref_g, rtol=1e-4, atol=1e-6)
    moves = {(c.kind, "inside" in c.reason) for c in f.plan(dw, dx, n).collectives}
    assert ("all-to-all", False) in moves and ("all-to-all", True) not in moves
    assert ("all-gather", True) in moves and ("all-gather", False) not in moves
    split = dist.Layout(((), ("dp",), ()))  # the micro-batches' batch dim over dp, moved
    after_move = [p for p in plans if split in p]
    assert len(after_move) == 1 and all(L.partial for L in after_move[0][-2:]), after_move


def test_cond_and_while():
    x = np.arange(32, dtype=np.float32).reshape(8, 4) / 10
    dx = dist.shard_tensor(x, MESH, ["S(0)", "S(1)"])

    def fn(x):
        y = jax.lax.cond(x.sum() > 0, lambda a: jnp.sin(a) * 2, lambda a: a - 1, x)
        n, z = jax.lax.while_loop(lambda c: c[0] < 4, lambda c: (c[0] + 1, c[1] * 1.5 + 1), (0, y))
        return z * n

    _, out = run_checked(fn, dx)
    np.testing.assert_allclose(out.numpy(), fn(x), rtol=1e-5)


def test_checkpoint_is_partitioned_inside_and_keeps_its_policy():
    x = np.arange(32, dtype=np.float32).reshape(8, 4) / 10
    w = np.ones((4, 4), np.float32) / 4
    dx = dist.shard_tensor(x, MESH, ["S(0)", "R"])
    dw = dist.shard_tensor(w, MESH, ["R", "S(1)"])
    policy = jax.checkpoint_policies.nothing_saveable
    block = jax.checkpoint(lambda x, w: jnp.tanh(x @ w) @ w.T, policy=policy)
    loss = lambda x, w: jnp.sum(block(x, w) ** 2)  # noqa: E731
    f, (l, g) = run_checked(jax.value_and_grad(loss, argnums=1), dx, dw)
    ref_l, ref_g = jax.value_and_grad(loss, argnums=1)(x, w)
    np.testing.assert_allclose(l.numpy(), ref_l, rtol=1e-5)
    np.testing.assert_allclose(g.numpy(), ref_g, rtol=1e-4, atol=1e-6)
    kept = [ep for ep in f.plan(dx, dw).eqns if ep.sub_plans and "checkpoint" in ep.strategy]
    assert kept and all("nothing_saveable" in ep.strategy for ep in kept)


def test_checkpoint_names_keep_the_megatron_layout_and_the_policy():
    # checkpoint_name (remat policies of LLM code) is an identity with a name: the column-split
    # projection it names stays split (it ran replicated, gathering it, with a fallback warning)
    from jax.ad_checkpoint import checkpoint_name

    x = np.arange(64, dtype=np.float32).reshape(8, 8) / 50
    w1 = np.linspace(-1, 1, 128, dtype=np.float32).reshape(8, 16)
    w2 = np.linspace(1, -1, 128, dtype=np.float32).reshape(16, 8)
    policy = jax.checkpoint_policies.save_only_these_names("up")
    block = jax.checkpoint(lambda x, w1, w2: jnp.tanh(checkpoint_name(x @ w1, "up")) @ w2,
                           policy=policy)
    loss = lambda x, w1, w2: jnp.sum(block(x, w1, w2) ** 2)  # noqa: E731
    grad = jax.value_and_grad(loss, argnums=(1, 2))
    args = (dist.shard_tensor(x, MESH, ["S(0)", "R"]), dist.shard_tensor(w1, MESH, ["R", "S(1)"]),
            dist.shard_tensor(w2, MESH, ["R", "S(0)"]))
    f, (l, (g1, g2)) = run_checked(grad, *args)
    ref_l, (ref_g1, ref_g2) = grad(x, w1, w2)
    np.testing.assert_allclose(l.numpy(), ref_l, rtol=1e-5)
    np.testing.assert_allclose(g1.numpy(), ref_g1, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(g2.numpy(), ref_g2, rtol=1e-4, atol=1e-5)
    plan = f.plan(*args)
    named = [ep for ep in plan.eqns if ep.primitive == "name"]
    assert named and all(ep.results[0].dims == (("dp",), ("mp",)) for ep in named)
    # Megatron's all-reduces only: forward output, backward input gradient, and the dp ones
    assert {c.kind for c in plan.collectives} == {"all-reduce"}


# ------------------------------------------------------------------ ZeRO-3 under jax.checkpoint
MESH8 = dist.ProcessMesh(list(range(8)), ["dp"])


def _zero3_loss(remat: bool):
    """Params stored Shard(0) over 8 devices, gathered where used (ZeRO-3)."""
    def block(x, w):
        return jnp.tanh(x @ dist.reshard(w, MESH8, [dist.Replicate()]))

    step = jax.checkpoint(block) if remat else block

    def loss(ws, x):
        for w in ws.values():
            x = step(x, w)
        return (x ** 2).mean()
    return loss


def test_zero3_checkpoint_gathers_params_again_in_the_backward():
    """The backward recomputation of a checkpointed block gathers its params again instead of
    XLA merging those gathers into the forward's (which would keep every gathered param alive
    through the backward): all-gathers = forward + backward, exactly, values as one device."""
    from autoshard.bench.workloads import keep_placements

    layers, d = 3, 128
    rng = np.random.default_rng(0)
    ws = {f"w{i}": (rng.normal(size=(d, d)) / np.sqrt(d)).astype(np.float32) for i in range(layers)}
    x = rng.normal(size=(16, d)).astype(np.float32)
    dws = {k: dist.shard_tensor(v, MESH8, [dist.Shard(0)]) for k, v in ws.items()}
    dx = dist.shard_tensor(x, MESH8, [dist.Shard(0)])
    temps = {}
    for remat in (True, False):
        step = jax.value_and_grad(_zero3_loss(remat))
        f = dist.jit(step, out_placements=keep_placements([dist.Replicate()], dws))
        value, grads = f(dws, dx)
        ref_value, ref_grads = jax.jit(step)(ws, x)
        np.testing.assert_allclose(value.numpy(), ref_value, rtol=1e-5)
        for k in ws:
            np.testing.assert_allclose(grads[k].numpy(), ref_grads[k], rtol=1e-4, atol=1e-6)
        compiled = f.lower(dws, dx).compile()
        hlo = compiled.as_text()
        gathers = layers * (2 if remat else 1)   # forward, and again in the backward
        assert count_collectives(hlo) == Counter(
            {"all-gather": gathers, "reduce-scatter": layers, "all-reduce": 1})
        assert collective_bytes(hlo)["all-gather"] == gathers * d * d * 4
        assert collective_bytes(hlo)["reduce-scatter"] == layers * d * d * 4 // 8
        temps[remat] = compiled.memory_analysis().temp_size_in_bytes
    # recomputing costs no memory over keeping the gathered params as residuals
    assert temps[True] <= temps[False]


@pytest.mark.parametrize("loop", ["scan", "fori_loop"])
def test_a_residual_carry_is_reduced_once_per_iteration_not_also_after_the_loop(loop):
    # x + relu(x @ w1) @ w2 with Megatron weights: the update is Partial over mp. Kept Partial
    # in the carry, it is reduced where the next iteration reads it and once more after the
    # loop; reduced before it is carried, once per iteration is all (the weights are the
    # loop's constants, which come before the carry among the body's inputs)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 16)).astype(np.float32)
    w1 = (rng.normal(size=(16, 32)) * 0.2).astype(np.float32)
    w2 = (rng.normal(size=(32, 16)) * 0.2).astype(np.float32)

    def f(w1, w2, x):
        def layer(h):
            return h + jax.nn.relu(h @ w1) @ w2
        if loop == "scan":
            return jax.lax.scan(lambda h, _: (layer(h), None), x, None, length=3)[0]
        return jax.lax.fori_loop(0, 3, lambda i, h: layer(h), x)

    args = (dist.shard_tensor(w1, MESH, [dist.Replicate(), dist.Shard(1)]),
            dist.shard_tensor(w2, MESH, [dist.Replicate(), dist.Shard(0)]),
            dist.shard_tensor(x, MESH, [dist.Shard(0), dist.Replicate()]))
    fn, out = run_checked(f, *args)
    np.testing.assert_allclose(out.numpy(), f(w1, w2, x), rtol=1e-5, atol=1e-6)
    collectives = fn.plan(*args).collectives
    assert [(c.kind, c.axes) for c in collectives] == [("all-reduce", ("mp",))]
    assert "inside" in collectives[0].reason


def test_a_carry_that_joins_a_partial_update_before_it_is_read_is_reduced_inside():
    # c = h + (Partial update from the scanned input): the carry itself is only added to, the
    # sum is what gets reduced (for tanh); kept Partial, the carry needed one more reduction
    # after the loop
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 16)).astype(np.float32)
    us = rng.normal(size=(3, 8, 16)).astype(np.float32)
    w1 = (rng.normal(size=(16, 32)) * 0.2).astype(np.float32)
    w2 = (rng.normal(size=(32, 16)) * 0.2).astype(np.float32)

    def f(w1, w2, x, us):
        def body(h, u):
            c = h + jax.nn.relu(u @ w1) @ w2
            return c, jnp.tanh(c)
        return jax.lax.scan(body, x, us)

    R, S = dist.Replicate(), dist.Shard
    args = (dist.shard_tensor(w1, MESH, [R, S(1)]), dist.shard_tensor(w2, MESH, [R, S(0)]),
            dist.shard_tensor(x, MESH, [S(0), R]), dist.shard_tensor(us, MESH, [R, S(1)]))
    fn, (c, ys) = run_checked(f, *args)
    want_c, want_ys = f(w1, w2, x, us)
    np.testing.assert_allclose(c.numpy(), want_c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ys.numpy(), want_ys, rtol=1e-5, atol=1e-6)
    reductions = [c for c in fn.plan(*args).collectives if c.kind == "all-reduce"]
    assert len(reductions) == 1 and "inside" in reductions[0].reason, reductions


# -- scans of independent iterations over a split scanned axis ------------------------------------

def _mapped_loss(w, x):
    """lax.map over the rows of a batch (each row alone through a small MLP)."""
    return jnp.sum(jax.lax.map(lambda r: jnp.tanh(r @ w) ** 2, x))


def _split_scans(f, *args):
    return [ep for ep in f.plan(*args).eqns if ep.primitive == "scan"
            and "iterations per device" in ep.strategy]


@pytest.mark.parametrize("pw,px", [(["R", "R"], ["S(0)", "R"]), (["R", "S(1)"], ["S(0)", "R"]),
                                   (["R", "R"], ["S(0)", "S(0)"])],
                         ids=["w replicated, rows dp", "w mp, rows dp", "rows dp,mp"])
def test_lax_map_over_a_split_batch_runs_each_devices_rows(pw, px):
    """Iterations that do not read each other run where their rows are: no gather of the
    batch, and the gradient of the mapped function's weights is the data-parallel Partial sum,
    reduced once (plain jax.jit gathers the batch and computes every row on every device)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 32)).astype(np.float32)
    w = (rng.normal(size=(32, 32)) * 0.3).astype(np.float32)
    dx, dw = dist.shard_tensor(x, MESH, px), dist.shard_tensor(w, MESH, pw)
    f, (loss, grad) = run_checked(jax.value_and_grad(_mapped_loss), dw, dx)
    ref_loss, ref_grad = jax.value_and_grad(_mapped_loss)(w, x)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), ref_grad, rtol=1e-4, atol=1e-5)
    forward, backward = _split_scans(f, dw, dx)
    rows = tuple(a for p, a in zip(px, ("dp", "mp")) if p == "S(0)")
    assert forward.required[-1].dims[0] == rows and forward.results[0].dims[0] == rows
    # the transposed map adds each row's weight gradient to its carry: Partial over the rows'
    # axes after the loop, reduced once; nothing moves the rows
    assert {a for a, _ in backward.results[0].partial} >= set(rows)
    plan = f.plan(dw, dx)
    assert not [c for c in plan.collectives if c.kind == "all-gather"]
    assert {c.kind for c in plan.collectives} == {"all-reduce"}
    assert not [c for c in plan.collectives if "inside scan" in c.reason and
                set(c.axes) & set(rows)]


def test_a_pending_weight_read_by_a_split_map_is_reduced_once_before_it():
    """A weight that is a pending sum over both axes, read whole by a map whose rows are split
    over dp: it is reduced once, before the loop, and the backward map reads the same copy
    (it was reduced over dp before the map and over mp inside every iteration of both)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 8, 8)).astype(np.float32)
    w = (rng.normal(size=(8, 8)) * 0.3).astype(np.float32)

    def loss(w, x):
        return jnp.sum(jnp.tanh(jax.lax.map(lambda r: r @ w, x)) ** 2)

    dx = dist.shard_tensor(x, MESH, ["S(0)", "S(1)"])
    dw = make_tensor(w, MESH, ["P(sum)", "P(sum)"])  # parts up to ±35: f32 rounding in w
    f, (value, grad) = run_checked(jax.value_and_grad(loss), dw, dx)
    ref_value, ref_grad = jax.value_and_grad(loss)(w, x)
    np.testing.assert_allclose(value.numpy(), ref_value, rtol=1e-4)
    np.testing.assert_allclose(grad.numpy(), ref_grad, rtol=1e-3, atol=1e-3)
    assert len(_split_scans(f, dw, dx)) == 2
    plan = f.plan(dw, dx)
    assert not [c for c in plan.collectives if "inside scan" in c.reason], str(plan)
    assert [c.step for c in plan.collectives if c.value == "a"] == ["psum(dp,mp)"]


def test_mapped_outputs_stay_split_and_equal_one_device():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    dx = dist.shard_tensor(x, MESH, ["S(0)", "R"])
    fns = {
        "map": lambda a: jax.lax.map(lambda r: jnp.sin(r) * r.sum(), a),
        "batch_size": lambda a: jax.lax.map(lambda r: jnp.sin(r) * r.sum(), a, batch_size=4),
        "reverse, carry handed back": lambda a: jax.lax.scan(
            lambda c, r: (c, jnp.cos(r) + c), 1.5, a, reverse=True)[1],
        "two xs": lambda a: jax.lax.map(lambda rs: rs[0] * rs[1], (a, a[::-1])),
    }
    for name, fn in fns.items():
        f, out = run_checked(fn, dx)
        np.testing.assert_allclose(out.numpy(), jax.jit(fn)(x), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
        assert _split_scans(f, dx), name
        assert out.placements[0] == dist.Shard(0), name
        assert not count_collectives(f.lower(dx).compile().as_text()) or name == "two xs", name


@pytest.mark.parametrize("case", ["running carry", "carry read", "uneven rows", "ordered effect"])
def test_scans_whose_iterations_depend_on_each_other_keep_the_scanned_axis_whole(case):
    """A carry that an iteration reads (a cumulative sum, a carry fed into the next row),
    rows that do not divide over the devices, or an ordered effect: the plain plan."""
    rng = np.random.default_rng(5)
    n = 10 if case == "uneven rows" else 16
    x = rng.normal(size=(n, 8)).astype(np.float32)
    fn = {
        "running carry": lambda a: jax.lax.scan(lambda c, r: (c + r, c + r), jnp.zeros(8), a)[1],
        "carry read": lambda a: jax.lax.scan(lambda c, r: (c + r, jnp.tanh(c) * r), jnp.zeros(8),
                                             a)[1],
        "uneven rows": lambda a: jax.lax.map(jnp.sin, a),
        "ordered effect": lambda a: jax.lax.map(
            lambda r: (jax.debug.print("{}", r.sum(), ordered=True), r * 2)[1], a),
    }[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dist.UnevenShardingWarning)  # 10 rows over 4
        dx = dist.shard_tensor(x, dist.ProcessMesh(list(range(4)), ["dp"]), ["S(0)"])
        f, out = run_checked(fn, dx)
    np.testing.assert_allclose(out.numpy(), jax.jit(fn)(x), rtol=1e-5, atol=1e-6)
    assert not _split_scans(f, dx)


def test_weights_split_over_the_rows_axes_are_gathered_once_before_the_map():
    """FSDP-style weights (split over the axes the rows are) under a map over the batch: the
    body runs whole iterations, so the weights are gathered once before the loop — never
    inside it — and the rows stay split; the gradient ends as the weights are placed."""
    rng = np.random.default_rng(6)
    x = rng.normal(size=(16, 32)).astype(np.float32)
    w = (rng.normal(size=(32, 32)) * 0.3).astype(np.float32)
    dx, dw = dist.shard_tensor(x, MESH, ["S(0)", "S(0)"]), dist.shard_tensor(w, MESH, ["R", "S(1)"])
    f, (loss, grad) = run_checked(jax.value_and_grad(_mapped_loss), dw, dx)
    np.testing.assert_allclose(loss.numpy(), _mapped_loss(w, x), rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), jax.grad(_mapped_loss)(w, x), rtol=1e-4, atol=1e-5)
    assert len(_split_scans(f, dw, dx)) == 2
    plan = f.plan(dw, dx)
    gathers = [c for c in plan.collectives if c.kind == "all-gather"]
    assert gathers and not [c for c in gathers if "inside scan" in c.reason]
    assert all(c.bytes_per_device <= w.nbytes for c in gathers)  # the weight, not the batch


def test_a_cond_differentiated_fills_the_other_branchs_residuals_in_place():
    """jax's gradient of a cond makes each branch return the residuals of both, the other
    branch's as broadcast placeholders. Those are made where each result is wanted (a
    scalar's broadcast is never merged into one value read in two layouts), so nothing is
    gathered for them: the plan is the compiled program."""
    mesh = dist.ProcessMesh([[0, 1], [2, 3], [4, 5], [6, 7]], ["a", "b"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 8, 8)).astype(np.float32) * 0.5
    w = rng.normal(size=(8, 8)).astype(np.float32) * 0.3

    def loss(x, w):
        h = jax.lax.cond(x.sum() > 0, lambda h: h @ w, lambda h: (h * 2.0).T, x[1])
        return (jnp.tanh(h) ** 2).sum()

    step = jax.grad(loss, argnums=(0, 1))
    dx = dist.shard_tensor(x, mesh, [dist.Replicate(), dist.Shard(2)])
    dw = dist.shard_tensor(w, mesh, [dist.Shard(1), dist.Shard(1)])
    f = dist.jit(step)
    for got, want in zip(f(dx, dw), jax.jit(step)(x, w)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    plan = f.plan(dx, dw)
    assert count_collectives(f.lower(dx, dw).compile().as_text()) == Counter(
        c.kind for c in plan.collectives), str(plan)


def _unrolled_scan(w, x, length, unroll):
    def body(c, wi):
        return jnp.tanh(c @ wi), c.sum()
    return jax.lax.scan(body, x, w[:length], unroll=unroll)


@pytest.mark.parametrize("length,unroll", [(5, 2), (4, 4), (5, True), (5, 3)])
def test_an_unrolled_scan_plans_its_bodys_collectives_once_per_copy(length, unroll):
    """jax lowers `scan(unroll=k)` with k copies of the body in the loop and the iterations
    left over after it (or every copy, when unrolled whole): the plan lists a body's
    collectives as often as the compiled program holds them."""
    rng = np.random.default_rng(4)
    w = rng.normal(size=(5, 16, 16)).astype(np.float32) * 0.3
    x = rng.normal(size=(8, 16)).astype(np.float32)
    dw = dist.shard_tensor(w, MESH, ["R", "S(1)"])
    dx = dist.shard_tensor(x, MESH, ["S(0)", "R"])
    fn = lambda w, x: _unrolled_scan(w, x, length, unroll)  # noqa: E731
    f, (c, ys) = run_checked(fn, dw, dx)
    ref_c, ref_ys = fn(w, x)
    np.testing.assert_allclose(c.numpy(), ref_c, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ys.numpy(), ref_ys, rtol=1e-5, atol=1e-5)
    copies = {(5, 2): 3, (4, 4): 4, (5, True): 5, (5, 3): 5}[(length, unroll)]
    inside = [c for c in f.plan(dw, dx).collectives if "inside scan" in c.reason]
    assert len(inside) == copies and f"copy {copies} of {copies} unrolled" in inside[-1].reason


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
@pytest.mark.parametrize("hidden, inside", [(1024, True), (32, False)], ids=["large", "small"])
def test_stacked_layer_gradients_are_reduced_inside_the_backward_loop_when_large(
        hidden, inside, remat):
    """A scan over stacked layers, data parallel: each layer's weight gradient is a stacked
    output pending its dp sum. Reduced after the loop (one collective of the same bytes), the
    stack and its reduced copy were both alive — 3.75x jax.jit's temporary memory with a
    remat body (found by a probe). A slice whose all-reduce the bandwidth prices (here 512
    KiB) is now reduced per iteration, as XLA does, and the memory is jax.jit's; a small one
    (latency-priced: one collective per layer would cost more) stays pending, reduced once."""
    layers, rows, width = 4, 256, 128
    rng = np.random.default_rng(0)
    w1 = (rng.normal(size=(layers, width, hidden)) * 0.05).astype(np.float32)
    w2 = (rng.normal(size=(layers, hidden, width)) * 0.05).astype(np.float32)
    x = rng.normal(size=(rows, width)).astype(np.float32)

    def body(h, w):
        return h + jnp.tanh(h @ w[0]) @ w[1], None

    layer = jax.checkpoint(body) if remat else body
    step = jax.value_and_grad(
        lambda w1, w2, x: jnp.mean(jax.lax.scan(layer, x, (w1, w2))[0] ** 2), argnums=(0, 1))
    args = (dist.shard_tensor(w1, MESH8, ["R"]), dist.shard_tensor(w2, MESH8, ["R"]),
            dist.shard_tensor(x, MESH8, ["S(0)"]))
    f, (loss, grads) = run_checked(step, *args)
    want_loss, want_grads = jax.jit(step)(w1, w2, x)
    np.testing.assert_allclose(loss.numpy(), want_loss, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-3, atol=1e-6)
    plan = f.plan(*args)
    stacked = [c for c in plan.collectives if c.kind == "all-reduce"
               and c.bytes_per_device >= hidden * width * 4 // (1 if inside else layers) - 1]
    assert len(stacked) == 2, plan.collectives  # the two weights' gradients
    assert all((c.runs == layers) == inside for c in stacked), [c.runs for c in stacked]
    compiled = f.lower(*args).compile()
    assert count_collectives(compiled.as_text()) == Counter(c.kind for c in plan.collectives)
    if inside:
        ours = compiled.memory_analysis().temp_size_in_bytes
        xla = jax.jit(step).lower(*(a.physical for a in args)).compile()
        assert ours <= 1.05 * xla.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("length,unroll", [(5, 1), (5, 2), (4, 4), (6, 3)])
def test_collectives_per_call_count_each_iteration_of_a_scan(length, unroll):
    """The plan lists a loop body's collectives once per copy, as the compiled program holds
    them; per call (what a step sends: DistModel.summary, explain's "per call") they run once
    per iteration — as many as the same scan unrolled whole lists."""
    rng = np.random.default_rng(4)
    w = rng.normal(size=(6, 16, 16)).astype(np.float32) * 0.3
    x = rng.normal(size=(8, 16)).astype(np.float32)
    dw = dist.shard_tensor(w, MESH, ["R", "S(1)"])
    dx = dist.shard_tensor(x, MESH, ["S(0)", "R"])
    looped = dist.jit(lambda w, x: _unrolled_scan(w, x, length, unroll)).plan(dw, dx)
    whole = dist.jit(lambda w, x: _unrolled_scan(w, x, length, True)).plan(dw, dx)
    assert looped.collective_counts(per_call=True) == whole.collective_counts()
    assert looped.bytes_per_call() == whole.total_bytes and looped.runs_known
    # and the plans are priced per call, as the passes that weigh one plan against another
    # compare them (a plan moving data in a long loop is not as cheap as one moving it once)
    model = dist.default_cost_model()
    assert plan_seconds(looped, model) == pytest.approx(plan_seconds(whole, model))
    if unroll == 1:
        assert looped.collective_counts() != whole.collective_counts()
        assert "per call: " in str(looped)


def test_a_split_scan_unrolled_plans_its_share_of_the_copies():
    """A map whose rows are split runs length / n iterations per device: unrolled by 2, each
    device's loop holds 2 copies of the body's collectives."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(16, 32)).astype(np.float32)
    w = (rng.normal(size=(32, 32)) * 0.3).astype(np.float32)
    dx = dist.shard_tensor(x, MESH, ["S(0)", "R"])
    dw = dist.shard_tensor(w, MESH, ["R", "S(1)"])

    def fn(w, x):
        return jax.lax.scan(lambda c, r: (c, jnp.tanh(jnp.tanh(r @ w).sum())), 0.0, x,
                            unroll=2)[1]
    f, ys = run_checked(fn, dw, dx)
    np.testing.assert_allclose(ys.numpy(), fn(w, x), rtol=1e-5, atol=1e-5)
    scan = next(ep for ep in f.plan(dw, dx).eqns if ep.primitive == "scan")
    assert scan.required[-1].dims[0] == ("dp",)  # 8 rows per device, unrolled by 2
    inside = [c for c in f.plan(dw, dx).collectives if "inside scan" in c.reason]
    assert len(inside) == 2, [c.reason for c in inside]


def _llama_scan_loss(p, ids, labels, cos, sin):
    """A Llama-style step: stacked blocks (RMSNorm, RoPE, grouped-query attention, SwiGLU) run
    by lax.scan, a tied embedding head, optax-style integer-label cross-entropy."""
    def rms(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * w

    def rope(x):
        x1, x2 = jnp.split(x, 2, axis=-1)
        return (x * cos[None, :, None, :]
                + jnp.concatenate([-x2, x1], -1) * sin[None, :, None, :])

    def block(x, b):
        B, T, D = x.shape
        h = rms(x, b["n1"])
        q = rope((h @ b["wq"]).reshape(B, T, 8, 4))
        k = jnp.repeat(rope((h @ b["wk"]).reshape(B, T, 4, 4)), 2, axis=2)
        v = jnp.repeat((h @ b["wv"]).reshape(B, T, 4, 4), 2, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.float32(2.0)
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool))[None, None], s,
                      jnp.finfo(s.dtype).min)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(B, T, 32)
        x = x + o @ b["wo"]
        h = rms(x, b["n2"])
        return x + (jax.nn.silu(h @ b["w1"]) * (h @ b["w3"])) @ b["w2"], None

    x, _ = jax.lax.scan(block, p["embed"][ids], p["blocks"])
    logits = rms(x, p["norm"]) @ p["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_a_scanned_llama_steps_plan_lists_every_collective_of_the_loop_body():
    """Collectives planned inside a loop body name the body's own values, whose names can be a
    top-level value's too: a top-level reduction moved by commute.py dropped the body's psum of
    a same-named cotangent from the plan (20 all-reduces planned, 21 compiled)."""
    rng = np.random.default_rng(0)
    n = lambda *s: (rng.normal(size=s) * 0.1).astype(np.float32)  # noqa: E731
    L = 1
    blocks = dict(n1=1 + n(L, 32), wq=n(L, 32, 32), wk=n(L, 32, 16), wv=n(L, 32, 16),
                  wo=n(L, 32, 32), n2=1 + n(L, 32), w1=n(L, 32, 48), w3=n(L, 32, 48),
                  w2=n(L, 48, 32))
    p = dict(embed=n(64, 32), norm=1 + n(32), blocks=blocks)
    ids = rng.integers(0, 64, (8, 16)).astype(np.int32)
    labels = rng.integers(0, 64, (8, 16)).astype(np.int32)
    inv = 1.0 / 10000.0 ** (np.arange(0, 4, 2, dtype=np.float32) / 4)
    angles = np.concatenate([np.outer(np.arange(16.0), inv)] * 2, -1)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    R, S = dist.Replicate(), dist.Shard

    def place(path, x):
        name = jax.tree_util.keystr(path)
        split = ([R, S(2)] if any(f"'{k}'" in name for k in ("wq", "wk", "wv", "w1", "w3"))
                 else [R, S(1)] if any(f"'{k}'" in name for k in ("wo", "w2"))
                 else [R, S(0)] if "embed" in name else [R, R])
        return dist.shard_tensor(x, MESH, split)

    args = (jax.tree_util.tree_map_with_path(place, p), dist.shard_tensor(ids, MESH, [S(0), R]),
            dist.shard_tensor(labels, MESH, [S(0), R]), cos, sin)
    f = dist.jit(jax.value_and_grad(_llama_scan_loss))
    value, grads = f(*args)
    want, want_grads = jax.jit(jax.value_and_grad(_llama_scan_loss))(p, ids, labels, cos, sin)
    np.testing.assert_allclose(value.numpy(), want, rtol=1e-5)
    for got, ref in zip(jax.tree.leaves(grads, is_leaf=lambda x: isinstance(x, dist.DistTensor)),
                        jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-4, atol=1e-6)
    assert f.plan(*args).collective_counts() == count_collectives(
        f.lower(*args).compile().as_text())


def _per_example_loops(x):
    """Loops jax.vmap leaves with a batched predicate: a convergence test per row, a fori_loop
    with a per-row bound, and a data-dependent trip count over a pair carry."""
    doubled = jax.vmap(lambda r: jax.lax.while_loop(lambda c: c.sum() < 40.0, lambda c: c * 2.0,
                                                    r))(x)
    bound = jax.vmap(lambda r: jax.lax.fori_loop(0, (r[0] % 4).astype(jnp.int32) + 1,
                                                 lambda i, c: c + jnp.cos(c) * i, r))(x)
    steps = jax.vmap(lambda r: jax.lax.while_loop(
        lambda c: c[0] < r[1], lambda c: (c[0] + 1.0, c[1] + c[1][::-1]), (0.0, r))[1])(x)
    return doubled, bound, steps


@pytest.mark.parametrize("mesh, placements", [
    (dist.ProcessMesh(list(range(8)), ["x"]), ["S(0)"]),
    (dist.ProcessMesh(list(range(8)), ["x"]), ["R"]),
    (MESH, ["S(0)", "S(1)"]),
    (MESH, ["R", "S(0)"]),
])
def test_vmapped_loops_with_per_example_conditions_equal_one_device(mesh, placements):
    """jax.vmap of a while_loop / fori_loop whose condition depends on the row keeps the
    predicate batched (bool[B]): planning read it as a scalar (a KeyError deep in the planner).
    Rewritten as the loop jax lowers it to (run while any row continues, finished rows keep
    their carry): one device's values, every device running the same trip count."""
    x = (np.arange(8 * 4, dtype=np.float32).reshape(8, 4) % 7) + 1.0
    g = dist.jit(_per_example_loops)
    xd = dist.shard_tensor(x, mesh, placements)
    for got, want in zip(g(xd), jax.jit(_per_example_loops)(x)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    assert g.plan(xd).collective_counts() == count_collectives(g.lower(xd).compile().as_text())


@pytest.mark.parametrize("step", [0, 7])
@pytest.mark.parametrize("form", ["cond", "switch"])
def test_a_branch_picked_by_a_constant_is_the_only_one_planned(step, form):
    """A cond whose index the program computes from constants (a schedule on a constant step
    count, as optax.novograd's first update writes): XLA keeps only the branch it picks, and so
    does the plan (both branches' all-reduces were listed)."""
    w = np.random.default_rng(0).normal(size=(32, 64)).astype(np.float32)

    def fn(w):
        count = jnp.int32(step)
        norm = lambda a: jnp.sqrt(jnp.sum(a * a))
        absum = lambda a: jnp.sum(jnp.abs(a)) ** 2
        if form == "cond":
            return jax.lax.cond(count < 5, norm, absum, w)
        return jax.lax.switch(count // 4, [norm, absum, lambda a: jnp.max(a)], w)

    ws = dist.shard_tensor(w, MESH, [dist.Shard(0), dist.Shard(1)])
    f = dist.jit(fn)
    np.testing.assert_allclose(f(ws).numpy(), jax.jit(fn)(w), rtol=1e-5)
    plan = f.plan(ws)
    assert not any(ep.sub_plans for ep in plan.eqns)  # no branch left to choose at run time
    hlo = count_collectives(f.lower(ws).compile().as_text())
    assert hlo == Counter(c.kind for c in plan.collectives), plan.collectives


CUBE = dist.ProcessMesh(np.arange(8).reshape(2, 2, 2), ["a", "b", "c"])
_switch = lambda i, x: jax.lax.switch(i[0, 0] % 3, [lambda a: a, lambda a: a * 2.0,
                                                    lambda a: -a], x)
_cond = lambda p, x: jax.lax.cond(p[0, 0], lambda a: a * 2.0, lambda a: a - 1.0, x)


@pytest.mark.parametrize("form,batched,mesh,p_at,x_at", [
    ("cond", "out_axes=-1", MESH, ["S(2)", "S(0)"], ["R", "S(1)"]),
    ("cond", "out_axes=-1", CUBE, ["R", "S(0)", "S(0)"], ["R", "S(0)", "S(1)"]),
    ("switch", "twice", CUBE, ["S(1)", "S(0)", "R"], ["S(1)", "S(3)", "S(1)"]),
    ("switch", "out_axes=-1", CUBE, ["S(1)", "S(2)", "S(0)"], ["S(0)", "S(0)", "S(0)"])])
def test_a_vmapped_branch_predicate_moves_before_it_is_broadcast(form, batched, mesh, p_at,
                                                                  x_at):
    """jax.vmap makes a cond or switch with a per-example index a select of the branches'
    results, reading the index broadcast to the data's shape once per branch. Where the data
    lies elsewhere than the index, the small index moves once, before its broadcasts — as
    XLA's simplifier moves it (each broadcast copy was listed as a move of its own: up to 4
    collectives planned where the compiled program runs 1)."""
    fn = _cond if form == "cond" else _switch
    fn = jax.vmap(jax.vmap(fn)) if batched == "twice" else jax.vmap(fn, out_axes=-1)
    shape = (2, 4, 4, 8) if batched == "twice" else (8, 4, 8)
    rng = np.random.default_rng(0)
    p = rng.random(shape) > 0.5 if form == "cond" else rng.integers(0, 5, shape, np.int32)
    x = rng.normal(size=shape).astype(np.float32)
    pd, xd = make_tensor(p, mesh, p_at), make_tensor(x, mesh, x_at)
    f, out = run_checked(fn, pd, xd)  # the plan's collectives are the compiled program's
    np.testing.assert_array_equal(out.numpy(), jax.jit(fn)(p, x))
    plan = f.plan(pd, xd)
    moves = [c for c in plan.collectives if not c.by_rule]
    assert len(moves) <= 2, str(plan)  # the index, and the data if it must move
    assert sum(c.bytes_per_device for c in moves if c.value != "b") <= p.size, str(plan)


@pytest.mark.parametrize("n,unroll", [(5, 16), (5, 3), (5, 2), (4, 2), (5, 1)],
                         ids=["whole", "loop-then-two", "loop-then-one", "loop-only", "rolled"])
def test_an_unrolled_scans_unread_final_carry_is_not_moved(n, unroll):
    """The gradient of jnp.polyval runs a reverse scan whose second carry's final value nobody
    reads. Where jax's lowering runs the scan's last iteration after its loop (an unroll that
    leaves iterations over, or covers them all), XLA drops that copy's sum of the carry; the
    plan lists one sum fewer there too (it listed one per copy: 10 planned / 9 compiled)."""
    mesh = dist.ProcessMesh(np.arange(8).reshape(2, 2, 2), ["a", "b", "c"])
    x = np.random.default_rng(0).normal(size=(8, 16, 32)).astype(np.float32)
    fn = jax.grad(lambda x: jnp.sum(jnp.polyval(x[0, 0, :n], x[1], unroll=unroll) ** 2))
    xd = dist.shard_tensor(x, mesh, [dist.Shard(0), dist.Shard(0), dist.Replicate()])
    f, out = run_checked(fn, xd)  # the plan's collectives are the compiled program's
    np.testing.assert_allclose(out.numpy(), jax.jit(fn)(x), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("placements", [["S(1)", "P(max)"], ["P(max)", "S(1)"], ["P(sum)", "S(0)"]])
def test_a_platform_dependent_cond_lists_the_branch_of_the_platform_compiled_for(placements):
    """lax.platform_dependent is a cond on `platform_index`, which jax lowers to the constant
    of the platform it compiles for: XLA keeps that branch alone. The plan plans both (the
    program holds both) but lists the collectives of that one (it listed both: 2 / 1)."""
    mesh = dist.ProcessMesh(np.arange(8).reshape(4, 2), ["a", "b"])
    x = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)

    def fn(x):
        return jax.lax.platform_dependent(x, cpu=lambda a: a * 2.0, default=lambda a: a + 1.0)

    f, out = run_checked(fn, make_tensor(x, mesh, placements))  # (a sum's parts: rounding)
    np.testing.assert_allclose(out.numpy(), jax.jit(fn)(x), rtol=1e-5, atol=1e-6)
    assert any(ep.sub_plans for ep in f.plan(make_tensor(x, mesh, placements)).eqns)


def test_a_checkpoints_partial_operand_is_reduced_once_with_the_forward():
    """The recomputation of a differentiated jax.checkpoint reads a Partial operand outside
    its barrier: its reduction of it and the forward's are one, which XLA's CSE runs once —
    listed once (3 all-reduces planned / 2 compiled before)."""
    mesh = dist.ProcessMesh(np.arange(8).reshape(2, 2, 2), ["a", "b", "c"])
    x = np.random.default_rng(0).normal(size=(8, 4, 8)).astype(np.float32)
    inner = jax.vmap(lambda x: jax.checkpoint(lambda y: jnp.sin(y).sum(1))(x))
    fn = jax.value_and_grad(lambda x: jnp.sum(inner(x)))
    xd = make_tensor(x, mesh, ["P(min)", "S(0)", "P(min)"])
    f, (value, grad) = run_checked(fn, xd)
    want = jax.jit(fn)(x)
    np.testing.assert_allclose(value.numpy(), want[0], rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), want[1], rtol=1e-5, atol=1e-6)


def test_a_loop_body_is_built_once_however_often_its_fixpoint_plans_it(monkeypatch):
    # the body is planned once per carry layout until the carries settle (and again for its
    # accumulators, its outputs): the same program each time, built from the body's jaxpr once,
    # its equations' rule facts made once
    from autoshard.compiler import control_flow, plan as plan_module, propagate

    rng = np.random.default_rng(0)
    w = rng.normal(size=(4, 4)).astype(np.float32)
    xs = rng.normal(size=(3, 8, 4)).astype(np.float32)
    dw, dxs = dist.shard_tensor(w, MESH, ["R", "S(1)"]), dist.shard_tensor(xs, MESH, ["R", "R"])
    bodies, planned = [], Counter()
    build, make = control_flow.build_program, plan_module.make_plan

    def counting_build(closed, *a, **k):
        bodies.append(build(closed, *a, **k))
        return bodies[-1]

    def counting_make(program, *a, **k):
        planned[id(program)] += 1
        return make(program, *a, **k)

    facts_made, facts = [], propagate.EqnFacts

    def counting_facts(*lists):
        facts_made.append(id(sys._getframe(1).f_locals["program"]))  # eqn_facts's program
        return facts(*lists)

    monkeypatch.setattr(control_flow, "build_program", counting_build)
    monkeypatch.setattr(plan_module, "make_plan", counting_make)
    monkeypatch.setattr(propagate, "EqnFacts", counting_facts)
    f, (loss, grad) = run_checked(jax.value_and_grad(_scan_loss), dw, dxs)
    body_plans = sum(planned[id(b)] for b in bodies)
    # the forward and backward bodies, each planned several times, each built once per plan
    # of the step (its fixpoint's plans read one program)
    assert bodies and body_plans >= 2 * len(bodies), (body_plans, len(bodies))
    made = Counter(facts_made)
    assert [made[id(b)] for b in bodies] == [1] * len(bodies), (made, planned)
    ref_loss, ref_grad = jax.value_and_grad(_scan_loss)(w, xs)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grad.numpy(), ref_grad, rtol=1e-4, atol=1e-5)
