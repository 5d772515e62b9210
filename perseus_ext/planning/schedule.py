"""Per-stage execution order of one training iteration for the supported pipeline schedules.

A schedule is a list, one entry per pipeline stage, of the computations that stage runs in
order. Computations are small immutable data objects (like DeepSpeed's pipeline instructions),
so the planner, the runtime and the framework adapters can all speak about "the 7th computation
of stage 2" without importing a framework.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from perseus_ext.errors import ScheduleError


class Kind(str, enum.Enum):
    """What a computation does; the value is the profile CSV's `instruction` name."""

    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True, order=True)
class Computation:
    """One forward or backward of one microbatch through one model chunk on one stage."""

    stage: int
    chunk: int
    microbatch: int
    kind: Kind

    def __str__(self) -> str:
        letter = "F" if self.kind is Kind.FORWARD else "B"
        chunk = f"c{self.chunk}" if self.chunk else ""
        return f"{letter}{self.microbatch}{chunk}@s{self.stage}"


class ScheduleKind(str, enum.Enum):
    """Schedules the planner knows, named after the framework code that executes them."""

    ONE_F_ONE_B = "1f1b"  # DeepSpeed TrainSchedule == Megatron-core non-interleaved 1F1B
    INTERLEAVED = "interleaved"  # Megatron-core virtual-pipeline 1F1B


@dataclass(frozen=True)
class PipelineSchedule:
    """The computations of one iteration: `orders[s]` is stage s's execution order."""

    kind: ScheduleKind
    num_stages: int
    num_microbatches: int
    num_chunks: int
    orders: tuple[tuple[Computation, ...], ...]

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.num_chunks

    def virtual_stage(self, c: Computation) -> int:
        """Position of `c`'s model chunk in the whole model (Megatron's layout: chunk-major)."""
        return c.chunk * self.num_stages + c.stage

    def producer_of(self, c: Computation) -> Computation | None:
        """The computation on another virtual stage whose output `c` consumes (None: the
        first forward of the model reads the data loader)."""
        v = self.virtual_stage(c)
        if c.kind is Kind.FORWARD:
            if v == 0:
                return None
            v -= 1
            kind = Kind.FORWARD
        elif v == self.num_virtual_stages - 1:
            kind = Kind.FORWARD  # the loss: backward of the last stage needs its own forward
        else:
            v += 1
            kind = Kind.BACKWARD
        return Computation(v % self.num_stages, v // self.num_stages, c.microbatch, kind)

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

        def fwd(k: int) -> Computation:
            m, c = table[k]
            return Computation(stage, c, m, Kind.FORWARD)

        def bwd(k: int) -> Computation:
            m, c = table[k]
            return Computation(stage, num_chunks - 1 - c, m, Kind.BACKWARD)

        order = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            order.append(fwd(warmup + k))
            order.append(bwd(k))
        order += [bwd(k) for k in range(total - warmup, total)]
        orders.append(tuple(order))
    return PipelineSchedule(
        ScheduleKind.INTERLEAVED, num_stages, num_microbatches, num_chunks, tuple(orders)
    )


def build_schedule(
    kind: str | ScheduleKind, num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> PipelineSchedule:
    """Build a schedule by name (`1f1b` or `interleaved`), as the CLI and configs name them."""
    try:
        kind = ScheduleKind(kind)
    except ValueError:
        names = ", ".join(k.value for k in ScheduleKind)
        raise ScheduleError(f"unknown schedule {kind!r}; use one of: {names}") from None
    if kind is ScheduleKind.ONE_F_ONE_B:
        if num_chunks != 1:
            raise ScheduleError("virtual stages need the 'interleaved' schedule")
        return one_f_one_b(num_stages, num_microbatches)
    return interleaved(num_stages, num_microbatches, num_chunks)
