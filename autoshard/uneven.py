"""Uneven sharding: a dim its mesh axes do not divide (a vocab of 50257 over 4 devices).

jax arrays shard evenly only, so such a tensor is *stored* padded: the dim grows to the next
multiple of its device count (zeros at the end) and each device holds ceil(size / n) rows, the
last ones partly or wholly padding. The padding never reaches a computation: dist.jit programs
compute on even layouts only. Where a value stored unevenly enters a program (or an eager
reshard), its uneven dims are gathered whole along their axes and the padding is cut off (the
reshard atom `GatherUneven`, an all-gather the plans list); where a program's output, or a
reshard's target, asks for an uneven placement, the whole dim is padded and each device keeps
its block (`SplitUneven`, no communication). This module is the layout arithmetic.
"""
from __future__ import annotations

import math
import os
import sys
import warnings
from typing import Any, Sequence

import numpy as np

from .layout import Layout
from .mesh import ProcessMesh


class UnevenShardingWarning(UserWarning):
    """A placement splits a dim its devices do not divide: stored padded, computed whole."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _user_stacklevel() -> int:
    """The stacklevel of the innermost caller outside autoshard (jax's frames count as
    outside: a hint inside a traced function is attributed to the user's line there)."""
    frame, level = sys._getframe(2), 2  # 1: warn_uneven, 2: its caller
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def warn_uneven(layout: Layout, mesh: ProcessMesh, shape: Sequence[int], what: str,
                consequence: str) -> None:
    """One warning naming the dims, the axes and what to write to keep them split, at the
    user's line."""
    sizes = mesh.axis_sizes
    for d in uneven_dims(layout, mesh, shape):
        axes = layout.dims[d]
        n = math.prod(sizes[a] for a in axes)
        over = " × ".join(f"{a!r} ({sizes[a]})" for a in axes)
        warnings.warn(
            f"autoshard: {what} (shape {tuple(shape)}): dim {d} of size {shape[d]} does not split "
            f"evenly over mesh dim{'s' if len(axes) > 1 else ''} {over} = {n} devices; it {consequence}"
            f" — pad dim {d} to {-(-shape[d] // n) * n} (a multiple of {n}) to compute it split",
            UnevenShardingWarning, stacklevel=_user_stacklevel())


def _counts(layout: Layout, mesh: ProcessMesh) -> list[int]:
    sizes = mesh.axis_sizes
    return [math.prod(sizes[a] for a in axes) for axes in layout.dims]


def uneven_dims(layout: Layout, mesh: ProcessMesh, shape: Sequence[int]) -> list[int]:
    """The dims of `shape` that `layout` splits over devices that do not divide them."""
    return [d for d, (size, n) in enumerate(zip(shape, _counts(layout, mesh))) if size % n]


def is_uneven(layout: Layout, mesh: ProcessMesh, shape: Sequence[int]) -> bool:
    return any(size % n for size, n in zip(shape, _counts(layout, mesh)))


def padded_shape(layout: Layout, mesh: ProcessMesh, shape: Sequence[int]) -> tuple[int, ...]:
    """The stored (global) shape: every dim rounded up to a multiple of its device count."""
    return tuple(-(-size // n) * n for size, n in zip(shape, _counts(layout, mesh)))


def even_part(layout: Layout, mesh: ProcessMesh, shape: Sequence[int]) -> Layout:
    """`layout` with its uneven dims whole: the layout programs compute with."""
    bad = uneven_dims(layout, mesh, shape)
    if not bad:
        return layout
    return Layout(tuple(() if d in bad else axes for d, axes in enumerate(layout.dims)),
                  layout.partial)


def pad_global(x: Any, layout: Layout, mesh: ProcessMesh, shape: Sequence[int], xp=np) -> Any:
    """A whole value (numpy or jax) padded with zeros to its stored shape."""
    padded = padded_shape(layout, mesh, shape)
    if tuple(padded) == tuple(shape):
        return x
    widths = [(0, p - s) for s, p in zip(shape, padded)]
    if is_key(x):  # PRNG keys pad as their key data (no zero key to pad with)
        import jax

        data = jax.random.key_data(x)
        return jax.random.wrap_key_data(jax.numpy.pad(data, widths + [(0, 0)] * (data.ndim - len(shape))),
                                        impl=jax.random.key_impl(x))
    return xp.pad(x, widths)


def key_partial_error(what: str, placements: list):
    from .errors import PlacementError

    return PlacementError(
        f"{what} of PRNG keys placed {placements}: a Partial placement is pending parts of a "
        f"sum / mean / max / min, which keys have none of; place keys with Replicate() or "
        f"Shard(d)")


def is_key(x: Any) -> bool:
    """Whether `x` (an array, or a dtype) holds typed PRNG keys."""
    import jax

    dtype = getattr(x, "dtype", x)
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


__all__ = ["UnevenShardingWarning", "warn_uneven", "uneven_dims", "is_uneven", "padded_shape",
           "even_part", "pad_global", "is_key", "key_partial_error"]
