"""Calibrate: fit the alpha–beta cost model to the devices a mesh really has.

The defaults of `CostModel` are of the order of one accelerator node. On other hardware the
right decision can differ: on CPU devices a collective is a rendezvous of threads costing
hundreds of microseconds whatever its size, so one all-reduce beats two smaller all-gathers;
across nodes one mesh axis may be ten times slower than another. `calibrate_cost_model(mesh)`
times a chain of all-reduces of a small and of a large buffer over each mesh axis (the
median of interleaved runs, minus the same chain of local ops, so that neither dispatch nor
arithmetic is counted), fits
`latency + wire_bytes / bandwidth` per axis, and times a local copy for the local bandwidth:

    model = dist.calibrate_cost_model(mesh)
    step = dist.jit(train_step, cost_model=model)      # or dist.set_default_cost_model(model)

The measurement runs programs on the mesh (a second or two); the model it returns is a plain,
hashable `CostModel` that can be stored and reused (`model.latency`, `model.bandwidth`).
"""
from __future__ import annotations

import time

import numpy as np

from .cost_model import CostModel
from .mesh import as_process_mesh

_FLOOR_S = 1e-7           # a measured latency is never taken below this
_BANDWIDTH_RANGE = (1e8, 1e13)  # bytes/s: a noisy difference of two timings stays plausible


def _median_seconds(fns: list, args: list, repeats: int) -> list[float]:
    """Median wall time of each compiled fn, calls interleaved (a slow moment hits them all)."""
    import jax

    for f, a in zip(fns, args):
        jax.block_until_ready(f(a))  # compile and warm up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for k, (f, a) in enumerate(zip(fns, args)):
            t = time.perf_counter()
            jax.block_until_ready(f(a))
            times[k].append(time.perf_counter() - t)
    return [float(np.median(t)) for t in times]


def calibrate_cost_model(mesh, *, small_bytes: int = 4096, large_bytes: int = 4 << 20,
                         repeats: int = 15, chain: int = 8) -> CostModel:
    """A `CostModel` with each mesh axis's latency and bandwidth measured on `mesh`."""
    import jax
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = as_process_mesh(mesh)
    jmesh = mesh.to_jax()
    names = mesh.dim_names

    def program(body, n_elems: int):
        x = np.ones((mesh.size * n_elems,), np.float32)
        arr = jax.device_put(x, NamedSharding(jmesh, P(tuple(names))))
        f = jax.jit(jax.shard_map(body, mesh=jmesh, in_specs=P(tuple(names)),
                                  out_specs=P(tuple(names))))
        return f, arr

    def chained(step):
        def body(b):
            for _ in range(chain):  # each waits for the one before: nothing merges or overlaps
                b = step(b) * 0.5
            return b
        return body

    small, large = max(small_bytes // 4, 1), max(large_bytes // 4, 1)
    local_f, local_small = program(chained(lambda b: b + 1.0), small)
    copy_f, local_large = program(chained(lambda b: b + 1.0), large)
    latency, bandwidth, local_times = {}, {}, []
    for axis in names:
        n = mesh.get_dim_size(axis)
        if n < 2:
            continue  # nothing to measure on an axis of one device

        def reduce(b, axis=axis):
            return lax.psum(b, axis)

        ar_small, x_small = program(chained(reduce), small)
        ar_large, x_large = program(chained(reduce), large)
        t_local, t_small, t_copy, t_large = _median_seconds(
            [local_f, ar_small, copy_f, ar_large], [local_small, x_small, local_large, x_large],
            repeats)
        local_times.append((t_local, t_copy))
        alpha = max((t_small - t_local) / chain, _FLOOR_S)
        wire = 2 * (n - 1) / n * large * 4  # a ring all-reduce: what each device sends
        beta_s = max((t_large - t_copy) / chain - alpha, 1e-12)
        latency[axis] = alpha
        bandwidth[axis] = float(np.clip(wire / beta_s, *_BANDWIDTH_RANGE))
    # local traffic: each large elementwise step reads and writes its block once (XLA may fuse
    # the chain into fewer passes: then this overestimates, which only favours local work)
    if not local_times:  # no axis to measure: time the local chains by themselves
        local_times.append(tuple(_median_seconds([local_f, copy_f], [local_small, local_large],
                                                 repeats)))
    t_local, t_copy = (float(np.median(t)) for t in zip(*local_times))
    local_bw = float(np.clip(2 * large * 4 / max(t_copy - t_local, 1e-12), *_BANDWIDTH_RANGE))
    default = CostModel()
    return CostModel(
        default_latency=max(latency.values(), default=default.default_latency),
        default_bandwidth=min(bandwidth.values(), default=default.default_bandwidth),
        local_bandwidth=local_bw,
        transfer_bandwidth=min(bandwidth.values(), default=default.transfer_bandwidth),
        latency=latency, bandwidth=bandwidth)


__all__ = ["calibrate_cost_model"]
