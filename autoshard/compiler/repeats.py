"""Repeats: the blocks of equations a program repeats back to back, and when a later block may
take the plan of the first.

An unrolled model repeats itself: every layer's forward, every layer's backward, the optimizer's
update of each like-shaped leaf. `find_runs` finds such stretches in a list of equation numbers
(equal numbers: equal equations). The plan (plan.py) numbers equations by their rule signature
(primitive, params and types: one object per distinct equation), decides the first block of a
run as usual, and for every later block checks that everything its decisions read is the same
as it was for the first block — the operand layouts from outside the block and the copies made
of them so far, which outside values are one value, the wiring inside the block, the
propagated preferences of its results, which values have one reader, which are parameters. If
so the later block's decisions are the first block's, and are copied rather than made again;
if not, it is planned equation by equation. Copying never decides anything: a block either
takes exactly the decisions it would have made, or is planned as usual. Propagation's first
sweep copies the proposals of a block the same way (propagate.py, `first_sweep`).
"""
from __future__ import annotations

from typing import NamedTuple

MIN_LEN = 16      # shorter repetitions save less than checking (plan) or calling (partition) costs
MAX_LEN = 4096    # the longest period looked for (a layer's backward is a few hundred)
TRIES = 8         # candidate periods tried per start position
ENABLED = True    # off: every equation is planned by itself (the tests compare both plans)


def find_runs(h: list[int], min_len: int = MIN_LEN, max_len: int = MAX_LEN,
              tries: int = TRIES) -> list[tuple[int, int, int]]:
    """(start, period, count) of stretches where `h[start:start + period]` repeats `count` >= 2
    times back to back; negative entries never repeat. Greedy, left to right."""
    n = len(h)
    nxt, seen = [-1] * n, {}
    for k in range(n - 1, -1, -1):
        if h[k] >= 0:
            nxt[k] = seen.get(h[k], -1)
            seen[h[k]] = k
    runs, s = [], 0
    while s < n:
        period, j, tried = 0, nxt[s], 0
        while j != -1 and j - s <= max_len and tried < tries:
            p = j - s
            if p >= min_len:
                tried += 1
                # (the ends first: most candidates differ there, and the slices copy p items)
                if (j + p <= n and h[j - 1] == h[j + p - 1] and h[s + p // 2] == h[j + p // 2]
                        and h[s:j] == h[j:j + p]):
                    period = p
                    break
            j = nxt[j]
        if not period:
            s += 1
            continue
        block, count = h[s:s + period], 2
        while (s + (count + 1) * period <= n
               and h[s + count * period:s + (count + 1) * period] == block):
            count += 1
        runs.append((s, period, count))
        s += count * period
    return runs


class Boundary(NamedTuple):
    """What the plan of block eqns[start:stop] reads besides the facts of its own equations:
    its wiring, the layouts of the values it reads from outside and the copies already made of
    them, and the propagated preferences of the values it makes."""

    wiring: tuple
    layouts: tuple    # per outside value (in order of first use): its actual layout
    moved: tuple      # per outside value: the layouts it has been copied to
    preferred: tuple  # per value made in the block: its propagated preference


def boundary(program, start: int, stop: int, actual: dict, moved_to: dict,
             pref: dict) -> Boundary:
    wiring, values = program.block_values(start, stop)
    outside = [v for v in values if v.producer < start]
    return Boundary(wiring, tuple([actual[v] for v in outside]),
                    tuple([moved_to.get(v) for v in outside]),
                    tuple([pref.get(v) for v in values if v.producer >= start]))


class Repeats:
    """The repeated blocks of one program, numbered by `ids` (one number per distinct equation,
    negative: never repeats), and the blocks planned so far of each run by their boundary: a
    later block with the boundary of one of them takes its plan. (The first layer of a model
    often reads its input in another layout than the rest: the second becomes the one the
    others copy.)"""

    def __init__(self, ids: list[int]):
        self.run_of: dict[int, tuple[int, int]] = {}  # block start -> (run start, period)
        self.planned: dict[int, dict] = {}  # run start -> {boundary: start of a planned block}
        if not ENABLED:
            return
        for start, period, count in find_runs(ids):
            self.planned[start] = {}
            for i in range(count):
                self.run_of[start + i * period] = (start, period)


__all__ = ["find_runs", "Boundary", "boundary", "Repeats", "ENABLED", "MIN_LEN", "MAX_LEN"]
