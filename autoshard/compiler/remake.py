"""Remake: an operand made in the layout its reader wants, from the small values it grew from.

The plan decides equations in program order, each by the layouts its operands already have,
and prices a layout an operand does not have as the move of the operand itself. Some operands
are made by local steps from much smaller values: a mixture-of-experts layer's dispatch and
combine tensors, (tokens, experts, capacity), are one-hot comparisons and broadcasts of the
(tokens, 2) routing choices. Split by tokens as the activations are, the dispatch einsum
"tec,td->ecd" could only contract the token dim (a pending (experts, capacity, features) sum,
reduce-scattered onto the experts), since moving the dispatch tensor itself onto the experts is
an all-to-all of the largest array of the layer. Yet gathering the routing choices (a few KiB)
makes that very tensor split by experts with no more communication, and the einsum then runs on
each device's experts — as XLA plans it.

This pass looks back from each equation of a finished plan that pays for something (a move,
a pending sum): for each layout one of its candidate strategies asks of an operand made by a
local step, it prices making the operand there by the steps that made it — each a step whose
rule does not communicate, run in the layout the rule implies from its result's (no
contraction, no collective of its own) — down to values that are cheaper to move than to
remake (`_Remaker.cheapest`), plus the local work the steps do beyond what they do now. Those
moves are priced by their bytes: they are small, and remakes share them (the dispatch and the
combine tensors grow from the same routing), so only an operand whose own move is
bandwidth-bound, not latency-bound, is tried. Where the equation's choice with the operand
remade, plus that price, is cheaper than its choice now, the remade values are pinned in
their layouts for propagation (`pins`), and the program is planned again (plan.py,
`make_plan`): each step then chooses by cost as usual, given those preferences, and the plan
that moves fewer bytes at a lower price under the full cost model is kept. Values are the
plan's as ever: only preferences change.
"""
from __future__ import annotations

import math

from ..reshard.planner import plan_on_mesh
from ..layout import Layout
from .dtypes import cost_dtype, itemsize
from .recompute import _cheap
from .strategy import (candidates, chooser, layouts, _merge, _seed_from,
                       _with_repairs)
from .trace import Program, hint_p

MAX_STEPS = 24  # steps one remake may run in another layout (a value's cone, not a model)
GAIN = 0.5  # a remake must cost at most this share of moving the operand itself


def _result_strategy(sig, j: int, target: Layout, sizes):
    """The operand layouts under which equation's result `j` comes out as `target` with no
    communication (None: the rule implies no such strategy, or another result layout)."""
    opsh = sig.opsh
    s = _merge([_seed_from(opsh.results[j], target, opsh, None, sizes=sizes)])
    implied = layouts(opsh, s, [a.shape for a in sig.in_avals],
                      [a.shape for a in sig.out_avals], sizes)
    if implied is None:
        return None
    ins, outs = implied
    if outs[j] is not target or any(L.partial for L in ins) or any(L.partial for L in outs):
        return None
    return ins


class _Remaker:
    """Prices of remaking values of one plan in other layouts (memoised per value and layout)."""

    def __init__(self, plan, registry, cost_model):
        self.plan, self.program = plan, plan.program
        self.actual, self.sigs = plan.layouts, plan.signatures
        self.mesh, self.cost_model = plan.mesh, cost_model
        self.registry = registry
        self.cheap: dict = {}
        self.in_region = {k for r in self.program.regions for k in range(r.start, r.stop)}
        self.memo: dict = {}

    def local(self, v) -> bool:
        """`v` is made by a top-level step that runs in any layout without communicating."""
        p = v.producer
        if p < 0 or v.is_const or p in self.in_region:
            return False
        e, ep = self.program.eqns[p], self.plan.eqns[p]
        sig = self.sigs[p] if p < len(self.sigs) else None
        return not (sig is None or e.primitive is hint_p or ep.fallback or ep.sub_plans
                    or ep.index != p or ep.sends or not _cheap(e, self.registry, self.cheap))

    def price(self, found: tuple[dict, dict]) -> float:
        """Seconds of a remake (`remake`'s answer): its moves, and the local work its steps
        do beyond what they do now (a step remade less split computes more of its result
        on each device — as the chooser prices a strategy's results)."""
        moves, made = found
        sizes, local = self.mesh.axis_sizes, self.cost_model.local
        more = sum(local((math.prod(L.local_shape(w.shape, sizes))
                          - math.prod(self.actual[w].local_shape(w.shape, sizes)))
                         * itemsize(w.dtype)) for w, L in made.items())
        return sum(moves.values()) + max(more, 0.0)

    def move(self, v, dst: Layout) -> float:
        """Seconds of moving `v` to `dst`, each collective's latency left out: the moves
        that remake an operand are small, and several remakes often share them (the dispatch
        and the combine tensors both grow from the one routing choice), so priced with their
        latency each, equation by equation, they would look as dear as the large move they
        replace. Whether the plan made with operands remade is cheaper is decided by the
        whole plan's price under the full cost model (plan.py)."""
        src = self.actual[v]
        if src is dst:
            return 0.0
        latency = self.cost_model.collective
        return sum(s.seconds - (latency(s.step.axes, 0) if s.step.hlo else 0.0)
                   for s in plan_on_mesh(self.mesh, src, dst, tuple(v.shape),
                                         cost_dtype(v.dtype), self.cost_model))

    def remake(self, v, dst: Layout, budget: list) -> tuple[dict, dict] | None:
        """(moves, made) to have `v` laid out as `dst` by remaking it: `moves` maps (value,
        layout) -> seconds of the values moved, `made` value -> the layout it is remade in
        (None: `v` is made by no step that can run in another layout)."""
        if not self.local(v):
            return None
        e = self.program.eqns[v.producer]
        sig = self.sigs[v.producer]
        ins = _result_strategy(sig, e.outputs.index(v), dst, self.mesh.axis_sizes)
        if ins is None or budget[0] <= 0:
            return None
        budget[0] -= 1
        moves: dict = {}
        made = {v: dst}
        for u, L in zip(e.inputs, ins):
            if u.is_const:
                continue  # a constant is sliced where it is made
            got = self.cheapest(u, L, budget)
            if got is None:
                return None
            moves.update(got[0])
            for w, M in got[1].items():
                if made.setdefault(w, M) is not M:
                    return None  # one value wanted in two layouts
        return moves, made

    def cheapest(self, v, dst: Layout, budget: list) -> tuple[dict, dict] | None:
        """The cheaper of moving `v` to `dst` and remaking it there: (moves, made)."""
        key = (v, dst)
        if key in self.memo:
            return self.memo[key]
        if self.actual[v] is dst:
            found: tuple | None = ({}, {})
        else:
            found = ({key: self.move(v, dst)}, {})
            remade = self.remake(v, dst, budget)
            if remade is not None and self.price(remade) < self.price(found):
                found = remade
        self.memo[key] = found
        return found


_ASKED: dict = {}
_MAX_ASKED = 16384


def _asked(sig, mesh, operands: tuple, wanted: tuple, single: tuple) -> tuple:
    """The operand layouts of each candidate strategy the plan weighs for an equation
    (memoised: every layer of a model asks the same)."""
    key = (sig, mesh, operands, wanted, single)
    found = _ASKED.get(key)
    if found is None:
        sizes = mesh.axis_sizes
        none = (frozenset(),) * len(operands)
        cands = candidates(sig.opsh, operands, wanted, single, none, True, sizes, False,
                           [a.dtype for a in sig.in_avals])
        found = tuple(tuple(ins) for _, (ins, _) in _with_repairs(
            cands, sig.opsh, [a.shape for a in sig.in_avals], [a.shape for a in sig.out_avals],
            sizes))
        if len(_ASKED) >= _MAX_ASKED:
            _ASKED.clear()
        _ASKED[key] = found
    return found


def pins(plan, registry, cost_model) -> dict:
    """value -> layout: the values to prefer remade (see the module docstring); empty where
    no equation of `plan` gains by an operand remade."""
    program: Program = plan.program
    remaker = _Remaker(plan, registry, cost_model)
    actual, pref = plan.layouts, plan.preferred
    mesh = plan.mesh
    pick = chooser(mesh, cost_model, unreducing=True)
    latency = min(cost_model.axis_latency(a) for a in mesh.dim_names) if mesh.dim_names else 0.0
    floor = latency * min(cost_model.axis_bandwidth(a) for a in mesh.dim_names) \
        if mesh.dim_names else 0.0  # bytes
    found: dict = {}
    sized: dict = {}  # aval -> whether a value of it is large enough (below)
    eqns, signatures = program.eqns, plan.signatures
    uses = None
    for k, ep in enumerate(plan.eqns):
        # (tests in order of cost: this loop visits every equation of every program planned)
        if ep.fallback or ep.sub_plans:
            continue
        e = eqns[k]
        # a move sends at most twice the whole value (an all-reduce of a pending sum): one
        # that cannot outweigh a collective's latency is no operand to remake (`move`)
        large = False
        for v in e.inputs:
            ok = sized.get(v.aval)
            if ok is None:
                ok = sized[v.aval] = 2 * math.prod(v.shape) * itemsize(v.dtype) >= floor
            large = large or ok
        if not large:
            continue
        sig = signatures[e.index] if e.index < len(signatures) else None
        if sig is None or e.primitive is hint_p or e.index in remaker.in_region:
            continue
        # only an equation that pays for something (a move of an operand, a pending sum, a
        # result not laid out as its readers prefer) may gain, and only by a large operand
        # made by a local step
        if not (ep.reshards or any(L.partial or (P is not None and P is not L)
                                   for L, P in zip(ep.results, map(pref.get, e.outputs)))):
            continue
        if not any(sized[v.aval] and remaker.local(v) for v in e.inputs):
            continue
        if uses is None:
            uses = program.use_counts()
        operands = tuple(actual[v] for v in e.inputs)
        wanted = tuple(pref.get(v) for v in e.outputs)
        single = tuple(uses[v] <= 1 for v in e.inputs)
        params = tuple(v.producer < 0 for v in e.inputs)
        none = (frozenset(),) * len(operands)
        base = None
        tried: set = set()
        best = None  # (seconds, made)
        for ins in _asked(sig, mesh, operands, wanted, single):
            for i, (v, R) in enumerate(zip(e.inputs, ins)):
                if (v, R) in tried or v in tried or R is operands[i] or R.partial or v.is_const:
                    continue
                tried.add((v, R) if remaker.local(v) else v)
                if not remaker.local(v):
                    continue
                # the remake's moves are priced by their bytes alone (`move`): only where the
                # operand's own move is one whose bytes, not its latency, dominate
                whole = remaker.move(v, R)
                if whole < latency:
                    continue
                remade = remaker.remake(v, R, [MAX_STEPS])
                if remade is None:
                    continue
                price = remaker.price(remade)
                if price > GAIN * whole:
                    continue
                avail = tuple(frozenset({R}) if k == i else m for k, m in enumerate(none))
                other = pick(sig, operands, wanted, single, avail, params)
                if other.operands[i] is not R:
                    continue
                total = other.seconds + price
                if base is None:
                    base = pick(sig, operands, wanted, single, none, params)
                if total < base.seconds - 1e-15 and (best is None or total < best[0]):
                    best = (total, remade[1])
        if best is not None:
            for w, L in best[1].items():
                found.setdefault(w, L)
    return found


__all__ = ["pins", "MAX_STEPS"]
