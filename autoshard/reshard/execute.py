"""Running a ReshardPlan: each same-mesh stretch of steps is one jitted shard_map program of
collectives (cached); a cross-mesh transfer is a set of device-to-device copies."""
from __future__ import annotations

import functools

import jax
import numpy as np

from ..layout import Layout
from ..mesh import ProcessMesh
from ..physical import physical_sharding, physical_spec
from .planner import PlannedStep, ReshardPlan
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
def program(mesh: ProcessMesh, src: Layout, dst: Layout, steps: tuple[PlannedStep, ...]):
    """The jitted shard_map that runs `steps` on one mesh (jit caches per shape and dtype)."""
    sizes = mesh.axis_sizes

    def local(x):
        if src.partial:
            x = x[0]  # drop the physical partial axis: one slot per device
        for planned in steps:
            x = planned.step.run(x, sizes)
        return x[None] if dst.partial else x

    return jax.jit(jax.shard_map(local, mesh=mesh.to_jax(), in_specs=physical_spec(src, mesh),
                                 out_specs=physical_spec(dst, mesh), check_vma=True))


def _run_transfer(transfer: Transfer, value: jax.Array, dst_mesh: ProcessMesh, landing: Layout,
                  shape: tuple[int, ...]) -> jax.Array:
    held = {s.device.id: s.data for s in value.addressable_shards}
    devices = {d.id: d for d in dst_mesh.devices().flat}
    blocks = []
    for route in transfer.routes:
        device = devices[route.dst_device]
        parts = []
        for piece in route.pieces:
            data = held[piece.src_device]
            if tuple(data.shape) != tuple(hi - lo for lo, hi in piece.src_slices):
                data = data[tuple(slice(lo, hi) for lo, hi in piece.src_slices)]
            parts.append((piece.dst_offset, jax.device_put(data, device)))
        if len(parts) == 1 and tuple(parts[0][1].shape) == route.block_shape:
            block = parts[0][1]
        else:
            block = jax.device_put(np.zeros(route.block_shape, value.dtype), device)
            for offset, data in parts:
                block = jax.lax.dynamic_update_slice(block, data, offset)
        blocks.append(block)
    return jax.make_array_from_single_device_arrays(
        shape, physical_sharding(landing, dst_mesh), blocks)


def execute(plan: ReshardPlan, value: jax.Array) -> jax.Array:
    """Apply `plan` to the physical array `value`; returns the destination's physical array."""
    for mesh, src, dst, steps in segments(plan):
        if isinstance(steps[0].step, Transfer):
            value = _run_transfer(steps[0].step, value, mesh, dst, plan.shape)
        else:
            value = program(mesh, src, dst, steps)(value)
    return value


def compiled_hlo(plan: ReshardPlan, value: jax.Array) -> list[str]:
    """The compiled HLO text of each same-mesh program of the plan (to check collectives)."""
    texts = []
    for mesh, src, dst, steps in segments(plan):
        if isinstance(steps[0].step, Transfer):
            value = _run_transfer(steps[0].step, value, mesh, dst, plan.shape)
            continue
        fn = program(mesh, src, dst, steps)
        texts.append(fn.lower(value).compile().as_text())
        value = fn(value)
    return texts


__all__ = ["execute", "program", "segments", "compiled_hlo"]
