"""Repeats: the blocks of equations a program repeats back to back, and when a later block may
take the plan of the first.

An unrolled model repeats itself: every layer's forward, every layer's backward, the
optimizer's update of each like-shaped leaf. `find_runs` finds such stretches in a list of
equation numbers (equal numbers: equal equations), and `find_blocks` also stretches repeated
with other equations between (partition outlines those too, outline.py). The plan (plan.py)
numbers equations by their rule signature (primitive, params and types: one object per distinct
equation), decides the first block of a run as usual, and for every later block checks that
everything its decisions read is the same as it was for the first block — the operand layouts
from outside the block and the copies made of them so far, which outside values are one value,
the wiring inside the block, the propagated preferences of its results, which values have one
reader, which are parameters. If so the later block's decisions are the first block's, and are
copied rather than made again; if not, it is planned equation by equation. Copying never
decides anything: a block either takes exactly the decisions it would have made, or is planned
as usual. Propagation's first sweep copies the proposals of a block the same way (propagate.py,
`first_sweep`).
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


def find_blocks(h: list[int], min_len: int = MIN_LEN, tries: int = TRIES, apart: bool = True
                ) -> list[tuple[int, list[int]]]:
    """(period, starts) of each group of equal blocks `h[s:s + period]`, s in starts: the
    back-to-back runs of `find_runs`, then (`apart`) stretches that occur again further on with
    other equations between — longest first, so that a layer's long stretch is not cut up by a
    short one that happens to come first. (A model's first layer also computes what every
    layer reads alike — the attention mask, made once by jax's CSE — so its second layer is no
    back-to-back repeat of it: a 2-layer model has no run at all in its forward.)"""
    groups = [(period, [start + i * period for i in range(count)])
              for start, period, count in find_runs(h, min_len, tries=tries)]
    if not apart:
        return groups
    n = len(h)
    covered = bytearray(n)

    def cover(start: int, length: int) -> None:
        covered[start:start + length] = b"\x01" * length

    for period, starts in groups:
        for s in starts:
            cover(s, period)
    prev: dict = {}  # number -> the uncovered positions holding it so far (latest last)
    pairs = []  # (-length, s, j): h[s:s + length] == h[j:j + length], j + length <= s
    matched: set = set()  # (s, j) pairs inside a longer pair found already
    for s in range(n):
        x = h[s]
        if covered[s] or x < 0:
            continue
        earlier = prev.setdefault(x, [])
        for j in earlier[-tries:]:
            if (s, j) in matched:
                continue
            m = 1
            while (s + m < n and j + m < s and h[j + m] == h[s + m] and not covered[s + m]
                   and not covered[j + m]):
                m += 1
            if m >= min_len:
                pairs.append((-m, s, j))
            # (its tails are no longer: not extended again)
            matched.update([(s + i, j + i) for i in range(1, m)])
        earlier.append(s)
    pairs.sort()
    first_of: dict = {}  # start of an accepted block -> (period, its group's starts)
    for neg, s, j in pairs:
        m = -neg
        if any(covered[s:s + m]):
            continue
        group = first_of.get(j)
        if group is None or group[0] != m:
            if any(covered[j:j + m]):
                continue
            group = first_of[j] = (m, [j])
            groups.append(group)
            cover(j, m)
        group[1].append(s)
        first_of[s] = group
        cover(s, m)
    for _, starts in groups:
        starts.sort()
    return groups


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


def same_readers(single_use: list, first: int, start: int, read) -> bool:
    """Whether blocks at `first` and `start` agree on which operands have other readers at
    the offsets `read` — where the first block's choices read a Partial, the only place the
    chooser asks (a Partial flows through a single reader, strategy.candidates)."""
    return all(single_use[first + j] == single_use[start + j] for j in read)


class Repeats:
    """The repeated blocks of one program, numbered by `ids` (one number per distinct equation,
    negative: never repeats), and the blocks planned so far of each run by their boundary: a
    later block with the boundary of one of them takes its plan. (The first layer of a model
    often reads its input in another layout than the rest: the second becomes the one the
    others copy.)"""

    def __init__(self, ids: list[int]):
        self.run_of: dict[int, tuple[int, int]] = {}  # block start -> (run start, period)
        self.planned: dict[int, dict] = {}  # run start -> {boundary: starts of planned blocks}
        if not ENABLED:
            return
        # back-to-back runs only: a block apart from its equal is most often the first layer
        # of a model (its stretches equal to the second's, past the attention mask), whose
        # operands come in other layouts (the embedding's Partial output) — its boundary never
        # matches, and checking cost the 2-layer GPT step 0.4 ms for nothing copied
        for period, starts in find_blocks(ids, apart=False):
            self.planned[starts[0]] = {}
            for s in starts:
                self.run_of[s] = (starts[0], period)


__all__ = ["find_runs", "find_blocks", "Boundary", "boundary", "Repeats", "same_readers",
           "ENABLED", "MIN_LEN",
           "MAX_LEN"]
