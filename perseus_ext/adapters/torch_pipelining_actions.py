"""torch.distributed.pipelining's actions as perseus-ext `Computation`s: which schedule classes
are supported, how a rank's local stages map to (stage, chunk), how a schedule's
`pipeline_order` reads as per-rank orders, and where it disagrees with what ran.

No torch import at module level: the classes are told apart by name along the MRO, so this
module loads (and its rules can be tested) without torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from perseus_ext.errors import ConfigError
from perseus_ext.planning.schedule import Computation, Kind, ScheduleKind

# The schedule classes perseus-ext knows, most derived first, and the planner's name for each.
SUPPORTED_CLASSES: dict[str, ScheduleKind] = {
    "Schedule1F1B": ScheduleKind.ONE_F_ONE_B,
    "ScheduleInterleaved1F1B": ScheduleKind.INTERLEAVED,
    "ScheduleInterleavedZeroBubble": ScheduleKind.ZERO_BUBBLE,
    "ScheduleZBVZeroBubble": ScheduleKind.ZBV,
    "ScheduleDualPipeV": ScheduleKind.DUALPIPE_V,
}

# Classes whose `_step_microbatches` executes `pipeline_order` (lowered with communication):
# there the order is authoritative. Schedule1F1B's `pipeline_order` only describes its loop.
AUTHORITATIVE_BASE = "_PipelineScheduleRuntime"

# What the runtime profiles and paces per action: its profiler measures a row per kind the
# stage runs (the gradient sync's included), and the simulated pacer splits a backward's duration
# into the input and weight gradients by the planner's derivation rule. A kind outside this set
# (none that torch 2.13's supported classes run) is recorded and checked, but the job keeps
# default clocks.
RUNTIME_KINDS = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.INPUT_GRADIENT, Kind.WEIGHT_GRADIENT, Kind.REDUCE_GRAD})

# torch's computation type names (`_ComputationType.value`) -> Kind. Communication, FSDP
# unshard/reshard and the overlapped unit (expanded into its parts) are not here.
_TORCH_KINDS = {
    "F": Kind.FORWARD,
    "B": Kind.BACKWARD,
    "I": Kind.INPUT_GRADIENT,
    "W": Kind.WEIGHT_GRADIENT,
    "REDUCE_GRAD": Kind.REDUCE_GRAD,
}
_OVERLAP = "OVERLAP_F_B"


def supported_kind(schedule: Any) -> ScheduleKind:
    """The planner's kind for `schedule`'s class (a subclass counts as the torch class it
    derives from; the cross-check catches one that changes the order); ConfigError naming the
    class and the supported ones otherwise."""
    for cls in type(schedule).__mro__:
        if cls.__module__.startswith("torch.distributed.pipelining") and cls.__name__ in SUPPORTED_CLASSES:
            return SUPPORTED_CLASSES[cls.__name__]
    names = ", ".join(SUPPORTED_CLASSES)
    raise ConfigError(f"perseus-ext does not support the torch.distributed.pipelining schedule class "
                      f"{type(schedule).__name__}; use one of: {names} (docs/torch-pipelining.md)")


def is_authoritative(schedule: Any) -> bool:
    """Whether `schedule.pipeline_order` is what its step executes."""
    return any(cls.__name__ == AUTHORITATIVE_BASE for cls in type(schedule).__mro__)


def local_stages(schedule: Any) -> list[Any]:
    """The pipeline stages this rank runs, by their place in the model (`stage_index`)."""
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stages = [schedule._stage]
    return sorted(stages, key=lambda s: s.stage_index)


@dataclass(frozen=True)
class RankLayout:
    """Where the model's slices sit: `placement[v]` is the (pipeline rank, local chunk) of
    stage_index v; a rank's chunk k is its k-th stage by stage_index (looped: v // S, V-shape:
    0 on the way down, 1 on the way up)."""

    placement: tuple[tuple[int, int], ...]

    @classmethod
    def from_indices(cls, indices_per_rank: list[list[int]]) -> RankLayout:
        where: dict[int, tuple[int, int]] = {}
        for rank, indices in enumerate(indices_per_rank):
            for chunk, index in enumerate(sorted(indices)):
                if index in where:
                    raise ConfigError(f"stage_index {index} is held by ranks {where[index][0]} and {rank} of the "
                                      f"pipeline group; every pipeline stage must live on one rank")
                where[index] = (rank, chunk)
        missing = sorted(set(range(len(where))) - set(where))
        if missing or not where:
            raise ConfigError(f"the pipeline group's ranks hold stage_index {sorted(where)}; stage_index "
                              f"{missing or [0]} is on no rank (PipelineStage(stage_index=...) must cover "
                              f"0..num_stages-1)")
        return cls(tuple(where[v] for v in range(len(where))))

    def locate(self, stage_index: int) -> tuple[int, int]:
        return self.placement[stage_index]


def _computation(layout: RankLayout, stage_index: int, microbatch: int | None, kind: Kind) -> Computation:
    rank, chunk = layout.locate(stage_index)
    return Computation(rank, chunk, 0 if microbatch is None else int(microbatch), kind)


def orders_from_pipeline_order(pipeline_order: dict[int, list[Any]], layout: RankLayout) -> list[list[Computation]]:
    """Each rank's compute actions of a torch `pipeline_order` as Computations, in order; an
    overlapped F+B action as its sub-actions, in the order torch's runtime runs them."""
    orders: list[list[Computation]] = []
    for rank in range(len(layout_ranks(layout))):
        order: list[Computation] = []
        for action in pipeline_order.get(rank, []):
            if action is None:
                continue
            name = getattr(action.computation_type, "value", str(action.computation_type))
            if name == _OVERLAP:
                order += [_computation(layout, a.stage_index, a.microbatch_index, _TORCH_KINDS[a.computation_type.value])
                          for a in action.sub_actions]
            elif name in _TORCH_KINDS:
                order.append(_computation(layout, action.stage_index, action.microbatch_index, _TORCH_KINDS[name]))
        orders.append(order)
    return orders


def layout_ranks(layout: RankLayout) -> list[int]:
    """The pipeline ranks of a layout, 0..R-1."""
    return sorted({rank for rank, _ in layout.placement})


def first_mismatch(executed: list[list[Computation]], listed: list[list[Computation]]) -> str | None:
    """Where a rank's executed order first differs from the listed one, in words; None if equal.
    A listed order without gradient syncs is compared with the executed one's syncs left out
    (torch adds REDUCE_GRAD when it lowers the order, not always in `pipeline_order`)."""
    for rank, (ran, planned) in enumerate(zip(executed, listed)):
        if not any(c.kind is Kind.REDUCE_GRAD for c in planned):
            ran = [c for c in ran if c.kind is not Kind.REDUCE_GRAD]
        if ran == planned:
            continue
        position = next((k for k, (a, b) in enumerate(zip(ran, planned)) if a != b), min(len(ran), len(planned)))
        got = str(ran[position]) if position < len(ran) else "nothing more"
        want = str(planned[position]) if position < len(planned) else "nothing more"
        return (f"pipeline rank {rank} ran {got} at position {position} where pipeline_order lists {want} "
                f"({len(ran)} actions ran, {len(planned)} listed)")
    if len(executed) != len(listed):
        return f"{len(executed)} pipeline ranks ran actions but pipeline_order lists {len(listed)}"
    return None
