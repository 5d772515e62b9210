"""Run megatron-core's real pipeline schedules on a CPU-only machine, for tests.

`run_megatron_schedule(S, M, V)` executes the schedule function that Megatron training uses
(`get_forward_backward_func(pp_size=S, vp_size=V)`: `forward_backward_no_pipelining`,
`forward_backward_pipelining_without_interleaving` or `..._with_interleaving`) for all S
pipeline ranks at once, one thread per rank in this process, and returns every rank's
forward/backward steps in the order Megatron executed them.

Only the transport and the model are fake; Megatron's scheduling loop, its p2p helper methods
(`recv_forward`, `send_forward_recv_backward`, ...), its forward_step/backward_step and its
activation/gradient bookkeeping run unchanged:

- `ThreadP2PCommunicator` subclasses megatron's `P2PCommunicator` and replaces only
  `_communicate` (the one method that talks to torch.distributed) with in-process queues,
  one per (sender, receiver, direction). Sends never block, receives wait with a timeout, so a
  schedule that deadlocks fails instead of hanging.
- Process groups are the adapter's `GroupPosition(rank, size)` objects passed through
  megatron's own `p2p_communicator=` / `pg_collection=` arguments, so `parallel_state` is never initialised.
  Megatron only asks a group for `rank()`/`size()` after checking
  `torch.distributed.is_initialized()`, which is patched to True while the ranks run.
- `torch.zeros(..., device="cuda")` (megatron's token counter) is redirected to the CPU by a
  `TorchFunctionMode` entered in every rank thread.
- Each model chunk is a parameter-free module whose forward output is a tensor filled with a
  code for (virtual stage, microbatch); its backward returns a gradient with the same code.
  Every step therefore also reports which (virtual stage, microbatch) produced the tensor it
  consumed, so tests can check the cross-stage data dependencies, not just the local order.

With `combined=True` the model's config takes megatron-core's combined_1f1b path
(`overlap_moe_expert_parallel_comm`, set after the config is built: its checks want expert
parallelism and a MoE GPT model), and `combined_step_on_cpu` stands in for
`combined_1f1b.combined_forward_backward_step`, the one function whose model work needs CUDA
streams and a GPT schedule plan: it runs the forward through megatron's own `forward_step` and
then the backward through its `backward_step`, one after the other where the GPU overlaps them.
megatron-core's `combined_1f1b_schedule_for_interleaved_pipelining` (its pre- and
post-processing, the virtual microbatch ids) and the interleaved schedule's loop run unchanged.
`cpu_streams()` gives megatron's stream registry stand-ins for the CUDA streams it creates.

Microbatch ids come from the data iterators (each yields 0..M-1 per model chunk, and the
forward step calls `next()` on every stage); chunk ids from the model chunk Megatron passes in.
"""

from __future__ import annotations

import contextlib
import inspect
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import combined_1f1b, schedules
from megatron.core.pipeline_parallel import utils as pipeline_utils
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from perseus_ext.adapters.megatron_combined import GroupPosition

CODE_BASE = 1000  # code = virtual_stage * CODE_BASE + microbatch; exact in float32 below 2**24
TENSOR_SHAPE = (1, 1, 1)  # (seq_length, micro_batch_size, hidden_size)


@dataclass(frozen=True)
class Step:
    """One computation a rank executed, and whose output it consumed.

    `consumed` is (virtual stage, microbatch) of the tensor this step read from another
    virtual stage (the activation for a forward, the output gradient for a backward), or None
    when it read none (first virtual stage's forward, last virtual stage's backward).
    """

    kind: str  # "forward" | "backward"
    microbatch: int
    chunk: int
    consumed: tuple[int, int] | None


def _encode(virtual_stage: int, microbatch: int) -> float:
    return float(virtual_stage * CODE_BASE + microbatch)


def _decode(tensor: torch.Tensor) -> tuple[int, int]:
    code = int(tensor.detach().reshape(-1)[0].item())
    return divmod(code, CODE_BASE)


class _Mailboxes:
    """FIFO queues between ranks. Sends complete at once (buffered), so these checks are
    about order and data flow; megatron's pairing of sends with receives is not modelled."""

    def __init__(self, num_ranks: int, timeout_s: float):
        self.timeout_s = timeout_s
        self.boxes = {
            (src, dst): queue.Queue() for src in range(num_ranks) for dst in range(num_ranks)
        }

    def send(self, src: int, dst: int, tensor: torch.Tensor) -> None:
        self.boxes[(src, dst)].put(tensor.detach().clone())

    def recv(self, src: int, dst: int) -> torch.Tensor:
        try:
            tensor = self.boxes[(src, dst)].get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"rank {dst} waited {self.timeout_s}s for a tensor from rank {src}: "
                "the schedule deadlocks"
            ) from None
        # megatron receives into a fresh `requires_grad=True` buffer
        return tensor.requires_grad_(True)


class ThreadP2PCommunicator(P2PCommunicator):
    """megatron's P2PCommunicator with its transport replaced by in-process mailboxes."""

    def __init__(self, rank: int, num_ranks: int, config: TransformerConfig, boxes: _Mailboxes):
        # Not calling super().__init__: it maps group ranks to global ranks through
        # torch.distributed, which needs a real process group. These are the attributes it sets.
        self.pp_group = GroupPosition(rank, num_ranks)
        self.config = config
        self.next_rank = (rank + 1) % num_ranks
        self.prev_rank = (rank - 1) % num_ranks
        self.virtual_pipeline_model_parallel_size = config.virtual_pipeline_model_parallel_size
        self._rank = rank
        self._boxes = boxes

    def _communicate(
        self,
        *,
        tensor_send_next: torch.Tensor | None,
        tensor_send_prev: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape,
        wait_on_reqs: bool = True,
    ):
        if tensor_send_next is not None:
            self._boxes.send(self._rank, self.next_rank, tensor_send_next)
        if tensor_send_prev is not None:
            self._boxes.send(self._rank, self.prev_rank, tensor_send_prev)
        tensor_recv_prev = self._boxes.recv(self.prev_rank, self._rank) if recv_prev else None
        tensor_recv_next = self._boxes.recv(self.next_rank, self._rank) if recv_next else None
        return tensor_recv_prev, tensor_recv_next, {}


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Create tensors that megatron asks for on "cuda" on the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class _TracedStage(torch.autograd.Function):
    """Identity-like op whose output/gradient carry (virtual stage, microbatch) codes."""

    @staticmethod
    def forward(ctx, stage_input: torch.Tensor, chunk: "FakeModelChunk", microbatch: int):
        ctx.chunk = chunk
        ctx.microbatch = microbatch
        return torch.full_like(stage_input, _encode(chunk.virtual_stage, microbatch))

    @staticmethod
    def backward(ctx, output_grad: torch.Tensor):
        chunk: FakeModelChunk = ctx.chunk
        consumed = None if chunk.is_last_virtual_stage else _decode(output_grad)
        chunk.steps.append(Step("backward", ctx.microbatch, chunk.chunk_id, consumed))
        input_grad = torch.full_like(output_grad, _encode(chunk.virtual_stage, ctx.microbatch))
        return input_grad, None, None


class FakeModelChunk(torch.nn.Module):
    """One model chunk of one rank: what megatron's schedules need from a model, no more."""

    def __init__(
        self,
        config: TransformerConfig,
        rank: int,
        chunk_id: int,
        steps: list[Step],
        compute: torch.nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.chunk_id = chunk_id
        num_stages = config.pipeline_model_parallel_size
        num_chunks = config.virtual_pipeline_model_parallel_size or 1
        self.virtual_stage = chunk_id * num_stages + rank  # megatron's chunk-major layout
        self.is_last_virtual_stage = self.virtual_stage == num_stages * num_chunks - 1
        self.steps = steps
        self.compute = compute  # optional real work on the stage input (e.g. a compiled module)
        self.input_tensor: list[torch.Tensor | None] = [None]

    def set_input_tensor(self, input_tensor: list[torch.Tensor | None]) -> None:
        self.input_tensor = input_tensor


def _forward_step(data_iterator: Iterator[int], model: FakeModelChunk):
    """megatron `forward_step_func`: returns (output, loss function)."""
    microbatch = next(data_iterator)
    received = model.input_tensor[0]
    if received is None:
        consumed = None
        stage_input = torch.zeros(TENSOR_SHAPE, requires_grad=True)
    else:
        consumed = _decode(received)
        stage_input = received
    model.steps.append(Step("forward", microbatch, model.chunk_id, consumed))
    if model.compute is not None:  # its backward runs when _TracedStage hands back the input grad
        stage_input = model.compute(stage_input)
    output = _TracedStage.apply(stage_input, model, microbatch)

    def loss_func(output_tensor: torch.Tensor):
        return output_tensor.sum(), {"microbatch": microbatch}

    return output, loss_func


# 0.17 dropped backward_step's model_type (read here, before any test wraps the function)
_BACKWARD_TAKES_MODEL_TYPE = "model_type" in inspect.signature(schedules.backward_step).parameters


def combined_step_on_cpu(forward_step_func, data_iterator, f_model, num_microbatches, input_tensor,
                        forward_data_store, b_model, b_input_tensor, b_output_tensor, b_output_tensor_grad,
                        config, f_model_chunk_id=None, pre_forward=None, pre_backward=None, post_forward=None,
                        post_backward=None, collect_non_loss_data=False, checkpoint_activations_microbatch=None,
                        is_first_microbatch=False, current_microbatch=None, encoder_decoder_xattn=False):
    """megatron's `combined_forward_backward_step` on the CPU: the forward of `f_model` by
    megatron's `forward_step`, then the backward of `b_model` by its `backward_step` (a model
    chunk says whether it is the model's last with `is_last_virtual_stage`). Returns what the
    original returns: (output tensor, number of tokens, input gradient)."""
    output_tensor = num_tokens = input_tensor_grad = None
    if f_model is not None:
        if pre_forward is not None:
            pre_forward()
        output_tensor, num_tokens = schedules.forward_step(
            forward_step_func, data_iterator, f_model, num_microbatches, input_tensor, forward_data_store,
            config, 1, collect_non_loss_data, None, is_first_microbatch, current_microbatch,
            vp_stage=f_model_chunk_id, is_last_stage=f_model.is_last_virtual_stage)
        if post_forward is not None:
            output_tensor = post_forward(output_tensor)
    if b_model is not None:
        if pre_backward is not None:
            pre_backward()
        extra = {"model_type": ModelType.encoder_or_decoder} if _BACKWARD_TAKES_MODEL_TYPE else {}
        input_tensor_grad = schedules.backward_step(input_tensor=b_input_tensor, output_tensor=b_output_tensor,
                                                    output_tensor_grad=b_output_tensor_grad, config=config, **extra)
        if post_backward is not None:
            input_tensor_grad = post_backward(input_tensor_grad)
    return output_tensor, num_tokens, input_tensor_grad


@contextlib.contextmanager
def cpu_streams():
    """megatron's computation/communication stream registry filled with stand-ins, so its
    `set_streams()` (which creates a CUDA stream) returns at once; restored on exit."""
    saved = pipeline_utils._COMP_STREAM, pipeline_utils._COMM_STREAM
    pipeline_utils._COMP_STREAM, pipeline_utils._COMM_STREAM = "cpu compute stream", "cpu comm stream"
    try:
        yield
    finally:
        pipeline_utils._COMP_STREAM, pipeline_utils._COMM_STREAM = saved


@contextlib.contextmanager
def combined_path_on_cpu(wrap: Callable[[Callable], Callable] | None = None):
    """`combined_step_on_cpu` in place of megatron's combined step (`wrap`ped, e.g. by the hook
    `install()` puts around it), and the stream stand-ins."""
    original = combined_1f1b.combined_forward_backward_step
    combined_1f1b.combined_forward_backward_step = wrap(combined_step_on_cpu) if wrap else combined_step_on_cpu
    try:
        with cpu_streams():
            yield
    finally:
        combined_1f1b.combined_forward_backward_step = original


@dataclass
class _RankOutcome:
    steps: list[Step] = field(default_factory=list)
    error: BaseException | None = None


def run_megatron_schedule(
    num_stages: int,
    num_microbatches: int,
    num_chunks: int = 1,
    microbatch_group_size: int | None = None,
    timeout_s: float = 60.0,
    config_options: dict | None = None,
    stage_module: Callable[[int], torch.nn.Module] | None = None,
    combined: bool = False,
    wrap_combined_step: Callable[[Callable], Callable] | None = None,
) -> list[list[Step]]:
    """Steps of every pipeline rank, in the order megatron-core's real schedule ran them.

    `num_chunks` > 1 selects the interleaved (virtual pipeline) schedule;
    `microbatch_group_size` is megatron's `microbatch_group_size_per_vp_stage` (default:
    pipeline size). Errors megatron raises for unsupported sizes propagate unchanged.
    `config_options` are further TransformerConfig fields (e.g. CUDA-graph options the schedule
    reads); `stage_module(virtual_stage)` is a module each forward applies to its stage input
    (real work, e.g. a compiled block, whose backward runs in megatron's backward_step). Rank r
    runs in a thread named `pp-rank-{r}` (`rank_of_current_thread()`). `combined`: megatron's
    combined_1f1b path, with the model work of its combined step on the CPU (module docstring),
    wrapped by `wrap_combined_step` if given.
    """
    if num_microbatches >= CODE_BASE:
        raise ValueError(f"num_microbatches must be < {CODE_BASE} to fit the tensor codes")
    with warnings.catch_warnings():  # megatron 0.16 warns about its own cuda_graph_scope default
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        config = TransformerConfig(  # what Megatron models carry; the schedules read it
            num_layers=num_stages * num_chunks,
            hidden_size=TENSOR_SHAPE[2],
            num_attention_heads=1,
            pipeline_model_parallel_size=num_stages,
            virtual_pipeline_model_parallel_size=num_chunks if num_chunks > 1 else None,
            microbatch_group_size_per_vp_stage=microbatch_group_size,
            pipeline_dtype=torch.float32,
            **(config_options or {}),
        )
    config.overlap_moe_expert_parallel_comm = combined
    schedule = schedules.get_forward_backward_func(
        pp_size=num_stages, vp_size=config.virtual_pipeline_model_parallel_size
    )
    boxes = _Mailboxes(num_stages, timeout_s)
    outcomes = [_RankOutcome() for _ in range(num_stages)]

    def run_rank(rank: int) -> None:
        outcome = outcomes[rank]
        try:
            chunks = [
                FakeModelChunk(
                    config, rank, c, outcome.steps,
                    stage_module(c * num_stages + rank) if stage_module is not None else None,
                )
                for c in range(num_chunks)
            ]
            pg_collection = ProcessGroupCollection()
            for name in ("tp", "cp", "dp_cp"):
                setattr(pg_collection, name, GroupPosition(0, 1))
            pg_collection.pp = GroupPosition(rank, num_stages)
            pg_collection.embd = None
            pg_collection.pos_embd = None
            interleaved = num_chunks > 1
            with _CudaFactoriesOnCpu():
                schedule(
                    forward_step_func=_forward_step,
                    data_iterator=[iter(range(num_microbatches)) for _ in chunks]
                    if interleaved
                    else iter(range(num_microbatches)),
                    model=chunks if interleaved else chunks[0],
                    num_microbatches=num_microbatches,
                    seq_length=TENSOR_SHAPE[0],
                    micro_batch_size=TENSOR_SHAPE[1],
                    p2p_communicator=ThreadP2PCommunicator(rank, num_stages, config, boxes),
                    pg_collection=pg_collection,
                )
        except BaseException as err:  # re-raised in the calling thread
            outcome.error = err

    path = combined_path_on_cpu(wrap_combined_step) if combined else contextlib.nullcontext()
    with path, mock.patch.object(torch.distributed, "is_initialized", return_value=True):
        threads = [
            threading.Thread(target=run_rank, args=(r,), name=f"pp-rank-{r}", daemon=True)
            for r in range(num_stages)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    errors = [o.error for o in outcomes if o.error is not None]
    # A rank that failed first makes its neighbours wait (and time out): report the root cause.
    root = next((e for e in errors if not isinstance(e, TimeoutError)), None)
    if root is not None:
        raise root
    if hung:
        raise TimeoutError(f"megatron schedule did not finish within {timeout_s}s on {hung}")
    if errors:
        raise errors[0]
    return [o.steps for o in outcomes]


def rank_of_current_thread() -> int:
    """The pipeline rank whose schedule this thread runs (inside `run_megatron_schedule`)."""
    name = threading.current_thread().name
    if not name.startswith("pp-rank-"):
        raise RuntimeError(f"thread {name!r} runs no pipeline rank of run_megatron_schedule")
    return int(name.removeprefix("pp-rank-"))


def cuda_factories_on_cpu() -> TorchFunctionMode:
    """The torch-function mode every rank thread runs in (warm a compiled module up under it, so
    its guards hold in the rank threads)."""
    return _CudaFactoriesOnCpu()


__all__ = ["Step", "ThreadP2PCommunicator", "combined_path_on_cpu", "combined_step_on_cpu",
           "cpu_streams", "cuda_factories_on_cpu", "rank_of_current_thread", "run_megatron_schedule"]
