"""The framework-agnostic Perseus lifecycle that adapters drive from their pipeline hooks.

warm-up (default clocks) -> profiling (candidate clocks, all stages in parallel, early stop)
-> solving (frontier solved off the training thread, training goes on at default clocks)
-> deployed (a frontier plan; straggler checks every N iterations move to slower plans and back).
With `policy.mode: "power_limit"` warm-up is followed by the power-limit phase instead.

Adapters call, on every rank: `iteration_start()`, `before_computation()` / `after_computation()`
around every computation of the plan (forwards, backwards, and where the schedule plans it the
gradient sync's own step), optionally `mark_compute_end()` after this stage's last planned
computation, before it waits for the other data-parallel replicas, and `iteration_end()`.
The runtime is a phase machine over collaborators that `RankParts` (wiring.py) builds: `RankSetup`,
`ClockSequencer` (clocks ordered by device markers), `ComputationPacer`, `RunRecorder`,
`ProfilingRun`, `PipelineSolve`, `PlanDeployment`, `PowerLimitMode` (whole-iteration mode:
`whole_iteration.py`). Deployed iterations never synchronise the host with the device: whether a
straggler has recovered is judged off the training thread as the device runs
(`recovery.RecoveryJudge`, `recovery_signal.RecoverySignal`), and the training thread learns it at
a later iteration boundary without waiting. Phase changes are decided from collective results
only, so every rank changes phase at the same iteration. Nothing raises into the training step:
a failure logs its traceback once and the rank falls back to default clocks while still taking
part in the collectives, so it cannot hang the others.
"""

from __future__ import annotations

import datetime
import functools
import logging
from collections.abc import Callable
from typing import Any

from perseus_ext.actuation.exit_guard import forget_interrupt, on_interrupt
from perseus_ext.errors import PerseusError
from perseus_ext.planning.schedule import Computation, Kind, PipelineSchedule
from perseus_ext.policies.base import OperatingPointPolicy
from perseus_ext.config import PerseusConfig
from perseus_ext.runtime.deployment import PlanDeployment, SlowdownAnnouncement, parse_announcement
from perseus_ext.observability.phase import Phase
from perseus_ext.runtime.power_limit_mode import PowerLimitMode
from perseus_ext.runtime.profiling_run import ProfilingRun
from perseus_ext.runtime.rank_setup import describe_gpu
from perseus_ext.runtime.run_report import RunReport
from perseus_ext.runtime import whole_iteration
from perseus_ext.runtime.recurring import PreparedRun
from perseus_ext.observability.iteration import IterationSetting
from perseus_ext.runtime.recovery import RecoveryJudge
from perseus_ext.runtime.recovery_signal import RecoverySignal, Span
from perseus_ext.runtime.records import MeasuredProfile
from perseus_ext.runtime.summary import RunSnapshot
from perseus_ext.runtime.wiring import RankParts
from perseus_ext.measurement.gpu import GPU
from perseus_ext.measurement.pacing import ComputationPacer
from perseus_ext.measurement.gpu.timeline import DeviceMarker

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
        if self.parts.hooks.entered(starts_iteration=starts_iteration):
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
        """whole_iterations: each iteration is one unit the hooks cannot look into, a full-iteration
        CUDA graph replay (`whole_iteration.py`). `prepared_run`: this run's batch size from the store
        (`choose_batch_size`, called by the adapter before the engine was built); required with
        `policy.batch_size`."""
        self.parts = parts = RankParts.build(config, schedule, stage, dp_group=dp_group, pp_group=pp_group, gpu=gpu,
                                policy=policy, local_rank=local_rank, whole_iterations=whole_iterations,
                                prepared_run=prepared_run, fall_back=self.fall_back)
        self.config, self.whole_iterations, self.local_rank = config, whole_iterations, local_rank
        self.schedule, self.stage, self.order = schedule, stage, schedule.orders[stage]
        self.pacer = self._pacer_for(schedule)  # the schedule's simulated work (NoPacing on real GPUs)
        self.phase = Phase.WARMUP if config.mode == "optimize" else Phase.OBSERVING
        self.fallback_reason: str | None = None
        self.iteration, self.control_plane_failed = 0, False  # failed: this rank joins no more collectives
        self.profiling: ProfilingRun | None = None
        self.deployment: PlanDeployment | None = None
        self.power_limit: PowerLimitMode | None = None
        self._announced: SlowdownAnnouncement | None = None
        self._setting = IterationSetting(-1, self.phase)
        self._phase_iterations, self._compute_ended, self._closed = 0, False, False
        self._clock_before_iteration: float | None = None  # the last planned clock of the iteration before
        self.recovery_judge = RecoveryJudge(self.controller)  # held iterations, judged as the device ends them
        self.recovery_signal = RecoverySignal(self.comm.store() if self.comm.num_pipelines > 1 else None,
                                              parts.job_id, self.recovery_judge, config.straggler_threshold / 2)
        self.report = RunReport(self.snapshot, config.summary_path)
        on_interrupt(self)  # SIGINT/SIGTERM: the summary is written after the clocks are restored
        parts.announce_ready(stage, schedule)

    # ------------------------------------------------------------------ hooks
    @_hook
    def iteration_start(self) -> None:
        """Pick the iteration's clocks and queue them at the device's iteration start."""
        self._compute_ended = False
        setting = self._setting = self._current_setting()
        if self._profiling_now:
            self.profiling.start_iteration()
        clocks = durations = recovery = None
        if setting.phase is Phase.DEPLOYED:
            program = self.deployment.recovery_program(setting)  # a held iteration is told to the judge
            recovery = None if self.whole_iterations else program  # a whole iteration keeps its one clock
        if setting.plan is not None:
            if self.whole_iterations:  # a stage-constant plan: its one clock for the whole iteration
                clocks = whole_iteration.stage_clock(self.deployment, self.stage)
            else:
                clocks = self.deployment.stage_clocks(self.stage)
                durations = self.deployment.stage_durations(self.stage)
        elif setting.profiled_clock_mhz is not None:
            clocks = (setting.profiled_clock_mhz,) * len(self.order)
        last = self.sequencer.trace.planned_clocks[-1:]  # the iteration before's (None: default clocks)
        self._clock_before_iteration = (last[0] or self.recorder.default_clock_mhz) if last else None
        start = self.sequencer.start_iteration(self.iteration, clocks, durations, recovery)
        self.recorder.begin(setting, start)
        self.parts.solve.play_filler(setting.plan, -1, start)  # a swing cap's filler: the wait into this iteration
        if self.whole_iterations:  # the whole iteration is the one span the stage's clock covers
            self.sequencer.computation_started()

    @_hook
    def before_computation(self, kind: Kind | str, microbatch: int, chunk: int = 0,
                           parts: tuple[Computation, ...] = ()) -> None:
        """The framework is about to launch this computation's work (a combined unit names its
        `parts`, e.g. megatron-core's combined_1f1b step: one forward and another's backward)."""
        computation = Computation(self.stage, chunk, microbatch, Kind(kind), tuple(parts))
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
    def after_computation(self, kind: Kind | str, microbatch: int, chunk: int = 0,
                          parts: tuple[Computation, ...] = ()) -> None:
        """The framework has launched this computation's work: queue what comes next."""
        if self._profiling_now:
            self.profiling.after_computation(Kind(kind).value, self.sequencer.planned_clock())
        position = self.sequencer.position
        end = self.sequencer.computation_finished()
        self.parts.solve.play_filler(None if self.fallback_reason else self._setting.plan, position, end)  # swing cap
        if self.recovery_signal.watching and self._setting.plan is not None:
            self._watch_span(position, end)

    def _watch_span(self, position: int, end: DeviceMarker) -> None:
        """The straggler pipeline's computation, handed to the recovery signal's thread: a queue put."""
        durations = self.deployment.stage_durations(self.stage) if self.deployment is not None else None
        spans = self.sequencer.trace.spans
        if durations is None or position >= len(durations) or not spans:
            return
        self.recovery_signal.computation(Span.of(
            self.iteration, spans[-1][0], end, self.deployment.stage_clocks(self.stage), durations, position,
            self._clock_before_iteration, self.sequencer.landing_window_s))

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
        self.parts.hooks.silence.heartbeat()
        try:
            if not self.parts.hooks.capture_noticed():  # captured: nothing ran on the device, nothing to record
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
        self.parts.solve.reschedule(self.schedule, schedule, deployed=self.deployment is not None,
                                    solving_again=solving_again)
        self.schedule = schedule
        self.order = schedule.orders[self.stage]
        self.pacer = self._pacer_for(schedule)
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
        self.parts.solve.forget()
        self.deployment = None
        self.recovery_signal.disarm()
        logger.info("perseus-ext: stage %d profiles again from iteration %d on (%s)", self.stage,
                    self.iteration, reason)
        self._set_phase(Phase.WARMUP)

    # ------------------------------------------------------------------ state
    def _pacer_for(self, schedule: PipelineSchedule) -> ComputationPacer:
        return self.parts.setup.pacer(self.config, self.parts.timeline, schedule, stage=self.stage,
                                      pipeline=self.parts.comm.pipeline, num_pipelines=self.parts.comm.num_pipelines)

    @property
    def policy(self) -> OperatingPointPolicy | None:
        """The frontier policy (None in power-limit mode); replacing it before deployment (the demo's
        variants do) changes the policy the deployment and the summary take."""
        return self.parts.setup.policy

    @policy.setter
    def policy(self, policy: OperatingPointPolicy | None) -> None:
        self.parts.setup.policy = policy

    @property
    def _profiling_now(self) -> bool:
        return (self.phase is Phase.PROFILING and self.fallback_reason is None
                and self.profiling is not None and not self.profiling.profiler.done)

    # Read-only views of the collaborators (`self.parts`), for adapters, tests and monitoring.
    gpu = property(lambda self: self.parts.setup.gpu)
    controller = property(lambda self: self.parts.controller)
    comm = property(lambda self: self.parts.comm)
    timeline = property(lambda self: self.parts.timeline)
    sequencer = property(lambda self: self.parts.sequencer)
    recorder = property(lambda self: self.parts.recorder)
    probes = property(lambda self: self.parts.probes)
    emissions = property(lambda self: self.parts.emissions)
    job = property(lambda self: self.parts.job, doc="The job-wide exchange of a recurring job (None without one).")
    plan = property(lambda self: self.deployment.plan if self.deployment is not None else None)
    frontier = property(lambda self: self.deployment.frontier if self.deployment is not None else None)
    history = property(lambda self: self.recorder.history)
    saved_profile = property(lambda self: self.parts.solve.saved_profile, doc="The profile saved beside the job, if any.")
    solve_outcome = property(lambda self: self.parts.solve.outcome,
                             doc="This rank's view of its pipeline's solve result (a StageSolve; None before).")
    silence = property(lambda self: self.parts.hooks.silence)
    captured_hooks = property(lambda self: self.parts.hooks.captured_hooks)
    profiling_iterations = property(lambda self: self.profiling.iterations if self.profiling is not None else 0)
    candidate_clocks = property(lambda self: self.parts.setup.candidate_clocks)

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
        if self.parts.setup.power_limit_mode:
            self.power_limit = PowerLimitMode.start(
                self.gpu, self.controller, self.parts.setup.policy_config, self.comm,
                can_take_part=not self.controller.dry_run and self.fallback_reason is None,
                settle=lambda: self.controller.flush(FLUSH_TIMEOUT_S))
            self.emissions.power_limit = self.power_limit
            self._set_phase(Phase.POWER_LIMIT if self.power_limit is not None else Phase.OBSERVING)
            return
        have_profile, can_set_clocks, none_fell_back = self.comm.all_min([
            float(self.parts.solve.saved_profile is not None),
            float(not self.controller.dry_run and bool(self.parts.setup.candidate_clocks)),
            float(self.fallback_reason is None),
        ])
        if have_profile:
            logger.info("perseus-ext: using saved profile %s; skipping profiling", self.config.profile_path)
            self._start_solve(self.parts.solve.saved_profile if self.comm.is_pipeline_leader else None)
        elif self.whole_iterations:
            whole_iteration.warn_nothing_to_solve_from()
            self._set_phase(Phase.OBSERVING)
        elif can_set_clocks and none_fell_back:
            self.profiling = ProfilingRun.create(self.config, self.stage, self.parts.setup, self.controller,
                                                 self.timeline, self.schedule, free_running=self.sequencer.trace)
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
            gpu_name=describe_gpu(self.gpu), save=lambda profile: self.parts.solve.store.save(profile, self.schedule))
        if done:
            self._start_solve(measured)

    def _start_solve(self, measured: MeasuredProfile | None) -> None:
        self._set_phase(Phase.SOLVING)
        self.parts.solve.start(self.schedule, measured)

    def _solving_step(self) -> None:
        shipped = self.parts.solve.collect()
        if shipped is None:
            return
        if shipped.frontier is None:
            logger.warning("perseus-ext: pipeline %d has no frontier (%s); staying at default clocks",
                           self.comm.pipeline, shipped.error)
            self._set_phase(Phase.OBSERVING)
            return
        self.recovery_signal.disarm()  # a redeployment: the last one's straggler episodes are over
        self.deployment = PlanDeployment(shipped, self.policy, self.config, self.comm, self.schedule,
                                         self.recovery_judge, self.recovery_signal)
        self.deployment.deploy(self.iteration)
        self._set_phase(Phase.DEPLOYED)

    def _set_phase(self, phase: Phase) -> None:
        self.phase = phase
        self._phase_iterations = 0

    def _record_end(self) -> None:
        """The iteration's end marker and the checks that it ran as planned."""
        if self.whole_iterations:
            whole_iteration.replay_launched(self.iteration, self.order, self.pacer, self.sequencer)
        self.mark_compute_end()
        self.recorder.end(self.iteration, self.timeline.record_marker(), self.sequencer.trace)
        disabled = self.controller.disabled_reason
        if self.fallback_reason is None and disabled is not None:
            self.fall_back(f"GPU clock control failed ({disabled})")
        spans = whole_iteration.SPANS_PER_ITERATION if self.whole_iterations else len(self.order)
        if self.fallback_reason is None and self.sequencer.position != spans:
            self.fall_back(f"the iteration ran {self.sequencer.position} computations on stage "
                           f"{self.stage}, the schedule has {spans}")

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
        return self.parts.snapshot(self.stage, self.config, self.phase, self.fallback_reason, self.profiling,
                                   self.deployment, self.power_limit)

    def _close_policy(self) -> None:
        if self.policy is not None:
            self.policy.close()
        if self.power_limit is not None:
            self.power_limit.close()

    def close(self) -> None:
        """Restore default clocks and report; idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        forget_interrupt(self)
        self.parts.solve.cancel()
        self.parts.hooks.close()
        self.recovery_signal.close()
        for what, step in (("recording the last iterations", lambda: self.recorder.close(FLUSH_TIMEOUT_S)),
                           ("closing the policy", self._close_policy), ("restoring clocks", self.controller.close),
                           ("closing the device timeline", self.timeline.close),
                           ("writing the summary", lambda: self.report.write_at_close(
                               self.comm, job_id=self.parts.job_id, control_timeout_s=self.config.control_timeout_s,
                               control_plane_failed=self.control_plane_failed))):
            try:
                step()
            except Exception:
                logger.exception("perseus-ext: %s failed", what)
        if self.job is not None:
            self.job.close()  # reports the batch-size run (rank 0); never raises
        if not self.control_plane_failed:  # a failed group may still hold a collective
            self.comm.close()  # the last collective was the job summary's

