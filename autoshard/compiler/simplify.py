"""Simplify: the steps XLA's algebraic simplifier removes, recognised while the program is
built (trace.py), so that the plan does not move values the compiled program never makes.

Each function looks at one equation's operands: `x * 1`, a cast to its own dtype, the identity
transpose or reshape (`unchanged`), a select between equal filled constants, a slice of one
concatenated part, a result that is an empty array. They decide nothing about layouts.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from jax import lax

if TYPE_CHECKING:
    from .trace import Value


def is_one(v: Value, ones: set) -> bool:
    """`v` is 1 everywhere: a real scalar constant 1, or a broadcast of one (`ones`). Complex
    numbers are left alone: (a + bi)(1 + 0i) is not a + bi where b is infinite."""
    if v in ones:
        return True
    if not v.is_const or np.ndim(v.const) or getattr(v.dtype, "kind", "c") not in "fiu":
        return False
    return bool(np.asarray(v.const) == 1)


def times_one(ins: list, out_aval, ones: set) -> Value | None:
    """The operand of a product `ins[0] * ins[1]` that is the product (the other is 1 and it
    has the result's shape and dtype), else None."""
    for x, y in ((ins[0], ins[1]), (ins[1], ins[0])):
        if (is_one(y, ones) and x.aval.shape == out_aval.shape
                and x.aval.dtype == out_aval.dtype):
            return x
    return None


def unchanged(eqn: Any, ins: list) -> Value | None:
    """The operand of a one-operand step that returns it as it is, else None: a reversal of
    dims of size 1 (jax's convolution gradient reverses a 1x1 kernel), a cast to its own dtype,
    a reshape or broadcast to its own shape, the identity transpose."""
    p = eqn.primitive
    if len(ins) != 1 or p not in MAYBE_UNCHANGED:
        return None
    x, out = ins[0], eqn.outvars[0].aval
    if x.aval.shape != out.shape or x.aval.dtype != out.dtype:
        return None
    params = eqn.params
    if params.get("sharding") is not None:
        return None  # (jax's explicit-sharding out_sharding: kept as written)
    if p is lax.rev_p:
        return x if all(x.aval.shape[d] == 1 for d in params["dimensions"]) else None
    if p is lax.transpose_p:
        return x if tuple(params["permutation"]) == tuple(range(len(out.shape))) else None
    if p is lax.broadcast_in_dim_p:
        return x if tuple(params["broadcast_dimensions"]) == tuple(range(len(out.shape))) \
            else None
    if p is lax.reshape_p:
        return x if params.get("dimensions") is None else None
    return x  # convert_element_type to the same dtype (a weak type made strong)


MAYBE_UNCHANGED = frozenset({lax.rev_p, lax.transpose_p, lax.broadcast_in_dim_p, lax.reshape_p,
                              lax.convert_element_type_p})


def slice_of_part(params: dict, dim: int, parts: list) -> tuple | None:
    """(part, slice params) of a slice that reads only one part of a concatenation along
    `dim` (params None: the whole part); None when it reads from several."""
    if params["strides"] is not None and any(s != 1 for s in params["strides"]):
        return None
    lo, hi = params["start_indices"][dim], params["limit_indices"][dim]
    at = 0
    for x in parts:
        size = x.aval.shape[dim]
        if at <= lo and hi <= at + size and hi > lo:
            starts = tuple(lo - at if d == dim else s
                           for d, s in enumerate(params["start_indices"]))
            limits = tuple(hi - at if d == dim else s
                           for d, s in enumerate(params["limit_indices"]))
            whole = all(s == 0 for s in starts) and limits == tuple(x.aval.shape)
            return x, None if whole else dict(params, start_indices=starts,
                                              limit_indices=limits)
        at += size
    return None


def scalar_key(v: Value) -> tuple:
    """A scalar constant's value as a key (bytes tell -0.0 from 0.0)."""
    c = np.asarray(v.const, dtype=v.dtype)
    return (c.dtype, c.tobytes())


def same_cases(ins: list, out_aval, fills: dict) -> Value | None:
    """The first case of a `select_n(which, *cases)` whose cases are all one value (jax.vmap
    of a `where` between an unbatched value and itself: jax.scipy.special.expn's branches) or
    the same constant filled in (a broadcast scalar; jax's gradient of `x.at[i].set(0.0)`
    selects between two zeros), else None: whichever is picked, the result is that value —
    and what computes the predicate is dead, as XLA finds."""
    cases = ins[1:]
    if not cases:
        return None
    x = cases[0]
    if any(c is not x for c in cases[1:]):  # (one value in every case: that value)
        first = fills.get(x)
        if first is None or any(fills.get(c) != first for c in cases[1:]):
            return None
    return x if x.aval.shape == out_aval.shape and x.aval.dtype == out_aval.dtype else None


def all_empty(values: list) -> bool:
    """Every value an empty array of numbers (a constant: zeros of its shape)."""
    return bool(values) and all(
        0 in v.aval.shape and isinstance(getattr(v.aval, "dtype", None), np.dtype)
        for v in values)


__all__ = ["is_one", "times_one", "unchanged", "MAYBE_UNCHANGED", "slice_of_part", "scalar_key", "same_cases", "all_empty"]
