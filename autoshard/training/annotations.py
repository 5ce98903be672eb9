"""Placements a parameter already carries: flax's sharding annotations, sharded jax.Arrays.

A flax user marks parameters with `nnx.with_partitioning(init, (None, "mp"))` (kept as the
Param's `out_sharding` metadata; under `jax.set_mesh` flax also shards the value eagerly) or
linen's `nn.with_partitioning` (an `nn.Partitioned` box in the params tree). shard_layer and
parallelize place such a parameter as annotated — flax's logical axis rules applied first —
where otherwise it would be replicated, silently dropping what the user wrote. A shard_fn's
placement still wins: it runs first.
"""
from __future__ import annotations

from typing import Any

from jax.sharding import PartitionSpec

from ..errors import AutoshardError
from ..mesh import ProcessMesh, as_process_mesh
from ..physical import layout_of_spec, mesh_sharding
from ..placement import Placement


class AnnotationError(AutoshardError, ValueError):
    """A parameter's sharding annotation names what the mesh does not have."""


def placements_of_spec(spec: PartitionSpec | tuple, mesh: ProcessMesh, shape: tuple,
                       path: str, how: str) -> list[Placement]:
    """The placements on `mesh` of a PartitionSpec-like `spec` (per tensor dim: None, a mesh
    dim name, or a tuple of them); `how` says where the spec came from, for the error."""
    spec = tuple(spec)
    if len(spec) > len(shape):
        raise AnnotationError(
            f"parameter {path!r} of shape {shape} is annotated {spec} ({how}): one entry per "
            f"dim at most")
    layout = layout_of_spec(spec, len(shape))
    for name in sorted(layout.used_axes):
        if name not in mesh.dim_names:
            raise AnnotationError(
                f"parameter {path!r} is annotated {spec} ({how}), but {name!r} is not a dim "
                f"of the mesh {list(mesh.dim_names)}: name mesh dims, map logical names to "
                f"them with flax's logical axis rules (nn.logical_axis_rules / "
                f"sharding_rules), or place it with shard_fn")
    return layout.placements(mesh)


def of_array(value: Any, mesh: ProcessMesh, path: str) -> list[Placement] | None:
    """Placements of a jax.Array already sharded on `mesh` (None: not sharded over it — an
    array sharded on another mesh, say the whole mesh when `mesh` is a pipeline stage's, is
    placed afresh on `mesh`, by its annotation where it has one)."""
    sharding = mesh_sharding(value)
    if sharding is None or as_process_mesh(sharding.mesh) != mesh:
        return None
    return placements_of_spec(sharding.spec, mesh, tuple(value.shape), path,
                              "its NamedSharding")


def of_nnx(param: Any, mesh: ProcessMesh, path: str) -> list[Placement] | None:
    """Placements an nnx Param's sharding metadata asks for (None: it has none)."""
    from flax.nnx import spmd

    metadata = param.get_metadata()
    if not (metadata.get("out_sharding") or metadata.get("sharding")):
        return None
    getter = getattr(spmd, "get_var_pspec", None)
    spec = getter(param) if getter is not None else PartitionSpec(*metadata["sharding"])
    return placements_of_spec(spec, mesh, tuple(param.get_value().shape), path,
                              "nnx.with_partitioning")


def unbox_linen(value: Any) -> tuple[Any, PartitionSpec | None]:
    """A linen params leaf without its `nn.Partitioned` box, and the box's spec (logical
    names mapped by the rules in context)."""
    from flax.core import meta

    if isinstance(value, meta.AxisMetadata) and hasattr(value, "get_partition_spec"):
        return value.unbox(), value.get_partition_spec()
    return value, None


__all__ = ["AnnotationError", "placements_of_spec", "of_array", "of_nnx", "unbox_linen"]
