"""Pipeline stages of an nnx model for `dist.parallelize`'s pp_config (Paddle's `split_spec`
and `SplitPoint`): which stage each layer belongs to, and where activations move on.

Layers are taken in definition order (the order their attributes were set in `__init__`,
depth first), as Paddle takes `named_sublayers()`: everything before the first split belongs
to stage 0, everything after the last to the last stage. `split_spec` is either the dotted path
of a layer list (`"blocks"`, an nnx.List), cut into as many equal runs as the mesh's pp dim
has stages, or `{layer path: SplitPoint.END or SplitPoint.BEGINNING}` naming each cut — a
multiple of pp stages gives each pp rank several model chunks (stage c on rank c mod pp, the
interleaved "VPP" layout). The first layer of every later stage gets an input hook that moves
its positional array arguments to its stage's mesh (`dist.reshard`, the batch split over dp) —
the reshard a Paddle user writes by hand in the forward, which dist.jit / to_static then cut
into one program per stage.
"""
from __future__ import annotations

import enum
from typing import Any

import jax
import numpy as np

from ..dtensor import DistTensor
from ..errors import AutoshardError
from ..mesh import ProcessMesh
from ..placement import Placement, Replicate, Shard


class SplitPoint(enum.Enum):
    """Where a pipeline stage ends: before (BEGINNING) or after (END) the named layer."""

    BEGINNING = "BEGINNING"
    END = "END"


def definition_order(model: Any) -> list[str]:
    """Dotted paths of the model's submodules, depth first in attribute-definition order (the
    root is ""). nnx's own graph walk sorts attributes by name, which says nothing about the
    order layers run in; the order they were defined in usually does."""
    from flax import nnx

    order: list[str] = []

    def walk(module: Any, path: str) -> None:
        order.append(path)
        for key, value in vars(module).items():
            if key.startswith("_") or not isinstance(value, nnx.Module):
                continue
            walk(value, f"{path}.{key}" if path else str(key))

    walk(model, "")
    return order


def _error(message: str) -> AutoshardError:
    from .layers import ParallelizeError

    return ParallelizeError(message)


def stage_starts(order: list[str], modules: dict, spec: Any, stages: int) -> list[str]:
    """The first layer of each stage after the first (stages - 1 paths, in order)."""
    position = {path: k for k, path in enumerate(order)}

    def after(path: str) -> str:
        """The first layer after `path` and everything inside it."""
        inside = path + "."
        for later in order[position[path] + 1:]:
            if not later.startswith(inside):
                return later
        raise _error(f"pp_config split_spec: nothing is defined after layer {path!r}, so no "
                     f"stage can start there: split at an earlier layer")

    if isinstance(spec, str):
        if spec not in modules:
            raise _error(f"pp_config split_spec {spec!r} names no layer; the layers are "
                         f"{order[1:13]}{' ...' if len(order) > 13 else ''}")
        items = [p for p in order if p.startswith(spec + ".") and "." not in p[len(spec) + 1:]]
        if not items:
            raise _error(f"pp_config split_spec {spec!r} is a {type(modules[spec]).__name__} "
                         f"without layers in it: name a layer list (e.g. an nnx.List of blocks)")
        if not all(p.rpartition(".")[2].isdigit() for p in items):
            raise _error(f"pp_config split_spec {spec!r} is a {type(modules[spec]).__name__} whose "
                         f"parts ({', '.join(p[len(spec) + 1:] for p in items[:6])}) are not a "
                         f"list of layers; stacked layers (one module whose params carry a leading "
                         f"layer dim, made by nnx.vmap and run by nnx.scan) cannot be cut into "
                         f"stages: keep the layers in an nnx.List to pipeline them")
        if len(items) % stages:
            raise _error(f"pp_config split_spec {spec!r} has {len(items)} layers, which do not cut "
                         f"into {stages} equal stages (the mesh's pp dim): use a number of layers "
                         f"divisible by {stages}, or name each cut with {{layer: "
                         f"dist.SplitPoint.END}}")
        per = len(items) // stages
        return [items[k * per] for k in range(1, stages)]
    if not isinstance(spec, dict):
        raise _error(f"pp_config split_spec must be a layer-list path (str) or a dict {{layer "
                     f"path: dist.SplitPoint}}, got {type(spec).__name__}")
    starts = []
    for path, point in spec.items():
        if path not in modules:
            raise _error(f"pp_config split_spec names layer {path!r}, which the model does not "
                         f"have; its layers are {order[1:13]}{' ...' if len(order) > 13 else ''}")
        if not isinstance(point, SplitPoint):
            raise _error(f"pp_config split_spec[{path!r}] is {point!r}: write "
                         f"dist.SplitPoint.END or dist.SplitPoint.BEGINNING")
        starts.append(path if point is SplitPoint.BEGINNING else after(path))
    if not starts or (len(set(starts)) + 1) % stages:
        raise _error(f"pp_config split_spec makes {len(set(starts)) + 1} stages, but the mesh's "
                     f"pp dim has {stages}: name {stages - 1} distinct cuts (or a multiple of "
                     f"{stages} stages less one, for several model chunks per pp rank)")
    return sorted(set(starts), key=position.__getitem__)


def even_cuts(model: Any, spec: Any, stages: int) -> str | None:
    """A split_spec dict, as Python source, cutting the layer list `spec` (a path) into
    `stages` equal runs — None when `spec` names no layer list that divides so."""
    if not isinstance(spec, str):
        return None
    order = definition_order(model)
    items = [p for p in order if p.startswith(spec + ".") and "." not in p[len(spec) + 1:]]
    if not items or len(items) % stages or len(items) < stages:
        return None
    per = len(items) // stages
    return "{" + ", ".join(f"{items[k * per - 1]!r}: dist.SplitPoint.END"
                           for k in range(1, stages)) + "}"


def module_stages(order: list[str], starts: list[str]) -> dict[str, int]:
    """Each layer's stage: the number of stage starts at or before it in definition order."""
    out, stage, begins = {}, 0, set(starts)
    for path in order:
        if path in begins:
            stage += 1
        out[path] = stage
    return out


def batch_placements(mesh: ProcessMesh, dp_dim: str, x: Any) -> list[Placement]:
    """An activation's placements on a stage mesh: the batch (dim 0) split over dp where it
    divides, everything else replicated."""
    shape = tuple(np.shape(x))
    return [Shard(0) if name == dp_dim and shape and shape[0] % mesh.get_dim_size(name) == 0
            else Replicate() for name in mesh.dim_names]


def move_inputs(mesh: ProcessMesh, dp_dim: str, args: tuple) -> tuple:
    """The stage's input hook: its positional array arguments moved onto its mesh."""
    from ..reshard.api import reshard

    def move(x: Any) -> Any:
        if isinstance(x, (DistTensor, jax.core.Tracer)):
            return reshard(x, mesh, batch_placements(mesh, dp_dim, x))
        return x

    return tuple(move(a) for a in args)


__all__ = ["SplitPoint", "definition_order", "stage_starts", "module_stages", "even_cuts", "batch_placements",
           "move_inputs"]
