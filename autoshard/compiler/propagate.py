"""Propagate: where every value of the program would like to live, both ways, to a fixpoint.

Annotated values (placed inputs, shard_tensor / reshard hints) are fixed. Sweeping forward,
an equation with some known operands proposes layouts for its unknown results (and unknown
operands); sweeping backward, known results propose layouts for unknown operands — so a hint
deep in the program reaches the unplaced inputs that feed it, as in GSPMD and Shardy. A
proposal never takes sharding away from a value, but may add some on mesh axes the value
leaves unused (a refinement), so information arriving later still lands.
Proposals that shard something go first; "replicated" proposals (from replicated keys,
constants) only fill what is still unknown after those reach their fixpoint — else a random
mask would be decided replicated before its sharded consumer is seen. Otherwise the first
proposal wins, in program order, deterministically; what stays unknown is replicated. The plan (plan.py) then decides each equation by cost, using these
preferences as the look-ahead.
"""
from __future__ import annotations

from collections import deque

from ..cost_model import CostModel
from ..errors import PlacementError
from ..layout import Layout
from ..mesh import ProcessMesh
from .strategy import choose
from .trace import Eqn, Program, hint_p


_UNSET = object()


def rule_sharding(eqn: Eqn, registry):
    """The rule's description of `eqn` (computed once per equation and registry)."""
    cached = eqn.sharding_cache.get(id(registry), _UNSET)
    if cached is not _UNSET:
        return cached
    rule = registry.lookup(eqn.primitive)
    result = None
    if rule is not None:
        try:
            result = rule.sharding([v.aval for v in eqn.inputs], [v.aval for v in eqn.outputs],
                                   **eqn.params)
        except (TypeError, ValueError, KeyError, IndexError, AssertionError):
            result = None  # an instance the rule does not describe runs replicated
    eqn.sharding_cache[id(registry)] = result
    return result


def refines(old: Layout, new: Layout) -> bool:
    """`new` keeps every sharding and partial axis of `old` and adds more (a strict refinement)."""
    if new == old or len(new.dims) != len(old.dims):
        return False
    if not set(old.partial) <= set(new.partial):
        return False
    return all(n[:len(o)] == o for o, n in zip(old.dims, new.dims))


def with_pending_partial(old: Layout | None, new: Layout) -> Layout:
    """A consumer's wish `new` for a value its producer proposes as Partial (`old`).

    The consumer needs the value reduced, but the producer may still shard it as wished and
    stay Partial on its other axes: a gradient accumulated Partial over dp can be built
    vocab-sharded over mp, so the later reduction moves (and the scatter holds) a shard, not the
    whole table.
    """
    if old is None or not old.partial or new.partial:
        return new
    try:
        both = Layout(new.dims, old.partial)
    except PlacementError:  # the wish shards an axis the value is Partial over
        return new
    return both if refines(old, both) else new


def propagate(program: Program, mesh: ProcessMesh, fixed: dict, registry,
              cost_model: CostModel, max_sweeps: int = 4) -> dict:
    """Preferred Layout of every value (fixed ones included); consts are replicated."""
    pref: dict = dict(fixed)
    for c in program.consts:
        pref[c] = Layout.replicated(len(c.shape))
    shardings = {e.index: rule_sharding(e, registry) for e in program.eqns
                 if e.primitive is not hint_p}

    uses = program.use_counts()
    parameters = {*program.inputs, *program.consts}
    pinned = set(fixed) | set(program.consts)

    def offer(v, L) -> bool:
        """Record a proposal: first one wins, but a free value may be refined later."""
        if v not in pref or (v not in pinned and refines(pref[v], L)):
            pref[v] = L
            return True
        return False

    def visit(e: Eqn, allow_trivial: bool) -> list:
        known_in = [pref.get(v) for v in e.inputs]
        known_out = [pref.get(v) for v in e.outputs]
        if not any(L is not None for L in known_in + known_out):
            return []
        changed: list = []
        if e.primitive is hint_p:
            target = e.params["layout"]
            for v in e.outputs:
                if offer(v, target):
                    changed.append(v)
            for v in e.inputs:
                if not v.is_const and offer(v, target.without_partial()):
                    changed.append(v)
            return changed
        opsh = shardings.get(e.index)
        if opsh is None:
            return []
        choice = choose(opsh, mesh, [v.aval for v in e.inputs], [v.aval for v in e.outputs],
                        known_in, known_out, cost_model, [uses.get(v, 0) <= 1 for v in e.inputs],
                        parameters=[v in parameters for v in e.inputs])
        if not allow_trivial and not (choice.strategy.assign or choice.strategy.partial):
            return []  # "replicated" carries no information yet: let other proposals arrive
        for v, L in zip(e.outputs, choice.results):
            if offer(v, L):
                changed.append(v)
        for v, L in zip(e.inputs, choice.operands):
            if not v.is_const and offer(v, with_pending_partial(pref.get(v), L.without_partial())):
                changed.append(v)
        return changed

    neighbours: dict = {}
    for e in program.eqns:
        for v in e.inputs + e.outputs:
            neighbours.setdefault(v, []).append(e)

    def settle(allow_trivial: bool, seeds) -> set:
        """Visit `seeds`, then only equations next to a value that just changed.

        A visit reads only the proposals of its own operands and results, so an equation none
        of whose values changed since its last visit would propose nothing new: later sweeps
        start from the neighbours of what the previous sweep changed, not from every equation.
        """
        queue = deque(seeds)
        queued = {e.index for e in queue}
        changed: set = set()
        while queue:
            e = queue.popleft()
            queued.discard(e.index)
            for v in visit(e, allow_trivial):
                changed.add(v)
                for n in neighbours.get(v, ()):
                    if n.index not in queued:
                        queued.add(n.index)
                        queue.append(n)
        return changed

    def around(values: set) -> list:
        seen: dict = {}
        for v in values:
            for n in neighbours.get(v, ()):
                seen[n.index] = n
        return [seen[k] for k in sorted(seen)]

    # Informative proposals first; then let "replicated" fill the gaps, and go again.
    informative = settle(False, program.eqns)
    filled = settle(True, program.eqns)
    for _ in range(max_sweeps - 1):
        if not filled:
            break
        informative = settle(False, around(filled))
        filled = settle(True, around(informative))  # `filled` neighbours were queued already
    return pref


__all__ = ["propagate", "rule_sharding"]
