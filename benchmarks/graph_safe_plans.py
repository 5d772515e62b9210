"""How much graph-safe (stage-constant) plans keep of Perseus' saving.

Under a full-iteration CUDA graph perseus-ext can only change a stage's clock between replays,
so it deploys stage-constant plans (one clock per stage, `planning/stage_constant.py`). This
prints, for the published GPT-3 175B and Bloom 176B profiles on A100 and A40, the emulator's
intrinsic saving and total saving (one straggler at T'/T = 1.1, 1.2, 1.5; wait-aware planning,
as the runtime plans) of stage-constant plans against per-computation plans, on the paper's
setup: TP 8 x PP 8, global batch 1536, stage times x10 (`perseus-ext emulate --scale 10`).

    python benchmarks/graph_safe_plans.py [--microbatches 24] [--factors 1.1 1.2 1.5]

Both columns come from the same `Emulator` (same accounting, same straggler policy); only the
solver differs (`solve_frontier` vs `solve_stage_constant`). Prints one markdown table and the
solve times.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

from perseus_ext.emulator import Emulator, JobLayout
from perseus_ext.planning.energy import BLOCKING_POWER_W
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.stage_constant import solve_stage_constant

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ["gpt3-175b-a100_sxm", "gpt3-175b-a40", "bloom-a100_sxm", "bloom-a40"]


def blocking_power(stem: str) -> float:
    return next(watts for gpu, watts in BLOCKING_POWER_W.items() if gpu in stem)


def main() -> None:
    from perseus_ext.commands.arguments import bounded_float, bounded_int  # the CLI's flag types
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--microbatches", type=bounded_int(1, 10**9), default=24)
    parser.add_argument("--factors", type=bounded_float(1.0, 100.0), nargs="+", default=[1.1, 1.2, 1.5])
    parser.add_argument("--profiles", nargs="+", default=PROFILES)
    args = parser.parse_args()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    layout = JobLayout(8, 8, 1536, args.microbatches)
    print(f"TP 8 x PP 8, {args.microbatches} microbatches, DP {layout.data_parallel} = {layout.num_gpus:,} GPUs, "
          f"1F1B, stage times x10, wait-aware; code at {commit}\n")
    head = " | ".join(f"T'/T {f:g}: per-comp. / stage-const." for f in args.factors)
    print(f"| profile | intrinsic: per-computation / stage-constant | {head} |")
    print("|---|---:|" + "---:|" * len(args.factors))
    timings = []
    for stem in args.profiles:
        profile = load_profile(ROOT / "examples" / "profiles" / f"{stem}.csv")
        watts = blocking_power(stem)
        cells = {}
        for name, solver in (("per-computation", None), ("stage-constant", solve_stage_constant)):
            emulator = Emulator(profile, layout, watts, time_scale=10, solver=solver)
            start = time.perf_counter()
            emulator.frontier  # noqa: B018 -- the solve, timed
            solve_s = time.perf_counter() - start
            runs = emulator.sweep([1.0, *args.factors])  # at 1.0 (no straggler) the saving is intrinsic
            cells[name] = (runs[0].total_saving, [run.total_saving for run in runs[1:]])
            timings.append(f"{stem} {name}: {len(emulator.frontier.plans)} plans in {solve_s:.1f} s")
        per, const = cells["per-computation"], cells["stage-constant"]
        totals = " | ".join(f"{100 * a:.1f}% / {100 * b:.1f}%" for a, b in zip(per[1], const[1]))
        print(f"| {stem} | {100 * per[0]:.1f}% / {100 * const[0]:.1f}% | {totals} |", flush=True)
    print()
    print("\n".join(timings))


if __name__ == "__main__":
    main()
