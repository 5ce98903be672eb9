"""The reshard atoms: one collective (or one local op) each, with precondition and local code.

Every atom answers four questions: may it run on this Layout (`after` returns None if not — it
never raises), what Layout results, how many bytes each device sends (ring algorithms), and how
to compute it on one device's block inside `shard_map` (`run`). The planner searches over them;
the executor only calls `run` in order.
"""
from __future__ import annotations

import functools
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
    missing = tuple(sorted(a for a in axes if a not in varying_axes(x)))
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


def _differentiable_choice(choose, x, axes):
    """pmax / pmin of `x` over `axes`, with a derivative (jax defines none for them, and a
    partitioned program is differentiated when jax.grad is taken outside dist.jit): the tangent
    of the device(s) holding the chosen value, split evenly among them as jax splits a max's
    gradient among ties. (Ties within one device's block were already split by its local
    reduction, so exact ties held unevenly across devices are weighted per device.)"""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return choose(x, axes)
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


class Retiling(NamedTuple):
    """One round of a re-tiling over `axes` (the mesh axes either layout splits a dim over, in
    the mesh's order; a device is numbered by its linear index over them, major first: jax's
    numbering of `lax.axis_index(axes)` and of ppermute's pairs). Each device's target block
    lies inside one source block, `ratio` target blocks per source block along each dim; a
    device holding its own target's source block slices it (keeps), the others receive it from
    a holder (`perm`: (sender, receiver))."""

    axes: tuple[str, ...]
    ratio: tuple[int, ...]
    perm: tuple[tuple[int, int], ...]
    send: tuple[tuple[int, ...], ...]  # per device: the block (in target blocks, per dim) it
    # slices to send — or to keep, when `keep` is None (no device both keeps and sends)
    keep: tuple[tuple[int, ...], ...] | None
    receives: tuple[bool, ...]  # per device: whether its block arrives (else it keeps one)


def _block_index(dims, position, sizes) -> tuple[int, ...]:
    out = []
    for axes in dims:
        index = 0
        for a in axes:
            index = index * sizes[a] + position[a]
        out.append(index)
    return tuple(out)


@functools.lru_cache(maxsize=8192)
def retiling(src: Layout, dst: Layout, sizes: tuple[tuple[str, int], ...]) -> Retiling | None:
    """The one round of sends that turns `src` into `dst` (mesh axis sizes `sizes`, in the
    mesh's order), or None: their partial axes differ, a target block spans source blocks
    (some dim has fewer target blocks than source blocks, or a count that is no multiple of
    theirs), no device needs a block it lacks, or some source block is needed by more devices
    than hold it (one round: each device sends at most one piece and receives at most one)."""
    if src is dst or src.partial != dst.partial or src.ndim != dst.ndim:
        return None
    size = dict(sizes)
    used = {a for axes in src.dims + dst.dims for a in axes}
    axes = tuple(a for a, _ in sizes if a in used)
    n_src = [math.prod(size[a] for a in d) for d in src.dims]
    n_dst = [math.prod(size[a] for a in d) for d in dst.dims]
    if any(t % s for s, t in zip(n_src, n_dst)):
        return None
    ratio = tuple(t // s for s, t in zip(n_src, n_dst))
    count = math.prod(size[a] for a in axes)
    coords, holds, needs, within = [], [], [], []
    for i in range(count):
        position, rest = {}, i
        for a in reversed(axes):
            rest, position[a] = divmod(rest, size[a])
        coords.append(tuple(position[a] for a in axes))
        holds.append(_block_index(src.dims, position, size))
        target = _block_index(dst.dims, position, size)
        needs.append(tuple(t // r for t, r in zip(target, ratio)))
        within.append(tuple(t % r for t, r in zip(target, ratio)))
    keepers = {i for i in range(count) if holds[i] == needs[i]}
    if len(keepers) == count:
        return None  # nothing moves: a local slice
    holders: dict[tuple, list[int]] = {}
    for i in range(count):
        holders.setdefault(holds[i], []).append(i)
    perm = []
    for i in range(count):
        if i in keepers:
            continue
        free = holders.get(needs[i], [])
        if not free:
            return None  # more devices need this source block than hold it
        # a holder that keeps no block of its own first (it slices once), then the one
        # nearest on the mesh (fewest coordinates differ)
        j = min(free, key=lambda j: (j in keepers, sum(a != b for a, b in zip(coords[i], coords[j])), j))
        free.remove(j)
        perm.append((j, i))
    zero = (0,) * src.ndim
    send = [zero] * count
    for j, i in perm:
        send[j] = within[i]
    senders = {j for j, _ in perm}
    keep = None
    if keepers & senders:
        keep = tuple(within[i] if i in keepers else zero for i in range(count))
    else:
        for i in keepers:
            send[i] = within[i]
    receives = tuple(i not in keepers for i in range(count))
    return Retiling(axes, ratio, tuple(perm), tuple(send), keep, receives)


def _slice_blocks(x, table, index, block):
    """This device's block of shape `block` from `x`, at the block offsets of row `index` of
    the constant `table` (one row per device)."""
    starts = []
    for d, b in enumerate(block):
        column = np.array([row[d] * b for row in table], np.int32)
        if not column.any():
            starts.append(np.int32(0))
        else:
            starts.append(lax.dynamic_index_in_dim(column, index, keepdims=False))
    return lax.dynamic_slice(x, starts, block)


@dataclass(frozen=True)
class Retile(Step):
    """Any layout to `dst` (same partial axes) in which each device's block lies inside one
    block of `src`: one collective permute over `moved` (a dim's split moved to another mesh
    axis, axes exchanged between dims, a dim split finer over other axes). Each device slices
    the piece its receiver needs, the permute delivers it, and a device that already holds its
    target's rows slices them instead (`retiling`: applies where one round does it)."""

    src: Layout
    dst: Layout
    moved: tuple[str, ...]  # the mesh axes either layout splits a dim over, in the mesh's order
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
        return out_bytes  # one target block, from each device that sends

    def run(self, x, sizes):
        plan = retiling(self.src, self.dst, tuple(sizes.items()))
        block = tuple(n // r for n, r in zip(x.shape, plan.ratio))
        index = _linear_axis_index(plan.axes, sizes)
        sent = _slice_blocks(x, plan.send, index, block)
        received = lax.ppermute(sent, _axis_arg(plan.axes), plan.perm)
        if all(plan.receives):
            out = received
        else:
            kept = sent if plan.keep is None else _slice_blocks(x, plan.keep, index, block)
            axes = varying_axes(received) | varying_axes(kept)
            received, kept = ensure_varying(received, axes), ensure_varying(kept, axes)
            receives = lax.dynamic_index_in_dim(np.array(plan.receives), index, keepdims=False)
            receives = ensure_varying(lax.broadcast(receives, block), axes)
            out = lax.select(receives, received, kept)
        # the devices along an axis the target does not vary over hold equal blocks now
        keep_varying = self.dst.used_axes
        return agreed(out, [a for a in plan.axes + tuple(self.src.used_axes)
                            if a not in keep_varying])

    def __str__(self):
        dims = [str(d) for d, (a, b) in enumerate(zip(self.src.dims, self.dst.dims)) if a != b]
        return f"ppermute({','.join(self.moved)}) dim{'s' if len(dims) > 1 else ''} {','.join(dims)}"


__all__ = ["remainder_sum", "widened_mean", "Step", "AllGather", "AllReduce", "ReduceScatter", "AllToAll", "LocalSlice",
           "MakePartial", "ShardToPartial", "Retile", "retiling", "agreed"]
