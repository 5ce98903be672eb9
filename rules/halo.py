"""Halos: the rows a window reaches past a device's block of a split dim, fetched from the
devices holding them (ppermute). Shared by the convolutions (conv.py) and the windowed
reductions (window.py).

A window op over a dim split into blocks of b rows needs, for its output block, the input block
plus a few rows before and after it. Each device fetches those rows from its neighbours — from
several devices away when the halo is longer than a block — in one collective-permute per hop;
the first and last devices have no one to fetch from and receive the padding instead (zeros, or
the reduction's identity). Rows past every device are the same padding on each device, so they
stay the local op's own padding. Negative halo widths crop the block itself.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from jax import lax

SLIDE, CONTRACT = "slide", "contract"


class Halo(NamedTuple):
    kind: str        # SLIDE or CONTRACT
    left: int        # input rows each device needs from before its block (< 0: skips rows)
    right: int       # ... and from after it
    padding: tuple[int, int] = (0, 0)  # the local convolution's own padding then


def halo(length: int, window: int, out: int, stride: int, padding: tuple[int, int],
         lhs_dilation: int, rhs_dilation: int) -> Halo | None:
    """How one spatial dim may stay split: the input's `length` rows, the kernel's `window`,
    the output's `out` rows; None when it must stay whole. Positions below are in the padded
    (and dilated) input, as the convolution reads it: out[k] = sum_w in[k * stride + w * rd]."""
    lo, _hi = padding  # negative padding crops: the rows needed start inside the block
    ld, rd = lhs_dilation, rhs_dilation
    if length < 2:
        return None
    reach = (window - 1) * rd + 1  # rows one output row reads
    if ld == 1 and out * stride == length and out > 1:
        # (an output of one row is never split — nor then may the input be: its blocks would
        # have no output rows to make)
        # output block i (b / stride rows) reads padded rows [i b, i b + b - stride + reach):
        # the input block, `lo` rows before it and the rest of the window's reach after it
        return Halo(SLIDE, lo, reach - stride - lo)
    if stride == 1 and ld > 1 and out == length * ld:
        # an input dilated by ld (the input gradient of a strided convolution): output block
        # i (b ld rows) reads dilated rows [i b ld - lo, (i + 1) b ld - 1 + reach - lo), whose
        # real rows are those of input block i, lo // ld before it and last // ld after it;
        # the dilation's zeros at either end are the local convolution's padding
        last = ld - 1 + reach - 1 - lo
        return Halo(SLIDE, lo // ld, last // ld, (lo % ld, last % ld))
    if ld == 1 and window * rd == length and window > 1:
        # (a window of one row is never split, so its blocks would not follow the input's)
        # the kernel gradient: the "window" is the output gradient (one row per rd input rows),
        # summed over; out[k] = sum_t in[k * stride + t * rd], so the rows t of one block reach
        # (out - 1) * stride + 1 - rd padded rows past the input block
        return Halo(CONTRACT, lo, (out - 1) * stride + 1 - rd - lo)
    return None


def pieces(b: int, n: int, left: int, right: int):
    """(hop, first row, end row) of the rows [-left, b + right) around a block of b rows: hop
    0 is the block itself, hop h the block h devices after it (before, when negative); a
    negative `left` / `right` drops rows of the block itself."""
    start, stop = -left, b + right
    for hop in range(start // b, -(-stop // b)):
        first, end = max(start, hop * b) - hop * b, min(stop, (hop + 1) * b) - hop * b
        if end > first:
            yield hop, first, end


def fetch(ctx, x, dim: int, axes: tuple[str, ...], left: int, right: int, fill=None):
    """This device's block of `x` along `dim` with `left` rows before it and `right` after it,
    fetched from the devices holding them; and how many rows lie past every device on each
    side (the same padding everywhere: left to the local op). The first / last devices receive
    zeros from ppermute, or `fill` (a scalar: the reduction's identity) where it is given."""
    n = math.prod(ctx.sizes[a] for a in axes)
    parts, before, after = [], 0, 0
    for hop, first, end in pieces(x.shape[dim], n, left, right):
        if hop <= -n or hop >= n:
            if hop < 0:
                before += end - first
            else:
                after += end - first
            continue
        piece = lax.slice_in_dim(x, first, end, axis=dim)
        if hop:
            piece = ctx.ppermute(piece, axes, [(i + hop, i) for i in range(n) if 0 <= i + hop < n])
            if fill is not None and fill != 0:
                source = lax.add(ctx.block_index(axes), np.int32(hop))
                present = lax.bitwise_and(lax.ge(source, np.int32(0)), lax.lt(source, np.int32(n)))
                piece = lax.select(lax.broadcast(present, piece.shape), piece,
                                   lax.full_like(piece, fill))
        parts.append(piece)
    return (lax.concatenate(parts, dim) if len(parts) > 1 else parts[0]), before, after


def sends(layout, aval, sizes, halos, operand: int = 0) -> list:
    """The collective-permutes `fetch` runs for `halos` — (dim, left, right), in the order the
    lowering fetches them, each dim's pieces carrying the rows the dims before it added (the
    corners a 2-d window needs) — as a rule's `comm` lists them, each naming `operand` as what
    it sends (the same rows of one value are sent once)."""
    local = list(layout.local_shape(aval.shape, sizes))
    itemsize = np.dtype(aval.dtype).itemsize
    out = []
    for dim, left, right in halos:
        axes = layout.dims[dim]
        if not axes:
            continue
        n, b = math.prod(sizes[a] for a in axes), local[dim]
        row = math.prod(local) // b * itemsize
        kept = 0
        for hop, first, end in pieces(b, n, left, right):
            if abs(hop) >= n:
                continue
            rows, kept = end - first, kept + end - first
            if hop:
                side = "before" if hop < 0 else "after"
                out.append(("collective-permute",
                            f"ppermute({','.join(axes)}) {rows} edge row{'' if rows == 1 else 's'} "
                            f"of dim {dim} from {abs(hop)} block{'' if hop in (1, -1) else 's'} "
                            f"{side} "
                            f"(block {'x'.join(map(str, local))})", axes, rows * row, operand))
        local[dim] = kept
    return out


__all__ = ["Halo", "SLIDE", "CONTRACT", "halo", "pieces", "fetch", "sends"]
