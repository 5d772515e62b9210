"""What perseus-ext saves under each pipeline schedule, and what is left once bubbles are gone.

GPT-3 175B on A100 SXM (the shipped profile `gpt3-175b-a100_sxm`, 8 stages), TP 8 x PP 8,
global batch 1536, the paper's scaling (stage time x 10), wait-aware planning, for 1F1B,
megatron-core's interleaved 1F1B (2 chunks per stage), torch's ScheduleZBVZeroBubble and
ScheduleDualPipeV (their own orders, built offline by `perseus-ext emulate --schedule zb-v` /
`dualpipev`; the input/weight-gradient split derived from the profile's backward, 0.5 / 0.5):

    python benchmarks/emulator_schedules.py [--microbatches 12 24 48] [--combined]

Per (schedule, microbatches): the all-max-clock iteration time T, the bubble's share of the
max-clock energy, the intrinsic saving (fastest plan), the total saving at T'/T = 1.1 and 1.2,
the intrinsic saving on a *balanced* copy of the profile (every stage given the mean of the
stages' rows, clock by clock), which separates what stage imbalance leaves to save from what the
schedule's own slack (bubbles, deferrable weight gradients) leaves, and the part of that saving
made on weight-gradient computations. `--combined` prints the
interleaved vs combined_1f1b table (T'/T 1.0, 1.1, 1.2) instead. Every figure is the emulator's,
i.e. the planner code `perseus-ext emulate` runs; the per-row commands are printed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from perseus_ext.adapters.torch_pipelining_orders import torch_schedule
from perseus_ext.commands.arguments import bounded_float, bounded_int, resolve_profile
from perseus_ext.emulator import Emulator, JobLayout
from perseus_ext.emulator.core import MAX_CLOCK
from perseus_ext.planning.profile import OperatingPoints, Profile, load_profile
from perseus_ext.planning.schedule import Kind

PROFILE = "gpt3-175b-a100_sxm"
BLOCKING_W = 83.64  # --blocking-power a100
GLOBAL_BATCH, TP, PP, SCALE = 1536, 8, 8, 10
FACTORS = [1.0, 1.1, 1.2]
SCHEDULES = {  # label -> (--schedule, chunks per stage)
    "1F1B": ("1f1b", 1),
    "interleaved": ("interleaved", 2),
    "ZB-V": ("zb-v", 2),
    "DualPipeV": ("dualpipev", 2),
}
KINDS = {"1f1b": "1f1b", "interleaved": "interleaved", "combined_1f1b": "combined_1f1b", "zb-v": "zbv",
         "dualpipev": "dualpipev"}


def balanced(profile: Profile) -> Profile:
    """Every stage with the stages' mean time and energy per (instruction, clock): the same total
    work, no stage imbalance."""
    kinds = sorted({kind for _, kind in profile.points})
    points = {}
    for kind in kinds:
        rows = [profile.points[stage, kind] for stage in range(profile.num_stages)]
        clocks = rows[0].frequencies
        assert all(r.frequencies.tolist() == clocks.tolist() for r in rows), "stages profiled at other clocks"
        mean = OperatingPoints(clocks, np.mean([r.times for r in rows], axis=0),
                               np.mean([r.energies for r in rows], axis=0))
        for stage in range(profile.num_stages):
            points[stage, kind] = mean
    return Profile(points, f"{profile.source} (balanced)", [])


def emulator(profile: Profile, schedule: str, chunks: int, microbatches: int, **options) -> Emulator:
    kind = KINDS[schedule]
    actions = torch_schedule(kind, PP, microbatches) if schedule in ("zb-v", "dualpipev") else None
    layout = JobLayout(TP, PP, GLOBAL_BATCH, microbatches, schedule=kind, chunks=chunks, actions=actions)
    return Emulator(profile, layout, BLOCKING_W, time_scale=SCALE, **options)


def weight_gradient_share(em: Emulator) -> str:
    """The part of the fastest plan's saving (points of the max-clock energy of one pipeline)
    made on weight-gradient computations: what slowing deferrable W work saves."""
    model = em.model
    nodes = np.arange(model.num_nodes)
    fastest, top = model.choice_of(em.policy.select(em.frontier, None)), model.choice_of(em.max_clock_plan)
    saved = model.energies[nodes, top] - model.energies[nodes, fastest]
    on_w = np.array([c.kind is Kind.WEIGHT_GRADIENT for c in model.dag.computations])
    if not on_w.any():
        return "-"
    return f"{100 * saved[on_w].sum() / em.max_clock_plan.energy:.1f} pt"


def command(schedule: str, chunks: int, microbatches: list[int], extra: str = "") -> str:
    chunk_flag = f" --chunks {chunks}" if schedule in ("interleaved", "combined_1f1b") else ""
    return (f"perseus-ext emulate --profile {PROFILE} --tp {TP} --pp {PP} --global-batch {GLOBAL_BATCH} "
            f"--microbatches {' '.join(map(str, microbatches))} --schedule {schedule}{chunk_flag}{extra} "
            f"--blocking-power a100 --scale {SCALE} --sweep {' '.join(f'{f:g}' for f in FACTORS)} --markdown")


def schedules_table(profile: Profile, sizes: list[int]) -> None:
    even = balanced(profile)
    print("| schedule | microbatches | iteration time T (s) | bubble share at max clock | intrinsic saving "
          "| saving at T'/T 1.1 | saving at T'/T 1.2 | intrinsic, balanced stages | of which on W |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    commands = []
    for label, (schedule, chunks) in SCHEDULES.items():
        runnable = []
        for m in sizes:
            start = time.perf_counter()
            try:
                em = emulator(profile, schedule, chunks, m)
            except Exception as err:  # a size the torch class refuses: say so in the row
                print(f"| {label} | {m} | - | - | - | - | - | - | - |  <!-- {err} -->")
                continue
            runnable.append(m)
            sweep = em.sweep(FACTORS)
            base = sweep[0].outcomes[MAX_CLOCK].iteration
            flat_emulator = emulator(even, schedule, chunks, m)
            flat = flat_emulator.run(sweep[0].scenario)
            print(f"| {label} | {m} | {em.reference_time:.2f} | {100 * base.bubble / base.total:.1f}% "
                  f"| {100 * sweep[0].intrinsic_saving:.1f}% | {100 * sweep[1].total_saving:.1f}% "
                  f"| {100 * sweep[2].total_saving:.1f}% | {100 * flat.intrinsic_saving:.1f}% "
                  f"| {weight_gradient_share(flat_emulator)} |  <!-- {time.perf_counter() - start:.1f} s -->")
        if runnable:
            commands.append(command(schedule, chunks, runnable))
    print()
    print("\n".join(commands))


def combined_table(profile: Profile, sizes: list[int], overlap_share: float) -> None:
    from perseus_ext.planning.derived import DerivationRule

    print("| schedule | microbatches | iteration time T (s) | saving at T'/T 1.0 | 1.1 | 1.2 |")
    print("|---|---:|---:|---:|---:|---:|")
    for schedule in ("interleaved", "combined_1f1b"):
        for m in sizes:
            em = emulator(profile, schedule, 2, m, derivation=DerivationRule(overlap_share=overlap_share))
            sweep = em.sweep(FACTORS)
            print(f"| {schedule} | {m} | {em.reference_time:.2f} | "
                  + " | ".join(f"{100 * e.total_saving:.1f}%" for e in sweep) + " |")
    print()
    extra = f" --overlap-share {overlap_share:g}" if overlap_share else ""
    print(command("interleaved", 2, sizes))
    print(command("combined_1f1b", 2, sizes, extra))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--microbatches", type=bounded_int(1, 1024), nargs="+", default=[12, 24, 48],
                        help="microbatches per iteration, one table row each (default: %(default)s)")
    parser.add_argument("--combined", action="store_true",
                        help="interleaved vs combined_1f1b at T'/T 1.0, 1.1, 1.2 instead")
    parser.add_argument("--overlap-share", type=bounded_float(0.0, 1.0), default=0.0,
                        help="with --combined: the combined unit's overlap share (planning.derived)")
    args = parser.parse_args()
    profile = load_profile(resolve_profile(PROFILE))
    if args.combined:
        combined_table(profile, args.microbatches, args.overlap_share)
    else:
        schedules_table(profile, args.microbatches)


if __name__ == "__main__":
    main()
