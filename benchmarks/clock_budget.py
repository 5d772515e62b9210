"""What a clock-change budget costs in energy: GPT-3 175B on A100, 8 stages x 12 microbatches.

For each budget (no budget; at most 10, 5, 2 clock changes per second per GPU; one clock per
stage), the frontier of one pipeline is solved under it (`perseus_ext/planning/clock_budget.py`)
and read as the runtime reads it: the cheapest plan for an iteration held to T' = 1.0 and 1.05 x
the all-max-clock time. The budget bites where computations are short: at the profiled slice's
stage times (`--scale 1`: 50-93 ms computations) and hardly at the paper's full model (`--scale
10`: stage times x 10). Prints one markdown table per scale, the command that makes it first.

    python benchmarks/clock_budget.py [--microbatches 12] [--scales 1 10]

The same table for any profile and job: `perseus-ext emulate --profile P --microbatches M
--clock-budgets --markdown`.
"""

from __future__ import annotations

import argparse

from perseus_ext.data import shipped_profile
from perseus_ext.emulator import Emulator, JobLayout
from perseus_ext.emulator.clock_budget import LEGEND, budget_costs, budget_table
from perseus_ext.planning.energy import BLOCKING_POWER_W
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import ScheduleKind

PROFILE = "gpt3-175b-a100_sxm"


def main() -> None:
    from perseus_ext.commands.arguments import bounded_float, bounded_int  # the CLI's flag types

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--microbatches", type=bounded_int(1, 10_000), default=12)
    parser.add_argument("--scales", type=bounded_float(0, 1000, inclusive_min=False), nargs="+", default=[1.0, 10.0])
    args = parser.parse_args()
    profile = load_profile(shipped_profile(PROFILE))
    for scale in args.scales:
        layout = JobLayout(tensor_parallel=1, pipeline_parallel=profile.num_stages, global_batch=args.microbatches,
                           microbatches=args.microbatches, microbatch_size=1, schedule=ScheduleKind.ONE_F_ONE_B.value)
        emulator = Emulator(profile, layout, BLOCKING_POWER_W["a100"], time_scale=scale)
        print(f"\n`perseus-ext emulate --profile {PROFILE} --microbatches {args.microbatches} --scale {scale:g} "
              f"--clock-budgets --markdown` (GPT-3 A100, {profile.num_stages} x {args.microbatches}, stage times "
              f"x{scale:g}):\n")
        print(budget_table(budget_costs(emulator), markdown=True))
    print("\n" + LEGEND)


if __name__ == "__main__":
    main()
