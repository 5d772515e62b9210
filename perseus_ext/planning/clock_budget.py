"""Plans within a clock-change budget: how often each GPU may change its clock.

NCCL collectives were reported to stall when locked clocks changed about every 50 ms, while a
fixed clock did not; a plan that gives every computation its own clock changes a GPU's clock
after every computation (tens of times a second on short computations). `ClockBudget`
(`options.py`) bounds that, per GPU, with iterations replayed back to back: at most
`max_changes_per_s` changes in any window [t, t + 1 s) and no clock held shorter than
`min_hold_s`. The budget is met by planning, never by dropping changes at run time.

When a change happens. The runtime asks for computation k's clock when computation k-1 of its
stage ends (`energy.py`), so a change falls at that end; the iteration's first clock, when it
differs from the last one, falls at the stage's first computation's start. A clock is held from
its change to the next, so a run of computations under one clock holds it at least as long as
the run computes.

How plans are made to keep it (`solve_within_budget`). With the hold hold_s =
max(min_hold_s, 1 / max_changes_per_s) (`ClockBudget.hold_s`), cutting each stage's order into
runs that each take at least hold_s even at the fastest clocks, and giving each run one clock
(`groups.ClockGroups`), keeps the budget for every clock choice: such a plan holds each clock at
least hold_s, and changes at least hold_s apart put at most 1 / hold_s of them in a half-open
second. A run that is a stage's whole iteration never changes clock at all. Which runs? The cut
that costs least depends on the deadline, so it is chosen per deadline, against the plan the
unbudgeted solver finds there: the loss of a run is what tying its computations to one clock
costs at the same total time (the lower convex hull of the run's (time, cost) over its common
clocks at the plan's time for it, minus the plan's own cost), and a dynamic program over each
stage's order picks the cut of least total loss among cuts whose runs all last hold_s. It is
exact for that surrogate and linear in the runs a stage can have, where a greedy merge of short
neighbours would fix the cut before knowing what tying them costs. Each cut is then solved with
the grouped frontier solver (`grouped.py`), one stage-constant cut is solved alongside (the
budget never costs more than one clock per stage), and the unbudgeted plans that already keep
the budget stay candidates; the frontier is the Pareto set of all of them.

Every plan carries its figures (`frontier.ClockFigures`, from `clock_figures`): the most changes
one GPU makes in a second and the shortest hold, from the same replay as its time and energy.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from perseus_ext.errors import SolverError
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import ClockFigures, Frontier, Plan
from perseus_ext.planning.grouped import solve_grouped
from perseus_ext.planning.groups import ClockGroups
from perseus_ext.planning.options import ClockBudget
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import PipelineSchedule
from perseus_ext.planning.wait_aware import distinct_plans, pareto_plans

logger = logging.getLogger(__name__)

# The unbudgeted plans a cut is chosen against: those for these multiples of the all-max-clock
# time, and the minimum-energy one.
REFERENCE_DEADLINES = (1.0, 1.05, 1.15)
# LP deadlines of each cut's grouped solve: up to the most on small pipelines, down to the
# fewest as (groups x computations) grows (its passes cost a DAG pass per group and deadline).
GROUPED_DEADLINES, GROUPED_DEADLINES_MIN, GROUPED_DEADLINE_CELLS = 256, 64, 5e5
_WINDOW_S = 1.0


def clock_figures(model: CostModel, choices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(most changes in any [t, t + 1 s), shortest hold in s; inf without changes) of plans
    (columns of option indices), each the worst over the GPUs, iterations back to back
    (module docstring: when a change happens)."""
    choices = np.asarray(choices).reshape(model.num_nodes, -1)
    if model.switch_latency_s > 0:
        trace = model.latency_trace(choices)
        finish, durations = trace.finish, trace.durations
    else:
        durations = np.take_along_axis(model.times, choices, axis=1)
        finish = model.dag.finish_times(durations)
    period = finish.max(axis=0)
    clocks = np.take_along_axis(model.frequencies, choices, axis=1)
    plans = choices.shape[1]
    rate, hold = np.zeros(plans), np.full(plans, np.inf)
    for pos in model.dag.stage_positions:
        if len(pos) == 0:
            continue
        f = clocks[pos]
        # Change times in order: the wrap-around one (at the first computation's start), then
        # one at the end of every computation whose successor runs another clock.
        times = np.full((len(pos), plans), np.inf)
        times[0] = np.where(f[0] != f[-1], finish[pos[0]] - durations[pos[0]], np.inf)
        times[1:] = np.where(f[1:] != f[:-1], finish[pos[:-1]], np.inf)
        times = np.sort(times, axis=0)
        count = np.isfinite(times).sum(axis=0)
        stage_rate, stage_hold = _periodic_figures(times, count, period)
        rate = np.maximum(rate, stage_rate)
        hold = np.minimum(hold, stage_hold)
    return rate, hold


def _periodic_figures(times: np.ndarray, count: np.ndarray, period: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(max changes in a half-open second, shortest hold) of change times (sorted columns, inf
    padded, `count` finite) repeating with `period`."""
    n, plans = times.shape
    last = times[np.maximum(count - 1, 0), np.arange(plans)]
    with np.errstate(invalid="ignore"):
        gaps = np.where(np.arange(1, n)[:, None] < count[None], np.diff(times, axis=0), np.inf)
    with np.errstate(invalid="ignore"):
        wrap = np.where(count > 0, times[0] + period - last, np.inf)
    hold = np.minimum(gaps.min(axis=0, initial=np.inf), wrap)
    repeats = int(np.ceil(_WINDOW_S / max(float(period.min()), 1e-9))) + 1
    # Every change's window [c, c + 1 s) against the changes of `repeats` periods, in chunks of
    # plans that keep the (changes, changes x repeats, plans) comparison small.
    rate = np.zeros(plans)
    step = max(1, 4_000_000 // max(1, n * n * repeats))
    for lo in range(0, plans, step):
        c, t = times[:, lo : lo + step], period[lo : lo + step]
        unrolled = (c[None] + t[None, None] * np.arange(repeats)[:, None, None]).reshape(repeats * n, -1)
        inside = (unrolled[None] >= c[:, None] - 1e-12) & (unrolled[None] < c[:, None] + _WINDOW_S - 1e-9)
        counts = np.where(np.isfinite(c), inside.sum(axis=1), 0)
        rate[lo : lo + step] = counts.max(axis=0, initial=0)
    return rate, hold


def with_figures(model: CostModel, choices: np.ndarray, plans: list[Plan]) -> list[Plan]:
    """`plans` (the columns of `choices`) carrying their `ClockFigures`."""
    rate, hold = clock_figures(model, choices)
    return [dataclasses.replace(plan, clock=ClockFigures(float(r), float(h))) for plan, r, h in zip(plans, rate, hold)]


def choose_cut(model: CostModel, hold_s: float, reference: np.ndarray, deadline: float) -> ClockGroups:
    """The cut of each stage's order into runs of at least `hold_s` at the fastest clocks with
    the least tying loss against the reference plan `reference` (option indices of `model`)
    at `deadline`, by dynamic programming over each stage (module docstring)."""
    dag = model.dag
    rows = np.arange(model.num_nodes)
    ref_time = model.times[rows, reference]
    ref_cost = model.energies[rows, reference] - model.blocking_power * ref_time
    float_s = dag.latest_finish_times(ref_time, deadline) - dag.finish_times(ref_time)
    fastest = np.nanmin(np.where(np.isfinite(model.times), model.times, np.nan), axis=1)
    groups = []
    for stage, pos in enumerate(dag.stage_positions):
        n = len(pos)
        if n == 0:
            continue
        clocks = _common_clocks(model, pos, stage)
        lookup = [{int(f): k for k, f in enumerate(model.frequencies[i, : model.num_options[i]])} for i in pos]
        option = np.array([[row[int(f)] for f in clocks] for row in lookup])
        level_t = model.times[pos[:, None], option]
        level_c = model.energies[pos[:, None], option] - model.blocking_power * level_t
        prefix_c = np.r_[np.zeros((1, len(clocks))), np.cumsum(level_c, axis=0)]
        # A run at level k delays its j-th member by the sum of its members' extra seconds up
        # to j; the plan keeps its deadline while that fits in member j's float.
        prefix_extra = np.r_[np.zeros((1, len(clocks))),
                             np.cumsum(np.maximum(level_t - ref_time[pos, None], 0.0), axis=0)]
        over = prefix_extra[1:] - float_s[pos, None]  # (members, levels)
        prefix_d = np.r_[0.0, np.cumsum(fastest[pos])]
        prefix_rc = np.r_[0.0, np.cumsum(ref_cost[pos])]
        longest = 2 * hold_s + fastest[pos].max()
        runs, losses = [], []
        for a in range(n):
            worst = np.full(len(clocks), -np.inf)
            for b in range(a + 1, n + 1):
                np.maximum(worst, over[b - 1], out=worst)
                span = prefix_d[b] - prefix_d[a]
                whole = (a, b) == (0, n)  # the whole iteration: no change at all
                if span >= hold_s - 1e-12 or whole:
                    fits = worst <= prefix_extra[a] + 1e-9
                    cost = np.where(fits, prefix_c[b] - prefix_c[a], np.inf).min()
                    if not np.isfinite(cost):  # nothing fits: the run's fastest clock, late
                        cost = (prefix_c[b] - prefix_c[a])[0]
                    runs.append((a, b))
                    losses.append(cost - (prefix_rc[b] - prefix_rc[a]))
                if span > longest and a > 0:
                    break
        best, back = np.full(n + 1, np.inf), np.full(n + 1, -1)
        best[0] = 0.0
        for r in sorted(range(len(runs)), key=lambda r: runs[r][1]):
            a, b = runs[r]
            if best[a] + losses[r] < best[b]:
                best[b], back[b] = best[a] + losses[r], r
        cut, b = [], n
        while b > 0:
            a = runs[back[b]][0]
            cut.append((a, b))
            b = a
        order = [dag.computations[i] for i in pos]
        groups += [order[a:b] for a, b in reversed(cut)]
    return ClockGroups.of(model.schedule, groups)


def _common_clocks(model: CostModel, pos: np.ndarray, stage: int) -> np.ndarray:
    common = None
    for i in pos:
        own = set(model.frequencies[i, : model.num_options[i]].tolist())
        common = own if common is None else common & own
    if not common:
        raise SolverError(
            f"stage {stage} has no clock measured for every one of its computations: a clock-change "
            "budget ties runs of them to one clock (set solver option max_clock_changes_per_s and "
            "min_clock_hold_s to 0 for no budget, or profile the same clocks for every computation)")
    return np.array(sorted(common, reverse=True), dtype=np.int64)


def solve_within_budget(
    schedule: PipelineSchedule, profile: Profile, blocking_power: float, switch_latency_s: float,
    budget: ClockBudget, unbudgeted: Frontier, reference_model: CostModel, reference_choices: np.ndarray,
    *, wait_aware: bool = False,
) -> Frontier:
    """The frontier of plans that keep `budget` (module docstring). `unbudgeted`: the solver's
    frontier without it, whose plans (`reference_choices`, option indices of `reference_model`,
    one column per plan) pick the cuts and stay candidates where they keep the budget."""
    model = CostModel(schedule, profile, blocking_power, switch_latency_s)  # every measured clock
    hold_s = budget.hold_s
    plans = [plan for plan in unbudgeted.plans
             if plan.clock is not None and budget.allows(plan.clock.changes_per_s, plan.clock.shortest_hold_s)]
    t_min = unbudgeted.fastest.time
    references = {unbudgeted.plans.index(unbudgeted.plan_for_deadline(t_min * r)): t_min * r
                  for r in REFERENCE_DEADLINES}
    least = unbudgeted.plans.index(unbudgeted.min_energy)
    references.setdefault(least, unbudgeted.min_energy.time)
    cuts: dict[tuple, ClockGroups] = {}
    for k, deadline in references.items():
        cut = choose_cut(model, hold_s, _in_model(model, reference_model, reference_choices[:, k]), deadline)
        cuts.setdefault(cut.groups, cut)
    stage_constant = ClockGroups.per_stage(schedule)
    cuts.setdefault(stage_constant.groups, stage_constant)
    slope = schedule.num_stages * blocking_power
    for cut in cuts.values():
        size = len(cut.groups) * model.num_nodes
        count = int(min(GROUPED_DEADLINES, max(GROUPED_DEADLINES_MIN, GROUPED_DEADLINE_CELLS // size)))
        choices, times, energies = solve_grouped(model, cut, count, to_slowest=wait_aware)
        keep = _pareto_columns(times, energies, slope if wait_aware else None)
        made = model.make_plans(choices[:, keep], times[keep], energies[keep])
        plans += with_figures(model, choices[:, keep], made)
    broken = [plan for plan in plans if not budget.allows(plan.clock.changes_per_s, plan.clock.shortest_hold_s)]
    if broken:  # the cut guarantees the budget; a plan that breaks it is a bug, never shipped
        logger.error("clock budget: %d grouped plans break %s and are left out", len(broken), budget.describe())
        plans = [plan for plan in plans if plan not in broken]
    candidates = distinct_plans(plans)
    ordinary = [plan for plan in pareto_plans(candidates, 0.0) if plan.time >= t_min - 1e-12]
    extension: list[Plan] = []
    if wait_aware:
        chosen = {id(p) for p in ordinary}
        extension = [p for p in pareto_plans(candidates, slope) if id(p) not in chosen and p.time > ordinary[-1].time]
    logger.info("clock budget (%s): %d plans from %d cuts, fastest %.4f s %.1f J (unbudgeted %.1f J)",
                budget.describe(), len(ordinary), len(cuts), ordinary[0].time, ordinary[0].energy,
                unbudgeted.fastest.energy)
    return Frontier(unbudgeted.schedule, blocking_power, tuple(ordinary) + tuple(extension), unbudgeted.baseline,
                    extension_start=len(ordinary) if extension else None)


def _in_model(model: CostModel, other: CostModel, choice: np.ndarray) -> np.ndarray:
    """Option indices in `model` of the clocks `choice` gives in `other` (same schedule)."""
    clocks = other.frequencies[np.arange(other.num_nodes), choice]
    hits = model.frequencies == clocks[:, None]
    return np.where(hits.any(axis=1), hits.argmax(axis=1), 0)


def _pareto_columns(times: np.ndarray, energies: np.ndarray, slope: float | None) -> np.ndarray:
    """Columns Pareto-optimal in (time, energy), and with `slope` in (time, energy - slope time)."""
    keep = []
    for s in (0.0,) if slope is None else (0.0, slope):
        order = np.lexsort((energies - s * times, np.round(times, 12)))
        cost = (energies - s * times)[order]
        running = np.minimum.accumulate(cost)
        first = np.r_[True, cost[1:] < running[:-1] - 1e-9]
        keep.append(order[first])
    return np.unique(np.concatenate(keep))
