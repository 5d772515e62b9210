"""The job's results from the runtime's JSONL logs (`log_path`), for `perseus-ext report` and the demo.

Why: the runtime's summary is per rank and a job has no side-by-side twin; the JSONL of every
rank holds what the device ran in each iteration (phase, plan, baseline probes, time, energy),
which is all a job-level figure needs (the runtime computes the same figure at close, from the
same records and the same `observability.run_figures.RunFigures`). The command prints, at most 100
columns wide, the job's measured saving against the baseline probes with its confidence interval
(energy summed over the ranks, time of the slowest) and whether the evidence is thin, split into
the fastest-plan (intrinsic) and straggler (extrinsic) regimes, the probes' own cost, a table of
every rank's own saving (the same tables the runtime's job summary prints:
`observability.summary_text`), and what warm-up, profiling and solving cost on their own.
With `--frontier` the profile-based estimate is printed beside it, labelled as a model. `--plot`
draws the timeline that the demo draws too.

A log appended across restarts holds several runs; the job of the logs' latest runs is reported
(`observability.log_files`: logs of several jobs, or a rank given twice, are refused, never merged).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from perseus_ext.observability.log_files import JobLogs, read_logs
from perseus_ext.observability.power_samples import DeployedRun, job_swing, rank_swing
from perseus_ext.observability.run_figures import RunFigures, Sample, job_sample, no_saving_reason
from perseus_ext.observability.saving_estimate import Comparison

STRAGGLER_LABEL = "deployed (slowed for a straggler)"


def analyse(logs: JobLogs, model_saving: float | None = None, *, timeline: bool = True) -> dict[str, Any]:
    """Per-rank and job-level measured saving, probe cost and phase costs (JSON-ready), in one
    streaming pass over the logs; `timeline` keeps the job's per-iteration figures (for the
    figure and the JSON: 4 values per job iteration, the only memory that grows with the logs)."""
    per_rank = {run.rank: RunFigures() for run in logs.runs}
    fell_back_at: dict[int, int | None] = dict.fromkeys(per_rank)
    power_runs = {rank: DeployedRun() for rank in per_rank}  # bounded: the last deployed run's samples
    with_power: set[int] = set()

    def on_sample(rank: int):
        figures = per_rank[rank]

        def add(sample: Sample) -> None:
            figures.add(sample)
            if fell_back_at[rank] is None and sample.label == "fallback":
                fell_back_at[rank] = sample.iteration
            if (power := sample.iteration_power()) is not None:
                power_runs[rank].add(power)
                with_power.add(rank)
        return add

    job = RunFigures()
    series: dict[str, list] = {"iterations": [], "labels": [], "time_s": [], "energy_j": []}
    for iteration, row in logs.merged({rank: on_sample(rank) for rank in per_rank}):
        sample = job_sample(iteration, row)
        job.add(sample)
        if timeline:
            series["iterations"].append(sample.iteration)
            series["labels"].append(timeline_label(sample))
            series["time_s"].append(sample.time_s)
            series["energy_j"].append(sample.energy_j)
    runs = {rank: collector.items() for rank, collector in power_runs.items()}
    ranks = {run.rank: {"pipeline": run.pipeline, "stage": run.stage, "iterations": per_rank[run.rank].iterations,
                        "fell_back_at_iteration": fell_back_at[run.rank], "measured": per_rank[run.rank].measured(),
                        "power_swing": rank_swing(runs[run.rank], run.rank in with_power)}
             for run in logs.runs}
    return {"job_id": logs.job, "ranks": ranks,
            "job": {**job.figures(), "model_intrinsic_saving": model_saving,
                    "power_swing": job_swing(list(runs.values()))},
            "timeline": series if timeline else None}


def timeline_label(sample: Sample) -> str:
    """The band a job iteration gets in the timeline: its phase, probes and fallbacks as such,
    and deployed iterations slowed for a straggler apart from fastest-plan ones."""
    if sample.label == "deployed" and (sample.factor or 1.0) > 1.0:
        return STRAGGLER_LABEL
    return sample.label


def format_report(analysis: dict[str, Any]) -> str:
    """What `perseus-ext report` prints (the demo prints it too), at most 100 columns wide: the
    job's measured saving as labelled rows, every rank's own figures as a table, and what the
    lifecycle cost, each with what it means."""
    from perseus_ext.observability.summary_text import (
        WIDTH,
        gpus_summed,
        labelled_rows,
        measured_rows,
        rank_table,
        swing_row,
        table,
    )

    job = analysis["job"]
    measured = job["measured"]
    costs = job["phase_costs"]
    named = f"job {analysis['job_id']}" if analysis.get("job_id") else "job (its rows carry no job id)"
    ranks = len(analysis["ranks"])
    head = f"{named}: {ranks} rank{'s' * (ranks != 1)}, {job['iterations']} iterations"
    if costs:
        head += " (" + ", ".join(f"{label} {group['iterations']}" for label, group in costs.items()) + ")"
    lines = textwrap.wrap(head, WIDTH, subsequent_indent="  ")
    rows: list[tuple[str, str]] = [("figures", "measured vs baseline probes, for the whole job (energy summed over "
                                               "the ranks, time of the slowest)")]
    overall = measured["all"]
    if overall is None:
        rows.append(("no saving", no_saving_reason(costs)))
        default = job["default_per_iteration"]
        if default["energy_j"] is not None:
            rows.append(("default clocks", f"energy/iteration {default['energy_j']:.1f} J, time/iteration "
                                           f"{default['time_s']:.4f} s"))
    else:
        rows += measured_rows(measured)
        for regime, what in (("intrinsic", "fastest plan"), ("extrinsic", "straggler")):
            if measured[regime] is not None and measured[regime]["deployed"] != overall["deployed"]:
                rows.append((what, f"saving {Comparison(**measured[regime]).describe_with_evidence()}" + (
                    " (intrinsic: no straggler)" if regime == "intrinsic" else
                    " (intrinsic + extrinsic: plans slowed for a straggler)")))
    if job["model_intrinsic_saving"] is not None:
        rows.append(("model", f"{100 * job['model_intrinsic_saving']:.1f}% intrinsic (profile-based: pipeline 0's "
                              "fastest plan vs all max clock)"))
    if (swing := swing_row(job.get("power_swing"), gpus_summed(ranks))) is not None:
        rows.append(swing)
    lines += labelled_rows(rows)
    entries = [{"rank": rank, "pipeline": entry["pipeline"], "stage": entry["stage"],
                "iterations": entry["iterations"], "measured": entry["measured"]["all"],
                "fell_back_at_iteration": entry["fell_back_at_iteration"], "clock_coverage": entry.get("clock_coverage"),
                "power_swing_w": entry["power_swing"].get("peak_to_trough_w")}
               for rank, entry in analysis["ranks"].items()]
    if len(entries) > 1:  # one rank's figures are the job's, printed above
        lines += rank_table(entries, "--output writes every rank's figures as JSON")
    lines.append("  lifecycle cost, never counted in the saving (extra: beyond default clocks per iteration):")
    lifecycle = []
    for label, group in costs.items():
        lifecycle.append([label, str(group["iterations"]), f"{group['time_s']:.3f}",
                          "-" if group["energy_j"] is None else f"{group['energy_j']:.1f}",
                          "-" if group["extra_time_s"] is None else f"{group['extra_time_s']:+.3f}",
                          "-" if group["extra_energy_j"] is None else f"{group['extra_energy_j']:+.1f}"])
    lines += table(("phase", "iters", "time (s)", "energy (J)", "extra s", "extra J"), lifecycle, indent="    ",
                   left=(0,))
    return "\n".join(lines)


def plot(analysis: dict[str, Any], path: str | Path, *, title: str,
         series: dict[str, dict[str, list[float]]] | None = None,
         straggler: tuple[int, int] | None = None) -> Path:
    """The timeline figure: job time and energy per iteration over bands marking warm-up,
    profiling, solving, deployed plans (fastest / slowed for a straggler) and baseline probes;
    `series` adds other runs (the demo's side-by-side baseline); `straggler` is the straggler's
    window when known (default: where plans were slowed for one)."""
    from perseus_ext.observability.plotting import plot_run_timeline

    timeline = analysis["timeline"]
    labels = timeline["labels"]
    slowed = [k for k, label in enumerate(labels) if label == STRAGGLER_LABEL]
    energies = [float("nan") if e is None else e for e in timeline["energy_j"]]
    return plot_run_timeline(
        {"perseus-ext (measured)": {"time_s": timeline["time_s"], "energy_j": energies}, **(series or {})},
        labels, path, straggler=straggler or ((slowed[0], slowed[-1] + 1) if slowed else None), title=title)
