"""Mixed precision for to_static: Paddle's AMP levels o1 / o2 and float16 loss scaling.

o1 ("autocast"): the forward is traced once and replayed with every matmul-like primitive
(dot_general, conv_general_dilated, plus strategy.amp.custom_white_list, minus
custom_black_list) fed low-precision inputs and producing a low-precision result that is cast
back; every other op (elementwise, reductions, softmax, norms, the loss) keeps float32, and so
do the params. o2: the params and floating inputs are cast once at the start, so the whole
forward and backward run in low precision. Both keep float32 master weights: the optimizer
updates the float32 params with float32 gradients.

float16 needs loss scaling: the loss is multiplied by a scale before the backward pass so
small gradients do not flush to zero, and the gradients divided by it after. The dynamic
scaler (Paddle's GradScaler) skips an update whose gradients are not finite and lowers the
scale, and raises it after `incr_every_n_steps` finite steps in a row.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from ..compiler.trace import bind_eqn

LOW_PRECISION_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})
# Their jvp / transpose rules are written for the primitive as declared: replaying their
# bodies with casts would leave the rules computing in the old dtype, so they are kept whole.
_OPAQUE = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Every floating leaf of `tree` as `dtype`; other leaves unchanged."""
    return jax.tree.map(lambda x: x.astype(dtype) if _is_float(x) else x, tree)


# ------------------------------------------------------------------------------ o1 autocast
def _narrow(x: Any, dtype: Any) -> Any:
    wider = _is_float(x) and jnp.finfo(x.dtype).bits > jnp.finfo(dtype).bits
    return x.astype(dtype) if wider else x


def _bind_low(eqn, invals: list, dtype: Any) -> list:
    """A matmul-like equation on low-precision inputs, its result cast back to the declared type."""
    cast = [_narrow(x, dtype) for x in invals]
    if all(a is b for a, b in zip(cast, invals)):  # nothing floating and wide: run as written
        return _bind(eqn, invals, eqn.params)
    params = dict(eqn.params)
    if params.get("preferred_element_type") is not None and jnp.issubdtype(
            params["preferred_element_type"], jnp.floating):
        params["preferred_element_type"] = jnp.dtype(dtype)
    outs = _bind(eqn, cast, params)
    return [o.astype(v.aval.dtype) for o, v in zip(outs, eqn.outvars)]


_bind = bind_eqn


def _replay(jaxpr, consts: list, args: list, dtype: Any, white: frozenset) -> list:
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive.name in white:
            outs = _bind_low(eqn, invals, dtype)
        elif eqn.primitive.name in _OPAQUE:
            outs = _bind(eqn, invals, eqn.params)
        else:
            outs = _bind(eqn, invals, _autocast_params(eqn.params, dtype, white))
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _autocast_closed(closed, dtype: Any, white: frozenset):
    """A ClosedJaxpr with the same signature whose matmuls run in `dtype` (scan / cond / jit bodies)."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
             for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *a: _replay(closed.jaxpr, closed.consts, list(a), dtype, white))(*avals)


def _autocast_open(jaxpr, dtype: Any, white: frozenset):
    """The same for an open Jaxpr (checkpoint bodies); unchanged if the replay needs constants."""
    new = _autocast_closed(jex_core.ClosedJaxpr(jaxpr, ()), dtype, white)
    return new.jaxpr if not new.consts else jaxpr


def _autocast_params(params: dict, dtype: Any, white: frozenset) -> dict:
    def convert(value):
        if isinstance(value, jex_core.ClosedJaxpr):
            return _autocast_closed(value, dtype, white)
        if isinstance(value, jex_core.Jaxpr):
            return _autocast_open(value, dtype, white)
        if isinstance(value, tuple) and value and all(isinstance(v, jex_core.ClosedJaxpr) for v in value):
            return tuple(_autocast_closed(v, dtype, white) for v in value)
        return value

    return {key: convert(value) for key, value in params.items()}


def autocast(fn: Callable, dtype: Any, white: frozenset = LOW_PRECISION_PRIMITIVES) -> Callable:
    """`fn` with the primitives named in `white` run in `dtype` (AMP o1); same outputs' types."""
    dtype = jnp.dtype(dtype)

    @functools.wraps(fn)
    def wrapped(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = _replay(closed.jaxpr, closed.consts, jax.tree.leaves(args), dtype, white)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return wrapped


def o1_primitives(custom_white_list=(), custom_black_list=()) -> frozenset:
    return (LOW_PRECISION_PRIMITIVES | frozenset(custom_white_list)) - frozenset(custom_black_list)


# ---------------------------------------------------------------------------- loss scaling
@dataclass(frozen=True)
class LossScaler:
    """Paddle's dynamic loss scaling as pure functions of a small state dict.

    state = {"scale": f32, "good_steps": i32, "bad_steps": i32} (scalars, replicated).
    """

    init_scale: float = 32768.0
    dynamic: bool = True
    incr_every_n_steps: int = 1000
    decr_every_n_nan_or_inf: int = 2
    incr_ratio: float = 2.0
    decr_ratio: float = 0.8

    def init_state(self) -> dict[str, Any]:
        return {"scale": jnp.float32(self.init_scale), "good_steps": jnp.int32(0),
                "bad_steps": jnp.int32(0)}

    def unscale(self, grads: Any, state: dict) -> Any:
        scale = state["scale"]
        return jax.tree.map(lambda g: g / scale.astype(g.dtype) if _is_float(g) else g, grads)

    def next_state(self, state: dict, finite: Any) -> dict:
        """Grow after enough finite steps in a row; shrink (never below 1) after enough bad ones."""
        if not self.dynamic:
            return state
        scale = state["scale"]
        good = jnp.where(finite, state["good_steps"] + 1, 0)
        bad = jnp.where(finite, 0, state["bad_steps"] + 1)
        grown = scale * self.incr_ratio
        grow = good >= self.incr_every_n_steps
        scale = jnp.where(grow & jnp.isfinite(grown), grown, scale)
        shrink = bad >= self.decr_every_n_nan_or_inf
        scale = jnp.where(shrink, jnp.maximum(scale * self.decr_ratio, 1.0), scale)
        return {"scale": scale.astype(jnp.float32), "good_steps": jnp.where(grow, 0, good).astype(jnp.int32),
                "bad_steps": jnp.where(shrink, 0, bad).astype(jnp.int32)}


def all_finite(tree: Any) -> Any:
    """One boolean: every floating element of `tree` is finite."""
    checks = [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(tree) if _is_float(g)]
    return functools.reduce(jnp.logical_and, checks, jnp.bool_(True))


def keep_if(finite: Any, new: Any, old: Any) -> Any:
    """`new` where the step was finite, else `old` (a skipped update)."""
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)


__all__ = ["autocast", "cast_floating", "o1_primitives", "LossScaler", "all_finite", "keep_if",
           "LOW_PRECISION_PRIMITIVES"]
