"""Seed 002 §4.1 (data parallel), §4.2 (tensor parallel) and §4.5 (to_static) with flax + optax.

    python examples/seed_parallel.py

The Paddle code of the seed, ported: an MLP whose forward marks its input with
dist.shard_tensor (§4.1) or whose weights are created sharded (§4.2), trained with
dist.shard_optimizer(AdamW) (an nnx.Optimizer, as Paddle's optimizer is built over the
model's parameters); §4.5 compiles the same model with dist.to_static and a
dist.shard_dataloader. Sizes are scaled down from the seed's (1024, 4096) for CPUs. Every loss
is checked against the same steps on one device.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import autoshard as dist  # noqa: E402

HIDDEN, FFN, SEQ, BATCH, STEPS = 64, 256, 8, 4, 5
mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])


class RandomDataset:
    def __init__(self, seq_len, hidden, num_samples=BATCH * STEPS):
        rng = np.random.default_rng(0)
        self.data = rng.uniform(size=(num_samples, seq_len, hidden)).astype("float32")

    def batches(self):
        for i in range(0, len(self.data), BATCH):
            yield self.data[i:i + BATCH]


class MlpModel(nnx.Module):
    def __init__(self, mode: str):
        rng = np.random.default_rng(1)
        w0 = rng.normal(size=(HIDDEN, FFN)).astype("float32") * 0.05
        w1 = rng.normal(size=(FFN, HIDDEN)).astype("float32") * 0.05
        if mode == "tp":  # §4.2: w0 split by columns, w1 by rows
            w0 = dist.shard_tensor(w0, mesh, [dist.Shard(1)])
            w1 = dist.shard_tensor(w1, mesh, [dist.Shard(0)])
        self.w0, self.w1 = nnx.Param(w0), nnx.Param(w1)
        self.mode = mode

    def __call__(self, x):
        if self.mode == "dp":  # §4.1: mark the data as split along the batch dim
            x = dist.shard_tensor(x, mesh, [dist.Shard(0)])
        y = jnp.matmul(x, self.w0[...])
        return jnp.matmul(y, self.w1[...])


def train_eagerly(mode: str) -> list[float]:
    """The seed's loop — logits = model(data); loss = mean(logits); backward; opt.step()."""
    model = MlpModel(mode)
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    params = jax.tree.map(lambda p: p if isinstance(p, dist.DistTensor)
                          else dist.shard_tensor(p, mesh, [dist.Replicate()]), params,
                          is_leaf=lambda p: isinstance(p, dist.DistTensor))
    # Paddle: opt = AdamW(learning_rate=0.001, parameters=model.parameters()); shard_optimizer(opt)
    opt = dist.shard_optimizer(nnx.Optimizer(model, optax.adamw(learning_rate=0.001), wrt=nnx.Param))
    state = opt.init(params)

    @dist.jit
    def step(params, state, data):
        def loss_fn(p):
            return jnp.mean(nnx.merge(graphdef, nnx.State(p))(data))
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for data in RandomDataset(SEQ, HIDDEN).batches():
        params, state, loss = step(params, state, data)
        losses.append(float(loss.numpy()))
    return losses


def train_static() -> list[float]:
    """§4.5: dist_model = dist.to_static(model, dataloader, paddle.mean, opt)."""
    model = MlpModel("tp")
    dataloader = dist.shard_dataloader(list(RandomDataset(SEQ, HIDDEN).batches()), meshes=mesh)
    opt = dist.shard_optimizer(nnx.Optimizer(model, optax.adamw(learning_rate=0.001), wrt=nnx.Param))
    dist_model = dist.to_static(model, dataloader, jnp.mean, opt)

    dist_model.train()
    losses = []
    for step, inputs in enumerate(dataloader()):
        data = inputs
        loss = dist_model(data)
        losses.append(float(loss.numpy()))
    return losses


def one_device() -> list[float]:
    model = MlpModel("single")
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    tx = optax.adamw(learning_rate=0.001)
    state = tx.init(params)

    @jax.jit
    def step(params, state, data):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(nnx.merge(graphdef, nnx.State(p))(data)))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for data in RandomDataset(SEQ, HIDDEN).batches():
        params, state, loss = step(params, state, data)
        losses.append(float(loss))
    return losses


def main() -> None:
    reference = one_device()
    for name, losses in [("§4.1 data parallel", train_eagerly("dp")),
                         ("§4.2 tensor parallel", train_eagerly("tp")),
                         ("§4.5 to_static", train_static())]:
        print(f"{name:<22} losses {[round(v, 6) for v in losses]}")
        np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-6)
    print(f"{'one device':<22} losses {[round(v, 6) for v in reference]}")
    print("every loss equals the one-device run")


if __name__ == "__main__":
    main()
