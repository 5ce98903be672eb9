"""Joining the processes of one job into one jax runtime (Paddle's `dist.init_parallel_env`).

`python -m autoshard.launch` (launch.py) starts the processes and tells each, in the
environment, where the coordinator is and which rank it has.
"""
from __future__ import annotations

import os

ENV_COORDINATOR = "AUTOSHARD_COORDINATOR"
ENV_NPROC = "AUTOSHARD_NPROC"
ENV_RANK = "AUTOSHARD_RANK"


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
    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=int(nproc), process_id=int(rank))


def _initialized() -> bool:
    from jax._src import distributed

    return getattr(distributed.global_state, "client", None) is not None


__all__ = ["init_parallel_env", "ENV_COORDINATOR", "ENV_NPROC", "ENV_RANK"]
