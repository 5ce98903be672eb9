"""Move a value before the steps that widen it: gather the bf16 activations, then cast to f32.

The plan moves an operand where its consumer needs it, so a move lands after the steps that
made the value — and some of those steps make it larger without changing what any device
holds: a cast to a wider dtype (`x.astype(jnp.float32)` before a matmul in f32), a pad of a
whole dim, a pointwise function of either. Moving the value before them sends the narrower
array (half the bytes for bf16 → f32) and the steps then run on the moved copy; their result
is the same array, so values are unchanged.

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
    lax.erf_p, lax.not_p))


def _step_input(e, ep, actual: dict, dst: Layout) -> int | None:
    """The operand of `e` that a move to `dst` may go before (None: `e` is no such step): `e`
    keeps its one array operand's layout (its plan moved nothing), and laid out as `dst` it
    still needs no communication (a padded dim stays whole)."""
    if len(e.outputs) != 1 or ep.fallback or ep.sub_plans or ep.reshards or ep.sends:
        return None
    arrays = [i for i, v in enumerate(e.inputs) if v.shape]
    if len(arrays) != 1 or len(e.inputs[arrays[0]].shape) != len(e.outputs[0].shape):
        return None
    i = arrays[0]
    u = e.inputs[i]
    if u.is_const or actual[u].partial or ep.required[i] is not actual[u] \
            or ep.results[0].dims != actual[u].dims or ep.results[0].partial:
        return None
    name = e.primitive.name
    if name == "pad":
        if any(cfg[2] for cfg in e.params["padding_config"]):
            return None  # interior padding spreads rows: a split dim's rows would move
        if any(dst.dims[d] and (lo or hi) for d, (lo, hi, _) in
               enumerate(e.params["padding_config"])):
            return None
    elif name not in _POINTWISE:
        return None
    return i


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
            # the chain back from v: (step index, its operand's index), latest first
            chain: list[tuple[int, int]] = []
            w = v
            while w.producer >= 0 and not in_region(w.producer):
                p = w.producer
                n = _step_input(program.eqns[p], eqn_plans[p], actual, dst)
                if n is None:
                    break
                chain.append((p, n))
                w = program.eqns[p].inputs[n]
                if len(readers.get(w, ())) != 1 or outs.get(w):
                    break  # read elsewhere too: it stays where it is for those readers
            if not chain:
                continue
            here = sum(s.seconds for s in rp.steps)
            best, at = here, None
            for m, (p, n) in enumerate(chain):
                u = program.eqns[p].inputs[n]
                cost = price(u, dst, p)
                if cost < best - 1e-15:
                    best, at = cost, m
            if at is None:
                continue
            steps = chain[:at + 1]
            p0, n0 = steps[-1]
            first, fp = program.eqns[p0], eqn_plans[p0]
            u = first.inputs[n0]
            fp.reshards = [(n0, reshard(u, dst, f"{first.name} (eqn {first.index})", first.where,
                                        at=p0))]
            for p, n in steps:  # new lists: plans may share theirs with copied blocks
                sp = eqn_plans[p]
                if p != p0:
                    sp.operands = [dst if q == n else L for q, L in enumerate(sp.operands)]
                sp.required = [dst if q == n else L for q, L in enumerate(sp.required)]
                sp.early = n
                sp.results = [dst]
                sp.strategy = "as its readers need it: moved before this step (narrower there)"
                actual[program.eqns[p].outputs[0]] = dst
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


__all__ = ["move_before_widening"]
