"""shard_optimizer: an optax transformation whose states live where their params live, or are
split along one mesh dim (ZeRO stages 1–3).

Stage 1 splits the optimizer states along `mesh_dim`; stage 2 also reduce-scatters the
gradients into that split (in one compiled step the compiler does this for stage 1 too: the
update consumes each gradient where its state shard lives, so the two compile to the same
step); stage 3 also stores the params split and gathers each one where the forward and
backward use it (FSDP). With gradient merge the stages differ in the accumulator (see
DistModel): stage 1 keeps the whole unreduced gradient, stage 2 and 3 only the local shard.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np
import optax

from ..dtensor import DistTensor, is_dist_tensor as _is_dt
from ..errors import AutoshardError
from ..mesh import ProcessMesh
from ..paddle_names import paddle_names
from ..placement import Placement, Replicate, Shard


class OptimizerError(AutoshardError, ValueError):
    """An optimizer or sharding stage that does not fit the params or the mesh."""


@dataclass(frozen=True)
class _Stage:
    mesh_dim: str | int | None = None
    mesh: ProcessMesh | None = None
    level: int = 0

    def __post_init__(self) -> None:
        name = f"ShardingStage{self.level}"
        dim = self.mesh_dim
        if not (dim is None or isinstance(dim, str) or (isinstance(dim, int)
                                                        and not isinstance(dim, bool))):
            raise OptimizerError(f"{name}(mesh_dim={dim!r}): mesh_dim is the mesh dim the "
                                 f"states are split over: a dim name such as 'dp', its index, "
                                 f"or None (the mesh's 'dp' or first dim)")
        if self.mesh is not None:
            if not isinstance(self.mesh, ProcessMesh):
                raise OptimizerError(f"{name}(mesh={self.mesh!r:.60}): mesh is a "
                                     f"{type(self.mesh).__name__}, not a dist.ProcessMesh: "
                                     f"write {name}('dp', mesh) with the params' ProcessMesh, "
                                     f"or leave it out")
            self.axis(self.mesh)  # a dim the mesh lacks fails here, not at the first step

    def axis(self, mesh: ProcessMesh) -> str:
        dim = self.mesh_dim
        if dim is None:
            dim = "dp" if "dp" in mesh.dim_names else mesh.dim_names[0]
        if isinstance(dim, int) and -len(mesh.dim_names) <= dim < len(mesh.dim_names):
            return mesh.dim_names[dim]
        if dim not in mesh.dim_names:
            raise OptimizerError(
                f"ShardingStage{self.level}(mesh_dim={dim!r}): the params' mesh has dims "
                f"{mesh.dim_names}; name one of them, e.g. ShardingStage{self.level}("
                f"{mesh.dim_names[0]!r})")
        return dim


class ShardingStage1(_Stage):
    @paddle_names(sharding_mesh_dim="mesh_dim")
    def __init__(self, mesh_dim: str | int | None = None, mesh: ProcessMesh | None = None):
        if isinstance(mesh_dim, ProcessMesh):  # Paddle's older ShardingStage1(mesh) spelling
            mesh_dim, mesh = None, mesh_dim
        super().__init__(mesh_dim, mesh, 1)


class ShardingStage2(_Stage):
    @paddle_names(sharding_mesh_dim="mesh_dim")
    def __init__(self, mesh_dim: str | int | None = None, mesh: ProcessMesh | None = None):
        if isinstance(mesh_dim, ProcessMesh):
            mesh_dim, mesh = None, mesh_dim
        super().__init__(mesh_dim, mesh, 2)


class ShardingStage3(_Stage):
    @paddle_names(sharding_mesh_dim="mesh_dim")
    def __init__(self, mesh_dim: str | int | None = None, mesh: ProcessMesh | None = None):
        if isinstance(mesh_dim, ProcessMesh):
            mesh_dim, mesh = None, mesh_dim
        super().__init__(mesh_dim, mesh, 3)


def split_placements(placements: Sequence[Placement], shape: Sequence[int], mesh: ProcessMesh,
                     axis: str) -> list[Placement]:
    """`placements` with mesh dim `axis` also splitting the first tensor dim that can take it.

    A dim already split by another mesh dim is skipped (it would need a co-shard order), as is
    one that the axis does not divide; a tensor with no such dim keeps its placements.
    """
    out = list(placements)
    k = mesh.dim_names.index(axis)
    if not isinstance(out[k], Replicate):
        return out
    used = {p.dim % len(shape) for p in out if isinstance(p, Shard)}
    n = mesh.get_dim_size(axis)
    for d, size in enumerate(shape):
        if d not in used and size % n == 0 and size >= n:
            out[k] = Shard(d)
            return out
    return out



def unwrap_optimizer(optimizer: Any) -> Any:
    """nnx.Optimizer(model, tx, wrt=...) → its optax tx.

    The port of Paddle's `AdamW(parameters=model.parameters())`; the DistModel (or the user's
    dist.jit step) owns the params and the optimizer state, so only the rule is needed.
    """
    tx = getattr(optimizer, "tx", None)
    if tx is not None and not hasattr(optimizer, "init") and hasattr(tx, "init"):
        return tx
    return optimizer


class ShardedOptimizer:
    """An optax GradientTransformation plus where its states (and, at stage 3, params) live."""

    def __init__(self, tx: optax.GradientTransformation, shard_fn: Any = None,
                 gradient_accumulation_steps: int = 1, offload: bool = False):
        # nnx.Optimizer(model, tx, wrt=filter): the params it updates (to_static keeps the
        # others as they are, as nnx's update does: `restricted_to`)
        self.wrt = getattr(tx, "wrt", None) if hasattr(tx, "tx") else None
        if isinstance(tx, ShardedOptimizer):
            offload = offload or tx.offload
            self.wrt = tx.wrt
            tx = tx.tx
        tx = unwrap_optimizer(tx)
        if not hasattr(tx, "init") or not hasattr(tx, "update"):
            raise OptimizerError(f"shard_optimizer needs an optax GradientTransformation, got "
                                 f"{type(tx).__name__}: write dist.shard_optimizer(optax.adamw(1e-3))")
        if shard_fn is not None and not isinstance(shard_fn, _Stage) and (
                not callable(shard_fn) or _positional_count(shard_fn) not in (-1, 2, 3)):
            raise OptimizerError(
                f"shard_fn must be dist.ShardingStage1/2/3(mesh_dim) or a function of (param, "
                f"state) or, as Paddle's, of (accumulator_name, param, accumulator), answering "
                f"the state's placements or the state placed, got {shard_fn!r}")
        if isinstance(gradient_accumulation_steps, bool) or not isinstance(
                gradient_accumulation_steps, (int, np.integer)) or gradient_accumulation_steps < 1:
            raise OptimizerError(f"gradient_accumulation_steps must be an int >= 1, got "
                                 f"{gradient_accumulation_steps!r}")
        if not isinstance(offload, (bool, np.bool_)):  # a string "False" would turn offloading on
            raise OptimizerError(f"shard_optimizer: offload is a switch: write True or False, "
                                 f"not {offload!r}")
        self.tx = tx
        self.shard_fn = shard_fn
        self.gradient_accumulation_steps = int(gradient_accumulation_steps)
        # the states live in host memory between steps (Paddle's optimize_offload): a step's
        # program copies them in for the update and back out (dist.jit's host offloading)
        self.offload = bool(offload)

    def restricted_to(self, trained: set, params: dict) -> "ShardedOptimizer":
        """This optimizer updating only the params at `trained` paths (flattened nested-dict
        keys): the others get a zero update and no state."""
        from .model_state import flatten_dict, unflatten_dict

        flat = flatten_dict(params)
        if all(path in trained for path in flat):
            return self
        labels = unflatten_dict({path: "train" if path in trained else "frozen" for path in flat})
        tx = optax.multi_transform({"train": self.tx, "frozen": optax.set_to_zero()}, labels)
        out = ShardedOptimizer(tx, self.shard_fn, self.gradient_accumulation_steps, self.offload)
        out.wrt = self.wrt
        return out

    @property
    def stage(self) -> int:
        return self.shard_fn.level if isinstance(self.shard_fn, _Stage) else 0

    # -- placements ------------------------------------------------------------------------
    def storage_placements(self, param: DistTensor) -> list[Placement]:
        """Where a param is stored between steps: split along the stage's axis at stage 3."""
        if self.stage == 3:
            return split_placements(param.placements, param.shape, param.mesh,
                                    self.shard_fn.axis(param.mesh))
        return list(param.placements)

    def state_placements(self, param: DistTensor) -> list[Placement]:
        if self.stage >= 1:
            return split_placements(param.placements, param.shape, param.mesh,
                                    self.shard_fn.axis(param.mesh))
        return list(param.placements)

    def _state_targets(self, state_shapes: Any, params: Any) -> Any:
        """Mesh and placements for every state leaf: those mirroring a param live where it
        does; others (a step count) replicate on the first param's mesh."""
        params_tree = jax.tree.structure(params, is_leaf=_is_dt)
        mesh = next(p.mesh for p in jax.tree.leaves(params, is_leaf=_is_dt) if _is_dt(p))
        replicated = _Target(mesh, [Replicate()] * mesh.ndim, mirrors=False)

        def mirrors_params(node) -> bool:
            # a subtree shaped like the params (adam's mu, nu); in optax.masked's and
            # multi_transform's states (nnx.Optimizer's `wrt`, frozen layers) a MaskedNode
            # stands where a param has no state
            return jax.tree.structure(node, is_leaf=_masked) == params_tree

        def target(name, s, p):
            if _masked(s):
                return s  # no state here: nothing to place
            if _is_dt(p) and tuple(s.shape) == tuple(p.shape):
                return _Target(p.mesh, self._custom(p, s, name) or self.state_placements(p))
            return replicated

        def place(path, node):
            if not mirrors_params(node):
                return replicated
            # the state's name as optax's state field holding it (adam's "mu", "nu")
            fields = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
            name = fields[-1] if fields else "state"
            return jax.tree.map(functools.partial(target, name), node, params,
                                is_leaf=lambda x: _is_dt(x) or _masked(x))

        return jax.tree_util.tree_map_with_path(place, state_shapes, is_leaf=mirrors_params)

    def _custom(self, param: DistTensor, state_leaf, name: str) -> list[Placement] | None:
        """A user's shard_fn: `fn(param, state)` or Paddle's `fn(accumulator_name, param,
        accumulator)`, answering placements or the state placed (Paddle's
        `dist.shard_tensor(accumulator, mesh, placements)`); None keeps the default."""
        fn = self.shard_fn
        if fn is None or isinstance(fn, _Stage):
            return None
        # a stand-in for the state: zeros of its shape and dtype that hold no memory
        leaf = np.broadcast_to(np.zeros((), state_leaf.dtype), tuple(state_leaf.shape))
        if _positional_count(fn) == 3:
            out = fn(name, param, leaf)
        else:
            out = fn(param, leaf)
        if out is None:
            return None
        if _is_dt(out):
            if out.mesh != param.mesh:
                raise OptimizerError(
                    f"shard_fn placed the optimizer state {name!r} of a param on {param.mesh!r} "
                    f"on {out.mesh!r}: a state lives on its param's mesh")
            return list(out.placements)
        if isinstance(out, (list, tuple)) and all(isinstance(q, Placement) for q in out):
            return list(out)
        raise OptimizerError(
            f"shard_fn returned {type(out).__name__} for the optimizer state {name!r}: return "
            f"its placements (e.g. [dist.Shard(0), dist.Replicate()]), the state placed "
            f"(dist.shard_tensor(accumulator, param.mesh, placements)), or None for the default")

    # -- optax interface -------------------------------------------------------------------
    def init(self, params: Any) -> Any:
        """Optimizer states as DistTensors placed by the policy (built where they live)."""
        from ..compiler.jit import jit

        leaves = [p for p in jax.tree.leaves(params, is_leaf=_is_dt) if _is_dt(p)]
        if not leaves:
            raise OptimizerError("shard_optimizer.init needs params that are DistTensors: place "
                                 "them with dist.shard_tensor or dist.shard_layer first")
        mesh = leaves[0].mesh
        if isinstance(self.shard_fn, _Stage):
            # a mesh dim the params' mesh lacks is an error even where no state is sharded yet
            # (sgd keeps none): it would surface only once the optimizer is swapped for adam
            meshes = list({id(p.mesh): p.mesh for p in leaves}.values())
            for m in meshes:
                try:
                    self.shard_fn.axis(m)
                except OptimizerError:
                    if len(meshes) == 1:
                        raise
                    # params on several meshes (pipeline stages): the dim must be on each
                    common = [d for d in meshes[0].dim_names
                              if all(d in q.dim_names for q in meshes)]
                    level, dim = self.shard_fn.level, self.shard_fn.mesh_dim
                    raise OptimizerError(
                        f"ShardingStage{level}(mesh_dim={dim!r}): the params live on "
                        f"{len(meshes)} meshes (pipeline stages), and {m!r} has no dim {dim!r}: "
                        f"name a dim every stage's mesh has"
                        + (f", e.g. ShardingStage{level}({common[0]!r})" if common else "")
                        + f", or leave mesh_dim None (each mesh's 'dp', else its first dim)"
                    ) from None
        logical = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype) if _is_dt(p) else p,
                               params, is_leaf=_is_dt)
        shapes = jax.eval_shape(self.tx.init, logical)
        targets = self._state_targets(shapes, params)
        flat = jax.tree.leaves(targets, is_leaf=lambda x: isinstance(x, _Target))
        if not jax.tree.leaves(shapes):
            return self.tx.init(params)
        state = jit(self.tx.init, out_placements=[t.placements for t in flat])(params)
        if _holds_variables(params):
            state = _unplaced_extras(state, targets)
        if all(t.mesh == mesh for t in flat):
            return self._stored(state)
        # params on several meshes (pipeline stages): a state made from nothing placed (zeros
        # like a param) comes back unplaced; each goes where its param lives
        leaves, tree = jax.tree.flatten(state, is_leaf=_is_dt)
        return self._stored(jax.tree.unflatten(tree, [_put(x, t) for x, t in zip(leaves, flat)]))

    def _stored(self, state: Any) -> Any:
        from ..creation import offload

        return offload(state) if self.offload else state

    def update(self, grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return self.tx.update(grads, state, params)

    def state_out_placements(self, state: Any) -> list:
        return [x.placements if _is_dt(x) else None for x in jax.tree.leaves(state, is_leaf=_is_dt)]


@dataclass(frozen=True)
class _Target:
    """Where one optimizer state leaf lives."""

    mesh: Any
    placements: list
    mirrors: bool = True  # False: a leaf mirroring no param (a step count), replicated


def _positional_count(fn) -> int:
    """How many positional arguments `fn` takes (-1: any number, or not introspectable)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return -1
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return -1
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
               for p in params)


def _masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def _holds_variables(params: Any) -> bool:
    """Whether `params` is an nnx State of Variables (what nnx.Optimizer hands tx.init)."""
    from flax import nnx

    return any(isinstance(x, nnx.Variable)
               for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def _unplaced_extras(state: Any, targets: Any) -> Any:
    """`state` with each leaf that mirrors no param (a step count, replicated) as a jax.Array
    replicated over its mesh. nnx.Optimizer wraps every leaf of tx.init's state in an
    OptArray by jax.tree.map, which descends into a DistTensor (a pytree node) and wrapped
    its storage instead, so its update could not write the count back. Plain optax's count
    is a jax.Array too; a step's program places it as it reads it."""
    def unplace(x, target):
        if _is_dt(x) and isinstance(target, _Target) and not target.mirrors:
            return x.physical
        return x

    return jax.tree.map(unplace, state, targets,
                        is_leaf=lambda x: _is_dt(x) or isinstance(x, _Target) or _masked(x))


def _put(x: Any, target: _Target) -> DistTensor:
    from ..creation import shard_tensor
    from ..reshard.api import reshard

    if _is_dt(x):
        return x if (x.mesh, x.placements) == (target.mesh, target.placements) else reshard(
            x, target.mesh, target.placements)
    return shard_tensor(x, target.mesh, target.placements)


def shard_optimizer(optimizer: Any, shard_fn: Any = None,
                    gradient_accumulation_steps: int = 1, *,
                    offload: bool = False) -> ShardedOptimizer:
    """Paddle's dist.shard_optimizer for an optax transformation (see the module docstring).
    `offload=True` keeps the optimizer states in host memory between steps (Paddle's
    `optimize_offload`)."""
    return ShardedOptimizer(optimizer, shard_fn, gradient_accumulation_steps, offload)


def place_params(params: Any, opt: ShardedOptimizer) -> Any:
    """The params as the optimizer stores them between steps (split along the axis at stage 3;
    at stage 3 with offload, in host memory too, as Paddle's stage-3 offload keeps them)."""
    from ..creation import offload
    from ..reshard.api import reshard

    def move(p):
        if not _is_dt(p):
            return p
        target = opt.storage_placements(p)
        p = p if target == p.placements else reshard(p, p.mesh, target)
        return offload(p) if opt.offload and opt.stage == 3 else p

    return jax.tree.map(move, params, is_leaf=_is_dt)


__all__ = ["shard_optimizer", "ShardedOptimizer", "ShardingStage1", "ShardingStage2",
           "ShardingStage3", "OptimizerError", "split_placements", "place_params"]
