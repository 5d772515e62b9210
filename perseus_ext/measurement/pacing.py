"""Who puts work on the device: the framework on a real GPU, the pacer on a simulated one.

A real GPU gets its kernels from the framework, so perseus-ext launches nothing (`NoPacing`). A
simulated GPU has no kernels: the simulator's `SimulatedWorkloadPacer` (`gpu/sim/workload.py`)
launches each computation's simulated duration, with its data dependencies, onto the simulated
device's stream. This is the one place the lifecycle's simulated and real runs differ, and it
sits behind one interface, so the runtime imports neither the simulator nor torch.
"""

from __future__ import annotations

import abc

from perseus_ext.planning.schedule import Computation


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
