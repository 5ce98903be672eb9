"""A small Llama-style decoder (RMSNorm, rotary position embedding, grouped-query attention,
SwiGLU MLP, untied head) written unrolled or as a lax.scan over stacked layers, with Megatron
placements on a (dp, mp) mesh. Used by the tests and the benchmark beside `gpt.py`: the same
parallel strategy on the architecture most models trained today use.

Megatron for this block: q / k / v / gate / up column-parallel (heads and hidden features split
over mp; with fewer key-value heads than query heads, each device keeps the key-value heads its
query heads read, so the repeat is local), o / down row-parallel, the embedding vocab-parallel,
the head split along the vocab.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import autoshard as dist

V, D, H, KV, T, B = 64, 32, 8, 4, 16, 8
DH = D // H          # head dim
F = 64               # SwiGLU hidden features
THETA = 10000.0


def init(key, layers: int) -> dict:
    ks = jax.random.split(key, 2 + 7 * layers)
    n = lambda k, s: jax.random.normal(k, s) * 0.05  # noqa: E731
    blocks = [{"attn_norm": jnp.ones(D), "wq": n(ks[2 + 7 * i], (D, H * DH)),
               "wk": n(ks[3 + 7 * i], (D, KV * DH)), "wv": n(ks[4 + 7 * i], (D, KV * DH)),
               "wo": n(ks[5 + 7 * i], (H * DH, D)), "mlp_norm": jnp.ones(D),
               "gate": n(ks[6 + 7 * i], (D, F)), "up": n(ks[7 + 7 * i], (D, F)),
               "down": n(ks[8 + 7 * i], (F, D))}
              for i in range(layers)]
    return {"embed": n(ks[0], (V, D)), "norm": jnp.ones(D), "head": n(ks[1], (D, V)),
            "blocks": blocks}


def stack(params: dict) -> dict:
    """The same parameters with the blocks stacked on a leading layer axis (for lax.scan)."""
    return {**params, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *params["blocks"])}


def rms_norm(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


def rope(x, positions=None):
    """Rotate each head's two halves by position-dependent angles ([B, t, heads, DH]; the
    positions of its t tokens, 0.. by default)."""
    half = DH // 2
    freq = THETA ** (-jnp.arange(half) / half)
    positions = jnp.arange(x.shape[1]) if positions is None else positions
    angle = positions[:, None] * freq[None, :]
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _no_hint(t):
    return t


def block(x, p, attention_in=_no_hint, attention_out=_no_hint):
    """`attention_in` / `attention_out`: placement hints on q, k, v ([B, T, heads, DH]) before
    the attention and on its output after (context parallelism's; identities by default)."""
    h = rms_norm(x, p["attn_norm"])
    q = rope((h @ p["wq"]).reshape(B, T, H, DH))
    k = rope((h @ p["wk"]).reshape(B, T, KV, DH))
    v = (h @ p["wv"]).reshape(B, T, KV, DH)
    k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)
    q, k, v = attention_in(q), attention_in(k), attention_in(v)
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(DH)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    o = attention_out(jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v))
    x = x + o.reshape(B, T, H * DH) @ p["wo"]
    h = rms_norm(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]


def _loss(p, x, labels):
    logits = rms_norm(x, p["norm"]) @ p["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def loss_unrolled(p, ids, labels):
    x = p["embed"][ids]
    for bp in p["blocks"]:
        x = block(x, bp)
    return _loss(p, x, labels)


def loss_scan(p, ids, labels):
    x, _ = jax.lax.scan(lambda x, bp: (block(x, bp), None), p["embed"][ids], p["blocks"])
    return _loss(p, x, labels)


LOSSES = {"unrolled": loss_unrolled, "scan": loss_scan}


def train_step(loss_fn, tx):
    def step(p, s, ids, labels):
        loss, grads = jax.value_and_grad(loss_fn)(p, ids, labels)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss
    return step


def decode_step(p, cache, tok, pos):
    """Serving: one new token per sequence at position `pos` (a traced int), each layer's keys
    and values written into its cache ([B, T, KV, DH] each) and attended over positions
    0..pos; returns the updated cache and the greedy next tokens."""
    x = p["embed"][tok][:, None]
    at = jnp.reshape(pos, (1,))
    new_cache = []
    for bp, (kc, vc) in zip(p["blocks"], cache):
        h = rms_norm(x, bp["attn_norm"])
        q = rope((h @ bp["wq"]).reshape(-1, 1, H, DH), at)
        k = rope((h @ bp["wk"]).reshape(-1, 1, KV, DH), at)
        v = (h @ bp["wv"]).reshape(-1, 1, KV, DH)
        kc = jax.lax.dynamic_update_slice(kc, k.astype(kc.dtype), (0, pos, 0, 0))
        vc = jax.lax.dynamic_update_slice(vc, v.astype(vc.dtype), (0, pos, 0, 0))
        kk, vv = jnp.repeat(kc, H // KV, axis=2), jnp.repeat(vc, H // KV, axis=2)
        s = jnp.einsum("bqhd,bshd->bhqs", q, kk) / np.sqrt(DH)
        s = jnp.where(jnp.arange(kc.shape[1]) <= pos, s, -1e9)
        o = jnp.einsum("bhqs,bshd->bqhd", jax.nn.softmax(s, axis=-1), vv)
        x = x + o.reshape(-1, 1, H * DH) @ bp["wo"]
        h = rms_norm(x, bp["mlp_norm"])
        x = x + (jax.nn.silu(h @ bp["gate"]) * (h @ bp["up"])) @ bp["down"]
        new_cache.append((kc, vc))
    logits = rms_norm(x, p["norm"]) @ p["head"]
    return new_cache, jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)


def generate(p, cache, tok, steps: int):
    """`steps` greedy tokens from `tok` in a fori_loop; (cache, last token, [B, T] tokens)."""
    def body(i, carry):
        cache, tok, out = carry
        cache, tok = decode_step(p, cache, tok, i)
        return cache, tok, out.at[:, i].set(tok)
    out = jnp.zeros((tok.shape[0], T), jnp.int32)
    return jax.lax.fori_loop(0, steps, body, (cache, tok, out))


def empty_cache(layers: int, batch: int = B) -> list:
    return [(jnp.zeros((batch, T, KV, DH)), jnp.zeros((batch, T, KV, DH)))
            for _ in range(layers)]


COLUMN = ("'wq'", "'wk'", "'wv'", "'gate'", "'up'", "'head'")
ROW = ("'wo'", "'down'", "'embed'")


def megatron_placements(path, x, stacked: bool = False) -> list:
    """Column-parallel q/k/v/gate/up/head, row-parallel o/down, vocab-parallel embedding;
    norms replicated. Stacked blocks carry a leading layer dim."""
    R, S = dist.Replicate(), dist.Shard
    name = jax.tree_util.keystr(path)
    shift = 1 if stacked and "blocks" in name else 0
    if any(k in name for k in COLUMN):
        return [R, S(1 + shift)]
    if any(k in name for k in ROW):
        return [R, S(0 + shift)]
    return [R, R]


def batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, V, (B, T)).astype(np.int32),
            rng.integers(0, V, (B, T)).astype(np.int32))


def workload(mesh, layers: int, form: str, tx, seed: int = 0):
    """(train step, single-device args, distributed args) on a (dp, mp) mesh: params with
    Megatron placements, the optimizer state made from them (so it keeps their placements),
    ids and labels split over dp."""
    params = init(jax.random.key(seed), layers)
    if form == "scan":
        params = stack(params)
    dparams = jax.tree_util.tree_map_with_path(
        lambda path, x: dist.shard_tensor(x, mesh, megatron_placements(path, x, form == "scan")),
        params)
    ids, labels = batch(seed)
    split = [dist.Shard(0), dist.Replicate()]
    return (train_step(LOSSES[form], tx), (params, tx.init(params), ids, labels),
            (dparams, tx.init(dparams), dist.shard_tensor(ids, mesh, split),
             dist.shard_tensor(labels, mesh, split)))


__all__ = ["workload", "megatron_placements", "init", "stack", "LOSSES"]
