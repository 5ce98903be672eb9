"""A pipeline from one loss function: the stages are cut where values change mesh.

    runner = dist.PipelineRunner.from_function(loss_fn, "1F1B", micro_batches=4)
    loss, grads = runner.value_and_grad(params, inputs, labels)

`loss_fn(params, inputs, *labels)` is written as for one device, with the seed's
`dist.reshard(y, mesh1, ...)` where the activations move to the next stage. It is traced on
the first micro-batch's shapes and cut as dist.jit cuts it (compiler/cut.py); each stage
becomes a function of the params it reads and of what earlier stages made that it or later
stages read (values a stage only passes on ride along), and a PipelineRunner schedules them.
Gradients come back as one tree like `params` (a param read by two stages gets both parts).

With `stateful=True` the function is `fn(params, state, inputs, *labels) -> (loss, new_state)`
(a model's dropout counters and BatchNorm statistics): each state leaf belongs to the stages
that read it or make its new value, which thread it through their micro-batches in order — the
state after a step is one device's after running the micro-batches one by one. A counter read
by several stages (a linen model's step) is advanced by each of them on its own copy; a leaf
whose new value one stage makes from what only that stage holds must be read by no other.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jax.extend import core as jex_core

from ..compiler.cut import arrive, cut_by_mesh, eval_eqns
from ..compiler.trace import source_line
from ..compiler.jit import _describe_leaf
from ..dtensor import DistTensor
from ..reshard.api import reshard
from .pipeline import (PipelineRunner, _add, _is_leaf, _named_leaves, check_batch,
                       check_chunk_count, default_name)
from .schedule import Schedule
from .stages import Stage, StageError


class FunctionPipeline:
    """A PipelineRunner over the stages of one loss function (see the module docstring)."""

    def __init__(self, fn, schedule: str | Schedule = "1F1B", micro_batches: int = 1, *,
                 chunks: int = 1, costs: dict | None = None, recompute: bool = False,
                 stateful: bool = False):
        self.fn = fn
        self._options = (schedule, micro_batches, chunks, costs)
        self.recompute = recompute
        self.stateful = stateful
        self._micro_batch_size: int | None = None  # from a Strategy: its runners check it
        self._name_of = default_name  # how errors name the batch values (to_static: its own)
        self._runners: dict = {}

    def value_and_grad(self, params: Any, inputs: Any, *loss_args: Any, state: Any = None):
        """(loss, gradients like params); with stateful, (loss, gradients, new state)."""
        self._check_state(state)
        runner, split = self._runner(params, inputs, loss_args, state)
        if not self.stateful:
            loss, grads = runner.value_and_grad(split(params), inputs, *loss_args)
            return loss, runner.join(grads, params)
        loss, grads, states = runner.value_and_grad(split(params), inputs, *loss_args,
                                                    state=runner.split_state(state))
        return loss, runner.join(grads, params), runner.join_state(states, state)

    def _check_state(self, state: Any) -> None:
        if self.stateful and state is None:
            raise StageError("this pipeline's function takes model state: pass it as "
                             "value_and_grad(params, inputs, *labels, state=state)")
        if not self.stateful and state is not None:
            raise StageError("state= needs a pipeline made with stateful=True, whose function "
                             "is fn(params, state, inputs, *labels) -> (loss, new_state)")

    def explain(self, params: Any, inputs: Any, *loss_args: Any, state: Any = None) -> str:
        """PipelineRunner.explain of the cut stages."""
        self._check_state(state)
        runner, split = self._runner(params, inputs, loss_args, state)
        text = runner.explain(split(params), inputs, *loss_args, state=runner.split_state(state))
        if state is None:
            return text
        paths = [".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_leaf)[0]]
        lines = ["model state, threaded through each stage's micro-batches:"]
        for k, owned in enumerate(runner._owned):
            names = ", ".join(paths[j] for j in owned) or "none"
            lines.append(f"  stage {k}: {names}")
        return "\n".join([text, *lines])

    def profile(self, params: Any, inputs: Any, *loss_args: Any, steps: int = 3,
                state: Any = None):
        """PipelineRunner.profile of the cut stages (the state each step starts from stays)."""
        from .pipeline_profile import measure

        self._check_state(state)
        runner, split = self._runner(params, inputs, loss_args, state)
        return measure(runner, lambda: runner.value_and_grad(
            split(params), inputs, *loss_args, state=runner.split_state(state)), steps)

    def forward(self, params: Any, inputs: Any, *loss_args: Any, state: Any = None):
        self._check_state(state)
        runner, split = self._runner(params, inputs, loss_args, state)
        return runner.forward(split(params), inputs, *loss_args, state=runner.split_state(state))

    # -- building ------------------------------------------------------------------------------
    def _runner(self, params, inputs, loss_args, state=None):
        schedule, m, chunks, costs = self._options
        # the batch is checked before it is traced on micro-batch shapes: a value whose dim 0
        # is not the batch would be cut, and the trace fail on the cut, first
        check_batch(inputs, loss_args, m, self._micro_batch_size, self._name_of)
        p_leaves, p_tree = jax.tree.flatten(params, is_leaf=_is_leaf)
        s_leaves, s_tree = jax.tree.flatten(state, is_leaf=_is_leaf)
        i_leaves, i_tree = jax.tree.flatten(inputs, is_leaf=_is_leaf)
        a_leaves, a_tree = jax.tree.flatten(loss_args, is_leaf=_is_leaf)
        # traced on one micro-batch: what each stage program will see. A replicated state leaf
        # (a dropout key or counter) goes to whichever stage reads it: traced as unplaced.
        micro = [_micro_aval(x, m) for x in i_leaves + a_leaves]
        described = (tuple(_describe_leaf(x) for x in p_leaves)
                     + tuple(_state_aval(x) for x in s_leaves) + tuple(micro))
        key = (p_tree, s_tree, i_tree, a_tree, described)
        if key not in self._runners:
            whole = [(name, jax.ShapeDtypeStruct(np.shape(x), _describe_leaf(x).dtype))
                     for name, x in _named_leaves(inputs, loss_args, self._name_of)]
            self._runners[key] = self._build(p_leaves, p_tree, s_tree, i_tree, a_tree,
                                             described, whole)
        runner = self._runners[key]
        return runner, runner.split

    def _build(self, p_leaves, p_tree, s_tree, i_tree, a_tree, described, whole=None):
        schedule, m, chunks, costs = self._options
        n_p, n_s, n_i = len(p_leaves), s_tree.num_leaves, i_tree.num_leaves
        n_ps = n_p + n_s

        def flat(*leaves):
            params = jax.tree.unflatten(p_tree, leaves[:n_p])
            inputs = jax.tree.unflatten(i_tree, leaves[n_ps:n_ps + n_i])
            args = jax.tree.unflatten(a_tree, leaves[n_ps + n_i:])
            if not self.stateful:
                return [self.fn(params, inputs, *args)]
            out = self.fn(params, jax.tree.unflatten(s_tree, leaves[n_p:n_ps]), inputs, *args)
            if not (isinstance(out, tuple) and len(out) == 2):
                raise StageError("a stateful pipeline function returns (loss, new_state)")
            new_leaves, new_tree = jax.tree.flatten(out[1], is_leaf=_is_leaf)
            if new_tree != s_tree:
                raise StageError(f"a stateful pipeline function returns the new state with the "
                                 f"structure of the state it took: {s_tree} became {new_tree}")
            return [out[0], *new_leaves]

        avals = [jax.ShapeDtypeStruct(d.shape, d.dtype) for d in described]
        try:
            closed = jax.make_jaxpr(flat)(*avals)
        except Exception as exc:
            if whole:
                _not_per_sample(flat, avals, whole, m, exc)
            raise
        cut = cut_by_mesh(closed, [d.mesh for d in described])
        runner = _CutRunner(cut, n_p, n_i, p_tree, schedule, m, chunks, costs, self.recompute,
                            n_state=n_s, s_tree=s_tree)
        runner._micro_batch_size = self._micro_batch_size
        runner._name_of = self._name_of
        return runner


def _not_per_sample(flat, avals: list, whole: list, m: int, exc: Exception) -> None:
    """The function failed to trace on micro-batch shapes. Where it traces on the whole batch
    and keeping one batch value whole makes it trace, that value is not one row per sample (a
    table the loss broadcasts against the batch): raise a StageError naming it."""
    fixed = avals[:len(avals) - len(whole)]
    micro = avals[len(fixed):]
    cut = [j for j, (a, (_, w)) in enumerate(zip(micro, whole)) if a.shape != w.shape]

    def traces(batch: list) -> bool:
        try:
            jax.make_jaxpr(flat)(*fixed, *batch)
            return True
        except Exception:
            return False

    if not cut or not traces([w for _, w in whole]):
        return  # it fails on the whole batch too: the function's own error
    culprits = [j for j in cut if traces([whole[j][1] if k == j else a
                                          for k, a in enumerate(micro)])] or cut
    names = "; ".join(f"{whole[j][0]}, shape {list(whole[j][1].shape)}" for j in culprits)
    rows = whole[culprits[0]][1].shape[0]
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    raise StageError(
        f"{names}: its dim 0 has the batch's {rows} rows, so the pipeline cuts it into {m} "
        f"micro-batches of {rows // m} rows like every batch value, and the function fails on "
        f"the cut ({type(exc).__name__}: {first[:200]}) though it runs on the whole value — it "
        f"is not one row per sample (a table, class weights, a mask the whole batch shares). "
        f"Pass only per-sample values in the batch and close over the others in the loss "
        f"function: to_static(..., loss_fn=functools.partial(loss, t=table)), or a "
        f"from_function fn that reads the table from its enclosing scope") from exc


def _state_aval(x):
    """A state leaf as the cut sees it: replicated ones unplaced (their stage reads them)."""
    d = _describe_leaf(x)
    if isinstance(x, DistTensor) and not x.layout.partial and all(
            p.is_replicated() for p in x.placements):
        return type(d)(d.shape, d.dtype, None, None)
    return d


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
                 recompute: bool = False, n_state: int = 0, s_tree: Any = None):
        parts = cut.stages
        if not parts or len(cut.outvars) != 1 + n_state:
            raise StageError("a pipeline loss function returns one scalar loss computed on the "
                             "meshes of its params")
        invars = cut.invars
        params_vars = invars[:n_params]
        state_vars = invars[n_params:n_params + n_state]
        n_params += n_state  # below: the batch inputs and loss arguments come after the state
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
        # nothing else lands in the first stage on the label's mesh), to the last if none does;
        # not to a last stage that reads none: a label on another mesh would make its program
        # one of two meshes (a loss moved back to the first mesh is a stage of its own)
        self._arg_readers = {k for k, part in enumerate(parts)
                             if any(v in arg_vars for v in part.inputs)} or {last}
        self._carries, self._made_by, self._n_params = carries, cut, len(params_vars)
        self._p_tree, self._s_tree, self._micro = p_tree, s_tree, m
        self._owned, self._updates = _state_owners(cut, state_vars, made_in)
        updates = self._updates
        stages = [Stage(_stage_fn(cut, part, k, params_vars, self._reads[k],
                                  carries[k - 1] if k else [],
                                  invars[n_params:n_params + n_inputs] if k == 0 else [],
                                  invars[n_params + n_inputs:] if k in self._arg_readers
                                  else [],
                                  cut.outvars[:1] if k == last else carries[k],
                                  [(state_vars[j], updates[j]) for j in self._owned[k]]
                                  if n_state else None),
                        part.mesh) for k, part in enumerate(parts)]
        if not isinstance(schedule, Schedule):
            check_chunk_count(stages, chunks)
        super().__init__(stages, schedule, m, chunks=chunks, costs=costs, recompute=recompute)

    def _reads_args(self, s: int) -> bool:
        return s in self._arg_readers

    def split_state(self, state: Any) -> list | None:
        """Per stage, the state leaves it owns, moved onto its mesh."""
        if state is None:
            return None
        leaves = jax.tree.leaves(state, is_leaf=_is_leaf)
        n = self._n_params
        vars_ = self._made_by.invars[n:n + len(leaves)]
        return [tuple(arrive(leaves[j], part, vars_[j]) for j in owned)
                for owned, part in zip(self._owned, self._made_by.stages)]

    def join_state(self, states: list, state: Any) -> Any:
        """The state after the step, each leaf from a stage that owns it (all owners advanced
        it alike), back where the leaf lived; a leaf no stage owns advanced m times here."""
        leaves = jax.tree.leaves(state, is_leaf=_is_leaf)
        out, given = list(leaves), set()
        for k, owned in enumerate(self._owned):
            for j, value in zip(owned, states[k]):
                if j in given:
                    continue
                old, given = leaves[j], given | {j}
                if isinstance(value, DistTensor) and isinstance(old, DistTensor) and (
                        value.mesh != old.mesh or value.layout != old.layout):
                    value = reshard(value, old.mesh, old.placements)
                out[j] = value
        for j, (v, eqns) in enumerate(self._updates):
            if eqns is not None and j not in given:
                value = leaves[j]
                for _ in range(self._micro):
                    value = _advance(self._made_by, self._made_by.invars[self._n_params + j],
                                     v, eqns, value)
                out[j] = value
        return jax.tree.unflatten(self._s_tree, out)

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


def _stage_fn(cut, part, k, params_vars, reads, carry_in, input_vars, arg_vars, outs,
              state=None):
    """Stage k as fn(params it reads, carry in | inputs, *loss args) -> carry out | loss;
    with `state` ([(state var, (new var, update eqns))] of the leaves it owns) as
    fn(params, carry in | inputs, state, *loss args) -> (carry out | loss, new state)."""
    loss = k == len(cut.stages) - 1  # the last stage makes the loss

    def stage(p_sub, x, *args):
        env = dict(cut.consts)
        env.update(zip([params_vars[j] for j in reads], p_sub))
        if k == 0:
            env.update(zip(input_vars, jax.tree.leaves(x, is_leaf=_is_leaf)))
        else:
            env.update(zip(carry_in, x))
        if state is not None:
            owned, *args = args
            env.update(zip([v for v, _ in state], owned))
        env.update(zip(arg_vars, jax.tree.leaves(args, is_leaf=_is_leaf)))
        eval_eqns(part.eqns, env)
        # a loss_fn returning a constant (0.0) leaves a literal, not a variable, as the loss
        result = [v.val if isinstance(v, jex_core.Literal) else env[v] for v in outs]
        result = result[0] if loss else tuple(result)
        if state is None:
            return result
        return result, tuple(_new_value(new, eqns, env) for _, (new, eqns) in state)

    stage.__name__ = f"stage{k}"
    return stage


def _new_value(new: Any, eqns: list | None, env: dict) -> Any:
    """A state leaf's new value in a stage's environment: made there, or by its update
    equations (a counter's `count + 1`) run here too."""
    if isinstance(new, jex_core.Literal):
        return new.val
    if new not in env:
        eval_eqns(eqns, env)
    return env[new]


def _advance(cut, var, new, eqns, value):
    """One micro-batch's update of a state leaf no stage reads (its update reads only it)."""
    env = dict(cut.consts)
    env[var] = value
    return _new_value(new, eqns, env)


def _state_owners(cut, state_vars: list, made_in: dict) -> tuple[list, list]:
    """Per stage, the indices of the state leaves it threads; per leaf, (its new value's var,
    the equations that make it from the leaf alone, or None when they read more).

    A leaf is owned by the stages that read it and the one that makes its new value. Several
    owners each advance their own copy: the update must then read nothing but the leaf (and
    constants), else the leaf's stages would wait on each other between micro-batches."""
    n_s = len(state_vars)
    new_vars = cut.outvars[1:1 + n_s]
    producer = {v: e for part in cut.stages for e in part.eqns for v in e.outvars}
    producer.update({v: e for e in cut.free_eqns for v in e.outvars})
    consts = set(cut.consts)
    updates, owned = [], [[] for _ in cut.stages]
    for j, (var, new) in enumerate(zip(state_vars, new_vars)):
        eqns = _update_eqns(new, var, producer, consts)
        updates.append((new, eqns))
        owners = {k for k, part in enumerate(cut.stages) if var in part.inputs}
        maker = made_in.get(new) if not isinstance(new, jex_core.Literal) else None
        if maker is not None:
            owners.add(maker)
        unchanged = isinstance(new, jex_core.Literal) or new is var
        if len(owners) > 1 and not unchanged and eqns is None:
            where = source_line(producer[new].source_info) if new in producer else None
            raise StageError(
                f"model state leaf {j} (shape {list(var.aval.shape)}) is read on stages "
                f"{sorted(owners - {maker})} but its new value is made "
                f"{'outside them' if maker is None else f'on stage {maker}'} from values "
                f"those stages do not hold: a pipeline threads each stage's state through "
                f"its own micro-batches — keep the layer that reads and updates it in one "
                f"stage" + (f" ({where})" if where else ""))
        if not owners and not unchanged and eqns is None:
            raise StageError(f"model state leaf {j} gets a new value that no stage makes: it "
                             f"reads neither the params nor the batch")
        for k in sorted(owners):
            owned[k].append(j)
    return owned, updates


def _update_eqns(new: Any, var: Any, producer: dict, consts: set) -> list | None:
    """The equations that make `new` from `var` and constants alone, in order, else None."""
    if isinstance(new, jex_core.Literal) or new is var:
        return []
    order: dict = {}  # id -> eqn, each after the equations it reads (post-order)

    def visit(v) -> bool:
        if isinstance(v, jex_core.Literal) or v is var or v in consts:
            return True
        e = producer.get(v)
        if e is None:  # another input: the update reads more than the leaf
            return False
        if id(e) not in order:
            if not all(visit(u) for u in e.invars):
                return False
            order[id(e)] = e
        return True

    return list(order.values()) if visit(new) else None


__all__ = ["FunctionPipeline"]
