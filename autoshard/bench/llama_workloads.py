"""The Llama-style train step of `llama.py` (adamw) with Megatron placements on a 2x4 (dp, mp)
mesh, unrolled or as a scan over stacked layers, and its analytic minimum."""
from __future__ import annotations

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

import autoshard as dist

from . import llama
from .analytic import Minimum, all_reduce, dp_gradients, megatron_blocks, nbytes
from .workloads import Workload, mesh_2x4


def megatron_minimum(params, layers: int, dp: int, mp: int, stacked: bool = False) -> Minimum:
    """Megatron's collectives for the step of `llama.py`.

    Per block two all-reduces of the (B/dp, T, D) activations forward (attention and MLP
    outputs) and two backward (the gradients of the norms' outputs, read by the
    column-parallel q/k/v and gate/up); one for the vocab-parallel lookup and one for the
    head's input gradient; three per-row reductions of the vocab-split logits forward (the
    label's logit, the row max and the row sum of the softmax: optax's cross-entropy needs
    none backward) and the scalar loss over dp; then each gradient reduced over dp at its
    mp-local size (adamw's update is elementwise, so the state adds nothing).
    """
    act, rows = nbytes((llama.B // dp, llama.T, llama.D)), nbytes((llama.B // dp, llama.T))
    out = [all_reduce(act, mp, "embedding lookup (partial over the vocab shards)"),
           *megatron_blocks(act, mp, layers, ("q/k/v", "gate/up")),
           all_reduce(rows, mp, "label logit"), all_reduce(rows, mp, "softmax row max"),
           all_reduce(rows, mp, "softmax row sum"), all_reduce(4, dp, "loss"),
           all_reduce(act, mp, "backward: head input gradient"),
           *dp_gradients(params, lambda path, p: isinstance(
               llama.megatron_placements(path, p, stacked)[1], dist.Shard), dp, mp)]
    return Minimum(tuple(out), "Megatron TP collectives + dp gradient all-reduces at mp-local size")


def llama_dp_tp(layers: int, form: str = "unrolled") -> Workload:
    """The step returns (params, adamw state, loss); dist.jit picks the output layouts, which
    come back as the params and the state were placed."""
    mesh = mesh_2x4()
    step, (params, *_), args = llama.workload(mesh, layers, form, optax.adamw(1e-3))
    dp, mp = mesh.shape
    return Workload(f"llama dp×tp {layers}L" + (" scan" if form == "scan" else ""), step, args,
                    mesh, megatron_minimum(params, layers, dp, mp, form == "scan"),
                    info={"layers": layers, "form": form})


def llama_context_parallel(layers: int, backend: str = "all2all") -> Workload:
    """The Llama step on a 2x4 (dp, sep) mesh with the sequence split over sep (Paddle's
    context parallelism): tokens split on the sequence, the residual stream with them, params
    replicated (their gradients reduced over dp and sep). "all2all" (Ulysses): q, k, v on
    whole sequences with the heads split over sep for the attention, its output back on
    sequence shards; "p2p": q, k, v and the output stay on sequence shards (the plan brings
    the keys and values each device's queries attend to). The baseline runs the same
    function with those placements written as jax sharding constraints."""
    mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "sep"])
    S, R = dist.Shard, dist.Replicate()
    heads = [S(0), S(2) if backend == "all2all" else S(1)]
    jmesh = mesh.to_jax()
    spec = {"heads": PartitionSpec("dp", None, "sep") if backend == "all2all"
            else PartitionSpec("dp", "sep"), "seq": PartitionSpec("dp", "sep")}

    def ours(kind):
        placements = heads if kind == "heads" else [S(0), S(1)]
        return lambda t: dist.shard_tensor(t, mesh, placements)

    def xla(kind):
        return lambda t: jax.lax.with_sharding_constraint(t, NamedSharding(jmesh, spec[kind]))

    def make_step(hint):
        def loss(p, ids, labels):
            x = hint("seq")(p["embed"][ids])
            for bp in p["blocks"]:
                x = llama.block(x, bp, hint("heads"), hint("seq"))
            return llama._loss(p, x, labels)
        return llama.train_step(loss, optax.sgd(0.1))

    params = llama.init(jax.random.key(0), layers)
    dparams = jax.tree.map(lambda x: dist.shard_tensor(x, mesh, [R, R]), params)
    ids, labels = llama.batch(0)
    seq = [S(0), S(1)]
    args = (dparams, optax.sgd(0.1).init(dparams), dist.shard_tensor(ids, mesh, seq),
            dist.shard_tensor(labels, mesh, seq))
    return Workload(f"llama cp-{backend} {layers}L", make_step(ours), args, mesh, None,
                    notes="no closed-form minimum claimed; compare with the baseline",
                    info={"layers": layers, "backend": backend},
                    baseline_step=make_step(xla))


__all__ = ["llama_dp_tp", "llama_context_parallel", "megatron_minimum"]
