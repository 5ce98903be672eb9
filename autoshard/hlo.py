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


__all__ = ["collectives", "count_collectives", "COLLECTIVE_KINDS"]
