"""A GPT train step (embedding, positions, layernorm, causal attention, gelu MLP, vocab-parallel
head and cross-entropy, value_and_grad, optax) three ways on a 2×4 (dp, mp) mesh with Megatron
placements: loss and gradients equal one device, dropout masks equal, no fallback, and no more
collective bytes than plain jax.jit with the same input shardings."""
import warnings

import jax
import numpy as np
import optax
import pytest

import autoshard as dist
from autoshard.hlo import collective_bytes, count_collectives

from autoshard.bench import gpt
from autoshard.bench.workloads import keep_placements

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "mp"])
LAYERS = 2


def _is_dt(x):
    return isinstance(x, dist.DistTensor)


@pytest.mark.parametrize("outputs", ["kept", "free"])
@pytest.mark.parametrize("form", ["unrolled", "scan", "remat"])
def test_gpt_train_step_equals_one_device(form, outputs):
    step, (params, state, ids, labels, key), (dparams, _, dids, dlabels, _) = gpt.workload(
        MESH, LAYERS, form, optax.sgd(0.1))

    # A train step hands params (and here grads) back where they live ("kept"); left free,
    # each output is returned where the plan made it (reduced), as jax.jit chooses its own
    R = dist.Replicate()
    f = dist.jit(step, out_placements=keep_placements(dparams, state, [R, R], dparams)
                 if outputs == "kept" else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dist.FallbackWarning)
        new, _, loss, grads = f(dparams, state, dids, dlabels, key)
    ref_new, _, ref_loss, ref_grads = jax.jit(step)(params, state, ids, labels, key)

    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads, is_leaf=_is_dt), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=2e-6)
    for got, want in zip(jax.tree.leaves(new, is_leaf=_is_dt), jax.tree.leaves(ref_new)):
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=2e-6)

    # Collectives: what was planned was compiled, and no more bytes than XLA's own propagation.
    ours = f.lower(dparams, state, dids, dlabels, key).compile().as_text()
    planned = {}
    for c in f.plan(dparams, state, dids, dlabels, key).collectives:
        planned[c.kind] = planned.get(c.kind, 0) + 1
    compiled = dict(count_collectives(ours))
    if form == "remat":
        # XLA may merge a recomputed reduction with the forward one it duplicates
        assert set(compiled) <= set(planned) and all(compiled[k] <= planned[k] for k in compiled)
    else:
        assert compiled == planned
    physical = jax.tree.map(lambda d: d.physical, dparams, is_leaf=_is_dt)
    base = jax.jit(step).lower(physical, state, dids.physical, dlabels.physical, key).compile().as_text()
    # per step: a collective inside the scan's loop counts once per layer
    ours_bytes = sum(collective_bytes(ours, per_step=True).values())
    base_bytes = sum(collective_bytes(base, per_step=True).values())
    assert ours_bytes <= base_bytes, (collective_bytes(ours, True), collective_bytes(base, True))
