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
`ProfilingRun`, `PipelineSolve` (the frontier, solved and shipped), `PlanDeployment` and
`PowerLimitMode`; the summary is built from a typed `RunSnapshot`. Deployed iterations never synchronise the
host with the device. Phase changes are decided from collective results only, so every rank
changes phase at the same iteration. Nothing raises into the training step: a failure logs its
traceback once and the rank falls back to default clocks while still taking part in the
collectives, so it cannot hang the others.
"""

from __future__ import annotations

import datetime
import functools
import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from perseus_ext.actuation.exit_guard import forget_interrupt, on_interrupt
from perseus_ext.actuation.sequencer import ClockSequencer
from perseus_ext.errors import PerseusError
from perseus_ext.planning.schedule import Computation, Kind, PipelineSchedule
from perseus_ext.policies.base import OperatingPointPolicy
from perseus_ext.runtime.baseline import BaselineProbes
from perseus_ext.runtime.comm import ControlPlane, check_pipeline_rank
from perseus_ext.runtime.config import PerseusConfig
from perseus_ext.runtime.deployment import PlanDeployment, SlowdownAnnouncement, parse_announcement
from perseus_ext.runtime.emissions import EmissionsAccount
from perseus_ext.runtime.hook_watch import HookWatch
from perseus_ext.runtime.phase import Phase
from perseus_ext.runtime.power_limit_mode import PowerLimitMode
from perseus_ext.runtime.profile_store import ProfileStore
from perseus_ext.runtime.profiling import ProfilingRun
from perseus_ext.runtime.rank_setup import RankSetup, describe_gpu
from perseus_ext.runtime.recorder import RunRecorder
from perseus_ext.runtime.run_report import RunReport
from perseus_ext.runtime.recurring import JobCoordinator, PreparedRun
from perseus_ext.runtime.pipeline_solve import PipelineSolve
from perseus_ext.runtime.records import IterationSetting, MeasuredProfile
from perseus_ext.runtime.summary import RunSnapshot, policy_snapshot
from perseus_ext.measurement.gpu import GPU

if TYPE_CHECKING:
    from perseus_ext.measurement.gpu.zeusd import ZeusdReport

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 5.0
RECORD_WAIT_S = 5.0  # power-limit mode: longest wait for the previous iteration's device record


def _hook(method: Callable[..., None]) -> Callable[..., None]:
    """A training-thread hook: does nothing after `close()` or while a CUDA graph is captured
    (the silence guard hears it either way), and a failure makes this rank fall back to default
    clocks (`fall_back`, traceback logged once) instead of breaking the step."""
    starts_iteration = method.__name__ == "iteration_start"

    @functools.wraps(method)
    def hook(self: PerseusRuntime, *args: Any, **kwargs: Any) -> None:
        if self._closed:
            return
        if self.hooks.entered(starts_iteration=starts_iteration):
            return
        try:
            method(self, *args, **kwargs)
        except Exception as err:  # never break the training step
            self.fall_back(f"{method.__name__} failed", err)
    return hook


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
        prepared_run: PreparedRun | None = None,
    ) -> None:
        """whole_iterations: the adapter reports iterations only, each run as one unit the hooks
        cannot look into (a full-iteration CUDA graph replay): every iteration is one span on the
        device at one clock per stage, set before it and released after it, so plans are
        stage-constant (`planning/stage_constant.py`) and solved from a saved profile
        (`profile_path`), since computations cannot be profiled one by one. `prepared_run`: this
        run's batch size from the store (`choose_batch_size`, called by the adapter before the
        engine was built); required with `policy.batch_size`."""
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
        self.controller = self.setup.controller(config, stage)
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
        # Hooks that fall silent never leave a clock held; hooks during a CUDA graph capture do nothing.
        self.hooks = HookWatch(lambda: self.controller.current_clock, lambda episode: self.controller.release_silent(),
                               self.fall_back)
        self.solve = PipelineSolve(config, self.comm, self.setup.latency,
                                   ProfileStore.for_job(config, self.comm.gpus_per_stage, self.gpu), schedule,
                                   stage_constant=whole_iterations)
        self.emissions = EmissionsAccount(self.policy)
        self.probes = BaselineProbes(config.baseline_fraction, config.straggler_check_interval)
        self.recorder = RunRecorder(self.controller, rank=self.comm.rank, pipeline=self.comm.pipeline,
                                    stage=stage, latency=self.setup.latency, log_path=config.log_path,
                                    log_interval=config.log_interval, job_id=self.job_id,
                                    on_record=self.emissions.on_record,
                                    saving=self.probes.estimate)
        # The job-wide exchange (batch-size run, early stop, shared signal); None when unused.
        self.job = JobCoordinator.create(config, self.comm, self.gpu, self.policy, prepared_run)
        self.phase = Phase.WARMUP if config.mode == "optimize" else Phase.OBSERVING
        self.iteration = 0
        self.fallback_reason: str | None = None
        self.control_plane_failed = False  # a lifecycle collective failed: this rank joins no more
        self.profiling: ProfilingRun | None = None
        self.deployment: PlanDeployment | None = None
        self.power_limit: PowerLimitMode | None = None
        self._phase_iterations = 0
        self._announced: SlowdownAnnouncement | None = None
        self._setting = IterationSetting(-1, self.phase)
        self._compute_ended = False
        self._closed = False
        self.report = RunReport(self.snapshot, config.summary_path)
        on_interrupt(self)  # SIGINT/SIGTERM: the summary is written after the clocks are restored
        # Lines every rank would repeat: rank 0's at INFO, the others' at DEBUG.
        logger.log(logging.INFO if self.comm.rank == 0 else logging.DEBUG,
                   "perseus-ext: stage %d/%d pipeline %d ready on %s (%s); %d candidate clocks; %d ranks",
                   stage, schedule.num_stages, self.comm.pipeline, describe_gpu(self.gpu),
                   "dry-run" if self.controller.dry_run else "live", len(self.setup.candidate_clocks),
                   self.comm.num_pipelines * schedule.num_stages)

    # ------------------------------------------------------------------ hooks
    @_hook
    def iteration_start(self) -> None:
        """Pick the iteration's clocks and queue them at the device's iteration start."""
        self._compute_ended = False
        setting = self._setting = self._current_setting()
        if self._profiling_now:
            self.profiling.start_iteration()
        clocks = durations = None
        if setting.plan is not None:
            clocks = self.deployment.stage_clocks(self.stage)
            if not self.whole_iterations:
                durations = self.deployment.stage_durations(self.stage)
            elif len(set(clocks)) != 1:  # a stage-constant plan: its one clock for the whole iteration
                raise PerseusError(f"whole-iteration mode deploys stage-constant plans; stage "
                                   f"{self.stage} was given {sorted(set(clocks))} MHz")
            else:
                clocks = tuple(clocks[:1])
        elif setting.profiled_clock_mhz is not None:
            clocks = (setting.profiled_clock_mhz,) * len(self.order)
        start = self.sequencer.start_iteration(self.iteration, clocks, durations)
        self.recorder.begin(setting, start)
        if self.whole_iterations:  # the whole iteration is the one span the stage's clock covers
            self.sequencer.computation_started()

    @_hook
    def before_computation(self, kind: Kind | str, microbatch: int, chunk: int = 0) -> None:
        """The framework is about to launch this computation's work."""
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

    @_hook
    def after_computation(self, kind: Kind | str, microbatch: int, chunk: int = 0) -> None:
        """The framework has launched this computation's work: queue what comes next."""
        if self._profiling_now:
            self.profiling.after_computation(Kind(kind).value, self.sequencer.planned_clock())
        self.sequencer.computation_finished()

    @_hook
    def mark_compute_end(self) -> None:
        """This stage's computations are launched; the data-parallel gradient sync follows,
        which straggler detection must not count."""
        if self._compute_ended:
            return
        self._compute_ended = True
        self.recorder.compute_end(self.iteration, self.timeline.record_marker())
        self.pacer.gradient_sync(self.iteration)

    def iteration_end(self) -> None:
        """Record the iteration's end on the device and advance the lifecycle (collectives)."""
        if self._closed:
            return
        self.hooks.silence.heartbeat()
        try:
            if not self.hooks.capture_noticed():  # captured: nothing ran on the device, nothing to record
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

    # ------------------------------------------------------------------ script and cluster-manager API
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
        solving_again = self.phase in (Phase.SOLVING, Phase.DEPLOYED)
        self.solve.reschedule(self.schedule, schedule, deployed=self.deployment is not None, solving_again=solving_again)
        self.schedule = schedule
        self.order = schedule.orders[self.stage]
        self.pacer = self.setup.pacer(self.config, self.timeline, schedule, stage=self.stage,
                                      pipeline=self.comm.pipeline, num_pipelines=self.comm.num_pipelines)
        logger.info("perseus-ext: stage %d runs %s from iteration %d on", self.stage,
                    schedule.describe(), self.iteration)
        if solving_again:
            self._set_phase(Phase.SOLVING)

    def reprofile(self, reason: str) -> None:
        """Measure the profile again from the next iteration on: each computation's work changed
        (e.g. DeepSpeed's `set_train_micro_batch_size()`), so the profile and every frontier
        solved from it are stale. Every rank calls it at the same iteration boundary. A pipeline
        that was profiling, solving or deployed warms up again at default clocks, then profiles,
        solves and deploys as at the start; the new profile is not written to `profile_path`,
        which keeps describing the job as configured. Warm-up, observe and power-limit mode go on."""
        if self._closed or self.phase not in (Phase.PROFILING, Phase.SOLVING, Phase.DEPLOYED):
            return
        self.solve.forget()
        self.deployment = None
        logger.info("perseus-ext: stage %d profiles again from iteration %d on (%s)", self.stage,
                    self.iteration, reason)
        self._set_phase(Phase.WARMUP)

    # ------------------------------------------------------------------ state
    @property
    def _profiling_now(self) -> bool:
        return (self.phase is Phase.PROFILING and self.fallback_reason is None
                and self.profiling is not None and not self.profiling.profiler.done)

    # Read-only views of the collaborators, for adapters, tests and monitoring.
    plan = property(lambda self: self.deployment.plan if self.deployment is not None else None)
    frontier = property(lambda self: self.deployment.frontier if self.deployment is not None else None)
    history = property(lambda self: self.recorder.history)
    saved_profile = property(lambda self: self.solve.saved_profile, doc="The profile saved beside the job, if any.")
    solve_outcome = property(lambda self: self.solve.outcome,
                             doc="The pipeline leader's solve outcome, or this rank's share of it (None before).")
    silence = property(lambda self: self.hooks.silence)
    captured_hooks = property(lambda self: self.hooks.captured_hooks)
    profiling_iterations = property(lambda self: self.profiling.iterations if self.profiling is not None else 0)
    candidate_clocks = property(lambda self: self.setup.candidate_clocks)

    def _current_setting(self) -> IterationSetting:
        fell_back = self.fallback_reason is not None
        if self.phase is Phase.DEPLOYED and self.deployment is not None:
            return self.deployment.iteration_setting(self.iteration, self._phase_iterations, self.probes, fell_back)
        if self._profiling_now:
            return IterationSetting(self.iteration, self.phase, profiled_clock_mhz=self.profiling.profiler.current_clock)
        if self.power_limit is not None:
            return IterationSetting(self.iteration, self.phase, power_limit_w=self.power_limit.limit_w, fell_back=fell_back)
        return IterationSetting(self.iteration, self.phase, fell_back=fell_back)

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
            float(self.solve.saved_profile is not None),
            float(not self.controller.dry_run and bool(self.setup.candidate_clocks)),
            float(self.fallback_reason is None),
        ])
        if have_profile:
            logger.info("perseus-ext: using saved profile %s; skipping profiling", self.config.profile_path)
            self._start_solve(self.solve.saved_profile if self.comm.is_pipeline_leader else None)
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
        done, measured = self.profiling.finish_iteration(
            self.comm, self.fallback_reason, blocking_override_w=self.config.blocking_power_w,
            gpu_name=describe_gpu(self.gpu), save=lambda profile: self.solve.store.save(profile, self.schedule))
        if done:
            self._start_solve(measured)

    def _start_solve(self, measured: MeasuredProfile | None) -> None:
        self._set_phase(Phase.SOLVING)
        self.solve.start(self.schedule, measured)

    def _solving_step(self) -> None:
        shipped = self.solve.collect()
        if shipped is None:
            return
        if shipped.frontier is None:
            logger.warning("perseus-ext: pipeline %d has no frontier (%s); staying at default clocks",
                           self.comm.pipeline, shipped.error)
            self._set_phase(Phase.OBSERVING)
            return
        self.deployment = PlanDeployment(shipped.frontier, self.policy, self.config, self.comm, self.schedule,
                                         shipped.measured, shipped.stage_table)
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
        if not self._closed:
            self.report.interrupt(signal_name, self.iteration, self.phase.value, clocks_restored)

    def summary(self) -> dict[str, Any]:
        """Per-rank results: measured default-clock vs deployed iterations, the frontier's model
        figures, profiling cost, clock coverage and plan switches."""
        return self.report.summary()

    def snapshot(self) -> RunSnapshot:
        """This rank's run as the summary reads it (typed, detached from the collaborators)."""
        profiling, deployment = self.profiling, self.deployment
        power_limit = self.power_limit.snapshot() if self.power_limit is not None else None
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
            silent_hooks=self.hooks.report(),
            frontier=deployment.frontier if deployment else None, zeusd=self._zeusd_report(),
            policy=policy_snapshot(self.setup, power_limit, getattr(self.emissions.ledger, "report", None)))

    def _zeusd_report(self) -> ZeusdReport | None:
        from perseus_ext.measurement.gpu.zeusd import ZeusdGPU  # here: httpx only where zeusd is used

        return self.gpu.report() if isinstance(self.gpu, ZeusdGPU) else None

    def on_close(self, hook: Callable[[], None]) -> None:
        """Run `hook` at close, after the last device records and the summary (metrics writers
        flush their last iterations there)."""
        self.report.on_close(hook)

    def _close_policy(self) -> None:
        if self.policy is not None:
            self.policy.close()
        if self.power_limit is not None:
            self.power_limit.close()

    def _close_summary(self) -> None:
        self.report.write_at_close(self.comm, job_id=self.job_id, control_timeout_s=self.config.control_timeout_s,
                                   control_plane_failed=self.control_plane_failed)

    def close(self) -> None:
        """Restore default clocks and report; idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        forget_interrupt(self)
        self.solve.cancel()
        self.hooks.close()
        for what, step in (("recording the last iterations", lambda: self.recorder.close(FLUSH_TIMEOUT_S)),
                           ("closing the policy", self._close_policy), ("restoring clocks", self.controller.close),
                           ("closing the device timeline", self.timeline.close),
                           ("writing the summary", self._close_summary)):
            try:
                step()
            except Exception:
                logger.exception("perseus-ext: %s failed", what)
        self.report.run_close_hooks()
        if self.job is not None:
            self.job.close()  # reports the batch-size run (rank 0); never raises
        if not self.control_plane_failed:  # a failed group may still hold a collective
            self.comm.close()  # the last collective was the job summary's

