"""Reshards between different meshes: reduce on the source, copy blocks device to device, finish
on the destination.

Source blocks are sliced on the device that holds them before they travel, so each destination
device receives exactly the bytes of its own block that it does not already hold (a device in
both meshes keeps what it has). This covers disjoint device sets of any sizes, reordered ids,
and a full mesh ↔ one of its pipeline sub-meshes.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..cost_model import CostModel
from ..layout import Layout, block_bounds
from ..mesh import ProcessMesh
from ..placement import ReduceType
from .planner import PlannedStep, plan_on_mesh
from .steps import Step

Bounds = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Piece:
    src_device: int
    src_slices: Bounds       # relative to the source device's block
    dst_offset: tuple[int, ...]  # where it lands in the destination device's block
    nbytes: int


@dataclass(frozen=True)
class Route:
    dst_device: int
    block_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Transfer(Step):
    """Device-to-device copies from the source mesh's blocks to the destination mesh's blocks."""

    src_mesh: ProcessMesh
    routes: tuple[Route, ...]
    kind: ClassVar[str] = "transfer"

    @property
    def axes(self):
        return ()

    def received_bytes(self) -> int:
        """The most bytes any destination device receives from another device."""
        return max((sum(p.nbytes for p in r.pieces if p.src_device != r.dst_device)
                    for r in self.routes), default=0)

    def __str__(self):
        moved = sum(1 for r in self.routes for p in r.pieces if p.src_device != r.dst_device)
        return f"transfer ({moved} device-to-device copies)"


def _blocks(mesh: ProcessMesh, layout: Layout, shape) -> list[tuple[int, Bounds]]:
    return [(int(mesh.id_array[c]), block_bounds(layout, mesh, shape, c))
            for c in itertools.product(*(range(s) for s in mesh.shape))]


def _intersect(a: Bounds, b: Bounds) -> Bounds | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def plan_routes(src_mesh: ProcessMesh, src: Layout, dst_mesh: ProcessMesh, dst: Layout,
                shape: tuple[int, ...], itemsize: int) -> tuple[Route, ...]:
    """For each destination device, which source devices send which parts of its block.

    Among devices holding the same source block (replicas), the destination device itself is
    preferred, then the least loaded sender, so copies spread over the source mesh.
    """
    holders: dict[Bounds, list[int]] = {}
    for device, bounds in _blocks(src_mesh, src, shape):
        holders.setdefault(bounds, []).append(device)
    load: dict[int, int] = {d: 0 for d in src_mesh.process_ids}
    routes = []
    for device, want in _blocks(dst_mesh, dst, shape):
        pieces = []
        for have, devices in holders.items():
            part = _intersect(want, have)
            if part is None:
                continue
            nbytes = math.prod(hi - lo for lo, hi in part) * itemsize
            sender = device if device in devices else min(devices, key=lambda d: (load[d], d))
            if sender != device:
                load[sender] += nbytes
            pieces.append(Piece(sender,
                                tuple((lo - h0, hi - h0) for (lo, hi), (h0, _) in zip(part, have)),
                                tuple(lo - w0 for (lo, _), (w0, _) in zip(part, want)), nbytes))
        routes.append(Route(device, tuple(hi - lo for lo, hi in want), tuple(pieces)))
    return tuple(routes)


def _staging_layouts(src: Layout, shape, sizes) -> list[Layout]:
    """Source-mesh layouts to send from: partial axes reduced, or reduce-scattered onto a dim."""
    options = [src.without_partial()]
    sum_axes = tuple(a for a, t in src.partial if t in (ReduceType.SUM, ReduceType.AVG))
    if sum_axes and len(sum_axes) == len(src.partial):
        n = math.prod(sizes[a] for a in sum_axes)
        local = src.local_shape(shape, sizes)
        for d in range(len(shape)):
            if local[d] % n == 0:
                dims = list(src.dims)
                dims[d] = dims[d] + sum_axes
                options.append(Layout(tuple(dims)))
    return options


@functools.lru_cache(maxsize=1024)
def plan_across_meshes(src_mesh: ProcessMesh, src: Layout, dst_mesh: ProcessMesh, dst: Layout,
                       shape: tuple[int, ...], dtype: str,
                       cost_model: CostModel) -> tuple[PlannedStep, ...]:
    itemsize = np.dtype(dtype).itemsize
    landing = dst.without_partial()
    finish = plan_on_mesh(dst_mesh, landing, dst, shape, dtype, cost_model)
    best: tuple[float, tuple[PlannedStep, ...]] | None = None
    for staging in _staging_layouts(src, shape, src_mesh.axis_sizes):
        before = plan_on_mesh(src_mesh, src, staging, shape, dtype, cost_model)
        transfer = Transfer(src_mesh, plan_routes(src_mesh, staging, dst_mesh, landing, shape,
                                                  itemsize))
        wire = transfer.received_bytes()
        moved = PlannedStep(transfer, dst_mesh, staging, landing, wire, cost_model.transfer(wire))
        steps = before + (moved,) + finish
        cost = sum(s.seconds for s in steps)
        if best is None or cost < best[0] - 1e-15:
            best = (cost, steps)
    return best[1]


__all__ = ["Transfer", "Route", "Piece", "plan_routes", "plan_across_meshes"]
