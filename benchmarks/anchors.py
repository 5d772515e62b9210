"""What the LP walk's anchor count buys: solve CPU against the frontier's energy gap to a walk
with many more anchors, at deadlines evenly spaced from T_min to the min-energy plan.

    python benchmarks/anchors.py --microbatches 24 --anchors 256 192 160 128 [--reference 1024]

Each row solves the frontier with `SolverOptions(anchors=N)` (median CPU of `--repeats` solves in
this process) and, at `--deadlines` evenly spaced deadlines, compares the cheapest plan meeting
each with the reference frontier's (`--reference` anchors): mean and worst gap, and the gap at
1.00 / 1.05 / 1.10 x the all-max-clock time. Fewer anchors mean fewer LP solves (each ~0.4 ms of
fixed HiGHS work at 8 x 24) and a coarser relaxed plan between anchors to round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from perseus_ext.data import shipped_profile
from perseus_ext.planning.energy import BLOCKING_POWER_W
from perseus_ext.planning.options import SolverOptions
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import one_f_one_b
from perseus_ext.planning.solver import solve_frontier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="gpt3-175b-a100_sxm")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=24)
    parser.add_argument("--anchors", type=int, nargs="+", default=[256, 192, 160, 128])
    parser.add_argument("--reference", type=int, default=1024, help="anchors of the reference walk")
    parser.add_argument("--deadlines", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    profile = load_profile(shipped_profile(args.profile))
    power = BLOCKING_POWER_W["a40" if args.profile.endswith("a40") else "a100"]
    schedule = one_f_one_b(args.stages, args.microbatches)
    reference = solve_frontier(schedule, profile, power, SolverOptions(anchors=args.reference, max_clock_changes_per_s=0))
    deadlines = np.linspace(reference.fastest.time, reference.min_energy.time, args.deadlines)
    t_max_clock = reference.baseline.time

    def energies(frontier, at) -> np.ndarray:
        return np.array([frontier.plan_for_deadline(d).energy for d in at])

    wanted = energies(reference, deadlines)
    marks = t_max_clock * np.array([1.0, 1.05, 1.10])
    wanted_marks = energies(reference, marks)
    print(f"{args.profile} {args.stages} x {args.microbatches}, against {args.reference} anchors, "
          f"{args.deadlines} deadlines")
    print(f"{'anchors':>8} {'CPU ms':>7} {'mean gap %':>11} {'worst gap %':>12} {'at 1.00 / 1.05 / 1.10 x T %':>28}")
    for anchors in args.anchors:
        options = SolverOptions(anchors=anchors, max_clock_changes_per_s=0)
        cpu = []
        for _ in range(args.repeats):
            started = time.process_time()
            frontier = solve_frontier(schedule, profile, power, options)
            cpu.append(time.process_time() - started)
        gap = 100 * (energies(frontier, deadlines) / wanted - 1)
        at_marks = 100 * (energies(frontier, marks) / wanted_marks - 1)
        print(f"{anchors:>8} {1e3 * statistics.median(cpu):>7.0f} {gap.mean():>+11.4f} {gap.max():>+12.3f} "
              f"{' / '.join(f'{g:+.3f}' for g in at_marks):>28}", flush=True)


if __name__ == "__main__":
    main()
