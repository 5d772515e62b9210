"""What a clock-change budget costs in energy (`perseus-ext emulate --clock-budgets`).

For one pipeline of the emulated job, the frontier is solved under each budget (no budget,
10, 5 and 2 changes per second per GPU, one clock per stage: `planning/clock_budget.py`,
`planning/stage_constant.py`) on the job's real stage times, and each is read the way the
runtime reads it: the cheapest plan for an iteration that ends at T' anyway
(`wait_aware.plan_ending_at`), T' a multiple of the all-max-clock time T. The energy is one
pipeline's per iteration, its saving against every GPU at the max clock held to the same T'.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from perseus_ext.planning.frontier import Frontier
from perseus_ext.planning.options import SolverOptions
from perseus_ext.planning.stage_constant import solve_stage_constant
from perseus_ext.planning.wait_aware import plan_ending_at, waiting_energy

BUDGET_RATES = (0.0, 10.0, 5.0, 2.0)  # clock changes per second per GPU; 0: no budget
DEADLINE_RATIOS = (1.0, 1.05)  # T'/T


@dataclass(frozen=True)
class BudgetCost:
    """One budget's plans at each T'/T: energy per iteration (J), saving against all-max
    clocks, and the most clock changes per second and shortest hold of the plans chosen."""

    label: str
    energies_j: tuple[float, ...]
    savings: tuple[float, ...]
    changes_per_s: float
    shortest_hold_s: float
    solve_s: float


def budget_costs(emulator: object, ratios: tuple[float, ...] = DEADLINE_RATIOS,
                 rates: tuple[float, ...] = BUDGET_RATES) -> list[BudgetCost]:
    """Each budget's cost for one pipeline of `emulator` (an `emulator.core.Emulator`)."""
    from perseus_ext.planning.solver import solve_frontier

    profile = emulator.profile.scaled(emulator.time_scale, emulator.energy_scale * emulator.layout.tensor_parallel)
    blocking = emulator.stage_blocking_power
    schedule = emulator.schedule
    solves: list[tuple[str, Frontier, float]] = []
    for rate in rates:
        started = time.perf_counter()
        frontier = solve_frontier(schedule, profile, blocking, SolverOptions(max_clock_changes_per_s=rate),
                                  wait_aware=True)
        solves.append(("no budget" if rate == 0 else f"{rate:g} changes/s", frontier, time.perf_counter() - started))
    started = time.perf_counter()
    frontier = solve_stage_constant(schedule, profile, blocking, wait_aware=True)
    solves.append(("one clock per stage", frontier, time.perf_counter() - started))
    costs = []
    for label, frontier, seconds in solves:
        t_max = frontier.baseline.time
        chosen = [plan_ending_at(frontier, ratio * t_max) for ratio in ratios]
        energies = tuple(waiting_energy(frontier, plan, ratio * t_max) for plan, ratio in zip(chosen, ratios))
        baseline = tuple(waiting_energy(frontier, frontier.baseline, ratio * t_max) for ratio in ratios)
        figures = [plan.clock for plan in chosen if plan.clock is not None]
        costs.append(BudgetCost(
            label, energies, tuple(1 - e / b for e, b in zip(energies, baseline)),
            max((f.changes_per_s for f in figures), default=0.0),
            min((f.shortest_hold_s for f in figures), default=float("inf")), seconds,
        ))
    return costs


def budget_table(costs: list[BudgetCost], ratios: tuple[float, ...] = DEADLINE_RATIOS, markdown: bool = False) -> str:
    """The costs as a table: energy and saving at each T'/T, the plans' change figures."""
    header = ["budget"] + [f"J @ {r:g}" for r in ratios] + [f"saving @ {r:g}" for r in ratios] + [
        "vs no budget @ " + "/".join(f"{r:g}" for r in ratios), "changes/s", "shortest hold", "solve s"]
    free = costs[0].energies_j
    rows = []
    for cost in costs:
        extra = "/".join(f"{100 * (e / f - 1):+.1f} %" for e, f in zip(cost.energies_j, free))
        hold = "none" if cost.shortest_hold_s == float("inf") else f"{1e3 * cost.shortest_hold_s:.0f} ms"
        rows.append([cost.label] + [f"{e:.1f}" for e in cost.energies_j] + [f"{100 * s:.2f} %" for s in cost.savings]
                    + [extra, f"{cost.changes_per_s:g}", hold, f"{cost.solve_s:.1f}"])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    return "\n".join("  ".join(str(x).rjust(w) for x, w in zip(line, widths)) for line in [header, *rows])


LEGEND = (
    "J: one pipeline's energy per iteration held to T' = ratio x the all-max-clock time (the cheapest plan for it); "
    "saving: against every GPU at its max clock held to the same T'; changes/s: the most clock changes one GPU "
    "makes in any second, shortest hold: the shortest time a GPU keeps a clock, of the plans chosen (iterations "
    "back to back). Budgets: solver options max_clock_changes_per_s (0: none; docs/solver.md)."
)
