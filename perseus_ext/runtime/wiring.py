"""One rank's collaborators, built and wired together once, before its first iteration.

`PerseusRuntime` is a phase machine over these parts; building them (which checks the rank's
place in the pipeline, opens the device, agrees on a job id with the other ranks and links the
recorder to the emissions account, the baseline probes and the rank's metrics feed) is kept here
so the phase machine reads as phases only.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from perseus_ext.actuation.controller import FrequencyController
from perseus_ext.actuation.sequencer import ClockSequencer
from perseus_ext.errors import PerseusError
from perseus_ext.measurement.gpu.timeline import DeviceTimeline
from perseus_ext.planning.schedule import PipelineSchedule
from perseus_ext.policies.base import OperatingPointPolicy
from perseus_ext.measurement.gpu import GPU
from perseus_ext.observability.feed import RankFeed, RankIdentity
from perseus_ext.observability.phase import Phase
from perseus_ext.runtime.baseline import BaselineProbes
from perseus_ext.runtime.comm import ControlPlane, check_pipeline_rank
from perseus_ext.config import PerseusConfig
from perseus_ext.runtime.emissions import EmissionsAccount
from perseus_ext.runtime.hook_watch import HookWatch
from perseus_ext.runtime.pipeline_solve import PipelineSolve
from perseus_ext.runtime.profile_store import ProfileStore
from perseus_ext.runtime.rank_setup import RankSetup, describe_gpu
from perseus_ext.runtime.recorder import RunRecorder
from perseus_ext.runtime.deployment import PlanDeployment
from perseus_ext.runtime.power_limit_mode import PowerLimitMode
from perseus_ext.runtime.profiling_run import ProfilingRun
from perseus_ext.runtime.recurring import JobCoordinator, PreparedRun
from perseus_ext.runtime.summary import RunSnapshot, policy_snapshot

if TYPE_CHECKING:
    from perseus_ext.measurement.gpu.zeusd import ZeusdReport

logger = logging.getLogger("perseus_ext.runtime.runtime")  # the runtime's own log lines


@dataclass(frozen=True)
class RankParts:
    """The collaborators of one rank's `PerseusRuntime` (see `build`)."""

    setup: RankSetup
    controller: FrequencyController
    comm: ControlPlane
    job_id: str  # the same on every rank
    timeline: DeviceTimeline
    sequencer: ClockSequencer
    hooks: HookWatch
    solve: PipelineSolve
    emissions: EmissionsAccount
    probes: BaselineProbes
    recorder: RunRecorder
    job: JobCoordinator | None  # the job-wide exchange (batch-size run, early stop, shared signal)
    feed: RankFeed  # what the rank publishes for its metrics writers (observability.feed)
    # The pacer (the schedule's simulated work) is the runtime's: it changes with the schedule.

    @classmethod
    def build(cls, config: PerseusConfig, schedule: PipelineSchedule, stage: int, *, dp_group: Any,
              pp_group: Any, gpu: GPU | None, policy: OperatingPointPolicy | None, local_rank: int,
              whole_iterations: bool, prepared_run: PreparedRun | None,
              fall_back: Callable[[str], None]) -> RankParts:
        """Check the rank's place, then build its parts; `fall_back` is the runtime's, which the
        hook watch calls when a hook runs during a CUDA graph capture."""
        if not 0 <= stage < schedule.num_stages:
            raise PerseusError(f"stage {stage} is outside the schedule's 0..{schedule.num_stages - 1}")
        check_pipeline_rank(pp_group, stage)
        if config.simulated_workload is not None:
            config.simulated_workload.check_stages(schedule.num_stages)
        setup = RankSetup.prepare(config, gpu=gpu, policy=policy, local_rank=local_rank)
        controller = setup.controller(config, stage)
        comm = ControlPlane(stage=stage, dp_group=dp_group, timeout_s=config.control_timeout_s)
        job_id = comm.broadcast_job(secrets.token_hex(8))
        # a simulated device's wait for another rank is bounded like every collective
        timeline = setup.timeline(job_id, comm.rank, peer_timeout_s=config.control_timeout_s)
        sequencer = ClockSequencer(controller, timeline, communication_clock=setup.communication_clock,
                                   latency=setup.latency)
        # Hooks that fall silent never leave a clock held; hooks during a CUDA graph capture do nothing.
        hooks = HookWatch(lambda: controller.current_clock, lambda episode: controller.release_silent(), fall_back)
        solve = PipelineSolve(config, comm, setup.latency, ProfileStore.for_job(config, comm.gpus_per_stage, setup.gpu),
                              schedule, stage_constant=whole_iterations, gpu=setup.gpu)
        emissions = EmissionsAccount(setup.policy)
        probes = BaselineProbes(config.baseline_fraction, config.straggler_check_interval)
        feed = RankFeed(RankIdentity(job_id, comm.rank, local_rank, comm.pipeline, stage), config.prometheus,
                        probes.estimate)
        recorder = RunRecorder(controller, rank=comm.rank, pipeline=comm.pipeline, stage=stage,
                               latency=setup.latency, log_path=config.log_path, log_interval=config.log_interval,
                               job_id=job_id, on_record=emissions.on_record, saving=probes.estimate, feed=feed,
                               default_clock_mhz=_max_clock_mhz(setup.gpu), power_bins=timeline.power_bins)
        job = JobCoordinator.create(config, comm, setup.gpu, setup.policy, prepared_run)
        return cls(setup, controller, comm, job_id, timeline, sequencer, hooks, solve, emissions,
                   probes, recorder, job, feed)

    def announce_ready(self, stage: int, schedule: PipelineSchedule) -> None:
        """The line every rank would repeat: rank 0's at INFO, the others' at DEBUG."""
        logger.log(logging.INFO if self.comm.rank == 0 else logging.DEBUG,
                   "perseus-ext: stage %d/%d pipeline %d ready on %s (%s); %d candidate clocks; %d ranks",
                   stage, schedule.num_stages, self.comm.pipeline, describe_gpu(self.setup.gpu),
                   "dry-run" if self.controller.dry_run else "live", len(self.setup.candidate_clocks),
                   self.comm.num_pipelines * schedule.num_stages)

    def snapshot(self, stage: int, config: PerseusConfig, phase: Phase, fallback_reason: str | None,
                 profiling: ProfilingRun | None, deployment: PlanDeployment | None,
                 power_limit: PowerLimitMode | None) -> RunSnapshot:
        """The rank's run as the summary reads it, from these parts and the runtime's phase state."""
        gpu, controller = self.setup.gpu, self.controller
        return RunSnapshot(
            rank=self.comm.rank, pipeline=self.comm.pipeline, stage=stage,
            gpu_name=gpu.name if gpu is not None else None, mode=str(config.mode),
            dry_run=controller.dry_run, fallback_reason=fallback_reason, phase=phase,
            history=tuple(self.recorder.history), baseline_fraction=config.baseline_fraction,
            profiling_iterations=profiling.iterations if profiling else 0,
            profiled_clocks=tuple(profiling.profiler.profiled_clocks) if profiling else (),
            profile_overhead_s=profiling.overhead_s if profiling else 0.0,
            exact_coverage=self.timeline.exact_coverage(), switch_latency_s=self.setup.latency.effective_s,
            plan_switches=tuple(deployment.switches) if deployment else (),
            controller_errors=controller.error_count,
            set_call_s=tuple(controller.set_call_s), assumed_call_s=controller.dry_run_call_s,
            silent_hooks=self.hooks.report(),
            frontier=deployment.frontier if deployment else None, zeusd=self._zeusd_report(),
            policy=policy_snapshot(self.setup, power_limit.snapshot() if power_limit is not None else None,
                                   getattr(self.emissions.ledger, "report", None)))

    def _zeusd_report(self) -> ZeusdReport | None:
        from perseus_ext.measurement.gpu.zeusd import ZeusdGPU  # here: httpx only where zeusd is used

        gpu = self.setup.gpu
        return gpu.report() if isinstance(gpu, ZeusdGPU) else None


def _max_clock_mhz(gpu: GPU | None) -> float | None:
    """The GPU's highest SM clock (what default clocks run); None when it cannot say."""
    try:
        return float(gpu.supported_sm_clocks()[0]) if gpu is not None else None
    except Exception:  # a GPU that cannot answer: no clock figure, training goes on
        return None
