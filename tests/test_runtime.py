"""Single-process tests of the framework-agnostic runtime (config, profiler, lifecycle, fallbacks).

They drive `PerseusRuntime` the way an adapter does, on a simulated A100 with a virtual clock
(`pace=0`), so whole training runs take milliseconds and are exactly reproducible.
"""

from __future__ import annotations

import datetime
import logging
import sys

import numpy as np
import pytest

from perseus_ext.errors import ConfigError, PerseusError
from perseus_ext.measurement.windows import EnergyMeter
from perseus_ext.planning.schedule import Kind, build_schedule
from perseus_ext.runtime import PerseusConfig, PerseusRuntime, Phase
from perseus_ext.measurement.counter_updates import build_windows, locate_updates
from perseus_ext.runtime.profiler import StageProfiler
from perseus_ext.runtime.straggler import SlowdownTracker

from runtime_helpers import BACKWARD_S, FORWARD_S, make_config, sim_gpu, train, virtual_gpu  # noqa: E402


@pytest.fixture
def schedule():
    return build_schedule("1f1b", 1, 4)


# --------------------------------------------------------------------------- config
def test_config_round_trip_and_defaults():
    config = make_config(candidate_clocks=[1200, 1410], policy={"type": "zeus", "eta": 0.5})
    assert config.candidate_clocks == (1410, 1200)  # sorted fastest first
    assert PerseusConfig.from_dict(config.to_dict()) == config
    assert PerseusConfig.from_dict(None).enabled is False


def test_config_imports_without_torch():
    import subprocess

    code = ("import sys; from perseus_ext.runtime import PerseusConfig; "
            "PerseusConfig.from_dict({'enabled': True}); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_runtime_rejects_clocks_the_gpu_does_not_support(schedule):
    with pytest.raises(ConfigError, match=r"perseus.candidate_clocks: 1234 MHz is not supported .*nearest 1230"):
        PerseusRuntime(make_config(candidate_clocks=[1410, 1234]), schedule=schedule, stage=0, gpu=sim_gpu())
    with pytest.raises(ConfigError, match="perseus.communication_clock: 5 MHz"):
        PerseusRuntime(make_config(communication_clock=5), schedule=schedule, stage=0, gpu=sim_gpu())


def test_runtime_rejects_workload_of_wrong_length_and_unknown_solver_keys(schedule):
    two = build_schedule("1f1b", 2, 4)
    config = make_config(simulated_workload={"forward_seconds": [0.01, 0.02, 0.03], "backward_seconds": 0.02})
    with pytest.raises(ConfigError, match="forward_seconds has 3 entries but the pipeline has 2 stages"):
        PerseusRuntime(config, schedule=two, stage=0, gpu=sim_gpu())
    with pytest.raises(ConfigError, match="perseus.solver.speed"):
        PerseusRuntime(make_config(solver={"speed": 2}), schedule=schedule, stage=0, gpu=sim_gpu())


# --------------------------------------------------------------------------- straggler hysteresis
def test_slowdown_tracker_hysteresis():
    tracker = SlowdownTracker(threshold=0.05, hysteresis=0.02)
    assert not tracker.update(1.04) and tracker.factor == 1.0  # below threshold: noise
    assert tracker.update(1.20) and tracker.factor == 1.20  # straggler detected
    assert not tracker.update(1.21) and tracker.factor == 1.20  # within hysteresis: no flapping
    assert tracker.update(1.30) and tracker.factor == 1.30  # straggler got worse
    assert tracker.update(1.04) and tracker.factor == 1.04  # milder, still above the exit level
    assert not tracker.update(1.035) and tracker.factor == 1.04  # within hysteresis: hold
    assert tracker.update(1.01) and tracker.factor == 1.0  # recovered


def test_slowdown_tracker_waits_for_confirmation():
    tracker = SlowdownTracker(threshold=0.05, hysteresis=0.02, confirmations=2)
    assert not tracker.update(1.3) and tracker.factor == 1.0  # one noisy check moves nothing
    assert not tracker.update(1.0) and tracker.factor == 1.0
    assert not tracker.update(1.2)
    assert tracker.update(1.22) and tracker.factor == 1.22  # confirmed: latest ratio wins
    assert tracker.update(1.1) and tracker.factor == 1.1  # faster plans need no confirmation
    assert tracker.update(1.0) and tracker.factor == 1.0


# --------------------------------------------------------------------------- profiler
def test_locate_updates_recovers_a_periodic_counter():
    period, phase = 0.1, 0.037
    rng = np.random.default_rng(0)
    reads = np.cumsum(rng.uniform(0.002, 0.03, 400))
    ticks = np.floor((reads - phase) / period)
    changes = [(a, b) for a, b, ta, tb in zip(reads, reads[1:], ticks, ticks[1:]) if tb != ta]
    located = np.array(locate_updates(changes))
    truth = phase + np.floor((np.array([b for _, b in changes]) - phase) / period) * period
    assert np.max(np.abs(located - truth)) < 0.002  # well below the ~16 ms read interval


def test_build_windows_splits_computations_at_counter_updates():
    # The counter updates at 0.1, 0.2, 0.3 s; reads bracket each update by 1 ms.
    reads = [(0.0, 0), (0.099, 0), (0.101, 100), (0.199, 100), (0.201, 300), (0.299, 300), (0.301, 450)]
    computations = [("forward@1410", 0.02, 0.12), ("backward@1410", 0.15, 0.25)]
    windows = build_windows(reads, computations)
    assert [w.energy_j for w in windows] == [0.2, 0.15]
    first, second = windows
    assert first.duration_s == pytest.approx(0.1, abs=0.002)
    assert first.counts["forward@1410"] == pytest.approx(0.2, abs=0.02)  # 0.10..0.12 of 0.02..0.12
    assert first.counts["backward@1410"] == pytest.approx(0.5, abs=0.02)
    assert second.counts == pytest.approx({"backward@1410": 0.5}, abs=0.02)
    assert sum(first.busy_s.values()) + first.idle_s == pytest.approx(first.duration_s)
    assert build_windows([(0.0, 0), (0.1, None), (0.2, 100)], computations) == []  # failed read


def test_profiler_estimates_energy_and_stops_early():
    gpu = virtual_gpu()
    meter = EnergyMeter(gpu)
    clocks = gpu.supported_sm_clocks()[::4]
    profiler = StageProfiler(0, clocks, iterations_per_clock=1, early_stop=True, patience=2)
    rng = np.random.default_rng(1)
    order = ["forward", "forward", "backward", "forward", "backward", "forward", "backward", "backward"]
    while not profiler.done:
        clock = profiler.current_clock
        gpu.set_locked_sm_clocks(clock)
        gpu.wait(gpu.switch_latency.switch_s + gpu.switch_latency.transition_s)  # until it lands
        for kind in order:
            gpu.wait(float(rng.uniform(0.0, 0.012)))
            profiler.on_counter(*meter.read())
            start = gpu.timestamp()
            gpu.run(FORWARD_S if kind == "forward" else BACKWARD_S, kind)
            profiler.on_computation(kind, clock, start, gpu.timestamp())
            profiler.on_counter(*meter.read())
        profiler.end_iteration()
    assert "early stop" in profiler.stop_reason
    assert len(profiler.profiled_clocks) < len(clocks)  # never profiled the lowest clocks
    best = gpu.preset.min_energy_clock()
    assert min(profiler.profiled_clocks) < best  # but went past the energy minimum
    measured = profiler.measurements()
    assert measured.blocking_power_w == pytest.approx(gpu.preset.idle_power_w, rel=0.25)
    errors = []
    for row in measured.rows:
        seconds = FORWARD_S if row.instruction == "forward" else BACKWARD_S
        true_time, true_energy = gpu.expected(seconds, row.frequency)
        overhead = measured.overhead_s  # the smallest gaps between computations
        assert row.time == pytest.approx(true_time + overhead, rel=1e-6)
        errors.append((row.energy - overhead * measured.blocking_power_w) / true_energy - 1)
    assert 0.0 < measured.overhead_s < 0.012
    assert np.sqrt(np.mean(np.square(errors))) < 0.12


# --------------------------------------------------------------------------- lifecycle
def test_lifecycle_profiles_solves_deploys_and_restores_clocks(schedule, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="perseus_ext")
    config = make_config(profile_path=str(tmp_path / "profile.csv"), frontier_path=str(tmp_path / "frontier.json"),
                         log_path=str(tmp_path / "log-{rank}.jsonl"), summary_path=str(tmp_path / "summary-{rank}.json"))
    gpu = sim_gpu()
    runtime = PerseusRuntime(config, schedule=schedule, stage=0, gpu=gpu)
    train(runtime, 30)
    assert runtime.phase is Phase.DEPLOYED
    assert runtime.plan == runtime.frontier.fastest
    assert 1 <= runtime.profiling_iterations <= len(runtime.candidate_clocks)
    assert set(gpu.clock_history) - {None} <= set(runtime.candidate_clocks)
    assert (tmp_path / "profile.csv").is_file() and (tmp_path / "frontier.json").is_file()
    runtime.close()
    runtime.close()  # idempotent
    assert gpu.locked_clock is None
    summary = runtime.summary()
    assert summary["final_phase"] == "deployed" and summary["deployed"]["iterations"] > 0
    assert (tmp_path / "summary-0.json").is_file()
    assert len((tmp_path / "log-0.jsonl").read_text().splitlines()) == 30
    runtime.iteration_start()  # hooks after close are ignored, never raise
    assert "profiling finished after" in caplog.text

    # A restarted job loads the saved profile and skips profiling.
    restarted = PerseusRuntime(PerseusConfig.from_dict(config.to_dict()), schedule=schedule, stage=0, gpu=sim_gpu())
    train(restarted, 5)
    assert restarted.phase is Phase.DEPLOYED and restarted.profiling_iterations == 0
    restarted.close()


def test_schedule_mismatch_logs_once_and_falls_back(schedule, caplog):
    gpu = sim_gpu()
    runtime = PerseusRuntime(make_config(warmup_iterations=0), schedule=schedule, stage=0, gpu=gpu)
    train(runtime, 2)  # now profiling: candidate clocks were locked
    assert any(clock is not None for clock in gpu.clock_history)
    runtime.iteration_start()
    runtime.before_computation(Kind.BACKWARD, 3)  # the schedule expects forward 0
    runtime.after_computation(Kind.BACKWARD, 3)
    runtime.iteration_end()
    train(runtime, 3)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "expects F0@s0" in errors[0].getMessage()
    assert runtime.fallback_reason is not None
    runtime.controller.flush()
    assert gpu.locked_clock is None  # default clocks for the rest of the run
    runtime.close()


def test_fallback_during_warmup_is_not_reported_as_missing_clock_control(schedule, caplog):
    runtime = PerseusRuntime(make_config(warmup_iterations=2), schedule=schedule, stage=0, gpu=sim_gpu())
    runtime.fall_back("the adapter cannot identify a computation")
    runtime.fall_back("a second reason")  # only the first one counts
    train(runtime, 3)
    assert runtime.phase is Phase.OBSERVING and runtime.fallback_reason.startswith("the adapter")
    assert "cannot set GPU clocks" not in caplog.text
    assert "a rank fell back to default clocks during warm-up" in caplog.text
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        "perseus-ext: rank 0 stage 0: the adapter cannot identify a computation; this rank runs at "
        "default clocks from now on"]
    runtime.close()


def test_no_clock_permission_means_dry_run(schedule, caplog):
    gpu = sim_gpu(privileged="0")
    runtime = PerseusRuntime(make_config(), schedule=schedule, stage=0, gpu=gpu)
    train(runtime, 6)
    assert runtime.controller.dry_run
    assert "DRY-RUN" in caplog.text
    assert runtime.phase is Phase.OBSERVING  # nothing to profile without clock control
    assert gpu.clock_history == []
    runtime.close()


def test_strict_mode_fails_fast_without_clock_permission(schedule):
    from perseus_ext.measurement.gpu import GPUPermissionError

    with pytest.raises(GPUPermissionError, match="CAP_SYS_ADMIN|root"):
        PerseusRuntime(make_config(strict=True), schedule=schedule, stage=0, gpu=sim_gpu(privileged="0"))


def test_controller_errors_never_reach_training(schedule):
    gpu = sim_gpu()
    gpu.inject_fault("set_locked_sm_clocks", times=None)
    runtime = PerseusRuntime(make_config(), schedule=schedule, stage=0, gpu=gpu)
    train(runtime, 12)
    runtime.close()
    assert runtime.controller.error_count >= 1
    assert gpu.locked_clock is None


def test_observe_mode_never_touches_clocks(schedule):
    gpu = sim_gpu()
    runtime = PerseusRuntime(make_config(mode="observe"), schedule=schedule, stage=0, gpu=gpu)
    train(runtime, 5)
    runtime.close()
    assert gpu.clock_history == [] and runtime.phase is Phase.OBSERVING
    assert runtime.summary()["default_clocks"]["iterations"] == 4
    assert gpu.run_counts == {"forward": 20, "backward": 20}  # paced all the same


def test_announce_slowdown_validates_input(schedule):
    runtime = PerseusRuntime(make_config(), schedule=schedule, stage=0, gpu=sim_gpu())
    runtime.announce_slowdown(1.2)
    runtime.announce_slowdown(datetime.timedelta(seconds=0.3))
    runtime.announce_slowdown(None)
    with pytest.raises(PerseusError):
        runtime.announce_slowdown(0.5)
    with pytest.raises(PerseusError):
        runtime.announce_slowdown(datetime.timedelta(0))
    runtime.close()


def test_announced_slowdown_moves_a_single_pipeline_to_a_slower_plan(schedule):
    runtime = PerseusRuntime(make_config(), schedule=schedule, stage=0, gpu=sim_gpu())
    train(runtime, 20)
    assert runtime.plan == runtime.frontier.fastest
    runtime.announce_slowdown(1.15)
    train(runtime, 9)  # two straggler checks confirm it (each reads it 3 iterations before its switch)
    assert runtime.plan.time > runtime.frontier.fastest.time
    # The slowest pipeline takes 15% longer than the normal iteration: about that much extra
    # time (the normal time is re-measured at every check, hence the margin).
    normal = np.median([r.compute_s for r in runtime.history[-9:-6]])
    assert runtime.plan.time <= runtime.frontier.fastest.time + 0.15 * normal * 1.1
    runtime.announce_slowdown(None)
    train(runtime, 6)  # recovery needs no confirmation
    assert runtime.plan == runtime.frontier.fastest
    runtime.close()


def test_policy_section_selects_a_cost_policy(schedule):
    from perseus_ext.policies import StragglerPolicy, ZeusPolicy

    runtime = PerseusRuntime(make_config(policy={"type": "zeus", "eta": 1.0}), schedule=schedule, stage=0,
                             gpu=sim_gpu())
    assert isinstance(runtime.policy, ZeusPolicy)
    train(runtime, 20)
    assert runtime.phase is Phase.DEPLOYED
    assert runtime.plan == runtime.frontier.min_energy  # eta = 1: energy only
    runtime.close()
    default = PerseusRuntime(make_config(), schedule=schedule, stage=0, gpu=sim_gpu())
    assert isinstance(default.policy, StragglerPolicy)
    default.close()
    with pytest.raises(ConfigError, match="perseus.policy.mode 'power_limit' picks a power limit"):
        PerseusRuntime(make_config(policy={"type": "zeus", "mode": "power_limit"}), schedule=schedule, stage=0,
                       gpu=sim_gpu(), policy=StragglerPolicy())
    with pytest.raises(ConfigError, match=r"limits_w: \[50(\.0)?\] W outside"):
        PerseusRuntime(make_config(policy={"type": "zeus", "mode": "power_limit", "power_limit": {"limits_w": [500, 50]}}),
                       schedule=schedule, stage=0, gpu=sim_gpu())
    with pytest.raises(ConfigError, match="perseus.policy.eta"):
        PerseusRuntime(make_config(policy={"type": "zeus", "eta": 2}), schedule=schedule, stage=0, gpu=sim_gpu())


def test_communication_clock_fills_the_gaps_between_computations(schedule):
    gpu = sim_gpu()
    runtime = PerseusRuntime(make_config(communication_clock="min"), schedule=schedule, stage=0, gpu=gpu)
    train(runtime, 20)
    assert runtime.phase is Phase.DEPLOYED
    lowest = gpu.supported_sm_clocks()[-1]
    runtime.controller.flush()
    gpu.clock_history.clear()
    train(runtime, 1)
    runtime.controller.flush()
    planned = [int(c) for c in runtime.plan.frequencies[0]]
    # Each computation at its planned clock, the lowest clock after each one (the device waits
    # for its next input there), default clocks after the last one -- or the last clock kept,
    # when the gap between iterations is too short for a reset to land (ClockSequencer). A
    # worker that falls behind skips targets the device has already passed, so only the order
    # is exact.
    expected = [c for clock in planned for c in (clock, lowest)][:-1] + [None]
    history = gpu.clock_history
    assert lowest in history and history[-1] in (None, planned[-1])
    assert all(clock in expected for clock in history)
    runtime.close()
    assert gpu.locked_clock is None
