"""Layout: the canonical, hashable form of a placement that rules, planner and cost model speak.

For each tensor dim, the ordered tuple of mesh axes it is split over (major first, JAX style),
plus the partial mesh axes with their reduce types. Paddle placements (one per mesh dim) convert
both ways; co-sharding one dim over several mesh dims orders them as the mesh does.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from .errors import PlacementError, ShardingError
from .hashing import hash_once
from .mesh import ProcessMesh
from .placement import Partial, Placement, ReduceType, Replicate, Shard, normalize_placements


@dataclass(frozen=True)
class Layout:
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[tuple[str, ReduceType], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(tuple(d) for d in self.dims))
        object.__setattr__(self, "partial", tuple(sorted(self.partial)))
        seen: set[str] = set()
        for axes in self.dims:
            for a in axes:
                if a in seen:
                    raise PlacementError(f"mesh axis {a!r} shards two tensor dims in {self}")
                seen.add(a)
        for a, _ in self.partial:
            if a in seen:
                # Invariant: an axis is never both partial and sharding a dim of the same value.
                raise PlacementError(f"mesh axis {a!r} is both partial and sharding in {self}")
            seen.add(a)
        kinds = {t for _, t in self.partial}
        if len(kinds) > 1 and not kinds <= {ReduceType.SUM, ReduceType.AVG}:
            # max-of-sums differs from sum-of-maxes: such a value has no single meaning.
            raise PlacementError(
                "a tensor can be partial with only one kind of reduction at a time (sum and avg "
                f"may mix, being linear); got {', '.join(f'P({t.value}) on {a!r}' for a, t in self.partial)} "
                "— reshard to reduce one of them first")

    def __hash__(self) -> int:
        return hash_once(self, lambda: (self.dims, self.partial))

    def __getstate__(self) -> dict:
        return {"dims": self.dims, "partial": self.partial}  # str hashes differ per process

    # -- queries ---------------------------------------------------------------------------
    @staticmethod
    def replicated(ndim: int) -> "Layout":
        return _replicated(ndim)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def partial_map(self) -> dict[str, ReduceType]:
        return dict(self.partial)

    @property
    def used_axes(self) -> frozenset[str]:
        return frozenset(a for axes in self.dims for a in axes) | {a for a, _ in self.partial}

    @property
    def is_replicated(self) -> bool:
        return not self.partial and not any(self.dims)

    def dim_of(self, axis: str) -> int | None:
        for d, axes in enumerate(self.dims):
            if axis in axes:
                return d
        return None

    def local_shape(self, shape: Sequence[int], axis_sizes: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(s // math.prod(axis_sizes[a] for a in axes) for s, axes in zip(shape, self.dims))

    def without_partial(self) -> "Layout":
        if not self.partial:
            return self
        reduced = self.__dict__.get("_reduced")  # asked for on every visit of a Partial value
        if reduced is None:
            reduced = Layout(self.dims)
            object.__setattr__(self, "_reduced", reduced)
        return reduced

    # -- edits used by the planner -------------------------------------------------------
    def with_dim(self, d: int, axes: tuple[str, ...]) -> "Layout":
        dims = list(self.dims)
        dims[d] = axes
        return Layout(tuple(dims), self.partial)

    def with_partial(self, partial: Mapping[str, ReduceType]) -> "Layout":
        return Layout(self.dims, tuple(partial.items()))

    # -- printing --------------------------------------------------------------------------
    def __str__(self) -> str:
        dims = ", ".join("(" + ",".join(a) + ")" if a else "-" for a in self.dims)
        part = "".join(f" P({t.value})@{a}" for a, t in self.partial)
        return f"[{dims}]{part}"

    def placements(self, mesh: ProcessMesh) -> list[Placement]:
        """One Paddle placement per mesh dim."""
        partial = self.partial_map
        result: list[Placement] = []
        for name in mesh.dim_names:
            d = self.dim_of(name)
            if name in partial:
                result.append(Partial(partial[name]))
            elif d is not None:
                result.append(Shard(d))
            else:
                result.append(Replicate())
        return result

    def describe(self, mesh: ProcessMesh) -> str:
        return "[" + ", ".join(repr(p) for p in self.placements(mesh)) + "]"


@functools.lru_cache(maxsize=64)
def _replicated(ndim: int) -> Layout:
    return Layout(((),) * ndim)  # one object per rank: equal layouts compare by identity first


def layout_from_placements(placements: Sequence[Placement | str], mesh: ProcessMesh,
                           shape: Sequence[int], *, what: str = "the tensor") -> Layout:
    """Check `placements` against `mesh` and the tensor's global `shape`, return the Layout.

    Negative Shard dims are normalised; co-sharded dims follow mesh-dim order (major first).
    """
    placements = normalize_placements(placements, mesh.ndim, mesh.dim_names)
    ndim = len(shape)
    dims: list[list[str]] = [[] for _ in range(ndim)]
    partial: list[tuple[str, ReduceType]] = []
    for name, p in zip(mesh.dim_names, placements):
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                valid = f"{-ndim}..{ndim - 1}" if ndim else "none (it is a scalar)"
                raise PlacementError(
                    f"{p!r} on mesh dim {name!r}: {what} has {ndim} dims (shape {tuple(shape)}), "
                    f"so dim {p.dim} does not exist; valid dims are {valid} — or use "
                    f"dist.Replicate() on {name!r}")
            dims[p.dim % ndim].append(name)
        elif isinstance(p, Partial):
            partial.append((name, p.reduce_type))
    layout = Layout(tuple(tuple(d) for d in dims), tuple(partial))
    check_divisible(layout, mesh, shape, what=what)
    return layout


def check_divisible(layout: Layout, mesh: ProcessMesh, shape: Sequence[int], *,
                    what: str = "the tensor") -> None:
    sizes = mesh.axis_sizes
    for d, (size, axes) in enumerate(zip(shape, layout.dims)):
        n = math.prod(sizes[a] for a in axes)
        if size % n:
            over = " × ".join(f"{a!r} (size {sizes[a]})" for a in axes)
            raise ShardingError(
                f"{what} (shape {tuple(shape)}) cannot be split evenly: dim {d} has size {size}, "
                f"which mesh dim{'s' if len(axes) > 1 else ''} {over} = {n} devices do not "
                f"divide; uneven sharding is not supported yet — pad dim {d} to a multiple of "
                f"{n}, or use dist.Replicate() on {', '.join(repr(a) for a in axes)}")


def block_bounds(layout: Layout, mesh: ProcessMesh, shape: Sequence[int],
                 coords: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """[start, stop) per dim of the block held by the device at mesh `coords`."""
    position = dict(zip(mesh.dim_names, coords))
    sizes = mesh.axis_sizes
    bounds = []
    for size, axes in zip(shape, layout.dims):
        index, count = 0, 1
        for a in axes:  # mixed radix, major axis first
            index = index * sizes[a] + position[a]
            count *= sizes[a]
        step = size // count
        bounds.append((index * step, (index + 1) * step))
    return tuple(bounds)


def partial_index(layout: Layout, mesh: ProcessMesh, coords: Sequence[int]) -> int:
    """Linear index of a device along the (mesh-ordered) partial axes: its physical slot."""
    position = dict(zip(mesh.dim_names, coords))
    sizes = mesh.axis_sizes
    index = 0
    for a in partial_axes_in_mesh_order(layout, mesh):
        index = index * sizes[a] + position[a]
    return index


def partial_axes_in_mesh_order(layout: Layout, mesh: ProcessMesh) -> tuple[str, ...]:
    partial = layout.partial_map
    return tuple(a for a in mesh.dim_names if a in partial)


__all__ = ["Layout", "layout_from_placements", "check_divisible", "block_bounds",
           "partial_index", "partial_axes_in_mesh_order"]
