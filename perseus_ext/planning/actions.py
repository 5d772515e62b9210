"""The action type of a pipeline schedule: one thing one stage runs, free of any framework.

Like DeepSpeed's pipeline instructions or torch.distributed.pipelining's actions, but plain
frozen data the planner, the runtime and the adapters share (`schedule.py` orders them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from perseus_ext.errors import ScheduleError


class Kind(str, enum.Enum):
    """What a computation does; the value is the profile CSV's `instruction` name.

    A full backward computes the input gradient (I) and the weight gradient (W) together;
    zero-bubble schedules run them as two computations. A combined unit runs several
    computations as one (Megatron's combined_1f1b step, DualPipeV's overlapped forward and
    backward); its parts say which. The gradient sync is the data-parallel all-reduce a stage
    runs after its last gradient work, where a schedule lists it.
    """

    FORWARD = "forward"
    BACKWARD = "backward"
    INPUT_GRADIENT = "input_gradient"
    WEIGHT_GRADIENT = "weight_gradient"
    COMBINED = "combined"
    REDUCE_GRAD = "reduce_grad"


_LETTERS = {
    Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.INPUT_GRADIENT: "I", Kind.WEIGHT_GRADIENT: "W",
    Kind.COMBINED: "C", Kind.REDUCE_GRAD: "R",
}


@dataclass(frozen=True, order=True)
class Computation:
    """One action of one stage: a forward, backward, input- or weight-gradient of one microbatch
    through one model chunk, a combined unit of such `parts`, or a chunk's gradient sync.

    `chunk` is the model chunk's index among the stage's own chunks (the stage's k-th chunk);
    `PipelineSchedule.placement` says which virtual stage that is. A combined unit's `chunk`
    and `microbatch` are its first part's; a gradient sync's microbatch is 0.
    """

    stage: int
    chunk: int
    microbatch: int
    kind: Kind
    parts: tuple["Computation", ...] = field(default=(), compare=True)

    def __str__(self) -> str:
        if self.kind is Kind.COMBINED:
            return "(" + ";".join(str(p) for p in self.parts) + ")"
        chunk = f"c{self.chunk}" if self.chunk else ""
        if self.kind is Kind.REDUCE_GRAD:
            return f"R{chunk}@s{self.stage}"
        return f"{_LETTERS[self.kind]}{self.microbatch}{chunk}@s{self.stage}"

    @property
    def units(self) -> tuple["Computation", ...]:
        """The single computations this action runs: its parts, or itself."""
        return self.parts if self.kind is Kind.COMBINED else (self,)


def combined(*parts: Computation) -> Computation:
    """A combined unit running `parts` (two or more computations of one stage) as one action."""
    if len(parts) < 2:
        raise ScheduleError(f"a combined unit needs at least two parts, got {len(parts)}")
    stages = {p.stage for p in parts}
    if len(stages) != 1:
        raise ScheduleError(f"the parts of a combined unit run on one stage, got stages {sorted(stages)}")
    for p in parts:
        if p.kind in (Kind.COMBINED, Kind.REDUCE_GRAD):
            raise ScheduleError(f"a combined unit's parts are forwards and gradients, got {p}")
    first = parts[0]
    return Computation(first.stage, first.chunk, first.microbatch, Kind.COMBINED, tuple(parts))
