"""Outlined blocks: a repeated block of equations is lowered once and called, and the compiled
program is the same program.

Partition emits one jitted call per repetition of a block (compiler/outline.py); XLA inlines the
calls. These tests compile each program with outlining on and off and require the same
collectives (kind, count, bytes) in the compiled HLO and results equal to the bit, on the GPT
step (dropout, vocab-parallel embedding, adam) written unrolled, scanned and rematerialised,
and on blocks that share reshard copies with the code around them.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard as dist
from autoshard.bench import gpt
from autoshard.compiler import outline, partition, replay
from autoshard.hlo import collective_bytes, count_collectives

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
R, S = dist.Replicate(), dist.Shard


def _compiled(step, args, enabled: bool, monkeypatch):
    monkeypatch.setattr(outline, "ENABLED", enabled)
    f = dist.jit(step)
    entry, leaves = f._entry(args, {})
    inputs = f._physical_inputs(entry, leaves)
    dispatched = []

    class Counted(partition._BlockCall):
        def __init__(self, jitted):
            super().__init__(lambda *a: dispatched.append(a) or jitted(*a))

    monkeypatch.setattr(partition, "_BlockCall", Counted)
    replay.clear_shared()  # blocks lowered by earlier programs would be replayed, not dispatched
    traced = entry.fn.trace(*inputs)
    body = traced.jaxpr.jaxpr.eqns[0].params["jaxpr"]  # the shard_map's local program
    blocks = [e for e in body.eqns
              if e.primitive.name == "jit" and e.params["name"].startswith("block")]
    calls = len(blocks)
    # each block function is dispatched through jax once; its later calls re-emit the recorded
    # call equation — also when a literal operand differs (dropout's per-layer fold_in index)
    assert len(dispatched) == len({id(e.params["jaxpr"]) for e in blocks})
    compiled = traced.lower().compile()
    return compiled.as_text(), jax.tree.leaves(compiled(*inputs)), len(body.eqns), calls


def _assert_same_program(step, args, monkeypatch) -> tuple[int, int, int]:
    hlo, outs, eqns, calls = _compiled(step, args, True, monkeypatch)
    hlo0, outs0, eqns0, calls0 = _compiled(step, args, False, monkeypatch)
    assert calls0 == 0
    assert count_collectives(hlo) == count_collectives(hlo0)
    assert collective_bytes(hlo) == collective_bytes(hlo0)
    assert len(outs) == len(outs0)
    for a, b in zip(outs, outs0):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return calls, eqns, eqns0


@pytest.mark.parametrize("form", ["unrolled", "scan", "remat"])
def test_outlined_gpt_step_is_the_inline_program(form, monkeypatch):
    step, _, args = gpt.workload(MESH, 3, form, optax.adam(1e-3))
    calls, eqns, eqns0 = _assert_same_program(step, args, monkeypatch)
    if form == "unrolled":  # the layers (forward and backward) and adam's per-leaf updates
        assert calls >= 8 and eqns < eqns0 * 2 // 3


def test_outlined_step_equals_one_device():
    step, single, args = gpt.workload(MESH, 3, "unrolled", optax.sgd(0.1))
    got = jax.tree.leaves(dist.jit(step)(*args), is_leaf=lambda x: isinstance(x, dist.DistTensor))
    want = jax.tree.leaves(jax.jit(step)(*single))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g.numpy() if hasattr(g, "numpy") else g),
                                   np.asarray(w), rtol=2e-5, atol=2e-6)


def test_reshard_copies_are_shared_across_blocks(monkeypatch):
    """W is split where every layer needs it whole: it is gathered once, before or in the first
    block, and every later block gets that copy passed in (not gathered again)."""
    mesh = dist.ProcessMesh(list(range(8)), ["x"])

    def f(x, w, b):
        for _ in range(4):
            h = jnp.tanh(x @ w + b)
            h = h * jax.nn.sigmoid(h)
            h = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
            x = h + x
        return x

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 32)).astype(np.float32)
    w = (rng.normal(size=(32, 32)) * 0.1).astype(np.float32)
    b = rng.normal(size=(32,)).astype(np.float32)
    args = (dist.shard_tensor(x, mesh, [S(0)]), dist.shard_tensor(w, mesh, [S(0)]),
            dist.shard_tensor(b, mesh, [R]))
    calls, _, _ = _assert_same_program(f, args, monkeypatch)
    assert calls >= 3
    hlo, outs, _, _ = _compiled(f, args, True, monkeypatch)
    assert count_collectives(hlo)["all-gather"] == 1
    np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(jax.jit(f)(x, w, b)),
                               rtol=1e-5, atol=1e-6)


def _alternating(x, w):
    # layers the plan decides once (equal rule signatures: sin and cos are both elementwise)
    # but that are not one block: outlining the first for all would compute sin everywhere
    for act in [jnp.sin, jnp.cos, jnp.sin, jnp.cos]:
        m = x.mean(-1, keepdims=True)
        h = (x - m) / jnp.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)
        x = x + act(h @ w) @ w.T
    return (x ** 2).sum()


def _cummax_gradient(x, w):  # jax's cummax derivative: like blocks of slices at other offsets
    return jnp.sum(jnp.sin(jax.lax.cummax(x, axis=1)) * w)


@pytest.mark.parametrize("fn,placements", [
    (jax.grad(_alternating, (0, 1)), ([S(0), R], [R, S(1)])),
    (jax.grad(_cummax_gradient), ([R, R], [R, R])),
], ids=["sin-cos layers", "cummax"])
def test_blocks_planned_alike_are_outlined_only_where_their_equations_are_equal(fn, placements):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(16, 32)) * 0.1).astype(np.float32)
    w = (rng.normal(size=(32, 64)) * 0.1).astype(np.float32)
    if fn.__name__ == "_cummax_gradient":
        x, w = x[:2, :3] * 5, rng.normal(size=(2, 3)).astype(np.float32)
    args = [dist.shard_tensor(a, MESH, p) for a, p in zip((x, w), placements)]
    got = jax.tree.leaves(dist.jit(fn)(*args), is_leaf=lambda t: isinstance(t, dist.DistTensor))
    for g, want in zip(got, jax.tree.leaves(jax.jit(fn)(x, w))):
        np.testing.assert_allclose(g.numpy(), np.asarray(want), rtol=1e-3, atol=1e-4)


def test_a_two_layer_models_layers_are_outlined_though_not_back_to_back(monkeypatch):
    """The first layer also computes what both read (the causal mask: jax's CSE makes it once),
    so the second layer's forward is no back-to-back repeat of the first; its stretches equal
    to the first's (attention, MLP) are still called, not emitted again — the same program."""
    step, single, args = gpt.workload(MESH, 2, "unrolled", optax.sgd(0.1))
    found = []

    def spy(*a, **k):
        found.append(_find_instances(*a, **k))
        return found[-1]

    monkeypatch.setattr(outline, "find_instances", spy)
    calls, eqns, eqns0 = _assert_same_program(step, args, monkeypatch)
    blocks = found[0]
    apart = [(a.start, b.start) for a in blocks.values() for b in blocks.values()
             if a.signature == b.signature and a.stop < b.start
             and not any(c.signature == a.signature and a.stop <= c.start < b.start
                         for c in blocks.values())]
    assert apart, "no equal blocks with other equations between were outlined"
    assert calls == len(blocks) and eqns < eqns0
    got = jax.tree.leaves(dist.jit(step)(*args), is_leaf=lambda x: isinstance(x, dist.DistTensor))
    for g, w in zip(got, jax.tree.leaves(jax.jit(step)(*single))):
        np.testing.assert_allclose(np.asarray(g.numpy() if hasattr(g, "numpy") else g),
                                   np.asarray(w), rtol=2e-5, atol=2e-6)


_find_instances = outline.find_instances
