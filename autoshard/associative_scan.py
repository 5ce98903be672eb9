"""Associative scans along a split axis: linear recurrences (Mamba / S5 / linear attention's
`h_t = a_t * h_{t-1} + b_t`) over a sequence split across devices.

    h = dist.associative_scan(combine, (a, b), axis=1, mesh_dim="sep")

`jax.lax.associative_scan` is a tree of strided slices over the whole axis: on a split axis
every level reads rows of other devices, and the plan gathers the sequence. This scans in
blocks instead, one per device of the split: each device scans its own block, the block totals
(one row per device) are scanned across blocks, and each block folds in the total of the blocks
before it — the same combine applied in the same order, so the result equals the whole-axis
scan (up to float reassociation, as jax's own tree is). It is plain jax (a reshape of the axis
into (blocks, rows) and scans along each), differentiated by jax like the rest of the model;
the plan keeps the blocks where they are and moves only the totals.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from .dtensor import is_dist_tensor
from .errors import PlacementError
from .layout import layout_from_placements
from .mesh import ProcessMesh, as_process_mesh, get_mesh
from .placement import Replicate, Shard, normalize_placements


class ScanBlocksError(PlacementError):
    """dist.associative_scan cannot tell or use the number of blocks."""


def _split_of(placements, mesh: ProcessMesh, axis: int, ndim: int) -> int:
    return math.prod(mesh.get_dim_size(name) for name, p in zip(mesh.dim_names, placements)
                     if p.is_shard() and p.get_dim() % ndim == axis)


def _totals_placements(placements, axis: int, ndim: int) -> list:
    """The block totals' placements on the (…, blocks, 1, …) view of the input: the blocks dim
    whole (one row per device, gathered so the scan across blocks is local everywhere), the
    dims after it one further, the rest as the input's."""
    return [Replicate() if p.is_shard() and p.get_dim() % ndim == axis else
            Shard(p.get_dim() % ndim + 1) if p.is_shard() and p.get_dim() % ndim > axis else p
            for p in placements]


def _placed_whole(scan: Callable, leaves: list, mesh, placements: list) -> list:
    """`scan` of the arrays annotated with `placements` on `mesh`, its results too."""
    from .creation import shard_tensor

    xs = [shard_tensor(x, mesh, placements) for x in leaves]
    return [shard_tensor(y, mesh, placements) for y in scan(*xs)]


def _scan_blocked(fn: Callable, leaves: list, tree: Any, axis: int, reverse: bool, n: int,
                  hint: Callable | None = None) -> list:
    """`hint(x, i)`: leaf i's block totals (or their shifted running totals) placed whole."""
    rows = leaves[0].shape[axis] // n
    blocked = [x.reshape(x.shape[:axis] + (n, rows) + x.shape[axis + 1:]) for x in leaves]

    def scan(xs, along):
        return jax.tree.leaves(lax.associative_scan(fn, jax.tree.unflatten(tree, xs),
                                                    reverse=reverse, axis=along))

    local = scan(blocked, axis + 1)                      # each block by itself
    edge = 0 if reverse else rows - 1
    totals = [lax.slice_in_dim(x, edge, edge + 1, axis=axis + 1) for x in local]
    if hint is not None:
        totals = [hint(t, i) for i, t in enumerate(totals)]
    running = scan(totals, axis)                         # across blocks: one row each
    # the blocks before each block (after it, reversed) combined: the running totals moved by
    # one block; the first block (the last, reversed) has none and keeps its own scan
    shift = -1 if reverse else 1
    before = [jnp.roll(r, shift, axis=axis) for r in running]
    if hint is not None:  # whole along the blocks, and so their gradients
        before = [hint(b, i) for i, b in enumerate(before)]

    def fold(before):
        return jax.tree.leaves(fn(jax.tree.unflatten(tree, before),
                                  jax.tree.unflatten(tree, local)))

    # one row per block, broadcast by fn itself where it can (its gradient then keeps the row,
    # not a block-sized copy of it); else broadcast first
    try:
        fits = [tuple(y.shape) for y in jax.eval_shape(fold, before)] == \
            [tuple(x.shape) for x in local]
    except (TypeError, ValueError):
        fits = False
    folded = fold(before if fits else
                  [jnp.broadcast_to(b, x.shape) for b, x in zip(before, local)])
    first = jnp.arange(n) == (n - 1 if reverse else 0)
    out = [jnp.where(first.reshape((1,) * axis + (n, 1) + (1,) * (x.ndim - axis - 2)), x, f)
           for x, f in zip(local, folded)]
    return [x.reshape(x.shape[:axis] + (n * rows,) + x.shape[axis + 2:]) for x in out]


def associative_scan(fn: Callable, elems: Any, *, axis: int = 0, reverse: bool = False,
                     placements: Sequence | None = None, mesh: ProcessMesh | None = None,
                     blocks: int | None = None) -> Any:
    """`jax.lax.associative_scan(fn, elems, reverse, axis)` computed in blocks along a split
    axis (see the module docstring).

    On DistTensors, eagerly: one `dist.jit` program, the results placed as the inputs.
    Inside `dist.jit`: pass the arrays' `placements` (and `mesh=`, or `set_mesh`), as for
    `local_map`: the blocks follow the mesh dims that split `axis`, and the block totals are
    gathered over them alone. On plain arrays: `blocks=`."""
    leaves, tree = jax.tree.flatten(elems, is_leaf=is_dist_tensor)
    if not leaves:
        raise ScanBlocksError("dist.associative_scan needs at least one array to scan")
    ndim = len(leaves[0].shape)
    if not -ndim <= axis < ndim:
        raise ScanBlocksError(f"dist.associative_scan: axis {axis} is out of range for the "
                              f"{ndim}-d array of shape {tuple(leaves[0].shape)}: pass an axis "
                              f"in {-ndim}..{ndim - 1}" if ndim else
                              "dist.associative_scan: a scalar has no axis to scan: pass arrays "
                              "with the scanned axis")
    axis %= ndim
    length = leaves[0].shape[axis]
    # as jax's scan: the arrays may differ in shape (a decay (L, 1) beside inputs (L, d)) but
    # share the scanned axis
    if any(len(x.shape) <= axis or x.shape[axis] != length for x in leaves):
        raise ScanBlocksError(f"dist.associative_scan: the arrays scanned together need one "
                              f"length along axis {axis}, got {[tuple(x.shape) for x in leaves]}")
    placed = [x for x in leaves if is_dist_tensor(x)]
    if placed:
        mesh, placements = placed[0].mesh, list(placed[0].placements)
        if any(x.mesh != mesh or list(x.placements) != placements for x in placed[1:]):
            raise ScanBlocksError("dist.associative_scan: the DistTensors scanned together "
                                  "must be placed alike: reshard them to one placements list")
    elif placements is not None:
        mesh = mesh if mesh is not None else get_mesh()
        if mesh is None:
            raise ScanBlocksError("dist.associative_scan(placements=...) needs the mesh: pass "
                                  "mesh=, or call dist.auto_parallel.set_mesh(mesh) first")
        mesh = as_process_mesh(mesh)
        if len(placements) != mesh.ndim:
            raise ScanBlocksError(f"dist.associative_scan: placements {list(placements)} name "
                                  f"{len(placements)} mesh dims, the mesh has {mesh.dim_names}")
    elif blocks is None:
        raise ScanBlocksError(
            "dist.associative_scan cannot see how the scanned axis is split: inside dist.jit "
            "pass placements= (the arrays' placements, e.g. [dist.Shard(0), dist.Shard(1)]) "
            "and mesh=; on plain arrays pass blocks=")
    if placements is not None:
        # checked against every array (short forms read, Shard dims in range): each array's
        # split of the scanned axis makes the blocks, one count for all
        placements = list(normalize_placements(placements, mesh.ndim, mesh.dim_names))
        for x in leaves:
            layout_from_placements(placements, mesh, tuple(x.shape),
                                   what="a scanned array")
        splits = {_split_of(placements, mesh, axis, len(x.shape)) for x in leaves}
        if len(splits) > 1:
            raise ScanBlocksError(
                f"dist.associative_scan: placements {placements} split axis {axis} of the "
                f"arrays {[tuple(x.shape) for x in leaves]} into different numbers of blocks "
                f"{sorted(splits)}: name the scanned dim with a non-negative Shard dim")
    n = blocks if placements is None else splits.pop()
    if n < 1:
        raise ScanBlocksError(f"dist.associative_scan: blocks={n}; pass a positive number of "
                              f"blocks (the devices axis {axis} is split over)")
    def associative_scan(*xs):  # jax's scan of the whole axis, on the flat leaves
        return jax.tree.leaves(lax.associative_scan(
            fn, jax.tree.unflatten(tree, list(xs)), reverse=reverse, axis=axis))

    if length % n and placements is not None:
        # an uneven split is stored padded and computed whole, as everywhere (uneven.py: the
        # program's UnevenShardingWarning names the dim)
        if not placed:  # traced: the placements are hints, as in the blocked path
            return jax.tree.unflatten(tree, _placed_whole(associative_scan, leaves, mesh,
                                                          placements))
        from .compiler.jit import jit

        return jax.tree.unflatten(tree, jit(
            associative_scan, out_placements=[placements] * len(leaves))(*leaves))
    if length % n:
        raise ScanBlocksError(f"dist.associative_scan: axis {axis} of length {length} does not "
                              f"divide into {n} blocks (one per device it is split over): pad "
                              f"the sequence to a multiple of {n}")
    if n == 1:
        if placements is None or placed:
            return lax.associative_scan(fn, elems, reverse=reverse, axis=axis)
        # the scanned axis whole on every device: a scan of the blocks as they are, the
        # placements kept as hints (the inputs may arrive unplaced: they name the mesh)
        return jax.tree.unflatten(tree, _placed_whole(associative_scan, leaves, mesh,
                                                      placements))
    if placements is None:
        return jax.tree.unflatten(tree, _scan_blocked(fn, leaves, tree, axis, reverse, n))
    from .creation import shard_tensor

    def whole_blocks(ndim: int):
        totals = _totals_placements(placements, axis, ndim)

        def hint(t):
            # a hint to the plan of a traced program; a concrete value (jax.grad run eagerly
            # hands the rules concrete arrays) passes as it is: a custom_vjp rule must give
            # back arrays, not DistTensors
            return shard_tensor(t, mesh, totals) if isinstance(t, jax.core.Tracer) else t

        @jax.custom_vjp
        def place(t):
            return hint(t)

        # the gradient of the totals too: else the plan, placing the backward's small scan on
        # its own, splits it on another dim and pads it back to block size before moving it
        place.defvjp(lambda t: (hint(t), None), lambda _, ct: (hint(ct),))
        return place

    hints = [whole_blocks(len(x.shape)) for x in leaves]

    def run(*xs):
        out = _scan_blocked(fn, list(xs), tree, axis, reverse, n,
                            hint=lambda t, i: hints[i](t))
        return [shard_tensor(x, mesh, placements) for x in out]

    if placed:
        # eagerly: one program, each result placed as its input was
        from .compiler.jit import jit

        return jax.tree.unflatten(tree, jit(run, out_placements=[placements] * len(leaves))(
            *leaves))
    return jax.tree.unflatten(tree, run(*leaves))


__all__ = ["associative_scan", "ScanBlocksError"]
