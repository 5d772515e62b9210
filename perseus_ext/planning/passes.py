"""Batched passes over plans, the solver's steps 2, 3 and 5 (`solver.py`): rounding relaxed
durations to profiled clocks, reclaiming slack, repairing deadlines and the local-search polish.

Plans are columns of one (computations x plans) matrix of option indices; every pass works on
all of them at once with numpy and treats each column on its own, so a pass over a set of
plans in pieces gives the same plans as over all of them.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from perseus_ext.planning.dag import gather_max, gather_min
from perseus_ext.planning.energy import CostModel

_EPS = 1e-9
CELLS = 4_000_000  # (computation, plan) cells per batched DAG pass (bounds peak memory)
# Cells per batched replay: a latency-aware replay makes a dozen (N, plans) arrays, and these
# stay in cache at this size (a plain replay is unaffected).
REPLAY_CELLS = 400_000
# Option indices fit in int16; a pool holds tens of thousands of plans of thousands of
# computations, so candidates are kept in this type (a few tens of MiB).
CHOICE_DTYPE = np.int16


def chunk_columns(num_nodes: int, cells: int = CELLS) -> int:
    """Plans per batched DAG pass: `cells` cells, at least 64 plans."""
    return max(64, cells // max(num_nodes, 1))


def _slowest_fitting(option_times: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Index of the slowest option whose time fits in `window` (0 if even the fastest does not)."""
    return np.maximum(np.searchsorted(option_times, window + _EPS, side="right") - 1, 0)


class _OptionTables:
    """Computations of one stage and kind share their option table, so searches for the best
    clock run once per table (and, in the DAG passes, once per table and level), not per node."""

    def __init__(self, model: CostModel):
        # Tables in order of first use (np.unique(axis=0) would sort rows as records, slowly).
        keys = [row.tobytes() for row in model.times]
        first_node: dict[bytes, int] = {}
        for node, key in enumerate(keys):
            first_node.setdefault(key, node)
        table_id = {key: t for t, key in enumerate(first_node)}
        table_of = np.array([table_id[key] for key in keys])
        tables = model.times[list(first_node.values())]
        self.options = [table[np.isfinite(table)] for table in tables]
        self.nodes = [np.flatnonzero(table_of == t) for t in range(len(tables))]
        # Per DAG level: its one table, or the lookups of `_MixedLevel` for several.
        # Levels with the same tables in the same order (most of a pipeline's steady state)
        # share one `_MixedLevel`: its lookups grow with the level's rows and tables.
        self.by_level: list[np.ndarray | _MixedLevel] = []
        mixed: dict[bytes, _MixedLevel] = {}
        for lv in model.dag.levels:
            ids = table_of[lv]
            if (ids == ids[0]).all():
                self.by_level.append(self.options[ids[0]])
            else:
                key = ids.tobytes()
                if key not in mixed:
                    mixed[key] = _MixedLevel([self.options[t] for t in ids])
                self.by_level.append(mixed[key])

    @classmethod
    def of(cls, model: CostModel) -> "_OptionTables":
        """The model's tables, built once: the solver's two pass threads ask at the same time."""
        with _TABLES_LOCK:
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
        tables = self.by_level[level]
        if isinstance(tables, _MixedLevel):
            best, option_times = tables.slowest_fitting(window), tables.times
        else:
            best, option_times = _slowest_fitting(tables, window), tables.take
        if cap is not None:
            np.minimum(best, cap, out=best)
        np.maximum(best, choice, out=best)
        choice[...] = best
        durations[...] = option_times(best)


class _MixedLevel:
    """A DAG level whose nodes use several option tables: one search for all of them.

    The window is searched in the union of the tables' times (`rank`: how many union times fit),
    then each row's lookup maps rank to its own slowest fitting option. Exact: a row's options
    that fit are those no slower than the slowest fitting union time, which is one of them or
    another table's. One search and two gathers replace a search per table (8 x 24: a level has
    3 tables, and the per-table numpy calls were most of a pass).
    """

    def __init__(self, row_options: list[np.ndarray]):
        union = np.sort(np.concatenate(row_options))
        self.union = union[np.r_[True, np.diff(union) > 0]]
        # lookup[r, j]: row r's slowest option among union times 0..j-1 (0 when none fits).
        lookup = np.zeros((len(row_options), len(self.union) + 1), dtype=np.int32)
        width = max(len(options) for options in row_options)
        option_times = np.full((len(row_options), width), np.inf)
        for r, options in enumerate(row_options):
            lookup[r, 1:] = np.maximum(np.searchsorted(options, self.union, side="right") - 1, 0)
            option_times[r, : len(options)] = options
        self.lookup = lookup.ravel()
        self.option_times = option_times.ravel()
        self.lookup_base = (np.arange(len(row_options)) * lookup.shape[1])[:, None]
        self.times_base = (np.arange(len(row_options)) * width)[:, None]

    def slowest_fitting(self, window: np.ndarray) -> np.ndarray:
        """`_slowest_fitting` of each row's own options, for a (rows, plans) window."""
        rank = np.searchsorted(self.union, window + _EPS, side="right")
        rank += self.lookup_base
        return self.lookup.take(rank)

    def times(self, best: np.ndarray) -> np.ndarray:
        """Each row's option times at option indices `best` (rows, plans)."""
        return self.option_times.take(best + self.times_base)


_TABLES: "weakref.WeakKeyDictionary[CostModel, _OptionTables]" = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def round_to_options(model: CostModel, durations: np.ndarray) -> dict[str, np.ndarray]:
    """Per plan (column), each relaxed duration rounded to a profiled clock, three ways.

    `down`: the slowest clock no slower than the duration, so the relaxation's deadline holds.
    `up` / `nearest`: the next slower / the nearest clock; such plans overshoot the deadline a
    little but are often the best plans at their own, slightly longer, time.
    Option indices come as int16 (what the candidate pool stores): a third of the memory traffic.
    """
    rounded = {way: np.empty(durations.shape, dtype=CHOICE_DTYPE) for way in ("down", "up", "nearest")}
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
    step = chunk_columns(model.num_nodes)
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
        for level, (lv, slots) in enumerate(dag.level_preds):
            start = gather_max(finish, slots)
            refit(level, lv, latest_finish[lv] - start)
            np.add(start, durations[lv], out=finish[lv])

    def backward_pass() -> None:
        earliest_start = dag.finish_times(durations) - durations
        latest_start = np.empty((len(dag) + 1, choice.shape[1]))
        latest_start[-1] = deadlines
        for level in range(len(dag.levels) - 1, -1, -1):
            lv, slots = dag.level_succs[level]
            end = gather_min(latest_start, slots)
            refit(level, lv, end - earliest_start[lv])
            np.subtract(end, durations[lv], out=latest_start[lv])

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
    # Only the plans still late are worked on each round (the others are done: columns are
    # independent; in the polish most neighbours are on time after a round or two), and only
    # the moved computation's entries change from one round to the next.
    width = model.times.shape[1]
    flat_times, flat_saved, flat_extra = model.times.ravel(), saved.ravel(), extra.ravel()
    index = choice + (np.arange(model.num_nodes) * width)[:, None]  # into the flat tables
    durations, step_saved, step_extra = flat_times.take(index), flat_saved.take(index), flat_extra.take(index)
    if frozen is not None:  # a frozen computation's step is never taken
        step_extra[frozen] = np.inf
    late, plan_deadlines = np.arange(choice.shape[1]), np.asarray(deadlines, dtype=float)
    for _ in range(int(model.num_options.sum())):
        finish = model.dag.finish_times(durations)
        makespan = finish.max(axis=0)
        still = makespan > plan_deadlines + _EPS
        if not still.all():
            late, index, durations, step_saved, step_extra, plan_deadlines, finish, makespan = (
                late[still], index[:, still], durations[:, still], step_saved[:, still],
                step_extra[:, still], plan_deadlines[still], finish[:, still], makespan[still],
            )
        if not late.size:
            break
        slack = model.dag.latest_finish_times(durations, plan_deadlines) - finish
        critical = slack <= slack.min(axis=0) + _EPS
        # Price a step by the time the plan still needs, not by all the time it saves: a big
        # step that overshoots the deficit is charged in full.
        useful = np.minimum(step_saved, makespan - plan_deadlines)
        with np.errstate(divide="ignore", invalid="ignore"):
            score = np.where(critical & (useful > 0), step_extra / useful, np.inf)
        pick = score.argmin(axis=0)
        column = np.arange(late.size)
        can = np.isfinite(score[pick, column])
        if not can.any():
            break
        node, column = pick[can], column[can]
        choice[node, late[column]] -= 1
        index[node, column] -= 1
        moved = index[node, column]
        durations[node, column] = flat_times[moved]
        step_saved[node, column] = flat_saved[moved]
        step_extra[node, column] = flat_extra[moved]
        if not can.all():  # a plan that cannot be repaired stays late as it is
            late, index, durations, step_saved, step_extra, plan_deadlines = (
                late[can], index[:, can], durations[:, can], step_saved[:, can], step_extra[:, can],
                plan_deadlines[can],
            )
    return choice


def polish(
    model: CostModel, choice: np.ndarray, deadlines: np.ndarray, rounds: int = 20, window: int | None = None,
) -> np.ndarray:
    """Local search on each plan (column): a move puts one computation at another clock (any
    clock, or with `window` one at most `window` steps from its own), repairs the deadline
    (`repair_deadline`, the moved computation frozen) and reclaims slack; the best improving
    neighbour (either reclaim direction) is kept until none improves.

    Rounding and greedy reclaim can settle on a distribution of clocks that no single-step
    change improves; a move here changes many computations at once. A round evaluates N x K
    neighbours per plan (N x 2 `window` with a window), each repaired in up to ~K DAG passes of
    N nodes, so the solver runs the full one only while deadlines x (N x K)^2 stays within
    `SolverOptions.polish_budget` and the windowed one on evenly spaced deadlines the LP's lower
    bound cannot certify (`solver.py`).
    """
    choice = np.array(choice, dtype=np.int64)
    n, num_plans = choice.shape
    if window is None:  # moves: (node, absolute option)
        width = n * model.times.shape[1]
        node_of, option_of = np.divmod(np.arange(width), model.times.shape[1])
    else:  # moves: (node, option steps from the plan's own)
        steps = np.r_[np.arange(-window, 0), np.arange(1, window + 1)]
        width = n * len(steps)
        node_of, option_of = np.repeat(np.arange(n), len(steps)), np.tile(steps, n)
    _, energy = model.replay(choice, switch_latency_s=0.0)
    active = np.arange(num_plans)
    for _ in range(rounds):
        if not active.size:
            break
        base = np.repeat(choice[:, active], width, axis=1)
        column = np.arange(base.shape[1])
        node = np.tile(node_of, active.size)
        option = np.tile(option_of, active.size)
        if window is not None:
            option = option + base[node, column]
        valid = (option >= 0) & (option < model.num_options[node]) & (option != base[node, column])
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
        active = keep_best_neighbours(choice, energy, active, neighbours, times, energies, valid, plan_deadlines,
                                      base.shape[1], width)
    return choice


def keep_best_neighbours(plans: np.ndarray, energy: np.ndarray, active: np.ndarray, neighbours: np.ndarray,
                         times: np.ndarray, energies: np.ndarray, valid: np.ndarray, plan_deadlines: np.ndarray,
                         base_width: int, moves: int) -> np.ndarray:
    """One local-search round's step: each active plan's `moves` neighbours per reclaim direction
    (the two directions concatenated, `base_width` columns apart) compete; the cheapest valid one
    that meets its plan's deadline replaces the plan (in `plans` and `energy`, in place) where it
    saves energy. Returns the plans that improved, the next round's active ones."""
    ok = np.tile(valid, 2) & (times <= np.tile(plan_deadlines, 2) + _EPS)
    costs = np.where(ok, energies, np.inf).reshape(2, active.size, moves)
    costs = costs.transpose(1, 0, 2).reshape(active.size, 2 * moves)
    best = costs.argmin(axis=1)
    best_cost = costs[np.arange(active.size), best]
    improved = best_cost < energy[active] - 1e-9
    direction, offset = np.divmod(best, moves)
    chosen = neighbours[:, direction * base_width + np.arange(active.size) * moves + offset]
    plans[:, active[improved]] = chosen[:, improved]
    energy[active[improved]] = best_cost[improved]
    return active[improved]
