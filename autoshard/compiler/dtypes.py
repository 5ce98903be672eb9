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
