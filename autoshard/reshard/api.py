"""The public reshard entry points: plan_reshard (pure, cached) and reshard (plan + execute)."""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np

from ..cost_model import CostModel, default_cost_model
from ..dtensor import DistTensor, make_dtensor
from ..errors import PlacementTypeError, ReshardError
from ..layout import Layout, layout_from_placements
from ..mesh import ProcessMesh, as_process_mesh
from ..placement import Placement
from ..physical import physical_spec
from ..uneven import even_part, gather_local, is_uneven, split_local
from .execute import execute
from .planner import ReshardPlan, plan_on_mesh
from .transfer import plan_across_meshes


@functools.lru_cache(maxsize=4096)
def plan_layouts(shape: tuple[int, ...], dtype: str, src_mesh: ProcessMesh, src: Layout,
                 dst_mesh: ProcessMesh, dst: Layout, cost_model: CostModel) -> ReshardPlan:
    """The plan between two layouts; same-mesh plans are one program, others add a transfer."""
    if src_mesh == dst_mesh:
        steps = plan_on_mesh(src_mesh, src, dst, shape, dtype, cost_model)
    else:
        steps = plan_across_meshes(src_mesh, src, dst_mesh, dst, shape, dtype, cost_model)
    return ReshardPlan(shape, dtype, src_mesh, src, dst_mesh, dst, steps)


def _check_tensor(x, verb: str) -> DistTensor:
    if not isinstance(x, DistTensor):
        raise PlacementTypeError(
            f"dist.{verb} needs a DistTensor, got {type(x).__name__}: place a plain array first "
            f"with dist.shard_tensor(x, mesh, placements)")
    from jax.core import Tracer

    if isinstance(x.physical, Tracer):
        raise ReshardError(
            f"dist.{verb} was called on a traced value inside a jax transformation; eager "
            f"reshards run outside jit — inside a function, use dist.jit (or reshard before jit)")
    return x


def plan_reshard(x: DistTensor, mesh: ProcessMesh, placements: Sequence[Placement | str], *,
                 cost_model: CostModel | None = None) -> ReshardPlan:
    """The steps that would reshard `x` onto (mesh, placements), with bytes per device.

    A dim stored unevenly (uneven.py) moves whole: the steps are those between the layouts
    with such dims whole, after the gather that makes them so."""
    x = _check_tensor(x, "plan_reshard")
    mesh = as_process_mesh(mesh)
    dst = layout_from_placements(placements, mesh, x.shape, what=f"the tensor {_describe(x)}")
    return plan_layouts(x.shape, np.dtype(x.dtype).name, x.mesh,
                        even_part(x.layout, x.mesh, x.shape), mesh,
                        even_part(dst, mesh, x.shape), cost_model or default_cost_model())


@functools.lru_cache(maxsize=512)
def _uneven_program(mesh: ProcessMesh, layout: Layout, shape: tuple[int, ...], gather: bool):
    """The jitted shard_map between `layout`, stored unevenly, and its even part: gathering
    the uneven dims whole, or (gather False) keeping each device's rows of them."""
    even = even_part(layout, mesh, shape)
    src, dst = (layout, even) if gather else (even, layout)
    move = gather_local if gather else split_local
    return jax.jit(jax.shard_map(lambda block: move(block, layout, mesh, shape),
                                 mesh=mesh.to_jax(), in_specs=physical_spec(src, mesh),
                                 out_specs=physical_spec(dst, mesh), check_vma=True))


def to_even(x: DistTensor) -> DistTensor:
    """`x` with the dims it stores unevenly gathered whole (itself if there are none)."""
    even = even_part(x.layout, x.mesh, x.shape)
    if even is x.layout:
        return x
    moved = _uneven_program(x.mesh, x.layout, x.shape, True)(x.physical)
    return make_dtensor(moved, x.mesh, even, x.shape)


def to_uneven(x: DistTensor, layout: Layout) -> DistTensor:
    """`x`, laid out as `even_part(layout)`, stored as `layout` (local slicing only)."""
    moved = _uneven_program(x.mesh, layout, x.shape, False)(x.physical)
    return make_dtensor(moved, x.mesh, layout, x.shape)


def reshard(x: DistTensor, mesh: ProcessMesh, placements: Sequence[Placement | str], *,
            cost_model: CostModel | None = None) -> DistTensor:
    """Move `x` to (mesh, placements): collectives on one mesh, device copies across meshes.

    Inside dist.jit, on a traced value, it marks a forced conversion point instead.
    """
    mesh = as_process_mesh(mesh)
    from jax.core import Tracer

    if isinstance(x, Tracer):
        from ..creation import annotate

        return annotate(x, mesh, placements, force=True)
    mesh.devices()  # a destination with devices this process lacks fails here, with the ids
    x = _check_tensor(x, "reshard")
    dst = layout_from_placements(placements, mesh, x.shape, what=f"the tensor {_describe(x)}")
    if x.mesh == mesh and x.layout == dst:
        return x
    if is_uneven(dst, mesh, x.shape):  # computed on the even part, then stored as asked
        return to_uneven(reshard(x, mesh, even_part(dst, mesh, x.shape).placements(mesh),
                                 cost_model=cost_model), dst)
    x = to_even(x)
    plan = plan_reshard(x, mesh, placements, cost_model=cost_model)
    if not plan.steps and plan.src_mesh == plan.dst_mesh:
        return x
    return make_dtensor(execute(plan, x.physical), mesh, plan.dst, x.shape)


def _describe(x: DistTensor) -> str:
    return f"{np.dtype(x.dtype).name}{list(x.shape)}"


__all__ = ["plan_reshard", "reshard", "plan_layouts", "to_even", "to_uneven"]
