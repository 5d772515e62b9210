"""One rank of test_control_plane.py's gloo job: PP=2 x TP=2 x DP=2 (8 ranks).

    RANK=r WORLD_SIZE=8 MASTER_ADDR=... MASTER_PORT=... python tests/control_plane_worker.py OUT_DIR

Builds the control plane the runtime builds, runs its reductions and straggler checks, closes it
and writes what it saw to OUT_DIR/rank<r>.json. It imports only torch.distributed and the control
plane (not the runtime, not pytest): eight ranks start on two cores, and each one's imports are
paid eight times.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

PP, TP, DP = 2, 2, 2
WORLD = PP * TP * DP
LATE_S = 1.0  # how late rank 0 starts the non-blocking straggler check


def layout(rank: int) -> tuple[int, int, int]:
    """(pipeline, stage, tensor-parallel slot) of a global rank: pipeline-major, then stage."""
    return rank // (PP * TP), (rank // TP) % PP, rank % TP


def _threads() -> int:
    """This process's threads, C++ ones included (gloo's workers and transport loop)."""
    return len(os.listdir("/proc/self/task"))


def worker(out_dir: str) -> None:
    import torch.distributed as dist

    from perseus_ext.runtime.comm import ControlPlane, StragglerExchange

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    pipeline, stage, slot = layout(rank)
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
    noise = 0.001 * rank  # this rank's spread of waits at the gradient sync; the pipeline's is its noisiest rank's
    mine, normal, slowest, factor, announced, wait_noise = comm.straggler_exchange(own, 1.0 if rank == 5 else 0.0, 0.0,
                                                                                   noise)
    if rank == 0:
        time.sleep(LATE_S)
    started = time.perf_counter()
    exchange = StragglerExchange(comm, own, 1.0 if rank == 5 else 0.0, 0.0, noise)
    start_s = time.perf_counter() - started
    steps = [exchange.advance(), exchange.advance()]  # two later iteration boundaries
    result = {
        "pipeline": comm.pipeline, "gpus_per_stage": comm.gpus_per_stage, "peers": comm.peer_ranks,
        "pipeline_members": sorted(m.rank for m in comm.pipeline_members), "setup": setup,
        "stats": dict(comm.stats), "total": total, "lowest": lowest,
        "straggler": [mine, normal, slowest, factor, announced, wait_noise],
        "started_without_waiting": {"start_s": start_s, "steps": [list(s) if s else None for s in steps]},
    }
    groups_before, threads_before = len(dist.distributed_c10d._world.pg_map), _threads()
    comm.close()
    comm.close()  # idempotent
    result["closed"] = {"groups": [groups_before, len(dist.distributed_c10d._world.pg_map)],
                        "threads": [threads_before, _threads()], "sum_after": comm.all_sum([1.0])[0]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1])
