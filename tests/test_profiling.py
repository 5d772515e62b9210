"""The profiler's clock search on a simulated A100 (virtual clock: fast, reproducible).

A stage is driven the way `ProfilingRun` drives it -- each candidate clock put in force, the
device synchronised around every computation, the energy counter read at every boundary --
with random pipeline waits between computations. Checked against the simulator's exact curves:
the search reaches the minimum-energy clock with the default keys on every seed, keeps the
clocks that are useful once a wait is paid, never stops at the maximum clock on noise, and the
profile it hands over is worth >= 90 % of a full sweep of all clocks in the planner's model.
"""

from __future__ import annotations

import numpy as np
import pytest

from perseus_ext.measurement.windows import EnergyMeter
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.planning.solver import SolverOptions, solve_frontier
from perseus_ext.runtime import profiler as profiler_module
from perseus_ext.runtime.profiler import StageProfiler, coarse_stride
from perseus_ext.runtime.profiling_run import ProfilingRun

from runtime_helpers import virtual_gpu

FORWARD_S, BACKWARD_S = (0.010, 0.014), (0.020, 0.028)  # the demo's two stages
MICROBATCHES = 4


def profile_stage(stage: int, seed: int, *, microbatches: int = MICROBATCHES, keep_wait_useful: bool = True,
                  max_wait_s: float = 0.012):
    """Profile one stage with the default keys; returns (profiler, gpu)."""
    gpu = virtual_gpu(seed=seed)
    schedule = build_schedule("1f1b", 2, microbatches)
    order = schedule.orders[stage]
    local = [(p := schedule.producer_of(c)) is None or p.stage == stage for c in order]
    profiler = StageProfiler(stage, gpu.supported_sm_clocks(), iterations_per_clock=1, early_stop=True,
                             patience=2, local_inputs=local, keep_wait_useful=keep_wait_useful)
    meter = EnergyMeter(gpu)
    rng = np.random.default_rng(seed)
    while not profiler.done:
        clock = profiler.current_clock
        gpu.set_locked_sm_clocks(clock)
        gpu.wait(gpu.switch_latency.switch_s + gpu.switch_latency.transition_s)
        profiler.on_counter(*meter.read())
        for computation, is_local in zip(order, local):
            gpu.wait(0.0005)  # the framework's own work
            ready = gpu.timestamp()
            if not is_local:
                gpu.wait(float(rng.uniform(0.0, max_wait_s)))  # the device waits for its input
            profiler.on_counter(*meter.read())
            start = gpu.timestamp()
            seconds = (FORWARD_S if computation.kind.value == "forward" else BACKWARD_S)[stage]
            gpu.run(seconds, computation.kind.value)
            profiler.on_computation(computation.kind.value, clock, start, gpu.timestamp(), ready=ready)
            profiler.on_counter(*meter.read())
        gpu.wait(0.005)  # optimizer step
        profiler.end_iteration()
    return profiler, gpu


def true_block_energy(gpu, stage: int, clock: int) -> float:
    return gpu.expected(FORWARD_S[stage], clock)[1] + gpu.expected(BACKWARD_S[stage], clock)[1]


def test_coarse_stride_is_about_a_sixteenth_of_the_max_clock():
    a100 = list(range(1410, 209, -15))
    assert coarse_stride(a100) == 6  # 90 MHz steps
    assert coarse_stride(a100[::6]) == 1  # an explicit stride already that coarse
    assert coarse_stride([1410, 1200, 990]) == 1 and coarse_stride([1410]) == 1


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stage", [0, 1])
def test_search_reaches_the_min_energy_clock_and_keeps_wait_useful_clocks(stage, seed):
    profiler, gpu = profile_stage(stage, seed)
    profiled = profiler.profiled_clocks
    step = profiler.search_clocks[0] - profiler.search_clocks[1]
    truth = {c: true_block_energy(gpu, stage, c) for c in gpu.supported_sm_clocks()}
    best = min(truth, key=truth.get)
    assert min(profiled) <= best  # reached it
    assert min(profiled) <= best - step  # and went at least one profiled step past it
    measured_best = min(profiler.block_energy, key=profiler.block_energy.get)
    assert measured_best != profiled[0]  # never the max clock on noise
    assert truth[measured_best] <= 1.06 * truth[best]  # the curve is flat there: 6 % at most
    # Clocks useful once a wait is paid: energy - blocking power x time below the best clock's.
    idle = gpu.preset.idle_power_w
    wait_cost = {c: e - idle * (gpu.expected(FORWARD_S[stage], c)[0] + gpu.expected(BACKWARD_S[stage], c)[0])
                 for c, e in truth.items()}
    useful = [c for c in profiler.search_clocks if c < best and wait_cost[c] < wait_cost[best]]
    assert set(useful) <= set(profiled)
    assert profiler.iterations == len(profiled) <= len(profiler.search_clocks)  # one iteration per clock
    assert profiler.energy_stop_iterations is not None and profiler.energy_stop_iterations <= profiler.iterations


def test_energy_only_search_stops_sooner():
    kept, _ = profile_stage(0, 0)
    energy_only, _ = profile_stage(0, 0, keep_wait_useful=False)
    assert energy_only.iterations == kept.energy_stop_iterations < kept.iterations
    assert "once a wait is paid" not in energy_only.stop_reason


def test_waits_are_not_framework_overhead():
    profiler, _ = profile_stage(0, 1, max_wait_s=0.3)
    assert profiler.overhead_s == pytest.approx(0.0005, abs=1e-4)
    assert max(profiler.waits_s) > 0.1
    single, _ = profile_stage(0, 1, microbatches=1, max_wait_s=0.3)  # F0, B0: B0 always waits
    assert single.overhead_s is None  # unknown here: the pipeline leader fills it in
    assert single.measurements().overhead_measured is False


def test_pipeline_leader_fills_in_unmeasured_overhead():
    from perseus_ext.runtime.comm import Member

    first, _ = profile_stage(0, 2, microbatches=1, max_wait_s=0.3)
    last, _ = profile_stage(1, 2, microbatches=1, max_wait_s=0.3)
    measured = [first.measurements(), last.measurements()]
    assert measured[1].overhead_measured and measured[1].overhead_s == pytest.approx(0.0005, abs=1e-4)
    members = [Member(rank=s, stage=s, pipeline=0) for s in (0, 1)]
    profile = ProfilingRun.assemble(list(zip(members, measured)), pipeline=0, blocking_override_w=None,
                                    gpu_name="sim").profile
    raw = next(r for r in measured[0].rows if r.instruction == "forward")
    row = next(r for r in profile.rows() if (r["stage"], r["instruction"], r["frequency"]) == (0, "forward", raw.frequency))
    assert row["time"] == pytest.approx(raw.time + measured[1].overhead_s)


def _frontier_saving(profilers, gpus, *, full_sweep: bool) -> float:
    rows = []
    blocking = []
    for stage, (profiler, gpu) in enumerate(zip(profilers, gpus)):
        if full_sweep:
            for clock in gpu.supported_sm_clocks():
                for kind, seconds in (("forward", FORWARD_S[stage]), ("backward", BACKWARD_S[stage])):
                    time_s, energy_j = gpu.expected(seconds, clock)
                    rows.append({"stage": stage, "instruction": kind, "frequency": clock, "time": time_s,
                                 "energy": energy_j})
            blocking.append(gpu.preset.idle_power_w)
        else:
            measured = profiler.measurements()
            rows += [{"stage": r.stage, "instruction": r.instruction, "frequency": r.frequency,
                      "time": r.time - measured.overhead_s,
                      "energy": r.energy - measured.overhead_s * measured.blocking_power_w} for r in measured.rows]
            blocking.append(measured.blocking_power_w)
    frontier = solve_frontier(build_schedule("1f1b", 2, MICROBATCHES), Profile.from_rows(rows),
                              float(np.mean(blocking)), SolverOptions(min_grid_points=300, max_clock_changes_per_s=0),
                              switch_latency_s=0.025)  # the profile's worth, per computation: no clock-change budget
    return frontier.intrinsic_saving()


def test_profile_is_worth_ninety_percent_of_a_full_sweep():
    profilers, gpus = zip(*(profile_stage(stage, 4) for stage in (0, 1)))
    full = _frontier_saving(profilers, gpus, full_sweep=True)
    searched = _frontier_saving(profilers, gpus, full_sweep=False)
    assert full > 0.05
    assert searched >= 0.9 * full, (searched, full)


def _profile_short_iterations(read_counter: bool) -> StageProfiler:
    """Two microbatches of 8 + 16 ms per iteration: a round over three clocks spans about one
    update period of the counter (100 ms), too few windows to tell the clocks apart."""
    gpu = virtual_gpu(seed=5)
    profiler = StageProfiler(0, [1410, 1200, 990], iterations_per_clock=1, early_stop=False, patience=2)
    meter = EnergyMeter(gpu)
    while not profiler.done:
        gpu.set_locked_sm_clocks(profiler.current_clock)
        gpu.wait(gpu.switch_latency.switch_s + gpu.switch_latency.transition_s)
        for kind, seconds in [("forward", 0.008), ("forward", 0.008), ("backward", 0.016), ("backward", 0.016)]:
            timestamp, energy = meter.read()
            profiler.on_counter(timestamp, energy if read_counter else None)
            start = gpu.timestamp()
            gpu.run(seconds, kind)
            profiler.on_computation(kind, profiler.current_clock, start, gpu.timestamp())
        gpu.wait(0.002)
        profiler.end_iteration()
    return profiler


def test_profiling_goes_round_the_clocks_again_until_the_windows_separate_them():
    profiler = _profile_short_iterations(read_counter=True)
    assert 3 < profiler.iterations <= 3 * profiler_module.MAX_PROFILING_ROUNDS
    assert profiler.iterations % 3 == 0 and "rounds" in profiler.stop_reason
    assert "cannot" not in profiler.stop_reason
    measured = profiler.measurements()
    assert {row.frequency for row in measured.rows} == {1410, 1200, 990}


def test_profiling_rounds_are_bounded_when_the_counter_never_answers():
    profiler = _profile_short_iterations(read_counter=False)
    assert profiler.iterations == 3 * profiler_module.MAX_PROFILING_ROUNDS
    assert "still cannot tell them apart" in profiler.stop_reason


def test_a_stage_left_without_a_profile_is_told_which_keys_fix_it(caplog):
    from types import SimpleNamespace

    profiler = _profile_short_iterations(read_counter=False)
    run = ProfilingRun(profiler, SimpleNamespace(gpu=virtual_gpu(), candidate_clocks=[1410, 1200, 990]), None, None)
    with caplog.at_level("ERROR", logger="perseus_ext"):
        assert run.measurements(fell_back=False) is None
    assert "perseus.profiling_iterations_per_clock" in caplog.text and "perseus.blocking_power_w" in caplog.text


def test_a_stop_at_the_last_search_clock_is_not_called_early(monkeypatch):
    """The search confidently stopped at its last clock: nothing was skipped, yet the log said
    "early stop at 360 MHz" (240 MHz on the full A100 range)."""
    clocks = [1410, 1200, 990, 780, 570, 360]
    original = StageProfiler.__init__
    monkeypatch.setattr(StageProfiler, "__init__", lambda self, stage, _, **keys: original(self, stage, clocks, **keys))
    profiler, _ = profile_stage(0, 2)
    assert profiler.iterations == len(profiler.search_clocks) == 6
    assert "confidently cost more energy" in profiler.stop_reason  # stopped by the rule, at the last clock
    assert profiler.stop_reason.startswith("all 6 search clocks profiled") and "early stop" not in profiler.stop_reason
    monkeypatch.undo()  # the GPU's own search clocks again: on them both of these stop early
    for stage, seed in ((0, 0), (1, 3)):  # a real early stop says how many clocks it skipped
        early, _ = profile_stage(stage, seed)
        assert early.stop_reason.startswith("early stop at "), early.stop_reason
        assert early.iterations < len(early.search_clocks) and "lower search clock(s) skipped" in early.stop_reason




def test_overhead_is_what_an_unsynchronised_iteration_pays_between_computations():
    """Profiling synchronises, so its gaps hold the host's whole turn (3 ms before each
    computation here) and then 0.5 ms of device work the host queued in the gap (a copy the
    device still ran after the host got there). An iteration run without synchronising hides the
    host's turn behind the computations still queued; its device gaps are what the model adds,
    never less than the device work the profiling gaps showed."""

    def profiled() -> StageProfiler:
        profiler = StageProfiler(0, [1410], iterations_per_clock=1, early_stop=False, patience=2,
                                 local_inputs=[True] * 4)
        end = 0.0
        for _ in range(4):
            ready = end + 0.003  # the host reaches the computation 3 ms after the last one ended
            start = ready + 0.0005  # the device runs the queued copy first
            end = start + 0.010
            profiler.on_computation("forward", 1410, start, end, ready=ready)
        return profiler

    def spans_with(gaps_s: list[float]) -> list[tuple[float, float]]:
        spans, at = [], 0.0  # the iteration starts on the device at 0
        for gap in gaps_s:
            spans.append((at + gap, at + gap + 0.010))
            at = spans[-1][1]
        return spans

    synchronised = profiled()
    assert synchronised.local_gaps == pytest.approx([0.003] * 3)
    assert synchronised.local_device_s == pytest.approx([0.0005] * 3)
    assert synchronised.overhead_s == pytest.approx(0.0035)  # no unsynchronised iteration: the whole gap
    measured = profiled()
    # The first computation's gap counts from the iteration start (its input is local too).
    measured.on_free_running_iteration(0.0, spans_with([0.0012, 0.0006, 0.0005, 0.0009]))
    assert measured.free_running_gaps == pytest.approx([0.0012, 0.0006, 0.0005, 0.0009])
    assert measured.overhead_s == pytest.approx(0.00075)  # their median
    hidden = profiled()
    hidden.on_free_running_iteration(0.0, spans_with([0.0, 0.0, 0.0, 0.0]))  # a warm-up that showed no gap
    assert hidden.overhead_s == pytest.approx(0.0005)  # the device work still counts
