"""Stage-by-stage execution of a model split across meshes: one dist.jit program per stage,
cross-mesh reshards of activations forward and of their cotangents backward.

This runs the stages in order for one batch, with no schedule (no micro-batches, no overlap,
every other stage idle): the unscheduled baseline a pipeline schedule must match, and enough to
train a model whose layers live on different meshes (Paddle's `dist.reshard(y, mesh1, ...)`
inside `forward`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from ..compiler.jit import DistributedFunction, jit
from ..dtensor import DistTensor, make_dtensor
from ..errors import AutoshardError
from ..mesh import ProcessMesh, as_process_mesh
from ..placement import Placement, Replicate, placement_code
from ..reshard.api import reshard

Params = Any  # a pytree of DistTensors, all on the stage's mesh


class StageError(AutoshardError, ValueError):
    """Stages, params or a stage output that do not fit stage-by-stage execution."""


@dataclass(frozen=True)
class Stage:
    """One stage: `fn(params, activation)` on `mesh`; the last stage's fn returns the loss.

    `in_placements`: where the previous stage's activation lands on this stage's mesh (the
    seed's `dist.reshard(y, mesh1, [Shard(0), Shard(2)])`); None keeps its placements. The
    first stage takes the batch as it comes (already placed by shard_dataloader).
    """

    fn: Callable[..., Any]
    mesh: ProcessMesh
    in_placements: Sequence[Placement | str] | None = None


class StageRunner:
    """Runs stages forward and backward, moving activations and cotangents between meshes.

    Each stage is compiled with dist.jit on its own mesh (`programs[i]`); the backward of a
    stage is jax's transpose of that program (jax.vjp through dist.jit), so gradients come
    back where their params live. The last stage may take extra arguments (labels), which
    should already be on its mesh (shard_dataloader with meshes=[first, last] puts them there).
    """

    def __init__(self, stages: Sequence[Stage]):
        if not stages:
            raise StageError("StageRunner needs at least one Stage(fn, mesh)")
        self.stages = tuple(Stage(s.fn, as_process_mesh(s.mesh), s.in_placements) for s in stages)
        self.programs: tuple[DistributedFunction, ...] = tuple(jit(s.fn) for s in self.stages)

    def forward(self, params: Sequence[Params], inputs: Any, *loss_args: Any) -> DistTensor:
        """The loss (or the last stage's output) without gradients."""
        self._check_params(params)
        x = inputs
        for i, program in enumerate(self.programs):
            x = program(params[i], self._arrive(i, x), *self._extra(i, loss_args))
        return x

    def value_and_grad(self, params: Sequence[Params], inputs: Any,
                       *loss_args: Any) -> tuple[DistTensor, list[Params]]:
        """The loss and, per stage, the gradients of its params (placed like the params)."""
        self._check_params(params)
        backward: list[Callable] = []
        outputs: list[DistTensor] = []
        x = inputs
        for i in range(len(self.stages)):
            x, vjp = self._stage_vjp(i, params[i], self._arrive(i, x), self._extra(i, loss_args))
            backward.append(vjp)
            outputs.append(x)
        loss = x
        if loss.shape != ():
            raise StageError(f"the last stage returned shape {list(loss.shape)}; it must return "
                             f"the scalar loss (e.g. jnp.mean(logits)) for value_and_grad")
        ones = jax.device_put(jnp.ones((), loss.dtype), loss.physical.sharding)
        cotangent = make_dtensor(ones, loss.mesh, loss.layout, ())
        grads: list[Params] = [None] * len(self.stages)
        for i in reversed(range(1, len(self.stages))):
            grads[i], d_input = backward[i](cotangent)
            # The cotangent goes back to where the previous stage's output was produced.
            sent = outputs[i - 1]
            cotangent = reshard(d_input, sent.mesh, sent.placements)
        (grads[0],) = backward[0](cotangent)
        return loss, grads

    # -- helpers ------------------------------------------------------------------------------
    def _arrive(self, i: int, x: Any) -> Any:
        """Stage i's input: the previous activation resharded onto stage i's mesh."""
        if i == 0:
            return x
        if not isinstance(x, DistTensor):
            raise StageError(f"stage {i - 1} returned {type(x).__name__}; each stage but the "
                             f"last must return one array (its activation)")
        stage = self.stages[i]
        if stage.in_placements is None and x.mesh.ndim != stage.mesh.ndim:
            # its placements cannot carry over: say where it should land, by the dims' names
            names = dict(zip(x.mesh.dim_names, x.placements))
            guess = [names.get(n, Replicate()) for n in stage.mesh.dim_names]
            raise StageError(
                f"stage {i - 1}'s activation is placed {list(x.placements)} on a "
                f"{x.mesh.ndim}-d mesh {x.mesh.dim_names}, and stage {i} runs on a "
                f"{stage.mesh.ndim}-d mesh {stage.mesh.dim_names}: say where it lands there, "
                f"dist.Stage(fn, mesh, in_placements=[{', '.join(map(placement_code, guess))}])")
        placements = x.placements if stage.in_placements is None else stage.in_placements
        return reshard(x, stage.mesh, placements)

    def _stage_vjp(self, i: int, params: Params, x: Any,
                   extra: tuple) -> tuple[DistTensor, Callable]:
        """Stage i's output and its backward (d output -> d params, and d input after stage 0)."""
        program = self.programs[i]
        if i == 0:  # the batch needs no cotangent
            out, vjp = jax.vjp(lambda p: program(p, x, *extra), params)
        else:
            out, vjp = jax.vjp(lambda p, a: program(p, a, *extra), params, x)
        # Under jax.vjp dist.jit may return the global array rather than a DistTensor; the
        # cotangent must then be an array too.
        backward = vjp if isinstance(out, DistTensor) else lambda d: vjp(d.physical)
        return self._as_dtensor(i, program, (params, x, *extra), out), backward

    def _extra(self, i: int, loss_args: tuple) -> tuple:
        return loss_args if i == len(self.stages) - 1 else ()

    def _check_params(self, params: Sequence[Params]) -> None:
        if len(params) != len(self.stages):
            raise StageError(f"got params for {len(params)} stages, but there are "
                             f"{len(self.stages)}: pass one params pytree per stage")
        for i, (p, stage) in enumerate(zip(params, self.stages)):
            for leaf in jax.tree.leaves(p, is_leaf=lambda v: isinstance(v, DistTensor)):
                if isinstance(leaf, DistTensor) and leaf.mesh != stage.mesh:
                    raise StageError(
                        f"a param of stage {i} is on {leaf.mesh!r}, but the stage runs on "
                        f"{stage.mesh!r}: place each stage's params on its mesh "
                        f"(dist.shard_tensor(w, stage_mesh, placements))")

    @staticmethod
    def _as_dtensor(i: int, program: DistributedFunction, args: tuple, out: Any) -> DistTensor:
        """A stage output under jax.vjp may be the global array: give back its mesh and layout."""
        if isinstance(out, DistTensor):
            return out
        if not isinstance(out, jax.Array):
            raise StageError(f"stage {i} returned {type(out).__name__}; a stage returns one "
                             f"array (its activation, or the scalar loss for the last stage)")
        plan = program.plan(*args)
        # Pending Partial outputs were reduced for the outer autodiff: the layout without them.
        return make_dtensor(out, plan.user_mesh, plan.user_outputs[0].without_partial(), out.shape)


__all__ = ["Stage", "StageRunner", "StageError"]
