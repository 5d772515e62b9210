"""The solving phase as a collaborator of the runtime: from the pipeline's measured profile to the
frontier every rank of the pipeline deploys.

Its input is the measured profile, or the one saved beside the job (`ProfileStore`: loaded when
the runtime is built; pipeline 0's measured one is saved there). The pipeline leader solves (in
a child process while training goes on, or inline), keeps the frontier it solved for each
schedule (a `reschedule` back to one re-uses it), ships every other rank its own stage's share
(`shipping.py`) and saves pipeline 0's frontier to `frontier_path`. Every rank polls `collect()`
once per solving iteration: it returns None until every leader of the job has a result (one
all-reduce), then this rank's view of it, a `StageSolve` (the leader's holds the whole frontier).
Leader-only work never raises past `collect()`, so no rank skips a collective.

Under `perseus.solver.power_swing_cap` the leader plans fillers (dummy work while GPUs wait) only
where its device can draw a stated power (`GPU.supports_power_floor`, the simulated GPU), and
clock-only plans elsewhere; each rank receives its stage's filler programs with its plans and
draws the deployed plan's (`actuation/filler.py`, `play_filler`), so a deployed plan's model
energy and swing are what runs.
"""

from __future__ import annotations

import dataclasses
import logging

from perseus_ext.actuation.filler import FillerPlayer
from perseus_ext.config import PerseusConfig
from perseus_ext.measurement.gpu.common import GPU
from perseus_ext.measurement.gpu.timeline import DeviceMarker, SwitchLatency
from perseus_ext.planning.frontier import Frontier
from perseus_ext.planning.schedule import PipelineSchedule
from perseus_ext.runtime.comm import ControlPlane
from perseus_ext.runtime.profile_store import ProfileStore
from perseus_ext.runtime.records import MeasuredProfile, SolveProblem, SolveResult, StageSolve
from perseus_ext.runtime.shipping import ship, shipped_bytes
from perseus_ext.runtime.solver_process import BackgroundSolve, solve

logger = logging.getLogger(__name__)


class PipelineSolve:
    """One rank's part of solving its pipeline's frontier (see the module docstring)."""

    def __init__(self, config: PerseusConfig, comm: ControlPlane, latency: SwitchLatency, store: ProfileStore,
                 schedule: PipelineSchedule, *, stage_constant: bool = False, gpu: GPU | None = None) -> None:
        """Loads the saved profile for `schedule` (a ConfigError when it does not fit the job).
        `stage_constant`: plan one clock per stage (whole-iteration mode); `gpu`: this rank's
        device, which draws a swing-capped plan's filler where it can."""
        self.stage_constant = stage_constant
        self.gpu = gpu
        self.filler: FillerPlayer | None = None  # the deployed capped plans' fillers (a swing cap)
        self.config = config
        self.comm = comm
        self.latency = latency
        self.store = store
        self.saved_profile = store.load(schedule)
        self.outcome: StageSolve | None = None  # this rank's view of the last result collected
        self._measured: MeasuredProfile | None = None  # the pipeline leader's, kept for re-plans
        self._solver: BackgroundSolve | None = None
        self._leader_result: SolveResult | None = None
        self._solved: dict[PipelineSchedule, SolveResult] = {}  # the leader's frontiers, per schedule

    def start(self, schedule: PipelineSchedule, measured: MeasuredProfile | None) -> None:
        """Every rank, as the solving phase starts; only the leader (with a profile) solves."""
        self._measured = measured
        if not self.comm.is_pipeline_leader:
            return
        if measured is None:
            self._leader_result = SolveResult(None, "no usable profile", 0.0, False)
            return
        try:
            # Changes within an iteration are issued so that the ramp starts as the previous
            # computation ends (ClockSequencer): what plans pay per change is about half the
            # ramp. A change must also save more than the stage draws idle during one ramp.
            ramp_s = self.latency.transition_s
            problem = SolveProblem(schedule, measured, self.config.solver, ramp_s / 2,
                                   switch_cost_j=ramp_s * measured.blocking_power_per_stage_w,
                                   stage_constant=self.stage_constant, power_floor=self._power_floor())
            if self.config.solve_in_background:
                self._solver = BackgroundSolve(problem)
            else:
                self._leader_result = solve(problem)
        except Exception as err:  # leader-only work: failing it must not skip a collective
            logger.exception("perseus-ext: pipeline %d: starting the solve failed", self.comm.pipeline)
            self._leader_result = SolveResult(None, f"starting the solve failed: {err!r}", 0.0, False)

    def collect(self) -> StageSolve | None:
        """Every rank, once per solving iteration: None until every leader has a result, then
        this rank's view of it (the leader scatters, logs and saves)."""
        leader = self.comm.is_pipeline_leader
        if leader and self._leader_result is None and self._solver is not None:
            try:
                self._leader_result = self._solver.result()
            except Exception as err:  # leader-only work: failing it must not skip a collective
                self._leader_result = SolveResult(None, f"reading the solver's result failed: {err!r}", 0.0, True)
        (all_ready,) = self.comm.all_min([float(self._leader_result is not None or not leader)])
        if not all_ready:
            return None
        shipments = ship(self._leader_result, self.comm.pipeline_members) if leader else None
        shipment: StageSolve = self.comm.scatter_pipeline(shipments)
        if leader:  # the leader keeps the whole frontier; the others get their own stage's clocks only
            shipment = dataclasses.replace(shipment, whole_frontier=self._leader_result.frontier)
            if shipment.frontier is not None:
                self._report(shipment.frontier, shipment, shipments)
        self.outcome = shipment
        self.filler = None if shipment.capped is None else FillerPlayer(
            self.gpu, shipment.capped, shipment.stage, self.comm.gpus_per_stage,
            speaks_for_pipeline="pipeline 0" if leader and self.comm.pipeline == 0 else None)
        return shipment

    def play_filler(self, plan: int | None, position: int, marker: DeviceMarker) -> None:
        """A deployed iteration at plan `plan`: computation `position` ends at `marker` (a device
        marker; position -1: the iteration starts there). The device draws the plan's filler of
        the wait that follows from there (nothing without a swing cap)."""
        if self.filler is None:
            return
        if position < 0:
            self.filler.iteration_started(plan, marker)
        else:
            self.filler.computation_launched(plan, position, marker)

    def _power_floor(self) -> bool:
        """Whether this (the leader's) device draws a stated filler power; the pipeline's devices
        are of one kind (a rank whose device cannot says so when it deploys)."""
        try:
            return self.gpu is not None and self.gpu.supports_power_floor()
        except Exception:  # a device that cannot answer: plan clock-only
            return False

    def _report(self, frontier: Frontier, shipment: StageSolve, shipments: dict[int, StageSolve]) -> None:
        how = "in a background process while training went on" if shipment.in_background else "inline"
        logger.info("perseus-ext: pipeline %d frontier: %d plans, solved in %.1f s %s; the fastest "
                    "plan saves %.1f%% energy at no slowdown (model); %.3f MB shipped per rank",
                    self.comm.pipeline, len(frontier.plans), shipment.solve_s, how,
                    100 * frontier.intrinsic_saving(), max(map(shipped_bytes, shipments.values())) / 1e6)
        capped = shipment.capped
        if capped is not None and self.comm.pipeline == 0:
            met = sum(capped.meets_cap(k) for k in range(len(capped.plans)))
            logger.info("perseus-ext: perseus.solver.power_swing_cap %g (%.0f W of the all-max-clock swing %.0f W): "
                        "%d of %d plans meet it, %s", capped.cap_fraction, capped.cap_w, capped.reference_swing_w,
                        met, len(capped.plans), "with fillers the devices draw while they wait" if capped.filler
                        else "clock-only (the devices cannot draw a stated filler power)")
        if self.comm.pipeline == 0 and self.config.frontier_path:
            try:
                frontier.save(self.config.frontier_path)
            except OSError as err:
                logger.error("perseus-ext: cannot save the frontier to %s: %s", self.config.frontier_path, err)

    def reschedule(self, old: PipelineSchedule, new: PipelineSchedule, *, deployed: bool, solving_again: bool) -> None:
        """A new schedule from the next iteration on: the frontier deployed for `old` is kept,
        any solve in flight is dropped and, when the pipeline plans (`solving_again`), the
        frontier for `new` is the one solved before, if any, else solved now."""
        if deployed and self._leader_result is not None:
            self._solved[old] = self._leader_result
        self.cancel()
        self._leader_result = None
        if not solving_again:
            return
        cached = self._solved.get(new)
        if cached is None:
            self.start(new, self._measured)
        else:
            self._leader_result = dataclasses.replace(cached, solve_s=0.0, in_background=False)

    def forget(self) -> None:
        """The profile is stale (`PerseusRuntime.reprofile`): drop it, every frontier and the
        saved profile; the new one is not saved (`profile_path` keeps describing the job as
        configured)."""
        self.cancel()
        self.filler = None
        self._leader_result = self._measured = self.saved_profile = None
        self._solved.clear()
        self.store.path = None

    def cancel(self) -> None:
        """Stop a solve in flight (its child process)."""
        if self._solver is not None:
            self._solver.cancel()
            self._solver = None
