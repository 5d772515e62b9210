"""One rank's end-of-run summary, built from its device records.

Figures say what really happened: iterations after a fallback count as default-clock iterations
of a fallen-back rank, not as deployed ones (`final_phase` is then "fallback"), and coverage is
reported only for iterations that ran a plan. The saving is measured against the baseline probes
(`perseus_ext.observability.run_figures`), with its confidence interval; the frontier's figure stays
beside it, labelled as a model; warm-up, profiling and solving are their own cost (`phase_costs`),
never mixed into the saving.

A rank's figures are not the job's: a stage with slack saves more than the busiest one, so
per-rank savings of -2 % to +16 % sat beside a job saving of 0 to 4 %. At close every rank
therefore reduces its iterations into the job's (`gather_job_summary`: energy summed over the
GPUs, time of the slowest, the same `job_figures` that `perseus-ext report` computes from the
logs), rank 0 logs that one line and per-rank lines go to DEBUG.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import time
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from perseus_ext.actuation.silence import SilentEpisode
from perseus_ext.observability.iteration import IterationRecord
from perseus_ext.observability.phase import Phase
from perseus_ext.observability.run_figures import FALLBACK, MIXED, PROBE, RunFigures, Sample
from perseus_ext.observability.summary_text import job_line, summary_line, zeusd_line
from perseus_ext.runtime.measured_swing import gather_job_swing, rank_power_swing
from perseus_ext.runtime.records import PlanSwitch

__all__ = ["RunSnapshot", "build_summary", "close_summary"]

if TYPE_CHECKING:
    from perseus_ext.measurement.gpu.timeline import CoverageTally
    from perseus_ext.measurement.gpu.zeusd import ZeusdReport
    from perseus_ext.planning.frontier import Frontier
    from perseus_ext.policies.chase import CarbonReport
    from perseus_ext.runtime.comm import ControlPlane
    from perseus_ext.runtime.power_limit_mode import PowerLimitSnapshot
    from perseus_ext.runtime.rank_setup import RankSetup

logger = logging.getLogger(__name__)


def _stats(records: list[IterationRecord]) -> dict[str, Any] | None:
    if not records:
        return None
    energies = [r.energy_j for r in records if r.energy_j is not None]
    return {
        "iterations": len(records),
        "time_s": statistics.fmean(r.time_s for r in records),
        "energy_j": statistics.fmean(energies) if energies else None,
    }


@dataclass(frozen=True)
class PolicySnapshot:
    """Which policy ran: mode and type (from `policy` config, else the frontier policy's name),
    eta for cost policies, power-limit mode's state, and Chase's emissions report."""

    mode: str
    type: str | None
    eta: float | None = None
    power_limit_mode: bool = False  # configured, even where the mode never started
    power_limit: PowerLimitSnapshot | None = None
    carbon: CarbonReport | None = None


@dataclass(frozen=True)
class SilenceReport:
    """The silence guard's state: its bound, the episodes it restored default clocks in, and how
    many hooks ran during a CUDA graph capture."""

    bound_s: float
    expected_iteration_s: float | None
    episodes: tuple[SilentEpisode, ...]
    hooks_during_capture: int


@dataclass(frozen=True)
class RunSnapshot:
    """Everything one rank's summary is built from, taken by the runtime (`PerseusRuntime.snapshot`):
    the summary reads these typed fields, never the runtime itself."""

    rank: int
    pipeline: int
    stage: int
    gpu_name: str | None
    mode: str
    dry_run: bool
    fallback_reason: str | None
    phase: Phase
    history: tuple[IterationRecord, ...]
    baseline_fraction: float
    profiling_iterations: int
    profiled_clocks: tuple[int, ...]
    profile_overhead_s: float
    exact_coverage: CoverageTally | None  # simulated devices only
    switch_latency_s: float
    plan_switches: tuple[PlanSwitch, ...]
    controller_errors: int
    silent_hooks: SilenceReport
    frontier: Frontier | None  # the deployed one (the leader's whole frontier, a rank's own share)
    policy: PolicySnapshot
    zeusd: ZeusdReport | None = None  # clock changes went through zeusd (measurement/gpu/zeusd.py)
    set_call_s: tuple[float, ...] = ()  # durations of the live clock set calls (the latest 1000)
    assumed_call_s: float = 0.0  # the set call's duration a dry-run assumes (the GPU's preset)


def _silence_summary(report: SilenceReport) -> dict[str, Any]:
    """When the hooks fell silent with a clock held and the guard restored default clocks
    (`actuation/silence.py`), and hooks that ran during a CUDA graph capture."""
    return {
        "bound_s": report.bound_s,
        "expected_iteration_s": report.expected_iteration_s,
        "episodes": [dict(dataclasses.asdict(e), why=e.describe()) for e in report.episodes],
        "hooks_during_cuda_graph_capture": report.hooks_during_capture,
    }


def policy_snapshot(setup: RankSetup, power_limit: PowerLimitSnapshot | None, carbon: CarbonReport | None) -> PolicySnapshot:
    """Which policy this rank set up, with power-limit mode's state and Chase's report."""
    config, policy = setup.policy_config, setup.policy
    return PolicySnapshot(
        mode=str(config.mode) if config else "frontier",
        type=str(config.type) if config else (policy.name if policy else None),
        eta=config.eta if config is not None and config.type != "perseus" else None,
        power_limit_mode=setup.power_limit_mode, power_limit=power_limit, carbon=carbon)


def close_summary(comm: ControlPlane, run: RunSnapshot, *, summary_path: str | None, job_id: str,
                  control_timeout_s: float, control_plane_failed: bool,
                  interrupted: dict[str, Any] | None = None) -> dict[str, Any]:
    """The rank's summary at close with the job's figures (every rank: a bounded wait for the
    others, logged by rank 0); a rank whose control plane failed earlier skips the reductions.
    `interrupted`: the signal that interrupted the run before the application closed it."""
    summary = build_summary(run)
    if interrupted is not None:
        summary["interrupted"] = interrupted
    if control_plane_failed:
        summary["job"], job_error = None, "this rank's control plane failed earlier (its error says why)"
    else:
        summary["job"], job_error = gather_job_summary(comm, run, summary, job_id=job_id,
                                                       control_timeout_s=control_timeout_s)
    log_summary(summary, summary_path, job_error)
    return summary


def _coverage(run: RunSnapshot, deployed: list[IterationRecord]) -> dict[str, Any]:
    estimated = [r.coverage for r in deployed if r.coverage is not None]
    exact = run.exact_coverage
    return {
        "estimated": statistics.fmean(estimated) if estimated else None,
        "exact": exact.coverage if exact is not None else None,
        "switch_latency_s": run.switch_latency_s,
        # how long a clock set call blocks: measured in live runs (the figure that should replace
        # the preset a dry-run assumes), assumed in dry-runs
        "set_call_ms": {
            "assumed": 1000.0 * run.assumed_call_s,
            "measured_median": 1000.0 * statistics.median(run.set_call_s) if run.set_call_s else None,
            "measured_max": 1000.0 * max(run.set_call_s) if run.set_call_s else None,
            "measured_calls": len(run.set_call_s),
        },
    }


def build_summary(run: RunSnapshot) -> dict[str, Any]:
    history = list(run.history)
    # The first iteration carries one-off costs (buffer allocation): it describes no clock setting.
    default = [r for r in history[1:] if r.phase.at_default_clocks and not r.setting.fell_back]
    deployed = [r for r in history if r.setting.plan is not None]
    power_limit = run.policy.power_limit
    if power_limit is not None and power_limit.chosen_at is not None:  # the iterations at the chosen limit
        deployed = [r for r in history if r.phase is Phase.POWER_LIMIT and r.iteration > power_limit.chosen_at]
    samples = [Sample.of_record(r) for r in history]
    figures = job_figures(samples)
    measured = figures["measured"]
    fell_back_at = next((r.iteration for r in history if r.setting.fell_back), None)
    result: dict[str, Any] = {
        "rank": run.rank, "pipeline": run.pipeline, "stage": run.stage,
        "gpu": run.gpu_name,
        "mode": run.mode, "dry_run": run.dry_run,
        "fallback_reason": run.fallback_reason, "fell_back_at_iteration": fell_back_at,
        "final_phase": "fallback" if run.fallback_reason is not None else run.phase.value,
        "iterations": len(history),
        "profiling_iterations": run.profiling_iterations,
        "profiled_clocks": list(run.profiled_clocks),
        "profile_overhead_s": run.profile_overhead_s,
        "default_clocks": _stats(default),
        "deployed": _stats(deployed),
        "deployed_intrinsic": _stats([r for r in deployed if r.setting.factor == 1.0]),
        "deployed_extrinsic": _stats([r for r in deployed if r.setting.factor and r.setting.factor > 1.0]),
        "baseline_fraction": run.baseline_fraction,
        "measured": measured,
        "default_per_iteration": figures["default_per_iteration"],
        "phase_costs": figures["phase_costs"],
        "clock_coverage": _coverage(run, deployed),
        "power_swing": rank_power_swing(history),  # measured from fine power samples (simulated devices)
        "plan_switches": [dataclasses.asdict(s) for s in run.plan_switches],
        "controller_errors": run.controller_errors,
        "zeusd": dataclasses.asdict(run.zeusd) if run.zeusd is not None else None,
        "silent_hooks": _silence_summary(run.silent_hooks),
        "policy": _policy_summary(run.policy),
    }
    if run.frontier is not None:
        frontier = run.frontier
        result["frontier"] = {
            "plans": len(frontier.plans),
            "all_max_clock": {"time_s": frontier.baseline.time, "energy_j": frontier.baseline.energy},
            "fastest": {"time_s": frontier.fastest.time, "energy_j": frontier.fastest.energy},
            "min_energy": {"time_s": frontier.min_energy.time, "energy_j": frontier.min_energy.energy},
            "intrinsic_saving": frontier.intrinsic_saving(),
            "blocking_power_w": frontier.blocking_power,
        }
        result["model"] = {"intrinsic_saving": frontier.intrinsic_saving(),
                           "what": "model: the pipeline's fastest plan vs all max clock, from the profile"}
    if measured["all"] is not None:
        overall = measured["all"]
        result.update(energy_saving_vs_default=overall["saving"], throughput_change=-overall["time_change"],
                      saving_source="baseline probes")
    elif power_limit is not None:  # power-limit mode runs no probes: warm-up is the only default-clock figure
        base, dep = result["default_clocks"], result["deployed"]
        if base and dep and base["energy_j"] and dep["energy_j"]:
            result.update(energy_saving_vs_default=1.0 - dep["energy_j"] / base["energy_j"],
                          throughput_change=base["time_s"] / dep["time_s"] - 1.0,
                          saving_source="warm-up iterations (unpaired)")
    return result


def _policy_summary(policy: PolicySnapshot) -> dict[str, Any]:
    """Which policy ran; in power-limit mode the limits measured and the one chosen; with Chase
    this GPU's emissions (kgCO2 emitted, and saved against its default-clock energy)."""
    result: dict[str, Any] = {"mode": policy.mode, "type": policy.type}
    if policy.eta is not None:
        result["eta"] = policy.eta
    mode = policy.power_limit
    if mode is not None:
        result.update(limit_w=mode.limit_w, profiling=mode.profiling,
                      measurements=list(mode.measurements), switches=list(mode.switches))
    elif policy.power_limit_mode:
        result.update(limit_w=None, profiling=False, measurements=[], switches=[])
    if policy.carbon is not None:
        result["carbon"] = {**dataclasses.asdict(policy.carbon), "summary": policy.carbon.summary()}
    return result


def job_figures(samples: list[Sample]) -> dict[str, Any]:
    """Measured saving (against the probes), default-clock figures and phase costs of a run's
    samples: one rank's, or the job's (`job_samples`); `perseus-ext report` and the runtime's
    close both use `RunFigures`, so they agree."""
    return RunFigures.of(samples).figures()


# ------------------------------------------------------------------------------ the job at close
JOB_SUMMARY_WAIT_S = 60.0  # longest wait for the other ranks at close (capped by control_timeout_s)
LABELS = tuple(phase.value for phase in Phase) + (PROBE, FALLBACK)  # a rank's iteration labels, coded


SUMMED_RANK_FIGURES = 4  # fell back, coverage, coverage known, hooks fell silent; then the maxed one


def _encode(samples: list[Sample], length: int, rank_figures: list[float]) -> tuple[list[float], list[float]]:
    """This rank's share of the job's per-iteration figures as two vectors, one summed and one
    maxed over the ranks: per iteration [present, energy, energy missing, fell back] and [time,
    factor, label code, -label code] (min = -max of the negation), then `rank_figures`."""
    sums, maxes = [0.0] * (4 * length), [0.0] * (4 * length)
    for sample in samples:
        k, code = sample.iteration, LABELS.index(sample.label)
        sums[k] = 1.0
        sums[length + k] = sample.energy_j or 0.0
        sums[2 * length + k] = float(sample.energy_j is None)
        sums[3 * length + k] = float(sample.label == FALLBACK)
        maxes[k], maxes[length + k] = sample.time_s, sample.factor or 0.0
        maxes[2 * length + k], maxes[3 * length + k] = code, -code
    return sums + rank_figures[:SUMMED_RANK_FIGURES], maxes + rank_figures[SUMMED_RANK_FIGURES:]


def _decode(sums: list[float], maxes: list[float], length: int, ranks: int) -> list[Sample]:
    """The job's samples (`run_figures.job_samples` over every rank): iterations every rank
    recorded, energy summed, time of the slowest, one label if all ranks ran it."""
    job = []
    for k in range(length):
        if round(sums[k]) < ranks:
            continue
        high, low = int(maxes[2 * length + k]), -int(maxes[3 * length + k])
        label = LABELS[high] if high == low else FALLBACK if sums[3 * length + k] > 0 else MIXED
        energy = None if sums[2 * length + k] > 0 else sums[length + k]
        job.append(Sample(k, label, maxes[length + k] or None, maxes[k], energy))
    return job


# Each rank's own figures, in its slot of one summed vector (the others add zeros; NaN: unknown).
RANK_FIELDS = ("pipeline", "stage", "iterations", "saving", "saving_low", "saving_high", "probes", "probes_needed",
               "fell_back_at_iteration", "clock_coverage", "power_swing_w")


def _own_row(summary: dict[str, Any]) -> list[float]:
    """This rank's row of the per-rank table (`RANK_FIELDS`), None as NaN."""
    overall = summary["measured"]["all"] or {}
    coverage = summary["clock_coverage"]["exact"] or summary["clock_coverage"]["estimated"]
    values = (summary["pipeline"], summary["stage"], summary["iterations"], overall.get("saving"),
              overall.get("saving_low"), overall.get("saving_high"), overall.get("probes"),
              overall.get("probes_needed"), summary["fell_back_at_iteration"], coverage,
              summary["power_swing"].get("peak_to_trough_w"))
    return [math.nan if value is None else float(value) for value in values]


def _rank_entries(summed: list[float], ranks: list[int]) -> list[dict[str, Any]]:
    """Every rank's row, decoded: what the job summary's per-rank table prints."""
    width = len(RANK_FIELDS)
    entries = []
    for slot, rank in enumerate(ranks):
        row = dict(zip(RANK_FIELDS, (None if math.isnan(v) else v for v in summed[slot * width:(slot + 1) * width])))
        whole = {key: None if row[key] is None else round(row[key])
                 for key in ("pipeline", "stage", "iterations", "probes", "probes_needed", "fell_back_at_iteration")}
        measured = None if row["saving"] is None else {
            "saving": row["saving"], "saving_low": row["saving_low"], "saving_high": row["saving_high"],
            "probes": whole["probes"], "probes_needed": whole["probes_needed"]}
        entries.append({"rank": rank, "pipeline": whole["pipeline"], "stage": whole["stage"],
                        "iterations": whole["iterations"], "measured": measured,
                        "fell_back_at_iteration": whole["fell_back_at_iteration"],
                        "clock_coverage": row["clock_coverage"], "power_swing_w": row["power_swing_w"]})
    return entries


def gather_job_summary(comm: "ControlPlane", run: RunSnapshot, summary: dict[str, Any], *, job_id: str,
                       control_timeout_s: float) -> tuple[dict[str, Any] | None, str | None]:
    """(the job's figures, None), identical on every rank, or (None, why not). Every rank whose
    control plane still works calls it at close: three reductions over the control plane, of
    eight numbers per iteration and eleven per rank (its own figures, for the per-rank table). Every rank gives up after a bounded wait (`JOB_SUMMARY_WAIT_S`,
    at most `control_timeout_s`); never raises."""
    samples = [Sample.of_record(r) for r in run.history]
    coverage = summary["clock_coverage"]["exact"] or summary["clock_coverage"]["estimated"]
    fell_back_at = summary["fell_back_at_iteration"]
    rank_figures = [float(fell_back_at is not None), coverage or 0.0, float(coverage is not None),
                    float(len(summary["silent_hooks"]["episodes"]) > 0),
                    -math.inf if fell_back_at is None else -float(fell_back_at)]
    ranks = len(comm.members)
    member_ranks = [member.rank for member in comm.members]
    own_slot = member_ranks.index(comm.rank) if comm.rank in member_ranks else 0
    own_rows = [0.0] * (ranks * len(RANK_FIELDS))
    own_rows[own_slot * len(RANK_FIELDS):(own_slot + 1) * len(RANK_FIELDS)] = _own_row(summary)

    # Bounded: a rank whose peers died or never close must still exit, and the groups themselves
    # time out only after control_timeout_s (by default half an hour). A shorter timeout is left
    # to the groups, so that no reduction stays pending when the process exits.
    timeout_s = control_timeout_s
    deadline_s = None if timeout_s <= JOB_SUMMARY_WAIT_S else time.monotonic() + JOB_SUMMARY_WAIT_S
    try:
        (length,) = comm.all_reduce_by([max((s.iteration for s in samples), default=-1) + 1], "max", deadline_s)
        sums, maxes = _encode(samples, int(length), rank_figures)
        sums, maxes = comm.all_reduce_by(sums + own_rows, "sum", deadline_s), comm.all_reduce_by(maxes, "max", deadline_s)
    except Exception as err:
        return None, f"gathering the ranks' figures failed: {err}"
    power_swing = gather_job_swing(comm, run.history, deadline_s)  # never raises
    try:
        comm.settle(f"job-summary/{job_id}", time.monotonic() + min(timeout_s, JOB_SUMMARY_WAIT_S))
    except Exception as err:  # the figures are complete; only the exit's ordering is at stake
        logger.debug("perseus-ext: settling the ranks after the job summary failed: %s", err)
    length = int(length)
    sums, rank_rows = sums[:len(sums) - len(own_rows)], sums[len(sums) - len(own_rows):]
    fell_back, coverage_sum, coverage_count, silenced = sums[-SUMMED_RANK_FIGURES:]
    first_fallback = maxes[-1]
    job = job_figures(_decode(sums[:-SUMMED_RANK_FIGURES], maxes[:-1], length, ranks))
    job.update(
        ranks=ranks, mode=summary["mode"], final_phase=summary["final_phase"],
        baseline_fraction=summary["baseline_fraction"],
        power_limit_mode=summary["policy"]["mode"] == "power_limit",
        fell_back_ranks=round(fell_back), silenced_ranks=round(silenced),
        first_fallback_iteration=None if first_fallback == -math.inf else round(-first_fallback),
        clock_coverage=coverage_sum / coverage_count if coverage_count else None,
        model_intrinsic_saving=summary["model"]["intrinsic_saving"] if "model" in summary else None,
        per_rank=_rank_entries(rank_rows, member_ranks), power_swing=power_swing,
    )
    return job, None


def write_interrupted_summary(snapshot: Callable[[], RunSnapshot], interrupted: dict[str, Any],
                              summary_path: str | None) -> dict[str, Any] | None:
    """After SIGINT/SIGTERM: this rank's summary with `interrupted` (signal, iteration, phase,
    whether the clocks were restored), written without any collective, and one warning line
    saying so. Never raises (the process is ending)."""
    summary, rank = None, "?"
    try:
        run = snapshot()
        rank = run.rank
        summary = build_summary(run)
        summary["interrupted"] = interrupted
        log_summary(summary, summary_path, f"interrupted by {interrupted['signal']}")
    except Exception:
        logger.exception("perseus-ext: writing the summary of the interrupted run failed")
    restored = ("GPU clocks restored to the default" if interrupted["clocks_restored"]
                else "restoring the GPU clocks FAILED (the watchdog retries; see the error above)")
    where = f"; summary in {summary_path.format(rank=rank)}" if summary_path and summary is not None else ""
    logger.warning("perseus-ext: rank %s interrupted by %s at iteration %d (%s); %s%s", rank, interrupted["signal"],
                   interrupted["at_iteration"], interrupted["phase"], restored, where)
    return summary


def log_summary(summary: dict[str, Any], summary_path: str | None, job_error: str | None = None) -> None:
    """Write the JSON file (a failure is logged: close() never raises) and the log lines: the
    job's line on rank 0 (its own line at DEBUG, every other rank's too); without a job figure
    rank 0's own line at INFO and why there is no job figure."""
    if summary_path:
        path = Path(summary_path.format(rank=summary["rank"]))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(summary, indent=2))
        except OSError as err:
            logger.error("perseus-ext: cannot write the summary to %s: %s", path, err)
    rank_zero = summary["rank"] == 0
    job = summary.get("job")
    logger.log(logging.INFO if rank_zero and job is None else logging.DEBUG, "%s", summary_line(summary))
    if (line := zeusd_line(summary)) is not None:  # every rank: whose GPU was affected matters
        logger.warning("%s", line)
    if not rank_zero:
        return
    if job is not None:
        logger.info("%s", job_line(job))
    elif job_error is not None:
        logger.warning("perseus-ext: no job summary (%s); per-rank figures are in the summaries, or "
                       "run perseus-ext report on every rank's log", job_error)
