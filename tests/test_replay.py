"""Replayed lowerings: the partitioned program is the same program, only built faster.

Partition lowers each distinct equation once and re-emits what it emitted for every later
equal one (compiler/replay.py). These tests build the local program with replay on and off and
require the two jaxprs to be identical, equation for equation, on models whose layers repeat
(unrolled, scanned, rematerialised GPT steps with dropout and vocab-parallel embedding).
"""
import jax
import numpy as np
import optax
import pytest

import autoshard as dist
from autoshard.bench import gpt
from autoshard.compiler import outline, replay

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
    step, _, args = gpt.workload(MESH, 3, "unrolled", optax.sgd(0.1))
    bound = {}
    for outlined in (False, True):
        monkeypatch.setattr(outline, "ENABLED", outlined)
        before = replay.STATS["bound"]
        program = _local_program(step, args)
        bound[outlined] = replay.STATS["bound"] - before
    assert "name=block" in program  # the layers were outlined
    assert bound[True] <= 1.05 * bound[False], bound
