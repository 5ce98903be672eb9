"""Linear algebra and FFTs on batches: the leading (batch) dims pass, the matrix / transform dims
stay whole.

Every operand and result of these primitives shares the batch dims of operand 0; what follows
them (a matrix, its pivots, its eigenvalues, the transformed axes) is computed by one device.
An FFT is linear, and a triangular solve is linear in its right-hand side, so a pending sum
passes through them; the factorizations need their whole input.
"""
from __future__ import annotations

import math

from jax import lax
from jax._src.lax import fft as lax_fft
from jax._src.lax import linalg

from autoshard.compiler.factors import ALL, LETTERS, NONE, ONE, einsum

from .registry import Rule

_CORE = {  # primitive: (dims of operand 0 after its batch dims, how a Partial(sum) passes)
    linalg.cholesky_p: (2, NONE), linalg.eigh_p: (2, NONE), linalg.lu_p: (2, NONE),
    linalg.qr_p: (2, NONE), linalg.svd_p: (2, NONE), linalg.geqrf_p: (2, NONE),
    linalg.householder_product_p: (2, NONE), linalg.lu_pivots_to_permutation_p: (1, NONE),
    linalg.tridiagonal_p: (2, NONE), linalg.tridiagonal_solve_p: (1, NONE),
    linalg.triangular_solve_p: (2, ONE),
    # jax.scipy.linalg's eig / schur / hessenberg / pivoted qr and their helpers
    linalg.eig_p: (2, NONE), linalg.schur_p: (2, NONE), linalg.hessenberg_p: (2, NONE),
    linalg.geqp3_p: (2, NONE), linalg.ormqr_p: (2, NONE), linalg.cholesky_update_p: (2, NONE),
    linalg.symmetric_product_p: (2, NONE),
}


def _batched(core0: int | None, linear: str, partial_operands=None):
    """`core0`: operand 0's dims after its batch dims (None: an FFT's transformed dims)."""
    def rule(in_avals, out_avals, **params):
        n_core = len(params["fft_lengths"]) if core0 is None else core0
        batch = len(in_avals[0].shape) - n_core
        letters = iter(LETTERS[batch:])

        def term(aval) -> str:  # the batch letters, then fresh letters kept whole
            return LETTERS[:batch] + "".join(next(letters) for _ in aval.shape[batch:])

        ins = [term(a) for a in in_avals]
        outs = [term(a) for a in out_avals]
        whole = "".join(ch for t in ins + outs for ch in t[batch:])
        return einsum(",".join(ins) + "->" + ",".join(outs), [a.shape for a in in_avals],
                      [a.shape for a in out_avals], replicate=whole, linear=linear,
                      partial_operands=partial_operands)
    return rule


TABLE = {p: Rule(_batched(core, linear, (1,) if linear == ONE else None))
         for p, (core, linear) in _CORE.items()}


def _row_major(a):
    """`a` as it is, laid out row-major whatever its readers ask for (see _fft_lower)."""
    if a.ndim < 2:
        return a
    return lax.optimization_barrier(a.reshape(-1)).reshape(a.shape)


def _fft_lower(ctx, x, *, fft_type, fft_lengths):
    """The local FFT with its batch dims merged into one, or none when they hold one element.
    XLA's CPU FFT kernel takes only an operand laid out dim 0 major, and its layout
    assignment does not see to it (RET_CHECK IsMonotonicWithDim0Major at run time; both
    found by fuzzing):
    - a device's block can have dims of size 1 (a dim split down to one row, a reshape's), and
      for such an operand it picked a layout the kernel refused: hence the merged batch dims;
    - it carries a reader's layout back through the FFT to its operand. A reduce-scatter is
      laid out with its scatter dim major, so one of a Partial result along a transformed dim
      (the sum of an FFT of parts, hinted split after it) made that layout the FFT's result's,
      then its operand's (the transpose before it, jnp.fft's for axis=0, became a bitcast).
      A Partial result is made row-major behind a rank-1 view under an optimization_barrier:
      a rank-1 array has one layout, and the barrier keeps XLA from folding the reshapes, so
      no layout crosses it (a barrier on the block itself passes its layout on). That costs a
      local copy of the block, next to the collective that reduces it; results that are not
      Partial are left alone (their readers' layouts did not reach the FFT in any case tried,
      and the copy would be paid by every FFT)."""
    n = len(fft_lengths)
    batch, core = x.shape[:x.ndim - n], x.shape[x.ndim - n:]
    size = math.prod(batch)
    y = lax_fft.fft_p.bind(x.reshape((size, *core) if size != 1 else core),
                           fft_type=fft_type, fft_lengths=tuple(fft_lengths))
    if ctx.out_layouts[0].partial:  # a reduction reads it, maybe a reduce-scatter
        y = _row_major(y)
    return [y.reshape(batch + y.shape[y.ndim - n:])]


TABLE[lax_fft.fft_p] = Rule(_batched(None, ALL), lower=_fft_lower)  # core: the transformed dims


def validation_samples() -> list:
    """Batches of 8 small matrices (split over the batch dim or not), made well conditioned
    inside the sample; outputs that are unique up to sign are squared."""
    import jax.numpy as jnp
    import jax.scipy.linalg as jsl
    from jax import lax

    m3, v3 = ((8, 4, 4), "f"), ((8, 4, 2), "f")

    def spd(a):  # symmetric, diagonally dominant for entries in [-5, 5]: positive definite
        b = jnp.abs(a)
        return b + jnp.swapaxes(b, -1, -2) + 40.0 * jnp.eye(a.shape[-1])

    return [
        ("cholesky", "cholesky", lambda a: jnp.linalg.cholesky(spd(a)), (m3,)),
        ("triangular_solve", "triangular_solve",
         lambda a, b: lax.linalg.triangular_solve(spd(a), b, left_side=True, lower=True), (m3, v3)),
        ("lu", "lu", lambda a: lax.linalg.lu(spd(a))[0], (m3,)),
        ("lu permutation", "lu_pivots_to_permutation",
         lambda a: lax.linalg.lu(spd(a) - 2.0 * a)[2].astype(jnp.float32), (m3,)),
        ("qr", "qr", lambda a: jnp.abs(jnp.linalg.qr(spd(a))[1]), (m3,)),
        ("eigh", "eigh", lambda a: jnp.linalg.eigh(spd(a))[0], (m3,)),
        ("svd", "svd", lambda a: jnp.linalg.svd(spd(a), compute_uv=False), (m3,)),
        ("geqrf", "geqrf", lambda a: jnp.abs(linalg.geqrf(spd(a))[0]), (m3,)),
        ("householder_product", "householder_product",
         lambda a: jnp.square(linalg.householder_product(*linalg.geqrf(spd(a)))), (m3,)),
        ("tridiagonal", "tridiagonal", lambda a: lax.linalg.tridiagonal(spd(a))[1], (m3,)),
        ("tridiagonal_solve", "tridiagonal_solve",
         lambda d, b: lax.linalg.tridiagonal_solve(
             jnp.pad(d[..., 1:] * 0.5, [(0, 0), (1, 0)]), 10.0 + jnp.abs(d),
             jnp.pad(d[..., :-1] * 0.5, [(0, 0), (0, 1)]), b), (((8, 4), "f"), v3)),
        # eigenvalues and Schur forms come in LAPACK's order: sorted, of a symmetric matrix
        ("eig", "eig", lambda a: jnp.sort(jnp.linalg.eigvals(spd(a)).real, axis=-1), (m3,)),
        ("schur", "schur",
         lambda a: jnp.sort(jnp.diagonal(jsl.schur(spd(a))[0], axis1=-2, axis2=-1), axis=-1),
         (m3,)),
        ("hessenberg", "hessenberg", lambda a: jnp.abs(jsl.hessenberg(spd(a) - a)), (m3,)),
        ("pivoted qr", "geqp3", lambda a: jnp.abs(jsl.qr(spd(a) - a, pivoting=True)[1]), (m3,)),
        ("ormqr", "ormqr", lambda a, b: jnp.abs(linalg.ormqr(*linalg.geqrf(spd(a)), b)), (m3, v3)),
        ("cholesky_update", "cholesky_update",
         lambda a, w: lax.linalg.cholesky_update(jnp.linalg.cholesky(spd(a)), w * 0.1),
         (((4, 4), "f"), ((4,), "f"))),
        ("symmetric_product", "symmetric_product",
         lambda a, c: lax.linalg.symmetric_product(a, spd(c), alpha=0.5, beta=2.0), (m3, m3)),
        ("fft", "fft", lambda a: jnp.abs(jnp.fft.fft(a, axis=-1)), (m3,)),
        ("rfft2 / irfft2", "fft", lambda a: jnp.fft.irfft2(jnp.fft.rfft2(a) * 0.5, s=(4, 4)), (m3,)),
    ]


__all__ = ["TABLE", "validation_samples"]
