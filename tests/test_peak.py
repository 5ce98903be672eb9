"""peak.py: a plan's peak bytes per device, the measure that keeps a remade plan (remake.py)
from holding whole what the first plan kept split."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import autoshard as dist
from autoshard.compiler.peak import peak_bytes

S, R = dist.Shard, dist.Replicate
LINE = dist.ProcessMesh(list(range(8)), dim_names=["x"])
MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])


@pytest.mark.parametrize("mesh,placements,block", [
    (LINE, [S(0)], 8 * 32 * 4), (LINE, [R()], 64 * 32 * 4), (LINE, [S(1)], 64 * 4 * 4),
    (MESH, [S(0), S(1)], 32 * 8 * 4), (MESH, [R(), S(0)], 16 * 32 * 4)],
    ids=["rows", "replicated", "columns", "2x4", "2x4 mp"])
def test_peak_holds_two_blocks_of_an_elementwise_chain(mesh, placements, block):
    # mul, tanh, add, sum: each step reads the one before and frees it after, so at most two
    # blocks are live at once (plus the two scalar constants, 4 bytes each, held from the
    # start to their readers)
    x = np.ones((64, 32), np.float32)
    plan = dist.jit(lambda x: jnp.sum(jnp.tanh(x * 2) + 1)).plan(
        dist.shard_tensor(x, mesh, placements))
    assert peak_bytes(plan) == 2 * block + 8


def test_a_value_read_later_is_held_until_then():
    # x is read again by the add: it stays live beside x * 2 and its tanh (the constant 2 is
    # freed after the mul)
    x = np.ones((64, 32), np.float32)
    plan = dist.jit(lambda x: jnp.sum(jnp.tanh(x * 2) + x)).plan(
        dist.shard_tensor(x, LINE, [S(0)]))
    assert peak_bytes(plan) == 3 * 1024
