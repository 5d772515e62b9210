"""Tensor parallelism > 1: a stage of two GPUs is profiled, planned and saved as one stage.

Its energy is the sum over the stage's GPUs and so is its blocking power (per stage, in watts):
one GPU's blocking power times the GPUs per stage. The assembly is checked directly, and a real
two-process gloo job (one pipeline stage of two tensor-parallel ranks) checks the runtime.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from perseus_ext.planning.schedule import build_schedule
from perseus_ext.runtime.comm import Member
from perseus_ext.runtime.profiler import ProfileRow, StageMeasurements
from perseus_ext.runtime.profiling_run import ProfilingRun

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_helpers import make_config, run_gloo_job, sim_gpu, train  # noqa: E402

WORKER_TIMEOUT_S = 240


def _measurements(stage: int, scale: float, blocking_w: float) -> StageMeasurements:
    rows = tuple(ProfileRow(stage, kind, clock, base_s * scale, base_s * scale * 300.0)
                 for kind, base_s in (("forward", 0.01), ("backward", 0.02)) for clock in (1410, 1050))
    return StageMeasurements(stage, rows, blocking_w, 0.0, (1050, 1410))


def test_assembly_adds_up_the_gpus_of_a_stage():
    gathered = [(Member(rank, 0, rank // 2), _measurements(rank // 2, 1.0 + 0.1 * (rank % 2), 80.0 + rank))
                for rank in range(4)]  # 2 stages x 2 tensor-parallel GPUs
    measured = ProfilingRun.assemble(gathered, pipeline=0, blocking_override_w=None, gpu_name="A100")
    assert measured.gpus_per_stage == 2
    # Per stage: the sum of its GPUs' blocking powers (81 + 80, 83 + 82), averaged over stages.
    assert measured.blocking_power_per_stage_w == pytest.approx((80 + 81 + 82 + 83) / 2)
    assert measured.blocking_power_per_gpu_w == pytest.approx((80 + 81 + 82 + 83) / 4)
    points = measured.profile[0, "forward"]
    clock = points.index_of(1410)
    assert points.times[clock] == pytest.approx(0.011)  # the slower GPU sets the time
    assert points.energies[clock] == pytest.approx(0.01 * 300 + 0.011 * 300)  # energies add up
    overridden = ProfilingRun.assemble(gathered, pipeline=0, blocking_override_w=90.0, gpu_name="A100")
    assert overridden.blocking_power_per_stage_w == pytest.approx(180.0)  # the override is per GPU


def worker(out_dir: str) -> None:
    """One of two tensor-parallel ranks of a one-stage pipeline."""
    import torch.distributed as dist

    from perseus_ext.runtime import PerseusRuntime

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    profile = str(Path(out_dir) / "profile.csv")
    runtime = PerseusRuntime(make_config(profile_path=profile), schedule=build_schedule("1f1b", 1, 4), stage=0,
                             gpu=sim_gpu(seed=rank))
    train(runtime, 30, seed=rank)
    runtime.close()
    summary = runtime.summary()
    summary["gpus_per_stage"] = runtime.comm.gpus_per_stage
    summary["frontier_blocking_power_w"] = runtime.frontier.blocking_power if runtime.frontier else None
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(summary))
    dist.destroy_process_group()


def test_a_tensor_parallel_stage_is_planned_as_one_stage_of_two_gpus(tmp_path):
    summaries = run_gloo_job(__file__, tmp_path, 2, WORKER_TIMEOUT_S)
    idle_w = 83.64  # the simulated A100's blocking power per GPU
    for summary in summaries:
        assert summary["gpus_per_stage"] == 2 and summary["final_phase"] == "deployed"
        # One stage of two GPUs blocks at about twice one GPU's power. It is estimated while
        # profiling (a few noisy counter windows per clock), so only its scale is checked here;
        # the exact sum is test_assembly_adds_up_the_gpus_of_a_stage's.
        assert 1.2 * idle_w < summary["frontier_blocking_power_w"] < 3 * idle_w
    sidecar = json.loads((tmp_path / "profile.csv.json").read_text())
    assert sidecar["gpus_per_stage"] == 2
    stage_w = summaries[0]["frontier_blocking_power_w"]
    assert sidecar["blocking_power_w"] == pytest.approx(stage_w / 2)  # saved per GPU


if __name__ == "__main__":
    worker(sys.argv[1])
