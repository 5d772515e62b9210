"""Bytes a frontier costs on disk and on the wire: the JSON file vs the compact per-stage form.

    python benchmarks/frontier_io.py --stages 8 --microbatches 24 96

Columns: plans; JSON file size and write time (`Frontier.save`); the whole frontier pickled as
`to_dict()` (what a broadcast of the full dict ships to every rank); the compact form with all
stages; and the largest compact form one rank needs (its own stage only).
"""

from __future__ import annotations

import argparse
import pickle
import tempfile
import time
from pathlib import Path

from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import one_f_one_b
from perseus_ext.planning.solver import SolverOptions, solve_frontier

# The per-computation solver the tables in docs/solver.md measure: no clock-change budget
# (benchmarks/clock_budget.py measures the budget).
UNBUDGETED = SolverOptions(max_clock_changes_per_s=0)

DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / "examples/profiles/gpt3-175b-a100_sxm.csv"


def main() -> None:
    from perseus_ext.commands.arguments import bounded_float, bounded_int  # the CLI's flag types
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE))
    parser.add_argument("--stages", type=bounded_int(1, 10**9), default=8)
    parser.add_argument("--microbatches", type=bounded_int(1, 10**9), nargs="+", default=[24, 96])
    parser.add_argument("--blocking-power", type=bounded_float(0.0, 1e9, inclusive_min=False), default=83.64)
    args = parser.parse_args()
    profile = load_profile(args.profile)
    header = f"{'pipeline':>8} {'plans':>6} {'JSON MB':>8} {'write s':>8} {'dict pickle MB':>14} {'compact MB':>10} {'per rank MB':>11}"
    print(header)
    print("-" * len(header))
    for m in args.microbatches:
        frontier = solve_frontier(one_f_one_b(args.stages, m), profile, args.blocking_power, UNBUDGETED)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "frontier.json"
            start = time.perf_counter()
            frontier.save(path)
            write_s = time.perf_counter() - start
            json_mb = path.stat().st_size / 1e6
        whole = len(pickle.dumps(frontier.to_dict())) / 1e6
        compact = len(pickle.dumps(frontier.to_compact())) / 1e6
        per_rank = max(len(pickle.dumps(frontier.to_compact(stages=[s]))) for s in range(args.stages)) / 1e6
        print(
            f"{f'{args.stages}x{m}':>8} {len(frontier.plans):>6} {json_mb:>8.2f} {write_s:>8.3f} "
            f"{whole:>14.2f} {compact:>10.3f} {per_rank:>11.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
