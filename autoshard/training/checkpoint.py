"""Distributed checkpoints (Paddle's dist.save_state_dict / dist.load_state_dict) on orbax-checkpoint:
every device writes and reads only its own shards, so a checkpoint loads onto any mesh."""
from __future__ import annotations

import atexit
import difflib
import itertools
import os
import re
import shutil
import sys
import threading
import warnings
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..creation import offload
from ..dtensor import DistTensor, make_dtensor
from ..errors import AutoshardError
from ..physical import physical_sharding
from ..layout import Layout
from ..mesh import ProcessMesh, one_device_per_process, spans_every_process
from ..reshard.api import reshard, to_even
from ..uneven import even_part, is_key
from .model_state import exact_cast

if TYPE_CHECKING:
    import orbax.checkpoint as ocp


def _orbax():
    # imported when a checkpoint is first saved or loaded: orbax is a sixth of
    # `import autoshard`'s time, which every run (and every launched process) would pay
    import orbax.checkpoint

    return orbax.checkpoint


class CheckpointError(AutoshardError, ValueError):
    """A checkpoint that cannot be written, found, read, or matched to the target state dict."""


_SCALARS = (bool, int, float, np.bool_, np.number)
_UNWRITABLE = ("uint4", "uint2")  # dtypes tensorstore refuses (int4 / int2 it writes)
_INT64 = (-2 ** 63, 2 ** 63 - 1)
_KINDS = (np.bool_, np.integer, np.floating, np.complexfloating)


def _is_prng_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _state_of(x: Any) -> str | None:
    """For a model passed in place of its state dict (a DistModel, not a pytree, so one
    leaf): how to get that state dict; else None. (An nnx Module is a pytree of its state.)"""
    if callable(getattr(x, "state_dict", None)) and jax.tree_util.treedef_is_leaf(
            jax.tree.structure(x)):
        return ("dist_model" if type(x).__name__ == "DistModel"
                else type(x).__name__.lower()) + ".state_dict()"
    return None


def _flatten(state_dict: Any) -> tuple[list[str], list[Any], Any]:
    """Leaves of `state_dict` keyed by their tree path ("opt.0.mu.w"), DistTensors kept whole."""
    state = _state_of(state_dict)
    if state is not None:  # dist.save_state_dict(dist_model, path): one leaf named ''
        raise CheckpointError(
            f"the state dict is a {type(state_dict).__name__}, not a dict of name -> array: "
            f"pass {state} (to load: sd = {state}; dist.load_state_dict(sd, path); "
            f"{state.replace('state_dict()', 'set_state_dict(sd)')})")
    pairs, treedef = jax.tree_util.tree_flatten_with_path(
        state_dict, is_leaf=lambda x: isinstance(x, DistTensor))
    keys = [jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in pairs]
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            raise CheckpointError(
                f"two entries of the state dict are both named {key!r} (a key containing '.' "
                f"clashes with a nested path): rename one of them")
        seen.add(key)
    return keys, [leaf for _, leaf in pairs], treedef


def _is_local(x: jax.Array) -> bool:
    """A plain array one process holds, among several: its own copy of a value."""
    return jax.process_count() > 1 and x.is_fully_addressable


def _check_same_everywhere(flat: dict[str, Any]) -> None:
    """Numpy values (and processes' own jax.Arrays, saved as numpy) are written by one process
    only: a CheckpointError unless every process holds the same ones, not a silent pick."""
    import zlib

    from ..agreement import differences

    local = sorted(k for k, v in flat.items() if isinstance(v, (np.ndarray, *_SCALARS)))
    crc = 0
    for key in local:
        value = np.asarray(flat[key])
        crc = zlib.crc32(f"{key}{value.dtype}{value.shape}".encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(value).tobytes(), crc)
    if differences(np.array([len(local), crc], np.uint32).tobytes()) is not None:
        raise CheckpointError(
            f"save_state_dict: the numbers and arrays that are not DistTensors ({local[:8]}) "
            f"differ between the processes (each process holds its own copy, and only one "
            f"process's would be written): give every process the same values, or make a "
            f"per-process value a DistTensor (dist.dtensor_from_local)")


def _world_layout(shape: tuple[int, ...]) -> Layout:
    """Split over the processes along the first dim they divide (each holds a part), else whole."""
    n = jax.process_count()
    dim = next((i for i, size in enumerate(shape) if size % n == 0), None)
    return Layout([("process",) if i == dim else () for i in range(len(shape))])


def _to_saveable(key: str, x: Any) -> Any:
    if isinstance(x, (DistTensor, jax.Array, np.ndarray)) and 0 in tuple(x.shape):
        # orbax refuses them only once its background write has started
        raise CheckpointError(
            f"cannot save {key!r}: it has zero size (shape {tuple(x.shape)}), and orbax writes "
            f"no zero-size arrays; it holds no values, so drop it from the state dict (and "
            f"from the target when loading)")
    if isinstance(x, (DistTensor, jax.Array, np.ndarray)) and \
            getattr(x.dtype, "name", "") in _UNWRITABLE:
        raise CheckpointError(
            f"cannot save {key!r}: orbax's storage (tensorstore) has no {x.dtype.name} type; "
            f"save x.astype(jnp.uint8) and cast the loaded value back")
    if isinstance(x, DistTensor):
        # Partial reduced; a dim stored padded (uneven.py) written whole, without the padding.
        # Shard placements stay, so orbax writes each block once, from the device that holds it.
        x = to_even(x, reduce_partial=True)
        if not spans_every_process(x.mesh):  # orbax writes only arrays every process holds
            x = reshard(x, one_device_per_process(), _world_layout(x.shape).placements(one_device_per_process()))
        value = x.physical
        return jax.random.key_data(value) if is_key(value) else value  # keys: as plain ones
    if isinstance(x, jax.core.Tracer):
        raise CheckpointError(f"save_state_dict got a traced value for {key!r}: save outside "
                              f"jax.jit / dist.jit, on the concrete state")
    if _is_prng_key(x):
        x = jax.random.key_data(x)  # orbax stores plain arrays; load re-wraps with the impl
    if isinstance(x, jax.Array) and _is_local(x):
        return np.asarray(x)  # orbax writes a process's own jax.Array in one process only
    if isinstance(x, (jax.Array, np.ndarray)) and x.dtype != object:
        return x
    if isinstance(x, np.bool_):  # orbax has no handler for numpy's bool scalar: as Python's
        return bool(x)
    if isinstance(x, int) and not isinstance(x, bool) and not _INT64[0] <= x <= _INT64[1]:
        raise CheckpointError(
            f"cannot save {key!r}: the Python int {x} lies outside int64, the widest integer a "
            f"checkpoint holds; save it as a string elsewhere, or as a float if exactness "
            f"does not matter")
    if isinstance(x, _SCALARS):
        return x
    state = _state_of(x)
    raise CheckpointError(
        f"cannot save {key!r}: it is a {type(x).__name__} ({x!r:.60}), but a checkpoint holds "
        f"DistTensors, jax.Arrays, numpy arrays and numbers: "
        + (f"save its state, {state}, in its place" if state else
           "drop it from the state dict or store it separately (e.g. as JSON)"))


def _checkpoint_path(path: Any, what: str) -> str:
    """The absolute directory name of `path` (a str or os.PathLike), else a CheckpointError."""
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(
            f"{what}: path is {path!r:.60} of type {type(path).__name__}, not a directory name: "
            f"pass a str or pathlib.Path, e.g. dist.{what}(state_dict, 'checkpoints/step_100')")
    return os.path.abspath(os.fspath(path))


def _is_checkpoint_dir(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("_CHECKPOINT_METADATA", "_METADATA"))


def _staging_path(path: str) -> str:
    """Where a save is written before it replaces `path`: a sibling whose name has none of
    the glob characters orbax's commit would read as a pattern (`ckpt-dp[2x4]`)."""
    parent, name = os.path.split(path)
    return os.path.join(parent, "." + re.sub(r"[][*?{}]", "_", name) + ".autoshard-saving")


# saves put in place by this process: every process counts alike, naming one barrier per save
_SWAPS = itertools.count(1)


def _put_in_place(staging: str, path: str) -> None:
    """The complete checkpoint at `staging` becomes `path`; the one there before is removed
    only now (orbax's own `force` removed it before writing: a failed save lost both)."""
    if jax.process_index() == 0:
        old = staging + "-old"
        if os.path.exists(old):
            shutil.rmtree(old)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(staging, path)
        if os.path.exists(old):
            shutil.rmtree(old)
    swap = next(_SWAPS)
    if jax.process_count() > 1:  # no process reads `path` before it is in place
        _orbax().multihost.sync_global_processes(f"autoshard_checkpoint_in_place_{swap}")


class SaveHandle:
    """A save in progress or done; `wait()` blocks until the checkpoint is complete on disk."""

    def __init__(self, checkpointer: ocp.AsyncCheckpointer | None, path: str,
                 staging: str | None = None):
        self._checkpointer = checkpointer
        self.path = path
        self._staging = staging

    def done(self) -> bool:
        """True once wait() has returned (the checkpoint is then complete)."""
        return self._checkpointer is None

    def wait(self) -> None:
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is None:
            return
        if self in _PENDING:
            _PENDING.remove(self)
        try:
            checkpointer.close()  # waits for the background commit, then frees its threads
        except Exception as exc:
            kept = (f"; the checkpoint there before is kept" if os.path.exists(self.path)
                    else "")
            raise CheckpointError(f"writing the checkpoint {self.path} failed: {exc}{kept}; "
                                  f"save it again") from exc
        if self._staging is not None:
            _put_in_place(self._staging, self.path)

    def __repr__(self) -> str:
        return f"SaveHandle({self.path!r}, done={self.done()})"


# Async saves not yet waited on: a later save or load, and interpreter exit, wait for them first,
# so nobody reads a half-written checkpoint and no commit is cut off at exit.
_PENDING: list[SaveHandle] = []


def wait_for_saves() -> None:
    """Block until every async save_state_dict has finished."""
    while _PENDING:
        _PENDING[0].wait()


def _wait_at_exit() -> None:
    """Have interpreter exit wait for the pending saves while thread pools still run.

    Python shuts down its thread pools, which orbax's background commit needs, before atexit
    handlers run; threading's own exit hooks run before that, last registered first. So the
    wait is registered there, and again once the first async save has started: by then orbax has
    imported and registered concurrent.futures' pool shutdown (Python >= 3.12 imports it
    lazily), and the wait runs before it."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(wait_for_saves)
    else:
        register(wait_for_saves)  # returns at once when nothing is pending


_wait_at_exit()
_hooked_after_a_save = False  # the wait is registered again after the first async save
# CPython 3.12.0-3.12.2 refuse to start a thread once the main thread has returned
# (python/cpython#113964, fixed in 3.12.3); orbax's commit starts some, so exit cannot finish
# a save there.
_EXIT_CANNOT_WAIT = (3, 12, 0) <= sys.version_info[:3] < (3, 12, 3)


def _hook_after_a_save() -> None:
    global _hooked_after_a_save
    _hooked_after_a_save = True
    _wait_at_exit()
    if _EXIT_CANNOT_WAIT:
        warnings.warn(
            f"save_state_dict(async_save=True) on Python {sys.version.split()[0]}: this "
            f"interpreter starts no threads at exit (CPython issue 113964, fixed in 3.12.3), "
            f"so exit cannot finish the save; call .wait() on the returned handle (or "
            f"autoshard.training.checkpoint.wait_for_saves()) before the program ends",
            RuntimeWarning, stacklevel=3)


def save_state_dict(state_dict: Any, path: str | os.PathLike, *,
                    async_save: bool = False) -> SaveHandle:
    """Save a (nested) state dict of DistTensors, jax/numpy arrays and numbers to directory `path`.

    Partial values are reduced first; sharded values are written block by block. With
    `async_save` the call returns once the values are copied off the devices and the files are
    written in the background: call `.wait()` on the returned handle (a later save or load, and
    exit, also wait). An existing checkpoint at `path` is replaced.
    """
    path = _checkpoint_path(path, "save_state_dict")
    wait_for_saves()
    keys, leaves, _ = _flatten(state_dict)
    if not keys:
        raise CheckpointError(f"save_state_dict to {path}: the state dict has no arrays to save")
    if os.path.exists(path) and not _is_checkpoint_dir(path) and (
            not os.path.isdir(path) or os.listdir(path)):
        raise CheckpointError(f"cannot save to {path}: it exists and is not a checkpoint, and "
                              f"saving would delete it; pass a new or empty directory")
    flat = {key: _to_saveable(key, leaf) for key, leaf in zip(keys, leaves)}
    if jax.process_count() > 1:
        _check_same_everywhere(flat)
    ocp = _orbax()
    checkpointer = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler())
    # written beside `path` and moved there once complete: `force` clears only the staging
    # directory (a crashed save's), never the checkpoint a failed save would replace
    staging = _staging_path(path)
    try:
        checkpointer.save(staging, args=ocp.args.PyTreeSave(flat), force=True)
    except Exception as exc:
        try:
            checkpointer.close()
        except Exception:
            pass  # the save's own error says what went wrong
        raise CheckpointError(f"saving the state dict to {path} failed: "
                              f"{str(exc).splitlines()[0][:300]}") from exc
    handle = SaveHandle(checkpointer, path, staging)
    _PENDING.append(handle)
    if not async_save:
        handle.wait()
    elif not _hooked_after_a_save:
        _hook_after_a_save()
    return handle


def _read_metadata(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path}: it is not a directory; pass the "
                              f"directory given to save_state_dict")
    ocp = _orbax()
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            meta = checkpointer.metadata(path).item_metadata
    except Exception as exc:
        meta, cause = None, exc
    else:
        cause = None
    # orbax answers None (not an error) when a metadata or index file is missing or unreadable.
    if meta is None or not isinstance(meta.tree, dict):
        raise CheckpointError(
            f"{path} is not a complete checkpoint: its metadata cannot be read (not a checkpoint "
            f"directory, or a file in it is missing, truncated or corrupt"
            f"{': ' + str(cause)[:200] if cause else ''}); save it again or load another "
            f"checkpoint") from cause
    return dict(meta.tree)


def _same_kind(a: np.dtype, b: np.dtype) -> bool:
    return any(jax.dtypes.issubdtype(a, k) and jax.dtypes.issubdtype(b, k) for k in _KINDS)


def _restore_spec(key: str, target: Any, saved: Any, path: str) -> tuple[Any, Any]:
    """(item, restore args) reading `key` straight into the target's sharding, after checks."""
    ocp = _orbax()
    if isinstance(target, DistTensor) and is_key(target):
        # keys are written as their key data (orbax's form): the trailing data dims whole
        data = jax.eval_shape(jax.random.key_data,
                              jax.ShapeDtypeStruct(target.shape, target.dtype))
        shape, dtype = tuple(data.shape), np.dtype(data.dtype)
        mesh, layout = _read_place(target)
        spec = physical_sharding(layout, mesh).spec
        sharding = NamedSharding(mesh.to_jax(), PartitionSpec(
            *spec, *[None] * (len(shape) - len(spec))))
    elif isinstance(target, DistTensor):
        shape, dtype = target.shape, np.dtype(target.dtype)
        mesh, layout = _read_place(target)
        sharding = physical_sharding(layout, mesh)
    elif _is_prng_key(target):
        data = jax.random.key_data(target)
        shape, dtype, sharding = tuple(data.shape), np.dtype(data.dtype), data.sharding
    elif isinstance(target, jax.Array):
        shape, dtype, sharding = tuple(target.shape), np.dtype(target.dtype), target.sharding
    elif isinstance(target, (np.ndarray, *_SCALARS)) and np.asarray(target).dtype != object:
        shape, dtype, sharding = np.shape(target), np.asarray(target).dtype, None
    else:
        raise CheckpointError(
            f"cannot load into {key!r}: the target is a {type(target).__name__}, not a "
            f"DistTensor, array or number" + (  # orbax's usual abstract target
                f": make it a DistTensor of that shape where it should land, e.g. "
                f"dist.dtensor_from_fn(jnp.zeros, mesh, placements, {tuple(target.shape)}, "
                f"jnp.{getattr(target.dtype, 'name', target.dtype)})"
                if isinstance(target, jax.ShapeDtypeStruct) else ""))
    if not hasattr(saved, "dtype"):
        raise CheckpointError(f"{key!r} in checkpoint {path} is a subtree, not one array: this "
                              f"checkpoint was not written by save_state_dict")
    saved_shape, saved_dtype = tuple(saved.shape), np.dtype(saved.dtype)
    keys = (isinstance(target, DistTensor) and is_key(target)) or _is_prng_key(target)
    if keys and shape != saved_shape and shape[:-1] == saved_shape[:-1]:
        # keys are saved as their key data: another width is another PRNG implementation
        impl = jax.random.key_impl(target.physical if isinstance(target, DistTensor) else target)
        raise CheckpointError(
            f"{key!r} holds PRNG keys of {saved_shape[-1]} words each in checkpoint {path}, "
            f"but the target's are {shape[-1]} words ({impl}): "
            f"the keys were made by another implementation; make the target with that one, "
            f"e.g. jax.random.key(0, impl='rbg') for 4 words, 'threefry2x32' for 2")
    if shape != saved_shape:
        raise CheckpointError(
            f"{key!r} has global shape {list(saved_shape)} in checkpoint {path}, but the target "
            f"has shape {list(shape)}: build the target with the saved shape")
    # Numbers carry no fixed width (a Python int saves as int64), so only their kind must agree.
    loose = isinstance(saved, ocp.metadata.ScalarMetadata) or isinstance(target, (bool, int, float))
    if not (_same_kind(dtype, saved_dtype) if loose else dtype == saved_dtype):
        raise CheckpointError(
            f"{key!r} is {saved_dtype.name} in checkpoint {path}, but the target is "
            f"{dtype.name}: loading must be exact, so make the target {saved_dtype.name} (and "
            f"cast after loading if needed)")
    if loose and dtype != saved_dtype and np.issubdtype(saved_dtype, np.integer):
        # read as saved, then checked to fit (`_fitted`): a cast on read would wrap 2**40 + 5
        # into int32 as 5, silently; read as numpy (a jax int64 is int32 without x64)
        return np.zeros(shape, saved_dtype), ocp.RestoreArgs(restore_type=np.ndarray,
                                                             dtype=saved_dtype)
    if sharding is None:
        return target, ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
    return (jax.ShapeDtypeStruct(shape, dtype, sharding=sharding),
            ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype))


def _fitted(key: str, target: Any, value: Any, path: str) -> Any:
    """A saved integer number read in its own width (`_restore_spec`), in the target's dtype
    when it fits there (a Python int target holds any), else a CheckpointError."""
    if isinstance(target, (bool, int, float)) or is_key(target) or _is_prng_key(target):
        return value
    want = np.dtype(target.dtype)
    if np.dtype(value.dtype) == want:
        return value
    cast = exact_cast(np.asarray(value), want)
    if cast is None:
        raise CheckpointError(
            f"{key!r} is {np.asarray(value)!r:.60} in checkpoint {path}, which the target's "
            f"{want.name} cannot hold: make the target a wider type (e.g. "
            f"{'uint64' if np.asarray(value).min() >= 0 else 'int64'})")
    if isinstance(target, DistTensor):  # where _rebuild expects it read
        mesh, layout = _read_place(target)
        return jax.device_put(cast, physical_sharding(layout, mesh))
    return jax.device_put(cast, target.sharding) if isinstance(target, jax.Array) else cast


def _read_place(target: DistTensor) -> tuple[ProcessMesh, Layout]:
    """Where a target DistTensor's value is read: its mesh without Partial or uneven dims, or,
    when that mesh lacks some process's devices (orbax reads only arrays every process holds),
    one device of every process; _rebuild moves it on to the target's mesh and placements."""
    if not spans_every_process(target.mesh):
        return one_device_per_process(), _world_layout(target.shape)
    return target.mesh, even_part(target.layout.without_partial(), target.mesh, target.shape)


def _rebuild(target: Any, value: Any) -> Any:
    if isinstance(target, DistTensor):
        if is_key(target) and not is_key(value):  # (orbax itself wraps keys it was given)
            value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(target.physical))
        mesh, layout = _read_place(target)
        out = make_dtensor(value, mesh, layout, target.shape)
        if (mesh, layout) != (target.mesh, target.layout):
            out = reshard(out, target.mesh, target.placements)
        # into the target's memory: an offloaded one (optimizer states) is loaded back to host
        return offload(out, target.memory_kind)
    if _is_prng_key(target):
        return value if is_key(value) else jax.random.wrap_key_data(
            value, impl=jax.random.key_impl(target))
    if isinstance(target, (bool, int, float)):
        return type(target)(np.asarray(value).item())
    if isinstance(target, np.generic):
        return np.asarray(value, target.dtype)[()]
    return value


def _restore(path: str, items: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    ocp = _orbax()
    with ocp.PyTreeCheckpointer() as checkpointer:
        def read(keys: list[str]) -> dict[str, Any]:
            return checkpointer.restore(path, args=ocp.args.PyTreeRestore(
                item={k: items[k] for k in keys}, restore_args={k: args[k] for k in keys},
                partial_restore=True))

        try:
            return read(list(items))
        except Exception as exc:
            bad = next((k for k in items if not _reads(read, k)), None)
            raise CheckpointError(
                f"reading {repr(bad) if bad else 'the state dict'} from checkpoint {path} failed ("
                f"{str(exc).splitlines()[0][:200]}): a file in the checkpoint is missing, "
                f"truncated or corrupt; save it again or load another checkpoint") from exc


def _reads(read: Callable[[list[str]], Any], key: str) -> bool:
    # Only on failure: retry key by key so the error can name the broken entry.
    try:
        read([key])
        return True
    except Exception:
        return False


# a to_static model's gradient-merge cycle and float16 loss scaler (dist_model.py's state dict)
_RUN_STATE = ("gm.", "amp.")
_MODEL_GROUPS = ("param", "state", "opt", "amp", "gm")  # DistModel.state_dict's name groups


def _is_model_state(state_dict: Any) -> bool:
    """A DistModel's state dict (flat, every name in one of its groups): only there are
    gm.* / amp.* the run state a checkpoint may lack — a user's own {"gm": generator, ...}
    is checked entry by entry as any other."""
    return isinstance(state_dict, Mapping) and all(
        isinstance(k, str) and k.split(".", 1)[0] in _MODEL_GROUPS and not isinstance(v, Mapping)
        for k, v in state_dict.items())


def load_state_dict(state_dict: Any, path: str | os.PathLike) -> Any:
    """Load the checkpoint at `path` into the layout of the target `state_dict`.

    Each target (a DistTensor on any mesh and placements, a jax.Array, numpy array or number)
    decides where its value goes; every device reads only its own block. Returns a new state
    dict of the same structure and also replaces the entries of the given dicts and lists in
    place, as Paddle does. Checkpoint entries the target does not name are ignored; where the
    checkpoint has no gradient-merge (gm.*) or loss-scaler (amp.*) entries, a DistModel's
    state dict gets those of a new cycle and a fresh scaler (`DistModel.state_dict()`'s
    `fresh_run_state`; another dict's are kept as they are).
    """
    path = _checkpoint_path(path, "load_state_dict")
    wait_for_saves()
    keys, targets, treedef = _flatten(state_dict)
    saved = _read_metadata(path)
    items: dict[str, Any] = {}
    args: dict[str, Any] = {}
    # A checkpoint saved without gradient merge or float16 loss scaling (a pretrained model's)
    # has no gm.* / amp.* entries: a model that merges loads it into a new cycle, one that
    # scales starts from a fresh scaler.
    keep = {k for prefix in _RUN_STATE if not any(n.startswith(prefix) for n in saved)
            for k in keys if k.startswith(prefix)} if _is_model_state(state_dict) else set()
    for key, target in zip(keys, targets):
        if key in keep:
            continue
        if key not in saved:
            near = difflib.get_close_matches(key, list(saved), n=3) or sorted(saved)[:5]
            raise CheckpointError(
                f"{key!r} is not in checkpoint {path} (it has {len(saved)} entries, e.g. "
                f"{near}): rename the target entry or drop it from the state dict")
        items[key], args[key] = _restore_spec(key, target, saved[key], path)
    restored = _restore(path, items, args) if items else {}
    for key, target in zip(keys, targets):
        if key in restored:
            restored[key] = _fitted(key, target, restored[key], path)
    # a kept entry starts afresh: a new cycle (the target's pending micro-steps were taken
    # with other weights), a fresh scaler — as the model itself makes them
    fresh = (getattr(state_dict, "fresh_run_state", None) or dict)() if keep else {}
    result = jax.tree_util.tree_unflatten(
        treedef, [fresh.get(k, t) if k in keep else _rebuild(t, restored[k])
                  for k, t in zip(keys, targets)])
    _fill_in_place(state_dict, result)
    return result


def _fill_in_place(target: Any, result: Any) -> None:
    """Put the loaded values into the caller's own dicts and lists (Paddle mutates in place)."""
    if isinstance(target, MutableMapping):
        slots = list(target.keys())
    elif isinstance(target, list):
        slots = list(range(len(target)))
    else:
        return
    for slot in slots:
        old, new = target[slot], result[slot]
        if isinstance(old, (MutableMapping, list)) and old is not new:
            _fill_in_place(old, new)
        else:
            target[slot] = new


__all__ = ["save_state_dict", "load_state_dict", "SaveHandle", "CheckpointError",
           "wait_for_saves"]
