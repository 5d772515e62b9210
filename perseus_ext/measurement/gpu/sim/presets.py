"""The simulated GPU models: each preset's curve parameters and limits (the physics is in
`simulated_gpu.py`'s docstring and docs/device.md). Its own module so that the simulated device
(`device.py`) and the simulated GPU (`simulated_gpu.py`) both read it without importing each other.
The presets' names are the config's (`perseus_ext.config.gpu.SimPreset`: the door checks a spec
without loading these curves)."""

from __future__ import annotations

from dataclasses import dataclass

from perseus_ext.config.gpu import SimPreset
from perseus_ext.measurement.gpu.common import GPUError
from perseus_ext.measurement.gpu.timeline import SwitchLatency
from perseus_ext.planning.energy import BLOCKING_POWER_W


@dataclass(frozen=True)
class Preset:
    """Curve parameters and limits of one simulated GPU model."""

    key: str
    name: str
    max_clock_mhz: int
    min_clock_mhz: int
    clock_step_mhz: int
    max_compute_power_w: float  # power of a computation at the max clock
    static_fraction: float  # s: share of max-clock power that does not scale with f
    voltage_floor: float  # V_min as a fraction of f_max
    memory_bound_fraction: float  # m: share of max-clock time that does not scale with f
    idle_power_w: float  # power while no computation runs (= blocking power in the paper)
    default_power_limit_w: float
    power_limit_range_w: tuple[float, float]
    source: str  # where the curve parameters come from
    switch_latency: SwitchLatency = SwitchLatency(0.020, 0.010)  # see docs/device.md

    def supported_clocks(self) -> list[int]:
        return list(range(self.max_clock_mhz, self.min_clock_mhz - 1, -self.clock_step_mhz))

    def time_factor(self, mhz: float) -> float:
        """Duration at `mhz` relative to the duration at the max clock (>= 1)."""
        m = self.memory_bound_fraction
        return (1.0 - m) * self.max_clock_mhz / mhz + m

    def compute_power_w(self, mhz: float) -> float:
        x = mhz / self.max_clock_mhz
        voltage = max(self.voltage_floor, x)
        s = self.static_fraction
        return self.max_compute_power_w * (s + (1.0 - s) * x * voltage * voltage)

    def energy_factor(self, mhz: float) -> float:
        """Energy of a computation at `mhz` relative to the max clock."""
        top = self.max_clock_mhz
        return self.compute_power_w(mhz) * self.time_factor(mhz) / self.compute_power_w(top)

    def min_energy_clock(self) -> int:
        return min(self.supported_clocks(), key=self.energy_factor)

    def throttled_clock(self, mhz: int, power_limit_w: float) -> int:
        """Highest supported clock <= mhz whose compute power fits under the power limit."""
        for clock in self.supported_clocks():
            if clock <= mhz and self.compute_power_w(clock) <= power_limit_w:
                return clock
        return self.min_clock_mhz


PRESETS: dict[str, Preset] = {
    SimPreset.A100_SXM.value: Preset(
        key=SimPreset.A100_SXM.value,
        name="NVIDIA A100-SXM4-80GB (simulated)",
        max_clock_mhz=1410,
        min_clock_mhz=210,
        clock_step_mhz=15,
        max_compute_power_w=472.0,
        static_fraction=0.21,
        voltage_floor=0.77,
        memory_bound_fraction=0.20,
        idle_power_w=BLOCKING_POWER_W["a100"],
        default_power_limit_w=500.0,
        power_limit_range_w=(100.0, 500.0),
        source="fitted to examples/profiles/{gpt3-175b,bloom}-a100_sxm.csv",
    ),
    SimPreset.A40.value: Preset(
        key=SimPreset.A40.value,
        name="NVIDIA A40 (simulated)",
        max_clock_mhz=1740,
        min_clock_mhz=210,
        clock_step_mhz=15,
        max_compute_power_w=294.0,
        static_fraction=0.52,
        voltage_floor=0.575,
        memory_bound_fraction=0.67,
        idle_power_w=BLOCKING_POWER_W["a40"],
        default_power_limit_w=300.0,
        power_limit_range_w=(100.0, 300.0),
        source="fitted to examples/profiles/{gpt3-175b,bloom}-a40.csv",
    ),
    SimPreset.H100.value: Preset(
        key=SimPreset.H100.value,
        name="NVIDIA H100 80GB HBM3 (simulated)",
        max_clock_mhz=1980,
        min_clock_mhz=345,
        clock_step_mhz=15,
        max_compute_power_w=690.0,
        static_fraction=0.21,
        voltage_floor=0.72,
        memory_bound_fraction=0.22,
        # Measured (docs/device.md, "Real-GPU check"): an H100 80GB HBM3 waiting in spin kernels, as
        # NCCL's kernels wait for a peer, at the driver's 1980 MHz drew 124 W (an H200 127 W).
        idle_power_w=124.0,
        default_power_limit_w=700.0,
        power_limit_range_w=(200.0, 700.0),
        source="no published profile: A100 SXM shape scaled to H100 SXM clocks and 700 W TDP; "
               "blocking power measured on an H100",
    ),
}


def find_preset(key: str) -> Preset:
    try:
        return PRESETS[key]
    except KeyError:
        raise GPUError(
            f"unknown simulated GPU preset {key!r}; choose one of {', '.join(sorted(PRESETS))}"
        ) from None
