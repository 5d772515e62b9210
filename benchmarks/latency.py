"""What clock-change latency costs: frontier savings and clock changes vs switch latency.

    python benchmarks/latency.py --microbatches 24 96 --latency-ms 0 5 20 50

For each pipeline and latency L the frontier is solved with `switch_latency_s = L`; every
plan's figures are its exact latency-aware replay. Columns: solve time, intrinsic saving (the
fastest plan vs all-max-clock, no slowdown), the saving of the cheapest plan within 1.05 x and
1.10 x the all-max-clock time, and the clock changes per iteration of the plans picked at
those three deadlines (mean).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from perseus_ext.planning.frontier import Frontier, Plan
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import one_f_one_b
from perseus_ext.planning.solver import SolverOptions, solve_frontier

# The per-computation solver the tables in docs/solver.md measure: no clock-change budget
# (benchmarks/clock_budget.py measures the budget).
UNBUDGETED = SolverOptions(max_clock_changes_per_s=0)

DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / "examples/profiles/gpt3-175b-a100_sxm.csv"
SLOWDOWNS = (1.0, 1.05, 1.10)


def clock_changes(plan: Plan) -> int:
    """Clock requests that change the clock: along each stage, and from the max clock at start."""
    f = plan.frequencies
    return int((np.diff(f, axis=1) != 0).sum() + (f[:, 0] != f.max()).sum())


def row(frontier: Frontier) -> list[float]:
    base = frontier.baseline
    picked = [frontier.plan_for_deadline(base.time * s) for s in SLOWDOWNS]
    savings = [100 * (1 - p.energy / base.energy) for p in picked]
    return [*savings, float(np.mean([clock_changes(p) for p in picked]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE))
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[24, 96])
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0, 5, 20, 50])
    parser.add_argument("--blocking-power", type=float, default=83.64)
    args = parser.parse_args()
    profile = load_profile(args.profile)
    header = (
        f"{'pipeline':>8} {'L ms':>5} {'solve s':>8} {'plans':>6} {'saving@1.00 %':>13} "
        f"{'saving@1.05 %':>13} {'saving@1.10 %':>13} {'changes/iter':>12}"
    )
    print(header)
    print("-" * len(header))
    for m in args.microbatches:
        schedule = one_f_one_b(args.stages, m)
        for latency_ms in args.latency_ms:
            start = time.perf_counter()
            frontier = solve_frontier(
                schedule, profile, args.blocking_power, UNBUDGETED, switch_latency_s=latency_ms / 1e3
            )
            elapsed = time.perf_counter() - start
            s100, s105, s110, changes = row(frontier)
            print(
                f"{f'{args.stages}x{m}':>8} {latency_ms:>5g} {elapsed:>8.2f} {len(frontier.plans):>6} "
                f"{s100:>13.2f} {s105:>13.2f} {s110:>13.2f} {changes:>12.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
