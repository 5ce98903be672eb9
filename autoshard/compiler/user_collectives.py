"""A user's own `jax.shard_map` inside a dist.jit function: its collectives pass through.

A user who writes `jax.shard_map(body, mesh, in_specs, out_specs)` with `lax.psum(x, "mp")`
inside has already decided the layouts and the communication of that region. The planner takes
them as given: the operands are resharded to the layouts `in_specs` name, the results have the
layouts `out_specs` name, and the body runs unchanged on the local blocks — the partitioned
program is already manual over every mesh axis, so the user's psum / all_gather / ppermute bind
as written. The body's collectives are listed in the plan like the planner's own.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from ..errors import MeshMismatchError, PlacementError
from ..layout import Layout
from ..mesh import ProcessMesh
from ..reshard.steps import ensure_varying, varying_axes

SHARD_MAP = "shard_map"

# collective primitive name → (HLO kind, bytes each device sends per byte of its input, by n)
_COLLECTIVES = {
    "psum": ("all-reduce", lambda n: 2 * (n - 1) / n),
    "psum_invariant": ("all-reduce", lambda n: 2 * (n - 1) / n),
    "pmax": ("all-reduce", lambda n: 2 * (n - 1) / n),
    "pmin": ("all-reduce", lambda n: 2 * (n - 1) / n),
    "all_gather": ("all-gather", lambda n: n - 1),
    "all_gather_invariant": ("all-gather", lambda n: n - 1),
    "reduce_scatter": ("reduce-scatter", lambda n: (n - 1) / n),
    "psum_scatter": ("reduce-scatter", lambda n: (n - 1) / n),
    "all_to_all": ("all-to-all", lambda n: (n - 1) / n),
    "ppermute": ("collective-permute", lambda n: 1.0),
}


def spec_layout(spec: Any, ndim: int) -> Layout:
    """The Layout a PartitionSpec names (None dims whole, tuples of axes major-to-minor)."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    dims = []
    for entry in entries:
        if entry is None:
            dims.append(())
        elif isinstance(entry, (tuple, list)):
            dims.append(tuple(entry))
        else:
            dims.append((entry,))
    return Layout(tuple(dims))


def check_mesh(e, mesh: ProcessMesh) -> None:
    """The user's shard_map must run on the program's mesh (same axes, sizes and devices)."""
    user = e.params["mesh"]
    names = tuple(getattr(user, "axis_names", ()))
    sizes = tuple(user.axis_sizes)
    ours = mesh.to_jax()
    same_devices = True
    if hasattr(user, "devices") and not isinstance(user, jax.sharding.AbstractMesh):
        same_devices = [d.id for d in np.asarray(user.devices).flat] == \
            [d.id for d in np.asarray(ours.devices).flat]
    if names != tuple(ours.axis_names) or tuple(sizes) != tuple(ours.axis_sizes) or not same_devices:
        raise MeshMismatchError(
            f"the jax.shard_map at {e.source or '?'} runs on mesh {dict(zip(names, sizes))} but this "
            f"dist.jit program runs on {mesh!r} (axes {dict(zip(ours.axis_names, ours.axis_sizes))}): "
            f"write the shard_map with mesh=mesh.to_jax() of the same ProcessMesh",
            where=e.source)


def plan_shard_map(e, mesh: ProcessMesh) -> tuple[list[Layout], list[Layout]]:
    """(required operand layouts, result layouts) of a user shard_map equation."""
    check_mesh(e, mesh)
    manual = e.params.get("newly_manual_axes", e.params.get("manual_axes"))
    if manual is not None and set(manual) != set(mesh.dim_names):
        # its body was typed with the other axes automatic; dist.jit runs every axis by hand
        auto = [a for a in mesh.dim_names if a not in set(manual)]
        raise PlacementError(
            f"the jax.shard_map at {e.source or '?'} takes mesh axes {sorted(manual)} by hand "
            f"(axis_names=) and leaves {auto} automatic; inside dist.jit every mesh axis is by "
            f"hand: drop axis_names= (in_specs that do not name {auto} keep those dims whole, "
            f"the same values), or use dist.local_map", where=e.source)
    required = [spec_layout(s, len(v.shape)) for s, v in zip(e.params["in_specs"], e.inputs)]
    results = [spec_layout(s, len(v.shape)) for s, v in zip(e.params["out_specs"], e.outputs)]
    return required, results


def body_collectives(e, mesh: ProcessMesh) -> list[tuple[str, str, tuple[str, ...], int]]:
    """(HLO kind, step, mesh axes, bytes per device) of each collective in the user's body; one
    inside a scan (a fori_loop of fixed length) sends its bytes on every iteration."""
    sizes = mesh.axis_sizes
    found = []

    def walk(jaxpr, times: int = 1) -> None:
        for eq in jaxpr.eqns:
            name = eq.primitive.name
            if name in _COLLECTIVES:
                axes = eq.params.get("axes", eq.params.get("axis_name", ()))
                axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
                axes = tuple(a for a in axes if isinstance(a, str))
                n = math.prod(sizes[a] for a in axes) if axes else 1
                if n > 1:
                    kind, factor = _COLLECTIVES[name]
                    nbytes = sum(math.prod(v.aval.shape) * np.dtype(v.aval.dtype).itemsize
                                 for v in eq.invars if hasattr(v.aval, "shape"))
                    found.append((kind, f"{name}({', '.join(axes)})"
                                  + (f" × {times} iterations" if times > 1 else ""), axes,
                                  int(nbytes * factor(n)) * times))
            inner = times * eq.params["length"] if name == "scan" else times
            for sub in jex_core.jaxprs_in_params(eq.params):
                walk(sub, inner)

    walk(e.params["jaxpr"])
    return found


def lower_shard_map(e, ins: list) -> list:
    """The user's body on local blocks, already in the layouts its in_specs name."""
    jaxpr = e.params["jaxpr"]
    # the body was typed with its inputs varying over the axes its in_specs split; a value we
    # made replicated (a constant cotangent, say) must be cast so before the body's first op
    ins = [ensure_varying(x, varying_axes(v.aval)) for x, v in zip(ins, jaxpr.invars)]
    return list(jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, ()))(*ins))


__all__ = ["SHARD_MAP", "spec_layout", "plan_shard_map", "body_collectives", "lower_shard_map"]
