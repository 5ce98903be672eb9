"""Recompute: a split value that a later reader needs whole, made whole where it is made.

The plan decides equations in program order, each by the layouts its operands already have.
A value made from nothing sharded — a zero buffer, an iota, a scatter of replicated indices
into them — takes the layout its first reader prefers; a later reader that needs it whole
then pays a collective for what every device could have computed itself. (jax's derivative
of `x.at[order].set(y)` without `unique_indices` scatters iota ids into zeros and gathers them
back: split over dp by the residual stream, the gather-back became an all-reduce of the whole
id matrix in a mixture-of-experts step.) When no equation planned so far reads the value or
anything it is made from, their plans are rewritten replicated: the reader takes it whole for
the price of computing it whole, and later readers that want it split slice it for free.
"""
from __future__ import annotations

from ..layout import Layout
from .control_flow import HIGHER_ORDER
from .trace import Program, Value, hint_p
from .user_collectives import SHARD_MAP

MAX_EQNS = 8  # a cone longer than this is not cheap to compute twice
# contractions cost more to compute whole than the collective they would save; random
# generators without a key and effects must not run again
_NEVER = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general", "ragged_dot",
                    "rng_bit_generator", "rng_uniform"})


def _cheap(e, registry, memo: dict) -> bool:
    known = memo.get(e.primitive)
    if known is None:
        known = memo[e.primitive] = _cheap_primitive(e.primitive, registry)
    return known


def _cheap_primitive(p, registry) -> bool:
    if p is hint_p or p.name in HIGHER_ORDER or p.name == SHARD_MAP or p.name in _NEVER:
        return False
    if "callback" in p.name:  # a host effect runs once
        return False
    rule = registry.lookup(p)
    return rule is not None and rule.comm is None  # a rule that communicates is not local


def cone(v: Value, at: int, floor: int, program: Program, actual: dict, plans: list,
         registry, failed: set, memo: dict) -> tuple[int, ...] | None:
    """The equations (ascending) to plan replicated so that `v` is whole with no collective,
    or None. Each reads only constants, whole values, or the cone's own results; none is
    below `floor` (a block other plans were copied from) or read by an equation planned
    before `at` outside the cone; none communicates or contracts. `failed` caches the values
    of cones found impossible (readers only grow and plans before `at` only settle; a value
    whose cone would have passed in a larger one is merely not tried again); `memo` caches
    per primitive whether it is cheap (one plan's registry).
    """
    eqns = program.eqns
    found: set[int] = set()
    seen: list[Value] = []
    stack = [v]
    while stack:
        u = stack.pop()
        if u.is_const or actual[u].is_replicated:
            continue
        p = u.producer
        if p in found:
            continue
        seen.append(u)
        if u in failed or p < floor or len(found) >= MAX_EQNS:
            failed.update(seen)
            return None
        e, ep = eqns[p], plans[p]
        if ep.reshards or ep.fallback or ep.sub_plans or ep.index != p or not _cheap(e, registry, memo):
            failed.update(seen)
            return None
        found.add(p)
        stack.extend(e.inputs)
    readers = program.readers()
    for p in found:
        for w in eqns[p].outputs:
            for j, _ in readers.get(w, ()):
                if j < at and j not in found:
                    failed.update(seen)
                    return None
    return tuple(sorted(found))


def replan(found: tuple[int, ...], reader: str, program: Program, actual: dict,
           plans: list) -> None:
    """Rewrite the plans of the equations `found` (from `cone`) to run replicated."""
    for p in found:
        e, ep = program.eqns[p], plans[p]
        ep.operands = [actual[u] for u in e.inputs]
        ep.required = [Layout.replicated(len(u.shape)) for u in e.inputs]
        ep.results = [Layout.replicated(len(w.shape)) for w in e.outputs]
        ep.strategy = f"replicated: computed whole for {reader}, which needs it whole"
        for w, L in zip(e.outputs, ep.results):
            actual[w] = L


__all__ = ["cone", "replan", "MAX_EQNS"]
