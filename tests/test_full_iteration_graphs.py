"""Full-iteration CUDA graphs: the runtime driven by the replay itself, one call per iteration,
deploying stage-constant plans set between replays (runtime `whole_iterations`,
planning/stage_constant.py).

On CPU the replay is simulated: the paced simulated GPU runs the iteration's work (every
forward and backward of the stage, with its pipeline dependencies) when the replay is launched,
asynchronously, as a CUDA graph replay runs on a real device; no per-computation hook runs.
The straggler job runs 2 pipelines x 2 stages as four gloo ranks, pipeline 1's GPUs 1.25x slow.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from runtime_helpers import STAGE_BACKWARD_S, STAGE_FORWARD_S, make_config, run_gloo_job, sim_gpu, stage_profile  # noqa: E402

from perseus_ext.planning.schedule import build_schedule
from perseus_ext.planning.stage_constant import is_stage_constant
from perseus_ext.runtime import PerseusRuntime
from perseus_ext.observability.phase import Phase

FORWARD_S, BACKWARD_S = STAGE_FORWARD_S, STAGE_BACKWARD_S
STRAGGLER_SLOWDOWN = 1.25
WORKER_TIMEOUT_S = 240


def replay(runtime: PerseusRuntime, iterations: int) -> None:
    """What the adapter does around megatron-core's FullCudaGraphWrapper call: one iteration per
    call, no hook inside it (the replay's work is launched by the simulated device)."""
    for _ in range(iterations):
        runtime.iteration_start()
        runtime.gpu.wait(0.003)  # the host's share of the call (data copy into the static buffers)
        runtime.iteration_end()


def config(stages: int = 2, **overrides):
    if "profile_path" in overrides:  # a saved profile carries no blocking power: give the GPU's idle draw
        overrides.setdefault("blocking_power_w", sim_gpu().preset.idle_power_w)
    return make_config(simulated_workload={"forward_seconds": list(FORWARD_S[:stages]),
                                           "backward_seconds": list(BACKWARD_S[:stages])}, **overrides)


def test_a_full_iteration_graph_job_deploys_a_stage_constant_plan_between_replays(tmp_path):
    gpu = sim_gpu()
    schedule = build_schedule("1f1b", 1, 4)  # one process: a one-stage pipeline (more in the gloo job below)
    profile = stage_profile(tmp_path / "profile.csv", gpu, 1)
    runtime = PerseusRuntime(config(1, profile_path=profile, baseline_fraction=0.0), schedule=schedule, stage=0,
                             gpu=gpu, whole_iterations=True)
    replay(runtime, 12)
    assert runtime.phase is Phase.DEPLOYED and runtime.fallback_reason is None
    assert runtime.profiling_iterations == 0  # solved from the saved profile: no per-computation hooks
    assert all(is_stage_constant(plan) for plan in runtime.frontier.plans)
    runtime.controller.flush(5.0)
    locked = [c for c in gpu.clock_history if c is not None]
    assert locked and set(locked) <= {int(p.frequencies[0][0]) for p in runtime.frontier.plans}
    runtime.announce_slowdown(1.3)  # the cluster manager says another pipeline is 1.3x slower
    replay(runtime, 2 * runtime.config.straggler_check_interval + 3)
    switches = runtime.summary()["plan_switches"]
    assert switches and switches[-1]["factor"] > 1.0 and switches[-1]["plan_time_s"] > runtime.frontier.fastest.time
    assert is_stage_constant(runtime.plan)
    runtime.close()
    assert gpu.locked_clock is None
    summary = runtime.summary()
    assert summary["silent_hooks"]["episodes"] == [] and summary["deployed"]["iterations"] > 0


def test_without_a_saved_profile_full_iteration_graphs_stay_at_default_clocks(caplog):
    gpu = sim_gpu()
    runtime = PerseusRuntime(config(1), schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=gpu, whole_iterations=True)
    replay(runtime, 5)
    assert runtime.phase is Phase.OBSERVING and runtime.fallback_reason is None
    assert "cannot be profiled one by one" in caplog.text
    assert all(c is None for c in gpu.clock_history)
    runtime.close()


# --------------------------------------------------------------------------- 2 pipelines x 2 stages
def worker(out_dir: str) -> None:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pipeline, stage = divmod(rank, 2)
    dp_groups = [dist.new_group([s, 2 + s]) for s in range(2)]
    pp_groups = [dist.new_group([2 * p, 2 * p + 1]) for p in range(2)]
    gpu = sim_gpu(seed=rank)
    if pipeline == 1:
        gpu.slowdown = STRAGGLER_SLOWDOWN
    schedule = build_schedule("1f1b", 2, 4)
    runtime = PerseusRuntime(
        config(profile_path=str(Path(out_dir) / "profile.csv"), straggler_check_interval=2, baseline_fraction=0.0),
        schedule=schedule, stage=stage, gpu=gpu, dp_group=dp_groups[stage], pp_group=pp_groups[pipeline],
        whole_iterations=True)
    replay(runtime, 30)
    runtime.close()
    summary = runtime.summary()
    result = {
        "pipeline": pipeline, "stage": stage, "phase": runtime.phase.value, "fallback": runtime.fallback_reason,
        "switches": summary["plan_switches"], "clocks": sorted({c for c in gpu.clock_history if c is not None}),
        "stage_constant": all(is_stage_constant(p) for p in runtime.frontier.plans) if runtime.frontier else None,
        "restored": gpu.locked_clock is None,
        "compute_s": [r.compute_s for r in runtime.history if r.setting.plan is not None][-6:],
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_full_iteration_graph_job_adapts_its_stage_constant_plan_to_a_straggler(tmp_path):
    stage_profile(tmp_path / "profile.csv", sim_gpu(), 2)
    ranks = run_gloo_job(__file__, tmp_path, 4, WORKER_TIMEOUT_S)
    for rank in ranks:
        assert rank["phase"] == "deployed" and rank["fallback"] is None and rank["stage_constant"], rank
        assert rank["restored"]
    healthy = [r for r in ranks if r["pipeline"] == 0]
    straggling = [r for r in ranks if r["pipeline"] == 1]
    assert len(healthy) == len(straggling) == 2, [r["pipeline"] for r in ranks]  # 2 pipelines x 2 stages
    for rank in healthy:  # moved to a slower stage-constant plan that about meets the straggler
        slowed = [s for s in rank["switches"] if s["factor"] > 1.1]
        assert slowed, rank["switches"]
        # Any return to the fastest plan while the straggler lasts comes from the pipeline's own
        # wait at the gradient sync: the slowed plan ends a few ms before the straggler, within a
        # loaded host's jitter, so an iteration can find this pipeline the slowest (energy, never time).
        returns = [s for s in rank["switches"] if s["iteration"] > slowed[0]["iteration"] and s["factor"] == 1.0]
        assert all(s["reason"].startswith("this pipeline became the slowest") for s in returns), rank["switches"]
    for rank in straggling:  # the straggler keeps its fastest plan (deployed, never slowed)
        factors = [s["factor"] for s in rank["switches"]]
        assert factors and set(factors) == {1.0}, rank["switches"]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    worker(sys.argv[1])
