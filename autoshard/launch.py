"""Several processes, one mesh: `python -m autoshard.launch --nproc N script.py [args]`.

Starts N copies of a script on this machine, as Paddle's `python -m paddle.distributed.launch`
does, for developing and testing multi-process code without a cluster: each process gets its
rank and the coordinator's address in the environment, and `dist.init_parallel_env()` in the
script joins them into one jax runtime (jax.distributed; on CPU with gloo collectives). On CPU
every process simulates `--devices` devices (XLA_FLAGS), so 2 processes × 4 devices form the
same 8-device meshes the single-process examples use; ProcessMesh entries are global ranks.

Output lines are prefixed with the rank; the launcher waits for all, stops the others when one
fails (SIGTERM, then SIGKILL), and exits with the first failure's code; `--timeout S` stops
them all after S seconds (exit code 124). On a cluster, skip the launcher:
`init_parallel_env()` then lets jax detect SLURM / Open MPI / Kubernetes settings.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

from .errors import AutoshardError

from .parallel_env import ENV_COORDINATOR, ENV_NPROC, ENV_RANK, STACK_SIGNAL


class LaunchError(AutoshardError, RuntimeError):
    """Processes that could not be joined into one runtime."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, rank: int, out) -> None:
    for line in iter(stream.readline, ""):
        if "connected peer ranks" in line or "connected to" in line and "[Gloo]" in line:
            continue  # gloo's connection report: a line per device, interleaved by its threads
        out.write(f"[rank {rank}] {line}")
        out.flush()


def _show_stacks(procs: Sequence[subprocess.Popen], grace: float = 2.0) -> None:
    """Ask each process for its Python stack (STACK_SIGNAL: init_parallel_env has every rank
    answer it with faulthandler, on its output, which the pumps prefix with the rank): a hung
    launch then says which collective or barrier each rank waits in. A rank that never called
    init_parallel_env ends on the signal instead, as it was about to be stopped."""
    if STACK_SIGNAL is None:
        return
    for p in procs:
        if p.poll() is None:
            p.send_signal(STACK_SIGNAL)
    time.sleep(grace)  # (the dump is written at once; the pumps carry it out)


def _stop(procs: Sequence[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL what still runs after `grace` seconds: a process that joined the
    jax runtime catches SIGTERM (jax's preemption notifier records it and carries on), and one
    blocked in a collective whose peer is gone would never return."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(end - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            p.kill()


def launch(script: str, args: Sequence[str] = (), nproc: int = 2, devices: int | None = None,
           timeout: float | None = None) -> int:
    """Run `script` in `nproc` processes; the exit code of the first that failed (a process
    killed by signal N: 128 + N), else 0. With `timeout` (seconds), processes still running
    then are stopped and the code is 124 — a rank blocked in a collective whose peer finished
    or took another branch would otherwise wait forever."""
    if nproc < 1:
        raise LaunchError(f"--nproc must be at least 1, got {nproc}")
    if timeout is not None and not timeout > 0:
        raise LaunchError(f"--timeout must be a positive number of seconds, got {timeout}")
    port = _free_port()
    procs, pumps = [], []
    for rank in range(nproc):
        env = dict(os.environ)
        env.update({ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NPROC: str(nproc),
                    ENV_RANK: str(rank), "PYTHONUNBUFFERED": "1"})
        if devices is not None:  # simulated CPU devices per process
            flags = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                             if not f.startswith("--xla_force_host_platform_device_count"))
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
        p = subprocess.Popen([sys.executable, script, *args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        procs.append(p)
        t = threading.Thread(target=_pump, args=(p.stdout, rank, sys.stdout), daemon=True)
        t.start()
        pumps.append(t)
    code = 0
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        pending = list(procs)
        while pending:
            for p in list(pending):
                try:
                    rc = p.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    continue
                pending.remove(p)
                if rc != 0 and code == 0:
                    code = rc if rc > 0 else 128 - rc  # killed by signal N: 128 + N, as a shell
                    _stop(pending)  # the others would wait for it forever
                    pending = []
                    break
            if pending and deadline is not None and time.monotonic() > deadline:
                ranks = [procs.index(p) for p in pending]
                sys.stderr.write(f"autoshard.launch: ranks {ranks} still running after "
                                 f"--timeout {timeout:g} s; their Python stacks follow (where "
                                 f"each waits), then they are stopped\n")
                _show_stacks(pending)
                _stop(pending)
                code = code or 124  # as coreutils' timeout
                pending = []
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(timeout=5)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoshard.launch",
                                     description=__doc__.split("\n\n")[1])
    parser.add_argument("--nproc", type=int, default=2, help="processes to start (default 2)")
    parser.add_argument("--devices", type=int, default=None,
                        help="simulated CPU devices per process (sets XLA_FLAGS)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop every process after this many seconds (exit code 124)")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    return launch(ns.script, ns.args, ns.nproc, ns.devices, ns.timeout)


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["launch", "LaunchError", "main"]
