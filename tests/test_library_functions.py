"""Library functions users call on sharded arrays (jax.numpy, jax.nn, jax.random, optax), each
against one device on a 2-d and a 3-d mesh: values equal, no primitive runs replicated, and
the compiled program runs exactly the collectives the plan lists.

These compose many primitives (sorts, scatters, cumulative sums, loops, FFTs) in the forms jax
emits for them; the rule validator covers the primitives one at a time.
"""
from __future__ import annotations

import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard as dist
from autoshard.hlo import count_collectives

S, R = dist.Shard, dist.Replicate
MESH2 = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
MESH3 = dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["a", "b", "c"])

RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 16, 32)).astype(np.float32)
W = (RNG.normal(size=(32, 64)) * 0.1).astype(np.float32)
IDS = RNG.integers(0, 16, size=(8, 16)).astype(np.int32)
KEY = jax.random.key(0)


def _clip_by_global_norm(w, x):
    grads = {"w": jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)}
    return optax.clip_by_global_norm(1e-3).update(grads, None)[0]["w"]


def _complex_extremes(z):
    return jnp.max(z, axis=(0, 1)) + jnp.min(z, axis=1).sum(0)


@jax.custom_batching.custom_vmap
def _doubled_sine(x):
    return jnp.sin(x) * 2.0


@_doubled_sine.def_vmap
def _doubled_sine_vmap(axis_size, in_batched, x):
    return jnp.sin(x) * 2.0, in_batched[0]


_row_cumsum = jax.custom_batching.sequential_vmap(lambda r: jnp.cumsum(r, axis=-1))


# name -> (function, its array arguments); the placements of each argument are per mesh below
FUNCTIONS = {
    "segment_sum": (lambda x, i: jax.ops.segment_sum(x.reshape(128, 32), i.reshape(128),
                                                     num_segments=16), (X, IDS)),
    "searchsorted": (lambda x: jnp.searchsorted(jnp.sort(x[0, :, 0]), x[:, :, 1].reshape(-1)),
                     (X,)),
    "unique with size": (lambda i: jnp.unique(i, size=16, fill_value=-1), (IDS,)),
    "clip_by_global_norm": (_clip_by_global_norm, (W, X)),
    "random.categorical": (lambda x: jax.random.categorical(KEY, x, axis=-1), (X,)),
    "histogram": (lambda x: jnp.histogram(x, bins=8, range=(-2, 2))[0], (X,)),
    "linalg.norm": (lambda x: jnp.linalg.norm(x, axis=-1), (X,)),
    "pad reflect": (lambda x: jnp.pad(x, ((0, 0), (2, 2), (0, 0)), mode="reflect"), (X,)),
    # a bitcast changing the width adds / drops a trailing dim of bytes: the rest stays split
    "bitcast to bytes and back": (lambda x: jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(x, jnp.uint8)[..., ::-1], jnp.float32), (X,)),
    "bitcast to half width": (lambda x: jax.lax.bitcast_convert_type(x, jnp.bfloat16)[..., 1]
                              .astype(jnp.float32), (X,)),
    # the rule's gather of each device's best indices makes a result nothing reads here
    "top_k values only": (lambda x: jax.lax.top_k(jnp.swapaxes(x, 1, 2), 3)[0], (X,)),
    # a slice of one concatenated part is a slice of that part, as XLA folds it: jnp.partition
    # slices away the top_k of the larger side
    "partition": (lambda x: jnp.partition(x, 3, axis=-1)[..., 3], (X,)),
    "slice of one concatenated part": (lambda x: jnp.concatenate([x, x * 2], axis=2)[..., 40:48],
                                       (X,)),
    # statistics jnp.pad computes for the dims it pads by nothing feed empty arrays: dead, as
    # XLA finds (the plan listed their collectives)
    "pad median": (lambda x: jnp.pad(x, ((0, 0), (0, 0), (2, 2)), mode="median"), (X,)),
    "pad minimum stat_length": (lambda x: jnp.pad(x, ((0, 0), (0, 0), (2, 2)), mode="minimum",
                                                  stat_length=3), (X,)),
    "interp": (lambda x: jnp.interp(x, jnp.linspace(-3, 3, 7), jnp.arange(7.0)), (X,)),
    "diff": (lambda x: jnp.diff(x, axis=1), (X,)),
    "convolve rows": (lambda x: jax.vmap(lambda r: jnp.convolve(r, jnp.ones(3)))(x[:, :, 0]),
                      (X,)),
    "var ddof=1": (lambda x: jnp.var(x, axis=(0, 1), ddof=1), (X,)),
    "median": (lambda x: jnp.median(x, axis=1), (X,)),
    "logsumexp where": (lambda x: jax.nn.logsumexp(x, axis=-1, where=x > 0), (X,)),
    # XLA has no cross-device max of complex numbers: reduced whole
    "complex max and min": (lambda x: _complex_extremes(jax.lax.complex(x[..., :16], x[..., 16:])),
                            (X,)),
    # a custom_vmap function met unbatched, and one sequential_vmap runs in a loop per row:
    # their plain bodies, partitioned by their equations' rules
    "custom_vmap unbatched": (lambda x: _doubled_sine(x) @ jnp.ones((32, 4)), (X,)),
    "sequential_vmap": (lambda x: jax.vmap(_row_cumsum)(x), (X,)),
    # lax.composite: its decomposition
    "composite": (lambda x: jax.lax.composite(lambda y: jnp.tanh(y).sum(-1), name="my.tsum")(x),
                  (X,)),
    # a continued fraction looping until the whole array converged (rules/special.py)
    "betainc": (lambda x: jax.scipy.special.betainc(jnp.abs(x) + 0.5, 2.0 + x ** 2,
                                                    jax.nn.sigmoid(x)), (X,)),
}

# per mesh: placements for X-like (8, 16, 32), W (32, 64) and ids (8, 16) arguments
PLACEMENTS = {
    "2x4": (MESH2, {X.shape: [S(0), S(1)], W.shape: [R(), S(1)], IDS.shape: [S(0), R()]}),
    "2x2x2": (MESH3, {X.shape: [S(1), S(0), S(2)], W.shape: [S(1), R(), R()],
                      IDS.shape: [S(0), S(1), R()]}),
}


@pytest.mark.parametrize("mesh_name", list(PLACEMENTS))
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_library_function_on_sharded_inputs_equals_one_device(name, mesh_name):
    fn, args = FUNCTIONS[name]
    mesh, by_shape = PLACEMENTS[mesh_name]
    placed = [dist.shard_tensor(a, mesh, by_shape[a.shape]) for a in args]
    f = dist.jit(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)  # every primitive has its rule
        got = f(*placed)
        plan = f.plan(*placed)
    want = jax.jit(fn)(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    hlo = f.lower(*placed).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives), plan.collectives


def _betainc_data(n: int = 64):
    """a, b, x whose first rows converge at once (x tiny) and last rows slowest (x just below
    the switch to the symmetric form, (a + 1) / (a + b + 2)): blocks computed alone stop after
    different numbers of iterations."""
    rng = np.random.default_rng(1)
    a = rng.uniform(0.5, 20, n).astype(np.float32)
    b = rng.uniform(0.5, 20, n).astype(np.float32)
    x = np.concatenate([np.full(n // 8, 1e-4), rng.uniform(0, 1, n - n // 4),
                        ((a + 1) / (a + b + 2))[n - n // 8:] * 0.999]).astype(np.float32)
    x[n // 8:n // 8 + 4] = [0.0, 1.0, 0.5, np.nan]  # its special cases
    return a, b, x


@pytest.mark.parametrize("mesh,placements", [
    (dist.ProcessMesh(list(range(8)), ["x"]), [S(0)]),
    (MESH2, [S(0), R()]),
    (MESH2, [S(0), S(0)]),
    (MESH3, [S(0), R(), S(0)]),
], ids=["1-d", "2x4 rows over dp", "2x4 rows over both", "2x2x2"])
def test_betainc_runs_sharded_as_many_iterations_as_one_device(mesh, placements):
    """Each device iterates until every element of the whole array has converged, as one device
    does: equal to the bit (blocks computed alone are not), with jax's derivative by x."""
    a, b, x = _betainc_data()
    fn = jax.scipy.special.betainc
    want = np.asarray(jax.jit(fn)(a, b, x))
    alone = np.asarray(jax.jit(fn)(a[:8], b[:8], x[:8]))
    assert not np.array_equal(alone, want[:8])  # the data needs the whole array's count
    placed = [dist.shard_tensor(v, mesh, placements) for v in (a, b, x)]
    f = dist.jit(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)  # no longer replicated
        got = f(*placed)
        plan = f.plan(*placed)
    np.testing.assert_array_equal(got.numpy(), want)
    assert got.placements == placements
    [flag] = plan.collectives  # the stopping flag's or, once per iteration
    assert flag.kind == "all-reduce" and flag.runs is None and flag.bytes_per_device == 4
    hlo = f.lower(*placed).compile().as_text()
    assert count_collectives(hlo) == Counter({"all-reduce": 1})

    def loss(a, b, x):
        return jnp.sum(jnp.where(jnp.isnan(x), 0.0, fn(a, b, x)) ** 2)

    clean = np.nan_to_num(x, nan=0.5)
    placed[2] = dist.shard_tensor(clean, mesh, placements)
    grad_want = np.asarray(jax.jit(jax.grad(loss, 2))(a, b, clean))
    inside = dist.jit(jax.grad(loss, 2))(*placed)
    np.testing.assert_allclose(inside.numpy(), grad_want, rtol=1e-6, atol=1e-7)
    outside = jax.grad(lambda x: dist.jit(loss)(placed[0], placed[1], x))(placed[2])
    np.testing.assert_allclose(outside.numpy(), grad_want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="with respect to a and b"):
        jax.grad(lambda a: dist.jit(loss)(a, placed[1], placed[2]))(placed[0])
