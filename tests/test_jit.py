"""dist.jit: partitioned programs equal one device, and compile to exactly the planned collectives."""
from __future__ import annotations

import copy
import functools
import pickle
import re
from typing import Any
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import autoshard as dist
from autoshard.hlo import count_collectives

MESH4 = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
MESH24 = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])


def hlo_counts(f, *args) -> Counter:
    return count_collectives(f.lower(*args).compile().as_text())


def planned(f, *args) -> Counter:
    return Counter(c.kind for c in f.plan(*args).collectives)


def assert_tree_close(a, b, rtol=1e-6, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# -- seed 002 §3: C = A @ B with A replicated and B split by rows, then relu --------------------

def test_seed_matmul_relu_partial_then_reduced():
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    A = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    B = np.array([[5.0, 6.0], [7.0, 8.0]], np.float32)
    a = dist.shard_tensor(A, mesh, [dist.Replicate()])
    b = dist.shard_tensor(B, mesh, [dist.Shard(0)])
    f = dist.jit(lambda a, b: jax.nn.relu(a @ b))
    np.testing.assert_array_equal(f(a, b).numpy(), np.maximum(A @ B, 0))
    plan = f.plan(a, b)
    dot = plan.eqns[0]
    assert dot.primitive == "dot_general" and repr(dot.results[0].placements(mesh)) == "[P(sum)]"
    assert [repr(L.placements(mesh)) for L in dot.required] == ["[S(1)]", "[S(0)]"]  # A is split
    (c,) = plan.collectives  # the partial is reduced once, before the nonlinear relu
    assert c.kind in ("all-reduce", "reduce-scatter") and "test_jit.py" in c.source
    assert hlo_counts(f, a, b) == planned(f, a, b)
    text = str(f.explain(a, b))
    assert "P(sum)" in text and "dot_general" in text and "test_jit.py:" in text


# -- seed 002 §4.1 data parallel and §4.2 tensor parallel MLPs with optax -----------------------

def _mlp_data(seed=0, d_in=16, d_hidden=32, d_out=8, batch=8):
    rng = np.random.default_rng(seed)
    params = {"w0": (rng.normal(size=(d_in, d_hidden)) * 0.2).astype(np.float32),
              "w1": (rng.normal(size=(d_hidden, d_out)) * 0.2).astype(np.float32)}
    x = rng.normal(size=(batch, d_in)).astype(np.float32)
    y = rng.normal(size=(batch, d_out)).astype(np.float32)
    return params, x, y


def _loss(p, x, y):
    h = jax.nn.relu(x @ p["w0"])
    return jnp.mean((h @ p["w1"] - y) ** 2)


def _make_step(tx, hint=None):
    def step(p, s, x, y):
        if hint is not None:
            x = hint(x)
        loss, grads = jax.value_and_grad(_loss)(p, x, y)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss
    return step


@pytest.mark.parametrize("tx,rtol", [(optax.sgd(0.1), 1e-6), (optax.adamw(1e-2), 1e-4)],
                         ids=["sgd", "adamw"])
def test_data_parallel_mlp_trains_like_one_device(tx, rtol):
    params, x, y = _mlp_data()
    step = _make_step(tx, hint=lambda x: dist.shard_tensor(x, MESH4, [dist.Shard(0)]))
    f = dist.jit(step)
    dparams = {k: dist.shard_tensor(v, MESH4, [dist.Replicate()]) for k, v in params.items()}
    dstate = tx.init(params)
    ref_p, ref_s = params, tx.init(params)
    for _ in range(3):
        dparams, dstate, loss = f(dparams, dstate, x, y)
        ref_p, ref_s, ref_loss = jax.jit(step)(ref_p, ref_s, x, y)
        np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=rtol)
    assert_tree_close(dparams, ref_p, rtol=rtol, atol=rtol)
    assert all(p.placements == [dist.Replicate()] for p in jax.tree.leaves(
        dparams, is_leaf=lambda t: isinstance(t, dist.DistTensor)))
    # DP: the gradient all-reduce only — nothing gathered, nothing else moved.
    kinds = planned(f, dparams, dstate, x, y)
    assert set(kinds) == {"all-reduce"}
    assert hlo_counts(f, dparams, dstate, x, y) == kinds
    grad_bytes = sum(v.size * 4 for v in params.values())
    reduced = sum(c.bytes_per_device for c in f.plan(dparams, dstate, x, y).collectives)
    assert reduced <= 2 * grad_bytes * 3 / 4 + 16 * 4  # ring all-reduce of the gradients (+ scalars)


def test_tensor_parallel_mlp_forward_has_one_all_reduce():
    params, x, _ = _mlp_data()
    w0 = dist.shard_tensor(params["w0"], MESH4, [dist.Shard(1)])
    w1 = dist.shard_tensor(params["w1"], MESH4, [dist.Shard(0)])
    f = dist.jit(lambda x, w0, w1: jax.nn.relu(x @ w0) @ w1)
    out = f(x, w0, w1)
    np.testing.assert_allclose(out.numpy(), jax.nn.relu(x @ params["w0"]) @ params["w1"],
                               rtol=1e-5, atol=1e-6)  # summation order differs across shards
    assert planned(f, x, w0, w1) == Counter({"all-reduce": 1}) == hlo_counts(f, x, w0, w1)


def test_tensor_parallel_mlp_trains_like_one_device():
    params, x, y = _mlp_data()
    tx = optax.sgd(0.1)
    f = dist.jit(_make_step(tx))
    dparams = {"w0": dist.shard_tensor(params["w0"], MESH4, [dist.Shard(1)]),
               "w1": dist.shard_tensor(params["w1"], MESH4, [dist.Shard(0)])}
    dstate = tx.init(params)
    ref_p, ref_s = params, tx.init(params)
    for _ in range(3):
        dparams, dstate, loss = f(dparams, dstate, x, y)
        ref_p, ref_s, ref_loss = jax.jit(_make_step(tx))(ref_p, ref_s, x, y)
        np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-6)
    assert_tree_close(dparams, ref_p)
    # Megatron: the weights' gradients stay sharded; only activations are all-reduced.
    assert dparams["w0"].placements == [dist.Shard(1)] and dparams["w1"].placements == [dist.Shard(0)]
    kinds = planned(f, dparams, dstate, x, y)
    assert set(kinds) <= {"all-reduce"} and hlo_counts(f, dparams, dstate, x, y) == kinds


def test_hybrid_dp_tp_on_2x4_equals_one_device_with_gradients():
    params, x, y = _mlp_data(batch=8)
    dparams = {"w0": dist.shard_tensor(params["w0"], MESH24, [dist.Replicate(), dist.Shard(1)]),
               "w1": dist.shard_tensor(params["w1"], MESH24, [dist.Replicate(), dist.Shard(0)])}
    dx = dist.shard_tensor(x, MESH24, [dist.Shard(0), dist.Replicate()])
    f = dist.jit(jax.value_and_grad(_loss))
    loss, grads = f(dparams, dx, y)
    ref_loss, ref_grads = jax.value_and_grad(_loss)(params, x, y)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-6)
    assert_tree_close(grads, ref_grads)
    assert hlo_counts(f, dparams, dx, y) == planned(f, dparams, dx, y)


# -- annotations inside, outputs, inputs of every kind, caching ---------------------------------

def test_hints_reshard_and_out_placements():
    x = np.arange(64, dtype=np.float32).reshape(8, 8)

    def fn(a):
        a = dist.shard_tensor(a, MESH24, [dist.Shard(0), dist.Shard(1)])
        b = jnp.sin(a) * 2.0
        return dist.reshard(b, MESH24, [dist.Replicate(), dist.Shard(0)])

    f = dist.jit(fn)
    out = f(x)
    assert out.placements == [dist.Replicate(), dist.Shard(0)]
    np.testing.assert_allclose(out.numpy(), np.sin(x) * 2.0, rtol=1e-6)
    # The unplaced input is placed where the hint wants it: no collective before the sin.
    plan = f.plan(x)
    assert [repr(p) for p in plan.inputs[0].placements(MESH24)] == ["S(0)", "S(1)"]
    g = dist.jit(lambda a: a + 1.0, out_placements=[dist.Shard(1), dist.Replicate()])
    xs = dist.shard_tensor(x, MESH24, [dist.Shard(0), dist.Replicate()])
    out = g(xs)
    assert out.placements == [dist.Shard(1), dist.Replicate()]
    np.testing.assert_array_equal(out.numpy(), x + 1.0)
    assert hlo_counts(g, xs) == planned(g, xs) == Counter({"all-to-all": 1})


@pytest.mark.parametrize("form", ["assigned", "unread (seed 4.1)"])
def test_an_annotation_whose_result_is_unread_marks_its_tensor_as_paddle_does(form):
    """Paddle's static form `dist.shard_tensor(x, mesh, [Shard(0)])` with the result unused
    (seed §4.1, line for line) marks x: the step splits the batch as with `x = ...` (it was
    dead code: the whole step ran replicated, silently)."""
    rng = np.random.default_rng(0)
    mesh = dist.ProcessMesh([0, 1, 2, 3], ["x"])
    w0, w1 = rng.normal(size=(16, 32)).astype(np.float32), rng.normal(size=(32, 16)).astype(np.float32)
    x = rng.normal(size=(4, 8, 16)).astype(np.float32)

    def loss(p, x):
        if form == "assigned":
            x = dist.shard_tensor(x, mesh, [dist.Shard(0)])
        else:
            dist.shard_tensor(x, mesh, [dist.Shard(0)])
        return jnp.mean(jnp.matmul(jnp.matmul(x, p["w0"]), p["w1"]))

    params = {k: dist.shard_tensor(v, mesh, [dist.Replicate()]) for k, v in
              (("w0", w0), ("w1", w1))}
    f = dist.jit(jax.value_and_grad(loss))
    (value, grads) = f(params, x)
    want, want_grads = jax.jit(jax.value_and_grad(lambda p, x: jnp.mean(x @ p["w0"] @ p["w1"])))(
        {"w0": w0, "w1": w1}, x)
    np.testing.assert_allclose(value.numpy(), want, rtol=1e-5)
    for k in want_grads:
        np.testing.assert_allclose(grads[k].numpy(), want_grads[k], rtol=1e-4, atol=1e-5)
    assert f.plan(params, x).inputs[-1].dims[0] == ("x",)  # the batch arrives split
    assert hlo_counts(f, params, x) == planned(f, params, x) == Counter({"all-reduce": 3})


R, S = dist.Replicate(), dist.Shard

OUT_SPECS = [  # (out_placements, the placements asked of w, b, loss; None: the plan's choice)
    pytest.param([{"b": None, "w": [R, S(1)]}, None], ([R, S(1)], None, None),
                 id="prefix: dict then loss"),
    pytest.param(({"b": [R, R], "w": [R, S(1)]}, [R, R]), ([R, S(1)], [R, R], [R, R]),
                 id="prefix: tuple, every leaf"),
    pytest.param([[R, R], [S(0), S(1)], [R, R]], ([S(0), S(1)], [R, R], [R, R]),
                 id="flat: one per output leaf"),
    pytest.param([[R, R], [R, R]], ([R, R], [R, R], [R, R]),
                 id="prefix: one list for the whole dict"),
]


@pytest.mark.parametrize("spec,asked", OUT_SPECS)
def test_out_placements_as_a_pytree_prefix_of_the_result(spec, asked):
    # `return params, loss` with params a dict: out_placements written like jax.jit's
    # out_shardings (lists and tuples alike), or flat, one per leaf as before.
    w = np.arange(32, dtype=np.float32).reshape(4, 8) / 32
    params = {"w": dist.shard_tensor(w, MESH24, [R, S(1)]),
              "b": dist.shard_tensor(np.ones(8, np.float32), MESH24, [R, R])}
    x = dist.shard_tensor(np.ones((8, 4), np.float32), MESH24, [S(0), R])

    def step(p, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    new, loss = dist.jit(step, out_placements=spec)(params, x)
    ref_new, ref_loss = jax.jit(step)({k: v.numpy() for k, v in params.items()}, x.numpy())
    for got, want in zip((new["w"], new["b"], loss), asked):
        assert want is None or got.placements == want
    for k in ("w", "b"):
        np.testing.assert_allclose(new[k].numpy(), ref_new[k], rtol=1e-6)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-6)


@pytest.mark.parametrize("spec,says", [
    ([{"w": [R, S(1)]}, None], "has keys ['w'] where the result has ['b', 'w']"),
    ([None, None, None, None], "4 entries where the result has 2"),
    ([{"b": None, "w": [R, S(1)]}, None, None], "3 entries where the result has 2"),
    ([None, [[R, R], [R, R]]], "out_placements[1] is a list of 2 entries where the result is "
                               "one array: give one placements list"),
    ([{"b": None, "w": {"x": None}}, None], "out_placements[0]['w'] is a dict of 1 entries "
                                            "where the result is one array"),
    # a list of the right length whose entries are not placements: said for the entry
    ([None, [dist.Shard, R]], "out_placements[1][0] is the class dist.Shard, not a placement: "
                              "write dist.Shard(0)"),
    ([None, ["dp", None]], "out_placements[1][0] is 'dp', not a placement: out_placements name "
                           "one placement per mesh dim"),
    ([None, [R, None]], "out_placements[1][1] is None, not a placement"),
    ("kepp", "out_placements is the string 'kepp' (did you mean 'keep'?)"),
])
def test_out_placements_that_do_not_match_the_result_say_where(spec, says):
    params = {"w": np.ones((4, 8), np.float32), "b": np.ones(8, np.float32)}
    x = dist.shard_tensor(np.ones((8, 4), np.float32), MESH24, [S(0), R])
    f = dist.jit(lambda p, x: (p, jnp.sum(x)), out_placements=spec)
    with pytest.raises(dist.PlacementTypeError, match=__import__("re").escape(says)):
        f(params, x)


def test_inputs_numpy_scalars_jax_arrays_and_named_shardings():
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    named = jax.device_put(x, NamedSharding(MESH24.to_jax(), P("dp", None)))
    f = dist.jit(lambda a, b, c, s: (a * b + c) * s)
    out = f(named, jnp.asarray(x), x, 2.0)
    np.testing.assert_array_equal(out.numpy(), (x * x + x) * 2.0)
    assert f.plan(named, jnp.asarray(x), x, 2.0).inputs[0].dims[0] == ("dp",)


def test_second_call_with_same_layouts_does_not_retrace():
    calls = []

    def fn(a, b):
        calls.append(1)
        return a @ b

    f = dist.jit(fn)
    a = dist.shard_tensor(np.ones((8, 4), np.float32), MESH4, [dist.Shard(0)])
    b = dist.shard_tensor(np.ones((4, 4), np.float32), MESH4, [dist.Replicate()])
    f(a, b)
    f(a, b)
    f(dist.shard_tensor(np.zeros((8, 4), np.float32), MESH4, [dist.Shard(0)]), b)
    assert len(calls) == 1 and f.trace_count == 1
    f(dist.shard_tensor(np.ones((8, 4), np.float32), MESH4, [dist.Replicate()]), b)
    assert len(calls) == 2  # a new layout is a new program


def test_outputs_handed_back_as_the_plan_placed_them_reuse_the_program():
    """A train loop: state that entered unplaced (numpy weights, a fresh optimizer's count)
    comes back as DistTensors laid out as the program placed them on entry; the next step
    runs the same program instead of tracing and compiling a second one. Data that stays
    numpy each step still finds it."""
    tx = optax.adam(0.1)
    w = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)

    def step(w, s, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
        u, s = tx.update(g, s, w)
        return optax.apply_updates(w, u), s, loss

    f = dist.jit(step)
    x = dist.shard_tensor(np.ones((8, 4), np.float32), MESH24, [dist.Shard(0), dist.Replicate()])
    ref_w, ref_s = w, tx.init(w)
    dw, ds = w, tx.init(w)
    for i in range(3):
        y = np.full((8, 4), i, np.float32)  # fresh numpy every step: stays unplaced
        dw, ds, loss = f(dw, ds, dist.shard_tensor(y, MESH24, [dist.Shard(0), dist.Replicate()]))
        ref_w, ref_s, ref_loss = jax.jit(step)(ref_w, ref_s, y)
        np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
        assert isinstance(ds[0].count, dist.DistTensor)
    np.testing.assert_allclose(dw.numpy(), ref_w, rtol=1e-5, atol=1e-6)
    assert f.trace_count == 1
    # a layout the program did not place them in is a new program
    f(dist.reshard(dw, MESH24, [dist.Shard(0), dist.Replicate()]), ds, x)
    assert f.trace_count == 2


def test_static_argnums_and_pytrees():
    f = dist.jit(lambda d, n: {"y": d["a"] * n, "z": [d["b"].sum()]}, static_argnums=(1,))
    d = {"a": dist.shard_tensor(np.ones((8,), np.float32), MESH4, [dist.Shard(0)]),
         "b": dist.shard_tensor(np.arange(8.0, dtype=np.float32), MESH4, [dist.Shard(0)])}
    out = f(d, 3)
    np.testing.assert_array_equal(out["y"].numpy(), np.full(8, 3.0))
    np.testing.assert_array_equal(out["z"][0].numpy(), 28.0)


# -- primitives without rules, user rules -------------------------------------------------------

def test_primitive_without_rule_runs_replicated_with_one_warning():
    from jax.extend import core as jex_core

    # a primitive of the user's that no rule knows: a sliding sum down dim 0
    def window(a):
        return jax.lax.reduce_window(a, 0.0, jax.lax.add, (2, 1), (1, 1), "VALID")

    slide_p = jex_core.Primitive("my_sliding_sum")
    slide_p.def_impl(window)
    slide_p.def_abstract_eval(lambda a: jax.core.ShapedArray((a.shape[0] - 1,) + a.shape[1:], a.dtype))
    jax.interpreters.mlir.register_lowering(
        slide_p, jax.interpreters.mlir.lower_fun(window, multiple_results=False))
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    xs = dist.shard_tensor(x, MESH4, [dist.Shard(0)])
    f = dist.jit(lambda a: slide_p.bind(a * 2.0) + 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = f(xs)
    msgs = [str(w.message) for w in caught if issubclass(w.category, dist.FallbackWarning)]
    assert len(msgs) == 1 and "'my_sliding_sum'" in msgs[0] and "test_jit.py:" in msgs[0]
    np.testing.assert_array_equal(out.numpy(), np.asarray(window(x * 2.0)) + 1.0)


def test_register_rule_for_a_user_primitive():
    from jax.extend import core as jex_core

    from autoshard.compiler.factors import einsum

    double_p = jex_core.Primitive("my_double")
    double_p.def_impl(lambda x: x * 2)
    double_p.def_abstract_eval(lambda a: a)
    jax.interpreters.mlir.register_lowering(
        double_p, jax.interpreters.mlir.lower_fun(lambda x: x * 2, multiple_results=False))
    dist.register_rule(double_p, lambda ins, outs, **p: einsum("ij->ij", [ins[0].shape], [outs[0].shape]))
    xs = dist.shard_tensor(np.ones((8, 4), np.float32), MESH4, [dist.Shard(0)])
    f = dist.jit(lambda a: double_p.bind(a))
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        out = f(xs)
    assert out.placements == [dist.Shard(0)] and not f.plan(xs).collectives
    np.testing.assert_array_equal(out.numpy(), np.full((8, 4), 2.0))


def _doubling_primitive(name: str):
    from jax.extend import core as jex_core

    p = jex_core.Primitive(name)
    p.def_impl(lambda x: x * 2)
    p.def_abstract_eval(lambda a: a)
    jax.interpreters.mlir.register_lowering(
        p, jax.interpreters.mlir.lower_fun(lambda x: x * 2, multiple_results=False))
    return p


@pytest.mark.parametrize("rule, error, match", [
    (lambda ins, outs, **p: "ij->ij", dist.PlacementTypeError,
     r"the SPMD rule registered for 'my_rule_p' \(at test_jit.py:\d+\) returned 'ij->ij' of "
     r"type str: a rule returns an OpSharding"),
    (lambda ins, outs, **p: 1 // 0, dist.PlacementTypeError,
     r"registered for 'my_rule_p' \(at test_jit.py:\d+\) raised ZeroDivisionError: .*fix the "
     r"rule, or have it return None"),
    (lambda ins, outs, **p: ins[5], dist.FallbackWarning,
     r"primitive 'my_rule_p' \(at test_jit.py:\d+\): its SPMD rule does not describe it \(the "
     r"rule raised IndexError: list index out of range\); it runs replicated"),
    (lambda ins, outs, **p: None, dist.FallbackWarning,
     r"its SPMD rule does not describe it \(the rule returned None\)"),
    # an OpSharding that does not fit the equation: was an IndexError deep in the planner
    (lambda ins, outs, **p: __import__("autoshard.compiler.factors", fromlist=["einsum"]).einsum(
        "ij,ij->ij", [ins[0].shape] * 2, [outs[0].shape]), dist.PlacementTypeError,
     r"'my_rule_p' \(at test_jit.py:\d+\) returned an OpSharding that does not fit the "
     r"equation: it describes 2 operands, the equation has 1"),
    (lambda ins, outs, **p: __import__("autoshard.compiler.factors", fromlist=["einsum"]).einsum(
        "i->i", [(8,)], [(8,)]), dist.PlacementTypeError,
     r"does not fit the equation: operand 0 has 2 dims, the rule gives 1"),
])
def test_a_broken_user_rule_is_named_and_a_declining_one_says_so(rule, error, match):
    """A rule answering other than an OpSharding or None, or failing other than as rules
    decline an instance, is an error naming the primitive and its line (was an AttributeError
    deep in planning, or the rule's own exception); a rule that declines (None, or a
    TypeError / ValueError / IndexError ...) runs the primitive replicated, and the warning
    says the rule declined, with why — not that there is no rule."""
    p = _doubling_primitive("my_rule_p")
    dist.register_rule(p, rule)
    xs = dist.shard_tensor(np.ones((8, 4), np.float32), MESH4, [dist.Shard(0)])
    f = dist.jit(lambda a: p.bind(a) + 1.0)
    if issubclass(error, Warning):
        with pytest.warns(error, match=match):
            out = f(xs)
        np.testing.assert_array_equal(out.numpy(), np.full((8, 4), 3.0))
    else:
        with pytest.raises(error, match=match):
            f(xs)


@pytest.mark.parametrize("lower, match", [
    (lambda ctx, x: x * 2.0, None),  # one bare block for a primitive of one result
    (lambda ctx, x: [x * 2.0], None),
    (lambda ctx, x: [x, x], r"the `lower` hook of the rule registered for 'my_lower_p' \(at "
                            r"test_jit.py:\d+\) returned 2 result\(s\); my_lower_p has 1 "
                            r"result\(s\): return a list of 1 local block"),
    (lambda ctx, x: [x.sum(0)], r"returned result 0 as float32\[4\]; this device's block of "
                                r"it is float32\[2, 4\] \(the global float32\[8, 4\]"),
    (lambda ctx, x: [x.astype(np.int32)], r"returned result 0 as int32\[2, 4\]; this "
                                          r"device's block of it is float32\[2, 4\]"),
    (lambda ctx, x: 2.0, r"returned float; my_lower_p has 1 result"),
])
def test_a_user_rules_lower_hook_gives_the_local_blocks_or_is_named(lower, match):
    """A `lower` hook returns the local block of each result (a bare block for a primitive of
    one result is taken as it). Another count, shape or dtype is an error naming the primitive
    and the user's line (was a shard_map out_specs ValueError or a dot_general TypeError deep
    inside jax)."""
    from autoshard.compiler.factors import einsum

    p = _doubling_primitive("my_lower_p")
    dist.register_rule(p, lambda ins, outs, **k: einsum("ij->ij", [ins[0].shape], [outs[0].shape]),
                       lower)
    xs = dist.shard_tensor(np.arange(32, dtype=np.float32).reshape(8, 4), MESH4, [dist.Shard(0)])
    f = dist.jit(lambda a: p.bind(a) @ np.ones((4, 3), np.float32))
    if match is None:
        np.testing.assert_array_equal(f(xs).numpy(), (np.arange(32).reshape(8, 4) * 2.0) @ np.ones((4, 3)))
    else:
        with pytest.raises(dist.PlacementTypeError, match=match):
            f(xs)


# -- bad input --------------------------------------------------------------------------------

def _err(error, match, fn):
    with pytest.raises(error, match=match) as info:
        fn()
    assert "test_jit.py:" in str(info.value), str(info.value)


def test_errors_name_the_problem_and_the_line():
    other = dist.ProcessMesh([4, 5, 6, 7], dim_names=["x"])
    a = dist.shard_tensor(np.ones((8, 4), np.float32), MESH4, [dist.Shard(0)])
    b = dist.shard_tensor(np.ones((8, 4), np.float32), other, [dist.Shard(0)])
    _err(dist.MeshMismatchError, "different meshes|is on|meet in `add`", lambda: dist.jit(lambda a, b: a + b)(a, b))
    # an annotation on another mesh moves the value there: a second stage (test_cut.py)
    moved = dist.jit(lambda a: dist.shard_tensor(a, other, [dist.Replicate()]) * 2)(a)
    assert (moved.mesh, moved.placements) == (other, [dist.Replicate()])
    np.testing.assert_array_equal(moved.numpy(), np.full((8, 4), 2.0))
    bad_len = dist.jit(lambda a: dist.shard_tensor(a, MESH4, [dist.Shard(0), dist.Replicate()]))
    _err(dist.PlacementError, "got 2 placements", lambda: bad_len(a))
    uneven = dist.jit(lambda a: dist.reshard(a, MESH4, [dist.Shard(1)]) * 2.0)
    with pytest.warns(dist.UnevenShardingWarning, match=r"dim 1 of size 2 does not split evenly "
                      r"over mesh dim 'x' \(4\) = 4 devices; it is computed with that dim whole"):
        got = uneven(dist.shard_tensor(np.ones((8, 2), np.float32), MESH4, [dist.Shard(0)]))
    np.testing.assert_array_equal(got.numpy(), np.full((8, 2), 2.0))
    _err(dist.MeshMismatchError, "found no mesh", lambda: dist.jit(lambda a: a * 2)(np.ones(4)))


# -- pending Partial, invariants, donation, notebook view ---------------------------------------

def test_partial_stays_pending_through_linear_ops_and_is_reduce_scattered_once():
    a = dist.shard_tensor(np.arange(32, dtype=np.float32).reshape(8, 4), MESH4, [dist.Shard(1)])
    b = dist.shard_tensor(np.ones((4, 8), np.float32), MESH4, [dist.Shard(0)])

    def fn(a, b):
        c = (a @ b) * 2.0                 # P(sum), scaled: still pending
        c = (c + c).T.reshape(8, 8)       # add, transpose, reshape: still pending
        return dist.reshard(c, MESH4, [dist.Shard(0)])

    f = dist.jit(fn)
    out = f(a, b)
    A = np.arange(32, dtype=np.float32).reshape(8, 4)
    np.testing.assert_array_equal(out.numpy(), (4.0 * (A @ np.ones((4, 8)))).T)
    plan = f.plan(a, b)
    assert [c.kind for c in plan.collectives] == ["reduce-scatter"]
    assert hlo_counts(f, a, b) == Counter({"reduce-scatter": 1})


@pytest.mark.parametrize("mesh, placements", [(MESH4, [dist.Shard(0)]),
                                                (MESH24, [dist.Replicate(), dist.Shard(0)]),
                                                (MESH24, [dist.Shard(0), dist.Shard(0)])],
                         ids=["4", "2x4 mp", "2x4 both"])
def test_a_value_and_its_stop_gradient_read_alike_are_planned_once(mesh, placements):
    # softmax / logsumexp write `x - stop_gradient(m)`; a program that also reads `m` itself
    # alike computes the same bytes twice, which XLA merges: the plan moved both copies and
    # listed collectives the compiled program does not run (3 gathers and 2 all-to-alls
    # planned, 2 and 1 run). Called at the top level, the program drops its stop_gradients
    # (its jax.grad ran inside) and plans what runs; differentiated from outside it keeps them.
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 16)).astype(np.float32)
    m = rng.normal(size=(16, 16)).astype(np.float32)
    ramp = np.arange(256, dtype=np.float32)

    def f(a, b, m):
        y = jnp.broadcast_to(jax.lax.stop_gradient(a)[None, :], (16, 16))
        z = jnp.broadcast_to(a[None, :], (16, 16))
        w = jnp.broadcast_to(b[:, None], (16, 16))
        return (jnp.sort((y * m).ravel()) + jnp.sort((z * m).ravel()) * ramp
                + jnp.sort((w * m).ravel()) ** 2)

    def unstopped(a, b, m):  # the same program with the stopped copy read as the value
        z = jnp.broadcast_to(a[None, :], (16, 16))
        w = jnp.broadcast_to(b[:, None], (16, 16))
        return jnp.sort((z * m).ravel()) * (1.0 + ramp) + jnp.sort((w * m).ravel()) ** 2

    g = dist.jit(f)
    da, db = (dist.shard_tensor(v, mesh, placements) for v in (a, b))
    dm = dist.shard_tensor(m, mesh, [dist.Replicate()] * mesh.ndim)
    np.testing.assert_allclose(g(da, db, dm).numpy(), jax.jit(f)(a, b, m), rtol=1e-6)
    assert hlo_counts(g, da, db, dm) == planned(g, da, db, dm)
    assert planned(g, da, db, dm) == planned(dist.jit(unstopped), da, db, dm)
    # differentiated from outside, the gradient stops where the user stopped it
    got = jax.grad(lambda a: jnp.sum(g(a, db, dm)))(da)
    want = jax.grad(lambda a: jnp.sum(f(a, b, m)))(a)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh, placements", [(MESH4, [dist.Shard(0)]),
                                                (MESH24, [dist.Shard(1), dist.Shard(0)])],
                         ids=["4", "2x4"])
def test_equal_steps_reading_a_scalar_fill_are_one_step(mesh, placements):
    # `where(x > 0, x, 1.0)` written twice (jax.scipy.special.zeta does): each reads its own
    # broadcast of 1.0, so they were two equations and the plan moved both results, where
    # XLA's CSE runs one. A scalar's broadcast is compared by its value, as a literal is.
    x = np.random.default_rng(1).normal(size=(16, 8)).astype(np.float32)

    def f(x):
        a = jnp.log(jnp.where(x > 0, x, 1.0))
        b = jnp.log(jnp.where(x > 0, x, 1.0))
        return jnp.sort(a, axis=0) + jnp.sort(b, axis=0) * 2.0

    g = dist.jit(f)
    dx = dist.shard_tensor(x, mesh, placements)
    np.testing.assert_allclose(g(dx).numpy(), jax.jit(f)(x), rtol=1e-6)
    moved = planned(g, dx)
    assert sum(moved.values()) == 1, moved  # one move of the sorted value, read twice
    assert hlo_counts(g, dx) == moved


def test_a_select_between_one_value_and_itself_is_that_value():
    # jax.vmap of `where(c, v, v)`-like branches (jax.scipy.special.expn selects an unbatched
    # value against itself under vmap): whichever case is picked the result is the value, as
    # XLA simplifies it; planned as a select, the plan moved the value and the predicate
    # (2 × 4: 33 all-to-alls planned for expn's 28 compiled)
    rng = np.random.default_rng(0)
    a, b = (rng.uniform(0.1, 0.9, size=(4, 8, 16)).astype(np.float32) for _ in range(2))

    def f(a, b):
        return jax.lax.select_n(a > b, b, b) * jnp.sort(a, 0)

    da = dist.shard_tensor(a, MESH24, [dist.Shard(0), dist.Shard(2)])
    db = dist.shard_tensor(b, MESH24, [dist.Shard(1), dist.Shard(2)])
    g = dist.jit(f)
    np.testing.assert_array_equal(g(da, db).numpy(), jax.jit(f)(a, b))
    assert planned(g, da, db) == planned(dist.jit(lambda a, b: b * jnp.sort(a, 0)), da, db)
    assert hlo_counts(g, da, db) == planned(g, da, db)
    x = rng.uniform(0.1, 0.9, size=(4, 8, 16)).astype(np.float32)
    n = (rng.integers(0, 4, size=(4, 8, 16))).astype(np.int32)
    h = dist.jit(jax.vmap(jax.scipy.special.expn))
    dn = dist.shard_tensor(n, MESH24, [dist.Shard(0), dist.Shard(2)])
    dx = dist.shard_tensor(x, MESH24, [dist.Shard(1), dist.Shard(2)])
    np.testing.assert_allclose(h(dn, dx).numpy(), jax.jit(jax.vmap(jax.scipy.special.expn))(n, x),
                               rtol=1e-5, atol=1e-6)
    assert hlo_counts(h, dn, dx) == planned(h, dn, dx)


def _linspace_one_view(a, b):
    # jnp.linspace(a, b) for one example, its stop's two views written as one
    t = (jnp.arange(49, dtype=jnp.float32) / 49.0).reshape(49, 1, 1)
    stop = b.reshape(1, 8, 16)
    return jnp.concatenate([a.reshape(1, 8, 16) * (1.0 - t) + stop * t, stop], axis=0)


@pytest.mark.parametrize("form", ["vmap of linspace", "reshape beside expand_dims",
                                  "squeeze of expand_dims"])
def test_a_reshape_and_a_unit_dim_broadcast_of_one_value_are_one_value(form):
    # jnp.linspace(start, stop) reshapes stop for one term and broadcasts it to the same shape
    # (a unit dim inserted) for another: the same elements in the same order, one buffer to
    # XLA, whose CSE merges the two moves; the plan moved each (2 all-to-alls, 1 compiled). It
    # now plans what the program written with one view plans, and what XLA runs
    rng = np.random.default_rng(0)
    a, b = (rng.uniform(0.1, 0.9, size=(4, 8, 16)).astype(np.float32) for _ in range(2))
    fns = {  # (the form, the same written with one view)
        "vmap of linspace": (jax.vmap(lambda a, b: jnp.linspace(a, b)),
                             jax.vmap(_linspace_one_view)),
        "reshape beside expand_dims": (
            lambda a, b: jnp.concatenate(
                [a.reshape(4, 1, 8, 16) * b.reshape(4, 1, 8, 16), jnp.expand_dims(b, 1)], 1),
            lambda a, b: jnp.concatenate(
                [a.reshape(4, 1, 8, 16) * b.reshape(4, 1, 8, 16), b.reshape(4, 1, 8, 16)], 1)),
        "squeeze of expand_dims": (
            lambda a, b: jnp.sort(jnp.squeeze((a + b)[:, None], 1), 0) * jnp.sort(a + b, 0),
            lambda a, b: jnp.sort(a + b, 0) ** 2),
    }
    da = dist.shard_tensor(a, MESH24, [dist.Shard(0), dist.Shard(2)])
    db = dist.shard_tensor(b, MESH24, [dist.Shard(1), dist.Shard(2)])
    f, one_view = (dist.jit(g) for g in fns[form])
    np.testing.assert_allclose(f(da, db).numpy(), jax.jit(fns[form][0])(a, b), rtol=1e-6,
                               atol=1e-6)
    moved = planned(f, da, db)
    assert hlo_counts(f, da, db) == moved
    assert moved == planned(one_view, da, db) and sum(moved.values()), moved


def test_layout_invariants():
    from autoshard.layout import Layout
    from autoshard.placement import ReduceType
    from autoshard.reshard.steps import LocalSlice

    with pytest.raises(dist.PlacementError, match="both partial and sharding"):
        Layout((("x",), ()), (("x", ReduceType.SUM),))
    partial = Layout(((), ()), (("x", ReduceType.SUM),))
    assert LocalSlice("x", 0).after(partial, (8, 8), {"x": 4}) is None  # never slice a partial


def test_donated_inputs_still_give_right_results():
    f = dist.jit(lambda a, b: a * 2.0 + b, donate_argnums=(0,))
    a = dist.shard_tensor(np.ones((8, 4), np.float32), MESH4, [dist.Shard(0)])
    b = dist.shard_tensor(np.ones((8, 4), np.float32), MESH4, [dist.Shard(0)])
    np.testing.assert_array_equal(f(a, b).numpy(), np.full((8, 4), 3.0))


def test_explain_renders_for_notebooks():
    a = dist.shard_tensor(np.ones((8, 4), np.float32), MESH4, [dist.Shard(1)])
    b = dist.shard_tensor(np.ones((4, 4), np.float32), MESH4, [dist.Shard(0)])
    html = dist.jit(lambda a, b: jnp.tanh(a @ b)).explain(a, b)._repr_html_()
    assert "<table>" in html and "all-reduce" in html and "dot_general" in html


def test_explain_is_text():
    """f.explain(...) is the text it prints (a str: searched, split, sliced as one), with the
    plan it describes beside it; on a function cut into stages too."""
    a = dist.shard_tensor(np.ones((8, 4), np.float32), MESH4, [dist.Shard(1)])
    b = dist.shard_tensor(np.ones((4, 4), np.float32), MESH4, [dist.Shard(0)])
    f = dist.jit(lambda a, b: jnp.tanh(a @ b))
    text = f.explain(a, b)
    assert isinstance(text, str) and "all-reduce" in text and text[:10] == str(text)[:10]
    assert repr(text) == str(text) and text.plan.collectives
    assert copy.copy(text) == copy.deepcopy(text) == text == pickle.loads(pickle.dumps(text))
    other = dist.ProcessMesh([4, 5, 6, 7], ["x"])
    g = dist.jit(lambda a: dist.reshard(a * 2.0, other, [dist.Shard(0)]) + 1.0)
    staged = g.explain(dist.shard_tensor(np.ones((8, 4), np.float32), MESH4, [dist.Shard(0)]))
    assert isinstance(staged, str) and "2 stages" in staged and len(staged.stages) == 2
    assert copy.deepcopy(staged) == pickle.loads(pickle.dumps(staged)) == staged


def test_explains_equation_table_lists_a_copy_read_twice_once():
    """A layer norm's centred value is reduced once and read by two equations: the table named
    psum(mp) at both rows (the collectives list and the HLO have one)."""
    x = dist.shard_tensor(np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32),
                          MESH24, [dist.Shard(0), dist.Shard(1)])

    def norm(x):
        c = x - x.mean(-1, keepdims=True)
        return c * jax.lax.rsqrt((c ** 2).mean(-1, keepdims=True) + 1e-5)

    f = dist.jit(norm)
    table = str(f.explain(x)).split("collectives:")[0]
    planned = [c for c in f.plan(x).collectives if c.kind == "all-reduce"]
    hlo = count_collectives(f.lower(x).compile().as_text())
    assert table.count("psum(mp)") == len(planned) == hlo["all-reduce"], table
    assert "(same copy as #" in table


def test_conflicting_contracting_shardings_are_decided_by_cost_deterministically():
    # lhs contracts over 'dp', rhs over 'mp': JAX's explicit mode stops here; we choose.
    A = np.arange(64, dtype=np.float32).reshape(8, 8) / 10
    B = np.arange(64, dtype=np.float32).reshape(8, 8)[::-1] / 10
    a = dist.shard_tensor(A, MESH24, [dist.Shard(1), dist.Replicate()])
    b = dist.shard_tensor(B, MESH24, [dist.Replicate(), dist.Shard(0)])
    def matmul(a, b):
        return a @ b

    f = dist.jit(matmul)
    np.testing.assert_allclose(f(a, b).numpy(), A @ B, rtol=1e-5)
    plan = f.plan(a, b)
    assert plan.eqns[0].considered > 1 and plan.eqns[0].strategy
    assert all(c.reason and c.source for c in plan.collectives)
    again = dist.jit(matmul)
    assert str(again.explain(a, b)) == str(f.explain(a, b))  # same inputs, same plan
    assert hlo_counts(f, a, b) == planned(f, a, b)


def test_rule_answers_are_shared_by_equal_equations_until_a_rule_changes():
    # the planner asks a rule once per distinct equation (layers repeat theirs) and shares the
    # answer; registering a rule again must not leave the old answer in use
    from autoshard.compiler.factors import einsum
    from autoshard.compiler.propagate import rule_signature
    from autoshard.compiler.trace import build_program
    from autoshard.rules.registry import RuleRegistry

    calls = []

    def rule(spec):
        def sharding(ins, outs, **params):
            calls.append(spec)
            return einsum(spec, [ins[0].shape], [outs[0].shape])
        return sharding

    registry = RuleRegistry()
    registry.register(jax.lax.sin_p, rule("ij->ij"))
    program = build_program(jax.make_jaxpr(lambda a: jnp.sin(jnp.sin(a)))(jnp.ones((8, 4))))
    first, second = (rule_signature(e, registry) for e in program.eqns)
    assert first is second and calls == ["ij->ij"]
    registry.register(jax.lax.sin_p, rule("i.->i."))
    program = build_program(jax.make_jaxpr(lambda a: jnp.sin(a))(jnp.ones((8, 4))))
    assert rule_signature(program.eqns[0], registry).opsh.operands == ((0, None),)
    assert calls == ["ij->ij", "i.->i."]


# -- the passes pause cyclic garbage collection and always give the setting back ----------------

@pytest.mark.parametrize("enabled_before", [True, False])
def test_compiling_restores_the_garbage_collector_setting(enabled_before):
    import gc

    from autoshard.compiler.gc_pause import gc_paused
    x = dist.shard_tensor(np.arange(16, dtype=np.float32).reshape(4, 4), MESH4,
                          [dist.Shard(0)])
    seen = []

    @gc_paused
    def failing_pass():
        assert not gc.isenabled()
        return 1 / 0

    def f(a):
        seen.append(gc.isenabled())  # runs while the program is traced, before the passes
        return jnp.tanh(a) @ a.T

    (gc.enable if enabled_before else gc.disable)()
    try:
        out = dist.jit(f)(x)
        assert gc.isenabled() is enabled_before
        with pytest.raises(ZeroDivisionError):
            failing_pass()
        assert gc.isenabled() is enabled_before
    finally:
        gc.enable()
    assert seen[0] is enabled_before
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    np.testing.assert_allclose(np.asarray(out.numpy()), np.tanh(a) @ a.T, rtol=1e-5)


def test_every_equation_is_attributed_to_the_users_line():
    # gelu's and optax's bodies are library code: their equations report the line that called
    # them (source lines are resolved only when read, e.g. by explain).
    import inspect

    X = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    x = dist.shard_tensor(X, MESH24, [dist.Shard(0), dist.Replicate()])
    w = dist.shard_tensor(X.T.copy(), MESH24, [dist.Replicate(), dist.Shard(1)])
    tx = optax.sgd(0.1)

    def step(x, w):
        g = jax.grad(lambda w: jnp.sum(jax.nn.gelu(x @ w)))(w)
        updates, _ = tx.update(g, tx.init(w))
        return optax.apply_updates(w, updates)

    first = inspect.getsourcelines(step)[1]
    lines = {f"test_jit.py:{first + k}" for k in (1, 2, 3)}
    plan = dist.jit(step).plan(x, w)
    assert {ep.source for ep in plan.eqns} <= lines
    assert {ep.source for ep in plan.eqns} >= {f"test_jit.py:{first + 1}"}
    assert all(c.source in lines for c in plan.collectives)


def test_collectives_no_equation_of_the_user_made_name_the_calling_line():
    # An input returned as it came is moved for the output by no equation, and a library
    # function under dist.jit (jnp.matmul) has no frame of the user's: both collectives name
    # the line that ran the program (were None, and autoshard's own compiler/jit.py).
    import inspect

    X = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    x = dist.shard_tensor(X, MESH24, [dist.Shard(0), dist.Shard(1)])
    w = dist.shard_tensor(X.T.copy(), MESH24, [dist.Shard(0), dist.Replicate()])
    passed = dist.jit(lambda x: (x, x * 2), out_placements=[[dist.Replicate()] * 2, None])
    here = inspect.currentframe().f_lineno
    plans = [passed.plan(x), dist.jit(jnp.matmul).plan(x, w)]
    for plan in plans:
        assert plan.collectives
        assert {c.source for c in plan.collectives} == {f"test_jit.py:{here + 1}"}, str(plan)
        assert "jit.py:" not in str(plan).replace("test_jit.py:", ""), str(plan)


def test_collectives_of_a_library_update_name_the_users_call_not_the_librarys_file():
    """A to_static step's optimizer update has no frame of the user's (to_static's own step
    calls optax): its gradient reductions after a scanned model named optax's `update.py:42`,
    a file the user never wrote; now the user's line that ran the step."""
    import inspect

    import optax

    rng = np.random.default_rng(0)
    w = {"w": dist.shard_tensor((rng.normal(size=(3, 16, 16)) * 0.2).astype(np.float32),
                                MESH24, [dist.Replicate(), dist.Shard(2)])}

    def apply(p, x):  # three layers as a scan: the gradients are reduced after the loop
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["w"])[0]

    m = dist.to_static((apply, w), None, lambda o, y: jnp.mean((o - y) ** 2), optax.sgd(0.1))
    x, y = (rng.normal(size=(8, 16)).astype(np.float32) for _ in range(2))
    here = inspect.currentframe().f_lineno
    m(x, y)
    plan = m.programs()["train"].plan(*m.program_args("train", x, y))
    dp = [c for c in plan.collectives if c.axes == ("dp",)]
    assert dp and all(c.source.startswith("test_jit.py:") for c in plan.collectives), str(plan)
    assert any(c.source == f"test_jit.py:{here + 1}" for c in dp), str(plan)
    # the summary's "per step" counts the scanned layers' collectives once per layer
    per_step = plan.collective_counts(per_call=True)
    assert per_step != plan.collective_counts()
    listed = m.summary(x, y).splitlines()[1].split(": ", 1)[1].split("; ")[0].split(", ")
    assert {k: int(n) for n, k in (c.split(" ", 1) for c in listed)} == per_step


# -- composition: dist.jit inside dist.jit, closed-over DistTensors, outer transformations -----

def _split_inputs():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(8, 16)).astype(np.float32)
    w = rng.normal(size=(16, 16)).astype(np.float32)
    return x, w, dist.shard_tensor(x, MESH24, ["S(0)", "R"]), dist.shard_tensor(w, MESH24, ["R", "S(1)"])


def test_dist_jit_inside_dist_jit_is_one_program():
    x, w, dx, dw = _split_inputs()
    inner = dist.jit(lambda a, b: jnp.tanh(a @ b))
    outer = dist.jit(lambda a, b: inner(a, b).sum(axis=1) * 2.0)
    np.testing.assert_allclose(outer(dx, dw).numpy(), np.tanh(x @ w).sum(axis=1) * 2.0, rtol=1e-5,
                               atol=1e-5)
    assert inner.trace_count == 0  # its body was traced into the outer program, not apart


def test_closed_over_dtensors_enter_as_their_global_values():
    x, w, dx, dw = _split_inputs()
    partial = dist.shard_tensor(w, MESH24, ["P(sum)", "R"])
    got = dist.jit(lambda a: a @ dw + (partial * 2.0).sum() + dw.T.max())(dx)
    np.testing.assert_allclose(got.numpy(), x @ w + 2.0 * w.sum() + w.max(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("order", ["run first", "differentiated first"])
def test_higher_order_derivatives_through_a_max_over_a_split_dim(order):
    # a row max over the mp-split dim reduces a pending Partial(max) with pmax, which jax
    # cannot differentiate: ours carries a derivative of every order where the program may be
    # differentiated (called under a jax transformation), and is plain equations where it is
    # only run — each program's lowering kept apart from the other's, in either order
    x, w, dx, dw = _split_inputs()

    def fn(a, b):
        return jnp.max(jnp.tanh(a @ b), axis=1) + jnp.sum(a @ b, axis=1)

    f = dist.jit(fn)
    assert any(c.step.startswith("pmax") for c in f.plan(dx, dw).collectives)

    def hvp(fun, a, b):
        return jax.jvp(jax.grad(lambda a, b: jnp.sum(fun(a, b) ** 2), argnums=(0, 1)),
                       (a, b), (a, b))[1]

    def run():
        np.testing.assert_allclose(f(dx, dw).numpy(), fn(x, w), rtol=1e-5, atol=1e-5)
        entry, leaves = f._entry((dx, dw), {})
        lowered = str(entry.fn.trace(*f._physical_inputs(entry, leaves)).jaxpr)
        assert "pmax" in lowered and "custom_jvp_call" not in lowered

    if order == "run first":
        run()
    for got, want in zip(hvp(f, dx, dw), hvp(fn, x, w)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    run()


@pytest.mark.filterwarnings("ignore:.*custom_linear_solve")  # runs whole there: see below
@pytest.mark.parametrize("wrap", ["jit", "checkpoint", "grad of jit", "grad of checkpoint"])
def test_jax_transformations_around_dist_jit_see_global_arrays(wrap):
    # as a nested jax.jit does, a dist.jit call inside jax.jit / jax.checkpoint hands back
    # global arrays, which jnp functions take; a solve stays whole there, since the enclosing
    # jit may be differentiated after this call was traced (its inlined form has no
    # derivative in the matrix)
    x, w, dx, dw = _split_inputs()
    m = (w @ w.T / 16 + np.eye(16, dtype=np.float32))
    dm = dist.shard_tensor(m, MESH24, ["R", "R"])
    f = dist.jit(lambda a, b, c: jnp.tanh(a @ b) @ jnp.linalg.solve(c, b.T))

    def loss(fun, a, b, c):
        return jnp.sum(fun(a, b, c) ** 2)

    wrapper = {"jit": jax.jit, "checkpoint": jax.checkpoint}[wrap.split()[-1]]
    run = functools.partial(loss, f)
    want_fn = functools.partial(loss, lambda a, b, c: jnp.tanh(a @ b) @ jnp.linalg.solve(c, b.T))
    if wrap.startswith("grad"):
        got = jax.grad(wrapper(run), argnums=(0, 1, 2))(dx, dw, dm)
        want = jax.grad(want_fn, argnums=(0, 1, 2))(x, w, m)
    else:
        got, want = wrapper(run)(dx, dw, dm), want_fn(x, w, m)
        assert isinstance(got, jax.Array)
    for g, v in zip(jax.tree.leaves(got, is_leaf=lambda t: isinstance(t, dist.DistTensor)),
                    jax.tree.leaves(want)):
        g = g.numpy() if isinstance(g, dist.DistTensor) else np.asarray(g)
        np.testing.assert_allclose(g, v, rtol=2e-4, atol=2e-4)


def test_eager_operators_inside_jax_jit_keep_their_placements():
    x, w, dx, dw = _split_inputs()
    out = jax.jit(lambda a, b: (a @ b) * 2.0)(dx, dw)
    assert isinstance(out, dist.DistTensor) and out.placements == [dist.Shard(0), dist.Shard(1)]
    np.testing.assert_allclose(out.numpy(), (x @ w) * 2.0, rtol=1e-5, atol=1e-5)


def test_closed_over_dtensors_inside_jax_jit_give_global_arrays():
    x, w, dx, dw = _split_inputs()
    f = dist.jit(lambda a, b: jnp.tanh(a @ b))
    got = jax.jit(lambda: jnp.sum(f(dx, dw)))()  # no traced argument reaches f
    np.testing.assert_allclose(float(got), np.tanh(x @ w).sum(), rtol=1e-5)


def test_partial_outputs_asked_for_under_an_outer_jit_or_grad_are_reduced_in_jitted_code():
    # out_placements Partial: the global array is made by jitted programs, which an outer
    # trace takes (the eager reshard refuses traced values)
    x, w, dx, dw = _split_inputs()
    a, b = dist.shard_tensor(x, MESH4, ["S(1)"]), dist.shard_tensor(w, MESH4, ["S(0)"])
    f = dist.jit(lambda a, b: a @ b, out_placements=[["P(sum)"]])
    assert f(a, b).placements == [dist.Partial()]
    np.testing.assert_allclose(np.asarray(jax.jit(lambda a, b: f(a, b) * 2)(a, b)), 2 * x @ w,
                               rtol=1e-5, atol=1e-5)
    got = jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2))(a, b)
    want = jax.grad(lambda a, b: jnp.sum((a @ b) ** 2))(x, w)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("out", [["S(0)", "P(max)"], ["S(0)", "P(min)"], ["R", "P(max)"],
                                 ["S(0)", "P(avg)"], ["S(0)", "P(sum)"]], ids=str)
def test_a_pending_sum_asked_for_as_another_partial_is_reduced_after_the_steps(out):
    # the sum pending on the add's output rides through the dot; the output's target makes a
    # Partial(max) of its own, which does not commute with the dot: the sum is reduced where
    # the output needs it (it was moved before the dot: every value came out -inf)
    rng = np.random.default_rng(0)
    x, y, w = (rng.normal(size=s).astype(np.float32) for s in [(4, 8), (4, 8), (8, 8)])
    a = dist.shard_tensor(x, MESH24, ["R", "R"])
    b = dist.reshard(dist.shard_tensor(y, MESH24, ["R", "R"]), MESH24, ["R", "P(sum)"])
    f = dist.jit(lambda a, b, w: (a + b) @ w, out_placements=[out])
    got = f(a, b, dist.shard_tensor(w, MESH24, ["R", "R"]))
    np.testing.assert_allclose(got.numpy(), (x + y) @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.uint32, np.int32, np.uint8, np.int16])
def test_multiply_high_equals_one_device_for_every_integer_width(dtype):
    # XLA's multiply-high does not lower inside shard_map (jax 0.10 CPU); the rule computes it
    # from half-width products: bit-equal to one device, extremes included
    info = np.iinfo(dtype)
    rng = np.random.default_rng(0)
    a, b = (rng.integers(info.min, info.max, (8, 16), dtype=dtype, endpoint=True)
            for _ in range(2))
    a[0, :3], b[0, :3] = [info.min, info.max, info.max], [info.min, info.min, info.max]
    f = dist.jit(jax.lax.mulhi)
    x = dist.shard_tensor(a, MESH24, [dist.Shard(0), dist.Shard(1)])
    y = dist.shard_tensor(b, MESH24, [dist.Shard(0), dist.Replicate()])
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        out = f(x, y)
    np.testing.assert_array_equal(out.numpy(), jax.jit(jax.lax.mulhi)(a, b))
    assert out.placements == x.placements and not f.plan(x, y).collectives


def test_a_closed_over_dtensor_is_a_placed_input_not_a_constant():
    """`dist.jit(lambda x: x @ w)` with w a DistTensor split over mp: w enters the program as
    an input laid out as stored (the matmul runs split, one all-reduce of the result), not as
    a constant baked whole into the executable on every device."""
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(16, 32)).astype(np.float32)
    dw = dist.shard_tensor(w, MESH24, [dist.Replicate(), dist.Shard(0)])
    f = dist.jit(lambda x: jnp.tanh(x @ dw))
    dx = dist.shard_tensor(x, MESH24, [dist.Shard(0), dist.Replicate()])
    np.testing.assert_allclose(f(dx).numpy(), np.tanh(x @ w), rtol=1e-5, atol=1e-6)
    plan = f.plan(dx)
    assert [L.dims for L in plan.inputs] == [(("dp",), ()), (("mp",), ())]
    assert [c.kind for c in plan.collectives] == ["all-reduce"]
    assert hlo_counts(f, dx) == Counter({"all-reduce": 1})
    hlo = f.lower(dx).compile().as_text()
    assert not [line for line in hlo.splitlines() if "constant(" in line and "f32[" in line
                and ("16,32" in line or "4,32" in line)]


def test_static_argnames_compile_one_program_per_value():
    """jax.jit's static_argnames: a Python bool picks the code path when tracing."""
    calls = []

    @functools.partial(dist.jit, static_argnames=("train", "scale"))
    def f(x, *, train, scale=1.0):
        calls.append(train)
        return jnp.tanh(x) * scale if train else x * scale

    x = np.arange(32, dtype=np.float32).reshape(8, 4) / 32
    dx = dist.shard_tensor(x, MESH24, [dist.Shard(0), dist.Replicate()])
    np.testing.assert_allclose(f(dx, train=True).numpy(), np.tanh(x), rtol=1e-6)
    np.testing.assert_allclose(f(dx, train=False, scale=2.0).numpy(), x * 2)
    np.testing.assert_allclose(f(dx, train=True).numpy(), np.tanh(x), rtol=1e-6)
    assert calls == [True, False]  # the third call reused the first program
    assert f.plan(dx, train=True).inputs[0].dims == (("dp",), ())
    with pytest.raises(dist.PlacementTypeError, match="hashable"):
        f(dx, train=[True])


@pytest.mark.parametrize("how", [dict(static_argnames="train"), dict(static_argnums=1)],
                         ids=["argnames", "argnums"])
def test_a_static_argument_is_static_passed_by_position_or_by_keyword(how):
    """As jax.jit reads the signature: static_argnames covers the argument passed by position,
    static_argnums the one passed by keyword — not a traced bool reaching `if train`."""
    def f(x, train):
        return jnp.tanh(x) if train else x * 2

    g = dist.jit(f, **how)
    x = np.arange(32, dtype=np.float32).reshape(8, 4) / 32
    dx = dist.shard_tensor(x, MESH24, [dist.Shard(0), dist.Replicate()])
    for call in (lambda: g(dx, True), lambda: g(dx, train=True)):
        np.testing.assert_allclose(call().numpy(), np.tanh(x), rtol=1e-6)
    np.testing.assert_allclose(g(dx, False).numpy(), x * 2)


@pytest.mark.parametrize("how", [dict(donate_argnames="a"), dict(donate_argnums=0)],
                         ids=["argnames", "argnums"])
@pytest.mark.parametrize("by_keyword", [False, True], ids=["positional", "keyword"])
def test_donated_arguments_named_either_way_are_donated(how, by_keyword):
    """donate_argnames as jax.jit's (it was refused as an unknown keyword): the argument's
    buffers are donated to the program whether it is passed by position or keyword, the
    other argument's are not, and the result is unchanged."""
    def f(a, b):
        return a * 2.0 + b

    g = dist.jit(f, **how)
    a = dist.shard_tensor(np.ones((8, 4), np.float32), MESH24, [dist.Shard(0), dist.Replicate()])
    b = dist.shard_tensor(np.ones((8, 4), np.float32), MESH24, [dist.Replicate(), dist.Shard(1)])
    args, kwargs = ((), dict(a=a, b=b)) if by_keyword else ((a, b), {})
    text = g.lower(*args, **kwargs).as_text()
    assert text.count("jax.buffer_donor = true") == 1
    np.testing.assert_array_equal(g(*args, **kwargs).numpy(), np.full((8, 4), 3.0))


@pytest.mark.parametrize("call,named,fix", [
    (lambda f, x: f(x, "relu"), "argument 1 is 'relu'", "static_argnums=(1,)"),
    (lambda f, x: f(x, {"act": "relu", "k": 2.0}), "argument 1['act'] is 'relu'",
     "static_argnums=(1,)"),
    (lambda f, x: f(x, mode="relu"), "keyword argument 'mode' is 'relu'",
     "static_argnames=('mode',)"),
], ids=["positional", "inside a dict", "keyword"])
def test_an_argument_that_is_not_an_array_names_itself_and_says_mark_it_static(call, named, fix):
    """A string among the traced arguments: not jax's "Dtype <U4 is not a valid JAX array
    type", but which argument it is and the static_argnums / static_argnames to write."""
    f = dist.jit(lambda x, cfg=None, mode=None: x * 2)
    dx = dist.shard_tensor(np.ones((8, 4), np.float32), MESH24, [dist.Shard(0), dist.Replicate()])
    with pytest.raises(dist.PlacementTypeError) as info:
        call(f, dx)
    assert named in str(info.value) and fix in str(info.value)
    assert "test_jit.py" in str(info.value)


def test_jax_jit_in_and_out_shardings_carry_over():
    """Code written for jax.jit keeps its in_shardings / out_shardings: the arguments are
    placed as they say before the call (a DistTensor laid out otherwise is resharded), the
    results laid out as they say; bare PartitionSpecs read jax.set_mesh's mesh."""
    jm = MESH24.to_jax()
    rng = np.random.default_rng(2)
    x, w = rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(16, 8)).astype(np.float32)

    def f(x, w):
        return jnp.tanh(x @ w)

    kw = dict(in_shardings=(NamedSharding(jm, P("dp", None)), NamedSharding(jm, P(None, "mp"))),
              out_shardings=NamedSharding(jm, P("dp", "mp")))
    g = dist.jit(f, **kw)
    want = jax.jit(f, **kw)(x, w)
    dw = dist.shard_tensor(w, MESH24, [dist.Shard(0), dist.Replicate()])  # resharded first
    for args in ((x, w), (x, dw)):
        out = g(*args)
        np.testing.assert_allclose(out.numpy(), np.asarray(want), rtol=1e-5, atol=1e-6)
        assert out.placements == [dist.Shard(0), dist.Shard(1)]
        assert [L.dims for L in g.plan(*args).inputs] == [(("dp",), ()), ((), ("mp",))]
        assert hlo_counts(g, *args) == Counter()  # each device's block, no communication
    with jax.set_mesh(jm):
        h = dist.jit(f, in_shardings=P("dp"), out_shardings=P())
        out = h(x, w)
    assert out.placements == [dist.Replicate(), dist.Replicate()]
    np.testing.assert_allclose(out.numpy(), np.tanh(x @ w), rtol=1e-5, atol=1e-6)
    with pytest.raises(dist.PlacementTypeError, match="jax.set_mesh"):
        dist.jit(f, in_shardings=P("dp"))(x, w)


def test_out_shardings_name_the_mesh_as_jax_jit_reads_them():
    """With no placed input, out_shardings' mesh is the program's (jax.jit's reading: it
    found no mesh); on another mesh than the inputs' it is a MeshMismatchError naming both
    (its placements were read against the inputs' mesh: "got 1 placements for a 2-d mesh")."""
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    q = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("q",))
    out = dist.jit(lambda a: a * 2, out_shardings=NamedSharding(q, P("q")))(x)
    assert out.mesh == dist.ProcessMesh([0, 1, 2, 3], ["q"]) and out.placements == [S(0)]
    np.testing.assert_array_equal(out.numpy(), x * 2)
    with jax.set_mesh(q):
        out = dist.jit(lambda a: a * 2, out_shardings=P(None, "q"))(x.T)
    assert out.placements == [S(1)]
    np.testing.assert_array_equal(out.numpy(), x.T * 2)
    placed = dist.shard_tensor(x, MESH24, [S(0), R])
    with pytest.raises(dist.MeshMismatchError, match=r"out_shardings of <lambda> names "
                       r"ProcessMesh\(\[0, 1, 2, 3\], dim_names=\['q'\]\), but the program runs on "
                       r"ProcessMesh\(\[\[0, 1, 2, 3\], \[4, 5, 6, 7\]\]"):
        dist.jit(lambda a: a * 2, out_shardings=NamedSharding(q, P("q")))(placed)


@pytest.mark.parametrize("arg", ["numpy", "jax.Array", "DistTensor"])
def test_in_shardings_that_do_not_divide_an_array_split_it_unevenly(arg):
    """A sharding the mesh does not divide places the argument as shard_tensor does (jax's
    device_put raised its IndivisibleError for an array, not for a DistTensor); a spec of more
    dims than the argument is a PlacementError naming it."""
    jm = MESH24.to_jax()
    rng = np.random.default_rng(3)
    x, w = rng.normal(size=(8, 6)).astype(np.float32), rng.normal(size=(6, 8)).astype(np.float32)
    given = {"numpy": w, "jax.Array": jnp.asarray(w),
             "DistTensor": dist.shard_tensor(w, MESH24, [dist.Replicate(), dist.Replicate()])}[arg]
    f = dist.jit(lambda a, b: a @ b, in_shardings=(None, NamedSharding(jm, P("mp", None))))
    with pytest.warns(dist.UnevenShardingWarning, match="dim 0 of size 6"):
        out = f(x, given)
    np.testing.assert_allclose(out.numpy(), x @ w, rtol=1e-5, atol=1e-6)
    with pytest.raises(dist.PlacementError, match=r"argument leaf 1 is P\('mp', None, None\), of "
                       r"3 dims, but the argument has 2 \(shape \[6, 8\]\)"):
        dist.jit(lambda a, b: a @ b, in_shardings=(None, NamedSharding(jm, P("mp", None, None))))(
            x, given)


def test_out_placements_prefix_through_a_registered_dataclass():
    """out_placements matched through a pytree node that is neither dict nor sequence (a
    registered dataclass, a flax State) by jax's own prefix matching."""
    import dataclasses

    @functools.partial(jax.tree_util.register_dataclass, data_fields=["a", "b"], meta_fields=[])
    @dataclasses.dataclass
    class Pair:
        a: Any
        b: Any

    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    S, R = dist.Shard, dist.Replicate
    f = dist.jit(lambda x: Pair(x * 2, x + 1), out_placements=Pair([S(0), R()], None))
    out = f(dist.shard_tensor(x, MESH24, [R(), S(1)]))
    assert out.a.placements == [S(0), R()]
    np.testing.assert_array_equal(out.a.numpy(), x * 2)
    np.testing.assert_array_equal(out.b.numpy(), x + 1)


MESH222 = dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["a", "b", "c"])


@pytest.mark.parametrize("packing", [True, False], ids=["packed gathers", "gathers apart"])
@pytest.mark.parametrize("reduce_dim", [0, 1])
def test_two_moves_of_a_value_that_start_alike_run_their_common_steps_once(
        packing, reduce_dim, monkeypatch):
    """`h` is needed gathered over c as an output and, by a reshape, gathered over c and then
    all-to-all'd over a: both moves start with the same gather of the same block, run once (the
    partitioned program reuses it; XLA's CSE would merge it anyway) and listed once."""
    from autoshard.compiler import combine
    monkeypatch.setattr(combine, "ENABLED", packing)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 2)).astype(np.float32)
    w = rng.normal(size=(2, 16)).astype(np.float32)

    def f(x):
        h = jnp.tanh(x.reshape(2, 16)) * w
        z = h.reshape(16, 2) * 2.0
        return z, (z.reshape(2, 16) * h).sum(axis=reduce_dim)

    dx = dist.shard_tensor(x, MESH222, [dist.Replicate(), dist.Replicate(), dist.Shard(0)])
    g = dist.jit(f, out_placements=([dist.Shard(1), dist.Replicate(), dist.Replicate()], None))
    got, want = g(dx), jax.jit(f)(x)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-6)
    plan = g.plan(dx)
    gathers = [c for c in plan.collectives if c.kind == "all-gather" and c.step == "all_gather(c) dim 0"]
    # h gathered once (the other factor moves by its own gather, or by one permute)
    values = [c.value for c in gathers]
    assert len(set(values)) == len(values) and values.count("h") == 1, plan
    assert hlo_counts(g, dx) == planned(g, dx)


def test_a_value_and_its_resharded_copy_moved_alike_run_that_move_once():
    """`d = dist.reshard(a, ...)` is `a` gathered over mp; `a @ a` then moves `a` from that
    copy, gathering it over dp, as `d @ d` gathers `d`: one buffer gathered once in the
    program (XLA's CSE), so listed once — the plan listed both."""
    x = np.linspace(-1, 1, 256, dtype=np.float32).reshape(16, 16)
    S, R = dist.Shard, dist.Replicate
    a = dist.shard_tensor(x, MESH24, [S(0), S(0)])

    def f(a):
        d = dist.reshard(a, MESH24, [S(0), R()])
        return a @ a, d @ d

    g = dist.jit(f)
    for got in g(a):
        np.testing.assert_allclose(got.numpy(), x @ x, rtol=1e-5, atol=1e-5)
    assert planned(g, a) == hlo_counts(g, a) == Counter({"all-gather": 2})

    # a reshard of that copy back to a's own layout is a buffer of its own, moved apart
    def twice(a):
        d = dist.reshard(a, MESH24, [R(), S(0)])
        e = dist.reshard(d, MESH24, [S(1), S(1)])
        return a + d.T, e @ d

    b = dist.shard_tensor(x, MESH24, [S(1), S(1)])
    g = dist.jit(twice)
    np.testing.assert_allclose(g(b)[1].numpy(), x @ x, rtol=1e-5, atol=1e-5)
    assert planned(g, b) == hlo_counts(g, b)


def test_an_early_move_starts_from_no_copy_a_later_step_makes():
    """`a * 2` is read only as the constraint wants it: moved early, before the multiply. The
    plan started that move from `a`'s copy gathered for the later matmul, which the program
    does not hold yet there (it moves `a` from its own layout: a gather and an all-to-all)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    x = np.linspace(-1, 1, 256, dtype=np.float32).reshape(16, 16)
    S, R = dist.Shard, dist.Replicate
    a = dist.shard_tensor(x, MESH24, [S(1), S(0)])

    def f(a):
        d = jax.lax.with_sharding_constraint(a * 2, NamedSharding(MESH24.to_jax(), P(("dp", "mp"))))
        return a * 2 + 1, d.T @ a

    g = dist.jit(f, out_placements=[[S(1), S(0)], [S(0), R()]])
    got = g(a)
    np.testing.assert_allclose(got[1].numpy(), (x * 2).T @ x, rtol=1e-5, atol=1e-5)
    assert planned(g, a) == hlo_counts(g, a)


def test_a_scalars_broadcast_is_made_in_each_readers_layout():
    """The gradient of a mean broadcasts one scalar cotangent, read by both terms of a
    cross-entropy (logsumexp minus the label's logit, as optax writes it): made split as the
    first reader wants and gathered for the second, the plan listed a gather XLA folds into a
    local broadcast. Each reader gets its own broadcast in its own layout."""
    mesh = dist.ProcessMesh(np.arange(8).reshape(4, 2).tolist(), dim_names=["dp", "mp"])
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, 16, 32)).astype(np.float32)
    labels = rng.integers(0, 32, (8, 16)).astype(np.int32)

    def loss(z, y):
        lse = jax.nn.logsumexp(z, -1)
        return (lse - jnp.take_along_axis(z, y[..., None], -1)[..., 0]).mean()

    step = jax.value_and_grad(loss)
    args = (dist.shard_tensor(logits, mesh, [dist.Shard(0), dist.Shard(2)]),
            dist.shard_tensor(labels, mesh, [dist.Shard(0), dist.Shard(0)]))
    g = dist.jit(step)
    got, want = g(*args), jax.jit(step)(logits, labels)
    np.testing.assert_allclose(got[0].numpy(), want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1].numpy(), want[1], rtol=1e-5, atol=1e-7)
    plan = g.plan(*args)
    assert not [c for c in plan.collectives if c.kind == "all-gather"], plan
    broadcasts = [e for e in plan.program.eqns if e.name == "broadcast_in_dim"
                  and not e.inputs[0].shape]
    readers = Counter(v for e in plan.program.eqns for v in set(e.inputs))
    assert broadcasts and all(readers[e.outputs[0]] <= 1 for e in broadcasts)
    assert hlo_counts(g, *args) == planned(g, *args)


def _masked(a, b):
    m = jnp.tril(jnp.ones((16, 16), bool))[None, None]  # a causal mask, made from constants
    return jnp.where(m, a, 0.0) * 2.0, jnp.where(m, b, 1.0)


@pytest.mark.parametrize("form", ["plain", "checkpoint", "gradient of checkpoint"])
def test_a_broadcast_made_from_constants_is_made_in_each_readers_layout(form):
    """A causal mask broadcast to the scores and read by two selects split differently (an
    attention's scores split by heads forward, by batch in its gradient under Megatron-SP): made
    in the first reader's layout, it was all-to-all'ed for the second (1.75 KiB here; under
    jax.checkpoint once more in the recomputation, 2 planned / 1 compiled). Each reader gets its
    own broadcast of the constant mask, laid out as it reads it: nothing moves."""
    fn = {"plain": _masked, "checkpoint": jax.checkpoint(_masked),
          "gradient of checkpoint": jax.grad(
              lambda a, b: sum(jnp.sum(jnp.sin(o)) for o in jax.checkpoint(_masked)(a, b)),
              argnums=(0, 1))}[form]
    line = dist.ProcessMesh(list(range(8)), dim_names=["mp"])
    rng = np.random.default_rng(0)
    a, b = (rng.normal(size=(8, 8, 16, 16)).astype(np.float32) for _ in range(2))
    args = (dist.shard_tensor(a, line, [S(1)]), dist.shard_tensor(b, line, [S(0)]))
    g = dist.jit(fn)
    for got, want in zip(g(*args), jax.jit(fn)(a, b)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    assert planned(g, *args) == hlo_counts(g, *args) == Counter(), g.plan(*args)


def test_a_product_with_one_is_its_other_operand():
    """jax's gradient of a sum multiplies by a broadcast 1: that product is its other operand
    (XLA simplifies it so), so the gather it would have needed is the one already planned for
    that operand, listed once as it runs once."""
    mesh = dist.ProcessMesh([[0, 1], [2, 3], [4, 5], [6, 7]], dim_names=["a", "b"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 8, 4)).astype(np.float32)
    w = rng.normal(size=(4, 32, 1)).astype(np.float32)

    def f(x):
        y = jnp.tanh(x.reshape(4, 32, 1)) * w
        z = y.reshape(128, 1) * 2.0
        return (z ** 2).sum() + (z.reshape(4, 32, 1) * y).sum(axis=0).sum()

    step = jax.value_and_grad(f)
    dx = dist.shard_tensor(x, mesh, [dist.Shard(2), dist.Shard(0)])
    g = dist.jit(step)
    got, want = g(dx), jax.jit(step)(x)
    np.testing.assert_allclose(got[0].numpy(), want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1].numpy(), want[1], rtol=1e-5, atol=1e-6)
    plan = g.plan(dx)
    eqns = plan.program.eqns
    ones = {e.outputs[0] for e in eqns if e.name == "broadcast_in_dim"
            and e.inputs[0].is_const and np.ndim(e.inputs[0].const) == 0 and e.inputs[0].const == 1}
    assert ones and not any(e.name == "mul" and ones & set(e.inputs) for e in eqns)
    assert hlo_counts(g, dx) == planned(g, dx) == Counter(
        {"all-to-all": 1, "all-gather": 1, "all-reduce": 1})


def test_python_numbers_stay_weakly_typed_and_argument_numbers_count_from_the_end():
    # as jax.jit: a bfloat16 tensor times a Python float stays bfloat16; static_argnums=-1 is
    # the last argument
    mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
    x = (np.arange(128).reshape(8, 16) / 7).astype(jnp.bfloat16)
    dx = dist.shard_tensor(x, mesh, [dist.Shard(0), dist.Replicate()])
    fn = lambda a, s: a * s + 1.0
    out = dist.jit(fn)(dx, 0.1)
    assert out.dtype == jax.jit(fn)(x, 0.1).dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out.numpy(), np.float32),
                                  np.asarray(jax.jit(fn)(x, 0.1), np.float32))
    g = dist.jit(lambda a, n: a * n, static_argnums=-1)
    assert float(g(dx, 3).numpy()[1, 0]) == float(x[1, 0]) * 3
    assert g.trace_count == 1 and float(g(dx, 3).numpy()[1, 0]) == float(x[1, 0]) * 3


class _Double:
    def __call__(self, x):
        return x * 2.0


@pytest.mark.parametrize("fn, name", [(functools.partial(lambda s, x: x * s, 2.0),
                                       "partial(<lambda>)"), (_Double(), "_Double")])
def test_a_callable_without_a_name_runs_uneven_inputs_and_is_named_in_errors(fn, name):
    """dist.jit of a functools.partial or of an object with __call__ (no __name__): an input
    split unevenly, or a bad argument, crashed with an AttributeError on the function's name."""
    w = np.arange(4 * 50, dtype=np.float32).reshape(4, 50)  # 50 columns over 4: uneven
    x = dist.shard_tensor(w, MESH4, [dist.Shard(1)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dist.UnevenShardingWarning)
        out = dist.jit(fn)(x)
    np.testing.assert_array_equal(out.numpy(), w * 2.0)
    with pytest.raises(dist.PlacementTypeError, match=re.escape(name) + r": argument 0 is "
                       r"'a string' of type str, not an array"):
        dist.jit(fn)("a string")


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int8])
def test_multiply_high_with_a_size_one_operand_equals_one_device(dtype):
    """jax.vmap with one operand unbatched binds mulhi on (1, n) against (m, n), legal for the
    primitive: the half-width lowering's select failed on the two shapes."""
    info = np.iinfo(dtype)
    rng = np.random.default_rng(1)
    a = rng.integers(info.min, info.max, (16,), dtype=dtype, endpoint=True)
    b = rng.integers(info.min, info.max, (8, 16), dtype=dtype, endpoint=True)
    fn = jax.vmap(jax.lax.mulhi, in_axes=(None, 0))
    for placements in (["R", "R"], ["S(0)", "S(1)"]):
        y = dist.shard_tensor(b, MESH24, placements)
        out = dist.jit(fn)(dist.shard_tensor(a, MESH24, ["R", "R"]), y)
        np.testing.assert_array_equal(out.numpy(), jax.jit(fn)(a, b))


@pytest.mark.parametrize("collective", [jax.lax.psum, jax.lax.pmax, jax.lax.pmin])
@pytest.mark.parametrize("placements", [["R", "R"], ["S(0)", "S(1)"], ["S(1)", "S(0)"]])
def test_a_collective_over_a_vmapped_axis_is_a_reduction_over_its_dim(collective, placements):
    """jax.vmap(..., axis_name="i") makes lax.psum / pmax / pmin over "i" a collective over a
    positional axis: no rule (a fallback warning), and pmax / pmin then failed in jax's
    varying-axes check. They are reductions over that dim: one device's values, no warning,
    the plan's collectives those of the compiled program."""
    x = (np.arange(8 * 16, dtype=np.float32).reshape(8, 16) % 11) - 3.0
    fn = jax.vmap(lambda r: r / (collective(r, "i") + 100.0), axis_name="i")
    g = dist.jit(fn)
    xd = dist.shard_tensor(x, MESH24, placements)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        out = g(xd)
    np.testing.assert_allclose(out.numpy(), jax.jit(fn)(x), rtol=1e-6)
    assert g.plan(xd).collective_counts() == count_collectives(g.lower(xd).compile().as_text())


@pytest.mark.parametrize("placements", [["S(2)", "S(2)"], ["S(0)", "S(1)"], ["P(sum)", "S(0)"]])
def test_moves_of_empty_arrays_are_not_listed_as_xla_drops_them(placements):
    """An empty value (a zero-length slice, reshaped) moved to another layout: the plan listed
    0-byte gathers and all-reduces the compiled program does not run (XLA removes collectives
    of empty arrays)."""
    fn = jax.vmap(lambda x: jax.lax.reshape(x[:, :0], (0, 4)), out_axes=-1)
    x = np.ones((8, 4, 8), np.float32)
    xd = dist.shard_tensor(x, MESH24, placements)
    g = dist.jit(fn)
    out = g(xd)
    assert out.shape == (0, 4, 8) and out.numpy().shape == (0, 4, 8)
    assert not g.plan(xd).collectives
    assert not count_collectives(g.lower(xd).compile().as_text())


@pytest.mark.parametrize("pa,pb", [
    ([dist.Shard(1), dist.Shard(0)], [dist.Shard(0), dist.Replicate()]),
    ([dist.Shard(0), dist.Shard(1)], [dist.Replicate(), dist.Shard(0)]),
    ([dist.Shard(0), dist.Replicate()], [dist.Shard(1), dist.Shard(0)]),
])
@pytest.mark.parametrize("batched", [False, True])
def test_an_optimization_barrier_keeps_each_operand_as_it_lies(pa, pb, batched):
    """Operands of one barrier split on the same mesh axis over different dims: one factor
    model over all of them gave the axis to one, and gathered the other before the barrier
    (the plan listed it; XLA dropped it where that result was dead)."""
    def fn(a, b):
        a2, b2 = jax.lax.optimization_barrier((a, b * 2.0))
        return a2 @ b2 + a[0]

    f_ = jax.vmap(fn) if batched else fn
    shape = (4, 8, 8) if batched else (8, 8)
    rng = np.random.default_rng(0)
    a, b = (rng.normal(size=shape).astype(np.float32) for _ in range(2))
    if batched:
        pa, pb = ([dist.Shard(p.dim + 1) if isinstance(p, dist.Shard) else p for p in pl]
                  for pl in (pa, pb))
    A, B = dist.shard_tensor(a, MESH24, pa), dist.shard_tensor(b, MESH24, pb)
    f = dist.jit(f_)
    np.testing.assert_allclose(f(A, B).numpy(), jax.jit(f_)(a, b), rtol=1e-5, atol=1e-5)
    plan = f.plan(A, B)
    # (a barrier operand may still be sliced locally, for free, as its reader wants it)
    assert not [c for c in plan.collectives if "optimization_barrier" in c.consumer], plan
    hlo = count_collectives(f.lower(A, B).compile().as_text())
    assert hlo == Counter(c.kind for c in plan.collectives), plan.collectives


MESH8 = dist.ProcessMesh(list(range(8)), dim_names=["x"])


def test_a_closed_over_dtensor_used_as_an_index_is_named_with_what_to_write():
    """jax converts a DistTensor where jnp reads its operands (`a + t`), but not as an index:
    `dist.jit(lambda w: w[ids])` with the ids closed over failed inside jax's indexing
    ('Triggering __jax_array__() during abstractification'). It is an OperandTypeError naming
    the line and what to write; both ways it suggests equal one device."""
    ids_np = np.array([3, 1, 7, 0, 2, 2, 5, 9], np.int32)
    table = np.arange(32, dtype=np.float32).reshape(16, 2)
    ids = dist.shard_tensor(ids_np, MESH8, [dist.Shard(0)])
    w = dist.shard_tensor(table, MESH8, [dist.Replicate()])
    with pytest.raises(dist.OperandError, match=r"uses, at test_jit\.py:\d+, a DistTensor it "
                                                   r"does not take as an argument.*w\[ids\].*"
                                                   r"jnp\.asarray\(t\)") as info:
        dist.jit(lambda w: w[ids])(w)
    assert isinstance(info.value, TypeError)
    as_argument = dist.jit(lambda w, i: w[i])
    np.testing.assert_array_equal(as_argument(w, ids).numpy(), table[ids_np])
    assert as_argument.plan(w, ids).inputs[1].dims == (("x",),)
    converted = dist.jit(lambda w: w[jnp.asarray(ids)])
    np.testing.assert_array_equal(converted(w).numpy(), table[ids_np])
    assert [L.dims for L in converted.plan(w).inputs] == [((), ()), (("x",),)]  # ids: placed


@pytest.mark.parametrize("ids", [[6], [0, 1]], ids=["one-device", "two-devices"])
def test_a_tensor_closed_over_on_a_mesh_of_one_device_is_an_input_there(ids):
    """Inference on one device (MindSpore's 'a different device count'): a model placed on a
    one-device mesh and closed over, `dist.jit(lambda x: model(x))`, runs there. A jax.Array on
    one device was never hoisted, so the weight stayed a constant and dist.jit found no mesh
    (a MeshMismatchError; found by a probe)."""
    from flax import nnx

    mesh = dist.ProcessMesh(ids, ["x"])
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 8
    w = dist.shard_tensor(np.full((4, 4), 2.0, np.float32), mesh, [dist.Replicate()])
    f = dist.jit(lambda x: x @ w)
    np.testing.assert_allclose(f(x).numpy(), x @ np.full((4, 4), 2.0, np.float32), rtol=1e-6)
    plan = f.plan(x)
    assert plan.mesh == mesh and len(plan.inputs) == 2  # the weight: an input, as stored
    layer = dist.shard_layer(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), mesh)
    got = dist.jit(lambda x: layer(x))(x).numpy()
    want = x @ np.asarray(layer.kernel.get_value().numpy()) + np.asarray(
        layer.bias.get_value().numpy())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_argument_moved_to_a_mesh_sharing_its_devices_stays_valid_when_donated():
    """Read only on a sub-mesh of its own mesh, a donated argument arrives there as a "copy"
    whose blocks on the shared devices are the original's buffers (jax's device_put hands them
    back): donating it deleted the original, which the user still holds (found by a probe)."""
    whole, sub = dist.ProcessMesh(list(range(8)), ["x"]), dist.ProcessMesh([0, 1, 2, 3], ["x"])
    a = np.arange(32, dtype=np.float32).reshape(8, 4)
    b = np.ones((8, 4), np.float32)
    x = dist.shard_tensor(a, whole, [dist.Replicate()])
    f = dist.jit(lambda x, y: dist.reshard(x, sub, [dist.Replicate()]) * 2 + y,
                 donate_argnums=0)
    np.testing.assert_array_equal(f(x, dist.shard_tensor(b, sub, [dist.Replicate()])).numpy(),
                                  a * 2 + b)
    np.testing.assert_array_equal(x.numpy(), a)


@pytest.mark.parametrize("moved", [False, True], ids=["stays", "moves"])
def test_a_function_on_two_meshes_takes_the_donated_buffers_in_its_stages(moved):
    """A function cut into stages on two meshes runs one program per stage; each donated
    argument is donated to the last stage reading it (donate_argnums was dropped silently,
    found by a probe, then warned about): its buffers are gone after the call, the values are
    one device's, and asking for the plans first consumes nothing. An argument the function
    returns, or one read last on another mesh (its moved copy is donated), stays valid. to_static of a model on two
    meshes updates its params in place too."""
    m0, m1 = dist.ProcessMesh([0, 1, 2, 3], ["dp"]), dist.ProcessMesh([4, 5, 6, 7], ["dp"])
    rng = np.random.default_rng(0)
    w0, w1 = (rng.normal(size=s).astype(np.float32) for s in ((16, 16), (16, 8)))

    def place():
        return {"w0": dist.shard_tensor(w0, m0, [dist.Replicate()]),
                "w1": dist.shard_tensor(w1, m1, [dist.Replicate()])}

    def step(p):
        a = p["w0"] * 2
        # a value of the first mesh read on the second: moved there (the copy is donated)
        b = p["w1"] * 2 + (dist.reshard(p["w0"], m1, [dist.Replicate()]).sum() if moved else 0)
        return {"w0": a, "w1": b}

    f = dist.jit(step, donate_argnums=0)
    q = place()
    f.stage_plans(q)  # runs the stages, on copies
    assert not q["w0"].physical.is_deleted()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing about donation
        out = f(q)
    np.testing.assert_allclose(out["w1"].numpy(), w1 * 2 + (w0.sum() if moved else 0), atol=1e-5)
    np.testing.assert_array_equal(out["w0"].numpy(), w0 * 2)
    assert q["w1"].physical.is_deleted()
    # read again on the other mesh after its own stage: the moved copy is donated there
    assert q["w0"].physical.is_deleted() != moved
    with pytest.raises(dist.SignatureError, match="was donated to an earlier call"):
        f(q)
    kept = place()  # returned as it is: not donated
    out = dist.jit(lambda p: (p["w0"], p["w1"] + 1), donate_argnums=0)(kept)
    assert not kept["w0"].physical.is_deleted()
    np.testing.assert_array_equal(out[0].numpy(), w0)

    def model(p, x):
        return dist.reshard(jnp.tanh(x @ p["w0"]), m1, [dist.Shard(0)]) @ p["w1"]

    q = place()
    dm = dist.to_static((model, q), None, lambda o, t: jnp.mean((o - t) ** 2), optax.sgd(0.1))
    x, y = rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(8, 8)).astype(np.float32)
    dm(x, y)
    np.testing.assert_array_equal(q["w0"].numpy(), w0)  # the user's: copied, intact
    own = [dm.params["w0"], dm.params["w1"]]  # the model's own, after a step
    dm(x, y)
    assert all(v.physical.is_deleted() for v in own)

    def loss(p):
        return jnp.mean((jnp.tanh(x @ p["w0"]) @ p["w1"] - y) ** 2)

    ref = {"w0": w0, "w1": w1}
    for _ in range(2):
        ref = jax.tree.map(lambda w, g: w - 0.1 * g, ref, jax.grad(loss)(ref))
    for k, v in ref.items():
        np.testing.assert_allclose(dm.params[k].numpy(), v, rtol=1e-5, atol=1e-6)
