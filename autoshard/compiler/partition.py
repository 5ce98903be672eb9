"""Partition: the plan → one device's program, binding each primitive on local blocks.

Planned reshards run as the same atoms the eager reshard uses (reshard/steps.py), once per
(value, layout). Primitives are bound with params rewritten to local shapes (or through the
rule's own `lower` hook), after their operands are cast to a common set of varying mesh axes —
the bookkeeping jnp does implicitly and check_vma verifies.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..cost_model import default_cost_model
from ..errors import PlacementTypeError
from ..hashing import Hashed
from ..layout import Layout
from ..reshard.api import plan_layouts
from ..reshard.steps import DIFFERENTIABLE, ensure_varying, varying_axes
from .control_flow import lower_higher_order
from .dtypes import cost_dtype
from .custom_rules import run_region
from .gc_pause import gc_paused
from . import combine, late_fill, outline
from .plan import Plan, buffer_path
from .propagate import type_key
from .replay import Replayer, literal
from .trace import hint_p
from .user_collectives import SHARD_MAP, lower_shard_map

STRAIGHT = True  # off: every equation is replayed apart (the tests compare both programs)

# first item of the `moved` keys that hold a move's intermediate results (`run_steps`); the
# other keys are (value, layout): the copies a block is handed and hands back
_STEPS = object()
_STOPPED = object()  # `copy_key`: a buffer reached through a stop_gradient under a broadcast


@dataclass
class LowerContext:
    """What a rule's `lower` hook may ask about the equation it binds on one device."""

    sizes: dict
    in_layouts: list[Layout]
    out_layouts: list[Layout]
    local_out_shapes: list[tuple[int, ...]]

    def block_index(self, axes: tuple[str, ...]):
        """This device's block number along a dim split over `axes` (major first)."""
        index = None  # lax, not jnp operators: see rules/indexing.py
        for a in axes:
            i = lax.axis_index(a)
            index = i if index is None else lax.add(lax.mul(index, np.int32(self.sizes[a])), i)
        return np.int32(0) if index is None else index

    def global_shape(self, layout: Layout, local_shape) -> tuple[int, ...]:
        """The global shape of a local block laid out as `layout`."""
        return tuple(size * math.prod(self.sizes[a] for a in axes)
                     for size, axes in zip(local_shape, layout.dims))

    def ppermute(self, x, axes: tuple[str, ...], pairs):
        """lax.ppermute over `axes` with (source, target) block numbers along them, major
        first as a layout lists a dim's axes — renumbered over the axes in the mesh's order,
        the order jax (from 0.12) requires of ppermute's axis names."""
        order = tuple(a for a in self.sizes if a in axes)
        if order != tuple(axes):
            def renumber(block: int) -> int:
                coords = {}
                for a in reversed(axes):
                    block, coords[a] = divmod(block, self.sizes[a])
                index = 0
                for a in order:
                    index = index * self.sizes[a] + coords[a]
                return index
            pairs = [(renumber(s), renumber(t)) for s, t in pairs]
        return lax.ppermute(x, order[0] if len(order) == 1 else order, list(pairs))


def match_vma(values: list[Any]) -> list[Any]:
    """`values` cast to vary over the union of their varying axes (what check_vma expects)."""
    if len(values) < 2:
        return list(values)  # one value always agrees with itself
    vmas = [varying_axes(x) for x in values]
    axes = frozenset().union(*vmas)
    return [x if v == axes else lax.pcast(x, tuple(sorted(axes - v)), to="varying")
            for x, v in zip(values, vmas)]


def _localize(params: dict, local_out_shapes: list[tuple[int, ...]]) -> dict:
    p = dict(params)
    if len(local_out_shapes) == 1:
        # the result's trailing dims: all of them (broadcast, iota, reshape, random_bits), or
        # the new ones of random_split, whose result is the keys' shape + `shape`
        local = tuple(local_out_shapes[0])
        for key in ("shape", "new_sizes"):
            if p.get(key) is not None:
                p[key] = local[len(local) - len(p[key]):]
    for key in ("sharding", "out_sharding"):
        if key in p:
            p[key] = None
    return p


def _bind(e, ep, ins: list, registry, sizes, ambient: frozenset = frozenset()) -> list:
    """One equation on local values, with its operands already in the required layouts.
    `ambient`: mesh axes along which the devices run other iterations of an enclosing loop
    (control_flow.py's split scans): every value varies over them."""
    if e.primitive is hint_p:
        return ins
    if e.name == SHARD_MAP:
        return lower_shard_map(e, ins)
    if ep.sub_plans:
        return lower_higher_order(e, ep, ins, registry, sizes, ambient)
    local_shapes = [L.local_shape(v.shape, sizes) for v, L in zip(e.outputs, ep.results)]
    rule = None if ep.fallback else registry.lookup(e.primitive)
    if rule is None or rule.match_vma:
        ins = match_vma(ins)
    if rule is not None and rule.lower is not None:
        ctx = LowerContext(sizes, ep.required, ep.results, local_shapes)
        outs = _lowered(e, rule.lower(ctx, *ins, **e.params), local_shapes)
    else:
        outs = e.primitive.bind(*ins, **_localize(e.params, local_shapes))
        outs = outs if e.primitive.multiple_results else [outs]
    # A result laid out over a mesh axis varies over it, though its blocks may be equal: a
    # broadcast's new dim split over an axis the operand is whole on (jnp.repeat's copies) is
    # one copy per device, the same values. Typed invariant, jax refuses the psum that later
    # sums it over that axis, and would transpose the broadcast without summing its copies'
    # cotangents across the devices (the cast's transpose is that sum).
    return [ensure_varying(x, L.used_axes) for x, L in zip(outs, ep.results)]


def _lowered(e, outs, local_shapes: list) -> list:
    """A rule's `lower` hook's results, checked: one local block per result of the
    primitive, each of the local shape and the dtype jax's own rule gives (a user's hook that
    returns something else would otherwise fail deep inside jax, or compute a wrong program).
    One bare array for a primitive of one result is taken as that result."""
    if not isinstance(outs, (list, tuple)):
        outs = [outs] if len(e.outputs) == 1 and hasattr(outs, "shape") else outs
    where = f" (at {e.source or '?'})"
    if not isinstance(outs, (list, tuple)) or len(outs) != len(e.outputs):
        got = (f"{len(outs)} result(s)" if isinstance(outs, (list, tuple))
               else f"{type(outs).__name__}")
        raise PlacementTypeError(
            f"the `lower` hook of the rule registered for {e.name!r}{where} returned {got}; "
            f"{e.name} has {len(e.outputs)} result(s): return a list of {len(e.outputs)} local "
            f"block(s), one per result")
    for k, (x, v, shape) in enumerate(zip(outs, e.outputs, local_shapes)):
        if tuple(getattr(x, "shape", ())) != tuple(shape) or getattr(x, "dtype", None) != v.dtype:
            raise PlacementTypeError(
                f"the `lower` hook of the rule registered for {e.name!r}{where} returned result "
                f"{k} as {getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}; "
                f"this device's block of it is {v.dtype}{list(shape)} (the global "
                f"{v.dtype}{list(v.shape)} laid out as the rule's sharding says): compute the "
                f"local block of each result")
    return list(outs)


@dataclass
class _Straight:
    """Equations start..stop-1, emitted with nothing between them: the values they read from
    before (`ext`) and make (`made`), in order of first use, and their replay key."""

    start: int
    stop: int
    ext: list
    made: list
    key: Hashed


@dataclass
class _BlockCall:
    jitted: Any
    copies: list = field(default_factory=list)  # (kind, where, layout) of each copy handed back


def _replay_key(e, ep) -> tuple | None:
    """What `_bind` depends on besides its operands' types (None: always bind afresh)."""
    if e.params_key is None or ep.sub_plans or e.primitive is hint_p or e.name == SHARD_MAP:
        return None
    return Hashed((type_key(e), tuple(ep.required), tuple(ep.results), ep.fallback))


def _device_const(c, scalars: dict):
    """Program constant `c` as a jax array; equal scalars (one per literal in the user's
    program) are put on the device once. A scalar enters the traced program as a literal of
    its value, whichever array object holds it, so sharing one changes nothing there."""
    if 0 in c.aval.shape and not jax.dtypes.issubdtype(c.dtype, jax.dtypes.extended):
        # made in the program: an empty array captured as a constant would be an operand of
        # the shard_map, which XLA refuses when all its operands are empty
        return jnp.zeros(c.aval.shape, c.dtype)
    key = outline.const_key(c)
    if key is not c:  # a scalar: one device array per value
        if key not in scalars:
            value = np.asarray(c.const)
            x = literal(value) if value.dtype == c.dtype else None
            scalars[key] = jnp.asarray(value, dtype=c.dtype) if x is None else x
        return scalars[key]
    return c.const if isinstance(c.const, jax.Array) else jnp.asarray(np.asarray(c.const),
                                                                      dtype=c.dtype)


class _Scope(dict):
    """The local values of one trace, by program Value. A constant is put on the device when
    first read: most of a deep model's literals are read only inside outlined blocks, which
    make their own, so making all of them up front was wasted work."""

    __slots__ = ("_scalars",)

    def __init__(self) -> None:
        super().__init__()
        self._scalars: dict = {}  # equal scalars: one device array per scope

    def __missing__(self, v):
        if not v.is_const:
            raise KeyError(v)
        x = self[v] = _device_const(v, self._scalars)
        return x


def local_function(plan: Plan, registry, *, physical: bool = True,
                   ambient: frozenset = frozenset(), pack: bool = True,
                   differentiable: bool | None = None):
    """A function of the local input blocks that computes the local output blocks.

    `physical`: inputs and outputs carry the leading slot axis of Partial values (the form
    shard_map hands over); sub-programs (loop bodies) take and give plain local blocks.
    `ambient`: see `_bind`. `pack`: gathers may share one buffer (combine.py).
    `differentiable`: False for a program jax will only run, never differentiate (see
    `steps.DIFFERENTIABLE`); None: as the program whose trace calls it (a sub-program).
    """
    program = plan.program
    sizes = plan.mesh.axis_sizes

    regions = {r.start: r for r in program.regions if r.stop > r.start}
    keys: dict = {}  # equation index -> its replay key, made when first asked (the plan is fixed)

    def key_of(k: int):
        key = keys.get(k, keys)
        if key is keys:
            key = keys[k] = _replay_key(program.eqns[k], plan.eqns[k])
        return key

    roots: dict = {}  # value -> `live_root`
    copy_keys: dict = {}  # value -> `copy_key`

    def live_root(v):
        """The value `v` is a stop_gradient of, in its layout, through stop_gradients alone
        (`v` itself if none): its moves are that value's moves, the gradient stopped after."""
        found = roots.get(v)
        if found is None:
            found = v
            while found.producer >= 0:
                e = program.eqns[found.producer]
                if (e.primitive is not lax.stop_gradient_p
                        or plan.layouts.get(e.inputs[0]) is not plan.layouts.get(found)):
                    break
                found = e.inputs[0]
            roots[v] = found
        return found

    def copy_key(v):
        """What `v`'s moved copies are kept under: the buffer the plan lists its moves by
        (`buffer_path`; a hint's result as its operand, as the plan's `record` does), so that
        values that are one buffer share one copy, as XLA's CSE shares their collectives — and
        the plan lists them once. A copy made through a stop_gradient has the derivative
        stopped, so a buffer reached so is another key: an outer jax.grad must not flow back
        through it into the live value (a stop_gradient directly above a value is moved as
        that value instead, `get`)."""
        found = copy_keys.get(v)
        if found is None:
            u = v
            if u.producer >= 0 and program.eqns[u.producer].primitive is hint_p:
                u = program.eqns[u.producer].inputs[0]
            buffer, stopped = buffer_path(u, program, plan.layouts, plan.eqns)
            found = copy_keys[v] = (_STOPPED, buffer) if stopped else buffer
        return found

    def get(env: dict, moved: dict, v, rp):
        if rp is None:
            return env[v]
        key = (v, rp.dst)
        if 0 in v.aval.shape and not jax.dtypes.issubdtype(v.dtype, jax.dtypes.extended):
            # an empty array holds nothing to move (the plan lists no collective, and XLA's
            # verifier refuses an all-gather of a zero-sized dim): its block in the target
            # layout, made in place
            if key not in moved:
                moved[key] = jnp.zeros(rp.dst.local_shape(v.shape, sizes), v.dtype)
            return moved[key]
        own = plan.layouts[v]
        root = live_root(v)
        if root is not v and rp.src == own and key not in moved and (root in env or root.is_const):
            # moved as the value it stops the gradient of (one collective, as planned), the
            # gradient stopped on the copy
            moved[key] = lax.stop_gradient(get(env, moved, root, rp))
        start = outline.reshard_start(v, rp, moved, own)
        if start == outline.HAVE_TARGET:
            return moved[key]
        if start == outline.FROM_COPY:
            x = moved[(v, rp.src)]
        else:
            x = env[v]
            if rp.src != own:  # its starting copy lives in another scope (a custom rule's
                # body): plan afresh from the value's own layout
                rp = plan_layouts(tuple(v.shape), cost_dtype(v.dtype), plan.mesh, own,
                                  plan.mesh, rp.dst, plan.cost_model or default_cost_model())
        x = moved[key] = run_steps(moved, v, rp.src, rp.steps, x)
        return x

    def run_steps(moved: dict, v, src, steps, x):
        """`steps` of a move of `v` from its copy `x` at layout `src`. Two moves from one copy
        that start with the same steps share them (the plan lists them once, plan._once): each
        step's result is kept in `moved` under the steps that led to it."""
        prefix: tuple = (_STEPS, copy_key(v), src)
        for planned in steps:
            prefix += (planned.step,)
            y = moved.get(prefix)
            if y is None:
                step = planned.step
                # a step's local code reads nothing but its operand and the mesh's axis sizes
                # (the replayer's context): every layer's equal step is emitted, not bound
                y = moved[prefix] = replayers[-1].run(
                    step, [x], lambda: [step.run(x, sizes)], shared=True)[0]
            x = y
        return x

    blocks: list = []  # [{start: outline.Instance}], found on the first trace

    def run_eqns(env: dict, moved: dict, start: int, stop: int, *, inside: bool = False,
                 calls: dict | None = None, single: bool = False) -> None:
        # equal equations (every layer of a model) are lowered once, then replayed — also
        # into the traces of outlined blocks and custom rules' bodies made during this call of
        # `run`; one replayer per call, so that nothing of a finished trace is kept alive
        replayer = replayers[-1] if replayers else Replayer()
        instances = {}
        if calls is not None:  # the top level of a trace: repeated blocks become calls
            if not blocks:
                # a sub-program's (a loop body's, a checkpoint's) only as whole runs: its
                # other repeats are a layer's short stretches (its two layernorms), whose
                # calls cost about what they save in a body traced once
                blocks.append(outline.find_instances(program, plan, key_of, apart=physical))
            instances = blocks[0]
        k = start
        while k < stop:
            inst = instances.get(k)
            if inst is not None and inst.stop <= stop:
                call_block(env, moved, inst, calls, replayer)
                k = inst.stop
                continue
            region = None if (inside and k == start) else regions.get(k)
            if region is not None:
                outs = run_region(region, plan, registry, [env[v] for v in region.inputs],
                                  functools.partial(run_region_body, env, region, replayer))
                env.update(zip(region.outputs, outs))
                k = region.stop
                continue
            e, ep = program.eqns[k], plan.eqns[k]
            if not (ep.reshards or single) and STRAIGHT:
                run = straight_run(k, stop, instances)
                if run is not None:
                    run_straight(env, moved, run, replayer)
                    k = run.stop
                    continue
            if ep.reshards and packing:
                pack_gathers(env, moved, k, stop, instances, replayer)
            plans = dict(ep.reshards)
            ins = [get(env, moved, v, plans.get(i)) for i, v in enumerate(e.inputs)]
            if ep.reshards and late_fill.wanted(program, e, ep):
                ins[0] = late_fill.zeros_after(ins[0], ins[2])
            outs = replayer.run(key_of(k), ins,
                                functools.partial(_bind, e, ep, ins, registry, sizes, ambient),
                                shared=True)
            env.update(zip(e.outputs, outs))
            k += 1

    runs: dict = {}  # (start, stop of the scope, top level?) -> _Straight or None

    def straight_run(k: int, stop: int, instances: dict):
        """The run of equations from k that partition emits one by one with nothing between
        them — no reshard, no region, no outlined block, each with a replay key — as one
        replay key (None: shorter than two)."""
        memo = (k, stop, bool(instances))
        found = runs.get(memo, runs)
        if found is not runs:
            return found
        keys = [key_of(k)]
        j = k + 1
        while j < stop and j not in instances and j not in regions and not plan.eqns[j].reshards:
            key = key_of(j)
            if key is None:
                break
            keys.append(key)
            j += 1
        found = None
        if keys[0] is not None and len(keys) > 1:
            wiring, values = program.block_values(k, j)
            ext = [v for v in values if v.producer < k]
            made = [v for v in values if v.producer >= k]
            found = _Straight(k, j, ext, made, Hashed(("run", tuple(keys), wiring)))
        runs[memo] = found
        return found

    def run_straight(env: dict, moved: dict, run, replayer: Replayer) -> None:
        """A straight run of equations, replayed as one: what jax emitted for it in an earlier
        trace (this program's or another's with the same run by value) is emitted again, with
        none of the per-equation bookkeeping (the layers' code between outlined blocks)."""
        def bind() -> list:
            run_eqns(env, moved, run.start, run.stop, inside=True, single=True)
            return [env[v] for v in run.made]

        outs = replayer.run(run.key, [env[v] for v in run.ext], bind, shared=True)
        env.update(zip(run.made, outs))

    packing = pack and combine.wanted(plan.mesh)
    last_use: dict = {}  # (value, layout) -> the last equation reading that copy (made lazily)

    def used_until(v, layout) -> int:
        if not last_use:
            for j, ep in enumerate(plan.eqns):
                for i, rp in ep.reshards:
                    last_use[(program.eqns[j].inputs[i], rp.dst)] = j
            for i, rp in plan.output_reshards:
                last_use[(program.outputs[i], rp.dst)] = len(plan.eqns)
        return last_use[(v, layout)]

    def pending_gathers(env: dict, moved: dict, k: int, stop: int, instances: dict, *,
                        first_only: bool = False):
        """(value, plan, local block, step) of the all-gathers worth packing that equations
        k, k+1, ... of this scope need and that can run now (see combine.py). A copy read
        again further on (a weight's gathered copy reused by the backward pass) is left to
        itself: XLA would keep the whole packed buffer alive for it."""
        end = min(stop, k + combine.WINDOW)
        seen: set = set()
        for j in range(k, k + 1 if first_only else end):
            if j > k and (j in instances or j in regions):
                return  # the copies made in there belong to that scope
            for i, rp in plan.eqns[j].reshards:
                v = program.eqns[j].inputs[i]
                step = combine.gather_step(v, rp, plan.layouts.get(v))
                if (step is None or (v, rp.dst) in moved or v not in env or 0 in v.aval.shape
                        or used_until(v, rp.dst) >= end):
                    continue
                root = live_root(v)  # a stop_gradient'ed value is moved as its operand (`get`)
                if root is not v:
                    if (root, rp.dst) in moved or root not in env:
                        continue
                    v = root
                first = (_STEPS, copy_key(v), rp.src, step)
                if first in moved or first in seen:
                    continue  # gathered already, for a move that starts alike
                seen.add(first)
                yield v, rp, env[v], step

    def pack_gathers(env: dict, moved: dict, k: int, stop: int, instances: dict,
                     replayer: Replayer) -> None:
        """Equation k's pending gathers, run packed with those of the next equations. Values
        that are one buffer (`copy_key`: broadcasts of one operand alike, which XLA's CSE
        makes one) are gathered once, as the plan lists them — `pending_gathers` yields each
        buffer once, and the others take its copy when they are moved (`run_steps`): packed
        side by side, XLA could not merge them."""
        first = next(pending_gathers(env, moved, k, stop, instances, first_only=True), None)
        if first is None:
            return
        key = combine.pack_key(first[2], first[3])
        if key is None:
            return
        members = combine.pick_members(pending_gathers(env, moved, k, stop, instances), key,
                                       sizes)
        if len(members) < 2:
            return
        for (v, rp, _, step), x in zip(members, combine.run_packed(members, replayer.run)):
            moved[(_STEPS, copy_key(v), rp.src, step)] = x
            moved[(v, rp.dst)] = run_steps(moved, v, rp.src, rp.steps, x)

    def call_block(env: dict, moved: dict, inst, calls: dict, replayer: Replayer) -> None:
        """One repeated block as a call of its jitted lowering (traced on its first call).

        Later calls replay the call equation the first one emitted (jax's dispatch of a jitted
        call under tracing costs about as much as a few dozen equations) — in other programs
        too, where the block is the same by value (`block_identity`)."""
        state, copy_keys = outline.moved_inputs(inst, moved, plan.layouts)
        args = [env[v] for v in inst.external] + [moved[c] for c in copy_keys]
        n_ext = len(inst.external)

        def function():
            fn = calls.get((inst.signature, state))
            if fn is None:
                fn = calls[(inst.signature, state)] = block_function(inst, state)
            return fn

        def bind() -> list:
            outs, copies = function().jitted(args[:n_ext], args[n_ext:])
            return [*outs, *copies]

        # the call is traced on abstract types: a layer index passed in as a literal (its RNG
        # fold_in) does not make it another call
        identity = block_identity(inst, state)
        flat = replayer.run(("block", inst.signature if identity is None else identity, state),
                            args, bind, by_value=False, shared=identity is not None,
                            note=lambda: function().copies, name=f"block{inst.signature}")
        outs, copies = flat[:len(inst.escaping)], flat[len(inst.escaping):]
        eqns = program.eqns
        for (p, o), x in zip(inst.escaping, outs):
            env[eqns[inst.start + p].outputs[o]] = x
        for (kind, ref, layout), x in zip(replayer.note, copies):
            v = (eqns[inst.start + ref[0]].outputs[ref[1]] if kind == "made"
                 else inst.external[ref] if kind == "ext" else inst.consts[ref])
            moved[(v, layout)] = x

    identities: dict = {}  # (signature, reshard state) -> block_identity

    def block_identity(inst, state: tuple):
        """What a block's lowering from reshard `state` depends on, by value (None: kept to
        this program): its signature by value, the reshard steps the cost model chose, and the
        program's facts that shape its packed gathers (how far each copy it makes is read) and
        late zero fills — those of the first instance called from `state`, whose trace every
        later one calls here (the copies a block makes are read after it by some instances
        only: the facts of another instance could name another program's trace)."""
        found = identities.get((inst.signature, state), identities)
        if found is not identities:
            return found
        identity = None
        if inst.identity is not None:
            facts: list = []
            for k in range(inst.start, inst.stop):
                ep = plan.eqns[k]
                if not ep.reshards:
                    continue
                e = program.eqns[k]
                for i, rp in ep.reshards:
                    read = (min(used_until(e.inputs[i], rp.dst), inst.stop) - inst.start
                            if packing else 0)
                    facts.append((tuple(s.step for s in rp.steps), read))
                if late_fill.wanted(program, e, ep):
                    facts.append(k - inst.start)
            identity = (inst.identity, tuple(facts), plan.cost_model, packing)
        identities[(inst.signature, state)] = identity
        return identity

    def block_function(t, state: tuple):
        """The jitted lowering of block `t` (the first of its kind) from reshard state `state`;
        `.copies` says which reshard copies it hands back (known once it has been traced)."""
        made = {v: (p, o) for p in range(t.stop - t.start)
                for o, v in enumerate(program.eqns[t.start + p].outputs)}
        ext = {v: i for i, v in enumerate(t.external)}
        const = {v: i for i, v in enumerate(t.consts)}
        pre = outline.passed_copies(t, state)
        given = set(pre)

        def block(raw: list, copies: list):
            env = _Scope()  # its constants made inside the block's trace: literals, as outside
            env.update(zip(t.external, raw))
            moved = dict(zip(pre, copies))
            run_eqns(env, moved, t.start, t.stop)
            new = [key for key in moved if key not in given and key[0] is not _STEPS]
            call.copies = [("made", made[v], L) if v in made else ("ext", ext[v], L)
                           if v in ext else ("const", const[v], L) for v, L in new]
            eqns = program.eqns
            return ([env[eqns[t.start + p].outputs[o]] for p, o in t.escaping],
                    [moved[key] for key in new])

        block.__name__ = block.__qualname__ = f"block{t.signature}"
        call = _BlockCall(jax.jit(block))
        return call

    def run_region_body(outer: dict, region, replayer: Replayer, *xs) -> list:
        # A region reads only its inputs and constants (trace.py keeps CSE inside it), so it
        # runs in a scope of its own: under jax.custom_jvp / custom_vjp it may be traced apart
        # — also after `run` has returned (jax.grad taken outside dist.jit traces a custom_vjp's
        # forward while differentiating the program), so under the replayer of the call that
        # made it, this program's (its lowerings' context), not whichever call is under way
        env = _Scope()
        env.update(zip(region.inputs, xs))
        replayers.append(replayer)
        try:
            run_eqns(env, {}, region.start, region.stop, inside=True)
        finally:
            replayers.pop()
        return [env[v] for v in region.outputs]

    replayers: list[Replayer] = []  # the replayer of the call of `run` under way

    @gc_paused
    def run(*local_inputs):
        env = _Scope()
        for v, L, x in zip(program.inputs, plan.inputs, local_inputs):
            env[v] = x[0] if (L.partial and physical) else x
        moved: dict = {}
        flag = DIFFERENTIABLE.get() if differentiable is None else differentiable
        token = DIFFERENTIABLE.set(flag)
        # what a lowering reads besides its equation's key and operands (`_bind`)
        replayers.append(Replayer((registry, registry.generation, tuple(sizes.items()),
                                   ambient, flag)))
        try:
            run_eqns(env, moved, 0, len(program.eqns), calls={} if outline.ENABLED else None)
            reshards = dict(plan.output_reshards)
            results = []
            for k, (v, L) in enumerate(zip(program.outputs, plan.outputs)):
                x = get(env, moved, v, reshards.get(k))
                results.append(x[None] if (L.partial and physical) else x)
        finally:
            replayers.pop()
            DIFFERENTIABLE.reset(token)
        return results

    return run


__all__ = ["local_function", "LowerContext"]
