"""What the solver's LP walk costs per anchor: HiGHS's fixed work per warm-started solve against
its simplex iterations, at 1x, 2x, 4x and 8x the default anchor spacing (`relaxation.py`).

    python benchmarks/lp_walk.py [--microbatches 24]

Each row walks the convex relaxation from T_min to the relaxed minimum-energy deadline, one
warm-started `run()` per anchor, and times `run()` alone. A fit of time = fixed x solves +
per-iteration x iterations over the rows says which of the two a shorter walk must cut.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.relaxation import ConvexRelaxation
from perseus_ext.planning.schedule import one_f_one_b
from perseus_ext.planning.solver import planning_model

DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / "examples/profiles/gpt3-175b-a100_sxm.csv"
DEFAULT_ANCHORS = 256


def walk(model: CostModel, spacing_s: float, t_min: float, t_end: float) -> tuple[int, int, float]:
    """(solves, simplex iterations, seconds in run()) of one walk from T_min to t_end."""
    relaxation = ConvexRelaxation(model)
    relaxation.durations(t_min)  # the cold start, not counted
    highs = relaxation.highs
    solves = iterations = 0
    seconds = 0.0
    deadline = t_min
    while deadline < t_end:
        deadline += spacing_s
        highs.changeColBounds(relaxation.t_col, deadline, deadline)
        started = time.perf_counter()
        highs.run()
        seconds += time.perf_counter() - started
        iterations += highs.getInfo().simplex_iteration_count
        solves += 1
    return solves, iterations, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE))
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=24)
    parser.add_argument("--blocking-power", type=float, default=83.64)
    args = parser.parse_args()
    model = planning_model(one_f_one_b(args.stages, args.microbatches), load_profile(args.profile), args.blocking_power)
    t_min = float(model.dag.makespan(model.times[:, 0]))
    slowest = model.times[np.arange(model.num_nodes), model.num_options - 1]
    t_slowest = float(model.dag.makespan(slowest))
    # the walk's end: the relaxed minimum-energy deadline (T free, priced at the blocking power)
    relaxation = ConvexRelaxation(model)
    highs = relaxation.highs
    highs.changeColCost(relaxation.t_col, model.blocking_power * model.num_stage_gpus)
    highs.changeColBounds(relaxation.t_col, t_min, t_slowest)
    highs.run()
    t_end = float(highs.getSolution().col_value[relaxation.t_col])
    print(f"{args.stages} x {args.microbatches}: {model.num_nodes} computations, walk {t_min:.4f} -> {t_end:.4f} s")
    print(f"{'spacing':>8} {'solves':>7} {'iterations':>11} {'run() ms':>9} {'ms/solve':>9}")
    rows = []
    for factor in (1, 2, 4, 8):
        solves, iterations, seconds = walk(model, factor * (t_slowest - t_min) / (DEFAULT_ANCHORS - 1), t_min, t_end)
        rows.append((solves, iterations, seconds))
        print(f"{factor:>7}x {solves:>7} {iterations:>11} {1000 * seconds:>9.1f} {1000 * seconds / solves:>9.3f}")
    (fixed_s, per_iteration_s), *_ = np.linalg.lstsq(np.array([[s, i] for s, i, _ in rows], dtype=float),
                                                    np.array([t for _, _, t in rows]), rcond=None)
    print(f"fit: {1000 * fixed_s:.3f} ms fixed per solve + {1e6 * per_iteration_s:.1f} us per simplex iteration")


if __name__ == "__main__":
    main()
