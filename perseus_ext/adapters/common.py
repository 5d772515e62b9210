"""The rules both adapters share: which modes a job without a pipeline may run, and how a rank's
runtime and its metrics writer are assembled from the typed configuration the adapter parsed at
the door (and the run a batch-size policy prepared before the engine was built).

Imports stay light (no torch): the DeepSpeed adapter loads on `import deepspeed`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from perseus_ext.errors import ConfigError

if TYPE_CHECKING:
    from perseus_ext.measurement.gpu import GPU
    from perseus_ext.observability.monitoring import IterationMetrics, Sink
    from perseus_ext.planning.schedule import PipelineSchedule
    from perseus_ext.policies.base import OperatingPointPolicy
    from perseus_ext.runtime import PerseusConfig, PerseusRuntime
    from perseus_ext.runtime.recurring import PreparedRun

PREFIX = "perseus"


def ensure_log_output() -> None:
    """Show perseus-ext's INFO lines when the training script configured no logging at all
    (DeepSpeed and torch.distributed.pipelining scripts usually do not), so the per-iteration log
    and summary are visible."""
    package_logger = logging.getLogger("perseus_ext")
    if package_logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s"))
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)


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


@dataclass(frozen=True)
class RankCounts:
    """How many ranks the job has, and how many of them this node runs (the launcher's
    WORLD_SIZE and LOCAL_WORLD_SIZE; 1 and LOCAL_RANK + 1 where it sets none)."""

    world_size: int
    local_world_size: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RankCounts:
        environ = os.environ if environ is None else environ

        def count(name: str, default: int) -> int:
            text = environ.get(name, "").strip()
            if not text:
                return default
            if not text.isdigit() or int(text) < 1:
                raise ConfigError(f"env {name}={text!r} must be a count of ranks >= 1 (the launcher sets it)")
            return int(text)

        local_rank = environ.get("LOCAL_RANK", "").strip()
        below = int(local_rank) + 1 if local_rank.isdigit() else 1  # at least this rank's node
        return cls(count("WORLD_SIZE", 1), count("LOCAL_WORLD_SIZE", below))


_PATH_CHECKS = ("log_path", "summary_path")


def check_rank_values(config: PerseusConfig, counts: RankCounts) -> None:
    """ConfigError (with the keys it is about) unless every value that combines with a rank
    works for every rank of the job, checked by each rank before any of them trains: the
    Prometheus port plus the highest local rank is a port, and `{rank}` paths (log, summary, the
    simulated GPU's state file) render for every global rank to files that can be written (one
    check per directory, plus each file that exists). A rank that would fail alone later fails
    here with all the others."""
    from perseus_ext.config.rules import unwritable_reason
    from perseus_ext.observability.prometheus import export_target

    highest_local = counts.local_world_size - 1
    prometheus = config.prometheus
    if prometheus is not None and prometheus.port is not None and prometheus.port + highest_local > 65535:
        raise ConfigError(
            f"{PREFIX}.prometheus.port {prometheus.port}: local rank r serves on port + r, and local rank "
            f"{highest_local} (LOCAL_WORLD_SIZE {counts.local_world_size}) would need {prometheus.port + highest_local}, "
            f"past 65535; use a base port <= {65536 - counts.local_world_size}", keys=(f"{PREFIX}.prometheus.port",))
    export_target(prometheus, highest_local)  # the environment's port and gateway, for the highest local rank
    templates = {f"{PREFIX}.{key}": getattr(config, key) for key in _PATH_CHECKS}
    spec = config.gpu_spec
    state_file_of = getattr(spec, "state_file_of", None)
    for key, template in templates.items():
        if template is not None:
            _check_rendered(key, [template.format(rank=rank) for rank in range(counts.world_size)], unwritable_reason)
    if state_file_of is not None and state_file_of(0) is not None:
        _check_rendered(f"{PREFIX}.gpu", [state_file_of(rank) for rank in range(counts.world_size)], unwritable_reason)


def _check_rendered(key: str, paths: list[str], unwritable_reason: Any) -> None:
    """One check per directory the ranks' files go to, and one per file that exists already."""
    seen_dirs: set[Path] = set()
    for rank, text in enumerate(paths):
        path = Path(text)
        parent = path.absolute().parent
        if path.exists() or parent not in seen_dirs:
            seen_dirs.add(parent)
            reason = unwritable_reason(path)
            if reason is not None:
                raise ConfigError(f"{key} gives rank {rank} the path {text!r}, which {reason}; every rank of the "
                                  f"job (0 to {len(paths) - 1}) must be able to write its file", keys=(key,))


def start_runtime(
    config: PerseusConfig,
    *,
    schedule: PipelineSchedule,
    stage: int,
    sinks: Iterable[Sink | None],
    dp_group: Any = None,
    pp_group: Any = None,
    gpu: GPU | None = None,
    policy: OperatingPointPolicy | None = None,
    local_rank: int = 0,
    whole_iterations: bool = False,
    prepared_run: PreparedRun | None = None,
) -> tuple[PerseusRuntime, IterationMetrics]:
    """One rank's runtime and the writer of its per-iteration metrics to the framework's sinks
    (DeepSpeed's monitor, Megatron's TensorBoard/W&B writers)."""
    from perseus_ext.observability.monitoring import IterationMetrics
    from perseus_ext.runtime import PerseusRuntime

    runtime = PerseusRuntime(config, schedule=schedule, stage=stage, dp_group=dp_group, pp_group=pp_group,
                             gpu=gpu, policy=policy, local_rank=local_rank, whole_iterations=whole_iterations,
                             prepared_run=prepared_run)
    return runtime, IterationMetrics(runtime.parts.feed, sinks)
