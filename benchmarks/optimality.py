"""Gap to the optimum per deadline: the frontier solver against an exact MILP on ALL profiled clocks.

    python benchmarks/optimality.py --milp-time-limit 120 --save-reference milp.json

For each case (profile, stages x microbatches; default: GPT-3 A100 8 x 4, 8 x 8, 8 x 12, Bloom
A100 8 x 8, GPT-3 A40 8 x 8) and each deadline (a multiple of the all-max-clock iteration time),
the MILP of `perseus_ext.planning.exact` is solved on every clock the profile measured (the
oracle must not share the solver's useful-clock filter) to `--milp-gap` or the time limit. The
tables show its plan, its proven lower bound, and how much more energy the frontier's plan for
that deadline costs (negative: ours is cheaper than the MILP's incumbent, which did not close).
The last line per case checks that the fastest plan is exactly as fast as all GPUs at max clock.
`--reference FILE` reuses saved MILP results (they take minutes at 8 x 12); with
`--save-reference` each result is written as soon as it is known.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from perseus_ext.data import shipped_profile
from perseus_ext.planning.energy import BLOCKING_POWER_W, CostModel
from perseus_ext.planning.exact import exact_solve
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import one_f_one_b
from perseus_ext.planning.solver import SolverOptions, solve_frontier

# The per-computation solver the tables in docs/solver.md measure: no clock-change budget
# (benchmarks/clock_budget.py measures the budget).
UNBUDGETED = SolverOptions(max_clock_changes_per_s=0)

CASES = (
    "gpt3-175b-a100_sxm:8x4", "gpt3-175b-a100_sxm:8x8", "gpt3-175b-a100_sxm:8x12",
    "bloom-a100_sxm:8x8", "gpt3-175b-a40:8x8",
)
TARGET_PCT = 0.1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), help="PROFILE:STAGESxMICROBATCHES")
    parser.add_argument("--slowdowns", type=float, nargs="+", default=[1.0, 1.05, 1.1, 1.2])
    parser.add_argument("--milp-gap", type=float, default=1e-4, help="relative MILP gap to stop at")
    parser.add_argument("--milp-time-limit", type=float, default=120.0, help="seconds per MILP")
    parser.add_argument("--reference", type=Path, help="saved MILP results to compare against")
    parser.add_argument("--save-reference", type=Path, help="write the MILP results here")
    args = parser.parse_args()
    reference = json.loads(args.reference.read_text()) if args.reference else {}
    print(f"MILP: every profiled clock, HiGHS to a {args.milp_gap:g} gap or {args.milp_time_limit:g} s "
          f"per deadline; target: ours at most {TARGET_PCT} % over the MILP's plan")
    worst = -1.0
    for case in args.cases:
        worst = max(worst, run_case(case, args, reference))
    print(f"\nworst ours - MILP over every row: {worst:+.3f} % "
          f"({'within' if worst <= TARGET_PCT else 'OVER'} the {TARGET_PCT} % target)")


def run_case(case: str, args: argparse.Namespace, reference: dict) -> float:
    """Print one case's table; the worst ours - MILP (%)."""
    name, size = case.split(":")
    stages, microbatches = (int(x) for x in size.split("x"))
    power = BLOCKING_POWER_W["a40" if name.endswith("a40") else "a100"]
    measured = load_profile(shipped_profile(name))  # every clock: the solver filters its own
    schedule = one_f_one_b(stages, microbatches)
    model = CostModel(schedule, measured, power)
    clocks = sum(len(op) for op in measured.points.values())
    started = time.perf_counter()
    frontier = solve_frontier(schedule, measured, power, UNBUDGETED)
    solve_s = time.perf_counter() - started
    t_base = frontier.baseline.time
    print(f"\n{name} {stages} x {microbatches}, P_block {power:g} W, {clocks} measured clocks; frontier "
          f"solved in {solve_s:.2f} s ({len(frontier.plans)} plans)\n")
    print("| deadline x T | MILP J | bound J | MILP gap % | MILP s | ours J | ours - MILP % | ours - bound % |")
    print("|---|---|---|---|---|---|---|---|")
    worst = -1.0
    for slowdown in args.slowdowns:
        key = f"{case}@{slowdown:g}"
        if key not in reference:
            started = time.perf_counter()
            result = exact_solve(model, t_base * slowdown, args.milp_gap, args.milp_time_limit)
            reference[key] = {"energy": result.energy, "bound": result.lower_bound,
                              "seconds": time.perf_counter() - started}
            if args.save_reference:
                args.save_reference.parent.mkdir(parents=True, exist_ok=True)
                args.save_reference.write_text(json.dumps(reference, indent=1))
        milp, bound, seconds = (reference[key][k] for k in ("energy", "bound", "seconds"))
        ours = frontier.plan_for_deadline(t_base * slowdown).energy
        over = 100 * (ours / milp - 1)
        worst = max(worst, over)
        print(f"| {slowdown:.2f} | {milp:.2f} | {bound:.2f} | {100 * (milp / bound - 1):.3f} | {seconds:.0f} | "
              f"{ours:.2f} | {over:+.3f} | {100 * (ours / bound - 1):+.3f} |", flush=True)
    fast = frontier.fastest
    print(f"\nfastest plan {fast.time:.6f} s, all max clock {t_base:.6f} s: "
          f"{'exactly as fast' if fast.time == t_base else f'{fast.time - t_base:+.3g} s'}; "
          f"intrinsic saving {100 * frontier.intrinsic_saving():.2f} %")
    return worst


if __name__ == "__main__":
    main()
