"""Move a value before the steps that widen it: gather the bf16 activations, then cast to f32.

The plan moves an operand where its consumer needs it, so a move lands after the steps that
made the value — and some of those steps make it larger without changing what any device
holds: a cast to a wider dtype (`x.astype(jnp.float32)` before a matmul in f32), a pad of a
whole dim, a broadcast (a vmapped cond's predicate `p[:, None, None]` made as large as the
data it selects), a pointwise function of any of them. Moving the value before them sends the
narrower array (half the bytes for bf16 → f32; one element per row instead of a whole row for
a broadcast) and the steps then run on the moved copy; their result is the same array, so
values are unchanged. Several broadcasts of one small value (each branch's predicate) then
move that value once, as XLA's simplifier makes it.

A pass over a finished plan, like `commute.py`: it walks back from a moved value through a
chain of single-reader steps that took their operand's layout as it was, and moves the chain's
first operand instead when that is priced cheaper (the cost model, the copies already made
counted free). Only moves without a Partial on either side: a pending sum is `commute.py`'s.
"""
from __future__ import annotations

from typing import Callable

from jax import lax

from ..layout import Layout
from .trace import Program

# one-operand steps that run on any layout and keep each element where it was (their other
# operands, if any, are scalars)
_POINTWISE = frozenset(p.name for p in (
    lax.convert_element_type_p, lax.neg_p, lax.exp_p, lax.exp2_p, lax.expm1_p, lax.log_p,
    lax.log1p_p, lax.tanh_p, lax.logistic_p, lax.abs_p, lax.sqrt_p, lax.rsqrt_p, lax.sin_p,
    lax.cos_p, lax.integer_pow_p, lax.square_p, lax.reduce_precision_p, lax.mul_p, lax.add_p,
    lax.sub_p, lax.div_p, lax.max_p, lax.min_p, lax.copy_p, lax.real_p, lax.imag_p,
    lax.erf_p, lax.not_p, lax.eq_p, lax.ne_p, lax.lt_p, lax.le_p, lax.gt_p, lax.ge_p,
    lax.and_p, lax.or_p, lax.xor_p))


def operand_layout(e, out: Layout) -> Layout:
    """The layout of a broadcast's operand that makes its result laid out as `out` with no
    communication: each operand dim as the result dim it becomes; a dim it stretches from
    size 1, and the dims it adds, hold whole copies (their axes leave the operand whole)."""
    shape, into = e.inputs[0].shape, e.params["broadcast_dimensions"]
    return Layout([out.dims[d] if n == e.outputs[0].shape[d] else () for n, d in zip(shape, into)])


def result_layout(e, operand: Layout) -> Layout:
    """A broadcast's result laid out as its operand (the dims it adds whole)."""
    dims: list = [()] * len(e.outputs[0].shape)
    for axes, d in zip(operand.dims, e.params["broadcast_dimensions"]):
        dims[d] = axes
    return Layout(dims)


def _step_input(e, ep, actual: dict, dst: Layout) -> tuple[int, Layout] | None:
    """The operand of `e` that a move to `dst` may go before, and the layout it moves to
    there (None: `e` is no such step): `e` keeps its one array operand's layout (its plan
    moved nothing), and laid out as `dst` it still needs no communication (a padded dim stays
    whole, a broadcast's operand splits as the dims it becomes)."""
    if len(e.outputs) != 1 or ep.fallback or ep.sub_plans or ep.reshards or ep.sends:
        return None
    arrays = [i for i, v in enumerate(e.inputs) if v.shape]
    name = e.primitive.name
    if name == "broadcast_in_dim":
        if len(e.inputs) != 1 or not e.inputs[0].shape:
            return None  # (a scalar's broadcast is made in any layout for free)
        u = e.inputs[0]
        if u.is_const or actual[u].partial or ep.required[0] is not actual[u] \
                or ep.results[0].partial or operand_layout(e, ep.results[0]) is not actual[u]:
            return None
        return 0, operand_layout(e, dst)
    if len(arrays) != 1 or len(e.inputs[arrays[0]].shape) != len(e.outputs[0].shape):
        return None
    i = arrays[0]
    u = e.inputs[i]
    if u.is_const or actual[u].partial or ep.required[i] is not actual[u] \
            or ep.results[0].dims != actual[u].dims or ep.results[0].partial:
        return None
    if name == "pad":
        if any(cfg[2] for cfg in e.params["padding_config"]):
            return None  # interior padding spreads rows: a split dim's rows would move
        if any(dst.dims[d] and (lo or hi) for d, (lo, hi, _) in
               enumerate(e.params["padding_config"])):
            return None
    elif name not in _POINTWISE:
        return None
    return i, dst


def move_before_widening(program: Program, eqn_plans: list, actual: dict,
                         output_reshards: list, collectives: list, reshard: Callable,
                         price: Callable, in_region: Callable[[int], bool]) -> set[int]:
    """Rewrite the plan in place (see the module docstring). `reshard(value, dst, consumer,
    source, at=)` plans a move and records its collectives, as make_plan's own does; `price(
    value, dst, at)` is what that move would cost (0: already made). Returns the indices of
    the equations whose plans changed."""
    touched: set[int] = set()
    readers = program.readers()
    outs = program.output_readers()
    out_plans = dict(output_reshards)
    dropped: set[str] = set()
    # latest first: a move placed before a chain is itself a move a chain before it may take
    for j in range(len(program.eqns) - 1, -1, -1):
        e, ep = program.eqns[j], eqn_plans[j]
        for i, rp in list(ep.reshards):
            v = e.inputs[i]
            if v.is_const or v.producer < 0 or v not in actual or actual[v].partial \
                    or rp.dst.partial or in_region(j):
                continue
            moves = [dict(eqn_plans[r].reshards).get(n) for r, n in readers.get(v, ())]
            moves += [out_plans.get(k) for k in outs.get(v, ())]
            if any(m is None or m.dst is not rp.dst for m in moves):
                continue  # a reader takes the value as it is, or wants another layout
            dst = rp.dst
            # the chain back from v, latest first: (step index, its operand's index, the
            # step's result layout, its operand's layout) with v laid out as dst
            chain: list[tuple[int, int, Layout, Layout]] = []
            w, out = v, dst
            while w.producer >= 0 and not in_region(w.producer):
                p = w.producer
                found = _step_input(program.eqns[p], eqn_plans[p], actual, out)
                if found is None:
                    break
                n, into = found
                chain.append((p, n, out, into))
                w, out = program.eqns[p].inputs[n], into
                if len(readers.get(w, ())) != 1 or outs.get(w):
                    break  # read elsewhere too: it stays where it is for those readers
            if not chain:
                continue
            here = sum(s.seconds for s in rp.steps)
            best, at = here, None
            for m, (p, n, _, into) in enumerate(chain):
                u = program.eqns[p].inputs[n]
                cost = price(u, into, p)
                if cost < best - 1e-15:
                    best, at = cost, m
            if at is None:
                continue
            steps = chain[:at + 1]
            p0, n0, _, into0 = steps[-1]
            first, fp = program.eqns[p0], eqn_plans[p0]
            u = first.inputs[n0]
            # (none where the operand lies as needed: a broadcast then makes its block only)
            fp.reshards = [] if actual[u] is into0 else [
                (n0, reshard(u, into0, f"{first.name} (eqn {first.index})", first.where,
                             at=p0))]
            for p, n, made, into in steps:  # new lists: plans may share theirs with copied blocks
                sp = eqn_plans[p]
                if p != p0:
                    sp.operands = [into if q == n else L for q, L in enumerate(sp.operands)]
                sp.required = [into if q == n else L for q, L in enumerate(sp.required)]
                sp.early = n
                sp.results = [made]
                sp.strategy = ("as its readers need it: moved before this step (narrower there)"
                               if fp.reshards else "made as its readers need it (no move)")
                actual[program.eqns[p].outputs[0]] = made
                touched.add(p)
            for r, n in readers.get(v, ()):
                rp_ = eqn_plans[r]
                rp_.operands = [dst if q == n else L for q, L in enumerate(rp_.operands)]
                rp_.reshards = [(q, x) for q, x in rp_.reshards if q != n]
                touched.add(r)
            ks = set(outs.get(v, ()))
            output_reshards[:] = [(k, x) for k, x in output_reshards if k not in ks]
            for k in ks:
                out_plans.pop(k, None)
            dropped.add(repr(v))
    if dropped:
        collectives[:] = [c for c in collectives
                          if c.by_rule or c.nested or c.value not in dropped]
    return touched


__all__ = ["move_before_widening", "operand_layout", "result_layout"]
