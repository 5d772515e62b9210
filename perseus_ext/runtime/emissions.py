"""Chase's emissions ledger, fed one device record per iteration.

This GPU's energy is priced at the carbon intensity of the moment, against its mean energy per
iteration at default settings (the warm-up and solving iterations; the first one carries one-off
costs). Without such a measurement nothing is claimed saved.
"""

from __future__ import annotations

from typing import Any

from perseus_ext.observability.iteration import IterationRecord


class EmissionsAccount:
    """Routes records to the ledger of whichever policy keeps one (Chase frontier policy, or the
    power-limit mode's carbon ledger)."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.power_limit: Any = None  # set when power-limit mode starts
        self._default_energy_sum = 0.0
        self._default_energy_count = 0

    @property
    def ledger(self) -> Any:
        if self.power_limit is not None and self.power_limit.carbon_ledger is not None:
            return self.power_limit.carbon_ledger
        return self.policy if hasattr(self.policy, "record_iteration") else None

    def on_record(self, record: IterationRecord) -> None:
        energy = record.energy_j
        if energy is None:
            return
        at_default = record.phase.at_default_clocks
        if at_default and record.iteration > 0 and not record.setting.fell_back:
            self._default_energy_sum += energy
            self._default_energy_count += 1
        ledger = self.ledger
        if ledger is None:
            return
        baseline = energy
        if not at_default and self._default_energy_count:
            baseline = self._default_energy_sum / self._default_energy_count
        ledger.record_iteration(energy, baseline)
