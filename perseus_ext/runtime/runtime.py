"""The framework-agnostic Perseus lifecycle that adapters drive from their pipeline hooks.

warm-up (default clocks) -> profiling (candidate clocks, all stages in parallel, early stop)
-> solving (frontier solved off the training thread, training goes on at default clocks)
-> deployed (a frontier plan; straggler checks every N iterations move to slower plans and back).
With `policy.mode: "power_limit"` warm-up is followed by the power-limit phase instead.

Adapters call, on every rank: `iteration_start()`, `before_computation()` / `after_computation()`
around every forward and backward, optionally `mark_compute_end()` right before the gradient
all-reduce, and `iteration_end()`. The runtime is a phase machine over collaborators:
`RankSetup` (device, clocks, policy), `ClockSequencer` (clocks ordered by device markers),
`ComputationPacer` (simulated work, nothing on real GPUs), `RunRecorder` (device-side records),
`ProfilingRun`, `PlanDeployment` and `PowerLimitMode`. Deployed iterations never synchronise the
host with the device. Phase changes are decided from collective results only, so every rank
changes phase at the same iteration. Nothing raises into the training step: a failure logs its
traceback once and the rank falls back to default clocks while still taking part in the
collectives, so it cannot hang the others.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import secrets
from typing import TYPE_CHECKING, Any, Callable

from perseus_ext.actuation.controller import FrequencyController
from perseus_ext.actuation.exit_guard import forget_interrupt, on_interrupt
from perseus_ext.actuation.sequencer import ClockSequencer
from perseus_ext.actuation.silence import SilenceGuard, SilentEpisode
from perseus_ext.errors import PerseusError
from perseus_ext.planning.schedule import Computation, Kind, PipelineSchedule
from perseus_ext.policies.base import OperatingPointPolicy
from perseus_ext.runtime.baseline import BaselineProbes
from perseus_ext.runtime.capture import capture_probe
from perseus_ext.runtime.comm import ControlPlane, check_pipeline_rank
from perseus_ext.runtime.config import PerseusConfig
from perseus_ext.runtime.deployment import PlanDeployment, parse_announcement
from perseus_ext.runtime.emissions import EmissionsAccount
from perseus_ext.runtime.phase import Phase
from perseus_ext.runtime.power_limit_mode import PowerLimitMode
from perseus_ext.runtime.profile_store import ProfileStore
from perseus_ext.runtime.profiling import ProfilingRun
from perseus_ext.runtime.rank_setup import RankSetup, describe_gpu
from perseus_ext.runtime.recorder import RunRecorder
from perseus_ext.runtime.recurring import JobCoordinator
from perseus_ext.runtime.records import IterationSetting, MeasuredProfile, SolveOutcome, SolveProblem
from perseus_ext.runtime.shipping import StageFrontier, ship, shipped_bytes
from perseus_ext.runtime.solver_process import BackgroundSolve, solve
from perseus_ext.runtime.summary import (
    PolicySnapshot,
    PowerLimitSnapshot,
    RunSnapshot,
    SilenceReport,
    build_summary,
    gather_job_summary,
    log_summary,
    write_interrupted_summary,
)
from perseus_ext.measurement.gpu import GPU

if TYPE_CHECKING:
    from perseus_ext.measurement.gpu.zeusd import ZeusdReport

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 5.0
CAPTURE_REASON = ("a perseus-ext hook ran while a CUDA stream was capturing a CUDA graph: the graph's replays "
                  "run without hooks, so no planned clock can follow them (megatron-core's full-iteration "
                  "graph is supported through its replay, docs/megatron.md; per-layer graphs capture outside "
                  "the hooks)")
RECORD_WAIT_S = 5.0  # power-limit mode: longest wait for the previous iteration's device record


class PerseusRuntime:
    """One rank's Perseus lifecycle (see the module docstring for the hook protocol)."""

    def __init__(
        self,
        config: PerseusConfig,
        *,
        schedule: PipelineSchedule,
        stage: int,
        dp_group: Any = None,
        pp_group: Any = None,
        gpu: GPU | None = None,
        policy: OperatingPointPolicy | None = None,
        local_rank: int = 0,
        whole_iterations: bool = False,
    ) -> None:
        """whole_iterations: the adapter reports iterations only, each run as one unit the hooks
        cannot look into (a full-iteration CUDA graph replay): every iteration is one span on the
        device at one clock per stage, set before it and released after it, so plans are
        stage-constant (`planning/stage_constant.py`) and solved from a saved profile
        (`profile_path`), since computations cannot be profiled one by one."""
        if not 0 <= stage < schedule.num_stages:
            raise PerseusError(f"stage {stage} is outside the schedule's 0..{schedule.num_stages - 1}")
        check_pipeline_rank(pp_group, stage)
        if config.simulated_workload is not None:
            config.simulated_workload.check_stages(schedule.num_stages)
        self.config = config
        self.whole_iterations = whole_iterations
        self.local_rank = local_rank
        self.schedule = schedule
        self.stage = stage
        self.order: tuple[Computation, ...] = schedule.orders[stage]
        self.setup = RankSetup.prepare(config, gpu=gpu, policy=policy, local_rank=local_rank)
        self.gpu = self.setup.gpu
        self.policy = self.setup.policy
        self.controller = FrequencyController(self.gpu, dry_run=config.dry_run, strict=config.strict)
        if self.controller.dry_run:
            why = ("as configured" if config.dry_run else "no GPU could be opened" if self.gpu is None
                   else "no permission to set GPU clocks")
            logger.warning("perseus-ext: stage %d runs in DRY-RUN mode (%s): clock changes are "
                           "recorded, not applied", stage, why)
        self.comm = ControlPlane(stage=stage, dp_group=dp_group, timeout_s=config.control_timeout_s)
        self.job_id = self.comm.broadcast_job(secrets.token_hex(8))  # the same on every rank
        # a simulated device's wait for another rank is bounded like every collective
        self.timeline = self.setup.timeline(self.job_id, self.comm.rank, peer_timeout_s=config.control_timeout_s)
        self.pacer = self.setup.pacer(config, self.timeline, schedule, stage=stage,
                                      pipeline=self.comm.pipeline, num_pipelines=self.comm.num_pipelines)
        self.sequencer = ClockSequencer(self.controller, self.timeline,
                                        communication_clock=self.setup.communication_clock,
                                        latency=self.setup.latency)
        # Hooks that fall silent (a CUDA graph replay, an unhooked schedule) never leave a clock held.
        self.silence = SilenceGuard(lambda: self.controller.current_clock, self._hooks_fell_silent)
        self._capturing = capture_probe()
        self.captured_hooks = 0  # hooks that ran during a CUDA graph capture (and did nothing)
        self.store = ProfileStore(config.profile_path, gpus_per_stage=self.comm.gpus_per_stage,
                                  gpu_name=self.gpu.name if self.gpu is not None else None,
                                  blocking_power_per_gpu_w=config.blocking_power_w or config.saved_blocking_power_w)
        self.saved_profile = self.store.load(schedule)
        self.emissions = EmissionsAccount(self.policy)
        self.probes = BaselineProbes(config.baseline_fraction, config.straggler_check_interval)
        self.recorder = RunRecorder(self.controller, rank=self.comm.rank, pipeline=self.comm.pipeline,
                                    stage=stage, latency=self.setup.latency, log_path=config.log_path,
                                    log_interval=config.log_interval, job_id=self.job_id,
                                    on_record=self.emissions.on_record,
                                    saving=self.probes.estimate)
        # The job-wide exchange (batch-size run, early stop, shared signal); None when unused.
        self.job = JobCoordinator.create(config, self.comm, self.gpu, self.policy)
        self.phase = Phase.WARMUP if config.mode == "optimize" else Phase.OBSERVING
        self.iteration = 0
        self.fallback_reason: str | None = None
        self.control_plane_failed = False  # a lifecycle collective failed: this rank joins no more
        self.profiling: ProfilingRun | None = None
        self.deployment: PlanDeployment | None = None
        self.power_limit: PowerLimitMode | None = None
        self.solve_outcome: SolveOutcome | StageFrontier | None = None  # the leader's, or this rank's share
        self._phase_iterations = 0
        self._announced: tuple[str, float] | None = None
        self._solver: BackgroundSolve | None = None
        self._leader_outcome: SolveOutcome | None = None
        self._measured: MeasuredProfile | None = None  # the pipeline leader's, kept for re-plans
        self._solved: dict[PipelineSchedule, SolveOutcome] = {}  # the leader's frontiers, per schedule
        self._setting = IterationSetting(-1, self.phase)
        self._compute_ended = False
        self._closed = False
        self._summary: dict[str, Any] | None = None
        self._close_hooks: list[Callable[[], None]] = []
        self._interrupted: dict[str, Any] | None = None  # the signal that interrupted the run
        on_interrupt(self)  # SIGINT/SIGTERM: the summary is written after the clocks are restored
        # Lines every rank would repeat: rank 0's at INFO, the others' at DEBUG.
        logger.log(logging.INFO if self.comm.rank == 0 else logging.DEBUG,
                   "perseus-ext: stage %d/%d pipeline %d ready on %s (%s); %d candidate clocks; %d ranks",
                   stage, schedule.num_stages, self.comm.pipeline, describe_gpu(self.gpu),
                   "dry-run" if self.controller.dry_run else "live", len(self.setup.candidate_clocks),
                   self.comm.num_pipelines * schedule.num_stages)

    # ------------------------------------------------------------------ hooks
    def iteration_start(self) -> None:
        """Pick the iteration's clocks and queue them at the device's iteration start."""
        if self._closed:
            return
        self.silence.iteration_started()
        if self._capture_noticed():
            return
        try:
            self._compute_ended = False
            self._setting = self._current_setting()
            if self._profiling_now:
                self.profiling.start_iteration()
            planned = self._setting.plan is not None and not self.whole_iterations
            durations = self.deployment.stage_durations(self.stage) if planned else None
            start = self.sequencer.start_iteration(self.iteration, self._iteration_clocks(), durations)
            self.recorder.begin(self._setting, start)
            if self.whole_iterations:  # the whole iteration is the one span the stage's clock covers
                self.sequencer.computation_started()
        except Exception as err:  # never break the training step
            self.fall_back("iteration_start failed", err)

    def before_computation(self, kind: Kind | str, microbatch: int, chunk: int = 0) -> None:
        """The framework is about to launch this computation's work."""
        if self._closed:
            return
        self.silence.heartbeat()
        if self._capture_noticed():
            return
        try:
            computation = Computation(self.stage, chunk, microbatch, Kind(kind))
            position = self.sequencer.position
            if self.fallback_reason is None:
                expected = self.order[position] if position < len(self.order) else None
                if computation != expected:
                    self.fall_back(
                        f"the framework ran {computation} where the {self.schedule.kind.value} "
                        f"schedule expects {expected if expected else 'no more computations'} "
                        f"(position {position}); is the configured schedule the one running?")
            self.pacer.receive(self.iteration, computation)
            if self._profiling_now:
                self.profiling.before_computation()
            self.sequencer.computation_started()
            planned = self.sequencer.planned_clock() if self._setting.plan is not None else None
            self.pacer.compute(self.iteration, computation, planned)
        except Exception as err:
            self.fall_back("before_computation failed", err)

    def after_computation(self, kind: Kind | str, microbatch: int, chunk: int = 0) -> None:
        """The framework has launched this computation's work: queue what comes next."""
        if self._closed:
            return
        self.silence.heartbeat()
        if self._capture_noticed():
            return
        try:
            if self._profiling_now:
                self.profiling.after_computation(Kind(kind).value, self.sequencer.planned_clock())
            self.sequencer.computation_finished()
        except Exception as err:
            self.fall_back("after_computation failed", err)

    def mark_compute_end(self) -> None:
        """This stage's computations are launched; the data-parallel gradient sync follows,
        which straggler detection must not count."""
        if self._closed or self._compute_ended or self._capture_noticed():
            return
        self.silence.heartbeat()
        try:
            self._compute_ended = True
            self.recorder.compute_end(self.iteration, self.timeline.record_marker())
            self.pacer.gradient_sync(self.iteration)
        except Exception as err:
            self.fall_back("mark_compute_end failed", err)

    def iteration_end(self) -> None:
        """Record the iteration's end on the device and advance the lifecycle (collectives)."""
        if self._closed:
            return
        self.silence.heartbeat()
        try:
            if not self._capture_noticed():  # captured: nothing ran on the device, nothing to record
                self._record_end()
        except Exception as err:
            self.fall_back("iteration_end failed", err)
        try:
            self._advance()
        except Exception as err:
            # Most likely a control-plane collective timed out (a rank died or stalled): the
            # groups are unusable, so stop all lifecycle collectives on this rank.
            self.fall_back("lifecycle step failed", err)
            self.control_plane_failed = True
            self._set_phase(Phase.OBSERVING)
        self.iteration += 1
        if self.job is not None and self.job.on_iteration_end():
            # The run passed its cost limit: every rank stops at this boundary, clocks restored
            # and the run reported as stopped, then the documented exception reaches the script.
            self.close()
            raise self.job.early_stop()

    # ------------------------------------------------------------------ recurring-job API
    def report_metric(self, value: float) -> bool:
        """Hand over one evaluation result of `policy.batch_size.target_metric`; True once the
        target is reached (the run is then reported as reached)."""
        if self.job is None:
            raise PerseusError("report_metric needs perseus.policy.batch_size with a target_metric")
        return self.job.report_metric(value)

    @property
    def stop_requested(self) -> bool:
        """True once the run was stopped early by its cost limit (PerseusEarlyStop was raised)."""
        return self.job is not None and self.job.stop_requested

    # ------------------------------------------------------------------ cluster-manager API
    def announce_slowdown(self, factor_or_time: float | datetime.timedelta | None) -> None:
        """Announce the slowest pipeline's expected iteration time instead of waiting for it to
        be measured: a float is a factor of the normal (fastest pipeline's) iteration time, a
        timedelta an absolute iteration time, None withdraws the announcement. Takes effect at
        the next straggler check."""
        self._announced = parse_announcement(factor_or_time)

    def reschedule(self, schedule: PipelineSchedule) -> None:
        """Run `schedule` from the next iteration on (e.g. another number of microbatches).

        Every rank calls it at the same iteration boundary (between `iteration_end()` and
        `iteration_start()`). The measured profile stays: a computation's time and energy do
        not depend on how many microbatches the iteration holds. A pipeline that had a
        frontier (or was solving one) re-solves for the new schedule -- its leader re-uses the
        frontier it solved for that schedule before, if any -- and redeploys through the solving
        phase, so all ranks deploy together; warm-up, profiling and power-limit mode go on."""
        if self._closed or schedule == self.schedule:
            return
        if schedule.num_stages != self.schedule.num_stages:
            raise PerseusError(f"reschedule: the new schedule has {schedule.num_stages} stages, this "
                               f"pipeline {self.schedule.num_stages}; a new pipeline needs a new runtime")
        if self.deployment is not None and self._leader_outcome is not None:
            self._solved[self.schedule] = self._leader_outcome
        if self._solver is not None:
            self._solver.cancel()
            self._solver = None
        self._leader_outcome = None
        self.schedule = schedule
        self.order = schedule.orders[self.stage]
        self.pacer = self.setup.pacer(self.config, self.timeline, schedule, stage=self.stage,
                                      pipeline=self.comm.pipeline, num_pipelines=self.comm.num_pipelines)
        logger.info("perseus-ext: stage %d runs %s from iteration %d on", self.stage,
                    schedule.describe(), self.iteration)
        if self.phase not in (Phase.SOLVING, Phase.DEPLOYED):
            return
        cached = self._solved.get(schedule)
        if cached is None:
            self._start_solve(self._measured)
            return
        self._set_phase(Phase.SOLVING)
        self._leader_outcome = dataclasses.replace(cached, solve_s=0.0, in_background=False)

    def reprofile(self, reason: str) -> None:
        """Measure the profile again from the next iteration on: each computation's work changed
        (e.g. DeepSpeed's `set_train_micro_batch_size()`), so the profile and every frontier
        solved from it are stale. Every rank calls it at the same iteration boundary. A pipeline
        that was profiling, solving or deployed warms up again at default clocks, then profiles,
        solves and deploys as at the start; the new profile is not written to `profile_path`,
        which keeps describing the job as configured. Warm-up, observe and power-limit mode go on."""
        if self._closed or self.phase not in (Phase.PROFILING, Phase.SOLVING, Phase.DEPLOYED):
            return
        if self._solver is not None:
            self._solver.cancel()
            self._solver = None
        self._leader_outcome = self._measured = self.saved_profile = None
        self._solved.clear()
        self.store.path = None
        self.deployment = None
        logger.info("perseus-ext: stage %d profiles again from iteration %d on (%s)", self.stage,
                    self.iteration, reason)
        self._set_phase(Phase.WARMUP)

    # ------------------------------------------------------------------ state
    @property
    def _profiling_now(self) -> bool:
        return (self.phase is Phase.PROFILING and self.fallback_reason is None
                and self.profiling is not None and not self.profiling.profiler.done)

    @property
    def plan(self):
        return self.deployment.plan if self.deployment is not None else None

    @property
    def frontier(self):
        return self.deployment.frontier if self.deployment is not None else None

    @property
    def history(self):
        return self.recorder.history

    @property
    def profiling_iterations(self) -> int:
        return self.profiling.iterations if self.profiling is not None else 0

    @property
    def candidate_clocks(self) -> list[int]:
        return self.setup.candidate_clocks

    def _current_setting(self) -> IterationSetting:
        fell_back = self.fallback_reason is not None
        if self.phase is Phase.DEPLOYED and self.deployment is not None:
            probe = not fell_back and self._baseline_probe()
            return IterationSetting(self.iteration, self.phase,
                                    plan=None if fell_back or probe else self.deployment.index,
                                    factor=self.deployment.factor, fell_back=fell_back, probe=probe)
        if self._profiling_now:
            return IterationSetting(self.iteration, self.phase, profiled_clock_mhz=self.profiling.profiler.current_clock)
        if self.power_limit is not None:
            return IterationSetting(self.iteration, self.phase, power_limit_w=self.power_limit.limit_w, fell_back=fell_back)
        return IterationSetting(self.iteration, self.phase, fell_back=fell_back)

    def _baseline_probe(self) -> bool:
        """Whether this deployed iteration runs default clocks as a baseline probe: decided from
        the deployed-iteration count and the pipeline's last plan switch, the same on every rank;
        a probe's setting has no plan, so it runs (and is recorded) at default clocks."""
        switches = self.deployment.switches
        since_switch = self.iteration - switches[-1].iteration - 1 if switches else None
        return self.probes.is_probe(self._phase_iterations, since_switch)

    def _iteration_clocks(self) -> tuple[int, ...] | None:
        setting = self._setting
        if setting.plan is not None:
            clocks = self.deployment.stage_clocks(self.stage)
            if self.whole_iterations:  # a stage-constant plan: its one clock for the whole iteration
                if len(set(clocks)) != 1:
                    raise PerseusError(f"whole-iteration mode deploys stage-constant plans; stage "
                                       f"{self.stage} was given {sorted(set(clocks))} MHz")
                return tuple(clocks[:1])
            return clocks
        if setting.profiled_clock_mhz is not None:
            return (setting.profiled_clock_mhz,) * len(self.order)
        return None

    # ------------------------------------------------------------------ phase machine
    def _advance(self) -> None:
        self._phase_iterations += 1
        records = self.recorder.collect()
        self.probes.observe(records)
        payback = self.probes.payback_once()
        if payback is not None:  # once per job: rank 0 says it, the others' go to DEBUG
            logger.log(logging.INFO if self.comm.rank == 0 else logging.DEBUG, "perseus-ext: rank %d: %s",
                       self.comm.rank, payback)
        if self.phase is Phase.WARMUP and self._phase_iterations >= self.config.warmup_iterations:
            self._end_warmup()
        elif self.phase is Phase.PROFILING:
            self._profiling_step()
        elif self.phase is Phase.SOLVING:
            self._solving_step()
        elif self.phase is Phase.DEPLOYED:
            self.deployment.on_iteration(self.iteration, records, self._announced)
        elif self.phase is Phase.POWER_LIMIT:
            if self._phase_iterations > 1:  # fed one iteration late: its device record is in by now
                self.power_limit.step(self.iteration, self.recorder.wait_for(self.iteration - 1, RECORD_WAIT_S))

    def _end_warmup(self) -> None:
        if self.setup.power_limit_mode:
            self.power_limit = PowerLimitMode.start(
                self.gpu, self.controller, self.setup.policy_config, self.comm,
                can_take_part=not self.controller.dry_run and self.fallback_reason is None,
                settle=lambda: self.controller.flush(FLUSH_TIMEOUT_S))
            self.emissions.power_limit = self.power_limit
            self._set_phase(Phase.POWER_LIMIT if self.power_limit is not None else Phase.OBSERVING)
            return
        have_profile, can_set_clocks, none_fell_back = self.comm.all_min([
            float(self.saved_profile is not None),
            float(not self.controller.dry_run and bool(self.setup.candidate_clocks)),
            float(self.fallback_reason is None),
        ])
        if have_profile:
            logger.info("perseus-ext: using saved profile %s; skipping profiling", self.config.profile_path)
            self._start_solve(self.saved_profile if self.comm.is_pipeline_leader else None)
        elif self.whole_iterations:
            logger.warning("perseus-ext: each iteration runs as one full-iteration CUDA graph replay, whose "
                           "computations cannot be profiled one by one, and there is no saved profile "
                           "(perseus.profile_path): staying at default clocks. Run the job once without the "
                           "full-iteration graph with profile_path set (it saves the profile there), then "
                           "again with it")
            self._set_phase(Phase.OBSERVING)
        elif can_set_clocks and none_fell_back:
            self.profiling = ProfilingRun.create(self.config, self.stage, self.setup, self.controller,
                                                 self.timeline, self.schedule)
            self._set_phase(Phase.PROFILING)
        else:
            why = ("a rank fell back to default clocks during warm-up (its error says why)" if not none_fell_back
                   else "some rank cannot set GPU clocks")
            logger.warning("perseus-ext: %s and there is no saved profile (%s.profile_path): nothing to "
                           "profile, staying at default clocks", why, "perseus")
            self._set_phase(Phase.OBSERVING)

    def _profiling_step(self) -> None:
        run = self.profiling
        run.end_iteration(self.fallback_reason)
        (all_done,) = self.comm.all_min([float(run.profiler.done)])
        if not all_done:
            return
        measurements = run.measurements(self.fallback_reason is not None)
        (iterations,) = self.comm.all_max([run.iterations])
        # One line per stage (pipeline 0's ranks); the other pipelines' at DEBUG.
        logger.log(logging.INFO if self.comm.pipeline == 0 else logging.DEBUG,
                   "perseus-ext: profiling finished after %d iteration(s) (stage %d: %s; framework "
                   "overhead %.2f ms per computation)", int(iterations), self.stage,
                   run.profiler.stop_reason, 1000 * run.overhead_s)
        gathered = self.comm.gather_pipeline(measurements)
        measured = None
        if self.comm.is_pipeline_leader:
            try:
                measured = run.assemble(gathered, pipeline=self.comm.pipeline,
                                        blocking_override_w=self.config.blocking_power_w,
                                        gpu_name=describe_gpu(self.gpu))
                if measured is not None and self.comm.pipeline == 0:
                    self.store.save(measured, self.schedule)
            except Exception as err:  # leader-only work: failing it must not skip a collective
                logger.exception("perseus-ext: pipeline %d: assembling the profile failed: %r",
                                 self.comm.pipeline, err)
        self._start_solve(measured)

    def _start_solve(self, measured: MeasuredProfile | None) -> None:
        self._measured = measured
        self._set_phase(Phase.SOLVING)
        if not self.comm.is_pipeline_leader:
            return
        if measured is None:
            self._leader_outcome = SolveOutcome(None, "no usable profile", 0.0, False)
            return
        try:
            # Changes within an iteration are issued so that the ramp starts as the previous
            # computation ends (ClockSequencer): what plans pay per change is about half the
            # ramp. A change must also save more than the stage draws idle during one ramp.
            ramp_s = self.setup.latency.transition_s
            problem = SolveProblem(self.schedule, measured, self.config.solver, ramp_s / 2,
                                   switch_cost_j=ramp_s * measured.blocking_power_per_stage_w,
                                   stage_constant=self.whole_iterations)
            if self.config.solve_in_background:
                self._solver = BackgroundSolve(problem)
            else:
                self._leader_outcome = solve(problem)
        except Exception as err:  # leader-only work: failing it must not skip a collective
            logger.exception("perseus-ext: pipeline %d: starting the solve failed", self.comm.pipeline)
            self._leader_outcome = SolveOutcome(None, f"starting the solve failed: {err!r}", 0.0, False)

    def _solving_step(self) -> None:
        leader = self.comm.is_pipeline_leader
        if leader and self._leader_outcome is None and self._solver is not None:
            try:
                self._leader_outcome = self._solver.result()
            except Exception as err:  # leader-only work: failing it must not skip a collective
                self._leader_outcome = SolveOutcome(None, f"reading the solver's result failed: {err!r}", 0.0, True)
        (all_ready,) = self.comm.all_min([float(self._leader_outcome is not None or not leader)])
        if not all_ready:
            return
        shipments = ship(self._leader_outcome, self.comm.pipeline_members) if leader else None
        shipment: StageFrontier = self.comm.scatter_pipeline(shipments)
        self.solve_outcome = self._leader_outcome if leader else shipment
        if shipment.compact is None:
            logger.warning("perseus-ext: pipeline %d has no frontier (%s); staying at default clocks",
                           self.comm.pipeline, shipment.error)
            self._set_phase(Phase.OBSERVING)
            return
        # The leader keeps the whole frontier; the others get their own stage's clocks only.
        frontier = self._leader_outcome.frontier if leader else shipment.frontier()
        if leader:
            how = "in a background process while training went on" if shipment.in_background else "inline"
            logger.info("perseus-ext: pipeline %d frontier: %d plans, solved in %.1f s %s; the fastest "
                        "plan saves %.1f%% energy at no slowdown (model); %.3f MB shipped per rank",
                        self.comm.pipeline, len(frontier.plans), shipment.solve_s, how,
                        100 * frontier.intrinsic_saving(), max(map(shipped_bytes, shipments.values())) / 1e6)
            if self.comm.pipeline == 0 and self.config.frontier_path:
                try:
                    frontier.save(self.config.frontier_path)
                except OSError as err:
                    logger.error("perseus-ext: cannot save the frontier to %s: %s", self.config.frontier_path, err)
        self.deployment = PlanDeployment(frontier, self.policy, self.config, self.comm, self.schedule,
                                         shipment.measured, None if leader else shipment.stage_clocks())
        self.deployment.deploy(self.iteration)
        self._set_phase(Phase.DEPLOYED)

    def _set_phase(self, phase: Phase) -> None:
        self.phase = phase
        self._phase_iterations = 0

    def _record_end(self) -> None:
        """The iteration's end marker and the checks that it ran as planned."""
        if self.whole_iterations:
            self._whole_iteration_ran()
        self.mark_compute_end()
        self.recorder.end(self.iteration, self.timeline.record_marker(), self.sequencer.trace)
        disabled = self.controller.disabled_reason
        if self.fallback_reason is None and disabled is not None:
            self.fall_back(f"GPU clock control failed ({disabled})")
        spans = 1 if self.whole_iterations else len(self.order)
        if self.fallback_reason is None and self.sequencer.position != spans:
            self.fall_back(f"the iteration ran {self.sequencer.position} computations on stage "
                           f"{self.stage}, the schedule has {spans}")

    def _whole_iteration_ran(self) -> None:
        """The iteration (a graph replay) has been launched: its work is on the device (a
        simulated device gets it from the pacer now, computation by computation, with its
        pipeline dependencies); the stage's clock is released after it."""
        planned = self.sequencer.planned_clock()
        for computation in self.order:
            self.pacer.receive(self.iteration, computation)
            self.pacer.compute(self.iteration, computation, planned)
        self.sequencer.computation_finished()

    # ------------------------------------------------------------------ hooks that cannot steer
    def _capture_noticed(self) -> bool:
        """True while a CUDA graph is being captured: the hook then does nothing on the device
        (a marker recorded now would belong to the graph). The first one falls back."""
        if not self._capturing():
            return False
        self.captured_hooks += 1
        self.fall_back(CAPTURE_REASON)
        return True

    def _hooks_fell_silent(self, episode: SilentEpisode) -> None:
        """The silence guard's thread: a clock was held with no hook for longer than its bound."""
        self.controller.release_silent()

    # ------------------------------------------------------------------ fallback and end
    def fall_back(self, reason: str, error: BaseException | None = None) -> None:
        """Stop steering clocks (and the power limit) on this rank for good; it still joins
        every collective, so the other ranks carry on. Adapters call it when they cannot tell
        which computation the framework runs. Logs once (with the traceback of `error`);
        never raises."""
        if self.fallback_reason is not None:
            return
        self.fallback_reason = reason if error is None else f"{reason}: {error!r}"
        logger.error("perseus-ext: rank %d stage %d: %s; this rank runs at default clocks from now on",
                     self.comm.rank, self.stage, self.fallback_reason, exc_info=error)
        try:
            self.sequencer.release()
            if self.power_limit is not None:
                self.power_limit.limits.release()
        except Exception:  # the controller never raises, but a fallback must not either
            logger.debug("perseus-ext: releasing clocks during fallback failed", exc_info=True)

    def interrupted(self, signal_name: str, clocks_restored: bool) -> None:
        """SIGINT/SIGTERM (the exit guard restored the clocks first): write this rank's summary
        now and say that the run was interrupted and whether the clocks were restored. No
        collective: the other ranks are being stopped too. Never raises."""
        if self._closed or self._interrupted is not None:
            return
        self._interrupted = {"signal": signal_name, "at_iteration": self.iteration, "phase": self.phase.value,
                             "clocks_restored": clocks_restored}
        self._summary = write_interrupted_summary(self.snapshot, self._interrupted, self.config.summary_path)

    def summary(self) -> dict[str, Any]:
        """Per-rank results: measured default-clock vs deployed iterations, the frontier's model
        figures, profiling cost, clock coverage and plan switches."""
        if self._summary is not None:
            return self._summary
        return build_summary(self.snapshot())

    def snapshot(self) -> RunSnapshot:
        """This rank's run as the summary reads it (typed, detached from the collaborators)."""
        profiling, deployment, mode = self.profiling, self.deployment, self.power_limit
        config = self.setup.policy_config
        power_limit = None if mode is None else PowerLimitSnapshot(
            limit_w=None if mode.optimizer.profiling else mode.optimizer.limit_w,
            profiling=mode.optimizer.profiling,
            measurements=tuple(dataclasses.asdict(m) for m in mode.optimizer.measurements),
            switches=tuple(mode.switches), chosen_at=mode.chosen_at)
        policy = PolicySnapshot(
            mode=str(config.mode) if config else "frontier",
            type=str(config.type) if config else (self.policy.name if self.policy else None),
            eta=config.eta if config is not None and config.type != "perseus" else None,
            power_limit_mode=self.setup.power_limit_mode, power_limit=power_limit,
            carbon=getattr(self.emissions.ledger, "report", None))
        return RunSnapshot(
            rank=self.comm.rank, pipeline=self.comm.pipeline, stage=self.stage,
            gpu_name=self.gpu.name if self.gpu is not None else None, mode=str(self.config.mode),
            dry_run=self.controller.dry_run, fallback_reason=self.fallback_reason, phase=self.phase,
            history=tuple(self.recorder.history), baseline_fraction=self.config.baseline_fraction,
            profiling_iterations=profiling.iterations if profiling else 0,
            profiled_clocks=tuple(profiling.profiler.profiled_clocks) if profiling else (),
            profile_overhead_s=profiling.overhead_s if profiling else 0.0,
            exact_coverage=self.timeline.exact_coverage(), switch_latency_s=self.setup.latency.effective_s,
            plan_switches=tuple(deployment.switches) if deployment else (),
            controller_errors=self.controller.error_count,
            set_call_s=tuple(self.controller.set_call_s), assumed_call_s=self.controller.dry_run_call_s,
            silent_hooks=SilenceReport(self.silence.bound_s, self.silence.expected_iteration_s,
                                       tuple(self.silence.episodes), self.captured_hooks),
            frontier=deployment.frontier if deployment else None, policy=policy, zeusd=self._zeusd_report())

    def _zeusd_report(self) -> ZeusdReport | None:
        from perseus_ext.measurement.gpu.zeusd import ZeusdGPU  # here: httpx only where zeusd is used

        return self.gpu.report() if isinstance(self.gpu, ZeusdGPU) else None

    def on_close(self, hook: Callable[[], None]) -> None:
        """Run `hook` at close, after the last device records and the summary (metrics writers
        flush their last iterations there)."""
        self._close_hooks.append(hook)

    def close(self) -> None:
        """Restore default clocks and report; idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        forget_interrupt(self)
        if self._solver is not None:
            self._solver.cancel()
        self.silence.close()
        try:
            self.recorder.close(FLUSH_TIMEOUT_S)
        except Exception:
            logger.exception("perseus-ext: recording the last iterations failed")
        try:
            if self.policy is not None:
                self.policy.close()
            if self.power_limit is not None:
                self.power_limit.close()
        except Exception:
            logger.exception("perseus-ext: closing the policy failed")
        try:
            self.controller.close()
        except Exception:
            logger.exception("perseus-ext: restoring clocks failed")
        try:
            self.timeline.close()
        except Exception:
            logger.exception("perseus-ext: closing the device timeline failed")
        try:
            run = self.snapshot()
            self._summary = build_summary(run)
            if self._interrupted is not None:  # closed by the application after the signal
                self._summary["interrupted"] = self._interrupted
            # Every rank: the job's figures (bounded wait for the others), logged by rank 0. A
            # rank whose control plane failed earlier skips the reductions.
            if self.control_plane_failed:
                self._summary["job"], job_error = None, "this rank's control plane failed earlier (its error says why)"
            else:
                self._summary["job"], job_error = gather_job_summary(
                    self.comm, run, self._summary, job_id=self.job_id,
                    control_timeout_s=self.config.control_timeout_s)
            log_summary(self._summary, self.config.summary_path, job_error)
        except Exception:
            logger.exception("perseus-ext: writing the summary failed")
        for hook in self._close_hooks:
            try:
                hook()
            except Exception:
                logger.exception("perseus-ext: a close hook failed")
        if self.job is not None:
            self.job.close()  # reports the batch-size run (rank 0); never raises
        if not self.control_plane_failed:  # a failed group may still hold a collective
            self.comm.close()  # the last collective was the job summary's

