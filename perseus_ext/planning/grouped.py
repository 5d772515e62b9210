"""The frontier of plans that keep each of a set of clock groups at one clock.

A `ClockGroups` (`groups.py`) ties runs of consecutive computations of a stage to one clock
(the clock-change budget's plans, `clock_budget.py`). `GroupedModel` sees a `CostModel` through
one clock level per group; `solve_grouped` finds the plans of least energy over the deadlines
from the all-max-clock time on, with the solver's own method (`solver.py`) lifted to groups:

1. *LP relaxation per deadline.* Each group g picks a convex combination lambda_g of its clocks;
   member i then takes sum_k lambda_gk t_i(k) seconds, and the group costs
   sum_k lambda_gk C_g(k), C_g(k) = sum_i (e_i(k) - P_block t_i(k)). With start times and the
   DAG's precedence rows this is the exact LP relaxation of the grouped MILP
   (`exact.exact_solve(groups=)` with its binaries relaxed), solved with HiGHS from deadline to
   deadline, warm-started. A per-computation hull (the ungrouped solver's LP) cannot be used:
   one group's members move together, not each along its own hull.
2. *Rounding.* Each group takes the fastest, the slowest or the nearest (in group time) clock
   its lambda uses; the fastest keeps every member within its relaxed duration, so the deadline
   holds where the profile's times fall with the clock.
3. *Repair and reclaim.* A late plan speeds up, one level at a time, the critical group of least
   extra cost per second saved on the critical path; then every group in turn (by its first
   member's place in the DAG, then in reverse) takes its cheapest slower level that fits its
   members' float: members j of a group lie on one chain, so slowing them by d_1..d_j delays
   member j and everything after it by at most d_1 + ... + d_j, and a successor's float is at
   least its predecessor's, so sum_{i<=j} d_i <= float_j for every member keeps the deadline.
4. *Carry.* Each deadline also gets the best plan of every earlier one, slowed into its slack.
5. *Polish* (small pipelines: while its work fits a fixed budget). Local search on the best
   plan of every LP deadline: one group moved up to two
   levels, or one up to two levels faster and another up to two slower, the deadline repaired and the
   slack reclaimed with the moved groups held (`GroupedModel.polish`); the polished plans are
   carried to the deadlines around them.

Every candidate is replayed on the model (`CostModel.replay`, latency-aware when the model has a
latency): reported times and energies are exact.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import highspy
import numpy as np

from perseus_ext.background import start_background
from perseus_ext.errors import SolverError
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.groups import ClockGroups
from perseus_ext.planning.passes import REPLAY_CELLS, chunk_columns, keep_best_neighbours
from perseus_ext.planning.relaxation import csc_matrix, simplex_highs

_EPS = 1e-9
T = TypeVar("T")
_REPAIR_ROUNDS = 200  # at most; a round moves one group of every late plan one level faster
# The polish (step 5), on pipelines of at most `_PAIR_GROUPS` groups: moves of up to this many
# levels, for at most this many rounds, when (plans x moves x computations x groups x 4) stays
# within the cells (its reclaims make two DAG passes per group over every neighbour, both ways).
_POLISH_STEPS, _POLISH_ROUNDS, _POLISH_CELLS = 2, 4, 1e8
_CARRY_DENSITY = 4  # carried plans per LP deadline (step 4)
_PAIR_GROUPS = 24  # the polish also moves pairs of groups (one faster, one slower) up to this many groups
# The deadlines run this far past the relaxed minimum-energy deadline: rounded plans reach their
# least energy later than the relaxation does.
_PAST_RELAXED_OPTIMUM = 1.15


class GroupedModel:
    """A `CostModel` seen through one clock level per group (level 0: the group's fastest)."""

    def __init__(self, model: CostModel, groups: ClockGroups):
        self.model = model
        n = model.num_nodes
        members = groups.node_groups(model.dag.index)
        covered = np.zeros(n, dtype=bool)
        for nodes in members:
            covered[nodes] = True
        members += [np.array([i]) for i in np.flatnonzero(~covered)]  # the rest on their own
        # Groups by their first member's place in the DAG (the reclaim's forward order).
        members.sort(key=lambda nodes: int(nodes.min()))
        self.members = [np.sort(nodes) for nodes in members]
        self.num_groups = len(members)
        self.group_of = np.empty(n, dtype=np.int64)
        clocks = []
        for g, nodes in enumerate(self.members):
            self.group_of[nodes] = g
            common = None
            for i in nodes:
                own = set(model.frequencies[i, : model.num_options[i]].tolist())
                common = own if common is None else common & own
            if not common:
                raise SolverError(
                    f"clock group {g} ({', '.join(str(model.dag.computations[i]) for i in nodes[:3])}...) has no "
                    "clock measured for every member; profile the same clocks for a stage's computations")
            clocks.append(np.array(sorted(common, reverse=True), dtype=np.int64))
        self.num_levels = np.array([len(c) for c in clocks])
        width = int(self.num_levels.max())
        # option[i, k]: node i's option index at its group's level k (padded with the slowest).
        self.option = np.zeros((n, width), dtype=np.int64)
        for g, nodes in enumerate(self.members):
            for i in nodes:
                index = {int(f): j for j, f in enumerate(model.frequencies[i, : model.num_options[i]])}
                row = [index[int(f)] for f in clocks[g]]
                self.option[i] = row + [row[-1]] * (width - len(row))
        rows = np.arange(n)[:, None]
        self.times = model.times[rows, self.option]  # (N, width) member seconds per level
        cost = model.energies[rows, self.option] - model.blocking_power * self.times
        self.group_cost = np.full((self.num_groups, width), np.inf)
        for g, nodes in enumerate(self.members):
            self.group_cost[g, : self.num_levels[g]] = cost[nodes, : self.num_levels[g]].sum(axis=0)

    def choices(self, levels: np.ndarray) -> np.ndarray:
        """Per-computation option indices (N, plans) of group levels (G, plans)."""
        return np.take_along_axis(self.option, levels[self.group_of], axis=1)

    def durations(self, levels: np.ndarray) -> np.ndarray:
        return np.take_along_axis(self.times, levels[self.group_of], axis=1)

    def replay(self, levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(times, energies) of group levels (G, plans), replayed on the model in cache-sized chunks."""
        step = chunk_columns(self.model.num_nodes, REPLAY_CELLS)
        parts = [self.model.replay(self.choices(levels[:, k : k + step])) for k in range(0, levels.shape[1], step)]
        return np.concatenate([np.atleast_1d(t) for t, _ in parts]), np.concatenate([np.atleast_1d(e) for _, e in parts])

    def reclaim(
        self, levels: np.ndarray, deadlines: np.ndarray, reverse: bool = False, frozen: np.ndarray | None = None,
    ) -> np.ndarray:
        """Step 3's reclaim: every group in turn at its cheapest slower level within its float
        (`frozen` (G, plans): groups left as they are)."""
        levels = levels.copy()
        dag = self.model.dag
        order = range(self.num_groups - 1, -1, -1) if reverse else range(self.num_groups)
        for g in order:
            nodes = self.members[g]
            durations = self.durations(levels)
            finish = dag.finish_times(durations)
            float_s = dag.latest_finish_times(durations, deadlines) - finish  # (N, plans)
            current = levels[g]
            top = self.num_levels[g]
            # (levels, members, plans): members' extra seconds at every level, from their own.
            # (A member made faster counts as 0: its gain may arrive where nothing waits for it.)
            extra = np.maximum(self.times[nodes][:, :top].T[:, :, None] - durations[nodes][None], 0.0)
            fits = (np.cumsum(extra, axis=1) <= float_s[nodes][None] + _EPS).all(axis=1)
            fits &= np.arange(top)[:, None] >= current[None]
            cost = np.where(fits, self.group_cost[g, :top, None], np.inf)
            best = cost.argmin(axis=0)
            better = cost[best, np.arange(len(best))] < self.group_cost[g, current] - _EPS
            if frozen is not None:
                better &= ~frozen[g]
            levels[g] = np.where(better, best, current)
        return levels

    def repair(self, levels: np.ndarray, deadlines: np.ndarray, frozen: np.ndarray | None = None) -> np.ndarray:
        """Step 3's repair: late plans made faster, a critical group one level at a time
        (`frozen` (G, plans): groups never moved)."""
        levels = levels.copy()
        dag = self.model.dag
        late = np.arange(levels.shape[1])
        for _ in range(_REPAIR_ROUNDS):
            durations = self.durations(levels[:, late])
            finish = dag.finish_times(durations)
            still = finish.max(axis=0) > deadlines[late] + _EPS
            late, durations, finish = late[still], durations[:, still], finish[:, still]
            if not late.size:
                break
            float_s = dag.latest_finish_times(durations, deadlines[late]) - finish
            critical = float_s <= float_s.min(axis=0) + _EPS
            sub = levels[:, late]
            faster = np.maximum(sub - 1, 0)
            saved = np.where(critical, durations - self.durations(faster), 0.0)
            group_saved = np.zeros(sub.shape)
            np.add.at(group_saved, self.group_of, saved)
            rows = np.arange(self.num_groups)[:, None]
            extra = self.group_cost[rows, faster] - self.group_cost[rows, sub]
            movable = (sub > 0) & (group_saved > _EPS)
            if frozen is not None:
                movable &= ~frozen[:, late]
            with np.errstate(divide="ignore", invalid="ignore"):
                price = np.where(movable, extra / group_saved, np.inf)
            pick = price.argmin(axis=0)
            can = np.isfinite(price[pick, np.arange(late.size)])
            if not can.any():
                break
            levels[pick[can], late[can]] -= 1
            late = late[can]
        return levels


    def polish(self, levels: np.ndarray, deadlines: np.ndarray, rounds: int = _POLISH_ROUNDS) -> np.ndarray:
        """Step 5: local search on each plan (column). A move puts one group up to
        `_POLISH_STEPS` levels from its own, repairs the deadline and reclaims slack with that
        group held; the best improving neighbour is kept until none improves. Rounding and a
        greedy reclaim can settle where no single group's change helps, but one group faster
        and the time it frees handed to others does."""
        levels = levels.copy()
        _, energies = self.replay(levels)
        steps = np.r_[-np.arange(_POLISH_STEPS, 0, -1), np.arange(1, _POLISH_STEPS + 1)]
        groups = np.arange(self.num_groups)
        # (group, step) moves; on few groups also one group a level faster and another slower.
        first = [np.repeat(groups, len(steps))]
        first_step = [np.tile(steps, self.num_groups)]
        second, second_step = [np.full(len(first[0]), -1)], [np.zeros(len(first[0]), dtype=np.int64)]
        if self.num_groups <= _PAIR_GROUPS:
            a, b = np.meshgrid(groups, groups, indexing="ij")
            a, b = a[a != b], b[a != b]
            for faster in range(1, _POLISH_STEPS + 1):
                for slower in range(1, _POLISH_STEPS + 1):
                    first.append(a)
                    first_step.append(np.full(len(a), -faster))
                    second.append(b)
                    second_step.append(np.full(len(b), slower))
        move_group, move_step = np.concatenate(first), np.concatenate(first_step)
        pair_group, pair_step = np.concatenate(second), np.concatenate(second_step)
        moves = len(move_group)
        active = np.arange(levels.shape[1])
        for _ in range(rounds):
            if not active.size:
                break
            base = np.repeat(levels[:, active], moves, axis=1)
            column = np.arange(base.shape[1])
            frozen = np.zeros(base.shape, dtype=bool)
            valid = np.ones(base.shape[1], dtype=bool)
            for group, step in ((move_group, move_step), (pair_group, pair_step)):
                group, step = np.tile(group, active.size), np.tile(step, active.size)
                moved = group >= 0
                target = base[np.maximum(group, 0), column] + step
                valid &= ~moved | ((target >= 0) & (target < self.num_levels[np.maximum(group, 0)]))
                ok = moved & valid
                base[group[ok], column[ok]] = target[ok]
                frozen[group[moved], column[moved]] = True
            plan_deadlines = np.repeat(deadlines[active], moves)
            repaired = self.repair(base, plan_deadlines, frozen)
            # Both reclaim orders: freed time can be worth most early or late in the iteration.
            neighbours = np.concatenate(
                [self.reclaim(repaired, plan_deadlines, reverse, frozen) for reverse in (False, True)], axis=1)
            times, costs = self.replay(neighbours)
            active = keep_best_neighbours(levels, energies, active, neighbours, times, costs, valid, plan_deadlines,
                                          base.shape[1], moves)
        return levels


class GroupRelaxation:
    """Step 1's LP: start times, one convex combination of clocks per group, the deadline."""

    def __init__(self, grouped: GroupedModel):
        self.grouped = grouped
        model = grouped.model
        dag = model.dag
        n, num_groups = model.num_nodes, grouped.num_groups
        levels = grouped.num_levels
        first_column = n + np.r_[0, np.cumsum(levels)[:-1]]  # each group's first lambda column
        m = int(levels.sum())
        self.t_col = n + m
        sinks = np.flatnonzero(dag.out_degree == 0)
        before = np.r_[dag.pred_idx, sinks]
        after = np.r_[np.repeat(np.arange(n), dag.in_degree), np.full(len(sinks), self.t_col)]
        rows, cols, values = [], [], []
        count = len(before)
        row_ids = np.arange(count)
        # start_a + sum_k lambda_k t_a(k) - start_b (or T) <= 0
        rows += [row_ids, row_ids]
        cols += [before, after]
        values += [np.ones(count), -np.ones(count)]
        width = levels[grouped.group_of[before]]
        rep = np.repeat(row_ids, width)
        node = before[rep]
        level = np.arange(len(rep)) - np.repeat(np.cumsum(width) - width, width)
        rows.append(rep)
        cols.append(first_column[grouped.group_of[node]] + level)
        values.append(grouped.times[node, level])
        # sum_k lambda_gk = 1
        convex = count + np.repeat(np.arange(num_groups), levels)
        rows.append(convex)
        cols.append(n + np.arange(m))
        values.append(np.ones(m))
        start, index, value = csc_matrix(np.concatenate(rows), np.concatenate(cols), np.concatenate(values), n + m + 1)
        num_rows = count + num_groups
        lp = highspy.HighsLp()
        lp.num_col_ = n + m + 1
        lp.num_row_ = num_rows
        level_cost = np.concatenate([grouped.group_cost[g, : levels[g]] for g in range(num_groups)])
        lp.col_cost_ = np.concatenate([np.zeros(n), level_cost, [0.0]])
        lp.col_lower_ = np.zeros(n + m + 1)
        lp.col_upper_ = np.concatenate([np.full(n + m, highspy.kHighsInf), [0.0]])
        lp.row_lower_ = np.r_[np.full(count, -highspy.kHighsInf), np.ones(num_groups)]
        lp.row_upper_ = np.r_[np.zeros(count), np.ones(num_groups)]
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = start
        lp.a_matrix_.index_ = index
        lp.a_matrix_.value_ = value
        self.highs = simplex_highs(lp)
        self.n, self.m = n, m
        self.first_column = first_column - n

    def free_deadline(self, t_min: float, t_max: float) -> float:
        """The relaxed minimum-energy deadline: the deadline free, priced at P_block x stages."""
        model = self.grouped.model
        h = self.highs
        h.changeColCost(self.t_col, model.blocking_power * model.num_stage_gpus)
        h.changeColBounds(self.t_col, t_min, t_max)
        h.run()
        self._check(h, "a free deadline")
        t_star = float(h.getSolution().col_value[self.t_col])
        h.changeColCost(self.t_col, 0.0)
        return t_star

    def weights(self, deadline: float) -> np.ndarray:
        """(G, levels) relaxed weights of every group's levels at `deadline` (warm-started)."""
        h = self.highs
        h.changeColBounds(self.t_col, deadline, deadline)
        h.run()
        self._check(h, f"T={deadline:.6f}s")
        x = np.fromiter(h.getSolution().col_value[self.n : self.n + self.m], float, self.m)
        grouped = self.grouped
        out = np.zeros(grouped.group_cost.shape)
        for g in range(grouped.num_groups):
            k = grouped.num_levels[g]
            out[g, :k] = x[self.first_column[g] : self.first_column[g] + k]
        return np.clip(out, 0.0, None)

    @staticmethod
    def _check(h: "highspy.Highs", where: str) -> None:
        status = h.getModelStatus()
        if status != highspy.HighsModelStatus.kOptimal:
            raise SolverError(f"grouped LP relaxation at {where} ended with {h.modelStatusToString(status)}")


def round_weights(grouped: GroupedModel, weights: np.ndarray) -> list[np.ndarray]:
    """Step 2: (G,) levels three ways from (G, levels) weights: fastest, slowest and nearest used."""
    used = weights > 1e-7
    width = weights.shape[1]
    fastest = np.where(used.any(axis=1), used.argmax(axis=1), 0)
    slowest = np.where(used.any(axis=1), width - 1 - used[:, ::-1].argmax(axis=1), 0)
    group_time = np.zeros(weights.shape)
    np.add.at(group_time, grouped.group_of, grouped.times)
    group_time = np.where(np.arange(width)[None] < grouped.num_levels[:, None], group_time, np.inf)
    wanted = (np.where(np.isfinite(group_time), group_time, 0.0) * weights).sum(axis=1)
    nearest = np.abs(group_time - wanted[:, None]).argmin(axis=1)
    return [fastest, slowest, nearest]


def solve_grouped(
    model: CostModel, groups: ClockGroups, deadlines_count: int, *, to_slowest: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(choices (N, plans), times, energies) of the grouped candidates (module docstring) at
    `deadlines_count` deadlines from the all-max-clock time to the relaxed minimum-energy plan
    (`to_slowest`: on to the all-slowest grouped plan, for the wait-aware extension)."""
    grouped = GroupedModel(model, groups)
    zeros = np.zeros((grouped.num_groups, 1), dtype=np.int64)
    slowest = (grouped.num_levels - 1)[:, None]
    dag = model.dag
    t_min = float(dag.makespan(grouped.durations(zeros))[0])
    t_slowest = max(float(dag.makespan(grouped.durations(slowest))[0]), t_min)
    deadlines, rounded = _on_own_thread(lambda: _relaxed_levels(grouped, t_min, t_slowest, deadlines_count, to_slowest))
    candidates = [zeros, slowest]
    for kind, both_ways in zip(rounded, (True, False, False)):
        levels = grouped.repair(np.stack(kind, axis=1), deadlines)
        candidates.append(grouped.reclaim(levels, deadlines))
        if both_ways:  # the rounding that keeps the deadline also hands its slack to late groups
            candidates.append(grouped.reclaim(levels, deadlines, reverse=True))
    pool = np.concatenate(candidates, axis=1)
    times, energies = grouped.replay(pool)
    # Step 4: the best plan meeting each deadline of a grid _CARRY_DENSITY times finer, slowed
    # into that deadline's slack (the frontier between two LP deadlines).
    fine = np.linspace(deadlines[0], deadlines[-1], _CARRY_DENSITY * (len(deadlines) - 1) + 1)
    best = np.array([_cheapest(times, energies, d) for d in fine])
    carried = grouped.reclaim(pool[:, best], fine)
    carried_times, carried_energies = grouped.replay(carried)
    pool = np.concatenate([pool, carried], axis=1)
    times, energies = np.r_[times, carried_times], np.r_[energies, carried_energies]
    # Step 5 on the best plan of every LP deadline, where that fits `_POLISH_CELLS`.
    moves = 2 * _POLISH_STEPS * grouped.num_groups + _POLISH_STEPS ** 2 * grouped.num_groups ** 2
    if grouped.num_groups <= _PAIR_GROUPS and 4 * moves * grouped.num_groups * model.num_nodes * len(deadlines) <= _POLISH_CELLS:
        best = np.array([_cheapest(times, energies, d) for d in deadlines])
        polished = grouped.polish(pool[:, best], deadlines)
        polished_times, polished_energies = grouped.replay(polished)
        pool = np.concatenate([pool, polished], axis=1)
        times, energies = np.r_[times, polished_times], np.r_[energies, polished_energies]
        # Carried again: every fine deadline from the best plan meeting it, slowed into its
        # slack, and from the best plan of the next one, sped up to it.
        now = np.array([_cheapest(times, energies, d) for d in fine])
        later = grouped.repair(pool[:, np.r_[now[1:], now[-1]]], fine)
        settled = np.concatenate([grouped.reclaim(pool[:, now], fine), grouped.reclaim(later, fine)], axis=1)
        settled_times, settled_energies = grouped.replay(settled)
        pool = np.concatenate([pool, settled], axis=1)
        times, energies = np.r_[times, settled_times], np.r_[energies, settled_energies]
    return grouped.choices(pool), times, energies


def _relaxed_levels(
    grouped: GroupedModel, t_min: float, t_slowest: float, deadlines_count: int, to_slowest: bool,
) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """Steps 1-2: the deadlines, and per rounding kind each deadline's group levels."""
    relaxation = GroupRelaxation(grouped)
    if t_slowest <= t_min + _EPS:
        t_end = t_min
    else:
        t_end = t_slowest if to_slowest else min(t_slowest, relaxation.free_deadline(t_min, t_slowest) * _PAST_RELAXED_OPTIMUM)
    deadlines = np.linspace(t_min, t_end, max(2, deadlines_count)) if t_end > t_min + _EPS else np.array([t_min])
    rounded: list[list[np.ndarray]] = [[], [], []]
    for deadline in deadlines:
        for kind, levels in zip(rounded, round_weights(grouped, relaxation.weights(float(deadline)))):
            kind.append(levels)
    relaxation.highs.clear()
    return deadlines, rounded


def _on_own_thread(work: Callable[[], T]) -> T:
    """`work()` on a thread of its own, which ends with it. HiGHS keeps one task scheduler per
    calling thread whose size cannot change (`relaxation.simplex_highs`): the one-thread simplex
    here must not meet a scheduler the caller's thread made for another HiGHS."""
    result: list = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as err:  # raised again in the caller's thread
            result.append(err)

    thread = start_background(threading.Thread(target=run, name="grouped-lp", daemon=True))
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _cheapest(times: np.ndarray, energies: np.ndarray, deadline: float) -> int:
    meets = times <= deadline + _EPS
    return int(np.flatnonzero(meets)[energies[meets].argmin()]) if meets.any() else int(times.argmin())
