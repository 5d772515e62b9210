"""Power-budget operating point: the fastest frontier plan whose average power fits a budget.

A facility or a co-tenant grants the job a power budget (per GPU, or for the whole job); the
policy keeps the job's *average* power under it while losing as little speed as possible. The
average includes what the GPUs draw while blocked: bubbles inside the plan (already in the
plan's energy) and, with a straggler, the wait for it at the gradient sync. So with a
straggler whose iteration takes T_s, every plan faster than T_s runs at the same effective
speed and the policy takes the one of them that draws least, never racing ahead only to wait.

The budget may change while the job runs. It comes from the same kinds of sources as Chase's
carbon intensity (a CSV schedule, an HTTP endpoint, a callback, or a value fed from the rank
that polls) and is re-read every `period_s`; the runtime re-selects at least that often, so
the plan follows a new budget within one period.

Per-GPU budgets are averages over the job's GPUs, not caps on each GPU (that is what a power
limit is; see the emulator's comparison). The frontier ends at its minimum-energy plan; budgets
below that plan's power need slower plans, which `capped_plans` makes from frontier plans by
capping every computation's power (`low_power_plans`). A budget below every candidate's power cannot be met by picking
plans: the policy then runs the lowest-power one and says so once.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from perseus_ext.config.policy import BudgetScope
from perseus_ext.errors import ConfigError
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import Frontier, Plan
from perseus_ext.policies.base import OperatingPointPolicy, StragglerPolicy
from perseus_ext.policies.carbon import CarbonSignal, SignalQuantity
from perseus_ext.policies.chase import NO_READING_RETRY_S
from perseus_ext.policies.cost import check_positive

logger = logging.getLogger(__name__)

BUDGET_KEY = "perseus.policy.budget"
POWER_BUDGET = SignalQuantity(
    "power budget", "power budget", "W", BUDGET_KEY, ("budget_w", "power_w", "watts")
)


class PowerBudget:
    """The budget per GPU right now: a constant, or a signal re-read every `period_s`.

    `num_gpus` (the job's GPU count) converts a job-wide budget to a per-GPU one.
    """

    def __init__(
        self,
        source: float | CarbonSignal,
        *,
        scope: BudgetScope = BudgetScope.GPU,
        num_gpus: int = 1,
        period_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ):
        self.scope = BudgetScope(scope)
        if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
            raise ConfigError(f"{BUDGET_KEY}: num_gpus must be a positive integer, got {num_gpus!r}")
        self.num_gpus = num_gpus
        if isinstance(source, CarbonSignal):
            self.signal: CarbonSignal | None = source
            self._watts: float | None = None
            self.period_s: float | None = check_positive(period_s, "perseus.policy.period_s", "seconds")
        else:
            self.signal = None
            self._watts = check_positive(source, f"{BUDGET_KEY}.watts", "watts")
            self.period_s = None
        self.clock = clock
        self._next_refresh: float | None = None

    def watts(self) -> float | None:
        """The budget as configured (scope's units); None before a signal's first reading."""
        if self.signal is None:
            return self._watts
        now = self.clock()
        if self._next_refresh is None or now >= self._next_refresh:
            value = self.signal.intensity(now)
            if value is not None and value != self._watts:
                logger.info("power budget %.1f W (%s)", value, self.scope.value)
            self._watts = value if value is not None else self._watts
            assert self.period_s is not None
            retry = self.period_s if self._watts is not None else min(self.period_s, NO_READING_RETRY_S)
            self._next_refresh = now + retry
        return self._watts

    def per_gpu_w(self) -> float | None:
        watts = self.watts()
        if watts is None:
            return None
        return watts if self.scope is BudgetScope.GPU else watts / self.num_gpus

    def close(self) -> None:
        if self.signal is not None:
            self.signal.close()


def average_power_w(
    frontier: Frontier, plan: Plan, straggler_time: float | None, gpus_per_stage: int = 1
) -> float:
    """One GPU's average power running `plan` (mean over the pipeline's GPUs), waiting for a
    straggler at the frontier's blocking power until `straggler_time` if it is later."""
    num_stages = len(plan.frequencies)
    iteration_s = max(plan.time, straggler_time or 0.0)
    energy = plan.energy + num_stages * frontier.blocking_power * (iteration_s - plan.time)
    return energy / iteration_s / (num_stages * gpus_per_stage)


@dataclass(frozen=True)
class BudgetChoice:
    """The last selection: what it draws and whether it fits."""

    plan: Plan
    budget_per_gpu_w: float
    average_power_w: float  # per GPU, waits included

    @property
    def fits(self) -> bool:
        return self.average_power_w <= self.budget_per_gpu_w * (1 + 1e-12)


def computation_power_w(model: CostModel, gpus_per_stage: int = 1) -> np.ndarray:
    """One GPU's power running each computation at each option (inf for padding options)."""
    valid = np.arange(model.times.shape[1])[None, :] < model.num_options[:, None]
    return np.where(valid, model.energies / np.where(valid, model.times, 1.0) / gpus_per_stage, np.inf)


def power_capped_choices(
    model: CostModel, choice: np.ndarray, limits_w: Sequence[float], gpus_per_stage: int = 1
) -> np.ndarray:
    """Option choices (nodes, limits): each computation at the highest clock that is no higher
    than in `choice` and draws at most the limit (the lowest-power option if none does). From
    the all-max-clock choice this is what a GPU power limit does to the pipeline."""
    power = computation_power_w(model, gpus_per_stage)
    clocks = np.where(np.isfinite(power), model.frequencies, -1)
    ceiling = clocks[np.arange(model.num_nodes), choice][:, None]
    lowest = np.argmin(power, axis=1)
    choices = np.empty((model.num_nodes, len(limits_w)), dtype=np.int64)
    for column, limit in enumerate(limits_w):
        allowed = (power <= limit) & (clocks <= ceiling)
        best = np.argmax(np.where(allowed, clocks, -1), axis=1)
        choices[:, column] = np.where(allowed.any(axis=1), best, lowest)
    return choices


def power_limits_w(model: CostModel, gpus_per_stage: int = 1, step_w: float = 1.0) -> np.ndarray:
    """Per-GPU power caps from the highest computing power down to the lowest, `step_w` apart."""
    power = computation_power_w(model, gpus_per_stage)
    finite = power[np.isfinite(power)]
    return np.arange(math.ceil(finite.max()), math.floor(finite.min()) - step_w, -step_w)


def capped_plans(
    model: CostModel,
    frontier: Frontier,
    gpus_per_stage: int = 1,
    num_plans: int = 8,
    step_w: float = 1.0,
) -> list[Plan]:
    """Plans beyond the frontier's reach: `num_plans` frontier plans (evenly spread, the
    all-max-clock baseline and the minimum-energy plan included) with every computation's power
    capped, at caps `step_w` apart. They reach below the minimum-energy plan's power and keep
    the frontier's shape (non-critical work slowed most) while they do."""
    plans = [frontier.baseline, frontier.min_energy]
    plans += [frontier.plans[int(i)] for i in np.linspace(0, len(frontier.plans) - 1, num_plans)]
    limits = power_limits_w(model, gpus_per_stage, step_w)
    choices = np.concatenate(
        [power_capped_choices(model, model.choice_of(p), limits, gpus_per_stage) for p in plans],
        axis=1,
    )
    times, energies = model.replay(choices)
    return model.make_plans(choices, times, energies)


def fastest_plan_within(
    frontier: Frontier,
    straggler_time: float | None,
    budget_per_gpu_w: float,
    gpus_per_stage: int = 1,
    low_power_plans: Sequence[Plan] = (),
) -> BudgetChoice:
    """The plan with the shortest effective iteration (its time, or the straggler's if later)
    among those within the budget; ties go to the lower power. Nothing fits: the lowest power.
    Candidates: the frontier up to its minimum-energy plan, then `low_power_plans`."""
    floor = straggler_time or 0.0
    slowest = frontier.min_energy.time
    candidates = [p for p in frontier.plans if p.time <= slowest]
    candidates += low_power_plans
    powers = {id(p): average_power_w(frontier, p, straggler_time, gpus_per_stage) for p in candidates}
    fitting = [p for p in candidates if powers[id(p)] <= budget_per_gpu_w * (1 + 1e-12)]
    if fitting:
        plan = min(fitting, key=lambda p: (max(p.time, floor), powers[id(p)]))
    else:
        plan = min(candidates, key=lambda p: powers[id(p)])
    return BudgetChoice(plan, budget_per_gpu_w, powers[id(plan)])


class PowerBudgetPolicy(OperatingPointPolicy):
    """Runs the fastest frontier plan that keeps the average power within `budget`.

    `gpus_per_stage`: 1 for the runtime's per-GPU frontier, TP for a frontier whose plan energy
    covers a stage's TP GPUs (the emulator's). With no budget reading yet, it runs like Perseus.
    `low_power_plans(frontier)` gives the plans beyond the frontier's minimum-energy end, e.g.
    ``lambda f: capped_plans(cost_model, f)``; it is called once per frontier.
    """

    name = "power_budget"

    def __init__(
        self,
        budget: PowerBudget,
        gpus_per_stage: int = 1,
        low_power_plans: Callable[[Frontier], Sequence[Plan]] | None = None,
    ):
        if isinstance(gpus_per_stage, bool) or not isinstance(gpus_per_stage, int) or gpus_per_stage < 1:
            raise ValueError(f"gpus_per_stage must be a positive integer, got {gpus_per_stage!r}")
        self.budget = budget
        self.gpus_per_stage = gpus_per_stage
        self.period_s = budget.period_s
        self.low_power_plans = low_power_plans
        self.last: BudgetChoice | None = None
        self._extension: tuple[Frontier, Sequence[Plan]] | None = None
        self._fallback = StragglerPolicy()
        self._warned_budget: float | None = None

    def select(self, frontier: Frontier, straggler_time: float | None) -> Plan:
        budget = self.budget.per_gpu_w()
        if budget is None:
            return self._fallback.select(frontier, straggler_time)
        choice = fastest_plan_within(
            frontier, straggler_time, budget, self.gpus_per_stage, self._beyond(frontier)
        )
        if not choice.fits and self._warned_budget != budget:
            self._warned_budget = budget
            logger.warning(
                "power budget %.1f W per GPU is below the lowest-power plan (%.1f W per GPU); "
                "running that plan. Lower the GPUs' power limit to go further.",
                budget,
                choice.average_power_w,
            )
        self.last = choice
        return choice.plan

    def _beyond(self, frontier: Frontier) -> Sequence[Plan]:
        if self.low_power_plans is None:
            return ()
        if self._extension is None or self._extension[0] is not frontier:
            self._extension = (frontier, list(self.low_power_plans(frontier)))
        return self._extension[1]

    def close(self) -> None:
        self.budget.close()

