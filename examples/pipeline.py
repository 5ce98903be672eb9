"""Pipeline parallel with a schedule: a 4-stage MLP on four 2-device meshes, trained with
FThenB, 1F1B, interleaved 1F1B (VPP) and zero-bubble ZBH1, each checked against one device.

    python examples/pipeline.py
    python -m autoshard.launch --nproc 2 --devices 4 examples/pipeline.py

Every stage is one dist.jit program on its own sub-mesh ("pp" rank), data parallel over the
mesh's "dp" dim; the batch is cut into micro-batches and the stages run forward and backward
in the schedule's order (dist.PipelineRunner, configured from Paddle's
`strategy.pipeline` settings). Prints each schedule's simulated bubble and peak activations,
the measured step time, the losses, which equal one device's, and a measured profile of
1F1B (each stage's forward and backward alone, per-rank busy time, the stage balance). Under the launcher, stages
0-1 live in process 0 and stages 2-3 in process 1 (global ranks 0..3 and 4..7): what crosses
between them moves between the processes.
"""
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import autoshard as dist  # noqa: E402

dist.init_parallel_env()  # under `python -m autoshard.launch`; alone, nothing to join

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from autoshard.training.schedule import table  # noqa: E402

HIDDEN, BATCH, STEPS, STAGES = 64, 16, 3, 4
R, S = dist.Replicate(), dist.Shard

# pp rank k owns devices 2k, 2k+1 as a 1-d "dp" mesh
MESHES = [dist.ProcessMesh([2 * k, 2 * k + 1], dim_names=["dp"]) for k in range(4)]


def block(params, x):
    """One stage of the model: a residual MLP block."""
    h = jax.nn.gelu(x @ params["w_in"] + params["b_in"])
    return x + h @ params["w_out"]


def head(params, x, labels):
    """The last stage: its block, then the mean squared error against the labels."""
    return jnp.mean((block(params, x) - labels) ** 2)


def init_params(n_stages: int = STAGES) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"w_in": rng.normal(size=(HIDDEN, 4 * HIDDEN)).astype("float32") * 0.1,
             "b_in": np.zeros(4 * HIDDEN, "float32"),
             "w_out": rng.normal(size=(4 * HIDDEN, HIDDEN)).astype("float32") * 0.1}
            for _ in range(n_stages)]


def batches(steps: int = STEPS):
    rng = np.random.default_rng(1)
    for _ in range(steps):
        yield (rng.normal(size=(BATCH, HIDDEN)).astype("float32"),
               rng.normal(size=(BATCH, HIDDEN)).astype("float32"))


def stages_for(chunks: int) -> list[dist.Stage]:
    """Stage s runs on pipeline rank s mod p (p = STAGES / chunks meshes)."""
    p = STAGES // chunks
    return [dist.Stage(head if s == STAGES - 1 else block, MESHES[s % p])
            for s in range(STAGES)]


def train(mode: str, micro_batches: int, chunks: int = 1, steps: int = STEPS):
    """Losses, final params (per stage) and the runner of `steps` SGD steps under `mode`."""
    strategy = dist.Strategy({"pipeline": {"enable": True, "schedule_mode": mode,
                                           "accumulate_steps": micro_batches,
                                           "vpp_degree": chunks}})
    stages = stages_for(chunks)
    runner = dist.PipelineRunner.from_strategy(stages, strategy)
    params = [{k: dist.shard_tensor(v, st.mesh, [R]) for k, v in p.items()}
              for p, st in zip(init_params(), stages)]
    tx = optax.sgd(0.1)
    states = [tx.init(p) for p in params]

    @dist.jit
    def update(p, state, g):
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state

    first, last = stages[0].mesh, stages[-1].mesh
    losses, seconds = [], []
    for x, y in batches(steps):
        t0 = time.perf_counter()
        loss, grads = runner.value_and_grad(params, dist.shard_tensor(x, first, [S(0)]),
                                            dist.shard_tensor(y, last, [S(0)]))
        params, states = map(list, zip(*[update(p, s, g)
                                         for p, s, g in zip(params, states, grads)]))
        losses.append(float(loss.numpy()))
        seconds.append(time.perf_counter() - t0)
    return losses, params, runner, seconds


def one_device(steps: int = STEPS):
    """The same SGD steps on one device, the whole batch at once."""
    params = init_params()
    tx = optax.sgd(0.1)
    state = tx.init(params)

    def loss_fn(params, x, y):
        for p in params[:-1]:
            x = block(p, x)
        return head(params[-1], x, y)

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for x, y in batches(steps):
        params, state, loss = step(params, state, x, y)
        losses.append(float(loss))
    return losses, params


RUNS = [("FThenB", 4, 1), ("1F1B", 4, 1), ("VPP", 4, 2), ("ZBH1", 4, 1)]


def main() -> None:
    reference, ref_params = one_device()
    print(f"{'one device':<22} losses {[round(v, 6) for v in reference]}")
    timelines = []
    for mode, m, chunks in RUNS:
        losses, params, runner, seconds = train(mode, m, chunks)
        timelines.append(runner.timeline)
        print(f"{mode + f' m={m} v={chunks}':<22} losses {[round(v, 6) for v in losses]}  "
              f"last step {seconds[-1] * 1e3:.1f} ms")
        np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-6)
        for p, ref in zip(params, ref_params):
            for name in ref:
                np.testing.assert_allclose(p[name].numpy(), ref[name], rtol=1e-4, atol=1e-5)
    print("\nsimulated schedules (F = 1, B = 2 or B = W = 1; per rank):")
    print(table(timelines))
    runner = dist.PipelineRunner(stages_for(1), "1F1B", 4)
    print("\n1F1B's order per rank:")
    print(runner.schedule)
    # measured: each stage's forward and backward alone, and the schedule replayed with them
    stages = stages_for(1)
    params = [{k: dist.shard_tensor(v, st.mesh, [R]) for k, v in p.items()}
              for p, st in zip(init_params(), stages)]
    x, y = next(batches(1))
    print()
    print(runner.profile(params, dist.shard_tensor(x, stages[0].mesh, [S(0)]),
                         dist.shard_tensor(y, stages[-1].mesh, [S(0)])))
    print("every loss and weight equals the one-device run")


if __name__ == "__main__":
    main()
