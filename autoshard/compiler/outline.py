"""Outline: a block of equations that repeats (the layers of an unrolled model, forward and
backward) is lowered once, as a jitted function, and called for every repetition.

Replay (replay.py) already skips our lowering work for equal equations, but jax still emits
every local equation into its trace, and lowers each to StableHLO: on a 48-layer GPT step that
is ~16k equations, most of the partition and lowering time. Here partition emits one call per
repeated block instead; jax traces the block once and lowers it to one private function that
every call names, and XLA inlines the calls before it optimises, so the compiled program does
the same work with the same collectives.

Only exact repetitions are outlined. Two blocks are the same when, position for position, their
equations have the same replay key (primitive, params, layouts, types) and read their operands
the same way: from the same earlier position of the block, from the same external value (by
order of first use, so aliasing is kept), or from the same program constant; planned reshards
start from the same layouts; the same results are read after the block. Copies that reshards
make are shared with the code around the block exactly as without outlining: copies made before
the block are passed in, copies made inside are handed back.

A block is also known by value (`Instance.identity`: its equations' replay keys, wiring,
constants by value, reshards and escaping results; partition adds the program facts its
lowering reads), so that another program with the same block — the next pipeline stage, a
re-made dist.jit — calls the function this one traced (replay.py keeps it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..hashing import Hashed
from .repeats import find_blocks

ENABLED = True    # off: every equation is emitted inline (the tests compare both programs)

_EXT, _CONST, _MADE = "x", "c", "m"


@dataclass
class Instance:
    """One occurrence of a repeated block: eqns[start:stop]."""

    start: int
    stop: int
    signature: int            # equal numbers: the same block
    external: list            # values read from outside, in order of first use
    consts: list              # program constants read, in order of first use
    reshards: list            # (value, reshard plan) of outside operands resharded in the block
    escaping: list            # (position, output index) of results read after the block
    identity: Any = None      # the signature by value, in any program (None: a block that
    # reads an array constant, which is this program's own)


def const_key(c) -> Any:
    """Program constants that partition puts on the device as one array have one key: equal
    scalars (one Value per literal in the user's program) are one; anything else is itself."""
    if isinstance(c.const, jax.Array):
        return c
    value = np.asarray(c.const)
    if value.ndim:
        return c
    return (value.dtype, value.tobytes(), np.dtype(c.dtype))


class _ConstKeys(dict):
    """`const_key` of the program constants blocks read, made when first asked. None: an
    integer scalar (a layer's RNG fold_in index, a loop bound), which may differ between blocks
    and is passed in like a value from outside; float constants stay literals, so that XLA folds
    them as it would without outlining (the results are the same to the bit)."""

    def __missing__(self, c):
        # (a dtype without a numpy kind, e.g. a PRNG key's, is kept by its bytes: never wrong)
        integer = getattr(c.dtype, "kind", "") in ("i", "u")
        key = self[c] = None if integer and np.ndim(c.const) == 0 else const_key(c)
        return key


def find_instances(program, plan, key_of, apart: bool = True) -> dict[int, Instance]:
    """The blocks worth outlining, by start index: those whose signature occurs twice or more.
    `key_of(k)`: equation k's replay key; `apart`: also blocks that repeat with other
    equations between (`find_blocks`)."""
    eqns, layouts = program.eqns, plan.layouts
    n = len(eqns)
    excluded = [False] * n
    for r in program.regions:
        for k in range(r.start, r.stop):
            excluded[k] = True
    # each equation as a number: its replay key and its operands' layouts (what the reshards
    # start from); equations that cannot be replayed never repeat. An equation the plan decided
    # as a copy of an earlier one (`plan.same_as`) has that one's operand layouts, and its key
    # where it is the same primitive with the same params: the plan copies by rule signature,
    # which sin and cos, or slices at different offsets, share.
    key_ids: dict = {}  # a key is hashed once here; the pair below hashes its number
    ids: dict = {}
    same_as = plan.same_as
    h = []
    for k, e in enumerate(eqns):
        j = same_as.get(k)
        if j is not None and not excluded[k] and h[j] >= 0 and e.primitive is eqns[j].primitive \
                and e.params_key == eqns[j].params_key:
            h.append(h[j])
            continue
        key = None if excluded[k] else key_of(k)
        if key is None:
            h.append(-1 - k)
        else:
            key_id = key_ids.setdefault(key, len(key_ids))
            h.append(ids.setdefault((key_id, tuple(map(layouts.get, e.inputs))), len(ids)))
    runs = find_blocks(h, apart=apart)
    if not runs:
        return {}
    by_id = [None] * len(ids)  # each equation number's value: (replay key, operand layouts)
    keys = list(key_ids)
    for (key_id, operand_layouts), i in ids.items():
        by_id[i] = (keys[key_id], operand_layouts)
    last_use = {v: r[-1][0] for v, r in program.readers().items()}  # reads in program order
    for r in program.regions:
        for v in r.inputs:
            last_use[v] = max(last_use.get(v, -1), r.start)
    for v in program.outputs:
        last_use[v] = n
    const_keys = _ConstKeys()
    signatures: dict = {}
    found = []
    for period, starts in runs:
        for s in starts:
            found.append(_instance(program, plan, h, s, s + period, last_use, const_keys,
                                   signatures, by_id))
    counts: dict = {}
    for inst in found:
        counts[inst.signature] = counts.get(inst.signature, 0) + 1
    return {inst.start: inst for inst in found if counts[inst.signature] > 1}


def _instance(program, plan, h, start, stop, last_use, const_keys, signatures,
              by_id) -> Instance:
    # The block's identity: its equations (h), its wiring (which reads are one value), what
    # each value is (made here, a constant by its key, or read from outside), the reshards
    # planned at each operand and the results read after it. The wiring is the one the plan
    # and propagation already asked for (memoised on the program).
    wiring, values = program.block_values(start, stop)
    eqns = program.eqns
    kinds, external, consts, escaping = [], [], [], []
    for v in values:
        p = v.producer
        if p >= start:  # made in the block (first seen as a result)
            kinds.append(_MADE)
            if last_use.get(v, -1) >= stop:
                outs = eqns[p].outputs
                escaping.append((p - start, 0 if len(outs) == 1 else outs.index(v)))
            continue
        key = const_keys[v] if v.is_const else None
        if key is None:
            kinds.append(_EXT)
            external.append(v)
        else:
            kinds.append((_CONST, key))
            consts.append(v)
    reshards, moves = [], []
    plan_eqns = plan.eqns
    for k in range(start, stop):
        planned = plan_eqns[k].reshards
        if planned:  # most equations reshard nothing
            inputs = eqns[k].inputs
            for i, rp in planned:
                moves.append((k - start, i, rp.src, rp.dst))
                if inputs[i].producer < start:
                    reshards.append((inputs[i], rp))
    kinds, moves, escaping_key = tuple(kinds), tuple(moves), tuple(escaping)
    sig = (tuple(h[start:stop]), wiring, kinds, moves, escaping_key)
    found = signatures.get(sig)
    if found is None:
        identity = None
        if all(k in (_MADE, _EXT) or type(k[1]) is tuple for k in kinds) and min(sig[0]) >= 0:
            identity = Hashed((tuple(by_id[x] for x in sig[0]), wiring, kinds, moves,
                               escaping_key))
        found = signatures[sig] = (len(signatures), identity)
    return Instance(start, stop, found[0], external, consts, reshards, escaping, found[1])


# Where the copy an operand's reshard needs comes from, given the copies made so far. The same
# decision serves partition's emission and a block's identity (its copies are passed in).
HAVE_TARGET, FROM_COPY, FROM_VALUE = 1, 2, 0


def reshard_start(v, rp, moved: dict, own) -> int:
    """HAVE_TARGET: the target copy exists; FROM_COPY: the plan starts from a copy made for an
    earlier use; FROM_VALUE: start from the value itself (in its own layout `own`)."""
    if (v, rp.dst) in moved:
        return HAVE_TARGET
    if rp.src != own and (v, rp.src) in moved:
        return FROM_COPY
    return FROM_VALUE


def passed_copies(inst: Instance, state: tuple) -> list:
    """The (value, layout) keys of the copies a block with reshard `state` is handed."""
    return list(dict.fromkeys((v, rp.dst if s == HAVE_TARGET else rp.src)
                              for (v, rp), s in zip(inst.reshards, state) if s != FROM_VALUE))


def moved_inputs(inst: Instance, moved: dict, own: dict) -> tuple[tuple, list]:
    """Where each operand resharded in the block starts from, given the copies made before it
    (part of the block's identity), and the keys of the copies it is handed."""
    state = tuple(reshard_start(v, rp, moved, own.get(v)) for v, rp in inst.reshards)
    return state, passed_copies(inst, state)


__all__ = ["Instance", "const_key", "find_instances", "reshard_start", "passed_copies",
           "moved_inputs", "HAVE_TARGET", "FROM_COPY", "FROM_VALUE", "ENABLED"]
