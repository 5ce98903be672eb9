"""jax.debug.print / jax.debug.callback inside dist.jit see what one device would: the global
value, once (or, with partitioned=True, each device's own block)."""
from __future__ import annotations

import warnings
from collections import Counter

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


@pytest.mark.parametrize("kind", ["pure", "io", "io ordered"])
@pytest.mark.parametrize("placements", [[S(0), S(1)], [S(0), R]])
def test_pure_and_io_callbacks_run_once_on_the_global_value(kind, placements):
    """As under jax.jit: the host function is called once per call with the global operand
    (an io_callback's side effect happens once, not once per device), and its result — here
    with a -0.0 and an integer output — reaches every device by one planned all-reduce."""
    from jax.experimental import io_callback

    from autoshard.hlo import collective_wire_bytes, count_collectives

    calls = []

    def host(v):
        calls.append(np.asarray(v).copy())
        return np.where(v > 1, -0.0, np.sin(v)).astype(np.float32), np.int32(v.shape[0])

    out_types = (jax.ShapeDtypeStruct(X.shape, np.float32), jax.ShapeDtypeStruct((), np.int32))

    def fn(x):
        y = jnp.tanh(x) * 2
        if kind == "pure":
            r, n = jax.pure_callback(host, out_types, y)
        else:
            r, n = io_callback(host, out_types, y, ordered=kind == "io ordered")
        return r * n, r

    x = dist.shard_tensor(X, MESH24, placements)
    out, r = run(fn, x)
    ref_out, ref_r = jax.jit(fn)(X)
    assert len(calls) == 2  # ours once, jax.jit's once
    np.testing.assert_allclose(calls[0], calls[1], rtol=1e-6)  # XLA may fuse tanh otherwise
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=1e-6)
    np.testing.assert_array_equal(np.signbit(r.numpy()), np.signbit(np.asarray(ref_r)))
    assert np.signbit(r.numpy()).any()
    f = dist.jit(fn)
    plan = f.plan(x)
    planned = [c for c in plan.collectives if "callback's result" in c.step]
    assert len(planned) == 2 and {c.kind for c in planned} == {"all-reduce"}
    # the operand is gathered for the host function (as jax.jit's maximal sharding gathers it)
    gathers = [c for c in plan.collectives if c.kind == "all-gather"]
    assert len(gathers) == len(plan.collectives) - 2
    hlo_text = f.lower(x).compile().as_text()
    assert count_collectives(hlo_text) == Counter(c.kind for c in plan.collectives)
    # each device's bytes as the planner counts every all-reduce (they were the buffer's)
    assert sum(c.bytes_per_device for c in plan.collectives if c.kind == "all-reduce") == \
        collective_wire_bytes(hlo_text)["all-reduce"]


def test_an_io_callback_in_a_scan_body_runs_once_per_iteration():
    from jax.experimental import io_callback

    seen = []

    def fn(x):
        def body(c, row):
            io_callback(lambda s: seen.append(float(s)), None, row.sum())
            return c + row.sum(), row * 2
        return jax.lax.scan(body, 0.0, x)

    total, rows = run(fn, dist.shard_tensor(X, MESH24, [S(0), S(1)]))
    np.testing.assert_allclose(float(total), X.sum(), rtol=1e-6)
    assert sorted(seen) == sorted(float(r.sum()) for r in X)


def test_a_callback_in_a_map_over_split_rows_runs_once_per_row():
    """lax.map over rows split over dp runs each device's own rows (test_control_flow): the
    callback is called once per row, by one device of the group that holds it, and each
    group's results stay its own."""
    seen = []

    def host(v):
        seen.append(np.asarray(v).copy())
        return np.sin(v)

    row = jax.ShapeDtypeStruct((4,), np.float32)

    def fn(x):
        return jax.lax.map(lambda r: jax.pure_callback(host, row, r) * 2, x)

    out = run(fn, dist.shard_tensor(X, MESH24, [S(0), R]))
    np.testing.assert_allclose(out.numpy(), np.sin(X) * 2, rtol=1e-6)
    assert len(seen) == len(X)
    np.testing.assert_allclose(np.sort(np.stack(seen), axis=0), np.sort(X, axis=0), rtol=1e-6)
