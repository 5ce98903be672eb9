"""dist.jit: trace → propagate → plan → partition → lower, cached per input layouts and avals."""
from __future__ import annotations

import copy
import functools
import inspect
import re
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax._src import core as jcore
from jax._src.interpreters import ad

from ..cost_model import CostModel, check_cost_model, default_cost_model
from .. import in_flight
from ..hashing import hash_once
from ..dtensor import DistTensor, partial_gradient_error, with_own_buffers
from ..errors import (MeshMismatchError, OperandTypeError, PlacementTypeError,
                      SignatureError, did_you_mean, user_line_of)
from ..layout import Layout, layout_from_placements
from ..mesh import ProcessMesh, as_process_mesh
from ..physical import (HOST_MEMORY_KINDS, device_put, host_memory, layout_of_spec,
                        mesh_sharding, physical_shape, physical_sharding, physical_spec)
from ..reshard.planner import uneven_steps
from ..uneven import even_part, is_uneven, warn_uneven
from .dtypes import cost_dtype, is_extended, normalize
from .closure import hoist_sharded_consts
from .cut import arrive, cut_by_mesh, eval_eqns, meshes_named
from .explain import Explanation, StagedExplanation
from .gc_pause import gc_paused
from . import out_spec
from .partition import local_function
from .plan import KEEP, Plan, PlannedCollective, make_plan
from .propagate import jax_config_key
from .refine import refined_plan
from . import constraints, graph_nodes, jax_shardings
from .trace import build_program, hint_p


def _registry():
    from .. import rules

    return rules.REGISTRY


class _Tracing(threading.local):
    depth = 0  # dist.jit functions being traced on this thread


_TRACING = _Tracing()


@dataclass(frozen=True)
class _Leaf:
    shape: tuple[int, ...]
    dtype: Any
    mesh: ProcessMesh | None
    layout: Layout | None    # None: unplaced, the plan decides
    memory: str | None = None  # a host memory kind the value is stored in (None: the device's)
    weak: bool = False  # a Python number: weakly typed, as jax.jit traces it (x_bf16 * 0.1 stays bf16)

    def __hash__(self) -> int:  # every call hashes the key of all its inputs' descriptions
        return hash_once(self, lambda: (self.shape, self.dtype, self.mesh, self.layout,
                                        self.memory, self.weak))


def _stored_memory(physical) -> str | None:
    """The host memory kind a tensor's array lives in. A tracer (dist.jit called under
    jax.grad or vmap) has no sharding to read but carries the memory space in its type: an
    offloaded input traced so must still be copied in where the program reads it."""
    if not isinstance(physical, jax.core.Tracer):
        return host_memory(physical.sharding)
    space = getattr(physical.aval, "memory_space", None)
    return "pinned_host" if space is not None and space.name == "Host" else None


def _describe_leaf(x, one_device: bool = False) -> _Leaf:
    """`one_device`: a jax.Array on a mesh of one device is placed on it too (a constant
    hoisted from a DistTensor there, closure.py), not taken as unplaced."""
    if isinstance(x, DistTensor):
        if x._desc is None:
            x._desc = _Leaf(x.shape, normalize(x.dtype), x.mesh, x.layout,
                            _stored_memory(x.physical))
        return x._desc
    sharding = mesh_sharding(x, one_device)
    if sharding is not None:
        return _Leaf(tuple(x.shape), normalize(x.dtype), as_process_mesh(sharding.mesh),
                     layout_of_spec(sharding.spec, x.ndim), host_memory(sharding))
    arr = x if isinstance(x, (jax.Array, np.ndarray)) else np.asarray(x)
    if not is_extended(arr.dtype) and arr.dtype.kind not in "biufcV":
        raise _NotAnArray(x)  # a string, an object: named with its argument by _entry
    dtype = arr.dtype if is_extended(arr.dtype) else jax.dtypes.canonicalize_dtype(arr.dtype)
    weak = type(x) in (int, float, complex) or bool(getattr(x, "weak_type", False))
    return _Leaf(tuple(np.shape(arr)), normalize(dtype), None, None, weak=weak)


class _NotAnArray(Exception):
    def __init__(self, value: Any) -> None:
        self.value = value


def _not_an_array_error(name: str, path, value: Any, n_args: int, static: Sequence[int],
                        lifted: bool = False):
    """The PlacementTypeError for a traced argument jax cannot take (a string, an object).
    `lifted`: the call of a function whose nnx modules were lifted out of its arguments
    (graph_nodes.py), whose positions are not the user's."""
    head, first, *rest = path
    where = jax.tree_util.keystr(tuple(rest))  # inside the argument: ['name'], [0], .field
    if lifted:
        arg, fix = "an argument", "static_argnums (its position)"
        where = ""
    elif getattr(head, "idx", None) == 0:   # (dynamic args, kwargs): a positional argument
        pos = [i for i in range(n_args) if i not in static][first.idx]
        arg, fix = f"argument {pos}", f"static_argnums=({pos},)"
    else:
        key = first.key
        arg, fix = f"keyword argument {key!r}", f"static_argnames=({key!r},)"
    from ..training.optimizer import ShardedOptimizer  # (training builds on the compiler)

    if isinstance(value, ShardedOptimizer):  # (made static, it would never update)
        return PlacementTypeError(
            f"{name}: {arg}{where} is a {type(value).__name__} (dist.shard_optimizer's or "
            f"parallelize's optimizer), not an array: train with dist.to_static(model, loader, "
            f"loss_fn, optimizer), or pass its state (opt_state = optimizer.init(params)) and "
            f"call optimizer.update(grads, opt_state, params) inside the step")
    return PlacementTypeError(
        f"{name}: {arg}{where} is {value!r:.60} of type {type(value).__name__}, not an array — "
        f"jax traces only arrays and numbers; mark it static with dist.jit(f, {fix}) (one "
        f"program per value), or close over it")


@dataclass
class _Compiled:
    plan: Plan
    fn: Callable
    out_tree: Any
    leaves: tuple[_Leaf, ...]
    stored_outputs: list[Layout]  # the outputs' layouts as stored (plan.outputs, but uneven
    # placements the caller asked for: the program computes their even part, uneven.py)
    traced: bool = False  # jax has traced `fn` (its first call traces, lowers and compiles)
    out_descs: list | None = None  # the outputs' descriptions as inputs, made on the first call
    hoisted: tuple = ()  # sharded arrays the function closed over, its last inputs (closure.py)

    def call(self, *physical):
        if self.traced:
            outs = self.fn(*physical)
        else:
            self.traced = True
            # the first call builds the local program (one jax trace of every equation): a
            # pass like planning, run with cyclic collection paused for the same reason
            # (gc_pause.py)
            outs = gc_paused(self.fn)(*physical)
        in_flight.ran(outs)  # (XLA's CPU backend deadlocks on too many left running)
        return outs


def _jax_arguments(method):
    """Every public entry (call, plan, explain, lower) takes its arguments as jax.jit and
    nnx.jit do: placed as `in_shardings` says (jax_shardings.py), `static_argnames` bound (one
    function per their values), and nnx modules (graph nodes) among them lifted — the call
    runs as a pure function of their State, written back after (graph_nodes.py); nested in
    another dist.jit's trace the function just runs, on the outer trace's objects."""
    @functools.wraps(method)
    def taking(self, *args, **kwargs):
        if self._in_shardings is not None:
            args = self._placed_arguments(args)
        if self._out_shardings is not None and self._out_placements is None:
            self._out_placements = jax_shardings.as_out_placements(self._out_shardings)
            if self._out_memory_kinds is None:  # jax's offloading: memory_kind="pinned_host"
                self._out_memory_kinds = _check_memory_kinds(
                    jax_shardings.as_out_memory_kinds(self._out_shardings))
        named = {k: kwargs.pop(k) for k in self._static_names if k in kwargs}
        if named:  # static_argnames: one function per their values, as jax.jit compiles one
            return getattr(self._with_static_kwargs(named), method.__name__)(*args, **kwargs)
        if self._bound is not None:
            args = (self._bound,) + args
        lifted = None if _TRACING.depth or not self._lifts else graph_nodes.lift(self, args, kwargs)
        if lifted is None:
            return method(self, *args, **kwargs)
        if method.__name__ == "__call__":
            return graph_nodes.write_back(lifted, lifted.fn(*lifted.args))
        return getattr(lifted.fn, method.__name__)(*lifted.args)

    return taking


def _callable_name(fn: Any) -> str:
    """How messages name a callable that has no __name__: partial(f), or its class."""
    if isinstance(fn, functools.partial):
        return f"partial({_callable_name(fn.func)})"
    return getattr(fn, "__name__", None) or type(fn).__name__


class DistributedFunction:
    """A function partitioned across a mesh by autoshard; see `autoshard.jit`."""

    def __init__(self, fn: Callable, *, static_argnums: Sequence[int] = (),
                 donate_argnums: Sequence[int] = (), out_placements: Any = None,
                 cost_model: CostModel | None = None, static_argnames: Sequence[str] = (),
                 in_shardings: Any = None, out_shardings: Any = None,
                 donate_argnames: Sequence[str] = (), out_memory_kinds: Any = None):
        if not callable(fn):
            raise SignatureError(f"dist.jit needs a function to partition, got "
                                 f"{type(fn).__name__} {fn!r:.60}: write dist.jit(step) or put "
                                 f"@dist.jit above def step(...)")
        functools.update_wrapper(self, fn)
        if not hasattr(self, "__name__"):  # a functools.partial, an object with __call__
            self.__name__ = _callable_name(fn)
        if out_shardings is not None and out_placements is not None:
            raise PlacementTypeError("dist.jit takes out_placements or jax.jit's out_shardings, "
                                     "not both")
        self._in_shardings, self._out_shardings = in_shardings, out_shardings
        self._fn = fn
        static_nums, static_names = _argnums_and_names(fn, static_argnums, static_argnames)
        donate_nums, donate_names = _argnums_and_names(fn, donate_argnums, donate_argnames)
        both = sorted(static_nums & donate_nums) or sorted(set(static_names) & set(donate_names))
        if both:  # a static argument is hashed into the program, not passed: nothing to donate
            raise SignatureError(
                f"dist.jit({getattr(fn, '__name__', type(fn).__name__)}): argument {both[0]!r} "
                f"is both static and donated; a static argument is no buffer to donate: name "
                f"it in one of them")
        self._static = tuple(sorted(static_nums))
        self._donate = tuple(sorted(donate_nums))
        self._donate_names = donate_names
        # dist.jit(model) for an nnx Module (or dist.jit(model.method)): the module is the
        # hidden first argument of every call (lifted like any module argument, so each call reads its current params rather
        # than the ones traced into constants); argnums count the model call's own arguments
        self._bound, method = graph_nodes.bound_module(fn)
        if self._bound is not None:
            self.__name__ = getattr(fn, "__name__", type(fn).__name__)
            self._fn = lambda module, *args, **kwargs: method(module, *args, **kwargs)
            self._static = tuple(i + 1 for i in self._static)
            self._donate = tuple(i + 1 for i in self._donate)
        self._out_placements = out_placements
        self._out_memory_kinds = _check_memory_kinds(out_memory_kinds)
        self._cost_model = check_cost_model(
            cost_model, f"dist.jit({getattr(fn, '__name__', type(fn).__name__)})")
        self._static_names = static_names
        self._by_static_kwargs: dict = {}
        self._cache: dict = {}
        # the default cost model the cached programs were planned with (without cost_model=):
        # set_default_cost_model makes them stale
        self._planned_with: CostModel | None = None
        self._unagreed: set = set()  # keys compiled by plan/explain/lower, not yet called
        self.trace_count = 0
        # eager operators (eager.py) hand DistTensors back even under an outer jax trace: the
        # user is writing DistTensor code there, op by op
        self._always_dist = False
        self._lifts = True  # nnx graph nodes among the arguments are lifted (graph_nodes.py)

    # -- argument handling ------------------------------------------------------------------
    def _placed_arguments(self, args: tuple) -> tuple:
        """The positional arguments but the static ones laid out as in_shardings says
        (jax_shardings.py); called before a bound module is put in front of them."""
        static = {i - (self._bound is not None) for i in self._static}
        dynamic = [a for i, a in enumerate(args) if i not in static]
        placed = iter(jax_shardings.place_arguments(self._in_shardings, tuple(dynamic)))
        return tuple(a if i in static else next(placed) for i, a in enumerate(args))

    def _with_static_kwargs(self, named: dict) -> "DistributedFunction":
        """This function with the keyword arguments named static bound (jax.jit's
        static_argnames): a program of its own for each of their values."""
        try:
            key = tuple(sorted(named.items()))
            sub = self._by_static_kwargs.get(key)
        except TypeError as exc:
            raise PlacementTypeError(
                f"dist.jit: static arguments must be hashable ({exc})") from None
        if sub is None:
            sub = copy.copy(self)
            for cached in ("_graph_inner", "_graph_keep"):  # graph_nodes.py's, per function
                sub.__dict__.pop(cached, None)
            sub._fn = functools.partial(self._fn, **named)
            sub._static_names, sub._by_static_kwargs, sub._cache = (), {}, {}
            sub._unagreed = set()
            sub._in_shardings = None  # placed by the function it came from
            sub.trace_count = 0
            self._by_static_kwargs[key] = sub
        return sub

    def _split(self, args, kwargs):
        static = tuple(args[i] for i in self._static if i < len(args))
        dynamic = tuple(a for i, a in enumerate(args) if i not in self._static)
        leaves, tree = jax.tree.flatten((dynamic, kwargs), is_leaf=lambda x: isinstance(x, DistTensor))
        for k, x in enumerate(leaves):
            # a concrete DistTensor matches its layout by construction (make_dtensor): only a
            # traced one is checked, off the eager path
            if isinstance(x, DistTensor) and isinstance(x.physical, jax.core.Tracer) and tuple(
                    np.shape(x.physical)) != physical_shape(x.layout, x.mesh, x.shape):
                # jax.vmap (or another transformation that maps over arrays) handed each call a
                # slice of the stored array: the layout no longer describes what arrived
                name = self._input_names(tree, static, len(leaves))[k]
                raise PlacementTypeError(
                    f"{self.__name__}: {name}, a DistTensor of shape {x.shape} with placements "
                    f"{x.placements}, arrived as an array of shape {tuple(np.shape(x.physical))} — "
                    f"jax.vmap over a DistTensor maps over its stored array and loses the layout "
                    f"of the mapped dim; put the vmap inside the partitioned function instead: "
                    f"dist.jit(jax.vmap(f))(x)")
            if isinstance(x, DistTensor) and not isinstance(x.physical, jax.core.Tracer) \
                    and x.physical.is_deleted():  # (jaxlib may crash the process on it)
                name = self._input_names(tree, static, len(leaves))[k]
                raise SignatureError(
                    f"{self.__name__}: {name}, a DistTensor of shape {x.shape} placed "
                    f"{x.placements}, was donated to an earlier call (donate_argnums) and its "
                    f"buffers are gone: pass that call's result, or stop donating it")
        if self._donate or self._donate_names:
            donated = self._flat_donations(tree)
            held = {id(getattr(leaves[i], "physical", leaves[i])) for i in donated}
            twice = [k for k, x in enumerate(leaves) if k not in donated
                     and id(getattr(x, "physical", x)) in held]
            if twice or len(held) < len(donated):
                names = self._input_names(tree, static, len(leaves))
                ident = lambda i: id(getattr(leaves[i], "physical", leaves[i]))  # noqa: E731
                first = next(i for i in donated if twice and ident(i) == ident(twice[0])
                             or not twice and [ident(j) for j in donated].count(ident(i)) > 1)
                other = twice[0] if twice else next(j for j in donated
                                                    if j != first and ident(j) == ident(first))
                raise SignatureError(
                    f"{self.__name__}: one array is passed as a donated argument and again as "
                    f"another ({names[first]} and {names[other]}): donating it frees the "
                    f"buffers the other still reads; pass a copy (x + 0) as one of them, or do "
                    f"not donate it")
        return static, leaves, tree

    def _rebuild_args(self, static, dynamic):
        args, it = [], iter(static)
        total = len(dynamic) + len(static)
        dyn = iter(dynamic)
        for i in range(total):
            args.append(next(it) if i in self._static else next(dyn))
        return args

    def _entry(self, args, kwargs, reduced: bool = False, split=None,
               run: bool = False) -> tuple[_Compiled, list]:
        static, leaves, tree = split or self._split(args, kwargs)
        try:
            described = tuple(_describe_leaf(x) for x in leaves)
        except _NotAnArray as bad:
            dynamic = tuple(a for i, a in enumerate(args) if i not in self._static)
            flat = jax.tree_util.tree_flatten_with_path(
                (dynamic, kwargs), is_leaf=lambda x: isinstance(x, DistTensor))[0]
            path = next(p for p, x in flat if x is bad.value)
            raise _not_an_array_error(self.__name__, path, bad.value, len(args),
                                      self._static, lifted=not self._lifts) from None
        try:
            # jax's configuration too: a rule's answer may depend on it (random draws split
            # only with jax_threefry_partitionable on), and jax traces again when it changes
            key = (tree, static, described, reduced, jax_config_key())
            hash(key)
        except TypeError as exc:
            raise PlacementTypeError(f"dist.jit: static arguments must be hashable ({exc})") from None
        if self._cost_model is None and self._planned_with is not default_cost_model():
            self._cache.clear()  # planned with another default cost model: plan again
            self._planned_with = default_cost_model()
        entry = self._cache.get(key)
        if entry is None:
            if jax.process_count() > 1:
                self._agree(key, run)
            entry = self._placed_as_planned(key) or self._compile(static, tree, described, reduced)
            self._cache[key] = entry
        elif self._unagreed and run and key in self._unagreed:
            self._agree(key, run)
        return entry, leaves

    def _agree(self, key, run: bool) -> None:
        """Several processes, a signature not yet called: before it is traced, every process
        checks that all call it alike (one small collective; agreement.py), so that processes
        passing different shapes get one clear error each rather than a trace error in one and
        a collective waiting forever in the others. plan / explain / lower may be asked in one
        process only: there the first call for the signature checks."""
        if not run:
            self._unagreed.add(key)
            return
        from ..agreement import check_call_signature

        self._unagreed.discard(key)
        tree, static, described, reduced, _ = key
        names = self._input_names(tree, static, len(described))
        check_call_signature(self.__name__, names, described, static,
                             self._static[:len(static)], reduced)

    def _placed_as_planned(self, key) -> _Compiled | None:
        """A program already built for inputs that then arrived unplaced (numpy, a fresh
        optimizer count, an nnx Rngs key), when each of them now arrives as a DistTensor laid
        out as that program placed it on entry: a train loop hands a step's outputs back to
        the next. Same program, same physical inputs — no second trace and compile."""
        tree, static, described, reduced, config = key
        for (t, s, seen, r, c), entry in self._cache.items():
            if (t, s, r, c) != (tree, static, reduced, config) or not isinstance(entry, _Compiled):
                continue
            if all(new == old or (old.mesh is None and new.mesh == entry.plan.user_mesh
                                  and new.layout == L and (new.shape, new.dtype) ==
                                  (old.shape, old.dtype))
                   for new, old, L in zip(described, seen, entry.plan.user_inputs)):
                return entry
        return None

    # -- the pipeline -----------------------------------------------------------------------
    def _trace(self, static, tree, described):
        out_tree_box = []

        def flat(*flat_args):
            dynamic, kwargs = jax.tree.unflatten(tree, flat_args)
            out = self._fn(*self._rebuild_args(static, dynamic), **kwargs)
            paths, out_tree = jax.tree_util.tree_flatten_with_path(out)
            for path, x in paths:
                if not _is_array_like(x):
                    raise SignatureError(
                        f"{self.__name__} returned {type(x).__name__} {x!r:.40} at "
                        f"{_output_name(path)}: a "
                        f"partitioned function returns arrays (and pytrees of them); return "
                        f"the array, or compute a non-array result outside dist.jit")
            out_tree_box.append(out_tree)
            return [x for _, x in paths]

        self.trace_count += 1
        avals = [jax.ShapeDtypeStruct(d.shape, d.dtype, weak_type=d.weak) for d in described]
        _TRACING.depth += 1
        try:
            closed = jax.make_jaxpr(flat)(*avals)
        except jax.errors.JAXTypeError as e:  # a Python `if` on a traced value, and its kin
            self._name_the_user_function(e, tree, static)
            raise
        except ValueError as e:
            if "__jax_array__" not in str(e):
                raise
            # jax takes a DistTensor (an object with __jax_array__) where jnp converts its
            # operands, but not as an index or a jax.lax operand: one the function reads
            # without taking it as an argument (closed over, a global) ends there
            raise OperandTypeError(
                f"{self.__name__} uses, at {user_line_of(e) or '?'}, a DistTensor it does not "
                f"take as an argument (closed over, or a global) where jax takes only its own "
                f"arrays — an index (`w[ids]`) or a jax.lax operand: pass it to "
                f"{self.__name__} as an argument (it is then placed and planned like the "
                f"others), or write jnp.asarray(t) there (as jnp's functions read it: its "
                f"global array, an input of the program laid out as stored)") from e
        finally:
            _TRACING.depth -= 1
        return closed, out_tree_box[0]

    def _name_the_user_function(self, error: Exception, tree, static) -> None:
        """jax's tracing error, naming the user's function and argument where it named our
        flat wrapper (`flat at jit.py:N`, `flat_args[1]`), with dist.jit's static_argnames."""
        if not error.args or not isinstance(error.args[0], str):
            return
        text = error.args[0]
        fn = inspect.unwrap(self._fn)
        code = getattr(fn, "__code__", None)
        where = f"{self.__name__} at {code.co_filename}:{code.co_firstlineno}" if code \
            else self.__name__
        text = re.sub(r"the function flat at \S+:\d+", f"the function {where}", text)
        try:
            names = self._leaf_names(tree, static)
            params = list(inspect.signature(self._fn).parameters)
        except (TypeError, ValueError):
            names, params = [], []

        def leaf(m: re.Match) -> str:
            k = int(m.group(1))
            if k >= len(names):
                return m.group(0)
            name = names[k]
            head = re.match(r"argument (\d+)(.*)", name)
            if head and int(head.group(1)) < len(params):
                return params[int(head.group(1))] + head.group(2)
            return name.removeprefix("argument ")

        text, n = re.subn(r"flat_args\[(\d+)\]", leaf, text)
        if n:
            text += (f"\n(dist.jit traces {self.__name__} on abstract values, as jax.jit does: "
                     f"a Python value that decides control flow is passed as static, "
                     f"dist.jit({self.__name__}, static_argnames=[...]), or the branch "
                     f"written with jnp.where / jax.lax.cond)")
        error.args = (text, *error.args[1:])

    def _mesh(self, program, described, closed=None) -> ProcessMesh:
        seen: list[tuple[ProcessMesh, str]] = []
        for i, d in enumerate(described):
            if d.mesh is not None:
                seen.append((d.mesh, f"input {i}"))
        for e in program.eqns:
            if e.primitive is hint_p:
                seen.append((e.params["mesh"], f"the annotation at {e.source or '?'}"))
        seen.extend(constraints.meshes(program))
        if not seen:
            # a user's shard_map (local_map's) runs on its mesh: with its annotated inputs dead
            # (a gradient that never reads the forward), it is what names the devices (with
            # another mesh named, user_collectives.check_mesh says how the two differ)
            seen.extend((as_process_mesh(e.params["mesh"]), f"the shard_map at {e.source or '?'}")
                        for e in program.eqns if e.primitive.name == "shard_map"
                        and isinstance(e.params.get("mesh"), jax.sharding.Mesh))
        if not seen and closed is not None:
            # an annotation inside a loop, cond or checkpoint body (a local_map there) names it
            seen.extend((m, "an annotation inside a control-flow body")
                        for m in meshes_named(closed, []))
        if not seen and self._out_shardings is not None:  # jax.jit's: results placed there
            seen.extend((m, "out_shardings")
                        for m in jax_shardings.out_meshes(self._out_shardings))
        if not seen:
            raise MeshMismatchError(
                "dist.jit found no mesh: no argument is a DistTensor or a sharded jax.Array and "
                "the function annotates nothing — place an input with dist.shard_tensor(x, mesh, "
                "placements) or annotate a value inside with dist.shard_tensor")
        mesh, what = seen[0]
        for other, where in seen[1:]:
            if other != mesh:
                raise MeshMismatchError(
                    f"{where} is on {other!r} but {what} is on {mesh!r}: one dist.jit program runs "
                    f"on one mesh — reshard the input onto the same mesh before the call "
                    f"(dist.reshard(x, mesh, placements)); moving between meshes inside a "
                    f"function is pipeline parallelism, which needs its own stage programs",
                    where=where.split(" at ")[-1] if " at " in where else None)
        return mesh

    def _out_targets(self, program, mesh, out_tree=None) -> list[Layout | None]:
        """One target per flat output (`out_spec.per_output`; `out_tree` lets out_placements
        be a pytree prefix of the result)."""
        n = len(program.outputs)
        per_output = out_spec.per_output(self._out_placements, out_tree, n)
        return [p if p is None or (isinstance(p, str) and p == KEEP) else
                layout_from_placements(p, mesh, v.shape, what=f"output {k}")
                for k, (v, p) in enumerate(zip(program.outputs, per_output))]

    def _compile(self, static, tree, described, reduced: bool = False) -> _Compiled:
        """`reduced`: no output stays Partial (for an outer jax transformation)."""
        closed, out_tree = self._trace(static, tree, described)  # the user's code: gc as set
        if len(meshes_named(closed, [d.mesh for d in described])) > 1:
            cut = cut_by_mesh(closed, [d.mesh for d in described])
            donated = {cut.invars[i] for i in self._flat_donations(tree)}
            return _MeshStages(cut, out_tree, self.__name__, self._cost_model,
                               self._out_placements, donated)
        return self._passes(static, tree, closed, out_tree, described, reduced)

    @gc_paused
    def _passes(self, static, tree, closed, out_tree, described, reduced: bool) -> _Compiled:
        """Build, plan and partition under one collection pause: each pass pauses its own,
        but a collection between them still walked the whole heap for nothing."""
        closed, hoisted = hoist_sharded_consts(
            closed, {d.mesh for d in described if d.mesh is not None})
        described = tuple(described) + tuple(_describe_leaf(c, one_device=True)
                                              for c in hoisted)
        program = build_program(closed, inline_solves=not reduced, stop_gradients=reduced)
        mesh = self._mesh(program, described, closed)
        for d in described:
            if d.mesh is not None and d.mesh != mesh:
                raise MeshMismatchError(f"inputs are on different meshes: {d.mesh!r} and {mesh!r}")
        cost_model = self._cost_model or default_cost_model()
        if self._out_shardings is not None:
            jax_shardings.check_out_mesh(self._out_shardings, mesh, self.__name__)
        targets = self._out_targets(program, mesh, out_tree)
        if reduced:
            targets = [None if isinstance(t, str) and t == KEEP else t for t in targets]
        # Values stored unevenly enter with those dims gathered whole; outputs asked for uneven
        # placements are computed whole there and each device keeps its rows (uneven.py)
        stored_in = [d.layout if d.layout is not None and is_uneven(d.layout, mesh, d.shape)
                     else None for d in described]
        stored_out = [t if isinstance(t, Layout) and is_uneven(t, mesh, v.shape) else None
                      for t, v in zip(targets, program.outputs)]
        plan = make_plan(program, mesh,
                         [d.layout if s is None else even_part(s, mesh, d.shape)
                          for d, s in zip(described, stored_in)],
                         [t if s is None else even_part(s, mesh, v.shape)
                          for t, s, v in zip(targets, stored_out, program.outputs)],
                         _registry(), cost_model)
        if not (any(stored_in) or any(stored_out) or any(d.memory for d in described)
                or any(self._out_kinds(len(program.outputs)))):
            # a reshape splitting a dim finer than its axis: planned on sub-axes (refine.py)
            plan = refined_plan(plan, program, targets, _registry(), cost_model)
        # (reduced: called under an outer jax transformation, which may differentiate it)
        local = local_function(plan, _registry(), differentiable=reduced)
        if any(stored_in) or any(stored_out):
            local = _with_uneven_boundaries(local, plan, described, stored_in, stored_out,
                                            self.__name__, self._leaf_names(tree, static),
                                            _output_names(out_tree), eager=self._always_dist)
        ins = [L if s is None else s for L, s in zip(plan.inputs, stored_in)]
        outs = [L if s is None else s for L, s in zip(plan.outputs, stored_out)]
        mapped = _shard_mapped(local, plan.mesh, tuple(physical_spec(L, plan.mesh) for L in ins),
                               [physical_spec(L, plan.mesh) for L in outs])
        mapped = _with_memory_kinds(mapped, mesh, ins, outs, [d.memory for d in described],
                                    self._out_kinds(len(outs)))
        if plan.refinement is None:
            fn = jax.jit(mapped, donate_argnums=self._flat_donations(tree))
        else:  # the refined mesh's devices are the user's in order: the same arrays, renamed
            outs = plan.user_outputs
            fn = jax.jit(mapped, donate_argnums=self._flat_donations(tree),
                         out_shardings=[physical_sharding(L, mesh) for L in outs])
        return _Compiled(plan, fn, out_tree, described, outs, hoisted=hoisted)

    def _out_kinds(self, n: int) -> list[str | None]:
        kinds = self._out_memory_kinds
        if kinds is None or isinstance(kinds, str):
            return [kinds] * n
        if len(kinds) != n:
            raise PlacementTypeError(
                f"dist.jit({self.__name__}): out_memory_kinds has {len(kinds)} entries but the "
                f"function returns {n} arrays: give one per output leaf (None: device memory), "
                f"or one string for all")
        return list(kinds)

    def _input_names(self, tree, static, n: int) -> list[str]:
        """`_leaf_names(tree, static)`, or `input k` for each of the n flat inputs where the
        tree is of another shape (a lifted module's)."""
        try:
            names = self._leaf_names(tree, static)
        except Exception:
            names = []
        return names if len(names) == n else [f"input {k}" for k in range(n)]

    def _leaf_names(self, tree, static) -> list[str]:
        """How the user would name each flat input: `params['w0']`-style paths from the
        argument (positional index or keyword)."""
        positions = [i for i in range(len(static) + len(tree.children()[0].children()))
                     if i not in self._static] if tree.children() else []
        paths = jax.tree_util.tree_flatten_with_path(
            jax.tree.unflatten(tree, list(range(tree.num_leaves))))[0]
        names = []
        for path, _ in paths:
            head, rest = path[:2], path[2:]
            if getattr(head[0], "idx", 0) == 0 and hasattr(head[1], "idx"):
                arg = f"argument {positions[head[1].idx]}"
            else:
                arg = f"argument {getattr(head[1], 'key', '?')!s}"
            names.append(arg + jax.tree_util.keystr(rest))
        return names

    def _flat_donations(self, tree) -> tuple[int, ...]:
        """The flat positions of the donated leaves (per tree: every call checks them)."""
        if not self._donate and not self._donate_names:
            return ()
        cache = self.__dict__.setdefault("_donations", {})
        if tree not in cache:
            cache[tree] = self._donated_leaves(tree)
        return cache[tree]

    def _donated_leaves(self, tree) -> tuple[int, ...]:
        dynamic_positions = [i for i in range(max(self._donate, default=0) + 1 + len(self._static))
                             if i not in self._static]
        donated_dynamic = {dynamic_positions.index(i) for i in self._donate if i in dynamic_positions}
        (dyn_tree, kw) = jax.tree.unflatten(tree, list(range(tree.num_leaves)))
        flat = []
        for j, sub in enumerate(dyn_tree):
            if j in donated_dynamic:
                flat.extend(jax.tree.leaves(sub))
        for name in self._donate_names:  # passed by keyword
            flat.extend(jax.tree.leaves(kw.get(name)))
        return tuple(sorted(flat))

    def _physical_inputs(self, entry: _Compiled, leaves) -> list:
        out = []
        for x, d, L in zip(leaves, entry.leaves, entry.plan.user_inputs):
            if isinstance(x, DistTensor):
                out.append(x.physical)
            elif d.layout is not None:
                out.append(x)
            else:
                arr = x if isinstance(x, (jax.Array, np.ndarray)) else np.asarray(x, dtype=d.dtype)
                out.append(device_put(arr, physical_sharding(L, entry.plan.user_mesh)))
        return out + list(entry.hoisted)

    # -- public -------------------------------------------------------------------------------
    @_jax_arguments
    def __call__(self, *args, **kwargs):
        if _TRACING.depth:
            # called while another dist.jit function is being traced: its body becomes part
            # of that program, which the outer plan partitions as a whole (as jax.jit nests);
            # a DistTensor it meets (closed over by the user, or an eager operator's operand)
            # enters as its global value, a constant of that program
            args, kwargs = jax.tree.map(
                lambda x: _global_array(x) if isinstance(x, DistTensor) else x, (args, kwargs),
                is_leaf=lambda x: isinstance(x, DistTensor))
            return self._fn(*args, **kwargs)
        split = self._split(args, kwargs)
        physicals = [x.physical if isinstance(x, DistTensor) else x for x in split[1]]
        # Inside any outer jax transformation (jit, checkpoint, grad, ...) no output stays
        # Partial, and no custom_linear_solve is inlined: a jit or checkpoint may itself be
        # differentiated later, after this call has been traced
        outer = _under_a_trace() or any(isinstance(x, jax.core.Tracer) for x in physicals)
        entry, leaves = self._entry(args, kwargs, reduced=outer, split=split, run=True)
        if isinstance(entry, _MeshStages):
            if outer:
                raise MeshMismatchError(
                    f"{self.__name__} spans {len(entry.cut.stages)} stages on different meshes "
                    f"and runs them one after another, which an outer jax transformation cannot "
                    f"trace: put jax.grad / value_and_grad inside the function")
            return jax.tree.unflatten(entry.out_tree, entry(leaves))
        physical = self._physical_inputs(entry, leaves)
        outs = entry.call(*physical)
        plan = entry.plan
        wrapped = [DistTensor(o if o.size or isinstance(o, jax.core.Tracer) else
                              # jax hands an empty result back replicated: give it its layout
                              device_put(o, physical_sharding(L, plan.user_mesh)),
                              plan.user_mesh, L, v.shape)
                   for o, L, v in zip(outs, entry.stored_outputs, plan.program.outputs)]
        if entry.out_descs is None:
            entry.out_descs = [_describe_leaf(d) for d in wrapped]
        else:  # the same descriptions each call: the next call's cache key compares by identity
            for d, desc in zip(wrapped, entry.out_descs):
                d._desc = desc
        if outer:
            self._check_differentiable(entry, leaves)
            if not self._always_dist or _differentiated(physicals):
                # Under jax.jit / grad / checkpoint / vjp from outside, behave as a nested
                # jax.jit does: global arrays (sharded as planned; Partial outputs were reduced
                # inside the program), which jnp functions and the outer transformation take
                wrapped = [_global_array(d) for d in wrapped]
        return jax.tree.unflatten(entry.out_tree, wrapped)

    def _check_differentiable(self, entry: _Compiled, leaves) -> None:
        for k, (x, d) in enumerate(zip(leaves, entry.leaves)):
            if isinstance(x, DistTensor) and d.layout is not None and d.layout.partial \
                    and _differentiated([x.physical]):
                raise partial_gradient_error(f"{self.__name__}'s input {k}", x.placements)

    @_jax_arguments
    def plan(self, *args, **kwargs) -> Plan:
        """The Plan for these arguments: every value's layout, every collective and why."""
        entry = self._entry(args, kwargs)[0]
        if isinstance(entry, _MeshStages):
            raise MeshMismatchError(
                f"{self.__name__} spans {len(entry.cut.stages)} meshes, one program each: "
                f"their plans are .stage_plans(*args)")
        return entry.plan

    @_jax_arguments
    def stage_plans(self, *args, **kwargs) -> list[Plan]:
        """Per stage (one per run of equations on one mesh), its Plan; one Plan when the
        function runs on one mesh."""
        entry, leaves = self._entry(args, kwargs)
        if isinstance(entry, _MeshStages):
            return [plan for plan, _ in entry.plans(leaves)]
        return [entry.plan]

    @_jax_arguments
    def explain(self, *args, **kwargs) -> Explanation | StagedExplanation:
        """The plan as a table (text in a terminal, HTML in a notebook); for a function cut
        into stages on several meshes, each stage's, with what moves between them."""
        entry, leaves = self._entry(args, kwargs)
        if isinstance(entry, _MeshStages):
            return StagedExplanation(self.__name__, entry.plans(leaves))
        return Explanation(entry.plan)

    @_jax_arguments
    def lower(self, *args, **kwargs):
        """The jax `Lowered` of the partitioned program (`.compile().as_text()` for HLO)."""
        entry, leaves = self._entry(args, kwargs)
        return gc_paused(entry.fn.lower)(*self._physical_inputs(entry, leaves))


class _MeshStages:
    """A function cut into stages on different meshes (cut.py): one dist.jit program per
    stage, run in order, values moved between meshes by cross-mesh reshards."""

    def __init__(self, cut, out_tree, name: str, cost_model, out_placements,
                 donated: set = frozenset()):
        self.cut, self.out_tree, self._out_placements = cut, out_tree, out_placements
        self._free = None
        self.programs = []
        for k, (part, given) in enumerate(zip(cut.stages, _donated_per_stage(cut, donated))):
            program = DistributedFunction(_stage_function(cut, part), cost_model=cost_model,
                                          donate_argnums=given)
            program.__name__ = f"{name}[stage {k}]"
            self.programs.append(program)

    def _arguments(self, env: dict, part, moves: list | None = None) -> list:
        from ..reshard.api import plan_reshard

        args = []
        for v in part.inputs:
            x = arrive(env[v], part, v)
            if moves is not None and x is not env[v]:
                moves.append((f"{x.dtype}{list(x.shape)}", part.lines.get(v),
                              plan_reshard(env[v], x.mesh, x.placements)))
            args.append(x)
        return args

    def _run(self, leaves, visit=None) -> dict:
        env = dict(zip(self.cut.invars, leaves))
        for part, program in zip(self.cut.stages, self.programs):
            moves = [] if visit is not None else None
            args = self._arguments(env, part, moves)
            if visit is not None:
                visit(program, args, moves)
            # donated: copies where asking for the plans runs the stages, and where a moved
            # argument's copy shares the original's buffers (a device of both meshes keeps
            # its block: jax's device_put hands the same buffer back), which stays valid
            args = [with_own_buffers(x) if j in program._donate and (
                visit is not None or x is not env[v] and _shares_buffers(x, env[v])) else x
                for j, (x, v) in enumerate(zip(args, part.inputs))]
            env.update(zip(part.outputs, program(*args)))
        return env

    def __call__(self, leaves) -> list:
        env = self._run(leaves)
        cut = self.cut
        if cut.free_results:  # results that read nothing placed: plain arrays, on no mesh
            if self._free is None:
                part = _FreePart(cut)
                self._free = part, jax.jit(_stage_function(cut, part))
            part, fn = self._free
            env.update(zip(cut.free_results, fn(*[env[v] for v in part.inputs])))
        outs = [v.val if isinstance(v, jcore.Literal) else
                self.cut.consts[v] if v in self.cut.consts else env[v] for v in self.cut.outvars]
        spec = self._out_placements
        if spec is not None and not (isinstance(spec, str) and spec == KEEP):
            from ..reshard.api import reshard

            per = out_spec.per_output(spec, self.out_tree, len(outs))
            outs = [reshard(o, o.mesh, p) if p is not None and isinstance(o, DistTensor) else o
                    for o, p in zip(outs, per)]
        return outs

    def plans(self, leaves) -> list[tuple[Plan, list]]:
        """Per stage: its Plan and the values that move onto its mesh before it runs
        (what, the user's line, the cross-mesh reshard plan). Runs the stages."""
        found: list = []
        self._run(leaves, lambda program, args, moves: found.append((program.plan(*args), moves)))
        return found


class _FreePart:
    """The equations of a cut's mesh-less results, shaped like a stage for _stage_function."""

    def __init__(self, cut):
        used = {v for e in cut.free_eqns for v in e.invars if not isinstance(v, jcore.Literal)}
        self.inputs = [v for v in cut.invars if v in used]
        self.eqns, self.outputs = cut.free_eqns, cut.free_results


def _donated_per_stage(cut, donated: set) -> list[tuple[int, ...]]:
    """Per stage, the positions of its inputs it takes the buffers of: each donated input of
    the function goes to the last stage that reads it (where it arrives moved from another
    mesh, the moved copy), unless the function returns it or its mesh-less part reads it."""
    last = {v: k for k, part in enumerate(cut.stages) for v in part.inputs}
    kept = {v for v in cut.outvars if isinstance(v, jcore.Var)}
    if cut.free_results:
        kept.update(_FreePart(cut).inputs)
    return [tuple(j for j, v in enumerate(part.inputs)
                  if v in donated and last[v] == k and v not in kept)
            for k, part in enumerate(cut.stages)]


def _shares_buffers(a: Any, b: Any) -> bool:
    def buffers(x) -> set:
        held = getattr(x, "physical", x)
        if not isinstance(held, jax.Array):
            return set()
        return {s.data.unsafe_buffer_pointer() for s in held.addressable_shards}

    return bool(buffers(a) & buffers(b))


def _stage_function(cut, part) -> Callable:
    """The equations of one stage as a function of its inputs (re-bound when traced)."""
    def stage(*xs):
        env = eval_eqns(part.eqns, {**cut.consts, **dict(zip(part.inputs, xs))})
        return [env[v] for v in part.outputs]

    return stage


_EAGER_WARNED: set = set()  # (layout, mesh, shape) an eager operator has warned about


def _output_name(path: tuple) -> str:
    """A flat output as the user would name it: `output[1]['w']`, or `its output` (one array)."""
    return "output" + jax.tree_util.keystr(path) if path else "its output"


def _output_names(out_tree) -> list[str]:
    paths = jax.tree_util.tree_flatten_with_path(
        jax.tree.unflatten(out_tree, list(range(out_tree.num_leaves))))[0]
    return [_output_name(path) for path, _ in paths]


def _with_uneven_boundaries(local: Callable, plan: Plan, described, stored_in, stored_out,
                            name: str, leaf_names: list[str], out_names: list[str], *,
                            eager: bool = False) -> Callable:
    """`local` between the stored blocks of uneven inputs / outputs and their even parts (the
    reshard atoms of uneven dims); the entry gathers join the plan's collectives (the HLO has
    them), with a warning each (eager operators: once per tensor layout, not per operator),
    as does each output asked for an uneven placement."""
    mesh, sizes = plan.mesh, plan.mesh.axis_sizes
    cost_model = plan.cost_model or default_cost_model()

    def steps(layout, shape, dtype, gather):
        return None if layout is None else uneven_steps(mesh, layout, shape, cost_dtype(dtype),
                                                        cost_model, gather=gather)

    # an input nothing reads is not gathered (XLA would drop the gather, unlisted)
    readers, outputs = plan.program.readers(), set(plan.program.outputs)
    entry = [steps(s, d.shape, d.dtype, True) if v in readers or v in outputs else None
             for s, d, v in zip(stored_in, described, plan.program.inputs)]
    exit_ = [steps(s, v.shape, v.dtype, False)
             for s, v in zip(stored_out, plan.program.outputs)]
    for k, (d, s, v) in enumerate(zip(described, stored_in, plan.program.inputs)):
        if s is None or entry[k] is None:
            continue
        even = even_part(s, mesh, d.shape)
        for planned in reversed(entry[k]):
            plan.collectives.insert(0, PlannedCollective(
                "all-gather", str(planned.step), planned.step.axes, planned.bytes_per_device,
                repr(v), "entry", plan.program.where,  # the user's call that ran it
                f"{name}: {leaf_names[k]} is stored as {s.describe(mesh)}, dim "
                f"{planned.step.dim} uneven; programs compute it as {even.describe(mesh)}"))
        nbytes = [p.bytes_per_device for p in entry[k]]
        if eager:
            if (s, mesh, d.shape) in _EAGER_WARNED:
                continue
            _EAGER_WARNED.add((s, mesh, d.shape))
        warn_uneven(s, mesh, d.shape,
                    f"a DistTensor stored as {s.describe(mesh)}" if eager else
                    f"{name}: {leaf_names[k]}",
                    "is gathered whole along that mesh dim by every eager operator on it" if eager
                    else f"is gathered whole along that mesh dim when the program starts "
                         f"({sum(nbytes)} bytes per device per call)")

    # an output's uneven dim is computed whole, as an input's is; one stored as an input is
    # (a param updated by a train step, an eager operator's result) was warned about as that
    stored = {(s, tuple(d.shape)) for s, d in zip(stored_in, described) if s is not None}
    for s, v, out_name in zip(stored_out, plan.program.outputs, out_names):
        if s is not None and not eager and (s, tuple(v.shape)) not in stored:
            warn_uneven(s, mesh, v.shape, f"{name}: {out_name} placed {s.describe(mesh)}",
                        "is computed whole along that mesh dim, then each device keeps its "
                        "block")

    def moved(x, layout, planned):
        if planned is None:
            return x
        if layout.partial:
            x = x[0]  # the slot axis of a Partial layout (physical.py)
        for p in planned:
            x = p.step.run(x, sizes)
        return x[None] if layout.partial else x

    def run(*blocks):
        outs = local(*[moved(b, s, p) for b, s, p in zip(blocks, stored_in, entry)])
        return [moved(o, s, p) for o, s, p in zip(outs, stored_out, exit_)]

    return run


def _under_a_trace() -> bool:
    """Whether an outer jax transformation is tracing this call (also when every input is a
    closed-over concrete value: the result still enters that trace)."""
    ctx = getattr(jcore, "trace_ctx", None)
    return ctx is not None and hasattr(ctx, "is_top_level") and not ctx.is_top_level()


def _differentiated(values) -> bool:
    """Whether any value is being differentiated by an outer jax transformation."""
    return any(isinstance(v, (ad.JVPTracer, ad.LinearizeTracer)) for v in values)


def _global_array(x: DistTensor):
    """The logical value as a jax array: non-Partial layouts are their physical array.

    Runs under an outer trace too (a closed-over tensor, a Partial output under jax.jit):
    only jitted programs, no eager reshard (which refuses traced values)."""
    from ..reshard.api import to_even

    return to_even(x, reduce_partial=True).physical


def _is_array_like(x: Any) -> bool:
    """What jax can return from a traced function: arrays, tracers, numbers, numpy scalars."""
    return isinstance(x, (jax.Array, jcore.Tracer, np.ndarray, np.generic, bool, int, float,
                          complex, DistTensor)) or hasattr(x, "__jax_array__")


def _argnums_and_names(fn: Callable, argnums: Any, argnames: Any
                       ) -> tuple[frozenset[int], tuple[str, ...]]:
    """Positions and names of the arguments meant, either way the user named them — as jax.jit
    does, a parameter named in argnames also counts when passed by position and one numbered
    in argnums also when passed by keyword (read from the signature where there is one)."""
    name = getattr(fn, "__name__", type(fn).__name__)
    argnums = () if argnums is None else argnums  # jax.jit's None: no argument
    argnames = () if argnames is None else argnames
    nums = argnums if isinstance(argnums, (list, tuple)) else (argnums,)
    bad = [i for i in nums if isinstance(i, bool) or not isinstance(i, (int, np.integer))]
    if bad:
        raise SignatureError(
            f"dist.jit({name}): static_argnums / donate_argnums take argument numbers, got "
            f"{bad[0]!r}" + (f": name it with static_argnames={bad[0]!r} (or donate_argnames)"
                             if isinstance(bad[0], str) else ": write e.g. static_argnums=(1,)"))
    nums = {int(i) for i in nums}
    names = (argnames,) if isinstance(argnames, str) else argnames
    if not isinstance(names, (list, tuple, set, frozenset)) or not all(
            isinstance(n, str) for n in names):
        raise SignatureError(
            f"dist.jit({name}): static_argnames / donate_argnames take parameter names, got "
            f"{argnames!r}: write e.g. static_argnames=('train',), or number the arguments "
            f"with static_argnums / donate_argnums")
    names = set(names)
    try:  # a module or bound method: the signature without the module itself
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function: no signature to read
        return frozenset(nums), tuple(sorted(names))
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    variadic = any(p.kind == p.VAR_POSITIONAL for p in params)
    beyond = sorted(i for i in nums if i >= len(positional) or i < -len(positional))
    if any(i < 0 for i in nums) and variadic:
        raise SignatureError(
            f"dist.jit({name}): a negative argument number {min(nums)} of a function taking "
            f"*args counts from a different end on each call: number the argument from 0")
    if beyond and not variadic:
        raise SignatureError(
            f"dist.jit({name}): argument number {beyond[0]} is named static (or donated), but "
            f"{name} takes {len(positional)} positional argument(s), numbered 0 to "
            f"{len(positional) - 1}: write the number of one of its parameters")
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        known = {p.name for p in params if p.kind != p.POSITIONAL_ONLY}
        unknown = sorted(names - known)
        if unknown:  # as jax.jit: a name the function does not take would be ignored silently
            raise SignatureError(
                f"dist.jit({name}): {unknown[0]!r} is named static (or donated), but {name} "
                f"takes no keyword argument of that name (it takes {sorted(known)})"
                + did_you_mean(unknown[0], sorted(known)))
    nums = {i % len(positional) if i < 0 else i for i in nums}  # -1: the last, as jax.jit
    by_name = {p.name: i for i, p in enumerate(positional) if p.kind == p.POSITIONAL_OR_KEYWORD}
    nums |= {by_name[n] for n in names if n in by_name}
    names |= {p.name for i, p in enumerate(positional)
              if i in nums and p.kind == p.POSITIONAL_OR_KEYWORD}
    return frozenset(nums), tuple(sorted(names))


def _check_memory_kinds(kinds: Any) -> Any:
    if kinds is None:
        return None
    if not isinstance(kinds, (str, list, tuple)):
        raise PlacementTypeError(
            f"dist.jit: out_memory_kinds={kinds!r} is not a memory kind: write 'pinned_host' "
            f"for every output, or a list with one entry per output leaf ('pinned_host', "
            f"'device' or None)")
    flat = [kinds] if isinstance(kinds, str) else list(kinds)
    for k in flat:
        if k is not None and k not in HOST_MEMORY_KINDS + ("device",):
            raise PlacementTypeError(
                f"dist.jit: out_memory_kinds entry {k!r} is not a memory kind: write "
                f"'pinned_host' (kept in host memory between calls), 'device' or None")
    if isinstance(kinds, str):
        return None if kinds == "device" else kinds
    return [None if k == "device" else k for k in flat]


def _shard_mapped(local: Callable, mesh: ProcessMesh, in_specs: tuple, out_specs: list):
    """`local` under jax.shard_map, its empty inputs made inside rather than passed in: XLA's
    Shardy verifier refuses a manual computation whose operands are all empty ("expected at
    least one operand ... produced by a GlobalToLocalShape"), and an empty block holds
    nothing to pass."""
    jmesh = mesh.to_jax()

    def call(*xs):
        empty = {k for k, x in enumerate(xs) if 0 in np.shape(x) and not is_extended(x.dtype)}
        if not empty:
            return jax.shard_map(local, mesh=jmesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=True)(*xs)
        kept = [k for k in range(len(xs)) if k not in empty]

        def block(k: int):  # the empty input's local block, varying as its spec says
            shape, axes = list(np.shape(xs[k])), []
            for d, entry in enumerate(in_specs[k]):
                for a in (() if entry is None else (entry,) if isinstance(entry, str) else entry):
                    shape[d] //= mesh.get_dim_size(a)
                    axes.append(a)
            z = jax.numpy.zeros(shape, xs[k].dtype)
            return jax.lax.pcast(z, tuple(axes), to="varying") if axes else z

        def body(*given):
            full = dict(zip(kept, given))
            return local(*[full[k] if k in full else block(k) for k in range(len(xs))])

        return jax.shard_map(body, mesh=jmesh, in_specs=tuple(in_specs[k] for k in kept),
                             out_specs=out_specs, check_vma=True)(*[xs[k] for k in kept])

    return call


def _with_memory_kinds(mapped: Callable, mesh: ProcessMesh, ins: list, outs: list,
                       in_kinds: list, out_kinds: list) -> Callable:
    """Host offloading: inputs stored in host memory are copied to the devices inside the
    program (XLA places the copy where the value is first needed, so it is not resident for the
    whole step), outputs asked for in host memory are copied back there before they return."""
    if not any(in_kinds) and not any(out_kinds):
        return mapped
    to_device = [physical_sharding(L, mesh) if k else None for L, k in zip(ins, in_kinds)]
    to_host = [physical_sharding(L, mesh).with_memory_kind(k) if k else None
               for L, k in zip(outs, out_kinds)]

    def offloaded(*xs):
        xs = [x if s is None else jax.device_put(x, s) for x, s in zip(xs, to_device)]
        return [y if s is None else jax.device_put(y, s) for y, s in zip(mapped(*xs), to_host)]

    return offloaded


def jit(fn: Callable | None = None, *, static_argnums: Sequence[int] = (),
        donate_argnums: Sequence[int] = (), out_placements: Any = None,
        cost_model: CostModel | None = None, static_argnames: Sequence[str] = (),
        in_shardings: Any = None, out_shardings: Any = None,
        donate_argnames: Sequence[str] = (), out_memory_kinds: Any = None, **unknown: Any):
    """Partition `fn` across the mesh of its DistTensor inputs (usable as a decorator).

    Inside, `dist.shard_tensor(x, mesh, placements)` fixes x's placement (a hint) and
    `dist.reshard(x, mesh, placements)` forces a conversion; everything else is decided by the
    SPMD rules and the cost model. Outputs are DistTensors: pending Partial values are reduced
    unless `out_placements` gives the placements (one list for all outputs, one per flat
    output, or a pytree prefix of the result as jax.jit's out_shardings: `[{"w": [R, S(1)]},
    None]` for `return params, loss`) or is "keep" (leave every output as the plan computed
    it, Partial included). `static_argnames`: keyword arguments compiled into the program,
    as jax.jit's (`train=True`); `donate_argnums` / `donate_argnames`: arguments whose buffers
    the program may reuse. As in jax.jit, an argument named in argnames counts when passed by
    position and one numbered in argnums when passed by keyword. `in_shardings` /
    `out_shardings`: jax.jit's, NamedShardings (or PartitionSpecs under jax.set_mesh) — the
    arguments are placed so before the call, the results laid out so after it.
    Host offloading: an input stored in host memory (`dist.offload(x)`, or a jax array put
    with memory_kind="pinned_host") is copied to the devices inside the program;
    `out_memory_kinds` ("pinned_host" for every output, or one entry per output leaf, None
    for device memory) sends outputs back to host memory.
    """
    if unknown:
        raise _unknown_option(sorted(unknown)[0])
    if fn is None:
        return functools.partial(jit, static_argnums=static_argnums, donate_argnums=donate_argnums,
                                 out_placements=out_placements, cost_model=cost_model,
                                 static_argnames=static_argnames, in_shardings=in_shardings,
                                 out_shardings=out_shardings, donate_argnames=donate_argnames,
                                 out_memory_kinds=out_memory_kinds)
    return DistributedFunction(fn, static_argnums=static_argnums, donate_argnums=donate_argnums,
                               out_placements=out_placements, cost_model=cost_model,
                               static_argnames=static_argnames, in_shardings=in_shardings,
                               out_shardings=out_shardings, donate_argnames=donate_argnames,
                               out_memory_kinds=out_memory_kinds)


def _unknown_option(name: str) -> SignatureError:
    """The error for a keyword dist.jit does not take, saying what to write instead."""
    options = [p.name for p in inspect.signature(jit).parameters.values()
               if p.kind is p.KEYWORD_ONLY]
    if name == "in_placements":
        hint = (": in_placements is local_map's: dist.jit places the inputs as their "
                "DistTensors are placed, as in_shardings= says (jax.jit's), or by "
                "dist.shard_tensor inside the function")
    else:
        hint = f"{did_you_mean(name, options)}: its options are {options}"
    return SignatureError(f"dist.jit takes no option {name!r}{hint}")


__all__ = ["jit", "DistributedFunction"]
