"""Gap to the optimum per deadline: the frontier solver against an exact MILP (HiGHS).

    python benchmarks/optimality.py --stages 8 --microbatches 12 --slowdowns 1.0 1.05 1.1 \
        --milp-time-limit 600 --save-reference benchmarks/results/milp-8x12.json

At each deadline (a multiple of the all-max-clock iteration time) the MILP of
`perseus_ext.planning.exact` is solved to `--milp-gap` or the time limit; the table shows its
plan, its proven lower bound, and how much more energy the frontier's plan for that deadline
costs. `--reference FILE` reuses saved MILP results (they take minutes at 8 x 12).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.exact import exact_solve
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import one_f_one_b
from perseus_ext.planning.solver import solve_frontier

DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / "examples/profiles/gpt3-175b-a100_sxm.csv"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE))
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=12)
    parser.add_argument("--blocking-power", type=float, default=83.64)
    parser.add_argument("--slowdowns", type=float, nargs="+", default=[1.0, 1.05, 1.1])
    parser.add_argument("--milp-gap", type=float, default=5e-4, help="relative MILP gap to stop at")
    parser.add_argument("--milp-time-limit", type=float, default=600.0, help="seconds per MILP")
    parser.add_argument("--reference", type=Path, help="saved MILP results to compare against")
    parser.add_argument("--save-reference", type=Path, help="write the MILP results here")
    args = parser.parse_args()

    profile = load_profile(args.profile)
    schedule = one_f_one_b(args.stages, args.microbatches)
    model = CostModel(schedule, profile, args.blocking_power)
    started = time.perf_counter()
    frontier = solve_frontier(schedule, profile, args.blocking_power)
    solve_s = time.perf_counter() - started
    t_base = frontier.baseline.time

    reference = json.loads(args.reference.read_text()) if args.reference else {}
    header = f"{'deadline':>8} {'MILP J':>10} {'bound J':>10} {'MILP gap %':>10} {'ours J':>10} {'ours-MILP %':>11} {'ours-bound %':>12}"
    print(f"{args.stages} x {args.microbatches}, frontier solved in {solve_s:.2f} s ({len(frontier.plans)} plans)")
    print(header)
    print("-" * len(header))
    for slowdown in args.slowdowns:
        key = f"{slowdown:g}"
        if key not in reference:
            result = exact_solve(model, t_base * slowdown, args.milp_gap, args.milp_time_limit)
            reference[key] = {"energy": result.energy, "bound": result.lower_bound}
        milp, bound = reference[key]["energy"], reference[key]["bound"]
        ours = frontier.plan_for_deadline(t_base * slowdown).energy
        print(
            f"{slowdown:>8.2f} {milp:>10.1f} {bound:>10.1f} {100 * (milp / bound - 1):>10.3f} "
            f"{ours:>10.1f} {100 * (ours / milp - 1):>11.3f} {100 * (ours / bound - 1):>12.3f}",
            flush=True,
        )
    if args.save_reference:
        args.save_reference.parent.mkdir(parents=True, exist_ok=True)
        args.save_reference.write_text(json.dumps(reference, indent=1))


if __name__ == "__main__":
    main()
