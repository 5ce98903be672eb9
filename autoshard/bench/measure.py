"""Measuring one workload: autoshard's program against XLA's, built in the same process.

The baseline is plain `jax.jit` of the same unpartitioned step, called on the DistTensors'
`.physical` arrays, so XLA (Shardy) starts from the same input shardings and chooses every
collective itself; annotations inside the step (`dist.shard_tensor` / `dist.reshard` on
tracers) are identities to it. Everything deterministic (collectives, bytes, memory) is read
from the compiled programs; times are wall-clock on this machine.

Timings and what they include:
- pass time: our propagation + planning (`build_program` + `make_plan`, timed alone) plus
  partitioning (building the local program: tracing it under `shard_map`, `jit.trace`),
  excluding `make_jaxpr` of the user's function, jax's lowering and XLA; each part the best
  of 3 runs on a fresh `dist.jit`;
- trace: `make_jaxpr` of the user's step (jax's own tracing of the program we are handed),
  best of 3, timed beside the passes as a yardstick of this machine's Python speed: pass time
  per 10k equations in seconds depends on the machine (the same code measured 0.27 s at 48
  layers on one day and 0.5 s on a slower one); `pass_per_trace` (pass time / trace time) does
  not;
- lower: jax's lowering of that program to StableHLO (`traced.lower()`, jax's MLIR emission,
  none of our code runs there), reported apart from the pass time, not hidden: the
  `*_with_lower` columns add it back;
- XLA compile: `lowered.compile()` of our program (what follows our passes);
- baseline compile: `jax.jit(step).lower(...).compile()`, tracing included;
- step time: the two compiled executables called alternately on their physical inputs (same
  dispatch path for both): the median of the per-pair ratios, with their min and max.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

import autoshard as dist
from autoshard.compiler import replay
from autoshard.compiler.gc_pause import gc_paused
from autoshard.dtensor import is_dist_tensor as _is_dt
from autoshard.hlo import (collective_bytes, collective_wire_bytes, count_collective_ops,
                           count_collectives)

from .workloads import Workload



def baseline_inputs(args: tuple) -> tuple:
    """The args as jax sees them: each DistTensor's physical array (its NamedSharding kept)."""
    def physical(x):
        if not _is_dt(x):
            return x
        if x.layout.partial:
            raise ValueError("a Partial input has no plain-jax.jit equivalent; benchmark "
                             "workloads take Replicate/Shard inputs only")
        return x.physical
    return jax.tree.map(physical, args, is_leaf=_is_dt)


@dataclass
class Built:
    """Both programs compiled, their inputs, and how long building them took."""

    ours: Any                  # jax.stages.Compiled of our shard_map program
    base: Any                  # jax.stages.Compiled of plain jax.jit
    ours_inputs: list
    base_inputs: tuple
    equations: int
    planned_collectives: int
    plan_s: float
    partition_s: float
    trace_s: float             # make_jaxpr of the user's step (best of the repeats)
    lower_s: float
    xla_compile_s: float
    base_compile_s: float
    call: Callable[[], Any]    # dist.jit's own __call__ (DistTensors in and out)
    traced_equations: int = 0  # the user's traced step, calls inlined (`jaxpr_equations`)
    # the program's equations and its loop / cond / checkpoint bodies' (`planned_equations`)
    equations_with_bodies: int = 0
    # the first compile of the model in the process: planning with every process-wide memo
    # of the passes forgotten first (`forget_memos`) and partition with no lowering kept from
    # another program
    plan_first_s: float = 0.0
    partition_first_s: float = 0.0


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def jaxpr_equations(closed: Any) -> int:
    """The equations of the traced step as `build_program` walks them: the bodies of the calls
    it inlines (jit, custom_jvp / custom_vjp calls) counted equation by equation. The passes'
    input; the program they plan has fewer (duplicates merged, steps XLA removes removed)."""
    from autoshard.compiler.trace import _INLINE_JAXPR_PARAM

    n = 0
    for e in closed.eqns:
        key = _INLINE_JAXPR_PARAM.get(e.primitive.name)
        inner = e.params.get(key) if key else None
        n += 1 if inner is None else jaxpr_equations(getattr(inner, "jaxpr", inner))
    return n


def planned_equations(plan: Any) -> int:
    """The equations the passes plan and partition: the program's, and each loop / cond /
    checkpoint body's once (planned again for a loop's fixpoint, and unrolled copies made of
    it, it is one body). `equations` counts only the top level, where a scanned model is a
    hundred equations around its layer's body."""
    return len(plan.program.eqns) + sum(planned_equations(sub) for ep in plan.eqns
                                        for sub in ep.sub_plans)


def forget_memos() -> None:
    """Forget what the passes keep across programs in the process: the strategy choices
    (strategy.py), the rules' answers (the registry's memo), the reshard plans (planner.py,
    reshard/api.py) and the lowerings (replay.py). The next program is planned and
    partitioned as the first one of a fresh process (jax's own caches aside)."""
    from autoshard.compiler import remake, strategy
    from autoshard.compiler.jit import _registry
    from autoshard.reshard import api, planner, steps

    strategy._MEMOS.clear()
    remake._ASKED.clear()
    remake._NBYTES.clear()
    _registry().memo.clear()
    planner.plan_on_mesh.cache_clear()
    planner._moves.cache_clear()
    planner._transitions.cache_clear()
    planner._retile_moves.cache_clear()
    planner._retile_targets.cache_clear()
    planner._retiles.cache_clear()
    planner._local_count.cache_clear()
    planner._dtype_facts.cache_clear()
    steps.retiling.cache_clear()
    api.plan_layouts.cache_clear()
    replay.clear_shared()


def warm_process() -> None:
    """Compile one small program unlike any workload (a 2-layer MLP step on a 2x4 mesh), so
    that the first workload measured does not also pay what any first program of a process
    pays (our modules and jax's imported and their tables filled on first use): its
    first-compile column then times our passes with their memos forgotten, as every later
    row's does. (A 2-layer GPT step planned in a fresh process took 304 ms, after this 152,
    on a busy machine; in the bench the step's own trace, which precedes its plan, already
    paid most of it: 90 ms before, 84 after.)"""
    mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
    w = dist.shard_tensor(np.full((24, 40), 0.1, np.float32), mesh,
                          [dist.Replicate(), dist.Shard(1)])
    x = dist.shard_tensor(np.ones((16, 24), np.float32), mesh,
                          [dist.Shard(0), dist.Replicate()])

    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jax.numpy.mean(jax.nn.gelu(x @ w) ** 2))(w)
        return loss, w - 0.1 * g

    jax.block_until_ready(dist.jit(step)(w, x)[0].physical)
    forget_memos()


def time_plan(f: Any, args: tuple, mesh: dist.ProcessMesh
              ) -> tuple[float, int, float, int, int]:
    """Time propagation + planning by themselves, on an already traced program; and jax's
    tracing of the user's function that precedes them (seconds, equations, trace seconds,
    the traced step's equations, the equations with the bodies' `planned_equations`).

    Uses the DistributedFunction's internals (as the compiler benchmark always has): there is
    no public hook between make_jaxpr and the plan.
    """
    from autoshard.compiler.jit import _describe_leaf, _registry
    from autoshard.compiler.plan import make_plan
    from autoshard.compiler.trace import build_program

    static, leaves, tree = f._split(args, {})
    described = tuple(_describe_leaf(x) for x in leaves)
    (closed, _), trace_s = _timed(lambda: gc_paused(f._trace)(static, tree, described))

    @gc_paused  # as in dist.jit's _passes: one collection pause over both
    def passes():
        program = build_program(closed, stop_gradients=False)  # as a top-level call builds it
        return make_plan(program, mesh, [d.layout for d in described],
                         f._out_targets(program, mesh), _registry(),
                         f._cost_model or dist.default_cost_model())

    plan, seconds = _timed(passes)
    return (seconds, len(plan.program.eqns), trace_s, jaxpr_equations(closed.jaxpr),
            planned_equations(plan))


def build(w: Workload, repeats: int = 3) -> Built:
    """Both programs, compiled. Our passes are timed `repeats` times, each on a fresh
    `dist.jit` (nothing cached but what a second model in the same process would reuse), and
    the best is kept: on a shared 2-core machine single timings of the same work vary by a
    third. XLA's compiles are timed once (minutes at 48 layers)."""
    f = dist.jit(w.step, out_placements=w.out_placements)
    forget_memos()  # the first plan: a first compile's
    plans = [time_plan(f, w.args, w.mesh) for _ in range(repeats)]
    plan_s, equations, traced_equations = min(p[0] for p in plans), plans[0][1], plans[0][3]
    trace_s = min(p[2] for p in plans)
    partition_s = math.inf
    for k in range(repeats):
        f = dist.jit(w.step, out_placements=w.out_placements)
        entry, leaves = f._entry(w.args, {})      # traces and plans again (not timed)
        ours_inputs = f._physical_inputs(entry, leaves)
        if k == 0:
            replay.clear_shared()
        # as dist.jit's first call does: tracing and lowering with cyclic collection paused
        traced, seconds = _timed(lambda: gc_paused(entry.fn.trace)(*ours_inputs))
        partition_s = min(partition_s, seconds)
        if k == 0:
            first_s = seconds
    lowered, lower_s = _timed(gc_paused(traced.lower))
    ours, xla_compile_s = _timed(lowered.compile)
    base_inputs = baseline_inputs(w.args)
    base, base_compile_s = _timed(lambda: jax.jit(w.baseline_step or w.step).lower(*base_inputs).compile())
    return Built(ours, base, ours_inputs, base_inputs, equations, len(entry.plan.collectives),
                 plan_s, partition_s, trace_s, lower_s, xla_compile_s, base_compile_s,
                 lambda: f(*w.args), traced_equations, plans[0][4], plans[0][0], first_s)


def pass_times(b: Built) -> dict:
    """Our pass time (plan + partition) and jax's lowering beside it, per 10k equations too."""
    pass_s = b.plan_s + b.partition_s
    with_lower = pass_s + b.lower_s
    per_10k = 1e4 / max(b.equations, 1)
    return {"plan_s": round(b.plan_s, 3), "partition_s": round(b.partition_s, 3),
            "lower_s": round(b.lower_s, 3), "pass_s": round(pass_s, 3),
            "pass_with_lower_s": round(with_lower, 3),
            "s_per_10k_eqns": round(pass_s * per_10k, 3),
            "plan_first_s": round(b.plan_first_s, 3),
            "partition_first_s": round(b.partition_first_s, 3),
            "s_per_10k_eqns_first": round((b.plan_first_s + b.partition_first_s) * per_10k, 3),
            "s_per_10k_traced_eqns": round(pass_s * 1e4 / max(b.traced_equations, 1), 3),
            "equations_with_bodies": b.equations_with_bodies,
            "s_per_10k_eqns_with_bodies": round(
                pass_s * 1e4 / max(b.equations_with_bodies, b.equations, 1), 3),
            "trace_s": round(b.trace_s, 3), "pass_per_trace": round(pass_s / b.trace_s, 3),
            "s_per_10k_eqns_with_lower": round(with_lower * per_10k, 3)}


# ------------------------------------------------------------------------ deterministic
def communication(ours_hlo: str, base_hlo: str, w: Workload) -> dict:
    """Collective bytes (result and wire convention) and counts by kind, with the minimum.

    Per step: a collective inside a scan's loop counts once per iteration.
    """
    ob, bb = collective_bytes(ours_hlo, True), collective_bytes(base_hlo, True)
    ow, bw = collective_wire_bytes(ours_hlo, True), collective_wire_bytes(base_hlo, True)
    oc, bc = count_collectives(ours_hlo, True), count_collectives(base_hlo, True)
    row = {
        "bytes": sum(ob.values()), "xla_bytes": sum(bb.values()),
        "wire_bytes": round(sum(ow.values())), "xla_wire_bytes": round(sum(bw.values())),
        "collectives": sum(oc.values()), "xla_collectives": sum(bc.values()),
        # ops after XLA's combiners: how often the devices synchronise per step
        "collective_ops": sum(count_collective_ops(ours_hlo, True).values()),
        "xla_collective_ops": sum(count_collective_ops(base_hlo, True).values()),
        "bytes_by_kind": dict(ob), "xla_bytes_by_kind": dict(bb),
        "count_by_kind": dict(oc), "xla_count_by_kind": dict(bc),
    }
    row["bytes_ratio"] = _ratio(row["bytes"], row["xla_bytes"])
    row["wire_ratio"] = _ratio(row["wire_bytes"], row["xla_wire_bytes"])
    m = w.minimum
    row["min_bytes"] = m.bytes if m else None
    row["min_wire_bytes"] = round(m.wire_bytes) if m else None
    row["min_collectives"] = m.count if m else None
    row["min_bytes_by_kind"] = m.by_kind() if m else None
    row["vs_min"] = _ratio(row["bytes"], m.bytes) if m else None
    row["xla_vs_min"] = _ratio(row["xla_bytes"], m.bytes) if m else None
    return row


def memory(ours: Any, base: Any) -> dict:
    """Per-device bytes from XLA's buffer assignment: arguments, temporaries, outputs, peak.

    Peak is arguments + temporaries + outputs minus what aliases (donated inputs reused as
    outputs): every buffer live at once, the bound XLA's own reports use.
    """
    def stats(c):
        m = c.memory_analysis()
        arg, temp, out = m.argument_size_in_bytes, m.temp_size_in_bytes, m.output_size_in_bytes
        alias = getattr(m, "alias_size_in_bytes", 0)
        return {"argument": arg, "temp": temp, "output": out, "peak": arg + temp + out - alias}

    o, b = stats(ours), stats(base)
    return {"mem": o, "xla_mem": b, "mem_ratio": _ratio(o["peak"], b["peak"])}


def work(ours: Any, base: Any) -> dict:
    """Arithmetic and memory traffic per device from XLA's cost analysis (deterministic).

    The step-time ratio on a loaded CPU is noisy; these say whether our program asks the
    hardware for more work than the baseline (e.g. a value recomputed in many fusions).
    """
    def stats(c):
        d = c.cost_analysis()
        d = d[0] if isinstance(d, (list, tuple)) else d
        return float(d.get("flops", 0.0)), float(d.get("bytes accessed", 0.0))

    (of, ob), (bf, bb) = stats(ours), stats(base)
    return {"flops": of, "xla_flops": bf, "flops_ratio": _ratio(of, bf),
            "bytes_accessed": ob, "xla_bytes_accessed": bb,
            "bytes_accessed_ratio": _ratio(ob, bb)}


def outputs_agree(ours: Any, base: Any, inputs_ours: list, inputs_base: tuple) -> bool:
    """Whether both programs compute the same values (a guard on the comparison itself).

    Only outputs whose physical shapes match are compared (a Partial output carries an extra
    leading axis); dropout masks agree because both use the partitionable threefry.
    """
    got = jax.tree.leaves(ours(*inputs_ours))
    want = jax.tree.leaves(base(*inputs_base))
    for g, r in zip(got, want):
        if g.shape != r.shape or not jax.numpy.issubdtype(g.dtype, jax.numpy.floating):
            continue
        if not np.allclose(np.asarray(g), np.asarray(r), rtol=2e-3, atol=2e-4):
            return False
    return True


# ------------------------------------------------------------------------ time
def step_times(ours: Callable[[], Any], base: Callable[[], Any], pairs: int,
               warmup: int = 2) -> dict:
    """Interleaved runs (ours, baseline, ours, ...): load on the machine hits both alike.

    The ratio is the median of the per-pair ratios (each pair ran back to back, under the same
    load), reported with their min and max; the absolute medians are kept alongside.
    """
    def once(fn):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - t0

    for _ in range(warmup):
        once(ours), once(base)
    o, b = [], []
    for _ in range(pairs):
        o.append(once(ours))
        b.append(once(base))
    per_pair = [x / y for x, y in zip(o, b)]
    return {"step_ms": round(statistics.median(o) * 1e3, 3),
            "xla_step_ms": round(statistics.median(b) * 1e3, 3),
            "step_ratio": round(statistics.median(per_pair), 3),
            "step_ratio_min": round(min(per_pair), 3), "step_ratio_max": round(max(per_pair), 3),
            "step_pairs": pairs}


def call_overhead(call: Callable[[], Any], compiled: Callable[[], Any], runs: int) -> float:
    """Median ms that dist.jit's __call__ adds over calling its compiled executable."""
    def med(fn):
        ts = []
        for _ in range(runs):
            t0 = time.perf_counter()
            out = jax.tree.leaves(fn(), is_leaf=_is_dt)
            jax.block_until_ready([x.physical if _is_dt(x) else x for x in out])
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    return round((med(call) - med(compiled)) * 1e3, 3)


def _ratio(a: float, b: float) -> float | None:
    if not b:
        return None if a else 1.0
    r = a / b
    return round(r, 3) if math.isfinite(r) else None


def measure(w: Workload, pairs: int = 20, warmup: int = 2, hlo_dir: str | None = None) -> dict:
    """Every number of the report for one workload (see the module docstring).

    `hlo_dir`: also save both compiled programs' HLO text there, to read what differs.
    """
    built = build(w)
    if hlo_dir:
        import os

        os.makedirs(hlo_dir, exist_ok=True)
        stem = "".join(c if c.isalnum() else "_" for c in w.name)
        for tag, compiled in (("ours", built.ours), ("xla", built.base)):
            with open(os.path.join(hlo_dir, f"{stem}.{tag}.hlo.txt"), "w") as fh:
                fh.write(compiled.as_text())
    row: dict[str, Any] = {"workload": w.name, "mesh": dict(zip(w.mesh.dim_names, w.mesh.shape)),
                           "equations": built.equations,
                           "traced_equations": built.traced_equations,
                           "planned_collectives": built.planned_collectives, **w.info}
    row.update(communication(built.ours.as_text(), built.base.as_text(), w))
    row.update(memory(built.ours, built.base))
    row.update(work(built.ours, built.base))
    row.update(pass_times(built))
    row.update({"xla_compile_s": round(built.xla_compile_s, 3),
                "xla_base_compile_s": round(built.base_compile_s, 3),
                "pass_over_compile": _ratio(row["pass_s"], built.xla_compile_s)})

    def ours():
        return built.ours(*built.ours_inputs)

    def base():
        return built.base(*built.base_inputs)

    row["outputs_agree"] = outputs_agree(built.ours, built.base, built.ours_inputs,
                                         built.base_inputs)
    row.update(step_times(ours, base, pairs, warmup))
    row["call_overhead_ms"] = call_overhead(built.call, ours, max(3, pairs // 4))
    row["minimum_rationale"] = w.minimum.rationale if w.minimum else w.notes
    return row


__all__ = ["measure", "build", "pass_times", "time_plan", "planned_equations", "communication", "memory", "work", "step_times", "baseline_inputs"]
