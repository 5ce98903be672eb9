"""Host callbacks see what one device would: the global value, called once.

jax.debug.print / jax.debug.callback:
`partitioned=False` (jax's default) hands the callback the global value, once: the operands
are gathered and only the mesh's first device calls it (in a shard_map every device would, and
a print would appear once per device). `partitioned=True` asks for each device's own block, as
under jax.jit: the operands stay where they are and every device calls it. An ordered print
(`ordered=True`) runs unordered: jax keeps ordered effects only in one-device programs (it
raises for more), and the line is still printed once.
"""
from __future__ import annotations

import math

import numpy as np
from jax import lax
from jax._src.callback import io_callback_p, pure_callback_p
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


def _spread(sizes) -> tuple[str, ...]:
    """The mesh axes this program's devices are spread over. Inside a scan split over its rows
    (compiler/control_flow.py) those axes have size 1 here: each device along them runs other
    iterations, and calls for its own."""
    return tuple(a for a, n in sizes.items() if n > 1)


def _first_device(ctx):
    """True on device 0 of the mesh."""
    return lax.eq(ctx.block_index(_spread(ctx.sizes)), np.int32(0))


def callback_lower(primitive):
    def lower(ctx, *args, partitioned: bool = False, **params):
        if params.get("ordered"):                          # jax.debug.print
            params = {**params, "ordered": False}
        if params.get("effect") is ordered_debug_effect:   # jax.debug.callback
            params = {**params, "effect": debug_effect}

        def call():
            return primitive.bind(*args, partitioned=partitioned, **params)

        if partitioned or not _spread(ctx.sizes):
            return call()
        lax.cond(_first_device(ctx), lambda: (call(), None)[1], lambda: None)
        return []

    return lower


def host_call_sharding(in_avals, out_avals, **params):
    """jax.pure_callback / io_callback: the operands gathered (the callback takes the global
    value, as under jax.jit), the results replicated."""
    gathered = callback_sharding(in_avals, ())
    return OpSharding(gathered.operands, tuple(tuple(None for _ in a.shape) for a in out_avals),
                      gathered.factors)


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _wire(dtype) -> tuple[np.dtype, int]:
    """(dtype a result travels as, parts) in the psum that broadcasts it: floats as their
    bits (a float sum would turn device 0's -0.0 into +0.0), booleans as int32, complex
    numbers as the bits of their two halves."""
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
        return np.dtype(_UINT[dtype.itemsize // 2]), 2
    if dtype == np.bool_:
        return np.dtype(np.int32), 1
    return (np.dtype(_UINT[dtype.itemsize]) if dtype.kind == "f" else dtype), 1


def _from_first(x, axes):
    """Device 0's `x` on every device, where the others hold zeros."""
    dtype = np.dtype(x.dtype)
    if dtype.kind == "c":
        return lax.complex(_from_first(lax.real(x), axes), _from_first(lax.imag(x), axes))
    wire, _ = _wire(dtype)
    if wire == dtype:
        return lax.psum(x, axes)
    if dtype == np.bool_:
        return lax.psum(x.astype(wire), axes).astype(dtype)
    return lax.bitcast_convert_type(lax.psum(lax.bitcast_convert_type(x, wire), axes), dtype)


def once_lower(primitive):
    """pure_callback / io_callback: device 0 of the mesh calls it, once per call as under
    jax.jit (in a shard_map every device would: an io_callback's log line written eight
    times, a pure callback's host work done eight times); its results reach the others by a
    psum in which the rest add zero bits."""
    def lower(ctx, *args, result_avals, **params):
        def call():
            return list(primitive.bind(*args, result_avals=result_avals, **params))

        if not _spread(ctx.sizes):
            return call()
        outs = lax.cond(_first_device(ctx), call,
                        lambda: [lax.full(a.shape, 0, a.dtype) for a in result_avals])
        return [_from_first(o, _spread(ctx.sizes)) for o in outs]

    return lower


def once_comm(in_layouts, out_layouts, in_avals, out_avals, sizes, **params):
    axes = _spread(sizes)
    if not axes:
        return []
    n = math.prod(sizes[a] for a in axes)
    out = []
    for a in out_avals:
        wire, parts = _wire(a.dtype)
        # what each device sends, as the planner counts an all-reduce (a ring's 2 (n - 1) / n
        # of the buffer), not the buffer itself
        nbytes = 2 * math.prod(a.shape) * wire.itemsize * (n - 1) // n
        out += [("all-reduce", f"psum({','.join(axes)}) the callback's result from device 0",
                 axes, nbytes)] * parts
    return out


TABLE = {p: Rule(callback_sharding, callback_lower(p)) for p in (debug_print_p, debug_callback_p)}
TABLE.update({p: Rule(host_call_sharding, once_lower(p), once_comm)
              for p in (pure_callback_p, io_callback_p)})


def validation_samples() -> list:
    """A print and a callback beside a value that is returned (they have no results)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    f2 = ((4, 8), "f")
    return [
        ("debug_print", "debug_print",
         lambda x: (jax.debug.print("{}", jnp.tanh(x).sum(axis=1)), x * 2.0)[1], (f2,)),
        ("debug_callback", "debug_callback",
         lambda x: (jax.debug.callback(lambda v: None, x), x * 2.0)[1], (f2,)),
        ("debug_callback partitioned", "debug_callback",
         lambda x: (jax.debug.callback(lambda v: None, x, partitioned=True), x * 2.0)[1], (f2,)),
        ("pure_callback", "pure_callback",
         lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct((4, 8), jnp.float32), x) * x,
         (f2,)),
        ("io_callback", "io_callback",
         lambda x: io_callback(np.cos, jax.ShapeDtypeStruct((4, 8), jnp.float32), x) + x,
         (f2,)),
    ]


__all__ = ["TABLE", "validation_samples"]
