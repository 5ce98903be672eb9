"""Convolutional models: conv, pooling and their gradients partition without falling back.

A small flax nnx CNN (conv → relu → max pool → conv → avg pool → linear) trains on a 2×4 mesh
with the batch over dp and the conv channels over mp; every step equals one device, no
primitive runs replicated, and the compiled collectives are the planned ones.
"""
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import autoshard as dist
from autoshard.testing import assert_trains_like_one_device, make_tensor, mse_step, nnx_apply
from autoshard.hlo import collective_bytes, count_collectives

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
R, S = dist.Replicate(), dist.Shard


class CNN(nnx.Module):
    def __init__(self, rngs):
        self.conv1 = nnx.Conv(4, 8, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 8, (3, 3), strides=(1, 1), padding="VALID", rngs=rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.conv1(x)), (2, 2), strides=(2, 2))
        x = nnx.avg_pool(jnp.tanh(self.conv2(x)), (2, 2), strides=(1, 1))
        return self.head(x.mean(axis=(1, 2)))


def _placements(path, v):
    # conv1 splits its output channels over mp (a column-parallel conv), conv2 contracts them
    # (row-parallel: its output is a pending sum over mp); the rest is replicated
    name = jax.tree_util.keystr(path)
    if "conv1" in name:
        return [R, S(v.ndim - 1)]
    if "conv2" in name and v.ndim == 4:
        return [R, S(2)]
    return [R, R]


def _trains_like_one_device(model, x, y, x_placements, mesh=MESH, place=None, tx=None):
    """Two optax steps of `model` (an nnx module; params placed by `place(path, value)`,
    replicated by default) through dist.jit equal jax.jit's, with no fallback and the planned
    collectives those compiled; returns the plan and the compiled HLO text."""
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    tx = tx or optax.adam(1e-2)
    step = mse_step(nnx_apply(graphdef), tx)
    place = place or (lambda path, v: [R] * mesh.ndim)
    dp = jax.tree_util.tree_map_with_path(
        lambda path, v: dist.shard_tensor(v, mesh, place(path, v)), params)
    dx = dist.shard_tensor(x, mesh, x_placements)
    state = tx.init(params)
    f = assert_trains_like_one_device(step, dp, params, state, dx, x, y)
    plan = f.plan(dp, state, dx, y)
    assert not plan.fallbacks
    hlo = f.lower(dp, state, dx, y).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)
    return plan, hlo


@pytest.mark.parametrize("channels", ["mp", "replicated"])
def test_cnn_trains_like_one_device(channels):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 12, 12, 4)).astype(np.float32)
    y = rng.normal(size=(8, 4)).astype(np.float32)
    plan, _ = _trains_like_one_device(CNN(nnx.Rngs(0)), x, y, [S(0), R],
                                      place=_placements if channels == "mp" else None)
    # data parallel: the conv activations are never gathered over dp, only gradients reduced
    assert not [c for c in plan.collectives if c.kind == "all-gather" and "dp" in c.axes]
    if channels == "mp":  # the mp-split channels meet once per conv2, as a matmul's would
        assert [c for c in plan.collectives if "mp" in c.axes]


# -- spatial partitioning: a split spatial dim stays split, its edge rows fetched (halo) --------

def _conv(strides=(1, 1), padding="SAME", dilation=None):
    return lambda x, k: jax.lax.conv_general_dilated(
        x, k, strides, padding, rhs_dilation=dilation, dimension_numbers=("NHWC", "HWIO", "NHWC"))


_NETS = {
    # conv → relu → strided conv: the forward slides, the input gradient of the strided conv
    # reads a dilated input, the kernel gradients contract the spatial dims
    "same then strided": lambda x, k, k2: _conv((2, 2))(jax.nn.relu(_conv()(x, k)), k2),
    # a depthwise (grouped) conv: its kernel gradient reshapes a transposed kernel
    "depthwise then dense": lambda x, k, k2: _conv()(jax.lax.conv_general_dilated(
        x, k[:, :, :1, :4], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=4), k2[:, :, :4, :]),
    # asymmetric (causal) padding, then a dilated window reaching past a whole block of 4
    "causal then dilated": lambda x, k, k2: _conv(padding=((4, 4), (6, 6)), dilation=(2, 3))(
        jnp.tanh(_conv(padding=((2, 0), (0, 2)))(x, k)), k2),
}


@pytest.mark.parametrize("net", list(_NETS))
@pytest.mark.parametrize("placements", [[R, S(1)], [S(1), S(2)], [S(0), S(1)], [S(1), R]],
                         ids=["H over mp", "H over dp, W over mp", "batch dp, H mp", "H over dp"])
def test_split_spatial_dims_exchange_edge_rows_instead_of_gathering(net, placements):
    """A convolution over an image split by rows (and columns) keeps it split: each device
    fetches the few rows its window reaches past its block from its neighbours (a
    collective-permute), never gathering the image — forward and gradient equal one device,
    the planned collectives are the compiled ones, and no more bytes move than under jax.jit
    (whose gradient sends more: it all-reduces whole activations where we send edges)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 16, 16, 4)).astype(np.float32)
    k = rng.normal(size=(3, 3, 4, 8)).astype(np.float32) * 0.3
    k2 = rng.normal(size=(5, 5, 8, 4)).astype(np.float32) * 0.3
    f = _NETS[net]
    grad = jax.grad(lambda k, k2, x: jnp.mean(f(x, k, k2) ** 2), (0, 1))
    dx = dist.shard_tensor(x, MESH, placements)
    jm = MESH.to_jax()
    spec = [None] * 4
    for axis, p in zip(MESH.dim_names, placements):
        if isinstance(p, dist.Shard):
            spec[p.dim] = axis
    for fn, args in ((f, (dx, k, k2)), (lambda x, k, k2: grad(k, k2, x), (dx, k, k2))):
        g = dist.jit(fn)
        out = g(*args)
        want = jax.jit(fn)(x, k, k2)
        for o, w in zip(jax.tree.leaves(out, is_leaf=lambda v: isinstance(v, dist.DistTensor)),
                        jax.tree.leaves(want)):
            np.testing.assert_allclose(o.numpy(), w, rtol=2e-4, atol=2e-5)
        plan = g.plan(*args)
        assert not plan.fallbacks
        hlo = g.lower(*args).compile().as_text()
        assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)
        assert collective_bytes(hlo)["collective-permute"] == sum(
            c.bytes_per_device for c in plan.collectives if c.kind == "collective-permute")
        assert not [c for c in plan.collectives if c.kind == "all-gather"]
        assert [c for c in plan.collectives if c.kind == "collective-permute"]
        baseline = jax.jit(fn, in_shardings=(jax.sharding.NamedSharding(
            jm, jax.sharding.PartitionSpec(*spec)), None, None)).lower(x, k, k2).compile()
        assert sum(collective_bytes(hlo).values()) <= sum(
            collective_bytes(baseline.as_text()).values())


_SAME_EVERYWHERE = {
    # the first conv's cotangent is the constant ones of `.sum()`: laid out split by rows,
    # the same on every device, while the kernel is replicated
    "sum plus squares": lambda f, x, k, k2: jax.grad(
        lambda x: f(x, k, k2).sum() + (f(x, k, k2) ** 2).sum())(x),
    # a classifier whose last conv feeds global average pooling and a linear head: the
    # cotangent is the head's gradient spread over the rows; the first kernel's gradient runs
    # through the second conv's input gradient
    "pooled classifier": lambda f, x, k, k2: jax.grad(
        lambda k: (f(x, k, k2).mean((1, 2)) @ jnp.arange(12.0).reshape(4, 3)).sum())(k),
}


@pytest.mark.parametrize("how", list(_SAME_EVERYWHERE))
@pytest.mark.parametrize("net", ["plain", "depthwise", "dilated", "transpose"])
@pytest.mark.parametrize("mesh,placements", [
    (dist.ProcessMesh(list(range(8)), ["x"]), [S(1)]), (MESH, [S(1), S(2)]),
    (MESH, [S(0), S(1)]), (dist.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["a", "b", "c"]),
                           [S(0), S(1), S(1)])], ids=["H over 8", "H dp W mp", "N dp H mp", "2x2x2"])
def test_a_gradient_the_same_on_every_device_through_a_split_image_equals_one_device(
        how, net, mesh, placements):
    """A cotangent that is the same on every device but laid out split by rows reaches a
    convolution whose input rows are fetched from the neighbours: the fetched rows vary over
    the row axes, the replicated kernel does not — the two are made to agree before the conv
    runs (it crashed inside jax with 'varying manual axes to match')."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 16, 16, 4)).astype(np.float32)
    k = rng.normal(size=(3, 3, 4, 4)).astype(np.float32) * 0.3
    k2 = rng.normal(size=(3, 3, 4, 4)).astype(np.float32) * 0.3
    dn = ("NHWC", "HWIO", "NHWC")
    conv = {
        "plain": lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                                           dimension_numbers=dn),
        "depthwise": lambda x, k: jax.lax.conv_general_dilated(
            x, k[:, :, :1, :], (1, 1), "SAME", dimension_numbers=dn, feature_group_count=4),
        "dilated": lambda x, k: jax.lax.conv_general_dilated(
            x, k, (1, 1), "SAME", rhs_dilation=(2, 2), dimension_numbers=dn),
        "transpose": lambda x, k: jax.lax.conv_transpose(x, k, (1, 1), "SAME",
                                                         dimension_numbers=dn),
    }[net]
    f = lambda x, k, k2: conv(jnp.tanh(conv(x, k)), k2)
    fn = lambda x, k, k2: _SAME_EVERYWHERE[how](f, x, k, k2)
    g = dist.jit(fn)
    args = (dist.shard_tensor(x, mesh, placements), k, k2)
    np.testing.assert_allclose(g(*args).numpy(), jax.jit(fn)(x, k, k2), rtol=2e-4, atol=2e-5)
    plan = g.plan(*args)
    assert not plan.fallbacks
    hlo = g.lower(*args).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)
    assert [c for c in plan.collectives if c.kind == "collective-permute"]  # rows fetched


def test_a_causal_sequence_conv_over_a_split_sequence_fetches_its_window_from_the_left():
    """Sequence parallelism through a causal depthwise conv (a Mamba-style short conv): the
    sequence stays split over all 8 devices, each fetching its window - 1 = 3 previous rows —
    from two devices back where a block holds only 2 rows; the first device gets zeros, the
    conv's padding. Trains like one device."""
    class ShortConv(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(8, 8, (4,), padding="CAUSAL", feature_group_count=8, rngs=rngs)
            self.head = nnx.Linear(8, 4, rngs=rngs)

        def __call__(self, x):
            return self.head(jax.nn.silu(self.conv(x)))

    mesh = dist.ProcessMesh(list(range(8)), ["sp"])
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 16, 8)).astype(np.float32)
    y = rng.normal(size=(2, 16, 4)).astype(np.float32)
    plan, _ = _trains_like_one_device(ShortConv(nnx.Rngs(0)), x, y, [S(1)], mesh,
                                      tx=optax.sgd(0.1))
    assert not [c for c in plan.collectives if c.kind == "all-gather"]
    permutes = [c for c in plan.collectives if c.kind == "collective-permute"]
    assert any("from 2 blocks before" in c.step for c in permutes)  # 3 rows, blocks of 2


class SpatialCNN(nnx.Module):
    """Overlapping windows everywhere: SAME convs, a 3×3 stride-2 max pool (ResNet's stem), a
    3×3 average pool, then a global mean."""
    def __init__(self, rngs):
        self.conv1 = nnx.Conv(4, 8, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 8, (5, 5), rngs=rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.conv1(x)), (3, 3), strides=(2, 2), padding="SAME")
        x = nnx.avg_pool(jnp.tanh(self.conv2(x)), (3, 3), strides=(1, 1), padding="SAME")
        return self.head(x.mean(axis=(1, 2)))


@pytest.mark.parametrize("placements", [[S(0), S(1)], [S(1), S(2)]],
                         ids=["batch dp, rows mp", "rows dp, columns mp"])
def test_a_cnn_over_split_images_trains_like_one_device_without_gathering_them(placements):
    """Spatial partitioning end to end: the images stay split by rows (and columns) through
    convolutions, pools and their gradients — edge rows fetched, never an all-gather — and the
    steps equal one device's; the planned collectives and their bytes are the compiled ones."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 16, 16, 4)).astype(np.float32)
    y = rng.normal(size=(4, 4)).astype(np.float32)
    plan, hlo = _trains_like_one_device(SpatialCNN(nnx.Rngs(0)), x, y, placements)
    assert not [c for c in plan.collectives if c.kind == "all-gather"]
    assert collective_bytes(hlo)["collective-permute"] == sum(
        c.bytes_per_device for c in plan.collectives if c.kind == "collective-permute")


def _block(x, k):
    return x + jnp.tanh(_conv()(x, k))


@pytest.mark.parametrize("how", ["checkpoint", "scan", "scan of checkpoints"])
def test_halos_inside_checkpointed_and_scanned_blocks(how):
    """Residual conv blocks over images split by rows, rematerialised and/or scanned over a
    stack of kernels: every result equals one device's, each halo the plan lists runs (the
    backward's recomputation fetches its own halos, as it gathers its own weights, rather
    than holding the forward's), and no image is gathered."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 16, 16, 4)).astype(np.float32)
    ks = rng.normal(size=(3, 3, 3, 4, 4)).astype(np.float32) * 0.3
    forward = {
        "checkpoint": lambda x, ks: jax.checkpoint(_block)(x, ks[0]),
        "scan": lambda x, ks: jax.lax.scan(lambda h, k: (_block(h, k), None), x, ks)[0],
        "scan of checkpoints": lambda x, ks: jax.lax.scan(
            lambda h, k: (jax.checkpoint(_block)(h, k), None), x, ks)[0],
    }[how]
    fn = jax.grad(lambda x, ks: jnp.sum(forward(x, ks) ** 2), (0, 1))
    dx = dist.shard_tensor(x, MESH, [S(1), S(2)])
    g = dist.jit(fn)
    got, want = g(dx, ks), jax.jit(fn)(x, ks)
    for o, w in zip(got, want):
        np.testing.assert_allclose(o.numpy(), w, rtol=1e-4, atol=1e-4)
    plan = g.plan(dx, ks)
    hlo = g.lower(dx, ks).compile().as_text()
    assert count_collectives(hlo) == Counter(c.kind for c in plan.collectives)
    assert not [c for c in plan.collectives if c.kind == "all-gather"]
    assert [c for c in plan.collectives if c.kind == "collective-permute"]


def test_a_pointwise_convolutions_gradient_reads_the_kernel_gathered_once():
    """jax's input gradient of a convolution reverses the kernel's spatial dims; for a 1x1
    kernel that is the kernel itself (as XLA simplifies it), so the gather the forward
    convolution made of it serves the backward one too, and the plan is the compiled program."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 8, 16, 16)).astype(np.float32)
    w = (rng.normal(size=(8, 8, 1, 1)) * 0.3).astype(np.float32)

    def loss(x, w):
        y = jax.nn.relu(jax.lax.conv_general_dilated(x, w, (1, 1), "VALID"))
        return (jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2),
                                      "VALID") ** 2).mean()

    step = jax.grad(loss, argnums=(0, 1))
    dx, dw = make_tensor(x, MESH, [S(0), S(1)]), make_tensor(w, MESH, [S(1), S(1)])
    f = dist.jit(step)
    for got, want in zip(f(dx, dw), jax.jit(step)(x, w)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)
    plan = f.plan(dx, dw)
    assert not [e for e in plan.program.eqns if e.name == "rev"]
    assert [c.kind for c in plan.collectives].count("all-gather") == 1, str(plan)
    assert count_collectives(f.lower(dx, dw).compile().as_text()) == Counter(
        c.kind for c in plan.collectives)


def _conv_over_rows(kernel, stride, dilation, padding):
    return lambda x, w: jax.lax.conv_general_dilated(
        x, w, (stride, 1), [padding, (0, 0)], rhs_dilation=(dilation, 1),
        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _strided_max_pool(x, w):
    return jax.lax.reduce_window(x * w.sum(), -jnp.inf, jax.lax.max, (1, 1, 1, 1), (1, 2, 1, 1),
                                 "VALID")


@pytest.mark.parametrize("rows,kernel,fn", [
    (2, 1, _conv_over_rows(1, 1, 2, (1, 0))),   # a one-row kernel dilated past a padded input
    (2, 1, _conv_over_rows(1, 2, 1, (0, 0))),   # a single output row, from one of the two blocks
    (2, 2, _conv_over_rows(2, 2, 1, (0, 0))),   # a single output row, reading both blocks
    (8, 1, _conv_over_rows(1, 2, 1, (0, 0))),   # a window shorter than its stride
    (8, 1, _strided_max_pool),        # ... pooled: its gradient scatters into unread rows too
], ids=["dilated-one-row-kernel", "one-output-row", "one-output-row-window-2",
        "window-below-stride", "pool-window-below-stride"])
def test_a_split_spatial_dim_with_one_row_windows_or_outputs_equals_one_device(rows, kernel, fn):
    # a kernel or an output of one row is never split: the dim is then not a halo's (a
    # contraction whose kernel would not follow the input's blocks, an output block with no
    # rows), and a window shorter than the stride reads none of a block's last rows
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, rows, 3, 2)).astype(np.float32)
    w = rng.normal(size=(kernel, 1, 2, 2)).astype(np.float32)
    mesh = dist.ProcessMesh([0, 1], ["s"])
    step = jax.value_and_grad(lambda x, w: (fn(x, w) ** 2).sum(), argnums=(0, 1))
    dx, dw = make_tensor(x, mesh, [S(1)]), make_tensor(w, mesh, [R])
    f = dist.jit(step)
    (value, grads), (want_value, want_grads) = f(dx, dw), jax.jit(step)(x, w)
    np.testing.assert_allclose(value.numpy(), want_value, rtol=1e-5)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)
    plan = f.plan(dx, dw)
    assert not plan.fallbacks
    assert count_collectives(f.lower(dx, dw).compile().as_text()) == Counter(
        c.kind for c in plan.collectives)


@pytest.mark.parametrize("dn,x_pl,k_pl", [
    (("NHWC", "HWIO", "NHWC"), ["S(0)", "S(3)"], ["R", "S(3)"]),
    (("NHWC", "HWIO", "NHWC"), ["R", "S(3)"], ["R", "R"]),
    (("NCHW", "OIHW", "NCHW"), ["S(0)", "S(1)"], ["R", "S(0)"]),
])
def test_a_depthwise_conv_with_its_channels_split_moves_nothing(dn, x_pl, k_pl):
    """A depthwise convolution (every feature its own group: MobileNet's, ConvNeXt's) with its
    channels split over devices convolves each device's own channels: no collective, where
    the channels were gathered whole before (found by a probe; jax.jit moves nothing either).
    Its gradients equal one device's."""
    rng = np.random.default_rng(0)
    nhwc = dn[0] == "NHWC"
    x = rng.normal(size=(2, 8, 8, 8) if nhwc else (2, 8, 8, 8)).astype(np.float32)
    k = (rng.normal(size=(3, 3, 1, 8) if nhwc else (8, 1, 3, 3)) * 0.3).astype(np.float32)

    def f(x, k):
        return lax.conv_general_dilated(x, k, (1, 1), "SAME", feature_group_count=8,
                                        dimension_numbers=dn)

    dx, dk = make_tensor(x, MESH, x_pl), make_tensor(k, MESH, k_pl)
    g = dist.jit(f)
    np.testing.assert_allclose(g(dx, dk).numpy(), f(x, k), rtol=1e-4, atol=1e-5)
    assert not g.plan(dx, dk).collectives
    assert not count_collectives(g.lower(dx, dk).compile().as_text())
    loss = lambda x, k: jnp.sum(jnp.sin(f(x, k)) ** 2)  # noqa: E731
    got = dist.jit(jax.grad(loss, argnums=(0, 1)))(dx, dk)
    for a, b in zip(got, jax.grad(loss, argnums=(0, 1))(x, k)):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-4, atol=1e-4)
