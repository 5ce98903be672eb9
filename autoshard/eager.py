"""Eager mode (Paddle's dynamic graph): DistTensor operators, indexing, reductions and casts.

Each op is a small dist.jit program, cached per (op, static params), that keeps Partial results.
"""
from __future__ import annotations

import inspect
import operator
import threading
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util
from jax._src.lib import xla_client

from .compiler.jit import DistributedFunction, jit
from .dtensor import DistTensor
from .errors import (AutoshardError, OperandAxisError, OperandIndexError, OperandTypeError,
                     operand_error)

class _Programs(dict):
    """(op name, *static params) → its program, keyed by the params' values *and types*
    (`_typed`). dist.jit caches per input layouts and avals inside, so a second call of an op
    on tensors laid out the same way neither retraces nor replans."""

    def __getitem__(self, key: tuple) -> DistributedFunction:
        return super().__getitem__(_typed(key))

    def __setitem__(self, key: tuple, f: DistributedFunction) -> None:
        super().__setitem__(_typed(key), f)

    def __contains__(self, key: object) -> bool:
        return super().__contains__(_typed(key))

    def get(self, key: tuple, default: Any = None) -> Any:
        return super().get(_typed(key), default)


PROGRAMS: dict[tuple, DistributedFunction] = _Programs()

_CALLER = threading.local()  # the traceback of the eager call being traced, if any
_PY_SCALARS = (bool, int, float, complex)  # bool first: True is an int too
_ARRAY = object()  # an index array's slot in a getitem key (the array itself is an argument)

_BINARY: dict[str, Callable[..., Any]] = {
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "truediv": jnp.true_divide,
    "floordiv": jnp.floor_divide, "mod": jnp.remainder, "pow": jnp.power, "matmul": jnp.matmul,
    "and": jnp.bitwise_and, "or": jnp.bitwise_or, "xor": jnp.bitwise_xor,
    "lshift": jnp.left_shift, "rshift": jnp.right_shift, "divmod": jnp.divmod,
}
_COMPARE: dict[str, Callable[..., Any]] = {
    "lt": jnp.less, "le": jnp.less_equal, "gt": jnp.greater, "ge": jnp.greater_equal,
    "eq": jnp.equal, "ne": jnp.not_equal,
}
_UNARY: dict[str, Callable[..., Any]] = {
    "neg": jnp.negative, "pos": jnp.positive, "abs": jnp.abs, "invert": jnp.invert,
}
# jax.Array's array-valued properties
_PROPERTIES: dict[str, Callable[..., Any]] = {
    "real": jnp.real, "imag": jnp.imag, "mT": lambda x: jnp.swapaxes(x, -1, -2),
}
_REDUCE: dict[str, Callable[..., Any]] = {
    "sum": jnp.sum, "mean": jnp.mean, "max": jnp.max, "min": jnp.min, "prod": jnp.prod,
    "any": jnp.any, "all": jnp.all,
}


def _typed(x: Any) -> Any:
    """`x` with the type of every scalar in it: True == 1 == 1.0 as dict keys, but x[True] adds
    a dim where x[1] takes a row, and clip(1.0) promotes an int tensor that clip(1) keeps."""
    if isinstance(x, tuple):
        return tuple(_typed(v) for v in x)
    if isinstance(x, slice):
        return slice, _typed(x.start), _typed(x.stop), _typed(x.step)
    if isinstance(x, (*_PY_SCALARS, np.generic)):
        return type(x), x
    return x


def program(key: tuple, make: Callable[[], Callable[..., Any]]) -> DistributedFunction:
    """The cached program of `key` = (op name, *static params), built by `make()` once."""
    f = PROGRAMS.get(key)
    if f is None:
        fn = make()

        def traced(*args: Any) -> Any:
            # jax cuts a traceback at its API boundary, so every equation would be attributed
            # to this file; the caller's traceback puts the user's line in plans and warnings.
            with source_info_util.user_context(getattr(_CALLER, "traceback", None)):
                try:
                    return fn(*args)
                except (TypeError, ValueError, IndexError) as exc:
                    # jax's own check of the op's operands (run() names them): not one of ours
                    if not isinstance(exc, AutoshardError):
                        exc.__dict__["_autoshard_operands"] = True
                    raise

        traced.__name__ = traced.__qualname__ = f"eager_{key[0]}"
        # "keep": pending Partial results stay visible op by op, until the user reshards them
        f = PROGRAMS[key] = jit(traced, out_placements="keep")
        f._always_dist = True
    return f


def run(key: tuple, make: Callable[[], Callable[..., Any]], *args: Any) -> Any:
    """Call the program of `key` on `args` (DistTensors, arrays, scalars)."""
    f = program(key, make)
    _CALLER.traceback = xla_client.Traceback.get_traceback()
    try:
        return f(*args)
    except (TypeError, ValueError, IndexError) as exc:
        if not exc.__dict__.get("_autoshard_operands"):
            raise
        raise operand_error(exc, f"{key[0]} of {', '.join(map(_describe, args))}: {exc} (numpy "
                                 f"and jax refuse it alike on one device)") from exc
    finally:
        _CALLER.traceback = None


def _describe(x: Any) -> str:
    """An operand as an error names it: dtype, shape and, for a DistTensor, its placements."""
    shape, dtype = np.shape(x), getattr(x, "dtype", type(x).__name__)
    where = f" {x.placements}" if isinstance(x, DistTensor) else ""
    return f"{dtype}{list(shape)}{where}"


def _operand(x: Any) -> tuple[Any, type | None] | None:
    """(value, its Python scalar type or None), or None for what no op takes (NotImplemented)."""
    if isinstance(x, (DistTensor, jax.Array, np.ndarray, np.generic)):
        return x, None
    for t in _PY_SCALARS:
        if isinstance(x, t):
            return t(x), t
    if isinstance(x, (list, tuple)):
        arr = np.asarray(x)
        return (arr, None) if arr.dtype.kind in "biufc" else None
    return None


def _apply(name: str, f: Callable[..., Any], *operands: Any) -> Any:
    parsed = [_operand(x) for x in operands]
    if any(p is None for p in parsed):
        return NotImplemented
    values = [v for v, _ in parsed]
    kinds = [k for _, k in parsed]
    if name == "pow" and kinds[1] is int and kinds[0] is None:
        # x ** 3 with a Python int is lax.integer_pow in jnp (exact for integers, no loop):
        # the exponent is static, one program per exponent.
        n = values[1]
        return run(("pow", ("int", n)), lambda: lambda x: jnp.power(x, n), values[0])
    if any(kinds):
        # A Python scalar is weakly typed in jnp (bf16 * 2.0 stays bf16, int32 * 2.5 is
        # float32): give it the dtype jnp would, here, so the program sees a plain array.
        target = jnp.result_type(*(np.dtype(v.dtype) if k is None else k
                                   for v, k in zip(values, kinds)))
        try:
            values = [v if k is None else np.asarray(v, dtype=target)
                      for v, k in zip(values, kinds)]
        except OverflowError:
            # a Python int outside the dtype's range (uint8 + 300, x < 1000): the program
            # takes it as jnp does, weakly typed (it wraps, or compares by value), one
            # program per such value
            return _with_scalars(name, f, values, kinds)
    return run((name,), lambda: f, *values)


def _with_scalars(name: str, f: Callable[..., Any], values: list, kinds: list) -> Any:
    scalars = tuple((i, v) for i, (v, k) in enumerate(zip(values, kinds)) if k is not None)
    arrays = [v for v, k in zip(values, kinds) if k is None]

    def make() -> Callable[..., Any]:
        def fn(*xs):
            it, given = iter(xs), dict(scalars)
            return f(*[given[i] if i in given else next(it) for i in range(len(values))])
        return fn

    return run((name, ("scalars", scalars)), make, *arrays)


def _binary(name: str, f: Callable[..., Any]) -> tuple[Callable, Callable]:
    def method(self: DistTensor, other: Any) -> Any:
        return _apply(name, f, self, other)

    def reflected(self: DistTensor, other: Any) -> Any:
        return _apply(name, f, other, self)

    return method, reflected


def _pow(self: DistTensor, other: Any, mod: Any = None) -> Any:
    return NotImplemented if mod is not None else _apply("pow", jnp.power, self, other)


def _unary(name: str, f: Callable[..., Any]) -> Callable:
    def method(self: DistTensor) -> DistTensor:
        return run((name,), lambda: f, self)

    return method


def _axis(axis: Any, ndim: int) -> int:
    a = operator.index(axis)
    if not -ndim <= a < ndim:
        raise OperandAxisError(f"axis {a} is out of bounds for a DistTensor of {ndim} dims: "
                               f"name an axis from {-ndim} to {ndim - 1}")
    return a % ndim


def _axes(axis: Any, ndim: int) -> tuple[int, ...] | None:
    if axis is None:
        return None
    return tuple(sorted(_axis(a, ndim) for a in (axis if isinstance(axis, (tuple, list)) else (axis,))))


def _no_out(out: Any, name: str) -> None:
    # numpy's np.sum(x) / np.mean(x) / np.argmax(x) call x.sum(axis=..., dtype=..., out=None)
    if out is not None:
        raise OperandTypeError(f"DistTensor.{name}: out= is not supported (DistTensors are immutable "
                        f"values, as jax arrays are); use the result")


def _reduction(name: str, f: Callable[..., Any]) -> Callable:
    # the arguments in jnp's own order (x.max(0, None, True) is axis, out, keepdims as in jnp)
    sig = inspect.signature(f)
    first = next(iter(sig.parameters))

    def method(self: DistTensor, *args: Any, **kwargs: Any) -> DistTensor:
        given = sig.bind(self, *args, **kwargs).arguments
        _no_out(given.get("out"), name)
        other = set(given) - {first, "axis", "dtype", "out", "keepdims", "initial", "where"}
        if other:
            raise OperandTypeError(f"DistTensor.{name}: {', '.join(sorted(other))} is not "
                                   f"supported; "
                            f"call jnp.{f.__name__} inside a dist.jit function for it")
        axes, keep = _axes(given.get("axis"), self.ndim), bool(given.get("keepdims", False))
        kw: dict = {}
        if given.get("dtype") is not None:
            kw["dtype"] = np.dtype(given["dtype"])
        if given.get("initial") is not None:
            kw["initial"] = np.asarray(given["initial"]).item()  # static: one program per value
        where = given.get("where")
        key = (name, axes, keep, *sorted(kw.items()), *(() if where is None else ("where",)))
        if where is None:
            return run(key, lambda: lambda x: f(x, axis=axes, keepdims=keep, **kw), self)
        if not isinstance(where, (DistTensor, jax.Array)):
            where = np.asarray(where, dtype=bool)
        return run(key, lambda: lambda x, w: f(x, axis=axes, keepdims=keep, where=w, **kw),
                   self, where)

    method.__signature__ = sig  # type: ignore[attr-defined]
    method.__doc__ = (f"jnp.{f.__name__} over `axis` (all dims when None), as a DistTensor; "
                      f"`where` may be a DistTensor.")
    return method


def _arg_reduction(name: str, f: Callable[..., Any]) -> Callable:
    def method(self: DistTensor, axis: Any = None, out: Any = None,
               keepdims: bool = False) -> DistTensor:
        _no_out(out, name)
        ax = None if axis is None else _axis(axis, self.ndim)
        keep = bool(keepdims)
        return run((name, ax, keep), lambda: lambda x: f(x, axis=ax, keepdims=keep), self)

    method.__doc__ = f"jnp.{f.__name__} along `axis` (of the flattened tensor when None)."
    return method


def astype(self: DistTensor, dtype: Any) -> DistTensor:
    """This tensor converted to `dtype`, laid out as the plan chooses."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise OperandTypeError(f"DistTensor.astype({dtype!r:.60}): {exc}: name a numpy or jax "
                               f"dtype, e.g. 'float32' or jnp.bfloat16") from exc
    return run(("astype", dt), lambda: lambda x: x.astype(dt), self)


def reshape(self: DistTensor, *shape: Any) -> DistTensor:
    """`x.reshape(2, 3)` or `x.reshape((2, 3))`; one dim may be -1."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    new = tuple(operator.index(s) for s in shape)
    return run(("reshape", new), lambda: lambda x: jnp.reshape(x, new), self)


def transpose(self: DistTensor, *axes: Any) -> DistTensor:
    """`x.transpose(1, 0)` or `x.transpose((1, 0))`; all dims reversed when none are given."""
    if len(axes) == 1 and (axes[0] is None or isinstance(axes[0], (tuple, list))):
        axes = () if axes[0] is None else tuple(axes[0])
    perm = tuple(operator.index(a) for a in axes) or tuple(reversed(range(self.ndim)))
    return run(("transpose", perm), lambda: lambda x: jnp.transpose(x, perm), self)


def _is_mask(k: Any) -> bool:
    return isinstance(k, (DistTensor, jax.Array, np.ndarray)) and k.dtype == np.bool_


def _index_entries(shape: tuple[int, ...], key: Any) -> list:
    # A boolean mask is concrete here (eager), so it becomes integer arrays as numpy does; the
    # result's shape then depends on the mask's values, which a traced program could not know.
    # It must have the shape of the dims it indexes, as numpy and jax require (its nonzero
    # indices would otherwise pick other elements, silently).
    # an empty list is an empty integer index, as numpy reads it (np.asarray makes it float)
    entries = [(np.asarray(k) if k else np.zeros(0, np.intp)) if isinstance(k, list) else k
               for k in (key if isinstance(key, tuple) else (key,))]

    def width(k) -> int:  # the dims an entry indexes
        if k is None or k is Ellipsis or isinstance(k, (bool, np.bool_)):
            return 0
        return np.ndim(k) if _is_mask(k) else 1

    rest = len(shape) - sum(map(width, entries))
    out: list = []
    dim = 0
    for k in entries:
        if k is Ellipsis:
            dim += max(rest, 0)
        if _is_mask(k):
            k = np.asarray(k)
            if k.ndim and tuple(k.shape) != tuple(shape[dim:dim + k.ndim]):
                raise OperandIndexError(
                    f"DistTensor index: a boolean mask of shape {list(k.shape)} indexes dims "
                    f"{list(range(dim, dim + k.ndim))} of a tensor of shape {list(shape)}, whose "
                    f"sizes are {list(shape[dim:dim + k.ndim])}: give a mask of those sizes")
            out.extend(np.nonzero(k) if k.ndim else [bool(k)])
        else:
            out.append(k)
        dim += width(k)
    return out


def _index_spec(shape: tuple[int, ...], key: Any, check: bool = True) -> tuple[tuple, list]:
    """`key` as (static spec, index arrays): the spec keys the program, the arrays are operands."""
    spec: list = []
    arrays: list = []
    for k in _index_entries(shape, key):
        if k is None or k is Ellipsis or isinstance(k, (bool, np.bool_)):
            spec.append(k if k is None or k is Ellipsis else bool(k))
        elif isinstance(k, slice):
            spec.append(("slice",) + tuple(None if v is None else operator.index(v)
                                           for v in (k.start, k.stop, k.step)))
        elif isinstance(k, (int, np.integer)) or (isinstance(k, np.ndarray) and k.ndim == 0
                                                  and k.dtype.kind in "iu"):
            spec.append(operator.index(k))
        elif isinstance(k, (DistTensor, jax.Array, np.ndarray)) and np.dtype(k.dtype).kind in "iu":
            spec.append(_ARRAY)
            arrays.append(k)
        else:
            raise OperandIndexError(f"DistTensor index {k!r:.60}: only integers, slices (`:`), ellipsis "
                             f"(`...`), None and integer or boolean arrays are valid indices")
    if check:
        _check_bounds(shape, spec, arrays)
    return _progression_as_slice(shape, spec, arrays)


def _progression_as_slice(shape: tuple[int, ...], spec: list, arrays: list) -> tuple[tuple, list]:
    """A lone 1-d host index array that steps evenly up a dim (`np.arange(1, 32, 2)`, a mask
    of every other row) as the slice it equals: the program is the strided slice, which
    keeps a split dim split (an index operand is a gather that must assume any row), and one
    program serves every array with the same start, stop and step. Exact: the same rows in
    the same order, and the same result shape (one advanced index in one dim keeps its place)."""
    if len(arrays) != 1 or not isinstance(arrays[0], np.ndarray) or arrays[0].ndim != 1 \
            or not arrays[0].size or any(isinstance(k, bool) for k in spec):
        return tuple(spec), arrays  # (a scalar bool is an advanced index too)
    at = spec.index(_ARRAY)
    # beside an index array, integers are advanced indices too: split apart by a slice, their
    # result dim moves to the front (numpy's rule), which a slice in place would not do
    advanced = [i for i, k in enumerate(spec) if k is _ARRAY or type(k) is int]
    if advanced != list(range(advanced[0], advanced[-1] + 1)):
        return tuple(spec), arrays
    dim = _dims(shape, spec)[at]
    if dim >= len(shape):  # too many indices: jnp says so
        return tuple(spec), arrays
    n = shape[dim]
    rows = np.asarray(arrays[0], np.int64) % n  # (in bounds: checked above)
    step = int(rows[1] - rows[0]) if rows.size > 1 else 1
    if step < 1 or np.any(np.diff(rows) != step):
        return tuple(spec), arrays
    start = int(rows[0])
    spec = spec[:at] + [("slice", start, start + step * (rows.size - 1) + 1, step)] + spec[at + 1:]
    return tuple(spec), []


def _index(static: tuple, idx: Iterator) -> tuple:
    """The jnp index of a spec, taking its arrays from `idx` in order."""
    return tuple(next(idx) if k is _ARRAY else slice(*k[1:]) if isinstance(k, tuple) else k
                 for k in static)


def _getitem(self: DistTensor, key: Any) -> DistTensor:
    static, arrays = _index_spec(self.shape, key)

    def make() -> Callable[..., Any]:
        return lambda x, *idx: x[_index(static, iter(idx))]

    return run(("getitem", static), make, self, *arrays)


# x.at[idx].<op>(value): jax's out-of-place updates, as one program per (op, index spec, mode)
_AT_OPS = ("set", "add", "subtract", "multiply", "divide", "power", "min", "max")


class _AtIndexer:
    """`x.at`: `x.at[idx].set(v)`, `.add(v)`, ..., `.get()` — as jax arrays have them."""

    __slots__ = ("_x",)

    def __init__(self, x: DistTensor) -> None:
        self._x = x

    def __getitem__(self, key: Any) -> "_AtUpdate":
        # the bounds are checked when the mode is known: jax's modes ("fill", "drop", "clip")
        # say what an out-of-range index does; without one it is an IndexError, as numpy's
        return _AtUpdate(self._x, *_index_spec(self._x.shape, key, check=False))


class _AtUpdate:
    __slots__ = ("_x", "_static", "_arrays")

    def __init__(self, x: DistTensor, static: tuple, arrays: list) -> None:
        self._x, self._static, self._arrays = x, static, arrays

    def _checked(self, mode: str | None) -> None:
        if mode is None:
            _check_bounds(self._x.shape, list(self._static), self._arrays)

    def get(self, *, mode: str | None = None, fill_value: Any = None) -> DistTensor:
        self._checked(mode)
        static = self._static

        def make() -> Callable[..., Any]:
            return lambda x, *idx: x.at[_index(static, iter(idx))].get(mode=mode,
                                                                      fill_value=fill_value)

        return run(("at_get", static, mode, fill_value), make, self._x, *self._arrays)

    def _update(self, op: str, value: Any, mode: str | None) -> DistTensor:
        self._checked(mode)
        parsed = _operand(value)
        if parsed is None:
            raise OperandTypeError(f"x.at[...].{op}() takes an array, a DistTensor or a scalar, not "
                            f"{type(value).__name__}")
        static, x = self._static, self._x
        v = parsed[0]
        if parsed[1] is not None:
            try:
                v = np.asarray(v, dtype=x.dtype)
            except OverflowError:  # a Python int past the dtype's range: it wraps, as in jnp
                v = np.asarray(v).astype(x.dtype)
        if x.dtype == np.bool_ and op in ("add", "multiply"):
            # jax's scatter adds or multiplies no truth values; on them a sum is an `or` and
            # a product an `and`, which max and min compute (jax.jit gives the same values)
            op = {"add": "max", "multiply": "min"}[op]

        def make() -> Callable[..., Any]:
            def fn(x, v, *idx):
                return getattr(x.at[_index(static, iter(idx))], op)(v, mode=mode)
            return fn

        return run(("at_" + op, static, mode), make, x, v, *self._arrays)


def _at_method(op: str) -> Callable:
    def method(self: _AtUpdate, value: Any, *, mode: str | None = None) -> DistTensor:
        return self._update(op, value, mode)

    method.__name__ = op
    method.__doc__ = f"jax's `x.at[idx].{op}(value)`, out of place, as a DistTensor."
    return method


for _op in _AT_OPS:
    setattr(_AtUpdate, _op, _at_method(_op))


def _check_bounds(shape: tuple[int, ...], spec: list, arrays: list) -> None:
    # jnp clamps an out-of-range index; numpy (and Python iteration) raise IndexError. Host
    # index arrays are checked too; device ones would have to be fetched, so they are not.
    it = iter(arrays)
    for k, dim in zip(spec, _dims(shape, spec)):
        if dim is None:
            continue
        values = next(it) if k is _ARRAY else k
        if dim < len(shape) and isinstance(values, (int, np.ndarray)):
            n = shape[dim]
            bad = np.asarray(values)
            bad = bad[(bad < -n) | (bad >= n)]
            if bad.size:
                raise OperandIndexError(f"index {int(bad.flat[0])} is out of bounds for axis "
                                        f"{dim} with size {n} (of a DistTensor of shape "
                                        f"{tuple(shape)})")


def _dims(shape: tuple[int, ...], spec: list) -> list:
    """The dim of `shape` each index entry takes (None: a new axis, `...`, a scalar bool)."""
    takes = [k is not None and k is not Ellipsis and not isinstance(k, bool) for k in spec]
    dims, dim = [], 0
    for k, t in zip(spec, takes):
        if k is Ellipsis:
            dim += max(len(shape) - sum(takes), 0)
        dims.append(dim if t else None)
        dim += t
    return dims


def _iter(self: DistTensor) -> Iterator[DistTensor]:
    if not self.shape:
        raise TypeError("iteration over a 0-d DistTensor")
    n = self.shape[0]
    # One program for all rows rather than one per row index.
    rows = run(("rows", n), lambda: lambda x: tuple(x[i] for i in range(n)), self)
    return iter(rows)


def _to_python(convert: Callable[[Any], Any]) -> Callable:
    def method(self: DistTensor) -> Any:
        if self.ndim:
            raise TypeError(f"only a 0-d DistTensor converts to a Python {convert.__name__}; this "
                            f"one has shape {self.shape}: index or reduce it first")
        return convert(self.numpy())

    return method


def _bool(self: DistTensor) -> bool:
    if self.size != 1:
        raise ValueError(f"the truth value of a DistTensor of shape {self.shape} is ambiguous: "
                         f"reduce it first (x.any(), x.all())")
    return bool(self.numpy().reshape(()))


# jax.Array methods that run as they are, on the global tensor: one program per (method, static
# arguments); array arguments (DistTensors included) are operands.
_METHODS = ("flatten", "ravel", "squeeze", "swapaxes", "clip", "round", "cumsum", "cumprod",
            "var", "std", "dot", "conj", "sort", "argsort", "repeat", "take", "diagonal",
            "trace", "copy", "conjugate", "ptp", "searchsorted", "argpartition", "view",
            "byteswap")
_OPERAND_TYPES = (DistTensor, jax.Array, np.ndarray)


def _static(x: Any, method: str) -> Any:
    """`x` as a hashable part of a program's key (lists become tuples)."""
    if isinstance(x, list):
        x = tuple(x)
    try:
        hash(x)
    except TypeError:
        raise OperandTypeError(f"DistTensor.{method}: argument {x!r:.60} is neither an array nor a "
                        f"hashable constant") from None
    return x


# Array arguments whose values set the result's shape (position, keyword): read on the host
# into the program's key, as jax.Array.repeat reads array repeats eagerly; traced, they would
# have no value to give the shape.
_SHAPE_ARGS = {"repeat": (0, "repeats")}


class _HostArray(tuple):
    """A host array as a hashable key part: (dtype, shape, values)."""

    @classmethod
    def of(cls, a: Any) -> "_HostArray":
        v = np.asarray(a)
        return cls((v.dtype.str, v.shape, tuple(v.ravel().tolist())))

    def value(self) -> np.ndarray:
        dtype, shape, values = self
        return np.array(values, dtype=dtype).reshape(shape)


def _array_method(name: str) -> Callable:
    at, keyword = _SHAPE_ARGS.get(name, (None, None))

    def method(self: DistTensor, *args: Any, **kwargs: Any) -> DistTensor:
        if at is not None:
            args = tuple(_HostArray.of(a) if i == at and isinstance(a, _OPERAND_TYPES) else a
                         for i, a in enumerate(args))
            kwargs = {k: _HostArray.of(a) if k == keyword and isinstance(a, _OPERAND_TYPES)
                      else a for k, a in kwargs.items()}
        arrays = [a for a in (*args, *kwargs.values()) if isinstance(a, _OPERAND_TYPES)]
        slot = lambda a: _ARRAY if isinstance(a, _OPERAND_TYPES) else _static(a, name)  # noqa: E731
        pos = tuple(slot(a) for a in args)
        kw = tuple(sorted((k, slot(a)) for k, a in kwargs.items()))

        def make() -> Callable[..., Any]:
            def fn(x, *ops):
                it = iter(ops)
                take = lambda a: (next(it) if a is _ARRAY else  # noqa: E731
                                  a.value() if isinstance(a, _HostArray) else a)
                a = [take(p) for p in pos]
                return getattr(x, name)(*a, **{k: take(v) for k, v in kw})
            return fn

        return run((name, pos, kw), make, self, *arrays)

    method.__name__ = name
    method.__doc__ = f"jax.Array.{name} on the global tensor, as a DistTensor."
    return method


_NONZERO = _array_method("nonzero")


def _choose(self: DistTensor, choices: Any, out: None = None, mode: str = "raise") -> DistTensor:
    """As jax.Array.choose: `self` picks, element by element, from the arrays `choices` (a
    sequence; each an operand of the program, DistTensors included)."""
    _no_out(out, "choose")
    choices = list(choices)
    mode = _static(mode, "choose")
    if mode == "raise":
        # checked on the host, as jax checks it outside a jit (a traced check cannot raise);
        # for indices in range, "clip" picks alike
        picks = self.numpy()
        if picks.size and (picks.min() < 0 or picks.max() >= len(choices)):
            raise ValueError("invalid entry in choice array")
        mode = "clip"
    return run(("choose", len(choices), mode),
               lambda: lambda x, *cs: x.choose(list(cs), mode=mode), self, *choices)


_COMPRESS = _array_method("compress")


def _compress(self: DistTensor, condition: Any, axis: int | None = None, *,
              size: int | None = None, fill_value: Any = 0, out: None = None) -> DistTensor:
    """As jax.Array.compress. With `size`, one program (the condition an operand); without,
    the condition sets the result's shape: it is read on the host, as jax reads it outside a
    jit, and the kept rows are taken on the devices."""
    _no_out(out, "compress")
    if size is not None:
        return _COMPRESS(self, condition, axis=axis, size=size, fill_value=fill_value)
    cond = np.asarray(condition.numpy() if isinstance(condition, DistTensor)
                      else condition).astype(bool)
    if cond.ndim != 1:
        raise ValueError("condition must be a 1D array")
    n = self.size if axis is None else self.shape[axis]
    if cond[n:].any():
        raise ValueError("condition contains entries that are out of bounds")
    kept = np.flatnonzero(cond[:n]).astype(np.int32)
    return (self.ravel() if axis is None else self).take(kept, axis=0 if axis is None else axis)


def _item(self: DistTensor) -> Any:
    if self.size != 1:
        raise ValueError(f"only a DistTensor of one element converts to a Python scalar; this "
                         f"one has shape {self.shape}: index or reduce it first")
    return self.numpy().item()


def _format(self: DistTensor, spec: str) -> str:
    """f"{loss:.4f}": a one-element tensor formats as its Python scalar (as a jax array does);
    with no spec, as str()."""
    if not spec:
        return str(self)
    if self.size != 1:
        raise TypeError(f"format spec {spec!r} needs a one-element DistTensor; this one has "
                        f"shape {self.shape}: index or reduce it first")
    return format(self.item(), spec)


def _nonzero(self: DistTensor, *, size: int | None = None, fill_value: Any = None) -> tuple:
    """As jax.Array.nonzero: with `size`, one program (DistTensors out); without, the shape
    depends on the values, so it is computed from the global value on the host, as jax
    computes it outside a jit (jax arrays out)."""
    if size is None:
        return tuple(jnp.asarray(i) for i in np.nonzero(self.numpy()))
    return _NONZERO(self, size=size, fill_value=fill_value)


def _round(self: DistTensor, ndigits: int | None = None) -> DistTensor:
    """Python's round(x) as jax's own round of an array runs it: round(x) is an integer, as
    round(jnp.float32(2.5)) and round(np.float32(2.5)) are; round(x, 2) keeps the dtype."""
    ndigits = None if ndigits is None else operator.index(ndigits)
    return run(("__round__", ndigits), lambda: lambda x: round(x, ndigits), self)


def _contains(self: DistTensor, value: Any) -> bool:
    """`v in x` as for a jax or numpy array: whether any element equals `v` (Python's default
    compared `v` with each row, which is ambiguous past one dim)."""
    return bool((self == value).any())


def _setitem(self: DistTensor, index: Any, value: Any) -> None:
    """`x[idx] = v` in place, as numpy and Paddle tensors take it (flax writes a Variable
    holding a non-jax array this way: `metric.total[...] = 0`): the tensor now holds
    `x.at[idx].set(v)`, with its placements kept."""
    from .reshard.api import reshard

    # (not `index == ()`: an array index would compare elementwise)
    if index is Ellipsis or (type(index) is tuple and not index):
        # the whole tensor: a broadcast, not a scatter (jax 0.11's CPU build crashes on a 0-d
        # scatter inside shard_map — the `metric.total[...] = 0` of every flax metric reset)
        parsed = _operand(value)
        if parsed is None:
            raise OperandTypeError(f"x[...] = v takes an array, a DistTensor or a scalar, not "
                            f"{type(value).__name__}")
        new = run(("fill",), lambda: lambda x, v: jnp.broadcast_to(
            jnp.asarray(v).astype(x.dtype), x.shape), self, parsed[0])
    else:
        new = self.at[index].set(value)
    if new.mesh != self.mesh or new.layout != self.layout:
        new = reshard(new, self.mesh, self.placements)
    self._set_storage(new.physical)


def install(cls: type = DistTensor) -> None:
    """Give `cls` the eager operators and methods (idempotent)."""
    methods: dict[str, Any] = {}
    for name, f in _BINARY.items():
        methods[f"__{name}__"], methods[f"__r{name}__"] = _binary(name, f)
    methods["__pow__"] = _pow
    for name, f in _COMPARE.items():  # Python swaps the operands itself: no reflected forms
        methods[f"__{name}__"] = _binary(name, f)[0]
    for name, f in _UNARY.items():
        methods[f"__{name}__"] = _unary(name, f)
    for name, f in _PROPERTIES.items():
        methods[name] = property(_unary(name, f), doc=f"jax.Array.{name}, as a DistTensor.")
    for name, f in _REDUCE.items():
        methods[name] = _reduction(name, f)
    for name in _METHODS:
        methods[name] = _array_method(name)
    methods.update(
        argmax=_arg_reduction("argmax", jnp.argmax), argmin=_arg_reduction("argmin", jnp.argmin),
        astype=astype, reshape=reshape, transpose=transpose,
        at=property(_AtIndexer, doc="`x.at[idx].set(v)` / `.add(v)` / ... / `.get()`, as jax."),
        item=_item, tolist=lambda self: self.numpy().tolist(), __format__=_format,
        nonzero=_nonzero, choose=_choose, compress=_compress,
        clone=_array_method("copy"),  # (jax.Array.clone: a copy; traced values have only copy)
        __round__=_round,
        T=property(lambda self: self.transpose(), doc="All dims reversed."),
        __getitem__=_getitem, __setitem__=_setitem, __iter__=_iter, __contains__=_contains,
        __bool__=_bool, __float__=_to_python(float),
        __int__=_to_python(int), __complex__=_to_python(complex),
        # a 0-d integer tensor is an index, as a jax array's is: range(round(x)), seq[x.argmax()]
        __index__=_to_python(operator.index),
        # __eq__ is elementwise, which would make the class unhashable had it been defined in
        # the class body; DistTensors stay hashable by identity (dict keys, sets, `x in list`).
        __hash__=object.__hash__,
        # ndarray's binary operators step aside for a higher priority: np_array + x is ours.
        __array_priority__=1000,
    )
    for name, value in methods.items():
        setattr(cls, name, value)


install(DistTensor)

__all__ = ["install", "program", "PROGRAMS", "astype", "reshape", "transpose"]
