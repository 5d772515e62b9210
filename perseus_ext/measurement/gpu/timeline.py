"""The device timeline: where and when work runs on the GPU, as opposed to when the host asked.

CUDA is asynchronous: the training thread launches kernels and returns; the device executes them
later, in order. A clock set "before a forward" on the host therefore lands somewhere on the
device timeline that may be before, during or after that forward. Everything that wants to know
which clock a computation actually ran at (the runtime, the frequency controller, coverage
accounting) talks to the compute stream through this module:

* `DeviceMarker`: a point on the stream (a CUDA event), reached once the device has executed all
  work launched before it; it carries the device time it was reached.
* `DeviceTimeline`: records markers on the training thread without ever blocking, and (simulated
  GPUs only) launches simulated work with cross-rank dependencies.
* `SwitchLatency`: how long a clock change takes to land.
* `CoverageTally`: how much device compute time ran at its planned clock.

Real GPUs get `CudaTimeline` (torch.cuda events, `cuda_timeline.py`), simulated GPUs their own
asynchronous device (`sim/device.py`: such a GPU is an `OwnTimeline`), and anything else
`HostOnlyTimeline`; `timeline_factory.py` picks one (`open_timeline`), so this abstract module
imports none of its implementations, and asking a GPU whether it brings its own timeline loads no
simulator.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from perseus_ext.measurement.gpu.common import GPUNotSupportedError

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class SwitchLatency:
    """How long a clock change takes to land on the device."""

    switch_s: float  # set call returns -> the clock starts to change
    transition_s: float  # duration of the ramp from the old to the new clock
    call_s: float = 0.0  # how long the set call itself blocks its caller before it returns

    def __post_init__(self) -> None:
        for name in ("switch_s", "transition_s", "call_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and value < float("inf")):
                raise ValueError(f"SwitchLatency.{name}={value!r}; it must be a finite number >= 0")

    @property
    def issue_to_change_s(self) -> float:
        """call_s + switch_s: from issuing the set call until the clock starts to change."""
        return self.call_s + self.switch_s

    @property
    def effective_s(self) -> float:
        """switch_s + transition_s / 2: the step approximation planners use."""
        return self.switch_s + self.transition_s / 2.0


NO_LATENCY = SwitchLatency(0.0, 0.0)

# Published or conservative defaults for real GPUs, matched in order against the NVML name
# (see docs/device.md, "Clock-change latency", for where each number comes from). call_s: the
# NVML set call's own duration, ~10-20 ms (not yet measured here: no GPU could be written to).
NVML_SWITCH_LATENCIES: tuple[tuple[str, SwitchLatency], ...] = (
    ("GH200", SwitchLatency(0.020, 0.010, call_s=0.015)),
    ("H100", SwitchLatency(0.020, 0.010, call_s=0.015)),
    ("H200", SwitchLatency(0.020, 0.010, call_s=0.015)),  # the H100's GH100 chip, more memory
    ("A100", SwitchLatency(0.020, 0.010, call_s=0.015)),
)
CONSERVATIVE_SWITCH_LATENCY = SwitchLatency(0.050, 0.020, call_s=0.020)


@dataclass
class CoverageTally:
    """Device compute time that had a planned clock, and how much ran at exactly that clock."""

    planned_s: float = 0.0  # device compute time that had a planned clock
    covered_s: float = 0.0  # of which ran at exactly that clock

    @property
    def coverage(self) -> float | None:
        """covered / planned, None while nothing was planned."""
        return self.covered_s / self.planned_s if self.planned_s > 0 else None

    def __add__(self, other: CoverageTally) -> CoverageTally:
        return CoverageTally(self.planned_s + other.planned_s, self.covered_s + other.covered_s)

    def __sub__(self, other: CoverageTally) -> CoverageTally:
        return CoverageTally(self.planned_s - other.planned_s, self.covered_s - other.covered_s)


class DeviceMarker(abc.ABC):
    """A point on the compute stream (a CUDA event): reached once the device has executed all work
    launched before it was recorded."""

    @abc.abstractmethod
    def query(self) -> bool:
        """Whether the device has reached the marker; never blocks."""

    @abc.abstractmethod
    def wait(self, timeout_s: float | None = None) -> bool:
        """Block the CALLING thread (the controller's worker) until reached; True if reached."""

    @abc.abstractmethod
    def device_time_s(self) -> float | None:
        """When the device reached it, on the clock of `GPU.timestamp()`; None until reached."""


class DeviceTimeline(abc.ABC):
    """The compute stream the training thread launches work on, as perseus-ext sees it."""

    @abc.abstractmethod
    def record_marker(self) -> DeviceMarker:
        """Training thread: microseconds, never blocks or synchronises."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Host waits until all launched work is done (used only while profiling)."""

    def anchor_at(self, marker: DeviceMarker) -> None:
        """An iteration starts at `marker`: a timeline that measures times from a reference
        (CUDA events) measures later markers from this one once the device has reached it, so
        their precision does not decay over weeks. Never blocks; nothing to do elsewhere."""

    def launch(self, label: str, seconds_at_max_clock: float, *,
               planned_clock_mhz: int | None = None, after: Sequence[str] = (),
               publish: str | None = None) -> None:
        """Launch simulated work (simulated GPUs only; real frameworks launch their own kernels).

        Returns at once unless the launch queue is full. `after`: keys other ranks' devices
        publish that this work waits for ON THE DEVICE; `publish`: key published at completion.
        """
        raise GPUNotSupportedError(
            f"{type(self).__name__} cannot launch simulated work: only a simulated GPU "
            "(PERSEUS_GPU=sim:<preset>) runs work perseus-ext launches; on a real GPU the "
            "framework launches its own kernels"
        )

    def exact_coverage(self) -> CoverageTally | None:
        """Exact coverage tally (simulated devices); None where only an estimate is possible."""
        return None

    def power_bins(self, start_s: float, end_s: float, period_s: float) -> tuple[int, np.ndarray] | None:
        """(first bin, mean watts per bin) of the device's power over the bins
        floor(start / period) .. floor(end / period) - 1 of device time (bin b spans [b period,
        (b + 1) period)), where the device knows its power that finely: the simulated device.
        None elsewhere: a real GPU's default power reading is averaged over a second on H100/H200
        and of unknown rate elsewhere (docs/monitoring.md), not the swing within an iteration."""
        return None

    def close(self) -> None:
        """Release what the timeline holds; markers already recorded stay readable."""


class HostMarker(DeviceMarker):
    """A marker on a timeline without a device: reached the moment it is recorded."""

    def __init__(self, at_s: float) -> None:
        self._at_s = at_s

    def query(self) -> bool:
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        return True

    def device_time_s(self) -> float | None:
        return self._at_s


class HostOnlyTimeline(DeviceTimeline):
    """No device to wait for (no GPU, or no CUDA): markers are reached when recorded."""

    def record_marker(self) -> DeviceMarker:
        return HostMarker(time.perf_counter())

    def synchronize(self) -> None:
        """Nothing runs anywhere but on the host."""


class OwnTimeline(abc.ABC):
    """A GPU that brings its own compute stream and clock-change latency (the simulator's device).

    A real GPU's work is launched by the framework, so its stream is the framework's (CUDA events)
    and its latency a measured default for the model. A GPU that simulates its device instead says
    so by being an `OwnTimeline`; `timeline_factory` asks this, never the simulator's class, so a
    job on real GPUs never imports the simulator.
    """

    switch_latency: SwitchLatency

    @abc.abstractmethod
    def open_timeline(self, *, job_id: str | None = None, rank: int | None = None,
                      peer_timeout_s: float | None = None) -> DeviceTimeline:
        """This GPU's compute stream, joined to the cross-rank dependencies of `job_id`."""
