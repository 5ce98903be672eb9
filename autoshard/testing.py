"""Testing helpers: a host-side reference for DistTensors, and adversarial Partial tensors.

`logical_value` rebuilds the logical value from the device shards with numpy alone (checking
that replicas agree); `make_tensor` builds Partial tensors whose per-device values differ
unevenly and at random, so a wrong rule or reshard cannot pass by coincidence. Used by the test
suite and by the rule validator; useful to anyone writing a rule.
"""
from __future__ import annotations

import itertools

import jax
import numpy as np

from . import creation as _creation
from .dtensor import DistTensor
from .layout import block_bounds, layout_from_placements, partial_index
from .mesh import ProcessMesh
from .placement import ReduceType, narrow_float
from .uneven import even_part


def logical_value(x: DistTensor) -> np.ndarray:
    """The logical value of `x`, reduced on the host from every device's shard. Typed PRNG
    keys (which have no numpy form) give their key data: one more dim, of uint32 words.

    Also checks honesty: the physical block shapes, and that replicas agree.
    """
    mesh, layout = x.mesh, x.layout
    partial = layout.partial_map
    keys = jax.dtypes.issubdtype(x.physical.dtype, jax.dtypes.prng_key)
    shards = {s.device.id: np.asarray(jax.random.key_data(s.data) if keys else s.data)
              for s in x.physical.addressable_shards}
    groups: dict[tuple, list[np.ndarray]] = {}
    where: dict[tuple, tuple] = {}
    for coords in itertools.product(*(range(s) for s in mesh.shape)):
        data = shards[int(mesh.id_array[coords])]
        if partial:
            assert data.shape[0] == 1, "a partial tensor keeps one slot per device"
            data = data[0]
        assert data.shape[:x.ndim] == x.local_shape
        key = tuple(c for c, n in zip(coords, mesh.dim_names) if n not in partial)
        groups.setdefault(key, []).append(data)
        where[key] = block_bounds(layout, mesh, x.shape, coords)
    first = next(iter(shards.values()))
    # (a key's words: the dims key_data adds after the stored array's own)
    out = np.empty(tuple(x.shape) + first.shape[x.physical.ndim:], dtype=first.dtype)
    kinds = set(partial.values())
    avg_div = int(np.prod([mesh.get_dim_size(a) for a, t in partial.items() if t.value == "avg"]))
    for key, datas in groups.items():
        stack = np.stack(datas)
        if not kinds:
            for d in datas[1:]:
                np.testing.assert_array_equal(d, datas[0], err_msg="replicas disagree")
            value = datas[0]
        elif kinds <= {ReduceType.SUM, ReduceType.AVG}:
            if avg_div > 1 and narrow_float(stack.dtype):  # a mean's parts: summed in float32
                stack = stack.astype(np.float32)
            value = stack.sum(0) / avg_div
        elif kinds == {ReduceType.MAX}:
            value = stack.max(0)
        else:
            value = stack.min(0)
        # an uneven dim's last blocks end in padding (uneven.py): only the owned rows count
        out[tuple(slice(lo, hi) for lo, hi in where[key])] = value[
            tuple(slice(0, hi - lo) for lo, hi in where[key])]
    return out


def make_tensor(value: np.ndarray, mesh: ProcessMesh, placements, seed: int = 0):
    """A DistTensor of logical `value`, whose partial values are split unevenly and at random."""
    layout = layout_from_placements(placements, mesh, value.shape)
    partial = layout.partial_map
    if not partial:
        return _creation.shard_tensor(value, mesh, placements)
    even = even_part(layout, mesh, value.shape)
    if even is not layout:  # random parts on the even layout, then stored padded
        from .reshard.api import reshard

        return reshard(make_tensor(value, mesh, even.placements(mesh), seed), mesh, placements)
    rng = np.random.default_rng(seed)
    axes = [a for a in mesh.dim_names if a in partial]
    kinds = set(partial.values())
    k = int(np.prod([mesh.get_dim_size(a) for a in axes]))
    avg_div = int(np.prod([mesh.get_dim_size(a) for a in axes if partial[a].value == "avg"]))
    parts_by_block: dict[tuple, list[np.ndarray]] = {}

    def parts_for(bounds):
        if bounds not in parts_by_block:
            block = value[tuple(slice(lo, hi) for lo, hi in bounds)]
            noise = rng.integers(-5, 6, size=(k,) + block.shape).astype(value.dtype)
            if kinds <= {ReduceType.SUM, ReduceType.AVG}:
                noise[-1] = block * avg_div - noise[:-1].sum(0)
            else:
                sign = -1 if kinds == {ReduceType.MAX} else 1
                noise = block + sign * np.abs(noise) + sign  # strictly worse than the value
                owner = rng.integers(0, k, size=block.shape)
                np.put_along_axis(noise, owner[None], block[None], axis=0)
            parts_by_block[bounds] = list(noise)
        return parts_by_block[bounds]

    def block_of(coords):
        bounds = block_bounds(layout, mesh, value.shape, coords)
        return parts_for(bounds)[partial_index(layout, mesh, coords)]

    return _creation.dtensor_from_local(block_of, mesh, placements)


# -- train steps against one device --------------------------------------------------------------

def mse_step(apply, tx):
    """A train step `(params, opt_state, x, y) -> (params, opt_state, loss)`: the mean squared
    error of `apply(params, x)` against `y`, then one update of the optax transformation `tx`."""
    import jax
    import jax.numpy as jnp
    import optax

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((apply(p, x) - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def token_streams(steps: int, batch: int, seq: int, vocab: int, *, mul: int = 5, add: int = 3,
                  jump: float = 0.1, seed: int = 0):
    """`steps` batches of (ids, next ids) [batch, seq]: streams that mostly follow
    t' = (mul t + add) mod vocab and sometimes jump at random — learnable, a little noisy."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        tokens = np.empty((batch, seq + 1), np.int32)
        tokens[:, 0] = rng.integers(0, vocab, batch)
        for i in range(1, seq + 1):
            jumps = rng.random(batch) < jump
            tokens[:, i] = np.where(jumps, rng.integers(0, vocab, batch),
                                    (mul * tokens[:, i - 1] + add) % vocab)
        yield tokens[:, :-1], tokens[:, 1:]


def ce_step(apply, tx):
    """A train step `(params, opt_state, x, labels) -> (params, opt_state, loss)`: optax's
    integer-label cross-entropy of the logits `apply(params, x)`, then one update of `tx`."""
    import jax
    import optax

    def step(params, opt_state, x, labels):
        def loss(p):
            return optax.softmax_cross_entropy_with_integer_labels(apply(p, x), labels).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def nnx_apply(graphdef):
    """`apply(params, x)` of a flax nnx model split into `graphdef` and a pure dict of params."""
    from flax import nnx

    return lambda params, x: nnx.merge(graphdef, nnx.State(params))(x)


def assert_trains_like_one_device(step, dist_params, params, opt_state, dist_x, x, y, *,
                                  steps: int = 2):
    """Run `steps` of `step` through dist.jit (DistTensor params and input) and through
    jax.jit (arrays) from the same start; every loss and the final params must agree, and no
    primitive may fall back to running replicated. Returns the dist.jit function."""
    import warnings

    import jax

    from .compiler.jit import jit
    from .compiler.plan import FallbackWarning

    f = jit(step)
    dist_state = opt_state
    for _ in range(steps):
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            dist_params, dist_state, loss = f(dist_params, dist_state, dist_x, y)
        params, opt_state, ref_loss = jax.jit(step)(params, opt_state, x, y)
        np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    is_dt = lambda t: isinstance(t, DistTensor)  # noqa: E731
    for got, want in zip(jax.tree.leaves(dist_params, is_leaf=is_dt), jax.tree.leaves(params)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)
    return f
