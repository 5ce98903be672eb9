"""autoshard_shift (compiler/shift.py: rolls and shifts folded from slices, pads and
concatenations): the shifted dim stays split; each device fetches the rows its block reads.

Output block i of a dim split into n blocks of b rows reads rows [i b + s, i b + s + b) (mod
n b) of the input, for the shift s mod n b = q b + t: rows [t, b) of block i + q and rows
[0, t) of block i + q + 1 — at most two collective-permutes (a roll by one row sends one row
to the next device, as XLA does), none for a part a device already holds. Rows outside the
shift's [lo, hi) (a token shift's zero row) are set to the fill on the devices holding them.
"""
from __future__ import annotations

import math

import numpy as np
from jax import lax

from autoshard.compiler.factors import ALL, LETTERS, einsum
from autoshard.compiler.shift import shift_p

from .registry import Rule


def shift_sharding(in_avals, out_avals, *, dim, shift, lo, hi):
    term = LETTERS[:len(in_avals[0].shape)]
    # a fill is an operand like pad's value: a pending sum fills one part, zeros the others
    spec = f"{term}{',' * (len(in_avals) - 1)}->{term}"
    return einsum(spec, [a.shape for a in in_avals], [out_avals[0].shape], linear=ALL,
                  monotone=ALL)


def _pieces(n: int, b: int, shift: int, lo: int, hi: int):
    """(hop, first row, end row, the blocks that need the piece) of the (at most) two pieces
    of a block's shifted rows: each receiver's rows [at, at + end - first) come from block
    receiver + hop; blocks whose rows there all lie outside [lo, hi) do not need it."""
    q, t = divmod(shift % (n * b), b)
    out = []
    for hop, first, end, at in ((q, t, b, 0), (q + 1, 0, t, b - t)):
        if end > first:
            need = [i for i in range(n)
                    if max(i * b + at, lo) < min(i * b + at + end - first, hi)]
            out.append((hop % n, first, end, need))
    return out


def shift_lower(ctx, x, *fill, dim, shift, lo, hi):
    axes = ctx.in_layouts[0].dims[dim]
    n = math.prod(ctx.sizes[a] for a in axes)
    b = x.shape[dim]
    parts = []
    for hop, first, end, need in _pieces(n, b, shift, lo, hi):
        piece = lax.slice_in_dim(x, first, end, axis=dim)
        if hop and need:  # receivers that need none of it get zeros, then the fill
            piece = ctx.ppermute(piece, axes, [((i + hop) % n, i) for i in need])
        parts.append(piece)
    out = lax.concatenate(parts, dim) if len(parts) > 1 else parts[0]
    first = lax.mul(ctx.block_index(axes), np.int32(b)) if axes else np.int32(0)
    for start, stop in ((0, lo), (hi, n * b)):  # the rows outside [lo, hi) take the fill
        out = _fill_rows(out, fill[0] if fill else None, dim, first, start, stop)
    return [out]


def _fill_rows(x, fill, dim: int, first, start: int, stop: int):
    """`x`, this device's rows [first, first + b) of a dim, with global rows [start, stop)
    set to `fill`. A few rows (a token shift's one) are rewritten in place — a window of that
    many rows where they fall, every block alike — rather than selecting over the whole block
    (a select over the block fused into what reads it, e.g. a transposing copy before a
    matmul, made XLA on CPU recompute it there)."""
    b, k = x.shape[dim], stop - start
    if k <= 0:
        return x
    at = np.int32(0)
    if k < b:
        at = lax.clamp(np.int32(0), lax.sub(np.int32(start), first), np.int32(b - k))
        window = lax.dynamic_slice_in_dim(x, at, k, axis=dim)
    else:
        window, k = x, b
    rows = lax.add(lax.broadcasted_iota(np.int32, window.shape, dim), lax.add(first, at))
    outside = lax.bitwise_and(lax.ge(rows, np.int32(start)), lax.lt(rows, np.int32(stop)))
    window = lax.select(outside, lax.broadcast(fill, window.shape), window)
    return window if k == b else lax.dynamic_update_slice_in_dim(x, window, at, axis=dim)


def shift_comm(in_layouts, out_layouts, in_avals, out_avals, sizes, *, dim, shift, lo, hi):
    axes = in_layouts[0].dims[dim]
    if not axes:
        return []
    local = in_layouts[0].local_shape(in_avals[0].shape, sizes)
    n, b = math.prod(sizes[a] for a in axes), local[dim]
    row = math.prod(local) // b * np.dtype(in_avals[0].dtype).itemsize
    out = []
    for hop, first, end, need in _pieces(n, b, shift, lo, hi):
        if hop and need:
            rows = end - first
            to = "" if len(need) == n else f" to block{'s' if len(need) > 1 else ''} " + \
                ",".join(map(str, need))
            # where the rows come from, as the receivers see it: a token shift's previous
            # block is "1 block before", not "n - 1 blocks after (cyclic)"
            if all(i - (n - hop) >= 0 for i in need):
                source = f"{n - hop} block{'' if n - hop == 1 else 's'} before"
            elif all(i + hop < n for i in need):
                source = f"{hop} block{'' if hop == 1 else 's'} after"
            else:
                source = f"{hop} block{'' if hop == 1 else 's'} after (cyclic)"
            out.append(("collective-permute",
                        f"ppermute({','.join(axes)}) {rows} row{'' if rows == 1 else 's'} of dim "
                        f"{dim} from {source}{to}", axes, rows * row, 0))
    return out


TABLE = {shift_p: Rule(shift_sharding, shift_lower, shift_comm)}


def validation_samples() -> list:
    """Rolls (jnp.roll both ways, by more than a block), token shifts with zeros (pad of a
    slice, concatenate with a broadcast zero) and a nonzero fill, a roll's gradient (a sum of
    pads) and a chain masking both ends."""
    import jax
    import jax.numpy as jnp

    f2 = ((4, 8), "f")
    aval = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    return [
        ("roll by 1", "autoshard_shift", lambda x: jnp.roll(x, 1, axis=1), (f2,)),
        ("roll by -3 rows", "autoshard_shift", lambda x: jnp.roll(x, -3, axis=0), (f2,)),
        ("roll by 5", "autoshard_shift", lambda x: jnp.roll(x, 5, axis=1), (f2,)),
        ("token shift (pad of a slice)", "autoshard_shift",
         lambda x: jnp.pad(x[:, :-1], ((0, 0), (1, 0))), (f2,)),
        ("shift left with a concatenated zero", "autoshard_shift",
         lambda x: jnp.concatenate([x[1:], jnp.zeros((1, 8))], 0), (f2,)),
        ("shift with a fill of -1", "autoshard_shift",
         lambda x: jnp.pad(x[:, 2:], ((0, 0), (0, 2)), constant_values=-1.0), (f2,)),
        ("edges zeroed", "autoshard_shift", lambda x: jnp.pad(x[:, 1:-1], ((0, 0), (1, 1))), (f2,)),
        ("roll's transpose (pads summed)", "autoshard_shift",
         lambda ct: jax.linear_transpose(lambda a: jnp.roll(a, 3, axis=1), aval)(ct)[0], (f2,)),
    ]


__all__ = ["TABLE", "validation_samples"]
