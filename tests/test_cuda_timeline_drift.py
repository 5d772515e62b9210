"""`CudaTimeline` over weeks of training: CUDA reports elapsed times as float32 milliseconds, and
the device's clock runs at a rate against the host's that is off by up to 100 ppm and wanders
(NTP slews the host clock, the oscillator follows its temperature). A fake event clock does all
of it (rounding like float32 ms; a rate of `drift_ppm` plus a sine of `wander_ppm` amplitude and
6 h period), with 5-60 s iterations, notices that come 20 us to a few ms after the device got
there, and pauses of hours without a marker. Every marker's time must stay within 0.5 ms of
when the device really reached it (1 ms when the rate wanders by +-30 ppm), the markers of the
first minutes after a pause included: those of the first iteration after a pause are read once
the next iteration has been noticed (the estimate has had one iteration to settle).
"""

from __future__ import annotations

import math
import random
import types

import numpy as np
import pytest

from perseus_ext.measurement.gpu import cuda_timeline
from perseus_ext.measurement.gpu.cuda_timeline import CudaTimeline

DAY_S = 86_400.0
HOUR_S = 3_600.0
WANDER_PERIOD_S = 6 * HOUR_S
COMPUTATIONS = 4  # markers per iteration besides its start
AFTER_PAUSE_S = 300.0  # markers this soon after a pause are reported apart (the fit holds a few bounds only)


class Clock:
    """The host's perf_counter (virtual), and the device clock whose rate against it is
    1 + drift + wander·sin(2πt/6h): its device time is that rate's integral, in closed form."""

    def __init__(self, drift_ppm: float, wander_ppm: float = 0.0, phase: float = 0.0) -> None:
        self.now = 1000.0
        self.drift = drift_ppm * 1e-6
        self.wander = wander_ppm * 1e-6
        self.phase = phase
        self.device_busy_until = self.now  # host time at which the device reaches the next event

    def device_clock(self, host_s: float) -> float:
        t, omega = host_s - 1000.0, 2 * math.pi / WANDER_PERIOD_S
        swing = self.wander / omega * (math.cos(self.phase) - math.cos(omega * t + self.phase))
        return 5000.0 + t * (1.0 + self.drift) + swing


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


def simulate(monkeypatch, *, drift_ppm: float, days: float, wander_ppm: float = 0.0,
             iteration_s: tuple[float, float] = (20.0, 20.0), anchor_hints: bool = True,
             pauses: dict[float, float] | None = None, settle_iterations: int = 100,
             seed: int = 7) -> tuple[dict[int, float], float]:
    """Iterations of `iteration_s` (uniform in the range) for `days`: the worst marker-time
    error (ms) of each day, over every marker from iteration `settle_iterations` on, but those
    of the first `AFTER_PAUSE_S` after a pause, and the worst of those (0 without pauses).
    `pauses`: {at this many seconds into the run: pause this long}; the first iteration after
    each is read after the next one."""
    clock = Clock(drift_ppm, wander_ppm, phase=random.Random(seed).uniform(0, 2 * math.pi))
    monkeypatch.setattr(cuda_timeline, "time", types.SimpleNamespace(perf_counter=lambda: clock.now,
                                                                     sleep=lambda s: None))
    cuda = types.SimpleNamespace(Event=lambda enable_timing=False: FakeEvent(clock), synchronize=lambda: None)
    timeline = CudaTimeline(cuda)
    rng = random.Random(seed)
    pending_pauses = dict(sorted((pauses or {}).items()))

    def notice_delay_s() -> float:  # a thread waking up: 20 us at best, often much later
        return 20e-6 + rng.expovariate(1 / 0.5e-3)

    worst_ms_by_day: dict[int, float] = {}
    worst_after_pause_ms = 0.0
    resumed_s = -math.inf  # host time the last pause ended
    start_s = clock.now
    end_s = start_s + days * DAY_S
    iteration, held = 0, []  # held: markers of the first iteration after a pause, read one later

    def check(markers: list[tuple[object, float]]) -> None:
        nonlocal worst_after_pause_ms
        day = int((clock.now - start_s) // DAY_S)
        for marker, reached_s in markers:
            error_ms = abs(marker.device_time_s() - reached_s) * 1000.0
            if reached_s - resumed_s < AFTER_PAUSE_S:
                worst_after_pause_ms = max(worst_after_pause_ms, error_ms)
            else:
                worst_ms_by_day[day] = max(worst_ms_by_day.get(day, 0.0), error_ms)

    while clock.now < end_s:
        after_pause = False
        if pending_pauses and clock.now - start_s >= next(iter(pending_pauses)):
            clock.now += pending_pauses.pop(next(iter(pending_pauses)))  # no marker at all meanwhile
            after_pause, resumed_s = True, clock.now
        # The host launches an iteration's work: the start marker, then COMPUTATIONS markers.
        length_s = rng.uniform(*iteration_s)
        clock.device_busy_until = clock.now + 0.05
        start = timeline.record_marker()
        if anchor_hints:
            timeline.anchor_at(start)  # what the sequencer does at every iteration start
        markers = [(start, clock.device_busy_until)]
        for _ in range(COMPUTATIONS):
            clock.device_busy_until += length_s / (COMPUTATIONS + 1) * (0.8 + 0.4 * rng.random())
            markers.append((timeline.record_marker(), clock.device_busy_until))
        # The observer notices the start, the worker two of the computations' ends (as a clock
        # change's marker), each some time after the device got there.
        for marker, reached_s in (markers[0], markers[2], markers[4]):
            clock.now = reached_s + notice_delay_s()
            assert marker.query()
        clock.now = max(clock.now, clock.device_busy_until) + 0.5  # gap between iterations
        # Every marker's time, read after the fact (records, coverage), against the truth.
        if iteration >= settle_iterations:
            check(held)
            held = []
            if after_pause:
                held = markers
            else:
                check(markers)
        iteration += 1
    return worst_ms_by_day, worst_after_pause_ms


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_weeks_of_a_wandering_rate_with_long_iterations_and_pauses(monkeypatch):
    """100 ppm drift, +-5 ppm wander over 6 h, 5-60 s iterations, pauses of 3 h and 9 h."""
    worst_ms_by_day, after_pause_ms = simulate(monkeypatch, drift_ppm=100.0, wander_ppm=5.0, days=14,
                                               iteration_s=(5.0, 60.0),
                                               pauses={3 * DAY_S: 3 * HOUR_S, 9.5 * DAY_S: 9 * HOUR_S})
    assert set(worst_ms_by_day) == set(range(15))  # every day measured, the last iterations after 14 days
    assert max(worst_ms_by_day.values()) < 0.5, worst_ms_by_day
    assert 0 < after_pause_ms < 0.5


@pytest.mark.parametrize("drift_ppm, wander_ppm, bound_ms", [(-100.0, 5.0, 0.5), (0.0, 30.0, 1.0), (60.0, 30.0, 1.0)])
def test_three_days_of_a_wandering_rate(monkeypatch, drift_ppm, wander_ppm, bound_ms):
    worst_ms_by_day, after_pause_ms = simulate(monkeypatch, drift_ppm=drift_ppm, wander_ppm=wander_ppm, days=3,
                                               iteration_s=(5.0, 60.0), pauses={1.2 * DAY_S: 2 * HOUR_S}, seed=11)
    assert set(worst_ms_by_day) == {0, 1, 2, 3}
    assert max(worst_ms_by_day.values()) < bound_ms, worst_ms_by_day
    assert 0 < after_pause_ms < bound_ms


def test_late_then_early_notices_after_a_pause_do_not_tilt_the_rate(monkeypatch):
    """After a 3 h pause, the first (57 s) iteration's notices come late, then ever earlier
    (1.21, 0.75, 0.11 ms), the next one's early, then late (0.26, 0.17, 0.62 ms): the envelope
    of those six bounds alone tilts by ~20 ppm and puts the first marker 1.2 ms off. The pause's
    own mean rate holds the young fit's rate, so every marker of both iterations stays within
    0.5 ms."""
    clock = Clock(40.0, 5.0, phase=1.0)
    monkeypatch.setattr(cuda_timeline, "time", types.SimpleNamespace(perf_counter=lambda: clock.now,
                                                                     sleep=lambda s: None))
    timeline = CudaTimeline(types.SimpleNamespace(Event=lambda enable_timing=False: FakeEvent(clock)))
    rng = random.Random(5)

    def iteration(length_s: float, delays_s: tuple[float, float, float]) -> list[tuple[object, float]]:
        clock.device_busy_until = clock.now + 0.05
        start = timeline.record_marker()
        timeline.anchor_at(start)
        markers = [(start, clock.device_busy_until)]
        for _ in range(COMPUTATIONS):
            clock.device_busy_until += length_s / (COMPUTATIONS + 1)
            markers.append((timeline.record_marker(), clock.device_busy_until))
        for (marker, reached_s), delay_s in zip((markers[0], markers[2], markers[4]), delays_s):
            clock.now = reached_s + delay_s
            assert marker.query()
        clock.now = clock.device_busy_until + 0.5
        return markers

    for _ in range(360):  # two hours of 20 s iterations before the pause
        iteration(20.0, tuple(20e-6 + rng.expovariate(1 / 0.5e-3) for _ in range(3)))
    clock.now += 3 * HOUR_S
    first = iteration(57.0, (1.21e-3, 0.75e-3, 0.11e-3))
    second = iteration(41.0, (0.26e-3, 0.17e-3, 0.62e-3))
    errors_ms = [abs(marker.device_time_s() - reached) * 1e3 for marker, reached in first + second]
    assert len(errors_ms) == 10 and max(errors_ms) < 0.5, errors_ms


@pytest.mark.parametrize("drift_ppm", [50.0, -50.0])
def test_marker_times_hold_at_a_constant_drift(monkeypatch, drift_ppm):
    worst_ms_by_day, _ = simulate(monkeypatch, drift_ppm=drift_ppm, days=2)
    assert set(worst_ms_by_day) == {0, 1, 2}
    assert max(worst_ms_by_day.values()) < 0.25, worst_ms_by_day


def test_without_iteration_anchors_and_after_a_three_hour_pause(monkeypatch):
    """A timeline nobody tells about iterations (measurement windows) re-anchors by itself, and
    a pause with no marker (its float32 link rounds by up to ~0.5 ms) restarts the offset
    estimate; the markers before it keep the fit they had."""
    worst_ms_by_day, after_pause_ms = simulate(monkeypatch, drift_ppm=50.0, days=1.5, anchor_hints=False,
                                               pauses={0.5 * DAY_S: 3 * HOUR_S})
    assert set(worst_ms_by_day) == {0, 1}
    assert max(worst_ms_by_day.values()) < 0.25, worst_ms_by_day
    assert 0 < after_pause_ms < 0.5


def test_a_marker_from_before_a_pause_keeps_its_time(monkeypatch):
    """The estimate restarts after a pause; a marker reached before it is still placed by the
    fit of its own time, not by a line extrapolated back over the pause."""
    clock = Clock(40.0, 5.0)
    monkeypatch.setattr(cuda_timeline, "time", types.SimpleNamespace(perf_counter=lambda: clock.now,
                                                                     sleep=lambda s: None))
    timeline = CudaTimeline(types.SimpleNamespace(Event=lambda enable_timing=False: FakeEvent(clock)))
    truth = []
    for _ in range(100):  # 100 iterations of 20 s, each start noticed 50 us late
        clock.device_busy_until = clock.now + 0.01
        marker = timeline.record_marker()
        timeline.anchor_at(marker)
        clock.now = clock.device_busy_until + 50e-6
        assert marker.query()
        truth.append((marker, clock.device_busy_until))
        clock.now += 20.0
    clock.now += 5 * HOUR_S
    for _ in range(3):
        clock.device_busy_until = clock.now + 0.01
        marker = timeline.record_marker()
        timeline.anchor_at(marker)
        clock.now = clock.device_busy_until + 50e-6
        assert marker.query()
        clock.now += 20.0
    errors_ms = [abs(marker.device_time_s() - reached) * 1e3 for marker, reached in truth[-10:]]
    assert len(errors_ms) == 10 and max(errors_ms) < 0.1, errors_ms


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
