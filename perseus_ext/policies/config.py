"""The policy objects built from the `perseus.policy` section (its schema: `section.py`).

`PolicyConfig` is the validated section plus its factories: the frontier policy (Perseus,
Zeus, Chase, power budget), the carbon or budget signal, the power-limit optimizer and the
recurring job's batch-size optimizer. Nothing here validates user input (the schema did, at
the door); what needs the GPU (its maximum power limit when `max_power_w` is not given) or the
network (the carbon source itself) is checked here, when the runtime builds the policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from perseus_ext.errors import ConfigError
from perseus_ext.policies.base import OperatingPointPolicy, StragglerPolicy
from perseus_ext.policies.batch_size import BatchSizeOptimizer
from perseus_ext.policies.carbon import (
    CARBON,
    CallbackCarbonSignal,
    CarbonSignal,
    CSVCarbonTrace,
    HTTPCarbonSignal,
    SignalQuantity,
)
from perseus_ext.policies.chase import CarbonCost, ChasePolicy
from perseus_ext.policies.cost import EnergyTimeCost, ZeusCost
from perseus_ext.policies.power_budget import POWER_BUDGET, PowerBudget, PowerBudgetPolicy
from perseus_ext.policies.power_limit import AllReduceSum, PowerLimitGPU, PowerLimitOptimizer
from perseus_ext.policies.recurring_job import RecurringJob, TargetMetric
from perseus_ext.policies.section import (
    PREFIX,
    BudgetSettings,
    CarbonSourceKind,
    PolicySection,
    PolicyType,
    resolve_callable,
)
from perseus_ext.policies.zeus import ZeusPolicy


class PolicyConfig(PolicySection):
    """The validated `perseus.policy` section and the policy objects it builds."""

    def _max_power(self, gpu_max_power_w: float | None, what: str | None = None) -> float:
        value = self.max_power_w if self.max_power_w is not None else gpu_max_power_w
        if value is None:
            raise ConfigError(
                f"{PREFIX}.max_power_w is required for {what or f'type {self.type.value!r}'} when the "
                f"GPU's maximum power limit is unknown; set it to one GPU's max power limit in watts "
                f"(e.g. 400 for an A100 SXM)"
            )
        return value

    def build_signal(self, key: str = "carbon") -> CarbonSignal:
        """The `carbon` (or `budget`) section's signal; an HTTP source starts polling at once,
        so build it on one rank per job and feed the others (`ExternalSignal`)."""
        where = f"{PREFIX}.{key}"
        quantity: SignalQuantity = CARBON if key == "carbon" else POWER_BUDGET
        carbon, budget = self.carbon_settings, self.budget_settings
        if key == "carbon":
            source, max_carbon = (carbon.source, carbon.max_carbon) if carbon is not None else (None, None)
        else:
            source, max_carbon = (budget.source if budget is not None else None), None
        if source is None:
            raise ConfigError(f"{where} names no signal source (csv, url or callback)")
        if source.kind is CarbonSourceKind.CSV:
            return CSVCarbonTrace(source.location, align=source.align, quantity=quantity)
        if source.kind is CarbonSourceKind.URL:
            return HTTPCarbonSignal(source.location, field=source.field, timeout_s=source.timeout_s,
                                    refresh_s=self.period_s, headers=dict(source.headers),
                                    max_intensity=max_carbon, quantity=quantity,
                                    max_response_bytes=source.max_response_bytes)
        forecast = source.forecast_callback
        return CallbackCarbonSignal(
            resolve_callable(source.location, f"{where}.callback"),
            None if forecast is None else resolve_callable(forecast, f"{where}.forecast_callback"),
            max_intensity=max_carbon,
            quantity=quantity,
        )

    def build_cost(
        self, gpu_max_power_w: float | None = None, clock: Callable[[], float] = time.time
    ) -> EnergyTimeCost | None:
        """Zeus or Chase cost (None for perseus and power_budget). Chase starts its carbon
        signal here."""
        if self.type in (PolicyType.PERSEUS, PolicyType.POWER_BUDGET):
            return None
        max_power = self._max_power(gpu_max_power_w)
        if self.type is PolicyType.ZEUS:
            return ZeusCost(self.eta, max_power)
        carbon = self.carbon_settings
        return CarbonCost(
            self.eta,
            max_power,
            self.build_signal(),
            max_carbon=carbon.max_carbon if carbon is not None else None,
            period_s=self.period_s,
            forecast_horizon_s=carbon.forecast_horizon_s if carbon is not None else None,
            clock=clock,
        )

    def build_budget(self, num_gpus: int = 1, clock: Callable[[], float] = time.time) -> PowerBudget:
        """The power budget of type power_budget; `num_gpus` (the job's) converts a job-wide
        budget to the average GPU's."""
        budget = self.budget_settings or BudgetSettings(None, None)
        source = budget.watts if budget.watts is not None else self.build_signal("budget")
        return PowerBudget(source, scope=budget.scope, num_gpus=num_gpus, period_s=self.period_s, clock=clock)

    def build_policy(
        self, gpu_max_power_w: float | None = None, clock: Callable[[], float] = time.time
    ) -> OperatingPointPolicy:
        if self.type is PolicyType.POWER_BUDGET:
            return PowerBudgetPolicy(self.build_budget(clock=clock))
        cost = self.build_cost(gpu_max_power_w, clock)
        if cost is None:
            return StragglerPolicy()
        if isinstance(cost, CarbonCost):
            return ChasePolicy(cost)
        assert isinstance(cost, ZeusCost)
        return ZeusPolicy(cost.eta, cost.max_power_w)

    def build_power_limit_optimizer(
        self,
        gpu: PowerLimitGPU,
        *,
        cost: EnergyTimeCost | None = None,
        all_reduce: AllReduceSum | None = None,
        clock: Callable[[], float] = time.time,
    ) -> PowerLimitOptimizer:
        """`cost` lets the power-limit optimizer share a Chase policy's cost (one carbon poller);
        MaxPower defaults to the GPU's maximum power limit."""
        if cost is None:
            gpu_max = None if self.max_power_w is not None else float(gpu.power_limit_range_w()[1])
            cost = self.build_cost(gpu_max, clock)
            if cost is None:
                raise ConfigError(f"{PREFIX}.mode 'power_limit' needs {PREFIX}.type 'zeus' or 'chase'")
        options = self.power_limit_settings
        return PowerLimitOptimizer(
            gpu,
            cost,
            warmup_iters=options.warmup_iters,
            profile_iters=options.profile_iters,
            step_w=options.step_w,
            limits_w=None if options.limits_w is None else list(options.limits_w),
            all_reduce=all_reduce,
        )

    # ------------------------------------------------------------------ batch size
    @property
    def target_metric(self) -> TargetMetric | None:
        """The job's target (`batch_size.target_metric`), None without one."""
        target = (self.batch_size or {}).get("target_metric")
        if target is None:
            return None
        return TargetMetric(target["name"], target["value"], target.get("higher_is_better", True))

    def build_batch_size_optimizer(self, gpu_max_power_w: float | None = None) -> BatchSizeOptimizer | None:
        """None unless a `batch_size` section is configured."""
        options = self.batch_size_settings
        if options is None:
            return None
        return BatchSizeOptimizer(
            options.store, options.job_id, list(options.batch_sizes), options.default_batch_size, eta=self.eta,
            max_power_w=self._max_power(gpu_max_power_w, f"{PREFIX}.batch_size"), beta=options.beta,
            pruning_rounds=options.pruning_rounds, seed=options.seed, lease_s=options.lease_s,
            network_timeout_s=options.network_timeout_s,
        )

    def start_recurring_job(
        self, *, num_gpus: int, gpu_max_power_w: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> RecurringJob:
        """Ask the store for this run's batch size (rank 0, before the engine is built)."""
        options = self.batch_size_settings
        if options is None:
            raise ConfigError(f"{PREFIX}.batch_size is not configured")
        return RecurringJob.start(
            options.store, options.job_id, list(options.batch_sizes), options.default_batch_size,
            max_power_w=self._max_power(gpu_max_power_w, f"{PREFIX}.batch_size"), num_gpus=num_gpus,
            target=self.target_metric, eta=self.eta, beta=options.beta, pruning_rounds=options.pruning_rounds,
            seed=options.seed, lease_s=options.lease_s, network_timeout_s=options.network_timeout_s, clock=clock,
        )


def build_policy(
    section: Mapping[str, Any] | PolicyConfig | None,
    *,
    gpu_max_power_w: float | None = None,
    clock: Callable[[], float] = time.time,
) -> OperatingPointPolicy:
    """The frontier policy for a `perseus.policy` section (None = Perseus' straggler policy).

    `gpu_max_power_w` is the runtime's reading of one GPU's maximum power limit, used when the
    section has no `max_power_w`.
    """
    return PolicyConfig.parse(section).build_policy(gpu_max_power_w, clock)
