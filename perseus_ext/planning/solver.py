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
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from perseus_ext.background import start_background
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.first_pass import FirstPass, Replayed, replayed
from perseus_ext.planning.frontier import Frontier
from perseus_ext.planning.options import SolverOptions, check_problem_size
from perseus_ext.planning.passes import CELLS, CHOICE_DTYPE, polish, reclaim_slack, repair_deadline
from perseus_ext.planning.profile import Profile, pareto_indices
from perseus_ext.planning.relaxation import AnchorWalk
from perseus_ext.planning.schedule import PipelineSchedule
from perseus_ext.planning.switching import merge_switches

logger = logging.getLogger(__name__)

_EPS = 1e-9
# Stretch rounds; each fills the gaps the previous one opened. A third round (8 x 24: 4
# deadlines) found nothing in 8 of the 9 reference cases and 0.0024 % at one deadline of A40
# 8 x 96, for the cost of a DAG pass and a frontier (docs/solver.md).
_GAP_ROUNDS = 2
# Gap-targeted polish (step 5): deadlines whose best plan is more than this over the LP's bound
# are its targets; it needs this many plans to be worth running (fewer, and the deadlines between
# them gain little), and its local search moves a computation by one clock step for at most
# these rounds (A40 8 x 8: as close to the MILP as +-2 steps and 20 rounds, in a third of the time).
_GAP_TARGET, _GAP_POLISH_MIN_PLANS, _GAP_POLISH_ROUNDS = 1e-3, 8, 6
_FILL_BIN = 0.5  # gap-fill bin width as a fraction of the resolution
_MERGE_FASTEST, _MERGE_SAMPLE = 64, 64  # Pareto plans the latency merge pass works on
# Fewer plans than this go through a pass on one thread: below it, handing the GIL back and
# forth costs what the second thread gains.
_SPLIT_COLUMNS = 1024


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
    """
    options = options or SolverOptions()
    options.validate()  # also catches options changed with object.__setattr__ or pickled
    num_nodes = sum(len(order) for order in schedule.orders)
    check_problem_size(options, num_nodes, options.min_grid_points, _anchor_count(options, num_nodes))
    model = planning_model(schedule, profile, blocking_power, switch_latency_s, wait_aware=wait_aware)
    return FrontierSolver(model, options, wait_aware).solve()


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
        pool = _CandidatePool.around(first_pass, fastest[:, None])
        reclaimed = first_pass.reclaimed_columns()
        # The ordinary frontier's deadlines (to the walk's ordinary end past T*); the
        # extension's follow on the same grid.
        ordinary_grid = grid[: len(self._deadline_grid(t_min, walk.ordinary_end, walk.ordinary_end))]
        # Rounding loses more at some deadlines than at others. Give deadlines a second chance:
        # the best plan found for any earlier deadline, stretched into the new slack (past the
        # ordinary end: best in energy - blocking power x stages x time).
        best = _best_so_far(pool.times, pool.energies, ordinary_grid)
        if len(grid) > len(ordinary_grid):
            waiting = pool.energies - self._slope * pool.times
            best = np.r_[best, _best_so_far(pool.times, waiting, grid[len(ordinary_grid):])]
        # Where that plan is the deadline's own reclaimed one, a second reclaim would give it
        # back unchanged (a reclaim leaves no slack a computation could take: 8 x 24, 337 of
        # 818 deadlines). Of the others, every other one: the deadline between is served by the
        # plan carried to the one before it, a grid step earlier (carrying to both took ~5 ms
        # more of the 8 x 24 command's ~0.27 s, for 0.002 % less energy on average: docs/solver.md).
        carry = np.flatnonzero(best != reclaimed)[::2]
        block = _even_block(len(carry), block)
        for k in range(0, len(carry), block):
            carried, deadlines = pool.choices[:, best[carry[k : k + block]]], grid[carry[k : k + block]]
            pool.extend_all(_in_two(
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
            stretch_from, stretch_to = _gap_deadlines(pool.times[keep], resolution)
            if not stretch_to.size:
                break
            stretched = pool.choices[:, keep[stretch_from]]
            pool.extend_all(_in_two(
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
            keep = np.array(_pareto(pool.times, pool.energies))
            rest = keep[_MERGE_FASTEST:]
            sample = rest[np.linspace(0, len(rest) - 1, min(len(rest), _MERGE_SAMPLE)).astype(int)]
            keep = np.r_[keep[:_MERGE_FASTEST], sample] if rest.size else keep
            pool.add(merge_switches(model, pool.choices[:, keep], pool.times[keep]))

        # Only non-dominated plans: a gap filler (slower and no cheaper than a faster plan)
        # would be read as a frontier point by users and the straggler policy.
        keep = np.array(_pareto(pool.times, pool.energies))
        extension_start = None
        if self.wait_aware:
            # Cheapest in energy - P_block S T for some deadline T' the iteration is held to,
            # and not already an ordinary plan (mostly past T*).
            waiting = _pareto(pool.times, pool.energies - self._slope * pool.times)
            extension = np.setdiff1d(waiting, keep)
            extension = extension[np.argsort(pool.times[extension], kind="stable")]
            if extension.size:
                extension_start = len(keep)
                keep = np.r_[keep, extension]
        plans = tuple(model.make_plans(pool.choices[:, keep], pool.times[keep], pool.energies[keep]))
        frontier = Frontier(
            model.schedule.summary(), model.blocking_power, plans, model.to_plan(fastest), extension_start,
        )
        ordinary = frontier.ordinary_plans
        if logger.isEnabledFor(logging.DEBUG):  # the certificate: how far from optimal at worst
            gap = pool.energies[_best_so_far(pool.times, pool.energies, ordinary_grid)] / walk.lower_bound(ordinary_grid) - 1
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

    def _gap_polish(self, walk: AnchorWalk, pool: "_CandidatePool", grid: np.ndarray) -> None:
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
        best = _best_so_far(pool.times, pool.energies, grid)
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
        now_best = _best_so_far(pool.times, pool.energies, grid)
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

def _in_two(work: Callable[[int, int], list[Replayed]], columns: int) -> list[Replayed]:
    """`work(lo, hi)` over the columns [0, columns), the second half on a helper thread, the
    parts joined column by column (the same candidates in the same order as `work(0, columns)`).

    The passes treat every plan (column) on its own, and numpy lets go of the GIL inside
    operations on rows this long: a reclaim pass over 2,118 plans at 8 x 96 took 114 ms on two
    threads instead of 180 ms.
    """
    if columns < _SPLIT_COLUMNS:
        return work(0, columns)
    half = columns // 2
    second: list = []

    def run_second() -> None:
        try:
            second.append(work(half, columns))
        except BaseException as err:  # raised again below, in the solver's thread
            second.append(err)

    thread = start_background(threading.Thread(target=run_second, name="frontier-pass", daemon=True))
    try:
        first = work(0, half)
    finally:
        thread.join()
    if isinstance(second[0], BaseException):
        raise second[0]
    return [
        tuple(np.concatenate([a, b], axis=-1) for a, b in zip(left, right))
        for left, right in zip(first, second[0])
    ]


class _CandidatePool:
    """Every candidate plan found so far (columns), with its replayed time and energy."""

    DTYPE = CHOICE_DTYPE  # int16 option indices (passes.py)

    def __init__(self, model: CostModel, buffer: np.ndarray, times: np.ndarray, energies: np.ndarray):
        """Candidates in `buffer`'s first len(times) columns; the pool grows into the rest."""
        self.model = model
        self._buffer = buffer
        self.size = len(times)
        self.times, self.energies = times, energies

    @classmethod
    def around(cls, first_pass: FirstPass, fastest: np.ndarray) -> "_CandidatePool":
        """The pool in the first pass's buffer: its candidates, and `fastest` in column 0."""
        pool = cls(first_pass.model, *first_pass.hand_over())
        pool._buffer[:, :1] = fastest
        pool.times[:1], pool.energies[:1] = first_pass.model.replay(fastest)
        return pool

    @property
    def choices(self) -> np.ndarray:
        """(N, plans) option indices of every candidate (a view; `add` may reallocate)."""
        return self._buffer[:, : self.size]

    def add(self, choices: np.ndarray) -> None:
        self.extend(*replayed(self.model, choices))

    def extend_all(self, parts: list[Replayed]) -> None:
        """Append replayed candidates, part by part."""
        for part in parts:
            self.extend(*part)

    def extend(self, choices: np.ndarray, times: np.ndarray, energies: np.ndarray) -> None:
        """Append plans whose replayed times and energies the caller has."""
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
        return _fill_gaps(self.times, self.energies, _pareto(self.times, self.energies), resolution)


def _even_block(columns: int, block: int) -> int:
    """Columns per block when `columns` are cut into as few blocks of at most `block` as
    possible, all about the same size: a short last block would go through its pass on one
    thread (`_SPLIT_COLUMNS`) while the other core waits (8 x 96: 3,061 deadlines were 2,604 +
    457)."""
    blocks = max(1, -(-columns // block))
    return max(1, -(-columns // blocks))


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


def _fill_gaps(times: np.ndarray, energies: np.ndarray, keep: list[int], resolution: float) -> np.ndarray:
    """Add, inside every gap wider than `resolution` between Pareto plans, the lowest-energy
    candidate of each bin (bins half the resolution wide: plans in neighbouring bins are less
    than `resolution` apart).

    Such gaps only occur where the frontier is flat (a slower plan cannot beat a faster one by
    more than rounding noise); the fill keeps the promised time resolution, and the straggler
    lookup still picks the cheapest plan meeting a deadline.
    """
    kept_times = times[keep]
    bin_width = resolution * _FILL_BIN
    # Each candidate's gap k: kept_times[k] < t < kept_times[k + 1], the gap wider than 2 bins.
    after = np.searchsorted(kept_times, times, side="left")
    gap = after - 1
    inside = (after > 0) & (after < len(kept_times))
    inside[inside] &= times[inside] < kept_times[after[inside]]
    inside[inside] &= kept_times[after[inside]] - kept_times[gap[inside]] > 2 * bin_width
    members = np.flatnonzero(inside)
    gaps = gap[members]
    bins = np.floor((times[members] - kept_times[gaps]) / bin_width).astype(np.int64)
    # the lowest energy of each (gap, bin); the first candidate among equals
    order = np.lexsort((members, energies[members], bins, gaps))
    first = np.r_[True, (np.diff(gaps[order]) != 0) | (np.diff(bins[order]) != 0)][: len(order)]
    # The kept and filling candidates without repeats, by time, then energy, then index (a mask:
    # np.unique imports numpy.ma, the CLI's start-up time; a Python sort with a key took ~1 ms).
    chosen = np.zeros(len(times), dtype=bool)
    chosen[keep] = True
    chosen[members[order[first]]] = True
    out = np.flatnonzero(chosen)
    return out[np.lexsort((energies[out], times[out]))]


def _pareto(times: np.ndarray, energies: np.ndarray) -> list[int]:
    """Indices of Pareto-optimal (time, energy) points, by increasing time. Times within 1e-12 s
    count as equal: replays of different plans along the same critical path can differ by
    rounding, and a costlier plan must not win on that."""
    return pareto_indices(np.round(times, 12), energies, tolerance=1e-9)
