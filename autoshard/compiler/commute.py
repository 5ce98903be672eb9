"""Move a reduction from after a transpose to before it, where both orders cost the same.

jax's transpose rule of `dot_general` ends a weight gradient with a `transpose`. The gradient
is Partial over the batch axes, the transpose passes the Partial through, and the plan reduces
the transposed value where the optimizer needs it. Same bytes either way, but XLA (CPU) then
folds the transpose into the dot, and a dot with a transposed output is not one of its fast
library dots: a 12-layer GPT step ran 49 of its 219 dots that way. Reducing first and
transposing after, as `jax.jit` does, keeps the dot canonical and fuses the transpose into
the update.

A pass over a finished plan: it only rewrites a transpose whose Partial input has no other
reader and whose every reader reshards the result to one same layout that reduces the Partial
(a reader that takes the Partial as it is — a sum of pending gradients — keeps the plan).
"""
from __future__ import annotations

from typing import Callable

from ..layout import Layout
from .trace import Program, Value


def _before(layout: Layout, permutation) -> Layout:
    """The layout whose transpose by `permutation` is `layout`."""
    dims: list = [()] * len(permutation)
    for out_dim, in_dim in enumerate(permutation):
        dims[in_dim] = layout.dims[out_dim]
    return Layout(tuple(dims), layout.partial)


# Elementwise primitives a Partial passes through on its way from the transpose to the
# reduction (the optimizer's `lr * grad`, a dtype cast): operand index -> linear in it.
_LINEAR_IN = {"mul": (0, 1), "neg": (0,), "convert_element_type": (0,), "div": (0,),
              "copy": (0,), "copy_p": (0,)}


def _chain(v: Value, readers: dict, out_readers: dict, program: Program, eqn_plans: list,
           actual: dict) -> list[tuple[int, int]]:
    """The single-reader elementwise equations that take `v`'s Partial as it is, in order."""
    chain: list[tuple[int, int]] = []
    while len(readers.get(v, ())) == 1 and not out_readers.get(v):
        j, i = readers[v][0]
        e, ep = program.eqns[j], eqn_plans[j]
        if (i not in _LINEAR_IN.get(e.name, ()) or ep.required[i] != actual[v]
                or ep.results[0].partial != actual[v].partial
                or any(L.partial for n, L in enumerate(ep.required) if n != i)):
            break
        chain.append((j, i))
        v = e.outputs[0]
    return chain


def _layout_in_plan(eqn_plans: list, j: int, *, operand: int | None = None,
                    required=None, result=None) -> None:
    ep = eqn_plans[j]
    # new lists: a plan's lists may be shared with the memoised choice of other layers
    if operand is not None:
        ep.required = [required if n == operand else L for n, L in enumerate(ep.required)]
    if result is not None:
        ep.results = [result, *ep.results[1:]]


def hoist_reductions(program: Program, eqn_plans: list, actual: dict, output_reshards: list,
                     collectives: list, reshard: Callable) -> set[int]:
    """Rewrite the plan in place (see the module docstring). `reshard(value, dst, consumer,
    source)` plans a move and records its collectives, as make_plan's own does. Returns the
    indices of the equations whose plans changed."""
    touched: set[int] = set()
    readers = program.readers()
    out_readers: dict[Value, list] = {}
    for k, v in enumerate(program.outputs):
        out_readers.setdefault(v, []).append(k)
    out_plans = dict(output_reshards)
    # collectives of values whose reduction moved: dropped once at the end (one pass over the
    # list, not one per transpose), except the moves planned here
    dropped: set[str] = set()
    planned_here: set[int] = set()

    for j0, (e, ep) in enumerate(zip(program.eqns, eqn_plans)):
        if e.primitive.name != "transpose" or ep.fallback or not ep.required[0].partial:
            continue
        x, v = e.inputs[0], e.outputs[0]
        if x.is_const or len(readers.get(x, ())) + len(out_readers.get(x, ())) != 1:
            continue
        chain = _chain(v, readers, out_readers, program, eqn_plans, actual)
        last = program.eqns[chain[-1][0]].outputs[0] if chain else v
        moves = [dict(eqn_plans[j].reshards).get(i) for j, i in readers.get(last, ())]
        moves += [out_plans.get(k) for k in out_readers.get(last, ())]
        if not moves or any(m is None for m in moves):
            continue  # a reader takes the value as it is: nothing to move
        dst, now = moves[0].dst, actual[last]
        if any(m.dst != dst for m in moves) or set(dst.partial) >= set(now.partial):
            continue  # readers disagree, or nothing is reduced (a gather has no reason to move)
        if chain and dst.dims != now.dims:
            continue  # a reduce-scatter split into an all-reduce and a slice would cost more
        ends = dst if not chain else Layout(now.dims, dst.partial)
        target = _before(ends, e.params["permutation"])
        dropped.update((repr(x), repr(last)))
        ep.reshards = [(i, rp) for i, rp in ep.reshards if i != 0]
        if actual[x] != target:  # before the layouts change: `reshard` reads actual[x]
            n = len(collectives)
            ep.reshards.append((0, reshard(x, target, f"{e.name} (eqn {e.index})", e.where)))
            planned_here.update(id(c) for c in collectives[n:])
        _layout_in_plan(eqn_plans, j0, operand=0, required=target, result=ends)
        touched.add(j0)
        touched.update(j for j, _ in chain)
        touched.update(j for j, _ in readers.get(last, ()))
        eqn_plans[j0].strategy += "; reduced before the transpose (they commute; the dot stays canonical)"
        actual[v] = ends
        for j, i in chain:  # the elementwise steps now run on the reduced value
            _layout_in_plan(eqn_plans, j, operand=i, required=ends, result=ends)
            eqn_plans[j].operands = [ends if n == i else L
                                     for n, L in enumerate(eqn_plans[j].operands)]
            actual[program.eqns[j].outputs[0]] = ends
        for j, i in readers.get(last, ()):
            rp = eqn_plans[j]
            rp.operands = [ends if n == i else L for n, L in enumerate(rp.operands)]
            rp.reshards = [(n, p) for n, p in rp.reshards if n != i]
        ks = set(out_readers.get(last, ()))
        output_reshards[:] = [(k, p) for k, p in output_reshards if k not in ks]
    if dropped:
        collectives[:] = [c for c in collectives
                          if c.value not in dropped or id(c) in planned_here]
    return touched


__all__ = ["hoist_reductions"]
