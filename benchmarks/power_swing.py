"""Energy of swing-capped plans against the cap, side by side with all-max clocks plus a
dummy-work power floor at the same cap (docs/power.md).

For each case: the uncapped frontier (the default solver options, or the clock budget asked),
then the capped frontier at each cap under the same options; the cheapest plan within 1.05 x
the all-max-clock time T, its energy against the uncapped cheapest plan at that deadline (same
options, clock budget included: what a user gets without the cap), and all-max clocks with the
least dummy work that meets the same cap (every waiting GPU lifted to the floor, energy
counted). The "why" figures: the fastest and the 1.05 x T plan's swing against all-max clocks.

    python benchmarks/power_swing.py                       # the three cases, caps 0.5 and 0.25
    python benchmarks/power_swing.py --cases gpt3-175b-a100_sxm:12 --caps 0.25
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from perseus_ext.commands.arguments import bounded_float, resolve_profile
from perseus_ext.planning.energy import CostModel, resolve_blocking_power
from perseus_ext.planning.power_swing import plan_power_traces
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.planning.solver import SolverOptions, solve_frontier
from perseus_ext.planning.swing_cap import all_max_with_floor, capped_frontier

CASES = ("gpt3-175b-a100_sxm:12", "gpt3-175b-a100_sxm:24", "bloom-a100_sxm:12")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--cases", nargs="+", default=list(CASES), help="profile:microbatches (8 stages, 1F1B)")
    parser.add_argument("--caps", nargs="+", type=bounded_float(0.0, 1.0, inclusive_min=False), default=[0.5, 0.25])
    parser.add_argument("--slowdown", type=bounded_float(1.0, 10.0), default=1.05, help="deadline as a multiple of T")
    parser.add_argument("--max-clock-changes-per-s", type=bounded_float(0.0, 1000.0), default=SolverOptions().max_clock_changes_per_s,
                        help="the solver's clock-change budget, capped and uncapped alike (0: none; "
                             "default: the solver's)")
    args = parser.parse_args()
    power = resolve_blocking_power("a100")
    print(f"clock-change budget: {SolverOptions(max_clock_changes_per_s=args.max_clock_changes_per_s).clock_budget.describe()}")
    print("| case | cap | capped J | uncapped J | capped vs uncapped | all-max + floor J | floor vs uncapped "
          "| capped swing / all-max | capping wall s, CPU s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    why = []
    for case in args.cases:
        name, microbatches = case.split(":")
        profile = load_profile(resolve_profile(name))
        schedule = build_schedule("1f1b", profile.num_stages, int(microbatches))
        options = SolverOptions(max_clock_changes_per_s=args.max_clock_changes_per_s)
        frontier = solve_frontier(schedule, profile, power, options)
        deadline = args.slowdown * frontier.baseline.time
        uncapped = frontier.plan_for_deadline(deadline)
        model = CostModel(schedule, profile, power)
        reference = plan_power_traces(model, model.fastest_choice())[0].figures()
        fast, slow = (plan_power_traces(model, model.choice_of(p))[0].figures() for p in (frontier.fastest, uncapped))
        why.append((case, fast, slow, reference))
        for cap in args.caps:
            started, cpu = time.perf_counter(), time.process_time()
            capped = capped_frontier(frontier, schedule, profile, cap, deadlines_s=(deadline,),
                                     clock_budget=options.clock_budget)
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
            plan = capped.frontier.plan_for_deadline(deadline)
            swing = capped.plans[capped.frontier.plans.index(plan)].swing
            floor_j = all_max_with_floor(schedule, profile, power, cap)
            print(f"| {name} 8 x {microbatches} | {cap:g} | {plan.energy:,.1f} | {uncapped.energy:,.1f} | "
                  f"{plan.energy / uncapped.energy - 1:+.2%} | {floor_j:,.1f} | {floor_j / uncapped.energy - 1:+.1%} | "
                  f"{swing.peak_to_trough_w / reference.peak_to_trough_w:.3f} | {elapsed:.0f}, {cpu:.0f} |")
    print()
    print("| case | fastest plan swing vs all-max | 1.05 x T plan swing vs all-max | largest ramp, fastest / 1.05 x T vs all-max |")
    print("|---|---:|---:|---:|")
    for case, fast, slow, reference in why:
        ratio = lambda f, attr: getattr(f, attr) / getattr(reference, attr) - 1  # noqa: E731
        print(f"| {case} | {ratio(fast, 'peak_to_trough_w'):+.1%} | {ratio(slow, 'peak_to_trough_w'):+.1%} | "
              f"{ratio(fast, 'max_ramp_w_per_s'):+.1%} / {ratio(slow, 'max_ramp_w_per_s'):+.1%} |")


if __name__ == "__main__":
    np.seterr(invalid="ignore")
    main()
