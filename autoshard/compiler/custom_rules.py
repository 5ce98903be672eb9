"""Custom derivative rules survive partitioning.

Planning inlines the body of a custom_jvp_call / custom_vjp_call like any other equations.
Partitioning runs that body wrapped in jax.custom_jvp / jax.custom_vjp on local blocks, so that
a program differentiated from outside (`jax.grad(dist.jit(f))`) uses the user's rule, as one
device would — not autodiff of the primal (relu's derivative at 0, a straight-through
estimator, a clipped gradient). The rule itself is a global-view function: it is traced
(`jax.jvp` / `jax.vjp` of the original call), planned on the region's layouts and partitioned —
lazily, only when an outer transformation asks for it.

Tangent and cotangent layouts: a tangent is laid out as its primal. A cotangent is too, except
over Partial(sum) axes: every part of x = Σ xᵢ receives the whole cotangent, so those axes are
replicated. A region whose boundary carries another Partial kind (max, min, avg) has no such
simple cotangent; it runs unwrapped (its primal is differentiated, as before).

A linear solve (custom_linear_solve: jnp.linalg.solve, jax.scipy.sparse.linalg.cg) is bound
again as jax's own primitive on local blocks — its operator, solve and transposed solve
partitioned — so jax's rules differentiate it to any order (`_solve_rebound`). An iterative
one (a while loop inside) has its right-hand side moved into the solution's layout first and
every operand cast to vary over the mesh axes any of them varies over, so that it is rebound
whatever its layouts; a direct one whose operands jax's typing of varying values refuses is
wrapped like a custom_jvp. (An iterative one with a Partial solution, which no plan was found
to make, would have a linear call whose transpose is its vjp as tangent: first order only, a
second derivative is a TransformationError — `_solve_wrapped`.)
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from jax import lax
from jax._src import core as jcore

from ..layout import Layout
from ..placement import ReduceType
from ..reshard.steps import ensure_varying, varying_axes
from .trace import CustomRegion, build_program


def _inexact(aval) -> bool:
    # jax's issubdtype: numpy does not count bfloat16 / float8 as inexact (their inputs were
    # then taken as not differentiable, and jax.grad through the region failed)
    return jax.dtypes.issubdtype(aval.dtype, np.inexact)


def _global_call(region: CustomRegion) -> Callable:
    """The original custom call, bound on global values (so jax applies the user's rule)."""
    prim, params = region.primitive, region.params

    def call(*args):
        got = prim.get_bind_params(params)
        # older jax returns (subfuns, params); newer jax params with 'subfuns' for bind
        if isinstance(got, tuple):
            subfuns, bind_params = got
            return prim.bind(*subfuns, *args, **bind_params)
        return prim.bind(*args, **got)

    return call


def _cotangent_layout(L: Layout) -> Layout:
    return L.without_partial()


def _wrappable(layouts: list[Layout]) -> bool:
    return all(kind == ReduceType.SUM for L in layouts for _, kind in L.partial)


def _sub_plan(fn: Callable, avals: list, plan, in_layouts: list[Layout], targets: list[Layout],
              registry, pack: bool = True, ambient: frozenset = frozenset()):
    from .partition import local_function
    from .plan import make_plan

    closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
    # (a rule's derivative may be differentiated again from outside, a Hessian: a solve in it
    # keeps its own derivative, as at the top — inlined, it runs on stop_gradient'ed factors)
    sub = make_plan(build_program(closed, inline_solves=False), plan.mesh, in_layouts, targets,
                    registry, plan.cost_model, top_level=False)
    return local_function(sub, registry, physical=False, pack=pack, ambient=ambient)


def _match(values: list, like: list) -> list:
    """Cast each value to vary over the mesh axes its primal varies over (check_vma)."""
    return [ensure_varying(v, varying_axes(p)) for v, p in zip(values, like)]


def run_region(region: CustomRegion, plan, registry, xs: list, body: Callable) -> list:
    """The region on local blocks `xs`, differentiable by the user's custom rule."""
    ins = [v.aval for v in region.inputs]
    outs = [v.aval for v in region.outputs]
    in_layouts = [plan.layouts[v] for v in region.inputs]
    out_layouts = [plan.layouts[v] for v in region.outputs]
    if not _wrappable(in_layouts + out_layouts):
        return body(*xs)
    diff_in = [i for i, a in enumerate(ins) if _inexact(a)]
    diff_out = [j for j, a in enumerate(outs) if _inexact(a)]
    call = _global_call(region)
    if region.primitive.name == "custom_linear_solve":
        iterative = any(e.primitive is lax.while_p
                        for e in plan.program.eqns[region.start:region.stop])
        rebound = _solve_rebound(region, plan, registry, xs, in_layouts, out_layouts,
                                 iterative)
        if rebound is not None:
            return rebound
        if iterative:
            where = plan.program.eqns[region.start].source if region.stop > region.start \
                else None
            return _solve_wrapped(call, body, plan, registry, xs, ins, outs, in_layouts,
                                  out_layouts, diff_in, diff_out, where)
    if region.primitive.name in ("custom_jvp_call", "custom_linear_solve"):
        return _jvp_wrapped(call, body, plan, registry, xs, ins, outs, in_layouts, out_layouts,
                            diff_in, diff_out)
    return _vjp_wrapped(call, body, plan, registry, xs, ins, outs, in_layouts, out_layouts,
                        diff_in, diff_out)


def _jvp_wrapped(call, body, plan, registry, xs, ins, outs, in_layouts, out_layouts,
                 diff_in, diff_out) -> list:
    def global_jvp(*args):
        primals, given = list(args[:len(ins)]), iter(args[len(ins):])
        tangents = [next(given) if i in diff_in else np.zeros(a.shape, jax.dtypes.float0)
                    for i, a in enumerate(ins)]
        y, ty = jax.jvp(call, primals, tangents)
        return list(y) + [ty[j] for j in diff_out]

    local_jvp = []  # planned once, when jax first differentiates this region

    @jax.custom_jvp
    def region_fn(*args):
        return body(*args)

    @region_fn.defjvp
    def region_jvp(primals, tangents):
        if not local_jvp:
            local_jvp.append(_sub_plan(
                global_jvp, ins + [ins[i] for i in diff_in], plan,
                in_layouts + [in_layouts[i] for i in diff_in],
                out_layouts + [out_layouts[j] for j in diff_out], registry,
                # a primal gathered in one buffer with a tangent would depend on it: jax's
                # linearization needs the rule's primal results from the primals alone
                pack=False))
        res = local_jvp[0](*primals, *[tangents[i] for i in diff_in])
        y = _match(res[:len(outs)], res[:len(outs)])
        t_given = iter(_match(res[len(outs):], [y[j] for j in diff_out]))
        ty = [next(t_given) if j in diff_out else np.zeros(np.shape(y[j]), jax.dtypes.float0)
              for j in range(len(outs))]
        return y, ty

    return list(region_fn(*xs))


def _solve_rebound(region: CustomRegion, plan, registry, xs: list, in_layouts: list[Layout],
                   out_layouts: list[Layout], iterative: bool = False) -> list | None:
    """A linear solve (jnp.linalg.solve, jax.scipy.sparse.linalg.cg, ...) differentiated from
    outside, bound again as jax's own custom_linear_solve on local blocks: its operator, solve
    and transposed solve each planned on the region's layouts and partitioned, so that jax's
    rules differentiate it — a tangent is a solve, a cotangent a transposed solve, to any order
    (a Hessian through the solve; the inlined solve runs on stop_gradient'ed factors, and
    transposing its loop or differentiating its transpose lost the matrix's part). The
    right-hand side's local blocks must have the solution's shape: an iterative solve's is
    moved into the solution's layout (a planned reshard, differentiated and transposed by
    jax); a direct one's that is Partial or laid out otherwise returns None, as does a Partial
    solution — the region is then wrapped instead."""
    lengths, jaxprs = region.params["const_lengths"], region.params["jaxprs"]
    n_consts = sum(lengths)
    rhs_layouts = in_layouts[n_consts:]
    if any(L.partial for L in out_layouts) or jaxprs.solve is None:
        return None
    if iterative and rhs_layouts != out_layouts:
        # the right-hand side moved into the solution's layout first (a planned reshard of
        # its own: jax differentiates and transposes its collectives)
        move = _sub_plan(lambda *v: list(v), [v.aval for v in region.outputs], plan,
                         rhs_layouts, out_layouts, registry)
        xs = [*xs[:n_consts], *move(*xs[n_consts:])]
        rhs_layouts = out_layouts
    if rhs_layouts != out_layouts or any(L.partial for L in rhs_layouts):
        return None
    # jax's rules need the operator's operands and the vectors to vary over the same mesh
    # axes: its derivative of the operator's cast of an operand to varying (`pcast`) refuses a
    # tangent typed varying already, its transpose a vector typed otherwise than the operator's
    # result (an invariant identity's solve by split matrices: jnp.linalg.inv) — such a direct
    # solve is wrapped instead (the solve's own constants, a tolerance, are not differentiated).
    # An iterative one has every operand cast to vary over the axes any of them varies over,
    # and its programs' loops carry values varying over them too (`ambient`): a second
    # derivative's residuals come back typed varying (shard_map's partial evaluation), which
    # the loop's invariant steps (a zero initial guess, a replicated matrix) refused — and
    # the linear call it was wrapped in instead is differentiable once only
    ambient = frozenset()
    if iterative:
        ambient = frozenset().union(*map(varying_axes, xs))
        xs = [ensure_varying(x, ambient) for x in xs]
    elif len({frozenset(varying_axes(x)) for x in (*xs[:lengths.matvec], *xs[n_consts:])}) > 1:
        return None
    starts = np.cumsum([0, *lengths]).tolist()
    const_vals = {name: (xs[a:b], region.inputs[a:b], in_layouts[a:b])
                  for name, a, b in zip(lengths._fields, starts, starts[1:])}
    rhs = tuple(xs[n_consts:])
    vec_avals = [v.aval for v in region.outputs]
    made: dict = {}

    def local(name: str) -> Callable:
        """The `name` jaxpr (its constants, then a vector) on local blocks, planned once."""
        if name not in made:
            closed = getattr(jaxprs, name)
            consts, values, layouts = const_vals[name]
            sub = _sub_plan(jcore.jaxpr_as_fun(closed), [v.aval for v in values] + vec_avals,
                            plan, list(layouts) + rhs_layouts, rhs_layouts, registry,
                            ambient=ambient)
            made[name] = lambda *vec: tuple(_match(sub(*consts, *vec), rhs))
        return made[name]

    transpose = None
    if jaxprs.transpose_solve is not None:
        def transpose(_, v):
            return local("transpose_solve")(*v)
    # a solve declared symmetric (cg) stays so: jax then takes its operator as its own
    # transpose, also for a tangent operator that is not (a second derivative with respect
    # to the matrix) — as one device does
    symmetric = jaxprs.vecmat is not None and jaxprs.vecmat is jaxprs.matvec
    return list(lax.custom_linear_solve(
        lambda v: local("matvec")(*v), rhs, lambda _, v: local("solve")(*v),
        transpose_solve=transpose, symmetric=symmetric))


def _first_order_only(values: tuple, where: str | None, laid_out: str) -> tuple:
    """`values` as they are, but a derivative of them — the linear call's residuals
    differentiated again, a second derivative from outside, which jax's linear call does not
    take (it asserted deep in jax, when the outer transformation re-ran the staged program) —
    is a TransformationError saying to take the derivatives inside."""
    from jax.custom_derivatives import SymbolicZero

    from ..errors import TransformationError

    @jax.custom_jvp
    def guard(*vs):
        return vs

    def guard_jvp(primals, tangents):
        if any(not isinstance(t, SymbolicZero) for t in tangents):
            raise TransformationError(
                f"a second derivative taken from outside dist.jit through an iterative linear "
                f"solve (jax.scipy.sparse.linalg's cg / gmres / bicgstab: a "
                f"custom_linear_solve whose solve is a while loop) whose solution is laid out "
                f"{laid_out} is not supported — its tangent is a "
                f"linear call, differentiable once: take the derivatives inside, "
                f"dist.jit(jax.grad(jax.grad(f))) or dist.jit(jax.hessian(f))",
                where=where)
        return primals, tangents

    guard.defjvp(guard_jvp, symbolic_zeros=True)
    return tuple(guard(*values))


def _solve_wrapped(call, body, plan, registry, xs, ins, outs, in_layouts, out_layouts,
                   diff_in, diff_out, where: str | None = None) -> list:
    """A linear solve (lax.custom_linear_solve: jax.scipy.sparse.linalg.cg, gmres, ...) whose
    derivative is its own: its tangent is another solve, an iterative one a while loop, which
    jax cannot transpose for a gradient taken outside. So the tangent is a `linear_call` of the
    tangents given (not the zero ones: a linear call's operands are all linear): the solve's
    jvp planned and partitioned, and as its transpose the solve's vjp (jax's transpose of the
    solve — a solve by the transposed operator — run forward), each made when first asked."""
    from jax.custom_derivatives import SymbolicZero, linear_call

    def zero(a):
        return np.zeros(a.shape, a.dtype if _inexact(a) else jax.dtypes.float0)

    planned: dict = {}  # (kind, the inputs with a tangent) -> its local function

    def once(key: tuple, make: Callable) -> Callable:  # (planned when first asked)
        if key not in planned:
            planned[key] = make()
        return planned[key]

    def tangent_of(given: tuple) -> Callable:
        def global_tangent(*args):
            primals, t = list(args[:len(ins)]), iter(args[len(ins):])
            tangents = [next(t) if i in given else zero(a) for i, a in enumerate(ins)]
            _, ty = jax.jvp(call, primals, tangents)
            return [ty[j] for j in diff_out]

        def tangent(primals, tangents):
            run = once(("tangent", given), lambda: _sub_plan(
                global_tangent, ins + [ins[i] for i in given], plan,
                in_layouts + [in_layouts[i] for i in given],
                [out_layouts[j] for j in diff_out], registry, pack=False))
            return tuple(run(*primals, *tangents))
        return tangent

    def transpose_of(given: tuple) -> Callable:
        def global_vjp(*args):
            primals, cts = list(args[:len(ins)]), iter(args[len(ins):])
            _, pullback = jax.vjp(call, *primals)
            grads = pullback([next(cts) if j in diff_out else
                              np.zeros(a.shape, jax.dtypes.float0) for j, a in enumerate(outs)])
            return [grads[i] for i in given]

        def transpose(primals, cts):
            run = once(("transpose", given), lambda: _sub_plan(
                global_vjp, ins + [outs[j] for j in diff_out], plan,
                in_layouts + [_cotangent_layout(out_layouts[j]) for j in diff_out],
                [_cotangent_layout(in_layouts[i]) for i in given], registry))
            grads = run(*primals, *cts)
            return tuple(_match(grads, [primals[i] for i in given]))
        return transpose

    @jax.custom_jvp
    def region_fn(*args):
        return body(*args)

    def region_jvp(primals, tangents):
        y = list(body(*primals))
        given = tuple(i for i in diff_in if not isinstance(tangents[i], SymbolicZero))
        if given:
            found = linear_call(tangent_of(given), transpose_of(given),
                                _first_order_only(tuple(primals), where, ", ".join(
                                    L.describe(plan.mesh) for L in out_layouts)),
                                tuple(tangents[i] for i in given))
            ty_given = iter(_match(list(found), [y[j] for j in diff_out]))
        else:
            ty_given = iter(SymbolicZero(jax.core.get_aval(y[j]).to_tangent_aval())
                            for j in diff_out)
        ty = [next(ty_given) if j in diff_out else
              SymbolicZero(jax.core.get_aval(y[j]).to_tangent_aval()) for j in range(len(outs))]
        return y, ty

    region_fn.defjvp(region_jvp, symbolic_zeros=True)
    return list(region_fn(*xs))


def _vjp_wrapped(call, body, plan, registry, xs, ins, outs, in_layouts, out_layouts,
                 diff_in, diff_out) -> list:
    def global_vjp(*args):
        primals, cts = list(args[:len(ins)]), iter(args[len(ins):])
        y, pullback = jax.vjp(call, *primals)
        full = [next(cts) if j in diff_out else np.zeros(a.shape, jax.dtypes.float0)
                for j, a in enumerate(outs)]
        grads = pullback(full)
        return [grads[i] for i in diff_in]

    local_vjp = []

    @jax.custom_vjp
    def region_fn(*args):
        return body(*args)

    def fwd(*args):
        # Residuals are the inputs: the backward re-runs the user's fwd inside its own plan.
        return body(*args), args

    def bwd(res, cts):
        if not local_vjp:
            local_vjp.append(_sub_plan(
                global_vjp, ins + [outs[j] for j in diff_out], plan,
                in_layouts + [_cotangent_layout(out_layouts[j]) for j in diff_out],
                [_cotangent_layout(in_layouts[i]) for i in diff_in], registry))
        grads = iter(_match(local_vjp[0](*res, *[cts[j] for j in diff_out]),
                            [res[i] for i in diff_in]))
        return tuple(next(grads) if i in diff_in else None for i in range(len(ins)))

    region_fn.defvjp(fwd, bwd)
    return list(region_fn(*xs))


__all__ = ["run_region"]
