"""Peak memory of `perseus-ext report` against the length of its logs, beside a reference
checkout (the code before the logs were streamed), one table.

    python benchmarks/report_memory.py --rows 20000 250000 --reference /tmp/old-checkout

Writes two ranks' logs of each length (rows shaped like the runtime's, ~350 bytes each) and runs
`python -m perseus_ext report` on them in a child process per code base, reading the child's
peak RSS from the kernel (wait4). The streamed reader's peak should not grow with the logs; the
reference's grew ~7 x the logs' size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_log(path: Path, rank: int, rows: int) -> None:
    with path.open("w") as handle:
        for i in range(rows):
            probe = i % 20 == 10
            handle.write(json.dumps({
                "timestamp": 1.7e9 + i, "job": "5f3a9c1e2b7d4a60", "iteration": i, "rank": rank, "pipeline": 0,
                "stage": rank, "phase": "deployed" if i >= 10 else "warmup", "setting": "plan 3",
                "plan": None if probe else 3, "profiled_clock_mhz": None, "power_limit_w": None, "factor": 1.0,
                "fell_back": False, "probe": probe, "time_s": 0.512 + (i % 7) * 1e-4, "compute_s": 0.48,
                "energy_j": (780.1 if probe else 612.3) + i % 5, "coverage": 0.97}) + "\n")


def peak_rss_mb(code: Path, logs: list[Path]) -> tuple[float, float, int]:
    """(peak RSS in MB, wall seconds, exit code) of one report run with `code` on the path."""
    env = dict(os.environ, PYTHONPATH=str(code))
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "perseus_ext", "report", *map(str, logs)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    return usage.ru_maxrss / 1024, time.perf_counter() - started, os.waitstatus_to_exitcode(status)


def main() -> None:
    from perseus_ext.commands.arguments import bounded_int  # the CLI's flag types
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--rows", type=bounded_int(1, 10**9), nargs="+", default=[20_000, 250_000], help="iterations per rank's log")
    parser.add_argument("--reference", type=Path, help="a checkout of the code to compare with (its repo root)")
    args = parser.parse_args()
    codes = {"this checkout": REPO, **({"reference": args.reference} if args.reference else {})}
    print(f"{'rows/rank':>10} {'logs MB':>8}  " + "  ".join(f"{name + ' MB':>18} {'s':>6}" for name in codes))
    with tempfile.TemporaryDirectory() as scratch:
        for rows in args.rows:
            logs = [Path(scratch) / f"log-{rows}-{rank}.jsonl" for rank in (0, 1)]
            for rank, log in enumerate(logs):
                write_log(log, rank, rows)
            size = sum(log.stat().st_size for log in logs) / 2 ** 20
            cells = []
            for code in codes.values():
                peak, wall, code_exit = peak_rss_mb(code, logs)
                cells.append(f"{peak:>18.0f} {wall:>6.1f}" + ("" if code_exit == 0 else f" (exit {code_exit})"))
            print(f"{rows:>10,} {size:>8.0f}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
