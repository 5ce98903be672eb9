"""Combine: all-gathers that are ready together run as one collective.

Every collective is a rendezvous of the devices in its group, with a fixed launch cost whatever
its size. XLA merges independent all-reduces itself, but its CPU pipeline leaves all-gathers
alone, so a ZeRO-3 layer that gathers a dozen small parameters pays a dozen launches. When an
equation needs a gathered copy, the all-gathers that the next equations of the same scope will
need, over the same mesh axes and from values already computed, are packed into one flat
buffer, gathered once, and unpacked into the copies each of them plans: the same values, one
launch. (Only on CPU: on GPU and TPU XLA combines all-gathers itself.)

Packing copies each member into the buffer and out of it again, and for a moment holds the
gathered bytes twice (buffer and copies), so a group stays within `PACK_BYTES`: one collective
launch on CPU costs ~170 µs (12 gathers of 4 KiB blocks over 8 devices: 3.0 ms apart, 1.2 ms
packed), about the time to copy that much; a larger gather is bandwidth-bound and gains
nothing (a vocab-parallel embedding's 1 MiB of gathered updates runs by itself). Members are
looked for no further ahead than `WINDOW` equations, never past the start of an outlined block
or a custom-rule region (their copies belong to that scope), and a copy read again beyond the
window (a weight reused by the backward pass) is left out, so that nothing is gathered long
before its use (a ZeRO-3 model must not hold the next layers' parameters gathered).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import jax
import numpy as np
from jax import lax

from ..hlo import PACKED_SCOPE
from ..reshard.steps import AllGather, varying_axes
from .dtypes import local_nbytes

ENABLED = True  # off: every gather runs by itself (the tests compare both programs)
PACK_BYTES = 512 * 1024  # gathered bytes of one packed group (see above)
WINDOW = 64     # equations ahead: about one transformer layer's forward

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def wanted(mesh) -> bool:
    """Packing pays where XLA leaves all-gathers apart: its CPU pipeline. On GPU and TPU its
    combiner merges them itself, and its scheduler places them to overlap with compute."""
    return ENABLED and mesh.devices().flat[0].platform == "cpu"


def gather_step(v, rp, own):
    """The all-gather that starts reshard `rp` of value `v` from its own layout, or None."""
    if rp.src != own or not rp.steps or rp.src_mesh != rp.dst_mesh:
        return None
    step = rp.steps[0].step
    return step if type(step) is AllGather else None


def pack_key(x, step: AllGather) -> tuple | None:
    """Members with equal keys can share one buffer (None: never packed)."""
    dtype = np.dtype(x.dtype) if not hasattr(x.dtype, "_impl") else None
    if dtype is None or dtype.kind not in "fiuV" or dtype.itemsize not in _UINT:
        return None  # keys, booleans, complex numbers: gathered by themselves
    # the varying axes are part of the type: one buffer has one. Vectors (norm scales, biases,
    # also as a [1, n] row) go apart from matrices: XLA fuses a vector's slice of the packed
    # buffer into its consumer, which keeps the whole buffer alive as long as that consumer is
    # pending, beside the copies the matrices were unpacked into (a ZeRO-3 GPT's peak memory
    # 0.66x -> 1.17x of jax.jit's with one buffer for both, 0.73x apart)
    vector = sum(n > 1 for n in x.shape) <= 1
    # floats share a buffer only with their own dtype: a bitcast has no derivative, and the
    # program may be differentiated from outside (jax.grad of a dist.jit function: packing
    # f32 params with i32 ids zeroed their gradients); integers of one width share one
    width = dtype if jax.numpy.issubdtype(dtype, jax.numpy.inexact) else dtype.itemsize
    return step.gathered, width, varying_axes(x), vector


def _to_front(x, dim: int):
    if dim == 0:
        return x
    return lax.transpose(x, (dim, *[d for d in range(x.ndim) if d != dim]))


def _from_front(x, dim: int):
    if dim == 0:
        return x
    perm = list(range(1, x.ndim))
    perm.insert(dim, 0)
    return lax.transpose(x, tuple(perm))


def gather_packed(xs: list, steps: list[AllGather]) -> list:
    """Each `xs[i]` gathered as `steps[i]` would (tiled along its dim), in one all-gather."""
    axes = steps[0].gathered
    common = xs[0].dtype if all(x.dtype == xs[0].dtype for x in xs) else \
        _UINT[np.dtype(xs[0].dtype).itemsize]
    flats, fronts = [], []
    for x, s in zip(xs, steps):
        y = _to_front(x, s.dim)
        fronts.append(y.shape)
        y = lax.reshape(y, (math.prod(y.shape),))
        flats.append(y if y.dtype == common else lax.bitcast_convert_type(y, common))
    buf = lax.concatenate(flats, 0)
    # untiled: one row per device, in the order a tiled gather concatenates the blocks. The
    # scope names the count in the op's metadata: hlo.collectives counts each member
    with jax.named_scope(f"{PACKED_SCOPE}{len(xs)}"):
        full = lax.all_gather(buf, axes[0] if len(axes) == 1 else axes, axis=0, tiled=False,
                              to="invarying")
    n, outs, offset = full.shape[0], [], 0
    for x, s, y, front in zip(xs, steps, flats, fronts):
        piece = lax.slice_in_dim(full, offset, offset + y.shape[0], axis=1)
        offset += y.shape[0]
        piece = lax.reshape(piece, (n * front[0], *front[1:]))
        if piece.dtype != x.dtype:
            piece = lax.bitcast_convert_type(piece, x.dtype)
        outs.append(_from_front(piece, s.dim))
    return outs


def pick_members(candidates: Iterable[tuple[Any, Any, Any, AllGather]], first_key: tuple,
                 sizes) -> list:
    """The candidates (value, plan, local block, step) that share the first one's buffer key,
    each (value, target layout) once, while their gathered bytes fit in PACK_BYTES."""
    seen, members, total = set(), [], 0
    for v, rp, x, step in candidates:
        if (v, rp.dst) in seen or pack_key(x, step) != first_key:
            continue
        gathered = local_nbytes(v.shape, v.dtype, rp.steps[0].after, sizes)
        if total + gathered > PACK_BYTES:
            if not members:
                return []  # the first one alone is too big: it runs by itself
            continue
        seen.add((v, rp.dst))
        members.append((v, rp, x, step))
        total += gathered
    return members


def run_packed(members: list, replay: Callable) -> list:
    """The members' gathered copies, through `replay(key, ins, bind)` (equal groups of every
    layer are emitted once and replayed)."""
    xs = [x for _, _, x, _ in members]
    steps = [s for _, _, _, s in members]
    return replay(("packed all-gather", tuple(steps)), xs, lambda: gather_packed(xs, steps))


__all__ = ["ENABLED", "WINDOW", "PACK_BYTES", "wanted", "gather_step", "pack_key",
           "gather_packed", "pick_members", "run_packed"]
