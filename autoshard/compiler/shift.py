"""Shifts and rolls along one dim, folded from the slices, pads and concatenations that write them.

`jnp.roll(x, 1, axis)` is two slices and a concatenate; a token shift is `jnp.pad(x[:, :-1],
((0, 0), (1, 0)))`; their gradients are pads of slices summed (`add_any`). Each piece has a
length its devices do not divide (15 of 16 rows), so a split dim was gathered whole for every
one of them — where one device needs only a row or two from its neighbour. This pass follows
such chains symbolically, row by row, from one source value and, where a chain ends at a value
as long as its source, replaces its last equation by one `autoshard_shift`:

    out[j] = x[(j + shift) mod n]   for lo <= j < hi,   fill elsewhere

(rules/shift.py keeps the dim split and fetches the rows from the devices holding them). The
pieces the chain made are left to the dead-code pass when nothing else reads them.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

import numpy as np
from jax import lax
from jax._src import core as jcore
from jax._src.interpreters import mlir

from .fold import constant, is_zero, without

shift_p = jcore.Primitive("autoshard_shift")


def shift_reference(x, *fill, dim: int, shift: int, lo: int, hi: int):
    """One device's shift: the rows rolled by `shift`, those outside [lo, hi) set to `fill`."""
    n = x.shape[dim]
    s = shift % n
    rolled = x if s == 0 else lax.concatenate(
        [lax.slice_in_dim(x, s, n, axis=dim), lax.slice_in_dim(x, 0, s, axis=dim)], dim)
    if (lo, hi) == (0, n):
        return rolled
    rows = lax.broadcasted_iota(np.int32, x.shape, dim)
    inside = lax.bitwise_and(lax.ge(rows, np.int32(lo)), lax.lt(rows, np.int32(hi)))
    return lax.select(inside, rolled, lax.broadcast(fill[0], x.shape))


shift_p.def_impl(shift_reference)
shift_p.def_abstract_eval(lambda x, *fill, **params: jcore.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(shift_p, mlir.lower_fun(shift_reference, multiple_results=False))


class RowMap(NamedTuple):
    """A value whose rows along `dim` are `source`'s, rolled by `shift`, inside [lo, hi); the
    other rows hold `fill` (a scalar Value; None when [lo, hi) is every row)."""

    source: Any
    dim: int
    shift: int
    lo: int
    hi: int
    fill: Any


_MOVES = (lax.slice_p, lax.split_p, lax.pad_p, lax.concatenate_p, lax.add_p)


def _same_fill(a: Any, b: Any, made_by: dict) -> bool:
    if a is None or b is None or a is b:
        return a is b
    ca, cb = constant(a, made_by), constant(b, made_by)
    return ca is not None and cb is not None and ca.shape == cb.shape and bool(np.all(ca == cb))


def one_dim(e) -> int | None:
    """The one dim a slice or pad changes (-1: none; None: several, or strided / interior)."""
    if e.primitive is lax.slice_p:
        size = e.inputs[0].shape
        strides = e.params.get("strides") or ()
        if any(s not in (None, 1) for s in strides):
            return None
        changed = [d for d, (a, b) in enumerate(zip(e.params["start_indices"],
                                                     e.params["limit_indices"]))
                   if (a, b) != (0, size[d])]
    else:
        config = e.params["padding_config"]
        if any(interior for _, _, interior in config):
            return None
        changed = [d for d, (lo, hi, _) in enumerate(config) if (lo, hi) != (0, 0)]
    if not changed:
        return -1
    return changed[0] if len(changed) == 1 else None


def _cut(m: RowMap, start: int, stop: int) -> RowMap:
    """Rows [start, stop) of a mapped value."""
    length = stop - start
    return m._replace(shift=m.shift + start, lo=min(max(m.lo - start, 0), length),
                      hi=min(max(m.hi - start, 0), length))


def _joined(parts: list[tuple[RowMap | None, int, int, Any]], made_by: dict) -> RowMap | None:
    """Pieces laid one after another — (map or None for a piece of fill only, offset, length,
    its fill) — as one map: their data rows from one source at one shift, in one run, and the
    rest of the rows one fill."""
    data = [(m, at) for m, at, _, _ in parts if m is not None and m.hi > m.lo]
    if not data:
        return None
    first = data[0][0]
    n = first.source.shape[first.dim]
    spans = []
    for m, at in data:
        if m.source is not first.source or m.dim != first.dim:
            return None
        if (m.shift - at - (first.shift - data[0][1])) % n:
            return None
        spans.append((m.lo + at, m.hi + at))
    spans.sort()
    if any(a != b for (_, b), (a, _) in zip(spans, spans[1:])):
        return None
    lo, hi = spans[0][0], spans[-1][1]
    total = max(at + length for _, at, length, _ in parts)
    fill = None
    for m, at, length, f in parts:
        has_fill_rows = m is None or m.lo > 0 or m.hi < length
        if not has_fill_rows:
            continue
        if f is None or (fill is not None and not _same_fill(fill, f, made_by)):
            return None
        fill = f
    if (lo, hi) == (0, total):
        fill = None  # every row is data
    elif fill is None:
        return None
    return RowMap(first.source, first.dim, (first.shift - data[0][1]) % n, lo, hi, fill)


def fold_shifts(eqns: list, outputs: list, regions: list) -> list:
    """`eqns` with every chain of slices / pads / concatenations / sums that rolls or shifts
    one value along one dim (and is as long as it) made one `autoshard_shift` equation."""
    if not any(e.primitive is lax.concatenate_p or e.primitive is lax.pad_p for e in eqns):
        return eqns  # most programs: one pass over the equations, nothing to fold
    from .trace import params_key

    # a custom region's boundary values are its interface: chains neither cross nor rename them
    pinned = {v for r in regions for v in (*r.inputs, *r.outputs)}
    made_by = {e.outputs[0]: e for e in eqns if len(e.outputs) == 1}
    maps: dict = {}

    def mapped(v, dim: int) -> RowMap:
        m = maps.get(v)
        # a value padded up from fewer rows (a slice's gradient) is a better source itself:
        # a chain ends folded only where it is as long as its source
        if (m is not None and m.dim == dim and v not in pinned
                and m.source.shape[dim] >= v.shape[dim]):
            return m
        return RowMap(v, dim, 0, 0, v.shape[dim], None)

    def scalar_piece(v) -> Any:
        """The scalar a piece broadcasts (a piece of fill only), else None."""
        e = made_by.get(v)
        if (e is not None and e.primitive is lax.broadcast_in_dim_p and len(e.inputs) == 1
                and e.inputs[0].shape == ()):
            return e.inputs[0]
        return None

    folded: list = []  # (index, map)
    for k, e in enumerate(eqns):
        if e.primitive not in _MOVES and e.primitive.name != "add_any":
            continue
        if any(not hasattr(v, "shape") for v in e.outputs):
            continue
        out: list = [None] * len(e.outputs)
        d = one_dim(e) if e.primitive in (lax.slice_p, lax.pad_p) else None
        if d == -1:  # a slice or pad that keeps every row: the same map
            out[0] = maps.get(e.inputs[0]) if e.inputs[0] not in pinned else None
        elif e.primitive is lax.slice_p:
            if d is not None:
                out[0] = _cut(mapped(e.inputs[0], d), e.params["start_indices"][d],
                              e.params["limit_indices"][d])
        elif e.primitive is lax.split_p:
            d, at = e.params["axis"], 0
            m = mapped(e.inputs[0], d)
            for i, size in enumerate(e.params["sizes"]):
                out[i], at = _cut(m, at, at + size), at + size
        elif e.primitive is lax.pad_p:
            if d is not None:
                m = mapped(e.inputs[0], d)
                before, after, _ = e.params["padding_config"][d]
                length = e.inputs[0].shape[d]
                inner = _cut(m, max(-before, 0), length - max(-after, 0))
                kept = length - max(-before, 0) - max(-after, 0)
                parts = [(None, 0, max(before, 0), e.inputs[1]),
                         (inner, max(before, 0), kept, inner.fill),
                         (None, max(before, 0) + kept, max(after, 0), e.inputs[1])]
                out[0] = _joined([p for p in parts if p[2] > 0], made_by)
        elif e.primitive is lax.concatenate_p:
            d, at, parts = e.params["dimension"], 0, []
            for v in e.inputs:
                length = v.shape[d]
                scalar = scalar_piece(v)
                if scalar is not None:
                    parts.append((None, at, length, scalar))
                else:
                    m = mapped(v, d)
                    parts.append((m, at, length, m.fill))
                at += length
            out[0] = _joined(parts, made_by)
        else:  # add / add_any of two shifts of one value with zeros elsewhere
            a, b = e.inputs
            ma, mb = maps.get(a), maps.get(b)
            if ma is not None and mb is not None and a not in pinned and b not in pinned:
                if (ma.fill is not None and mb.fill is not None and is_zero(ma.fill, made_by)
                        and is_zero(mb.fill, made_by) and ma.dim == mb.dim
                        and (mb.lo >= ma.hi or ma.lo >= mb.hi)):
                    length = a.shape[ma.dim]
                    out[0] = _joined([(ma, 0, length, ma.fill), (mb, 0, length, mb.fill)],
                                     made_by)
        for v, m in zip(e.outputs, out):
            if m is None:
                continue
            maps[v] = m
            if (len(e.outputs) == 1 and v.shape == m.source.shape and m.hi > m.lo
                    and v not in pinned):
                folded.append((k, m))
    if not folded:
        return eqns
    read = Counter(v for e in eqns for v in e.inputs)  # before: only what the fold orphans goes
    for k, m in folded:
        e = eqns[k]
        e.primitive = shift_p
        e.inputs = [m.source] if m.fill is None else [m.source, m.fill]
        e.params = dict(dim=m.dim, shift=m.shift, lo=m.lo, hi=m.hi)
        e.params_key = params_key(e.params)
        e.sharding_cache = {}
    return drop_dead(eqns, outputs, regions, pinned, read)


def drop_dead(eqns: list, outputs: list, regions: list, pinned: set, read: Counter,
              also: frozenset = frozenset()) -> list:
    """`eqns` without the data movement that was read before a rewrite and no longer is, and
    without the equations `also` names (by id) that nothing reads (regions' bounds follow)."""
    uses = Counter(v for e in eqns for v in e.inputs)
    uses.update(outputs)
    dead: set = set()
    movers = (*_MOVES, shift_p, lax.broadcast_in_dim_p, lax.convert_element_type_p)
    for e in reversed(eqns):
        moved = ((e.primitive in movers or e.primitive.name == "add_any")
                 and any(read[v] for v in e.outputs))
        if ((moved or id(e) in also)
                and all(uses[v] == 0 and v not in pinned for v in e.outputs)):
            dead.add(id(e))
            for v in e.inputs:
                uses[v] -= 1
    return without(eqns, dead, regions)


__all__ = ["shift_p", "shift_reference", "fold_shifts", "RowMap", "drop_dead", "one_dim"]
