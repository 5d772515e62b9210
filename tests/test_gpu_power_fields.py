"""gpu_check's read-only `power_fields` section on the fake NVML the check's `--cpu` mode uses:
every reading it offers is found with the update period the fake gives it, nothing is written,
and a driver that lacks a reading is reported as such (not as a failed section)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from gpu_check_support import FakeNVML, install_nvml_guard  # noqa: E402
from gpu_power_fields import section_power_fields  # noqa: E402


def test_the_section_finds_each_reading_and_its_update_period_without_writing():
    fake = FakeNVML()
    attempts: list[str] = []
    install_nvml_guard(fake, attempts)
    figures = section_power_fields(fake, fake.device.uuid, time.perf_counter() + 10.0, sample_s=0.6)
    assert attempts == [] and fake.writes == []
    instant = figures["field_power_instant"]  # alternates 260 / 340 W every 20 ms
    assert instant["available"] and instant["distinct_values"] == 2
    assert (instant["min"], instant["max"]) == (pytest.approx(260.0), pytest.approx(340.0))
    assert instant["update_period_ms_from_changes"]["median"] == pytest.approx(20.0, abs=4.0)
    assert instant["update_period_ms_from_timestamps"]["median"] == pytest.approx(20.0)
    average = figures["field_power_average"]  # one value, stamped once a second
    assert average["available"] and average["distinct_values"] == 1 and average["value_changes"] == 0
    usage = figures["power_usage"]
    assert usage["available"] and usage["min"] == usage["max"] == pytest.approx(300.0)
    energy = figures["total_energy"]
    assert energy["update_period_ms_from_changes"]["median"] == pytest.approx(20.0, abs=4.0)
    buffer = figures["power_samples_buffer"]
    assert buffer["available"] and buffer["samples"] >= 20
    assert buffer["sample_period_ms"]["median"] == pytest.approx(20.0) and buffer["distinct_values"] == 2


def test_a_driver_without_the_newer_fields_is_a_finding():
    class OldDriver(FakeNVML):
        NVML_FI_DEV_POWER_INSTANT = None  # an older pynvml: the constant is missing

        def nvmlDeviceGetFieldValues(self, device, field_ids):
            values = super().nvmlDeviceGetFieldValues(device, field_ids)
            for value in values:
                value.nvmlReturn = self.NVML_ERROR_NOT_SUPPORTED
            return values

        def nvmlDeviceGetSamples(self, device, sampling_type, last_seen_us):
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)

    fake = OldDriver()
    figures = section_power_fields(fake, fake.device.uuid, time.perf_counter() + 10.0, sample_s=0.1)
    assert figures["field_power_instant"] == {
        "available": False, "what": "field value: instantaneous power (newer drivers)",
        "error": "this pynvml has no NVML_FI_DEV_POWER_INSTANT (older NVML)"}
    assert not figures["field_power_average"]["available"]
    assert "NVML return code 3" in figures["field_power_average"]["error"]
    assert not figures["power_samples_buffer"]["available"]
    assert figures["power_usage"]["available"] and figures["total_energy"]["available"]
