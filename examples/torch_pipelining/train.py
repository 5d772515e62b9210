"""A plain torch.distributed.pipelining training script; perseus-ext is one `enable()` call.

    torchrun --nproc_per_node 2 examples/torch_pipelining/train.py --config examples/torch_pipelining/perseus.json

Each rank builds its stages of a small MLP (one Linear + Tanh per pipeline stage), a stock
torch schedule (`--schedule`, any class in docs/torch-pipelining.md) and an SGD optimizer, then
`perseus_ext.torch_pipelining.enable(schedule, config)`. With 4 ranks and `--data-parallel 2`
two pipelines train replicas of the model; their gradients are averaged over the data-parallel
group after each step, and perseus-ext compares the pipelines for stragglers over that group.
`"gpu": "sim:a100_sxm"` simulates A100s so this runs on a CPU-only machine; on real GPUs set
`"gpu": "nvml"` and drop `"simulated_workload"`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import pipelining

from perseus_ext.torch_pipelining import enable

WIDTH = 16
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
SINGLE = ("Schedule1F1B", "ScheduleGPipe")


def stage_indices(schedule_class: str, rank: int, ranks: int, chunks: int) -> list[int]:
    """The model slices (stage_index) this pipeline rank holds: one, looped (rank + k x ranks)
    or V-shaped (rank on the way down, 2 x ranks - 1 - rank on the way up)."""
    if schedule_class in SINGLE:
        return [rank]
    if schedule_class in V_SHAPED:
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(chunks)]


def slices_of(schedule_class: str, ranks: int, chunks: int) -> int:
    """How many slices (pipeline stages) the model is cut into."""
    return ranks * (1 if schedule_class in SINGLE else 2 if schedule_class in V_SHAPED else chunks)


def build(args: argparse.Namespace, pp_group: dist.ProcessGroup, pp_rank: int, pp_size: int):
    indices = stage_indices(args.schedule, pp_rank, pp_size, args.chunks)
    num_slices = slices_of(args.schedule, pp_size, args.chunks)
    torch.manual_seed(1234)
    slices = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(num_slices)]
    modules = [slices[i] for i in indices]
    stages = [pipelining.PipelineStage(slices[i], i, num_slices, torch.device("cpu"), group=pp_group)
              for i in indices]
    loss_fn = torch.nn.MSELoss()
    schedule_class = getattr(pipelining, args.schedule)
    if args.schedule in SINGLE:
        schedule = schedule_class(stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn)
    else:
        schedule = schedule_class(stages, n_microbatches=args.microbatches, loss_fn=loss_fn)
    return modules, schedule


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--config", required=True, help="JSON file with a \"perseus\" section")
    parser.add_argument("--schedule", default="Schedule1F1B", help="a torch.distributed.pipelining schedule class")
    parser.add_argument("--chunks", type=int, default=2, help="stages per rank of looped schedules")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=80)
    parser.add_argument("--data-parallel", type=int, default=1)
    return parser


@dataclass
class Job:
    """What one rank trains: its pipeline and groups, its modules and schedule, perseus-ext's handle."""

    rank: int
    pipeline: int
    dp_group: dist.ProcessGroup
    modules: list[torch.nn.Module]
    schedule: Any
    perseus: Any = None
    losses: list[float] = field(default_factory=list)


def run(args: argparse.Namespace, *, after_build: Callable[[Job], None] | None = None,
        before_step: Callable[[Job, int], None] | None = None) -> Job:
    """Train `args.iterations` steps; `after_build` sees the schedule before perseus-ext is
    enabled, `before_step` each iteration (the tests' fault and straggler injection)."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.data_parallel:
        parser().error(f"--data-parallel {args.data_parallel} does not divide the {world} ranks")
    pp_size = world // args.data_parallel
    pp_groups = [dist.new_group(list(range(p * pp_size, (p + 1) * pp_size))) for p in range(args.data_parallel)]
    dp_groups = [dist.new_group(list(range(s, world, pp_size))) for s in range(pp_size)]
    pipeline, pp_rank = divmod(rank, pp_size)
    pp_group, dp_group = pp_groups[pipeline], dp_groups[pp_rank]

    modules, schedule = build(args, pp_group, pp_rank, pp_size)
    job = Job(rank, pipeline, dp_group, modules, schedule)
    if after_build is not None:
        after_build(job)
    job.perseus = enable(schedule, args.config, dp_group=dp_group if args.data_parallel > 1 else None)

    parameters = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.SGD(parameters, lr=0.01)
    generator = torch.Generator().manual_seed(pipeline)
    batch = args.microbatches * 2
    data = [(torch.randn(batch, WIDTH, generator=generator), torch.randn(batch, WIDTH, generator=generator))
            for _ in range(8)]
    indices = stage_indices(args.schedule, pp_rank, pp_size, args.chunks)
    is_first, is_last = 0 in indices, max(indices) == slices_of(args.schedule, pp_size, args.chunks) - 1
    for iteration in range(args.iterations):
        if before_step is not None:
            before_step(job, iteration)
        inputs, targets = data[iteration % len(data)]
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        step_args = (inputs,) if is_first else ()
        schedule.step(*step_args, target=targets if is_last else None, losses=losses if is_last else None)
        if args.data_parallel > 1:  # the replicas' gradients averaged, as DDP would
            for p in parameters:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=dp_group)
                    p.grad.div_(args.data_parallel)
        optimizer.step()
        if losses:
            job.losses.append(float(torch.stack(losses).detach().mean()))
        if rank == 0 and losses and iteration % 10 == 0:
            print(f"iteration {iteration}: loss {job.losses[-1]:.6f}", flush=True)
    job.perseus.close()  # restores clocks and logs perseus-ext's summary
    return job


def main() -> None:
    run(parser().parse_args())
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
