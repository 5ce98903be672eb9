"""Debug callbacks (jax.debug.print, jax.debug.callback) see what one device would.

`partitioned=False` (jax's default) hands the callback the global value, once: the operands
are gathered and only the mesh's first device calls it (in a shard_map every device would, and
a print would appear once per device). `partitioned=True` asks for each device's own block, as
under jax.jit: the operands stay where they are and every device calls it. An ordered print
(`ordered=True`) runs unordered: jax keeps ordered effects only in one-device programs (it
raises for more), and the line is still printed once.
"""
from __future__ import annotations

import numpy as np
from jax import lax
from jax._src.debugging import (debug_callback_p, debug_effect, debug_print_p,
                                ordered_debug_effect)

from autoshard.compiler.factors import PASS, REPLICATE, Factor, OpSharding

from .registry import Rule


def callback_sharding(in_avals, out_avals, *, partitioned: bool = False, **params):
    factors: list[Factor] = []
    operands = []
    for a in in_avals:
        dims = []
        for size in a.shape:
            if size == 1:
                dims.append(None)
                continue
            factors.append(Factor(PASS if partitioned else REPLICATE))
            dims.append(len(factors) - 1)
        operands.append(tuple(dims))
    return OpSharding(tuple(operands), tuple(() for _ in out_avals), tuple(factors))


def callback_lower(primitive):
    def lower(ctx, *args, partitioned: bool = False, **params):
        if params.get("ordered"):                          # jax.debug.print
            params = {**params, "ordered": False}
        if params.get("effect") is ordered_debug_effect:   # jax.debug.callback
            params = {**params, "effect": debug_effect}

        def call():
            return primitive.bind(*args, partitioned=partitioned, **params)

        if partitioned or not ctx.sizes:
            return call()
        first = lax.eq(ctx.block_index(tuple(ctx.sizes)), np.int32(0))  # device 0 of the mesh
        lax.cond(first, lambda: (call(), None)[1], lambda: None)
        return []

    return lower


TABLE = {p: Rule(callback_sharding, callback_lower(p)) for p in (debug_print_p, debug_callback_p)}


def validation_samples() -> list:
    """A print and a callback beside a value that is returned (they have no results)."""
    import jax
    import jax.numpy as jnp

    f2 = ((4, 8), "f")
    return [
        ("debug_print", "debug_print",
         lambda x: (jax.debug.print("{}", jnp.tanh(x).sum(axis=1)), x * 2.0)[1], (f2,)),
        ("debug_callback", "debug_callback",
         lambda x: (jax.debug.callback(lambda v: None, x), x * 2.0)[1], (f2,)),
        ("debug_callback partitioned", "debug_callback",
         lambda x: (jax.debug.callback(lambda v: None, x, partitioned=True), x * 2.0)[1], (f2,)),
    ]


__all__ = ["TABLE", "validation_samples"]
