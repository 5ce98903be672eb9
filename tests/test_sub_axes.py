"""Sub-axes: a reshape that splits a dim finer than its mesh axis (8 query heads over mp = 4
grouped as 2 key-value heads × 4) is planned on the mesh with that axis split in two (mp.0 ×
mp.1), where it moves nothing — kept when the cost model prices it cheaper, always equal to
one device, with inputs and outputs on the user's mesh."""
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard as dist
from autoshard.compiler import refine
from autoshard.compiler.plan import plan_seconds
from autoshard.compiler.refine import Refinement
from autoshard.hlo import collective_bytes, count_collectives
from autoshard.layout import Layout
from autoshard.placement import ReduceType

R, S = dist.Replicate(), dist.Shard
MESH24 = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
MESH8 = dist.ProcessMesh(list(range(8)), ["mp"])


def _attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _run(f, args, ref_fn, ref_args, atol=1e-5):
    """f(*args) with fallbacks as errors, against ref_fn(*ref_args) on one device; the plan,
    and the compiled program's collectives (which must be the plan's)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        out = f(*args)
    for got, want in zip(jax.tree.leaves(out, is_leaf=lambda a: isinstance(a, dist.DistTensor)),
                         jax.tree.leaves(ref_fn(*ref_args))):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=atol)
    plan = f.plan(*args)
    hlo = count_collectives(f.lower(*args).compile().as_text())
    assert hlo == Counter(c.kind for c in plan.collectives), (hlo, plan.collectives)
    return out, plan, hlo


@pytest.mark.parametrize("mesh,heads,kv,q_placements,split", [
    (MESH24, 8, 2, [S(0), S(2)], ("mp", 2)),
    (MESH8, 16, 2, [S(2)], ("mp", 2)),       # mp = 8 as 2 × 4
    (MESH8, 16, 4, [S(2)], ("mp", 4)),       # mp = 8 as 4 × 2
], ids=["kv 2 of 8 heads over mp 4", "kv 2 of 16 heads over mp 8", "kv 4 of 16 over mp 8"])
def test_grouped_query_heads_stay_where_they_lie(mesh, heads, kv, q_placements, split,
                                                 monkeypatch):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(4, 16, heads, 8)).astype(np.float32)
    k, v = (rng.normal(size=(4, 16, kv, 8)).astype(np.float32) for _ in range(2))
    qd = dist.shard_tensor(q, mesh, q_placements)
    kd, vd = (dist.shard_tensor(a, mesh, [R] * mesh.ndim) for a in (k, v))
    f = dist.jit(_attention)
    out, plan, hlo = _run(f, (qd, kd, vd), _attention, (q, k, v))
    assert plan.refinement is not None and plan.refinement.split == (split,)
    assert not plan.collectives and not hlo
    # the output is the user's: its mesh, its placements, and it feeds the next call as is
    assert out.mesh == mesh and out.placements == q_placements
    again = dist.jit(lambda o, k, v: _attention(o, k, v))(out, kd, vd)
    np.testing.assert_allclose(again.numpy(), _attention(_attention(q, k, v), k, v),
                               rtol=1e-4, atol=1e-5)
    # on the user's mesh alone the heads move (the test would pass without sub-axes otherwise)
    monkeypatch.setattr(refine, "ENABLED", False)
    assert dist.jit(_attention).plan(qd, kd, vd).collectives


def _llama_like(kv: int):
    """A 2-layer grouped-query attention + MLP model (its logits and loss) with Megatron
    placements (the key-value projections replicated: fewer heads than mp devices)."""
    rng = np.random.default_rng(1)
    B, T, D, H, DH, F, V = 8, 16, 32, 8, 4, 64, 64

    def n(*shape):
        return (rng.normal(size=shape) * 0.05).astype(np.float32)
    params = {"embed": n(V, D), "head": n(D, V), "blocks": [
        {"wq": n(D, H * DH), "wk": n(D, kv * DH), "wv": n(D, kv * DH), "wo": n(H * DH, D),
         "up": n(D, F), "down": n(F, D)} for _ in range(2)]}
    placements = {"embed": [R, S(0)], "head": [R, S(1)], "blocks": [
        {"wq": [R, S(1)], "wk": [R, R], "wv": [R, R], "wo": [R, S(0)], "up": [R, S(1)],
         "down": [R, S(0)]} for _ in range(2)]}

    def rms(x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)

    def logits(p, ids):
        x = p["embed"][ids]
        for b in p["blocks"]:
            h = rms(x)
            q = (h @ b["wq"]).reshape(B, T, H, DH)
            k = (h @ b["wk"]).reshape(B, T, kv, DH)
            v = (h @ b["wv"]).reshape(B, T, kv, DH)
            x = x + _attention(q, k, v).reshape(B, T, H * DH) @ b["wo"]
            x = x + jax.nn.gelu(rms(x) @ b["up"]) @ b["down"]
        return rms(x) @ p["head"]

    def loss(p, ids, labels):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits(p, ids)),
                                             labels[..., None], -1))

    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    labels = rng.integers(0, V, (B, T)).astype(np.int32)
    placed = jax.tree.map(lambda a, p: dist.shard_tensor(a, MESH24, p), params, placements,
                          is_leaf=lambda x: isinstance(x, list) and isinstance(x[0], dist.Placement))
    data = [dist.shard_tensor(a, MESH24, [S(0), R]) for a in (ids, labels)]
    return logits, loss, (params, ids, labels), (placed, *data)


def _hlo_bytes(compiled) -> int:
    return sum(collective_bytes(compiled.as_text()).values())


def test_a_grouped_query_model_is_planned_on_sub_axes_when_that_prices_cheaper(monkeypatch):
    # two key-value heads over mp = 4: on the user's mesh the queries move to another dim
    # around each attention (all-to-alls, gathers); on mp.0 × mp.1 every attention is local
    # and each block all-reduces twice, as Megatron does — the bytes of jax.jit with the same
    # input shardings (Shardy splits mp the same way), where the user's mesh alone moved more
    _, loss, args, placed = _llama_like(kv=2)
    f = dist.jit(loss)
    _, plan, hlo = _run(f, placed, loss, args)
    assert plan.refinement is not None
    assert "sub-axes: mp (4) planned as mp.0 × mp.1 (2 × 2)" in str(plan)
    assert set(hlo) == {"all-reduce"}, hlo
    physical = jax.tree.map(lambda t: t.physical, placed,
                            is_leaf=lambda t: isinstance(t, dist.DistTensor))
    xla = _hlo_bytes(jax.jit(loss).lower(*physical).compile())
    ours = _hlo_bytes(f.lower(*placed).compile())
    assert ours <= xla
    monkeypatch.setattr(refine, "ENABLED", False)
    g = dist.jit(loss)
    _, flat, flat_hlo = _run(g, placed, loss, args)
    assert flat.refinement is None
    model = dist.default_cost_model()
    assert plan_seconds(plan, plan.refinement.cost_model(model)) < plan_seconds(flat, model)
    assert sum(hlo.values()) < sum(flat_hlo.values())
    assert _hlo_bytes(g.lower(*placed).compile()) > xla


def test_a_program_that_names_mesh_axes_keeps_the_users_mesh():
    # the user's own shard_map with a psum over mp names the user's axes: no sub-axes there
    # (still one device's values); a sharding constraint is an annotation and is translated
    rng = np.random.default_rng(2)
    q = rng.normal(size=(4, 16, 8, 8)).astype(np.float32)
    k, v = (rng.normal(size=(4, 16, 2, 8)).astype(np.float32) for _ in range(2))
    P = jax.sharding.PartitionSpec
    jmesh = MESH24.to_jax()

    def scaled(o):  # o / its global sum of squares, written with the user's psum
        return o / jax.lax.psum(jnp.sum(o * o), ("dp", "mp"))

    def fn(q, k, v):
        o = _attention(q, k, v)
        return jax.shard_map(scaled, mesh=jmesh, in_specs=P("dp", None, "mp"),
                             out_specs=P("dp", None, "mp"))(o)
    qd = dist.shard_tensor(q, MESH24, [S(0), S(2)])
    kd, vd = (dist.shard_tensor(a, MESH24, [S(0), R]) for a in (k, v))
    _, plan, _ = _run(dist.jit(fn), (qd, kd, vd), fn, (q, k, v))
    assert plan.refinement is None

    sharding = jax.sharding.NamedSharding(jmesh, P("dp", None, "mp"))

    def constrained(q, k, v):
        return jax.lax.with_sharding_constraint(_attention(q, k, v), sharding)
    out, plan, hlo = _run(dist.jit(constrained), (qd, kd, vd), constrained, (q, k, v))
    assert plan.refinement is not None and not hlo
    assert out.placements == [S(0), S(2)]


def test_annotations_scans_gradients_and_eager_reshapes_on_sub_axes():
    rng = np.random.default_rng(3)
    q = rng.normal(size=(4, 16, 8, 8)).astype(np.float32)
    k, v = (rng.normal(size=(4, 16, 2, 8)).astype(np.float32) for _ in range(2))
    kd, vd = (dist.shard_tensor(a, MESH24, [S(0), R]) for a in (k, v))

    def annotated(q, k, v):  # placed inside: the annotation is translated to the sub-axes
        return _attention(dist.shard_tensor(q, MESH24, [S(0), S(2)]), k, v)
    _, plan, hlo = _run(dist.jit(annotated), (q, kd, vd), _attention, (q, k, v))
    assert plan.refinement is not None and not hlo

    def scanned(q, k, v):  # the attention in a loop body, planned on the same sub-axes
        def body(x, _):
            return _attention(x, k, v), None
        return jax.lax.scan(body, q, None, length=2)[0]
    qd = dist.shard_tensor(q, MESH24, [S(0), S(2)])
    _, plan, hlo = _run(dist.jit(scanned), (qd, kd, vd), scanned, (q, k, v))
    assert plan.refinement is not None and not hlo

    # differentiated from outside: the program's outputs are reduced for jax.grad
    f = dist.jit(_attention)

    def outer(q):
        return jnp.sum(f(q, kd, vd) ** 2)
    got = jax.grad(outer)(qd)
    want = jax.grad(lambda q: jnp.sum(_attention(q, k, v) ** 2))(q)
    np.testing.assert_allclose(np.asarray(got.numpy() if hasattr(got, "numpy") else got), want,
                               rtol=1e-4, atol=1e-5)

    # an eager reshape into (kv, group) ends on the user's mesh, values as one device
    grouped = qd.reshape(4, 16, 2, 4, 8)
    assert grouped.mesh == MESH24
    np.testing.assert_array_equal(grouped.numpy(), q.reshape(4, 16, 2, 4, 8))


P_SUM = (("mp.0", ReduceType.SUM), ("mp.1", ReduceType.SUM))


@pytest.mark.parametrize("user,refined", [
    (Layout((("dp",), ("mp",))), Layout((("dp",), ("mp.0", "mp.1")))),
    (Layout((("dp", "mp"), ())), Layout((("dp", "mp.0", "mp.1"), ()))),
    (Layout(((), ()), (("mp", ReduceType.SUM),)), Layout(((), ()), P_SUM)),
])
def test_layouts_cross_between_the_users_mesh_and_its_sub_axes(user, refined):
    r = Refinement(MESH24, (("mp", 2),))
    assert r.mesh.dim_names == ["dp", "mp.0", "mp.1"] and r.mesh.shape == [2, 2, 2]
    assert r.mesh.process_ids == MESH24.process_ids
    assert r.refined(user) is refined
    assert r.user(refined) is user
    assert r.coarsened(refined) is refined


@pytest.mark.parametrize("lone,coarse", [
    (Layout((("mp.0",), ())), Layout(((), ()))),                      # major half alone
    (Layout((("mp.1", "mp.0"), ())), Layout(((), ()))),               # halves out of order
    (Layout((("dp",), ("mp.1",))), Layout((("dp",), ()))),
    (Layout(((), ()), (("mp.1", ReduceType.SUM),)), Layout(((), ()))),  # reduced over one half
])
def test_a_lone_sub_axis_has_no_layout_on_the_users_mesh(lone, coarse):
    r = Refinement(MESH24, (("mp", 2),))
    assert r.user(lone) is None
    assert r.coarsened(lone) is coarse
    assert r.user(coarse) is not None


def test_to_static_trains_and_serves_a_grouped_query_model():
    # the Paddle-style entry: the train step stays on the user's mesh (its replicated key-value
    # weights come back replicated), predict and eval run on sub-axes; all equal one device
    import optax

    apply, _, (params, ids, labels), (placed, dids, dlabels) = _llama_like(kv=2)
    def ce(logits, labels):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1))
    m = dist.to_static((apply, placed), None, ce, optax.sgd(0.1))
    p, want = jax.tree.map(jnp.asarray, params), []
    for _ in range(2):
        value, g = jax.value_and_grad(lambda p: ce(apply(p, ids), labels))(p)
        want.append(float(value))
        p = jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    got = [float(m(dids, dlabels).numpy()) for _ in range(2)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    out = m.predict()(dids)
    np.testing.assert_allclose(out.numpy(), apply(p, ids), rtol=1e-4, atol=1e-5)
    assert out.mesh == MESH24
    predict = m.programs()["predict"]
    assert predict.plan(*m.program_args("predict", dids)).refinement is not None
    np.testing.assert_allclose(float(m.eval()(dids, dlabels).numpy()),
                               float(ce(apply(p, ids), labels)), rtol=1e-5)


def test_an_nnx_grouped_query_module_and_its_gradient_on_sub_axes():
    # a free output left on a lone sub-axis (the key-value kernels' gradients: split over mp.0
    # only) is finished on the user's mesh the cheaper way: gathered, or split finer over the
    # whole axis (here: its sum over mp.1 reduce-scattered, not all-reduced then gathered)
    from flax import nnx

    class GQA(nnx.Module):
        def __init__(self, d, heads, kv, rngs):
            self.heads, self.kv, self.dh = heads, kv, d // heads
            self.q = nnx.Linear(d, d, use_bias=False, rngs=rngs)
            self.k = nnx.Linear(d, kv * self.dh, use_bias=False, rngs=rngs)
            self.v = nnx.Linear(d, kv * self.dh, use_bias=False, rngs=rngs)
            self.o = nnx.Linear(d, d, use_bias=False, rngs=rngs)

        def __call__(self, x):
            B, T, _ = x.shape
            q = self.q(x).reshape(B, T, self.heads, self.dh)
            k = self.k(x).reshape(B, T, self.kv, self.dh)
            v = self.v(x).reshape(B, T, self.kv, self.dh)
            return self.o(_attention(q, k, v).reshape(B, T, -1))

    def loss(m, x):
        return jnp.mean(m(x) ** 2)
    x = np.random.default_rng(4).normal(size=(8, 16, 32)).astype(np.float32)
    m, ref = GQA(32, 8, 2, nnx.Rngs(0)), GQA(32, 8, 2, nnx.Rngs(0))
    for layer, placements in (("q", [R, S(1)]), ("o", [R, S(0)]), ("k", [R, R]), ("v", [R, R])):
        kernel = getattr(m, layer).kernel
        kernel.set_value(dist.shard_tensor(kernel.get_value(), MESH24, placements))
    xd = dist.shard_tensor(x, MESH24, [S(0), R])
    forward, grad = dist.jit(lambda m, x: m(x)), dist.jit(nnx.grad(loss))
    np.testing.assert_allclose(forward(m, xd).numpy(), ref(x), rtol=1e-4, atol=1e-5)
    assert forward.plan(m, xd).refinement is not None
    got, want = grad(m, xd), nnx.grad(loss)(ref, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-6)
    plan = grad.plan(m, xd)
    assert plan.refinement is not None
    assert Counter(c.kind for c in plan.collectives) == \
        count_collectives(grad.lower(m, xd).compile().as_text())
    assert "all-gather" not in {c.kind for c in plan.collectives}


@pytest.mark.parametrize("lone,shape,finer", [
    (Layout((("mp.0",), ())), (8, 4), Layout((("mp.0", "mp.1"), ()))),
    (Layout(((), ("mp.1",))), (8, 4), Layout(((), ("mp.0", "mp.1")))),
    (Layout((("dp", "mp.0"), ()), ((("mp.1", ReduceType.SUM),))), (8, 4),
     Layout((("dp", "mp.0", "mp.1"), ()))),            # the Partial half reduce-scattered in
    (Layout((("mp.0",), ("mp.1",))), (8, 4), None),    # the other half splits another dim
    (Layout((("mp.0",), ())), (2, 4), None),           # 2 rows cannot split over 4
])
def test_a_lone_sub_axis_joined_by_its_other_half(lone, shape, finer):
    r = Refinement(MESH24, (("mp", 2),))
    assert r.completed(lone, shape) is finer
