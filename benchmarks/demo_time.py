"""`perseus-ext demo`'s wall time against a reference commit's, side by side.

    python benchmarks/demo_time.py [--reference COMMIT] [--runs N]

Both demos run at the same time, each as a whole process (`python -m perseus_ext demo`) from its
own checkout (the reference in a temporary `git worktree`), so a noisy shared machine slows both
alike; the table gives each wall time, their ratio and the load average around the run. The
target is 60 s on an idle 2-core machine; on a loaded one read the ratio against the reference's
idle time (README says how the demo's figure was taken).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _start(checkout: Path, out: Path) -> tuple[subprocess.Popen, float]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    log = open(out.with_suffix(".out"), "w")
    started = time.perf_counter()
    command = [sys.executable, "-m", "perseus_ext", "demo", "--out", str(out)]  # older commits take --out only
    process = subprocess.Popen(command, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
    return process, started


def main() -> int:
    from perseus_ext.commands.arguments import bounded_int  # the CLI's flag types
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--reference", default="8ca3278",
                        help="commit whose demo is the reference (default: %(default)s, the last 64-iteration demo)")
    parser.add_argument("--runs", type=bounded_int(1, 10**9), default=1, help="side-by-side pairs (default: %(default)s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="demo-time-") as scratch:
        reference = Path(scratch) / "reference"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(reference), args.reference],
                       check=True, capture_output=True)
        try:
            print(f"{'run':>4} {'this checkout':>14} {'reference':>10} {'ratio':>6}  load average before -> after")
            for run in range(args.runs):
                load_before = os.getloadavg()[0]
                jobs = {name: _start(checkout, Path(scratch) / f"{name}-{run}")
                        for name, checkout in (("this", REPO), ("reference", reference))}
                seconds: dict[str, float] = {}
                while len(seconds) < len(jobs):  # each timed when it ends, whichever ends first
                    for name, (process, started) in jobs.items():
                        if name not in seconds and process.poll() is not None:
                            if process.returncode != 0:
                                print(f"{name} demo failed; see {Path(scratch) / f'{name}-{run}.out'}",
                                      file=sys.stderr)
                                return 1
                            seconds[name] = time.perf_counter() - started
                    time.sleep(0.05)
                print(f"{run:>4} {seconds['this']:>12.1f} s {seconds['reference']:>8.1f} s "
                      f"{seconds['this'] / seconds['reference']:>6.2f}  {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(reference)],
                           capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
