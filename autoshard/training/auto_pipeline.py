"""A pipeline from one loss function: the stages are cut where values change mesh.

    runner = dist.PipelineRunner.from_function(loss_fn, "1F1B", micro_batches=4)
    loss, grads = runner.value_and_grad(params, inputs, labels)

`loss_fn(params, inputs, *labels)` is written as for one device, with the seed's
`dist.reshard(y, mesh1, ...)` where the activations move to the next stage. It is traced on
the first micro-batch's shapes and cut as dist.jit cuts it (compiler/cut.py); each stage
becomes a function of the params it reads and of what earlier stages made that it or later
stages read (values a stage only passes on ride along), and a PipelineRunner schedules them.
Gradients come back as one tree like `params` (a param read by two stages gets both parts).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..compiler.cut import arrive, cut_by_mesh, eval_eqns
from ..compiler.jit import _describe_leaf
from ..dtensor import DistTensor
from ..reshard.api import reshard
from .pipeline import PipelineRunner, _add, _is_leaf
from .schedule import Schedule
from .stages import Stage, StageError


class FunctionPipeline:
    """A PipelineRunner over the stages of one loss function (see the module docstring)."""

    def __init__(self, fn, schedule: str | Schedule = "1F1B", micro_batches: int = 1, *,
                 chunks: int = 1, costs: dict | None = None, recompute: bool = False):
        self.fn = fn
        self._options = (schedule, micro_batches, chunks, costs)
        self.recompute = recompute
        self._runners: dict = {}

    def value_and_grad(self, params: Any, inputs: Any, *loss_args: Any):
        runner, split = self._runner(params, inputs, loss_args)
        loss, grads = runner.value_and_grad(split(params), inputs, *loss_args)
        return loss, runner.join(grads, params)

    def explain(self, params: Any, inputs: Any, *loss_args: Any) -> str:
        """PipelineRunner.explain of the cut stages."""
        runner, split = self._runner(params, inputs, loss_args)
        return runner.explain(split(params), inputs, *loss_args)

    def profile(self, params: Any, inputs: Any, *loss_args: Any, steps: int = 3):
        """PipelineRunner.profile of the cut stages."""
        from .pipeline_profile import measure

        runner, split = self._runner(params, inputs, loss_args)
        return measure(runner, lambda: runner.value_and_grad(split(params), inputs, *loss_args),
                       steps)

    def forward(self, params: Any, inputs: Any, *loss_args: Any):
        runner, split = self._runner(params, inputs, loss_args)
        return runner.forward(split(params), inputs, *loss_args)

    # -- building ------------------------------------------------------------------------------
    def _runner(self, params, inputs, loss_args):
        schedule, m, chunks, costs = self._options
        p_leaves, p_tree = jax.tree.flatten(params, is_leaf=_is_leaf)
        i_leaves, i_tree = jax.tree.flatten(inputs, is_leaf=_is_leaf)
        a_leaves, a_tree = jax.tree.flatten(loss_args, is_leaf=_is_leaf)
        # traced on one micro-batch: what each stage program will see
        micro = [_micro_aval(x, m) for x in i_leaves + a_leaves]
        described = tuple(_describe_leaf(x) for x in p_leaves) + tuple(micro)
        key = (p_tree, i_tree, a_tree, described)
        if key not in self._runners:
            self._runners[key] = self._build(p_leaves, p_tree, i_tree, a_tree, described)
        runner = self._runners[key]
        return runner, runner.split

    def _build(self, p_leaves, p_tree, i_tree, a_tree, described):
        schedule, m, chunks, costs = self._options
        n_p, n_i = len(p_leaves), i_tree.num_leaves

        def flat(*leaves):
            params = jax.tree.unflatten(p_tree, leaves[:n_p])
            inputs = jax.tree.unflatten(i_tree, leaves[n_p:n_p + n_i])
            args = jax.tree.unflatten(a_tree, leaves[n_p + n_i:])
            return [self.fn(params, inputs, *args)]

        avals = [jax.ShapeDtypeStruct(d.shape, d.dtype) for d in described]
        closed = jax.make_jaxpr(flat)(*avals)
        cut = cut_by_mesh(closed, [d.mesh for d in described])
        return _CutRunner(cut, n_p, n_i, p_tree, schedule, m, chunks, costs, self.recompute)


def _micro_aval(x, m: int):
    """A batch leaf as one micro-batch sees it (dim 0 / m), keeping its mesh and layout."""
    shape = tuple(np.shape(x))
    if shape and shape[0] % m == 0:
        shape = (shape[0] // m,) + shape[1:]
    d = _describe_leaf(x)
    return type(d)(shape, d.dtype, d.mesh, d.layout)


class _CutRunner(PipelineRunner):
    """PipelineRunner whose stages come from a cut; activations are tuples of values."""

    def __init__(self, cut, n_params: int, n_inputs: int, p_tree, schedule, m, chunks, costs,
                 recompute: bool = False):
        parts = cut.stages
        if not parts or len(cut.outvars) != 1:
            raise StageError("a pipeline loss function returns one scalar loss computed on the "
                             "meshes of its params")
        invars = cut.invars
        params_vars = invars[:n_params]
        input_vars = set(invars[n_params:n_params + n_inputs])
        arg_vars = set(invars[n_params + n_inputs:])
        made_in = {v: k for k, part in enumerate(parts) for e in part.eqns for v in e.outvars
                   if v not in cut.free_results}
        last = len(parts) - 1
        self._reads: list[list[int]] = []   # per stage: indices of the params it reads
        carries: list[list] = []           # carry out of stage k: values later stages read
        for k, part in enumerate(parts):
            reads = [j for j, v in enumerate(params_vars) if v in part.inputs]
            self._reads.append(reads)
            for v in part.inputs:
                if v in input_vars and k != 0:
                    raise StageError(f"stage {k} reads the batch inputs: only the first stage "
                                     f"may (pass what later stages need through the "
                                     f"activations)")
        for k in range(len(parts)):
            later = {v for part in parts[k + 1:] for v in part.inputs}
            carries.append([v for v in dict.fromkeys(v for part in parts[:k + 1]
                                                      for e in part.eqns for v in e.outvars)
                            if v in later and made_in.get(v, -1) <= k])
        # the loss arguments go to every stage that reads them (label preprocessing that reads
        # nothing else lands in the first stage on the label's mesh); the last always takes them
        self._arg_readers = {k for k, part in enumerate(parts)
                             if any(v in arg_vars for v in part.inputs)} | {last}
        self._carries, self._made_by, self._n_params = carries, cut, n_params
        self._p_tree = p_tree
        stages = [Stage(_stage_fn(cut, part, k, params_vars, self._reads[k],
                                  carries[k - 1] if k else [],
                                  invars[n_params:n_params + n_inputs] if k == 0 else [],
                                  invars[n_params + n_inputs:] if k in self._arg_readers
                                  else [],
                                  cut.outvars if k == last else carries[k]),
                        part.mesh) for k, part in enumerate(parts)]
        super().__init__(stages, schedule, m, chunks=chunks, costs=costs, recompute=recompute)

    def _reads_args(self, s: int) -> bool:
        return s in self._arg_readers

    def split(self, params: Any) -> list:
        """Per stage, the params it reads — one that lives on another stage's mesh (a weight
        two stages share, moved by a `dist.reshard` in the function) as a copy on this one."""
        leaves = jax.tree.leaves(params, is_leaf=_is_leaf)
        params_vars = self._made_by.invars[:self._n_params]
        return [tuple(arrive(leaves[j], part, params_vars[j]) for j in reads)
                for reads, part in zip(self._reads, self._made_by.stages)]

    def join(self, grads: list, params: Any) -> Any:
        """Per-stage gradients as one tree like `params`: a param two stages read gets the sum
        (a copy's gradient moved back to the param's mesh first), one that no stage reads a zero
        gradient (as jax.grad gives it)."""
        leaves = jax.tree.leaves(params, is_leaf=_is_leaf)
        total: list = [None] * self._n_params
        for reads, g in zip(self._reads, grads):
            for j, x in zip(reads, g or ()):
                p = leaves[j]
                if isinstance(x, DistTensor) and isinstance(p, DistTensor) and x.mesh != p.mesh:
                    x = reshard(x, p.mesh, p.placements)
                total[j] = x if total[j] is None else _add(total[j], x)
        total = [_zeros_like(p) if t is None else t for t, p in zip(total, leaves)]
        return jax.tree.unflatten(self._p_tree, total)

    def _arrive(self, i: int, x: Any) -> Any:
        if i == 0:
            return x
        part = self._made_by.stages[i]
        return tuple(arrive(leaf, part, v) for v, leaf in zip(self._carries[i - 1], x))


def _zeros_like(p: Any) -> Any:
    from ..creation import shard_tensor

    zeros = np.zeros(np.shape(p), p.dtype)
    return shard_tensor(zeros, p.mesh, p.placements) if isinstance(p, DistTensor) else zeros


def _stage_fn(cut, part, k, params_vars, reads, carry_in, input_vars, arg_vars, outs):
    """Stage k as fn(params it reads, carry in | inputs, *loss args) -> carry out | loss."""
    def stage(p_sub, x, *args):
        env = dict(cut.consts)
        env.update(zip([params_vars[j] for j in reads], p_sub))
        if k == 0:
            env.update(zip(input_vars, jax.tree.leaves(x, is_leaf=_is_leaf)))
        else:
            env.update(zip(carry_in, x))
        env.update(zip(arg_vars, jax.tree.leaves(args, is_leaf=_is_leaf)))
        eval_eqns(part.eqns, env)
        result = [env[v] for v in outs]
        return result[0] if outs is cut.outvars else tuple(result)

    stage.__name__ = f"stage{k}"
    return stage


__all__ = ["FunctionPipeline"]
