"""How perseus-ext places each of megatron-core's step calls in the stage's planned order.

Why wrap module functions instead of subclassing: megatron-core's schedules are plain functions
that look `forward_step`/`backward_step` up in their module at call time, and their signatures
change between releases. The wrappers bind arguments by *name* with `inspect.signature`. A
forward is identified from the schedule's own objects (the chunk is the position of the `model`
argument in the iteration's model list, the microbatch megatron's `current_microbatch` or the
chunk's running forward count). A backward carries no model, and tensor ids are reused by
Python after a free, so it is identified by the schedule's own order instead: it is the
computation the stage's `PipelineSchedule` order puts next, which must be a backward of a
microbatch whose forward already ran on that chunk. The output tensor megatron hands the
backward only cross-checks that (through weak references to this iteration's forward outputs,
live objects whose identity cannot be reused): if it is another forward's output, the order is
wrong and the rank falls back.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from typing import Any

from perseus_ext.adapters.megatron_combined import executed_order, no_pipelining_order
from perseus_ext.adapters.megatron_surface import WITH_INTERLEAVING
from perseus_ext.planning.schedule import Computation, Kind, PipelineSchedule, build_schedule, interleaved


def model_config(model: Any) -> Any:
    """The model chunk's megatron-core TransformerConfig, None if it has none."""
    from megatron.core.utils import get_model_config

    try:
        return get_model_config(model)
    except Exception:  # a model megatron cannot read a config from: nothing to detect
        return None


def microbatch_group_size(model: Any) -> int | None:
    """megatron-core's `microbatch_group_size_per_vp_stage` (None: its default, the PP size)."""
    from megatron.core.utils import get_model_config

    value = getattr(get_model_config(model), "microbatch_group_size_per_vp_stage", None)
    return value if isinstance(value, int) else None


def planned_schedule(name: str, num_stages: int, num_microbatches: int, num_chunks: int, group: int | None,
                     combined: bool) -> PipelineSchedule:
    """The order megatron-core's schedule function `name` runs: combined_1f1b's units when the
    model's config takes that path (`megatron_combined`), else interleaved or 1F1B."""
    if combined and name == WITH_INTERLEAVING:
        return executed_order(num_stages, num_microbatches, num_chunks, group)
    if combined:
        return no_pipelining_order(num_microbatches)
    if name == WITH_INTERLEAVING:
        return interleaved(num_stages, num_microbatches, num_chunks, group)
    return build_schedule("1f1b", num_stages, num_microbatches)


def pipeline_group(bound: dict) -> Any:
    """The pipeline group a schedule call runs over (its arguments', else megatron's global one)."""
    collection = bound.get("pg_collection")
    if collection is not None and getattr(collection, "pp", None) is not None:
        return collection.pp
    communicator = bound.get("p2p_communicator")
    if communicator is not None and getattr(communicator, "pp_group", None) is not None:
        return communicator.pp_group
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def data_parallel_group() -> Any:
    """Straggler detection compares the pipelines of Megatron's data-parallel group."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


def local_device() -> int:
    """The CUDA ordinal this process drives (NVML maps it through CUDA_VISIBLE_DEVICES)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.current_device()
    return int(os.environ.get("LOCAL_RANK", "0"))


def _first_tensor(value: Any) -> Any:
    """Megatron passes single tensors or one-element lists depending on the version/path."""
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value


@dataclasses.dataclass
class IterationSteps:
    """Book-keeping for one training iteration on this stage."""

    models: list[Any]
    order: tuple[Computation, ...]
    forwards_per_chunk: list[int]
    position: int = 0  # computations reported so far
    # (microbatch, chunk) -> weak reference to that forward's output, until its backward
    outputs: dict[tuple[int, int], weakref.ref] = dataclasses.field(default_factory=dict)

    def chunk_of(self, model: Any, vp_stage: Any) -> int | None:
        for index, candidate in enumerate(self.models):
            if candidate is model:
                return index
        return vp_stage if isinstance(vp_stage, int) else None

    @property
    def expected(self) -> Computation | None:
        return self.order[self.position] if self.position < len(self.order) else None

    def remember_output(self, identity: tuple[int, int], result: Any) -> None:
        output = _first_tensor(result[0] if isinstance(result, tuple) else result)
        try:
            self.outputs[identity] = weakref.ref(output)
        except TypeError:  # not weak-referenceable: nothing to cross-check the backward with
            pass

    def producer_of(self, output_tensor: Any) -> tuple[int, int] | None:
        """The forward that made `output_tensor` (a live object, so never a reused id), or None
        when it is none of this iteration's forwards."""
        output = _first_tensor(output_tensor)
        for identity, reference in self.outputs.items():
            if reference() is output:
                return identity
        return None

    def place(self, kind: Kind, bound: dict, *, schedule_kind: str, stage: int) -> tuple[int, int] | str:
        """(microbatch, chunk) of the step megatron is about to run, from its bound arguments, or
        what it ran when that cannot be placed in the stage's order (the caller falls back)."""
        if kind is Kind.FORWARD:
            chunk = self.chunk_of(bound.get("model"), bound.get("vp_stage"))
            if chunk is None or not 0 <= chunk < len(self.forwards_per_chunk):
                return "a forward step of a model chunk it was not given"
            reported = bound.get("current_microbatch")
            counted = self.forwards_per_chunk[chunk]
            self.forwards_per_chunk[chunk] += 1
            return (reported if isinstance(reported, int) else counted), chunk
        expected = self.expected
        where = (f"where the {schedule_kind} schedule expects "
                 f"{expected if expected else 'no more computations'} (position {self.position})")
        if (expected is None or expected.kind is not Kind.BACKWARD
                or self.forwards_per_chunk[expected.chunk] <= expected.microbatch):
            return f"a backward step {where}"
        identity = expected.microbatch, expected.chunk
        # The order names the backward; the output tensor (when it is a forward's of this
        # iteration) can only confirm it or prove the order wrong.
        produced_by = self.producer_of(bound.get("output_tensor"))
        if produced_by is not None and produced_by != identity:
            ran = Computation(stage, produced_by[1], produced_by[0], Kind.BACKWARD)
            return f"{ran} {where}"
        self.outputs.pop(identity, None)
        return identity
