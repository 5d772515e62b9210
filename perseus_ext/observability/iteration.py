"""One finished iteration of one rank, as the runtime publishes it: what it ran at (known when
the host launched it) and what the device measured. The typed view every observer reads -- the
JSONL writer, the metrics sinks, the Prometheus exporter, the summary's statistics -- so none of
them reaches into the runtime's collaborators for a figure."""

from __future__ import annotations

from dataclasses import dataclass

from perseus_ext.observability.phase import Phase
from perseus_ext.observability.power_samples import PowerSamples


@dataclass(frozen=True)
class IterationSetting:
    """What one iteration ran at, known when the host launches it."""

    iteration: int
    phase: Phase
    plan: int | None = None  # frontier plan index (deployed)
    profiled_clock_mhz: int | None = None  # the candidate clock (profiling)
    power_limit_w: float | None = None  # the limit in force (power-limit mode)
    factor: float | None = None  # the slowdown factor planned for (deployed)
    fell_back: bool = False  # this rank ran default clocks because it fell back
    probe: bool = False  # a deployed iteration run at default clocks on purpose (baseline probe)

    def describe(self) -> str:
        if self.fell_back:
            return "default (fallback)"
        if self.probe:
            return "default (baseline probe)"
        if self.plan is not None:
            return f"plan {self.plan}"
        if self.profiled_clock_mhz is not None:
            return f"profile {self.profiled_clock_mhz} MHz"
        if self.power_limit_w is not None:
            return f"limit {self.power_limit_w:g} W"
        return "default"


@dataclass(frozen=True)
class IterationRecord:
    """One iteration as the device ran it: times from device markers, energy from the counter
    read when the device reached them."""

    setting: IterationSetting
    rank: int
    pipeline: int
    stage: int
    time_s: float  # iteration start to end on the device
    compute_s: float  # iteration start to the end of this stage's computations
    energy_j: float | None
    coverage: float | None  # share of planned compute time at its planned clock (estimated)
    wall_time: float  # Unix time the host finished launching the iteration
    # the SM clock it was planned to run: the profiled clock, the mean of the plan's clocks over
    # the stage's computations, or the GPU's maximum at default clocks (None: not known)
    clock_mhz: float | None = None
    # the GPU's power at a fine rate from the previous iteration's end to this one's, where the
    # device knows it (the simulated device; None on real GPUs: observability.power_samples)
    power: PowerSamples | None = None
    # iteration start to the start of this stage's first computation (None: not known): what
    # precedes it (the host's launch, data loading, the wait for the first activation) is no
    # computation's, so a model check measures from there
    first_computation_s: float | None = None

    @property
    def iteration(self) -> int:
        return self.setting.iteration

    @property
    def phase(self) -> Phase:
        return self.setting.phase

    @property
    def power_w(self) -> float | None:
        """The iteration's average GPU power (None without an energy reading)."""
        return self.energy_j / self.time_s if self.energy_j is not None and self.time_s > 0 else None
