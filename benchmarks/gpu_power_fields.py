"""gpu_check's `power_fields` section: which NVML power readings the GPU offers and how often
each really changes, read-only.

Why: a power swing (peak to trough within an iteration, the largest ramp) can only be measured
from readings that follow the power within an iteration. NVML's default reading,
`nvmlDeviceGetPowerUsage`, is a one-second average on H100/H200 and Ampere other than A100 (NVML's
documentation; instantaneous on A100 and older, at the sensor's rate); newer drivers add
field values for an instantaneous (`NVML_FI_DEV_POWER_INSTANT`) and an averaged
(`NVML_FI_DEV_POWER_AVERAGE`) reading, the driver keeps a buffer of its own power samples
(`nvmlDeviceGetSamples(NVML_TOTAL_POWER_SAMPLES)`), and the energy counter
(`nvmlDeviceGetTotalEnergyConsumption`) gives the mean power between two of its updates. Which of
these a lent GPU answers, and how often each changes, decides what perseus-ext can honestly
report there (docs/monitoring.md).

Every source is polled in turn for `sample_s` seconds. A source's update period is the median
time between two reads that returned a new value (host clock) and, where the driver stamps its
readings (field values, the sample buffer), the median step between distinct driver timestamps.
Only NVML reads are called; the guard of gpu_check refuses any write before this runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from gpu_check_support import stats

POLL_S = 0.001  # between two rounds of reads: far below any update period NVML documents


@dataclass
class _Source:
    """One NVML power reading and what polling it showed."""

    name: str
    unit: str
    what: str
    read: Callable[[], tuple[float, int | None]]  # (value, driver timestamp in microseconds or None)
    error: str | None = None
    values: list[float] = field(default_factory=list)
    change_times_s: list[float] = field(default_factory=list)
    stamps_us: list[int] = field(default_factory=list)
    read_us: list[float] = field(default_factory=list)

    def poll(self) -> None:
        if self.error is not None:
            return
        began = time.perf_counter()
        try:
            value, stamp = self.read()
        except Exception as err:  # noqa: BLE001 - an unsupported reading is a finding, not a failure
            self.error = f"{type(err).__name__}: {err}"
            return
        now = time.perf_counter()
        self.read_us.append((now - began) * 1e6)
        if not self.values or value != self.values[-1]:
            self.change_times_s.append(now)
        self.values.append(value)
        if stamp is not None and (not self.stamps_us or stamp != self.stamps_us[-1]):
            self.stamps_us.append(stamp)

    def figures(self) -> dict[str, Any]:
        if self.error is not None and not self.values:
            return {"available": False, "what": self.what, "error": self.error}
        periods_ms = [1000.0 * p for p in np.diff(self.change_times_s[1:])]  # the first read is no change
        result: dict[str, Any] = {
            "available": True, "what": self.what, "unit": self.unit, "reads": len(self.values),
            "distinct_values": len(set(self.values)), "value_changes": max(0, len(self.change_times_s) - 1),
            "update_period_ms_from_changes": stats(periods_ms),
            "min": min(self.values), "max": max(self.values), "read_us": stats(self.read_us),
        }
        if self.stamps_us:
            steps_ms = [d / 1000.0 for d in np.diff(self.stamps_us)]
            result.update(driver_timestamps=len(self.stamps_us), update_period_ms_from_timestamps=stats(steps_ms))
        if self.error is not None:
            result["error_later"] = self.error
        return result


def _field_reader(nvml: Any, handle: Any, field_id: int, scale: float) -> Callable[[], tuple[float, int | None]]:
    """A reader of one NVML field value (its own return code checked: a field the driver does
    not know answers NOT_SUPPORTED there, not as an exception)."""
    def read() -> tuple[float, int | None]:
        (value,) = nvml.nvmlDeviceGetFieldValues(handle, [field_id])
        if value.nvmlReturn != 0:
            raise RuntimeError(f"field {field_id}: NVML return code {value.nvmlReturn}")
        raw = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}[value.valueType]
        return float(getattr(value.value, raw)) * scale, int(value.timestamp)
    return read


class _SampleBuffer:
    """The driver's own buffer of power samples (`nvmlDeviceGetSamples`), read since the last
    sample seen: every sample it returns is one the driver took, with its timestamp."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle
        self.last_us = 0
        self.samples: list[tuple[int, float]] = []
        self.error: str | None = None

    def poll(self) -> None:
        if self.error is not None:
            return
        try:
            value_type, samples = self.nvml.nvmlDeviceGetSamples(self.handle, self.nvml.NVML_TOTAL_POWER_SAMPLES,
                                                                 self.last_us)
        except Exception as err:  # noqa: BLE001 - NOT_FOUND before the first sample is normal; others are findings
            if getattr(err, "value", None) != getattr(self.nvml, "NVML_ERROR_NOT_FOUND", -1):
                self.error = f"{type(err).__name__}: {err}"
            return
        raw = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}[value_type]
        for sample in samples:
            stamp = int(sample.timeStamp)
            if stamp > self.last_us:
                self.samples.append((stamp, float(getattr(sample.sampleValue, raw)) / 1000.0))
                self.last_us = stamp

    def figures(self) -> dict[str, Any]:
        what = "the driver's buffer of its own power samples, each with its timestamp (nvmlDeviceGetSamples)"
        if self.error is not None and not self.samples:
            return {"available": False, "what": what, "error": self.error}
        stamps = [s for s, _ in self.samples]
        values = [v for _, v in self.samples]
        return {"available": bool(self.samples), "what": what, "unit": "W", "samples": len(self.samples),
                "distinct_values": len(set(values)),
                "sample_period_ms": stats([d / 1000.0 for d in np.diff(stamps)]),
                "min": min(values) if values else None, "max": max(values) if values else None}


def section_power_fields(nvml: Any, uuid: str, deadline: float, sample_s: float = 2.0) -> dict[str, Any]:
    """Which power readings the GPU answers and their observed update rates (module doc)."""
    handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
    sources = [
        _Source("power_usage", "W", "nvmlDeviceGetPowerUsage, NVML's default reading (averaged on recent GPUs)",
                lambda: (nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0, None)),
        _Source("total_energy", "mJ", "nvmlDeviceGetTotalEnergyConsumption: mean power between two updates",
                lambda: (float(nvml.nvmlDeviceGetTotalEnergyConsumption(handle)), None)),
    ]
    for name, constant, what in (
        ("field_power_instant", "NVML_FI_DEV_POWER_INSTANT", "field value: instantaneous power (newer drivers)"),
        ("field_power_average", "NVML_FI_DEV_POWER_AVERAGE", "field value: averaged power (newer drivers)"),
    ):
        field_id = getattr(nvml, constant, None)
        source = _Source(name, "W", what, _field_reader(nvml, handle, field_id, 1e-3) if field_id is not None
                         else lambda: (0.0, None))
        if field_id is None:
            source.error = f"this pynvml has no {constant} (older NVML)"
        sources.append(source)
    buffer = _SampleBuffer(nvml, handle)
    end = min(deadline, time.perf_counter() + sample_s)
    rounds = 0
    while time.perf_counter() < end:
        for source in sources:
            source.poll()
        buffer.poll()
        rounds += 1
        time.sleep(POLL_S)
    result: dict[str, Any] = {"sampled_s": sample_s, "rounds": rounds}
    result.update({source.name: source.figures() for source in sources})
    result["power_samples_buffer"] = buffer.figures()
    return result
