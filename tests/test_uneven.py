"""Uneven sharding: a dim its mesh axes do not divide is stored padded (ceil-sized blocks, the
padding zeros), computed whole inside programs, and always equals one device."""
from __future__ import annotations

import tempfile
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard as dist
from autoshard.hlo import count_collectives
from autoshard.testing import logical_value, make_tensor, mse_step
from autoshard.uneven import uneven_dims

MESH24 = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
MESH4 = dist.ProcessMesh([0, 1, 2, 3], ["x"])
RNG = np.random.default_rng(0)
X = RNG.normal(size=(10, 6)).astype(np.float32)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dist.UnevenShardingWarning)
        yield


def _blocks_agree(d: dist.DistTensor, value: np.ndarray, tol: float = 1e-5) -> None:
    """Every device's owned rows are the value's, and its stored padding is zeros."""
    for device in d.mesh.process_ids:
        bounds = d.block_bounds(device)
        owned = value[tuple(slice(lo, hi) for lo, hi in bounds)]
        if not d.layout.partial:
            np.testing.assert_allclose(np.asarray(d.local(device)), owned, rtol=tol, atol=tol)
        stored = np.asarray(next(s.data for s in d.physical.addressable_shards
                                 if s.device.id == device))
        assert stored.shape[-value.ndim:] == d.local_shape
        if not d.layout.partial:
            pad = stored.copy()
            pad[tuple(slice(0, hi - lo) for lo, hi in bounds)] = 0
            assert not pad.any(), "the padding must be zeros"


UNEVEN = [["R", "S(0)"], ["S(0)", "S(0)"], ["S(1)", "S(0)"], ["S(0)", "S(1)"],
          ["P(sum)", "S(0)"], ["S(1)", "P(max)"], ["S(0)", "R"]]


@pytest.mark.parametrize("placements", UNEVEN, ids=str)
def test_shard_tensor_stores_uneven_dims_padded(placements):
    d = dist.shard_tensor(X, MESH24, placements)
    sizes = MESH24.axis_sizes
    for dim, axes in enumerate(d.layout.dims):
        n = int(np.prod([sizes[a] for a in axes]))
        assert d.local_shape[dim] == -(-X.shape[dim] // n)  # ceil-sized blocks
    np.testing.assert_array_equal(d.numpy(), X)
    np.testing.assert_array_equal(logical_value(d), X)
    _blocks_agree(d, X)


@pytest.mark.parametrize("src", UNEVEN, ids=str)
@pytest.mark.parametrize("dst", [["R", "R"], ["S(1)", "S(0)"], ["S(0)", "S(1)"], ["P(sum)", "S(0)"]],
                         ids=str)
def test_reshard_to_and_from_uneven_placements(src, dst):
    d = dist.reshard(dist.shard_tensor(X, MESH24, src), MESH24, dst)
    assert d.placements == dist.shard_tensor(X, MESH24, dst).placements
    np.testing.assert_allclose(logical_value(d), X, rtol=1e-6)
    _blocks_agree(d, X)


def test_reshard_across_meshes_keeps_the_value():
    d = dist.shard_tensor(X, MESH24, ["S(1)", "S(0)"])
    e = dist.reshard(d, MESH4, ["S(1)"])  # 6 over 4: uneven on the other mesh too
    np.testing.assert_array_equal(e.numpy(), X)
    _blocks_agree(e, X)


def _matmul_program():
    return lambda a, b: jnp.tanh(a @ b).sum(axis=1)


@pytest.mark.parametrize("a_pl,b_pl,out_pl", [
    (["S(0)", "R"], ["R", "S(0)"], None),           # b: 6 rows over mp (4)
    (["S(0)", "S(1)"], ["R", "S(1)"], [["R", "S(0)"]]),  # a: 6 cols over mp; out 10 over mp
    (["S(0)", "S(0)"], ["R", "R"], [["S(0)", "S(0)"]]),  # 10 rows over dp × mp (8)
], ids=["uneven-weight", "uneven-contraction-and-output", "uneven-co-sharded"])
def test_dist_jit_on_uneven_inputs_and_outputs_equals_one_device(a_pl, b_pl, out_pl):
    w = RNG.normal(size=(6, 5)).astype(np.float32)
    a, b = dist.shard_tensor(X, MESH24, a_pl), dist.shard_tensor(w, MESH24, b_pl)
    fn = _matmul_program()
    f = dist.jit(fn, out_placements=out_pl)
    out = f(a, b)
    np.testing.assert_allclose(out.numpy(), fn(X, w), rtol=1e-5, atol=1e-5)
    if out_pl:
        assert out.placements == dist.shard_tensor(fn(X, w), MESH24, out_pl[0]).placements
        _blocks_agree(out, np.asarray(fn(X, w)))
    # the entry gathers are planned collectives, and the HLO has exactly the planned ones
    plan = f.plan(a, b)
    entry = [c for c in plan.collectives if c.consumer == "entry"]
    assert entry and all(c.kind == "all-gather" and c.bytes_per_device > 0 for c in entry)
    assert count_collectives(f.lower(a, b).compile().as_text()) == Counter(
        c.kind for c in plan.collectives)
    # gradients, through dist.jit and from outside it
    grads = jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2), argnums=(0, 1))(a, b)
    want = jax.grad(lambda a, b: jnp.sum(fn(a, b) ** 2), argnums=(0, 1))(X, w)
    for g, v in zip(grads, want):
        np.testing.assert_allclose(np.asarray(g.numpy()), v, rtol=1e-4, atol=1e-4)


def test_entry_gathers_name_the_users_line_that_ran_the_program():
    # an input stored unevenly is gathered at entry by no equation of the user's: the plan
    # names the call that ran the program (was "(program entry)", no line of the user's)
    import inspect

    a = dist.shard_tensor(X, MESH24, ["S(0)", "S(1)"])  # 6 columns over mp (4)
    f = dist.jit(lambda a: jnp.sum(a, axis=1))
    here, plan = inspect.currentframe().f_lineno, f.plan(a)
    entry = [c for c in plan.collectives if c.consumer == "entry"]
    assert entry and {c.source for c in entry} == {f"test_uneven.py:{here}"}, str(plan)
    assert f"at test_uneven.py:{here}: <lambda>: argument 0 is stored" in str(plan)


def test_the_warning_names_the_input_the_dim_the_axis_and_the_padding():
    b = dist.shard_tensor(RNG.normal(size=(6, 5)).astype(np.float32), MESH24, ["R", "S(0)"])
    a = dist.shard_tensor(X, MESH24, ["S(0)", "R"])
    with pytest.warns(dist.UnevenShardingWarning,
                      match=r"argument 1 \(shape \(6, 5\)\): dim 0 of size 6 does not split evenly "
                            r"over mesh dim 'mp' \(4\).*pad dim 0 to 8"):
        dist.jit(lambda a, b: a @ b)(a, b)


def test_an_uneven_input_nothing_reads_is_not_gathered():
    """An unused argument stored unevenly is neither gathered at entry nor warned about (XLA
    drops the gather: listed, it would be a collective the program never runs)."""
    b = dist.shard_tensor(RNG.normal(size=(6, 5)).astype(np.float32), MESH24, ["R", "S(0)"])
    a = dist.shard_tensor(X, MESH24, ["S(0)", "R"])
    f = dist.jit(lambda a, b, c: (a * 2.0, c + 1.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", dist.UnevenShardingWarning)
        out = f(a, b, b)  # the same tensor read (c) and not read (b): gathered once, for c
        plan = f.plan(a, b, b)
    assert {str(w.message).split(" (shape")[0] for w in caught} == {
        "autoshard: <lambda>: argument 2"}
    assert [c.value for c in plan.collectives] == [repr(plan.program.inputs[2])]
    np.testing.assert_allclose(out[0].numpy(), X * 2.0)
    np.testing.assert_allclose(out[1].numpy(), b.numpy() + 1.0)
    assert Counter(c.kind for c in plan.collectives) == count_collectives(
        f.lower(a, b, b).compile().as_text())
    unused = dist.jit(lambda a, b: a * 2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.UnevenShardingWarning)
        np.testing.assert_allclose(unused(a, b).numpy(), X * 2.0)
    assert not unused.plan(a, b).collectives
    assert not count_collectives(unused.lower(a, b).compile().as_text())


@pytest.mark.parametrize("fn,out_placements,name,dim", [
    (lambda a: jnp.sin(a), [["R", "S(0)"]], "its output", 0),  # 10 rows over mp (4)
    (lambda a: (jnp.sin(a), {"w": a * 2.0}), [None, {"w": ["R", "S(1)"]}], "output[1]['w']", 1),
], ids=["one-output", "a-pytree-leaf"])
def test_an_uneven_out_placement_warns_once_naming_the_output_and_the_dim(
        fn, out_placements, name, dim):
    # as shard_tensor warns of a split its devices do not divide, so does a program asked for
    # one (it said nothing); the dim is computed whole, each device keeping its block
    a = dist.shard_tensor(X, MESH24, ["S(0)", "R"])  # even: no input warns
    f = dist.jit(fn, out_placements=out_placements)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = f(a)
        again = f(a)  # the compiled program: no second warning
    uneven = [w for w in caught if w.category is dist.UnevenShardingWarning]
    assert len(uneven) == 1 and uneven[0].filename == __file__, [str(w.message) for w in caught]
    text, size = str(uneven[0].message), X.shape[dim]
    assert f"<lambda>: {name} placed " in text, text
    assert f"dim {dim} of size {size} does not split evenly over mesh dim 'mp' (4)" in text, text
    assert f"pad dim {dim} to {-(-size // 4) * 4}" in text, text
    got = jax.tree.leaves(again, is_leaf=lambda x: isinstance(x, dist.DistTensor))
    want = jax.tree.leaves(fn(X))
    for g, v in zip(got, want):
        np.testing.assert_allclose(g.numpy(), v, rtol=1e-6)
    _blocks_agree(got[-1], np.asarray(want[-1]))

def test_uneven_hint_inside_dist_jit_computes_the_dim_whole():
    a = dist.shard_tensor(X, MESH24, ["S(0)", "R"])

    def fn(x):
        y = dist.reshard(jnp.sin(x), MESH24, ["R", "S(1)"])  # 6 cols over mp (4)
        return y * 2.0

    f = dist.jit(fn)
    with pytest.warns(dist.UnevenShardingWarning, match="computed with that dim whole"):
        out = f(a)
    np.testing.assert_allclose(out.numpy(), np.sin(X) * 2.0, rtol=1e-6)


def test_eager_operators_on_uneven_tensors():
    a = dist.shard_tensor(X, MESH24, ["R", "S(0)"])
    b = dist.shard_tensor(X, MESH24, ["S(1)", "S(0)"])
    np.testing.assert_allclose((a * b + 1.0).numpy(), X * X + 1.0, rtol=1e-6)
    np.testing.assert_allclose(a.sum(axis=0).numpy(), X.sum(0), rtol=1e-5)
    np.testing.assert_allclose((a @ b.T).numpy(), X @ X.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a[3:7].numpy(), X[3:7])


def _assert_trained_like_one_device(m, losses, apply, tx, weights, batches):
    """`m`'s losses and final params are those of mse_step under jax.jit from `weights`."""
    params = jax.tree.map(jnp.asarray, weights)
    state, step = tx.init(params), jax.jit(mse_step(apply, tx))
    for (x, y), got in zip(batches, losses):
        params, state, want = step(params, state, x, y)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for k, v in params.items():
        np.testing.assert_allclose(m.params[k].numpy(), v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stage,tx", [(0, optax.sgd(0.1)), (1, optax.adamw(1e-2)),
                                      (3, optax.sgd(0.1))], ids=["tp", "zero1", "zero3"])
def test_training_with_a_hidden_size_the_mesh_does_not_divide(stage, tx):
    # hidden 30 over mp (4): every TP parameter is stored unevenly
    rng = np.random.default_rng(1)
    weights = {"w0": (rng.normal(size=(16, 30)) * 0.2).astype(np.float32),
               "b0": np.zeros((30,), np.float32),
               "w1": (rng.normal(size=(30, 8)) * 0.2).astype(np.float32)}
    placements = {"w0": ["R", "S(1)"], "b0": ["R", "S(0)"], "w1": ["R", "S(0)"]}
    apply = lambda p, x: jax.nn.relu(x @ p["w0"] + p["b0"]) @ p["w1"]  # noqa: E731
    loss = lambda out, y: jnp.mean((out - y) ** 2)  # noqa: E731  (mse_step's loss)
    batches = [(rng.normal(size=(8, 16)).astype(np.float32),
                rng.normal(size=(8, 8)).astype(np.float32)) for _ in range(4)]
    model = (apply, {k: dist.shard_tensor(v, MESH24, placements[k]) for k, v in weights.items()})
    strategy = dist.Strategy({"sharding": {"enable": stage > 0, "stage": max(stage, 1)}})
    m = dist.to_static(model, None, loss, tx, strategy)
    losses = [float(m(x, y).numpy()) for x, y in batches]
    _assert_trained_like_one_device(m, losses, apply, tx, weights, batches)
    f = m.programs()["train"]
    args = m.program_args("train", *batches[0])
    assert count_collectives(f.lower(*args).compile().as_text()) == Counter(
        c.kind for c in f.plan(*args).collectives)


def test_checkpoint_round_trip_between_uneven_and_even_layouts():
    from autoshard.training.checkpoint import load_state_dict, save_state_dict

    path = tempfile.mkdtemp() + "/ckpt"
    save_state_dict({"a": dist.shard_tensor(X, MESH24, ["S(1)", "S(0)"]),
                     "b": dist.shard_tensor(X, MESH24, ["P(sum)", "S(0)"])}, path)
    target = {"a": dist.shard_tensor(np.zeros_like(X), MESH24, ["S(0)", "S(1)"]),
              "b": dist.shard_tensor(np.zeros_like(X), MESH24, ["R", "S(0)"])}
    got = load_state_dict(target, path)
    for key in ("a", "b"):
        assert got[key].placements == target[key].placements
        np.testing.assert_allclose(got[key].numpy(), X, rtol=1e-6)
        _blocks_agree(got[key], X)


# -- random shapes, placements and programs ------------------------------------------------------

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

MESHES = [MESH24, MESH4, dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["a", "b", "c"])]
PROGRAMS = {
    "tanh_matmul": lambda a, b: jnp.tanh(a) @ b,
    "softmax_rows": lambda a, b: jax.nn.softmax(a, axis=1) @ b,
    "center_cols": lambda a, b: (a - a.mean(axis=0, keepdims=True)) @ (b * 2.0),
    "max_then_sum": lambda a, b: (jnp.max(a, axis=1, keepdims=True) - a) @ jnp.cumsum(b, axis=0),
}


@st.composite
def _placements(draw, mesh, ndim):
    choices = ["R", "P(sum)"] + [f"S({d})" for d in range(ndim)]
    return [draw(st.sampled_from(choices)) for _ in range(mesh.ndim)]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_uneven_shapes_and_placements_equal_one_device(data):
    mesh = data.draw(st.sampled_from(MESHES))
    m, k, n = (data.draw(st.integers(1, 11)) for _ in range(3))
    name = data.draw(st.sampled_from(sorted(PROGRAMS)))
    fn = PROGRAMS[name]
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    a, b = rng.normal(size=(m, k)).astype(np.float32), rng.normal(size=(k, n)).astype(np.float32)
    da = make_tensor(a, mesh, data.draw(_placements(mesh, 2)), seed=1)
    db = make_tensor(b, mesh, data.draw(_placements(mesh, 2)), seed=2)
    out_pl = data.draw(_placements(mesh, 2))
    f = dist.jit(fn, out_placements=[out_pl])
    out = f(da, db)
    want = np.asarray(fn(a, b))
    np.testing.assert_allclose(logical_value(out), want, rtol=2e-4, atol=2e-4)
    if "P(sum)" not in out_pl:
        _blocks_agree(out, want, tol=2e-4)
    plan = f.plan(da, db)
    assert count_collectives(f.lower(da, db).compile().as_text()) == Counter(
        c.kind for c in plan.collectives)
    grads = jax.grad(lambda x, y: jnp.sum(fn(x, y) ** 2), argnums=(0, 1))
    got = dist.jit(grads)(da, db)
    for g, v in zip(got, grads(a, b)):
        np.testing.assert_allclose(g.numpy(), v, rtol=5e-4, atol=5e-4)


def test_to_static_over_a_loader_whose_last_batch_is_short():
    rng = np.random.default_rng(1)
    batches = [(rng.normal(size=(b, 16)).astype(np.float32),
                rng.normal(size=(b, 8)).astype(np.float32)) for b in (8, 8, 5)]
    weights = {"w0": (rng.normal(size=(16, 32)) * 0.2).astype(np.float32),
               "w1": (rng.normal(size=(32, 8)) * 0.2).astype(np.float32)}
    placements = {"w0": ["R", "S(1)"], "w1": ["R", "S(0)"]}
    apply = lambda p, x: jax.nn.relu(x @ p["w0"]) @ p["w1"]  # noqa: E731
    tx = optax.adamw(1e-2)
    model = (apply, {k: dist.shard_tensor(v, MESH24, placements[k]) for k, v in weights.items()})
    loader = dist.shard_dataloader(batches, MESH24, shard_dims="dp")
    m = dist.to_static(model, loader, lambda out, y: jnp.mean((out - y) ** 2), tx)
    losses = [float(m(x, y).numpy()) for x, y in loader]
    _assert_trained_like_one_device(m, losses, apply, tx, weights, batches)


def test_eager_operators_warn_once_per_tensor_layout_at_the_users_line():
    a = dist.shard_tensor(np.ones((7, 3), np.float32), MESH24, ["R", "S(0)"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b = a * 2.0
        c = (a + b).sum(axis=0)
    uneven = [w for w in caught if w.category is dist.UnevenShardingWarning]
    assert len(uneven) == 1 and uneven[0].filename == __file__, uneven
    assert "a DistTensor stored as [R, S(0)]" in str(uneven[0].message)
    np.testing.assert_allclose(c.numpy(), np.full(3, 21.0))


def test_a_closed_over_uneven_partial_tensor_enters_as_its_global_value():
    b = dist.reshard(dist.shard_tensor(X, MESH24, ["R", "R"]), MESH24, ["P(sum)", "S(0)"])
    x = dist.shard_tensor(np.ones((8, 6), np.float32), MESH24, ["R", "R"])
    got = dist.jit(lambda x: x.sum() + b.sum())(x)  # b.sum(): an eager operator, traced
    np.testing.assert_allclose(got.numpy(), 48.0 + X.sum(), rtol=1e-5)


@pytest.mark.parametrize("src,dst", [(["R", "S(0)"], ["R", "S(1)"]), (["S(0)", "S(0)"], ["R", "R"]),
                                     (["S(1)", "P(sum)"], ["S(1)", "S(0)"]),
                                     (["R", "R"], ["S(1)", "S(0)"])], ids=str)
def test_plan_reshard_lists_the_uneven_gather_and_the_hlo_has_exactly_its_collectives(src, dst):
    from autoshard.reshard.execute import compiled_hlo

    d = dist.shard_tensor(X, MESH24, src)
    plan = dist.plan_reshard(d, MESH24, dst)
    assert plan.src == d.layout  # the stored layout, uneven dims included
    gathers = [s for s in plan.steps if s.step.kind == "gather_uneven"]
    assert len(gathers) == len(uneven_dims(d.layout, MESH24, X.shape))
    assert all(s.bytes_per_device > 0 for s in gathers) and plan.total_bytes >= sum(
        s.bytes_per_device for s in gathers)
    compiled = Counter()
    for text in compiled_hlo(plan, d.physical):
        compiled += count_collectives(text)
    assert compiled == Counter(plan.collectives)
    out = dist.reshard(d, MESH24, dst)
    np.testing.assert_allclose(out.numpy(), X, rtol=1e-6)
    _blocks_agree(out, X)
