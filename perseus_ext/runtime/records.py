"""Typed objects that cross process and rank boundaries (pickled by gloo or the solver child),
so no collaborator parses another one's dicts or strings."""

from __future__ import annotations

from dataclasses import dataclass

from perseus_ext.planning.frontier import Frontier
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import PipelineSchedule


@dataclass(frozen=True)
class MeasuredProfile:
    """A pipeline's per-stage profile plus what its CSV cannot hold.

    Energies in `profile` are per stage (the sum over the stage's tensor-parallel GPUs), so the
    blocking power is per stage too: one GPU's blocking power times `gpus_per_stage`.
    """

    profile: Profile
    blocking_power_per_stage_w: float
    gpus_per_stage: int
    gpu_name: str | None

    @property
    def blocking_power_per_gpu_w(self) -> float:
        return self.blocking_power_per_stage_w / self.gpus_per_stage

    def for_schedule(self, schedule: PipelineSchedule) -> Profile:
        """The profile the planner reads for `schedule`.

        The runtime times single computations: with V model chunks per GPU, one chunk's forward
        or backward. The planner reads a profile of one entry per GPU stage as the stage's whole
        model and gives each chunk 1/V of it, so an interleaved schedule gets one entry per
        virtual stage instead, each holding its GPU's measured computations."""
        if schedule.num_chunks == 1:
            return self.profile
        stages = self.profile.num_stages
        points = {(chunk * stages + stage, instruction): measured
                  for (stage, instruction), measured in self.profile.points.items()
                  for chunk in range(schedule.num_chunks)}
        return Profile(points, f"{self.profile.source} (per virtual stage)")


@dataclass(frozen=True)
class SolveProblem:
    """What the pipeline leader hands the solver (inline or in the child process)."""

    schedule: PipelineSchedule
    measured: MeasuredProfile
    options: object | None  # perseus_ext.planning.solver.SolverOptions, or None for its defaults
    switch_latency_s: float
    switch_cost_j: float = 0.0  # what a clock change must save to be kept (planning/switching.py)
    stage_constant: bool = False  # one clock per stage (full-iteration CUDA graphs: planning/stage_constant.py)


@dataclass(frozen=True)
class SolveOutcome:
    """The frontier, or why there is none; broadcast from the pipeline leader to its stages."""

    frontier: Frontier | None
    error: str | None
    solve_s: float
    in_background: bool
    measured: MeasuredProfile | None = None  # what the frontier was solved from (planned durations)


@dataclass(frozen=True)
class PlanChoice:
    """The pipeline leader's plan for every stage, and when to evaluate the policy again."""

    index: int
    reevaluate_in_iterations: int | None


@dataclass(frozen=True)
class PlanSwitch:
    """A deployed plan change, as reported in the summary."""

    iteration: int
    plan: int
    factor: float
    reason: str
    plan_time_s: float
    plan_energy_j: float
