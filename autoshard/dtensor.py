"""DistTensor: a logical (global) tensor stored across a ProcessMesh as one honest jax.Array.

A registered pytree node, so DistTensors pass through jax transformations as their physical
array; the mesh, layout and global shape travel as static metadata.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import sys
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax._src.interpreters.batching import BatchTracer

from .errors import (DeviceNotFoundError, MeshMismatchError, OperandTypeError,
                     PlacementTypeError, user_frame)
from .layout import Layout, block_bounds, partial_axes_in_mesh_order
from .mesh import ProcessMesh, as_process_mesh
from .physical import layout_of_spec, physical_shape, physical_sharding, physical_spec
from .uneven import is_uneven, padded_shape
from .placement import Placement, mean_of_parts


def _actual_layout(value: Any, mesh: ProcessMesh, layout: Layout) -> Layout:
    sharding = getattr(value, "sharding", None)
    if not isinstance(sharding, NamedSharding) or isinstance(value, jax.core.Tracer) \
            or isinstance(sharding.mesh, jax.sharding.AbstractMesh):
        return layout  # (an abstract mesh: a loop's carry type, jax checking its structure)
    if sharding.spec == physical_spec(layout, mesh):
        return layout
    if as_process_mesh(sharding.mesh) != mesh:
        return layout
    return layout_of_spec(sharding.spec, len(value.shape))


_sharding_of = functools.lru_cache(maxsize=4096)(physical_sharding)


def _stored_as(value: jax.Array, mesh: ProcessMesh, layout: Layout) -> jax.Array:
    """Concrete `value` where `layout` keeps it. A result jax hands back into a DistTensor node
    is laid out as XLA chose: an eager gradient made of unsharded jnp values sits on one device,
    and a padded (uneven) or Partial storage split otherwise than its layout says would make
    every per-device read (`local`, `dtensor_to_local`) take the wrong block. Moved, in its
    memory (an offloaded tensor stays on the host); what already fits is kept as it is."""
    have, want = value.sharding, _sharding_of(layout, mesh)
    if have.memory_kind != want.memory_kind:
        want = want.with_memory_kind(have.memory_kind)
    if have == want or not value.is_fully_addressable or have.is_equivalent_to(want, value.ndim):
        return value
    if have.device_set != want.device_set and _in_jax_api("device_put"):
        raise PlacementTypeError(
            f"jax.device_put of a DistTensor of shape {value.shape} with placements "
            f"{layout.placements(mesh)} onto devices outside its mesh {mesh!r}: a DistTensor "
            f"lives on its mesh; move it with dist.reshard(x, other_mesh, placements), or take "
            f"its global array, jax.device_put(x.numpy(), ...) / dist.unshard_dtensor(x)")
    return jax.device_put(value, want)


@functools.lru_cache(maxsize=4096)
def _stored_shape(mesh: ProcessMesh, layout: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(physical_shape(layout, mesh, shape))


class _Meta(tuple):
    """A DistTensor's pytree aux data, (mesh, layout, global shape). Two are one tree
    structure when both store the plain global array (no Partial slots, no uneven padding) of
    one shape on one mesh, whatever the dims are split over: `jax.tree.map(f, params,
    grads)` pairs a param with a grad laid out otherwise, as it pairs jax.Arrays of different
    shardings. Partial and uneven storage mean different things by layout (P(max) slots are
    not P(sum) slots), so those compare by layout."""

    __slots__ = ()

    def _identity(self) -> tuple:
        mesh, layout, shape = self
        plain = not layout.partial and _stored_shape(*self) == shape
        return mesh, shape, None if plain else layout

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Meta) and self._identity() == other._identity()

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self._identity())


def _logical(x: Any, mesh: ProcessMesh, layout: Layout, shape: tuple[int, ...], xp: Any) -> Any:
    """The logical global value of stored array `x` with array module `xp` (jax.numpy or
    numpy): pending Partial slots reduced (the slot axis is mesh-ordered, major first), an
    uneven dim's padding dropped."""
    if layout.partial:
        kinds = dict(layout.partial)
        axes = partial_axes_in_mesh_order(layout, mesh)
        x = x.reshape(tuple(mesh.get_dim_size(a) for a in axes) + x.shape[1:])
        reduce = {"max": xp.max, "min": xp.min, "sum": xp.sum}
        # sums (or max / min) first, one slot axis at a time, then every mean's slots at once:
        # an integer mean truncates, so neither a mean of means nor a sum of means is the
        # value (a sum of truth values, a mean of integers: read back in the tensor's dtype)
        averaged = [i for i, a in enumerate(axes) if kinds[a].value == "avg"]
        for i in reversed(range(len(axes))):
            if i not in averaged:
                x = reduce[kinds[axes[i]].value](x, axis=i).astype(x.dtype)
        if averaged:  # the slot axes left, leading
            n = math.prod(x.shape[:len(averaged)])
            x = x.reshape((n,) + x.shape[len(averaged):])
            x = mean_of_parts(x, n, lambda p: xp.sum(p, axis=0),
                              np.int32 if xp is not np else np.int64).astype(x.dtype)
    if tuple(x.shape) != tuple(shape):
        x = x[tuple(slice(0, n) for n in shape)]
    return x


_JAX_API = os.path.join("jax", "_src", "api.py")


def _in_jax_api(name: str, frames: int | None = None) -> bool:
    """Whether jax's own function `name` (of jax/_src/api.py) is on the stack above the caller,
    within `frames` frames (None: anywhere)."""
    frame = sys._getframe(2)
    while frame is not None and frames != 0:
        if frame.f_code.co_name == name and frame.f_code.co_filename.endswith(_JAX_API):
            return True
        frame = frame.f_back
        frames = None if frames is None else frames - 1
    return False


def partial_gradient_error(what: str, placements: list) -> PlacementTypeError:
    return PlacementTypeError(
        f"differentiating with respect to {what}, a DistTensor with placements {placements}: "
        f"the gradient of a Partial value has no Partial meaning (every part gets the whole "
        f"gradient) — reduce it first with dist.reshard(x, mesh, [Replicate() or Shard(d) ...]) "
        f"before jax.grad")


def _jacobian_error(aux: tuple) -> PlacementTypeError:
    mesh, layout, shape = aux
    return PlacementTypeError(
        f"jax.jacfwd / jax.jacrev / jax.hessian of a function of a DistTensor of shape "
        f"{tuple(shape)} with placements {layout.placements(mesh)}: jax builds the jacobian's "
        f"basis and blocks as arrays of other shapes, which no layout of the tensor describes; "
        f"take the jacobian inside the partitioned function, dist.jit(jax.jacfwd(f))(x) (a "
        f"DistTensor placed by the plan), or of the global array, jax.jacfwd(f)(x.numpy())")


def _jax_random_key_check() -> str | None:
    """The jax.random function (its name as jax gives it to `_check_prng_key`) whose check of
    its key argument is on the stack just above the caller, if any."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return None
        if frame.f_code.co_name == "_check_prng_key" \
                and os.sep + "jax" + os.sep in frame.f_code.co_filename:
            name = frame.f_locals.get("name")
            return name if isinstance(name, str) else "<function>"
        frame = frame.f_back
    return None


def _keys_in_jax_random_error(x: "DistTensor", name: str) -> OperandTypeError:
    """jax.random.<name>(x) of a DistTensor of typed keys: jax takes typed keys only as a
    jax.Array (an isinstance check no other class passes), and reads anything else that has
    __jax_array__ as raw uint32 key data — its own error then says the shape is wrong."""
    mesh, layout, shape = x._mesh, x._layout, x._shape
    where = (f"a DistTensor of typed PRNG keys ({x._value.dtype}, shape {list(shape)}) placed "
             f"{layout.placements(mesh)} on mesh dims {list(mesh.dim_names)}")
    if name == "key_data":
        instead = ("write dist.jit(jax.random.key_data)(x) (a DistTensor of the uint32 words, with one "
                   "more dim; .numpy() reads them), or jax.random.key_data(jnp.asarray(x)) (a "
                   "jax.Array split as x is)")
    elif name == "key_impl":  # a name, not an array: nothing for dist.jit to place
        instead = "write jax.random.key_impl(jnp.asarray(x))"
    else:
        instead = (f"call it inside dist.jit, dist.jit(lambda k: jax.random.{name}(k, ...))(x) "
                   f"(placed by the plan), or on the keys as one jax.Array split as x is, "
                   f"jax.random.{name}(jnp.asarray(x), ...)")
    return OperandTypeError(
        f"jax.random.{name} of {where}: jax takes typed keys only as a jax.Array and does not "
        f"read a DistTensor's keys through __jax_array__ (it would take them for raw uint32 key "
        f"data): {instead}")


# jnp's and jax.nn's own code: the frames that hold a function's operands as it converts them
_JAX_FUNCTION_DIRS = tuple(os.sep + os.path.join("jax", "_src", d) + os.sep
                           for d in ("numpy", "nn"))


def _operand_on_other_devices(x: "DistTensor") -> "DistTensor | None":
    """A DistTensor on other devices than `x`'s mesh that the jax function converting `x`
    (jnp.add(a, b): each operand in turn, through __jax_array__) also takes: found among the
    locals of jnp's / jax.nn's frames just above the conversion (not further: a jax.tree.map
    of jnp.add holds every pair's tensors, each pair on its own mesh). jax would then stop on
    its own device error, which names neither mesh. Not while dist.jit traces: it cuts a
    program over two meshes."""
    from .compiler.jit import _TRACING

    if _TRACING.depth:
        return None
    devices = set(x._mesh.process_ids)
    frame = sys._getframe(2)
    while frame is not None and any(d in frame.f_code.co_filename for d in _JAX_FUNCTION_DIRS):
        for value in frame.f_locals.values():
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(v, DistTensor) and set(v._mesh.process_ids) != devices:
                    return v
        frame = frame.f_back
    return None


def _meshes_meet_error(x: "DistTensor", other: "DistTensor") -> MeshMismatchError:
    def described(t: "DistTensor") -> str:
        return (f"a DistTensor of shape {tuple(t._shape)} placed "
                f"{t._layout.placements(t._mesh)} on {t._mesh!r}")

    return MeshMismatchError(
        f"a jax function (jnp.*, jax.nn.*) was called on {described(x)} and on "
        f"{described(other)}: an operation runs on one mesh — move one onto the other's mesh "
        f"first, e.g. jnp.add(a, b) as jnp.add(a, dist.reshard(b, a.process_mesh, "
        f"a.placements))")


class StorageViewWarning(UserWarning):
    """A pytree function saw a DistTensor's padded / Partial storage, not its logical value."""


def _not_storage(value: Any, aux: tuple, stored: tuple[int, ...]) -> Any:
    """What f returned for a DistTensor node when it is not the node's storage: itself. Where
    the storage is not the logical value (uneven dims padded, Partial slots), f saw the storage,
    so a value f derived from its shape or contents may differ from one device's: say so."""
    mesh, layout, shape = aux
    if stored != tuple(shape):
        filename, line = user_frame(skip_libraries=True) or ("<unknown>", 0)
        warnings.warn_explicit(
            f"autoshard: a pytree function (jax.tree.map, jax.lax.map / scan over a "
            f"DistTensor, an optax or flax init) called at "
            f"{os.path.basename(filename)}:{line} was handed the stored array of a DistTensor "
            f"of shape {tuple(shape)} placed {layout.placements(mesh)} on mesh dims "
            f"{list(mesh.dim_names)} — shape {stored}, padded or with Partial slots — and made "
            f"a value of another shape from it, which may differ from one device's; run the "
            f"function under dist.jit (e.g. dist.jit(tx.init)(params), "
            f"dist.jit(lambda x: jax.lax.map(f, x))(x)) or use "
            f"dist.shard_optimizer(tx).init(params), which see the logical shape",
            StorageViewWarning, filename, line)
    return value


@dataclasses.dataclass(frozen=True)
class UnevenShard:
    """One device's block of a DistTensor split unevenly, with jax.Shard's fields (a jax.Array
    is split into equal blocks only, so jax has no Shard for it)."""

    device: Any
    index: tuple[slice, ...]
    replica_id: int
    data: Any  # None: the block of another process's device


@jax.tree_util.register_pytree_node_class
class DistTensor:
    """A tensor of global `shape` laid out on `mesh` with `placements`."""

    # _desc: dist.jit's description of this tensor as an input (shape, dtype, mesh, layout),
    # made once: a train loop hands the same outputs back in every step
    __slots__ = ("_value", "_mesh", "_layout", "_shape", "_desc", "_whole")

    def __init__(self, value: Any, mesh: ProcessMesh, layout: Layout, shape: tuple[int, ...]):
        # Trusted constructor: callers have checked that `value` is the physical array of
        # `layout` (see physical.py). Users build DistTensors with shard_tensor & co.
        self._value = value
        self._mesh = mesh
        self._layout = layout
        self._shape = tuple(shape)
        self._desc = None
        self._whole = None  # a Partial tensor's value, reduced, once flattened (`_reduced`)

    # -- pytree ------------------------------------------------------------------------------
    def tree_flatten(self):
        if self._layout.partial and not isinstance(self._value, jax.core.Tracer):
            # The leaf is what jax.tree.map's function is given. Partial storage holds the
            # parts of the value, one per slot: a function that is not linear (x + 1, x ** 2)
            # applied to each part and summed is not that function of the value — so outside
            # a trace the leaf is the value reduced (the collective `.numpy()` runs too), and
            # the node comes back without the Partial. Traced storage stays as it is: jax's
            # own passes (a jit's inputs and outputs, vmap, grad) hand it through whole.
            whole = self._reduced()
            return (whole._value,), _Meta((whole._mesh, whole._layout, whole._shape))
        return (self._value,), _Meta((self._mesh, self._layout, self._shape))

    def _set_storage(self, value: Any) -> None:
        """Hold `value` (the physical array of the same layout) from now on: `x[idx] = v`."""
        self._value = value
        self._whole = None  # the reduced value of what it held before

    def _reduced(self) -> "DistTensor":
        """This tensor with its Partial placements reduced (made once, until `_set_storage`)."""
        if self._whole is None:
            from .reshard.api import reshard

            self._whole = reshard(self, self._mesh,
                                  self._layout.without_partial().placements(self._mesh))
        return self._whole

    @classmethod
    def tree_unflatten(cls, aux, children):
        value = children[0]
        # jax.tree.map(f, params) rebuilds every node from what f returned. optax's inits make
        # per-param scalars, factored rows, lists of accumulators or MaskedNodes (zero_nans,
        # novograd, adafactor, sm3, muon) that are not this tensor's storage: they come back
        # as what f made, not as a DistTensor claiming the param's shape and placements over
        # something else. Kept as a node: the stored shape itself (tracers, ShapeDtypeStructs,
        # updated arrays), sentinels jax's own round-trips pass (None, object()), and a plain
        # tuple holding the stored shape — f returned (new_value, extra) for
        # jax.tree.transpose to unzip (optax's per-example clipping, GaLore), which needs the
        # node where it was.
        stored = _stored_shape(*aux)
        value_shape = getattr(value, "shape", None)
        if aux[1].partial and value_shape is not None and _in_jax_api("_vjp3_bwd", 4):
            # jax.grad's cotangent of a Partial input's slots (read through jnp, which reduces
            # them): per-slot gradients, not parts of one — the operator path refuses it alike
            raise partial_gradient_error("an input", aux[1].placements(aux[0]))
        # What describes the tensor rather than holds it comes back as f made it, not wrapped in
        # a DistTensor claiming to store it: jax.tree.map(lambda x: x.size, params) is a tree of
        # ints. A dtype or a bool (an optax weight-decay mask, lambda p: p.ndim > 1) reads what
        # storage keeps; a number may have been counted on padded storage, so it is warned of.
        # Other objects (names, shardings, orbax's SaveArgs) keep the node: libraries (orbax)
        # zip such trees with the params, whose structure they must share.
        if isinstance(value, (np.dtype, bool)):
            return value
        if isinstance(value, numbers.Number):
            return _not_storage(value, aux, stored)
        if isinstance(value, (np.ndarray, np.generic)) and tuple(value_shape) == stored:
            # jax.device_get(params), jax.tree.map(np.asarray, params): host values, as for
            # jax.Arrays — the logical global value, not a DistTensor stored on the host
            return _logical(value, *aux, np)
        if value_shape is not None:
            # jax.vmap hands each call a slice of the storage: the node stays, for dist.jit to
            # say that the layout of the mapped dim is lost and to vmap inside instead
            if tuple(value_shape) != stored and not isinstance(value, BatchTracer):
                if value_shape and _in_jax_api("jacfun"):  # jacfwd, jacrev, hessian
                    raise _jacobian_error(aux)
                return _not_storage(value, aux, stored)
        elif value is not None:
            leaves = jax.tree.leaves(value)
            if not (len(leaves) == 1 and leaves[0] is value) and not (
                    type(value) is tuple
                    and any(tuple(getattr(x, "shape", ())) == stored for x in value)):
                return _not_storage(value, aux, stored)
        mesh, layout, shape = aux
        if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
            if not layout.partial and stored == tuple(shape):
                # a concrete result knows how it is laid out: f(param, grad) of two placements,
                # or XLA's choice for a jax.jit output, may differ from the aux it is rebuilt with
                layout = _actual_layout(value, mesh, layout)
            value = _stored_as(value, mesh, layout)
        return cls(value, mesh, layout, shape)

    # -- description -------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return math.prod(self._shape)

    @property
    def dtype(self):
        dtype = self._value.dtype
        # typed PRNG keys (an extended dtype, not a numpy one): jax.random takes them only as a
        # jax.Array, a DistTensor it reads as raw uint32 key data, and its check of that data
        # reads the dtype before it fails on the shape
        if not isinstance(dtype, np.dtype) and (name := _jax_random_key_check()) is not None:
            raise _keys_in_jax_random_error(self, name)
        return dtype

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the logical global value (as jax.Array.nbytes), not of one device's block."""
        return self.size * self.itemsize

    @property
    def is_fully_replicated(self) -> bool:
        return not self._layout.partial and all(p.is_replicated() for p in self.placements)

    def devices(self) -> set:
        """The jax devices of this tensor's mesh (as jax.Array.devices())."""
        return set(self._value.devices())

    def block_until_ready(self) -> "DistTensor":
        """Wait until the stored array is computed (as jax.Array.block_until_ready)."""
        self._value.block_until_ready()
        return self

    @property
    def is_fully_addressable(self) -> bool:
        """Whether this process holds every block (multi-process code asks before numpy())."""
        return self._value.is_fully_addressable

    @property
    def addressable_shards(self) -> list:
        """This process's blocks of the logical value, as jax.Array's (each with its device,
        its index into the global shape, its replica_id and its data). A Partial value's are
        the blocks of its sum (its pending parts are `local(device_id)`); an uneven dim's are
        the rows each device owns, the last blocks shorter (jax's own arrays split evenly
        only)."""
        return [s for s in self.global_shards if s.data is not None]

    @property
    def global_shards(self) -> list:
        """Every device's block of the logical value (as jax.Array.global_shards: the data of
        another process's block is None)."""
        if self._layout.partial or not is_uneven(self._layout, self._mesh, self._shape):
            return self.__jax_array__().global_shards
        held = {s.device: s.data for s in self._value.addressable_shards}
        seen: dict = {}
        blocks = []
        for device_id in self._mesh.process_ids:
            device = self._mesh.device_for(device_id)
            bounds = self.block_bounds(device_id)
            replica = seen[bounds] = seen.get(bounds, -1) + 1
            stored = held.get(device)
            blocks.append(UnevenShard(device, tuple(slice(lo, hi) for lo, hi in bounds),
                                      replica,
                                      None if stored is None else self._owned(stored, bounds)))
        return sorted(blocks, key=lambda b: b.device.id)

    def addressable_data(self, index: int) -> jax.Array:
        """The data of `addressable_shards[index]` (as jax.Array.addressable_data)."""
        return self.addressable_shards[index].data

    @property
    def weak_type(self) -> bool:
        return bool(getattr(self._value, "weak_type", False))

    @property
    def aval(self) -> jax.core.ShapedArray:
        """The logical value's abstract type (global shape, dtype, weak type), as a traced
        value's aval — what code written for jax arrays reads to allocate alike."""
        return jax.core.ShapedArray(self.shape, self.dtype, weak_type=self.weak_type)

    @property
    def device(self):
        """As jax.Array.device of an array on several devices: its sharding."""
        return self.sharding

    def to_device(self, device, *, stream: Any = None) -> jax.Array:
        """The logical value as a plain jax.Array on `device` (a jax Device or Sharding), as
        the array API's to_device: it leaves the mesh (to keep it a DistTensor, reshard)."""
        if stream is not None:
            raise OperandTypeError("DistTensor.to_device: `stream` is not supported (as jax)")
        return jax.device_put(self.__jax_array__(), device)

    @property
    def flat(self):
        raise NotImplementedError("DistTensors, as jax arrays, do not implement .flat: iterate "
                                  "over x.flatten() (or x.ravel()) instead")

    def is_ready(self) -> bool:
        """Whether the stored array is computed (as jax.Array.is_ready)."""
        return self._value.is_ready()

    def copy_to_host_async(self) -> None:
        """Start copying the stored blocks to the host (as jax.Array's), for a later numpy()."""
        self._value.copy_to_host_async()

    @property
    def committed(self) -> bool:
        """Always: a DistTensor's blocks are placed on its mesh's devices (jax.Array's flag)."""
        return True

    def on_device_size_in_bytes(self) -> int:
        """Bytes the stored blocks take on all devices together (as jax.Array's: replicas
        counted each, a Partial tensor's pending parts and an uneven dim's padding included)."""
        return self._value.on_device_size_in_bytes()

    def tobytes(self, order: str = "C") -> bytes:
        """The logical value's bytes (as numpy's and jax.Array's tobytes)."""
        return self.numpy().tobytes(order)

    def delete(self) -> None:
        """Free the stored array now (as jax.Array.delete); the tensor is unusable after."""
        self._value.delete()

    def is_deleted(self) -> bool:
        return self._value.is_deleted()

    @property
    def mesh(self) -> ProcessMesh:
        return self._mesh

    @property
    def process_mesh(self) -> ProcessMesh:  # Paddle's name
        return self._mesh

    def is_dist(self) -> bool:
        """Paddle's query: a DistTensor is distributed."""
        return True

    def _local_value(self) -> jax.Array:
        """Paddle's name for this rank's block: the block of this process's first device in
        the mesh (one device per process, as Paddle runs, makes it that process's own);
        `.local(device_id)` reads any other."""
        mine = {d.id for d in jax.local_devices()}
        for device_id in self._mesh.process_ids:
            if self._mesh.device_for(device_id).id in mine:
                return self.local(device_id)
        raise DeviceNotFoundError(f"this process holds no device of {self._mesh!r}: its blocks "
                                  f"live in the processes that do")

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def placements(self) -> list[Placement]:
        return self._layout.placements(self._mesh)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the block each device stores (of an uneven dim: ceil(size / devices)
        rows, the last devices' partly padding; `local(d)` gives the rows device d owns)."""
        return self._layout.local_shape(padded_shape(self._layout, self._mesh, self._shape),
                                        self._mesh.axis_sizes)

    @property
    def physical(self) -> jax.Array:
        """The jax.Array that stores this tensor (with a leading slot axis if partial)."""
        return self._value

    @property
    def sharding(self):
        return physical_sharding(self._layout, self._mesh)

    @property
    def memory_kind(self) -> str:
        """Where the blocks are stored: "device", or "pinned_host" once `dist.offload`ed."""
        kind = getattr(getattr(self._value, "sharding", None), "memory_kind", None)
        return kind or "device"

    # -- values ------------------------------------------------------------------------------
    def local(self, device_id: int) -> jax.Array:
        """The block held by device `device_id` (its partial value, for a Partial tensor)."""
        if device_id not in self._mesh:
            raise DeviceNotFoundError(
                f"device {device_id} is not in this tensor's mesh {self._mesh!r}: ask for one of "
                f"{self._mesh.process_ids}")
        device = self._mesh.device_for(device_id)
        for shard in self._value.addressable_shards:
            if shard.device == device:
                return self._owned(shard.data, self.block_bounds(device_id))
        raise DeviceNotFoundError(f"device {device_id} belongs to another process; read its "
                                  f"block there")

    def _owned(self, stored: jax.Array, bounds: tuple[tuple[int, int], ...]) -> jax.Array:
        """A device's stored block as the rows it owns (its partial value, for a Partial)."""
        data = stored[0] if self._layout.partial else stored
        # an uneven dim's last blocks end in padding: only the rows the device owns
        if any(hi - lo != n for (lo, hi), n in zip(bounds, data.shape)):
            data = data[tuple(slice(0, hi - lo) for lo, hi in bounds)]
        return data

    def block_bounds(self, device_id: int) -> tuple[tuple[int, int], ...]:
        """[start, stop) per dim of the global region that device `device_id` holds."""
        return block_bounds(self._layout, self._mesh, self._shape, self._mesh.coords_of(device_id))

    def numpy(self) -> np.ndarray:
        """The logical global value, as numpy (Partial values reduced)."""
        from .creation import host_value

        if jax.dtypes.issubdtype(self.dtype, jax.dtypes.prng_key):
            raise OperandTypeError(
                f"a DistTensor of typed PRNG keys ({self.dtype}, shape {list(self._shape)}) has "
                f"no numpy value: read its key data, "
                f"dist.jit(jax.random.key_data)(x).numpy() (a DistTensor of the uint32 words, "
                f"with one more dim), or keep it as keys: dist.unshard_dtensor(x)")
        return host_value(self)

    def __jax_array__(self) -> jax.Array:
        """The logical value as one global jax.Array, split as this tensor is — so
        `jnp.exp(x)` and `jax.nn.relu(x)` take a DistTensor as jax takes a sharded array, and
        return a jax.Array (`dist.jit(f)(x)` keeps the DistTensor and its plan). Pending
        Partial values are reduced and an uneven dim's padding dropped by jax ops on the
        stored array, so this also holds inside a jax transformation that took the
        DistTensor as a pytree (jax.nn.relu is a jax.jit)."""
        import jax.numpy as jnp

        other = _operand_on_other_devices(self)
        if other is not None:
            raise _meshes_meet_error(self, other)
        return _logical(self._value, self._mesh, self._layout, self._shape, jnp)

    def __array__(self, dtype=None, copy=None):
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d DistTensor")
        return self._shape[0]

    # -- display -----------------------------------------------------------------------------
    def __repr__(self) -> str:
        placements = "[" + ", ".join(repr(p) for p in self.placements) + "]"
        # a node jax rebuilt around a sentinel (object(), a prefix marker) has no dtype
        dtype = getattr(self._value, "dtype", "?")
        return (f"DistTensor(shape={self._shape}, dtype={dtype}, mesh={self._mesh!r}, "
                f"placements={placements}, local_shape={self.local_shape})")

    def _repr_html_(self) -> str:
        from .display import dtensor_html

        return dtensor_html(self)


def is_dist_tensor(x: Any) -> bool:
    """`is_leaf` for jax.tree functions that must see DistTensors (a pytree node) whole."""
    return isinstance(x, DistTensor)


def with_own_buffers(x: Any) -> Any:
    """`x` (a DistTensor or jax.Array) copied into buffers of its own, placed as it is — what a
    call donating it may take while `x` stays valid (jnp.copy copies: an identity jit would
    hand the input buffer back); anything else as it is."""
    held = getattr(x, "physical", x)
    if not isinstance(held, jax.Array):
        return x
    held = jax.numpy.copy(held)
    return DistTensor(held, x.mesh, x.layout, x.shape) if isinstance(x, DistTensor) else held


def make_dtensor(value: jax.Array, mesh: ProcessMesh, layout: Layout, shape) -> DistTensor:
    """Wrap a physical array, checking that its shape and sharding are what `layout` implies."""
    expected = physical_shape(layout, mesh, shape)
    assert tuple(value.shape) == expected, (value.shape, expected)
    return DistTensor(value, mesh, layout, tuple(shape))


__all__ = ["DistTensor", "make_dtensor"]
