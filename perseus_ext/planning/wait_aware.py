"""Wait-aware planning: the cheapest plan when the iteration is held to a deadline T' anyway.

When another pipeline straggles (or a slowdown is announced, or a cost policy accepts a longer
iteration), this pipeline's iteration ends at T' whatever its plan: a plan finishing at T <= T'
then blocks its S stages at the gradient sync for T' - T. Its cost is

    E(plan) + P_block S (T' - T) = sum_c (e_c - P_block t_c) + P_block S T',

so for a fixed T' the cheapest plan minimises sum_c (e_c - P_block t_c) subject to T <= T'.
That is the cost the frontier solver minimises at every deadline already (its LP, rounding and
slack reclaim work on e - P_block t, on the clocks useful in it: `Profile.useful_clocks`), so
`solve_frontier(..., wait_aware=True)` continues its deadline grid past the minimum-energy plan
T* to the all-slowest plan and appends the plans Pareto-optimal in (T, E - P_block S T) as the
frontier's extension (`Frontier.extension_start`). This module holds what the policies need to
choose among them.
"""

from __future__ import annotations

import numpy as np

from perseus_ext.planning.frontier import Frontier, Plan
from perseus_ext.planning.profile import pareto_indices

_EPS_J = 1e-9  # an extension plan must undercut the previous one by more than this (joules)


def waiting_energy(frontier: Frontier, plan: Plan, deadline: float) -> float:
    """Energy of one iteration held to `deadline` with `plan`: the plan's own energy plus its
    stages blocked at the sync until the deadline (joules; `frontier.blocking_power` is per
    stage)."""
    stages = len(plan.frequencies)
    return plan.energy + stages * frontier.blocking_power * max(0.0, deadline - plan.time)


def plan_ending_at(frontier: Frontier, deadline: float) -> Plan:
    """The cheapest plan for an iteration that ends at `deadline` anyway: least
    `waiting_energy` among the plans that finish by then (the fastest plan if none does).

    Never slower than the deadline; on an ordinary frontier this is `plan_for_deadline`. Ties
    go to the faster plan.
    """
    best, best_energy = frontier.fastest, waiting_energy(frontier, frontier.fastest, deadline)
    for plan in frontier.plans:
        if plan.time <= deadline:
            energy = waiting_energy(frontier, plan, deadline)
            if energy < best_energy - _EPS_J:
                best, best_energy = plan, energy
    return best


def distinct_plans(plans: list[Plan]) -> list[Plan]:
    """Plans with distinct clocks, the first of each kept."""
    seen: set[bytes] = set()
    kept = []
    for plan in plans:
        key = plan.frequencies.tobytes()
        if key not in seen:
            seen.add(key)
            kept.append(plan)
    return kept


def pareto_plans(plans: list[Plan], slope: float) -> list[Plan]:
    """Plans Pareto-optimal in (time, energy - slope x time), by time; times equal to 1e-12 s
    count as equal (replays along one critical path differ by rounding)."""
    times = np.round([p.time for p in plans], 12)
    costs = np.array([p.energy for p in plans]) - slope * times
    return [plans[i] for i in pareto_indices(times, costs, tolerance=_EPS_J)]
