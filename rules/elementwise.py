"""Elementwise primitives: every dim is a pass-through factor; scalars and size-1 dims never shard.

The partial algebra is the table below: which ops let Partial operands flow through unreduced.
"""
from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
from jax import lax
from jax._src import dispatch as _dispatch
from jax._src import pjit as _pjit
from jax._src.ad_checkpoint import name_p
from jax._src.ad_util import add_jaxvals_p
from jax._src.lax import lax as lax_internal
from jax._src.lax.lax import optimization_barrier_p

from autoshard.compiler.factors import ALL, LETTERS, NONE, ONE, einsum
from autoshard.placement import ReduceType

from .registry import Rule

_MAX, _MIN = ReduceType.MAX, ReduceType.MIN
# (linear mode, monotone mode, operands that may be the partial one, monotone reduce types)
_ADD_LIKE = (ALL, NONE, None, ())
_MUL = (ONE, NONE, None, ())
_DIV = (ONE, NONE, (0,), ())
# f(max x_i) == max f(x_i) needs f increasing on *every* part, and a part that does not hold
# the value may be anything below it (down to -inf): so log, sqrt, log1p are not here.
_INCREASING = (NONE, ALL, None, (_MAX, _MIN))
_PLAIN = (NONE, NONE, None, ())

ALGEBRA = {
    lax.add_p: _ADD_LIKE, lax.sub_p: _ADD_LIKE, add_jaxvals_p: _ADD_LIKE, lax.neg_p: _ADD_LIKE,
    lax.mul_p: _MUL, lax.div_p: _DIV,
    # max of maxima is the max; max of minima is not the min
    lax.max_p: (NONE, ALL, None, (_MAX,)), lax.min_p: (NONE, ALL, None, (_MIN,)),
    lax.exp_p: _INCREASING, lax.exp2_p: _INCREASING, lax.expm1_p: _INCREASING,
    lax.tanh_p: _INCREASING, lax.logistic_p: _INCREASING, lax.cbrt_p: _INCREASING,
    lax.floor_p: _INCREASING, lax.ceil_p: _INCREASING, lax.round_p: _INCREASING,
    lax.erf_p: _INCREASING, lax.atan_p: _INCREASING, lax.sinh_p: _INCREASING,
    lax.asinh_p: _INCREASING,
    lax.copy_p: (ALL, ALL, None, (_MAX, _MIN)),
    lax.stop_gradient_p: (ALL, ALL, None, (_MAX, _MIN)),  # identity on values
    # jax.ad_checkpoint.checkpoint_name: an identity that names a value for remat policies
    name_p: (ALL, ALL, None, (_MAX, _MIN)),
}
PLAIN = [
    lax.log_p, lax.log1p_p, lax.sqrt_p, lax.rem_p, lax.pow_p, lax.sign_p, lax.is_finite_p,
    lax.sin_p, lax.cos_p, lax.tan_p,
    lax.asin_p, lax.acos_p, lax.atan2_p, lax.cosh_p, lax.acosh_p, lax.atanh_p, lax.rsqrt_p,
    lax.abs_p, lax.integer_pow_p, lax.square_p, lax.erfc_p, lax.erf_inv_p, lax.lgamma_p,
    lax.digamma_p, lax.nextafter_p, lax.eq_p, lax.ne_p, lax.lt_p, lax.le_p, lax.gt_p, lax.ge_p,
    lax.and_p, lax.or_p, lax.xor_p, lax.not_p, lax.shift_left_p,
    lax.shift_right_arithmetic_p, lax.shift_right_logical_p, lax.population_count_p,
    lax.clz_p, lax.select_n_p, lax.clamp_p, lax.real_p, lax.imag_p, lax.conj_p, lax.complex_p,
    lax.reduce_precision_p,
    # special functions (jax.scipy.special's gammainc, i0e, polygamma, zeta; betainc, whose
    # lowering loops over the whole array, has a lowering of its own: special.py)
    lax.bessel_i0e_p, lax.bessel_i1e_p, lax.igamma_p, lax.igammac_p, lax.igamma_grad_a_p,
    lax.polygamma_p, lax.zeta_p,
    # total-order comparisons (searchsorted's): -0.0 < 0.0 and NaNs ordered
    lax_internal.eq_to_p, lax_internal.le_to_p, lax_internal.lt_to_p,
]
def _mulhi_unsigned(x, y, half: int):
    """The high half of x * y for unsigned x, y of 2 * `half` bits, in that type: the product
    of `half`-bit pieces fits, so no wider type is needed."""
    mask = lax.full_like(x, (1 << half) - 1)
    shift = lax.full_like(x, half)
    x_lo, x_hi = lax.bitwise_and(x, mask), lax.shift_right_logical(x, shift)
    y_lo, y_hi = lax.bitwise_and(y, mask), lax.shift_right_logical(y, shift)
    ll, lh, hl, hh = x_lo * y_lo, x_lo * y_hi, x_hi * y_lo, x_hi * y_hi
    mid = (lax.shift_right_logical(ll, shift) + lax.bitwise_and(lh, mask)
           + lax.bitwise_and(hl, mask))
    return (hh + lax.shift_right_logical(lh, shift) + lax.shift_right_logical(hl, shift)
            + lax.shift_right_logical(mid, shift))


def _mulhi_lower(ctx, x, y):
    # XLA's multiply-high does not lower inside shard_map (jax 0.10: "Unable to convert MHLO
    # to StableHLO", plain jax.shard_map too): computed from half-width products instead
    # the primitive takes size-1 dims against full ones (what jax.vmap emits with one operand
    # unbatched) and scalars against arrays (Philox's constant multipliers); the half-width
    # steps below want one shape
    shape = tuple(np.broadcast_shapes(np.shape(x), np.shape(y)))
    x, y = (v if np.shape(v) == shape else lax.broadcast_in_dim(
        v, shape, tuple(range(len(shape) - np.ndim(v), len(shape)))) for v in (x, y))
    dtype = np.dtype(x.dtype)
    bits = dtype.itemsize * 8
    signed = np.issubdtype(dtype, np.signedinteger)
    if bits < 32:  # the whole product fits the 32-bit type of the same signedness
        wide = np.int32 if signed else np.uint32
        prod = lax.convert_element_type(x, wide) * lax.convert_element_type(y, wide)
        shifted = (lax.shift_right_arithmetic if signed else lax.shift_right_logical)(
            prod, lax.full_like(prod, bits))
        return [lax.convert_element_type(shifted, dtype)]
    unsigned = np.dtype(f"uint{bits}")
    xu, yu = (lax.bitcast_convert_type(v, unsigned) for v in (x, y))
    hi = _mulhi_unsigned(xu, yu, bits // 2)
    if signed:  # two's complement: subtract y where x < 0 and x where y < 0 (mod 2**bits)
        zero = lax.full_like(xu, 0)
        hi = hi - lax.select(x < 0, yu, zero) - lax.select(y < 0, xu, zero)
        return [lax.bitcast_convert_type(hi, dtype)]
    return [hi]


# primitives of later jax versions (tanh's derivative 1 - x² from 0.11, lax.polynomial 0.12)
PLAIN += [p for p in (getattr(lax, "one_minus_square_p", None),
                      getattr(lax, "polynomial_p", None)) if p is not None]


def elementwise_sharding(algebra):
    linear, monotone, partial_operands, monotone_types = algebra

    def rule(in_avals, out_avals, **params):
        out = out_avals[0]
        r = len(out.shape)
        terms = [LETTERS[:r] if len(a.shape) == r else "" for a in in_avals]
        if any(len(a.shape) not in (0, r) for a in in_avals):
            return None
        # an integer quotient truncates: (p0 + p1) // 2 is not p0 // 2 + p1 // 2
        lin = NONE if algebra is _DIV and not jax.dtypes.issubdtype(out.dtype, np.inexact) \
            else linear
        return einsum(",".join(terms) + "->" + LETTERS[:r], [a.shape for a in in_avals],
                      [out.shape], linear=lin, monotone=monotone,
                      partial_operands=partial_operands, monotone_types=monotone_types)

    return rule


def _exact_cast(src, dst) -> bool:
    """Every value of float (or complex) type `src` is one of `dst`: no rounding."""
    a, b = jax.numpy.finfo(src), jax.numpy.finfo(dst)
    return b.nmant >= a.nmant and b.maxexp >= a.maxexp and b.minexp <= a.minexp


def _carries_sums(src, dst) -> bool:
    """A pending sum of type `src` may be added up after a cast to `dst`: the cast is exact and
    keeps the range, so the sum overflows where one device's would (float16's parts added in
    float32 never reach inf where one device's float16 sum does — loss scaling skips its steps
    by that; bfloat16 has float32's range, and its sum added in float32 only rounds less)."""
    return _exact_cast(src, dst) and jax.numpy.finfo(src).maxexp == jax.numpy.finfo(dst).maxexp


def carries_sums(src, dst) -> bool:
    """A pending sum of dtype `src` may pass a step that computes in `dst` (a cast, a matmul's
    preferred_element_type): the same type, or float / complex types by `_carries_sums`. A
    wider integer does not: int8 parts of 100 and 100 sum to -56 on one device, to 200 widened
    first."""
    if src == dst:
        return True
    return (jax.dtypes.issubdtype(src, np.inexact) and jax.dtypes.issubdtype(dst, np.inexact)
            and _carries_sums(src, dst))


def _convert_sharding(in_avals, out_avals, **params):
    # A cast between float and complex types keeps sums unless it rounds (the partial sums
    # would be rounded before they are added, where one device rounds the whole sum once) or
    # widens the range (`carries_sums`);
    # maxima pass between real floats, rounding included (it is monotone; complex numbers
    # have no order: a pending max cast to complex could never be reduced); a cast to or from
    # integers keeps neither (a cast to its own type, a weak type's, keeps sums).
    sums = carries_sums(in_avals[0].dtype, out_avals[0].dtype)
    maxima = all(jax.dtypes.issubdtype(a.dtype, np.floating) for a in (in_avals[0], out_avals[0]))
    return elementwise_sharding((ALL if sums else NONE, ALL if maxima else NONE, None,
                                 (_MAX, _MIN)))(in_avals, out_avals)


def _bitcast_sharding(in_avals, out_avals, **params):
    # Same-width bitcasts are elementwise; width changes add or drop a trailing dim (the
    # bytes of one wider element), which stays whole: the leading dims split as they lie
    ranks = len(in_avals[0].shape), len(out_avals[0].shape)
    if ranks[0] == ranks[1]:
        return elementwise_sharding(_PLAIN)(in_avals, out_avals)
    lead = LETTERS[:min(ranks)]
    return einsum(lead + "." * (ranks[0] - len(lead)) + "->" + lead + "." * (ranks[1] - len(lead)),
                  [in_avals[0].shape], [out_avals[0].shape])


def _barrier_sharding(in_avals, out_avals, **params):
    # lax.optimization_barrier: result i is operand i, each laid out on its own (pending
    # partial values are reduced first: the barrier orders work, it does not sum it)
    letters = iter(LETTERS)
    terms = ["".join(next(letters) for _ in a.shape) for a in in_avals]
    spec = ",".join(terms) + "->" + ",".join(terms)
    return replace(einsum(spec, [a.shape for a in in_avals], [a.shape for a in out_avals]),
                   independent=True)


def _barrier_lower(ctx, *xs, **params):
    # jax gives every result of one barrier the union of its operands' varying axes, so a
    # replicated operand's result would vary: one barrier per group of operands that vary
    # over the same mesh axes (each group is ordered as the user asked; values are unchanged)
    from autoshard.reshard.steps import varying_axes

    groups: dict = {}
    for i, x in enumerate(xs):
        groups.setdefault(frozenset(varying_axes(x)), []).append(i)
    out = list(xs)
    for members in groups.values():
        for i, y in zip(members, optimization_barrier_p.bind(*[xs[i] for i in members],
                                                             **params)):
            out[i] = y
    return out


TABLE = {p: Rule(elementwise_sharding(a)) for p, a in ALGEBRA.items()}
TABLE.update({p: Rule(elementwise_sharding(_PLAIN)) for p in PLAIN})
TABLE[lax.convert_element_type_p] = Rule(_convert_sharding)
TABLE[lax.bitcast_convert_type_p] = Rule(_bitcast_sharding)
TABLE[optimization_barrier_p] = Rule(_barrier_sharding, _barrier_lower, match_vma=False)
if getattr(lax, "mulhi_p", None) is not None:
    TABLE[lax.mulhi_p] = Rule(elementwise_sharding(_PLAIN), _mulhi_lower)


def _identity_lower(ctx, *xs, **params):
    return list(xs)  # each operand its own result


# jax's own sharding annotations (with_sharding_constraint, jax.reshard, and the reshard jax
# inserts when it transposes a shard_map) name global shardings that mean nothing on the local
# blocks of the partitioned program: here they are identities on values, laid out by the plan.
for _p in (getattr(_pjit, "sharding_constraint_p", None), getattr(_pjit, "reshard_p", None)):
    if _p is not None:
        TABLE[_p] = Rule(elementwise_sharding((ALL, ALL, None, (_MAX, _MIN))), _identity_lower)


# jax.device_put inside a traced function: each operand to its own result, unchanged here (a
# NamedSharding on the program's mesh became a hint before planning: compiler/constraints.py)
if getattr(_dispatch, "device_put_p", None) is not None:
    TABLE[_dispatch.device_put_p] = Rule(_barrier_sharding, _identity_lower, match_vma=False)
