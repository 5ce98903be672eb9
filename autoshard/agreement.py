"""Do the processes of a multi-process run hold the same thing? One small collective says.

Every process runs the same program on the same global values; where each computes something
on its own (the global shape of blocks it was handed, the signature of a dist.jit call, the
plain values a checkpoint writes once), a process that computed something else would wait for
the others in a collective of another program forever, or fail alone. `differences` compares
them: a fixed-size digest goes through one all-gather, and only where the digests differ does
a second gather bring every process's own bytes back, so that the error can name them.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from typing import Any, Sequence

import numpy as np


@contextlib.contextmanager
def _at_top_level():
    """Outside every jax trace: the comparison is a small program of its own, run now, also
    where dist.jit is called under jax.vjp or an outer jax.jit (jax refuses to enter the mesh
    of process_allgather under a trace: '`set_mesh` can only be used outside of `jax.jit`')."""
    from jax._src import core

    ctx = core.trace_ctx
    axis_env = ctx.axis_env
    with core.eval_context():
        ctx.set_axis_env(core.top_axis_env)
        try:
            yield
        finally:
            ctx.set_axis_env(axis_env)


def differences(mine: bytes, note: bytes = b"") -> list[tuple[bytes, bytes]] | None:
    """None when every process passed the same `mine` (at once in a single process: no
    collective); else, in every process, each process's (`mine`, `note`) in process order.

    `note` is not compared, only gathered with `mine` (e.g. the user's line, which may differ
    where the values agree). A collective: every process must call it, in the same order."""
    import jax

    if jax.process_count() == 1:
        return None
    from jax.experimental import multihost_utils

    digest = hashlib.blake2b(mine, digest_size=16).digest()
    payload = len(mine).to_bytes(4, "little") + mine + note
    row = np.concatenate([np.frombuffer(digest, np.uint32),
                          np.array([len(payload)], np.uint32)])
    with _at_top_level():
        every = np.asarray(multihost_utils.process_allgather(row)).reshape(-1, row.size)
    if (every[:, :-1] == row[:-1]).all():
        return None
    width = -(-int(every[:, -1].max()) // 4) * 4  # whole uint32 words
    padded = np.frombuffer(payload.ljust(width, b"\0"), np.uint32)
    with _at_top_level():
        rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, padded.size)
    out = []
    for r, n in zip(rows, every[:, -1]):
        data = np.ascontiguousarray(r).tobytes()[:int(n)]
        size = int.from_bytes(data[:4], "little")
        out.append((data[4:4 + size], data[4 + size:]))
    return out


# -- dist.jit: the processes call a program with one signature ----------------------------------

def _plain(value: Any) -> str:
    """A static argument as every process would write it: the repr of a number, string or a
    tuple of them; else just its type (a repr with an object's address differs everywhere)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return type(value).__name__ + "(" + ", ".join(_plain(v) for v in value) + ")"
    return type(value).__name__


def _leaf_text(desc) -> list:
    """[dtype, shape, placements, mesh, memory, weak] of a dist.jit input description."""
    from .compiler.dtypes import dtype_name

    try:
        dtype = dtype_name(desc.dtype)
    except TypeError:
        dtype = str(desc.dtype)
    if desc.mesh is None or desc.layout is None:
        placed, mesh = None, None if desc.mesh is None else repr(desc.mesh)
    else:
        placed = "[" + ", ".join(f"{dim}: {p!r}" for dim, p in zip(
            desc.mesh.dim_names, desc.layout.placements(desc.mesh))) + "]"
        mesh = repr(desc.mesh)
    return [dtype, list(desc.shape), placed, mesh, desc.memory, bool(desc.weak)]


def _say(entry: list | None) -> str:
    if entry is None:
        return "nothing (it passes fewer arguments)"
    if entry[0] == "static":
        return f"static value {entry[1]}"
    dtype, shape, placed, mesh, memory, weak = entry
    text = f"{dtype}{shape}"
    if weak:
        text += " (a Python number)"
    if placed is None:
        text += (" not placed (a numpy array or a process's own jax.Array)" if mesh is None
                 else f" on {mesh}")
    else:
        text += f" placed {placed} on {mesh}"
    if memory:
        text += f" in {memory} memory"
    return text


def check_call_signature(name: str, names: Sequence[str], described: Sequence,
                         static: Sequence = (), static_positions: Sequence[int] = (),
                         reduced: bool = False) -> None:
    """dist.jit's first call for a signature in a multi-process run: a ParallelEnvError in
    every process unless all call with the same global shapes, dtypes, placements and mesh
    (one small collective; a single process returns at once)."""
    import jax

    if jax.process_count() == 1:
        return
    from .errors import user_source_line
    from .parallel_env import ParallelEnvError

    entries = [[n, _leaf_text(d)] for n, d in zip(names, described)]
    entries += [[f"static argument {i}", ["static", _plain(v)]]
                for i, v in zip(static_positions, static)]
    entries.append(["the call", ["static", "under a jax transformation" if reduced else
                                 "not under a jax transformation"]])
    where = user_source_line() or "?"
    seen = differences(json.dumps(entries).encode(), where.encode())
    if seen is None:
        return
    calls = [(json.loads(m), n.decode()) for m, n in seen]
    width = max(len(c) for c, _ in calls)
    differ = [k for k in range(width)
              if len({json.dumps(c[k] if k < len(c) else None) for c, _ in calls}) > 1]
    k = differ[0]
    what = next(c[k][0] for c, _ in calls if k < len(c))
    lines = "\n".join(f"    process {p}: {_say(c[k][1] if k < len(c) else None)}  (called at "
                      f"{line})" for p, (c, line) in enumerate(calls))
    more = (f"\n  and {len(differ) - 1} more input(s) differ: "
            f"{', '.join(next(c[j][0] for c, _ in calls if j < len(c)) for j in differ[1:4])}"
            f"{', ...' if len(differ) > 4 else ''}" if len(differ) > 1 else "")
    meshes = [e[1][3] for c, _ in calls for e in ([c[k]] if k < len(c) else []) + c
              if e[1][0] != "static" and e[1][3]]  # the differing input's first
    mesh = meshes[0] if meshes else None
    raise ParallelEnvError(
        f"{name}: the {len(calls)} processes called it with different arguments — {what} "
        f"differs:\n{lines}{more}\n  Every process runs one program over the same global "
        f"values{f' on {mesh}' if mesh else ''}, so every process must call {name} with the "
        f"same global shapes, dtypes, placements (per mesh dim) and mesh, in the same order: "
        f"pass the whole global value in every process (a DistTensor placed the same way "
        f"everywhere), not a process's own part of it — join the parts of a value each process "
        f"holds with dist.dtensor_from_local(parts, mesh, placements) or feed them with "
        f"dist.shard_dataloader(..., is_dataset_splitted=True)",
        where=None if where == "?" else where)


__all__ = ["differences", "check_call_signature"]
