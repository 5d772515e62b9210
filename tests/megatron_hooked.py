"""perseus-ext's real Megatron hooks on tests/megatron_shims.py's in-process pipeline ranks.

megatron_shims runs every pipeline rank of megatron-core's real schedule as a thread of this
process; the Megatron adapter patches module-level functions of
`megatron.core.pipeline_parallel.schedules` once per process. So each rank gets its own
`MegatronPerseus` whose wrappers (`_wrap_schedule`, `_wrap_step`: exactly what `install()` puts
in place) are reached through one dispatcher per patched name that picks the calling thread's
rank. Each rank's `PerseusRuntime` is built up front in the main thread on a paced simulated
A100 with a saved profile (no process group: the runtime's control plane is single-process and
every rank solves the pipeline's frontier as its leader would and keeps its own stage's plans;
the simulated devices share one job board, each under its
stage's rank, so a stage's simulated work waits for its neighbour's as a pipeline's does), and its `before_computation` / `after_computation` are
spied on: every rank's `events` list gets ("before"|"after", kind, microbatch) in the order the
hooks ran, and stage modules may append their own compute records to the same list.
"""

from __future__ import annotations

import contextlib
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron.core.pipeline_parallel import schedules

from megatron_shims import rank_of_current_thread
from runtime_helpers import STAGE_BACKWARD_S, STAGE_FORWARD_S, make_config, sim_gpu, stage_profile

from perseus_ext.adapters.megatron import MegatronPerseus
from perseus_ext.adapters.megatron_surface import installed_version, patch_surface
from perseus_ext.observability.monitoring import IterationMetrics
from perseus_ext.planning.schedule import Kind, build_schedule
from perseus_ext.runtime import PerseusRuntime
from perseus_ext.runtime.comm import Member
from perseus_ext.runtime.rank_setup import RankSetup

FORWARD_S, BACKWARD_S = STAGE_FORWARD_S, STAGE_BACKWARD_S


@dataclass
class HookedRank:
    perseus: MegatronPerseus
    runtime: PerseusRuntime
    gpu: Any
    events: list = field(default_factory=list)


def hooked_ranks(tmp_path: Path, num_stages: int, num_microbatches: int, model_config: Any = None) -> list[HookedRank]:
    """One MegatronPerseus + runtime per rank, deploying from a saved profile. `model_config`
    (megatron's TransformerConfig, e.g. with CUDA-graph options) is adopted as the adapter does at
    the first iteration."""
    profile = stage_profile(tmp_path / "profile.csv", sim_gpu(), num_stages)
    config = make_config(profile_path=profile, blocking_power_w=sim_gpu().preset.idle_power_w,
                         baseline_fraction=0.0, simulated_workload={
                             "forward_seconds": list(FORWARD_S[:num_stages]),
                             "backward_seconds": list(BACKWARD_S[:num_stages])})
    schedule = build_schedule("1f1b", num_stages, num_microbatches)
    ranks = []
    job_id = secrets.token_hex(8)
    open_timeline = RankSetup.timeline
    for stage in range(num_stages):
        gpu = sim_gpu(seed=stage)

        def timeline(setup, _job_id, _rank, peer_timeout_s=None, stage=stage):
            return open_timeline(setup, job_id, stage, peer_timeout_s=peer_timeout_s)

        RankSetup.timeline = timeline  # one board for the job's in-process ranks
        try:
            runtime = PerseusRuntime(config, schedule=schedule, stage=stage, gpu=gpu)
        finally:
            RankSetup.timeline = open_timeline
        # single-process control plane: this rank leads the pipeline (solves it) and is `stage`
        runtime.comm.members = [Member(0, 0, 0)] + ([Member(0, 0, stage)] if stage else [])
        perseus = MegatronPerseus(None, gpu=gpu)
        perseus._config = config
        perseus.runtime, perseus.metrics = runtime, IterationMetrics(runtime.parts.feed, [])
        perseus.schedule, perseus.stage = schedule, stage
        if model_config is not None:
            perseus.adopt_execution(model_config)
        rank = HookedRank(perseus, runtime, gpu)
        runtime.before_computation = _spy(runtime.before_computation, "before", rank.events)
        runtime.after_computation = _spy(runtime.after_computation, "after", rank.events)
        ranks.append(rank)
    return ranks


def _spy(method, what: str, events: list):
    def record(kind, microbatch, *args, **kwargs):
        events.append((what, Kind(kind).value, microbatch))
        return method(kind, microbatch, *args, **kwargs)
    return record


@contextlib.contextmanager
def perseus_hooks(ranks: list[HookedRank]):
    """Put each rank's adapter wrappers in place of megatron-core's schedule and step functions
    (as `install()` does), dispatched by the calling rank thread; restored on exit."""
    surface = patch_surface(installed_version())
    originals = {name: getattr(schedules, name) for name in surface.names}
    wrapped = []
    for rank in ranks:
        wrappers = {name: rank.perseus._wrap_schedule(originals[name]) for name in surface.schedules}
        wrappers.update({name: rank.perseus._wrap_step(originals[name], Kind.FORWARD) for name in surface.forward_steps})
        wrappers.update({name: rank.perseus._wrap_step(originals[name], Kind.BACKWARD)
                         for name in surface.backward_steps})
        wrapped.append(wrappers)

    def dispatcher(name: str):
        def call(*args, **kwargs):
            return wrapped[rank_of_current_thread()][name](*args, **kwargs)
        call.__name__ = name
        return call

    for name in originals:
        setattr(schedules, name, dispatcher(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(schedules, name, original)
