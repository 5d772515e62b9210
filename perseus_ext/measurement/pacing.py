"""Who puts work on the device: the framework on a real GPU, the pacer on a simulated one.

A real GPU gets its kernels from the framework, so perseus-ext launches nothing (`NoPacing`). A
simulated GPU has no kernels: `SimulatedWorkloadPacer` launches each computation's simulated
duration onto the simulated device's stream, together with what the device must wait
for -- the producing computation on the neighbouring stage (a pipeline receive) and, before the
optimizer step, the same stage of every other data-parallel pipeline (the gradient all-reduce).
The waits happen on the simulated devices' timelines, like NCCL waits on streams, never on the
host. This is the one place the lifecycle's simulated and real runs differ, and it sits behind
one interface, so the runtime imports neither the simulator nor torch.
"""

from __future__ import annotations

import abc
from typing import Sequence

import numpy as np

from perseus_ext.measurement.gpu.timeline import DeviceTimeline
from perseus_ext.planning.derived import DerivationRule, derive_kinds
from perseus_ext.planning.profile import OperatingPoints, Profile
from perseus_ext.planning.schedule import Computation, Kind, PipelineSchedule

TRANSFER_LABEL = "receive"


class ComputationPacer(abc.ABC):
    """Called on the training thread around every computation; never synchronises the host."""

    @abc.abstractmethod
    def receive(self, iteration: int, computation: Computation) -> None:
        """The computation's input is about to be consumed (its pipeline receive)."""

    @abc.abstractmethod
    def compute(self, iteration: int, computation: Computation, planned_clock_mhz: int | None) -> None:
        """The computation's work is launched now."""

    @abc.abstractmethod
    def gradient_sync(self, iteration: int) -> None:
        """The stage's gradients are reduced across data-parallel pipelines now."""


class NoPacing(ComputationPacer):
    """Real GPUs: the framework launches its own kernels and communication."""

    def receive(self, iteration: int, computation: Computation) -> None:
        pass

    def compute(self, iteration: int, computation: Computation, planned_clock_mhz: int | None) -> None:
        pass

    def gradient_sync(self, iteration: int) -> None:
        pass


class SimulatedWorkloadPacer(ComputationPacer):
    """Launches one stage's simulated work, with the pipeline's data dependencies.

    forward_s / backward_s: seconds of one microbatch at the max clock, one number or one per
    stage. The input-gradient and weight-gradient computations of split-backward schedules
    take the shares of the backward that the planner's own rule gives them (`split_backward_s`),
    so a simulated zero-bubble job runs the durations its plan assumes. Keys name (pipeline, iteration, computation), so every rank of a job derives the same
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
    ) -> None:
        self.timeline = timeline
        self.schedule = schedule
        self.stage = stage
        self.pipeline = pipeline
        self.num_pipelines = num_pipelines
        input_gradient_s, weight_gradient_s = split_backward_s(forward_s, backward_s)
        self._seconds = {Kind.FORWARD: list(forward_s), Kind.BACKWARD: list(backward_s),
                         Kind.INPUT_GRADIENT: input_gradient_s, Kind.WEIGHT_GRADIENT: weight_gradient_s}
        self._publishes = schedule.num_stages > 1  # another stage consumes this stage's outputs

    def _key(self, iteration: int, computation: Computation) -> str:
        return f"p{self.pipeline}.i{iteration}.{computation}"

    def _work_s(self, computation: Computation) -> float:
        table = self._seconds.get(computation.kind)
        if table is None:
            kinds = ", ".join(kind.value for kind in self._seconds)
            raise ValueError(f"the simulated workload has durations for {kinds}, not for {computation.kind.value} "
                             f"computations ({computation})")
        return table[computation.stage] if len(table) > 1 else table[0]

    def receive(self, iteration: int, computation: Computation) -> None:
        producer = self.schedule.producer_of(computation)
        if producer is None or producer.stage == self.stage:
            return  # the data loader, or this stage's own earlier work: the stream orders it
        self.timeline.launch(TRANSFER_LABEL, 0.0, after=(self._key(iteration, producer),))

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
