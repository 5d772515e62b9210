"""The control plane's groups and message counts on a real gloo job: PP=2 x TP=2 x DP=2 (8 ranks).

Job-wide reductions and straggler checks run within a rank's pipeline (PP x TP ranks) and among
its data-parallel peers (DP ranks), never on the world group after set-up. A straggler check
started at one iteration boundary is collected at later ones: starting it never waits for the
other ranks, and a deployment starts each check three boundaries before the one where its
plan switches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from control_plane_worker import DP, LATE_S, TP, WORLD  # noqa: E402
from control_plane_worker import layout as _layout  # noqa: E402
from runtime_helpers import make_config, run_gloo_job, sim_gpu, train  # noqa: E402

TIMEOUT_S = 240
WORKER = Path(__file__).resolve().parent / "control_plane_worker.py"


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[dict]:
    return run_gloo_job(str(WORKER), tmp_path_factory.mktemp("control-plane"), WORLD, TIMEOUT_S)


def test_groups_are_the_pipeline_and_the_data_parallel_peers(job):
    for rank, result in enumerate(job):
        pipeline, stage, slot = _layout(rank)
        assert result["pipeline"] == pipeline and result["gpus_per_stage"] == TP
        assert result["pipeline_members"] == [r for r in range(WORLD) if _layout(r)[0] == pipeline]
        assert result["peers"] == [r for r in range(WORLD) if _layout(r)[1:] == (stage, slot)]


def test_job_wide_results_from_two_small_reductions(job):
    for result in job:
        assert result["total"] == WORLD and result["lowest"] == 0.0
        mine, normal, slowest, factor, announced, wait_noise = result["straggler"]
        pipeline_time = [max(0.1 + 0.01 * r for r in range(WORLD) if _layout(r)[0] == p) for p in range(DP)]
        assert mine == pytest.approx(pipeline_time[result["pipeline"]])
        assert normal == pytest.approx(min(pipeline_time)) and slowest == pytest.approx(max(pipeline_time))
        assert factor == 1.0 and announced == 0.0  # rank 5's announcement reaches every rank
        # the wait noise stays within the pipeline: its noisiest rank's, not the job's
        assert wait_noise == pytest.approx(max(0.001 * r for r in range(WORLD) if _layout(r)[0] == result["pipeline"]))


def test_message_counts_per_rank(job):
    for result in job:
        assert result["setup"] == {}  # membership is learnt with plain torch.distributed calls
        stats = result["stats"]
        # all_sum + all_min: one reduction in each group each; each straggler check: one more each.
        assert stats["pipeline collectives"] == 4 and stats["peers collectives"] == 4
        assert stats["pipeline payload bytes"] == (1 + 1 + 4 + 4) * 8 and stats["peers payload bytes"] == (1 + 1 + 4 + 4) * 8
        assert "world collectives" not in stats


def test_close_destroys_the_control_planes_groups_and_joins_their_threads(job):
    # A gloo group left to interpreter exit can abort the process after training (exit -6).
    # This rank is in three of the control plane's groups: the world, its pipeline, its peers.
    for result in job:
        groups_before, groups_after = result["closed"]["groups"]
        threads_before, threads_after = result["closed"]["threads"]
        assert groups_after == groups_before - 3
        assert threads_after <= threads_before - 3  # at least gloo's transport loop per group
        assert result["closed"]["sum_after"] == 1.0  # a closed control plane is local


def test_close_waits_briefly_for_a_collective_in_flight_and_leaves_groups_it_never_sees_finish():
    """Destroying joins gloo's threads, which would wait for a peer that never came; a check in
    flight that every rank issued gets a moment to finish first."""
    import datetime

    from perseus_ext.runtime import comm as comm_module
    from perseus_ext.runtime.comm import ControlPlane

    class Work:
        def __init__(self, finishes_in_s: float | None) -> None:
            self.finishes_in_s, self.done = finishes_in_s, finishes_in_s == 0

        def is_completed(self) -> bool:
            return self.done

        def wait(self, timeout: datetime.timedelta) -> bool:
            if self.finishes_in_s is None or self.finishes_in_s > timeout.total_seconds():
                raise RuntimeError("timed out")  # what gloo's Work.wait(timeout) does
            self.done = True
            return True

    class Dist:
        def __init__(self) -> None:
            self.destroyed: list[str] = []

        def destroy_process_group(self, group: str) -> None:
            self.destroyed.append(group)

    everything = ["world", "pipeline", "peers"]
    for finishes_in_s, destroyed in ((0, everything), (0.1, everything), (comm_module.CLOSE_WAIT_S + 1, []),
                                     (None, [])):
        comm, dist = ControlPlane(stage=0), Dist()
        comm._dist, comm._world, comm._pipeline_group, comm._peer_group = dist, *everything
        comm._started(Work(finishes_in_s=0))
        comm._started(Work(finishes_in_s=finishes_in_s))
        comm.close()
        assert dist.destroyed == destroyed, finishes_in_s
        assert not comm.distributed


def test_a_straggler_check_starts_without_waiting_for_the_other_ranks(job):
    for rank, result in enumerate(job):
        started = result["started_without_waiting"]
        first, second = started["steps"]
        assert first is None and second == pytest.approx(result["straggler"])  # the blocking check's result
        if rank != 0:  # rank 0 started a second late; nobody waited for it at the start
            assert started["start_s"] < LATE_S / 4, started


def test_a_deployment_starts_each_check_three_boundaries_before_its_plan_switch():
    from perseus_ext.planning.schedule import build_schedule
    from perseus_ext.runtime import Phase, PerseusRuntime

    interval = 5
    runtime = PerseusRuntime(make_config(straggler_check_interval=interval), schedule=build_schedule("1f1b", 1, 4),
                             stage=0, gpu=sim_gpu())
    try:
        while runtime.phase is not Phase.DEPLOYED:
            train(runtime, 1)
        deployed_at = runtime.deployment.switches[0].iteration
        runtime.announce_slowdown(1.3)  # read by checks starting at deployed iterations 2 and 7
        train(runtime, 2 * interval)
        slowed = [s for s in runtime.deployment.switches if s.factor > 1.0]
        # the second check confirms it; its plan switches on the check boundary, as a blocking check's would
        assert [s.iteration for s in slowed] == [deployed_at + 2 * interval], runtime.deployment.switches
        assert slowed[0].factor == pytest.approx(1.3, rel=0.1)
        train(runtime, 3)
        # iterations are recorded with the factor of the plan they ran, never the next check's
        slowed_iterations = [r.iteration for r in runtime.history if (r.setting.factor or 1.0) > 1.0]
        assert slowed_iterations and min(slowed_iterations) == slowed[0].iteration + 1
        runtime.announce_slowdown(None)  # after the next check started (deployed iteration 12): it still sees it
        train(runtime, 2)
        assert runtime.deployment.switches[-1] is slowed[0]
        train(runtime, interval)  # the one after recovers, which needs no confirmation
        assert runtime.deployment.switches[-1].factor == 1.0
        assert runtime.deployment.switches[-1].iteration == deployed_at + 4 * interval
    finally:
        runtime.close()
