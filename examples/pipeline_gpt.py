"""A flax transformer in 3-D parallel — pipeline × data × tensor — from Paddle's dist.parallelize.

    python examples/pipeline_gpt.py
    python -m autoshard.launch --nproc 2 --devices 4 examples/pipeline_gpt.py

The model is written for one device with flax's own layers (nnx.Embed, nnx.MultiHeadAttention,
LayerNorm, RMSNorm, Linear). `dist.parallelize` with a mesh of dims (pp, dp, mp) = (2, 2, 2)
places it: `pp_config` cuts the block list into two stages (embeddings join the first, the
final norm and head the last), `mp_config` makes attention and MLP Megatron column/row
parallel inside each stage, `dp_config` adds ZeRO-1. `dist.to_static` with Paddle's
`strategy.pipeline` runs the stages 1F1B over 4 micro-batches, with dropout in every block:
each stage's dropout streams advance once per micro-batch. Under the launcher each stage lives
in its own process (two "hosts"). Every loss and weight is checked against the same steps on
one device accumulating gradients over the same 4 micro-batches; the DistModel's summary
(schedule, per-micro-batch moves and collectives) and a measured profile of the stages are
printed.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import autoshard as dist  # noqa: E402

dist.init_parallel_env()  # under `python -m autoshard.launch`; alone, nothing to join

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

VOCAB, D, HEADS, LAYERS, SEQ, BATCH, STEPS = 64, 32, 4, 4, 8, 16, 4
MICRO, DP, DROPOUT = 4, 2, 0.1


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        # no biases (as Llama): a key bias has an exactly-zero gradient (softmax ignores a
        # per-row shift), which AdamW would turn into steps of rounding noise
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False,
                                           use_bias=False, rngs=rngs)
        self.ln2 = nnx.RMSNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, 4 * D, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, rngs=rngs)
        self.drop = nnx.Dropout(DROPOUT, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.drop(self.down(jax.nn.gelu(self.up(self.ln2(x)))))


class GPT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.wte = nnx.Embed(VOCAB, D, rngs=rngs)
        self.wpe = nnx.Param(jax.random.normal(rngs.params(), (SEQ, D)) * 0.02)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        x = self.wte(ids) + self.wpe[...][None]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def batches():
    rng = np.random.default_rng(0)
    return [(rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32),
             rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)) for _ in range(STEPS)]


MESH = dist.ProcessMesh(np.arange(8).reshape(2, 2, 2), dim_names=["pp", "dp", "mp"])
CONFIG = {
    "dp_config": {"sharding_level": 1},
    "mp_config": {"parallelize_plan": {
        "*.attn.query": dist.ColWiseParallel(), "*.attn.key": dist.ColWiseParallel(),
        "*.attn.value": dist.ColWiseParallel(), "*.attn.out": dist.RowWiseParallel(),
        "*.up": dist.ColWiseParallel(), "*.down": dist.RowWiseParallel(),
        "head": dist.ColWiseParallel()}},
    "pp_config": {"split_spec": "blocks"},
}


def train():
    model, opt = dist.parallelize(GPT(nnx.Rngs(0)), optax.adamw(3e-3), MESH, CONFIG)
    loader = dist.shard_dataloader(batches(), meshes=[MESH["pp", 0], MESH["pp", -1]],
                                   shard_dims="dp")
    strategy = dist.Strategy({"pipeline": {"enable": True, "schedule_mode": "1F1B",
                                           "accumulate_steps": MICRO}})
    dm = dist.to_static(model, loader, loss_fn, opt, strategy)
    losses = [float(dm(ids, labels).numpy()) for ids, labels in loader()]
    print(dm.summary(*batches()[0]))  # the schedule, what crosses per micro-batch, collectives
    print(dm.profile(*batches()[0], steps=1))  # each stage measured: is the split balanced?
    return model, losses


def micro_batch(x, i: int):
    """Micro-batch i as the pipeline cuts it: the i-th quarter of each dp shard's rows."""
    return x.reshape(DP, MICRO, -1, *x.shape[1:])[:, i].reshape(-1, *x.shape[1:])


def one_device():
    """The same steps on one device: the micro-batches one after another (each drawing the
    next dropout masks), then one AdamW update with the mean gradient."""
    model = GPT(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    grad = nnx.jit(lambda m, ids, labels: nnx.value_and_grad(
        lambda m: loss_fn(m(ids), labels))(m))
    update = nnx.jit(lambda m, o, g: o.update(m, g))

    def step(ids, labels):
        losses, total = [], None
        for i in range(MICRO):
            loss, g = grad(model, micro_batch(ids, i), micro_batch(labels, i))
            losses.append(float(loss))
            total = g if total is None else jax.tree.map(jnp.add, total, g)
        update(model, opt, jax.tree.map(lambda t: t / MICRO, total))
        return float(np.mean(losses))

    with jax.default_device(jax.local_devices()[0]):
        return model, [step(ids, labels) for ids, labels in batches()]


def params(model) -> dict:
    return {".".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}


def main() -> None:
    model, losses = train()
    ref, ref_losses = one_device()
    for name in ("wte.embedding", "blocks.0.up.kernel", "blocks.3.attn.out.kernel",
                 "head.kernel"):
        value = params(model)[name].get_value()
        print(f"{name:<26} stage mesh {value.mesh.process_ids} {value.placements}")
    print(f"{'pipelined':<10} losses {[round(v, 5) for v in losses]}")
    print(f"{'one device':<10} losses {[round(v, 5) for v in ref_losses]}")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    ref_params = params(ref)
    for name, p in params(model).items():
        np.testing.assert_allclose(p.get_value().numpy(), np.asarray(ref_params[name][...]),
                                   rtol=1e-3, atol=2e-5, err_msg=name)
    print("every loss and weight equals the one-device run")


if __name__ == "__main__":
    main()
