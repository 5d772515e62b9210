"""The iteration time–energy frontier solver.

Problem: pick one clock per computation to minimise energy subject to the iteration's longest
path meeting a deadline T, for every T from T_min (all clocks at max) to the minimum-energy plan.
With the energy model of `energy.py`, at a fixed T this is minimising sum_i c_i(t_i) with
c_i = e_i - P_block t_i: a discrete time–cost tradeoff on the DAG (NP-hard in general).

Method. Plans are columns of one (computations x plans) matrix, and every step below works on
all of them at once with numpy, so there is no per-deadline graph algorithm in Python:

1. *Convex relaxation at anchor deadlines* (`relaxation.py`). Each computation's cost is
   replaced by the lower convex hull of its (time, cost) points; the problem becomes an LP
   (start times + hull-segment fills) solved exactly with HiGHS, warm-started from one anchor to
   the next. Between anchors, the convex combination of the two neighbouring LP solutions is
   feasible for the interpolated deadline (the constraints are linear), so every grid deadline
   gets a relaxed plan in O(N).
2. *Rounding.* Relaxed durations are rounded down to a profiled clock (the deadline holds), and
   also up / to the nearest clock (plans that are best at their own, slightly longer, time).
3. *Slack reclaim.* Rounding leaves slack; forward and backward passes over the DAG give each
   computation the slowest clock that fits in its slack window (`passes.reclaim_slack`).
4. *Carry and stretch.* Every other deadline whose best plan is not its own also gets the best
   plan of any earlier deadline, stretched into its slack; the plans at the start of gaps in
   the frontier are stretched into deadlines inside the gaps, in two rounds (the second fills
   the gaps the first opened).
5. *Gap-targeted polish* (while its cost fits `gap_polish_budget`, i.e. up to ~180
   computations): the LP anchors bound the energy of any plan at every deadline from below
   (`AnchorWalk.lower_bound`); where the best plan is more than `_GAP_TARGET` over that bound,
   evenly spaced deadlines get a local search with moves of one clock step (`passes.polish`),
   and each polished plan is carried to the deadlines around it (sped up to the earlier ones,
   slack reclaimed into the later ones).
6. *Polish* (while its cost fits `polish_budget`, i.e. for small pipelines): local search that
   moves one computation to any clock, repairs the deadline by speeding up the cheapest critical
   computations and reclaims slack (`passes.polish`).

Every candidate is replayed on the discrete profile (`CostModel.replay`, latency-aware when the
clock-change latency is not 0); only the Pareto-optimal ones form the frontier, so reported
times and energies are exact replays and no plan is dominated. Where the frontier is flat,
neighbouring plans can be more than `resolution` apart: the plans found inside such a gap were
all no cheaper than the plan before it.

A clock-change budget (`SolverOptions.clock_budget`) that these plans break is met by solving
again over runs of computations tied to one clock (`clock_budget.py`, `grouped.py`); every plan
carries its clock-change figures (`Plan.clock`). The candidate pool and its Pareto and gap-fill
selections live in `pool.py`.
"""

from __future__ import annotations

import logging

import numpy as np

from perseus_ext.planning.clock_budget import solve_within_budget, with_figures
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.first_pass import FirstPass, replayed
from perseus_ext.planning.frontier import Frontier
from perseus_ext.planning.options import SolverOptions, check_problem_size
from perseus_ext.planning.passes import CELLS, polish, reclaim_slack, repair_deadline
from perseus_ext.planning.pool import CandidatePool, best_so_far, even_block, gap_deadlines, in_two, pareto
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.relaxation import AnchorWalk
from perseus_ext.planning.schedule import PipelineSchedule
from perseus_ext.planning.switching import merge_switches

logger = logging.getLogger(__name__)

# Stretch rounds; each fills the gaps the previous one opened. A third round (8 x 24: 4
# deadlines) found nothing in 8 of the 9 reference cases and 0.0024 % at one deadline of A40
# 8 x 96, for the cost of a DAG pass and a frontier (docs/solver.md).
_GAP_ROUNDS = 2
# Gap-targeted polish (step 5): deadlines whose best plan is more than this over the LP's bound
# are its targets; it needs this many plans to be worth running (fewer, and the deadlines between
# them gain little), and its local search moves a computation by one clock step for at most
# these rounds (A40 8 x 8: as close to the MILP as +-2 steps and 20 rounds, in a third of the time).
_GAP_TARGET, _GAP_POLISH_MIN_PLANS, _GAP_POLISH_ROUNDS = 1e-3, 8, 6
_MERGE_FASTEST, _MERGE_SAMPLE = 64, 64  # Pareto plans the latency merge pass works on


def solve_frontier(
    schedule: PipelineSchedule,
    profile: Profile,
    blocking_power: float,
    options: SolverOptions | None = None,
    switch_latency_s: float = 0.0,
    *,
    wait_aware: bool = False,
) -> Frontier:
    """Every Pareto-optimal (iteration time, energy) plan from T_min to the min-energy plan.

    `profile` as measured: the solver plans on its useful clocks (`Profile.useful_clocks` at
    `blocking_power`; with `wait_aware` off, computations every path passes through also drop
    clocks costlier in energy than a faster one). `switch_latency_s`: effective latency of a
    clock change (see `energy.py`); every plan's time and energy are the latency-aware replay
    of its clocks, and changes that cost more than they save are merged away. 0 plans for
    instant clock changes.

    `wait_aware`: also the plans for an iteration held to a deadline T' anyway (a straggler):
    cheapest in energy - blocking power x stages x time, up to the all-slowest plan, appended
    from `Frontier.extension_start` on (`wait_aware.py` has the cost). The same solve: its LP,
    rounding and reclaim minimise that cost at every deadline already, so the extension only
    continues the deadline grid past T* to the all-slowest plan.

    Every plan keeps `options.clock_budget` (at most `max_clock_changes_per_s` clock changes per
    second per GPU, no clock held shorter than `min_clock_hold_s`; both 0: no budget) and
    carries its figures (`Plan.clock`). Where the plans solved per computation break it, the
    frontier is solved again over runs of computations that share a clock (`clock_budget.py`).
    """
    options = options or SolverOptions()
    options.validate()  # also catches options changed with object.__setattr__ or pickled
    if options.power_swing_cap > 0:  # swing-capped plans (swing_cap.py) from the uncapped frontier
        capped = solve_capped_frontier(schedule, profile, blocking_power, options, switch_latency_s,
                                       wait_aware=wait_aware)
        if not capped.meets_cap:
            logger.warning("perseus-ext: no plan meets solver option power_swing_cap %g; the frontier is the one "
                           "plan of least swing found (%.0f W, %.0f W allowed)", options.power_swing_cap,
                           capped.plans[0].swing.peak_to_trough_w, capped.cap_w)
        return capped.frontier
    num_nodes = sum(len(order) for order in schedule.orders)
    check_problem_size(options, num_nodes, options.min_grid_points, _anchor_count(options, num_nodes))
    model = planning_model(schedule, profile, blocking_power, switch_latency_s, wait_aware=wait_aware)
    solver = FrontierSolver(model, options, wait_aware)
    frontier = solver.solve()
    budget = options.clock_budget
    if not budget.active or all(budget.allows(p.clock.changes_per_s, p.clock.shortest_hold_s) for p in frontier.plans):
        return frontier
    return solve_within_budget(schedule, profile, blocking_power, switch_latency_s, budget, frontier, model,
                               solver.choices, wait_aware=wait_aware)


def planning_model(
    schedule: PipelineSchedule,
    profile: Profile,
    blocking_power: float,
    switch_latency_s: float = 0.0,
    *,
    wait_aware: bool = False,
) -> CostModel:
    """The cost model `solve_frontier` plans on: the profile's useful clocks (with `wait_aware`
    off, computations on every path also drop clocks costlier in energy than a faster one).
    Its replays are what the frontier's plans report (with clock-change latency, a clock the
    model lacks is stood in for by the nearest one it has, `energy.py`)."""
    return CostModel(
        schedule, profile.useful_clocks(blocking_power), blocking_power, switch_latency_s,
        energy_filter_on_every_path=not wait_aware,
    )


class FrontierSolver:
    """Runs the steps of the module docstring on one `CostModel`."""

    def __init__(self, model: CostModel, options: SolverOptions, wait_aware: bool = False):
        self.model = model
        self.options = options
        self.wait_aware = wait_aware
        self.choices: np.ndarray | None = None  # the frontier's plans (option indices), once solved

    def solve(self) -> Frontier:
        model = self.model
        fastest = model.fastest_choice()
        t_min = float(model.dag.makespan(model.times[:, 0]))
        slowest = model.num_options - 1
        t_slowest = float(model.dag.makespan(model.times[np.arange(model.num_nodes), slowest]))
        grid_bound = int((t_slowest - t_min) / self._grid_step(t_min, t_slowest)) + 2
        check_problem_size(
            self.options, model.num_nodes, grid_bound,
            _anchor_count(self.options, model.num_nodes), t_slowest - t_min,
        )
        # Deadlines in blocks: the float and int64 intermediates of one block stay small, only
        # the int16 candidates accumulate (peak memory ~ the pool, not 10x the pool).
        block = 2 * max(32, CELLS // (2 * model.num_nodes))
        anchor_count = _anchor_count(self.options, model.num_nodes)
        # Steps 2-3 run on the walk's threads, each end taking blocks of deadlines once it has
        # solved its anchors (`first_pass.py`).
        first_pass = FirstPass(
            model, lambda walk: self._deadline_grid(t_min, float(walk.deadlines[-1]), walk.ordinary_end),
            # The fastest plan, the first pass's three or four kinds and the carried plans: one
            # allocation, not a buffer grown and copied over and over (8 x 96: 12,000 plans).
            lambda deadlines: 1 + (5 if model.switch_latency_s > 0 else 4) * deadlines,
        )
        walk = AnchorWalk(
            model, anchor_count, t_min, t_slowest, lambda t_max: self._grid_step(t_min, t_max),
            self.options.progress, to_slowest=self.wait_aware,
            t_least_energy=float(model.dag.makespan(model.times[np.arange(model.num_nodes), model.min_energy_choice()])),
            then=first_pass.take_blocks,
        )
        try:
            anchors = walk.wait()  # the first pass has its durations: none stacked here
        finally:
            walk.close()
        grid = first_pass.grid
        pool = CandidatePool.around(first_pass, fastest[:, None])
        reclaimed = first_pass.reclaimed_columns()
        # The ordinary frontier's deadlines (to the walk's ordinary end past T*); the
        # extension's follow on the same grid.
        ordinary_grid = grid[: len(self._deadline_grid(t_min, walk.ordinary_end, walk.ordinary_end))]
        # Rounding loses more at some deadlines than at others. Give deadlines a second chance:
        # the best plan found for any earlier deadline, stretched into the new slack (past the
        # ordinary end: best in energy - blocking power x stages x time).
        best = best_so_far(pool.times, pool.energies, ordinary_grid)
        if len(grid) > len(ordinary_grid):
            waiting = pool.energies - self._slope * pool.times
            best = np.r_[best, best_so_far(pool.times, waiting, grid[len(ordinary_grid):])]
        # Where that plan is the deadline's own reclaimed one, a second reclaim would give it
        # back unchanged (a reclaim leaves no slack a computation could take: 8 x 24, 337 of
        # 818 deadlines). Of the others, every other one: the deadline between is served by the
        # plan carried to the one before it, a grid step earlier (carrying to both took ~5 ms
        # more of the 8 x 24 command's ~0.27 s, for 0.002 % less energy on average: docs/solver.md).
        carry = np.flatnonzero(best != reclaimed)[::2]
        block = even_block(len(carry), block)
        for k in range(0, len(carry), block):
            carried, deadlines = pool.choices[:, best[carry[k : k + block]]], grid[carry[k : k + block]]
            pool.extend_all(in_two(
                lambda lo, hi: [replayed(model, reclaim_slack(model, carried[:, lo:hi], deadlines[lo:hi]))],
                len(deadlines),
            ))
        polish_all = len(ordinary_grid) * (model.num_nodes * model.times.shape[1]) ** 2 <= self.options.polish_budget
        if not polish_all and model.switch_latency_s == 0:
            self._gap_polish(walk, pool, ordinary_grid)

        resolution = self.options.resolution
        # Where the frontier is flat, Pareto plans can be more than `resolution` apart; stretch
        # the plan at each gap's start into deadlines inside the gap so every step has a plan.
        previous = None
        for _ in range(_GAP_ROUNDS):
            keep = pool.frontier(resolution)
            if previous is not None and np.array_equal(keep, previous):
                break  # the last round's plans changed nothing: another would repeat it
            previous = keep
            stretch_from, stretch_to = gap_deadlines(pool.times[keep], resolution)
            if not stretch_to.size:
                break
            stretched = pool.choices[:, keep[stretch_from]]
            pool.extend_all(in_two(
                lambda lo, hi: [replayed(model, reclaim_slack(model, stretched[:, lo:hi], stretch_to[lo:hi]))],
                len(stretch_to),
            ))

        if polish_all:
            # The best plan at every grid deadline, then every frontier plan at its own time
            # (a plan that ties a better one in time is only found there).
            pool.add(polish(model, pool.best_for(ordinary_grid), ordinary_grid))
            keep = pool.frontier(resolution)
            pool.add(polish(model, pool.choices[:, keep], pool.times[keep]))

        if model.switch_latency_s > 0:
            # Merging pays most near T_min, where every switch on the critical path costs
            # time: all the fastest Pareto plans, then an even sample of the rest.
            keep = np.array(pareto(pool.times, pool.energies))
            rest = keep[_MERGE_FASTEST:]
            sample = rest[np.linspace(0, len(rest) - 1, min(len(rest), _MERGE_SAMPLE)).astype(int)]
            keep = np.r_[keep[:_MERGE_FASTEST], sample] if rest.size else keep
            pool.add(merge_switches(model, pool.choices[:, keep], pool.times[keep]))

        # Only non-dominated plans: a gap filler (slower and no cheaper than a faster plan)
        # would be read as a frontier point by users and the straggler policy.
        keep = np.array(pareto(pool.times, pool.energies))
        extension_start = None
        if self.wait_aware:
            # Cheapest in energy - P_block S T for some deadline T' the iteration is held to,
            # and not already an ordinary plan (mostly past T*).
            waiting = pareto(pool.times, pool.energies - self._slope * pool.times)
            extension = np.setdiff1d(waiting, keep)
            extension = extension[np.argsort(pool.times[extension], kind="stable")]
            if extension.size:
                extension_start = len(keep)
                keep = np.r_[keep, extension]
        self.choices = pool.choices[:, keep]
        plans = tuple(with_figures(model, self.choices, model.make_plans(self.choices, pool.times[keep], pool.energies[keep])))
        frontier = Frontier(
            model.schedule.summary(), model.blocking_power, plans, model.to_plan(fastest), extension_start,
        )
        ordinary = frontier.ordinary_plans
        if logger.isEnabledFor(logging.DEBUG):  # the certificate: how far from optimal at worst
            gap = pool.energies[best_so_far(pool.times, pool.energies, ordinary_grid)] / walk.lower_bound(ordinary_grid) - 1
            logger.debug(
                "frontier: within %.3f %% of the optimum at every grid deadline (mean %.3f %%, worst at T %.4f s; "
                "against the LP bound)", 100 * gap.max(), 100 * gap.mean(), ordinary_grid[gap.argmax()],
            )
        logger.info(
            "frontier: %d plans, T %.4f..%.4f s, energy %.1f..%.1f J (%d LP anchors)%s",
            len(ordinary), ordinary[0].time, ordinary[-1].time, ordinary[0].energy, ordinary[-1].energy,
            len(anchors), "" if extension_start is None else
            f"; wait-aware plans: {len(plans) - len(ordinary)}, up to T {plans[-1].time:.4f} s",
        )
        return frontier

    def _gap_polish(self, walk: AnchorWalk, pool: "CandidatePool", grid: np.ndarray) -> None:
        """Step 5 on the ordinary grid: polish the best plans at evenly spaced deadlines among
        those the LP bound cannot certify within `_GAP_TARGET`, as many as `gap_polish_budget`
        allows (none if that is fewer than `_GAP_POLISH_MIN_PLANS`; each costs ~N^2), and carry
        the polished plans to the deadlines between them.

        Where the certified gap is large, the relaxation is often loose as well, so the largest
        gaps are not where polishing gains most (A40 8 x 8: 0.35-0.54 % near T_min against
        0.18 % at 1.05 x T, where the MILP closes 0.03 % above the LP); and a polished plan
        mostly improves its own deadline (the frontier there falls by ~400 J per second of
        deadline). So the budget is spread evenly over every uncertified deadline, and the
        deadlines between two polished plans start from both."""
        model = self.model
        plans = min(self.options.gap_polish_budget // model.num_nodes**2, len(grid))
        if plans < _GAP_POLISH_MIN_PLANS:
            return
        bound = walk.lower_bound(grid)
        best = best_so_far(pool.times, pool.energies, grid)
        uncertified = np.flatnonzero(pool.energies[best] > bound * (1 + _GAP_TARGET))
        if not uncertified.size:
            return
        spaced = np.linspace(0, len(uncertified) - 1, min(plans, len(uncertified))).round().astype(np.int64)
        # Without repeats (np.unique and np.setdiff1d import numpy.ma: the CLI's start-up time).
        picked = uncertified[spaced[np.r_[True, np.diff(spaced) > 0]]]
        polished = polish(model, pool.choices[:, best[picked]], grid[picked], _GAP_POLISH_ROUNDS, window=1)
        pool.add(polished)
        # Every deadline after the previous polished plan A, up to a polished plan B, starts from
        # B sped up to the deadline, from B sped up only where A differs, and from A slowed into
        # its slack no further than B (the polished plans mark which computations are in play).
        earlier = np.arange(picked[-1] + 1)
        sped_up = repair_deadline(model, polished[:, np.searchsorted(picked, earlier)], grid[earlier])
        pool.add(reclaim_slack(model, sped_up, grid[earlier]))
        is_picked = np.zeros(picked[-1] + 1, dtype=bool)
        is_picked[picked] = True
        between = np.flatnonzero(~is_picked)
        between = between[between > picked[0]]
        if between.size:
            after = np.searchsorted(picked, between)
            a, b = polished[:, after - 1], polished[:, after]
            pool.add(reclaim_slack(model, repair_deadline(model, b, grid[between], frozen=a == b), grid[between]))
            pool.add(reclaim_slack(model, a, grid[between], cap=b))
        # Deadlines where a new plan is now the best get it with their slack reclaimed.
        now_best = best_so_far(pool.times, pool.energies, grid)
        changed = np.flatnonzero(now_best != best)
        if changed.size:
            pool.add(reclaim_slack(model, pool.choices[:, now_best[changed]], grid[changed]))

    @property
    def _slope(self) -> float:
        """Joules a plan saves per second it is slower when the iteration is held anyway."""
        return self.model.blocking_power * self.model.num_stage_gpus

    def _grid_step(self, t_min: float, t_max: float) -> float:
        """Grid spacing: `resolution` (over `grid_oversampling`), finer for short frontiers."""
        options = self.options
        step = min(options.resolution / options.grid_oversampling, (t_max - t_min) / options.min_grid_points)
        return max(step, 1e-9)

    def _deadline_grid(self, t_min: float, t_max: float, ordinary_end: float) -> np.ndarray:
        """Deadlines from T_min to t_max, `_grid_step(ordinary_end)` apart (t_min + step * k, as
        the LP anchors that lie on them are computed)."""
        step = self._grid_step(t_min, ordinary_end)
        grid = t_min + step * np.arange(int(np.ceil((t_max - t_min) / step - 1e-9)) + 1)
        grid[-1] = max(grid[-1], t_max)
        return grid

def _anchor_count(options: SolverOptions, num_nodes: int) -> int:
    """LP anchors: `anchors`, more for small pipelines (up to `anchor_budget` / computations)."""
    return max(options.anchors, options.anchor_budget // max(num_nodes, 1), 2)


def solve_capped_frontier(schedule: PipelineSchedule, profile: Profile, blocking_power: float, options: SolverOptions,
                          switch_latency_s: float = 0.0, *, filler_max_w: float | None = None,
                          wait_aware: bool = False):
    """The capped solve (`swing_cap.CappedFrontier`): the frontier solved with `options` less its
    `power_swing_cap`, then its plans under that cap and the options' clock budget. Capped
    `solve_frontier` calls and the runtime's capped solve (`filler_program.solve_capped`) run it."""
    from dataclasses import replace

    from perseus_ext.planning.swing_cap import capped_frontier

    uncapped = solve_frontier(schedule, profile, blocking_power, replace(options, power_swing_cap=0.0),
                              switch_latency_s, wait_aware=wait_aware)
    return capped_frontier(uncapped, schedule, profile, options.power_swing_cap, switch_latency_s,
                           filler_max_w=filler_max_w, clock_budget=options.clock_budget)
