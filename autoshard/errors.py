"""The error hierarchy: every mistake a user can make raises a subclass of AutoshardError.

Messages say what was wrong, where in the user's code it happened, and what to write instead.
"""
from __future__ import annotations

import os
import sys
import sysconfig
from typing import Any, Iterable

import numpy as np

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# In an editable install the rules live beside the package, not inside it.
_RULES_DIR = os.path.join(os.path.dirname(_PACKAGE_DIR), "rules")
# Python's own library (functools' cached_property, threading, runpy): never the user's line;
# its site-packages folder is not the stdlib
_STDLIB_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep
                      for k in ("stdlib", "platstdlib")})


def _is_internal(filename: str) -> bool:
    # Frames of autoshard itself, its rules, jax and the stdlib are never the user's line.
    if filename.startswith("<") and filename not in ("<stdin>",) and not filename.startswith("<ipython"):
        return True  # generated code (dataclass __init__, exec) is never the user's line
    path = os.path.abspath(filename)
    if path.startswith(_PACKAGE_DIR) or path.startswith(_RULES_DIR):
        return True
    if path.startswith(_STDLIB_DIRS) and "-packages" + os.sep not in path:
        return True
    return any(part in path for part in (os.sep + "jax" + os.sep, os.sep + "jaxlib" + os.sep,
                                         os.sep + "contextlib.py", "<frozen "))


def user_frame(skip_libraries: bool = False) -> tuple[str, int] | None:
    """(file, line) of the innermost stack frame that belongs to the user's code; with
    `skip_libraries`, outside installed packages too where the stack has such a frame (optax's
    init runs a tree.map; the user's line is the `tx.init(params)` that called it)."""
    frame, fallback = sys._getframe(1), None
    while frame is not None:
        name = frame.f_code.co_filename
        if not _is_internal(name):
            if not skip_libraries or not any(p in name for p in ("site-packages",
                                                                  "dist-packages")):
                return name, frame.f_lineno
            fallback = fallback or (name, frame.f_lineno)
        frame = frame.f_back
    return fallback


def user_line_of(exc: BaseException) -> str | None:
    """`file:line` of the innermost frame of the user's code in `exc`'s traceback (where a
    jax error raised inside a traced function was written)."""
    found, tb = None, exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not _is_internal(name):
            found = f"{os.path.basename(name)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found


def did_you_mean(name: Any, names: Iterable[str]) -> str:
    """" (did you mean 'x'?)" for the closest of `names` to a misspelt `name`, else ""."""
    import difflib

    near = difflib.get_close_matches(name, list(names), n=1) if isinstance(name, str) else []
    return f" (did you mean {near[0]!r}?)" if near else ""


def user_source_line() -> str | None:
    """`file:line` of the innermost stack frame that belongs to the user's code."""
    found = user_frame()
    return None if found is None else f"{os.path.basename(found[0])}:{found[1]}"


class AutoshardError(Exception):
    """Base of every error autoshard raises on bad input.

    `where` is the user's source line (file:line) that led to the error, found on the stack when
    the error is created; it is appended to the message.
    """

    def __init__(self, message: str, *, where: str | None = None):
        self.where = where if where is not None else user_source_line()
        self.message = message
        full = message if self.where is None else f"{message}\n  (at {self.where})"
        super().__init__(full)


class MeshError(AutoshardError, ValueError):
    """A ProcessMesh that cannot exist: ragged, duplicate ids, bad dim names."""


class DeviceNotFoundError(AutoshardError, ValueError):
    """A mesh names device ids that this process does not see."""


class PlacementError(AutoshardError, ValueError):
    """A placements list that does not fit the mesh or the tensor."""


class PlacementTypeError(AutoshardError, TypeError):
    """Something that is not a placement where a placement was expected."""


class ShardingError(AutoshardError, ValueError):
    """A tensor dim that cannot be split as asked (for instance not divisible)."""


class ReshardError(AutoshardError, ValueError):
    """A reshard that cannot be carried out."""


class MeshMismatchError(AutoshardError, ValueError):
    """Values of one program on different meshes (or no mesh at all)."""


class LocalDataError(AutoshardError, ValueError):
    """Per-device data handed to dtensor_from_local that does not fit the mesh and placements."""


class TransformationError(AutoshardError, NotImplementedError):
    """A jax transformation applied from outside dist.jit that the partitioned program cannot
    carry (a second derivative through a construct differentiable once from outside): take it
    inside the dist.jit function."""


class CostModelError(AutoshardError, ValueError):
    """A cost model with a latency or bandwidth that is not a number of the right sign, or
    something that is not a dist.CostModel where one is expected."""


class SignatureError(AutoshardError, TypeError):
    """A partitioned function's arguments or results that do not fit it: a static argument
    number past its parameters, a result that is not an array."""


class OperandError(AutoshardError):
    """An eager DistTensor op given operands it does not take (shapes that do not broadcast, an
    axis or index out of range, an unknown dtype): the check numpy or jax would make on one
    device, with the tensors and the user's line. Each is also the builtin error numpy raises
    (TypeError, ValueError, IndexError), so code catching those still does."""


class OperandTypeError(OperandError, TypeError):
    pass


class OperandValueError(OperandError, ValueError):
    pass


class OperandIndexError(OperandError, IndexError):
    pass


class OperandAxisError(OperandError, np.exceptions.AxisError):
    """An axis out of range (numpy's AxisError: a ValueError and an IndexError)."""


def operand_error(exc: BaseException, message: str) -> OperandError:
    """`message` as the OperandError of the builtin kind of `exc`."""
    if isinstance(exc, IndexError) and isinstance(exc, ValueError):
        return OperandAxisError(message)
    for kind, cls in ((IndexError, OperandIndexError), (TypeError, OperandTypeError)):
        if isinstance(exc, kind):
            return cls(message)
    return OperandValueError(message)


__all__ = [
    "CostModelError", "SignatureError", "AutoshardError", "MeshError", "DeviceNotFoundError", "PlacementError", "PlacementTypeError",
    "ShardingError", "ReshardError", "LocalDataError", "MeshMismatchError", "user_source_line",
    "OperandError", "OperandTypeError", "OperandValueError", "OperandIndexError",
    "OperandAxisError", "operand_error", "TransformationError",
]
