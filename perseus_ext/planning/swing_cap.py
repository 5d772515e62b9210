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
plan's and any the caller names), the cheapest of them is improved by a descent over clock
moves of one computation (and, under a clock-change budget, of each run of computations at one
clock), all moves of a round evaluated at once as columns of one matrix. A plateau of equal
peaks (the steady state repeats) hides the gain of lowering any one of them, so the descent
works at a fixed ceiling U: it minimises energy + filler up to (U - cap) + a steep penalty on
power above U and on power below the floor that no waiting GPU can fill (integrals, so every
move that trims the plateau counts), at ceilings just below the plan's own peak, re-centred on
the improved plan's peak while that pays. Each round applies the best prefix of its improving
moves (best first, one per computation). Every plan kept is then re-evaluated with its own peak
and exact filler, and only Pareto-optimal (time, energy) plans are returned: claimed time,
energy and swing are that replay (`tests/test_power_swing.py` replays them independently).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from perseus_ext.errors import SolverError
from perseus_ext.planning.clock_budget import clock_figures
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import ClockFigures, Frontier, Plan
from perseus_ext.planning.power_swing import (
    PowerTrace,
    SwingFigures,
    choices_of,
    computation_power,
    piecewise_power,
    plan_power_traces,
)
from perseus_ext.planning.options import ClockBudget
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import PipelineSchedule

_MIN_SEGMENT_S = 1e-9  # shorter segments are simultaneous events, not power the site sees
_PENALTY = 50.0  # what a watt-second above the ceiling costs the descent, in joules
_STEPS = (1, 3, 8)  # clock-option steps a move tries, each way
_ROUNDS = 60  # descent rounds at one ceiling
_TOP_MOVES = 96  # improving moves per round checked against the clock-change budget and combined
_CEILING_STEPS_W = (0.0, -20.0, -50.0)  # ceilings tried below the plan's own peak
_RESTARTS = 3  # times the ceilings are re-centred on the improved plan's peak
# Deadlines the descent targets, as multiples of T_min (up to the minimum-energy plan's time,
# which is targeted too); every other frontier plan keeps its clocks and gets its filler.
_DESCENT_DEADLINES = (1.0, 1.05, 1.1)
_DEADLINE_EPS_S = 1e-12


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


@dataclass(frozen=True, eq=False)
class CappedFrontier:
    """Pareto-optimal swing-capped plans; `frontier.plans[k]` is `plans[k].plan`."""

    frontier: Frontier
    plans: tuple[CappedPlan, ...]
    cap_fraction: float
    cap_w: float
    reference: SwingFigures  # the all-max-clock plan's swing the cap is a fraction of


@dataclass(frozen=True)
class _Evaluated:
    """Figures of candidate plans (columns), exact on the planning model."""

    times: np.ndarray
    clock_energies: np.ndarray
    peaks: np.ndarray
    filler_energies: np.ndarray  # filler up to each plan's own peak - cap (inf: not enough idle GPUs)
    objective: np.ndarray  # what the descent minimises at its ceiling


class _Evaluator:
    """Exact figures of candidate plans at one cap, and which candidates a search may keep."""

    def __init__(self, model: CostModel, cap_w: float, filler_max_w: float, budget: ClockBudget | None):
        self.model = model
        self.cap_w = cap_w
        self.filler_headroom_w = max(0.0, filler_max_w - model.blocking_power)
        self.budget = budget if budget is not None and budget.active else None

    def admissible(self, choices: np.ndarray, result: "_Evaluated", deadline: float) -> np.ndarray:
        """Candidates that meet `deadline` and the clock-change budget (if any)."""
        fits = result.times <= deadline + _DEADLINE_EPS_S
        if self.budget is None or not fits.any():
            return fits
        # The solver's own rule (`ClockBudget.hold_s`): every clock held at least 1 / the rate,
        # not only at most that many changes in a second (no bursts of short holds).
        rate, hold = clock_figures(self.model, choices[:, fits])
        fits[np.flatnonzero(fits)] = [
            self.budget.allows(r, h) and h >= self.budget.hold_s - 1e-9 for r, h in zip(rate.tolist(), hold.tolist())
        ]
        return fits

    def segments(self, choices: np.ndarray):
        """(times, clock energies, segment lengths, power, waiting GPUs) of plans as columns;
        the last three plan-major (plans, segments)."""
        model = self.model
        starts, finishes, power = computation_power(model, choices)
        times = finishes.max(axis=0)
        breakpoints, level, busy = piecewise_power(
            starts, finishes, power, model.blocking_power, model.num_stage_gpus, times
        )
        lengths = np.diff(breakpoints, axis=1)
        energies = (lengths * level).sum(axis=1)
        return times, energies, lengths, level, np.maximum(model.num_stage_gpus - np.rint(busy), 0)

    def evaluate(self, choices: np.ndarray, ceiling: np.ndarray | None = None) -> _Evaluated:
        times, energies, lengths, level, idle = self.segments(choices)
        real = lengths > _MIN_SEGMENT_S
        peaks = np.where(real, level, -np.inf).max(axis=1)
        filler_energy = self._filler(lengths, level, idle, real, peaks - self.cap_w)
        if ceiling is None:
            objective = energies + filler_energy
        else:
            # Power above the ceiling, and power below the floor that no waiting GPU can fill,
            # are what the descent must remove: both are charged steeply.
            floor = (ceiling - self.cap_w)[:, None]
            deficit = np.where(real, np.clip(floor - level, 0.0, None), 0.0)
            fillable = np.minimum(deficit, idle * self.filler_headroom_w)
            excess = np.where(real, np.clip(level - ceiling[:, None], 0.0, None), 0.0) + (deficit - fillable)
            objective = energies + (lengths * (fillable + _PENALTY * excess)).sum(axis=1)
        return _Evaluated(times, energies, peaks, filler_energy, objective)

    def _filler(self, lengths, level, idle, real, floor) -> np.ndarray:
        deficit = np.where(real, np.clip(floor[:, None] - level, 0.0, None), 0.0)
        short = (deficit > idle * self.filler_headroom_w + 1e-9).any(axis=1)
        return np.where(short, np.inf, (lengths * deficit).sum(axis=1))

    def filler(self, choice: np.ndarray) -> tuple[Filler, PowerTrace]:
        """The filler of one plan and its pipeline power with the filler."""
        _, _, lengths, level, _ = self.segments(choice[:, None])
        lengths, level = lengths[0], level[0]
        breakpoints = np.concatenate([[0.0], np.cumsum(lengths)])
        real = lengths > _MIN_SEGMENT_S
        floor = level[real].max() - self.cap_w
        extra = np.where(real, np.clip(floor - level, 0.0, None), 0.0)
        return Filler(breakpoints, extra), PowerTrace(breakpoints, level + extra)


def _moves(model, choice: np.ndarray, whole_runs: bool) -> np.ndarray:
    """Every move of `choice` by `_STEPS` clock options either way, as columns (N, moves):
    of one computation and, with `whole_runs`, of each run of consecutive computations of a
    stage at one clock (a plan under a clock-change budget moves mostly whole runs)."""
    last = model.num_options - 1
    runs = [np.array([node]) for node in range(model.num_nodes)]
    if whole_runs:
        clocks = model.frequencies[np.arange(model.num_nodes), choice]
        for pos in model.dag.stage_positions:
            cuts = np.flatnonzero(clocks[pos][1:] != clocks[pos][:-1]) + 1
            runs += [run for run in np.split(pos, cuts) if len(run) > 1]
    columns = []
    for step in _STEPS:
        for sign in (-1, 1):
            for run in runs:
                target = np.clip(choice[run] + sign * step, 0, last[run])
                if np.any(target != choice[run]):
                    column = choice.copy()
                    column[run] = target
                    columns.append(column)
    return np.stack(columns, axis=1) if columns else choice[:, None].copy()


def _subset(result: _Evaluated, columns: np.ndarray) -> _Evaluated:
    return _Evaluated(*(getattr(result, f.name)[columns] for f in dataclasses.fields(result)))


def descend(evaluator: _Evaluator, choice: np.ndarray, deadline: float, ceiling: float) -> np.ndarray:
    """Steepest descent of the ceiling objective over the moves of `_moves` that keep the
    deadline (and the clock-change budget): each round takes the best prefix of the round's
    improving moves, best first, one per computation (one more batch), until none improves."""
    current = choice.copy()
    value = float(evaluator.evaluate(current[:, None], np.array([ceiling])).objective[0])
    for _ in range(_ROUNDS):
        candidates = _moves(evaluator.model, current, evaluator.budget is not None)
        result = evaluator.evaluate(candidates, np.full(candidates.shape[1], ceiling))
        gain = value - np.where(result.times <= deadline + _DEADLINE_EPS_S, result.objective, np.inf)
        order = np.argsort(-gain)
        order = order[gain[order] > 1e-9][:_TOP_MOVES]
        # The budget is checked on the best moves only (its replay costs more than the figures).
        order = order[evaluator.admissible(candidates[:, order], _subset(result, order), deadline)]
        if not order.size:
            break
        changed = np.argmax(candidates[:, order] != current[:, None], axis=0)  # each move's first computation
        _, first = np.unique(changed, return_index=True)
        picked = order[np.sort(first)]  # the best move of each computation, best first
        prefixes = np.repeat(current[:, None], picked.size, axis=1)
        for k, column in enumerate(picked.tolist()):
            moved = candidates[:, column] != current
            prefixes[moved, k:] = candidates[moved, column][:, None]
        combined = evaluator.evaluate(prefixes, np.full(picked.size, ceiling))
        combined_value = np.where(evaluator.admissible(prefixes, combined, deadline), combined.objective, np.inf)
        best = int(np.argmin(combined_value))
        if combined_value[best] >= value - 1e-9:
            break
        current, value = prefixes[:, best].copy(), float(combined_value[best])
    return current


def improve(evaluator: _Evaluator, choice: np.ndarray, deadline: float) -> np.ndarray:
    """The cheapest plan (energy + filler) the ceiling descents find from `choice` within
    `deadline`: descents at ceilings just below the plan's own peak, re-centred on the
    improved plan's peak while that keeps paying."""
    best = choice.copy()
    best_value, best_peak = _total(evaluator, best)
    for _ in range(_RESTARTS):
        tried = [descend(evaluator, best, deadline, best_peak + step) for step in _CEILING_STEPS_W]
        totals = [_total(evaluator, plan) for plan in tried]
        k = int(np.argmin([value for value, _ in totals]))
        if totals[k][0] >= best_value - 1e-6:
            break
        best, (best_value, best_peak) = tried[k], totals[k]
    return best


def _total(evaluator: _Evaluator, choice: np.ndarray) -> tuple[float, float]:
    """(energy + exact filler, peak) of one plan; the peak is +inf when no plan exists."""
    result = evaluator.evaluate(choice[:, None])
    return float(result.clock_energies[0] + result.filler_energies[0]), float(result.peaks[0])


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
    method of the module docstring. `deadlines_s`: more deadlines for the descent (e.g. the
    one a caller will look up). `clock_budget`: every plan keeps it too (the descent then moves
    whole runs of one clock, and drops moves that break it). Raises `SolverError` naming `power_swing_cap` when no plan can
    meet the cap (the waiting GPUs cannot draw enough to lift the trough).
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
    evaluator = _Evaluator(model, cap_w, filler_max_w, clock_budget)

    ordinary = frontier.ordinary_plans
    choices = choices_of(model, ordinary)
    start = evaluator.evaluate(choices)
    totals = start.clock_energies + start.filler_energies
    t_min, t_least = ordinary[0].time, frontier.min_energy.time
    targets = sorted({min(t_min * factor, t_least) for factor in _DESCENT_DEADLINES}
                     | {t_least} | {d for d in deadlines_s if t_min <= d})
    found = [choices]
    for deadline in targets:
        fits = np.flatnonzero((start.times <= deadline + _DEADLINE_EPS_S) & np.isfinite(totals))
        if fits.size:
            found.append(improve(evaluator, choices[:, fits[np.argmin(totals[fits])]], deadline)[:, None])
    pool = np.concatenate(found, axis=1)
    result = evaluator.evaluate(pool)
    totals = result.clock_energies + result.filler_energies
    keep = _pareto(result.times, totals)
    if not keep.size:
        raise SolverError(
            f"no plan meets solver option power_swing_cap {cap_fraction:g} ({cap_w:.0f} W of the all-max-clock "
            f"swing {reference.peak_to_trough_w:.0f} W): the waiting GPUs cannot draw enough to lift the trough "
            "(each at most the highest profiled power); raise the cap"
        )
    plans = []
    rate, hold = clock_figures(model, pool[:, keep])
    for column, changes_per_s, shortest_hold_s in zip(keep.tolist(), rate.tolist(), hold.tolist()):
        choice = pool[:, column]
        filler, trace = evaluator.filler(choice)
        clocks = model.to_plan(choice)
        plans.append(CappedPlan(
            Plan(clocks.time, clocks.energy + filler.energy_j, clocks.frequencies,
                 ClockFigures(changes_per_s, shortest_hold_s)),
            clocks.energy, filler, trace.figures(),
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
    evaluator = _Evaluator(model, cap_fraction * reference.peak_to_trough_w, filler_max_w, None)
    return _total(evaluator, model.fastest_choice())[0]

