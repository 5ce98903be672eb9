"""Higher-order primitives: scan, while, cond and checkpoint, planned as sub-programs.

Each body is planned with the engine itself (a sub-Plan on the same mesh):
- scan / while: carry layouts go to a fixpoint (carry-in == carry-out). The body's own carry
  layout is adopted when it differs — so a gradient accumulated across a scan stays Partial in
  the carry and is reduced once, after the loop, not per iteration. The scanned axis of xs and
  ys is never split.
- cond: every branch is planned on the same operand layouts; if their results disagree, all
  branches are re-planned to the first branch's result layouts (the join).
- checkpoint (jax.checkpoint / remat): the body is partitioned and re-wrapped in
  jax.checkpoint with the same policy, so the rematerialisation survives partitioning.
Collectives inside a body appear once in the plan (and once in the HLO), whatever the trip
count; their reason says which loop they belong to.
"""
from __future__ import annotations

import jax
from jax import lax
from jax.extend import core as jex_core

from ..layout import Layout
from .trace import build_program

HIGHER_ORDER = {"scan", "while", "cond", "checkpoint", "remat", "remat2"}
_MAX_FIXPOINT = 4


def _closed(jaxpr):
    return jaxpr if hasattr(jaxpr, "consts") else jex_core.ClosedJaxpr(jaxpr, [])


def _unsharded_leading(L: Layout) -> Layout:
    return Layout(((),) + L.dims[1:], L.partial)


def _slice_layout(L: Layout) -> Layout:
    return Layout(L.dims[1:], L.partial)


def _stacked(L: Layout) -> Layout:
    return Layout(((),) + L.dims, L.partial)


def _sub_plan(jaxpr, mesh, inputs, targets, registry, cost_model):
    from .plan import make_plan

    return make_plan(build_program(_closed(jaxpr)), mesh, list(inputs), list(targets), registry,
                     cost_model, top_level=False)


def _loop_carries(make, carries: list[Layout], n_outputs_after: int):
    """Plan a loop body until its carry-out layouts equal its carry-in layouts."""
    from .plan import KEEP

    n = len(carries)
    for _ in range(_MAX_FIXPOINT):
        sub = make(carries, [KEEP] * (n + n_outputs_after))
        out = sub.outputs[:n]
        if list(out) == list(carries):
            return carries, sub
        carries = list(out)
    # No fixpoint: force the body to hand back what it was given.
    return carries, make(carries, carries + [KEEP] * n_outputs_after)


def plan_higher_order(e, operands: list[Layout], mesh, registry, cost_model):
    """(required operand layouts, result layouts, sub-plans, description) for `e`."""
    from .plan import KEEP

    p = e.params
    if e.name == "scan":
        nc, nk = p["num_consts"], p["num_carry"]
        consts, init, xs = operands[:nc], operands[nc:nc + nk], operands[nc + nk:]
        xs_req = [_unsharded_leading(L) for L in xs]
        xs_in = [_slice_layout(L) for L in xs_req]
        n_ys = len(e.outputs) - nk

        def make(carries, targets):
            return _sub_plan(p["jaxpr"], mesh, consts + carries + xs_in, targets, registry, cost_model)

        carries, body = _loop_carries(make, list(init), n_ys)
        ys = [_stacked(L) for L in body.outputs[nk:]]
        return consts + carries + xs_req, carries + ys, [body], f"scan × {p['length']}"
    if e.name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = operands[:cn], operands[cn:cn + bn], operands[cn + bn:]

        def make(carries, targets):
            return _sub_plan(p["body_jaxpr"], mesh, bconsts + carries, targets, registry, cost_model)

        carries, body = _loop_carries(make, list(init), 0)
        cond = _sub_plan(p["cond_jaxpr"], mesh, cconsts + carries, [Layout.replicated(0)],
                         registry, cost_model)
        return cconsts + bconsts + carries, carries, [cond, body], "while loop"
    if e.name == "cond":
        index, ops = Layout.replicated(0), operands[1:]
        branches = [_sub_plan(b, mesh, ops, [KEEP] * len(e.outputs), registry, cost_model)
                    for b in p["branches"]]
        joined = list(branches[0].outputs)
        if any(list(b.outputs) != joined for b in branches[1:]):
            branches = [_sub_plan(b, mesh, ops, joined, registry, cost_model) for b in p["branches"]]
        return [index] + ops, joined, branches, f"cond of {len(branches)} branches"
    # checkpoint / remat
    body = _sub_plan(p["jaxpr"], mesh, operands, [KEEP] * len(e.outputs), registry, cost_model)
    return list(operands), list(body.outputs), [body], f"checkpoint (policy {getattr(p.get('policy'), '__name__', None)})"


def lower_higher_order(e, ep, ins, registry):
    """Bind `e` on local values, with its bodies partitioned by their sub-plans.

    Loop carries and branch results are cast to vary over exactly their planned layout's mesh
    axes (the bookkeeping check_vma verifies), so carry-in and carry-out types agree.
    """
    from .partition import local_function

    p = e.params
    fns = [local_function(sub, registry, physical=False) for sub in ep.sub_plans]
    if e.name == "scan":
        nc, nk = p["num_consts"], p["num_carry"]
        consts, init, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
        carry_layouts = ep.results[:nk]
        body = fns[0]

        def step(carry, x):
            outs = body(*consts, *carry, *x)
            return _vary_to(outs[:nk], carry_layouts), list(outs[nk:])

        carry, ys = lax.scan(step, _vary_to(init, carry_layouts), list(xs), length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])
        return list(carry) + list(ys)
    if e.name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        cond_fn, body_fn = fns
        layouts = ep.results
        return list(lax.while_loop(lambda c: cond_fn(*cconsts, *c)[0],
                                   lambda c: _vary_to(body_fn(*bconsts, *c), layouts),
                                   _vary_to(init, layouts)))
    if e.name == "cond":
        index, ops = ins[0], ins[1:]
        layouts = ep.results
        return list(lax.switch(index, [lambda *a, f=f: _vary_to(f(*a), layouts) for f in fns], *ops))
    body = fns[0]
    return list(jax.checkpoint(lambda *a: body(*a), prevent_cse=p.get("prevent_cse", True),
                               policy=p.get("policy"))(*ins))


def _vary_to(values, layouts):
    from ..reshard.steps import ensure_varying

    return [ensure_varying(v, L.used_axes) for v, L in zip(values, layouts)]


__all__ = ["HIGHER_ORDER", "plan_higher_order", "lower_higher_order"]
