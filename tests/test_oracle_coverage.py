"""The coverage estimator against clock trajectories built by hand, not through `ClockTrajectory`.

tests/test_coverage.py compares the estimator with the simulator's exact tally, but both replay
clock requests through the same `ClockTrajectory`: a wrong latency model would agree with itself.
Here the trajectory is written out from its definition instead (docs: a request issued at t keeps
the old clock until t + switch, ramps to the target over the transition, and counts as the
planned clock only once it has landed; a request for the clock already held changes nothing;
a request landing during a ramp starts its own full ramp), first as a fixed table worked out on
paper, then as a settled-intervals replay for random requests spaced at least a transition apart.
The clocks are chosen so that no ramp step between two of them equals the third (1410 -> 1005
would pass 1200 only if 28 s = 27 (2k + 1) for whole s and k: even against odd), so the time a
computation spends at its planned clock is exactly its overlap with the settled intervals.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from perseus_ext.measurement.coverage import estimate_coverage
from perseus_ext.measurement.gpu import SwitchLatency

DEFAULT_MHZ = 1410
CLOCKS = (1410, 1200, 1005)

# (time the set call returned s, target MHz; None = back to the driver default), out of order on purpose
CHANGES = [(0.335, 1200), (0.100, 1200), (0.300, 1005), (0.340, 855), (0.500, 855), (0.600, None)]
# (device start s, device end s, planned MHz; None = no plan)
COMPUTATIONS = [
    (0.000, 0.125, 1410), (0.125, 0.300, 1200), (0.310, 0.350, 1005), (0.350, 0.400, 1200),
    (0.400, 0.550, 855), (0.550, 0.640, 855), (0.640, 0.700, 1410), (0.700, 0.720, None),
]
PLANNED_S = 0.125 + 0.175 + 0.040 + 0.050 + 0.150 + 0.090 + 0.060  # the last one has no plan


def test_a_hand_built_trajectory_with_a_20_ms_switch_and_a_10_ms_ramp():
    """Switch 20 ms, ramp 10 ms; the clock by hand:
        until 0.120  1410 (default)        0.120-0.130 ramp
        0.130-0.320  1200                  0.320-0.330 ramp
        0.330-0.355  1005                  0.355-0.370 ramp to 1200, cut at 0.360 by the ramp to 855
        0.370-0.620  855 (0.500's request for 855 changes nothing)    0.620-0.630 ramp
        from 0.630   1410 (default)
    Covered: 0.120 + 0.170 (1200 from 0.130) + 0.020 (1005 from 0.330) + 0 (1200 never lands)
    + 0.150 + 0.070 (855 until 0.620) + 0.060."""
    tally = estimate_coverage(COMPUTATIONS, CHANGES, SwitchLatency(0.020, 0.010), initial_clock_mhz=None,
                              default_clock_mhz=DEFAULT_MHZ)
    assert tally.planned_s == pytest.approx(PLANNED_S)
    assert tally.covered_s == pytest.approx(0.120 + 0.170 + 0.020 + 0.0 + 0.150 + 0.070 + 0.060)


def test_an_unknown_default_clock_is_never_covered():
    """The same trajectory with the driver default unknown: the first computation (before any
    request) and the last (after the reset) no longer count."""
    tally = estimate_coverage(COMPUTATIONS, CHANGES, SwitchLatency(0.020, 0.010), initial_clock_mhz=None)
    assert tally.planned_s == pytest.approx(PLANNED_S)
    assert tally.covered_s == pytest.approx(0.170 + 0.020 + 0.150 + 0.070)


def test_instant_changes_hold_from_the_set_call_on():
    """No latency: 1410 until 0.100, 1200 to 0.300, 1005 to 0.335, 1200 to 0.340, 855 to 0.600,
    then 1410. Covered 0.100 + 0.175 + 0.025 + 0 + 0.150 + 0.050 + 0.060."""
    tally = estimate_coverage(COMPUTATIONS, CHANGES, SwitchLatency(0.0, 0.0), initial_clock_mhz=None,
                              default_clock_mhz=DEFAULT_MHZ)
    assert tally.covered_s == pytest.approx(0.100 + 0.175 + 0.025 + 0.0 + 0.150 + 0.050 + 0.060)


def test_a_known_initial_clock_counts_from_the_start():
    """Starting at 1200 (set before the window) with no request: the first computation (planned
    1410) is not covered at all, the second (planned 1200) wholly."""
    tally = estimate_coverage(COMPUTATIONS[:2], [], SwitchLatency(0.020, 0.010), initial_clock_mhz=1200,
                              default_clock_mhz=DEFAULT_MHZ)
    assert tally.covered_s == pytest.approx(0.175)


def settled_intervals(changes, latency: SwitchLatency, initial: float) -> list[tuple[float, float, float]]:
    """(from, to, clock) where the clock has landed, for requests whose landings are at least a
    transition apart (so no ramp is cut short); NaN = the unknown default."""
    intervals, current, since = [], initial, -math.inf
    for issued, target in sorted(changes, key=lambda change: change[0]):  # stable: same-time requests in issue order
        lands = issued + latency.switch_s
        if target == current or (math.isnan(target) and math.isnan(current)):
            continue  # the clock already held: nothing moves
        intervals.append((since, lands, current))
        current, since = target, lands + latency.transition_s
    intervals.append((since, math.inf, current))
    return intervals


def covered_by_hand(computations, intervals) -> tuple[float, float]:
    planned = covered = 0.0
    for start, end, clock in computations:
        if clock is None:
            continue
        planned += end - start
        covered += sum(max(0.0, min(end, high) - max(start, low))
                       for low, high, held in intervals if held == clock)
    return planned, covered


@st.composite
def runs(draw):
    switch_s = draw(st.floats(0.0, 0.040))
    transition_s = draw(st.floats(0.0, 0.020))
    targets = st.sampled_from((*CLOCKS, None))
    changes, issued = [], 0.0
    for _ in range(draw(st.integers(0, 12))):
        issued += transition_s + draw(st.floats(0.0, 0.050))  # landings a transition or more apart
        changes.append((issued, draw(targets)))
    computations, at = [], 0.0
    for _ in range(draw(st.integers(1, 16))):
        at += draw(st.floats(0.0, 0.010))
        length = draw(st.floats(0.001, 0.060))
        computations.append((at, at + length, draw(targets)))
        at += length
    initial = draw(st.sampled_from((None, *CLOCKS)))
    default = draw(st.sampled_from((None, DEFAULT_MHZ)))
    return SwitchLatency(switch_s, transition_s), changes, computations, initial, default


@settings(max_examples=80, deadline=None)
@given(runs())
@example((SwitchLatency(0.0, 0.0), [(0.0, 1410), (0.0, 1200)], [(0.0, 0.03125, 1410)], None, None))  # same instant: the later wins
def test_the_estimator_is_the_settled_time_at_the_planned_clock(run):
    latency, changes, computations, initial, default = run
    unknown = math.nan if default is None else float(default)
    as_clock = [(issued, unknown if target is None else float(target)) for issued, target in changes]
    intervals = settled_intervals(as_clock, latency, unknown if initial is None else float(initial))
    planned, covered = covered_by_hand(computations, intervals)
    tally = estimate_coverage(computations, changes, latency, initial_clock_mhz=initial, default_clock_mhz=default)
    assert tally.planned_s == pytest.approx(planned, rel=1e-9, abs=1e-12)
    assert tally.covered_s == pytest.approx(covered, rel=1e-9, abs=1e-9)
