"""Wait-aware planning against one global clock and EnvPipe-style, on the published profiles.

    python benchmarks/wait_aware_sweep.py [--profiles bloom-a100_sxm gpt3-175b-a40 ...]
        [--microbatches 48 96] [--factors 1.05 1.1 1.2 1.3 1.5 2.0] [--markdown]

The paper's large-scale setup for every profile: TP 8 x PP 8, global batch 1536, microbatch size 1,
time x 10 and energy x 10 x TP, one straggler at T'/T. Prints, per profile, the command that
reproduces its table with `perseus-ext emulate`, then the table (total saving vs all GPUs at max
clock; margin = perseus-ext over the better of one global clock and EnvPipe-style), and, for each
tie, why: at a deadline that lets every computation run the clock of least energy minus blocking
power x time, and that clock is the same for all of them, the one-global-clock plan is the exact
optimum (the wait-aware cost is a sum over computations, each at its minimum), so nothing beats it.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from perseus_ext.emulator import Emulator, JobLayout
from perseus_ext.emulator.core import GLOBAL_CLOCK, PERSEUS
from perseus_ext.data import shipped_profile
from perseus_ext.emulator.report import comparison_table
from perseus_ext.planning.energy import BLOCKING_POWER_W
from perseus_ext.planning.profile import Profile, load_profile

PROFILES = ("gpt3-175b-a100_sxm", "bloom-a100_sxm", "gpt3-175b-a40", "bloom-a40")
FACTORS = (1.05, 1.1, 1.2, 1.3, 1.5, 2.0)
TIE_PT = 0.005  # margins within this many percentage points are reported as ties


def blocking_power_key(stem: str) -> str:
    return "a40" if stem.endswith("a40") else "a100"


def command(stem: str, microbatches: list[int], factors: list[float]) -> str:
    return (f"perseus-ext emulate --profile {stem} --tp 8 --pp 8 --global-batch 1536 --microbatches "
            f"{' '.join(map(str, microbatches))} --blocking-power {blocking_power_key(stem)} --scale 10 "
            f"--sweep {' '.join(f'{f:g}' for f in factors)} --markdown")


def wait_optimal_clocks(profile: Profile, blocking_power_w: float) -> set[int]:
    """Per (stage, instruction), the clock of least energy - blocking power x time."""
    clocks = set()
    for op in profile.useful_clocks(blocking_power_w).points.values():
        clocks.add(int(op.frequencies[int(np.argmin(op.energies - blocking_power_w * op.times))]))
    return clocks


def main() -> None:
    from perseus_ext.commands.arguments import bounded_float, bounded_int  # the CLI's flag types
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES))
    parser.add_argument("--microbatches", nargs="+", type=bounded_int(1, 10**9), default=[48, 96])
    parser.add_argument("--factors", nargs="+", type=bounded_float(1.0, 100.0), default=list(FACTORS))
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    for stem in args.profiles:
        started = time.perf_counter()
        profile = load_profile(shipped_profile(stem))
        power = BLOCKING_POWER_W[blocking_power_key(stem)]
        sweeps, ties = {}, []
        for microbatches in args.microbatches:
            emulator = Emulator(profile, JobLayout(8, 8, 1536, microbatches), power, time_scale=10)
            sweeps[microbatches] = emulator.sweep(args.factors)
            for em in sweeps[microbatches]:
                margin = em.total_saving - em.outcomes[GLOBAL_CLOCK].saving
                if abs(margin) < TIE_PT / 100:
                    ties.append((microbatches, em))
        print(f"## {stem} ({time.perf_counter() - started:.0f} s)\n\n{command(stem, args.microbatches, args.factors)}\n")
        print(comparison_table(sweeps, stem, markdown=args.markdown))
        optimal = wait_optimal_clocks(profile, power)
        for microbatches, em in ties:
            deployed = em.outcomes[PERSEUS].deployments[0].others
            clocks = sorted({int(c) for row in deployed.frequencies for c in row})
            print(f"tie at {microbatches} mb, T'/T {em.scenario.factors[0]:g}: perseus-ext runs "
                  f"{clocks} MHz, the global clock {em.outcomes[GLOBAL_CLOCK].note}; every computation's "
                  f"clock of least energy - blocking power x time: {sorted(optimal)} MHz"
                  + (" (one clock for all: the global clock is the exact optimum)" if len(optimal) == 1 else ""))
        print()


if __name__ == "__main__":
    main()
