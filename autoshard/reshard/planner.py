"""The reshard planner: Layout A → Layout B as the cheapest sequence of atoms, by the cost model.

A short Dijkstra search over layouts on one mesh (greedy first-match misses multi-axis routes
such as co-shard reorderings); results are cached on (mesh, src, dst, shape, dtype, cost model).
Between meshes the plan is: steps on the source mesh, one device-to-device transfer, steps on
the destination mesh (see transfer.py).
"""
from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Iterator

import jax
import numpy as np

from ..cost_model import CostModel
from ..errors import ReshardError
from ..layout import Layout
from ..mesh import ProcessMesh
from ..placement import ReduceType, narrow_float
from .steps import (AllGather, AllReduce, AllToAll, GatherUneven, LocalSlice, MakePartial,
                    ReduceScatter, Retile, ShardToPartial, SplitUneven, Step, remainder_sum,
                    retiling, widened_mean)


@dataclass(frozen=True)
class PlannedStep:
    """One step of a plan, with where it runs, what it changes, and what it costs."""

    step: Step
    mesh: ProcessMesh
    before: Layout
    after: Layout
    bytes_per_device: int
    seconds: float
    # the second all-reduce of an integer mean: the remainders of the parts, summed in int32
    # (`steps.remainder_sum`); 0 for every other step
    remainder_bytes: int = 0

    @property
    def kind(self) -> str:
        return self.step.kind

    @property
    def collectives(self) -> list[str]:
        """The HLO ops this step runs (none for a local step)."""
        if not self.step.hlo:
            return []
        return [self.step.hlo] * (self.rounds + (1 if self.remainder_bytes else 0))

    @property
    def rounds(self) -> int:
        """How many collectives the step itself runs, one after another (a re-tiling's
        permutes, `steps.Retile`; 1 for every other collective)."""
        return getattr(self.step, "rounds", 1)

    @property
    def before_mesh(self) -> ProcessMesh:
        """The mesh `before` lives on (the source mesh, for a cross-mesh transfer)."""
        return getattr(self.step, "src_mesh", self.mesh)

    def __str__(self) -> str:
        extra = (f" + {format_bytes(self.remainder_bytes)}/device of int32 remainders (a "
                 f"second {self.step.hlo})" if self.remainder_bytes else "")
        return (f"{str(self.step):<34} {self.before.describe(self.before_mesh)} → "
                f"{self.after.describe(self.mesh)}  {format_bytes(self.bytes_per_device)}/device"
                + extra)


@dataclass(frozen=True)
class ReshardPlan:
    """The steps that turn (src_mesh, src) into (dst_mesh, dst) for one shape and dtype."""

    shape: tuple[int, ...]
    dtype: str
    src_mesh: ProcessMesh
    src: Layout
    dst_mesh: ProcessMesh
    dst: Layout
    steps: tuple[PlannedStep, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes each device sends, summed over the steps (the largest sender of each step)."""
        return sum(s.bytes_per_device + s.remainder_bytes for s in self.steps)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    @property
    def collectives(self) -> list[str]:
        """HLO op names of the planned collectives, in order."""
        return [op for s in self.steps for op in s.collectives]

    @property
    def cross_mesh(self) -> bool:
        return self.src_mesh != self.dst_mesh

    def __str__(self) -> str:
        head = (f"reshard {self.dtype}{list(self.shape)}: {self.src.describe(self.src_mesh)} → "
                f"{self.dst.describe(self.dst_mesh)}"
                + (f" (mesh {self.src_mesh.process_ids} → {self.dst_mesh.process_ids})"
                   if self.cross_mesh else ""))
        if not self.steps:
            return head + "\n  (nothing to do)"
        lines = [head] + [f"  {i}. {s}" for i, s in enumerate(self.steps, 1)]
        lines.append(f"  total {format_bytes(self.total_bytes)}/device, est. {self.seconds * 1e6:.1f} µs")
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle):  # IPython
        printer.text(str(self))


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


@functools.lru_cache(maxsize=65536)
def _local_count(layout: Layout, shape: tuple[int, ...], mesh: ProcessMesh) -> int:
    """Elements of one device's block: the search prices every step by the blocks before and
    after it, and meets the same few layouts of the same few shapes again and again."""
    return math.prod(layout.local_shape(shape, mesh.axis_sizes))


def _candidate_steps(layout: Layout, wanted_partial: dict, ndim: int, axis_names,
                     integer: bool = False, narrow: bool = False) -> Iterator[Step]:
    """`integer` / `narrow`: the values are integers / floats of less range than float32
    (`placement.narrow_float`), whose means are reduced with care."""
    partial = layout.partial_map
    for d, axes in enumerate(layout.dims):
        for k in range(1, len(axes) + 1):
            yield AllGather(axes[len(axes) - k:], d)
    by_type: dict[ReduceType, list[str]] = {}
    for a in axis_names:
        if a in partial:
            by_type.setdefault(partial[a], []).append(a)
    for reduce_type, axes in by_type.items():
        # an integer mean is truncated: the mean of a few parts' means is not the mean of all
        # ((1 + 0) // 2 then (0 + 1) // 2 is 0 where (1 + 0 + 0 + 3) // 4 is 1), nor is a sum
        # of means the mean of the sum, so an integer Partial(avg) is reduced over all its axes
        # at once, after any pending sum (a target that keeps some pending makes them Partial
        # again after: exact, every device holding the value)
        fewest = 1
        if integer and reduce_type is ReduceType.AVG:
            if ReduceType.SUM in by_type:
                continue
            fewest = len(axes)
        for r in range(fewest, len(axes) + 1):
            for subset in itertools.combinations(axes, r):
                yield AllReduce(subset, reduce_type)
            if reduce_type in (ReduceType.SUM, ReduceType.AVG):
                for ordered in itertools.permutations(axes, r):
                    for d in range(ndim):
                        yield ReduceScatter(ordered, d, reduce_type)
    for d, axes in enumerate(layout.dims):
        if axes:
            for k in range(1, len(axes) + 1):
                for e in range(ndim):
                    yield AllToAll(tuple(axes[len(axes) - k:]), d, e)
            if axes[-1] in wanted_partial and not (
                    (integer or narrow) and wanted_partial[axes[-1]] is ReduceType.AVG):
                # (a shard's mean over n parts is n times it on its owner: integers and
                # float16 overflow)
                yield ShardToPartial(axes[-1], d, wanted_partial[axes[-1]])
    used = layout.used_axes
    for a in axis_names:
        if a not in used:
            for d in range(ndim):
                yield LocalSlice(a, d)
            if a in wanted_partial:
                yield MakePartial(a, wanted_partial[a])


def _divisibility(layout: Layout, shape: tuple[int, ...], mesh: ProcessMesh) -> tuple[int, ...]:
    """What a step's `after` reads of `shape` on `layout`: whether a dim's local size divides
    by a group of mesh axes, the group always of axes not splitting that dim. Every such group
    and the dim's own devices multiply to a divisor of the mesh's size, so an evenly split
    dim's gcd with it answers alike; a dim split unevenly (floored local sizes) stays itself."""
    sizes, devices = mesh.axis_sizes, mesh.size
    return tuple(math.gcd(s, devices) if s % math.prod(sizes[a] for a in axes) == 0 else s
                 for s, axes in zip(shape, layout.dims))


@functools.lru_cache(maxsize=8192)
def _transitions(layout: Layout, wanted_partial: tuple, divisible: tuple[int, ...],
                 integer: bool, mesh: ProcessMesh, narrow: bool = False) -> tuple:
    """Every step that may run on `layout`, with the layout after it: a function of the
    shape only through `_divisibility`, so the layers' many shapes of one rank share it."""
    sizes = mesh.axis_sizes
    found = []
    for step in _candidate_steps(layout, dict(wanted_partial), len(divisible), mesh.dim_names,
                                 integer, narrow):
        nxt = step.after(layout, divisible, sizes)
        if nxt is not None:
            found.append((step, nxt))
    return tuple(found)


@functools.lru_cache(maxsize=64)
def _dtype_facts(dtype: str) -> tuple[int, bool, bool]:
    """(itemsize, integer, narrow float) of a dtype: asked by every expansion of a search."""
    return (np.dtype(dtype).itemsize,
            bool(jax.dtypes.issubdtype(dtype, np.integer)),  # (int4: numpy's does not know it)
            narrow_float(dtype))


@functools.lru_cache(maxsize=8192)  # (a model of a few shapes meets ~700)
def _moves(layout: Layout, wanted_partial: tuple, shape: tuple[int, ...], dtype: str,
           mesh: ProcessMesh, cost_model: CostModel) -> tuple:
    """Every step that may run on `layout`, as (layout after, step, wire bytes, seconds,
    remainder bytes). A search to a target with partial axes `wanted_partial` expands a layout
    the same way whatever the target's dims, and the searches of one model meet the same few
    layouts of the same few shapes again and again: expanded once."""
    sizes = mesh.axis_sizes
    itemsize, integer, narrow = _dtype_facts(dtype)
    in_bytes = _local_count(layout, shape, mesh) * itemsize
    found = []
    for step, nxt in _transitions(layout, wanted_partial, _divisibility(layout, shape, mesh),
                                  integer, mesh, narrow):
        out_bytes = _local_count(nxt, shape, mesh) * itemsize
        wire = step.wire_bytes(in_bytes, out_bytes, sizes)
        if narrow and widened_mean(step, dtype):  # its parts summed in float32
            wire = wire * 4 / itemsize
        seconds = (cost_model.collective(step.axes, wire) if step.is_collective
                   else cost_model.local(out_bytes))
        remainders = 0
        if integer and remainder_sum(step, dtype):  # int32 remainders summed apart
            remainders = int(round(wire)) * 4 // itemsize
            seconds += cost_model.collective(step.axes, remainders)
        found.append((nxt, step, wire, seconds, remainders))
    return tuple(found)


@functools.lru_cache(maxsize=256)
def _retile_targets(dst: Layout, mesh: ProcessMesh) -> tuple[Layout, ...]:
    """The layouts a search for `dst` may re-tile to by permutes (`steps.Retile`): `dst`
    itself, and `dst` with mesh axes it leaves free split further over one dim (minor-most),
    which all-gathers of those axes then undo — rows split over mp becoming rows over dp on a
    2x4 mesh ([R, S(0)] → [S(0), R]) permute to rows over (dp, mp), half a target block each,
    and gather mp: a target block spans two source blocks, which one round cannot fill (two
    rounds of a piece each, straight to `dst`, send as many bytes in as many collectives; the
    search keeps the permute and gather, which place no pieces)."""
    used = dst.used_axes
    free = [a for a in mesh.dim_names if a not in used]
    found = [dst]
    for k in range(1, len(free) + 1):
        for extra in itertools.permutations(free, k):
            for d, axes in enumerate(dst.dims):
                found.append(dst.with_dim(d, axes + extra))
    return tuple(found)


@functools.lru_cache(maxsize=4096)
def _retiles(layout: Layout, dst: Layout, mesh: ProcessMesh) -> tuple[Retile, ...]:
    """The permutes from `layout` to `_retile_targets(dst)` (`steps.retiling`), whatever
    the shape (the searches of a model's many shapes meet the same pairs of layouts)."""
    if layout.partial != dst.partial:
        return ()
    sizes = mesh.axis_sizes
    counts = layout.devices_per_dim(sizes)
    blocks = math.prod(counts)
    found = []
    for target in _retile_targets(dst, mesh):
        # most pairs fail one of these tests, cheaper than `retiling`'s: a dim whose blocks
        # neither layout's subdivide, a target block inside its device's own (a slice), a
        # target block spanning source blocks of a target split over fewer devices in all
        # (pieces gathered by rounds of permutes, where all-gathers move them in one), or
        # spanning more than two (a round per piece but one, a latency each: of the ~30k
        # moves on 8 devices' meshes none such beat the all-to-alls), or two on the way to
        # a gather (dst split further: 90 of those moves, all on 2x2x2, send 15-25 % fewer
        # bytes so, but finding their rounds for every layout the search meets made a
        # model's first plan ~30 % slower)
        target_counts = target.devices_per_dim(sizes)
        if (any(t % c and c % t for c, t in zip(counts, target_counts))
                or all(t[:len(c)] == c for c, t in zip(layout.dims, target.dims))):
            continue
        pieces = math.prod(c // t for c, t in zip(counts, target_counts) if c > t)
        if pieces > 1 and (pieces > 2 or target is not dst or math.prod(target_counts) < blocks):
            continue
        plan = retiling(layout, target, tuple(sizes.items()))
        if plan is not None:
            found.append(Retile(layout, target, plan.axes, len(plan.rounds),
                                math.prod(plan.span)))
    return tuple(found)


@functools.lru_cache(maxsize=8192)
def _retile_moves(layout: Layout, dst: Layout, shape: tuple[int, ...], dtype: str,
                  mesh: ProcessMesh, cost_model: CostModel) -> tuple:
    """The re-tiling permutes from `layout` towards `dst` (`_retiles`), as `_moves` lists
    steps. Apart from `_moves`: these depend on the search's target, whose other steps do not
    (and are shared by every search of that shape)."""
    sizes = mesh.axis_sizes
    itemsize = _dtype_facts(dtype)[0]
    found = []
    for step in _retiles(layout, dst, mesh):
        if step.after(layout, shape, sizes) is None:
            continue
        out_bytes = _local_count(step.dst, shape, mesh) * itemsize
        wire = step.wire_bytes(0, out_bytes, sizes)
        # its rounds one after another, each its latency; a target block of several pieces
        # is written once per piece placed in it (`Retile.run`), the kept one too
        seconds = step.rounds * cost_model.collective(step.axes, wire / step.rounds)
        if step.pieces > 1:
            seconds += cost_model.local(out_bytes * step.pieces)
        found.append((step.dst, step, wire, seconds, 0))
    return tuple(found)


@functools.lru_cache(maxsize=4096)
def plan_on_mesh(mesh: ProcessMesh, src: Layout, dst: Layout, shape: tuple[int, ...],
                 dtype: str, cost_model: CostModel) -> tuple[PlannedStep, ...]:
    """Cheapest steps from `src` to `dst` on one mesh (Dijkstra over layouts)."""
    if src == dst:
        return ()
    counter = itertools.count()
    best: dict[Layout, float] = {src: 0.0}
    back: dict[Layout, tuple[Layout, PlannedStep]] = {}
    heap = [(0.0, next(counter), src)]
    wanted_partial = dst.partial

    while heap:
        cost, _, layout = heapq.heappop(heap)
        if layout == dst:
            break
        if cost > best.get(layout, math.inf):
            continue
        for nxt, step, wire, seconds, remainders in itertools.chain(
                _moves(layout, wanted_partial, shape, dtype, mesh, cost_model),
                _retile_moves(layout, dst, shape, dtype, mesh, cost_model)):
            total = cost + seconds
            # a first path to a layout is taken even at an infinite cost (a cost model of
            # bandwidths so small that seconds overflow): the plan, not whether one exists
            known = best.get(nxt)
            if known is None or total < known - 1e-18:
                best[nxt] = total
                back[nxt] = (layout, step, wire, seconds, remainders)  # (a step made at the end)
                heapq.heappush(heap, (total, next(counter), nxt))
    if dst not in back:
        # (callers ask for layouts the shape divides: one that does not is a bug of the caller)
        raise ReshardError(
            f"no reshard reaches {dst.describe(mesh)} from {src.describe(mesh)} for shape "
            f"{list(shape)} on {mesh!r}: a dim split over devices that do not divide it is "
            f"computed whole (dist.shard_tensor / dist.reshard do so, with a warning)")
    steps = []
    node = dst
    while node != src:
        before, step, wire, seconds, remainders = back[node]
        steps.append(PlannedStep(step, mesh, before, node, int(round(wire)), seconds, remainders))
        node = before
    return tuple(reversed(steps))


def uneven_steps(mesh: ProcessMesh, layout: Layout, shape: tuple[int, ...], dtype: str,
                 cost_model: CostModel, *, gather: bool) -> tuple[PlannedStep, ...]:
    """Between `layout`, whose devices do not divide some dims (stored padded, uneven.py),
    and its even part (those dims whole): their gathers (`gather`), else their splits."""
    from ..uneven import even_part, padded_shape, uneven_dims  # uneven.py builds on layouts

    sizes = mesh.axis_sizes
    itemsize = np.dtype(dtype).itemsize
    now = list(padded_shape(layout, mesh, shape))  # the stored shape, as dims are gathered
    steps: list[PlannedStep] = []
    here = layout if gather else even_part(layout, mesh, shape)
    for d in uneven_dims(layout, mesh, shape):
        axes = layout.dims[d]
        n = math.prod(sizes[a] for a in axes)
        if gather:
            step: Step = GatherUneven(axes, d, shape[d])
            # the padded block of every device arrives, the padding with it
            wire = math.prod(here.local_shape(now, sizes)) * (n - 1) * itemsize
            now[d] = shape[d]
            seconds = cost_model.collective(axes, wire)
        else:
            step = SplitUneven(axes, d, shape[d])
            wire = 0
            seconds = cost_model.local(math.prod(here.local_shape(shape, sizes)) * itemsize)
        after = step.after(here, shape, sizes)
        steps.append(PlannedStep(step, mesh, here, after, int(wire), seconds))
        here = after
    return tuple(steps)


__all__ = ["PlannedStep", "ReshardPlan", "plan_on_mesh", "uneven_steps", "format_bytes"]
