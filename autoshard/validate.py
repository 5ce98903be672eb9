"""The rule validator: every registered primitive, every 1-d placement of its inputs, vs one device.

    python -m autoshard.validate [--primitive NAME] [--quick] [--devices N]

For each sample invocation of each primitive, every combination of input placements R, S(d),
P(sum/avg/max/min) on a 1-d mesh (partial values split unevenly at random, so a wrong rule
cannot pass by coincidence) runs through dist.jit and is compared with the unpartitioned
result. Reported per primitive: cases run, wrong results (must be zero), and needless moves —
cases where the operands already fit a strategy of the rule, yet the plan moved data.
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable

_HELP_DEVICES = 4


@dataclass(frozen=True)
class Sample:
    name: str
    primitive: str
    fn: Callable
    args: tuple[tuple[tuple[int, ...], str], ...]   # (shape, kind) with kind f, i or b


@dataclass
class Report:
    primitive: str
    cases: int = 0
    wrong: list[str] = field(default_factory=list)
    needless: list[str] = field(default_factory=list)


def samples() -> list[Sample]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax._src.ad_util import add_jaxvals_p
    from jax.ad_checkpoint import checkpoint_name

    f2, i2, b2 = ((4, 8), "f"), ((4, 8), "i"), ((4, 8), "b")
    out: list[Sample] = []

    def add(name, prim, fn, *args):
        out.append(Sample(name, prim, fn, tuple(args)))

    unary_f = ["neg", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "cbrt",
               "floor", "ceil", "round", "erf", "atan", "sinh", "asinh", "sign", "is_finite",
               "sin", "cos", "tan", "asin", "acos", "cosh", "acosh", "atanh", "rsqrt", "abs",
               "square", "erfc", "erf_inv", "lgamma", "digamma"]
    for n in unary_f:
        add(n, n, getattr(lax, n), f2)
    add("copy", "copy", lambda x: lax.copy_p.bind(x), f2)
    if hasattr(lax, "one_minus_square_p"):  # jax >= 0.11: tanh's derivative
        add("one_minus_square", "one_minus_square", lax.one_minus_square_p.bind, f2)
    if hasattr(lax, "polynomial_p"):  # jax >= 0.12: Horner's rule, elementwise in x and coeffs
        add("polynomial", "polynomial", lambda x, c: lax.polynomial(x, (0.5, c, c * 2.0)), f2, f2)
    pos = lambda x: jnp.abs(x) + 0.5  # noqa: E731  (the special functions' domains)
    for n in ["bessel_i0e", "bessel_i1e"]:
        add(n, n, getattr(lax, n), f2)
    for n in ["igamma", "igammac", "igamma_grad_a"]:
        add(n, n, lambda a, x, n=n: getattr(lax, n)(pos(a), pos(x)), f2, f2)
    add("polygamma", "polygamma", lambda x: lax.polygamma(jnp.ones_like(x), pos(x)), f2)
    add("betainc", "regularized_incomplete_beta",
        lambda a, b, x: lax.betainc(pos(a), pos(b), jax.nn.sigmoid(x)), f2, f2, f2)
    add("zeta", "zeta", lambda x, q: lax.zeta(pos(x) + 1.0, pos(q)), f2, f2)
    add("stop_gradient", "stop_gradient", lambda x: lax.stop_gradient(x) * 2.0, f2)
    add("optimization_barrier", "optimization_barrier",
        lambda a, b: jnp.sum(lax.optimization_barrier((a, b * 2.0))[1], axis=0) + a[0], f2, f2)
    add("checkpoint_name", "name",
        lambda x: checkpoint_name(x, "saved") * 2.0, f2)
    one = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("v",)),
                                     jax.sharding.PartitionSpec())
    add("sharding_constraint", "sharding_constraint",
        lambda x: jax.lax.with_sharding_constraint(x, one) * 2.0, f2)
    add("reshard", "reshard", lambda x: jax.sharding.reshard(x, one) * 2.0, f2)
    add("reduce (variadic)", "reduce",
        lambda x, y: sum(lax.reduce((x, y), (-jnp.inf, 0.0),
                                    lambda a, b: (jnp.maximum(a[0], b[0]), a[1] + b[1]), (1,))),
        f2, f2)
    add("mulhi", "mulhi", lambda x, y: lax.mulhi(lax.convert_element_type(x * 1e9, jnp.int32),
                                                 lax.convert_element_type(y * 1e9, jnp.int32)),
        f2, f2)
    add("device_put", "device_put",
        lambda x, y: jnp.sum(jax.device_put((x, y * 2.0))[1], axis=0) + x[0], f2, f2)
    add("integer_pow", "integer_pow", lambda x: lax.integer_pow(x, 3), f2)
    add("reduce_precision", "reduce_precision", lambda x: lax.reduce_precision(x, 5, 10), f2)
    add("convert f32->f16", "convert_element_type", lambda x: lax.convert_element_type(x, jnp.float16), f2)
    add("bitcast f32->i32", "bitcast_convert_type",
        lambda x: lax.bitcast_convert_type(x, jnp.int32) >> 3, f2)
    add("bitcast f32->u8 (a trailing dim of bytes)", "bitcast_convert_type",
        lambda x: lax.bitcast_convert_type(x, jnp.uint8)[..., 1:], f2)
    add("bitcast u8 bytes->f32", "bitcast_convert_type",
        lambda x: lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint8)[::-1],
                                           jnp.float32) * 2.0, f2)
    add("convert f32->c64", "convert_element_type",
        lambda x: lax.real(lax.convert_element_type(x, jnp.complex64) * (1.0 + 2.0j)), f2)
    add("convert f32->i32", "convert_element_type", lambda x: lax.convert_element_type(x, jnp.int32), f2)
    for n in ["add", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "nextafter",
              "eq", "ne", "lt", "le", "gt", "ge"]:
        add(n, n, getattr(lax, n), f2, f2)
    add("add scalar", "add", lambda x: x + 2.0, f2)
    add("mul scalar", "mul", lambda x: x * 3.0, f2)
    add("add_any", "add_any", lambda a, b: add_jaxvals_p.bind(a, b), f2, f2)
    for n in ["not", "population_count", "clz"]:
        add(n, n, getattr(lax, n if n != "not" else "bitwise_not"), i2)
    for n, fn in [("and", lax.bitwise_and), ("or", lax.bitwise_or), ("xor", lax.bitwise_xor),
                  ("shift_left", lax.shift_left), ("shift_right_arithmetic", lax.shift_right_arithmetic),
                  ("shift_right_logical", lax.shift_right_logical)]:
        add(n, n, fn, i2, i2)
    add("and bool", "and", lax.bitwise_and, b2, b2)
    add("select_n", "select_n", lambda p, a, b: lax.select(p, a, b), b2, f2, f2)
    add("clamp", "clamp", lambda lo, x, hi: lax.clamp(lo, x, hi), f2, f2, f2)
    add("clamp scalars", "clamp", lambda x: lax.clamp(2.0, x, 4.0), f2)
    add("complex", "complex", lambda a, b: jnp.abs(lax.complex(a, b)), f2, f2)
    add("real/imag/conj", "real", lambda a: lax.real(lax.conj(lax.complex(a, a))) + lax.imag(lax.complex(a, a)), f2)

    for n, fn in [("reduce_sum", jnp.sum), ("reduce_max", jnp.max), ("reduce_min", jnp.min),
                  ("reduce_prod", jnp.prod)]:
        for axes in [(0,), (1,), (0, 1)]:
            add(f"{n} axes={axes}", n, lambda x, fn=fn, axes=axes: fn(x, axis=axes), f2)
    add("reduce_and", "reduce_and", lambda x: jnp.all(x, axis=0), b2)
    add("reduce_or", "reduce_or", lambda x: jnp.any(x, axis=1), b2)
    add("reduce_xor", "reduce_xor", lambda x: lax.reduce_xor_p.bind(x, axes=(1,)), i2)

    dn = lambda lc, rc, lb=(), rb=(): ((lc, rc), (lb, rb))  # noqa: E731
    add("dot (4,8)@(8,4)", "dot_general", lambda a, b: lax.dot_general(a, b, dn((1,), (0,))),
        ((4, 8), "f"), ((8, 4), "f"))
    add("dot batched", "dot_general", lambda a, b: lax.dot_general(a, b, dn((2,), (1,), (0,), (0,))),
        ((4, 4, 8), "f"), ((4, 8, 4), "f"))
    add("dot two contracting", "dot_general", lambda a, b: lax.dot_general(a, b, dn((0, 1), (1, 0))),
        ((4, 8), "f"), ((8, 4), "f"))
    add("dot outer", "dot_general", lambda a, b: lax.dot_general(a, b, dn((), ())),
        ((4,), "f"), ((8,), "f"))

    for shape in [(32,), (2, 2, 8), (8, 4), (4, 2, 4)]:
        add(f"reshape (4,8)->{shape}", "reshape", lambda x, s=shape: lax.reshape(x, s), f2)
    add("reshape (2,2,8)->(4,8)", "reshape", lambda x: lax.reshape(x, (4, 8)), ((2, 2, 8), "f"))
    add("reshape of a transpose (4,8)->(2,16)", "reshape",
        lambda x: lax.reshape(x, (2, 16), dimensions=(1, 0)), f2)
    add("reshape of an empty array", "reshape", lambda x: lax.reshape(x[:, :0], (0, 4)), f2)
    add("reshape of a transpose (2,4,8)->(8,8)", "reshape",
        lambda x: lax.reshape(x, (8, 8), dimensions=(2, 0, 1)), ((2, 4, 8), "f"))
    add("broadcast (4,1)->(4,8)", "broadcast_in_dim",
        lambda x: lax.broadcast_in_dim(x, (4, 8), (0, 1)), ((4, 1), "f"))
    add("broadcast (8,)->(4,8)", "broadcast_in_dim",
        lambda x: lax.broadcast_in_dim(x, (4, 8), (1,)), ((8,), "f"))
    add("transpose", "transpose", lambda x: lax.transpose(x, (1, 0)), f2)
    add("squeeze", "squeeze", lambda x: lax.squeeze(x, (1,)), ((4, 1, 8), "f"))
    add("concatenate dim 0", "concatenate", lambda a, b: lax.concatenate([a, b], 0), f2, f2)
    add("concatenate dim 1", "concatenate", lambda a, b: lax.concatenate([a, b], 1), f2, f2)
    add("split dim 1", "split", lambda x: lax.split(x, (3, 5), axis=1)[1] * 2.0, f2)
    add("split dim 0", "split", lambda x: sum(lax.split(x, (2, 2), axis=0)), f2)
    add("pad dim 0", "pad", lambda x: lax.pad(x, 1.5, [(1, 2, 0), (0, 0, 0)]), f2)
    add("pad interior dim 1", "pad", lambda x: lax.pad(x, 0.0, [(0, 0, 0), (0, 1, 1)]), f2)
    add("slice", "slice", lambda x: lax.slice(x, (0, 2), (4, 6)), f2)
    add("slice strided", "slice", lambda x: lax.slice(x, (0, 0), (4, 8), (1, 2)), f2)
    add("slice odd rows", "slice", lambda x: lax.slice(x, (1, 1), (4, 8), (2, 2)), f2)
    add("slice every fourth row from the third", "slice",
        lambda x: lax.slice(x, (0, 2), (4, 8), (1, 4)), f2)
    add("slice one row with a stride as long as the dim", "slice",
        lambda x: lax.slice(x, (3, 0), (4, 8), (4, 1)) * 2.0, f2)
    add("slice the last row", "slice", lambda x: lax.slice(x, (3, 0), (4, 8)), f2)
    add("slice rows across blocks", "slice", lambda x: lax.slice(x, (0, 3), (4, 6)) * 2.0, f2)
    add("slice a corner", "slice", lambda x: lax.slice(x, (1, 2), (3, 4)), f2)
    add("slice a column of ints", "slice", lambda x: lax.slice(x, (0, 7), (4, 8)), i2)
    add("slice a column of bools", "slice", lambda x: lax.slice(x, (0, 0), (4, 1)), b2)
    add("pad interleaving", "pad", lambda x: lax.pad(x, 0.0, [(0, 0, 0), (1, 0, 1)]), f2)
    add("pad a few rows to a split dim (a slice's gradient)", "pad",
        lambda x, y: lax.pad(x, 0.5, [(0, 0, 0), (5, 1, 0)]) * y, ((4, 2), "f"), f2)
    add("rev", "rev", lambda x: lax.rev(x, (1,)), f2)
    add("rev both dims", "rev", lambda x: lax.rev(x, (0, 1)), f2)
    add("iota dim 0", "iota", lambda x: x + lax.broadcasted_iota(jnp.float32, (4, 8), 0), f2)
    add("iota dim 1", "iota", lambda x: x * lax.broadcasted_iota(jnp.float32, (4, 8), 1), f2)
    add("tile dim 0", "tile", lambda x: jnp.tile(x, (2, 1)), f2)
    add("tile both", "tile", lambda x: jnp.tile(x, (2, 3)), f2)
    add("tile new leading dim", "tile", lambda x: jnp.tile(x, (2, 1, 1)), f2)
    add("stack axis 0", "stack", lambda a, b: jnp.stack([a, b], 0), f2, f2)
    add("stack axis 2", "stack", lambda a, b: jnp.stack([a, b, a], 2), f2, f2)
    add("unstack axis 1", "unstack",  # (jnp.stack's gradient) the parts restacked reversed
        lambda a: jnp.stack(lax_internal.unstack_p.bind(a, axis=1)[::-1]) * 2.0, ((4, 2, 8), "f"))
    from jax._src.lax import lax as lax_internal
    for n in ["eq_to", "le_to", "lt_to"]:
        add(n, n, lambda a, b, n=n: getattr(lax_internal, f"{n}_p").bind(a, b), f2, f2)
    from jax._src import core as jcore
    add("empty2", "empty2", lambda x: x + lax_internal.empty2(
        jnp.float32, memory_space=jcore.MemorySpace.Device), f2)
    add("platform_dependent", "platform_index", lambda x: lax.platform_dependent(
        x, cpu=lambda a: a * 2.0, default=lambda a: a + 1.0), f2)
    # Families may ship their own samples next to their rules.
    from .rules import FAMILIES

    for module in FAMILIES.values():
        extra = getattr(module, "validation_samples", None)
        if extra is not None:
            out.extend(Sample(*item) for item in extra())
    return out


def _placement_options(shape, kind, n_devices):
    options = ["R"] + [f"S({d})" for d, s in enumerate(shape) if s % n_devices == 0]
    if kind == "f":
        options += ["P(sum)", "P(avg)", "P(max)", "P(min)"]
    elif kind == "i":
        options += ["P(sum)", "P(max)", "P(min)"]
    return options


def _value(shape, kind, rng):
    import numpy as np

    if kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if kind == "i":
        return rng.integers(1, 6, size=shape).astype(np.int32)
    # small positive integers: sums of partial parts stay exact, most domains are valid
    return rng.integers(1, 6, size=shape).astype(np.float32)


def run_sample(sample: Sample, mesh, limit: int | None, seed: int = 0) -> Report:
    import jax
    import numpy as np

    from . import jit as dist_jit
    from .compiler.plan import FallbackWarning
    from .testing import logical_value, make_tensor

    report = Report(sample.primitive)
    n = mesh.size
    options = [_placement_options(s, k, n) for s, k in sample.args]
    combos = list(itertools.product(*options))
    if limit is not None and len(combos) > limit:
        combos = random.Random(sample.name).sample(combos, limit)
    rng = np.random.default_rng(seed)
    values = [_value(s, k, rng) for s, k in sample.args]
    expected = np.asarray(jax.jit(sample.fn)(*values))
    for combo in combos:
        inputs = [make_tensor(v, mesh, [p], seed=seed + i) for i, (v, p) in enumerate(zip(values, combo))]
        f = dist_jit(sample.fn, out_placements="keep")
        report.cases += 1
        label = f"{sample.name} [{', '.join(combo)}]"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FallbackWarning)
                got = logical_value(f(*inputs))
                plan = f.plan(*inputs)
        except Exception as exc:  # a crash is as wrong as a wrong number
            report.wrong.append(f"{label}: {type(exc).__name__}: {(str(exc).splitlines() or [repr(exc)])[0][:200]}")
            continue
        close = np.allclose(got.astype(np.float64) if got.dtype != bool else got,
                            expected.astype(np.float64) if expected.dtype != bool else expected,
                            rtol=2e-3 if expected.dtype == np.float16 else 1e-5, atol=1e-5,
                            equal_nan=True) if got.shape == expected.shape else False
        if not close:
            report.wrong.append(label)
        elif any(not c.by_rule for c in plan.collectives) \
                and _fits_without_moving(plan):
            report.needless.append(label)
    return report


def _fits_without_moving(plan) -> bool:
    """True if the operands already fit the strategy the rule seeds from them."""
    from .compiler.early_moves import result_layout
    from .compiler.propagate import rule_sharding
    from .compiler.strategy import candidates, layouts
    from .rules import REGISTRY

    # a step moved early for its readers (early_moves.py) fits as it came; its readers are
    # judged by the layout the value had before that move
    before: dict = {}
    for e, ep in zip(plan.program.eqns, plan.eqns):
        if ep.early is not None:
            came = before.get(e.inputs[ep.early], ep.operands[ep.early])
            before[e.outputs[0]] = (result_layout(e, came) if e.primitive.name == "broadcast_in_dim"
                                    else came)
            continue
        opsh = rule_sharding(e, REGISTRY)
        if opsh is None:
            return False
        actual = [None if v.is_const else before.get(v, L) for v, L in zip(e.inputs, ep.operands)]
        implied = layouts(opsh, candidates(opsh, actual, [None] * len(e.outputs))[0],
                          [v.shape for v in e.inputs], [v.shape for v in e.outputs],
                          plan.mesh.axis_sizes)
        if implied is None or any(L is not None and L != R for L, R in zip(actual, implied[0])):
            return False
    return True


def validate(primitive: str | None = None, *, limit: int | None = None,
             n_devices: int = _HELP_DEVICES) -> dict[str, Report]:
    from .mesh import ProcessMesh

    mesh = ProcessMesh(list(range(n_devices)), dim_names=["x"])
    reports: dict[str, Report] = {}
    for sample in samples():
        if primitive is not None and sample.primitive != primitive:
            continue
        r = run_sample(sample, mesh, limit)
        total = reports.setdefault(sample.primitive, Report(sample.primitive))
        total.cases += r.cases
        total.wrong += r.wrong
        total.needless += r.needless
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoshard.validate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--primitive", help="validate only this primitive (its jax name)")
    parser.add_argument("--quick", action="store_true", help="at most 12 placement combinations per sample")
    parser.add_argument("--devices", type=int, default=_HELP_DEVICES, help="size of the 1-d mesh")
    args = parser.parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    reports = validate(args.primitive, limit=12 if args.quick else None, n_devices=args.devices)
    if not reports:
        print(f"no samples for primitive {args.primitive!r}")
        return 2
    print(f"{'primitive':<24}{'cases':>7}{'wrong':>7}{'needless':>10}")
    for name, r in sorted(reports.items()):
        print(f"{name:<24}{r.cases:>7}{len(r.wrong):>7}{len(r.needless):>10}")
    wrong = [w for r in reports.values() for w in r.wrong]
    needless = [w for r in reports.values() for w in r.needless]
    total = sum(r.cases for r in reports.values())
    print(f"{total} cases, {len(wrong)} wrong, {len(needless)} needless moves")
    for w in wrong:
        print("  WRONG:", w)
    for w in needless:
        print("  needless:", w)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
