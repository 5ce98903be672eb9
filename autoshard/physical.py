"""How a Layout is stored as one honest jax.Array with a NamedSharding.

Sharded dims are ordinary NamedSharding shards (a dim its devices do not divide is stored
padded to a multiple of them: uneven.py). Partial mesh axes get one extra leading axis of
size prod(partial axis sizes), sharded over those axes: the differing per-device values are then
*varying* data, as JAX requires — a "replicated" spec whose replicas secretly differ would let
JAX read any replica, and under check_vma a psum of it would compute n * x without talking.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .layout import Layout, partial_axes_in_mesh_order
from .mesh import ProcessMesh
from .uneven import padded_shape


def _entry(axes: Sequence[str]):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def physical_shape(layout: Layout, mesh: ProcessMesh, shape: Sequence[int]) -> tuple[int, ...]:
    """The stored array's shape: uneven dims padded (uneven.py), a slot axis if Partial."""
    shape = padded_shape(layout, mesh, shape)
    if not layout.partial:
        return shape
    sizes = mesh.axis_sizes
    return (math.prod(sizes[a] for a, _ in layout.partial),) + shape


@functools.lru_cache(maxsize=4096)  # every rebuilt DistTensor compares its array's spec to it
def physical_spec(layout: Layout, mesh: ProcessMesh) -> PartitionSpec:
    dims = [_entry(axes) for axes in layout.dims]
    if layout.partial:
        dims.insert(0, _entry(partial_axes_in_mesh_order(layout, mesh)))
    return PartitionSpec(*dims)


def physical_sharding(layout: Layout, mesh: ProcessMesh) -> NamedSharding:
    return NamedSharding(mesh.to_jax(), physical_spec(layout, mesh))


def layout_of_spec(spec, ndim: int) -> Layout:
    """The Layout a PartitionSpec-like `spec` (per dim: None, a mesh axis name, or a tuple of
    them, major first) gives an `ndim`-dim value; missing trailing entries are whole."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return Layout(tuple(() if e is None else tuple(e) if isinstance(e, (tuple, list)) else (e,)
                        for e in entries))


def mesh_sharding(x, one_device: bool = False) -> NamedSharding | None:
    """The NamedSharding over several devices of a concrete jax.Array (None: anything else —
    a tracer, a numpy array, an array on one device); with `one_device`, over a mesh of one
    device too (a DistTensor's on a one-device ProcessMesh)."""
    import jax

    sharding = getattr(x, "sharding", None)
    if (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
            and isinstance(sharding, NamedSharding)
            and (sharding.mesh.size > 1 or one_device)):
        return sharding
    return None


def device_put(value, sharding):
    """`jax.device_put(value, sharding)`, also onto the devices of several processes of a value
    every process holds whole (an unplaced input, a tensor being placed) where jax 0.10 refuses:
    a typed PRNG key array ("device_put's second argument must be a Device or a Sharding which
    represents addressable devices", though its jax.jit takes the same key: it moves as its key
    data and is wrapped again with its impl); an array committed to one local device (jax would
    need a cross-host transfer: it goes through host memory, as a numpy array does); and a value
    being differentiated eagerly (`jax.grad(dist.jit(f))(w)`: jax's transpose would move the
    cotangent, an array on every process's devices, back to one device)."""
    import jax

    if not sharding.is_fully_addressable:
        if isinstance(value, jax.core.Tracer):
            return _put_differentiably(value, sharding)
        if isinstance(value, jax.Array) and value.is_fully_addressable and not _is_key(value):
            value = np.asarray(value)
    if _is_key(value) and not sharding.is_fully_addressable:
        data = device_put(jax.random.key_data(value), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
    return jax.device_put(value, sharding)


def _is_key(value) -> bool:
    import jax

    dtype = getattr(value, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _put_differentiably(value, sharding):
    """`device_put` of a traced value onto several processes' devices whose cotangent comes
    back as the whole value on this process (every process holds the input whole)."""
    import jax

    @jax.custom_vjp
    def put(x):
        return device_put(x, sharding) if not isinstance(x, jax.core.Tracer) else \
            jax.device_put(x, sharding)

    def forward(x):
        return put(x), None

    def backward(_, ct):
        whole = jax.device_put(ct, NamedSharding(sharding.mesh, PartitionSpec()))
        if isinstance(whole, jax.core.Tracer) or whole.is_fully_addressable:
            return (whole,)  # (under an outer jit: one global program, nothing to bring back)
        return (jax.numpy.asarray(np.asarray(whole.addressable_data(0))),)

    put.defvjp(forward, backward)
    return put(value)


# Host offloading: the memory kinds a value can be stored in besides the devices' own
HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


def host_memory(sharding) -> str | None:
    """The host memory kind `sharding` stores its array in (None: the devices')."""
    kind = getattr(sharding, "memory_kind", None)
    return kind if kind in HOST_MEMORY_KINDS else None


__all__ = ["physical_shape", "physical_spec", "physical_sharding", "layout_of_spec",
           "mesh_sharding", "device_put", "HOST_MEMORY_KINDS", "host_memory"]
