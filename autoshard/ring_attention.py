"""Ring attention: attention over a sequence split across a mesh dim, with no device ever
holding the whole keys and values.

    out = dist.ring_attention(q, k, v)     # [batch, seq, heads, head_dim], seq split over "sep"

Each device keeps its queries and passes its key / value block to the next device around the
ring (a collective-permute per step); after as many steps as there are devices every query has
met every key, and the softmax is accumulated block by block (running max and sum, as flash
attention does). The backward pass runs the ring again, recomputing each block's scores from
the saved log-sum-exp, with whichever side sends fewer bytes travelling: the key / value
blocks with their gradients (grouped-query attention: fewer key heads), or the queries with
the output's gradient, the row statistics and dq (every head with its own keys); the
travelling gradients arrive home after the last step. Per device: its own queries' scores against one key block at a time, and
two key / value blocks — where the all-gather form (`ContextParallel("p2p")` around a plain
attention) holds a layer's whole keys and values.

Causal attention hides half the scores. Split in order, the first device would see one block
and the last all n, and every step waits for the slowest; so each device holds chunks i and
2n-1-i of 2n instead (zigzag), and after its own block computes only the visible half of each
other block — (n+1)/2n of the full work on every device. A sequence held in order is moved
into zigzag order and back inside (two collective-permutes per tensor each way); tokens the
data pipeline already permuted with `zigzag_indices` pass `order="zigzag"` and move nothing.

Built on `dist.local_map`: it runs eagerly on DistTensors and inside `dist.jit`, where the
blocks are named (the sequence over `axis`, the batch over dp, heads over mp when the mesh has
them) and the plan moves q, k, v there first.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .local_map import LocalMapError, local_map
from .mesh import ProcessMesh, as_process_mesh, get_mesh
from .placement import Replicate, Shard

_NEG = -1e30  # a masked score: finite, so a block with nothing visible adds exp(-1e30 - m) = 0


def _placements(mesh: ProcessMesh, axis: str, shape: tuple, kv_heads: int) -> list:
    """The blocks' placements: sequence over `axis`, batch over dp, heads over mp (query and
    key-value heads alike, so each device keeps the key-value heads its queries read)."""
    out = []
    for name in mesh.dim_names:
        size = mesh.get_dim_size(name)
        if name == axis:
            out.append(Shard(1))
        elif name == "dp" and shape[0] % size == 0:
            out.append(Shard(0))
        elif name == "mp" and shape[2] % size == 0 and kv_heads % size == 0:
            out.append(Shard(2))
        else:
            out.append(Replicate())
    return out


def _grouped(x, heads: int):
    """Key / value heads repeated for the query heads that read them (grouped-query
    attention); the ring passes them unrepeated."""
    return x if x.shape[2] == heads else jnp.repeat(x, heads // x.shape[2], axis=2)


def _ungrouped(dx, kv_heads: int):
    """A gradient over the repeated heads summed back onto the key-value heads."""
    b, s, h, d = dx.shape
    return dx if h == kv_heads else dx.reshape(b, s, kv_heads, h // kv_heads, d).sum(3)


def _softmax_step(o, m, l, s, v):
    """The running (output, max, sum) of some query rows after one more block of scores."""
    v = _grouped(v, o.shape[2])
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    o = o * corr.transpose(0, 2, 1)[..., None] + jnp.einsum(
        "bhqk,bkhd->bqhd", p, v.astype(jnp.float32))
    return o, m_new, l * corr + p.sum(-1)


def _block_grads(q, k, v, do, lse, delta, s, scale):
    """(dq, dk, dv) of one block of queries against one block of keys, scores `s` recomputed."""
    kv_heads, k, v = k.shape[2], _grouped(k, q.shape[2]), _grouped(v, q.shape[2])
    p = jnp.exp(s - lse[..., None])
    dv = jnp.einsum("bhqk,bqhd->bkhd", p, do)
    ds = p * (jnp.einsum("bqhd,bkhd->bhqk", do, v.astype(jnp.float32)) - delta[..., None])
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k.astype(jnp.float32)) * scale
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32)) * scale
    return dq, _ungrouped(dk, kv_heads), _ungrouped(dv, kv_heads)


def _rows(x, part, c):
    """Rows (dim 1 of [b, s, ...], dim 2 of [b, h, s]) `part` of a zigzag block: 0 the front
    chunk, 1 the back one, None both."""
    if part is None:
        return x
    return lax.slice_in_dim(x, part * c, (part + 1) * c, axis=1 if x.ndim == 4 else 2)


def _put(x, part, c, value):
    if part is None:
        return value
    return lax.dynamic_update_slice_in_dim(x, value, part * c, axis=1 if x.ndim == 4 else 2)


def _ring(axis: str, n: int, causal: bool, scale: float, zigzag: bool):
    """The per-device function of the local blocks q, k, v ([b, s, h, d]), differentiable.

    `zigzag`: the blocks hold the sequence's chunks (i, 2n-1-i) of 2n (causal only). Then of a
    key block from an earlier device every query sees the front chunk and none the back one;
    of a block from a later device only the back query chunk sees anything, all of it: every
    step after the first computes half a block, unmasked, on every device alike — the causal
    half of the work, balanced. Without it the causal mask hides whole blocks on the first
    devices while the last device computes all of them, and each step waits for the slowest.
    """
    forward_perm = [(j, (j + 1) % n) for j in range(n)]  # block t steps later: from idx - t

    def positions(block, rows):
        if not zigzag:
            return block * rows + jnp.arange(rows)
        c = rows // 2
        return jnp.concatenate([block * c + jnp.arange(c), (2 * n - 1 - block) * c + jnp.arange(c)])

    def scores(q, k, t=None, queries_visit=False):
        """Scores of q against k; with `t`, masked as the block t steps around the ring (the
        keys', or with `queries_visit` the queries'), whole; without, none hidden (a zigzag
        half block)."""
        s = jnp.einsum("bqhd,bkhd->bhqk", q, _grouped(k, q.shape[2]),
                       preferred_element_type=jnp.float32) * scale
        if not causal or t is None:
            return s
        idx = lax.axis_index(axis)
        q_at, k_at = ((idx - t) % n, idx) if queries_visit else (idx, (idx - t) % n)
        seen = positions(q_at, q.shape[1])[:, None] >= positions(k_at, k.shape[1])[None]
        return jnp.where(seen, s, _NEG)

    def visit(t, update, *state, queries_visit=False):
        """`update(query part, key part, t or None, *state)` for the block t steps around:
        the whole block masked, or (zigzag, after the own block) the visible half by itself —
        of keys from an earlier device the front chunk for all queries, from a later one all
        of them for the back query chunk; of visiting queries, the mirror image."""
        if not zigzag or isinstance(t, int) and t == 0:
            return update(None, None, t, *state)
        earlier = (lax.axis_index(axis) - t) % n < lax.axis_index(axis)
        front_keys = lambda *st: update(None, 0, None, *st)  # noqa: E731
        back_queries = lambda *st: update(1, None, None, *st)  # noqa: E731
        return lax.cond(earlier, *((back_queries, front_keys) if queries_visit
                                   else (front_keys, back_queries)), *state)

    def forward(q, k, v):
        b, s_q, h, _ = q.shape
        c = s_q // 2
        m = jnp.full((b, h, s_q), _NEG, jnp.float32) + 0 * q[..., 0].transpose(0, 2, 1)
        o = jnp.zeros(q.shape, jnp.float32) + 0 * q

        def update(qp, kp, t, k, v, o, m, l):
            s = scores(_rows(q, qp, c), _rows(k, kp, c), t)
            o1, m1, l1 = _softmax_step(_rows(o, qp, c), _rows(m, qp, c), _rows(l, qp, c), s,
                                       _rows(v, kp, c))
            return _put(o, qp, c, o1), _put(m, qp, c, m1), _put(l, qp, c, l1)

        # The own block first (every causal row sees its diagonal before anything is hidden),
        # the next one already on its way; then a loop, not unrolled — one block's scores
        # live at a time — each step sending on the block it is about to use.
        o, m, l = visit(0, update, k, v, o, m, jnp.zeros_like(m))
        first = (k, v)
        if n > 1:
            def step(t, carry):
                k, v, o, m, l = carry
                nxt = [lax.ppermute(x, axis, forward_perm) for x in (k, v)]
                return (*nxt, *visit(t, update, k, v, o, m, l))

            k, v = first = tuple(lax.ppermute(x, axis, forward_perm) for x in (k, v))
            if n > 2:
                k, v, o, m, l = lax.fori_loop(1, n - 1, step, (k, v, o, m, l))
            o, m, l = visit(n - 1, update, k, v, o, m, l)  # the last block goes no further
        out = (o / l.transpose(0, 2, 1)[..., None]).astype(q.dtype)
        return out, m + jnp.log(l), first

    @jax.custom_vjp
    def attend(q, k, v):
        return forward(q, k, v)[0]

    def queries_travel(q, k) -> bool:
        """Which blocks the backward ring passes: the keys and values with their gradients
        (the neighbour's block the forward received kept, so n - 2 sends of k and v, n of dk
        and dv in float32), or the queries with the output's gradient, the softmax's saved
        row statistics and their gradient (n - 1 sends each, n of dq): whichever sends fewer
        bytes — the queries where every head has its own keys, the keys where heads share
        them (grouped-query attention)."""
        if n < 3:
            return False
        size = lambda x: math.prod(x.shape)  # noqa: E731
        keys = 2 * (n - 2) * size(k) * k.dtype.itemsize + 2 * n * size(k) * 4
        rows = size(q) // q.shape[-1]
        queries = (2 * (n - 1) * size(q) * q.dtype.itemsize + 2 * (n - 1) * rows * 4
                   + n * size(q) * 4)
        return queries < keys

    def attend_fwd(q, k, v):
        out, lse, first = forward(q, k, v)
        # `first`: the neighbour's key / value block the forward received, kept where the
        # backward passes the keys round, so they are not sent again
        return out, (q, k, v, out, lse, None if queries_travel(q, k) else first)

    def attend_bwd(res, do):
        q, k, v, out, lse, first = res
        c = q.shape[1] // 2
        delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32),
                        -1).transpose(0, 2, 1)  # [b, h, q]

        def grads_into(qp, kp, t, q, k, v, do, lse, delta, dq, dk, dv, queries_visit=False):
            """dq, dk, dv with one block pair's gradients added (parts as `visit` names them)."""
            qr, kr, vr = _rows(q, qp, c), _rows(k, kp, c), _rows(v, kp, c)
            gq, gk, gv = _block_grads(qr, kr, vr, _rows(do, qp, c).astype(jnp.float32),
                                      _rows(lse, qp, c), _rows(delta, qp, c),
                                      scores(qr, kr, t, queries_visit), scale)
            return (_put(dq, qp, c, _rows(dq, qp, c) + gq),
                    _put(dk, kp, c, _rows(dk, kp, c) + gk), _put(dv, kp, c, _rows(dv, kp, c) + gv))

        def passed(*xs):
            return [lax.ppermute(x, axis, forward_perm) for x in xs]

        zeros = [jnp.zeros(x.shape, jnp.float32) + 0 * x for x in (q, k, v)]
        if first is None:
            # the queries travel: each device keeps its keys and values and sums their
            # gradients in place; q, the output's gradient, the row statistics and dq go
            # around, dq arriving home after n moves
            def visitors(qp, kp, t, q, do, lse, delta, dq, dk, dv):
                return (q, do, lse, delta,
                        *grads_into(qp, kp, t, q, k, v, do, lse, delta, dq, dk, dv, True))

            def step(t, carry):
                return visit(t, visitors, *passed(*carry[:5]), *carry[5:], queries_visit=True)

            state = lax.fori_loop(1, n, step, visit(0, visitors, q, do, lse, delta, *zeros))
            dq, dk, dv = passed(state[4])[0], state[5], state[6]
        else:
            # the keys travel, their gradients with them: after n moves all are home again
            def keys(qp, kp, t, k, v, dq, dk, dv):
                return grads_into(qp, kp, t, q, k, v, do, lse, delta, dq, dk, dv)

            def step(t, carry):
                k, v, dq, dk, dv = carry
                k, v, dk, dv = passed(k, v, dk, dv)
                return (k, v, *visit(t, keys, k, v, dq, dk, dv))

            dq, dk, dv = visit(0, keys, k, v, *zeros)
            if n > 1:
                k, v = first  # the neighbour's block, as the forward received it
                dk, dv = passed(dk, dv)
                dq, dk, dv = visit(1, keys, k, v, dq, dk, dv)
                if n > 2:
                    _, _, dq, dk, dv = lax.fori_loop(2, n, step, (k, v, dq, dk, dv))
                dk, dv = passed(dk, dv)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def zigzag_indices(seq_len: int, n: int) -> np.ndarray:
    """The token order that balances causal ring attention over `n` devices: `x[:, idx]`
    puts chunks (i, 2n-1-i) of 2n on device i when the sequence is split evenly. Apply it to
    the tokens, labels and positions once in the data pipeline, then call
    `ring_attention(..., order="zigzag")`: no reordering inside the attention at all.
    `np.argsort(idx)` undoes it."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise LocalMapError(f"zigzag_indices: n={n!r} must be the number of devices the "
                            f"sequence is split over, a positive int")
    if not isinstance(seq_len, (int, np.integer)) or isinstance(seq_len, bool) or seq_len < 1:
        raise LocalMapError(f"zigzag_indices: seq_len={seq_len!r} must be the sequence length, "
                            f"a positive int")
    if seq_len % (2 * n):
        raise LocalMapError(f"zigzag_indices: the sequence length {seq_len} must divide into "
                            f"2 × {n} chunks")
    c = seq_len // (2 * n)
    chunks = [j for i in range(n) for j in (i, 2 * n - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def _to_zigzag(axis: str, n: int):
    """Contiguous blocks (chunks 2i, 2i+1 on device i) → zigzag ones (chunks i, 2n-1-i), and
    back: two collective-permutes each way, as every device receives one even and one odd
    chunk (i + 2n-1-i is odd)."""
    def home(chunk):  # the device holding `chunk` in zigzag order
        return chunk if chunk < n else 2 * n - 1 - chunk

    to_even = [(i, home(2 * i)) for i in range(n)]
    to_odd = [(i, home(2 * i + 1)) for i in range(n)]
    back_even = [(d, s) for s, d in to_even]
    back_odd = [(d, s) for s, d in to_odd]

    def there(x):
        c = x.shape[1] // 2
        even = lax.ppermute(x[:, :c], axis, to_even)
        odd = lax.ppermute(x[:, c:], axis, to_odd)
        first = lax.axis_index(axis) % 2 == 0  # an even device's front chunk is the even one
        return jnp.where(first, jnp.concatenate([even, odd], 1), jnp.concatenate([odd, even], 1))

    def back(x):
        c = x.shape[1] // 2
        first = lax.axis_index(axis) % 2 == 0
        even = jnp.where(first, x[:, :c], x[:, c:])
        odd = jnp.where(first, x[:, c:], x[:, :c])
        return jnp.concatenate([lax.ppermute(even, axis, back_even),
                                lax.ppermute(odd, axis, back_odd)], 1)

    return there, back


def ring_attention(q: Any, k: Any, v: Any, *, axis: str = "sep", causal: bool = True,
                   mesh: ProcessMesh | None = None, scale: float | None = None,
                   order: str = "contiguous") -> Any:
    """Attention of q over k, v ([batch, seq, heads, head_dim]; k and v may have fewer heads,
    a divisor of q's: grouped-query attention, the ring passing them unrepeated) with the
    sequence split over mesh dim `axis`; see the module
    docstring. `mesh`: the DistTensors' own eagerly, else `dist.set_mesh`'s; required inside
    dist.jit when none is set. `scale` defaults to 1/sqrt(head_dim).

    Causal attention is load-balanced when the sequence divides into 2 × devices chunks:
    `order="contiguous"` (the sequence as the user holds it) moves each block to the zigzag
    order and the output back (two collective-permutes per tensor each way);
    `order="zigzag"` says the tokens already are in `zigzag_indices` order (the data pipeline
    permuted them once), and nothing is moved."""
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
    if len(q.shape) != 4 or tuple(k.shape) != tuple(v.shape) or len(k.shape) != 4 or \
            (q.shape[0], q.shape[3]) != (k.shape[0], k.shape[3]) or q.shape[2] % k.shape[2]:
        raise LocalMapError(f"ring_attention takes q, k, v as [batch, seq, heads, head_dim] "
                            f"with the same batch and head_dim, k and v alike, and q's heads a "
                            f"multiple of k's (grouped-query attention), got {tuple(q.shape)}, "
                            f"{tuple(k.shape)}, {tuple(v.shape)}")
    n = mesh.get_dim_size(axis)
    if q.shape[1] % n or k.shape[1] % n:
        raise LocalMapError(f"ring_attention: sequence lengths {q.shape[1]} / {k.shape[1]} "
                            f"must divide by the {n} devices of mesh dim {axis!r}")
    if order not in ("contiguous", "zigzag"):
        raise LocalMapError(f"ring_attention: order={order!r}; write order='contiguous' (the "
                            f"sequence in its own order) or 'zigzag' (permuted by "
                            f"dist.zigzag_indices)")
    balanced = causal and q.shape[1] == k.shape[1] and q.shape[1] % (2 * n) == 0
    if order == "zigzag" and not balanced:
        raise LocalMapError(f"ring_attention: order='zigzag' needs causal attention of a "
                            f"sequence into 2 × {n} chunks (q {q.shape[1]}, k {k.shape[1]} "
                            f"tokens, causal={causal}): use order='contiguous'")
    placements = _placements(mesh, axis, tuple(q.shape), k.shape[2])
    ring = _ring(axis, n, causal, scale if scale is not None else 1 / math.sqrt(q.shape[-1]),
                 zigzag=balanced)
    if balanced and order == "contiguous":
        there, back = _to_zigzag(axis, n)

        def attend(q, k, v):
            return back(ring(there(q), there(k), there(v)))
    else:
        attend = ring
    return local_map(attend, out_placements=[placements], in_placements=[placements] * 3,
                     process_mesh=mesh, reshard_inputs=True)(q, k, v)


def ring_attention_fn(*, axis: str = "sep", mesh: ProcessMesh | None = None,
                      order: str = "contiguous") -> Callable[..., Any]:
    """`ring_attention` as flax's `attention_fn`:
    `nnx.MultiHeadAttention(..., attention_fn=dist.ring_attention_fn())`, called with
    `is_causal=True` for a causal model (flax passes it through). An explicit `mask` or `bias`
    and attention dropout are errors that say what to write: the ring masks by position."""
    def attention(query, key, value, bias=None, mask=None, *, dropout_rate=0.0,
                  deterministic=True, dtype=None, is_causal=False, **_ignored):
        if bias is not None or mask is not None:
            raise LocalMapError(
                "ring_attention_fn takes no mask or bias: the ring masks by position — call "
                "the attention with is_causal=True (flax passes it on) instead of "
                "mask=nnx.make_causal_mask(...), or keep flax's dot_product_attention")
        if dropout_rate and not deterministic:
            raise LocalMapError(f"ring_attention_fn has no attention dropout (dropout_rate="
                                f"{dropout_rate}): set the layer's dropout_rate=0.0")
        out = ring_attention(query, key, value, axis=axis, causal=is_causal, mesh=mesh,
                             order=order)
        return out if dtype is None else out.astype(dtype)

    return attention


__all__ = ["ring_attention", "ring_attention_fn", "zigzag_indices"]
