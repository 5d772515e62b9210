"""Where `ClockSequencer` issues each clock change: tied to which device marker, after how long.

A fake timeline hands out markers whose device times the test sets, as the device would; a fake
controller records what the sequencer asked for. The sim-device tests
(`test_actuation_device_order.py`) check the coverage this placement reaches.
"""

from __future__ import annotations

import pytest
from runtime_helpers import HandMarker

from perseus_ext.actuation.issue_delay import IssueDelay
from perseus_ext.actuation.sequencer import ClockSequencer
from perseus_ext.measurement.gpu.timeline import DeviceTimeline, SwitchLatency

LATENCY = SwitchLatency(switch_s=0.020, transition_s=0.010)


class Timeline(DeviceTimeline):
    def __init__(self) -> None:
        self.markers: list[HandMarker] = []

    def record_marker(self) -> HandMarker:
        self.markers.append(HandMarker())
        return self.markers[-1]

    def synchronize(self) -> None:
        raise AssertionError("the sequencer must never synchronise")


class Controller:
    """Records requests; repeats of the last requested clock are dropped, as the real one does."""

    def __init__(self, issue_delay_s: float = 0.0) -> None:
        self.requests: list[tuple[int | None, HandMarker | None, float]] = []
        self.bounds: list[HandMarker | None] = []  # each clock request's `by` marker
        self.last: int | None = None
        self.issue_delay = IssueDelay()
        if issue_delay_s:
            self.issue_delay.record(issue_delay_s)

    def set_clock(self, mhz: int, at: HandMarker | None = None, after_s: float = 0.0,
                  by: HandMarker | None = None) -> None:
        if mhz != self.last:
            self.last = mhz
            self.requests.append((mhz, at, after_s))
            self.bounds.append(by)

    def reset(self, at: HandMarker | None = None) -> None:
        self.last = None
        self.requests.append((None, at, 0.0))


def run_iteration(sequencer: ClockSequencer, timeline: Timeline, iteration: int,
                  clocks: tuple[int, ...], durations_s: tuple[float, ...]) -> list[HandMarker]:
    """Launch one iteration; returns [start, (computation start, end) per computation]."""
    markers = [sequencer.start_iteration(iteration, clocks, durations_s)]
    for _ in clocks:
        sequencer.computation_started()
        markers.append(timeline.markers[-1])
        markers.append(sequencer.computation_finished())
    return markers


def reach(markers: list[HandMarker], start_s: float, durations_s: tuple[float, ...],
          waits_s: tuple[float, ...]) -> None:
    """The device reaches the markers: each computation after its wait, for its duration."""
    markers[0].at_s = at = start_s
    for k, (duration, wait) in enumerate(zip(durations_s, waits_s)):
        at += wait
        markers[1 + 2 * k].at_s = at
        at += duration
        markers[2 + 2 * k].at_s = at


CLOCKS = (1410, 900, 900, 1410)
DURATIONS_S = (0.050, 0.080, 0.080, 0.050)


def changes(controller: Controller) -> list[tuple[int | None, HandMarker | None, float]]:
    """The in-iteration changes (after the iteration's first clock)."""
    return controller.requests[1:]


def test_without_known_waits_the_ramp_starts_as_the_previous_computation_ends():
    controller, timeline = Controller(), Timeline()
    sequencer = ClockSequencer(controller, timeline, latency=LATENCY)
    markers = run_iteration(sequencer, timeline, 0, CLOCKS, DURATIONS_S)
    (slower, at_slower, after_slower), (faster, at_faster, after_faster), (reset, at_reset, _) = changes(controller)
    # 900 MHz for computation 1: issued the switching latency before computation 0 ends.
    assert (slower, at_slower) == (900, markers[0])
    assert after_slower == pytest.approx(0.050 - 0.020)
    # 1410 MHz for computation 3: issued 20 ms before computation 2 ends (tied to 1's end).
    assert (faster, at_faster) == (1410, markers[4])
    assert after_faster == pytest.approx(0.080 - 0.020)
    assert (reset, at_reset) == (None, markers[-1])


def test_a_long_wait_before_a_computation_takes_the_whole_change():
    """With the device's waits known from a completed iteration, a change before a computation
    that waits longer than the switch latency plus the ramp is tied to the previous computation's
    end itself: it lands inside the wait, never in the computation before it."""
    controller, timeline = Controller(), Timeline()
    sequencer = ClockSequencer(controller, timeline, latency=LATENCY)
    waits = (0.0, 0.0, 0.0, 0.100)  # the stage waits 100 ms for computation 3's input
    first = run_iteration(sequencer, timeline, 0, CLOCKS, DURATIONS_S)
    reach(first, 1.0, DURATIONS_S, waits)
    controller.requests.clear()
    second = run_iteration(sequencer, timeline, 1, CLOCKS, DURATIONS_S)
    (_, at_faster, after_faster) = changes(controller)[1]
    assert at_faster is second[6] and after_faster == 0.0  # computation 2's end, at once


def test_a_short_wait_ends_the_ramp_as_the_computation_starts():
    """A wait between the ramp and the switch latency plus the ramp: the ramp ends exactly when
    the next computation is planned to start (issued ahead of the previous computation's end)."""
    controller, timeline = Controller(), Timeline()
    sequencer = ClockSequencer(controller, timeline, latency=LATENCY)
    waits = (0.005, 0.0, 0.0, 0.015)
    first = run_iteration(sequencer, timeline, 0, CLOCKS, DURATIONS_S)
    reach(first, 1.0, DURATIONS_S, waits)
    controller.requests.clear()
    second = run_iteration(sequencer, timeline, 1, CLOCKS, DURATIONS_S)
    (_, at_faster, after_faster) = changes(controller)[1]
    # Planned start of computation 3: 5 + 50 + 80 + 80 + 15 = 230 ms; the ramp starts 10 ms
    # before, issued 20 ms earlier: 200 ms, tied to computation 1's end (135 ms).
    assert at_faster is second[4]
    assert after_faster == pytest.approx(0.200 - 0.135)


def test_the_same_clocks_again_follow_the_devices_own_timeline():
    """A computation right after a change runs partly at the old clock, so it takes longer or
    shorter than planned; with the same clocks as the last completed iteration, the device's
    own durations place the changes."""
    controller, timeline = Controller(), Timeline()
    sequencer = ClockSequencer(controller, timeline, latency=LATENCY)
    ran_s = (0.050, 0.070, 0.080, 0.050)  # computation 1 ran 10 ms short of its plan
    first = run_iteration(sequencer, timeline, 0, CLOCKS, DURATIONS_S)
    reach(first, 1.0, ran_s, (0.0, 0.0, 0.0, 0.0))
    controller.requests.clear()
    second = run_iteration(sequencer, timeline, 1, CLOCKS, DURATIONS_S)
    (_, at_faster, after_faster) = changes(controller)[1]
    assert at_faster is second[4] and after_faster == pytest.approx(0.080 - 0.020)
    controller.requests.clear()
    other = (1410, 900, 1200, 1410)  # other clocks: the planned durations again, with its waits
    run_iteration(sequencer, timeline, 2, other, DURATIONS_S)
    assert [after for _, _, after in changes(controller)[:3]] == pytest.approx(
        [0.050 - 0.020, 0.130 - 0.020 - 0.050, 0.210 - 0.020 - 0.130])


def test_a_plan_keeps_its_timeline_across_a_probe_iteration():
    controller, timeline = Controller(), Timeline()
    sequencer = ClockSequencer(controller, timeline, latency=LATENCY)
    ran_s = (0.050, 0.070, 0.080, 0.050)
    reach(run_iteration(sequencer, timeline, 0, CLOCKS, DURATIONS_S), 1.0, ran_s, (0.0,) * 4)
    probe = (1410,) * 4  # a baseline probe at the default clocks, with other waits
    reach(run_iteration(sequencer, timeline, 1, probe, (0.05,) * 4), 2.0, (0.05,) * 4, (0.03,) * 4)
    controller.requests.clear()
    after_probe = run_iteration(sequencer, timeline, 2, CLOCKS, DURATIONS_S)
    (_, at_faster, after_faster) = changes(controller)[1]
    assert at_faster is after_probe[4] and after_faster == pytest.approx(0.080 - 0.020)


@pytest.mark.parametrize("gap_s, released", [(0.010, False), (0.050, True)])
def test_a_gap_between_iterations_too_short_for_a_reset_keeps_the_last_clock(gap_s, released):
    """The default clock between iterations only where a reset can land inside the gap."""
    controller, timeline = Controller(), Timeline()
    sequencer = ClockSequencer(controller, timeline, latency=LATENCY)
    first = run_iteration(sequencer, timeline, 0, CLOCKS, DURATIONS_S)
    reach(first, 1.0, DURATIONS_S, (0.0,) * 4)
    start = sequencer.start_iteration(1, CLOCKS, DURATIONS_S)
    start.at_s = first[-1].at_s
    sequencer.computation_started()
    timeline.markers[-1].at_s = first[-1].at_s + gap_s  # the device started iteration 1
    sequencer.computation_finished()
    controller.requests.clear()
    for _ in CLOCKS[1:]:
        sequencer.computation_started()
        sequencer.computation_finished()
    assert (controller.requests[-1][0] is None) == released


def test_waits_of_an_unfinished_iteration_are_not_used():
    controller, timeline = Controller(), Timeline()
    sequencer = ClockSequencer(controller, timeline, latency=LATENCY)
    first = run_iteration(sequencer, timeline, 0, CLOCKS, DURATIONS_S)
    reach(first, 1.0, DURATIONS_S, (0.0, 0.0, 0.0, 0.100))
    first[-1].at_s = None  # the device has not finished the last computation yet
    controller.requests.clear()
    second = run_iteration(sequencer, timeline, 1, CLOCKS, DURATIONS_S)
    assert changes(controller)[1][1:] == (second[4], pytest.approx(0.060))


def test_changes_go_out_earlier_by_the_workers_typical_lateness():
    controller, timeline = Controller(issue_delay_s=0.004), Timeline()
    sequencer = ClockSequencer(controller, timeline, latency=LATENCY)
    markers = run_iteration(sequencer, timeline, 0, CLOCKS, DURATIONS_S)
    (_, at_slower, after_slower), (_, at_faster, after_faster) = changes(controller)[:2]
    assert (at_slower, at_faster) == (markers[0], markers[4])
    assert after_slower == pytest.approx(0.050 - 0.020 - 0.004)
    assert after_faster == pytest.approx(0.080 - 0.020 - 0.004)


def test_typical_lateness_is_the_median_of_recent_changes():
    delay = IssueDelay()
    for late_s in (0.002, 0.003, 0.050, 0.002, -0.001):
        delay.record(late_s)
    assert delay.typical_s == pytest.approx(0.002)
    for _ in range(40):
        delay.record(5.0)  # stalls are capped, never planned around in full
    assert delay.typical_s == pytest.approx(0.1)


def test_without_latency_each_change_waits_for_the_previous_computation():
    controller, timeline = Controller(), Timeline()
    sequencer = ClockSequencer(controller, timeline, latency=None)
    markers = run_iteration(sequencer, timeline, 0, CLOCKS, DURATIONS_S)
    assert [(mhz, at) for mhz, at, _ in changes(controller)] == [
        (900, markers[2]), (1410, markers[6]), (None, markers[8])]


def test_the_first_clock_goes_out_by_the_iteration_start_whatever_the_last_gap():
    """The first clock is planned from the last gap between iterations; that gap may have been
    long (an inline solve, a checkpoint), so the change is also bound to the start marker."""
    controller, timeline = Controller(), Timeline()
    sequencer = ClockSequencer(controller, timeline, latency=LATENCY)
    first = run_iteration(sequencer, timeline, 0, CLOCKS, DURATIONS_S)
    reach(first, 1.0, DURATIONS_S, (0.0,) * 4)
    second = run_iteration(sequencer, timeline, 1, CLOCKS, DURATIONS_S)
    reach(second, 3.0, DURATIONS_S, (0.0,) * 4)  # 1.74 s after the first: a solve in between
    controller.requests.clear()
    controller.bounds.clear()
    controller.last = None
    third = run_iteration(sequencer, timeline, 2, CLOCKS, DURATIONS_S)
    (mhz, at, after_s), by = controller.requests[0], controller.bounds[0]
    assert (mhz, at, by) == (CLOCKS[0], second[-1], third[0])
    assert after_s == pytest.approx(3.0 - 1.26 - LATENCY.switch_s - LATENCY.transition_s)
