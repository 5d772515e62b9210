"""The search behind swing-capped plans (`swing_cap.py`, whose docstring says how and why):
exact figures of candidate plans at one cap (`Evaluator`), the clock moves, the ceiling descent
and its seeds (`search`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from perseus_ext.planning.clock_budget import clock_figures
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import Frontier
from perseus_ext.planning.options import ClockBudget
from perseus_ext.planning.power_swing import PowerTrace, computation_power, piecewise_power

_MIN_SEGMENT_S = 1e-9  # shorter segments are simultaneous events, not power the site sees
_PENALTY = 50.0  # what a watt-second above the ceiling costs the descent, in joules
_STEPS = (1, 3, 8)  # clock-option steps a move tries, each way
_PAIRED_STEPS = ((1, 1), (1, 3), (3, 1))  # (slower at the peak, faster at the trough) of a paired move
_ROUNDS = 60  # descent rounds at one ceiling
_TOP_MOVES = 96  # improving moves per round checked against the clock-change budget and combined
# Ceilings tried below the plan's own peak, and power this close to the ceiling counted as the
# peak a phase move trims: fractions of the all-max-clock swing (the scale of the problem).
_CEILING_STEPS = (0.0, -0.02, -0.05, -0.1)
_NEAR_PEAK = 0.004
_RELAXED_DEADLINES = (1.01, 1.03)  # deadlines a descent may overrun before its repair, x the deadline
_OVERRUN_PRICE_J_PER_S = 1e5  # what the repair charges for each second past the deadline
_RESTARTS = 3  # times the ceilings are re-centred on the improved plan's peak
# Deadlines the descent targets, as multiples of T_min (up to the minimum-energy plan's time,
# which is targeted too); every other frontier plan keeps its clocks and gets its filler.
_DESCENT_DEADLINES = (1.0, 1.05, 1.1)
_DEADLINE_EPS_S = 1e-12
_SEED_SLACKS = (0.01, 0.02, 0.03)
_NEAR_DEADLINE = 0.005
_SCREEN_CEILING = -0.02  # the ceiling a seed is screened at below its peak, of the all-max swing
_SCREEN_ROUNDS = 20  # descent rounds of a screen
SHORTFALL_WS = 1e-9  # a plan whose filler falls short by more than this misses the cap


@dataclass(frozen=True)
class Evaluated:
    """Figures of candidate plans (columns), exact on the planning model."""

    times: np.ndarray
    clock_energies: np.ndarray
    peaks: np.ndarray
    filler_energies: np.ndarray  # filler up to each plan's own peak - cap, as far as the waiting GPUs reach
    shortfalls: np.ndarray  # W s below that floor that no waiting GPU can fill (0: the plan meets the cap)
    objective: np.ndarray  # what the descent minimises at its ceiling

    @property
    def totals(self) -> np.ndarray:
        """Energy with the filler, and a steep charge for any shortfall: plans that meet the
        cap first, then the least energy."""
        return self.clock_energies + self.filler_energies + _PENALTY * self.shortfalls


class Evaluator:
    """Exact figures of candidate plans at one cap, and which candidates a search may keep."""

    def __init__(self, model: CostModel, cap_w: float, filler_max_w: float, budget: ClockBudget | None,
                 scale_w: float):
        self.model = model
        self.cap_w = cap_w
        self.scale_w = scale_w  # the all-max-clock swing: the search's steps in watts are fractions of it
        self.filler_headroom_w = max(0.0, filler_max_w - model.blocking_power)
        self.budget = budget if budget is not None and budget.active else None

    def admissible(self, choices: np.ndarray, result: "Evaluated", deadline: float) -> np.ndarray:
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

    def evaluate(self, choices: np.ndarray, ceiling: np.ndarray | None = None) -> Evaluated:
        times, energies, lengths, level, idle = self.segments(choices)
        real = lengths > _MIN_SEGMENT_S
        peaks = np.where(real, level, -np.inf).max(axis=1)
        deficit = np.where(real, np.clip(peaks[:, None] - self.cap_w - level, 0.0, None), 0.0)
        fillable = np.minimum(deficit, idle * self.filler_headroom_w)
        filler_energy = (lengths * fillable).sum(axis=1)
        shortfall = (lengths * (deficit - fillable)).sum(axis=1)
        if ceiling is None:
            objective = energies + filler_energy + _PENALTY * shortfall
        else:
            # Power above the ceiling, and power below the floor that no waiting GPU can fill,
            # are what the descent must remove: both are charged steeply.
            floor = (ceiling - self.cap_w)[:, None]
            deficit = np.where(real, np.clip(floor - level, 0.0, None), 0.0)
            fillable = np.minimum(deficit, idle * self.filler_headroom_w)
            excess = np.where(real, np.clip(level - ceiling[:, None], 0.0, None), 0.0) + (deficit - fillable)
            objective = energies + (lengths * (fillable + _PENALTY * excess)).sum(axis=1)
        return Evaluated(times, energies, peaks, filler_energy, shortfall, objective)

    def filler(self, choice: np.ndarray) -> tuple[np.ndarray, np.ndarray, PowerTrace]:
        """The filler of one plan (up to its peak - cap, as far as the waiting GPUs reach): its
        breakpoints and power (`swing_cap.Filler`), and the pipeline's power with it."""
        _, _, lengths, level, idle = self.segments(choice[:, None])
        lengths, level, idle = lengths[0], level[0], idle[0]
        breakpoints = np.concatenate([[0.0], np.cumsum(lengths)])
        real = lengths > _MIN_SEGMENT_S
        floor = level[real].max() - self.cap_w
        extra = np.where(real, np.minimum(np.clip(floor - level, 0.0, None), idle * self.filler_headroom_w), 0.0)
        return breakpoints, extra, PowerTrace(breakpoints, level + extra)


def _moves(evaluator: "Evaluator", choice: np.ndarray, ceiling: float) -> np.ndarray:
    """Moves of `choice`, as columns (N, moves): `_STEPS` clock options either way for each
    group of computations below, and every computation set to a stage neighbour's clock (a run
    boundary shifted by one computation: a plan under a clock-change budget keeps its runs).

    Groups: each computation; with a budget, each run of consecutive computations of a stage at
    one clock; each stage whole, and all computations; the computations running where the power
    is within `_NEAR_PEAK` of the ceiling (all of them, and those of each stage), and those
    running where it is below the floor (ceiling - cap): whole phases of the iteration, which
    one computation at a time cannot trim (a plateau of equal peaks), widened to whole runs
    under a budget."""
    model = evaluator.model
    last = model.num_options - 1
    nodes = np.arange(model.num_nodes)
    clocks = model.frequencies[nodes, choice]
    whole_runs = evaluator.budget is not None
    run_of = np.empty(model.num_nodes, dtype=np.int64)
    runs = []
    for pos in model.dag.stage_positions:
        cuts = np.flatnonzero(clocks[pos][1:] != clocks[pos][:-1]) + 1
        for run in np.split(pos, cuts):
            run_of[run] = len(runs)
            runs.append(run)
    groups = [np.array([node]) for node in range(model.num_nodes)]
    if whole_runs:
        groups += [run for run in runs if len(run) > 1]
    groups += [np.asarray(pos) for pos in model.dag.stage_positions] + [nodes]
    starts, finishes, _ = computation_power(model, choice[:, None])
    _, _, lengths, level, _ = evaluator.segments(choice[:, None])
    breakpoints = np.concatenate([[0.0], np.cumsum(lengths[0])])
    real = lengths[0] > _MIN_SEGMENT_S
    phases = []  # [the peak's groups, the trough's groups]
    for hot in (real & (level[0] >= ceiling - _NEAR_PEAK * evaluator.scale_w), real & (level[0] < ceiling - evaluator.cap_w)):
        phases.append([])
        if not hot.any():
            continue
        # computations overlapping any hot segment
        a, b = breakpoints[:-1][hot], breakpoints[1:][hot]
        overlaps = ((starts[:, 0][:, None] < b[None, :]) & (finishes[:, 0][:, None] > a[None, :])).any(axis=1)
        members = np.flatnonzero(overlaps)
        if whole_runs:
            members = np.concatenate([runs[r] for r in np.unique(run_of[members])])
        if members.size:
            stage_of = model.dag.stage[members]
            phases[-1] += [members] + [members[stage_of == stage] for stage in np.unique(stage_of)]
            groups += phases[-1]
    member = np.zeros((len(groups), model.num_nodes), dtype=bool)
    for row, group in enumerate(groups):
        member[row, group] = True
    blocks = []
    for step in _STEPS:
        for sign in (-1, 1):
            moved = np.where(member, np.clip(choice + sign * step, 0, last), choice)
            blocks.append(moved[(moved != choice).any(axis=1)])
    # The peak slower and the trough faster at once: at a deadline that binds, the time the
    # trough's (critical) computations save is what lets the peak's slow down.
    for slower, faster in _PAIRED_STEPS:
        for peak in phases[0]:
            for trough in phases[1]:
                column = choice.copy()
                column[peak] = np.minimum(choice[peak] + slower, last[peak])
                column[trough] = np.maximum(choice[trough] - faster, 0)
                if np.any(column != choice):
                    blocks.append(column[None, :])
    boundary = []
    for pos in model.dag.stage_positions:
        pos = np.asarray(pos)
        differs = np.flatnonzero(clocks[pos][1:] != clocks[pos][:-1])
        for node, neighbour in [(pos[k], pos[k + 1]) for k in differs] + [(pos[k + 1], pos[k]) for k in differs]:
            column = choice.copy()
            column[node] = np.abs(model.frequencies[node, : model.num_options[node]] - clocks[neighbour]).argmin()
            boundary.append(column)
    columns = np.concatenate(blocks + [np.array(boundary, dtype=choice.dtype).reshape(-1, model.num_nodes)])
    return columns.T.copy() if columns.size else choice[:, None].copy()


def _subset(result: Evaluated, columns: np.ndarray) -> Evaluated:
    return Evaluated(*(getattr(result, f.name)[columns] for f in dataclasses.fields(result)))


def descend(evaluator: Evaluator, choice: np.ndarray, deadline: float, ceiling: float,
            rounds: int = _ROUNDS, overrun_price: float = 0.0) -> np.ndarray:
    """Steepest descent of the ceiling objective over the moves of `_moves` that keep the
    deadline (and the clock-change budget): each round takes the best prefix of the round's
    improving moves, best first, one per computation (one more batch), until none improves.
    `overrun_price` > 0 (J/s): time past the deadline is charged at that price instead of
    refused (a repair of a plan that is too slow)."""
    def score(result: Evaluated) -> np.ndarray:
        if overrun_price > 0:
            return result.objective + overrun_price * np.clip(result.times - deadline, 0.0, None)
        return np.where(result.times <= deadline + _DEADLINE_EPS_S, result.objective, np.inf)

    limit = np.inf if overrun_price > 0 else deadline
    current = choice.copy()
    value = float(score(evaluator.evaluate(current[:, None], np.array([ceiling])))[0])
    for _ in range(rounds):
        candidates = _moves(evaluator, current, ceiling)
        result = evaluator.evaluate(candidates, np.full(candidates.shape[1], ceiling))
        gain = value - score(result)
        order = np.argsort(-gain)
        order = order[gain[order] > 1e-9][:_TOP_MOVES]
        # The budget is checked on the best moves only (its replay costs more than the figures).
        order = order[evaluator.admissible(candidates[:, order], _subset(result, order), limit)]
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
        combined_value = np.where(evaluator.admissible(prefixes, combined, limit), score(combined), np.inf)
        best = int(np.argmin(combined_value))
        if combined_value[best] >= value - 1e-9:
            break
        current, value = prefixes[:, best].copy(), float(combined_value[best])
    return current


def improve(evaluator: Evaluator, choice: np.ndarray, deadline: float) -> np.ndarray:
    """The cheapest plan (energy + filler) the ceiling descents find from `choice` within
    `deadline`: descents at ceilings just below the plan's own peak, re-centred on the
    improved plan's peak while that keeps paying."""
    best = choice.copy()
    best_value, best_peak = _total(evaluator, best)
    for _ in range(_RESTARTS):
        tried = [descend(evaluator, best, deadline, best_peak + step * evaluator.scale_w) for step in _CEILING_STEPS]
        totals = [_total(evaluator, plan) for plan in tried]
        k = int(np.argmin([value for value, _ in totals]))
        if totals[k][0] >= best_value - 1e-6:
            break
        best, (best_value, best_peak) = tried[k], totals[k]
    # A descent that must keep the deadline at every move cannot slow the peak's computations
    # (critical in the steady state) before something else got faster: let it run past the
    # deadline, then repair the overrun at a steep price on time, keeping the lower ceiling.
    for relax in _RELAXED_DEADLINES:
        loose = descend(evaluator, best, deadline * relax, best_peak + _CEILING_STEPS[1] * evaluator.scale_w)
        loose_peak = _total(evaluator, loose)[1]
        repaired = descend(evaluator, loose, deadline, loose_peak, overrun_price=_OVERRUN_PRICE_J_PER_S)
        within = evaluator.evaluate(repaired[:, None]).times[0] <= deadline + _DEADLINE_EPS_S
        value, peak = _total(evaluator, repaired)
        if within and value < best_value - 1e-6:
            best, best_value, best_peak = repaired, value, peak
    return best


def _total(evaluator: Evaluator, choice: np.ndarray) -> tuple[float, float]:
    """(energy + exact filler + the charge for any shortfall (`Evaluated.totals`), peak) of one plan."""
    result = evaluator.evaluate(choice[:, None])
    return float(result.totals[0]), float(result.peaks[0])


def search_deadlines(frontier: Frontier, deadlines_s: tuple[float, ...]) -> list[float]:
    """The deadlines the search targets: the caller's, and `_DESCENT_DEADLINES` x T_min and
    the minimum-energy plan's time, except those within `_NEAR_DEADLINE` of a caller's (a plan
    for a deadline a hair shorter than one already searched adds little)."""
    t_min, t_least = frontier.ordinary_plans[0].time, frontier.min_energy.time
    requested = {d for d in deadlines_s if t_min <= d}
    defaults = {min(t_min * factor, t_least) for factor in _DESCENT_DEADLINES} | {t_least}
    return sorted(requested | {d for d in defaults if not any(abs(d - r) <= _NEAR_DEADLINE * r for r in requested)})


def search(evaluator: Evaluator, choices: np.ndarray, start: Evaluated, deadline: float) -> list[np.ndarray]:
    """Plans within `deadline` from the frontier's plans `choices` (figures `start`): seeds
    (the cheapest plan within the deadline, the cheapest within each of `_SEED_SLACKS` less,
    whose slack the descent can spend on trimming the peak, and the one of least peak), each
    screened by one descent at `_SCREEN_CEILING` below its peak, then the best of them
    improved (`improve`)."""
    fits = np.flatnonzero(start.times <= deadline + _DEADLINE_EPS_S)
    if not fits.size:
        return []
    seeds = {int(fits[np.argmin(start.peaks[fits])])}
    for slack in (0.0, *_SEED_SLACKS):
        tighter = fits[start.times[fits] <= deadline * (1 - slack) + _DEADLINE_EPS_S]
        if tighter.size:
            seeds.add(int(tighter[np.argmin(start.totals[tighter])]))
    screened = [descend(evaluator, choices[:, seed], deadline, start.peaks[seed] + _SCREEN_CEILING * evaluator.scale_w,
                        _SCREEN_ROUNDS)
                for seed in sorted(seeds)]
    best = screened[int(np.argmin([_total(evaluator, plan)[0] for plan in screened]))]
    return [*screened, improve(evaluator, best, deadline)]
