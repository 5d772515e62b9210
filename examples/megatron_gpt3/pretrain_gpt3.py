"""Self-contained GPT-3 pretraining on megatron-core, with Perseus energy-bloat removal (--perseus).

Uses megatron-core's own building blocks end to end: `GPTModel` (one per virtual pipeline
stage), its pipeline schedules (`get_forward_backward_func`), its `DistributedDataParallel`
grad buffers, `finalize_model_grads` and its optimizer. The data are synthetic token streams
(seeded per global sample) so the script needs no dataset or tokenizer and every run is
reproducible: the same flags give the same losses with and without --perseus.

Launch with torchrun, one process per GPU; see run_gpt3.sh for the standard GPT-3 sizes:

    torchrun --nproc-per-node 8 pretrain_gpt3.py --model 1.3b --pipeline-model-parallel-size 4 \
        --micro-batch-size 1 --global-batch-size 64 --train-iters 100 --perseus
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

from perseus_ext import megatron as perseus_megatron
from perseus_ext.policies import PerseusEarlyStop

# Standard GPT-3 sizes (Brown et al. 2020, Table 2.1): layers, hidden size, attention heads.
GPT3_SIZES: dict[str, tuple[int, int, int]] = {
    "1.3b": (24, 2048, 16),
    "2.7b": (32, 2560, 32),
    "6.7b": (32, 4096, 32),
    "13b": (40, 5120, 40),  # the paper lists 5140; 5120 keeps 128-wide heads (Megatron)
    "175b": (96, 12288, 96),
    "tiny": (4, 64, 4),  # CPU smoke tests
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    model = parser.add_argument_group("model")
    model.add_argument("--model", choices=sorted(GPT3_SIZES), default="tiny",
                       help="GPT-3 size preset for layers/hidden/heads (default: tiny)")
    model.add_argument("--num-layers", type=int, help="override the preset's layer count")
    model.add_argument("--hidden-size", type=int, help="override the preset's hidden size")
    model.add_argument("--num-attention-heads", type=int, help="override the preset's heads")
    model.add_argument("--seq-length", type=int, default=2048)
    model.add_argument("--vocab-size", type=int, default=51200)
    model.add_argument("--bf16", action="store_true", help="bfloat16 weights and compute")
    par = parser.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                     help="model chunks per pipeline stage (interleaved 1F1B schedule)")
    train = parser.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, default=1)
    train.add_argument("--global-batch-size", type=int, default=8)
    train.add_argument("--rampup-batch-size", type=int, nargs=3, default=None,
                       metavar=("START", "INCREMENT", "SAMPLES"),
                       help="Megatron-LM's batch-size ramp-up: the global batch grows from START by "
                            "INCREMENT until --global-batch-size, spread evenly over SAMPLES samples")
    train.add_argument("--train-iters", type=int, default=10)
    train.add_argument("--cuda-graph-impl", choices=("none", "full_iteration"), default="none",
                       help="full_iteration: capture the whole forward-backward as one CUDA graph "
                            "(megatron-core's FullCudaGraphWrapper, as Megatron-LM >= 0.18 spells it) "
                            "and replay it; perseus-ext then deploys stage-constant plans")
    train.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                       help="eager iterations before the full-iteration graph is captured")
    train.add_argument("--lr", type=float, default=1.5e-4)
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--log-interval", type=int, default=1)
    train.add_argument("--metrics-file", help="write per-iteration loss/time as JSON (rank 0)")
    logs = parser.add_argument_group("logging (Megatron-LM's flags)")
    logs.add_argument("--tensorboard-dir", help="TensorBoard event files, written by the last rank as in "
                      "Megatron-LM: 'lm loss' and, with --perseus, the perseus/* metrics")
    logs.add_argument("--tensorboard-queue-size", type=int, default=1000,
                      help="events buffered before the writer flushes them")
    par.add_argument("--microbatch-group-size-per-vp-stage", type=int, default=None,
                     help="megatron-core's interleaving group (default: pipeline size)")
    perseus_megatron.add_perseus_args(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    layers, hidden, heads = GPT3_SIZES[args.model]
    args.num_layers = args.num_layers or layers
    args.hidden_size = args.hidden_size or hidden
    args.num_attention_heads = args.num_attention_heads or heads
    return args


def initialize_distributed(args: argparse.Namespace) -> None:
    """One process per GPU (NCCL), or per CPU core over gloo when no GPU is present."""
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        )
    model_parallel_cuda_manual_seed(args.seed)


def build_model(args: argparse.Namespace) -> list[DistributedDataParallel]:
    """One GPTModel per virtual stage, wrapped in megatron-core's DDP grad buffers."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        use_cpu_initialization=not torch.cuda.is_available(),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
    )
    num_chunks = args.virtual_pipeline_model_parallel_size or 1
    torch.manual_seed(args.seed)
    chunks = []
    for vp_stage in range(num_chunks):
        vp = vp_stage if args.virtual_pipeline_model_parallel_size else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=args.vocab_size,
            max_sequence_length=args.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            vp_stage=vp,
        )
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
        chunks.append(
            DistributedDataParallel(config, ddp_config, model, disable_bucketing=vp_stage > 0)
        )
    config.no_sync_func = [chunk.no_sync for chunk in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    if num_chunks == 1:
        config.no_sync_func = config.no_sync_func[0]
    return chunks


def synthetic_batches(args: argparse.Namespace) -> Iterator[dict[str, torch.Tensor]]:
    """Endless microbatches of token streams; each global sample has its own seed, so data-
    parallel replicas see different samples and runs are reproducible."""
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    step = 0
    while True:
        samples = []
        for i in range(args.micro_batch_size):
            generator = torch.Generator().manual_seed(
                args.seed + (step * dp_size + dp_rank) * args.micro_batch_size + i
            )
            samples.append(torch.randint(args.vocab_size, (args.seq_length + 1,), generator=generator))
        tokens = torch.stack(samples).to(device)
        positions = torch.arange(args.seq_length, device=device).unsqueeze(0)
        yield {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "position_ids": positions.expand(args.micro_batch_size, -1),
        }
        step += 1


def loss_func(output_tensor: torch.Tensor):
    """Mean token loss; the schedule divides by the number of microbatches."""
    loss = output_tensor.float().mean()
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model: GPTModel):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, loss_func


def average_loss(losses_reduced: list[dict[str, torch.Tensor]]) -> float:
    """Loss of the iteration averaged over microbatches and data-parallel replicas; every rank
    returns it (the last stage broadcasts it over the pipeline)."""
    value = torch.zeros(1, dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        value += sum(float(entry["lm loss"]) for entry in losses_reduced) / len(losses_reduced)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    value = value.to(device)
    dist.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
    dist.all_reduce(value, group=parallel_state.get_data_parallel_group())
    return float(value) / parallel_state.get_data_parallel_world_size()


def global_batch_size(args: argparse.Namespace, consumed_samples: int) -> int:
    """The global batch after `consumed_samples` (Megatron-LM's ramp-up rule)."""
    if args.rampup_batch_size is None:
        return args.global_batch_size
    start, increment, samples = args.rampup_batch_size
    steps = (args.global_batch_size - start) // increment
    if steps <= 0:
        return args.global_batch_size
    return min(args.global_batch_size, start + increment * (consumed_samples // (samples // steps)))


def tensorboard_writer(args: argparse.Namespace):
    """Megatron-LM's arrangement: with --tensorboard-dir the last rank (the last pipeline stage,
    which computes the loss) holds a SummaryWriter; every other rank has none."""
    if not args.tensorboard_dir or dist.get_rank() != dist.get_world_size() - 1:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)


def train(args: argparse.Namespace) -> dict:
    """Build the model and optimizer, run `--train-iters` iterations; returns the per-iteration
    metrics (loss, seconds) and, with --perseus, every rank's Perseus summary."""
    initialize_distributed(args)
    writer = tensorboard_writer(args)
    # Before the microbatches are counted: a batch-size policy sets --global-batch-size here.
    # The perseus/* metrics go to the same writer as the loss.
    perseus = perseus_megatron.install(args, tensorboard_writer=writer)
    dp_size = parallel_state.get_data_parallel_world_size()
    per_step = args.micro_batch_size * dp_size
    starts = [args.global_batch_size] + list(args.rampup_batch_size or ())[:2]
    if any(size % per_step for size in starts):
        raise SystemExit(f"--global-batch-size and --rampup-batch-size START/INCREMENT must be "
                         f"multiples of micro batch x DP = {per_step}")

    model = build_model(args)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, bf16=args.bf16, clip_grad=1.0), model
    )
    data = [synthetic_batches(args) for _ in model]
    forward_backward = get_forward_backward_func()
    if args.cuda_graph_impl == "full_iteration":  # as Megatron-LM's training.py wraps it
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper

        forward_backward = FullCudaGraphWrapper(forward_backward, cuda_graph_warmup_steps=args.cuda_graph_warmup_steps)
    iterations = []
    summary = None
    consumed_samples = 0
    try:
        for iteration in range(args.train_iters):
            batch = global_batch_size(args, consumed_samples)
            num_microbatches = batch // per_step
            consumed_samples += batch
            start = time.perf_counter()
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            losses = forward_backward(
                forward_step_func=forward_step,
                data_iterator=data if len(model) > 1 else data[0],
                model=model if len(model) > 1 else model[0],
                num_microbatches=num_microbatches,
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
                forward_only=False,
            )
            _, grad_norm, _ = optimizer.step()
            seconds = time.perf_counter() - start
            loss = average_loss(losses)
            iterations.append({"iteration": iteration, "loss": loss, "seconds": seconds,
                               "microbatches": num_microbatches})
            if writer is not None:
                writer.add_scalar("lm loss", loss, iteration)
            if dist.get_rank() == 0 and (iteration + 1) % args.log_interval == 0:
                print(f"iteration {iteration + 1:5d}/{args.train_iters} | lm loss {loss:.6f} | "
                      f"grad norm {grad_norm:.3f} | {seconds * 1000:.1f} ms", flush=True)
            if perseus is not None and perseus.target is not None and perseus.report_metric(loss):
                break  # the recurring job's target (every rank has the same loss)
    except PerseusEarlyStop as stop:  # cost limit passed: clocks restored, run recorded as stopped
        if dist.get_rank() == 0:
            print(f"perseus: {stop}", flush=True)
    finally:
        if perseus is not None:
            summary = perseus.close()  # rank 0 logs the job's energy, saving and time cost
        if writer is not None:
            writer.close()
    summaries = None
    if perseus is not None:
        summaries = [None] * dist.get_world_size()
        dist.all_gather_object(summaries, summary)
    return {"iterations": iterations, "perseus": summaries}


def main(argv: list[str] | None = None) -> dict:
    """Train once with `argv`; callable repeatedly in one process (same parallel layout)."""
    args = parse_args(argv)
    if not logging.getLogger().handlers:  # rank 0 tells Perseus' story; the rest only warns
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
        if os.environ.get("RANK", "0") == "0":
            logging.getLogger("perseus_ext").setLevel(logging.INFO)
    metrics = train(args)
    if dist.get_rank() == 0 and args.metrics_file:
        with open(args.metrics_file, "w", encoding="utf-8") as out:
            json.dump(metrics, out, indent=1, default=str)
    dist.barrier()
    return metrics


def shutdown() -> None:
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    shutdown()
