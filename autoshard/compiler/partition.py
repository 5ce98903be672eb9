"""Partition: the plan → one device's program, binding each primitive on local blocks.

Planned reshards run as the same atoms the eager reshard uses (reshard/steps.py), once per
(value, layout). Primitives are bound with params rewritten to local shapes (or through the
rule's own `lower` hook), after their operands are cast to a common set of varying mesh axes —
the bookkeeping jnp does implicitly and check_vma verifies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..layout import Layout
from ..reshard.steps import ensure_varying, varying_axes
from .control_flow import lower_higher_order
from .plan import Plan
from .trace import hint_p


@dataclass
class LowerContext:
    """What a rule's `lower` hook may ask about the equation it binds on one device."""

    sizes: dict
    in_layouts: list[Layout]
    out_layouts: list[Layout]
    local_out_shapes: list[tuple[int, ...]]

    def block_index(self, axes: tuple[str, ...]):
        """This device's block number along a dim split over `axes` (major first)."""
        index = jnp.int32(0)
        for a in axes:
            index = index * self.sizes[a] + lax.axis_index(a)
        return index


def match_vma(values: list[Any]) -> list[Any]:
    axes: set = set()
    for x in values:
        axes |= varying_axes(x)
    return [ensure_varying(x, axes) for x in values]


def _localize(params: dict, local_out_shapes: list[tuple[int, ...]]) -> dict:
    p = dict(params)
    if len(local_out_shapes) == 1:
        for key in ("shape", "new_sizes"):
            if p.get(key) is not None:
                p[key] = tuple(local_out_shapes[0])
    for key in ("sharding", "out_sharding"):
        if key in p:
            p[key] = None
    return p


def local_function(plan: Plan, registry, *, physical: bool = True):
    """A function of the local input blocks that computes the local output blocks.

    `physical`: inputs and outputs carry the leading slot axis of Partial values (the form
    shard_map hands over); sub-programs (loop bodies) take and give plain local blocks.
    """
    program = plan.program
    sizes = plan.mesh.axis_sizes

    def run(*local_inputs):
        env: dict = {}
        moved: dict = {}
        for v, L, x in zip(program.inputs, plan.inputs, local_inputs):
            env[v] = x[0] if (L.partial and physical) else x
        for c in program.consts:
            env[c] = (c.const if isinstance(c.const, jax.Array)
                      else jnp.asarray(np.asarray(c.const), dtype=c.dtype))

        def get(v, rp):
            if rp is None:
                return env[v]
            key = (v, rp.dst)
            if key not in moved:
                x = env[v]
                for planned in rp.steps:
                    x = planned.step.run(x, sizes)
                moved[key] = x
            return moved[key]

        for e, ep in zip(program.eqns, plan.eqns):
            plans = dict(ep.reshards)
            ins = [get(v, plans.get(i)) for i, v in enumerate(e.inputs)]
            if e.primitive is hint_p:
                outs = ins
            elif ep.sub_plans:
                outs = lower_higher_order(e, ep, ins, registry)
            else:
                local_shapes = [L.local_shape(v.shape, sizes) for v, L in zip(e.outputs, ep.results)]
                rule = None if ep.fallback else registry.lookup(e.primitive)
                ins = match_vma(ins)
                if rule is not None and rule.lower is not None:
                    ctx = LowerContext(sizes, ep.required, ep.results, local_shapes)
                    outs = rule.lower(ctx, *ins, **e.params)
                else:
                    outs = e.primitive.bind(*ins, **_localize(e.params, local_shapes))
                    if not e.primitive.multiple_results:
                        outs = [outs]
            for v, x in zip(e.outputs, outs):
                env[v] = x
        reshards = dict(plan.output_reshards)
        results = []
        for k, (v, L) in enumerate(zip(program.outputs, plan.outputs)):
            x = get(v, reshards.get(k))
            results.append(x[None] if (L.partial and physical) else x)
        return results

    return run


__all__ = ["local_function", "LowerContext"]
