"""Sends between processes: the pieces of a cross-mesh transfer whose source and destination
devices belong to different processes, moved by collective permutes.

jax copies a block between two devices with `device_put` only when one process addresses both;
across processes the only way is a collective both take part in. The pieces are grouped into
rounds — one block shape per round, each device sending at most one piece and receiving at most
one — and each round is one jitted `ppermute` over a 1-d mesh of exactly the devices it
involves (senders put their piece in, receivers put zeros in and take theirs out). Every
process derives the same rounds from the same plan and runs them in the same order, and a
process owning none of a round's devices skips it, so the collectives always match up.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .. import in_flight

AXIS = "_send"
STATS = {"rounds": 0, "received_bytes": 0}  # this process's part, over the process


class Send(NamedTuple):
    key: Any                  # what the caller files the received block under
    src: Any                  # jax device holding the piece
    dst: Any                  # jax device receiving it
    shape: tuple[int, ...]    # the piece's shape


def crosses(src, dst) -> bool:
    return src.process_index != dst.process_index


def rounds(sends: list[Send]) -> list[list[Send]]:
    """Sends grouped into rounds of one shape where no device sends or receives twice (first
    fit, in the given order: every process computes the same rounds)."""
    out: list[tuple[tuple, set, set, list[Send]]] = []
    for s in sends:
        for shape, senders, receivers, members in out:
            if shape == s.shape and s.src.id not in senders and s.dst.id not in receivers:
                break
        else:
            shape, senders, receivers, members = s.shape, set(), set(), []
            out.append((shape, senders, receivers, members))
        senders.add(s.src.id)
        receivers.add(s.dst.id)
        members.append(s)
    return [members for *_, members in out]


@functools.lru_cache(maxsize=256)
def _permute(devices: tuple, perm: tuple[tuple[int, int], ...]):
    mesh = jax.sharding.Mesh(np.array(devices, dtype=object), (AXIS,))
    spec = PartitionSpec(AXIS)
    program = jax.jit(jax.shard_map(lambda b: jax.lax.ppermute(b, AXIS, perm), mesh=mesh,
                                    in_specs=spec, out_specs=spec))
    return program, NamedSharding(mesh, spec)


def exchange(sends: list[Send], piece: Callable[[Send], jax.Array], dtype) -> dict:
    """Run `sends`; {send.key: the block now on send.dst} for the receivers this process owns.

    `piece(send)` gives the block to send, on `send.src`; it is asked only for senders this
    process owns."""
    me = jax.process_index()
    received: dict = {}
    for members in rounds(sends):
        devices = sorted({d.id: d for s in members for d in (s.src, s.dst)}.items())
        devices = tuple(d for _, d in devices)
        if all(d.process_index != me for d in devices):
            continue  # none of its devices are ours: the owners run it
        index = {d.id: i for i, d in enumerate(devices)}
        perm = tuple((index[s.src.id], index[s.dst.id]) for s in members)
        program, sharding = _permute(devices, perm)
        shape = members[0].shape
        outgoing = {s.src.id: s for s in members}
        blocks = []
        for d in devices:
            if d.process_index != me:
                continue
            s = outgoing.get(d.id)
            block = (piece(s)[None] if s is not None
                     else jax.device_put(np.zeros((1, *shape), dtype), d))
            blocks.append(block)
        stacked = jax.make_array_from_single_device_arrays((len(devices), *shape), sharding,
                                                           blocks, dtype=dtype)
        out = program(stacked)
        in_flight.ran(out)  # (XLA's CPU backend deadlocks on too many left running)
        arrived = {sh.device.id: sh.data for sh in out.addressable_shards}
        STATS["rounds"] += 1
        for s in members:
            if s.dst.process_index == me:
                received[s.key] = arrived[s.dst.id][0]
                STATS["received_bytes"] += received[s.key].nbytes
    return received


def permute_program(devices: tuple, perm: tuple[tuple[int, int], ...]):
    """The jitted program (cached) that runs a round over `devices` (to read its HLO)."""
    return _permute(devices, perm)[0]


__all__ = ["Send", "crosses", "rounds", "exchange", "permute_program", "STATS"]
