"""Layout: the canonical, hashable form of a placement that rules, planner and cost model speak.

For each tensor dim, the ordered tuple of mesh axes it is split over (major first, JAX style),
plus the partial mesh axes with their reduce types. Paddle placements (one per mesh dim) convert
both ways; co-sharding one dim over several mesh dims orders them as the mesh does.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import PlacementError, ShardingError
from .mesh import ProcessMesh
from .placement import Partial, Placement, ReduceType, Replicate, Shard, normalize_placements


def _check(dims: tuple, partial: tuple) -> None:
    seen: set[str] = set()
    for axes in dims:
        for a in axes:
            if a in seen:
                raise PlacementError(
                    f"mesh axis {a!r} shards two tensor dims in {_show(dims, partial)}")
            seen.add(a)
    for a, _ in partial:
        if a in seen:
            # Invariant: an axis is never both partial and sharding a dim of the same value.
            raise PlacementError(
                f"mesh axis {a!r} is both partial and sharding in {_show(dims, partial)}")
        seen.add(a)
    kinds = {t for _, t in partial}
    if len(kinds) > 1 and not kinds <= {ReduceType.SUM, ReduceType.AVG}:
        # max-of-sums differs from sum-of-maxes: such a value has no single meaning.
        kinds_text = ", ".join(f"P({t.value}) on {a!r}" for a, t in partial)
        raise PlacementError(
            "a tensor can be partial with only one kind of reduction at a time (sum and avg "
            f"may mix, being linear); got {kinds_text} — reshard to reduce one of them first")


def _show(dims: tuple, partial: tuple) -> str:
    return f"Layout(dims={dims!r}, partial={partial!r})"


_INTERNED: dict = {}  # (dims, partial) -> the one Layout with them
_DESCRIBED: dict = {}  # (layout, mesh) -> its placements as text


class Layout:
    """Immutable and interned: equal layouts are one object, so equality and hashing are by
    identity (C speed). Every planning memo is keyed by tuples of layouts, hashed and compared
    tens of thousands of times per program; interning also keeps one copy of each."""

    __slots__ = ("dims", "partial", "__dict__")
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[tuple[str, ReduceType], ...]

    def __new__(cls, dims: Sequence[Sequence[str]], partial: Sequence[tuple[str, ReduceType]] = ()):
        key = (tuple(tuple(d) for d in dims), tuple(sorted(partial)))
        self = _INTERNED.get(key)
        if self is None:
            _check(*key)
            new = object.__new__(cls)
            object.__setattr__(new, "dims", key[0])
            object.__setattr__(new, "partial", key[1])
            self = _INTERNED.setdefault(key, new)  # atomic: two threads get one object
        return self

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"Layout is immutable (cannot set {name!r})")

    def __reduce__(self):
        return (Layout, (self.dims, self.partial))  # unpickled: the interned object again

    def __copy__(self) -> "Layout":
        return self

    def __deepcopy__(self, memo) -> "Layout":
        return self

    def __repr__(self) -> str:
        return f"Layout(dims={self.dims!r}, partial={self.partial!r})"

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

    def devices_per_dim(self, axis_sizes: Mapping[str, int]) -> tuple[int, ...]:
        """How many devices split each dim (its blocks along it)."""
        # kept for the last axis-size mapping asked with (a mesh's own, one object): the
        # reshard search asks for thousands of local shapes and block counts per model
        kept = self.__dict__.get("_devices")
        if kept is None or kept[0] is not axis_sizes:
            kept = (axis_sizes, tuple(math.prod(axis_sizes[a] for a in axes) for axes in self.dims))
            object.__setattr__(self, "_devices", kept)
        return kept[1]

    def local_shape(self, shape: Sequence[int], axis_sizes: Mapping[str, int]) -> tuple[int, ...]:
        kept = self.__dict__.get("_devices")  # (inline: asked for far more than made)
        devices = kept[1] if kept is not None and kept[0] is axis_sizes \
            else self.devices_per_dim(axis_sizes)
        return tuple(s // n for s, n in zip(shape, devices))

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
        # kept per layout (interned: one object per value): the reshard search and the
        # strategy chooser ask for the same few edits of the same few layouts again and again
        edits = self.__dict__.get("_edits")
        if edits is None:
            edits = {}
            object.__setattr__(self, "_edits", edits)
        key = (d, tuple(axes))
        found = edits.get(key)
        if found is None:
            dims = list(self.dims)
            dims[d] = key[1]
            found = edits[key] = Layout(tuple(dims), self.partial)
        return found

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
        text = _DESCRIBED.get((self, mesh))
        if text is None:  # every planned collective's reason describes two layouts
            if len(_DESCRIBED) >= 65536:
                _DESCRIBED.clear()
            text = "[" + ", ".join(repr(p) for p in self.placements(mesh)) + "]"
            _DESCRIBED[(self, mesh)] = text
        return text


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
    # a dim its devices do not divide is stored padded and computed whole (uneven.py)
    return Layout(tuple(tuple(d) for d in dims), tuple(partial))


def block_bounds(layout: Layout, mesh: ProcessMesh, shape: Sequence[int],
                 coords: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """[start, stop) per dim of the block held by the device at mesh `coords` (of an uneven
    dim, blocks of ceil(size / devices) rows: the last devices' blocks are short or empty)."""
    position = dict(zip(mesh.dim_names, coords))
    sizes = mesh.axis_sizes
    bounds = []
    for size, axes in zip(shape, layout.dims):
        index, count = 0, 1
        for a in axes:  # mixed radix, major axis first
            index = index * sizes[a] + position[a]
            count *= sizes[a]
        step = -(-size // count)
        bounds.append((min(index * step, size), min((index + 1) * step, size)))
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


@functools.lru_cache(maxsize=None)
def _holds_zero(dtype: Any) -> bool:
    """Whether 0 is a value of float type `dtype` (float8_e8m0fnu, the MX scales, has none)."""
    return bool(np.asarray(0.0, np.float32).astype(dtype).astype(np.float32) == 0)


def check_partial_dtype(layout: "Layout", dtype: Any, what: str) -> None:
    """A Partial(max) / Partial(min) of complex numbers is an error: they have no order (XLA
    has no max-reduction of them, and would fail deep in its runtime); so is a Partial(sum)
    of a float type without a zero (it read back NaN)."""
    from jax import numpy as jnp

    sums = [a for a, t in layout.partial if t is ReduceType.SUM]
    if sums and jnp.issubdtype(dtype, jnp.floating) and not _holds_zero(dtype):
        raise PlacementError(
            f"{what} is {jnp.dtype(dtype).name}, placed Partial(sum) over {sums[0]!r}: the type "
            f"has no zero (its parts on the other devices would be zeros) — place it "
            f"Replicate / Shard / Partial(avg), or cast it to float32 first")
    kinds = {t for t in layout.partial_map.values() if t in (ReduceType.MAX, ReduceType.MIN)}
    if kinds and jnp.issubdtype(dtype, jnp.complexfloating):
        kind = sorted(t.value for t in kinds)[0]
        raise PlacementError(
            f"{what} is complex, placed Partial({kind}): complex "
            f"numbers have no order to take a {kind} by — place it Partial(sum) / "
            f"Partial(avg), or Replicate / Shard")


__all__ = ["check_partial_dtype", "Layout", "layout_from_placements", "block_bounds",
           "partial_index", "partial_axes_in_mesh_order"]
