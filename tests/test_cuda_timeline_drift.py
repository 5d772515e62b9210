"""`CudaTimeline` over a week of training: CUDA reports elapsed times as float32 milliseconds and
the device's clock drifts against the host's. A fake event clock that does both (rounding like
float32 ms, drifting 50 ppm either way) runs 7 simulated days of 20 s iterations; marker times must
stay within 0.1 ms of when the device really reached them. The first version of the module
(one reference event at start, offset = smallest bound ever seen) is off by 32 ms of float32
quantisation and, for a slow device clock, by the whole drift (30 s)."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest

from perseus_ext.measurement.gpu import cuda_timeline
from perseus_ext.measurement.gpu.cuda_timeline import CudaTimeline

DAY_S = 86_400.0
ITERATION_S = 20.0
COMPUTATIONS = 4  # markers per iteration besides its start


class Clock:
    """The host's perf_counter (virtual), and the device clock that drifts against it."""

    def __init__(self, drift_ppm: float) -> None:
        self.now = 1000.0
        self.rate = 1.0 + drift_ppm * 1e-6
        self.device_busy_until = self.now  # host time at which the device reaches the next event

    def device_clock(self, host_s: float) -> float:
        return 5000.0 + (host_s - 1000.0) * self.rate


class FakeEvent:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.done_at = float("inf")

    def record(self) -> None:
        self.done_at = self.clock.device_busy_until

    def query(self) -> bool:
        return self.clock.now >= self.done_at

    def synchronize(self) -> None:
        self.clock.now = max(self.clock.now, self.done_at)

    def elapsed_time(self, end: "FakeEvent") -> float:
        """float32 milliseconds between the two device timestamps, as CUDA returns them (asked
        only from an earlier event to a later one: what CUDA documents)."""
        assert end.done_at >= self.done_at, "elapsed_time asked backwards"
        device = self.clock.device_clock
        return float(np.float32((device(end.done_at) - device(self.done_at)) * 1000.0))


def simulate(monkeypatch, *, drift_ppm: float, days: float, anchor_hints: bool = True,
             pause_at_s: float | None = None, pause_s: float = 0.0) -> dict[int, float]:
    """Iterations of 20 s for `days`; the worst marker-time error (ms) seen each day, once the
    offset has settled (100 iterations after the start and after a pause)."""
    clock = Clock(drift_ppm)
    monkeypatch.setattr(cuda_timeline, "time", types.SimpleNamespace(perf_counter=lambda: clock.now,
                                                                     sleep=lambda s: None))
    cuda = types.SimpleNamespace(Event=lambda enable_timing=False: FakeEvent(clock), synchronize=lambda: None)
    timeline = CudaTimeline(cuda)
    rng = random.Random(7)

    def notice_delay_s() -> float:  # a thread waking up: 20 us at best, often much later
        return 20e-6 + rng.expovariate(1 / 0.5e-3)

    worst_ms_by_day: dict[int, float] = {}
    start_s = clock.now
    iteration = settled_from = 0
    end_s = start_s + days * DAY_S
    while clock.now < end_s:
        if pause_at_s is not None and clock.now - start_s >= pause_at_s:
            clock.now += pause_s  # evaluation or a checkpoint: no marker at all for pause_s
            pause_at_s = None
            settled_from = iteration + 100
        # The host launches an iteration's work: the start marker, then COMPUTATIONS markers.
        clock.device_busy_until = clock.now + 0.05
        start = timeline.record_marker()
        if anchor_hints:
            timeline.anchor_at(start)  # what the sequencer does at every iteration start
        markers = [(start, clock.device_busy_until)]
        for _ in range(COMPUTATIONS):
            clock.device_busy_until += ITERATION_S / (COMPUTATIONS + 1) * (0.8 + 0.4 * rng.random())
            markers.append((timeline.record_marker(), clock.device_busy_until))
        # The observer notices the start, the worker two of the computations' ends (as a clock
        # change's marker), each some time after the device got there.
        for marker, reached_s in (markers[0], markers[2], markers[4]):
            clock.now = reached_s + notice_delay_s()
            assert marker.query()
        clock.now = max(clock.now, clock.device_busy_until) + 0.5  # gap between iterations
        # Every marker's time, read after the fact (records, coverage), against the truth.
        day = int((clock.now - start_s) // DAY_S)
        last = clock.now >= end_s
        if iteration >= max(100, settled_from) and (iteration % 50 == 0 or last):
            for marker, reached_s in markers:
                error_ms = abs(marker.device_time_s() - reached_s) * 1000.0
                worst_ms_by_day[day] = max(worst_ms_by_day.get(day, 0.0), error_ms)
        iteration += 1
    return worst_ms_by_day


@pytest.mark.parametrize("drift_ppm", [50.0, -50.0])
def test_marker_times_hold_for_a_week_of_drifting_float32_events(monkeypatch, drift_ppm):
    worst_ms_by_day = simulate(monkeypatch, drift_ppm=drift_ppm, days=7)
    assert max(worst_ms_by_day) == 7  # the last iterations ran after 7 days
    assert all(error_ms < 0.1 for error_ms in worst_ms_by_day.values()), worst_ms_by_day


def test_without_iteration_anchors_and_after_a_three_hour_pause(monkeypatch):
    """A timeline nobody tells about iterations (measurement windows) re-anchors by itself, and
    a pause with no marker (its float32 link rounds to ~0.5 ms) restarts the offset estimate."""
    worst_ms_by_day = simulate(monkeypatch, drift_ppm=50.0, days=1.5, anchor_hints=False,
                               pause_at_s=0.5 * DAY_S, pause_s=3 * 3600.0)
    assert set(worst_ms_by_day) == {0, 1}
    assert all(error_ms < 0.1 for error_ms in worst_ms_by_day.values()), worst_ms_by_day


def test_a_marker_noticed_after_a_later_anchor_is_measured_forwards(monkeypatch):
    """The observer may notice an iteration start (the new anchor) before anyone queries a
    marker of the previous iteration: its time is then measured from it to the anchor."""
    clock = Clock(0.0)
    monkeypatch.setattr(cuda_timeline, "time", types.SimpleNamespace(perf_counter=lambda: clock.now,
                                                                     sleep=lambda s: None))
    timeline = CudaTimeline(types.SimpleNamespace(Event=lambda enable_timing=False: FakeEvent(clock)))
    clock.device_busy_until = clock.now + 0.010
    earlier = timeline.record_marker()
    clock.device_busy_until += 0.020
    start = timeline.record_marker()
    timeline.anchor_at(start)
    clock.now = clock.device_busy_until + 50e-6
    assert start.query() and timeline.anchors == 2
    assert earlier.device_time_s() == pytest.approx(clock.device_busy_until - 0.020, abs=60e-6)
