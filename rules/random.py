"""Random numbers equal to one device's on every mesh.

With `jax_threefry_partitionable` (on by default), bit i of `random_bits(key, shape)` is
threefry(key, i) for the element's global row-major index i. So each device computes threefry
over the global indices of its own block: the values match one device exactly, whatever the
mesh, with no communication. (JAX itself does not promise mesh-independent values under
shard_map.) Key manipulation (wrap, unwrap, split, fold_in) is per key: a key array split over a
mesh dim stays split (`keywise_sharding`); seeding runs replicated.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax import lax
from jax._src.lax import lax as lax_internal
from jax._src import random as _jax_random
from jax._src.random import prng
from jax._src.random import threefry2x32 as threefry

try:  # jax's own per-element sampler (private): without it, gamma draws run replicated
    from jax._src.random.core import _gamma_one, random_gamma_p
except ImportError:  # pragma: no cover
    _gamma_one = random_gamma_p = None
# jax.random.clone (flax's lifted transforms clone a key before splitting it per layer): an
# identity on keys
random_clone_p = getattr(_jax_random, "random_clone_p", getattr(prng, "random_clone_p", None))

from autoshard.compiler.factors import LETTERS, REPLICATE, Factor, OpSharding, einsum

from .registry import Rule


def _is_threefry(aval) -> bool:
    impl = getattr(aval.dtype, "_impl", None)
    return impl is not None and str(getattr(impl, "name", "")) == "threefry2x32"


def _by_index(key, bit_width, shape) -> bool:
    """Can each device draw its own block of `random_bits` (threefry over global indices)?"""
    return (_is_threefry(key) and bit_width in (8, 16, 32)
            and jax.config.jax_threefry_partitionable and math.prod(shape) < 2 ** 32)


def random_bits_sharding(in_avals, out_avals, *, bit_width, shape):
    # A batch of keys (split keys under vmap) draws one block per key: the result is
    # (*key dims, *shape), and a key dim may be split along with the draws that use it.
    key = in_avals[0]
    batch = LETTERS[:key.ndim]
    inner = LETTERS[key.ndim:key.ndim + len(shape)]
    if not _by_index(key, bit_width, shape):
        # other generators (rbg keys), 64-bit or huge draws: drawn whole on every device from
        # the (replicated) keys — no communication. Not even a key dim splits: an rbg batch
        # drawn in parts differs from the batch drawn at once.
        batch, inner = "." * key.ndim, "." * len(shape)
    return einsum(f"{batch}->{batch}{inner}", [key.shape], [tuple(key.shape) + tuple(shape)])


def _threefry_at(key, index):
    """The two words of threefry(key, (0, i)) at the global element indices `index` (one
    scalar key): random_bits xors them, a split key is the pair."""
    from autoshard.compiler.partition import match_vma

    # lax throughout, not jnp's operators: each of those is a jitted call under tracing
    data = prng.random_unwrap(key)
    word = lambda i: lax.index_in_dim(data, i, axis=-1, keepdims=False)  # noqa: E731
    k1, k2, hi, lo = match_vma([word(0), word(1), lax.full(index.shape, 0, np.uint32), index])
    return threefry.threefry2x32_p.bind(k1, k2, hi, lo)


def _bits_for_one_key(key, index, bit_width):
    """threefry(key, i) at the global element indices `index` (one scalar key)."""
    bits = lax.bitwise_xor(*_threefry_at(key, index))
    if bit_width != 32:
        bits = lax.convert_element_type(bits, prng.UINT_DTYPES[bit_width])
    return bits


def _global_index(ctx, local, dims, shape):
    """The global row-major index (uint32) of each element of this device's block."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    index = lax.full(local, 0, np.uint32)
    for d, axes in enumerate(dims):
        g = lax.broadcasted_iota(np.uint32, local, d)
        if axes:  # this block starts at block_index * local size along d
            start = lax.mul(ctx.block_index(axes), np.int32(local[d]))
            g = lax.add(g, lax.convert_element_type(start, np.uint32))
        index = lax.add(index, lax.mul(g, lax.full(local, strides[d], np.uint32)))
    return index


def random_bits_lower(ctx, key, *, bit_width, shape):
    if not _by_index(key, bit_width, shape):  # whole draws, from every key
        return [prng.random_bits_p.bind(key, bit_width=bit_width, shape=shape)]
    nb = key.ndim
    local = ctx.local_out_shapes[0][nb:]  # this device's block of one key's draw
    dims = ctx.out_layouts[0].dims[nb:]
    index = _global_index(ctx, local, dims, shape)
    draw = lambda k: _bits_for_one_key(k, index, bit_width)  # noqa: E731
    for _ in range(nb):  # one draw per local key, as jax batches random_bits
        draw = jax.vmap(draw)
    return [draw(key)]


def random_gamma_sharding(in_avals, out_avals, *, log_space):
    """jax.random.gamma (and beta, dirichlet): element i of `a` draws with key i of
    split(key, a.size); elementwise over `a`, the key whole."""
    key, a = in_avals
    if (key.ndim or not _is_threefry(key) or _gamma_one is None
            or not jax.config.jax_threefry_partitionable or math.prod(a.shape) >= 2 ** 32):
        return None
    term = LETTERS[:len(a.shape)]
    return einsum(f",{term}->{term}", [key.shape, a.shape], [out_avals[0].shape])


def random_gamma_lower(ctx, key, a, *, log_space):
    """Each device makes the split keys of its own elements (split(key, n)[i] is
    threefry(key, (0, i)) with partitionable threefry) and samples them as jax does."""
    from autoshard.compiler.partition import match_vma

    local, dims = ctx.local_out_shapes[0], ctx.out_layouts[0].dims
    shape = tuple(n * math.prod(ctx.sizes[ax] for ax in axes) for n, axes in zip(local, dims))
    bits1, bits2 = _threefry_at(key, _global_index(ctx, local, dims, shape))
    keys = prng.random_wrap(lax.concatenate([bits1.reshape(-1, 1), bits2.reshape(-1, 1)], 1),
                            impl=key.dtype._impl)
    keys, alphas = match_vma([keys, a.reshape(-1)])
    one = lambda k, x: _gamma_one(k, x, log_space=log_space)  # noqa: E731
    return [jax.vmap(one)(keys, alphas).reshape(local)]


def replicated_sharding(in_avals, out_avals, **params):
    """Every dim stays whole: small key arrays, where sharding gains nothing, and draws whose
    values depend on the whole shape."""
    factors, operands, results = [], [], []
    for group, avals in ((operands, in_avals), (results, out_avals)):
        for aval in avals:
            dims = []
            for _ in aval.shape:
                dims.append(len(factors))
                factors.append(Factor(REPLICATE))
            group.append(tuple(dims))
    return OpSharding(tuple(operands), tuple(results), tuple(factors))


def threefry_sharding(in_avals, out_avals, **params):
    """The raw threefry2x32 hash (jax.extend.random.threefry_2x32, custom PRNGs): each output
    element hashes the key words with the count words at its own position — elementwise, key
    words scalar or shaped like the counts."""
    r = len(out_avals[0].shape)
    if any(len(a.shape) not in (0, r) for a in in_avals):
        return None
    term = LETTERS[:r]
    return einsum(",".join(term if len(a.shape) == r else "" for a in in_avals) + "->"
                  + ",".join([term] * len(out_avals)),
                  [a.shape for a in in_avals], [a.shape for a in out_avals])


def keywise_sharding(in_avals, out_avals, **params):
    """Key manipulation is per key: a key array's dims map to the result's leading dims, which
    split as the keys do; the dims it adds (a key's uint32 words, split's new keys) or drops
    (wrap's words) stay whole. Per-sample keys split over the batch stay split (no gather of the
    keys for each device to use its own). Anything else (fold_in messages shaped otherwise than
    the keys) runs replicated."""
    keys, out = in_avals[0], out_avals[0]
    r = min(len(keys.shape), len(out.shape))
    if any(keys.shape[d] != out.shape[d] for d in range(r)):
        return replicated_sharding(in_avals, out_avals)
    term = LETTERS[:r]
    terms = [term + "." * (len(keys.shape) - r)]
    for a in in_avals[1:]:  # fold_in's messages: one per key, or one for all
        if tuple(a.shape) == tuple(keys.shape):
            terms.append(terms[0])
        elif not a.shape:
            terms.append("")
        else:
            return replicated_sharding(in_avals, out_avals)
    return einsum(",".join(terms) + "->" + term + "." * (len(out.shape) - r),
                  [a.shape for a in in_avals], [a.shape for a in out_avals])


TABLE = {
    threefry.threefry2x32_p: Rule(threefry_sharding),
    prng.random_bits_p: Rule(random_bits_sharding, random_bits_lower),
    prng.random_seed_p: Rule(replicated_sharding),
    prng.random_wrap_p: Rule(keywise_sharding),
    prng.random_unwrap_p: Rule(keywise_sharding),
    prng.random_split_p: Rule(keywise_sharding),
    prng.random_fold_in_p: Rule(keywise_sharding),
    # lax.rng_bit_generator's bits depend on the whole shape drawn: every device draws all of
    # them from the (whole) key, as one device does, and its consumers take their blocks
    lax_internal.rng_bit_generator_p: Rule(replicated_sharding),
}
if random_clone_p is not None:
    TABLE[random_clone_p] = Rule(keywise_sharding)
if _gamma_one is not None:
    TABLE[random_gamma_p] = Rule(random_gamma_sharding, random_gamma_lower)


def validation_samples() -> list:
    f2 = ((8, 8), "f")
    return [
        ("gamma", "random_gamma",
         lambda x: jax.random.gamma(jax.random.key(5), jax.numpy.abs(x) + 0.5), (f2,)),
        ("raw rng_bit_generator", "rng_bit_generator",
         lambda k, x: x * lax.rng_bit_generator(k.astype(np.uint32), x.shape)[1]
         .astype(np.float32), (((4,), "f"), f2)),
        ("uniform", "random_bits",
         lambda x: x * jax.random.uniform(jax.random.key(3), x.shape), (f2,)),
        ("bernoulli dropout", "random_bits",
         lambda x: jax.numpy.where(jax.random.bernoulli(jax.random.key(7), 0.7, x.shape), x / 0.7, 0.0), (f2,)),
        ("per-row keys (vmap)", "random_bits",
         lambda x: x * jax.vmap(lambda k: jax.random.normal(k, x.shape[1:]))(
             jax.random.split(jax.random.key(8), x.shape[0])), (f2,)),
        ("bits 8", "random_bits",
         lambda x: x + jax.random.bits(jax.random.key(1), x.shape, dtype=np.uint8).astype(np.float32), (f2,)),
        ("split + fold_in", "random_split",
         lambda x: x * jax.random.normal(jax.random.split(jax.random.fold_in(jax.random.key(5), 2))[1], x.shape), (f2,)),
        ("PRNGKey wrap", "random_wrap",
         lambda x: x + jax.random.uniform(jax.random.PRNGKey(11), x.shape), (f2,)),
        ("fold_in", "random_fold_in",
         lambda x: x + jax.random.uniform(jax.random.fold_in(jax.random.key(2), 9), x.shape), (f2,)),
        ("clone", "random_clone",
         lambda x: x * jax.random.normal(jax.random.clone(jax.random.key(9)), x.shape), (f2,)),
        ("seed", "random_seed", lambda x: x + jax.random.normal(jax.random.key(4), x.shape), (f2,)),
        ("per-row keys split and folded", "random_split",
         lambda x: x * jax.vmap(lambda k: jax.random.normal(k, x.shape[1:]))(
             jax.vmap(jax.random.fold_in, in_axes=(0, None))(
                 jax.vmap(jax.random.split)(jax.random.split(jax.random.key(8), x.shape[0]))[:, 1],
                 3)), (f2,)),
        ("per-row key data", "random_unwrap",
         lambda x: x + jax.random.key_data(jax.random.split(jax.random.key(2), x.shape[0]))[:, :1]
         .astype(np.float32), (f2,)),
        ("unwrap", "random_unwrap",
         lambda x: x + jax.random.key_data(jax.random.key(6))[1].astype(np.float32), (f2,)),
        ("rbg draw", "random_bits",
         lambda x: x * jax.random.normal(jax.random.key(3, impl="rbg"), x.shape), (f2,)),
        ("raw threefry2x32", "threefry2x32",
         lambda x, y: x + threefry.threefry2x32_p.bind(
             np.uint32(7), np.uint32(9), lax.bitcast_convert_type(x, np.uint32),
             lax.bitcast_convert_type(y, np.uint32))[1].astype(np.float32) * 1e-9, (f2, f2)),
    ]
