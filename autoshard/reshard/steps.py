"""The reshard atoms: one collective (or one local op) each, with precondition and local code.

Every atom answers four questions: may it run on this Layout (`after` returns None if not — it
never raises), what Layout results, how many bytes each device sends (ring algorithms), and how
to compute it on one device's block inside `shard_map` (`run`). The planner searches over them;
the executor only calls `run` in order.
"""
from __future__ import annotations

import contextvars
import functools
import itertools
import math
from dataclasses import dataclass
from typing import ClassVar, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from ..compiler.dtypes import highest, lowest
from ..layout import Layout
from ..placement import ReduceType, mean_of_parts, narrow_float


def _axis_arg(axes: tuple[str, ...]):
    return axes[0] if len(axes) == 1 else axes


def _group_size(axes: tuple[str, ...], sizes: Mapping[str, int]) -> int:
    return math.prod(sizes[a] for a in axes)


def _linear_axis_index(axes: tuple[str, ...], sizes: Mapping[str, int]):
    index = 0
    for a in axes:
        index = index * sizes[a] + lax.axis_index(a)
    return index


def _identity(reduce_type: ReduceType, dtype) -> object:
    """The element that leaves a reduction unchanged (fills the slots a device does not own)."""
    if reduce_type in (ReduceType.SUM, ReduceType.AVG):
        return 0
    return lowest(dtype) if reduce_type is ReduceType.MAX else highest(dtype)


def varying_axes(x) -> frozenset:
    """The manual mesh axes a value (or an abstract value) varies over."""
    aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.10 keeps it on the aval's manual-axis type
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _can_add_partial(layout: Layout, reduce_type: ReduceType) -> bool:
    """Partial kinds may only mix when all are linear (sum, avg); see Layout."""
    kinds = {t for _, t in layout.partial} | {reduce_type}
    return len(kinds) == 1 or kinds <= {ReduceType.SUM, ReduceType.AVG}


def ensure_varying(x, axes) -> object:
    """`x` cast to vary over at least `axes` (the type check_vma expects for a value split or
    partial over them)."""
    if not axes:  # (most results of a partitioned program's bound equations)
        return x
    varying = varying_axes(x)
    missing = tuple(sorted(a for a in axes if a not in varying))
    return lax.pcast(x, missing, to="varying") if missing else x


@dataclass(frozen=True)
class Step:
    """Base of the atoms. `hlo` is the HLO op the step compiles to (None for local steps)."""

    kind: ClassVar[str] = ""
    hlo: ClassVar[str | None] = None

    @property
    def axes(self) -> tuple[str, ...]:
        raise NotImplementedError

    def after(self, layout: Layout, shape: tuple[int, ...], sizes: Mapping[str, int]) -> Layout | None:
        raise NotImplementedError

    def wire_bytes(self, in_bytes: int, out_bytes: int, sizes: Mapping[str, int]) -> float:
        return 0.0

    def run(self, x, sizes: Mapping[str, int]):
        raise NotImplementedError

    @property
    def is_collective(self) -> bool:
        return self.hlo is not None


@dataclass(frozen=True)
class AllGather(Step):
    """S→R: gather the minor-most `gathered` axes of tensor dim `dim`."""

    gathered: tuple[str, ...]
    dim: int
    kind: ClassVar[str] = "all_gather"
    hlo: ClassVar[str] = "all-gather"

    @property
    def axes(self):
        return self.gathered

    def after(self, layout, shape, sizes):
        axes = layout.dims[self.dim]
        k = len(self.gathered)
        if k == 0 or axes[len(axes) - k:] != self.gathered:
            return None
        return layout.with_dim(self.dim, axes[:len(axes) - k])

    def wire_bytes(self, in_bytes, out_bytes, sizes):
        n = _group_size(self.gathered, sizes)
        return out_bytes * (n - 1) / n

    def run(self, x, sizes):
        return lax.all_gather(x, _axis_arg(self.gathered), axis=self.dim, tiled=True, to="invarying")

    def __str__(self):
        return f"all_gather({','.join(self.gathered)}) dim {self.dim}"


@dataclass(frozen=True)
class GatherUneven(Step):
    """A dim stored padded (its devices do not divide it, uneven.py) gathered whole over all
    its axes, the padding cut off: the way into the even layouts programs compute with."""

    gathered: tuple[str, ...]
    dim: int
    size: int  # the dim's logical size
    kind: ClassVar[str] = "gather_uneven"
    hlo: ClassVar[str] = "all-gather"

    @property
    def axes(self):
        return self.gathered

    def after(self, layout, shape, sizes):
        if layout.dims[self.dim] != self.gathered:
            return None
        return layout.with_dim(self.dim, ())

    def run(self, x, sizes):
        x = lax.all_gather(x, _axis_arg(self.gathered), axis=self.dim, tiled=True,
                           to="invarying")
        return lax.slice_in_dim(x, 0, self.size, axis=self.dim)

    def __str__(self):
        return f"all_gather({','.join(self.gathered)}) dim {self.dim} (uneven, {self.size})"


@dataclass(frozen=True)
class SplitUneven(Step):
    """A whole dim stored split over devices that do not divide it: padded with zeros to a
    multiple of them, each device keeps its block of ceil(size / devices) rows (no
    communication)."""

    split: tuple[str, ...]
    dim: int
    size: int
    kind: ClassVar[str] = "split_uneven"

    @property
    def axes(self):
        return self.split

    def after(self, layout, shape, sizes):
        if layout.dims[self.dim]:
            return None
        return layout.with_dim(self.dim, self.split)

    def run(self, x, sizes):
        n = _group_size(self.split, sizes)
        step = -(-self.size // n)
        widths = [(0, 0, 0)] * x.ndim
        widths[self.dim] = (0, step * n - self.size, 0)
        x = ensure_varying(lax.pad(x, np.zeros((), x.dtype), widths), self.split)
        start = lax.mul(_linear_axis_index(self.split, sizes), np.int32(step))
        return lax.dynamic_slice_in_dim(x, start, step, axis=self.dim)

    def __str__(self):
        return f"split({','.join(self.split)}) dim {self.dim} (uneven, {self.size})"


# Whether the program being traced may be differentiated by jax afterwards (a dist.jit call
# under jax.grad / vjp / an outer jit). A program called at the top level is only run: its max
# and min all-reduces need no derivative, and without the custom_jvp (whose traced rule is a
# Python callable, so that its lowering is traced afresh for every program) the lowering is
# plain equations, shared between programs like every other step's (partition.py sets it).
DIFFERENTIABLE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "autoshard_differentiable", default=True)


def _differentiable_choice(choose, x, axes):
    """pmax / pmin of `x` over `axes`, with a derivative (jax defines none for them, and a
    partitioned program is differentiated when jax.grad is taken outside dist.jit): the tangent
    of the device(s) holding the chosen value, split evenly among them as jax splits a max's
    gradient among ties. (Ties within one device's block were already split by its local
    reduction, so exact ties held unevenly across devices are weighted per device.)"""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return choose(x, axes)
    if not DIFFERENTIABLE.get():
        return _ordered_choice(choose, x, axes)
    return _chooser(choose, axes)(x)


def _ordered_choice(choose, x, axes):
    """pmax / pmin of floats `x` as one device's jnp.max / jnp.min gives them: NaN wins.
    XLA's all-reduce max drops a NaN (on CPU, jax.jit(jnp.max) of a split array holding one
    returns a number), so the devices reduce integer keys ordered as the floats are, NaN above
    (max) or below (min) every number, and the chosen key is turned back into its float. One
    collective of the same bytes; the key is an elementwise bit flip on each side."""
    if np.dtype(x.dtype).itemsize < 2:
        # float8 and 4-bit floats: chosen as float32, which holds each of their values (NaN
        # too) exactly. Their own bits cannot serve as keys: a 4-bit float has no integer of
        # its width to view it as, and in the fnuz kinds (no -0, NaN at 0x80) the NaN marker
        # below would read back as their largest finite number.
        wide = _ordered_choice(choose, lax.convert_element_type(x, np.float32), axes)
        return lax.convert_element_type(wide, x.dtype)
    ints = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[np.dtype(x.dtype).itemsize]
    flip = np.array(np.iinfo(ints).max, ints)
    zero = np.array(0, ints)
    # (lax, not jnp: a layer's every softmax emits this, and jnp's checks and jitted helpers
    # cost more to trace than the few equations they make)
    bits = lax.bitcast_convert_type(x, ints)
    # a negative float's bits, read as a signed integer, order backwards: flip its magnitude
    key = lax.select(lax.lt(bits, zero), lax.bitwise_xor(bits, flip), bits)
    nan = np.iinfo(ints).max if choose is lax.pmax else np.iinfo(ints).min
    key = choose(lax.select(lax.ne(x, x), lax.full_like(key, nan), key), axes)
    return lax.bitcast_convert_type(
        lax.select(lax.lt(key, zero), lax.bitwise_xor(key, flip), key), x.dtype)


@functools.lru_cache(maxsize=None)
def _chooser(choose, axes):
    """One differentiable pmax / pmin per (reduction, axes), made once (a layer's every max
    reuses it)."""
    @jax.custom_jvp
    def chosen(x):
        return _ordered_choice(choose, x, axes)

    @chosen.defjvp
    def chosen_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        m = chosen(x)  # itself, so that derivatives of any order exist (a Hessian-vector product)
        holds = lax.convert_element_type(lax.eq(x, lax.pcast(m, axes, to="varying")), t.dtype)
        return m, lax.psum(t * holds, axes) / lax.psum(holds, axes)

    return chosen


@dataclass(frozen=True)
class AllReduce(Step):
    """P→R: reduce the partial values over `reduced` axes (psum / pmean / pmax / pmin)."""

    reduced: tuple[str, ...]
    reduce_type: ReduceType
    kind: ClassVar[str] = "all_reduce"
    hlo: ClassVar[str] = "all-reduce"

    @property
    def axes(self):
        return self.reduced

    def after(self, layout, shape, sizes):
        partial = layout.partial_map
        if not self.reduced or any(partial.get(a) is not self.reduce_type for a in self.reduced):
            return None
        return layout.with_partial({a: t for a, t in partial.items() if a not in self.reduced})

    def wire_bytes(self, in_bytes, out_bytes, sizes):
        n = _group_size(self.reduced, sizes)
        return 2 * in_bytes * (n - 1) / n

    def run(self, x, sizes):
        axes = _axis_arg(self.reduced)
        if x.dtype == jnp.bool_ and self.reduce_type in (ReduceType.SUM, ReduceType.AVG):
            return lax.pmax(x, axes)  # a sum (or mean) of truth values, read as one, is their or
        if self.reduce_type is ReduceType.SUM:
            return lax.psum(x, axes)
        if self.reduce_type is ReduceType.MAX:
            return _differentiable_choice(lax.pmax, x, axes)
        if self.reduce_type is ReduceType.MIN:
            return _differentiable_choice(lax.pmin, x, axes)
        return mean_of_parts(x, _group_size(self.reduced, sizes),
                             lambda v: lax.psum(v, axes), jnp.int32)

    def __str__(self):
        op = {"sum": "psum", "avg": "pmean", "max": "pmax", "min": "pmin"}[self.reduce_type.value]
        return f"{op}({','.join(self.reduced)})"


@dataclass(frozen=True)
class ReduceScatter(Step):
    """P→S: reduce partial sums over `reduced` axes and keep only this device's slice of `dim`."""

    reduced: tuple[str, ...]
    dim: int
    reduce_type: ReduceType
    kind: ClassVar[str] = "reduce_scatter"
    hlo: ClassVar[str] = "reduce-scatter"

    @property
    def axes(self):
        return self.reduced

    def after(self, layout, shape, sizes):
        partial = layout.partial_map
        if self.reduce_type not in (ReduceType.SUM, ReduceType.AVG):
            return None
        if not self.reduced or any(partial.get(a) is not self.reduce_type for a in self.reduced):
            return None
        if layout.local_shape(shape, sizes)[self.dim] % _group_size(self.reduced, sizes):
            return None
        rest = {a: t for a, t in partial.items() if a not in self.reduced}
        dims = list(layout.dims)
        dims[self.dim] = dims[self.dim] + self.reduced
        return Layout(tuple(dims), tuple(rest.items()))

    def wire_bytes(self, in_bytes, out_bytes, sizes):
        n = _group_size(self.reduced, sizes)
        return in_bytes * (n - 1) / n

    def run(self, x, sizes):
        if x.dtype == jnp.bool_:  # jax sums no truth values: count them, any count is true
            y = lax.psum_scatter(x.astype(jnp.int32), _axis_arg(self.reduced),
                                 scatter_dimension=self.dim, tiled=True)
            return y != 0
        def total(v):
            return lax.psum_scatter(v, _axis_arg(self.reduced), scatter_dimension=self.dim,
                                    tiled=True)

        if self.reduce_type is ReduceType.AVG:
            return mean_of_parts(x, _group_size(self.reduced, sizes), total, jnp.int32)
        return total(x)

    def __str__(self):
        op = "psum_scatter" if self.reduce_type is ReduceType.SUM else "pmean_scatter"
        return f"{op}({','.join(self.reduced)}) dim {self.dim}"


def widened_mean(step: Step, dtype) -> bool:
    """Whether `step` on values of `dtype` sums its parts in float32: a mean of float16 (or
    float8) parts (`placement.mean_of_parts`), its collective twice (or four times) the bytes."""
    return (type(step) in (AllReduce, ReduceScatter) and step.reduce_type is ReduceType.AVG
            and narrow_float(dtype))


def remainder_sum(step: Step, dtype) -> bool:
    """Whether `step` on values of `dtype` runs a second collective: the mean of integer parts
    sums their remainders apart, in int32 (`mean_of_parts`)."""
    return (type(step) in (AllReduce, ReduceScatter) and step.reduce_type is ReduceType.AVG
            and jax.dtypes.issubdtype(dtype, np.integer))  # (int4: numpy's does not know it)


@dataclass(frozen=True)
class AllToAll(Step):
    """S(a)→S(b): move the mesh axes `moved` — the minor-most of tensor dim `src_dim`'s, in
    their order — to the minor end of `dst_dim`'s (a dim split over two axes moves as one
    collective over both: one all-to-all of the block, not a gather and another all-to-all)."""

    moved: tuple[str, ...]
    src_dim: int
    dst_dim: int
    kind: ClassVar[str] = "all_to_all"
    hlo: ClassVar[str] = "all-to-all"

    @property
    def axes(self):
        return self.moved

    def after(self, layout, shape, sizes):
        src, k = layout.dims[self.src_dim], len(self.moved)
        if self.src_dim == self.dst_dim or tuple(src[len(src) - k:]) != self.moved:
            return None
        if layout.local_shape(shape, sizes)[self.dst_dim] % _group_size(self.moved, sizes):
            return None
        moved = layout.with_dim(self.src_dim, src[:len(src) - k])
        return moved.with_dim(self.dst_dim, moved.dims[self.dst_dim] + self.moved)

    def wire_bytes(self, in_bytes, out_bytes, sizes):
        n = _group_size(self.moved, sizes)
        return in_bytes * (n - 1) / n

    def run(self, x, sizes):
        # the split dim first: XLA on CPU cuts an all-to-all into one operand per block along
        # it, and its simplifier once handed over a block of a minor split transposed in
        # memory, which its verifier refused (jax.grad around dist.jit; test_properties).
        # Its operand goes through an optimization barrier: XLA's CSE after layout assignment
        # merged a block's slice with the program's own slice of the same rows in another
        # layout, which the verifier refused too (found by the explore profile). Over several
        # axes the blocks go in the order of the axes as listed, the first major (jax's
        # linear index of an axis group), as the dims' own axes split them.
        axis = _axis_arg(self.moved)
        if self.dst_dim == 0:
            return lax.all_to_all(lax.optimization_barrier(x), axis, split_axis=0,
                                  concat_axis=self.src_dim, tiled=True)
        perm = (self.dst_dim, *(d for d in range(x.ndim) if d != self.dst_dim))
        y = lax.all_to_all(lax.optimization_barrier(lax.transpose(x, perm)), axis, split_axis=0,
                           concat_axis=perm.index(self.src_dim), tiled=True)
        return lax.transpose(y, tuple(perm.index(d) for d in range(x.ndim)))

    def __str__(self):
        return f"all_to_all({', '.join(self.moved)}) dim {self.src_dim}→{self.dst_dim}"


@dataclass(frozen=True)
class LocalSlice(Step):
    """R→S: keep this device's slice of `dim` along an unused mesh axis (no communication)."""

    axis: str
    dim: int
    kind: ClassVar[str] = "slice"

    @property
    def axes(self):
        return (self.axis,)

    def after(self, layout, shape, sizes):
        # A partial axis is never used to slice: that would drop other devices' contributions.
        if self.axis in layout.used_axes:
            return None
        if layout.local_shape(shape, sizes)[self.dim] % sizes[self.axis]:
            return None
        return layout.with_dim(self.dim, layout.dims[self.dim] + (self.axis,))

    def run(self, x, sizes):
        size = x.shape[self.dim] // sizes[self.axis]
        return lax.dynamic_slice_in_dim(x, lax.axis_index(self.axis) * size, size, axis=self.dim)

    def __str__(self):
        return f"slice({self.axis}) dim {self.dim}"


@dataclass(frozen=True)
class MakePartial(Step):
    """R→P: a replicated value becomes partial without communication.

    For sum, the device at index 0 keeps the value and the others hold zeros; for avg, max and
    min every device keeps the value (their reduction is the value itself).
    """

    axis: str
    reduce_type: ReduceType
    kind: ClassVar[str] = "to_partial"

    @property
    def axes(self):
        return (self.axis,)

    def after(self, layout, shape, sizes):
        if self.axis in layout.used_axes or not _can_add_partial(layout, self.reduce_type):
            return None
        return layout.with_partial({**layout.partial_map, self.axis: self.reduce_type})

    def run(self, x, sizes):
        if self.reduce_type is ReduceType.SUM:
            # lax, not jnp.where: no jitted call under tracing
            x = ensure_varying(x, (self.axis,))
            first = lax.eq(lax.axis_index(self.axis), np.int32(0))
            first = ensure_varying(lax.broadcast(first, x.shape), varying_axes(x))
            return lax.select(first, x, lax.full_like(x, 0))
        return ensure_varying(x, (self.axis,))

    def __str__(self):
        return f"to_partial({self.axis}, {self.reduce_type.value})"


@dataclass(frozen=True)
class ShardToPartial(Step):
    """S→P: each device places its block in an identity-filled full dim (no communication)."""

    axis: str
    dim: int
    reduce_type: ReduceType
    kind: ClassVar[str] = "shard_to_partial"

    @property
    def axes(self):
        return (self.axis,)

    def after(self, layout, shape, sizes):
        axes = layout.dims[self.dim]
        if not axes or axes[-1] != self.axis or not _can_add_partial(layout, self.reduce_type):
            return None
        moved = layout.with_dim(self.dim, axes[:-1])
        return moved.with_partial({**moved.partial_map, self.axis: self.reduce_type})

    def run(self, x, sizes):
        n = sizes[self.axis]
        size = x.shape[self.dim]
        full_shape = x.shape[:self.dim] + (size * n,) + x.shape[self.dim + 1:]
        fill = jnp.full(full_shape, _identity(self.reduce_type, x.dtype), x.dtype)
        if self.reduce_type is ReduceType.AVG:
            x = x * jnp.asarray(n, x.dtype)  # the mean over n devices divides it back
        return lax.dynamic_update_slice_in_dim(fill, x, lax.axis_index(self.axis) * size, self.dim)

    def __str__(self):
        return f"shard_to_partial({self.axis}, {self.reduce_type.value}) dim {self.dim}"


# ------------------------------------------------------------------------ re-tiling by permute
# A value whose copies along some mesh axes agree, typed invarying over them (no communication).
# A permute's result varies over every axis it ran across, although where the target layout is
# replicated over one of them (rows split over dp moved to mp: [S(0), R] → [R, S(0)]) every
# device of a dp-group received the same block; jax has no cast from varying to invarying
# (only collectives: a psum, an all-gather to="invarying"), and shard_map's check_vma rejects
# a varying value for a replicated out_spec. As a linear map it reads the copy of the devices at
# index 0 along `axes` (the others equal it): its transpose puts the cotangent there.
agreed_p = jex_core.Primitive("autoshard_agreed")
agreed_p.def_impl(lambda x, *, axes: x)


def _agreed_abstract(aval, *, axes):
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return aval.update(manual_axis_type=mat.update(varying=mat.varying - frozenset(axes)))
    return aval.update(vma=frozenset(aval.vma) - frozenset(axes))  # (jax before 0.10)


def _agreed_transpose(ct, x, *, axes):
    ct = lax.pcast(ct, axes, to="varying")
    first = functools.reduce(lax.bitwise_and, [lax.eq(lax.axis_index(a), np.int32(0))
                                                for a in axes])
    first = ensure_varying(lax.broadcast(first, ct.shape), varying_axes(ct))
    return [lax.select(first, ct, lax.full_like(ct, 0))]


agreed_p.def_abstract_eval(_agreed_abstract)
ad.deflinear2(agreed_p, _agreed_transpose)
batching.primitive_batchers[agreed_p] = lambda args, dims, *, axes: (
    agreed_p.bind(args[0], axes=axes), dims[0])
mlir.register_lowering(agreed_p, lambda ctx, x, *, axes: [x])


def agreed(x, axes):
    """`x` typed invarying over those of `axes` it varies over: its copies along them agree."""
    axes = tuple(sorted(a for a in axes if a in varying_axes(x)))
    return agreed_p.bind(x, axes=axes) if axes else x


class Round(NamedTuple):
    """One collective permute of a re-tiling: each device sends at most one piece and
    receives at most one."""

    perm: tuple[tuple[int, int], ...]  # (sender, receiver)
    send: tuple[tuple[int, ...], ...]  # per device: the piece it slices (in pieces, per dim)
    receives: tuple[bool, ...]         # per device: whether a piece arrives
    place: tuple[tuple[int, ...], ...]  # per device: where it goes in the target block


class Retiling(NamedTuple):
    """A re-tiling over `axes` (the mesh axes either layout splits a dim over, in the mesh's
    order; a device is numbered by its linear index over them, major first: jax's numbering
    of `lax.axis_index(axes)` and of ppermute's pairs), in rounds of collective permutes.

    Along each dim one layout's blocks subdivide the other's, and the finer grid cuts the
    tensor into pieces: a source block is `split` pieces per dim, a target block `span`. A
    target block lies inside one source block (`span` all 1: one piece, a dim's split moved
    to other mesh axes) or spans several (a dim's split moved to fewer devices, or axes
    exchanged between dims of unequal splits: [S(0), S(1)] → [S(1), S(0)] on 2x4). The piece
    a device's own source block has of its target it slices (`keep`); each other piece
    arrives from a holder of its source block. Each round a device sends and receives at
    most one piece; as many rounds as the busiest device has pieces to send or to receive
    (the sends coloured as a bipartite multigraph's edges, König's bound)."""

    axes: tuple[str, ...]
    split: tuple[int, ...]
    span: tuple[int, ...]
    rounds: tuple[Round, ...]
    keeps: tuple[bool, ...]                 # per device: whether it keeps a piece of its own
    keep: tuple[tuple[int, ...], ...] | None  # per device: that piece in its source block;
    # None: the keepers' pieces are the ones they slice in the first round (no keeper sends
    # in it), one slice serving both
    keep_place: tuple[tuple[int, ...], ...]  # per device: where the kept piece goes


def _block_index(dims, position, sizes) -> tuple[int, ...]:
    out = []
    for axes in dims:
        index = 0
        for a in axes:
            index = index * sizes[a] + position[a]
        out.append(index)
    return tuple(out)


def _edge_colours(edges: list[tuple[int, int]]) -> list[int]:
    """A colour per (sender, receiver) edge such that no device sends, nor receives, twice
    in one colour, in as many colours as the busiest device has edges (a bipartite
    multigraph's edge colouring, by alternating-path swaps; deterministic)."""
    degree: dict = {}
    for u, v in edges:
        degree[("s", u)] = degree.get(("s", u), 0) + 1
        degree[("r", v)] = degree.get(("r", v), 0) + 1
    colours = max(degree.values(), default=0)
    if colours <= 1:
        return [0] * len(edges)  # one round
    at: dict = {}  # (side, device) -> {colour: edge}
    colour = [-1] * len(edges)

    def free(node):
        used = at.get(node, {})
        return next(c for c in range(colours) if c not in used)

    for e, (u, v) in enumerate(edges):
        s, r = ("s", u), ("r", v)
        a, b = free(s), free(r)
        if a in at.get(r, {}):
            # swap a and b along the path from r that starts with colour a (it cannot reach
            # s: the graph is bipartite and s lacks a), which frees a at r
            path, node, c = [], r, a
            while c in at.get(node, {}):
                f = at[node][c]
                path.append(f)
                x, y = edges[f]
                node = ("s", x) if node[0] == "r" else ("r", y)
                c = b if c == a else a
            for f in path:
                x, y = edges[f]
                del at[("s", x)][colour[f]], at[("r", y)][colour[f]]
            for f in path:
                x, y = edges[f]
                colour[f] = b if colour[f] == a else a
                at.setdefault(("s", x), {})[colour[f]] = f
                at.setdefault(("r", y), {})[colour[f]] = f
        colour[e] = a
        at.setdefault(s, {})[a] = e
        at.setdefault(r, {})[a] = e
    return colour


@functools.lru_cache(maxsize=8192)
def retiling(src: Layout, dst: Layout, sizes: tuple[tuple[str, int], ...]) -> Retiling | None:
    """The rounds of sends that turn `src` into `dst` (mesh axis sizes `sizes`, in the mesh's
    order), or None: their partial axes differ, along some dim neither layout's block count
    is a multiple of the other's, or no device needs a piece it lacks."""
    if src is dst or src.partial != dst.partial or src.ndim != dst.ndim:
        return None
    size = dict(sizes)
    used = {a for axes in src.dims + dst.dims for a in axes}
    axes = tuple(a for a, _ in sizes if a in used)
    n_src = [math.prod(size[a] for a in d) for d in src.dims]
    n_dst = [math.prod(size[a] for a in d) for d in dst.dims]
    if any(t % s and s % t for s, t in zip(n_src, n_dst)):
        return None
    split = tuple(max(s, t) // s for s, t in zip(n_src, n_dst))
    span = tuple(max(s, t) // t for s, t in zip(n_src, n_dst))
    count = math.prod(size[a] for a in axes)
    coords, holds, targets = [], [], []
    for i in range(count):
        position, rest = {}, i
        for a in reversed(axes):
            rest, position[a] = divmod(rest, size[a])
        coords.append(tuple(position[a] for a in axes))
        holds.append(_block_index(src.dims, position, size))
        targets.append(_block_index(dst.dims, position, size))
    zero = (0,) * src.ndim
    holders: dict[tuple, list[int]] = {}
    for i in range(count):
        holders.setdefault(holds[i], []).append(i)
    keeps, keep, keep_place = [False] * count, [zero] * count, [zero] * count
    wanted = []  # (receiver, source block, the piece in it, where it goes in the target)
    for i in range(count):
        for within in itertools.product(*(range(n) for n in span)):
            piece = tuple(t * n + w for t, n, w in zip(targets[i], span, within))
            block = tuple(p // n for p, n in zip(piece, split))
            offset = tuple(p % n for p, n in zip(piece, split))
            if block == holds[i]:
                keeps[i], keep[i], keep_place[i] = True, offset, within
            else:
                wanted.append((i, block, offset, within))
    if not wanted:
        return None  # nothing moves: a local slice
    keepers = {i for i in range(count) if keeps[i]}
    sends = [0] * count
    edges, pieces = [], []
    for i, block, offset, within in wanted:
        # the holder sending least so far, then one that keeps no piece of its own (it
        # slices once), then the one nearest on the mesh (fewest coordinates differ)
        j = min(holders[block], key=lambda j: (
            sends[j], j in keepers, sum(a != b for a, b in zip(coords[i], coords[j])), j))
        sends[j] += 1
        edges.append((j, i))
        pieces.append((offset, within))
    colour = _edge_colours(edges)
    rounds = []
    for c in range(max(colour) + 1):
        send, receives, place = [zero] * count, [False] * count, [zero] * count
        perm = []
        for e, (j, i) in enumerate(edges):
            if colour[e] == c:
                perm.append((j, i))
                send[j], place[i] = pieces[e]
                receives[i] = True
        rounds.append([tuple(perm), send, tuple(receives), tuple(place)])
    first_senders = {j for j, _ in rounds[0][0]}
    shared = not keepers & first_senders
    if shared:  # the keepers' pieces are what they slice in the first round
        for i in keepers:
            rounds[0][1][i] = keep[i]
    return Retiling(axes, split, span,
                    tuple(Round(perm, tuple(send), receives, place)
                          for perm, send, receives, place in rounds),
                    tuple(keeps), None if shared else tuple(keep), tuple(keep_place))


def _starts(table, index, block):
    """The offsets of row `index` of the constant `table` (one row per device, in blocks of
    shape `block`)."""
    starts = []
    for d, b in enumerate(block):
        column = np.array([row[d] * b for row in table], np.int32)
        if not column.any():
            starts.append(np.int32(0))
        else:
            starts.append(lax.dynamic_index_in_dim(column, index, keepdims=False))
    return starts


def _slice_blocks(x, table, index, block):
    """This device's block of shape `block` from `x`, at the block offsets of row `index` of
    the constant `table` (one row per device)."""
    return lax.dynamic_slice(x, _starts(table, index, block), block)


@dataclass(frozen=True)
class Retile(Step):
    """Any layout to `dst` (same partial axes) in which, along each dim, one layout's blocks
    subdivide the other's: collective permutes over `moved` (a dim's split moved to another
    mesh axis, axes exchanged between dims, a dim split finer over other axes). Each device
    slices the pieces its receivers need, the permutes deliver them, and a device that
    already holds a piece of its target slices it instead (`retiling`). One round where each
    target block lies inside one source block held by enough devices; `rounds` where target
    blocks span `pieces` pieces of several source blocks ([S(0), S(1)] → [S(1), S(0)] on
    2x4, which XLA does as an all-to-all over pairs of mp devices and a permute)."""

    src: Layout
    dst: Layout
    moved: tuple[str, ...]  # the mesh axes either layout splits a dim over, in the mesh's order
    rounds: int = 1  # collective permutes, one after another
    pieces: int = 1  # pieces per target block
    kind: ClassVar[str] = "permute"
    hlo: ClassVar[str] = "collective-permute"

    @property
    def axes(self):
        return self.moved

    def after(self, layout, shape, sizes):
        if layout is not self.src:
            return None
        plan = retiling(self.src, self.dst, tuple(sizes.items()))
        if plan is None or plan.axes != self.moved:
            return None
        for size, axes in zip(shape, self.dst.dims):
            if size % _group_size(axes, sizes):
                return None
        return self.dst

    def wire_bytes(self, in_bytes, out_bytes, sizes):
        return out_bytes * self.rounds / self.pieces  # a piece per round, from each sender

    def run(self, x, sizes):
        plan = retiling(self.src, self.dst, tuple(sizes.items()))
        piece = tuple(n // s for n, s in zip(x.shape, plan.split))
        index = _linear_axis_index(plan.axes, sizes)
        parts = []  # (value, which devices hold one, where it goes in the target block)
        if any(plan.keeps) and plan.keep is not None:
            parts.append((_slice_blocks(x, plan.keep, index, piece), plan.keeps, plan.keep_place))
        for r, rnd in enumerate(plan.rounds):
            sent = _slice_blocks(x, rnd.send, index, piece)
            if r == 0 and any(plan.keeps) and plan.keep is None:
                parts.append((sent, plan.keeps, plan.keep_place))
            parts.append((lax.ppermute(sent, _axis_arg(plan.axes), rnd.perm), rnd.receives,
                          rnd.place))
        axes = frozenset().union(*(varying_axes(v) for v, _, _ in parts))
        parts = [(ensure_varying(v, axes), held, at) for v, held, at in parts]

        def held_here(held, shape):
            held = lax.dynamic_index_in_dim(np.array(held), index, keepdims=False)
            return ensure_varying(lax.broadcast(held, shape), axes)

        if all(n == 1 for n in plan.span):  # one piece per target block: pick the one held
            out = parts[-1][0]
            for value, held, _ in reversed(parts[:-1]):
                out = lax.select(held_here(held, piece), value, out)
        else:  # the pieces placed into the target block
            block = tuple(p * n for p, n in zip(piece, plan.span))
            out = ensure_varying(lax.full(block, 0, x.dtype), axes)
            for value, held, at in parts:
                placed = lax.dynamic_update_slice(out, value, _starts(at, index, piece))
                out = placed if all(held) else lax.select(held_here(held, block), placed, out)
        # the devices along an axis the target does not vary over hold equal blocks now
        keep_varying = self.dst.used_axes
        return agreed(out, [a for a in plan.axes + tuple(self.src.used_axes)
                            if a not in keep_varying])

    def __str__(self):
        dims = [str(d) for d, (a, b) in enumerate(zip(self.src.dims, self.dst.dims)) if a != b]
        rounds = f" ({self.rounds} rounds)" if self.rounds > 1 else ""
        return (f"ppermute({','.join(self.moved)}) dim{'s' if len(dims) > 1 else ''} "
                f"{','.join(dims)}{rounds}")


__all__ = ["remainder_sum", "widened_mean", "Step", "AllGather", "AllReduce", "ReduceScatter", "AllToAll", "LocalSlice",
           "MakePartial", "ShardToPartial", "Retile", "retiling", "agreed"]
