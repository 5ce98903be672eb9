"""shard_dataloader: wrap a loader of numpy/jax batches so each batch arrives as DistTensors,
split along its batch dim, every device receiving only its own slice (Paddle's API)."""
from __future__ import annotations

import numbers
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any, Union

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.tree_util import DictKey, GetAttrKey, SequenceKey, keystr, tree_map_with_path

from ..creation import shard_tensor
from ..dtensor import DistTensor, make_dtensor
from ..errors import AutoshardError, ShardingError
from ..layout import Layout
from ..mesh import ProcessMesh, as_process_mesh
from ..paddle_names import paddle_names
from ..physical import physical_sharding
from ..reshard import reshard
from ..uneven import is_key

DimSpec = Union[str, int, None]
ShardDims = Union[DimSpec, Sequence[DimSpec], Mapping[Hashable, DimSpec]]
InputKeys = Union[Sequence[Hashable], Mapping[Hashable, int], None]


class DataloaderError(AutoshardError, ValueError):
    """shard_dataloader arguments, or a batch, that do not say how to place the data."""


class BatchSplitError(DataloaderError, ShardingError):
    """A batch whose batch dim the mesh dim it is split over does not divide."""


def _as_meshes(meshes: Any) -> list[ProcessMesh]:
    items = list(meshes) if isinstance(meshes, (list, tuple)) else [meshes]
    if not items:
        raise DataloaderError("shard_dataloader got meshes=[]: give one ProcessMesh, or a list "
                              "[first_stage_mesh, last_stage_mesh] for pipeline stages")
    return [as_process_mesh(m) for m in items]


def _axis_name(spec: DimSpec, mesh: ProcessMesh, where: str) -> str:
    """The mesh dim name that `spec` (None: the first dim) picks on `mesh`."""
    if spec is None:
        return mesh.dim_names[0]
    if isinstance(spec, str) and spec in mesh.dim_names:
        return spec
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool) \
            and -mesh.ndim <= spec < mesh.ndim:
        return mesh.dim_names[spec]
    raise DataloaderError(
        f"shard_dims={spec!r} for {where}: {mesh!r} has no such mesh dim; write one of its dim "
        f"names {mesh.dim_names}, an index in 0..{mesh.ndim - 1}, or None for the first dim")


def _top_key(batch: Any, path: tuple) -> Hashable:
    """The key (dict batch) or position (tuple/list batch) of the input a leaf belongs to."""
    if not path:
        return None
    head = path[0]
    if isinstance(head, DictKey):
        return head.key
    if isinstance(head, SequenceKey):
        return head.idx
    if isinstance(head, GetAttrKey) and hasattr(batch, "_fields"):  # namedtuple
        return batch._fields.index(head.name)
    return None


def _is_number(x: Any) -> bool:
    if isinstance(x, (numbers.Number, np.bool_)):
        return True
    return isinstance(x, (np.ndarray, jax.Array)) and not isinstance(x, DistTensor) \
        and x.ndim == 0 and not is_key(x)


def _is_number_list(x: Any) -> bool:
    """A Python list of numbers, or of such lists: per-sample values (a collate_fn's
    `[len(s) for s in samples]`), one array — not a container of separate 0-d inputs."""
    return isinstance(x, list) and bool(x) and all(_is_number(e) or _is_number_list(e)
                                                   for e in x)


def _number_list_array(leaf: list, where: str, axis: str, mesh: ProcessMesh) -> np.ndarray:
    """`leaf`, a list of numbers (or of such lists), as the array np.asarray makes of it."""
    try:
        return np.asarray(leaf)
    except ValueError:  # ragged: numpy has no one array for it
        raise DataloaderError(
            f"{where} is a ragged list of numbers (its rows differ in length): shard_dataloader "
            f"places a list of numbers as one per-sample array, as np.asarray makes it, split "
            f"over mesh dim {axis!r} of {mesh!r} — a ragged list is no array: pad its rows to "
            f"one length in your collate_fn (np.stack of the padded rows), or pass each row as "
            f"its own array in a tuple") from None


def _host_array(leaf: Any, where: str) -> np.ndarray:
    arr = np.asarray(leaf)
    # jax's issubdtype: numpy files bfloat16 / float8 under kind "V", as it does raw bytes
    if not (jax.dtypes.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise DataloaderError(
            f"{where} is {type(leaf).__name__} {leaf!r:.60}, which is not numeric: "
            f"shard_dataloader places numpy/jax arrays only; turn it into an array in your "
            f"collate_fn, or leave it out of the batch")
    # float64/int64 become float32/int32 unless jax_enable_x64 is on, as everywhere in jax.
    return arr.astype(jax.dtypes.canonicalize_dtype(arr.dtype), copy=False)


class ShardDataloader:
    """Iterate it (or call it, Paddle style) to get each batch of the wrapped loader as
    DistTensors of the same structure. See `shard_dataloader` for the placement rules."""

    def __init__(self, loader: Any, meshes: Any, input_keys: InputKeys = None,
                 shard_dims: ShardDims = None, is_dataset_splitted: bool = False):
        if not (hasattr(loader, "__iter__") or hasattr(loader, "__getitem__")):
            hint = (" — it looks like a generator function: pass its result, gen()"
                    if callable(loader) else "")
            raise DataloaderError(
                f"shard_dataloader needs an iterable of batches, got {type(loader).__name__}"
                f"{hint}; pass a DataLoader, a list of batches or a generator")
        self._loader = loader
        self._meshes = _as_meshes(meshes)
        self._input_keys = self._check_input_keys(input_keys)
        if isinstance(shard_dims, (str, int, np.integer)):
            # Fail at the call when the one dim named cannot be found on a receiving mesh.
            for mesh in (self._meshes[0], self._meshes[-1]):
                _axis_name(shard_dims, mesh, "every input")
        elif not (shard_dims is None or isinstance(shard_dims, (list, tuple, Mapping))):
            raise DataloaderError(
                f"shard_dims={shard_dims!r}: write a mesh dim name, an int mesh dim index, None, "
                f"or a list/dict with one of those per input")
        self._shard_dims = shard_dims
        self._splitted = bool(is_dataset_splitted)
        self._shardings: dict[tuple, tuple[Layout, NamedSharding]] = {}

    def _check_input_keys(self, input_keys: InputKeys) -> InputKeys:
        if input_keys is None:
            return None
        if isinstance(input_keys, Mapping):
            n = len(self._meshes)
            for key, index in input_keys.items():
                if not isinstance(index, (int, np.integer)) or not -n <= index < n:
                    raise DataloaderError(
                        f"input_keys[{key!r}]={index!r}: map each key to a mesh index in "
                        f"0..{n - 1} (meshes has {n} entries)")
            return dict(input_keys)
        keys = list(input_keys) if isinstance(input_keys, (list, tuple)) else None
        if keys is None or len(keys) != 2 or keys[0] == keys[1]:
            raise DataloaderError(
                f"input_keys={input_keys!r}: give two different keys [input_key, label_key], "
                f"e.g. input_keys=['image', 'label'], or a dict key -> mesh index")
        return keys

    # -- iteration --------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        # A generator: one batch is drawn from the loader per batch handed out, never ahead,
        # and everything is inferred from the batch in hand.
        for batch in self._loader:
            yield self._place(batch)

    def __call__(self) -> Iterator[Any]:
        return iter(self)

    def __len__(self) -> int:
        try:
            return len(self._loader)
        except TypeError:
            raise TypeError(f"the wrapped {type(self._loader).__name__} has no len(); "
                            f"shard_dataloader passes len() through only when it does") from None

    def __getattr__(self, name: str) -> Any:
        # Paddle code reads loader attributes (batch_size, dataset) through the wrapper.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._loader, name)

    @property
    def meshes(self) -> list[ProcessMesh]:
        return list(self._meshes)

    @property
    def input_keys(self) -> InputKeys:
        """The input_keys given (None, [input_key, label_key] or {key: mesh index})."""
        return self._input_keys

    # -- placement --------------------------------------------------------------------------
    def _check_batch(self, batch: Any) -> None:
        dims, keys = self._shard_dims, self._input_keys
        if isinstance(batch, Mapping):
            names = list(batch)
            if keys is None and len(self._meshes) > 1:
                raise DataloaderError(
                    f"the batch is a dict with keys {names} and {len(self._meshes)} meshes were "
                    f"given: say which key is the input and which the label, e.g. "
                    f"input_keys={names[:1] + names[-1:]}")
            missing = [k for k in (keys or []) if k not in batch]
            if isinstance(dims, Mapping):
                missing += [k for k in dims if k not in batch]
            if missing:
                raise DataloaderError(f"the batch has no key(s) {missing} named in input_keys or "
                                      f"shard_dims; its keys are {names}")
            if isinstance(dims, (list, tuple)) and not (isinstance(keys, list)
                                                        and len(dims) == len(keys)):
                raise DataloaderError(
                    f"shard_dims={dims!r} is a list but the batch is a dict: give "
                    f"input_keys=[input_key, label_key] to match it, or write shard_dims as a "
                    f"dict key -> mesh dim")
        elif isinstance(batch, (list, tuple)):
            if keys is not None:
                raise DataloaderError(
                    f"input_keys={keys!r} applies to dict batches, but this batch is a "
                    f"{type(batch).__name__}: drop input_keys (element 0 goes to meshes[0], the "
                    f"last element to meshes[-1])")
            n = len(batch)
            bad = (len(dims) != n if isinstance(dims, (list, tuple)) else
                   [k for k in dims if not (isinstance(k, int) and -n <= k < n)]
                   if isinstance(dims, Mapping) else False)
            if bad:
                raise DataloaderError(
                    f"shard_dims={dims!r} does not fit a batch of {n} elements: give one entry "
                    f"per element (a list of {n}), or a dict element index -> mesh dim")
        elif isinstance(dims, (list, tuple, Mapping)):
            raise DataloaderError(
                f"shard_dims={dims!r} is per input, but the batch is one "
                f"{type(batch).__name__}: write a single mesh dim name or index")

    def _mesh_index(self, batch: Any, top: Hashable) -> int:
        keys = self._input_keys
        if isinstance(batch, Mapping):
            if isinstance(keys, dict):
                return keys.get(top, 0)
            return -1 if keys is not None and top == keys[1] else 0
        if isinstance(batch, (list, tuple)) and len(batch) > 1 and top == len(batch) - 1:
            return -1
        return 0

    def _dim_spec(self, batch: Any, top: Hashable) -> DimSpec:
        dims = self._shard_dims
        if isinstance(dims, Mapping):
            if isinstance(batch, Mapping):
                return dims.get(top)
            n = len(batch)
            return next((v for k, v in dims.items() if k % n == top), None)
        if isinstance(dims, (list, tuple)):
            if isinstance(batch, Mapping):  # aligned with input_keys; other keys: the default
                keys = self._input_keys
                return dims[keys.index(top)] if top in keys else None
            return dims[top]
        return dims

    def _place(self, batch: Any) -> Any:
        self._check_batch(batch)

        def place(path: tuple, leaf: Any) -> Any:
            top = _top_key(batch, path)
            mesh = self._meshes[self._mesh_index(batch, top)]
            return self._place_leaf(leaf, mesh, self._dim_spec(batch, top), "batch" + keystr(path))

        # A list of numbers inside the batch is one input (per-sample values, as np.asarray
        # makes them), not separate 0-d leaves; the batch itself, a list, is its inputs.
        placed = tree_map_with_path(
            place, batch, is_leaf=lambda x: isinstance(x, DistTensor)
            or (x is not batch and _is_number_list(x)))
        return _in_order_of(batch, placed)

    def _sharding(self, mesh: ProcessMesh, axis: str | None,
                  ndim: int) -> tuple[Layout, NamedSharding]:
        key = (mesh, axis, ndim)
        if key not in self._shardings:
            dims = ((axis,),) + ((),) * (ndim - 1) if axis is not None else ((),) * ndim
            layout = Layout(dims)
            self._shardings[key] = (layout, physical_sharding(layout, mesh))
        return self._shardings[key]

    def _slots(self, mesh: ProcessMesh, axis: str) -> int:
        """How many distinct batch slices this process feeds along `axis`."""
        if not self._splitted or jax.process_count() == 1:
            return mesh.get_dim_size(axis)
        i, me = mesh.dim_names.index(axis), jax.process_index()
        held: dict[int, set] = {}  # process -> the slices of the batch its devices hold
        for idx, d in np.ndenumerate(mesh.devices()):
            held.setdefault(d.process_index, set()).add(idx[i])
        for p, slices in held.items():
            shared = sorted(slices & held.get(me, set()))
            if p != me and shared:
                # each process would feed its own rows for the same global slices: devices
                # holding "one" slice would hold different data
                raise DataloaderError(
                    f"shard_dataloader(is_dataset_splitted=True): mesh dim {axis!r} of {mesh!r} "
                    f"does not split the batch between the processes — processes {me} and {p} "
                    f"both hold its slices {shared}, so they would have to feed the same rows; "
                    f"split the batch over a mesh dim whose slices lie in different processes "
                    f"(shard_dims=...), or give every process the whole batch with "
                    f"is_dataset_splitted=False")
        return max(len(held.get(me, ())), 1)

    def _place_leaf(self, leaf: Any, mesh: ProcessMesh, spec: DimSpec, where: str) -> Any:
        if isinstance(leaf, DistTensor):
            if leaf.mesh == mesh:
                return leaf  # placed by the user on the mesh it goes to: kept as placed
            # On another mesh, no step on this one could take it (a MeshMismatchError in
            # dist.jit): moved as dist.reshard moves across meshes, placed as an array would be.
            axis = _axis_name(spec, mesh, where) if leaf.ndim else None
            return reshard(leaf, mesh, self._sharding(mesh, axis, leaf.ndim)[0].placements(mesh))
        if isinstance(leaf, list):  # numbers (_is_number_list): one per-sample array
            axis = _axis_name(spec, mesh, where)
            leaf = _number_list_array(leaf, where, axis, mesh)
        if isinstance(leaf, jax.Array) and is_key(leaf):
            return self._place_keys(leaf, mesh, spec, where)
        data = leaf if isinstance(leaf, jax.Array) else _host_array(leaf, where)
        # A 0-d value (a step counter, a scalar weight) has no batch dim: every device gets it.
        axis = _axis_name(spec, mesh, where) if data.ndim else None
        if axis is not None:
            slots = self._slots(mesh, axis)
            if data.shape[0] % slots and not self._splitted:
                # a short last batch (drop_last=False): stored padded and computed whole along
                # `axis` (uneven.py; dist.jit warns once per program)
                layout = self._sharding(mesh, axis, data.ndim)[0]
                return shard_tensor(data, mesh, layout.placements(mesh))
            if data.shape[0] % slots:
                part = "this process's part of " if self._splitted else ""
                raise BatchSplitError(
                    f"{part}{where} has {data.shape[0]} rows on dim 0 (the batch dim), which "
                    f"mesh dim {axis!r} (size {slots}) of {mesh!r} does not divide — each process "
                    f"feeds its own rows of a split dataset, so they must divide: make every "
                    f"batch a multiple of {slots} (e.g. drop_last=True in the DataLoader, or pad "
                    f"the last batch), or split {where} over another mesh dim with shard_dims")
        layout, sharding = self._sharding(mesh, axis, data.ndim)
        if isinstance(data, jax.Array):
            if data.sharding.is_equivalent_to(sharding, data.ndim):
                return make_dtensor(data, mesh, layout, data.shape)  # already laid out as asked
            data = _host_array(data, where)
        if self._splitted:
            # The loader yields only this process's rows; jax stitches the processes' parts
            # into the global array (one process: the local part is the global batch).
            value = jax.make_array_from_process_local_data(sharding, data)
        else:
            # Each addressable device is sent just its own slice of the host batch.
            value = jax.make_array_from_callback(data.shape, sharding, data.__getitem__,
                                                 dtype=data.dtype)
        return make_dtensor(value, mesh, layout, value.shape)


    def _place_keys(self, keys: jax.Array, mesh: ProcessMesh, spec: DimSpec, where: str) -> Any:
        """Typed PRNG keys (no numpy value): split along the batch dim as shard_tensor splits
        them (moved as their key data, a short batch padded)."""
        if self._splitted and jax.process_count() > 1:
            raise DataloaderError(
                f"{where} holds typed PRNG keys, which shard_dataloader cannot stitch from the "
                f"processes' parts of a split dataset: feed their key data "
                f"(jax.random.key_data(keys)) and wrap it again in the step "
                f"(jax.random.wrap_key_data), or give every process all the keys")
        axis = _axis_name(spec, mesh, where) if keys.ndim else None
        layout = self._sharding(mesh, axis, keys.ndim)[0]
        return shard_tensor(keys, mesh, layout.placements(mesh))


def _in_order_of(original: Any, placed: Any) -> Any:
    """`placed` with its dicts' keys in `original`'s order: jax's tree functions sort dict
    keys, and a dict batch's inputs are the model's arguments in the batch's order."""
    if isinstance(original, Mapping) and isinstance(placed, Mapping):
        pairs = [(k, _in_order_of(original[k], placed[k])) for k in original]
        try:
            return type(placed)(pairs)
        except TypeError:  # a mapping type built otherwise (defaultdict): a plain dict
            return dict(pairs)
    if isinstance(original, (list, tuple)) and type(original) is type(placed):
        items = [_in_order_of(o, q) for o, q in zip(original, placed)]
        return type(placed)(*items) if hasattr(placed, "_fields") else type(placed)(items)
    return placed


@paddle_names(dataloader="loader")
def shard_dataloader(loader: Any, meshes: ProcessMesh | Sequence[ProcessMesh],
                     input_keys: InputKeys = None, shard_dims: ShardDims = None,
                     is_dataset_splitted: bool = False) -> ShardDataloader:
    """Wrap `loader` so every batch it yields arrives as DistTensors of the same structure.

    `loader` is any iterable of batches: arrays, or (nested) tuples/lists/dicts of arrays.
    Each array's dim 0 (the batch dim) is Shard along one mesh dim and Replicate on the other
    mesh dims; 0-d values are replicated. Each device receives only its slice of the batch.
    A Python list of numbers (or of equal-length lists of numbers) inside a batch is one
    per-sample array, as np.asarray makes it (`{"ids": ids, "lens": [3, 4, 5, 6]}`); a ragged
    one is a DataloaderError. A DistTensor in a batch is kept as placed when it is on the mesh
    it goes to, and moved there (dist.reshard, placed as an array would be) from another mesh.

    `meshes`: one ProcessMesh, or a list of pipeline-stage meshes. With a list, inputs go to
    meshes[0] and labels to meshes[-1]: for a tuple/list batch, its last element goes to
    meshes[-1] and every other element (a lone element too) to meshes[0]; for a dict batch,
    `input_keys` decides: `[input_key, label_key]` sends label_key to meshes[-1] and every other
    key to meshes[0], and a dict `{key: mesh_index}` sends each listed key to meshes[index] and
    the rest to meshes[0]. A dict batch with several meshes needs input_keys.

    `shard_dims` names the mesh dim the batch dim is split over: None (each mesh's first dim),
    a dim name, an int mesh dim index, or per input: a list (one entry per element of a
    tuple/list batch, or per key of input_keys=[input_key, label_key] for a dict batch) or a
    dict (element index or key -> dim; inputs it omits use None). An input's entry applies to
    every array nested in it.

    `is_dataset_splitted=True`: the loader already yields only this process's rows; the
    parts of all processes form the global batch (jax.make_array_from_process_local_data). In
    a single process the local part is the whole batch.

    Iterate the result, or call it (`for step, inputs in enumerate(loader())`); `len()` is the
    wrapped loader's. Nothing is drawn from `loader` before you iterate.
    """
    return ShardDataloader(loader, meshes, input_keys, shard_dims, is_dataset_splitted)


__all__ = ["shard_dataloader", "ShardDataloader", "DataloaderError", "BatchSplitError"]
