"""Online profiling's accuracy on the demo's two-stage pipeline, against the simulator's truth.

    PYTHONPATH=. python benchmarks/profiling_accuracy.py [--seeds 4]
    PYTHONPATH=/other/checkout python benchmarks/profiling_accuracy.py   # compare versions

Each stage is profiled with the default keys (one iteration per searched clock, confident early
stop) on a virtual-clock simulated A100, read the way a pipeline stage reads its counter: at
computation boundaries only, pipeline waits of 0-90 ms before computations whose input comes
from the other stage, 0.55 s without reads between iterations (optimizer step, gradient sync,
clock switch), as in `perseus-ext demo`. Per seed and stage it prints the profiling iterations,
the per-clock power error, the blocking power and the estimated vs true minimum-energy clock;
per seed, the fastest plan solved from the measured profiles replayed in the TRUE cost model
(its real saving) against the fastest plan of a full sweep of all clocks, and the model's
energy error on that plan.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from perseus_ext.measurement.gpu import open_gpu
from perseus_ext.measurement.windows import EnergyMeter
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.planning.solver import SolverOptions, solve_frontier
from perseus_ext.runtime.profiler import StageProfiler

FORWARD_S, BACKWARD_S = (0.025, 0.035), (0.050, 0.070)  # the demo's two stages at the max clock
MICROBATCHES = 4
ITERATION_GAP_S = 0.55  # between iterations, without counter reads
MAX_WAIT_S = 0.09  # pipeline wait before a computation whose input comes from the other stage
SWITCH_LATENCY_S = 0.025


def profile_stage(stage: int, seed: int):
    """One stage's profiling with the default keys; returns (profiler, gpu)."""
    gpu = open_gpu("sim:a100_sxm?pace=0", seed=seed * 10 + stage)
    schedule = build_schedule("1f1b", 2, MICROBATCHES)
    order = schedule.orders[stage]
    local = [(p := schedule.producer_of(c)) is None or p.stage == stage for c in order]
    profiler = StageProfiler(stage, gpu.supported_sm_clocks(), iterations_per_clock=1, early_stop=True,
                             patience=2, local_inputs=local)
    meter = EnergyMeter(gpu)
    rng = np.random.default_rng(seed * 10 + stage)
    while not profiler.done:
        clock = profiler.current_clock
        gpu.set_locked_sm_clocks(clock)
        gpu.wait(gpu.switch_latency.switch_s + gpu.switch_latency.transition_s)
        profiler.on_counter(*meter.read())
        for computation, is_local in zip(order, local):
            gpu.wait(0.0005)  # the framework's own work
            ready = gpu.timestamp()
            if not is_local:
                gpu.wait(float(rng.uniform(0.0, MAX_WAIT_S)))
            profiler.on_counter(*meter.read())
            start = gpu.timestamp()
            kind = computation.kind.value
            gpu.run((FORWARD_S if kind == "forward" else BACKWARD_S)[stage], kind)
            profiler.on_computation(kind, clock, start, gpu.timestamp(), ready=ready)
            profiler.on_counter(*meter.read())
        gpu.wait(ITERATION_GAP_S)
        profiler.end_iteration()
    return profiler, gpu


def true_rows(gpus) -> list[dict]:
    return [{"stage": stage, "instruction": kind, "frequency": clock,
             "time": gpu.expected(seconds[stage], clock)[0], "energy": gpu.expected(seconds[stage], clock)[1]}
            for stage, gpu in enumerate(gpus) for clock in gpu.supported_sm_clocks()
            for kind, seconds in (("forward", FORWARD_S), ("backward", BACKWARD_S))]


def run_seed(seed: int) -> dict:
    profilers, gpus = zip(*(profile_stage(stage, seed) for stage in (0, 1)))
    idle_w = gpus[0].preset.idle_power_w
    stages = []
    rows = []
    blocking = []
    for stage, (profiler, gpu) in enumerate(zip(profilers, gpus)):
        measured = profiler.measurements()
        powers = {r.frequency: (r.energy - measured.overhead_s * measured.blocking_power_w) / (r.time - measured.overhead_s)
                  for r in measured.rows if r.instruction == "forward"}
        errors = [powers[c] / gpu.preset.compute_power_w(c) - 1 for c in powers]
        block = {c: gpu.expected(FORWARD_S[stage], c)[1] + gpu.expected(BACKWARD_S[stage], c)[1]
                 for c in profiler.profiled_clocks}
        truth_all = {c: gpu.expected(FORWARD_S[stage], c)[1] + gpu.expected(BACKWARD_S[stage], c)[1]
                     for c in gpu.supported_sm_clocks()}
        estimated = {c: powers[c] * (gpu.expected(FORWARD_S[stage], c)[0] + gpu.expected(BACKWARD_S[stage], c)[0])
                     for c in powers}
        stages.append({"stage": stage, "iterations": profiler.iterations, "clocks": len(profiler.profiled_clocks),
                       "kept": len(powers), "rms_power_error": float(np.sqrt(np.mean(np.square(errors)))),
                       "blocking_w": measured.blocking_power_w, "true_blocking_w": idle_w,
                       "best_estimated": min(estimated, key=estimated.get), "best_profiled": min(block, key=block.get),
                       "best_true": min(truth_all, key=truth_all.get),
                       "step": profiler.search_clocks[0] - profiler.search_clocks[1]})
        rows += [{"stage": r.stage, "instruction": r.instruction, "frequency": r.frequency,
                  "time": r.time - measured.overhead_s, "energy": r.energy - measured.overhead_s * measured.blocking_power_w}
                 for r in measured.rows]
        blocking.append(measured.blocking_power_w)
    schedule = build_schedule("1f1b", 2, MICROBATCHES)
    options = SolverOptions(min_grid_points=300)
    truth_profile = Profile.from_rows(true_rows(gpus))
    full = solve_frontier(schedule, truth_profile, idle_w, options, switch_latency_s=SWITCH_LATENCY_S)
    searched = solve_frontier(schedule, Profile.from_rows(rows), float(np.mean(blocking)), options,
                              switch_latency_s=SWITCH_LATENCY_S)
    true_model = CostModel(schedule, truth_profile, idle_w, SWITCH_LATENCY_S)
    baseline_time, baseline_energy = (float(v) for v in true_model.replay(true_model.fastest_choice()))
    plan_time, plan_energy = (float(v) for v in true_model.replay(true_model.choice_of(searched.fastest)))
    return {"seed": seed, "stages": stages, "full_saving": full.intrinsic_saving(),
            "real_saving": 1.0 - plan_energy / baseline_energy, "time_change": plan_time / baseline_time - 1.0,
            "model_energy_error": searched.fastest.energy / plan_energy - 1.0}


def main() -> None:
    from perseus_ext.commands.arguments import bounded_int  # the CLI's flag types
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--seeds", type=bounded_int(1, 10**9), default=4)
    args = parser.parse_args()
    results = [run_seed(seed) for seed in range(args.seeds)]
    print("seed stage iters clocks kept  power rms  blocking W (true)  min-energy clock est/profiled/true (step)")
    for result in results:
        for s in result["stages"]:
            print(f"{result['seed']:4d} {s['stage']:5d} {s['iterations']:5d} {s['clocks']:6d} {s['kept']:4d}"
                  f"  {100 * s['rms_power_error']:8.1f}%  {s['blocking_w']:6.1f} ({s['true_blocking_w']:.2f})"
                  f"     {s['best_estimated']}/{s['best_profiled']}/{s['best_true']} MHz ({s['step']} MHz)")
    print("\nseed  full-sweep saving  measured plan's real saving  ratio  time change  model energy error")
    for r in results:
        print(f"{r['seed']:4d}  {100 * r['full_saving']:16.1f}%  {100 * r['real_saving']:26.1f}%"
              f"  {r['real_saving'] / r['full_saving']:5.2f}  {100 * r['time_change']:+10.2f}%"
              f"  {100 * r['model_energy_error']:+17.1f}%")
    iterations = [s["iterations"] for r in results for s in r["stages"]]
    print(f"\nprofiling iterations per stage: median {statistics.median(iterations)}, max {max(iterations)} "
          f"(one per profiled clock)")


if __name__ == "__main__":
    main()
