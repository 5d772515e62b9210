"""megatron-core's combined_1f1b (`--overlap-moe-expert-parallel-comm`): one clock per unit it runs.

With the flag, megatron-core's interleaved schedule hands every step to
`combined_1f1b_schedule_for_interleaved_pipelining` (its `forward_backward_helper_wrapper` looks
the name up in the schedules module at call time): the lone forwards of warm-up, each steady
step's forward of one microbatch together with the backward of another (their expert
all-to-alls overlapped on a second stream inside `combined_forward_backward_step`), and the
lone backwards of cool-down. Neither `forward_step` nor `backward_step` runs. Without pipeline
parallelism `combined_1f1b_schedule_for_no_pipelining` calls `combined_forward_backward_step`
directly, once per unit. The names and signatures are the same in core_r0.16.0 to core_r0.19.0.

So the planning unit is what megatron-core executes: a `Kind.COMBINED` computation whose parts
are the forward and the backward, or a lone forward or backward. The wrapper here reads each
unit's identity from megatron-core's own arguments (its virtual microbatch ids, mapped by the
schedule's own `get_model_chunk_id` / `get_microbatch_id_in_model_chunk`), so nothing is
guessed; the runtime checks every unit against the stage's planned order and falls back to
default clocks on the first mismatch.

The planned order is megatron-core's: `executed_order` builds each rank's unit list from
megatron-core's `get_pp_rank_microbatches` (warm-up count, with its extra forward for the
overlap) and `get_schedule_table`, following the loop of
`forward_backward_pipelining_with_interleaving`, and checks it against the planner's own
`planning.schedule.combined_1f1b`; a difference is a `ConfigError` before any clock is set.

Delayed weight gradients (`--delay-wgrad-compute`, which megatron-core allows only with the
overlap flag and Transformer Engine) run inside the unit in every supported release (the layer
schedule plans call `backward_dw()` within `combined_forward_backward_step`), so they are part
of the unit's measured time and energy; no step of their own runs between units.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from perseus_ext.adapters.megatron_graphs import COMBINED_1F1B_FLAG
from perseus_ext.errors import ConfigError
from perseus_ext.planning.schedule import (
    Computation,
    Kind,
    PipelineSchedule,
    ScheduleKind,
    combined,
    combined_1f1b,
    looped_placement,
    schedule_from_actions,
)

COMBINED_MODULE = "megatron.core.pipeline_parallel.combined_1f1b"
INTERLEAVED_UNIT = "combined_1f1b_schedule_for_interleaved_pipelining"  # looked up in the schedules module
NO_PIPELINING_UNIT = "combined_forward_backward_step"  # looked up in the combined_1f1b module


def runs_combined(model_config: Any) -> bool:
    """What megatron-core's schedules test to take the combined path (the first chunk's config)."""
    return bool(getattr(model_config, "overlap_moe_expert_parallel_comm", False))


@dataclass(frozen=True)
class GroupPosition:
    """A rank's place in a process group, as megatron-core asks it of one (`rank()`, `size()`):
    enough for `get_pp_rank_microbatches` here, and for megatron's schedules run without
    torch.distributed in tests."""

    rank_in_group: int
    group_size: int

    def rank(self) -> int:
        return self.rank_in_group

    def size(self) -> int:
        return self.group_size


@dataclass(frozen=True)
class _PipelinePosition:
    """What `get_pp_rank_microbatches` reads of a P2PCommunicator: one rank of the pipeline."""

    pp_group: _Group
    virtual_pipeline_model_parallel_size: int


def executed_order(num_stages: int, num_microbatches: int, num_chunks: int,
                   microbatch_group_size: int | None = None) -> PipelineSchedule:
    """The units every rank of megatron-core's combined_1f1b runs, from megatron-core's own
    warm-up count and schedule table; the same as the planner's `combined_1f1b` or a
    `ConfigError` naming the first unit where they part."""
    from megatron.core.pipeline_parallel import schedules

    group = num_stages if microbatch_group_size is None else microbatch_group_size
    table = schedules.get_schedule_table(num_microbatches, num_chunks, group)
    orders = []
    for stage in range(num_stages):
        total, _, warmup, remaining = schedules.get_pp_rank_microbatches(
            num_microbatches, num_chunks, group, overlap_moe_expert_parallel_comm=True,
            p2p_communicator=_PipelinePosition(GroupPosition(stage, num_stages), num_chunks))

        def forward(k: int, stage: int = stage) -> Computation:
            microbatch, chunk = table[k]
            return Computation(stage, chunk, microbatch, Kind.FORWARD)

        def backward(k: int, stage: int = stage) -> Computation:
            microbatch, chunk = table[k]  # backwards walk the same table with chunks reversed
            return Computation(stage, num_chunks - 1 - chunk, microbatch, Kind.BACKWARD)

        orders.append([forward(k) for k in range(warmup)]
                      + [combined(forward(warmup + k), backward(k)) for k in range(remaining)]
                      + [backward(k) for k in range(remaining, total)])
    executed = schedule_from_actions(orders, looped_placement(num_stages, num_chunks), ScheduleKind.COMBINED_1F1B)
    planned = combined_1f1b(num_stages, num_microbatches, num_chunks, microbatch_group_size)
    for stage, (ran, plan) in enumerate(zip(executed.orders, planned.orders)):
        if ran != plan:
            at = next((k for k, (a, b) in enumerate(zip(ran, plan)) if a != b), min(len(ran), len(plan)))
            raise ConfigError(
                f"perseus: megatron-core's combined_1f1b runs {ran[at] if at < len(ran) else 'nothing'} at "
                f"position {at} of stage {stage}, where perseus-ext's combined_1f1b plan has "
                f"{plan[at] if at < len(plan) else 'nothing'}; this megatron-core release orders its "
                f"{COMBINED_1F1B_FLAG} schedule differently: run without {COMBINED_1F1B_FLAG} or with "
                f"--perseus-mode observe")
    return executed


def no_pipelining_order(num_microbatches: int) -> PipelineSchedule:
    """`combined_1f1b_schedule_for_no_pipelining`'s units: the first forward alone, each next
    forward with the previous microbatch's backward, the last backward alone."""
    def forward(m: int) -> Computation:
        return Computation(0, 0, m, Kind.FORWARD)

    def backward(m: int) -> Computation:
        return Computation(0, 0, m, Kind.BACKWARD)

    order = ([forward(0)] + [combined(forward(m + 1), backward(m)) for m in range(num_microbatches - 1)]
             + [backward(num_microbatches - 1)])
    return schedule_from_actions([order], kind=ScheduleKind.COMBINED_1F1B)


def interleaved_unit(bound: dict, stage: int) -> Computation | None:
    """The unit one `combined_1f1b_schedule_for_interleaved_pipelining` call runs, read from
    megatron-core's virtual microbatch ids through the schedule's own table lookups (a
    backward's microbatch is the table's entry at its id, as megatron pops it; its chunk comes
    from `get_model_chunk_id(..., forward=False)`)."""
    chunk_of, microbatch_of = bound["get_model_chunk_id"], bound["get_microbatch_id_in_model_chunk"]
    parts = []
    forward_id, backward_id = bound.get("f_virtual_microbatch_id"), bound.get("b_virtual_microbatch_id")
    if forward_id is not None:
        parts.append(Computation(stage, chunk_of(forward_id, forward=True),
                                 microbatch_of(forward_id, forward=True), Kind.FORWARD))
    if backward_id is not None:
        parts.append(Computation(stage, chunk_of(backward_id, forward=False),
                                 microbatch_of(backward_id, forward=True), Kind.BACKWARD))
    if not parts:
        return None
    return combined(*parts) if len(parts) > 1 else parts[0]


def _shape(unit: Computation) -> tuple[bool, bool]:
    kinds = {part.kind for part in unit.units}
    return Kind.FORWARD in kinds, Kind.BACKWARD in kinds


def no_pipelining_unit(bound: dict, expected: Computation | None) -> Computation | str:
    """A `combined_forward_backward_step` call of the no-pipelining path: the plan's next unit,
    which must have a forward exactly when megatron passes a forward model (of the microbatch it
    names) and a backward exactly when it passes a backward model; else what ran, for the error."""
    has_forward, has_backward = bound.get("f_model") is not None, bound.get("b_model") is not None
    ran = " + ".join(what for what, present in (("a forward", has_forward), ("a backward", has_backward)) if present)
    if expected is None or _shape(expected) != (has_forward, has_backward):
        return f"{ran or 'an empty'} combined step where the plan has {expected or 'no more computations'}"
    microbatch = bound.get("current_microbatch")
    forward = next((p for p in expected.units if p.kind is Kind.FORWARD), None)
    if forward is not None and isinstance(microbatch, int) and microbatch != forward.microbatch:
        return f"the forward of microbatch {microbatch} where the plan has {expected}"
    return expected


class UnitHost(Protocol):
    """What `wrap_unit` reads and calls of the adapter (`megatron.MegatronPerseus`)."""

    stage: int | None
    runtime: Any  # the rank's PerseusRuntime
    in_unit: bool  # set while a unit runs: step hooks inside it pass through

    @property
    def current_iteration(self) -> Any: ...  # megatron_steps.IterationSteps, None outside a hooked iteration

    @property
    def fell_back_on_order(self) -> bool: ...

    def cannot_place(self, what: str) -> None: ...

    def check_unit_outside_iteration(self, function: str) -> None: ...  # ConfigError outside every hooked schedule


def wrap_unit(perseus: UnitHost, original: Callable, *, interleaved: bool) -> Callable:
    """`original` (one of megatron-core's combined-unit functions) reported to the runtime as one
    computation: before and after it, with its parts; step hooks inside it pass through."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def run_unit(*args: Any, **kwargs: Any) -> Any:
        iteration = perseus.current_iteration
        if iteration is None:
            perseus.check_unit_outside_iteration(original.__name__)
            return original(*args, **kwargs)
        if perseus.in_unit or perseus.fell_back_on_order:
            return original(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        if interleaved:
            unit = interleaved_unit(bound, perseus.stage)
        else:
            unit = no_pipelining_unit(bound, iteration.expected)
        if isinstance(unit, str):
            perseus.cannot_place(unit)
            return original(*args, **kwargs)
        if unit is None:
            return original(*args, **kwargs)
        runtime = perseus.runtime
        runtime.before_computation(unit.kind, unit.microbatch, chunk=unit.chunk, parts=unit.parts)
        perseus.in_unit = True
        try:
            result = original(*args, **kwargs)
        finally:
            perseus.in_unit = False
        runtime.after_computation(unit.kind, unit.microbatch, chunk=unit.chunk, parts=unit.parts)
        iteration.position += 1
        if iteration.position == len(iteration.order):
            runtime.mark_compute_end()  # what follows is the data-parallel grad sync
        return result

    return run_unit
