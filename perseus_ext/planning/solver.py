"""The iteration time–energy frontier solver.

Problem: pick one clock per computation to minimise energy subject to the iteration's longest
path meeting a deadline T, for every T from T_min (all clocks at max) to the minimum-energy plan.
With the energy model of `energy.py`, at a fixed T this is minimising sum_i c_i(t_i) with
c_i = e_i - P_block t_i: a discrete time–cost tradeoff on the DAG (NP-hard in general).

Method. Plans are columns of one (computations x plans) matrix, and every step below works on
all of them at once with numpy, so there is no per-deadline graph algorithm in Python:

1. *Convex relaxation at anchor deadlines.* Each computation's cost is replaced by the lower
   convex hull of its (time, cost) points; the problem becomes an LP (start times + hull-segment
   fills) solved exactly with HiGHS, warm-started from one anchor to the next. Between anchors,
   the convex combination of the two neighbouring LP solutions is feasible for the interpolated
   deadline (the constraints are linear), so every grid deadline gets a relaxed plan in O(N).
2. *Rounding.* Relaxed durations are rounded down to a profiled clock (the deadline holds), and
   also up / to the nearest clock (plans that are best at their own, slightly longer, time).
3. *Slack reclaim.* Rounding leaves slack; forward and backward passes over the DAG give each
   computation the slowest clock that fits in its slack window (`reclaim_slack`).
4. *Carry and stretch.* Each deadline also gets the best plan of any earlier deadline, stretched
   into its slack; plans inside gaps of the frontier are stretched until no step between plans
   exceeds the resolution.
5. *Polish* (while its cost fits `polish_budget`, i.e. for small pipelines): local search that
   moves one computation to any clock, repairs the deadline by speeding up the cheapest critical
   computations and reclaims slack (`polish`).

Every candidate is replayed on the discrete profile (`CostModel.replay`, latency-aware when the
clock-change latency is not 0); only the Pareto-optimal ones form the frontier, so reported
times and energies are exact replays and no plan is dominated. Where the frontier is flat,
neighbouring plans can be more than `resolution` apart: the plans found inside such a gap were
all no cheaper than the plan before it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import highspy
import numpy as np
from scipy import sparse

from perseus_ext.errors import SolverError
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import Frontier
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import PipelineSchedule
from perseus_ext.planning.switching import merge_switches, repair_latency

logger = logging.getLogger(__name__)

_EPS = 1e-9
_GAP_ROUNDS = 6  # stretch rounds; each fills the gaps the previous one opened
_FILL_BIN = 0.5  # gap-fill bin width as a fraction of the resolution
_MERGE_FASTEST, _MERGE_SAMPLE = 64, 64  # Pareto plans the latency merge pass works on
_REPAIR_STRIDE = 2  # the latency repair works on every other grid deadline
_CHUNK = 2560  # plans processed at once by the batched DAG passes (bounds peak memory)


@dataclass(frozen=True)
class SolverOptions:
    """Knobs of the solver; the defaults meet the quality/speed targets in the README."""

    resolution: float = 1e-3  # seconds between grid deadlines (and between gap-search deadlines)
    grid_oversampling: int = 1  # grid deadlines per `resolution` (finer grid, denser frontier)
    min_grid_points: int = 500  # short frontiers get a finer grid than `resolution`
    anchors: int = 256  # LP anchors from T_min to all-slowest (the walk stops past min energy)
    anchor_budget: int = 4_000  # small pipelines get up to anchor_budget / computations anchors
    progress: bool = False  # show a tqdm bar over the LP anchors
    polish_budget: int = 20_000_000  # max deadlines x (computations x clocks)^2 for the local-search polish


class _ConvexRelaxation:
    """The LP over start times and convex-hull segment fills, kept warm across deadlines."""

    def __init__(self, model: CostModel):
        self.model = model
        dag = model.dag
        n = len(dag)
        p = model.blocking_power
        # Lower convex hull of (time, cost) per node; nodes sharing options share hulls.
        seg_node, seg_len, seg_slope = [], [], []
        cache: dict[bytes, np.ndarray] = {}
        for i in range(n):
            k = model.num_options[i]
            t = model.times[i, :k]
            c = model.energies[i, :k] - p * t
            key = t.tobytes() + c.tobytes()
            if key not in cache:
                cache[key] = _lower_hull(t, c)
            hull = cache[key]
            ht, hc = t[hull], c[hull]
            for j in range(len(hull) - 1):
                seg_node.append(i)
                seg_len.append(ht[j + 1] - ht[j])
                seg_slope.append((hc[j + 1] - hc[j]) / (ht[j + 1] - ht[j]))
        self.seg_node = np.array(seg_node, dtype=np.int64)
        self.seg_len = np.array(seg_len)
        seg_slope = np.array(seg_slope)
        self.t_min = model.times[:, 0].copy()
        self.base_cost = float((model.energies[:, 0] - p * self.t_min).sum())  # all fastest
        m = len(seg_node)

        # Variables: [start_0..start_{n-1}, fill_0..fill_{m-1}, T]. Every row says "node a
        # finishes before b starts" (b a successor's start, or T for a sink):
        #   start_a + sum fills(a) - x_b <= -t_min_a
        t_col = n + m
        fills_of = [[] for _ in range(n)]
        for s, node in enumerate(seg_node):
            fills_of[node].append(n + s)
        rows, cols, vals, rhs = [], [], [], []
        sinks = np.flatnonzero((dag.succs == -1).all(axis=1))
        for r, (node, later) in enumerate([*dag.edges(), *((int(i), t_col) for i in sinks)]):
            row_cols = [node, later, *fills_of[node]]
            rows += [r] * len(row_cols)
            cols += row_cols
            vals += [1.0, -1.0] + [1.0] * len(fills_of[node])
            rhs.append(-self.t_min[node])
        r = len(rhs)
        a = sparse.csc_matrix((vals, (rows, cols)), shape=(r, n + m + 1))

        lp = highspy.HighsLp()
        lp.num_col_ = n + m + 1
        lp.num_row_ = r
        lp.col_cost_ = np.concatenate([np.zeros(n), seg_slope, [0.0]])
        lp.col_lower_ = np.zeros(n + m + 1)
        lp.col_upper_ = np.concatenate([np.full(n, highspy.kHighsInf), self.seg_len, [0.0]])
        lp.row_lower_ = np.full(r, -highspy.kHighsInf)
        lp.row_upper_ = np.array(rhs)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = a.indptr
        lp.a_matrix_.index_ = a.indices
        lp.a_matrix_.value_ = a.data
        self.highs = highspy.Highs()
        self.highs.setOptionValue("output_flag", False)
        self.highs.setOptionValue("solver", "simplex")
        self.highs.passModel(lp)
        self.t_col = t_col
        self.n, self.m = n, m

    def energy(self, deadline: float) -> float:
        """Relaxed minimum energy at `deadline` (after `durations` solved it)."""
        objective = self.highs.getInfo().objective_function_value
        return self.base_cost + objective + self.model.blocking_power * self.model.num_stage_gpus * deadline

    def durations(self, deadline: float) -> np.ndarray:
        """Relaxed optimal durations at `deadline` (warm-started from the previous solve)."""
        h = self.highs
        h.changeColBounds(self.t_col, deadline, deadline)
        h.run()
        status = h.getModelStatus()
        if status != highspy.HighsModelStatus.kOptimal:
            raise SolverError(f"LP relaxation at T={deadline:.6f}s ended with {h.modelStatusToString(status)}")
        x = np.asarray(h.getSolution().col_value)
        fills = np.clip(x[self.n : self.n + self.m], 0.0, self.seg_len)
        return self.t_min + np.bincount(self.seg_node, weights=fills, minlength=self.n)


def _lower_hull(t: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Indices of the lower convex hull of points sorted by increasing t."""
    hull: list[int] = []
    for i in range(len(t)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b lies on or above segment a-i: drop it.
            if (c[b] - c[a]) * (t[i] - t[a]) >= (c[i] - c[a]) * (t[b] - t[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return np.array(hull, dtype=np.int64)


def _slowest_fitting(option_times: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Index of the slowest option whose time fits in `window` (0 if even the fastest does not)."""
    return np.maximum(np.searchsorted(option_times, window + _EPS, side="right") - 1, 0)


def round_to_options(model: CostModel, durations: np.ndarray) -> dict[str, np.ndarray]:
    """Per plan (column), each relaxed duration rounded to a profiled clock, three ways.

    `down`: the slowest clock no slower than the duration, so the relaxation's deadline holds.
    `up` / `nearest`: the next slower / the nearest clock; such plans overshoot the deadline a
    little but are often the best plans at their own, slightly longer, time.
    """
    down = np.empty(durations.shape, dtype=np.int64)
    # Computations of one stage and kind share their option table: one search per table.
    tables, table_of = np.unique(model.times, axis=0, return_inverse=True)
    for t, table in enumerate(tables):
        nodes = np.flatnonzero(table_of.ravel() == t)
        options = table[np.isfinite(table)]
        down[nodes] = _slowest_fitting(options, durations[nodes])
    t_down = np.take_along_axis(model.times, down, axis=1)
    last = (model.num_options - 1)[:, None]
    up = np.where(t_down < durations - _EPS, np.minimum(down + 1, last), down)
    t_up = np.take_along_axis(model.times, up, axis=1)
    nearest = np.where(t_up - durations < durations - t_down, up, down)
    return {"down": down, "up": up, "nearest": nearest}


def reclaim_slack(
    model: CostModel,
    choice: np.ndarray,
    deadlines: np.ndarray,
    cap: np.ndarray | None = None,
    backward_first: bool = False,
) -> np.ndarray:
    """Slow computations into their slack, for every plan (column) at once.

    Forward pass: latest finish times with the current durations bound each computation; walking
    the DAG in topological order, a computation starts as early as its (possibly slowed)
    predecessors allow and takes the slowest clock that still finishes by its latest finish time. The
    backward pass mirrors it (latest starts), handing leftover slack to later computations;
    `backward_first` swaps the passes, favouring late computations.
    Durations only grow and every plan still meets its deadline. `cap` (same shape as
    `choice`), if given, bounds how slow each computation may become.
    """
    if choice.shape[1] > _CHUNK:  # bound memory: a few (N, _CHUNK) matrices at a time
        return np.concatenate(
            [
                reclaim_slack(
                    model, choice[:, k : k + _CHUNK], deadlines[k : k + _CHUNK],
                    None if cap is None else cap[:, k : k + _CHUNK], backward_first,
                )
                for k in range(0, choice.shape[1], _CHUNK)
            ],
            axis=1,
        )
    dag = model.dag
    option_times = model.option_times
    choice = np.ascontiguousarray(choice, dtype=np.int64)  # row-wise passes need C order
    durations = np.take_along_axis(model.times, choice, axis=1)

    def refit(node: int, window: np.ndarray) -> None:
        best = _slowest_fitting(option_times[node], window)
        if cap is not None:
            best = np.minimum(best, cap[node])
        best = np.maximum(best, choice[node])
        choice[node] = best
        durations[node] = option_times[node][best]

    def forward_pass() -> None:
        latest_finish = dag.latest_finish_times(durations, deadlines)
        finish = np.zeros((len(dag) + 1, choice.shape[1]))
        for node, (p0, p1) in enumerate(preds):
            start = np.maximum(finish[p0], finish[p1])
            refit(node, latest_finish[node] - start)
            finish[node] = start + durations[node]

    def backward_pass() -> None:
        earliest_start = dag.finish_times(durations) - durations
        latest_start = np.empty((len(dag) + 1, choice.shape[1]))
        latest_start[-1] = deadlines
        for node in range(len(dag) - 1, -1, -1):
            s0, s1 = succs[node]
            end = np.minimum(latest_start[s0], latest_start[s1])
            refit(node, end - earliest_start[node])
            latest_start[node] = end - durations[node]

    preds, succs = dag.preds.tolist(), dag.succs.tolist()
    passes = (backward_pass, forward_pass) if backward_first else (forward_pass, backward_pass)
    for run_pass in passes:
        run_pass()
    return choice


def repair_deadline(
    model: CostModel, choice: np.ndarray, deadlines: np.ndarray, frozen: np.ndarray | None = None
) -> np.ndarray:
    """Make every plan (column) meet its deadline again by speeding up critical computations.

    Each round, in every late plan, the computation on its longest path whose next faster clock
    costs the least extra effective energy per second saved gets that clock. `frozen` (bool,
    same shape) marks computations repair must not touch. Plans that cannot be repaired keep
    every unfrozen computation at its fastest clock (and so stay late).
    """
    choice = choice.copy()
    # Moving node i from option k to k-1 saves saved[i, k] seconds for extra[i, k] effective
    # energy (+inf where there is no faster option).
    with np.errstate(invalid="ignore"):
        cost = model.energies - model.blocking_power * model.times
        saved = model.times[:, 1:] - model.times[:, :-1]
        extra = cost[:, :-1] - cost[:, 1:]
        usable = np.isfinite(saved) & np.isfinite(extra) & (saved > 0)
    saved = np.c_[np.zeros(len(saved)), np.where(usable, saved, 0.0)]
    extra = np.c_[np.full(len(extra), np.inf), np.where(usable, extra, np.inf)]
    rows = np.arange(model.num_nodes)[:, None]
    for _ in range(int(model.num_options.sum())):
        durations = model.times[rows, choice]
        finish = model.dag.finish_times(durations)
        makespan = finish.max(axis=0)
        late = makespan > deadlines + _EPS
        if not late.any():
            break
        slack = model.dag.latest_finish_times(durations, deadlines) - finish
        critical = slack <= slack.min(axis=0) + _EPS
        # Price a step by the time the plan still needs, not by all the time it saves: a big
        # step that overshoots the deficit is charged in full.
        useful = np.minimum(saved[rows, choice], makespan - deadlines)
        with np.errstate(divide="ignore", invalid="ignore"):
            price = np.where(useful > 0, extra[rows, choice] / useful, np.inf)
        score = np.where(critical & (choice > 0), price, np.inf)
        if frozen is not None:
            score = np.where(frozen, np.inf, score)
        pick = score.argmin(axis=0)
        can = late & np.isfinite(score[pick, np.arange(choice.shape[1])])
        if not can.any():
            break
        choice[pick[can], np.flatnonzero(can)] -= 1
    return choice


def polish(model: CostModel, choice: np.ndarray, deadlines: np.ndarray, rounds: int = 20) -> np.ndarray:
    """Local search on each plan (column): a move puts one computation at any other clock,
    repairs the deadline (`repair_deadline`, the moved computation frozen) and reclaims slack;
    the best improving neighbour (either reclaim direction) is kept until none improves.

    Rounding and greedy reclaim can settle on a distribution of clocks that no single-step
    change improves; a move here changes many computations at once. A round evaluates N x K
    neighbours per plan, each repaired in up to ~K DAG passes of N nodes, so the solver runs it
    only while deadlines x (N x K)^2 stays within `SolverOptions.polish_budget`.
    """
    choice = choice.copy()
    n, num_plans = choice.shape
    width_k = model.times.shape[1]
    width = n * width_k
    node_of, option_of = np.divmod(np.arange(width), width_k)
    _, energy = model.replay(choice, switch_latency_s=0.0)
    active = np.arange(num_plans)
    for _ in range(rounds):
        if not active.size:
            break
        base = np.repeat(choice[:, active], width, axis=1)
        column = np.arange(base.shape[1])
        node = np.tile(node_of, active.size)
        option = np.tile(option_of, active.size)
        valid = (option < model.num_options[node]) & (option != base[node, column])
        base[node[valid], column[valid]] = option[valid]
        frozen = np.zeros(base.shape, dtype=bool)
        frozen[node, column] = True
        plan_deadlines = np.repeat(deadlines[active], width)
        repaired = repair_deadline(model, base, plan_deadlines, frozen)
        cap = np.where(frozen, repaired, model.times.shape[1] - 1)
        # Both reclaim directions: freed time can be worth most early or late in the iteration.
        neighbours = np.concatenate(
            [reclaim_slack(model, repaired, plan_deadlines, cap, backward_first=b) for b in (False, True)],
            axis=1,
        )
        times, energies = model.replay(neighbours, switch_latency_s=0.0)
        ok = np.tile(valid, 2) & (times <= np.tile(plan_deadlines, 2) + _EPS)
        energies = np.where(ok, energies, np.inf).reshape(2, active.size, width)
        energies = energies.transpose(1, 0, 2).reshape(active.size, 2 * width)
        best = energies.argmin(axis=1)
        best_energy = energies[np.arange(active.size), best]
        improved = best_energy < energy[active] - 1e-9
        direction, offset = np.divmod(best, width)
        chosen = neighbours[:, direction * base.shape[1] + np.arange(active.size) * width + offset]
        choice[:, active[improved]] = chosen[:, improved]
        energy[active[improved]] = best_energy[improved]
        active = active[improved]
    return choice


def solve_frontier(
    schedule: PipelineSchedule,
    profile: Profile,
    blocking_power: float,
    options: SolverOptions | None = None,
    switch_latency_s: float = 0.0,
) -> Frontier:
    """Every Pareto-optimal (iteration time, energy) plan from T_min to the min-energy plan.

    `switch_latency_s`: effective latency of a clock change (see `energy.py`); every plan's
    time and energy are the latency-aware replay of its clocks, and changes that cost more
    than they save are merged away. 0 plans for instant clock changes.
    """
    options = options or SolverOptions()
    if options.resolution <= 0 or options.anchors < 2 or options.grid_oversampling < 1:
        raise SolverError("solver options: resolution > 0, anchors >= 2, grid_oversampling >= 1")
    model = CostModel(schedule, profile, blocking_power, switch_latency_s)
    return FrontierSolver(model, options).solve()


class FrontierSolver:
    """Runs the three steps of the module docstring on one `CostModel`."""

    def __init__(self, model: CostModel, options: SolverOptions):
        self.model = model
        self.options = options

    def solve(self) -> Frontier:
        model = self.model
        fastest = model.fastest_choice()
        t_min = float(model.dag.makespan(model.times[:, 0]))
        slowest = model.num_options - 1
        t_slowest = float(model.dag.makespan(model.times[np.arange(model.num_nodes), slowest]))
        anchors, anchor_durations = self._relaxed_anchors(t_min, t_slowest)
        grid = self._deadline_grid(t_min, float(anchors[-1]))
        relaxed = _interpolate(anchors, anchor_durations, grid)
        pool = _CandidatePool(model, fastest[:, None])

        rounded = round_to_options(model, relaxed)
        feasible = reclaim_slack(model, rounded["down"], grid)
        pool.add(feasible)
        if model.switch_latency_s > 0:
            # Latency makes most of these plans late; win their deadlines back (every other
            # deadline: neighbours differ by little and the pass costs a few replays).
            stride = slice(None, None, _REPAIR_STRIDE)
            pool.add(repair_latency(model, feasible[:, stride], grid[stride]))
        overshooting = np.concatenate([rounded["up"], rounded["nearest"]], axis=1)
        pool.add(overshooting)
        # Rounding loses more at some deadlines than at others. Give every deadline a second
        # chance: the best plan found for any earlier deadline, stretched into the new slack.
        pool.add(reclaim_slack(model, pool.best_for(grid), grid))

        resolution = self.options.resolution
        # Where the frontier is flat, Pareto plans can be more than `resolution` apart; stretch
        # the plan at each gap's start into deadlines inside the gap so every step has a plan.
        for _ in range(_GAP_ROUNDS):
            keep = pool.frontier(resolution)
            stretch_from, stretch_to = _gap_deadlines(pool.times[keep], resolution)
            if not stretch_to.size:
                break
            pool.add(reclaim_slack(model, pool.choices[:, keep[stretch_from]], stretch_to))

        if len(grid) * (model.num_nodes * model.times.shape[1]) ** 2 <= self.options.polish_budget:
            # The best plan at every grid deadline, then every frontier plan at its own time
            # (a plan that ties a better one in time is only found there).
            pool.add(polish(model, pool.best_for(grid), grid))
            keep = pool.frontier(resolution)
            pool.add(polish(model, pool.choices[:, keep], pool.times[keep]))

        if model.switch_latency_s > 0:
            # Merging pays most near T_min, where every switch on the critical path costs
            # time: all the fastest Pareto plans, then an even sample of the rest.
            keep = np.array(_pareto(pool.times, pool.energies))
            rest = keep[_MERGE_FASTEST:]
            sample = rest[np.linspace(0, len(rest) - 1, min(len(rest), _MERGE_SAMPLE)).astype(int)]
            keep = np.r_[keep[:_MERGE_FASTEST], sample] if rest.size else keep
            pool.add(merge_switches(model, pool.choices[:, keep], pool.times[keep]))

        # Only non-dominated plans: a gap filler (slower and no cheaper than a faster plan)
        # would be read as a frontier point by users and the straggler policy.
        keep = np.array(_pareto(pool.times, pool.energies))
        plans = tuple(model.make_plans(pool.choices[:, keep], pool.times[keep], pool.energies[keep]))
        frontier = Frontier(model.schedule.describe(), model.blocking_power, plans, model.to_plan(fastest))
        logger.info(
            "frontier: %d plans, T %.4f..%.4f s, energy %.1f..%.1f J (%d LP anchors)",
            len(plans), plans[0].time, plans[-1].time, plans[0].energy, plans[-1].energy, len(anchors),
        )
        return frontier

    def _deadline_grid(self, t_min: float, t_max: float) -> np.ndarray:
        """Deadlines from T_min to t_max: `resolution` apart, finer for short frontiers."""
        options = self.options
        step = min(options.resolution / options.grid_oversampling, (t_max - t_min) / options.min_grid_points)
        step = max(step, 1e-9)
        grid = np.arange(t_min, t_max + step, step)
        grid[-1] = max(grid[-1], t_max)
        return grid

    def _relaxed_anchors(self, t_min: float, t_slowest: float) -> tuple[np.ndarray, np.ndarray]:
        """Convex-relaxation durations (N, anchors) at evenly spaced deadlines from T_min.

        The walk stops once the relaxed energy has risen at two anchors past its minimum:
        slower than the minimum-energy plan, energy only grows (blocking power outweighs what
        slower clocks save), so deadlines there are not worth planning.
        """
        n = self.model.num_nodes
        count = max(self.options.anchors, self.options.anchor_budget // n, 2)
        if t_slowest - t_min < _EPS:  # slower clocks save no time: a single deadline
            count = 1
        spacing = (t_slowest - t_min) / max(count - 1, 1)
        relaxation = _ConvexRelaxation(self.model)
        anchors, durations, energies = [], [], []
        progress = None
        if self.options.progress:
            from tqdm import tqdm

            progress = tqdm(total=count, desc="frontier LP anchors", unit="anchor")
        for k in range(count):
            deadline = t_min + k * spacing if k < count - 1 else max(t_slowest, t_min)
            durations.append(relaxation.durations(deadline))
            energies.append(relaxation.energy(deadline))
            anchors.append(deadline)
            if progress is not None:
                progress.update()
            if k >= 2 and min(energies[-2:]) > min(energies):
                break
        if progress is not None:
            progress.close()
        return np.array(anchors), np.stack(durations, axis=1)


class _CandidatePool:
    """Every candidate plan found so far (columns), with its replayed time and energy."""

    # Option indices fit in int16; a pool holds tens of thousands of plans of thousands of
    # computations, so this keeps it a few tens of MiB.
    DTYPE = np.int16

    def __init__(self, model: CostModel, choices: np.ndarray):
        self.model = model
        self.choices = choices.astype(self.DTYPE)
        self.times, self.energies = model.replay(choices)

    def add(self, choices: np.ndarray) -> None:
        parts = [self.model.replay(choices[:, k : k + _CHUNK]) for k in range(0, choices.shape[1], _CHUNK)]
        times, energies = np.concatenate([t for t, _ in parts]), np.concatenate([e for _, e in parts])
        self.choices = np.concatenate([self.choices, choices.astype(self.DTYPE)], axis=1)
        self.times = np.r_[self.times, times]
        self.energies = np.r_[self.energies, energies]

    def best_for(self, deadlines: np.ndarray) -> np.ndarray:
        """Choices of the lowest-energy plan meeting each deadline."""
        return self.choices[:, _best_so_far(self.times, self.energies, deadlines)]

    def frontier(self, resolution: float) -> np.ndarray:
        """Indices of the Pareto plans plus the gap-filling ones, by time."""
        return np.array(_fill_gaps(self.times, self.energies, _pareto(self.times, self.energies), resolution))


def _interpolate(anchors: np.ndarray, durations: np.ndarray, deadlines: np.ndarray) -> np.ndarray:
    """Relaxed durations at each deadline: the convex combination of the two neighbouring
    anchors' LP solutions, which is feasible for the interpolated deadline."""
    if len(anchors) == 1:
        return np.repeat(durations, len(deadlines), axis=1)
    hi = np.clip(np.searchsorted(anchors, deadlines, side="left"), 1, len(anchors) - 1)
    lo = hi - 1
    weight = np.clip((deadlines - anchors[lo]) / (anchors[hi] - anchors[lo]), 0.0, 1.0)
    return durations[:, lo] * (1 - weight) + durations[:, hi] * weight


def _best_so_far(times: np.ndarray, energies: np.ndarray, deadlines: np.ndarray) -> np.ndarray:
    """For each deadline, the index of the lowest-energy plan whose time meets it."""
    order = np.argsort(times, kind="stable")
    sorted_energy = energies[order]
    running = np.minimum.accumulate(sorted_energy)
    # position of the running minimum within the sorted order
    arg = np.arange(len(order))
    arg = np.where(sorted_energy == running, arg, 0)
    arg = np.maximum.accumulate(arg)
    count = np.searchsorted(times[order], deadlines + _EPS, side="right")
    return order[arg[np.maximum(count - 1, 0)]]


def _gap_deadlines(kept_times: np.ndarray, resolution: float) -> tuple[np.ndarray, np.ndarray]:
    """(index of the plan starting each gap, deadline) pairs, finely spaced inside each gap."""
    starts, deadlines = [], []
    bin_width = resolution * _FILL_BIN
    for k, (a, b) in enumerate(zip(kept_times[:-1], kept_times[1:])):
        if b - a > 2 * bin_width:
            inner = np.arange(a + bin_width, b, bin_width)
            starts += [k] * len(inner)
            deadlines += inner.tolist()
    return np.array(starts, dtype=np.int64), np.array(deadlines)


def _fill_gaps(times: np.ndarray, energies: np.ndarray, keep: list[int], resolution: float) -> list[int]:
    """Add, inside every gap wider than `resolution` between Pareto plans, the lowest-energy
    candidate of each bin (bins half the resolution wide: plans in neighbouring bins are less
    than `resolution` apart).

    Such gaps only occur where the frontier is flat (a slower plan cannot beat a faster one by
    more than rounding noise); the fill keeps the promised time resolution, and the straggler
    lookup still picks the cheapest plan meeting a deadline.
    """
    out = list(keep)
    kept_times = times[keep]
    bin_width = resolution * _FILL_BIN
    for a, b in zip(kept_times[:-1], kept_times[1:]):
        if b - a <= 2 * bin_width:
            continue
        inside = np.flatnonzero((times > a) & (times < b))
        if not inside.size:
            continue
        bins = np.floor((times[inside] - a) / bin_width).astype(np.int64)
        for bin_id in np.unique(bins):
            members = inside[bins == bin_id]
            out.append(int(members[np.argmin(energies[members])]))
    return sorted(set(out), key=lambda j: (times[j], energies[j]))


def _pareto(times: np.ndarray, energies: np.ndarray) -> list[int]:
    """Indices of Pareto-optimal (time, energy) points, by increasing time.

    Times equal to 1e-12 s count as equal: replays of different plans along the same critical
    path can differ by rounding, and a costlier plan must not win on that.
    """
    order = np.lexsort((energies, np.round(times, 12)))
    keep, best = [], np.inf
    for j in order:
        if energies[j] < best - 1e-9:
            keep.append(int(j))
            best = energies[j]
    return keep
