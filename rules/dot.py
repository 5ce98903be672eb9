"""dot_general with any dimension numbers and ragged_dot (grouped matmul): batch and free dims
pass, contracting dims reduce (sum). Convolutions are in conv.py."""
from __future__ import annotations

import numpy as np
from jax import lax
from jax._src.lax.lax import ragged_dot_general_p

from autoshard.compiler.factors import LETTERS, NONE, ONE, einsum
from autoshard.compiler.partition import match_vma

from .elementwise import carries_sums
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
    # Linear in each operand: one Partial(sum) operand passes through a matmul — unless it
    # computes in a type the sum does not carry to (preferred_element_type widening int8)
    linear = ONE if all(carries_sums(a.dtype, out_avals[0].dtype) for a in in_avals) else NONE
    return einsum(spec, [lhs.shape, rhs.shape], [out_avals[0].shape], linear=linear)


def ragged_dot_sharding(in_avals, out_avals, *, ragged_dot_dimension_numbers, group_offset,
                        **params):
    """ragged_dot_general (jax.lax.ragged_dot, a mixture of experts' grouped matmul): the
    lhs rows are cut into groups by `group_sizes`, each multiplied by its group's rhs. The
    contracting dims reduce and the free dims pass as in a matmul; the group dim stays whole.
    The ragged dim may be split: each block of rows gets its own group sizes (ragged_dot_lower),
    so tokens split over data parallelism stay split. Two forms: ragged rows with a group dim
    in the rhs (the forward and the lhs gradient: the split passes to the output rows), and a
    ragged contracting dim that makes a group dim first in the output (the rhs gradient: a
    split there is contracted, each block's sum pending)."""
    rdn = ragged_dot_dimension_numbers
    (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
    lhs, rhs, sizes = in_avals
    if group_offset is not None or lb or rb or len(rdn.lhs_ragged_dimensions) != 1:
        return None
    ragged, groups = rdn.lhs_ragged_dimensions[0], rdn.rhs_group_dimensions
    letters = iter(LETTERS)
    lterm, rterm = [""] * len(lhs.shape), [""] * len(rhs.shape)
    for a, b in zip(lc, rc):
        lterm[a] = rterm[b] = next(letters)
    group = next(letters)
    if ragged in lc:           # ragged contracting: out = [group, lhs free, rhs free]
        if groups:
            return None
        out = [group]
    elif len(groups) == 1:     # ragged rows: out = [lhs free (the ragged one too), rhs free]
        rterm[groups[0]] = group
        out = []
    else:
        return None
    for term in (lterm, rterm):
        for d, ch in enumerate(term):
            if not ch:
                term[d] = ch = next(letters)
                out.append(ch)
    if len(out) != len(out_avals[0].shape):
        return None
    # the group sizes stay whole (each block needs the groups before its own); the group dim
    # of the rhs or of the output may split: experts over a mesh axis, each device running its
    # own (ragged rows: the other experts' rows come out zero, so the output is a pending sum)
    whole = next(letters)
    spec = f"{''.join(lterm)},{''.join(rterm)},{whole}->{''.join(out)}"
    return einsum(spec, [lhs.shape, rhs.shape, sizes.shape], [out_avals[0].shape],
                  replicate=whole, linear=ONE, partial_operands=(0, 1))


def ragged_dot_lower(ctx, lhs, rhs, group_sizes, *, ragged_dot_dimension_numbers, **params):
    """A block of rows [start, start + n) keeps, of each group [begin, end), the rows inside
    the block: the groups are contiguous and cover the rows from the first, so the kept rows
    are the block's first ones, as ragged_dot expects; rows past every group stay zero.

    A block of groups [g0, g0 + k) (experts split) runs as k + 1 groups, the first one a zero
    matrix taking the rows of the groups before g0; rows past the block's groups stay zero.
    With a ragged contracting dim the extra group's output is dropped."""
    rdn = ragged_dot_dimension_numbers
    ragged = rdn.lhs_ragged_dimensions[0]
    sizes = group_sizes
    axes = ctx.in_layouts[0].dims[ragged]
    if axes:
        n = lhs.shape[ragged]
        start = lax.convert_element_type(lax.mul(ctx.block_index(axes), np.int32(n)), sizes.dtype)
        begin = _group_starts(sizes)
        end = lax.add(begin, sizes)
        zero, rows = np.zeros((), sizes.dtype), np.asarray(n, sizes.dtype)

        def inside(v):
            return lax.clamp(zero, lax.sub(v, start), rows)

        sizes = lax.sub(inside(end), inside(begin))
    contracting = ragged in rdn.dot_dimension_numbers[0][0]
    group_dim = None if contracting else rdn.rhs_group_dimensions[0]
    group_axes = ctx.out_layouts[0].dims[0] if contracting else ctx.in_layouts[1].dims[group_dim]
    if group_axes:
        k = ctx.local_out_shapes[0][0] if contracting else rhs.shape[group_dim]
        g0 = lax.mul(ctx.block_index(group_axes), np.int32(k))
        before = lax.dynamic_slice(_group_starts(sizes), (g0,), (1,))
        sizes = lax.concatenate([before, lax.dynamic_slice(sizes, (g0,), (k,))], 0)
        if not contracting:
            shape = list(rhs.shape)
            shape[group_dim] = 1
            rhs = lax.concatenate([lax.full(shape, 0, rhs.dtype), rhs], group_dim)
    if axes or group_axes:
        lhs, rhs, sizes = match_vma([lhs, rhs, sizes])
    out = ragged_dot_general_p.bind(lhs, rhs, sizes, ragged_dot_dimension_numbers=rdn, **params)
    if contracting and group_axes:
        out = lax.slice_in_dim(out, 1, out.shape[0], axis=0)
    return [out]


def _group_starts(sizes):
    """The first row of each group (an exclusive cumulative sum of the sizes)."""
    return lax.sub(lax.cumsum(sizes, axis=0), sizes)


TABLE = {lax.dot_general_p: Rule(dot_general_sharding),
         ragged_dot_general_p: Rule(ragged_dot_sharding, ragged_dot_lower)}


def validation_samples() -> list:
    """ragged_dot in its three forms (forward, lhs and rhs gradients)."""
    import jax
    import jax.numpy as jnp

    sizes = jnp.array([1, 0, 3], jnp.int32)  # 4 rows in 3 groups, one of them empty
    rows_aval = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    experts_aval = jax.ShapeDtypeStruct((3, 8, 4), jnp.float32)
    ragged = lambda a, b: lax.ragged_dot(a, b, sizes)  # noqa: E731
    sizes4 = jnp.array([3, 0, 4, 1], jnp.int32)  # a group crossing a block of 2 or 4 rows
    experts4_aval = jax.ShapeDtypeStruct((4, 8, 4), jnp.float32)
    ragged4 = lambda a, b: lax.ragged_dot(a, b, sizes4)  # noqa: E731
    return [
        ("ragged_dot", "ragged_dot_general", ragged, (((4, 8), "f"), ((3, 8, 4), "f"))),
        ("ragged_dot lhs gradient", "ragged_dot_general",
         lambda ct, b: jax.linear_transpose(lambda a: ragged(a, b), rows_aval)(ct)[0],
         (((4, 4), "f"), ((3, 8, 4), "f"))),
        ("ragged_dot rhs gradient (ragged contracting)", "ragged_dot_general",
         lambda ct, a: jax.linear_transpose(lambda b: ragged(a, b), experts_aval)(ct)[0],
         (((4, 4), "f"), ((4, 8), "f"))),
        # 4 experts and 8 rows: both may split over a mesh axis (expert parallelism)
        ("ragged_dot 4 experts", "ragged_dot_general", ragged4,
         (((8, 8), "f"), ((4, 8, 4), "f"))),
        ("ragged_dot 4 experts rhs gradient", "ragged_dot_general",
         lambda ct, a: jax.linear_transpose(lambda b: ragged4(a, b), experts4_aval)(ct)[0],
         (((8, 4), "f"), ((8, 8), "f"))),
    ]


__all__ = ["TABLE", "validation_samples"]
