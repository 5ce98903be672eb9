"""Scans, arg-reductions and sorts along one axis.

cumsum / cumprod / cummax / cummin / cumlogsumexp over a *sharded* axis: each device scans its
block, the shard totals are all-gathered (small), and each device combines its block with the
exclusive scan of the totals of the shards before it (after it, for reverse) — instead of
gathering the whole axis. argmax / argmin over a sharded axis: each device finds its local best
value and global index, the candidates are all-gathered, and the first best wins, as on one
device. top_k over a sharded axis does the same with each device's best k. sort keeps the
sorted axis whole; every other dim stays sharded.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from autoshard.compiler.dtypes import highest, lowest
from autoshard.compiler.factors import LETTERS, Serves, einsum
from autoshard.placement import ReduceType

from .registry import Rule

_COMBINE = {
    lax.cumsum_p: (lax.add, lambda dt: 0),
    lax.cumprod_p: (lax.mul, lambda dt: 1),
    lax.cummax_p: (lax.max, lowest),
    lax.cummin_p: (lax.min, highest),
    lax.cumlogsumexp_p: (jnp.logaddexp, lambda dt: -np.inf),
}
_SCAN = {lax.cumsum_p: lax.cumsum, lax.cumprod_p: lax.cumprod, lax.cummax_p: lax.cummax,
         lax.cummin_p: lax.cummin, lax.cumlogsumexp_p: lax.cumlogsumexp}


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


# -- cumulative scans ------------------------------------------------------------------------

def cumulative_sharding(in_avals, out_avals, *, axis, reverse):
    term = LETTERS[:len(in_avals[0].shape)]
    return einsum(f"{term}->{term}", [in_avals[0].shape], [out_avals[0].shape])


def cumulative_lower(primitive):
    combine, identity = _COMBINE[primitive]
    scan = _SCAN[primitive]

    def lower(ctx, x, *, axis, reverse):
        local = scan(x, axis=axis, reverse=reverse)
        axes = ctx.in_layouts[0].dims[axis]
        if not axes:
            return [local]
        n = math.prod(ctx.sizes[a] for a in axes)
        edge = 0 if reverse else x.shape[axis] - 1
        total = lax.slice_in_dim(local, edge, edge + 1, axis=axis)     # this shard's total
        totals = lax.all_gather(total, axes[0] if len(axes) == 1 else axes, axis=0, tiled=False)
        me = ctx.block_index(axes)
        fill = jnp.full(total.shape, identity(x.dtype), x.dtype)
        prefix = fill
        for j in range(n):  # n is a mesh size: a short, unrolled exclusive scan
            before = (j > me) if reverse else (j < me)
            prefix = jnp.where(before, combine(prefix, totals[j]), prefix)
        return [combine(prefix, local)]

    return lower


def cumulative_comm(in_layouts, out_layouts, in_avals, out_avals, sizes, *, axis, reverse):
    axes = in_layouts[0].dims[axis]
    if not axes:
        return []
    local = list(in_layouts[0].local_shape(in_avals[0].shape, sizes))
    local[axis] = 1
    n = math.prod(sizes[a] for a in axes)
    return [("all-gather", f"all_gather({','.join(axes)}) shard totals", axes,
             _nbytes(local, in_avals[0].dtype) * (n - 1))]


# -- argmax / argmin ---------------------------------------------------------------------------

def arg_sharding(in_avals, out_avals, *, axes, index_dtype):
    term = LETTERS[:len(in_avals[0].shape)]
    out = "".join(ch for d, ch in enumerate(term) if d not in axes)
    if len(axes) != 1:
        return None
    return einsum(f"{term}->{out}", [in_avals[0].shape], [out_avals[0].shape],
                  combine=term[axes[0]])


def arg_lower(is_max: bool):
    def lower(ctx, x, *, axes, index_dtype):
        (axis,) = axes
        best = (jnp.argmax if is_max else jnp.argmin)(x, axis=axis).astype(index_dtype)
        mesh_axes = ctx.in_layouts[0].dims[axis]
        if not mesh_axes:
            return [best]
        value = (jnp.max if is_max else jnp.min)(x, axis=axis)
        index = best + (ctx.block_index(mesh_axes) * x.shape[axis]).astype(index_dtype)
        name = mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes
        # invariant results: every device of the axis ends with the same answer
        values = lax.all_gather(value, name, axis=0, tiled=False, to="invarying")
        indices = lax.all_gather(index, name, axis=0, tiled=False, to="invarying")
        target = (jnp.max if is_max else jnp.min)(values, axis=0)
        hit = values == target
        if jnp.issubdtype(values.dtype, jnp.floating):
            hit = hit | jnp.isnan(values)  # a NaN is the best value, as on one device
        # the first shard holding the best value has the smallest global index: as one device
        big = jnp.iinfo(np.dtype(index_dtype)).max
        return [jnp.min(jnp.where(hit, indices, big), axis=0).astype(index_dtype)]

    return lower


def arg_comm(in_layouts, out_layouts, in_avals, out_avals, sizes, *, axes, index_dtype):
    mesh_axes = in_layouts[0].dims[axes[0]]
    if not mesh_axes:
        return []
    n = math.prod(sizes[a] for a in mesh_axes)
    local = out_layouts[0].local_shape(out_avals[0].shape, sizes)
    return [("all-gather", f"all_gather({','.join(mesh_axes)}) local best values", mesh_axes,
             _nbytes(local, in_avals[0].dtype) * (n - 1)),
            ("all-gather", f"all_gather({','.join(mesh_axes)}) local best indices", mesh_axes,
             _nbytes(local, index_dtype) * (n - 1))]


# -- sort, top_k -------------------------------------------------------------------------------

def sort_sharding(in_avals, out_avals, *, dimension, is_stable, num_keys):
    term = LETTERS[:len(in_avals[0].shape)]
    return einsum(",".join([term] * len(in_avals)) + "->" + ",".join([term] * len(out_avals)),
                  [a.shape for a in in_avals], [a.shape for a in out_avals],
                  replicate=term[dimension])


def _search(in_avals, out_avals, axis: int, *, combined: bool):
    """(values, indices) of the best k along `axis`: the k dim of the results is never split;
    the searched dim is COMBINE (candidates merged by the lowering) or whole."""
    shape = in_avals[0].shape
    term = LETTERS[:len(shape)]
    axis = axis % len(shape)
    out = term[:axis] + "." + term[axis + 1:]
    return einsum(f"{term}->{out},{out}", [shape], [a.shape for a in out_avals],
                  **{"combine" if combined else "replicate": term[axis]})


def top_k_sharding(in_avals, out_avals, *, k, axis=-1, **params):
    return _search(in_avals, out_avals, axis, combined=True)


def _candidates_cost_more(block: int, k: int, value_dtype, index_dtype) -> bool:
    """Each device's best k (values and indices) would outweigh its whole block."""
    kk = min(k, block)
    return kk * (np.dtype(value_dtype).itemsize + np.dtype(index_dtype).itemsize) \
        >= block * np.dtype(value_dtype).itemsize


def top_k_lower(ctx, x, *, k, axis=-1, **params):
    axis = axis % x.ndim
    mesh_axes = ctx.in_layouts[0].dims[axis]
    name = mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes
    if mesh_axes and _candidates_cost_more(x.shape[axis], k, x.dtype, np.int32):
        x = lax.all_gather(x, name, axis=axis, tiled=True, to="invarying")
        mesh_axes = ()
    if not mesh_axes:
        return list(lax.top_k(x, k, axis=axis))
    # Each device's best min(k, block) along the axis, with their global indices; the n·kk
    # candidates (shard-major, so equal values keep one device's lowest-index-first order)
    # are gathered and searched again.
    kk = min(k, x.shape[axis])
    values, local = lax.top_k(x, kk, axis=axis)
    index = local + (ctx.block_index(mesh_axes) * x.shape[axis]).astype(local.dtype)
    values = lax.all_gather(values, name, axis=axis, tiled=True, to="invarying")
    index = lax.all_gather(index, name, axis=axis, tiled=True, to="invarying")
    best, where = lax.top_k(values, k, axis=axis)
    return [best, jnp.take_along_axis(index, where, axis=axis)]


def top_k_comm(in_layouts, out_layouts, in_avals, out_avals, sizes, *, k, axis=-1, **params):
    axis = axis % len(in_avals[0].shape)
    axes = in_layouts[0].dims[axis]
    if not axes:
        return []
    n = math.prod(sizes[a] for a in axes)
    local = list(in_layouts[0].local_shape(in_avals[0].shape, sizes))
    name = ",".join(axes)
    if _candidates_cost_more(local[axis], k, in_avals[0].dtype, out_avals[1].dtype):
        return [("all-gather", f"all_gather({name}) the searched dim (smaller than k candidates)",
                 axes, _nbytes(local, in_avals[0].dtype) * (n - 1), 0)]
    local[axis] = min(k, local[axis])
    return [("all-gather", f"all_gather({name}) local top-k values", axes,
             _nbytes(local, in_avals[0].dtype) * (n - 1)),
            ("all-gather", f"all_gather({name}) local top-k indices", axes,
             _nbytes(local, out_avals[1].dtype) * (n - 1), Serves(1))]


def approx_top_k_sharding(in_avals, out_avals, *, reduction_dimension, **params):
    # lax.approx_max_k / approx_min_k: approximate where the platform makes it so (TPU), so
    # candidates combined across shards could differ from one device's answer: the searched
    # dim stays whole, the others split
    return _search(in_avals, out_avals, reduction_dimension, combined=False)


TABLE = {p: Rule(cumulative_sharding, cumulative_lower(p), cumulative_comm) for p in _COMBINE}
TABLE.update({
    lax.argmax_p: Rule(arg_sharding, arg_lower(True), arg_comm),
    lax.argmin_p: Rule(arg_sharding, arg_lower(False), arg_comm),
    lax.sort_p: Rule(sort_sharding),
    lax.top_k_p: Rule(top_k_sharding, top_k_lower, top_k_comm),
    lax.approx_top_k_p: Rule(approx_top_k_sharding),
})


def validation_samples() -> list:
    f2 = ((4, 8), "f")
    out = []
    for name, fn in [("cumsum", jnp.cumsum), ("cumprod", jnp.cumprod)]:
        for axis in (0, 1):
            out.append((f"{name} axis={axis}", name, lambda x, fn=fn, a=axis: fn(x, axis=a), (f2,)))
    for name, fn in [("cummax", lax.cummax), ("cummin", lax.cummin),
                     ("cumlogsumexp", lax.cumlogsumexp)]:
        for axis in (0, 1):
            for rev in (False, True):
                out.append((f"{name} axis={axis} reverse={rev}", name,
                            lambda x, fn=fn, a=axis, r=rev: fn(x, axis=a, reverse=r), (f2,)))
    out.append(("cumsum reverse", "cumsum", lambda x: lax.cumsum(x, axis=1, reverse=True), (f2,)))
    for name, fn in [("argmax", jnp.argmax), ("argmin", jnp.argmin)]:
        for axis in (0, 1):
            out.append((f"{name} axis={axis}", name, lambda x, fn=fn, a=axis: fn(x, axis=a), (f2,)))
    out.append(("sort axis=0", "sort", lambda x: jnp.sort(x, axis=0), (f2,)))
    out.append(("sort axis=1 with values", "sort",
                lambda x, y: lax.sort((x, y), dimension=1, num_keys=1)[1], (f2, f2)))
    out.append(("top_k", "top_k", lambda x: lax.top_k(x, 3)[0] + lax.top_k(x, 3)[1], (f2,)))
    out.append(("top_k k > block", "top_k", lambda x: lax.top_k(x, 6)[0] * lax.top_k(x, 6)[1], (f2,)))
    out.append(("top_k axis=0", "top_k", lambda x: lax.top_k(x, 3, axis=0)[1], (f2,)))
    out.append(("approx_max_k", "approx_top_k",
                lambda x: lax.approx_max_k(x, 3)[0] + lax.approx_min_k(x, 2, reduction_dimension=0)[1].sum(),
                (f2,)))
    return out


__all__ = ["TABLE", "validation_samples", "ReduceType"]
