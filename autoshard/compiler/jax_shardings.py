"""jax.jit's `in_shardings` / `out_shardings` on dist.jit, so code written for jax.jit moves over
by changing the decorator's name.

`in_shardings` places the arguments before the call (a pytree prefix of the positional
arguments, as jax.jit takes it: one sharding for all, None for "as they come"): an array is
placed as `shard_tensor` places it (a dim the mesh does not divide split unevenly, as
everywhere in autoshard), a DistTensor laid out otherwise is resharded to it. The
plan then starts from those layouts, as from any placed input. `out_shardings` becomes
`out_placements` (a pytree prefix of the result). Leaves are NamedShardings, or bare
PartitionSpecs under `jax.set_mesh(mesh)` as jax.jit reads them.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax._src.tree_util import broadcast_prefix  # jax.jit's own prefix matching
from jax.sharding import NamedSharding, PartitionSpec

from ..dtensor import DistTensor
from ..errors import MeshMismatchError, PlacementError, PlacementTypeError
from ..mesh import as_process_mesh
from ..physical import host_memory, layout_of_spec


def _is_sharding(x: Any) -> bool:
    return x is None or isinstance(x, (NamedSharding, PartitionSpec))


def _named(s: Any, what: str) -> NamedSharding | None:
    if s is None or isinstance(s, NamedSharding):
        return s
    from jax._src.mesh import get_concrete_mesh  # jax.set_mesh's concrete mesh

    mesh = get_concrete_mesh()
    if mesh is None or getattr(mesh, "empty", False) or not mesh.axis_names:
        raise PlacementTypeError(
            f"{what} is a bare PartitionSpec {s} with no mesh: give "
            f"NamedSharding(mesh.to_jax(), {s}) or call under jax.set_mesh(mesh.to_jax())")
    return NamedSharding(mesh, s)


def _placements(s: NamedSharding) -> list:
    spec = tuple(s.spec)
    return layout_of_spec(spec, len(spec)).placements(as_process_mesh(s.mesh))


def place_arguments(in_shardings: Any, args: tuple) -> tuple:
    """`args` laid out as `in_shardings` (a pytree prefix of the tuple of arguments) says."""
    from ..creation import offload, shard_tensor
    from ..reshard.api import reshard

    spec = in_shardings
    if _is_sharding(spec):
        spec = (spec,) * len(args)
    elif isinstance(spec, list):
        spec = tuple(spec)
    try:
        per_leaf = broadcast_prefix(
            spec, tuple(args), is_leaf=lambda x: isinstance(x, DistTensor) or x is None)
    except ValueError as exc:
        raise PlacementTypeError(
            f"in_shardings does not match the arguments: give one sharding per positional "
            f"argument (a pytree prefix of each, None to leave it as it comes) ({exc})") from None
    leaves, tree = jax.tree.flatten(tuple(args), is_leaf=lambda x: isinstance(x, DistTensor))
    placed = []
    for k, (x, s) in enumerate(zip(leaves, per_leaf)):
        s = _named(s, f"in_shardings for argument leaf {k}")
        if s is None:
            placed.append(x)
            continue
        if len(s.spec) > np.ndim(x):
            raise PlacementError(
                f"in_shardings for argument leaf {k} is {s.spec}, of {len(s.spec)} dims, but "
                f"the argument has {np.ndim(x)} (shape {list(np.shape(x))}): give a spec of at "
                f"most {np.ndim(x)} entries")
        target = _placements(s)
        mesh = as_process_mesh(s.mesh)
        if isinstance(x, DistTensor):
            x = x if (x.mesh, x.placements) == (mesh, target) else reshard(x, mesh, target)
        else:  # as shard_tensor places it: also where the mesh does not divide a dim
            x = shard_tensor(x, mesh, target)
        placed.append(offload(x, host_memory(s)) if host_memory(s) else x)
    return tuple(jax.tree.unflatten(tree, placed))


def as_out_placements(out_shardings: Any) -> Any:
    """`out_shardings` written as out_placements (placements lists where shardings were)."""
    return jax.tree.map(
        lambda s: None if s is None else _placements(_named(s, "out_shardings")),
        out_shardings, is_leaf=_is_sharding)


def out_meshes(out_shardings: Any) -> list:
    """The meshes `out_shardings` names (bare PartitionSpecs: jax.set_mesh's)."""
    return [as_process_mesh(_named(s, "out_shardings").mesh)
            for s in jax.tree.leaves(out_shardings, is_leaf=_is_sharding) if s is not None]


def check_out_mesh(out_shardings: Any, mesh, name: str) -> None:
    """Every NamedSharding of `out_shardings` on the program's mesh (jax.jit refuses devices
    that differ too); its placements would otherwise be read against another mesh's dims."""
    for other in out_meshes(out_shardings):
        if other != mesh:
            raise MeshMismatchError(
                f"out_shardings of {name} names {other!r}, but the program "
                f"runs on {mesh!r} (its inputs' mesh): give NamedShardings on that mesh "
                f"(NamedSharding(mesh.to_jax(), spec)), or move the result after the call "
                f"with dist.reshard(out, other_mesh, placements)")


def as_out_memory_kinds(out_shardings: Any) -> Any:
    """The host memory kinds `out_shardings` asks for (dist.jit's out_memory_kinds): None if
    none, one kind if every sharding names the same, else one entry per sharding leaf."""
    kinds = [host_memory(s) for s in
             jax.tree.leaves(out_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))]
    if not any(kinds):
        return None
    return kinds[0] if len(set(kinds)) == 1 else kinds


__all__ = ["place_arguments", "as_out_placements", "as_out_memory_kinds", "check_out_mesh",
           "out_meshes"]
