"""to_static → DistModel: one compiled program per mode (train: forward, backward and optimizer
update; eval: the loss; predict: the outputs), over a flax nnx Module or an (apply_fn, params)
pair, with the Strategy's sharding stage, gradient merge, AMP and recompute applied.

Every program threads the model's non-Param state (BatchNorm statistics, dropout RNG
counters; see model_state) and, for float16, the loss scaler's state: they go in and come out
of the compiled step, and after each call the params and state are written back into the nnx
Module, so the user's model is the trained model, as in Paddle.

Gradient merge keeps the summed gradients Partial across calls — each micro-step adds its
still-unreduced gradients into an accumulator that lives as Partial DistTensors — and reduces
once, in the k-th call, where the optimizer update consumes them. At ZeRO stage 2 and 3 the
accumulator is the gradient shard instead: each micro-step reduce-scatters (1/N memory).
The pending accumulator and the cycle's micro-step are in the state dict (gm.*): saved reduced,
and made Partial again by the first program a restored model runs, which continues the cycle.
"""
from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..compiler.jit import jit
from ..creation import shard_tensor
from ..dtensor import DistTensor, is_dist_tensor as _is_dt, with_own_buffers
from ..errors import did_you_mean
from ..mesh import ProcessMesh, as_process_mesh, get_mesh
from ..paddle_names import paddle_names
from ..physical import mesh_sharding
from ..placement import Partial, Replicate, Shard
from ..reshard.api import reshard
from ..uneven import is_key
from .checkpoint import _RUN_STATE  # a model's gradient-merge and loss-scaler names
from .amp import LossScaler, all_finite, autocast, cast_floating, keep_if, o1_primitives
from .model_state import (DistModelError, exact_cast, flatten_dict, sibling_param, split_model,
                          unflatten_dict)
from .optimizer import (ShardedOptimizer, ShardingStage1, ShardingStage2, ShardingStage3,
                        place_params, shard_optimizer)
from .layers import shard_layer
from .strategy import Strategy, StrategyError

_STAGES = {1: ShardingStage1, 2: ShardingStage2, 3: ShardingStage3}

# Per program: the carried values it reads and those it returns (before its loss / outputs).
_PROGRAMS = {
    "train": (("params", "opt_state", "state", "scaler"), ("params", "opt_state", "state", "scaler")),
    "accumulate": (("params", "state", "acc", "scaler"), ("state", "acc")),
    "merge": (("params", "opt_state", "state", "acc", "scaler"),
              ("params", "opt_state", "state", "scaler")),
    "eval": (("params", "state"), ("state",)),
    "predict": (("params", "state"), ("state",)),
}

# Per program: the carried values whose buffers it takes (donated), those it returns anew:
# the params and optimizer states are updated in place, as Paddle's static graph does, not
# held twice (old and new) at the step's peak. The rest of what it reads is a separate,
# undonated argument: a value read and dropped (the merging step's accumulators), if donated,
# took the slots of the params' buffers and saved nothing; an accumulating step's params are
# read only. (A pipeline's update donates its params and optimizer states the same way.)
_DONATED = {"train": ("params", "opt_state", "state", "scaler"),
            "accumulate": ("state", "acc"),
            "merge": ("params", "opt_state", "state", "scaler")}

_ATTRIBUTES = {"params": "params", "opt_state": "opt_state", "state": "state",
               "scaler": "scaler_state", "acc": "_acc"}



def _donatable(tree: Any, owned: weakref.WeakValueDictionary, others: set[int]) -> Any:
    """`tree` as a donated step may take it: each array copied that holds the same buffers as
    an earlier one (a donated step frees each argument's buffers once: tied weights loaded
    from one array), that the model did not make itself (`owned`: the arrays a user passed in
    or loaded stay the user's, readable after the step), or that another DistModel holds
    (`others`: ids of its arrays — one built from the same nnx module, or given this one's
    state_dict, keeps reading them)."""
    seen: set = set()

    def own(x):
        held = getattr(x, "physical", x)
        if not isinstance(held, jax.Array) or isinstance(held, jax.core.Tracer):
            return x
        if held.is_deleted():  # (copying it would crash jaxlib)
            raise DistModelError(
                f"this DistModel holds an array of shape {tuple(np.shape(held))} whose buffers "
                f"were donated to another program (a dist.jit call with donate_argnums) before "
                f"this step: give the model that call's result (set_state_dict)")
        if id(held) in seen or owned.get(id(held)) is not held or id(held) in others:
            x = with_own_buffers(x)
            held = getattr(x, "physical", x)
        seen.add(id(held))
        return x

    return jax.tree.map(own, tree, is_leaf=_is_dt)


_MODELS: "weakref.WeakSet[DistModel]" = weakref.WeakSet()  # every live DistModel


def _held_by_others(model: "DistModel") -> set[int]:
    """Ids of the arrays the other live DistModels carry (params, states, accumulators)."""
    out: set[int] = set()
    for other in list(_MODELS):
        if other is not model:
            for x in jax.tree.leaves(other._carry(), is_leaf=_is_dt):
                out.add(id(getattr(x, "physical", x)))
    return out


def _register(owned: weakref.WeakValueDictionary, tree: Any, skip: set[int] = frozenset()) -> None:
    """Note the arrays of `tree` (a step's results, or what the model made for itself) as the
    model's own, donatable next step — but those of ids in `skip` (the user's)."""
    for x in jax.tree.leaves(tree, is_leaf=_is_dt):
        held = getattr(x, "physical", x)
        if isinstance(held, jax.Array) and id(held) not in skip:
            owned[id(held)] = held


def _batch_shapes(batch: tuple) -> list[tuple[int, ...]]:
    return [tuple(np.shape(x)) for x in jax.tree.leaves(batch, is_leaf=_is_dt)]


def _signature_text(fn: Any) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _names(prefix: str, n: int) -> str:
    """"y1, y2" for prefix "y" and n 2."""
    return ", ".join(f"{prefix}{k + 1}" for k in range(n))


def _is_placements(x: Any) -> bool:
    return isinstance(x, list)


def _find_mesh(params: Any, loader: Any) -> ProcessMesh:
    leaves = jax.tree.leaves(params, is_leaf=_is_dt)
    for leaf in leaves:
        if _is_dt(leaf):
            return leaf.mesh
    for leaf in leaves:  # flax shards annotated params on the mesh in context (jax.set_mesh)
        sharding = mesh_sharding(leaf)
        if sharding is not None:
            return as_process_mesh(sharding.mesh)
    meshes = getattr(loader, "meshes", None)
    if meshes:
        return meshes[0] if isinstance(meshes, (list, tuple)) else meshes
    if get_mesh() is not None:  # as parallelize: the mesh of dist.auto_parallel.set_mesh
        return get_mesh()
    raise DistModelError("to_static found no mesh: place the params with dist.shard_tensor / "
                         "dist.shard_layer, pass a dist.shard_dataloader, or call "
                         "dist.set_mesh(mesh) first")


def _as_strategy(strategy: Any) -> Strategy:
    """to_static's strategy: a dist.Strategy, or the dict dist.Strategy takes."""
    if strategy is None:
        return Strategy()
    if isinstance(strategy, dict):
        return Strategy(strategy)
    if not isinstance(strategy, Strategy):
        raise StrategyError(
            f"to_static: strategy is {strategy!r:.60} of type {type(strategy).__name__}: pass "
            f"dist.Strategy({{'sharding': {{'enable': True, 'stage': 1}}}}) (or that dict), or "
            f"None for the defaults")
    return strategy


def _unbox_linen(model: Any, loader: Any) -> Any:
    """A linen (module, variables[, rngs]) whose params hold `nn.with_partitioning` boxes, with
    those params placed as the boxes say (shard_layer) — the boxes dropped, as linen's own
    `nn.unbox` does."""
    from flax.core import meta

    def boxed(x) -> bool:
        return isinstance(x, meta.AxisMetadata)
    if not (isinstance(model, tuple) and len(model) in (2, 3) and isinstance(model[1], dict)
            and any(boxed(x) for x in jax.tree.leaves(model[1].get("params", {}),
                                                      is_leaf=boxed))):
        return model
    params = model[1]["params"]
    mesh = _find_mesh(jax.tree.leaves(params, is_leaf=_is_dt), loader)
    return (model[0], {**model[1], "params": shard_layer(params, mesh)}, *model[2:])


def _has_unplaced(params: Any) -> bool:
    return not all(_is_dt(p) for p in jax.tree.leaves(params, is_leaf=_is_dt))


def _is_nnx(model: Any) -> bool:
    from flax import nnx

    return isinstance(model, nnx.Module)


def _memory_kinds(leaves: list) -> list:
    """Per leaf: the host memory kind an offloaded DistTensor lives in, else None."""
    return [x.memory_kind if _is_dt(x) and x.memory_kind != "device" else None for x in leaves]


class DistModel:
    """What dist.to_static returns; call it with a batch (see `__call__`)."""

    def __init__(self, model: Any, loader: Any, loss_fn: Callable | None, optimizer: Any,
                 strategy: Strategy | dict | None = None):
        self.strategy = _as_strategy(strategy)
        if loss_fn is not None and not callable(loss_fn):
            raise DistModelError(
                f"to_static: loss_fn is {loss_fn!r:.60} of type {type(loss_fn).__name__}, not a "
                f"function: pass a function loss_fn(output, label) returning one number, e.g. "
                f"lambda out, y: jnp.mean((out - y) ** 2) (or None to only predict)")
        model = _unbox_linen(model, loader)
        self._parts = split_model(model)
        self._model = model
        self._loss_fn = loss_fn
        self._input_keys = getattr(loader, "input_keys", None)
        self.mesh = _find_mesh(self._parts.params, loader)
        if _has_unplaced(self._parts.params) and _is_nnx(model):
            # placed as flax annotates them (shard_layer), else replicated, as before
            shard_layer(model, self.mesh)
            self._parts = split_model(model)
        params = jax.tree.map(lambda p: p if _is_dt(p) else self._replicated(p),
                              self._parts.params, is_leaf=_is_dt)
        self._compute = jax.tree.map(lambda p: list(p.placements), params, is_leaf=_is_dt)
        self._homes = jax.tree.map(lambda p: p.mesh, params, is_leaf=_is_dt)  # pipeline stages
        self.optimizer = self._sharded_optimizer(optimizer) if optimizer is not None else None
        if self.optimizer is not None and self.optimizer.wrt is not None and _is_nnx(model):
            from flax import nnx

            trained = {path for path, _ in nnx.to_flat_state(nnx.state(model, self.optimizer.wrt))}
            self.optimizer = self.optimizer.restricted_to(trained, params)
        self.params = place_params(params, self.optimizer) if self.optimizer else params
        self.opt_state = self.optimizer.init(self.params) if self.optimizer else None
        self.state = self._place_state(self._parts.state)
        self._scaler = self._loss_scaler()
        self.scaler_state = (jax.tree.map(self._replicated, self._scaler.init_state())
                             if self._scaler else None)
        self._dp = "dp" if "dp" in self.mesh.dim_names else self.mesh.dim_names[0]
        # where unplaced inputs and labels go: the first and last pipeline stage's meshes
        stages = (getattr(loader, "meshes", None)
                  or getattr(getattr(model, "_autoshard_parallel", None), "stage_meshes", None))
        self._home_meshes = {m for m in jax.tree.leaves(self._homes)
                             if isinstance(m, ProcessMesh)}
        # params placed by hand on several meshes, no stage order given: the last stage (where
        # the loss reads the label) is not known before tracing, so the label stays unplaced
        # and goes where the program reads it
        self._label_unplaced = not stages and len(self._home_meshes) > 1
        stages = stages or [self.mesh]
        self._io_meshes = (stages[0], stages[-1])
        gm = self.strategy.gradient_merge
        self.k_steps = gm.k_steps if gm.enable else 1
        # Paddle's shard_optimizer(..., gradient_accumulation_steps=k): gradient merge of k
        accumulate = self.optimizer.gradient_accumulation_steps if self.optimizer else 1
        if accumulate > 1:
            if self.k_steps not in (1, accumulate):
                raise StrategyError(
                    f"to_static: shard_optimizer's gradient_accumulation_steps = {accumulate} "
                    f"and strategy.gradient_merge.k_steps = {self.k_steps} disagree: give one "
                    f"of them (or the same k in both)")
            self.k_steps = accumulate
        self._micro = 0
        self._acc = None
        # the arrays the model's own steps made (by id, weakly): a donating step copies any
        # other first, so that what the user passed in or loaded stays theirs (`_donatable`)
        self._owned: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._ran_shapes: dict[str, list] = {}  # per step kind: the last batch's that ran
        # its own from the start: what it made (optimizer states, placed copies), not what the
        # model handed it (an optimizer state may be a param's very array: optax's identity
        # outputs come back as their inputs)
        given = {id(getattr(x, "physical", x)) for x in jax.tree.leaves(
            (self._parts.params, self._parts.state), is_leaf=_is_dt)}
        _register(self._owned, self._carry(), skip=given)
        _MODELS.add(self)
        # Paddle's DistModel starts where it can run: train with an optimizer, eval with only a
        # loss, predict with neither
        self._mode = ("train" if self.optimizer is not None else
                      "eval" if self._loss_fn is not None else "predict")
        self._programs: dict[str, Any] = {}
        self._pipeline = self._pipeline_runner()

    # -- configuration ----------------------------------------------------------------------
    def _pipeline_runner(self) -> Any:
        """strategy.pipeline: the loss cut into stages where the model's forward moves to
        another mesh, run over `accumulate_steps` micro-batches in `schedule_mode`'s order
        (PipelineRunner.from_function); the optimizer then updates every stage's params."""
        pp = self.strategy.pipeline
        meshes = self._home_meshes
        # recompute on stages of several meshes: a jax.checkpoint around the whole forward
        # cannot be cut into stages, so each stage recomputes its own forward in its backward,
        # as a pipeline of one micro-batch does
        staged_recompute = self.strategy.recompute.enable and len(meshes) > 1
        if not pp.enable and not staged_recompute:
            return None
        from .pipeline import PipelineRunner, micro_batch_size

        scaled = self._loss_scaler() is not None
        stateful = bool(jax.tree.leaves(self.state))

        def loss(params, state, inputs, *labels):
            # recompute is the runner's (each stage's forward again in its backward): a
            # jax.checkpoint around the whole forward would keep it on one mesh
            if scaled:  # float16: the loss scale comes last (0-d: every micro-batch's)
                *labels, scale = labels
            out, new_state = self._forward("train", params, state, inputs, remat=False)
            value = self._checked_loss("train", self._call_loss(out, tuple(labels)))
            return value * scale if scaled else value, new_state

        # model state (dropout counters, BatchNorm statistics) is threaded through each stage's
        # micro-batches: the step's new state is one device's after the micro-batches in turn
        fn = loss if stateful else (lambda params, inputs, *labels:
                                    loss(params, self.state, inputs, *labels)[0])
        if not pp.enable:
            runner = PipelineRunner.from_function(fn, "1F1B", 1, recompute=True,
                                                  stateful=stateful)
            runner._name_of = self._batch_name
            return runner
        self._check_chunks(pp.vpp_degree)
        runner = PipelineRunner.from_function(fn, pp.schedule_mode, pp.accumulate_steps,
                                              chunks=pp.vpp_degree,
                                              recompute=self.strategy.recompute.enable,
                                              stateful=stateful)
        runner._micro_batch_size = micro_batch_size(pp)  # checked per batch, as from_strategy
        runner._name_of = self._batch_name  # errors name the batch's elements
        return runner

    def _check_chunks(self, vpp: int) -> None:
        """A model cut by parallelize's pp_config: with vpp_degree chunks per pp rank, its
        split_spec must have made pp x vpp_degree stages (checked here, before any batch, so
        the error can say which cuts to name). With one chunk per rank, more stages than pp
        ranks would run as that many ranks, several on one mesh: the schedule (and its
        simulated timeline) would count ranks the mesh does not have."""
        parallel = getattr(self._model, "_autoshard_parallel", None)
        if parallel is None or not parallel.stage_meshes:
            return
        ranks, spec = len(parallel.stage_meshes), parallel.split_spec
        want = ranks * vpp
        if parallel.stages == want or (vpp < 2 and parallel.stages <= ranks):
            return
        from .pipeline_split import even_cuts

        cuts = even_cuts(self._model, spec, want)
        cut_s = "cut" if want == 2 else "cuts"
        what = (f"split_spec={cuts}" if cuts else
                f"split_spec={{layer: dist.SplitPoint.END, ...}} with {want - 1} "
                f"{'entry' if want == 2 else 'entries'}")
        chunks, rest = divmod(parallel.stages, ranks)  # (vpp 1 here: more stages than ranks)
        fewer = "" if rest else (f" or set vpp_degree to {chunks}"
                                 + (" with schedule_mode 'VPP'" if vpp < 2 else ""))
        chunk_s = "model chunk" if vpp == 1 else "model chunks"
        raise StrategyError(
            f"strategy.pipeline.vpp_degree = {vpp} puts {vpp} {chunk_s} on each of the "
            f"mesh's {ranks} pp ranks: {ranks} x {vpp} = {want} stages, but pp_config's "
            f"split_spec={spec!r} cut the model into {parallel.stages}"
            + (" (a layer-list path makes one stage per pp slice)" if isinstance(spec, str)
               else "")
            + f": name the {want - 1} {cut_s} with dist.SplitPoint in dist.parallelize's "
              f"pp_config, {what} —{fewer or ' or change vpp_degree'}")

    def _batch_name(self, kind: str, path: tuple, n_inputs: int) -> str:
        """A pipeline's batch value as errors name it: the batch element (the model's input,
        or the label: loss_fn's argument after the model's output)."""
        if not path:
            return "the batch's inputs" if kind == "input" else "the batch's label"
        k = getattr(path[0], "idx", 0)
        rest = jax.tree_util.keystr(tuple(path[1:]))
        if kind == "input":
            names = self._input_names()
            role = f"the model's input {names[k]!r}" if k < len(names) else "a model input"
            return f"batch element {k}{rest} ({role})"
        signature = self._loss_signature()
        names = [] if signature is None else list(signature.parameters)
        j = getattr(path[1], "idx", None) if len(path) > 1 else None
        # an element of a list of labels, which a loss_fn of several label parameters takes
        # one per argument (`_call_loss`): named by the parameter it is passed to
        arg = k + j if j is not None and len(names) > 2 else k
        role = (f"loss_fn's argument {names[arg + 1]!r}" if arg + 1 < len(names)
                else "a loss_fn argument")
        return f"batch element {n_inputs + k}{rest} ({role})"

    def _pipelined_step(self, *batch: Any) -> DistTensor:
        """One train step through the pipeline: loss and gradients over the micro-batches,
        then one optimizer update (with gradient merge, every k-th call, on the gradients of
        the k calls summed, or averaged with `avg`)."""
        if self._loss_fn is None:
            raise DistModelError("this DistModel has no loss_fn: pass one to dist.to_static")
        batch = self._batch(batch, "train")
        self._check_loss_args(batch)
        inputs, labels = (batch, ()) if len(batch) == 1 else (batch[:-1], batch[-1:])
        scaler = self.scaler_state
        extra = (scaler["scale"],) if scaler else ()
        if self._pipeline.stateful:
            loss, grads, self.state = self._pipeline.value_and_grad(
                self.params, inputs, *labels, *extra, state=self.state)
        else:
            loss, grads = self._pipeline.value_and_grad(self.params, inputs, *labels, *extra)
        if scaler:  # float16: the loss and gradients came scaled
            if "unscale" not in self._programs:
                self._programs["unscale"] = jit(lambda v, g, sc: (
                    v / sc["scale"], self._scaler.unscale(g, sc)))
            loss, grads = self._programs["unscale"](loss, grads, scaler)
        if self.k_steps > 1:  # gradient merge: k pipeline steps, then one update
            if self._acc is None:
                acc = grads
            else:  # added into in place (the accumulators' buffers donated)
                if "add" not in self._programs:
                    self._programs["add"] = jit(lambda a, g: jax.tree.map(jnp.add, a, g),
                                                donate_argnums=0)
                acc = self._programs["add"](
                    _donatable(self._acc, self._owned, _held_by_others(self)), grads)
            _register(self._owned, acc)
            # the cycle moves on only once this step's work is done: a call that raises
            # leaves it where it was (the user fixes the batch and calls again)
            if self._micro + 1 < self.k_steps:
                self._acc, self._micro = acc, self._micro + 1
                return loss
            grads = acc
        if "update" not in self._programs:
            stored = jax.tree.leaves((self.params, self.opt_state, scaler or {}), is_leaf=_is_dt)
            out = [x.placements if _is_dt(x) else None for x in stored]
            scale = (1.0 / self.k_steps if self.k_steps > 1 and self.strategy.gradient_merge.avg
                     else None)

            def update(p, s, g, sc):
                if scale is not None:
                    g = jax.tree.map(lambda x: x * scale, g)
                return self._update(p, s, g, sc)  # float16: skipped unless every grad is finite

            # params and optimizer states updated in place, each stage's on its mesh
            self._programs["update"] = jit(update, out_placements=out,
                                           out_memory_kinds=_memory_kinds(stored),
                                           donate_argnums=(0, 1))
        params, opt_state = _donatable((self.params, self.opt_state), self._owned,
                                       _held_by_others(self))
        self.params, self.opt_state, scaler = self._programs["update"](
            params, opt_state, grads, scaler or {})
        _register(self._owned, (self.params, self.opt_state))
        if self.k_steps > 1:
            self._acc, self._micro = None, 0
        if self.scaler_state:
            self.scaler_state = scaler
        self._parts.write_back(self.params, self.state)
        return loss

    def _replicated(self, value: Any) -> DistTensor:
        return shard_tensor(np.asarray(value), self.mesh, [Replicate()] * self.mesh.ndim)

    def _sharded_optimizer(self, optimizer: Any) -> ShardedOptimizer:
        opt = optimizer if isinstance(optimizer, ShardedOptimizer) else shard_optimizer(optimizer)
        sharding = self.strategy.sharding
        if sharding.enable and opt.stage not in (0, sharding.stage):
            raise StrategyError(
                f"to_static: the optimizer is already sharded at stage {opt.stage} and "
                f"strategy.sharding asks for stage {sharding.stage}: give one of them (pass the "
                f"plain optax optimizer, or leave strategy.sharding.enable False)")
        if sharding.enable and opt.stage == 0:
            opt = ShardedOptimizer(opt, _STAGES[sharding.stage](sharding.mesh_dim),
                                   opt.gradient_accumulation_steps, opt.offload)
        parallel = getattr(self._model, "_autoshard_parallel", None)
        level = getattr(parallel, "sharding_level", 0)
        if level and not sharding.enable and opt.stage == 0 and opt.shard_fn is None:
            # dist.parallelize(model, config={"dp_config": {"sharding_level": k}}) without the
            # optimizer: the level the model was configured with applies to the one given here
            opt = ShardedOptimizer(opt, _STAGES[level](parallel.dp_dim),
                                   opt.gradient_accumulation_steps, opt.offload)
        if sharding.enable and sharding.degree is not None and hasattr(opt.shard_fn, "axis"):
            axis = opt.shard_fn.axis(self.mesh)
            if sharding.degree != self.mesh.get_dim_size(axis):
                raise StrategyError(
                    f"strategy.sharding.degree = {sharding.degree}, but the optimizer states "
                    f"are split over mesh dim {axis!r} of {self.mesh.get_dim_size(axis)} "
                    f"devices: set degree to {self.mesh.get_dim_size(axis)} (or leave it None), "
                    f"or give sharding.mesh_dim a mesh dim of {sharding.degree} devices")
        if sharding.offload and not opt.offload:  # Paddle's sharding "optimize_offload"
            opt = ShardedOptimizer(opt, opt.shard_fn, opt.gradient_accumulation_steps, True)
        return opt

    def _place_state(self, state: dict) -> dict:
        """Model state placed as the user placed it, else like a same-shaped param beside it."""
        compute = flatten_dict(self._compute) if isinstance(self._compute, dict) else {}
        homes = flatten_dict(self._homes) if isinstance(self._homes, dict) else {}
        placed = {}
        for path, value in flatten_dict(state).items():
            if _is_dt(value):
                placed[path] = value
                continue
            sibling = sibling_param(self._parts.param_paths, path, np.shape(value))
            param = self._parts.param_of(sibling) if sibling is not None else None
            placements = compute.get(param)
            # beside its param: on that param's pipeline stage too
            mesh = homes.get(param, self.mesh)
            placed[path] = (shard_tensor(np.asarray(value), mesh, placements)
                            if placements is not None else self._replicated(value))
        return unflatten_dict(placed)

    def _loss_scaler(self) -> LossScaler | None:
        amp = self.strategy.amp
        if not (amp.enable and amp.dtype == "float16"):
            return None  # bfloat16 has float32's exponent range: nothing to rescue
        return LossScaler(float(amp.init_loss_scaling), bool(amp.use_dynamic_loss_scaling),
                          amp.incr_every_n_steps, amp.decr_every_n_nan_or_inf,
                          float(amp.incr_ratio), float(amp.decr_ratio))

    def train(self) -> "DistModel":
        self._mode = "train"
        return self

    def eval(self) -> "DistModel":
        self._mode = "eval"
        return self

    def predict(self) -> "DistModel":
        self._mode = "predict"
        return self

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def loss_scale(self) -> float | None:
        """The current float16 loss scale (None without float16 AMP)."""
        return None if self.scaler_state is None else float(self.scaler_state["scale"].numpy())

    # -- the traced pieces ------------------------------------------------------------------
    def _compute_view(self, params: Any) -> Any:
        """Params as the forward uses them: gathered from ZeRO-3 storage."""
        if self.optimizer is not None and self.optimizer.stage == 3:
            params = jax.tree.map(lambda p, pl, mesh: reshard(p, mesh, pl), params,
                                  self._compute, self._homes, is_leaf=_is_placements)
        return params

    def _apply_fn(self, mode: str, remat: bool = True) -> Callable:
        """apply(params, state, *inputs) → (outputs, state) with AMP and recompute wrapped in."""
        parts = self._parts

        def apply(params, state, *inputs):
            return parts.apply(mode, params, state, *inputs)

        amp = self.strategy.amp
        if amp.enable and amp.level == "o1":
            apply = autocast(apply, amp.dtype, o1_primitives(amp.custom_white_list,
                                                             amp.custom_black_list))
        recompute = self.strategy.recompute
        if recompute.enable and mode == "train" and remat:
            policy = recompute.policy
            if isinstance(policy, str):
                policy = getattr(jax.checkpoint_policies, policy)
            apply = jax.checkpoint(apply, policy=policy)
        return apply

    def _forward(self, mode: str, params: Any, state: dict, inputs: tuple,
                 remat: bool = True) -> tuple[Any, dict]:
        params = self._compute_view(params)
        amp = self.strategy.amp
        if amp.enable and amp.level == "o2":  # the whole forward in low precision
            params, inputs = cast_floating(params, amp.dtype), cast_floating(inputs, amp.dtype)
        out, state = self._apply_fn(mode, remat)(params, state, *inputs)
        if amp.enable:  # the loss (and what predict returns) in float32
            out = cast_floating(out, jnp.float32)
        return out, state

    def _loss(self, mode: str, params: Any, state: dict, batch: tuple) -> tuple[Any, dict]:
        if self._loss_fn is None:
            raise DistModelError("this DistModel has no loss_fn: pass one to dist.to_static, or "
                                 "use .predict()")
        inputs, labels = (batch, ()) if len(batch) == 1 else (batch[:-1], batch[-1:])
        out, state = self._forward(mode, params, state, inputs)
        return self._checked_loss(mode, self._call_loss(out, labels)), state

    def _loss_signature(self) -> inspect.Signature | None:
        """loss_fn's signature, read once per loss_fn (None: a builtin without one)."""
        cached = self.__dict__.get("_loss_sig")
        if cached is None or cached[0] is not self._loss_fn:
            try:
                signature = inspect.signature(self._loss_fn)
            except (TypeError, ValueError):
                signature = None
            cached = self.__dict__["_loss_sig"] = (self._loss_fn, signature)
        return cached[1]

    def _loss_binds(self, n_args: int) -> bool:
        """Whether loss_fn binds n positional arguments (True when its signature cannot be
        read: its call will say)."""
        signature = self._loss_signature()
        if signature is None:
            return True
        try:
            signature.bind(*([None] * n_args))
        except TypeError:
            return False
        return True

    def _call_loss(self, out: Any, labels: tuple) -> Any:
        """loss_fn called on the model's output and the batch's label element (`labels` is ()
        or (label,)), as Paddle's static Engine calls it, loss(*outputs, *labels):

        - a label that is a list or tuple — Paddle's batch of several labels,
          dist_model(inputs, [y1, y2]), a loader's [inputs, [y1, y2]] — is passed one element
          per argument, loss_fn(output, y1, y2), as the list of inputs is to the model; unless
          loss_fn cannot take them so but takes one label (a single parameter: a pytree
          label), which then gets the list whole;
        - a model's tuple (or list) of outputs is passed whole, loss_fn(outputs, ...), as
          to_static always has; unless loss_fn cannot take it so but takes the outputs one by
          one, as Paddle passes them: loss_fn(out1, out2, y).

        The first reading of (output whole, labels apart), (output whole, labels whole),
        (outputs apart, labels apart), (outputs apart, labels whole) that loss_fn's signature
        binds is the call. k outputs and a list of k labels that bind both as (outputs whole,
        y1..yk) and (out1..outk, labels whole) are ambiguous: a DistModelError."""
        listed = len(labels) == 1 and type(labels[0]) in (list, tuple)
        label_forms = [tuple(labels[0]), tuple(labels)] if listed else [tuple(labels)]
        several = type(out) in (list, tuple)
        out_forms = [(out,)] + ([tuple(out)] if several else [])
        # (indices: the forms hold traced arrays, which `in` would compare)
        fits = [(i, j) for i, o in enumerate(out_forms) for j, y in enumerate(label_forms)
                if self._loss_binds(len(o) + len(y))]
        if not fits:
            raise DistModelError(self._loss_mismatch(out, labels))
        outs, args = out_forms[fits[0][0]], label_forms[fits[0][1]]
        if (listed and several and len(out) == len(labels[0]) > 1 and fits[0] == (0, 0)
                and (1, 1) in fits and not self._loss_takes_varargs()):
            name = getattr(self._loss_fn, "__name__", type(self._loss_fn).__name__)
            k = len(out)
            raise DistModelError(
                f"to_static: the model returns {k} outputs and the batch's label is a list of "
                f"{k}, so loss_fn {name}{_signature_text(self._loss_fn)} can be called both as "
                f"loss_fn(outputs, {_names('y', k)}) (the outputs whole, the labels apart) and "
                f"as loss_fn({_names('out', k)}, labels) (the outputs apart, the labels whole): "
                f"say which — for the first, return the outputs as a dict (passed whole); for "
                f"the second, pass the labels as a dict, dist_model(inputs, {{'y': y1, ...}}) "
                f"(passed whole)")
        return self._loss_fn(*outs, *args)

    def _loss_takes_varargs(self) -> bool:
        signature = self._loss_signature()
        return signature is None or any(p.kind == p.VAR_POSITIONAL
                                        for p in signature.parameters.values())

    def _loss_mismatch(self, out: Any, labels: tuple) -> str:
        """Why loss_fn cannot be called on this output and label, and what to write."""
        name = getattr(self._loss_fn, "__name__", type(self._loss_fn).__name__)
        listed = len(labels) == 1 and type(labels[0]) in (list, tuple)
        several = type(out) in (list, tuple)
        if not labels and not several:
            try:
                inspect.signature(self._loss_fn).bind(None)
                exc = "it has keyword-only parameters without defaults"
            except TypeError as e:
                exc = e
            return (f"to_static: loss_fn {name}{_signature_text(self._loss_fn)} cannot be "
                    f"called as loss_fn(output) ({exc}): loss_fn needs a label, the batch's "
                    f"last element after the model's inputs, but the batch has 1 element (the "
                    f"input): call dist_model(inputs, label) — 2 elements or more")
        given = f"outputs (a {type(out).__name__} of {len(out)})" if several else "output"
        if labels:
            given += (f" and labels (a {type(labels[0]).__name__} of {len(labels[0])})"
                      if listed else " and label")
        outs = [["output"]] + ([["outputs"], _names("out", len(out)).split(", ")]
                               if several else [])
        ys = ([_names("y", len(labels[0])).split(", "), ["labels"]] if listed
              else [["label"]] if labels else [[]])
        forms = ", ".join(dict.fromkeys(f"loss_fn({', '.join(o + y)})" for o in outs
                                        for y in ys))
        return (f"to_static: loss_fn {name}{_signature_text(self._loss_fn)} cannot be called "
                f"on the model's {given} as any of {forms}: to_static passes one label, the "
                f"batch's last element, and a list of labels one element per argument "
                f"(Paddle's loss(out, y1, y2)); give loss_fn's other parameters defaults (or "
                f"close over those values), or pass the labels as a list: "
                f"dist_model(inputs, [y1, y2]) for loss_fn(output, y1, y2)")

    def _checked_loss(self, mode: str, loss: Any) -> Any:
        """loss_fn's result as the float32 number a step differentiates, else a DistModelError
        saying what to return. Both train steps — the one program and the pipeline's stages —
        call it, so they refuse alike (an int loss would train silently with zero gradients)."""
        name = getattr(self._loss_fn, "__name__", type(self._loss_fn).__name__)
        if not (hasattr(loss, "dtype") or isinstance(loss, (int, float))):  # a tuple, a dict
            raise DistModelError(
                f"to_static: loss_fn {name} returned a {type(loss).__name__}; the step "
                f"differentiates one number, so return the loss alone (as Paddle's loss_fn "
                f"does); to see other values, compute them from .predict()'s output")
        loss = loss if _is_dt(loss) else jnp.asarray(loss)
        if mode == "train" and not jnp.issubdtype(loss.dtype, jnp.floating):
            raise DistModelError(
                f"to_static: loss_fn {name} returned a value of dtype {loss.dtype}, which has no "
                f"gradient: return a floating-point loss (e.g. jnp.mean(...) of floats)")
        if mode == "train" and np.shape(loss) != ():
            raise DistModelError(
                f"to_static: loss_fn {name} returned an array of shape {tuple(np.shape(loss))}; "
                f"training differentiates one number: reduce it in loss_fn (e.g. "
                f"jnp.mean(...)) before returning")
        return loss.astype(jnp.float32)

    def _grads(self, params: Any, state: dict, scaler: dict, batch: tuple):
        """(loss, gradients, new state); with float16, the loss scaled and the gradients unscaled."""
        def scaled_loss(p):
            loss, new_state = self._loss("train", p, state, batch)
            return (loss * scaler["scale"] if scaler else loss), (loss, new_state)

        (_, (loss, state)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
        if scaler:
            grads = self._scaler.unscale(grads, scaler)
        return loss, grads, state

    def _update(self, params, opt_state, grads, scaler):
        """The optimizer step; with float16, skipped when a gradient is inf or nan."""
        updates, new_opt_state = self.optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if not scaler:
            return new_params, new_opt_state, scaler
        finite = all_finite(grads)
        return (keep_if(finite, new_params, params), keep_if(finite, new_opt_state, opt_state),
                self._scaler.next_state(scaler, finite))

    def _step_fn(self, name: str) -> Callable:
        """The function of (kept, donated, *batch) → (carry, result) that program `name`
        compiles: the carried values it reads come in two parts (`program_args`), the second
        the one whose buffers the step takes."""
        if name == "train":
            def step(c, *batch):
                loss, grads, state = self._grads(c["params"], c["state"], c["scaler"], batch)
                params, opt_state, scaler = self._update(c["params"], c["opt_state"], grads, c["scaler"])
                return {"params": params, "opt_state": opt_state, "state": state, "scaler": scaler}, loss
        elif name == "accumulate":
            def step(c, *batch):
                loss, grads, state = self._grads(c["params"], c["state"], c["scaler"], batch)
                return {"state": state, "acc": jax.tree.map(jnp.add, c["acc"], grads)}, loss
        elif name == "merge":
            k, avg = self.k_steps, self.strategy.gradient_merge.avg

            def step(c, *batch):
                loss, grads, state = self._grads(c["params"], c["state"], c["scaler"], batch)
                total = jax.tree.map(jnp.add, c["acc"], grads)
                if avg:
                    total = jax.tree.map(lambda g: g / k, total)
                params, opt_state, scaler = self._update(c["params"], c["opt_state"], total, c["scaler"])
                return {"params": params, "opt_state": opt_state, "state": state, "scaler": scaler}, loss
        elif name == "eval":
            def step(c, *batch):
                loss, state = self._loss("eval", c["params"], c["state"], batch)
                return {"state": state}, loss
        else:
            def step(c, *batch):
                out, state = self._forward("eval", c["params"], c["state"], batch)
                return {"state": state}, out

        def program(kept, donated, *batch):
            return step({**kept, **donated}, *batch)
        return program

    # -- programs -----------------------------------------------------------------------------
    def _carry(self) -> dict[str, Any]:
        return {"params": self.params, "opt_state": self.opt_state, "state": self.state,
                "scaler": self.scaler_state or {}, "acc": self._acc if self._acc is not None else {}}

    def _acc_placements(self, batch: tuple) -> list:
        """Gradient accumulators: the gradient shards at ZeRO-2/3; else Partial on the mesh dims
        the batch is split over (where each device's gradient is a part of the sum), so they
        are reduced once per k steps, over those dims only."""
        stage = self.optimizer.stage if self.optimizer is not None else 0
        # the mesh dims the batch is split over, by name: a model on two meshes reads its
        # inputs on the first and its labels on the last
        # inputs, each array of a pytree element (a label list) too
        split = {x.mesh.dim_names[k] for x in jax.tree.leaves(batch, is_leaf=_is_dt)
                 if _is_dt(x) for k, q in enumerate(x.placements)
                 if not isinstance(q, Replicate)}
        out = []
        for p in jax.tree.leaves(self.params, is_leaf=_is_dt):
            if stage >= 2:
                out.append(self.optimizer.state_placements(p))
            else:
                out.append([Partial() if name in split and isinstance(q, Replicate) else q
                            for q, name in zip(p.placements, p.mesh.dim_names)])
        return out

    def _program(self, name: str, args: tuple):
        """The compiled program `name`; what it returns keeps the placements it was given."""
        if name in self._programs:
            return self._programs[name]
        _, writes = _PROGRAMS[name]
        returned = {k: {**args[0], **args[1]}[k] for k in writes}
        leaves = jax.tree.leaves(returned, is_leaf=_is_dt)
        out = [x.placements for x in leaves]
        # predict's outputs are whatever the model returns: the plan places them.
        out = None if name == "predict" else out + [[Replicate()] * self.mesh.ndim]
        # what it hands back goes back to the memory it came from (offloaded optimizer states)
        kinds = None if name == "predict" else _memory_kinds(leaves) + [None]
        self._programs[name] = jit(self._step_fn(name), out_placements=out,
                                   out_memory_kinds=kinds,
                                   donate_argnums=(1,) if name in _DONATED else ())
        return self._programs[name]

    def program_args(self, name: str, *batch: Any) -> tuple:
        """The arguments program `name` is called with for this batch (for .plan / .lower)."""
        if not (isinstance(name, str) and name in _PROGRAMS):
            raise DistModelError(
                f"program_args({name!r}): there is no program {name!r}"
                + did_you_mean(name, _PROGRAMS)
                + f"; the programs are {list(_PROGRAMS)} (train, or accumulate and merge with "
                  f"gradient merge; eval; predict)")
        self._check_can_build(name)
        # read for the program's mode, not the model's: summary() builds the train step in
        # any mode, and predict's batch has no label
        batch = self._batch(batch, "predict" if name == "predict" else "train")
        if name != "predict":
            self._check_loss_args(batch)
        if name in ("accumulate", "merge"):
            if self._acc is None:  # made here: the model's own, donated uncopied
                self._acc = self._zero_acc(batch)
                _register(self._owned, self._acc)
            else:
                self._acc = self._placed_acc(batch)
        carry = self._carry()
        reads, _ = _PROGRAMS[name]
        given = _DONATED.get(name, ())
        return ({k: carry[k] for k in reads if k not in given},
                {k: carry[k] for k in reads if k in given}) + batch

    def _runnable(self) -> list[str]:
        """The steps this model has what to build from, the train step first."""
        has_loss = self._loss_fn is not None
        return (["train"] * (has_loss and self.optimizer is not None) + ["eval"] * has_loss
                + ["predict"])

    def _check_can_build(self, name: str) -> None:
        """A DistModelError for a program this model lacks what to build from (its trace
        would fail on the missing optimizer or loss_fn, in a bare AttributeError)."""
        have = {"loss_fn": self._loss_fn is not None, "optimizer": self.optimizer is not None}
        needs = {"predict": (), "eval": ("loss_fn",)}.get(name, ("loss_fn", "optimizer"))
        missing = [n for n in needs if not have[n]]
        if not missing:
            return
        can = self._runnable()
        raise DistModelError(
            f"program {name!r} needs " + " and ".join(
                ("an " if n == "optimizer" else "a ") + n for n in missing)
            + f", which this DistModel was built without: pass "
              f"{'them' if len(missing) > 1 else 'it'} to dist.to_static(model, loader, "
              f"loss_fn, optimizer), or use what it has: {', '.join(can)}")

    def _run(self, name: str, *batch: Any) -> Any:
        args = self.program_args(name, *batch)
        if name in _DONATED:
            args = (args[0], _donatable(args[1], self._owned, _held_by_others(self))) + args[2:]
        kind = "train" if name in ("accumulate", "merge") else name
        try:
            carry, result = self._program(name, args)(*args)
        except TypeError as e:  # jax's, from tracing the user's code on this batch's shapes
            ran = self._ran_shapes.get(kind)
            now = _batch_shapes(args[2:])
            if ran is None or ran == now:
                raise
            raise DistModelError(
                f"the {kind} step failed on this batch, whose arrays have shapes {now}; the "
                f"last batch it ran had {ran} ({type(e).__name__}: "
                f"{str(e).splitlines()[0]}): give batches shaped as the model takes them — "
                f"only the batch dim may change") from e
        self._ran_shapes[kind] = _batch_shapes(args[2:])
        _register(self._owned, carry)
        if name == "predict":  # the plan chose its output layouts: keep the stored ones
            carry["state"] = self._restore_placements(carry["state"], self.state)
        for key, value in carry.items():
            if key == "scaler" and not value:
                value = None  # no float16 loss scaling
            setattr(self, _ATTRIBUTES[key], value)
        # the params only where the step changed them: an eval model built beside a training
        # one from the same module wrote its older params back over the trained ones
        self._parts.write_back(self.params if "params" in carry else {}, self.state)
        return result

    def _restore_placements(self, new: Any, old: Any) -> Any:
        return jax.tree.map(lambda n, o: n if n.placements == o.placements
                            else reshard(n, o.mesh, o.placements), new, old, is_leaf=_is_dt)

    def _zero_acc(self, batch: tuple) -> Any:
        # each accumulator on its param's mesh (a model cut into stages has several)
        return jax.tree.map(
            lambda p, pl: shard_tensor(np.zeros(p.shape, p.dtype), p.mesh, pl),
            self.params, _unflatten_like(self.params, self._acc_placements(batch)),
            is_leaf=lambda x: _is_dt(x) or _is_placements(x))

    def _placed_acc(self, batch: tuple) -> Any:
        """The accumulator as this batch's programs take it: one loaded from a state dict
        comes placed like the params (Partial parts are summed when saved) and is made Partial
        over the batch's dims again, so the cycle continues in the program it started in."""
        leaves = jax.tree.leaves(self._acc, is_leaf=_is_dt)
        homes = [p.mesh for p in jax.tree.leaves(self.params, is_leaf=_is_dt)]
        want = self._acc_placements(batch)
        if all(a.mesh == m and a.placements == w for a, m, w in zip(leaves, homes, want)):
            return self._acc
        return _unflatten_like(self.params, [
            a if a.mesh == m and a.placements == w else reshard(a, m, w)
            for a, m, w in zip(leaves, homes, want)])

    def _batch(self, batch: tuple, mode: str) -> tuple:
        """The call's batch as the arguments of a program of `mode` ("predict": inputs only;
        else inputs, then the label), each unplaced array placed."""
        if len(batch) == 1 and isinstance(batch[0], (tuple, list)) and (
                mode != "predict" or self._takes_one_by_one(len(batch[0]))):
            batch = tuple(batch[0])
        if mode == "predict":
            self._check_no_labels(batch)
        if len(batch) == 1 and isinstance(batch[0], dict):
            batch = self._ordered(batch[0], mode)
        batch = self._unpacked_inputs(batch, mode)
        out = []
        first, last = self._io_meshes
        for k, x in enumerate(batch):
            # unplaced arrays are split over the data-parallel dim when they can be; the label
            # (last, with a loss) goes where the last pipeline stage computes the loss
            label = k == len(batch) - 1 and k and mode != "predict"
            if label and self._label_unplaced:
                out.append(x)
                continue
            mesh = last if label else first
            # each array of a pytree element (a model's (x, mask) input) on its own: numpy would
            # stack a list of arrays into one, or fail on arrays of different shapes
            out.append(jax.tree.map(lambda a: self._split_over_dp(a, mesh), x, is_leaf=_is_dt))
        return tuple(out)

    def _check_no_labels(self, batch: tuple) -> None:
        """Predict takes the model's inputs only. Train's batch of Paddle's form, a list of
        inputs and then the label(s) — dist_model([x1, x2], [y1, y2]), a loader's [[x1, x2],
        y] — handed to predict would reach a model of two parameters as the list and the
        label (traced into a wrong sum, or a jax TypeError): a DistModelError saying what to
        drop. (A model whose first input is itself a list takes it as a dict, or another
        pytree, in predict as in train, which reads such a list as the inputs.)"""
        if not (len(batch) == 2 and type(batch[0]) in (list, tuple) and len(batch[0]) > 1
                and self._takes(len(batch[0]))):
            return
        label = batch[1]
        what = (f"a {type(label).__name__} of {len(label)} labels"
                if type(label) in (list, tuple) else "a label")
        n = len(batch[0])
        raise DistModelError(
            f"predict takes the model's inputs only, but the batch is a {type(batch[0]).__name__}"
            f" of {n} inputs and then {what}, as train and eval read it: drop the label(s) — "
            f"dist_model([{_names('x', n)}]) or dist_model({_names('x', n)}) (a model whose "
            f"first input is itself a list: pass that input as a dict)")

    def _split_over_dp(self, x: Any, mesh: ProcessMesh) -> Any:
        """An unplaced array split by its first dim over the mesh's data-parallel dim where
        that divides it; anything else as it is."""
        dp = self._dp if self._dp in mesh.dim_names else mesh.dim_names[0]
        if not _is_dt(x) and np.ndim(x) and np.shape(x)[0] % mesh.get_dim_size(dp) == 0:
            return shard_tensor(x, mesh, [Shard(0) if d == dp else Replicate()
                                          for d in mesh.dim_names])
        return x

    def _check_loss_args(self, batch: tuple) -> None:
        """loss_fn is called as loss_fn(output, label), the label being the batch's last
        element (a one-element batch is the model's input: loss_fn(output)); a label that is
        a list, loss_fn(output, y1, y2) (see _call_loss). Checked against loss_fn's signature
        before tracing, so that a mismatch says what the batch holds rather than which
        argument of the traced step is missing. A loss_fn of more parameters than that may
        take a model's several outputs one by one: the traced call (_call_loss) decides."""
        label = batch[-1] if len(batch) > 1 else None
        listed = type(label) in (list, tuple)
        counts = (len(label), 1) if listed else (1,) if len(batch) > 1 else (0,)
        checked = self.__dict__.setdefault("_loss_args_ok", set())
        if self._loss_fn is None or counts in checked:
            return
        signature = self._loss_signature()
        if signature is None:  # a builtin without one: its call will say
            return
        if any(self._loss_binds(1 + n) for n in counts):
            checked.add(counts)
            return
        if any(self._loss_binds(k + n) for n in counts
               for k in range(2, len(signature.parameters) + 2)):
            return  # several outputs, one per parameter: known once the model is traced
        name = getattr(self._loss_fn, "__name__", type(self._loss_fn).__name__)
        try:
            signature.bind(*([None] * (1 + counts[0])))
        except TypeError as e:
            exc = e
        else:  # (keyword-only parameters without defaults: nothing binds)
            exc = "it has keyword-only parameters without defaults"
        if listed:
            call = f"output, {_names('y', len(label))}"
            fix = (f"the batch's last element, the label, is a {type(label).__name__} of "
                   f"{len(label)}: loss_fn is called as loss_fn({call}) (Paddle's rule), or with "
                   f"the {type(label).__name__} whole as loss_fn(output, labels); write one of "
                   f"those, or call the model with its inputs only")
        elif counts[0]:
            call = "output, label"
            fix = (f"the batch has {len(batch)} elements, the model's input(s) and then the "
                   f"label (the last): write loss_fn(output, label), or call the model with "
                   f"its inputs only")
        else:
            call = "output"
            fix = ("loss_fn needs a label, the batch's last element after the model's "
                   "inputs, but the batch has 1 element (the input): call "
                   "dist_model(inputs, label) — 2 elements or more")
        raise DistModelError(
            f"to_static: loss_fn {name}{signature} cannot be called as loss_fn({call}) "
            f"({exc}): {fix}") from None

    def _ordered(self, batch: dict, mode: str) -> tuple:
        """A dict batch as arguments: the inputs in the batch's order, then the label."""
        keys = self._input_keys
        if keys is None:
            raise DistModelError(
                "dict batches need an order: pass dist.shard_dataloader(..., input_keys=['x', "
                "'label']) to to_static, or call dist_model(batch['x'], batch['label'])")
        if isinstance(keys, dict):  # {key: mesh index} says where, not in which order
            raise DistModelError(
                f"a dict batch with input_keys={keys!r} has no argument order: call "
                f"dist_model(batch[...], ...) with the model's inputs and then the label")
        missing = [k for k in keys if k not in batch
                   and not (k == keys[1] and mode == "predict")]
        if missing:
            raise DistModelError(f"the batch has no {missing} (its keys are {sorted(batch)}); "
                                 f"input_keys are {keys}")
        # As shard_dataloader reads them: the label key last, every other key an input — in
        # the order of the model's parameters when they are named so (model(input_ids,
        # attention_mask) fed {"attention_mask": ..., "input_ids": ...}), else the batch's
        label = keys[1]
        inputs = self._by_signature([k for k in batch if k != label])
        if mode == "predict" and label not in batch:
            return tuple(batch[k] for k in inputs)
        if mode == "predict" and self._takes(len(inputs)) and not self._takes(len(inputs) + 1):
            # the model would be handed the label as one input too many: name the key to drop
            raise DistModelError(
                f"predict takes a dict batch without its label: drop {label!r} (input_keys "
                f"{keys} name it the label), e.g. dist_model({{k: v for k, v in batch.items() "
                f"if k != {label!r}}})")
        return tuple(batch[k] for k in inputs) + (batch[label],)

    def _by_signature(self, keys: list) -> list:
        names = self._input_names()
        if not all(k in names for k in keys):
            return keys
        return sorted(keys, key=names.index)

    def _unpacked_inputs(self, batch: tuple, mode: str) -> tuple:
        """Paddle's batch of a multi-input model, (inputs, label) with the inputs in a list —
        dist_model([x1, x2], label), or a loader's [[x1, x2], label] — as (x1, x2, label): Paddle
        feeds each element of the list as one input (also to a model with optional parameters
        after its first, `forward(input_ids, attention_mask=None)`). A model whose call cannot
        take them one by one (a single parameter: a pytree input) gets the list whole."""
        if mode != "predict" and len(batch) > 2:
            return self._split_flat(batch)
        if (mode == "predict" or len(batch) != 2
                or not isinstance(batch[0], (list, tuple))):
            return batch
        inputs = tuple(batch[0])
        if self._takes_one_by_one(len(inputs)):
            return inputs + batch[1:]
        return batch

    def _split_flat(self, batch: tuple) -> tuple:
        """Paddle's flat call of a model of several inputs and labels, dist_model(x1, x2, y1,
        y2): Paddle splits its feed list where its data spec's inputs end; here, where the
        model's call stops taking inputs. The batch reads as usual — every element an input
        but the last, the label — unless the model cannot take that many; then it splits
        after the one count of inputs that the model takes and after which loss_fn takes the
        rest as labels, one per argument (loss_fn(output, y1, y2), `_call_loss`)."""
        n = len(batch)
        if any(isinstance(x, (list, tuple, dict)) for x in batch) or self._takes(n - 1):
            return batch
        counts = [k for k in range(1, n - 1) if self._takes(k) and self._loss_binds(1 + n - k)]
        if not counts:
            return batch  # `_run` says that the model cannot take the batch's inputs
        if len(counts) > 1:
            ways = " or ".join(f"dist_model([{_names('x', k)}], [{_names('y', n - k)}])"
                               for k in counts)
            raise DistModelError(
                f"a flat batch of {n} arrays splits into the model's inputs and loss_fn's "
                f"labels {len(counts)} ways ({', '.join(f'{k} + {n - k}' for k in counts)}): "
                f"say which, as Paddle's [inputs, labels] — {ways}")
        k = counts[0]
        return batch[:k] + (list(batch[k:]),)

    def _takes_one_by_one(self, n_inputs: int) -> bool:
        """Whether a list of n inputs goes to the model one element per input — as it does
        unless the model's call cannot take n inputs but takes one (a single parameter: a
        pytree input), which then gets the list whole. Train's dist_model([x1, x2], label)
        and predict's dist_model([x1, x2]) read it alike."""
        return self._takes(n_inputs) or not self._takes(1)

    def _takes(self, n_inputs: int) -> bool:
        """Whether the model's call binds n positional inputs (True when its signature cannot
        be read: the call itself will say)."""
        signature, params_first = self._call_signature()
        if signature is None:
            return True
        try:
            signature.bind(*([None] * (int(params_first) + n_inputs)))
        except TypeError:
            return False
        return True

    def _call_signature(self) -> tuple[inspect.Signature | None, bool]:
        """The signature of what the model's inputs are passed to — an nnx Module's __call__, a
        linen pair's module, an (apply_fn, params) pair's apply_fn — and whether the params come
        first in it (read once: every batch asks)."""
        found = self.__dict__.get("_signature")
        if found is None:
            model = self._model
            fn = model[0] if isinstance(model, tuple) else model
            fn = fn if inspect.isfunction(fn) else getattr(fn, "__call__", None)
            try:
                signature = inspect.signature(fn)
            except (TypeError, ValueError):
                signature = None
            found = self._signature = (signature, isinstance(model, tuple)
                                       and inspect.isfunction(model[0]))
        return found

    def _input_names(self) -> list:
        """The model's positional parameter names after its params, if it takes them first."""
        signature, params_first = self._call_signature()
        if signature is None:
            return []
        names = [n for n, p in signature.parameters.items()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return names[1:] if params_first else names  # apply_fn(params, *inputs)

    # -- calls ----------------------------------------------------------------------------------
    def __call__(self, *batch: Any) -> DistTensor:
        """train: one step (loss); eval: the loss; predict: the model's outputs."""
        if self._mode in ("predict", "eval"):
            return self._run(self._mode, *batch)
        if self.optimizer is None:
            raise DistModelError("train mode needs an optimizer: pass one to dist.to_static")
        if self._pipeline is not None:
            return self._pipelined_step(*batch)
        if self.k_steps == 1:
            return self._run("train", *batch)
        # the cycle moves on only once the step has run: a call that raises (a batch of the
        # wrong shape, fixed and called again) leaves it where it was
        if self._micro + 1 < self.k_steps:
            loss = self._run("accumulate", *batch)
            self._micro += 1
            return loss
        loss = self._run("merge", *batch)
        self._micro, self._acc = 0, None
        return loss

    def summary(self, *batch: Any) -> str:
        """The plan of the step this model runs, in a few lines: collectives, bytes, memory
        per device; for a model cut into stages, each stage's collectives, and with
        strategy.pipeline the schedule and what crosses between stages per micro-batch. The
        step is the train step when the model has an optimizer (and a loss_fn), else the eval
        step with a loss_fn, else predict's — read from the batch of that program in any mode."""
        from ..reshard.planner import format_bytes

        amp = self.strategy.amp
        meshes = list(dict.fromkeys(m for m in jax.tree.leaves(self._homes)
                                    if isinstance(m, ProcessMesh)))
        where = (f"mesh {self.mesh.shape} {self.mesh.dim_names}" if len(meshes) <= 1 else
                 "meshes " + " | ".join(f"{m.shape} {m.dim_names} on {m.process_ids}"
                                        for m in meshes))
        head = (f"{where}; strategy: sharding stage "
                f"{self.optimizer.stage if self.optimizer else 0}, gradient merge k={self.k_steps}, "
                f"amp {f'{amp.dtype} {amp.level}' if amp.enable else 'off'}, recompute "
                f"{'on' if self.strategy.recompute.enable else 'off'}")
        name, why = self._summary_program()
        head += f"\n{why}" if why else ""
        if self._pipeline is not None and name == "train":  # the stages, the schedule and what
            # moves between them (eval and predict run dist.jit's cut: their plans below)
            placed = self._batch(batch, "train")
            self._check_loss_args(placed)
            inputs, labels = ((placed, ()) if len(placed) == 1
                              else (placed[:-1], placed[-1:]))
            return "\n".join([head, self._pipeline.explain(self.params, inputs, *labels,
                                                                **self._pipeline_state())])
        name = "merge" if name == "train" and self.k_steps > 1 else name
        args = self.program_args(name, *batch)
        f = self._program(name, args)
        plans = f.stage_plans(*args)

        def counts(plan) -> str:
            # as often as one step runs them (a scanned layer's once per layer)
            text = ", ".join(f"{n} {k}" for k, n in
                             sorted(plan.collective_counts(per_call=True).items()))
            return (text or "no collectives") + ("" if plan.runs_known else
                                                 " (a while loop's body counted once)")

        def sent(plan) -> str:
            return f"{format_bytes(plan.bytes_per_call())} sent per device"

        if len(plans) > 1:  # a model whose forward moves to other meshes: a program per stage
            return "\n".join([head] + [
                f"stage {k} on devices {plan.mesh.process_ids}: {counts(plan)}; {sent(plan)}"
                for k, plan in enumerate(plans)])
        memory = f.lower(*args).compile().memory_analysis()
        steps = [f"per step: {counts(plans[0])}; {sent(plans[0])}"]
        if name == "merge":  # a cycle is k - 1 accumulating steps, then the merging one
            acc = self._program("accumulate", self.program_args("accumulate", *batch))
            acc_plan = acc.stage_plans(*self.program_args("accumulate", *batch))[0]
            steps = [f"per accumulating step ({self.k_steps - 1} of every {self.k_steps}): "
                     f"{counts(acc_plan)}; {sent(acc_plan)}",
                     f"per merging step (1 of every {self.k_steps}): {counts(plans[0])}; "
                     f"{sent(plans[0])}"]
        return "\n".join([
            head, *steps,
            f"memory per device: arguments {format_bytes(memory.argument_size_in_bytes)}, "
            f"temporaries {format_bytes(memory.temp_size_in_bytes)}, outputs "
            f"{format_bytes(memory.output_size_in_bytes)}"
            # outputs written over donated arguments (the train step's params and states)
            + (f" ({format_bytes(memory.alias_size_in_bytes)} of them in the arguments' "
               f"buffers)" if memory.alias_size_in_bytes else "")])

    def _summary_program(self) -> tuple[str, str]:
        """The program summary() describes — the train step, else the step this model can
        run (an eval-only model's train step would fail inside its trace on the missing
        optimizer) — and, for one that is not the train step, a line saying so."""
        name = self._runnable()[0]
        if name == "train":
            return name, ""
        missing = "optimizer" if self._loss_fn is not None else "loss_fn"
        return name, (f"the {name} step (this DistModel has no {missing}, so no train step: "
                      f"pass one to dist.to_static for the train step's summary)")

    def profile(self, *batch: Any, steps: int = 3):
        """With strategy.pipeline: each stage's forward and backward measured on this batch
        (PipelineRunner.profile: per-stage times, busy time per rank, stage balance, the
        schedule replayed with the measured costs). Runs the step's forward and backward
        `2 * steps + 1` times without updating anything."""
        if self._pipeline is None:
            raise DistModelError("profile measures pipeline stages: this DistModel has no "
                                 "strategy.pipeline (see summary() for its one program)")
        placed = self._batch(batch, "train")
        self._check_loss_args(placed)
        inputs, labels = (placed, ()) if len(placed) == 1 else (placed[:-1], placed[-1:])
        extra = (self.scaler_state["scale"],) if self.scaler_state else ()
        return self._pipeline.profile(self.params, inputs, *labels, *extra, steps=steps,
                                      **self._pipeline_state())

    def _pipeline_state(self) -> dict:
        return {"state": self.state} if self._pipeline.stateful else {}

    def programs(self) -> dict[str, Any]:
        """The compiled programs built so far, by mode (their .plan / .explain / .lower)."""
        return dict(self._programs)

    # -- state --------------------------------------------------------------------------------
    # state_dict names: param.* (nnx.Param), state.* (other model variables: batch statistics,
    # RNG counters and key data), opt.* (optimizer state), amp.* (the float16 loss scaler).
    # With gradient merge, gm.acc.* (the gradients summed so far in the cycle, reduced: a
    # Partial accumulator is saved as its sum) and gm.step (the micro-steps done in it): a
    # model restored mid-cycle continues it.
    _GROUPS = (("param", "params", ("all", "param")), ("state", "state", ("all", "param")),
               ("opt", "opt_state", ("all", "opt")), ("amp", "scaler_state", ("all", "opt")),
               ("gm", "_merge_state", ("all", "opt")))

    @property
    def _merge_state(self) -> dict | None:
        """{"acc": the pending accumulated gradients (zeros between cycles), "step": the
        micro-steps of the current cycle done}, or None without gradient merge."""
        if self.k_steps == 1 or self.optimizer is None:
            return None
        return self._merge_state_at(self._micro, self._acc)

    def _merge_state_at(self, micro: int, acc: Any) -> dict:
        if acc is None:  # between cycles: zeros, placed like the params (ZeRO-2/3: shards)
            stage = self.optimizer.stage
            acc = jax.tree.map(
                lambda p: shard_tensor(np.zeros(p.shape, p.dtype), p.mesh,
                                       self.optimizer.state_placements(p) if stage >= 2
                                       else p.placements), self.params, is_leaf=_is_dt)
        step = shard_tensor(np.asarray(micro, np.int32), self.mesh,
                            [Replicate()] * self.mesh.ndim)
        return {"acc": acc, "step": step}

    @_merge_state.setter
    def _merge_state(self, value: dict) -> None:
        self._micro = self._merge_step(value["step"])
        self._acc = value["acc"] if self._micro else None

    def _merge_step(self, value: Any) -> int:
        """A loaded gm.step, checked against this model's k_steps."""
        step = int(np.asarray(value.numpy() if _is_dt(value) else value))
        if not 0 <= step < self.k_steps:
            raise DistModelError(
                f"set_state_dict: 'gm.step' is {step}, but this model's gradient merge has "
                f"k_steps = {self.k_steps} (a cycle is at micro-step 0 to {self.k_steps - 1}): "
                f"load a checkpoint saved with the same k_steps, or leave out the gm.* entries "
                f"to start a new cycle")
        return step

    def state_dict(self, mode: str = "all") -> dict[str, DistTensor]:
        if mode not in ("all", "param", "opt"):
            raise DistModelError(f"state_dict(mode={mode!r}): mode is 'all', 'param' or 'opt'")
        out = ModelStateDict()
        for prefix, attr, modes in self._GROUPS:
            tree = getattr(self, attr)
            if mode in modes and tree is not None:
                out.update(_flat(prefix, tree))
        out._owner = weakref.ref(self)
        return out

    def _fresh_run_state(self) -> dict[str, Any]:
        """The gm.* / amp.* entries of a model between cycles with a fresh loss scaler: what
        load_state_dict puts where a checkpoint has none (one saved without them)."""
        fresh: dict[str, Any] = {}
        if self.k_steps > 1 and self.optimizer is not None:
            fresh.update(_flat("gm", self._merge_state_at(0, None)))
        if self._scaler is not None:
            fresh.update(_flat("amp", jax.tree.map(self._replicated, self._scaler.init_state())))
        return fresh

    def set_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, Mapping):
            raise DistModelError(
                f"set_state_dict takes a dict of name -> value, as dist_model.state_dict() "
                f"returns (e.g. sd = dist_model.state_dict(); dist.load_state_dict(sd, path); "
                f"dist_model.set_state_dict(sd)), got {state_dict!r:.60} of type "
                f"{type(state_dict).__name__}")
        trees = [(prefix, attr, getattr(self, attr)) for prefix, attr, _ in self._GROUPS]
        known = [n for prefix, _, tree in trees if tree is not None for n in _flat(prefix, tree)]
        unknown = sorted(set(state_dict) - set(known))
        if unknown:  # a typo, or another model's names: say so rather than load nothing
            text = ", ".join(f"{k!r}{did_you_mean(k, known)}" for k in unknown)
            message = (f"set_state_dict: {len(unknown)} of {len(state_dict)} keys name nothing in "
                       f"this model: {text}; its keys are those of model.state_dict(), e.g. "
                       f"{known[:3]}")
            if len(unknown) == len(state_dict):
                raise DistModelError(message + " — nothing was loaded")
            warnings.warn(message + " — they were skipped", UserWarning, stacklevel=2)
        if "gm.step" in state_dict and self.k_steps > 1:
            self._merge_step(state_dict["gm.step"])  # before anything is loaded
        # a state without the run state (params and optimizer state only: one saved without
        # gradient merge or loss scaling) starts a new cycle with a fresh scaler, as the
        # model's pending micro-steps were taken with other weights
        state_dict = {**self._fresh_run_state(), **state_dict} if not any(
            k.startswith(_RUN_STATE) for k in state_dict) else state_dict
        for prefix, attr, tree in trees:
            if tree is not None:
                setattr(self, attr, _load_group(prefix, tree, state_dict))
        self._parts.write_back(self.params, self.state)


class ModelStateDict(dict):
    """DistModel.state_dict()'s dict of name -> tensor; `fresh_run_state()` gives the gm.* /
    amp.* entries of a new cycle and scaler, which load_state_dict puts where a checkpoint has
    none. A pytree as a dict is (the same keys, in the same order); pickled or copied, the
    plain dict it is (the model is only referred to, weakly: a copy of the state is not a
    copy of the model)."""

    _owner: Any = None  # weakref.ref to the DistModel

    def fresh_run_state(self) -> dict[str, Any]:
        model = self._owner() if self._owner is not None else None
        return {} if model is None else model._fresh_run_state()

    def __reduce__(self):
        return (dict, (dict(self),))


jax.tree_util.register_pytree_with_keys(
    ModelStateDict,
    lambda d: ([(jax.tree_util.DictKey(k), d[k]) for k in sorted(d)], tuple(sorted(d))),
    lambda keys, values: ModelStateDict(zip(keys, values)),
    flatten_func=lambda d: ([d[k] for k in sorted(d)], tuple(sorted(d))))


def _load_group(prefix: str, tree: Any, state_dict: dict[str, Any]) -> Any:
    """`tree` with the values state_dict has for its names, placed as the tree's leaves are."""
    names = list(_flat(prefix, tree))
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_dt)
    new = []
    for name, leaf in zip(names, leaves):
        value = state_dict.get(name, leaf)
        if _is_dt(leaf) and value is not leaf:
            keys = hasattr(value, "dtype") and is_key(value)  # held as their key data
            value = jax.random.key_data(value.physical if _is_dt(value) else value) if (
                keys and not is_key(leaf)) else value
            if tuple(np.shape(value)) != tuple(leaf.shape):
                raise DistModelError(
                    f"set_state_dict: {name!r} has shape {tuple(np.shape(value))}, the model's "
                    f"is {leaf.shape}" + (
                        " (PRNG keys are stored as their key data, jax.random.key_data(key): "
                        "a key of another implementation has another width; make it with the "
                        "model's, e.g. jax.random.key(seed))" if keys else ""))
            if _is_dt(value):  # in the param's dtype, as a host value is: a float32 master
                # weight set from a bfloat16 copy stays float32
                value = reshard(value, leaf.mesh, leaf.placements)
                value = value if value.dtype == leaf.dtype else value.astype(leaf.dtype)
            else:
                cast = np.asarray(value) if is_key(leaf) else exact_cast(value, leaf.dtype)
                if cast is None:
                    raise DistModelError(
                        f"set_state_dict: {name!r} is {value!r:.60}, which {leaf.dtype} cannot "
                        f"hold exactly (the model's value is {leaf.dtype}): give a value in "
                        f"its range{', a whole number' if np.issubdtype(leaf.dtype, np.integer) else ''}")
                value = shard_tensor(cast, leaf.mesh, leaf.placements)
        new.append(value)
    return jax.tree.unflatten(treedef, new)


def _flat(prefix: str, tree: Any) -> dict[str, Any]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_dt)[0]:
        name = ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        if f"{prefix}.{name}" in out:  # one name for two leaves: a state dict would lose one
            raise DistModelError(
                f"two entries of the model's {prefix} tree are both named {prefix + '.' + name!r} in "
                f"the state dict (a key containing '.' clashes with a nested path, "
                f"{jax.tree_util.keystr(path)}): rename the key")
        out[f"{prefix}.{name}"] = leaf
    return out


def _unflatten_like(tree: Any, leaves: list) -> Any:
    treedef = jax.tree.structure(tree, is_leaf=_is_dt)
    return jax.tree.unflatten(treedef, leaves)


@paddle_names(layer="model", loss="loss_fn")
def to_static(model: Any, loader: Any = None, loss_fn: Callable | None = None,
              optimizer: Any = None, strategy: Strategy | dict | None = None) -> DistModel:
    """Paddle's dist.to_static: compile the whole training step of `model` across its mesh.

    `strategy`: a dist.Strategy or the dict dist.Strategy takes. `loss_fn(output, label)`: the
    label is the batch's last element; a list of labels, dist_model([x1, x2], [y1, y2]), is
    passed one per argument, loss_fn(output, y1, y2), as Paddle does. The mesh is the placed
    params' (or the one flax sharded them on), else the loader's, else dist.set_mesh's."""
    return DistModel(model, loader, loss_fn, optimizer, strategy)


__all__ = ["to_static", "DistModel", "DistModelError"]
