"""benchmarks/gpu_check.py, the real-GPU check, kept from rotting: its `--cpu` mode runs every
section on fakes (a fake pynvml, CPU tensors, CUDA events that are reached when recorded), and
its NVML write guard is checked on the fake and on the real pynvml module's functions."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from gpu_check_support import FakeNVML, GuardError, install_nvml_guard, is_write  # noqa: E402

WRITES = ("nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks", "nvmlDeviceSetPowerManagementLimit",
          "nvmlDeviceSetApplicationsClocks", "nvmlDeviceResetApplicationsClocks", "nvmlDeviceClearEccErrorCounts",
          "nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstance", "nvmlDeviceSetPersistenceMode",
          "nvmlDeviceSetMemoryLockedClocks", "nvmlDeviceResetMemoryLockedClocks", "nvmlDeviceModifyDrainState")
READS = ("nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetClockInfo",
         "nvmlDeviceGetSupportedGraphicsClocks", "nvmlDeviceGetCreatableVgpus", "nvmlDeviceGetName", "nvmlInit",
         "nvmlSystemGetDriverVersion", "nvmlDeviceGetPowerManagementLimitConstraints", "nvmlShutdown")


def test_write_names_are_told_from_reads():
    assert all(is_write(name) for name in WRITES)
    assert not any(is_write(name) for name in READS)


def test_the_guard_blocks_every_write_of_the_real_pynvml_and_keeps_its_reads():
    pynvml = pytest.importorskip("pynvml")
    copy = types.ModuleType("pynvml_copy")  # the real module's functions, patched on a copy
    copy.__dict__.update({k: v for k, v in vars(pynvml).items() if not k.startswith("__")})
    attempts: list[str] = []
    replaced = set(install_nvml_guard(copy, attempts))
    assert set(WRITES) <= replaced and "_nvmlGetFunctionPointer" in replaced
    for name in READS:
        assert getattr(copy, name) is getattr(pynvml, name)
    with pytest.raises(GuardError, match="nvmlDeviceSetGpuLockedClocks is blocked"):
        copy.nvmlDeviceSetGpuLockedClocks(None, 1410, 1410)
    # the C entry point lookup refuses writes too (a wrapper the name pattern missed still fails)
    with pytest.raises(GuardError, match="nvmlDeviceSetPowerManagementLimit"):
        copy._nvmlGetFunctionPointer("nvmlDeviceSetPowerManagementLimit")
    assert attempts == ["nvmlDeviceSetGpuLockedClocks", "nvmlDeviceSetPowerManagementLimit"]
    assert pynvml.nvmlDeviceSetGpuLockedClocks.__name__ == "nvmlDeviceSetGpuLockedClocks"  # original untouched


def test_the_guard_on_the_fake_keeps_writes_from_it():
    fake = FakeNVML()
    install_nvml_guard(fake, [])
    with pytest.raises(GuardError):
        fake.nvmlDeviceResetGpuLockedClocks(fake.device)
    assert fake.writes == []
    assert fake.nvmlDeviceGetTotalEnergyConsumption(fake.device) >= 0


def test_cpu_mode_runs_every_section_and_the_guard_stops_a_live_controller(tmp_path):
    out = tmp_path / "check.json"
    process = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--cpu", "--json", str(out),
                              "--budget-s", "150", "--iterations", "12", "--e2e-iterations", "12",
                              "--quiet-iterations", "4", "--records-only-iterations", "3", "--graph-iterations", "4", "--graph-replays", "3"],
                             capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["guard"]["blocks_set_gpu_locked_clocks"] and report["guard"]["replaced"] >= 5
    drill = report["guard_drill"]  # a controller NOT in dry-run: its writes end at the guard
    assert drill["blocked"] == ["nvmlDeviceResetGpuLockedClocks", "nvmlDeviceSetGpuLockedClocks"]
    assert drill["reached_nvml"] == [] and drill["controller_errors"] >= 1 and drill["disabled_reason"]
    assert report["guard_attempts"] == []  # the measured sections (dry-run) tried no write at all
    sections = report["sections"]
    assert set(sections) == {"environment", "nvml_reads", "energy_counter", "event_timing", "actuation",
                             "end_to_end", "waiting_power", "power_fields", "cuda_graphs"}
    assert not [name for name, figures in sections.items() if "error" in figures]
    assert sections["energy_counter"]["update_period_ms"]["median"] == pytest.approx(20, abs=5)
    assert sections["event_timing"]["float32_quantum_ms_after_7_days"] == 64.0
    actuation = sections["actuation"]
    assert actuation["iterations"] == 12 + 4 + 3 + 10 and actuation["hook_us"]["n"] == 12 * 8
    assert actuation["hook_us_in_step"]["n"] == 10 * 8 and actuation["hook_event_records_us"]["n"] == 12 * 8
    assert actuation["event_records_only_us"]["n"] == (3 - 2) * 8
    assert actuation["hook_us_quiet"]["n"] == (4 - 2) * 8 and actuation["bare_event_records_us"]["n"] == 12 * 8
    assert actuation["hook_event_records_us"]["median"] < actuation["hook_us"]["median"]
    assert actuation["notice_delay_ms"]["n"] == 22 and actuation["estimated_coverage"] is not None
    (stage,) = sections["end_to_end"]["stages"]
    assert stage["dry_run"] and stage["final_phase"] == "deployed" and stage["deployed_iterations"] >= 8
    assert stage["dry_run_changes"] > 0 and stage["estimated_coverage"] is not None
    for phase in ("idle_with_context", "spin_wait", "compute"):  # the fake NVML draws 300 W throughout
        waiting = sections["waiting_power"][phase]
        assert waiting["power_w"]["median"] == pytest.approx(300.0) and waiting["power_w"]["n"] >= 3
        assert waiting["mean_power_w_from_counter"] == pytest.approx(300.0, rel=0.25)
    fields = sections["power_fields"]  # read-only: the fake's instant field alternates every 20 ms
    assert fields["field_power_instant"]["distinct_values"] == 2 and fields["power_usage"]["available"]
    graphs = sections["cuda_graphs"]  # a stand-in on CPU: the code runs, the answers are the GPU's to give
    assert graphs["mode"].startswith("cpu stand-in")
    assert not [part for part in ("per_layer", "full_iteration", "capture_probe") if "error" in graphs[part]]
    for run in ("eager", "graphed"):
        assert graphs["per_layer"][run]["iterations_all_markers_paired"] == 4 - 2
        assert graphs["per_layer"][run]["estimated_coverage"] is not None
    full = graphs["full_iteration"]
    assert full["in_step"]["replays"] == 3 and full["in_step"]["computation_ms"]["n"] == 3 * 8
    assert full["observer_in_step"]["markers_observed"] == 3 * 9 and full["controller_errors"] == 0
    assert graphs["capture_probe"]["inside"]["torch"] and not graphs["capture_probe"]["after"]["torch"]
    assert "hook_us" in process.stdout  # the table


def test_a_waiting_power_phase_measures_nothing_while_its_work_settles():
    """The driver's power reading lags (about a second): the phase's work runs `settle_s`
    before the first sample and before the energy counter's start is read."""
    import time

    from gpu_check import _waiting_phase

    calls: list[tuple[str, float]] = []

    class Event:
        def record(self) -> None:
            pass

        def query(self) -> bool:
            return True

    machine = types.SimpleNamespace(synchronize=lambda: None, cuda=types.SimpleNamespace(Event=Event))
    gpu = types.SimpleNamespace(
        energy_mj=lambda: calls.append(("energy", time.perf_counter())) or 1000.0 * len(calls),
        power_w=lambda: calls.append(("power", time.perf_counter())) or 120.0,
        sm_clock=lambda: 1980,
    )
    chunks: list[float] = []
    started = time.perf_counter()
    figures = _waiting_phase(machine, gpu, "spin_wait", lambda kind: chunks.append(time.perf_counter()), 0.2, 0.3)
    assert calls[0][0] == "energy" and calls[0][1] - started >= 0.3  # nothing read while settling
    assert all(at - started >= 0.3 for _, at in calls)
    assert min(chunks) - started < 0.05  # the work itself started at once
    assert figures["power_w"]["median"] == 120.0 and figures["sm_clock_mhz"]["median"] == 1980.0
