"""Uneven sharding: a dim its mesh axes do not divide (a vocab of 50257 over 4 devices).

jax arrays shard evenly only, so such a tensor is *stored* padded: the dim grows to the next
multiple of its device count (zeros at the end) and each device holds ceil(size / n) rows, the
last ones partly or wholly padding. The padding never reaches a computation: dist.jit programs
compute on even layouts only. Where a value stored unevenly enters a program (or an eager
reshard), its uneven dims are gathered whole along their axes and the padding is cut off
(`gather_local`, an all-gather the plan lists); where a program's output, or a reshard's
target, asks for an uneven placement, the whole dim is padded and each device keeps its block
(`split_local`, no communication).
"""
from __future__ import annotations

import math
import os
import sys
import warnings
from typing import Any, Sequence

import numpy as np
from jax import lax

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
    return xp.pad(x, [(0, p - s) for s, p in zip(shape, padded)])


def gather_local(block, layout: Layout, mesh: ProcessMesh, shape: Sequence[int]):
    """Inside shard_map: this device's stored block of `layout` → its block of `even_part`.

    `block` may carry the leading slot axis of a Partial layout (physical.py)."""
    lead = 1 if layout.partial else 0
    for d in uneven_dims(layout, mesh, shape):
        axes = layout.dims[d]
        block = lax.all_gather(block, axes if len(axes) > 1 else axes[0], axis=d + lead,
                               tiled=True, to="invarying")
        block = lax.slice_in_dim(block, 0, shape[d], axis=d + lead)
    return block


def split_local(block, layout: Layout, mesh: ProcessMesh, shape: Sequence[int]):
    """Inside shard_map: this device's block of `even_part(layout)` → its stored block of
    `layout` (no communication: every device holds the whole dim and keeps its rows)."""
    from .reshard.steps import ensure_varying  # reshard/ builds on this module

    lead = 1 if layout.partial else 0
    sizes = mesh.axis_sizes
    padded = padded_shape(layout, mesh, shape)
    for d in uneven_dims(layout, mesh, shape):
        axes = layout.dims[d]
        n = math.prod(sizes[a] for a in axes)
        widths = [(0, 0)] * block.ndim
        widths[d + lead] = (0, padded[d] - shape[d])
        block = lax.pad(block, np.zeros((), block.dtype), [(lo, hi, 0) for lo, hi in widths])
        index = None  # this device's block number along the dim (major axis first)
        for a in axes:
            i = lax.axis_index(a)
            index = i if index is None else lax.add(lax.mul(index, np.int32(sizes[a])), i)
        step = padded[d] // n
        block = ensure_varying(block, axes)  # it now differs per device along `axes`
        block = lax.dynamic_slice_in_dim(block, lax.mul(index, np.int32(step)), step, axis=d + lead)
    return block


def gathered_bytes(layout: Layout, mesh: ProcessMesh, shape: Sequence[int],
                   itemsize: int) -> list[int]:
    """Bytes one device receives gathering each uneven dim of a stored value whole, in order
    (`gather_local`), counting the padding it receives."""
    padded = padded_shape(layout, mesh, shape)
    local = [p // n for p, n in zip(padded, _counts(layout, mesh))]
    if layout.partial:
        local.insert(0, 1)
    lead = 1 if layout.partial else 0
    out = []
    for d in uneven_dims(layout, mesh, shape):
        before = math.prod(local)
        local[d + lead] = padded[d]
        out.append((math.prod(local) - before) * itemsize)
        local[d + lead] = shape[d]  # the padding is cut off before the next dim is gathered
    return out


__all__ = ["UnevenShardingWarning", "warn_uneven", "uneven_dims", "is_uneven", "padded_shape", "even_part", "pad_global", "gather_local",
           "split_local", "gathered_bytes"]
