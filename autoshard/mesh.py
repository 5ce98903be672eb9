"""ProcessMesh: an N-d array of device ids with named dims, and its jax.sharding.Mesh.

Ids may come in any order (`[[2, 4, 5], [0, 1, 3]]` is legal); they are jax device ids, which
across processes are global. Devices are looked up lazily, so meshes can be built and compared
without any device, and a missing device is reported where the mesh is first used.
"""
from __future__ import annotations

import os
from functools import cached_property, lru_cache
from typing import Any, Sequence

import numpy as np

from .errors import DeviceNotFoundError, MeshError
from .hashing import hash_once


def _to_id_array(mesh: Any) -> np.ndarray:
    if isinstance(mesh, ProcessMesh):
        return mesh.id_array
    try:
        arr = np.asarray(mesh)
    except ValueError as exc:  # numpy refuses ragged nested lists
        raise MeshError(f"the mesh {mesh!r} is ragged: every row must have the same length, "
                        f"e.g. [[0, 1], [2, 3]]") from exc
    if arr.dtype == object:
        raise MeshError(f"the mesh {mesh!r} is ragged or holds non-integers: write a rectangular "
                        f"nested list of device ids, e.g. [[0, 1], [2, 3]]")
    if arr.size == 0:
        raise MeshError("the mesh is empty: it needs at least one device id, e.g. [0, 1, 2, 3]")
    if arr.ndim == 0:  # ProcessMesh(3) read as [3] is one device, not three
        n = int(arr) if np.issubdtype(arr.dtype, np.integer) and 0 < arr <= 16 else None
        raise MeshError(f"the mesh {mesh!r} is a single number, not a list of device ids: write "
                        + (f"dist.ProcessMesh({list(range(n))}) for {n} devices (or "
                           f"dist.ProcessMesh(list(range({n})))), dist.ProcessMesh([{n}]) for "
                           f"device {n} alone" if n is not None else
                           "a list of device ids, e.g. dist.ProcessMesh([0, 1, 2]) or "
                           "dist.ProcessMesh(list(range(n))) for n devices"))
    if not np.issubdtype(arr.dtype, np.integer):
        raise MeshError(f"mesh entries must be integer device ids, got dtype {arr.dtype} in "
                        f"{mesh!r}: write e.g. [[0, 1], [2, 3]]")
    if (arr < 0).any():
        raise MeshError(f"device ids must be >= 0, got {sorted(set(arr[arr < 0].tolist()))}")
    ids, counts = np.unique(arr, return_counts=True)
    if (counts > 1).any():
        raise MeshError(f"device ids {ids[counts > 1].tolist()} appear more than once in mesh "
                        f"{arr.tolist()}: each device may sit at one mesh position only")
    return arr.astype(np.int64)


@lru_cache(maxsize=256)
def _device_table(ids: tuple[int, ...]) -> dict | None:
    """Mesh entry -> jax device, for the entries `ids` (see ProcessMesh.device_for); None when
    they name no devices this process knows of."""
    import jax

    devices = jax.devices()
    by_id = {d.id: d for d in devices}
    if all(i in by_id for i in ids):
        return {i: by_id[i] for i in ids}
    if all(i < len(devices) for i in ids):
        return {i: devices[i] for i in ids}
    return None


class ProcessMesh:
    """A named N-d arrangement of devices (Paddle's `ProcessMesh`)."""

    def __init__(self, mesh: Any = None, dim_names: Sequence[str] | None = None,
                 shape: Sequence[int] | None = None, process_ids: Sequence[int] | None = None):
        if mesh is None and process_ids is not None:  # Paddle's ProcessMesh(shape=, process_ids=)
            flat = _to_id_array(process_ids).reshape(-1)
            size = int(np.prod(shape)) if shape is not None else flat.size
            if shape is not None and size != flat.size:
                raise MeshError(f"ProcessMesh(shape={list(shape)}, process_ids=...): the shape "
                                f"holds {size} devices but {flat.size} process ids are given")
            mesh = flat.reshape(list(shape) if shape is not None else [flat.size]).tolist()
        elif mesh is None or shape is not None or process_ids is not None:
            raise MeshError("ProcessMesh takes the device ids as a nested list (ProcessMesh([[0, 1], "
                            "[2, 3]], dim_names=['dp', 'mp'])), or Paddle's shape= with "
                            "process_ids= (and no mesh)")
        ids = _to_id_array(mesh)
        if dim_names is None:
            dim_names = [f"d{i}" for i in range(ids.ndim)]
        if isinstance(dim_names, str) or not all(isinstance(n, str) for n in dim_names):
            raise MeshError(f"dim_names must be a list of strings, one per mesh dim, got {dim_names!r}")
        dim_names = list(dim_names)
        if len(dim_names) != ids.ndim:
            raise MeshError(
                f"dim_names {dim_names} has {len(dim_names)} names but the mesh has {ids.ndim} dims "
                f"(shape {list(ids.shape)}): give one name per dim, e.g. "
                f"{[f'd{i}' for i in range(ids.ndim)]}")
        if any(not n.strip() for n in dim_names):
            raise MeshError(f"dim_names {dim_names} has an empty name: each mesh dim needs a "
                            f"name to be placed and referred to by, e.g. "
                            f"{[f'd{i}' for i in range(ids.ndim)]} or ['dp', 'mp']")
        if len(set(dim_names)) != len(dim_names):
            dup = sorted({n for n in dim_names if dim_names.count(n) > 1})
            raise MeshError(f"dim_names {dim_names} repeats {dup}: each mesh dim needs its own name")
        ids.setflags(write=False)
        self._ids = ids
        self._dim_names = tuple(dim_names)

    # -- description ---------------------------------------------------------------------
    @property
    def id_array(self) -> np.ndarray:
        """The device ids as a read-only numpy array of the mesh's shape."""
        return self._ids

    @property
    def mesh(self) -> np.ndarray:
        return self._ids

    @property
    def shape(self) -> list[int]:
        return list(self._ids.shape)

    @property
    def ndim(self) -> int:
        return self._ids.ndim

    @property
    def dim_names(self) -> list[str]:
        return list(self._dim_names)

    @property
    def process_ids(self) -> list[int]:
        return self._ids.flatten().tolist()

    @property
    def size(self) -> int:
        return int(self._ids.size)

    @cached_property
    def axis_sizes(self) -> dict[str, int]:
        return dict(zip(self._dim_names, self._ids.shape))

    def get_dim_size(self, dim: str | int) -> int:
        return self._ids.shape[self._dim_index(dim)]

    def _dim_index(self, dim: str | int) -> int:
        if isinstance(dim, str):
            if dim not in self._dim_names:
                raise MeshError(f"mesh has no dim named {dim!r}; its dims are {list(self._dim_names)}")
            return self._dim_names.index(dim)
        if not -self.ndim <= dim < self.ndim:
            raise MeshError(f"mesh dim {dim} is out of range for a {self.ndim}-d mesh")
        return dim % self.ndim

    def coords_of(self, device_id: int) -> tuple[int, ...]:
        """Mesh coordinates of a device id."""
        hits = np.argwhere(self._ids == device_id)
        if len(hits) == 0:
            raise DeviceNotFoundError(f"device {device_id} is not in {self!r}; its devices are "
                                      f"{self.process_ids}")
        return tuple(int(c) for c in hits[0])

    # -- sub-meshes ------------------------------------------------------------------------
    def get_mesh_with_dim(self, dim_name: str, index: int | None = None) -> "ProcessMesh":
        """Move `dim_name` to the front; with `index`, return that slice (one pipeline stage)."""
        axis = self._dim_index(dim_name)
        order = [axis] + [i for i in range(self.ndim) if i != axis]
        ids = np.transpose(self._ids, order)
        names = [self._dim_names[i] for i in order]
        if index is None:
            return ProcessMesh(ids, names)
        if not -ids.shape[0] <= index < ids.shape[0]:
            raise MeshError(f"index {index} is out of range for mesh dim {dim_name!r} of size {ids.shape[0]}")
        if ids.ndim == 1:
            return ProcessMesh([int(ids[index])], names)
        return ProcessMesh(ids[index], names[1:])

    def __getitem__(self, key: Any) -> "ProcessMesh":
        # mesh["pp", 1] is the stage-1 sub-mesh; anything else indexes the id array like numpy.
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str):
            return self.get_mesh_with_dim(key[0], key[1])
        if isinstance(key, str):
            return self.get_mesh_with_dim(key)
        key_t = key if isinstance(key, tuple) else (key,)
        sub = self._ids[key_t]
        kept = [n for n, k in zip(self._dim_names, key_t + (slice(None),) * (self.ndim - len(key_t)))
                if not isinstance(k, (int, np.integer))]
        if np.ndim(sub) == 0:
            return ProcessMesh([int(sub)], kept or [self._dim_names[-1]])
        return ProcessMesh(sub, kept)

    # -- jax -------------------------------------------------------------------------------
    def devices(self) -> np.ndarray:
        """The jax devices in mesh order; raises DeviceNotFoundError for unknown ids."""
        table = self._device_table()
        out = np.empty(self._ids.shape, dtype=object)
        for index, i in np.ndenumerate(self._ids):
            out[index] = table[int(i)]
        return out

    def device_for(self, device_id: int):
        """The jax device that mesh entry `device_id` names.

        Entries are jax device ids; when some are not (several CPU processes number their
        devices 0.. and 2048..), they are global ranks, as in Paddle: the position in
        `jax.devices()`, process by process. One process's GPUs are both."""
        table = self._device_table()
        if device_id not in table:
            raise DeviceNotFoundError(f"device {device_id} is not in {self!r}; its devices are "
                                      f"{self.process_ids}")
        return table[device_id]

    def _device_table(self) -> dict:
        table = _device_table(tuple(self.process_ids))
        if table is None:
            import jax

            from .parallel_env import ENV_COORDINATOR, ENV_NPROC

            ids = sorted(d.id for d in jax.devices())
            missing = [i for i in self.process_ids if i not in ids]
            if ENV_COORDINATOR in os.environ:  # under autoshard.launch, which sets the flag
                more = (f"launch more: `python -m autoshard.launch --nproc N --devices K` "
                        f"gives N * K devices (now {os.environ.get(ENV_NPROC, '?')} processes "
                        f"of {len(jax.local_devices())} devices each)")
            else:
                more = ("(on CPU) simulate more devices with "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=N set before jax is "
                        "imported")
            raise DeviceNotFoundError(
                f"{self!r} uses device ids {missing}, but this process sees {len(ids)} devices "
                f"with ids {ids} (global ranks 0..{len(ids) - 1}): build the mesh from those, or "
                f"{more}")
        return table

    @cached_property
    def _jax_mesh(self):
        from jax.sharding import AxisType, Mesh

        # Auto axes: jax 0.10 defaults to Explicit, which shard_map rejects for unsharded inputs.
        return Mesh(self.devices(), self._dim_names, axis_types=(AxisType.Auto,) * self.ndim)

    def to_jax(self):
        """The equivalent `jax.sharding.Mesh` (Auto axis types), cached."""
        return self._jax_mesh

    # -- identity --------------------------------------------------------------------------
    def _key(self) -> tuple:
        key = self.__dict__.get("_identity")
        if key is None:  # meshes are immutable; planning hashes them on every cached decision
            key = (self._ids.shape, tuple(self._ids.flatten().tolist()), self._dim_names)
            self.__dict__["_identity"] = key
        return key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessMesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash_once(self, self._key)

    def __contains__(self, device_id: int) -> bool:
        return bool((self._ids == device_id).any())

    def __repr__(self) -> str:
        return f"ProcessMesh({self._ids.tolist()}, dim_names={list(self._dim_names)})"

    def __reduce__(self):
        return (ProcessMesh, (self._ids.tolist(), list(self._dim_names)))


def as_process_mesh(mesh: Any) -> ProcessMesh:
    """Accept a ProcessMesh, or a jax.sharding.Mesh (its devices' ids and axis names)."""
    if isinstance(mesh, ProcessMesh):
        return mesh
    devices = getattr(mesh, "devices", None)
    names = getattr(mesh, "axis_names", None)
    if devices is not None and names is not None:
        ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(np.asarray(devices))
        return ProcessMesh(ids, list(names))
    from .errors import PlacementTypeError

    raise PlacementTypeError(f"expected a dist.ProcessMesh, got {type(mesh).__name__}: "
                             f"write dist.ProcessMesh([[0, 1], [2, 3]], dim_names=['dp', 'mp'])")


_GLOBAL: list = []  # the mesh set by set_mesh (one entry, or none)


def set_mesh(mesh: Any) -> None:
    """Paddle's `dist.auto_parallel.set_mesh`: the mesh that `parallelize` and `local_map` use
    when they are given none (None: forget it)."""
    _GLOBAL[:] = [] if mesh is None else [as_process_mesh(mesh)]


def get_mesh() -> ProcessMesh | None:
    """The mesh given to `set_mesh`, or None."""
    return _GLOBAL[0] if _GLOBAL else None


def spans_every_process(mesh: ProcessMesh) -> bool:
    """`mesh` has a device of every process (orbax and numpy reads need one)."""
    import jax

    return len({d.process_index for d in mesh.devices().flat}) == jax.process_count()


def one_device_per_process() -> ProcessMesh:
    """The 1-d mesh "process" of every process's first device: where a value held by some
    processes' devices only (a pipeline stage's) is read out or written from, as a collective."""
    import jax

    first: dict[int, int] = {}
    for d in jax.devices():
        first.setdefault(d.process_index, d.id)
    return ProcessMesh(sorted(first.values()), ["process"])


__all__ = ["ProcessMesh", "as_process_mesh", "set_mesh", "get_mesh", "spans_every_process",
           "one_device_per_process"]
