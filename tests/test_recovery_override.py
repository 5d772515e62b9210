"""A straggler's recovery reaches the device without the training thread waiting for anything.

The controller's worker swaps a straggler episode's slowed-plan changes for its recovery program
once the episode is overridden, in device order (hand-reached markers); the straggler's own post
through a rendezvous store overrides the slowed pipeline's episode within the recovered iteration;
a store that fails or hangs changes nothing but that (the iteration-level verdict stands), and
the training thread's hooks return at once whatever the device and the store do.
"""

from __future__ import annotations

import threading
import time

import pytest
from runtime_helpers import HandMarker

from perseus_ext.actuation.controller import FrequencyController
from perseus_ext.actuation.sequencer import ClockSequencer, RecoveryProgram
from perseus_ext.measurement.gpu.sim import SimulatedGPU
from perseus_ext.actuation.observer import Observation
from perseus_ext.runtime.recorder import COMPUTE_END, END
from perseus_ext.runtime.recovery import HeldIteration, RecoveryJudge, Verdict
from perseus_ext.runtime.straggler import HeldStraggler
from perseus_ext.runtime.recovery_signal import RecoverySignal, Span

SLOWED = (1140, 870, 870, 1275)  # a stage's plan slowed for a straggler
FASTEST = (1410, 1005, 870, 1410)  # the same stage's fastest plan


class HandTimeline:
    """A device timeline whose markers the test reaches by hand, in order."""

    def __init__(self) -> None:
        self.markers: list[HandMarker] = []

    def record_marker(self) -> HandMarker:
        self.markers.append(HandMarker())
        return self.markers[-1]

    def anchor_at(self, marker: HandMarker) -> None:
        pass


def settle(gpu: SimulatedGPU, count: int, timeout_s: float = 5.0) -> list[int | None]:
    """The clock history once it holds `count` changes (or after `timeout_s`)."""
    deadline = time.perf_counter() + timeout_s
    while len(gpu.clock_history) < count and time.perf_counter() < deadline:
        time.sleep(0.002)
    time.sleep(0.05)  # nothing more may come
    return list(gpu.clock_history)


def run_iteration(sequencer: ClockSequencer, timeline: HandTimeline, recovery: RecoveryProgram | None) -> None:
    """Launch one four-computation iteration (nine markers: its start, each computation's start
    and end), which the device has not started yet."""
    sequencer.start_iteration(0, SLOWED, None, recovery)
    for _ in SLOWED:
        sequencer.computation_started()
        sequencer.computation_finished()


def reach(timeline: HandTimeline, markers: range) -> None:
    """The device reaches these markers one after the other, as it runs the computations."""
    for index in markers:
        timeline.markers[index].reach()
        time.sleep(0.03)


def test_the_slowed_plan_runs_until_its_episode_is_overridden():
    gpu = SimulatedGPU("a100_sxm", pace=False)
    timeline = HandTimeline()
    with FrequencyController(gpu, watchdog=False) as controller:
        sequencer = ClockSequencer(controller, timeline)
        run_iteration(sequencer, timeline, RecoveryProgram(7, FASTEST))
        reach(timeline, range(9))
        assert controller.flush(5)
        assert gpu.clock_history == [1140, 870, 1275, None]  # the slowed plan, then the default clocks
        assert controller.overridden_skipped == 0


def test_an_override_runs_the_fastest_plan_from_the_computation_the_device_runs_now():
    gpu = SimulatedGPU("a100_sxm", pace=False)
    timeline = HandTimeline()
    with FrequencyController(gpu, watchdog=False) as controller:
        sequencer = ClockSequencer(controller, timeline)
        # The device has reached the iteration start and computation 0's start and end: it runs
        # computation 1 at the slowed plan's clock.
        run_iteration(sequencer, timeline, RecoveryProgram(7, FASTEST))
        reach(timeline, range(3))
        assert settle(gpu, 2) == [1140, 870]
        assert controller.recover(7) and not controller.recover(7)  # one-way, once
        # At once: computation 1's recovery clock, the higher of its own and the next one's.
        assert settle(gpu, 3)[2] == max(FASTEST[1:3])
        reach(timeline, range(3, 9))
        assert controller.flush(5)
        # Computation 2's recovery clock at its start (the higher of 870 and 1410: a raise lands
        # before the computation it serves), computation 3's the same, then the default clocks.
        assert gpu.clock_history == [1140, 870, 1005, 1410, None]
        assert controller.overridden_skipped == 1  # computation 3's slowed clock never went out


def test_changes_of_other_iterations_are_untouched_by_an_override():
    gpu = SimulatedGPU("a100_sxm", pace=False)
    timeline = HandTimeline()
    with FrequencyController(gpu, watchdog=False) as controller:
        sequencer = ClockSequencer(controller, timeline)
        controller.recover(3)  # another episode
        run_iteration(sequencer, timeline, None)
        reach(timeline, range(9))
        assert controller.flush(5)
        assert gpu.clock_history == [1140, 870, 1275, None]


class MemoryStore:
    """What the signal asks of torch.distributed's Store, in memory; `fail`/`hang`: every call
    raises, or blocks until released (an unreachable or stalled rendezvous store)."""

    def __init__(self, fail: bool = False, hang: bool = False) -> None:
        self.values: dict[str, bytes] = {}
        self.fail, self.hang = fail, hang
        self.released = threading.Event()
        self.calls = 0

    def _enter(self) -> None:
        self.calls += 1
        if self.fail:
            raise RuntimeError("connection refused")
        if self.hang:
            self.released.wait()

    def set(self, key: str, value: str) -> None:
        self._enter()
        self.values[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        self._enter()
        return all(key in self.values for key in keys)

    def get(self, key: str) -> bytes:
        self._enter()
        return self.values[key]


class Recovers:
    """A controller stand-in that notes which episodes were overridden."""

    observer = None

    def __init__(self) -> None:
        self.episodes: list[int] = []

    def recover(self, episode: int) -> bool:
        self.episodes.append(episode)
        return True


def spans(iteration: int, ratios: list[float], planned_s: float = 0.02) -> list[Span]:
    """Ended computations of the straggler, each `ratio` times its planned duration."""
    out, at = [], 100.0
    for position, ratio in enumerate(ratios):
        start, end = HandMarker(at), HandMarker(at + ratio * planned_s)
        at += ratio * planned_s
        out.append(Span(iteration, start, end, planned_s, may_run_fast=position == 0, may_run_slow=position == 0))
    return out


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.perf_counter() + timeout_s
    while not condition() and time.perf_counter() < deadline:
        time.sleep(0.002)
    return condition()


def test_the_straggler_posts_after_two_computations_at_model_speed_and_the_slowed_pipeline_recovers():
    store = MemoryStore()
    straggler = RecoverySignal(store, "job", RecoveryJudge(), tolerance=0.025)
    controller = Recovers()
    slowed_judge = RecoveryJudge(controller)
    slowed = RecoverySignal(store, "job", slowed_judge, tolerance=0.025)
    try:
        slowed.arm_held(4, since=38)
        straggler.arm_straggler(6)
        assert straggler.watching
        # Still slow (1.2x), then one computation at model speed, one slow, then two at model
        # speed (the first of an iteration has a ramp inside it and says nothing).
        for span in spans(40, [1.2, 1.2, 1.2, 1.0, 1.2]):
            straggler.computation(span)
        time.sleep(0.1)
        assert not controller.episodes  # still slow, said so: no verdict from a dipping wait either
        assert store.values["perseus-ext/job/straggler-state"] == b"6:40:slow"
        assert wait_until(lambda: slowed_judge.straggler_slow_in(40)) and not slowed_judge.straggler_slow_in(41)
        for span in spans(41, [0.5, 1.01, 1.0, 1.0]):
            straggler.computation(span)
        assert wait_until(lambda: controller.episodes == [4])
        assert straggler.posted == ["6:41:recovered"] and not straggler.watching
        verdict = slowed_judge.take(4)
        assert verdict is not None and verdict.iteration == 41 and "model speed" in verdict.reason
        # A later check whose window began before that post measured the straggler gone since.
        straggler.arm_straggler(7, window_start=40)
        assert not straggler.watching
        straggler.arm_straggler(8, window_start=42)
        assert straggler.watching
    finally:
        straggler.close()
        slowed.close()


def test_a_post_of_a_recovery_before_the_episode_was_measured_is_ignored():
    store = MemoryStore()
    store.values["perseus-ext/job/straggler-state"] = b"2:20:recovered"  # a recovery before the episode's first check measured
    controller = Recovers()
    slowed = RecoverySignal(store, "job", RecoveryJudge(controller), tolerance=0.025)
    try:
        slowed.arm_held(5, since=50)
        assert wait_until(lambda: store.calls > 5)
        assert controller.episodes == []
        store.values["perseus-ext/job/straggler-state"] = b"8:61:recovered"
        assert wait_until(lambda: controller.episodes == [5])
    finally:
        slowed.close()


@pytest.mark.parametrize("trouble", ["fail", "hang"])
def test_a_failing_or_hanging_store_leaves_the_iteration_level_verdict(trouble):
    store = MemoryStore(**{trouble: True})
    controller = Recovers()
    judge = RecoveryJudge(controller)
    slowed = RecoverySignal(store, "job", judge, tolerance=0.025)
    try:
        started = time.perf_counter()
        slowed.arm_held(1, since=20)
        assert wait_until(lambda: store.calls > 0)
        assert time.perf_counter() - started < 1.0  # arming never waits for the store
        if trouble == "fail":
            assert wait_until(lambda: slowed.failure is not None) and "connection refused" in slowed.failure
        judge.report(Verdict(1, 30, "its own wait"))  # what the judge finds on its own
        assert controller.episodes == [1] and judge.take(1).iteration == 30
        closed = time.perf_counter()
        slowed.close()
        assert time.perf_counter() - closed < 2.0  # a hung store call keeps only a daemon thread
    finally:
        store.released.set()


def test_a_straggler_whose_computations_never_ran_slow_says_nothing():
    """Named the straggler by a check (a slow link, a slow host, or a noisy check), its
    computations at model speed tell nothing about its recovery."""
    store = MemoryStore()
    straggler = RecoverySignal(store, "job", RecoveryJudge(), tolerance=0.025)
    try:
        straggler.arm_straggler(3)
        for span in spans(12, [1.0, 1.0, 1.01, 1.0, 1.0, 1.0]):
            straggler.computation(span)
        time.sleep(0.3)  # the signal's thread judges an ended computation within milliseconds
        assert straggler.watching and not straggler.posted and not store.values
    finally:
        straggler.close()


def test_each_check_that_names_the_straggler_again_keeps_what_its_computations_showed():
    """Checks run every few iterations and each one names the straggler again: the slow
    computations seen under the earlier checks still count, so the first two at model speed
    after a re-arming post at once (a reset there left the recovered iteration unreported)."""
    store = MemoryStore()
    straggler = RecoverySignal(store, "job", RecoveryJudge(), tolerance=0.025)
    try:
        straggler.arm_straggler(6)
        for span in spans(30, [1.2, 1.2, 1.2]):
            straggler.computation(span)
        time.sleep(0.1)
        straggler.arm_straggler(7, window_start=30)  # the next check, same straggler
        for span in spans(33, [1.0, 1.0, 1.0]):
            straggler.computation(span)
        assert wait_until(lambda: straggler.posted == ["7:33:recovered"])
        straggler.arm_straggler(None)
        straggler.arm_straggler(9, window_start=40)  # named anew after a gap: counts start afresh
        for span in spans(42, [1.0, 1.0, 1.0]):
            straggler.computation(span)
        time.sleep(0.2)
        assert straggler.posted == ["7:33:recovered"]
    finally:
        straggler.close()


def test_a_computation_a_higher_clock_may_have_sped_up_is_no_evidence_of_model_speed():
    """A 1.2x straggler whose computation runs, for part of it, at a higher clock (a change for
    an earlier computation landing late, or the next one's raise issued early) can take its
    planned time while still slow: it never counts towards the recovery; one a lower clock may
    have slowed never counts as slow. Which clocks may be in force: those of the computations
    ending less than a change's landing window before it starts, and the next one's."""
    clocks, durations = (1410, 1005, 1005, 1005, 1410, 1410), (0.02,) * 6

    def span(iteration: int, position: int, ratio: float, window_s: float = 0.0, before: float | None = 1410) -> Span:
        start = HandMarker(100.0 + position)
        return Span.of(iteration, start, HandMarker(100.0 + position + ratio * 0.02), clocks, durations, position,
                       before, window_s)

    def bends(position: int, window_s: float = 0.0, before: float | None = 1410) -> tuple[bool, bool]:
        made = span(1, position, 1.0, window_s, before)
        return made.may_run_fast, made.may_run_slow

    assert bends(1) == (True, False)  # after 1410
    assert bends(2) == (False, False)  # 1005 between 1005s
    assert bends(3) == (True, False)  # the next one's raise, issued ahead
    assert bends(4) == (False, True)  # after 1005
    assert bends(5) == (False, False)
    assert bends(0) == (False, True)  # the next one's lowering, issued ahead
    assert bends(0, before=None) == (True, True)  # nothing known before the first
    # A landing window of 30 ms reaches back two computations of 20 ms each.
    assert bends(2, window_s=0.03) == (True, False) and bends(5, window_s=0.03) == (False, True)
    store = MemoryStore()
    straggler = RecoverySignal(store, "job", RecoveryJudge(), tolerance=0.025)
    try:
        straggler.arm_straggler(2)
        # Slow only where a lower clock could have lengthened it: no evidence of a slow straggler.
        for position in (4, 4, 4):
            straggler.computation(span(10, position, 1.2))
        # Planned time only where a higher clock could have shortened it: no model speed.
        for position in (1, 3, 1, 3):
            straggler.computation(span(11, position, 1.0))
        time.sleep(0.2)
        assert not straggler.posted and not store.values
        for _ in range(2):  # slow twice in a row at a steady clock: a slow straggler
            straggler.computation(span(12, 5, 1.2))
        assert wait_until(lambda: store.values.get("perseus-ext/job/straggler-state") == b"2:12:slow")
        for _ in range(2):  # at model speed at a steady clock: the recovery
            straggler.computation(span(13, 5, 1.0))
        assert wait_until(lambda: straggler.posted == ["2:13:recovered"])
    finally:
        straggler.close()


def test_a_straggler_slow_only_now_and_then_never_says_it_recovered():
    """A straggler whose plan was solved from its own slow profile runs at its model speed; a
    single computation that a ramp the rule cannot see made slow, now and then, is no slow
    straggler: no post, however many computations run at model speed."""
    store = MemoryStore()
    straggler = RecoverySignal(store, "job", RecoveryJudge(), tolerance=0.025)
    try:
        straggler.arm_straggler(4)
        for iteration in range(20, 26):
            for span in spans(iteration, [1.0, 1.0, 1.2, 1.0, 1.0, 1.2, 1.0, 1.0]):
                straggler.computation(span)
        time.sleep(0.3)
        assert straggler.watching and not straggler.posted and not store.values
    finally:
        straggler.close()


def test_a_wait_that_dips_while_the_straggler_says_it_runs_slow_returns_nothing():
    """The slowed plan ends 10 ms before the straggler; a wait that falls to the free wait in an
    iteration the straggler said it still ran slow in is this host's jitter, not a recovery."""
    controller = Recovers()
    judge = RecoveryJudge(controller)
    held = HeldStraggler(slowest_s=0.30, mine_s=0.25, wait_noise_s=0.001)  # predicted wait 10 ms at +40 ms

    def run(iteration: int, wait_s: float) -> None:
        judge.expect(HeldIteration(iteration, 1, held, free_wait_s=0.001, planned_extra_s=0.04, runs_held_plan=True))
        judge.observed(Observation((iteration, COMPUTE_END), 10.0 + iteration, 0.0, None))
        judge.observed(Observation((iteration, END), 10.0 + iteration + wait_s, 0.0, None))

    for iteration in (1, 2, 3):  # the first is left out, the next two calibrate this rank's lead
        run(iteration, 0.011)
    judge.still_slow(4)
    run(4, 0.001)
    assert judge.take(1) is None and controller.episodes == []
    run(5, 0.001)  # nobody said slow in iteration 5: the wait tells
    verdict = judge.take(1)
    assert verdict is not None and verdict.iteration == 5 and controller.episodes == [1]
