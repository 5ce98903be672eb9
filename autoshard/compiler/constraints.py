"""jax's own `with_sharding_constraint` inside dist.jit: an annotation, like dist.shard_tensor.

Code written for `jax.jit` pins layouts with `jax.lax.with_sharding_constraint(x,
NamedSharding(mesh, P("dp", None)))` (flax's logical constraints end there too). Where the
sharding's mesh is the program's — the same devices and dim names (`ProcessMesh.to_jax()`),
or an abstract mesh of the same names and sizes, as a bare `PartitionSpec` under
`jax.set_mesh` gives — the equation becomes a hint that fixes the value's layout, as
`dist.shard_tensor` inside the function would. A concrete mesh in such a constraint also
tells dist.jit which mesh to run on when no input is placed. A one-device sharding says
nothing about a mesh and stays an identity, as it does on an input. `jax.device_put(x,
NamedSharding(...))` of one array inside the function is read the same way.
"""
from __future__ import annotations

import warnings

from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from ..errors import MeshMismatchError, PlacementError
from ..layout import Layout
from ..mesh import ProcessMesh, as_process_mesh
from ..physical import layout_of_spec
from ..uneven import even_part, warn_uneven
from .trace import Program, hint_p, params_key

NAME = "sharding_constraint"
PUT = "device_put"  # jax.device_put(x, sharding) inside a traced function means the same


class IgnoredConstraintWarning(UserWarning):
    """A `with_sharding_constraint` that autoshard cannot express was left to the plan."""


def _sharding(e):
    """The sharding equation `e` asks its value to have (None: it is not such a request)."""
    if e.name == NAME:
        return e.params.get("sharding")
    if e.name == PUT and len(e.inputs) == 1:
        target = e.params.get("devices", (None,))[0]
        return target if isinstance(target, NamedSharding) else None
    return None


def _what(e) -> str:
    return "with_sharding_constraint" if e.name == NAME else "device_put"


def meshes(program: Program) -> list[tuple[ProcessMesh, str]]:
    """(mesh, where) of each constraint whose sharding names concrete devices."""
    found = []
    for e in program.eqns:
        sharding = _sharding(e)
        if (isinstance(sharding, NamedSharding) and sharding.mesh.size > 1
                and not isinstance(sharding.mesh, AbstractMesh)):
            found.append((as_process_mesh(sharding.mesh), f"the {_what(e)} at {e.source or '?'}"))
    return found


def _layout(e, mesh: ProcessMesh) -> Layout | None:
    """The layout the constraint of equation `e` asks for on `mesh` (None: inexpressible, with
    a warning); raises where it names another mesh."""
    sharding = _sharding(e)
    where = e.source or "?"
    what = _what(e)
    if getattr(sharding, "num_devices", 2) == 1:
        return None  # one device says nothing about a mesh (as a one-device input's sharding)
    if not isinstance(sharding, NamedSharding):
        warnings.warn(f"autoshard: {what} at {where} gives a "
                      f"{type(sharding).__name__}, not a NamedSharding: it is ignored and the "
                      f"plan decides that value's layout — write "
                      f"NamedSharding(mesh.to_jax(), PartitionSpec(...)) or dist.shard_tensor",
                      IgnoredConstraintWarning, stacklevel=2)
        return None
    jm = sharding.mesh
    sizes = dict(zip(jm.axis_names, jm.axis_sizes))
    if not isinstance(jm, AbstractMesh) and as_process_mesh(jm) != mesh:
        raise MeshMismatchError(
            f"{what} at {where} is on {as_process_mesh(jm)!r} but the program "
            f"runs on {mesh!r}: build its NamedSharding on the program's mesh "
            f"(mesh.to_jax()), or use dist.shard_tensor(x, mesh, placements)", where=where)
    spec = tuple(sharding.spec)
    if e.params.get("unconstrained_dims") or any(p is PartitionSpec.UNCONSTRAINED for p in spec):
        warnings.warn(f"autoshard: {what} at {where} leaves dims "
                      f"UNCONSTRAINED ({sharding.spec}): a layout is fixed whole, so this one is "
                      f"ignored and the plan decides — give every dim (None to keep it whole)",
                      IgnoredConstraintWarning, stacklevel=2)
        return None
    shape = tuple(e.inputs[0].shape)
    layout = layout_of_spec(spec, len(shape))
    for a in sorted(layout.used_axes):
        if a not in mesh.dim_names or sizes.get(a) != mesh.get_dim_size(a):
            raise PlacementError(
                f"{what} at {where} splits over mesh axis {a!r} "
                f"(size {sizes.get(a)}), which the program's mesh {mesh!r} does not have "
                f"with that size: name its dims {list(mesh.dim_names)}", where=where)
    even = even_part(layout, mesh, shape)
    if even is not layout:  # programs compute on even layouts only (uneven.py)
        warn_uneven(layout, mesh, shape, f"the value constrained at {where}",
                    "is computed with that dim whole inside dist.jit")
    return even


def as_hints(program: Program, mesh: ProcessMesh) -> None:
    """Rewrite, in place, each expressible constraint of `program` as a hint on `mesh`."""
    for e in program.eqns:
        name = e.primitive.name  # (most equations are neither: skipped before any call)
        if (name != NAME and name != PUT) or _sharding(e) is None:
            continue
        layout = _layout(e, mesh)
        if layout is None:
            continue  # stays an identity (rules/elementwise.py)
        e.primitive = hint_p
        e.params = {"mesh": mesh, "layout": layout, "force": False}
        e.params_key = params_key(e.params)
        e.sharding_cache.clear()
        program.__dict__.pop("_facts", None)  # (propagate.eqn_facts: its signature is a hint's)


__all__ = ["IgnoredConstraintWarning", "as_hints", "meshes"]
