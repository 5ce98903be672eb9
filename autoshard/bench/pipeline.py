"""The pipeline suite: each schedule's simulated bubble and held activations beside its measured
step, dispatched asynchronously (stages overlap as far as the machine lets them) and blocking
after every action (no overlap), on a 4-stage residual MLP over four 2-device meshes.

    python -m autoshard.bench pipeline [--hidden 512] [--batch 256] [--json FILE]

`overlap` is blocking / async step time: how much of the schedule's concurrency the host
dispatch turns into wall time. `held_mib` is the most one device holds during a step beyond
what it held before (activations and residuals kept for the backward, gradient sums), measured
from jax's live arrays after every action: where 1F1B's memory advantage over FThenB shows. On a machine with fewer cores than simulated devices there is
little to gain (every stage competes for the same cores); the figure is meant for real
accelerators. Values are checked against the unscheduled one-batch StageRunner.
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import autoshard as dist

from .report import print_rows

RUNS = [("1F1B", 1, 1, False), ("FThenB", 4, 1, False), ("1F1B", 4, 1, False),
        ("ZBH1", 4, 1, False), ("VPP", 4, 2, False), ("FThenB", 8, 1, False),
        ("1F1B", 8, 1, False), ("FThenB", 8, 1, True), ("1F1B", 8, 1, True)]


def _block(p, x):
    return x + jax.nn.gelu(x @ p["a"]) @ p["b"]


def _head(p, x, y):
    return jnp.mean((_block(p, x) - y) ** 2)


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _peak_held_bytes(runner, step) -> int:
    """The most bytes one device holds during a step beyond what it held before (activations,
    cotangents, vjp residuals, gradient sums), read from jax's live arrays after every action
    with the runner blocking: measured, not simulated."""
    def per_device() -> dict:
        held: dict = {}
        for arr in jax.live_arrays():
            for shard in arr.addressable_shards:
                held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
        return held

    start = per_device()
    peak = 0

    def probe(_action) -> None:
        nonlocal peak
        now = per_device()
        peak = max([peak, *(n - start.get(d, 0) for d, n in now.items())])

    runner.after_action = probe
    try:
        jax.block_until_ready(step())
    finally:
        runner.after_action = None
    return peak


def measure(mode: str, micro: int, chunks: int, recompute: bool, hidden: int, batch: int,
            repeats: int = 5) -> dict:
    p = 4 // chunks
    meshes = [dist.ProcessMesh([2 * k, 2 * k + 1], dim_names=["dp"]) for k in range(p)]
    rng = np.random.default_rng(0)
    weights = [{"a": rng.normal(size=(hidden, 4 * hidden)).astype("float32") * 0.02,
                "b": rng.normal(size=(4 * hidden, hidden)).astype("float32") * 0.02}
               for _ in range(4)]
    stages = [dist.Stage(_head if s == 3 else _block, meshes[s % p]) for s in range(4)]
    params = [{k: dist.shard_tensor(v, st.mesh, [dist.Replicate()]) for k, v in w.items()}
              for w, st in zip(weights, stages)]
    x = dist.shard_tensor(rng.normal(size=(batch, hidden)).astype("float32"), meshes[0],
                          [dist.Shard(0)])
    y = dist.shard_tensor(rng.normal(size=(batch, hidden)).astype("float32"), stages[-1].mesh,
                          [dist.Shard(0)])
    runner = dist.PipelineRunner(stages, mode, micro, chunks=chunks, recompute=recompute)
    loss, grads = runner.value_and_grad(params, x, y)  # compiles
    ref_loss, ref_grads = dist.StageRunner(stages).value_and_grad(params, x, y)
    same = bool(np.allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-5) and all(
        np.allclose(g[k].numpy(), r[k].numpy(), rtol=1e-3, atol=1e-6)
        for g, r in zip(grads, ref_grads) for k in r))
    step = lambda: runner.value_and_grad(params, x, y)  # noqa: E731
    runner.blocking = False
    fast = _timed(step, repeats)
    runner.blocking = True
    slow = _timed(step, repeats)
    held = _peak_held_bytes(runner, step)
    t = runner.timeline
    return {"schedule": mode, "ranks": runner.schedule.ranks, "micro_batches": micro,
            "chunks": chunks, "recompute": recompute, "sim_bubble": round(t.bubble, 3),
            "peak_in_flight": max(t.peak_in_flight),
            "held_mib": round(held / 2**20, 2), "step_ms": round(fast * 1e3, 1),
            "blocking_ms": round(slow * 1e3, 1), "overlap": round(slow / fast, 2),
            "same_values": same}


def run(hidden: int = 512, batch: int = 256, json_path: str | None = None,
        runs=RUNS, repeats: int = 5) -> list[dict]:
    rows = [measure(mode, m, v, r, hidden, batch, repeats) for mode, m, v, r in runs]
    print_rows(rows, list(rows[0]), 8, json_path)
    return rows
