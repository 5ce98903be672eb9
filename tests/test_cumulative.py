"""Scans and arg-reductions over a sharded axis combine shard totals instead of gathering."""
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import autoshard as dist
from autoshard.hlo import count_collectives

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
X = (np.arange(16 * 32, dtype=np.float32).reshape(16, 32) % 7 - 3) / 4


@pytest.mark.parametrize("fn", [
    lambda x: jnp.cumsum(x, axis=1), lambda x: lax.cumsum(x, axis=1, reverse=True),
    lambda x: lax.cummax(x, axis=1), lambda x: lax.cumlogsumexp(x, axis=1),
    lambda x: jnp.argmax(x, axis=1), lambda x: jnp.argmin(x, axis=1),
], ids=["cumsum", "cumsum-reverse", "cummax", "cumlogsumexp", "argmax", "argmin"])
def test_sharded_axis_is_combined_not_gathered(fn):
    x = dist.shard_tensor(X, MESH, [dist.Shard(0), dist.Shard(1)])
    f = dist.jit(fn)
    np.testing.assert_allclose(f(x).numpy(), np.asarray(jax.jit(fn)(X)), rtol=1e-5, atol=1e-5)
    plan = f.plan(x)
    local_rows, full_axis = 16 // 2, 32
    for c in plan.collectives:  # only shard totals / candidates travel, never the whole axis
        assert c.bytes_per_device < local_rows * full_axis * 4, str(c)
    assert count_collectives(f.lower(x).compile().as_text()) == Counter(c.kind for c in plan.collectives)


def test_sort_keeps_the_other_dims_sharded():
    x = dist.shard_tensor(X, MESH, [dist.Shard(0), dist.Shard(1)])
    f = dist.jit(lambda x: jnp.sort(x, axis=1), out_placements="keep")
    out = f(x)
    np.testing.assert_array_equal(out.numpy(), np.sort(X, axis=1))
    assert out.placements[0] == dist.Shard(0)  # rows stay split over dp
