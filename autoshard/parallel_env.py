"""Joining the processes of one job into one jax runtime (Paddle's `dist.init_parallel_env`).

`python -m autoshard.launch` (launch.py) starts the processes and tells each, in the
environment, where the coordinator is and which rank it has.
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import sys

from .errors import AutoshardError


class ParallelEnvError(AutoshardError, RuntimeError):
    """A process that cannot join the others of its launch."""


ENV_COORDINATOR = "AUTOSHARD_COORDINATOR"
ENV_NPROC = "AUTOSHARD_NPROC"
ENV_RANK = "AUTOSHARD_RANK"
# the launcher's --timeout asks hung ranks for their Python stacks with it (POSIX only)
STACK_SIGNAL = getattr(signal, "SIGUSR1", None)


def init_parallel_env() -> None:
    """Join this process to the others (Paddle's `dist.init_parallel_env`).

    Under `python -m autoshard.launch` it reads the launcher's settings; elsewhere with more
    than one process it leaves the settings to jax's cluster detection; a lone process needs
    nothing. Call it before anything asks jax for devices."""
    import jax

    if _initialized():
        return
    coordinator, nproc, rank = (os.environ.get(k) for k in (ENV_COORDINATOR, ENV_NPROC, ENV_RANK))
    if coordinator is None:
        if any(k in os.environ for k in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE",
                                          "JAX_COORDINATOR_ADDRESS")):
            jax.distributed.initialize()
        return
    if int(nproc) == 1:
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise ParallelEnvError(
            f"dist.init_parallel_env() came after jax had started this process's devices "
            f"(something before it asked for them: jax.devices(), an array, a computation, a "
            f"ProcessMesh's .devices()), so process {rank} cannot join the other "
            f"{int(nproc) - 1} of the launch: call dist.init_parallel_env() first, right after "
            f"`import autoshard as dist` at the top of the script")
    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=int(nproc), process_id=int(rank))
    _exit_promptly_after_an_uncaught_exception()
    if STACK_SIGNAL is not None:  # a launcher's --timeout shows where this rank waits
        faulthandler.register(STACK_SIGNAL, all_threads=True)


_FAILED: list[bool] = []


def _exit_promptly_after_an_uncaught_exception() -> None:
    """A process that dies of an uncaught exception leaves without jax's shutdown barrier.

    At exit jax waits (up to 5 minutes) for every process to shut down, so a rank that raised
    would sit there while the others wait for it inside a collective, and the launcher, which
    stops the rest when one exits non-zero, would never see it exit. The exception is printed
    as usual; exit handlers registered after this one (a checkpoint save still being written)
    run, then the process exits with status 1 before jax's own handlers."""
    hook = sys.excepthook

    def excepthook(kind, value, tb):
        _FAILED.append(True)
        hook(kind, value, tb)

    sys.excepthook = excepthook
    atexit.register(_leave_if_failed)


def _leave_if_failed() -> None:
    if _FAILED:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed stream: nothing left to say
                pass
        os._exit(1)


def _initialized() -> bool:
    from jax._src import distributed

    return getattr(distributed.global_state, "client", None) is not None


__all__ = ["init_parallel_env", "ParallelEnvError", "ENV_COORDINATOR", "ENV_NPROC", "ENV_RANK"]
