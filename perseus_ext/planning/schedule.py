"""Per-stage execution order of one training iteration: the ordered action list a schedule runs.

A schedule is a list, one entry per pipeline stage, of the computations that stage runs in
order. Computations are small immutable data objects (like DeepSpeed's pipeline instructions),
so the planner, the runtime and the framework adapters can all speak about "the 7th computation
of stage 2" without importing a framework. Any schedule is one such list plus its placement
(which stage and model chunk hold each virtual stage, `PipelineSchedule.placement`):
`one_f_one_b`, `interleaved` and `combined_1f1b` produce them here, and a framework adapter
converts the actions its schedule executes (a torch.distributed.pipelining schedule's, say) into
`Computation`s and calls `schedule_from_actions`. The dependency rules that turn a schedule into
the iteration graph live in `dependencies.py`, for every producer alike.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from perseus_ext.errors import ScheduleError
from perseus_ext.planning.actions import Computation, Kind, combined
from perseus_ext.planning.dependencies import check_schedule, data_inputs

__all__ = [
    "BUILT_IN", "Computation", "Kind", "PipelineSchedule", "ScheduleKind", "ScheduleSummary",
    "build_schedule", "combined", "combined_1f1b", "interleaved", "looped_placement",
    "one_f_one_b", "schedule_from_actions", "v_shape_placement",
]


class ScheduleKind(str, enum.Enum):
    """Schedules the planner knows, named after the framework code that executes them."""

    ONE_F_ONE_B = "1f1b"  # DeepSpeed TrainSchedule == Megatron-core non-interleaved 1F1B
    INTERLEAVED = "interleaved"  # Megatron-core virtual-pipeline 1F1B
    COMBINED_1F1B = "combined_1f1b"  # Megatron-core interleaved 1F1B with combined F+B steps
    ZERO_BUBBLE = "zero_bubble"  # torch ScheduleInterleavedZeroBubble (looped, I/W split)
    ZBV = "zbv"  # torch ScheduleZBVZeroBubble (V-shaped, I/W split)
    DUALPIPE_V = "dualpipev"  # torch ScheduleDualPipeV (V-shaped, overlapped F+B)
    CUSTOM = "custom"  # any other action list with its placement


# Schedules `build_schedule` produces itself; the others come from a framework's action list.
BUILT_IN = (ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED, ScheduleKind.COMBINED_1F1B)


def looped_placement(num_stages: int, num_chunks: int) -> tuple[tuple[int, int], ...]:
    """Megatron's and torch's looped layout: virtual stage v is chunk v // S of stage v % S."""
    return tuple((v % num_stages, v // num_stages) for v in range(num_stages * num_chunks))


def v_shape_placement(num_stages: int) -> tuple[tuple[int, int], ...]:
    """The V-shaped layout of ZB-V and DualPipeV: stage s holds virtual stages s (its chunk 0)
    and 2S - 1 - s (its chunk 1), so the last stage runs both middle virtual stages."""
    down = [(s, 0) for s in range(num_stages)]
    up = [(s, 1) for s in reversed(range(num_stages))]
    return tuple(down + up)


@dataclass(frozen=True)
class PipelineSchedule:
    """The computations of one iteration: `orders[s]` is stage s's execution order.

    `placement[v]` is the (stage, chunk) holding virtual stage v, the v-th slice of the model
    from input to loss; empty means the looped layout (`looped_placement`). `num_chunks` is
    the most chunks any stage holds.
    """

    kind: ScheduleKind
    num_stages: int
    num_microbatches: int
    num_chunks: int
    orders: tuple[tuple[Computation, ...], ...]
    placement: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.placement:
            object.__setattr__(self, "placement", looped_placement(self.num_stages, self.num_chunks))

    def __getstate__(self) -> dict:
        """Pickled without the lookups it caches (they are rebuilt on first use)."""
        return {name: self.__dict__[name] for name in self.__dataclass_fields__}

    @property
    def num_virtual_stages(self) -> int:
        return len(self.placement)

    @cached_property
    def _virtual_of(self) -> dict[tuple[int, int], int]:
        return {where: v for v, where in enumerate(self.placement)}

    @cached_property
    def chunks_per_stage(self) -> tuple[int, ...]:
        """How many model chunks each stage holds (asymmetric layouts differ per stage)."""
        counts = [0] * self.num_stages
        for stage, _ in self.placement:
            counts[stage] += 1
        return tuple(counts)

    def virtual_stage(self, c: Computation) -> int:
        """Position of `c`'s model chunk in the whole model (a combined unit: its first part's)."""
        try:
            return self._virtual_of[c.stage, c.chunk]
        except KeyError:
            raise ScheduleError(
                f"{c} runs chunk {c.chunk} of stage {c.stage}, which the schedule's placement "
                f"does not hold"
            ) from None

    def at(self, virtual_stage: int, microbatch: int, kind: Kind) -> Computation:
        """The computation of `kind` for `microbatch` on virtual stage `virtual_stage`."""
        stage, chunk = self.placement[virtual_stage]
        return Computation(stage, chunk, microbatch, kind)

    def producer_of(self, c: Computation) -> Computation | None:
        """The computation on another virtual stage whose output `c` consumes first (None: the
        first forward of the model reads the data loader, or `c` consumes nothing from
        another stage); `dependencies.data_inputs` lists all of them."""
        inputs = data_inputs(self, c)
        return inputs[0] if inputs else None

    def summary(self) -> ScheduleSummary:
        """What a frontier was solved for (`Frontier.schedule`), without the orders."""
        return ScheduleSummary(self.kind, self.num_stages, self.num_microbatches, self.num_chunks)

    def describe(self) -> dict:
        """JSON-friendly summary (used in frontier files and logs)."""
        return self.summary().to_dict()


@dataclass(frozen=True)
class ScheduleSummary:
    """The schedule a frontier was solved for: its kind and sizes, as frontier files hold them
    (`{"kind", "stages", "microbatches", "virtual_stages"}`)."""

    kind: ScheduleKind
    stages: int
    microbatches: int
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ScheduleKind(self.kind))
        _check_positive(stages=self.stages, microbatches=self.microbatches, virtual_stages=self.virtual_stages)

    def to_dict(self) -> dict:
        return {"kind": self.kind.value, "stages": self.stages, "microbatches": self.microbatches,
                "virtual_stages": self.virtual_stages}

    @classmethod
    def from_dict(cls, data: dict) -> ScheduleSummary:
        """The summary `to_dict` wrote; a `ScheduleError` (a `ValueError`) names a bad field."""
        unknown = set(data) - {"kind", "stages", "microbatches", "virtual_stages"}
        if unknown:
            raise ScheduleError(f"unknown schedule field(s) {sorted(unknown)}")
        missing = {"kind", "stages", "microbatches"} - set(data)
        if missing:
            raise ScheduleError(f"schedule field(s) {sorted(missing)} missing")
        try:
            kind = ScheduleKind(data["kind"])
        except (ValueError, TypeError):
            raise ScheduleError(f"kind must be one of {[k.value for k in ScheduleKind]}, got {data['kind']!r}") from None
        return cls(kind, data["stages"], data["microbatches"], data.get("virtual_stages", 1))


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")


def one_f_one_b(num_stages: int, num_microbatches: int) -> PipelineSchedule:
    """Non-interleaved 1F1B: DeepSpeed's `TrainSchedule` and Megatron-core's
    `forward_backward_pipelining_without_interleaving` execute exactly this order.

    Stage s runs min(S - s - 1, M) warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards.
    """
    _check_positive(num_stages=num_stages, num_microbatches=num_microbatches)
    orders = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        order = [Computation(stage, 0, m, Kind.FORWARD) for m in range(warmup)]
        for m in range(num_microbatches - warmup):
            order.append(Computation(stage, 0, warmup + m, Kind.FORWARD))
            order.append(Computation(stage, 0, m, Kind.BACKWARD))
        order += [
            Computation(stage, 0, m, Kind.BACKWARD)
            for m in range(num_microbatches - warmup, num_microbatches)
        ]
        orders.append(tuple(order))
    return PipelineSchedule(ScheduleKind.ONE_F_ONE_B, num_stages, num_microbatches, 1, tuple(orders))


def _interleaved_table(num_microbatches: int, num_chunks: int, group: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of the k-th forward on every stage.

    Megatron runs microbatches in groups of `group` (its `microbatch_group_size_per_vp_stage`,
    default = pipeline size): all chunks of one group before the next group; the last group
    takes whatever microbatches remain.
    """
    table = []
    for first in range(0, num_microbatches, group):
        last = num_microbatches if first + group >= num_microbatches else first + group
        table += [(m, c) for c in range(num_chunks) for m in range(first, last)]
    return table


def _table_actions(stage: int, table: list[tuple[int, int]], num_chunks: int
                   ) -> tuple[Callable[[int], Computation], Callable[[int], Computation]]:
    """The k-th forward and the k-th backward of `stage` in megatron-core's schedule table
    ((microbatch, chunk) pairs in forward order; backwards walk the chunks in reverse)."""

    def forward(k: int) -> Computation:
        microbatch, chunk = table[k]
        return Computation(stage, chunk, microbatch, Kind.FORWARD)

    def backward(k: int) -> Computation:
        microbatch, chunk = table[k]
        return Computation(stage, num_chunks - 1 - chunk, microbatch, Kind.BACKWARD)

    return forward, backward


def interleaved(
    num_stages: int,
    num_microbatches: int,
    num_chunks: int,
    microbatch_group_size: int | None = None,
) -> PipelineSchedule:
    """Megatron-core's interleaved (virtual pipeline) 1F1B,
    `forward_backward_pipelining_with_interleaving`.

    Each stage holds `num_chunks` model chunks. Stage s warms up with
    2 (S - s - 1) + (V - 1) * group forwards, then alternates forward/backward; backwards walk
    the same (microbatch, chunk) table with chunks reversed.
    """
    _check_positive(num_stages=num_stages, num_microbatches=num_microbatches, num_chunks=num_chunks)
    group = num_stages if microbatch_group_size is None else microbatch_group_size
    _check_positive(microbatch_group_size=group)
    if num_chunks > 1 and num_stages < 2:
        raise ScheduleError("an interleaved schedule needs at least 2 pipeline stages")
    if num_chunks > 1 and num_microbatches < num_stages:
        raise ScheduleError(
            f"an interleaved schedule needs microbatches >= stages ({num_microbatches} < "
            f"{num_stages}); raise the number of microbatches or use the 1f1b schedule"
        )
    if num_chunks > 1 and not num_stages <= group <= num_microbatches:
        raise ScheduleError(
            f"microbatch_group_size must lie in [stages, microbatches] = [{num_stages}, "
            f"{num_microbatches}] (Megatron-core refuses others), got {group}"
        )
    if num_chunks > 1 and 0 < num_microbatches % group < num_stages:
        raise ScheduleError(
            f"Megatron-core refuses {num_microbatches} microbatches in groups of {group}: the "
            f"last group would hold {num_microbatches % group} < {num_stages} (stages) "
            f"microbatches; use a multiple of {group} microbatches"
        )
    table = _interleaved_table(num_microbatches, num_chunks, group)
    total = len(table)
    orders = []
    for stage in range(num_stages):
        if num_chunks == 1:
            warmup = num_stages - stage - 1
        else:
            warmup = (num_stages - stage - 1) * 2 + (num_chunks - 1) * group
        warmup = min(warmup, total)

        fwd, bwd = _table_actions(stage, table, num_chunks)

        order = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            order.append(fwd(warmup + k))
            order.append(bwd(k))
        order += [bwd(k) for k in range(total - warmup, total)]
        orders.append(tuple(order))
    return PipelineSchedule(
        ScheduleKind.INTERLEAVED, num_stages, num_microbatches, num_chunks, tuple(orders)
    )


def combined_1f1b(
    num_stages: int,
    num_microbatches: int,
    num_chunks: int,
    microbatch_group_size: int | None = None,
) -> PipelineSchedule:
    """Megatron-core's interleaved 1F1B with `--overlap-moe-expert-parallel-comm`: the steady
    state runs each forward together with a backward as one combined step
    (`combined_1f1b_schedule_for_interleaved_pipelining`), and every stage warms up with one
    forward more than the interleaved schedule so the two halves of a step never depend on
    each other. Cool-down backwards and warm-up forwards run alone."""
    base = interleaved(num_stages, num_microbatches, num_chunks, microbatch_group_size)
    if num_chunks < 2:
        raise ScheduleError(
            "Megatron-core runs combined_1f1b over several pipeline stages only with virtual "
            "stages; give at least 2 model chunks per stage"
        )
    group = num_stages if microbatch_group_size is None else microbatch_group_size
    table = _interleaved_table(num_microbatches, num_chunks, group)
    total = len(table)
    orders = []
    for stage in range(num_stages):
        warmup = min((num_stages - stage - 1) * 2 + (num_chunks - 1) * group + 1, total)

        fwd, bwd = _table_actions(stage, table, num_chunks)

        order = [fwd(k) for k in range(warmup)]
        order += [combined(fwd(warmup + k), bwd(k)) for k in range(total - warmup)]
        order += [bwd(k) for k in range(total - warmup, total)]
        orders.append(tuple(order))
    return PipelineSchedule(
        ScheduleKind.COMBINED_1F1B, num_stages, num_microbatches, num_chunks, tuple(orders),
        base.placement,
    )


def schedule_from_actions(
    orders: list[list[Computation]] | tuple[tuple[Computation, ...], ...],
    placement: tuple[tuple[int, int], ...] | list[tuple[int, int]] | None = None,
    kind: str | ScheduleKind = ScheduleKind.CUSTOM,
) -> PipelineSchedule:
    """The schedule of an ordered action list: `orders[s]` is what stage s runs, in order;
    `placement[v]` the (stage, chunk) of virtual stage v (default: looped over the chunks the
    actions name). Checked at once against every dependency rule (`dependencies.py`): an action
    list that could not run (a backward before its forward on a stage, a microbatch missing on
    a virtual stage, a gradient sync before the stage's last gradient) is a `ScheduleError`
    naming the action."""
    try:
        kind = ScheduleKind(kind)
    except ValueError:
        names = ", ".join(k.value for k in ScheduleKind)
        raise ScheduleError(f"unknown schedule kind {kind!r}; use one of: {names}") from None
    orders = tuple(tuple(order) for order in orders)
    if not orders:
        raise ScheduleError("an action list needs at least one stage")
    for stage, order in enumerate(orders):
        for action in order:
            if not isinstance(action, Computation):
                raise ScheduleError(f"stage {stage}'s actions must be Computation objects, got {action!r}")
            if action.stage != stage:
                raise ScheduleError(f"{action} is listed in stage {stage}'s actions")
    units = [u for order in orders for a in order for u in a.units]
    work = [u for u in units if u.kind is not Kind.REDUCE_GRAD]
    if not work:
        raise ScheduleError("an action list needs at least one forward")
    num_chunks = 1 + max(u.chunk for u in units)
    if placement is None:
        placement = looped_placement(len(orders), num_chunks)
    placement = tuple((int(s), int(c)) for s, c in placement)
    if len(set(placement)) != len(placement):
        raise ScheduleError(f"placement {placement} names one (stage, chunk) twice")
    if any(not 0 <= s < len(orders) for s, _ in placement):
        raise ScheduleError(f"placement {placement} names a stage outside 0..{len(orders) - 1}")
    chunks = 1 + max(c for _, c in placement)
    schedule = PipelineSchedule(
        kind, len(orders), 1 + max(u.microbatch for u in work), chunks, orders, placement,
    )
    check_schedule(schedule)
    return schedule


def build_schedule(
    kind: str | ScheduleKind, num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> PipelineSchedule:
    """Build a schedule by name (`1f1b`, `interleaved` or `combined_1f1b`), as the CLI and
    configs name them; the other kinds come from a framework's action list
    (`schedule_from_actions`)."""
    try:
        kind = ScheduleKind(kind)
    except ValueError:
        names = ", ".join(k.value for k in BUILT_IN)
        raise ScheduleError(f"unknown schedule {kind!r}; use one of: {names}") from None
    if kind is ScheduleKind.ONE_F_ONE_B:
        if num_chunks != 1:
            raise ScheduleError("virtual stages need the 'interleaved' schedule")
        return one_f_one_b(num_stages, num_microbatches)
    if kind is ScheduleKind.INTERLEAVED:
        return interleaved(num_stages, num_microbatches, num_chunks)
    if kind is ScheduleKind.COMBINED_1F1B:
        return combined_1f1b(num_stages, num_microbatches, num_chunks)
    raise ScheduleError(
        f"the {kind.value!r} schedule is built from the framework's own action list "
        f"(planning.schedule.schedule_from_actions), not by name"
    )
