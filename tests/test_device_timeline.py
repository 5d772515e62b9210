"""The device timeline: asynchronous simulated device, clock-change latency, markers, the
cross-process board, CUDA-event markers (with a fake torch.cuda) and `open_timeline` dispatch."""

from __future__ import annotations

import multiprocessing
import sys
import time
import types

import pytest

from perseus_ext.measurement.gpu import (
    GPU,
    GPUError,
    GPUNotSupportedError,
    CoverageTally,
    HostOnlyTimeline,
    SwitchLatency,
    gpu_switch_latency,
    open_timeline,
)
from perseus_ext.measurement.gpu.sim import PRESETS, SimulatedGPU
from perseus_ext.measurement.gpu.clock_ramp import ClockTrajectory
from perseus_ext.measurement.gpu.cuda_timeline import CudaTimeline
from perseus_ext.measurement.gpu.sim.board import board_directory
from perseus_ext.measurement.gpu.timeline import CONSERVATIVE_SWITCH_LATENCY, NO_LATENCY

A100 = PRESETS["a100_sxm"]


def _virtual(**kwargs) -> SimulatedGPU:
    kwargs.setdefault("energy_noise", 0.0)
    return SimulatedGPU("a100_sxm", pace=False, **kwargs)


# ----------------------------------------------------------------------------- asynchrony
def test_host_leads_the_device_and_a_full_queue_blocks_the_launch():
    gpu = SimulatedGPU("a100_sxm", queue_depth=2)
    timeline = gpu.open_timeline()
    start = time.perf_counter()
    timeline.launch("forward", 0.1)
    first = timeline.record_marker()
    timeline.launch("forward", 0.1)
    assert not first.query()  # two launches returned while the device works on the first
    timeline.launch("forward", 0.1)  # the queue is full: waits for the first to finish
    assert first.query()
    assert time.perf_counter() - start >= 0.1
    assert first.device_time_s() - start == pytest.approx(0.1, abs=0.01)
    timeline.synchronize()
    assert time.perf_counter() - start >= 0.3
    assert gpu.run_counts == {"forward": 3}


def test_markers_are_reached_in_order_at_the_device_times_of_completion():
    gpu = _virtual(queue_depth=8)
    timeline = gpu.open_timeline()
    idle = timeline.record_marker()
    assert idle.query() and idle.device_time_s() == 0.0  # an idle device reaches it when recorded
    markers = []
    for seconds in (0.01, 0.02, 0.03):
        timeline.launch("forward", seconds)
        markers.append(timeline.record_marker())
    assert gpu.timestamp() == 0.0  # launching took no device time on the host
    assert [m.query() for m in markers] == [False, False, False]
    assert markers[1].wait() and gpu.timestamp() == pytest.approx(0.03)
    assert markers[0].query() and not markers[2].query()
    assert [m.device_time_s() for m in markers[:2]] == pytest.approx([0.01, 0.03])
    assert markers[2].device_time_s() is None
    assert not markers[2].wait(timeout_s=0.01) and gpu.timestamp() == pytest.approx(0.04)
    timeline.synchronize()
    assert markers[2].device_time_s() == pytest.approx(0.06) == gpu.timestamp()
    gpu.wait(0.5)
    late = timeline.record_marker()
    assert late.device_time_s() == pytest.approx(0.56)  # idle: the record time


def test_paced_markers_resolve_on_the_engine_thread():
    gpu = SimulatedGPU("a100_sxm", queue_depth=4)
    timeline = gpu.open_timeline()
    start = time.perf_counter()
    timeline.launch("forward", 0.3)  # long enough that a loaded host still queries it early
    first = timeline.record_marker()
    timeline.launch("backward", 0.3)
    second = timeline.record_marker()
    assert not first.query()
    time.sleep(0.4)  # the host does nothing; the device works on
    assert second.wait(timeout_s=2.0) and first.query()
    assert 0.3 <= first.device_time_s() - start < 0.3 + 0.1  # + the launch's host delay
    assert second.device_time_s() - first.device_time_s() == pytest.approx(0.3, abs=1e-9)


def test_slowdown_applies_to_work_launched_after_it_is_set():
    gpu = _virtual(queue_depth=4)
    timeline = gpu.open_timeline()
    timeline.launch("forward", 0.1)
    gpu.slowdown = 2.0
    timeline.launch("forward", 0.1)
    marker = timeline.record_marker()
    assert marker.wait() and marker.device_time_s() == pytest.approx(0.3)


# ----------------------------------------------------------------------------- clock latency
def test_a_clock_change_lands_after_the_switch_latency_and_ramps():
    gpu = _virtual(switch_s=0.02, transition_s=0.01)
    gpu.wait(1.0)
    gpu.set_locked_sm_clocks(855)
    assert gpu.locked_clock == 855  # requested at once
    assert gpu.sm_clock() == 1410  # but the device still runs at the old clock
    gpu.wait(0.0199)
    assert gpu.sm_clock() == 1410
    gpu.wait(0.0002)
    assert 855 < gpu.sm_clock() < 1410  # ramping
    gpu.wait(0.0049)
    assert gpu.sm_clock() == pytest.approx((1410 + 855) / 2, abs=30)  # mid-ramp
    gpu.wait(0.0051)
    assert gpu.sm_clock() == 855  # landed at t + switch + transition
    gpu.reset_locked_sm_clocks()
    gpu.wait(0.031)
    assert gpu.sm_clock() == 1410


def test_zero_latency_gives_instant_changes():
    gpu = _virtual(switch_s=0, transition_s=0)
    gpu.set_locked_sm_clocks(1005)
    assert gpu.sm_clock() == 1005
    assert gpu.run(0.1) == pytest.approx(gpu.expected(0.1, 1005)[0])


def test_a_change_mid_computation_integrates_time_and_energy_piecewise():
    gpu = _virtual(switch_s=0.02, transition_s=0.0)
    timeline = gpu.open_timeline()
    timeline.launch("forward", 0.1)  # 100 ms at 1410 if nothing changed
    gpu.set_locked_sm_clocks(855)  # lands 20 ms into the computation
    done = timeline.record_marker()
    assert done.wait()
    # closed form: 20 ms at 1410 do 20 ms of work; the remaining 80 ms of work at 855
    slow_s = 0.08 * A100.time_factor(855)
    assert done.device_time_s() == pytest.approx(0.02 + slow_s, rel=0.01)
    energy = 0.02 * A100.compute_power_w(1410) + slow_s * A100.compute_power_w(855)
    assert gpu.true_energy_j == pytest.approx(energy, rel=0.01)


def test_a_ramp_integrates_like_the_step_approximation():
    gpu = _virtual(switch_s=0.0, transition_s=0.02)
    gpu.set_locked_sm_clocks(1005)
    duration = gpu.run(0.2)
    landed = SimulatedGPU("a100_sxm", pace=False, switch_s=0.01, transition_s=0.0)
    landed.set_locked_sm_clocks(1005)
    # a 20 ms ramp costs about what a step at its midpoint (10 ms) costs
    assert duration == pytest.approx(landed.run(0.2), rel=0.01)


def test_power_limit_throttles_running_work_immediately():
    gpu = _virtual()
    timeline = gpu.open_timeline()
    timeline.launch("forward", 0.1)
    gpu.wait(0.05)
    gpu.set_power_limit_w(300)
    cap = A100.throttled_clock(1410, 300)
    assert gpu.sm_clock() == cap
    timeline.synchronize()
    assert gpu.timestamp() == pytest.approx(0.05 + 0.05 * A100.time_factor(cap))


def test_energy_counter_follows_true_energy_under_asynchronous_work():
    gpu = SimulatedGPU("a100_sxm", seed=7, energy_update_period_s=0.02, queue_depth=3)
    timeline = gpu.open_timeline()
    before_mj, before_j = gpu.energy_mj(), gpu.true_energy_j
    for index in range(12):
        timeline.launch("forward", 0.01)
        if index == 4:
            gpu.set_locked_sm_clocks(1005)
    timeline.synchronize()
    time.sleep(0.05)  # let the counter tick past the end of the work
    counted_j = (gpu.energy_mj() - before_mj) / 1000.0
    true_j = gpu.true_energy_j - before_j
    assert counted_j == pytest.approx(true_j, rel=0.08)
    assert true_j > 0.12 * A100.compute_power_w(1005)


# ----------------------------------------------------------------------------- errors
def test_cross_rank_keys_need_a_board_and_host_only_timelines_launch_nothing():
    gpu = _virtual()
    timeline = open_timeline(gpu, job_id="virtual-job", rank=0)
    with pytest.raises(GPUError, match="pace=False"):
        timeline.launch("forward", 0.01, after=["x"])
    with pytest.raises(GPUError, match="sequence of keys"):
        timeline.launch("forward", 0.01, after="x")
    with pytest.raises(GPUNotSupportedError, match="framework launches its own kernels"):
        HostOnlyTimeline().launch("forward", 0.01)
    assert HostOnlyTimeline().exact_coverage() is None


def test_an_engine_failure_reaches_the_waiting_host_instead_of_a_hang():
    class _BrokenBoard:
        job_id, transfer_s = "broken", 0.0

        def lookup(self, key):
            raise OSError("board disk gone")

    gpu = SimulatedGPU("a100_sxm")
    timeline = gpu.open_timeline()
    gpu.device.board = _BrokenBoard()
    timeline.launch("forward", 0.01, after=["never"])
    with pytest.raises(GPUError, match="board disk gone"):
        timeline.synchronize()


def test_a_wait_for_a_dead_rank_is_bounded_by_the_peer_timeout():
    """A key no rank publishes (its publisher died): every host wait on the device used to
    block for ever; past `peer_timeout_s` the device fails, its markers resolve and every
    later launch and wait raises at once."""
    gpu = SimulatedGPU("a100_sxm")
    timeline = open_timeline(gpu, job_id=f"test-dead-peer-{time.time_ns()}", rank=0, peer_timeout_s=0.3)
    try:
        timeline.launch("forward", 0.01)
        timeline.launch("recv", 0.0, after=["never"])
        marker = timeline.record_marker()
        began = time.perf_counter()
        with pytest.raises(GPUError, match="waited 0.[3-9] s for never from another rank, more than "
                                           "perseus.control_timeout_s 0.3 s"):
            timeline.synchronize()
        assert time.perf_counter() - began < 1.5
        assert marker.wait(timeout_s=0.0)
        with pytest.raises(GPUError, match="control_timeout_s"):
            timeline.launch("forward", 0.01)
    finally:
        timeline.close()


# ----------------------------------------------------------------------------- the board
def _board_rank(rank: int, job_id: str, start, done, results) -> None:
    gpu = SimulatedGPU("a100_sxm", rank=rank, switch_s=0, transition_s=0, transfer_s=0.001)
    timeline = open_timeline(gpu, job_id=job_id, rank=rank)
    start.wait()
    began = time.perf_counter()
    if rank == 0:
        timeline.launch("forward", 0.15, publish="a/forward")
        timeline.launch("recv", 0.01, after=["b/forward"])
        finished = timeline.record_marker()
        reached = finished.wait(timeout_s=10.0)
        results.put((rank, began, reached, finished.device_time_s(), time.perf_counter()))
        done.set()
    else:
        timeline.launch("forward", 0.02, after=["a/forward"], publish="b/forward")
        launched = time.perf_counter()
        mine = timeline.record_marker()
        done.wait(10.0)  # the host blocks; the device must run and publish on its own
        results.put((rank, began, launched, mine.device_time_s(), mine.query()))
    timeline.close()


def test_board_dependencies_wait_on_the_device_across_processes():
    context = multiprocessing.get_context("spawn")
    job_id = f"test-board-{time.time_ns()}"
    start, done, results = context.Barrier(2), context.Event(), context.Queue()
    ranks = [context.Process(target=_board_rank, args=(rank, job_id, start, done, results))
             for rank in (0, 1)]
    for process in ranks:
        process.start()
    outcome = {}
    for _ in ranks:
        row = results.get(timeout=60)
        outcome[row[0]] = row
    for process in ranks:
        process.join(timeout=30)
        assert process.exitcode == 0
    _, a_began, a_reached, a_end, _ = outcome[0]
    _, b_began, b_launched_at, b_end, b_reached = outcome[1]
    assert a_reached and b_reached
    # B's host returned from the launch long before its device could start (A's key + 1 ms)
    assert b_launched_at < b_end - 0.021 - 0.05
    # A's forward ends ~0.15 s after A began; B's starts 1 ms later, A's recv 1 ms after B's end
    assert b_end - a_began == pytest.approx(0.15 + 0.001 + 0.02, abs=0.02)
    # exact even when the key is seen late (a loaded machine wakes engines late): the waiting
    # device keeps the recent past open and starts at publish time + transfer
    assert a_end == pytest.approx(b_end + 0.001 + 0.01, abs=1e-6)
    board = board_directory(job_id)
    assert not board.exists()  # the last rank to leave removed the board and its lock file
    assert not board.with_name(board.name + ".lock").exists()


# ----------------------------------------------------------------------------- CUDA events
class _FakeEvent:
    """torch.cuda.Event stand-in on a fake device clock the test controls."""

    def __init__(self, device: dict, enable_timing: bool = False) -> None:
        assert enable_timing
        self.device, self.done_at = device, None

    def record(self) -> None:
        self.done_at = self.device["busy_until"]

    def query(self) -> bool:
        return self.device["now"]() >= self.done_at

    def synchronize(self) -> None:
        while not self.query():
            time.sleep(0.0005)

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return (end.done_at - self.done_at) * 1000.0


def test_cuda_timeline_markers_and_perf_counter_alignment():
    device = {"now": time.perf_counter, "busy_until": time.perf_counter()}
    fake_cuda = types.SimpleNamespace(
        Event=lambda enable_timing=False: _FakeEvent(device, enable_timing),
        synchronize=lambda: None,
    )
    timeline = CudaTimeline(cuda=fake_cuda)
    device["busy_until"] = time.perf_counter() + 0.05  # 50 ms of queued kernels
    marker = timeline.record_marker()
    assert not marker.query() and marker.device_time_s() is None
    assert not marker.wait(timeout_s=0.005)
    assert marker.wait()
    # aligned to perf_counter: never early, late by at most the host's noticing delay
    assert device["busy_until"] <= marker.device_time_s() < device["busy_until"] + 0.05
    with pytest.raises(GPUNotSupportedError):
        timeline.launch("forward", 0.01)
    assert timeline.exact_coverage() is None


def test_open_timeline_dispatch(monkeypatch):
    simulated = _virtual()
    assert open_timeline(simulated, job_id="j", rank=0).exact_coverage() == CoverageTally()
    assert isinstance(open_timeline(None, job_id="j", rank=0), HostOnlyTimeline)

    class _NVMLLike(GPU):  # only the name matters for dispatch and latency lookup
        name, uuid = "NVIDIA A100-SXM4-80GB", "GPU-x"
        supported_sm_clocks = set_locked_sm_clocks = reset_locked_sm_clocks = None
        energy_mj = power_w = sm_clock = power_limit_w = power_limit_range_w = None
        default_power_limit_w = set_power_limit_w = can_set_clocks = None

    real = _NVMLLike()
    device = {"now": time.perf_counter, "busy_until": time.perf_counter()}
    for available, expected in ((False, HostOnlyTimeline), (True, CudaTimeline)):
        fake_cuda = types.SimpleNamespace(
            is_available=lambda available=available: available,
            Event=lambda enable_timing=False: _FakeEvent(device, enable_timing),
        )
        monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=fake_cuda))
        assert type(open_timeline(real, job_id="j", rank=0)) is expected


def test_switch_latency_per_gpu():
    assert gpu_switch_latency(None) == NO_LATENCY
    assert gpu_switch_latency(_virtual(switch_s=0.003)) == SwitchLatency(0.003, 0.010)
    named = types.SimpleNamespace(name="NVIDIA GH200 480GB")
    assert gpu_switch_latency(named) == SwitchLatency(0.020, 0.010, call_s=0.015)
    assert gpu_switch_latency(types.SimpleNamespace(name="NVIDIA H200")).issue_to_change_s == pytest.approx(0.035)
    assert gpu_switch_latency(types.SimpleNamespace(name="Tesla V100")) == \
        CONSERVATIVE_SWITCH_LATENCY
    assert SwitchLatency(0.02, 0.01).effective_s == pytest.approx(0.025)
    with pytest.raises(ValueError, match="switch_s"):
        SwitchLatency(-0.1, 0.0)
    with pytest.raises(ValueError, match="call_s"):
        SwitchLatency(0.0, 0.0, call_s=float("nan"))


def test_clock_trajectory_supersedes_an_unfinished_ramp():
    trajectory = ClockTrajectory(1400, switch_s=0.01, transition_s=0.004, start_s=0.0)
    trajectory.request(0.0, 1000)  # ramp 1400 -> 1000 during [0.010, 0.014)
    trajectory.request(0.002, 1400)  # lands at 0.012, mid-ramp: ramps back from there
    assert trajectory.value_at(0.0115) == pytest.approx(1400 - 400 * 1.5 / 4)
    origin = trajectory.value_at(0.0121)
    assert origin > 1000 and trajectory.value_at(0.016) == 1400
    with pytest.raises(ValueError, match="time order"):
        trajectory.request(0.0, 1000)
