"""What a rule declares about one equation: a factor per operand/result dim, and a partial algebra.

Shardy's factor model in miniature. Each dim carries a factor (or None: never sharded, e.g. a
size-1 broadcast dim); sharding a factor on a mesh axis shards every dim that carries it.
- PASS factors are batch / elementwise / matmul m,n dims;
- REDUCE factors are contracted or reduced dims: sharding one makes the result Partial with the
  factor's reduce type;
- REPLICATE factors must stay whole (a sort axis, a concatenated dim);
- COMBINE factors may be sharded though no result dim carries them: the rule's own lowering
  combines the shards (argmax over a sharded axis), so the result is complete, not Partial.
The partial algebra says which Partial operands may flow straight through: LINEAR ops pass
P(sum)/P(avg) when all operands carry it (add), or when exactly one does and the rest are
replicated (mul, dot); MONOTONE ops pass P(max)/P(min) when all operands carry it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from ..placement import ReduceType

PASS, REDUCE, REPLICATE, COMBINE = "pass", "reduce", "replicate", "combine"
NONE, ALL, ONE = "none", "all", "one"

DimFactors = tuple  # tuple[int | tuple[int, ...] | None, ...]: factor index per dim
# A dim may carry a tuple of factors, major first: a compound dim (Shardy's term). A reshape
# splitting heads (8) into (kv_heads 2, group 4) gives the operand's dim both pieces; a dim
# split over axes (a, b) then puts a on the major piece and b on the minor one — valid only
# when the major piece is split whole before the minor takes an axis (the blocks stay
# contiguous), which `strategy.layouts` checks.


@dataclass(frozen=True)
class Factor:
    kind: str = PASS
    reduce_type: ReduceType | None = None
    # a piece of a compound dim (below): its own extent, which no single dim may have
    size: int | None = None


@dataclass(frozen=True)
class OpSharding:
    operands: tuple[DimFactors, ...]
    results: tuple[DimFactors, ...]
    factors: tuple[Factor, ...]
    linear: str = NONE           # how P(sum)/P(avg) pass: NONE, ALL or ONE
    monotone: str = NONE         # how P(max)/P(min) pass: NONE or ALL
    partial_operands: tuple[int, ...] | None = None  # operands that may be the partial one (ONE)
    monotone_types: tuple[ReduceType, ...] = (ReduceType.MAX, ReduceType.MIN)
    # a mesh axis a dim's factor cannot take (a reshape splitting the dim finer than the axis)
    # may move onto another passing factor instead of being given up (strategy._moved)
    regroups: bool = False
    compounds: tuple[tuple[int, ...], ...] = ()  # every compound dim's factors, for the check
    # result i is operand i's own (an optimization_barrier): each pair is decided by itself,
    # so one mesh axis may split a dim of every pair — one OpSharding over all of them would
    # give each axis to one factor, and move every other operand split on it
    independent: bool = False

    def pairs(self) -> list["OpSharding"]:
        """Per operand / result pair of an `independent` op, its own OpSharding."""
        out = []
        for ops, res in zip(self.operands, self.results):
            used = sorted({g for d in ops + res if d is not None
                           for g in (d if type(d) is tuple else (d,))})
            at = {f: k for k, f in enumerate(used)}

            def renamed(dims: DimFactors) -> DimFactors:
                return tuple(None if d is None else tuple(at[g] for g in d) if type(d) is tuple
                             else at[d] for d in dims)
            out.append(OpSharding((renamed(ops),), (renamed(res),),
                                  tuple(self.factors[f] for f in used), self.linear,
                                  self.monotone, None, self.monotone_types, self.regroups,
                                  tuple(tuple(at[g] for g in c) for c in self.compounds
                                        if all(g in at for g in c))))
        return out

    def partial_mode(self, reduce_type: ReduceType) -> str:
        if reduce_type in (ReduceType.SUM, ReduceType.AVG):
            return self.linear
        return self.monotone if reduce_type in self.monotone_types else NONE

    def dims_of(self, factor: int) -> list[tuple[str, int, int]]:
        """('operand'|'result', index, dim) of every dim that carries `factor`."""
        out = []
        for kind, groups in (("operand", self.operands), ("result", self.results)):
            for i, dims in enumerate(groups):
                for d, f in enumerate(dims):
                    if f == factor or (type(f) is tuple and factor in f):
                        out.append((kind, i, d))
        return out


class InLoop:
    """The last item of a rule's `comm` entry that its lowering runs once per iteration of a
    loop of its own, whose count is known only when it runs (listed once, runs unknown: as a
    while loop's collectives)."""


class Serves(NamedTuple):
    """The last item of a rule's `comm` entry (rules/registry.py) that only result `output`
    of the equation needs."""

    output: int


def einsum(spec: str, shapes_in: Sequence[Sequence[int]], shapes_out: Sequence[Sequence[int]],
           *, reduce_type: ReduceType = ReduceType.SUM, replicate: str = "", combine: str = "",
           linear: str = NONE, monotone: str = NONE,
           partial_operands: tuple[int, ...] | None = None,
           monotone_types: tuple[ReduceType, ...] = (ReduceType.MAX, ReduceType.MIN)) -> OpSharding:
    """Build an OpSharding from an einsum-like spec, e.g. "bk,kn->bn" (one letter per dim).

    Letters only on the input side are REDUCE factors; letters in `replicate` are REPLICATE;
    `.` marks a dim that is never sharded. Size-1 dims are never sharded either.
    """
    lhs, rhs = spec.split("->")
    ins, outs = lhs.split(","), rhs.split(",")
    letters: list[str] = []
    for term in ins + outs:
        for ch in term:
            if ch != "." and ch not in letters:
                letters.append(ch)
    out_letters = set("".join(outs))
    factors = tuple(
        Factor(REPLICATE) if ch in replicate else
        Factor(COMBINE) if ch in combine else
        Factor(PASS) if ch in out_letters else Factor(REDUCE, reduce_type)
        for ch in letters)

    def dims(term: str, shape: Sequence[int]) -> DimFactors:
        assert len(term) == len(shape), (spec, term, shape)
        return tuple(None if ch == "." or size == 1 else letters.index(ch)
                     for ch, size in zip(term, shape))

    return OpSharding(tuple(dims(t, s) for t, s in zip(ins, shapes_in)),
                      tuple(dims(t, s) for t, s in zip(outs, shapes_out)),
                      factors, linear, monotone, partial_operands, monotone_types)


LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

__all__ = ["Factor", "OpSharding", "Serves", "einsum", "PASS", "REDUCE", "REPLICATE", "COMBINE", "NONE", "ALL", "ONE",
           "LETTERS"]
