"""Reductions: a sharded reduced dim makes the result Partial of the matching kind."""
from __future__ import annotations

import numpy as np
from jax import lax

from autoshard.compiler.factors import ALL, LETTERS, NONE, einsum
from autoshard.placement import ReduceType

from .registry import Rule

# primitive → (reduce type of a sharded reduced dim or None: keep it whole, linear, monotone)
KINDS = {
    lax.reduce_sum_p: (ReduceType.SUM, ALL, NONE),
    lax.reduce_max_p: (ReduceType.MAX, NONE, ALL),
    lax.reduce_min_p: (ReduceType.MIN, NONE, ALL),
    lax.reduce_and_p: (ReduceType.MIN, NONE, NONE),
    lax.reduce_or_p: (ReduceType.MAX, NONE, NONE),
    lax.reduce_prod_p: (None, NONE, NONE),
    lax.reduce_xor_p: (None, NONE, NONE),
}


def reduction_sharding(kind, bitwise: bool = False):
    reduce_type, linear, monotone = kind

    def rule(in_avals, out_avals, *, axes, **params):
        shape = in_avals[0].shape
        term = LETTERS[:len(shape)]
        out = "".join(ch for d, ch in enumerate(term) if d not in axes)
        # XLA has no cross-device max / min of complex numbers (pmax: UNIMPLEMENTED; plain
        # jax.jit of the same split fails alike): their reduced dims stay whole
        whole = reduce_type is None or (reduce_type in (ReduceType.MAX, ReduceType.MIN)
                                        and np.issubdtype(in_avals[0].dtype, np.complexfloating))
        # and / or of integers are bitwise: min / max across devices equal them for bools only
        whole = whole or (bitwise and in_avals[0].dtype != np.bool_)
        replicate = "".join(term[d] for d in axes) if whole else ""
        # reduce_max keeps a P(max) (max of maxima) but not a P(min); reduce_min the reverse
        keeps = (reduce_type,) if reduce_type in (ReduceType.MAX, ReduceType.MIN) else ()
        return einsum(f"{term}->{out}", [shape], [out_avals[0].shape],
                      reduce_type=reduce_type or ReduceType.SUM, replicate=replicate,
                      linear=linear, monotone=monotone, monotone_types=keeps)

    return rule


def reduce_sharding(in_avals, out_avals, *, dimensions, **params):
    """lax.reduce with the user's own computation (variadic: n operands, then n scalar initial
    values): the kept dims pass, every operand alike; a reduced dim stays whole — what the
    computation does across shards is unknown, so no Partial is claimed."""
    n = len(out_avals)
    shape = in_avals[0].shape
    term = LETTERS[:len(shape)]
    out = "".join(ch for d, ch in enumerate(term) if d not in dimensions)
    spec = ",".join([term] * n + [""] * n) + "->" + ",".join([out] * n)
    return einsum(spec, [a.shape for a in in_avals], [a.shape for a in out_avals],
                  replicate="".join(term[d] for d in dimensions))


def _over_positions(reduce_p):
    """psum / pmax / pmin over positional axes — what jax.vmap(..., axis_name=) makes of a
    collective over its named axis — is a reduction over those dims of the batched value:
    reduce_sum / max / min's rule and lowering. Over mesh axis names (a user's shard_map body,
    partitioned apart: user_collectives.py) the rule does not describe it."""
    inner = reduction_sharding(KINDS[reduce_p])

    def rule(in_avals, out_avals, *, axes, axis_index_groups=None, **params):
        if (axis_index_groups is not None or len(in_avals) != 1
                or not all(isinstance(a, (int, np.integer)) for a in axes)):
            return None
        return inner(in_avals, out_avals, axes=tuple(int(a) for a in axes))

    # (lax's functions, which give each jax version's params: 0.12's max / min take an
    # out_sharding that 0.10's do not)
    reduce = {lax.reduce_sum_p: lax.reduce_sum, lax.reduce_max_p: lax.reduce_max,
              lax.reduce_min_p: lax.reduce_min}[reduce_p]

    def lower(ctx, x, *, axes, **params):
        return [reduce(x, tuple(int(a) for a in axes))]

    return Rule(rule, lower)


TABLE = {p: Rule(reduction_sharding(k, p in (lax.reduce_and_p, lax.reduce_or_p)))
         for p, k in KINDS.items()}
TABLE[lax.reduce_p] = Rule(reduce_sharding)
TABLE.update({lax.psum_p: _over_positions(lax.reduce_sum_p),
              lax.pmax_p: _over_positions(lax.reduce_max_p),
              lax.pmin_p: _over_positions(lax.reduce_min_p)})


def validation_samples() -> list:
    import jax

    f2 = ((4, 8), "f")
    return [(f"vmap {name}", name,
             lambda x, c=c: jax.vmap(lambda r: r - c(r, "i"), axis_name="i")(x), (f2,))
            for name, c in (("psum", lax.psum), ("pmax", lax.pmax), ("pmin", lax.pmin))]
