"""Benchmark workloads: a train step, its placed arguments and its analytic minimum.

Each builder returns a `Workload`: the unpartitioned step function (the same function is
given to `dist.jit` and, for the baseline, to plain `jax.jit`), the arguments with their
placements (DistTensors; the baseline gets their `.physical` arrays, so XLA starts from the
same input shardings), and the collectives the strategy cannot avoid. Sizes come in two
scales: "full" for the benchmark, "quick" for the smoke test. The GPT workloads live in
`gpt_workloads.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import autoshard as dist

from .analytic import Minimum, all_gather, all_reduce, nbytes

R, S = dist.Replicate(), dist.Shard
LR = 0.1


@dataclass(frozen=True)
class Workload:
    """One benchmark case: `step(*args)` partitioned by us and by XLA from the same placements."""

    name: str
    step: Callable
    args: tuple
    mesh: dist.ProcessMesh
    minimum: Minimum | None = None        # None where no simple closed form is claimed
    out_placements: Any = None            # passed to dist.jit (e.g. ZeRO-3 keeps params split)
    notes: str = ""
    info: dict = field(default_factory=dict)   # sizes, for the JSON
    # The baseline's step where the function carries placement annotations: the same function
    # with them written as jax sharding constraints, which plain jax.jit honours (our hints are
    # identities outside dist.jit).
    baseline_step: Callable | None = None


def mesh_1d(name: str) -> dist.ProcessMesh:
    return dist.ProcessMesh(list(range(8)), dim_names=[name])


def mesh_2x4() -> dist.ProcessMesh:
    return dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])


def sgd(params: Any, grads: Any) -> Any:
    """Plain SGD: the update is elementwise, so it adds no communication of its own."""
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def keep_placements(*trees: Any) -> list:
    """out_placements for outputs laid out like `trees` (DistTensor leaves, or a placements
    list standing for one output): a train step hands its params back where they came from,
    as `dist.to_static` does, instead of letting the plan pick a layout per step."""
    out: list = []
    for tree in trees:
        if isinstance(tree, list):
            out.append(tree)
        else:
            out.extend(x.placements for x in jax.tree.leaves(
                tree, is_leaf=lambda t: isinstance(t, dist.DistTensor)))
    return out


def _normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.normal(size=shape) * 0.05).astype(np.float32)


def _place(tree: dict, mesh: dist.ProcessMesh, placements: dict) -> dict:
    return {k: dist.shard_tensor(v, mesh, placements[k]) for k, v in tree.items()}


# ------------------------------------------------------------------------ data-parallel MLP
def dp_mlp(quick: bool = False) -> Workload:
    """Replicated params, batch split 8 ways: one all-reduce of every gradient (and the loss)."""
    b, d_in, hidden, d_out = (64, 32, 64, 32) if quick else (512, 256, 1024, 256)
    mesh = mesh_1d("dp")
    rng = np.random.default_rng(0)
    params = {"w0": _normal(rng, d_in, hidden), "w1": _normal(rng, hidden, d_out)}
    x, y = _normal(rng, b, d_in), _normal(rng, b, d_out)

    def step(p, x, y):
        def loss(p):
            return jnp.mean((jax.nn.relu(x @ p["w0"]) @ p["w1"] - y) ** 2)
        value, grads = jax.value_and_grad(loss)(p)
        return sgd(p, grads), value

    n = mesh.size
    minimum = Minimum(
        tuple(all_reduce(v.nbytes, n, f"grad {k}") for k, v in params.items())
        + (all_reduce(4, n, "loss"),),
        "each gradient all-reduced once over dp, plus the scalar loss")
    placed = _place(params, mesh, {"w0": [R], "w1": [R]})
    return Workload(
        "dp mlp", step,
        (placed, dist.shard_tensor(x, mesh, [S(0)]), dist.shard_tensor(y, mesh, [S(0)])),
        mesh, minimum, keep_placements(placed, [R]), info={"batch": b, "d_in": d_in, "hidden": hidden, "d_out": d_out})


# ------------------------------------------------------------------------ Megatron MLP
def tp_mlp(quick: bool = False) -> Workload:
    """Column- then row-parallel MLP over 8: one all-reduce of activations fwd, one bwd.

    The step also returns the input's gradient (as a layer inside a larger model must), which
    is what makes the backward all-reduce necessary.
    """
    b, d = (16, 32) if quick else (256, 512)
    mesh = mesh_1d("mp")
    rng = np.random.default_rng(1)
    params = {"w1": _normal(rng, d, 4 * d), "w2": _normal(rng, 4 * d, d)}
    x, y = _normal(rng, b, d), _normal(rng, b, d)

    def step(p, x, y):
        def loss(p, x):
            return jnp.mean((jax.nn.gelu(x @ p["w1"]) @ p["w2"] - y) ** 2)
        value, (grads, dx) = jax.value_and_grad(loss, argnums=(0, 1))(p, x)
        return sgd(p, grads), dx, value

    act = nbytes((b, d))
    minimum = Minimum((all_reduce(act, mesh.size, "forward: row-parallel output"),
                       all_reduce(act, mesh.size, "backward: input gradient")),
                      "Megatron: one all-reduce of the activations forward, one backward")
    placed = _place(params, mesh, {"w1": [S(1)], "w2": [S(0)]})
    return Workload(
        "tp mlp", step,
        (placed, dist.shard_tensor(x, mesh, [R]), dist.shard_tensor(y, mesh, [R])),
        mesh, minimum, keep_placements(placed, [R], [R]), info={"batch": b, "d": d})


# ------------------------------------------------------------------------ vocab-parallel CE
def vocab_ce(quick: bool = False) -> Workload:
    """Vocab-parallel embedding and head with cross-entropy on 2x4 (dp, mp).

    The lookup on a vocab-sharded table is a partial sum, reduced once; the logits stay
    vocab-sharded and the softmax only reduces per-row max and sum over mp (never gathering
    the logits); the backward reduces the input gradient of the head once.
    """
    v, d, b, t = (256, 32, 4, 8) if quick else (8192, 256, 16, 64)
    mesh = mesh_2x4()
    dp, mp = mesh.shape
    rng = np.random.default_rng(2)
    params = {"wte": _normal(rng, v, d), "head": _normal(rng, d, v)}
    ids = rng.integers(0, v, (b, t)).astype(np.int32)
    labels = rng.integers(0, v, (b, t)).astype(np.int32)

    def step(p, ids, labels):
        def loss(p):
            h = jnp.tanh(p["wte"][ids])
            logp = jax.nn.log_softmax(h @ p["head"], axis=-1)
            return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()
        value, grads = jax.value_and_grad(loss)(p)
        return sgd(p, grads), value

    act, rows = nbytes((b // dp, t, d)), nbytes((b // dp, t))
    # The table gradient: all-reduce its vocab shard over dp, or all-gather the batch's updates
    # (and ids) over dp and scatter them locally — whichever moves fewer bytes.
    table_grad = min(
        [(all_reduce(nbytes((v // mp, d)), dp, "grad wte: all-reduce the vocab shard"),),
         (all_gather(nbytes((b, t, d)), dp, "grad wte: all-gather the updates"),
          all_gather(nbytes((b, t), np.int32), dp, "grad wte: all-gather the ids"))],
        key=lambda terms: sum(c.result_bytes for c in terms))
    minimum = Minimum(
        (all_reduce(act, mp, "forward: lookup partial sum"),
         all_reduce(rows, mp, "softmax row max"), all_reduce(rows, mp, "softmax row sum"),
         all_reduce(rows, mp, "backward: row sum of the log-softmax cotangent"),
         all_reduce(4, dp * mp, "loss (target logits stay partial into the mean)"),
         all_reduce(act, mp, "backward: head input gradient"),
         *table_grad,
         all_reduce(nbytes((d, v // mp)), dp, "grad head")),
        "lookup all-reduce, three per-row softmax reductions, head input gradient, dp gradients "
        "(the table's by the cheaper of reducing it and gathering the updates)")
    placed = _place(params, mesh, {"wte": [R, S(0)], "head": [R, S(1)]})
    return Workload(
        "vocab-parallel ce", step,
        (placed, dist.shard_tensor(ids, mesh, [S(0), R]),
         dist.shard_tensor(labels, mesh, [S(0), R])),
        mesh, minimum, keep_placements(placed, [R, R]), info={"vocab": v, "d": d, "batch": b, "seq": t})


# ------------------------------------------------------------------------ dropout (RNG)
def dropout_mlp(quick: bool = False) -> Workload:
    """A DP x TP MLP with dropout on the mp-sharded hidden layer: the mask costs no bytes."""
    b, d = (16, 32) if quick else (256, 512)
    mesh = mesh_2x4()
    dp, mp = mesh.shape
    rng = np.random.default_rng(3)
    params = {"w1": _normal(rng, d, 4 * d), "w2": _normal(rng, 4 * d, d)}
    x, y = _normal(rng, b, d), _normal(rng, b, d)
    keep = 0.9

    def step(p, x, y, key):
        def loss(p):
            h = jax.nn.gelu(x @ p["w1"])
            h = jnp.where(jax.random.bernoulli(key, keep, h.shape), h / keep, 0.0)
            return jnp.mean((h @ p["w2"] - y) ** 2)
        value, grads = jax.value_and_grad(loss)(p)
        return sgd(p, grads), value

    minimum = Minimum(
        (all_reduce(nbytes((b // dp, d)), mp, "forward: row-parallel output"),
         all_reduce(4, dp, "loss"),
         all_reduce(params["w1"].nbytes // mp, dp, "grad w1"),
         all_reduce(params["w2"].nbytes // mp, dp, "grad w2")),
        "Megatron forward all-reduce, dp gradient all-reduces; the dropout mask is local")
    split = [S(0), R]
    placed = _place(params, mesh, {"w1": [R, S(1)], "w2": [R, S(0)]})
    return Workload(
        "dropout mlp", step,
        (placed, dist.shard_tensor(x, mesh, split), dist.shard_tensor(y, mesh, split),
         jax.random.key(11)),
        mesh, minimum, keep_placements(placed, [R, R]), info={"batch": b, "d": d, "keep": keep})


# ------------------------------------------------------------------------ spatial CNN
def spatial_cnn(quick: bool = False) -> Workload:
    """A CNN over images split by rows over mp (batch over dp): SAME convolutions, a 3×3
    stride-2 max pool and a 3×3 average pool, each fetching the rows its window reaches from
    its neighbours (collective-permutes) where XLA also exchanges halos; no closed form is
    claimed for the halos."""
    b, hw, c = (4, 16, 4) if quick else (16, 64, 32)
    mesh = mesh_2x4()
    rng = np.random.default_rng(4)
    params = {"k1": _normal(rng, 3, 3, c, 2 * c) * 0.3, "k2": _normal(rng, 5, 5, 2 * c, 2 * c) * 0.1,
              "head": _normal(rng, 2 * c, 8) * 0.3}
    x, y = _normal(rng, b, hw, hw, c), _normal(rng, b, 8)

    def conv(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def pool(x, op, init, window, stride):
        return jax.lax.reduce_window(x, init, op, (1, window, window, 1), (1, stride, stride, 1),
                                     "SAME")

    def step(p, x, y):
        def loss(p):
            h = pool(jax.nn.relu(conv(x, p["k1"])), jax.lax.max, -jnp.inf, 3, 2)
            h = pool(jnp.tanh(conv(h, p["k2"])), jax.lax.add, 0.0, 3, 1) / 9
            return jnp.mean((h.mean(axis=(1, 2)) @ p["head"] - y) ** 2)
        value, grads = jax.value_and_grad(loss)(p)
        return sgd(p, grads), value

    placed = _place(params, mesh, {k: [R, R] for k in params})
    return Workload(
        "spatial cnn", step,
        (placed, dist.shard_tensor(x, mesh, [S(0), S(1)]), dist.shard_tensor(y, mesh, [S(0), R])),
        mesh, None, keep_placements(placed, [R, R]),
        notes="rows over mp: halos by collective-permute; gradients all-reduced",
        info={"batch": b, "image": hw, "channels": c})


def shifted_lm_loss(quick: bool = False) -> Workload:
    """A language model's last layer and loss over a sequence split over mp (batch over dp):
    a token shift mixing each position with the one before, the head, and the cross-entropy
    of `logits[:, :-1]` against `tokens[:, 1:]` — slices of 63 of 64 positions, which
    autoshard runs at the full length (the labels rolled by one token) rather than gathering
    the logits; no closed form is claimed."""
    b, t, d, v = (4, 16, 16, 64) if quick else (16, 256, 64, 2048)
    mesh = mesh_2x4()
    rng = np.random.default_rng(5)
    params = {"mix": _normal(rng, d) * 0.1, "head": _normal(rng, d, v) * 0.1}
    h = _normal(rng, b, t, d)
    tokens = rng.integers(0, v, (b, t)).astype(np.int32)

    def step(p, h, tokens):
        def loss(p):
            prev = jnp.pad(h[:, :-1], ((0, 0), (1, 0), (0, 0)))
            x = h + jnp.tanh(p["mix"] * prev)
            logp = jax.nn.log_softmax((x @ p["head"])[:, :-1])
            return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()
        value, grads = jax.value_and_grad(loss)(p)
        return sgd(p, grads), value

    placed = _place(params, mesh, {k: [R, R] for k in params})
    return Workload(
        "shifted lm loss", step,
        (placed, dist.shard_tensor(h, mesh, [S(0), S(1)]),
         dist.shard_tensor(tokens, mesh, [S(0), S(1)])),
        mesh, None, keep_placements(placed, [R, R]),
        notes="tokens over mp: labels rolled by one token, logits never gathered",
        info={"batch": b, "seq": t, "d": d, "vocab": v})


# ------------------------------------------------------------------------ ring attention
def ring_attention(quick: bool = False) -> Workload:
    """Causal attention over a long sequence split 8 ways (q, k, v and the output's weights
    split on the sequence), forward and backward: `dist.ring_attention` against plain jax.jit
    of `jax.nn.dot_product_attention` from the same placements (XLA brings each device the
    keys and values it needs). The ring passes key / value blocks round and balances the
    causal work (zigzag chunks); no closed form is claimed."""
    b, t, h, dh = (1, 128, 2, 16) if quick else (1, 4096, 4, 64)
    mesh = mesh_1d("sep")
    rng = np.random.default_rng(6)
    q, k, v, w = (_normal(rng, b, t, h, dh) for _ in range(4))

    def grads(attention):
        def step(q, k, v, w):
            return jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v) * w),
                            argnums=(0, 1, 2))(q, k, v)
        return step

    seq = [S(1)]
    return Workload(
        "ring attention", grads(lambda q, k, v: dist.ring_attention(q, k, v, mesh=mesh)),
        tuple(dist.shard_tensor(x, mesh, seq) for x in (q, k, v, w)), mesh, None, [seq] * 3,
        notes="causal, sequence over 8 devices: ring of key / value blocks vs XLA's gather",
        info={"batch": b, "seq": t, "heads": h, "head_dim": dh},
        baseline_step=grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                          is_causal=True)))


# ------------------------------------------------------------------------ linear recurrence
def linear_recurrence(quick: bool = False) -> Workload:
    """A gated linear recurrence (h_t = a_t h_{t-1} + b_t, Mamba / S5's scan) over a sequence
    split by batch (dp) and sequence (mp), forward and backward: `dist.associative_scan`
    against plain jax.jit of `jax.lax.associative_scan` from the same placements. The blocked
    scan moves one row of block totals per device; no closed form is claimed."""
    b, t, d = (4, 64, 16) if quick else (16, 4096, 256)
    mesh = mesh_2x4()
    rng = np.random.default_rng(7)
    a = rng.uniform(0.5, 1.0, (b, t, d)).astype(np.float32)
    x, w = _normal(rng, b, t, d), _normal(rng, b, t, d)
    seq = [S(0), S(1)]

    def combine(p, q):
        return p[0] * q[0], q[0] * p[1] + q[1]

    def grads(scan):
        def step(a, x, w):
            return jax.grad(lambda a, x: jnp.sum(scan((a, x))[1] * w), argnums=(0, 1))(a, x)
        return step

    return Workload(
        "linear recurrence",
        grads(lambda e: dist.associative_scan(combine, e, axis=1, placements=seq, mesh=mesh)),
        tuple(dist.shard_tensor(v, mesh, seq) for v in (a, x, w)), mesh, None, [seq] * 2,
        notes="associative scan over the split sequence: block totals only",
        info={"batch": b, "seq": t, "d": d},
        baseline_step=grads(lambda e: jax.lax.associative_scan(combine, e, axis=1)))


__all__ = ["Workload", "keep_placements", "dp_mlp", "tp_mlp", "vocab_ce", "dropout_mlp",
           "spatial_cnn", "shifted_lm_loss", "ring_attention", "linear_recurrence", "mesh_1d",
           "mesh_2x4", "sgd"]
