"""The end-of-run summary as text a console shows at 100 columns: the job's figures as labelled
rows, every rank's own figures as a table, one rank's line when there is no job figure.

Why a table per rank beside the job's figure: a stage with slack saves more than the busiest
one, so the ranks' savings (say -6 % to +16 %) are not the job's (+6 %); printed side by side,
each labelled, nobody reads a rank's figure as the job's. Why at most 100 columns: the summary
is read in a terminal or a job scheduler's log viewer, where one 600-character line wraps into
an unreadable block. `perseus-ext report` prints the same tables from the logs
(`perseus_ext.observability.reporting`).
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from perseus_ext.observability.run_figures import no_saving_reason
from perseus_ext.observability.saving_estimate import MIN_TRUSTED_PROBES, TARGET_HALF_WIDTH, Comparison

WIDTH = 100  # columns every line fits in
LABEL_WIDTH = 18  # the job's row labels ("energy/iteration:" ...)
MAX_RANK_ROWS = 32  # ranks listed one per row; a larger job lists the extremes and where the rest are


def labelled_rows(rows: Sequence[tuple[str, str]], indent: str = "  ") -> list[str]:
    """'  label:            value' rows, values wrapped under themselves at `WIDTH` columns."""
    lines = []
    for label, value in rows:
        head = f"{indent}{label + ':':<{LABEL_WIDTH}}"
        lines += textwrap.wrap(value, WIDTH, initial_indent=head, subsequent_indent=" " * len(head),
                               break_on_hyphens=False) or [head.rstrip()]
    return lines


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ",
          left: Sequence[int] = ()) -> list[str]:
    """A text table: columns as wide as their widest cell, right-aligned (`left`: the columns
    aligned left), two spaces apart."""
    widths = [max(len(header), *(len(row[k]) for row in rows)) for k, header in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return indent + "  ".join(cell.ljust(width) if k in left else cell.rjust(width)
                                  for k, (cell, width) in enumerate(zip(cells, widths))).rstrip()
    return [line(headers), indent + "  ".join("-" * width for width in widths)] + [line(row) for row in rows]


def _percent(value: float | None, sign: str = "") -> str:
    return "-" if value is None else f"{100 * value:{sign}.1f}%"


def saving_cells(measured: Mapping[str, Any] | None) -> tuple[str, str, str, str]:
    """(saving, its 95% interval, probes, probes its interval needs for the target width); no
    interval from fewer than `MIN_TRUSTED_PROBES` probes (its width would be a guess)."""
    if measured is None:
        return "-", "-", "0", "-"
    interval = ("-" if measured["saving_low"] is None or measured["probes"] < MIN_TRUSTED_PROBES else
                f"[{100 * measured['saving_low']:.1f}, {100 * measured['saving_high']:.1f}]")
    needed = measured.get("probes_needed")
    return _percent(measured["saving"]), interval, str(measured["probes"]), "-" if needed is None else str(needed)


RANK_HEADERS = ("rank", "pipeline", "stage", "iters", "saving", "95% CI", "probes", "need", "coverage", "swing W",
                "note")
OPTIONAL_COLUMNS = ("coverage", "swing W", "note")  # shown only where some rank has a figure


def rank_rows(entries: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """One table row per rank; `entries` hold rank, pipeline, stage, iterations, measured (the
    'all' comparison or None), fell_back_at_iteration, clock_coverage and power_swing_w (the
    GPU's measured peak-to-trough; None where unknown)."""
    rows = []
    for entry in entries:
        saving, interval, probes, needed = saving_cells(entry["measured"])
        fell_back = entry.get("fell_back_at_iteration")
        coverage, swing = entry.get("clock_coverage"), entry.get("power_swing_w")
        rows.append([str(entry["rank"]), "-" if entry["pipeline"] is None else str(entry["pipeline"]),
                     "-" if entry["stage"] is None else str(entry["stage"]), str(entry["iterations"]),
                     saving, interval, probes, needed, _percent(coverage), "-" if swing is None else f"{swing:.0f}",
                     "" if fell_back is None else f"fell back at it {fell_back}"])
    return rows


def rank_table(entries: Sequence[Mapping[str, Any]], where_the_rest_are: str) -> list[str]:
    """The per-rank table with what its columns mean; past `MAX_RANK_ROWS` ranks, the ones
    that save least and most and `where_the_rest_are`."""
    shown = list(entries)
    note = []
    if len(shown) > MAX_RANK_ROWS:
        ordered = sorted(shown, key=lambda entry: -1e9 if entry["measured"] is None else entry["measured"]["saving"])
        half = MAX_RANK_ROWS // 2
        shown = sorted(ordered[:half] + ordered[-half:], key=lambda entry: entry["rank"])
        note = [f"    ({len(entries) - len(shown)} more ranks between the least and the most saving ones shown; "
                f"{where_the_rest_are})"]
    lines = textwrap.wrap("per rank (each GPU's own stage: a stage with slack saves more than the busiest one, "
                          "so these are not the job's figure):", WIDTH, initial_indent="  ", subsequent_indent="  ")
    rows = rank_rows(shown)
    # a column nobody has a figure in (coverage in logs without it, the note when no rank fell back)
    kept = [k for k, header in enumerate(RANK_HEADERS)
            if header not in OPTIONAL_COLUMNS or any(row[k] not in ("", "-") for row in rows)]
    note_column = RANK_HEADERS.index("note")
    lines += table([RANK_HEADERS[k] for k in kept], [[row[k] for k in kept] for row in rows], indent="    ",
                   left=(kept.index(note_column),) if note_column in kept else ()) + note
    legend = ("saving: 1 - deployed / baseline-probe energy per iteration; 95% CI: its interval; probes: "
              "baseline probes (default-clock iterations among the deployed ones); need: probes the interval "
              f"needs for ±{100 * TARGET_HALF_WIDTH:g} points (-: it has them)")
    if "coverage" in (RANK_HEADERS[k] for k in kept):
        legend += "; coverage: share of the planned compute time that ran at its planned clock"
    if "swing W" in (RANK_HEADERS[k] for k in kept):
        legend += "; swing W: the GPU's measured peak-to-trough power over its deployed iterations"
    lines += textwrap.wrap(legend, WIDTH, initial_indent="    ", subsequent_indent="    ")
    return lines


def measured_rows(measured: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The saving and time change against the baseline probes, with their intervals, whether
    the evidence is thin, and what the probes cost."""
    overall = measured["all"]
    comparison = Comparison(**overall)
    time_ci = ("" if overall["time_change_low"] is None or comparison.probes < MIN_TRUSTED_PROBES else
               f" [{100 * overall['time_change_low']:+.1f}, {100 * overall['time_change_high']:+.1f}]")
    rows = [("energy/iteration", f"{overall['default_energy_j']:.1f} J at default clocks (baseline probes) -> "
                                 f"{overall['deployed_energy_j']:.1f} J with the plans"),
            ("saving", comparison.describe() if comparison.probes >= MIN_TRUSTED_PROBES else
             f"{100 * comparison.saving:.1f}% ({comparison.probes} probe{'s' * (comparison.probes != 1)}; "
             "no interval: from so few probes its width would be a guess)"),
            ("time/iteration", f"{overall['default_time_s']:.4f} s -> {overall['deployed_time_s']:.4f} s "
                               f"({100 * overall['time_change']:+.1f}%{time_ci})")]
    evidence = comparison.evidence()
    if evidence is not None:
        rows.append(("evidence", f"thin: {evidence}; the interval narrows as probes accumulate"))
    cost = measured["probe_cost"]
    rows.append(("baseline probes", f"{cost['probes']} iteration{'s' * (cost['probes'] != 1)} "
                                    f"({100 * cost['share_of_deployed']:.1f}% of the "
                                    f"deployed ones), their own cost {cost['energy_j']:.1f} J "
                                    f"({100 * (cost['share_of_energy'] or 0.0):.2f}% of the energy)"))
    return rows


def gpus_summed(ranks: int) -> str:
    """Whose power a job's swing is: the sum of its GPUs (one GPU per rank)."""
    return f"the {ranks} GPUs summed" if ranks > 1 else "the job's one GPU"


def swing_row(swing: Mapping[str, Any] | None, whose: str) -> tuple[str, str] | None:
    """The measured power swing as one labelled row (None where it was not measured: a real
    GPU's default power reading cannot show it, docs/monitoring.md)."""
    if not swing or not swing.get("measured"):
        return None
    first, last = swing["iterations"]
    return ("power swing", f"{whose}: {swing['peak_to_trough_w']:,.0f} W peak to trough "
                           f"({100 * swing['peak_to_trough_fraction']:.1f}% of the mean {swing['mean_w']:,.0f} W), "
                           f"max ramp {swing['max_ramp_w_per_s']:,.0f} W/s (50 ms average), "
                           f"{100 * swing['band_energy_fraction']:.0f}% of the variance at 0.1-20 Hz; deployed "
                           f"iterations {first}-{last}, {1000 * swing['sample_period_s']:g} ms samples "
                           "(simulated device; docs/power.md)")


def summary_line(summary: Mapping[str, Any]) -> str:
    """One rank's result: what really ran, the measured saving with its interval (and whether
    the evidence is thin), the model's figure labelled as such, and what the probes and the
    lifecycle cost. Labelled rows, so that it reads at 100 columns."""
    head = (f"perseus-ext: rank {summary['rank']} summary (stage {summary['stage']}, pipeline "
            f"{summary['pipeline']}): {summary['iterations']} iterations")
    costs = summary["phase_costs"]
    if summary["fallback_reason"] is not None:
        return "\n".join(textwrap.wrap(
            f"{head}; fell back to default clocks at iteration {summary['fell_back_at_iteration']} "
            f"({summary['fallback_reason']}): no saving to report", WIDTH, subsequent_indent="  "))
    default = summary["default_per_iteration"]
    rows: list[tuple[str, str]] = []
    if costs:
        rows.append(("iterations", ", ".join(f"{label} {group['iterations']}" for label, group in costs.items())))
    if summary["mode"] == "observe":
        rows.append(("result", "observe mode: no energy readings" if default["energy_j"] is None else
                     f"observe mode at default clocks: energy/iteration {default['energy_j']:.1f} J, "
                     f"time/iteration {default['time_s']:.4f} s"))
    elif summary["measured"]["all"] is not None:
        rows.append(("figures", "measured vs baseline probes, for this stage only"))
        rows += measured_rows(summary["measured"])
    elif summary.get("energy_saving_vs_default") is not None:
        rows.append(("energy saving", f"{100 * summary['energy_saving_vs_default']:.1f}% vs "
                                      f"{summary['saving_source']}"))
    elif summary["final_phase"] == "deployed":
        rows.append(("no saving", no_saving_reason(summary["phase_costs"], summary["baseline_fraction"])))
    else:
        rows.append(("no saving", f"final phase {summary['final_phase']}: no plan ran"))
    if "model" in summary:
        rows.append(("model", f"{100 * summary['model']['intrinsic_saving']:.1f}% intrinsic (from the profile)"))
    coverage = summary["clock_coverage"]["exact"] or summary["clock_coverage"]["estimated"]
    if coverage is not None:
        rows.append(("clock coverage", f"{100 * coverage:.1f}%"))
    if (swing := swing_row(summary.get("power_swing"), "this GPU")) is not None:
        rows.append(swing)
    return "\n".join(textwrap.wrap(head, WIDTH, subsequent_indent="  ") + labelled_rows(rows))


def job_line(job: Mapping[str, Any]) -> str:
    """The job's result (rank 0 logs it at close): energy per iteration summed over every GPU,
    time of the slowest rank, the saving against the baseline probes with its interval and the
    time it cost; the model's figure labelled as such; then every rank's own figures."""
    costs = job["phase_costs"]
    # a short first line: a log prefix (time, level, logger) goes in front of it
    lines = [f"perseus-ext: job summary, {job['ranks']} rank{'s' * (job['ranks'] != 1)}, "
             f"{job['iterations']} iterations"]
    if costs:
        lines += labelled_rows([("iterations", ", ".join(f"{label} {group['iterations']}"
                                                         for label, group in costs.items()))])
    fallback = (f"the first at iteration {job['first_fallback_iteration']}; their errors say why"
                if job["fell_back_ranks"] else None)
    if job["fell_back_ranks"] == job["ranks"]:
        lines += labelled_rows([("result", f"every rank fell back to default clocks ({fallback}): no saving to "
                                           "report")])
        return "\n".join(lines)
    default = job["default_per_iteration"]
    rows: list[tuple[str, str]] = []
    if job["mode"] == "observe":
        rows.append(("result", "observe mode: no energy readings" if default["energy_j"] is None else
                     f"observe mode at default clocks: energy/iteration {default['energy_j']:.1f} J, "
                     f"time/iteration {default['time_s']:.4f} s"))
    elif job["measured"]["all"] is not None:
        rows.append(("figures", "measured vs baseline probes, for the whole job (energy summed over the GPUs, "
                                "time of the slowest)"))
        rows += measured_rows(job["measured"])
    elif job["power_limit_mode"] and "power_limit" in costs and costs["power_limit"]["energy_per_iteration_j"]:
        warmup = costs.get("warmup", {}).get("energy_per_iteration_j")
        rows.append(("power-limit mode", f"no baseline probes: energy/iteration "
                                         f"{costs['power_limit']['energy_per_iteration_j']:.1f} J under the limits"
                     + (f", {warmup:.1f} J in warm-up at default clocks (unpaired)" if warmup else "")))
    elif job["final_phase"] == "deployed":
        rows.append(("no saving", no_saving_reason(job["phase_costs"], job["baseline_fraction"])))
    else:
        rows.append(("no saving", f"final phase {job['final_phase']}: no plan ran"))
    if job["fell_back_ranks"]:
        rows.append(("fallback", f"{job['fell_back_ranks']} of {job['ranks']} ranks fell back to default clocks "
                                 f"({fallback})"))
    if job.get("silenced_ranks"):
        rows.append(("silent hooks", f"on {job['silenced_ranks']} of {job['ranks']} ranks the hooks fell silent "
                                     "while a clock was held and default clocks were restored (silent_hooks in "
                                     "their summaries says why)"))
    if job["model_intrinsic_saving"] is not None:
        rows.append(("model", f"{100 * job['model_intrinsic_saving']:.1f}% intrinsic (pipeline 0's fastest plan, "
                              "from the profile)"))
    if job["clock_coverage"] is not None:
        rows.append(("clock coverage", f"{100 * job['clock_coverage']:.1f}% (mean over the ranks)"))
    if (swing := swing_row(job.get("power_swing"), gpus_summed(job["ranks"]))) is not None:
        rows.append(swing)
    lines += labelled_rows(rows)
    if len(job.get("per_rank") or ()) > 1:  # one rank's figures are the job's, printed above
        lines += rank_table(job["per_rank"], "every rank's figures are in its summary (perseus.summary_path) "
                                             "and in `perseus-ext report` on the logs")
    return "\n".join(lines)


def zeusd_line(summary: Mapping[str, Any]) -> str | None:
    """A warning line when zeusd could not be used or clock changes through it failed on this
    rank, None otherwise."""
    zeusd = summary.get("zeusd")
    if not zeusd or not (zeusd["failures"] or zeusd["control_fault"]):
        return None
    if zeusd["control_fault"]:
        return (f"perseus-ext: rank {summary['rank']}: zeusd could not be used, clocks stayed at default: "
                f"{zeusd['control_fault']}")
    return (f"perseus-ext: rank {summary['rank']}: {zeusd['failures']} clock change(s) through {zeusd['endpoint']} "
            f"failed ({zeusd['writes']} succeeded); after the first failure perseus-ext stopped changing this GPU's "
            f"clocks and restored its defaults (or, if that failed too, handed the restore to its watchdog). "
            f"Last error: {zeusd['last_error']}")
