"""Reading collectives out of compiled HLO text, to check what a program really communicates.

XLA's combiner passes merge independent all-reduces (all-gathers, reduce-scatters) into one
op over a tuple of operands; each operand is one logical collective and is counted as such.
An all-to-all, by contrast, may be emitted over several operand pieces of one exchange.
"""
from __future__ import annotations

import re
from collections import Counter

COLLECTIVE_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# Async pairs (all-gather-start / -done) count once, at the start.
_OP = re.compile(r"\b(" + "|".join(COLLECTIVE_KINDS) + r")(-start)?\(([^)]*)\)")
_COMBINABLE = {"all-gather", "all-reduce", "reduce-scatter"}


def collectives(hlo_text: str) -> list[str]:
    """The logical collectives of an HLO module, in textual order."""
    found = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        kind, operands = m.group(1), m.group(3)
        n = operands.count("%") if kind in _COMBINABLE else 1
        found.extend([kind] * max(n, 1))
    return found


def count_collectives(hlo_text: str) -> Counter:
    return Counter(collectives(hlo_text))


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_RESULT = re.compile(r"=\s+(\([^=]*?\)|\S+)\s+(" + "|".join(COLLECTIVE_KINDS) + r")(-start)?\(")


def collective_bytes(hlo_text: str) -> Counter:
    """Result bytes of the collectives per kind (per device), tuples of combined ops summed.

    The size of what each collective produces on one device: a deterministic measure of
    traffic to compare two programs (the wire bytes of a ring algorithm are proportional).
    """
    total: Counter = Counter()
    for line in hlo_text.splitlines():
        m = _RESULT.search(line)
        if not m:
            continue
        kind, result = m.group(2), m.group(1)
        if m.group(3):  # an async start returns (operands, results): count the results half
            arrays = _ARRAY.findall(result)
            arrays = arrays[len(arrays) // 2:]
        else:
            arrays = _ARRAY.findall(result)
        for dtype, dims in arrays:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total[kind] += n * _BYTES.get(dtype, 4)
    return total


__all__ = ["collectives", "count_collectives", "collective_bytes", "COLLECTIVE_KINDS"]
