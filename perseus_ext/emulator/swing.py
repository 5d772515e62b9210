"""The power swing of a whole emulated job over one periodic iteration, gradient sync included.

Why the whole job: a site sees the sum of every GPU, and what it sees repeats once per
iteration: each data-parallel pipeline runs its plan (fill, steady state, drain), pipelines
that finish early block at the gradient sync until the slowest arrives, and then every GPU
takes part in the gradient all-reduce and the optimizer step before the next iteration starts.
No clock choice changes that last gap, but it is where the job's power falls furthest, so the
job's figures include it while the pipeline swing a plan is capped by does not (docs/power.md).

The model, stated (the planner's, `planning.power_swing`, plus the gap):

* a computation draws its energy / its time (profiled, scaled as the emulator scales it); a
  GPU that waits inside its pipeline draws the blocking power;
* all pipelines start together (lockstep); a pipeline that ends its plan before the job's
  iteration time waits at the blocking power, the straggler too for its external slowdown;
* the gradient sync and optimizer step (`SyncGap`) then take `seconds` on every GPU at
  `power_w` per GPU: by default 5 % of the all-max-clock iteration time at the blocking power
  (the GPUs wait on the network), both options of `perseus-ext emulate`;
* the iteration repeats back to back, so the trace is one period.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from perseus_ext.emulator.core import MAX_CLOCK, PERSEUS, Deployment, Emulation, Emulator
from perseus_ext.errors import ConfigError
from perseus_ext.planning.frontier import Plan
from perseus_ext.planning.power_swing import PowerTrace, SwingFigures, plan_power_traces

DEFAULT_GAP_SHARE = 0.05  # of the all-max-clock iteration time, when no gap length is given
SWING_STRATEGIES = (MAX_CLOCK, PERSEUS)
SWING_LABELS = {MAX_CLOCK: "all max clock", PERSEUS: "perseus-ext"}  # short: the table fits 100 columns


@dataclass(frozen=True)
class SyncGap:
    """The gradient sync and optimizer step after every iteration: how long, and what each GPU
    draws meanwhile."""

    seconds: float
    power_w: float  # per GPU

    def __post_init__(self) -> None:
        if not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise ConfigError(f"sync gap: seconds must be >= 0, got {self.seconds!r}")
        if not (math.isfinite(self.power_w) and self.power_w >= 0):
            raise ConfigError(f"sync gap: power_w must be >= 0 watts per GPU, got {self.power_w!r}")

    @classmethod
    def default_for(cls, emulator: Emulator, seconds: float | None = None, power_w: float | None = None) -> SyncGap:
        """The stated default where an option is not given (module doc)."""
        return cls(DEFAULT_GAP_SHARE * emulator.max_clock_plan.time if seconds is None else seconds,
                   emulator.blocking_power if power_w is None else power_w)


@dataclass(frozen=True)
class JobSwing:
    """One strategy's whole-job trace figures."""

    strategy: str
    period_s: float
    energy_j: float
    figures: SwingFigures


def hold(trace: PowerTrace, until_s: float, power_w: float) -> PowerTrace:
    """`trace`, then `power_w` from its end to `until_s` (nothing added when it already ends
    there)."""
    if until_s <= trace.period_s:
        return trace
    return PowerTrace(np.append(trace.breakpoints_s, until_s), np.append(trace.power_w, power_w))


def summed(traces: list[tuple[float, PowerTrace]]) -> PowerTrace:
    """Σ weight × trace over traces of one period (every one ends at the same time)."""
    period = traces[0][1].period_s
    if any(not math.isclose(t.period_s, period, rel_tol=1e-12, abs_tol=1e-12) for _, t in traces):
        raise ValueError("summed traces must share one period")
    edges = np.unique(np.concatenate([t.breakpoints_s[:-1] for _, t in traces]))
    edges = edges[edges < period]
    level = np.zeros(edges.size)
    for weight, trace in traces:
        segment = np.searchsorted(trace.breakpoints_s, edges, side="right") - 1
        level += weight * trace.power_w[np.clip(segment, 0, trace.power_w.size - 1)]
    return PowerTrace(np.append(edges, period), level)


def job_power_trace(emulator: Emulator, deployment: Deployment, gap: SyncGap) -> PowerTrace:
    """The whole job's power over one iteration of `deployment` (module doc), W."""
    layout = emulator.layout
    dp = layout.data_parallel
    gpus_per_pipeline = layout.gpus_per_pipeline
    idle_pipeline_w = emulator.stage_blocking_power * emulator.model.num_stage_gpus
    straggler_time = emulator.straggler_time(deployment.factor)

    def pipeline(plan: Plan) -> PowerTrace:
        return plan_power_traces(emulator.model, emulator.model.choice_of(plan))[0]

    if straggler_time is None:
        parts = [(float(dp), pipeline(deployment.others))]
    else:
        straggler = pipeline(deployment.straggler)
        # the straggler's own iteration ends at T' at the earliest: its extra time is blocking
        straggler = hold(straggler, max(straggler_time, straggler.period_s), idle_pipeline_w)
        parts = [(1.0, straggler)] + ([(float(dp - 1), pipeline(deployment.others))] if dp > 1 else [])
    job_time = max(trace.period_s for _, trace in parts)
    parts = [(weight, hold(trace, job_time, idle_pipeline_w)) for weight, trace in parts]
    job = summed(parts)
    if gap.seconds > 0:
        job = hold(job, job_time + gap.seconds, dp * gpus_per_pipeline * gap.power_w)
    return job


def deployment_of(emulation: Emulation, strategy: str) -> Deployment:
    """The deployment a strategy runs most often under the emulation's scenario (a steady
    scenario has one)."""
    outcome = emulation.outcomes[strategy]
    weights = emulation.scenario.weights
    return outcome.deployments[int(np.argmax(weights))]


def job_swings(emulator: Emulator, emulation: Emulation, gap: SyncGap,
               strategies: tuple[str, ...] = SWING_STRATEGIES) -> list[JobSwing]:
    """The whole job's swing figures per strategy (all-max clocks and perseus-ext's plans by
    default), each over its own periodic iteration."""
    swings = []
    for strategy in strategies:
        trace = job_power_trace(emulator, deployment_of(emulation, strategy), gap)
        swings.append(JobSwing(strategy, trace.period_s, trace.energy_j, trace.figures()))
    return swings


def swing_table(swings: list[JobSwing], markdown: bool = False) -> str:
    """One row per strategy: the job's mean power, peak-to-trough (and % of the mean), the
    largest ramp of the 50 ms moving average and the variance in the 0.1-20 Hz band; in MW, kW
    or W, whichever keeps the largest mean at 1 or more."""
    from perseus_ext.emulator.report import format_table

    largest = max(swing.figures.mean_w for swing in swings)
    unit, scale = next(((u, k) for u, k in (("MW", 1e6), ("kW", 1e3)) if largest >= k), ("W", 1.0))
    headers = ["strategy", "period s", f"mean {unit}", f"peak-trough {unit}", "% of mean",
               f"max ramp {unit}/s", f"band {unit}^2", "band %"]
    rows = []
    for swing in swings:
        f = swing.figures
        rows.append([SWING_LABELS.get(swing.strategy, swing.strategy), f"{swing.period_s:.2f}", f"{f.mean_w / scale:.3f}",
                     f"{f.peak_to_trough_w / scale:.3f}", f"{100 * f.peak_to_trough_fraction:.1f}%",
                     f"{f.max_ramp_w_per_s / scale:.2f}", f"{f.band_energy_w2 / scale**2:.4g}",
                     f"{100 * f.band_energy_fraction:.1f}%"])
    return format_table(headers, rows, markdown)


def swing_legend() -> str:
    """What the swing table's model and columns are, printed under it."""
    import textwrap

    lines = [
        "all max clock: every GPU at its highest clock; perseus-ext: the plans perseus-ext deploys (intrinsic "
        "+ extrinsic)",
        "model: the whole job over one iteration, pipelines in lockstep; a computation draws its energy / its "
        "time, a waiting GPU the blocking power; then the gradient sync and optimizer step, every GPU at the "
        "power the header states for as long (--sync-gap-s, default 5% of the all-max-clock iteration; "
        "--sync-gap-power, default the blocking power); iterations back to back",
        "peak-trough: highest minus lowest 1 ms power average, and as % of the mean; max ramp: largest slope of "
        "the 50 ms moving average; band: the power's variance at 0.1-20 Hz, and its % of the whole variance "
        "(definitions: docs/power.md)",
    ]
    return "\n".join(textwrap.fill(line, 100, initial_indent="  ", subsequent_indent="      ") for line in lines)
