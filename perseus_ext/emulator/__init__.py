"""Large-scale emulation (`perseus-ext emulate`): what a whole TP x PP x DP job spends per
iteration with and without perseus-ext, from per-stage profiles, using the runtime's own planner
and operating-point policy.
"""

from perseus_ext.emulator.core import (
    ENVPIPE,
    GLOBAL_CLOCK,
    INTRINSIC,
    MAX_CLOCK,
    PERSEUS,
    PERSEUS_DETECTED,
    PERSEUS_T_STAR,
    STRATEGIES,
    Deployment,
    Emulation,
    Emulator,
    IterationEnergy,
    StrategyOutcome,
)
from perseus_ext.emulator.layout import JobLayout, resolve_blocking_power
from perseus_ext.emulator.scenario import StragglerScenario

__all__ = [
    "ENVPIPE", "GLOBAL_CLOCK", "INTRINSIC", "MAX_CLOCK", "PERSEUS", "PERSEUS_DETECTED",
    "PERSEUS_T_STAR", "STRATEGIES",
    "Deployment", "Emulation", "Emulator", "IterationEnergy", "StrategyOutcome",
    "JobLayout", "resolve_blocking_power", "StragglerScenario",
]
