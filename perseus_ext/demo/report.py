"""What `perseus-ext demo` prints and draws."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from perseus_ext.demo.analysis import MODEL_TOLERANCE, by_variant, straggler_response
from perseus_ext.demo.scenario import Scenario


def launch_line(scenario: Scenario) -> str:
    """The demo's first line (printed before the job runs)."""
    return (f"launching {scenario.world_size} DeepSpeed ranks (torchrun, gloo); log: "
            f"{Path(scenario.out_dir) / 'torchrun.log'}")


def finish_line(paths: list[Path], seconds: float) -> str:
    """The demo's last line: its plots and how long the whole command took."""
    return f"plots: {', '.join(str(p) for p in paths)}; finished in {seconds:.0f} s"


def print_report(scenario: Scenario, comparison: dict[str, Any], results: list[list[dict[str, Any]]]) -> None:
    pers = by_variant(results, "perseus")
    summary0 = pers[0]["summary"]
    print()
    print(f"perseus-ext demo: DeepSpeed {scenario.stages} stages x {scenario.pipelines} pipelines, "
          f"{scenario.microbatches} microbatches, simulated A100 SXM, {scenario.iterations} iterations")
    print(f"profiling: {summary0['profiling_iterations']} iterations, clocks {summary0['profiled_clocks']}")
    frontier = summary0.get("frontier")
    if frontier:
        print(f"frontier (pipeline 0): {frontier['plans']} plans; fastest plan {frontier['fastest']['time_s']:.4f} s "
              f"{frontier['fastest']['energy_j']:.1f} J vs all-max-clock {frontier['all_max_clock']['energy_j']:.1f} J "
              f"(model: {100 * frontier['intrinsic_saving']:.1f}% intrinsic bloat)")
    print()
    print("per iteration over each window: mean job time (its step on the devices) and the change of the "
          "median, mean job energy (all GPUs); recovery: the first iterations after the straggler recovered")
    header = (f"{'window':<14}{'iters':>9}{'time/it base':>14}{'perseus':>10}{'change':>9}{'median':>8}"
              f"{'energy/it base':>16}{'perseus':>10}{'saved':>8}{'(counter)':>11}")
    print(header)
    print("-" * len(header))
    for label, row in comparison["windows"].items():
        span = f"{row['iterations'][0]}-{row['iterations'][1] - 1}"
        print(f"{label:<14}{span:>9}{row['baseline_time_s']:>12.4f} s{row['perseus_time_s']:>8.4f} s"
              f"{100 * row['time_change']:>+8.1f}%{100 * row['median_time_change']:>+7.1f}%"
              f"{row['baseline_true_energy_j']:>14.1f} J"
              f"{row['perseus_true_energy_j']:>8.1f} J{100 * row['energy_saving']:>7.1f}%"
              f"{100 * row['measured_energy_saving']:>10.1f}%")
    print("energy: the simulated GPUs' exact energy; (counter): the saving perseus-ext measured "
          "itself with the coarse NVML-like energy counter")
    table = comparison["windows"]
    if "no straggler" in table:
        calm = table["no straggler"]
        intrinsic = calm["baseline_true_energy_j"] - calm["perseus_true_energy_j"]
        print()
        print(f"intrinsic savings (fastest plan, no slowdown): {intrinsic:.1f} J/iteration "
              f"({100 * calm['energy_saving']:.1f}%)")
        if "straggler" in table:
            slow = table["straggler"]
            total = slow["baseline_true_energy_j"] - slow["perseus_true_energy_j"]
            print(f"extrinsic savings (non-stragglers slowed to the straggler): {total - intrinsic:.1f} "
                  f"J/iteration on top ({100 * (total - intrinsic) / slow['baseline_true_energy_j']:.1f}%), "
                  f"{100 * slow['energy_saving']:.1f}% in total")
    print_measured(comparison)
    check = comparison.get("model_check")
    if check:
        print(f"model check (pipeline 0, fastest plan): time {check['planned_time_s']:.4f} s planned vs "
              f"{check['measured_compute_s']:.4f} s measured ({100 * check['time_error']:+.1f}%), energy "
              f"{check['planned_energy_j']:.1f} J planned vs {check['measured_energy_j']:.1f} J measured "
              f"({100 * check['energy_error']:+.1f}%): "
              + ("within" if check["within_tolerance"] else "OUTSIDE") + f" the ±{100 * MODEL_TOLERANCE:.0f}% tolerance")
    coverage = [r["summary"]["clock_coverage"] for r in pers if r["summary"]]
    exact = [c["exact"] for c in coverage if c["exact"] is not None]
    estimated = [c["estimated"] for c in coverage if c["estimated"] is not None]
    if exact:
        print(f"clock coverage: {100 * statistics.fmean(exact):.1f}% (share of deployed compute time at its "
              f"planned clock, exact on the simulated devices; estimated from device markers as on a real "
              f"GPU: {100 * statistics.fmean(estimated) if estimated else float('nan'):.1f}%; clock-change "
              f"latency {1000 * coverage[0]['switch_latency_s']:.0f} ms)")
    for pipeline, switches in sorted(straggler_response(scenario, pers).items()):
        steps = ", ".join(f"it {s['iteration']}: plan {s['plan']} (x{s['factor']:.2f})" for s in switches)
        print(f"pipeline {pipeline} plans: {steps}")


def print_measured(comparison: dict[str, Any]) -> None:
    """The saving measured against the baseline probes (what a job without a twin reports),
    with its interval, against the side-by-side saving over the same deployed iterations."""
    from perseus_ext.observability.reporting import format_report

    report, twin = comparison["report"], comparison["side_by_side_saving"]
    print()
    print("what the job itself measured (perseus-ext report on the perseus run's logs):")
    print(format_report(report))
    overall = report["job"]["measured"]["all"]
    if overall is None or twin is None:
        return
    low, high = overall["saving_low"], overall["saving_high"]
    inside = low is not None and low <= twin <= high
    print(f"measured saving {100 * overall['saving']:.1f}%" + (
        "" if low is None else f" [{100 * low:.1f}, {100 * high:.1f}] (95% CI)")
        + f" vs side-by-side {100 * twin:.1f}% (exact energy, same deployed iterations): "
        + ("within the interval" if inside else "OUTSIDE the interval"))


def plot(scenario: Scenario, comparison: dict[str, Any], results: list[list[dict[str, Any]]]) -> list[Path]:
    """frontier.png (time-energy frontier with the plans used) and timeline.png (time and
    energy of every iteration, baseline vs perseus)."""
    from perseus_ext.observability.reporting import plot as plot_report
    from perseus_ext.planning.frontier import Frontier
    from perseus_ext.observability.plotting import plot_frontier

    out = Path(scenario.out_dir)
    paths = []
    frontier_file = out / "frontier-perseus.json"
    if frontier_file.is_file():
        frontier = Frontier.load(frontier_file)
        used = {s["plan"] for s in straggler_response(scenario, by_variant(results, "perseus"))[0]}
        marks = {f"plan {index} (straggler)": frontier.plans[index] for index in sorted(used - {0})}
        plot_frontier(frontier, out / "frontier.png", marks=marks, title="Pipeline 0 time-energy frontier")
        paths.append(out / "frontier.png")
    straggler = ((scenario.straggler_start, scenario.straggler_end)
                 if scenario.straggler_pipeline is not None else None)
    baseline = comparison["series"]["baseline"]
    plot_report(
        comparison["report"], out / "timeline.png", straggler=straggler,
        series={"baseline, side by side (measured)": {"time_s": baseline["device_time_s"], "energy_j": baseline["energy_j"]}},
        title=f"perseus-ext demo ({scenario.stages} stages x {scenario.pipelines} pipelines): job time and "
              f"energy per iteration",
    )
    paths.append(out / "timeline.png")
    return paths
