"""The rules both adapters share: which modes a job without a pipeline may run, and how a rank's
runtime and its metrics writer are assembled from the typed configuration the adapter parsed at
the door (and the run a batch-size policy prepared before the engine was built).

Imports stay light (no torch): the DeepSpeed adapter loads on `import deepspeed`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from perseus_ext.errors import ConfigError

if TYPE_CHECKING:
    from perseus_ext.monitoring import IterationMetrics, Sink
    from perseus_ext.planning.schedule import PipelineSchedule
    from perseus_ext.runtime import PerseusConfig, PerseusRuntime
    from perseus_ext.runtime.recurring import PreparedRun

PREFIX = "perseus"


def needs_pipeline(config: PerseusConfig) -> bool:
    """`optimize` plans per-computation clocks across pipeline stages; observe and power-limit
    modes need nothing but iteration boundaries."""
    power_limit = config.policy is not None and config.policy.mode == "power_limit"
    return config.mode == "optimize" and not power_limit


def check_mode(config: PerseusConfig, *, has_pipeline: bool, without_pipeline: str, fix: str) -> None:
    """ConfigError when `config` plans clocks across stages but the job has no pipeline:
    "... but {without_pipeline}; {fix}" (each adapter names its own way out)."""
    if not has_pipeline and needs_pipeline(config):
        raise ConfigError(f"{PREFIX}.mode 'optimize' plans GPU clocks across pipeline stages, but "
                          f"{without_pipeline}; {fix}")


def start_runtime(
    config: PerseusConfig,
    *,
    schedule: PipelineSchedule,
    stage: int,
    sinks: Iterable[Sink | None],
    dp_group: Any = None,
    pp_group: Any = None,
    gpu: Any = None,
    policy: Any = None,
    local_rank: int = 0,
    whole_iterations: bool = False,
    prepared_run: PreparedRun | None = None,
) -> tuple[PerseusRuntime, IterationMetrics]:
    """One rank's runtime and the writer of its per-iteration metrics to the framework's sinks
    (DeepSpeed's monitor, Megatron's TensorBoard/W&B writers)."""
    from perseus_ext.monitoring import IterationMetrics
    from perseus_ext.runtime import PerseusRuntime

    runtime = PerseusRuntime(config, schedule=schedule, stage=stage, dp_group=dp_group, pp_group=pp_group,
                             gpu=gpu, policy=policy, local_rank=local_rank, whole_iterations=whole_iterations,
                             prepared_run=prepared_run)
    return runtime, IterationMetrics(runtime, sinks)
