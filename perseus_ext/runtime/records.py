"""Typed objects that cross process and rank boundaries (pickled by gloo or the solver child),
so no collaborator parses another one's dicts or strings."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from perseus_ext.planning.filler_program import CappedPlans
from perseus_ext.planning.frontier import Frontier, StagePlanTable
from perseus_ext.planning.options import SolverOptions
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
        points = {(virtual, instruction): measured
                  for virtual, (stage, _) in enumerate(schedule.placement)  # looped, V-shaped or other
                  for (measured_stage, instruction), measured in self.profile.points.items()
                  if measured_stage == stage}
        return Profile(points, f"{self.profile.source} (per virtual stage)")


@dataclass(frozen=True)
class SolveProblem:
    """What the pipeline leader hands the solver (inline or in the child process)."""

    schedule: PipelineSchedule
    measured: MeasuredProfile
    options: SolverOptions | None  # None: the solver's defaults
    switch_latency_s: float
    switch_cost_j: float = 0.0  # what a clock change must save to be kept (planning/switching.py)
    stage_constant: bool = False  # one clock per stage (full-iteration CUDA graphs: planning/stage_constant.py)
    power_floor: bool = False  # the devices draw a swing-capped plan's filler (GPU.supports_power_floor)


@dataclass(frozen=True)
class SolveResult:
    """The solve's one result: the frontier, or why there is none, and how it was solved.

    The solver returns it (inline, or pickled by the child process) and the pipeline leader keeps
    it; each rank of the pipeline deploys its own view of it, `for_stage(stage)`, which is also
    what the leader scatters (`shipping.py`).
    """

    frontier: Frontier | None
    error: str | None
    solve_s: float
    in_background: bool
    measured: MeasuredProfile | None = None  # what the frontier was solved from (planned durations)
    capped: CappedPlans | None = None  # a swing-capped frontier's fillers and swings (planning/filler_program.py)

    def for_stage(self, stage: int) -> StageSolve:
        """The view of the rank that runs `stage`, as it travels (no whole frontier)."""
        table = None if self.frontier is None else self.frontier.stage_table(stage)
        capped = None if self.capped is None else self.capped.for_stage(stage)
        return StageSolve(stage, table, self.error, self.solve_s, self.in_background, self.measured, capped=capped)


@dataclass(frozen=True)
class StageSolve:
    """One rank's view of its pipeline's `SolveResult`: every plan's time and energy and the
    clocks of its own stage (`table`), or why there is none. The pipeline leader scatters one to
    each rank (pickled by gloo: this is the wire format); the leader's own view also holds the
    whole frontier it solved (`whole_frontier`, never scattered)."""

    stage: int
    table: StagePlanTable | None  # this stage's plan table; None when there is no frontier
    error: str | None
    solve_s: float
    in_background: bool
    measured: MeasuredProfile | None
    whole_frontier: Frontier | None = None
    capped: CappedPlans | None = None  # every plan's swing and this stage's filler program (a swing cap)

    @cached_property
    def frontier(self) -> Frontier | None:
        """What this rank's policy chooses from: the leader's whole frontier; on every other rank
        every plan's time and energy without clocks (its table's figures)."""
        if self.whole_frontier is not None:
            return self.whole_frontier
        return None if self.table is None else self.table.frontier()


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
