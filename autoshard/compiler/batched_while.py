"""A while loop with a batched predicate, as one with a scalar predicate.

`jax.vmap` of a `while_loop` whose condition depends on the mapped value (a per-example
convergence test, a `fori_loop` with a per-example bound) keeps the predicate batched: the
`while` equation's cond returns `bool[B, ...]`, and jax's lowering runs the loop while any
element is true, the body keeping the rows already done (a select on the predicate broadcast
along the carries' leading dims). Planning and partitioning expect a scalar predicate, so the
equation is rewritten into exactly that loop: its cond is the `or` of the batched predicate,
its body computes the predicate of the carry it gets, runs the original body and selects row by
row. The body reads the cond's constants too (they come first among its constants).
"""
from __future__ import annotations

from typing import Any

import jax
from jax import lax
from jax._src import core


def has_batched_predicate(params: dict) -> bool:
    return bool(params["cond_jaxpr"].out_avals[0].shape)


def _spec(aval) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def scalar_predicate(params: dict, operands: list) -> tuple[dict, list]:
    """(params, operands) of the equivalent `while` equation with a scalar predicate."""
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    cn, bn = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, carry = operands[:cn], operands[cn:cn + bn], operands[cn + bn:]

    def predicate(consts, xs) -> Any:
        (p,) = core.eval_jaxpr(cond.jaxpr, cond.consts, *consts, *xs)
        return p

    def any_true(*args):
        p = predicate(args[:cn], args[cn:])
        return lax.reduce_or(p, tuple(range(p.ndim)))

    def step(*args):
        consts, xs = args[:cn], args[cn + bn:]
        p = predicate(consts, xs)
        new = core.eval_jaxpr(body.jaxpr, body.consts, *args[cn:cn + bn], *xs)
        # the rows whose predicate is false are done: they keep their carry (jax's lowering)
        return [lax.select(lax.broadcast_in_dim(p, x.shape, tuple(range(p.ndim))), n, x)
                for n, x in zip(new, xs)]

    c_specs = [_spec(v.aval) for v in cond_consts]
    b_specs = [_spec(v.aval) for v in body_consts]
    x_specs = [_spec(v.aval) for v in carry]
    new_cond = jax.make_jaxpr(any_true)(*c_specs, *x_specs)
    new_body = jax.make_jaxpr(step)(*c_specs, *b_specs, *x_specs)
    new = dict(params, cond_jaxpr=new_cond, body_jaxpr=new_body, body_nconsts=cn + bn)
    return new, [*cond_consts, *cond_consts, *body_consts, *carry]


__all__ = ["has_batched_predicate", "scalar_predicate"]
