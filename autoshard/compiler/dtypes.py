"""dtype helpers that also accept JAX's extended dtypes (PRNG key arrays)."""
from __future__ import annotations

import functools
import math

import jax
import numpy as np


def is_extended(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


@functools.lru_cache(maxsize=None)
def cost_dtype(dtype) -> str:
    """A numpy dtype name with the same bytes per element, for the cost model and planner."""
    if is_extended(dtype):
        # a threefry key is two uint32 words; other key kinds are priced the same
        return "uint64"
    return np.dtype(dtype).name


def dtype_name(dtype) -> str:
    """For messages and tables: numpy's name, or the extended dtype's own (key<fry>)."""
    return str(dtype) if is_extended(dtype) else np.dtype(dtype).name


@functools.lru_cache(maxsize=None)
def itemsize(dtype) -> int:
    return np.dtype(cost_dtype(dtype)).itemsize


def local_nbytes(shape, dtype, layout, sizes) -> int:
    """Bytes of one device's block of a value of `shape` laid out as `layout`."""
    return math.prod(layout.local_shape(shape, sizes)) * itemsize(dtype)


def normalize(dtype):
    return dtype if is_extended(dtype) else np.dtype(dtype)


def _has_inf(dtype) -> bool:
    with np.errstate(all="ignore"):
        return bool(np.isinf(np.asarray(np.inf).astype(dtype)))


@functools.lru_cache(maxsize=None)
def lowest(dtype):
    """The identity of max over `dtype`: -inf (the lowest finite value where it has no
    infinity, as float8_e4m3fn), the integer minimum, False. jax's own floats (bfloat16,
    float8) count as floats: numpy's issubdtype does not know them."""
    dtype = np.dtype(dtype)
    if jax.dtypes.issubdtype(dtype, np.inexact):
        return -np.inf if _has_inf(dtype) else float(jax.numpy.finfo(dtype).min)
    if dtype == np.bool_:
        return False
    return jax.numpy.iinfo(dtype).min  # (int4: numpy's iinfo does not know it)


@functools.lru_cache(maxsize=None)
def highest(dtype):
    """The identity of min over `dtype` (see `lowest`)."""
    dtype = np.dtype(dtype)
    if jax.dtypes.issubdtype(dtype, np.inexact):
        return np.inf if _has_inf(dtype) else float(jax.numpy.finfo(dtype).max)
    if dtype == np.bool_:
        return True
    return jax.numpy.iinfo(dtype).max
