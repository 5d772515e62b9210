"""A straggler's recovery end to end: two real `PerseusRuntime`s over gloo (one stage each, two
data-parallel pipelines) on paced simulated GPUs whose devices wait for each other at the
gradient sync; pipeline 1 straggles (1.3x) and recovers.

* The training thread never waits for a device record: at each held iteration's end the rank
  has not got that iteration's record yet (the device still runs it), where a host wait would
  always have it, and the hooks return within milliseconds.
* With the rendezvous store, the straggler's ranks post its recovery during its first recovered
  iteration and the slowed pipeline switches within it (its compute in that iteration is shorter
  than its slowed plan's); the verdict from the slowed pipeline's own wait is switched off in
  this case, so the post alone tells. Without a store (every call fails), its own wait at the
  gradient sync tells, at the recovered iteration's end at the latest -- a host descheduled on
  this crowded machine shortens a wait and may make it tell earlier, a return the hysteresis
  takes back at the next checks --: either way every iteration after the recovered one runs the
  fastest plan's clocks on the device, and the plan returns by the next boundary.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
from runtime_helpers import make_config, model_profile, run_gloo_job, sim_gpu

from perseus_ext.measurement.gpu.timeline_factory import gpu_switch_latency
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.runtime import PerseusRuntime

# Computations long enough that a host descheduled for ~10 ms on this crowded machine (which
# shortens a rank's wait at the gradient sync) stays well inside the straggler's lead.
FORWARD_S, BACKWARD_S = 0.015, 0.030
SLOWDOWN = 1.3
STRAGGLER = range(8, 22)  # the iterations pipeline 1 runs slowed
ITERATIONS = 32
WORKER_TIMEOUT_S = 240


class BrokenStore:
    """A rendezvous store every call of which fails (unreachable)."""

    def __getattr__(self, name: str):
        def fail(*args, **kwargs):
            raise ConnectionError("store unreachable")
        return fail


def run_case(out_dir: str, rank: int, case: str) -> dict:
    import perseus_ext.runtime.comm as comm
    from perseus_ext.runtime.straggler import RecoveryWatch

    original = comm.ControlPlane.store
    if case == "no store":
        comm.ControlPlane.store = lambda self: BrokenStore()
    else:
        RecoveryWatch.became_slowest = lambda self, wait_s, planned_extra_s: False
    gpu = sim_gpu(seed=rank)
    profile = model_profile(Path(out_dir) / f"profile-{rank}.csv", gpu, FORWARD_S, BACKWARD_S)
    config = make_config(profile_path=profile, blocking_power_w=gpu.preset.idle_power_w, straggler_check_interval=2,
                         baseline_fraction=0.0,
                         simulated_workload={"forward_seconds": FORWARD_S, "backward_seconds": BACKWARD_S})
    import torch.distributed as dist

    runtime = PerseusRuntime(config, schedule=build_schedule("1f1b", 1, 4), stage=0, dp_group=dist.group.WORLD, gpu=gpu)
    comm.ControlPlane.store = original
    rows = []
    for iteration in range(ITERATIONS):
        if rank == 1:
            gpu.slowdown = SLOWDOWN if iteration in STRAGGLER else 1.0
        held = runtime.deployment is not None and runtime.deployment.episode is not None
        began = time.perf_counter()
        runtime.iteration_start()
        start_s = time.perf_counter() - began
        for computation in runtime.order:
            runtime.before_computation(computation.kind, computation.microbatch)
            runtime.after_computation(computation.kind, computation.microbatch)
        runtime.mark_compute_end()
        began = time.perf_counter()
        runtime.iteration_end()
        end_s = time.perf_counter() - began
        latest = max((r.iteration for r in runtime.history), default=-1)
        rows.append({"iteration": iteration, "held": held, "start_s": start_s, "end_s": end_s, "latest": latest})
    runtime.close()
    return {
        "rows": rows,
        "switches": [[s.iteration, s.plan, s.factor, s.reason] for s in runtime.deployment.switches],
        "records": {r.iteration: [r.setting.plan, r.compute_s] for r in runtime.history},
        "plan_times": [p.time for p in runtime.frontier.plans],
        "posted": runtime.recovery_signal.posted, "failure": runtime.recovery_signal.failure,
    }


def worker(out_dir: str) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    results = {case: run_case(out_dir, rank, case) for case in ("no store", "store")}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[dict]:
    return run_gloo_job(__file__, tmp_path_factory.mktemp("recovery"), 2, WORKER_TIMEOUT_S)


@pytest.mark.distributed
def test_held_iterations_never_wait_for_their_device_record(job):
    held = [row for case in ("store", "no store") for row in job[0][case]["rows"] if row["held"]]
    assert len(held) >= 6, job[0]["store"]["switches"]
    # A host wait would always have the iteration's own record at its end; the device is still
    # running it (and waiting for the straggler at the gradient sync) when the hook returns.
    own_record_in = [row for row in held if row["latest"] >= row["iteration"]]
    assert len(own_record_in) <= len(held) // 5, own_record_in
    assert statistics.median(row["end_s"] for row in held) < 0.005
    assert statistics.median(row["start_s"] for row in held) < 0.005


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["store", "no store"])
def test_every_iteration_after_the_recovered_one_runs_the_fastest_plan(job, case):
    pipeline0, pipeline1 = job[0][case], job[1][case]
    assert [s[1] for s in pipeline1["switches"]] == [0]  # the straggler keeps its fastest plan
    switches = pipeline0["switches"]
    slowed = [s for s in switches if s[2] > 1.0]
    assert slowed and STRAGGLER.start < slowed[0][0] < STRAGGLER.stop, switches
    recovered = STRAGGLER.stop  # pipeline 1's first iteration at full speed
    last = switches[-1]  # the plan in force from the boundary after the recovered iteration on
    assert last[1] == 0 and last[2] == 1.0 and last[0] <= recovered + 1, switches
    records = {int(k): v for k, v in pipeline0["records"].items()}
    fastest = pipeline0["plan_times"][0]
    # On the device: the iteration after the recovered one runs the fastest plan's clocks once
    # the override's first change lands (launched at the slowed plan when the verdict comes only
    # as the recovered iteration ends: a clock change's latency at the slowed clock, less than
    # half of it lost for a slowdown under 2x), and every later one the fastest plan's time.
    # (A compute time counts from the iteration's start marker: a host descheduled before it
    # launches the first computation adds its delay, hence most iterations, not all, within 3 %.)
    latency = gpu_switch_latency(sim_gpu())
    landing_s = latency.issue_to_change_s + latency.transition_s
    assert records[recovered + 1][1] < fastest + landing_s / 2, records[recovered + 1]
    after = [records[i][1] for i in range(recovered + 2, ITERATIONS - 1) if i in records]
    assert len(after) >= 6 and statistics.median(after) < fastest * 1.01, after
    assert sum(compute < fastest * 1.03 for compute in after) >= 0.8 * len(after), after


@pytest.mark.distributed
def test_the_stragglers_post_switches_the_slowed_pipeline_within_the_recovered_iteration(job):
    pipeline0, pipeline1 = job[0]["store"], job[1]["store"]
    recovered = STRAGGLER.stop
    assert pipeline0["failure"] is None and pipeline1["posted"] and pipeline1["posted"][-1].endswith(f":{recovered}:recovered")
    back = pipeline0["switches"][-1]
    assert back[0] == recovered + 1 and "its post" in back[3] and f"iteration {recovered}" in back[3], back
    records = {int(k): v for k, v in pipeline0["records"].items()}
    slowed_plan, compute_s = records[recovered]
    assert slowed_plan != 0 and compute_s < pipeline0["plan_times"][slowed_plan] * 0.97  # switched within it
    assert records[recovered + 1][1] < pipeline0["plan_times"][0] * 1.03  # launched slowed, ran fast


@pytest.mark.distributed
def test_without_a_store_the_slowed_pipelines_own_wait_tells(job):
    pipeline0, pipeline1 = job[0]["no store"], job[1]["no store"]
    assert "ConnectionError" in pipeline0["failure"] and not pipeline1["posted"]
    assert "became the slowest" in pipeline0["switches"][-1][3]


if __name__ == "__main__":
    worker(sys.argv[1])
