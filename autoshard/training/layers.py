"""Paddle's dist.shard_layer and dist.parallelize for flax: place a model's parameters on a mesh,
by hand (a shard_fn) or from a plan of name patterns (Megatron column/row and sequence parallel)."""
from __future__ import annotations

import dataclasses
import functools
import math
import inspect
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from ..creation import shard_tensor
from ..dtensor import DistTensor
from ..errors import AutoshardError, did_you_mean
from ..layout import Layout, layout_from_placements
from ..mesh import ProcessMesh, as_process_mesh, get_mesh
from ..placement import Placement, Replicate, Shard
from ..uneven import even_part, is_uneven, warn_uneven
from . import annotations
from .pipeline_split import definition_order, module_stages, move_inputs, stage_starts


class ParallelizeError(AutoshardError, ValueError):
    """A shard_layer / parallelize request that does not fit the model, the config or the mesh."""


def _nnx():
    # Imported on first use so that `import autoshard` does not pay for flax.
    from flax import nnx

    return nnx


def _dotted(path: Sequence[Any]) -> str:
    return ".".join(str(k) for k in path)


# ------------------------------------------------------------------------------- call hooks
@dataclass(frozen=True)
class _Hooks:
    inputs: tuple[Callable[[tuple], tuple], ...] = ()
    outputs: tuple[Callable[[Any], Any], ...] = ()


_HOOKED_CLASSES: dict[type, type] = {}


def _hooked_class(cls: type) -> type:
    """A subclass of `cls` whose __call__ runs the instance's hooks around cls.__call__.

    Python looks __call__ up on the type, so per-instance hooks need a class of their own; nnx
    records that class in the graphdef, so modules rebuilt by nnx.merge inside dist.jit keep
    their hooks. One subclass per class keeps graphdefs of equal models equal.
    """
    if cls in _HOOKED_CLASSES.values():
        return cls
    if cls not in _HOOKED_CLASSES:
        def __call__(self, *args, **kwargs):
            hooks = getattr(self, "_autoshard_hooks", _Hooks())
            if hooks.inputs and not args and kwargs:
                # (the plan places the first positional input: given by keyword, its step
                # was skipped, silently)
                raise ParallelizeError(
                    f"the {cls.__name__} layer was called with its inputs by keyword "
                    f"({', '.join(kwargs)}=...), but its parallelize_plan places its first "
                    f"positional input: call it with that input first, positionally "
                    f"(layer(x, ...))")
            for fn in hooks.inputs:
                args = fn(args)
            out = cls.__call__(self, *args, **kwargs)
            for fn in hooks.outputs:
                out = fn(out)
            return out

        # Same name and module: reprs and error messages show the user's class.
        _HOOKED_CLASSES[cls] = type(cls)(cls.__name__, (cls,), {
            "__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _HOOKED_CLASSES[cls]


def _add_hooks(module: Any, path: str, inputs: Sequence[Callable] = (),
               outputs: Sequence[Callable] = ()) -> None:
    if not callable(module):
        raise ParallelizeError(
            f"the layer at {path!r} ({type(module).__name__}) has no __call__, so input/output "
            f"hooks cannot run around it: attach them to the layer that is called")
    old = getattr(module, "_autoshard_hooks", _Hooks())
    # object.__setattr__: nnx's own __setattr__ would record __class__ as a module attribute.
    object.__setattr__(module, "__class__", _hooked_class(type(module)))
    module._autoshard_hooks = _Hooks(old.inputs + tuple(inputs), old.outputs + tuple(outputs))


def _as_args(result: Any) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _run_input_fn(fn: Callable, mesh: ProcessMesh, args: tuple) -> tuple:
    return _as_args(fn(args, mesh))


def _run_output_fn(fn: Callable, mesh: ProcessMesh, out: Any) -> Any:
    return fn(out, mesh)


def _run_first_input_fn(fn: Callable, mesh: ProcessMesh, path: str, args: tuple) -> tuple:
    if not args:
        raise ParallelizeError(f"PrepareLayerInput on {path!r}: the layer was called without "
                               f"positional arguments; pass its input positionally")
    return (fn(args[0], mesh),) + args[1:]


# ------------------------------------------------------------------------------- shard_layer
def shard_layer(layer: Any, process_mesh: ProcessMesh, shard_fn: Callable | None = None,
                input_fn: Callable | None = None, output_fn: Callable | None = None) -> Any:
    """Place every parameter of `layer` on `process_mesh` (Paddle's dist.shard_layer).

    flax nnx Module: changed in place and returned. `shard_fn(name, sublayer, mesh)` is called
    once per submodule (shared ones once), the root first with name "", the others with their
    dotted attribute path ("up", "layers.0.attn"); it shards a parameter by assigning a
    DistTensor, e.g. `sublayer.kernel.set_value(dist.shard_tensor(sublayer.kernel.get_value(),
    mesh, [dist.Replicate(), dist.Shard(1)]))` or `.value = ...` (not `kernel[...] = ...`,
    which copies the values into the old array), by assigning the attribute as Paddle does
    (`sublayer.kernel = dist.shard_tensor(...)`: the DistTensor goes into the Param it
    replaced), or by returning {param name: DistTensor or placements} for the sublayer's own
    params (linen's form). Every nnx.Param it leaves alone is placed as
    flax annotates it (`nnx.with_partitioning`, or sharded on the mesh by flax under
    jax.set_mesh; names are mesh dims, after flax's logical axis rules), else replicated.
    `input_fn(inputs, mesh)` gets the tuple of positional arguments of each call and returns
    the new tuple (or one value); `output_fn(outputs, mesh)` gets and
    returns the call's result. They run around every call of the layer, also after nnx.split /
    nnx.merge, so inside dist.jit a `dist.shard_tensor` in them is a placement hint (e.g. split
    the batch over "dp").

    linen params (the dict from `model.init`): returns a new tree of DistTensors. `shard_fn(name,
    subtree, mesh)` is called for every sub-dict, parents before children, the root with name
    "" and the others with their dotted key path ("params.Dense_0"); `subtree` is the
    unsharded sub-dict. It returns None or a dict {key: DistTensor or placements list} for keys
    of `subtree` that hold arrays (not sub-dicts); every array not named so is placed as its
    `nn.with_partitioning` box says (the box is dropped), else replicated.
    input_fn / output_fn need an nnx module.
    """
    mesh = as_process_mesh(process_mesh)
    for name, fn, form in (("shard_fn", shard_fn, "shard_fn(name, sublayer, mesh)"),
                           ("input_fn", input_fn, "input_fn(inputs, mesh)"),
                           ("output_fn", output_fn, "output_fn(outputs, mesh)")):
        if fn is not None and not callable(fn):
            raise ParallelizeError(
                f"shard_layer: {name} is {fn!r:.60} of type {type(fn).__name__}, not a "
                f"function: pass None or a function {form} (see help(dist.shard_layer))")
    nnx = _nnx()
    if isinstance(layer, nnx.Module):
        _shard_nnx(layer, mesh, shard_fn)
        if input_fn is not None or output_fn is not None:
            _add_hooks(layer, "",
                       [functools.partial(_run_input_fn, input_fn, mesh)] if input_fn else [],
                       [functools.partial(_run_output_fn, output_fn, mesh)] if output_fn else [])
        return layer
    if isinstance(layer, Mapping):
        if input_fn is not None or output_fn is not None:
            raise ParallelizeError(
                "shard_layer on a linen params tree cannot take input_fn / output_fn: the tree "
                "is not called; annotate the inputs with dist.shard_tensor in the step function "
                "or inside the linen module's __call__")
        return _shard_tree(layer, mesh, shard_fn, ())
    raise ParallelizeError(
        f"shard_layer takes a flax nnx.Module or a linen params dict, got "
        f"{type(layer).__name__}: for a linen Module pass `model.init(key, x)` (its params tree)")


def _nnx_modules(model: Any) -> dict[str, Any]:
    nnx = _nnx()
    found = {_dotted(p): m for p, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)}
    # iter_graph visits children before parents; Paddle calls shard_fn on the root first.
    return {"": found.pop("")} | found


def _nnx_params(model: Any) -> dict[str, Any]:
    nnx = _nnx()
    return {_dotted(p): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}


def _on_mesh(value: Any, mesh: ProcessMesh, path: str,
             annotated: Callable[[], Any] | None = None) -> DistTensor:
    """`value` as a DistTensor on `mesh`: as placed already (a DistTensor, a jax.Array sharded
    on the mesh), else as `annotated()` says (flax's annotations), else replicated."""
    if isinstance(value, DistTensor):
        if value.mesh != mesh:
            raise ParallelizeError(
                f"parameter {path!r} is on {value.mesh!r}, not on the layer's mesh {mesh!r}: "
                f"shard it onto {mesh!r} (dist.shard_tensor(x, mesh, placements))")
        return value
    placements = annotations.of_array(value, mesh, path)
    if placements is None and annotated is not None:
        placements = annotated()
    return shard_tensor(value, mesh, placements or [Replicate()] * mesh.ndim)


def _call_shard_fn(shard_fn: Callable, name: str, layer: Any, mesh: ProcessMesh) -> Any:
    """`shard_fn(name, layer, mesh)`, its arity checked first (a TypeError raised inside it
    is the user's own and goes through as it is)."""
    try:
        inspect.signature(shard_fn).bind(name, layer, mesh)
    except TypeError as e:
        raise ParallelizeError(
            f"shard_layer calls shard_fn as shard_fn(name, sublayer, mesh), but "
            f"{getattr(shard_fn, '__name__', shard_fn)!r:.60} does not take those three "
            f"arguments ({e}): write def shard_fn(name, layer, mesh)") from None
    except ValueError:
        pass  # a builtin without a signature: call it and see
    return shard_fn(name, layer, mesh)


def _shard_nnx(model: Any, mesh: ProcessMesh, shard_fn: Callable | None) -> None:
    if shard_fn is not None:
        nnx = _nnx()
        for name, module in _nnx_modules(model).items():
            own = {k: v for k, v in vars(module).items() if isinstance(v, nnx.Param)}
            wanted = _call_shard_fn(shard_fn, name, module, mesh)
            path = {key: f"{name}.{key}" if name else key for key in own}
            for key, param in own.items():
                now = getattr(module, key, None)
                if now is not param and isinstance(now, DistTensor):
                    # Paddle's `layer.weight = dist.shard_tensor(layer.weight.get_value(), ...)`:
                    # the DistTensor goes into the Param it replaced (an optimizer and
                    # nnx.state find parameters by their Param; a tied one stays tied)
                    param.set_value(_on_mesh(now, mesh, path[key]))
                    setattr(module, key, param)
            if wanted is None:
                continue
            if not isinstance(wanted, Mapping):
                raise ParallelizeError(
                    f"shard_fn({name!r}, ...) returned {type(wanted).__name__}: return None "
                    f"(after setting the layer's params) or a dict {{param name: DistTensor "
                    f"or placements}} of the layer's own params {sorted(own)}")
            for key, target in wanted.items():
                if key not in own:
                    raise ParallelizeError(
                        f"shard_fn({name!r}, ...) returned key {key!r}, but the params of "
                        f"layer {name or 'the root'!r} are {sorted(own)}: return only those; a "
                        f"sub-layer's params are placed by the shard_fn call for that sub-layer")
                own[key].set_value(_place_leaf(target, own[key].get_value(), mesh, path[key]))
    for path, param in _nnx_params(model).items():
        param.set_value(_placed(param, mesh, path))


def _placed(param: Any, mesh: ProcessMesh, path: str) -> DistTensor:
    """An nnx Param's value on `mesh` (`_on_mesh`, its flax annotation consulted)."""
    return _on_mesh(param.get_value(), mesh, path,
                    functools.partial(annotations.of_nnx, param, mesh, path))


def _shard_tree(tree: Mapping, mesh: ProcessMesh, shard_fn: Callable | None,
                path: tuple[str, ...]) -> Mapping:
    name = _dotted(path)
    wanted = (_call_shard_fn(shard_fn, name, tree, mesh) if shard_fn is not None else None) or {}
    if not isinstance(wanted, Mapping):
        raise ParallelizeError(f"shard_fn({name!r}, ...) returned {type(wanted).__name__}: return "
                               f"None or a dict {{key: DistTensor or placements}}")
    for key in wanted:
        if key not in tree or isinstance(tree[key], Mapping):
            raise ParallelizeError(
                f"shard_fn({name!r}, ...) returned key {key!r}, but the arrays of "
                f"{name or 'the root'!r} are "
                f"{[k for k, v in tree.items() if not isinstance(v, Mapping)]}: return only "
                f"those; a sub-dict's arrays are sharded by the shard_fn call for that sub-dict")
    out = {}
    for key, value in tree.items():
        where = _dotted(path + (str(key),))
        if isinstance(value, Mapping):
            out[key] = _shard_tree(value, mesh, shard_fn, path + (str(key),))
            continue
        value, spec = annotations.unbox_linen(value)  # nn.with_partitioning's box
        if key in wanted:
            out[key] = _place_leaf(wanted[key], value, mesh, where)
        else:
            out[key] = _on_mesh(value, mesh, where, None if spec is None else functools.partial(
                annotations.placements_of_spec, spec, mesh, tuple(value.shape), where,
                "nn.with_partitioning"))
    return type(tree)(out)  # keeps dict / FrozenDict as given


def _place_leaf(target: Any, value: Any, mesh: ProcessMesh, path: str) -> DistTensor:
    if isinstance(target, DistTensor):
        if tuple(target.shape) != tuple(value.shape):
            raise ParallelizeError(f"shard_fn gave parameter {path!r} shape {target.shape}, but it "
                                   f"is {tuple(value.shape)}: shard the given array itself")
        return _on_mesh(target, mesh, path)  # checks the mesh
    if isinstance(target, (list, tuple)):
        layout_from_placements(target, mesh, tuple(value.shape), what=f"parameter {path!r}")
        return shard_tensor(value, mesh, target)
    raise ParallelizeError(f"shard_fn gave {type(target).__name__} for parameter {path!r}: give "
                           f"a DistTensor or placements, e.g. [dist.Replicate(), dist.Shard(1)]")


# ------------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class ParallelConfig:
    """What parallelize decided, kept on an nnx model as `model._autoshard_parallel`."""

    mesh: ProcessMesh
    dp_dim: str
    mp_dim: str
    sharding_level: int
    stage_meshes: tuple = ()  # with pp_config: each pp slice's mesh, in order
    stages: int = 0  # with pp_config: the stages (model chunks) its split_spec made
    split_spec: Any = None  # with pp_config: the split_spec they were made by


# What a plan does to the activations around its layer's calls, as (first input, output):
# NO_HINT leaves that side alone; otherwise the mesh dim mp splits that tensor dim (None:
# whole over mp). The batch stays split over dp either way (_activation_hint).
NO_HINT = "no hint"


class ParallelPlan:
    """Base of the entries of mp_config["parallelize_plan"]."""

    def __repr__(self) -> str:
        # as the user wrote it: options left at their defaults are not shown
        set_ = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                if f.default is dataclasses.MISSING or getattr(self, f.name) != f.default] \
            if dataclasses.is_dataclass(self) else []
        return f"{type(self).__name__}({', '.join(set_)})"

    def param_dim(self, ndim: int) -> int | None:
        """The tensor dim a parameter of `ndim` dims is split on over the mp dim (None: keep)."""
        return None

    activations: tuple = (NO_HINT, NO_HINT)  # see NO_HINT: (first input, output)

    def hooks(self, config: ParallelConfig, path: str, layer: Any = None) -> tuple[list, list]:
        """(input hooks, output hooks) to run around the calls of `layer` (at `path`): by
        default the placements `activations` names."""
        before, after = self.activations
        kind = repr(self)
        return ([] if before == NO_HINT else
                [_on_first(functools.partial(_activation_hint, config, before, path, kind))],
                [] if after == NO_HINT else
                [functools.partial(_activation_hint, config, after, path, kind)])

    def feature_dim(self, ndim: int, features: tuple | None) -> int | None:
        """`param_dim`, knowing the parameter's (first input-feature dim, first output-feature
        dim) when its layer says (a multi-dim nnx.LinearGeneral kernel: (in, heads, head_dim))."""
        return self.param_dim(ndim)

    @property
    def places_params(self) -> bool:
        return type(self).param_dim is not ParallelPlan.param_dim

    @property
    def wants_hooks(self) -> bool:
        """Whether it runs hooks around its layer's calls (a plan that places parameters may
        too: ColWiseParallel(gather_output=True))."""
        return self.activations != (NO_HINT, NO_HINT) or (
            type(self).hooks is not ParallelPlan.hooks)


def _check_flag(plan: Any, name: str) -> None:
    """A plan's on/off option is a bool (any non-empty string read as True: "no" turned it on)."""
    value = getattr(plan, name)
    if not isinstance(value, (bool, np.bool_)):
        raise ParallelizeError(
            f"{type(plan).__name__}({name}={value!r}): {name} is True or False")


@dataclass(frozen=True, repr=False)
class ColWiseParallel(ParallelPlan):
    """Split the output features: the last dim of a kernel / embedding (nnx.Linear (in, out):
    Shard(1)) and the bias (Shard(0)) over the mp mesh dim. `gather_output`: the layer's output
    (split on its features) is gathered whole over mp after each call, as Paddle's
    ColWiseParallel(gather_output=True) does (PaddleNLP's embedding)."""

    gather_output: bool = False

    def __post_init__(self) -> None:
        _check_flag(self, "gather_output")

    def param_dim(self, ndim: int) -> int | None:
        return ndim - 1 if ndim >= 1 else None

    def feature_dim(self, ndim: int, features: tuple | None) -> int | None:
        # the first output dim: attention's heads (not head_dim) for a (in, heads, head_dim)
        # kernel, so each device owns whole heads and attention needs no collective
        return features[1] if features is not None else self.param_dim(ndim)

    @property
    def activations(self) -> tuple:
        return NO_HINT, None if self.gather_output else NO_HINT


@dataclass(frozen=True, repr=False)
class RowWiseParallel(ParallelPlan):
    """Split the input features: the second-to-last dim of a kernel (nnx.Linear (in, out):
    Shard(0); nnx.Embed: the vocabulary) over the mp mesh dim; the bias stays replicated.
    `is_input_parallel` False: the layer's input arrives whole, and is split on its last dim
    over mp before each call (Paddle's RowWiseParallel(is_input_parallel=False))."""

    is_input_parallel: bool = True

    def __post_init__(self) -> None:
        _check_flag(self, "is_input_parallel")

    def param_dim(self, ndim: int) -> int | None:
        return ndim - 2 if ndim >= 2 else None

    def feature_dim(self, ndim: int, features: tuple | None) -> int | None:
        return features[0] if features is not None else self.param_dim(ndim)

    @property
    def activations(self) -> tuple:
        return NO_HINT if self.is_input_parallel else -1, NO_HINT


# Sequence parallelism. Paddle's plans take `need_transpose`: with it, Paddle itself transposes
# [b, s, h] activations to [s/mp, b, h] and back. autoshard never changes the shape of what
# the model computes — the sequence dim of [batch, seq, ...] is split where it is, and the
# plan's collectives do the rest — so the flag is accepted (a PaddleNLP config runs as
# written) and changes nothing.
@dataclass(frozen=True, repr=False)
class SequenceParallelBegin(ParallelPlan):
    """From this layer's output on, activations [batch, seq, ...] are split on seq over mp."""

    need_transpose: bool = True
    activations = (NO_HINT, 1)


@dataclass(frozen=True, repr=False)
class SequenceParallelEnd(ParallelPlan):
    """The first layer after the sequence-parallel range: its input is gathered back to whole
    sequences (Replicate over mp) before each call, as Paddle's pre-hook does; its output is
    left as the layer makes it (a column-parallel head's logits stay split on the vocabulary,
    so the cross-entropy runs vocab-parallel)."""

    need_transpose: bool = True
    activations = (None, NO_HINT)


@dataclass(frozen=True, repr=False)
class SequenceParallelEnable(ParallelPlan):
    """The layer runs on sequence shards: its first input and its output split on seq."""

    activations = (1, 1)


@dataclass(frozen=True, repr=False)
class SequenceParallelDisable(ParallelPlan):
    """Inside a sequence-parallel range, the layer runs on whole sequences: its first input is
    gathered over mp before each call, its output split on seq again after."""

    need_transpose: bool = True
    activations = (None, 1)


# Context parallelism (Paddle's ContextParallel / PrepareContextParallel): the sequence split
# over the mesh dim named "sep". Paddle's hooks reshard each tensor from the placements it has
# at run time; a hint here is made while tracing, before the plan places anything, so the other
# mesh dims are said too: the batch stays over dp, and over mp (if the mesh has one besides
# sep) attention's heads stay split as Megatron's column-parallel q / k / v make them.
CP_DIM = "sep"
_CP_BACKENDS = ("p2p", "all2all")


def _check_backend(plan: Any) -> None:
    if plan.backend not in _CP_BACKENDS:
        raise ParallelizeError(f"{type(plan).__name__}(backend={plan.backend!r}): the backends "
                               f"are 'p2p' (ring: queries stay split on the sequence) and "
                               f"'all2all' (Ulysses: heads split during attention)")


def _check_cp_mesh(config: ParallelConfig, kind: str, path: str) -> None:
    if CP_DIM not in config.mesh.dim_names:
        raise ParallelizeError(
            f"{kind} on {path!r} splits the sequence over the mesh dim {CP_DIM!r}, but the mesh "
            f"has dims {config.mesh.dim_names}: build it with a 'sep' dim, e.g. "
            f"dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=['dp', 'sep'])")


def _cp_hint(config: ParallelConfig, sep_dim: int, path: str, kind: str, x: Any) -> Any:
    """`x` split on `sep_dim` over sep, its batch over dp, dim 2 (attention's heads) over mp."""
    if not isinstance(x, jax.core.Tracer) or not x.ndim:
        return x  # a placement hint means something only while dist.jit traces
    mesh = config.mesh
    if x.ndim <= sep_dim or x.shape[sep_dim] < mesh.get_dim_size(CP_DIM):
        # not a [batch, seq, heads, head_dim] tensor the dim splits: an attention mask's
        # size-1 head dim ([batch, 1, seq, seq]), a bias — left where the program puts it
        return x
    mp = config.mp_dim
    heads_over_mp = (mp not in (CP_DIM, config.dp_dim) and x.ndim >= 3
                     and x.shape[2] % mesh.get_dim_size(mp) == 0)
    split = {CP_DIM: sep_dim, **({mp: 2} if heads_over_mp else {})}
    layout = layout_from_placements(
        _hint_placements(config, x, split), mesh, tuple(x.shape),
        what=f"the activations of layer {path!r} ({kind}: a [batch, seq, ...] tensor)")
    if heads_over_mp and sep_dim == 2:
        n = mesh.get_dim_size(mp) * mesh.get_dim_size(CP_DIM)
        if x.shape[2] % n:
            # (grouped-query attention: fewer key / value heads than query heads)
            raise ParallelizeError(
                f"{kind} on layer {path!r}: Ulysses splits the heads (dim 2) of q, k and v "
                f"over {mp!r} and {CP_DIM!r} ({n} devices), but an argument of shape "
                f"{list(x.shape)} has {x.shape[2]} heads: give it a multiple of {n} (repeat "
                f"the key / value heads before the call, jnp.repeat(k, {n // math.gcd(n, x.shape[2])}, "
                f"axis=2)), or use ContextParallel('p2p')")
        # Ulysses inside tensor parallelism: each mp device's heads (Megatron's blocks) are
        # split again over sep — mp the outer split — so the all-to-alls stay within sep
        # (in mesh order, a sep-major split would reorder the heads across mp as well)
        dims = list(layout.dims)
        dims[sep_dim] = (mp, CP_DIM)
        layout = Layout(tuple(dims), layout.partial)
    return _placed_hint(x, layout, mesh, f"{kind} on layer {path!r}")


def _placed_hint(x: Any, layout: Layout, mesh: ProcessMesh, what: str) -> Any:
    """`x` annotated with `layout` (its even part: programs compute on even layouts only, as
    dist.shard_tensor's), a split that does not divide warned of naming `what` (the layer and
    its plan: shard_tensor's warning could only say "a traced value")."""
    from ..compiler.trace import bind_hint

    even = even_part(layout, mesh, tuple(x.shape))
    if even is not layout:
        warn_uneven(layout, mesh, tuple(x.shape), what, "is computed with that dim whole")
    return bind_hint(x, mesh, even, False)


def _on_all(hook: Callable) -> Callable:
    """An input hook that applies `hook` to every positional array argument."""
    def run(args: tuple) -> tuple:
        return tuple(hook(a) if hasattr(a, "ndim") else a for a in args)
    return run


@dataclass(frozen=True, repr=False)
class PrepareContextParallel(ParallelPlan):
    """On the model's first layer: its [batch, seq] inputs are split on the sequence over the
    mesh dim 'sep' before each call. Both backends split evenly: Paddle's p2p reorders the
    chunks to balance a ring's causal work, which autoshard's attention (below) does not
    have."""

    backend: str = "p2p"

    def __post_init__(self) -> None:
        _check_backend(self)

    def hooks(self, config, path, layer=None):
        _check_cp_mesh(config, repr(self), path)
        return [_on_all(functools.partial(_cp_hint, config, 1, path, repr(self)))], []


@dataclass(frozen=True, repr=False)
class ContextParallel(ParallelPlan):
    """On the attention layer called as `layer(q, k, v)` ([batch, seq, heads, head_dim]), split
    on the sequence over 'sep' before and after. 'all2all' (DeepSpeed Ulysses): q, k and v are
    moved to whole sequences with the heads split over sep for the call (all-to-alls), and the
    output back to sequence shards. 'p2p': the queries stay on their sequence shard and the
    plan brings each device the keys and values it attends to (all-gathers over sep: the bytes
    a ring passes around, without its overlap — each device holds the whole keys and values of
    one layer at a time, and the scores of its own queries only)."""

    backend: str = "p2p"

    def __post_init__(self) -> None:
        _check_backend(self)

    def hooks(self, config, path, layer=None):
        _check_cp_mesh(config, repr(self), path)
        before = 2 if self.backend == "all2all" else 1
        return ([_on_all(functools.partial(_cp_hint, config, before, path, repr(self)))],
                [functools.partial(_cp_hint, config, 1, path, repr(self))])


@dataclass(frozen=True, repr=False)
class PrepareLayerInput(ParallelPlan):
    """Prepare the layer's inputs before each call. `fn` is either Paddle's form —
    `fn(process_mesh)` returning a pre-hook `hook(layer, inputs) -> inputs` (None: unchanged) —
    or `fn(x, mesh) -> x` on the first positional argument."""

    fn: Callable

    def hooks(self, config, path, layer=None):
        if _takes_mesh_only(self.fn):
            return [functools.partial(_run_paddle_pre_hook, self.fn(config.mesh), layer)], []
        return [functools.partial(_run_first_input_fn, self.fn, config.mesh, path)], []


@dataclass(frozen=True, repr=False)
class PrepareLayerOutput(ParallelPlan):
    """Prepare the layer's result after each call: Paddle's `fn(process_mesh)` returning a
    post-hook `hook(layer, inputs, output) -> output`, or `fn(out, mesh) -> out`."""

    fn: Callable

    def hooks(self, config, path, layer=None):
        if _takes_mesh_only(self.fn):
            return [], [functools.partial(_run_paddle_post_hook, self.fn(config.mesh), layer)]
        return [], [functools.partial(_run_output_fn, self.fn, config.mesh)]


def _takes_mesh_only(fn: Callable) -> bool:
    """Paddle's PrepareLayerInput / Output functions take exactly one argument, the mesh."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 1 and not any(p.kind is p.VAR_POSITIONAL for p in params)


def _run_paddle_pre_hook(hook: Callable, layer: Any, args: tuple) -> tuple:
    out = hook(layer, args)
    return args if out is None else _as_args(out)


def _run_paddle_post_hook(hook: Callable, layer: Any, out: Any) -> Any:
    # Paddle hands a post-hook the layer's inputs too; the call's inputs are past by now, and
    # PaddleNLP's hooks read only the output
    new = hook(layer, (), out)
    return out if new is None else new


def _on_first(hook: Callable) -> Callable:
    """An input hook that applies `hook` to the first positional argument."""
    def run(args: tuple) -> tuple:
        return (hook(args[0]),) + args[1:] if args else args
    return run


def _activation_hint(config: ParallelConfig, split_dim: int | None, path: str, kind: str,
                     x: Any) -> Any:
    """`x` placed with its batch (dim 0) over dp and `split_dim` over mp (None: whole over mp)."""
    if not isinstance(x, jax.core.Tracer):
        return x  # a placement hint means something only while dist.jit traces
    split = {config.mp_dim: split_dim} if split_dim is not None and x.ndim else {}
    placements = _hint_placements(config, x, split)
    layout = layout_from_placements(placements, config.mesh, tuple(x.shape), what=(
        f"the activations of layer {path!r} ({kind}, [batch, seq, ...])"))
    return _placed_hint(x, layout, config.mesh, f"{kind} on layer {path!r}")


def _hint_placements(config: ParallelConfig, x: Any, split: dict) -> list[Placement]:
    """Per mesh dim of an activation hint: the tensor dim `split` names for it (None: whole),
    else the batch over dp where it divides, else Replicate."""
    mesh = config.mesh
    placements: list[Placement] = []
    for name in mesh.dim_names:
        if name in split:
            d = split[name]
            placements.append(Replicate() if d is None else Shard(d % x.ndim))
        elif name == config.dp_dim and x.ndim and x.shape[0] % mesh.get_dim_size(name) == 0:
            # Keep the batch split over dp as data parallelism left it; a Replicate hint there
            # would make the plan gather the whole batch at every sequence-parallel boundary.
            placements.append(Shard(0))
        else:
            placements.append(Replicate())
    return placements


_PLAN_NAMES = ("ColWiseParallel(), RowWiseParallel(), SequenceParallelBegin(), "
               "SequenceParallelEnd(), SequenceParallelEnable(), SequenceParallelDisable(), "
               "PrepareLayerInput(fn), PrepareLayerOutput(fn), ContextParallel(), "
               "PrepareContextParallel()")


# ------------------------------------------------------------------------------- parallelize
def parallelize(model: Any, optimizer: Any = None, mesh: ProcessMesh | None = None,
                config: Mapping[str, Any] | None = None) -> Any:
    """Place `model` on `mesh` as Paddle's dist.parallelize `config` says.

    config = {"dp_config": {"sharding_level": 0-3}, "mp_config": {"parallelize_plan":
    {pattern: plan or [plans]}}}. A pattern is matched (fnmatch, case-sensitive) against the
    dotted path of every submodule ("" is the root) and parameter ("up.kernel"); `*` also
    matches dots, so "*.qkv" finds "layers.0.attn.qkv". A plan on a module applies to its own
    parameters (not its children's). Parameters no plan places are replicated.

    Mesh dims: mp is mp_config["mesh_dim"] if given, else "mp" if the mesh has it, else its last
    dim; dp is dp_config["mesh_dim"], else "dp", else the first dim. `mesh` defaults to the mesh
    of the model's DistTensor parameters. dp sharding_level picks the optimizer's ZeRO stage
    (0: none, 1-3: dist.ShardingStage1-3 over dp) and, for an nnx model, is recorded with the
    dims as `model._autoshard_parallel` (a ParallelConfig).

    An nnx model is changed in place; a linen params tree comes back as a new tree. Returns
    (model, optimizer) when `optimizer` is given (wrapped by dist.shard_optimizer), else model.
    """
    nnx = _nnx()
    is_nnx = isinstance(model, nnx.Module)
    if not is_nnx and not isinstance(model, Mapping):
        raise ParallelizeError(
            f"parallelize takes a flax nnx.Module or a linen params dict, got "
            f"{type(model).__name__}: for a linen Module pass `model.init(key, x)` (its params)")
    mesh = _model_mesh(model, mesh, is_nnx)
    level, dp_named, mp_named, plan = _read_config(config)
    pp = (config or {}).get("pp_config")
    if pp is not None and not is_nnx:
        raise ParallelizeError("pp_config needs an nnx Module: its layers are cut into stages "
                               "and the first layer of each stage moves its inputs on")
    # with a pipeline, each stage lives on its slice of the mesh's pp dim (dp and mp inside)
    stage_meshes = _stage_meshes(mesh, dict(pp)) if pp is not None else [mesh]
    if pp is not None and is_nnx:
        _check_global_spec(pp.get("global_spec"), _nnx_modules(model))

    if is_nnx:
        modules, params = _nnx_modules(model), _nnx_params(model)
        shapes = {p: tuple(v.get_value().shape) for p, v in params.items()}
    else:
        modules, shapes = _tree_paths(model)
    targets = _match(plan, modules, shapes)
    decided = _resolve_dims(stage_meshes[0], dp_named, mp_named, level, targets)

    placements = _param_placements(targets, shapes, decided, modules)
    if is_nnx:
        stage_of, starts = _module_stages(model, modules, pp, len(stage_meshes))

        def stage(path: str) -> int:
            return stage_of.get(path, 0)

        for path, param in params.items():  # model chunk c lives on pp rank c mod pp
            home = stage_meshes[stage(_parent(path)) % len(stage_meshes)]
            pl = placements.get(path, [Replicate()] * home.ndim)
            param.set_value(_placed(param, home, path) if path not in placements
                            else shard_tensor(param.get_value(), home, pl))
        for path, hook_plans in targets.hooks.items():
            ins, outs = [], []
            here = replace(decided, mesh=stage_meshes[stage(path) % len(stage_meshes)])
            for p in hook_plans:
                i, o = p.hooks(here, path, modules[path])
                ins += i
                outs += o
            _add_hooks(modules[path], path, ins, outs)
        for path in starts:  # the first layer of each later stage moves its inputs there
            _add_hooks(modules[path], path, [functools.partial(
                move_inputs, stage_meshes[stage(path) % len(stage_meshes)], decided.dp_dim)])
        model._autoshard_parallel = replace(
            decided, stage_meshes=tuple(stage_meshes) if pp is not None else (),
            stages=len(starts) + 1 if pp is not None else 0,
            split_spec=pp.get("split_spec") if pp is not None else None)
    else:
        if targets.hooks:
            path, plans = next(iter(targets.hooks.items()))
            raise ParallelizeError(
                f"{type(plans[0]).__name__} on {path!r} needs an nnx module: a linen params tree "
                f"is never called; annotate activations with dist.shard_tensor inside the linen "
                f"module's __call__ instead")

        def by_parent(name: str, subtree: Mapping, _mesh: ProcessMesh) -> dict:
            paths = {k: f"{name}.{k}" if name else str(k) for k in subtree}
            return {k: placements[p] for k, p in paths.items() if p in placements}

        model = shard_layer(model, mesh, by_parent)
    if optimizer is None:
        return model
    return model, _wrap_optimizer(optimizer, decided)


def _check_global_spec(spec: Any, modules: Mapping[str, Any]) -> None:
    """Paddle's pp_config["global_spec"] names the layer whose outputs every stage reads
    (PaddleNLP's `llama.global_layer`: position ids, masks). It runs on the stage it is
    defined in, and each later stage's first layer moves the arguments it is handed onto its
    own mesh, so its outputs reach every stage that reads them; nothing else to do but check
    the name."""
    if spec is None:
        return
    if not isinstance(spec, str) or spec not in modules:
        raise ParallelizeError(
            f"pp_config['global_spec'] {spec!r} names no layer: give the dotted path of the "
            f"layer whose outputs every stage reads, one of {sorted(modules)[:8]} ...")


def _stage_meshes(mesh: ProcessMesh, pp: dict) -> list[ProcessMesh]:
    unknown = set(pp) - {"split_spec", "mesh_dim", "global_spec"}
    if unknown or "split_spec" not in pp:
        raise ParallelizeError(f"config['pp_config'] takes 'split_spec' (a layer-list path or "
                               f"{{layer: dist.SplitPoint}}) and optionally 'mesh_dim' and "
                               f"'global_spec', got {sorted(pp)}")
    dim = pp.get("mesh_dim", "pp")
    if dim not in mesh.dim_names:
        raise ParallelizeError(f"pp_config splits the model over mesh dim {dim!r}, but the mesh "
                               f"has dims {mesh.dim_names}: build it with a 'pp' dim, e.g. "
                               f"dist.ProcessMesh(np.arange(8).reshape(2, 2, 2), "
                               f"dim_names=['pp', 'dp', 'mp']), or name it in "
                               f"pp_config['mesh_dim']")
    return [mesh.get_mesh_with_dim(dim, s) for s in range(mesh.get_dim_size(dim))]


def _module_stages(model: Any, modules: Mapping[str, Any], pp: Mapping | None,
                   stages: int) -> tuple[dict[str, int], list[str]]:
    """Each layer's pipeline stage, and the first layer of each stage after the first."""
    if pp is None:
        return {}, []
    order = definition_order(model)
    starts = stage_starts(order, dict(modules), pp["split_spec"], stages)
    return module_stages(order, starts), starts


def _wrap_optimizer(optimizer: Any, config: ParallelConfig) -> Any:
    try:
        from .optimizer import ShardingStage1, ShardingStage2, ShardingStage3, shard_optimizer
    except ImportError:
        return optimizer  # no optimizer layer in this install: its states stay as optax makes them
    stage = {1: ShardingStage1, 2: ShardingStage2, 3: ShardingStage3}.get(config.sharding_level)
    # no mesh of its own: with pipeline stages each param's states follow its own stage mesh
    return shard_optimizer(optimizer, stage(config.dp_dim) if stage else None)


def _model_mesh(model: Any, mesh: ProcessMesh | None, is_nnx: bool) -> ProcessMesh:
    if mesh is not None:
        return as_process_mesh(mesh)
    values = ([v.get_value() for v in _nnx_params(model).values()] if is_nnx
              else jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, DistTensor)))
    for v in values:
        if isinstance(v, DistTensor):
            return v.mesh
    if get_mesh() is not None:  # Paddle's best practice: dist.auto_parallel.set_mesh first
        return get_mesh()
    raise ParallelizeError("parallelize needs a mesh: pass mesh=dist.ProcessMesh([[0, 1, 2, 3], "
                           "[4, 5, 6, 7]], dim_names=['dp', 'mp']), or call "
                           "dist.auto_parallel.set_mesh(mesh) first")


def _read_config(config: Mapping[str, Any] | None
                 ) -> tuple[int, Any, Any, list[tuple[str, ParallelPlan]]]:
    config = dict(config or {})
    known = {"dp_config": {"sharding_level", "mesh_dim"},
             "mp_config": {"parallelize_plan", "mesh_dim"},
             "cp_config": {"parallelize_plan"},  # context parallel plans, as in mp_config
             "pp_config": {"split_spec", "mesh_dim", "global_spec"}}
    for key, section in config.items():
        if key not in known:
            raise ParallelizeError(f"unknown parallelize config key {key!r}: the keys are "
                                   f"{sorted(known)}")
        if not isinstance(section, Mapping) or set(section) - known[key]:
            raise ParallelizeError(f"config[{key!r}] must be a dict with keys from "
                                   f"{sorted(known[key])}, got {section!r}")
    dp, mp = config.get("dp_config", {}), config.get("mp_config", {})
    level = dp.get("sharding_level", 0)
    if level not in (0, 1, 2, 3) or isinstance(level, bool):
        raise ParallelizeError(f"dp_config['sharding_level'] is {level!r}: write 0 (no sharding), "
                               f"1 (optimizer states), 2 (+ gradients) or 3 (+ parameters)")
    entries: list[tuple[str, ParallelPlan]] = []
    plans = [("mp_config", mp.get("parallelize_plan", {})),
             ("cp_config", config.get("cp_config", {}).get("parallelize_plan", {}))]
    for key, plan in plans:
        if not isinstance(plan, Mapping):
            raise ParallelizeError(f"{key}['parallelize_plan'] must be a dict {{pattern: plan}}, "
                                   f"got {type(plan).__name__}")
    for pattern, value in [item for _, plan in plans for item in plan.items()]:
        for p in (value if isinstance(value, (list, tuple)) else [value]):
            if not isinstance(p, ParallelPlan):
                raise ParallelizeError(
                    f"parallelize_plan[{pattern!r}] is {p!r} ({type(p).__name__}), not a plan: "
                    f"write one of {_PLAN_NAMES}, or a list of them")
            entries.append((str(pattern), p))
    return level, dp.get("mesh_dim"), mp.get("mesh_dim"), entries


def _tree_paths(tree: Mapping, path: tuple[str, ...] = ()) -> tuple[dict, dict[str, tuple]]:
    """Every sub-dict by dotted path (the 'modules' of a linen tree) and every array's shape."""
    modules, shapes = {_dotted(path): tree}, {}
    for key, value in tree.items():
        sub = path + (str(key),)
        if isinstance(value, Mapping):
            m, s = _tree_paths(value, sub)
            modules |= m
            shapes |= s
        else:
            shapes[_dotted(sub)] = tuple(value.shape)
    return modules, shapes


@dataclass
class _Targets:
    params: dict[str, tuple[str, ParallelPlan]]     # param path -> (pattern, plan)
    hooks: dict[str, list[ParallelPlan]]            # module path -> hook plans, in plan order


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _match(entries, modules: Mapping[str, Any], shapes: Mapping[str, tuple]) -> _Targets:
    targets = _Targets({}, {})
    for pattern, plan in entries:
        hit_modules = [m for m in modules if fnmatchcase(m, pattern)]
        if not hit_modules and not any(fnmatchcase(p, pattern) for p in shapes) \
                and "params" in modules:
            # a linen variables dict: the plan may be written as for the module ('layers.up'),
            # without the 'params' collection its paths start with
            pattern = "params." + pattern
            hit_modules = [m for m in modules if fnmatchcase(m, pattern)]
        names = _flax_names(pattern, shapes)
        if plan.places_params:
            hits = {p for p in shapes if any(fnmatchcase(p, n) for n in names)}
            hits |= {p for p in shapes if _parent(p) in hit_modules}
            for p in sorted(hits):
                if p in targets.params and targets.params[p][1] != plan:
                    other, prev = targets.params[p]
                    raise ParallelizeError(
                        f"parameter {p!r} gets {prev!r} from pattern {other!r} and {plan!r} from "
                        f"pattern {pattern!r}: make the patterns select disjoint parameters")
                targets.params[p] = (pattern, plan)
            if plan.wants_hooks:  # around the layers it placed ('lm_head' or 'lm_head.weight')
                for m in sorted(set(hit_modules) | {_parent(p) for p in hits}):
                    targets.hooks.setdefault(m, []).append(plan)
        else:
            hits = set(hit_modules)
            for m in hit_modules:
                targets.hooks.setdefault(m, []).append(plan)
        if not hits and hit_modules:
            subs = sorted(p for p in shapes if any(p.startswith(m + ".") for m in hit_modules))
            inner = sorted({_parent(p)[len(m) + 1:] for p in subs for m in hit_modules
                            if p.startswith(m + ".")} - {""})
            raise ParallelizeError(
                f"parallelize_plan pattern {pattern!r} matches the layer(s) "
                f"{hit_modules[:4]}{' ...' if len(hit_modules) > 4 else ''}, which hold no "
                f"parameters of their own, so {plan!r} has nothing to split: name the layers "
                f"inside that hold them"
                + (f", e.g. {pattern + '.' + inner[0]!r} (its sub-layers: {inner[:6]})"
                   if inner else ""))
        if not hits:
            kind = "layer or parameter" if plan.places_params else "layer"
            raise ParallelizeError(
                f"parallelize_plan pattern {pattern!r} matches no {kind}"
                f"{did_you_mean(pattern, _known_names(modules, shapes))}: the layers are "
                f"{sorted(modules)[:12]}{' ...' if len(modules) > 12 else ''} (patterns are "
                f"fnmatch on dotted paths, e.g. 'layers.*.mlp.up' or '*.qkv')")
    return targets


# Paddle names a layer's matrix `weight`; flax calls it `kernel` (Linear, Conv), `embedding`
# (Embed) or `scale` (norms). A plan written for Paddle ('lm_head.weight') finds flax's.
_PADDLE_PARAM_NAMES = {"weight": ("kernel", "embedding", "scale")}


def _known_names(modules: Mapping[str, Any], shapes: Mapping[str, tuple]) -> list[str]:
    """What a pattern may name, for a "did you mean": the layers, the params, and the params
    by their Paddle names (a misspelt 'up_proj.wieght' is nearest to 'up_proj.weight')."""
    paddle = [f"{_parent(p)}.{alias}" for p in shapes for alias, flax in
              _PADDLE_PARAM_NAMES.items() if p.rpartition(".")[2] in flax]
    return [m for m in modules if m] + list(shapes) + paddle


def _flax_names(pattern: str, shapes: Mapping[str, tuple]) -> tuple[str, ...]:
    """`pattern`, with a Paddle parameter name that matches nothing as every flax name it may
    be ('*.weight': the Linear kernels and the Embed tables and the norms' scales it reaches);
    unchanged otherwise (the error then names the original)."""
    head, dot, last = pattern.rpartition(".")
    if last not in _PADDLE_PARAM_NAMES or any(fnmatchcase(p, pattern) for p in shapes):
        return (pattern,)
    found = tuple(f"{head}{dot}{name}" for name in _PADDLE_PARAM_NAMES[last]
                  if any(fnmatchcase(p, f"{head}{dot}{name}") for p in shapes))
    return found or (pattern,)


def _resolve_dims(mesh: ProcessMesh, dp_named: Any, mp_named: Any, level: int,
                  targets: _Targets) -> ParallelConfig:
    first = next(iter(targets.params), None) or next(iter(targets.hooks), None)
    users = f" (the plan would shard {first!r} over it)" if first is not None else ""

    def pick(named: Any, default: str, fallback: str, key: str) -> str:
        if named is None:
            return default if default in mesh.dim_names else fallback
        if named not in mesh.dim_names:
            raise ParallelizeError(
                f"{key}['mesh_dim'] is {named!r}, but the mesh has dims {mesh.dim_names}"
                f"{users if key == 'mp_config' else ''}: name one of them, or build the mesh with "
                f"dim_names=['dp', 'mp']")
        return named

    dp = pick(dp_named, "dp", mesh.dim_names[0], "dp_config")
    mp = pick(mp_named, "mp", mesh.dim_names[-1], "mp_config")
    if dp == mp and level > 0 and first is not None:
        # (the mesh may have two dims already: then a mesh_dim named the same dim for both)
        named = [f"{k}['mesh_dim'] = {n!r}" for k, n in (("dp_config", dp_named),
                                                         ("mp_config", mp_named)) if n]
        fix = (f"name another dim of {mesh.dim_names} in {' or '.join(named)}, or leave it out"
               if named and len(mesh.dim_names) > 1 else
               f"give the mesh a 'dp' and an 'mp' dim, e.g. dist.ProcessMesh([[0, 1, 2, 3], "
               f"[4, 5, 6, 7]], dim_names=['dp', 'mp'])")
        raise ParallelizeError(
            f"data parallel (sharding_level {level}) and model parallel{users} both fall on mesh "
            f"dim {mp!r} of {mesh!r}: {fix}")
    return ParallelConfig(mesh, dp, mp, level)


_QKV_NAMES = (frozenset({"query", "key", "value"}), frozenset({"q_proj", "k_proj", "v_proj"}))


def _features(modules: Mapping[str, Any], path: str, ndim: int) -> tuple | None:
    """(first input-feature dim, first output-feature dim) of parameter `path` (of `ndim`
    dims) of a linear layer (kernel: batch dims, input features, output features; bias: batch
    dims, output features): from the nnx module — whose params may carry leading layer dims
    (layers made by nnx.vmap and applied by nnx.scan), so dims are counted from the end — or
    in a linen params dict from a kernel whose trailing dims are its bias's (no batch dims; the
    inputs of a multi-dim kernel are known for attention's output projection only); None for
    anything else."""
    module = modules.get(_parent(path))
    name = path.rpartition(".")[2]
    if isinstance(module, Mapping):  # a linen params dict: the bias says where outputs start
        kernel, bias = (tuple(np.shape(module.get(k))) if k in module else None
                        for k in ("kernel", "bias"))
        # an attention block's projections, by flax's names or PaddleNLP's
        owner = modules.get(_parent(_parent(path)))
        siblings = set(owner) if isinstance(owner, Mapping) else set()
        qkv = next((names for names in _QKV_NAMES if names <= siblings), None)
        if kernel is not None and bias is None and qkv is not None and len(kernel) == 3:
            # no bias to tell: q / k / v (in, heads, head_dim), the output (heads, head_dim, out)
            layer = _parent(path).rpartition(".")[2]
            return {"kernel": (0, 1) if layer in qkv else (0, 2)}.get(name)
        if kernel is None or bias is None or not bias or len(bias) >= len(kernel):
            return None
        # `stack` leading dims shared by kernel and bias: layers stacked by nn.scan / nn.vmap
        stack = next((k for k in range(len(bias)) if kernel[:k] == bias[:k]
                      and kernel[len(kernel) - len(bias) + k:] == bias[k:]), None)
        if stack is None:
            return None
        outputs = len(kernel) - len(bias) + stack
        # inputs start at 0 only for attention's output projection (its siblings are query,
        # key, value): a 1-d conv kernel (width, in, out) has the same shape
        inputs = stack if qkv is not None else (len(kernel) - 2 if not stack else outputs - 1)
        return {"kernel": (inputs, outputs), "bias": (None, stack)}.get(name)
    nnx = _nnx()
    if isinstance(module, nnx.LinearGeneral):
        nb, ni = len(module.batch_axis), len(module.in_features)
        no = len(module.out_features)
        if name == "kernel":
            first = ndim - (nb + ni + no) + nb  # past any stacked layer dims and the batch dims
            return first, first + ni
        return (None, ndim - no) if name == "bias" else None
    if isinstance(module, (nnx.Linear, nnx.Embed)):
        # kernel (in, out) / embedding (vocab, features); a bias (out,): the last dims
        if name in ("kernel", "embedding") and ndim >= 2:
            return ndim - 2, ndim - 1
        return (None, ndim - 1) if name == "bias" and ndim >= 1 else None
    return None


def _param_placements(targets: _Targets, shapes: Mapping[str, tuple], config: ParallelConfig,
                      modules: Mapping[str, Any]) -> dict[str, list[Placement]]:
    mesh, mp, out = config.mesh, config.mp_dim, {}
    named: dict[str, tuple] = {}  # pattern -> (its plan, the params it names)
    split: set = set()  # the patterns that split one of them
    for path, (pattern, plan) in targets.params.items():
        named.setdefault(pattern, (plan, []))[1].append(path)
        ndim = len(shapes[path])
        dim = plan.feature_dim(ndim, _features(modules, path, ndim))
        if dim is None:
            continue
        split.add(pattern)
        placements = [Shard(dim) if n == mp else Replicate() for n in mesh.dim_names]
        # Checked here so that errors and warnings name the parameter and the pattern.
        what = (f"parameter {path!r} (Shard({dim}) on mesh dim {mp!r}, from {plan!r} for "
                f"pattern {pattern!r})")
        layout = layout_from_placements(placements, mesh, shapes[path], what=what)
        if is_uneven(layout, mesh, shapes[path]):
            warn_uneven(layout, mesh, shapes[path], what,
                        f"is stored split (padded) but computed whole, gathered at every step; "
                        f"or drop {path!r} from pattern {pattern!r} of the parallelize_plan")
        out[path] = placements
    for pattern, (plan, paths) in named.items():
        if pattern in split:
            continue
        # (a plan that splits none of what its pattern names does nothing: Paddle refuses a
        # Col/RowWiseParallel on a layer that is neither a Linear nor an Embedding)
        raise ParallelizeError(
            f"parallelize_plan[{pattern!r}] = {plan!r} splits none of the parameters it names "
            f"({', '.join(repr(p) for p in paths[:6])}: a {plan.__class__.__name__} splits a "
            f"Linear's or an Embedding's weight): name the Linear / Embedding layer (or its "
            f"weight), or drop {pattern!r} from the plan")
    return out


__all__ = ["shard_layer", "parallelize", "ParallelPlan", "ColWiseParallel", "RowWiseParallel",
           "SequenceParallelBegin", "SequenceParallelEnd", "SequenceParallelEnable",
           "SequenceParallelDisable", "ContextParallel", "PrepareContextParallel", "PrepareLayerInput",
           "PrepareLayerOutput", "ParallelConfig", "ParallelizeError"]
