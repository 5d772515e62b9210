"""One torchrun rank of the torch.distributed.pipelining tests: the example script's training
(examples/torch_pipelining/train.py, imported, not copied) plus what the tests inject and read.

    --result DIR                 each rank writes DIR/rank-N.json (summary, graph, clocks restored)
    --forge-pipeline-order       swap rank 0's first two listed actions after the schedule is built
                                 (what runs is unchanged): perseus-ext must refuse the mismatch
    --straggler ITERATION FACTOR the last pipeline's simulated GPUs run FACTOR slower from ITERATION on
    --raise-at ITERATION         the script dies with an exception before that step; clocks must
                                 still be restored (interpreter exit closes perseus-ext)
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_pipelining" / "train.py"


def _example():
    spec = importlib.util.spec_from_file_location("torch_pipelining_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


class InjectedFailure(RuntimeError):
    """The failure `--raise-at` injects."""


def main() -> None:
    example = _example()
    parser = example.parser()
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--forge-pipeline-order", action="store_true")
    parser.add_argument("--straggler", nargs=2, type=float, metavar=("ITERATION", "FACTOR"))
    parser.add_argument("--raise-at", type=int)
    args = parser.parse_args()
    args.result.mkdir(parents=True, exist_ok=True)

    def forge(job) -> None:
        order = job.schedule.pipeline_order[0]
        listed = [i for i, action in enumerate(order) if action is not None]
        first, second = listed[0], listed[1]
        order[first], order[second] = order[second], order[first]

    def before_step(job, iteration: int) -> None:
        runtime = job.perseus.runtime
        if args.raise_at is not None and iteration == args.raise_at:
            _write(args.result, job, failed_at=iteration)
            raise InjectedFailure(f"injected failure before step {iteration}")
        if args.straggler and runtime is not None and job.pipeline == args.data_parallel - 1:
            start, factor = args.straggler
            runtime.gpu.slowdown = factor if iteration >= start else 1.0

    job = example.run(args, after_build=forge if args.forge_pipeline_order else None, before_step=before_step)
    _write(args.result, job)
    import torch.distributed as dist

    dist.destroy_process_group()


def _planned_clocks(runtime) -> list[int] | None:
    """The deployed plan's clock of each action of this rank, in `planned_order` (None undeployed)."""
    if runtime is None or runtime.deployment is None:
        return None
    return list(runtime.deployment.stage_clocks(runtime.stage))


def _write(result: Path, job, *, failed_at: int | None = None) -> None:
    perseus = job.perseus
    gpu = perseus.runtime.gpu if perseus.runtime is not None else None
    record = {
        "rank": job.rank, "pipeline": job.pipeline, "summary": perseus.summary(), "losses": job.losses,
        "clocks_restored": gpu is None or gpu.locked_clock is None, "failed_at": failed_at,
        "graph_orders": [[str(c) for c in order] for order in perseus.graph.orders] if perseus.graph else None,
        "planned_order": [str(c) for c in perseus.runtime.order] if perseus.runtime is not None else None,
        "planned_clocks": _planned_clocks(perseus.runtime),
    }
    (result / f"rank-{job.rank}.json").write_text(json.dumps(record, default=str), encoding="utf-8")


if __name__ == "__main__":
    main()
