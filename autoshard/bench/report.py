"""Reporting benchmark rows: plain-text tables, the targets check, JSON and a bar chart.

Kept apart from measuring so a saved JSON can be re-reported (`python -m autoshard.bench
report FILE.json`) without re-running anything.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from typing import Any, Sequence

# ------------------------------------------------------------------------ formatting


def _bytes(n: Any) -> str:
    if n is None:
        return "—"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _x(r: Any) -> str:
    return "—" if r is None else f"{r:.2f}×"


def _s(t: Any) -> str:
    return "—" if t is None else (f"{t:.2f}" if t < 10 else f"{t:.1f}")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain monospace table, right-aligned but for the first column (also valid Markdown)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells):
        out = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":"
                         for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def print_rows(rows: Sequence[dict], cols: Sequence[str], min_width: int,
               json_path: str | None = None) -> None:
    """A suite's rows as right-aligned columns on stdout ('—' where a row has no value), and
    as a JSON list when asked (the small suites: compiler, pipeline)."""
    widths = [max(min_width, len(c)) for c in cols]
    print("  ".join(f"{c:>{w}}" for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(f"{str(r.get(c, '—')):>{w}}" for c, w in zip(cols, widths)))
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(list(rows), fh, indent=1)


def communication_table(rows: Sequence[dict]) -> str:
    headers = ["workload", "collectives (ours/xla/min)", "ops (ours/xla)", "bytes ours",
               "bytes xla", "ours/xla", "minimum", "ours/min", "wire ours/xla", "peak mem ours", "peak mem xla",
               "mem ours/xla"]
    body = [[r["workload"],
             f"{r['collectives']}/{r['xla_collectives']}/"
             f"{'—' if r['min_collectives'] is None else r['min_collectives']}",
             f"{r['collective_ops']}/{r['xla_collective_ops']}",
             _bytes(r["bytes"]), _bytes(r["xla_bytes"]), _x(r["bytes_ratio"]),
             _bytes(r["min_bytes"]), _x(r["vs_min"]), _x(r["wire_ratio"]),
             _bytes(r["mem"]["peak"]), _bytes(r["xla_mem"]["peak"]), _x(r["mem_ratio"])]
            for r in rows]
    return table(headers, body)


def time_table(rows: Sequence[dict]) -> str:
    headers = ["workload", "eqns", "plan s", "partition s", "pass s", "pass/trace", "jax lower s",
               "xla compile s",
               "pass/compile", "xla jit compile s", "flops ours/xla", "mem traffic ours/xla",
               "step ms ours", "step ms xla", "step ours/xla [min–max]", "same values"]
    body = [[r["workload"], str(r["equations"]), _s(r["plan_s"]), _s(r["partition_s"]),
             _s(r["pass_s"]), _x(r.get("pass_per_trace")), _s(r["lower_s"]),
             _s(r["xla_compile_s"]), f"{100 * r['pass_over_compile']:.0f}%",
             _s(r["xla_base_compile_s"]), _x(r.get("flops_ratio")),
             _x(r.get("bytes_accessed_ratio")), f"{r['step_ms']:.2f}", f"{r['xla_step_ms']:.2f}",
             f"{_x(r['step_ratio'])} [{r['step_ratio_min']:.2f}–{r['step_ratio_max']:.2f}]",
             "yes" if r["outputs_agree"] else "NO"]
            for r in rows]
    return table(headers, body)


# ------------------------------------------------------------------------ targets
_EXACT = ("dp mlp", "tp mlp", "gpt zero-3")


def targets(rows: Sequence[dict]) -> list[dict]:
    """The issue's targets, each with the measured value and whether it is met."""
    out: list[dict] = []

    def add(name, value, goal, met):
        out.append({"target": name, "value": value, "goal": goal, "met": bool(met)})

    for r in rows:
        add(f"bytes ≤ baseline: {r['workload']}", r["bytes_ratio"], "≤ 1.0",
            r["bytes_ratio"] is not None and r["bytes_ratio"] <= 1.0)
    for r in rows:
        if r["workload"].startswith("gpt dp×tp 12L") and not r["workload"].endswith("scan"):
            add("bytes ≤ 0.75× baseline: gpt dp×tp 12L", r["bytes_ratio"], "≤ 0.75",
                r["bytes_ratio"] is not None and r["bytes_ratio"] <= 0.75)
    for r in rows:
        if r["workload"].startswith(_EXACT):
            add(f"bytes = analytic minimum: {r['workload']}", r["vs_min"], "= 1.0",
                r["vs_min"] == 1.0)
    for r in rows:
        add(f"peak memory ≤ baseline: {r['workload']}", r["mem_ratio"], "≤ 1.0",
            r["mem_ratio"] is not None and r["mem_ratio"] <= 1.0)
    by_name = {r["workload"]: r for r in rows}
    r12, r48 = by_name.get("gpt dp×tp 12L"), by_name.get("gpt dp×tp 48L")
    if r12:
        add("pass time ≤ 10% of XLA compile: gpt dp×tp 12L", r12["pass_over_compile"], "≤ 0.10",
            r12["pass_over_compile"] <= 0.10)
    if r12 and r48:
        ratio = round(r48["pass_s"] / r12["pass_s"], 2)
        add("pass time 48L / 12L (linear)", ratio, "≤ 4.4", ratio <= 4.4)
    for r in rows:
        add(f"step time ≤ baseline: {r['workload']}", r["step_ratio"], "≤ 1.0",
            r["step_ratio"] is not None and r["step_ratio"] <= 1.0)
    return out


def targets_text(checks: Sequence[dict]) -> str:
    met = sum(c["met"] for c in checks)
    lines = [f"targets met: {met}/{len(checks)}"]
    lines += [f"  {'ok  ' if c['met'] else 'MISS'} {c['target']}: {c['value']} (goal {c['goal']})"
              for c in checks]
    return "\n".join(lines)


# ------------------------------------------------------------------------ files
def metadata(command: Sequence[str] | None = None) -> dict:
    import jax

    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores",
            "devices": f"{jax.device_count()} × {jax.devices()[0].platform}",
            "jax": jax.__version__, "python": platform.python_version(),
            "command": " ".join(command if command is not None else
                                ["python -m autoshard.bench", *sys.argv[1:]])}


def write_json(path: str, rows: Sequence[dict], meta: dict) -> None:
    def clean(x):  # JSON has no NaN / inf: they become null
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    doc = {"meta": meta, "rows": clean(list(rows)), "targets": targets(rows)}
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1, ensure_ascii=False)


def plot(path: str, rows: Sequence[dict]) -> None:
    """Grouped bars, one group per workload: every ratio against the baseline (1.0 = parity)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("bytes ours/xla", "bytes_ratio"), ("wire bytes ours/xla", "wire_ratio"),
              ("peak memory ours/xla", "mem_ratio"), ("step time ours/xla", "step_ratio"),
              ("pass / xla compile", "pass_over_compile")]
    names = [r["workload"] for r in rows]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(rows)), 4.5))
    for k, (label, key) in enumerate(series):
        values = [r[key] if r[key] is not None else 0.0 for r in rows]
        ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(rows))], values,
               width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), names, rotation=30, ha="right")
    ax.set_ylabel("ratio (lower is better)")
    ax.set_title("autoshard vs plain jax.jit (XLA/Shardy), same input shardings")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(rows: Sequence[dict]) -> str:
    return "\n\n".join(["Communication and memory (per device, per step)", communication_table(rows),
                        "Compile and step time", time_table(rows), targets_text(targets(rows))])


__all__ = ["render", "communication_table", "time_table", "targets", "targets_text", "metadata",
           "write_json", "plot", "table"]
