"""The analytic minimum communication of a workload, computed from shapes alone.

A workload lists the collectives its parallel strategy cannot avoid (Megatron's two
all-reduces per MLP, ZeRO-3's parameter gathers, ...). Each is described by what it produces
on one device and the size of its group, so it can be counted under both conventions the
benchmark reports: result bytes (what `autoshard.hlo.collective_bytes` reads from compiled HLO:
an all-reduce's result is the whole buffer, an all-gather's the gathered tensor, a
reduce-scatter's one shard) and ring wire bytes (`autoshard.hlo.collective_wire_bytes`).
The two must agree with the HLO readers, or "equals the minimum" would mean nothing.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import numpy as np

_RING = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
         "reduce-scatter": lambda n: n - 1, "all-to-all": lambda n: (n - 1) / n,
         "collective-permute": lambda n: 1.0}


@dataclass(frozen=True)
class Collective:
    """One unavoidable collective: its kind, its result bytes per device, its group size."""

    kind: str
    result_bytes: int
    group: int
    what: str = ""

    @property
    def wire_bytes(self) -> float:
        return self.result_bytes * _RING[self.kind](self.group)


def nbytes(shape: Iterable[int], dtype=np.float32) -> int:
    return int(math.prod(shape)) * np.dtype(dtype).itemsize


def all_reduce(nbytes_: int, group: int, what: str = "") -> Collective:
    """Reduce a buffer of `nbytes_` (per device) over a group: the result is the whole buffer."""
    return Collective("all-reduce", nbytes_, group, what)


def all_gather(full_bytes: int, group: int, what: str = "") -> Collective:
    """Gather shards into a tensor of `full_bytes` (the gathered size, per device)."""
    return Collective("all-gather", full_bytes, group, what)


def reduce_scatter(full_bytes: int, group: int, what: str = "") -> Collective:
    """Reduce a buffer of `full_bytes` and keep one of `group` shards (the result)."""
    return Collective("reduce-scatter", full_bytes // group, group, what)


@dataclass(frozen=True)
class Minimum:
    """The collectives a workload must run per step, and why (for the report)."""

    collectives: tuple[Collective, ...]
    rationale: str

    @property
    def bytes(self) -> int:
        return sum(c.result_bytes for c in self.collectives)

    @property
    def wire_bytes(self) -> float:
        return sum(c.wire_bytes for c in self.collectives)

    @property
    def count(self) -> int:
        return len(self.collectives)

    def by_kind(self) -> dict[str, int]:
        out: Counter = Counter()
        for c in self.collectives:
            out[c.kind] += c.result_bytes
        return dict(out)


def megatron_blocks(act: int, mp: int, layers: int, backward: tuple[str, str]) -> list:
    """Per block of a Megatron transformer: two all-reduces of the activations forward (the
    attention and MLP outputs), two backward (the input gradients of the two column-parallel
    groups, named by `backward`)."""
    out = []
    for i in range(layers):
        out += [all_reduce(act, mp, f"block {i} attention output"),
                all_reduce(act, mp, f"block {i} mlp output"),
                *(all_reduce(act, mp, f"block {i} backward: {name} input gradient")
                  for name in backward)]
    return out


def dp_gradients(params, split_over_mp, dp: int, mp: int) -> list:
    """Each gradient reduced over dp at its mp-local size; `split_over_mp(path, p)` says whether
    a parameter is split over mp."""
    import jax

    out = []
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        local = p.nbytes // (mp if split_over_mp(path, p) else 1)
        out.append(all_reduce(local, dp, f"grad {jax.tree_util.keystr(path)}"))
    return out


__all__ = ["Collective", "Minimum", "nbytes", "all_reduce", "all_gather", "reduce_scatter",
           "megatron_blocks", "dp_gradients"]
