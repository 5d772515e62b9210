"""Chase (carbon-aware): favour speed when the grid is clean, efficiency when it is dirty.

Cost = ``eta * carbon * Energy + (1 - eta) * MaxPower * MaxCarbon * Time``: the time term is
priced at the worst intensity, so at MaxCarbon Chase equals Zeus and as the grid gets cleaner
energy matters less and the policy speeds up. The intensity is re-read every `period_s`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from perseus_ext.planning.frontier import Frontier, Plan
from perseus_ext.policies.base import CostPolicy
from perseus_ext.policies.carbon import CarbonSignal
from perseus_ext.policies.cost import CostWeights, EnergyTimeCost, check_eta, check_positive

logger = logging.getLogger(__name__)

JOULES_PER_KWH = 3.6e6
#: While no intensity reading has arrived, look again this often (seconds) rather than a full period.
NO_READING_RETRY_S = 10.0


class CarbonCost(EnergyTimeCost):
    """Chase's cost weights, refreshed from `signal` at most every `period_s` seconds.

    MaxCarbon is `max_carbon` if given, else the signal's known maximum (a CSV trace's peak),
    else the highest intensity seen so far. With `forecast_horizon_s`, the intensity used is the
    signal's forecast mean over the next horizon instead of the instantaneous value.
    """

    def __init__(
        self,
        eta: float,
        max_power_w: float,
        signal: CarbonSignal,
        *,
        max_carbon: float | None = None,
        period_s: float = 300.0,
        forecast_horizon_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.eta = check_eta(eta)
        self.max_power_w = check_positive(max_power_w, "perseus.policy.max_power_w", "watts")
        self.period_s = check_positive(period_s, "perseus.policy.period_s", "seconds")
        if max_carbon is not None:
            max_carbon = check_positive(max_carbon, "perseus.policy.carbon.max_carbon", "gCO2/kWh")
        if forecast_horizon_s is not None:
            forecast_horizon_s = check_positive(
                forecast_horizon_s, "perseus.policy.carbon.forecast_horizon_s", "seconds"
            )
        self.signal = signal
        self.forecast_horizon_s = forecast_horizon_s
        self.clock = clock
        self._configured_max = max_carbon
        self._seen_max = 0.0
        self.intensity: float | None = None  # gCO2/kWh used by the current weights
        self._next_refresh: float | None = None

    @property
    def max_carbon(self) -> float | None:
        if self._configured_max is not None:
            return self._configured_max
        if self.signal.max_intensity is not None:
            return max(self.signal.max_intensity, self._seen_max)
        return self._seen_max or None

    def refresh(self, now: float | None = None) -> float | None:
        """Re-read the signal now (normally done by `weights` once per period)."""
        now = self.clock() if now is None else now
        if self.forecast_horizon_s is None:
            value = self.signal.intensity(now)
        else:
            value = self.signal.mean_intensity(now, now + self.forecast_horizon_s)
        if value is not None:
            if self.intensity is None or value != self.intensity:
                logger.info(
                    "carbon intensity %.1f gCO2/kWh (max %.1f)",
                    value,
                    max(value, self.max_carbon or 0),
                )
            self.intensity = value
            self._seen_max = max(self._seen_max, value)
        self._next_refresh = now + (
            self.period_s if value is not None else min(self.period_s, NO_READING_RETRY_S)
        )
        return self.intensity

    def weights(self) -> CostWeights | None:
        now = self.clock()
        if self._next_refresh is None or now >= self._next_refresh:
            self.refresh(now)
        max_carbon = self.max_carbon
        if self.intensity is None or not max_carbon:
            return None
        return CostWeights(
            self.eta * self.intensity, (1.0 - self.eta) * self.max_power_w * max_carbon
        )

    def close(self) -> None:
        self.signal.close()


@dataclass
class CarbonReport:
    """Emissions accounted so far. `saved` is against running every iteration at the baseline
    (all clocks at max, what training does without perseus-ext) at the same intensity."""

    iterations: int = 0
    energy_j: float = 0.0
    baseline_energy_j: float = 0.0
    kg_emitted: float = 0.0
    kg_saved: float = 0.0
    unaccounted_energy_j: float = 0.0  # energy spent before any intensity reading

    def summary(self) -> str:
        return (
            f"{self.iterations} iterations: {self.kg_emitted:.4f} kgCO2 emitted, "
            f"{self.kg_saved:.4f} kgCO2 saved vs. all-max-clock"
        )


class CarbonLedger:
    """Accumulates kgCO2 from per-iteration energy at the cost's current intensity."""

    def __init__(self, cost: CarbonCost):
        self.cost = cost
        self.report = CarbonReport()

    def record_iteration(self, energy_j: float, baseline_energy_j: float) -> None:
        """`energy_j`: what the iteration used; `baseline_energy_j`: what it would have used
        at all-max clocks (the frontier's `baseline.energy`, or the max power limit's energy)."""
        report = self.report
        report.iterations += 1
        report.energy_j += energy_j
        report.baseline_energy_j += baseline_energy_j
        intensity = self.cost.intensity
        if intensity is None:
            report.unaccounted_energy_j += energy_j
            return
        grams_per_joule = intensity / JOULES_PER_KWH
        report.kg_emitted += energy_j * grams_per_joule / 1000.0
        report.kg_saved += (baseline_energy_j - energy_j) * grams_per_joule / 1000.0


class ChasePolicy(CostPolicy):
    """Chase on the Perseus frontier. `max_power_w` is one GPU's max power limit (an S-stage
    pipeline's time is priced at S x gpus_per_stage x max_power_w). Call `record_iteration`
    once per iteration to account emissions; `report` holds the totals."""

    name = "chase"

    def __init__(self, cost: CarbonCost, gpus_per_stage: int = 1):
        super().__init__(cost, gpus_per_stage)
        self.ledger = CarbonLedger(cost)
        self._last_baseline_j: float | None = None

    @property
    def report(self) -> CarbonReport:
        return self.ledger.report

    def select(self, frontier: Frontier, straggler_time: float | None) -> Plan:
        self._last_baseline_j = frontier.baseline.energy
        return super().select(frontier, straggler_time)

    def record_iteration(self, energy_j: float, baseline_energy_j: float | None = None) -> None:
        """Account one iteration; the baseline defaults to the last frontier's baseline energy."""
        if baseline_energy_j is None:
            if self._last_baseline_j is None:
                raise ValueError(
                    "record_iteration needs baseline_energy_j before the first select()"
                )
            baseline_energy_j = self._last_baseline_j
        self.ledger.record_iteration(energy_j, baseline_energy_j)

    def close(self) -> None:
        if self.report.iterations:
            logger.info("chase: %s", self.report.summary())
        super().close()
