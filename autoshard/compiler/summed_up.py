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

from ..placement import ReduceType
from .factors import PASS
from .trace import Program

# reductions whose every result is a scalar sum up their operand: a split operand costs one
# scalar combine
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_and", "reduce_or",
                         "reduce_prod", "reduce_xor", "argmax", "argmin"})


def _elementwise(sig) -> bool:
    """Every dim passes: a split on any of them stays a split of the result."""
    return sig is not None and not sig.opsh.compounds and all(
        f.kind == PASS for f in sig.opsh.factors)


def scatter_candidates(plan) -> frozenset[int]:
    """Equations of `plan` that are elementwise, whose results are only summed up, and that
    read a value pending a sum (in the plan, or before steps the reduction was hoisted above)
    which another of its readers wants split along the sum's axis (its results' preferred
    layouts split a dim over it: a ZeRO-sharded update) — see the module docstring."""
    program: Program = plan.program
    signatures, layouts, pref = plan.signatures, plan.layouts, plan.preferred
    readers = program.readers()
    outputs = set(program.outputs)
    eqns = program.eqns
    memo: dict[int, bool] = {}

    def summed(k: int) -> bool:
        """Every result of equation k is read only by scalar reductions or by elementwise
        steps whose results are in turn only summed up."""
        found = memo.get(k)
        if found is not None:
            return found
        memo[k] = False  # (no cycles in a program; a guard all the same)
        ok = True
        for v in eqns[k].outputs:
            rs = readers.get(v)
            if not rs or v in outputs:
                ok = False
                break
            for j, _ in rs:
                r = eqns[j]
                if r.primitive.name in _REDUCTIONS and all(not o.shape for o in r.outputs):
                    continue
                if not (_elementwise(signatures[j]) and summed(j)):
                    ok = False
                    break
            if not ok:
                break
        memo[k] = ok
        return ok

    def pending(v) -> set:
        """The axes of the sum `v` pends in the plan, or pended before steps of one operand
        the plan hoisted its reduction above (a transpose of a weight gradient)."""
        for _ in range(8):
            L = layouts.get(v)
            if L is None:
                return set()
            sums = {a for a, t in L.partial if t is ReduceType.SUM}
            if sums or v.producer < 0:
                return sums
            e = eqns[v.producer]
            ins = [x for x in e.inputs if not x.is_const]
            if len(ins) != 1 or not _elementwise(signatures[e.index]):
                return set()
            v = ins[0]
        return set()

    def wanted(v, k: int, axes: set) -> bool:
        """Another reader of `v` prefers a result split over one of `axes`."""
        for j, _ in readers.get(v, ()):
            if j == k or (_elementwise(signatures[j]) and summed(j)):
                continue
            for o in eqns[j].outputs:
                P = pref.get(o)
                if P is not None and any(a in axes for dim in P.dims for a in dim):
                    return True
        return False

    found = set()
    for e in eqns:
        k = e.index
        if not _elementwise(signatures[k]):
            continue
        for v in e.inputs:
            axes = pending(v) if not v.is_const else set()
            if axes and wanted(v, k, axes) and summed(k):
                found.add(k)
                break
    return frozenset(found)


SMALL = 1024  # elements: a value this small is reduced by its latency, not its bytes


def small_tail(program: Program, start: frozenset[int]) -> frozenset[int]:
    """The equations after `start` whose results are small and that read, directly or through
    such equations, what `start` computes: the reductions of the sums up and what combines
    their scalars (a norm over every gradient, one finiteness flag). The plan sets aside their
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
