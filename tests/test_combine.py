"""Packed all-gathers (compiler/combine.py): small gathers that are ready together run as one
collective on CPU, where XLA leaves all-gathers apart.

The packed program must be the same computation: values and gradients equal one device and the
program with packing off, the same logical collectives and bytes in the compiled HLO, fewer
all-gather ops; the packing itself (any dtypes, any gathered dim, several mesh axes) returns
exactly what separate gathers return.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autoshard as dist
from autoshard.bench.workloads import keep_placements
from autoshard.compiler import combine
from autoshard.hlo import PACKED_SCOPE, collective_bytes, count_collective_ops, count_collectives
from autoshard.reshard.steps import AllGather

S, R = dist.Shard, dist.Replicate
MESH8 = dist.ProcessMesh(list(range(8)), ["x"])
MESH2x4 = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])


@pytest.mark.parametrize("axes, dims", [
    (("x",), (0, 0, 0, 0)),
    (("x",), (1, 0, 2, 0)),
    (("dp", "mp"), (0, 1, 1, 0)),
    (("mp", "dp"), (0, 0, 1, 0)),
], ids=["1d-dim0", "1d-mixed-dims", "2d-axes", "2d-axes-minor-first"])
def test_a_packed_gather_returns_what_separate_gathers_return(axes, dims):
    jax_mesh = jax.make_mesh((8,), ("x",)) if axes == ("x",) else \
        jax.make_mesh((2, 4), ("dp", "mp"))
    rng = np.random.default_rng(0)
    n = 8
    # float32, int32 and uint32 (one buffer via bitcasts), bfloat16 (a buffer of its own width)
    shapes = [tuple(k * n if i == d else k for i, k in enumerate(base))
              for base, d in zip([(2, 3), (2, 5), (3, 2, 1), (1,)], dims)]
    xs = [rng.normal(size=shapes[0]).astype(np.float32),
          rng.integers(-9, 9, size=shapes[1]).astype(np.int32),
          rng.integers(0, 2 ** 31, size=shapes[2]).astype(np.uint32),
          rng.normal(size=shapes[3]).astype(np.float32)]
    steps = [AllGather(axes, d) for d in dims]

    def spec(d, ndim):
        return P(*[axes if k == d else None for k in range(ndim)])

    specs = tuple(spec(d, x.ndim) for d, x in zip(dims, xs))

    def separate(*blocks):
        return tuple(s.run(b, {}) for s, b in zip(steps, blocks))

    def packed(*blocks):
        return tuple(combine.gather_packed(list(blocks), steps))

    args = [jax.device_put(x, jax.NamedSharding(jax_mesh, sp)) for x, sp in zip(xs, specs)]
    outs = {}
    for name, body in (("separate", separate), ("packed", packed)):
        f = jax.jit(jax.shard_map(body, mesh=jax_mesh, in_specs=specs,
                                  out_specs=tuple(P() for _ in xs)))
        outs[name] = f(*args)
        hlo = f.lower(*args).compile().as_text()
        ops = count_collective_ops(hlo)["all-gather"]
        assert ops == (1 if name == "packed" else len(xs))
        assert count_collectives(hlo)["all-gather"] == len(xs)  # each member counted
    for x, a, b in zip(xs, outs["separate"], outs["packed"]):
        np.testing.assert_array_equal(np.asarray(a), x)
        np.testing.assert_array_equal(np.asarray(b), x)
        assert b.dtype == x.dtype


def test_members_of_other_widths_or_types_get_other_buffers():
    f32 = jnp.zeros((4,), jnp.float32)
    step = AllGather(("x",), 0)
    i32, u32 = jnp.zeros((4,), jnp.int32), jnp.zeros((4,), jnp.uint32)
    assert combine.pack_key(i32, step) == combine.pack_key(u32, step)  # integers: one width
    # a float only with its own dtype: a bitcast would cut its gradient (see below)
    assert combine.pack_key(f32, step) != combine.pack_key(i32, step)
    assert combine.pack_key(f32, step) != combine.pack_key(jnp.zeros((4,), jnp.bfloat16), step)
    assert combine.pack_key(jnp.zeros((4,), jnp.bfloat16), step) != combine.pack_key(
        jnp.zeros((4,), jnp.int16), step)
    assert combine.pack_key(jnp.zeros((4,), bool), step) is None
    assert combine.pack_key(jax.random.key(0), step) is None
    # vectors apart from matrices (see combine.pack_key)
    assert combine.pack_key(f32, step) != combine.pack_key(jnp.zeros((4, 4)), step)
    assert combine.pack_key(f32, step) == combine.pack_key(jnp.zeros((1, 4)), step)


@pytest.mark.parametrize("keys", ["int32", "float32"])
def test_gradients_taken_outside_flow_through_packed_gathers(keys):
    # A sort along the split dim gathers its keys and values together; with jax.grad outside
    # dist.jit the partitioned program itself is differentiated. Packed with int32 keys
    # through a bitcast, the float values' gradient was zero; float keys share the values'
    # buffer (one packed gather) and pass gradients to both.
    rng = np.random.default_rng(0)
    k = rng.permutation(64).reshape(16, 4).astype(keys)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    w = np.cos(np.arange(64, dtype=np.float32)).reshape(16, 4)

    def f(k, x):
        sk, sx = lax.sort((k, x), dimension=0, num_keys=1)
        return jnp.sum(sx * w) + (jnp.sum(sk * w) if keys == "float32" else 0.0)

    g = dist.jit(f)
    dk, dx = dist.shard_tensor(k, MESH8, [S(0)]), dist.shard_tensor(x, MESH8, [S(0)])
    argnums = (0, 1) if keys == "float32" else (1,)
    got = jax.grad(lambda a, b: g(a, b), argnums=argnums)(dk, dx)
    want = jax.grad(f, argnums=argnums)(k, x)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6)
    hlo = g.lower(dk, dx).compile().as_text()
    assert (PACKED_SCOPE in hlo) == (keys == "float32")


@pytest.mark.parametrize("stopped_first", [False, True], ids=["live-first", "stopped-first"])
def test_a_stopped_copy_gathered_beside_its_operand_keeps_the_gradient_stopped(stopped_first,
                                                                             monkeypatch):
    # A sort along the split dim gathers what it sorts. `a` and stop_gradient(a) are one
    # buffer, gathered once (the plan lists one gather; XLA's CSE would merge two); packed with
    # the gather of `c`, the stopped value was handed the live value's packed copy, and
    # jax.grad taken outside dist.jit flowed back through it into `w` (4.0 off).
    w = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    ramp = np.arange(16, dtype=np.float32)[:, None]

    def f(w):
        a = jnp.sin(w) * 2.0
        b = lax.stop_gradient(a)
        c = jnp.cos(w)
        terms = [jnp.sum(jnp.sort(a, axis=0) * ramp), jnp.sum(jnp.sort(b, axis=0) ** 2)]
        if stopped_first:
            terms.reverse()
        return terms[0] + terms[1] + jnp.sum(jnp.sort(c, axis=0) ** 3)

    packed = []
    run_packed = combine.run_packed
    monkeypatch.setattr(combine, "run_packed",
                        lambda members, replay: packed.append(len(members))
                        or run_packed(members, replay))
    g = dist.jit(f)
    dw = dist.shard_tensor(w, MESH8, [S(0)])
    value, grad = jax.value_and_grad(g)(dw)
    want_value, want_grad = jax.value_and_grad(f)(w)
    np.testing.assert_allclose(np.asarray(value), want_value, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-5)
    assert packed == [2]  # (the case: `a` or its stopped copy packed with `c`, once)
    # the program as planned: one gather of `a` for both sorts, packed with `c`'s
    assert [c.kind for c in g.plan(dw).collectives] == ["all-gather"] * 2
    hlo = g.lower(dw).compile().as_text()
    assert PACKED_SCOPE in hlo and count_collectives(hlo) == {"all-gather": 2}


def _fsdp_mlp(layers: int, d: int, remat: bool = True):
    """A ZeRO-3 / FSDP step: every weight, bias and scale split over all devices, the batch
    too; each layer's parameters are gathered where they are used (checkpointed layers: again
    in the backward)."""
    rng = np.random.default_rng(1)
    params = {}
    for i in range(layers):
        params[f"w{i}"] = (rng.normal(size=(d, 2 * d)) / np.sqrt(d)).astype(np.float32)
        params[f"b{i}"] = (rng.normal(size=(2 * d,)) * 0.1).astype(np.float32)
        params[f"v{i}"] = (rng.normal(size=(2 * d, d)) / np.sqrt(2 * d)).astype(np.float32)
        params[f"g{i}"] = (1 + rng.normal(size=(d,)) * 0.1).astype(np.float32)
    x = rng.normal(size=(32, d)).astype(np.float32)

    def layer(h, w, b, v, g):
        return h + (jax.nn.gelu(h @ w + b) @ v) * g

    def loss(p, x):
        h = x
        for i in range(layers):
            f = jax.checkpoint(layer) if remat else layer
            h = f(h, p[f"w{i}"], p[f"b{i}"], p[f"v{i}"], p[f"g{i}"])
        return jnp.mean(h ** 2)

    return jax.value_and_grad(loss), params, x


def _run(step, params, x, mesh, placements, enabled, monkeypatch):
    monkeypatch.setattr(combine, "ENABLED", enabled)
    dp = {k: dist.shard_tensor(v, mesh, placements) for k, v in params.items()}
    dx = dist.shard_tensor(x, mesh, placements)
    f = dist.jit(step, out_placements=keep_placements([R()] * mesh.ndim, dp))
    value, grads = f(dp, dx)
    compiled = f.lower(dp, dx).compile()
    return value.numpy(), {k: g.numpy() for k, g in grads.items()}, compiled


@pytest.mark.parametrize("mesh, placements", [(MESH8, [S(0)]), (MESH2x4, [S(0), S(0)])],
                         ids=["8", "2x4-flattened"])
@pytest.mark.parametrize("remat", [True, False], ids=["checkpointed", "plain"])
def test_a_zero3_step_gathers_each_layer_in_one_op(mesh, placements, remat, monkeypatch):
    layers = 3
    step, params, x = _fsdp_mlp(layers, d=32, remat=remat)
    ref_value, ref_grads = jax.jit(step)(params, x)
    value, grads, on = _run(step, params, x, mesh, placements, True, monkeypatch)
    value0, grads0, off = _run(step, params, x, mesh, placements, False, monkeypatch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(value, value0, rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(grads[k], grads0[k], rtol=1e-5, atol=1e-7)
    hlo, hlo0 = on.as_text(), off.as_text()
    # the same logical collectives and bytes: only how many times the devices meet changes
    assert count_collectives(hlo) == count_collectives(hlo0)
    assert collective_bytes(hlo) == collective_bytes(hlo0)
    gathers, gathers0 = (count_collective_ops(h)["all-gather"] for h in (hlo, hlo0))
    assert PACKED_SCOPE not in hlo0
    if remat:  # every parameter gathered in the forward and again in the backward
        assert gathers0 == count_collectives(hlo0)["all-gather"] >= 2 * 4 * layers
        # each layer's two matrices in one op, forward and backward (its vectors are broadcast
        # to rows just before their gathers: not ready together)
        assert gathers <= gathers0 - 2 * layers and PACKED_SCOPE in hlo
    else:  # the backward reuses the forward's gathered weights: those are left apart
        assert gathers0 == count_collectives(hlo0)["all-gather"] >= 4 * layers
        assert gathers <= gathers0
    # unpacking costs no more memory than a packed group's bytes, held for a moment twice
    assert (on.memory_analysis().temp_size_in_bytes
            <= off.memory_analysis().temp_size_in_bytes + combine.PACK_BYTES)


def test_gathers_over_the_byte_budget_run_apart(monkeypatch):
    step, params, x = _fsdp_mlp(layers=2, d=32)
    matrix = 32 * 64 * 4  # one weight gathered
    ops = {}
    for budget in (matrix, 2 * matrix):
        monkeypatch.setattr(combine, "PACK_BYTES", budget)
        value, _, compiled = _run(step, params, x, MESH8, [S(0)], True, monkeypatch)
        np.testing.assert_allclose(value, jax.jit(step)(params, x)[0], rtol=1e-5)
        hlo = compiled.as_text()
        ops[budget] = count_collective_ops(hlo)["all-gather"]
        for line in hlo.splitlines():
            if " all-gather(" in line and PACKED_SCOPE in line:
                rows, cols = map(int, re.search(r"= f32\[(\d+),(\d+)\]", line).groups())
                assert rows * cols * 4 <= budget, line
    # one matrix: nothing fits beside it; two: a layer's pair shares one gather
    assert ops[matrix] == count_collectives(hlo)["all-gather"] > ops[2 * matrix]


def test_packing_looks_only_window_equations_ahead(monkeypatch):
    """A gather is packed only with those needed within WINDOW equations: a deep model does
    not gather every layer's parameters at the first layer."""
    step, params, x = _fsdp_mlp(layers=8, d=16)
    monkeypatch.setattr(combine, "WINDOW", 4)
    _, _, near = _run(step, params, x, MESH8, [S(0)], True, monkeypatch)
    monkeypatch.setattr(combine, "WINDOW", 64)
    _, _, far = _run(step, params, x, MESH8, [S(0)], True, monkeypatch)
    ops = [count_collective_ops(c.as_text())["all-gather"] for c in (near, far)]
    assert ops[0] > ops[1] > 1
