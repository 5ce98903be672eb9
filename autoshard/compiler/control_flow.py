"""Higher-order primitives: scan, while, cond and checkpoint, planned as sub-programs.

Each body is planned with the engine itself (a sub-Plan on the same mesh):
- scan / while: carry layouts go to a fixpoint (carry-in == carry-out). The body's own carry
  layout is adopted when it differs — so a gradient accumulated across a scan stays Partial in
  the carry and is reduced once, after the loop, not per iteration. The scanned axis of xs and
  ys is not split — except where the iterations are independent (below).
- a scan whose iterations are independent (`lax.map`; every carry handed back as it came, or
  only added to, as the transposed map accumulates the gradients of its constants) over xs
  split on the scanned axis runs as a local scan of every device's own block: the data stays
  split and each device computes only its iterations, where the plain plan gathers the
  batch and every device computes them all. The body is planned on the mesh with the split
  axes cut to size 1 (it never splits or reduces over them: the devices along them hold
  other iterations); constants and initial carries split or pending over them are gathered
  (reduced) once, before the loop; an added-to carry ends Partial(sum) over them, its initial
  value counted on their first device only.
- cond: every branch is planned on the same operand layouts; if their results disagree, all
  branches are re-planned to the first branch's result layouts (the join).
- checkpoint (jax.checkpoint / remat): the body is partitioned and re-wrapped in
  jax.checkpoint with the same policy, so the rematerialisation survives partitioning; an
  already-differentiated one (the backward recomputation) keeps jax's optimization barrier on
  its operands, and the operands it gathers from are kept distinct from the forward's even
  where XLA drops that barrier (CPU), so that e.g. ZeRO-3's params are gathered again in the
  backward instead of staying gathered from the forward.
Collectives inside a body appear once in the plan (and once in the HLO), whatever the trip
count; their reason says which loop they belong to.
"""
from __future__ import annotations

import contextvars
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax._src import xla_bridge

from ..layout import Layout
from ..mesh import ProcessMesh
from ..placement import ReduceType
from .dtypes import local_nbytes
from .strategy import reshard_seconds
from .trace import build_program

HIGHER_ORDER = {"scan", "while", "cond", "checkpoint", "remat", "remat2"}
_MAX_FIXPOINT = 4
_ADDS = ("add", "add_any")


def _closed(jaxpr):
    return jaxpr if hasattr(jaxpr, "consts") else jex_core.ClosedJaxpr(jaxpr, [])


def scan_counts(params: dict, n_operands: int) -> tuple[int, int]:
    """(constants, carries) among a scan's operands: jax 0.10 names the counts, jax 0.11
    keeps the operand groups as a flat tree (`ft_in`: constants, carries, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carries, _ = params["ft_in"].update(list(range(n_operands))).unpack()
    return len(list(consts)), len(list(carries))


def _unsharded_leading(L: Layout) -> Layout:
    return Layout(((),) + L.dims[1:], L.partial)


def _slice_layout(L: Layout) -> Layout:
    return Layout(L.dims[1:], L.partial)


def _stacked(L: Layout) -> Layout:
    return Layout(((),) + L.dims, L.partial)


# The bodies built while one higher-order equation is planned, by (jaxpr, mesh): a loop's
# body is planned again for each carry layout of its fixpoint, a cond's branches again when
# joined, and building the body's program each time was near a quarter of a scanned GPT
# step's plan.
# (By mesh too: a body's sharding constraints become hints on the mesh it is planned on.)
_BUILT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("autoshard_built_bodies",
                                                                     default=None)


def _sub_plan(jaxpr, mesh, inputs, targets, registry, cost_model):
    from .plan import make_plan

    built = _BUILT.get()
    key = (id(jaxpr), mesh)  # (the equation being planned holds the jaxpr: its id is its own)
    program = None if built is None else built.get(key)
    if program is None:
        program = build_program(_closed(jaxpr))
        if built is not None:
            built[key] = program
    return make_plan(program, mesh, list(inputs), list(targets), registry, cost_model,
                     top_level=False)


def _loop_carries(make, carries: list[Layout], n_outputs_after: int, first: int):
    """Plan a loop body until its carry-out layouts equal its carry-in layouts (the carries
    are the body's inputs first, first + 1, ...). A fixpoint whose body reduces an update
    only to add it to a complete carry is planned once more with that carry Partial (see
    `_accumulators`); that plan is kept if it is a fixpoint too and moves fewer bytes per
    iteration."""
    from .plan import KEEP

    n = len(carries)
    for _ in range(_MAX_FIXPOINT):
        sub = make(carries, [KEEP] * (n + n_outputs_after))
        out = list(sub.outputs[:n])
        if out == list(carries):
            break
        carries = out
    else:
        # No fixpoint: force the body to hand back what it was given.
        return carries, make(carries, carries + [KEEP] * n_outputs_after)
    pending = _accumulators(sub, carries, first)
    if pending != carries:
        other = make(pending, [KEEP] * (n + n_outputs_after))
        if list(other.outputs[:n]) == pending and other.total_bytes < sub.total_bytes:
            carries, sub = pending, other
    return _complete_if_reduced(make, carries, sub, n_outputs_after, first)


def _accumulators(sub, carries: list[Layout], first: int) -> list[Layout]:
    """`carries` with each complete carry that the body hands back as `carry + update`, the
    update Partial(sum) and reduced only to be added, made Partial like the update.

    Gradient accumulation over micro-batches (`fori_loop` / `scan` adding each step's
    gradient to zeros) is planned with complete carries first: the zeros are complete, and an
    update made by a loop or branch inside the body has no preference for propagation to
    carry out to the add. Reduced there, the gradient is all-reduced on every iteration;
    carried Partial (the zeros are a Partial value as they are, any other initial value is
    counted on one device only), it is reduced once, after the loop."""
    program, out = sub.program, list(carries)
    for i, L in enumerate(carries):
        v = program.outputs[i]
        if L.partial or v.producer < 0:
            continue
        e, ep = program.eqns[v.producer], sub.eqns[v.producer]
        carry = program.inputs[first + i]
        if e.primitive.name not in _ADDS or len(e.inputs) != 2 or e.inputs.count(carry) != 1:
            continue
        k = 1 - e.inputs.index(carry)
        update = sub.layouts[e.inputs[k]]
        if (k not in dict(ep.reshards) or not update.partial
                or any(t is not ReduceType.SUM for _, t in update.partial)
                or any(a in axes for a, _ in update.partial for axes in L.dims)):
            continue
        out[i] = Layout(L.dims, update.partial)
    return out


def _invariant_moves(sub, consts: list[Layout], first: int, mesh) -> list[Layout]:
    """`consts` (the body's inputs first, first + 1, ...) with each that the body moves to
    one same layout wherever it reads it, no larger per device (an all-to-all, a slice, a
    split of a pending sum), in that layout: moved once before the loop instead of on every
    iteration. Gathers stay in the body: hoisted, every gathered copy would be held for the
    whole loop (ZeRO-3's params across accumulated micro-batches)."""
    program, out = sub.program, list(consts)
    readers, results = program.readers(), set(program.outputs)
    sizes = mesh.axis_sizes
    for i, L in enumerate(consts):
        v = program.inputs[first + i]
        reads = readers.get(v)
        if not reads or v in results:
            continue
        dsts = {dict(sub.eqns[j].reshards).get(k) for j, k in reads}
        if None in dsts:
            continue  # some read takes it as it is
        targets = {rp.dst for rp in dsts}
        if len(targets) != 1:
            continue
        dst = targets.pop()
        if local_nbytes(v.shape, v.dtype, dst, sizes) <= local_nbytes(v.shape, v.dtype, L, sizes):
            out[i] = dst
    return out


def _join(branches, outputs, mesh, cost_model) -> list[Layout]:
    """A cond's result layouts: per result, the branches' layout that is cheapest to move every
    branch's result to (the first branch's on a tie). A branch that hands back zeros (optax's
    apply_if_finite rejecting an update) can make them split for free; the other branch's split
    update should not be gathered to match its replicated zeros."""
    joined = []
    for j, v in enumerate(outputs):
        made = [b.outputs[j] for b in branches]
        joined.append(min(dict.fromkeys(made), key=lambda L: sum(
            reshard_seconds(mesh, m, L, v.shape, v.dtype, cost_model) for m in made)))
    return joined


def _read_as(sub, v) -> set:
    """The layouts body `sub` moves its value `v` to where it reads it (None: read as it is),
    looking through the conds it hands `v` to (optax.MultiSteps' update nests one)."""
    program, dsts = sub.program, set()
    if v in set(program.outputs):
        dsts.add(None)  # handed back as it came: the result keeps its layout
    for j, k in program.readers().get(v, ()):
        moved = dict(sub.eqns[j].reshards).get(k)
        if moved is not None:
            dsts.add(moved.dst)
        elif program.eqns[j].primitive.name == "cond" and k > 0:
            for inner in sub.eqns[j].sub_plans:
                dsts |= _read_as(inner, inner.program.inputs[k - 1])
        else:
            dsts.add(None)
    return dsts


def _copies_reused(branches, ops: list[Layout], available: list, mesh,
                   cost_model) -> list[Layout]:
    """`ops` (a cond's branch operands) with each that the program already holds a copy of
    that the branches should take instead: the one cheapest to move to where they read it, or
    (where a branch reads it as it is) a complete copy of a pending sum, smallest per device
    — to be tried, as the branches may reduce what they compute from it. A gradient all-reduced
    for optax's is_finite check is then not reduced a second time by the update in the taken
    branch (apply_if_finite, MultiSteps' skip_not_finite)."""
    out = list(ops)
    for i, L in enumerate(ops):
        if not available[i]:
            continue
        v = branches[0].program.inputs[i]
        copies = sorted(available[i], key=repr)
        dsts: set = set().union(*(_read_as(sub, sub.program.inputs[i]) for sub in branches))
        if dsts and None not in dsts:
            def seconds(src: Layout) -> float:
                return sum(reshard_seconds(mesh, src, d, v.shape, v.dtype, cost_model)
                           for d in dsts)

            best = min(copies, key=seconds)
            if seconds(best) < seconds(L) - 1e-15:
                out[i] = best
        elif L.partial and (complete := [c for c in copies if not c.partial]):
            out[i] = min(complete, key=lambda c: local_nbytes(v.shape, v.dtype, c, mesh.axis_sizes))
    return out


def _reduced_inside(sub, i: int) -> bool:
    """Whether the body reduces its Partial input i, or a value the Partial passed into
    (`carry + update`), where it reads it."""
    partial = set(sub.inputs[i].partial)
    carrying = {sub.program.inputs[i]}  # values that still carry input i's Partial
    for e, ep in zip(sub.program.eqns, sub.eqns):
        reads = [k for k, v in enumerate(e.inputs) if v in carrying]
        if not reads:
            continue
        moved = dict(ep.reshards)
        if any(k in moved and not partial <= set(moved[k].dst.partial) for k in reads):
            return True
        carrying.update(v for v, L in zip(e.outputs, ep.results) if partial <= set(L.partial))
    return False


def _complete_if_reduced(make, carries: list[Layout], sub, n_outputs_after: int,
                         first: int):
    """A Partial carry that the body reduces where it reads it (a residual stream whose
    Partial update joined the carry) is reduced once per iteration either way, and once more
    after the loop; reduced before it is carried, it needs no reduction after the loop and the
    first iteration reads the complete value it was given. A carry only accumulated into (a
    gradient summed across the loop) is left Partial: reduced once, after the loop."""
    from .plan import KEEP

    fixed = [L.without_partial() if L.partial and _reduced_inside(sub, first + i) else L
             for i, L in enumerate(carries)]
    if fixed == list(carries):
        return carries, sub
    return fixed, make(fixed, fixed + [KEEP] * n_outputs_after)


def _reduced_copy(sub, v) -> Layout | None:
    """A layout without the Partial of body value `v` that the body already moves `v` to
    where it reads it (None: it never reduces it)."""
    partial = {a for a, _ in sub.layouts[v].partial}
    for e, ep in zip(sub.program.eqns, sub.eqns):
        for k, rp in ep.reshards:
            if e.inputs[k] is v and not partial & {a for a, _ in rp.dst.partial}:
                return rp.dst
    return None


def _ys_as_reduced(make, carries: list[Layout], body, nk: int):
    """A scan's stacked output (a residual saved for the backward pass) that is Partial where
    the body makes it but that the body reduces anyway (the residual stream after a
    row-parallel matmul, reduced before the next norm) is handed out reduced: the body pays
    nothing more, and the backward loop, which reads it reduced too, need not reduce it a
    second time per iteration (the unrolled program reuses the forward's reduced copy)."""
    outs = body.program.outputs[nk:]
    targets = [_reduced_copy(body, v) if L.partial and not v.is_const else None
               for v, L in zip(outs, body.outputs[nk:])]
    return _with_ys_targets(make, carries, body, nk, targets)


def _with_ys_targets(make, carries: list[Layout], body, nk: int, targets: list):
    """The body planned again with its stacked outputs at `targets` (None: as they come),
    kept if that leaves the carries' layouts as they are; else `body`."""
    if not any(targets):
        return body
    from .plan import KEEP

    fixed = make(carries, list(carries) + [t or KEEP for t in targets])
    return fixed if list(fixed.outputs[:nk]) == list(carries) else body


def _ys_reduced_inside(make, carries: list[Layout], body, nk: int, mesh, cost_model):
    """A scan's stacked output that is Partial where the body makes it (each layer's weight
    gradient in a backward loop over stacked layers, pending its data-parallel sum) and whose
    slice is large enough that the bandwidth, not the latency, prices its all-reduce, is
    reduced in the body, once per iteration. Left pending, the whole stack is reduced after
    the loop by one collective of the same bytes — but the stack and its reduced copy are then
    both alive: a second copy of every layer's gradient (3.75x jax.jit's temporary memory on
    an 8-layer scan with remat). Per iteration the collectives cost at most twice as long as
    the one after (the latency is paid once per slice, and it is at most the bandwidth's
    share), and XLA reduces them there too. Small slices (an RNN's per-step outputs) stay
    pending: there the latency of one collective per iteration would dominate."""
    sizes = mesh.axis_sizes
    targets = []
    for v, L in zip(body.program.outputs[nk:], body.outputs[nk:]):
        target = None
        if L.partial and not v.is_const:
            axes = [a for a, _ in L.partial]
            local = local_nbytes(v.shape, v.dtype, L, sizes)
            if cost_model.collective(axes, local) >= 2 * cost_model.collective(axes, 0):
                target = L.without_partial()
        targets.append(target)
    return _with_ys_targets(make, carries, body, nk, targets)


_LINEAR = {ReduceType.SUM, ReduceType.AVG}


def independent_carries(jaxpr, nc: int, nk: int) -> list[str] | None:
    """Per carry of a scan body: "pass" (handed back as it came) or "sum" (carry + a value
    computed without it, the carry read by nothing else); None when some iteration reads
    another's result or the body has effects (their order would change)."""
    if jaxpr.effects:
        return None
    carry_in = jaxpr.invars[nc:nc + nk]
    made = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    kinds, adds = [], {}
    for cin, out in zip(carry_in, jaxpr.outvars[:nk]):
        if out is cin:
            kinds.append("pass")
            continue
        eqn = made.get(out) if not isinstance(out, jex_core.Literal) else None
        if eqn is None or eqn.primitive.name not in _ADDS or \
                [v is cin for v in eqn.invars].count(True) != 1:
            return None
        kinds.append("sum")
        adds[cin] = eqn
    totals = {eqn.outvars[0] for eqn in adds.values()}
    running = set(adds) | totals
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, jex_core.Var) and v in running and adds.get(v) is not eqn:
                return None  # a running carry read elsewhere: iterations depend on each other
    outs = [v for v in jaxpr.outvars if isinstance(v, jex_core.Var)]
    if any(v in running for v in jaxpr.outvars[nk:] if isinstance(v, jex_core.Var)) or \
            sum(v in totals for v in outs) != len(totals):
        return None  # a running total among the ys, or handed back as two carries
    return kinds


def _uses(L: Layout, axes) -> bool:
    return bool(L.used_axes & set(axes))


def _plan_uses(plan, axes) -> bool:
    """Whether any layout of a plan (its nested bodies too) splits or reduces over `axes`."""
    layouts = [*plan.inputs, *plan.outputs]
    for ep in plan.eqns:
        layouts += [*ep.required, *ep.results]
        if any(_plan_uses(sub, axes) for sub in ep.sub_plans):
            return True
    return any(_uses(L, axes) for L in layouts)


def _without_axes(mesh: ProcessMesh, axes) -> ProcessMesh:
    """`mesh` with the dims `axes` cut to size 1 (their first slice)."""
    ids = mesh.id_array
    for a in axes:
        ids = np.take(ids, [0], axis=list(mesh.dim_names).index(a))
    return ProcessMesh(ids, list(mesh.dim_names))


def _split_scan(e, operands, mesh, registry, cost_model):
    """The plan of a scan with independent iterations over xs split on the scanned axis, or
    None (see the module docstring)."""
    p = e.params
    nc, nk = scan_counts(p, len(operands))
    consts, init, xs = operands[:nc], operands[nc:nc + nk], operands[nc + nk:]
    axes = next((L.dims[0] for L in xs if L.dims[0]), ())
    n = math.prod(mesh.axis_sizes[a] for a in axes)
    if not axes or p["length"] % n or any(a in axes for L in xs for a, _ in L.partial):
        return None
    kinds = independent_carries(p["jaxpr"].jaxpr, nc, nk)
    if kinds is None:
        return None

    def whole_over_axes(L: Layout) -> Layout:
        # every device runs whole iterations: what they all read is gathered (reduced) over
        # the rows' axes once, before the loop (FSDP weights under a map over the batch)
        return Layout(tuple(tuple(a for a in d if a not in axes) for d in L.dims),
                      tuple((a, t) for a, t in L.partial if a not in axes))

    consts, init = [whole_over_axes(L) for L in consts], [whole_over_axes(L) for L in init]
    xs_req = [Layout((axes,) + whole_over_axes(L).dims[1:], L.partial) for L in xs]
    xs_in = [_slice_layout(L) for L in xs_req]
    local_mesh = _without_axes(mesh, axes)

    def make(carries, targets):
        return _sub_plan(p["jaxpr"], local_mesh, consts + carries + xs_in, targets, registry,
                         cost_model)

    carries, body = _loop_carries(make, list(init), len(e.outputs) - nk, nc)
    moved = _invariant_moves(body, consts, 0, local_mesh)
    if moved != consts:  # (a pending sum of a weight the map reads: reduced once, before it)
        consts = moved  # (read by `make`)
        carries, body = _loop_carries(make, carries, len(e.outputs) - nk, nc)
    if _plan_uses(body, axes):
        return None  # the body asked for the split axes itself (a reshard naming them)
    if any(k == "sum" and {t for _, t in L.partial} - _LINEAR for L, k in zip(carries, kinds)):
        return None  # a carry pending a max/min cannot also be a sum over the rows' axes
    summed = tuple((a, ReduceType.SUM) for a in axes)
    ends = [L if k == "pass" else Layout(L.dims, L.partial + summed) for L, k in zip(carries, kinds)]
    ys = [Layout((axes,) + L.dims, L.partial) for L in body.outputs[nk:]]
    return (consts + carries + xs_req, ends + ys, [body],
            f"scan × {p['length']}, {p['length'] // n} iterations per device along "
            f"{', '.join(axes)} (independent iterations)")


def split_axes(e, ep) -> tuple[str, ...]:
    """The mesh axes a planned scan splits its iterations over (none: every device runs all)."""
    return _split_axes(e, ep.required)


def _split_axes(e, required: list[Layout]) -> tuple[str, ...]:
    nc, nk = scan_counts(e.params, len(required))
    xs = required[nc + nk:]
    return xs[0].dims[0] if xs else ()


def _unrolled(length: int, unroll: int | bool) -> tuple[int, int, int]:
    """(copies in the loop's body, loop trips, iterations after the loop) of jax's scan
    lowering: a scan unrolled whole, or in one trip, is all copies after no loop."""
    unroll = length if unroll is True else 1 if unroll is False else int(unroll)
    if unroll == 1:
        return 1, length, 0
    trips, remainder = divmod(length, unroll) if unroll else (0, length)
    if trips == 1 and remainder == 0:
        return unroll, 0, length
    return unroll, trips, remainder


def copy_runs(e, required: list[Layout], sizes: dict) -> list[int]:
    """One entry per copy of `e`'s body in the compiled program (each of its sub-plans'
    collectives appears once per copy: an unrolled scan repeats them, a split scan runs its
    share of the iterations), saying how often one run of `e` runs that copy: a scan's loop
    copies once per trip, the copies after the loop once; [1] for the other higher-order
    primitives. jax lowers `scan(unroll=k)` with k copies in the loop and the iterations left
    over after it (every copy, when unrolled whole)."""
    if e.name != "scan":
        return [1]
    n = math.prod(sizes[a] for a in _split_axes(e, required))
    iterations = e.params["length"] // n
    per_trip, trips, remainder = _unrolled(iterations, e.params["unroll"])
    if per_trip == 1:
        return [iterations] if iterations else []
    return [trips] * (per_trip if trips else 0) + [1] * remainder


def last_copy_straight(e, required: list[Layout]) -> bool:
    """Whether a scan's last iteration runs as straight-line code after its loop (jax's
    lowering: the iterations an `unroll` leaves over, or all of them when it covers the
    length), where XLA drops what only makes a final carry nobody reads. Not for a split scan,
    whose devices each run a share of the iterations."""
    if e.name != "scan" or _split_axes(e, required):
        return False
    per_trip, _, remainder = _unrolled(e.params["length"], e.params["unroll"])
    return per_trip != 1 and remainder > 0


def shared_operands(e, required: list[Layout], sub) -> dict:
    """Body input -> the operand it is, for the inputs of a checkpoint whose moves inside its
    body run on the operand's own buffer, which XLA's CSE merges with the same move outside:
    all of them when nothing is barred (a checkpoint jax has not differentiated), else those
    out of the recomputation's barrier — held as Partial, or not prevent_cse
    (`_rematerialised`)."""
    if e.name not in ("checkpoint", "remat", "remat2"):
        return {}
    inputs = sub.program.inputs
    if not e.params.get("differentiated", False):
        return dict(zip(inputs, e.inputs))
    read = _cse_flags(e.params.get("prevent_cse", True), len(e.inputs))
    return {b: v for b, v, f, L in zip(inputs, e.inputs, read, required) if not f or L.partial}


def platform_branch(e, program, mesh) -> int | None:
    """The branch a `lax.platform_dependent` cond takes on the mesh's devices (its index is a
    `platform_index`, which jax lowers to the constant of the platform compiled for, and XLA
    then keeps that branch alone), else None."""
    if e.name != "cond" or e.inputs[0].producer < 0:
        return None
    made = program.eqns[e.inputs[0].producer]
    if made.primitive.name != "platform_index":
        return None
    platform = xla_bridge.canonicalize_platform(mesh.devices().flat[0].platform)
    options = made.params["platforms"]
    found = next((i for i, names in enumerate(options) if names and platform in names), None)
    if found is None:
        found = next((i for i, names in enumerate(options) if names is None), None)
    return found if found is not None and found < len(e.params["branches"]) else None


def plan_higher_order(e, operands: list[Layout], mesh, registry, cost_model,
                      available: list | None = None):
    """(required operand layouts, result layouts, sub-plans, description) for `e`.

    `available`: per operand, the layouts the program already moved it to before `e` (copies
    it can take for free)."""
    token = _BUILT.set({})
    try:
        return _plan_higher_order(e, operands, mesh, registry, cost_model, available)
    finally:
        _BUILT.reset(token)


def _plan_higher_order(e, operands: list[Layout], mesh, registry, cost_model,
                       available: list | None):
    from .plan import KEEP

    p = e.params
    if e.name == "scan":
        split = _split_scan(e, operands, mesh, registry, cost_model)
        if split is not None:
            return split
        nc, nk = scan_counts(p, len(operands))
        consts, init, xs = operands[:nc], operands[nc:nc + nk], operands[nc + nk:]
        xs_req = [_unsharded_leading(L) for L in xs]
        xs_in = [_slice_layout(L) for L in xs_req]
        n_ys = len(e.outputs) - nk

        def make(carries, targets):
            return _sub_plan(p["jaxpr"], mesh, consts + carries + xs_in, targets, registry, cost_model)

        carries, body = _loop_carries(make, list(init), n_ys, nc)
        moved = _invariant_moves(body, consts, 0, mesh)
        if moved != consts:
            consts = moved  # (read by `make`; the fixpoint goes on from the carries found)
            carries, body = _loop_carries(make, carries, n_ys, nc)
        body = _ys_as_reduced(make, carries, body, nk)
        body = _ys_reduced_inside(make, carries, body, nk, mesh, cost_model)
        ys = [_stacked(L) for L in body.outputs[nk:]]
        return consts + carries + xs_req, carries + ys, [body], f"scan × {p['length']}"
    if e.name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = operands[:cn], operands[cn:cn + bn], operands[cn + bn:]

        def make(carries, targets):
            return _sub_plan(p["body_jaxpr"], mesh, bconsts + carries, targets, registry, cost_model)

        carries, body = _loop_carries(make, list(init), 0, bn)
        moved = _invariant_moves(body, bconsts, 0, mesh)
        if moved != bconsts:
            bconsts = moved  # (read by `make`)
            carries, body = _loop_carries(make, carries, 0, bn)
        cond = _sub_plan(p["cond_jaxpr"], mesh, cconsts + carries, [Layout.replicated(0)],
                         registry, cost_model)
        return cconsts + bconsts + carries, carries, [cond, body], "while loop"
    if e.name == "cond":
        index, ops = Layout.replicated(0), operands[1:]
        branches = [_sub_plan(b, mesh, ops, [KEEP] * len(e.outputs), registry, cost_model)
                    for b in p["branches"]]
        reused = _copies_reused(branches, ops, (available or [frozenset()] * len(operands))[1:],
                                mesh, cost_model)
        if reused != ops:  # kept if the branches then move fewer bytes
            tried = [_sub_plan(b, mesh, reused, [KEEP] * len(e.outputs), registry, cost_model)
                     for b in p["branches"]]
            if sum(b.total_bytes for b in tried) < sum(b.total_bytes for b in branches):
                ops, branches = reused, tried
        joined = _join(branches, e.outputs, mesh, cost_model)
        if any(list(b.outputs) != joined for b in branches):
            branches = [_sub_plan(b, mesh, ops, joined, registry, cost_model) for b in p["branches"]]
        return [index] + ops, joined, branches, f"cond of {len(branches)} branches"
    # checkpoint / remat
    body = _sub_plan(p["jaxpr"], mesh, operands, [KEEP] * len(e.outputs), registry, cost_model)
    return list(operands), list(body.outputs), [body], f"checkpoint (policy {getattr(p.get('policy'), '__name__', None)})"


def _lower_split_scan(e, ep, ins, body, axes, sizes, ambient):
    """A scan of independent iterations on each device's own block of xs (`_split_scan`)."""
    from .partition import LowerContext

    p = e.params
    nc, nk = scan_counts(p, len(ins))
    consts, init, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
    # the added-to carries, as planned: the only ones that end pending over the split axes
    # (a carry handed back is whole over them, `_split_scan`)
    summed = [i for i in range(nk) if any(a in axes for a, _ in ep.results[i].partial)]
    layouts = [ep.results[i] for i in summed]
    # an added-to carry starts from its initial value on the first device along the split
    # axes and from zero on the others: the Partial(sum) it ends as counts it once
    first = lax.eq(LowerContext(sizes, [], [], []).block_index(axes), 0)
    starts = [lax.select(lax.broadcast(first, jnp.shape(init[i])), init[i],
                         jnp.zeros_like(init[i])) for i in summed]

    def step(carry, x):
        given = list(init)
        for i, c in zip(summed, carry):
            given[i] = c
        outs = body(*consts, *given, *x)
        # a ys slice that does not read xs still stands for other iterations on each device
        return (_vary_to([outs[i] for i in summed], layouts, ambient),
                _vary_to(outs[nk:], ep.results[nk:], ambient))

    n = math.prod(sizes[a] for a in axes)
    carry, ys = lax.scan(step, _vary_to(starts, layouts, ambient), list(xs),
                         length=p["length"] // n,
                         reverse=p["reverse"], unroll=p["unroll"])
    ends = list(init)
    for i, c in zip(summed, carry):
        ends[i] = c
    return ends + list(ys)


def lower_higher_order(e, ep, ins, registry, sizes, ambient: frozenset = frozenset()):
    """Bind `e` on local values, with its bodies partitioned by their sub-plans.

    Loop carries and branch results are cast to vary over exactly their planned layout's mesh
    axes (the bookkeeping check_vma verifies), so carry-in and carry-out types agree — and
    over the `ambient` axes, inside a split scan (partition._bind).
    """
    from .partition import local_function

    p = e.params
    split = split_axes(e, ep) if e.name == "scan" else ()
    inner = ambient | frozenset(split)
    fns = [local_function(sub, registry, physical=False, ambient=inner) for sub in ep.sub_plans]
    if split:
        return _lower_split_scan(e, ep, ins, fns[0], split, sizes, ambient)
    if e.name == "scan":
        nc, nk = scan_counts(p, len(ins))
        consts, init, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
        carry_layouts = ep.results[:nk]
        body = fns[0]

        def step(carry, x):
            outs = body(*consts, *carry, *x)
            return _vary_to(outs[:nk], carry_layouts, ambient), list(outs[nk:])

        carry, ys = lax.scan(step, _vary_to(init, carry_layouts, ambient), list(xs),
                             length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])
        return list(carry) + list(ys)
    if e.name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        cond_fn, body_fn = fns
        layouts = ep.results
        return list(lax.while_loop(lambda c: cond_fn(*cconsts, *c)[0],
                                   lambda c: _vary_to(body_fn(*bconsts, *c), layouts, ambient),
                                   _vary_to(init, layouts, ambient)))
    if e.name == "cond":
        index, ops = ins[0], ins[1:]
        layouts = ep.results
        return list(lax.switch(index, [lambda *a, f=f: _vary_to(f(*a), layouts, ambient)
                                       for f in fns], *ops))
    gathered = _gathered_inputs(ep.sub_plans[0])
    return _rematerialised(fns[0], list(ins), p, ep.required, gathered)


def _rematerialised(body, ins: list, p: dict, layouts: list[Layout],
                    gathered: list[bool]) -> list:
    """`body(*ins)` re-wrapped in jax.checkpoint with the equation's policy and prevent_cse.

    A checkpoint that jax has already differentiated (`differentiated=True`: the backward
    recomputation that partial evaluation stages out) is lowered by jax with an optimization
    barrier over its prevent_cse operands, so that XLA neither CSEs the recomputation with
    the forward nor schedules it there (it waits for the cotangents among the operands).
    jax.checkpoint always binds `differentiated=False`: a plain re-wrap drops the barrier, so
    it is placed here, as jax places it.

    That is not enough on XLA's CPU backend, which removes optimization barriers
    (cse_barrier_expander) before its last CSE pass; plain jax shard_map code has the same
    problem. There, since shard_map lowers every collective with the same channel id, the
    recomputation's all-gathers merge with the forward's: ZeRO-3's re-gathered params would
    stay alive from the forward through the whole backward. (jax.jit's own SPMD partitioner
    numbers its collectives apart, so its re-gathers survive.) The operands the recomputation
    gathers from (`gathered`) are therefore also made distinct from the forward's values in
    a way XLA keeps (`_held_back`). The rest of the recomputation is left to XLA, as for
    jax.jit.

    Operands held as Partial stay out of the barrier: such a residual is a value the forward
    reduced right after computing it (the plan saved it unreduced), and XLA merging its
    re-reduction with the forward's is what saving the reduced value would do, at the same
    size and without a second collective.
    """
    prevent_cse = p.get("prevent_cse", True)
    if p.get("differentiated", False):
        read = _cse_flags(prevent_cse, len(ins))
        barred = [f and not L.partial for f, L in zip(read, layouts)]
        distinct = [b and g for b, g in zip(barred, gathered)]
        ins = _held_back(ins, barred, distinct, read)
    return list(jax.checkpoint(lambda *a: body(*a), prevent_cse=prevent_cse,
                               policy=p.get("policy"))(*ins))


def _cse_flags(prevent_cse, n: int) -> list[bool]:
    """prevent_cse (one bool, or one per operand) as one flag per operand."""
    if isinstance(prevent_cse, bool):
        return [prevent_cse] * n
    return [bool(f) for f in prevent_cse]


def _gathered_inputs(plan) -> list[bool]:
    """Per input of a sub-plan's program: whether a value the body all-gathers, or a rule
    sends (a convolution's halo), is computed from it (a nested body that does either counts
    for all its operands)."""
    program = plan.program
    wanted: set = set()
    for e, ep in zip(program.eqns, plan.eqns):
        wanted.update(e.inputs[i] for i, rp in ep.reshards if _gathers(rp))
        wanted.update(e.inputs[i] for i in ep.sends)
        if any(_plan_gathers(sub) for sub in ep.sub_plans):
            wanted.update(e.inputs)
    wanted.update(program.outputs[k] for k, rp in plan.output_reshards if _gathers(rp))
    for e in reversed(program.eqns):
        if any(v in wanted for v in e.outputs):
            wanted.update(e.inputs)
    return [v in wanted for v in program.inputs]


def _gathers(rp) -> bool:
    return any(s.step.kind == "all_gather" for s in rp.steps)


def _plan_gathers(plan) -> bool:
    return (any(_gathers(rp) for ep in plan.eqns for _, rp in ep.reshards)
            or any(ep.sends for ep in plan.eqns)
            or any(_gathers(rp) for _, rp in plan.output_reshards)
            or any(_plan_gathers(sub) for ep in plan.eqns for sub in ep.sub_plans))


def _held_back(ins: list, barred: list[bool], distinct: list[bool], read: list[bool]) -> list:
    """The `barred` operands behind an optimization barrier over the `read` ones; the floating
    `distinct` ones then as `select(ready, rounded(x), x)`.

    The select is x bit for bit: `rounded` rounds x to its dtype's own precision (no bit
    changes, NaN payloads included), an op XLA does not fold, so the two branches stay
    distinct and the select stays; `ready` is `s == s` over one element s of each operand
    read, whose value does not matter (a NaN just picks the other, equal branch). What it
    buys where XLA drops the barrier: x is a value XLA has not computed in the forward (no
    CSE), and it depends on the operands read, the cotangents among them (not hoisted into
    the forward).

    Under check_vma both ops type their results as varying over every input's mesh axes
    (optimization_barrier unifies them), which must not change an operand's type: so the
    barred operands are taken in groups of equal varying axes, each group behind a barrier
    over the operands read that vary over no other axes.
    """
    from ..reshard.steps import varying_axes

    axes = {i: varying_axes(x) for i, (x, r) in enumerate(zip(ins, read)) if r}
    out = list(ins)
    for group in dict.fromkeys(axes[i] for i, b in enumerate(barred) if b):
        readable = [i for i in axes if axes[i] <= group]
        held = dict(zip(readable, lax.optimization_barrier([ins[i] for i in readable])))
        own = [i for i in readable if barred[i] and axes[i] == group]
        kept = [i for i in own if distinct[i] and _is_float(held[i])]
        ready = _all_read([held[i] for i in readable if _is_float(held[i])]) if kept else None
        for i in own:
            out[i] = _rounded_select(ready, held[i]) if i in kept else held[i]
    return out


def _is_float(x) -> bool:
    return jnp.issubdtype(jax.typeof(x).dtype, jnp.floating)


def _rounded_select(ready, x):
    """x, as select(ready, x rounded to its own precision, x): see `_held_back`."""
    info = jnp.finfo(x.dtype)
    return lax.select(ready, lax.reduce_precision(x, exponent_bits=info.nexp,
                                                  mantissa_bits=info.nmant), x)


def _all_read(values: list):
    """A boolean scalar that reads one element of each value (True unless one is NaN)."""
    out = jnp.asarray(True)
    for v in values:
        if v.size:
            s = _first(v)
            out = out & (s == s)
    return out


def _first(x):
    """The first element of `x`, as a scalar (a one-element slice: no copy of x)."""
    return lax.slice(x, (0,) * x.ndim, (1,) * x.ndim).reshape(()) if x.ndim else x


def _vary_to(values, layouts, ambient: frozenset = frozenset()):
    from ..reshard.steps import ensure_varying

    return [ensure_varying(v, L.used_axes | ambient) for v, L in zip(values, layouts)]


__all__ = ["last_copy_straight", "platform_branch", "shared_operands", "HIGHER_ORDER", "plan_higher_order", "lower_higher_order"]
