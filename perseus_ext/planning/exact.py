"""Exact minimum-energy plans for small pipelines: the yardstick for the frontier solver.

`exact_min_energy` solves, for one deadline, the discrete problem exactly as a mixed-integer
program (HiGHS, quiet): one binary per (computation, clock), start times,
and the iteration time as a variable so blocking energy is charged on the plan's own time.
`exact_wait_aware` solves the wait-aware problem (the iteration ends at the deadline whatever
the plan, so every stage pays blocking power until then). `groups` (`groups.ClockGroups`) ties
runs of consecutive computations to one clock as rows of the formulation: for each clock f,
the first member's binaries at f equal each other member's. `brute_force_min_energy` enumerates
every assignment and is only for the tiniest cases (it checks the MILP formulation itself).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import highspy
from scipy import sparse

from perseus_ext.errors import SolverError
from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.groups import ClockGroups
from perseus_ext.planning.relaxation import quiet_highs, set_option


@dataclass(frozen=True)
class ExactResult:
    """Best plan the MILP found, its replayed energy, and HiGHS' lower bound on the optimum."""

    energy: float
    choice: np.ndarray
    lower_bound: float

    @property
    def gap(self) -> float:
        """Relative distance of the plan from the bound (0 when proven optimal)."""
        return self.energy / self.lower_bound - 1.0


def exact_min_energy(
    model: CostModel, deadline: float, groups: ClockGroups | None = None
) -> tuple[float, np.ndarray] | None:
    """(energy, choice) of the cheapest plan with iteration time <= deadline (each of `groups`
    at one clock); None if infeasible."""
    result = exact_solve(model, deadline, groups=groups)
    return None if result is None else (result.energy, result.choice)


def exact_wait_aware(model: CostModel, deadline: float) -> ExactResult | None:
    """Cheapest plan, time <= deadline, when the iteration ends at the deadline anyway: its
    energy counts every stage blocked until the deadline (`energy` and `lower_bound` include
    that wait). None if infeasible."""
    return exact_solve(model, deadline, wait_aware=True)


def exact_solve(
    model: CostModel, deadline: float, rel_gap: float = 1e-9, time_limit_s: float | None = None,
    wait_aware: bool = False, groups: ClockGroups | None = None, *, relaxed: bool = False,
) -> ExactResult | None:
    """The MILP at one deadline; `rel_gap` / `time_limit_s` stop HiGHS early on pipelines too
    large to prove optimal (the result then carries the bound). None if infeasible.
    `wait_aware`: blocking is charged up to the deadline instead of the plan's own time.
    `groups`: runs of computations that share one clock (module docstring). `relaxed`: the
    same formulation with the binaries relaxed to [0, 1] (`lp_bound`)."""
    n = model.num_nodes
    option_index = [(i, k) for i in range(n) for k in range(model.num_options[i])]
    nx = len(option_index)
    # Variables: x (binaries, one per option), start times s (n), makespan T.
    num_vars = nx + n + 1
    t_col = nx + n
    p = model.blocking_power
    stages = model.num_stage_gpus
    cost = np.zeros(num_vars)
    for col, (i, k) in enumerate(option_index):
        cost[col] = model.energies[i, k] - p * model.times[i, k]
    cost[t_col] = 0.0 if wait_aware else p * stages  # waiting: P S deadline, a constant

    rows: list[dict[int, float]] = []
    lower: list[float] = []
    upper: list[float] = []
    options_of = [[] for _ in range(n)]
    for col, (i, k) in enumerate(option_index):
        options_of[i].append((col, model.times[i, k]))
    for i in range(n):  # exactly one clock per computation
        rows.append({col: 1.0 for col, _ in options_of[i]})
        lower.append(1.0)
        upper.append(1.0)

    def finish_row(i: int) -> dict[int, float]:
        row = {nx + i: 1.0}
        for col, t in options_of[i]:
            row[col] = t
        return row

    for pred, node in model.dag.edges():  # s_node >= s_pred + d_pred
        row = finish_row(pred)
        row[nx + node] = row.get(nx + node, 0.0) - 1.0
        rows.append(row)
        lower.append(-np.inf)
        upper.append(0.0)
    for i in range(n):  # s_i + d_i <= T
        row = finish_row(i)
        row[t_col] = -1.0
        rows.append(row)
        lower.append(-np.inf)
        upper.append(0.0)

    if groups is not None:
        for row in _group_rows(model, options_of, groups):
            rows.append(row)
            lower.append(0.0)
            upper.append(0.0)

    a = sparse.lil_matrix((len(rows), num_vars))
    for r, row in enumerate(rows):
        for col, val in row.items():
            a[r, col] = val
    matrix = a.tocsc()
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = num_vars, len(rows)
    lp.col_cost_ = cost
    lp.col_lower_ = np.zeros(num_vars)
    lp.col_upper_ = np.r_[np.ones(nx), np.full(n, highspy.kHighsInf), deadline]
    lp.row_lower_ = np.where(np.isinf(lower), -highspy.kHighsInf, lower)
    lp.row_upper_ = np.array(upper, dtype=float)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = matrix.indptr
    lp.a_matrix_.index_ = matrix.indices
    lp.a_matrix_.value_ = matrix.data
    if not relaxed:
        lp.integrality_ = [highspy.HighsVarType.kInteger] * nx + [highspy.HighsVarType.kContinuous] * (n + 1)
    # Nothing on the terminal: HiGHS's log, and its MIP solver's own prints, go nowhere.
    highs = quiet_highs()
    set_option(highs, "mip_rel_gap", float(rel_gap))
    if time_limit_s:
        set_option(highs, "time_limit", float(time_limit_s))
    highs.passModel(lp)
    highs.run()
    status = highs.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return None
    if relaxed:
        if status != highspy.HighsModelStatus.kOptimal:
            raise SolverError(f"LP at deadline {deadline}: {highs.modelStatusToString(status)}")
        value = float(highs.getInfo().objective_function_value)
        x = np.array(highs.getSolution().col_value)
        choice = np.zeros(n, dtype=np.int64)
        weights = np.zeros(n)
        for col, (i, k) in enumerate(option_index):
            if x[col] > weights[i]:
                weights[i], choice[i] = x[col], k
        if wait_aware:
            value += p * stages * deadline
        return ExactResult(value, choice, value)
    info = highs.getInfo()
    if info.primal_solution_status != 2:  # kSolutionStatusFeasible
        raise SolverError(
            f"exact MILP found no plan at deadline {deadline}: {highs.modelStatusToString(status)}"
        )
    x = np.array(highs.getSolution().col_value)
    choice = np.zeros(n, dtype=np.int64)
    for col, (i, k) in enumerate(option_index):
        if x[col] > 0.5:
            choice[i] = k
    time, energy = model.replay(choice, switch_latency_s=0.0)
    bound = float(info.mip_dual_bound)
    bound = None if not np.isfinite(bound) else bound
    if wait_aware:
        constant = p * stages * deadline
        energy = energy + p * stages * max(0.0, deadline - time)
        bound = None if bound is None else bound + constant
    return ExactResult(float(energy), choice, float(energy if bound is None else bound))


def lp_bound(model: CostModel, deadline: float, groups: ClockGroups | None = None,
             wait_aware: bool = False) -> float | None:
    """The energy of the MILP's linear relaxation at `deadline` (a lower bound on every plan
    that meets it, with `groups` as rows of the LP too); None if no plan meets the deadline."""
    result = exact_solve(model, deadline, wait_aware=wait_aware, groups=groups, relaxed=True)
    return None if result is None else result.energy


def _group_rows(model: CostModel, options_of: list[list[tuple[int, float]]], groups: ClockGroups) -> list[dict[int, float]]:
    """Rows tying each group to one clock: per member after the first and per clock f,
    x[first, f] - x[member, f] = 0 (a clock one of them lacks forces the other's to 0)."""
    rows = []
    for g, nodes in enumerate(groups.node_groups(model.dag.index)):
        def columns(node: int) -> dict[int, int]:
            return {int(model.frequencies[node, k]): options_of[node][k][0] for k in range(model.num_options[node])}

        first = columns(int(nodes[0]))
        common = set(first)
        for node in nodes[1:]:
            other = columns(int(node))
            common &= set(other)
            for clock in set(first) | set(other):
                row = {}
                if clock in first:
                    row[first[clock]] = 1.0
                if clock in other:
                    row[other[clock]] = -1.0
                rows.append(row)
        if not common:
            raise SolverError(
                f"clock group {g} ({', '.join(map(str, groups.groups[g][:3]))}...) has no clock "
                f"every member was profiled at; split the group or profile a common clock"
            )
    return rows


def brute_force_min_energy(model: CostModel, deadline: float, groups: ClockGroups | None = None) -> float | None:
    """Cheapest energy with time <= deadline by enumerating every clock assignment (with
    `groups`, only those that keep each group at one clock)."""
    ranges = [range(k) for k in model.num_options]
    total = int(np.prod([len(r) for r in ranges]))
    if total > 2_000_000:
        raise SolverError(f"brute force over {total} assignments is too large")
    choices = np.array(list(itertools.product(*ranges)), dtype=np.int64).T
    times, energies = model.replay(choices)
    ok = times <= deadline + 1e-12
    if groups is not None:
        clocks = np.take_along_axis(model.frequencies, choices, axis=1)
        ok &= groups.holds(clocks, model.dag.index)
    return float(energies[ok].min()) if ok.any() else None
