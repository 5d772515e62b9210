"""Operating-point policies: which frontier plan a pipeline should run right now.

The runtime and the emulator both call a policy's `select`, so the emulator reports exactly what
the runtime would do.
"""

from __future__ import annotations

import abc

from perseus_ext.planning.frontier import Frontier, Plan
from perseus_ext.planning.wait_aware import plan_ending_at
from perseus_ext.policies.cost import CostWeights, EnergyTimeCost


class OperatingPointPolicy(abc.ABC):
    """Chooses a plan from a frontier given the slowest pipeline's iteration time (if any)."""

    name: str = "policy"
    #: Time-varying policies (Chase) want `select` re-run at least this often, in seconds, even
    #: when no straggler changed; None = the choice only depends on the frontier and straggler.
    period_s: float | None = None

    @abc.abstractmethod
    def select(self, frontier: Frontier, straggler_time: float | None) -> Plan:
        """`straggler_time` is the data-parallel group's slowest iteration time, or None."""

    def close(self) -> None:
        """Release background resources (e.g. a carbon-intensity poller); idempotent."""


class StragglerPolicy(OperatingPointPolicy):
    """Perseus: run the fastest plan (intrinsic bloat removed, no slowdown); when another
    pipeline straggles, the cheapest plan for an iteration that ends at the straggler's time
    anyway (its energy plus the blocking energy of waiting for the straggler). On a wait-aware
    frontier that may be slower than the minimum-energy plan, never slower than the straggler."""

    name = "perseus"

    def __init__(self, wait_aware: bool = True) -> None:
        """`wait_aware=False` never goes past the minimum-energy plan T* (Perseus before
        wait-aware planning): the yardstick the wait-aware plans are measured against."""
        self.wait_aware = wait_aware

    def select(self, frontier: Frontier, straggler_time: float | None) -> Plan:
        if straggler_time is None:
            return frontier.fastest
        if not self.wait_aware:
            return frontier.plan_for_deadline(straggler_time)
        return plan_ending_at(frontier, straggler_time)


def min_cost_plan(
    frontier: Frontier, straggler_time: float | None, weights: CostWeights, gpus_per_stage: int = 1
) -> Plan:
    """The frontier plan minimising `weights`' cost for one pipeline of S = len(plan.frequencies)
    stages of `gpus_per_stage` GPUs each (1 for the runtime's per-GPU frontier; TP for a frontier
    whose plan energies cover a stage's TP GPUs, like the emulator's).

    A straggler caps useful speed: the data-parallel iteration takes at least `straggler_time`,
    so a plan finishing earlier is charged the straggler's time, plus the energy its S stages
    burn at the frontier's blocking power while waiting. Hence a plan faster than needed never
    beats the cheapest plan that meets the straggler's time. Plans slower than both the
    minimum-energy plan and the straggler are never candidates (they cost more energy and
    time); a wait-aware frontier's plans up to the straggler's time are. Ties go to the plan
    with less energy including the wait, then the faster one, which makes weights with no
    energy term reproduce `StragglerPolicy` exactly.
    """
    floor = 0.0 if straggler_time is None else float(straggler_time)
    num_stages = len(frontier.fastest.frequencies)
    num_gpus = num_stages * gpus_per_stage
    slowest_useful = max(frontier.min_energy.time, floor)

    def cost(plan: Plan) -> tuple[float, float, float]:
        wait = max(0.0, floor - plan.time)
        # frontier.blocking_power is per stage (all of a stage's GPUs), as in the energy model.
        energy = plan.energy + num_stages * frontier.blocking_power * wait
        return (weights.cost(max(plan.time, floor), energy, num_gpus), energy, plan.time)

    return min((p for p in frontier.plans if p.time <= slowest_useful), key=cost)


class CostPolicy(OperatingPointPolicy):
    """Deploys the frontier plan minimising an energy–time cost (Zeus, Chase).

    When the cost cannot be evaluated yet (a carbon signal with no reading) the policy behaves
    like `StragglerPolicy`, i.e. it never slows training down on missing information.
    """

    name = "cost"

    def __init__(self, cost: EnergyTimeCost, gpus_per_stage: int = 1):
        if (
            isinstance(gpus_per_stage, bool)
            or not isinstance(gpus_per_stage, int)
            or gpus_per_stage < 1
        ):
            raise ValueError(f"gpus_per_stage must be a positive integer, got {gpus_per_stage!r}")
        self.cost = cost
        self.gpus_per_stage = gpus_per_stage
        self.period_s = cost.period_s
        self._fallback = StragglerPolicy()

    def select(self, frontier: Frontier, straggler_time: float | None) -> Plan:
        weights = self.cost.weights()
        if weights is None:
            return self._fallback.select(frontier, straggler_time)
        return min_cost_plan(frontier, straggler_time, weights, self.gpus_per_stage)

    def close(self) -> None:
        self.cost.close()
