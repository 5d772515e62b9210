"""The measured power swing: the simulated device's fine power samples against a trace written
by hand from its known powers, the selection of a run's deployed iterations, and the job's sum of
ranks over the device time they all cover (observability.power_samples, the report's way)."""

from __future__ import annotations

import numpy as np
import pytest

from perseus_ext.measurement.gpu.sim import SimulatedGPU
from perseus_ext.measurement.gpu.sim.power_log import PowerLog
from perseus_ext.observability.power_samples import (
    MAX_ITERATIONS,
    NOT_MEASURED,
    DeployedRun,
    IterationPower,
    PowerSamples,
    deployed_run,
    job_swing,
    rank_swing,
)

BIN_S = 0.001


def hand_bins(pieces: list[tuple[float, float, float]], first_bin: int, end_bin: int) -> np.ndarray:
    """Each bin's mean power, by summing every piece's overlap with it (no cumulative sums)."""
    means = []
    for b in range(first_bin, end_bin):
        low, high = b * BIN_S, (b + 1) * BIN_S
        means.append(sum(w * max(0.0, min(e, high) - max(s, low)) for s, e, w in pieces) / BIN_S)
    return np.array(means)


def test_the_simulated_device_s_bins_are_the_hand_integrated_trace():
    """Idle, a computation at the max clock, one at a lower clock (instant clock changes), idle:
    every 1 ms bin is the exact mean of the powers the preset gives those stretches."""
    gpu = SimulatedGPU("a100_sxm", pace=False, switch_s=0.0, transition_s=0.0, energy_noise=0.0)
    stream = gpu.open_timeline()
    preset, low_clock = gpu.preset, gpu.supported_sm_clocks()[20]
    idle_w, high_w, low_w = preset.idle_power_w, preset.compute_power_w(preset.max_clock_mhz), \
        preset.compute_power_w(low_clock)
    gpu.wait(0.0025)
    first = gpu.run(0.004)
    gpu.set_locked_sm_clocks(low_clock)
    second = gpu.run(0.002)
    gpu.wait(0.0031)
    t1 = 0.0025 + first
    t2 = t1 + second
    assert first == pytest.approx(0.004) and second == pytest.approx(0.002 * preset.time_factor(low_clock))
    pieces = [(0.0, 0.0025, idle_w), (0.0025, t1, high_w), (t1, t2, low_w), (t2, t2 + 0.0031, idle_w)]
    first_bin, watts = stream.power_bins(0.0, t2 + 0.0031, BIN_S)
    end_bin = int(np.floor((t2 + 0.0031) / BIN_S))
    assert first_bin == 0 and len(watts) == end_bin
    assert watts == pytest.approx(hand_bins(pieces, 0, end_bin), rel=1e-9)
    assert idle_w < low_w < high_w and watts.max() == pytest.approx(high_w) and watts.min() == pytest.approx(idle_w)
    # consecutive windows get consecutive, disjoint bins; the future is not known yet
    a, wa = stream.power_bins(0.0, t1, BIN_S)
    b, wb = stream.power_bins(t1, t2 + 0.0031, BIN_S)
    assert a + len(wa) == b and np.concatenate([wa, wb]) == pytest.approx(watts)
    assert stream.power_bins(0.0, t2 + 1.0, BIN_S) is None


def test_the_log_forgets_the_distant_past_and_says_so():
    log = PowerLog(keep_s=0.01)
    for k in range(100):
        log.add(k * 0.001, (k + 1) * 0.001, 100.0 + k % 2)
    assert log.bins(0.0, 0.005, BIN_S) is None  # older than what is kept
    first, watts = log.bins(0.095, 0.1, BIN_S)
    assert first == 95 and watts == pytest.approx([101.0, 100.0, 101.0, 100.0, 101.0])


def test_the_log_s_energy_over_any_window_is_the_hand_integrated_trace():
    """The exact energy between two device times (what the demo compares per step), against the
    overlap of every piece with the window summed by hand."""
    pieces = [(10.0, 10.25, 80.0), (10.25, 10.3, 400.0), (10.3, 10.4, 250.0), (10.4, 11.0, 80.0)]
    log = PowerLog()
    for piece in pieces:
        log.add(*piece)
    for start, end in [(10.0, 11.0), (10.1, 10.33), (10.27, 10.29), (10.3, 10.3), (10.35, 10.95)]:
        by_hand = sum(w * max(0.0, min(e, end) - max(s, start)) for s, e, w in pieces)
        assert log.energy_j(start, end) == pytest.approx(by_hand, rel=1e-12, abs=1e-12), (start, end)
    assert log.energy_j(9.0, 10.5) is None and log.energy_j(10.5, 11.5) is None  # not all in the log
    assert log.energy_j(10.6, 10.5) is None


def samples(first_bin: int, watts: list[float]) -> PowerSamples:
    return PowerSamples(BIN_S, first_bin, np.array(watts, dtype=float))


def test_the_deployed_run_is_the_last_one_on_one_plan_with_samples_that_tile():
    items = [IterationPower(0, None, samples(0, [1, 1])),  # warm-up: no plan
             IterationPower(1, 3, samples(2, [2, 2])), IterationPower(2, 3, samples(4, [3, 3])),
             IterationPower(3, None, samples(6, [9, 9])),  # a baseline probe ends the run
             IterationPower(4, 3, samples(8, [4, 4])), IterationPower(5, 3, samples(10, [5, 5])),
             IterationPower(6, 2, samples(12, [6, 6])),  # another plan: a new run
             IterationPower(7, 2, samples(14, [7, 7])),
             IterationPower(8, 2, samples(17, [8, 8])),  # a gap in device time: a new run
             IterationPower(9, None, samples(19, [9, 9]))]  # a trailing probe keeps the run before it
    assert [item.iteration for item in deployed_run(items)] == [8]
    assert [item.iteration for item in deployed_run(items[:8])] == [6, 7]
    long = [IterationPower(k, 1, samples(2 * k, [1, 2])) for k in range(MAX_ITERATIONS + 7)]
    assert [item.iteration for item in deployed_run(long)] == list(range(7, MAX_ITERATIONS + 7))
    assert rank_swing([], any_samples=False) == {"measured": False, "why": NOT_MEASURED}


def test_the_job_swing_sums_the_ranks_over_the_time_they_all_cover():
    """Two ranks, three deployed iterations each, their boundaries a few bins apart (one starts
    first): the job's trace is their sum from the later start to the earlier end."""
    rank0 = [IterationPower(k, 1, samples(10 * k, [300.0] * 6 + [100.0] * 4)) for k in range(1, 4)]
    # the other pipeline's rank runs another plan (a straggler's): the job's trace is periodic all the same
    rank1 = [IterationPower(k, 5, samples(10 * k + 2, [100.0] * 3 + [400.0] * 7)) for k in range(1, 4)]
    collectors = [DeployedRun(), DeployedRun()]
    for collector, items in zip(collectors, (rank0, rank1)):
        for item in items:
            collector.add(item)
    swing = job_swing([collector.items() for collector in collectors])
    # by hand: rank 0 from bin 10 to 40, rank 1 from 12 to 42; both cover 12..40
    bins = np.arange(12, 40)
    power0 = np.where((bins % 10) < 6, 300.0, 100.0)
    power1 = np.where(((bins - 2) % 10) < 3, 100.0, 400.0)
    total = power0 + power1
    assert swing["measured"] and swing["ranks"] == 2 and swing["iterations"] == [1, 3]
    assert swing["seconds"] == pytest.approx(28 * BIN_S)
    assert swing["mean_w"] == pytest.approx(total.mean())
    assert swing["peak_to_trough_w"] == pytest.approx(total.max() - total.min())
    assert (total.max(), total.min()) == (700.0, 400.0)
    assert swing["peak_to_trough_fraction"] == pytest.approx(300.0 / total.mean())
    rank = rank_swing(collectors[1].items(), any_samples=True)
    assert rank["peak_to_trough_w"] == pytest.approx(300.0) and rank["mean_w"] == pytest.approx(0.3 * 100 + 0.7 * 400)


def test_no_job_swing_without_a_shared_run():
    rank0 = [IterationPower(k, 1, samples(10 * k, [300.0] * 10)) for k in range(1, 3)]
    rank1 = [IterationPower(k, 1, samples(10 * k, [300.0] * 10)) for k in range(3, 5)]
    assert job_swing([rank0, rank1])["measured"] is False
    assert job_swing([rank0, []]) == {"measured": False, "why": job_swing([rank0, rank1])["why"]}


class _MarkerObserver:
    """The part of a `ClockControl` the recorder reads: markers observed once the device reached
    them (here the virtual device is advanced by the test itself)."""

    def __init__(self) -> None:
        self.watched: list = []

    def observe(self, at, tag) -> None:
        self.watched.append((at, tag))

    def observations(self):
        from perseus_ext.actuation.observer import Observation

        seen = [(at, tag) for at, tag in self.watched if at.query()]
        self.watched = [(at, tag) for at, tag in self.watched if not at.query()]
        return [Observation(tag, at.device_time_s(), 0.0, 0) for at, tag in seen]

    def drain_changes(self):
        return []

    def flush(self, timeout=None) -> bool:
        return True


def test_a_running_rank_s_records_tile_its_device_power_and_measure_the_hand_trace():
    """Three deployed iterations on a virtual simulated device, each: a forward at the max clock,
    a backward at a lower clock (instant changes), then an idle gap (the optimizer step and the
    wait before the next iteration, outside any computation). The records' samples tile device
    time from the first start marker on, and the rank's measured swing is that of the trace written
    by hand from the preset's powers."""
    from perseus_ext.actuation.sequencer import IterationTrace
    from perseus_ext.measurement.gpu.timeline import SwitchLatency
    from perseus_ext.observability.iteration import IterationSetting
    from perseus_ext.observability.phase import Phase
    from perseus_ext.runtime.measured_swing import rank_power_swing
    from perseus_ext.runtime.recorder import RunRecorder

    gpu = SimulatedGPU("a100_sxm", pace=False, switch_s=0.0, transition_s=0.0, energy_noise=0.0)
    stream = gpu.open_timeline()
    preset, low_clock = gpu.preset, gpu.supported_sm_clocks()[30]
    idle_w, high_w, low_w = (preset.idle_power_w, preset.compute_power_w(preset.max_clock_mhz),
                             preset.compute_power_w(low_clock))
    observer = _MarkerObserver()
    recorder = RunRecorder(observer, rank=0, pipeline=0, stage=0, latency=SwitchLatency(0.0, 0.0, 0.0), log_path=None,
                           log_interval=0, power_bins=stream.power_bins)
    gpu.wait(0.0103)  # device time before the first iteration: not any record's
    pieces, t = [], 0.0103
    for iteration in range(3):
        start = stream.record_marker()
        recorder.begin(IterationSetting(iteration, Phase.DEPLOYED, plan=2, factor=1.0), start)
        gpu.set_locked_sm_clocks(preset.max_clock_mhz)
        forward = gpu.run(0.020)
        gpu.set_locked_sm_clocks(low_clock)
        backward = gpu.run(0.040)
        gpu.wait(0.0157)  # the optimizer step
        end = stream.record_marker()
        gpu.wait(0.0)  # the device reaches the end marker
        recorder.end(iteration, end, IterationTrace(iteration))
        pieces += [(t, t + forward, high_w), (t + forward, t + forward + backward, low_w),
                   (t + forward + backward, t + forward + backward + 0.0157, idle_w)]
        t += forward + backward + 0.0157
        gpu.wait(0.0049)  # the host between iterations: the device idles
        pieces.append((t, t + 0.0049, idle_w))
        t += 0.0049
    records = recorder.collect()
    assert [record.iteration for record in records] == [0, 1, 2]
    powers = [record.power for record in records]
    assert powers[0].first_bin == 10  # from the first start marker (10.3 ms: bin 10)
    assert all(a.end_bin == b.first_bin for a, b in zip(powers, powers[1:]))  # consecutive, nothing between
    first, end = powers[0].first_bin, powers[-1].end_bin
    watts = np.concatenate([p.watts for p in powers])
    expected = hand_bins([(0.0, 0.0103, idle_w), *pieces], first, end)
    assert watts == pytest.approx(expected, rel=1e-9)
    swing = rank_power_swing(records)
    assert swing["measured"] and swing["iterations"] == [0, 2] and swing["seconds"] == pytest.approx(len(watts) * BIN_S)
    assert swing["peak_to_trough_w"] == pytest.approx(expected.max() - expected.min())
    assert swing["peak_to_trough_w"] == pytest.approx(high_w - idle_w)  # whole 1 ms bins at both powers
    assert swing["mean_w"] == pytest.approx(expected.mean())
