"""Hooks that fall silent never leave a GPU throttled (actuation/silence.py), and hooks that run
while a CUDA graph is being captured change nothing on the device (runtime/capture.py).

The job runs on a paced simulated A100, which executes asynchronously like a real device, so the
clock the GPU holds is the one a real GPU would hold."""

from __future__ import annotations

import logging
import time

import pytest
from runtime_helpers import HandMarker, make_config, sim_gpu, train

from perseus_ext.actuation import silence
from perseus_ext.actuation.controller import FrequencyController
from perseus_ext.measurement.gpu.sim import SimulatedGPU
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.runtime import PerseusRuntime
from perseus_ext.runtime import hook_watch as hook_watch_module
from perseus_ext.runtime.capture import capture_probe
from perseus_ext.observability.phase import Phase


def _wait_for(predicate, timeout_s: float, poll_s: float = 0.01) -> float | None:
    """Seconds until `predicate()` held, None if it never did within `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(poll_s)
    return None


def _deployed_runtime(stages: int = 1, microbatches: int = 4) -> tuple[PerseusRuntime, SimulatedGPU]:
    gpu = sim_gpu()
    runtime = PerseusRuntime(make_config(baseline_fraction=0.0), schedule=build_schedule("1f1b", stages, microbatches),
                             stage=0, gpu=gpu)
    train(runtime, 25)
    assert runtime.phase is Phase.DEPLOYED
    return runtime, gpu


def _start_half_an_iteration(runtime: PerseusRuntime) -> None:
    """An iteration whose hooks stop halfway (as if the framework ran the rest unseen)."""
    runtime.iteration_start()
    for computation in runtime.order[: len(runtime.order) // 2]:
        runtime.before_computation(computation.kind, computation.microbatch)
        runtime.after_computation(computation.kind, computation.microbatch)


def test_hooks_stopping_mid_job_restore_default_clocks_within_the_bound(caplog):
    caplog.set_level(logging.INFO, logger="perseus_ext")
    runtime, gpu = _deployed_runtime()
    bound_s = runtime.silence.bound_s
    expected_s = runtime.silence.expected_iteration_s
    assert expected_s is not None and bound_s == max(silence.MIN_BOUND_S, silence.BOUND_FACTOR * expected_s)
    _start_half_an_iteration(runtime)
    silent_from = time.monotonic()
    assert _wait_for(lambda: gpu.locked_clock is not None, 2.0) is not None  # the plan holds a clock
    # The GPU is back at default clocks within the bound (plus the guard's polling and one set call).
    restored_after = _wait_for(lambda: gpu.locked_clock is None, bound_s * (1 + silence.POLL_FRACTION) + 1.0)
    assert restored_after is not None
    assert time.monotonic() - silent_from <= bound_s * (1 + silence.POLL_FRACTION) + 1.0
    assert time.monotonic() - silent_from >= bound_s * 0.9  # and not before the bound
    runtime.close()
    summary = runtime.summary()
    (episode,) = summary["silent_hooks"]["episodes"]
    assert episode["held_mhz"] in runtime.candidate_clocks
    assert episode["bound_s"] == pytest.approx(bound_s)
    assert "no perseus-ext hook for" in episode["why"] and "default clocks restored" in episode["why"]
    assert summary["job"]["silenced_ranks"] == 1
    assert "the hooks fell silent while a clock was held" in caplog.text
    assert gpu.locked_clock is None


def test_hooks_that_come_back_run_their_plan_again():
    runtime, gpu = _deployed_runtime()
    _start_half_an_iteration(runtime)
    assert _wait_for(lambda: runtime.silence.episodes, 3 * runtime.silence.bound_s + 2.0) is not None
    assert _wait_for(lambda: gpu.locked_clock is None, 2.0) is not None
    before = len(gpu.clock_history)
    for computation in runtime.order[len(runtime.order) // 2:]:  # the framework carries on
        runtime.before_computation(computation.kind, computation.microbatch)
        runtime.after_computation(computation.kind, computation.microbatch)
    runtime.iteration_end()
    train(runtime, 3)
    runtime.controller.flush(5.0)
    assert any(clock is not None for clock in gpu.clock_history[before:])  # the plan is in force again
    assert runtime.fallback_reason is None and len(runtime.silence.episodes) == 1
    runtime.close()


def test_release_silent_drops_a_change_waiting_for_a_marker_the_device_never_reaches():
    """A marker recorded into a CUDA graph is reached at no time a hook knows of: the change
    waiting for it must not block the reset (nor land after it)."""
    gpu = SimulatedGPU("a100_sxm", pace=False)
    with FrequencyController(gpu, watchdog=False) as controller:
        controller.set_clock(1200)
        assert _wait_for(lambda: gpu.locked_clock == 1200, 2.0) is not None
        never = HandMarker()
        controller.set_clock(900, at=never)
        controller.release_silent()
        assert _wait_for(lambda: gpu.locked_clock is None, 2.0) is not None
        never.reach()
        controller.flush(2.0)
        assert gpu.locked_clock is None and 900 not in gpu.clock_history
        controller.set_clock(1200)  # asked for again after the silence: applied, not deduplicated
        assert _wait_for(lambda: gpu.locked_clock == 1200, 2.0) is not None


def test_the_bound_follows_the_iteration_time():
    released = []
    guard = silence.SilenceGuard(lambda: 1200, released.append)
    try:
        assert guard.bound_s == silence.INITIAL_BOUND_S and guard.expected_iteration_s is None
        for _ in range(4):
            guard.iteration_started()
            time.sleep(0.3)
        assert guard.expected_iteration_s == pytest.approx(0.3, abs=0.1)
        assert guard.bound_s == pytest.approx(silence.BOUND_FACTOR * guard.expected_iteration_s)
        assert _wait_for(lambda: released, 3.0) is not None
        (episode,) = released
        assert episode.held_mhz == 1200 and episode.at_iteration == 4
        time.sleep(guard.bound_s * 1.5)
        assert len(released) == 1  # one episode per silence
    finally:
        guard.close()


def test_capture_probe_is_false_without_cuda():
    assert capture_probe()() is False


def test_hooks_during_a_cuda_graph_capture_fall_back_and_record_nothing(monkeypatch, caplog):
    capturing = {"on": False}
    monkeypatch.setattr(hook_watch_module, "capture_probe", lambda: lambda: capturing["on"])
    gpu = sim_gpu()
    runtime = PerseusRuntime(make_config(warmup_iterations=0), schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=gpu)
    train(runtime, 2)  # profiling: a candidate clock is locked
    assert any(clock is not None for clock in gpu.clock_history)
    recorded = len(runtime.recorder.history) + len(runtime.recorder._pending)
    capturing["on"] = True
    train(runtime, 1)  # the iteration a full-iteration CUDA graph captures
    capturing["on"] = False
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "capturing a CUDA graph" in errors[0].getMessage()
    assert runtime.captured_hooks >= 2 + 2 * len(runtime.order)
    runtime.controller.flush(5.0)
    assert len(runtime.recorder.collect()) + len(runtime.recorder.history) + len(runtime.recorder._pending) <= recorded
    runtime.controller.flush(5.0)
    assert gpu.locked_clock is None
    runtime.close()
    assert runtime.summary()["silent_hooks"]["hooks_during_cuda_graph_capture"] == runtime.captured_hooks
