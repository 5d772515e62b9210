"""Operating-point policies: Perseus' straggler policy, Zeus' energy–time cost, Chase's carbon
cost (on the frontier or as a global power limit), and Zeus' batch-size optimizer.

`build_policy(section)` turns the `perseus.policy` config section into a policy; keys are
documented in docs/policies.md and in `perseus_ext.config.policy` (the section's model); the
factories are in `perseus_ext.policies.factories`.
"""

from perseus_ext.policies.base import (
    CostPolicy,
    OperatingPointPolicy,
    StragglerPolicy,
    min_cost_plan,
)
from perseus_ext.policies.batch_size import BatchSizeOptimizer, RunOutcome, Suggestion
from perseus_ext.policies.carbon import (
    CallbackCarbonSignal,
    CarbonSignal,
    CarbonSignalError,
    CSVCarbonTrace,
    ExternalSignal,
    HTTPCarbonSignal,
)
from perseus_ext.policies.chase import CarbonCost, CarbonLedger, CarbonReport, ChasePolicy
from perseus_ext.policies.factories import build_policy
from perseus_ext.policies.cost import CostWeights, EnergyTimeCost, ZeusCost
from perseus_ext.policies.power_limit import PowerLimitOptimizer
from perseus_ext.policies.recurring_job import (
    BatchSizeDecision,
    FinishedRun,
    PerseusEarlyStop,
    RecurringJob,
    TargetMetric,
)
from perseus_ext.policies.zeus import ZeusPolicy

__all__ = [
    "BatchSizeDecision",
    "BatchSizeOptimizer",
    "CallbackCarbonSignal",
    "CarbonCost",
    "CarbonLedger",
    "CarbonReport",
    "CarbonSignal",
    "CarbonSignalError",
    "ChasePolicy",
    "CostPolicy",
    "CostWeights",
    "CSVCarbonTrace",
    "EnergyTimeCost",
    "ExternalSignal",
    "FinishedRun",
    "HTTPCarbonSignal",
    "OperatingPointPolicy",
    "PerseusEarlyStop",
    "PowerLimitOptimizer",
    "RecurringJob",
    "RunOutcome",
    "StragglerPolicy",
    "Suggestion",
    "TargetMetric",
    "ZeusCost",
    "ZeusPolicy",
    "build_policy",
    "min_cost_plan",
]
