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
import jax.extend.core as jex_core
import numpy as np
from jax import lax
from jax._src.lax import lax as lax_internal
from jax._src import random as _jax_random
from jax._src.random import prng
from jax._src.random import threefry2x32 as threefry

try:  # jax's own per-element sampler (private): without it, gamma draws run replicated
    from jax._src.random.core import _gamma_impl, _gamma_one, random_gamma_p
except ImportError:  # pragma: no cover
    _gamma_impl = _gamma_one = random_gamma_p = None
try:  # jax 0.10's counter-based Philox generators (jax.random.key(0, impl="philox4x32"))
    from jax._src.random import philox2x32 as _philox2x32, philox4x32 as _philox4x32
except ImportError:  # pragma: no cover
    _philox2x32 = _philox4x32 = None
try:  # and the 4-word threefry
    from jax._src.random import threefry4x32 as _threefry4x32
except ImportError:  # pragma: no cover
    _threefry4x32 = None
# jax.random.clone (flax's lifted transforms clone a key before splitting it per layer): an
# identity on keys
random_clone_p = getattr(_jax_random, "random_clone_p", getattr(prng, "random_clone_p", None))

from autoshard.compiler.factors import LETTERS, REPLICATE, Factor, OpSharding, einsum

from .elementwise import _mulhi_lower
from .registry import Rule


def _is_threefry(aval) -> bool:
    impl = getattr(aval.dtype, "_impl", None)
    return impl is not None and str(getattr(impl, "name", "")) == "threefry2x32"


# Philox: each round's multiply-high is XLA's, which does not lower inside shard_map (jax
# 0.10, plain jax.shard_map too: "Unable to convert MHLO to StableHLO"). jax lowers every
# Philox key operation through its hash primitive, so a program holding such keys is run
# here through the generator's own functions with the multiply-high computed from
# half-width products (elementwise.py) — the same bits. The hash's round function is jax's
# (named per primitive below); where a jax version lacks it, keys are bound as jax binds them.
_PHILOX_ROUNDS = {getattr(m, f"{n}_p"): getattr(m, f"_{n}_lowering")
                  for m, n in ((_philox2x32, "philox2x32"), (_philox4x32, "philox4x32"))
                  if m is not None and hasattr(m, f"{n}_p") and hasattr(m, f"_{n}_lowering")}
_PHILOX_NAMES = frozenset(p.name for p in _PHILOX_ROUNDS)  # (the generators' names too)
_CALLS = ("pjit", "jit", "closed_call", "core_call")


def is_philox_impl(impl) -> bool:
    return str(getattr(impl, "name", "")) in _PHILOX_NAMES


def _is_philox(aval) -> bool:
    return is_philox_impl(getattr(aval.dtype, "_impl", None))


def _without_mulhi(fn, *args) -> list:
    """`fn(*args)` bound here, its multiply-highs (and those of the Philox hashes it binds)
    computed from half-width products."""
    from autoshard.compiler.partition import match_vma

    closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in args])
    return _eval_without_mulhi(closed.jaxpr, closed.consts, match_vma(list(args)))


def _eval_without_mulhi(jaxpr, consts: list, args: list) -> list:
    from autoshard.compiler.partition import match_vma

    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]  # noqa: E731
    for e in jaxpr.eqns:
        ins = [read(v) for v in e.invars]
        if e.primitive is getattr(lax, "mulhi_p", None):
            outs = _mulhi_lower(None, *match_vma(ins))
        elif e.primitive in _PHILOX_ROUNDS:
            outs = _without_mulhi(_PHILOX_ROUNDS[e.primitive], *ins)
        elif e.primitive.name in _CALLS and "jaxpr" in e.params:
            inner = e.params["jaxpr"]
            outs = _eval_without_mulhi(inner.jaxpr, inner.consts, ins)
        elif e.primitive in _PHILOX_KEY_OPS and _holds_philox(ins, e.params):
            outs = [_PHILOX_KEY_OPS[e.primitive](*ins, **e.params)]
        else:  # (a loop's or branch's bodies rewritten alike: a sampler's rejection loop)
            params = {k: _rewritten(v) for k, v in e.params.items()}
            outs = e.primitive.bind(*match_vma(ins), **params)
            outs = outs if e.primitive.multiple_results else [outs]
        env.update(zip(e.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _rewritten(param):
    """A parameter with its jaxprs (a loop's body, a cond's branches) computing multiply-highs
    from half-width products; anything else as it is."""
    if isinstance(param, jex_core.ClosedJaxpr):
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in param.jaxpr.invars]
        return jax.make_jaxpr(lambda *a: _eval_without_mulhi(param.jaxpr, param.consts,
                                                             list(a)))(*avals)
    if isinstance(param, tuple) and param and all(
            isinstance(p, jex_core.ClosedJaxpr) for p in param):
        return tuple(_rewritten(p) for p in param)
    return param


def _holds_philox(args, params) -> bool:
    """Whether a key operation works on Philox keys (a seed's generator is its parameter;
    other operations read it from their keys)."""
    return is_philox_impl(params.get("impl", getattr(args[0].dtype, "_impl", None)))


def _key_op_lowering(primitive):
    """A key operation's lowering: as jax binds it, or for Philox keys `_PHILOX_KEY_OPS`'."""
    def lowering(ctx, *args, **params):
        if not _holds_philox(args, params):
            return [primitive.bind(*args, **params)]
        return [_PHILOX_KEY_OPS[primitive](*args, **params)]
    return lowering


def _philox_seed(seeds, *, impl):
    made, = _without_mulhi(prng.iterated_vmap_unary(np.ndim(seeds), impl.seed), seeds)
    return prng.random_wrap(made, impl=impl)


def _philox_split(keys, *, shape):
    impl = keys.dtype._impl
    made, = _without_mulhi(prng.iterated_vmap_unary(keys.ndim, lambda k: impl.split(k, shape)),
                           prng.random_unwrap(keys))
    return prng.random_wrap(made, impl=impl)


def _philox_fold_in(keys, msgs):
    impl = keys.dtype._impl
    made, = _without_mulhi(prng.iterated_vmap_binary_bcast(keys.shape, np.shape(msgs),
                                                           impl.fold_in),
                           prng.random_unwrap(keys), msgs)
    return prng.random_wrap(made, impl=impl)


def _philox_bits(keys, *, bit_width, shape):
    """Whole draws from every key, as jax draws them."""
    impl = keys.dtype._impl
    bits = prng.iterated_vmap_unary(keys.ndim, lambda k: impl.random_bits(k, bit_width, shape))
    return _without_mulhi(bits, prng.random_unwrap(keys))[0]


_PHILOX_KEY_OPS = {prng.random_seed_p: _philox_seed, prng.random_split_p: _philox_split,
                   prng.random_fold_in_p: _philox_fold_in, prng.random_bits_p: _philox_bits}


# Generators whose random_bits hash (the key's words, then a counter: the element's global
# index as its high and low words, zero words after) and xor the hash's words; by the name
# shared by a generator and its hash primitive: the counter's length (the hash's outputs)
_COUNTER_HASHES = {name: (getattr(m, f"{name}_p"), words) for m, name, words in (
    (_philox2x32, "philox2x32", 2), (_philox4x32, "philox4x32", 4),
    (_threefry4x32, "threefry4x32", 4)) if m is not None and hasattr(m, f"{name}_p")}


def _counter_hash(key):
    """(hash primitive, counter words) of a key drawing by index (threefry2x32 aside)."""
    found = _COUNTER_HASHES.get(str(getattr(getattr(key.dtype, "_impl", None), "name", "")))
    if found is not None and found[0].name.startswith("philox") and not _is_philox(key):
        return None  # (a Philox hash this module cannot run without XLA's multiply-high)
    return found


def _by_index(key, bit_width, shape) -> bool:
    """Can each device draw its own block of `random_bits` (the generator's hash over the
    global indices: threefry made partitionable, and the counter-based generators, whose
    counter is the index)?"""
    return ((_is_threefry(key) and jax.config.jax_threefry_partitionable
             or _counter_hash(key) is not None)
            and bit_width in (8, 16, 32) and math.prod(shape) < 2 ** 32)


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


def _counter_hash_at(key, index) -> list:
    """The words of a counter-based generator's hash of one key at the global element
    indices `index` — the counter (0, i, 0, ...): its high word 0, fewer than 2**32 elements —
    the key's words first, as jax's random_bits binds the hash."""
    hashed, words = _counter_hash(key)
    data = prng.random_unwrap(key)
    key_words = [lax.index_in_dim(data, i, axis=-1, keepdims=False)
                 for i in range(data.shape[-1])]
    zero = lax.full(index.shape, 0, np.uint32)
    counter = [zero, index] + [zero] * (words - 2)
    return _without_mulhi(lambda *w: hashed.bind(*w), *key_words, *counter)


def _bits_for_one_key(key, index, bit_width):
    """The generator's hash of one key at the global element indices `index`, its words
    xored (random_bits of every generator drawing by index)."""
    words = _threefry_at(key, index) if _is_threefry(key) else _counter_hash_at(key, index)
    bits = words[0]
    for w in words[1:]:
        bits = lax.bitwise_xor(bits, w)
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
        if _is_philox(key):
            return [_philox_bits(key, bit_width=bit_width, shape=shape)]
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
    if not _gamma_by_element(key, a):
        # other generators' keys, a batch of keys: drawn whole on every device from the
        # whole keys and alphas, as one device draws them (as rbg keys draw bits)
        return replicated_sharding(in_avals, out_avals)
    term = LETTERS[:len(a.shape)]
    return einsum(f",{term}->{term}", [key.shape, a.shape], [out_avals[0].shape])


def _gamma_by_element(key, a) -> bool:
    """Can each device draw its own elements' gamma samples (their split keys made there)?"""
    return (not key.ndim and _is_threefry(key) and _gamma_one is not None
            and jax.config.jax_threefry_partitionable and math.prod(a.shape) < 2 ** 32)


def random_gamma_lower(ctx, key, a, *, log_space):
    """Each device makes the split keys of its own elements (split(key, n)[i] is
    threefry(key, (0, i)) with partitionable threefry) and samples them as jax does."""
    from autoshard.compiler.partition import match_vma

    if not _gamma_by_element(key, a):
        if _is_philox(key) and _gamma_impl is not None:
            # jax's sampler, its keys' hashes without XLA's multiply-high
            return _without_mulhi(
                lambda k, x: _gamma_impl(k, x, log_space=log_space, use_vmap=True), key, a)
        return [random_gamma_p.bind(key, a, log_space=log_space)]
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
    prng.random_seed_p: Rule(replicated_sharding, _key_op_lowering(prng.random_seed_p)),
    prng.random_wrap_p: Rule(keywise_sharding),
    prng.random_unwrap_p: Rule(keywise_sharding),
    prng.random_split_p: Rule(keywise_sharding, _key_op_lowering(prng.random_split_p)),
    prng.random_fold_in_p: Rule(keywise_sharding, _key_op_lowering(prng.random_fold_in_p)),
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
    ] + [
        (f"{impl} draw", "random_bits",
         lambda x, impl=impl: x * jax.random.normal(
             jax.random.fold_in(jax.random.key(3, impl=impl), 1), x.shape), (f2,))
        for impl in sorted(_PHILOX_NAMES)
    ] + [
        ("raw threefry2x32", "threefry2x32",
         lambda x, y: x + threefry.threefry2x32_p.bind(
             np.uint32(7), np.uint32(9), lax.bitcast_convert_type(x, np.uint32),
             lax.bitcast_convert_type(y, np.uint32))[1].astype(np.float32) * 1e-9, (f2, f2)),
    ]
