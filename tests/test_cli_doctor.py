"""`perseus-ext doctor`: environment report, NVML mapping through a fake pynvml, exit codes."""

from __future__ import annotations

import json
import sys

import pytest

from perseus_ext.cli import main
from test_gpu_nvml import FakeDevice, FakeNVML


class FakeNVMLWithDriver(FakeNVML):
    """The fake NVML of the backend tests plus the two calls only doctor makes."""

    def nvmlSystemGetDriverVersion(self):
        return "550.54.15"

    def nvmlDeviceGetIndex(self, device):
        return self.devices.index(device)


def test_doctor_on_the_simulator_reports_counter_hook_and_versions(tmp_path, capsys) -> None:
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--gpu", "sim:a40?pace=0&period=0.05", "--updates", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    gpu = report["gpu"]
    assert gpu["energy_counter"]["update_period_s"] == pytest.approx(0.05, abs=0.001)
    assert gpu["set_clock_hook"]["median_us"] < 50
    installation = report["installation"]
    assert installation["packages"]["deepspeed"] and installation["packages"]["megatron-core"]
    assert installation["megatron_lm_patches"].endswith("megatron-lm")
    printed = capsys.readouterr().out
    assert "energy counter: updates every 50.0 ms" in printed
    assert "deepspeed " + installation["packages"]["deepspeed"] in printed


def test_doctor_maps_cuda_devices_to_nvml_and_says_how_to_grant_clocks(monkeypatch, capsys) -> None:
    devices = [FakeDevice("GPU-aaaa", "00000000:81:00.0"), FakeDevice("GPU-bbbb", "00000000:01:00.0")]
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVMLWithDriver(devices))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,0")
    monkeypatch.setattr("perseus_ext.measurement.gpu.nvml.has_clock_privilege", lambda: False)
    assert main(["doctor", "--gpu", "sim:a100_sxm?pace=0&period=0.02", "--updates", "2"]) == 0
    printed = capsys.readouterr().out
    assert "NVML: driver 550.54.15, 2 GPU(s)" in printed
    # CUDA 0 is the UUID-named GPU (NVML index 0); CUDA 1 is physical device 0 in PCI order,
    # i.e. NVML index 1 (bus 01 sorts before bus 81).
    assert "cuda 0 -> nvml 0 (GPU-aaaa)" in printed
    assert "cuda 1 -> nvml 1 (GPU-bbbb)" in printed
    assert "permission to set clocks: no" in printed and "cap_sys_admin" in printed


def test_doctor_without_a_gpu_lists_the_problem(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no nvidia-ml-py
    assert main(["doctor", "--gpu", "nvml"]) == 1
    captured = capsys.readouterr()
    assert "NVML: unavailable: the NVML backend needs nvidia-ml-py" in captured.out
    assert "problem: no GPU to measure" in captured.err


def test_doctor_names_a_zeusd_that_does_not_answer_on_any_backend(monkeypatch, tmp_path, capsys) -> None:
    """A configured zeusd is asked whatever the GPU (here simulated, and no NVML at all): one
    that does not answer is a problem, named, and the exit status is 1."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setenv("ZEUSD_SOCK_PATH", str(tmp_path / "missing.sock"))
    monkeypatch.delenv("ZEUSD_HOST_PORT", raising=False)
    assert main(["doctor", "--gpu", "sim:a40?pace=0&period=0.02", "--updates", "2"]) == 1
    captured = capsys.readouterr()
    problems = [line for line in captured.err.splitlines() if line.startswith("problem: ")]
    assert len(problems) == 1, captured.err
    assert problems[0].startswith("problem: clock control path: zeusd: zeusd at") and "no socket at" in problems[0]
    monkeypatch.delenv("ZEUSD_SOCK_PATH")
    assert main(["doctor", "--gpu", "sim:a40?pace=0&period=0.02", "--updates", "2"]) == 0  # no zeusd asked for


def test_doctor_on_a_real_gpu_without_a_control_path_is_a_problem(monkeypatch, capsys) -> None:
    """A real GPU nobody here may set clocks on: jobs would run in dry-run; doctor says so and
    exits 1 (the same machine asked about a simulated GPU exits 0)."""
    devices = [FakeDevice("GPU-aaaa", "00000000:81:00.0")]
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVMLWithDriver(devices))
    monkeypatch.setattr("perseus_ext.measurement.gpu.nvml.has_clock_privilege", lambda: False)
    monkeypatch.delenv("ZEUSD_SOCK_PATH", raising=False)
    monkeypatch.delenv("ZEUSD_HOST_PORT", raising=False)
    monkeypatch.setattr("perseus_ext.commands.doctor.measure_gpu", lambda *args: {"available": False,
                                                                                   "reason": "not measured here"})
    assert main(["doctor", "--gpu", "nvml"]) == 1
    err = capsys.readouterr().err
    assert "problem: no path can set clocks on this GPU: no CAP_SYS_ADMIN, and neither ZEUSD_SOCK_PATH" in err
    assert main(["doctor", "--gpu", "sim:a40"]) == 1  # only the unmeasured GPU, not the control path
    assert "no path can set clocks" not in capsys.readouterr().err


class FakeNVMLWithPowerFields(FakeNVMLWithDriver):
    """A driver that answers the instantaneous power field and not the averaged one."""

    NVML_FI_DEV_POWER_INSTANT = 186
    NVML_FI_DEV_POWER_AVERAGE = 185

    def nvmlDeviceGetFieldValues(self, device, field_ids):
        import types

        return [types.SimpleNamespace(nvmlReturn=0 if field_id == 186 else 3,
                                      value=types.SimpleNamespace(uiVal=412_500)) for field_id in field_ids]


def test_doctor_says_which_power_readings_a_real_gpu_answers(monkeypatch) -> None:
    """Read-only: one field read each; the swing is not claimed on NVML, whatever it answers."""
    from perseus_ext.commands.doctor import power_readings
    from perseus_ext.measurement.gpu import open_gpu

    devices = [FakeDevice("GPU-aaaa", "00000000:81:00.0")]
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVMLWithPowerFields(devices))
    readings = power_readings(open_gpu("nvml"))
    assert readings["swing_measured"] is False and "averaged" in readings["power_usage"]
    assert readings["instant"] == "NVML_FI_DEV_POWER_INSTANT: answers, 412.5 W now"
    assert readings["average"] == "NVML_FI_DEV_POWER_AVERAGE: not supported by this driver (NVML return 3)"
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVMLWithDriver(devices))  # an older nvidia-ml-py
    older = power_readings(open_gpu("nvml"))
    assert older["instant"] == "NVML_FI_DEV_POWER_INSTANT: not in this nvidia-ml-py (older NVML)"
    assert power_readings(open_gpu("sim:a40?pace=0"))["swing_measured"] is True


def test_doctor_says_what_is_known_about_nvml_calls_and_nccl(capsys) -> None:
    assert main(["doctor", "--gpu", "sim:a40?pace=0&period=0.05", "--updates", "2"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "power swing: measured (simulated device" in printed
    assert "known about NVML calls and NCCL:" in printed
    assert "changing locked clocks about every 50 ms (20 a second) delayed NCCL collectives" in printed
    assert "perseus.solver.max_clock_changes_per_s" in printed and "own worker thread" in printed
