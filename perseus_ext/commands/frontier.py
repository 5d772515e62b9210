"""`perseus-ext frontier`: compute a pipeline's iteration time–energy frontier from a profile."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from perseus_ext.commands.arguments import (
    add_blocking_power_argument,
    add_output_argument,
    add_profile_argument,
    blocking_power_w,
    bounded_float,
    bounded_int,
    check_pipeline_size,
    check_plotting,
    check_writable_file,
    resolve_profile,
)

MAX_STAGES = 256
MAX_MICROBATCHES = 4096
MAX_VIRTUAL_STAGES = 64
MIN_RESOLUTION_S, MAX_RESOLUTION_S = 1e-4, 60.0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "frontier",
        help="compute the iteration time-energy frontier of a pipeline from a profile",
        description="Compute every Pareto-optimal (iteration time, energy) plan of a pipeline, "
        "from all-max-clock speed to the minimum-energy plan, and write it as JSON.",
    )
    add_profile_argument(parser)
    parser.add_argument("--stages", type=bounded_int(1, MAX_STAGES),
                        help="pipeline stages (default: the profile's)")
    parser.add_argument("--microbatches", type=bounded_int(1, MAX_MICROBATCHES), required=True,
                        help="microbatches per iteration")
    add_blocking_power_argument(parser)
    parser.add_argument("--schedule", choices=["1f1b", "interleaved"], default="1f1b",
                        help="pipeline schedule (default: %(default)s)")
    parser.add_argument("--virtual-stages", type=bounded_int(1, MAX_VIRTUAL_STAGES), default=1,
                        help="model chunks per stage (interleaved schedule; default: %(default)s)")
    parser.add_argument("--resolution", type=bounded_float(MIN_RESOLUTION_S, MAX_RESOLUTION_S),
                        default=1e-3, help="max time step between plans in seconds (default: %(default)s)")
    parser.add_argument("--switch-latency", type=bounded_float(0.0, 10.0), default=0.0,
                        help="effective clock-change latency in seconds: plans pay for it and avoid changes "
                             "not worth it (default: %(default)s)")
    parser.add_argument("--wait-aware", action="store_true",
                        help="also the plans for an iteration held to a longer time anyway (a straggler): "
                             "cheapest in energy - blocking power x stages x time, up to the all-slowest plan")
    parser.add_argument("--power-swing-cap", type=bounded_float(0.0, 1.0, inclusive_min=False), metavar="FRACTION",
                        help="only plans whose pipeline power swing (peak to trough, docs/power.md) is at most "
                             "this fraction of the all-max-clock plan's; dummy work that lifts the trough is "
                             "counted in their energy")
    add_output_argument(parser, help="write the frontier JSON here", old=("--out",))
    parser.add_argument("--plot", type=Path, help="write a frontier plot here (.png, .svg or .pdf)")
    parser.set_defaults(func=run, exit_at_once=True)


def check_outputs(args: argparse.Namespace) -> None:
    """Fail before the solve if an output cannot be written."""
    if args.output:
        check_writable_file(args.output, "--output")
    if args.plot:
        check_plotting(args.plot, "--plot")
        check_writable_file(args.plot, "--plot")


def run(args: argparse.Namespace) -> int:
    # The solver's numpy work is elementwise: OpenBLAS's thread pool would only add ~60 ms of
    # CPU to the command's start-up (a user's own setting is kept).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from perseus_ext.planning.power_swing import frontier_swing
    from perseus_ext.planning.profile import load_profile, useful_indices
    from perseus_ext.planning.schedule import build_schedule
    from perseus_ext.planning.solver import SolverOptions, solve_frontier

    path = resolve_profile(args.profile)
    profile = load_profile(path)
    power = blocking_power_w(args.blocking_power, path)
    stages = args.stages if args.stages is not None else profile.num_stages
    check_pipeline_size(stages, args.microbatches, args.virtual_stages)
    schedule = build_schedule(args.schedule, stages, args.microbatches, args.virtual_stages)
    check_outputs(args)
    started = time.perf_counter()
    options = SolverOptions(resolution=args.resolution, progress=sys.stderr.isatty())
    frontier = solve_frontier(schedule, profile, power, options,
                              switch_latency_s=args.switch_latency, wait_aware=args.wait_aware)
    uncapped, capped = frontier, None
    if args.power_swing_cap is not None:
        from perseus_ext.planning.swing_cap import capped_frontier

        capped = capped_frontier(uncapped, schedule, profile, args.power_swing_cap, args.switch_latency,
                                 clock_budget=options.clock_budget)
        frontier = capped.frontier
    elapsed = time.perf_counter() - started
    swing = frontier_swing(uncapped, schedule, profile, args.switch_latency)
    plan_swings = swing.plans if capped is None else tuple(p.swing for p in capped.plans)
    if args.output:
        save_with_swing(frontier, swing.reference, plan_swings, args.output,
                        capped.cap_fraction if capped else None,
                        [p.filler.energy_j for p in capped.plans] if capped else None)
    if args.plot:
        from perseus_ext.observability.plotting import plot_frontier

        plot_frontier(uncapped, args.plot, swing_fractions=swing.fractions(),
                      capped=capped.frontier if capped else None,
                      capped_label=f"swing-capped at {args.power_swing_cap:g} of all-max" if capped else None)

    fast, cheapest, base = frontier.fastest, frontier.min_energy, frontier.baseline
    print(f"profile        {path.name} ({profile.num_stages} stages), blocking power {power:g} W")
    measured = sum(len(op) for op in profile.points.values())
    useful = sum(len(useful_indices(op.times, op.energies, power)) for op in profile.points.values())
    print(f"useful clocks  {useful} of {measured} measured (dropped: another clock of the same "
          f"computation no slower and no costlier in energy - {power:g} W x time)")
    print(f"schedule       {schedule.kind.value}, {stages} stages x {args.microbatches} microbatches"
          + (f" x {args.virtual_stages} virtual stages" if args.virtual_stages > 1 else ""))
    ordinary = len(frontier.ordinary_plans)
    print(f"solved in      {elapsed:.2f} s: {ordinary} plans"
          + (f" + {len(frontier.plans) - ordinary} wait-aware" if ordinary < len(frontier.plans) else ""))
    print(f"all max clock  T = {base.time:.4f} s, energy {base.energy:,.1f} J")
    print(f"T_min          T = {fast.time:.4f} s, energy {fast.energy:,.1f} J "
          f"(intrinsic saving {frontier.intrinsic_saving():.2%} at no slowdown)")
    print(f"T* (min energy) T = {cheapest.time:.4f} s, energy {cheapest.energy:,.1f} J "
          f"({1 - cheapest.energy / base.energy:.2%} less, {cheapest.time / base.time - 1:+.2%} time)")
    print_swing(swing, uncapped, frontier.baseline.time, capped)
    if args.output:
        print(f"wrote          {args.output}")
    if args.plot:
        print(f"plotted        {args.plot}")
    sys.stdout.flush()
    return 0


def print_swing(swing, uncapped, all_max_time_s: float, capped) -> None:
    """The pipeline swing (planning model, docs/power.md) of all-max clocks, the fastest plan,
    the cheapest plan within 1.05 x T and, with a cap, the capped plan there."""
    reference = swing.reference
    print(f"swing all-max  {reference.peak_to_trough_w:,.0f} W peak to trough ({reference.peak_to_trough_fraction:.0%} "
          f"of mean), ramp {reference.max_ramp_w_per_s:,.0f} W/s, 0.1-20 Hz {reference.band_energy_fraction:.0%} of variance")
    index = {id(plan): k for k, plan in enumerate(uncapped.plans)}
    rows = [("fastest", swing.plans[0], uncapped.fastest.energy)]
    at = uncapped.plan_for_deadline(1.05 * all_max_time_s)
    rows.append(("at 1.05 x T", swing.plans[index[id(at)]], at.energy))
    if capped is not None:
        plan = capped.frontier.plan_for_deadline(1.05 * all_max_time_s)
        k = capped.frontier.plans.index(plan)
        rows.append((f"capped {capped.cap_fraction:g}", capped.plans[k].swing, plan.energy))
        print(f"swing cap      {capped.cap_fraction:g} x {reference.peak_to_trough_w:,.0f} W = {capped.cap_w:,.0f} W: "
              f"{len(capped.plans)} plans; dummy work at 1.05 x T {capped.plans[k].filler.energy_j:,.1f} J "
              f"(counted), {plan.energy / at.energy - 1:+.2%} energy over the uncapped plan")
        if not capped.meets_cap:
            least = capped.plans[0].swing.peak_to_trough_w
            print(f"swing cap      NOT met: no plan within the filler's power reaches it; the plan of least swing "
                  f"found swings {least:,.0f} W ({least / reference.peak_to_trough_w:.2f} of all-max)")
    for name, figures, energy in rows:
        print(f"swing {name:<12} {figures.peak_to_trough_w / reference.peak_to_trough_w - 1:+.0%} peak to trough, "
              f"{figures.max_ramp_w_per_s / reference.max_ramp_w_per_s - 1:+.0%} ramp vs all-max "
              f"({figures.peak_to_trough_w:,.0f} W; {energy:,.1f} J)")


def save_with_swing(frontier, reference, plan_swings, path: Path, cap_fraction: float | None,
                    filler_energies: list[float] | None) -> None:
    """The frontier JSON (`Frontier.load` reads it back) with each plan's pipeline swing (and,
    capped, its dummy-work energy, counted in its energy) and the all-max-clock swing."""
    import dataclasses

    frontier.save(path)  # the frontier file as ever (orjson when installed), then its swing added
    try:
        import orjson
    except ImportError:
        import json

        loads, dumps = json.loads, lambda data: json.dumps(data).encode()
    else:
        loads, dumps = orjson.loads, orjson.dumps
    data = loads(Path(path).read_bytes())
    for k, (plan, figures) in enumerate(zip(data["plans"], plan_swings)):
        plan["swing"] = dataclasses.asdict(figures)
        if filler_energies is not None:
            plan["filler_energy"] = filler_energies[k]
    data["power_swing"] = {"reference": dataclasses.asdict(reference), "cap_fraction": cap_fraction}
    Path(path).write_bytes(dumps(data))
