"""Wait-aware planning: the cheapest plan when the iteration is held to a deadline T' anyway.

When another pipeline straggles (or a slowdown is announced, or a cost policy accepts a longer
iteration), this pipeline's iteration ends at T' whatever its plan: a plan finishing at T <= T'
then blocks its S stages at the gradient sync for T' - T. Its cost is

    E(plan) + P_block S (T' - T) = sum_c (e_c - P_block t_c) + P_block S T',

so for a fixed T' the cheapest plan minimises sum_c (e_c - P_block t_c) subject to T <= T'.
Below the ordinary frontier's minimum-energy plan T* the ordinary frontier already answers
this; past T* it stops (its energy rises), and the profile's Pareto filter has dropped the
clocks whose energy rises as the clock falls, which can still be worth running when their
extra energy is less than the blocking energy they replace.

Method: the same solver on a transformed problem. Per computation keep the clocks that are
Pareto-optimal in (t, e - P_block t) (`wait_useful_profile`), and give each the energy
e'' = e - P_block t + P_block t_slowest (positive: e - P_block t falls as t grows) with blocking
power 0 (`waiting_cost_profile`). Plans then cost sum_c e''_c = sum_c (e_c - P_block t_c) +
constant, under the latency-aware replay too (the constant per computation is unchanged and
P_block times a computation's replayed duration is what the blocking term adds back), so the
transformed frontier is Pareto-optimal in (T, E - P_block S T) from T_min to the all-slowest
plan. Every extension plan is then replayed on the true profile and blocking power, so its
reported time and energy are exact (as for every other plan).
"""

from __future__ import annotations

import logging

import numpy as np

from perseus_ext.errors import SolverError
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import Frontier, Plan
from perseus_ext.planning.options import SolverOptions
from perseus_ext.planning.profile import OperatingPoints, Profile, pareto_indices
from perseus_ext.planning.schedule import PipelineSchedule
from perseus_ext.planning.solver import solve_frontier

logger = logging.getLogger(__name__)

_EPS_J = 1e-9  # an extension plan must undercut the previous one by more than this (joules)


def wait_useful_profile(profile: Profile, blocking_power: float) -> Profile:
    """Per (stage, instruction), the clocks no other clock beats in both time and
    energy - `blocking_power` x time: every clock some deadline can make worth running.

    `profile` should be unfiltered (`load_profile(path, pareto=False)`, a runtime's measured
    profile): its Pareto filter (on time and energy) drops clocks this one keeps.
    """
    _check_power(blocking_power)
    points = {}
    for key, op in profile.points.items():
        keep = np.array(pareto_indices(op.times, op.energies - blocking_power * op.times))
        points[key] = OperatingPoints(op.frequencies[keep], op.times[keep], op.energies[keep])
    return Profile(points, profile.source, list(profile.dropped))


def waiting_cost_profile(useful: Profile, blocking_power: float) -> Profile:
    """The transformed profile: energy e - P t + P t_slowest per clock, to plan with blocking
    power 0 (module docstring). `useful` must come from `wait_useful_profile`."""
    _check_power(blocking_power)
    points = {}
    for key, op in useful.points.items():
        shifted = op.energies + blocking_power * (op.times[-1] - op.times)
        points[key] = OperatingPoints(op.frequencies, op.times, shifted)
    return Profile(points, useful.source, list(useful.dropped))


def extend_frontier(
    frontier: Frontier,
    schedule: PipelineSchedule,
    profile: Profile,
    blocking_power: float,
    options: SolverOptions | None = None,
    switch_latency_s: float = 0.0,
) -> Frontier:
    """`frontier` merged with the wait-aware solve: the ordinary plans (Pareto in time and
    energy, up to the minimum-energy plan T*) first, then every other plan that is cheapest for
    some deadline the iteration is held to, by time (mostly past T*).

    `profile` is the pipeline's unfiltered profile and `blocking_power` the one `frontier` was
    solved with (per stage). Wait-useful clocks can also make ordinary plans cheaper (a clock
    whose extra energy is less than the blocking energy it replaces inside the iteration), so
    the ordinary part is the Pareto set of both solves' plans.
    """
    useful = wait_useful_profile(profile, blocking_power)
    transformed = solve_frontier(
        schedule, waiting_cost_profile(useful, blocking_power), 0.0, options,
        switch_latency_s=switch_latency_s,
    )
    true_model = CostModel(schedule, useful, blocking_power, switch_latency_s)
    choices = np.stack([true_model.choice_of(p) for p in transformed.plans], axis=1)
    times, energies = true_model.replay(choices)
    candidates = distinct_plans([*frontier.ordinary_plans, *true_model.make_plans(choices, times, energies)])
    ordinary = pareto_plans(candidates, 0.0)
    chosen = {id(p) for p in ordinary}
    slope = len(frontier.fastest.frequencies) * frontier.blocking_power
    extension = [p for p in pareto_plans(candidates, slope) if id(p) not in chosen]
    if extension:
        logger.info(
            "wait-aware plans: %d beyond the %d ordinary ones, up to T %.4f s (T* %.4f s)",
            len(extension), len(ordinary), extension[-1].time, ordinary[-1].time,
        )
    return Frontier(
        schedule=frontier.schedule,
        blocking_power=frontier.blocking_power,
        plans=tuple(ordinary) + tuple(extension),
        baseline=frontier.baseline,
        extension_start=len(ordinary),
    )


def solve_wait_aware(
    schedule: PipelineSchedule,
    profile: Profile,
    blocking_power: float,
    options: SolverOptions | None = None,
    switch_latency_s: float = 0.0,
) -> Frontier:
    """The ordinary frontier (on `profile.pareto()`) extended with wait-aware plans."""
    frontier = solve_frontier(
        schedule, profile.pareto(), blocking_power, options, switch_latency_s=switch_latency_s
    )
    return extend_frontier(frontier, schedule, profile, blocking_power, options, switch_latency_s)


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


def _check_power(blocking_power: float) -> None:
    if not np.isfinite(blocking_power) or blocking_power < 0:
        raise SolverError(
            f"blocking power must be a non-negative number of watts, got {blocking_power!r}"
        )
