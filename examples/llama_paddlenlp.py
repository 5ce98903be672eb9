"""A Llama (flax nnx) placed by PaddleNLP's parallelize plan and trained through to_static, on
8 simulated CPU devices.

The model has Llama's parts — RMSNorm, rotary position embedding, grouped-query attention,
SwiGLU — and PaddleNLP's module names, so the plan is the one a PaddleNLP user writes: the
embedding column-parallel with its output gathered, q/k/v/gate/up column-parallel, o/down
row-parallel, the head split along the vocabulary, written for Paddle's `weight` names; the
batch over "dp" with ZeRO-1 (`dp_config`). With `--sp` the plan adds sequence parallelism
between the layers (PaddleNLP's `sp_config`); with `--pp` the mesh is 2 × 2 × 2 (pp, dp, mp)
and `pp_config` cuts the decoder layers into two pipeline stages, run 1F1B over two
micro-batches; with `--cp all2all|p2p|ring` the mesh is 2 × 2 × 2 (dp, sep, mp) and Paddle's
context-parallel plans split the token sequence over "sep" (Ulysses, the keys and values
gathered for each device's queries, or the attention swapped for `dist.ring_attention`).
Every loss equals the one-device run.

Run:  python examples/llama_paddlenlp.py [--steps N] [--sp] [--pp] [--cp all2all|p2p|ring]
"""
import argparse
import os

# Simulated devices must be requested before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import autoshard as dist  # noqa: E402
from autoshard.testing import ce_step, nnx_apply, token_streams  # noqa: E402

VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, SEQ, BATCH = 128, 64, 8, 4, 128, 2, 32, 8
HEAD_DIM = HIDDEN // HEADS


def rope(x):
    """Rotate each head's two halves by angles that grow with the position ([b, s, h, d])."""
    half = HEAD_DIM // 2
    angle = jnp.arange(x.shape[1])[:, None] * 10000.0 ** (-jnp.arange(half) / half)
    sin, cos = jnp.sin(angle)[None, :, None], jnp.cos(angle)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class ScaledDotProductAttention(nnx.Module):
    """Causal attention of q, k, v ([batch, seq, heads, head_dim]); its own layer so that a
    plan can name it (`ContextParallel` on "*.sdpa", as in Paddle's example)."""

    def __call__(self, q, k, v):
        s = q.shape[1]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HEAD_DIM)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


class RingAttention(nnx.Module):
    """The same attention as a ring over "sep" (`dist.ring_attention`): key / value blocks
    passed around the devices, causal work balanced — what Paddle's "p2p" context parallelism
    runs inside its sdpa kernel. Swapped in for `ScaledDotProductAttention` with `--cp ring`."""

    def __call__(self, q, k, v):
        return dist.ring_attention(q, k, v)  # the mesh: set_mesh's


class Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        def proj(n_in, n_out):
            return nnx.Linear(n_in, n_out, use_bias=False, rngs=rngs)
        self.q_proj, self.o_proj = proj(HIDDEN, HEADS * HEAD_DIM), proj(HEADS * HEAD_DIM, HIDDEN)
        self.k_proj, self.v_proj = (proj(HIDDEN, KV_HEADS * HEAD_DIM) for _ in range(2))
        self.sdpa = ScaledDotProductAttention()

    def __call__(self, x):
        b, s, _ = x.shape
        q = rope(self.q_proj(x).reshape(b, s, HEADS, HEAD_DIM))
        k = rope(self.k_proj(x).reshape(b, s, KV_HEADS, HEAD_DIM))
        v = self.v_proj(x).reshape(b, s, KV_HEADS, HEAD_DIM)
        # grouped-query attention: each key-value head serves HEADS // KV_HEADS query heads
        k, v = (jnp.repeat(t, HEADS // KV_HEADS, axis=2) for t in (k, v))
        return self.o_proj(self.sdpa(q, k, v).reshape(b, s, HEADS * HEAD_DIM))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.gate_proj = nnx.Linear(HIDDEN, FFN, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(HIDDEN, FFN, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(FFN, HIDDEN, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.input_layernorm = nnx.RMSNorm(HIDDEN, rngs=rngs)
        self.self_attn = Attention(rngs)
        self.post_attention_layernorm = nnx.RMSNorm(HIDDEN, rngs=rngs)
        self.mlp = MLP(rngs)

    def __call__(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(VOCAB, HIDDEN, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(HIDDEN, rngs=rngs)

    def __call__(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.llama = LlamaModel(rngs)
        self.lm_head = nnx.Linear(HIDDEN, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        return self.lm_head(self.llama(ids))


def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def dist_config(sp: bool, pp: bool = False, cp: str | None = None) -> dict:
    """PaddleNLP's Llama plans (its `mp_config` / `sp_config`, `pp_config`), in Paddle's API."""
    layers = "llama.layers.*"
    plan = {f"{layers}.self_attn.q_proj": dist.ColWiseParallel(),
            f"{layers}.self_attn.k_proj": dist.ColWiseParallel(),
            f"{layers}.self_attn.v_proj": dist.ColWiseParallel(),
            f"{layers}.self_attn.o_proj": dist.RowWiseParallel(),
            f"{layers}.mlp.gate_proj": dist.ColWiseParallel(),
            f"{layers}.mlp.up_proj": dist.ColWiseParallel(),
            f"{layers}.mlp.down_proj": dist.RowWiseParallel(),
            "lm_head.weight": dist.ColWiseParallel()}
    if sp:
        plan |= {"llama.embed_tokens": [dist.ColWiseParallel(), dist.SequenceParallelBegin()],
                 f"{layers}.self_attn": dist.SequenceParallelDisable(),
                 f"{layers}.mlp": dist.SequenceParallelDisable(need_transpose=False),
                 "lm_head": dist.SequenceParallelEnd()}
    else:
        plan["llama.embed_tokens"] = dist.ColWiseParallel(gather_output=True)
    config = {"mp_config": {"parallelize_plan": plan}, "dp_config": {"sharding_level": 1}}
    if cp == "ring":  # the inputs split on the sequence; the ring places its own blocks
        config["cp_config"] = {"parallelize_plan": {"llama": dist.PrepareContextParallel("p2p")}}
    elif cp:  # context parallel: the token sequence split over "sep" (Paddle's plans)
        config["cp_config"] = {"parallelize_plan": {
            "llama": dist.PrepareContextParallel(cp),
            f"{layers}.self_attn.sdpa": dist.ContextParallel(cp)}}
    if pp:
        config["pp_config"] = {"split_spec": "llama.layers"}
    return config


def batches(steps: int):
    """Token streams that mostly follow t' = (3t + 1) mod VOCAB: learnable, a little noisy."""
    return token_streams(steps, BATCH, SEQ, VOCAB, mul=3, add=1)


def one_device_losses(steps: int, tx) -> list[float]:
    """The same training on one device: plain jax.jit of the step on the unplaced params."""
    graphdef, params = nnx.split(LlamaForCausalLM(nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(params)
    step = jax.jit(ce_step(nnx_apply(graphdef), tx))  # optax's integer-label cross-entropy
    state, losses = tx.init(params), []
    for ids, labels in batches(steps):
        params, state, value = step(params, state, ids, labels)
        losses.append(float(value))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sp", action="store_true", help="sequence parallel between the layers")
    parser.add_argument("--pp", action="store_true", help="two pipeline stages (2 × 2 × 2 mesh)")
    parser.add_argument("--cp", choices=["all2all", "p2p", "ring"],
                        help="context parallel over 'sep' (2 × 2 × 2 dp, sep, mp mesh)")
    args = parser.parse_args()

    if args.cp:
        mesh = dist.ProcessMesh(np.arange(8).reshape(2, 2, 2), dim_names=["dp", "sep", "mp"])
        stages, strategy = mesh, None
    elif args.pp:
        mesh = dist.ProcessMesh(np.arange(8).reshape(2, 2, 2), dim_names=["pp", "dp", "mp"])
        stages = [mesh["pp", 0], mesh["pp", 1]]  # the batch enters the first, labels the last
        strategy = dist.Strategy({"pipeline": {"enable": True, "schedule_mode": "1F1B",
                                               "accumulate_steps": 2}})
    else:
        mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
        stages, strategy = mesh, None
    dist.auto_parallel.set_mesh(mesh)  # parallelize (mesh=None) takes it, as in Paddle
    tx = optax.adamw(3e-3)
    model = LlamaForCausalLM(nnx.Rngs(0))
    if args.cp == "ring":
        for layer in model.llama.layers:
            layer.self_attn.sdpa = RingAttention()
    model, optimizer = dist.parallelize(model, tx,
                                        config=dist_config(args.sp, args.pp, args.cp))
    loader = dist.shard_dataloader(list(batches(args.steps)), meshes=stages, shard_dims="dp")
    dist_model = dist.to_static(model, loader, loss_fn, optimizer, strategy)

    first = next(iter(loader))
    kind = (f"context ({args.cp}) and tensor" if args.cp else
            "sequence" if args.sp else "tensor")
    print(f"plan of one training step ({kind} parallel, "
          f"ZeRO-1 over dp{', two 1F1B pipeline stages' if args.pp else ''}, on "
          f"{' × '.join(map(str, mesh.shape))}):")
    print(dist_model.summary(*first))

    dist_model.train()
    losses = [float(dist_model(ids, labels).numpy()) for ids, labels in loader]
    reference = one_device_losses(args.steps, tx)
    for i in range(0, args.steps, max(1, args.steps // 5)):
        print(f"step {i}: loss {losses[i]:.6f} (one device {reference[i]:.6f})")
    np.testing.assert_allclose(losses, reference, rtol=2e-5)
    assert losses[-1] < losses[0], "the model did not learn"
    print("every loss equals the one-device run")


if __name__ == "__main__":
    main()
