"""Two processes, one 2×4 mesh: data parallel across the processes, tensor parallel inside.

    python -m autoshard.launch --nproc 2 --devices 4 examples/multiprocess.py

Each process simulates 4 CPU devices; `dist.init_parallel_env()` joins them into one jax
runtime, so the mesh [[0, 1, 2, 3], [4, 5, 6, 7]] (global ranks) has one data-parallel row per
process and a tensor-parallel MLP inside each. Every process feeds only its own half of each
batch (`shard_dataloader(..., is_dataset_splitted=True)`), trains a few SGD steps with one
dist.jit step, and checks its losses and weights against the whole batch on one device.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import autoshard as dist  # noqa: E402

dist.init_parallel_env()  # before anything asks jax for devices

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

R, S = dist.Replicate(), dist.Shard
STEPS, BATCH, HIDDEN = 3, 8, 32
mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])


def init():
    rng = np.random.default_rng(0)
    return {"up": rng.normal(size=(HIDDEN, 4 * HIDDEN)).astype("float32") * 0.1,
            "down": rng.normal(size=(4 * HIDDEN, HIDDEN)).astype("float32") * 0.1}


def batches():
    rng = np.random.default_rng(1)
    return [(rng.normal(size=(BATCH, HIDDEN)).astype("float32"),
             rng.normal(size=(BATCH, HIDDEN)).astype("float32")) for _ in range(STEPS)]


def loss_fn(p, x, y):
    return jnp.mean((jax.nn.gelu(x @ p["up"]) @ p["down"] - y) ** 2)


tx = optax.sgd(0.1)


def step(p, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
    updates, state = tx.update(grads, state, p)
    return optax.apply_updates(p, updates), state, loss


def main() -> None:
    me, n = jax.process_index(), jax.process_count()
    params = {"up": dist.shard_tensor(init()["up"], mesh, [R, S(1)]),      # column parallel
              "down": dist.shard_tensor(init()["down"], mesh, [R, S(0)])}  # row parallel
    state = tx.init(params)
    # this process's rows of every batch: the dataset is split by process, as on a cluster
    half = BATCH // n
    mine = [(x[me * half:(me + 1) * half], y[me * half:(me + 1) * half]) for x, y in batches()]
    loader = dist.shard_dataloader(mine, meshes=mesh, shard_dims="dp", is_dataset_splitted=True)
    train = dist.jit(step)
    losses = []
    for x, y in loader():
        params, state, loss = train(params, state, x, y)
        losses.append(float(loss.numpy()))

    # the same steps on one of this process's devices, the whole batch at once
    local = jax.local_devices()[0]
    ref, ref_state = jax.device_put(init(), local), jax.device_put(tx.init(init()), local)
    ref_losses = []
    for x, y in batches():
        ref, ref_state, loss = jax.jit(step)(ref, ref_state, *jax.device_put((x, y), local))
        ref_losses.append(float(loss))
    print(f"process {me} of {n}: {jax.local_device_count()} devices of {jax.device_count()}, "
          f"losses {[round(v, 6) for v in losses]}")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name in ref:
        np.testing.assert_allclose(params[name].numpy(), np.asarray(ref[name]), rtol=1e-4,
                                   atol=1e-6)
    print(f"process {me}: every loss and weight equals the one-device run")


if __name__ == "__main__":
    main()
