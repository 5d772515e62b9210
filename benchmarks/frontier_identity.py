"""Frontiers, stage-constant frontiers, merged-switch frontiers and emulator figures of a fixed set
of reference cases, saved to a JSON file or compared against one.

Run it on two checkouts to show that a change to the planner leaves every plan as it was:

    python benchmarks/frontier_identity.py --save before.json        # in the checkout before
    python benchmarks/frontier_identity.py --compare before.json     # in the checkout after

Run it as `python -S` (as `benchmarks/solver.py` runs its children): an editable install's import
finder would otherwise import the installed checkout instead of the one the script lies in.

`--compare` prints one line per case (plan counts, largest relative difference in time and
energy, whether every plan's clocks are equal) and exits 1 if any case differs by more than
`--tolerance` (default 1e-9, relative) or in its plan count.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if sys.flags.no_site:  # `python -S`: this checkout first, then the environment's packages
    sys.path[:0] = [str(REPO)]
    sys.path += [str(p) for p in Path(sys.executable).parents[1].glob("lib/python3*/site-packages")]
else:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402


from perseus_ext.data import shipped_profile  # noqa: E402
from perseus_ext.planning.energy import BLOCKING_POWER_W  # noqa: E402
from perseus_ext.planning.frontier import Frontier  # noqa: E402
from perseus_ext.planning.profile import load_profile  # noqa: E402
from perseus_ext.planning.schedule import build_schedule  # noqa: E402
from perseus_ext.planning.solver import solve_frontier  # noqa: E402
from perseus_ext.planning.stage_constant import solve_stage_constant  # noqa: E402
from perseus_ext.planning.thinning import with_fewer_switches  # noqa: E402

# (name, profile, gpu, schedule, stages, microbatches, chunks, switch latency s, wait-aware)
CASES = [
    ("gpt3-a100-8x4", "gpt3-175b-a100_sxm", "a100", "1f1b", 8, 4, 1, 0.0, False),
    ("gpt3-a100-8x8", "gpt3-175b-a100_sxm", "a100", "1f1b", 8, 8, 1, 0.0, False),
    ("gpt3-a100-8x12", "gpt3-175b-a100_sxm", "a100", "1f1b", 8, 12, 1, 0.0, False),
    ("gpt3-a100-8x24", "gpt3-175b-a100_sxm", "a100", "1f1b", 8, 24, 1, 0.0, False),
    ("bloom-a100-8x8", "bloom-a100_sxm", "a100", "1f1b", 8, 8, 1, 0.0, False),
    ("gpt3-a40-8x8", "gpt3-175b-a40", "a40", "1f1b", 8, 8, 1, 0.0, False),
    ("gpt3-a40-8x96", "gpt3-175b-a40", "a40", "1f1b", 8, 96, 1, 0.0, False),
    ("gpt3-a100-8x24-latency", "gpt3-175b-a100_sxm", "a100", "1f1b", 8, 24, 1, 5e-4, False),
    ("gpt3-a100-8x24-wait-aware", "gpt3-175b-a100_sxm", "a100", "1f1b", 8, 24, 1, 0.0, True),
    ("gpt3-a100-8x16x2-interleaved", "gpt3-175b-a100_sxm", "a100", "interleaved", 8, 16, 2, 0.0, False),
]
STAGE_CONSTANT = [("gpt3-a100-8x12-stage-constant", 8, 12, False), ("gpt3-a100-8x12-stage-constant-wait", 8, 12, True)]


def _frontier_record(frontier: Frontier, seconds: float) -> dict:
    clocks = hashlib.sha256()
    for plan in frontier.plans:
        clocks.update(np.ascontiguousarray(plan.frequencies, dtype=np.int64).tobytes())
    return {
        "plans": len(frontier.plans),
        "times": [p.time for p in frontier.plans],
        "energies": [p.energy for p in frontier.plans],
        "extension_start": frontier.extension_start,
        "clocks_sha256": clocks.hexdigest(),
        "seconds": seconds,
    }


def collect() -> dict:
    import perseus_ext

    print(f"planner from {Path(perseus_ext.__file__).parent}", file=sys.stderr)
    records = {}
    for name, profile_name, gpu, kind, stages, micro, chunks, latency, wait in CASES:
        profile = load_profile(shipped_profile(profile_name))
        schedule = build_schedule(kind, stages, micro, chunks)
        start = time.perf_counter()
        frontier = solve_frontier(schedule, profile, BLOCKING_POWER_W[gpu], switch_latency_s=latency,
                                  wait_aware=wait)
        records[name] = _frontier_record(frontier, time.perf_counter() - start)
        if name == "gpt3-a100-8x24-latency":
            start = time.perf_counter()
            merged = with_fewer_switches(frontier, schedule, profile, BLOCKING_POWER_W[gpu], latency, 5.0)
            records[name + "-merged"] = _frontier_record(merged, time.perf_counter() - start)
        print(f"{name}: {len(frontier.plans)} plans", file=sys.stderr)
    profile = load_profile(shipped_profile("gpt3-175b-a100_sxm"))
    for name, stages, micro, wait in STAGE_CONSTANT:
        schedule = build_schedule("1f1b", stages, micro)
        start = time.perf_counter()
        frontier = solve_stage_constant(schedule, profile, BLOCKING_POWER_W["a100"], wait_aware=wait)
        records[name] = _frontier_record(frontier, time.perf_counter() - start)
    from perseus_ext.emulator import Emulator, JobLayout, StragglerScenario

    layout = JobLayout(tensor_parallel=8, pipeline_parallel=8, global_batch=1536, microbatches=12)
    emulation = Emulator(profile, layout, BLOCKING_POWER_W["a100"], time_scale=10).run(
        StragglerScenario.fixed(1.2))
    records["emulator-gpt3-8x12-1.2"] = {
        "plans": len(emulation.frontier.plans),
        "times": [o.iteration.time for o in emulation.outcomes.values()],
        "energies": [o.iteration.total for o in emulation.outcomes.values()],
        "extension_start": emulation.frontier.extension_start,
        "clocks_sha256": "",
        "seconds": 0.0,
    }
    return records


def _max_rel(a: list[float], b: list[float]) -> float:
    x, y = np.asarray(a, float), np.asarray(b, float)
    return float(np.max(np.abs(x - y) / np.maximum(np.abs(y), 1e-300))) if len(x) else 0.0


def main(argv: list[str] | None = None) -> int:
    from perseus_ext.commands.arguments import bounded_float  # the CLI's flag types
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", type=Path, help="write this checkout's figures here")
    group.add_argument("--compare", type=Path, help="compare this checkout's figures with a saved file")
    parser.add_argument("--tolerance", type=bounded_float(0.0, 1e9), default=1e-9, help="largest relative difference allowed")
    args = parser.parse_args(argv)
    records = collect()
    if args.save:
        args.save.write_text(json.dumps(records, indent=1))
        return 0
    saved = json.loads(args.compare.read_text())
    failed = False
    for name, old in saved.items():
        new = records.get(name)
        if new is None:
            print(f"{name}: missing in this checkout")
            failed = True
            continue
        same_count = new["plans"] == old["plans"] and len(new["times"]) == len(old["times"])
        dt = _max_rel(new["times"], old["times"]) if same_count else float("inf")
        de = _max_rel(new["energies"], old["energies"]) if same_count else float("inf")
        clocks = new["clocks_sha256"] == old["clocks_sha256"]
        ok = same_count and dt <= args.tolerance and de <= args.tolerance
        failed |= not ok
        print(f"{name}: plans {old['plans']} -> {new['plans']}, max rel dtime {dt:.2e}, "
              f"max rel denergy {de:.2e}, clocks {'equal' if clocks else 'DIFFER'}, "
              f"solve {old['seconds']:.2f} -> {new['seconds']:.2f} s {'ok' if ok else 'DIFFERS'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
