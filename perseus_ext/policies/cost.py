"""Energy–time costs shared by every cost-driven policy (frontier plans, power limits, batch sizes).

Every cost here is linear: ``cost = energy_weight * energy_J + time_weight * n_gpus * time_s``.
Zeus (NSDI'23) sets ``energy_weight = eta`` and ``time_weight = (1 - eta) * MaxPower``; Chase
multiplies the energy term by the grid's carbon intensity and the time term by the maximum
intensity. Writing both as weights lets one selection routine serve the frontier policy, the
power-limit optimizer and the batch-size optimizer, and lets Chase change the weights over time.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

from perseus_ext.errors import ConfigError


def check_eta(eta: object, key: str = "perseus.policy.eta") -> float:
    """`eta` as a float in [0, 1], or a ConfigError naming `key`."""
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not math.isfinite(eta):
        raise ConfigError(f"{key} must be a number in [0, 1], got {eta!r}")
    if not 0.0 <= eta <= 1.0:
        raise ConfigError(
            f"{key} must be in [0, 1], got {eta}; 0 = never trade speed for energy, "
            f"1 = minimise energy only"
        )
    return float(eta)


def check_positive(value: object, key: str, unit: str) -> float:
    """`value` as a finite float > 0, or a ConfigError naming `key` and its unit."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key} must be a positive number of {unit}, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{key} must be a positive number of {unit}, got {value}")
    return float(value)


@dataclass(frozen=True)
class CostWeights:
    """``cost = energy * energy_J + time_per_gpu * n_gpus * time_s``.

    `time_per_gpu` is per GPU so that one weight prices a single GPU (power-limit mode) and an
    S-stage pipeline (S GPUs, frontier mode) consistently: Zeus' MaxPower is per GPU.
    """

    energy: float
    time_per_gpu: float

    def cost(self, time_s: float, energy_j: float, n_gpus: int = 1) -> float:
        return self.energy * energy_j + self.time_per_gpu * n_gpus * time_s


class EnergyTimeCost(abc.ABC):
    """A (possibly time-varying) linear energy–time cost."""

    #: How often a time-varying cost's weights may change (seconds); None = constant weights.
    period_s: float | None = None

    @abc.abstractmethod
    def weights(self) -> CostWeights | None:
        """The weights to use now; None when the cost cannot be evaluated yet (e.g. no carbon
        reading arrived), in which case callers fall back to running at full speed."""

    def close(self) -> None:
        """Release background resources (HTTP poller threads); idempotent."""


class ZeusCost(EnergyTimeCost):
    """Zeus: ``eta * Energy + (1 - eta) * MaxPower * Time`` (MaxPower = one GPU's max power limit).

    The time term converts seconds to joules at MaxPower, so eta is a unit-free preference:
    eta = 0 never slows down, eta = 1 minimises energy regardless of time.
    """

    def __init__(self, eta: float, max_power_w: float):
        self.eta = check_eta(eta)
        self.max_power_w = check_positive(max_power_w, "perseus.policy.max_power_w", "watts")
        self._weights = CostWeights(self.eta, (1.0 - self.eta) * self.max_power_w)

    def weights(self) -> CostWeights:
        return self._weights

    def __repr__(self) -> str:
        return f"ZeusCost(eta={self.eta}, max_power_w={self.max_power_w})"
