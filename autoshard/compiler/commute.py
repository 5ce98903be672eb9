"""Move a pending reduction back to where its Partial was made, where both places cost the same.

The plan keeps a Partial pending until a consumer cannot take it, so a reduction often lands
a few elementwise steps after the value was made: `lr * grad` before the optimizer's `sub`, a
division by a replicated row sum before a broadcast. Same bytes either way (the steps keep the
shape and the dtype's size), but the late place ties the collective to everything those steps
wait for. Two cases are rewritten:

- After a transpose. jax's transpose rule of `dot_general` ends a weight gradient with a
  `transpose`; reduced after it, XLA (CPU) folds the transpose into the dot, and a dot with a
  transposed output is not one of its fast library dots: a 12-layer GPT step ran 49 of its
  219 dots that way. Reducing first and transposing after, as `jax.jit` does, keeps the dot
  canonical and fuses the transpose into the update.
- After any other equation that makes a Partial (a `reduce_sum` over a sharded dimension, a
  dot over a sharded contraction), when a step also reads a computed value (the division of a
  softmax's row sum by the normalizer): the reduction runs on the Partial's own result, before
  the steps. It then no longer waits for that value, so XLA can combine it with an
  independent reduction over the same axes into one collective (the vocab-parallel
  cross-entropy: 9 collective ops per step to 8), or overlap it with the work that computes
  the value; and the arithmetic is done in one device's order (reduce, then scale).

- Before casts and scalings, a reduce-scatter too: under ZeRO the update reads a weight
  gradient split, after its cast to float32 (AMP) and its unscaling. Steps that compute each
  element from the same element alone keep any split, so the reduce-scatter moves up to the
  matmul's 16-bit result — half the bytes, as an all-reduce there already was.

A pass over a finished plan: it only rewrites a chain of single-reader equations whose plans
take the Partial as it is (steps that commute with the reduction) and whose end every reader reshards to one same layout that
reduces it (a reader that takes the Partial as it is — a sum of pending gradients — keeps the
plan: summing before reducing is what saves bytes there).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from ..layout import Layout
from .dtypes import local_nbytes
from .trace import Program, Value


def _before(layout: Layout, permutation) -> Layout:
    """The layout whose transpose by `permutation` is `layout`."""
    dims: list = [()] * len(permutation)
    for out_dim, in_dim in enumerate(permutation):
        dims[in_dim] = layout.dims[out_dim]
    return Layout(tuple(dims), layout.partial)


def _chain(v: Value, readers: dict, out_readers: dict, program: Program, eqn_plans: list,
           actual: dict) -> list[tuple[int, int]]:
    """The single-reader equations that take `v`'s Partial as it is, in order: each step's plan
    passed the Partial through, which its rule allows only where the step commutes with the
    reduction (a scale, a reshape, a sum over an unsharded dimension)."""
    chain: list[tuple[int, int]] = []
    while len(readers.get(v, ())) == 1 and not out_readers.get(v):
        j, i = readers[v][0]
        e, ep = program.eqns[j], eqn_plans[j]
        if (len(e.outputs) != 1 or ep.fallback or ep.sub_plans or ep.required[i] != actual[v]
                or ep.results[0].partial != actual[v].partial
                or any(L.partial for n, L in enumerate(ep.required) if n != i)):
            break
        chain.append((j, i))
        v = e.outputs[0]
    return chain


# steps that compute each element from the same element alone (and rank-0 operands), so any
# split of the operand is the same split of the result: a reduce-scatter moves up through them
_ELEMENTWISE = frozenset({"convert_element_type", "mul", "div", "neg", "copy",
                          "reduce_precision"})


def _keeps_layouts(chain: list[tuple[int, int]], program: Program) -> bool:
    """Every step of `chain` is elementwise on the chained operand, of its shape, with only
    rank-0 other operands (a cast, a scale: an AMP gradient's cast to float32 and unscaling)."""
    for j, i in chain:
        e = program.eqns[j]
        x = e.inputs[i]
        if (e.primitive.name not in _ELEMENTWISE or e.outputs[0].shape != x.shape
                or any(w.shape for n, w in enumerate(e.inputs) if n != i)):
            return False
    return True


def _layout_in_plan(eqn_plans: list, j: int, *, operand: int | None = None,
                    required=None, result=None) -> None:
    ep = eqn_plans[j]
    # new lists: a plan's lists may be shared with the memoised choice of other layers
    if operand is not None:
        ep.required = [required if n == operand else L for n, L in enumerate(ep.required)]
    if result is not None:
        ep.results = [result, *ep.results[1:]]


def hoist_reductions(program: Program, eqn_plans: list, actual: dict, output_reshards: list,
                     collectives: list, reshard: Callable, sizes: Mapping[str, int]) -> set[int]:
    """Rewrite the plan in place (see the module docstring). `reshard(value, dst, consumer,
    source)` plans a move and records its collectives, as make_plan's own does. Returns the
    indices of the equations whose plans changed."""
    touched: set[int] = set()
    readers = program.readers()
    out_readers = program.output_readers()
    out_plans = dict(output_reshards)
    # collectives of values whose reduction moved: dropped once at the end (one pass over the
    # list, not one per chain), except the moves planned here
    dropped: set[str] = set()
    planned_here: set[int] = set()

    def planned(fn: Callable[[], Any]) -> Any:
        n = len(collectives)
        out = fn()
        planned_here.update(id(c) for c in collectives[n:])
        return out

    for j0, (e, ep) in enumerate(zip(program.eqns, eqn_plans)):
        if ep.fallback or ep.sub_plans or len(e.outputs) != 1:
            continue
        before_transpose = e.primitive.name == "transpose"
        if before_transpose:
            x, v = e.inputs[0], e.outputs[0]
            if (not ep.required[0].partial or x.is_const
                    or len(readers.get(x, ())) + len(out_readers.get(x, ())) != 1):
                continue
        else:
            v = e.outputs[0]
            if not actual[v].partial:
                continue
        chain = _chain(v, readers, out_readers, program, eqn_plans, actual)
        if not before_transpose and not any(
                not w.is_const for j, i in chain
                for n, w in enumerate(program.eqns[j].inputs) if n != i):
            continue  # the steps wait for nothing else: the reduction would move for nothing
        last = program.eqns[chain[-1][0]].outputs[0] if chain else v
        moves = [dict(eqn_plans[j].reshards).get(i) for j, i in readers.get(last, ())]
        moves += [out_plans.get(k) for k in out_readers.get(last, ())]
        if not moves or any(m is None for m in moves):
            continue  # a reader takes the value as it is: nothing to move
        dst, now = moves[0].dst, actual[last]
        if any(m.dst != dst for m in moves) or not set(dst.partial) < set(now.partial):
            # readers disagree, nothing is reduced (a gather has no reason to move), or the
            # target adds a Partial of its own (a sum reduced, then made a Partial(max)): the
            # steps on the way commute with the reduction, not with making a new Partial
            continue
        rescatter = bool(chain) and dst.dims != now.dims
        if rescatter and not _keeps_layouts(chain, program):
            continue  # a reduce-scatter split into an all-reduce and a slice would cost more
        if not before_transpose and (local_nbytes(v.shape, v.dtype, actual[v], sizes)
                                     > local_nbytes(last.shape, last.dtype, now, sizes)):
            continue  # a sum or a cast on the way: reducing the smaller value is cheaper

        def reduced(w: Value) -> Layout:
            # a reduce-scatter moved up a chain of steps that keep every layout splits each
            # value on the way as the target is split
            return Layout(dst.dims if rescatter else actual[w].dims, dst.partial)

        ends = dst if not chain else reduced(last)
        dropped.add(repr(last))
        if before_transpose:
            at_v = reduced(v) if chain else dst
            target = _before(at_v, e.params["permutation"])
            dropped.add(repr(x))
            ep.reshards = [(i, rp) for i, rp in ep.reshards if i != 0]
            if actual[x] != target:  # before the layouts change: `reshard` reads actual[x]
                # from x itself: the copy the transpose read before (e.g. after an all-to-all)
                # is no longer made, its move being the one replaced here
                ep.reshards.append((0, planned(lambda: reshard(
                    x, target, f"{e.name} (eqn {e.index})", e.where, at=e.index,
                    from_own=True))))
            _layout_in_plan(eqn_plans, j0, operand=0, required=target, result=at_v)
            ep.strategy += "; reduced before the transpose (they commute; the dot stays canonical)"
            actual[v] = at_v
            steps = chain
        else:
            # the first step reduces the value made here; the rest run on reduced values
            j1, i1 = chain[0]
            e1, ep1 = program.eqns[j1], eqn_plans[j1]
            ep1.reshards = [(i, rp) for i, rp in ep1.reshards if i != i1]
            head = reduced(v)
            ep1.reshards.append((i1, planned(lambda: reshard(
                v, head, f"{e1.name} (eqn {e1.index})", e.where, at=e1.index))))
            _layout_in_plan(eqn_plans, j1, operand=i1, required=head,
                            result=reduced(e1.outputs[0]))
            ep1.strategy += "; reduced where the Partial was made (same bytes, fewer dependencies)"
            actual[e1.outputs[0]] = reduced(e1.outputs[0])
            steps = chain[1:]
        touched.add(j0)
        touched.update(j for j, _ in chain)
        touched.update(j for j, _ in readers.get(last, ()))
        for j, i in steps:  # the steps now run on the reduced value
            w, out = program.eqns[j].inputs[i], program.eqns[j].outputs[0]
            came = actual[w]  # already rewritten: the previous step's result
            _layout_in_plan(eqn_plans, j, operand=i, required=came, result=reduced(out))
            eqn_plans[j].operands = [came if n == i else L
                                     for n, L in enumerate(eqn_plans[j].operands)]
            actual[out] = reduced(out)
        for j, i in readers.get(last, ()):
            rp = eqn_plans[j]
            rp.operands = [ends if n == i else L for n, L in enumerate(rp.operands)]
            rp.reshards = [(n, p) for n, p in rp.reshards if n != i]
        ks = set(out_readers.get(last, ()))
        output_reshards[:] = [(k, p) for k, p in output_reshards if k not in ks]
    if dropped:
        # a rule's own collectives (a roll's halo on the way) stay: the step still runs them
        collectives[:] = [c for c in collectives
                          if c.value not in dropped or c.by_rule or c.nested
                          or id(c) in planned_here]
    return touched


__all__ = ["hoist_reductions"]
