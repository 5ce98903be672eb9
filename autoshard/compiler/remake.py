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

This pass looks back from each equation of a finished plan that pays for something (a move
that runs a collective, a pending sum reduced; `_paying`) and reads a split operand made by
local steps from values that may move for much less (`_Remaker.promising`): for each layout
one of its candidate strategies asks of such an operand, it prices making the operand
there by the steps that made it — each a step whose rule does not communicate, run in the
layout the rule implies from its result's (no contraction, no collective of its own) — down
to values that are cheaper to move than to remake (`_Remaker.cheapest`), plus the local work
the steps do beyond what they do now. A remake is one whose collectives move much less than
the operand's own move would (`GAIN`).

What the equation saves (its choice now less its choice with the operand remade, a pending
sum it no longer leaves counted whole) and what the remake costs are both priced by bytes,
latency left out: a remake's moves are small and often shared — the dispatch and the combine
tensors grow from the same routing; in `y = x + v` read by two matmuls, one gathered `v`
serves both, so neither matmul alone might pay for it while together they save two
all-reduces. So the offers of all equations are joined where they share a collective
(`_joined`), and a group whose savings exceed its remake, each move counted once, by at least
`FLOOR`, has its remade values pinned in their layouts for propagation (`pins`). The program
is then planned again (plan.py, `make_plan`): each step chooses by cost as usual, given those
preferences, and the plan that moves fewer bytes at a lower price under the full cost model
(latency included) is kept, if it holds no more at its peak (peak.py): a remade value may be
held whole where it was split, and a context-parallel model's token ids gathered to save a
few small collectives at a small size would hold every activation grown from them whole.
Values are the plan's as ever: only preferences change.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

from ..layout import Layout
from ..reshard.planner import plan_on_mesh
from .dtypes import cost_dtype, itemsize
from .recompute import _cheap
from .strategy import (candidates, chooser, deferred_reduction_seconds, layouts, _merge,
                       _seed_from, _with_repairs)
from .trace import Program, hint_p

MAX_STEPS = 24  # steps one remake may run in another layout (a value's cone, not a model)
GAIN = 0.5  # a remake's collectives must cost at most this share of moving the operand itself
# what the equations a remake serves must save beyond its price, in bytes, for the program to
# be planned again: this share of one collective's latency (2.5 KB at the default model).
# Less is lost in the cost model's error, and not worth planning the program twice for
FLOOR = 0.01


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
        self.locals: dict = {}
        self.hopeful: dict = {}
        self.kinds: dict = {}

    def local(self, v) -> bool:
        """`v` is made by a top-level step that runs in any layout without communicating."""
        locals_ = self.locals
        if v in locals_:
            return locals_[v]
        p = v.producer
        if p < 0 or v.is_const or p in self.in_region:
            found = False
        else:
            e, ep = self.program.eqns[p], self.plan.eqns[p]
            sig = self.sigs[p] if p < len(self.sigs) else None
            found = not (sig is None or e.primitive is hint_p or ep.fallback or ep.sub_plans
                         or ep.index != p or ep.sends
                         or not _cheap(e, self.registry, self.cheap))
        locals_[v] = found
        return found

    def promising(self, v) -> bool:
        """Whether `v` is split, made by a local step, from values that may move for much less
        than `v` (`GAIN`): what a remake needs, checked before one is priced. A value made
        from a split value of its own size (an activation, its norm, a reshape of it) is not.
        Each operand of a remade step is moved or remade in turn: a replicated value or a
        constant is sliced into any layout, a small one moved (its bytes counted against
        `v`'s), a large one remade if a local step made it (at most `MAX_STEPS` of them).
        Layouts are not looked at (a split value is taken to move), and each step's
        operands are looked at before any is remade, so that a remake that must move a
        large value is found out at the first step that reads one."""
        hopeful = self.hopeful
        if v in hopeful:
            return hopeful[v]
        size, made = self.kinds[v] if v in self.kinds else self._kind(v)
        found = hopeful[v] = bool(size and made) and self._from_small(v)
        return found

    def _from_small(self, v) -> bool:
        eqns, kind, kinds = self.program.eqns, self._kind, self.kinds
        most = GAIN * kinds[v][0]
        seen = {v}
        level = [v]
        steps = MAX_STEPS
        while level:
            remade = []
            for w in level:
                for u in eqns[w.producer].inputs:
                    size, made = kinds[u] if u in kinds else kind(u)
                    if size == 0 or u in seen:
                        continue  # sliced, or met before
                    seen.add(u)
                    if size <= most:
                        most -= size  # moved
                    elif made:
                        remade.append(u)
                        steps -= 1
                    else:
                        return False  # a large value moved
            if steps < 0:
                return False
            level = remade
        return True

    def _kind(self, u) -> tuple[int, bool]:
        """(bytes, whether a local step made it) of `u`, bytes 0 for a constant or a
        replicated value (sliced into any layout); memoised."""
        L = self.actual[u]
        if u.is_const or not (L.partial or any(L.dims)):
            found = (0, False)
        else:
            found = (_nbytes(u), self.local(u))
        self.kinds[u] = found
        return found

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
        """Seconds of moving `v` to `dst`, each collective's latency left out: a remake's
        moves are small and often shared by several remakes (the dispatch and the combine
        tensors both grow from the one routing choice), so priced with their latency each,
        equation by equation, they would look as dear as the large moves they replace. What
        an equation saves is priced by bytes alike (`pins`); latency counts where the plan
        made with the remade values is judged (plan.py)."""
        src = self.actual[v]
        if src is dst:
            return 0.0
        latency = self.cost_model.collective
        return sum(s.seconds - (latency(s.step.axes, 0) if s.step.hlo else 0.0)
                   for s in plan_on_mesh(self.mesh, src, dst, tuple(v.shape),
                                         cost_dtype(v.dtype), self.cost_model))

    def communicates(self, key) -> bool:
        """Whether the move `key` ((value, layout)) runs a collective (not only a slice)."""
        v, dst = key
        return any(s.step.hlo for s in plan_on_mesh(self.mesh, self.actual[v], dst,
                                                   tuple(v.shape), cost_dtype(v.dtype),
                                                   self.cost_model))

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


class _Offer(NamedTuple):
    """One equation's operand remade: what the equation saves (`gain`, seconds, the remake's
    price aside), and the remake (`moves`: (value, layout) -> seconds; `made`: value ->
    layout)."""
    gain: float
    moves: dict
    made: dict


def _pending(choice, wanted: tuple, sig, mesh, cost_model) -> float:
    """What the chooser priced the pending sums of `choice`'s results at."""
    return sum(deferred_reduction_seconds(mesh, L, P, aval, cost_model)
               for L, P, aval in zip(choice.results, wanted, sig.out_avals) if L.partial)


def _offer(e, sig, remaker: _Remaker, pick, bytes_only, floor: float,
           uses) -> _Offer | None:
    """The best remake of an operand of equation `e` into a layout one of its candidate
    strategies asks for (None: none saves `floor` seconds or more)."""
    actual, pref, mesh = remaker.actual, remaker.plan.preferred, remaker.mesh
    operands = tuple(actual[v] for v in e.inputs)
    wanted = tuple(pref.get(v) for v in e.outputs)
    single = tuple(uses(v) <= 1 for v in e.inputs)
    params = tuple(v.producer < 0 for v in e.inputs)
    none = (frozenset(),) * len(operands)
    base = None
    tried: set = set()
    best = None  # (net seconds, offer)
    for ins in _asked(sig, mesh, operands, wanted, single):
        for i, (v, R) in enumerate(zip(e.inputs, ins)):
            if (v, R) in tried or v in tried or R is operands[i] or R.partial or v.is_const:
                continue
            tried.add((v, R) if remaker.promising(v) else v)
            if not remaker.promising(v):
                continue
            # (the chooser's answers are memoised, the remake is not: asked first)
            avail = tuple(frozenset({R}) if k == i else m for k, m in enumerate(none))
            other = pick(sig, operands, wanted, single, avail, params)
            if other.operands[i] is not R:
                continue
            if base is None:
                base = pick(sig, operands, wanted, single, none, params)
            # the chooser prices a pending sum at half its reduction (it might be
            # reduce-scattered later); a remake that avoids one saves it all, as the plan
            # all-reduces it where a reader wants it whole
            gain = (base.seconds + _pending(base, wanted, sig, mesh, bytes_only)
                    - other.seconds - _pending(other, wanted, sig, mesh, bytes_only))
            # (an offer saving less than an eighth of what a group must save is noise: a
            # remake whose whole gain is a few hundred bytes is not worth looking for)
            if gain < floor / 8:
                continue
            remade = remaker.remake(v, R, [MAX_STEPS])
            # a remake is one whose collectives move much less than the operand's own move
            # would (slices of replicated values are local work, priced with the group)
            if remade is None or sum(t for key, t in remade[0].items()
                                     if remaker.communicates(key)) > GAIN * remaker.move(v, R):
                continue
            net = gain - remaker.price(remade)
            if best is None or net > best[0]:
                best = (net, _Offer(gain, *remade))
    return None if best is None else best[1]


def _joined(offers: list, remaker: _Remaker) -> list:
    """The offers in groups that share a collective (the dispatch and the combine tensors
    of a mixture of experts both grow from the gathered routing choices; in `x + v` read by
    two matmuls, the one gathered `v` serves both): a move is paid once per group. (A slice
    of a replicated value, no collective, joins nothing: it costs nothing to repeat.)"""
    groups: list = []  # [(set of move keys, [offers])]
    for o in offers:
        keys = {k for k in o.moves if remaker.communicates(k)}
        joined = [g for g in groups if g[0] & keys]
        for g in joined:
            groups.remove(g)
            keys |= g[0]
        groups.append((keys, [o] + [x for g in joined for x in g[1]]))
    return [members for _, members in groups]


def _united(group: list) -> tuple[dict, dict] | None:
    """The one remake (moves, made) of a group of offers (None: they want one value in two
    layouts)."""
    moves: dict = {}
    made: dict = {}
    for o in group:
        moves.update(o.moves)
        for w, L in o.made.items():
            if made.setdefault(w, L) is not L:
                return None
    return moves, made


def _accepted(offers: list, remaker: _Remaker, floor: float) -> dict:
    """value -> layout: the remade values of each group of offers (`_joined`) whose remake,
    each move paid once, costs less than what the equations it serves save together, by at
    least `floor` seconds."""
    found: dict = {}
    for group in _joined(offers, remaker):
        remade = _united(group)
        if remade is not None and remaker.price(remade) + floor < sum(o.gain for o in group):
            for w, L in remade[1].items():
                found.setdefault(w, L)
    return found


_NBYTES: dict = {}  # (shape, dtype) -> bytes


def _nbytes(v) -> int:
    a = v.aval
    key = (a.shape, a.dtype)
    found = _NBYTES.get(key)
    if found is None:
        if len(_NBYTES) >= _MAX_ASKED:
            _NBYTES.clear()
        found = _NBYTES[key] = math.prod(a.shape) * itemsize(a.dtype)
    return found


def _paying(plan) -> list:
    """The top-level equations that pay for something, in order: each that runs a collective
    to move an operand, the equation that made a value moved so (in a layout its readers do
    not take), and the one that made a pending sum reduced so (followed back through the
    equations it passed through as one: those owe it, as the reader reducing it does, whatever
    layout their other operands come in). A slice moves nothing."""
    eqns, actual, plans = plan.program.eqns, plan.layouts, plan.eqns
    found: set = set()
    todo: list = []
    for k, ep in enumerate(plans):
        if ep.reshards:
            inputs = eqns[k].inputs
            for i, rp in ep.reshards:
                if _communicates(rp):
                    todo.append(inputs[i])
                    if not rp.src.partial:
                        found.add(k)
    outputs = plan.program.outputs
    todo += [outputs[i] for i, rp in plan.output_reshards if _communicates(rp)]
    n = len(plans)
    while todo:
        v = todo.pop()
        p = v.producer
        if p < 0 or p in found or p >= n:
            continue
        if actual[v].partial:
            passed = [u for u in eqns[p].inputs if actual[u].partial]
            if passed:
                todo += passed
                continue
        found.add(p)
    return sorted(found)


def _communicates(rp) -> bool:
    for s in rp.steps:
        if s.step.hlo:
            return True
    return False


def pins(plan, registry, cost_model) -> dict:
    """value -> layout: the values to prefer remade (see the module docstring); empty where
    no equation of `plan` gains by an operand remade."""
    program: Program = plan.program
    remaker = _Remaker(plan, registry, cost_model)
    mesh = plan.mesh
    latency = min(cost_model.axis_latency(a) for a in mesh.dim_names) if mesh.dim_names else 0.0
    floor = FLOOR * latency
    pick = bytes_only = None  # made at the first equation that may gain (below)
    offers: list = []
    eqns, signatures = program.eqns, plan.signatures
    n = len(signatures)
    uses = None
    # only an equation that pays for something (a move of an operand, a pending sum, a result
    # not laid out as its readers take it) may gain, and only by a split operand made by
    # local steps from values that may move for much less (`_Remaker.promising`)
    for k in _paying(plan):
        ep = plan.eqns[k]
        if ep.fallback or ep.sub_plans:
            continue
        e = eqns[k]
        sig = signatures[e.index] if e.index < n else None
        if sig is None or e.primitive is hint_p or e.index in remaker.in_region:
            continue
        hopeful = remaker.hopeful
        for v in e.inputs:
            if hopeful[v] if v in hopeful else remaker.promising(v):
                break
        else:
            continue
        if uses is None:
            readers, outputs = program.readers(), set(program.outputs)

            def uses(v) -> int:
                return len(readers.get(v, ())) + (v in outputs)
            # what an equation saves is priced as its remake is, by bytes
            # (`_Remaker.move`): the plan made with values remade is kept only if it moves
            # fewer bytes (plan.py), and an equation whose gain is only a collective's
            # latency (a tiny move it no longer makes) seldom leads to one
            bytes_only = replace(cost_model, default_latency=0.0, latency=())
            pick = chooser(mesh, bytes_only, unreducing=True)
        offer = _offer(e, sig, remaker, pick, bytes_only, floor, uses)
        if offer is not None:
            offers.append(offer)
    return _accepted(offers, remaker, floor) if offers else {}


__all__ = ["pins", "MAX_STEPS"]
