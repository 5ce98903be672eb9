"""The Llama-style train step of `llama.py` (adamw) with Megatron placements on a 2x4 (dp, mp)
mesh, unrolled or as a scan over stacked layers, and its analytic minimum."""
from __future__ import annotations

import optax

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


__all__ = ["llama_dp_tp", "megatron_minimum"]
