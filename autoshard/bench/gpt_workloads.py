"""GPT workloads: the DP x TP train step of `gpt.py`, ZeRO-3 and sequence parallelism.

All three use the model of `gpt.py` (vocab-parallel embedding and head, causal attention,
gelu MLP, dropout); they differ in where the parameters and activations live:
- DP x TP: Megatron placements on a 2x4 (dp, mp) mesh, batch over dp (`gpt.workload`);
- ZeRO-3: every parameter stored split over 8 devices and gathered where used, each block
  under `jax.checkpoint` so that the backward gathers again instead of keeping every gathered
  parameter alive (what makes ZeRO-3 save memory);
- sequence parallel: DP x TP with the residual stream annotated split along the sequence over
  mp between the blocks (Megatron-SP), so layer norms and dropout run on sequence shards.
"""
from __future__ import annotations

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

import autoshard as dist

from . import gpt
from .analytic import (Minimum, all_gather, all_reduce, dp_gradients, megatron_blocks, nbytes,
                       reduce_scatter)
from .workloads import R, S, Workload, keep_placements, mesh_1d, mesh_2x4, sgd


def _param_leaves(params) -> list:
    return jax.tree.leaves(params)


def megatron_minimum(params, layers: int, dp: int, mp: int, stacked: bool = False) -> Minimum:
    """Megatron's collectives for the GPT step of `gpt.py` with its placements.

    Per block two all-reduces of the (B/dp, T, D) activations forward (attention and MLP
    outputs) and two backward (the inputs of the column-parallel qkv and fc); one each for the
    vocab-parallel lookup (forward) and the head's input gradient (backward); three per-row
    reductions of the vocab-sharded softmax (row max and sum forward, the row sum of the
    log-softmax cotangent backward) and the scalar loss; then each gradient reduced over dp at
    its mp-local size (the returned gradients keep the params' placements).
    """
    act, rows = nbytes((gpt.B // dp, gpt.T, gpt.D)), nbytes((gpt.B // dp, gpt.T))
    out = [all_reduce(act, mp, "embedding lookup (partial over the vocab shards)"),
           *megatron_blocks(act, mp, layers, ("qkv", "fc")),
           all_reduce(rows, mp, "softmax row max"), all_reduce(rows, mp, "softmax row sum"),
           all_reduce(rows, mp, "backward: row sum of the log-softmax cotangent"),
           all_reduce(4, dp * mp, "loss"), all_reduce(act, mp, "backward: head input gradient"),
           *dp_gradients(params, lambda path, p: isinstance(
               gpt.megatron_placements(path, p, stacked)[1], dist.Shard), dp, mp)]
    return Minimum(tuple(out), "Megatron TP collectives + dp gradient all-reduces at mp-local size")


def gpt_dp_tp(layers: int, form: str = "unrolled") -> Workload:
    """The GPT train step of `gpt.py` (optax sgd, returns params, state, loss and grads)."""
    mesh = mesh_2x4()
    step, (params, *_), args = gpt.workload(mesh, layers, form, optax.sgd(0.1))
    dp, mp = mesh.shape
    dparams, state = args[0], args[1]
    # outputs (params, optimizer state, loss, grads): params and grads keep the params' layout
    keep = keep_placements(dparams, state, [R, R], dparams)
    return Workload(f"gpt dp×tp {layers}L" + (" scan" if form == "scan" else ""), step, args, mesh,
                    megatron_minimum(params, layers, dp, mp, form == "scan"), keep,
                    info={"layers": layers, "form": form})


def _zero3_loss(mesh):
    def gather(tree):
        return jax.tree.map(lambda a: dist.reshard(a, mesh, [R]), tree)

    @jax.checkpoint
    def block(x, bp, key):
        return gpt.block(x, gather(bp), key)

    def loss(p, ids, labels, key):
        emb = gather({"wte": p["wte"], "wpe": p["wpe"]})
        x = emb["wte"][ids] + emb["wpe"][None]
        for i, bp in enumerate(p["blocks"]):
            x = block(x, bp, jax.random.fold_in(key, i))
        return gpt._head_loss(gather({"lnf": p["lnf"], "head": p["head"]}), x, labels)

    return loss


def gpt_zero3(layers: int) -> Workload:
    """ZeRO-3 over 8: params stored Shard(0), gathered per use, gradients reduce-scattered."""
    mesh = mesh_1d("dp")
    n = mesh.size
    params = gpt.init(jax.random.key(0), layers)
    loss = _zero3_loss(mesh)

    def step(p, ids, labels, key):
        value, grads = jax.value_and_grad(loss)(p, ids, labels, key)
        return sgd(p, grads), value

    dparams = jax.tree.map(lambda a: dist.shard_tensor(a, mesh, [S(0)]), params)
    ids, labels = gpt.batch(0)
    split = [S(0)]
    args = (dparams, dist.shard_tensor(ids, mesh, split), dist.shard_tensor(labels, mesh, split),
            jax.random.key(7))
    leaves = _param_leaves(params)
    block_leaves = _param_leaves(params["blocks"])
    minimum = Minimum(
        tuple(all_gather(p.nbytes, n, "forward gather") for p in leaves)
        + tuple(all_gather(p.nbytes, n, "backward re-gather (checkpointed block)")
                for p in block_leaves)
        + tuple(reduce_scatter(p.nbytes, n, "gradient") for p in leaves)
        + (all_reduce(4, n, "loss"),),
        "every param gathered forward, block params again backward, every gradient "
        "reduce-scattered into its shard")
    return Workload(f"gpt zero-3 {layers}L", step, args, mesh, minimum,
                    keep_placements(dparams, [R]),
                    info={"layers": layers})


def gpt_sequence_parallel(layers: int) -> Workload:
    """DP x TP GPT with the residual stream split along the sequence over mp (Megatron-SP).

    The baseline runs the same function with the residual constraint written for jax
    (with_sharding_constraint to P(dp, mp)), so XLA is asked for sequence parallelism too.
    """
    mesh = mesh_2x4()
    params = gpt.init(jax.random.key(0), layers)
    seq_split = NamedSharding(mesh.to_jax(), PartitionSpec("dp", "mp"))

    def ours(x):
        return dist.shard_tensor(x, mesh, [S(0), S(1)])

    def xla(x):
        return jax.lax.with_sharding_constraint(x, seq_split)

    def make_step(constrain):
        def loss(p, ids, labels, key):
            x = constrain(p["wte"][ids] + p["wpe"][None])
            for i, bp in enumerate(p["blocks"]):
                x = gpt.block(x, bp, jax.random.fold_in(key, i), constrain)
            return gpt._head_loss(p, x, labels)

        def step(p, ids, labels, key):
            value, grads = jax.value_and_grad(loss)(p, ids, labels, key)
            return sgd(p, grads), value
        return step

    dparams = jax.tree_util.tree_map_with_path(
        lambda path, x: dist.shard_tensor(x, mesh, gpt.megatron_placements(path, x, False)), params)
    ids, labels = gpt.batch(0)
    split = [S(0), R]
    args = (dparams, dist.shard_tensor(ids, mesh, split), dist.shard_tensor(labels, mesh, split),
            jax.random.key(7))
    return Workload(f"gpt seq-parallel {layers}L", make_step(ours), args, mesh, None,
                    keep_placements(dparams, [R, R]),
                    notes="no closed-form minimum claimed; compare wire bytes with the baseline",
                    info={"layers": layers}, baseline_step=make_step(xla))


__all__ = ["gpt_dp_tp", "gpt_zero3", "gpt_sequence_parallel", "megatron_minimum"]
