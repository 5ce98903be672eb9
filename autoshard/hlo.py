"""Reading collectives out of compiled HLO text, to check what a program really communicates."""
from __future__ import annotations

import re
from collections import Counter

COLLECTIVE_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# Async pairs (all-gather-start / -done) count once, at the start.
_OP = re.compile(r"\b(" + "|".join(COLLECTIVE_KINDS) + r")(-start)?\(")


def collectives(hlo_text: str) -> list[str]:
    """The collective ops of an HLO module, in textual order."""
    return [m.group(1) for line in hlo_text.splitlines() for m in [_OP.search(line)] if m]


def count_collectives(hlo_text: str) -> Counter:
    return Counter(collectives(hlo_text))


__all__ = ["collectives", "count_collectives", "COLLECTIVE_KINDS"]
