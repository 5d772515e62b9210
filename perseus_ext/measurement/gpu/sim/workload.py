"""The simulated workload: one stage's computations launched on a simulated GPU's stream.

A simulated GPU has no kernels, so something must put each computation's duration on its device,
with what the device must wait for: the producing computation on the neighbouring stage (a
pipeline receive) and, before the optimizer step, the same stage of every other data-parallel
pipeline (the gradient all-reduce). The waits happen on the simulated devices' timelines, like
NCCL waits on streams, never on the host. The runtime sees it only as a `ComputationPacer`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from perseus_ext.measurement.gpu.timeline import DeviceTimeline
from perseus_ext.measurement.pacing import ComputationPacer
from perseus_ext.planning.dependencies import data_inputs
from perseus_ext.planning.derived import DerivationRule, derive_kinds
from perseus_ext.planning.profile import OperatingPoints, Profile
from perseus_ext.planning.schedule import Computation, Kind, PipelineSchedule

TRANSFER_LABEL = "receive"


class SimulatedWorkloadPacer(ComputationPacer):
    """Launches one stage's simulated work, with the pipeline's data dependencies.

    forward_s / backward_s: seconds of one microbatch at the max clock, one number or one per
    stage. The input-gradient and weight-gradient computations of split-backward schedules
    take the shares of the backward that the planner's own rule gives them (`split_backward_s`),
    so a simulated zero-bubble job runs the durations its plan assumes. reduce_grad_s: a
    gradient sync action's seconds (torch.distributed.pipelining's REDUCE_GRAD, one per model
    chunk; 0 launches no work, and the node costs what is measured around it); the data-parallel
    wait stays in `gradient_sync`, after the stage's last sync. Keys name (pipeline, iteration, computation), so every rank of a job derives the same
    keys from the shared schedule without talking to the others.
    """

    def __init__(
        self,
        timeline: DeviceTimeline,
        schedule: PipelineSchedule,
        *,
        stage: int,
        pipeline: int,
        num_pipelines: int,
        forward_s: Sequence[float],
        backward_s: Sequence[float],
        reduce_grad_s: Sequence[float] = (0.0,),
    ) -> None:
        self.timeline = timeline
        self.schedule = schedule
        self.stage = stage
        self.pipeline = pipeline
        self.num_pipelines = num_pipelines
        input_gradient_s, weight_gradient_s = split_backward_s(forward_s, backward_s)
        self._seconds = {Kind.FORWARD: list(forward_s), Kind.BACKWARD: list(backward_s),
                         Kind.INPUT_GRADIENT: input_gradient_s, Kind.WEIGHT_GRADIENT: weight_gradient_s,
                         Kind.REDUCE_GRAD: list(reduce_grad_s)}
        self._publishes = schedule.num_stages > 1  # another stage consumes this stage's outputs

    def _key(self, iteration: int, computation: Computation) -> str:
        return f"p{self.pipeline}.i{iteration}.{computation}"

    def _work_s(self, computation: Computation) -> float:
        if computation.kind is Kind.COMBINED:  # its parts' work, none credited to the overlap
            return sum(self._work_s(part) for part in computation.parts)
        table = self._seconds.get(computation.kind)
        if table is None:
            kinds = ", ".join(kind.value for kind in self._seconds)
            raise ValueError(f"the simulated workload has durations for {kinds}, not for {computation.kind.value} "
                             f"computations ({computation})")
        return table[computation.stage] if len(table) > 1 else table[0]

    def receive(self, iteration: int, computation: Computation) -> None:
        # Every input from another stage (a combined unit has one per part); the data loader
        # and this stage's own earlier work need none: the stream orders them.
        producers = tuple(self._key(iteration, producer) for producer in data_inputs(self.schedule, computation)
                          if producer.stage != self.stage)
        if producers:
            self.timeline.launch(TRANSFER_LABEL, 0.0, after=producers)

    def compute(self, iteration: int, computation: Computation, planned_clock_mhz: int | None) -> None:
        self.timeline.launch(
            computation.kind.value, self._work_s(computation), planned_clock_mhz=planned_clock_mhz,
            publish=self._key(iteration, computation) if self._publishes else None,
        )

    def gradient_sync(self, iteration: int) -> None:
        if self.num_pipelines < 2:
            return
        arrived = f"sync.s{self.stage}.i{iteration}.p"
        self.timeline.launch("gradient sync arrive", 0.0, publish=f"{arrived}{self.pipeline}")
        others = tuple(f"{arrived}{p}" for p in range(self.num_pipelines) if p != self.pipeline)
        self.timeline.launch("gradient sync", 0.0, after=others)


def split_backward_s(forward_s: Sequence[float], backward_s: Sequence[float],
                     rule: DerivationRule | None = None) -> tuple[list[float], list[float]]:
    """(input-gradient seconds, weight-gradient seconds) per stage (one entry when both inputs
    have one), by the rule the planner estimates unmeasured kinds with
    (`planning.derived.derive_kinds`, run here on a one-clock profile of the workload): one
    rule, so the simulated work and the plans that assume it agree."""
    stages = max(len(forward_s), len(backward_s))

    def at(table: Sequence[float], stage: int) -> OperatingPoints:
        seconds = float(table[stage] if len(table) > 1 else table[0])
        return OperatingPoints(np.array([1]), np.array([seconds]), np.array([seconds]))

    points = {(stage, kind): at(table, stage) for stage in range(stages)
              for kind, table in (("forward", forward_s), ("backward", backward_s))}
    derived = derive_kinds(Profile(points, "simulated workload"), rule)
    return ([float(derived[stage, "input_gradient"].times[0]) for stage in range(stages)],
            [float(derived[stage, "weight_gradient"].times[0]) for stage in range(stages)])
