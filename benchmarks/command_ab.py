"""A perseus-ext command from two source trees, side by side: alternating whole-process runs,
median wall and CPU time of each (the shared machine's load drifts; only ratios from one run
mean anything).

    git worktree add /tmp/before <commit>
    python benchmarks/command_ab.py --runs 10 /tmp/before . -- \\
        frontier -q --profile gpt3-175b-a100_sxm --microbatches 24 --out /tmp/f.json

Each run is `python -S` with the tree, then this interpreter's site-packages, first on the path
(an editable install would otherwise import this checkout's package for both), with bytecode
caching on, after one untimed run per tree that writes the cache.
"""

from __future__ import annotations

import argparse
import os
import resource
import site
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The executable's entry point: `console` where the tree has one, `main` before it.
RUNNER = (
    "import sys; sys.path[:0] = [{tree!r}, *{site!r}]; from perseus_ext import cli; "
    "import perseus_ext; assert perseus_ext.__file__.startswith({tree!r}), perseus_ext.__file__; "
    "cli.console() if hasattr(cli, 'console') else sys.exit(cli.main(sys.argv[1:]))"
)


def run(tree: str, args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall s, CPU s) of one whole `perseus-ext ARGS` process from `tree`."""
    code = RUNNER.format(tree=tree, site=site.getsitepackages())
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-S", "-c", code, *args], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> None:
    from perseus_ext.commands.arguments import bounded_int  # the CLI's flag types
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--runs", type=bounded_int(1, 10**9), default=10)
    parser.add_argument("trees", nargs=2, help="two source trees (checkouts) of perseus-ext")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the perseus-ext arguments")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    trees = [str(Path(tree).resolve()) for tree in args.trees]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for tree in trees:
        run(tree, command, env)  # writes the bytecode cache
    times: dict[str, list[tuple[float, float]]] = {tree: [] for tree in trees}
    for _ in range(args.runs):
        for tree in trees:
            times[tree].append(run(tree, command, env))
    for tree in trees:
        walls = sorted(wall for wall, _ in times[tree])
        cpu = statistics.median(c for _, c in times[tree])
        print(f"{tree}: median {statistics.median(walls):.3f} s wall (min {walls[0]:.3f}, "
              f"max {walls[-1]:.3f}), median {cpu:.3f} s CPU")
    first, second = (statistics.median(w for w, _ in times[tree]) for tree in trees)
    print(f"second / first: {second / first:.3f}")


if __name__ == "__main__":
    main()
