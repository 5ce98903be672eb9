"""Slices of most of a dim, computed at the dim's full length: a language model's shifted loss.

`logits[:, :-1]` against `tokens[:, 1:]` — the loss of most training loops — slices 63 of 64
positions; 63 rows do not divide over the devices a sequence is split across, so the logits
(the largest activation) were gathered whole on every device. This pass computes such a chain
at the full length instead: a slice of L of a dim's N rows (7N/8 <= L < N) becomes the whole
dim rolled so that its rows come first (`autoshard_shift`; no equation at all for a slice from
row 0), and the equations reading it run on all N rows — elementwise ops, broadcasts, reductions
over other dims, matmuls along a free or batch dim (the head on `h[:, :-1]`), gathers and
scatters that keep rows apart (take_along_axis and its gradient, `jnp.take` of one index, an
embedding lookup of shifted ids); values made from nothing along the dim (a mean's gradient,
zeros to scatter into) are made again at full length. Rows L.. carry wrapped-around values no
one reads: a reduction over the dim, a matmul contracting it and an embedding gradient's
updates first set them to the identity (zeros), and a pad back to N rows (the slice's
gradient) becomes a shift that fills them with the pad value. Both are `autoshard_shift`
equations, whose rule keeps the dim split (rules/shift.py).

A chain is rewritten only when every value in it is read by equations the pass rewrites too,
so nothing is computed twice; anything else keeps the slices as written.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Callable

import numpy as np
from jax import lax

from .dtypes import highest, lowest
from .shift import drop_dead, one_dim, shift_p

# the reductions a pass can mask: the identity its dropped rows are set to
_IDENTITY: dict = {
    "reduce_sum": lambda dtype: np.zeros((), dtype),
    "reduce_max": lowest,
    "reduce_min": highest,
    "reduce_prod": lambda dtype: np.ones((), dtype),
    "reduce_or": lambda dtype: np.zeros((), dtype),
    # every bit set: and's identity for integers (1 only for bools)
    "reduce_and": lambda dtype: np.array(True if dtype == np.bool_ else -1).astype(dtype),
}


def _most_rows(e) -> tuple[int, int] | None:
    """(dim, start) of a unit-stride slice of nearly all of one dim's rows."""
    d = one_dim(e)
    if d is None or d < 0:
        return None
    a, b = e.params["start_indices"][d], e.params["limit_indices"][d]
    rows = b - a
    # at most an eighth more rows computed than the slice kept (a shift by a token or two)
    return (d, int(a)) if 2 <= rows and 8 * rows >= 7 * e.inputs[0].shape[d] else None


def _reshape_dim(src: tuple, dst: tuple, d: int) -> int | None:
    """Where dim d of `src` lands in `dst` when the reshape only adds or drops size-1 dims."""
    big_src = [i for i, s in enumerate(src) if s != 1]
    big_dst = [i for i, s in enumerate(dst) if s != 1]
    if [src[i] for i in big_src] != [dst[i] for i in big_dst] or d not in big_src:
        return None
    return big_dst[big_src.index(d)]


def _plan_eqn(e, dim_of: Callable, elementwise: set) -> tuple | None:
    """How `e` runs at full length: ("widen", {input: dim}, output dim), ("mask", input dim)
    for a reduction over the dim, ("unpad", input dim) for a pad back to the full length; None
    when it cannot. `dim_of(v)` is the long dim of a value already computed at full length."""
    name = e.primitive.name
    if e.primitive in elementwise and len(e.outputs) == 1:
        shape = e.outputs[0].shape
        framed = [dim_of(v) for v in e.inputs if dim_of(v) is not None]
        if not framed or any(f != framed[0] for f in framed):
            return None
        d = framed[0]
        # operands are scalars or of the result's rank, size-1 dims broadcasting (jax lets
        # elementwise ops broadcast them): those as long as the dim run at full length
        if any(v.shape and (len(v.shape) != len(shape)
                            or any(a not in (b, 1) for a, b in zip(v.shape, shape)))
               for v in e.inputs):
            return None
        return "widen", {i: d for i, v in enumerate(e.inputs)
                         if v.shape and v.shape[d] == shape[d]}, d
    if e.primitive is lax.broadcast_in_dim_p and len(e.inputs) == 1:
        d = dim_of(e.inputs[0])
        out = e.params["broadcast_dimensions"][d]
        return "widen", {0: d}, out
    if e.primitive is lax.reshape_p and e.params.get("dimensions") is None and len(e.inputs) == 1:
        d = dim_of(e.inputs[0])
        out = _reshape_dim(e.inputs[0].shape, e.outputs[0].shape, d)
        return None if out is None else ("widen", {0: d}, out)
    if (name in _IDENTITY or name in ("argmax", "argmin")) and len(e.inputs) == 1:
        # over other dims the rows stay apart (argmax: a prediction per position); over the
        # dim, a reduction first sets the rows past the slice to its identity
        d, axes = dim_of(e.inputs[0]), e.params["axes"]
        if d in axes:
            return ("mask", d) if name in _IDENTITY else None
        return "widen", {0: d}, d - sum(1 for a in axes if a < d)
    if e.primitive is lax.pad_p:
        d = dim_of(e.inputs[0])
        config = e.params["padding_config"]
        lo, hi, interior = config[d]
        if (dim_of(e.inputs[1]) is None and interior == 0 and lo >= 0 and hi >= 0
                and all(tuple(c) == (0, 0, 0) for i, c in enumerate(config) if i != d)):
            return "unpad", d
        return None
    if e.primitive is lax.dot_general_p:
        return _plan_dot(e, dim_of)
    if e.primitive is lax.gather_p:
        return _plan_gather(e, dim_of)
    if name in ("scatter-add", "scatter_add", "scatter"):
        return _plan_scatter(e, dim_of)
    return None


def _plan_dot(e, dim_of) -> tuple | None:
    """A matmul keeps rows apart along a free or batch dim (the head on `h[:, :-1]`: its
    result is as long); contracting the dim (the head's weight gradient) sums over rows, so
    both operands' rows past the slice are zeroed first."""
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    lhs, rhs = e.inputs
    dl, dr = dim_of(lhs), dim_of(rhs)
    lfree = [i for i in range(len(lhs.shape)) if i not in lc and i not in lb]
    rfree = [i for i in range(len(rhs.shape)) if i not in rc and i not in rb]
    if dl is not None and dl in lc:
        k = lc.index(dl)
        return ("mask_both", dl, rc[k]) if dr in (None, rc[k]) else None
    if dr is not None and dr in rc:
        k = rc.index(dr)
        return ("mask_both", lc[k], dr) if dl is None else None
    if dl is not None and dl in lb:
        k = lb.index(dl)
        return ("widen", {0: dl, 1: rb[k]}, k) if dr in (None, rb[k]) else None
    if dr is not None and dr in rb:
        k = rb.index(dr)
        return ("widen", {0: lb[k], 1: dr}, k) if dl is None else None
    if dl is not None and dr is None:
        return "widen", {0: dl}, len(lb) + lfree.index(dl)
    if dr is not None and dl is None:
        return "widen", {1: dr}, len(lb) + len(lfree) + rfree.index(dr)
    return None  # both operands long along free dims: an outer product of rows


def _whole_window(d: int, dropped, batching, indexed) -> bool:
    """Dim d of a gather's or scatter's operand is neither indexed nor a batching dim: its
    rows pass whole inside each window."""
    return d not in dropped and d not in batching and d not in indexed


def _plan_gather(e, dim_of) -> tuple | None:
    dn = e.params["dimension_numbers"]
    operand, indices = e.inputs
    d_op, d_ix = dim_of(operand), dim_of(indices)
    out_rank = len(e.outputs[0].shape)
    batch_out = [i for i in range(out_rank) if i not in dn.offset_dims]
    if d_op is not None and d_ix is None and _whole_window(
            d_op, dn.collapsed_slice_dims, dn.operand_batching_dims, dn.start_index_map):
        # the rows are taken whole, as a slice's window (jnp.take of one index of another dim)
        if e.params["slice_sizes"][d_op] != operand.shape[d_op]:
            return None
        window = [i for i in range(len(operand.shape))
                  if i not in dn.collapsed_slice_dims and i not in dn.operand_batching_dims]
        return "widen", {0: d_op}, dn.offset_dims[window.index(d_op)]
    if d_op is not None:  # take_along_axis: the dim is a batching dim of both
        if d_op not in dn.operand_batching_dims:
            return None
        want = dn.start_indices_batching_dims[dn.operand_batching_dims.index(d_op)]
        if d_ix not in (None, want):
            return None
        return "widen", {0: d_op, 1: want}, batch_out[want]
    # a lookup of rows of indices (shifted ids into a table): rows of the result follow them
    if d_ix is None or d_ix == len(indices.shape) - 1 or d_ix in dn.start_indices_batching_dims:
        return None
    return "widen", {1: d_ix}, batch_out[d_ix]


def _plan_scatter(e, dim_of) -> tuple | None:
    if len(e.inputs) != 3:
        return None
    dn = e.params["dimension_numbers"]
    operand, indices, updates = e.inputs
    known = [(i, dim_of(v)) for i, v in enumerate(e.inputs) if dim_of(v) is not None]
    if not known:
        return None
    scatter_upd = [i for i in range(len(updates.shape)) if i not in dn.update_window_dims]
    d_ix, d_op, d_up = dim_of(indices), dim_of(operand), dim_of(updates)
    window = [i for i in range(len(operand.shape))
              if i not in dn.inserted_window_dims and i not in dn.operand_batching_dims]
    if d_op is None and d_up in dn.update_window_dims:
        d_op = window[dn.update_window_dims.index(d_up)]
    if d_ix is None and d_op is not None and _whole_window(
            d_op, dn.inserted_window_dims, dn.operand_batching_dims,
            dn.scatter_dims_to_operand_dims):
        # the gradient of a whole-window gather: rows pass whole into the operand's windows
        d_upd = dn.update_window_dims[window.index(d_op)]
        if d_up not in (None, d_upd) or updates.shape[d_upd] != operand.shape[d_op]:
            return None
        return "widen", {0: d_op, 2: d_upd}, d_op
    if (dim_of(operand) is None and e.primitive.name in ("scatter-add", "scatter_add")
            and d_ix is not None and d_ix < len(indices.shape) - 1
            and d_ix not in dn.scatter_indices_batching_dims
            and d_up in (None, scatter_upd[d_ix])):
        # an embedding's gradient: updates of rows of indices added into a table; the rows
        # past the slice add zeros (their updates masked), and the table is whole again
        return "mask_updates", d_ix, scatter_upd[d_ix]
    # else the dim must be a batching dim: operand, indices and updates rows stay together
    for k, d_op in enumerate(dn.operand_batching_dims):
        d_ix = dn.scatter_indices_batching_dims[k]
        if d_ix >= len(scatter_upd):
            continue
        dims = {0: d_op, 1: d_ix, 2: scatter_upd[d_ix]}
        if all(dims[i] == d for i, d in known):
            return "widen", dims, d_op
    return None


def widen_slices(eqns: list, outputs: list, regions: list, fresh: Callable[[Any], Any],
                 constant: Callable[[Any, Any], Any]) -> list:
    """`eqns` with each chain that starts at a slice of most of a dim computed at the dim's
    full length (see the module's docstring); `fresh(aval)` makes a new value, `constant(value,
    aval)` a new constant."""
    if not any(e.primitive is lax.slice_p for e in eqns):
        return eqns  # one pass over the equations: most programs have nothing to widen
    from ..rules.elementwise import TABLE

    elementwise = {p for p in TABLE if p.name not in ("optimization_barrier",
                                                        "bitcast_convert_type")}
    inside = {k for r in regions for k in range(r.start, r.stop)}
    pinned = {v for r in regions for v in (*r.inputs, *r.outputs)}
    made_by = {e.outputs[0]: e for e in eqns if len(e.outputs) == 1}
    readers: dict = defaultdict(list)
    for k, e in enumerate(eqns):
        for v in e.inputs:
            readers[v].append(k)

    long_dim: dict = {}    # a value computed at full length → (its long dim, group)
    length: dict = {}      # group → (rows the slice kept, the dim's full rows)
    parent: dict = {}      # groups joined by an equation reading both

    def find(g):
        while parent[g] != g:
            g = parent[g]
        return g

    def dim_of(v):
        return long_dim[v][0] if v in long_dim else None

    def spread_inputs(e, v, d) -> list | None:
        """The (operand, dim) pairs of `e` (which makes v) that run along v's dim d; None if
        `e` cannot be made again at full length from them."""
        if len(e.outputs) != 1:
            return None
        if e.primitive is lax.broadcast_in_dim_p and len(e.inputs) == 1:
            dims = e.params["broadcast_dimensions"]
            return [(0, dims.index(d))] if d in dims else []
        if e.primitive in elementwise:
            if any(u.shape and len(u.shape) != len(v.shape) for u in e.inputs):
                return None
            return [(i, d) for i, u in enumerate(e.inputs) if u.shape and u.shape[d] == v.shape[d]]
        if e.primitive.name in ("scatter-add", "scatter_add") and len(e.inputs) == 3:
            dn = e.params["dimension_numbers"]
            if not _whole_window(d, dn.inserted_window_dims, dn.operand_batching_dims,
                                 dn.scatter_dims_to_operand_dims):
                return None
            window = [i for i in range(len(v.shape))
                      if i not in dn.inserted_window_dims and i not in dn.operand_batching_dims]
            return [(0, d), (2, dn.update_window_dims[window.index(d)])]
        return None

    def spreadable(v, d, rows) -> bool:
        """Made without reading dim d's rows from anything of the chain — a broadcast (zeros to
        scatter into, a scalar's gradient), ops and whole-window scatters of such values: it
        is made again at full length where it is read."""
        e = made_by.get(v)
        if e is None or v in pinned or v in long_dim or v.shape[d] != rows:
            return False
        ins = spread_inputs(e, v, d)
        return ins is not None and all(spreadable(e.inputs[i], dd, rows) for i, dd in ins)

    actions: dict = {}
    for k, e in enumerate(eqns):
        if k in inside:
            continue
        if e.primitive is lax.slice_p and e.inputs[0] not in long_dim:
            cut = _most_rows(e)
            if cut is not None:
                d, start = cut
                g = len(parent)
                parent[g] = g
                length[g] = (e.outputs[0].shape[d], e.inputs[0].shape[d])
                long_dim[e.outputs[0]] = (d, g)
                actions[k] = ("start", g, (d, start))
            continue
        if not any(v in long_dim for v in e.inputs):
            continue
        plan = _plan_eqn(e, dim_of, elementwise)
        if plan is None:
            continue
        groups = {find(long_dim[v][1]) for v in e.inputs if v in long_dim}
        sizes = {length[g] for g in groups}
        if len(sizes) != 1:
            continue
        rows, full = sizes.pop()
        if plan[0] == "widen":
            _, dims, out_dim = plan
            if any(e.inputs[i] not in long_dim and not spreadable(e.inputs[i], d, rows)
                   for i, d in dims.items()):
                continue
            if any(v.shape[out_dim] != rows for v in e.outputs[:1]):
                continue
        elif plan[0] == "mask_both":
            if not all(v in long_dim or spreadable(v, d, rows)
                       for v, d in zip(e.inputs, plan[1:])):
                continue
        elif plan[0] == "mask_updates":
            if not all(v in long_dim or spreadable(v, d, rows)
                       for v, d in zip(e.inputs[1:], plan[1:])):
                continue
        elif plan[0] == "unpad":
            lo, hi, _ = e.params["padding_config"][plan[1]]
            if lo + rows + hi != full:
                continue
        g = min(groups)
        for other in groups:
            parent[find(other)] = g
        actions[k] = (plan[0], g, plan[1:])
        if plan[0] == "widen":
            for v in e.outputs:
                long_dim[v] = (plan[2], g)

    # a group is rewritten only if every reader of its values is rewritten with it
    spoiled = set()
    for v, (_, g) in long_dim.items():
        if v in pinned or v in outputs or any(r not in actions for r in readers[v]):
            spoiled.add(find(g))
    keep = {k for k, (_, g, _) in actions.items() if find(g) not in spoiled}
    if not keep:
        return eqns

    from .trace import Eqn, params_key

    full_of: dict = {}  # value → the same value computed at full length
    new: list = []
    new_index: list = []
    rewritten: set = set()
    read = Counter(v for e in eqns for v in e.inputs)

    def emit(primitive, inputs, avals, params, where) -> list:
        outs = [fresh(a) for a in avals]
        new.append(Eqn(primitive, list(inputs), outs, params, where,
                       params_key=params_key(params)))
        rewritten.add(id(new[-1]))  # unread (a copy of something the program never read)
        return outs

    def masked(x, d, rows, value, where):
        """`x` (at full length) with its rows from `rows` on set to `value`."""
        fill = constant(np.asarray(value, x.dtype), x.aval.update(shape=()))
        (out,) = emit(shift_p, [x, fill], [x.aval], dict(dim=d, shift=0, lo=0, hi=rows), where)
        return out

    def longer(aval, d, full):
        shape = list(aval.shape)
        shape[d] = full
        return aval.update(shape=tuple(shape))

    def at_full(v, d, full, where):
        if v in full_of:
            return full_of[v]
        src = made_by[v]  # a spreadable value, made again at full length
        ins = list(src.inputs)
        for i, dd in spread_inputs(src, v, d):
            ins[i] = at_full(ins[i], dd, full, where)
        params = dict(src.params)
        if "shape" in params:
            params["shape"] = tuple(longer(v.aval, d, full).shape)
        (out,) = emit(src.primitive, ins, [longer(v.aval, d, full)], params, where)
        rewritten.add(id(src))
        full_of[v] = out
        return out

    for k, e in enumerate(eqns):
        new_index.append(len(new))
        if k not in keep:
            new.append(e)
            continue
        kind, g, info = actions[k]
        rows, full = length[find(g)]
        if kind == "start":
            new.append(e)
            rewritten.add(id(e))
            d, start = info
            x = e.inputs[0]
            full_of[e.outputs[0]] = x if start == 0 else emit(
                shift_p, [x], [x.aval], dict(dim=d, shift=start, lo=0, hi=full), e.where)[0]
        elif kind == "widen":
            new.append(e)
            rewritten.add(id(e))
            dims, out_dim = info
            ins = [at_full(v, dims[i], full, e.where) if i in dims else v
                   for i, v in enumerate(e.inputs)]
            params = dict(e.params)
            avals = [longer(v.aval, out_dim, full) for v in e.outputs]
            for key in ("shape", "new_sizes"):
                if params.get(key) is not None:
                    params[key] = tuple(avals[0].shape)
            if e.primitive is lax.gather_p and 0 in dims:  # a whole-window dim's slice size
                sizes = list(params["slice_sizes"])
                if sizes[dims[0]] == rows:
                    sizes[dims[0]] = full
                params["slice_sizes"] = tuple(sizes)
            for v, out in zip(e.outputs, emit(e.primitive, ins, avals, params, e.where)):
                full_of[v] = out
        elif kind == "mask":  # a reduction over the dim: the extra rows its identity
            (d,) = info
            x = full_of[e.inputs[0]]
            e.inputs = [masked(x, d, rows, _IDENTITY[e.primitive.name](x.dtype), e.where)]
            e.sharding_cache = {}
            new.append(e)
        elif kind == "mask_both":  # a contraction over the dim: both operands' extra rows zero
            e.inputs = [masked(at_full(v, d, full, e.where), d, rows, 0, e.where)
                        for v, d in zip(e.inputs, info)]
            e.sharding_cache = {}
            new.append(e)
        elif kind == "mask_updates":  # an embedding's gradient: the extra rows add zeros
            d_ix, d_upd = info
            e.inputs = [e.inputs[0], at_full(e.inputs[1], d_ix, full, e.where),
                        masked(at_full(e.inputs[2], d_upd, full, e.where), d_upd, rows, 0,
                               e.where)]
            e.sharding_cache = {}
            new.append(e)
        else:  # unpad: the pad back to full length is a shift filling the rest with its value
            (d,) = info
            lo = e.params["padding_config"][d][0]
            e.primitive = shift_p
            e.inputs = [full_of[e.inputs[0]], e.inputs[1]]
            e.params = dict(dim=d, shift=(-lo) % full, lo=lo, hi=lo + rows)
            e.params_key = params_key(e.params)
            e.sharding_cache = {}
            new.append(e)
    new_index.append(len(new))
    for r in regions:
        r.start, r.stop = new_index[r.start], new_index[r.stop]
    return drop_dead(new, outputs, regions, pinned, read, frozenset(rewritten))


__all__ = ["widen_slices"]
