"""Making DistTensors: shard_tensor, dtensor_from_fn, dtensor_from_local, and back (unshard)."""
from __future__ import annotations

import itertools
import json
import sys
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .compiler.dtypes import cost_dtype, dtype_name
from .dtensor import DistTensor, make_dtensor
from .errors import LocalDataError, PlacementTypeError, ReshardError
from .layout import Layout, block_bounds, check_partial_dtype, layout_from_placements
from .paddle_names import paddle_names
from .mesh import ProcessMesh, as_process_mesh, one_device_per_process, spans_every_process
from .physical import HOST_MEMORY_KINDS, device_put, physical_shape, physical_sharding
from .placement import Placement, Replicate, Shard, normalize_placements
from .uneven import (even_part, is_key, is_uneven, key_partial_error, pad_global, padded_shape,
                     warn_uneven)


def _describe(shape, dtype) -> str:
    return f"the tensor {dtype_name(dtype)}{list(shape)}"


def _to_array(data: Any, dtype=None):
    if dtype is not None:
        try:
            dtype = jnp.dtype(dtype)
        except TypeError:
            raise PlacementTypeError(f"dtype={dtype!r} is not a dtype: write e.g. "
                                     f"dtype='float32' or dtype=jnp.bfloat16") from None
    if isinstance(data, jax.Array):
        return data if dtype is None else data.astype(dtype)
    try:
        arr = np.asarray(data, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as e:  # ragged lists, values the dtype cannot hold
        raise PlacementTypeError(f"cannot make a tensor from {type(data).__name__} "
                                 f"{data!r:.80} ({e}): pass a numpy array, a jax.Array, a number "
                                 f"or a rectangular nested list of numbers") from None
    # strings and raw bytes are not numbers (bfloat16 and the float8s are kind "V" too)
    if arr.dtype == object or arr.dtype.kind in "US" or arr.dtype.type is np.void:
        raise PlacementTypeError(f"cannot make a tensor from {type(data).__name__} {data!r:.80}"
                                 f" (numpy dtype {arr.dtype}): pass a numpy array, a jax.Array, "
                                 f"a number or a nested list of numbers")
    # Python floats and ints become float32 / int32 unless jax_enable_x64 is on, as in jnp.
    return arr.astype(jax.dtypes.canonicalize_dtype(arr.dtype), copy=False)


def _add_partial(value: jax.Array, mesh: ProcessMesh, layout: Layout, shape) -> DistTensor:
    """Turn the physical array of layout.without_partial() into that of `layout` (local steps)."""
    base = make_dtensor(value, mesh, layout.without_partial(), shape)
    if not layout.partial:
        return base
    check_partial_dtype(layout, value.dtype, _describe(shape, value.dtype))
    if is_uneven(layout, mesh, shape):  # the partial steps work on even blocks
        from .reshard.api import reshard

        return reshard(base, mesh, layout.placements(mesh))
    from .reshard.api import plan_layouts
    from .reshard.execute import execute
    from .cost_model import default_cost_model

    plan = plan_layouts(tuple(shape), cost_dtype(value.dtype), mesh, base.layout, mesh, layout,
                        default_cost_model())
    return make_dtensor(execute(plan, value), mesh, layout, shape)


def _reject_tracer(data: Any, verb: str) -> None:
    if isinstance(data, jax.core.Tracer):
        raise ReshardError(
            f"dist.{verb} got a traced value: inside jax.jit it needs dist.jit to partition the "
            f"function; outside a transformation pass a concrete array")


def annotate(x, mesh: ProcessMesh, placements, *, force: bool):
    """Inside dist.jit: fix the placement of a traced value (force: a hard conversion point)."""
    from .compiler.trace import bind_hint

    layout = layout_from_placements(placements, mesh, tuple(x.shape),
                                    what=_describe(x.shape, x.dtype))
    even = even_part(layout, mesh, tuple(x.shape))
    if even is not layout:  # programs compute on even layouts only (uneven.py)
        warn_uneven(layout, mesh, tuple(x.shape),
                    f"a traced value given placements {layout.describe(mesh)}",
                    "is computed with that dim whole inside dist.jit")
    return bind_hint(x, mesh, even, force)


def shard_tensor(data: Any, mesh: ProcessMesh, placements: Sequence[Placement | str], dtype=None,
                 place: Any = None, stop_gradient: bool | None = None) -> DistTensor:
    """Place `data` (numpy, jax.Array, scalar or list) on `mesh` as `placements` describe.

    The logical value is `data` for every placement: a Partial placement stores it so that the
    reduction over the mesh dim gives `data` back (sum: one device holds it, the rest zeros).
    `stop_gradient` and `place` are accepted for Paddle compatibility and ignored. A flax nnx
    Param (or other Variable) gives a Variable of its kind holding the DistTensor, as Paddle
    gives a parameter for a parameter.
    """
    mesh = as_process_mesh(mesh)
    variable = _nnx_variable(data)
    if variable is not None:
        # Paddle returns a parameter for a parameter (`layer.weight = dist.shard_tensor(
        # layer.weight, ...)`): an nnx Param (or other Variable) of the same kind holding the
        # DistTensor — a bare DistTensor assigned there is no parameter to flax, not trained
        return variable.replace(shard_tensor(variable.get_value(), mesh, placements, dtype))
    if isinstance(data, DistTensor):
        from .reshard.api import reshard

        out = reshard(data, mesh, placements)
        return out if dtype is None else shard_tensor(np.asarray(out), mesh, placements, dtype)
    if isinstance(data, jax.core.Tracer):
        return annotate(data, mesh, placements, force=False)
    arr = _to_array(data, dtype)
    shape = tuple(arr.shape)
    layout = layout_from_placements(placements, mesh, shape, what=_describe(shape, arr.dtype))
    if layout.partial and is_key(arr):
        raise key_partial_error(_describe(shape, arr.dtype), layout.placements(mesh))
    stored = pad_global(arr, layout, mesh, shape, jnp if isinstance(arr, jax.Array) else np)
    value = device_put(stored, physical_sharding(layout.without_partial(), mesh))
    return _add_partial(value, mesh, layout, shape)


def _nnx_variable(x: Any) -> Any:
    """`x` if it is a flax nnx Variable (flax is not imported for the question), else None."""
    nnx = sys.modules.get("flax.nnx")
    return x if nnx is not None and isinstance(x, nnx.Variable) else None


def dtensor_from_fn(fn: Callable[..., Any], mesh: ProcessMesh,
                    placements: Sequence[Placement | str], *args, **kwargs) -> DistTensor:
    """Call `fn(*args, **kwargs)` (e.g. jnp.ones, a random init) and place its result.

    The call is compiled with the target sharding, so each device computes only its block and
    the full tensor is never built on one device.
    """
    if not callable(fn):
        raise PlacementTypeError(f"dtensor_from_fn needs a function that makes the array (e.g. "
                                 f"jnp.ones), got {type(fn).__name__} {fn!r:.60}: write "
                                 f"dist.dtensor_from_fn(jnp.ones, mesh, placements, shape)")
    mesh = as_process_mesh(mesh)
    thunk = lambda: fn(*args, **kwargs)  # noqa: E731
    traced, aval = jax.make_jaxpr(thunk, return_shape=True)()
    if not hasattr(aval, "shape"):
        raise PlacementTypeError(f"dtensor_from_fn: {getattr(fn, '__name__', fn)} returned "
                                 f"{type(aval).__name__}, not one array")
    shape = tuple(aval.shape)
    layout = layout_from_placements(placements, mesh, shape, what=_describe(shape, aval.dtype))
    if _draws_philox(traced.jaxpr):
        # XLA cannot compile a Philox key's hash in a partitioned program (its multiply-high:
        # "Unable to convert MHLO to StableHLO", plain jax.jit with shardings too): planned
        # as a dist.jit program, each device draws its own block (rules/random.py)
        from .compiler.jit import jit
        from .reshard.api import reshard

        placed = jit(lambda: shard_tensor(thunk(), mesh, layout.without_partial().placements(
            mesh)))()
        return reshard(placed, mesh, layout.placements(mesh))
    value = jax.jit(lambda: pad_global(thunk(), layout, mesh, shape, jnp),
                    out_shardings=physical_sharding(layout.without_partial(), mesh))()
    return _add_partial(value, mesh, layout, shape)


def _draws_philox(jaxpr) -> bool:
    """Whether `jaxpr` (or a body in it) holds a key of a Philox generator."""
    from .rules.random import is_philox_impl

    for e in jaxpr.eqns:
        if is_philox_impl(e.params.get("impl")) or any(
                is_philox_impl(getattr(getattr(v.aval, "dtype", None), "_impl", None))
                for v in (*e.invars, *e.outvars)):
            return True
        for p in e.params.values():
            for sub in (p if isinstance(p, tuple) else (p,)):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
                if hasattr(inner, "eqns") and _draws_philox(inner):
                    return True
    return False


def dtensor_from_local(local_tensor: Any, mesh: ProcessMesh,
                       placements: Sequence[Placement | str]) -> DistTensor:
    """Assemble a DistTensor from each device's own block.

    `local_tensor` is a list with one array per device in mesh order (row-major over mesh
    coordinates), a function of a device's mesh coordinates returning its block, or one array
    that every device holds. For Partial mesh dims the blocks are the partial values; for
    Replicate dims they should agree (each device keeps its own).

    Across processes each process places only its own devices' blocks: the blocks of other
    processes' devices may be None (as `dtensor_to_local` gives them), or arrays that are only
    read for their shapes. Where they are None the split is taken to be even (Paddle's rule:
    the global shape is the local one times the mesh dims splitting it), and the processes
    check that they agree on it; an uneven tensor needs every device's block (its shape).
    """
    mesh = as_process_mesh(mesh)
    coords = list(itertools.product(*(range(s) for s in mesh.shape)))
    if callable(local_tensor):
        blocks = [local_tensor(c) for c in coords]
    elif isinstance(local_tensor, (list, tuple)) and local_tensor and all(
            b is None or isinstance(b, (np.ndarray, jax.Array)) for b in local_tensor) and any(
            b is not None for b in local_tensor):
        if len(local_tensor) != mesh.size:
            raise LocalDataError(
                f"dtensor_from_local got {len(local_tensor)} blocks for a mesh of {mesh.size} "
                f"devices {mesh.process_ids}: give one block per device in mesh order, or a "
                f"function of the mesh coordinates")
        blocks = list(local_tensor)
    else:
        blocks = [local_tensor] * len(coords)
    devices = mesh.devices()
    mine = {d.id for d in jax.local_devices()}
    here = [devices[c].id in mine for c in coords]
    for c, b, h in zip(coords, blocks, here):
        if b is None and h:
            raise LocalDataError(
                f"dtensor_from_local: the block for the device at mesh coords {c} (id "
                f"{int(mesh.id_array[c])}) is None, but that device belongs to this process: "
                f"give its block (None stands only for the devices of other processes)")
    for b in blocks:
        _reject_tracer(b, "dtensor_from_local")
    blocks = [None if b is None else _to_array(b) for b in blocks]
    first = next(b for b in blocks if b is not None)
    for c, b in zip(coords, blocks):
        if b is not None and (b.ndim != first.ndim or b.dtype != first.dtype):
            raise LocalDataError(
                f"dtensor_from_local: the block for the device at mesh coords {c} "
                f"(id {int(mesh.id_array[c])}) is {dtype_name(b.dtype)}{list(b.shape)}, but the "
                f"first is {dtype_name(first.dtype)}{list(first.shape)}: every device's block "
                f"must have the same number of dims and dtype")
    placements = normalize_placements(placements, mesh.ndim, mesh.dim_names)
    factor = [1] * first.ndim
    for name, p in zip(mesh.dim_names, placements):
        if isinstance(p, Shard) and -first.ndim <= p.dim < first.ndim:
            factor[p.dim % first.ndim] *= mesh.get_dim_size(name)
    even = tuple(s * f for s, f in zip(first.shape, factor))
    layout = layout_from_placements(placements, mesh, even, what=_describe(even, first.dtype))
    unknown = any(b is None for b in blocks)  # another process's: taken to be even
    shape = _global_shape(layout, mesh, coords, [first if b is None else b for b in blocks])
    if unknown and jax.process_count() > 1:
        _check_processes_agree(shape, first, placements)
    if shape != even:  # blocks of an uneven split (dtensor_to_local's of an uneven tensor)
        layout = layout_from_placements(placements, mesh, shape,
                                        what=_describe(shape, first.dtype))
    if layout.partial and is_key(first):
        raise key_partial_error(f"dtensor_from_local: blocks {dtype_name(first.dtype)}"
                                f"{list(first.shape)}", list(placements))
    local = layout.local_shape(padded_shape(layout, mesh, shape), mesh.axis_sizes)
    for c, b in zip(coords, blocks):
        want = tuple(hi - lo for lo, hi in block_bounds(layout, mesh, shape, c))
        if b is not None and b.shape != want:
            raise LocalDataError(
                f"dtensor_from_local: the block for the device at mesh coords {c} "
                f"(id {int(mesh.id_array[c])}) is {dtype_name(b.dtype)}{list(b.shape)}, but "
                f"placed {list(placements)} in a tensor of shape {list(shape)} it holds "
                f"{list(want)}: every device's block has the same shape, but where a dim does "
                f"not divide evenly — then each holds ceil(size / devices) rows, the last ones "
                f"fewer" + ("; with the blocks of other processes' devices given as None the "
                            "split is taken to be even: for an uneven one give every device's "
                            "block" if unknown else ""))
    sharding = physical_sharding(layout, mesh)
    # each process places the blocks of its own devices; jax joins the processes' parts
    placed = [jax.device_put(_padded(b, local)[None] if layout.partial else _padded(b, local),
                             devices[c]) for c, b, h in zip(coords, blocks, here) if h]
    value = jax.make_array_from_single_device_arrays(physical_shape(layout, mesh, shape),
                                                     sharding, placed)
    return make_dtensor(value, mesh, layout, shape)


def _check_processes_agree(shape: tuple, first: Any, placements: Sequence) -> None:
    """Every process must build one global tensor: with other processes' blocks unknown, the
    shape each process inferred from its own blocks (and their dtype) is compared across them
    (a collective) — a process holding only the short last blocks of an uneven split would
    infer a smaller one, and the processes would then wait for each other forever."""
    from .agreement import differences

    every = differences(json.dumps([list(shape), dtype_name(first.dtype)]).encode())
    if every is not None:
        seen = {i: tuple(json.loads(mine)) for i, (mine, _) in enumerate(every)}
        raise LocalDataError(
            f"dtensor_from_local: the processes' blocks, placed {list(placements)}, make "
            f"different tensors (process: (global shape, dtype)) {seen}: with the blocks of "
            f"other processes' devices given as None, each process takes the split to be even "
            f"— give every device's block (their shapes) for an uneven split, and the same "
            f"dtype and block shapes in every process")


def _global_shape(layout: Layout, mesh: ProcessMesh, coords: list, blocks: list) -> tuple:
    """The shape the blocks make together: along each split dim, the sum of the blocks of the
    devices that split it (the other mesh coordinates at 0)."""
    sizes = mesh.axis_sizes
    index = {c: k for k, c in enumerate(coords)}
    shape = []
    for d, axes in enumerate(layout.dims):
        total = 0
        for along in itertools.product(*(range(sizes[a]) for a in axes)):
            position = dict(zip(axes, along))
            c = tuple(position.get(name, 0) for name in mesh.dim_names)
            total += blocks[index[c]].shape[d]
        shape.append(total if axes else blocks[0].shape[d])
    return tuple(shape)


def _padded(b: Any, local: Sequence[int]) -> Any:
    """Block `b` padded with zeros at the end of each dim to the stored block shape."""
    if tuple(b.shape) == tuple(local):
        return b
    widths = [(0, n - s) for s, n in zip(b.shape, local)]
    if is_key(b):  # PRNG keys pad as their key data (there is no zero key)
        data = jax.random.key_data(b)
        return jax.random.wrap_key_data(jnp.pad(data, widths + [(0, 0)] * (data.ndim - b.ndim)),
                                        impl=jax.random.key_impl(b))
    return jnp.pad(b, widths)


@paddle_names(dist_tensor="x")
def dtensor_to_local(x: DistTensor, mesh: ProcessMesh | None = None,
                     placements: Sequence[Placement | str] | None = None) -> list:
    """Each device's block of `x`, one per device in mesh order (row-major over mesh
    coordinates): the inverse of `dtensor_from_local` given a list. A Partial tensor's blocks
    are its partial values. A device of another process gives None (read it there).

    `mesh` / `placements` (Paddle's arguments) name what `x` is expected to be; a tensor placed
    otherwise is an error, not a silent reshard: `dist.reshard` it first.
    """
    if not isinstance(x, DistTensor):
        if isinstance(x, jax.core.Tracer):
            raise LocalDataError(
                "dtensor_to_local got a traced value: inside dist.jit the plan decides where "
                "values live after tracing; write the per-device part as a function and run it "
                "with dist.local_map(fn, out_placements=..., in_placements=...)")
        raise PlacementTypeError(f"dtensor_to_local needs a DistTensor, got {type(x).__name__}: "
                                 f"make one with dist.shard_tensor or dist.dtensor_from_local")
    if mesh is not None and as_process_mesh(mesh) != x.mesh:
        raise LocalDataError(f"dtensor_to_local: the tensor lives on {x.mesh!r}, not on "
                             f"{as_process_mesh(mesh)!r}: dist.reshard(x, mesh, placements) "
                             f"first")
    if placements is not None:
        want = normalize_placements(placements, x.mesh.ndim, x.mesh.dim_names)
        if list(want) != list(x.placements):
            raise LocalDataError(f"dtensor_to_local: the tensor is placed {x.placements}, not "
                                 f"{list(want)}: dist.reshard(x, mesh, {list(want)}) first, or "
                                 f"pass its own placements")
    if not isinstance(x.physical, jax.core.Tracer) and x.physical.is_deleted():
        raise ReshardError(f"dtensor_to_local: a DistTensor {dtype_name(x.dtype)}{list(x.shape)} "
                           f"placed {x.placements} was donated to a dist.jit call "
                           f"(donate_argnums) and its buffers are gone: read that call's result "
                           f"instead, or stop donating it")
    mine = {d.id for d in jax.local_devices()}
    blocks = []
    for c in itertools.product(*(range(n) for n in x.mesh.shape)):
        device_id = int(x.mesh.id_array[c])
        on = x.mesh.device_for(device_id).id in mine
        blocks.append(x.local(device_id) if on else None)
    return blocks


def offload(tree: Any, memory_kind: str = "pinned_host") -> Any:
    """Every DistTensor of `tree` with its blocks moved to host memory (same mesh and
    placements); `memory_kind="device"` brings them back. A dist.jit program reading an
    offloaded tensor copies it to the devices inside the program, where it is needed."""
    if memory_kind not in HOST_MEMORY_KINDS + ("device",):
        raise PlacementTypeError(f"offload: memory_kind {memory_kind!r} is not one of "
                                 f"{HOST_MEMORY_KINDS + ('device',)}")

    def move(x):
        if not isinstance(x, DistTensor) or x.memory_kind == memory_kind:
            return x
        value = jax.device_put(x.physical, x.physical.sharding.with_memory_kind(memory_kind))
        return make_dtensor(value, x.mesh, x.layout, x.shape)

    return jax.tree.map(move, tree, is_leaf=lambda x: isinstance(x, DistTensor))


@paddle_names(dist_tensor="x")
def unshard_dtensor(x: DistTensor) -> jax.Array:
    """The logical value of `x` as a jax.Array replicated over its mesh."""
    if not isinstance(x, DistTensor):
        raise PlacementTypeError(f"unshard_dtensor needs a DistTensor, got {type(x).__name__}")
    from .reshard.api import reshard

    return reshard(x, x.mesh, [Replicate()] * x.mesh.ndim).physical


def host_value(x: DistTensor) -> np.ndarray:
    """The logical value of `x` as numpy, in every process (DistTensor.numpy).

    A mesh without a device of some process (a pipeline stage on another host) is first copied
    to one device of every process — a collective: every process must ask, as every process
    runs the same program."""
    value = unshard_dtensor(x)
    if not spans_every_process(x.mesh):
        from .reshard.api import reshard

        world = one_device_per_process()
        replicated = make_dtensor(value, x.mesh, Layout.replicated(len(x.shape)), x.shape)
        value = reshard(replicated, world, [Replicate()]).physical
    return np.asarray(value)


__all__ = ["shard_tensor", "dtensor_from_fn", "dtensor_from_local", "unshard_dtensor",
           "host_value"]
