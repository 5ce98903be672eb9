"""Sub-axes: a program planned on the mesh with one of its axes split in two, where a reshape
splits a dim finer than that axis.

`jax.nn.dot_product_attention` with 8 query heads split over mp = 4 and 2 key-value heads
reshapes the queries to (2, 4): no split of a dim of 2 over 4 devices exists, so on the user's
mesh the plan moves the heads (an all-to-all, rules/shape.py's moved axis) or gathers them.
Seen as two axes of 2 — mp.0 the major, mp.1 the minor, the devices reshaped in order, so a dim
split over (mp.0, mp.1) is exactly a dim split over mp — the reshape gives mp.0 the key-value
heads and mp.1 the group (a compound dim) and moves nothing. Shardy calls these sub-axes.

The refined plan is made only when some reshape straddles an axis (a compound dim's major piece
sharing a factor with the axis's size but smaller than it) and kept only when the cost model
prices its collectives below those of the plan on the user's mesh. Its inputs and outputs must be
layouts of the user's mesh (a sub-axis pair adjacent, major first); the program runs as one
shard_map on the refined jax mesh, whose devices are the user's in the same order, so arrays
cross the boundary without moving. Programs that name mesh axes themselves (collectives, a
shard_map, sharding constraints, annotations inside loop bodies) keep the user's mesh.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from jax import lax

from ..cost_model import CostModel
from ..layout import Layout
from ..mesh import ProcessMesh
from .control_flow import HIGHER_ORDER
from .propagate import rule_sharding
from .trace import Program, hint_p, params_key

ENABLED = True  # off: every program is planned on the user's mesh (the tests compare both)

# params that name mesh axes or meshes: a program with them keeps the user's axes
_NAMING = frozenset({"axis_name", "axes", "mesh", "sharding", "shardings", "axis_names"})


def sub_names(axis: str) -> tuple[str, str]:
    return f"{axis}.0", f"{axis}.1"


@dataclass(frozen=True)
class Refinement:
    """The user's mesh, and per split axis the size of its major sub-axis."""

    user_mesh: ProcessMesh
    split: tuple[tuple[str, int], ...]  # (axis, major size), in mesh order

    @property
    def mesh(self) -> ProcessMesh:
        """The refined mesh: each split axis replaced by its two sub-axes, devices in order."""
        found = self.__dict__.get("_mesh")
        if found is None:
            major = dict(self.split)
            shape, names = [], []
            for name, n in zip(self.user_mesh.dim_names, self.user_mesh.shape):
                if name in major:
                    shape += [major[name], n // major[name]]
                    names += sub_names(name)
                else:
                    shape.append(n)
                    names.append(name)
            found = ProcessMesh(self.user_mesh.id_array.reshape(shape), names)
            object.__setattr__(self, "_mesh", found)
        return found

    def refined(self, layout: Layout) -> Layout:
        """A layout of the user's mesh on the refined one (an axis becomes its two halves)."""
        major = dict(self.split)

        def axes(names):
            return tuple(a for n in names for a in (sub_names(n) if n in major else (n,)))
        return Layout(tuple(axes(d) for d in layout.dims),
                      tuple((a, t) for n, t in layout.partial for a in axes((n,))))

    def user(self, layout: Layout) -> Layout | None:
        """The layout in the user's mesh's axes; None where a sub-axis stands alone (or the
        two are out of order), which the user's mesh cannot express."""
        if self.coarsened(layout) is not layout:  # (layouts are interned)
            return None
        major = {sub_names(a)[0]: a for a, _ in self.split}
        minor = {sub_names(a)[1] for a, _ in self.split}
        return Layout(tuple(tuple(major.get(a, a) for a in names if a not in minor)
                            for names in layout.dims),
                      tuple((major.get(a, a), t) for a, t in layout.partial if a not in minor))

    def coarsened(self, layout: Layout) -> Layout:
        """`layout` without its lone sub-axes (gathered, or reduced where Partial): the
        nearest layout the user's mesh can hold."""
        pairs = {sub_names(a): a for a, _ in self.split}
        halves = {h for pair in pairs for h in pair}

        def keep(names):
            out, k = [], 0
            while k < len(names):
                if tuple(names[k:k + 2]) in pairs:
                    out += names[k:k + 2]
                    k += 2
                    continue
                if names[k] not in halves:
                    out.append(names[k])
                k += 1
            return tuple(out)
        partial = dict(layout.partial)
        kept = [(a, t) for a, t in layout.partial if a not in halves or all(
            partial.get(h) == t for pair in pairs if a in pair for h in pair)]
        return Layout(tuple(keep(d) for d in layout.dims), tuple(kept))

    def completed(self, layout: Layout, shape) -> Layout | None:
        """`layout` with each lone sub-axis joined by its other half on the same dim (a local
        slice, or a reduce-scatter where that half is Partial): a layout of the user's mesh
        split finer; None where the other half splits another dim or the dim is too small."""
        sizes = self.mesh.axis_sizes
        halves = {h: pair for a, _ in self.split for pair in [sub_names(a)] for h in pair}
        used = {a for names in layout.dims for a in names}
        dims, joined = [], set()
        for names, size in zip(layout.dims, shape):
            out = []
            for k, a in enumerate(names):
                pair = halves.get(a)
                if pair is None or (a == pair[0] and names[k + 1:k + 2] == (pair[1],)) or (
                        a == pair[1] and k and names[k - 1] == pair[0]):
                    out.append(a)
                    continue
                other = pair[1] if a == pair[0] else pair[0]
                if other in used:
                    return None
                out += list(pair)
                joined.add(other)
            if size % math.prod(sizes[a] for a in out):
                return None
            dims.append(tuple(out))
        finer = Layout(tuple(dims), tuple(p for p in layout.partial if p[0] not in joined))
        return finer if self.user(finer) is not None else None

    def cost_model(self, model: CostModel) -> CostModel:
        """`model` with an axis's own latency and bandwidth given to both its halves."""
        def halves(table):
            major = dict(self.split)
            return tuple((h, v) for a, v in table for h in (sub_names(a) if a in major else (a,)))
        return dataclasses.replace(model, latency=halves(model.latency),
                                   bandwidth=halves(model.bandwidth))

    def describe(self) -> str:
        sizes = self.user_mesh.axis_sizes
        return "; ".join(f"{a} ({sizes[a]}) planned as {sub_names(a)[0]} × {sub_names(a)[1]} "
                         f"({g} × {sizes[a] // g})" for a, g in self.split)


def straddled(program: Program, mesh: ProcessMesh, registry) -> Refinement | None:
    """The split that lets a reshape of this program keep an axis on a dim smaller than it:
    for the first compound dim whose major piece p shares a factor g with an axis of n devices
    (1 < g < n), that axis as (g, n / g). None if no reshape straddles, or the program names
    mesh axes itself."""
    major: dict[str, int] = {}
    # (an axis whose halves' names the mesh already uses is left whole)
    sizes = {a: n for a, n in mesh.axis_sizes.items()
             if not set(sub_names(a)) & set(mesh.dim_names)}

    def note(opsh) -> None:
        for pieces in () if opsh is None else opsh.compounds:
            p = opsh.factors[pieces[0]].size
            for axis, n in sizes.items():
                g = math.gcd(p, n)
                if axis not in major and 1 < g < n:
                    major[axis] = g

    rule, reshape, seen = registry.lookup(lax.reshape_p), lax.reshape_p, set()
    for e in program.eqns:  # every equation of a deep model: kept to two checks each
        p = e.primitive
        if p is reshape:
            opsh = rule_sharding(e, registry)
            if opsh is not None and opsh.compounds and id(opsh) not in seen:
                seen.add(id(opsh))  # interned: every layer's reshape is one object
                note(opsh)
            continue
        if p.name not in HIGHER_ORDER:
            continue
        for inner in _jaxprs(e.params):  # a loop body's (a scan over layers)
            for x in _reshapes(inner):
                try:
                    note(rule.sharding([v.aval for v in x.invars], [v.aval for v in x.outvars],
                                       **x.params))
                except (TypeError, ValueError, KeyError, IndexError, AssertionError):
                    pass  # as propagation does: an instance the rule does not describe
    if not major or _names_axes(program):
        return None
    return Refinement(mesh, tuple((a, major[a]) for a in mesh.dim_names if a in major))


def _names_axes(program: Program) -> bool:
    for e in program.eqns:
        if e.primitive is hint_p:
            continue
        if _naming(e.params) or any(_inner_names(j) for j in _jaxprs(e.params)):
            return True
    return False


def _naming(params: dict) -> bool:
    """Whether params name mesh axes or a mesh (`axes` of a reduction are dims, not names;
    an op's `sharding` is None outside jax's explicit mode)."""
    for key in _NAMING & params.keys():
        value = params[key]
        if value is None or (key == "axes" and not any(
                isinstance(a, str) for a in (value if isinstance(value, tuple) else (value,)))):
            continue
        return True
    return False


def _jaxprs(params: dict):
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            inner = getattr(x, "jaxpr", x)
            if hasattr(inner, "eqns"):
                yield inner


def _reshapes(jaxpr):
    for e in jaxpr.eqns:
        if e.primitive is lax.reshape_p:
            yield e
        for inner in _jaxprs(e.params):
            yield from _reshapes(inner)


def _inner_names(jaxpr) -> bool:
    """Whether a body names mesh axes (an annotation included: it holds the user's mesh)."""
    for e in jaxpr.eqns:
        if e.primitive is hint_p or _naming(e.params):
            return True
        if any(_inner_names(j) for j in _jaxprs(e.params)):
            return True
    return False


def refined_plan(plan, program: Program, output_targets: list, registry,
                 cost_model: CostModel):
    """`plan` (made on the user's mesh), or the plan on the refined mesh where some reshape
    straddles an axis and the cost model prices that one's collectives cheaper, with the same
    inputs and outputs the user's mesh can hold."""
    # (imported here: plan.py's Plan refers to this module's Refinement)
    from .plan import make_plan, plan_seconds

    r = straddled(program, plan.mesh, registry) if ENABLED else None
    if r is None:
        return plan
    saved = [(e, e.params, e.params_key) for e in program.eqns if e.primitive is hint_p]
    try:
        for e, params, _ in saved:  # annotations hold the user's mesh and layout
            e.params = {**params, "mesh": r.mesh, "layout": r.refined(params["layout"])}
            e.params_key = params_key(e.params)
        # unplaced inputs as the user's plan placed them; outputs it decided are free, and
        # if the refined plan leaves one on a sub-axis alone, planned once more with each
        # such output moved to what the user's mesh holds: the lone sub-axes gathered, or
        # joined by their other halves (split finer), whichever prices cheaper
        model = r.cost_model(cost_model)
        ins = [r.refined(L) for L in plan.inputs]
        targets = [r.refined(t) if isinstance(t, Layout) else t for t in output_targets]
        other = make_plan(program, r.mesh, ins, targets, registry, model, top_level=False)
        lone = [r.user(L) is None for L in other.outputs]
        if any(lone):
            tries = [[r.coarsened(L) if x else t
                      for t, L, x in zip(targets, other.outputs, lone)]]
            finer = [r.completed(L, v.shape) if x else t
                     for t, L, v, x in zip(targets, other.outputs, program.outputs, lone)]
            if all(t is not None or not x for t, x in zip(finer, lone)):
                tries.append(finer)
            other = min((make_plan(program, r.mesh, ins, t, registry, model, top_level=False)
                         for t in tries), key=lambda p: plan_seconds(p, model))
    finally:
        for e, params, key in saved:
            e.params, e.params_key = params, key
    if plan_seconds(other, model) >= plan_seconds(plan, cost_model):
        return plan
    if any(r.user(L) is None for L in (*other.inputs, *other.outputs)):
        return plan
    other.refinement = r
    return other


__all__ = ["Refinement", "straddled", "sub_names", "refined_plan", "ENABLED"]
