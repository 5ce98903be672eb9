"""Trace: a user function → a flat program (our IR) with the user's annotations on it.

`jax.make_jaxpr` gives nested jaxprs; calls that only wrap a body (jit, closed_call,
custom_jvp_call, custom_vjp_call, checkpoint) are inlined so the propagation sees one flat list
of equations, zero pads and crops around convolutions become their padding (fold.py), and
duplicate pure equations (common after autodiff) are merged — else XLA would
merge them behind the plan's back and the plan would list collectives that never run. Each IR value is a fresh `Value` (inner jaxprs reuse their Var objects when called
twice, so jaxpr Vars cannot be keys). `shard_tensor` / `reshard` on tracers bind `hint_p`.
"""
from __future__ import annotations

import itertools
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax import lax
from jax._src import source_info_util
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jex_core

from ..layout import Layout
from ..mesh import ProcessMesh
from .batched_while import has_batched_predicate, scalar_predicate
from .constant_gathers import constant_gathers, known_constant
from .fold import fold_conv_padding
from .reversals import fold_reversals
from .shift import drop_dead, fold_shifts
from .simplify import (MAYBE_UNCHANGED, all_empty, is_one, same_cases, scalar_key, slice_of_part,
                       times_one, unchanged)
from .widen import widen_slices
from .gc_pause import gc_paused

# --------------------------------------------------------------------------------- hint primitive
hint_p = jex_core.Primitive("autoshard_hint")


def _hint_impl(x, *, mesh, layout, force):
    return x


def _hint_abstract(aval, *, mesh, layout, force):
    return aval


hint_p.def_impl(_hint_impl)
hint_p.def_abstract_eval(_hint_abstract)


def _hint_jvp(primals, tangents, *, mesh, layout, force):
    (x,), (t,) = primals, tangents
    out = hint_p.bind(x, mesh=mesh, layout=layout, force=force)
    if type(t) is jax.interpreters.ad.Zero:
        return out, t
    return out, hint_p.bind(t, mesh=mesh, layout=layout, force=force)


def _hint_transpose(ct, x, *, mesh, layout, force):
    # The cotangent is left free: the engine places it by cost. Pinning it to the value's
    # layout would, for a ZeRO-3 gather (reshard to replicated), force an all-reduce of the
    # gradient where a reduce-scatter into the param's shard is what the update wants. It is
    # marked, though: when the hint moved the value to another mesh, its cotangent goes back
    # to where the value came from (cut.py), which nothing else in the jaxpr says.
    if type(ct) is jax.interpreters.ad.Zero:
        return (ct,)
    return (hint_back_p.bind(ct),)


# The cotangent of a hinted value: an identity that build_program drops; cut.py reads it as
# "this value may move to the mesh of whoever reads it".
hint_back_p = jex_core.Primitive("autoshard_hint_back")
hint_back_p.def_impl(lambda x: x)
hint_back_p.def_abstract_eval(lambda aval: aval)
jax.interpreters.ad.deflinear2(hint_back_p, lambda ct, _: [ct])
jax.interpreters.batching.primitive_batchers[hint_back_p] = lambda args, dims: (args[0], dims[0])
jax.interpreters.mlir.register_lowering(hint_back_p, lambda ctx, x: [x])


def _hint_batch(args, dims, *, mesh, layout, force):
    return args[0], dims[0]  # vmapped values carry an extra dim: drop the hint rather than lie


jax.interpreters.ad.primitive_jvps[hint_p] = _hint_jvp
jax.interpreters.ad.primitive_transposes[hint_p] = _hint_transpose
jax.interpreters.batching.primitive_batchers[hint_p] = _hint_batch
jax.interpreters.mlir.register_lowering(hint_p, lambda ctx, x, **_: [x])


def bind_hint(x, mesh: ProcessMesh, layout: Layout, force: bool):
    return hint_p.bind(x, mesh=mesh, layout=layout, force=force)


# --------------------------------------------------------------------------------- the IR
Literal = jex_core.Literal


def _letters(n: int) -> str:
    """a, b, ..., z, aa, ab, ...: the n-th value's name (as jaxprs print them)."""
    s = ""
    while True:
        s = chr(ord("a") + n % 26) + s
        n = n // 26 - 1
        if n < 0:
            return s


def serial_of(name: str) -> int | None:
    """The n whose `_letters(n)` is `name` (None: no such name, e.g. "v140..."): finds a value
    named in a plan without naming every value of the program."""
    if not name or not name.isascii() or not name.isalpha() or not name.islower():
        return None
    n = 0
    for ch in name:
        n = n * 26 + (ord(ch) - ord("a") + 1)
    return n - 1


class Value:
    """One SSA value of the flat program. Compared and hashed by identity.

    A plain slotted class: a deep model's program makes tens of thousands of them, and a
    dataclass's generated constructor with a default factory cost a visible share of building
    it. The name is made when first printed.
    """

    __slots__ = ("aval", "const", "is_const", "producer", "serial", "_name")

    def __init__(self, aval: Any, serial: int = -1, const: Any = None, is_const: bool = False):
        self.aval = aval
        self.serial = serial       # order of creation in its program: names it
        self.const = const         # a literal or closed-over constant, else None
        self.is_const = is_const
        self.producer = -1         # index of the equation that makes it (-1: an input or constant)
        self._name = None

    @property
    def name(self) -> str:
        if self._name is None:
            self._name = _letters(self.serial) if self.serial >= 0 else f"v{id(self)}"
        return self._name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.aval.shape)

    @property
    def dtype(self):
        return self.aval.dtype

    def __repr__(self) -> str:
        return self.name


class Where:
    """The user's `file:line` of an equation, resolved when first read.

    Only explanations, warnings, errors and planned collectives read it — a few hundred of a
    deep model's ten thousand equations — so walking every equation's traceback while flattening
    the program would be wasted. Falls back to the enclosing call's line (`outer`): library
    internals such as jax.nn.relu's body report no user frame.
    """

    __slots__ = ("_info", "_outer", "_line")

    def __init__(self, info: Any, outer: "Where | None" = None):
        self._info, self._outer, self._line = info, outer, None

    @property
    def line(self) -> str | None:
        if self._info is not None or self._outer is not None:
            # the user's frame, else the enclosing call's line, else the library feature
            # that bound it (optax's update inside to_static's step: named by its package)
            user, feature = _user_and_feature(self._info)
            self._line = (user or (self._outer.line if self._outer else None)
                          or (_frame_line(*feature, qualified=True) if feature else None))
            self._info = self._outer = None
        return self._line


class Eqn:
    """One equation of the flat program (a slotted class, for the reason `Value` is one)."""

    __slots__ = ("primitive", "inputs", "outputs", "params", "where", "index", "sharding_cache",
                 "params_key")

    def __init__(self, primitive: Any, inputs: list[Value], outputs: list[Value], params: dict,
                 where: Where | None, index: int = 0, params_key: tuple | None = None):
        self.primitive = primitive
        self.inputs = inputs
        self.outputs = outputs
        self.params = params
        self.where = where
        self.index = index
        self.sharding_cache: dict = {}
        self.params_key = params_key  # `params_key(params)`, set by build_program

    @property
    def name(self) -> str:
        return self.primitive.name

    @property
    def source(self) -> str | None:
        """The user's `file:line` that produced this equation (None if unknown)."""
        return None if self.where is None else self.where.line

    def __repr__(self) -> str:
        return f"Eqn({self.primitive.name}, {self.inputs} -> {self.outputs}, index={self.index})"


@dataclass(eq=False)
class CustomRegion:
    """The inlined body of a custom_jvp_call / custom_vjp_call: eqns[start:stop].

    Planning sees the body like any other equations; partitioning re-wraps it in
    jax.custom_jvp / custom_vjp so that differentiating the partitioned program from outside
    uses the user's rule, not autodiff of the primal (`custom_rules.py`).
    """

    primitive: Any
    params: dict
    inputs: list[Value]
    outputs: list[Value]
    start: int
    stop: int


@dataclass(eq=False)
class Program:
    inputs: list[Value]
    outputs: list[Value]
    eqns: list[Eqn]
    consts: list[Value]
    regions: list[CustomRegion] = field(default_factory=list)
    # the user's line that ran the program (a call of the dist.jit function): the source of
    # what no equation of theirs made, an input returned as it came, a library function's body
    where: "Where | None" = None

    def readers(self) -> dict:
        """value -> [(equation index, operand index)] of every read by an equation, in program
        order; made once per program (the passes that need it share it)."""
        readers = self.__dict__.get("_readers")
        if readers is None:
            readers = {}
            for j, e in enumerate(self.eqns):
                for i, v in enumerate(e.inputs):
                    found = readers.get(v)
                    if found is None:
                        readers[v] = [(j, i)]
                    else:
                        found.append((j, i))
            self.__dict__["_readers"] = readers
        return readers

    def output_readers(self) -> dict:
        """value -> the indices of the program outputs it is."""
        found: dict = {}
        for k, v in enumerate(self.outputs):
            found.setdefault(v, []).append(k)
        return found

    def block_values(self, start: int, stop: int) -> tuple[tuple, list]:
        """The wiring of block eqns[start:stop]: every operand and result as the index of its
        value in order of first use (which reads are one value, inside the block or outside
        it), and those values. Equal wirings: blocks connected alike, position for position.
        Memoised per block: propagation, the plan and the block finder ask for the same ones."""
        blocks = self.__dict__.setdefault("_blocks", {})
        found = blocks.get((start, stop))
        if found is None:
            slots: dict = {}
            wiring = []
            for e in self.eqns[start:stop]:
                for v in e.inputs:
                    wiring.append(slots.setdefault(v, len(slots)))
                for v in e.outputs:
                    wiring.append(slots.setdefault(v, len(slots)))
            found = blocks[(start, stop)] = (tuple(wiring), list(slots))
        return found

    def use_counts(self) -> dict:
        """How many times each value is read (by equations and as a program output)."""
        counts = {v: len(r) for v, r in self.readers().items()}
        for v in self.outputs:
            counts[v] = counts.get(v, 0) + 1
        return counts


_INLINE_JAXPR_PARAM = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    # custom_vjp(optimize_remat=True) differentiated: its forward (residuals and outputs) is
    # the closed `fwd_jaxpr` of all its operands, constants first (jax evaluates it so)
    "remat_opt": "fwd_jaxpr",
    # a custom_vmap function (jax.custom_batching; sequential_vmap) met unbatched: its batching
    # rule has already run wherever it was vmapped, so what is left is its plain body
    "custom_vmap_call": "call",
    # lax.composite: its decomposition is its meaning; partitioned by its equations' rules
    # (the composite marker, which only a backend's pattern matching reads, is not kept)
    "composite": "jaxpr",
}  # checkpoint / remat are kept: their bodies are partitioned and re-wrapped (control_flow.py)

_CUSTOM_RULES = {"custom_jvp_call", "custom_vjp_call"}


def _linear_solve_body(params: dict, ins: list) -> tuple:
    """custom_linear_solve (jnp.linalg.solve / inv) evaluates its `solve` jaxpr on its own
    constants and the right-hand side; its other jaxprs only define derivatives, which jax has
    already taken when a gradient is computed inside. Inlined, the factorization and triangular
    solves it runs are partitioned by their rules."""
    lengths, jaxprs = params["const_lengths"], params["jaxprs"]
    start = lengths.matvec + lengths.vecmat
    consts = ins[start:start + lengths.solve]
    rhs = ins[sum(lengths):]
    return jaxprs.solve, consts + rhs


def _hi_primitive_body(eqn) -> Any:
    """jax 0.12's hijax primitives (`call_hi_primitive`: jnp.nonzero(size=) is one) say what
    they compute in lower-level jax (`to_lojax`); traced so on their operand types, their
    equations are partitioned by the rules. None where that cannot be done here (effects,
    operands of a high-level type): the primitive then runs replicated, with the warning."""
    to_lojax = getattr(eqn.primitive, "to_lojax", None)
    if to_lojax is None or eqn.effects or not all(
            isinstance(v.aval, jax.core.ShapedArray) for v in eqn.invars):
        return None
    try:
        return jax.make_jaxpr(lambda *args: to_lojax(*args, **eqn.params))(
            *[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars])
    except Exception:  # noqa: BLE001 — an expansion jax cannot trace here stays the primitive
        return None


_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# autoshard's binding plumbing: the compiler and the annotation entry points
_PLUMBING = (os.path.join(_PKG, "compiler") + os.sep, os.path.join(_PKG, "creation.py"))
_LIBRARY_MARKERS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def source_line(source_info) -> str | None:
    """`file:line` of the user's code that produced an equation.

    Frames inside installed libraries (optax, flax) and autoshard itself are skipped, so an
    optimizer update is attributed to the user's line that called it; with no such frame, the
    innermost library frame outside autoshard's compiler, by its package path, else None."""
    user, feature = _user_and_feature(source_info)
    return user or (_frame_line(*feature, qualified=True) if feature else None)


def _user_and_feature(source_info) -> tuple[str | None, tuple | None]:
    """(the user's `file:line`, None if no frame is the user's; the innermost library frame
    outside the binding plumbing). Walks the raw frames (what `source_info_util.user_frames`
    filters) and resolves the line of the chosen frame only: this runs once per equation.

    No user frame: a rule autoshard's own custom_vjp binds while jax differentiates, optax's
    update inside to_static's step — the feature that bound it (autoshard/ring_attention.py,
    optax/_src/update.py; Where reads the caller's `outer` line before it), never the
    plumbing (dist.jit(jnp.tanh)'s equations see only compiler/jit.py)."""
    if not source_info or not source_info.traceback:
        return None, None
    found = None
    for code, lasti in zip(*source_info.traceback.raw_frames()):
        if not source_info_util.is_user_filename(code.co_filename):
            continue  # jax's own frames
        if not _library_file(code.co_filename):
            return _frame_line(code, lasti), found
        if found is None and not code.co_filename.startswith(_PLUMBING):
            found = (code, lasti)
    return None, found


_LIBRARY_FILES: dict[str, bool] = {}
_FRAME_LINES: dict = {}


def _library_file(file_name: str) -> bool:
    """Whether frames of this file are autoshard's or an installed library's (memoised)."""
    known = _LIBRARY_FILES.get(file_name)
    if known is None:
        known = file_name.startswith(_PKG) or any(m in file_name for m in _LIBRARY_MARKERS)
        _LIBRARY_FILES[file_name] = known
    return known


def _frame_line(code, lasti: int, qualified: bool = False) -> str:
    """`file:line` of one raw frame (memoised: a layer's equations come from the same lines);
    `qualified`: a library's file by its package path (optax/_src/update.py), not its name."""
    line = _FRAME_LINES.get((code, lasti, qualified))
    if line is None:
        frame = source_info_util.raw_frame_to_frame(code, lasti)
        name = _package_path(frame.file_name) if qualified else os.path.basename(frame.file_name)
        line = f"{name}:{frame.start_line}"
        if len(_FRAME_LINES) >= 65536:
            _FRAME_LINES.clear()
        _FRAME_LINES[(code, lasti, qualified)] = line
    return line


def _package_path(file_name: str) -> str:
    """An installed library's (or autoshard's) file from its package's folder on."""
    for marker in _LIBRARY_MARKERS:
        if marker in file_name:
            return file_name.rsplit(marker, 1)[1]
    if file_name.startswith(_PKG):
        return os.path.relpath(file_name, os.path.dirname(_PKG))
    return os.path.basename(file_name)


def bind_eqn(eqn: Any, invals: list, params: dict | None = None) -> list:
    """Bind a jaxpr equation again on new operands (as jax's eval_jaxpr does), under the user's
    source line so that the new equation reports it too."""
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    with source_info_util.user_context(eqn.source_info.traceback), eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _broadcasts_per_reader(eqns: list, outputs: list, regions: list, fresh,
                           constant: set = frozenset()) -> list:
    """`eqns` with a scalar's broadcast read by several equations made once per reader (each
    copy right after it): a broadcast made in one reader's layout and moved for another lists
    a gather XLA folds into a local broadcast (the gradient of a mean, read by a cross-entropy's
    two terms split differently). So too the broadcast of a value computed from constants
    alone (`constant`: a causal mask, read by the attention's select split by heads and by its
    gradient's split by batch — XLA computes it in place, the plan moved it). Top-level
    broadcasts only: a custom rule's region hands out what it makes as its outputs, which stay
    single values."""
    in_region = {id(e) for r in regions for e in eqns[r.start:r.stop]} if regions else set()
    many = {}
    for e in eqns:
        if (e.primitive is lax.broadcast_in_dim_p and id(e) not in in_region
                and (not e.inputs[0].aval.shape or e.inputs[0] in constant)):
            many[e.outputs[0]] = e
    if not many:
        return eqns
    readers: dict = {}
    kept = set(outputs)  # read as they are: by the outputs, or inside a region (its operands)
    for e in eqns:
        for v in e.inputs:
            if v in many:
                if id(e) in in_region:
                    kept.add(v)
                    continue
                found = readers.setdefault(v, [])
                if not found or found[-1] is not e:
                    found.append(e)
    copies: dict = {}  # id(broadcast eqn) -> [its copies]
    for v, rs in readers.items():
        keep = 0 if v in kept else 1  # the first reader (or the outputs) keeps the original
        for r in rs[keep:]:
            b = many[v]
            made = fresh(v.aval)
            copies.setdefault(id(b), []).append(
                Eqn(b.primitive, list(b.inputs), [made], dict(b.params), b.where,
                    params_key=b.params_key))
            r.inputs = [made if x is v else x for x in r.inputs]
    if not copies:
        return eqns
    new, at = [], []
    for e in eqns:
        at.append(len(new))
        new.append(e)
        new.extend(copies.get(id(e), ()))
    at.append(len(new))
    for r in regions:
        r.start, r.stop = at[r.start], at[r.stop]
    return new


def params_key(params: dict) -> tuple | None:
    """`params` as a hashable key (None if some value is not hashable, e.g. an array)."""
    try:
        key = tuple(sorted(params.items()))
        hash(key)
    except TypeError:
        return None
    return key


# How `build_program` treats a primitive: copied as it is (merged with an equal equation, if
# any); first checked for a step XLA's simplifier removes (simplify.py) and noted for the folds
# that read concatenations and broadcasts; or a case of its own (annotations, calls it inlines,
# branches on constants, loops, slices of concatenations)
_PLAIN, _SIMPLIFIABLE, _SPECIAL = "plain", "simplifiable", "special"
_SIMPLIFIABLE_PRIMITIVES = frozenset({lax.mul_p, lax.select_n_p, lax.concatenate_p,
                                      lax.broadcast_in_dim_p, *MAYBE_UNCHANGED})
_SPECIAL_NAMES = frozenset({*_INLINE_JAXPR_PARAM, "custom_linear_solve", "call_hi_primitive",
                            "device_put"})


_VIEWS = (lax.reshape_p, lax.squeeze_p, lax.broadcast_in_dim_p)


def _is_view(eqn) -> bool:
    """`eqn` (one of `_VIEWS`) keeps its operand's elements in their order, laid out as jax
    pleases (no sharding of its own): a reshape, a squeeze, or a broadcast that only inserts
    dims of size 1."""
    params = eqn.params
    if params.get("sharding") is not None:
        return False
    if eqn.primitive is lax.reshape_p:
        return params.get("dimensions") is None
    if eqn.primitive is lax.squeeze_p:
        return True
    kept = tuple(params["broadcast_dimensions"])
    shape, operand = params["shape"], eqn.invars[0].aval.shape
    return (list(kept) == sorted(set(kept))
            and all(shape[d] == n for d, n in zip(kept, operand))
            and all(n == 1 for d, n in enumerate(shape) if d not in kept))


def _kind(p) -> str:
    if p is hint_back_p or p is lax.cond_p or p is lax.while_p or p is lax.slice_p \
            or p.name in _SPECIAL_NAMES:
        return _SPECIAL
    return _SIMPLIFIABLE if p in _SIMPLIFIABLE_PRIMITIVES else _PLAIN


def _hints_in_place(jaxpr: Any) -> Any:
    """`dist.shard_tensor(x, mesh, placements)` whose result is never read (Paddle's static
    form: the call marks `x`, as seed §4.1 writes it) annotates `x` for what reads it after:
    those readers read the annotated value. Dead code otherwise, the annotation was dropped
    and the step ran replicated, silently. (A dist.reshard's result is a new tensor in Paddle
    too: an unread one stays dead.) In the traced function itself, where the seeds write it;
    inside a jax.checkpoint or loop body the result must be assigned."""
    hints = [k for k, e in enumerate(jaxpr.eqns) if e.primitive is hint_p
             and not e.params["force"] and isinstance(e.invars[0], jex_core.Var)]
    if not hints:  # (the common case: one pass, no sets)
        return jaxpr
    used = {id(v) for e in jaxpr.eqns for v in e.invars if isinstance(v, jex_core.Var)}
    used |= {id(v) for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
    unread = {k for k in hints if id(jaxpr.eqns[k].outvars[0]) not in used}
    if not unread:
        return jaxpr
    renamed: dict = {}  # input of an unread annotation -> the annotated value
    eqns = []
    for k, e in enumerate(jaxpr.eqns):
        if renamed and any(id(v) in renamed for v in e.invars if isinstance(v, jex_core.Var)):
            e = e.replace(invars=[renamed.get(id(v), v) if isinstance(v, jex_core.Var) else v
                                  for v in e.invars])
        eqns.append(e)
        if k in unread:
            renamed[id(jaxpr.eqns[k].invars[0])] = e.outvars[0]
    outvars = [renamed.get(id(v), v) if isinstance(v, jex_core.Var) else v
               for v in jaxpr.outvars]
    return jaxpr.replace(eqns=eqns, outvars=outvars)


def _unread_sort_operands(eqns: list, outputs: list, regions: list) -> bool:
    """Drop the operands of a sort that are not keys and whose sorted results nothing reads
    (a grad-only step keeps sort_key_val's permutation, not the sorted values), as XLA's sort
    simplifier does: else their moves are planned and listed, and XLA runs none of them.
    Whether any was dropped (what only fed them is dead)."""
    sorts = [e for e in eqns if e.primitive is lax.sort_p and len(e.outputs) > e.params["num_keys"]]
    if not sorts:
        return False
    read = {v for e in eqns for v in e.inputs}
    read.update(outputs)
    read.update(v for r in regions for v in (*r.inputs, *r.outputs))
    dropped = False
    for e in sorts:
        keys = e.params["num_keys"]
        kept = [i for i, v in enumerate(e.outputs) if i < keys or v in read]
        if len(kept) < len(e.outputs):
            e.inputs = [e.inputs[i] for i in kept]
            e.outputs = [e.outputs[i] for i in kept]
            dropped = True
    return dropped


@gc_paused
def build_program(closed: Any, *, inline_solves: bool = True,
                  stop_gradients: bool = True) -> Program:
    """Flatten a ClosedJaxpr into a Program, inlining body-wrapping calls.

    `inline_solves`: a custom_linear_solve becomes the equations of its solve, partitioned by
    their rules. Off when the program is itself differentiated from outside: the inlined
    solve runs on stop_gradient'ed factors, so the solve is then a region (custom_rules.py)
    whose derivative is the primitive's own, planned and partitioned in turn.
    `stop_gradients`: keep them. A program nothing differentiates from outside (a dist.jit
    call at the top level: any jax.grad ran inside, when it was traced) computes nothing with
    them — XLA drops them and merges what they made different (the softmax of a value and of
    its stop_gradient, `x - sg(m)` beside `x - m`) — so they are dropped here, and equations
    equal but for one are one equation, planned once: the plan lists the collectives the
    compiled program runs, not one per copy XLA merged."""
    serials = itertools.count()
    eqns: list[Eqn] = []
    consts: list[Value] = []
    called = Where(source_info_util.current())  # the user's call, resolved only if read

    def fresh(aval) -> Value:
        return Value(aval, next(serials))

    # values computed from constants alone (literals, closed-over arrays, iotas), without
    # effects: their broadcasts are made once per reader (`_broadcasts_per_reader`)
    constant: set = set()

    def const_value(val, aval) -> Value:
        v = Value(aval, next(serials), const=val, is_const=True)
        consts.append(v)
        constant.add(v)
        return v

    # literal -> its value as a key: `cse_key` compares literals by value, so an expression
    # written twice (jnp indexing's `i < 0`, `i + n` for two tables read at the same ids) is one
    # equation, as XLA's CSE makes it, and its moves are planned once. Each literal stays a
    # constant of its own: equal layers do not share one (their blocks stay apart, repeats.py)
    literal_keys: dict = {}

    def literal(atom) -> Value:
        v = const_value(atom.val, atom.aval)
        # (bytes tell -0.0 from 0.0)
        literal_keys[id(v)] = (atom.aval, type(atom.val), np.asarray(atom.val).tobytes())
        return v

    seen: dict = {}  # (primitive, inputs, params) → outputs: duplicate pure equations run once
    kinds: dict = {}  # primitive -> _PLAIN, or whether it has a case of its own (`_kind`)
    made_by: dict = {}  # value -> its equation, for the equations up to `indexed[0]`
    indexed = [0]

    def constant_branch(branches, index: Value):
        """The branch a cond takes whatever the inputs (its index a computed constant)."""
        if not index.is_const:
            made_by.update((v, e) for e in eqns[indexed[0]:] for v in e.outputs)
            indexed[0] = len(eqns)
            if index not in made_by:
                return None
        found = known_constant(index, made_by)
        return None if found is None else branches[int(np.clip(found, 0, len(branches) - 1))]
    # an equation was replaced by one of its operands (a select of equal cases) or a slice of
    # one part of a concatenation: what only fed it is dead
    pruned = [False]
    empty_at: list = []  # top-level equations making only empty arrays
    fills: dict = {}  # broadcast of a scalar constant -> the constant (`same_cases`)
    concats: dict = {}  # a concatenation -> (its dim, its parts) (`slice_of_part`)
    effectful: set = set()  # indices of equations with effects (kept though unread)
    ones: set = set()  # broadcasts of a scalar 1 (`is_one`)
    regions: list[CustomRegion] = []
    depth = [0]  # custom-rule nesting: only outermost bodies become regions

    is_literal = literal_keys.__contains__
    view_roots: dict = {}  # a view's id -> the value its chain of views starts from (`cse_key`)

    def cse_key(eqn, ins, params):
        if eqn.effects or params is None:  # params holding arrays: not worth comparing
            return None
        prim = eqn.primitive
        if prim is lax.broadcast_in_dim_p and not ins[0].aval.shape:
            # a scalar's broadcast is made in any layout for free: one per reader, so that
            # readers wanting it laid out differently (a cond branch's placeholder results,
            # two of them one value once merged) do not move it
            return None
        if prim in _VIEWS and _is_view(eqn):
            # a reshape and a broadcast adding unit dims (jnp.linspace writes both of its stop)
            # are the same elements in the same order: one value, as XLA's CSE of the two
            # bitcasts makes them, or the plan moves both. Keyed by the value a chain of views
            # starts from, which a view back to its shape is (`x[:, None]` squeezed). (Not in a
            # region: its body reads only its inputs.)
            root = ins[0] if depth[0] else view_roots.get(id(ins[0]), ins[0])
            if not depth[0]:
                seen.setdefault((_VIEWS, id(root), root.aval.shape), [root])
            return (_VIEWS, id(root), eqn.outvars[0].aval.shape)
        # (values live while building: ids are unique). Literals by value only beside a
        # computed operand: a step of literals alone (a cast of a constant) stays one per
        # layer, or equal layers would read one layer's result and stop being equal blocks
        ids = tuple(map(id, ins))
        if not any(map(is_literal, ids)):  # (most equations: checked without a key per read)
            return (eqn.primitive, ids, params)
        keys = [literal_keys.get(i, i) for i in ids]
        if all(type(k) is tuple for k in keys):
            return (eqn.primitive, ids, params)
        return (eqn.primitive, tuple(keys), params)

    def own_outputs(outs: list[Value], start: int, source: Where) -> list[Value]:
        # An output the body passes through (custom_vjp identity with a gradient rule) must be
        # a value of its own, or wrapping the region would rename the input for every reader.
        made = {id(v) for e in eqns[start:] for v in e.outputs}
        fixed = []
        for v in outs:
            if id(v) not in made:
                out = fresh(v.aval)
                eqns.append(Eqn(lax.copy_p, [v], [out], {}, source, params_key=()))
                made.add(id(out))
                v = out
            fixed.append(v)
        return fixed

    def noted(eqn, ins: list[Value], outs: list[Value]) -> None:
        """What the simplifications and folds below ask of a concatenation or broadcast."""
        prim = eqn.primitive
        if prim is lax.concatenate_p:
            if not depth[0]:  # (a region reads only its inputs: not inside)
                concats[outs[0]] = (eqn.params["dimension"], ins)
        elif prim is lax.broadcast_in_dim_p:
            if is_one(ins[0], ones):
                ones.add(outs[0])
            if (ins[0].is_const and not ins[0].aval.shape
                    and isinstance(ins[0].aval.dtype, np.dtype)):
                fills[outs[0]] = scalar_key(ins[0])
                # each reader has its own broadcast of a scalar (`cse_key`), but an equation
                # reading one compares it by value, as a literal: two `where(c, x, 1.0)` are
                # one equation, as XLA's CSE makes them (jax.scipy.special's zeta writes it
                # twice), else the plan moves both copies
                literal_keys[id(outs[0])] = ("fill", outs[0].aval, fills[outs[0]])

    def walk(jaxpr, const_vals, inputs: list[Value], outer: Where | None = None) -> list[Value]:
        env: dict[Any, Value] = {}
        for var, val in zip(jaxpr.constvars, const_vals):
            env[var] = const_value(val, var.aval)
        for var, v in zip(jaxpr.invars, inputs):
            env[var] = v

        def read(atom) -> Value:
            if isinstance(atom, jex_core.Literal):
                return literal(atom)
            return env[atom]

        for eqn in jaxpr.eqns:
            ins = [env[a] if type(a) is not Literal else literal(a) for a in eqn.invars]
            prim = eqn.primitive
            kind = kinds.get(prim)
            if kind is None:
                kind = kinds[prim] = _kind(prim)
            if kind is _SPECIAL:
                if prim is hint_back_p:  # within one mesh, an identity
                    env[eqn.outvars[0]] = ins[0]
                    continue
                source = Where(eqn.source_info, outer)
                key = _INLINE_JAXPR_PARAM.get(eqn.primitive.name)
                inner = eqn.params.get(key) if key else None
                body_ins, solve_region = ins, False
                if eqn.primitive.name == "custom_linear_solve":
                    # inlined; differentiated from outside, as a region that keeps the solve's
                    # own derivative (the inlined body runs on stop_gradient'ed factors)
                    inner, body_ins = _linear_solve_body(eqn.params, ins)
                    solve_region = not inline_solves
                    if inline_solves:
                        ins = body_ins
                elif eqn.primitive.name == "call_hi_primitive":
                    inner = _hi_primitive_body(eqn)
                if inner is not None:
                    if hasattr(inner, "jaxpr"):  # ClosedJaxpr
                        inner_jaxpr, inner_consts = inner.jaxpr, inner.consts
                    else:
                        inner_jaxpr, inner_consts = inner, []
                    custom = eqn.primitive.name in _CUSTOM_RULES or solve_region
                    if custom:
                        # A region's body must read only its inputs and constants: equations are
                        # not merged across its boundary.
                        outer_seen, start = dict(seen), len(eqns)
                        seen.clear()
                        depth[0] += 1
                    outs = walk(inner_jaxpr, inner_consts, body_ins, source)
                    if custom:
                        depth[0] -= 1
                        seen.clear()
                        seen.update(outer_seen)
                        if depth[0] == 0:
                            outs = own_outputs(outs, start, source)
                            regions.append(CustomRegion(eqn.primitive, dict(eqn.params), list(ins),
                                                        list(outs), start, len(eqns)))
                    env.update(zip(eqn.outvars, outs))
                    continue
                if eqn.primitive.name == "device_put" and len(ins) > 1:
                    # jax.device_put of a pytree is one equation; per array it lays out (and may
                    # constrain) each value on its own, as its own equation
                    for i, (x, out) in enumerate(zip(ins, eqn.outvars)):
                        one = {k: (v[i],) if isinstance(v, tuple) and len(v) == len(ins) else v
                               for k, v in eqn.params.items()}
                        made = fresh(out.aval)
                        eqns.append(Eqn(eqn.primitive, [x], [made], one, source,
                                        params_key=params_key(one)))
                        env[out] = made
                    continue
                if eqn.primitive is lax.cond_p and not eqn.effects:
                    branch = constant_branch(eqn.params["branches"], ins[0])
                    if branch is not None:
                        # an index known when compiling (a schedule on a constant step): the branch
                        # it picks, as XLA folds it (both branches planned listed both's moves)
                        outs = walk(branch.jaxpr, branch.consts, ins[1:], source)
                        env.update(zip(eqn.outvars, outs))
                        pruned[0] = True
                        continue
                if eqn.primitive is lax.while_p and has_batched_predicate(eqn.params):
                    # jax.vmap of a loop with a per-example condition: as the scalar-predicate loop
                    # jax lowers it to (batched_while.py)
                    loop, ins = scalar_predicate(eqn.params, ins)
                    outs = [fresh(v.aval) for v in eqn.outvars]
                    if eqn.effects:
                        effectful.add(len(eqns))
                    eqns.append(Eqn(eqn.primitive, ins, outs, loop, source,
                                    params_key=params_key(loop)))
                    env.update(zip(eqn.outvars, outs))
                    continue
                if eqn.primitive is lax.slice_p and ins[0] in concats and not depth[0]:
                    # a slice of one concatenated part is a slice of that part (as XLA folds it)
                    part = slice_of_part(eqn.params, *concats[ins[0]])
                    if part is not None:
                        pruned[0] = True
                        ins, (x, params) = [part[0]], part
                        if params is None:
                            env[eqn.outvars[0]] = x
                            continue
                        eqn = eqn.replace(params=params)
            else:
                if prim is lax.stop_gradient_p and not stop_gradients:
                    env[eqn.outvars[0]] = ins[0]
                    continue
                if kind is _SIMPLIFIABLE:
                    kept = (times_one(ins, eqn.outvars[0].aval, ones) if prim is lax.mul_p
                            else same_cases(ins, eqn.outvars[0].aval, fills)
                            if prim is lax.select_n_p else unchanged(eqn, ins))
                    if kept is not None:  # x * 1 is x (jax's gradient of a sum multiplies by
                        env[eqn.outvars[0]] = kept  # a broadcast 1), as are the steps of
                        # simplify.py: as XLA simplifies them, or the plan moves a copy the
                        # program never makes
                        if prim is lax.select_n_p:
                            pruned[0] = True  # (its predicate may now be read by nothing)
                        continue
                source = Where(eqn.source_info, outer)
            # every other equation: merged with an equal one made before, or copied
            params = params_key(eqn.params)
            key = cse_key(eqn, ins, params)
            if key is not None:
                found = seen.get(key)
                if found is not None:
                    env.update(zip(eqn.outvars, found))
                    continue
            outs = [Value(v.aval, next(serials)) for v in eqn.outvars]
            if key is not None:
                seen[key] = outs
                if key[0] is _VIEWS and not depth[0]:
                    view_roots[id(outs[0])] = view_roots.get(id(ins[0]), ins[0])
                if outs and 0 in outs[0].aval.shape and not depth[0] and all_empty(outs):
                    empty_at.append(len(eqns))  # (made constants below)
            elif eqn.effects:
                effectful.add(len(eqns))
            if not eqn.effects and constant.issuperset(ins):
                constant.update(outs)
            eqns.append(Eqn(prim, ins, outs, dict(eqn.params), source, params_key=params))
            env.update(zip(eqn.outvars, outs))
            if kind is _SIMPLIFIABLE:
                noted(eqn, ins, outs)
        return [read(a) if isinstance(a, jex_core.Literal) else env[a] for a in jaxpr.outvars]

    # Dead code out first, into every body (a user's shard_map included): what XLA would drop
    # must not be planned, or the plan lists collectives the compiled program never runs (the
    # unused primal output of a differentiated local_map). Every input is kept.
    jaxpr, _ = pe.dce_jaxpr(_hints_in_place(closed.jaxpr),
                            [True] * len(closed.jaxpr.outvars), instantiate=True)
    inputs = [fresh(v.aval) for v in jaxpr.invars]
    outputs = walk(jaxpr, closed.consts, inputs, called)
    if empty_at:
        # an empty array holds nothing: a constant, so what only fed it is dead and not
        # planned (jnp.pad's statistics of a dim padded by nothing, which XLA drops: the plan
        # listed their collectives). An output keeps its equation, whose layout it reports.
        returned = set(outputs)
        zeros = {v: const_value(np.zeros(v.aval.shape, v.aval.dtype), v.aval)
                 for k in empty_at if not any(v in returned for v in eqns[k].outputs)
                 for v in eqns[k].outputs}
        if zeros:
            pruned[0] = True
            for e in eqns:
                if any(v in zeros for v in e.inputs):
                    e.inputs = [zeros.get(v, v) for v in e.inputs]
            for r in regions:
                r.inputs = [zeros.get(v, v) for v in r.inputs]
    if _unread_sort_operands(eqns, outputs, regions):
        pruned[0] = True
    if pruned[0]:  # what only fed the replaced equations: top-level, without effects
        inside = {id(e) for r in regions for e in eqns[r.start:r.stop]}
        eqns = drop_dead(eqns, outputs, regions,
                         {v for r in regions for v in (*r.inputs, *r.outputs)}, Counter(),
                         also=frozenset(id(e) for k, e in enumerate(eqns)
                                        if k not in effectful and id(e) not in inside))
    eqns = constant_gathers(eqns, outputs, regions, fresh, const_value)
    eqns = fold_conv_padding(eqns, outputs, regions)
    eqns = fold_shifts(eqns, outputs, regions)
    eqns = fold_reversals(eqns, outputs, regions)
    eqns = widen_slices(eqns, outputs, regions, fresh, const_value)
    eqns = _broadcasts_per_reader(eqns, outputs, regions, fresh, constant)
    for i, e in enumerate(eqns):
        e.index = i
        for v in e.outputs:
            v.producer = i
    return Program(inputs, outputs, eqns, consts, regions, called)



__all__ = ["hint_p", "hint_back_p", "bind_eqn", "bind_hint", "serial_of", "Value", "Eqn", "Program", "CustomRegion", "build_program", "source_line", "Where"]
