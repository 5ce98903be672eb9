"""Windowed reductions (pooling) and their gradients: dims the window does not touch pass, and
a split dim the window slides over stays split, fetching the rows its windows reach past the
block (a halo, halo.py) — or none, for windows that tile the block (a 2×2 pool of stride 2).

A dim passes when its output rows come from the input rows of the same block plus a halo: the
output has one row per `stride` input rows (dilated by the base dilation), as a SAME or
non-overlapping pool has; other dims (a VALID pool with overlap shrinking the dim) stay whole.
The devices at either end receive the reduction's identity where a neighbour would be (the
pool's padding: -inf for max). Sums pass P(sum); max/min pass P(max)/P(min) (a max over a
window of maxima over parts is the max over the window); the gradients are linear in the values
they route, not in the operand whose maxima choose the route. The max pool's gradient
(select_and_scatter_add) also stays split: each device takes the windows touching its block
(some of its neighbours'), routes their values, and keeps its own rows.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from jax import lax

from autoshard.compiler.dtypes import highest, lowest
from autoshard.compiler.factors import ALL, LETTERS, NONE, ONE, einsum
from autoshard.compiler.partition import match_vma
from autoshard.placement import ReduceType

from .halo import SLIDE, Halo, fetch, halo, sends
from .registry import Rule


def _identity(primitive, dtype):
    """The reduction's identity: what its padding holds, and what edge devices fetch."""
    if primitive is lax.reduce_window_sum_p:
        return None
    return lowest(dtype) if primitive is lax.reduce_window_max_p else highest(dtype)


def _not_chosen(select_prim, dtype):
    """A value the selection never picks (ge picks maxima): the padding's."""
    return lowest(dtype) if select_prim is lax.ge_p else highest(dtype)


def _slides(in_shape, out_shape, window_dimensions, window_strides, padding, base_dilation=None,
            window_dilation=None) -> list[Halo | None]:
    n = len(window_dimensions)
    base_dilation = base_dilation or (1,) * n
    window_dilation = window_dilation or (1,) * n
    out = []
    for args in zip(in_shape, window_dimensions, out_shape, window_strides, padding,
                    base_dilation, window_dilation):
        h = halo(*args[:4], tuple(args[4]), *args[5:])
        out.append(h if h is not None and h.kind == SLIDE else None)
    return out


def _whole(term: str, halos) -> str:
    return "".join(ch for ch, h in zip(term, halos) if h is None)


def _pool_sharding(linear: str, monotone: str, types: tuple):
    def rule(in_avals, out_avals, *, window_dimensions, window_strides, padding,
             base_dilation=None, window_dilation=None):
        term = LETTERS[:len(window_dimensions)]
        halos = _slides(in_avals[0].shape, out_avals[0].shape, window_dimensions,
                        window_strides, padding, base_dilation, window_dilation)
        return einsum(f"{term}->{term}", [in_avals[0].shape], [out_avals[0].shape],
                      replicate=_whole(term, halos), linear=linear, monotone=monotone,
                      monotone_types=types)
    return rule


def _with_halos(ctx, values: list, fills: list, which: int, window_dimensions, window_strides,
                padding, base_dilation, window_dilation):
    """`values` (laid out as input `which`) each extended by the rows its windows reach past
    the block along every split dim (`fills`: what the end devices receive), and the padding
    the local op keeps."""
    halos = _slides(ctx.global_shape(ctx.in_layouts[which], values[0].shape),
                    ctx.global_shape(ctx.out_layouts[0], ctx.local_out_shapes[0]),
                    window_dimensions, window_strides, padding, base_dilation, window_dilation)
    values, padding = list(values), [tuple(p) for p in padding]
    for d, h in enumerate(halos):
        axes = ctx.in_layouts[which].dims[d]
        if axes and h is not None:
            for i, fill in enumerate(fills):
                values[i], before, after = fetch(ctx, values[i], d, axes, h.left, h.right, fill)
            padding[d] = (h.padding[0] + before * base_dilation[d],
                          h.padding[1] + after * base_dilation[d])
    return values, tuple(padding)


def _pool_lower(primitive):
    def lower(ctx, x, *, window_dimensions, window_strides, padding, base_dilation,
              window_dilation):
        params = dict(window_dimensions=window_dimensions, window_strides=window_strides,
                      base_dilation=base_dilation, window_dilation=window_dilation)
        (x,), padding = _with_halos(ctx, [x], [_identity(primitive, x.dtype)], 0,
                                    padding=padding, **params)
        return [primitive.bind(x, padding=padding, **params)]
    return lower


def _pool_comm(in_layouts, out_layouts, in_avals, out_avals, sizes, *, window_dimensions,
               window_strides, padding, base_dilation=None, window_dilation=None, **params):
    halos = _slides(in_avals[0].shape, out_avals[0].shape, window_dimensions, window_strides,
                    padding, base_dilation, window_dilation)
    return sends(in_layouts[0], in_avals[0], sizes,
                 [(d, h.left, h.right) for d, h in enumerate(halos) if h is not None])


# -- the max pool's gradient: select_and_scatter_add(source, operand) --------------------------

class _Scatter(NamedTuple):
    """The windows touching a block's rows beyond its own, and the operand rows they read."""
    windows_before: int
    windows_after: int
    rows_before: int
    rows_after: int


def _scatter_halo(length: int, out: int, window: int, stride: int, padding) -> _Scatter | None:
    lo, _hi = padding
    if length < 2 or out * stride != length or lo < 0 or lo > window - 1:
        return None
    # output block i (b = stride * b' rows) gets values from windows k with
    # k * stride - lo <= row <= k * stride - lo + window - 1: windows [i b' - before,
    # i b' + b' + after), which read operand rows [i b - rows_before, i b + b + rows_after)
    before, after = (window - 1 - lo) // stride, (lo - 1) // stride + 1
    # a window shorter than the stride leaves a block's last rows unread: none to fetch, and
    # the block keeps them (their gradient is zero) so that it still scatters all b rows
    return _Scatter(before, after, before * stride + lo,
                    max(0, after * stride - stride + window - lo))


def _scatters(source_shape, operand_shape, window_dimensions, window_strides, padding) -> list:
    return [_scatter_halo(L, O, w, s, tuple(p)) for L, O, w, s, p in
            zip(operand_shape, source_shape, window_dimensions, window_strides, padding)]


def _scatter_sharding(in_avals, out_avals, *, select_prim, window_dimensions, window_strides,
                      padding):
    term = LETTERS[:len(window_dimensions)]
    whole = _whole(term, _scatters(in_avals[0].shape, in_avals[1].shape, window_dimensions,
                                   window_strides, padding))
    return einsum(f"{term},{term}->{term}", [a.shape for a in in_avals], [out_avals[0].shape],
                  replicate=whole, linear=ONE, partial_operands=(0,))


def _scatter_lower(ctx, source, operand, *, select_prim, window_dimensions, window_strides,
                   padding):
    padding = [tuple(p) for p in padding]
    crops = []
    for d, sc in enumerate(_scatters(ctx.global_shape(ctx.in_layouts[0], source.shape),
                                     ctx.global_shape(ctx.in_layouts[1], operand.shape),
                                     window_dimensions, window_strides, padding)):
        axes = ctx.in_layouts[1].dims[d]
        if not axes or sc is None:
            continue
        w_before, w_after, r_before, r_after = sc
        b = operand.shape[d]
        source, s0, s1 = fetch(ctx, source, d, axes, w_before, w_after)
        if s0 or s1:  # windows past every device: none exist, they route nothing
            source = lax.pad(source, np.zeros((), source.dtype),
                             [(s0, s1, 0) if i == d else (0, 0, 0) for i in range(source.ndim)])
        operand, o0, o1 = fetch(ctx, operand, d, axes, r_before, r_after,
                                _not_chosen(select_prim, operand.dtype))
        padding[d] = (o0, o1)  # past every device: padding, never chosen
        crops.append((d, r_before - o0, b))
    # one of the two may have fetched no rows (no ppermute): both vary as the other does
    source, operand = match_vma([source, operand])
    out = lax.select_and_scatter_add_p.bind(
        source, operand, select_prim=select_prim, window_dimensions=window_dimensions,
        window_strides=window_strides, padding=tuple(padding))
    for d, start, b in crops:  # the rows of the windows' reach that are the neighbours'
        out = lax.slice_in_dim(out, start, start + b, axis=d)
    return [out]


def _scatter_comm(in_layouts, out_layouts, in_avals, out_avals, sizes, *, select_prim,
                  window_dimensions, window_strides, padding):
    found = [(d, sc) for d, sc in enumerate(_scatters(in_avals[0].shape, in_avals[1].shape,
                                                      window_dimensions, window_strides, padding))
             if sc is not None]
    return (sends(in_layouts[0], in_avals[0], sizes,
                  [(d, sc.windows_before, sc.windows_after) for d, sc in found])
            + sends(in_layouts[1], in_avals[1], sizes,
                    [(d, sc.rows_before, sc.rows_after) for d, sc in found], operand=1))


# -- the max pool's tangent: select_and_gather_add(tangents, operand) --------------------------

def _gather_sharding(in_avals, out_avals, *, select_prim, window_dimensions, window_strides,
                     padding, base_dilation, window_dilation):
    term = LETTERS[:len(window_dimensions)]
    halos = _slides(in_avals[1].shape, out_avals[0].shape, window_dimensions, window_strides,
                    padding, base_dilation, window_dilation)
    return einsum(f"{term},{term}->{term}", [a.shape for a in in_avals], [out_avals[0].shape],
                  replicate=_whole(term, halos), linear=ONE, partial_operands=(0,))


def _gather_lower(ctx, tangents, operand, *, select_prim, window_dimensions, window_strides,
                  padding, base_dilation, window_dilation):
    params = dict(window_dimensions=window_dimensions, window_strides=window_strides,
                  base_dilation=base_dilation, window_dilation=window_dilation)
    (tangents, operand), padding = _with_halos(
        ctx, [tangents, operand], [None, _not_chosen(select_prim, operand.dtype)], 1,
        padding=padding, **params)
    tangents, operand = match_vma([tangents, operand])  # (see _scatter_lower)
    return [lax.select_and_gather_add_p.bind(tangents, operand, select_prim=select_prim,
                                             padding=padding, **params)]


def _gather_comm(in_layouts, out_layouts, in_avals, out_avals, sizes, *, select_prim,
                 window_dimensions, window_strides, padding, base_dilation, window_dilation):
    halos = [(d, h.left, h.right) for d, h in enumerate(_slides(
        in_avals[1].shape, out_avals[0].shape, window_dimensions, window_strides, padding,
        base_dilation, window_dilation)) if h is not None]
    return (sends(in_layouts[0], in_avals[0], sizes, halos)
            + sends(in_layouts[1], in_avals[1], sizes, halos, operand=1))


def _moving_dims(window_dimensions, window_strides, padding, base_dilation=None,
                 window_dilation=None) -> str:
    n = len(window_dimensions)
    base_dilation = base_dilation or (1,) * n
    window_dilation = window_dilation or (1,) * n
    term = LETTERS[:n]
    return "".join(ch for ch, w, s, p, b, d in zip(term, window_dimensions, window_strides,
                                                   padding, base_dilation, window_dilation)
                   if (w, s, tuple(p), b, d) != (1, 1, (0, 0), 1, 1))


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
    **{p: Rule(_pool_sharding(*kind), _pool_lower(p), _pool_comm) for p, kind in (
        (lax.reduce_window_sum_p, (ALL, NONE, ())),
        (lax.reduce_window_max_p, (NONE, ALL, (ReduceType.MAX,))),
        (lax.reduce_window_min_p, (NONE, ALL, (ReduceType.MIN,))))},
    lax.select_and_scatter_add_p: Rule(_scatter_sharding, _scatter_lower, _scatter_comm),
    lax.select_and_gather_add_p: Rule(_gather_sharding, _gather_lower, _gather_comm),
}


def validation_samples():
    """(name, primitive, fn, *operand specs) for autoshard.validate: max/avg pools over the
    middle dims of (4, 8, 8), strided, padded and overlapping windows (a halo when those dims
    are split), and their gradients and tangents."""
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
        ("overlapping max pool gradient", "select_and_scatter_add", jax.grad(
            lambda x: jnp.sum(pool(lax.max, -jnp.inf, (1, 3, 3), (1, 2, 2), "SAME")(x) ** 2)),
         (f3,)),
        ("padded max pool gradient", "select_and_scatter_add", jax.grad(
            lambda x: jnp.sum(pool(lax.max, -jnp.inf, (1, 3, 1), (1, 1, 1), "SAME")(x) ** 2)),
         (f3,)),
        ("avg pool gradient", "reduce_window_sum", jax.grad(
            lambda x: jnp.sum(pool(lax.add, 0.0, (1, 2, 2), (1, 2, 2), "VALID")(x) ** 2)), (f3,)),
        ("overlapping max pool tangent", "select_and_gather_add", lambda x: jax.jvp(
            pool(lax.max, -jnp.inf, (1, 3, 3), (1, 2, 2), "SAME"), (x,), (jnp.cos(x),))[1], (f3,)),
        ("max pool tangent", "select_and_gather_add", lambda x: jax.jvp(
            pool(lax.max, -jnp.inf, (1, 2, 2), (1, 2, 2), "VALID"), (x,), (jnp.cos(x),))[1], (f3,)),
    ]


__all__ = ["TABLE", "validation_samples"]
