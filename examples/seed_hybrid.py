"""Seed 002 §4.4 (3D hybrid: data, tensor and pipeline parallel) with flax + optax.

    python examples/seed_hybrid.py
    python -m autoshard.launch --nproc 2 --devices 4 examples/seed_hybrid.py

The Paddle code of the seed, ported: an MLP whose w0 lives on mesh0 = [[0, 1], [2, 3]] split
by columns and whose w1 lives on mesh1 = [[4, 5], [6, 7]] split by rows; the batch is split
over mesh dim 'x' (data parallel), the weights over 'y' (tensor parallel), and the forward
crosses from mesh0 to mesh1 at the seed's `dist.reshard(y, mesh1, [Shard(0), Shard(2)])`
(pipeline parallel). Trained three ways with dist.shard_optimizer(AdamW):
- as the seed writes it (`train_as_written`): the forward with its reshard inside one
  dist.jit train step, which dist.jit cuts into a program per stage (forward on mesh0; forward,
  backward and w1's update on mesh1; backward and w0's update on mesh0);
- compiled by `dist.to_static` with Paddle's `strategy.pipeline` (`train_pipelined`): those
  stages run 1F1B over 2 micro-batches per step;
- as explicit stages (`train_hybrid`): the forward cut by hand at that reshard, one function
  per mesh, run by dist.StageRunner (what dist.PipelineRunner schedules over micro-batches).
Every loss and the final weights are checked against the same steps on one device. Sizes are
scaled down from the seed's for CPUs. Under the launcher (two processes of four devices, as two
hosts), mesh0 is process 0's devices and mesh1 process 1's: each stage runs in its own process
and the activations and gradients between them move from process to process.
"""
import os
from typing import NamedTuple

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import autoshard as dist  # noqa: E402

dist.init_parallel_env()  # under `python -m autoshard.launch`; alone, nothing to join

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

HIDDEN, FFN, SEQ, BATCH, STEPS = 64, 256, 16, 4, 5

mesh0 = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
mesh1 = dist.ProcessMesh([[4, 5], [6, 7]], dim_names=["x", "y"])


class RandomDataset:
    def __init__(self, seq_len, hidden, num_samples=BATCH * STEPS):
        self.seq_len, self.hidden, self.num_samples = seq_len, hidden, num_samples

    def __getitem__(self, index):
        rng = np.random.default_rng(index)  # seeded per sample so every run sees the same data
        input = rng.uniform(size=[self.seq_len, self.hidden]).astype("float32")
        label = rng.uniform(size=[self.seq_len, self.hidden]).astype("float32")
        return input, label

    def __len__(self):
        return self.num_samples


def data_loader(dataset, batch_size):
    """paddle.io.DataLoader(dataset, batch_sampler=BatchSampler(dataset, batch_size)): stacked
    (inputs, labels) batches."""
    for start in range(0, len(dataset), batch_size):
        samples = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        yield tuple(np.stack(column) for column in zip(*samples))


class MlpModel(nnx.Module):
    def __init__(self, placed: bool = True):
        rng = np.random.default_rng(1)
        w0 = rng.normal(size=(HIDDEN, FFN)).astype("float32") * 0.05
        w1 = rng.normal(size=(FFN, HIDDEN)).astype("float32") * 0.05
        if placed:
            w0 = dist.shard_tensor(w0, mesh0, [dist.Replicate(), dist.Shard(1)])  # column split
            w1 = dist.shard_tensor(w1, mesh1, [dist.Replicate(), dist.Shard(0)])  # row split
        self.w0, self.w1 = nnx.Param(w0), nnx.Param(w1)

    def __call__(self, x):
        return forward({"w0": self.w0[...], "w1": self.w1[...]}, x)


def forward(params, x):
    """The seed's MlpModel.forward, line for line."""
    y = jnp.matmul(x, params["w0"])
    y = dist.reshard(y, mesh1, [dist.Shard(0), dist.Shard(2)])  # pipeline parallel
    z = jnp.matmul(y, params["w1"])
    return z


def train_as_written(steps: int = STEPS) -> tuple[list[float], dict]:
    """The seed's loop, its forward as written: dist.jit cuts the step at the reshard."""
    model = MlpModel()
    dataset = RandomDataset(SEQ, HIDDEN, num_samples=BATCH * steps)
    dataloader = dist.shard_dataloader(data_loader(dataset, BATCH), meshes=[mesh0, mesh1],
                                       shard_dims="x")
    opt = dist.shard_optimizer(optax.adamw(learning_rate=0.001))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    state = opt.init(params)  # each moment on its weight's mesh, placed like it

    @dist.jit
    def step(params, state, data):
        def loss_fn(params):
            logits = forward(params, data)  # logits = model(data)
            return jnp.mean(logits)         # loss = paddle.mean(logits)
        loss, grads = jax.value_and_grad(loss_fn)(params)  # loss.backward()
        updates, state = opt.update(grads, state, params)  # opt.step()
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for inputs in dataloader():
        params, state, loss = step(params, state, inputs[0])
        losses.append(float(loss.numpy()))
    return losses, params


def train_pipelined(steps: int = STEPS) -> tuple[list[float], dict]:
    """The seed's model compiled by `dist.to_static` with Paddle's `strategy.pipeline`: the
    stages cut at the reshard run 1F1B over 2 micro-batches per step."""
    model = MlpModel()
    dataset = RandomDataset(SEQ, HIDDEN, num_samples=BATCH * steps)
    dataloader = dist.shard_dataloader(data_loader(dataset, BATCH), meshes=[mesh0, mesh1],
                                       shard_dims="x")
    strategy = dist.Strategy({"pipeline": {"enable": True, "schedule_mode": "1F1B",
                                           "accumulate_steps": 2}})
    dm = dist.to_static(model, dataloader, lambda logits, _label: jnp.mean(logits),
                        dist.shard_optimizer(optax.adamw(learning_rate=0.001)), strategy)
    losses = [float(dm(data, label).numpy()) for data, label in dataloader()]
    return losses, {"w0": model.w0[...], "w1": model.w1[...]}


# The seed's forward, cut at its `y = dist.reshard(y, mesh1, [Shard(0), Shard(2)])`; the
# StageRunner does that reshard between the two (and the reverse one for the gradient).
def stage0(params, x):
    return jnp.matmul(x, params["w0"])  # y = paddle.matmul(x, self.w0)


def stage1(params, y):
    z = jnp.matmul(y, params["w1"])  # z = paddle.matmul(y, self.w1)
    return jnp.mean(z)               # loss = paddle.mean(logits)


STAGES = [dist.Stage(stage0, mesh0),
          dist.Stage(stage1, mesh1, in_placements=[dist.Shard(0), dist.Shard(2)])]


def split_by_stage(params: dict) -> list[dict]:
    return [{"w0": params["w0"]}, {"w1": params["w1"]}]


class HybridRun(NamedTuple):
    losses: list[float]
    params: list[dict]            # per stage, on its mesh
    states: list[optax.OptState]  # per stage, the AdamW state beside its params
    runner: dist.StageRunner


def train_hybrid(steps: int = STEPS) -> HybridRun:
    """The seed's training loop."""
    model = MlpModel()
    dataset = RandomDataset(SEQ, HIDDEN, num_samples=BATCH * steps)
    dataloader = dist.shard_dataloader(data_loader(dataset, BATCH), meshes=[mesh0, mesh1],
                                       shard_dims="x")
    # Paddle: opt = AdamW(learning_rate=0.001, parameters=model.parameters()); shard_optimizer(opt)
    opt = dist.shard_optimizer(nnx.Optimizer(model, optax.adamw(learning_rate=0.001),
                                             wrt=nnx.Param))
    params = split_by_stage(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    states = [opt.init(p) for p in params]  # each stage's moments on its mesh, placed as its params
    runner = dist.StageRunner(STAGES)

    @dist.jit  # one program per mesh: its cache is keyed by the inputs' meshes and layouts
    def opt_step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    losses = []
    for step, inputs in enumerate(dataloader()):
        data = inputs[0]  # inputs[1], the label, arrived on mesh1; the seed's loss ignores it
        loss, grads = runner.value_and_grad(params, data)  # model(data); mean; loss.backward()
        params, states = map(list, zip(*[opt_step(p, s, g)  # opt.step(); opt.clear_grad()
                                         for p, s, g in zip(params, states, grads)]))
        losses.append(float(loss.numpy()))
    return HybridRun(losses, params, states, runner)


def one_device(steps: int = STEPS):
    """The same steps with plain jax + optax on one device: the losses and the final params."""
    params = nnx.to_pure_dict(nnx.state(MlpModel(placed=False), nnx.Param))
    tx = optax.adamw(learning_rate=0.001)
    state = tx.init(params)

    @jax.jit
    def step(params, state, data):
        loss, grads = jax.value_and_grad(lambda p: stage1(p, stage0(p, data)))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for data, _label in data_loader(RandomDataset(SEQ, HIDDEN, num_samples=BATCH * steps), BATCH):
        params, state, loss = step(params, state, data)
        losses.append(float(loss))
    return losses, split_by_stage(params)


def main() -> None:
    reference, ref_params = one_device()
    written, written_params = train_as_written()
    print(f"{'§4.4 as written':<16} losses {[round(v, 6) for v in written]}")
    np.testing.assert_allclose(written, reference, rtol=1e-5, atol=1e-6)
    for name, ref in {**ref_params[0], **ref_params[1]}.items():
        np.testing.assert_allclose(written_params[name].numpy(), ref, rtol=1e-4, atol=1e-6)
    pipelined, pipelined_params = train_pipelined()
    print(f"{'§4.4 pipelined':<16} losses {[round(v, 6) for v in pipelined]}")
    np.testing.assert_allclose(pipelined, reference, rtol=1e-5, atol=1e-6)
    for name, ref in {**ref_params[0], **ref_params[1]}.items():
        np.testing.assert_allclose(pipelined_params[name].numpy(), ref, rtol=1e-4, atol=1e-6)
    losses, params, _, _ = train_hybrid()
    print(f"{'§4.4 as stages':<16} losses {[round(v, 6) for v in losses]}")
    print(f"{'one device':<16} losses {[round(v, 6) for v in reference]}")
    for stage, (p, ref) in enumerate(zip(params, ref_params)):
        for name in p:
            print(f"stage {stage} {name}: {p[name].mesh.process_ids} {p[name].placements}")
            np.testing.assert_allclose(p[name].numpy(), ref[name], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-6)
    print("every loss and weight equals the one-device run")


if __name__ == "__main__":
    main()
