"""Paddle's `dist.local_map`: run a function written for one device's block on every block of
distributed tensors, and say how its results combine.

    @dist.local_map(out_placements=[[dist.Partial()]], in_placements=[[dist.Shard(0)]],
                    process_mesh=mesh)
    def masked_sum(x):               # x: this device's rows
        return jnp.sum(x * mask_for(dist.get_rank()))

Each input is moved to its `in_placements` (inside dist.jit the plan moves it; in eager mode
an input placed otherwise is an error unless `reshard_inputs=True`, as in Paddle), the function
runs once per device on the local blocks (a `jax.shard_map`), and each result is read by its
`out_placements`: Shard / Replicate say where the blocks go; Partial says the blocks are parts
of one value (summed, averaged, max- or min-reduced over those mesh dims). A Partial result is
handed out with a leading axis of one slot per part, split over the Partial mesh dims, and
reduced over that axis: inside dist.jit that reduction is a pending Partial like any other —
reduced only where a consumer needs it, and fused with later reductions when they commute.

`dist.get_rank()` inside the function is the id of the device running the block (Paddle's
rank: one process per device); elsewhere it is this process's index. Branch on it with
`jnp.where`, not `if`: the function is traced once for all devices.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .dtensor import DistTensor, is_dist_tensor as _is_dt
from .errors import AutoshardError, PlacementError, PlacementTypeError
from .layout import Layout, layout_from_placements
from .mesh import ProcessMesh, as_process_mesh, get_mesh
from .physical import physical_spec
from .placement import (Partial, Placement, ReduceType, Replicate, Shard, parse_placement,
                        mean_of_parts, placement_code)
from .uneven import uneven_dims


class LocalMapError(AutoshardError, ValueError):
    """A local_map call whose placements, inputs or outputs do not fit each other or the mesh."""


_ACTIVE = threading.local()  # the meshes of the local_map bodies being traced, innermost last


def get_rank():
    """Inside a local_map function: the id of the device running this block (a traced int32,
    the mesh's process id of the device, as Paddle's rank). Elsewhere: `jax.process_index()`."""
    stack = getattr(_ACTIVE, "meshes", [])
    if not stack:
        return jax.process_index()
    mesh = stack[-1]
    index = jnp.int32(0)
    for name, size in zip(mesh.dim_names, mesh.shape):
        index = index * size + jax.lax.axis_index(name)
    return jnp.asarray(np.asarray(mesh.process_ids, np.int32).reshape(-1))[index]



def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, DistTensor)) or hasattr(x, "aval")


def _sum_of_parts(y, axis: int):
    """The parts summed in their own dtype, as a reshard's psum sums them (jnp.sum would
    promote uint8 to uint32); truth values: any part true, as a reshard reads their sum."""
    if y.dtype == jnp.bool_:
        return jnp.any(y, axis=axis)
    return jnp.sum(y, axis=axis, dtype=y.dtype)


_REDUCE = {ReduceType.SUM: _sum_of_parts, ReduceType.MAX: jnp.max, ReduceType.MIN: jnp.min,
           ReduceType.AVG: lambda y, axis: _sum_of_parts(y, axis) if y.dtype == jnp.bool_
           else mean_of_parts(y, y.shape[axis], lambda p: _sum_of_parts(p, axis), jnp.int32)}


def local_map(func: Callable | None = None, out_placements: Sequence | None = None,
              in_placements: Sequence | None = None, process_mesh: ProcessMesh | None = None,
              reshard_inputs: bool = False) -> Callable:
    """`func` applied to the local blocks of its inputs; see the module docstring.

    `out_placements`: one placements list per output of `func` (in the order of its flattened
    result); the results come back in the structure `func` returns (a dict, a tuple). `in_placements`: one per positional argument (None: not a distributed input — it
    is handed whole to every device), a list applying to every array in that argument; omitted,
    each DistTensor argument keeps its placements (eager mode only: inside dist.jit the plan
    has not placed anything yet, so they must be given). Usable as `local_map(func, ...)` or as
    a decorator `@local_map(out_placements=...)`.
    """
    if func is None:
        return functools.partial(local_map, out_placements=out_placements,
                                 in_placements=in_placements, process_mesh=process_mesh,
                                 reshard_inputs=reshard_inputs)
    if out_placements is None:
        raise LocalMapError(f"local_map({getattr(func, '__name__', func)!r}) needs "
                            f"out_placements: one placements list per output, e.g. "
                            f"[[dist.Shard(0), dist.Replicate()]] for one output")
    # checked as written; each placement too where the mesh is known (else at the call, where
    # the inputs name it, so that the error can name the mesh dim)
    _check_placements(func, out_placements, in_placements,
                      process_mesh if process_mesh is not None else get_mesh(), now=True)
    eager_programs: dict = {}

    @functools.wraps(func)
    def wrapped(*args):
        if getattr(_ACTIVE, "meshes", []):
            raise LocalMapError(
                f"local_map({_name(func)!r}) called inside the function of another local_map: "
                f"its arguments there are already one device's blocks — call "
                f"{_name(func)!r} itself on them, or move this local_map outside")
        leaves = jax.tree.leaves(args, is_leaf=_is_dt)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return _traced(func, out_placements, in_placements, process_mesh, args)
        return _eager(func, out_placements, in_placements, process_mesh, reshard_inputs, args,
                      eager_programs)

    return wrapped


def _name(func: Callable) -> str:
    return getattr(func, "__name__", repr(func))


def _check_placements(func: Callable, out_placements: Any, in_placements: Any,
                      mesh: ProcessMesh | None, now: bool = False) -> None:
    elements = not now or isinstance(mesh, ProcessMesh)
    _check_placement_lists(func, "out_placements", out_placements, "output", mesh, elements)
    if in_placements is not None:
        _check_placement_lists(func, "in_placements", in_placements, "positional argument",
                               mesh, elements)


def _check_placement_lists(func: Callable, name: str, lists: Any, per: str,
                           mesh: ProcessMesh | None, elements: bool = True) -> None:
    """`out_placements` / `in_placements` as written: a list with one placements list (or None)
    per output / argument, each placement a dist.Shard / Replicate / Partial or its short
    form — checked where local_map is given them, not where their first use fails."""
    head = f"local_map({_name(func)!r}): {name}"
    example = "[[dist.Shard(0), dist.Replicate()]]"
    if isinstance(lists, (Placement, str)) or not isinstance(lists, (list, tuple)):
        raise PlacementTypeError(
            f"{head} is a list with one placements list per {per}, got {lists!r} of type "
            f"{type(lists).__name__}: write e.g. {name}={example} for one {per} on a 2-d mesh")
    if any(isinstance(p, (Placement, str)) for p in lists):
        one = "[" + ", ".join(placement_code(p) for p in lists) + "]"
        raise PlacementTypeError(
            f"{head} = {list(lists)} is one flat list of placements, but it has one placements "
            f"list per {per} (one placement per mesh dim in each): for one {per} write "
            f"{name}=[{one}]")
    dims = mesh.dim_names if isinstance(mesh, ProcessMesh) else None
    for k, placements in enumerate(lists):
        if placements is None or not elements:
            continue
        if not isinstance(placements, (list, tuple)):
            raise PlacementTypeError(
                f"{head}[{k}] is {placements!r} of type {type(placements).__name__}: each {per} "
                f"takes a list with one placement per mesh dim, e.g. "
                f"[dist.Shard(0), dist.Replicate()], or None")
        for i, p in enumerate(placements):
            axis = (f"mesh dim {dims[i]!r}" if dims is not None and i < len(dims)
                    else f"mesh dim {i}")
            where = f"{head}[{k}][{i}] (for {per} {k}, {axis})"
            if isinstance(p, str):
                try:
                    parse_placement(p)
                except PlacementError as e:
                    raise PlacementError(f"{where}: {e.message}") from None
            elif not isinstance(p, Placement):
                raise PlacementTypeError(
                    f"{where} is {p!r} of type {type(p).__name__}, not a placement: write "
                    f"dist.Shard(d) to split tensor dim d over that mesh dim, dist.Replicate() "
                    f"to copy it, or dist.Partial() for parts of a sum")


def _check_arity(func: Callable, in_placements: Sequence, args: tuple) -> None:
    if len(in_placements) != len(args):
        raise LocalMapError(
            f"local_map({_name(func)!r}) got {len(args)} positional arguments but "
            f"{len(in_placements)} in_placements: give one per argument (None for an argument "
            f"that is not distributed)")


def _eager(func, out_placements, in_placements, mesh, reshard_inputs, args, programs):
    """Outside any trace: infer what was not given from the DistTensors, check them, and run
    the traced form under dist.jit (one compiled program per input placements)."""
    from .compiler.jit import jit

    dts = [x for x in jax.tree.leaves(args, is_leaf=_is_dt) if _is_dt(x)]
    mesh = mesh if mesh is not None else dts[0].mesh if dts else get_mesh()
    if mesh is None:
        raise LocalMapError(f"local_map({_name(func)!r}) got no DistTensor input: give "
                            f"process_mesh= (or dist.auto_parallel.set_mesh) so it knows which "
                            f"devices to run on")
    mesh = as_process_mesh(mesh)
    _check_placements(func, out_placements, in_placements, mesh)
    if in_placements is None:
        in_placements = [_arg_placements(a) for a in args]
    _check_arity(func, in_placements, args)
    for k, (a, pl) in enumerate(zip(args, in_placements)):
        for path, x in jax.tree_util.tree_flatten_with_path(a, is_leaf=_is_dt)[0]:
            if not _is_dt(x) or pl is None:
                continue
            what = f"argument {k}{jax.tree_util.keystr(path)} (shape {tuple(x.shape)})"
            want = layout_from_placements(pl, mesh, x.shape, what=what)
            if reshard_inputs or (x.layout == want and x.mesh == mesh):
                continue
            asked = want.placements(mesh)
            if x.mesh != mesh:
                where = f"is on {x.mesh!r}, but local_map runs on {mesh!r}"
            else:
                where = "; ".join(
                    f"on mesh dim {name!r} it is {have!r}, the function expects {wanted!r}"
                    for name, have, wanted in zip(mesh.dim_names, x.layout.placements(mesh),
                                                  asked) if have != wanted)
                where = f"is placed {x.placements}, but in_placements asks for {asked}: {where}"
            raise LocalMapError(
                f"local_map({_name(func)!r}): {what} {where} — write "
                f"dist.reshard(x, mesh, {asked}) before the call, or pass reshard_inputs=True")
    key = (mesh, tuple(None if p is None else tuple(map(repr, p)) for p in in_placements))
    f = programs.get(key)
    if f is None:
        def run(*a):
            return _traced(func, out_placements, in_placements, mesh, a)
        run.__name__ = _name(func)
        f = programs[key] = jit(run, out_placements=_keep_as_given(out_placements))
    return f(*args)


def _keep_as_given(out_placements: Sequence) -> Any:
    # the results are handed out as out_placements says, Partial ones unreduced
    # (None — an array output without placements — is refused when the function is traced)
    kept = [None if p is None else list(p) for p in out_placements]
    return kept if len(kept) > 1 else kept[0]


def _arg_placements(arg: Any) -> list | None:
    placed = [x for x in jax.tree.leaves(arg, is_leaf=_is_dt) if _is_dt(x)]
    if not placed:
        return None
    if any(x.placements != placed[0].placements for x in placed[1:]):
        raise LocalMapError("local_map: an argument holds DistTensors placed differently; give "
                            "in_placements, or pass them as separate arguments")
    return placed[0].placements


def _traced(func, out_placements, in_placements, mesh, args):
    if in_placements is None:
        raise LocalMapError(
            f"local_map({_name(func)!r}) inside dist.jit needs in_placements: the plan places "
            f"values after tracing, so the blocks the function gets must be named, e.g. "
            f"in_placements=[[dist.Shard(0), dist.Replicate()]] for one argument split by rows"
            + ("" if mesh is not None or get_mesh() is not None
               else ", and process_mesh= (the devices they run on)"))
    mesh = mesh if mesh is not None else get_mesh()
    if mesh is None:
        raise LocalMapError(f"local_map({_name(func)!r}) inside a traced function needs "
                            f"process_mesh=: the devices its blocks run on")
    mesh = as_process_mesh(mesh)
    _check_placements(func, out_placements, in_placements, mesh)
    _check_arity(func, in_placements, args)
    from .creation import annotate

    flat_args, arg_tree = jax.tree.flatten(args)
    specs, placed = [], []
    per_leaf = [pl for a, pl in zip(args, in_placements) for _ in jax.tree.leaves(a)]
    for k, (x, pl) in enumerate(zip(flat_args, per_leaf)):
        if pl is None or not _is_array(x):
            specs.append(jax.sharding.PartitionSpec())
            placed.append(x)
            continue
        layout = layout_from_placements(pl, mesh, tuple(np.shape(x)),
                                        what=f"local_map input {k}")
        bad = uneven_dims(layout, mesh, np.shape(x))
        if bad:  # a block per device has no one shape to write code for
            d = bad[0]
            axes = layout.dims[d]
            n = int(np.prod([mesh.get_dim_size(a) for a in axes]))
            raise LocalMapError(
                f"local_map({_name(func)!r}): input {k} of shape {tuple(np.shape(x))} placed "
                f"{list(pl)} splits dim {d} of size {np.shape(x)[d]} over mesh dim(s) "
                f"{list(axes)} ({n} devices), unevenly: the function's blocks must be "
                f"equal — pad dim {d} to a multiple of {n}, or keep it whole (Replicate)")
        if layout.partial:
            raise LocalMapError(
                f"local_map({_name(func)!r}): in_placements {list(pl)} is Partial; a function "
                f"of local blocks reads whole values or shards: reshard it to Replicate or "
                f"Shard first")
        specs.append(physical_spec(layout, mesh))
        placed.append(annotate(x, mesh, pl, force=True) if isinstance(x, jax.core.Tracer)
                      else x)

    out_tree: list = []  # the structure of func's result, handed back as func gave it

    def body(*local):
        _ACTIVE.meshes = getattr(_ACTIVE, "meshes", []) + [mesh]
        try:
            out = func(*jax.tree.unflatten(arg_tree, list(local)))
        finally:
            _ACTIVE.meshes = _ACTIVE.meshes[:-1]
        leaves, tree = jax.tree.flatten(out)
        out_tree[:] = [tree]
        return leaves

    jmesh = mesh.to_jax()
    # local output shapes (out_specs P(): global = local), to read the placements against
    probe = jax.eval_shape(jax.shard_map(body, mesh=jmesh, in_specs=tuple(specs),
                                         out_specs=jax.sharding.PartitionSpec(),
                                         check_vma=False), *placed)
    if len(probe) != len(out_placements):
        raise LocalMapError(
            f"local_map({_name(func)!r}) returns {len(probe)} arrays but out_placements has "
            f"{len(out_placements)} entries: give one placements list per output")
    layouts = [_out_layout(pl, mesh, tuple(s.shape), k, func)
               for k, (pl, s) in enumerate(zip(out_placements, probe))]

    def slotted(*local):
        return [y[None] if L.partial else y for y, L in zip(body(*local), layouts)]

    try:
        outs = jax.shard_map(slotted, mesh=jmesh, in_specs=tuple(specs),
                             out_specs=[physical_spec(L, mesh) for L in layouts],
                             check_vma=True)(*placed)
    except ValueError as e:
        if "varying" not in str(e) and "replicat" not in str(e):
            raise
        raise LocalMapError(
            f"local_map({_name(func)!r}): an output differs between devices of a mesh dim where "
            f"out_placements {[list(p) for p in out_placements]} says Replicate: name how the "
            f"blocks combine there — Shard(d) (pieces of dim d), Partial() (parts of a sum) — "
            f"or make them equal inside with jax.lax.psum / pmax / pmin over that mesh dim "
            f"(jax counts an all_gather's result as still differing: say Shard(d) and "
            f"return the block instead)"
            ) from None
    results = []
    for y, L in zip(outs, layouts):
        if L.partial:
            kind = L.partial[0][1]
            y = _REDUCE[ReduceType(kind)](y, axis=0)  # the slots' parts combined: pending
        results.append(y)
    return jax.tree.unflatten(out_tree[0], results)


def _out_layout(placements: Sequence[Placement], mesh: ProcessMesh, local: tuple, k: int,
                func) -> Layout:
    """The layout of output `k` from its placements and its local block's shape."""
    if placements is None:
        raise LocalMapError(f"local_map({_name(func)!r}): output {k} is an array; give it "
                            f"placements (None is for outputs that are not tensors)")
    global_shape = list(local)
    for name, p in zip(mesh.dim_names, placements):
        p = parse_placement(p) if isinstance(p, str) else p
        if p.is_shard() and local:  # a block of a split dim is 1/size of it
            global_shape[p.get_dim() % len(local)] *= mesh.get_dim_size(name)
    layout = layout_from_placements(placements, mesh, tuple(global_shape),
                                    what=f"local_map output {k}")
    kinds = {t for _, t in layout.partial}
    if len(kinds) > 1:
        # (the slots of a local_map output are combined with one reduction; a reshard or a
        # dist.jit output may mix sum and avg)
        named = ", ".join(f"{a!r} {t.value}" for a, t in layout.partial)
        raise LocalMapError(
            f"local_map({_name(func)!r}): output {k} is pending more than one kind of "
            f"reduction ({named}); a local_map output takes one kind: reduce one of them inside "
            f"(jax.lax.psum / pmean over that mesh dim, and place it Replicate()), or return "
            f"the parts of one kind (Partial() on every pending dim, each block divided by the "
            f"device count of the mean's mesh dims), then dist.reshard the result")
    return layout


__all__ = ["local_map", "get_rank", "LocalMapError"]
