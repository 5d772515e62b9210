"""Frontier solver benchmark: perseus-ext vs the public reference (`lowtime`), side by side.

For each microbatch count, both solvers compute the frontier of the same profile; every plan of
both is replayed on the *raw* (unfiltered) profile with the same energy model, and the table
reports points, wall time, the speed ratio, peak memory, and the energy gap: at every lowtime
point (T_L, E_L), perseus-ext's best plan with time <= T_L minus E_L (negative = we are better).

    python benchmarks/solver.py --microbatches 12 24 48 96 [--lowtime-limit 3600]

lowtime is optional (`pip install lowtime==0.3.0`, extra `reference`); without it, or above
`--lowtime-max-microbatches`, only perseus-ext runs. `--save-reference DIR` keeps lowtime's plans
and time; `--reference DIR` compares a new perseus-ext run against them without re-running
lowtime (lowtime at 96 microbatches takes over 20 minutes).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import time
from pathlib import Path

import numpy as np

from perseus_ext.planning.energy import CostModel
from perseus_ext.planning.frontier import Plan
from perseus_ext.planning.profile import load_profile
from perseus_ext.planning.schedule import one_f_one_b
from perseus_ext.planning.solver import solve_frontier

DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / "examples/profiles/gpt3-175b-a100_sxm.csv"


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_perseus(profile_path: str, stages: int, microbatches: int, power: float, queue) -> None:
    start = time.perf_counter()
    frontier = solve_frontier(one_f_one_b(stages, microbatches), load_profile(profile_path), power)
    elapsed = time.perf_counter() - start
    queue.put((elapsed, [p.frequencies for p in frontier.plans], _peak_rss_mib()))


def run_lowtime(profile_path: str, stages: int, microbatches: int, power: float, queue) -> None:
    """Drive lowtime's Phillips–Dessouky solver the way its Perseus example does (1 ms units)."""
    import csv

    import networkx as nx
    from lowtime.cost_model import ExponentialModel
    from lowtime.graph_utils import add_sink_node, add_source_node
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec
    from lowtime.perseus.instruction import Backward, Forward
    from lowtime.perseus.schedule import Synchronous1F1B
    from lowtime.solver import PhillipsDessouky

    rows = list(csv.DictReader(open(profile_path)))
    start = time.perf_counter()
    specs: dict[int, dict[type, OperationSpec]] = {s: {} for s in range(stages)}
    for stage in range(stages):
        for cls in (Forward, Backward):
            options = [
                ExecutionOption[int](
                    real_time=float(r["time"]), unit_time=1e-3, cost=float(r["energy"]),
                    knob=int(r["frequency"]),
                )
                for r in rows
                if int(r["stage"]) == stage and r["instruction"] == cls.__name__.lower()
            ]
            candidates = CandidateExecutionOptions[int](options=options)
            for option in candidates.options:  # effective energy, as in the Perseus example
                option.cost -= power * option.quant_time * option.unit_time
            specs[stage][cls] = OperationSpec[int](
                options=candidates, cost_model=ExponentialModel(candidates)
            )

    dag = nx.DiGraph()
    per_stage: list[list] = []
    node = 2
    by_key = {}
    for stage in range(stages):
        insts = list(Synchronous1F1B(stages, microbatches, stage, specs[stage]))
        ids = []
        for inst in insts:
            dag.add_node(node, op=inst)
            by_key[(type(inst), inst.stage_id, inst.micro_batch_id)] = node
            ids.append(node)
            node += 1
        dag.add_edges_from(zip(ids, ids[1:]))
        per_stage.append(insts)
    for (cls, stage, mb), n in by_key.items():
        if cls is Forward and (Forward, stage + 1, mb) in by_key:
            dag.add_edge(n, by_key[(Forward, stage + 1, mb)])
        if cls is Backward and (Backward, stage - 1, mb) in by_key:
            dag.add_edge(n, by_key[(Backward, stage - 1, mb)])
        if cls is Forward and stage == stages - 1:
            dag.add_edge(n, by_key[(Backward, stage, mb)])
    add_source_node(dag, 0)
    add_sink_node(dag, 1)
    dag.graph["source_node"] = 0
    dag.graph["sink_node"] = 1

    plans = []
    for _ in PhillipsDessouky(dag).run():
        plans.append(tuple(tuple(inst.assigned_knob for inst in insts) for insts in per_stage))
    queue.put((time.perf_counter() - start, plans, _peak_rss_mib()))


def _run(target, args, limit: float):
    """Run one solver in a fresh process (fair memory figures, hard time limit)."""
    queue = mp.get_context("fork").Queue()
    proc = mp.get_context("fork").Process(target=target, args=(*args, queue))
    proc.start()
    try:
        result = queue.get(timeout=limit)
    except Exception:
        proc.kill()
        return None
    proc.join()
    return result


def replay(model: CostModel, frequencies) -> tuple[np.ndarray, np.ndarray]:
    choices = np.stack([model.choice_of(Plan(0.0, 0.0, f)) for f in frequencies], axis=1)
    return model.replay(choices)


def energy_gap(ours: tuple[np.ndarray, np.ndarray], ref: tuple[np.ndarray, np.ndarray]):
    """Max and mean (ours - ref) energy at the reference's points that we also cover."""
    t_ours, e_ours = ours
    order = np.argsort(t_ours)
    best = np.minimum.accumulate(e_ours[order])
    gaps = []
    for t, e in zip(*ref):
        k = np.searchsorted(t_ours[order], t + 1e-9, side="right")
        if k:
            gaps.append(best[k - 1] - e)
    gaps = np.array(gaps)
    return gaps.max(), gaps.mean(), len(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE))
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[12, 24, 48, 96])
    parser.add_argument("--blocking-power", type=float, default=83.64)
    parser.add_argument("--lowtime-max-microbatches", type=int, default=96)
    parser.add_argument("--lowtime-limit", type=float, default=3600.0, help="seconds per lowtime run")
    parser.add_argument(
        "--reference", type=Path,
        help="directory of a saved lowtime run (--save-reference): compare against it instead of re-running lowtime",
    )
    parser.add_argument(
        "--save-reference", type=Path,
        help="directory to write lowtime's plans to (lowtime-<M>.json), to compare later runs without re-solving",
    )
    args = parser.parse_args()
    try:
        import lowtime  # noqa: F401

        have_lowtime = True
    except ImportError:
        have_lowtime = False
        print("lowtime not installed: perseus-ext only (pip install lowtime==0.3.0)")

    raw = load_profile(args.profile, pareto=False)
    header = (
        f"{'M':>4} {'ours pts':>8} {'ours s':>8} {'ours MiB':>8} {'lowtime pts':>11} {'lowtime s':>10} "
        f"{'speedup':>8} {'max dE J':>9} {'mean dE J':>9} {'saving %':>8}"
    )
    print(header)
    print("-" * len(header))
    for m in args.microbatches:
        model = CostModel(one_f_one_b(args.stages, m), raw, args.blocking_power)
        ours = _run(run_perseus, (args.profile, args.stages, m, args.blocking_power), 600)
        t_ours, freqs_ours, mem_ours = ours
        ours_te = replay(model, freqs_ours)
        baseline_e = model.replay(model.fastest_choice())[1]
        saving = 100 * (1 - ours_te[1][np.argmin(ours_te[0])] / baseline_e)
        row = f"{m:>4} {len(freqs_ours):>8} {t_ours:>8.2f} {mem_ours:>8.0f} "
        ref = None
        saved = args.reference / f"lowtime-{m}.json" if args.reference else None
        if saved is not None and saved.is_file():
            data = json.loads(saved.read_text())
            ref = (data["seconds"], [np.array(f) for f in data["plans"]], None)
        elif have_lowtime and m <= args.lowtime_max_microbatches:
            ref = _run(run_lowtime, (args.profile, args.stages, m, args.blocking_power), args.lowtime_limit)
        if ref is None:
            row += f"{'-':>11} {'-':>10} {'-':>8} {'-':>9} {'-':>9}"
        else:
            t_ref, freqs_ref, _ = ref
            if args.save_reference:
                args.save_reference.mkdir(parents=True, exist_ok=True)
                (args.save_reference / f"lowtime-{m}.json").write_text(
                    json.dumps({"seconds": t_ref, "plans": [[list(row) for row in f] for f in freqs_ref]})
                )
            gmax, gmean, _ = energy_gap(ours_te, replay(model, freqs_ref))
            row += f"{len(freqs_ref):>11} {t_ref:>10.2f} {t_ref / t_ours:>7.0f}x {gmax:>9.2f} {gmean:>9.2f}"
        print(row + f" {saving:>8.2f}", flush=True)
    print(
        "\nmax/mean dE: our best plan's energy at each lowtime point's time minus lowtime's "
        "(<= 0: ours is no worse). saving %: fastest plan vs all-max-clock at the same time."
    )


if __name__ == "__main__":
    main()
