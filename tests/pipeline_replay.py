"""An independent replay of a pipeline iteration and of a data-parallel job, for the oracle tests.

It shares nothing with the planner or the emulator but the schedule's per-stage orders and the
profile CSV: the CSV is read with the csv module, the dependencies of a non-interleaved 1F1B
pipeline are written out here (a forward needs the previous stage's forward of its microbatch, a
backward the next stage's backward, the last stage's backward its own forward), and the iteration
is run as a plain event loop over the stages (each runs its computations in order, starting one
when its stage is free and its input has arrived), not as a longest path over a DAG.

Energy is counted physically: every GPU draws its computation's profiled energy while computing
and the blocking power at every other moment until its iteration ends; a job's iteration ends
for every pipeline at the gradient sync, when the slowest pipeline (or the straggler's slowdown)
ends it.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class StageProfile:
    """(stage, instruction, MHz) -> (seconds, joules) of one computation, scaled like the
    emulator's full-size model: times x time_scale, energies x energy_scale."""

    points: dict[tuple[int, str, int], tuple[float, float]]

    @classmethod
    def read(cls, path: Path, time_scale: float = 1.0, energy_scale: float = 1.0) -> StageProfile:
        with open(path, newline="") as handle:
            return cls({(int(row["stage"]), row["instruction"], int(row["frequency"])):
                        (float(row["time"]) * time_scale, float(row["energy"]) * energy_scale)
                        for row in csv.DictReader(handle)})

    def clocks(self, stage: int, instruction: str) -> list[int]:
        return sorted((mhz for s, kind, mhz in self.points if (s, kind) == (stage, instruction)), reverse=True)


@dataclass(frozen=True)
class PipelineRun:
    """One pipeline's iteration: when it ends, each stage's busy time, the computations' energy,
    and when each computation (stage, instruction, microbatch) finished."""

    time_s: float
    busy_s: tuple[float, ...]
    computation_j: float
    finish_s: dict[tuple[int, str, int], float]

    def energy_until(self, end_s: float, stage_blocking_w: float) -> float:
        """The pipeline's energy when its GPUs are held until `end_s`: computation energy plus
        the blocking power of every stage for every second it is not computing."""
        assert end_s >= self.time_s - 1e-12
        return self.computation_j + stage_blocking_w * sum(end_s - busy for busy in self.busy_s)


def input_of(stage: int, stages: int, kind: str, microbatch: int) -> tuple[int, str, int] | None:
    """The computation whose output a 1F1B computation consumes (None: the data loader's)."""
    if kind == "forward":
        return (stage - 1, "forward", microbatch) if stage > 0 else None
    return (stage + 1, "backward", microbatch) if stage < stages - 1 else (stage, "forward", microbatch)


def replay_pipeline(orders: Sequence[Sequence], clocks: Sequence[Sequence[int]], profile: StageProfile) -> PipelineRun:
    """Run one 1F1B iteration: `orders[s]` are stage s's computations (with `.kind.value`,
    `.microbatch`, `.chunk`) in the order it runs them, `clocks[s][k]` the clock of the k-th."""
    stages = len(orders)
    assert all(c.chunk == 0 for order in orders for c in order), "non-interleaved 1F1B only"
    finished: dict[tuple[int, str, int], float] = {}
    free_at, busy, position = [0.0] * stages, [0.0] * stages, [0] * stages
    energy = 0.0
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for stage in range(stages):
            while position[stage] < len(orders[stage]):
                computation = orders[stage][position[stage]]
                kind, microbatch = computation.kind.value, computation.microbatch
                needs = input_of(stage, stages, kind, microbatch)
                if needs is not None and needs not in finished:
                    break  # its input has not arrived: another stage runs first
                start = max(free_at[stage], finished[needs] if needs is not None else 0.0)
                seconds, joules = profile.points[stage, kind, int(clocks[stage][position[stage]])]
                finished[stage, kind, microbatch] = free_at[stage] = start + seconds
                busy[stage] += seconds
                energy += joules
                position[stage] += 1
                remaining -= 1
                progressed = True
        assert progressed, "the schedule deadlocks"
    return PipelineRun(max(free_at), tuple(busy), energy, finished)


def latest_finish(orders: Sequence[Sequence], clocks: Sequence[Sequence[int]], profile: StageProfile,
                  run: PipelineRun, deadline_s: float) -> dict[tuple[int, str, int], float]:
    """The latest each computation may finish without the iteration ending after `deadline_s`
    (critical path method: backwards from the deadline over the same dependencies)."""
    stages = len(orders)
    later: dict[tuple[int, str, int], list[tuple[tuple[int, str, int], float]]] = {key: [] for key in run.finish_s}
    for stage, order in enumerate(orders):
        for k, computation in enumerate(order):
            me = (stage, computation.kind.value, computation.microbatch)
            seconds = profile.points[stage, me[1], int(clocks[stage][k])][0]
            if k > 0:
                before = order[k - 1]
                later[stage, before.kind.value, before.microbatch].append((me, seconds))
            needs = input_of(stage, stages, me[1], me[2])
            if needs is not None:
                later[needs].append((me, seconds))
    latest: dict[tuple[int, str, int], float] = {}
    for key in sorted(run.finish_s, key=run.finish_s.__getitem__, reverse=True):  # consumers finish later
        latest[key] = min([deadline_s] + [latest[after] - seconds for after, seconds in later[key]])
    return latest


def reclaim_slack(orders: Sequence[Sequence], profile: StageProfile, deadline_s: float,
                  stage_blocking_w: float) -> list[list[int]]:
    """A simple plan for an iteration held to `deadline_s`: from every computation at its
    fastest clock, each computation in turn (stage by stage) takes the clock that costs least
    energy once its stage's wait is charged (e - P_block t) among those that fit its slack. A
    greedy lower bound on what a planner should save, nothing like the solver's LP."""
    clocks = [[profile.clocks(stage, c.kind.value)[0] for c in order] for stage, order in enumerate(orders)]
    for stage, order in enumerate(orders):
        for k, computation in enumerate(order):
            run = replay_pipeline(orders, clocks, profile)
            latest = latest_finish(orders, clocks, profile, run, deadline_s)
            key = (stage, computation.kind.value, computation.microbatch)
            room_s = profile.points[stage, key[1], clocks[stage][k]][0] + latest[key] - run.finish_s[key]
            options = [(mhz, *profile.points[stage, key[1], mhz]) for mhz in profile.clocks(stage, key[1])]
            fitting = [(joules - stage_blocking_w * seconds, mhz) for mhz, seconds, joules in options
                       if mhz == clocks[stage][k] or seconds <= room_s]
            clocks[stage][k] = min(fitting)[1]
    return clocks


def uniform_clocks(orders: Sequence[Sequence], clock_of_stage: Sequence[int]) -> list[list[int]]:
    """Every computation of stage s at `clock_of_stage[s]`."""
    return [[clock_of_stage[stage]] * len(order) for stage, order in enumerate(orders)]


@dataclass(frozen=True)
class JobIteration:
    time_s: float
    energy_j: float


def job_iteration(straggler: PipelineRun, others: PipelineRun, pipelines: int, stage_blocking_w: float,
                  straggler_hold_s: float | None) -> JobIteration:
    """One iteration of `pipelines` data-parallel pipelines: one runs `straggler` and, when
    `straggler_hold_s` is given, cannot end its iteration before then (its extra time is idle);
    the others run `others`. Every pipeline's GPUs wait at the gradient sync for the last one."""
    if straggler_hold_s is None:
        return JobIteration(others.time_s, pipelines * others.energy_until(others.time_s, stage_blocking_w))
    straggler_end = max(straggler.time_s, straggler_hold_s)
    end = max(straggler_end, others.time_s) if pipelines > 1 else straggler_end
    energy = straggler.energy_until(end, stage_blocking_w) + (pipelines - 1) * others.energy_until(end, stage_blocking_w)
    return JobIteration(end, energy)
