"""Real GPUs through NVML (the `nvidia-ml-py` package, imported as `pynvml`).

The hard part is not the NVML calls but picking the right device: CUDA and NVML number GPUs
differently (CUDA_VISIBLE_DEVICES remaps, CUDA may order fastest-first), so this module maps the
process's CUDA ordinal to an NVML handle through UUIDs or PCI bus ids, never "NVML index = rank".
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

from perseus_ext.measurement.gpu.common import (
    GPU,
    DeviceAddress,
    GPUError,
    GPUNotSupportedError,
    GPUPermissionError,
    GPUUnavailableError,
    PERMISSION_HELP,
    SIMULATED_HINT,
    check_clock,
    normalise_pci_bus_id,
)
from perseus_ext.measurement.gpu.restore_spec import NVMLRestoreSpec

logger = logging.getLogger(__name__)

CAP_SYS_ADMIN = 21  # bit of CapEff in /proc/self/status


def _load_pynvml() -> Any:
    try:
        import pynvml
    except ImportError:
        raise GPUUnavailableError(
            "the NVML backend needs nvidia-ml-py (pip install nvidia-ml-py; perseus-ext installs it unless it was removed); "
            + SIMULATED_HINT
        ) from None
    return pynvml


def _init(nvml: Any) -> None:
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as err:
        raise GPUUnavailableError(
            f"NVML could not start ({err}): no NVIDIA driver or GPU is available to this process; "
            + SIMULATED_HINT
        ) from None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class NVMLGPU(GPU):
    """The NVIDIA GPU that CUDA device `local_rank` of this process runs on."""

    def __init__(self, local_rank: int = 0) -> None:
        self._nvml = _load_pynvml()
        _init(self._nvml)
        try:
            self._setup(resolve_cuda_device(self._nvml, local_rank))
        except BaseException:
            self._nvml.nvmlShutdown()
            raise

    @classmethod
    def from_uuid(cls, uuid: str) -> "NVMLGPU":
        """Open a GPU by NVML UUID (used by the watchdog process, which has no CUDA context)."""
        self = cls.__new__(cls)
        self._nvml = _load_pynvml()
        _init(self._nvml)
        self._setup(self._call(f"find GPU {uuid}", self._nvml.nvmlDeviceGetHandleByUUID, uuid))
        return self

    def _setup(self, handle: Any) -> None:
        nvml = self._nvml
        self._handle = handle
        self.name = _text(self._call("read the device name", nvml.nvmlDeviceGetName, handle))
        self.uuid = _text(self._call("read the device UUID", nvml.nvmlDeviceGetUUID, handle))
        _reject_mig(nvml, handle, self.name)
        self._clocks: list[int] | None = None

    # ----------------------------------------------------------------- error mapping
    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        nvml = self._nvml
        try:
            return fn(*args)
        except nvml.NVMLError as err:
            code = getattr(err, "value", None)
            where = f"{getattr(self, 'name', 'GPU')}: NVML could not {what} ({err})"
            if code == nvml.NVML_ERROR_NO_PERMISSION:
                raise GPUPermissionError(f"{where}; {PERMISSION_HELP}") from None
            if code == nvml.NVML_ERROR_NOT_SUPPORTED:
                raise GPUNotSupportedError(
                    f"{where}; this GPU or driver does not support it (locked clocks and the "
                    f"energy counter need a Volta or newer data-center GPU)"
                ) from None
            if code in (nvml.NVML_ERROR_LIBRARY_NOT_FOUND, nvml.NVML_ERROR_DRIVER_NOT_LOADED):
                raise GPUUnavailableError(f"{where}; {SIMULATED_HINT}") from None
            raise GPUError(where) from None

    # ----------------------------------------------------------------- GPU API
    def supported_sm_clocks(self) -> list[int]:
        if self._clocks is None:
            nvml = self._nvml
            memory = self._call(
                "list memory clocks", nvml.nvmlDeviceGetSupportedMemoryClocks, self._handle
            )
            if not memory:
                raise GPUNotSupportedError(f"{self.name}: NVML reports no supported memory clocks")
            clocks = self._call(
                "list SM clocks", nvml.nvmlDeviceGetSupportedGraphicsClocks, self._handle, max(memory)
            )
            if not clocks:
                raise GPUNotSupportedError(f"{self.name}: NVML reports no supported SM clocks")
            self._clocks = sorted({int(c) for c in clocks}, reverse=True)
        return list(self._clocks)

    def set_locked_sm_clocks(self, mhz: int) -> None:
        mhz = check_clock(self, mhz, self.supported_sm_clocks())
        self._call(
            f"lock SM clocks to {mhz} MHz", self._nvml.nvmlDeviceSetGpuLockedClocks,
            self._handle, mhz, mhz,
        )

    def reset_locked_sm_clocks(self) -> None:
        self._call("reset locked SM clocks", self._nvml.nvmlDeviceResetGpuLockedClocks, self._handle)

    def energy_mj(self) -> int:
        return int(
            self._call(
                "read the energy counter",
                self._nvml.nvmlDeviceGetTotalEnergyConsumption,
                self._handle,
            )
        )

    def power_w(self) -> float:
        return self._call("read power", self._nvml.nvmlDeviceGetPowerUsage, self._handle) / 1000.0

    def sm_clock(self) -> int:
        nvml = self._nvml
        return int(
            self._call("read the SM clock", nvml.nvmlDeviceGetClockInfo, self._handle, nvml.NVML_CLOCK_SM)
        )

    def power_limit_w(self) -> float:
        milliwatts = self._call(
            "read the power limit", self._nvml.nvmlDeviceGetPowerManagementLimit, self._handle
        )
        return milliwatts / 1000.0

    def power_limit_range_w(self) -> tuple[float, float]:
        low, high = self._call(
            "read the power limit range",
            self._nvml.nvmlDeviceGetPowerManagementLimitConstraints,
            self._handle,
        )
        return low / 1000.0, high / 1000.0

    def default_power_limit_w(self) -> float:
        milliwatts = self._call(
            "read the default power limit",
            self._nvml.nvmlDeviceGetPowerManagementDefaultLimit,
            self._handle,
        )
        return milliwatts / 1000.0

    def set_power_limit_w(self, watts: float) -> None:
        low, high = self.power_limit_range_w()
        if not low <= watts <= high:
            raise GPUError(
                f"{self.name}: power limit {watts} W is outside the supported range {low:g}-{high:g} W"
            )
        self._call(
            f"set the power limit to {watts} W",
            self._nvml.nvmlDeviceSetPowerManagementLimit,
            self._handle,
            int(round(watts * 1000)),
        )

    def can_set_clocks(self) -> bool:
        return has_clock_privilege()

    def address(self) -> DeviceAddress:
        nvml = self._nvml
        bus_id = _text(self._call("read the PCI bus id", nvml.nvmlDeviceGetPciInfo, self._handle).busId)
        index = int(self._call("read the NVML index", nvml.nvmlDeviceGetIndex, self._handle))
        return DeviceAddress(normalise_pci_bus_id(bus_id), index)

    def restore_spec(self) -> NVMLRestoreSpec:
        return NVMLRestoreSpec(uuid=self.uuid)

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as err:
            logger.debug("nvmlShutdown failed: %s", err)


def has_clock_privilege(status_path: str = "/proc/self/status") -> bool:
    """Whether this process holds what NVML needs to lock clocks: CAP_SYS_ADMIN (root has it).

    Reads the effective capability set instead of trying a clock change, so the probe never
    touches the GPU.
    """
    try:
        with open(status_path, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    geteuid = getattr(os, "geteuid", None)
    return geteuid is None or geteuid() == 0


def _reject_mig(nvml: Any, handle: Any, name: str) -> None:
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError as err:
        if getattr(err, "value", None) in (
            nvml.NVML_ERROR_NOT_SUPPORTED, getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)
        ):
            return  # pre-Ampere GPUs (or old drivers) do not know MIG at all
        raise GPUError(f"{name}: NVML could not read the MIG mode ({err})") from None
    if current == nvml.NVML_DEVICE_MIG_ENABLE:
        raise GPUNotSupportedError(
            f"{name}: MIG mode is enabled; SM clocks are shared by all MIG slices and cannot be "
            f"locked per slice. Disable MIG (`sudo nvidia-smi -i <gpu> -mig 0`) to use "
            f"perseus-ext frequency control"
        )


# --------------------------------------------------------------------------- device mapping
def resolve_cuda_device(nvml: Any, cuda_ordinal: int) -> Any:
    """NVML handle of CUDA device `cuda_ordinal` of this process.

    Preference order: the UUID CUDA itself reports (when torch already initialised CUDA), then
    CUDA_VISIBLE_DEVICES (UUIDs or physical indices), then CUDA's own enumeration order.
    """
    if cuda_ordinal < 0:
        raise GPUError(f"CUDA device ordinal {cuda_ordinal} is negative; pass the local rank")
    uuid = _torch_device_uuid(cuda_ordinal)
    if uuid is not None:
        return _handle_by_uuid_prefix(nvml, uuid)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return _physical_device(nvml, cuda_ordinal)
    entries = _visible_entries(visible)
    if cuda_ordinal >= len(entries):
        raise GPUUnavailableError(
            f"this process uses CUDA device {cuda_ordinal} but CUDA_VISIBLE_DEVICES={visible!r} "
            f"makes only {len(entries)} device(s) visible; fix CUDA_VISIBLE_DEVICES or the local "
            f"rank, or {SIMULATED_HINT}"
        )
    entry = entries[cuda_ordinal]
    if entry.upper().startswith("MIG-"):
        raise GPUNotSupportedError(
            f"CUDA_VISIBLE_DEVICES entry {entry!r} is a MIG slice; SM clocks cannot be locked per "
            f"MIG slice. Use whole GPUs to use perseus-ext frequency control"
        )
    if entry.upper().startswith("GPU-"):
        return _handle_by_uuid_prefix(nvml, entry)
    return _physical_device(nvml, int(entry))


def _visible_entries(visible: str) -> list[str]:
    """CUDA's reading of CUDA_VISIBLE_DEVICES: entries up to the first malformed one."""
    entries = []
    for raw in visible.split(","):
        entry = raw.strip()
        if not (entry.isdigit() or entry.upper().startswith(("GPU-", "MIG-"))):
            break  # CUDA ignores this entry and everything after it
        entries.append(entry)
    return entries


def _torch_device_uuid(cuda_ordinal: int) -> str | None:
    """UUID of the CUDA device from torch, only if torch has already initialised CUDA."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None  # initialising CUDA here could break a later fork
        uuid = getattr(torch.cuda.get_device_properties(cuda_ordinal), "uuid", None)
    except Exception as exc:  # torch raises several types for bad ordinals/no driver
        logger.debug("torch could not report the UUID of CUDA device %d: %s", cuda_ordinal, exc)
        return None
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.upper().startswith(("GPU-", "MIG-")) else "GPU-" + text


def _all_devices(nvml: Any) -> list[tuple[Any, str, str, str]]:
    """(handle, uuid, pci bus id, name) of every GPU NVML sees."""
    devices = []
    count = nvml.nvmlDeviceGetCount()
    for index in range(count):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        bus_id = _text(nvml.nvmlDeviceGetPciInfo(handle).busId).lower()
        devices.append((handle, uuid, bus_id, _text(nvml.nvmlDeviceGetName(handle))))
    return devices


def _handle_by_uuid_prefix(nvml: Any, uuid: str) -> Any:
    if uuid.upper().startswith("MIG-"):
        raise GPUNotSupportedError(
            f"CUDA device {uuid} is a MIG slice; SM clocks cannot be locked per MIG slice"
        )
    try:
        matches = [d for d in _all_devices(nvml) if d[1].lower().startswith(uuid.lower())]
    except nvml.NVMLError as err:
        raise GPUUnavailableError(f"NVML could not list GPUs ({err}); {SIMULATED_HINT}") from None
    if len(matches) != 1:
        raise GPUUnavailableError(
            f"GPU {uuid!r} matches {len(matches)} NVML device(s); CUDA_VISIBLE_DEVICES must name "
            f"exactly one GPU per entry (see `nvidia-smi -L`)"
        )
    return matches[0][0]


def _physical_device(nvml: Any, index: int) -> Any:
    """CUDA's physical device `index`: PCI bus order (what CUDA uses for identical GPUs)."""
    try:
        devices = sorted(_all_devices(nvml), key=lambda d: d[2])
    except nvml.NVMLError as err:
        raise GPUUnavailableError(f"NVML could not list GPUs ({err}); {SIMULATED_HINT}") from None
    if index >= len(devices):
        raise GPUUnavailableError(
            f"CUDA device {index} does not exist: NVML sees {len(devices)} GPU(s); {SIMULATED_HINT}"
        )
    names = {d[3] for d in devices}
    if len(names) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        raise GPUError(
            f"GPUs of different models ({', '.join(sorted(names))}) are installed and CUDA orders "
            f"them fastest-first, so CUDA device {index} cannot be matched to NVML safely; set "
            f"CUDA_DEVICE_ORDER=PCI_BUS_ID or list GPU UUIDs in CUDA_VISIBLE_DEVICES"
        )
    return devices[index][0]
