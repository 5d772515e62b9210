"""Wall time of the paper's large-scale emulation: GPT-3 175B on A100, TP 8 x PP 8, global batch
1536, 12/24/48/96 microbatches (8,192 to 1,024 GPUs), slowdown sweep 1.0-1.5.

    python benchmarks/emulator.py [--profile PATH] [--repeat N]

Prints the time to solve the four frontiers and to run the 11-factor sweep on each, and the
T'/T = 1.2 savings table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from perseus_ext.emulator import Emulator, JobLayout
from perseus_ext.emulator.report import summary_table
from perseus_ext.planning.profile import load_profile

ROOT = Path(__file__).resolve().parents[1]
SWEEP = [1.0 + 0.05 * k for k in range(11)]


def main() -> None:
    from perseus_ext.commands.arguments import bounded_float, bounded_int  # the CLI's flag types
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--profile", default=str(ROOT / "examples/profiles/gpt3-175b-a100_sxm.csv"))
    parser.add_argument("--blocking-power", type=bounded_float(0.0, 1e9, inclusive_min=False), default=83.64)
    parser.add_argument("--repeat", type=bounded_int(1, 10**9), default=1)
    args = parser.parse_args()

    profile = load_profile(args.profile)
    for _ in range(args.repeat):
        start = time.perf_counter()
        solve_s, sweep_s, at_1_2 = 0.0, 0.0, []
        for microbatches in (12, 24, 48, 96):
            layout = JobLayout(8, 8, 1536, microbatches)
            emulator = Emulator(profile, layout, args.blocking_power, time_scale=10)
            t0 = time.perf_counter()
            frontier = emulator.frontier
            t1 = time.perf_counter()
            runs = emulator.sweep(SWEEP)
            t2 = time.perf_counter()
            solve_s += t1 - t0
            sweep_s += t2 - t1
            at_1_2.append(runs[4])
            print(f"{microbatches:3d} microbatches ({layout.num_gpus:,} GPUs): frontier "
                  f"{len(frontier.plans)} plans in {t1 - t0:.2f} s, sweep of {len(SWEEP)} "
                  f"factors in {t2 - t1:.2f} s")
        total = time.perf_counter() - start
        print(f"total {total:.2f} s (frontiers {solve_s:.2f} s, accounting {sweep_s:.2f} s)\n")
    print(summary_table(at_1_2))


if __name__ == "__main__":
    main()
