"""Strategies for one equation: which mesh axis shards which factor, which Partial passes through.

The engine derives N-d strategies from the rule's 1-d factor description: candidates are seeded
from the operands' current layouts and the results' preferred layouts (merged where they agree,
in both priority orders), plus replicated. A pending Partial axis lands on a factor — one
reduce-scatter — only when a consumer's preferred layout asks for that shard (or, in a plan
made again for it, where the step's results are only summed up: summed_up.py); sharding that
nobody asked for (an implicit ZeRO) is the user's choice, not a side effect;
each is priced with the cost model (reshards of operands, mismatch with what consumers prefer,
local compute) and the cheapest wins, deterministically (first of equals). The plan (not
propagation) also tries each operand with the axes of a dim the op sums over moved onto a dim
it keeps: an all-to-all of that operand instead of a Partial result as large as the output.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple, Sequence

import jax
import numpy as np

from ..cost_model import CostModel
from ..errors import PlacementError
from ..layout import Layout
from ..mesh import ProcessMesh
from ..placement import ReduceType
from ..reshard.planner import plan_on_mesh
from .dtypes import cost_dtype, itemsize
from .factors import ALL, NONE, ONE, PASS, REDUCE, REPLICATE, OpSharding

ALL_OPERANDS = -1


class _Unread:
    """A result's preference (`preferred[j]`) when it is an output of the program returned
    as planned, reduced (no placement asked) and read by nothing in the program: any layout
    costs nothing more, a Partial pays its whole reduction (the output is reduced where it is
    returned, nothing merges or scatters it later)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNREAD"


UNREAD = _Unread()


@dataclass(frozen=True)
class Strategy:
    assign: tuple[tuple[str, int], ...] = ()                 # (mesh axis, factor), co-shard order
    partial: tuple[tuple[str, ReduceType, int], ...] = ()    # (axis, type, operand or ALL_OPERANDS)

    def axes_of(self, factor: int) -> tuple[str, ...]:
        return tuple(a for a, f in self.assign if f == factor)

    def used(self) -> set[str]:
        return {a for a, _ in self.assign} | {a for a, _, _ in self.partial}

    def describe(self, opsh: OpSharding) -> str:
        parts = [f"{a}→{'reduce' if opsh.factors[f].kind == REDUCE else 'dim'}#{f}" for a, f in self.assign]
        parts += [f"{a}→P({t.value}) passes" for a, t, _ in self.partial]
        return ", ".join(parts) or "replicated"


def _dims(groups, factors_axes) -> tuple[tuple[str, ...], ...]:
    return tuple(() if f is None else factors_axes.get(f, ()) if type(f) is not tuple
                 else tuple(a for g in f for a in factors_axes.get(g, ())) for f in groups)


def _kind(opsh: OpSharding, f) -> str | None:
    """The kind of a dim's factor (a compound dim's pieces all pass)."""
    if f is None:
        return None
    return opsh.factors[f[0] if type(f) is tuple else f].kind


def _assigned(f, axes, opsh: OpSharding, sizes) -> list[tuple[str, int]]:
    """(axis, factor) for a dim split over `axes` (major first) carrying factor(s) `f`: on a
    compound dim each axis takes the piece it falls in, a piece moving on once its axes split
    it whole. An axis that does not fit stays on its piece: the strategy is then invalid and
    repaired (`_repaired`). Without mesh sizes, every axis goes to the major piece."""
    if type(f) is not tuple:
        return [(a, f) for a in axes]
    out, k, left = [], 0, opsh.factors[f[0]].size
    for a in axes:
        while left == 1 and k + 1 < len(f):
            k += 1
            left = opsh.factors[f[k]].size
        out.append((a, f[k]))
        if sizes is not None and left % sizes[a] == 0:
            left //= sizes[a]
    return out


def layouts(opsh: OpSharding, s: Strategy, in_shapes: Sequence[tuple[int, ...]],
            out_shapes: Sequence[tuple[int, ...]], sizes) -> tuple[list[Layout], list[Layout]] | None:
    """Operand and result layouts that strategy `s` implies; None if it is not valid here."""
    factor_axes: dict[int, tuple[str, ...]] = {}
    for a, f in s.assign:
        if opsh.factors[f].kind == REPLICATE:
            return None
        factor_axes[f] = factor_axes.get(f, ()) + (a,)
    for f, axes in factor_axes.items():
        n = math.prod(sizes[a] for a in axes)
        piece = opsh.factors[f].size
        if piece is not None and piece % n:
            return None
        for kind, i, d in opsh.dims_of(f):
            shape = in_shapes[i] if kind == "operand" else out_shapes[i]
            if shape[d] % n:
                return None
    for pieces in opsh.compounds:  # a minor piece split only under a major one split whole
        for k, f in enumerate(pieces[:-1]):
            if (any(g in factor_axes for g in pieces[k + 1:])
                    and math.prod(sizes[a] for a in factor_axes.get(f, ())) != opsh.factors[f].size):
                return None
    try:
        ins = []
        for i, groups in enumerate(opsh.operands):
            partial = tuple((a, t) for a, t, who in s.partial if who in (ALL_OPERANDS, i))
            ins.append(Layout(_dims(groups, factor_axes), partial))
        outs = []
        reduced = tuple((a, opsh.factors[f].reduce_type) for a, f in s.assign
                        if opsh.factors[f].kind == REDUCE)
        passed = tuple((a, t) for a, t, _ in s.partial)
        for groups in opsh.results:
            outs.append(Layout(_dims(groups, factor_axes), reduced + passed))
    except PlacementError:  # e.g. a max-partial meeting a sum-partial
        return None
    return ins, outs


def _is_linear(t: ReduceType, dtype) -> bool:
    """A pending sum or mean of `dtype` passes a linear step as one: not a bool's (its parts'
    "sum" is their or), nor an integer's mean (truncated: (p0 + p1) // 2 * 2 is not
    (2 * p0 + 2 * p1) // 2)."""
    if dtype is None or t not in (ReduceType.SUM, ReduceType.AVG):
        return True
    if t is ReduceType.SUM:
        return dtype != np.bool_
    return jax.dtypes.issubdtype(dtype, np.inexact)


def _seed_from(groups, layout: Layout, opsh: OpSharding, operand: int | None,
               may_pass: bool = True, sizes=None, dtype=None):
    assign, partial = [], []
    for d, axes in enumerate(layout.dims):
        f = groups[d] if d < len(groups) else None
        if f is None or _kind(opsh, f) == REPLICATE:
            continue
        assign.extend(_assigned(f, axes, opsh, sizes))
    if operand is not None and may_pass:
        for a, t in layout.partial:
            if not _is_linear(t, dtype):
                continue
            mode = opsh.partial_mode(t)
            if mode == ALL:
                partial.append((a, t, ALL_OPERANDS))
            elif mode == ONE and (opsh.partial_operands is None or operand in opsh.partial_operands):
                partial.append((a, t, operand))
    return assign, partial


def _seeds_moving(groups, layout: Layout, opsh: OpSharding, sizes=None):
    """The operand's own assignment with the axes of its dims the op needs whole moved onto
    another of its dims the op lets pass (an all-to-all instead of an all-gather: a sort
    along a split dim re-splits the rows by that axis, as XLA does) — one seed per such dim,
    a dim already split first, then in order: the first may be one the axes do not divide (a
    batch of 4 over 8 devices), where a later one (the channels) would take them."""
    spare, kept, passing = [], {}, []
    for d, axes in enumerate(layout.dims):
        f = groups[d] if d < len(groups) else None
        kind = _kind(opsh, f)
        if f is None or kind == REPLICATE:
            spare.extend(axes)
        elif kind == PASS:
            kept[d] = axes
            passing.append((not axes, d))
    if not spare:
        return
    for _, target in sorted(passing):
        moved = dict(kept)
        moved[target] = moved[target] + tuple(spare)
        yield [x for d, axes in moved.items() for x in _assigned(groups[d], axes, opsh, sizes)], []


def _seeds_unreducing(groups, layout: Layout, opsh: OpSharding):
    """For each split dim of the operand that the op sums over: its own assignment with that
    dim's axes moved onto a dim the op lets pass — an all-to-all of the operand instead of a
    Partial result as large as the output (the embedding gradient: a scatter-add of a
    sequence-split cotangent into the whole table)."""
    if opsh.compounds:  # a reshape's: it sums over nothing
        return
    kinds = [_kind(opsh, groups[d]) if d < len(groups) else None
             for d in range(len(layout.dims))]
    passing = [(not axes, d) for d, axes in enumerate(layout.dims) if kinds[d] == PASS]
    if not passing:
        return
    target = groups[min(passing)[1]]
    for moved, axes in enumerate(layout.dims):
        if not axes or kinds[moved] != REDUCE:
            continue
        assign = [(a, groups[d]) for d, dim_axes in enumerate(layout.dims) if d != moved
                  and kinds[d] in (PASS, REDUCE) for a in dim_axes]
        yield assign + [(a, target) for a in axes], []


def _seeds_scattering(groups, layout: Layout, opsh: OpSharding):
    """For an operand with pending sums: its own assignment with the sums' axes put on a dim
    the op lets pass (each such dim in turn) — one reduce-scatter of the operand where an
    all-reduce would make it whole on every device. A gradient read first by a finiteness
    check or a norm (optax's apply_if_finite, clip_by_global_norm) and then by a ZeRO-sharded
    update was all-reduced for the check; scattered, the check reads a shard and the update
    the same shard."""
    if opsh.compounds:  # a reshape's: its pieces are placed by the reshard planner
        return
    sums = tuple(a for a, t in layout.partial if t is ReduceType.SUM)
    if not sums:
        return
    kinds = [_kind(opsh, groups[d]) if d < len(groups) else None
             for d in range(len(layout.dims))]
    own = [(a, groups[d]) for d, axes in enumerate(layout.dims)
           if kinds[d] in (PASS, REDUCE) for a in axes]
    # a dim no other axis splits first (as ZeRO places a tensor-parallel weight's state:
    # on a tie the first candidate wins), then in order
    for _, d in sorted((bool(axes), d) for d, axes in enumerate(layout.dims)
                       if kinds[d] == PASS):
        yield own + [(a, groups[d]) for a in sums], []


def _merge(seeds) -> Strategy:
    assign, partial, used = [], [], set()
    for seed_assign, seed_partial in seeds:
        for a, f in seed_assign:
            if a not in used:
                assign.append((a, f))
                used.add(a)
        for a, t, who in seed_partial:
            if a not in used:
                partial.append((a, t, who))
                used.add(a)
    return Strategy(tuple(assign), tuple(partial))


def candidates(opsh: OpSharding, actual: Sequence[Layout | None],
               preferred: Sequence[Layout | None],
               single_use: Sequence[bool] | None = None,
               available: Sequence[frozenset] = (), unreducing: bool = False,
               sizes=None, scattering: bool = False,
               dtypes: Sequence | None = None) -> list[Strategy]:
    """`single_use[i]`: operand i has no other consumer, so its Partial may flow through here.
    `available[i]`: layouts operand i was already moved to: each also seeds a strategy.
    `dtypes[i]`: operand i's dtype (a bool's or an integer mean's Partial never flows).

    A Partial with several consumers is reduced once, where it is first needed, and every
    consumer reads the reduced value — else each branch would reduce its own view of it.
    `sizes` (the mesh's axis sizes) place the axes of a compound dim on its pieces.
    """
    single_use = single_use if single_use is not None else [True] * len(actual)
    dtypes = dtypes if dtypes is not None else [None] * len(actual)
    operand_seeds = {i: _seed_from(opsh.operands[i], L, opsh, i, single_use[i], sizes,
                                   dtypes[i])
                     for i, L in enumerate(actual) if L is not None}
    seeds = list(operand_seeds.values())
    seeds += [_seed_from(opsh.results[j], L, opsh, None, sizes=sizes)
              for j, L in enumerate(preferred) if L is not None and L is not UNREAD]
    extra = [(i, _seed_from(opsh.operands[i], L, opsh, i, single_use[i], sizes, dtypes[i]))
             for i, moved in enumerate(available) for L in sorted(moved, key=repr)]
    out: list[Strategy] = [_merge(seeds), _merge(list(reversed(seeds)))]
    moving = [m for i, L in enumerate(actual) if L is not None
              for m in _seeds_moving(opsh.operands[i], L, opsh, sizes)]
    if unreducing:
        for i, L in enumerate(actual):
            for m in _seeds_unreducing(opsh.operands[i], L, opsh) if L is not None else ():
                # first with the other operands' axes as they lie: a weight gradient's batch
                # axis moved onto a feature dim of the activations while the cotangent keeps
                # its tensor-parallel split — the gradient comes out split on two dims, as
                # ZeRO shards a tensor-parallel weight's optimizer state (on a tie it wins
                # over the batch axis nested under the tensor-parallel one)
                others = [sd for j, sd in operand_seeds.items() if j != i]
                moving.append((list(m[0]) + [x for sd in others for x in sd[0]],
                               list(m[1]) + [x for sd in others for x in sd[1]]))
                moving.append(m)
    if scattering:
        for i, L in enumerate(actual):
            for m in _seeds_scattering(opsh.operands[i], L, opsh) if L is not None else ():
                moving.append(m)
    out += [_merge([s]) for s in seeds + [e for _, e in extra]]
    # a copy made for an earlier consumer, completed by another operand's axes as it lies:
    # the sequence-parallel backward reuses the gathered cotangent with the row-split weight,
    # where the other seeds gather the weight too
    out += [_merge([e, seed]) for i, e in extra for j, seed in operand_seeds.items() if j != i]
    out += [_merge([m]) for m in moving]
    # each operand's own splits less those the op sums over: the summed dims gathered instead
    # of a pending result as large as the output (a scatter-add into a fresh table, batched
    # by vmap: the batch stays split, each device counts its rows' whole table)
    for seed_assign, _ in operand_seeds.values():
        kept = [(a, f) for a, f in seed_assign if opsh.factors[f].kind != REDUCE]
        if kept and len(kept) < len(seed_assign):
            out.append(_merge([(kept, [])]))
    out.append(Strategy())
    unique: list[Strategy] = []
    for s in out:
        if s not in unique:
            unique.append(s)
    return unique


def reshard_seconds(mesh: ProcessMesh, src: Layout, dst: Layout, shape, dtype,
                    cost_model: CostModel) -> float:
    if src == dst:
        return 0.0
    return sum(s.seconds for s in plan_on_mesh(mesh, src, dst, tuple(shape), cost_dtype(dtype),
                                                cost_model))


def deferred_reduction_seconds(mesh: ProcessMesh, result: Layout, preferred: Layout | None,
                               aval, cost_model: CostModel) -> float:
    """The price of a Partial the result leaves pending (the preferred layout keeps it).

    A pending Partial is reduced later — perhaps merged with others first, perhaps
    reduce-scattered — so it is priced at half an all-reduce of the result as it is now. Not
    pricing it lets a strategy look free that contracts a dim sharded on a large axis and leaves
    a full-size weight gradient to reduce over every axis (sequence parallelism's backward).
    """
    if not result.partial:
        return 0.0
    kept = set(preferred.partial) if preferred is not None else set(result.partial)
    pending = [p for p in result.partial if p in kept]
    if not pending:
        return 0.0  # reduced on the way to the preferred layout: already in the reshard cost
    done = Layout(result.dims, tuple(p for p in result.partial if p not in pending))
    return 0.5 * reshard_seconds(mesh, result, done, aval.shape, aval.dtype, cost_model)


def made_partial_seconds(mesh: ProcessMesh, actual: Layout, required: Layout, aval,
                         cost_model: CostModel) -> float:
    """The price of making a complete operand Partial so a Partial can pass through.

    The Partial it joins is reduced later anyway, but the operand then travels in that
    reduction instead of being added after it, and a computed operand made Partial is
    recomputed by XLA in every consumer fusion (the residual stream of a Megatron block, with
    its dropout mask: O(layers²) work in the backward). Priced like a pending Partial of the
    operand itself, it wins only where a reduction is really saved.
    """
    made = [a for a in required.partial if a not in actual.partial]
    if not made:
        return 0.0
    done = Layout(required.dims, tuple(p for p in required.partial if p not in made))
    return 0.5 * reshard_seconds(mesh, required, done, aval.shape, aval.dtype, cost_model)


@dataclass(frozen=True)
class Choice:
    strategy: Strategy
    operands: list[Layout]
    results: list[Layout]
    seconds: float
    considered: int
    description: str = ""  # `strategy.describe(opsh)`: made once per memoised decision


class _Aval(NamedTuple):  # a tuple: cheap to build, hash and compare
    shape: tuple
    dtype: object


class Signature:
    """What planning needs of one equation besides layouts: its rule description and avals.

    Interned (`signature`): structurally equal equations — every layer of a model repeats
    them — share one object, so the memoised `choose` hashes and compares it by identity, not
    the OpSharding and avals field by field on every decision.
    """

    __slots__ = ("opsh", "in_avals", "out_avals")

    def __init__(self, opsh: OpSharding, in_avals: tuple[_Aval, ...], out_avals: tuple[_Aval, ...]):
        self.opsh, self.in_avals, self.out_avals = opsh, in_avals, out_avals


_SIGNATURES: dict = {}
_MAX_SIGNATURES = 65536  # past this the table starts over (old entries only miss, never lie)


def signature(opsh: OpSharding, in_avals, out_avals) -> Signature:
    key = (opsh, tuple(_Aval(tuple(a.shape), a.dtype) for a in in_avals),
           tuple(_Aval(tuple(a.shape), a.dtype) for a in out_avals))
    sig = _SIGNATURES.get(key)
    if sig is None:
        if len(_SIGNATURES) >= _MAX_SIGNATURES:
            _SIGNATURES.clear()
        sig = _SIGNATURES[key] = Signature(*key)
    return sig


def choose(sig: Signature, mesh: ProcessMesh, actual: tuple[Layout | None, ...],
           preferred: tuple[Layout | None, ...], cost_model: CostModel,
           single_use: tuple[bool, ...], available: tuple[frozenset, ...],
           parameters: tuple[bool, ...]) -> Choice:
    """The cheapest valid strategy; `actual[i]` None means the operand is free (costs nothing).

    `single_use[i]`: operand i has no other consumer (see `candidates`). `available[i]`:
    layouts operand i has already been moved to for an earlier consumer; the partitioned
    program reuses that copy, so asking for one of them costs nothing more. `parameters[i]`:
    operand i is an input or constant of the program (a loop body's carry included): made
    Partial, it is not recomputed anywhere, so that costs nothing either.

    A pure function of its arguments (all tuples: they are the cache key), memoised: the
    layers of a model repeat the same decisions, so most equations of a deep network are
    answered from the cache.
    """
    return chooser(mesh, cost_model)(sig, actual, preferred, single_use, available, parameters)


_MEMOS: dict = {}  # (mesh, cost model, unreducing) -> {the other arguments: Choice}
_MAX_MEMO = 65536


def chooser(mesh: ProcessMesh, cost_model: CostModel, unreducing: bool = False,
            scattering: bool = False):
    """`choose` with the mesh and cost model fixed. Propagation and the plan ask once per
    equation: fetching this once per pass spares hashing the mesh and the cost model on each
    of those calls.

    `unreducing`: also weigh the candidates of `_seeds_unreducing`; `scattering`, those of
    `_seeds_scattering` (the plan asks so where the results are only summed up:
    summed_up.py).
    """
    memo = _MEMOS.get((mesh, cost_model, unreducing, scattering))
    if memo is None:
        if len(_MEMOS) >= 64:
            _MEMOS.clear()
        memo = _MEMOS[(mesh, cost_model, unreducing, scattering)] = {}

    def pick(sig: Signature, actual: tuple, preferred: tuple, single_use: tuple,
             available: tuple, parameters: tuple) -> Choice:
        key = (sig, actual, preferred, single_use, available, parameters)
        choice = memo.get(key)
        if choice is None:
            if len(memo) >= _MAX_MEMO:
                memo.clear()
            choice = memo[key] = _choose(sig, mesh, actual, preferred, cost_model, single_use,
                                         available, parameters, unreducing, scattering)
        return choice
    return pick


def _repaired(opsh: OpSharding, s: Strategy, in_shapes, out_shapes, sizes) -> Strategy:
    """`s` without the assignments that make it invalid here: a mesh axis whose factor it does
    not divide (a reshape's (kv_heads * head_dim) → (kv_heads, head_dim) with fewer kv heads
    than mp devices) is dropped, the others kept. Without this, one such axis threw away every
    axis of the strategy — a batch dim's dp split included — and the operand was gathered whole."""
    kept: list[tuple[str, int]] = []
    for a, f in s.assign:
        trial = Strategy(tuple(kept) + ((a, f),))
        if layouts(opsh, trial, in_shapes, out_shapes, sizes) is not None:
            kept.append((a, f))
    return Strategy(tuple(kept), s.partial)


def _moved(opsh: OpSharding, s: Strategy, repaired: Strategy, in_shapes, out_shapes,
           sizes) -> Strategy | None:
    """`repaired` with each axis the repair dropped moved onto another passing factor that
    takes it (the first in order): an all-to-all instead of an all-gather where a reshape
    splits a dim finer than its mesh axis (8 query heads over 4 devices grouped as 2 key-value
    heads × 4: the axis moves to the batch or the sequence, and the attention stays computed
    split, by rows instead of heads).

    Reshapes only (`OpSharding.regroups`): offered to every op, each strided slice of jax's
    associative scan moved the axis to the next dim and the op after it moved it back (27
    all-to-alls where 8 gathers did). Never onto the operand's minor dim: features, which the
    next matmul contracts — unflattening (batch * sequence, features) with the batch smaller
    than the axis moved it there, and the matmul after left its whole output to all-reduce
    (2x the bytes of the gather)."""
    kept = list(repaired.assign)
    used = {a for a, _ in kept}
    minor = {g for dims in opsh.operands if dims
             for g in (dims[-1] if type(dims[-1]) is tuple else (dims[-1],))}
    moved = False
    for a, f in s.assign:
        if a in used:
            continue
        for g, factor in enumerate(opsh.factors):
            if g == f or factor.kind != PASS or g in minor:
                continue
            trial = Strategy(tuple(kept) + ((a, g),), s.partial)
            if layouts(opsh, trial, in_shapes, out_shapes, sizes) is not None:
                kept.append((a, g))
                used.add(a)
                moved = True
                break
    return Strategy(tuple(kept), s.partial) if moved else None


def _with_repairs(cands, opsh, in_shapes, out_shapes, sizes):
    """(strategy, its layouts) of the valid candidates, an invalid one replaced by its repair
    (when that is not a candidate already) and by the repair with the dropped axes moved."""
    tried = set(cands)
    for s in cands:
        implied = layouts(opsh, s, in_shapes, out_shapes, sizes)
        if implied is None and s.assign:
            fixed = _repaired(opsh, s, in_shapes, out_shapes, sizes)
            moved = _moved(opsh, s, fixed, in_shapes, out_shapes, sizes) if opsh.regroups \
                else None
            for r in (fixed, moved):
                if r is None or r in tried:
                    continue
                tried.add(r)
                implied = layouts(opsh, r, in_shapes, out_shapes, sizes)
                if implied is not None:
                    yield r, implied
            continue
        if implied is not None:
            yield s, implied


def _choose(sig: Signature, mesh: ProcessMesh, actual, preferred, cost_model: CostModel,
            single_use, available, parameters, unreducing: bool = False,
            scattering: bool = False) -> Choice:
    opsh, in_avals, out_avals = sig.opsh, sig.in_avals, sig.out_avals
    if opsh.independent:
        return _choose_pairs(sig, mesh, actual, preferred, cost_model, single_use, available,
                             parameters, unreducing, scattering)
    sizes = mesh.axis_sizes
    in_shapes = [a.shape for a in in_avals]
    out_shapes = [a.shape for a in out_avals]
    best: Choice | None = None
    best_nested = 0
    cands = candidates(opsh, actual, preferred, single_use, available, unreducing, sizes,
                       scattering, [a.dtype for a in in_avals])
    for s, implied in _with_repairs(cands, opsh, in_shapes, out_shapes, sizes):
        ins, outs = implied
        cost = 0.0
        # Every term below is a price (≥ 0), so a candidate already dearer than the best is
        # dropped before its remaining moves are searched for (the same one wins: one that
        # costs more wins neither outright nor on the tie rule). A first compile searches
        # most of the moves it prices only here.
        bound = math.inf if best is None else best.seconds + 1e-15
        for L, R, aval, moved, param in zip(actual, ins, in_avals, available, parameters):
            if L is not None and R not in moved:
                # from its cheapest copy, as the plan moves it (plan.cheapest): a copy made
                # whole for an earlier reader (or a value any device can make whole,
                # recompute.py) is sliced for free
                move = reshard_seconds(mesh, L, R, aval.shape, aval.dtype, cost_model)
                for M in moved:
                    if move <= 0.0:
                        break
                    move = min(move, reshard_seconds(mesh, M, R, aval.shape, aval.dtype,
                                                     cost_model))
                cost += move
                if not param:
                    cost += made_partial_seconds(mesh, L, R, aval, cost_model)
                if cost > bound:
                    break
        if cost > bound:
            continue
        for R, P, aval in zip(outs, preferred, out_avals):
            if P is UNREAD:  # returned reduced, as it lies: its whole reduction, if any
                if R.partial:
                    cost += reshard_seconds(mesh, R, R.without_partial(), aval.shape,
                                            aval.dtype, cost_model)
            else:
                if P is not None:
                    cost += reshard_seconds(mesh, R, P, aval.shape, aval.dtype, cost_model)
                cost += deferred_reduction_seconds(mesh, R, P, aval, cost_model)
            local = math.prod(R.local_shape(aval.shape, sizes)) * itemsize(aval.dtype)
            cost += cost_model.local(local)
            if cost > bound:
                break
        if cost > bound:
            continue
        # on a tie, the results with fewer dims split over several axes: the batch axis of a
        # weight gradient on a dim of its own, as ZeRO shards a tensor-parallel weight's
        # optimizer state, not nested under the tensor-parallel axis
        nested = sum(len(axes) > 1 for R in outs for axes in R.dims)
        if (best is None or cost < best.seconds - 1e-15
                or (cost <= best.seconds + 1e-15 and nested < best_nested)):
            best, best_nested = Choice(s, ins, outs, cost, len(cands)), nested
    assert best is not None  # the replicated strategy is always valid
    return replace(best, description=best.strategy.describe(opsh))


def _choose_pairs(sig: Signature, mesh: ProcessMesh, actual, preferred, cost_model: CostModel,
                  single_use, available, parameters, unreducing: bool,
                  scattering: bool) -> Choice:
    """`_choose` of an `independent` op: each operand / result pair by itself, joined."""
    picked = [_choose(signature(sub, [ia], [oa]), mesh, (a,), (p,), cost_model, (u,), (m,),
                      (q,), unreducing, scattering)
              for sub, ia, oa, a, p, u, m, q in zip(sig.opsh.pairs(), sig.in_avals, sig.out_avals,
                                                    actual, preferred, single_use, available,
                                                    parameters)]
    # (the joined strategy's factor numbers are each pair's own: read only for being empty)
    joined = Strategy(tuple(a for c in picked for a in c.strategy.assign),
                      tuple(t for c in picked for t in c.strategy.partial))
    return Choice(joined, [c.operands[0] for c in picked], [c.results[0] for c in picked],
                  sum(c.seconds for c in picked), sum(c.considered for c in picked),
                  "; ".join(f"{i}: {c.description}" for i, c in enumerate(picked)))


__all__ = ["Strategy", "Choice", "UNREAD", "Signature", "signature", "choose", "chooser", "candidates", "layouts", "reshard_seconds", "NONE"]
