"""Clock coverage: the simulator's exact tally, and the estimator real GPUs use, against it.

Both replay clock requests through `ClockTrajectory`, so they agree even if its latency model is
wrong; tests/test_oracle_coverage.py checks the estimator against trajectories built by hand."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perseus_ext.measurement.coverage import estimate_coverage
from perseus_ext.measurement.gpu import CoverageTally, SwitchLatency
from perseus_ext.measurement.gpu.sim import PRESETS, SimulatedGPU

A100 = PRESETS["a100_sxm"]
CLOCKS = (1410, 1305, 1200, 1005, 855)


def test_exact_tally_when_the_change_lands_late():
    gpu = SimulatedGPU("a100_sxm", pace=False, switch_s=0.02, transition_s=0.01)
    timeline = gpu.open_timeline()
    gpu.set_locked_sm_clocks(1200)  # asked for right before the computation...
    timeline.launch("forward", 0.05, planned_clock_mhz=1200)
    done = timeline.record_marker()
    assert done.wait()
    tally = timeline.exact_coverage()
    # ...but 1200 only holds from 30 ms on (20 ms switch + 10 ms ramp)
    assert tally.planned_s == pytest.approx(done.device_time_s())
    assert tally.covered_s == pytest.approx(done.device_time_s() - 0.03)
    assert 0.3 < tally.coverage < 0.6

    # set early enough, the next computation is fully covered; per-iteration differences work
    gpu.set_locked_sm_clocks(1005)
    gpu.wait(0.03)
    timeline.launch("forward", 0.05, planned_clock_mhz=1005)
    timeline.launch("sync", 0.01)  # no planned clock: not counted
    timeline.synchronize()
    second = timeline.exact_coverage() - tally
    assert second.planned_s == pytest.approx(0.05 * A100.time_factor(1005))
    assert second.coverage == pytest.approx(1.0)
    assert (tally + second).planned_s == pytest.approx(timeline.exact_coverage().planned_s)


def test_coverage_tally_arithmetic():
    assert CoverageTally().coverage is None
    assert CoverageTally(2.0, 1.5).coverage == 0.75
    assert CoverageTally(2.0, 1.5) - CoverageTally(1.0, 1.0) == CoverageTally(1.0, 0.5)


def _simulate(seed: int, latency: SwitchLatency, *, pace: bool = False, steps: int = 40):
    """A random schedule of computations and clock requests on the simulator; returns its exact
    tally and what a real GPU would have observed (marker times, set-call times)."""
    rng = random.Random(seed)
    gpu = SimulatedGPU("a100_sxm", pace=pace, switch_s=latency.switch_s,
                       transition_s=latency.transition_s, queue_depth=3)
    timeline = gpu.open_timeline()
    computations, changes, pending = [], [], []
    for _ in range(steps):
        planned = rng.choice(CLOCKS)
        if rng.random() < 0.7:  # the controller asks for the planned clock, sometimes late
            gpu.set_locked_sm_clocks(planned)
            changes.append((gpu.timestamp(), planned))
        elif rng.random() < 0.3:
            gpu.reset_locked_sm_clocks()
            changes.append((gpu.timestamp(), None))
        before = timeline.record_marker()
        timeline.launch("work", rng.uniform(0.002, 0.03), planned_clock_mhz=planned)
        after = timeline.record_marker()
        pending.append((before, after, planned))
        if rng.random() < 0.4:
            gpu.wait(rng.uniform(0.0, 0.03))  # the host does other things
    timeline.synchronize()
    for before, after, planned in pending:
        computations.append((before.device_time_s(), after.device_time_s(), planned))
    return timeline.exact_coverage(), computations, changes


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    switch_ms=st.floats(0.0, 40.0),
    transition_ms=st.floats(0.0, 20.0),
)
def test_estimator_agrees_with_the_exact_tally(seed, switch_ms, transition_ms):
    latency = SwitchLatency(switch_ms / 1000.0, transition_ms / 1000.0)
    exact, computations, changes = _simulate(seed, latency)
    estimate = estimate_coverage(computations, changes, latency, initial_clock_mhz=None,
                                 default_clock_mhz=A100.max_clock_mhz)
    assert estimate.planned_s == pytest.approx(exact.planned_s, rel=1e-6)
    assert estimate.coverage == pytest.approx(exact.coverage, abs=0.01)


def test_estimator_agrees_on_the_paced_simulator():
    # wall clock, engine thread, markers resolved asynchronously: what a real run looks like
    latency = SwitchLatency(0.02, 0.01)
    exact, computations, changes = _simulate(11, latency, pace=True, steps=25)
    estimate = estimate_coverage(computations, changes, latency, initial_clock_mhz=None,
                                 default_clock_mhz=A100.max_clock_mhz)
    assert 0.05 < exact.coverage < 0.95
    assert estimate.coverage == pytest.approx(exact.coverage, abs=0.02)


def test_estimator_with_a_wrong_latency_disagrees():
    # the estimate is only as good as the latency it is given: assuming instant changes
    # overstates coverage when the clocks really land late
    latency = SwitchLatency(0.02, 0.01)
    exact, computations, changes = _simulate(3, latency)
    naive = estimate_coverage(computations, changes, SwitchLatency(0.0, 0.0), None,
                              default_clock_mhz=A100.max_clock_mhz)
    assert naive.coverage > exact.coverage + 0.05


def test_estimator_never_counts_an_unknown_default_clock():
    latency = SwitchLatency(0.01, 0.0)
    computations = [(0.0, 0.1, 1410), (0.2, 0.3, 1200), (0.3, 0.4, None)]
    changes = [(0.1, 1200), (0.25, None)]
    unknown = estimate_coverage(computations, changes, latency, initial_clock_mhz=None)
    assert unknown.planned_s == pytest.approx(0.2)
    assert unknown.covered_s == pytest.approx(0.06)  # 1200 from 0.11 to 0.26
    known = estimate_coverage(computations, changes, latency, initial_clock_mhz=None,
                              default_clock_mhz=1410)
    assert known.covered_s == pytest.approx(0.16)
    with pytest.raises(ValueError, match="ends before it starts"):
        estimate_coverage([(1.0, 0.5, 1200)], [], latency, 1200)


def _marker_tied_run(*, dry_run: bool, dry_run_call_s: float | None = None):
    """Eight 80 ms computations alternating two clocks on a paced simulated A100 whose set call
    blocks 15 ms (then 20 ms switch, 10 ms ramp), each change tied to the previous computation's
    end, through the real controller: (estimated tally, exact tally, controller)."""
    from perseus_ext.actuation.controller import FrequencyController

    gpu = SimulatedGPU("a100_sxm", switch_s=0.02, transition_s=0.01, call_s=0.015, queue_depth=2)
    timeline = gpu.open_timeline()
    controller = FrequencyController(gpu, dry_run=dry_run, watchdog=False, handle_signals=False,
                                     dry_run_call_s=dry_run_call_s)
    try:
        spans = []
        end = timeline.record_marker()
        for k in range(8):
            clock = (1410, 1005)[k % 2]
            controller.set_clock(clock, at=end)
            start = timeline.record_marker()
            timeline.launch("work", 0.08, planned_clock_mhz=clock)
            end = timeline.record_marker()
            spans.append((start, end, clock))
        timeline.synchronize()
        assert controller.flush(5)
        changes = [(c.issued_s, c.mhz) for c in controller.drain_changes()]
    finally:
        controller.close()
    computations = [(start.device_time_s(), end.device_time_s(), clock) for start, end, clock in spans]
    estimate = estimate_coverage(computations, changes, gpu.switch_latency, None,
                                 default_clock_mhz=A100.max_clock_mhz)
    return estimate, timeline.exact_coverage(), controller


def test_dry_run_coverage_counts_the_set_calls_own_latency():
    """A dry-run change lands when the set call would have returned, and the worker is as busy as
    a live one: the compute time a dry-run estimates off its planned clock is the live run's,
    not less. (Dry-run computations run at the default clock, so they are shorter than the live
    ones at 1005 MHz: compare the time off-plan, not the share.)"""
    live_estimate, live_exact, live = _marker_tied_run(dry_run=False)
    dry, _, dry_controller = _marker_tied_run(dry_run=True)  # call_s from the GPU's latency: 15 ms
    instant, _, _ = _marker_tied_run(dry_run=True, dry_run_call_s=0.0)  # before: recorded at issue

    def off_plan_s(tally: CoverageTally) -> float:
        return tally.planned_s - tally.covered_s

    assert dry_controller.dry_run_call_s == 0.015 and min(live.set_call_s) >= 0.015
    assert live_estimate.coverage == pytest.approx(live_exact.coverage, abs=0.03)
    assert off_plan_s(dry) == pytest.approx(off_plan_s(live_exact), abs=0.02)  # 4 changes x ~40 ms
    assert off_plan_s(instant) < off_plan_s(live_exact) - 0.05  # the optimistic dry-run this replaces
