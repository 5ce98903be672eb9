"""Gathers and scatter-adds along one dim by a constant index that a slice or a repeat says.

`jax.image.resize(x, ..., "nearest")` to twice the size and `x[:, jnp.arange(64) // 2]` gather
row i // 2 of a dim; `x[:, jnp.arange(0, 32, 2)]` gathers every other row; their gradients
scatter-add by the same index. The index is computed in the program (iota, a floor divide,
jnp's wrap of negative indices), so the gather rule sees only an int array and must assume any
row may be read from anywhere: a split dim is gathered, or looked up masked and all-reduced.
Evaluated here (small integer arithmetic, done with numpy), such an index is recognised as
- a repeat, `i // r`: the gather is a broadcast to a new minor dim and a reshape (jnp.repeat),
  its scatter-add a reshape and a sum over that dim;
- every k-th row from one of the first k, `lo + k i`: the gather is a strided slice, its
  scatter-add an interior pad (a strided slice's own gradient);
whose rules keep the dim split with no communication (row block i of the result comes from
row block i of the operand). Anything else stays a gather. Exact: the same rows are read or
summed (a scatter-add into a nonzero operand adds the summed rows to it).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import jax
import jax.extend.core
import numpy as np
from jax import lax

from .fold import spliced
from .shift import drop_dead, shift_p

try:  # jax >= 0.11: a scan's operand groups as a flat tree (`ft_in`), built with these
    from jax._src import flattree as _flattree
    if not all(hasattr(_flattree, n) for n in ("pack", "nones")):
        _flattree = None
except ImportError:  # (jax 0.10 counts them in params)
    _flattree = None

_MAX_INDEX = 1 << 16  # an index longer than this is not worth evaluating at trace time
_LOOPS = ("scan", "while", "cond")


def _int_div(a, b):
    q = np.abs(a) // np.abs(b)  # lax.div on integers rounds toward zero
    return np.where((a < 0) != (b < 0), -q, q)


def _div(a, b):
    return _int_div(a, b) if np.issubdtype(a.dtype, np.integer) else np.divide(a, b)


def _broadcast_in_dim(x, *, shape, broadcast_dimensions, **_):
    expanded = np.reshape(x, [x.shape[broadcast_dimensions.index(d)] if d in broadcast_dimensions
                              else 1 for d in range(len(shape))])
    return np.broadcast_to(expanded, shape)


def _shift(x, *fill, dim, shift, lo, hi):
    """numpy's autoshard_shift (shift.py): rows rolled by `shift`, those outside [lo, hi) fill."""
    out = np.roll(x, -(shift % x.shape[dim]), axis=dim)
    rows = np.arange(x.shape[dim]).reshape([-1 if d == dim else 1 for d in range(x.ndim)])
    return np.where((rows >= lo) & (rows < hi), out, fill[0]) if fill else out


def _cumsum(x, *, axis, reverse):
    if not np.issubdtype(x.dtype, np.integer):
        raise ValueError("a float sum's rounding depends on XLA's order")
    flip = (lambda a: np.flip(a, axis)) if reverse else (lambda a: a)
    return flip(np.cumsum(flip(x), axis=axis, dtype=x.dtype))


def _scatter_1d(combine):
    """A scatter into a 1-d operand at single indices (jnp.repeat's `total_repeat_length`
    builds its index with two); anything else, a dropped duplicate's order, is left unknown."""
    def scatter(operand, indices, updates, *, dimension_numbers, mode, **_):
        dn = dimension_numbers
        if (operand.ndim != 1 or dn.update_window_dims or tuple(dn.inserted_window_dims) != (0,)
                or tuple(dn.scatter_dims_to_operand_dims) != (0,) or dn.operand_batching_dims
                or indices.shape[-1:] != (1,) or updates.size != indices.size):
            raise ValueError("not a scatter of single elements into a vector")
        at, values = indices.reshape(-1).astype(np.int64), updates.reshape(-1)
        inside = (at >= 0) & (at < operand.shape[0])
        if not inside.all() and mode != lax.GatherScatterMode.FILL_OR_DROP:
            raise ValueError("an out-of-bounds index clamped or promised away")
        at, values, out = at[inside], values[inside], operand.copy()
        if combine is None:
            if len(set(at.tolist())) != len(at):
                raise ValueError("which duplicate wins is XLA's choice")
            out[at] = values
        else:
            combine(out, at, values)
        return out
    return scatter


# What an index computation is made of (jnp.arange, //, %, the wrap of negative indices,
# jax.image's float arithmetic; the scatters, roll and cumsums jnp.repeat builds an index with
# for a `total_repeat_length`), as numpy: IEEE-exact operations only (integer sums), so the
# values are the ones the program computes. A primitive not here leaves its result unknown.
_ELEMENTWISE: dict = {
    lax.add_p: np.add, lax.sub_p: np.subtract, lax.mul_p: np.multiply, lax.div_p: _div,
    lax.rem_p: np.fmod, lax.neg_p: np.negative, lax.abs_p: np.abs, lax.sign_p: np.sign,
    lax.floor_p: np.floor, lax.ceil_p: np.ceil, lax.max_p: np.maximum, lax.min_p: np.minimum,
    lax.lt_p: np.less, lax.le_p: np.less_equal, lax.gt_p: np.greater,
    lax.ge_p: np.greater_equal, lax.eq_p: np.equal, lax.ne_p: np.not_equal,
    lax.and_p: np.bitwise_and, lax.or_p: np.bitwise_or, lax.not_p: np.invert,
    lax.select_n_p: lambda which, *cases: np.choose(which.astype(np.int32), cases),
    lax.clamp_p: lambda lo, x, hi: np.clip(x, lo, hi),
}  # their params (an accuracy, a result sharding) do not change an exact result
_NUMPY: dict = {
    **{p: (lambda f: lambda *args, **_: f(*args))(f) for p, f in _ELEMENTWISE.items()},
    lax.iota_p: lambda *, dtype, shape, dimension, **_: np.broadcast_to(
        np.arange(shape[dimension]).reshape([-1 if d == dimension else 1
                                             for d in range(len(shape))]), shape).astype(dtype),
    lax.convert_element_type_p: lambda x, *, new_dtype, **_: x.astype(new_dtype),
    lax.broadcast_in_dim_p: _broadcast_in_dim,
    lax.reshape_p: lambda x, *, new_sizes, dimensions, **_: np.reshape(
        x if dimensions is None else np.transpose(x, dimensions), new_sizes),
    lax.slice_p: lambda x, *, start_indices, limit_indices, strides, **_: x[tuple(
        slice(lo, hi, step) for lo, hi, step in zip(start_indices, limit_indices,
                                                    strides or [1] * x.ndim))],
    lax.concatenate_p: lambda *xs, dimension, **_: np.concatenate(xs, axis=dimension),
    lax.cumsum_p: _cumsum,
    lax.scatter_p: _scatter_1d(None),
    lax.scatter_add_p: _scatter_1d(np.add.at),
    shift_p: _shift,
}


class _Constants:
    """The values of small computed constants, found by walking back to literals."""

    def __init__(self, made_by: dict):
        self.made_by, self.memo = made_by, {}

    def __call__(self, v) -> np.ndarray | None:
        if v.is_const:
            # in the value's own dtype: a Python float literal would make numpy work in f64
            return None if v.const is None else np.asarray(v.const, dtype=v.dtype)
        if v in self.memo:
            return self.memo[v]
        self.memo[v] = None  # (a cycle cannot happen in SSA; this also bounds the work)
        e = self.made_by.get(v)
        fn = None if e is None else _NUMPY.get(e.primitive)
        if fn is None or len(e.outputs) != 1 or np.prod(v.shape, dtype=np.int64) > _MAX_INDEX:
            return None
        args = [self(u) for u in e.inputs]
        if any(a is None for a in args):
            return None
        try:
            # a division by zero, a NaN cast to an integer, an overflow: XLA's answer is its
            # own, so the value is left unknown rather than guessed
            with np.errstate(all="raise"):
                value = np.asarray(fn(*args, **e.params)).astype(v.dtype)
        except (FloatingPointError, ValueError, OverflowError):
            return None
        if value.shape != v.shape:
            return None
        self.memo[v] = value
        return value


def known_constant(v, made_by: dict) -> np.ndarray | None:
    """`v`'s value where the program computes it from literals alone (small integer
    arithmetic), else None."""
    return _Constants(made_by)(v)


def _pattern(index: np.ndarray, rows: int) -> tuple | None:
    """('repeat', r) for i // r; ('every', lo, k) for lo + k i with 0 <= lo < k and k times
    as many rows as indices; None for any other index into a dim of `rows` rows."""
    n = index.shape[0]
    steps = np.arange(n)
    if n > rows and n % rows == 0 and np.array_equal(index, steps // (n // rows)):
        return ("repeat", n // rows)
    if n >= 2:
        lo, k = int(index[0]), int(index[1]) - int(index[0])
        if 0 <= lo < k and n * k == rows and np.array_equal(index, lo + k * steps):
            return ("every", lo, k)
    return None


def _one_dim(operand_shape, index_shape, window_dims, inserted, to_operand, batching,
             sizes=None) -> int | None:
    """The dim d of a gather / scatter along one dim by a [n, 1] index whose result (updates)
    is the operand with dim d replaced by the n indexed rows, in place; else None."""
    rank = len(operand_shape)
    if len(index_shape) != 2 or index_shape[1] != 1 or batching or len(inserted) != 1:
        return None
    d = inserted[0]
    if tuple(to_operand) != (d,) or tuple(window_dims) != tuple(i for i in range(rank) if i != d):
        return None
    if sizes is not None and tuple(sizes) != tuple(1 if i == d else s
                                                   for i, s in enumerate(operand_shape)):
        return None
    return d


def _gather_dim(e) -> int | None:
    dn = e.params["dimension_numbers"]
    return _one_dim(e.inputs[0].shape, e.inputs[1].shape, dn.offset_dims,
                    dn.collapsed_slice_dims, dn.start_index_map, dn.operand_batching_dims,
                    e.params["slice_sizes"])


def _scatter_dim(e) -> int | None:
    if len(e.inputs) != 3 or e.inputs[0].dtype == np.bool_:
        return None
    dn = e.params["dimension_numbers"]
    return _one_dim(e.inputs[0].shape, e.inputs[1].shape, dn.update_window_dims,
                    dn.inserted_window_dims, dn.scatter_dims_to_operand_dims,
                    dn.operand_batching_dims)


def _zeros(v, made_by: dict, known: _Constants) -> bool:
    """Whether `v` is all zeros: a constant, or a constant scalar broadcast (a gradient's
    scatter-add starts from one)."""
    e = made_by.get(v)
    if e is not None and e.primitive is lax.broadcast_in_dim_p and len(e.inputs) == 1:
        v = e.inputs[0]
    c = known(v)
    return c is not None and not np.any(c)


def _gather_as(shape: tuple, d: int, pattern: tuple) -> Callable:
    if pattern[0] == "repeat":
        r = pattern[1]
        wide = shape[:d + 1] + (r,) + shape[d + 1:]
        out = shape[:d] + (shape[d] * r,) + shape[d + 1:]
        keep = tuple(i if i <= d else i + 1 for i in range(len(shape)))
        return lambda x: lax.reshape(lax.broadcast_in_dim(x, wide, keep), out)
    _, lo, k = pattern
    starts = tuple(lo if i == d else 0 for i in range(len(shape)))
    strides = tuple(k if i == d else 1 for i in range(len(shape)))
    return lambda x: lax.slice(x, starts, shape, strides)


def _scatter_add_as(shape: tuple, d: int, pattern: tuple, into_zeros: bool) -> Callable:
    if pattern[0] == "repeat":
        r = pattern[1]
        parts = shape[:d] + (shape[d], r) + shape[d + 1:]

        def summed(u):
            return lax.reduce_sum_p.bind(lax.reshape(u, parts), axes=(d + 1,), out_sharding=None)
    else:
        _, lo, k = pattern
        n = shape[d] // k

        def summed(u):
            config = [(0, 0, 0)] * len(shape)
            config[d] = (lo, shape[d] - lo - (n - 1) * k - 1, k - 1)
            return lax.pad(u, np.zeros((), u.dtype), config)
    if into_zeros:
        return lambda operand, u: summed(u)
    return lambda operand, u: lax.add(operand, summed(u))


def _closed_with(closed, sunk: dict):
    """`closed` (a ClosedJaxpr) with the invars at the positions in `sunk` made constants of
    the values there."""
    jaxpr = closed.jaxpr
    keep = [v for i, v in enumerate(jaxpr.invars) if i not in sunk]
    moved = [jaxpr.invars[i] for i in sorted(sunk)]
    inner = jaxpr.replace(constvars=[*jaxpr.constvars, *moved], invars=keep)
    return jax.extend.core.ClosedJaxpr(inner, [*closed.consts, *(sunk[i] for i in sorted(sunk))])


def _is_int(v) -> bool:
    # (a PRNG key's dtype is no numpy dtype)
    return isinstance(v.dtype, np.dtype) and np.issubdtype(v.dtype, np.integer)


def _invariant_operands(e) -> range:
    """The positions of the operands of loop / branch `e` that every iteration or branch
    reads as they are: a scan's consts, a while's cond and body consts, a cond's operands."""
    from .control_flow import scan_counts  # (control_flow imports trace, which imports this)

    p, name = e.params, e.primitive.name
    if name == "scan" and ("num_consts" in p or _flattree is not None):
        return range(scan_counts(p, len(e.inputs))[0])
    if name == "while":
        return range(p["cond_nconsts"] + p["body_nconsts"])
    if name == "cond":
        return range(1, len(e.inputs))  # the branch index stays an operand
    return range(0)


def _sunk_params(e, sunk: dict) -> dict:
    """The params of loop / branch `e` with its invariant operands at positions `sunk`
    (position → value) made constants of its bodies."""
    p, name = dict(e.params), e.primitive.name
    if name == "scan":
        p["jaxpr"] = _closed_with(p["jaxpr"], sunk)
        if "num_consts" in p:
            p["num_consts"] -= len(sunk)
        else:  # jax >= 0.11 keeps the operand groups as a flat tree: (consts, carries, xs)
            from .control_flow import scan_counts

            consts = scan_counts(p, len(e.inputs))[0]
            _, carries, xs = p["ft_in"].unpack()
            p["ft_in"] = _flattree.pack((_flattree.nones(consts - len(sunk)), carries, xs))
        if "linear" in p:  # (older jax's per-operand flags)
            p["linear"] = tuple(x for i, x in enumerate(p["linear"]) if i not in sunk)
    elif name == "while":
        cn = p["cond_nconsts"]
        p["cond_jaxpr"] = _closed_with(p["cond_jaxpr"], {i: x for i, x in sunk.items() if i < cn})
        p["body_jaxpr"] = _closed_with(p["body_jaxpr"],
                                       {i - cn: x for i, x in sunk.items() if i >= cn})
        p["cond_nconsts"] = cn - sum(i < cn for i in sunk)
        p["body_nconsts"] -= sum(i >= cn for i in sunk)
    else:
        p["branches"] = tuple(
            _closed_with(b, {i - 1: x[j] if isinstance(x, _PerBranch) else x
                             for i, x in sunk.items()})
            for j, b in enumerate(p["branches"]))
    return p


class _PerBranch(tuple):
    """A cond operand's value in each of its branches."""


def _reads(closed, k: int) -> bool:
    v = closed.jaxpr.invars[k]
    return any(v is a for e in closed.jaxpr.eqns for a in e.invars) or \
        any(v is a for a in closed.jaxpr.outvars)


def _residual_per_branch(e, i: int, made_by: dict) -> _PerBranch | None:
    """The value of operand i of cond `e` in each of its branches, where it is an output of
    an earlier cond on the same branch index (a differentiated cond's residual: the backward
    cond takes branch j exactly when the forward one took branch j) and each branch of `e`
    that reads it finds a constant there: a gather's index computed in the forward branch."""
    from .trace import build_program

    fwd, v = made_by.get(e.inputs[i]), e.inputs[i]
    if fwd is None or fwd.primitive.name != "cond" or fwd.inputs[0] is not e.inputs[0] \
            or len(fwd.params["branches"]) != len(e.params["branches"]):
        return None
    k = fwd.outputs.index(v)
    values = []
    for forward, branch in zip(fwd.params["branches"], e.params["branches"]):
        if not _reads(branch, i - 1):  # this branch never looks at it
            values.append(np.zeros(v.shape, v.dtype))
            continue
        program = build_program(forward)
        value = _Constants({u: q for q in program.eqns for u in q.outputs})(program.outputs[k])
        if value is None:
            return None
        values.append(value)
    return _PerBranch(values)


def _sink_into_bodies(loops: list, known: _Constants, params_key: Callable) -> dict:
    """{id(e): [e']} for each scan / while / cond `e` handed a small computed integer
    constant as an invariant operand — a gather's index, which jax hoists out of a
    differentiated scan or fori_loop, and which a differentiated cond's forward branch
    hands its backward branch as a residual — with that constant made one of its bodies':
    the body's gathers are then rewritten knowing their index."""
    from .trace import Eqn

    def value(e, i: int):
        if not _is_int(e.inputs[i]):
            return None
        found = known(e.inputs[i])
        if found is None and e.primitive.name == "cond":
            found = _residual_per_branch(e, i, known.made_by)
        return found

    made: dict = {}
    for e in loops:
        sunk = {i: x for i in _invariant_operands(e) if (x := value(e, i)) is not None}
        if sunk:
            params = _sunk_params(e, sunk)
            ins = [v for i, v in enumerate(e.inputs) if i not in sunk]
            made[id(e)] = [Eqn(e.primitive, ins, e.outputs, params, e.where,
                               params_key=params_key(params))]
    return made


def constant_gathers(eqns: list, outputs: list, regions: list, fresh: Callable[[Any], Any],
                     constant: Callable[[Any, Any], Any]) -> list:
    """`eqns` with each one-dim gather / scatter-add by a constant repeat or every-k-th-row
    index made the equations that say so (see the module's docstring), and such an index
    handed to a loop or branch as an operand made a constant of its body (where it is
    rewritten alike, when the body is built); the index computations left unread are
    dropped. `fresh(aval)` makes a value, `constant(value, aval)` a constant."""
    from .trace import Eqn, params_key

    gather, scatter_add = lax.gather_p, lax.scatter_add_p
    candidates = [(e, _gather_dim(e) if e.primitive is gather else _scatter_dim(e))
                  for e in eqns if e.primitive is gather or e.primitive is scatter_add]
    candidates = [(e, d) for e, d in candidates if d is not None]
    loops = [e for e in eqns if e.primitive.name in _LOOPS and any(map(_is_int, e.inputs))]
    if not candidates and not loops:
        return eqns  # most programs (an embedding lookup's index is no [n, 1] column)
    made_by = {v: e for e in eqns for v in e.outputs}
    known = _Constants(made_by)
    replaced = _sink_into_bodies(loops, known, params_key)
    for e, d in candidates:
        data = e.inputs[0] if e.primitive is gather else e.inputs[2]
        index = known(e.inputs[1])
        pattern = None if index is None else _pattern(index.reshape(-1), e.inputs[0].shape[d])
        if pattern is None:
            continue
        shape = tuple(e.inputs[0].shape)
        if e.primitive is gather:
            fn, args = _gather_as(shape, d, pattern), [data]
        else:
            zeros = _zeros(e.inputs[0], made_by, known)
            fn = _scatter_add_as(shape, d, pattern, zeros)
            args = [e.inputs[0], data]
        body = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(v.shape, v.dtype) for v in args])
        replaced[id(e)] = _inline(body, args, e.outputs[0], e.where, fresh, constant, Eqn,
                                  params_key)
    if not replaced:
        return eqns
    eqns = spliced(eqns, replaced, regions)
    # the index computations nothing reads any more
    pinned = {v for r in regions for v in (*r.inputs, *r.outputs)}
    return drop_dead(eqns, outputs, regions, pinned, Counter(),
                     also=frozenset(id(e) for e in eqns if e.primitive in _NUMPY))


def _inline(closed, args: list, out, where, fresh, constant, Eqn, params_key) -> list:
    """The equations of `closed` on our values `args`, its result written to `out`."""
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.invars, args))
    env.update((v, constant(c, v.aval)) for v, c in zip(jaxpr.constvars, closed.consts))
    made = []
    for k, je in enumerate(jaxpr.eqns):
        ins = [constant(a.val, a.aval) if isinstance(a, jax.extend.core.Literal) else env[a]
               for a in je.invars]
        last = k == len(jaxpr.eqns) - 1 and je.outvars[0] is jaxpr.outvars[0]
        outs = [out if last else fresh(v.aval) for v in je.outvars]
        made.append(Eqn(je.primitive, ins, outs, dict(je.params), where,
                        params_key=params_key(je.params)))
        env.update(zip(je.outvars, outs))
    if not made or made[-1].outputs[0] is not out:  # the body passes its input through
        made.append(Eqn(lax.copy_p, [env[jaxpr.outvars[0]]], [out], {}, where, params_key=()))
    return made


__all__ = ["constant_gathers", "known_constant"]
