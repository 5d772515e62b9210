"""Zeus (NSDI'23) on the Perseus frontier: deploy the plan minimising
``eta * Energy + (1 - eta) * MaxPower * Time``."""

from __future__ import annotations

from perseus_ext.policies.base import CostPolicy
from perseus_ext.policies.cost import ZeusCost


class ZeusPolicy(CostPolicy):
    """`max_power_w` is ONE GPU's maximum power limit; for a pipeline of S stages of
    `gpus_per_stage` GPUs the time term is priced at S x gpus_per_stage x max_power_w (the
    plan's energy covers all those GPUs too)."""

    name = "zeus"

    def __init__(self, eta: float, max_power_w: float, gpus_per_stage: int = 1):
        super().__init__(ZeusCost(eta, max_power_w), gpus_per_stage)

    @property
    def eta(self) -> float:
        return self.cost.eta

    @property
    def max_power_w(self) -> float:
        return self.cost.max_power_w
