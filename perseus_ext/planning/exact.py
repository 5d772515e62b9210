"""Exact minimum-energy plans for small pipelines: the yardstick for the frontier solver.

`exact_min_energy` solves, for one deadline, the discrete problem exactly as a mixed-integer
program (HiGHS through `scipy.optimize.milp`): one binary per (computation, clock), start times,
and the iteration time as a variable so blocking energy is charged on the plan's own time.
`exact_wait_aware` solves the wait-aware problem (the iteration ends at the deadline whatever
the plan, so every stage pays blocking power until then). `brute_force_min_energy` enumerates every assignment and is only for the tiniest cases (it
checks the MILP formulation itself).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from perseus_ext.errors import SolverError
from perseus_ext.planning.energy import CostModel


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


def exact_min_energy(model: CostModel, deadline: float) -> tuple[float, np.ndarray] | None:
    """(energy, choice) of the cheapest plan with iteration time <= deadline; None if infeasible."""
    result = exact_solve(model, deadline)
    return None if result is None else (result.energy, result.choice)


def exact_wait_aware(model: CostModel, deadline: float) -> ExactResult | None:
    """Cheapest plan, time <= deadline, when the iteration ends at the deadline anyway: its
    energy counts every stage blocked until the deadline (`energy` and `lower_bound` include
    that wait). None if infeasible."""
    return exact_solve(model, deadline, wait_aware=True)


def exact_solve(
    model: CostModel, deadline: float, rel_gap: float = 1e-9, time_limit_s: float | None = None,
    wait_aware: bool = False,
) -> ExactResult | None:
    """The MILP at one deadline; `rel_gap` / `time_limit_s` stop HiGHS early on pipelines too
    large to prove optimal (the result then carries the bound). None if infeasible.
    `wait_aware`: blocking is charged up to the deadline instead of the plan's own time."""
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

    a = sparse.lil_matrix((len(rows), num_vars))
    for r, row in enumerate(rows):
        for col, val in row.items():
            a[r, col] = val
    integrality = np.r_[np.ones(nx), np.zeros(n + 1)]
    bounds = Bounds(np.zeros(num_vars), np.r_[np.ones(nx), np.full(n, np.inf), deadline])
    result = milp(
        cost,
        constraints=LinearConstraint(a.tocsr(), lower, upper),
        integrality=integrality,
        bounds=bounds,
        options={"mip_rel_gap": rel_gap, **({"time_limit": time_limit_s} if time_limit_s else {})},
    )
    if result.status == 2:  # infeasible
        return None
    if result.x is None:
        raise SolverError(f"exact MILP failed at deadline {deadline}: {result.message}")
    choice = np.zeros(n, dtype=np.int64)
    for col, (i, k) in enumerate(option_index):
        if result.x[col] > 0.5:
            choice[i] = k
    time, energy = model.replay(choice, switch_latency_s=0.0)
    bound = getattr(result, "mip_dual_bound", None)
    if wait_aware:
        constant = p * stages * deadline
        energy = energy + p * stages * max(0.0, deadline - time)
        bound = None if bound is None else bound + constant
    return ExactResult(float(energy), choice, float(energy if bound is None else bound))


def brute_force_min_energy(model: CostModel, deadline: float) -> float | None:
    """Cheapest energy with time <= deadline by enumerating every clock assignment."""
    ranges = [range(k) for k in model.num_options]
    total = int(np.prod([len(r) for r in ranges]))
    if total > 2_000_000:
        raise SolverError(f"brute force over {total} assignments is too large")
    choices = np.array(list(itertools.product(*ranges)), dtype=np.int64).T
    times, energies = model.replay(choices)
    ok = times <= deadline + 1e-12
    return float(energies[ok].min()) if ok.any() else None
