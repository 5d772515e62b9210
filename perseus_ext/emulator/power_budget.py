"""Throughput at equal average power: perseus-ext's power-budget policy against the two knobs a
job has without it, one global GPU power limit (Zeus' knob) and one global SM clock.

Each strategy gets the same job-wide average-power budget (a fraction of what the job draws
with every GPU at its max clock) and takes its fastest setting whose emulated average power,
blocking power included, fits:

* perseus-ext: `PowerBudgetPolicy` on the pipeline's frontier (the runtime's own selection),
  extended below its minimum-energy plan by frontier plans under a power cap (`capped_plans`);
* power limit: every GPU capped at L watts, in 1 W steps. A capped GPU runs each computation at
  the highest profiled clock whose power (profiled energy / time) is within L; the cap binds
  only while computing, since blocked GPUs draw far less (the A100's 83.64 W);
* global clock: every GPU at one profiled clock for the whole run.

All three are replayed through the same `Emulator.iteration`, so time and power are accounted
identically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from perseus_ext.emulator.core import Deployment, Emulator
from perseus_ext.emulator.report import format_table
from perseus_ext.errors import ConfigError
from perseus_ext.planning.frontier import Plan
from perseus_ext.policies.power_budget import (
    PowerBudget,
    PowerBudgetPolicy,
    capped_plans,
    power_capped_choices,
    power_limits_w,
)

BUDGET_POLICY, POWER_LIMIT, GLOBAL_CLOCK = "perseus-ext budget", "global power limit", "global clock"
DEFAULT_FRACTIONS = (0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)
_FIT_TOLERANCE = 1e-9


@dataclass(frozen=True)
class BudgetOutcome:
    """One strategy's fastest fitting setting: iteration time and job-average power."""

    strategy: str
    setting: str
    time_s: float
    power_w: float  # the whole job's average power
    fits: bool

    def throughput(self, global_batch: int) -> float:
        return global_batch / self.time_s


@dataclass(frozen=True)
class BudgetRow:
    """The three strategies at one budget."""

    fraction: float
    budget_w: float
    outcomes: dict[str, BudgetOutcome]


class PowerBudgetComparison:
    """Equal-power comparison on one emulated job, with a steady straggler at `factor` (1: none)."""

    def __init__(self, emulator: Emulator, factor: float = 1.0):
        if not (math.isfinite(factor) and factor >= 1.0):
            raise ConfigError(f"slowdown factor must be >= 1, got {factor!r}")
        self.emulator = emulator
        self.factor = factor
        self.max_clock = self._evaluate(emulator.max_clock_plan, emulator.max_clock_plan)
        self._low_power_plans = capped_plans(
            emulator.model, emulator.frontier, emulator.layout.tensor_parallel
        )

    @property
    def num_gpus(self) -> int:
        return self.emulator.layout.num_gpus

    @property
    def max_clock_power_w(self) -> float:
        return self.max_clock[1]

    def _evaluate(self, straggler: Plan, others: Plan) -> tuple[float, float]:
        """(iteration time, job-average power) of one deployment."""
        iteration = self.emulator.iteration(Deployment(self.factor, straggler, others))
        return iteration.time, iteration.total / iteration.time

    def _fastest(self, strategy: str, settings: list[tuple[str, Plan]], budget_w: float) -> BudgetOutcome:
        """Of uniform settings (every pipeline alike), the fastest within the budget; ties go to
        the lower power. Nothing fits: the lowest-power one, marked as not fitting."""
        evaluated = [(name, *self._evaluate(plan, plan)) for name, plan in settings]
        fitting = [e for e in evaluated if e[2] <= budget_w * (1 + _FIT_TOLERANCE)]
        if fitting:
            name, time_s, power = min(fitting, key=lambda e: (e[1], e[2]))
            return BudgetOutcome(strategy, name, time_s, power, True)
        name, time_s, power = min(evaluated, key=lambda e: e[2])
        return BudgetOutcome(strategy, name, time_s, power, False)

    def _budget_policy(self, budget_w: float) -> BudgetOutcome:
        emulator = self.emulator
        policy = PowerBudgetPolicy(
            PowerBudget(budget_w / self.num_gpus),
            gpus_per_stage=emulator.layout.tensor_parallel,
            low_power_plans=lambda frontier: self._low_power_plans,
        )
        frontier = emulator.frontier
        own = policy.select(frontier, None)
        straggler_time = emulator.straggler_time(self.factor)
        others = own if straggler_time is None else policy.select(frontier, straggler_time)
        time_s, power = self._evaluate(own, others)
        setting = f"plan {others.time:.1f} s"
        return BudgetOutcome(
            BUDGET_POLICY, setting, time_s, power, power <= budget_w * (1 + _FIT_TOLERANCE)
        )

    def power_limit_plans(self) -> list[tuple[str, Plan]]:
        """Every GPU capped at L watts, L in 1 W steps from the highest computing power down
        to the lowest: each computation at its highest clock whose power is within L."""
        emulator = self.emulator
        tp = emulator.layout.tensor_parallel
        limits = power_limits_w(emulator.model, tp)
        top = emulator.model.choice_of(emulator.max_clock_plan)
        plans = emulator.plans_from_choices(power_capped_choices(emulator.model, top, limits, tp))
        return [(f"{limit:g} W", plan) for limit, plan in zip(limits.tolist(), plans)]

    def sweep(self, fractions: Sequence[float] = DEFAULT_FRACTIONS) -> list[BudgetRow]:
        limits = self.power_limit_plans()
        clocks = [(f"{clock} MHz", plan) for clock, plan in self.emulator.uniform_plans.items()]
        rows = []
        for fraction in fractions:
            if not (math.isfinite(fraction) and 0 < fraction <= 1.0):
                raise ConfigError(f"budget fractions must be in (0, 1], got {fraction!r}")
            budget = fraction * self.max_clock_power_w
            rows.append(BudgetRow(fraction, budget, {
                BUDGET_POLICY: self._budget_policy(budget),
                POWER_LIMIT: self._fastest(POWER_LIMIT, limits, budget),
                GLOBAL_CLOCK: self._fastest(GLOBAL_CLOCK, clocks, budget),
            }))
        return rows


def budget_table(comparison: PowerBudgetComparison, rows: Sequence[BudgetRow], markdown: bool = False) -> str:
    """Throughput (samples/s and % of all-max-clock) per budget and strategy, with each
    strategy's setting, and perseus-ext's gain over the better baseline."""
    batch = comparison.emulator.layout.global_batch
    base = batch / comparison.max_clock[0]
    headers = ["budget", "MW", "perseus-ext budget", "global power limit", "global clock", "gain vs best baseline"]
    table = []
    for row in rows:
        cells: list[object] = [f"{100 * row.fraction:.0f}%", f"{row.budget_w / 1e6:.3f}"]
        for key in (BUDGET_POLICY, POWER_LIMIT, GLOBAL_CLOCK):
            out = row.outcomes[key]
            mark = "" if out.fits else " (over)"
            cells.append(
                f"{out.throughput(batch):.2f}/s {100 * out.throughput(batch) / base:.1f}% "
                f"({out.setting}){mark}"
            )
        ours = row.outcomes[BUDGET_POLICY].throughput(batch)
        best = max(row.outcomes[k].throughput(batch) for k in (POWER_LIMIT, GLOBAL_CLOCK))
        cells.append(f"{100 * (ours / best - 1):+.1f}%")
        table.append(cells)
    return format_table(headers, table, markdown)
