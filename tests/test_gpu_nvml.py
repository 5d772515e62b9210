"""NVML backend against a fake `pynvml` module: device mapping, MIG, errors, permission probe."""

from __future__ import annotations

import logging
import sys
import types
from dataclasses import dataclass, field

import pytest

from perseus_ext.actuation.controller import FrequencyController, open_controller
from perseus_ext.measurement.gpu import (
    GPUError,
    GPUNotSupportedError,
    GPUPermissionError,
    GPUUnavailableError,
    NVMLRestoreSpec,
    open_gpu,
)
from perseus_ext.measurement.gpu.nvml import NVMLGPU, has_clock_privilege
from perseus_ext.measurement.windows import EnergyMeter, MeasurementWindow

NO_PERMISSION, NOT_SUPPORTED, LIBRARY_NOT_FOUND, UNKNOWN = 4, 3, 12, 999


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"fake NVML error {value}")
        self.value = value


@dataclass
class FakeDevice:
    uuid: str
    bus_id: str
    name: str = "NVIDIA A100-SXM4-80GB"
    mig: int = 0
    locked: tuple[int, int] | None = None
    power_limit_mw: int = 400_000
    energy_mj: int = 123_456
    calls: list[str] = field(default_factory=list)


class FakeNVML(types.ModuleType):
    """The subset of pynvml the backend uses; `fail` maps a function name to an NVML error code."""

    NVMLError = FakeNVMLError
    NVML_ERROR_NO_PERMISSION = NO_PERMISSION
    NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    NVML_ERROR_LIBRARY_NOT_FOUND = LIBRARY_NOT_FOUND
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_CLOCK_SM = 1

    def __init__(self, devices: list[FakeDevice]) -> None:
        super().__init__("pynvml")
        self.devices = devices  # in NVML index order
        self.fail: dict[str, int] = {}
        self.initialised = 0

    def __getattribute__(self, name: str):
        fail = object.__getattribute__(self, "fail")
        if name in fail:
            code = fail[name]

            def failing(*args, **kwargs):
                raise FakeNVMLError(code)

            return failing
        return object.__getattribute__(self, name)

    def nvmlInit(self):
        self.initialised += 1

    def nvmlShutdown(self):
        self.initialised -= 1

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.devices[index]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for device in self.devices:
            if device.uuid == uuid:
                return device
        raise FakeNVMLError(6)

    def nvmlDeviceGetUUID(self, device):
        return device.uuid

    def nvmlDeviceGetName(self, device):
        return device.name.encode()  # old pynvml versions return bytes

    def nvmlDeviceGetPciInfo(self, device):
        return types.SimpleNamespace(busId=device.bus_id)

    def nvmlDeviceGetMigMode(self, device):
        if device.mig < 0:
            raise FakeNVMLError(NOT_SUPPORTED)
        return device.mig, device.mig

    def nvmlDeviceGetSupportedMemoryClocks(self, device):
        return [1215, 1593, 405]

    def nvmlDeviceGetSupportedGraphicsClocks(self, device, memory_clock):
        top = 1410 if memory_clock == 1593 else 1000
        return list(range(210, top + 1, 15))

    def nvmlDeviceSetGpuLockedClocks(self, device, low, high):
        device.calls.append(f"lock {low} {high}")
        device.locked = (low, high)

    def nvmlDeviceResetGpuLockedClocks(self, device):
        device.calls.append("reset")
        device.locked = None

    def nvmlDeviceGetTotalEnergyConsumption(self, device):
        device.energy_mj += 25_000
        return device.energy_mj

    def nvmlDeviceGetPowerUsage(self, device):
        return 250_500

    def nvmlDeviceGetClockInfo(self, device, which):
        assert which == self.NVML_CLOCK_SM
        return device.locked[0] if device.locked else 1410

    def nvmlDeviceGetPowerManagementLimit(self, device):
        return device.power_limit_mw

    def nvmlDeviceGetPowerManagementLimitConstraints(self, device):
        return 100_000, 400_000

    def nvmlDeviceGetPowerManagementDefaultLimit(self, device):
        return 400_000

    def nvmlDeviceSetPowerManagementLimit(self, device, milliwatts):
        device.calls.append(f"power {milliwatts}")
        device.power_limit_mw = milliwatts


@pytest.fixture
def nvml(monkeypatch):
    """Four GPUs whose NVML index order differs from their PCI bus order."""
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(name, raising=False)
    devices = [
        FakeDevice("GPU-cccc0000-0000-0000-0000-000000000002", "00000000:47:00.0"),
        FakeDevice("GPU-aaaa0000-0000-0000-0000-000000000000", "00000000:07:00.0"),
        FakeDevice("GPU-dddd0000-0000-0000-0000-000000000003", "00000000:4E:00.0"),
        FakeDevice("GPU-bbbb0000-0000-0000-0000-000000000001", "00000000:0F:00.0"),
    ]
    fake = FakeNVML(devices)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr("perseus_ext.measurement.gpu.nvml.has_clock_privilege", lambda: True)
    return fake


def _by_pci_order(fake: FakeNVML, position: int) -> FakeDevice:
    return sorted(fake.devices, key=lambda d: d.bus_id.lower())[position]


# ----------------------------------------------------------------------------- availability
def test_missing_pynvml_points_at_the_simulated_backend(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    with pytest.raises(GPUUnavailableError, match="PERSEUS_GPU=sim:a100_sxm"):
        open_gpu("nvml")


def test_nvml_init_failure_points_at_the_simulated_backend(nvml):
    nvml.fail["nvmlInit"] = LIBRARY_NOT_FOUND
    with pytest.raises(GPUUnavailableError, match="no NVIDIA driver or GPU.*PERSEUS_GPU=sim"):
        open_gpu("nvml")


def test_default_spec_is_nvml(nvml, monkeypatch):
    monkeypatch.delenv("PERSEUS_GPU", raising=False)
    assert isinstance(open_gpu(), NVMLGPU)


# ----------------------------------------------------------------------------- device mapping
def test_no_cuda_visible_devices_uses_pci_order_not_nvml_index(nvml):
    for rank in range(4):
        assert open_gpu("nvml", local_rank=rank).uuid == _by_pci_order(nvml, rank).uuid


def test_cuda_visible_devices_indices_are_physical_pci_positions(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert open_gpu("nvml", local_rank=0).uuid == _by_pci_order(nvml, 2).uuid
    assert open_gpu("nvml", local_rank=1).uuid == _by_pci_order(nvml, 0).uuid
    with pytest.raises(GPUUnavailableError, match="makes only 2 device"):
        open_gpu("nvml", local_rank=2)


def test_cuda_visible_devices_uuid_and_uuid_prefix(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-dddd0000-0000-0000-0000-000000000003,GPU-bbbb")
    assert open_gpu("nvml", local_rank=0).uuid.startswith("GPU-dddd")
    assert open_gpu("nvml", local_rank=1).uuid.startswith("GPU-bbbb")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-")
    with pytest.raises(GPUUnavailableError, match="matches 4 NVML device"):
        open_gpu("nvml")


def test_cuda_visible_devices_stops_at_first_invalid_entry(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,bogus,3")
    assert open_gpu("nvml", local_rank=0).uuid == _by_pci_order(nvml, 1).uuid
    with pytest.raises(GPUUnavailableError, match="only 1 device"):
        open_gpu("nvml", local_rank=1)


def test_mig_is_rejected_clearly(nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-11111111-2222-3333-4444-555555555555")
    with pytest.raises(GPUNotSupportedError, match="MIG slice"):
        open_gpu("nvml")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    _by_pci_order(nvml, 0).mig = 1
    with pytest.raises(GPUNotSupportedError, match="MIG mode is enabled.*-mig 0"):
        open_gpu("nvml", local_rank=0)
    _by_pci_order(nvml, 1).mig = -1  # pre-Ampere: NVML does not know MIG, which is fine
    assert open_gpu("nvml", local_rank=1).uuid == _by_pci_order(nvml, 1).uuid


def test_mixed_gpu_models_need_pci_bus_id_order(nvml, monkeypatch):
    nvml.devices[0].name = "NVIDIA A40"
    with pytest.raises(GPUError, match="CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        open_gpu("nvml", local_rank=0)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert open_gpu("nvml", local_rank=0).uuid == _by_pci_order(nvml, 0).uuid


def test_torch_reported_uuid_wins_when_cuda_is_initialised(nvml, monkeypatch):
    target = nvml.devices[2]
    fake_torch = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            is_initialized=lambda: True,
            get_device_properties=lambda ordinal: types.SimpleNamespace(
                uuid=target.uuid.removeprefix("GPU-")
            ),
        )
    )
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert open_gpu("nvml", local_rank=0).uuid == target.uuid


def test_from_uuid_opens_the_named_gpu(nvml):
    assert NVMLGPU.from_uuid(nvml.devices[3].uuid).uuid == nvml.devices[3].uuid


# ----------------------------------------------------------------------------- device calls
def test_queries_convert_units_and_list_clocks_at_max_memory_clock(nvml):
    gpu = open_gpu("nvml")
    assert gpu.name == "NVIDIA A100-SXM4-80GB"
    clocks = gpu.supported_sm_clocks()
    assert clocks[0] == 1410 and clocks[-1] == 210 and clocks == sorted(clocks, reverse=True)
    assert gpu.max_sm_clock() == 1410
    assert gpu.power_w() == 250.5
    assert gpu.power_limit_w() == 400.0
    assert gpu.power_limit_range_w() == (100.0, 400.0)
    first = gpu.energy_mj()
    assert gpu.energy_mj() - first == 25_000
    assert gpu.restore_spec() == NVMLRestoreSpec(uuid=gpu.uuid)


def test_set_and_reset_clocks_and_power_limit(nvml):
    gpu = open_gpu("nvml")
    device = _by_pci_order(nvml, 0)
    gpu.set_locked_sm_clocks(1200)
    assert device.locked == (1200, 1200) and gpu.sm_clock() == 1200
    gpu.reset_locked_sm_clocks()
    assert device.locked is None
    gpu.set_power_limit_w(300)
    assert device.power_limit_mw == 300_000
    gpu.reset_power_limit()
    assert device.power_limit_mw == 400_000
    with pytest.raises(GPUNotSupportedError, match="1201 MHz is not supported"):
        gpu.set_locked_sm_clocks(1201)
    with pytest.raises(GPUError, match="outside the supported range"):
        gpu.set_power_limit_w(500)
    assert device.calls == ["lock 1200 1200", "reset", "power 300000", "power 400000"]


@pytest.mark.parametrize(
    "code, error, message",
    [
        (NO_PERMISSION, GPUPermissionError, "SYS_ADMIN"),
        (NOT_SUPPORTED, GPUNotSupportedError, "Volta or newer"),
        (UNKNOWN, GPUError, "could not lock SM clocks to 1200 MHz"),
    ],
)
def test_nvml_errors_become_typed_errors(nvml, code, error, message):
    gpu = open_gpu("nvml")
    nvml.fail["nvmlDeviceSetGpuLockedClocks"] = code
    with pytest.raises(error, match=message):
        gpu.set_locked_sm_clocks(1200)


def test_permission_probe_reads_cap_sys_admin(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nCapEff:\t00000000a80425fb\n")  # docker default: no SYS_ADMIN
    assert not has_clock_privilege(str(status))
    status.write_text("Name:\tpython\nCapEff:\t000001ffffffffff\n")  # root
    assert has_clock_privilege(str(status))


# ----------------------------------------------------------------------------- controller on NVML
def test_missing_privilege_warns_once_and_dry_runs(nvml, monkeypatch, caplog):
    monkeypatch.setattr("perseus_ext.measurement.gpu.nvml.has_clock_privilege", lambda: False)
    gpu = open_gpu("nvml")
    with caplog.at_level(logging.WARNING):
        controller = FrequencyController(gpu, watchdog=False)
    warnings = [r for r in caplog.records if "DRY-RUN" in r.getMessage()]
    assert len(warnings) == 1 and "SYS_ADMIN" in warnings[0].getMessage()
    for mhz in (1200, 1200, 1005, 1410):
        controller.set_clock(mhz)
    controller.close()
    assert controller.dry_run and controller.dry_run_log == [1200, 1005, 1410]
    assert _by_pci_order(nvml, 0).calls == []  # never touched the GPU


def test_strict_mode_fails_fast_without_privilege(nvml, monkeypatch):
    monkeypatch.setattr("perseus_ext.measurement.gpu.nvml.has_clock_privilege", lambda: False)
    with pytest.raises(GPUPermissionError, match="strict mode"):
        FrequencyController(open_gpu("nvml"), strict=True, watchdog=False)


@pytest.mark.parametrize(
    "failing", ["nvmlInit", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetMigMode"]
)
def test_init_failure_leaves_training_at_default_clocks(nvml, failing):
    nvml.fail[failing] = UNKNOWN
    controller = open_controller("nvml", watchdog=False)
    controller.set_clock(1200)  # the training loop keeps calling the hook
    controller.close()
    assert controller.dry_run and controller.error_count == 1
    assert nvml.devices and all(device.calls == [] for device in nvml.devices)
    with pytest.raises(GPUError):
        open_controller("nvml", strict=True, watchdog=False)


def test_set_failure_falls_back_to_default_clocks(nvml, caplog):
    device = _by_pci_order(nvml, 0)
    controller = FrequencyController(open_gpu("nvml"), watchdog=False)
    controller.set_clock(1200)
    controller.flush(5)
    nvml.fail["nvmlDeviceSetGpuLockedClocks"] = UNKNOWN
    with caplog.at_level(logging.WARNING):
        for mhz in (1005, 1100, 1300):
            controller.set_clock(mhz)  # never raises into the training step
            controller.flush(5)
    assert controller.error_count == 1 and controller.disabled_reason
    assert device.locked is None and device.calls == ["lock 1200 1200", "reset"]
    assert sum("stops changing this GPU's clocks and restores its defaults" in r.getMessage()
               for r in caplog.records) == 1
    controller.close()


def test_read_failure_loses_the_window_energy_not_the_step(nvml):
    gpu = open_gpu("nvml")
    meter = EnergyMeter(gpu)
    nvml.fail["nvmlDeviceGetTotalEnergyConsumption"] = UNKNOWN
    with MeasurementWindow(gpu, meter=meter) as window:
        window.add("forward@1410", 0.01)
    assert window.record.energy_j is None and meter.error_count == 2
    del nvml.fail["nvmlDeviceGetTotalEnergyConsumption"]
    with MeasurementWindow(gpu, meter=meter) as window:
        window.add("forward@1410", 0.01)
    assert window.record.energy_j == 25.0


def test_watchdog_restore_on_nvml(nvml):
    from perseus_ext.actuation.watchdog import Claims, WatchdogOrders, restore

    device = nvml.devices[1]
    device.locked, device.power_limit_mw = (1005, 1005), 250_000
    claims = Claims(clocks={1005}, power_limits={250.0})  # what the trainer reported it set
    target = NVMLRestoreSpec(uuid=device.uuid)
    finished, notes = restore(WatchdogOrders(target=target, power_limit_w=350.0), claims)
    assert finished and device.locked is None and device.power_limit_mw == 350_000
    nvml.fail["nvmlDeviceResetGpuLockedClocks"] = NO_PERMISSION
    device.locked = (1005, 1005)
    finished, notes = restore(WatchdogOrders(target=target, power_limit_w=None), Claims(clocks={1005}))
    assert not finished and any("SYS_ADMIN" in note for note in notes)


def test_windows_on_a_real_gpu_time_with_cuda_events_once_cuda_is_up(nvml, monkeypatch):
    from perseus_ext.measurement.windows import CudaEventTimer, WallTimer

    gpu = open_gpu("nvml")
    cuda = types.SimpleNamespace(is_initialized=lambda: False)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert isinstance(MeasurementWindow(gpu).timer, WallTimer)  # never initialises CUDA itself
    cuda.is_initialized = lambda: True
    assert isinstance(MeasurementWindow(gpu).timer, CudaEventTimer)
