"""conv_general_dilated: batch and output features pass, input features contract (sum), and a
spatial dim split over devices stays split, its neighbours' edge rows fetched (a halo).

A spatial dim of a convolution slides its window over neighbouring rows, so a device holding
one block of rows lacks the few rows its window reaches past the block's edges. Gathering the
whole dim (what a rule that keeps spatial dims whole does) moves the activation; instead each
device fetches just those edge rows from the devices before and after it (`ppermute`, a
collective-permute of `window - 1` rows) and convolves its extended block with no padding — the
first and last devices receive zeros, which is the convolution's own zero padding. Spatial
partitioning, as for large images or long sequences.

Two shapes of a spatial dim allow it, and jax.grad produces both from a forward convolution:
- *sliding* (the forward conv, and its input gradient when the stride is 1): the output's rows
  are the input's, one per `stride` input rows (output size × stride = input size), so output
  block i comes from input block i plus a halo; the dim stays split with the same axes.
- *contracting* (the kernel gradient): the "window" is as long as the input (the gradient of the
  output), so the dim is summed over; each device convolves its rows (plus halo) against its
  block of the output gradient, and the kernel ends a pending sum over the dim's axes.
(An input gradient of a strided convolution reads an input dilated by the stride: output block
i still comes from input block i plus a halo.) Negative padding (a crop) moves the rows needed
into the block. Anything else (a VALID convolution shrinking the dim, a stride that does not
divide it) keeps the dim whole, as before.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from jax import lax

from autoshard.compiler.factors import LETTERS, ONE, einsum

from .registry import Rule

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
    if ld == 1 and out * stride == length:
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
    if ld == 1 and window * rd == length:
        # the kernel gradient: the "window" is the output gradient (one row per rd input rows),
        # summed over; out[k] = sum_t in[k * stride + t * rd], so the rows t of one block reach
        # (out - 1) * stride + 1 - rd padded rows past the input block
        return Halo(CONTRACT, lo, (out - 1) * stride + 1 - rd - lo)
    return None


def _halos(in_avals, out_avals, dimension_numbers, window_strides, padding, lhs_dilation,
           rhs_dilation) -> list[Halo | None]:
    lhs, rhs = in_avals
    (_, _, *ls), (_, _, *rs), (_, _, *os_) = dimension_numbers
    return [halo(lhs.shape[l], rhs.shape[r], out_avals[0].shape[o], s, tuple(p), ld, rd)
            for l, r, o, s, p, ld, rd in zip(ls, rs, os_, window_strides, padding,
                                              lhs_dilation, rhs_dilation)]


def conv_sharding(in_avals, out_avals, *, dimension_numbers, feature_group_count,
                  batch_group_count, window_strides, padding, lhs_dilation, rhs_dilation,
                  **params):
    """Batch and output-feature dims pass, the input-feature dim contracts; a spatial dim with
    a halo shares its letter with the output's (sliding) or the kernel's (contracting) dim,
    the others stay whole. With feature or batch groups the features are tied to their group,
    so they stay whole too."""
    lhs, rhs = in_avals
    (lb, lf, *ls), (ro, ri, *rs), (ob, of, *os_) = dimension_numbers
    batch, out_f, in_f = "BOI"  # capitals: the spatial dims take the lower-case letters
    lterm, rterm, oterm = [""] * len(lhs.shape), [""] * len(rhs.shape), [""] * len(lhs.shape)
    lterm[lb] = oterm[ob] = batch
    rterm[ro] = oterm[of] = out_f
    lterm[lf] = rterm[ri] = in_f
    spatial = iter(LETTERS[:26])
    replicate = ""
    halos = _halos(in_avals, out_avals, dimension_numbers, window_strides, padding,
                   lhs_dilation, rhs_dilation)
    for l, r, o, h in zip(ls, rs, os_, halos):
        lterm[l], rterm[r], oterm[o] = next(spatial), next(spatial), next(spatial)
        if h is not None and h.kind == SLIDE:
            oterm[o] = lterm[l]
            replicate += rterm[r]
        elif h is not None:
            rterm[r] = lterm[l]
            replicate += oterm[o]
        else:
            replicate += lterm[l] + rterm[r] + oterm[o]
    if feature_group_count != 1 or batch_group_count != 1:
        replicate += out_f + in_f + (batch if batch_group_count != 1 else "")
    spec = f"{''.join(lterm)},{''.join(rterm)}->{''.join(oterm)}"
    # linear in each operand, as a matmul: one Partial(sum) operand passes through
    return einsum(spec, [lhs.shape, rhs.shape], [out_avals[0].shape], replicate=replicate,
                  linear=ONE)


def _split_halos(ctx, lhs, rhs, params):
    """(lhs dim, its mesh axes, Halo) for each spatial dim split on this device."""
    (_, _, *ls), (_, _, *rs), (_, _, *os_) = params["dimension_numbers"]
    out: list = []
    for j, (l, r, o) in enumerate(zip(ls, rs, os_)):
        axes = ctx.in_layouts[0].dims[l]
        if not axes:
            continue
        n = math.prod(ctx.sizes[a] for a in axes)
        out_rows = ctx.local_out_shapes[0][o] * math.prod(
            ctx.sizes[a] for a in ctx.out_layouts[0].dims[o])
        window = rhs.shape[r] * math.prod(ctx.sizes[a] for a in ctx.in_layouts[1].dims[r])
        h = halo(lhs.shape[l] * n, window, out_rows, params["window_strides"][j],
                 tuple(params["padding"][j]), params["lhs_dilation"][j], params["rhs_dilation"][j])
        assert h is not None, "the rule split a spatial dim without a halo"
        out.append((j, l, axes, h))
    return out


def _pieces(b: int, n: int, left: int, right: int):
    """(hop, first row, end row) of the rows [-left, b + right) around a block of b rows: hop
    0 is the block itself, hop h the block h devices after it (before, when negative); a
    negative `left` / `right` drops rows of the block itself."""
    start, stop = -left, b + right
    for hop in range(start // b, -(-stop // b)):
        first, end = max(start, hop * b) - hop * b, min(stop, (hop + 1) * b) - hop * b
        if end > first:
            yield hop, first, end


def _fetch(x, dim: int, axes: tuple[str, ...], n: int, left: int, right: int):
    """This device's block of `x` along `dim` with `left` rows before it and `right` after it,
    fetched from the devices holding them (ppermute: the first / last devices receive zeros,
    the convolution's padding); and how many rows lie past every device on each side (zeros
    everywhere: left to the local convolution's padding)."""
    name = axes[0] if len(axes) == 1 else tuple(axes)
    parts, before, after = [], 0, 0
    for hop, first, end in _pieces(x.shape[dim], n, left, right):
        if hop <= -n or hop >= n:
            before, after = (before + end - first, after) if hop < 0 else (before, after + end - first)
            continue
        piece = lax.slice_in_dim(x, first, end, axis=dim)
        if hop:
            piece = lax.ppermute(piece, name, [(i + hop, i) for i in range(n) if 0 <= i + hop < n])
        parts.append(piece)
    return (lax.concatenate(parts, dim) if len(parts) > 1 else parts[0]), before, after


def conv_lower(ctx, lhs, rhs, **params):
    padding = [tuple(p) for p in params["padding"]]
    for j, dim, axes, h in _split_halos(ctx, lhs, rhs, params):
        n = math.prod(ctx.sizes[a] for a in axes)
        lhs, before, after = _fetch(lhs, dim, axes, n, h.left, h.right)
        ld = params["lhs_dilation"][j]
        padding[j] = (h.padding[0] + before * ld, h.padding[1] + after * ld)
    return [lax.conv_general_dilated_p.bind(lhs, rhs, **{**params, "padding": tuple(padding)})]


def conv_comm(in_layouts, out_layouts, in_avals, out_avals, sizes, *, dimension_numbers,
              window_strides, padding, lhs_dilation, rhs_dilation, **params):
    lhs = in_avals[0]
    local = list(in_layouts[0].local_shape(lhs.shape, sizes))
    itemsize = np.dtype(lhs.dtype).itemsize
    halos = _halos(in_avals, out_avals, dimension_numbers, window_strides, padding,
                   lhs_dilation, rhs_dilation)
    (_, _, *ls), _, _ = dimension_numbers
    out = []
    for l, h in zip(ls, halos):
        axes = in_layouts[0].dims[l]
        if not axes or h is None:
            continue
        n, b = math.prod(sizes[a] for a in axes), local[l]
        row = math.prod(local) // b * itemsize
        for hop, first, end in _pieces(b, n, h.left, h.right):
            if hop and abs(hop) < n:
                # the same rows of the same input (a forward convolution's and its kernel
                # gradient's halo) are sent once: operand 0 names what is sent
                side = "before" if hop < 0 else "after"
                out.append(("collective-permute",
                            f"ppermute({','.join(axes)}) {end - first} edge rows of dim {l} from "
                            f"{abs(hop)} block{'s' if abs(hop) > 1 else ''} {side}", axes,
                            (end - first) * row, 0))
    return out


TABLE = {lax.conv_general_dilated_p: Rule(conv_sharding, conv_lower, conv_comm)}


def validation_samples() -> list:
    """Convolutions: NHWC / HWIO and NCHW / OIHW, strided and padded, grouped, a causal 1-d
    one, a window longer than a block (a halo from two devices away), and the gradients with
    respect to input and kernel (convolutions with swapped dimension numbers)."""
    import jax
    import jax.numpy as jnp

    x, k = ((4, 8, 8, 4), "f"), ((3, 3, 4, 8), "f")

    def conv(dn, strides=(1, 1), padding="SAME", groups=1, dilation=None):
        return lambda a, b: lax.conv_general_dilated(a, b, strides, padding, dimension_numbers=dn,
                                                     feature_group_count=groups,
                                                     rhs_dilation=dilation)

    nhwc = ("NHWC", "HWIO", "NHWC")
    x_aval = jax.ShapeDtypeStruct(x[0], jnp.float32)
    k_aval = jax.ShapeDtypeStruct(k[0], jnp.float32)
    causal = lambda a, b: lax.conv_general_dilated(  # noqa: E731
        a, b, (1,), [(2, 0)], dimension_numbers=("NWC", "WIO", "NWC"))
    return [
        ("conv NHWC", "conv_general_dilated", conv(nhwc), (x, k)),
        ("conv NCHW strided valid", "conv_general_dilated",
         conv(("NCHW", "OIHW", "NCHW"), (2, 2), "VALID"), (((4, 4, 8, 8), "f"), ((8, 4, 3, 3), "f"))),
        ("conv strided same", "conv_general_dilated", conv(nhwc, (2, 2)), (x, k)),
        ("conv grouped", "conv_general_dilated", conv(nhwc, groups=2), (x, ((3, 3, 2, 8), "f"))),
        ("conv causal 1-d", "conv_general_dilated", causal, (((2, 8, 4), "f"), ((3, 4, 4), "f"))),
        ("conv wide dilated window", "conv_general_dilated", conv(nhwc, dilation=(3, 1)),
         (x, k)),
        ("conv cropping (negative padding)", "conv_general_dilated",
         conv(nhwc, padding=((-1, 3), (1, 1))), (x, k)),
        # the transposed convolutions of the gradients, alone (jax.linear_transpose): inside a
        # whole jax.grad a Partial kernel feeds two convolutions and is reduced once up front
        ("conv input gradient", "conv_general_dilated",
         lambda ct, b: jax.linear_transpose(lambda a: conv(nhwc)(a, b), x_aval)(ct)[0],
         (((4, 8, 8, 8), "f"), k)),
        ("conv kernel gradient", "conv_general_dilated",
         lambda ct, a: jax.linear_transpose(lambda b: conv(nhwc)(a, b), k_aval)(ct)[0],
         (((4, 8, 8, 8), "f"), x)),
        ("conv strided kernel gradient", "conv_general_dilated",
         lambda ct, a: jax.linear_transpose(lambda b: conv(nhwc, (2, 2))(a, b), k_aval)(ct)[0],
         (((4, 4, 4, 8), "f"), x)),
    ]


__all__ = ["TABLE", "validation_samples", "halo", "Halo"]
