"""dist.ring_attention: causal (and full) attention over a sequence split across a mesh dim —
key / value blocks passed around the ring, the softmax accumulated block by block, the
backward a second ring — equal to jax's attention on one device, forward and gradients, with
only collective-permutes over the sequence's mesh dim and a fraction of the memory and bytes
of gathering the keys and values."""
from collections import Counter

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard as dist
from autoshard.hlo import collective_bytes, count_collectives

S, R = dist.Shard, dist.Replicate()
MESHES = {
    "dp×sep": (dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "sep"]), [S(0), S(1)]),
    "sep": (dist.ProcessMesh(list(range(8)), ["sep"]), [S(1)]),
    "dp×sep×mp": (dist.ProcessMesh(np.arange(8).reshape(2, 2, 2), ["dp", "sep", "mp"]),
                  [S(0), S(1), S(2)]),
}


def _qkvw(shape, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape).astype(np.float32) for _ in range(4)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", list(MESHES))
def test_ring_attention_equals_one_device_forward_and_gradients(name, causal):
    mesh, placements = MESHES[name]
    q, k, v, w = _qkvw((4, 32, 4, 8))
    args = [dist.shard_tensor(x, mesh, placements) for x in (q, k, v)]

    def loss(q, k, v):
        return jnp.sum(dist.ring_attention(q, k, v, mesh=mesh, causal=causal) * w)

    def reference(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=causal) * w)

    out = dist.ring_attention(*args, causal=causal)  # eagerly, on DistTensors
    assert out.placements == placements
    np.testing.assert_allclose(out.numpy(), jax.nn.dot_product_attention(q, k, v, is_causal=causal),
                               rtol=1e-5, atol=1e-5)
    grad = dist.jit(jax.grad(loss, argnums=(0, 1, 2)), out_placements=[placements] * 3)
    for got, want in zip(grad(*args), jax.grad(reference, argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)
    plan = grad.plan(*args)
    assert {(c.kind, c.axes) for c in plan.collectives} == {("collective-permute", ("sep",))}
    assert count_collectives(grad.lower(*args).compile().as_text()) == Counter(
        c.kind for c in plan.collectives)


@pytest.mark.parametrize("name", ["dp×sep", "dp×sep×mp"])
def test_grouped_query_heads_travel_unrepeated(name):
    """Grouped-query attention (2 key-value heads for 4 query heads): each block repeats its
    key-value heads locally and sums their gradients back; the ring passes the key / value
    blocks as they are — half the bytes of passing them repeated."""
    mesh, placements = MESHES[name]
    q, k, v, w = _qkvw((4, 32, 4, 8))
    k, v = k[:, :, :2], v[:, :, :2]
    args = [dist.shard_tensor(x, mesh, placements) for x in (q, k, v)]

    def loss(q, k, v):
        return jnp.sum(dist.ring_attention(q, k, v, mesh=mesh) * w)

    def reference(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) * w)

    grad = dist.jit(jax.grad(loss, argnums=(0, 1, 2)), out_placements=[placements] * 3)
    got = grad(*args)
    assert [g.shape for g in got] == [q.shape, k.shape, v.shape]
    for g, want in zip(got, jax.grad(reference, argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-4, atol=1e-5)
    repeated = [dist.shard_tensor(jnp.repeat(x, 2, axis=2), mesh, placements) for x in (k, v)]
    sent = {}
    for what, kv in [("grouped", args[1:]), ("repeated", repeated)]:
        compiled = grad.lower(args[0], *kv).compile()
        sent[what] = sum(collective_bytes(compiled.as_text(), per_step=True).values())
        assert sent[what] == grad.plan(args[0], *kv).total_bytes  # loops counted per trip
    assert sent["grouped"] < 0.8 * sent["repeated"], sent


def _dot_flops(jaxpr) -> float:
    """Matmul flops of the slowest device: a loop's body times its length, a branch (which
    depends on the device) at its most expensive."""
    total = 0.0
    for e in jaxpr.eqns:
        name = e.primitive.name
        if name == "dot_general":
            (lc, _), _ = e.params["dimension_numbers"]
            contracted = np.prod([e.invars[0].aval.shape[d] for d in lc])
            total += 2.0 * np.prod(e.outvars[0].aval.shape) * contracted
        elif name == "cond":
            total += max(_dot_flops(b.jaxpr) for b in e.params["branches"])
        elif name == "scan":
            total += e.params["length"] * _dot_flops(e.params["jaxpr"].jaxpr)
        else:
            assert name != "while", "a loop of unknown length"
            total += sum(_dot_flops(getattr(j, "jaxpr", j))
                         for j in jax.extend.core.jaxprs_in_params(e.params))
    return total


@pytest.mark.parametrize("tokens", [64, 56], ids=["balanced", "24-chunks"])
def test_causal_ring_balances_work_across_devices(tokens):
    """Causal attention needs half the scores. With the zigzag order (chunks i and 2n-1-i on
    device i) every device computes its own block and then half of each other block: the
    slowest device does (n+1)/2n of full attention's matmuls, forward and backward; without
    it (a sequence that is not 2n chunks) the last device computes every block."""
    mesh, placements = MESHES["sep"]
    q, k, v, w = _qkvw((1, tokens, 2, 8))
    work = {}
    for causal in (True, False):
        def loss(q, k, v):
            return jnp.sum(dist.ring_attention(q, k, v, mesh=mesh, causal=causal) * w)
        work[causal] = _dot_flops(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr)
    n = 8
    if tokens % (2 * n) == 0:
        assert work[True] <= (n + 1) / (2 * n) * work[False] * 1.02, work
    else:
        assert work[True] == work[False], work


def test_zigzag_order_from_the_data_pipeline_moves_nothing_extra():
    """Tokens permuted once by dist.zigzag_indices (as a data loader would, with labels and
    positions): order="zigzag" computes the same attention in that order, with only the ring's
    sends — no reordering collectives."""
    mesh, placements = MESHES["dp×sep"]
    q, k, v, w = _qkvw((4, 32, 4, 8))
    idx = dist.zigzag_indices(32, 4)
    assert sorted(idx) == list(range(32)) and list(idx[:4]) == [0, 1, 2, 3] \
        and list(idx[4:8]) == [28, 29, 30, 31]
    args = [dist.shard_tensor(x[:, idx], mesh, placements) for x in (q, k, v)]

    def run(order):
        def loss(q, k, v):
            return jnp.sum(dist.ring_attention(q, k, v, mesh=mesh, order=order) * w[:, idx])
        return dist.jit(jax.grad(loss, argnums=(0, 1, 2)), out_placements=[placements] * 3)

    def reference(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) * w)

    zigzag = run("zigzag")
    for got, want in zip(zigzag(*args), jax.grad(reference, argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(got.numpy(), want[:, idx], rtol=1e-4, atol=1e-5)
    sends = {o: len(run(o).plan(*args).collectives) for o in ("zigzag", "contiguous")}
    # the contiguous order sends q, k, v into the zigzag order, the output's cotangent too,
    # and the three gradients back (2 sends each); the output itself the gradient never reads
    assert sends["contiguous"] == sends["zigzag"] + 14, sends
    assert count_collectives(zigzag.lower(*args).compile().as_text()) == Counter(
        c.kind for c in zigzag.plan(*args).collectives)
    # the bytes, block by block (n = 4 devices, a block 2048 B, a row statistic 256 B): the
    # forward passes k and v n - 1 times; the backward passes the queries (every head has its
    # own keys, so they are the cheaper side): q and the output's gradient n - 1 times, the
    # two row statistics n - 1 times, dq (float32) n times — where passing k, v again (n - 2)
    # and dk, dv (n) would send 36864
    block, rows, n = 2048, 256, 4
    want = 2 * (n - 1) * block + 2 * (n - 1) * block + 2 * (n - 1) * rows + n * block
    assert zigzag.plan(*args).total_bytes == want == 34304


def test_ring_attention_holds_one_block_where_gathering_holds_the_sequence():
    mesh, placements = MESHES["sep"]
    q, k, v, w = _qkvw((1, 1024, 2, 32))
    args = [dist.shard_tensor(x, mesh, placements) for x in (q, k, v)]

    def hint(t):
        return dist.shard_tensor(t, mesh, placements)

    def ring(q, k, v):
        return jnp.sum(dist.ring_attention(q, k, v, mesh=mesh) * w)

    def gathered(q, k, v):  # ContextParallel("p2p") around a plain attention
        return jnp.sum(hint(jax.nn.dot_product_attention(hint(q), hint(k), hint(v),
                                                         is_causal=True)) * w)

    compiled = {}
    for name, fn in [("ring", ring), ("gathered", gathered)]:
        f = dist.jit(jax.grad(fn, argnums=(0, 1, 2)), out_placements=[placements] * 3)
        compiled[name] = f.lower(*args).compile()
    temp = {n: c.memory_analysis().temp_size_in_bytes for n, c in compiled.items()}
    sent = {n: sum(collective_bytes(c.as_text(), per_step=True).values())
            for n, c in compiled.items()}
    assert temp["ring"] * 3 < temp["gathered"], temp
    assert sent["ring"] < sent["gathered"], sent


def test_flax_multi_head_attention_runs_the_ring():
    """flax's nnx.MultiHeadAttention with attention_fn=dist.ring_attention_fn(): the layer
    as written, called with is_causal=True, inside dist.jit on a (dp, sep) split — its output
    and parameter gradients equal flax's own attention on one device."""
    from flax import nnx

    mesh, placements = MESHES["dp×sep"]
    x = np.random.default_rng(3).normal(size=(4, 32, 16)).astype(np.float32)

    def layer(fn):
        return nnx.MultiHeadAttention(4, 16, decode=False, rngs=nnx.Rngs(0),
                                      **({"attention_fn": fn} if fn else {}))

    def loss(model, x):
        return jnp.sum(jnp.sin(model(x, is_causal=True)))

    ring, plain = layer(dist.ring_attention_fn(mesh=mesh)), layer(None)
    graph, state = nnx.split(ring)

    def ring_loss(state, x):
        return loss(nnx.merge(graph, state), x)

    xs = dist.shard_tensor(x, mesh, placements)
    step = dist.jit(jax.grad(ring_loss))
    got = step(state, xs)
    assert ("collective-permute", ("sep",)) in {(c.kind, c.axes) for c in step.plan(state, xs).collectives}
    want = nnx.grad(loss)(plain, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(nnx.state(want))):
        np.testing.assert_allclose(np.asarray(g.numpy() if hasattr(g, "numpy") else g), w,
                                   rtol=1e-4, atol=1e-5)
    with pytest.raises(dist.LocalMapError, match="is_causal=True"):
        dist.jit(lambda s, x: nnx.merge(graph, s)(x, mask=jnp.ones((1, 1, 32, 32), bool)))(
            state, xs)


def test_ring_attention_errors_name_what_to_change():
    mesh, placements = MESHES["dp×sep"]
    q = dist.shard_tensor(np.zeros((4, 32, 4, 8), np.float32), mesh, placements)
    with pytest.raises(dist.LocalMapError, match="mesh dim 'cp'"):
        dist.ring_attention(q, q, q, axis="cp")
    with pytest.raises(dist.LocalMapError, match="must divide"):
        odd = dist.shard_tensor(np.zeros((4, 30, 4, 8), np.float32), mesh, [S(0), R])
        dist.ring_attention(odd, odd, odd)
    with pytest.raises(dist.LocalMapError, match="order='contiguous'"):
        dist.ring_attention(q, q, q, order="zigzag", causal=False)
    with pytest.raises(dist.LocalMapError, match="'zigzag' \\(permuted"):
        dist.ring_attention(q, q, q, order="striped")
    with pytest.raises(dist.LocalMapError, match="2 × 4 chunks"):
        dist.zigzag_indices(20, 4)
    for n in (0, -2, 2.0):  # was a ZeroDivisionError, or indices for "-2 devices"
        with pytest.raises(dist.LocalMapError, match="a positive int"):
            dist.zigzag_indices(16, n)
    for length in (16.0, -16, 0):  # were float indices numpy refused, or an empty order
        with pytest.raises(dist.LocalMapError, match=r"seq_len=.* a positive int"):
            dist.zigzag_indices(length, 4)
    with pytest.raises(dist.LocalMapError, match="multiple of k's"):
        kv = dist.shard_tensor(np.zeros((4, 32, 3, 8), np.float32), mesh, placements)
        dist.ring_attention(q, kv, kv)
