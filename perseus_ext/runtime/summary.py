"""One rank's end-of-run summary, built from its device records.

Figures say what really happened: iterations after a fallback count as default-clock iterations
of a fallen-back rank, not as deployed ones, and coverage is reported only for iterations that
ran a plan.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    # The first iteration carries one-off costs (buffer allocation), so it is no baseline.
    default = [r for r in history[1:] if r.phase.at_default_clocks and not r.setting.fell_back]
    deployed = [r for r in history if r.setting.plan is not None]
    power_limit = runtime.power_limit
    if power_limit is not None and power_limit.chosen_at is not None:  # the iterations at the chosen limit
        deployed = [r for r in history if r.phase is Phase.POWER_LIMIT and r.iteration > power_limit.chosen_at]
    deployment = runtime.deployment
    profiling = runtime.profiling
    result: dict[str, Any] = {
        "rank": runtime.comm.rank, "pipeline": runtime.comm.pipeline, "stage": runtime.stage,
        "gpu": runtime.gpu.name if runtime.gpu is not None else None,
        "mode": str(runtime.config.mode), "dry_run": runtime.controller.dry_run,
        "fallback_reason": runtime.fallback_reason, "final_phase": runtime.phase.value,
        "iterations": len(history),
        "profiling_iterations": profiling.iterations if profiling else 0,
        "profiled_clocks": profiling.profiler.profiled_clocks if profiling else [],
        "profile_overhead_s": profiling.overhead_s if profiling else 0.0,
        "default_clocks": _stats(default),
        "deployed": _stats(deployed),
        "deployed_intrinsic": _stats([r for r in deployed if r.setting.factor == 1.0]),
        "deployed_extrinsic": _stats([r for r in deployed if r.setting.factor and r.setting.factor > 1.0]),
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
        }
    base, dep = result["default_clocks"], result["deployed"]
    if base and dep and base["energy_j"] and dep["energy_j"]:
        result["energy_saving_vs_default"] = 1.0 - dep["energy_j"] / base["energy_j"]
        result["throughput_change"] = base["time_s"] / dep["time_s"] - 1.0
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
    coverage = summary["clock_coverage"]["exact"] or summary["clock_coverage"]["estimated"]
    coverage_text = f", clock coverage {100 * coverage:.1f}%" if coverage is not None else ""
    if summary.get("energy_saving_vs_default") is not None:
        logger.info("perseus-ext: rank %d summary: %d iterations, profiling %d; energy/iteration %.1f J -> "
                    "%.1f J (%.1f%% saved), time/iteration %.4f s -> %.4f s%s", summary["rank"],
                    summary["iterations"], summary["profiling_iterations"], summary["default_clocks"]["energy_j"],
                    summary["deployed"]["energy_j"], 100 * summary["energy_saving_vs_default"],
                    summary["default_clocks"]["time_s"], summary["deployed"]["time_s"], coverage_text)
    else:
        logger.info("perseus-ext: rank %d summary: %d iterations, final phase %s%s%s", summary["rank"],
                    summary["iterations"], summary["final_phase"],
                    " (fell back to default clocks)" if summary["fallback_reason"] else "", coverage_text)
