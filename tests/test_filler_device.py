"""The filler at run time: the simulated device holds a power floor exactly where it is asked to
(power log and energy counter), anchored on its own markers; real-GPU backends say they cannot;
a job on such a GPU plans clock-only plans, whose model energy is what the clocks run, and says
what swing they reach against the cap."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest

from perseus_ext.actuation.filler import FillerPlayer
from perseus_ext.config import PerseusConfig
from perseus_ext.measurement.gpu import GPUNotSupportedError, open_gpu
from perseus_ext.measurement.gpu.common import GPU, PowerFloor
from perseus_ext.measurement.gpu.nvml import NVMLGPU
from perseus_ext.measurement.gpu.sim import SimulatedGPU
from perseus_ext.measurement.gpu.timeline import SwitchLatency
from perseus_ext.measurement.gpu.zeusd import ZeusdGPU
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.power_swing import choices_of
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.runtime.comm import ControlPlane
from perseus_ext.runtime.pipeline_solve import PipelineSolve
from perseus_ext.runtime.profile_store import ProfileStore
from perseus_ext.runtime.records import MeasuredProfile

from test_gpu_nvml import FakeDevice, FakeNVML

BIN_S = 0.001


def quiet_gpu() -> SimulatedGPU:
    """Deterministic (virtual time), no counter noise, the counter updated every millisecond."""
    return SimulatedGPU("a100_sxm", pace=False, energy_noise=0.0, energy_update_period_s=BIN_S)


def bins(gpu: SimulatedGPU, end_s: float) -> np.ndarray:
    first, power = gpu.open_timeline().power_bins(0.0, end_s, BIN_S)
    assert first == 0
    return power


def test_the_simulated_device_holds_floors_from_a_marker_it_reaches_later():
    gpu = quiet_gpu()
    timeline = gpu.open_timeline()
    idle, busy = gpu.preset.idle_power_w, gpu.preset.compute_power_w(1410)
    timeline.launch("forward", 0.020)  # runs [0, 20) ms at the max clock
    anchor = timeline.record_marker()  # the device reaches it at 20 ms, after this call
    assert not anchor.query()
    gpu.hold_power_floor(anchor, [PowerFloor(0.005, 0.015, 100.0), PowerFloor(0.010, 0.020, 50.0)])
    gpu.wait(0.060)
    timeline.synchronize()
    gpu.wait(0.0)
    assert anchor.device_time_s() == pytest.approx(0.020)
    power = bins(gpu, 0.060)
    expected = np.full(60, idle)
    expected[:20] = busy
    expected[25:30] += 100.0
    expected[30:35] += 150.0  # floors that overlap add up
    expected[35:40] += 50.0
    assert power == pytest.approx(expected)
    assert gpu.true_energy_j == pytest.approx(expected.sum() * BIN_S)
    assert gpu.energy_mj() / 1000 == pytest.approx(gpu.true_energy_j, abs=busy * BIN_S)  # the counter, a tick behind at most
    assert gpu.device.power_w() == pytest.approx(idle)


def test_a_wait_s_floors_end_when_the_next_work_starts_and_hold_on_while_it_waits():
    gpu = quiet_gpu()
    timeline = gpu.open_timeline()
    idle, busy = gpu.preset.idle_power_w, gpu.preset.compute_power_w(1410)
    timeline.launch("forward", 0.010)
    first = timeline.record_marker()
    gpu.hold_power_floor(first, [PowerFloor(0.0, 0.010, 100.0)], hold_until_work_s=0.005)
    timeline.synchronize()  # 10 ms
    gpu.wait(0.012)  # the host launches the next computation 2 ms later than the floor's 10 ms
    assert gpu.power_w() == pytest.approx(idle + 100.0)  # held on past its end while the device waits
    timeline.launch("forward", 0.010)  # starts at 22 ms: the floor ends there
    second = timeline.record_marker()
    gpu.hold_power_floor(second, [PowerFloor(0.0, 0.004, 60.0)], hold_until_work_s=0.004)
    timeline.synchronize()  # 32 ms
    gpu.wait(0.018)  # nothing more comes: the second floor ends 4 ms past its own end
    power = bins(gpu, 0.050)
    expected = np.full(50, idle)
    expected[:10] = busy
    expected[10:22] = idle + 100.0  # 10 ms planned + 2 ms held on, ended by the next work
    expected[22:32] = busy  # a floor never adds to a computation
    expected[32:40] = idle + 60.0  # 4 ms planned + at most 4 ms held on
    assert power == pytest.approx(expected)
    assert gpu.true_energy_j == pytest.approx(expected.sum() * BIN_S)


def test_a_floor_on_a_marker_already_reached_starts_there():
    gpu = quiet_gpu()
    timeline = gpu.open_timeline()
    timeline.launch("forward", 0.010)
    anchor = timeline.record_marker()
    timeline.synchronize()
    assert anchor.device_time_s() == pytest.approx(0.010)
    gpu.hold_power_floor(anchor, [PowerFloor(0.002, 0.004, 80.0)])
    gpu.wait(0.010)
    power = bins(gpu, 0.020)
    assert power[12:14] == pytest.approx([gpu.preset.idle_power_w + 80.0] * 2)
    assert power[10:12] == pytest.approx([gpu.preset.idle_power_w] * 2) and power[14] == pytest.approx(power[10])


def test_bad_floors_and_foreign_anchors_are_refused_with_the_field():
    gpu, other = quiet_gpu(), quiet_gpu()
    with pytest.raises(Exception, match="above_idle_w >= 0"):
        PowerFloor(0.0, 0.01, -1.0)
    with pytest.raises(Exception, match="another device"):
        gpu.hold_power_floor(other.open_timeline().record_marker(), [PowerFloor(0.0, 0.01, 1.0)])


@pytest.fixture
def nvml(monkeypatch):
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(name, raising=False)
    fake = FakeNVML([FakeDevice("GPU-aaaa0000-0000-0000-0000-000000000000", "00000000:07:00.0")])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr("perseus_ext.measurement.gpu.nvml.has_clock_privilege", lambda: True)
    return fake


def test_real_gpu_backends_cannot_hold_a_stated_power(nvml):
    gpu = open_gpu("nvml")
    assert isinstance(gpu, NVMLGPU) and not gpu.supports_power_floor()
    with pytest.raises(GPUNotSupportedError, match="plan without a filler"):
        gpu.hold_power_floor(quiet_gpu().open_timeline().record_marker(), [PowerFloor(0.0, 0.01, 1.0)])
    assert ZeusdGPU.supports_power_floor is GPU.supports_power_floor  # zeusd sets clocks, draws no power
    assert open_gpu("sim:a100_sxm?pace=0").supports_power_floor()


FORWARD_S, BACKWARD_S = (0.010, 0.014), (0.020, 0.028)
CLOCKS_MHZ = (1410, 1200, 1005, 810)


def sim_profile() -> Profile:
    gpu = open_gpu("sim:a100_sxm?pace=0")
    return Profile.from_rows([
        {"stage": stage, "instruction": kind, "frequency": clock,
         "time": gpu.expected(seconds, clock)[0], "energy": gpu.expected(seconds, clock)[1]}
        for stage in (0, 1) for kind, seconds in (("forward", FORWARD_S[stage]), ("backward", BACKWARD_S[stage]))
        for clock in CLOCKS_MHZ])


def leader_solve(gpu: GPU, cap: float) -> tuple[PipelineSolve, object, MeasuredProfile]:
    """The pipeline leader's solve of a 2-stage job under a swing cap, inline, on `gpu`."""
    config = PerseusConfig.model_validate({"solver": {"min_grid_points": 300, "power_swing_cap": cap,
                                                      "max_clock_changes_per_s": 0},
                                           "solve_in_background": False})
    schedule = build_schedule("1f1b", 2, 4)
    comm = ControlPlane(stage=0, dp_group=None, timeout_s=30.0)
    store = ProfileStore(None, gpus_per_stage=1, gpu_name=None, blocking_power_per_gpu_w=None)
    solve = PipelineSolve(config, comm, SwitchLatency(0.0, 0.0), store, schedule, gpu=gpu)
    measured = MeasuredProfile(sim_profile(), 83.64, 1, gpu.name)
    solve.start(schedule, measured)
    shipment = solve.collect()
    assert shipment is not None and shipment.frontier is not None, shipment and shipment.error
    return solve, shipment, measured


def test_a_job_on_nvml_plans_clock_only_and_says_what_swing_its_clocks_reach(nvml, caplog):
    gpu = open_gpu("nvml")
    caplog.set_level(logging.INFO, logger="perseus_ext")
    solve, shipment, measured = leader_solve(gpu, cap=0.5)
    capped = shipment.capped
    assert capped is not None and not capped.filler and capped.filler_max_w == pytest.approx(83.64)
    assert all(plan.filler_energy_j == 0.0 for plan in capped.plans)
    assert "clock-only (the devices cannot draw a stated filler power)" in caplog.text
    # the model energy of every plan is what its clocks run: a replay of the clocks alone
    schedule = build_schedule("1f1b", 2, 4)
    model = CostModel(schedule, measured.profile, 83.64)
    plans = shipment.frontier.plans
    replayed = [model.replay(choice) for choice in choices_of(model, plans).T]
    assert [plan.energy for plan in plans] == pytest.approx([energy for _, energy in replayed])
    assert [plan.time for plan in plans] == pytest.approx([time for time, _ in replayed])
    # deploying a plan hands the device nothing and says, once, what swing its clocks reach
    marker = quiet_gpu().open_timeline().record_marker()
    for position in (-1, 0, 1):
        solve.play_filler(0, position, marker)
    assert solve.filler.floors(0) == () and solve.filler.disabled_reason is None
    lines = [r.getMessage() for r in caplog.records if "plan 0: the devices cannot draw a filler" in r.getMessage()]
    verdict = "meets" if capped.meets_cap(0) else "does NOT meet"
    assert len(lines) == 1 and f"pipeline swing of {capped.plans[0].swing_w:.0f} W" in lines[0]
    assert f"it {verdict} the cap" in lines[0]


def test_a_device_that_fails_to_hold_the_filler_stops_it_without_breaking_training(caplog):
    gpu = SimulatedGPU("a100_sxm", pace=False)
    solve, shipment, _ = leader_solve(gpu, cap=0.5)
    assert shipment.capped.filler
    plan = next(k for k, p in enumerate(shipment.capped.plans) if p.stages[0].windows)
    player: FillerPlayer = solve.filler
    timeline = gpu.open_timeline()
    gpu.inject_fault("hold_power_floor", GPUNotSupportedError("injected"), times=None)
    caplog.set_level(logging.ERROR, logger="perseus_ext")
    for position in range(len(player.floors(plan))):
        solve.play_filler(plan, position, timeline.record_marker())
    assert player.disabled_reason is not None and player.floors_held == 0
    assert sum("cannot draw the swing-capped plan's filler" in r.getMessage() for r in caplog.records) == 1
