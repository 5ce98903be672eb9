"""Measuring a pipeline run: each action's time, each rank's busy time, and the schedule
replayed with the measured costs beside the measured step.

A schedule is chosen on assumed costs (a backward twice a forward, every stage alike); real
stages are not alike — the one with the embedding or the loss head is often the slowest, and
the pipeline runs at its pace. `PipelineRunner.profile(...)` runs the step with the host
waiting for every action before it issues the next, so each action's time is its own (dispatch,
the transfer of what it reads, compute), takes the median per stage and kind, and simulates the
schedule with those costs: the predicted step and bubble under perfect overlap, to compare with
the measured overlapped step. The costs can be handed back to the runner (`costs=`) so that its
dispatch order (and ZBH1's placement of weight-gradient passes) follows the measured stages.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import jax

from .schedule import Schedule, Timeline, simulate

KINDS = ("F", "B", "W")


@dataclass(frozen=True)
class PipelineProfile:
    """What one pipeline step costs, measured (seconds; medians over the profiled steps)."""

    schedule: Schedule
    costs: dict          # (stage, kind) -> seconds of one action, run alone
    timeline: Timeline   # the schedule simulated with `costs`
    step_s: float        # the step as the runner runs it (actions overlapped)
    serial_s: float      # the step with the host waiting for every action

    @property
    def busy(self) -> tuple[float, ...]:
        """Per rank: seconds of its actions in one step."""
        return self.timeline.busy

    @property
    def predicted_s(self) -> float:
        """The step under perfect overlap of the measured actions (no host or link limits)."""
        return self.timeline.makespan

    @property
    def bubble(self) -> float:
        return self.timeline.bubble

    def stage_seconds(self) -> list[float]:
        """Per stage: one micro-batch's forward and backward (all its kinds)."""
        totals = [0.0] * self.schedule.stages
        for (stage, _), seconds in self.costs.items():
            totals[stage] += seconds
        return totals

    @property
    def imbalance(self) -> float:
        """The slowest stage over the mean stage (1.0: balanced); the pipeline runs at the
        slowest stage's pace, so work moved off it shortens every step."""
        totals = self.stage_seconds()
        mean = sum(totals) / len(totals)
        return max(totals) / mean if mean else 1.0

    def __str__(self) -> str:
        s = self.schedule
        kinds = [k for k in KINDS if any(kind == k for _, kind in self.costs)]
        head = f"{'stage':>5} {'rank':>4} " + " ".join(f"{k + ' ms':>8}" for k in kinds)
        rows = [f"pipeline profile: {s.name}, {s.stages} stages on {s.ranks} ranks, "
                f"{s.micro_batches} micro-batches (medians of each action run alone)", head]
        for stage in range(s.stages):
            cells = " ".join(f"{self.costs.get((stage, k), 0.0) * 1e3:>8.2f}" for k in kinds)
            rows.append(f"{stage:>5} {s.rank_of(stage):>4} {cells}")
        totals = self.stage_seconds()
        slow = max(range(len(totals)), key=totals.__getitem__)
        rows += [
            "busy per rank (ms/step): " + ", ".join(f"{b * 1e3:.1f}" for b in self.busy),
            f"stage balance: slowest stage {slow} at {self.imbalance:.2f}× the mean",
            f"simulated with these costs: step {self.predicted_s * 1e3:.1f} ms, bubble "
            f"{self.bubble:.1%}",
            f"measured: step {self.step_s * 1e3:.1f} ms overlapped, {self.serial_s * 1e3:.1f} ms "
            f"with every action waited for",
        ]
        return "\n".join(rows)


def measure(runner: Any, step: Callable[[], Any], steps: int = 3) -> PipelineProfile:
    """Profile `runner` on `step()` (one call of its value_and_grad on fixed arguments): one
    warm-up call (compiles), `steps` calls timing every action alone, `steps` overlapped."""
    jax.block_until_ready(step())
    samples: dict = defaultdict(list)
    serial = []
    clock = [0.0]  # when the previous action's results were ready

    def timed(action) -> None:
        now = time.perf_counter()
        samples[(action.stage, action.kind)].append(now - clock[0])
        clock[0] = now

    blocking, probe = runner.blocking, runner.after_action
    try:
        runner.blocking, runner.after_action = True, timed
        for _ in range(steps):
            clock[0] = start = time.perf_counter()
            jax.block_until_ready(step())
            serial.append(time.perf_counter() - start)
    finally:
        runner.blocking, runner.after_action = blocking, probe
    overlapped = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(step())
        overlapped.append(time.perf_counter() - start)
    costs = {key: statistics.median(v) for key, v in sorted(samples.items())}
    return PipelineProfile(runner.schedule, costs, simulate(runner.schedule, costs),
                           statistics.median(overlapped), statistics.median(serial))


__all__ = ["PipelineProfile", "measure"]
