"""Plan: the layout of every value, the strategy of every equation, and every collective.

Computed before anything is compiled, from the propagated preferences: in program order each
equation takes the cheapest strategy given its operands' actual layouts (cost model), the
operands that do not match are resharded (planner), and the results get the strategy's layouts
— Partial included, kept pending until a consumer cannot take it. Outputs are reduced unless
`out_placements` says otherwise.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any

from jax import lax

from ..cost_model import CostModel
from ..layout import Layout
from ..mesh import ProcessMesh
from ..reshard.api import plan_layouts
from ..reshard.planner import ReshardPlan
from .commute import hoist_reductions
from .early_moves import move_before_widening
from .control_flow import (HIGHER_ORDER, copy_runs, last_copy_straight, plan_higher_order,
                           platform_branch, scan_counts, shared_operands)
from .dtypes import cost_dtype
from .factors import InLoop, Serves
from .gc_pause import gc_paused
from .propagate import eqn_facts, propagate
from . import constraints, recompute
from .peak import peak_bytes
from .remake import pins as remake_pins
from .repeats import Repeats, boundary, same_readers
from .split_reduce import split_output_reductions
from .strategy import UNREAD, chooser
from .summed_up import scatter_candidates, small_tail
from .trace import Program, Value, Where, hint_p
from .user_collectives import SHARD_MAP, body_collectives, plan_shard_map


_NOT_MOVED: frozenset = frozenset()  # an operand no earlier consumer moved
_UNSET = object()

KEEP = "keep"  # an output target: leave the value as computed, Partial included


class FallbackWarning(UserWarning):
    """A primitive without an SPMD rule ran replicated (correct, but its inputs were gathered)."""


@dataclass(frozen=True)
class PlannedCollective:
    kind: str              # HLO op: all-gather, all-reduce, reduce-scatter, all-to-all
    step: str              # e.g. "psum(mp)"
    axes: tuple[str, ...]
    bytes_per_device: int
    value: str             # the program value it moves
    consumer: str          # the equation (or "output") that needed it
    where: Where | str | None  # the user's line (a Where is resolved when read: `source`)
    reason: str
    by_rule: bool = False  # run inside a rule's own lowering (a combine, a halo), not a reshard
    # (value, start layout, the move's steps up to this one): equal keys are the same
    # collective of the same operand, which XLA's CSE runs once (`_once`)
    shared: tuple | None = field(default=None, compare=False, repr=False)
    # run inside a loop / cond / checkpoint body: `value` names one of the body's own values
    # (named in the body's program, so the name may also be a top-level value's) — passes that
    # rewrite top-level moves by value name leave these alone
    nested: bool = field(default=False, compare=False, repr=False)
    # how often one call of the program runs it: a scan body's once per iteration of its
    # copy, None inside a while loop (its trip count is a value); the plan lists it once, as
    # the compiled program's text does
    runs: int | None = field(default=1, compare=False, repr=False)

    @property
    def source(self) -> str | None:
        """The user's `file:line`."""
        return self.where.line if isinstance(self.where, Where) else self.where


@dataclass
class EqnPlan:
    index: int
    primitive: str
    where: Where | None  # the user's line, resolved when read (`source`)
    operands: list[Layout]
    required: list[Layout]
    results: list[Layout]
    strategy: str
    considered: int
    seconds: float
    fallback: bool = False
    reshards: list[tuple[int, ReshardPlan]] = field(default_factory=list)
    sub_plans: list = field(default_factory=list)  # bodies of scan / while / cond / checkpoint
    sends: tuple[int, ...] = ()  # operands the rule's lowering sends to other devices (a halo)
    # the operand a move was made early at or before, for this step's readers (early_moves.py)
    early: int | None = None

    @property
    def source(self) -> str | None:
        return None if self.where is None else self.where.line


@dataclass
class Plan:
    mesh: ProcessMesh
    program: Program
    layouts: dict
    inputs: list[Layout]
    outputs: list[Layout]
    eqns: list[EqnPlan]
    output_reshards: list[tuple[int, ReshardPlan]]
    collectives: list[PlannedCollective]
    fallbacks: list[tuple[str, str | None]]
    cost_model: CostModel | None = None  # kept for plans made later, lazily (custom rules)
    # eqn index -> index of the equation whose decisions it took (repeats.py), for equations
    # whose plans are still those copies (the reduction hoist rewrote neither)
    same_as: dict = field(default_factory=dict)
    # planned on the mesh with an axis split in two (refine.py): `mesh` and every layout here
    # are the refined mesh's; `user_*` are the caller's terms
    refinement: Any = None
    # the equations' rule signatures (propagate.eqn_facts), for the passes that plan again
    signatures: list = field(default_factory=list, repr=False)
    preferred: dict = field(default_factory=dict, repr=False)  # propagation's, per value

    @property
    def user_mesh(self) -> ProcessMesh:
        return self.mesh if self.refinement is None else self.refinement.user_mesh

    @property
    def user_inputs(self) -> list[Layout]:
        return self.inputs if self.refinement is None else [
            self.refinement.user(L) for L in self.inputs]

    @property
    def user_outputs(self) -> list[Layout]:
        return self.outputs if self.refinement is None else [
            self.refinement.user(L) for L in self.outputs]

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes_per_device for c in self.collectives)

    def collective_counts(self, per_call: bool = False) -> dict[str, int]:
        """Collectives by kind: as the program lists them (a loop body's once, as the
        compiled HLO text has them), or with `per_call` as often as one call runs them (a
        scan body's once per iteration; a while loop's body, whose trip count is a value,
        counted once: `runs_known` says whether every count is exact)."""
        counts: dict[str, int] = {}
        for c in self.collectives:
            n = (c.runs or 1) if per_call else 1
            counts[c.kind] = counts.get(c.kind, 0) + n
        return counts

    def bytes_per_call(self) -> int:
        """Bytes each device sends in one call (`collective_counts(per_call=True)`)."""
        return sum(c.bytes_per_device * (c.runs or 1) for c in self.collectives)

    @property
    def runs_known(self) -> bool:
        """Whether every collective's runs per call is known (none inside a while loop)."""
        return all(c.runs is not None for c in self.collectives)

    def layout_of(self, value: Value) -> Layout:
        return self.layouts[value]

    def __str__(self) -> str:
        from .explain import explain_text

        return explain_text(self)


def _reason(consumer: str, value: Value, src: Layout, dst: Layout, mesh: ProcessMesh) -> str:
    return (f"{consumer} needs {value!r} as {dst.describe(mesh)}, it is {src.describe(mesh)}")


def _repeat_ids(program: Program, facts) -> list[int]:
    """One number per distinct equation as the plan sees it (its rule signature: primitive,
    params, types; a hint's params), negative where a block is never copied (no rule, a
    higher-order primitive or a user's shard_map: their plans hold more than layouts)."""
    hints: dict = {}
    excluded: dict = {}  # primitive -> whether its plan holds more than layouts
    h = []
    for k, (e, sig) in enumerate(zip(program.eqns, facts.signatures)):
        p = e.primitive
        if sig is not None:
            x = excluded.get(p)
            if x is None:
                x = excluded[p] = p.name in HIGHER_ORDER or p.name == SHARD_MAP
            # equal equations share one Signature (the registry's memo): its id numbers them
            h.append(-1 - k if x else id(sig))
        elif p is hint_p and e.params_key is not None:
            # numbered like the signatures, by the id of a live object: the first equal key
            h.append(id(hints.setdefault(e.params_key, e.params_key)))
        else:
            h.append(-1 - k)
    return h


@gc_paused
def make_plan(program: Program, mesh: ProcessMesh, input_layouts: list[Layout | None],
              output_targets: list, registry, cost_model: CostModel, *,
              top_level: bool = True) -> Plan:
    plan = _make_plan(program, mesh, input_layouts, output_targets, registry, cost_model)
    anticipated, offered = _anticipations(plan), None
    if anticipated:
        # Equations are planned in order, each by its own cost: an earlier matmul cannot see
        # that a later one reading the same value will move it anyway, and may pay for
        # another move instead (sequence parallelism: the forward output projection reads the
        # attention output as it lies, the backward's weight gradient all-to-alls it; planned
        # again, the forward reads that copy too). Planned again with the later copies
        # offered to the earlier readers, the cheaper of the two plans is kept (fewer bytes,
        # no more collectives).
        other = _make_plan(program, mesh, input_layouts, output_targets, registry, cost_model,
                           anticipated)
        if (other.bytes_per_call() < plan.bytes_per_call()
                and len(other.collectives) <= len(plan.collectives)):
            plan, offered = other, anticipated
    pinned = remake_pins(plan, registry, cost_model)
    if pinned:
        # an equation would take an operand in another layout, which the local steps that
        # made it from smaller values could have made with those values moved instead
        # (remake.py): planned again with the remade values preferred so, the plan moving
        # fewer bytes at a lower price is kept
        other = _make_plan(program, mesh, input_layouts, output_targets, registry, cost_model,
                           offered, pins=pinned)
        # (and holds no more at its peak: a remade value may be held whole where it was
        # split — the dispatch of a split vector into a replicated input costs nothing at
        # the peak, a context-parallel sequence gathered to save a few small collectives
        # would hold every activation grown from it whole)
        if (other.bytes_per_call() < plan.bytes_per_call()
                and plan_seconds(other, cost_model) < plan_seconds(plan, cost_model)
                and peak_bytes(other) <= peak_bytes(plan)):
            plan = other
        else:
            pinned = None
    scatter_at = scatter_candidates(plan)
    if scatter_at:
        # a pending sum read only to be summed up (a gradient's norm or finiteness check) was
        # all-reduced: planned again with it reduce-scattered there (summed_up.py), the plan
        # the cost model prices lower is kept
        other = _make_plan(program, mesh, input_layouts, output_targets, registry, cost_model,
                           offered, scatter_at, pins=pinned)
        if (other.bytes_per_call() < plan.bytes_per_call()
                and plan_seconds(other, cost_model) < plan_seconds(plan, cost_model)):
            plan = other
    if plan.fallbacks and top_level:
        names = sorted({n for n, _ in plan.fallbacks})
        declined = {p.name: why for p, why in registry.declined.items()}
        for name in names:
            where = ", ".join(sorted({s or "?" for n, s in plan.fallbacks if n == name}))
            if name in declined:  # the rule is there, it described no such instance
                why = (f"its SPMD rule does not describe it (the rule {declined[name]}); it "
                       f"runs replicated — results stay correct, but its "
                       f"inputs are gathered. Have the rule return an OpSharding for these "
                       f"shapes and params.")
            else:
                why = ("no SPMD rule for it; it runs replicated — results stay correct, but its "
                       "inputs are gathered. Add a rule with dist.register_rule(<primitive>, "
                       "rule).")
            warnings.warn(f"autoshard: primitive '{name}' (at {where}): {why}",
                          FallbackWarning, stacklevel=4)
    return plan


def plan_seconds(plan: Plan, cost_model: CostModel) -> float:
    """The cost model's time for the collectives of one call of the plan: a scan body's as
    often as it iterates (a while loop's once: its trip count is a value), so that a plan
    moving data inside a long loop does not look as cheap as one moving it once outside."""
    return sum(cost_model.collective(c.axes, c.bytes_per_device) * (c.runs or 1)
               for c in plan.collectives if c.axes)


def _anticipations(plan: Plan) -> dict:
    """(value, equation) -> layouts the value is moved to by a later matmul, for an earlier
    matmul reading the same value that did not take that layout (see make_plan)."""
    program = plan.program
    in_region = {k for r in program.regions for k in range(r.start, r.stop)}
    readers: dict = {}
    for e in program.eqns:
        if e.primitive.name == "dot_general" and e.index not in in_region:
            for v in e.inputs:
                readers.setdefault(v, []).append(e.index)
    found: dict = {}
    for e, ep in zip(program.eqns, plan.eqns):
        if e.primitive.name != "dot_general" or e.index in in_region:
            continue
        for i, rp in ep.reshards:
            v = e.inputs[i]
            for r in readers.get(v, ()):
                if r >= e.index:
                    break
                if any(rp.dst is q.dst for j, q in plan.eqns[r].reshards
                       if program.eqns[r].inputs[j] is v):
                    continue
                found[(v, r)] = found.get((v, r), frozenset()) | {rp.dst}
    return found


def _make_plan(program: Program, mesh: ProcessMesh, input_layouts: list[Layout | None],
               output_targets: list, registry, cost_model: CostModel,
               anticipated: dict | None = None, scatter_at: dict | None = None,
               pins: dict | None = None) -> Plan:
    """`anticipated`: see make_plan; `scatter_at`: equations whose pending sums may be
    reduce-scattered (summed_up.py); `pins`: values preferred in a layout (remake.py)."""
    anticipated = anticipated or {}
    scatter_at = scatter_at or {}
    constraints.as_hints(program, mesh)  # jax's with_sharding_constraint: a hint like ours
    fixed = {v: L for v, L in zip(program.inputs, input_layouts) if L is not None}
    # a hint's result is its operand's copy in the hint's layout (partition hands that very
    # copy back): a move of either from that layout runs on one buffer, which XLA's CSE runs
    # once, so their collectives' `shared` keys name the operand (`record`, `_once`). Not
    # transitively: a hint of a hint is a copy of the first hint's result, a buffer of its
    # own even where it has the first operand's layout
    copy_of: dict = {}
    for e in program.eqns:
        if e.primitive is hint_p:
            fixed[e.outputs[0]] = e.params["layout"]
            copy_of[e.outputs[0]] = e.inputs[0]
    for v, L in zip(program.outputs, output_targets):
        if isinstance(L, Layout) and v not in fixed and not v.is_const:
            fixed[v] = L
    for e in program.eqns:
        # a user's shard_map fixes its layouts; its operands prefer them
        if e.primitive.name == SHARD_MAP:
            required, results = plan_shard_map(e, mesh)
            fixed.update(zip(e.outputs, results))
            for v, L in zip(e.inputs, required):
                if v not in fixed and not v.is_const:
                    fixed[v] = L
    for v, L in (pins or {}).items():
        fixed.setdefault(v, L)
    facts = eqn_facts(program, registry)
    repeats = Repeats(_repeat_ids(program, facts))
    pref = propagate(program, mesh, fixed, registry, cost_model, facts=facts,
                     runs=repeats.run_of)
    # the plan also weighs moving a summed-over dim's axes onto another dim (an all-to-all
    # instead of a Partial as large as the result); propagation does not: its preferences
    # would follow those moves, and Megatron's layouts are what they should follow
    pick = chooser(mesh, cost_model, unreducing=True)
    pick_scattering = chooser(mesh, cost_model, unreducing=True, scattering=True)
    # equation -> the preferences its results are chosen with instead of propagation's, which
    # were made for the first plan (summed_up.py): a summed-up step's result split as the
    # update reading its operand wants it, or none (it and the small tail of its sums)
    overrides: dict = {}
    if scatter_at:
        for k in small_tail(program, scatter_at):
            overrides[k] = (None,) * len(program.eqns[k].outputs)
        for k, L in scatter_at.items():
            overrides[k] = (L,) * len(program.eqns[k].outputs)

    # A free output (returned reduced, no placement asked) that no equation reads has no
    # consumer to want a layout for it: a replicated preference of it is only the fill of
    # propagation's proposals (its producer's operands were preferred replicated, e.g. a
    # slice's pending sum reduced by a nonlinear step), not a need. Chosen with it, the
    # producer gathered an operand the plan had kept split, where propagation had not (the
    # gradient of a column slice of a column-split input: the plan all-to-alls the slice by
    # rows, the pad making the gradient then gathered its whole operand to meet the stale
    # [R]: 2x jax.jit's bytes, the gradient replicated). Chosen with UNREAD instead, any
    # layout of it is free and a Partial pays the whole reduction it gets on its way out.
    # A sharded preference (a weight gradient's) is kept: it comes from the value's own
    # operands, and UNREAD would price its pending sums in full, not half as now (the
    # plans tuned on that price: test_cost_choices, the GPT workloads).
    readers = program.readers()
    unread = {v for v, L in zip(program.outputs, output_targets)
              if L is None and v not in fixed and v.producer >= 0 and v not in readers
              and (pref.get(v) is None or pref[v].is_replicated)}

    actual: dict = {}
    inputs = []
    for v, L in zip(program.inputs, input_layouts):
        if L is None:  # unplaced input: placed where propagation wants it, never partial
            L = (pref.get(v) or Layout.replicated(len(v.shape))).without_partial()
        actual[v] = L
        inputs.append(L)
    for c in program.consts:
        actual[c] = Layout.replicated(len(c.shape))

    collectives: list[PlannedCollective] = []
    done: dict = {}  # (value, layout[, region]) → the plan that moved it there
    moved_to: dict = {}  # value → layouts it has been moved to (the copies partitioning reuses)
    # A custom-rule region is lowered in a scope of its own (jax may trace its body apart), so
    # copies made outside it are not there inside, nor the reverse: moves made in a region are
    # planned and reused per region. The same move of the same value in two scopes lowers to
    # the same collectives of the same operand, which XLA's CSE runs once: listed once (`_once`).
    region_of = {k: r.start for r in program.regions for k in range(r.start, r.stop)}

    def same_buffer(v: Value):
        return buffer_of(v, program, actual, eqn_plans)
    moved_in: dict = {}  # (value, region start) → layouts moved to inside that region
    made_at: dict = {}  # (value, layout) → the first equation a copy was made for

    def ready(value: Value, rp: ReshardPlan, at: int | None) -> bool:
        """Move `rp` of `value` can run for equation `at` (None: an output, after them all):
        it starts from the value itself or from a copy made by then. A late pass planning an
        earlier equation's move (early_moves.py) takes a move a later equation planned only
        so: one that starts from a copy made later is not there to run yet."""
        return (at is None or rp.src is actual[value]
                or made_at.get((value, rp.src), len(program.eqns)) <= at)

    def scope_of(at: int | None) -> int:
        """The start of the region equation `at` runs in (-1: the top level, or an output)."""
        return region_of.get(at, -1) if at is not None else -1

    def moves(value: Value, at: int | None, default=frozenset()):
        scope = scope_of(at)
        return moved_to.get(value, default) if scope < 0 else moved_in.get((value, scope), default)
    fallbacks: list[tuple[str, str | None]] = []

    def cheapest(value: Value, dst: Layout, at: int | None,
                 from_own: bool = False) -> tuple[ReshardPlan, float]:
        """The move of `value` to `dst` from its cheapest copy, and its seconds: the value itself
        or one it was already moved to (the all-to-all an earlier consumer paid for is not paid
        again on the way to a gather)."""
        rp, best = None, 0.0
        # a copy made for a later equation does not exist yet at `at` (partitioning moves
        # from the value's own layout there): a late pass planning an earlier move (an early
        # move, early_moves.py) may start only from copies made up to `at`
        copies = [] if from_own else sorted(
            (L for L in moves(value, at)
             if at is None or made_at.get((value, L), -1) <= at), key=repr)
        for src in [actual[value], *copies]:
            cand = plan_layouts(tuple(value.shape), cost_dtype(value.dtype), mesh, src, mesh,
                                dst, cost_model)
            seconds = sum(s.seconds for s in cand.steps)
            if rp is None or seconds < best - 1e-15:
                rp, best = cand, seconds
        return rp, best

    def reshard(value: Value, dst: Layout, consumer: str, source,
                planned: ReshardPlan | None = None, *, at: int | None = None,
                from_own: bool = False) -> ReshardPlan:
        """`planned`: the plan this very move got in a block planned alike (copy_block);
        `at`: the consuming equation's index (None: an output); `from_own`: start from the
        value's own layout, not from a copy an earlier consumer made (the hoist replaces the
        move that made it)."""
        scope = scope_of(at)
        key = (value, dst) if scope < 0 else (value, dst, scope)
        # a value resharded twice the same way (in one scope) is moved once, where first
        reused = key in done and not from_own and ready(value, done[key], at)
        rp = (done[key] if reused else planned if planned is not None
              else cheapest(value, dst, at, from_own)[0])
        when = len(program.eqns) if at is None else at
        made_at[(value, dst)] = min(made_at.get((value, dst), when), when)
        if reused:
            return rp
        done[key] = rp
        if scope < 0:
            moved_to[value] = moved_to.get(value, frozenset()) | {dst}
        else:
            moved_in[(value, scope)] = moved_in.get((value, scope), frozenset()) | {dst}
        record(rp.steps, value, consumer, source, "", (rp.src, dst))
        return rp

    def record(steps, value: Value, consumer: str, source, note: str = "",
               move: tuple[Layout, Layout] | None = None) -> None:
        """List the collectives of planned steps; the reason names the whole `move` (default:
        each step's own layouts)."""
        if 0 in value.aval.shape:
            return  # an empty array: no data to move, and XLA drops its collectives
        prefix: tuple = (same_buffer(copy_of.get(value, value)),
                         steps[0].before if steps else None)
        for s in steps:
            prefix += (s.step,)
            if s.step.hlo:
                src, dst = move or (s.before, s.after)
                for r in range(s.rounds):  # a re-tiling's permutes, a piece each (Retile)
                    collectives.append(PlannedCollective(
                        s.step.hlo, str(s.step) + (f" round {r + 1}" if s.rounds > 1 else ""),
                        tuple(s.step.axes), s.bytes_per_device // s.rounds, repr(value),
                        consumer, source, _reason(consumer, value, src, dst, mesh) + note,
                        shared=prefix + ((r,) if s.rounds > 1 else ())))
                if s.remainder_bytes:
                    collectives.append(replace(
                        collectives[-1], step=f"{s.step} (the remainders, int32)",
                        bytes_per_device=s.remainder_bytes, shared=prefix + ("remainders",)))

    comm_of: dict = {}  # primitive -> its rule's `comm` (None: it adds no collectives)
    read: list = []  # the values some equation or the outputs read, made when first asked

    def read_values() -> set:
        if not read:
            read.append({v for q in program.eqns for v in q.inputs} | set(program.outputs))
        return read[0]
    rule_sends: set = set()  # what rules' lowerings send that XLA computes once (CSE)

    def rule_collectives(e, required, results) -> tuple[int, ...]:
        """List the collectives the rule's lowering runs; the operands it sends."""
        comm = comm_of.get(e.primitive, _UNSET)
        if comm is _UNSET:
            rule = registry.lookup(e.primitive)
            comm = comm_of[e.primitive] = None if rule is None else rule.comm
        if comm is None:
            return ()
        in_avals = [v.aval for v in e.inputs]
        out_avals = [v.aval for v in e.outputs]
        sent: set = set()
        for kind, step, axes, nbytes, *sends in comm(required, results, in_avals, out_avals,
                                                     mesh.axis_sizes, **e.params):
            looped = bool(sends) and isinstance(sends[-1], InLoop)
            if looped:
                sends = sends[:-1]
            if sends and isinstance(sends[-1], Serves):
                if e.outputs[sends[-1].output] not in read_values():
                    continue  # it makes a result nothing reads: XLA drops it
                sends = sends[:-1]
            if sends:  # it sends only what `step` says of operand sends[0]: once per value
                sent.add(sends[0])
                key = (e.inputs[sends[0]], required[sends[0]], kind, step, tuple(axes), nbytes)
                if key in rule_sends:
                    continue
                rule_sends.add(key)
            reason = (f"{e.name} reads {e.inputs[sends[0]]!r}'s rows held by the devices beside "
                      f"it along {', '.join(axes)}" if sends else
                      f"{e.name} combines its shards across {', '.join(axes)}")
            collectives.append(PlannedCollective(
                kind, step, tuple(axes), int(nbytes), repr(e.outputs[0]),
                f"{e.name} (eqn {e.index})", e.where, reason, by_rule=True,
                runs=None if looped else 1))
        return tuple(sorted(sent))

    def plan_eqn(e) -> EqnPlan:
        operands = [actual[v] for v in e.inputs]
        fallback, sends = False, ()
        sub_plans: list = []
        name = e.primitive.name
        if e.primitive is hint_p:
            target = e.params["layout"]
            required, results, strategy, considered, seconds = [target], [target], "annotation", 1, 0.0
        elif name == SHARD_MAP:
            required, results = plan_shard_map(e, mesh)
            strategy, considered, seconds = "the user's shard_map (its collectives as written)", 1, 0.0
            for kind, step, axes, nbytes in body_collectives(e, mesh):
                collectives.append(PlannedCollective(
                    kind, step, axes, nbytes, repr(e.outputs[0]) if e.outputs else "-",
                    f"{e.name} (eqn {e.index})", e.where, "written by the user in a shard_map"))
        elif name in HIGHER_ORDER:
            required, results, sub_plans, strategy = plan_higher_order(
                e, operands, mesh, registry, cost_model,
                [moves(v, e.index, _NOT_MOVED) for v in e.inputs] if name == "cond" else None)
            considered, seconds = 1, 0.0
            # as often in the plan as in the compiled program: once per copy of the body
            # (a loop's body once, an unrolled scan's each copy), not once per iteration
            each = copy_runs(e, required, mesh.axis_sizes)  # and how often a call runs each
            copies = len(each)
            # a scan whose last copy runs after its loop: its moves for a final carry nobody
            # reads are dead code there, which XLA drops (the reverse scan of jnp.polyval's
            # gradient)
            dead: frozenset = frozenset()
            if copies > 1 and last_copy_straight(e, required):
                body_out = sub_plans[0].program.outputs
                carries = scan_counts(e.params, len(e.inputs))[1]
                dead = frozenset(f"output {k}" for k in range(carries)
                                 if e.outputs[k] not in read_values()
                                 and body_out.count(body_out[k]) == 1)
            # a platform_dependent cond runs the branch of the platform compiled for
            taken = platform_branch(e, program, mesh)
            for b, sub in enumerate(sub_plans):
                # a checkpoint's body moving an operand as it is moves the operand's buffer:
                # keyed by the operand, the same move made outside is listed once (XLA's CSE)
                outer = shared_operands(e, required, sub)
                for c in sub.collectives if taken is None or b == taken else ():
                    shared = c.shared
                    if shared is not None and outer and shared[0] in outer:
                        shared = (outer[shared[0]], *shared[1:])
                    for i in range(copies - (c.consumer in dead)):
                        runs = (None if c.runs is None or name == "while"
                                else c.runs * each[i])
                        unrolled = f", copy {i + 1} of {copies} unrolled" if copies > 1 else ""
                        collectives.append(replace(  # (copies are other collectives: `_once`)
                            c, reason=f"{c.reason} (inside {strategy}{unrolled})",
                            shared=shared if i == 0 or shared is None else (shared, i),
                            nested=True, runs=runs))
                fallbacks.extend(sub.fallbacks)
        else:
            sig = facts.signatures[e.index]
            if sig is None:
                fallback = True
                fallbacks.append((e.name, e.source))
                required = [Layout.replicated(len(v.shape)) for v in e.inputs]
                results = [Layout.replicated(len(v.shape)) for v in e.outputs]
                strategy, considered, seconds = "replicated (no rule)", 1, 0.0
            else:
                available = [moves(v, e.index, _NOT_MOVED) for v in e.inputs]
                if anticipated:
                    available = [a | anticipated.get((v, e.index), _NOT_MOVED)
                                 for a, v in zip(available, e.inputs)]
                cones = whole_for_free(e, operands, available)
                if any([L.partial for L in operands]) or any(
                        [L.partial for a in available for L in a]):
                    consulted.add(e.index)  # (see below)
                wanted = overrides.get(e.index)
                if wanted is None:
                    wanted = (tuple([UNREAD if v in unread else pref.get(v) for v in e.outputs])
                              if unread else tuple(map(pref.get, e.outputs)))
                choice = (pick_scattering if e.index in scatter_at else pick)(
                    sig, tuple(operands), wanted, facts.single_use[e.index], tuple(available),
                    facts.is_parameter[e.index])
                required, results = choice.operands, choice.results
                for i, found in cones.items():
                    # made whole where it is made, then sliced as the reader wants it (priced
                    # so by the chooser: the whole copy was offered)
                    if not required[i].partial and actual[e.inputs[i]] is not required[i]:
                        recompute.replan(found, f"{e.name} (eqn {e.index})", program, actual,
                                         eqn_plans)
                        operands[i] = actual[e.inputs[i]]
                strategy = choice.description
                considered, seconds = choice.considered, choice.seconds
                sends = rule_collectives(e, required, results)
        ep = EqnPlan(e.index, name, e.where, operands, required, results, strategy,
                     considered, seconds, fallback, sub_plans=sub_plans, sends=sends)
        for i, (v, src, dst) in enumerate(zip(e.inputs, operands, required)):
            if src is not dst:  # layouts are interned: equal layouts are one object
                ep.reshards.append((i, reshard(v, dst, f"{e.name} (eqn {e.index})", e.where,
                                               at=e.index)))
        for v, L in zip(e.outputs, results):
            actual[v] = L
        return ep

    failed: set = set()  # values no cone can make whole (recompute.cone)
    # equations whose choice read which operands have other readers (`facts.single_use`):
    # only a Partial operand — as it lies or as a copy already made — may flow through an
    # equation when it has no other reader (strategy.candidates); elsewhere a later block
    # whose readers differ decides the same (the first backward block of a model reads the
    # cotangent the head's gradient also reads)
    consulted: set = set()
    cheap: dict = {}  # primitive -> whether a cone may compute it again
    floor = [0]  # plans below this index are final: a copied block's, or one copies read

    def whole_for_free(e, operands: list[Layout], available: list) -> dict:
        """Operand index -> the cone of equations that would make it whole with no
        collective (recompute.py); its replicated layout is offered to the chooser as free."""
        cones = {}
        for i, (v, L) in enumerate(zip(e.inputs, operands)):
            if L.is_replicated or v.is_const or v.producer < floor[0] or v in failed:
                continue
            found = recompute.cone(v, e.index, floor[0], program, actual, eqn_plans, registry,
                                   failed, cheap)
            if found is not None and all(scope_of(j) == scope_of(e.index) for j in found):
                cones[i] = found
                available[i] = available[i] | {Layout.replicated(len(v.shape))}
        return cones

    def copy_block(first: int, start: int, period: int) -> None:
        """Plan eqns[start:start + period] as the block at `first` was planned: every decision
        read the same inputs (checked by the caller), so it is the same decision."""
        for j in range(period):
            tp, e = eqn_plans[first + j], eqns[start + j]
            ep = EqnPlan(e.index, tp.primitive, e.where, tp.operands, tp.required, tp.results,
                         tp.strategy, tp.considered, tp.seconds)
            for i, rp in tp.reshards:  # the same move, recorded against this block's value
                ep.reshards.append((i, reshard(e.inputs[i], rp.dst, f"{e.name} (eqn {e.index})",
                                               e.where, rp, at=e.index)))
            if e.primitive is not hint_p:
                ep.sends = rule_collectives(e, tp.required, tp.results)
            actual.update(zip(e.outputs, tp.results))
            eqn_plans.append(ep)
        copies.append((first, start, period))

    def planned_like(run: int, start: int, period: int) -> int | None:
        """The start of an already planned block of the run whose decisions read exactly what
        eqns[start:start + period]'s would (None: plan it; it becomes one such block)."""
        stop = start + period
        key = (boundary(program, start, stop, actual, moved_to, pref),
               tuple(facts.is_parameter[start:stop]),
               # which equations choose with other preferences (summed_up.py), by position
               tuple([(k - start, overrides[k], k in scatter_at) for k in range(start, stop)
                      if k in overrides]) if overrides else (),
               # which results are chosen as UNREAD, by position
               tuple([(k - start, j) for k in range(start, stop)
                      for j, v in enumerate(eqns[k].outputs) if v in unread]) if unread else ())
        found = repeats.planned[run].setdefault(key, [])
        for first in found:
            if same_readers(facts.single_use, first, start,
                            [j for j in range(period) if first + j in consulted]):
                return first
        found.append(start)
        return None

    eqns = program.eqns
    copies: list = []  # (first, start, period) of each block planned as a copy
    eqn_plans: list[EqnPlan] = []
    k, n = 0, len(eqns)
    while k < n:
        block = repeats.run_of.get(k)
        if block is not None:
            run, period = block
            first = planned_like(run, k, period)
            if first is not None:
                copy_block(first, k, period)
                k += period
                floor[0] = k
                continue
            floor[0] = k  # later blocks of the run copy this one's plans as they stand
        eqn_plans.append(plan_eqn(eqns[k]))
        k += 1

    outputs, output_reshards = [], []
    for k, (v, target) in enumerate(zip(program.outputs, output_targets)):
        if target is None:
            dst = actual[v].without_partial()
        elif isinstance(target, str) and target == KEEP:
            dst = actual[v]
        else:
            dst = target
        if actual[v] != dst:
            source = program.eqns[v.producer].where if v.producer >= 0 else program.where
            output_reshards.append((k, reshard(v, dst, f"output {k}", source)))
        outputs.append(dst)
    touched = hoist_reductions(program, eqn_plans, actual, output_reshards, collectives, reshard,
                               mesh.axis_sizes)

    def price(value: Value, dst: Layout, at: int) -> float:
        """What moving `value` to `dst` for equation `at` would cost (0: already moved there
        by then)."""
        planned = done.get((value, dst))
        if planned is not None and ready(value, planned, at):
            return 0.0
        return cheapest(value, dst, at)[1]

    touched |= move_before_widening(program, eqn_plans, actual, output_reshards, collectives,
                                    reshard, price, lambda k: k in region_of)
    split_output_reductions(program, output_reshards, collectives, mesh, cost_model, record)
    same_as = {start + j: first + j for first, start, period in copies for j in range(period)
               if start + j not in touched and first + j not in touched}

    return Plan(mesh, program, actual, inputs, outputs, eqn_plans, output_reshards,
                _once(collectives), fallbacks, cost_model, same_as, signatures=facts.signatures,
                preferred=pref)


def buffer_of(v: Value, program: Program, layouts: dict, eqn_plans: list):
    """What `v` is, buffer for buffer, for moves that XLA's CSE runs once: through
    stop_gradient (lowered to nothing) while the layout stays (slogdet's rule reads a
    stop_gradient'ed matrix its primal also moves); and a broadcast as its operand, params and
    layouts (build_program makes a broadcast of a scalar or a constant once per reader: copies
    laid out alike are one computation, and so are their moves). `eqn_plans`: the equations
    planned so far (a broadcast not yet planned reads its operand as it lies)."""
    return buffer_path(v, program, layouts, eqn_plans)[0]


def buffer_path(v: Value, program: Program, layouts: dict, eqn_plans: list) -> tuple[Any, bool]:
    """`buffer_of(v)`, and whether the way there passes a stop_gradient: the same bytes, but a
    copy of that buffer serves `v` only with its derivative stopped (partition)."""
    stopped = False
    while v.producer >= 0:
        p = v.producer
        e = program.eqns[p]
        if e.primitive is lax.stop_gradient_p and layouts.get(e.inputs[0]) is layouts.get(v):
            v, stopped = e.inputs[0], True
            continue
        if (e.primitive is lax.broadcast_in_dim_p and len(e.inputs) == 1
                and e.params_key is not None):
            read = eqn_plans[p].required[0] if p < len(eqn_plans) else layouts.get(e.inputs[0])
            inner, through = buffer_path(e.inputs[0], program, layouts, eqn_plans)
            return ("broadcast", inner, e.params_key, read, layouts.get(v)), stopped or through
        break
    return v, stopped


def _once(collectives: list[PlannedCollective]) -> list[PlannedCollective]:
    """Each collective once: two moves of a value that start alike (a gather on the way to an
    all-to-all, and the same gather for an output) run their common first steps on the same
    operand, which XLA's CSE merges. Done last, after the passes that drop a value's moves."""
    seen: set = set()
    kept = []
    for c in collectives:
        if c.shared is not None:
            if c.shared in seen:
                continue
            seen.add(c.shared)
        kept.append(c)
    return kept



__all__ = ["Plan", "EqnPlan", "PlannedCollective", "FallbackWarning", "make_plan",
           "plan_seconds", "buffer_of", "buffer_path"]
