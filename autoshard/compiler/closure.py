"""Sharded arrays a function closes over enter its program as placed inputs, not constants.

`dist.jit(lambda x: model(x))`, `dist.jit(model)` and any function reading a global DistTensor
meet the tensor while jax traces them: it arrives as its global jax.Array (DistTensor's
`__jax_array__`), which jax records as a constant of the jaxpr. As a constant it would be
baked into the HLO whole on every device — a tensor-parallel model's weights replicated, the
layout the user chose lost, a large model's weights copied into the executable. Each one
sharded over a mesh becomes an extra input instead, laid out as it is stored; the program
passes the same array on every call. As with jax.jit, what a closure held when the function
was traced is what the program reads (pass a tensor as an argument for it to follow updates).
"""
from __future__ import annotations

from typing import Any

from ..physical import layout_of_spec, mesh_sharding
from ..mesh import as_process_mesh
from ..uneven import is_uneven


def hoist_sharded_consts(closed: Any, input_meshes: set) -> tuple[Any, tuple]:
    """`closed` with each even constant sharded over the program's mesh turned into a
    trailing input, and those constants in order (empty, and `closed` itself, when there are
    none). The program's mesh is its inputs' (`input_meshes`), or with no placed input the
    first sharded constant's; a constant on another mesh stays a constant, as before."""
    keep_vars, keep_vals, moved_vars, moved_vals = [], [], [], []
    target = next(iter(input_meshes)) if len(input_meshes) == 1 else None
    for var, val in zip(closed.jaxpr.constvars, closed.consts):
        # (a mesh of one device too: a model placed for inference on one device)
        sharding = mesh_sharding(val, one_device=True)
        mesh = as_process_mesh(sharding.mesh) if sharding is not None else None
        if mesh is not None and target is None and not input_meshes:
            target = mesh
        if mesh is not None and mesh == target and not is_uneven(
                layout_of_spec(sharding.spec, val.ndim), mesh, val.shape):
            moved_vars.append(var)
            moved_vals.append(val)
        else:
            keep_vars.append(var)
            keep_vals.append(val)
    if not moved_vars:
        return closed, ()
    jaxpr = closed.jaxpr
    debug = jaxpr.debug_info
    jaxpr = jaxpr.replace(constvars=keep_vars, invars=list(jaxpr.invars) + moved_vars,
                          debug_info=debug.with_unknown_names() if debug is not None else None)
    return type(closed)(jaxpr, keep_vals), tuple(moved_vals)  # ClosedJaxpr (its home moves)


__all__ = ["hoist_sharded_consts"]
