"""Running a ReshardPlan: each same-mesh stretch of steps is one jitted shard_map program of
collectives (cached); a cross-mesh transfer is a set of device-to-device copies (between
processes: collective permutes, sends.py)."""
from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from .. import in_flight
from ..layout import Layout
from ..mesh import ProcessMesh
from ..physical import host_memory, physical_sharding, physical_spec
from .planner import PlannedStep, ReshardPlan
from .sends import Send, crosses, exchange
from .transfer import Transfer


def segments(plan: ReshardPlan) -> list[tuple[ProcessMesh, Layout, Layout, tuple[PlannedStep, ...]]]:
    """Split a plan into same-mesh stretches; a Transfer stands alone."""
    out: list = []
    run: list[PlannedStep] = []
    for s in plan.steps:
        if isinstance(s.step, Transfer):
            if run:
                out.append((run[0].mesh, run[0].before, run[-1].after, tuple(run)))
                run = []
            out.append((s.mesh, s.before, s.after, (s,)))
        else:
            run.append(s)
    if run:
        out.append((run[0].mesh, run[0].before, run[-1].after, tuple(run)))
    return out


@functools.lru_cache(maxsize=2048)
def program(mesh: ProcessMesh, src: Layout, dst: Layout, steps: tuple[PlannedStep, ...],
            host: str | None = None):
    """The jitted shard_map that runs `steps` on one mesh (jit caches per shape and dtype).

    `host`: the value is stored in that host memory kind (dist.offload): the program copies
    it to the devices, runs the steps there and copies the result back — computed on the
    host-memory array itself, a step that mixes it with a device constant (the ordered keys
    of a float max / min) is rejected by jax."""
    sizes = mesh.axis_sizes

    def local(x):
        if src.partial:
            x = x[0]  # drop the physical partial axis: one slot per device
        if x.size:
            for planned in steps:
                x = planned.step.run(x, sizes)
        else:  # an empty tensor: nothing to move (XLA rejects a collective of no elements)
            out = jax.eval_shape(lambda v: functools.reduce(
                lambda w, planned: planned.step.run(w, sizes), steps, v), x)
            x = jax.numpy.zeros(out.shape, out.dtype)
            varying = tuple(getattr(out, "vma", None) or ())
            if varying:
                x = jax.lax.pcast(x, varying, to="varying")
        return x[None] if dst.partial else x

    mapped = jax.shard_map(local, mesh=mesh.to_jax(), in_specs=physical_spec(src, mesh),
                           out_specs=physical_spec(dst, mesh), check_vma=True)
    if host is None:
        return jax.jit(mapped)
    to_device, to_host = physical_sharding(src, mesh), physical_sharding(dst, mesh)

    def offloaded(x):
        y = mapped(jax.device_put(x, to_device))
        return jax.device_put(y, to_host.with_memory_kind(host))

    return jax.jit(offloaded)


def _run_transfer(transfer: Transfer, value: jax.Array, dst_mesh: ProcessMesh, landing: Layout,
                  shape: tuple[int, ...]) -> jax.Array:
    """Each destination block this process owns, assembled from the pieces of its route: a
    piece from a device of this process by `device_put`, one from another process's device by
    a collective permute that both processes run (sends.py)."""
    me = jax.process_index()
    held = {s.device.id: s.data for s in value.addressable_shards}
    # an offloaded tensor: its pieces are assembled in device memory and the result stored
    # back in host memory (a piece put on its own device would otherwise stay on the host)
    host = host_memory(value.sharding)

    def on(device):
        return (jax.sharding.SingleDeviceSharding(device, memory_kind=device.default_memory().kind)
                if host else device)

    src_device, dst_device = transfer.src_mesh.device_for, dst_mesh.device_for

    def cut(src, piece) -> jax.Array:
        data = held[src.id]
        if tuple(data.shape) != tuple(hi - lo for lo, hi in piece.src_slices):
            data = data[tuple(slice(lo, hi) for lo, hi in piece.src_slices)]
        return data

    remote = [Send((r, k), src_device(p.src_device), dst_device(route.dst_device),
                   tuple(hi - lo for lo, hi in p.src_slices))
              for r, route in enumerate(transfer.routes) for k, p in enumerate(route.pieces)
              if crosses(src_device(p.src_device), dst_device(route.dst_device))]
    received = exchange(remote, lambda s: cut(s.src, transfer.routes[s.key[0]]
                                              .pieces[s.key[1]]), value.dtype) if remote else {}
    blocks = []
    for r, route in enumerate(transfer.routes):
        device = dst_device(route.dst_device)
        if device.process_index != me:
            continue  # its process assembles it
        parts = []
        for k, piece in enumerate(route.pieces):
            data = received.get((r, k))
            if data is None:
                data = jax.device_put(cut(src_device(piece.src_device), piece), on(device))
            parts.append((piece.dst_offset, data))
        if len(parts) == 1 and tuple(parts[0][1].shape) == route.block_shape:
            block = parts[0][1]
        else:
            block = jax.device_put(np.zeros(route.block_shape, value.dtype), on(device))
            for offset, data in parts:
                block = jax.lax.dynamic_update_slice(block, data, offset)
        blocks.append(block)
    out = jax.make_array_from_single_device_arrays(
        shape, physical_sharding(landing, dst_mesh), blocks, dtype=value.dtype)
    return out if host is None else jax.device_put(out, out.sharding.with_memory_kind(host))


def _host_memory_of(value: Any) -> str | None:
    """The host memory kind `value` is stored in (None: the devices', or a traced value, which
    has no storage: a reshard inside an outer jax.jit or jax.grad)."""
    return None if isinstance(value, jax.core.Tracer) else host_memory(value.sharding)


def execute(plan: ReshardPlan, value: jax.Array) -> jax.Array:
    """Apply `plan` to the physical array `value`; returns the destination's physical array."""
    for mesh, src, dst, steps in segments(plan):
        if isinstance(steps[0].step, Transfer):
            value = _run_transfer(steps[0].step, value, mesh, dst, plan.shape)
        else:
            host = _host_memory_of(value)
            value = program(mesh, src, dst, steps, host)(value)
            in_flight.ran(value)  # (XLA's CPU backend deadlocks on too many left running)
            if not value.size and not isinstance(value, jax.core.Tracer):
                # XLA reports an empty result replicated: store it as planned
                value = jax.device_put(value, physical_sharding(dst, mesh).with_memory_kind(
                    value.sharding.memory_kind))
    return value


def compiled_hlo(plan: ReshardPlan, value: jax.Array) -> list[str]:
    """The compiled HLO text of each same-mesh program of the plan (to check collectives)."""
    texts = []
    for mesh, src, dst, steps in segments(plan):
        if isinstance(steps[0].step, Transfer):
            value = _run_transfer(steps[0].step, value, mesh, dst, plan.shape)
            continue
        fn = program(mesh, src, dst, steps, _host_memory_of(value))
        texts.append(fn.lower(value).compile().as_text())
        value = fn(value)
    return texts


__all__ = ["execute", "program", "segments", "compiled_hlo"]
