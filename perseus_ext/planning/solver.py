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
import weakref

import numpy as np

from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import Frontier
from perseus_ext.planning.options import SolverOptions, check_problem_size
from perseus_ext.planning.profile import Profile, pareto_indices
from perseus_ext.planning.relaxation import interpolate, relaxed_anchors
from perseus_ext.planning.schedule import PipelineSchedule
from perseus_ext.planning.switching import merge_switches, repair_latency

logger = logging.getLogger(__name__)

_EPS = 1e-9
_GAP_ROUNDS = 6  # stretch rounds; each fills the gaps the previous one opened
_FILL_BIN = 0.5  # gap-fill bin width as a fraction of the resolution
_MERGE_FASTEST, _MERGE_SAMPLE = 64, 64  # Pareto plans the latency merge pass works on
_REPAIR_STRIDE = 2  # the latency repair works on every other grid deadline
_CELLS = 4_000_000  # (computation, plan) cells per batched DAG pass (bounds peak memory)
# Cells per batched replay: a latency-aware replay makes a dozen (N, plans) arrays, and these
# stay in cache at this size (3-5x faster at 8 x 96 than 4M cells; a plain replay is unaffected).
_REPLAY_CELLS = 400_000


def _slowest_fitting(option_times: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Index of the slowest option whose time fits in `window` (0 if even the fastest does not)."""
    return np.maximum(np.searchsorted(option_times, window + _EPS, side="right") - 1, 0)


class _OptionTables:
    """Computations of one stage and kind share their option table, so searches for the best
    clock run once per table (and, in the DAG passes, once per table and level), not per node."""

    def __init__(self, model: CostModel):
        tables, table_of = np.unique(model.times, axis=0, return_inverse=True)
        table_of = table_of.ravel()
        self.options = [table[np.isfinite(table)] for table in tables]
        self.nodes = [np.flatnonzero(table_of == t) for t in range(len(tables))]
        # Per DAG level: (rows within the level, or None for all of them; table) pairs.
        self.by_level: list[list[tuple[np.ndarray | None, np.ndarray]]] = []
        for lv in model.dag.levels:
            ids = table_of[lv]
            present = np.unique(ids)
            if len(present) == 1:
                self.by_level.append([(None, self.options[present[0]])])
            else:
                self.by_level.append([(np.flatnonzero(ids == t), self.options[t]) for t in present])

    @classmethod
    def of(cls, model: CostModel) -> "_OptionTables":
        tables = _TABLES.get(model)
        if tables is None:
            tables = _TABLES[model] = cls(model)
        return tables

    def refit(
        self, level: int, window: np.ndarray, choice: np.ndarray, durations: np.ndarray,
        cap: np.ndarray | None,
    ) -> None:
        """Give every node of DAG level `level` the slowest option that fits in its `window`
        (rows), no faster than its `choice` and no slower than its `cap`; `choice` and
        `durations` are the level's rows and are updated in place."""
        for rows, options in self.by_level[level]:
            part = slice(None) if rows is None else rows
            best = _slowest_fitting(options, window[part])
            if cap is not None:
                np.minimum(best, cap[part], out=best)
            np.maximum(best, choice[part], out=best)
            choice[part] = best
            durations[part] = options[best]


_TABLES: "weakref.WeakKeyDictionary[CostModel, _OptionTables]" = weakref.WeakKeyDictionary()


def round_to_options(model: CostModel, durations: np.ndarray) -> dict[str, np.ndarray]:
    """Per plan (column), each relaxed duration rounded to a profiled clock, three ways.

    `down`: the slowest clock no slower than the duration, so the relaxation's deadline holds.
    `up` / `nearest`: the next slower / the nearest clock; such plans overshoot the deadline a
    little but are often the best plans at their own, slightly longer, time.
    Option indices come as int16 (what the candidate pool stores): a third of the memory traffic.
    """
    rounded = {way: np.empty(durations.shape, dtype=_CandidatePool.DTYPE) for way in ("down", "up", "nearest")}
    tables = _OptionTables.of(model)
    for nodes, options in zip(tables.nodes, tables.options):
        wanted = durations[nodes]
        down = _slowest_fitting(options, wanted)
        t_down = options[down]
        up = np.minimum(down + (t_down < wanted - _EPS), len(options) - 1)
        t_up = options[up]
        rounded["down"][nodes] = down
        rounded["up"][nodes] = up
        rounded["nearest"][nodes] = np.where(t_up - wanted < wanted - t_down, up, down)
    return rounded


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
    `choice`), if given, bounds how slow each computation may become. The passes go level by
    level (no edge joins two nodes of one level, so a level's nodes are independent).
    """
    step = _chunk_columns(model.num_nodes)
    if choice.shape[1] > step:  # bound memory: a few (N, step) matrices at a time
        return np.concatenate(
            [
                reclaim_slack(
                    model, choice[:, k : k + step], deadlines[k : k + step],
                    None if cap is None else cap[:, k : k + step], backward_first,
                )
                for k in range(0, choice.shape[1], step)
            ],
            axis=1,
        )
    dag = model.dag
    tables = _OptionTables.of(model)
    choice = np.array(choice, dtype=np.int64, order="C")  # a copy in C order: row-wise passes write into it
    durations = np.take_along_axis(model.times, choice, axis=1)

    def refit(level: int, lv: slice, window: np.ndarray) -> None:
        tables.refit(level, window, choice[lv], durations[lv], None if cap is None else cap[lv])

    def forward_pass() -> None:
        latest_finish = dag.latest_finish_times(durations, deadlines)
        finish = np.zeros((len(dag) + 1, choice.shape[1]))
        p0, p1 = dag.preds[:, 0], dag.preds[:, 1]
        for level, lv in enumerate(dag.levels):
            start = np.maximum(finish[p0[lv]], finish[p1[lv]])
            refit(level, lv, latest_finish[lv] - start)
            finish[lv] = start + durations[lv]

    def backward_pass() -> None:
        earliest_start = dag.finish_times(durations) - durations
        latest_start = np.empty((len(dag) + 1, choice.shape[1]))
        latest_start[-1] = deadlines
        s0, s1 = dag.succs[:, 0], dag.succs[:, 1]
        for level in range(len(dag.levels) - 1, -1, -1):
            lv = dag.levels[level]
            end = np.minimum(latest_start[s0[lv]], latest_start[s1[lv]])
            refit(level, lv, end - earliest_start[lv])
            latest_start[lv] = end - durations[lv]

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
    options.validate()  # also catches options changed with object.__setattr__ or pickled
    num_nodes = sum(len(order) for order in schedule.orders)
    check_problem_size(options, num_nodes, options.min_grid_points, _anchor_count(options, num_nodes))
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
        grid_bound = int((t_slowest - t_min) / self._grid_step(t_min, t_slowest)) + 2
        check_problem_size(
            self.options, model.num_nodes, grid_bound,
            _anchor_count(self.options, model.num_nodes), t_slowest - t_min,
        )
        anchors, anchor_durations = relaxed_anchors(
            model, _anchor_count(self.options, model.num_nodes), t_min, t_slowest, self.options.progress
        )
        grid = self._deadline_grid(t_min, float(anchors[-1]))
        pool = _CandidatePool(model, fastest[:, None])
        # Deadlines in blocks: the float and int64 intermediates of one block stay small, only
        # the int16 candidates accumulate (peak memory ~ the pool, not 10x the pool).
        block = 2 * max(32, _CELLS // (2 * model.num_nodes))
        for k in range(0, len(grid), block):
            deadlines = grid[k : k + block]
            rounded = round_to_options(model, interpolate(anchors, anchor_durations, deadlines))
            feasible = reclaim_slack(model, rounded["down"], deadlines)
            pool.add(feasible)
            if model.switch_latency_s > 0:
                # Latency makes most of these plans late; win their deadlines back (every
                # other deadline: neighbours differ by little and the pass costs a few replays).
                stride = slice(None, None, _REPAIR_STRIDE)
                late = feasible[:, stride]
                step = _chunk_columns(model.num_nodes, _REPLAY_CELLS)  # its latency replays stay in cache
                pool.add(np.concatenate([
                    repair_latency(model, late[:, j : j + step], deadlines[stride][j : j + step])
                    for j in range(0, late.shape[1], step)
                ], axis=1))
            pool.add(rounded["up"])
            pool.add(rounded["nearest"])
        # Rounding loses more at some deadlines than at others. Give every deadline a second
        # chance: the best plan found for any earlier deadline, stretched into the new slack.
        best = _best_so_far(pool.times, pool.energies, grid)
        for k in range(0, len(grid), block):
            pool.add(reclaim_slack(model, pool.choices[:, best[k : k + block]], grid[k : k + block]))

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

    def _grid_step(self, t_min: float, t_max: float) -> float:
        """Grid spacing: `resolution` (over `grid_oversampling`), finer for short frontiers."""
        options = self.options
        step = min(options.resolution / options.grid_oversampling, (t_max - t_min) / options.min_grid_points)
        return max(step, 1e-9)

    def _deadline_grid(self, t_min: float, t_max: float) -> np.ndarray:
        """Deadlines from T_min to t_max, `_grid_step` apart."""
        step = self._grid_step(t_min, t_max)
        grid = np.arange(t_min, t_max + step, step)
        grid[-1] = max(grid[-1], t_max)
        return grid

class _CandidatePool:
    """Every candidate plan found so far (columns), with its replayed time and energy."""

    # Option indices fit in int16; a pool holds tens of thousands of plans of thousands of
    # computations, so this keeps it a few tens of MiB.
    DTYPE = np.int16

    def __init__(self, model: CostModel, choices: np.ndarray):
        self.model = model
        self._buffer = np.empty((model.num_nodes, 1024), dtype=self.DTYPE)
        self.size = 0
        self.times, self.energies = np.empty(0), np.empty(0)
        self.add(choices)

    @property
    def choices(self) -> np.ndarray:
        """(N, plans) option indices of every candidate (a view; `add` may reallocate)."""
        return self._buffer[:, : self.size]

    def add(self, choices: np.ndarray) -> None:
        step = _chunk_columns(self.model.num_nodes, _REPLAY_CELLS)
        parts = [self.model.replay(choices[:, k : k + step]) for k in range(0, choices.shape[1], step)]
        times, energies = np.concatenate([t for t, _ in parts]), np.concatenate([e for _, e in parts])
        end = self.size + choices.shape[1]
        if end > self._buffer.shape[1]:  # grow by half: amortised O(1) per plan
            grown = np.empty((self._buffer.shape[0], max(end, self._buffer.shape[1] * 3 // 2)), self.DTYPE)
            grown[:, : self.size] = self.choices
            self._buffer = grown
        self._buffer[:, self.size : end] = choices
        self.size = end
        self.times = np.r_[self.times, times]
        self.energies = np.r_[self.energies, energies]

    def best_for(self, deadlines: np.ndarray) -> np.ndarray:
        """Choices of the lowest-energy plan meeting each deadline."""
        return self.choices[:, _best_so_far(self.times, self.energies, deadlines)]

    def frontier(self, resolution: float) -> np.ndarray:
        """Indices of the Pareto plans plus the gap-filling ones, by time."""
        return np.array(_fill_gaps(self.times, self.energies, _pareto(self.times, self.energies), resolution))


def _chunk_columns(num_nodes: int, cells: int = _CELLS) -> int:
    """Plans per batched DAG pass: `cells` cells, at least 64 plans."""
    return max(64, cells // max(num_nodes, 1))


def _anchor_count(options: SolverOptions, num_nodes: int) -> int:
    """LP anchors: `anchors`, more for small pipelines (up to `anchor_budget` / computations)."""
    return max(options.anchors, options.anchor_budget // max(num_nodes, 1), 2)


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
    """Indices of Pareto-optimal (time, energy) points, by increasing time. Times within 1e-12 s
    count as equal: replays of different plans along the same critical path can differ by
    rounding, and a costlier plan must not win on that."""
    return pareto_indices(np.round(times, 12), energies, tolerance=1e-9)
