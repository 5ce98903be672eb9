"""Reading collectives out of compiled HLO text, to check what a program really communicates.

XLA's combiner passes merge independent all-reduces (all-gathers, reduce-scatters) into one
op over a tuple of operands; each operand is one logical collective and is counted as such.
An all-to-all, by contrast, may be emitted over several operand pieces of one exchange.
Where XLA does not combine all-gathers (CPU), autoshard packs small ones into one buffer itself
(compiler/combine.py) and names the member count in the op's metadata; each member is counted.

By default every function counts the collectives as written (each op once, wherever it is), which
is what a plan lists. With `per_step=True` an op inside a loop counts once per iteration (XLA
records `known_trip_count` on the while loops of scans): what one call of the program runs.
"""
from __future__ import annotations

import re
from collections import Counter

COLLECTIVE_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# Async pairs (all-gather-start / -done) count once, at the start.
_OP = re.compile(r"\b(" + "|".join(COLLECTIVE_KINDS) + r")(-start)?\(([^)]*)\)")
_COMBINABLE = {"all-gather", "all-reduce", "reduce-scatter"}
PACKED_SCOPE = "packed_all_gather_x"  # + member count: the scope of a packed gather's op name
_PACKED = re.compile(r'op_name="[^"]*' + PACKED_SCOPE + r'(\d+)')  # see compiler/combine.py
# Long tuples carry `/*index=5*/` markers, whose "=" would stop _RESULT's tuple match.
_COMMENT = re.compile(r"/\*.*?\*/")

# -------------------------------------------------------------------- computations and loops
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)="
                     r"%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def _weighted_lines(hlo_text: str, per_step: bool) -> list[tuple[str, int]]:
    """Every line (comments stripped) with how many times it runs per call of the module."""
    lines = [_COMMENT.sub("", line) for line in hlo_text.splitlines()]
    if not per_step:
        return [(line, 1) for line in lines]
    owner: list[str | None] = []
    calls: dict[str, list[tuple[str, int]]] = {}
    entry, current = None, None
    for line in lines:
        m = _HEADER.match(line)
        if m:
            current = m.group(2)
            calls.setdefault(current, [])
            if m.group(1):
                entry = current
        owner.append(current)
        if current is None or m:
            continue
        trip = _TRIP.search(line)
        for kind, callee in _CALLEE.findall(line):
            n = int(trip.group(1)) if trip and kind in ("body", "condition") else 1
            calls[current].append((callee, n))
        for group in _BRANCHES.findall(line):
            calls[current].extend((c.strip().lstrip("%"), 1) for c in group.split(",") if c.strip())
    runs: Counter = Counter()

    def visit(name: str, times: int, depth: int = 0) -> None:
        if depth > 64:  # HLO call graphs are acyclic; this only guards malformed text
            return
        runs[name] += times
        for callee, n in calls.get(name, ()):
            visit(callee, times * n, depth + 1)

    if entry is None:  # a bare fragment: count as written
        return [(line, 1) for line in lines]
    visit(entry, 1)
    return [(line, runs.get(name, 0) if name else 1) for line, name in zip(lines, owner)]


# -------------------------------------------------------------------- counts
def collectives(hlo_text: str, per_step: bool = False) -> list[str]:
    """The logical collectives of an HLO module, in textual order (repeated per loop trip
    with `per_step`)."""
    found = []
    for line, times in _weighted_lines(hlo_text, per_step):
        m = _OP.search(line)
        if not m or not times:
            continue
        kind, operands = m.group(1), m.group(3)
        n = operands.count("%") if kind in _COMBINABLE else 1
        packed = _PACKED.search(line) if kind == "all-gather" else None
        if packed:
            n *= int(packed.group(1))
        found.extend([kind] * (max(n, 1) * times))
    return found


def count_collectives(hlo_text: str, per_step: bool = False) -> Counter:
    return Counter(collectives(hlo_text, per_step))


def count_collective_ops(hlo_text: str, per_step: bool = False) -> Counter:
    """Collective ops by kind, a combined op once: how many times the devices synchronise
    (what a latency-bound step pays for), where `count_collectives` counts what is moved."""
    found: Counter = Counter()
    for line, times in _weighted_lines(hlo_text, per_step):
        m = _OP.search(line)
        if m and times:
            found[m.group(1)] += times
    return found


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_RESULT = re.compile(r"=\s+(\([^=]*?\)|\S+)\s+(" + "|".join(COLLECTIVE_KINDS) + r")(-start)?\(")


def _result_bytes(m: re.Match) -> int:
    arrays = _ARRAY.findall(m.group(1))
    if m.group(3):  # an async start returns (operands, results): count the results half
        arrays = arrays[len(arrays) // 2:]
    total = 0
    for dtype, dims in arrays:
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES.get(dtype, 4)
    return total


def collective_bytes(hlo_text: str, per_step: bool = False) -> Counter:
    """Result bytes of the collectives per kind (per device), tuples of combined ops summed.

    The size of what each collective produces on one device: a deterministic measure of
    traffic to compare two programs (the wire bytes of a ring algorithm are proportional).
    """
    total: Counter = Counter()
    for line, times in _weighted_lines(hlo_text, per_step):
        m = _RESULT.search(line)
        if m and times:
            total[m.group(2)] += _result_bytes(m) * times
    return total


# -------------------------------------------------------------------- wire bytes
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
# Bytes one device sends per result byte in a ring (bandwidth-optimal) implementation, for a
# group of n: an all-reduce is a reduce-scatter then an all-gather of the whole buffer.
_WIRE = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
         "reduce-scatter": lambda n: n - 1, "all-to-all": lambda n: (n - 1) / n,
         "collective-permute": lambda n: 1.0}


def group_size(line: str, devices: int) -> int:
    """How many devices take part in each group of the collective on this HLO line.

    Three spellings occur: explicit lists (`{{0,4},{1,5}}`), iota form (`[4,2]<=[8]`: 4 groups
    of 2) and Shardy's mesh form (`mesh['a'=2,'b'=4] {'b'}`: groups over the named axes).
    No groups at all means one group of every device.
    """
    if m := _GROUPS_LIST.search(line):
        return max(1, len(list(filter(None, m.group(1).split(",")))))
    if m := _GROUPS_IOTA.search(line):
        return int(m.group(1).split(",")[-1])
    if m := _GROUPS_MESH.search(line):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        n = 1
        for name in re.findall(r"'([^']+)'", m.group(2)):
            n *= int(sizes.get(name, 1))
        return n
    return devices


def collective_wire_bytes(hlo_text: str, per_step: bool = False) -> Counter:
    """Bytes each device sends per kind, as a ring implementation of each collective would.

    `collective_bytes` counts what a collective produces, which ranks an all-gather (whole
    result) above a reduce-scatter (one shard) although a ring sends the same amount for
    either; this is the measure under which sequence parallelism (reduce-scatter + all-gather)
    and Megatron's all-reduce cost the same, as they do on the wire. It is also the convention
    of the planner's `bytes_per_device`.
    """
    m = _PARTITIONS.search(hlo_text)
    devices = int(m.group(1)) if m else 1
    total: Counter = Counter()
    for line, times in _weighted_lines(hlo_text, per_step):
        m = _RESULT.search(line)
        if m and times:
            kind = m.group(2)
            total[kind] += _result_bytes(m) * _WIRE[kind](group_size(line, devices)) * times
    return total


__all__ = ["collectives", "count_collectives", "count_collective_ops", "collective_bytes",
           "collective_wire_bytes", "group_size", "COLLECTIVE_KINDS"]
