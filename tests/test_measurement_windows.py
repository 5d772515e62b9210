"""Measurement windows and the per-computation energy estimator on the simulated GPU."""

from __future__ import annotations

import random

import pytest

from perseus_ext.measurement.gpu.sim import SimulatedGPU
from perseus_ext.measurement.windows import (
    EnergyEstimator,
    EnergyMeter,
    MeasurementError,
    MeasurementWindow,
    WindowRecord,
    calibrate_counter,
)

FORWARD_S, BACKWARD_S = 0.004, 0.008  # at the max clock; both far below the 100 ms counter period
CLOCKS = (1410, 1200, 1005)


def _profile_windows(gpu: SimulatedGPU, windows: int, *, align: bool, seed: int = 0):
    """Windows of a random mix of forwards/backwards at one clock, with random idle gaps."""
    rng = random.Random(seed)
    meter = EnergyMeter(gpu)
    records = []
    for index in range(windows):
        clock = CLOCKS[index % len(CLOCKS)]
        gpu.set_locked_sm_clocks(clock)
        with MeasurementWindow(gpu, meter=meter, align=align) as window:
            for _ in range(rng.randint(5, 40)):
                kind = rng.choice(["forward", "backward"])
                seconds = FORWARD_S if kind == "forward" else BACKWARD_S
                window.add(f"{kind}@{clock}", gpu.run(seconds, kind))
                if rng.random() < 0.3:
                    gpu.wait(rng.random() * 0.01)  # e.g. waiting on a pipeline neighbour
        records.append(window.record)
    return records


def _truth(gpu: SimulatedGPU, label: str) -> tuple[float, float]:
    kind, clock = label.split("@")
    return gpu.expected(FORWARD_S if kind == "forward" else BACKWARD_S, int(clock))


@pytest.mark.parametrize("idle_power_w", [83.64, None])
def test_per_computation_energy_within_5_percent_of_truth(idle_power_w):
    gpu = SimulatedGPU("a100_sxm", pace=False, seed=1)
    estimator = EnergyEstimator(idle_power_w=idle_power_w)
    estimator.extend(_profile_windows(gpu, 120, align=True))
    estimate = estimator.estimate()
    assert set(estimate.labels) == {f"{k}@{c}" for k in ("forward", "backward") for c in CLOCKS}
    for label, result in estimate.labels.items():
        true_time, true_energy = _truth(gpu, label)
        assert result.energy_j == pytest.approx(true_energy, rel=0.05), label
        assert result.time_s == pytest.approx(true_time, rel=1e-6)
        assert result.power_w == pytest.approx(true_energy / true_time, rel=0.05)
        assert 0 < result.stderr_j < 0.05 * true_energy
    assert estimate.idle_power_w == pytest.approx(83.64, rel=0.05)
    assert estimate.windows == 120


def test_a_single_short_window_cannot_see_its_energy():
    # The limitation the estimator exists for: one 4 ms forward vs a 100 ms counter period.
    gpu = SimulatedGPU("a100_sxm", pace=False, seed=2)
    meter = EnergyMeter(gpu)
    readings = []
    for _ in range(100):
        with MeasurementWindow(gpu, meter=meter) as window:
            window.add("forward@1410", gpu.run(FORWARD_S))
        readings.append(window.record.energy_j)
        gpu.wait(0.003)
    zero = sum(1 for energy in readings if energy == 0)
    assert zero >= 85  # most windows see no counter update at all
    assert max(readings) > 10 * gpu.expected(FORWARD_S)[1]  # and some see a whole update


def test_aligned_windows_start_and_end_on_counter_updates():
    gpu = SimulatedGPU("a40", pace=False, seed=3, energy_noise=0.0)
    start_energy = gpu.true_energy_j
    with MeasurementWindow(gpu, align=True) as window:
        window.add("forward@1740", gpu.run(0.25), count=1)
    record = window.record
    # the window spans whole update periods; idle time is everything but the computation
    assert record.duration_s == pytest.approx(round(record.duration_s / 0.1) * 0.1, abs=0.0011)
    assert record.idle_s == pytest.approx(record.duration_s - 0.25)
    expected = 0.25 * gpu.preset.compute_power_w(1740) + record.idle_s * gpu.preset.idle_power_w
    assert record.energy_j == pytest.approx(expected, rel=0.01)
    assert gpu.true_energy_j > start_energy


def test_computation_timer_on_a_paced_gpu():
    gpu = SimulatedGPU("h100", seed=4)
    gpu.set_locked_sm_clocks(990)
    gpu.wait(gpu.switch_latency.switch_s + gpu.switch_latency.transition_s)  # landed
    with MeasurementWindow(gpu) as window:
        for _ in range(3):
            with window.computation("forward@990"):
                gpu.run(0.005)
    record = window.record
    expected = gpu.expected(0.005, 990)[0]
    assert record.counts == {"forward@990": 3}
    assert record.busy_s["forward@990"] >= 3 * expected
    assert record.busy_s["forward@990"] < 3 * expected + 0.03
    assert record.duration_s >= record.busy_s["forward@990"]


def test_failed_reads_drop_the_window_and_estimation_skips_it():
    gpu = SimulatedGPU("a100_sxm", pace=False)
    meter = EnergyMeter(gpu)
    gpu.inject_fault("energy_mj", times=1)
    with MeasurementWindow(gpu, meter=meter) as window:
        window.add("forward@1410", gpu.run(0.3))
    assert window.record.energy_j is None and meter.error_count == 1
    estimator = EnergyEstimator(idle_power_w=83.64)
    estimator.add(window.record)
    with pytest.raises(MeasurementError, match="no window with both an energy reading"):
        estimator.estimate()


def test_estimator_names_what_it_cannot_separate():
    estimator = EnergyEstimator()
    for _ in range(5):  # forward and backward always together, no idle variation
        estimator.add(WindowRecord({"forward": 2, "backward": 2}, 1.0, 10.0))
    with pytest.raises(MeasurementError, match="cannot separate backward, forward, idle power"):
        estimator.estimate()
    with pytest.raises(MeasurementError, match="idle_power_w"):
        EnergyEstimator(idle_power_w=-1)


def test_calibrate_counter_finds_the_update_period():
    gpu = SimulatedGPU("a100_sxm", pace=False, seed=5, energy_update_period_s=0.05)
    calibration = calibrate_counter(gpu, updates=10)
    assert calibration.update_period_s == pytest.approx(0.05, abs=0.001)
    assert calibration.median_step_mj == pytest.approx(0.05 * 83.64 * 1000, rel=0.05)
    assert calibration.updates == 10 and calibration.read_cost_s < 0.01


class _FakeEvent:
    """Stands in for torch.cuda.Event: records the simulated GPU's clock."""

    def __init__(self, gpu: SimulatedGPU, log: list[str], enable_timing: bool = False) -> None:
        assert enable_timing
        self.gpu, self.log, self.time = gpu, log, None

    def record(self) -> None:
        self.time = self.gpu.timestamp()

    def synchronize(self) -> None:
        self.log.append("event.synchronize")

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return (end.time - self.time) * 1000.0  # milliseconds, like CUDA


def test_cuda_event_timing_synchronises_only_at_window_edges(monkeypatch):
    import sys
    import types

    gpu = SimulatedGPU("a100_sxm", pace=False)
    log: list[str] = []
    fake_cuda = types.SimpleNamespace(
        Event=lambda enable_timing=False: _FakeEvent(gpu, log, enable_timing),
        synchronize=lambda: log.append("device.synchronize"),
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=fake_cuda))
    window = MeasurementWindow(gpu, timing="cuda")
    with window:
        for _ in range(4):
            with window.computation("backward@1410"):
                gpu.run(0.01)
            assert log == ["device.synchronize"]  # nothing waits inside the window
    assert log[-1] == "event.synchronize" and log.count("device.synchronize") == 2
    assert window.record.busy_s["backward@1410"] == pytest.approx(0.04)
    assert window.record.counts == {"backward@1410": 4}


def test_auto_timing_uses_wall_clock_for_the_simulator():
    assert type(MeasurementWindow(SimulatedGPU(pace=False)).timer).__name__ == "WallTimer"
    with pytest.raises(MeasurementError, match="timing='gpu'"):
        MeasurementWindow(SimulatedGPU(pace=False), timing="gpu")
