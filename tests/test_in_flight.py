"""Programs left running on XLA's CPU backend are bounded (in_flight.py): a loop that never
reads its results must not pile up executions until XLA's collectives deadlock and abort."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard as dist
from autoshard import in_flight

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])


@pytest.fixture
def waits(monkeypatch):
    """The results waited for, in order (the real wait still runs)."""
    seen = []
    real = in_flight._wait

    def wait(handle):
        seen.append(handle())
        return real(handle)

    monkeypatch.setattr(in_flight, "_wait", wait)
    in_flight._pending.clear()
    yield seen
    in_flight._pending.clear()


def _step():
    @dist.jit
    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * g, loss
    return step


def test_a_loop_that_never_reads_its_results_waits_for_the_oldest_beyond_the_window(waits):
    w = dist.shard_tensor(np.ones((8, 16), np.float32) * 0.1, MESH, [dist.Replicate(), dist.Shard(1)])
    x = dist.shard_tensor(np.ones((4, 8), np.float32), MESH, [dist.Shard(0), dist.Replicate()])
    step = _step()
    losses = []
    for _ in range(3 * in_flight.WINDOW):
        w, loss = step(w, x)
        losses.append(loss)
        assert in_flight.pending() <= in_flight.WINDOW
    # each step beyond the window waited for one execution, the oldest first: its loss (the
    # smallest result, held until then)
    assert len(waits) == 2 * in_flight.WINDOW
    assert [id(x) for x in waits] == [id(l.physical) for l in losses[:2 * in_flight.WINDOW]]
    # and the values are those of one device
    wr, xr = np.ones((8, 16), np.float32) * 0.1, np.ones((4, 8), np.float32)
    ref = jax.jit(lambda w, x: jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w))
    for _ in range(3 * in_flight.WINDOW):
        lr, g = ref(wr, xr)
        wr = wr - 0.1 * g
    np.testing.assert_allclose(w.numpy(), wr, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses[-1].numpy(), lr, rtol=1e-5)


def test_eager_ops_and_reshards_are_bounded_too(waits):
    data = np.arange(32 * 16, dtype=np.float32).reshape(32, 16)  # small: results held
    x = dist.shard_tensor(data, MESH, [dist.Shard(0), dist.Shard(1)])
    for _ in range(in_flight.WINDOW + 3):
        y = x.reshape(16, 32)  # an all-to-all each
        z = dist.reshard(x, MESH, [dist.Replicate(), dist.Shard(0)])
        assert in_flight.pending() <= in_flight.WINDOW
    assert len(waits) == 2 * (in_flight.WINDOW + 3) - in_flight.WINDOW
    assert all(w is not None for w in waits)  # each the oldest execution's own result
    np.testing.assert_array_equal(y.numpy(), data.reshape(16, 32))
    np.testing.assert_array_equal(z.numpy(), data)


def test_what_is_not_a_multi_device_cpu_execution_is_not_counted(waits):
    in_flight.ran([jnp.ones(3)])  # one device
    in_flight.ran([np.ones(3)])  # not a jax array
    jax.jit(lambda x: in_flight.ran([x]) or x)(jnp.ones(3))  # a tracer
    assert in_flight.pending() == 0 and not waits


def test_a_large_result_is_held_weakly_a_small_one_until_waited_for():
    sharding = jax.sharding.NamedSharding(MESH.to_jax(), jax.sharding.PartitionSpec("dp"))
    big = jax.device_put(np.ones((1 << 15, 4), np.float32), sharding)
    small = jax.device_put(np.ones((8,), np.float32), sharding)
    held = in_flight._handle([big, small])
    assert held() is small
    weak = in_flight._handle([big])
    assert weak() is big
    del big
    assert weak() is None
    assert in_flight._wait(weak) is False  # a dropped result: nothing to wait for, no error


def test_a_chain_of_large_dropped_temporaries_waits_for_the_newest(waits):
    # each result is larger than what is held until waited for, and dropped by the next
    # step: when it leaves the window, the call waits for its own execution instead
    t = dist.shard_tensor(np.ones((256, 128), np.float32), MESH, [dist.Shard(0), dist.Shard(1)])
    for i in range(in_flight.WINDOW + 2):
        t = t.reshape(128, 256) if i % 2 == 0 else t.reshape(256, 128)
    assert len(waits) == 4 and waits[0] is None and waits[2] is None
    assert waits[1] is not None and waits[3] is t.physical


def test_a_thousand_unread_steps_run_where_xla_alone_deadlocks():
    """The failure itself, in a process of its own (XLA aborts the process on it): 1000 steps
    of a dist.jit train step, 300 eager reshapes of one tensor and a chain of 500 calls each
    dropping the last one's large result, none read until the end. Without the window, jaxlib 0.10.2's CPU backend aborted
    this after 40 s on a 2-core machine."""
    script = textwrap.dedent("""
        import numpy as np, jax, jax.numpy as jnp
        import autoshard as dist
        mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
        w = dist.shard_tensor(np.ones((8, 16), np.float32) * 0.1, mesh, ["R", "S(1)"])
        x = dist.shard_tensor(np.ones((4, 8), np.float32), mesh, ["S(0)", "R"])

        @dist.jit
        def step(w, x):
            loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
            return w - 0.1 * g, loss

        for _ in range(1000):
            w, loss = step(w, x)
        t = dist.shard_tensor(np.ones((64, 32), np.float32), mesh, ["S(0)", "S(1)"])
        for _ in range(300):
            y = t.reshape(32, 64)
        # large results (held weakly), each dropped by the next call
        b = dist.shard_tensor(np.ones((512, 256), np.float32), mesh, ["S(0)", "S(1)"])
        e = dist.shard_tensor(np.eye(256, dtype=np.float32), mesh, ["R", "S(0)"])
        f = dist.jit(lambda b, e: b @ e, out_placements=[["S(0)", "S(1)"]])
        for _ in range(500):
            b = f(b, e)
        print("done", float(loss.numpy()), float(y.numpy().sum()), float(b.numpy().sum()))
    """)
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "done" and out.stdout.split()[2:] == ["2048.0", "131072.0"]
