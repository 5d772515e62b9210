"""A whole frontier with its small clock changes merged away (`with_fewer_switches`): the
frontier-level pass over `switching.merge_switches`, after the wait-aware extension, which it
Pareto-filters again the same way. Its own module because it needs both the per-plan merge
(`switching.py`, which the solver uses) and the wait-aware plan sets (`wait_aware.py`, which
uses the solver)."""

from __future__ import annotations

import dataclasses

import numpy as np

from perseus_ext.planning.clock_budget import with_figures
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import Frontier
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import PipelineSchedule
from perseus_ext.planning.switching import merge_switches
from perseus_ext.planning.wait_aware import distinct_plans, pareto_plans

CHUNK_CELLS = 400_000  # computations x plans merged at once by `with_fewer_switches`


def with_fewer_switches(frontier: Frontier, schedule: PipelineSchedule, profile: Profile,
                        blocking_power: float, switch_latency_s: float, switch_cost_j: float) -> Frontier:
    """`frontier` with every plan's changes merged away where they save less than
    `switch_cost_j` each (`merge_switches`), then Pareto-filtered again: the ordinary plans in
    time and energy, the wait-aware extension in time and energy - S x P_block x time.

    `profile` is the measured profile the frontier was solved from (it has every clock a plan
    may use); no plan gets slower, and every plan reports its exact replay.
    """
    if switch_cost_j <= 0:
        return frontier
    # Every measured clock: plans solved within a clock-change budget use clocks common to runs
    # of computations, which one computation's useful clocks may lack.
    model = CostModel(schedule, profile, blocking_power, switch_latency_s)
    plans = frontier.plans
    choices = np.stack([model.choice_of(plan) for plan in plans], axis=1)
    deadlines = np.array([plan.time for plan in plans])
    width = max(1, CHUNK_CELLS // len(choices))  # plans per batch: the replays stay in cache
    merged = np.concatenate([
        merge_switches(model, choices[:, i:i + width], deadlines[i:i + width], switch_cost_j=switch_cost_j)
        for i in range(0, len(plans), width)], axis=1)
    changed = np.flatnonzero((merged != choices).any(axis=0))
    if not changed.size:
        return frontier
    times, energies = model.replay(merged[:, changed])
    thinned = list(plans)
    made = with_figures(model, merged[:, changed], model.make_plans(merged[:, changed], times, energies))
    for column, plan in zip(changed, made):
        # A merge moves a change, which can shorten a hold: a plan solved within a clock-change
        # budget keeps it only if the merge changes clocks no more often (`clock_budget.py`).
        before = plans[column].clock
        if before is None or (plan.clock.changes_per_s <= before.changes_per_s
                              and plan.clock.shortest_hold_s >= before.shortest_hold_s - 1e-12):
            thinned[column] = plan
    ordinary = pareto_plans(distinct_plans(thinned), 0.0)  # from every plan, as the solver does
    slope = len(frontier.fastest.frequencies) * frontier.blocking_power
    if frontier.extension_start is None:
        return dataclasses.replace(frontier, plans=tuple(ordinary))
    chosen = {plan.frequencies.tobytes() for plan in ordinary}
    extension = [plan for plan in pareto_plans(distinct_plans(thinned), slope)
                 if plan.frequencies.tobytes() not in chosen]
    return dataclasses.replace(frontier, plans=tuple(ordinary) + tuple(extension), extension_start=len(ordinary))
