"""Baseline vs perseus per window of iterations, the measured saving, the model check."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from perseus_ext.demo.scenario import Scenario


def by_variant(results: list[list[dict[str, Any]]], variant: str) -> list[dict[str, Any]]:
    """Every rank's result of one variant, by rank."""
    return [next(r for r in rank_results if r["variant"] == variant) for rank_results in results]


def job_series(ranks: list[dict[str, Any]], key: str) -> list[float]:
    """Per-iteration job figure: the job's step on the devices (`device_time_s`: from the first
    device starting it to the last one ending it; the devices share one clock), or the sum of
    every rank's energy. `true_energy_j` is the exact energy of the devices over the job's step:
    each device's over its own step, plus its idle power for the rest of the job's (the variants
    take turns, so a device is idle between its own steps)."""
    rows = list(zip(*(r["iterations"] for r in ranks)))
    if key not in ("device_time_s", "true_energy_j"):
        return [sum(item[key] for item in row) for row in rows]
    spans = [max(item["device_end_s"] for item in row) - min(item["device_start_s"] for item in row) for row in rows]
    if key == "device_time_s":
        return spans
    return [sum(item["true_energy_j"] + rank["idle_power_w"] * (span - item["device_end_s"] + item["device_start_s"])
                for rank, item in zip(ranks, row)) for row, span in zip(rows, spans)]


MODEL_TOLERANCE = 0.05  # the model check's bound: planned vs measured time and energy of the deployed plan
RECOVERY_ITERATIONS = 8  # the "recovery" window: the first iterations after the straggler recovered


def windows(scenario: Scenario, perseus_ranks: list[dict[str, Any]]) -> dict[str, range]:
    """Iteration ranges to compare: deployed without straggler, with straggler, recovered, and
    within the latter the first `RECOVERY_ITERATIONS` (what the return to the fastest plan costs)."""
    phases = [it["phase"] for it in perseus_ranks[0]["iterations"]]
    deployed = phases.index("deployed") if "deployed" in phases else len(phases)
    if scenario.straggler_pipeline is None:
        return {"no straggler": range(deployed, scenario.iterations)}
    start = max(scenario.straggler_start, deployed)
    end = scenario.straggler_end
    return {
        "no straggler": range(deployed, start),
        "straggler": range(start, end),
        "recovered": range(end, scenario.iterations),
        "recovery": range(end, min(end + RECOVERY_ITERATIONS, scenario.iterations)),
    }


def compare(scenario: Scenario, results: list[list[dict[str, Any]]], baseline: str = "observe") -> dict[str, Any]:
    """Baseline vs perseus per window of iterations.

    Time: the mean of the job's step on the devices (`device_time_s`; the worker says why not
    the host's wall time), and
    the median (a shared 2-core machine adds scheduling spikes that are not the method's doing,
    but a slowdown over a few iterations -- a late return after a straggler -- shows only in the
    mean). Energy: mean job energy per iteration, both the simulator's exact integral over that
    step (`true_energy_j`, the table's figure) and what the runtime measured with the coarse
    NVML-like counter (`energy_j`; per-iteration readings are quantised to counter updates, so
    only means over many iterations are meaningful).
    """
    base, pers = by_variant(results, baseline), by_variant(results, "perseus")
    series = {
        name: {key: job_series(ranks, key) for key in ("device_time_s", "energy_j", "true_energy_j")}
        for name, ranks in (("baseline", base), ("perseus", pers))
    }
    # Baseline probes run default clocks on purpose: the side-by-side figures leave them out,
    # so they compare the plans with their twin (what the probes measure).
    probes = {i for r in pers for i, it in enumerate(r["iterations"]) if it.get("probe")}
    table = {}
    for label, span in windows(scenario, pers).items():
        kept = [i for i in span if i not in probes]
        if not kept:
            continue
        row: dict[str, Any] = {}
        for name in ("baseline", "perseus"):
            row[f"{name}_time_s"] = statistics.fmean(series[name]["device_time_s"][i] for i in kept)
            row[f"{name}_median_time_s"] = statistics.median(series[name]["device_time_s"][i] for i in kept)
            for key in ("energy_j", "true_energy_j"):
                row[f"{name}_{key}"] = statistics.fmean(series[name][key][i] for i in kept)
        row["time_change"] = row["perseus_time_s"] / row["baseline_time_s"] - 1.0
        row["median_time_change"] = row["perseus_median_time_s"] / row["baseline_median_time_s"] - 1.0
        row["energy_saving"] = 1.0 - row["perseus_true_energy_j"] / row["baseline_true_energy_j"]
        row["measured_energy_saving"] = 1.0 - row["perseus_energy_j"] / row["baseline_energy_j"]
        row["iterations"] = [span.start, span.stop]
        table[label] = row
    deployed = sorted({i for span in windows(scenario, pers).values() for i in span if i not in probes})
    side_by_side = None if not deployed else 1.0 - (
        statistics.fmean(series["perseus"]["true_energy_j"][i] for i in deployed)
        / statistics.fmean(series["baseline"]["true_energy_j"][i] for i in deployed))
    return {"windows": table, "series": series, "model_check": model_check(scenario, pers),
            "side_by_side_saving": side_by_side, "report": measured_report(scenario, pers)}


def measured_report(scenario: Scenario, perseus_ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """What `perseus-ext report` makes of the perseus run's own logs: the saving measured
    against its baseline probes, as a job without a twin would see it."""
    from perseus_ext.observability.log_files import read_logs
    from perseus_ext.observability.reporting import analyse

    frontier = perseus_ranks[0]["summary"].get("frontier") if perseus_ranks[0]["summary"] else None
    logs = sorted(Path(scenario.out_dir).glob("log-perseus-*.jsonl"))
    return analyse(read_logs(logs), frontier["intrinsic_saving"] if frontier else None)


def model_check(scenario: Scenario, perseus_ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Pipeline 0's deployed fastest plan, predicted against what the simulated devices did in
    the no-straggler window: the plan's time against stage 0's measured compute span (device
    markers, from its first computation's start: what precedes it is the host's), its energy against the pipeline's exact energy per iteration (step start to step
    start) less the blocking energy of the time outside the plan (gradient sync, optimizer step,
    the host's turn at the other variants)."""
    pipeline = sorted((r for r in perseus_ranks if r["pipeline"] == 0), key=lambda r: r["stage"])
    frontier = pipeline[0]["summary"].get("frontier")
    span = windows(scenario, perseus_ranks).get("no straggler")
    if frontier is None or not span:
        return None
    fastest = frontier["fastest"]
    at_plan = [i for i in span if pipeline[0]["iterations"][i].get("plan") == 0]
    if not at_plan:
        return None
    rows = [pipeline[0]["iterations"][i] for i in at_plan]
    compute = statistics.median(row["compute_s"] - (row.get("first_computation_s") or 0.0) for row in rows)
    iteration = statistics.fmean(pipeline[0]["iterations"][i]["period_s"] for i in at_plan)
    energy = statistics.fmean(sum(r["iterations"][i]["tiled_energy_j"] for r in pipeline) for i in at_plan)
    outside = frontier["blocking_power_w"] * len(pipeline) * max(0.0, iteration - fastest["time_s"])
    time_error = compute / fastest["time_s"] - 1.0
    energy_error = (energy - outside) / fastest["energy_j"] - 1.0
    return {
        "planned_time_s": fastest["time_s"], "measured_compute_s": compute, "time_error": time_error,
        "planned_energy_j": fastest["energy_j"], "measured_energy_j": energy - outside,
        "energy_error": energy_error,
        "within_tolerance": abs(time_error) <= MODEL_TOLERANCE and abs(energy_error) <= MODEL_TOLERANCE,
    }


def straggler_response(scenario: Scenario, perseus_ranks: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Plan switches of each pipeline (from its stage-0 rank), for the timeline and tests."""
    return {r["pipeline"]: r["summary"]["plan_switches"] for r in perseus_ranks if r["stage"] == 0}
