"""The compiler benchmark: how long our passes take against XLA's compile, and what the
partitioned GPT step communicates against plain jax.jit with the same input shardings.

    python -m autoshard.bench compiler [--layers 2 12 48] [--scan 12] [--json FILE]
"""
from __future__ import annotations

import json
import time

import jax
import optax

from ..compiler.jit import DistributedFunction
from ..compiler.plan import make_plan
from ..compiler.trace import build_program
from ..hlo import collective_bytes, count_collectives
from . import gpt


def _is_dt(x):
    from ..dtensor import DistTensor

    return isinstance(x, DistTensor)


def measure(layers: int, form: str) -> dict:
    import autoshard as dist

    mesh = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
    step, _, args = gpt.workload(mesh, layers, form, optax.sgd(0.1))

    f: DistributedFunction = dist.jit(step)
    static, leaves, tree = f._split(args, {})
    from ..compiler.jit import _describe_leaf, _registry
    described = tuple(_describe_leaf(x) for x in leaves)
    closed, _ = f._trace(static, tree, described)
    t0 = time.perf_counter()
    program = build_program(closed)
    make_plan(program, mesh, [d.layout for d in described], f._out_targets(program, mesh),
              _registry(), dist.default_cost_model())  # timed alone: trace and compile excluded
    t_plan = time.perf_counter() - t0
    entry, phys_leaves = f._entry(args, {})
    physical = f._physical_inputs(entry, phys_leaves)
    t0 = time.perf_counter()
    lowered = entry.fn.lower(*physical)  # traces the local program: our partition pass
    t_partition = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = lowered.compile().as_text()
    t_compile = time.perf_counter() - t0
    base_args = jax.tree.map(lambda d: d.physical if _is_dt(d) else d, args, is_leaf=_is_dt)
    base = jax.jit(step).lower(*base_args).compile().as_text()
    ob, bb = sum(collective_bytes(ours).values()), sum(collective_bytes(base).values())
    return {
        "workload": f"gpt {form} {layers}L", "equations": len(program.eqns),
        "plan_s": round(t_plan, 3), "partition_s": round(t_partition, 3),
        "pass_s": round(t_plan + t_partition, 3), "xla_compile_s": round(t_compile, 3),
        "s_per_10k_eqns": round((t_plan + t_partition) / len(program.eqns) * 1e4, 3),
        "bytes": ob, "xla_bytes": bb, "bytes_ratio": round(ob / bb, 3) if bb else None,
        "collectives": sum(count_collectives(ours).values()),
        "xla_collectives": sum(count_collectives(base).values()),
    }


def run(layers=(2, 12, 48), scan=(12,), json_path: str | None = None) -> list[dict]:
    rows = [measure(n, "unrolled") for n in layers] + [measure(n, "scan") for n in scan]
    cols = ["workload", "equations", "plan_s", "partition_s", "s_per_10k_eqns", "xla_compile_s",
            "bytes", "xla_bytes", "bytes_ratio", "collectives", "xla_collectives"]
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print("  ".join(f"{str(r[c]):>14}" for c in cols))
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows
