"""Shape primitives: data movement that keeps every Partial; dims that cannot move stay whole.

reshape uses a small dim algebra: input and output dims are grouped into runs of equal product;
a run is cut into the pieces both shapes agree on (their common refinement: (8) → (2, 4) is the
pieces 2 and 4), each piece a factor, and a dim spanning several pieces carries them all — a
compound dim, whose axes fill its major piece before the next (factors.py). Where no common
refinement exists ((4, 6) → (6, 4)) only the major-most dims share a factor. A reversed
dim stays split: each device reverses its block and swaps it with its mirror device's.
"""
from __future__ import annotations

import itertools
import math
import operator

import jax
import numpy as np
from jax import lax
from jax._src.lax import lax as lax_internal
from jax._src.lax.control_flow import platform_index_p

from autoshard.compiler.factors import ALL, LETTERS, Factor, OpSharding, PASS, REPLICATE, einsum

from .registry import Rule

_KEEP = dict(linear=ALL, monotone=ALL)


def broadcast_in_dim_sharding(in_avals, out_avals, *, shape, broadcast_dimensions, **params):
    out = LETTERS[:len(shape)]
    term = "".join(out[d] if in_avals[0].shape[i] == shape[d] else "."
                   for i, d in enumerate(broadcast_dimensions))
    extra = ["" for _ in in_avals[1:]]  # dynamic shape operands, if any
    return einsum(",".join([term] + extra) + "->" + out, [a.shape for a in in_avals], [shape], **_KEEP)


def transpose_sharding(in_avals, out_avals, *, permutation):
    term = LETTERS[:len(permutation)]
    return einsum(f"{term}->{''.join(term[p] for p in permutation)}", [in_avals[0].shape],
                  [out_avals[0].shape], **_KEEP)


def squeeze_sharding(in_avals, out_avals, *, dimensions):
    term = LETTERS[:len(in_avals[0].shape)]
    out = "".join(ch for d, ch in enumerate(term) if d not in dimensions)
    return einsum(f"{term}->{out}", [in_avals[0].shape], [out_avals[0].shape], **_KEEP)


def _runs(a: tuple[int, ...], b: tuple[int, ...]):
    """Split two shapes of equal size into runs of dims with equal products."""
    i = j = 0
    while i < len(a) or j < len(b):
        ri, rj = [i], [j]
        pa = a[i] if i < len(a) else 1
        pb = b[j] if j < len(b) else 1
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa *= a[i]; ri.append(i); i += 1
            else:
                pb *= b[j]; rj.append(j); j += 1
        yield [d for d in ri if d < len(a)], [d for d in rj if d < len(b)]


def _pieces(src: list[int], dst: list[int]) -> list[int] | None:
    """The common refinement of two factorizations of one extent: the sizes between the cuts
    both shapes make (prefix products), if each cut divides the next; else None ((4, 6) and
    (6, 4) cut at 4 and 6, and no piece of 6 / 4 exists)."""
    cuts = sorted({p for sizes in (src, dst) for p in itertools.accumulate(sizes, operator.mul)})
    pieces, last = [], 1
    for c in cuts:
        if c % last:
            return None
        pieces.append(c // last)
        last = c
    return pieces


def reshape_sharding(in_avals, out_avals, *, new_sizes, dimensions, **params):
    # `dimensions`: the operand is transposed first (a grouped convolution's kernel gradient
    # has one); the runs are those of the transposed shape, mapped back to the operand's dims
    order = tuple(range(len(in_avals[0].shape))) if dimensions is None else tuple(dimensions)
    src, dst = tuple(in_avals[0].shape[d] for d in order), tuple(new_sizes)
    if 0 in src or 0 in dst:  # an empty array (jnp.pad's edge mode makes some): nothing to split
        return OpSharding(((None,) * len(src),), ((None,) * len(dst),), (), **_KEEP)
    operand: list = [None] * len(src)
    result: list = [None] * len(dst)
    factors: list[Factor] = []
    compounds: list[tuple[int, ...]] = []
    for run_in, run_out in _runs(src, dst):
        big_in = [d for d in run_in if src[d] > 1]
        big_out = [d for d in run_out if dst[d] > 1]
        pieces = _pieces([src[d] for d in big_in], [dst[d] for d in big_out]) \
            if len(big_in) + len(big_out) > 2 else None
        if pieces is not None:
            # split or merged dims: each piece is a factor, and a dim spanning several carries
            # them all (major first), so an axis per piece moves nothing (heads over (m0, m1)
            # reshaped to (kv_heads, group): m0 on kv_heads, m1 on the group)
            first = len(factors)
            factors.extend(Factor(PASS, size=p) for p in pieces)
            for dims, sizes, into in ((big_in, src, operand), (big_out, dst, result)):
                k = first
                for d in dims:
                    covered, mine = 1, []
                    while covered < sizes[d]:
                        covered *= factors[k].size
                        mine.append(k)
                        k += 1
                    into[d] = mine[0] if len(mine) == 1 else tuple(mine)
                    if len(mine) > 1:
                        compounds.append(tuple(mine))
            continue
        if big_in and big_out:
            operand[big_in[0]] = result[big_out[0]] = len(factors)
            factors.append(Factor(PASS))
        for d in big_in[1:]:
            operand[d] = len(factors)
            factors.append(Factor(REPLICATE))
        for d in big_out[1:]:
            result[d] = len(factors)
            factors.append(Factor(REPLICATE))
    unpermuted: list = [None] * len(src)
    for k, d in enumerate(order):
        unpermuted[d] = operand[k]
    return OpSharding((tuple(unpermuted),), (tuple(result),), tuple(factors), regroups=True,
                      compounds=tuple(compounds), **_KEEP)


def concatenate_sharding(in_avals, out_avals, *, dimension):
    r = len(out_avals[0].shape)
    term = LETTERS[:r]
    return einsum(",".join([term] * len(in_avals)) + "->" + term, [a.shape for a in in_avals],
                  [out_avals[0].shape], replicate=term[dimension], **_KEEP)


def split_sharding(in_avals, out_avals, *, sizes, axis):
    term = LETTERS[:len(in_avals[0].shape)]
    return einsum(f"{term}->" + ",".join([term] * len(out_avals)), [in_avals[0].shape],
                  [a.shape for a in out_avals], replicate=term[axis], **_KEEP)


def _interleaving(lo: int, hi: int, interior: int) -> bool:
    """A pad that spreads each row over `interior + 1` rows (row k at k (interior + 1) + lo,
    the rest padding): block i of the result comes from block i of the operand alone (an
    associative scan's interleave of its even and odd elements)."""
    return interior > 0 and 0 <= lo <= interior and hi >= 0 and lo + hi == interior


def _spread(rows: int, lo: int, hi: int, interior: int) -> bool:
    """A pad to at least twice its operand's rows (the gradient of a slice of a few rows):
    the result may be split while the operand is whole — each device pads its own block,
    holding the operand's rows where they land and the padding elsewhere."""
    return interior == 0 and lo >= 0 and hi >= 0 and rows <= lo + hi


def pad_sharding(in_avals, out_avals, *, padding_config):
    shape = in_avals[0].shape
    term = LETTERS[:len(padding_config)]
    # an interleaving dim of one row is no interleave to split: the rule's einsum gives a
    # size-1 operand dim no factor (broadcast), which would let the result split alone
    changed = [d for d, cfg in enumerate(padding_config)
               if tuple(cfg) != (0, 0, 0) and not (shape[d] > 1 and _interleaving(*cfg))]
    spread = [d for d in changed if _spread(shape[d], *padding_config[d])]
    # The padding value is an operand too: Partial(sum) pads parts with 0 and one part with it.
    # A spread dim's letter is the result's alone (like a broadcast's new dim).
    operand = "".join("." if d in spread else ch for d, ch in enumerate(term))
    return einsum(f"{operand},->{term}", [a.shape for a in in_avals], [out_avals[0].shape],
                  replicate="".join(term[d] for d in changed if d not in spread), **_KEEP)


def _rows_at(x, dim: int, value, start, k: int):
    """Rows [start, start + k) of `x` along `dim` (`start` traced, this device's), the value
    `value` where they lie outside `x`: a dynamic slice of `x` padded by k rows each side."""
    config = [(0, 0, 0)] * x.ndim
    config[dim] = (k, k, 0)
    at = lax.clamp(np.int32(0), lax.add(start, np.int32(k)), np.int32(x.shape[dim] + k))
    return lax.dynamic_slice_in_dim(lax.pad(x, value, config), at, k, axis=dim)


def pad_lower(ctx, x, value, *, padding_config):
    config = [tuple(c) for c in padding_config]
    outs = ctx.out_layouts[0].dims
    local = ctx.local_out_shapes[0]
    for d, (axes, (lo, hi, interior)) in enumerate(zip(outs, config)):
        if not axes or ctx.in_layouts[0].dims[d] or interior:
            continue
        # this device's block of the padded dim: rows [i b - lo, (i + 1) b - lo) of x
        b = local[d]
        start = lax.sub(lax.mul(ctx.block_index(axes), np.int32(b)), np.int32(lo))
        x = _rows_at(x, d, value, start, b)
        config[d] = (0, 0, 0)
    return [lax.pad(x, value, config)]


def _few_rows(size: int, start: int, limit: int, stride: int) -> bool:
    """A slice of at most half a dim's rows (the last token, a class token, a window): where
    the dim is split, the devices holding those rows supply them and the others zeros — a
    pending sum of the slice, where gathering would move the whole dim."""
    return stride == 1 and 2 * (limit - start) <= size


def _every_kth(size: int, start: int, limit: int, stride: int) -> bool:
    """A strided slice taking one row in every `stride` from the first `stride` rows on
    (x[:, ::2], x[:, 1::2]: a 2x downsample, even and odd rows): result block i is read from
    operand block i alone whenever the result's rows divide over the devices, so the dim
    stays split and each device slices its own block."""
    rows = len(range(start, limit, stride))
    # one row is no block to keep: the rule gives a size-1 dim no factor, which would let the
    # operand split alone and each device slice a row of its own block
    return 0 <= start < stride and rows * stride == size and rows > 1


def slice_sharding(in_avals, out_avals, *, start_indices, limit_indices, strides):
    shape = in_avals[0].shape
    term = LETTERS[:len(shape)]
    strides = strides or (1,) * len(shape)
    cut = [d for d, (s, lo, hi, st) in enumerate(zip(shape, start_indices, limit_indices, strides))
           if (lo, hi, st) != (0, s, 1) and not _every_kth(s, lo, hi, st)]
    summable = jax.dtypes.issubdtype(in_avals[0].dtype, np.number)
    few = [d for d in cut if summable and _few_rows(shape[d], start_indices[d],
                                                    limit_indices[d], strides[d])]
    # a few rows' letter appears on the input only: split, it leaves the slice Partial(sum)
    out = "".join("." if d in few else ch for d, ch in enumerate(term))
    return einsum(f"{term}->{out}", [shape], [out_avals[0].shape],
                  replicate="".join(term[d] for d in cut if d not in few), **_KEEP)


def slice_lower(ctx, x, *, start_indices, limit_indices, strides):
    # A split dim is whole, or every k-th row from the first k (each device slices its own
    # block from the same start), or a few rows
    local = x.shape
    ins, outs = ctx.in_layouts[0].dims, ctx.out_layouts[0].dims
    few = [d for d, (a, b) in enumerate(zip(ins, outs)) if a and not b]
    starts = tuple(start_indices)
    limits = tuple(local[d] if axes and d not in few else hi
                   for d, (hi, axes) in enumerate(zip(limit_indices, ins)))
    for d in few:  # the slice's rows where this block holds them, zeros elsewhere
        rows, b = limits[d] - starts[d], local[d]
        start = lax.sub(np.int32(starts[d]), lax.mul(ctx.block_index(ins[d]), np.int32(b)))
        x = _rows_at(x, d, np.zeros((), x.dtype), start, rows)
        starts = starts[:d] + (0,) + starts[d + 1:]
        limits = limits[:d] + (rows,) + limits[d + 1:]
    return [lax.slice(x, starts, limits, strides)]


def rev_sharding(in_avals, out_avals, *, dimensions):
    # a reversed dim stays split: block i of the result is block n-1-i reversed
    term = LETTERS[:len(in_avals[0].shape)]
    return einsum(f"{term}->{term}", [in_avals[0].shape], [out_avals[0].shape], **_KEEP)


def rev_lower(ctx, x, *, dimensions):
    x = lax.rev(x, dimensions)
    split = [ctx.in_layouts[0].dims[d] for d in dimensions if ctx.in_layouts[0].dims[d]]
    if not split:
        return [x]
    # each device's block goes to the device mirrored along every reversed dim (one
    # collective-permute; a middle device keeps its block)
    axes = tuple(a for dim_axes in split for a in dim_axes)
    counts = [math.prod(ctx.sizes[a] for a in dim_axes) for dim_axes in split]
    pairs = []
    for blocks in itertools.product(*(range(n) for n in counts)):
        source = target = 0
        for b, n in zip(blocks, counts):
            source, target = source * n + b, target * n + (n - 1 - b)
        pairs.append((source, target))
    return [ctx.ppermute(x, axes, pairs)]


def rev_comm(in_layouts, out_layouts, in_avals, out_avals, sizes, *, dimensions):
    axes = tuple(a for d in dimensions for a in in_layouts[0].dims[d])
    if not axes:
        return []
    local = in_layouts[0].local_shape(in_avals[0].shape, sizes)
    block = math.prod(local) * np.dtype(in_avals[0].dtype).itemsize
    return [("collective-permute", f"ppermute({','.join(axes)}) blocks to their mirror devices",
             axes, block)]


def iota_sharding(in_avals, out_avals, *, dtype, shape, dimension, sharding):
    return einsum(f"->{LETTERS[:len(shape)]}", [], [shape])


def iota_lower(ctx, *, dtype, shape, dimension, sharding):
    local = ctx.local_out_shapes[0]
    values = lax.iota(dtype, local[dimension])
    axes = ctx.out_layouts[0].dims[dimension]
    if axes:  # each device counts from its block's global start
        values = values + (ctx.block_index(axes) * local[dimension]).astype(dtype)
    return [lax.broadcast_in_dim(values, local, (dimension,))]


def tile_sharding(in_avals, out_avals, *, reps):
    # a tiled dim repeats the whole of it: only untiled dims (reps 1) may stay split
    term = LETTERS[:len(reps)]
    return einsum(f"{term}->{term}", [in_avals[0].shape], [out_avals[0].shape],
                  replicate="".join(ch for ch, r in zip(term, reps) if r != 1), **_KEEP)


def stack_sharding(in_avals, out_avals, *, axis):
    # the new dim holds one operand per index: it is never split; the others pass
    term = LETTERS[:len(in_avals[0].shape)]
    out = term[:axis] + "." + term[axis:]
    return einsum(",".join([term] * len(in_avals)) + "->" + out, [a.shape for a in in_avals],
                  [out_avals[0].shape], **_KEEP)


def unstack_sharding(in_avals, out_avals, *, axis):
    # stack's transpose (the gradient of jnp.stack): result i is index i of the dim, which
    # stays whole; the other dims pass
    term = LETTERS[:len(in_avals[0].shape)]
    out = term[:axis] + term[axis + 1:]
    return einsum(f"{term}->" + ",".join([out] * len(out_avals)), [in_avals[0].shape],
                  [a.shape for a in out_avals], replicate=term[axis], **_KEEP)


def nullary_scalar_sharding(in_avals, out_avals, **params):
    # a scalar every device makes alike from no inputs: which branch of lax.platform_dependent
    # runs (jnp.diagonal uses one), or the zero a differentiated scan broadcasts into the
    # buffers of its residuals (empty2)
    return einsum("->", [], [()])


TABLE = {
    lax.broadcast_in_dim_p: Rule(broadcast_in_dim_sharding),
    lax.transpose_p: Rule(transpose_sharding),
    lax.squeeze_p: Rule(squeeze_sharding),
    lax.reshape_p: Rule(reshape_sharding),
    lax.concatenate_p: Rule(concatenate_sharding),
    lax.pad_p: Rule(pad_sharding, pad_lower),
    lax.split_p: Rule(split_sharding),
    lax.slice_p: Rule(slice_sharding, slice_lower),
    lax.rev_p: Rule(rev_sharding, rev_lower, rev_comm),
    lax.iota_p: Rule(iota_sharding, iota_lower),
    platform_index_p: Rule(nullary_scalar_sharding),
    lax_internal.empty2_p: Rule(nullary_scalar_sharding),
    lax_internal.tile_p: Rule(tile_sharding),
    lax_internal.stack_p: Rule(stack_sharding),
    lax_internal.unstack_p: Rule(unstack_sharding),
}

__all__ = ["TABLE"]
