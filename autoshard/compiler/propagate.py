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
from typing import NamedTuple

import jax

from ..cost_model import CostModel
from ..errors import PlacementError, PlacementTypeError
from ..hashing import Hashed
from ..layout import Layout
from ..mesh import ProcessMesh
from .factors import OpSharding
from .repeats import same_readers
from .strategy import Signature, chooser, signature
from .trace import Eqn, Program, hint_p


_UNSET = object()
_MAX_MEMO = 65536  # distinct equation shapes remembered per registry before starting over

try:  # jax's configuration as its own caches of traced work key on it
    from jax._src.config import trace_context as jax_config_key
except ImportError:  # another jax: the one setting a rule reads (rules/random.py)
    def jax_config_key():
        return jax.config.jax_threefry_partitionable


_TYPE = "type"  # sharding_cache's entry for `type_key` (the others are keyed by registry id)


def type_key(eqn: Eqn) -> Hashed | None:
    """The equation by value — primitive, operand and result types, params — hashed once
    (None: params that cannot be compared). Kept in the equation's `sharding_cache`, which
    the passes that rewrite an equation empty: the rule's memo keys on it, and partition's
    replay key reads it again instead of hashing every type a second time."""
    cache = eqn.sharding_cache
    key = cache.get(_TYPE, _UNSET)
    if key is _UNSET:
        key = cache[_TYPE] = None if eqn.params_key is None else Hashed(
            (eqn.primitive, tuple([v.aval for v in eqn.inputs]),
             tuple([v.aval for v in eqn.outputs]), eqn.params_key))
    return key


def rule_signature(eqn: Eqn, registry, config: object = _UNSET) -> Signature | None:
    """The rule's description of `eqn` with its avals (None: no rule, it runs replicated).

    Computed once per equation and registry; and since a rule is a pure function of avals,
    params and jax's configuration (the random rules split draws only with
    jax_threefry_partitionable on), equal equations (every layer of a model, the next program
    under the same configuration) share the answer through the registry's memo (which
    registering a rule clears). `config`: `jax_config_key()`, when the caller has it already
    (one read per program, not per equation).
    """
    cache = eqn.sharding_cache
    cached = cache.get(id(registry), _UNSET)
    if cached is not _UNSET:
        return cached
    key = type_key(eqn)
    if key is not None:
        key = (key, jax_config_key() if config is _UNSET else config)
    result = registry.memo.get(key, _UNSET) if key is not None else _UNSET
    if result is _UNSET:
        result = None
        rule = registry.lookup(eqn.primitive)
        if rule is not None:
            in_avals = [v.aval for v in eqn.inputs]
            out_avals = [v.aval for v in eqn.outputs]
            opsh = _call_rule(rule, eqn, in_avals, out_avals, registry)
            result = None if opsh is None else signature(opsh, in_avals, out_avals)
        if key is not None:
            if len(registry.memo) >= _MAX_MEMO:
                registry.memo.clear()
            registry.memo[key] = result
    cache[id(registry)] = result
    return result


def _call_rule(rule, eqn: Eqn, in_avals: list, out_avals: list, registry) -> OpSharding | None:
    """The rule's OpSharding of `eqn`, or None: an instance the rule does not describe (it
    returned None, or raised one of the errors a rule raises for shapes or params it does not
    handle: recorded in `registry.declined` for the fallback warning to say). A rule that
    answers something else, or fails otherwise, is a broken rule: an error naming it."""
    try:
        opsh = rule.sharding(in_avals, out_avals, **eqn.params)
    except (TypeError, ValueError, KeyError, IndexError, AssertionError) as exc:
        registry.declined[eqn.primitive] = f"raised {type(exc).__name__}: {exc}"[:200]
        return None
    except Exception as exc:
        raise PlacementTypeError(
            f"the SPMD rule registered for '{eqn.primitive.name}' (at {eqn.source or '?'}) "
            f"raised {type(exc).__name__}: {exc}: fix the rule, or have it return None (or "
            f"raise ValueError) for the shapes and params it does not describe, which then run "
            f"replicated") from exc
    if opsh is not None and not isinstance(opsh, OpSharding):
        raise PlacementTypeError(
            f"the SPMD rule registered for '{eqn.primitive.name}' (at {eqn.source or '?'}) "
            f"returned {opsh!r:.80} of type {type(opsh).__name__}: a rule returns an "
            f"OpSharding (autoshard.compiler.factors), or None for an instance it does not "
            f"describe")
    if opsh is None:
        registry.declined[eqn.primitive] = "returned None"
        return opsh
    problem = _misfit(opsh, in_avals, out_avals)
    if problem is not None:
        raise PlacementTypeError(
            f"the SPMD rule registered for '{eqn.primitive.name}' (at {eqn.source or '?'}) "
            f"returned an OpSharding that does not fit the equation: {problem} (operands "
            f"{[tuple(a.shape) for a in in_avals]}, results {[tuple(a.shape) for a in out_avals]})"
            f": describe every operand and result, one factor per dim")
    return opsh


def _misfit(opsh: OpSharding, in_avals: list, out_avals: list) -> str | None:
    """What in `opsh` does not fit the equation's operands and results, or None: their
    counts, one entry per dim, factors that exist. (One factor may span dims of other
    extents — a concatenated dim, a padded one, a pooling window's — so sizes are not
    compared: the validator checks what a rule means.)"""
    for what, dims, avals in (("operands", opsh.operands, in_avals),
                              ("results", opsh.results, out_avals)):
        if len(dims) != len(avals):
            return f"it describes {len(dims)} {what}, the equation has {len(avals)}"
    for what, dims, avals in (("operand", opsh.operands, in_avals),
                              ("result", opsh.results, out_avals)):
        for k, (d, a) in enumerate(zip(dims, avals)):
            if len(d) != len(a.shape):
                return f"{what} {k} has {len(a.shape)} dims, the rule gives {len(d)}"
            for f in d:
                for g in (f if type(f) is tuple else (f,)):
                    if g is not None and not 0 <= g < len(opsh.factors):
                        return f"{what} {k} names factor {g}, there are {len(opsh.factors)}"
    return None


def rule_sharding(eqn: Eqn, registry):
    """The rule's description of `eqn` (None: no rule, it runs replicated)."""
    sig = rule_signature(eqn, registry)
    return None if sig is None else sig.opsh


def refines(old: Layout, new: Layout) -> bool:
    """`new` keeps every sharding and partial axis of `old` and adds more (a strict refinement)."""
    old_dims, new_dims = old.dims, new.dims  # fields compared directly: called per proposal
    if new is old or len(new_dims) != len(old_dims) or (
            new_dims == old_dims and new.partial == old.partial):
        return False
    if not set(old.partial) <= set(new.partial):
        return False
    return all(n[:len(o)] == o for o, n in zip(old_dims, new_dims))


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


class EqnFacts(NamedTuple):
    """Per equation (by index), what every decision about it passes to `choose` besides
    layouts — computed once and shared by propagation and the plan."""

    signatures: list      # Signature, or None (a hint, or no rule)
    single_use: list      # per operand: no other reader
    is_parameter: list    # per operand: a program input or constant


def eqn_facts(program: Program, registry) -> EqnFacts:
    """Made once per program: a loop body's fixpoint plans one program again and again
    (control_flow._sub_plan). `constraints.as_hints`, the only pass that rewrites equations
    after the build, forgets them when it does."""
    config = jax_config_key()
    made = program.__dict__.get("_facts")
    # (a rule registered since: the registry's generation moved)
    key = (registry, getattr(registry, "generation", None), config)
    if made is not None and made[0][0] is registry and made[0][1:] == key[1:]:
        return made[1]
    uses = program.use_counts()
    eqns = program.eqns
    # list comprehensions inside tuple(): a generator per equation costs twice as much here
    facts = EqnFacts(
        [None if e.primitive is hint_p else rule_signature(e, registry, config) for e in eqns],
        [tuple([uses[v] <= 1 for v in e.inputs]) for e in eqns],
        [tuple([v.producer < 0 for v in e.inputs]) for e in eqns])  # an input or a constant
    program.__dict__["_facts"] = (key, facts)
    return facts


def propagate(program: Program, mesh: ProcessMesh, fixed: dict, registry,
              cost_model: CostModel, max_sweeps: int = 4, facts: EqnFacts | None = None,
              runs: dict | None = None) -> dict:
    """Preferred Layout of every value (fixed ones included); consts are replicated.

    `runs`: block start -> (run start, period) of the program's repeated blocks (repeats.py);
    the first sweep copies a block's proposals from an earlier block of its run that started
    from the same state (`first_sweep`).
    """
    pref: dict = dict(fixed)
    for c in program.consts:
        pref[c] = Layout.replicated(len(c.shape))
    pinned = set(fixed) | set(program.consts)
    sigs, single_use, is_parameter = facts or eqn_facts(program, registry)
    pick = chooser(mesh, cost_model)

    def offer(v, L) -> bool:
        """Record a proposal: first one wins, but a free value may be refined later."""
        if v not in pref or (v not in pinned and refines(pref[v], L)):
            pref[v] = L
            return True
        return False

    def visit(e: Eqn, allow_trivial: bool) -> list:
        known_in = tuple(map(pref.get, e.inputs))
        known_out = tuple(map(pref.get, e.outputs))
        if not any(known_in) and not any(known_out):  # (a Layout is never falsy)
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
        sig = sigs[e.index]
        if sig is None:
            return []
        n = len(known_in)
        nothing_moved = none_moved.get(n)
        if nothing_moved is None:
            nothing_moved = none_moved[n] = (frozenset(),) * n
        if tracking[0] is not None and any([L is not None and L.partial for L in known_in]):
            tracking[0].add(e.index)  # its choice reads which operands have other readers
        choice = pick(sig, known_in, known_out, single_use[e.index], nothing_moved,
                      is_parameter[e.index])
        if not allow_trivial and not (choice.strategy.assign or choice.strategy.partial):
            return []  # "replicated" carries no information yet: let other proposals arrive
        # A proposal identical to the value's preference changes nothing (layouts are
        # interned): most proposals of a settled program, so they skip `offer`.
        for v, L in zip(e.outputs, choice.results):
            if pref.get(v) is not L and offer(v, L):
                changed.append(v)
        for v, L in zip(e.inputs, choice.operands):
            if v.is_const:
                continue
            old = pref.get(v)
            L = with_pending_partial(old, L.without_partial())
            if old is not L and offer(v, L):
                changed.append(v)
        return changed

    none_moved: dict = {}  # operand count -> "no operand was moved yet" (propagation moves none)
    tracking: list = [None]  # while first_sweep visits a block: the equations that read
    # `single_use` (only where a Partial is read, as the plan's `consulted`)
    neighbours: dict = {}
    for e in program.eqns:
        for v in e.inputs:
            neighbours.setdefault(v, []).append(e)
        for v in e.outputs:
            neighbours.setdefault(v, []).append(e)

    def settle(allow_trivial: bool, seeds, settled: frozenset = frozenset()) -> set:
        """Visit `seeds`, then only equations next to a value that just changed.

        A visit reads only the proposals of its own operands and results, so an equation none
        of whose values changed since its last visit would propose nothing new: later sweeps
        start from the neighbours of what the previous sweep changed, not from every equation.
        `settled`: seeds known to propose nothing new unless a value of theirs changes first;
        they keep their place in the queue (the order decides which proposal wins) but are
        only visited once touched.
        """
        queue = deque(seeds)
        queued = {e.index for e in queue}
        touched: set = set()
        changed: set = set()
        while queue:
            e = queue.popleft()
            queued.discard(e.index)
            if e.index in settled and e.index not in touched:
                continue
            for v in visit(e, allow_trivial):
                changed.add(v)
                for n in neighbours.get(v, ()):
                    if n is e:
                        # Re-deciding it from its own proposals finds the strategy that made
                        # them (they cost nothing under it): not worth a second visit each.
                        continue
                    touched.add(n.index)
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

    def first_sweep() -> None:
        """`settle(False, program.eqns)`, with repeated blocks copied.

        The first sweep visits the equations in program order and queues, behind them, those
        next to a changed value that it has passed already. So its visits of one block, one
        after the other, depend on nothing but the preferences of the block's values when it
        starts, which of them are pinned, the block's wiring and its equations' facts: a later
        block of a run that starts from what an earlier one started from (by position) makes
        the same proposals, in the same order. Those are applied, and the equations they touch
        queued exactly as the visits would have; the block's equations are not visited.
        """
        eqns = program.eqns
        tail: deque = deque()
        queued: set = set()  # the equations in `tail`

        def spread(v, e, k: int) -> None:  # as settle queues the neighbours while at eqns[k]
            for nb in neighbours.get(v, ()):
                j = nb.index
                if nb is e or j > k or j in queued:  # j > k: still ahead in the first pass
                    continue
                queued.add(j)
                tail.append(nb)

        # run start -> {starting state: [(block start, offsets whose visits read single_use,
        # [(offset, [(slot, layout)])])]}
        seen: dict = {}
        k, n = 0, len(eqns)
        while k < n:
            block = runs.get(k) if runs else None
            if block is None:
                e = eqns[k]
                for v in visit(e, False):
                    spread(v, e, k)
                k += 1
                continue
            run, period = block
            stop = k + period
            wiring, values = program.block_values(k, stop)
            state = (wiring, tuple(map(pref.get, values)),
                     tuple([v in pinned for v in values]), tuple(is_parameter[k:stop]))
            # an earlier block from this state whose visits read `single_use` where this
            # block's is the same (a visit reads it only for a Partial operand)
            events = next((ev for first, read, ev in seen.setdefault(run, {}).get(state, ())
                           if same_readers(single_use, first, k, read)), None)
            if events is not None:
                for offset, changes in events:
                    e = eqns[k + offset]
                    for slot, L in changes:
                        v = values[slot]
                        pref[v] = L
                        spread(v, e, k + offset)
            else:
                events = []
                slot = {v: i for i, v in enumerate(values)}
                tracking[0] = read = set()
                for offset in range(period):
                    e = eqns[k + offset]
                    changed = visit(e, False)
                    if changed:
                        events.append((offset, [(slot[v], pref[v]) for v in changed]))
                        for v in changed:
                            spread(v, e, k + offset)
                tracking[0] = None
                seen[run].setdefault(state, []).append(
                    (k, sorted(j - k for j in read), events))
            k = stop
        settle(False, tail)  # the rest of the first sweep: what it queued behind the pass

    # Informative proposals first; then let "replicated" fill the gaps, and go again.
    first_sweep()
    # An equation whose every value is already placed was last visited with these very
    # layouts (the sweep ran to its fixpoint): its choice is the same, and allowing a trivial
    # one only adds "replicated" proposals, which never refine a placed value.
    placed = pref.__contains__
    complete = frozenset([e.index for e in program.eqns
                          if all(map(placed, e.inputs)) and all(map(placed, e.outputs))])
    filled = settle(True, program.eqns, complete)
    for _ in range(max_sweeps - 1):
        if not filled:
            break
        informative = settle(False, around(filled))
        filled = settle(True, around(informative))  # `filled` neighbours were queued already
    return pref


__all__ = ["propagate", "eqn_facts", "EqnFacts", "rule_sharding", "rule_signature", "jax_config_key",
           "type_key"]
