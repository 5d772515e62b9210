"""Swing-capped plans: the cheapest plans whose pipeline power swing stays under a cap.

The cap is a fraction of the all-max-clock plan's pipeline swing (peak-to-trough of the planning
model's power over one iteration without the gradient sync, `power_swing.py`). A plan meets it
with two means, both paid for in its energy:

* its clocks: slower clocks where the pipeline's power peaks (every GPU busy) lower the peak,
  faster ones where it is low (fill and drain) raise the trough;
* a filler: dummy work on GPUs that wait, at the power stated per segment of the iteration
  (`Filler`), just enough to lift the trough to the peak minus the cap; each waiting GPU draws
  at most `filler_max_w` (by default the highest power of any profiled computation, a power the
  GPU is known to reach). Its energy is counted in the plan's energy.

Method, and why. The exact problem (clocks and filler that minimise energy under a deadline and
a swing cap) couples every computation's start time with the power at every instant: as a MILP
it needs, per time slot, which computations run in it, i.e. big-M indicator variables for
slots × computations on top of computations × clocks (1 ms slots: ~3,000 × 192 × 38 at 8 × 12),
far beyond what HiGHS solves in a command's time. But given the clocks, the best filler is
exact and cheap: lift everything below (peak - cap) to it. So the search is over clocks only,
from the uncapped frontier's plans (the cheapest clocks at every deadline): each is first given
its exact filler, then, at a few deadlines (`_DESCENT_DEADLINES` × T_min, the minimum-energy
plan's and any the caller names), a descent over clock moves improves the best of several seeds.
Seeds: the cheapest plan within the deadline, the cheapest within 1-3 % less (slack the descent
spends on trimming the peak; under a clock-change budget the uncapped plans at one deadline
differ a lot in how their runs fall) and the one of least peak; each is screened by one short
descent and the best is improved. Moves step by `_STEPS` clock options: one computation; under
a budget each run of computations at one clock; each stage and the whole pipeline; the
computations running at the peak and those running below the floor, together and per stage
(a plateau of equal peaks, the steady state, falls only when all of it moves); and a run
boundary shifted by one computation. All moves of a round are evaluated at once as columns of
one matrix. A plateau also hides the gain of lowering any one peak, so the descent works at a
fixed ceiling U: it minimises energy + filler up to (U - cap) + a steep penalty on power above U
and on power below the floor that no waiting GPU can fill (integrals, so every move that trims
the plateau counts), at ceilings 0-10 % of the all-max swing below the plan's own peak,
re-centred on the improved plan's peak while that pays. Each round applies the best prefix of
its improving moves (best first, one per first computation moved). Every plan kept is then
re-evaluated with its own peak and exact filler, and only Pareto-optimal (time, energy) plans
are returned: claimed time, energy and swing are that replay (`tests/test_power_swing.py`
replays them independently). Where no plan meets the cap (e.g. `filler_max_w` at the blocking
power: GPUs that cannot run dummy work, clocks alone), the one plan of least swing is returned,
its swing as it is and `meets_cap` False, rather than an error.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perseus_ext.errors import SolverError
from perseus_ext.planning.clock_budget import clock_figures
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import ClockFigures, Frontier, Plan
from perseus_ext.planning.options import ClockBudget
from perseus_ext.planning.power_swing import SwingFigures, choices_of, plan_power_traces
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import PipelineSchedule
from perseus_ext.planning.swing_search import SHORTFALL_WS, Evaluator, search, search_deadlines


@dataclass(frozen=True, eq=False)
class Filler:
    """Dummy work at a stated power: from `breakpoints_s[k]` to `breakpoints_s[k + 1]` the
    waiting GPUs together draw `power_w[k]` watts more than their blocking power (0: none)."""

    breakpoints_s: np.ndarray
    power_w: np.ndarray

    @property
    def energy_j(self) -> float:
        return float(np.dot(np.diff(self.breakpoints_s), self.power_w))


@dataclass(frozen=True, eq=False)
class CappedPlan:
    """A plan with its filler: `plan.energy` counts the clocks' energy and the filler's."""

    plan: Plan
    clock_energy_j: float
    filler: Filler
    swing: SwingFigures  # the pipeline's swing, filler included
    # False: neither its clocks nor the filler the waiting GPUs can draw (`filler_max_w`) bring
    # the swing under the cap; `swing` is then what the plan has (with as much filler as helps).
    meets_cap: bool = True


@dataclass(frozen=True, eq=False)
class CappedFrontier:
    """Pareto-optimal swing-capped plans; `frontier.plans[k]` is `plans[k].plan`."""

    frontier: Frontier
    plans: tuple[CappedPlan, ...]
    cap_fraction: float
    cap_w: float
    reference: SwingFigures  # the all-max-clock plan's swing the cap is a fraction of

    @property
    def meets_cap(self) -> bool:
        """Whether every plan meets the cap (else the frontier is the one plan of least swing
        found, `CappedPlan.meets_cap` False)."""
        return all(p.meets_cap for p in self.plans)


def all_max_swing(schedule: PipelineSchedule, profile: Profile, blocking_power: float) -> SwingFigures:
    """The pipeline swing of every computation at its fastest clock (the reference of a cap)."""
    model = CostModel(schedule, profile, blocking_power)
    return plan_power_traces(model, model.fastest_choice())[0].figures()


def highest_power_w(profile: Profile) -> float:
    """The highest power of any profiled computation: what a GPU is known to reach."""
    return float(max((op.energies / op.times).max() for op in profile.points.values()))


def capped_frontier(
    frontier: Frontier,
    schedule: PipelineSchedule,
    profile: Profile,
    cap_fraction: float,
    switch_latency_s: float = 0.0,
    *,
    filler_max_w: float | None = None,
    deadlines_s: tuple[float, ...] = (),
    clock_budget: ClockBudget | None = None,
) -> CappedFrontier:
    """The Pareto-optimal plans whose pipeline swing is at most `cap_fraction` of the
    all-max-clock plan's, from `frontier` (solved for `schedule` on `profile`, uncapped) by the
    method of the module docstring. `deadlines_s`: more deadlines for the search (e.g. the
    one a caller will look up; a default deadline within 0.5 % of one is dropped).
    `clock_budget`: every plan keeps it too. `filler_max_w`: the most one waiting GPU draws
    with dummy work (the blocking power: no filler, clocks only). When no plan meets the cap,
    the result holds the one plan of least swing with `meets_cap` False (`CappedFrontier.meets_cap`).
    """
    if not (np.isfinite(cap_fraction) and 0 <= cap_fraction <= 1):
        raise SolverError(f"solver option power_swing_cap must be a fraction in [0, 1], got {cap_fraction!r}")
    blocking_power = frontier.blocking_power
    reference = all_max_swing(schedule, profile, blocking_power)
    cap_w = cap_fraction * reference.peak_to_trough_w
    # Every measured clock: frontier plans may hold clocks the useful-clock filter drops (a
    # group of computations sharing one clock), and a clock no plan gains from in energy can
    # still trim a peak.
    model = CostModel(schedule, profile, blocking_power, switch_latency_s)
    filler_max_w = highest_power_w(profile) if filler_max_w is None else filler_max_w
    evaluator = Evaluator(model, cap_w, filler_max_w, clock_budget, reference.peak_to_trough_w)

    ordinary = frontier.ordinary_plans
    choices = choices_of(model, ordinary)
    pool = np.concatenate([choices] + [
        plan[:, None] for deadline in search_deadlines(frontier, deadlines_s)
        for plan in search(evaluator, choices, evaluator.evaluate(choices), deadline)
    ], axis=1)
    result = evaluator.evaluate(pool)
    meets = result.shortfalls <= SHORTFALL_WS
    if meets.any():
        keep = np.flatnonzero(meets)[_pareto(result.times[meets], result.totals[meets])]
    else:
        # No plan meets the cap: the one of least swing, with as much filler as the waiting GPUs draw.
        swings = [evaluator.filler(pool[:, column])[2].figures().peak_to_trough_w for column in range(pool.shape[1])]
        keep = np.array([int(np.lexsort((result.totals, swings))[0])])
    plans = []
    rate, hold = clock_figures(model, pool[:, keep])
    for column, changes_per_s, shortest_hold_s in zip(keep.tolist(), rate.tolist(), hold.tolist()):
        choice = pool[:, column]
        breakpoints, extra, trace = evaluator.filler(choice)
        filler = Filler(breakpoints, extra)
        clocks = model.to_plan(choice)
        plans.append(CappedPlan(
            Plan(clocks.time, clocks.energy + filler.energy_j, clocks.frequencies,
                 ClockFigures(changes_per_s, shortest_hold_s)),
            clocks.energy, filler, trace.figures(), bool(meets[column]),
        ))
    capped = Frontier(frontier.schedule, blocking_power, tuple(p.plan for p in plans), frontier.baseline)
    return CappedFrontier(capped, tuple(plans), float(cap_fraction), cap_w, reference)


def _pareto(times: np.ndarray, energies: np.ndarray) -> np.ndarray:
    """Indices of the finite plans no other plan beats in time and energy, by time (times
    strictly increase, energies strictly decrease)."""
    finite = np.flatnonzero(np.isfinite(energies))
    order = finite[np.lexsort((energies[finite], times[finite]))]
    keep, best = [], np.inf
    for index in order.tolist():
        if energies[index] < best - 1e-9:
            keep.append(index)
            best = energies[index]
    return np.array(keep, dtype=np.int64)


def all_max_with_floor(
    schedule: PipelineSchedule, profile: Profile, blocking_power: float, cap_fraction: float,
    filler_max_w: float | None = None,
) -> float:
    """Energy (J) of every computation at its fastest clock plus the least dummy work that
    meets the same cap (the remedy without perseus-ext); inf when the waiting GPUs cannot
    draw enough."""
    reference = all_max_swing(schedule, profile, blocking_power)
    model = CostModel(schedule, profile, blocking_power)
    filler_max_w = highest_power_w(profile) if filler_max_w is None else filler_max_w
    evaluator = Evaluator(model, cap_fraction * reference.peak_to_trough_w, filler_max_w, None,
                           reference.peak_to_trough_w)
    result = evaluator.evaluate(model.fastest_choice()[:, None])
    if result.shortfalls[0] > SHORTFALL_WS:
        return float("inf")
    return float(result.clock_energies[0] + result.filler_energies[0])
