"""The job's results from the runtime's JSONL logs (`log_path`), for `perseus-ext report` and the demo.

Why: the runtime's summary is per rank and a job has no side-by-side twin; the JSONL of every
rank holds what the device ran in each iteration (phase, plan, baseline probes, time, energy),
which is all a job-level figure needs (the runtime computes the same figure at close, from the
same records, with `perseus_ext.runtime.summary.job_figures`). The command prints per-rank lines and the job's measured
saving against the baseline probes with its confidence interval (energy summed over the ranks,
time of the slowest), split into the fastest-plan (intrinsic) and straggler (extrinsic) regimes,
the probes' own cost, and what warm-up, profiling and solving cost on their own. With
`--frontier` the profile-based estimate is printed beside it, labelled as a model. `--plot`
draws the timeline that the demo draws too.

A log appended across restarts holds several runs; the job of the logs' latest runs is reported
(`perseus_ext.log_files`: logs of several jobs, or a rank given twice, are refused, never merged).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from perseus_ext.log_files import JobLogs, read_logs
from perseus_ext.runtime.baseline import Sample, no_saving_reason

STRAGGLER_LABEL = "deployed (slowed for a straggler)"


def analyse(logs: JobLogs, model_saving: float | None = None, *, timeline: bool = True) -> dict[str, Any]:
    """Per-rank and job-level measured saving, probe cost and phase costs (JSON-ready), in one
    streaming pass over the logs; `timeline` keeps the job's per-iteration figures (for the
    figure and the JSON: 4 values per job iteration, the only memory that grows with the logs)."""
    from perseus_ext.runtime.baseline import RunFigures, job_sample

    per_rank = {run.rank: RunFigures() for run in logs.runs}
    fell_back_at: dict[int, int | None] = dict.fromkeys(per_rank)

    def on_sample(rank: int):
        figures = per_rank[rank]

        def add(sample: Sample) -> None:
            figures.add(sample)
            if fell_back_at[rank] is None and sample.label == "fallback":
                fell_back_at[rank] = sample.iteration
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
    ranks = {run.rank: {"pipeline": run.pipeline, "stage": run.stage, "iterations": per_rank[run.rank].iterations,
                        "fell_back_at_iteration": fell_back_at[run.rank], "measured": per_rank[run.rank].measured()}
             for run in logs.runs}
    return {"job_id": logs.job, "ranks": ranks, "job": {**job.figures(), "model_intrinsic_saving": model_saving},
            "timeline": series if timeline else None}


def timeline_label(sample: Sample) -> str:
    """The band a job iteration gets in the timeline: its phase, probes and fallbacks as such,
    and deployed iterations slowed for a straggler apart from fastest-plan ones."""
    if sample.label == "deployed" and (sample.factor or 1.0) > 1.0:
        return STRAGGLER_LABEL
    return sample.label


def _interval(comparison: dict[str, Any]) -> str:
    from perseus_ext.runtime.baseline import Comparison

    return Comparison(**comparison).describe()


def format_report(analysis: dict[str, Any]) -> str:
    """The table `perseus-ext report` prints (the demo prints it too)."""
    lines = [f"{'rank':>4} {'pipeline':>8} {'stage':>5} {'iters':>6}  measured saving [95% CI]"]
    for rank, entry in analysis["ranks"].items():
        overall = entry["measured"]["all"]
        text = (f"fell back at iteration {entry['fell_back_at_iteration']}" if entry["fell_back_at_iteration"] is not None
                else _interval(overall) if overall is not None else "no probes")
        lines.append(f"{rank:>4} {entry['pipeline']!s:>8} {entry['stage']!s:>5} {entry['iterations']:>6}  {text}")
    job = analysis["job"]
    measured = job["measured"]
    lines.append("")
    lines.append(f"job ({len(analysis['ranks'])} ranks, {job['iterations']} iterations; energy summed over the "
                 "ranks, time of the slowest):")
    overall = measured["all"]
    if overall is None:
        default = job["default_per_iteration"]
        lines.append(f"  no measured saving: {no_saving_reason(job['phase_costs'])}")
        if default["energy_j"] is not None:
            lines.append(f"  default clocks: energy/iteration {default['energy_j']:.1f} J, time/iteration "
                         f"{default['time_s']:.4f} s")
    else:
        lines.append(f"  energy/iteration: default clocks {overall['default_energy_j']:.1f} J, perseus-ext "
                     f"{overall['deployed_energy_j']:.1f} J: saving {_interval(overall)} (measured)")
        time_ci = ("" if overall["time_change_low"] is None else
                   f" [{100 * overall['time_change_low']:+.1f}, {100 * overall['time_change_high']:+.1f}]")
        lines.append(f"  time/iteration: default clocks {overall['default_time_s']:.4f} s, perseus-ext "
                     f"{overall['deployed_time_s']:.4f} s: {100 * overall['time_change']:+.1f}%{time_ci}")
        for regime, what in (("intrinsic", "fastest plan (intrinsic)"),
                             ("extrinsic", "slowed for a straggler (intrinsic + extrinsic)")):
            if measured[regime] is not None:
                lines.append(f"  {what}: saving {_interval(measured[regime])}")
        cost = measured["probe_cost"]
        lines.append(f"  baseline probes: {cost['probes']} iterations ({100 * cost['share_of_deployed']:.1f}% of the "
                     f"deployed ones), their own cost {cost['energy_j']:.1f} J "
                     f"({100 * (cost['share_of_energy'] or 0.0):.2f}% of the deployed energy)")
    if job["model_intrinsic_saving"] is not None:
        lines.append(f"  model (profile-based, pipeline 0's fastest plan vs all max clock): "
                     f"{100 * job['model_intrinsic_saving']:.1f}% intrinsic saving")
    lines.append("  lifecycle cost, never counted in the saving (extra vs default clocks):")
    for label, group in job["phase_costs"].items():
        extra = ("" if group["extra_energy_j"] is None else
                 f", extra {group['extra_energy_j']:+.1f} J {group['extra_time_s']:+.3f} s")
        energy = "n/a" if group["energy_j"] is None else f"{group['energy_j']:.1f} J"
        lines.append(f"    {label:<34}{group['iterations']:>6} iterations, {group['time_s']:.3f} s, {energy}{extra}")
    return "\n".join(lines)


def plot(analysis: dict[str, Any], path: str | Path, *, title: str,
         series: dict[str, dict[str, list[float]]] | None = None,
         straggler: tuple[int, int] | None = None) -> Path:
    """The timeline figure: job time and energy per iteration over bands marking warm-up,
    profiling, solving, deployed plans (fastest / slowed for a straggler) and baseline probes;
    `series` adds other runs (the demo's side-by-side baseline); `straggler` is the straggler's
    window when known (default: where plans were slowed for one)."""
    from perseus_ext.plotting import plot_run_timeline

    timeline = analysis["timeline"]
    labels = timeline["labels"]
    slowed = [k for k, label in enumerate(labels) if label == STRAGGLER_LABEL]
    energies = [float("nan") if e is None else e for e in timeline["energy_j"]]
    return plot_run_timeline(
        {"perseus-ext (measured)": {"time_s": timeline["time_s"], "energy_j": energies}, **(series or {})},
        labels, path, straggler=straggler or ((slowed[0], slowed[-1] + 1) if slowed else None), title=title)
