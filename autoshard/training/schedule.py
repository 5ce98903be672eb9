"""Pipeline schedules as data: which action each pipeline rank runs, in order.

An action is a forward (F), a backward (B) or — when the backward is split, as zero-bubble
schedules do — an input-gradient backward (B) followed later by a weight-gradient pass (W), of
one model chunk ("virtual stage") on one micro-batch. Rank r runs virtual stages r, r + p,
r + 2p, ... (p ranks; more than one chunk per rank is the interleaved schedule).

Schedules are made here, checked for completeness and dependencies (`validate`), and simulated
with per-action costs (`simulate`: start times, makespan, bubble fraction, the most micro-batches
whose activations a rank holds at once). The driver (pipeline.py) dispatches the actions in the
simulated order; the schedule decides nothing about values, only about order and overlap.

    FThenB  every forward, then every backward (GPipe)            bubble (p-1)/(m+p-1)
    1F1B    p-r-1 warm-up forwards, then one forward / one backward; activations of ≤ p-r
            micro-batches held at once instead of m                 bubble (p-1)/(m+p-1)
    VPP     1F1B over v chunks per rank, interleaved (Megatron); m a multiple of p
                                                                    bubble (p-1)/(v·m+p-1)
    ZBH1    1F1B with the weight gradient split off the backward and run where the rank would
            wait (zero bubble, H1: no more activations held than 1F1B)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from ..errors import AutoshardError


class ScheduleError(AutoshardError, ValueError):
    """A pipeline schedule that cannot run: an action missing or twice, an impossible order."""


@dataclass(frozen=True, order=True)
class Action:
    """`kind` ("F", "B" or "W") of virtual stage `stage` on micro-batch `micro`."""

    kind: str
    stage: int
    micro: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.stage}.{self.micro}"


@dataclass(frozen=True)
class Schedule:
    """Per rank, its actions in the order it runs them."""

    name: str
    ranks: int
    micro_batches: int
    chunks: int                                 # virtual stages per rank
    actions: tuple[tuple[Action, ...], ...]     # actions[r]: rank r's, in order
    split_backward: bool = False                # W actions carry the weight gradients

    @property
    def stages(self) -> int:
        """Virtual stages (model chunks) in all."""
        return self.ranks * self.chunks

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(repr, acts))
                         for r, acts in enumerate(self.actions))


# -------------------------------------------------------------------------------- makers
def _check_sizes(ranks: int, micro_batches: int, chunks: int = 1) -> None:
    for name, n in (("ranks (pipeline stages)", ranks), ("micro_batches", micro_batches),
                    ("chunks (vpp_degree)", chunks)):
        if not isinstance(n, int) or n < 1:
            raise ScheduleError(f"{name} must be a positive int, got {n!r}")


def fthenb(ranks: int, micro_batches: int) -> Schedule:
    """GPipe: all forwards, then all backwards."""
    _check_sizes(ranks, micro_batches)
    m = range(micro_batches)
    acts = tuple(tuple([Action("F", r, i) for i in m] + [Action("B", r, i) for i in m])
                 for r in range(ranks))
    return Schedule("FThenB", ranks, micro_batches, 1, acts)


def one_f_one_b(ranks: int, micro_batches: int) -> Schedule:
    """1F1B: rank r runs p-r-1 warm-up forwards, then alternates forward and backward."""
    _check_sizes(ranks, micro_batches)
    acts = []
    for r in range(ranks):
        warm = min(ranks - r - 1, micro_batches)
        seq = [Action("F", r, i) for i in range(warm)]
        for i in range(micro_batches - warm):
            seq += [Action("F", r, warm + i), Action("B", r, i)]
        seq += [Action("B", r, i) for i in range(micro_batches - warm, micro_batches)]
        acts.append(tuple(seq))
    return Schedule("1F1B", ranks, micro_batches, 1, tuple(acts))


def interleaved(ranks: int, micro_batches: int, chunks: int) -> Schedule:
    """Interleaved 1F1B (VPP): v = `chunks` model chunks per rank; chunk c of rank r is virtual
    stage c·p + r. Micro-batches go through the chunks in groups of p, which is why m must be a
    multiple of p."""
    _check_sizes(ranks, micro_batches, chunks)
    if chunks == 1:
        return one_f_one_b(ranks, micro_batches)
    if micro_batches % ranks:
        raise ScheduleError(f"the interleaved (VPP) schedule needs micro_batches to be a multiple "
                            f"of the pipeline ranks: {micro_batches} micro-batches on {ranks} "
                            f"ranks; use {micro_batches + (-micro_batches) % ranks}")
    p, v, m = ranks, chunks, micro_batches
    total = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        """The k-th forward (or backward) of a rank: (chunk, micro-batch)."""
        chunk = (k // p) % v
        micro = (k // (p * v)) * p + k % p
        return (v - 1 - chunk if backward else chunk), micro

    acts = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        seq = []
        for k in range(warm):
            c, i = unit(k, False)
            seq.append(Action("F", c * p + r, i))
        for k in range(total - warm):
            c, i = unit(warm + k, False)
            seq.append(Action("F", c * p + r, i))
            c, i = unit(k, True)
            seq.append(Action("B", c * p + r, i))
        for k in range(total - warm, total):
            c, i = unit(k, True)
            seq.append(Action("B", c * p + r, i))
        acts.append(tuple(seq))
    return Schedule("VPP", p, m, v, tuple(acts))


def zero_bubble_h1(ranks: int, micro_batches: int, costs: dict | None = None) -> Schedule:
    """ZB-H1: 1F1B's order of forwards and input-gradient backwards; each weight-gradient pass
    (W) waits in its rank's queue and runs when the rank would otherwise wait for a neighbour,
    or before a forward that would make the rank hold more micro-batches than 1F1B's first rank
    does, p (a micro-batch is held from its forward to its W), or at the end: the peak memory
    is 1F1B's. The order comes from simulating the ranks with `costs` (default F = B = W = 1;
    per stage as in `simulate`)."""
    base = one_f_one_b(ranks, micro_batches)
    costs = {"F": 1.0, "B": 1.0, "W": 1.0, **(costs or {})}
    orders: list[list[Action]] = [[] for _ in range(ranks)]
    todo = [list(acts) for acts in base.actions]
    queued: list[list[Action]] = [[] for _ in range(ranks)]
    free = [0.0] * ranks
    done: dict[Action, float] = {}

    alive = [0] * ranks

    def run(r: int, a: Action, at: float) -> None:
        orders[r].append(a)
        alive[r] += 1 if a.kind == "F" else -1 if a.kind == "W" else 0
        free[r] = done[a] = at + costs.get((a.stage, a.kind), costs[a.kind])
        if a.kind == "B":
            queued[r].append(Action("W", a.stage, a.micro))

    while any(todo) or any(queued):
        # of what each rank could run next, the earliest (ties: the lower rank) goes first
        best = None
        for r in range(ranks):
            now, nxt = free[r], (todo[r][0] if todo[r] else None)
            deps = _deps(nxt, base.stages) if nxt is not None else ()
            ready = nxt is not None and all(d in done for d in deps)
            at = max([now, *(done[d] for d in deps)]) if ready else None
            # no rank holds more micro-batches (forward run, W not yet) than 1F1B's first, p
            full = nxt is not None and nxt.kind == "F" and alive[r] >= ranks
            if queued[r] and (not ready or at > now or full):
                pick = (now, r, queued[r][0])  # the rank would wait: a weight gradient fills it
            elif ready:
                pick = (at, r, nxt)
            else:
                continue  # waits for another rank's result
            best = pick if best is None or pick[:2] < best[:2] else best
        if best is None:  # unreachable for 1F1B's order; kept so a bug cannot loop forever
            raise ScheduleError("ZBH1: every rank waits for another")
        at, r, a = best
        (queued[r] if a.kind == "W" else todo[r]).pop(0)
        run(r, a, at)
    return Schedule("ZBH1", ranks, micro_batches, 1, tuple(map(tuple, orders)),
                    split_backward=True)


MODES = ("FThenB", "1F1B", "VPP", "ZBH1")  # Paddle's strategy.pipeline.schedule_mode names


def make_schedule(mode: str, ranks: int, micro_batches: int, chunks: int = 1,
                  costs: dict | None = None) -> Schedule:
    """A schedule by Paddle's name for it (`costs`: what ZBH1 places its W passes by)."""
    if mode == "FThenB":
        made = fthenb(ranks, micro_batches)
    elif mode == "1F1B":
        made = one_f_one_b(ranks, micro_batches)
    elif mode == "VPP":
        made = interleaved(ranks, micro_batches, chunks)
    elif mode == "ZBH1":
        made = zero_bubble_h1(ranks, micro_batches, costs)
    else:
        raise ScheduleError(f"unknown pipeline schedule {mode!r}; the schedules are {list(MODES)}")
    if chunks != made.chunks:
        raise ScheduleError(f"schedule {mode!r} runs one model chunk per rank, but {chunks} were "
                            f"asked for: use schedule 'VPP' for several chunks per rank")
    return made


# -------------------------------------------------------------------------- dependencies
def _deps(a: Action, stages: int) -> tuple[Action, ...]:
    """What must have finished before `a` runs (activations and cotangents between stages)."""
    if a.kind == "F":
        return (Action("F", a.stage - 1, a.micro),) if a.stage > 0 else ()
    if a.kind == "B":
        after = (Action("B", a.stage + 1, a.micro),) if a.stage + 1 < stages else ()
        return (Action("F", a.stage, a.micro), *after)
    return (Action("B", a.stage, a.micro),)


def validate(schedule: Schedule) -> None:
    """Every action exactly once, on the rank of its stage; an order that cannot deadlock."""
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    want = {Action(k, s, i) for k in kinds for s in range(schedule.stages)
            for i in range(schedule.micro_batches)}
    seen: set[Action] = set()
    if len(schedule.actions) != schedule.ranks:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for "
                            f"{schedule.ranks} ranks")
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            if a in seen:
                raise ScheduleError(f"{schedule.name}: {a!r} runs twice")
            if a not in want:
                raise ScheduleError(f"{schedule.name}: {a!r} is not an action of this pipeline")
            if schedule.rank_of(a.stage) != r:
                raise ScheduleError(f"{schedule.name}: {a!r} is on rank {r}, but stage "
                                    f"{a.stage} lives on rank {schedule.rank_of(a.stage)}")
            seen.add(a)
    missing = sorted(want - seen)
    if missing:
        raise ScheduleError(f"{schedule.name}: {len(missing)} actions never run, e.g. "
                            f"{missing[:4]}")
    simulate(schedule)  # raises on a deadlock


# ----------------------------------------------------------------------------- simulation
@dataclass(frozen=True)
class Timeline:
    """A schedule run with given costs: when each action starts, and what that costs."""

    schedule: Schedule
    start: dict[Action, float]
    finish: dict[Action, float]
    makespan: float
    busy: tuple[float, ...]                    # per rank: time spent computing
    peak_in_flight: tuple[int, ...]            # per rank: most micro-batches whose forward
    # activations it holds at once (forward run, weight gradient not yet done)
    order: tuple[Action, ...] = field(repr=False, default=())   # all actions by start time

    @property
    def bubble(self) -> float:
        """The share of rank-time spent waiting."""
        total = self.makespan * self.schedule.ranks
        return 1.0 - sum(self.busy) / total if total else 0.0


def default_costs(schedule: Schedule) -> dict[str, float]:
    """A rank's whole forward = 1 (a chunk's 1/v under VPP); a backward costs twice a
    forward, split evenly between B and W when split."""
    f = 1.0 / schedule.chunks
    return {"F": f, "B": f, "W": f} if schedule.split_backward else {"F": f, "B": 2 * f}


def simulate(schedule: Schedule, costs: dict | None = None) -> Timeline:
    """Run the schedule's fixed per-rank orders as a list schedule (no communication time):
    each action starts when its rank is free and its dependencies have finished.

    `costs`: per kind ({"F": 1, "B": 2}) and, overriding those, per stage and kind
    ({(stage, "F"): seconds}: measured costs, PipelineRunner.profile)."""
    costs = {**default_costs(schedule), **(costs or {})}
    stages = schedule.stages
    pos = [0] * schedule.ranks
    free = [0.0] * schedule.ranks
    busy = [0.0] * schedule.ranks
    start: dict[Action, float] = {}
    finish: dict[Action, float] = {}
    remaining = sum(map(len, schedule.actions))
    while remaining:
        best = None
        for r, acts in enumerate(schedule.actions):
            if pos[r] == len(acts):
                continue
            a = acts[pos[r]]
            deps = _deps(a, stages)
            if all(d in finish for d in deps):
                at = max([free[r], *(finish[d] for d in deps)])
                if best is None or (at, r) < best[:2]:
                    best = (at, r, a)
        if best is None:
            stuck = [acts[pos[r]] for r, acts in enumerate(schedule.actions) if pos[r] < len(acts)]
            raise ScheduleError(f"{schedule.name} deadlocks: the next actions {stuck} each wait "
                                f"for an action that runs after another of them")
        at, r, a = best
        cost = costs.get((a.stage, a.kind), costs[a.kind])
        start[a], finish[a] = at, at + cost
        free[r] = finish[a]
        busy[r] += cost
        pos[r] += 1
        remaining -= 1
    return Timeline(schedule, start, finish, max(finish.values(), default=0.0), tuple(busy),
                    _peaks(schedule), tuple(sorted(start, key=lambda a: (start[a],
                                                                         schedule.rank_of(a.stage)))))


def _peaks(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most micro-batch-chunks alive at once: from a forward to the pass that
    ends its backward (W when split, else B)."""
    last = "W" if schedule.split_backward else "B"
    peaks = []
    for acts in schedule.actions:
        alive = peak = 0
        for a in acts:
            alive += 1 if a.kind == "F" else -1 if a.kind == last else 0
            peak = max(peak, alive)
        peaks.append(peak)
    return tuple(peaks)


def dispatch_order(schedule: Schedule, costs: dict | None = None) -> tuple[Action, ...]:
    """All actions in one order a single host thread can issue them: by simulated start time.
    Every action comes after its dependencies, and ranks' work interleaves as it would run."""
    return simulate(schedule, costs).order


def bubble_formula(mode: str, ranks: int, micro_batches: int, chunks: int = 1) -> float:
    """The textbook bubble fraction of FThenB / 1F1B ((p-1)/(m+p-1)) and of the interleaved
    schedule ((p-1)/(v·m+p-1)), for B = 2F."""
    if mode not in ("FThenB", "1F1B", "VPP"):
        raise ScheduleError(f"no closed form for {mode!r}")
    v = chunks if mode == "VPP" else 1
    return (ranks - 1) / (v * micro_batches + ranks - 1)


def table(timelines: Iterable[Timeline]) -> str:
    """A plain-text comparison: schedule, ranks, micro-batches, makespan, bubble, peak."""
    rows = [f"{'schedule':>8} {'ranks':>5} {'micro':>5} {'chunks':>6} {'makespan':>8} "
            f"{'bubble':>7} {'peak in flight':>14}"]
    for t in timelines:
        s = t.schedule
        rows.append(f"{s.name:>8} {s.ranks:>5} {s.micro_batches:>5} {s.chunks:>6} "
                    f"{t.makespan:>8.1f} {t.bubble:>7.1%} {max(t.peak_in_flight):>14}")
    return "\n".join(rows)


__all__ = ["Action", "Schedule", "ScheduleError", "Timeline", "fthenb", "one_f_one_b",
           "interleaved", "zero_bubble_h1", "make_schedule", "validate", "simulate",
           "dispatch_order", "bubble_formula", "default_costs", "table", "MODES"]
