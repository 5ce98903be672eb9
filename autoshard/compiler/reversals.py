"""Reversals that cancel, folded before planning.

A sum from the end written as `jnp.flip(jnp.cumsum(jnp.flip(x, 1), 1), 1)` (returns-to-go,
a suffix max) reverses a split dim twice: each reversal sends every block to the device at the
mirrored position. The two reversals around a cumulative op along the same dim are that op
reversed (`lax.cumsum(x, 1, reverse=True)`), whose rule keeps the dim split; two reversals of
the same dims in a row are the value itself. Exact: jax computes a reverse cumulative op as the
forward one between two reversals, and a reversal only moves elements.
"""
from __future__ import annotations

from collections import Counter

from jax import lax

from .shift import drop_dead

_CUMULATIVE = (lax.cumsum_p, lax.cumprod_p, lax.cummax_p, lax.cummin_p, lax.cumlogsumexp_p)


def fold_reversals(eqns: list, outputs: list, regions: list) -> list:
    """`eqns` with rev(rev(x)) made a copy of x, and rev(cumulative(rev(x))) along one dim the
    cumulative op reversed on x; the reversals nothing reads any more dropped."""
    if sum(e.primitive is lax.rev_p for e in eqns) < 2:
        return eqns  # most programs: nothing to fold
    from .trace import params_key

    # a custom region's boundary values are its interface: a fold does not reach across them
    pinned = {v for r in regions for v in (*r.inputs, *r.outputs)}
    made_by = {e.outputs[0]: e for e in eqns if len(e.outputs) == 1}

    def reversal_of(v, dims) -> object | None:
        """x when `v` = rev(x, dims) (and may be looked through), else None."""
        p = made_by.get(v)
        if (p is None or v in pinned or p.primitive is not lax.rev_p
                or tuple(sorted(p.params["dimensions"])) != dims):
            return None
        return p.inputs[0]

    read = Counter(v for e in eqns for v in e.inputs)  # before: only what the fold orphans goes
    changed = False
    for e in eqns:
        if e.primitive is not lax.rev_p or e.outputs[0] in pinned:
            continue
        dims = tuple(sorted(e.params["dimensions"]))
        inner = e.inputs[0]
        source = reversal_of(inner, dims)
        if source is not None:  # rev(rev(x)) = x
            e.primitive, e.inputs, e.params = lax.copy_p, [source], {}
        else:
            op = made_by.get(inner)
            if (op is None or inner in pinned or op.primitive not in _CUMULATIVE
                    or (op.params["axis"],) != dims):
                continue
            source = reversal_of(op.inputs[0], dims)
            if source is None:
                continue
            e.primitive, e.inputs = op.primitive, [source]
            e.params = dict(op.params, reverse=not op.params["reverse"])
        e.params_key = params_key(e.params)
        e.sharding_cache = {}
        changed = True
    if not changed:
        return eqns
    return drop_dead(eqns, outputs, regions, pinned, read, also=frozenset(
        id(e) for e in eqns if e.primitive is lax.rev_p or e.primitive in _CUMULATIVE))


__all__ = ["fold_reversals"]
