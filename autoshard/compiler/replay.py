"""Replay: a lowering traced once is emitted again for every equal equation.

Binding one primitive through jax's tracer costs tens of microseconds of Python (dispatch,
abstract evaluation, tracer bookkeeping), and our lowering adds check_vma casts and rule code on
top. A deep model repeats the same equations with the same layouts layer after layer, so the
equations the first one emitted into jax's trace frame are recorded, and for every later equal
equation (same primitive, params, layouts, local input types and aliasing) they are emitted
again with its inputs substituted: no dispatch, no abstract evaluation, no rule code.

This reads jax's tracing internals (`DynamicJaxprTrace.emit_eqn`, the frame's equation list).
Whatever does not look as expected — another kind of trace, an equation with effects (other
than naming a mesh axis), inputs that are not tracers of the current trace — is not recorded,
and that equation is bound as before: replay only ever skips work, it never decides anything.

Lowerings are also kept across partitioned programs (`SHARED`): a lowering is a pure function
of its key (primitive, params, global types, layouts), the local operand types, the mesh's axis
sizes, the rule registry's contents and jax's tracing configuration, so a second program in the
process with equal equations — the eval step beside the train step, another pipeline stage,
to_static's other modes, a fresh dist.jit of the same model — emits them without lowering them
again. Only templates that read nothing of the trace that recorded them but their operands and
literals are shared, and none whose equations carry Python callables in their params (a custom
derivative's rule closes over its lowering's state). An outlined block's call is one such
template, under the block's identity by value (outline.py, partition.py).
"""
from __future__ import annotations

import functools
import types
import weakref
from typing import Any, Callable

import numpy as np
from jax._src import core as jcore
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jex_core

_IN, _MADE, _FIXED, _LIT = 0, 1, 2, 3  # where an emitted equation's operand comes from

_SUPPORTED = (hasattr(pe, "DynamicJaxprTrace") and hasattr(pe.DynamicJaxprTrace, "emit_eqn")
              and hasattr(pe, "TracingEqn") and hasattr(pe, "DynamicJaxprTracer")
              and "tracing_eqns" in getattr(pe.JaxprStackFrame, "__slots__", ()))


_NAMED_AXIS = getattr(jcore, "NamedAxisEffect", None)

try:  # what Primitive.bind does to a numpy operand before staging it
    from jax._src.dtypes import canonicalize_value as _canonical
    from jax._src import source_info_util as _source_info
except ImportError:  # another jax: scalars go through jnp.asarray
    _canonical = None
try:  # jax's own caches of traced work key on this (x64, threefry, the abstract mesh, ...)
    from jax._src.config import trace_context as _trace_context
except ImportError:  # another jax: nothing is shared between programs
    _trace_context = None


class _Template:
    """`trace` None: its equations read nothing of the trace that recorded them but their
    operands and literals, so they may be emitted into any trace (an outlined block's, a custom
    rule's body, another program's); else only into `trace`. `shareable`: none of its
    equations' params holds a Python callable (kept to the program that made it)."""

    __slots__ = ("trace", "steps", "outs", "shareable", "note")

    def __init__(self, trace, steps, outs, shareable):
        self.trace, self.steps, self.outs, self.shareable = trace, steps, outs, shareable
        self.note = None  # what the caller keeps with it (Replayer.run's `note`)


def _axis_effects_only(effects) -> bool:
    """No effects but naming a mesh axis (axis_index, collectives): those depend on nothing
    but the equation itself, so emitting it again is the same as binding it again."""
    return all(type(e) is _NAMED_AXIS for e in effects)


def _ref(var_pos: dict, tracer) -> tuple:
    ref = var_pos.get(id(tracer.val))
    if ref is None:
        if isinstance(tracer.val, jcore.Literal):  # kept as data: no tracer of a done trace
            ref = (_LIT, tracer.aval, tracer.val, tracer._line_info)
        else:
            ref = (_FIXED, tracer)
    return ref


_CALLABLE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)


def _is_callable(x) -> bool:
    return isinstance(x, _CALLABLE) or type(x).__name__ == "WrappedFun"


def _holds_callable(params: dict) -> bool:
    """A param that is a Python function (a custom derivative's rule, a thunk), or holds one
    one level down or in the equations of a jaxpr it holds (an outlined block's call): the
    equation may depend on state its lowering closed over."""
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if _is_callable(x):
                return True
            if isinstance(x, jex_core.ClosedJaxpr):  # (jax >= 0.12 keeps it only here)
                x = x.jaxpr
            if isinstance(x, jcore.Jaxpr) and any(_holds_callable(e.params) for e in x.eqns):
                return True
    return False


def _record(trace, entries: list, ins: list, outs: list) -> _Template | None:
    """The equations one lowering emitted, with operands as references (None: not replayable)."""
    var_pos: dict[int, tuple] = {}
    for i, x in enumerate(ins):
        var_pos.setdefault(id(x.val), (_IN, i))
    steps = []
    for entry in entries:
        eqn = entry() if isinstance(entry, weakref.ReferenceType) else entry
        if eqn is None:
            continue  # nothing reads its results: jax drops it too
        if not isinstance(eqn, pe.TracingEqn) or not _axis_effects_only(eqn.effects):
            return None
        refs = tuple(_ref(var_pos, t) for t in eqn.in_tracers)
        for k, v in enumerate(eqn.outvars):
            var_pos[id(v)] = (_MADE, len(steps), k)
        steps.append((refs, [v.aval for v in eqn.outvars], eqn.primitive, eqn.params,
                      eqn.effects, eqn.source_info, eqn.ctx))
    out_refs = []
    for o in outs:
        if not isinstance(o, pe.DynamicJaxprTracer) or o._trace is not trace:
            return None
        out_refs.append(_ref(var_pos, o))
    portable = not any(r[0] == _FIXED for step in steps for r in step[0]) \
        and not any(r[0] == _FIXED for r in out_refs)
    shareable = portable and not any(_holds_callable(step[3]) for step in steps)
    return _Template(None if portable else trace, steps, out_refs, shareable)


def _replay(t: _Template, ins: list, trace, name: str | None = None) -> list:
    made: list[list] = []

    def get(r):
        kind = r[0]
        if kind == _IN:
            return ins[r[1]]
        if kind == _MADE:
            return made[r[1]][r[2]]
        if kind == _FIXED:
            return r[1]
        return pe.DynamicJaxprTracer(trace, r[1], r[2], r[3])  # a literal, made in this trace

    emit = trace.emit_eqn
    for refs, out_avals, primitive, params, effects, source, ctx in t.steps:
        if name is not None and "name" in params:
            params = {**params, "name": name}
        made.append(emit([get(r) for r in refs], out_avals, primitive, params, effects, source, ctx))
    return [get(r) for r in t.outs]


def literal(value: np.ndarray):
    """A numpy scalar as a literal of the current trace, as binding it as an operand makes
    it — without first putting it on a device (jnp.asarray costs ~40 µs a scalar, this ~7).
    None where the current trace is not a jaxpr trace (the caller makes a jax array)."""
    trace = jcore.trace_ctx.trace
    if _canonical is None or not ENABLED or type(trace) is not pe.DynamicJaxprTrace \
            or not hasattr(trace, "to_jaxpr_tracer"):
        return None
    return trace.to_jaxpr_tracer(_canonical(value), _source_info.current())


def _bound(bind: Callable[[], list]) -> list:
    STATS["bound"] += 1
    return bind()


def _literal_value(lit) -> tuple | None:
    """A hashable stand-in for a scalar literal's value (None: not a scalar literal)."""
    if not isinstance(lit, jcore.Literal):
        return None
    value = np.asarray(lit.val)
    if value.ndim:
        return None
    return (value.dtype.str, value.tobytes())


ENABLED = True  # off: every equation is bound afresh (the tests compare both programs)
SHARED = True   # off: lowerings are kept for one call of a partitioned function only
STATS = {"replayed": 0, "bound": 0}  # equations re-emitted / bound, over the process

_SHARED_TEMPLATES: dict = {}  # (context, jax's tracing context, name stack, key) -> _Template
_MAX_SHARED = 4096  # past this the table starts over (old entries only miss, never lie); a
# GPT train step of any depth keeps ~170, of ~380 equations with their tracebacks


def clear_shared() -> None:
    """Forget the lowerings kept across programs (the benchmark times a first compile so;
    a rule registered again needs nothing: the registry's generation is part of the key)."""
    _SHARED_TEMPLATES.clear()


class Replayer:
    """Per call of a partitioned function: records each distinct lowering once, replays the
    rest. `context`: what its lowerings read besides a key and the operands (the mesh's axis
    sizes, the rule registry, ...); given, lowerings of keys marked `shared` are kept for
    other programs with the same context too."""

    def __init__(self, context: Any = None) -> None:
        self._templates: dict = {}
        self._context = context
        self.note: Any = None  # the `note` of the last run's lowering

    def _bound(self, bind: Callable[[], list], note: Callable[[], Any] | None) -> list:
        outs = _bound(bind)
        self.note = None if note is None else note()
        return outs

    def _shared_key(self, full: tuple):
        if not SHARED or self._context is None or _trace_context is None:
            return None
        # the name stack: the emitted equations carry it into the HLO's op names
        return (self._context, _trace_context(), _source_info.current_name_stack(), full)

    def run(self, key: Any, ins: list, bind: Callable[[], list], *,
            by_value: bool = True, shared: bool = False, note: Callable[[], Any] | None = None,
            name: str | None = None) -> list:
        """`bind()` the equation the first time its `key` is seen (with these operand types);
        re-emit what it emitted every later time. `key` None: always bind.

        `by_value` False: `bind` emits the same equations whatever the values of literal
        operands (a jitted call, traced on abstract types), so they are not part of the key.
        `shared`: the key says everything the lowering depends on besides the operands and
        this replayer's context, in any program (not a number of this program's).
        `note()`: what the caller needs to know about the lowering, asked after binding it and
        kept with it; `self.note` holds it after every run. `name`: the name a replayed call
        equation (an outlined block's) takes, whichever program recorded it.
        """
        trace = jcore.trace_ctx.trace
        if key is None or not (_SUPPORTED and ENABLED) or type(trace) is not pe.DynamicJaxprTrace:
            return self._bound(bind, note)
        literals = []
        for x in ins:
            if type(x) is not pe.DynamicJaxprTracer or x._trace is not trace:
                return self._bound(bind, note)
            if not isinstance(x.val, jcore.Var):
                value = _literal_value(x.val)
                if value is None:
                    return self._bound(bind, note)
                if by_value:
                    literals.append(value)
        # the operand types (local shape, dtype, varying axes), which operands are one value,
        # and the values of literal operands (a lowering may fold them)
        first: dict[int, int] = {}
        aliasing = tuple(first.setdefault(id(x.val), i) for i, x in enumerate(ins))
        full = (key, tuple(x.aval for x in ins), aliasing, tuple(literals))
        t = self._templates.get(full, self)
        if t is None:  # recorded before and found not replayable
            return self._bound(bind, note)
        gkey = None
        if t is self and shared:
            gkey = self._shared_key(full)
            if gkey is not None:
                t = _SHARED_TEMPLATES.get(gkey, self)
                if t is not self:
                    self._templates[full] = t
        if t is not self and (t.trace is None or t.trace is trace):
            STATS["replayed"] += 1
            self.note = t.note
            return _replay(t, ins, trace, name)
        frame = trace.frame
        start = len(frame.tracing_eqns)
        outs = self._bound(bind, note)
        t = self._templates[full] = _record(trace, frame.tracing_eqns[start:], ins, outs)
        if t is not None:
            t.note = self.note
        if gkey is not None and t is not None and t.shareable:
            if len(_SHARED_TEMPLATES) >= _MAX_SHARED:
                _SHARED_TEMPLATES.clear()
            _SHARED_TEMPLATES[gkey] = t
        return outs


__all__ = ["Replayer", "literal", "clear_shared", "ENABLED", "SHARED", "STATS"]
