"""Everything one rank needs before its first iteration, checked against its GPU.

The configuration itself is validated at the door (`PerseusConfig`); what only the GPU can tell
-- are the listed clocks supported, what is the lowest clock, what is the maximum power limit --
is checked here, when the runtime is built, so a mistake still fails at `deepspeed.initialize`
(or Megatron's `install`) rather than inside a training step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from perseus_ext.actuation.controller import FrequencyController
from perseus_ext.config import PREFIX, PerseusConfig
from perseus_ext.config.policy import PolicyMode, PolicySection
from perseus_ext.errors import ConfigError
from perseus_ext.measurement.gpu import GPU, GPUError, open_gpu
from perseus_ext.measurement.gpu.timeline import DeviceTimeline, SwitchLatency
from perseus_ext.measurement.gpu.timeline_factory import gpu_switch_latency, open_timeline
from perseus_ext.measurement.pacing import ComputationPacer, NoPacing
from perseus_ext.planning.schedule import PipelineSchedule
from perseus_ext.policies.base import OperatingPointPolicy, StragglerPolicy
from perseus_ext.policies.factories import build_policy

logger = logging.getLogger(__name__)

NO_LATENCY = SwitchLatency(0.0, 0.0)


@dataclass
class RankSetup:
    """One rank's device, clock choices and policy."""

    gpu: GPU | None
    candidate_clocks: list[int]
    communication_clock: int | None
    policy_config: PolicySection | None
    policy: OperatingPointPolicy | None  # None in power-limit mode
    latency: SwitchLatency

    @property
    def power_limit_mode(self) -> bool:
        return self.policy_config is not None and self.policy_config.mode is PolicyMode.POWER_LIMIT

    @classmethod
    def prepare(cls, config: PerseusConfig, *, gpu: GPU | None, policy: OperatingPointPolicy | None,
                local_rank: int) -> "RankSetup":
        if gpu is None:
            gpu = _open_gpu(config, local_rank)
        candidates, communication = _check_clocks(config, gpu)
        policy_config = config.policy
        power_limit_mode = policy_config is not None and policy_config.mode is PolicyMode.POWER_LIMIT
        if power_limit_mode:
            if policy is not None:
                raise ConfigError(f"{PREFIX}.policy.mode 'power_limit' picks a power limit, not frontier "
                                  f"plans; drop the policy object or set {PREFIX}.policy.mode 'frontier'")
            _check_power_limits(policy_config, gpu)
        elif policy is None:
            policy = _frontier_policy(policy_config, gpu)
        latency = gpu_switch_latency(gpu) if gpu is not None else NO_LATENCY
        return cls(gpu, candidates, communication, policy_config, policy, latency)

    def controller(self, config: PerseusConfig, stage: int) -> FrequencyController:
        """The GPU's clock controller; says so when it only records (dry-run)."""
        controller = FrequencyController(self.gpu, dry_run=config.dry_run, strict=config.strict)
        if controller.dry_run:
            why = ("as configured" if config.dry_run else "no GPU could be opened" if self.gpu is None
                   else "no permission to set GPU clocks")
            logger.warning("perseus-ext: stage %d runs in DRY-RUN mode (%s): clock changes are "
                           "recorded, not applied", stage, why)
        return controller

    def timeline(self, job_id: str, rank: int, peer_timeout_s: float | None = None) -> DeviceTimeline:
        return open_timeline(self.gpu, job_id=job_id, rank=rank, peer_timeout_s=peer_timeout_s)

    def pacer(self, config: PerseusConfig, timeline: DeviceTimeline, schedule: PipelineSchedule, *,
              stage: int, pipeline: int, num_pipelines: int) -> ComputationPacer:
        """Simulated work for a simulated GPU with `simulated_workload`, nothing otherwise."""
        workload = config.simulated_workload
        if workload is None:
            return NoPacing()
        workload.check_stages(schedule.num_stages)
        from perseus_ext.measurement.gpu.sim.workload import SimulatedWorkloadPacer  # the simulator, asked for

        return SimulatedWorkloadPacer(
            timeline, schedule, stage=stage, pipeline=pipeline, num_pipelines=num_pipelines,
            forward_s=workload.forward_seconds, backward_s=workload.backward_seconds,
            reduce_grad_s=workload.reduce_grad_seconds,
        )


def _open_gpu(config: PerseusConfig, local_rank: int) -> GPU | None:
    try:
        return open_gpu(config.gpu_spec, local_rank=local_rank, seed=config.seed)
    except GPUError as err:
        logger.warning("perseus-ext: cannot open the GPU (%s); DRY-RUN at default clocks", err)
        return None


def _check_clocks(config: PerseusConfig, gpu: GPU | None) -> tuple[list[int], int | None]:
    if gpu is None:
        return [], None
    supported = gpu.supported_sm_clocks()
    for clock in config.candidate_clocks or ():
        if clock not in supported:
            raise ConfigError(_unsupported(gpu, f"{PREFIX}.candidate_clocks", clock, supported))
    base = list(config.candidate_clocks) if config.candidate_clocks is not None else list(supported)
    candidates = base[:: config.clock_stride]
    communication = config.communication_clock
    if communication == "min":
        communication = supported[-1]
    elif communication is not None and communication not in supported:
        raise ConfigError(_unsupported(gpu, f"{PREFIX}.communication_clock", communication, supported))
    return candidates, communication


def _unsupported(gpu: GPU, key: str, clock: int, supported: list[int]) -> str:
    nearest = min(supported, key=lambda c: abs(c - clock))
    return (f"{key}: {clock} MHz is not supported by {gpu.name} (supported "
            f"{supported[-1]}-{supported[0]} MHz; nearest {nearest} MHz)")


def _check_power_limits(policy_config: PolicySection, gpu: GPU | None) -> None:
    """Explicit `policy.power_limit.limits_w` must fit this GPU."""
    listed = policy_config.power_limit.limits_w
    if listed is None or gpu is None:
        return
    low, high = gpu.power_limit_range_w()
    outside = [w for w in listed if not low <= w <= high]
    if outside:
        raise ConfigError(f"{PREFIX}.policy.power_limit.limits_w: {outside} W outside {gpu.name}'s "
                          f"power-limit range {low:g}-{high:g} W")


def _frontier_policy(parsed: PolicySection | None, gpu: GPU | None) -> OperatingPointPolicy:
    """The `policy` sub-section as a frontier policy (None: Perseus' straggler policy). Cost
    policies price time at one GPU's maximum power limit, read from `gpu` unless the section
    sets `max_power_w`."""
    if parsed is None:
        return StragglerPolicy()
    max_power = None
    if gpu is not None and parsed.max_power_w is None:
        max_power = float(gpu.power_limit_range_w()[1])
    return build_policy(parsed, gpu_max_power_w=max_power)


def describe_gpu(gpu: Any) -> str:
    return gpu.name if gpu is not None else "no GPU"
