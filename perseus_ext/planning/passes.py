"""Batched passes over plans, the solver's steps 2, 3 and 5 (`solver.py`): rounding relaxed
durations to profiled clocks, reclaiming slack, repairing deadlines and the local-search polish.

Plans are columns of one (computations x plans) matrix of option indices; every pass works on
all of them at once with numpy and treats each column on its own, so a pass over a set of
plans in pieces gives the same plans as over all of them.
"""

from __future__ import annotations

import weakref

import numpy as np

from perseus_ext.planning.energy import CostModel

_EPS = 1e-9
CELLS = 4_000_000  # (computation, plan) cells per batched DAG pass (bounds peak memory)
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
        # Tables in order of first use (np.unique(axis=0) sorts rows as records: 10x slower).
        keys = [row.tobytes() for row in model.times]
        first_node: dict[bytes, int] = {}
        for node, key in enumerate(keys):
            first_node.setdefault(key, node)
        table_id = {key: t for t, key in enumerate(first_node)}
        table_of = np.array([table_id[key] for key in keys])
        tables = model.times[list(first_node.values())]
        self.options = [table[np.isfinite(table)] for table in tables]
        self.nodes = [np.flatnonzero(table_of == t) for t in range(len(tables))]
        # Per DAG level: (rows within the level, or None for all of them; table) pairs.
        self.by_level: list[list[tuple[np.ndarray | None, np.ndarray]]] = []
        for lv in model.dag.levels:
            ids = table_of[lv]
            present = np.flatnonzero(np.bincount(ids))  # np.unique would import numpy.ma: start-up time
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
