"""One gloo rank of a megatron-core combined_1f1b job under perseus-ext (`python megatron_combined_worker.py OUT`).

Run by tests/test_megatron_combined_gloo.py through `runtime_helpers.run_gloo_job` (RANK,
WORLD_SIZE, MASTER_* set). megatron-core's own parallel state (PP = world size, 2 virtual stages),
its P2P communication over gloo, its interleaved schedule from `get_forward_backward_func()` and
its `combined_1f1b_schedule_for_interleaved_pipelining` run unchanged, with the model config's
`overlap_moe_expert_parallel_comm` set; the combined step's model work and the CUDA streams are
tests/megatron_shims.py's CPU stand-ins, CUDA tensor factories go to the CPU
(examples/megatron_gpt3/cpu_shims.py). Each model chunk is a small linear layer.

The job trains twice in the same processes, side by side in time: `--perseus` (profile, solve,
deploy, with baseline probes) and its twin `--perseus --perseus-mode observe` (default clocks),
both on paced simulated A100s. Two virtual stages on two GPUs leave every unit on the critical
path at the all-max-clock time (no intrinsic saving), so after the first iteration every rank
announces a straggler elsewhere in the job (`announce_slowdown`, as a cluster manager would):
the pipeline then runs a slower, cheaper plan, whose clocks land on combined units. Each rank writes rank<r>.json: both runs' summaries and
iteration samples, the units the adapter reported in one iteration, the stage's planned order
and the deployed plan's clock per unit.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples" / "megatron_gpt3")]

import cpu_shims  # noqa: E402

cpu_shims.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_shims import combined_path_on_cpu  # noqa: E402

from perseus_ext import megatron as perseus_megatron  # noqa: E402
from perseus_ext.observability.run_figures import Sample  # noqa: E402

CHUNKS = 2
MICROBATCHES = 4
SEQ, BATCH, HIDDEN = 4, 1, 8
ITERATIONS = int(os.environ.get("COMBINED_ITERATIONS", "34"))
STRAGGLER_S = 0.17  # the announced straggler's iteration time, about 1.2 x this pipeline's
PERSEUS = {
    "gpu": "sim:a100_sxm?noise=0&period=0.01",
    "warmup_iterations": 1,
    "candidate_clocks": [1410, 1200, 990],
    "profiling_iterations_per_clock": 2,
    "solve_in_background": False,
    "baseline_fraction": 0.25,
    "straggler_check_interval": 2,
    # Per model chunk; stage 1 holds the heavier layers, so stage 0 has slack to slow down in.
    "simulated_workload": {"forward_seconds": [0.003, 0.005], "backward_seconds": [0.006, 0.010]},
}


class TinyChunk(torch.nn.Module):
    """One model chunk: what megatron-core's schedules ask of a model, and a linear layer."""

    def __init__(self, config: TransformerConfig, virtual_stage: int, num_virtual_stages: int) -> None:
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.is_last_virtual_stage = virtual_stage == num_virtual_stages - 1
        self.layer = torch.nn.Linear(HIDDEN, HIDDEN)
        self.input_tensor: list[torch.Tensor | None] = [None]

    def set_input_tensor(self, input_tensor: list[torch.Tensor | None]) -> None:
        self.input_tensor = input_tensor

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        received = self.input_tensor[0]
        return torch.tanh(self.layer(batch if received is None else received))


def forward_step(data_iterator, model: TinyChunk):
    output = model(next(data_iterator))

    def loss_func(output_tensor: torch.Tensor):
        loss = output_tensor.pow(2).mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def batches(seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(SEQ, BATCH, HIDDEN, generator=generator)


def train(mode: str, out: Path, rank: int) -> dict:
    stages = dist.get_world_size()
    config = TransformerConfig(num_layers=stages * CHUNKS, hidden_size=HIDDEN, num_attention_heads=1,
                               pipeline_model_parallel_size=stages, virtual_pipeline_model_parallel_size=CHUNKS,
                               pipeline_dtype=torch.float32)
    config.overlap_moe_expert_parallel_comm = True  # megatron-core's combined_1f1b path
    stage = parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(stage)
    chunks = [TinyChunk(config, c * stages + stage, stages * CHUNKS) for c in range(CHUNKS)]
    optimizer = torch.optim.SGD([p for chunk in chunks for p in chunk.parameters()], lr=0.01)
    flags = ["--perseus", "--perseus-config", str(out / "perseus.json"), "--perseus-mode", mode,
             "--perseus-log-path", str(out / f"{mode}-{{rank}}.jsonl")]
    args = perseus_megatron.add_perseus_args(argparse.ArgumentParser()).parse_args(flags)
    perseus = perseus_megatron.install(args)
    reported: list[str] = []
    runtime_report = None
    try:
        forward_backward = get_forward_backward_func()
        for iteration in range(ITERATIONS):
            optimizer.zero_grad()
            forward_backward(forward_step_func=forward_step, data_iterator=[batches(iteration) for _ in chunks],
                             model=chunks, num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=BATCH,
                             forward_only=False)
            optimizer.step()
            if iteration == 0:  # from the second iteration on, record the units as the adapter reports them
                if mode == "optimize":
                    perseus.runtime.announce_slowdown(datetime.timedelta(seconds=STRAGGLER_S))
                runtime_report = perseus.runtime.before_computation

                def record(kind, microbatch, chunk=0, parts=(), report=runtime_report):
                    reported.append("(" + ";".join(map(str, parts)) + ")" if parts else f"{kind}:{microbatch}:{chunk}")
                    return report(kind, microbatch, chunk=chunk, parts=parts)

                perseus.runtime.before_computation = record
            elif iteration == 1:
                perseus.runtime.before_computation = runtime_report
        deployment = perseus.runtime.deployment
        plan_clocks = list(deployment.stage_clocks(perseus.stage)) if deployment is not None else None
        outcome = perseus.runtime.solve_outcome
        solve_s = outcome.solve_s if outcome is not None else None
    finally:
        summary = perseus.close()
    order = [str(c) for c in perseus.schedule.orders[perseus.stage]]
    return {"summary": summary, "reported": reported, "order": order, "plan_clocks": plan_clocks, "solve_s": solve_s,
            "samples": [dataclasses.asdict(Sample.of_record(r)) for r in perseus.runtime.history],
            "megatron_schedule": perseus.schedule.describe()}


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    dist.init_process_group(backend="gloo")
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=dist.get_world_size(),
                                             virtual_pipeline_model_parallel_size=CHUNKS)
    if rank == 0:
        (out / "perseus.json").write_text(json.dumps(PERSEUS))
    dist.barrier()
    with combined_path_on_cpu():
        result = {"optimize": train("optimize", out, rank), "observe": train("observe", out, rank)}
    (out / f"rank{rank}.json").write_text(json.dumps(result, default=str))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
