"""The compiler suite: how long our passes take against XLA's compile, and what the
partitioned GPT step communicates against plain jax.jit with the same input shardings.

Pass time is plan (build_program + propagate + plan) + partition (tracing our local program
under shard_map); jax's lowering of it to StableHLO is the `lower_s` column, apart, and
`s_per_10k_eqns_with_lower` counts it in (see `measure.py`). `trace_s` is jax's `make_jaxpr`
of the same step on the same machine, and `pass_per_trace` our pass time over it: seconds per
10k equations vary with the machine's speed (2-3x between days on the shared machine these
were measured on), the ratio to jax's own tracing much less. Plan and partition are each the
best of three fresh dist.jit's, which reuse what the first left in the process's memos
(strategy choices, rule answers, reshard plans; compiler/replay.py's lowerings and outlined
blocks): a second model, or a re-made dist.jit, in the same process. `plan_first_s` and
`partition_first_s` are the first of them with every such memo forgotten before
(`measure.forget_memos`) — a model's first compile in a process that has compiled something
else before (`measure.warm_process`: what any first jax program pays is not ours) — and
`s_per_10k_eqns_first` their seconds per 10k equations. `equations` counts the program
the passes plan (duplicates merged, steps XLA's simplifier removes removed: ~10% fewer on the
GPT step), `traced_equations` the traced step they start from (calls inlined), each with its
seconds per 10k; `equations_with_bodies` adds each loop / cond / checkpoint body's equations
once (`measure.planned_equations`), which the passes plan and partition too: a scanned model's
top level is a hundred equations around its layer's body.

    python -m autoshard.bench compiler [--layers 2 12 48] [--scan 12] [--json FILE]

A subset of the full suite (`python -m autoshard.bench`) without step timing, for quick
looks at compile-time scaling.
"""
from __future__ import annotations

from .gpt_workloads import gpt_dp_tp
from .measure import build, communication, pass_times, warm_process
from .report import print_rows


def measure(layers: int, form: str) -> dict:
    w = gpt_dp_tp(layers, form)
    b = build(w)
    comm = communication(b.ours.as_text(), b.base.as_text(), w)
    return {
        "workload": f"gpt {form} {layers}L", "equations": b.equations,
        "traced_equations": b.traced_equations, **pass_times(b),
        "xla_compile_s": round(b.xla_compile_s, 3),
        **{k: comm[k] for k in ("bytes", "xla_bytes", "bytes_ratio", "collectives",
                                "xla_collectives", "collective_ops", "xla_collective_ops")},
    }


def run(layers=(2, 12, 48), scan=(12,), json_path: str | None = None) -> list[dict]:
    warm_process()  # (the first row's first compile: our passes, not the process's start)
    rows = [measure(n, "unrolled") for n in sorted(layers)]
    # The cost of the equations a deeper model adds (slope between consecutive depths): what
    # "linear in layers" is about, without the fixed cost of a pass (jax's tracing of the
    # shard_map, the program's first equations) that dominates a 2-layer model's average.
    for a, b in zip(rows, rows[1:]):
        added = b["equations"] - a["equations"]
        b["marginal_s_per_10k_eqns"] = round((b["pass_s"] - a["pass_s"]) * 1e4 / added, 3) \
            if added > 0 else None
    rows += [measure(n, "scan") for n in scan]
    cols = ["workload", "equations", "traced_equations", "equations_with_bodies", "plan_s",
            "partition_s", "trace_s", "pass_per_trace", "lower_s", "s_per_10k_eqns",
            "s_per_10k_traced_eqns", "s_per_10k_eqns_with_bodies",
            "marginal_s_per_10k_eqns", "plan_first_s", "partition_first_s", "s_per_10k_eqns_first",
            "s_per_10k_eqns_with_lower", "xla_compile_s", "bytes",
            "xla_bytes", "bytes_ratio", "collectives", "xla_collectives", "collective_ops",
            "xla_collective_ops"]
    print_rows(rows, cols, 14, json_path)
    return rows
