"""Special functions whose lowering iterates over the whole array: sharded, with the loop's
stopping test taken over the whole array too.

jax computes the regularized incomplete beta function (`jax.scipy.special.betainc`,
`lax.betainc`) as a continued fraction (DLMF 8.17.22) evaluated by the modified Lentz method, in
one while loop over the whole array: it iterates until *every* element has converged (or 200
iterations for float32, 600 for float64), and every iteration updates every element, the
converged ones too. Bound on each device's block, a device would stop when its own elements had
converged — one device's array runs on, so the blocks would differ from it in the last bits —
and jax refuses the loop under shard_map anyway (its flag starts invariant and becomes varying).
Here each device runs the same recurrence on its block, and the "some element has not
converged" flag is or-ed over the mesh axes the block varies along: every device runs exactly as
many iterations as one device does on the whole array, so each element gets the same
arithmetic. The derivative is jax's: by x, exp((b-1) log1p(-x) + (a-1) log x - log B(a, b));
by a or b, jax's own error.
"""
from __future__ import annotations

import jax
import numpy as np
from jax import lax

from autoshard.compiler.factors import InLoop

from .elementwise import _PLAIN, elementwise_sharding
from .registry import Rule


def _full(like, value):
    return lax.full_like(like, value)


def _numerator(k, a, b, x, dtype):
    """The continued fraction's k-th partial numerator (k >= 1; the first is 1)."""
    k = lax.broadcast_in_dim(k, a.shape, ())
    even = lax.eq(lax.rem(k, _full(k, 2)), _full(k, 0))
    first = lax.eq(k, _full(k, 1))
    m_int = lax.div(k - _full(k, 1), _full(k, 2))
    m_zero = lax.eq(m_int, _full(m_int, 0))
    m = lax.convert_element_type(m_int, dtype)
    one, two = _full(a, 1), _full(a, 2.0)
    # m = 0: the short form, exact where a is tiny (flush-to-zero hardware)
    at_zero = -(a + b) * x / (a + one)
    d_even = lax.select(m_zero, at_zero,
                        -(a + m) * (a + b + m) * x / ((a + two * m) * (a + two * m + one)))
    d_odd = m * (b - m) * x / ((a + two * m - one) * (a + two * m))
    return lax.select(first, _full(x, 1.0), lax.select(even, d_even, d_odd))


def _continued_fraction(a, b, x, dtype, axes: tuple[str, ...]):
    """Lentz's evaluation of the fraction, all partial denominators 1 after the 0th (0)."""
    eps = np.asarray(np.finfo(dtype).eps / 2, dtype)
    small, threshold = eps, eps
    limit = 200 if dtype == np.float32 else 600
    h0 = lax.broadcast_in_dim(small, x.shape, ())  # the 0th denominator is 0: below `small`
    if axes:  # the carry varies along the block's axes from its first iteration on
        h0 = lax.pcast(h0, axes, to="varying")

    def stopping(carry):
        k, unconverged, _, _, _ = carry
        return lax.bitwise_and(lax.lt(k, np.int32(limit)), unconverged)

    def step(carry):
        k, _, c, d, h = carry
        num = _numerator(k, a, b, x, dtype)
        one = _full(x, 1)
        c = one + num / c
        c = lax.select(lax.lt(lax.abs(c), _full(c, small)), _full(c, small), c)
        d = one + num * d
        d = lax.select(lax.lt(lax.abs(d), _full(d, small)), _full(d, small), d)
        d = lax.integer_pow(d, -1)
        delta = c * d
        h = h * delta
        far = lax.ge(lax.abs(delta - _full(delta, 1.0)), _full(delta, threshold))
        unconverged = lax.reduce_or(far, tuple(range(far.ndim)))
        if axes:  # any element anywhere: the whole array's test, as on one device
            unconverged = lax.pmax(unconverged.astype(np.int32), axes) > 0
        return k + np.int32(1), unconverged, c, d, h

    carry = (np.int32(1), np.bool_(True), h0, lax.full_like(h0, 0), h0)
    return lax.while_loop(stopping, step, carry)[4]


def _regularized_incomplete_beta(a, b, x, dtype, axes):
    one = _full(a, 1)
    a_zero = lax.bitwise_or(lax.eq(a, _full(a, 0)), lax.eq(b, _full(b, np.inf)))
    b_zero = lax.bitwise_or(lax.eq(b, _full(b, 0)), lax.eq(a, _full(a, np.inf)))
    x_zero, x_one = lax.eq(x, _full(x, 0)), lax.eq(x, _full(x, 1))
    is_zero = lax.bitwise_or(lax.bitwise_and(b_zero, lax.bitwise_not(x_one)),
                             lax.bitwise_and(a_zero, x_zero))
    is_one = lax.bitwise_or(lax.bitwise_and(a_zero, lax.bitwise_not(x_zero)),
                            lax.bitwise_and(b_zero, x_one))
    is_nan = lax.bitwise_or(lax.bitwise_or(lax.bitwise_or(
        lax.lt(a, _full(a, 0)), lax.lt(b, _full(b, 0))), lax.lt(x, _full(x, 0))),
        lax.gt(x, _full(x, 1)))
    # the fraction converges fast below (a + 1) / (a + b + 2); above, I_x(a, b) = 1 - I_1-x(b, a)
    direct = lax.lt(x, (a + one) / (a + b + _full(b, 2.0)))
    a, b = lax.select(direct, a, b), lax.select(direct, b, a)
    x = lax.select(direct, x, _full(x, 1) - x)
    fraction = _continued_fraction(a, b, x, dtype, axes)
    tiny = np.asarray(np.finfo(dtype).tiny * 2, dtype)
    log_b_small_a = lax.lgamma(b) - lax.lgamma(a + b)  # log B(a, b) + log a, as a -> 0
    log_b = lax.lgamma(a) + log_b_small_a
    factor = lax.select(lax.lt(a, _full(a, tiny)),
                        lax.exp(lax.log1p(-x) * b - log_b_small_a),
                        lax.exp(lax.log(x) * a + lax.log1p(-x) * b - log_b) / a)
    result = fraction * factor
    result = lax.select(direct, result, _full(result, 1) - result)
    result = lax.select(is_zero, _full(a, 0), result)
    result = lax.select(is_one, _full(a, 1), result)
    return lax.select(is_nan, _full(a, np.nan), result)


def _betainc_block(a, b, x, axes):
    shape = np.broadcast_shapes(a.shape, b.shape, x.shape)
    a, b, x = (lax.broadcast_in_dim(v, shape, tuple(range(v.ndim))) for v in (a, b, x))
    dtype = np.dtype(a.dtype)
    narrow = dtype in (np.dtype(jax.numpy.bfloat16), np.dtype(np.float16))
    if narrow:  # computed in float32, as jax does
        a, b, x = (lax.convert_element_type(v, np.float32) for v in (a, b, x))
    out = _regularized_incomplete_beta(a, b, x, np.dtype(np.float32) if narrow else dtype, axes)
    return lax.convert_element_type(out, dtype) if narrow else out


def _differentiable(axes):
    from jax.custom_derivatives import SymbolicZero

    @jax.custom_jvp
    def betainc(a, b, x):
        return _betainc_block(a, b, x, axes)

    def jvp(primals, tangents):
        a, b, x = primals
        ta, tb, tx = tangents
        if not (isinstance(ta, SymbolicZero) and isinstance(tb, SymbolicZero)):
            raise ValueError("Betainc gradient with respect to a and b not supported.")
        out = betainc(a, b, x)
        if isinstance(tx, SymbolicZero):
            return out, lax.full_like(out, 0)
        log_b = lax.lgamma(a) + lax.lgamma(b) - lax.lgamma(a + b)
        slope = lax.exp((b - _full(b, 1)) * lax.log1p(-x) + (a - _full(a, 1)) * lax.log(x)
                        - log_b)
        return out, slope * tx

    betainc.defjvp(jvp, symbolic_zeros=True)
    return betainc


def _betainc_lower(ctx, a, b, x, **params):
    from autoshard.reshard.steps import DIFFERENTIABLE, varying_axes

    varying = varying_axes(a)  # (the operands come matched: Rule.match_vma)
    axes = tuple(n for n in ctx.sizes if n in varying)  # (mesh order, as collectives want)
    if not DIFFERENTIABLE.get():  # a program jax only runs: no derivative to carry
        return [_betainc_block(a, b, x, axes)]
    return [_differentiable(axes)(a, b, x)]


def _betainc_comm(in_layouts, out_layouts, in_avals, out_avals, sizes, **params):
    """The stopping flag's or over the axes the result is split along, once per iteration."""
    axes = tuple(n for n in sizes if any(n in d for d in out_layouts[0].dims))
    if not axes:
        return []
    return [("all-reduce", f"pmax({','.join(axes)}) of 'some element has not converged', "
             f"each iteration", axes, 4, InLoop())]


TABLE = {lax.regularized_incomplete_beta_p: Rule(elementwise_sharding(_PLAIN),
                                                 _betainc_lower, _betainc_comm)}
