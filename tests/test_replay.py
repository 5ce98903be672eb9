"""Replayed lowerings: the partitioned program is the same program, only built faster.

Partition lowers each distinct equation once and re-emits what it emitted for every later
equal one (compiler/replay.py). These tests build the local program with replay on and off and
require the two jaxprs to be identical, equation for equation, on models whose layers repeat
(unrolled, scanned, rematerialised GPT steps with dropout and vocab-parallel embedding).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard as dist
from autoshard.bench import gpt
from autoshard.compiler import outline, partition, replay

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])


def _local_program(step, args) -> str:
    f = dist.jit(step)
    entry, leaves = f._entry(args, {})
    return str(entry.fn.trace(*f._physical_inputs(entry, leaves)).jaxpr)


@pytest.mark.parametrize("outlined", [False, True], ids=["inline", "outlined"])
@pytest.mark.parametrize("form", ["unrolled", "scan", "remat"])
def test_replayed_program_is_the_bound_program(form, outlined, monkeypatch):
    # inline: every equation emitted at the top level; outlined: repeated blocks are jitted
    # calls, whose traces replay what the top level (or an earlier block) recorded
    monkeypatch.setattr(outline, "ENABLED", outlined)
    step, _, args = gpt.workload(MESH, 3, form, optax.adam(1e-3))
    before = dict(replay.STATS)
    replayed = _local_program(step, args)
    assert replay.STATS["replayed"] > before["replayed"]  # the layers were replayed
    if form == "unrolled" and not outlined:  # most equations: every layer after the first
        assert replay.STATS["replayed"] - before["replayed"] > replay.STATS["bound"] - before["bound"]
    monkeypatch.setattr(replay, "ENABLED", False)
    before = dict(replay.STATS)
    bound = _local_program(step, args)
    assert replay.STATS["replayed"] == before["replayed"]
    assert replayed == bound


def test_replay_keeps_aliased_operands_apart():
    """x*x and x*y are different lowerings even with equal operand types. (Literal operands
    are keyed by value; the program comparison above fails without that.)"""
    def f(x, y):
        a = x * x
        b = x * y
        c = a * 2.0
        d = b * 3.0
        return a, b, c, d

    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 7
    y = np.flip(x, 1).copy()
    dx = dist.shard_tensor(x, MESH, [dist.Shard(0), dist.Shard(1)])
    dy = dist.shard_tensor(y, MESH, [dist.Shard(0), dist.Shard(1)])
    got = dist.jit(f)(dx, dy)
    for g, w in zip(got, jax.jit(f)(x, y)):
        np.testing.assert_array_equal(g.numpy(), np.asarray(w))


def test_outlined_blocks_replay_what_other_traces_recorded(monkeypatch):
    """A lowering recorded in one trace is emitted into the traces of outlined blocks too: the
    program binds about as many equations with its layers outlined as with them inline (each
    block's trace used to bind its equations afresh: 266 against 171 on this model)."""
    monkeypatch.setattr(replay, "SHARED", False)  # each program lowers its own
    step, _, args = gpt.workload(MESH, 3, "unrolled", optax.sgd(0.1))
    bound = {}
    for outlined in (False, True):
        monkeypatch.setattr(outline, "ENABLED", outlined)
        before = replay.STATS["bound"]
        program = _local_program(step, args)
        bound[outlined] = replay.STATS["bound"] - before
    assert "name=block" in program  # the layers were outlined
    assert bound[True] <= 1.05 * bound[False], bound


def test_a_second_program_replays_the_first_ones_lowerings():
    """Lowerings are kept across programs: a fresh dist.jit of the same step lowers (almost)
    nothing again — its outlined blocks' calls are replayed too — and is the program lowered
    afresh."""
    step, _, args = gpt.workload(MESH, 2, "unrolled", optax.sgd(0.1))
    replay.clear_shared()
    before = replay.STATS["bound"]
    cold = _local_program(step, args)
    cold_bound = replay.STATS["bound"] - before
    before = replay.STATS["bound"]
    warm = _local_program(step, args)
    # nothing is bound again: the cross-entropy's max over the vocab shards is plain
    # equations in a program called at the top level (steps.DIFFERENTIABLE)
    assert replay.STATS["bound"] == before, (cold_bound, replay.STATS)
    assert "custom_jvp_call" not in warm
    assert "name=block" in warm
    assert warm == cold


def test_a_straight_run_of_equations_is_replayed_as_one(monkeypatch):
    """The equations between reshards and outlined blocks are replayed as one run in a later
    program (partition.STRAIGHT): a few replays stand for hundreds of equations, and the
    program is the one replayed equation by equation."""
    step, _, args = gpt.workload(MESH, 2, "unrolled", optax.sgd(0.1))
    _local_program(step, args)  # recorded
    programs, replayed = {}, {}
    for straight in (False, True):
        monkeypatch.setattr(partition, "STRAIGHT", straight)
        before = replay.STATS["replayed"]
        programs[straight] = _local_program(step, args)
        replayed[straight] = replay.STATS["replayed"] - before
    assert programs[True] == programs[False]
    assert replayed[True] < 0.4 * replayed[False], replayed


def _stacked(x, w):
    for _ in range(3):
        x = x @ w
        for _ in range(5):
            x = jnp.tanh(x) * 0.5 + jnp.cos(x)
    return x


def _prefixed(x, w, v):
    for _ in range(3):
        for _ in range(5):
            x = jnp.sin(x * v) + 1.0 - jnp.exp(x)
    return _stacked(x, w)


def test_a_block_from_another_program_is_named_as_this_one_numbers_it(monkeypatch):
    """An outlined block is shared with any program that has the same block by value; there
    it may be another block number (here the second repeated block where it was the first).
    Its calls take this program's name for it: the program is the one lowered afresh, and its
    values equal one device."""
    x = np.linspace(-1, 1, 8 * 16, dtype=np.float32).reshape(8, 16)
    w = np.linspace(-0.3, 0.3, 16 * 16, dtype=np.float32).reshape(16, 16)
    v = np.cos(x)
    dx = dist.shard_tensor(x, MESH, [dist.Shard(0), dist.Replicate()])
    dw = dist.shard_tensor(w, MESH, [dist.Replicate(), dist.Shard(1)])
    dv = dist.shard_tensor(v, MESH, [dist.Shard(0), dist.Replicate()])
    replay.clear_shared()
    first = _local_program(_stacked, (dx, dw))
    before = replay.STATS["bound"]
    shared = _local_program(_prefixed, (dx, dw, dv))
    shared_bound = replay.STATS["bound"] - before
    replay.clear_shared()
    before = replay.STATS["bound"]
    fresh = _local_program(_prefixed, (dx, dw, dv))
    assert shared_bound < replay.STATS["bound"] - before  # the layers' block came from `first`
    assert "name=block0" in first and "name=block1" in fresh
    assert shared == fresh
    got = dist.jit(_prefixed)(dx, dw, dv)
    np.testing.assert_allclose(got.numpy(), np.asarray(jax.jit(_prefixed)(x, w, v)),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("order", [(2, 4), (4, 2)])
def test_shared_lowerings_are_kept_apart_per_mesh(order):
    """An iota split over a mesh axis has no operands: its lowering depends on the axis's size
    alone (the local block is n / size long); a lowering is kept under the mesh it was made
    for. Values equal one device on meshes of either size, in either order."""
    def f(x):
        return x * jnp.arange(16, dtype=jnp.float32)[:, None] + 1.0

    x = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
    for n in order:
        mesh = dist.ProcessMesh(list(range(n)), ["x"])
        out = dist.jit(f)(dist.shard_tensor(x, mesh, [dist.Shard(0)]))
        assert out.placements == [dist.Shard(0)]
        np.testing.assert_array_equal(out.numpy(), np.asarray(f(x)))


def test_a_rule_registered_again_is_lowered_anew():
    """Registering a rule for a primitive again drops what was lowered with the old one."""
    from jax.extend import core as jex_core

    from autoshard.compiler.factors import einsum

    p = jex_core.Primitive("replay_scaled")
    p.def_abstract_eval(lambda a: a)
    rule = lambda ins, outs, **params: einsum("ij->ij", [ins[0].shape], [outs[0].shape])  # noqa: E731
    xs = dist.shard_tensor(np.ones((8, 4), np.float32), MESH, [dist.Shard(0), dist.Replicate()])
    for factor in (2.0, 3.0, 2.0):
        dist.register_rule(p, rule, lambda ctx, x, factor=factor, **params: [x * factor])
        out = dist.jit(lambda a: p.bind(a))(xs)
        np.testing.assert_array_equal(out.numpy(), np.full((8, 4), factor))


def _norm_layer(x, w, a, b):
    h = jnp.tanh(x @ w)
    h = h * jax.nn.sigmoid(h @ a)
    m = h.mean(-1, keepdims=True)
    h = (h - m) / jnp.sqrt(((h - m) ** 2).mean(-1, keepdims=True) + 1e-5)
    return x + (h @ b) * 0.5


def _four_layers(read_after: bool):
    """Four equal layers sharing `w`; `read_after`: the second layer's `a` is read again
    after them (its gathered copy lives on, so that layer's gathers are not packed)."""
    def f(x, w, *ab):
        for i in range(4):
            x = _norm_layer(x, w, ab[i], ab[4 + i])
        return x, x @ (ab[1] if read_after else w)
    return f


def test_a_block_is_shared_only_with_the_facts_of_the_instance_traced(monkeypatch):
    """The first layer gathers `w` and hands it on: the later layers are the same block called
    from another reshard state, traced at the second layer. Whether that layer's gathered
    weight is read after the block decides its packing, so a program that reads it and one
    that does not have different blocks: the second program built after the first is the one
    it is alone (it used to replay the first's block, with one all-gather more per layer)."""
    from autoshard.hlo import count_collective_ops

    mesh = dist.ProcessMesh(list(range(8)), ["x"])
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(16, 32)).astype(np.float32)] + [
        (rng.normal(size=(32, 32)) * 0.2).astype(np.float32) for _ in range(9)]
    args = [dist.shard_tensor(a, mesh, [dist.Shard(0)]) for a in arrays]

    def build(f):
        g = dist.jit(f)
        entry, leaves = g._entry(args, {})
        traced = entry.fn.trace(*g._physical_inputs(entry, leaves))
        return str(traced.jaxpr), count_collective_ops(traced.lower().compile().as_text())

    monkeypatch.setattr(replay, "SHARED", False)
    alone = build(_four_layers(False))
    monkeypatch.setattr(replay, "SHARED", True)
    replay.clear_shared()
    build(_four_layers(True))
    after = build(_four_layers(False))
    assert "name=block" in after[0]
    assert after == alone
    got = dist.jit(_four_layers(False))(*args)
    want = jax.jit(_four_layers(False))(*arrays)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), np.asarray(w), rtol=2e-5, atol=2e-5)
