"""Ring attention: attention over a sequence split across a mesh dim, with no device ever
holding the whole keys and values.

    out = dist.ring_attention(q, k, v)     # [batch, seq, heads, head_dim], seq split over "sep"

Each device keeps its queries and passes its key / value block to the next device around the
ring (a collective-permute per step); after as many steps as there are devices every query has
met every key, and the softmax is accumulated block by block (running max and sum, as flash
attention does). The backward pass runs the ring again, recomputing each block's scores from
the saved log-sum-exp, and the key / value gradients travel with their blocks, arriving home
after the last step. Per device: its own queries' scores against one key block at a time, and
two key / value blocks — where the all-gather form (`ContextParallel("p2p")` around a plain
attention) holds a layer's whole keys and values.

Built on `dist.local_map`: it runs eagerly on DistTensors and inside `dist.jit`, where the
blocks are named (the sequence over `axis`, the batch over dp, heads over mp when the mesh has
them) and the plan moves q, k, v there first.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .local_map import LocalMapError, local_map
from .mesh import ProcessMesh, as_process_mesh, get_mesh
from .placement import Replicate, Shard

_NEG = -1e30  # a masked score: finite, so a block with nothing visible adds exp(-1e30 - m) = 0


def _placements(mesh: ProcessMesh, axis: str, shape: tuple) -> list:
    out = []
    for name in mesh.dim_names:
        size = mesh.get_dim_size(name)
        if name == axis:
            out.append(Shard(1))
        elif name == "dp" and shape[0] % size == 0:
            out.append(Shard(0))
        elif name == "mp" and shape[2] % size == 0:
            out.append(Shard(2))
        else:
            out.append(Replicate())
    return out


def _ring(axis: str, n: int, causal: bool, scale: float):
    """The per-device function of the local blocks q, k, v ([b, s, h, d]), differentiable."""
    forward_perm = [(j, (j + 1) % n) for j in range(n)]  # block t steps later: from idx - t

    def scores(q, k, t):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
        if not causal:
            return s
        idx = lax.axis_index(axis)
        src = (idx - t) % n
        rows, cols = q.shape[1], k.shape[1]
        seen = (idx * rows + jnp.arange(rows))[:, None] >= (src * cols + jnp.arange(cols))[None]
        return jnp.where(seen, s, _NEG)

    def forward(q, k, v):
        b, s_q, h, _ = q.shape
        m = jnp.full((b, h, s_q), _NEG, jnp.float32) + 0 * q[..., 0].transpose(0, 2, 1)
        o = jnp.zeros(q.shape, jnp.float32) + 0 * q

        def step(t, carry):
            o, m, l, k, v = carry
            s = scores(q, k, t)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            o = o * corr.transpose(0, 2, 1)[..., None] + jnp.einsum(
                "bhqk,bkhd->bqhd", p, v.astype(jnp.float32))
            return o, m_new, l * corr + p.sum(-1), k, v

        def step_and_pass(t, carry):
            o, m, l, k, v = step(t, carry)
            return o, m, l, lax.ppermute(k, axis, forward_perm), lax.ppermute(v, axis, forward_perm)

        # a loop, not unrolled: one block's scores live at a time. The own block comes first,
        # so every causal row has seen its diagonal before any fully masked block
        carry = lax.fori_loop(0, n - 1, step_and_pass, (o, m, jnp.zeros_like(m), k, v))
        o, m, l, _, _ = step(n - 1, carry)  # the last block needs passing no further
        out = (o / l.transpose(0, 2, 1)[..., None]).astype(q.dtype)
        return out, m + jnp.log(l)

    @jax.custom_vjp
    def attend(q, k, v):
        return forward(q, k, v)[0]

    def attend_fwd(q, k, v):
        out, lse = forward(q, k, v)
        return out, (q, k, v, out, lse)

    def attend_bwd(res, do):
        q, k, v, out, lse = res
        do32 = do.astype(jnp.float32)
        delta = jnp.sum(do32 * out.astype(jnp.float32), -1).transpose(0, 2, 1)  # [b, h, q]

        def step(t, carry):
            dq, k, v, dk, dv = carry
            p = jnp.exp(scores(q, k, t) - lse[..., None])
            dv = dv + jnp.einsum("bhqk,bqhd->bkhd", p, do32)
            ds = p * (jnp.einsum("bqhd,bkhd->bhqk", do32, v.astype(jnp.float32))
                      - delta[..., None])
            dq = dq + jnp.einsum("bhqk,bkhd->bqhd", ds, k.astype(jnp.float32)) * scale
            dk = dk + jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32)) * scale
            # the gradients travel with their blocks: after n moves all are home again
            return (dq, *(lax.ppermute(x, axis, forward_perm) for x in (k, v, dk, dv)))

        zeros = [jnp.zeros(x.shape, jnp.float32) + 0 * x for x in (q, k, v)]
        dq, _, _, dk, dv = lax.fori_loop(0, n, step, (zeros[0], k, v, zeros[1], zeros[2]))
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def ring_attention(q: Any, k: Any, v: Any, *, axis: str = "sep", causal: bool = True,
                   mesh: ProcessMesh | None = None, scale: float | None = None) -> Any:
    """Attention of q over k, v ([batch, seq, heads, head_dim], equal heads: repeat grouped
    key-value heads first) with the sequence split over mesh dim `axis`; see the module
    docstring. `mesh`: the DistTensors' own eagerly, else `dist.set_mesh`'s; required inside
    dist.jit when none is set. `scale` defaults to 1/sqrt(head_dim)."""
    if mesh is None:
        mesh = next((x.mesh for x in (q, k, v) if hasattr(x, "mesh") and
                     isinstance(x.mesh, ProcessMesh)), None) or get_mesh()
    if mesh is None:
        raise LocalMapError("ring_attention needs a mesh: pass mesh=, or call "
                            "dist.auto_parallel.set_mesh(mesh) first")
    mesh = as_process_mesh(mesh)
    if axis not in mesh.dim_names:
        raise LocalMapError(f"ring_attention splits the sequence over mesh dim {axis!r}, but "
                            f"the mesh has dims {mesh.dim_names}: pass axis= one of them")
    shapes = {tuple(x.shape) for x in (k, v)}
    if len(q.shape) != 4 or len(shapes) != 1 or tuple(q.shape[:1] + q.shape[2:]) != \
            tuple(next(iter(shapes))[:1] + next(iter(shapes))[2:]):
        raise LocalMapError(f"ring_attention takes q, k, v as [batch, seq, heads, head_dim] "
                            f"with the same batch, heads and head_dim, got {tuple(q.shape)}, "
                            f"{tuple(k.shape)}, {tuple(v.shape)}: repeat grouped key-value "
                            f"heads first")
    n = mesh.get_dim_size(axis)
    if q.shape[1] % n or k.shape[1] % n:
        raise LocalMapError(f"ring_attention: sequence lengths {q.shape[1]} / {k.shape[1]} "
                            f"must divide by the {n} devices of mesh dim {axis!r}")
    placements = _placements(mesh, axis, tuple(q.shape))
    attend = _ring(axis, n, causal, scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    return local_map(attend, out_placements=[placements], in_placements=[placements] * 3,
                     process_mesh=mesh, reshard_inputs=True)(q, k, v)


__all__ = ["ring_attention"]
