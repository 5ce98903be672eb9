"""jax.debug.print / jax.debug.callback inside dist.jit see what one device would: the global
value, once (or, with partitioned=True, each device's own block)."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard as dist

MESH24 = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
R, S = dist.Replicate(), dist.Shard
X = np.arange(32, dtype=np.float32).reshape(8, 4) / 8


def run(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        out = dist.jit(fn)(*args)
    jax.effects_barrier()
    return out


@pytest.mark.parametrize("placements", [[S(0), S(1)], [S(0), R], [R, R]])
def test_a_callback_sees_the_global_value_once(placements):
    seen = []

    def fn(x):
        y = jnp.tanh(x)
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), y)
        return y * 2

    out = run(fn, dist.shard_tensor(X, MESH24, placements))
    np.testing.assert_allclose(out.numpy(), np.tanh(X) * 2, rtol=1e-6)
    assert len(seen) == 1
    np.testing.assert_allclose(seen[0], np.tanh(X), rtol=1e-6)


def test_a_print_in_every_layer_and_in_the_backward_prints_once_each(capfd):
    def loss(ws, x):
        for i, w in enumerate(ws):
            x = jnp.tanh(x @ w)
            jax.debug.print("layer {i}: {s:.4f}", i=i, s=x.sum())
        return jnp.sum(x ** 2)

    ws = [np.eye(4, dtype=np.float32) * 0.5 for _ in range(3)]
    placed = [dist.shard_tensor(w, MESH24, [R, S(1)]) for w in ws]
    ref = jax.grad(loss)(ws, X)
    jax.effects_barrier()
    capfd.readouterr()  # one device's prints
    grads = run(jax.grad(loss), placed, dist.shard_tensor(X, MESH24, [S(0), R]))
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-5, atol=1e-6)
    lines = [ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("layer")]
    x, want = X, []
    for i, w in enumerate(ws):
        x = np.tanh(x @ w)
        want.append(f"layer {i}: {x.sum():.4f}")
    assert sorted(lines) == sorted(want)  # unordered effects: XLA may run them in any order


def test_ordered_prints_and_prints_in_a_scan_body(capfd):
    # jax keeps ordered effects in one-device programs only: here they print unordered, once
    def fn(x):
        jax.debug.print("total {t}", t=x.sum(), ordered=True)
        jax.debug.callback(lambda t: print(f"callback {float(t)}"), x.sum(), ordered=True)

        def body(c, row):
            jax.debug.print("row {s}", s=row.sum())
            return c + row.sum(), row * 2
        return jax.lax.scan(body, 0.0, x)

    run(fn, dist.shard_tensor(X, MESH24, [S(0), S(1)]))
    lines = capfd.readouterr().out.splitlines()
    want = [f"total {X.sum()}", f"callback {X.sum()}"] + [f"row {r.sum()}" for r in X]
    assert sorted(lines) == sorted(want)


def test_a_partitioned_callback_sees_each_devices_block():
    seen = []

    def fn(x):
        jax.debug.callback(lambda v: seen.append(np.asarray(v).shape), x, partitioned=True)
        return x + 1

    run(fn, dist.shard_tensor(X, MESH24, [S(0), S(1)]))
    assert seen == [(4, 1)] * 8
