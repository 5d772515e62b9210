"""One rank's end-of-run summary, built from its device records.

Figures say what really happened: iterations after a fallback count as default-clock iterations
of a fallen-back rank, not as deployed ones (`final_phase` is then "fallback"), and coverage is
reported only for iterations that ran a plan. The saving is measured against the baseline probes
(`perseus_ext.runtime.baseline`), with its confidence interval; the frontier's figure stays
beside it, labelled as a model; warm-up, profiling and solving are their own cost (`phase_costs`),
never mixed into the saving. A job-level figure needs every rank's records: `perseus-ext report`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from perseus_ext.runtime.baseline import Comparison, Sample, default_figures, measured_counterfactual, phase_costs
from perseus_ext.runtime.phase import Phase
from perseus_ext.runtime.records import IterationRecord

if TYPE_CHECKING:
    from perseus_ext.runtime.runtime import PerseusRuntime

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


def _coverage(runtime: "PerseusRuntime", deployed: list[IterationRecord]) -> dict[str, Any]:
    estimated = [r.coverage for r in deployed if r.coverage is not None]
    exact = runtime.timeline.exact_coverage()
    return {
        "estimated": statistics.fmean(estimated) if estimated else None,
        "exact": exact.coverage if exact is not None else None,
        "switch_latency_s": runtime.setup.latency.effective_s,
    }


def build_summary(runtime: "PerseusRuntime") -> dict[str, Any]:
    history = runtime.recorder.history
    # The first iteration carries one-off costs (buffer allocation): it describes no clock setting.
    default = [r for r in history[1:] if r.phase.at_default_clocks and not r.setting.fell_back]
    deployed = [r for r in history if r.setting.plan is not None]
    power_limit = runtime.power_limit
    if power_limit is not None and power_limit.chosen_at is not None:  # the iterations at the chosen limit
        deployed = [r for r in history if r.phase is Phase.POWER_LIMIT and r.iteration > power_limit.chosen_at]
    deployment = runtime.deployment
    profiling = runtime.profiling
    samples = [Sample.of_record(r) for r in history]
    measured = measured_counterfactual(samples)
    default_energy_j, default_time_s = default_figures(samples, measured)
    fell_back_at = next((r.iteration for r in history if r.setting.fell_back), None)
    result: dict[str, Any] = {
        "rank": runtime.comm.rank, "pipeline": runtime.comm.pipeline, "stage": runtime.stage,
        "gpu": runtime.gpu.name if runtime.gpu is not None else None,
        "mode": str(runtime.config.mode), "dry_run": runtime.controller.dry_run,
        "fallback_reason": runtime.fallback_reason, "fell_back_at_iteration": fell_back_at,
        "final_phase": "fallback" if runtime.fallback_reason is not None else runtime.phase.value,
        "iterations": len(history),
        "profiling_iterations": profiling.iterations if profiling else 0,
        "profiled_clocks": profiling.profiler.profiled_clocks if profiling else [],
        "profile_overhead_s": profiling.overhead_s if profiling else 0.0,
        "default_clocks": _stats(default),
        "deployed": _stats(deployed),
        "deployed_intrinsic": _stats([r for r in deployed if r.setting.factor == 1.0]),
        "deployed_extrinsic": _stats([r for r in deployed if r.setting.factor and r.setting.factor > 1.0]),
        "baseline_fraction": runtime.config.baseline_fraction,
        "measured": measured,
        "default_per_iteration": {"energy_j": default_energy_j, "time_s": default_time_s},
        "phase_costs": phase_costs(samples, default_energy_j, default_time_s),
        "clock_coverage": _coverage(runtime, deployed),
        "plan_switches": [dataclasses.asdict(s) for s in deployment.switches] if deployment else [],
        "controller_errors": runtime.controller.error_count,
        "policy": _policy_summary(runtime),
    }
    if deployment is not None:
        frontier = deployment.frontier
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


def _policy_summary(runtime: "PerseusRuntime") -> dict[str, Any]:
    """Which policy ran; in power-limit mode the limits measured and the one chosen; with Chase
    this GPU's emissions (kgCO2 emitted, and saved against its default-clock energy)."""
    config = runtime.setup.policy_config
    policy = runtime.policy
    result: dict[str, Any] = {
        "mode": str(config.mode) if config else "frontier",
        "type": str(config.type) if config else (policy.name if policy else None),
    }
    if config is not None and config.type != "perseus":
        result["eta"] = config.eta
    mode = runtime.power_limit
    if mode is not None:
        optimizer = mode.optimizer
        result.update(
            limit_w=None if optimizer.profiling else optimizer.limit_w, profiling=optimizer.profiling,
            measurements=[dataclasses.asdict(m) for m in optimizer.measurements], switches=list(mode.switches),
        )
    elif runtime.setup.power_limit_mode:
        result.update(limit_w=None, profiling=False, measurements=[], switches=[])
    ledger = runtime.emissions.ledger
    report = getattr(ledger, "report", None)
    if report is not None:
        result["carbon"] = {**dataclasses.asdict(report), "summary": report.summary()}
    return result


def log_summary(summary: dict[str, Any], summary_path: str | None) -> None:
    """Write the JSON file (a failure is logged: close() never raises) and one log line."""
    if summary_path:
        path = Path(summary_path.format(rank=summary["rank"]))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(summary, indent=2))
        except OSError as err:
            logger.error("perseus-ext: cannot write the summary to %s: %s", path, err)
    logger.info("%s", summary_line(summary))


def summary_line(summary: dict[str, Any]) -> str:
    """One rank's result in one line: what really ran, the measured saving with its interval,
    the model's figure labelled as such, and what the probes and the lifecycle cost."""
    head = f"perseus-ext: rank {summary['rank']} summary: {summary['iterations']} iterations"
    costs = summary["phase_costs"]
    if costs:
        head += " (" + ", ".join(f"{label} {group['iterations']}" for label, group in costs.items()) + ")"
    if summary["fallback_reason"] is not None:
        return (f"{head}; fell back to default clocks at iteration {summary['fell_back_at_iteration']} "
                f"({summary['fallback_reason']}): no saving to report")
    default = summary["default_per_iteration"]
    if summary["mode"] == "observe":
        if default["energy_j"] is None:
            return f"{head}; observe mode: no energy readings"
        return (f"{head}; observe mode at default clocks: energy/iteration {default['energy_j']:.1f} J, "
                f"time/iteration {default['time_s']:.4f} s")
    parts = [head]
    overall = summary["measured"]["all"]
    if overall is not None:
        parts.append(f"measured vs baseline probes: energy/iteration {overall['default_energy_j']:.1f} J -> "
                     f"{overall['deployed_energy_j']:.1f} J, saving {Comparison(**overall).describe()}, "
                     f"time/iteration {overall['default_time_s']:.4f} s -> {overall['deployed_time_s']:.4f} s "
                     f"({100 * overall['time_change']:+.1f}%)")
        cost = summary["measured"]["probe_cost"]
        if cost["share_of_energy"] is not None:
            parts.append(f"probes cost {100 * cost['share_of_energy']:.2f}% of the energy")
    elif summary.get("energy_saving_vs_default") is not None:
        parts.append(f"energy saving {100 * summary['energy_saving_vs_default']:.1f}% vs "
                     f"{summary['saving_source']}")
    elif summary["final_phase"] == "deployed":
        parts.append(f"no baseline probe recorded (baseline_fraction {summary['baseline_fraction']:g}): "
                     "no measured saving")
    else:
        parts.append(f"final phase {summary['final_phase']}: no plan ran, so no saving")
    if "model" in summary:
        parts.append(f"model: {100 * summary['model']['intrinsic_saving']:.1f}% intrinsic")
    coverage = summary["clock_coverage"]["exact"] or summary["clock_coverage"]["estimated"]
    if coverage is not None:
        parts.append(f"clock coverage {100 * coverage:.1f}%")
    return "; ".join(parts)
