"""Summed up: the steps whose results are only summed up, where a pending sum they read may be
reduce-scattered rather than all-reduced.

A gradient pending over the batch axis is read first by a finiteness check (optax's
apply_if_finite) or a norm (clip_by_global_norm), then by the update. A step cannot take a
pending sum into a square or an `is_finite`, so the first reader reduces it — and with nothing
asking for a shard there, the plan all-reduces it whole. Under ZeRO the update then reads the
gradient split over that very axis: a reduce-scatter would have served both, at half the bytes,
the check reading a shard and combining one scalar.

Those first readers are found here: elementwise steps (every dim passes) whose results reach
nothing but reductions to a scalar, directly or through more such steps. The plan is made again
letting them scatter the sum (`strategy._seeds_scattering`, their results' preferences set
aside: a scalar is all that is left of them), and the cheaper plan by the cost model is kept
(plan.py, `make_plan`). The scattered plan moves fewer bytes in more collectives; on small
tensors the latency of the extra ones outweighs it, and the first plan stays.
"""
from __future__ import annotations

import math

from ..layout import Layout
from ..placement import ReduceType
from .factors import PASS
from .trace import Program

# reductions whose every result is a scalar sum up their operand: a split operand costs one
# scalar combine
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_and", "reduce_or",
                         "reduce_prod", "reduce_xor", "argmax", "argmin"})


def _sums_up(e) -> bool:
    """A reduction of its operand to a scalar."""
    return e.primitive.name in _REDUCTIONS and all(not o.shape for o in e.outputs)


def scatter_candidates(plan) -> dict:
    """Equations of `plan` (index -> the layout wanted for its result, or None) that are
    elementwise, whose results are only summed up, and that read a value pending a sum (in
    the plan, or before steps the reduction was hoisted above) which another of its readers
    wants split along the sum's axis (its results' preferred layouts split a dim over it: a
    ZeRO-sharded update) — see the module docstring."""
    program: Program = plan.program
    signatures, layouts, pref = plan.signatures, plan.layouts, plan.preferred
    readers = program.readers()
    outputs = set(program.outputs)
    eqns = program.eqns
    kinds: dict = {}  # id(signature) -> elementwise (signatures are interned)
    memo: dict[int, bool] = {}

    def elementwise(k: int) -> bool:
        """Every dim passes: a split on any of them stays a split of the result."""
        sig = signatures[k]
        if sig is None:
            return False
        found = kinds.get(id(sig))
        if found is None:
            found = kinds[id(sig)] = not sig.opsh.compounds and all(
                f.kind == PASS for f in sig.opsh.factors)
        return found

    def summed(k: int) -> bool:
        """Every result of equation k is read only by scalar reductions or by elementwise
        steps whose results are in turn only summed up."""
        found = memo.get(k)
        if found is not None:
            return found
        memo[k] = False  # (no cycles in a program; a guard all the same)
        found = memo[k] = all(
            readers.get(v) and v not in outputs
            and all(_sums_up(eqns[j]) or (elementwise(j) and summed(j)) for j, _ in readers[v])
            for v in eqns[k].outputs)
        return found

    def wanted(v, k: int, axes: set):
        """Whether another reader of `v` prefers a result split over one of `axes`, and that
        layout (without its Partials) where the result is shaped as `v`."""
        for j, _ in readers.get(v, ()):
            if j == k or (elementwise(j) and summed(j)):
                continue
            for o in eqns[j].outputs:
                P = pref.get(o)
                if P is not None and any(a in axes for dim in P.dims for a in dim):
                    return True, (P.without_partial() if o.shape == v.shape else None)
        return False, None

    found: dict = {}
    for x, L in layouts.items():
        if not L.partial:
            continue
        axes = {a for a, t in L.partial if t is ReduceType.SUM}
        if not axes:
            continue
        # its elementwise readers; past one-operand steps whose results the plan holds
        # reduced, the reduction hoisted above them (a weight gradient's transpose)
        todo, seen = [x], 0
        while todo and seen < 8:
            v = todo.pop()
            seen += 1
            for j, _ in readers.get(v, ()):
                if not elementwise(j):
                    continue
                if summed(j):
                    want, P = wanted(v, j, axes)
                    if want:
                        # the split that reader wants, for the step's result (same shape: it
                        # is elementwise): the sum is scattered onto the dims the update reads
                        found[j] = P if eqns[j].outputs[0].shape == v.shape else None
                    continue
                e = eqns[j]
                if (sum(1 for u in e.inputs if not u.is_const) == 1
                        and not any(layouts[o].partial for o in e.outputs)):
                    todo.extend(e.outputs)
    return found


SMALL = 1024  # elements: a value this small is reduced by its latency, not its bytes


def small_tail(program: Program, start) -> frozenset[int]:
    """The equations after `start` whose results are small and that read, directly or through
    such equations, what `start` computes: the reductions of the sums up and what combines
    their scalars (a norm over every gradient, one finiteness flag); `start`: equation
    indices (scatter_candidates' keys). The plan sets aside their
    results' preferences, which propagation made for the first plan: a pending scalar is then
    carried to where one collective reduces it, not reduced where a stale preference says."""
    readers = program.readers()
    eqns = program.eqns
    tail: set[int] = set()
    todo = list(start)
    while todo:
        k = todo.pop()
        for v in eqns[k].outputs:
            for j, _ in readers.get(v, ()):
                if j in tail or j in start:
                    continue
                if all(math.prod(o.shape) <= SMALL for o in eqns[j].outputs):
                    tail.add(j)
                    todo.append(j)
    return frozenset(tail)


__all__ = ["scatter_candidates", "small_tail"]
