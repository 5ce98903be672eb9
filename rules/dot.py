"""dot_general with any dimension numbers: batch and free dims pass, contracting dims reduce (sum)."""
from __future__ import annotations

from jax import lax

from autoshard.compiler.factors import LETTERS, ONE, einsum

from .registry import Rule


def dot_general_sharding(in_avals, out_avals, *, dimension_numbers, **params):
    (lc, rc), (lb, rb) = dimension_numbers
    lhs, rhs = in_avals
    letters = iter(LETTERS)
    lterm = [""] * len(lhs.shape)
    rterm = [""] * len(rhs.shape)
    out = []
    for a, b in zip(lb, rb):
        lterm[a] = rterm[b] = ch = next(letters)
        out.append(ch)
    for a, b in zip(lc, rc):
        lterm[a] = rterm[b] = next(letters)
    for term in (lterm, rterm):
        for d, ch in enumerate(term):
            if not ch:
                term[d] = ch = next(letters)
                out.append(ch)
    spec = f"{''.join(lterm)},{''.join(rterm)}->{''.join(out)}"
    # Linear in each operand: one Partial(sum) operand passes through a matmul.
    return einsum(spec, [lhs.shape, rhs.shape], [out_avals[0].shape], linear=ONE)


TABLE = {lax.dot_general_p: Rule(dot_general_sharding)}
