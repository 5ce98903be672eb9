"""Placements: how a tensor sits on one mesh dim — Replicate, Shard(dim) or Partial(reduce_type).

Paddle's vocabulary, with DTensor's short forms `R`, `S(0)`, `P(sum)` for reprs and tests.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .errors import PlacementError, PlacementTypeError


class ReduceType(str, enum.Enum):
    """How the per-device values of a Partial placement combine into the logical value."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"

    # Paddle spells them dist.ReduceType.kRedSum etc.; these are aliases of the members above.
    kRedSum = "sum"
    kRedAvg = "avg"
    kRedMax = "max"
    kRedMin = "min"

    def __repr__(self) -> str:
        return f"ReduceType.{self.name}"

    def __str__(self) -> str:
        return self.value


def as_reduce_type(value: ReduceType | str) -> ReduceType:
    if isinstance(value, ReduceType):
        return value
    if isinstance(value, str):
        key = value.lower().removeprefix("kred")
        key = {"mean": "avg", "average": "avg"}.get(key, key)
        for member in ReduceType:
            if member.value == key:
                return member
    raise PlacementError(
        f"unknown reduce type {value!r}: write one of 'sum', 'avg', 'max', 'min' "
        f"(or dist.ReduceType.SUM / AVG / MAX / MIN)")


class Placement:
    """Base class of the three placements; `is_*` queries follow Paddle's names."""

    __slots__ = ()

    def is_replicated(self) -> bool:
        return False

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True, repr=False)
class Replicate(Placement):
    """Every device on the mesh dim holds the whole tensor."""

    def is_replicated(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True, repr=False)
class Shard(Placement):
    """Tensor dim `dim` is split evenly over the devices of the mesh dim (negative dims allowed)."""

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise PlacementTypeError(
                f"Shard(dim) needs an int tensor dim, got {self.dim!r} "
                f"({type(self.dim).__name__}): write for example dist.Shard(0)")

    def get_dim(self) -> int:
        return self.dim

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, repr=False)
class Partial(Placement):
    """Each device holds a partial value; the logical value is their reduction by `reduce_type`."""

    reduce_type: ReduceType = ReduceType.SUM

    def __post_init__(self) -> None:
        object.__setattr__(self, "reduce_type", as_reduce_type(self.reduce_type))

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"P({self.reduce_type.value})"


_SHORT_FORM = re.compile(r"^\s*(?:(R)|S\((-?\d+)\)|P(?:\((\w+)\))?)\s*$")


def parse_placement(text: str) -> Placement:
    """`"R"`, `"S(0)"`, `"P"` or `"P(max)"` → the placement object."""
    if not isinstance(text, str):
        raise PlacementTypeError(
            f"parse_placement reads a short form string, got {text!r} of type "
            f"{type(text).__name__}: write 'R', 'S(<dim>)' or 'P(<sum|avg|max|min>)'")
    match = _SHORT_FORM.match(text)
    if match is None:
        raise PlacementError(f"cannot read placement {text!r}: write 'R', 'S(<dim>)' or 'P(<sum|avg|max|min>)'")
    if match.group(1):
        return Replicate()
    if match.group(2) is not None:
        return Shard(int(match.group(2)))
    return Partial(match.group(3) or "sum")


def normalize_placements(placements: Sequence[Placement | str], mesh_ndim: int,
                         mesh_dim_names: Sequence[str]) -> tuple[Placement, ...]:
    """Check a user's placements list against the mesh; short strings are accepted too."""
    if isinstance(placements, (Placement, str)) or not isinstance(placements, Sequence):
        raise PlacementTypeError(
            f"placements must be a list with one placement per mesh dim, got {placements!r}: "
            f"write for example {_example(mesh_ndim)}")
    result = []
    for i, p in enumerate(placements):
        if isinstance(p, str):
            p = parse_placement(p)
        if not isinstance(p, Placement):
            axis = mesh_dim_names[i] if i < len(mesh_dim_names) else f"#{i}"
            raise PlacementTypeError(
                f"placements[{i}] (for mesh dim {axis!r}) is {p!r} of type {type(p).__name__}, "
                f"not a placement: write dist.Shard({p if isinstance(p, int) else 0}) to split a "
                f"tensor dim over that mesh dim, dist.Replicate() to copy it, or dist.Partial()")
        result.append(p)
    if len(result) != mesh_ndim:
        raise PlacementError(
            f"got {len(result)} placements {list(result)} for a {mesh_ndim}-d mesh with dims "
            f"{list(mesh_dim_names)}: give exactly one placement per mesh dim, e.g. "
            f"{_example(mesh_ndim)}")
    return tuple(result)


def placement_code(p: Any) -> str:
    """A placement as the user writes it (for error messages that say what to write)."""
    if isinstance(p, Shard):
        return f"dist.Shard({p.dim})"
    if isinstance(p, Partial):
        kind = ReduceType(p.reduce_type).value
        return "dist.Partial()" if kind == "sum" else f"dist.Partial({kind!r})"
    return "dist.Replicate()" if isinstance(p, Replicate) else repr(p)


def _example(ndim: int) -> str:
    return "[" + ", ".join(["dist.Shard(0)"] + ["dist.Replicate()"] * max(ndim - 1, 0)) + "]"


def narrow_float(dtype) -> bool:
    """A float type of less range than float32 (float16, the float8s): the sum of n parts of a
    value past its largest / n overflows (float16 on 8 devices: past 8188), so a mean of its
    parts is summed in float32 (`mean_of_parts`: twice the bytes of float16), and a block is
    never scaled by n to make it a mean's part (`steps.ShardToPartial`)."""
    from jax import numpy as jnp

    return (jnp.issubdtype(dtype, jnp.floating) and not jnp.issubdtype(dtype, jnp.complexfloating)
            and jnp.finfo(dtype).maxexp < np.finfo(np.float32).maxexp)  # (bfloat16: float32's)


def mean_of_parts(x, n: int, total, wide):
    """The Partial(avg) value of `n` parts, given `total` (sums the parts: a psum, or a sum
    over a slot axis) — for integers exactly, truncated toward zero as a mean cast back to the
    dtype is, and without the sum overflowing the dtype (jax's pmean of uint8 parts 200 and
    100 gives 8 and 36): the parts' quotients by n and their remainders (in `wide`) summed
    apart."""
    # (jax's issubdtype: ml_dtypes' int4 / uint4 are integers too, which numpy's does not know)
    from jax import numpy as jnp

    if not jnp.issubdtype(x.dtype, jnp.integer):
        if narrow_float(x.dtype):  # summed in float32, as jnp.mean sums them
            return (total(x.astype(jnp.float32)) / n).astype(x.dtype)
        return (total(x) / n).astype(x.dtype)
    rest = total((x % n).astype(wide))
    mean = total(x // n) + (rest // n).astype(x.dtype)
    if jnp.issubdtype(x.dtype, jnp.signedinteger):  # floor → toward zero
        mean = mean + ((mean < 0) & (rest % n != 0)).astype(x.dtype)
    return mean


__all__ = ["mean_of_parts", "narrow_float", "ReduceType", "Placement", "Replicate", "Shard", "Partial", "parse_placement",
           "normalize_placements", "as_reduce_type", "placement_code"]
