"""Pipeline parallel training: stages on their meshes, micro-batches in a schedule's order.

`PipelineRunner(stages, schedule="1F1B", micro_batches=m)` splits the batch into m
micro-batches and runs each stage's forward (F) and backward (B, and W when the schedule splits
the weight gradient off) in the order of the schedule (schedule.py), issuing them from one host
thread in simulated start order. Each stage is its own dist.jit program on its own mesh and jax
dispatches asynchronously, so while one mesh computes a micro-batch the host already issues the
next mesh's work: the stages overlap as the schedule says, with activations and cotangents
moved between meshes by cross-mesh reshards.

Values are the unpipelined step's: the loss is the mean of the micro-batch losses and the
gradients are accumulated with the loss cotangent 1/m, which for a loss that is a mean over
the batch equals the whole batch's loss and gradients (up to float rounding order).

Model state (`state=`: dropout RNG counters, BatchNorm statistics) is each stage's own: stage
s's program takes its state after its previous micro-batch and returns the next, so the state
after a step is that of one device running the m micro-batches one after another (gradient
accumulation), with no wait between stages.

Micro-batches are cut without communication: of each shard of the batch dim (a data-parallel
rank's rows), micro-batch i takes the i-th 1/m part, so every device keeps its own rows. The
batch inputs of the first stage and the loss arguments of the last stage are cut the same way,
so samples stay paired with their labels.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import in_flight
from ..compiler.jit import jit
from ..dtensor import DistTensor, make_dtensor
from ..placement import Replicate
from ..reshard.api import reshard
from .schedule import Schedule, ScheduleError, dispatch_order, make_schedule, simulate, validate
from .stages import Params, Stage, StageError, StageRunner

if TYPE_CHECKING:
    from .pipeline_profile import PipelineProfile


def _shards_of_dim0(x: DistTensor) -> int:
    """How many blocks the mesh cuts dim 0 of `x` into."""
    axes = x.layout.dims[0] if x.ndim else ()
    sizes = x.mesh.axis_sizes
    return int(np.prod([sizes[a] for a in axes], dtype=int)) if axes else 1


def _is_leaf(v: Any) -> bool:
    return isinstance(v, DistTensor)


@functools.lru_cache(maxsize=None)
def _cutter(groups: int, micro: int, placements: tuple):
    """A dist.jit program: one batch tensor -> its `micro` micro-batches, placed as it is."""

    def cut(x):
        rest = x.shape[1:]
        parts = x.reshape(groups, micro, x.shape[0] // (groups * micro), *rest)
        return [parts[:, i].reshape(-1, *rest) for i in range(micro)]

    return jit(cut, out_placements=[list(placements)] * micro)


def _cut_numpy(x: np.ndarray, groups: int, micro: int) -> list:
    rest = x.shape[1:]
    parts = x.reshape(groups, micro, x.shape[0] // (groups * micro), *rest)
    return [parts[:, i].reshape(-1, *rest) for i in range(micro)]



def default_name(kind: str, path: tuple, n_inputs: int) -> str:
    """A batch value as errors name it: "the first stage's input[1]", "loss argument 0"."""
    if kind == "input":
        return "the first stage's input" + jax.tree_util.keystr(path)
    if not path:
        return "the loss arguments"
    k = getattr(path[0], "idx", path[0])
    return f"loss argument {k}" + jax.tree_util.keystr(tuple(path[1:]))


def _count(inputs: Any) -> int:
    return len(inputs) if isinstance(inputs, (tuple, list)) else 1


def _named_leaves(inputs: Any, loss_args: tuple, name_of) -> list[tuple[str, Any]]:
    """(name, leaf) of every batch value: the first stage's inputs, then the loss arguments."""
    n = _count(inputs)
    out = [(name_of("input", path, n), leaf) for path, leaf in
           jax.tree_util.tree_flatten_with_path(inputs, is_leaf=_is_leaf)[0]]
    out += [(name_of("arg", path, n), leaf) for path, leaf in
            jax.tree_util.tree_flatten_with_path(tuple(loss_args), is_leaf=_is_leaf)[0]]
    return out


def batch_rows(inputs: Any) -> int | None:
    """The batch's rows: dim 0 of the first stage's first array input."""
    first = jax.tree.leaves(inputs, is_leaf=_is_leaf)
    return next((x.shape[0] for x in first if getattr(x, "shape", ())), None)


def micro_batch_size(pipeline) -> int | None:
    """strategy.pipeline's micro_batch_size to check batches against: None where it is Paddle's
    default 1, not given (the batch then sets it); one the user gave, 1 included, is checked."""
    size = pipeline.micro_batch_size
    return size if size != 1 or pipeline.written("micro_batch_size") else None


def check_batch(inputs: Any, loss_args: tuple, m: int, micro_batch_size: int | None,
                name_of=default_name) -> None:
    """Before anything is cut or traced on micro-batch shapes: the batch fits
    `micro_batch_size`, and every array given to the pipeline has the batch's rows as dim 0
    (each is cut into micro-batches along it)."""
    first = jax.tree.leaves(inputs, is_leaf=_is_leaf)
    batch = batch_rows(inputs)
    if micro_batch_size is not None and batch is not None:
        # Paddle's micro_batch_size counts one data-parallel rank's rows: the batch is
        # micro_batch_size x accumulate_steps per rank (or in all, on one rank)
        ranks = max((_shards_of_dim0(x) for x in first if isinstance(x, DistTensor)),
                    default=1)
        if batch not in {micro_batch_size * m, micro_batch_size * m * ranks}:
            raise StageError(
                f"strategy.pipeline.micro_batch_size = {micro_batch_size} with "
                f"accumulate_steps = {m} makes batches of {micro_batch_size * m} rows"
                + (f" per data-parallel rank ({micro_batch_size * m * ranks} over "
                   f"the {ranks} the batch is split over)" if ranks > 1 else "")
                + f", but the batch has {batch} rows: set micro_batch_size to "
                f"{batch // (m * ranks) if batch % (m * ranks) == 0 else '(batch / ranks) / accumulate_steps'}"
                f" or leave it unset")
    if m == 1:
        return  # nothing is cut
    # every array is cut along dim 0: one that is not batch-shaped would be cut too
    for what, leaf in _named_leaves(inputs, loss_args, name_of):
        shape = tuple(getattr(leaf, "shape", np.shape(leaf)))
        if shape and batch is not None and shape[0] != batch:
            raise StageError(
                f"{what} has an array of shape {list(shape)} whose dim 0 is not the "
                f"batch ({batch} rows): every array given to the pipeline is cut into "
                f"micro-batches along dim 0 — close over arrays that are not per-sample "
                f"(class weights, masks) in the loss function instead of passing them "
                f"(to_static: loss_fn=functools.partial(loss, t=table))")


class _Pullback:
    """A stage's backward for one micro-batch: jax's vjp of its dist.jit program.

    Split schedules (ZBH1) ask for the input gradient (B) and the parameter gradients (W)
    apart. Each is one jitted function of the vjp's residuals, so XLA drops the other half of
    the backward: B computes no weight gradient, W no input gradient. The residuals of every
    micro-batch have the same structure, so the first micro-batch's pytree structure (which
    names the backward jaxpr) is reused with the others' residuals, and each half compiles once.
    """

    __slots__ = ("vjp", "raw", "first", "owner", "signature")

    def __init__(self, vjp, raw: bool, first: bool, owner: "PipelineRunner", signature: tuple):
        self.vjp, self.raw, self.first, self.owner = vjp, raw, first, owner
        self.signature = signature  # the stage program's operands: what its backward depends on

    def _ct(self, ct: Any):
        return _physical(ct) if self.raw else ct

    def both(self, ct: DistTensor) -> tuple[Params, Any]:
        out = self.vjp(self._ct(ct))
        return (out[0], None) if self.first else (out[0], out[1])

    def part(self, ct: DistTensor, index: int, stage: int):
        leaves, treedef = jax.tree_util.tree_flatten(self.vjp)
        ct = self._ct(ct)
        key = (stage, index, self.signature, tuple(
            (np.shape(v), getattr(v, "dtype", None), getattr(v, "sharding", None)) for v in leaves))
        fn = self.owner._halves.get(key)
        if fn is None:
            def half(leaves, ct, _treedef=treedef):
                return jax.tree_util.tree_unflatten(_treedef, leaves)(ct)[index]
            fn = self.owner._halves[key] = jax.jit(half)
        out = fn(leaves, ct)
        in_flight.ran(out)  # (XLA's CPU backend deadlocks on too many left running)
        return _placed(out)


class _Recomputed:
    """A stage's backward that keeps only its operands (params by reference, the micro-batch
    activation) and runs forward and backward together in one jitted function when asked:
    what is held between F and B is the activation the schedule counts, nothing more.

    Without it, jax's vjp of a shard_map program keeps, per micro-batch, the operands of every
    matmul as residuals — replicated weights included, as per-device copies (a weight cast to
    vary over the batch's mesh axis is a new value)."""

    __slots__ = ("program", "args", "first", "owner", "stage")

    def __init__(self, program, args: tuple, first: bool, owner: "PipelineRunner", stage: int):
        self.program, self.args, self.first, self.owner, self.stage = (program, args, first,
                                                                       owner, stage)

    def _run(self, ct: Any, index: int | None):
        params, x, extra = self.args
        key = ("recompute", self.stage, index)  # jax.jit retraces for other operand layouts
        fn = self.owner._halves.get(key)
        if fn is None:
            program, first, aux = self.program, self.first, self.owner._stateful

            def backward(params, x, extra, ct):
                if first:
                    grads = (jax.vjp(lambda p: program(p, x, *extra), params,
                                     has_aux=aux)[1](ct)[0], None)
                else:
                    grads = jax.vjp(lambda p, a: program(p, a, *extra), params, x,
                                    has_aux=aux)[1](ct)
                return grads if index is None else grads[index]

            fn = self.owner._halves[key] = jax.jit(backward)
        out = fn(params, x, extra, _physical(ct))
        in_flight.ran(out)
        return _placed(out)

    def both(self, ct: Any) -> tuple[Params, Any]:
        return self._run(ct, None)

    def part(self, ct: Any, index: int, stage: int):
        return self._run(ct, index)


def _signature(args: tuple) -> tuple:
    """Operands as the stage program sees them: structure, and per leaf shape, dtype, mesh and
    layout (a numpy or jax leaf by shape and dtype)."""
    leaves, treedef = jax.tree.flatten(args, is_leaf=_is_leaf)
    return (treedef, tuple((x.shape, x.dtype, x.mesh, x.layout) if isinstance(x, DistTensor)
                           else (np.shape(x), getattr(x, "dtype", type(x))) for x in leaves))


def _physical(tree: Any) -> Any:
    """DistTensor leaves as their stored arrays (a cotangent for a vjp that returned arrays)."""
    return jax.tree.map(lambda t: t.physical if isinstance(t, DistTensor) else t, tree,
                        is_leaf=_is_leaf)


def _placed(tree):
    """DistTensors whose physical arrays sit as their layouts say (a jitted half of a backward
    hands back what XLA chose: the same sharding, checked here rather than assumed)."""
    def fix(t):
        # (an integer value's cotangent is a float0 numpy array: it has no sharding to fix)
        if isinstance(t, DistTensor) and isinstance(t.physical, jax.Array) and \
                not t.physical.sharding.is_equivalent_to(
                t.sharding, t.physical.ndim):
            return DistTensor(jax.device_put(t.physical, t.sharding), t.mesh, t.layout, t.shape)
        return t
    return jax.tree.map(fix, tree, is_leaf=_is_leaf)


def _send_back(d_input: Any, where: Any) -> Any:
    """A cotangent (or a tuple of them) moved to where its value was made."""
    def back(d: Any, w: tuple) -> Any:
        # an integer value's cotangent is a float0 zero array, on no mesh: nothing to move
        if not isinstance(d, DistTensor) or d.dtype == jax.dtypes.float0:
            return d
        return reshard(d, *w)

    if isinstance(d_input, (tuple, list)):
        return tuple(back(d, w) for d, w in zip(d_input, where))
    return back(d_input, where)


def check_chunk_count(stages: Sequence[Stage], chunks: Any) -> None:
    """Stages cut from a function (where each mesh change starts one): with several model
    chunks per rank, every mesh the stages are on is a pipeline rank running `chunks` of them,
    so the stages must number ranks x chunks. (Stages listed by hand keep the per-stage check
    of PipelineRunner: there the user chose each stage's mesh.)"""
    if not isinstance(chunks, int) or chunks < 2:
        return
    n, meshes = len(stages), len(dict.fromkeys(s.mesh for s in stages))
    if n % chunks == 0 and meshes <= n // chunks:
        return
    want = meshes * chunks
    raise StageError(
        f"vpp_degree (chunks) = {chunks} model chunks per pipeline rank on the {meshes} meshes "
        f"the stages are on needs {meshes} x {chunks} = {want} stages, but the model is cut "
        f"into {n}: name {want - 1} cuts — with dist.parallelize's pp_config, "
        f"split_spec={{layer: dist.SplitPoint.END, ...}} with {want - 1} entries (a layer-list "
        f"path such as split_spec='blocks' makes one stage per pp slice); in a forward written "
        f"by hand, a dist.reshard to the next stage's mesh at each cut, stage c on mesh c mod "
        f"{meshes} — or set vpp_degree to {n // meshes if n % meshes == 0 and n >= meshes else 1}")


@jit
def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


class PipelineRunner(StageRunner):
    """Trains stages that live on different meshes with a pipeline schedule.

        runner = dist.PipelineRunner([dist.Stage(f0, mesh0), dist.Stage(f1, mesh1)],
                                     schedule="1F1B", micro_batches=4)
        loss, grads = runner.value_and_grad(params_per_stage, batch, labels)

    `schedule`: "FThenB", "1F1B", "VPP" (with `chunks` model chunks per rank: stage s runs
    on the mesh of stage s mod p, p = len(stages) / chunks) or "ZBH1", or a `Schedule` made by
    hand. `costs`: relative action costs for ordering ({"F": 1, "B": 2} by default).
    `recompute`: hold only each stage's operands between its forward and backward and run the
    forward again in the backward (less memory per micro-batch in flight, one more forward).
    """

    def __init__(self, stages: Sequence[Stage], schedule: str | Schedule = "1F1B",
                 micro_batches: int = 1, *, chunks: int = 1, costs: dict | None = None,
                 recompute: bool = False):
        super().__init__(stages)
        self.recompute = recompute
        n = len(self.stages)
        if isinstance(schedule, Schedule):
            made = schedule
        else:
            if not isinstance(chunks, int) or chunks < 1 or n % chunks:
                raise ScheduleError(f"{n} stages cannot be cut into {chunks!r} chunks per "
                                    f"pipeline rank: give a number of stages divisible by chunks")
            made = make_schedule(schedule, n // chunks, micro_batches, chunks, costs)
        if made.stages != n:
            raise ScheduleError(f"the schedule {made.name!r} runs {made.stages} stages, but "
                                f"{n} were given")
        validate(made)
        for s, stage in enumerate(self.stages):
            home = self.stages[made.rank_of(s)].mesh
            if stage.mesh != home:
                raise StageError(f"stage {s} is on {stage.mesh!r}, but with {made.chunks} chunks "
                                 f"per rank it runs on rank {made.rank_of(s)}, whose mesh is "
                                 f"{home!r}: put stage {s} on that mesh")
        self.schedule = made
        self.timeline = simulate(made, costs)
        self.order = dispatch_order(made, costs)
        self._halves: dict = {}
        self._micro_batch_size: int | None = None  # from a Strategy: checked per batch
        # names the batch values in errors: (kind "input" | "arg", tree path, number of
        # inputs) -> text; to_static names them as the elements of its batch
        self._name_of = default_name
        # waits for each action's results before issuing the next: the no-overlap baseline
        # the pipeline benchmark measures against
        self.blocking = False
        self.after_action = None  # called with each Action once issued (the benchmark's probe)
        self._stateful = False  # within value_and_grad(..., state=): programs return (y, state)

    @staticmethod
    def from_function(fn, schedule: str | Schedule = "1F1B", micro_batches: int = 1, *,
                      chunks: int = 1, costs: dict | None = None, recompute: bool = False,
                      stateful: bool = False):
        """A pipeline of one loss function `fn(params, inputs, *loss_args)` written with
        `dist.reshard(y, next_mesh, ...)` where activations move on: its stages are cut where
        values change mesh, as dist.jit cuts (auto_pipeline.py). `.value_and_grad(params,
        inputs, *loss_args)` gives the loss and gradients shaped like `params`. With
        `stateful=True`, `fn(params, state, inputs, *loss_args) -> (loss, new_state)` and
        `.value_and_grad(params, inputs, *loss_args, state=state)` gives (loss, gradients,
        the state after the micro-batches ran one after another)."""
        from .auto_pipeline import FunctionPipeline

        return FunctionPipeline(fn, schedule, micro_batches, chunks=chunks, costs=costs,
                                recompute=recompute, stateful=stateful)

    @classmethod
    def from_strategy(cls, stages: Sequence[Stage], strategy: Any) -> "PipelineRunner":
        """Paddle's pipeline settings: `schedule_mode`, `accumulate_steps` (micro-batches per
        step), `vpp_degree` (chunks per rank for VPP). `micro_batch_size` is then the batch
        divided by accumulate_steps, checked when a batch arrives."""
        pp = strategy.pipeline
        if not pp.enable:
            raise ScheduleError("strategy.pipeline.enable is False: set it to True (with "
                                "schedule_mode and accumulate_steps) to train with a pipeline")
        runner = cls(stages, pp.schedule_mode, pp.accumulate_steps, chunks=pp.vpp_degree)
        runner._micro_batch_size = micro_batch_size(pp)
        return runner

    # -- the step ------------------------------------------------------------------------------
    def value_and_grad(self, params: Sequence[Params], inputs: Any, *loss_args: Any,
                       state: Sequence[Any] | None = None):
        """The mean loss over the micro-batches and, per stage, the gradients of its params.

        With `state` (per stage, a pytree: dropout counters, BatchNorm statistics), each
        stage's fn is `fn(params, x, state, *loss_args) -> (y, new_state)`, run on its
        micro-batches in order with the state threaded through them; the result is then
        (loss, grads, new state per stage)."""
        self._check_params(params)
        m, last = self.schedule.micro_batches, len(self.stages) - 1
        micro_in, micro_args = self._micro_batches(inputs, loss_args)
        states = None if state is None else list(state)
        if states is not None and len(states) != len(self.stages):
            raise StageError(f"got state for {len(states)} stages, but there are "
                             f"{len(self.stages)}: pass one state pytree per stage")
        done = [0] * len(self.stages)  # micro-batches each stage has run forward
        sent: dict = {}      # (stage, micro) -> (mesh, placements) its output was produced with
        outs: dict = {}      # (stage, micro) -> output, until the next stage has taken it
        pulls: dict = {}     # (stage, micro) -> its backward
        cts: dict = {}       # (stage, micro) -> cotangent of its output
        losses: list = [None] * m
        grads: list = [None] * len(self.stages)
        split = self.schedule.split_backward

        def accumulate(s: int, g: Params) -> None:
            # (a stage of activations only, a norm or a nonlinearity, has no gradients to add)
            grads[s] = g if grads[s] is None or not jax.tree.leaves(g) else _add(grads[s], g)

        self._stateful = states is not None
        try:
            for a in self.order:
                s, i = a.stage, a.micro
                if a.kind == "F":
                    x = micro_in[i] if s == 0 else self._arrive(s, outs.pop((s - 1, i)))
                    extra = micro_args[i] if self._reads_args(s) else ()
                    if states is not None:
                        if i != done[s]:  # the state of micro-batch i is made by i - 1
                            raise ScheduleError(
                                f"the schedule {self.schedule.name!r} runs micro-batch {i} "
                                f"of stage {s} before micro-batch {done[s]}: with model "
                                f"state each stage runs its micro-batches in order")
                        extra = (states[s], *extra)
                    y, pulls[(s, i)] = self._forward(s, params[s], x, extra)
                    done[s] += 1
                    if states is not None:
                        y, states[s] = y
                    if s == last:
                        losses[i] = self._check_loss(y)
                    else:
                        outs[(s, i)], sent[(s, i)] = y, jax.tree.map(
                            lambda t: (t.mesh, t.placements), y, is_leaf=_is_leaf)
                elif a.kind == "B":
                    ct = self._seed(losses[i], m) if s == last else cts.pop((s, i))
                    pull = pulls[(s, i)] if split else pulls.pop((s, i))
                    if split:
                        cts[("W", s, i)] = ct
                        d_input = None if s == 0 else pull.part(ct, 1, s)
                    else:
                        g, d_input = pull.both(ct)
                        accumulate(s, g)
                    if s > 0:
                        cts[(s - 1, i)] = _send_back(d_input, sent.pop((s - 1, i)))
                else:  # W: the weight gradient the split backward left
                    accumulate(s, pulls.pop((s, i)).part(cts.pop(("W", s, i)), 0, s))
                if self.blocking:
                    jax.block_until_ready((list(outs.values()), list(cts.values()), losses,
                                           grads))
                if self.after_action is not None:
                    self.after_action(a)
        finally:
            self._stateful = False
        if states is None:
            return self._mean(losses), grads
        return self._mean(losses), grads, states

    def profile(self, params: Sequence[Params], inputs: Any, *loss_args: Any,
                steps: int = 3) -> "PipelineProfile":
        """Measure this step (pipeline_profile.py): each stage's F / B / W time run alone, each
        rank's busy time, the schedule simulated with those costs, the measured step. Pass
        `profile.costs` as `costs=` to a new runner to order its actions by them."""
        from .pipeline_profile import measure

        return measure(self, lambda: self.value_and_grad(params, inputs, *loss_args), steps)

    def forward(self, params: Sequence[Params], inputs: Any, *loss_args: Any,
                state: Sequence[Any] | None = None) -> DistTensor:
        """The mean loss over the micro-batches (forwards only, in the schedule's F order);
        with `state`, stage fns as in value_and_grad and the state they leave is dropped."""
        self._check_params(params)
        m, last = self.schedule.micro_batches, len(self.stages) - 1
        micro_in, micro_args = self._micro_batches(inputs, loss_args)
        states = None if state is None else list(state)
        outs, losses = {}, [None] * m
        for a in self.order:
            if a.kind != "F":
                continue
            s, i = a.stage, a.micro
            x = micro_in[i] if s == 0 else self._arrive(s, outs.pop((s - 1, i)))
            extra = micro_args[i] if self._reads_args(s) else ()
            y = self.programs[s](params[s], x, *(() if states is None else (states[s],)), *extra)
            if states is not None:
                y, states[s] = y
            if s == last:
                losses[i] = self._check_loss(y)
            else:
                outs[(s, i)] = y
        return self._mean(losses)

    def explain(self, params: Sequence[Params], inputs: Any, *loss_args: Any,
                state: Sequence[Any] | None = None) -> str:
        """The schedule (simulated bubble, held micro-batches, each rank's order) and, for one
        micro-batch, what moves between stages and what each stage's forward communicates."""
        from ..reshard.api import plan_reshard
        from ..reshard.planner import format_bytes
        from .schedule import table

        micro_in, micro_args = self._micro_batches(inputs, loss_args)
        sched = self.schedule
        lines = [f"pipeline: {len(self.stages)} stages on {sched.ranks} ranks, schedule "
                 f"{sched.name}, {sched.micro_batches} micro-batches", table([self.timeline]),
                 "per micro-batch (forward):"]
        x, last = micro_in[0], len(self.stages) - 1
        for s, program in enumerate(self.programs):
            if s:
                sent, x = x, self._arrive(s, x)
                pairs = zip(sent, x) if isinstance(x, tuple) else [(sent, x)]
                for a, b in pairs:
                    if isinstance(a, DistTensor) and a.mesh != b.mesh:
                        rp = plan_reshard(a, b.mesh, b.placements)
                        lines.append(f"  → stage {s}: {a.dtype}{list(a.shape)} "
                                     f"{a.layout.describe(a.mesh)} → "
                                     f"{b.layout.describe(b.mesh)}, "
                                     f"{format_bytes(rp.total_bytes)}/device")
            args = (params[s], x, *((state[s],) if state is not None else ()),
                    *(micro_args[0] if self._reads_args(s) else ()))
            plan = program.plan(*args)
            counts = ", ".join(f"{n} {k}" for k, n in sorted(plan.collective_counts().items()))
            lines.append(f"  stage {s} on devices {self.stages[s].mesh.process_ids}: "
                         f"{counts or 'no collectives'}, {format_bytes(plan.total_bytes)}/device")
            x = program(*args)
            if state is not None:
                x = x[0]
        lines.append("order per rank:")
        lines.append(str(sched))
        return "\n".join(lines)

    # -- helpers -------------------------------------------------------------------------------
    def _reads_args(self, s: int) -> bool:
        """Whether stage s takes the loss arguments (the last stage computes the loss)."""
        return s == len(self.stages) - 1

    def _micro_batches(self, inputs: Any, loss_args: tuple) -> tuple[list, list]:
        """Per micro-batch: the first stage's input and the last stage's extra arguments."""
        m = self.schedule.micro_batches
        groups = self._groups(inputs)
        check_batch(inputs, loss_args, m, self._micro_batch_size, self._name_of)
        # a 0-d loss argument placed elsewhere (a float16 loss scale) joins the stage that
        # computes the loss (the last that reads the loss arguments)
        home = self.stages[max(s for s in range(len(self.stages)) if self._reads_args(s))].mesh
        loss_args = jax.tree.map(
            lambda a: reshard(a, home, [Replicate()] * home.ndim)
            if isinstance(a, DistTensor) and not a.shape and a.mesh != home else a,
            loss_args, is_leaf=_is_leaf)
        n = _count(inputs)
        micro_in = self._cut(inputs, groups, m, self._name_of("input", (), n))
        micro_args = list(zip(*[self._cut(a, groups, m, self._name_of(
            "arg", (jax.tree_util.SequenceKey(k),), n))
                                for k, a in enumerate(loss_args)])) or [()] * m
        return micro_in, micro_args

    def _forward(self, s: int, params: Params, x: Any, extra: tuple) -> tuple[Any, Any]:
        """Stage s's output for one micro-batch (with model state: (output, new state)) and
        what its backward needs."""
        program = self.programs[s]
        if self.recompute:  # keep only the stage's operands; the backward runs the forward again
            y = program(params, x, *extra)
            return y, _Recomputed(program, (params, x, extra), s == 0, self, s)
        aux = self._stateful
        if s == 0:  # the batch needs no cotangent
            out, vjp, *new = jax.vjp(lambda p: program(p, x, *extra), params, has_aux=aux)
        else:
            out, vjp, *new = jax.vjp(lambda p, a: program(p, a, *extra), params, x, has_aux=aux)
        args = (params, x, *extra)
        if not aux and not isinstance(out, (tuple, list)):
            y = self._as_dtensor(s, program, args, out)
            return y, _Pullback(vjp, not isinstance(out, DistTensor), s == 0, self,
                                _signature(args))
        # Under jax.vjp dist.jit hands back arrays: give them their meshes and layouts again
        # (the plan's outputs are the flat leaves of (activation, new state))
        raw = not all(isinstance(o, DistTensor) for o in jax.tree.leaves(out, is_leaf=_is_leaf))
        leaves, tree = jax.tree.flatten((out, new[0]) if aux else out, is_leaf=_is_leaf)
        if not all(isinstance(o, DistTensor) for o in leaves):
            plan = program.plan(*args)
            leaves = [make_dtensor(o, plan.user_mesh, plan.user_outputs[k].without_partial(), o.shape)
                      if isinstance(o, jax.Array) else o for k, o in enumerate(leaves)]
        y = jax.tree.unflatten(tree, leaves)
        if aux:
            y = (tuple(y[0]) if isinstance(y[0], list) else y[0], y[1])
        elif isinstance(y, list):
            y = tuple(y)
        return y, _Pullback(vjp, raw, s == 0, self, _signature(args))

    @staticmethod
    def _check_loss(y: DistTensor) -> DistTensor:
        if y.shape != ():
            raise StageError(f"the last stage returned shape {list(y.shape)}; in a pipeline it "
                             f"must return the scalar loss of its micro-batch (e.g. jnp.mean)")
        return y

    @staticmethod
    def _seed(loss: DistTensor, m: int) -> DistTensor:
        """The loss cotangent 1/m: the gradients summed over micro-batches are the mean's."""
        value = jax.device_put(jnp.full((), 1.0 / m, loss.dtype), loss.physical.sharding)
        return make_dtensor(value, loss.mesh, loss.layout, ())

    @staticmethod
    def _mean(losses: list) -> DistTensor:
        return _mean_of(tuple(losses))

    @staticmethod
    def _groups(inputs: Any) -> int:
        """Blocks of the batch dim of the first DistTensor input (1 if there is none)."""
        for leaf in jax.tree.leaves(inputs, is_leaf=_is_leaf):
            if isinstance(leaf, DistTensor):
                return _shards_of_dim0(leaf)
        return 1

    @staticmethod
    def _cut(tree: Any, groups: int, m: int, what: str) -> list:
        """`tree` as m micro-batch trees (dim 0 of every array leaf is the batch)."""
        if m == 1:  # one micro-batch: the batch as it is (a value of any shape)
            return [tree]
        leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_leaf)
        columns = []
        for k, leaf in enumerate(leaves):
            shape = tuple(getattr(leaf, "shape", ()))
            if not shape:
                columns.append([leaf] * m)  # a scalar is every micro-batch's
                continue
            if shape[0] % (groups * m):
                raise StageError(
                    f"{what} (leaf {k}, shape {list(shape)}): its batch dim {shape[0]} cannot be "
                    f"cut into {m} micro-batches of each of its {groups} data-parallel shards; "
                    f"use a batch size divisible by {groups * m} or fewer micro-batches")
            if isinstance(leaf, DistTensor):
                columns.append(_cutter(groups, m, tuple(leaf.placements))(leaf))
            else:
                columns.append(_cut_numpy(np.asarray(leaf), groups, m))
        return [jax.tree.unflatten(treedef, [c[i] for c in columns]) for i in range(m)]


@jit
def _mean_of(losses: tuple):
    return sum(losses) / len(losses)


__all__ = ["PipelineRunner"]
