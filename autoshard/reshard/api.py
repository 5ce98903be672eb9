"""The public reshard entry points: plan_reshard (pure, cached) and reshard (plan + execute)."""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np

from ..compiler.dtypes import cost_dtype, dtype_name
from ..cost_model import CostModel, check_cost_model, default_cost_model
from ..dtensor import DistTensor, make_dtensor
from ..errors import PlacementTypeError, ReshardError
from ..layout import Layout, check_partial_dtype, layout_from_placements
from ..mesh import ProcessMesh, as_process_mesh
from ..paddle_names import paddle_names
from ..placement import Placement
from ..uneven import even_part, is_key, key_partial_error
from .execute import execute
from .planner import ReshardPlan, plan_on_mesh, uneven_steps
from .transfer import plan_across_meshes


@functools.lru_cache(maxsize=4096)
def plan_layouts(shape: tuple[int, ...], dtype: str, src_mesh: ProcessMesh, src: Layout,
                 dst_mesh: ProcessMesh, dst: Layout, cost_model: CostModel) -> ReshardPlan:
    """The plan between two layouts; same-mesh plans are one program, others add a transfer.

    A dim stored unevenly (uneven.py) moves whole: gathered first, split again last."""
    gather = uneven_steps(src_mesh, src, shape, dtype, cost_model, gather=True)
    split = uneven_steps(dst_mesh, dst, shape, dtype, cost_model, gather=False)
    a = gather[-1].after if gather else src
    b = split[0].before if split else dst
    if src_mesh == dst_mesh:
        steps = plan_on_mesh(src_mesh, a, b, shape, dtype, cost_model)
    else:
        steps = plan_across_meshes(src_mesh, a, dst_mesh, b, shape, dtype, cost_model)
    return ReshardPlan(shape, dtype, src_mesh, src, dst_mesh, dst, gather + steps + split)


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
    """The steps that would reshard `x` onto (mesh, placements), with bytes per device."""
    x = _check_tensor(x, "plan_reshard")
    check_cost_model(cost_model, "dist.plan_reshard")
    mesh = as_process_mesh(mesh)
    dst = layout_from_placements(placements, mesh, x.shape, what=f"the tensor {_describe(x)}")
    check_partial_dtype(dst, x.dtype, f"the tensor {_describe(x)}")
    return plan_layouts(x.shape, cost_dtype(x.dtype), x.mesh, x.layout, mesh, dst,
                        cost_model or default_cost_model())


def to_even(x: DistTensor, *, reduce_partial: bool = False) -> DistTensor:
    """`x` with the dims it stores unevenly gathered whole (and its Partial reduced, if asked;
    itself if there is nothing to do); jitted code only, so it runs under an outer trace too."""
    even = even_part(x.layout.without_partial() if reduce_partial else x.layout, x.mesh, x.shape)
    if even == x.layout:
        return x
    plan = plan_layouts(x.shape, cost_dtype(x.dtype), x.mesh, x.layout, x.mesh, even,
                        default_cost_model())
    return make_dtensor(execute(plan, x.physical), x.mesh, even, x.shape)


@paddle_names(dist_tensor="x")
def reshard(x: DistTensor, mesh: ProcessMesh, placements: Sequence[Placement | str], *,
            cost_model: CostModel | None = None) -> DistTensor:
    """Move `x` to (mesh, placements): collectives on one mesh, device copies across meshes.

    Inside dist.jit, on a traced value, it marks a forced conversion point instead.
    """
    mesh = as_process_mesh(mesh)
    check_cost_model(cost_model, "dist.reshard")
    from jax.core import Tracer

    if isinstance(x, Tracer):
        from ..creation import annotate

        return annotate(x, mesh, placements, force=True)
    mesh.devices()  # a destination with devices this process lacks fails here, with the ids
    if isinstance(x, DistTensor) and is_key(x.dtype):
        return _reshard_keys(_check_tensor(x, "reshard"), mesh, placements, cost_model)
    physical = getattr(x, "physical", None)
    if isinstance(physical, jax.Array) and not isinstance(physical, Tracer) \
            and physical.is_deleted():  # (jaxlib may crash on it; a tracer under jax.grad has
        # no buffers to ask about)
        raise ReshardError(f"a DistTensor {_describe(x)} placed {x.placements} was donated to a "
                           f"dist.jit call (donate_argnums) and its buffers are gone: read that "
                           f"call's result instead, or stop donating it")
    plan = plan_reshard(x, mesh, placements, cost_model=cost_model)
    if not plan.steps and plan.src_mesh == plan.dst_mesh:
        # nothing moves, but the result is a tensor of its own (as Paddle's reshard returns):
        # `y[idx] = v` on it must not write into `x`; the storage is shared (jax arrays are
        # immutable, and item assignment gives a tensor new storage)
        return DistTensor(x.physical, x.mesh, x.layout, x.shape)
    return make_dtensor(execute(plan, x.physical), mesh, plan.dst, x.shape)


def _reshard_keys(x: DistTensor, mesh: ProcessMesh, placements, cost_model) -> DistTensor:
    """PRNG keys move as their key data: unsigned words with one more dim, never split."""
    dst = layout_from_placements(placements, mesh, x.shape, what=f"the tensor {_describe(x)}")
    if dst.partial:
        raise key_partial_error(f"dist.reshard of the tensor {_describe(x)}", dst.placements(mesh))
    data = jax.random.key_data(x.physical)
    extra = ((),) * (data.ndim - x.physical.ndim)
    plan = plan_layouts(x.shape + data.shape[x.physical.ndim:], dtype_name(data.dtype), x.mesh,
                        Layout(x.layout.dims + extra), mesh, Layout(dst.dims + extra),
                        cost_model or default_cost_model())
    if not plan.steps and plan.src_mesh == plan.dst_mesh:
        return x
    moved = jax.random.wrap_key_data(execute(plan, data), impl=jax.random.key_impl(x.physical))
    return make_dtensor(moved, mesh, dst, x.shape)


def _describe(x: DistTensor) -> str:
    return f"{dtype_name(x.dtype)}{list(x.shape)}"


__all__ = ["plan_reshard", "reshard", "plan_layouts", "to_even"]
