"""A small GPT written three ways (unrolled, lax.scan over stacked layers, jax.checkpoint), with
Megatron placements on a (dp, mp) mesh. Used by the compiler tests and benchmarks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import autoshard as dist

V, D, H, T, B = 64, 32, 4, 8, 8
DROP = 0.9


def init(key, layers: int):
    ks = jax.random.split(key, 3 + 4 * layers)
    n = lambda k, s: jax.random.normal(k, s) * 0.05  # noqa: E731
    blocks = [{"ln1": jnp.ones(D), "qkv": n(ks[3 + 4 * i], (D, 3 * D)),
               "proj": n(ks[4 + 4 * i], (D, D)), "ln2": jnp.ones(D),
               "fc": n(ks[5 + 4 * i], (D, 4 * D)), "out": n(ks[6 + 4 * i], (4 * D, D))}
              for i in range(layers)]
    return {"wte": n(ks[0], (V, D)), "wpe": n(ks[1], (T, D)), "lnf": jnp.ones(D),
            "head": n(ks[2], (D, V)), "blocks": blocks}


def stack(params):
    """The same parameters with the blocks stacked on a leading layer axis (for lax.scan)."""
    out = dict(params)
    out["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *params["blocks"])
    return out


def _ln(x, g):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * g


def _dropout(x, key):
    return jnp.where(jax.random.bernoulli(key, DROP, x.shape), x / DROP, 0.0)


def _same(x):
    return x


def block(x, p, key, constrain=_same):
    """One pre-LN transformer block; `constrain` is applied to the residual stream after each
    residual add (the sequence-parallel workload annotates it there)."""
    # fused qkv laid out heads-major, as Megatron does: head h owns columns [3*Dh*h, 3*Dh*(h+1))
    h = (_ln(x, p["ln1"]) @ p["qkv"]).reshape(B, T, H, 3 * (D // H))
    q, k, v = (t.transpose(0, 2, 1, 3) for t in jnp.split(h, 3, axis=-1))
    att = (q @ k.transpose(0, 1, 3, 2)) / np.sqrt(D // H)
    att = jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, -1e9)
    o = (jax.nn.softmax(att, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B, T, D)
    x = constrain(x + _dropout(o @ p["proj"], key))
    return constrain(x + jax.nn.gelu(_ln(x, p["ln2"]) @ p["fc"]) @ p["out"])


def _head_loss(p, x, labels):
    logits = _ln(x, p["lnf"]) @ p["head"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


def loss_unrolled(p, ids, labels, key):
    x = p["wte"][ids] + p["wpe"][None]
    for i, bp in enumerate(p["blocks"]):
        x = block(x, bp, jax.random.fold_in(key, i))
    return _head_loss(p, x, labels)


def loss_scan(p, ids, labels, key):
    x = p["wte"][ids] + p["wpe"][None]
    n = p["blocks"]["qkv"].shape[0]

    def body(x, inputs):
        bp, i = inputs
        return block(x, bp, jax.random.fold_in(key, i)), None

    x, _ = jax.lax.scan(body, x, (p["blocks"], jnp.arange(n)))
    return _head_loss(p, x, labels)


def loss_remat(p, ids, labels, key):
    x = p["wte"][ids] + p["wpe"][None]
    step = jax.checkpoint(block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    for i, bp in enumerate(p["blocks"]):
        x = step(x, bp, jax.random.fold_in(key, i))
    return _head_loss(p, x, labels)


LOSSES = {"unrolled": loss_unrolled, "scan": loss_scan, "remat": loss_remat}


def train_step(loss_fn, tx):
    def step(p, s, ids, labels, key):
        loss, grads = jax.value_and_grad(loss_fn)(p, ids, labels, key)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss, grads
    return step


def megatron_placements(path, x, stacked: bool):
    """Column-parallel qkv/fc/head, row-parallel proj/out, vocab-parallel embedding."""
    R, S = dist.Replicate(), dist.Shard
    name = jax.tree_util.keystr(path)
    shift = 1 if stacked and "blocks" in name else 0
    if any(k in name for k in ("'qkv'", "'fc'", "'head'")):
        return [R, S(1 + shift)]
    if any(k in name for k in ("'proj'", "'out'")):
        return [R, S(0 + shift)]
    if "'wte'" in name:
        return [R, S(0)]
    return [R, R]


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, V, (B, T)).astype(np.int32), rng.integers(0, V, (B, T)).astype(np.int32))


def workload(mesh, layers: int, form: str, tx, seed: int = 0):
    """(train step, single-device args, distributed args) of the GPT step on a (dp, mp) mesh.

    The args are (params, optimizer state, ids, labels, dropout key): params with Megatron
    placements, the batch split over dp.
    """
    params = init(jax.random.key(seed), layers)
    if form == "scan":
        params = stack(params)
    step = train_step(LOSSES[form], tx)
    dparams = jax.tree_util.tree_map_with_path(
        lambda path, x: dist.shard_tensor(x, mesh, megatron_placements(path, x, form == "scan")),
        params)
    ids, labels = batch(seed)
    split = [dist.Shard(0), dist.Replicate()]
    key = jax.random.key(seed + 7)
    state = tx.init(params)
    return (step, (params, state, ids, labels, key),
            (dparams, state, dist.shard_tensor(ids, mesh, split),
             dist.shard_tensor(labels, mesh, split), key))
