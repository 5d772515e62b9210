"""The control plane's groups and message counts on a real gloo job: PP=2 x TP=2 x DP=2 (8 ranks).

Job-wide reductions and straggler checks run within a rank's pipeline (PP x TP ranks) and among
its data-parallel peers (DP ranks), never on the world group after set-up.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_helpers import run_gloo_job  # noqa: E402

PP, TP, DP = 2, 2, 2
WORLD = PP * TP * DP
TIMEOUT_S = 240


def _layout(rank: int) -> tuple[int, int, int]:
    """(pipeline, stage, tensor-parallel slot) of a global rank: pipeline-major, then stage."""
    return rank // (PP * TP), (rank // TP) % PP, rank % TP


def worker(out_dir: str) -> None:
    import torch.distributed as dist

    from perseus_ext.runtime.comm import ControlPlane

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    pipeline, stage, slot = _layout(rank)
    dp_groups = {}
    for key_stage in range(PP):
        for key_slot in range(TP):
            ranks = [p * PP * TP + key_stage * TP + key_slot for p in range(DP)]
            dp_groups[key_stage, key_slot] = dist.new_group(ranks=ranks, backend="gloo")
    comm = ControlPlane(stage=stage, dp_group=dp_groups[stage, slot], timeout_s=60)
    setup = dict(comm.stats)
    total = comm.all_sum([1.0])[0]
    lowest = comm.all_min([float(rank)])[0]
    own = 0.1 + 0.01 * rank  # this rank's compute time; the pipeline's is its slowest stage's
    mine, normal, slowest, factor, announced = comm.straggler_exchange(own, 1.0 if rank == 5 else 0.0, 0.0)
    result = {
        "pipeline": comm.pipeline, "gpus_per_stage": comm.gpus_per_stage, "peers": comm.peer_ranks,
        "pipeline_members": sorted(m.rank for m in comm.pipeline_members), "setup": setup,
        "stats": dict(comm.stats), "total": total, "lowest": lowest,
        "straggler": [mine, normal, slowest, factor, announced],
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[dict]:
    return run_gloo_job(__file__, tmp_path_factory.mktemp("control-plane"), WORLD, TIMEOUT_S)


def test_groups_are_the_pipeline_and_the_data_parallel_peers(job):
    for rank, result in enumerate(job):
        pipeline, stage, slot = _layout(rank)
        assert result["pipeline"] == pipeline and result["gpus_per_stage"] == TP
        assert result["pipeline_members"] == [r for r in range(WORLD) if _layout(r)[0] == pipeline]
        assert result["peers"] == [r for r in range(WORLD) if _layout(r)[1:] == (stage, slot)]


def test_job_wide_results_from_two_small_reductions(job):
    for result in job:
        assert result["total"] == WORLD and result["lowest"] == 0.0
        mine, normal, slowest, factor, announced = result["straggler"]
        pipeline_time = [max(0.1 + 0.01 * r for r in range(WORLD) if _layout(r)[0] == p) for p in range(DP)]
        assert mine == pytest.approx(pipeline_time[result["pipeline"]])
        assert normal == pytest.approx(min(pipeline_time)) and slowest == pytest.approx(max(pipeline_time))
        assert factor == 1.0 and announced == 0.0  # rank 5's announcement reaches every rank


def test_message_counts_per_rank(job):
    for result in job:
        assert result["setup"] == {}  # membership is learnt with plain torch.distributed calls
        stats = result["stats"]
        # all_sum + all_min: one reduction in each group each; the straggler check: one more each.
        assert stats["pipeline collectives"] == 3 and stats["peers collectives"] == 3
        assert stats["pipeline payload bytes"] == (1 + 1 + 3) * 8 and stats["peers payload bytes"] == (1 + 1 + 4) * 8
        assert "world collectives" not in stats


if __name__ == "__main__":
    worker(sys.argv[1])
