"""Spatial partitioning: a flax nnx CNN trained on images split by rows, on 8 simulated CPU devices.

The batch is split over "dp" and each image's rows over "sp" (2 × 4). Convolutions and pools
keep the rows split: each device fetches from its neighbours only the few rows its windows
reach past its block (collective-permutes, listed in the plan with their bytes and your source
line), where gathering the rows would move the whole activation. Every loss equals the
one-device run, and the step moves fewer bytes than plain jax.jit with the same input shardings.

Run:  python examples/spatial_cnn.py [--steps N]
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
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import autoshard as dist  # noqa: E402
from autoshard.hlo import collective_bytes  # noqa: E402


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.stem = nnx.Conv(3, 16, (3, 3), rngs=rngs)                   # SAME padding
        self.body = nnx.Conv(16, 16, (3, 3), rngs=rngs)
        self.down = nnx.Conv(16, 32, (3, 3), strides=(2, 2), rngs=rngs)  # rows halve
        self.head = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.stem(x)), (3, 3), strides=(2, 2), padding="SAME")
        x = x + nnx.relu(self.body(x))
        x = nnx.avg_pool(nnx.relu(self.down(x)), (3, 3), strides=(1, 1), padding="SAME")
        return self.head(x.mean(axis=(1, 2)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    steps = parser.parse_args().steps

    mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "sp"])
    graphdef, params = nnx.split(CNN(nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(params)
    tx = optax.adam(1e-2)

    def train_step(params, opt_state, images, labels):
        def loss_fn(p):
            logits = nnx.merge(graphdef, nnx.State(p))(images)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(0)
    images = rng.normal(size=(8, 32, 32, 3)).astype(np.float32)
    labels = rng.integers(0, 10, size=(8,)).astype(np.int32)

    # the only annotations: params replicated, the images split by batch (dp) and rows (sp)
    d_params = jax.tree.map(lambda v: dist.shard_tensor(v, mesh, [dist.Replicate()] * 2), params)
    d_images = dist.shard_tensor(images, mesh, [dist.Shard(0), dist.Shard(1)])
    d_labels = dist.shard_tensor(labels, mesh, [dist.Shard(0), dist.Replicate()])
    step = dist.jit(train_step)
    opt_state = tx.init(params)
    d_state = opt_state

    print(step.explain(d_params, d_state, d_images, d_labels))

    one_device = jax.jit(train_step)
    for i in range(steps):
        d_params, d_state, loss = step(d_params, d_state, d_images, d_labels)
        params, opt_state, ref = one_device(params, opt_state, images, labels)
        print(f"step {i}: loss {float(loss.numpy()):.6f} (one device {float(ref):.6f})")
        np.testing.assert_allclose(loss.numpy(), ref, rtol=1e-5)

    ours = collective_bytes(step.lower(d_params, d_state, d_images, d_labels).compile().as_text())
    jm = mesh.to_jax()
    rep = NamedSharding(jm, P())
    xla = jax.jit(train_step, in_shardings=(
        jax.tree.map(lambda _: rep, params), jax.tree.map(lambda _: rep, opt_state),
        NamedSharding(jm, P("dp", "sp")), NamedSharding(jm, P("dp")))).lower(
        params, opt_state, images, labels).compile().as_text()
    theirs = collective_bytes(xla)
    print(f"\ncollective bytes per device and step: autoshard {sum(ours.values())} "
          f"{dict(ours)}, jax.jit {sum(theirs.values())} {dict(theirs)}")
    assert sum(ours.values()) <= sum(theirs.values())
    print("every loss equals the one-device run")


if __name__ == "__main__":
    main()
