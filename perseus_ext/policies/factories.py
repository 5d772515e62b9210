"""The policy objects a `perseus.policy` section builds (the section itself:
`perseus_ext.config.policy.PolicySection`).

The factories: the frontier policy (Perseus, Zeus, Chase, power budget), the carbon or budget
signal, the power-limit optimizer and the recurring job's batch-size optimizer. Nothing here
validates user input (the door did); what needs the GPU (its maximum power limit when
`max_power_w` is not given) or the network (the carbon source itself) is checked here, when the
runtime builds the policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from perseus_ext.config.policy import (
    PREFIX,
    CallbackBudgetSource,
    CallbackCarbonSource,
    CarbonSourceKind,
    FixedBudget,
    PolicySection,
    PolicyType,
    URLBudgetSource,
    URLCarbonSource,
    resolve_callable,
)
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
from perseus_ext.policies.zeus import ZeusPolicy


def _max_power(section: PolicySection, gpu_max_power_w: float | None, what: str | None = None) -> float:
    value = section.max_power_w if section.max_power_w is not None else gpu_max_power_w
    if value is None:
        raise ConfigError(
            f"{PREFIX}.max_power_w is required for {what or f'type {section.type.value!r}'} when the "
            f"GPU's maximum power limit is unknown; set it to one GPU's max power limit in watts "
            f"(e.g. 400 for an A100 SXM)"
        )
    return value


def build_signal(section: PolicySection, key: str = "carbon") -> CarbonSignal:
    """The `carbon` (or `budget`) sub-section's signal; an HTTP source starts polling at once,
    so build it on one rank per job and feed the others (`ExternalSignal`)."""
    where = f"{PREFIX}.{key}"
    quantity: SignalQuantity = CARBON if key == "carbon" else POWER_BUDGET
    source = section.carbon if key == "carbon" else section.budget
    if source is None or isinstance(source, FixedBudget):
        raise ConfigError(f"{where} names no signal source (csv, url or callback)")
    max_carbon = section.carbon.max_carbon if key == "carbon" and section.carbon is not None else None
    if source.kind is CarbonSourceKind.CSV:
        return CSVCarbonTrace(source.location, align=source.align, quantity=quantity)
    if isinstance(source, (URLCarbonSource, URLBudgetSource)):
        return HTTPCarbonSignal(source.url, field=source.field, timeout_s=source.timeout_s,
                                refresh_s=section.period_s, headers=dict(source.headers),
                                max_intensity=max_carbon, quantity=quantity,
                                max_response_bytes=source.max_response_bytes)
    assert isinstance(source, (CallbackCarbonSource, CallbackBudgetSource))
    forecast = source.forecast_callback if isinstance(source, CallbackCarbonSource) else None
    return CallbackCarbonSignal(
        resolve_callable(source.callback, f"{where}.callback"),
        None if forecast is None else resolve_callable(forecast, f"{where}.forecast_callback"),
        max_intensity=max_carbon,
        quantity=quantity,
    )


def build_cost(section: PolicySection, gpu_max_power_w: float | None = None,
               clock: Callable[[], float] = time.time) -> EnergyTimeCost | None:
    """Zeus or Chase cost (None for perseus and power_budget). Chase starts its carbon signal here."""
    if section.type in (PolicyType.PERSEUS, PolicyType.POWER_BUDGET):
        return None
    max_power = _max_power(section, gpu_max_power_w)
    if section.type is PolicyType.ZEUS:
        return ZeusCost(section.eta, max_power)
    carbon = section.carbon
    return CarbonCost(
        section.eta,
        max_power,
        build_signal(section),
        max_carbon=carbon.max_carbon if carbon is not None else None,
        period_s=section.period_s,
        forecast_horizon_s=carbon.forecast_horizon_s if carbon is not None else None,
        clock=clock,
    )


def build_budget(section: PolicySection, num_gpus: int = 1, clock: Callable[[], float] = time.time) -> PowerBudget:
    """The power budget of type power_budget; `num_gpus` (the job's) converts a job-wide
    budget to the average GPU's."""
    budget = section.budget
    if budget is None:
        raise ConfigError(f"{PREFIX}.budget names no budget (watts, csv, url or callback)")
    source = budget.watts if isinstance(budget, FixedBudget) else build_signal(section, "budget")
    return PowerBudget(source, scope=budget.scope, num_gpus=num_gpus, period_s=section.period_s, clock=clock)


def build_policy(
    section: Mapping[str, Any] | PolicySection | None,
    *,
    gpu_max_power_w: float | None = None,
    clock: Callable[[], float] = time.time,
) -> OperatingPointPolicy:
    """The frontier policy for a `perseus.policy` section (None = Perseus' straggler policy).

    `gpu_max_power_w` is the runtime's reading of one GPU's maximum power limit, used when the
    section has no `max_power_w`. A mapping is validated first (the door's errors).
    """
    parsed = section if isinstance(section, PolicySection) else PolicySection.parse(section)
    if parsed.type is PolicyType.POWER_BUDGET:
        return PowerBudgetPolicy(build_budget(parsed, clock=clock))
    cost = build_cost(parsed, gpu_max_power_w, clock)
    if cost is None:
        return StragglerPolicy()
    if isinstance(cost, CarbonCost):
        return ChasePolicy(cost)
    assert isinstance(cost, ZeusCost)
    return ZeusPolicy(cost.eta, cost.max_power_w)


def build_power_limit_optimizer(
    section: PolicySection,
    gpu: PowerLimitGPU,
    *,
    cost: EnergyTimeCost | None = None,
    all_reduce: AllReduceSum | None = None,
    clock: Callable[[], float] = time.time,
) -> PowerLimitOptimizer:
    """`cost` lets the power-limit optimizer share a Chase policy's cost (one carbon poller);
    MaxPower defaults to the GPU's maximum power limit."""
    if cost is None:
        gpu_max = None if section.max_power_w is not None else float(gpu.power_limit_range_w()[1])
        cost = build_cost(section, gpu_max, clock)
        if cost is None:
            raise ConfigError(f"{PREFIX}.mode 'power_limit' needs {PREFIX}.type 'zeus' or 'chase'")
    options = section.power_limit
    return PowerLimitOptimizer(
        gpu,
        cost,
        warmup_iters=options.warmup_iters,
        profile_iters=options.profile_iters,
        step_w=options.step_w,
        limits_w=None if options.limits_w is None else list(options.limits_w),
        all_reduce=all_reduce,
    )


# ---------------------------------------------------------------------- batch size
def target_metric(section: PolicySection | None) -> TargetMetric | None:
    """The job's target (`batch_size.target_metric`), None without one."""
    target = None if section is None or section.batch_size is None else section.batch_size.target_metric
    if target is None:
        return None
    return TargetMetric(target.name, target.value, target.higher_is_better)


def build_batch_size_optimizer(section: PolicySection,
                               gpu_max_power_w: float | None = None) -> BatchSizeOptimizer | None:
    """None unless a `batch_size` sub-section is configured."""
    options = section.batch_size
    if options is None:
        return None
    return BatchSizeOptimizer(
        options.location, options.job_id, list(options.batch_sizes), options.default_batch_size, eta=section.eta,
        max_power_w=_max_power(section, gpu_max_power_w, f"{PREFIX}.batch_size"), beta=options.beta,
        pruning_rounds=options.pruning_rounds, seed=options.seed, lease_s=options.lease_s,
        network_timeout_s=options.timeout_s,
    )


def start_recurring_job(
    section: PolicySection, *, num_gpus: int, gpu_max_power_w: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> RecurringJob:
    """Ask the store for this run's batch size (rank 0, before the engine is built)."""
    optimizer = build_batch_size_optimizer(section, gpu_max_power_w)
    if optimizer is None:
        raise ConfigError(f"{PREFIX}.batch_size is not configured", keys=(f"{PREFIX}.batch_size",))
    return RecurringJob.with_optimizer(optimizer, num_gpus=num_gpus, target=target_metric(section), clock=clock)
