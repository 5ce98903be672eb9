"""Windowed reductions (pooling) and their gradients: dims the window does not touch pass.

A dim passes when its window is one element with stride 1, no padding and no dilation (the
batch and channel dims of a pool); any other dim slides over neighbours, so it stays whole.
Sums pass P(sum); max/min pass P(max)/P(min) (a max over a window of maxima over parts is
the max over the window); the gradients are linear in the values they route, not in the
operand whose maxima choose the route.
"""
from __future__ import annotations

from jax import lax

from autoshard.compiler.factors import ALL, LETTERS, NONE, ONE, einsum
from autoshard.placement import ReduceType

from .registry import Rule


def _moving_dims(window_dimensions, window_strides, padding, base_dilation=None,
                 window_dilation=None) -> str:
    n = len(window_dimensions)
    base_dilation = base_dilation or (1,) * n
    window_dilation = window_dilation or (1,) * n
    term = LETTERS[:n]
    return "".join(ch for ch, w, s, p, b, d in zip(term, window_dimensions, window_strides,
                                                   padding, base_dilation, window_dilation)
                   if (w, s, tuple(p), b, d) != (1, 1, (0, 0), 1, 1))


def _pool_sharding(linear: str, monotone: str, types: tuple):
    def rule(in_avals, out_avals, *, window_dimensions, window_strides, padding,
             base_dilation=None, window_dilation=None):
        term = LETTERS[:len(window_dimensions)]
        return einsum(f"{term}->{term}", [in_avals[0].shape], [out_avals[0].shape],
                      replicate=_moving_dims(window_dimensions, window_strides, padding,
                                             base_dilation, window_dilation),
                      linear=linear, monotone=monotone, monotone_types=types)
    return rule


def _routed_sharding(in_avals, out_avals, *, select_prim, window_dimensions, window_strides,
                     padding, base_dilation=None, window_dilation=None):
    # select_and_scatter_add(source, operand) and select_and_gather_add(tangents, operand):
    # the operand's maxima choose where each value goes; the values (operand 0) route linearly
    term = LETTERS[:len(window_dimensions)]
    return einsum(f"{term},{term}->{term}", [a.shape for a in in_avals], [out_avals[0].shape],
                  replicate=_moving_dims(window_dimensions, window_strides, padding,
                                         base_dilation, window_dilation),
                  linear=ONE, partial_operands=(0,))


def _custom_pool_sharding(in_avals, out_avals, *, jaxpr, consts, window_dimensions,
                          window_strides, padding, base_dilation, window_dilation):
    # lax.reduce_window with the user's own reduction: operands, then one scalar initial value
    # each; the window's dims stay whole, the rest pass, and no Partial passes (the reduction
    # is unknown)
    n = len(out_avals)
    term = LETTERS[:len(window_dimensions)]
    return einsum(",".join([term] * n + [""] * n) + "->" + ",".join([term] * n),
                  [a.shape for a in in_avals], [a.shape for a in out_avals],
                  replicate=_moving_dims(window_dimensions, window_strides, padding,
                                         base_dilation, window_dilation))


TABLE = {
    lax.reduce_window_p: Rule(_custom_pool_sharding),
    lax.reduce_window_sum_p: Rule(_pool_sharding(ALL, NONE, ())),
    lax.reduce_window_max_p: Rule(_pool_sharding(NONE, ALL, (ReduceType.MAX,))),
    lax.reduce_window_min_p: Rule(_pool_sharding(NONE, ALL, (ReduceType.MIN,))),
    lax.select_and_scatter_add_p: Rule(_routed_sharding),
    lax.select_and_gather_add_p: Rule(_routed_sharding),
}


def validation_samples():
    """(name, primitive, fn, *operand specs) for autoshard.validate: max/avg pools over the
    middle dims of (4, 8, 8), strided, padded and overlapping windows, and their gradients."""
    import jax
    import jax.numpy as jnp

    f3 = ((4, 8, 8), "f")

    def pool(op, init, window, strides, padding):
        return lambda x: lax.reduce_window(x, init, op, window, strides, padding)

    return [
        ("max pool 2x2", "reduce_window_max", pool(lax.max, -jnp.inf, (1, 2, 2), (1, 2, 2), "VALID"), (f3,)),
        ("max pool 3x3 same", "reduce_window_max", pool(lax.max, -jnp.inf, (1, 3, 3), (1, 1, 1), "SAME"), (f3,)),
        ("min pool dim 0", "reduce_window_min", pool(lax.min, jnp.inf, (2, 1, 1), (2, 1, 1), "VALID"), (f3,)),
        ("sum pool 2x2", "reduce_window_sum", pool(lax.add, 0.0, (1, 2, 2), (1, 2, 2), "VALID"), (f3,)),
        ("sum pool padded", "reduce_window_sum", pool(lax.add, 0.0, (1, 3, 1), (1, 2, 1), "SAME"), (f3,)),
        ("custom reduction", "reduce_window",
         lambda x: lax.reduce_window(x, 0.0, lambda a, b: a + 2.0 * b, (1, 2, 1), (1, 1, 1), "VALID"),
         (f3,)),
        ("two operands, padded", "reduce_window",
         lambda x: sum(lax.reduce_window((x, -x), (0.0, -jnp.inf),
                                         lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])),
                                         (1, 1, 3), (1, 1, 2), "SAME")), (f3,)),
        ("max pool gradient", "select_and_scatter_add", jax.grad(
            lambda x: jnp.sum(pool(lax.max, -jnp.inf, (1, 2, 2), (1, 2, 2), "VALID")(x) ** 2)), (f3,)),
        ("max pool tangent", "select_and_gather_add", lambda x: jax.jvp(
            pool(lax.max, -jnp.inf, (1, 2, 2), (1, 2, 2), "VALID"), (x,), (jnp.cos(x),))[1], (f3,)),
    ]


__all__ = ["TABLE", "validation_samples"]
