"""What `gpu_check.py` needs besides its measurements: the NVML write guard, the JSON written as
it goes, section budgets, and the fakes of its `--cpu` mode.

The guard exists because the check runs on a GPU lent to us: it must never change a clock, a
power limit or any other setting, whatever perseus-ext or a bug in it asks for. Every pynvml
function that writes (`nvmlDeviceSet*`, `nvmlDeviceReset*`, `nvmlDeviceClear*`, MIG instance
creation, ...) is replaced with one that raises, and so is pynvml's lookup of the C entry points
of those names, so a write cannot reach the driver by any path through pynvml.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
import traceback
import types
from typing import Any, Callable

import numpy as np

# A write is any NVML entry point whose name has one of these verbs (before any "Get").
_WRITE = re.compile(r"^nvml(?:(?!Get)[A-Za-z0-9])*?"
                    r"(Set|Reset|Clear|Create|Destroy|Modify|Remove|Discover|Freeze|Activate|Update|Force|"
                    r"ReadWrite|Register|Validate)(?=[A-Z_0-9]|$)")


class GuardError(RuntimeError):
    """An NVML write was attempted while the guard was installed."""


def is_write(name: str) -> bool:
    """Whether the NVML function `name` changes something on the device."""
    return bool(_WRITE.match(name))


def install_nvml_guard(nvml: Any, attempts: list[str]) -> list[str]:
    """Replace every writing function of the pynvml module `nvml` with one that raises GuardError
    (and records the name in `attempts`); returns the names replaced."""
    replaced = []

    def refuse(name: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            attempts.append(name)
            raise GuardError(f"gpu_check: {name} is blocked: this check never changes a GPU setting")

        refused.__name__ = name
        return refused

    for name in sorted(set(dir(nvml)) | set(dir(type(nvml)))):  # a module, or (--cpu) a fake's class
        if is_write(name) and callable(getattr(nvml, name, None)):
            setattr(nvml, name, refuse(name))
            replaced.append(name)
    lookup = getattr(nvml, "_nvmlGetFunctionPointer", None)
    if callable(lookup):  # the C entry points behind every wrapper: also refuse the writes there
        def guarded_lookup(name: Any) -> Any:
            text = name.decode() if isinstance(name, bytes) else str(name)
            if is_write(text):
                attempts.append(text)
                raise GuardError(f"gpu_check: NVML entry point {text} is blocked")
            return lookup(name)

        nvml._nvmlGetFunctionPointer = guarded_lookup
        replaced.append("_nvmlGetFunctionPointer")
    return replaced


class Report:
    """The figures, written to the JSON file after every section (a crash still leaves them)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                     "sections": {}}
        self._lock = threading.Lock()
        self.write()

    def section(self, name: str, figures: dict[str, Any]) -> None:
        with self._lock:
            self.data["sections"][name] = figures
        self.write()

    def set(self, key: str, value: Any) -> None:
        with self._lock:
            self.data[key] = value
        self.write()

    def write(self) -> None:
        if self.path is None:
            return
        with self._lock:
            text = json.dumps(self.data, indent=2, default=str)
        temporary = f"{self.path}.tmp"
        with open(temporary, "w") as handle:
            handle.write(text)
        os.replace(temporary, self.path)


class Budget:
    """Seconds left for the whole run and for one section."""

    def __init__(self, total_s: float) -> None:
        self.deadline = time.perf_counter() + total_s

    def left_s(self) -> float:
        return self.deadline - time.perf_counter()

    def section(self, wanted_s: float) -> float:
        """The deadline (perf_counter) of a section that wants `wanted_s` seconds."""
        return time.perf_counter() + max(0.0, min(wanted_s, self.left_s()))


def stats(values: list[float], digits: int = 3) -> dict[str, Any]:
    """median, p99, max and count of `values` (None when empty)."""
    if not values:
        return {"median": None, "p99": None, "max": None, "n": 0}
    array = np.asarray(values, dtype=float)
    return {"median": round(float(np.median(array)), digits), "p99": round(float(np.percentile(array, 99)), digits),
            "max": round(float(array.max()), digits), "n": int(array.size)}


# ----------------------------------------------------------------------------- the device and its work
class Machine:
    """The device under test: torch's CUDA, or (--cpu) torch on the CPU with fake events."""

    def __init__(self, cpu: bool) -> None:
        import torch

        self.torch = torch
        self.cpu = cpu
        self.cuda = FakeCuda() if cpu else torch.cuda
        self.device = "cpu" if cpu else "cuda"
        self.dtype = torch.float32 if cpu else torch.bfloat16

    def synchronize(self) -> None:
        self.cuda.synchronize()

    def timeline(self) -> Any:
        from perseus_ext.measurement.gpu.cuda_timeline import CudaTimeline

        return CudaTimeline(self.cuda)


def build_blocks(machine: Machine, layers: int, hidden: int) -> Any:
    """`layers` transformer blocks (FFN 4 x hidden, 128-wide heads) on the device."""
    torch = machine.torch
    heads = max(1, hidden // 128)
    return torch.nn.ModuleList(
        torch.nn.TransformerEncoderLayer(hidden, nhead=heads, dim_feedforward=4 * hidden, batch_first=True,
                                         dropout=0.0)
        for _ in range(layers)).to(device=machine.device, dtype=machine.dtype)


def backward_through(machine: Machine, block: Any, output: Any, inputs: Any, grad: Any) -> Any:
    """A real backward of one block: input AND weight gradients; returns the input gradient."""
    params = [p for p in block.parameters() if p.requires_grad]
    machine.torch.autograd.backward(output, grad, inputs=[inputs, *params])
    return inputs.grad


# ----------------------------------------------------------------------------- --cpu fakes
class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"fake NVML error {value}")
        self.value = value


class FakeNVML(types.ModuleType):
    """A pynvml of one GPU for `--cpu`: reads answer from a model (an energy counter that updates
    every 20 ms at 300 W); writes exist, as in pynvml, so the guard has something to block."""

    NVMLError = FakeNVMLError
    NVML_ERROR_NO_PERMISSION = 4
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_CLOCK_SM = 1
    UPDATE_S = 0.02
    POWER_W = 300.0

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.device = types.SimpleNamespace(uuid="GPU-00000000-0000-0000-0000-00000000c0de", bus_id="00000000:07:00.0")
        self.writes: list[str] = []  # writes that reached the fake (the guard must keep this empty)
        self._born = time.perf_counter()

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlSystemGetDriverVersion(self) -> str:
        return "fake (--cpu)"

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return self.device

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        if uuid != self.device.uuid:
            raise FakeNVMLError(6)
        return self.device

    def nvmlDeviceGetUUID(self, device: Any) -> str:
        return device.uuid

    def nvmlDeviceGetName(self, device: Any) -> str:
        return "Fake H100 (gpu_check --cpu)"

    def nvmlDeviceGetPciInfo(self, device: Any) -> Any:
        return types.SimpleNamespace(busId=device.bus_id)

    def nvmlDeviceGetMigMode(self, device: Any) -> tuple[int, int]:
        return 0, 0

    def nvmlDeviceGetSupportedMemoryClocks(self, device: Any) -> list[int]:
        return [2619]

    def nvmlDeviceGetSupportedGraphicsClocks(self, device: Any, memory_clock: int) -> list[int]:
        return list(range(1980, 344, -15))

    def nvmlDeviceGetTotalEnergyConsumption(self, device: Any) -> int:
        updates = int((time.perf_counter() - self._born) / self.UPDATE_S)
        return int(updates * self.UPDATE_S * self.POWER_W * 1000)

    def nvmlDeviceGetPowerUsage(self, device: Any) -> int:
        return int(self.POWER_W * 1000)

    def nvmlDeviceGetClockInfo(self, device: Any, which: int) -> int:
        return 1980

    # The power readings of newer drivers: an instantaneous field updated with the counter (every
    # UPDATE_S, alternating POWER_W -/+ INSTANT_SWING_W), an averaged field updated every
    # AVERAGE_S, and the driver's sample buffer (one sample per UPDATE_S, as the instant field).
    NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION = 83
    NVML_FI_DEV_POWER_AVERAGE = 185
    NVML_FI_DEV_POWER_INSTANT = 186
    NVML_TOTAL_POWER_SAMPLES = 0
    NVML_ERROR_NOT_FOUND = 6
    INSTANT_SWING_W = 40.0
    AVERAGE_S = 1.0

    def _instant_mw(self, update: int) -> int:
        return int((self.POWER_W + (self.INSTANT_SWING_W if update % 2 else -self.INSTANT_SWING_W)) * 1000)

    def nvmlDeviceGetFieldValues(self, device: Any, field_ids: list[int]) -> list[Any]:
        age_s = time.perf_counter() - self._born
        values = []
        for field_id in field_ids:
            period = self.AVERAGE_S if field_id == self.NVML_FI_DEV_POWER_AVERAGE else self.UPDATE_S
            update = int(age_s / period)
            reading = {self.NVML_FI_DEV_POWER_INSTANT: self._instant_mw(update),
                       self.NVML_FI_DEV_POWER_AVERAGE: int(self.POWER_W * 1000),
                       self.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION: self.nvmlDeviceGetTotalEnergyConsumption(device)}
            known = field_id in reading
            values.append(types.SimpleNamespace(
                fieldId=field_id, scopeId=0, timestamp=int(update * period * 1e6), latencyUsec=0, valueType=1,
                nvmlReturn=0 if known else self.NVML_ERROR_NOT_SUPPORTED,
                value=types.SimpleNamespace(uiVal=reading.get(field_id, 0))))
        return values

    def nvmlDeviceGetSamples(self, device: Any, sampling_type: int, last_seen_us: int) -> tuple[int, list[Any]]:
        if sampling_type != self.NVML_TOTAL_POWER_SAMPLES:
            raise FakeNVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        updates = int((time.perf_counter() - self._born) / self.UPDATE_S)
        stamps = [(k, int(k * self.UPDATE_S * 1e6)) for k in range(max(0, updates - 99), updates + 1)]
        samples = [types.SimpleNamespace(timeStamp=stamp, sampleValue=types.SimpleNamespace(uiVal=self._instant_mw(k)))
                   for k, stamp in stamps if stamp > last_seen_us]
        if not samples:
            raise FakeNVMLError(self.NVML_ERROR_NOT_FOUND)
        return 1, samples

    def nvmlDeviceGetPowerManagementLimit(self, device: Any) -> int:
        return 700_000

    def nvmlDeviceGetPowerManagementLimitConstraints(self, device: Any) -> tuple[int, int]:
        return 200_000, 700_000

    def nvmlDeviceGetPowerManagementDefaultLimit(self, device: Any) -> int:
        return 700_000

    def nvmlDeviceSetGpuLockedClocks(self, device: Any, low: int, high: int) -> None:
        self.writes.append("nvmlDeviceSetGpuLockedClocks")

    def nvmlDeviceResetGpuLockedClocks(self, device: Any) -> None:
        self.writes.append("nvmlDeviceResetGpuLockedClocks")

    def nvmlDeviceSetPowerManagementLimit(self, device: Any, milliwatts: int) -> None:
        self.writes.append("nvmlDeviceSetPowerManagementLimit")

    def nvmlDeviceSetApplicationsClocks(self, device: Any, memory: int, graphics: int) -> None:
        self.writes.append("nvmlDeviceSetApplicationsClocks")

    def nvmlDeviceClearEccErrorCounts(self, device: Any, counter: int) -> None:
        self.writes.append("nvmlDeviceClearEccErrorCounts")


class FakeEvent:
    """A CUDA event on a device that runs each kernel as it is launched (the CPU): reached when
    recorded; `elapsed_time` in float32 milliseconds, as CUDA returns it."""

    def __init__(self, enable_timing: bool = True) -> None:
        self._at_s: float | None = None

    def record(self, stream: Any = None) -> None:
        self._at_s = time.perf_counter()

    def query(self) -> bool:
        return self._at_s is not None

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "FakeEvent") -> float:
        return float(np.float32((end._at_s - self._at_s) * 1000.0))


class FakeCuda(types.SimpleNamespace):
    """The slice of `torch.cuda` the check and `CudaTimeline` use, for `--cpu`."""

    def __init__(self) -> None:
        super().__init__(Event=FakeEvent)

    @staticmethod
    def synchronize() -> None:
        pass


def install_fake_nvml() -> FakeNVML:
    fake = FakeNVML()
    sys.modules["pynvml"] = fake
    return fake


# ----------------------------------------------------------------------------- the guard drill and the driver
def guard_drill(gpu: Any, fake_nvml: Any, attempts: list[str]) -> dict[str, Any]:
    """(--cpu only) A controller that is NOT in dry-run sets a clock and resets it on the fake GPU:
    the guard must refuse both writes before they reach NVML, and the controller fall back."""
    from perseus_ext.actuation.controller import FrequencyController

    logging.getLogger("perseus_ext").setLevel(logging.CRITICAL)  # the fallback's warning is expected
    try:
        controller = FrequencyController(gpu, dry_run=False, watchdog=False, handle_signals=False)
        controller.set_clock(gpu.supported_sm_clocks()[-1])
        controller.flush(5)
        controller.close()
    finally:
        logging.getLogger("perseus_ext").setLevel(logging.NOTSET)
    return {"blocked": sorted(set(attempts)), "reached_nvml": list(fake_nvml.writes),
            "controller_errors": controller.error_count, "disabled_reason": controller.disabled_reason}


def print_table(report: Report) -> None:
    print()
    print(f"{'section':<16} {'figure':<38} value")
    print("-" * 90)
    for section, figures in report.data["sections"].items():
        for key, value in figures.items():
            if isinstance(value, dict) and "median" in value:
                text = f"median {value['median']}  p99 {value['p99']}  max {value['max']}  (n={value['n']})"
            elif isinstance(value, float):
                text = f"{value:.4g}"
            else:
                text = str(value)
            print(f"{section:<16} {key:<38} {text[:200]}")
            section = ""
    print(flush=True)


def run_section(report: Report, name: str, budget: Budget, wanted_s: float, body: Any) -> Any:
    """Run one section with its own deadline; its figures or its error go to the report."""
    if budget.left_s() < 1.0:
        report.section(name, {"skipped": "out of time"})
        return None
    began = time.perf_counter()
    print(f"[gpu_check] {name} (up to {min(wanted_s, budget.left_s()):.0f} s) ...", flush=True)
    try:
        figures = body(budget.section(wanted_s))
    except Exception as err:  # noqa: BLE001 - a section's failure must not lose the others
        figures = {"error": repr(err), "traceback": traceback.format_exc(limit=8)}
    figures["section_s"] = round(time.perf_counter() - began, 2)
    report.section(name, figures)
    return figures
