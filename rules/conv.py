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


from jax import lax

from autoshard.compiler.factors import LETTERS, NONE, ONE, einsum
from autoshard.compiler.partition import match_vma

from .elementwise import carries_sums
from .halo import SLIDE, Halo, fetch, halo, sends
from .registry import Rule


def _halos(in_avals, out_avals, dimension_numbers, window_strides, padding, lhs_dilation,
           rhs_dilation) -> list[Halo | None]:
    lhs, rhs = in_avals
    (_, _, *ls), (_, _, *rs), (_, _, *os_) = dimension_numbers
    return [halo(lhs.shape[l], rhs.shape[r], out_avals[0].shape[o], s, tuple(p), ld, rd)
            for l, r, o, s, p, ld, rd in zip(ls, rs, os_, window_strides, padding,
                                              lhs_dilation, rhs_dilation)]


def _depthwise(in_features: int, kernel_in: int, kernel_out: int, groups: int) -> bool:
    """A depthwise convolution with one output per input feature (MobileNet's, ConvNeXt's)."""
    return groups == in_features == kernel_out and kernel_in == 1


def conv_sharding(in_avals, out_avals, *, dimension_numbers, feature_group_count,
                  batch_group_count, window_strides, padding, lhs_dilation, rhs_dilation,
                  **params):
    """Batch and output-feature dims pass, the input-feature dim contracts; a spatial dim with
    a halo shares its letter with the output's (sliding) or the kernel's (contracting) dim,
    the others stay whole, as do the dims tied to feature or batch groups."""
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
    # groups tie dims to them: feature groups the input features (the lhs holds every group's,
    # the kernel one group's) and the output features; batch groups (a grouped conv's kernel
    # gradient) the lhs batch and the output features — its input features still contract
    if feature_group_count != 1:
        if _depthwise(lhs.shape[lf], rhs.shape[ri], rhs.shape[ro], feature_group_count):
            # every feature its own group: the input's features, the kernel's output features
            # and the output's are one dim, each device convolving its own features (the
            # kernel's one input feature stays whole)
            lterm[lf] = rterm[ro] = oterm[of] = out_f
            replicate += in_f
        else:
            replicate += out_f + in_f
    if batch_group_count != 1:
        replicate += out_f + batch
    spec = f"{''.join(lterm)},{''.join(rterm)}->{''.join(oterm)}"
    # linear in each operand, as a matmul: one Partial(sum) operand passes through (in a type
    # the sum carries to: rules/dot.py)
    linear = ONE if all(carries_sums(a.dtype, out_avals[0].dtype) for a in in_avals) else NONE
    return einsum(spec, [lhs.shape, rhs.shape], [out_avals[0].shape], replicate=replicate,
                  linear=linear)


def _split_halos(ctx, lhs, rhs, params):
    """(spatial index, lhs dim, its mesh axes, Halo) for each spatial dim split here."""
    (_, _, *ls), (_, _, *rs), (_, _, *os_) = params["dimension_numbers"]
    lhs_shape = ctx.global_shape(ctx.in_layouts[0], lhs.shape)
    rhs_shape = ctx.global_shape(ctx.in_layouts[1], rhs.shape)
    out_shape = ctx.global_shape(ctx.out_layouts[0], ctx.local_out_shapes[0])
    out: list = []
    for j, (l, r, o) in enumerate(zip(ls, rs, os_)):
        axes = ctx.in_layouts[0].dims[l]
        if not axes:
            continue
        h = halo(lhs_shape[l], rhs_shape[r], out_shape[o], params["window_strides"][j],
                 tuple(params["padding"][j]), params["lhs_dilation"][j], params["rhs_dilation"][j])
        assert h is not None, "the rule split a spatial dim without a halo"
        out.append((j, l, axes, h))
    return out


def conv_lower(ctx, lhs, rhs, **params):
    padding = [tuple(p) for p in params["padding"]]
    for j, dim, axes, h in _split_halos(ctx, lhs, rhs, params):
        lhs, before, after = fetch(ctx, lhs, dim, axes, h.left, h.right)
        ld = params["lhs_dilation"][j]
        padding[j] = (h.padding[0] + before * ld, h.padding[1] + after * ld)
    # the fetched rows vary over the split axes; the kernel may not (a cotangent the same on
    # every device, laid out split by rows, convolved with a replicated kernel)
    lhs, rhs = match_vma([lhs, rhs])
    (_, lf, *_), (ro, ri, *_), _ = params["dimension_numbers"]
    groups = params["feature_group_count"]
    lhs_global = ctx.global_shape(ctx.in_layouts[0], lhs.shape)
    rhs_global = ctx.global_shape(ctx.in_layouts[1], rhs.shape)
    if groups != 1 and _depthwise(lhs_global[lf], rhs_global[ri], rhs_global[ro], groups):
        groups = lhs.shape[lf]  # this device's features: its groups
    return [lax.conv_general_dilated_p.bind(lhs, rhs, **{**params, "padding": tuple(padding),
                                                         "feature_group_count": groups})]


def conv_comm(in_layouts, out_layouts, in_avals, out_avals, sizes, *, dimension_numbers,
              window_strides, padding, lhs_dilation, rhs_dilation, **params):
    # the same rows of the same input (a forward convolution's and its kernel gradient's halo)
    # are sent once: the sends name operand 0
    halos = _halos(in_avals, out_avals, dimension_numbers, window_strides, padding,
                   lhs_dilation, rhs_dilation)
    (_, _, *ls), _, _ = dimension_numbers
    return sends(in_layouts[0], in_avals[0], sizes,
                 [(l, h.left, h.right) for l, h in zip(ls, halos) if h is not None])


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
         conv(("NCHW", "OIHW", "NCHW"), (2, 2), "VALID"),
         (((4, 4, 8, 8), "f"), ((8, 4, 3, 3), "f"))),
        ("conv strided same", "conv_general_dilated", conv(nhwc, (2, 2)), (x, k)),
        ("conv grouped", "conv_general_dilated", conv(nhwc, groups=2), (x, ((3, 3, 2, 8), "f"))),
        ("conv depthwise", "conv_general_dilated", conv(nhwc, groups=8),
         (((4, 8, 8, 8), "f"), ((3, 3, 1, 8), "f"))),
        ("conv depthwise NCHW", "conv_general_dilated",
         conv(("NCHW", "OIHW", "NCHW"), groups=8), (((4, 8, 8, 8), "f"), ((8, 1, 3, 3), "f"))),
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
        ("conv grouped kernel gradient (batch groups)", "conv_general_dilated",
         lambda ct, a: jax.linear_transpose(lambda b: conv(nhwc, groups=2)(a, b),
                                            jax.ShapeDtypeStruct((3, 3, 2, 8), jnp.float32))(ct)[0],
         (((4, 8, 8, 8), "f"), x)),
        ("conv strided kernel gradient", "conv_general_dilated",
         lambda ct, a: jax.linear_transpose(lambda b: conv(nhwc, (2, 2))(a, b), k_aval)(ct)[0],
         (((4, 4, 4, 8), "f"), x)),
    ]


__all__ = ["TABLE", "validation_samples"]
