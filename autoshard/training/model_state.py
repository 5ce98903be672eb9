"""How to_static sees a model: a pure function of (params, state, inputs) returning the outputs
and the new state, for flax nnx Modules, linen (Module or module.apply, variables) pairs and
(apply_fn, params) pairs.

`state` is everything of an nnx Module that is not an nnx.Param but changes when it runs —
BatchNorm's running statistics, the counters of nnx.Rngs streams (dropout) — so the compiled
step takes it in, returns its new value, and the DistModel writes it back into the Module.
PRNG keys travel as their raw key data (uint32), which a DistTensor can hold; they are wrapped
into typed keys again inside the program and when written back.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..dtensor import is_dist_tensor as _is_dt
from ..errors import AutoshardError

# Attributes flax's Module.train() / Module.eval() set, by DistModel mode.
_MODE_ATTRIBUTES = {
    "train": {"deterministic": False, "use_running_average": False},
    "eval": {"deterministic": True, "use_running_average": True},
}


class DistModelError(AutoshardError, ValueError):
    """A model, batch or mode that to_static cannot work with."""



def exact_cast(value: Any, dtype: Any) -> np.ndarray | None:
    """`value` (a number or host array) as `dtype` when every element keeps its value there
    (an integer in range, a float that is a whole number for an integer dtype), else None:
    numpy's cast would wrap 2**32 + 10 to 10 in int32, or cut 2.7 to 2, silently."""
    x = np.asarray(value)
    dtype = np.dtype(dtype)
    if x.dtype == object or not (np.issubdtype(x.dtype, np.number) or x.dtype == bool):
        return None
    if not np.issubdtype(dtype, np.integer) or x.size == 0:
        return x.astype(dtype)
    if np.issubdtype(x.dtype, np.complexfloating):
        return None
    if np.issubdtype(x.dtype, np.floating) and not (np.isfinite(x).all() and (x == np.round(x)).all()):
        return None
    info = np.iinfo(dtype)
    # compared as Python ints: numpy's mixed int64 / uint64 comparisons go through float64
    low, high = (int(v) for v in (x.min(), x.max()))
    return x.astype(dtype) if info.min <= low and high <= info.max else None


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def flatten_dict(tree: dict, prefix: tuple = ()) -> dict[tuple, Any]:
    """{path tuple: leaf} of a nested dict (nnx's pure dicts), stopping at non-dicts."""
    out: dict[tuple, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten_dict(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


def unflatten_dict(flat: dict[tuple, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


@dataclass
class ModelParts:
    """A model taken apart: `apply(mode, params, state, *inputs) -> (outputs, new_state)`."""

    params: Any
    state: dict
    apply: Callable[..., tuple[Any, dict]]
    write_back: Callable[[Any, dict], None] = lambda params, state: None
    # The tensor shape of each param by a path comparable with the state's (sibling_param), to
    # place a state leaf like its params; `param_of` maps such a path to the param's own path.
    param_paths: dict[tuple, Any] = field(default_factory=dict)
    param_of: Callable[[tuple], tuple] = lambda path: path


# ------------------------------------------------------------------------------------ nnx
class _KeyCodec:
    """PRNG keys in the state as raw key data (and back), remembering each key's impl."""

    def __init__(self, state: dict):
        self.impls = {path: jax.random.key_impl(leaf) for path, leaf in flatten_dict(state).items()
                      if _is_key(leaf)}

    def encode(self, state: dict) -> dict:
        flat = flatten_dict(state)
        return unflatten_dict({p: jax.random.key_data(v) if p in self.impls and _is_key(v) else v
                               for p, v in flat.items()})

    def decode(self, state: dict, to_array: Callable[[Any], Any] = lambda v: v) -> dict:
        flat = flatten_dict(state)
        return unflatten_dict({p: jax.random.wrap_key_data(to_array(v), impl=self.impls[p])
                               if p in self.impls else v for p, v in flat.items()})


def _keep_structure(old: dict, new: dict) -> dict:
    """The new state on the old state's paths and dtypes.

    A step must return what it took (one compiled program, written back leaf by leaf); values
    a module adds while running (sown intermediates) are not state, and a dtype promoted by
    mixed precision is cast back to the stored one.
    """
    new_flat = flatten_dict(new)
    out = {}
    for path, before in flatten_dict(old).items():
        after = new_flat.get(path, before)
        if hasattr(after, "dtype") and hasattr(before, "dtype") and after.dtype != before.dtype:
            after = after.astype(before.dtype)
        out[path] = after
    return unflatten_dict(out)


def _set_attribute(node: Any, path: tuple, value: Any) -> None:
    """Set the plain (non-Variable) attribute at nnx graph `path`: attributes by name, list
    and dict entries by key. (nnx.update would walk into a DistTensor already set there, a
    pytree to it.)"""
    def child(n, key):
        return getattr(n, key) if isinstance(key, str) and hasattr(n, key) else n[key]

    for key in path[:-1]:
        node = child(node, key)
    key = path[-1]
    if isinstance(key, str) and hasattr(node, key):
        setattr(node, key, value)
    else:
        node[key] = value


def _nnx_parts(model: Any) -> ModelParts:
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rest_pure = nnx.to_pure_dict(rest)
    codec = _KeyCodec(rest_pure)
    graphdefs = {mode: nnx.split(nnx.with_attributes(model, raise_if_not_found=False, **attrs),
                                 nnx.Param, ...)[0]
                 for mode, attrs in _MODE_ATTRIBUTES.items()}

    def apply(mode: str, params: Any, state: dict, *inputs: Any) -> tuple[Any, dict]:
        module = nnx.merge(graphdefs.get(mode, graphdef), nnx.State(params),
                           nnx.State(codec.decode(state)))
        out = module(*_checked_inputs(module.__call__, inputs, params_first=False))
        new_state = codec.encode(nnx.to_pure_dict(nnx.split(module, nnx.Param, ...)[2]))
        return out, _keep_structure(state, new_state)

    # The Module's own Variable objects by path: setting their values is ~100x cheaper than
    # nnx.update, and write_back runs after every step.
    variables = {path: node for path, node in nnx.iter_graph(model)
                 if isinstance(node, nnx.Variable)}

    def write_back(params: Any, state: dict) -> None:
        for path, value in flatten_dict(params).items():
            variables[path].set_value(value)
        plain = {}  # arrays held as plain attributes (a RoPE table, a mask): no Variable
        for path, value in flatten_dict(state).items():
            if path in codec.impls:  # a DistTensor cannot hold a key dtype: a typed jax array
                value = jax.random.wrap_key_data(value.physical if _is_dt(value) else value,
                                                 impl=codec.impls[path])
            node = variables.get(path)
            if node is None:
                plain[path] = value
            else:
                node.set_value(value)
        for path, value in plain.items():
            # kept a jax.Array, as nnx filed it (a DistTensor there would be a pytree node to
            # nnx, no longer state): the logical value, laid out as the step left it
            _set_attribute(model, path, jnp.asarray(value) if _is_dt(value) else value)

    param_shapes = {path: np.shape(v) for path, v in flatten_dict(nnx.to_pure_dict(params)).items()}
    return ModelParts(nnx.to_pure_dict(params), codec.encode(rest_pure), apply, write_back,
                      param_shapes)


# ---------------------------------------------------------------------------------- linen
# The call arguments by which linen modules conventionally switch between training and
# inference, and the value each takes in training.
_LINEN_MODE_ARGUMENTS = {"train": True, "training": True, "deterministic": False,
                         "use_running_average": False}


def _linen_module(model: Any) -> Any:
    """The linen Module of `(module, variables)` or `(module.apply, variables)`, else None."""
    try:
        from flax import linen
    except ImportError:  # pragma: no cover - flax is a dependency
        return None
    head = model[0]
    owner = getattr(head, "__self__", None)  # a bound `module.apply`
    if isinstance(head, linen.Module):
        return head
    # `module.apply` with only params keeps the plain pair's meaning (apply_fn(variables, x)):
    # its params tree, and so its state_dict names, stay what they were.
    has_state = isinstance(model[1], dict) and bool(set(model[1]) - {"params"})
    if isinstance(owner, linen.Module) and getattr(head, "__name__", "") == "apply" and has_state:
        return owner
    return None


# The train-step counter of a linen model given RNG keys: step k draws from fold_in(key, k).
RNG_STEP = "rng_step"


def _linen_parts(module: Any, variables: Any, rngs: Any = None) -> ModelParts:
    """params = variables['params']; state = every other collection (batch_stats, ...).

    In training the step runs with the state collections mutable and returns their new value;
    in eval and predict they are read only. A mode argument of the module's __call__ (`train`,
    `deterministic`, `use_running_average`) is set by the DistModel's mode unless given.
    `rngs` ({name: key}, as for `module.apply`): train step k runs with
    `{name: fold_in(key, k)}` — the counter is state too (`state.rng_step`), so a loaded
    checkpoint goes on drawing where it stopped; eval and predict draw nothing.
    """
    import inspect

    from flax.errors import InvalidRngError

    if not isinstance(variables, dict) or "params" not in variables:
        raise DistModelError(
            f"to_static((module, variables)): variables must be the dict model.init returns, "
            f"with a 'params' collection; got {type(variables).__name__} with keys "
            f"{sorted(variables) if isinstance(variables, dict) else '-'}")
    collections = {k: v for k, v in variables.items() if k != "params"}
    keys = _rng_key_data(rngs)
    state = dict(collections, **({RNG_STEP: np.zeros((), np.uint32)} if keys else {}))
    accepted = inspect.signature(type(module).__call__).parameters
    flags = {name: train for name, train in _LINEN_MODE_ARGUMENTS.items() if name in accepted}

    def apply(mode: str, params: Any, state: dict, *inputs: Any) -> tuple[Any, dict]:
        training = mode == "train"
        kwargs = {name: (train if training else not train) for name, train in flags.items()}
        mutable = {k: v for k, v in state.items() if k != RNG_STEP}
        if training and keys:
            step = state[RNG_STEP]
            kwargs["rngs"] = {name: jax.random.fold_in(jax.random.wrap_key_data(data, impl=impl),
                                                       step)
                              for name, (data, impl) in keys.items()}
        try:
            if training and mutable:
                out, new = module.apply({"params": params, **mutable}, *inputs,
                                        mutable=list(mutable), **kwargs)
                new = _keep_structure(mutable, dict(new))
            else:
                out, new = module.apply({"params": params, **mutable}, *inputs, **kwargs), mutable
        except InvalidRngError as error:
            raise DistModelError(
                f"{type(module).__name__} draws random numbers in training ({error}): give "
                f"to_static its keys as flax's apply takes them, dist.to_static((module, "
                f"variables, {{'dropout': jax.random.key(0)}}), ...); train step k then uses "
                f"fold_in(key, k)") from None
        if keys:
            new = dict(new, **{RNG_STEP: state[RNG_STEP] + np.uint32(training)})
        return out, new

    # A collection's leaf is placed like the param of the same module and shape (BatchNorm's
    # mean beside its scale): state paths start with the collection's name, params' do not.
    params_flat = flatten_dict(variables["params"])
    param_paths = {(col, *path): np.shape(v) for col in state for path, v in params_flat.items()}
    return ModelParts(variables["params"], state, apply, param_paths=param_paths,
                      param_of=lambda path: path[1:])


def _rng_key_data(rngs: Any) -> dict:
    """{name: raw key data} of the keys a linen model's apply takes (typed or raw keys)."""
    if rngs is None:
        return {}
    if not isinstance(rngs, dict) or not rngs:
        raise DistModelError(f"to_static((module, variables, rngs)): rngs must be a dict "
                             f"{{name: key}} as flax's apply takes, got {rngs!r}")
    out = {}
    for name, key in rngs.items():
        typed = jax.dtypes.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key)
        impl = jax.random.key_impl(key) if typed else None
        out[name] = (np.asarray(jax.random.key_data(key) if typed else key, np.uint32), impl)
    return out


# ---------------------------------------------------------------------------------- pairs
def split_model(model: Any) -> ModelParts:
    """ModelParts of an nnx Module, a linen (module, variables) pair or an (apply_fn, params) pair."""
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is a dependency
        nnx = None
    if nnx is not None and isinstance(model, nnx.Module):
        return _nnx_parts(model)
    if isinstance(model, tuple) and len(model) in (2, 3):
        module = _linen_module(model)
        if module is not None:
            return _linen_parts(module, model[1], model[2] if len(model) == 3 else None)
        if len(model) == 3:
            raise DistModelError(
                f"to_static((module, variables, rngs)) takes a linen Module first, got "
                f"{type(model[0]).__name__}")
    if isinstance(model, tuple) and len(model) == 2 and callable(model[0]):
        apply_fn, params = model
        return ModelParts(params, {}, lambda mode, p, s, *inputs: (
            apply_fn(p, *_checked_inputs(apply_fn, inputs)), s))
    raise DistModelError(
        f"to_static needs a flax nnx Module or an (apply_fn, params) pair, got "
        f"{type(model).__name__}: for linen write dist.to_static((module, variables), ...)")


def _checked_inputs(apply_fn: Any, inputs: tuple, params_first: bool = True) -> tuple:
    """`inputs` if apply_fn(params, *inputs) — `apply_fn(*inputs)` without `params_first`, an
    nnx Module's __call__ — fits its signature, else a DistModelError that says how a batch
    becomes arguments (a jax TypeError would name neither)."""
    try:
        inspect.signature(apply_fn).bind(*((None,) if params_first else ()), *inputs)
    except TypeError as e:
        name = getattr(apply_fn, "__qualname__", None) or getattr(
            apply_fn, "__name__", type(apply_fn).__name__)
        call = f"{name}(params, *inputs)" if params_first else f"{name}(*inputs)"
        # (predict runs the eval graph's mode: the message says both readings)
        raise DistModelError(
            f"to_static: {call} cannot take the batch's {len(inputs)} "
            f"input(s) ({e}): in train and eval mode every element of a batch but the last "
            f"(the label) is an input, in predict mode every element is; make the batch "
            f"(inputs..., label) — (inputs...) for predict — or give {name} one parameter per "
            f"input") from None
    except ValueError:  # a builtin without a signature: call it as it is
        pass
    return inputs


def sibling_param(param_shapes: dict[tuple, Any], path: tuple, shape: tuple) -> tuple | None:
    """The path of an nnx.Param in the same module as state `path` with the same shape.

    BatchNorm's running mean and var live next to its scale and bias: they are placed like
    them, so a feature dim split over a mesh dim stays split in the statistics too.
    """
    for candidate, candidate_shape in param_shapes.items():
        if candidate[:-1] == path[:-1] and tuple(candidate_shape) == tuple(shape):
            return candidate
    return None


__all__ = ["ModelParts", "DistModelError", "split_model", "sibling_param", "flatten_dict",
           "unflatten_dict"]
