"""Frontier solver benchmark: perseus-ext vs the public reference (`lowtime`), side by side.

For each microbatch count, both solvers compute the frontier of the same profile, each as a
whole process timed from the outside (interpreter start-up, imports and writing the plans
included): perseus-ext is the `perseus-ext frontier --out F.json` command, lowtime a fresh
interpreter that imports it, builds its DAG, runs its solver and writes its plans. Every plan of
both is replayed on the *raw* (unfiltered) profile with the same energy model, and the table
reports points, wall and CPU time, the wall-time ratio, peak memory, and the energy gap: at
every lowtime point (T_L, E_L), perseus-ext's best plan with time <= T_L minus E_L (negative =
we are better).

    python benchmarks/solver.py --microbatches 12 24 48 96 [--lowtime-limit 3600] [--repeats 5] \
        [--lowtime-repeats 1]

Both start the same way: `python -S` with the same path (this checkout, then the environment's
site-packages), so no `.pth` start-up hook runs in either (an editable install's import finder
alone costs ~8 ms per process; a wheel install has none), and with bytecode cached as an
installed package runs (the environment's PYTHONDONTWRITEBYTECODE is dropped, and one untimed
run of ours writes the cache an editable install lacks; pip compiles it at install time). perseus-ext runs `--repeats` times in blocks,
with one of lowtime's `--lowtime-repeats` runs between each two blocks; the table shows the
median of each side's wall times and their ratio, and below it every lowtime run against the
median of the runs of ours on either side of it (this machine's load drifts over minutes, so
one lowtime run against runs taken elsewhere in time can be off by 15 %).

lowtime is optional (`pip install lowtime==0.3.0`, extra `reference`); without it, or above
`--lowtime-max-microbatches`, only perseus-ext runs. `--save-reference DIR` keeps lowtime's plans
and time; `--reference DIR` compares a new perseus-ext run against them without re-running
lowtime (lowtime at 96 microbatches takes over 20 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import site
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROFILE = REPO / "examples/profiles/gpt3-175b-a100_sxm.csv"
# Both sides' interpreters: no site start-up, this checkout then the environment's packages.
_PATH = [str(REPO), str(REPO / "benchmarks"), *site.getsitepackages()]
_OURS = "import sys; sys.path[:0] = {path!r}; from perseus_ext.cli import console; console()"
_LOWTIME = "import sys; sys.path[:0] = {path!r}; import solver; solver.lowtime_child(sys.argv[1:])"


def run_perseus(profile_path: str, stages: int, microbatches: int, power: float, out: Path) -> list[str]:
    """The `perseus-ext frontier` command line that writes the frontier to `out`."""
    return [
        sys.executable, "-S", "-c", _OURS.format(path=_PATH), "frontier", "--profile", profile_path,
        "--stages", str(stages), "--microbatches", str(microbatches), "--blocking-power", str(power),
        "--output", str(out),
    ]


def run_lowtime(profile_path: str, stages: int, microbatches: int, power: float, out: Path) -> list[str]:
    """The command line of a fresh interpreter that runs `lowtime_main` and writes to `out`."""
    return [
        sys.executable, "-S", "-c", _LOWTIME.format(path=_PATH), profile_path, str(stages),
        str(microbatches), str(power), str(out),
    ]


def lowtime_child(argv: list[str]) -> None:
    """`run_lowtime`'s process: its arguments are PROFILE STAGES MICROBATCHES POWER OUT."""
    path, stages, microbatches, power, out = argv
    lowtime_main(path, int(stages), int(microbatches), float(power), Path(out))


def lowtime_main(profile_path: str, stages: int, microbatches: int, power: float, out: Path) -> None:
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
        plans.append([[inst.assigned_knob for inst in insts] for insts in per_stage])
    out.write_text(json.dumps({"plans": plans}))


def _run(command: list[str], limit: float) -> tuple[float, float, float] | None:
    """Run one solver as a whole process: (wall s, CPU s, peak MiB) of that process alone;
    None past `limit` seconds or on failure (its stderr is shown)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryFile() as stderr:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
        timer = threading.Timer(limit, proc.kill)
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            stderr.seek(0)
            print(f"{command[:4]}... exit {proc.returncode}", stderr.read().decode(errors="replace")[-2000:],
                  file=sys.stderr)
            return None
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def replay(model, frequencies) -> tuple[np.ndarray, np.ndarray]:
    """Times and energies of plans (per-stage clock lists) replayed on `model`."""
    from perseus_ext.planning.frontier import Plan

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
    # Imported here: the lowtime child imports this module and must not pay for perseus-ext.
    from perseus_ext.planning.energy import CostModel
    from perseus_ext.planning.profile import load_profile
    from perseus_ext.planning.schedule import one_f_one_b

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
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of perseus-ext per size (median)")
    parser.add_argument(
        "--lowtime-repeats", type=int, default=1,
        help="timed runs of lowtime per size, each between two blocks of perseus-ext's runs (median)",
    )
    args = parser.parse_args()
    if args.repeats < args.lowtime_repeats + 1:
        parser.error("--repeats must be at least --lowtime-repeats + 1 (a block of ours around each lowtime run)")
    try:
        import lowtime  # noqa: F401

        have_lowtime = True
    except ImportError:
        have_lowtime = False
        print("lowtime not installed: perseus-ext only (pip install lowtime==0.3.0)")

    raw = load_profile(args.profile)
    header = (
        f"{'M':>4} {'ours pts':>8} {'ours s':>7} {'CPU s':>6} {'MiB':>5} {'lowtime pts':>11} "
        f"{'lowtime s':>9} {'CPU s':>8} {'MiB':>5} {'speedup':>8} {'max dE J':>9} {'mean dE J':>9} {'saving %':>8}"
    )
    print(header)
    print("-" * len(header))
    work = Path(tempfile.mkdtemp(prefix="perseus-solver-bench-"))
    ranges, pairs = [], []
    for m in args.microbatches:
        model = CostModel(one_f_one_b(args.stages, m), raw, args.blocking_power)
        problem = (args.profile, args.stages, m, args.blocking_power)
        ours_file = work / f"ours-{m}.json"
        _run(run_perseus(*problem, ours_file), 600)  # writes the bytecode cache; not timed
        ref = measured = None
        saved = args.reference / f"lowtime-{m}.json" if args.reference else None
        if saved is not None and saved.is_file():
            data = json.loads(saved.read_text())
            ref = (data["seconds"], data.get("cpu_seconds", float("nan")), float("nan"), data["plans"])
        runs_lowtime = have_lowtime and ref is None and m <= args.lowtime_max_microbatches
        # Ours in blocks with a lowtime run between each two: the machine's load drifts over
        # minutes, and each lowtime run is also compared with the runs of ours next to it.
        blocks = np.array_split(np.arange(args.repeats), args.lowtime_repeats + 1 if runs_lowtime else 2)
        ours_blocks, lowtime_runs = [], []
        ref_file = work / f"lowtime-{m}.json"
        for b, block in enumerate(blocks):
            ours_blocks.append([_run(run_perseus(*problem, ours_file), 600) for _ in block])
            if runs_lowtime and b < len(blocks) - 1:
                lowtime_runs.append(_run(run_lowtime(*problem, ref_file), args.lowtime_limit))
        ours_runs = [run for block in ours_blocks for run in block]
        wall, cpu, mem = (float(np.median(column)) for column in zip(*ours_runs))
        if lowtime_runs and None not in lowtime_runs:
            measured = tuple(float(np.median(column)) for column in zip(*lowtime_runs))
            ref = (*measured, json.loads(ref_file.read_text())["plans"])
            local = [
                run[0] / float(np.median([r[0] for r in ours_blocks[i] + ours_blocks[i + 1]]))
                for i, run in enumerate(lowtime_runs)
            ]
            pairs.append(f"{m}: lowtime {', '.join(f'{run[0]:.2f}' for run in lowtime_runs)} s; "
                         f"against the runs of ours around each: {', '.join(f'{r:.0f}x' for r in local)}")
        ranges.append(f"{m}: {', '.join(f'{run[0]:.3f}' for run in sorted(ours_runs))}")
        freqs_ours = [np.array(p["frequencies"]) for p in json.loads(ours_file.read_text())["plans"]]
        ours_te = replay(model, freqs_ours)
        baseline_e = model.replay(model.fastest_choice())[1]
        saving = 100 * (1 - ours_te[1][np.argmin(ours_te[0])] / baseline_e)
        row = f"{m:>4} {len(freqs_ours):>8} {wall:>7.3f} {cpu:>6.2f} {mem:>5.0f} "
        if ref is None:
            row += f"{'-':>11} {'-':>9} {'-':>8} {'-':>5} {'-':>8} {'-':>9} {'-':>9}"
        else:
            t_ref, cpu_ref, mem_ref, plans_ref = ref
            if args.save_reference and measured is not None:
                args.save_reference.mkdir(parents=True, exist_ok=True)
                (args.save_reference / f"lowtime-{m}.json").write_text(
                    json.dumps({"seconds": t_ref, "cpu_seconds": cpu_ref, "plans": plans_ref})
                )
            gmax, gmean, _ = energy_gap(ours_te, replay(model, [np.array(f) for f in plans_ref]))
            row += (
                f"{len(plans_ref):>11} {t_ref:>9.2f} {cpu_ref:>8.2f} {mem_ref:>5.0f} "
                f"{t_ref / wall:>7.0f}x {gmax:>9.2f} {gmean:>9.2f}"
            )
        print(row + f" {saving:>8.2f}", flush=True)
    print(
        "\nours s / lowtime s: wall time of the whole process (start-up, imports, solve, writing the "
        "plans); speedup: their ratio. max/mean dE: our best plan's energy at each lowtime point's "
        "time minus lowtime's (<= 0: ours is no worse). saving %: fastest plan vs all-max-clock at "
        "the same time."
    )
    print(f"ours s: median of {args.repeats} runs; all of them (s): " + "; ".join(ranges))
    if pairs:
        print(f"lowtime s: median of {args.lowtime_repeats} run(s), each between two blocks of ours; "
              + "; ".join(pairs))


if __name__ == "__main__":
    main()
