"""A bound on how many multi-device programs are left running on XLA's CPU backend.

jax returns from a call as soon as the program is dispatched. On the CPU backend (jaxlib
0.10.2) executions of programs with collectives that pile up unfinished deadlock in the
collectives' rendezvous, and after 40 s XLA aborts the whole process ("Termination timeout
for all reduce RendezvousKey ..."). Plain jax does it too: on a 2-core machine with 8
simulated devices, a `jax.jit` training step of a 2 × 4 mesh called 300 times without
reading its loss, 50 psums dispatched back to back, or alternating all-to-alls and psums
with 32 left in flight all aborted; with 16 in flight, 3000 calls ran. A loop that never
reads a result is what a training loop logging every n-th loss is, and what a notebook
user's eager ops are.

So every program autoshard runs over more than one CPU device notes its results here, and a
call that would leave more than `WINDOW` such executions unfinished first waits for the
oldest. The host still runs ahead of the devices by that many programs; other backends
(GPU, TPU) are left alone.
"""
from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any

import jax

WINDOW = 8  # executions left unfinished; half of the most seen to run safely
_KEEP_BYTES = 1 << 12  # a result this small is held until waited for: the loss of a step
# (larger ones by weak reference, so that a dropped temporary is not kept alive for it, nor
# counted among a step's live arrays — the pipeline bench reads those for its peak)

_pending: deque = deque()  # per execution: a callable giving the result to wait on (None: gone)
_lock = threading.Lock()


def _handle(leaves: list) -> Any:
    """What to wait on for one execution: its smallest result (all of an execution's results
    are ready once it has run on their devices)."""
    x = min(leaves, key=lambda a: a.nbytes)
    if x.nbytes <= _KEEP_BYTES:
        return lambda: x
    return weakref.ref(x)


def ran(outputs: Any) -> None:
    """Note the results of a program just dispatched; wait for the oldest executions if more
    than `WINDOW` multi-device CPU executions would be left unfinished."""
    leaves = [x for x in jax.tree.leaves(outputs)
              if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)]
    if not leaves:
        return
    devices = leaves[0].sharding.device_set
    if len(devices) < 2 or next(iter(devices)).platform != "cpu":
        return
    handle = _handle(leaves)
    with _lock:
        _pending.append(handle)
        due = [_pending.popleft() for _ in range(len(_pending) - WINDOW)]
    if not all([_wait(h) for h in due]):
        # a result dropped or donated since (a chain of large temporaries, `t = t.reshape()`
        # in a loop): wait for this execution instead, which read it or was dispatched after
        _wait(handle)


def _wait(handle) -> bool:
    """Wait for the execution of `handle`'s result; False where that result is gone."""
    x = handle()
    if x is None or x.is_deleted():
        return False
    try:
        x.block_until_ready()
    except RuntimeError:  # deleted meanwhile (donated by another thread's call)
        return False
    return True


def pending() -> int:
    """How many executions are noted and not yet waited for (at most `WINDOW`)."""
    return len(_pending)


__all__ = ["ran", "pending", "WINDOW"]
