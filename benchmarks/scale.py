"""Solver wall time and peak memory vs pipeline size, up to tens of thousands of computations.

    python benchmarks/scale.py --sizes 8x24 8x96 16x128 16x256x2 32x256x2

(32 x 256 x 2 is 32,768 computations.)

A size is STAGESxMICROBATCHES[xVIRTUAL]. Profiles for more stages than the published 8 are
built from them: each published stage is split into `stages / 8` equal stages (its layers
spread evenly, so each gets 1/k of the time and energy at every clock). Each solve runs in a
fresh process; peak memory is that process's maximum resident set; CPU s is the solve's CPU
time (the wall time on a shared machine is larger).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time
from pathlib import Path

from perseus_ext.planning.profile import Profile, load_profile
from perseus_ext.planning.schedule import interleaved, one_f_one_b
from perseus_ext.planning.solver import SolverOptions, solve_frontier

# The per-computation solver the tables in docs/solver.md measure: no clock-change budget
# (benchmarks/clock_budget.py measures the budget).
UNBUDGETED = SolverOptions(max_clock_changes_per_s=0)

DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / "examples/profiles/gpt3-175b-a100_sxm.csv"


def split_stages(profile: Profile, factor: int) -> Profile:
    """A profile of `factor` x as many stages: stage s becomes stages s*factor .. s*factor+factor-1,
    each with 1/factor of its time and energy."""
    rows = [
        dict(row, stage=row["stage"] * factor + k, time=row["time"] / factor, energy=row["energy"] / factor)
        for row in profile.rows()
        for k in range(factor)
    ]
    return Profile.from_rows(rows, source=f"{profile.source} split x{factor}")


def solve_once(profile_path: str, stages: int, microbatches: int, chunks: int, power: float, queue) -> None:
    raw = load_profile(profile_path)
    base = raw.num_stages
    profile = (raw if stages == base else split_stages(raw, stages // base))
    if chunks > 1:
        schedule = interleaved(stages, microbatches, chunks)
    else:
        schedule = one_f_one_b(stages, microbatches)
    start, cpu_start = time.perf_counter(), time.process_time()
    frontier = solve_frontier(schedule, profile, power, UNBUDGETED)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    computations = sum(len(order) for order in schedule.orders)
    queue.put((computations, elapsed, cpu, peak_mib, len(frontier.plans), frontier.intrinsic_saving()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE))
    parser.add_argument("--sizes", nargs="+", default=["8x24", "8x96", "16x128"])
    parser.add_argument("--blocking-power", type=float, default=83.64)
    parser.add_argument("--limit", type=float, default=1800.0, help="seconds per solve")
    args = parser.parse_args()
    header = (
        f"{'size':>10} {'computations':>12} {'wall s':>8} {'CPU s':>8} {'peak MiB':>9} {'plans':>6} "
        f"{'saving %':>8}"
    )
    print(header)
    print("-" * len(header))
    for size in args.sizes:
        stages, microbatches, *rest = (int(x) for x in size.split("x"))
        chunks = rest[0] if rest else 1
        context = mp.get_context("spawn")
        queue = context.Queue()
        proc = context.Process(
            target=solve_once, args=(args.profile, stages, microbatches, chunks, args.blocking_power, queue)
        )
        proc.start()
        try:
            computations, elapsed, cpu, peak, plans, saving = queue.get(timeout=args.limit)
        except Exception:
            proc.kill()
            print(f"{size:>10} {'-':>12} {'> limit':>8}")
            continue
        proc.join()
        print(
            f"{size:>10} {computations:>12} {elapsed:>8.2f} {cpu:>8.2f} {peak:>9.0f} {plans:>6} "
            f"{100 * saving:>8.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
