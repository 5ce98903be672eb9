"""Indexing primitives: gather, scatter(-add/-sub/-mul/-min/-max), dynamic_slice,
dynamic_update_slice.

Dims that are taken whole (slice/window size == the operand's size, not indexed) pass through.
Indexed dims that are read or written one element at a time may be sharded too, with masking:
- a *read* (gather, dynamic_slice) of a sharded dim is a REDUCE(sum) factor: each device looks
  up only the indices in its own block and contributes zero elsewhere, so the result is
  Partial(sum) — the vocab-parallel embedding lookup;
- a *write* (scatter, dynamic_update_slice) into a sharded dim is a PASS factor of operand and
  result: each device applies only the updates that land in its block (the others are dropped),
  so the result stays sharded with no communication — the vocab-parallel embedding gradient.
Scatter-add may also split its updates (the scatter dims): each device adds its own updates,
and the operand is counted on one device only, giving Partial(sum); scatter-min/max give
Partial(min/max) the same way. Everything else an index can touch stays whole.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lax.slicing import GatherScatterMode

from autoshard.compiler.factors import NONE, ONE, PASS, REDUCE, REPLICATE, Factor, OpSharding
from autoshard.compiler.partition import match_vma
from autoshard.placement import ReduceType

from .registry import Rule

_MODES = (GatherScatterMode.CLIP, GatherScatterMode.FILL_OR_DROP,
          GatherScatterMode.PROMISE_IN_BOUNDS)


class _Factors:
    """Collects factors while a rule walks the dims; size-1 dims never get one."""

    def __init__(self) -> None:
        self.factors: list[Factor] = []

    def new(self, kind: str, size: int, reduce_type: ReduceType | None = None) -> int | None:
        if size <= 1:
            return None
        self.factors.append(Factor(kind, reduce_type))
        return len(self.factors) - 1


def _summable(dtype) -> bool:
    # Masked-out devices contribute zero to a sum: meaningless for booleans. (jax's issubdtype:
    # numpy does not count bfloat16 as a number, and a bfloat16 vocab-parallel table was
    # gathered whole.)
    return jax.dtypes.issubdtype(dtype, np.number)


def _global_size(local: int, axes, sizes) -> int:
    return local * math.prod(sizes[a] for a in axes)


# The lowerings below build their index arithmetic from lax functions, not jnp's: each jnp
# function is a jitted wrapper that costs a trace-cache lookup per call, and these run once per
# gather / scatter of every partitioned program (a sixth of a 12-layer GPT step's partition).

def _all(conds):
    out = None
    for c in conds:
        out = c if out is None else lax.bitwise_and(out, c)
    return out


def _first_block(axes):
    return _all([lax.eq(lax.axis_index(a), 0) for a in axes])


def _where(cond, x, y):
    """jnp.where for a mask of x's shape or a scalar one (y: x's shape and dtype)."""
    if cond.shape != x.shape:
        cond = lax.broadcast_in_dim(cond, x.shape, ())
    return lax.select(cond, x, y)


def _zeros(x):
    return lax.full_like(x, 0)


def _clip(x, lo, hi):
    return lax.clamp(np.asarray(lo, x.dtype), x, np.asarray(hi, x.dtype))


def _column(indices, k):
    """indices[..., k]"""
    return lax.index_in_dim(indices, k, axis=indices.ndim - 1, keepdims=False)


def _stack_last(cols):
    """jnp.stack(cols, axis=-1)"""
    cols = match_vma(cols)
    nd = cols[0].ndim
    return lax.concatenate([lax.expand_dims(c, (nd,)) for c in cols], nd)


def _count_once(ctx, x, layout):
    """An additive term that does not vary along a Partial(sum) axis of the result must be
    counted once in that sum: keep it on the axis' first device, zero elsewhere. (Partial(avg)
    averages identical copies back to the term itself, so those axes need nothing.)"""
    axes = [a for a, t in ctx.out_layouts[0].partial
            if t == ReduceType.SUM and a not in layout.used_axes]
    if not axes:
        return x
    return _where(_first_block(axes), x, _zeros(x))


# Masks vary along the mesh axes they came from: before a bind, every operand is cast to the
# same varying axes (match_vma), as the engine does for the operands it passes in.

def _wide(i):
    # Block starts (and the past-the-end index a dropped update gets) must fit the index type.
    dtype = jnp.promote_types(i.dtype, np.int32)
    return i if i.dtype == dtype else lax.convert_element_type(i, dtype)


def _same_type(starts):
    # dynamic_slice wants every start index of one integer type.
    dtype = jnp.int32
    for x in starts:
        dtype = jnp.promote_types(dtype, x.dtype)
    return [x if x.dtype == dtype else lax.convert_element_type(x, dtype) for x in starts]


def _localize_index(ctx, g, axes, n_local):
    """Global index g (already in range) → (local index clipped into the block, in-block mask)."""
    g = _wide(g)
    start = lax.convert_element_type(lax.mul(ctx.block_index(axes), np.int32(n_local)), g.dtype)
    local = lax.sub(g, lax.broadcast_in_dim(start, g.shape, ()))
    mine = lax.bitwise_and(lax.ge(local, np.asarray(0, local.dtype)),
                           lax.lt(local, np.asarray(n_local, local.dtype)))
    return _clip(local, 0, n_local - 1), mine


# ------------------------------------------------------------------------------------ gather

def _default_fill(dtype):
    # As lax.gather resolves fill_value=None.
    if jax.dtypes.issubdtype(dtype, np.inexact):  # bfloat16 too, which numpy does not know
        return np.nan
    # (jax's issubdtype and iinfo: numpy's do not know int4 / uint4)
    if jax.dtypes.issubdtype(dtype, np.signedinteger):
        return jax.numpy.iinfo(dtype).min
    if jax.dtypes.issubdtype(dtype, np.unsignedinteger):
        return jax.numpy.iinfo(dtype).max
    return True


def _fill_survives_sums(fill, dtype) -> bool:
    """Summing k copies of the fill value gives the fill value back (0, nan, ±inf)."""
    if fill is None:
        fill = _default_fill(dtype)
    try:
        f = float(fill)
    except (TypeError, ValueError):
        return False
    return f == 0 or (jax.dtypes.issubdtype(dtype, np.inexact) and not np.isfinite(f))


def gather_sharding(in_avals, out_avals, *, dimension_numbers, slice_sizes, mode,
                    fill_value=None, **params):
    mode = GatherScatterMode.from_any(mode)
    if mode not in _MODES:
        return None
    dn = dimension_numbers
    operand, indices = in_avals
    out = out_avals[0]
    F = _Factors()
    op: list = [None] * len(operand.shape)
    ix: list = [None] * len(indices.shape)   # the last dim is the index vector: never sharded
    res: list = [None] * len(out.shape)
    batch_out = [d for d in range(len(out.shape)) if d not in dn.offset_dims]
    for j, r in enumerate(batch_out):
        ix[j] = res[r] = F.new(PASS, indices.shape[j])
    for od, idim in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
        op[od] = ix[idim]
    summable = _summable(operand.dtype)

    def indexed_kind(d):
        # One element of the dim is read per index: a sharded dim reads masked, then sums.
        if d in dn.start_index_map and slice_sizes[d] == 1 and summable:
            return REDUCE
        return REPLICATE

    offset_operand = [d for d in range(len(operand.shape))
                      if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    for d, r in zip(offset_operand, dn.offset_dims):
        if d not in dn.start_index_map and slice_sizes[d] == operand.shape[d]:
            op[d] = res[r] = F.new(PASS, operand.shape[d])
        elif indexed_kind(d) == REDUCE:
            op[d] = F.new(REDUCE, operand.shape[d], ReduceType.SUM)
        else:
            op[d] = res[r] = F.new(REPLICATE, max(operand.shape[d], out.shape[r]))
    for d in dn.collapsed_slice_dims:
        kind = indexed_kind(d)
        op[d] = F.new(kind, operand.shape[d], ReduceType.SUM if kind == REDUCE else None)
    # Gather only selects: a Partial(sum/avg) table passes through — unless out-of-range
    # indices read a fill value that every part would contribute again.
    linear = ONE if summable and (mode != GatherScatterMode.FILL_OR_DROP
                                  or _fill_survives_sums(fill_value, operand.dtype)) else NONE
    return OpSharding((tuple(op), tuple(ix)), (tuple(res),), tuple(F.factors), linear=linear,
                      partial_operands=(0,))


def gather_lower(ctx, operand, indices, **params):
    dn, slice_sizes = params["dimension_numbers"], params["slice_sizes"]
    mode = GatherScatterMode.from_any(params["mode"])
    fill_value = params.get("fill_value")
    dims = ctx.in_layouts[0].dims
    local_sizes = tuple(
        operand.shape[d] if dims[d] and d not in dn.start_index_map
        and d not in dn.operand_batching_dims else s
        for d, s in enumerate(slice_sizes))
    sharded = [(k, d) for k, d in enumerate(dn.start_index_map) if dims[d]]
    if not sharded:  # every indexed dim is whole: the local gather is the global one
        return [lax.gather_p.bind(operand, indices, **{**params, "slice_sizes": local_sizes})]
    sizes = ctx.sizes
    cols = [_wide(_column(indices, k)) for k in range(len(dn.start_index_map))]
    uppers = [_global_size(operand.shape[d], dims[d], sizes) - slice_sizes[d]
              for d in dn.start_index_map]
    outside = None
    if mode == GatherScatterMode.FILL_OR_DROP:
        outside = _all([lax.bitwise_or(lax.lt(c, np.asarray(0, c.dtype)),
                                       lax.gt(c, np.asarray(u, c.dtype)))
                        for c, u in zip(cols, uppers)])
    # Clamp as one device would (clip and promise_in_bounds both clamp a gather), so that
    # exactly one block owns every index.
    cols = [_clip(c, 0, u) for c, u in zip(cols, uppers)]
    masks = []
    for k, d in sharded:
        cols[k], mine = _localize_index(ctx, cols[k], dims[d], operand.shape[d])
        masks.append(mine)
    local_indices = _stack_last(cols)
    operand, local_indices = match_vma([operand, local_indices])
    out = lax.gather_p.bind(operand, local_indices, **{
        **params, "slice_sizes": local_sizes, "mode": GatherScatterMode.CLIP, "fill_value": None,
        "indices_are_sorted": False, "unique_indices": False})
    batch_out = [d for d in range(out.ndim) if d not in dn.offset_dims]

    def spread(mask):
        return lax.broadcast_in_dim(mask, out.shape, batch_out)

    value = _where(spread(_all(masks)), out, _zeros(out))
    if outside is not None:  # the fill value is counted on one block of the partial sum
        fill = _default_fill(out.dtype) if fill_value is None else fill_value
        owner = _all([_first_block(dims[d]) for _, d in sharded])
        filled = _where(owner, lax.full_like(out, fill), _zeros(out))
        value = _where(spread(outside), filled, value)
    return [value]


# ------------------------------------------------------------------------------------ scatter

# primitive → (kind of a scatter (updates) dim, its reduce type, linear mode, partial operands,
#              whether operand and updates are additive terms of the result)
_SCATTERS = {
    lax.scatter_add_p: (REDUCE, ReduceType.SUM, ONE, (0, 2), True),
    lax.scatter_sub_p: (REDUCE, ReduceType.SUM, ONE, (0, 2), True),
    # set: each result element is the operand's or one update's, so a Partial operand passes
    # when the updates count once; split updates could not be merged again.
    lax.scatter_p: (REPLICATE, None, ONE, (0,), True),
    lax.scatter_mul_p: (REPLICATE, None, ONE, (0,), False),
    lax.scatter_min_p: (REDUCE, ReduceType.MIN, NONE, None, False),
    lax.scatter_max_p: (REDUCE, ReduceType.MAX, NONE, None, False),
}


def _window_sizes(operand_shape, updates_shape, dn) -> list[int]:
    sizes, k = [], 0
    for d in range(len(operand_shape)):
        if d in dn.inserted_window_dims or d in dn.operand_batching_dims:
            sizes.append(1)
        else:
            sizes.append(updates_shape[dn.update_window_dims[k]])
            k += 1
    return sizes


def scatter_sharding(primitive):
    scatter_kind, reduce_type, linear, partial_operands, _ = _SCATTERS[primitive]

    def rule(in_avals, out_avals, *, dimension_numbers, mode, **params):
        if GatherScatterMode.from_any(mode) not in _MODES:
            return None
        dn = dimension_numbers
        operand, indices, updates = in_avals
        summable = _summable(operand.dtype)
        kind = scatter_kind if summable else REPLICATE
        F = _Factors()
        op: list = [None] * len(operand.shape)
        ix: list = [None] * len(indices.shape)
        up: list = [None] * len(updates.shape)
        scatter_dims = [u for u in range(len(updates.shape)) if u not in dn.update_window_dims]
        for j, u in enumerate(scatter_dims):
            if j in dn.scatter_indices_batching_dims:
                ix[j] = up[u] = F.new(PASS, indices.shape[j])
            else:
                ix[j] = up[u] = F.new(kind, indices.shape[j],
                                      reduce_type if kind == REDUCE else None)
        for od, idim in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims):
            op[od] = ix[idim]
        windows = [d for d in range(len(operand.shape))
                   if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
        for d, u in zip(windows, dn.update_window_dims):
            w = updates.shape[u]
            if d not in dn.scatter_dims_to_operand_dims and w == operand.shape[d]:
                op[d] = up[u] = F.new(PASS, w)
            elif d in dn.scatter_dims_to_operand_dims and w == 1:
                op[d] = F.new(PASS, operand.shape[d])   # masked write
            else:
                op[d] = up[u] = F.new(REPLICATE, max(w, operand.shape[d]))
        for d in dn.inserted_window_dims:
            op[d] = F.new(PASS if d in dn.scatter_dims_to_operand_dims else REPLICATE,
                          operand.shape[d])
        lin = linear if summable else NONE
        return OpSharding((tuple(op), tuple(ix), tuple(up)), (tuple(op),), tuple(F.factors),
                          linear=lin, partial_operands=partial_operands)

    return rule


def scatter_lower(primitive):
    additive = _SCATTERS[primitive][4]

    def lower(ctx, operand, indices, updates, **params):
        dn = params["dimension_numbers"]
        mode = GatherScatterMode.from_any(params["mode"])
        op_layout, _, up_layout = ctx.in_layouts
        if additive:
            operand = _count_once(ctx, operand, op_layout)
            updates = _count_once(ctx, updates, up_layout)
        dims = op_layout.dims
        sharded = [(k, d) for k, d in enumerate(dn.scatter_dims_to_operand_dims) if dims[d]]
        if sharded:
            cols = [_wide(_column(indices, k))
                    for k in range(len(dn.scatter_dims_to_operand_dims))]
            if mode == GatherScatterMode.CLIP:
                windows = _window_sizes(operand.shape, updates.shape, dn)
                cols = [_clip(c, 0, _global_size(operand.shape[d], dims[d], ctx.sizes)
                              - windows[d])
                        for c, d in zip(cols, dn.scatter_dims_to_operand_dims)]
            masks = []
            for k, d in sharded:
                cols[k], mine = _localize_index(ctx, cols[k], dims[d], operand.shape[d])
                masks.append(mine)
            # An update that is not this block's points past its end, and is dropped. (An index
            # outside the whole dim is outside every block: dropped everywhere, as XLA drops it
            # on one device in fill_or_drop and promise_in_bounds modes.)
            keep = _all(masks)
            k0, d0 = sharded[0]
            cols[k0] = _where(keep, cols[k0], lax.full_like(cols[k0], operand.shape[d0]))
            indices = _stack_last(cols)
            params = {**params, "mode": GatherScatterMode.FILL_OR_DROP,
                      "indices_are_sorted": False, "unique_indices": False}
        operand, indices, updates = match_vma([operand, indices, updates])
        return [primitive.bind(operand, indices, updates, **params)]

    return lower


# ------------------------------------------------------------------------- dynamic (update) slice

def dynamic_slice_sharding(in_avals, out_avals, *, slice_sizes, **params):
    operand = in_avals[0]
    if len(in_avals) != 1 + len(operand.shape):  # dynamic shapes: not described
        return None
    F = _Factors()
    op: list = [None] * len(operand.shape)
    res: list = [None] * len(operand.shape)
    summable = _summable(operand.dtype)
    for d, (n, s) in enumerate(zip(operand.shape, slice_sizes)):
        if s == n:
            op[d] = res[d] = F.new(PASS, n)
        elif s == 1 and summable:
            op[d] = F.new(REDUCE, n, ReduceType.SUM)    # masked read
        else:
            op[d] = res[d] = F.new(REPLICATE, n)
    scalars = [() for _ in in_avals[1:]]
    return OpSharding((tuple(op), *scalars), (tuple(res),), tuple(F.factors),
                      linear=ONE if summable else NONE, partial_operands=(0,))


def dynamic_slice_lower(ctx, operand, *starts, slice_sizes):
    dims = ctx.in_layouts[0].dims
    new_starts, sizes, masks = [], [], []
    for d, (start, s) in enumerate(zip(starts, slice_sizes)):
        if not dims[d]:
            new_starts.append(start)
            sizes.append(s)
        elif s < _global_size(operand.shape[d], dims[d], ctx.sizes):  # one element, masked
            n = _global_size(operand.shape[d], dims[d], ctx.sizes)
            local, mine = _localize_index(ctx, _clip(_wide(start), 0, n - 1), dims[d],
                                          operand.shape[d])
            new_starts.append(local)
            sizes.append(1)
            masks.append(mine)
        else:  # a whole dim: its start is clamped to 0 anyway
            new_starts.append(_zeros(start))
            sizes.append(operand.shape[d])
    operand, *new_starts = match_vma([operand, *_same_type(new_starts)])
    out = lax.dynamic_slice(operand, new_starts, sizes)
    if masks:
        out = _where(_all(masks), out, _zeros(out))
    return [out]


def dynamic_update_slice_sharding(in_avals, out_avals, **params):
    operand, update = in_avals[:2]
    if len(in_avals) != 2 + len(operand.shape):
        return None
    F = _Factors()
    op: list = [None] * len(operand.shape)
    up: list = [None] * len(update.shape)
    for d, (n, u) in enumerate(zip(operand.shape, update.shape)):
        if u == n:
            op[d] = up[d] = F.new(PASS, n)
        elif u == 1:
            op[d] = F.new(PASS, n)     # masked write
        else:
            op[d] = up[d] = F.new(REPLICATE, n)
    scalars = [() for _ in in_avals[2:]]
    lin = ONE if _summable(operand.dtype) else NONE
    return OpSharding((tuple(op), tuple(up), *scalars), (tuple(op),), tuple(F.factors),
                      linear=lin, partial_operands=(0, 1))


def dynamic_update_slice_lower(ctx, operand, update, *starts):
    op_layout, up_layout = ctx.in_layouts[:2]
    operand = _count_once(ctx, operand, op_layout)
    update = _count_once(ctx, update, up_layout)
    new_starts, masks = [], []
    for d, start in enumerate(starts):
        axes = op_layout.dims[d]
        if not axes:
            new_starts.append(start)
        elif up_layout.dims[d]:   # a whole dim, split alike: its start is clamped to 0 anyway
            new_starts.append(_zeros(start))
        else:
            n = _global_size(operand.shape[d], axes, ctx.sizes)
            local, mine = _localize_index(ctx, _clip(_wide(start), 0, n - 1), axes,
                                          operand.shape[d])
            new_starts.append(local)
            masks.append(mine)
    operand, update, *new_starts = match_vma([operand, update, *_same_type(new_starts)])
    out = lax.dynamic_update_slice(operand, update, new_starts)
    if masks:
        out = _where(_all(masks), out, operand)
    return [out]


TABLE = {
    lax.gather_p: Rule(gather_sharding, gather_lower),
    lax.dynamic_slice_p: Rule(dynamic_slice_sharding, dynamic_slice_lower),
    lax.dynamic_update_slice_p: Rule(dynamic_update_slice_sharding, dynamic_update_slice_lower),
}
TABLE.update({p: Rule(scatter_sharding(p), scatter_lower(p)) for p in _SCATTERS})


# ---------------------------------------------------------------------------- validator samples

def validation_samples() -> list:
    """(name, primitive name, fn, ((shape, kind), ...)) tuples for autoshard.validate.

    Index inputs arrive as ints 1..5; `(i * 3) % n` spreads them over every block of a dim
    split in 4, and `i * 3 - 4` (-1..11) also reaches past both ends of a dim of 8.
    """
    import jax

    def spread(i, n):
        return (i * 3) % n

    def scatter_dn(window, inserted, to_operand):
        return lax.ScatterDimensionNumbers(update_window_dims=window, inserted_window_dims=inserted,
                                           scatter_dims_to_operand_dims=to_operand)

    windows = lax.GatherDimensionNumbers(offset_dims=(1, 2), collapsed_slice_dims=(),
                                         start_index_map=(0,))

    def embedding_grad(t, ids, g):
        return jax.vjp(lambda t: t[spread(ids, 8)], t)[1](g)[0]

    def take_along_grad(x, i, g):
        return jax.vjp(lambda x: jnp.take_along_axis(x, spread(i, 8), axis=1), x)[1](g)[0]

    x84, x48, i4, i44, v44 = ((8, 4), "f"), ((4, 8), "f"), ((4,), "i"), ((4, 4), "i"), ((4, 4), "f")
    s = ((), "i")
    out = [
        ("x[idx]", "gather", lambda x, i: x[spread(i, 8)], x84, i4),
        ("x[:, idx]", "gather", lambda x, i: x[:, spread(i, 8)], x48, i4),
        ("embedding table[ids]", "gather", lambda t, ids: t[spread(ids, 8)], x84, i44),
        ("x[idx, jdx]", "gather", lambda x, i, j: x[spread(i, 8), spread(j, 4)], x84, i4, i4),
        ("x[idx] out of range clamps", "gather", lambda x, i: x[i * 3], x84, i4),
        ("take_along_axis axis=1", "gather",
         lambda x, i: jnp.take_along_axis(x, spread(i, 8), axis=1), x48, i44),
        ("take_along_axis axis=0", "gather",
         lambda x, i: jnp.take_along_axis(x, spread(i, 8), axis=0), x84, ((4, 4), "i")),
        ("take fill nan", "gather", lambda x, i: jnp.take(x, i * 3 - 4, axis=0, mode="fill"),
         x84, i4),
        ("take fill 7", "gather",
         lambda x, i: jnp.take(x, i * 3 - 4, axis=0, mode="fill", fill_value=7.0), x84, i4),
        ("int take fill", "gather", lambda x, i: jnp.take(x, i * 3 - 4, axis=0, mode="fill"),
         ((8, 4), "i"), i4),
        ("take clip", "gather", lambda x, i: jnp.take(x, i * 3 - 4, axis=0, mode="clip"), x84, i4),
        ("bool x[idx]", "gather", lambda x, i: x[spread(i, 8)], ((8, 4), "b"), i4),
        ("gather window", "gather",
         lambda x, i: lax.gather(x, spread(i, 6)[:, None], windows, (3, 4), mode="clip"), x84, i4),
        ("x.at[idx].add", "scatter-add", lambda x, i, v: x.at[spread(i, 8)].add(v), x84, i4, v44),
        ("embedding grad", "scatter-add", embedding_grad, x84, i44, ((4, 4, 4), "f")),
        ("take_along_axis grad", "scatter-add", take_along_grad, x48, i44, v44),
        ("x.at[idx, jdx].add", "scatter-add",
         lambda x, i, j, v: x.at[spread(i, 8), spread(j, 4)].add(v), x84, i4, i4, ((4,), "f")),
        ("x.at[idx].add clip", "scatter-add",
         lambda x, i, v: x.at[i * 3 - 4].add(v, mode="clip"), x84, i4, v44),
        ("x.at[idx].add drop", "scatter-add",
         lambda x, i, v: x.at[i * 3 - 4].add(v, mode="drop"), x84, i4, v44),
        ("int x.at[idx].add", "scatter-add", lambda x, i, v: x.at[spread(i, 8)].add(v),
         ((8, 4), "i"), i4, ((4, 4), "i")),
        ("scatter_sub", "scatter-sub",
         lambda x, i, v: lax.scatter_sub(x, spread(i, 8)[:, None], v, scatter_dn((1,), (0,), (0,))),
         x84, i4, v44),
        ("x.at[idx].set duplicates", "scatter",
         lambda x, i, v: x.at[spread(i, 8)].set(v), x84, i4, v44),
        ("x.at[:, idx].set", "scatter", lambda x, i, v: x.at[:, spread(i, 8)].set(v), x48, i4, v44),
        ("x.at[idx].mul", "scatter-mul", lambda x, i, v: x.at[spread(i, 8)].multiply(v), x84, i4, v44),
        ("x.at[idx].min", "scatter-min", lambda x, i, v: x.at[spread(i, 8)].min(v), x84, i4, v44),
        ("x.at[idx].max", "scatter-max", lambda x, i, v: x.at[spread(i, 8)].max(v), x84, i4, v44),
        ("dynamic_slice row", "dynamic_slice",
         lambda x, i: lax.dynamic_slice(x, (spread(i, 8), 0), (1, 4)), x84, s),
        ("x[i]", "dynamic_slice", lambda x, i: x[spread(i, 8)], x84, s),
        ("x[i, j]", "dynamic_slice", lambda x, i, j: x[spread(i, 8), spread(j, 4)], x84, s, s),
        ("dynamic_slice out of range clamps", "dynamic_slice",
         lambda x, i: lax.dynamic_slice(x, (i * 3 - 4, 0), (1, 4)), x84, s),
        ("dynamic_slice window", "dynamic_slice",
         lambda x, i: lax.dynamic_slice(x, (i, 0), (3, 4)), x84, s),
        ("dynamic_update_slice row", "dynamic_update_slice",
         lambda x, u, i: lax.dynamic_update_slice(x, u, (spread(i, 8), 0)), x84, ((1, 4), "f"), s),
        ("dynamic_update_slice column", "dynamic_update_slice",
         lambda x, u, i: lax.dynamic_update_slice(x, u, (0, spread(i, 8))), x48, ((4, 1), "f"), s),
        ("dynamic_update_slice out of range clamps", "dynamic_update_slice",
         lambda x, u, i: lax.dynamic_update_slice(x, u, (i * 3 - 4, 0)), x84, ((1, 4), "f"), s),
        ("dynamic_update_slice window", "dynamic_update_slice",
         lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 0)), x84, ((3, 4), "f"), s),
        ("x[i] grad", "dynamic_update_slice",
         lambda x, i, g: jax.vjp(lambda x: x[spread(i, 8)], x)[1](g)[0], x84, s, ((4,), "f")),
    ]
    return [(name, prim, fn, tuple(args)) for name, prim, fn, *args in out]


__all__ = ["TABLE", "validation_samples"]
