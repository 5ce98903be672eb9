"""to_static → DistModel: one compiled program per mode (train: forward, backward and optimizer
update; eval: the loss; predict: the outputs), over a flax nnx Module or an (apply_fn, params)
pair, with the Strategy's sharding stage, gradient merge, AMP and recompute applied.

Gradient merge keeps the summed gradients Partial across calls — each micro-step adds its
still-unreduced gradients into an accumulator that lives as Partial DistTensors — and reduces
once, in the k-th call, where the optimizer update consumes them.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..compiler.jit import jit
from ..creation import shard_tensor
from ..dtensor import DistTensor
from ..errors import AutoshardError
from ..mesh import ProcessMesh
from ..placement import Partial, Replicate, Shard
from ..reshard.api import reshard
from .optimizer import (ShardedOptimizer, ShardingStage1, ShardingStage2, ShardingStage3,
                        place_params, shard_optimizer)
from .strategy import Strategy

_STAGES = {1: ShardingStage1, 2: ShardingStage2, 3: ShardingStage3}


class DistModelError(AutoshardError, ValueError):
    """A model, batch or mode that to_static cannot work with."""


def _is_dt(x: Any) -> bool:
    return isinstance(x, DistTensor)


def _split_model(model: Any) -> tuple[Callable, Any]:
    """(apply(params, *inputs), params) for an nnx Module or an (apply_fn, params) pair."""
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is a dependency
        nnx = None
    if nnx is not None and isinstance(model, nnx.Module):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        pure = nnx.to_pure_dict(params)

        def apply(p, *inputs):
            state = nnx.State(p) if not isinstance(p, nnx.State) else p
            return nnx.merge(graphdef, state, rest)(*inputs)

        return apply, pure
    if isinstance(model, tuple) and len(model) == 2 and callable(model[0]):
        return model
    raise DistModelError(
        f"to_static needs a flax nnx Module or an (apply_fn, params) pair, got "
        f"{type(model).__name__}: for linen write dist.to_static((module.apply, params), ...)")


def _find_mesh(params: Any, loader: Any) -> ProcessMesh:
    for leaf in jax.tree.leaves(params, is_leaf=_is_dt):
        if _is_dt(leaf):
            return leaf.mesh
    meshes = getattr(loader, "meshes", None)
    if meshes:
        return meshes[0] if isinstance(meshes, (list, tuple)) else meshes
    raise DistModelError("to_static found no mesh: place the params with dist.shard_tensor / "
                         "dist.shard_layer, or pass a dist.shard_dataloader")


class DistModel:
    """What dist.to_static returns; call it with a batch (see `__call__`)."""

    def __init__(self, model: Any, loader: Any, loss_fn: Callable | None, optimizer: Any,
                 strategy: Strategy | None = None):
        self.strategy = strategy if strategy is not None else Strategy()
        self._apply, params = _split_model(model)
        self._model = model
        self._loss_fn = loss_fn
        self.mesh = _find_mesh(params, loader)
        replicated = [Replicate()] * self.mesh.ndim
        params = jax.tree.map(lambda p: p if _is_dt(p) else shard_tensor(np.asarray(p), self.mesh, replicated),
                              params, is_leaf=_is_dt)
        self._compute = jax.tree.map(lambda p: list(p.placements), params, is_leaf=_is_dt)
        self.optimizer = self._sharded_optimizer(optimizer) if optimizer is not None else None
        self.params = place_params(params, self.optimizer) if self.optimizer else params
        self.opt_state = self.optimizer.init(self.params) if self.optimizer else None
        self._dp = "dp" if "dp" in self.mesh.dim_names else self.mesh.dim_names[0]
        gm = self.strategy.gradient_merge
        self.k_steps = gm.k_steps if gm.enable else 1
        self._micro = 0
        self._acc = None
        self._mode = "train"
        self._programs: dict[str, Any] = {}

    # -- configuration ----------------------------------------------------------------------
    def _sharded_optimizer(self, optimizer: Any) -> ShardedOptimizer:
        opt = optimizer if isinstance(optimizer, ShardedOptimizer) else shard_optimizer(optimizer)
        sharding = self.strategy.sharding
        if sharding.enable and opt.stage == 0:
            opt = ShardedOptimizer(opt.tx, _STAGES[sharding.stage](sharding.mesh_dim),
                                   opt.gradient_accumulation_steps)
        return opt

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

    # -- the traced pieces ------------------------------------------------------------------
    def _compute_view(self, params: Any) -> Any:
        """Params as the forward uses them: gathered from ZeRO-3 storage, cast for AMP."""
        if self.optimizer is not None and self.optimizer.stage == 3:
            params = jax.tree.map(lambda p, pl: reshard(p, self.mesh, pl), params, self._compute,
                                  is_leaf=lambda x: isinstance(x, list))
        amp = self.strategy.amp
        if amp.enable:
            dtype = jnp.dtype(amp.dtype)
            params = jax.tree.map(
                lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)
        return params

    def _forward(self, params: Any, inputs: tuple) -> Any:
        apply = self._apply
        recompute = self.strategy.recompute
        if recompute.enable:
            policy = recompute.policy
            if isinstance(policy, str):
                policy = getattr(jax.checkpoint_policies, policy)
            apply = jax.checkpoint(apply, policy=policy)
        amp = self.strategy.amp
        if amp.enable:
            dtype = jnp.dtype(amp.dtype)
            inputs = tuple(x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
                           for x in inputs)
        return apply(self._compute_view(params), *inputs)

    def _loss(self, params: Any, batch: tuple) -> Any:
        if self._loss_fn is None:
            raise DistModelError("this DistModel has no loss_fn: pass one to dist.to_static, or "
                                 "use .predict()")
        if len(batch) == 1:
            loss = self._loss_fn(self._forward(params, batch))
        else:
            loss = self._loss_fn(self._forward(params, batch[:-1]), batch[-1])
        return loss.astype(jnp.float32)

    def _grads(self, params: Any, batch: tuple):
        amp = self.strategy.amp
        scale = float(amp.init_loss_scaling) if amp.enable and amp.dtype == "float16" else 1.0
        loss, grads = jax.value_and_grad(lambda p: self._loss(p, batch) * scale)(params)
        if scale != 1.0:  # static loss scaling keeps float16 gradients from underflowing
            loss = loss / scale
            grads = jax.tree.map(lambda g: g / scale, grads)
        return loss, grads

    def _update(self, params, opt_state, grads):
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # -- programs -----------------------------------------------------------------------------
    def _placements(self, tree: Any) -> list:
        return [x.placements for x in jax.tree.leaves(tree, is_leaf=_is_dt)]

    def _acc_placements(self) -> list:
        """Gradient accumulators: Partial on every mesh dim the param does not split."""
        return [[Partial() if isinstance(q, Replicate) else q for q in p.placements]
                for p in jax.tree.leaves(self.params, is_leaf=_is_dt)]

    def _program(self, name: str):
        if name in self._programs:
            return self._programs[name]
        scalar = [Replicate()] * self.mesh.ndim
        params_out = self._placements(self.params)
        state_out = self._placements(self.opt_state) if self.opt_state is not None else []
        if name == "train":
            def step(params, opt_state, *batch):
                loss, grads = self._grads(params, batch)
                params, opt_state = self._update(params, opt_state, grads)
                return params, opt_state, loss
            out = params_out + state_out + [scalar]
        elif name == "accumulate":
            def step(params, acc, *batch):
                loss, grads = self._grads(params, batch)
                return jax.tree.map(jnp.add, acc, grads), loss
            out = self._acc_placements() + [scalar]
        elif name == "merge":
            k, avg = self.k_steps, self.strategy.gradient_merge.avg

            def step(params, opt_state, acc, *batch):
                loss, grads = self._grads(params, batch)
                total = jax.tree.map(jnp.add, acc, grads)
                if avg:
                    total = jax.tree.map(lambda g: g / k, total)
                params, opt_state = self._update(params, opt_state, total)
                return params, opt_state, loss
            out = params_out + state_out + [scalar]
        elif name == "eval":
            def step(params, *batch):
                return self._loss(params, batch)
            out = [scalar]
        else:
            def step(params, *batch):
                return self._forward(params, batch)
            out = None
        self._programs[name] = jit(step, out_placements=out)
        return self._programs[name]

    def _zero_acc(self):
        if self._acc is None:
            self._acc = jax.tree.map(
                lambda p, pl: shard_tensor(np.zeros(p.shape, p.dtype), self.mesh, pl),
                self.params, _unflatten_like(self.params, self._acc_placements()),
                is_leaf=lambda x: _is_dt(x) or isinstance(x, list))
        return self._acc

    def _batch(self, batch: tuple) -> tuple:
        if len(batch) == 1 and isinstance(batch[0], (tuple, list)):
            batch = tuple(batch[0])
        if len(batch) == 1 and isinstance(batch[0], dict):
            raise DistModelError("dict batches: call the model with the inputs and label in "
                                 "order, e.g. dist_model(batch['x'], batch['y'])")
        out = []
        n = self.mesh.get_dim_size(self._dp)
        for x in batch:  # unplaced arrays are split over the data-parallel dim when they can be
            if not _is_dt(x) and np.ndim(x) and np.shape(x)[0] % n == 0:
                placements = [Shard(0) if d == self._dp else Replicate() for d in self.mesh.dim_names]
                x = shard_tensor(x, self.mesh, placements)
            out.append(x)
        return tuple(out)

    # -- calls ----------------------------------------------------------------------------------
    def __call__(self, *batch: Any) -> DistTensor:
        """train: one step (loss); eval: the loss; predict: the model's outputs."""
        batch = self._batch(batch)
        if self._mode == "predict":
            return self._program("predict")(self.params, *batch)
        if self._mode == "eval":
            return self._program("eval")(self.params, *batch)
        if self.optimizer is None:
            raise DistModelError("train mode needs an optimizer: pass one to dist.to_static")
        if self.k_steps == 1:
            self.params, self.opt_state, loss = self._program("train")(self.params, self.opt_state, *batch)
            return loss
        self._micro += 1
        if self._micro < self.k_steps:
            self._acc, loss = self._program("accumulate")(self.params, self._zero_acc() if self._acc is None else self._acc, *batch)
            return loss
        acc = self._acc if self._acc is not None else self._zero_acc()
        self.params, self.opt_state, loss = self._program("merge")(self.params, self.opt_state, acc, *batch)
        self._micro, self._acc = 0, None
        return loss

    def summary(self, *batch: Any) -> str:
        """The train step's plan in a few lines: collectives, bytes, memory per device."""
        from ..reshard.planner import format_bytes

        batch = self._batch(batch)
        name = "train" if self.k_steps == 1 else "merge"
        args = (self.params, self.opt_state) + ((self._zero_acc(),) if name == "merge" else ())
        f = self._program(name)
        plan = f.plan(*args, *batch)
        memory = f.lower(*args, *batch).compile().memory_analysis()
        counts = ", ".join(f"{n} {k}" for k, n in sorted(plan.collective_counts().items())) or "none"
        lines = [f"mesh {self.mesh.shape} {self.mesh.dim_names}; strategy: sharding stage "
                 f"{self.optimizer.stage if self.optimizer else 0}, gradient merge k={self.k_steps}, "
                 f"amp {'on' if self.strategy.amp.enable else 'off'}, recompute "
                 f"{'on' if self.strategy.recompute.enable else 'off'}",
                 f"per step: {counts}; {format_bytes(plan.total_bytes)} sent per device",
                 f"memory per device: arguments {format_bytes(memory.argument_size_in_bytes)}, "
                 f"temporaries {format_bytes(memory.temp_size_in_bytes)}, outputs "
                 f"{format_bytes(memory.output_size_in_bytes)}"]
        return "\n".join(lines)

    def programs(self) -> dict[str, Any]:
        """The compiled programs built so far, by mode (their .plan / .explain / .lower)."""
        return dict(self._programs)

    # -- state --------------------------------------------------------------------------------
    def state_dict(self, mode: str = "all") -> dict[str, DistTensor]:
        if mode not in ("all", "param", "opt"):
            raise DistModelError(f"state_dict(mode={mode!r}): mode is 'all', 'param' or 'opt'")
        out: dict[str, DistTensor] = {}
        if mode in ("all", "param"):
            out.update(_flat("param", self.params))
        if mode in ("all", "opt") and self.opt_state is not None:
            out.update(_flat("opt", self.opt_state))
        return out

    def set_state_dict(self, state_dict: dict[str, Any]) -> None:
        for prefix, attr in (("param", "params"), ("opt", "opt_state")):
            tree = getattr(self, attr)
            if tree is None:
                continue
            names = list(_flat(prefix, tree))
            leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_dt)
            new = []
            for name, leaf in zip(names, leaves):
                value = state_dict.get(name, leaf)
                if _is_dt(leaf) and value is not leaf:
                    if tuple(np.shape(value)) != tuple(leaf.shape):
                        raise DistModelError(f"set_state_dict: {name!r} has shape "
                                             f"{tuple(np.shape(value))}, the model's is {leaf.shape}")
                    value = (reshard(value, leaf.mesh, leaf.placements) if _is_dt(value)
                             else shard_tensor(np.asarray(value), leaf.mesh, leaf.placements))
                new.append(value)
            setattr(self, attr, jax.tree.unflatten(treedef, new))


def _flat(prefix: str, tree: Any) -> dict[str, Any]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_dt)[0]:
        name = ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        out[f"{prefix}.{name}"] = leaf
    return out


def _unflatten_like(tree: Any, leaves: list) -> Any:
    treedef = jax.tree.structure(tree, is_leaf=_is_dt)
    return jax.tree.unflatten(treedef, leaves)


def to_static(model: Any, loader: Any = None, loss_fn: Callable | None = None,
              optimizer: Any = None, strategy: Strategy | None = None) -> DistModel:
    """Paddle's dist.to_static: compile the whole training step of `model` across its mesh."""
    return DistModel(model, loader, loss_fn, optimizer, strategy)


__all__ = ["to_static", "DistModel", "DistModelError"]
