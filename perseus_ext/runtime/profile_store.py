"""A measured profile saved beside the job (`perseus.profile_path`), so a restarted job skips
profiling: the CSV (`stage,instruction,frequency,time,energy`) plus `<path>.json` with what the
CSV cannot hold -- the blocking power per GPU, the GPUs per stage and the GPU model, read once at
the door by `PerseusConfig` (`saved_profile_sidecar`) and handed to the store (`for_job`).

Everything wrong with a saved profile is a ConfigError naming `perseus.profile_path` and the
fix, found when the runtime is built (the GPU model needs the GPU) rather than at deployment.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from perseus_ext.errors import ConfigError, PerseusError
from perseus_ext.inputs import validation_problem
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import PipelineSchedule
from perseus_ext.config import PREFIX, PerseusConfig, ProfileSidecar
from perseus_ext.config.sections import profile_sidecar as sidecar_path
from perseus_ext.runtime.records import MeasuredProfile

if TYPE_CHECKING:
    from perseus_ext.measurement.gpu import GPU

logger = logging.getLogger(__name__)

KEY = f"{PREFIX}.profile_path"


class ProfileStore:
    """Loads and saves one job's measured profile."""

    def __init__(self, path: str | None, *, gpus_per_stage: int, gpu_name: str | None,
                 blocking_power_per_gpu_w: float | None, sidecar: ProfileSidecar | None = None) -> None:
        """`sidecar`: what the config read beside `path` at the door (None: no side file)."""
        self.path = Path(path) if path is not None else None
        self.sidecar = sidecar
        self.gpus_per_stage = gpus_per_stage
        self.gpu_name = gpu_name
        self.blocking_override_w = blocking_power_per_gpu_w

    @classmethod
    def for_job(cls, config: PerseusConfig, gpus_per_stage: int, gpu: GPU | None) -> "ProfileStore":
        """The store of `config.profile_path`, with the side file the config read at the door."""
        return cls(config.profile_path, gpus_per_stage=gpus_per_stage, gpu_name=gpu.name if gpu is not None else None,
                   blocking_power_per_gpu_w=config.blocking_power_w or config.saved_blocking_power_w,
                   sidecar=config.saved_profile_sidecar)

    def load(self, schedule: PipelineSchedule) -> MeasuredProfile | None:
        """The saved profile, None when there is none yet; ConfigError when it is unusable."""
        if self.path is None or not self.path.is_file():
            return None
        fix = f"delete {self.path} (and {sidecar_path(self.path)}) to profile again"
        try:
            profile = load_profile(self.path)  # as measured: the planner filters
        except PerseusError as err:
            raise ConfigError(f"{KEY} {self.path} is not a usable profile ({err}); {fix}") from None
        if profile.num_stages != schedule.num_stages:
            raise ConfigError(f"{KEY} {self.path} profiles {profile.num_stages} stages, this pipeline "
                              f"has {schedule.num_stages}; {fix}")
        sidecar = self.sidecar or ProfileSidecar()
        saved_gpu = sidecar.gpu
        if saved_gpu is not None and self.gpu_name is not None and saved_gpu != self.gpu_name:
            raise ConfigError(f"{KEY} {self.path} was measured on {saved_gpu}, this job runs on "
                              f"{self.gpu_name}; {fix}")
        per_gpu = self.blocking_override_w
        if per_gpu is None:  # PerseusConfig checked it at the door
            raise ConfigError(f"{KEY} {self.path} has no blocking power; set {PREFIX}.blocking_power_w or {fix}")
        saved_tp = sidecar.gpus_per_stage if sidecar.gpus_per_stage is not None else self.gpus_per_stage
        if saved_tp != self.gpus_per_stage:
            raise ConfigError(f"{KEY} {self.path} was measured with {saved_tp} GPU(s) per stage, this "
                              f"job has {self.gpus_per_stage}; {fix}")
        return MeasuredProfile(profile, float(per_gpu) * self.gpus_per_stage, self.gpus_per_stage,
                               saved_gpu if saved_gpu is not None else self.gpu_name)

    def save(self, measured: MeasuredProfile, schedule: PipelineSchedule) -> None:
        """Write the CSV and its sidecar; a failure is logged (the job goes on without it).

        The sidecar goes through `ProfileSidecar`, the model the next run reads it with: a
        profile whose side file that run would refuse (no blocking power, when the estimate
        failed: `profiling_run.py`) is not written, so the next run profiles again instead of
        stopping at the door (a recurring job broke on its second run this way)."""
        if self.path is None:
            return
        try:
            sidecar = ProfileSidecar(blocking_power_w=measured.blocking_power_per_gpu_w,
                                     gpus_per_stage=measured.gpus_per_stage, gpu=measured.gpu_name)
        except ValidationError as err:
            field, problem = validation_problem(err)
            logger.warning("perseus-ext: the profile is not saved to %s: its %s would be refused (%s; set "
                           "%s.blocking_power_w to keep one); the next run profiles again",
                           self.path, field, problem, PREFIX)
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            measured.profile.save(self.path)
            sidecar_path(self.path).write_text(json.dumps({**sidecar.model_dump(), "schedule": schedule.describe()}))
        except OSError as err:
            logger.error("perseus-ext: cannot save the profile to %s: %s", self.path, err)
            return
        logger.info("perseus-ext: saved the profile to %s (a restarted job skips profiling)", self.path)
