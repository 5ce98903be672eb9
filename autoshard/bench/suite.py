"""The benchmark suite: which workloads run, at which sizes, and in what order.

`full` is what the README reports; `quick` is a smoke run for the test suite (small sizes, the
GPT at one layer, few timing pairs) that exercises every code path the full run takes except
the long compiles. Builders are lazy so `--only` can pick workloads without building the rest.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .workloads import Workload


@dataclass(frozen=True)
class Entry:
    key: str
    build: Callable[[], Workload]


def catalog(quick: bool) -> list[Entry]:
    from . import gpt_workloads as g
    from . import llama_workloads as ll
    from . import workloads as w

    if quick:
        return [Entry("dp-mlp", lambda: w.dp_mlp(True)), Entry("tp-mlp", lambda: w.tp_mlp(True)),
                Entry("gpt", lambda: g.gpt_dp_tp(1)), Entry("zero3", lambda: g.gpt_zero3(1)),
                Entry("llama", lambda: ll.llama_dp_tp(1)),
                Entry("llama-cp", lambda: ll.llama_context_parallel(1)),
                Entry("vocab-ce", lambda: w.vocab_ce(True)),
                Entry("dropout", lambda: w.dropout_mlp(True)),
                Entry("spatial-cnn", lambda: w.spatial_cnn(True)),
                Entry("shifted-lm", lambda: w.shifted_lm_loss(True)),
                Entry("ring-attention", lambda: w.ring_attention(True)),
                Entry("linear-recurrence", lambda: w.linear_recurrence(True))]
    return [Entry("dp-mlp", w.dp_mlp), Entry("tp-mlp", w.tp_mlp),
            Entry("gpt-2", lambda: g.gpt_dp_tp(2)), Entry("gpt-12", lambda: g.gpt_dp_tp(12)),
            Entry("gpt-48", lambda: g.gpt_dp_tp(48)),
            Entry("gpt-12-scan", lambda: g.gpt_dp_tp(12, "scan")),
            Entry("llama-4", lambda: ll.llama_dp_tp(4)),
            Entry("llama-4-scan", lambda: ll.llama_dp_tp(4, "scan")),
            Entry("llama-cp-all2all", lambda: ll.llama_context_parallel(2, "all2all")),
            Entry("llama-cp-p2p", lambda: ll.llama_context_parallel(2, "p2p")),
            Entry("zero3", lambda: g.gpt_zero3(12)),
            Entry("seq-parallel", lambda: g.gpt_sequence_parallel(12)),
            Entry("vocab-ce", w.vocab_ce), Entry("dropout", w.dropout_mlp),
            Entry("spatial-cnn", w.spatial_cnn), Entry("shifted-lm", w.shifted_lm_loss),
            Entry("ring-attention", w.ring_attention),
            Entry("linear-recurrence", w.linear_recurrence)]


def run(quick: bool = False, only: Sequence[str] | None = None, pairs: int | None = None,
        progress: Callable[[str], None] | None = print, hlo_dir: str | None = None) -> list[dict]:
    """Measure each selected workload in turn; one row per workload."""
    from .measure import measure

    entries = catalog(quick)
    if only:
        unknown = set(only) - {e.key for e in entries}
        if unknown:
            raise SystemExit(f"unknown workload(s) {sorted(unknown)}; choose from "
                             f"{[e.key for e in entries]}")
        entries = [e for e in entries if e.key in only]
    n_pairs = pairs if pairs is not None else (3 if quick else 30)
    rows = []
    for e in entries:
        t0 = time.perf_counter()
        row = measure(e.build(), pairs=n_pairs, warmup=1 if quick else 3, hlo_dir=hlo_dir)
        row["key"] = e.key
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        if progress:
            progress(f"  {row['workload']}: bytes {row['bytes']} (xla {row['xla_bytes']}), "
                     f"step ×{row['step_ratio']}, {row['wall_s']} s")
        rows.append(row)
    return rows


__all__ = ["Entry", "catalog", "run"]
